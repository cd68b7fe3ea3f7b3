//! The data layer: file data blocks and the extent items that place them in a file.
//!
//! Owns: allocation of data blocks (at a goal address, so a file continues on disk, or from a
//! buffered write's reservation), writing them and computing their crc32c, reading them back
//! with every block's checksum verified, the space reservations of buffered blocks, the one
//! free path of data blocks ([`DataLayer::free`]), and a file's extent map as typed operations:
//! the extents of a range, dropping a range, replacing a range with newly written blocks,
//! inline and preallocated extents. `vfs` calls these and never builds an extent key, writes
//! or reads a data block, or asks the allocator for data space.
//!
//! Must not touch: inodes (their size and `nbytes`: the operations report the blocks they
//! added and freed, and the caller accounts), names, xattrs, permissions, errno, the fsync log,
//! and locks: a caller that changes a file's extent map holds that inode's write lock, which
//! orders the look-up and the change. Tree nodes are reached only through the engine (items go
//! into the running delta).
//!
//! **Freeing, and the birth generation.** Every data block that leaves a file, or that an
//! operation allocated and gives back, goes through [`DataLayer::free`], which is told the
//! block's birth generation: for a block an extent referenced, the generation recorded in that
//! extent item. A block's real birth is the generation of the transaction that first recorded
//! it in an extent item (no older tree can reference it). A block an extent item referenced
//! ([`Seen::Recorded`]) goes to the allocator's sharing-aware free
//! ([`crate::alloc::Allocator::free_recorded`]): a block born at or before a snapshot that
//! the live tree frees after it is kept (the snapshot reads it); otherwise it is pinned until
//! the freeing commit is durable. A block nothing ever recorded ([`Seen::Unrecorded`]) is
//! shared with nothing and is freed at once.
//! Contract: *a recorded birth generation may be older than the block's real birth, never
//! newer.* That errs the safe way for the check above (an older birth keeps a block that could
//! have gone); a newer one would free a block a snapshot still reads. New extents record the
//! transaction that records them; a piece cut from an extent keeps the extent's generation; an
//! extent merged with the one before it keeps the earlier extent's (older) generation, so the
//! later blocks' recorded birth may be older than their real one, and the earlier blocks' is
//! never moved forward. A block given back unrecorded is told the generation it was allocated
//! in.

use std::cell::RefCell;
use std::sync::Arc;

use birch_format::items::{ExtentKind, FileExtent};
use birch_format::{BlockAddr, BlockCount, ItemType, Key, BLOCK_SIZE, EXTENT_MAX_BLOCKS};

use crate::error::{Error, Result};
use crate::pending::PendingData;
use crate::txn::{Engine, WriteTxn};

mod extent_map;
#[cfg(test)]
mod test_support;
mod write;

pub(crate) use extent_map::{extents_in, seek_data_or_hole};
pub(crate) use write::Staged;

/// The longest extent in bytes: extent look-ups look back this far for one that reaches in.
const EXTENT_MAX_BYTES: u64 = EXTENT_MAX_BLOCKS * BLOCK_SIZE;

/// The key of `ino`'s extent item at file byte `offset`.
fn extent_key(ino: u64, offset: u64) -> Key {
    Key::new(ino, ItemType::ExtentData, offset)
}

/// How a file keeps its data ([`DataLayer::layout`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Layout {
    /// No extent item: empty, sparse, or data only in the daemon's buffer.
    Empty,
    /// Inline data (the file's only extent, at offset 0).
    Inline(Vec<u8>),
    /// Extents naming blocks (regular or preallocated).
    Blocks,
}

/// A run of consecutive data blocks on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockRun {
    /// Byte address of the first block (block aligned).
    pub(crate) addr: u64,
    /// Length in blocks.
    pub(crate) blocks: u64,
}

impl BlockRun {
    /// The run the allocator handed out.
    fn new(addr: BlockAddr, blocks: BlockCount) -> BlockRun {
        BlockRun {
            addr: addr.get(),
            blocks: blocks.get(),
        }
    }

    /// The first block's address, as the allocator takes it.
    fn disk_addr(&self) -> BlockAddr {
        BlockAddr::new(self.addr)
    }

