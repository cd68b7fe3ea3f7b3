//! Clones of file ranges ([`DataLayer::clone_range`], `copy_file_range`, DESIGN §15.8): the
//! source's regular extent pieces shared into the destination as flagged extents, the
//! source's extents flagged, the shared blocks' reference counts added, and the destination's
//! old range dropped.
//!
//! Owns: the order of a clone's steps (counts, then flags, then the destination's drop and
//! the new extents) and the superblock's shared-extents flag request. Must not touch: the
//! device (a clone copies no byte; the caller copies unaligned heads and tails), inline data
//! (the caller copies inline files), inodes and locks (the caller holds both inodes' write
//! locks and has flushed their buffered data).

use birch_format::items::{ExtentKind, FileExtent};
use birch_format::{BlockAddr, BlockCount, Key, BLOCK_SIZE};

use super::{extent_key, BlockDelta, DataLayer};
use crate::error::{Error, Result};

impl DataLayer<'_> {
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
        let mut blob_pieces: Vec<(u64, FileExtent)> = Vec::new();
        for (start, extent) in self.extents(src, src_off, src_end)? {
            let (disk_addr, csums) = match &extent.kind {
                ExtentKind::Regular { disk_addr, csums } => (disk_addr, csums),
                ExtentKind::Inline(_) => {
                    return Err(Error::Invalid(format!(
                        "clone of inode {src}: an inline extent at {start}"
                    )));
                }
                // Preallocated: reads as zeros, and a hole in the clone does too.
                ExtentKind::Prealloc { .. } => continue,
                // A window over a blob: the clone's piece is a narrower window on the same
                // blob, and the blob's stored run gets one more reference (DESIGN §16.5).
                ExtentKind::Blob(blob) => {
                    let lo = start.max(src_off);
                    let hi = (start + extent.len_bytes()).min(src_end);
                    if lo >= hi {
                        continue;
                    }
                    let window = blob.narrowed(lo - start, hi - lo);
                    let run = (
                        BlockAddr::new(blob.disk_addr),
                        BlockCount::new(blob.stored_blocks()),
                    );
                    blob_pieces.push((
                        dst_off + (lo - src_off),
                        FileExtent {
                            generation: extent.generation,
                            kind: ExtentKind::Blob(window),
                            shared: true,
                        },
                    ));
                    counts.push((run, run));
                    if !extent.shared {
                        let mut flagged = extent.clone();
                        flagged.shared = true;
                        flags.push((extent_key(src, start), flagged));
                    }
                    continue;
                }
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
        if pieces.is_empty() && blob_pieces.is_empty() {
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
        // A blob window charges its share of the stored blocks (DESIGN §16.8).
        for (offset, piece) in blob_pieces {
            let charged = match &piece.kind {
                ExtentKind::Blob(blob) => blob.charged_blocks(),
                ExtentKind::Inline(_)
                | ExtentKind::Regular { .. }
                | ExtentKind::Prealloc { .. } => 0,
            };
            changes.delta.added += charged;
            shared += charged;
            changes.set(extent_key(dst, offset), Some(piece.encode()));
        }
        Ok((self.apply(changes)?, shared))
    }
}

#[cfg(test)]
mod tests {
    //! Clones over an engine on a memory device: the source extent becomes shared, and an
    //! append contiguous with it is not merged into it.

    use super::*;
    use crate::data::test_support::{setup, two_contiguous_runs, INO};

    /// An append contiguous on disk with a shared extent is not merged into it (DESIGN §15.6:
    /// a shared extent's blocks are counted; a merge would make new blocks look shared).
    #[test]
    fn an_append_is_not_merged_into_a_shared_extent() {
        let (_mem, engine) = setup();
        let data = DataLayer::new(&engine);
        let (first, second) = two_contiguous_runs(&data);
        data.replace_range(INO, 0, BLOCK_SIZE, vec![first], false)
            .expect("record");
        // Clone the first block into another inode: the source extent becomes shared.
        let (delta, shared) = data
            .clone_range(INO, 0, INO + 1, 0, BLOCK_SIZE)
            .expect("clone");
        assert_eq!((delta.added, shared), (1, 1));
        data.replace_range(INO, BLOCK_SIZE, BLOCK_SIZE, vec![second], false)
            .expect("record the append");
        let extents = data.extents(INO, 0, 2 * BLOCK_SIZE).expect("extents");
        assert_eq!(extents.len(), 2, "merged into a shared extent: {extents:?}");
        assert!(extents[0].1.shared && !extents[1].1.shared);
        let clone = data.extents(INO + 1, 0, BLOCK_SIZE).expect("clone extents");
        assert_eq!(clone.len(), 1);
        assert!(clone[0].1.shared);
        assert_eq!(clone[0].1.kind, extents[0].1.kind);
    }
}
