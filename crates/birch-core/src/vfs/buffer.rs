//! The buffered data path (delayed allocation): a buffered WRITE copies into its inode's dirty
//! blocks and returns; the blocks get disk space and are written, merged into as few device
//! writes and extents as they allow, when they are flushed.
//!
//! Owns: [`DirtyBuf`] (an inode's buffered blocks, kept in its `InodeData` under the inode
//! lock), the filesystem-wide dirty set, byte count and limit ([`Buffers`]), the space
//! reservations of buffered blocks, the flush of one inode ([`Filesystem::flush_locked`]) and
//! the drain that makes every commit hold every write that returned before its freeze
//! ([`Filesystem::commit_now`]).
//! Must not touch: names and directories, the fsync log (fsync flushes through here first,
//! then logs what the flush recorded), the tree, the device and the allocator: space is
//! reserved, allocated and written, and extents recorded, by the data layer (`crate::data`).
//!
//! The rules (DESIGN §10.10):
//! - A buffered block is whole: a partial write reads and verifies the old block first, as a
//!   write-through one does. Reads overlay the buffer on the extents.
//! - A block enters the buffer with one reserved block of disk space (under copy-on-write an
//!   overwrite needs new space too) plus a share for the extent items; a shortfall answers
//!   `NoSpace`, which the write path turns into a commit and one retry.
//! - Flushes happen at every commit (the drain), at fsync of the file, at the dirty limit, at
//!   fallocate, lseek and before any write-through write to the same file, and when an inode
//!   with buffered data would be evicted. A flush writes the file's blocks in file order into
//!   as few allocated runs as the allocator gives, one device write per run, then records one
//!   extent per run of consecutive file blocks that stayed consecutive on disk.
//! - The drain: `draining` is set, a barrier waits for every mutation that may have missed
//!   it, every dirty inode is flushed, then the engine freezes; from the barrier until the
//!   freeze, writes go through (no new buffered data can miss the commit). So commit N holds
//!   every write that returned before freeze N, and a rename never commits without the data
//!   written before it.
//! - The drain batches across files: each drain thread takes a file's lock, takes its buffered
//!   blocks out, allocates and stages them (`DataLayer::stage_reserved`), keeps the lock and
//!   goes on to the next file, until the batch holds [`DRAIN_BATCH_WRITES`] writes or
//!   [`DRAIN_BATCH_BYTES`]; then one `write_many` writes the batch, and each file's extents are
//!   recorded (or, for a file whose writes failed, its blocks dropped as a failed flush drops
//!   them) and its lock let go. A file of more than [`DRAIN_BATCH_FILE_BLOCKS`] buffered
//!   blocks is flushed alone ([`Filesystem::flush_locked`]: its own runs are batch enough).
//!   See [`Filesystem::commit_now`] for why holding several inode locks cannot deadlock.

#![deny(clippy::too_many_lines)]

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use birch_format::items::ExtentKind;
use birch_format::{Generation, BLOCK_SIZE, MAX_FILE_BYTES};
use parking_lot::{Mutex, RwLockWriteGuard};

use super::{Filesystem, InodeData, InodeState};
use crate::data::{Staged, WrittenRun};
use crate::error::{Error, Result};

/// Most threads a drain flushes files with; it starts one per [`DRAIN_BATCH_WRITES`] dirty
/// files, up to this many.
const DRAIN_WORKERS: usize = 8;

/// Most device writes (allocated runs, one or more per file) of one drain batch: an
/// io_uring submission of an image file, or that many RBD requests in flight together.
const DRAIN_BATCH_WRITES: usize = 64;
/// Most bytes of one drain batch, about (the file that reaches it is still added).
const DRAIN_BATCH_BYTES: u64 = 32 << 20;
/// A file with more buffered blocks than this (4 MiB) is flushed alone, not in a batch.
const DRAIN_BATCH_FILE_BLOCKS: usize = 1024;

/// The dirty limit before the device's speed is known, and its bounds.
const START_LIMIT: u64 = 64 << 20;
const MIN_LIMIT: u64 = 8 << 20;
const MAX_LIMIT: u64 = 256 << 20;