    /// The length, as the allocator takes it.
    fn block_count(&self) -> BlockCount {
        BlockCount::new(self.blocks)
    }
}

/// Blocks written for a file and not yet recorded in its extent map: what
/// [`DataLayer::replace_range`] records, or [`DataLayer::give_back`] frees when the operation
/// fails before recording them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WrittenRun {
    /// File byte offset of the first block.
    pub(crate) file_offset: u64,
    /// Byte address of the first block on the device.
    pub(crate) addr: u64,
    /// crc32c of each block, in order (its length is the run's block count).
    pub(crate) csums: Vec<u32>,
    /// The running generation when the blocks were allocated.
    pub(crate) birth: u64,
}

impl WrittenRun {
    /// The blocks this run occupies.
    pub(crate) fn run(&self) -> BlockRun {
        BlockRun {
            addr: self.addr,
            blocks: self.csums.len() as u64,
        }
    }
}

/// How far blocks being freed were seen, which decides when their space may be reused.
#[derive(Clone, Copy)]
pub(crate) enum Seen<'t, 'e> {
    /// No extent item ever referenced them: allocated by the operation that gives them back
    /// (a failed write). Reusable at once.
    Unrecorded,
    /// An extent item referenced them (committed, in the running delta, or in an fsync log
    /// batch that replay would apply), and `txn` drops that reference: pinned until its
    /// commit is durable and no reader walks a snapshot that referenced them.
    Recorded(&'t WriteTxn<'e>),
}

/// Blocks an extent-map change added to a file and freed from it: the caller moves the
/// inode's `nbytes` by the difference.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockDelta {
    /// Blocks newly referenced.
    pub(crate) added: u64,
    /// Blocks no longer referenced.
    pub(crate) freed: u64,
}

impl BlockDelta {
    /// `nbytes` after this change.
    pub(crate) fn apply_to(self, nbytes: u64) -> u64 {
        (nbytes + self.added * BLOCK_SIZE).saturating_sub(self.freed * BLOCK_SIZE)
    }
}

/// An item changed by an extent-map operation: the key and its new value (`None`: deleted).
pub(crate) type ItemChange = (Key, Option<Vec<u8>>);

/// The data layer over one engine: a view, cheap to make for each call.
pub(crate) struct DataLayer<'e> {
    engine: &'e Engine,
}

