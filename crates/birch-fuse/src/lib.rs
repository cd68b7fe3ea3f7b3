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
//! This file holds the adapter's state ([`BirchFuse`], [`FuseOptions`]), INIT and DESTROY, and
//! the `fuser::Filesystem` dispatch: each request goes to its family's module, `attrs`
//! (LOOKUP, GETATTR, SETATTR, READLINK, conversions to the kernel's types), `dirs` (names
//! and listings), `file_io` (OPEN to RELEASE, FSYNC, FALLOCATE, COPY_FILE_RANGE, LSEEK),
//! `xattrs` (xattrs and the root's control and report xattrs), `ioctls` (`FS_IOC_SHUTDOWN`,
//! `FITRIM`), with `invalidate` (what the kernel is told to drop), `full_disk` (ENOSPC under
//! the writeback cache), `waiters` (the worker pool), `sync_writes` (a benchmark-only gate, a no-op without the
//! `seed-before` feature)
//! and [`daemon`] (the process serving a mount).

#![warn(missing_docs)]

/// Answers `EIO` and returns from the handler once the filesystem is shut down: every request
/// that reaches the daemon then fails. (Defined before the modules that use it.)
macro_rules! refuse_if_down {
    ($self:ident, $reply:ident) => {
        if $self.fs.is_shut_down() {
            $reply.error(fuser::Errno::EIO);
            return;
        }
    };
}

mod attrs;
pub mod daemon;
mod dirs;
mod file_io;
mod full_disk;
mod invalidate;
mod ioctls;
mod sync_writes;
mod waiters;
mod xattrs;

use std::ffi::OsStr;
use std::path::Path;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use birch_core::Filesystem;
use birch_format::InodeNo;
use fuser::{
    Errno, FileHandle, INodeNo, InitFlags, IoctlFlags, KernelConfig, LockOwner, OpenFlags,
    RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty,
    ReplyEntry, ReplyIoctl, ReplyLseek, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request,
    TimeOrNow, WriteFlags,
};

use attrs::HandleLookups;
use file_io::WriteOpens;
use full_disk::LostWrites;
use invalidate::Invalidator;

pub use full_disk::DEFAULT_WRITE_THROUGH_BELOW;
pub use ioctls::{DefragRange, BTRFS_IOC_DEFRAG_RANGE, FITRIM, FS_IOC_SHUTDOWN};
pub use xattrs::{
    diff_xattr_name, ALONE_XATTR, CONTROL_XATTR, DIFF_CHUNK, DIFF_XATTR_PREFIX, ERRORS_XATTR,
    SCRUB_XATTR, SNAPSHOTS_XATTR, STATS_XATTR,
};

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
    /// "before"; only with the `seed-before` feature): synchronous and direct writes to one
    /// file are serialized in the daemon for the write and its flush.
    #[cfg(feature = "seed-before")]
    pub bench_serialize_sync_writes: bool,
}

/// The filesystem's inode number of a FUSE node id. The two are the same number: FUSE's root
/// node id (1) is the filesystem's root inode, and every other id the kernel holds is one a
/// reply gave it ([`node_of`]).
pub(crate) fn ino_of(node: INodeNo) -> InodeNo {
    InodeNo::new(node.0)
}

/// The FUSE node id of an inode number ([`ino_of`]'s inverse).
pub(crate) fn node_of(ino: InodeNo) -> INodeNo {
    INodeNo(ino.get())
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
            #[cfg(feature = "seed-before")]
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
        let invalidator = Invalidator::start(notifier.clone());
        // The kernel's cache keeps the pages of data the filesystem lost (a failed write or
        // flush): they go, so that reads serve what the filesystem holds (SEMANTICS §2).
        let dropper = invalidator.clone();
        fs.set_data_lost_hook(Arc::new(move |ino| dropper.drop_pages(ino.get())));
        let sync_writes = Arc::new(sync_writes::SyncWriteGate::for_options(&options));
        BirchFuse {
            fs,
            options,
            posix_acl: false,
            killpriv: false,
            invalidator,
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

    /// Serves `job`, a request that waits for the device, here when [`BirchFuse::serve_here`]
    /// allows it, else on a worker.
    fn serve_waiting(&self, job: impl FnOnce() + Send + 'static) {
        match self.serve_here() {
            Some(_here) => job(),
            None => self.waiters.run(job),
        }
    }

    /// What has the kernel drop an inode's pages without waiting (the invalidation thread's
    /// queue), for the mount to use when its device is lost.
    pub(crate) fn page_dropper(&self) -> Invalidator {
        self.invalidator.clone()
    }

    /// Where the mount puts the session's notifier once it exists.
    pub fn notifier_slot(&self) -> Arc<OnceLock<fuser::Notifier>> {
        self.notifier.clone()
    }
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
        self.op_lookup(parent, name, reply)
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.fs.forget(ino_of(ino), nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        self.op_getattr(ino, fh, reply)
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
        self.op_setattr(req, ino, mode, uid, gid, size, atime, mtime, ctime, reply)
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        self.op_readlink(ino, reply)
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
        self.op_mknod(req, parent, name, mode, umask, rdev, reply)
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
        self.op_mkdir(req, parent, name, mode, umask, reply)
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.op_unlink(parent, name, reply)
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.op_rmdir(parent, name, reply)
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        self.op_symlink(req, parent, link_name, target, reply)
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
        self.op_rename(req, parent, name, newparent, newname, flags, reply)
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        self.op_link(ino, newparent, newname, reply)
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        self.op_open(ino, flags, reply)
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
        self.op_read(ino, offset, size, reply)
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
        self.op_write(req, ino, fh, offset, data, write_flags, flags, reply)
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
        self.op_release(ino, fh, flags, reply)
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.op_fsync(ino, datasync, reply)
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        self.op_opendir(ino, reply)
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
        reply: ReplyDirectory,
    ) {
        self.op_readdir(ino, offset, reply)
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        reply: ReplyDirectoryPlus,
    ) {
        self.op_readdirplus(ino, offset, reply)
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.op_fsyncdir(ino, datasync, reply)
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
        self.op_ioctl(req, ino, cmd, in_data, reply)
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
        self.op_setxattr(req, ino, name, value, flags, reply)
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        self.op_getxattr(ino, name, size, reply)
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        self.op_listxattr(ino, size, reply)
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.op_removexattr(ino, name, reply)
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
        self.op_create(req, parent, name, mode, umask, flags, reply)
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
        self.op_tmpfile(req, parent, mode, umask, flags, reply)
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
        self.op_fallocate(req, ino, offset, length, mode, reply)
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
        self.op_copy_file_range(req, ino_in, offset_in, ino_out, offset_out, len, reply)
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
        self.op_lseek(ino, offset, whence, reply)
    }
}
