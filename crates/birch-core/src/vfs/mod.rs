//! The filesystem API: POSIX semantics on the engine, inode-number based and thread-safe.
//!
//! Owns: the in-memory inode table and per-inode locks, lookup and open counts, every
//! namespace, data and xattr operation, orphans, the background committer, the last step of
//! a shutdown ([`Filesystem::shutdown`]; the engine's fence does the stopping), and the errors
//! POSIX callers see (mapped to errno once, in [`crate::Error::errno`]).
//!
//! Must not touch: nodes or blocks directly (it goes through the engine), or any FUSE type;
//! the keys and payloads of inode, link and xattr items (it goes through [`crate::items`]).
//! Locking: an operation locks the inodes it changes, in ascending inode order; it never holds
//! an inode lock across a commit or flush, and it holds the engine's write gate only while it
//! records items in memory. Data I/O of one file happens under that file's lock only.

pub mod acl;
mod buffer;
mod defrag;
mod dir;
mod durability;
pub mod errfiles;
mod file;
mod fsync_rules;
mod snapview;
pub(crate) mod xattr;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use birch_format::items::{InodeItem, Timespec};
use birch_format::{BlockCount, InodeNo, ItemType, Key, BLOCK_SIZE, ROOT_INO, ROOT_OBJECTID};
use parking_lot::{Condvar, Mutex, RwLock};

use crate::control::ControlCommand;
use crate::counters::CachePadded;
use crate::device::{
    create_rbd_image, open_image, BlockDevice, CephOptions, ImageOptions, OpenMode, RbdSpec,
};
use crate::error::{Error, Result};
use crate::items;
use crate::readonly::ReadOnlyCause;
use crate::txn::{Engine, MkfsOptions, OpenHead};

pub use defrag::CompressReport;
pub use dir::DirEntryOut;
pub use durability::{DeferredOutcome, FsyncDone, FsyncMode, LogFull};
pub use file::AtimeMode;
pub use fsync_rules::CommitReason;
pub use snapview::{snapshot_ino, SNAPSHOT_DIR_NAME};

/// Changed items after which the background committer is woken early, bounding memory.
const DELTA_ITEMS_COMMIT: usize = 200_000;
/// Commits [`Filesystem::admit`] makes at most before it answers ENOSPC.
const ADMIT_COMMITS: usize = 3;

/// Options for opening a filesystem.
#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// Background commit interval; `None` commits only on demand.
    pub commit_interval: Option<Duration>,
    /// Open read-only: no writes reach the device.
    pub read_only: bool,
    /// Wait for another process to release the image instead of failing.
    pub wait_for_lock: bool,
    /// How fsync makes a file durable.
    pub fsync: FsyncMode,
    /// Buffered writes (delayed allocation): a write that is neither direct nor synchronous
    /// is kept in memory and written at the next commit, fsync of its file or dirty limit.
    /// Off: every write goes to the device before it returns.
    pub buffered: bool,
    /// What a device error does (`errors=`): see [`ErrorPolicy`].
    pub errors: ErrorPolicy,
    /// Benchmark only, off by default (seed 002's "before"; only with the `seed-before`
    /// feature): one mutex on the object id counter for every create, no batch of ids per
    /// thread ([`Engine::set_bench_global_objectid_lock`]).
    #[cfg(feature = "seed-before")]
    pub bench_global_objectid_lock: bool,
    /// Benchmark only, off by default (seed 003's "before"; only with the `seed-before`
    /// feature): the commit apply deletes and inserts each changed extent item in a descent
    /// of its own ([`Engine::set_bench_apply_per_item`]).
    #[cfg(feature = "seed-before")]
    pub bench_apply_per_item: bool,
    /// Background compression (`compress=`, DESIGN §16.4): written data is rewritten
    /// compressed with this codec before the commit that would record it plainly (the
    /// background committer's, `sync` and the final one). `None` (the default): never.
    pub compress: Option<birch_format::codec::Codec>,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            commit_interval: Some(Duration::from_secs(5)),
            read_only: false,
            wait_for_lock: false,
            fsync: FsyncMode::Log,
            buffered: true,
            errors: ErrorPolicy::Continue,
            #[cfg(feature = "seed-before")]
            bench_global_objectid_lock: false,
            #[cfg(feature = "seed-before")]
            bench_apply_per_item: false,
            compress: None,
        }
    }
}

/// What a device error does (the `errors=` mount option, after ext4's). A failed commit or
/// log write always turns the filesystem read-only (or, with `Panic`, stops the process):
/// the in-memory state is then ahead of the disk. The policy decides what a lost data write
/// does beyond failing its file's fsyncs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ErrorPolicy {
    /// `errors=continue` (the default): the file that lost data fails its fsyncs for ever;
    /// every other file goes on.
    #[default]
    Continue,
    /// `errors=remount-ro`: the first lost data write turns the whole filesystem read-only
    /// (`ReadOnlyCause::DeviceError`), as ext4 does at an error.
    RemountRo,
    /// `errors=panic`: the first lost data write, failed commit or failed log write aborts
    /// the process (a FUSE mount then answers ENOTCONN until unmounted); what was durable
    /// stays, as after a power cut.
    Panic,
}

impl ErrorPolicy {
    /// Parses `continue`, `remount-ro` or `panic`.
    pub fn parse(text: &str) -> Option<ErrorPolicy> {
        match text {
            "continue" => Some(ErrorPolicy::Continue),
            "remount-ro" => Some(ErrorPolicy::RemountRo),
            "panic" => Some(ErrorPolicy::Panic),
            _ => None,
        }
    }
}

/// What a shutdown ([`Filesystem::shutdown`]) makes durable before it stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownMode {
    /// Commit (buffered data too), then stop: everything that returned before survives. What
    /// the `FS_IOC_SHUTDOWN` ioctl does through a mount (its flags never reach the daemon).
    Commit,
    /// Write the fsync records queued so far (fsyncs in flight complete), then stop: what an
    /// fsync acknowledged survives, nothing else since the last commit.
    Log,
    /// Stop now: fsyncs and commits in flight fail unless their I/O already completed;
    /// nothing more reaches the image.
    Now,
}

/// The caller of an operation: ownership of new inodes comes from here.
#[derive(Debug, Clone, Copy, Default)]
pub struct Caller {
    /// User id that owns inodes the caller creates.
    pub uid: u32,
    /// Group id of new inodes, unless the parent directory is set-group-id (then its group).
    pub gid: u32,
    /// The caller's umask, applied here when the kernel leaves it to the filesystem (POSIX
    /// ACL support: a directory's default ACL replaces the umask). 0 when already applied.
    pub umask: u32,
}

/// File type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link.
    Symlink,
    /// Named pipe.
    Fifo,
    /// Unix domain socket.
    Socket,
    /// Character device node; `Attr::rdev` names the device.
    CharDevice,
    /// Block device node; `Attr::rdev` names the device.
    BlockDevice,
}

impl FileKind {
    /// From st_mode.
    pub fn from_mode(mode: u32) -> FileKind {
        match mode & libc::S_IFMT {
            libc::S_IFDIR => FileKind::Dir,
            libc::S_IFLNK => FileKind::Symlink,
            libc::S_IFIFO => FileKind::Fifo,
            libc::S_IFSOCK => FileKind::Socket,
            libc::S_IFCHR => FileKind::CharDevice,
            libc::S_IFBLK => FileKind::BlockDevice,
            _ => FileKind::File,
        }
    }

    /// The d_type of this kind.
    pub fn dtype(self) -> u8 {
        match self {
            FileKind::File => libc::DT_REG,
            FileKind::Dir => libc::DT_DIR,
            FileKind::Symlink => libc::DT_LNK,
            FileKind::Fifo => libc::DT_FIFO,
            FileKind::Socket => libc::DT_SOCK,
            FileKind::CharDevice => libc::DT_CHR,
            FileKind::BlockDevice => libc::DT_BLK,
        }
    }

    /// From a d_type.
    pub fn from_dtype(dtype: u8) -> FileKind {
        match dtype {
            libc::DT_DIR => FileKind::Dir,
            libc::DT_LNK => FileKind::Symlink,
            libc::DT_FIFO => FileKind::Fifo,
            libc::DT_SOCK => FileKind::Socket,
            libc::DT_CHR => FileKind::CharDevice,
            libc::DT_BLK => FileKind::BlockDevice,
            _ => FileKind::File,
        }
    }
}

/// Attributes of an inode, as stat reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attr {
    /// Inode number.
    pub ino: InodeNo,
    /// Size in bytes (st_size); for a symlink, the target's length.
    pub size: u64,
    /// 512-byte blocks allocated.
    pub blocks: u64,
    /// Last access time.
    pub atime: Timespec,
    /// Last data modification time.
    pub mtime: Timespec,
    /// Last status (inode) change time.
    pub ctime: Timespec,
    /// Creation (birth) time.
    pub crtime: Timespec,
    /// File type (the `S_IFMT` part of st_mode).
    pub kind: FileKind,
    /// Permission bits and suid/sgid/sticky (st_mode without the type).
    pub perm: u32,
    /// Hard link count.
    pub nlink: u32,
    /// Owner user id.
    pub uid: u32,
    /// Owner group id.
    pub gid: u32,
    /// Device number of a character or block device node; 0 otherwise.
    pub rdev: u64,
    /// Preferred I/O size in bytes: the filesystem block size.
    pub blksize: u32,
    /// NFS generation of the inode.
    pub generation: u64,
}

