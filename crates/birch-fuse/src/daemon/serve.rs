//! A mount's daemon from mount(2) to exit: opens the image (its lock held until the end),
//! mounts /dev/fuse as `fuse.birch`, sets up the FUSE session (request loops, io_uring, the
//! adapter's options and the dirty cap from `crate::full_disk`), starts the control socket
//! (`super::control_socket`), serves until the last mount is gone, then removes the socket,
//! commits, flushes and releases the image; and what the device reports (a lost `rbd:` image
//! shuts the filesystem down).
//! Must not touch: request handling (the adapter), option parsing and daemonizing (the CLI).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use birch_core::device::{
    open_image, BlockDevice, DeviceEvents, ImageOptions, OpenMode, RbdSpec, TimeoutDevice,
};
use birch_core::vfs::ShutdownMode;
use birch_core::{Filesystem, OpenOptions, ReadOnlyCause};
use fuser::{Config, SessionACL};

use super::control_socket::{socket_path_for, ControlHandler, ControlSocket};
use super::front_end::{FrontEnd, GONE};
use super::mountinfo::{canonical, mount_device};
use super::signals::{block_signals, wait_for_signal_then_unmount};
use super::uring_setup::{ring_for, uring_allowed};
use super::MountConfig;
use crate::full_disk::{self, DirtyCap};
use crate::{BirchFuse, FuseOptions};

