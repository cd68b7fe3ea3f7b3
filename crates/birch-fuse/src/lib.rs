//! The FUSE adapter: a thin translation of fuser requests into [`birch_core::Filesystem`]
//! calls.
//!
//! Owns: reply construction, handle flags (O_DIRECT opens, and opens for writing while free
//! space is below the kernel's dirty limit, get `FOPEN_DIRECT_IO |
//! FOPEN_PARALLEL_DIRECT_WRITES`; other opens keep the page cache), negotiation of kernel
//! capabilities and of what the kernel may cache (entry, negative-entry and attribute
//! timeouts, the writeback cache, symlinks, directory listings), the invalidations the daemon
//! owes the kernel when it changes something the kernel cached, logging of failed requests,
//! the `FS_IOC_SHUTDOWN` and `FITRIM` ioctls (who may send them, their argument and answer),
//! and answering `EIO` to every request once the filesystem is shut down.
//! Must not touch: filesystem logic or caching of its own; every errno comes from
//! [`birch_core::Error::errno`].
//!
//! Modules of their own: [`daemon`] (the process serving a mount: session, signals, io_uring
//! setup, the final commit), `full_disk` (ENOSPC under the writeback cache: the dirty cap,
//! write-through below the headroom, reporting refused write-backs), `waiters` (the worker
//! pool for requests that wait for the device), `sync_writes` (a benchmark-only gate).

#![warn(missing_docs)]

pub mod daemon;
mod full_disk;
mod sync_writes;
mod waiters;

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use birch_core::vfs::{
    Attr, Caller, DeferredOutcome, FileKind, FsyncDone, SetAttr, SetTime, ShutdownMode,
};
use birch_core::{Error, Filesystem};
use birch_format::items::Timespec;
use full_disk::{LostWrites, WaitSlot, WriteVerdict, MAX_WRITE_WAITS};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, FopenFlags, Generation, INodeNo, InitFlags, IoctlFlags,
    KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyLseek, ReplyOpen,
    ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};

/// `FS_IOC_SHUTDOWN`, `_IOR('X', 125, __u32)` (also `XFS_IOC_GOINGDOWN`, what xfstests'
/// `godown` sends). The kernel copies data in only for `_IOC_WRITE` commands, so its flags
/// argument never reaches a FUSE server: through a mount it means "commit, then stop".
pub const FS_IOC_SHUTDOWN: u32 = 0x8004_587d;

/// `FITRIM`, `_IOWR('X', 121, struct fstrim_range)` (what `fstrim(8)` sends to a mount point):
/// in and out, three `u64`s in the host's order: start, len, minlen. The answer's len is the
/// bytes discarded.
pub const FITRIM: u32 = 0xc018_5879;

/// `struct fstrim_range`, `FITRIM`'s argument and answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FstrimRange {
    start: u64,
    len: u64,
    minlen: u64,
}

impl FstrimRange {
    /// The struct as the kernel passes it in (24 bytes, host order); None for another size.
    fn parse(bytes: &[u8]) -> Option<FstrimRange> {
        if bytes.len() != 24 {
            return None;
        }
        let word = |n: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[n * 8..n * 8 + 8]);
            u64::from_ne_bytes(w)
        };
        Some(FstrimRange {
            start: word(0),
            len: word(1),
            minlen: word(2),
        })
    }

    /// The struct as the kernel copies it out.
    fn bytes(&self) -> [u8; 24] {
        let mut out = [0u8; 24];
        out[..8].copy_from_slice(&self.start.to_ne_bytes());
        out[8..16].copy_from_slice(&self.len.to_ne_bytes());
        out[16..].copy_from_slice(&self.minlen.to_ne_bytes());
        out
    }
}

pub use full_disk::DEFAULT_WRITE_THROUGH_BELOW;

/// `CAP_SYS_ADMIN`, the capability a shutdown or a trim asks of its caller.
const CAP_SYS_ADMIN: u32 = 21;

/// Answers `EIO` and returns from the handler once the filesystem is shut down: every request
/// that reaches the daemon then fails.
macro_rules! refuse_if_down {
    ($self:ident, $reply:ident) => {
        if $self.fs.is_shut_down() {
            $reply.error(Errno::EIO);
            return;
        }
    };
}

/// Whether the process `pid` has `CAP_SYS_ADMIN` in its effective set (`CapEff` of
/// /proc/PID/status); for a process already gone, whether `uid` is root. The kernel checks
/// no capability before it forwards an ioctl to a FUSE server.
fn caller_is_admin(pid: u32, uid: u32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return uid == 0;
    };
    let effective = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok());
    match effective {
        Some(caps) => caps & (1u64 << CAP_SYS_ADMIN) != 0,
        None => uid == 0,
    }
}

/// The root xattr through which the mount helper reaches the daemon (remount ro/rw, sync).
pub const CONTROL_XATTR: &[u8] = b"trusted.birch.control";

/// The xattr of a POSIX access ACL, whose change can change the mode.
const ACL_ACCESS: &[u8] = b"system.posix_acl_access";

/// The root xattr that returns every counter as JSON.
pub const STATS_XATTR: &[u8] = b"trusted.birch.stats";

/// The root xattr that returns the online scrub's status and, once done, its report as JSON
/// (`Filesystem::scrub_status`); `scrub-start` and `scrub-cancel` on [`CONTROL_XATTR`] drive it.
pub const SCRUB_XATTR: &[u8] = b"trusted.birch.scrub";

/// The root xattr that lists the snapshots, a line each (`Filesystem::snapshots_text`);
/// `snapshot-create NAME` and `snapshot-delete NAME` on [`CONTROL_XATTR`] change them.
pub const SNAPSHOTS_XATTR: &[u8] = b"trusted.birch.snapshots";

/// The root xattr that names the snapshot a mount serves alone (`-o ro,snapshot=NAME`);
/// `ENODATA` on a mount of the live filesystem (and from daemons older than it).
pub const ALONE_XATTR: &[u8] = b"trusted.birch.alone";

/// The root xattrs `trusted.birch.diff/OFFSET/SNAP1[/SNAP2]` (`birch diff MNT`): the
/// lines of [`birch_core::Engine::diff`] from SNAP1 to SNAP2 (absent: the live state, committed
/// first), from byte OFFSET of the text, at most [`DIFF_CHUNK`] bytes: a shorter piece is the
/// last. The text is computed once per state (`Filesystem::diff_text` keeps the last two).
pub const DIFF_XATTR_PREFIX: &[u8] = b"trusted.birch.diff/";

/// The most bytes one `trusted.birch.diff/...` read returns (under the kernel's 64 KiB).
pub const DIFF_CHUNK: usize = 60_000;

/// The piece of `birch diff` text a `trusted.birch.diff/OFFSET/SNAP1[/SNAP2]` name asks for.
fn diff_piece(fs: &Filesystem, spec: &[u8]) -> birch_core::Result<Vec<u8>> {
    let bad = || birch_core::Error::Invalid("diff xattr: OFFSET/SNAP1[/SNAP2] expected".into());
    let spec = std::str::from_utf8(spec).map_err(|_| bad())?;
    let mut parts = spec.split('/');
    let offset: usize = parts.next().and_then(|o| o.parse().ok()).ok_or_else(bad)?;
    let from = parts.next().filter(|s| !s.is_empty()).ok_or_else(bad)?;
    let to = parts.next();
    if parts.next().is_some() {
        return Err(bad());
    }
    // Committed first for the live state; computed once per state and kept for later pieces.
    let text = fs.diff_text(from, to)?;
    let start = offset.min(text.len());
    let end = (start + DIFF_CHUNK).min(text.len());
    Ok(text[start..end].to_vec())
}

/// Adapter settings.
#[derive(Debug, Clone)]
pub struct FuseOptions {
    /// How long the kernel may cache attributes, names and the absence of names (negative
    /// entries). The daemon is the only writer of its image, and it tells the kernel whenever
    /// it changes something the kernel may hold, so a long timeout is safe.
    pub ttl: Duration,
    /// Ask for FUSE_WRITEBACK_CACHE: the kernel collects writes in its page cache and sends
    /// them later in large WRITEs (at the latest when the file is closed or fsync'd); it then
    /// owns size, mtime and O_APPEND positioning.
    pub writeback: bool,
    /// Keep a file's pages in the kernel across opens (`FOPEN_KEEP_CACHE`), so re-reads never
    /// reach the daemon; atime is then decided at OPEN too, as the filesystem's
    /// [`birch_core::vfs::AtimeMode`] says (the mount's atime flags).
    pub keep_cache: bool,
    /// Free bytes below which opens for writing are written through (`FOPEN_DIRECT_IO`), so a
    /// full filesystem answers ENOSPC at write(2) rather than at writeback. Should be at least
    /// what the kernel may hold dirty for this mount (its writeback device's `max_bytes`).
    pub write_through_below: u64,
    /// At most this many requests that wait for the device (FSYNC, FSYNCDIR, synchronous and
    /// direct WRITEs) are served at once, each on a worker thread of its own, so they share
    /// flushes while the request loops go on reading (mount option `waiters=`).
    pub waiters: usize,
    /// The session's request loops (fuser's `n_threads`): a loop serves a waiting request
    /// itself only while another stays free to read.
    pub loops: usize,
    /// Benchmark only, off by default (mount option `bench_serialize_sync_writes`, seed 001's
    /// "before"): synchronous and direct writes to one file are serialized in the daemon for
    /// the write and its flush.
    pub bench_serialize_sync_writes: bool,
}