/// A time to set: a given one, or now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetTime {
    /// The current time, taken once per operation.
    Now,
    /// This exact time.
    At(Timespec),
}

/// Which attributes to change.
#[derive(Debug, Clone, Default)]
pub struct SetAttr {
    /// New permission bits (`0o7777`; the file type is kept); also updates an access ACL.
    pub mode: Option<u32>,
    /// New owner. A chown of a regular file also clears suid, and sgid as a write would
    /// (see `caller_groups`).
    pub uid: Option<u32>,
    /// New group; clears suid/sgid of a regular file as for `uid`.
    pub gid: Option<u32>,
    /// New size in bytes (truncate or extend with a hole). `IsDir` on a directory,
    /// `Invalid` on a special file, `TooBig` past the maximum file size.
    pub size: Option<u64>,
    /// New access time.
    pub atime: Option<SetTime>,
    /// New modification time.
    pub mtime: Option<SetTime>,
    /// New change time; `None` sets it to now (every setattr moves ctime).
    pub ctime: Option<Timespec>,
    /// With `size`: the caller lacks CAP_FSETID, so the truncate clears suid (and sgid when
    /// group-execute is set or the caller is outside the file's group) and drops
    /// `security.capability`, as Linux does.
    pub kill_privs: bool,
    /// The caller's groups (primary first) when it lacks CAP_FSETID; `None` for a privileged
    /// caller. Decides whether a truncate or chown also drops an sgid bit without
    /// group-execute.
    pub caller_groups: Option<Vec<u32>>,
}

/// Filesystem statistics.
#[derive(Debug, Clone, Copy)]
pub struct StatFs {
    /// Total blocks (of `frsize` bytes) in the device.
    pub blocks: u64,
    /// Free blocks, pinned (freed but not yet committed) blocks excluded.
    pub bfree: u64,
    /// Blocks data may still take: free minus the metadata reserve.
    pub bavail: u64,
    /// Total inode numbers (2^32).
    pub files: u64,
    /// Inode numbers not yet handed out.
    pub ffree: u64,
    /// Block size in bytes.
    pub bsize: u32,
    /// Longest file name in bytes.
    pub namelen: u32,
    /// Fragment size in bytes (the block size; `blocks` counts these).
    pub frsize: u32,
}

/// In-memory state of one inode.
pub(crate) struct InodeState {
    pub(crate) data: RwLock<InodeData>,
    pub(crate) lookups: AtomicU64,
    pub(crate) opens: AtomicU64,
    /// What this inode's fsyncs already put in the log, so the next fsync writes only what
    /// changed since (btrfs logs only new items too).
    pub(crate) logged: Mutex<Logged>,
    /// The running generation of the last copy_file_range that shared blocks from or into
    /// this inode (0: none): until a commit covers it, an fsync commits instead of logging
    /// (DESIGN §15.8), so no log batch names a shared extent before its flag is durable.
    pub(crate) cloned_in: AtomicU64,
}

impl InodeState {
    fn new(item: InodeItem) -> Arc<InodeState> {
        Arc::new(InodeState {
            data: RwLock::new(InodeData {
                item,
                freed: false,
                write_error: false,
                linkable: false,
                xattrs_absent: AtomicU8::new(0),
                dirty: buffer::DirtyBuf::default(),
            }),
            lookups: AtomicU64::new(0),
            opens: AtomicU64::new(0),
            logged: Mutex::new(Logged::default()),
            cloned_in: AtomicU64::new(0),
        })
    }
}

/// The key under which [`Logged::values`] keeps an inode's log-clean mark (its inode item as
/// of the mark): `all` for everything queued, else all but times an fdatasync left out. Past
/// every real item key of the inode.
pub(crate) fn log_clean_key(ino: u64, all: bool) -> Key {
    let mut key = inode_key(InodeNo::new(ino));
    key.offset = if all { u64::MAX } else { u64::MAX - 1 };
    key
}

/// Item values an inode's fsyncs queued, and the ticket of the last batch that carried them.
#[derive(Default)]
pub(crate) struct Logged {
    /// Key -> (value queued, delta generation of its record).
    pub(crate) values: HashMap<Key, (Option<Vec<u8>>, u64)>,
    pub(crate) ticket: u64,
}

pub(crate) struct InodeData {
    pub(crate) item: InodeItem,
    /// The inode's items are gone (freed); the state lingers only for open handles.
    pub(crate) freed: bool,
    /// A data write failed: fsync reports EIO from now on (databases rely on this).
    pub(crate) write_error: bool,
    /// Made by `tmpfile` without `O_EXCL` and never linked yet: `link` may give it a name
    /// although its link count is 0 (Linux's `I_LINKABLE`). An inode whose names were all
    /// removed never is.
    pub(crate) linkable: bool,
    /// xattrs known to be absent ([`xattr::ABSENT_ACL_DEFAULT`] and friends), so the lookups
    /// that every create, write and chmod makes cost a tree search only once per inode.
    /// A bit is set under the read or the write lock (through `&self`), and cleared only
    /// through `&mut self`, that is under the write lock, by every change of the inode's
    /// xattr items: a set bit can never outlive the item it denies.
    pub(crate) xattrs_absent: AtomicU8,
    /// Buffered writes not yet on disk (buffer.rs).
    pub(crate) dirty: buffer::DirtyBuf,
}

const TABLE_SHARDS: usize = 64;

/// One shard of the inode table: inode number → its state, alone on its cache lines.
type TableShard = CachePadded<Mutex<HashMap<u64, Arc<InodeState>>>>;

pub(crate) struct Inner {
    pub(crate) engine: Arc<Engine>,
    table: Vec<TableShard>,
    pub(crate) rename_lock: Mutex<()>,
    /// The running generation of the newest clone (`copy_file_range` that shared blocks), 0
    /// for none: while it is above the committed generation, an fsync whose changes hold a
    /// shared extent commits (the per-inode mark goes with an evicted inode's state).
    pub(crate) last_clone: AtomicU64,
    /// Buffered flushes whose data was lost (a failed write or allocation: the file's fsync
    /// reports it), ever, and as many as `sync` last reported: a sync reports the losses
    /// since the one before, as syncfs(2) reports writeback errors.
    pub(crate) lost_flushes: AtomicU64,
    lost_reported: AtomicU64,
    /// The background committer, while one runs, and its interval.
    committer: Mutex<Option<(JoinHandle<()>, Duration)>>,
    /// `compress=`: the codec written data is rewritten with before it is committed.
    pub(crate) compress: Option<birch_format::codec::Codec>,
    /// Byte ranges of files written since the last compression pass (`defrag.rs`).
    pub(crate) to_compress: Mutex<HashMap<u64, (u64, u64)>>,
    /// The mount's background commit interval (`commit=`, [`OpenOptions::commit_interval`]):
    /// a remount rw that starts the committer uses it, as the open would have.
    commit_interval: Option<Duration>,
    wake: (Mutex<bool>, Condvar),
    stop: AtomicBool,
    next_fh: AtomicU64,
    closed: AtomicBool,
    pub(crate) fsync_mode: FsyncMode,
    /// `errors=`: what a lost data write does beyond its file.
    errors: ErrorPolicy,
    /// Keys some fsync logged that a later fsync of another inode must know of, with an
    /// inode and the generation they were logged in: dir items (the inode the entry names: a
    /// later fsync under the same key would make replay drop that entry while the inode keeps
    /// its name), an inode's refs (the dir index of each name) and dir indexes (the inode they
    /// name), so a name's gone holder can be deleted in the log (durability.rs).
    pub(crate) logged_names: Mutex<HashMap<birch_format::Key, (u64, u64)>>,
    /// The buffered data path's dirty set, limit and drain state (buffer.rs).
    pub(crate) buffers: buffer::Buffers,
    /// When reads move atime: an [`AtimeMode`] as u8 (file.rs).
    pub(crate) atime: AtomicU8,
    /// The last online scrub started by `scrub-start`, running or done.
    scrub: Mutex<Option<crate::scrub::ScrubJob>>,
    /// Why this read-only open may never turn writable (`remount,rw` is refused with it), if
    /// so: a pending log replayed into an in-memory overlay of the device
    /// ([`Filesystem::open_device`]; what it serves is not on the device), or a device that
    /// cannot be written ([`Filesystem::pin_read_only`]).
    pinned_read_only: Mutex<Option<String>>,
    /// Unlinked inodes whose space was freed so far (bumped, and waiters woken, by
    /// `free_inode`): what an operation at ENOSPC waits for while the kernel still holds
    /// unlinked files ([`Filesystem::wait_for_releases`]).
    released: (Mutex<u64>, Condvar),
    /// Regular files in the inode table that may be unlinked and not freed yet: every state
    /// in the table with no names and `freed` unset is here (added where a link count drops
    /// to 0, where a tmpfile is made and where an unlinked inode is loaded; removed where it
    /// is freed, leaves the table or gets a name), so [`Filesystem::release_may_free_space`]
    /// looks at these and not at the whole table. A leaf lock: nothing is taken under it.
    unlinked: Mutex<HashSet<u64>>,
    /// The count of `released` when a wait for releases last ran out with none: no later
    /// wait starts until another unlinked inode is freed (a file kept open on purpose must
    /// not delay every ENOSPC).
    fruitless: Mutex<Option<u64>>,
    /// Whether the calling thread may wait for releases ([`Filesystem::set_release_wait`]);
    /// any thread may when unset.
    release_wait: RwLock<Option<ReleaseWaitGate>>,
    /// Told the inode whose written data was lost (a failed write or flush of it): see
    /// [`Filesystem::set_data_lost_hook`].
    data_lost: RwLock<Option<DataLostHook>>,
    /// The snapshot namespace: `/.snapshot`, open files per snapshot (snapview.rs).
    pub(crate) snaps: snapview::SnapState,
    /// The files this mount found damaged (errfiles.rs).
    pub(crate) error_files: errfiles::ErrorFiles,
}