/// Runs the filesystem in this process until unmount or SIGTERM/SIGINT/SIGHUP. An error is
/// what the daemon reports before it exits with status 1 (the image already named in it).
/// `front`: the pipe of the `birch mount` that started this daemon, if one did
/// ([`FrontEnd::from_env`]): the daemon says on it when its mount is live and does not mount
/// once the command is gone ([`super::front_end`]).
pub fn serve(
    image: &Path,
    mountpoint: &Path,
    config: &MountConfig,
    front: Option<FrontEnd>,
) -> Result<(), String> {
    block_signals();
    let options = OpenOptions {
        commit_interval: (config.commit_secs > 0).then(|| Duration::from_secs(config.commit_secs)),
        read_only: config.read_only,
        wait_for_lock: true,
        fsync: config.fsync,
        buffered: config.buffer,
        errors: config.errors,
        #[cfg(feature = "seed-before")]
        bench_global_objectid_lock: config.bench_global_objectid_lock,
        #[cfg(feature = "seed-before")]
        bench_apply_per_item: config.bench_apply_per_item,
        compress: config.compress,
    };
    // An RBD snapshot (`rbd:POOL/IMAGE@SNAP`) cannot be written: it mounts read-only, takes
    // no lock (the image's holder keeps its own), and replays a pending log in memory.
    let snapshot =
        matches!(RbdSpec::from_path(image), Ok(Some(ref spec)) if spec.snapshot.is_some());
    if snapshot && !config.read_only {
        return Err(format!(
            "{}: a snapshot cannot be written: mount it with -o ro",
            image.display()
        ));
    }
    let mode = if snapshot {
        OpenMode::ReadOnlyUnlocked
    } else if config.snapshot.is_some() {
        // Not waiting: the lock's holder is most likely the live mount's daemon.
        OpenMode::ReadOnly
    } else if config.read_only {
        OpenMode::ReadOnlyWait
    } else {
        OpenMode::ReadWriteWait
    };
    let events = Arc::new(MountEvents {
        fs: OnceLock::new(),
        lost: AtomicBool::new(false),
        mountpoint: canonical(mountpoint),
        drop_pages: OnceLock::new(),
    });
    let image_options = ImageOptions {
        ceph: config.ceph.clone(),
        holder: format!("mount at {}", canonical(mountpoint).display()),
        events: Some(events.clone()),
    };
    // Waiting for the image's lock (a mount after umount waits for the final flush; an RBD
    // takeover for the holder's watch): if the mount command goes meanwhile, so does this
    // daemon, instead of mounting when the wait is over.
    if let Some(front) = &front {
        front.watch_while_waiting();
    }
    let opened = open_image(image, mode, &image_options);
    if let Some(front) = &front {
        front.done_waiting();
    }
    // The device's errors name the image already (path or rbd: spec).
    let device = match opened {
        Ok(d) => d,
        Err(e) => {
            return Err(match &config.snapshot {
                Some(name) => format!(
                    "{e}: the image is in use (the daemon of its live mount, or another birch \
                     command, holds its lock); while the filesystem is mounted, snapshot \
                     {name:?} is browsable at MNT/.snapshot/{name} of that mount"
                ),
                None => e.to_string(),
            })
        }
    };
    // Test builds only: the test kit's fault device sits right above the image, armed with
    // the `fault=` rules, and `birch fault` adds more while the mount serves.
    #[cfg(feature = "fault-injection")]
    let (device, fault) = {
        let seed = config.fault_seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
        log::warn!("fault injection: seed {seed} (replay with -o fault_seed={seed})");
        super::faults::arm(device, &config.faults, seed)
            .map_err(|e| format!("{}: {e}", image.display()))?
    };
    #[cfg(not(feature = "fault-injection"))]
    if !config.faults.is_empty() || config.fault_seed.is_some() {
        return Err(format!(
            "{}: fault= rules and fault_seed= need a daemon built with the fault-injection feature",
            image.display()
        ));
    }
    // `io_timeout=`: requests go through a device that gives up one its device has not
    // answered in time (an RBD image has its own watchdog, `rbd_timeout=`).
    let timed = match config.io_timeout {
        Some(timeout) if !matches!(RbdSpec::from_path(image), Ok(Some(_))) => {
            Some(TimeoutDevice::new(device.clone(), timeout))
        }
        _ => None,
    };
    let device: Arc<dyn BlockDevice> = match &timed {
        Some(t) => t.clone(),
        None => device,
    };
    let fs = match Filesystem::open_device(device, options) {
        Ok(fs) => Arc::new(fs),
        Err(e) => return Err(format!("{}: {e}", image.display())),
    };
    events.attach(&fs);
    if let Some(timed) = &timed {
        // A hung device turns the filesystem read-only: the request that hung and every later
        // one that needs the device answer EIO, the rest is served (SEMANTICS §2).
        let weak = Arc::downgrade(&fs);
        let mountpoint = canonical(mountpoint);
        timed.on_give_up(Box::new(move |why| {
            log::error!(
                "{}: {why}; the filesystem is read-only until it is unmounted",
                mountpoint.display()
            );
            if let Some(fs) = weak.upgrade() {
                fs.engine().set_read_only(ReadOnlyCause::DeviceError {
                    error: why.to_string(),
                });
            }
        }));
    }
    if snapshot {
        fs.pin_read_only("it serves an RBD snapshot, which cannot be written");
    }
    if let Some(name) = &config.snapshot {
        if let Err(e) = fs.serve_snapshot_alone(name) {
            return Err(format!("{}: -o snapshot={name}: {e}", image.display()));
        }
        fs.pin_read_only(&format!("it serves snapshot {name:?} alone"));
    }
    fs.set_atime_mode(config.atime.unwrap_or_default());
    let mut fuse_config = Config::default();
    fuse_config.acl = if config.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    fuse_config.n_threads = Some(config.threads);
    fuse_config.clone_fd = true;
    // The kernel offers FUSE_OVER_IO_URING in INIT (sent during mount(2)) only if the fuse
    // module's enable_uring is on; without it no ring is made (its buffers would go unused).
    fuse_config.uring = ring_for(config.uring, mountpoint, uring_allowed);
    if front.as_ref().is_some_and(FrontEnd::gone) {
        let _ = fs.close();
        return Err(GONE.to_string());
    }
    let fuse_fd = match kernel_mount(image, mountpoint, config) {
        Ok(fd) => fd,
        Err(e) => {
            return Err(format!(
                "mount {} on {}: {e}",
                image.display(),
                mountpoint.display()
            ))
        }
    };
    let (fuse_opts, dirty_cap) = fuse_options(config, &fs, mountpoint);
    let adapter = BirchFuse::new(fs.clone(), fuse_opts);
    let dropper = adapter.page_dropper();
    let _ = events
        .drop_pages
        .set(Box::new(move |ino| dropper.drop_pages(ino)));
    let control_handler = adapter.control_handler();
    #[cfg(feature = "fault-injection")]
    let control_handler = super::faults::handler(fault, control_handler);
    let acl = fuse_config.acl;
    let notifier_slot = adapter.notifier_slot();
    let session = match fuser::Session::from_fd(adapter, fuse_fd, acl, fuse_config) {
        Ok(s) => s,
        Err(e) => {
            lazy_unmount(mountpoint);
            return Err(format!(
                "mount {} on {}: FUSE handshake: {e}",
                image.display(),
                mountpoint.display()
            ));
        }
    };
    let _ = notifier_slot.set(session.notifier());
    // Started once the kernel may be told what a command changed (the notifier is set).
    let control = start_control_socket(mountpoint, control_handler);
    let target = canonical(mountpoint);
    let source = canonical(image);
    // The mount is live: the command that started this daemon may report success. If it went
    // in the meantime, nobody asked for this mount any more: it is taken down again (the
    // session then ends at once, and the filesystem closes as at any unmount), and no signal
    // thread is started (its unmount could meet whatever is mounted below at that path).
    let unasked = match front.map(FrontEnd::ready) {
        Some(Err(e)) => {
            log::error!("{GONE} ({e}); unmounting {}", target.display());
            lazy_unmount(&target);
            true
        }
        _ => false,
    };
    if !unasked {
        std::thread::spawn(move || wait_for_signal_then_unmount(&target, &source));
    }
    let stop_cap = Arc::new(AtomicBool::new(false));
    if let Some(cap) = dirty_cap {
        let (weak, stop) = (Arc::downgrade(&fs), stop_cap.clone());
        std::thread::spawn(move || cap.follow(weak, stop));
    }
    let result = session.run();
    stop_cap.store(true, Ordering::Relaxed);
    // No command after the last request: the socket file goes before the final commit.
    drop(control);
    // The kernel connection is gone; commit, flush and release the image lock before exit.
    let closed = fs.close();
    drop(fs);
    if let Err(e) = result {
        return Err(format!("FUSE session ended with an error: {e}"));
    }
    if let Err(e) = closed {
        return Err(format!("final commit failed: {e}"));
    }
    Ok(())
}

