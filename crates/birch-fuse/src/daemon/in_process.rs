//! A filesystem served by the calling process on a real FUSE mount, from background threads
//! (`birch crashtest --fuse`): the same session setup as a mount's daemon, without its image
//! lock, signals or final commit (the caller owns the filesystem and closes it).
//! Must not touch: the filesystem's lifetime (the caller's) or signal handling (a daemon's).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use birch_core::device::CephOptions;
use birch_core::vfs::FsyncMode;
use birch_core::Filesystem;
use fuser::{Config, SessionACL};

use super::mountinfo::canonical;
use super::serve::{fuse_options, kernel_mount, lazy_unmount};
use super::uring_setup::{ring_for, uring_allowed};
use super::{default_threads, MountConfig};
use crate::BirchFuse;

/// A filesystem served by this process on a real FUSE mount (for `birch crashtest --fuse`):
/// the kernel path, its page cache and its request ordering are all in play.
pub struct InProcessMount {
    mountpoint: PathBuf,
    session: Option<std::thread::JoinHandle<std::io::Result<()>>>,
    /// Stops the thread fitting the dirty cap to free space.
    stop_cap: Arc<AtomicBool>,
}

impl InProcessMount {
    /// Mounts `fs` at `mountpoint` and serves it from background threads.
    /// With `caches` false the kernel caches no names or attributes (`ttl=0`) and drops a
    /// file's pages at every open (`keep_cache=off`), as those mount options do; with `uring`
    /// it serves over FUSE over io_uring (falling back to /dev/fuse as a mount does).
    pub fn start(
        fs: Arc<Filesystem>,
        mountpoint: &Path,
        writeback: bool,
        caches: bool,
        uring: bool,
    ) -> Result<InProcessMount, String> {
        let config = MountConfig {
            read_only: false,
            allow_other: false,
            commit_secs: 0,
            threads: default_threads(),
            waiters: crate::DEFAULT_WAITERS,
            ttl_secs: if caches {
                crate::DEFAULT_TTL_SECS as f64
            } else {
                0.0
            },
            vfs_flags: 0,
            atime: None,
            nodiratime: None,
            fsync: FsyncMode::Log,
            errors: Default::default(),
            io_timeout: None,
            writeback,
            keep_cache: caches,
            buffer: true,
            uring: Some(uring),
            compress: None,
            #[cfg(feature = "seed-before")]
            bench_serialize_sync_writes: false,
            #[cfg(feature = "seed-before")]
            bench_global_objectid_lock: false,
            #[cfg(feature = "seed-before")]
            bench_apply_per_item: false,
            ceph: CephOptions::default(),
            snapshot: None,
            faults: Vec::new(),
            fault_seed: None,
        };
        let mut fuse_config = Config::default();
        fuse_config.acl = SessionACL::Owner;
        fuse_config.n_threads = Some(config.threads);
        fuse_config.uring = ring_for(Some(uring), mountpoint, uring_allowed);
        fuse_config.clone_fd = true;
        let fd = kernel_mount(Path::new("crashtest"), mountpoint, &config)
            .map_err(|e| format!("mount on {}: {e}", mountpoint.display()))?;
        let (fuse_opts, dirty_cap) = fuse_options(&config, &fs, mountpoint);
        let adapter = BirchFuse::new(fs.clone(), fuse_opts);
        let notifier_slot = adapter.notifier_slot();
        let session = fuser::Session::from_fd(adapter, fd, SessionACL::Owner, fuse_config)
            .map_err(|e| {
                lazy_unmount(mountpoint);
                format!("FUSE handshake on {}: {e}", mountpoint.display())
            })?;
        let _ = notifier_slot.set(session.notifier());
        let handle = std::thread::spawn(move || session.run());
        let stop_cap = Arc::new(AtomicBool::new(false));
        if let Some(cap) = dirty_cap {
            let (weak, stop) = (Arc::downgrade(&fs), stop_cap.clone());
            std::thread::spawn(move || cap.follow(weak, stop));
        }
        Ok(InProcessMount {
            mountpoint: canonical(mountpoint),
            session: Some(handle),
            stop_cap,
        })
    }

    /// Unmounts and waits for the session threads to end.
    pub fn stop(mut self) {
        self.unmount();
    }

    fn unmount(&mut self) {
        self.stop_cap.store(true, Ordering::Relaxed);
        lazy_unmount(&self.mountpoint);
        if let Some(handle) = self.session.take() {
            let _ = handle.join();
        }
    }
}

impl Drop for InProcessMount {
    fn drop(&mut self) {
        self.unmount();
    }
}