/// Says whether the calling thread may wait for another request of the embedder (a FUSE
/// RELEASE or FORGET) to free space: see [`Filesystem::set_release_wait`].
pub type ReleaseWaitGate = Arc<dyn Fn() -> bool + Send + Sync>;

/// Told the inode whose written data was lost: see [`Filesystem::set_data_lost_hook`].
pub type DataLostHook = Arc<dyn Fn(InodeNo) + Send + Sync>;

/// How long an operation at ENOSPC waits for unlinked files the kernel still holds to be
/// released and forgotten before it answers ENOSPC ([`Filesystem::wait_for_releases`]).
pub const RELEASE_WAIT: Duration = Duration::from_secs(5);

/// Why a read-only open that replayed a pending log in memory may not turn writable.
const REPLAYED_IN_MEMORY: &str = "its log was replayed in memory, not on the image (it was opened read-only): unmount and mount it read-write";

/// A mounted-or-embedded birchfs filesystem.
pub struct Filesystem {
    pub(crate) inner: Arc<Inner>,
    /// A second handle on the same filesystem made by its own background thread (the
    /// committer): dropping it does not close the filesystem.
    view: bool,
}

/// The time the filesystem stamps on inodes: the one place it takes "now".
///
/// It is the kernel's coarse clock (`CLOCK_REALTIME_COARSE`, one tick: 1 to 10 ms), the clock
/// Linux stamps inode times from (`current_time`). Under a FUSE writeback cache the kernel
/// stamps a file's mtime and ctime itself, and a finer clock here could put a create after a
/// later write in the kernel's time (up to a tick apart), so relatime would skip the first
/// read after the write and statx would show mtime before btime. With one clock a time stamped
/// later, here or in the kernel, is never before an earlier one (SEMANTICS §1). Public so
/// that embedders and tests can compare with the same clock: [`clock`].
pub(crate) fn now() -> Timespec {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec that we own.
    if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) } == 0 {
        return Timespec {
            sec: ts.tv_sec,
            nsec: ts.tv_nsec as u32,
        };
    }
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    Timespec {
        sec: d.as_secs() as i64,
        nsec: d.subsec_nanos(),
    }
}

/// The clock birchfs stamps inode times from (`CLOCK_REALTIME_COARSE`, as the kernel's inode
/// times): an embedder or test that compares its own time with an inode's should read this.
pub fn clock() -> Timespec {
    now()
}

pub(crate) use crate::items::inode_key;

impl Filesystem {
    /// Makes a new filesystem on `device` with an empty root directory.
    pub fn mkfs(device: Arc<dyn BlockDevice>, options: &MkfsOptions) -> Result<()> {
        let t = now();
        let root = InodeItem {
            generation: 1,
            transid: 1,
            nlink: 2,
            mode: libc::S_IFDIR | 0o755,
            next_dir_index: 2,
            atime: t,
            mtime: t,
            ctime: t,
            otime: t,
            ..Default::default()
        };
        Engine::create(
            device,
            options,
            vec![(inode_key(InodeNo::new(ROOT_OBJECTID)), root.encode())],
        )?;
        Ok(())
    }

    /// Makes a new filesystem in an image file (created or extended to `size_bytes` when
    /// given) or on a block device.
    /// An `rbd:POOL/IMAGE` path names a Ceph RBD image (created with `size_bytes` when it
    /// does not exist; cluster access from the environment, as `rbd` has it).
    pub fn mkfs_path(path: &Path, size_bytes: Option<u64>, options: &MkfsOptions) -> Result<()> {
        if let Some(spec) = RbdSpec::from_path(path).map_err(|e| Error::io("mkfs", e))? {
            if let Some(size) = size_bytes {
                create_rbd_image(&spec, size, &CephOptions::default())
                    .map_err(|e| Error::io("mkfs", e))?;
            }
        } else if let Some(size) = size_bytes {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .truncate(false)
                .open(path)
                .map_err(|e| Error::io(format!("{}: create image", path.display()), e))?;
            let meta = file
                .metadata()
                .map_err(|e| Error::io(format!("{}: stat", path.display()), e))?;
            if meta.is_file() && meta.len() < size {
                file.set_len(size)
                    .map_err(|e| Error::io(format!("{}: set size {size}", path.display()), e))?;
            }
        }
        let device = open_image(path, OpenMode::ReadWrite, &ImageOptions::default())
            .map_err(|e| Error::io("mkfs", e))?;
        Filesystem::mkfs(device, options)
    }

    /// Opens the filesystem in an image file, on a block device or (`rbd:POOL/IMAGE`, with
    /// cluster access from the environment) on a Ceph RBD image.
    pub fn open(path: &Path, options: OpenOptions) -> Result<Filesystem> {
        let mode = match (options.read_only, options.wait_for_lock) {
            (true, false) => OpenMode::ReadOnly,
            (true, true) => OpenMode::ReadOnlyWait,
            (false, true) => OpenMode::ReadWriteWait,
            (false, false) => OpenMode::ReadWrite,
        };
        let device = open_image(path, mode, &ImageOptions::default())
            .map_err(|e| Error::io("open image", e))?;
        Filesystem::open_device(device, options)
    }

    /// Opens the filesystem on any device; reclaims orphans left by a crash. A read-only open
    /// of a device whose fsync log still holds batches (a crash after fsyncs) shows what a
    /// writable open would: the log is replayed and committed into an in-memory overlay of the
    /// device, as `fsck` checks it ([`crate::check::check_replayed`]), and the device itself
    /// is left untouched, its log waiting for the next writable open.
    ///
    /// Engine opens (each a walk of the whole tree): one for a read-only open without a
    /// pending log; two with one, both over the overlay: the writable open that replays the
    /// log, and the reopen after the replay's commit that rebuilds the free-space map from
    /// the new tree (as a writable open of the device does), which reclaims orphans, commits
    /// and then serves, turned read-only. The superblock and the log are read once, before
    /// either (`OpenHead`).
    pub fn open_device(device: Arc<dyn BlockDevice>, options: OpenOptions) -> Result<Filesystem> {
        if !options.read_only {
            return Filesystem::open_device_once(device, options);
        }
        let head = OpenHead::read(&*device)?;
        if !head.log_pending() {
            return Filesystem::with_engine(Engine::open_from(device, head)?, options);
        }
        let overlay: Arc<dyn BlockDevice> = Arc::new(crate::device::OverlayDevice::new(device));
        let fs = Filesystem::with_engine(
            Engine::open_from(overlay, head)?,
            OpenOptions {
                read_only: false,
                commit_interval: None,
                ..options
            },
        )?;
        // What closing the replaying filesystem committed before (with_engine reclaimed the
        // orphans), then the read-only state a read-only open starts in, kept for good.
        fs.commit_now()?;
        fs.inner.engine.set_read_only(ReadOnlyCause::Mounted);
        *fs.inner.pinned_read_only.lock() = Some(REPLAYED_IN_MEMORY.to_string());
        Ok(fs)
    }

    /// [`Filesystem::open_device`] without the in-memory replay.
    fn open_device_once(device: Arc<dyn BlockDevice>, options: OpenOptions) -> Result<Filesystem> {
        let engine = Engine::open(device)?;
        Filesystem::with_engine(engine, options)
    }