/// Starts the control socket of the mount just made at `mountpoint` (see
/// [`control_socket`](super::control_socket) for where it lives). A mount without one still
/// takes commands on the root's control xattr, so a failure is a warning.
fn start_control_socket(mountpoint: &Path, handler: Arc<ControlHandler>) -> Option<ControlSocket> {
    let target = canonical(mountpoint);
    let started = mount_device(&target)
        .ok_or_else(|| {
            std::io::Error::other(format!("{}: not in /proc/self/mountinfo", target.display()))
        })
        .and_then(|(major, minor)| socket_path_for(major, minor))
        .and_then(|path| {
            // SAFETY: geteuid has no preconditions.
            let owner = unsafe { libc::geteuid() };
            ControlSocket::bind(&path, owner, handler)
        });
    match started {
        Ok(socket) => {
            log::debug!("control socket at {}", socket.path().display());
            Some(socket)
        }
        Err(e) => {
            log::warn!(
                "{}: no control socket ({e}); control commands go through the root's \
                 trusted.birch.control xattr only",
                target.display()
            );
            None
        }
    }
}

/// What a mount does when its device reports (an `rbd:` image, DESIGN §14.3): a lost device
/// (lock taken over, client fenced, the cluster not answering within `rbd_timeout=`) shuts the
/// filesystem down, so every request answers EIO, reads included, and has the kernel drop the
/// pages and attributes it cached (those need no request); a snapshot's quiesce commits.
struct MountEvents {
    fs: OnceLock<Weak<Filesystem>>,
    /// The device was lost, maybe before the filesystem was attached.
    lost: AtomicBool,
    mountpoint: PathBuf,
    /// Has the kernel drop an inode's pages and attributes without waiting (set once the
    /// adapter exists: before, the kernel holds nothing).
    drop_pages: OnceLock<Box<dyn Fn(u64) + Send + Sync>>,
}

impl MountEvents {
    fn attach(&self, fs: &Arc<Filesystem>) {
        let _ = self.fs.set(Arc::downgrade(fs));
        if self.lost.load(Ordering::SeqCst) {
            let _ = fs.shutdown(ShutdownMode::Now);
        }
    }
}

impl DeviceEvents for MountEvents {
    fn device_lost(&self, why: &str) {
        self.lost.store(true, Ordering::SeqCst);
        log::error!(
            "{}: the image is lost ({why}); shutting the filesystem down: every request answers EIO until it is unmounted",
            self.mountpoint.display()
        );
        if let Some(fs) = self.fs.get().and_then(Weak::upgrade) {
            if let Err(e) = fs.shutdown(ShutdownMode::Now) {
                log::warn!("{}: shutdown: {e}", self.mountpoint.display());
            }
            // Pages the kernel cached need no request: a file kept open across the takeover
            // (an NFS server's fd cache) would go on reading what the image held before it.
            // Dropped after the shutdown, so that reading them again asks, and gets EIO.
            if let Some(drop_pages) = self.drop_pages.get() {
                for ino in fs.cached_inodes() {
                    drop_pages(ino.get());
                }
            }
        }
    }

    fn lost_in_effect(&self) -> bool {
        self.fs
            .get()
            .and_then(Weak::upgrade)
            .is_none_or(|fs| fs.is_shut_down())
    }

    fn quiesce(&self) -> std::io::Result<()> {
        match self.fs.get().and_then(Weak::upgrade) {
            Some(fs) => fs.sync().map_err(|e| std::io::Error::other(e.to_string())),
            None => Ok(()),
        }
    }
}