impl Default for FuseOptions {
    fn default() -> Self {
        FuseOptions {
            ttl: Duration::from_secs(DEFAULT_TTL_SECS),
            writeback: true,
            keep_cache: true,
            write_through_below: DEFAULT_WRITE_THROUGH_BELOW,
            waiters: DEFAULT_WAITERS,
            loops: 2,
            bench_serialize_sync_writes: false,
        }
    }
}

/// Default limit on requests waiting for the device at once (mount option `waiters=`): the 64
/// O_SYNC writers and 64 fsyncs of the seed workloads each get a thread.
pub const DEFAULT_WAITERS: usize = 64;

/// Default entry/attribute timeout (mount option `ttl=`).
pub const DEFAULT_TTL_SECS: u64 = 60;

/// The fuser filesystem over a birchfs [`Filesystem`].
pub struct BirchFuse {
    fs: Arc<Filesystem>,
    options: FuseOptions,
    /// The kernel enforces POSIX ACLs and leaves the umask to us (FUSE_POSIX_ACL +
    /// FUSE_DONT_MASK were accepted).
    posix_acl: bool,
    /// FUSE_HANDLE_KILLPRIV_V2 was accepted: the kernel sends no GETXATTR of
    /// `security.capability` before each write and leaves clearing suid/sgid on write and
    /// truncate to us (writes say so with FUSE_WRITE_KILL_SUIDGID).
    killpriv: bool,
    /// Set once the session exists: tells the kernel to drop cached attributes the kernel
    /// cannot know changed (a write that cleared suid/sgid).
    notifier: Arc<OnceLock<fuser::Notifier>>,
    /// FUSE_WRITEBACK_CACHE was accepted.
    writeback: bool,
    /// Open handles with write access, per inode: the kernel can hold dirty pages of an inode
    /// only while one exists (it writes them back when the last one is closed).
    write_opens: WriteOpens,
    /// The end of each open directory's listing (see `opendir`).
    /// The invalidation thread's queue: invalidations that may wait for the kernel.
    invalidator: Invalidator,
    /// Inodes whose write-back the daemon refused for lack of space, not yet reported to a
    /// write(2) (see [`LostWrites`]).
    lost_writes: Arc<LostWrites>,
    /// WRITEs waiting on a worker for releases now (see [`MAX_WRITE_WAITS`]).
    write_waits: Arc<AtomicUsize>,
    /// Inodes whose low-space verdict a worker is deciding (see `decide_low_space_later`).
    deciding: Arc<parking_lot::Mutex<std::collections::HashSet<u64>>>,
    /// Worker threads for requests that wait for the device.
    waiters: waiters::Waiters,
    /// Serializes synchronous and direct writes per inode under `bench_serialize_sync_writes`.
    sync_writes: Arc<sync_writes::SyncWriteGate>,
    /// LOOKUPs of "." and ".." by node id: how the kernel resolves file handles (NFS export,
    /// open_by_handle_at) whose inodes it no longer caches.
    handle_lookups: HandleLookups,
}

/// Counters of the LOOKUPs the kernel sends to resolve a file handle: LOOKUP(node id, ".")
/// when it no longer caches the inode the handle names (any kind of inode), and
/// LOOKUP(dir, "..") when it reconnects a directory to its parent (exportfs `get_parent`).
/// Shown in the stats xattr as `lookup_dot`, `lookup_dotdot` (answered with an entry) and
/// `lookup_dot_stale` (the inode is gone: the kernel answers the handle ESTALE).
#[derive(Default)]
struct HandleLookups {
    dot: AtomicU64,
    dotdot: AtomicU64,
    dot_stale: AtomicU64,
}