    /// The rest of [`Filesystem::open_device`] over an opened engine.
    fn with_engine(engine: Arc<Engine>, options: OpenOptions) -> Result<Filesystem> {
        let device_bytes = engine.base_device().size_bytes();
        let unknown_ro =
            engine.superblock().ro_compat & !birch_format::superblock::RO_COMPAT_SUPPORTED;
        if unknown_ro != 0 && !options.read_only {
            return Err(Error::ReadOnly(ReadOnlyCause::UnknownRoCompat {
                flags: unknown_ro,
            }));
        }
        if options.read_only {
            engine.set_read_only(ReadOnlyCause::Mounted);
        }
        engine.abort_on_failure(options.errors == ErrorPolicy::Panic);
        #[cfg(feature = "seed-before")]
        {
            engine.set_bench_global_objectid_lock(options.bench_global_objectid_lock);
            engine.set_bench_apply_per_item(options.bench_apply_per_item);
        }
        let inner = Arc::new(Inner {
            engine,
            table: (0..TABLE_SHARDS)
                .map(|_| CachePadded(Mutex::new(HashMap::new())))
                .collect(),
            rename_lock: Mutex::new(()),
            last_clone: AtomicU64::new(0),
            lost_flushes: AtomicU64::new(0),
            lost_reported: AtomicU64::new(0),
            committer: Mutex::new(None),
            compress: options
                .compress
                .filter(|c| *c != birch_format::codec::Codec::None),
            to_compress: Mutex::new(HashMap::new()),
            commit_interval: options.commit_interval,
            wake: (Mutex::new(false), Condvar::new()),
            stop: AtomicBool::new(false),
            next_fh: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            fsync_mode: options.fsync,
            errors: options.errors,
            logged_names: Mutex::new(HashMap::new()),
            buffers: buffer::Buffers::new(options.buffered, device_bytes),
            atime: AtomicU8::new(AtimeMode::Relatime as u8),
            scrub: Mutex::new(None),
            pinned_read_only: Mutex::new(None),
            released: (Mutex::new(0), Condvar::new()),
            unlinked: Mutex::new(HashSet::new()),
            fruitless: Mutex::new(None),
            release_wait: RwLock::new(None),
            data_lost: RwLock::new(None),
            snaps: snapview::SnapState::default(),
            error_files: errfiles::ErrorFiles::default(),
        });
        let fs = Filesystem { inner, view: false };
        match fs.getattr(ROOT_INO) {
            Ok(_) => {}
            Err(Error::NotFound(_)) => {
                return Err(Error::corrupt(
                    "open: root directory (inode 1) is missing",
                    birch_format::FormatError::invalid(
                        format!("inode {ROOT_OBJECTID} of the fs tree"),
                        "no inode item",
                        "the root directory's inode item",
                    ),
                ))
            }
            Err(e) => return Err(e),
        }
        if !options.read_only {
            fs.inner.engine.log().erase_rejected_batch()?;
            if fs.replay_log()? {
                // The replay committed; reopen so the free-space map is rebuilt from the new
                // tree (the extents the log replaced are free again).
                let device = fs.inner.engine.base_device().clone();
                fs.close()?;
                drop(fs);
                return Filesystem::open_device_once(device, options);
            }
            fs.reclaim_orphans()?;
            if let Some(interval) = options.commit_interval {
                fs.start_committer(interval);
            }
        }
        Ok(fs)
    }

    /// Keeps this filesystem read-only for good: `remount,rw` is refused, saying `why` (for a
    /// device that cannot be written, such as an RBD snapshot).
    pub fn pin_read_only(&self, why: &str) {
        *self.inner.pinned_read_only.lock() = Some(why.to_string());
    }

    fn start_committer(&self, interval: Duration) {
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        let handle = std::thread::Builder::new()
            .name("birch-commit".into())
            .spawn(move || loop {
                let Some(inner) = weak.upgrade() else { return };
                {
                    let (lock, cvar) = &inner.wake;
                    let mut woken = lock.lock();
                    if !*woken && !inner.stop.load(Ordering::SeqCst) {
                        cvar.wait_for(&mut woken, interval);
                    }
                    *woken = false;
                }
                if inner.stop.load(Ordering::SeqCst) || inner.engine.is_shut_down() {
                    return;
                }
                let fs = Filesystem { inner, view: true };
                fs.compress_written();
                if let Err(e) = fs.commit_now() {
                    log::error!("background commit failed: {e}");
                }
            });
        match handle {
            Ok(h) => *self.inner.committer.lock() = Some((h, interval)),
            Err(e) => log::error!("cannot start the background committer: {e}"),
        }
    }

    /// The interval of the background committer, if one runs.
    pub fn committer_interval(&self) -> Option<Duration> {
        self.inner
            .committer
            .lock()
            .as_ref()
            .map(|(_, interval)| *interval)
    }