/// One buffered block of a file.
struct DirtyBlock {
    bytes: Box<[u8]>,
    /// The block was a hole (or past EOF) when buffered: counted in the inode's `nbytes` now,
    /// taken out again when the flush records it (the extent counts it then).
    counted: bool,
}

/// An inode's buffered blocks, by file block index.
#[derive(Default)]
pub(crate) struct DirtyBuf {
    blocks: BTreeMap<u64, DirtyBlock>,
    /// Blocks this buffer holds reserved in the allocator.
    reserved: u64,
    /// The file's size before the first buffered write that grew it since the last flush or
    /// explicit size change: a flush that fails puts it back, so the size never covers data
    /// that was lost.
    size_before: Option<u64>,
}

impl DirtyBuf {
    /// Whether nothing is buffered.
    pub(crate) fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The reservation `blocks` buffered blocks need: one disk block each, plus one in 32 for
    /// the extent items and tree nodes recording them.
    fn reservation_for(blocks: u64) -> u64 {
        blocks + blocks.div_ceil(32)
    }

    /// Copies the buffered bytes that fall in `[offset, offset + out.len())` over `out`.
    pub(crate) fn overlay(&self, offset: u64, out: &mut [u8]) {
        if self.blocks.is_empty() || out.is_empty() {
            return;
        }
        let end = offset + out.len() as u64;
        for (&index, block) in self
            .blocks
            .range(offset / BLOCK_SIZE..end.div_ceil(BLOCK_SIZE))
        {
            let start = index * BLOCK_SIZE;
            let lo = start.max(offset);
            let hi = (start + BLOCK_SIZE).min(end);
            out[(lo - offset) as usize..(hi - offset) as usize]
                .copy_from_slice(&block.bytes[(lo - start) as usize..(hi - start) as usize]);
        }
    }

    /// The bytes of `[offset, end)`, every block of which is buffered ([`DirtyBuf::covers`]),
    /// copied out block by block (no zero-filled buffer that is then overwritten).
    pub(crate) fn read_covered(&self, offset: u64, end: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(end.saturating_sub(offset) as usize);
        for (&index, block) in self
            .blocks
            .range(offset / BLOCK_SIZE..end.div_ceil(BLOCK_SIZE))
        {
            let start = index * BLOCK_SIZE;
            let lo = start.max(offset);
            let hi = (start + BLOCK_SIZE).min(end);
            out.extend_from_slice(&block.bytes[(lo - start) as usize..(hi - start) as usize]);
        }
        // Covered: the blocks were consecutive, so every byte was copied in order.
        debug_assert_eq!(out.len() as u64, end - offset);
        out
    }

    /// Whether every block of `[offset, end)` is buffered: a read of it needs no device read
    /// (a buffered block is always whole: a partial write fills it from the old data first).
    pub(crate) fn covers(&self, offset: u64, end: u64) -> bool {
        if offset >= end {
            return true;
        }
        let (first, last) = (offset / BLOCK_SIZE, end.div_ceil(BLOCK_SIZE));
        self.blocks.len() as u64 >= last - first
            && self.blocks.range(first..last).count() as u64 == last - first
    }

    /// The file's size was set explicitly: a failed flush no longer puts an older one back.
    pub(crate) fn forget_size_before(&mut self) {
        self.size_before = None;
    }

    /// Whether file block `index` is buffered.
    pub(crate) fn holds(&self, index: u64) -> bool {
        self.blocks.contains_key(&index)
    }
}

/// A file's buffered blocks taken out of its buffer for a flush.
struct Taken {
    blocks: BTreeMap<u64, DirtyBlock>,
    /// The reservation the blocks held (the flush allocates from it, then gives back the rest).
    reserved: u64,
    /// The buffer's `size_before`.
    size_before: Option<u64>,
}

/// One file of a drain batch: its write lock held, its blocks staged and not written yet.
struct BatchFile<'a> {
    ino: u64,
    data: RwLockWriteGuard<'a, InodeData>,
    staged: Staged,
    /// Blocks taken from the buffer.
    count: u64,
    size_before: Option<u64>,
}

/// The files a drain thread has staged for its next `write_many`.
#[derive(Default)]
struct DrainBatch<'a> {
    files: Vec<BatchFile<'a>>,
    writes: usize,
    bytes: u64,
    /// When its first file was taken (the flush speed the dirty limit learns counts the
    /// staging too, as a single file's flush does).
    started: Option<Instant>,
}

