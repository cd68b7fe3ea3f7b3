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
//!
//! **Files.** `mod.rs`: [`DataLayer`] and the small types every part shares ([`BlockRun`],
//! [`WrittenRun`], [`Seen`], [`BlockDelta`], [`Layout`]). `extent_map.rs`: the extent map's
//! look-ups and changes. `write.rs`: reservations, allocation and writes of new blocks.
//! `read.rs`: verified reads of extents. `clone.rs`: clones of ranges. `free.rs`: the free
//! path. `test_support.rs`: the unit tests' shared helpers.
//!
//! **Extent kinds.** Every decision on an extent's kind ([`ExtentKind`]) is a `match` naming
//! every kind, never a `_` arm, `let … else`, `if let` or `matches!`: a new kind (compressed,
//! encrypted) breaks the build at each place that must decide for it. The two lints below
//! catch `_` arms; the other forms are kept out by review.
//!
//! [`ExtentKind`]: birch_format::items::ExtentKind

#![deny(
    clippy::wildcard_enum_match_arm,
    clippy::match_wildcard_for_single_variants
)]

use birch_format::{BlockAddr, BlockCount, ItemType, Key, BLOCK_SIZE, EXTENT_MAX_BLOCKS};

use crate::txn::{Engine, WriteTxn};

mod blob_cache;
mod clone;
mod extent_map;
mod free;
mod read;
#[cfg(test)]
mod test_support;
mod write;

pub(crate) use blob_cache::BlobCache;
pub(crate) use extent_map::{extents_in, seek_data_or_hole};
pub(crate) use write::Staged;

/// The most file bytes one blob holds when birch writes it (DESIGN §16.3); the format allows
/// up to `birch_format::items::BLOB_MAX_LOGICAL`.
pub(crate) const BLOB_CAP_BYTES: u64 = 128 * 1024;

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
}
