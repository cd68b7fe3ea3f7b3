//! File data and attributes: open, read, write, truncate, fallocate, lseek, setattr, fsync.
//!
//! Data lives in copy-on-write extents: a write has the data layer (`crate::data`) allocate new
//! blocks, write them (O_DIRECT, no flush) and replace the extent items covering the range;
//! blocks it stops referencing are freed, pinned until the commit is durable. Partial blocks
//! are read, verified and merged first. Files up to [`INLINE_MAX_BYTES`] live inline in their
//! extent item. This file keeps the POSIX side: sizes, times, `nbytes`, locks, errors.

#![deny(clippy::too_many_lines)]

use std::sync::atomic::Ordering;

use birch_format::items::{ExtentKind, InodeItem, Timespec};
use birch_format::log::LOG_DATA_TYPE;
use birch_format::{InodeNo, Key, BLOCK_SIZE, INLINE_MAX_BYTES, MAX_FILE_BYTES};

use super::durability::{LOG_DATA_WRITE_MAX, PLACED_MAX_BLOCKS};
use super::{attr_of, now, Attr, Filesystem, FsyncMode, InodeData, InodeState, SetAttr, SetTime};
use crate::data::{BlockDelta, DataLayer, ItemChange, Layout, WrittenRun};
use crate::error::{Error, Result};
use crate::txn::DataHold;

/// fallocate mode bits, as Linux defines them.
pub const FALLOC_FL_KEEP_SIZE: i32 = 0x01;
pub const FALLOC_FL_PUNCH_HOLE: i32 = 0x02;
pub const FALLOC_FL_ZERO_RANGE: i32 = 0x10;

fn round_up(v: u64) -> u64 {
    v.div_ceil(BLOCK_SIZE) * BLOCK_SIZE
}

/// How a write goes, decided before any lock ([`Filesystem::plan_write`]); under the lock a
/// drain or a racing writer may still change whether it buffers.
struct WritePlan {
    /// Whole blocks at a block offset, within the size limit.
    aligned: bool,
    /// Into the inode's write buffer, not through to the device.
    buffer: bool,
    /// New blocks allocated and their bytes placed in memory, not written by this request.
    place: bool,
}

/// What a write to a log-clean inode queues in the fsync log itself: the items it changed
/// (the inode item goes last), and the runs of placed blocks whose bytes it logs. Placed
/// blocks it does not log stay placed: the next commit writes them, and an fsync that logs
/// their extent first writes them in place (`settle_placed`).
struct OwnLog {
    items: Vec<ItemChange>,
    placed_runs: Option<Vec<WrittenRun>>,
}

/// When reads move a file's atime: the mount's atime flags. Linux decides this in the VFS
/// from the mount (`MNT_NOATIME`, `MNT_RELATIME`), which it cannot do for a FUSE filesystem
/// (its inodes are `S_NOATIME`), so the filesystem applies them itself, at each read and at an
/// open for reading. Directory listings never move atime (as `nodiratime`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AtimeMode {
    /// No read moves atime (`noatime`).
    NoAtime = 0,
    /// A read moves atime when it is not after mtime or ctime, or is a day old (`relatime`,
    /// the default).
    #[default]
    Relatime = 1,
    /// Every read moves atime (`strictatime`).
    StrictAtime = 2,
}

impl AtimeMode {
    /// The mode a mount option names: `noatime`, `relatime` (or `atime`), `strictatime`.
    pub fn from_option(option: &str) -> Option<AtimeMode> {
        match option {
            "noatime" => Some(AtimeMode::NoAtime),
            "relatime" | "atime" => Some(AtimeMode::Relatime),
            "strictatime" => Some(AtimeMode::StrictAtime),
            _ => None,
        }
    }

    /// The mount option that names this mode.
    pub fn option(self) -> &'static str {
        match self {
            AtimeMode::NoAtime => "noatime",
            AtimeMode::Relatime => "relatime",
            AtimeMode::StrictAtime => "strictatime",
        }
    }
}

