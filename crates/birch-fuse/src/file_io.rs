//! File I/O: OPEN, CREATE, TMPFILE (their handle flags: direct I/O, kept pages), READ,
//! WRITE (buffered, written through, or handed to a worker), RELEASE, FSYNC, FALLOCATE,
//! COPY_FILE_RANGE and LSEEK, with the count of open write handles per inode.
//! Must not touch: when a write-back hears ENOSPC (`full_disk` decides; WRITE only asks it),
//! the worker pool's rules (`waiters`).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::Ordering;
use std::sync::OnceLock;
use std::time::Duration;

use birch_core::vfs::{DeferredOutcome, FsyncDone};
use birch_core::{Error, Filesystem};
use fuser::{
    Errno, FileHandle, FopenFlags, Generation, INodeNo, OpenFlags, ReplyCreate, ReplyData,
    ReplyEmpty, ReplyLseek, ReplyOpen, ReplyWrite, Request, WriteFlags,
};

use crate::attrs::{caller, errno, file_attr};
use crate::full_disk::{WaitSlot, WriteVerdict, MAX_WRITE_WAITS};
use crate::invalidate::{invalidate_attrs, Invalidator};
use crate::{ino_of, BirchFuse};
use birch_format::InodeNo;

/// Open write handles per inode, in shards so that opens of different files rarely meet.
pub(crate) struct WriteOpens {
    shards: Vec<parking_lot::Mutex<HashMap<u64, u32>>>,
}

impl WriteOpens {
    const SHARDS: usize = 64;

    pub(crate) fn new() -> WriteOpens {
        WriteOpens {
            shards: (0..Self::SHARDS)
                .map(|_| parking_lot::Mutex::new(HashMap::new()))
                .collect(),
        }
    }

    pub(crate) fn shard(&self, ino: u64) -> &parking_lot::Mutex<HashMap<u64, u32>> {
        &self.shards[(ino as usize) % Self::SHARDS]
    }

    pub(crate) fn opened(&self, ino: u64) {
        *self.shard(ino).lock().entry(ino).or_insert(0) += 1;
    }

    /// Counts a handle closed; whether it was the inode's last.
    pub(crate) fn released(&self, ino: u64) -> bool {
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

    pub(crate) fn any(&self, ino: u64) -> bool {
        self.shard(ino).lock().contains_key(&ino)
    }
}

/// Whether open flags give write access.
pub(crate) fn writes(flags: i32) -> bool {
    flags & libc::O_ACCMODE != libc::O_RDONLY
}

/// Set in the handle of a direct-I/O open (`FOPEN_DIRECT_IO`). The filesystem's own handle
/// numbers count up from 1 and never reach it; it ignores the handle at release.
pub(crate) const DIRECT_FH: u64 = 1 << 63;

/// A WRITE's work: writes `data` at `offset` of `ino` (buffered unless `through`), tells the
/// kernel to drop the cached mode if the write cleared suid/sgid, and with `sync` set
/// (`Some(datasync)`) makes it durable before returning. Runs on a request loop, or on a
/// worker for writes that wait for the device.
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_now(
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
    let (n, dropped) = fs.write_mode(InodeNo::new(ino), offset, data, append, kill, through)?;
    if dropped {
        // The kernel keeps the old mode cached after a write: make it ask again.
        invalidate_attrs(notifier, ino);
    }
    if let Some(datasync) = sync {
        fs.fsync(InodeNo::new(ino), datasync)?;
    }
    Ok(n)
}

/// A READ's work: `size` bytes at `offset` of `ino`, moving atime as the filesystem's atime
/// mode says (noatime: no read moves it; exec and mmap reads reach us too), and telling the
/// kernel to drop the cached attributes if it moved.
pub(crate) fn read_now(
    fs: &Filesystem,
    notifier: &OnceLock<fuser::Notifier>,
    ino: u64,
    offset: u64,
    size: u32,
) -> birch_core::Result<Vec<u8>> {
    let (data, atime_moved) = fs.read_noting_atime(InodeNo::new(ino), offset, size as usize)?;
    if atime_moved {
        invalidate_attrs(notifier, ino);
    }
    Ok(data)
}

/// How long SEEK_DATA/SEEK_HOLE waits for the kernel to write an inode's pages back.
pub(crate) const WRITE_BACK_WAIT: Duration = Duration::from_secs(30);

/// Bytes one COPY_FILE_RANGE reply can report (the reply carries a u32).
pub(crate) const COPY_MAX: u64 = 1 << 30;

impl BirchFuse {
    /// The handle and reply flags of an OPEN or CREATE with open flags `flags` that the
    /// filesystem gave handle `fh`. A direct-I/O handle carries [`DIRECT_FH`], so WRITE knows
    /// the kernel will send no FSYNC after its synchronous writes.
    pub(crate) fn opened(&self, fh: u64, flags: i32) -> (FileHandle, FopenFlags) {
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

    pub(crate) fn op_open(&self, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        refuse_if_down!(self, reply);
        match self.fs.open_file(ino_of(ino), flags.0) {
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
                    match self.fs.atime_at_open(ino_of(ino)) {
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

    pub(crate) fn op_read(&self, ino: INodeNo, offset: u64, size: u32, reply: ReplyData) {
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

    #[allow(
        clippy::too_many_arguments,
        reason = "the arguments of fuser's `Filesystem::write`, which lib.rs forwards as they come"
    )]
    pub(crate) fn op_write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        flags: OpenFlags,
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
                    through,
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
                                through,
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

    pub(crate) fn op_release(
        &self,
        ino: INodeNo,
        fh: FileHandle,
        flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        refuse_if_down!(self, reply);
        if writes(flags.0) && self.write_opens.released(ino.0) {
            self.lost_writes.take(ino.0);
        }
        match self.fs.release(ino_of(ino), fh.0 & !DIRECT_FH) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("release", &e)),
        }
    }

    pub(crate) fn op_fsync(&self, ino: INodeNo, datasync: bool, reply: ReplyEmpty) {
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
        match self.fs.fsync_defer(ino_of(ino), datasync, done) {
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
                let invalidator = self.invalidator.clone();
                self.serve_waiting(move || match fs.fsync(ino_of(ino), datasync) {
                    Ok(()) => done(Ok(DeferredOutcome::Logged)),
                    Err(e) => {
                        if matches!(e, birch_core::Error::StickyIo(_)) {
                            // The file lost data: before the caller hears it, the kernel
                            // drops the pages that still hold the lost bytes (the hook asked
                            // already; this waits for it), so a read after the failed fsync
                            // reads what the filesystem holds.
                            invalidator.write_back(ino.0, WRITE_BACK_WAIT);
                        }
                        done(Err(e))
                    }
                });
            }
        }
    }