/// The adapter's settings for a mount just made at `mountpoint`, and the dirty-page cap to keep
/// (`None` without the writeback cache; see [`full_disk::size_for_mount`]).
pub(crate) fn fuse_options(
    config: &MountConfig,
    fs: &Filesystem,
    mountpoint: &Path,
) -> (FuseOptions, Option<DirtyCap>) {
    let (write_through_below, cap) = full_disk::size_for_mount(fs, mountpoint, config.writeback);
    let options = FuseOptions {
        ttl: Duration::from_secs_f64(config.ttl_secs),
        writeback: config.writeback,
        keep_cache: config.keep_cache,
        write_through_below,
        waiters: config.waiters,
        loops: config.threads,
        #[cfg(feature = "seed-before")]
        bench_serialize_sync_writes: config.bench_serialize_sync_writes,
    };
    (options, cap)
}

/// Mounts /dev/fuse at `mountpoint` as type `fuse.birch` with the image path as source, so
/// that mount(8), /proc/mounts and `mount -o remount` see a birch filesystem (and call
/// mount.fuse.birch). Returns the /dev/fuse descriptor the session serves.
pub fn kernel_mount(
    image: &Path,
    mountpoint: &Path,
    config: &MountConfig,
) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::AsRawFd;
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .map_err(|e| std::io::Error::new(e.kind(), format!("/dev/fuse: {e}")))?;
    // SAFETY: geteuid/getegid have no preconditions.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    let mut data = format!(
        "fd={},rootmode=40000,user_id={uid},group_id={gid},default_permissions",
        dev.as_raw_fd()
    );
    if config.allow_other {
        data.push_str(",allow_other");
    }
    let mut flags = config.vfs_flags | config.atime_flags();
    if config.read_only {
        flags |= libc::MS_RDONLY;
    }
    let cstr = |p: &std::ffi::OsStr| {
        std::ffi::CString::new(p.as_encoded_bytes()).map_err(|_| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "path with a NUL byte")
        })
    };
    let source = cstr(canonical(image).as_os_str())?;
    let target = cstr(canonical(mountpoint).as_os_str())?;
    let fstype = cstr(std::ffi::OsStr::new("fuse.birch"))?;
    let data = cstr(std::ffi::OsStr::new(&data))?;
    // SAFETY: mount(2) with valid NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            flags,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        let hint = if err.raw_os_error() == Some(libc::EPERM) {
            " (mounting needs root or CAP_SYS_ADMIN)"
        } else {
            ""
        };
        return Err(std::io::Error::new(
            err.kind(),
            format!("mount(2): {err}{hint}"),
        ));
    }
    Ok(dev.into())
}

/// umount2(MNT_DETACH) of `mountpoint`: the kernel lets go of it at once.
pub fn lazy_unmount(mountpoint: &Path) {
    if let Ok(c) = std::ffi::CString::new(canonical(mountpoint).as_os_str().as_encoded_bytes()) {
        // SAFETY: umount2 with a valid NUL-terminated path.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use birch_core::device::MemDevice;
    use birch_core::vfs::Caller;
    use birch_core::MkfsOptions;
    use birch_format::InodeNo;

    use super::*;

    /// A lost device shuts the filesystem down and has the kernel drop the cached pages of
    /// every inode it holds (issue 42 item 5: a fenced node's ganesha read them otherwise).
    #[test]
    fn a_lost_device_shuts_down_and_drops_every_held_inodes_pages() {
        let dev = Arc::new(MemDevice::new(64 << 20));
        Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
        let fs = Arc::new(Filesystem::open_device(dev, OpenOptions::default()).expect("open"));
        let (attr, _fh) = fs
            .create(
                Caller::default(),
                InodeNo::new(1),
                b"f",
                0o644,
                libc::O_RDWR,
            )
            .expect("create");
        let events = MountEvents {
            fs: OnceLock::new(),
            lost: AtomicBool::new(false),
            mountpoint: PathBuf::from("/mnt/test"),
            drop_pages: OnceLock::new(),
        };
        events.attach(&fs);
        let dropped = Arc::new(Mutex::new(Vec::new()));
        let seen = dropped.clone();
        let _ = events
            .drop_pages
            .set(Box::new(move |ino| seen.lock().unwrap().push(ino)));
        assert!(!fs.is_shut_down());
        events.device_lost("a test");
        assert!(fs.is_shut_down(), "every request answers EIO");
        assert!(events.lost_in_effect());
        let dropped = dropped.lock().unwrap();
        assert!(
            dropped.contains(&attr.ino.get()),
            "the open file's pages dropped: {dropped:?}"
        );
    }
}