impl<'e> DataLayer<'e> {
    /// The data layer of `engine`.
    pub(crate) fn new(engine: &'e Engine) -> DataLayer<'e> {
        DataLayer { engine }
    }

    /// Frees the blocks of an extent item that `txn` deletes with the rest of a file (an
    /// unlinked inode's last use, orphan reclaim). An item that does not decode is left (its
    /// blocks stay used until the next mount derives the free-space map again).
    pub(crate) fn free_extent_item(&self, txn: &WriteTxn<'_>, key: &Key, value: &[u8]) {
        match FileExtent::decode(value) {
            Ok(extent) => {
                if let Some((addr, blocks)) = extent.disk_range() {
                    let run = BlockRun { addr, blocks };
                    self.free_extent_blocks(run, extent.generation, extent.shared, txn);
                }
            }
            Err(e) => log::warn!("freeing extent {key}: does not decode ({e}); blocks kept"),
        }
    }

    /// Shares the blocks of `src`'s block-aligned range `[src_off, src_off + len)` into `dst`
    /// at the block-aligned `dst_off` (a clone, DESIGN §15.8): `dst`'s range is dropped (its
    /// blocks freed), and gets one extent item per regular extent piece of the source range,
    /// naming the source's blocks with their crc32c and the source extent's generation, flagged
    /// shared; every source extent it takes from becomes flagged (whole: its blocks are
    /// counted). Holes and preallocated extents of the source leave holes in `dst`. Within one
    /// file the ranges must not overlap. The caller holds both inodes' write locks, has
    /// flushed their buffered data, and knows neither file is inline. Returns the destination's
    /// block change and the blocks shared.
    pub(crate) fn clone_range(
        &self,
        src: u64,
        src_off: u64,
        dst: u64,
        dst_off: u64,
        len: u64,
    ) -> Result<(BlockDelta, u64)> {
        debug_assert!(src_off % BLOCK_SIZE == 0 && dst_off % BLOCK_SIZE == 0);
        debug_assert!(len % BLOCK_SIZE == 0);
        debug_assert!(src != dst || src_off + len <= dst_off || dst_off + len <= src_off);
        let src_end = src_off + len;
        let mut flags: Vec<(Key, FileExtent)> = Vec::new();
        let mut counts: Vec<((BlockAddr, BlockCount), (BlockAddr, BlockCount))> = Vec::new();
        let mut pieces: Vec<(u64, FileExtent)> = Vec::new();
        for (start, extent) in self.extents(src, src_off, src_end)? {
            let ExtentKind::Regular { disk_addr, csums } = &extent.kind else {
                if matches!(extent.kind, ExtentKind::Inline(_)) {
                    return Err(Error::Invalid(format!(
                        "clone of inode {src}: an inline extent at {start}"
                    )));
                }
                // Preallocated: reads as zeros, and a hole in the clone does too.
                continue;
            };
            let lo = start.max(src_off);
            let hi = (start + extent.len_bytes()).min(src_end);
            if lo >= hi {
                continue;
            }
            let skip = (lo - start) / BLOCK_SIZE;
            let blocks = (hi - lo) / BLOCK_SIZE;
            let addr = disk_addr + skip * BLOCK_SIZE;
            pieces.push((
                dst_off + (lo - src_off),
                FileExtent {
                    generation: extent.generation,
                    kind: ExtentKind::Regular {
                        disk_addr: addr,
                        csums: csums[skip as usize..(skip + blocks) as usize].to_vec(),
                    },
                    shared: true,
                },
            ));
            counts.push((
                (
                    BlockAddr::new(*disk_addr),
                    BlockCount::new(csums.len() as u64),
                ),
                (BlockAddr::new(addr), BlockCount::new(blocks)),
            ));
            if !extent.shared {
                let mut flagged = extent.clone();
                flagged.shared = true;
                flags.push((extent_key(src, start), flagged));
            }
        }
        if pieces.is_empty() {
            // Nothing to share (holes and preallocated space): the range reads as zeros.
            return Ok((self.drop_range(dst, dst_off, dst_off + len)?, 0));
        }
        // The first commit that records a shared extent sets the flag (FORMAT §9).
        self.engine
            .want_incompat(birch_format::superblock::INCOMPAT_SHARED_EXTENTS);
        // The counts first: no drop below (of the destination's old blocks, which may be
        // shared with the source) may see a count that does not have the clone in it yet.
        let alloc = self.engine.allocator();
        for (source, cloned) in &counts {
            alloc.add_shared(*source, *cloned);
        }
        {
            let txn = self.engine.begin()?;
            for (key, extent) in &flags {
                txn.put(*key, extent.encode());
            }
        }
        // The destination's range goes (read after the flags: a source extent reaching into
        // it within one file is cut as a flagged extent), and the clones come in.
        let mut changes = self.plan_drop(dst, dst_off, dst_off + len)?;
        let mut shared = 0;
        for (offset, piece) in pieces {
            let blocks = piece.len_bytes() / BLOCK_SIZE;
            changes.delta.added += blocks;
            shared += blocks;
            changes.set(extent_key(dst, offset), Some(piece.encode()));
        }
        Ok((self.apply(changes)?, shared))
    }

    /// Frees the blocks of an extent item (or a piece of one) that `txn` drops from the live
    /// tree. A shared extent's blocks lose one reference each and only those left with none
    /// are freed ([`crate::alloc::Allocator::drop_shared`]); both then go through
    /// [`DataLayer::free`] with [`Seen::Recorded`] (the allocator's sharing-aware
    /// `free_recorded`, which keeps what a snapshot holds).
    pub(crate) fn free_extent_blocks(
        &self,
        run: BlockRun,
        birth: u64,
        shared: bool,
        txn: &WriteTxn<'_>,
    ) {
        if !shared {
            return self.free(run, birth, Seen::Recorded(txn));
        }
        let unreferenced = self
            .engine
            .allocator()
            .drop_shared(run.disk_addr(), run.block_count());
        for (addr, blocks) in unreferenced {
            self.free(BlockRun::new(addr, blocks), birth, Seen::Recorded(txn));
        }
    }

    /// Marks the blocks of an extent item (regular or preallocated) that log replay applies as used (the
    /// free-space map was derived from the committed tree, which does not reference them).
    pub(crate) fn mark_replayed_extent(&self, value: &[u8]) {
        // Regular and preallocated extents alike hold blocks, as the open walk counts them
        // (`FileExtent::disk_range`): a replayed one left unmarked could be handed out again.
        let Ok(extent) = FileExtent::decode(value) else {
            return;
        };
        let Some((disk_addr, blocks)) = extent.disk_range() else {
            return;
        };
        let (addr, count) = (BlockAddr::new(disk_addr), BlockCount::new(blocks));
        if extent.shared {
            // A shared extent (a piece of a clone an fsync logged after the clone's commit):
            // blocks counted already are one more reference, as the open walk counts them.
            if !self.engine.allocator().mark_shared(addr, count) {
                log::warn!(
                    "replay: shared extent at {disk_addr:#x} x {blocks} on blocks an unshared extent or node holds"
                );
            }
        } else {
            self.engine.allocator().mark_used(addr, count);
        }
    }

    // ---- Blocks: reads and frees ----

    /// Frees written runs that were never recorded (the operation that wrote them failed).
    pub(crate) fn give_back(&self, runs: &[WrittenRun]) {
        for run in runs {
            self.free(run.run(), run.birth, Seen::Unrecorded);
        }
    }

    /// Copies the bytes of `extents` (inode `ino`'s, as [`DataLayer::extents`] or
    /// [`extents_in`] return them) that fall in `[offset, end)` into `out`, which covers that
    /// range and is zeroed by the caller (holes and preallocated extents read as zeros); data
    /// blocks are read and verified ([`DataLayer::read_verified`]). The one read of extents
    /// for the live filesystem and for snapshots. Does device I/O: one device read for one
    /// regular extent, else one [`BlockDevice::read_many`] of every extent's blocks (extents
    /// adjacent on disk read as one), in flight together where the device can (RBD).
    ///
    /// [`BlockDevice::read_many`]: crate::device::BlockDevice::read_many
    pub(crate) fn read_extents_into(
        &self,
        ino: u64,
        extents: &[(u64, FileExtent)],
        offset: u64,
        end: u64,
        out: &mut [u8],
    ) -> Result<()> {
        let mut parts: Vec<ExtentPart<'_>> = Vec::new();
        for (start, extent) in extents {
            let start = *start;
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
                    if from < to {
                        parts.push(ExtentPart {
                            start,
                            disk_addr: *disk_addr,
                            csums,
                            from,
                            to,
                        });
                    }
                }
            }
        }
        match parts.as_slice() {
            [] => Ok(()),
            [p] => {
                let part = &mut out[(p.from - offset) as usize..(p.to - offset) as usize];
                self.read_verified(ino, p.start, p.disk_addr, p.csums, p.from, p.to, part)
            }
            _ => self.read_parts(ino, &parts, offset, out),
        }
    }

    /// Reads several extent parts of one request with one [`BlockDevice::read_many`] (parts
    /// adjacent on disk as one read), then verifies every block's checksum as
    /// [`DataLayer::read_verified`] does, and copies each part into `out` (which starts at file
    /// offset `offset`).
    ///
    /// [`BlockDevice::read_many`]: crate::device::BlockDevice::read_many
    fn read_parts(
        &self,
        ino: u64,
        parts: &[ExtentPart<'_>],
        offset: u64,
        out: &mut [u8],
    ) -> Result<()> {
        // Each part's blocks: (first block index in the extent, disk address, bytes), laid
        // one after the other in one buffer.
        let spans: Vec<(u64, u64, usize)> = parts
            .iter()
            .map(|p| {
                let first_block = (p.from - p.start) / BLOCK_SIZE;
                let last_block = (p.to - 1 - p.start) / BLOCK_SIZE;
                let at = p.disk_addr + first_block * BLOCK_SIZE;
                (
                    first_block,
                    at,
                    ((last_block - first_block + 1) * BLOCK_SIZE) as usize,
                )
            })
            .collect();
        let total: usize = spans.iter().map(|(_, _, len)| len).sum();
        let mut buf = Scratch::take(total);
        // Blocks whose bytes only the log holds yet: taken before the device read (a block
        // not placed now was written in place before it left).
        let placed: Vec<Vec<(u64, Arc<[u8]>)>> = spans
            .iter()
            .map(|(_, at, len)| self.engine.pending().overlay(*at, *len as u64))
            .collect();
        // Device reads: a span that continues the previous one on disk extends its read.
        let mut reads: Vec<(u64, usize)> = Vec::with_capacity(spans.len());
        for (_, at, len) in &spans {
            match reads.last_mut() {
                Some((prev, prev_len)) if *prev + *prev_len as u64 == *at => *prev_len += len,
                _ => reads.push((*at, *len)),
            }
        }
        {
            let mut rest: &mut [u8] = &mut buf.0;
            let mut batch: Vec<(u64, &mut [u8])> = Vec::with_capacity(reads.len());
            for (at, len) in &reads {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(*len);
                batch.push((*at, head));
                rest = tail;
            }
            let (first, last) = (parts[0].from, parts[parts.len() - 1].to);
            self.engine.device().read_many(&mut batch).map_err(|e| {
                Error::io(
                    format!(
                        "read inode {ino} offsets {first}..{last}: {} extents in {} device reads",
                        parts.len(),
                        reads.len()
                    ),
                    e,
                )
            })?;
        }
        let mut at_buf = 0usize;
        for ((p, (first_block, at, len)), placed) in parts.iter().zip(&spans).zip(&placed) {
            let span = &mut buf.0[at_buf..at_buf + len];
            at_buf += len;
            PendingData::lay_over(*at, span, placed);
            verify_blocks(ino, p.start, *first_block, *at, p.csums, span)?;
            let buf_start = p.start + first_block * BLOCK_SIZE;
            out[(p.from - offset) as usize..(p.to - offset) as usize]
                .copy_from_slice(&span[(p.from - buf_start) as usize..(p.to - buf_start) as usize]);
        }
        Ok(())
    }

    /// Reads bytes `[from, to)` of the file from the regular extent at file offset `start`
    /// (`disk_addr`, `csums`) into `out` (exactly `to - from` bytes), verifying the checksum of
    /// every block it reads. A mismatch is [`Error::DataChecksum`] naming the inode, the file
    /// offset and the block. Does device I/O.
    pub(crate) fn read_verified(
        &self,
        ino: u64,
        start: u64,
        disk_addr: u64,
        csums: &[u32],
        from: u64,
        to: u64,
        out: &mut [u8],
    ) -> Result<()> {
        debug_assert!(start <= from && from < to && to <= start + csums.len() as u64 * BLOCK_SIZE);
        debug_assert_eq!(out.len() as u64, to - from);
        let first_block = (from - start) / BLOCK_SIZE;
        let last_block = (to - 1 - start) / BLOCK_SIZE;
        let nblocks = last_block - first_block + 1;
        let at = disk_addr + first_block * BLOCK_SIZE;
        let mut buf = Scratch::take((nblocks * BLOCK_SIZE) as usize);
        // Blocks whose bytes only the log holds yet: taken before the device read (a block
        // not placed now was written in place before it left).
        let placed = self.engine.pending().overlay(at, nblocks * BLOCK_SIZE);
        self.engine
            .device()
            .read_at(&mut buf.0, at)
            .map_err(|e| Error::io(format!("read inode {ino} offset {from} block {at:#x}"), e))?;
        PendingData::lay_over(at, &mut buf.0, &placed);
        verify_blocks(ino, start, first_block, at, csums, &buf.0)?;
        let buf_start = start + first_block * BLOCK_SIZE;
        out.copy_from_slice(&buf.0[(from - buf_start) as usize..(to - buf_start) as usize]);
        Ok(())
    }

    /// The one free path of data blocks: `run` leaves a file (an extent dropped by truncate,
    /// punch or overwrite, a deleted file's extents) or goes back unrecorded (a failed write).
    /// `birth` is the blocks' birth generation, for a recorded block the generation of the
    /// extent item that referenced it; it may be older than the real birth, never newer (see
    /// the module doc). [`Seen::Recorded`] goes through the allocator's sharing-aware free (kept
    /// while a snapshot holds the blocks, else pinned until the freeing commit is durable);
    /// [`Seen::Unrecorded`] frees them at once.
    pub(crate) fn free(&self, run: BlockRun, birth: u64, seen: Seen<'_, '_>) {
        let alloc = self.engine.allocator();
        // Placed bytes of freed blocks are never written when no tree a commit will still
        // write names the blocks: unrecorded ones, and ones born in the freeing transaction.
        // A block an older generation recorded may be named by the frozen transaction whose
        // commit has not written its placed blocks yet (the free runs after the freeze): its
        // bytes stay placed, and a commit writes them (the blocks stay pinned until then).
        let forget = match &seen {
            Seen::Recorded(txn) => birth >= txn.generation().get(),
            Seen::Unrecorded => true,
        };
        let was_placed = forget
            && self
                .engine
                .pending()
                .forget(run.disk_addr().get(), run.block_count().get() * BLOCK_SIZE)
                > 0;
        match seen {
            // A commit's `write_out` may have taken these placed bytes already and be about
            // to write them: freed at once, the blocks could be taken and written by another
            // file first, and then overwritten with the stale bytes. Pinned to the running
            // transaction instead, they come back only after its commit, which starts after
            // the commit writing them ended.
            Seen::Unrecorded if was_placed => {
                alloc.free_pinned(
                    self.engine.running_generation(),
                    run.disk_addr(),
                    run.block_count(),
                );
            }
            Seen::Recorded(txn) => {
                let generation = txn.generation();
                // A block cannot be born after the transaction that frees it.
                debug_assert!(
                    birth <= generation.get(),
                    "birth {birth} after {generation}"
                );
                // Kept, not freed, when a snapshot holds the blocks (DESIGN §15.6).
                alloc.free_recorded(generation, birth, run.disk_addr(), run.block_count());
            }
            Seen::Unrecorded => alloc.free_now(run.disk_addr(), run.block_count()),
        }
    }
}