    /// The engine under this filesystem.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.inner.engine
    }

    /// Commits everything now (`birch sync`). Fails with `StickyIo` when the buffered data
    /// of some file was lost since the last `sync` (at this commit or before it:
    /// that file's fsync reports EIO every time), as syncfs(2) reports a writeback error once
    /// to each caller after it: a successful sync means every file written before it is
    /// durable. The commit itself is made either way.
    pub fn sync(&self) -> Result<()> {
        self.compress_written();
        self.commit_now()?;
        self.report_lost_data("sync")
    }

    /// `StickyIo` if buffered data was lost since the last report (see [`Filesystem::sync`]).
    fn report_lost_data(&self, what: &str) -> Result<()> {
        let now = self.inner.lost_flushes.load(Ordering::SeqCst);
        let before = self.inner.lost_reported.swap(now, Ordering::SeqCst);
        if now == before {
            return Ok(());
        }
        Err(Error::StickyIo(format!(
            "{what}: the buffered data of {} file flushes could not be written since the last \
             sync (the log names the inodes; their fsync reports EIO)",
            now.wrapping_sub(before)
        )))
    }

    /// Makes snapshot `name` of the filesystem as it is now: the request is queued, then the
    /// filesystem's commit writes buffered data and takes the snapshot with its tree
    /// (DESIGN §15, SEMANTICS §9). Never the engine's commit alone: it would record buffered
    /// writes' sizes without their data (found by the crash matrix's snapshot workload).
    /// Refused (`Exists`) while the root has a real entry `.snapshot`, the name the
    /// snapshots are shown under (an image made by an older build), and on a read-only
    /// filesystem (as while a snapshot is served alone).
    pub fn create_snapshot(&self, name: &str) -> Result<crate::snapshot::Snapshot> {
        self.check_snapshot_dir_free()?;
        self.inner.engine.queue_snapshot_create(name)?;
        self.commit_now()?;
        self.inner.engine.made_snapshot(name)
    }

    /// Deletes snapshot `name`: queued, then the filesystem's commit (as for
    /// [`Filesystem::create_snapshot`]) drops it and gives back what only it held. `Busy`
    /// (`EBUSY`) while a file is open in it (under `/.snapshot/NAME`) or it is served alone.
    pub fn delete_snapshot(&self, name: &str) -> Result<crate::snapshot::Snapshot> {
        self.delete_snapshot_unless_busy(name)
    }

    /// Every counter of the engine and the device, as one JSON object (the live-mount stats
    /// interface: `getfattr -n trusted.birch.stats MNT`, which `birch stats` reads), then the
    /// fault counters (`device_read_errors`, `device_write_errors`, `device_flush_errors`:
    /// requests the device failed since the mount; `lost_data_flushes`: buffered flushes
    /// whose data was lost, their files' fsyncs failing; `lifetime_device_read_errors`,
    /// `lifetime_device_write_errors`, `lifetime_device_flush_errors` and
    /// `lifetime_checksum_errors`: the same over the filesystem's life, as the superblock keeps
    /// them), the gauge `read_only_failure` (1
    /// when a failure made the filesystem read-only) and, while it is read-only, the string
    /// `read_only_cause` (why); the
    /// gauges: `dirty_bytes` (buffered, not yet written), `log_used_bytes` of
    /// `log_size_bytes`, `free_bytes` (what statfs calls available) of `size_bytes`,
    /// `shared_bytes` (blocks that more than one extent names, by clones, each once), and the
    /// commit and fsync latency histograms as arrays of [`LATENCY_BUCKETS`] counts
    /// (`commit_latency_us_log2`, `fsync_latency_us_log2`; bucket i counts 2^i to
    /// 2^(i+1) - 1 µs).
    ///
    /// [`LATENCY_BUCKETS`]: crate::counters::LATENCY_BUCKETS
    pub fn stats_json(&self) -> String {
        let device_names = ["device_reads", "device_writes", "bytes_written", "flushes"];
        let engine = self.inner.engine.counters().values();
        let device = self.inner.engine.device().counters().values();
        let mut parts: Vec<String> = engine
            .pairs()
            .into_iter()
            .filter(|(n, _)| !device_names.contains(n))
            .map(|(n, v)| format!("\"{n}\": {v}"))
            .collect();
        parts.extend(
            device
                .pairs()
                .into_iter()
                .filter(|(n, _)| device_names.contains(n))
                .map(|(n, v)| format!("\"{n}\": {v}")),
        );
        let engine = &self.inner.engine;
        let (log_used, log_size) = engine.log().fill_bytes();
        let statfs = self.statfs();
        let block = u64::from(statfs.bsize);
        let gauges = [
            ("dirty_bytes", self.inner.buffers.dirty_bytes()),
            ("log_used_bytes", log_used),
            ("log_size_bytes", log_size),
            ("free_bytes", statfs.bavail.saturating_mul(block)),
            ("size_bytes", statfs.blocks.saturating_mul(block)),
            // Blocks more than one extent names (clones), each once: statfs counts them once.
            (
                "shared_bytes",
                engine
                    .allocator()
                    .shared_blocks()
                    .get()
                    .saturating_mul(block),
            ),
        ];
        parts.extend(gauges.iter().map(|(n, v)| format!("\"{n}\": {v}")));
        // Faults: what the device failed since the mount, the buffered flushes whose data was
        // lost, and whether a failure turned the filesystem read-only (a gauge, 0 or 1).
        let errors = engine.device_errors();
        let lifetime = engine.device_stats();
        let failed = engine.read_only_cause().is_some_and(|c| !c.is_chosen());
        for (name, value) in [
            ("device_read_errors", errors.reads.load(Ordering::Relaxed)),
            ("device_write_errors", errors.writes.load(Ordering::Relaxed)),
            (
                "device_flush_errors",
                errors.flushes.load(Ordering::Relaxed),
            ),
            (
                "lost_data_flushes",
                self.inner.lost_flushes.load(Ordering::Relaxed),
            ),
            ("read_only_failure", u64::from(failed)),
            // Over the filesystem's life (kept in the superblock by each commit).
            ("lifetime_device_read_errors", lifetime.read_errors),
            ("lifetime_device_write_errors", lifetime.write_errors),
            ("lifetime_device_flush_errors", lifetime.flush_errors),
            ("lifetime_checksum_errors", lifetime.checksum_errors),
        ] {
            parts.push(format!("\"{name}\": {value}"));
        }
        // Why it is read-only, as text (absent while writable).
        if let Some(cause) = engine.read_only_cause() {
            parts.push(format!(
                "\"read_only_cause\": {}",
                crate::scrub::json_string(&cause.to_string())
            ));
        }
        for (name, histogram) in [
            ("commit_latency_us_log2", engine.commit_latency()),
            ("fsync_latency_us_log2", engine.fsync_latency()),
        ] {
            let buckets: Vec<String> = histogram
                .values()
                .buckets
                .iter()
                .map(u64::to_string)
                .collect();
            parts.push(format!("\"{name}\": [{}]", buckets.join(", ")));
        }
        format!("{{{}}}", parts.join(", "))
    }

    /// Control commands from the mount helper (`trusted.birch.control` on the root): `ro`
    /// commits and stops writing (remount,ro), `rw` allows writes again (remount,rw), `sync`
    /// commits, `shutdown`, `shutdown-log` and `shutdown-now` shut down
    /// ([`Filesystem::shutdown`] with [`ShutdownMode::Commit`], `Log` or `Now`),
    /// `scrub-start [rate=BYTES_PER_SEC]` starts an online scrub in a thread of its own
    /// (`EBUSY` while one runs; rate 0 is unlimited, none is
    /// [`crate::scrub::ONLINE_RATE_DEFAULT_BYTES_PER_SEC`]), `scrub-cancel` stops it; its
    /// progress and report are [`Filesystem::scrub_status`]. `snapshot-create NAME` and
    /// `snapshot-delete NAME` make and delete a snapshot ([`Filesystem::create_snapshot`],
    /// [`Filesystem::delete_snapshot`]); [`Filesystem::snapshots_text`] lists them.
    /// The command's wire string is parsed by [`ControlCommand::parse`].
    pub fn control(&self, command: &[u8]) -> Result<()> {
        self.inner.engine.check_up()?;
        match ControlCommand::parse(command)? {
            ControlCommand::Shutdown => self.shutdown(ShutdownMode::Commit),
            ControlCommand::ShutdownLog => self.shutdown(ShutdownMode::Log),
            ControlCommand::ShutdownNow => self.shutdown(ShutdownMode::Now),
            ControlCommand::ReadOnly => {
                // Buffered data first (it cannot be recorded once read-only); then read-only,
                // so no change slips in between; then commit what is there.
                self.commit_now()?;
                self.inner.engine.set_read_only(ReadOnlyCause::Remounted);
                self.commit_now().map(|_| ())
            }
            ControlCommand::ReadWrite => {
                if self.inner.engine.log().replay_pending() {
                    return Err(Error::Invalid("the log of this image was not replayed (it was opened read-only): unmount and mount it read-write".into()));
                }
                if let Some(why) = self.inner.pinned_read_only.lock().clone() {
                    return Err(Error::Invalid(format!("this mount stays read-only: {why}")));
                }
                self.inner.engine.clear_read_only()?;
                // A mount that started read-only has no committer: start it with the mount's
                // own interval (none: commits only on demand, as a writable open would).
                if let Some(interval) = self.inner.commit_interval {
                    if self.inner.committer.lock().is_none() {
                        self.start_committer(interval);
                    }
                }
                Ok(())
            }
            ControlCommand::Sync => self.sync(),
            ControlCommand::ErrorsClear => {
                self.clear_errors();
                self.sync()
            }
            ControlCommand::ScrubCancel => {
                if let Some(job) = self.inner.scrub.lock().as_ref() {
                    job.cancel();
                }
                Ok(())
            }
            ControlCommand::ScrubStart { rate, resume } => self.scrub_start(rate, resume),
            ControlCommand::SnapshotCreate(name) => self.create_snapshot(&name).map(|_| ()),
            ControlCommand::SnapshotDelete(name) => self.delete_snapshot(&name).map(|_| ()),
            ControlCommand::Atime(mode) => {
                self.set_atime_mode(mode);
                Ok(())
            }
            // The device below is the daemon's business: one built with fault injection
            // answers this before it reaches the filesystem.
            ControlCommand::Fault(_) => Err(Error::NotSupported(
                "fault injection: this daemon was built without the fault-injection feature \
                 (test builds only)"
                    .into(),
            )),
        }
    }

    /// Starts an online scrub at `rate` bytes per second, `None` unlimited, from `resume` or
    /// the start (control command `scrub-start [rate=BYTES_PER_SEC] [resume=POSITION]`).
    fn scrub_start(
        &self,
        rate: Option<u64>,
        resume: Option<crate::scrub::ScrubPosition>,
    ) -> Result<()> {
        let mut slot = self.inner.scrub.lock();
        if slot.as_ref().is_some_and(|job| job.is_running()) {
            return Err(Error::Busy(
                "scrub-start: a scrub is already running".into(),
            ));
        }
        let views = Arc::new(crate::scrub::EngineViews::new(self.inner.engine.clone()));
        let job = crate::scrub::ScrubJob::start(
            views,
            crate::scrub::ScrubOptions {
                rate_bytes_per_sec: rate,
                resume_from: resume,
            },
        )?;
        *slot = Some(job);
        Ok(())
    }

    /// The online scrub's status as JSON ([`crate::scrub::ScrubJob::status_json`]), or
    /// `{"state": "idle"}` when none was started since the mount.
    pub fn scrub_status(&self) -> String {
        match self.inner.scrub.lock().as_ref() {
            Some(job) => job.status_json(),
            None => "{\"state\": \"idle\"}".to_string(),
        }
    }

    /// Discards the free space in device bytes `[start, start + len)`, in free runs of at
    /// least `minlen` bytes, and returns the bytes discarded (`fstrim`, the `FITRIM` ioctl
    /// through a mount; [`Engine::trim`](crate::txn::Engine::trim), SEMANTICS §8).
    pub fn trim(&self, start: u64, len: u64, minlen: u64) -> Result<u64> {
        let trimmed = self.inner.engine.trim(start, len, minlen)?;
        log::info!(
            "trim: {trimmed} bytes of free space discarded in {start:#x}+{len:#x} (runs of {minlen} bytes at least)"
        );
        Ok(trimmed)
    }

    /// Shuts the filesystem down (`birch shutdown`, the `FS_IOC_SHUTDOWN` ioctl through a
    /// mount): after it every operation fails with [`Error::Shutdown`] (`EIO`) and nothing
    /// more reaches the image, not even buffered data (it is dropped) or a commit at
    /// [`Filesystem::close`]. What the image then holds is what a power cut at this moment
    /// would leave, after `mode`'s last step; the next open replays the log as after a crash.
    /// The filesystem is shut down even when that step fails; its error is returned. A
    /// second shutdown does nothing and returns `Ok`.
    pub fn shutdown(&self, mode: ShutdownMode) -> Result<()> {
        if self.inner.engine.is_shut_down() {
            return Ok(());
        }
        let last_step = match mode {
            ShutdownMode::Commit => self.commit_now().map(|_| ()),
            ShutdownMode::Log => self.inner.engine.log().flush().map(|_| ()),
            ShutdownMode::Now => Ok(()),
        };
        self.inner.engine.shut_down();
        self.inner.stop.store(true, Ordering::SeqCst);
        self.wake_committer();
        if let Err(e) = &last_step {
            log::error!("shutdown ({mode:?}): the last step before it failed: {e}");
        }
        last_step
    }

    /// Whether the filesystem was shut down ([`Filesystem::shutdown`]).
    pub fn is_shut_down(&self) -> bool {
        self.inner.engine.is_shut_down()
    }

    /// Drops the filesystem as a power cut would: the background committer is stopped (a
    /// commit it has begun completes, as one could before a real cut), then nothing more is
    /// written: no orphan reclaim, no final commit. Crash tests use this rather than leaking
    /// the filesystem, and with it the device, through `mem::forget`.
    pub fn power_cut(self) {
        self.inner.closed.store(true, Ordering::SeqCst);
        self.inner.stop.store(true, Ordering::SeqCst);
        if let Some(mut job) = self.inner.scrub.lock().take() {
            job.stop();
        }
        {
            let (lock, cvar) = &self.inner.wake;
            *lock.lock() = true;
            cvar.notify_all();
        }
        if let Some((handle, _)) = self.inner.committer.lock().take() {
            let _ = handle.join();
        }
        // Drop runs `close`, which finds `closed` set and returns at once.
    }

    /// Frees inodes without names that nothing holds open, then commits and stops the
    /// committer. Idempotent; also run on drop.
    pub fn close(&self) -> Result<()> {
        if self.inner.closed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        self.inner.stop.store(true, Ordering::SeqCst);
        {
            let (lock, cvar) = &self.inner.wake;
            *lock.lock() = true;
            cvar.notify_all();
        }
        if let Some((handle, _)) = self.inner.committer.lock().take() {
            let _ = handle.join();
        }
        if self.inner.engine.is_shut_down() {
            // Nothing more may reach the image: no orphan reclaim, no final commit. The next
            // open replays the log and frees the orphans.
            return Ok(());
        }
        if self.inner.engine.read_only_reason().is_none() {
            // The kernel sends no forgets at unmount: orphans of open-then-unlinked files go now.
            self.reclaim_orphans()?;
        }
        self.compress_written();
        // The final commit does not report data lost since the last sync: the files that
        // lost it have failed their fsyncs, and an unmount has no caller to tell.
        self.commit_now().map(|_| ())
    }

    /// Wakes the committer if the delta has grown large. Counting the delta reads a line of
    /// every shard, so each thread looks only on every 32nd call (the threshold is far above
    /// what 32 operations add).
    pub(crate) fn maybe_commit(&self) {
        thread_local! {
            static CALLS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
        }
        let call = CALLS.with(|c| {
            let n = c.get().wrapping_add(1);
            c.set(n);
            n
        });
        if call % 32 == 0 && self.inner.engine.pending_items() > DELTA_ITEMS_COMMIT {
            self.wake_committer();
        }
    }

    /// Lets an operation change metadata only if the next commit can still be written:
    /// without this, a filesystem filled with small files or xattrs (pure metadata) accepts
    /// changes until a commit runs out of space, fails, and turns the filesystem read-only
    /// with every change since the last commit lost. `grows`: the operation adds items (a
    /// create, link, rename, xattr, write); it must leave half the metadata reserve, which
    /// deletes (`grows` false) may use, so a full filesystem can always be emptied. When the
    /// changes so far leave too little room the operation commits first (the commit frees
    /// pinned space and empties the delta) and asks again; ENOSPC when even that is not
    /// enough. Above half the room the committer is woken, so the commit comes early and in
    /// the background. Call with no lock held (it may commit).
    pub(crate) fn admit(&self, grows: bool) -> Result<()> {
        let engine = &self.inner.engine;
        let alloc = engine.allocator();
        let keep = if grows {
            BlockCount::new(alloc.metadata_reserve_blocks().get() / 2)
        } else {
            BlockCount::new(0)
        };
        if engine.metadata_fits(keep) {
            let room = alloc.free_blocks().saturating_sub(alloc.reserved_blocks());
            let twice = BlockCount::new(engine.commit_estimate_blocks().get().saturating_mul(2));
            if twice + keep > room {
                self.wake_committer();
            }
            return Ok(());
        }
        // One commit is not always enough: the committer this call (or another) woke may start
        // a commit of its own right after ours, and while it runs its delta is counted with
        // ours (each with its top nodes); a FORGET's orphan reclaim or another delete may
        // refill the delta meanwhile, and the space they free is pinned until the next
        // commit. Commit again while a commit still has something to do, a few times at most;
        // a filesystem that is full with nothing pending answers ENOSPC after one.
        for _ in 0..ADMIT_COMMITS {
            engine.counters().add(|c| &c.metadata_full_commits, 1);
            self.commit_now()?;
            if engine.metadata_fits(keep) {
                return Ok(());
            }
            if engine.pending_items() == 0
                && !engine.commit_in_flight()
                && alloc.pinned_blocks().get() == 0
            {
                break;
            }
        }
        Err(Error::NoSpace(format!(
            "no room for more metadata: {} blocks free, {} kept for deletes and the commit",
            alloc.free_blocks(),
            keep + engine.commit_estimate_blocks()
        )))
    }

    /// Wakes the background committer now.
    pub(crate) fn wake_committer(&self) {
        let (lock, cvar) = &self.inner.wake;
        *lock.lock() = true;
        cvar.notify_one();
    }

    /// The inodes the in-memory table holds. Every inode the kernel holds (looked up or open),
    /// so every one it may have cached pages or attributes of, is among them: a mount whose
    /// device was lost has the kernel drop those (DESIGN §14.3).
    pub fn cached_inodes(&self) -> Vec<InodeNo> {
        let mut inodes = Vec::new();
        for shard in self.inner.table.iter() {
            inodes.extend(shard.lock().keys().map(|&ino| InodeNo::new(ino)));
        }
        inodes
    }

    fn shard(&self, ino: u64) -> &Mutex<HashMap<u64, Arc<InodeState>>> {
        &self.inner.table[crate::delta::batch_shard(ino, TABLE_SHARDS)]
    }

    /// The in-memory state of `ino`, loading the inode item on first use.
    pub(crate) fn inode(&self, ino: u64) -> Result<Arc<InodeState>> {
        self.inner.engine.check_up()?;
        if let Some(state) = self.shard(ino).lock().get(&ino) {
            return Ok(state.clone());
        }
        let item = items::get_inode(&*self.inner.engine, InodeNo::new(ino))?
            .ok_or_else(|| Error::NotFound(format!("inode {ino}")))?;
        let unlinked = item.nlink == 0;
        let state = InodeState::new(item);
        let mut shard = self.shard(ino).lock();
        let state = shard.entry(ino).or_insert(state).clone();
        drop(shard);
        if unlinked {
            // An orphan loaded again (at mount, or after its state left the table).
            self.note_unlinked(ino, &state.data.read().item);
        }
        Ok(state)
    }

    /// Notes that `item` of `ino` (in the inode table) may have no names left: a regular
    /// file with link count 0 joins the set [`Filesystem::release_may_free_space`] looks at.
    pub(crate) fn note_unlinked(&self, ino: u64, item: &InodeItem) {
        if item.nlink == 0 && item.mode & libc::S_IFMT == libc::S_IFREG {
            self.inner.unlinked.lock().insert(ino);
        }
    }

    /// `ino` was freed, left the inode table or got a name: out of the unlinked set.
    pub(crate) fn drop_unlinked(&self, ino: u64) {
        self.inner.unlinked.lock().remove(&ino);
    }

    /// Registers a new inode's state (create paths).
    pub(crate) fn insert_inode(&self, ino: u64, item: InodeItem) -> Arc<InodeState> {
        let state = InodeState::new(item);
        self.shard(ino).lock().insert(ino, state.clone());
        state
    }

    fn evict_if_unused(&self, ino: u64) -> Result<()> {
        if self.inner.engine.is_shut_down() {
            // Its buffered data is dropped with the filesystem; nothing is written.
            return Ok(());
        }
        // Buffered data of a file with names goes to disk while its state is still in the
        // table: a lookup that raced the eviction would otherwise load a state whose size
        // covers data still in the old state's buffer.
        let present = self.shard(ino).lock().get(&ino).cloned();
        if let Some(state) = present {
            let unused = state.lookups.load(Ordering::SeqCst) == 0
                && state.opens.load(Ordering::SeqCst) == 0;
            let buffered = {
                let data = state.data.read();
                data.item.nlink > 0 && !data.dirty.is_empty()
            };
            if unused && buffered {
                let mut data = state.data.write();
                self.flush_locked(ino, &mut data)?;
            }
        }
        let state = {
            let mut shard = self.shard(ino).lock();
            let Some(state) = shard.get(&ino) else {
                return Ok(());
            };
            if state.lookups.load(Ordering::SeqCst) > 0 || state.opens.load(Ordering::SeqCst) > 0 {
                return Ok(());
            }
            let state = state.clone();
            shard.remove(&ino);
            // Out of the table: no longer a state whose release may free space (freed
            // below, or loaded, and noted, again). Under the shard's lock, so a load of the
            // inode racing this eviction notes it after this, not before (the set's lock is
            // taken under a shard's, never the other way round).
            self.drop_unlinked(ino);
            state
        };
        let (needs_free, buffered) = {
            let data = state.data.read();
            (data.item.nlink == 0 && !data.freed, !data.dirty.is_empty())
        };
        if buffered && !needs_free {
            // Buffered again between the flush above and the removal: flush it now.
            let mut data = state.data.write();
            self.flush_locked(ino, &mut data)?;
        }
        if needs_free && self.inner.engine.read_only_reason().is_none() {
            let mut data = state.data.write();
            if !data.freed {
                self.free_inode(ino, &mut data)?;
            }
        }
        Ok(())
    }

    /// The kernel forgets `n` lookups of `ino` (nothing to do for a snapshot's nodes: none
    /// is in the inode table).
    pub fn forget(&self, ino: InodeNo, n: u64) {
        let ino = ino.get();
        let Some(state) = self.shard(ino).lock().get(&ino).cloned() else {
            return;
        };
        let _ = state
            .lookups
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
                Some(v.saturating_sub(n))
            });
        if let Err(e) = self.evict_if_unused(ino) {
            log::error!("forget of inode {ino}: {e}");
        }
    }

    pub(crate) fn remember(&self, state: &InodeState) {
        state.lookups.fetch_add(1, Ordering::SeqCst);
    }

    pub(crate) fn new_fh(&self) -> u64 {
        self.inner.next_fh.fetch_add(1, Ordering::Relaxed)
    }

    /// Stores an inode item in the running transaction. The inode is no longer log-clean
    /// ([`Filesystem::unmark_log_clean`]); a write that logs its own change marks it again.
    pub(crate) fn store_inode(&self, ino: u64, data: &mut InodeData) -> Result<()> {
        let mut txn = self.inner.engine.begin()?;
        data.item.transid = txn.generation().get();
        items::put_inode(&mut txn, InodeNo::new(ino), &data.item);
        self.unmark_log_clean(ino);
        Ok(())
    }

    /// Forgets that `ino` is log-clean: every change to an inode's items other than a write
    /// that logs its own range calls this, with the inode's write lock held. The mark's
    /// witness is the inode item, which can come back to the very same bytes after other
    /// items changed (the kernel's SETATTR restores a ctime it owns under the writeback
    /// cache, after a rename the daemon stamped with its own clock): without this, fsync
    /// would skip the rename (FUSE crash seed 1795610557250812997).
    pub(crate) fn unmark_log_clean(&self, ino: u64) {
        let state = self.shard(ino).lock().get(&ino).cloned();
        if let Some(state) = state {
            let mut logged = state.logged.lock();
            if logged.ticket != 0 {
                for all in [true, false] {
                    logged.values.remove(&log_clean_key(ino, all));
                }
            }
        }
    }

    /// Deletes every item of an inode and frees its data. The inode has no names.
    pub(crate) fn free_inode(&self, ino: u64, data: &mut InodeData) -> Result<()> {
        let (lo, hi) = items::inode_key_range(InodeNo::new(ino));
        let mut found = Vec::new();
        loop {
            let from = found
                .last()
                .and_then(|(k, _): &(Key, _)| k.successor())
                .unwrap_or(lo);
            let batch = self.inner.engine.range(&from, &hi, 4096)?;
            let done = batch.len() < 4096;
            found.extend(batch);
            if done {
                break;
            }
        }
        let mut txn = self.inner.engine.begin()?;
        let data_layer = self.data();
        for (key, value) in &found {
            if key.kind() == Some(ItemType::ExtentData) {
                data_layer.free_extent_item(&txn, key, value);
            }
            txn.delete(*key);
        }
        items::delete_orphan(&mut txn, InodeNo::new(ino));
        drop(txn);
        data.freed = true;
        self.drop_unlinked(ino);
        self.drop_buffered_from(data, 0);
        let flushed = self.flush_locked(ino, data);
        let (count, freed) = &self.inner.released;
        *count.lock() += 1;
        freed.notify_all();
        flushed
    }

    /// Sets who may wait for releases ([`Filesystem::wait_for_releases`]): `gate` answers
    /// for the calling thread. The FUSE adapter lets only its worker threads wait: a request
    /// loop (an io_uring queue thread above all, its queue's only loop) that waited for a
    /// RELEASE the kernel queued behind it would wait for itself.
    pub fn set_release_wait(&self, gate: ReleaseWaitGate) {
        *self.inner.release_wait.write() = Some(gate);
    }

    /// Sets what is told, with the inode, when data written to a file is lost (a failed
    /// device write of it, or of its buffered blocks at a flush; the file's fsync reports it
    /// from then on). The FUSE adapter has the kernel drop that file's cached pages, which
    /// still hold the lost bytes: reads must serve what the filesystem holds. Called with the
    /// inode's lock held: it must not block or call back into the filesystem.
    pub fn set_data_lost_hook(&self, hook: DataLostHook) {
        *self.inner.data_lost.write() = Some(hook);
    }

    /// Tells the hook (if any) that `ino`'s written data was lost.
    pub(crate) fn data_lost(&self, ino: u64) {
        self.inner
            .error_files
            .note(ino, errfiles::ErrorKind::LostWrite, None);
        if let Some(hook) = self.inner.data_lost.read().as_ref() {
            hook(InodeNo::new(ino));
        }
        match self.inner.errors {
            ErrorPolicy::Continue => {}
            ErrorPolicy::RemountRo | ErrorPolicy::Panic => {
                // With `Panic` the engine aborts here (`Engine::abort_on_failure`).
                self.inner.engine.set_read_only(ReadOnlyCause::DeviceError {
                    error: format!("written data of inode {ino} was lost"),
                });
            }
        }
    }

    /// Whether the calling thread may wait for releases (see [`Filesystem::set_release_wait`]).
    pub fn may_wait_for_releases(&self) -> bool {
        self.inner
            .release_wait
            .read()
            .as_ref()
            .is_none_or(|gate| gate())
    }

    /// Whether space may come back without any change by the caller: an unlinked inode still
    /// holds blocks because the kernel holds it (an open handle whose RELEASE, or a lookup
    /// whose FORGET, has not arrived), and the last wait for releases did not run out since
    /// an unlinked inode was last freed. Looks only at the inodes of the unlinked set (regular
    /// files with no names that are not freed yet; none, almost always), not at the table.
    pub fn release_may_free_space(&self) -> bool {
        let freed = *self.inner.released.0.lock();
        if *self.inner.fruitless.lock() == Some(freed) {
            return false;
        }
        // Copied out: the set is a leaf lock, and its writers hold an inode's data lock.
        let unlinked: Vec<u64> = self.inner.unlinked.lock().iter().copied().collect();
        unlinked.into_iter().any(|ino| {
            let Some(state) = self.shard(ino).lock().get(&ino).cloned() else {
                return false;
            };
            let data = state.data.read();
            data.item.nlink == 0
                && !data.freed
                && data.item.mode & libc::S_IFMT == libc::S_IFREG
                && (data.item.nbytes > 0 || !data.dirty.is_empty())
        })
    }

    /// How many inodes the unlinked set holds (see [`Filesystem::release_may_free_space`]).
    #[cfg(test)]
    pub(crate) fn unlinked_count(&self) -> usize {
        self.inner.unlinked.lock().len()
    }

    /// How many unlinked inodes were freed so far: read before an attempt that may fail for
    /// lack of space, and given to [`Filesystem::wait_for_releases`] after it failed, so a
    /// release in between is not missed.
    pub fn releases_seen(&self) -> u64 {
        *self.inner.released.0.lock()
    }

    /// Waits until `done` says so or an unlinked inode is freed (beyond the `seen` of
    /// [`Filesystem::releases_seen`]), for at most [`RELEASE_WAIT`], while
    /// [`Filesystem::release_may_free_space`]. Returns whether an unlinked inode was freed
    /// (the caller commits, which makes its space reusable, and tries again).
    ///
    /// Why: the kernel sends RELEASE in the background, and over FUSE-over-io_uring on the
    /// queue of the CPU that closed the file, where it can wait behind that queue's
    /// write-back WRITEs while the `rm` after the close and the next requests of the same
    /// program arrive on another CPU's queue at once (xfstests generic/371, DESIGN §12.5):
    /// an operation must not answer ENOSPC for space the program already gave back.
    /// A wait that runs out without any release is not repeated until an unlinked inode is
    /// freed. Call with no lock held, on a thread [`Filesystem::may_wait_for_releases`]
    /// allows.
    pub fn wait_for_releases(&self, seen: u64, mut done: impl FnMut() -> bool) -> bool {
        let (count, freed) = &self.inner.released;
        let start = seen;
        let until = Instant::now() + RELEASE_WAIT;
        loop {
            if done() || !self.release_may_free_space() {
                return *count.lock() != start;
            }
            let mut now = count.lock();
            if *now != start {
                return true;
            }
            if freed.wait_until(&mut now, until).timed_out() && *now == start {
                drop(now);
                *self.inner.fruitless.lock() = Some(start);
                log::info!(
                    "space: no unlinked file held by the kernel was freed in {} s; answering ENOSPC",
                    RELEASE_WAIT.as_secs()
                );
                return false;
            }
        }
    }

    /// Frees every orphan that nothing in memory holds.
    fn reclaim_orphans(&self) -> Result<()> {
        for ino in items::orphans(&*self.inner.engine)?
            .into_iter()
            .map(InodeNo::get)
        {
            let in_use = self
                .shard(ino)
                .lock()
                .get(&ino)
                .is_some_and(|s| s.opens.load(Ordering::SeqCst) > 0);
            if in_use && !self.inner.closed.load(Ordering::SeqCst) {
                continue;
            }
            let state = match self.inode(ino) {
                Ok(state) => state,
                Err(Error::NotFound(_)) => {
                    items::delete_orphan(&mut self.inner.engine.begin()?, InodeNo::new(ino));
                    continue;
                }
                Err(e) => return Err(e),
            };
            let mut data = state.data.write();
            if data.item.nlink == 0 && !data.freed {
                self.free_inode(ino, &mut data)?;
            } else if data.item.nlink > 0 {
                // Named again (a linked tmpfile whose orphan item outlived its link): not an
                // orphan.
                items::delete_orphan(&mut self.inner.engine.begin()?, InodeNo::new(ino));
            }
            drop(data);
            self.shard(ino).lock().remove(&ino);
            self.drop_unlinked(ino);
        }
        Ok(())
    }

    /// Attributes of `ino`.
    pub fn getattr(&self, ino: InodeNo) -> Result<Attr> {
        let ino = ino.get();
        if let Some(node) = self.snap_node(ino) {
            return self.snap_getattr(node);
        }
        let state = self.inode(ino)?;
        let data = state.data.read();
        Ok(attr_of(ino, &data.item))
    }

    /// Filesystem statistics; available space excludes the metadata reserve and pinned space.
    pub fn statfs(&self) -> StatFs {
        let alloc = self.inner.engine.allocator();
        let files = 1u64 << 32;
        let used_ids = self.inner.engine.superblock().next_objectid;
        // Space freed since the last commit (pinned) counts as free: it is reusable once the
        // next commit is durable, and an allocation that finds too little forces that commit
        // and retries (DESIGN §10.7), so a writer gets it. `df` after `rm` shows it at once.
        StatFs {
            blocks: alloc.total_blocks().get(),
            bfree: alloc.statfs_free_blocks().get(),
            bavail: alloc.statfs_available_blocks().get(),
            files,
            ffree: files.saturating_sub(used_ids),
            bsize: BLOCK_SIZE as u32,
            namelen: birch_format::NAME_MAX as u32,
            frsize: BLOCK_SIZE as u32,
        }
    }
}

