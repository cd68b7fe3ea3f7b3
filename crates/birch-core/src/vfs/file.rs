//! File data and attributes: open, read, write, truncate, fallocate, lseek, setattr, fsync.
//!
//! Data lives in copy-on-write extents: a write allocates new blocks, writes them (O_DIRECT,
//! no flush), and replaces the extent items covering the range; blocks it stops referencing are
//! freed, pinned until the commit is durable. Partial blocks are read, verified and merged
//! first. Files up to [`INLINE_MAX_BYTES`] live inline in their extent item.

use std::sync::atomic::Ordering;

use birch_format::items::{ExtentKind, FileExtent};
use birch_format::{
    ItemType, Key, BLOCK_SIZE, EXTENT_MAX_BLOCKS, INLINE_MAX_BYTES, MAX_FILE_BYTES,
};

use super::{attr_of, now, Attr, Filesystem, FsyncMode, InodeData, SetAttr, SetTime};
use crate::error::{Error, Result};

const EXTENT_MAX_BYTES: u64 = EXTENT_MAX_BLOCKS * BLOCK_SIZE;

/// fallocate mode bits, as Linux defines them.
pub const FALLOC_FL_KEEP_SIZE: i32 = 0x01;
pub const FALLOC_FL_PUNCH_HOLE: i32 = 0x02;
pub const FALLOC_FL_ZERO_RANGE: i32 = 0x10;

fn extent_key(ino: u64, offset: u64) -> Key {
    Key::new(ino, ItemType::ExtentData, offset)
}

fn round_up(v: u64) -> u64 {
    v.div_ceil(BLOCK_SIZE) * BLOCK_SIZE
}

/// Item changes and frees computed under an inode lock, applied under one write gate.
#[derive(Default)]
struct Changes {
    items: Vec<(Key, Option<Vec<u8>>)>,
    frees: Vec<(u64, u64)>,
    blocks_added: u64,
    blocks_freed: u64,
    /// Keys that exist now (in the tree or the delta): only these need a deletion recorded.
    existed: std::collections::HashSet<Key>,
}

/// A block run written for a file and not yet recorded: (file offset, disk address, crc32c
/// of each block).
pub(super) type NewExtent = (u64, u64, Vec<u32>);

impl Changes {
    fn set(&mut self, key: Key, value: Option<Vec<u8>>) {
        self.items.retain(|(k, _)| *k != key);
        self.items.push((key, value));
    }
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
    /// Extents of `ino` that overlap `[from, to)`, in order.
    pub(super) fn extents(&self, ino: u64, from: u64, to: u64) -> Result<Vec<(u64, FileExtent)>> {
        let hi = extent_key(ino, to);
        // Extents never overlap, so only the last one starting at or before `from` can reach
        // into the range from the left: one reverse look finds it, then a range from there.
        let reach_floor = extent_key(ino, from.saturating_sub(EXTENT_MAX_BYTES - 1));
        let lo = match self
            .inner
            .engine
            .last_in(&reach_floor, &extent_key(ino, from))?
        {
            Some((key, _)) => key,
            None => extent_key(ino, from),
        };
        let items = self.inner.engine.range(&lo, &hi, usize::MAX)?;
        let mut out = Vec::new();
        for (key, bytes) in items {
            let extent = FileExtent::decode(&bytes)
                .map_err(|e| Error::corrupt(format!("inode {ino} extent {key}"), e))?;
            if key.offset + extent.len_bytes() > from {
                out.push((key.offset, extent));
            }
        }
        Ok(out)
    }

    /// Whether the file has any extent item (one range step, not a scan of all extents).
    fn has_extent_items(&self, ino: u64) -> Result<bool> {
        let lo = extent_key(ino, 0);
        let hi = extent_key(ino, u64::MAX);
        Ok(!self.inner.engine.range(&lo, &hi, 1)?.is_empty())
    }

    /// Whether a regular file keeps its data in blocks (not inline), so a block-aligned write
    /// goes to new blocks whatever the file holds.
    fn in_blocks(&self, ino: u64, data: &InodeData) -> Result<bool> {
        if data.item.mode & libc::S_IFMT != libc::S_IFREG {
            return Ok(false);
        }
        Ok(self.inline_data(ino)?.is_none()
            && (!data.dirty.is_empty() || self.has_extent_items(ino)?))
    }

