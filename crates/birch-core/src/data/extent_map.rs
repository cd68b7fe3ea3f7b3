//! A file's extent map as typed operations: the extents of a range (live, or in any read view
//! for snapshots), the file's layout, `SEEK_DATA`/`SEEK_HOLE`, the continuation goal of a
//! write, inline data, and the changes: dropping a range, replacing a range with newly written
//! blocks (joined to the extent before them when contiguous on disk), preallocating, and the
//! one place planned changes are applied ([`ExtentChanges`], [`DataLayer::apply`]).
//!
//! Owns: the extent items' keys and values (built, decoded, split into pieces, merged) and the
//! rules of a piece's generation and shared flag (the free path's contract, `super`'s module
//! doc). Must not touch: the device (no block is written or read here: new blocks come from
//! `write.rs`, reads are `read.rs`), the allocator's free space (blocks leave only through
//! [`DataLayer::free_extent_blocks`] and [`DataLayer::free`], in `free.rs`, and come only from
//! [`DataLayer::allocate`]; the one other question asked of it is the newest snapshot's
//! generation, for a merge), inodes and their locks (the caller holds the inode's write lock
//! and accounts the returned [`BlockDelta`]).

use std::collections::HashSet;

use birch_format::items::{Blob, ExtentKind, FileExtent};
use birch_format::{Key, BLOCK_SIZE, EXTENT_MAX_BLOCKS};

use super::{
    extent_key, BlockDelta, BlockRun, DataLayer, ItemChange, Layout, Seen, WrittenRun,
    EXTENT_MAX_BYTES,
};
use crate::error::{Error, Result};