impl Drop for Filesystem {
    fn drop(&mut self) {
        if self.view {
            return;
        }
        if let Err(e) = self.close() {
            log::error!("final commit failed: {e}");
        }
    }
}

/// The NFS generation of a new inode: its number plus a salt taken from the filesystem's id.
/// Inode numbers are never reused, so within one filesystem the number alone tells inodes
/// apart; the salt makes the same number in another birch filesystem carry another
/// generation, in the low 32 bits too (all the kernel keeps in a file handle). An NFS server
/// that names a FUSE filesystem by its `st_dev` alone (NFS-Ganesha: FUSE reports `f_fsid` 0)
/// takes another image mounted at the same path with the same device number for the same
/// filesystem; the kernel then answers the old handles ESTALE instead of opening that image's
/// inode of the same number. Inodes made before this rule keep generation = number.
pub(crate) fn new_generation(fsid: &[u8; 16], ino: u64) -> u64 {
    let salt = u32::from_le_bytes([fsid[0], fsid[1], fsid[2], fsid[3]]);
    ino.wrapping_add(u64::from(salt))
}

/// Builds stat attributes from an inode item.
pub(crate) fn attr_of(ino: u64, item: &InodeItem) -> Attr {
    Attr {
        ino: InodeNo::new(ino),
        size: item.size,
        blocks: item.nbytes / 512,
        atime: item.atime,
        mtime: item.mtime,
        ctime: item.ctime,
        crtime: item.otime,
        kind: FileKind::from_mode(item.mode),
        perm: item.mode & 0o7777,
        nlink: item.nlink,
        uid: item.uid,
        gid: item.gid,
        rdev: item.rdev,
        blksize: BLOCK_SIZE as u32,
        generation: item.generation,
    }
}