    /// The inline data of a file, if it is stored inline.
    fn inline_data(&self, ino: u64) -> Result<Option<Vec<u8>>> {
        match self.inner.engine.get(&extent_key(ino, 0))? {
            Some(bytes) => match FileExtent::decode(&bytes)
                .map_err(|e| Error::corrupt(format!("inode {ino} extent at 0"), e))?
                .kind
            {
                ExtentKind::Inline(data) => Ok(Some(data)),
                _ => Ok(None),
            },
            None => Ok(None),
        }
    }

    /// Opens `ino`; returns a handle number.
    pub fn open_file(&self, ino: u64, _flags: i32) -> Result<u64> {
        let state = self.inode(ino)?;
        state.opens.fetch_add(1, Ordering::SeqCst);
        Ok(self.new_fh())
    }

    /// Closes a handle; the inode is freed here if this was its last use and it has no names.
    pub fn release(&self, ino: u64, _fh: u64) -> Result<()> {
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
    pub fn read(&self, ino: u64, offset: u64, size: usize) -> Result<Vec<u8>> {
        self.read_noting_atime(ino, offset, size)
            .map(|(out, _)| out)
    }

    /// [`Filesystem::read`], and whether it moved atime (a cache in front of the filesystem,
    /// such as the kernel's attributes, then holds a stale one).
    pub fn read_noting_atime(&self, ino: u64, offset: u64, size: usize) -> Result<(Vec<u8>, bool)> {
        let state = self.inode(ino)?;
        let out = {
            let data = state.data.read();
            if data.item.mode & libc::S_IFMT == libc::S_IFDIR {
                return Err(Error::IsDir(format!("read of dir {ino}")));
            }
            self.read_locked(ino, &data, offset, size)?
        };
        let moved = self.touch_atime(ino, &state);
        Ok((out, moved))
    }

    /// Applies relatime as a read would, for an open for reading whose reads a page cache
    /// in front of the filesystem may serve without asking it. Returns whether atime moved.
    pub fn atime_at_open(&self, ino: u64) -> Result<bool> {
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
        let mut out = vec![0u8; (end - offset) as usize];
        if data.dirty.covers(offset, end) {
            // All of it is in the write buffer: no extent lookup, no device read.
            data.dirty.overlay(offset, &mut out);
            return Ok(out);
        }
        for (start, extent) in self.extents(ino, offset, end)? {
            match &extent.kind {
                ExtentKind::Inline(bytes) => {
                    let from = offset.max(start);
                    let to = end.min(start + bytes.len() as u64);
                    if from < to {
                        out[(from - offset) as usize..(to - offset) as usize].copy_from_slice(
                            &bytes[(from - start) as usize..(to - start) as usize],
                        );
                    }
                }
                ExtentKind::Prealloc { .. } => {}
                ExtentKind::Regular { disk_addr, csums } => {
                    let ext_end = start + csums.len() as u64 * BLOCK_SIZE;
                    let from = offset.max(start);
                    let to = end.min(ext_end);
                    if from >= to {
                        continue;
                    }
                    let first_block = (from - start) / BLOCK_SIZE;
                    let last_block = (to - 1 - start) / BLOCK_SIZE;
                    let nblocks = last_block - first_block + 1;
                    let mut buf = vec![0u8; (nblocks * BLOCK_SIZE) as usize];
                    let at = disk_addr + first_block * BLOCK_SIZE;
                    self.inner
                        .engine
                        .device()
                        .read_at(&mut buf, at)
                        .map_err(|e| {
                            Error::io(format!("read inode {ino} offset {from} block {at:#x}"), e)
                        })?;
                    for n in 0..nblocks {
                        let block =
                            &buf[(n * BLOCK_SIZE) as usize..((n + 1) * BLOCK_SIZE) as usize];
                        let want = csums[(first_block + n) as usize];
                        let got = birch_format::checksum(block);
                        if got != want {
                            let addr = at + n * BLOCK_SIZE;
                            log::error!("inode {ino} offset {} block {addr:#x}: data checksum {got:#010x}, expected {want:#010x}", start + (first_block + n) * BLOCK_SIZE);
                            return Err(Error::DataChecksum(format!(
                                "inode {ino} offset {} block {addr:#x}",
                                start + (first_block + n) * BLOCK_SIZE
                            )));
                        }
                    }
                    let buf_start = start + first_block * BLOCK_SIZE;
                    out[(from - offset) as usize..(to - offset) as usize].copy_from_slice(
                        &buf[(from - buf_start) as usize..(to - buf_start) as usize],
                    );
                }
            }
        }
        data.dirty.overlay(offset, &mut out);
        Ok(out)
    }

    /// Writes `bytes` at `offset` (or at the end with `append`); returns bytes written.
    pub fn write(&self, ino: u64, offset: u64, bytes: &[u8], append: bool) -> Result<u32> {
        Ok(self.write_with(ino, offset, bytes, append, None)?.0)
    }

    /// [`Filesystem::write`], and with `kill_privs` (the writer lacks CAP_FSETID, as FUSE's
    /// `FUSE_WRITE_KILL_SUIDGID` says; its groups, primary first) also what Linux does to such
    /// a write: suid cleared, sgid cleared when group-execute is set or the writer is not in
    /// the file's group, `security.capability` dropped. Returns the bytes written and whether
    /// privileges were dropped (a cached mode is stale then).
    pub fn write_with(
        &self,
        ino: u64,
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
        ino: u64,
        offset: u64,
        bytes: &[u8],
        append: bool,
        kill_privs: Option<&[u32]>,
        through: bool,
    ) -> Result<(u32, bool)> {
        self.retry_on_full(true, || {
            self.write_once(ino, offset, bytes, append, kill_privs, through)
        })
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
        let buffer = !through
            && self.buffering()
            && !(aligned
                && self.inner.fsync_mode == FsyncMode::Log
                && self.log_clean_ticket(ino, &state, true)?.is_some());
        if !buffer {
            // Written through: what this file buffered goes first, so the buffer never
            // holds older bytes than the extents.
            self.flush_inode(ino, &state)?;
        }
        // Whole blocks at a block offset of a file already in blocks (O_DIRECT writes, seed
        // 001): allocate and write the data before taking the inode lock, so writers to
        // different parts of one file overlap their device writes; the lock then only covers
        // recording the extents.
        // A file larger than the inline limit is, in practice, in blocks: a hint that costs no
        // tree search; the exact check below, under the lock, decides.
        let likely_in_blocks = {
            let data = state.data.read();
            data.item.mode & libc::S_IFMT == libc::S_IFREG
                && data.item.size > INLINE_MAX_BYTES as u64
        };
        let prewritten = if aligned && likely_in_blocks && !buffer {
            match self.write_new_blocks(ino, offset, bytes) {
                Ok(extents) => Some(extents),
                Err(e) => {
                    if matches!(e, Error::Io { .. }) {
                        state.data.write().write_error = true;
                    }
                    return Err(e);
                }
            }
        } else {
            None
        };
        let mut data = state.data.write();
        let _op = match self.inner.engine.hold() {
            Ok(op) => op,
            Err(e) => {
                self.give_back(prewritten.as_deref().unwrap_or_default());
                return Err(e);
            }
        };
        if data.item.mode & libc::S_IFMT == libc::S_IFDIR {
            self.give_back(prewritten.as_deref().unwrap_or_default());
            return Err(Error::IsDir(format!("write to dir {ino}")));
        }
        let offset = if append { data.item.size } else { offset };
        let t = now();
        // Items this write changed, kept when the inode is log-clean (everything it changed
        // since the last commit is queued in the fsync log): the write then queues its own
        // items, so an fsync right after it (an O_SYNC write) only waits for the batch.
        let mut own_items: Option<Vec<(Key, Option<Vec<u8>>)>> = None;
        match prewritten {
            // In blocks (the same look-ups write_locked would do); otherwise the blocks go
            // back and the general path writes.
            Some(extents) if self.in_blocks(ino, &data)? => {
                // A buffered write that raced in since the flush above goes first.
                if let Err(e) = self.flush_locked(ino, &mut data) {
                    self.give_back(&extents);
                    return Err(e);
                }
                let clean = self.inner.fsync_mode == FsyncMode::Log
                    && data.item.nlink > 0
                    && !data.write_error
                    && self.log_clean_ticket(ino, &state, true)?.is_some();
                own_items = self
                    .record_new_blocks(ino, &mut data, offset, bytes.len() as u64, extents, clean)
                    .inspect_err(|_| self.unmark_log_clean(ino))?;
                data.item.size = data.item.size.max(offset + bytes.len() as u64);
            }
            Some(extents) => {
                self.give_back(&extents);
                self.flush_locked(ino, &mut data)?;
                self.write_locked(ino, &mut data, offset, bytes, None)?;
            }
            None => {
                let buffer_now = buffer && self.buffering();
                if !buffer_now {
                    // A drain began, or a write-through raced a buffered write in.
                    self.flush_locked(ino, &mut data)?;
                }
                self.write_locked(ino, &mut data, offset, bytes, buffer_now.then_some(&state))?
            }
        }
        let finish = |data: &mut InodeData| -> Result<bool> {
            let dropped = match kill_privs {
                Some(groups) => self.kill_privs_locked(ino, data, Some(groups))?,
                None => false,
            };
            data.item.mtime = t;
            data.item.ctime = t;
            self.store_inode(ino, data)?;
            Ok(dropped)
        };
        let dropped = match finish(&mut data) {
            Ok(dropped) => dropped,
            Err(e) => {
                // The extents may have changed and the inode item not: the inode is no
                // longer log-clean, whatever its inode item says.
                self.unmark_log_clean(ino);
                return Err(e);
            }
        };
        match own_items {
            Some(mut items) if !dropped => {
                items.push((super::inode_key(ino), Some(data.item.encode())));
                self.log_write(ino, &state, _op.generation(), items);
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
        let inline = self.inline_data(ino)?;
        // Any extent (even preallocated past EOF on an empty file) or buffered block means
        // the file is in blocks.
        let has_blocks =
            inline.is_none() && (!data.dirty.is_empty() || self.has_extent_items(ino)?);
        if !has_blocks && new_size <= INLINE_MAX_BYTES as u64 {
            let mut content = self.read_locked(ino, data, 0, data.item.size as usize)?;
            content.resize(new_size as usize, 0);
            content[offset as usize..end as usize].copy_from_slice(bytes);
            let extent = FileExtent {
                generation: self.inner.engine.running_generation(),
                kind: ExtentKind::Inline(content),
            };
            self.inner
                .engine
                .begin()?
                .put(extent_key(ino, 0), extent.encode());
            data.item.size = new_size;
            return Ok(());
        }
        if let Some(inline) = inline {
            // Grows past the inline limit: move the inline bytes to a block first.
            let mut changes = Changes::default();
            changes.set(extent_key(ino, 0), None);
            let mut block = inline;
            block.resize(BLOCK_SIZE as usize, 0);
            self.apply(ino, data, changes)?;
            self.write_blocks(ino, data, 0, &block)?;
        }
        if let Some(state) = buffer {
            return self.buffer_write_locked(ino, state, data, offset, bytes);
        }
        // Build whole blocks: merge partial head and tail blocks with what is there. The
        // buffer is this thread's, reused: a fresh one per WRITE of up to 1 MiB cost a page
        // fault and the kernel's zeroing of new pages every time (perf, untar).
        let first = offset / BLOCK_SIZE * BLOCK_SIZE;
        let last_end = round_up(end);
        let mut buf = MergeBuf::take((last_end - first) as usize);
        if offset != first {
            let head = self.read_locked(ino, data, first, BLOCK_SIZE as usize)?;
            buf[..head.len()].copy_from_slice(&head);
        }
        if end != last_end && (last_end - BLOCK_SIZE > first || offset == first) {
            let tail_start = last_end - BLOCK_SIZE;
            let tail = self.read_locked(ino, data, tail_start, BLOCK_SIZE as usize)?;
            let at = (tail_start - first) as usize;
            buf[at..at + tail.len()].copy_from_slice(&tail);
        }
        buf[(offset - first) as usize..(end - first) as usize].copy_from_slice(bytes);
        self.write_blocks(ino, data, first, &buf)?;
        data.item.size = new_size;
        Ok(())
    }

    /// Writes whole blocks at a block-aligned file offset into new extents.
    fn write_blocks(&self, ino: u64, data: &mut InodeData, offset: u64, buf: &[u8]) -> Result<()> {
        let new_extents = self.write_new_blocks(ino, offset, buf).inspect_err(|e| {
            if matches!(e, Error::Io { .. }) {
                data.write_error = true;
            }
        })?;
        self.record_new_blocks(ino, data, offset, buf.len() as u64, new_extents, false)
            .map(|_| ())
    }

    /// Allocates new blocks for `buf` (whole blocks for a block-aligned file offset) and
    /// writes them; returns the extents (file offset, disk address, checksums) to record.
    /// Needs no inode lock: the blocks are new and referenced by nothing until recorded.
    fn write_new_blocks(&self, ino: u64, offset: u64, buf: &[u8]) -> Result<Vec<NewExtent>> {
        debug_assert!(offset % BLOCK_SIZE == 0 && buf.len() as u64 % BLOCK_SIZE == 0);
        let total_blocks = buf.len() as u64 / BLOCK_SIZE;
        let mut new_extents: Vec<NewExtent> = Vec::new();
        let mut done = 0u64;
        let mut goal = self.continuation_goal(ino, offset)?;
        while done < total_blocks {
            let want = (total_blocks - done).min(EXTENT_MAX_BLOCKS);
            let (addr, got) = match self.allocate_blocks(goal, want) {
                Ok(v) => v,
                Err(e) => {
                    self.give_back(&new_extents);
                    return Err(e);
                }
            };
            let slice = &buf[(done * BLOCK_SIZE) as usize..((done + got) * BLOCK_SIZE) as usize];
            if let Err(e) = self.inner.engine.device().write_at(slice, addr) {
                self.inner.engine.allocator().free_now(addr, got);
                self.give_back(&new_extents);
                return Err(Error::io(
                    format!(
                        "write inode {ino} offset {} to block {addr:#x}",
                        offset + done * BLOCK_SIZE
                    ),
                    e,
                ));
            }
            let csums = slice
                .chunks(BLOCK_SIZE as usize)
                .map(birch_format::checksum)
                .collect();
            new_extents.push((offset + done * BLOCK_SIZE, addr, csums));
            done += got;
            goal = Some(addr + got * BLOCK_SIZE);
        }
        Ok(new_extents)
    }

    /// Replaces `[offset, offset + len)` of the file with blocks [`Filesystem::write_new_blocks`]
    /// wrote, with the inode lock held: one range drop, the new extent items, and a merge with
    /// the extent before them. With `keep`, returns the items it set and deleted.
    pub(super) fn record_new_blocks(
        &self,
        ino: u64,
        data: &mut InodeData,
        offset: u64,
        len: u64,
        new_extents: Vec<NewExtent>,
        keep: bool,
    ) -> Result<Option<Vec<(Key, Option<Vec<u8>>)>>> {
        let mut changes = self.drop_range(ino, offset, offset + len)?;
        let generation = self.inner.engine.running_generation();
        for (file_offset, addr, csums) in new_extents {
            changes.blocks_added += csums.len() as u64;
            let extent = FileExtent {
                generation,
                kind: ExtentKind::Regular {
                    disk_addr: addr,
                    csums,
                },
            };
            changes.set(extent_key(ino, file_offset), Some(extent.encode()));
        }
        self.merge_with_previous(ino, offset, &mut changes)?;
        let kept = keep.then(|| changes.items.clone());
        self.apply(ino, data, changes)?;
        Ok(kept)
    }

    /// Joins the first new extent to the one before it when both are contiguous on disk.
    fn merge_with_previous(&self, ino: u64, offset: u64, changes: &mut Changes) -> Result<()> {
        if offset == 0 {
            return Ok(());
        }
        let Some((_, Some(first_bytes))) = changes
            .items
            .iter()
            .find(|(k, _)| *k == extent_key(ino, offset))
            .cloned()
        else {
            return Ok(());
        };
        let Ok(FileExtent {
            kind: ExtentKind::Regular { disk_addr, csums },
            generation,
        }) = FileExtent::decode(&first_bytes)
        else {
            return Ok(());
        };
        let before = self.extents(ino, offset - 1, offset)?;
        let Some((prev_off, prev)) = before.into_iter().next() else {
            return Ok(());
        };
        if changes
            .items
            .iter()
            .any(|(k, v)| *k == extent_key(ino, prev_off) && v.is_none())
        {
            return Ok(());
        }
        let ExtentKind::Regular {
            disk_addr: prev_addr,
            csums: prev_csums,
        } = prev.kind
        else {
            return Ok(());
        };
        let prev_len = prev_csums.len() as u64 * BLOCK_SIZE;
        if prev_off + prev_len != offset
            || prev_addr + prev_len != disk_addr
            || prev_csums.len() + csums.len() > EXTENT_MAX_BLOCKS as usize
        {
            return Ok(());
        }
        let mut joined = prev_csums;
        joined.extend(csums);
        // The first new extent is merged away: a key that never existed needs no deletion.
        let first = extent_key(ino, offset);
        if changes.existed.contains(&first) {
            changes.set(first, None);
        } else {
            changes.items.retain(|(k, _)| *k != first);
        }
        changes.set(
            extent_key(ino, prev_off),
            Some(
                FileExtent {
                    generation,
                    kind: ExtentKind::Regular {
                        disk_addr: prev_addr,
                        csums: joined,
                    },
                }
                .encode(),
            ),
        );
        Ok(())
    }

    fn give_back(&self, extents: &[NewExtent]) {
        for (_, addr, csums) in extents {
            self.inner
                .engine
                .allocator()
                .free_now(*addr, csums.len() as u64);
        }
    }

    /// Allocates 1..=`want` data blocks, at `goal` when that space is free (ENOSPC is
    /// retried after a commit at the top of each operation, with no lock held: see
    /// [`Filesystem::retry_on_full`]).
    fn allocate_blocks(&self, goal: Option<u64>, want: u64) -> Result<(u64, u64)> {
        match goal {
            Some(goal) => self.inner.engine.allocate_data_near(goal, 1, want),
            None => self.inner.engine.allocate_data(1, want),
        }
    }

    /// Where a write at `offset` would continue the file on disk: the address just after
    /// the block before `offset`, if that block is allocated.
    pub(super) fn continuation_goal(&self, ino: u64, offset: u64) -> Result<Option<u64>> {
        if offset < BLOCK_SIZE {
            return Ok(None);
        }
        let before = offset - BLOCK_SIZE;
        Ok(self
            .extents(ino, before, offset)?
            .into_iter()
            .find_map(|(start, extent)| match extent.kind {
                ExtentKind::Regular { disk_addr, .. } | ExtentKind::Prealloc { disk_addr, .. }
                    if start <= before =>
                {
                    Some(disk_addr + (offset - start))
                }
                _ => None,
            }))
    }

    /// Runs an operation; on ENOSPC commits (space freed earlier is pinned until a commit is
    /// durable) and retries before the caller sees the error. Once always, and again while
    /// the failed attempt left pinned space behind: other writers free and take space
    /// meanwhile (xfstests generic/371 writes, fallocates and removes 80 MiB files side by
    /// side on a 256 MiB filesystem), so one commit may not be enough. At most
    /// [`Self::FULL_RETRIES`] commits.
    /// `grows`: whether the operation may add items (see [`Filesystem::admit`]).
    fn retry_on_full<T>(&self, grows: bool, mut op: impl FnMut() -> Result<T>) -> Result<T> {
        self.admit(grows)?;
        let mut commits = 0;
        loop {
            match op() {
                Err(Error::NoSpace(why)) => {
                    let pinned = self.inner.engine.allocator().pinned_blocks();
                    if commits == Self::FULL_RETRIES || (commits > 0 && pinned == 0) {
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

    /// Computes removal of every extent byte in the block-aligned range `[from, to)`: pieces
    /// outside the range are kept (split), blocks inside are freed.
    fn drop_range(&self, ino: u64, from: u64, to: u64) -> Result<Changes> {
        let mut changes = Changes::default();
        for (start, extent) in self.extents(ino, from, to)? {
            let len = extent.len_bytes();
            let ext_end = start + len;
            changes.set(extent_key(ino, start), None);
            changes.existed.insert(extent_key(ino, start));
            let disk_addr = match &extent.kind {
                ExtentKind::Inline(_) => continue,
                ExtentKind::Regular { disk_addr, .. } | ExtentKind::Prealloc { disk_addr, .. } => {
                    *disk_addr
                }
            };
            let piece = |lo: u64, hi: u64| -> FileExtent {
                let skip = (lo - start) / BLOCK_SIZE;
                let blocks = (hi - lo) / BLOCK_SIZE;
                let addr = disk_addr + skip * BLOCK_SIZE;
                let kind = match &extent.kind {
                    ExtentKind::Regular { csums, .. } => ExtentKind::Regular {
                        disk_addr: addr,
                        csums: csums[skip as usize..(skip + blocks) as usize].to_vec(),
                    },
                    _ => ExtentKind::Prealloc {
                        disk_addr: addr,
                        blocks,
                    },
                };
                FileExtent {
                    generation: extent.generation,
                    kind,
                }
            };
            if start < from {
                changes.set(extent_key(ino, start), Some(piece(start, from).encode()));
            }
            if ext_end > to {
                changes.set(extent_key(ino, to), Some(piece(to, ext_end).encode()));
            }
            let cut_lo = start.max(from);
            let cut_hi = ext_end.min(to);
            if cut_lo < cut_hi {
                let blocks = (cut_hi - cut_lo) / BLOCK_SIZE;
                changes.frees.push((disk_addr + (cut_lo - start), blocks));
                changes.blocks_freed += blocks;
            }
        }
        Ok(changes)
    }

    fn apply(&self, _ino: u64, data: &mut InodeData, changes: Changes) -> Result<()> {
        let txn = self.inner.engine.begin()?;
        for (key, value) in changes.items {
            match value {
                Some(v) => txn.put(key, v),
                None => txn.delete(key),
            }
        }
        for (addr, blocks) in changes.frees {
            txn.free_data(addr, blocks);
        }
        data.item.nbytes = (data.item.nbytes + changes.blocks_added * BLOCK_SIZE)
            .saturating_sub(changes.blocks_freed * BLOCK_SIZE);
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
        if let Some(inline) = self.inline_data(ino)? {
            if new_size <= INLINE_MAX_BYTES as u64 {
                let mut content = inline;
                content.resize(new_size as usize, 0);
                let txn = self.inner.engine.begin()?;
                if new_size == 0 {
                    txn.delete(extent_key(ino, 0));
                } else {
                    txn.put(
                        extent_key(ino, 0),
                        FileExtent {
                            generation: txn.generation(),
                            kind: ExtentKind::Inline(content),
                        }
                        .encode(),
                    );
                }
                data.item.size = new_size;
                return Ok(());
            }
            // Growing past the inline limit: the bytes move to a block, the rest is a hole.
            let len = inline.len();
            let mut changes = Changes::default();
            changes.set(extent_key(ino, 0), None);
            self.apply(ino, data, changes)?;
            let mut block = inline;
            block.resize(BLOCK_SIZE as usize, 0);
            if len > 0 {
                self.write_blocks(ino, data, 0, &block)?;
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
            let changes = self.drop_range(ino, keep_end, u64::MAX / 2)?;
            self.apply(ino, data, changes)?;
            if new_size % BLOCK_SIZE != 0 && !data.dirty.holds(new_size / BLOCK_SIZE) {
                let tail_start = new_size / BLOCK_SIZE * BLOCK_SIZE;
                let mapped = self
                    .extents(ino, tail_start, tail_start + 1)?
                    .into_iter()
                    .any(|(_, e)| matches!(e.kind, ExtentKind::Regular { .. }));
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
    pub fn setattr(&self, ino: u64, set: &SetAttr) -> Result<Attr> {
        self.retry_on_full(false, || self.setattr_once(ino, set))
    }

    fn setattr_once(&self, ino: u64, set: &SetAttr) -> Result<Attr> {
        let state = self.inode(ino)?;
        let mut data = state.data.write();
        let _op = self.inner.engine.hold()?;
        let t = now();
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
                    super::xattr::xattr_key(ino, super::acl::ACL_ACCESS),
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
        Ok(attr_of(ino, &data.item))
    }

    /// fallocate with Linux modes: default, KEEP_SIZE, PUNCH_HOLE (with KEEP_SIZE) and
    /// ZERO_RANGE. Preallocated blocks read as zeros.
    pub fn fallocate(&self, ino: u64, offset: u64, len: u64, mode: i32) -> Result<()> {
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
        if let Some(mut inline) = self.inline_data(ino)? {
            let hi = (to as usize).min(inline.len());
            if (from as usize) < hi {
                inline[from as usize..hi].fill(0);
            }
            let txn = self.inner.engine.begin()?;
            txn.put(
                extent_key(ino, 0),
                FileExtent {
                    generation: txn.generation(),
                    kind: ExtentKind::Inline(inline),
                }
                .encode(),
            );
            return Ok(());
        }
        let first_full = round_up(from);
        let last_full = to / BLOCK_SIZE * BLOCK_SIZE;
        let size = data.item.size;
        let zero_partial = |lo: u64, hi: u64, data: &mut InodeData| -> Result<()> {
            let mapped = !self.extents(ino, lo, hi)?.is_empty();
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
            let changes = self.drop_range(ino, first_full, last_full)?;
            self.apply(ino, data, changes)?;
        }
        Ok(())
    }

    /// Allocates preallocated extents for every unmapped block in `[from, to)`.
    fn preallocate_locked(&self, ino: u64, data: &mut InodeData, from: u64, to: u64) -> Result<()> {
        if let Some(inline) = self.inline_data(ino)? {
            let mut changes = Changes::default();
            changes.set(extent_key(ino, 0), None);
            self.apply(ino, data, changes)?;
            let mut block = inline;
            block.resize(BLOCK_SIZE as usize, 0);
            self.write_blocks(ino, data, 0, &block)?;
        }
        let lo = from / BLOCK_SIZE * BLOCK_SIZE;
        let hi = round_up(to);
        let mapped: Vec<(u64, u64)> = self
            .extents(ino, lo, hi)?
            .iter()
            .map(|(s, e)| (*s, s + e.len_bytes()))
            .collect();
        let mut holes = Vec::new();
        let mut cursor = lo;
        for (s, e) in mapped {
            if s > cursor {
                holes.push((cursor, s.min(hi)));
            }
            cursor = cursor.max(e);
        }
        if cursor < hi {
            holes.push((cursor, hi));
        }
        let mut changes = Changes::default();
        let generation = self.inner.engine.running_generation();
        let mut allocated: Vec<(u64, u64)> = Vec::new();
        for (mut s, e) in holes {
            while s < e {
                let want = ((e - s) / BLOCK_SIZE).min(EXTENT_MAX_BLOCKS);
                let (addr, got) = match self.allocate_blocks(None, want) {
                    Ok(v) => v,
                    Err(err) => {
                        for (a, b) in allocated {
                            self.inner.engine.allocator().free_now(a, b);
                        }
                        return Err(err);
                    }
                };
                allocated.push((addr, got));
                changes.set(
                    extent_key(ino, s),
                    Some(
                        FileExtent {
                            generation,
                            kind: ExtentKind::Prealloc {
                                disk_addr: addr,
                                blocks: got,
                            },
                        }
                        .encode(),
                    ),
                );
                changes.blocks_added += got;
                s += got * BLOCK_SIZE;
            }
        }
        self.apply(ino, data, changes)
    }

    /// SEEK_DATA (3) and SEEK_HOLE (4).
    pub fn lseek(&self, ino: u64, offset: u64, whence: i32) -> Result<u64> {
        let state = self.inode(ino)?;
        // Buffered ranges are data: on disk first, so the extents say where data is.
        self.flush_inode(ino, &state)?;
        let data = state.data.read();
        let size = data.item.size;
        if offset >= size {
            return Err(Error::NoSuchAddress(format!(
                "seek inode {ino} to {offset} past size {size}"
            )));
        }
        let extents = self.extents(ino, offset, size)?;
        match whence {
            libc::SEEK_DATA => {
                for (s, e) in &extents {
                    if s + e.len_bytes() > offset {
                        return Ok((*s).max(offset));
                    }
                }
                Err(Error::NoSuchAddress(format!(
                    "no data in inode {ino} after {offset}"
                )))
            }
            libc::SEEK_HOLE => {
                let mut cursor = offset;
                for (s, e) in &extents {
                    if *s > cursor {
                        break;
                    }
                    cursor = cursor.max(s + e.len_bytes());
                }
                Ok(cursor.min(size))
            }
            _ => Err(Error::Invalid(format!("lseek whence {whence}"))),
        }
    }

    /// copy_file_range: copies through memory in 1 MiB steps (no reflink: format v1 has no
    /// extent reference counts). Returns the bytes copied; short at the source's end.
    pub fn copy_file_range(
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
            let data = self.read(ino_in, offset_in + done, step as usize)?;
            if data.is_empty() {
                break;
            }
            self.write(ino_out, offset_out + done, &data, false)?;
            done += data.len() as u64;
            if (data.len() as u64) < step {
                break;
            }
        }
        Ok(done)
    }

    /// Creates and opens a regular file.
    pub fn create(
        &self,
        caller: super::Caller,
        parent: u64,
        name: &[u8],
        mode: u32,
        flags: i32,
    ) -> Result<(Attr, u64)> {
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
        let parent = self.resolve(dir)?;
        let ino = match self.find_entry(parent, name.as_bytes())? {
            Some(e) => e.child,
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

/// A zeroed buffer of whole blocks for merging a write, taken from a per-thread spare and
/// given back when dropped (kept only up to [`MergeBuf::KEEP`] bytes).
struct MergeBuf(Vec<u8>);

impl MergeBuf {
    const KEEP: usize = 4 << 20;

    thread_local! {
        static SPARE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    fn take(len: usize) -> MergeBuf {
        let mut v = Self::SPARE.with(|s| std::mem::take(&mut *s.borrow_mut()));
        v.clear();
        v.resize(len, 0);
        MergeBuf(v)
    }
}

impl std::ops::Deref for MergeBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl std::ops::DerefMut for MergeBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.0
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