impl Filesystem {
    /// The data layer: file data blocks and extent maps.
    pub(crate) fn data(&self) -> DataLayer<'_> {
        DataLayer::new(&self.inner.engine)
    }

    /// Whether a regular file keeps its data in blocks (not inline), so a block-aligned write
    /// goes to new blocks whatever the file holds.
    fn in_blocks(&self, ino: u64, data: &InodeData) -> Result<bool> {
        if data.item.mode & libc::S_IFMT != libc::S_IFREG {
            return Ok(false);
        }
        Ok(match self.data().layout(ino)? {
            Layout::Inline(_) => false,
            Layout::Blocks => true,
            Layout::Empty => !data.dirty.is_empty(),
        })
    }

    /// Opens `ino`; returns a handle number. A file of a snapshot opens for reading only
    /// (`EROFS` otherwise) and counts as open in it until its release.
    pub fn open_file(&self, ino: InodeNo, flags: i32) -> Result<u64> {
        let ino = ino.get();
        if let Some(node) = self.snap_node(ino) {
            return self.snap_open(node, flags);
        }
        let state = self.inode(ino)?;
        state.opens.fetch_add(1, Ordering::SeqCst);
        Ok(self.new_fh())
    }

    /// Closes a handle; the inode is freed here if this was its last use and it has no names.
    pub fn release(&self, ino: InodeNo, _fh: u64) -> Result<()> {
        let ino = ino.get();
        if let Some(node) = self.snap_node(ino) {
            self.snap_release(node);
            return Ok(());
        }
        let state = self.inode(ino)?;
        let _ = state
            .opens
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
                Some(v.saturating_sub(1))
            });
        let unlinked = state.data.read().item.nlink == 0;
        if unlinked
            && state.opens.load(Ordering::SeqCst) == 0
            && state.lookups.load(Ordering::SeqCst) == 0
        {
            self.evict_if_unused(ino)?;
        }
        Ok(())
    }

    /// Reads up to `size` bytes at `offset`.
    pub fn read(&self, ino: InodeNo, offset: u64, size: usize) -> Result<Vec<u8>> {
        self.read_noting_atime(ino, offset, size)
            .map(|(out, _)| out)
    }

    /// [`Filesystem::read`], and whether it moved atime (a cache in front of the filesystem,
    /// such as the kernel's attributes, then holds a stale one).
    pub fn read_noting_atime(
        &self,
        ino: InodeNo,
        offset: u64,
        size: usize,
    ) -> Result<(Vec<u8>, bool)> {
        let ino = ino.get();
        if let Some(node) = self.snap_node(ino) {
            // A snapshot never changes: no atime.
            return Ok((self.snap_read(node, offset, size)?, false));
        }
        let state = self.inode(ino)?;
        let out = {
            let data = state.data.read();
            if data.item.mode & libc::S_IFMT == libc::S_IFDIR {
                return Err(Error::IsDir(format!("read of dir {ino}")));
            }
            self.read_locked(ino, &data, offset, size)
                .inspect_err(|e| self.inner.error_files.note_read(ino, offset, e))?
        };
        let moved = self.touch_atime(ino, &state);
        Ok((out, moved))
    }

    /// Applies relatime as a read would, for an open for reading whose reads a page cache
    /// in front of the filesystem may serve without asking it. Returns whether atime moved.
    pub fn atime_at_open(&self, ino: InodeNo) -> Result<bool> {
        let ino = ino.get();
        if self.snap_node(ino).is_some() {
            return Ok(false);
        }
        let state = self.inode(ino)?;
        if state.data.read().item.mode & libc::S_IFMT != libc::S_IFREG {
            return Ok(false);
        }
        Ok(self.touch_atime(ino, &state))
    }

    /// When reads move atime from now on (the mount's atime flags, also after a remount).
    pub fn set_atime_mode(&self, mode: AtimeMode) {
        self.inner.atime.store(mode as u8, Ordering::Relaxed);
    }

    /// When reads move atime: relatime unless [`Filesystem::set_atime_mode`] said otherwise.
    pub fn atime_mode(&self) -> AtimeMode {
        match self.inner.atime.load(Ordering::Relaxed) {
            x if x == AtimeMode::NoAtime as u8 => AtimeMode::NoAtime,
            x if x == AtimeMode::StrictAtime as u8 => AtimeMode::StrictAtime,
            _ => AtimeMode::Relatime,
        }
    }

    /// Moves atime to now as the [`AtimeMode`] says (Linux's `atime_needs_update`): never
    /// with noatime; with relatime when it is older than mtime or ctime, or a day old; with
    /// strictatime always; and in no mode when it already says now. Returns whether it moved.
    fn touch_atime(&self, ino: u64, state: &super::InodeState) -> bool {
        let mode = self.atime_mode();
        if mode == AtimeMode::NoAtime {
            return false;
        }
        let t = now();
        let stale = {
            let d = state.data.read();
            d.item.atime != t
                && (mode == AtimeMode::StrictAtime
                    || d.item.atime <= d.item.mtime
                    || d.item.atime <= d.item.ctime
                    || t.sec - d.item.atime.sec >= 86_400)
        };
        if stale && self.inner.engine.read_only_reason().is_none() {
            let mut d = state.data.write();
            d.item.atime = t;
            return self.store_inode(ino, &mut d).is_ok();
        }
        false
    }

    /// Reads with the inode lock held.
    pub(crate) fn read_locked(
        &self,
        ino: u64,
        data: &InodeData,
        offset: u64,
        size: usize,
    ) -> Result<Vec<u8>> {
        let file_size = data.item.size;
        if offset >= file_size || size == 0 || data.freed {
            return Ok(Vec::new());
        }
        let end = file_size.min(offset.saturating_add(size as u64));
        if data.dirty.covers(offset, end) {
            // All of it is in the write buffer: no extent lookup, no device read, and the
            // bytes are copied out without zero-filling a buffer first.
            return Ok(data.dirty.read_covered(offset, end));
        }
        // Zeroed: holes and preallocated extents read as zeros.
        let mut out = vec![0u8; (end - offset) as usize];
        let data_layer = self.data();
        let extents = data_layer.extents(ino, offset, end)?;
        data_layer.read_extents_into(ino, &extents, offset, end, &mut out)?;
        data.dirty.overlay(offset, &mut out);
        Ok(out)
    }

    /// Writes `bytes` at `offset` (or at the end with `append`); returns bytes written.
    pub fn write(&self, ino: InodeNo, offset: u64, bytes: &[u8], append: bool) -> Result<u32> {
        Ok(self.write_with(ino, offset, bytes, append, None)?.0)
    }

    /// [`Filesystem::write`], and with `kill_privs` (the writer lacks CAP_FSETID, as FUSE's
    /// `FUSE_WRITE_KILL_SUIDGID` says; its groups, primary first) also what Linux does to such
    /// a write: suid cleared, sgid cleared when group-execute is set or the writer is not in
    /// the file's group, `security.capability` dropped. Returns the bytes written and whether
    /// privileges were dropped (a cached mode is stale then).
    pub fn write_with(
        &self,
        ino: InodeNo,
        offset: u64,
        bytes: &[u8],
        append: bool,
        kill_privs: Option<&[u32]>,
    ) -> Result<(u32, bool)> {
        self.write_mode(ino, offset, bytes, append, kill_privs, false)
    }

    /// [`Filesystem::write_with`]; with `through` (an O_DIRECT, O_SYNC or O_DSYNC write) the
    /// data goes to the device before this returns, else it is buffered (when the filesystem
    /// buffers writes, `OpenOptions::buffered`) and goes at the next commit, fsync of the
    /// file or dirty limit.
    pub fn write_mode(
        &self,
        ino: InodeNo,
        offset: u64,
        bytes: &[u8],
        append: bool,
        kill_privs: Option<&[u32]>,
        through: bool,
    ) -> Result<(u32, bool)> {
        let ino = ino.get();
        self.refuse_snapshot_change("write", &[ino])?;
        let written = self.retry_on_full(true, || {
            self.write_once(ino, offset, bytes, append, kill_privs, through)
        })?;
        if self.inner.compress.is_some() {
            // An append's offset is the size it found: the pass looks from there to the end.
            let (lo, hi) = if append {
                (offset, u64::MAX)
            } else {
                (offset, offset.saturating_add(u64::from(written.0)))
            };
            self.note_written(ino, lo, hi);
        }
        Ok(written)
    }

    fn write_once(
        &self,
        ino: u64,
        offset: u64,
        bytes: &[u8],
        append: bool,
        kill_privs: Option<&[u32]>,
        through: bool,
    ) -> Result<(u32, bool)> {
        let state = self.inode(ino)?;
        let plan = self.plan_write(ino, &state, offset, bytes, append, through)?;
        if !plan.buffer {
            // Written through: what this file buffered goes first, so the buffer never
            // holds older bytes than the extents.
            self.flush_inode(ino, &state)?;
        }
        // Whole blocks at a block offset of a file already in blocks (O_DIRECT writes, seed
        // 001): allocate and write the data before taking the inode lock, so writers to
        // different parts of one file overlap their device writes; the lock then only covers
        // recording the extents.
        let (likely_in_blocks, size_hint) = Self::blocks_hint(&state.data.read());
        // Bytes in the log only for a write at or past the end (a log or journal appended to
        // and fsync'd, a database's WAL): its placed blocks follow the file's last ones, so
        // the commit writes a run of appends in one write. Random overwrites in data records
        // would each cost a commit-time write of their own and the log bandwidth twice, and
        // fill the log so that commits come several times as often (sysbench random 8 KiB
        // writes with fsync: no faster, twice the bytes written; DESIGN §11.1).
        // Asked last: while the image lacks `INCOMPAT_LOG_DATA`, asking sets it at the next
        // commit, and only a write that would log its bytes should (an overwrite never does).
        let log_bytes =
            plan.place && likely_in_blocks && offset >= size_hint && self.log_data_allowed();
        let prewritten = if plan.aligned && likely_in_blocks && !plan.buffer {
            Some(self.prewrite(ino, &state, offset, bytes, plan.place)?)
        } else {
            None
        };
        let mut data = state.data.write();
        // Written blocks go back on every error until they are recorded.
        let (_op, in_blocks) = self.admit_locked_write(ino, &data, prewritten.as_deref())?;
        let offset = if append { data.item.size } else { offset };
        let t = now();
        // Items this write changed, kept when the inode is log-clean (everything it changed
        // since the last commit is queued in the fsync log): the write then queues its own
        // items, so an fsync right after it (an O_SYNC write) only waits for the batch
        // (`OwnLog`, with the placed runs whose bytes it logs).
        let own = match prewritten {
            // In blocks (the same look-ups write_locked would do); otherwise the blocks go
            // back and the general path writes.
            Some(extents) if in_blocks => {
                let clean = self.prewritten_log_clean(ino, &state, &mut data, &extents)?;
                let placed_runs = (log_bytes && clean).then(|| extents.clone());
                self.record_prewritten(ino, &mut data, offset, bytes.len() as u64, extents, clean)?
                    .map(|items| OwnLog { items, placed_runs })
            }
            Some(extents) => {
                self.data().give_back(&extents);
                self.flush_locked(ino, &mut data)?;
                self.write_locked(ino, &mut data, offset, bytes, None)?;
                None
            }
            None => {
                let buffer_now = plan.buffer && self.buffering();
                if !buffer_now {
                    // A drain began, or a write-through raced a buffered write in.
                    self.flush_locked(ino, &mut data)?;
                }
                self.write_locked(ino, &mut data, offset, bytes, buffer_now.then_some(&state))?;
                None
            }
        };
        let dropped = self
            .stamp_write(ino, &mut data, kill_privs, t)
            .inspect_err(|_| {
                // The extents may have changed and the inode item not: the inode is no
                // longer log-clean, whatever its inode item says.
                self.unmark_log_clean(ino);
            })?;
        match own {
            Some(own) if !dropped => {
                let generation = _op.generation().get();
                self.log_own_write(ino, &state, generation, own, &data.item, bytes);
            }
            // Dropped privileges changed an xattr item too: the next fsync collects.
            _ => {}
        }
        drop(_op);
        if !data.dirty.is_empty() {
            self.throttle_locked(ino, &mut data)?;
        }
        drop(data);
        self.maybe_commit();
        Ok((bytes.len() as u32, dropped))
    }

    /// Plans a write before any lock: whole blocks or not, into the buffer or written
    /// through, placed in memory or written in place ([`WritePlan`]).
    fn plan_write(
        &self,
        ino: u64,
        state: &InodeState,
        offset: u64,
        bytes: &[u8],
        append: bool,
        through: bool,
    ) -> Result<WritePlan> {
        // Buffered unless told otherwise, or unless this is a whole-block write to a file whose
        // every change since the commit is in the fsync log (log-clean: it is being fsync'd
        // write by write, as a database does): written through, the write queues its own
        // records and the fsync after it only waits for the batch, where a buffered write would
        // make that fsync flush and then collect the file's changed items. Decided again under
        // the locks (a drain may begin meanwhile).
        // Whole blocks at a block offset (within the size limit): such a write to a file in
        // blocks can be written before the inode lock (below).
        let aligned = !append
            && !bytes.is_empty()
            && offset % BLOCK_SIZE == 0
            && bytes.len() as u64 % BLOCK_SIZE == 0
            && offset
                .checked_add(bytes.len() as u64)
                .is_some_and(|end| end <= MAX_FILE_BYTES);
        let clean_before = aligned
            && self.inner.fsync_mode == FsyncMode::Log
            && self.log_clean_ticket(ino, state, true)?.is_some();
        let buffer = !through && self.buffering() && !clean_before;
        // A small write to a log-clean file (a database page or WAL record, then fsync) is
        // not written in place by this request: its blocks are allocated and their bytes
        // *placed* in memory (DESIGN §11.1). The fsync log's leader writes the placed blocks
        // its batch names, all batches' writes in one submission, before the batch; the
        // commit writes the rest. A small append goes further: its bytes go into the log
        // itself (a data record), so its fsync is one log write and one flush; only once the
        // image's superblock says its log may hold data records (older builds would stop
        // replay at one). Placed bytes are bounded (`PLACED_MAX_BLOCKS`): past that, writes
        // go in place as before.
        let place = clean_before
            && bytes.len() <= LOG_DATA_WRITE_MAX
            && self.inner.engine.pending().blocks() < PLACED_MAX_BLOCKS;
        Ok(WritePlan {
            aligned,
            buffer,
            place,
        })
    }

    /// Whether a file is likely in blocks, and its size, without a tree search: a regular
    /// file larger than the inline limit is, in practice, in blocks; the exact check, under
    /// the lock, decides ([`Filesystem::admit_locked_write`]).
    fn blocks_hint(data: &InodeData) -> (bool, u64) {
        (
            data.item.mode & libc::S_IFMT == libc::S_IFREG
                && data.item.size > INLINE_MAX_BYTES as u64,
            data.item.size,
        )
    }

    /// The blocks a whole-block write writes before the inode lock: allocated and written,
    /// or (with `place`) allocated and placed in memory. An I/O error marks the inode's
    /// write error.
    fn prewrite(
        &self,
        ino: u64,
        state: &InodeState,
        offset: u64,
        bytes: &[u8],
        place: bool,
    ) -> Result<Vec<WrittenRun>> {
        let written = if place {
            self.data().place_new(ino, offset, bytes)
        } else {
            self.data().write_new(ino, offset, bytes)
        };
        written.inspect_err(|e| {
            if matches!(e, Error::Io { .. }) {
                state.data.write().write_error = true;
                self.data_lost(ino);
            }
        })
    }

    /// A write's first steps under the inode lock, before it changes anything: holds the
    /// operation's transaction open, refuses a directory, and answers whether `prewritten`
    /// blocks can be recorded as they are (the file is in blocks). The blocks go back on
    /// every error.
    fn admit_locked_write(
        &self,
        ino: u64,
        data: &InodeData,
        prewritten: Option<&[WrittenRun]>,
    ) -> Result<(DataHold<'_>, bool)> {
        let op = self.inner.engine.hold().inspect_err(|_| {
            self.data().give_back(prewritten.unwrap_or_default());
        })?;
        if data.item.mode & libc::S_IFMT == libc::S_IFDIR {
            self.data().give_back(prewritten.unwrap_or_default());
            return Err(Error::IsDir(format!("write to dir {ino}")));
        }
        let in_blocks = match prewritten {
            Some(runs) => self.in_blocks(ino, data).inspect_err(|_| {
                self.data().give_back(runs);
            })?,
            None => false,
        };
        Ok((op, in_blocks))
    }

    /// Whether a write of prewritten blocks logs its own items: the inode is log-clean under
    /// the lock. A buffered write that raced in since the flush before the lock goes first.
    /// The blocks go back on either error.
    fn prewritten_log_clean(
        &self,
        ino: u64,
        state: &InodeState,
        data: &mut InodeData,
        extents: &[WrittenRun],
    ) -> Result<bool> {
        // A buffered write that raced in since the flush above goes first.
        if let Err(e) = self.flush_locked(ino, data) {
            self.data().give_back(extents);
            return Err(e);
        }
        Ok(self.inner.fsync_mode == FsyncMode::Log
            && data.item.nlink > 0
            && !data.write_error
            && match self.log_clean_ticket(ino, state, true) {
                Ok(ticket) => ticket.is_some(),
                Err(e) => {
                    self.data().give_back(extents);
                    return Err(e);
                }
            })
    }

    /// Records prewritten blocks as the extents of `[offset, offset + len)` and grows the
    /// size; with `clean`, returns the items it changed. On an error the inode is no longer
    /// log-clean.
    fn record_prewritten(
        &self,
        ino: u64,
        data: &mut InodeData,
        offset: u64,
        len: u64,
        extents: Vec<WrittenRun>,
        clean: bool,
    ) -> Result<Option<Vec<ItemChange>>> {
        let items = self
            .record_new_blocks(ino, data, offset, len, extents, clean)
            .inspect_err(|_| self.unmark_log_clean(ino))?;
        data.item.size = data.item.size.max(offset + len);
        Ok(items)
    }

    /// A write's inode changes once its data is recorded: privileges dropped (with
    /// `kill_privs`), mtime and ctime set to `t`, the inode item stored. Returns whether
    /// privileges were dropped.
    fn stamp_write(
        &self,
        ino: u64,
        data: &mut InodeData,
        kill_privs: Option<&[u32]>,
        t: Timespec,
    ) -> Result<bool> {
        let dropped = match kill_privs {
            Some(groups) => self.kill_privs_locked(ino, data, Some(groups))?,
            None => false,
        };
        data.item.mtime = t;
        data.item.ctime = t;
        self.store_inode(ino, data)?;
        Ok(dropped)
    }

    /// Queues a log-clean write's own items in the fsync log (the inode item `item` last),
    /// after the bytes of its placed runs as data records.
    fn log_own_write(
        &self,
        ino: u64,
        state: &InodeState,
        generation: u64,
        own: OwnLog,
        item: &InodeItem,
        bytes: &[u8],
    ) {
        let OwnLog {
            mut items,
            placed_runs,
        } = own;
        items.push((super::inode_key(InodeNo::new(ino)), Some(item.encode())));
        if let Some(runs) = placed_runs.as_deref() {
            // The bytes go first, as data records: a log batch never names a placed
            // block whose bytes are not in it or an earlier one.
            let mut records = self.log_data_records(ino, runs, bytes);
            records.append(&mut items);
            items = records;
        }
        self.log_write(ino, state, generation, items);
        if placed_runs.is_some() {
            self.log_data_room();
        }
    }

    /// The data records that carry `bytes`, written to the placed `runs`, in the log; marks
    /// the runs logged.
    fn log_data_records(&self, ino: u64, runs: &[WrittenRun], bytes: &[u8]) -> Vec<ItemChange> {
        let mut records = Vec::with_capacity(runs.len());
        let mut done = 0usize;
        for run in runs {
            let len = run.csums.len() * BLOCK_SIZE as usize;
            self.inner
                .engine
                .pending()
                .mark_logged(run.addr, len as u64);
            records.push((
                Key {
                    objectid: ino,
                    item_type: LOG_DATA_TYPE,
                    offset: run.addr,
                },
                Some(bytes[done..done + len].to_vec()),
            ));
            done += len;
        }
        let counters = self.inner.engine.counters();
        counters.add(|c| &c.log_data_records, runs.len() as u64);
        counters.add(|c| &c.log_data_bytes, done as u64);
        records
    }

    /// Writes with the inode lock held; updates size and nbytes, not times, and stores the
    /// extent items (the caller stores the inode item). With `buffer` (the inode's state),
    /// data bound for blocks is buffered instead of written (inline data is item data and
    /// goes to the delta either way).
    pub(crate) fn write_locked(
        &self,
        ino: u64,
        data: &mut InodeData,
        offset: u64,
        bytes: &[u8],
        buffer: Option<&std::sync::Arc<super::InodeState>>,
    ) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        let end = offset
            .checked_add(bytes.len() as u64)
            .filter(|e| *e <= MAX_FILE_BYTES)
            .ok_or_else(|| Error::TooBig(format!("write to inode {ino} at {offset}")))?;
        let new_size = data.item.size.max(end);
        // Any extent (even preallocated past EOF on an empty file) or buffered block means
        // the file is in blocks.
        let (inline, has_blocks) = match self.data().layout(ino)? {
            Layout::Inline(content) => (Some(content), false),
            Layout::Blocks => (None, true),
            Layout::Empty => (None, !data.dirty.is_empty()),
        };
        if !has_blocks && new_size <= INLINE_MAX_BYTES as u64 {
            let mut content = self.read_locked(ino, data, 0, data.item.size as usize)?;
            content.resize(new_size as usize, 0);
            content[offset as usize..end as usize].copy_from_slice(bytes);
            self.data().set_inline(ino, content)?;
            data.item.size = new_size;
            return Ok(());
        }
        if let Some(inline) = inline {
            // Grows past the inline limit: move the inline bytes to a block first.
            self.inline_to_block(ino, data, inline)?;
        }
        if let Some(state) = buffer {
            return self.buffer_write_locked(ino, state, data, offset, bytes);
        }
        // Build whole blocks: merge partial head and tail blocks with what is there. The
        // buffer is this thread's, reused, and filled only by copying: a fresh zeroed one per
        // WRITE of up to 1 MiB cost a page fault and the kernel's zeroing of new pages every
        // time (perf: untar, sysbench random writes).
        let first = offset / BLOCK_SIZE * BLOCK_SIZE;
        let last_end = round_up(end);
        let mut buf = MergeBuf::take((last_end - first) as usize);
        let head = if offset != first {
            self.read_locked(ino, data, first, BLOCK_SIZE as usize)?
        } else {
            Vec::new()
        };
        // Bytes past the file's end (a short read) are zeros.
        buf.extend_padded(&head, 0, (offset - first) as usize);
        buf.extend(bytes);
        if end != last_end {
            let tail_start = last_end - BLOCK_SIZE;
            // Inside one block whose head was read, the head holds the tail too.
            let tail = if tail_start == first && offset != first {
                head
            } else {
                self.read_locked(ino, data, tail_start, BLOCK_SIZE as usize)?
            };
            buf.extend_padded(&tail, (end - tail_start) as usize, BLOCK_SIZE as usize);
        }
        debug_assert_eq!(buf.len() as u64, last_end - first);
        self.write_blocks(ino, data, first, &buf)?;
        data.item.size = new_size;
        Ok(())
    }

    /// Writes whole blocks at a block-aligned file offset into new extents.
    fn write_blocks(&self, ino: u64, data: &mut InodeData, offset: u64, buf: &[u8]) -> Result<()> {
        let runs = self.data().write_new(ino, offset, buf).inspect_err(|e| {
            if matches!(e, Error::Io { .. }) {
                data.write_error = true;
                self.data_lost(ino);
            }
        })?;
        self.record_new_blocks(ino, data, offset, buf.len() as u64, runs, false)
            .map(|_| ())
    }

    /// Replaces `[offset, offset + len)` of the file with `runs` the data layer wrote, with
    /// the inode lock held, and moves `nbytes`. With `keep`, returns the items it set and
    /// deleted.
    pub(super) fn record_new_blocks(
        &self,
        ino: u64,
        data: &mut InodeData,
        offset: u64,
        len: u64,
        runs: Vec<WrittenRun>,
        keep: bool,
    ) -> Result<Option<Vec<ItemChange>>> {
        let (delta, kept) = self.data().replace_range(ino, offset, len, runs, keep)?;
        Self::account(data, delta);
        Ok(kept)
    }

    /// Moves the inode's `nbytes` by the blocks an extent-map change added and freed.
    fn account(data: &mut InodeData, delta: BlockDelta) {
        data.item.nbytes = delta.apply_to(data.item.nbytes);
    }

    /// Runs an operation; on ENOSPC commits (space freed earlier is pinned until a commit is
    /// durable) and retries before the caller sees the error. Once always, and again while
    /// the failed attempt left pinned space behind: other writers free and take space
    /// meanwhile (xfstests generic/371 writes, fallocates and removes 80 MiB files side by
    /// side on a 256 MiB filesystem), so one commit may not be enough. At most
    /// [`Self::FULL_RETRIES`] commits.
    /// `grows`: whether the operation may add items (see [`Filesystem::admit`]).
    /// Then, before answering ENOSPC, it waits while unlinked files the kernel still holds
    /// may be released ([`Filesystem::wait_for_releases`], on threads that may wait), and
    /// starts over after each one freed.
    fn retry_on_full<T>(&self, grows: bool, mut op: impl FnMut() -> Result<T>) -> Result<T> {
        self.admit(grows)?;
        let mut commits = 0;
        loop {
            let seen = self.releases_seen();
            match op() {
                Err(Error::NoSpace(why)) => {
                    let pinned = self.inner.engine.allocator().pinned_blocks().get();
                    if commits == Self::FULL_RETRIES || (commits > 0 && pinned == 0) {
                        if self.may_wait_for_releases() && self.wait_for_releases(seen, || false) {
                            commits = 0;
                            continue;
                        }
                        return Err(Error::NoSpace(why));
                    }
                    self.commit_now()?;
                    commits += 1;
                }
                other => return other,
            }
        }
    }

    /// Most commits an operation that found the filesystem full forces before it answers
    /// ENOSPC ([`Self::retry_on_full`]).
    const FULL_RETRIES: usize = 4;

    /// Drops every extent byte in the block-aligned range `[from, to)` (pieces outside it
    /// are kept, blocks inside freed) and moves `nbytes`.
    fn drop_range_locked(&self, ino: u64, data: &mut InodeData, from: u64, to: u64) -> Result<()> {
        let delta = self.data().drop_range(ino, from, to)?;
        Self::account(data, delta);
        Ok(())
    }

    /// Sets the size with the lock held: drops blocks past it, zeroes the tail of the last
    /// block, and keeps inline files inline.
    fn truncate_locked(&self, ino: u64, data: &mut InodeData, new_size: u64) -> Result<()> {
        if new_size > MAX_FILE_BYTES {
            return Err(Error::TooBig(format!("truncate inode {ino} to {new_size}")));
        }
        let old = data.item.size;
        if new_size == old {
            return Ok(());
        }
        // An explicit size: a later failed flush of buffered data keeps it (buffer.rs).
        data.dirty.forget_size_before();
        if let Some(inline) = self.data().inline_data(ino)? {
            if new_size <= INLINE_MAX_BYTES as u64 {
                let mut content = inline;
                content.resize(new_size as usize, 0);
                if new_size == 0 {
                    self.data().remove_inline(ino)?;
                } else {
                    self.data().set_inline(ino, content)?;
                }
                data.item.size = new_size;
                return Ok(());
            }
            // Growing past the inline limit: the bytes move to a block, the rest is a hole.
            if inline.is_empty() {
                self.data().remove_inline(ino)?;
            } else {
                self.inline_to_block(ino, data, inline)?;
            }
            data.item.size = new_size;
            return Ok(());
        }
        if new_size < old {
            // Buffered blocks past the new end go; the one holding it is zeroed past it.
            self.drop_buffered_from(data, new_size);
            // One pass over everything past the new end, preallocated extents beyond EOF
            // (fallocate KEEP_SIZE) included: two passes would plan from the same old extent.
            let keep_end = round_up(new_size);
            self.drop_range_locked(ino, data, keep_end, u64::MAX / 2)?;
            if new_size % BLOCK_SIZE != 0 && !data.dirty.holds(new_size / BLOCK_SIZE) {
                let tail_start = new_size / BLOCK_SIZE * BLOCK_SIZE;
                let mapped = self
                    .data()
                    .extents(ino, tail_start, tail_start + 1)?
                    .into_iter()
                    .any(|(_, e)| match e.kind {
                        // Bytes past the new end in the tail block are data to zero (a blob's
                        // window too: its stored bytes are not cut).
                        ExtentKind::Regular { .. } | ExtentKind::Blob(_) => true,
                        // Preallocated blocks read as zeros already; an inline file was cut
                        // above.
                        ExtentKind::Inline(_) | ExtentKind::Prealloc { .. } => false,
                    });
                if mapped {
                    data.item.size = new_size;
                    let mut block = self.read_locked(ino, data, tail_start, BLOCK_SIZE as usize)?;
                    block.resize(BLOCK_SIZE as usize, 0);
                    self.write_blocks(ino, data, tail_start, &block)?;
                }
            }
        }
        data.item.size = new_size;
        Ok(())
    }

    /// setattr: mode, owner, size, times. ctime moves on every change.
    pub fn setattr(&self, ino: InodeNo, set: &SetAttr) -> Result<Attr> {
        let ino = ino.get();
        self.refuse_snapshot_change("setattr", &[ino])?;
        self.retry_on_full(false, || self.setattr_once(ino, set))
    }

    fn setattr_once(&self, ino: u64, set: &SetAttr) -> Result<Attr> {
        let state = self.inode(ino)?;
        let mut data = state.data.write();
        let _op = self.inner.engine.hold()?;
        let t = now();
        // Times only (the kernel's SETATTR of mtime and ctime before every FSYNC under the
        // writeback cache, touch, utimes) on a log-clean inode: the new inode item is queued
        // in the log here, as a synchronous write queues its own items, so the inode stays
        // log-clean and the fsync after it only waits for the batch instead of collecting
        // every item the inode changed since the commit.
        let times_only =
            set.size.is_none() && set.mode.is_none() && set.uid.is_none() && set.gid.is_none();
        let log_own = times_only
            && self.inner.fsync_mode == FsyncMode::Log
            && data.item.nlink > 0
            && !data.write_error
            && self.log_clean_ticket(ino, &state, true)?.is_some();
        if let Some(size) = set.size {
            match data.item.mode & libc::S_IFMT {
                libc::S_IFDIR => return Err(Error::IsDir(format!("truncate of dir {ino}"))),
                libc::S_IFREG => {}
                _ => return Err(Error::Invalid(format!("truncate of special file {ino}"))),
            }
            if size != data.item.size {
                self.truncate_locked(ino, &mut data, size)?;
            }
            if set.kill_privs {
                self.kill_privs_locked(ino, &mut data, set.caller_groups.as_deref())?;
            }
            data.item.mtime = t;
        }
        if let Some(mode) = set.mode {
            data.item.mode = (data.item.mode & libc::S_IFMT) | (mode & 0o7777);
            // An access ACL follows chmod: owner, mask (or group) and other take the new bits.
            if let Some(acl) = self.xattr_value(ino, &data, super::acl::ACL_ACCESS)? {
                let updated = super::acl::chmod(&acl, mode)?;
                let xattrs = [birch_format::items::Xattr {
                    name: super::acl::ACL_ACCESS.to_vec(),
                    value: updated,
                    spill: None,
                }];
                self.inner.engine.begin()?.put(
                    super::xattr::xattr_key(InodeNo::new(ino), super::acl::ACL_ACCESS),
                    birch_format::items::encode_xattrs(&xattrs),
                );
                *data.xattrs_absent.get_mut() = 0;
            }
        }
        if set.uid.is_some() || set.gid.is_some() {
            // chown of a non-directory: suid always goes, sgid as for a write (Linux's
            // chown_common asks for ATTR_KILL_SUID | ATTR_KILL_SGID | ATTR_KILL_PRIV).
            self.kill_privs_locked(ino, &mut data, set.caller_groups.as_deref())?;
        }
        if let Some(uid) = set.uid {
            data.item.uid = uid;
        }
        if let Some(gid) = set.gid {
            data.item.gid = gid;
        }
        let pick = |s: SetTime| match s {
            SetTime::Now => t,
            SetTime::At(ts) => ts,
        };
        if let Some(a) = set.atime {
            data.item.atime = pick(a);
        }
        if let Some(m) = set.mtime {
            data.item.mtime = pick(m);
        }
        data.item.ctime = set.ctime.unwrap_or(t);
        self.store_inode(ino, &mut data)?;
        if log_own {
            let item = (
                super::inode_key(InodeNo::new(ino)),
                Some(data.item.encode()),
            );
            self.log_write(ino, &state, _op.generation().get(), vec![item]);
        }
        Ok(attr_of(ino, &data.item))
    }

    /// fallocate with Linux modes: default, KEEP_SIZE, PUNCH_HOLE (with KEEP_SIZE) and
    /// ZERO_RANGE. Preallocated blocks read as zeros.
    pub fn fallocate(&self, ino: InodeNo, offset: u64, len: u64, mode: i32) -> Result<()> {
        let ino = ino.get();
        self.refuse_snapshot_change("fallocate", &[ino])?;
        // Punching a hole frees space: allowed on a full filesystem, as unlink is.
        let grows = mode & libc::FALLOC_FL_PUNCH_HOLE == 0;
        self.retry_on_full(grows, || self.fallocate_once(ino, offset, len, mode))
    }

    fn fallocate_once(&self, ino: u64, offset: u64, len: u64, mode: i32) -> Result<()> {
        // Linux's order (vfs_fallocate): length, mode bits, PUNCH_HOLE rules, file type, size.
        if len == 0 {
            return Err(Error::Invalid("fallocate of length 0".into()));
        }
        let known = FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE;
        if mode & !known != 0 {
            return Err(Error::NotSupported(format!("fallocate mode {mode:#x}")));
        }
        if mode & FALLOC_FL_PUNCH_HOLE != 0
            && (mode & FALLOC_FL_KEEP_SIZE == 0 || mode & FALLOC_FL_ZERO_RANGE != 0)
        {
            return Err(Error::NotSupported(
                "PUNCH_HOLE needs KEEP_SIZE and excludes ZERO_RANGE".into(),
            ));
        }
        let state = self.inode(ino)?;
        let mut data = state.data.write();
        match data.item.mode & libc::S_IFMT {
            libc::S_IFREG => {}
            libc::S_IFDIR => return Err(Error::IsDir(format!("fallocate of dir {ino}"))),
            _ => return Err(Error::NoDevice(format!("fallocate of special file {ino}"))),
        }
        let end = offset
            .checked_add(len)
            .filter(|e| *e <= MAX_FILE_BYTES)
            .ok_or_else(|| Error::TooBig(format!("fallocate inode {ino} at {offset}+{len}")))?;
        // Buffered data goes to disk first: the range operations below work on extents.
        self.flush_locked(ino, &mut data)?;
        let _op = self.inner.engine.hold()?;
        let t = now();
        if mode & FALLOC_FL_PUNCH_HOLE != 0 {
            let size = data.item.size;
            self.zero_range_locked(ino, &mut data, offset, end.min(size))?;
        } else if mode & FALLOC_FL_ZERO_RANGE != 0 {
            let size = data.item.size;
            self.zero_range_locked(ino, &mut data, offset, end.min(size))?;
            if mode & FALLOC_FL_KEEP_SIZE == 0 && end > size {
                self.truncate_locked(ino, &mut data, end)?;
            }
        } else {
            self.preallocate_locked(ino, &mut data, offset, end)?;
            if mode & FALLOC_FL_KEEP_SIZE == 0 && end > data.item.size {
                data.item.size = end;
            }
        }
        data.item.ctime = t;
        data.item.mtime = t;
        self.store_inode(ino, &mut data)?;
        Ok(())
    }

    /// Makes `[from, to)` read as zeros: partial blocks are rewritten, whole blocks dropped.
    fn zero_range_locked(&self, ino: u64, data: &mut InodeData, from: u64, to: u64) -> Result<()> {
        if from >= to {
            return Ok(());
        }
        if let Some(mut inline) = self.data().inline_data(ino)? {
            let hi = (to as usize).min(inline.len());
            if (from as usize) < hi {
                inline[from as usize..hi].fill(0);
            }
            self.data().set_inline(ino, inline)?;
            return Ok(());
        }
        let first_full = round_up(from);
        let last_full = to / BLOCK_SIZE * BLOCK_SIZE;
        let size = data.item.size;
        let zero_partial = |lo: u64, hi: u64, data: &mut InodeData| -> Result<()> {
            let mapped = !self.data().extents(ino, lo, hi)?.is_empty();
            if mapped && lo < hi {
                self.write_locked(ino, data, lo, &vec![0u8; (hi - lo) as usize], None)?;
                data.item.size = size;
            }
            Ok(())
        };
        if first_full > last_full {
            return zero_partial(from, to, data);
        }
        zero_partial(from, first_full, data)?;
        zero_partial(last_full, to, data)?;
        if first_full < last_full {
            self.drop_range_locked(ino, data, first_full, last_full)?;
        }
        Ok(())
    }

    /// Moves an inline file's bytes to the file's first block (it grows past the inline limit
    /// or gets preallocated space). If the block cannot be written (`ENOSPC`, say) the inline
    /// extent is put back, so a failed write, truncate or fallocate leaves the file's bytes as
    /// they were instead of a hole.
    fn inline_to_block(&self, ino: u64, data: &mut InodeData, inline: Vec<u8>) -> Result<()> {
        let mut block = inline.clone();
        block.resize(BLOCK_SIZE as usize, 0);
        self.data().remove_inline(ino)?;
        if let Err(e) = self.write_blocks(ino, data, 0, &block) {
            self.data().set_inline(ino, inline)?;
            return Err(e);
        }
        Ok(())
    }

    /// Allocates preallocated extents for every unmapped block in `[from, to)`.
    fn preallocate_locked(&self, ino: u64, data: &mut InodeData, from: u64, to: u64) -> Result<()> {
        if let Some(inline) = self.data().inline_data(ino)? {
            self.inline_to_block(ino, data, inline)?;
        }
        let delta = self.data().preallocate(ino, from, to)?;
        Self::account(data, delta);
        Ok(())
    }

    /// SEEK_DATA (3) and SEEK_HOLE (4).
    pub fn lseek(&self, ino: InodeNo, offset: u64, whence: i32) -> Result<u64> {
        let ino = ino.get();
        if let Some(node) = self.snap_node(ino) {
            return self.snap_lseek(node, offset, whence);
        }
        let state = self.inode(ino)?;
        // Buffered ranges are data: on disk first, so the extents say where data is.
        self.flush_inode(ino, &state)?;
        let data = state.data.read();
        crate::data::seek_data_or_hole(
            format_args!("inode {ino}"),
            data.item.size,
            offset,
            whence,
            |from, to| self.data().extents(ino, from, to),
        )
    }

    /// copy_file_range. Returns the bytes copied; short at the source's end. When both
    /// offsets lie at the same place within a block, the whole blocks of the range are
    /// shared instead of copied (a clone, DESIGN §15.8: the destination's extents name the
    /// source's blocks, both flagged shared; a later write to either copy takes new blocks for
    /// what it touches); the unaligned head and tail, inline files and ranges whose offsets
    /// differ within a block are copied as bytes. Within one file the ranges must not overlap:
    /// `Invalid` (`EINVAL`), as the kernel answers before such a call reaches a FUSE server.
    pub fn copy_file_range(
        &self,
        ino_in: InodeNo,
        offset_in: u64,
        ino_out: InodeNo,
        offset_out: u64,
        len: u64,
    ) -> Result<u64> {
        let ino_in = ino_in.get();
        let ino_out = ino_out.get();
        // A snapshot may be the source (its reads are routed), never the destination.
        self.refuse_snapshot_change("copy_file_range", &[ino_out])?;
        let size_in = self.getattr(InodeNo::new(ino_in))?.size;
        if len == 0 || offset_in >= size_in {
            return Ok(0);
        }
        let n = len.min(size_in - offset_in);
        let end_out = offset_out
            .checked_add(n)
            .filter(|e| *e <= MAX_FILE_BYTES)
            .ok_or_else(|| {
                Error::TooBig(format!(
                    "copy_file_range to inode {ino_out} at {offset_out}"
                ))
            })?;
        let overlap = ino_in == ino_out && offset_in < end_out && offset_out < offset_in + n;
        if overlap {
            // As the kernel answers before such a call reaches a FUSE server: a forward copy
            // of overlapping ranges would read bytes it already overwrote.
            return Err(Error::Invalid(format!(
                "copy_file_range within inode {ino_in}: [{offset_in}, +{n}) and [{offset_out}, +{n}) overlap"
            )));
        }
        let lo = round_up(offset_in);
        let hi = (offset_in + n) / BLOCK_SIZE * BLOCK_SIZE;
        // A snapshot's blocks are read, never shared: its extents cannot be flagged.
        let from_snapshot = self.snap_node(ino_in).is_some();
        if offset_in % BLOCK_SIZE == offset_out % BLOCK_SIZE
            && !overlap
            && hi > lo
            && !from_snapshot
        {
            let lo_out = offset_out + (lo - offset_in);
            // In file order, so that a failure part-way (ENOSPC on the bytes of the head or
            // the tail, or on the clone's items) leaves a prefix copied and is answered as a
            // short count, as write(2) answers: the unaligned head as bytes (which also leaves
            // the destination at least a block long, never inline), the middle shared, the
            // tail as bytes.
            let head_len = lo - offset_in;
            let head = self.copy_bytes(ino_in, offset_in, ino_out, offset_out, head_len)?;
            if head < head_len {
                return Ok(head);
            }
            let shared = match self.retry_on_full(true, || {
                self.clone_once(ino_in, lo, ino_out, lo_out, hi - lo)
            }) {
                Ok(shared) => shared,
                Err(e) => return short_count(head, e),
            };
            let rest = if shared {
                let tail_out = lo_out + (hi - lo);
                match self.copy_bytes(ino_in, hi, ino_out, tail_out, offset_in + n - hi) {
                    Ok(tail) => hi - lo + tail,
                    Err(e) => return short_count(head + (hi - lo), e),
                }
            } else {
                match self.copy_bytes(ino_in, lo, ino_out, lo_out, offset_in + n - lo) {
                    Ok(rest) => rest,
                    Err(e) => return short_count(head, e),
                }
            };
            return Ok(head + rest);
        }
        self.copy_bytes(ino_in, offset_in, ino_out, offset_out, n)
    }

    /// Shares the block-aligned `[lo, lo + len)` of `ino_in` into `ino_out` at `lo_out`
    /// (see [`Filesystem::copy_file_range`]). False (nothing done) when either file is
    /// inline, the source has shrunk below the range meanwhile, or either is not a regular
    /// file's blocks to share.
    fn clone_once(
        &self,
        ino_in: u64,
        lo: u64,
        ino_out: u64,
        lo_out: u64,
        len: u64,
    ) -> Result<bool> {
        let state_in = self.inode(ino_in)?;
        let state_out = self.inode(ino_out)?;
        // Buffered data goes first: what is shared is what a read sees, and no buffered
        // block of the destination lands on the clone later.
        self.flush_inode(ino_in, &state_in)?;
        if ino_out != ino_in {
            self.flush_inode(ino_out, &state_out)?;
        }
        let shared = if ino_in == ino_out {
            let mut data = state_in.data.write();
            let _op = self.inner.engine.hold()?;
            self.flush_locked(ino_in, &mut data)?;
            self.clone_locked(ino_in, None, lo, ino_out, &mut data, lo_out, len)?
        } else {
            // Two inode locks: the lower number first, as every path that takes two.
            let (mut data_in, mut data_out) = if ino_in < ino_out {
                let a = state_in.data.write();
                (a, state_out.data.write())
            } else {
                let b = state_out.data.write();
                (state_in.data.write(), b)
            };
            let _op = self.inner.engine.hold()?;
            self.flush_locked(ino_in, &mut data_in)?;
            self.flush_locked(ino_out, &mut data_out)?;
            self.clone_locked(
                ino_in,
                Some(&mut data_in),
                lo,
                ino_out,
                &mut data_out,
                lo_out,
                len,
            )?
        };
        Ok(shared)
    }

    /// [`Filesystem::clone_once`] with the locks held: `data_in` is `None` when the source is
    /// the destination itself.
    #[allow(clippy::too_many_arguments)]
    fn clone_locked(
        &self,
        ino_in: u64,
        data_in: Option<&mut InodeData>,
        lo: u64,
        ino_out: u64,
        data_out: &mut InodeData,
        lo_out: u64,
        len: u64,
    ) -> Result<bool> {
        for (ino, mode) in [
            (
                ino_in,
                data_in.as_ref().map_or(data_out.item.mode, |d| d.item.mode),
            ),
            (ino_out, data_out.item.mode),
        ] {
            match mode & libc::S_IFMT {
                libc::S_IFREG => {}
                libc::S_IFDIR => return Err(Error::IsDir(format!("copy_file_range of dir {ino}"))),
                _ => {
                    return Err(Error::Invalid(format!(
                        "copy_file_range of special file {ino}"
                    )))
                }
            }
        }
        let size_in = data_in.as_ref().map_or(data_out.item.size, |d| d.item.size);
        if lo + len > size_in
            || self.data().inline_data(ino_in)?.is_some()
            || self.data().inline_data(ino_out)?.is_some()
        {
            return Ok(false);
        }
        // Marked before the items are recorded: an fsync that sees them commits (the
        // generation is at least the one the items land in).
        let generation = self.inner.engine.running_generation().get();
        self.inner
            .last_clone
            .fetch_max(generation, Ordering::AcqRel);
        for ino in [ino_in, ino_out] {
            if let Some(state) = self.shard(ino).lock().get(&ino).cloned() {
                state.cloned_in.fetch_max(generation, Ordering::AcqRel);
            }
        }
        let (delta, shared) = self.data().clone_range(ino_in, lo, ino_out, lo_out, len)?;
        Self::account(data_out, delta);
        data_out.item.size = data_out.item.size.max(lo_out + len);
        let t = now();
        data_out.item.mtime = t;
        data_out.item.ctime = t;
        self.store_inode(ino_out, data_out)?;
        // The source's extent items changed (flagged), its inode item did not.
        self.unmark_log_clean(ino_in);
        let counters = self.inner.engine.counters();
        counters.add(|c| &c.clone_ranges, 1);
        counters.add(|c| &c.clone_blocks, shared);
        Ok(true)
    }

    /// Copies `len` bytes through memory in 1 MiB steps. Returns the bytes copied; short at
    /// the source's end.
    fn copy_bytes(
        &self,
        ino_in: u64,
        offset_in: u64,
        ino_out: u64,
        offset_out: u64,
        len: u64,
    ) -> Result<u64> {
        const STEP: u64 = 1 << 20;
        let mut done = 0u64;
        while done < len {
            let step = (len - done).min(STEP);
            let data = match self.read(InodeNo::new(ino_in), offset_in + done, step as usize) {
                Ok(data) => data,
                Err(e) => return short_count(done, e),
            };
            if data.is_empty() {
                break;
            }
            if let Err(e) = self.write(InodeNo::new(ino_out), offset_out + done, &data, false) {
                return short_count(done, e);
            }
            done += data.len() as u64;
            if (data.len() as u64) < step {
                break;
            }
        }
        self.inner
            .engine
            .counters()
            .add(|c| &c.clone_copied_bytes, done);
        Ok(done)
    }

    /// Creates and opens a regular file.
    pub fn create(
        &self,
        caller: super::Caller,
        parent: InodeNo,
        name: &[u8],
        mode: u32,
        flags: i32,
    ) -> Result<(Attr, u64)> {
        let parent = parent.get();
        let attr = self.make_node(
            caller,
            parent,
            name,
            libc::S_IFREG | (mode & 0o7777),
            0,
            None,
        )?;
        let fh = self.open_file(attr.ino, flags)?;
        Ok((attr, fh))
    }

    /// Convenience for embedded use: writes a whole file at `path` (created if missing).
    pub fn write_file(&self, path: &str, bytes: &[u8]) -> Result<()> {
        let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
        let parent = self.resolve(dir)?.get();
        let ino = match self.find_entry(parent, name.as_bytes())? {
            Some(e) => InodeNo::new(e.child),
            None => {
                self.make_node(
                    super::Caller::default(),
                    parent,
                    name.as_bytes(),
                    libc::S_IFREG | 0o644,
                    0,
                    None,
                )?
                .ino
            }
        };
        self.setattr(
            ino,
            &SetAttr {
                size: Some(0),
                ..Default::default()
            },
        )?;
        self.write(ino, 0, bytes, false)?;
        Ok(())
    }

    /// Convenience for embedded use: reads a whole file at `path`.
    pub fn read_file(&self, path: &str) -> Result<Vec<u8>> {
        let ino = self.resolve(path)?;
        let size = self.getattr(ino)?.size;
        self.read(ino, 0, size as usize)
    }
}