/// Checks a name before any tree is touched.
pub(crate) fn check_name(name: &[u8]) -> Result<()> {
    if name.len() > birch_format::NAME_MAX {
        return Err(Error::NameTooLong(format!("name of {} bytes", name.len())));
    }
    if name.is_empty() || name.contains(&b'/') || name.contains(&0) {
        return Err(Error::Invalid(format!(
            "name {:?}",
            String::from_utf8_lossy(name)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::device::MemDevice;

    fn fresh() -> Filesystem {
        let dev = Arc::new(MemDevice::new(64 << 20));
        Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
        Filesystem::open_device(dev, OpenOptions::default()).expect("open")
    }

    fn file_with_data(fs: &Filesystem, name: &[u8]) -> (u64, u64) {
        let (attr, fh) = fs
            .create(
                Caller::default(),
                InodeNo::new(ROOT_OBJECTID),
                name,
                0o644,
                libc::O_RDWR,
            )
            .expect("create");
        fs.write(attr.ino, 0, &[7; 64 << 10], false).expect("write");
        (attr.ino.get(), fh)
    }

    /// `cached_inodes` lists an inode while the kernel holds it (a create counts one lookup)
    /// and no longer once it was forgotten and closed.
    #[test]
    fn cached_inodes_lists_the_inodes_the_kernel_holds() {
        let fs = fresh();
        let (a, fh) = file_with_data(&fs, b"a");
        assert!(
            fs.cached_inodes().contains(&InodeNo::new(a)),
            "created and open"
        );
        fs.release(InodeNo::new(a), fh).expect("release");
        assert!(
            fs.cached_inodes().contains(&InodeNo::new(a)),
            "still looked up"
        );
        fs.forget(InodeNo::new(a), 1);
        assert!(
            !fs.cached_inodes().contains(&InodeNo::new(a)),
            "forgotten and closed"
        );
    }

    /// The unlinked set follows the states that matter, and the answer follows it: an open
    /// file with data unlinked (or replaced by a rename) may give space back until its last
    /// release and forget; an empty one, a directory or a linked tmpfile never may.
    #[test]
    fn release_may_free_space_tracks_unlinked_open_files() {
        let fs = fresh();
        let root = ROOT_OBJECTID;
        assert!(!fs.release_may_free_space(), "nothing unlinked");
        let (a, fh_a) = file_with_data(&fs, b"a");
        let (empty, fh_empty) = fs
            .create(
                Caller::default(),
                InodeNo::new(root),
                b"empty",
                0o644,
                libc::O_RDWR,
            )
            .map(|(attr, fh)| (attr.ino, fh))
            .expect("create empty");
        fs.mkdir(Caller::default(), InodeNo::new(root), b"d", 0o755)
            .expect("mkdir");
        assert!(!fs.release_may_free_space(), "everything has a name");
        assert_eq!(fs.unlinked_count(), 0);

        fs.unlink(InodeNo::new(root), b"empty")
            .expect("unlink empty");
        fs.rmdir(InodeNo::new(root), b"d").expect("rmdir");
        assert!(!fs.release_may_free_space(), "an empty file frees nothing");
        fs.unlink(InodeNo::new(root), b"a")
            .expect("unlink a while open");
        assert!(fs.release_may_free_space(), "a's release frees its data");
        fs.release(InodeNo::new(a), fh_a).expect("release a");
        assert!(fs.release_may_free_space(), "a is still looked up");
        fs.forget(InodeNo::new(a), 1);
        assert!(!fs.release_may_free_space(), "a was freed");
        fs.release(empty, fh_empty).expect("release empty");
        fs.forget(empty, 1);
        assert_eq!(fs.unlinked_count(), 0, "freed inodes leave the set");

        // A rename over an open file drops its last name.
        let (c, fh_c) = file_with_data(&fs, b"c");
        fs.create(Caller::default(), InodeNo::new(root), b"e", 0o644, 0)
            .expect("create e");
        fs.rename(InodeNo::new(root), b"e", InodeNo::new(root), b"c", 0)
            .expect("rename over c");
        assert!(fs.release_may_free_space(), "c lost its last name");
        fs.release(InodeNo::new(c), fh_c).expect("release c");
        fs.forget(InodeNo::new(c), 1);
        assert!(!fs.release_may_free_space(), "c was freed");

        // A tmpfile has no name until linked.
        let (t, fh_t) = fs
            .tmpfile(Caller::default(), InodeNo::new(root), 0o644, libc::O_RDWR)
            .map(|(attr, fh)| (attr.ino, fh))
            .expect("tmpfile");
        fs.write(t, 0, &[1; 64 << 10], false)
            .expect("write tmpfile");
        assert!(fs.release_may_free_space(), "an unnamed tmpfile holds data");
        fs.link(t, InodeNo::new(root), b"t").expect("link tmpfile");
        assert!(!fs.release_may_free_space(), "the tmpfile has a name");
        assert_eq!(fs.unlinked_count(), 0, "a linked tmpfile leaves the set");
        fs.release(t, fh_t).expect("release t");
        fs.close().expect("close");
    }
}