    #[allow(
        clippy::too_many_arguments,
        reason = "the arguments of fuser's `Filesystem::create`, which lib.rs forwards as they come"
    )]
    pub(crate) fn op_create(
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
            ino_of(parent),
            name.as_bytes(),
            mode,
            flags,
        ) {
            Ok((a, fh)) => self.reply_created(&a, fh, flags, reply),
            Err(e) => reply.error(errno("create", &e)),
        }
    }

    /// The reply to CREATE and TMPFILE: a new inode opened with `flags` as handle `fh` (a
    /// writing open counted for the dirty cap's wait).
    fn reply_created(&self, a: &birch_core::vfs::Attr, fh: u64, flags: i32, reply: ReplyCreate) {
        if writes(flags) {
            self.write_opens.opened(a.ino.get());
        }
        let (fh, open_flags) = self.opened(fh, flags);
        reply.created(
            &self.options.ttl,
            &file_attr(a),
            Generation(a.generation),
            fh,
            open_flags,
        )
    }

    pub(crate) fn op_tmpfile(
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
            .tmpfile(caller(req, self.umask(umask)), ino_of(parent), mode, flags)
        {
            Ok((a, fh)) => self.reply_created(&a, fh, flags, reply),
            Err(e) => reply.error(errno("tmpfile", &e)),
        }
    }

    pub(crate) fn op_fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
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
            fs.fallocate(ino_of(ino), offset, length, mode)?;
            if let Some(groups) = &kill {
                fs.kill_privs(ino_of(ino), groups)?;
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

    #[allow(
        clippy::too_many_arguments,
        reason = "the arguments of fuser's `Filesystem::copy_file_range`, which lib.rs forwards as they come"
    )]
    pub(crate) fn op_copy_file_range(
        &self,
        req: &Request,
        ino_in: INodeNo,
        offset_in: u64,
        ino_out: INodeNo,
        offset_out: u64,
        len: u64,
        reply: ReplyWrite,
    ) {
        refuse_if_down!(self, reply);
        match self.fs.copy_file_range(
            ino_of(ino_in),
            offset_in,
            ino_of(ino_out),
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

    pub(crate) fn op_lseek(&self, ino: INodeNo, offset: i64, whence: i32, reply: ReplyLseek) {
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
                match fs.lseek(ino_of(ino), offset, whence) {
                    Ok(at) => reply.offset(at as i64),
                    Err(e) => reply.error(errno("lseek", &e)),
                }
            });
            return;
        }
        match self.fs.lseek(ino_of(ino), offset, whence) {
            Ok(at) => reply.offset(at as i64),
            Err(e) => reply.error(errno("lseek", &e)),
        }
    }
}