/// The part `[from, to)` of a regular extent at file offset `start` that one read covers.
struct ExtentPart<'a> {
    start: u64,
    disk_addr: u64,
    csums: &'a [u32],
    from: u64,
    to: u64,
}

/// Verifies the checksum of every block of `buf`, blocks `first_block..` of the regular
/// extent at file offset `start` (`csums`), read from disk address `at`. A mismatch is
/// [`Error::DataChecksum`] naming the inode, the file offset and the block.
fn verify_blocks(
    ino: u64,
    start: u64,
    first_block: u64,
    at: u64,
    csums: &[u32],
    buf: &[u8],
) -> Result<()> {
    for (n, block) in buf.chunks(BLOCK_SIZE as usize).enumerate() {
        let index = first_block + n as u64;
        let want = csums.get(index as usize).copied();
        let got = birch_format::checksum(block);
        if want != Some(got) {
            let addr = at + n as u64 * BLOCK_SIZE;
            let offset = start + index * BLOCK_SIZE;
            let want = want.unwrap_or_default();
            log::error!(
                "inode {ino} offset {offset} block {addr:#x}: data checksum {got:#010x}, expected {want:#010x}"
            );
            return Err(Error::DataChecksum(format!(
                "inode {ino} offset {offset} block {addr:#x}"
            )));
        }
    }
    Ok(())
}