impl HandleLookups {
    /// Counts one LOOKUP of `name` and what it found.
    fn count(&self, name: &[u8], found: &birch_core::Result<Attr>) {
        let counter = match (name, found) {
            (b".", Ok(_)) => &self.dot,
            (b".", Err(Error::NotFound(_))) => &self.dot_stale,
            (b"..", Ok(_)) => &self.dotdot,
            _ => return,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn pairs(&self) -> [(&'static str, u64); 3] {
        [
            ("lookup_dot", self.dot.load(Ordering::Relaxed)),
            ("lookup_dotdot", self.dotdot.load(Ordering::Relaxed)),
            ("lookup_dot_stale", self.dot_stale.load(Ordering::Relaxed)),
        ]
    }
}

/// Readdir cookies that carry where their listing ends.
///
/// A listing stops where the directory ended when it started (a READDIR at offset 0: opendir
/// or `rewinddir`), so one that meets names renamed away and back (each gets a new position)
/// still ends (xfstests generic/736; btrfs does the same). There is no per-open directory
/// state to keep that end in: OPENDIR is answered ENOSYS (FUSE_NO_OPENDIR_SUPPORT), which
/// saves an OPENDIR and a RELEASEDIR per listing, and the kernel then caches every listing
/// (`FOPEN_KEEP_CACHE | FOPEN_CACHE_DIR`). So each entry's cookie (the offset the kernel
/// hands back to continue after it) carries the end beside the position: the position in bits
/// 31..62, the end in bits 0..31. The position leads, so cookies grow along a listing, and any
/// number below the largest cookie a listing gave (xfstests generic/676 seeks to random ones)
/// lands on a position inside it, never past its end. A directory whose positions outgrow 31
/// bits (two billion names made in it over its life) gets plain positions with bit 62 set, and
/// its listings no end.
mod dir_cookie {
    const PLAIN: u64 = 1 << 62;
    const FIELD: u64 = (1 << 31) - 1;

    /// The cookie of position `pos` (the dir index cookie: 0 ".", 1 "..", then index + 1) in
    /// a listing that ends at `end`.
    pub(super) fn encode(pos: u64, end: Option<u64>) -> u64 {
        match end {
            Some(end) if pos <= FIELD && end <= FIELD => (pos << 31) | end,
            _ => PLAIN | pos,
        }
    }

    /// The position and the listing's end of `cookie`.
    pub(super) fn decode(cookie: u64) -> (u64, Option<u64>) {
        if cookie & PLAIN != 0 {
            (cookie & !PLAIN, None)
        } else {
            (cookie >> 31, Some(cookie & FIELD))
        }
    }
}

/// Open write handles per inode, in shards so that opens of different files rarely meet.
struct WriteOpens {
    shards: Vec<parking_lot::Mutex<HashMap<u64, u32>>>,
}

impl WriteOpens {
    const SHARDS: usize = 64;

    fn new() -> WriteOpens {
        WriteOpens {
            shards: (0..Self::SHARDS)
                .map(|_| parking_lot::Mutex::new(HashMap::new()))
                .collect(),
        }
    }

    fn shard(&self, ino: u64) -> &parking_lot::Mutex<HashMap<u64, u32>> {
        &self.shards[(ino as usize) % Self::SHARDS]
    }

    fn opened(&self, ino: u64) {
        *self.shard(ino).lock().entry(ino).or_insert(0) += 1;
    }

    /// Counts a handle closed; whether it was the inode's last.
    fn released(&self, ino: u64) -> bool {
        let mut shard = self.shard(ino).lock();
        if let Some(n) = shard.get_mut(&ino) {
            *n -= 1;
            if *n == 0 {
                shard.remove(&ino);
                return true;
            }
        }
        false
    }

    fn any(&self, ino: u64) -> bool {
        self.shard(ino).lock().contains_key(&ino)
    }
}

/// Whether open flags give write access.
fn writes(flags: i32) -> bool {
    flags & libc::O_ACCMODE != libc::O_RDONLY
}

/// A thread of its own for invalidations that wait on the kernel: a ranged invalidation
/// writes back (launders) and waits for the inode's dirty pages, whose WRITEs other request
/// loops serve, and an entry invalidation locks the parent directory, which a request being
/// served may hold. Neither may run inside a request handler.
struct Invalidator {
    queue: mpsc::Sender<(Inval, mpsc::Sender<()>)>,
}

/// What [`Invalidator`]'s thread tells the kernel to drop.
enum Inval {
    /// Every page of an inode (a directory's: its cached listing), dirty ones written back.
    Pages(u64),
    /// The dentry of a name in a directory.
    Entry(u64, Vec<u8>),
}

impl Invalidator {
    /// Starts the thread; it ends when the adapter is dropped.
    fn start(notifier: Arc<OnceLock<fuser::Notifier>>) -> Invalidator {
        let (tx, rx) = mpsc::channel::<(Inval, mpsc::Sender<()>)>();
        let spawned = std::thread::Builder::new()
            .name("birch-inval".into())
            .spawn(move || {
                for (job, done) in rx {
                    if let Some(n) = notifier.get() {
                        match job {
                            // Offset 0, length 0: every page; dirty ones are written back
                            // first.
                            Inval::Pages(ino) => {
                                if let Err(e) = n.inval_inode(INodeNo(ino), 0, 0) {
                                    log::debug!("invalidate pages of inode {ino}: {e}");
                                }
                            }
                            Inval::Entry(parent, name) => {
                                if let Err(e) =
                                    n.inval_entry(INodeNo(parent), OsStr::from_bytes(&name))
                                {
                                    log::debug!(
                                        "invalidate entry {:?} of inode {parent}: {e}",
                                        String::from_utf8_lossy(&name)
                                    );
                                }
                            }
                        }
                    }
                    let _ = done.send(());
                }
            });
        if let Err(e) = spawned {
            log::warn!("invalidation thread: {e}");
        }
        Invalidator { queue: tx }
    }

    /// Has the kernel write back and drop the pages of `ino`, and waits (at most `limit`)
    /// until it has. Returns whether it finished in time.
    fn write_back(&self, ino: u64, limit: Duration) -> bool {
        let (done, wait) = mpsc::channel();
        if self.queue.send((Inval::Pages(ino), done)).is_err() {
            return false;
        }
        wait.recv_timeout(limit).is_ok()
    }

    /// Has the kernel drop its cached listing of `/.snapshot` and its entry `name` there
    /// (a snapshot made or deleted through the control xattr, which the kernel cannot see),
    /// without waiting: the entry's invalidation locks `/.snapshot`, which a request being
    /// served may hold.
    fn snapshot_changed(&self, name: &[u8]) {
        let dir = birch_format::SNAPSHOT_DIR_OBJECTID;
        for job in [Inval::Entry(dir, name.to_vec()), Inval::Pages(dir)] {
            let (done, _) = mpsc::channel();
            let _ = self.queue.send((job, done));
        }
    }
}

impl BirchFuse {
    /// The umask the filesystem must apply: the kernel applied it already unless FUSE_DONT_MASK
    /// was negotiated.
    fn umask(&self, umask: u32) -> u32 {
        if self.posix_acl {
            umask
        } else {
            0
        }
    }

    /// An adapter over `fs`. POSIX ACLs and kill-priv start off and are switched on in `init`
    /// only if the kernel accepts them; the notifier slot starts empty (see
    /// [`BirchFuse::notifier_slot`]). Starts the invalidation thread; does no I/O.
    pub fn new(fs: Arc<Filesystem>, options: FuseOptions) -> BirchFuse {
        let waiters = waiters::Waiters::new(options.waiters, options.loops);
        // A thread whose own fsync is answered hands the leading of deferred fsyncs (see
        // `fsync`) to a worker. The log keeps this closure as long as the filesystem lives,
        // so it holds the filesystem weakly.
        let weak = Arc::downgrade(&fs);
        let pool = waiters.clone();
        fs.set_fsync_hand_off(Arc::new(move || {
            if let Some(fs) = weak.upgrade() {
                pool.run(move || fs.fsync_lead_deferred());
            }
        }));
        // Only workers wait for releases at ENOSPC; a request loop hands the request to one.
        fs.set_release_wait(Arc::new(waiters::on_worker));
        let notifier = Arc::new(OnceLock::new());
        let sync_writes = Arc::new(sync_writes::SyncWriteGate::new(
            options.bench_serialize_sync_writes,
        ));
        BirchFuse {
            fs,
            options,
            posix_acl: false,
            killpriv: false,
            invalidator: Invalidator::start(notifier.clone()),
            notifier,
            writeback: false,
            write_opens: WriteOpens::new(),
            lost_writes: Arc::new(LostWrites::new()),
            write_waits: Arc::new(AtomicUsize::new(0)),
            deciding: Arc::default(),
            waiters,
            sync_writes,
            handle_lookups: HandleLookups::default(),
        }
    }

    /// The adapter's own figures for the stats xattr.
    fn adapter_pairs(&self) -> Vec<(&'static str, u64)> {
        let mut pairs = self.handle_lookups.pairs().to_vec();
        pairs.extend(self.sync_writes.pairs());
        pairs
    }

    /// LOOKUP of `name` in `parent`, counting the lookups of "." and ".." (see
    /// [`HandleLookups`]).
    fn lookup_counted(&self, parent: u64, name: &[u8]) -> birch_core::Result<Attr> {
        let found = self.fs.lookup(parent, name);
        self.handle_lookups.count(name, &found);
        found
    }

    /// Tells the kernel to drop its cached attributes of `ino` (and ACLs): for changes the
    /// daemon makes that the kernel cannot know of. Attributes only: safe inside a request
    /// handler (an entry or range invalidation is not, see DESIGN §12.4).
    fn invalidate_attrs(&self, ino: u64) {
        invalidate_attrs(&self.notifier, ino);
    }

    /// Whether this request loop may serve a request that waits for the device itself
    /// ([`waiters::Waiters::serve_here`]); never on an io_uring queue thread, which is its
    /// queue's only loop.
    fn serve_here(&self) -> Option<waiters::ServingHere<'_>> {
        if fuser::on_ring_queue() {
            None
        } else {
            self.waiters.serve_here()
        }
    }

    /// `FITRIM` (`fstrim MOUNTPOINT`): on any inode of the mount (fstrim opens the mount
    /// point), from a caller with `CAP_SYS_ADMIN` only (`EPERM` otherwise, as the kernel's
    /// filesystems answer); discards the free space of the range
    /// ([`Filesystem::trim`]) and answers the range with `len` set to the bytes discarded.
    /// `EOPNOTSUPP` where the device frees nothing on a discard (an image file).
    fn fitrim(&self, req: &Request, ino: INodeNo, in_data: &[u8], reply: ReplyIoctl) {
        if !caller_is_admin(req.pid(), req.uid()) {
            log::warn!(
                "FITRIM on inode {} refused: pid {} (uid {}) lacks CAP_SYS_ADMIN",
                ino.0,
                req.pid(),
                req.uid()
            );
            reply.error(Errno::EPERM);
            return;
        }
        let Some(range) = FstrimRange::parse(in_data) else {
            log::warn!(
                "FITRIM on inode {}: argument of {} bytes, not 24",
                ino.0,
                in_data.len()
            );
            reply.error(Errno::EINVAL);
            return;
        };
        // Discards wait for the device, and a trim of a whole image may take minutes: always
        // on a worker (see `waiters`), never on a request loop.
        let fs = self.fs.clone();
        let job = move || match fs.trim(range.start, range.len, range.minlen) {
            Ok(trimmed) => reply.ioctl(
                0,
                &FstrimRange {
                    len: trimmed,
                    ..range
                }
                .bytes(),
            ),
            Err(e) => reply.error(errno("FITRIM", &e)),
        };
        self.waiters.run(job);
    }

    /// Serves `job`, a request that waits for the device, here when [`BirchFuse::serve_here`]
    /// allows it, else on a worker.
    fn serve_waiting(&self, job: impl FnOnce() + Send + 'static) {
        match self.serve_here() {
            Some(_here) => job(),
            None => self.waiters.run(job),
        }
    }

    /// The handle and reply flags of an OPEN or CREATE with open flags `flags` that the
    /// filesystem gave handle `fh`. A direct-I/O handle carries [`DIRECT_FH`], so WRITE knows
    /// the kernel will send no FSYNC after its synchronous writes.
    fn opened(&self, fh: u64, flags: i32) -> (FileHandle, FopenFlags) {
        let direct = FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES;
        if flags & libc::O_DIRECT != 0 {
            // Seed 001: writers to different regions of one file run in parallel.
            (FileHandle(fh | DIRECT_FH), direct)
        } else if writes(flags) && self.writeback && self.low_on_space() {
            // Near full, the kernel must not hold writes it may be unable to place: written
            // through, so ENOSPC comes back from write(2).
            (FileHandle(fh | DIRECT_FH), direct)
        } else if self.options.keep_cache {
            (FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE)
        } else {
            (FileHandle(fh), FopenFlags::empty())
        }
    }

    /// The groups of a caller that lacks CAP_FSETID, primary first, as far as the sgid rule
    /// of a write, truncate or chown of `ino` needs them: the supplementary groups (from
    /// /proc) only matter, and are only read, when the file has sgid without group-execute.
    fn caller_groups(&self, req: &Request, ino: u64) -> Vec<u32> {
        let needs_all = self
            .fs
            .getattr(ino)
            .is_ok_and(|a| a.perm & libc::S_ISGID != 0 && a.perm & libc::S_IXGRP == 0);
        if needs_all {
            self.all_groups(req)
        } else {
            vec![req.gid()]
        }
    }

    /// What Linux's `file_modified` does to a file changed by FALLOCATE or COPY_FILE_RANGE,
    /// which with FUSE_HANDLE_KILLPRIV_V2 the kernel leaves to us without saying so: for a
    /// caller without CAP_FSETID (for us, a caller other than root, as for truncate) suid
    /// goes, and sgid as for a write. The caller invalidates the kernel's attributes.
    fn kill_privs_of_modify(&self, req: &Request, ino: u64) -> birch_core::Result<()> {
        if self.killpriv && req.uid() != 0 {
            self.fs.kill_privs(ino, &self.caller_groups(req, ino))?;
        }
        Ok(())
    }

    /// The caller's groups, primary first, then its supplementary groups (from /proc).
    fn all_groups(&self, req: &Request) -> Vec<u32> {
        let mut groups = vec![req.gid()];
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", req.pid())).unwrap_or_default();
        if let Some(line) = status.lines().find(|l| l.starts_with("Groups:")) {
            groups.extend(
                line["Groups:".len()..]
                    .split_whitespace()
                    .filter_map(|g| g.parse::<u32>().ok()),
            );
        }
        groups
    }

    /// Where a READDIR of `ino` at cookie `offset` starts and where its listing ends: a new
    /// listing (offset 0) ends where the directory ends now; a continued one where its cookie
    /// says ([`dir_cookie`]).
    fn dir_range(&self, ino: u64, offset: u64) -> (u64, Option<u64>) {
        if offset == 0 {
            (0, self.fs.readdir_end(ino).ok())
        } else {
            dir_cookie::decode(offset)
        }
    }

    /// Where the mount puts the session's notifier once it exists.
    pub fn notifier_slot(&self) -> Arc<OnceLock<fuser::Notifier>> {
        self.notifier.clone()
    }
}

/// A WRITE's work: writes `data` at `offset` of `ino` (buffered unless `through`), tells the
/// kernel to drop the cached mode if the write cleared suid/sgid, and with `sync` set
/// (`Some(datasync)`) makes it durable before returning. Runs on a request loop, or on a
/// worker for writes that wait for the device.
#[allow(clippy::too_many_arguments)]
fn write_now(
    fs: &Filesystem,
    notifier: &OnceLock<fuser::Notifier>,
    ino: u64,
    offset: u64,
    data: &[u8],
    append: bool,
    kill: Option<&[u32]>,
    through: bool,
    sync: Option<bool>,
) -> birch_core::Result<u32> {
    let (n, dropped) = fs.write_mode(ino, offset, data, append, kill, through)?;
    if dropped {
        // The kernel keeps the old mode cached after a write: make it ask again.
        invalidate_attrs(notifier, ino);
    }
    if let Some(datasync) = sync {
        fs.fsync(ino, datasync)?;
    }
    Ok(n)
}

/// A READ's work: `size` bytes at `offset` of `ino`, moving atime as the filesystem's atime
/// mode says (noatime: no read moves it; exec and mmap reads reach us too), and telling the
/// kernel to drop the cached attributes if it moved.
fn read_now(
    fs: &Filesystem,
    notifier: &OnceLock<fuser::Notifier>,
    ino: u64,
    offset: u64,
    size: u32,
) -> birch_core::Result<Vec<u8>> {
    let (data, atime_moved) = fs.read_noting_atime(ino, offset, size as usize)?;
    if atime_moved {
        invalidate_attrs(notifier, ino);
    }
    Ok(data)
}

/// Tells the kernel to drop its cached attributes of `ino` (and ACLs): for changes the daemon
/// makes that the kernel cannot know of. Attributes only: safe inside a request handler (an
/// entry or range invalidation is not, see DESIGN §12.4).
fn invalidate_attrs(notifier: &OnceLock<fuser::Notifier>, ino: u64) {
    if let Some(notifier) = notifier.get() {
        if let Err(e) = notifier.inval_inode(INodeNo(ino), -1, 0) {
            log::debug!("invalidate attributes of inode {ino}: {e}");
        }
    }
}

/// Logs a failed request at the error's own level ([`Error::log_level`]) and gives the errno
/// to reply with ([`Error::errno`]).
fn errno(op: &str, e: &Error) -> Errno {
    log::log!(e.log_level(), "{op}: {e}");
    Errno::from_i32(e.errno())
}

fn system_time(t: Timespec) -> SystemTime {
    if t.sec >= 0 {
        UNIX_EPOCH + Duration::new(t.sec as u64, t.nsec)
    } else {
        UNIX_EPOCH - Duration::from_secs(t.sec.unsigned_abs())
            + Duration::from_nanos(u64::from(t.nsec))
    }
}

fn timespec(t: SystemTime) -> Timespec {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => Timespec {
            sec: d.as_secs() as i64,
            nsec: d.subsec_nanos(),
        },
        Err(e) => {
            let d = e.duration();
            let (sec, nsec) = if d.subsec_nanos() == 0 {
                (-(d.as_secs() as i64), 0)
            } else {
                (-(d.as_secs() as i64) - 1, 1_000_000_000 - d.subsec_nanos())
            };
            Timespec { sec, nsec }
        }
    }
}

fn file_type(kind: FileKind) -> FileType {
    match kind {
        FileKind::File => FileType::RegularFile,
        FileKind::Dir => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Fifo => FileType::NamedPipe,
        FileKind::Socket => FileType::Socket,
        FileKind::CharDevice => FileType::CharDevice,
        FileKind::BlockDevice => FileType::BlockDevice,
    }
}

fn file_attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.blocks,
        atime: system_time(a.atime),
        mtime: system_time(a.mtime),
        ctime: system_time(a.ctime),
        crtime: system_time(a.crtime),
        kind: file_type(a.kind),
        perm: a.perm as u16,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev as u32,
        blksize: a.blksize,
        flags: 0,
    }
}

