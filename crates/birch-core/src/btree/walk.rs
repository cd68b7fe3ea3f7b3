//! Whole-tree walks: [`walk_tree`] (depth first, every node read and verified, a visitor per
//! node and per extent item) and [`union_walk`] (the open's walk over the union of several
//! trees, each distinct node once, DESIGN §15.6).
//!
//! Owns: the order of a walk and the skipping of subtrees a visitor declines. The one place
//! the B-tree decodes an item payload: extent items, for the visitors that mark or count the
//! blocks they name. Must not touch: the engine (walks take a [`TreeCtx`] or a device), the
//! live allocator (a union walk marks a fresh one), anything but reads.

use std::collections::HashMap;

use birch_format::items::FileExtent;
use birch_format::node::NodeBody;
use birch_format::superblock::RootPtr;
use birch_format::{
    BlockAddr, BlockCount, FormatError, Generation, ItemType, Key, FS_TREE_ID, NODE_BLOCKS,
};

use crate::alloc::Allocator;
use crate::cache::NodeCache;
use crate::counters::Counters;
use crate::device::BlockDevice;
use crate::error::{Error, Result};

use super::TreeCtx;

/// Walks the tree at `root` depth first, reading and verifying every node. `node(addr,
/// generation)` is called before a node is read; `Ok(false)` skips it and its subtree.
/// `extent(key, decoded extent, node addr)` is called for every extent item. The first
/// error (a node that does not read, or a visitor's) ends the walk.
/// The walk of the engine's open (its live, snapshot and backup trees), of [`union_walk`],
/// of the snapshot walks (`crate::snapshot`) and of `crate::space`.
pub(crate) fn walk_tree(
    ctx: TreeCtx<'_>,
    root: RootPtr,
    mut node: impl FnMut(u64, u64) -> Result<bool>,
    mut extent: impl FnMut(Key, std::result::Result<FileExtent, FormatError>, u64) -> Result<()>,
) -> Result<()> {
    let mut stack = vec![(root.addr, root.generation, root.level)];
    while let Some((addr, generation, level)) = stack.pop() {
        if !node(addr, generation)? {
            continue;
        }
        let read = ctx.read(BlockAddr::new(addr), Generation::new(generation), level)?;
        match &read.body {
            NodeBody::Internal(ptrs) => {
                stack.extend(ptrs.iter().map(|p| (p.addr, p.generation, level - 1)))
            }
            NodeBody::Leaf(items) => {
                for (key, value) in items {
                    if key.kind() == Some(ItemType::ExtentData) {
                        extent(*key, FileExtent::decode(value), addr)?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// What [`union_walk`] found (DESIGN §15.6).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UnionWalk {
    /// Distinct nodes read (and verified), each once.
    pub nodes_read: u64,
    /// Child pointers (or roots) not followed because their node was already reached from
    /// an earlier root: a shared subtree is skipped whole.
    pub nodes_shared: u64,
    /// Extent items decoded (in the distinct leaves only).
    pub extents: u64,
    /// Data blocks marked used (distinct).
    pub data_blocks: u64,
    /// Data blocks an extent of a distinct leaf reached when an earlier leaf had marked them
    /// already: the same block referenced from a leaf another root's copy replaced.
    pub data_blocks_again: u64,
    /// With `count_refs`: blocks in the map of multiply referenced blocks.
    pub counted_blocks: u64,
}

/// The open walk over the union of several trees (DESIGN §15.6), as snapshots will need it (rule 3):
/// each distinct node is read once (a pointer to a node already reached at the same
/// generation is shared, its subtree skipped; at another generation the image is corrupt),
/// every node and extent is marked in a fresh allocator, and with `count_refs` every data
/// block reached again gets a reference count in a map (the cost of deriving counts for all
/// multiply referenced blocks). Reads through a fresh node cache as an open does. Today only
/// the engine benchmark (`birch-engine-bench --only open`) and a test call it; the open
/// itself walks the newest tree and the backup roots the same way
/// ([`crate::txn::Engine::open`]).
pub fn union_walk(
    device: &dyn BlockDevice,
    fsid: [u8; 16],
    total_bytes: u64,
    roots: &[RootPtr],
    count_refs: bool,
) -> Result<UnionWalk> {
    let cache = NodeCache::new(65536);
    let counters = Counters::default();
    let ctx = TreeCtx {
        device,
        cache: &cache,
        counters: &counters,
        fsid,
        owner: FS_TREE_ID,
    };
    let alloc = Allocator::new(total_bytes);
    let mut seen: HashMap<u64, u64> = HashMap::new();
    let mut refs: HashMap<u64, u32> = HashMap::new();
    let mut walk = UnionWalk::default();
    for root in roots {
        walk_tree(
            ctx,
            *root,
            |addr, generation| match seen.get(&addr) {
                Some(g) if *g == generation => {
                    walk.nodes_shared += 1;
                    Ok(false)
                }
                Some(g) => Err(Error::corrupt(
                    format!("union walk: node {addr:#x}"),
                    FormatError::invalid(
                        format!("node {addr:#x}"),
                        format!("generation {generation} from another root"),
                        format!("generation {g}"),
                    ),
                )),
                None => {
                    seen.insert(addr, generation);
                    walk.nodes_read += 1;
                    if !alloc.mark_used(BlockAddr::new(addr), BlockCount::new(NODE_BLOCKS)) {
                        return Err(Error::corrupt(
                            format!("union walk: node {addr:#x}"),
                            FormatError::invalid(
                                format!("node {addr:#x}"),
                                "on blocks an extent holds",
                                "one reference to a free block",
                            ),
                        ));
                    }
                    Ok(true)
                }
            },
            |key, extent, addr| {
                let extent =
                    extent.map_err(|e| Error::corrupt(format!("extent {key} in {addr:#x}"), e))?;
                walk.extents += 1;
                if let Some((disk, blocks)) = extent.disk_range() {
                    if alloc.mark_used(BlockAddr::new(disk), BlockCount::new(blocks)) {
                        walk.data_blocks += blocks;
                    } else {
                        walk.data_blocks_again += blocks;
                        if count_refs {
                            let first = disk / birch_format::BLOCK_SIZE;
                            for block in first..first + blocks {
                                *refs.entry(block).or_insert(1) += 1;
                            }
                        }
                    }
                }
                Ok(())
            },
        )?;
    }
    walk.counted_blocks = refs.len() as u64;
    Ok(walk)
}