/// A per-thread buffer of `len` bytes for a device read, reused so a read does not fault in
/// and zero fresh pages each time (kept only up to [`Scratch::KEEP`] bytes). The read
/// overwrites all of it; it is zeroed on take only where it grew.
struct Scratch(Vec<u8>);

impl Scratch {
    const KEEP: usize = 4 << 20;

    thread_local! {
        static SPARE: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    }

    fn take(len: usize) -> Scratch {
        let mut v = Self::SPARE.with(|s| std::mem::take(&mut *s.borrow_mut()));
        v.resize(len, 0);
        Scratch(v)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if self.0.capacity() <= Self::KEEP {
            let v = std::mem::take(&mut self.0);
            Self::SPARE.with(|s| *s.borrow_mut() = v);
        }
    }
}

#[cfg(test)]
mod tests {
    //! The data layer on its own, over an engine on a memory device: a written run reads back
    //! verified, a corrupted block fails its read naming the block, the free path keeps
    //! recorded blocks until the commit that freed them, and a failed write gives its
    //! blocks back at once.

    use super::*;
    use crate::data::test_support::{pattern, read_back, setup, INO};

    #[test]
    fn written_blocks_read_back_verified() {
        let (_mem, engine) = setup();
        let data = DataLayer::new(&engine);
        let bytes = pattern(3, 7);
        let runs = data.write_new(INO, 0, &bytes).expect("write");
        assert_eq!(runs.iter().map(|r| r.csums.len()).sum::<usize>(), 3);
        assert_eq!(read_back(&data, &runs).expect("read"), bytes);
        // A part of a block, in the middle of the run.
        let run = &runs[0];
        let mut part = vec![0u8; 100];
        data.read_verified(INO, 0, run.addr, &run.csums, 5000, 5100, &mut part)
            .expect("read part");
        assert_eq!(part, bytes[5000..5100]);
        // Recorded and looked up through the extent map.
        let (delta, _) = data
            .replace_range(INO, 0, bytes.len() as u64, runs, false)
            .expect("record");
        assert_eq!(delta, BlockDelta { added: 3, freed: 0 });
        let extents = data.extents(INO, 0, 3 * BLOCK_SIZE).expect("extents");
        assert_eq!(extents.len(), 1);
        assert_eq!(extents[0].1.len_bytes(), 3 * BLOCK_SIZE);
    }