fn caller(req: &Request, umask: u32) -> Caller {
    Caller {
        uid: req.uid(),
        gid: req.gid(),
        umask,
    }
}

fn set_time(t: TimeOrNow) -> SetTime {
    match t {
        TimeOrNow::Now => SetTime::Now,
        TimeOrNow::SpecificTime(t) => SetTime::At(timespec_from_kernel(t)),
    }
}

/// A time the kernel sent (SETATTR). fuser 0.18 decodes a negative (sec, nsec) as
/// `UNIX_EPOCH - (|sec| s + nsec ns)`, subtracting the nanoseconds that should be added;
/// undo that, so 1969-12-31 23:59:59.25 stays .25 and does not become .75 of the second
/// before. (Its encoding of replies is right: [`system_time`] is its inverse.)
fn timespec_from_kernel(t: SystemTime) -> Timespec {
    match t.duration_since(UNIX_EPOCH) {
        Ok(_) => timespec(t),
        Err(e) => {
            let d = e.duration();
            Timespec {
                sec: -(d.as_secs() as i64),
                nsec: d.subsec_nanos(),
            }
        }
    }
}

/// Set in the handle of a direct-I/O open (`FOPEN_DIRECT_IO`). The filesystem's own handle
/// numbers count up from 1 and never reach it; it ignores the handle at release.
const DIRECT_FH: u64 = 1 << 63;

/// The attributes of a negative entry: node id 0 tells the kernel the name does not exist,
/// and the entry timeout lets it remember that.
fn negative_attr() -> FileAttr {
    FileAttr {
        ino: INodeNo(0),
        size: 0,
        blocks: 0,
        atime: UNIX_EPOCH,
        mtime: UNIX_EPOCH,
        ctime: UNIX_EPOCH,
        crtime: UNIX_EPOCH,
        kind: FileType::RegularFile,
        perm: 0,
        nlink: 0,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 0,
        flags: 0,
    }
}