/// The filesystem-wide side of the buffered data path.
pub(crate) struct Buffers {
    /// Buffered writes are on (`OpenOptions::buffered`).
    pub(crate) enabled: bool,
    /// Between a drain's start and its commit's freeze: writes go through.
    draining: AtomicBool,
    /// One drain at a time, held from its start until the freeze.
    drain_lock: Mutex<()>,
    /// Inodes that buffered data since the last drain (some may have been flushed since).
    dirty: Mutex<HashMap<u64, Arc<InodeState>>>,
    /// Bytes buffered now, all inodes.
    dirty_bytes: AtomicU64,
    /// Buffered bytes above which the committer is woken; at twice this a writer flushes its
    /// own file before it returns. About one second of the device's measured write speed.
    limit: AtomicU64,
    /// The most the limit may be for this device (1/16 of it, within the bounds above).
    cap: u64,
}

impl Buffers {
    pub(crate) fn new(enabled: bool, device_bytes: u64) -> Buffers {
        let cap = (device_bytes / 16).clamp(MIN_LIMIT, MAX_LIMIT);
        Buffers {
            enabled,
            draining: AtomicBool::new(false),
            drain_lock: Mutex::new(()),
            dirty: Mutex::new(HashMap::new()),
            dirty_bytes: AtomicU64::new(0),
            limit: AtomicU64::new(START_LIMIT.min(cap)),
            cap,
        }
    }

    /// Bytes buffered now.
    pub(crate) fn dirty_bytes(&self) -> u64 {
        self.dirty_bytes.load(Ordering::Relaxed)
    }

    /// Takes a flush of `bytes` that took `secs` into the limit (moving average of speed).
    fn learn(&self, bytes: u64, secs: f64) {
        if bytes < (1 << 20) || secs <= 0.0 {
            return;
        }
        let speed = bytes as f64 / secs;
        let old = self.limit.load(Ordering::Relaxed) as f64;
        let new = (old * 0.75 + speed * 0.25).clamp(MIN_LIMIT as f64, self.cap as f64);
        self.limit.store(new as u64, Ordering::Relaxed);
    }
}

/// Copies a buffered write of `bytes` at `offset` into the buffer's blocks (every block it
/// touches is held), except the `fresh` blocks (ascending) it covers whole: those were made
/// from these bytes.
fn copy_into_buffered(dirty: &mut DirtyBuf, fresh: &[u64], offset: u64, bytes: &[u8]) {
    let end = offset + bytes.len() as u64;
    for index in offset / BLOCK_SIZE..=(end - 1) / BLOCK_SIZE {
        let start = index * BLOCK_SIZE;
        let lo = start.max(offset);
        let hi = (start + BLOCK_SIZE).min(end);
        if lo == start && hi == start + BLOCK_SIZE && fresh.binary_search(&index).is_ok() {
            continue; // made from these bytes above
        }
        if let Some(block) = dirty.blocks.get_mut(&index) {
            block.bytes[(lo - start) as usize..(hi - start) as usize]
                .copy_from_slice(&bytes[(lo - offset) as usize..(hi - offset) as usize]);
        }
    }
}

impl Filesystem {
    /// Whether a write that may be buffered is buffered now (not during a drain).
    pub(crate) fn buffering(&self) -> bool {
        let b = &self.inner.buffers;
        b.enabled && !b.draining.load(Ordering::SeqCst)
    }