    #[test]
    fn corrupted_block_fails_naming_the_block() {
        let (mem, engine) = setup();
        let data = DataLayer::new(&engine);
        let runs = data.write_new(INO, 0, &pattern(2, 1)).expect("write");
        let bad = runs[0].addr + BLOCK_SIZE;
        mem.corrupt(bad + 17, &[0xff, 0x00, 0xaa]);
        match read_back(&data, &runs) {
            Err(Error::DataChecksum(what)) => {
                assert!(what.contains(&format!("block {bad:#x}")), "{what}");
                assert!(
                    what.contains(&format!("inode {INO} offset {BLOCK_SIZE}")),
                    "{what}"
                );
            }
            other => panic!("expected a data checksum error, got {other:?}"),
        }
    }

    #[test]
    fn freed_blocks_stay_pinned_until_the_commit() {
        let (_mem, engine) = setup();
        let data = DataLayer::new(&engine);
        let runs = data.write_new(INO, 0, &pattern(4, 2)).expect("write");
        let addr = runs[0].addr;
        data.replace_range(INO, 0, 4 * BLOCK_SIZE, runs, false)
            .expect("record");
        engine.commit().expect("commit");
        let pinned_before = engine.allocator().pinned_blocks();
        let delta = data.drop_range(INO, 0, 4 * BLOCK_SIZE).expect("drop");
        assert_eq!(delta, BlockDelta { added: 0, freed: 4 });
        let (addr, four) = (BlockAddr::new(addr), BlockCount::new(4));
        assert_eq!(engine.allocator().pinned_blocks(), pinned_before + four);
        assert!(
            engine.allocator().is_used(addr),
            "freed block reusable before the commit"
        );
        // An allocation asking for exactly that place must not get it.
        let (got, blocks) = engine
            .allocate_data_near(addr, BlockCount::new(1), four)
            .expect("allocate");
        assert!(got + blocks <= addr || got >= addr + four);
        engine.allocator().free_now(got, blocks);
        engine.commit().expect("commit");
        // Released by that commit, the space is deferred for the backup trees (DESIGN §13.2):
        // still untouched by any search until DEFER_COMMITS more commits are durable.
        assert!(
            engine.allocator().is_used(addr),
            "reusable while a backup tree may still read it"
        );
        for i in 0..crate::alloc::DEFER_COMMITS {
            // A commit with nothing to write is no commit: give each one a change.
            let other = data
                .write_new(INO + 1, i * BLOCK_SIZE, &pattern(1, 9))
                .expect("write");
            data.replace_range(INO + 1, i * BLOCK_SIZE, BLOCK_SIZE, other, false)
                .expect("record");
            engine.commit().expect("commit");
        }
        assert!(
            !engine.allocator().is_used(addr),
            "not released after the deferral"
        );
        assert_eq!(
            engine
                .allocate_data_near(addr, BlockCount::new(1), four)
                .expect("reuse"),
            (addr, four)
        );
    }
}