/// The filesystem's counters plus the adapter's own: how many FUSE requests this process
/// served over /dev/fuse and over io_uring (`fuse_dev_requests`, `fuse_uring_requests`), by
/// opcode over both (`fuse_op_NAME`, opcodes seen at least once), and `extra` (the LOOKUPs of
/// "." and "..").
fn stats_with_transport(mut json: String, extra: &[(&str, u64)]) -> String {
    let (dev, ring) = fuser::transport_counts();
    if json.ends_with('}') {
        json.pop();
        let sep = if json.trim_end().ends_with('{') {
            ""
        } else {
            ", "
        };
        json.push_str(&format!(
            "{sep}\"fuse_dev_requests\": {dev}, \"fuse_uring_requests\": {ring}"
        ));
        for (name, value) in extra {
            json.push_str(&format!(", \"{name}\": {value}"));
        }
        // Requests by opcode (`fuse_op_lookup`, ...): what a workload costs in round trips.
        let mut by_op = std::collections::BTreeMap::new();
        for (name, n) in fuser::opcode_counts() {
            *by_op.entry(name).or_insert(0u64) += n;
        }
        for (name, n) in by_op {
            json.push_str(&format!(", \"fuse_op_{name}\": {n}"));
        }
        json.push('}');
    }
    json
}