    /// Buffers `bytes` (not empty, ending within the file size limit) at `offset` of a regular
    /// file whose data is in blocks (not inline), with the inode's write lock and the engine's
    /// gate held. Updates size and `nbytes`,
    /// not times; the caller stores the inode item.
    pub(crate) fn buffer_write_locked(
        &self,
        ino: u64,
        state: &Arc<InodeState>,
        data: &mut InodeData,
        offset: u64,
        bytes: &[u8],
    ) -> Result<()> {
        // The caller (write_locked) checked the range: non-empty, ending within the limit.
        let end = offset + bytes.len() as u64;
        debug_assert!(!bytes.is_empty() && end <= MAX_FILE_BYTES);
        let first = offset / BLOCK_SIZE;
        let last = (end - 1) / BLOCK_SIZE;
        let fresh: Vec<u64> = (first..=last).filter(|b| !data.dirty.holds(*b)).collect();
        if !fresh.is_empty() {
            self.reserve_buffered(ino, data, fresh.len() as u64, offset)?;
        }
        // Every fresh block is made (reading what a partial one holds now) before any joins
        // the buffer.
        let made = self.fresh_blocks(ino, data, &fresh, offset, bytes)?;
        for (index, block) in made {
            if block.counted {
                data.item.nbytes += BLOCK_SIZE;
            }
            data.dirty.blocks.insert(index, block);
        }
        copy_into_buffered(&mut data.dirty, &fresh, offset, bytes);
        if end > data.item.size && data.dirty.size_before.is_none() {
            data.dirty.size_before = Some(data.item.size);
        }
        data.item.size = data.item.size.max(end);
        if !fresh.is_empty() {
            self.note_buffered(ino, state, fresh.len() as u64);
        }
        Ok(())
    }

    /// Reserves the space an inode's buffer needs once it holds `fresh` more blocks (a write
    /// at `offset`), beyond what it reserved already.
    fn reserve_buffered(
        &self,
        ino: u64,
        data: &mut InodeData,
        fresh: u64,
        offset: u64,
    ) -> Result<()> {
        let held = data.dirty.blocks.len() as u64;
        let want = DirtyBuf::reservation_for(held + fresh).saturating_sub(data.dirty.reserved);
        if want > 0 {
            if !self.data().reserve(want) {
                return Err(Error::NoSpace(format!(
                    "reserve {want} blocks to buffer a write to inode {ino} at {offset}"
                )));
            }
            data.dirty.reserved += want;
        }
        Ok(())
    }

    /// The blocks a buffered write of `bytes` at `offset` adds to the buffer, for the `fresh`
    /// block indexes (ascending) it does not hold yet: a block the write covers whole is
    /// copied from it, a partial one holds what the block holds now (zeros past the file's
    /// end). A block no extent maps is `counted` (in `nbytes`).
    fn fresh_blocks(
        &self,
        ino: u64,
        data: &InodeData,
        fresh: &[u64],
        offset: u64,
        bytes: &[u8],
    ) -> Result<Vec<(u64, DirtyBlock)>> {
        let end = offset + bytes.len() as u64;
        // Which fresh blocks are mapped (their extent counts in nbytes already) and what the
        // partial ones hold now.
        let mut mapped: Vec<(u64, u64)> = Vec::new();
        if !fresh.is_empty() {
            let lo = fresh[0] * BLOCK_SIZE;
            let hi = (fresh[fresh.len() - 1] + 1) * BLOCK_SIZE;
            for (start, extent) in self.data().extents(ino, lo, hi)? {
                match extent.kind {
                    // Blocks counted in nbytes (regular, preallocated and blob windows alike).
                    ExtentKind::Regular { .. }
                    | ExtentKind::Prealloc { .. }
                    | ExtentKind::Blob(_) => mapped.push((start, start + extent.len_bytes())),
                    // No block (writes are buffered only for files in blocks, above).
                    ExtentKind::Inline(_) => {}
                }
            }
        }
        let mut made: Vec<(u64, DirtyBlock)> = Vec::with_capacity(fresh.len());
        for &index in fresh {
            let start = index * BLOCK_SIZE;
            let whole = offset <= start && end >= start + BLOCK_SIZE;
            let block: Box<[u8]> = if whole {
                // Copied once, straight from the request (`copy_into_buffered` skips it).
                let at = (start - offset) as usize;
                Box::from(&bytes[at..at + BLOCK_SIZE as usize])
            } else if start < data.item.size {
                // What the block holds now, zeros past the file's end.
                let mut old = self.read_locked(ino, data, start, BLOCK_SIZE as usize)?;
                old.resize(BLOCK_SIZE as usize, 0);
                old.into_boxed_slice()
            } else {
                vec![0u8; BLOCK_SIZE as usize].into_boxed_slice()
            };
            let counted = !mapped.iter().any(|(s, e)| *s <= start && start < *e);
            made.push((
                index,
                DirtyBlock {
                    bytes: block,
                    counted,
                },
            ));
        }
        Ok(made)
    }