/// Plans the removal of every extent byte in the block-aligned range `[from, to)` of `ino`,
/// given the extents that overlap it, in order: pieces outside the range are kept (split),
/// blocks inside are freed. A blob's window is narrowed, never split into blocks: its stored
/// blocks are freed only when no piece of the window is kept (DESIGN §16.5).
fn plan_drop_of(ino: u64, from: u64, to: u64, found: Vec<(u64, FileExtent)>) -> ExtentChanges {
    let mut changes = ExtentChanges::default();
    for (start, extent) in found {
        let len = extent.len_bytes();
        let ext_end = start + len;
        changes.set(extent_key(ino, start), None);
        changes.existed.insert(extent_key(ino, start));
        // An inline extent is only deleted (it holds no blocks). A piece of a regular extent
        // takes its blocks' checksums, a piece of a preallocated one only its length, a piece
        // of a blob's window the same blob with a narrower window.
        let (disk_addr, csums) = match &extent.kind {
            ExtentKind::Inline(_) => continue,
            ExtentKind::Regular { disk_addr, csums } => (*disk_addr, Some(csums)),
            ExtentKind::Prealloc { disk_addr, .. } => (*disk_addr, None),
            ExtentKind::Blob(blob) => {
                plan_blob_cut(ino, from, to, start, &extent, blob, &mut changes);
                continue;
            }
        };
        let piece = |lo: u64, hi: u64| -> FileExtent {
            let skip = (lo - start) / BLOCK_SIZE;
            let blocks = (hi - lo) / BLOCK_SIZE;
            let addr = disk_addr + skip * BLOCK_SIZE;
            let kind = match csums {
                Some(csums) => ExtentKind::Regular {
                    disk_addr: addr,
                    csums: csums[skip as usize..(skip + blocks) as usize].to_vec(),
                },
                None => ExtentKind::Prealloc {
                    disk_addr: addr,
                    blocks,
                },
            };
            // A piece of a shared extent stays shared (its blocks stay counted).
            FileExtent {
                generation: extent.generation,
                shared: extent.shared && kind.may_be_shared(),
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
            let run = BlockRun {
                addr: disk_addr + (cut_lo - start),
                blocks,
            };
            changes.frees.push((run, extent.generation, extent.shared));
            changes.delta.freed += blocks;
        }
    }
    changes
}

/// The blob part of [`plan_drop_of`]: the window of `extent` (at file offset `start`) loses
/// `[from, to)` (DESIGN §16.5). Pieces kept are narrower windows on the same blob: the bytes
/// they no longer cover stay stored until the blob goes (rule 5). One piece kept: nothing is
/// freed and the blob's item count is unchanged. Two pieces (a cut in the middle): both are
/// flagged and the blob gets one more reference (rule 2, counted per stored block as a clone's
/// blocks are). No piece: the stored run is freed, through the counts if flagged. The delta
/// is in charged blocks (§16.8: an item charges `ceil(stored · window / logical)`).
fn plan_blob_cut(
    ino: u64,
    from: u64,
    to: u64,
    start: u64,
    extent: &FileExtent,
    blob: &Blob,
    changes: &mut ExtentChanges,
) {
    let ext_end = start + extent.len_bytes();
    let left = (start < from).then_some((start, from));
    let right = (ext_end > to).then_some((to, ext_end));
    let kept: Vec<(u64, u64)> = left.into_iter().chain(right).collect();
    let shared = extent.shared || kept.len() > 1;
    for (lo, hi) in &kept {
        let narrowed = blob.narrowed(lo - start, hi - lo);
        changes.delta.added += narrowed.charged_blocks();
        let piece = FileExtent {
            generation: extent.generation,
            kind: ExtentKind::Blob(narrowed),
            shared,
        };
        changes.set(extent_key(ino, *lo), Some(piece.encode()));
    }
    changes.delta.freed += blob.charged_blocks();
    let run = BlockRun {
        addr: blob.disk_addr,
        blocks: blob.stored_blocks(),
    };
    if kept.len() > 1 {
        changes.references.push(run);
    }
    if kept.is_empty() {
        changes.frees.push((run, extent.generation, extent.shared));
    }
}

/// Extents of `ino` that overlap `[from, to)` in a read view (a snapshot's committed tree),
/// in order, each with its file offset: [`DataLayer::extents`] over any view. Extents never
/// overlap and none is longer than `EXTENT_MAX_BYTES`, so the range starts that far back.
pub(crate) fn extents_in<V: crate::items::ReadView + ?Sized>(
    view: &V,
    ino: u64,
    from: u64,
    to: u64,
) -> Result<Vec<(u64, FileExtent)>> {
    let lo = extent_key(ino, from.saturating_sub(EXTENT_MAX_BYTES - 1));
    let mut out = Vec::new();
    for (key, bytes) in view.range(&lo, &extent_key(ino, to), usize::MAX)? {
        let extent = FileExtent::decode(&bytes)
            .map_err(|e| Error::corrupt(format!("inode {ino} extent {key}"), e))?;
        if key.offset + extent.len_bytes() > from {
            out.push((key.offset, extent));
        }
    }
    Ok(out)
}

/// `SEEK_DATA` or `SEEK_HOLE` (`whence`) from `offset` in a file of `size` bytes whose extents
/// are the ones [`DataLayer::extents`] or [`extents_in`] return: `extents(from, to)` is asked
/// for those overlapping `[offset, size)`, only once `offset` is known to lie inside the file.
/// Every extent is data (inline, regular and preallocated alike); what no extent covers is a
/// hole, and the end of the file is one. `NoSuchAddress` (`ENXIO`) for an offset at or past
/// the end, or no data after it for `SEEK_DATA`; `Invalid` for another `whence`. `file` names
/// the file in those messages. The one seek for the live filesystem and for snapshots.
pub(crate) fn seek_data_or_hole(
    file: impl std::fmt::Display,
    size: u64,
    offset: u64,
    whence: i32,
    extents: impl FnOnce(u64, u64) -> Result<Vec<(u64, FileExtent)>>,
) -> Result<u64> {
    if offset >= size {
        return Err(Error::NoSuchAddress(format!(
            "seek {file} to {offset} past size {size}"
        )));
    }
    let extents = extents(offset, size)?;
    match whence {
        libc::SEEK_DATA => extents
            .iter()
            .find(|(s, e)| s + e.len_bytes() > offset)
            .map(|(s, _)| (*s).max(offset))
            .ok_or_else(|| Error::NoSuchAddress(format!("no data in {file} after {offset}"))),
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

/// Item changes and frees planned from one look at the extent map, applied together.
#[derive(Default)]
pub(super) struct ExtentChanges {
    items: Vec<ItemChange>,
    /// Blocks no longer referenced, each with its recorded birth generation and whether its
    /// extent was shared (flagged).
    frees: Vec<(BlockRun, u64, bool)>,
    /// Stored runs of blobs that gained an item (a cut in the middle): one more reference
    /// each, counted before any free.
    references: Vec<BlockRun>,
    pub(super) delta: BlockDelta,
    /// Keys that exist now (in the tree or the delta): only these need a deletion recorded.
    existed: HashSet<Key>,
}

impl ExtentChanges {
    pub(super) fn set(&mut self, key: Key, value: Option<Vec<u8>>) {
        self.items.retain(|(k, _)| *k != key);
        self.items.push((key, value));
    }
}

impl DataLayer<'_> {
    // ---- Look-ups ----

    /// Extents of `ino` that overlap `[from, to)`, in order, each with its file offset.
    pub(crate) fn extents(&self, ino: u64, from: u64, to: u64) -> Result<Vec<(u64, FileExtent)>> {
        let hi = extent_key(ino, to);
        // Extents never overlap, so only the last one starting at or before `from` can reach
        // into the range from the left: one reverse look finds it, then a range from there.
        let reach_floor = extent_key(ino, from.saturating_sub(EXTENT_MAX_BYTES - 1));
        let lo = match self.engine.last_in(&reach_floor, &extent_key(ino, from))? {
            Some((key, _)) => key,
            None => extent_key(ino, from),
        };
        let items = self.engine.range(&lo, &hi, usize::MAX)?;
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

    /// How the file keeps its data, from its first extent item: one range step answers both
    /// "inline?" and "any extent?" (an inline extent is the file's only one, at offset 0).
    pub(crate) fn layout(&self, ino: u64) -> Result<Layout> {
        let lo = extent_key(ino, 0);
        let hi = extent_key(ino, u64::MAX);
        let Some((key, bytes)) = self.engine.range(&lo, &hi, 1)?.into_iter().next() else {
            return Ok(Layout::Empty);
        };
        let extent = FileExtent::decode(&bytes)
            .map_err(|e| Error::corrupt(format!("inode {ino} extent {key}"), e))?;
        Ok(match extent.kind {
            ExtentKind::Inline(data) if key.offset == 0 => Layout::Inline(data),
            // An inline extent anywhere else is invalid (fsck reports it): not inline data.
            ExtentKind::Inline(_)
            | ExtentKind::Regular { .. }
            | ExtentKind::Prealloc { .. }
            | ExtentKind::Blob(_) => Layout::Blocks,
        })
    }

    /// The inline data of a file, if it is stored inline.
    pub(crate) fn inline_data(&self, ino: u64) -> Result<Option<Vec<u8>>> {
        match self.engine.get(&extent_key(ino, 0))? {
            Some(bytes) => match FileExtent::decode(&bytes)
                .map_err(|e| Error::corrupt(format!("inode {ino} extent at 0"), e))?
                .kind
            {
                ExtentKind::Inline(data) => Ok(Some(data)),
                ExtentKind::Regular { .. } | ExtentKind::Prealloc { .. } | ExtentKind::Blob(_) => {
                    Ok(None)
                }
            },
            None => Ok(None),
        }
    }

    /// Where a write at `offset` would continue the file on disk: the address just after
    /// the block before `offset`, if that block is allocated.
    pub(crate) fn continuation_goal(&self, ino: u64, offset: u64) -> Result<Option<u64>> {
        if offset < BLOCK_SIZE {
            return Ok(None);
        }
        let before = offset - BLOCK_SIZE;
        // Only the last extent starting at or before `before` can hold it: one reverse look,
        // not the look and range of `extents`.
        let floor = extent_key(ino, before.saturating_sub(EXTENT_MAX_BYTES - 1));
        let Some((key, bytes)) = self.engine.last_in(&floor, &extent_key(ino, before))? else {
            return Ok(None);
        };
        let extent = FileExtent::decode(&bytes)
            .map_err(|e| Error::corrupt(format!("inode {ino} extent {key}"), e))?;
        let start = key.offset;
        Ok(match extent.kind {
            ExtentKind::Regular { disk_addr, .. } | ExtentKind::Prealloc { disk_addr, .. }
                if start + extent.len_bytes() > before =>
            {
                Some(disk_addr + (offset - start))
            }
            // A blob's stored blocks are not the file's blocks one for one: continue after
            // the whole blob.
            ExtentKind::Blob(ref blob) if start + extent.len_bytes() > before => {
                Some(blob.disk_addr + blob.stored_blocks() * BLOCK_SIZE)
            }
            // Ends before the block before `offset` (a hole between), or holds no blocks.
            ExtentKind::Inline(_)
            | ExtentKind::Regular { .. }
            | ExtentKind::Prealloc { .. }
            | ExtentKind::Blob(_) => None,
        })
    }

    // ---- Changes (the caller holds the inode's write lock) ----

    /// Stores `content` (at most `INLINE_MAX_BYTES`) as the file's inline data.
    pub(crate) fn set_inline(&self, ino: u64, content: Vec<u8>) -> Result<()> {
        let txn = self.engine.begin()?;
        let extent = FileExtent {
            generation: txn.generation().get(),
            kind: ExtentKind::Inline(content),
            shared: false,
        };
        txn.put(extent_key(ino, 0), extent.encode());
        Ok(())
    }

    /// Deletes the file's inline extent (emptied, or its bytes are moving to a block).
    pub(crate) fn remove_inline(&self, ino: u64) -> Result<()> {
        self.engine.begin()?.delete(extent_key(ino, 0));
        Ok(())
    }

    /// Removes every extent byte in the block-aligned range `[from, to)`: pieces of extents
    /// reaching outside it are kept (split), blocks inside are freed (pinned).
    pub(crate) fn drop_range(&self, ino: u64, from: u64, to: u64) -> Result<BlockDelta> {
        let changes = self.plan_drop(ino, from, to)?;
        self.apply(changes)
    }

    /// Replaces `[offset, offset + len)` of the file with `runs` ([`DataLayer::write_new`] or
    /// [`DataLayer::write_reserved`] wrote them; they cover the range): one range drop, the new
    /// extent items, and a merge with the extent before them when contiguous on disk. With
    /// `keep`, also returns the items it set and deleted (for the fsync log). On failure
    /// nothing is recorded and the runs are given back.
    pub(crate) fn replace_range(
        &self,
        ino: u64,
        offset: u64,
        len: u64,
        runs: Vec<WrittenRun>,
        keep: bool,
    ) -> Result<(BlockDelta, Option<Vec<ItemChange>>)> {
        let taken: Vec<(BlockRun, u64)> = runs.iter().map(|r| (r.run(), r.birth)).collect();
        self.record_runs(ino, offset, len, runs, keep)
            .inspect_err(|_| {
                // Every failure comes before the first item is recorded (the look-ups, or
                // `begin` in `apply`): no item, delta or log batch saw the runs.
                for (run, birth) in taken {
                    self.free(run, birth, Seen::Unrecorded);
                }
            })
    }

    /// [`DataLayer::replace_range`] without the give-back.
    fn record_runs(
        &self,
        ino: u64,
        offset: u64,
        len: u64,
        runs: Vec<WrittenRun>,
        keep: bool,
    ) -> Result<(BlockDelta, Option<Vec<ItemChange>>)> {
        // One look-up from the byte before `offset` serves both the extents the new runs
        // replace and the one the first run may join (seed 003: one search per replace).
        let mut found = self.extents(ino, offset.saturating_sub(1), offset + len)?;
        let prev = found.first().filter(|(start, _)| *start < offset).cloned();
        found.retain(|(start, extent)| start + extent.len_bytes() > offset);
        let mut changes = plan_drop_of(ino, offset, offset + len, found);
        let generation = self.engine.running_generation().get();
        for run in runs {
            changes.delta.added += run.csums.len() as u64;
            let extent = FileExtent {
                generation,
                kind: ExtentKind::Regular {
                    disk_addr: run.addr,
                    csums: run.csums,
                },
                shared: false,
            };
            changes.set(extent_key(ino, run.file_offset), Some(extent.encode()));
        }
        self.merge_with_previous(ino, offset, prev, &mut changes);
        let kept = keep.then(|| changes.items.clone());
        Ok((self.apply(changes)?, kept))
    }

    /// Replaces `[offset, offset + window)` of the file with a window over `blob`
    /// ([`DataLayer::write_blob`] wrote it, `birth` its allocation's generation): one range
    /// drop and the blob's item, unflagged; asks the next commit for `INCOMPAT_BLOB_EXTENTS`.
    /// On failure nothing is recorded and the blob is given back.
    pub(crate) fn replace_with_blob(
        &self,
        ino: u64,
        offset: u64,
        blob: Blob,
        birth: u64,
    ) -> Result<BlockDelta> {
        let run = BlockRun {
            addr: blob.disk_addr,
            blocks: blob.stored_blocks(),
        };
        let len = u64::from(blob.window_len);
        let recorded = self
            .plan_drop(ino, offset, offset + len)
            .and_then(|mut changes| {
                changes.delta.added += blob.charged_blocks();
                let extent = FileExtent {
                    generation: self.engine.running_generation().get(),
                    kind: ExtentKind::Blob(blob),
                    shared: false,
                };
                changes.set(extent_key(ino, offset), Some(extent.encode()));
                // The commit that records the blob sets the flag (FORMAT §9).
                self.engine
                    .want_incompat(birch_format::superblock::INCOMPAT_BLOB_EXTENTS);
                self.apply(changes)
            });
        recorded.inspect_err(|_| self.free(run, birth, Seen::Unrecorded))
    }

    /// Allocates preallocated extents (read as zeros) for every unmapped block of the
    /// block-rounded range `[from, to)`. On failure gives back what it allocated.
    pub(crate) fn preallocate(&self, ino: u64, from: u64, to: u64) -> Result<BlockDelta> {
        let lo = from / BLOCK_SIZE * BLOCK_SIZE;
        let hi = to.div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
        let mut holes = Vec::new();
        let mut cursor = lo;
        for (s, e) in self.extents(ino, lo, hi)? {
            let end = s + e.len_bytes();
            if s > cursor {
                holes.push((cursor, s.min(hi)));
            }
            cursor = cursor.max(end);
        }
        if cursor < hi {
            holes.push((cursor, hi));
        }
        let mut changes = ExtentChanges::default();
        let generation = self.engine.running_generation().get();
        let mut allocated: Vec<BlockRun> = Vec::new();
        for (mut s, e) in holes {
            while s < e {
                let want = ((e - s) / BLOCK_SIZE).min(EXTENT_MAX_BLOCKS);
                let run = match self.allocate(None, want) {
                    Ok(run) => run,
                    Err(err) => {
                        for run in allocated {
                            self.free(run, generation, Seen::Unrecorded);
                        }
                        return Err(err);
                    }
                };
                allocated.push(run);
                let extent = FileExtent {
                    generation,
                    kind: ExtentKind::Prealloc {
                        disk_addr: run.addr,
                        blocks: run.blocks,
                    },
                    shared: false,
                };
                changes.set(extent_key(ino, s), Some(extent.encode()));
                changes.delta.added += run.blocks;
                s += run.blocks * BLOCK_SIZE;
            }
        }
        self.apply(changes)
    }

    /// Computes removal of every extent byte in the block-aligned range `[from, to)`: pieces
    /// outside the range are kept (split), blocks inside are freed.
    pub(super) fn plan_drop(&self, ino: u64, from: u64, to: u64) -> Result<ExtentChanges> {
        Ok(plan_drop_of(ino, from, to, self.extents(ino, from, to)?))
    }

    /// Joins the first new extent to the one before it when both are contiguous on disk; the
    /// joined extent keeps the earlier one's generation. `prev` is the extent that holds the
    /// byte before `offset`, if any.
    fn merge_with_previous(
        &self,
        ino: u64,
        offset: u64,
        prev: Option<(u64, FileExtent)>,
        changes: &mut ExtentChanges,
    ) {
        if offset == 0 {
            return;
        }
        let Some((_, Some(first_bytes))) = changes
            .items
            .iter()
            .find(|(k, _)| *k == extent_key(ino, offset))
            .cloned()
        else {
            return;
        };
        let Ok(first) = FileExtent::decode(&first_bytes) else {
            return;
        };
        if first.shared {
            return;
        }
        // Only a regular extent joins (`record_runs` sets regular, unshared ones).
        let (disk_addr, csums) = match first.kind {
            ExtentKind::Regular { disk_addr, csums } => (disk_addr, csums),
            ExtentKind::Inline(_) | ExtentKind::Prealloc { .. } | ExtentKind::Blob(_) => return,
        };
        let Some((prev_off, prev)) = prev else {
            return;
        };
        if changes
            .items
            .iter()
            .any(|(k, v)| *k == extent_key(ino, prev_off) && v.is_none())
        {
            return;
        }
        // Never joins a shared extent (DESIGN §15.6): its blocks' counts are per extent piece.
        if prev.shared {
            return;
        }
        // Only onto a regular extent: a preallocated one reads as zeros, an inline one is not
        // followed by blocks, a blob's window is not its stored blocks.
        let (prev_addr, prev_csums) = match prev.kind {
            ExtentKind::Regular { disk_addr, csums } => (disk_addr, csums),
            ExtentKind::Inline(_) | ExtentKind::Prealloc { .. } | ExtentKind::Blob(_) => return,
        };
        let prev_len = prev_csums.len() as u64 * BLOCK_SIZE;
        if prev_off + prev_len != offset
            || prev_addr + prev_len != disk_addr
            || prev_csums.len() + csums.len() > EXTENT_MAX_BLOCKS as usize
        {
            return;
        }
        // Never across a snapshot (DESIGN §15.6 rule 1): the new blocks would take the earlier
        // extent's birth, at or before the snapshot, and a free would keep them for it.
        let newest = self.engine.allocator().newest_snapshot_generation().get();
        if newest != 0 && prev.generation <= newest {
            return;
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
        // The earlier extent's generation: the recorded birth of its blocks must never move
        // forward (the free path's contract, module doc).
        let merged = FileExtent {
            generation: prev.generation,
            kind: ExtentKind::Regular {
                disk_addr: prev_addr,
                csums: joined,
            },
            shared: false,
        };
        changes.set(extent_key(ino, prev_off), Some(merged.encode()));
    }

    /// Records planned changes in the running transaction: items set and deleted, blocks
    /// freed through [`DataLayer::free`].
    pub(super) fn apply(&self, changes: ExtentChanges) -> Result<BlockDelta> {
        let txn = self.engine.begin()?;
        if !changes.references.is_empty() {
            // The first commit that records a flagged item sets the flag (FORMAT §9); the
            // counts come first, as a clone's do (`clone.rs`).
            self.engine
                .want_incompat(birch_format::superblock::INCOMPAT_SHARED_EXTENTS);
            let alloc = self.engine.allocator();
            for run in &changes.references {
                let whole = (run.disk_addr(), run.block_count());
                alloc.add_shared(whole, whole);
            }
        }
        for (key, value) in changes.items {
            match value {
                Some(v) => txn.put(key, v),
                None => txn.delete(key),
            }
        }
        for (run, birth, shared) in changes.frees {
            self.free_extent_blocks(run, birth, shared, &txn);
        }
        Ok(changes.delta)
    }
}

#[cfg(test)]
mod tests {
    //! The extent map over an engine on a memory device: layout and continuation goal from one
    //! look-up, the longest extent, merges of appends (older birth kept; never across a
    //! snapshot; never into a shared extent: `clone.rs`), and runs that cannot be recorded
    //! going back.

    use birch_format::{BlockAddr, BlockCount, Generation};

    use super::*;
    use crate::data::test_support::{pattern, setup, two_contiguous_runs, INO};

    const B: u64 = BLOCK_SIZE;

    /// A blob of 8 logical blocks in 3 stored ones at 0x50000, its window blocks 1..7.
    fn blob_extent(shared: bool) -> FileExtent {
        FileExtent {
            generation: 5,
            kind: ExtentKind::Blob(Blob {
                disk_addr: 0x50000,
                codec: birch_format::codec::Codec::Lz4,
                encoded_len: 3 * 4096 - 7,
                logical: 8 * 4096,
                window_offset: 4096,
                window_len: 6 * 4096,
                nonce: 0,
                csums: vec![11, 12, 13],
            }),
            shared,
        }
    }

    /// The blob of a blob extent (tests only build blob extents here).
    fn the_blob(extent: &FileExtent) -> Blob {
        let ExtentKind::Blob(blob) = &extent.kind else {
            panic!("not a blob: {extent:?}");
        };
        blob.clone()
    }

    /// The kept item at `offset` in planned changes, decoded (blob items are not accepted by
    /// the public decoder yet, so the window is read from the bytes: offset 30, length 34).
    fn kept_window(changes: &ExtentChanges, offset: u64) -> Option<(u32, u32, u8)> {
        changes.items.iter().find_map(|(k, v)| {
            let v = v.as_ref()?;
            (*k == extent_key(INO, offset)).then(|| {
                let word = |at: usize| u32::from_le_bytes(v[at..at + 4].try_into().expect("4"));
                (word(30), word(34), v[9])
            })
        })
    }

    /// A cut narrows a blob's window and frees nothing while a piece is kept; a drop of the
    /// whole window frees the blob's stored blocks (3, not the window's 6) with its birth,
    /// through the counts if flagged; a cut in the middle flags both pieces and adds one
    /// reference to the stored run. Deltas are charged blocks: ceil(3 · window / 8).
    #[test]
    fn blob_cuts_narrow_the_window_or_free_the_whole_blob() {
        let start = 10 * B; // the window covers file blocks 10..16
        let found = || vec![(start, blob_extent(false))];
        let delta = |c: &ExtentChanges| (c.delta.added, c.delta.freed);
        // Truncate to 12 blocks: the left piece, window blocks 1..3 of the blob.
        let c = plan_drop_of(INO, 12 * B, 100 * B, found());
        assert_eq!(kept_window(&c, start), Some((4096, 2 * 4096, 0)));
        assert!(c.frees.is_empty() && c.references.is_empty());
        assert_eq!(
            delta(&c),
            (1, 3),
            "ceil(3·2/8) charged now, ceil(3·6/8) before"
        );
        // Punch the head: the right piece starts at 13 blocks, blob bytes 4..7.
        let c = plan_drop_of(INO, 8 * B, 13 * B, found());
        assert_eq!(kept_window(&c, 13 * B), Some((4 * 4096, 3 * 4096, 0)));
        assert_eq!(kept_window(&c, start), None, "the old key is deleted");
        assert!(c.frees.is_empty());
        // Everything: the stored run goes, once.
        let c = plan_drop_of(INO, 0, 100 * B, found());
        assert_eq!(c.frees.len(), 1);
        let (run, birth, shared) = c.frees[0];
        assert_eq!(
            (run.addr, run.blocks, birth, shared),
            (0x50000, 3, 5, false)
        );
        assert_eq!(delta(&c), (0, 3));
        // The middle: two flagged items on one blob, one more reference, nothing freed.
        let c = plan_drop_of(INO, 12 * B, 13 * B, found());
        assert_eq!(kept_window(&c, start), Some((4096, 2 * 4096, 1)));
        assert_eq!(kept_window(&c, 13 * B), Some((4 * 4096, 3 * 4096, 1)));
        assert!(c.frees.is_empty());
        assert_eq!(c.references.len(), 1);
        assert_eq!((c.references[0].addr, c.references[0].blocks), (0x50000, 3));
        assert_eq!(
            delta(&c),
            (1 + 2, 3),
            "a cut blob may be charged a block more"
        );
        // A flagged window: narrowing keeps its flag; dropping it frees through the counts.
        let flagged = || vec![(start, blob_extent(true))];
        let c = plan_drop_of(INO, 15 * B, 100 * B, flagged());
        assert_eq!(kept_window(&c, start), Some((4096, 5 * 4096, 1)));
        let c = plan_drop_of(INO, 0, 100 * B, flagged());
        assert_eq!(c.frees.len(), 1);
        assert!(c.frees[0].2, "dropped as shared: one reference less");
    }

    /// Over an engine: a middle cut of a blob window counts the stored run's references (2),
    /// dropping one piece leaves 1 and frees nothing, dropping the other frees the run.
    #[test]
    fn blob_references_follow_its_items() {
        let (_mem, engine) = setup();
        let data = DataLayer::new(&engine);
        let runs = data.write_new(INO, 0, &pattern(3, 2)).expect("write");
        let blob = Blob {
            disk_addr: runs[0].addr,
            csums: runs[0].csums.clone(),
            ..the_blob(&blob_extent(false))
        };
        let at = BlockAddr::new(blob.disk_addr);
        let extent = FileExtent {
            generation: engine.running_generation().get(),
            kind: ExtentKind::Blob(blob),
            shared: false,
        };
        let used_before = engine.allocator().free_blocks();
        let middle = plan_drop_of(INO, 12 * B, 13 * B, vec![(10 * B, extent.clone())]);
        data.apply(middle).expect("apply");
        assert_eq!(engine.allocator().shared_references(at), 2);
        assert!(engine.incompat_pending(), "the shared flag is wanted");
        let left = FileExtent {
            shared: true,
            kind: ExtentKind::Blob(the_blob(&extent).narrowed(0, 2 * B)),
            ..extent.clone()
        };
        let right = FileExtent {
            shared: true,
            kind: ExtentKind::Blob(the_blob(&extent).narrowed(3 * B, 3 * B)),
            ..extent.clone()
        };
        data.apply(plan_drop_of(INO, 0, 12 * B, vec![(10 * B, left)]))
            .expect("drop left");
        assert_eq!(engine.allocator().shared_references(at), 1);
        assert_eq!(
            engine.allocator().free_blocks(),
            used_before,
            "nothing freed yet"
        );
        data.apply(plan_drop_of(INO, 0, 100 * B, vec![(13 * B, right)]))
            .expect("drop right");
        assert_eq!(engine.allocator().shared_references(at), 0);
    }

    #[test]
    fn layout_and_continuation_goal_answer_from_one_lookup() {
        let (_mem, engine) = setup();
        let data = DataLayer::new(&engine);
        assert_eq!(data.layout(INO).expect("layout"), Layout::Empty);
        assert_eq!(data.continuation_goal(INO, BLOCK_SIZE).expect("goal"), None);
        data.set_inline(INO, b"tiny".to_vec()).expect("inline");
        assert_eq!(
            data.layout(INO).expect("layout"),
            Layout::Inline(b"tiny".to_vec())
        );
        // Another file's extents never leak into this one's answers.
        assert_eq!(data.layout(INO + 1).expect("layout"), Layout::Empty);
        // Blocks at 8 KiB..20 KiB, a hole before them.
        let runs = data
            .write_new(INO + 1, 2 * BLOCK_SIZE, &pattern(3, 4))
            .expect("write");
        let addr = runs[0].addr;
        data.replace_range(INO + 1, 2 * BLOCK_SIZE, 3 * BLOCK_SIZE, runs, false)
            .expect("record");
        assert_eq!(data.layout(INO + 1).expect("layout"), Layout::Blocks);
        let goal = |offset| data.continuation_goal(INO + 1, offset).expect("goal");
        // In the hole, and right after it: no block before.
        assert_eq!(goal(BLOCK_SIZE), None);
        assert_eq!(goal(2 * BLOCK_SIZE), None);
        // Inside the extent and just past its end: after the block before.
        assert_eq!(goal(3 * BLOCK_SIZE), Some(addr + BLOCK_SIZE));
        assert_eq!(goal(5 * BLOCK_SIZE), Some(addr + 3 * BLOCK_SIZE));
        // Past the block after the extent: nothing before it.
        assert_eq!(goal(6 * BLOCK_SIZE), None);
        // The same answers once the extent is in the tree rather than the delta.
        engine.commit().expect("commit");
        assert_eq!(goal(5 * BLOCK_SIZE), Some(addr + 3 * BLOCK_SIZE));
        assert_eq!(goal(6 * BLOCK_SIZE), None);
        assert_eq!(data.layout(INO + 1).expect("layout"), Layout::Blocks);
    }

    /// The look-ups at an extent of the longest length after a hole: the goal at its end,
    /// inside it, at the hole and past it, from the delta and the tree; an append after it
    /// stays its own extent; an overwrite of its last block splits it; after a truncate whose
    /// deletions hide the tree's extents, no goal and an empty layout (session-17 review).
    #[test]
    fn lookups_at_the_longest_extent_and_after_a_truncate() {
        let (_mem, engine) = setup();
        let data = DataLayer::new(&engine);
        let max = EXTENT_MAX_BLOCKS;
        let runs = data
            .write_new(INO, BLOCK_SIZE, &pattern(max, 1))
            .expect("write");
        assert_eq!(runs.len(), 1);
        let addr = runs[0].addr;
        data.replace_range(INO, BLOCK_SIZE, max * BLOCK_SIZE, runs, false)
            .expect("record");
        let end = BLOCK_SIZE + EXTENT_MAX_BYTES;
        let goal = |offset| data.continuation_goal(INO, offset).expect("goal");
        assert_eq!(goal(end), Some(addr + EXTENT_MAX_BYTES));
        assert_eq!(
            goal(end - BLOCK_SIZE),
            Some(addr + EXTENT_MAX_BYTES - BLOCK_SIZE)
        );
        assert_eq!(goal(2 * BLOCK_SIZE), Some(addr + BLOCK_SIZE));
        assert_eq!(goal(BLOCK_SIZE), None);
        assert_eq!(goal(end + BLOCK_SIZE), None);
        engine.commit().expect("commit");
        assert_eq!(goal(end), Some(addr + EXTENT_MAX_BYTES));
        let runs = data.write_new(INO, end, &pattern(1, 2)).expect("append");
        data.replace_range(INO, end, BLOCK_SIZE, runs, false)
            .expect("record append");
        let all = data.extents(INO, 0, u64::MAX).expect("extents");
        assert_eq!(all.len(), 2, "{all:?}");
        assert_eq!(all[0].1.len_bytes(), EXTENT_MAX_BYTES);
        let runs = data
            .write_new(INO, end - BLOCK_SIZE, &pattern(1, 3))
            .expect("overwrite");
        let (delta, _) = data
            .replace_range(INO, end - BLOCK_SIZE, BLOCK_SIZE, runs, false)
            .expect("record overwrite");
        assert_eq!(delta, BlockDelta { added: 1, freed: 1 });
        let all = data.extents(INO, 0, u64::MAX).expect("extents");
        let starts: Vec<u64> = all.iter().map(|(s, _)| *s).collect();
        assert_eq!(starts, vec![BLOCK_SIZE, end - BLOCK_SIZE, end], "{all:?}");
        assert_eq!(all[0].1.len_bytes(), EXTENT_MAX_BYTES - BLOCK_SIZE);
        // Deleted in the delta (a truncate), an older extent in the tree behind: no goal from
        // the deleted one, and the layout sees past the deletions.
        engine.commit().expect("commit");
        data.drop_range(INO, 0, u64::MAX / BLOCK_SIZE * BLOCK_SIZE)
            .expect("truncate");
        assert_eq!(goal(end), None);
        assert_eq!(data.layout(INO).expect("layout"), Layout::Empty);
    }

    #[test]
    fn merged_extent_keeps_the_older_birth() {
        let (_mem, engine) = setup();
        let data = DataLayer::new(&engine);
        // Two blocks written together (contiguous on disk); the first is recorded in one
        // generation, the second, appended, in the next, and merges into the first's extent.
        let (first, second) = two_contiguous_runs(&data);
        data.replace_range(INO, 0, BLOCK_SIZE, vec![first], false)
            .expect("record");
        let born = engine.running_generation().get();
        engine.commit().expect("commit");
        assert!(engine.running_generation().get() > born);
        data.replace_range(INO, BLOCK_SIZE, BLOCK_SIZE, vec![second], false)
            .expect("record the append");
        let extents = data.extents(INO, 0, 2 * BLOCK_SIZE).expect("extents");
        assert_eq!(extents.len(), 1, "append did not merge: {extents:?}");
        assert_eq!(extents[0].1.len_bytes(), 2 * BLOCK_SIZE);
        assert_eq!(extents[0].1.generation, born);
    }

    #[test]
    fn an_append_is_not_merged_across_a_snapshot() {
        let (_mem, engine) = setup();
        let data = DataLayer::new(&engine);
        // As in merged_extent_keeps_the_older_birth, but a snapshot of the first block's
        // commit stands between the two (DESIGN §15.6 rule 1).
        let (first, second) = two_contiguous_runs(&data);
        data.replace_range(INO, 0, BLOCK_SIZE, vec![first], false)
            .expect("record");
        let born = engine.running_generation().get();
        engine.commit().expect("commit");
        engine.allocator().add_hold(Generation::new(born));
        data.replace_range(INO, BLOCK_SIZE, BLOCK_SIZE, vec![second], false)
            .expect("record the append");
        let extents = data.extents(INO, 0, 2 * BLOCK_SIZE).expect("extents");
        assert_eq!(extents.len(), 2, "merged across the snapshot: {extents:?}");
        assert_eq!(extents[0].1.generation, born);
        assert!(extents[1].1.generation > born);
    }

    #[test]
    fn runs_that_cannot_be_recorded_go_back() {
        let (_mem, engine) = setup();
        let data = DataLayer::new(&engine);
        let free_before = engine.allocator().free_blocks();
        let runs = data.write_new(INO, 0, &pattern(3, 6)).expect("write");
        assert_eq!(
            engine.allocator().free_blocks(),
            free_before - BlockCount::new(3)
        );
        // A shut-down engine takes no item: nothing is recorded and the blocks go back.
        engine.shut_down();
        assert!(data
            .replace_range(INO, 0, 3 * BLOCK_SIZE, runs, false)
            .is_err());
        assert_eq!(engine.allocator().free_blocks(), free_before);
    }
}
