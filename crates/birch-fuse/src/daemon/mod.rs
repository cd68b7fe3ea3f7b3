//! The mount daemon: what a process serving a birchfs mount does, from mount(2) to its final
//! commit. `serve` opens the image (taking its lock), mounts /dev/fuse, sets up the session
//! (request loops, io_uring rings: [`uring_setup`]), starts the dirty cap's loop
//! (`crate::full_disk`), the signal thread (`signals`) and the control socket
//! ([`control_socket`], `/run/birch/ctl-MAJOR:MINOR.sock`), serves until the last mount of
//! the filesystem is gone, then commits, flushes and releases the image lock before it
//! returns. [`InProcessMount`] serves a filesystem the caller opened (crash tests).
//! Must not touch: option parsing, the fstab / mount.fuse helper glue, daemonizing and
//! `birch umount` (the CLI's, birch-tools `mount.rs`); request handling (the adapter's, the
//! rest of this crate); filesystem logic (birch-core).

pub mod control_socket;
#[cfg(feature = "fault-injection")]
mod faults;
pub mod front_end;
mod in_process;
pub mod mountinfo;
mod serve;
mod signals;
pub mod uring_setup;

use birch_core::device::CephOptions;
use birch_core::vfs::{AtimeMode, FsyncMode};

pub use in_process::InProcessMount;
pub use serve::{kernel_mount, lazy_unmount, serve};

/// Parsed mount options: what the CLI parsed, what the daemon serves with.
#[derive(Debug, Clone)]
pub struct MountConfig {
    /// `ro` (true) or `rw`.
    pub read_only: bool,
    /// `allow_other`: users other than the mounter may use the mount.
    pub allow_other: bool,
    /// `commit=SECS`: background commit interval (0: none).
    pub commit_secs: u64,
    /// `threads=N`: FUSE request loops.
    pub threads: usize,
    /// Requests waiting for the device served at once (`waiters=`).
    pub waiters: usize,
    /// `ttl=SECS`: how long the kernel caches attributes and entries.
    pub ttl_secs: f64,
    /// MS_* flags for mount(2), but for the atime flags ([`MountConfig::atime_flags`]).
    pub vfs_flags: libc::c_ulong,
    /// The last of `noatime`, `relatime` (or `atime`), `strictatime` given, if any: when reads
    /// move atime, which birchfs decides itself (FUSE inodes are `S_NOATIME` in the kernel).
    pub atime: Option<AtimeMode>,
    /// `nodiratime` (true) or `diratime` (false), if given.
    pub nodiratime: Option<bool>,
    /// `fsync=log|commit`.
    pub fsync: FsyncMode,
    /// `errors=continue|remount-ro|panic`: what a device error does.
    pub errors: birch_core::vfs::ErrorPolicy,
    /// `io_timeout=SECS`: a request the device has not answered in that time gives it up
    /// (image files and block devices; `None`: no timeout).
    pub io_timeout: Option<std::time::Duration>,
    /// `writeback=on|off`: the kernel's writeback cache.
    pub writeback: bool,
    /// `keep_cache=on|off`: pages kept across opens.
    pub keep_cache: bool,
    /// The daemon's own write buffer (delayed allocation), `buffer=on|off`.
    pub buffer: bool,
    /// FUSE over io_uring beside /dev/fuse (`uring`, `uring=on|off`, DESIGN §12.5): `None`
    /// (the default) uses it where the kernel allows it (the fuse module's `enable_uring` is
    /// Y), leaving that machine-wide setting to the administrator; `Some(true)` (asked for)
    /// also turns `enable_uring` on, and warns when it cannot have the ring; `Some(false)`
    /// serves over /dev/fuse only.
    pub uring: Option<bool>,
    /// `compress=CODEC`: written data is rewritten compressed before it is committed
    /// (birch-core `OpenOptions::compress`); `None` (`compress=none`, the default): never.
    pub compress: Option<birch_format::codec::Codec>,
    /// Benchmark-only switches, each a seed's "before" (off by default; only with the
    /// `seed-before` feature; docs/BENCHMARKS.md): `bench_serialize_sync_writes`.
    #[cfg(feature = "seed-before")]
    pub bench_serialize_sync_writes: bool,
    /// `bench_global_objectid_lock` (benchmark only, `seed-before` feature).
    #[cfg(feature = "seed-before")]
    pub bench_global_objectid_lock: bool,
    /// `bench_apply_per_item` (benchmark only, `seed-before` feature).
    #[cfg(feature = "seed-before")]
    pub bench_apply_per_item: bool,
    /// Cluster access for an `rbd:` image (`ceph_id=`, `ceph_conf=`, `keyring=`).
    pub ceph: CephOptions,
    /// `snapshot=NAME`: serve that snapshot alone as the mount's root (read-only).
    pub snapshot: Option<String>,
    /// `fault=RULE` (each one given; test builds only, the `fault-injection` feature): rules
    /// of the test kit's fault-injecting device, in `birch_testkit::Rule::parse`'s form,
    /// armed between the image and the filesystem from the mount on. A daemon built without
    /// the feature refuses to serve with any.
    pub faults: Vec<String>,
    /// `fault_seed=N` (test builds only): the seed the fault device draws its chances from,
    /// so a run can be replayed; without it, from the clock (the daemon logs it either way).
    pub fault_seed: Option<u64>,
}

/// Default number of FUSE request loops (`threads=`): one per CPU, at least 2, at most 8.
/// Requests that wait for the device run on the adapter's worker pool (`waiters=`), so the
/// loops only ever do CPU work; more loops than CPUs only add wake-ups of cold threads
/// (DESIGN §12.4: 32 loops made single-thread creates 2-4x slower than 2 on this 2-core VM).
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8))
}

impl MountConfig {
    /// The atime flags for mount(2) (none when no atime option was given: a mount is then
    /// relatime and a remount keeps what it had).
    pub fn atime_flags(&self) -> libc::c_ulong {
        let atime = match self.atime {
            None => 0,
            Some(AtimeMode::NoAtime) => libc::MS_NOATIME,
            Some(AtimeMode::Relatime) => libc::MS_RELATIME,
            Some(AtimeMode::StrictAtime) => libc::MS_STRICTATIME,
        };
        if self.nodiratime == Some(true) {
            atime | libc::MS_NODIRATIME
        } else {
            atime
        }
    }
}