    /// After a write buffered `fresh` new blocks of `ino`: counts them dirty and puts the
    /// inode's state in the dirty set.
    fn note_buffered(&self, ino: u64, state: &Arc<InodeState>, fresh: u64) {
        let b = &self.inner.buffers;
        b.dirty_bytes
            .fetch_add(fresh * BLOCK_SIZE, Ordering::Relaxed);
        // By state, not only number: an evicted state (flushed as it left the table) may
        // still sit in the set under this number while a newer one buffers.
        let mut set = b.dirty.lock();
        if !set.get(&ino).is_some_and(|s| Arc::ptr_eq(s, state)) {
            set.insert(ino, state.clone());
        }
        drop(set);
        self.inner
            .engine
            .counters()
            .add(|c| &c.buffered_blocks, fresh);
    }

    /// After a buffered write, with no lock held by the caller except `data`'s: wakes the
    /// committer above the dirty limit, and flushes this file now above twice the limit
    /// (a writer faster than the device waits for its own data).
    pub(crate) fn throttle_locked(&self, ino: u64, data: &mut InodeData) -> Result<()> {
        let b = &self.inner.buffers;
        let dirty = b.dirty_bytes();
        let limit = b.limit.load(Ordering::Relaxed);
        if dirty > limit {
            self.wake_committer();
        }
        if dirty > 2 * limit {
            self.engine().counters().add(|c| &c.buffer_throttled, 1);
            self.flush_locked(ino, data)?;
        }
        Ok(())
    }

    /// Drops buffered blocks at or past file byte `from` (rounded up to a block), and zeroes
    /// the bytes from `from` in the block that holds it. Under the inode's write lock
    /// (truncate; the inode being freed drops everything with `from` 0).
    pub(crate) fn drop_buffered_from(&self, data: &mut InodeData, from: u64) {
        // The caller sets the size now: a later failed flush keeps it.
        data.dirty.forget_size_before();
        if data.dirty.blocks.is_empty() {
            return;
        }
        let keep = from.div_ceil(BLOCK_SIZE);
        let gone = data.dirty.blocks.split_off(&keep);
        if from % BLOCK_SIZE != 0 {
            if let Some(block) = data.dirty.blocks.get_mut(&(from / BLOCK_SIZE)) {
                block.bytes[(from % BLOCK_SIZE) as usize..].fill(0);
            }
        }
        let counted = gone.values().filter(|b| b.counted).count() as u64;
        data.item.nbytes = data.item.nbytes.saturating_sub(counted * BLOCK_SIZE);
        self.inner
            .buffers
            .dirty_bytes
            .fetch_sub(gone.len() as u64 * BLOCK_SIZE, Ordering::Relaxed);
        // Give back what the remaining blocks no longer need.
        let need = if data.dirty.blocks.is_empty() {
            0
        } else {
            DirtyBuf::reservation_for(data.dirty.blocks.len() as u64)
        };
        let extra = data.dirty.reserved.saturating_sub(need);
        if extra > 0 {
            self.data().unreserve(extra);
            data.dirty.reserved -= extra;
        }
    }

    /// Takes the inode's buffered blocks out of its buffer for a flush (the dirty byte count
    /// and `nbytes` let go of them: the extents recorded count them from now on).
    fn take_buffered(&self, data: &mut InodeData) -> Taken {
        let blocks = std::mem::take(&mut data.dirty.blocks);
        let reserved = std::mem::take(&mut data.dirty.reserved);
        let size_before = data.dirty.size_before.take();
        let count = blocks.len() as u64;
        self.inner
            .buffers
            .dirty_bytes
            .fetch_sub(count * BLOCK_SIZE, Ordering::Relaxed);
        let counted = blocks.values().filter(|b| b.counted).count() as u64;
        data.item.nbytes = data.item.nbytes.saturating_sub(counted * BLOCK_SIZE);
        Taken {
            blocks,
            reserved,
            size_before,
        }
    }