/// A buffer of whole blocks for merging a write, taken empty (with room for `len` bytes)
/// from a per-thread spare and given back when dropped (kept only up to [`MergeBuf::KEEP`]
/// bytes). It is filled only by copying ([`MergeBuf::extend`], [`MergeBuf::extend_padded`]):
/// no byte is zeroed only to be overwritten, and none is read before it is written.
struct MergeBuf(Vec<u8>);

impl MergeBuf {
    const KEEP: usize = 4 << 20;

    thread_local! {
        static SPARE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    fn take(len: usize) -> MergeBuf {
        let mut v = Self::SPARE.with(|s| std::mem::take(&mut *s.borrow_mut()));
        v.clear();
        v.reserve(len);
        MergeBuf(v)
    }

    /// Appends `bytes`.
    fn extend(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }

    /// Appends `src[lo..hi]`, with zeros for the part of it past `src`'s end.
    fn extend_padded(&mut self, src: &[u8], lo: usize, hi: usize) {
        let copied = src.get(lo..hi.min(src.len())).unwrap_or_default();
        self.0.extend_from_slice(copied);
        let zeros = hi.saturating_sub(lo) - copied.len();
        self.0.resize(self.0.len() + zeros, 0);
    }
}

impl std::ops::Deref for MergeBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for MergeBuf {
    fn drop(&mut self) {
        if self.0.capacity() <= Self::KEEP {
            let v = std::mem::take(&mut self.0);
            Self::SPARE.with(|s| *s.borrow_mut() = v);
        }
    }
}

/// What a copy that stopped on `e` after `done` bytes answers: the bytes it copied, as a
/// short count (the caller's next call meets the error), or the error when nothing was copied
/// (write(2)'s rule).
fn short_count(done: u64, e: Error) -> Result<u64> {
    if done > 0 {
        log::debug!("copy_file_range stopped after {done} bytes: {e}");
        Ok(done)
    } else {
        Err(e)
    }
}