impl fuser::Filesystem for BirchFuse {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let mut wanted = InitFlags::FUSE_EXPORT_SUPPORT
            | InitFlags::FUSE_PARALLEL_DIROPS
            | InitFlags::FUSE_DO_READDIRPLUS
            | InitFlags::FUSE_READDIRPLUS_AUTO
            | InitFlags::FUSE_CACHE_SYMLINKS
            | InitFlags::FUSE_NO_OPENDIR_SUPPORT
            | InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP;
        if self.options.writeback {
            wanted |= InitFlags::FUSE_WRITEBACK_CACHE;
        }
        let supported = wanted & config.capabilities();
        if let Err(missing) = config.add_capabilities(supported) {
            log::warn!("kernel refused capabilities {missing:?}");
        }
        self.writeback = supported.contains(InitFlags::FUSE_WRITEBACK_CACHE);
        // Readahead and writeback requests the kernel may keep in flight (fuser's default is 16).
        let _ = config.set_max_background(64);
        let _ = config.set_congestion_threshold(48);
        let killpriv = InitFlags::FUSE_HANDLE_KILLPRIV_V2;
        if config.capabilities().contains(killpriv) && config.add_capabilities(killpriv).is_ok() {
            self.killpriv = true;
        }
        let acl = InitFlags::FUSE_POSIX_ACL | InitFlags::FUSE_DONT_MASK;
        if config.capabilities().contains(acl) && config.add_capabilities(acl).is_ok() {
            self.posix_acl = true;
        }
        let _ = config.set_max_write(1 << 20);
        let _ = config.set_time_granularity(Duration::from_nanos(1));
        Ok(())
    }

    fn destroy(&mut self) {
        // Every FSYNC and synchronous WRITE handed to a worker is answered before the final
        // commit (none after a shutdown: `close` then writes nothing).
        self.waiters.close();
        if let Err(e) = self.fs.close() {
            log::error!("final commit at unmount failed: {e}");
        }
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        refuse_if_down!(self, reply);
        match self.lookup_counted(parent.0, name.as_bytes()) {
            Ok(a) => reply.entry(&self.options.ttl, &file_attr(&a), Generation(a.generation)),
            // A negative entry: the kernel remembers the absence (build tools, $PATH searches
            // and dbench ask again and again). A CREATE of the name replaces it in the kernel.
            Err(Error::NotFound(_)) if !self.options.ttl.is_zero() => {
                reply.entry(&self.options.ttl, &negative_attr(), Generation(0))
            }
            Err(e) => reply.error(errno("lookup", &e)),
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.fs.forget(ino.0, nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        refuse_if_down!(self, reply);
        // With a handle, this is the kernel starting a write(2) (or a read or lseek) on a file
        // whose write-back the daemon refused: report it there (see `LostWrites`).
        if fh.is_some() && self.lost_writes.take(ino.0) {
            reply.error(Errno::ENOSPC);
            return;
        }
        match self.fs.getattr(ino.0) {
            Ok(a) => reply.attr(&self.options.ttl, &file_attr(&a)),
            Err(e) => reply.error(errno("getattr", &e)),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        refuse_if_down!(self, reply);
        let set = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime: atime.map(set_time),
            mtime: mtime.map(set_time),
            ctime: ctime.map(timespec_from_kernel),
            // fuser does not pass FATTR_KILL_SUIDGID on; the kernel sets it on a truncate by
            // a caller without CAP_FSETID, which for us is a caller other than root.
            kill_privs: self.killpriv && size.is_some() && req.uid() != 0,
            caller_groups: (req.uid() != 0 && (size.is_some() || uid.is_some() || gid.is_some()))
                .then(|| self.caller_groups(req, ino.0)),
        };
        match self.fs.setattr(ino.0, &set) {
            Ok(a) => reply.attr(&self.options.ttl, &file_attr(&a)),
            Err(e) => reply.error(errno("setattr", &e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        refuse_if_down!(self, reply);
        match self.fs.readlink(ino.0) {
            Ok(target) => reply.data(&target),
            Err(e) => reply.error(errno("readlink", &e)),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        refuse_if_down!(self, reply);
        match self.fs.mknod(
            caller(req, self.umask(umask)),
            parent.0,
            name.as_bytes(),
            mode,
            u64::from(rdev),
        ) {
            Ok(a) => reply.entry(&self.options.ttl, &file_attr(&a), Generation(a.generation)),
            Err(e) => reply.error(errno("mknod", &e)),
        }
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        refuse_if_down!(self, reply);
        match self.fs.mkdir(
            caller(req, self.umask(umask)),
            parent.0,
            name.as_bytes(),
            mode,
        ) {
            Ok(a) => reply.entry(&self.options.ttl, &file_attr(&a), Generation(a.generation)),
            Err(e) => reply.error(errno("mkdir", &e)),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        refuse_if_down!(self, reply);
        match self.fs.unlink(parent.0, name.as_bytes()) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("unlink", &e)),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        refuse_if_down!(self, reply);
        match self.fs.rmdir(parent.0, name.as_bytes()) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("rmdir", &e)),
        }
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        refuse_if_down!(self, reply);
        match self.fs.symlink(
            caller(req, 0),
            parent.0,
            link_name.as_bytes(),
            target.as_os_str().as_bytes(),
        ) {
            Ok(a) => reply.entry(&self.options.ttl, &file_attr(&a), Generation(a.generation)),
            Err(e) => reply.error(errno("symlink", &e)),
        }
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        refuse_if_down!(self, reply);
        match self.fs.rename_as(
            caller(req, 0),
            parent.0,
            name.as_bytes(),
            newparent.0,
            newname.as_bytes(),
            flags.bits(),
        ) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("rename", &e)),
        }
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        refuse_if_down!(self, reply);
        match self.fs.link(ino.0, newparent.0, newname.as_bytes()) {
            Ok(a) => reply.entry(&self.options.ttl, &file_attr(&a), Generation(a.generation)),
            Err(e) => reply.error(errno("link", &e)),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        refuse_if_down!(self, reply);
        match self.fs.open_file(ino.0, flags.0) {
            Ok(fh) => {
                if writes(flags.0) {
                    self.write_opens.opened(ino.0);
                }
                if self.options.keep_cache
                    && flags.0 & libc::O_ACCMODE == libc::O_RDONLY
                    && flags.0 & libc::O_NOATIME == 0
                {
                    // Reads may all be served from kept pages and never reach us: the atime
                    // mode (noatime, relatime, strictatime) is applied at an open for reading
                    // only. Not at a read-write open: tools open files O_RDWR to fsync or
                    // fallocate them without reading (xfstests generic/392, 468 expect atime
                    // to stay).
                    match self.fs.atime_at_open(ino.0) {
                        Ok(true) => self.invalidate_attrs(ino.0),
                        Ok(false) => {}
                        Err(e) => log::debug!("atime at open of inode {}: {e}", ino.0),
                    }
                }
                let (fh, open_flags) = self.opened(fh, flags.0);
                reply.opened(fh, open_flags)
            }
            Err(e) => reply.error(errno("open", &e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyData,
    ) {
        refuse_if_down!(self, reply);
        // A READ that reaches the daemon is one the kernel's page cache could not answer: it
        // reads the device, so past the loops that may wait it runs on a worker, and readahead
        // keeps several in flight.
        let fs = self.fs.clone();
        let notifier = self.notifier.clone();
        let job = move || match read_now(&fs, &notifier, ino.0, offset, size) {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(errno("read", &e)),
        };
        self.serve_waiting(job);
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        refuse_if_down!(self, reply);
        // With the writeback cache the kernel has already placed O_APPEND writes.
        let append = flags.0 & libc::O_APPEND != 0 && !self.writeback;
        let kill = write_flags
            .contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID)
            .then(|| self.caller_groups(req, ino.0));
        // Direct handles and synchronous writes go to the device before the reply; the rest
        // is buffered in the daemon until a commit, an fsync of the file or the dirty limit.
        let through =
            fh.0 & DIRECT_FH != 0 || flags.0 & (libc::O_SYNC | libc::O_DSYNC | libc::O_DIRECT) != 0;
        // An O_SYNC or RWF_SYNC write on a direct handle gets no FSYNC from the kernel: it is
        // made durable before the reply (`Some(datasync)`).
        let sync = (fh.0 & DIRECT_FH != 0 && flags.0 & (libc::O_SYNC | libc::O_DSYNC) != 0)
            .then_some(flags.0 & libc::O_SYNC != libc::O_SYNC);
        let here = if through { self.serve_here() } else { None };
        let cached = write_flags.contains(WriteFlags::FUSE_WRITE_CACHE);
        if !through || here.is_some() {
            let write = || {
                write_now(
                    &self.fs,
                    &self.notifier,
                    ino.0,
                    offset,
                    data,
                    append,
                    kill.as_deref(),
                    false,
                    sync,
                )
            };
            let result = if through {
                self.sync_writes.run(ino.0, write)
            } else {
                write()
            };
            if let Ok(n) = result {
                if cached && self.low_on_space() && self.retry_on_worker() {
                    // A write-back that left less than the headroom while the kernel may
                    // still release an unlinked file: answered now (a write-back waiting here
                    // would hold one of the kernel's background slots the RELEASE may need),
                    // and a worker waits for the space to come back before it decides whether
                    // the writer hears ENOSPC.
                    reply.written(n);
                    self.decide_low_space_later(ino.0);
                    return;
                }
            }
            let wait = matches!(result, Err(Error::NoSpace(_)))
                && self.retry_on_worker()
                && self
                    .write_waits
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                        (n < MAX_WRITE_WAITS).then_some(n + 1)
                    })
                    .is_ok();
            if !wait {
                let verdict = WriteVerdict {
                    fs: &self.fs,
                    notifier: &self.notifier,
                    lost_writes: &self.lost_writes,
                    headroom: self.options.write_through_below,
                    ino: ino.0,
                    cached,
                };
                verdict.reply(result, reply);
                return;
            }
            // No space while the kernel may still release an unlinked file: written again on
            // a worker, which waits for the release first.
            drop(here);
            let fs = self.fs.clone();
            let notifier = self.notifier.clone();
            let lost_writes = self.lost_writes.clone();
            let headroom = self.options.write_through_below;
            let data = data.to_vec();
            let gate = self.sync_writes.clone();
            let waits = self.write_waits.clone();
            self.waiters.run(move || {
                let slot = WaitSlot(waits);
                let result = match result {
                    Ok(n) => Ok(n),
                    Err(_) => {
                        let write = || {
                            write_now(
                                &fs,
                                &notifier,
                                ino.0,
                                offset,
                                &data,
                                append,
                                kill.as_deref(),
                                false,
                                sync,
                            )
                        };
                        if through {
                            gate.run(ino.0, write)
                        } else {
                            write()
                        }
                    }
                };
                drop(slot);
                let verdict = WriteVerdict {
                    fs: &fs,
                    notifier: &notifier,
                    lost_writes: &lost_writes,
                    headroom,
                    ino: ino.0,
                    cached,
                };
                verdict.reply(result, reply);
            });
            return;
        }
        // A write-through waits for the device: off the request loop (see `waiters`).
        let fs = self.fs.clone();
        let notifier = self.notifier.clone();
        let data = data.to_vec();
        let gate = self.sync_writes.clone();
        self.waiters.run(move || {
            let result = gate.run(ino.0, || {
                write_now(
                    &fs,
                    &notifier,
                    ino.0,
                    offset,
                    &data,
                    append,
                    kill.as_deref(),
                    true,
                    sync,
                )
            });
            match result {
                Ok(n) => reply.written(n),
                Err(e) => reply.error(errno("write", &e)),
            }
        });
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock: LockOwner,
        reply: ReplyEmpty,
    ) {
        refuse_if_down!(self, reply);
        // Nothing to do at close: the kernel writes a file's dirty pages back before it sends
        // FLUSH (and reports their errors to close(2)) whether or not FLUSH is answered, and
        // POSIX locks are the kernel's. ENOSYS makes it stop sending FLUSH: one round trip
        // less per close(2).
        reply.error(Errno::ENOSYS);
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        flags: OpenFlags,
        _lock: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        refuse_if_down!(self, reply);
        if writes(flags.0) && self.write_opens.released(ino.0) {
            self.lost_writes.take(ino.0);
        }
        match self.fs.release(ino.0, fh.0 & !DIRECT_FH) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("release", &e)),
        }
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        refuse_if_down!(self, reply);
        // An fsync of a log-clean file (its records queued by the writes and SETATTRs before
        // it: 64 threads that write and fsync) parks no thread: the leader of its log batch
        // answers it after the batch's flush (DESIGN §11.4). Any other fsync waits on a thread
        // of its own, as a request that waits for the device does.
        let fs = self.fs.clone();
        let pool = self.waiters.clone();
        let done: FsyncDone = Box::new(move |outcome| match outcome {
            Ok(DeferredOutcome::Logged) => reply.ok(),
            // The log had no room: a commit, which blocks, on a worker.
            Ok(DeferredOutcome::LogFull(full)) => {
                pool.run(move || match fs.fsync_after_full(full) {
                    Ok(()) => reply.ok(),
                    Err(e) => reply.error(errno("fsync", &e)),
                })
            }
            Err(e) => reply.error(errno("fsync", &e)),
        });
        match self.fs.fsync_defer(ino.0, datasync, done) {
            Ok(None) => {}
            Ok(Some(ticket)) => {
                // No batch is being written: lead one (here when a loop stays free to read,
                // so a lone fsync pays no hand-off). On an io_uring queue thread with nothing
                // else fetched (a lone fsync), here too: one batch's write and flush hold up
                // only requests that arrive meanwhile, as the hop to a worker would.
                let fs = self.fs.clone();
                if fuser::ring_queue_idle() {
                    fs.fsync_lead(ticket);
                } else {
                    self.serve_waiting(move || fs.fsync_lead(ticket));
                }
            }
            Err(done) => {
                let fs = self.fs.clone();
                self.serve_waiting(move || match fs.fsync(ino.0, datasync) {
                    Ok(()) => done(Ok(DeferredOutcome::Logged)),
                    Err(e) => done(Err(e)),
                });
            }
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        refuse_if_down!(self, reply);
        // No per-open directory state: ENOSYS (with FUSE_NO_OPENDIR_SUPPORT) makes the kernel
        // stop sending OPENDIR and RELEASEDIR, two round trips per listing, and cache every
        // listing (`FOPEN_KEEP_CACHE | FOPEN_CACHE_DIR`), dropping it whenever the directory
        // changes through it; the daemon never changes a directory behind the kernel. Where a
        // listing ends travels in its cookies instead (`dir_cookie`). An inode that is gone
        // still answers as before (ENOENT), and a non-directory ENOTDIR.
        match self.fs.readdir_end(ino.0) {
            Ok(_) => reply.error(Errno::ENOSYS),
            Err(e) => reply.error(errno("opendir", &e)),
        }
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        // Never sent once OPENDIR is answered ENOSYS (no directory handles).
        refuse_if_down!(self, reply);
        reply.ok();
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        refuse_if_down!(self, reply);
        let (pos, end) = self.dir_range(ino.0, offset);
        match self.fs.readdir_until(ino.0, pos, 512, end) {
            Ok(entries) => {
                for e in entries {
                    if reply.add(
                        INodeNo(e.ino),
                        dir_cookie::encode(e.next_offset, end),
                        file_type(e.kind),
                        OsStr::from_bytes(&e.name),
                    ) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(errno("readdir", &e)),
        }
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        refuse_if_down!(self, reply);
        let (pos, end) = self.dir_range(ino.0, offset);
        match self.fs.readdir_until(ino.0, pos, 256, end) {
            Ok(entries) => {
                for e in entries {
                    // Entries other than "." and ".." count as lookups the kernel later forgets.
                    let attr = if e.name == b"." || e.name == b".." {
                        self.fs.getattr(e.ino)
                    } else {
                        self.fs.lookup_listed(ino.0, &e.name, e.ino)
                    };
                    let Ok(a) = attr else { continue };
                    if reply.add(
                        INodeNo(e.ino),
                        dir_cookie::encode(e.next_offset, end),
                        OsStr::from_bytes(&e.name),
                        &self.options.ttl,
                        &file_attr(&a),
                        Generation(a.generation),
                    ) {
                        if e.name != b"." && e.name != b".." {
                            self.fs.forget(e.ino, 1);
                        }
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(errno("readdirplus", &e)),
        }
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        refuse_if_down!(self, reply);
        let fs = self.fs.clone();
        let job = move || match fs.fsync(ino.0, datasync) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("fsyncdir", &e)),
        };
        self.serve_waiting(job);
    }

    fn ioctl(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        cmd: u32,
        in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        refuse_if_down!(self, reply);
        if cmd == FITRIM {
            self.fitrim(req, ino, in_data, reply);
            return;
        }
        if cmd != FS_IOC_SHUTDOWN {
            reply.error(Errno::ENOTTY);
            return;
        }
        if !caller_is_admin(req.pid(), req.uid()) {
            log::warn!(
                "FS_IOC_SHUTDOWN on inode {} refused: pid {} (uid {}) lacks CAP_SYS_ADMIN",
                ino.0,
                req.pid(),
                req.uid()
            );
            reply.error(Errno::EPERM);
            return;
        }
        log::warn!(
            "FS_IOC_SHUTDOWN from pid {} on inode {}: commit, then shut down",
            req.pid(),
            ino.0
        );
        // Its commit waits for the device: served as FSYNC is (see `waiters`).
        let fs = self.fs.clone();
        let job = move || match fs.shutdown(ShutdownMode::Commit) {
            Ok(()) => reply.ioctl(0, &[]),
            Err(e) => reply.error(errno("shutdown", &e)),
        };
        self.serve_waiting(job);
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        refuse_if_down!(self, reply);
        let s = self.fs.statfs();
        reply.statfs(
            s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.frsize,
        );
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        refuse_if_down!(self, reply);
        if ino.0 == 1 && name.as_bytes() == CONTROL_XATTR {
            match self.fs.control(value) {
                Ok(()) => {
                    let snapshot = value
                        .strip_prefix(b"snapshot-create ")
                        .or_else(|| value.strip_prefix(b"snapshot-delete "));
                    if let Some(name) = snapshot {
                        self.invalidator.snapshot_changed(name);
                        self.invalidate_attrs(birch_format::SNAPSHOT_DIR_OBJECTID);
                    }
                    reply.ok()
                }
                Err(e) => reply.error(errno("control", &e)),
            }
            return;
        }
        let acl = name.as_bytes() == ACL_ACCESS;
        // Setting an access ACL clears sgid for a caller outside the file's group without
        // CAP_FSETID (the kernel says so only with FUSE_SETXATTR_EXT, which fuser 0.18 does
        // not parse): for us a caller other than root, as for truncate.
        let groups = (acl && req.uid() != 0).then(|| self.all_groups(req));
        match self
            .fs
            .setxattr_by(ino.0, name.as_bytes(), value, flags, groups.as_deref())
        {
            Ok(()) => {
                if acl {
                    // An access ACL sets the mode (the kernel refreshes it after SETXATTR of
                    // an ACL; other callers of the library have no cache to drop).
                    self.invalidate_attrs(ino.0);
                }
                reply.ok()
            }
            Err(e) => reply.error(errno("setxattr", &e)),
        }
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        refuse_if_down!(self, reply);
        if ino.0 == 1 && name.as_bytes() == STATS_XATTR {
            xattr_reply(
                reply,
                size,
                stats_with_transport(self.fs.stats_json(), &self.adapter_pairs()).as_bytes(),
            );
            return;
        }
        if ino.0 == 1 && name.as_bytes() == SCRUB_XATTR {
            xattr_reply(reply, size, self.fs.scrub_status().as_bytes());
            return;
        }
        if ino.0 == 1 && name.as_bytes() == SNAPSHOTS_XATTR {
            xattr_reply(reply, size, self.fs.snapshots_text().as_bytes());
            return;
        }
        if ino.0 == 1 && name.as_bytes() == ALONE_XATTR {
            match self.fs.serving_alone() {
                Some(name) => xattr_reply(reply, size, name.as_bytes()),
                None => reply.error(Errno::from_i32(libc::ENODATA)),
            }
            return;
        }
        if let (1, Some(spec)) = (ino.0, name.as_bytes().strip_prefix(DIFF_XATTR_PREFIX)) {
            match diff_piece(&self.fs, spec) {
                Ok(piece) => xattr_reply(reply, size, &piece),
                Err(e) => reply.error(errno("getxattr diff", &e)),
            }
            return;
        }
        match self.fs.getxattr(ino.0, name.as_bytes()) {
            Ok(value) => xattr_reply(reply, size, &value),
            Err(e) => reply.error(errno("getxattr", &e)),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        refuse_if_down!(self, reply);
        match self.fs.listxattr(ino.0) {
            Ok(names) => xattr_reply(reply, size, &names),
            Err(e) => reply.error(errno("listxattr", &e)),
        }
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        refuse_if_down!(self, reply);
        match self.fs.removexattr(ino.0, name.as_bytes()) {
            Ok(()) => {
                if name.as_bytes() == ACL_ACCESS {
                    self.invalidate_attrs(ino.0);
                }
                reply.ok()
            }
            Err(e) => reply.error(errno("removexattr", &e)),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        refuse_if_down!(self, reply);
        match self.fs.create(
            caller(req, self.umask(umask)),
            parent.0,
            name.as_bytes(),
            mode,
            flags,
        ) {
            Ok((a, fh)) => {
                if writes(flags) {
                    self.write_opens.opened(a.ino);
                }
                let (fh, open_flags) = self.opened(fh, flags);
                reply.created(
                    &self.options.ttl,
                    &file_attr(&a),
                    Generation(a.generation),
                    fh,
                    open_flags,
                )
            }
            Err(e) => reply.error(errno("create", &e)),
        }
    }

    fn tmpfile(
        &self,
        req: &Request,
        parent: INodeNo,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        refuse_if_down!(self, reply);
        match self
            .fs
            .tmpfile(caller(req, self.umask(umask)), parent.0, mode, flags)
        {
            Ok((a, fh)) => {
                if writes(flags) {
                    self.write_opens.opened(a.ino);
                }
                let (fh, open_flags) = self.opened(fh, flags);
                reply.created(
                    &self.options.ttl,
                    &file_attr(&a),
                    Generation(a.generation),
                    fh,
                    open_flags,
                )
            }
            Err(e) => reply.error(errno("tmpfile", &e)),
        }
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        refuse_if_down!(self, reply);
        // What `file_modified` leaves to us (see `kill_privs_of_modify`): the caller's groups
        // when it lacks CAP_FSETID.
        let kill = (self.killpriv && req.uid() != 0).then(|| self.caller_groups(req, ino.0));
        let fs = self.fs.clone();
        let notifier = self.notifier.clone();
        let work = move || -> birch_core::Result<()> {
            fs.fallocate(ino.0, offset, length, mode)?;
            if let Some(groups) = &kill {
                fs.kill_privs(ino.0, groups)?;
            }
            Ok(())
        };
        let answer = move |result: birch_core::Result<()>, reply: ReplyEmpty| match result {
            Ok(()) => {
                // Times and block counts changed, and maybe the mode: the kernel refreshes
                // only size and times after a FALLOCATE.
                invalidate_attrs(&notifier, ino.0);
                reply.ok()
            }
            Err(e) => reply.error(errno("fallocate", &e)),
        };
        let result = work();
        if matches!(result, Err(Error::NoSpace(_))) && self.retry_on_worker() {
            // An unlinked file the kernel still holds may be released soon: again on a
            // worker, which waits for the release before it answers ENOSPC.
            self.waiters.run(move || answer(work(), reply));
            return;
        }
        answer(result, reply);
    }

    fn copy_file_range(
        &self,
        req: &Request,
        ino_in: INodeNo,
        _fh_in: FileHandle,
        offset_in: u64,
        ino_out: INodeNo,
        _fh_out: FileHandle,
        offset_out: u64,
        len: u64,
        _flags: fuser::CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        refuse_if_down!(self, reply);
        match self.fs.copy_file_range(
            ino_in.0,
            offset_in,
            ino_out.0,
            offset_out,
            len.min(COPY_MAX),
        ) {
            Ok(n) => {
                // The destination is written: suid/sgid go as for a WRITE (which the kernel
                // flags; a COPY_FILE_RANGE carries no flag).
                if n > 0 {
                    match self.kill_privs_of_modify(req, ino_out.0) {
                        Ok(()) => self.invalidate_attrs(ino_out.0),
                        Err(e) => log::warn!("copy_file_range: clearing suid/sgid: {e}"),
                    }
                }
                reply.written(n as u32)
            }
            Err(e) => reply.error(errno("copy_file_range", &e)),
        }
    }

    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        refuse_if_down!(self, reply);
        let Ok(offset) = u64::try_from(offset) else {
            // The kernel forwards only SEEK_DATA and SEEK_HOLE; at a negative offset both
            // answer ENXIO, as on ext4 and xfs (no data or hole "there").
            reply.error(Errno::ENXIO);
            return;
        };
        if self.writeback
            && (whence == libc::SEEK_DATA || whence == libc::SEEK_HOLE)
            && self.write_opens.any(ino.0)
        {
            // The kernel may hold written pages the daemon has not seen: a hole here could be
            // data there (cp would skip it). Have them written back first, on a worker: the
            // WRITEs of that writeback need a request loop, and over io_uring this thread is
            // its queue's only one (DESIGN §12.5).
            let fs = self.fs.clone();
            let invalidator = Invalidator {
                queue: self.invalidator.queue.clone(),
            };
            self.waiters.run(move || {
                if !invalidator.write_back(ino.0, WRITE_BACK_WAIT) {
                    log::warn!("lseek of inode {}: kernel writeback did not finish", ino.0);
                    reply.error(Errno::EIO);
                    return;
                }
                match fs.lseek(ino.0, offset, whence) {
                    Ok(at) => reply.offset(at as i64),
                    Err(e) => reply.error(errno("lseek", &e)),
                }
            });
            return;
        }
        match self.fs.lseek(ino.0, offset, whence) {
            Ok(at) => reply.offset(at as i64),
            Err(e) => reply.error(errno("lseek", &e)),
        }
    }
}

/// How long SEEK_DATA/SEEK_HOLE waits for the kernel to write an inode's pages back.
const WRITE_BACK_WAIT: Duration = Duration::from_secs(30);

/// Bytes one COPY_FILE_RANGE reply can report (the reply carries a u32).
const COPY_MAX: u64 = 1 << 30;

/// The xattr size-probe convention: size 0 asks for the length; too small a buffer is ERANGE.
fn xattr_reply(reply: ReplyXattr, size: u32, value: &[u8]) {
    if size == 0 {
        reply.size(value.len() as u32);
    } else if value.len() > size as usize {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `FITRIM` is `_IOWR('X', 121, struct fstrim_range)`, and its argument round-trips in
    /// the kernel's layout; another size is refused.
    #[test]
    fn fitrim_number_and_argument_match_the_kernel() {
        let iowr = |kind: u8, nr: u8, size: u32| {
            (3u32 << 30) | (size << 16) | (u32::from(kind) << 8) | u32::from(nr)
        };
        assert_eq!(FITRIM, iowr(b'X', 121, 24));
        let mut raw = Vec::new();
        for word in [4096u64, u64::MAX, 65536] {
            raw.extend_from_slice(&word.to_ne_bytes());
        }
        let range = FstrimRange::parse(&raw).expect("24 bytes parse");
        assert_eq!(
            range,
            FstrimRange {
                start: 4096,
                len: u64::MAX,
                minlen: 65536
            }
        );
        assert_eq!(range.bytes().as_slice(), raw.as_slice());
        assert_eq!(FstrimRange::parse(&raw[..16]), None);
    }

    #[test]
    fn a_readdir_cookie_carries_its_listing_end() {
        for (pos, end) in [
            (0, 0),
            (1, 5),
            (2, 2),
            (77, 1 << 20),
            ((1 << 31) - 1, (1 << 31) - 1),
        ] {
            let c = dir_cookie::encode(pos, Some(end));
            assert!(c < (1 << 63), "a non-negative loff_t");
            assert_eq!(dir_cookie::decode(c), (pos, Some(end)));
        }
        // Positions or ends past 31 bits: a plain position, no end.
        assert_eq!(
            dir_cookie::decode(dir_cookie::encode(1 << 31, Some(3))),
            (1 << 31, None)
        );
        assert_eq!(
            dir_cookie::decode(dir_cookie::encode(9, Some(1 << 31))),
            (9, None)
        );
        assert_eq!(dir_cookie::decode(dir_cookie::encode(9, None)), (9, None));
        // Cookies grow with the position within a listing, and a number below a listing's
        // largest cookie is a position inside it.
        let a = dir_cookie::encode(10, Some(100));
        let b = dir_cookie::encode(11, Some(100));
        assert!(a < b);
        let (pos, end) = dir_cookie::decode(b - 1);
        assert!(pos <= 11 && end.is_some());
    }

    /// The LOOKUPs the kernel sends to resolve an uncached file handle are counted in the
    /// stats: "." of a file and of a directory, ".." of a directory, and "." of a removed file
    /// (stale); an ordinary name counts in none of them.
    #[test]
    fn lookups_of_dot_and_dotdot_are_counted_in_the_stats() -> birch_core::Result<()> {
        use birch_core::device::MemDevice;
        use birch_core::vfs::Caller;
        use birch_core::{MkfsOptions, OpenOptions};
        let dev = Arc::new(MemDevice::new(64 << 20));
        Filesystem::mkfs(dev.clone(), &MkfsOptions::default())?;
        let options = OpenOptions {
            commit_interval: None,
            ..Default::default()
        };
        let fs = Arc::new(Filesystem::open_device(dev, options)?);
        let c = Caller::default();
        let dir = fs.mkdir(c, 1, b"d", 0o755)?;
        let sub = fs.mkdir(c, dir.ino, b"e", 0o755)?;
        fs.write_file("/d/e/f", b"data")?;
        fs.write_file("/d/gone", b"x")?;
        let file = fs.resolve("/d/e/f")?;
        let gone = fs.resolve("/d/gone")?;
        fs.unlink(dir.ino, b"gone")?;
        let adapter = BirchFuse::new(fs.clone(), FuseOptions::default());

        assert_eq!(adapter.lookup_counted(file, b".")?.ino, file);
        assert_eq!(adapter.lookup_counted(sub.ino, b".")?.ino, sub.ino);
        assert_eq!(adapter.lookup_counted(sub.ino, b"..")?.ino, dir.ino);
        assert_eq!(adapter.lookup_counted(dir.ino, b"..")?.ino, 1);
        assert_eq!(adapter.lookup_counted(dir.ino, b"e")?.ino, sub.ino);
        assert!(matches!(
            adapter.lookup_counted(gone, b"."),
            Err(Error::NotFound(_))
        ));
        let stats = stats_with_transport(fs.stats_json(), &adapter.handle_lookups.pairs());
        for want in [
            "\"lookup_dot\": 2",
            "\"lookup_dotdot\": 2",
            "\"lookup_dot_stale\": 1",
        ] {
            assert!(stats.contains(want), "{want} missing in {stats}");
        }
        assert!(stats.ends_with('}'), "{stats}");
        fs.close()
    }

    #[test]
    fn the_shutdown_ioctl_is_ior_x_125_of_a_u32() {
        // _IOR(type, nr, size) = read (2) << 30 | size << 16 | type << 8 | nr.
        let ior = (2u32 << 30) | (4 << 16) | (u32::from(b'X') << 8) | 125;
        assert_eq!(FS_IOC_SHUTDOWN, ior);
    }

    #[test]
    fn times_before_1970_from_the_kernel_keep_their_nanoseconds() {
        // What fuser 0.18 hands over for the wire value (-86400 s, 999999999 ns).
        let from_fuser = UNIX_EPOCH - Duration::new(86_400, 999_999_999);
        let t = timespec_from_kernel(from_fuser);
        assert_eq!((t.sec, t.nsec), (-86_400, 999_999_999));
        // Whole seconds and times after 1970 are unchanged.
        let t = timespec_from_kernel(UNIX_EPOCH - Duration::from_secs(5));
        assert_eq!((t.sec, t.nsec), (-5, 0));
        let t = timespec_from_kernel(UNIX_EPOCH + Duration::new(7, 3));
        assert_eq!((t.sec, t.nsec), (7, 3));
        // Our replies encode through system_time, which fuser turns back into (sec, nsec).
        let back = system_time(Timespec {
            sec: -86_400,
            nsec: 999_999_999,
        });
        assert_eq!(
            back,
            UNIX_EPOCH - Duration::from_secs(86_400) + Duration::from_nanos(999_999_999)
        );
    }
}