    /// Takes the inode's buffered blocks out ([`Filesystem::take_buffered`]), allocates and
    /// stages them ([`crate::data::DataLayer::stage_reserved`]) and gives back what the
    /// allocation did not take of their reservation (once). Returns how many blocks were
    /// taken, the size to put back if they are lost, and the staged file. The stage holds a
    /// copy and the checksums are taken: the buffer's memory goes here.
    fn stage_buffered(&self, ino: u64, data: &mut InodeData) -> (u64, Option<u64>, Result<Staged>) {
        let Taken {
            blocks,
            mut reserved,
            size_before,
        } = self.take_buffered(data);
        let count = blocks.len() as u64;
        let list: Vec<(u64, &[u8])> = blocks.iter().map(|(i, b)| (*i, &b.bytes[..])).collect();
        let staged = self.data().stage_reserved(ino, &list, &mut reserved);
        self.data().unreserve(reserved);
        (count, size_before, staged)
    }

    /// After the `count` blocks taken from the inode's buffer could not be written (their
    /// space is already freed): sets the inode's write error and puts back the size the lost
    /// writes grew. With the inode's write lock held.
    fn flush_failed(
        &self,
        ino: u64,
        data: &mut InodeData,
        count: u64,
        size_before: Option<u64>,
        e: &Error,
    ) {
        // The blocks are dropped whatever the cause (device error, or no space despite
        // the reservation): the file's fsync must report the loss, every time.
        data.write_error = true;
        self.inner.lost_flushes.fetch_add(1, Ordering::SeqCst);
        self.data_lost(ino);
        log::error!("inode {ino}: flushing {count} buffered blocks failed, data lost: {e}");
        if let Some(size) = size_before {
            // The lost writes grew the file: its size goes back, so no commit holds
            // a size that covers data never written.
            data.item.size = size.min(data.item.size);
            if let Err(store) = self.store_inode(ino, data) {
                log::error!("inode {ino}: restoring the size after a failed flush: {store}");
            }
        }
    }

    /// Records the runs a flush wrote as the inode's extents, with its write lock held; on
    /// failure the runs not recorded go back.
    fn record_flushed(&self, ino: u64, data: &mut InodeData, runs: Vec<WrittenRun>) -> Result<()> {
        let counters = self.engine().counters();
        counters.add(|c| &c.buffer_flushes, 1);
        counters.add(|c| &c.buffer_flush_runs, runs.len() as u64);
        let _op = match self.inner.engine.hold() {
            Ok(op) => op,
            Err(e) => {
                self.data().give_back(&runs);
                return Err(e);
            }
        };
        let mut runs = runs.into_iter();
        while let Some(run) = runs.next() {
            let (offset, len) = (run.file_offset, run.csums.len() as u64 * BLOCK_SIZE);
            if let Err(e) = self.record_new_blocks(ino, data, offset, len, vec![run], false) {
                // The runs not recorded yet go back (the failed one already went back).
                self.data().give_back(&runs.collect::<Vec<_>>());
                return Err(e);
            }
        }
        self.unmark_log_clean(ino);
        Ok(())
    }

    /// Writes the inode's buffered blocks to new space and records them as extents, with the
    /// inode's write lock held. On failure the buffered blocks are dropped (they cannot be
    /// placed), the inode's data write error is set (fsync reports EIO from then on), and
    /// the error is returned.
    pub(crate) fn flush_locked(&self, ino: u64, data: &mut InodeData) -> Result<()> {
        if data.dirty.blocks.is_empty() {
            self.data()
                .unreserve(std::mem::take(&mut data.dirty.reserved));
            return Ok(());
        }
        let Taken {
            blocks,
            mut reserved,
            size_before,
        } = self.take_buffered(data);
        let count = blocks.len() as u64;
        let started = Instant::now();
        let list: Vec<(u64, &[u8])> = blocks.iter().map(|(i, b)| (*i, &b.bytes[..])).collect();
        let written = self.data().write_reserved(ino, &list, &mut reserved);
        self.data().unreserve(reserved);
        let runs = match written {
            Ok(runs) => runs,
            Err(e) => {
                self.flush_failed(ino, data, count, size_before, &e);
                return Err(e);
            }
        };
        self.inner
            .buffers
            .learn(count * BLOCK_SIZE, started.elapsed().as_secs_f64());
        self.record_flushed(ino, data, runs)
    }

    /// The drain's part for one dirty inode, whose write lock `data` is: a freed inode's
    /// buffer is dropped, a file of many blocks flushed alone, any other file's blocks taken
    /// out, allocated and staged into `batch` (its lock kept until the batch is written),
    /// which is written when full.
    fn drain_file<'a>(
        &self,
        ino: u64,
        mut data: RwLockWriteGuard<'a, InodeData>,
        batch: &mut DrainBatch<'a>,
    ) {
        if data.freed {
            self.drop_buffered_from(&mut data, 0);
            self.flush_locked(ino, &mut data).ok();
            return;
        }
        if data.dirty.blocks.is_empty() || data.dirty.blocks.len() > DRAIN_BATCH_FILE_BLOCKS {
            if !data.dirty.blocks.is_empty() {
                // Written alone: let the files staged so far go first, not wait behind it.
                self.write_drain_batch(batch);
            }
            if let Err(e) = self.flush_locked(ino, &mut data) {
                // The blocks are dropped (and fsync of the file reports the error): the
                // commit goes on without them rather than stop every other file's.
                log::error!("commit: buffered data of inode {ino} lost: {e}");
            }
            return;
        }
        batch.started.get_or_insert_with(Instant::now);
        let (count, size_before, staged) = self.stage_buffered(ino, &mut data);
        match staged {
            Err(e) => {
                self.flush_failed(ino, &mut data, count, size_before, &e);
                log::error!("commit: buffered data of inode {ino} lost: {e}");
            }
            Ok(staged) => {
                batch.writes += staged.writes();
                batch.bytes += staged.bytes();
                batch.files.push(BatchFile {
                    ino,
                    data,
                    staged,
                    count,
                    size_before,
                });
                if batch.writes >= DRAIN_BATCH_WRITES || batch.bytes >= DRAIN_BATCH_BYTES {
                    self.write_drain_batch(batch);
                }
            }
        }
    }

    /// Writes the staged blocks of every file of `batch` with one device `write_many`, then,
    /// file by file, records the extents of those written or drops the blocks of those whose
    /// writes failed (as a failed flush does), and lets go of each file's lock.
    fn write_drain_batch(&self, batch: &mut DrainBatch<'_>) {
        let DrainBatch {
            files,
            bytes,
            started,
            ..
        } = std::mem::take(batch);
        if files.is_empty() {
            return;
        }
        let started = started.unwrap_or_else(Instant::now);
        let staged: Vec<&Staged> = files.iter().map(|f| &f.staged).collect();
        let results = self.data().write_staged(&staged);
        drop(staged);
        self.inner
            .buffers
            .learn(bytes, started.elapsed().as_secs_f64());
        let counters = self.engine().counters();
        counters.add(|c| &c.drain_batches, 1);
        counters.add(|c| &c.drain_batch_files, files.len() as u64);
        for (file, written) in files.into_iter().zip(results) {
            let BatchFile {
                ino,
                mut data,
                staged,
                count,
                size_before,
            } = file;
            match self.data().staged_done(staged, written) {
                Ok(runs) => {
                    if let Err(e) = self.record_flushed(ino, &mut data, runs) {
                        log::error!("commit: buffered data of inode {ino} lost: {e}");
                    }
                }
                Err(e) => {
                    self.flush_failed(ino, &mut data, count, size_before, &e);
                    log::error!("commit: buffered data of inode {ino} lost: {e}");
                }
            }
            drop(data);
        }
    }

    /// Commits, first flushing every buffered write (the drain, see the module doc). Every
    /// commit of the filesystem goes through here. Call with no inode lock held.
    pub(crate) fn commit_now(&self) -> Result<Generation> {
        self.inner.engine.check_up()?;
        let b = &self.inner.buffers;
        if !b.enabled {
            return self.inner.engine.commit();
        }
        let guard = b.drain_lock.lock();
        b.draining.store(true, Ordering::SeqCst);
        // A write that read `draining` as false holds the gate until it has buffered and put
        // its inode in the dirty set: after the barrier, the set is complete.
        self.inner.engine.barrier();
        let dirty: Vec<(u64, Arc<InodeState>)> =
            std::mem::take(&mut *b.dirty.lock()).into_iter().collect();
        // Many small files (an unpacked tree) are many small device writes: each drain thread
        // stages file after file and writes them as one batch (module doc), and a few threads
        // keep several batches in flight.
        //
        // Locks: a drain thread holds the write locks of every file of its batch across the
        // batch's write_many, and nothing else (no mutex, no gate; `Engine::hold` only while
        // it records). It never WAITS for an inode lock while it holds one: the first file
        // of a batch is locked with a blocking `write()`, every later one only with
        // `try_write()`, and a file that is busy makes the thread write out its batch (letting
        // go of every lock) before it waits for that file. So no cycle of inode-lock waits
        // (rename, link, clone and copy_file_range take two in ascending order) can pass
        // through a drain thread. Every other wait it makes with inode locks held (the
        // allocator, the engine gate to record, the inode table shard and `logged` mutex of
        // `unmark_log_clean`, the device) is one a single-file flush makes with its one inode
        // lock held, and which inode that is does not matter to those waits; so a deadlock
        // through a batch would be one through today's flush of a single file. Readers of a
        // file in a batch wait for the batch's write as they waited for the file's own flush:
        // the buffered blocks leave the buffer only while the lock is held, so no read can
        // see the old extent in between.
        let workers = dirty
            .len()
            .div_ceil(DRAIN_BATCH_WRITES)
            .clamp(1, DRAIN_WORKERS);
        let next = AtomicUsize::new(0);
        let drain_one = || {
            let mut batch = DrainBatch::default();
            let mut busy: Option<&(u64, Arc<InodeState>)> = None;
            while let Some(entry) = busy
                .take()
                .or_else(|| dirty.get(next.fetch_add(1, Ordering::Relaxed)))
            {
                let (ino, state) = (entry.0, &entry.1);
                let data = if batch.files.is_empty() {
                    state.data.write()
                } else if let Some(data) = state.data.try_write() {
                    data
                } else {
                    self.write_drain_batch(&mut batch);
                    busy = Some(entry);
                    continue;
                };
                self.drain_file(ino, data, &mut batch);
            }
            self.write_drain_batch(&mut batch);
        };
        std::thread::scope(|scope| {
            for _ in 1..workers {
                scope.spawn(drain_one);
            }
            drain_one();
        });
        self.inner.engine.commit_then(move || {
            b.draining.store(false, Ordering::SeqCst);
            drop(guard);
        })
    }

    /// Flushes `ino`'s buffered blocks for an fsync that will go through the log: allocated
    /// and recorded as a flush does, but their bytes *placed* (DESIGN §11.1) rather than
    /// written, so the log's leader writes them together with the batch that names them,
    /// in one submission, then flushes once: one round trip for the data and the batch (on
    /// RBD, where it took two) and no device write on the fsync's own thread. Files of more
    /// than [`DRAIN_BATCH_FILE_BLOCKS`] buffered blocks, and any flush that would take the
    /// placed blocks past their bound, are written as [`Filesystem::flush_inode`] writes them.
    /// Takes the inode's write lock.
    pub(crate) fn flush_inode_placed(&self, ino: u64, state: &InodeState) -> Result<()> {
        if state.data.read().dirty.is_empty() {
            return Ok(());
        }
        let mut data = state.data.write();
        let count = data.dirty.blocks.len();
        let placed = self.inner.engine.pending().blocks();
        if count == 0
            || count > DRAIN_BATCH_FILE_BLOCKS
            || placed + count >= super::durability::PLACED_MAX_BLOCKS
        {
            return self.flush_locked(ino, &mut data);
        }
        let (count, size_before, staged) = self.stage_buffered(ino, &mut data);
        match staged {
            Err(e) => {
                self.flush_failed(ino, &mut data, count, size_before, &e);
                Err(e)
            }
            Ok(staged) => {
                let runs = self.data().place_staged(staged);
                self.engine()
                    .counters()
                    .add(|c| &c.buffer_placed_blocks, count);
                self.record_flushed(ino, &mut data, runs)
            }
        }
    }

    /// Flushes `ino`'s buffered blocks if it has any (fsync, lseek, and the write-through
    /// paths): takes the inode's write lock.
    pub(crate) fn flush_inode(&self, ino: u64, state: &InodeState) -> Result<()> {
        if state.data.read().dirty.is_empty() {
            return Ok(());
        }
        let mut data = state.data.write();
        self.flush_locked(ino, &mut data)
    }
}
