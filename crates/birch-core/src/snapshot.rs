//! Snapshots of the whole filesystem (DESIGN §15): the list, its tree, and what a deletion
//! gives back.
//!
//! Owns: the [`Snapshot`] type and its name rules ([`check_name`]), reading and writing the
//! snapshot list tree (FORMAT §3.2: owner [`SNAPSHOT_TREE_ID`], one `Snapshot` item per
//! snapshot, written whole by the commit that changes it), the open's walk of every snapshot's
//! tree (their blocks are used space, each distinct node read once), and the deletion walk
//! that finds the blocks only a deleted snapshot held ([`deletion_frees`]).
//!
//! Must not touch: when a snapshot is made or deleted (the engine's commit decides: `txn`
//! queues the operations and applies them at a freeze), and the free of single blocks (the
//! allocator's sharing-aware free, [`crate::alloc::Allocator::free_recorded`], decides what a
//! snapshot holds). Every read here goes through the engine's tree context (checksummed,
//! verified nodes); no lock is held across a read.

use std::collections::{BTreeMap, HashMap, HashSet};

use birch_format::items::{FileExtent, SnapshotItem, Timespec};
use birch_format::node::NodeBody;
use birch_format::superblock::{RootPtr, RESERVED_HEAD_BYTES};
use birch_format::{
    BlockAddr, BlockCount, FormatError, Generation, ItemType, Key, BLOCK_SIZE, NAME_MAX,
    NODE_BLOCKS, SNAPSHOT_TREE_ID,
};

use crate::alloc::Allocator;
use crate::btree::{TreeCtx, TreeWriter};
use crate::error::{Error, Result};

/// One snapshot: the fs tree of commit `generation`, kept read-only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// Never reused, also after a deletion; ascends with age.
    pub id: u64,
    /// 1 ..= 255 bytes, no `/`, no NUL; unique among the snapshots.
    pub name: String,
    /// The commit whose tree the snapshot keeps.
    pub generation: u64,
    /// That commit's fs tree root.
    pub root: RootPtr,
    /// When it was made (wall clock).
    pub created: Timespec,
}

impl Snapshot {
    fn item(&self) -> SnapshotItem {
        SnapshotItem {
            generation: self.generation,
            root: self.root,
            created: self.created,
            name: self.name.as_bytes().to_vec(),
        }
    }
}

/// A change to the list that the next commit makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SnapshotOp {
    /// A snapshot of the commit's own tree.
    Create { name: String, created: Timespec },
    /// Drop snapshot `id`; the commit's deletion walk gives back what only it held.
    Delete { id: u64 },
    /// Make snapshot `id`'s tree the live tree (`birch rollback`): the commit writes no fs
    /// node, its root is the snapshot's, and the blocks only the replaced live tree held are
    /// given back by the deletion walk. Queued alone (with the deletions of every newer
    /// snapshot) on an engine whose delta is empty.
    Rollback { id: u64 },
}

/// Whether `snapshot`'s tree is newer than the live tree at `live_root`, and so not a past
/// state of it (DESIGN §15.4: every kept tree must be). The live tree's root node is written
/// by every commit that changes the tree, so a past state's root node is never newer than
/// the live root's (a rollback makes the live root a snapshot's, and deletes or refuses every
/// newer snapshot). Only a fallback to an older tree (`fsck --repair`) leaves such a
/// snapshot.
pub fn outside_lineage(snapshot: &Snapshot, live_root: RootPtr) -> bool {
    snapshot.root.generation > live_root.generation
}

/// The key of snapshot `id` in the list tree.
pub fn snapshot_key(id: u64) -> Key {
    Key::new(id, ItemType::Snapshot, 0)
}

/// Checks a snapshot name: not empty, at most [`NAME_MAX`] bytes, no `/` and no NUL, not `.`
/// or `..`.
pub fn check_name(name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::Invalid("snapshot name is empty".into()));
    }
    if name.len() > NAME_MAX {
        return Err(Error::NameTooLong(format!(
            "snapshot name of {} bytes (at most {NAME_MAX})",
            name.len()
        )));
    }
    if name.contains('/') || name.contains('\0') {
        return Err(Error::Invalid(format!(
            "snapshot name {name:?} contains '/' or NUL"
        )));
    }
    // Each snapshot is a directory entry of /.snapshot, where these two are taken.
    if name == "." || name == ".." {
        return Err(Error::Invalid(format!(
            "snapshot name {name:?} is reserved (a directory entry of /.snapshot)"
        )));
    }
    Ok(())
}

/// The context for the list tree's nodes (owner [`SNAPSHOT_TREE_ID`]).
fn list_ctx(ctx: TreeCtx<'_>) -> TreeCtx<'_> {
    TreeCtx {
        owner: SNAPSHOT_TREE_ID,
        ..ctx
    }
}

/// Reads the snapshot list at `root` (address 0: no list), oldest first, and the addresses of
/// its nodes. Errors name the list node or item that failed.
pub(crate) fn read_list(ctx: TreeCtx<'_>, root: RootPtr) -> Result<(Vec<Snapshot>, Vec<u64>)> {
    let mut list = Vec::new();
    let mut nodes = Vec::new();
    if root.addr == 0 {
        return Ok((list, nodes));
    }
    let ctx = list_ctx(ctx);
    let mut stack = vec![(root.addr, root.generation, root.level)];
    while let Some((addr, generation, level)) = stack.pop() {
        nodes.push(addr);
        let node = ctx.read(BlockAddr::new(addr), Generation::new(generation), level)?;
        match &node.body {
            NodeBody::Internal(ptrs) => {
                stack.extend(ptrs.iter().map(|p| (p.addr, p.generation, level - 1)));
            }
            NodeBody::Leaf(items) => {
                for (key, value) in items {
                    if key.kind() != Some(ItemType::Snapshot) || key.offset != 0 {
                        return Err(Error::corrupt(
                            format!("snapshot list node {addr:#x}"),
                            FormatError::invalid(
                                format!("item {key}"),
                                "another item",
                                "(id, snapshot, 0)",
                            ),
                        ));
                    }
                    let item = SnapshotItem::decode(value).map_err(|e| {
                        Error::corrupt(format!("snapshot {} in node {addr:#x}", key.objectid), e)
                    })?;
                    list.push(Snapshot {
                        id: key.objectid,
                        name: String::from_utf8_lossy(&item.name).into_owned(),
                        generation: item.generation,
                        root: item.root,
                        created: item.created,
                    });
                }
            }
        }
    }
    list.sort_by_key(|s| s.id);
    Ok((list, nodes))
}

/// Writes `list` as a new list tree in `generation`; returns its root and its nodes (to cache
/// once the commit is durable). An empty list has no tree (address 0).
pub(crate) fn write_list(
    ctx: TreeCtx<'_>,
    alloc: &Allocator,
    generation: Generation,
    list: &[Snapshot],
) -> Result<(RootPtr, Vec<std::sync::Arc<birch_format::node::Node>>)> {
    if list.is_empty() {
        return Ok((RootPtr::default(), Vec::new()));
    }
    let mut writer = TreeWriter::create(list_ctx(ctx), alloc, generation)?;
    for snapshot in list {
        writer.insert(snapshot_key(snapshot.id), snapshot.item().encode())?;
    }
    let nodes = writer.write_dirty()?;
    Ok((writer.root(), nodes))
}

/// The open's walk of the snapshots' trees, newest first (DESIGN §15.4, §15.6 rule 3): each
/// node no tree walked before reached is marked used (a node reached at the same generation is
/// shared, its subtree skipped; at another generation the image is damaged); an extent's
/// blocks are marked, and a block already used is accepted when the extent was born at or
/// before the snapshot and no node lies on it. `seen` holds the nodes walked so far
/// (address → generation). Any other conflict fails the open with the snapshot's name.
pub(crate) fn mark_snapshot_trees(
    ctx: TreeCtx<'_>,
    alloc: &Allocator,
    list: &[Snapshot],
    seen: &mut HashMap<u64, u64>,
) -> Result<()> {
    let total = alloc.total_blocks().bytes();
    for snapshot in list.iter().rev() {
        let what = format!(
            "open: snapshot {:?} (id {}, generation {})",
            snapshot.name, snapshot.id, snapshot.generation
        );
        let mut extents: Vec<(Key, u64, u64, u64)> = Vec::new();
        walk(
            ctx,
            snapshot.root,
            &mut |addr, generation| {
                if let Some(g) = seen.get(&addr) {
                    if *g == generation {
                        return Ok(false);
                    }
                    return Err(Error::corrupt(
                        what.clone(),
                        FormatError::invalid(
                            format!("node {addr:#x}"),
                            format!("generation {generation}"),
                            format!("generation {g} as another tree has it"),
                        ),
                    ));
                }
                if generation > snapshot.generation
                    || !alloc.mark_used(BlockAddr::new(addr), BlockCount::new(NODE_BLOCKS))
                {
                    return Err(Error::corrupt(
                        what.clone(),
                        FormatError::invalid(
                            format!("node {addr:#x} (generation {generation})"),
                            "newer than the snapshot or on used blocks",
                            "a node of the snapshot's tree on its own blocks",
                        ),
                    ));
                }
                seen.insert(addr, generation);
                Ok(true)
            },
            &mut |key, extent, node| {
                let extent = extent.map_err(|e| {
                    Error::corrupt(format!("{what}: extent {key} in node {node:#x}"), e)
                })?;
                if let Some((disk, blocks)) = extent.disk_range() {
                    extents.push((key, extent.generation, disk, blocks));
                }
                Ok(())
            },
        )?;
        for (key, birth, disk, blocks) in extents {
            let inside = disk >= RESERVED_HEAD_BYTES
                && disk % BLOCK_SIZE == 0
                && disk.saturating_add(blocks * BLOCK_SIZE) <= total;
            let clean = inside && alloc.mark_used(BlockAddr::new(disk), BlockCount::new(blocks));
            if clean {
                continue;
            }
            let shared = inside && birth <= snapshot.generation && !on_a_node(seen, disk, blocks);
            if !shared {
                return Err(Error::corrupt(
                    what.clone(),
                    FormatError::invalid(
                        format!("extent {key} at {disk:#x} x {blocks} blocks (generation {birth})"),
                        "outside the device, on a node, or newer than the snapshot",
                        "blocks of the data area born at or before the snapshot",
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Whether a node of `seen` lies on any of the `blocks` blocks at `disk`.
fn on_a_node(seen: &HashMap<u64, u64>, disk: u64, blocks: u64) -> bool {
    let node_bytes = NODE_BLOCKS * BLOCK_SIZE;
    let first = disk.saturating_sub(node_bytes - BLOCK_SIZE);
    let end = disk + blocks * BLOCK_SIZE;
    (first / BLOCK_SIZE..end.div_ceil(BLOCK_SIZE)).any(|b| seen.contains_key(&(b * BLOCK_SIZE)))
}

type NodeVisit<'a> = dyn FnMut(u64, u64) -> Result<bool> + 'a;
type ExtentVisit<'a> =
    dyn FnMut(Key, std::result::Result<FileExtent, FormatError>, u64) -> Result<()> + 'a;

/// Depth-first walk of an fs tree: `node(addr, generation)` before a node is read (`false`
/// skips it and its subtree), `extent(key, extent, node addr)` for every extent item; the
/// open's walk ([`crate::btree::walk::walk_tree`]) over these visitors.
fn walk(
    ctx: TreeCtx<'_>,
    root: RootPtr,
    node: &mut NodeVisit<'_>,
    extent: &mut ExtentVisit<'_>,
) -> Result<()> {
    crate::btree::walk::walk_tree(ctx, root, node, extent)
}

/// The blocks only the deleted snapshot `victim` held (DESIGN §15.4): its nodes and the blocks
/// of its extents born after `older` (the generation of the nearest older snapshot that stays,
/// 0 if none: what was born at or before it, that snapshot holds), that `newer` (the root of
/// the nearest newer snapshot that stays, or of the live tree the deleting commit wrote) does
/// not reference. `newer`'s nodes born after the victim are read; a pointer from them to a node
/// born at or before the victim names a subtree both trees share (the trees are copy-on-write,
/// so that node is in the victim's tree too), which the victim's walk skips. Its cost grows
/// with the change between the two trees, not with the filesystem, except when the victim's own
/// nodes hold blocks of shared (cloned) extents born after `older`: such a block may also be
/// named from a subtree the two trees share, so then the whole of `newer` is read once for the
/// shared extents it names, and only the blocks it does not name are freed (each once, though
/// the victim may name one twice). Why that is enough: a cloned block keeps its source's birth
/// b and the live tree names it without a break from b until its last live reference goes
/// (every clone is made from a live extent), so a snapshot names it exactly when it is at least
/// b and older than that drop: `older` names it if b ≤ `older`, and a tree newer than `newer`
/// names it only if `newer` does.
pub(crate) fn deletion_frees(
    ctx: TreeCtx<'_>,
    victim: &Snapshot,
    older: Generation,
    newer: RootPtr,
) -> Result<Vec<(BlockAddr, BlockCount)>> {
    // Compared below with the raw generations of node headers and extent items.
    let older = older.get();
    let mut shared: HashSet<u64> = HashSet::new();
    let mut newer_blocks: HashSet<u64> = HashSet::new();
    walk(
        ctx,
        newer,
        &mut |addr, generation| {
            if generation <= victim.generation {
                shared.insert(addr);
                return Ok(false);
            }
            Ok(true)
        },
        &mut |key, extent, node| {
            let extent =
                extent.map_err(|e| Error::corrupt(format!("extent {key} in node {node:#x}"), e))?;
            if let Some((disk, blocks)) = extent.disk_range() {
                let first = disk / BLOCK_SIZE;
                newer_blocks.extend(first..first + blocks);
            }
            Ok(())
        },
    )?;
    let mut frees: Vec<(BlockAddr, BlockCount)> = Vec::new();
    let mut node_frees: Vec<(BlockAddr, BlockCount)> = Vec::new();
    // Blocks of the victim's own shared extents born after `older`, not named by `newer`'s
    // nodes born after the victim: decided after the walk (below). Kept as ranges, so a
    // large clone costs an entry per extent, not per block.
    let mut shared_candidates = BlockRanges::default();
    walk(
        ctx,
        victim.root,
        &mut |addr, generation| {
            if generation <= older || shared.contains(&addr) {
                return Ok(false);
            }
            node_frees.push((BlockAddr::new(addr), BlockCount::new(NODE_BLOCKS)));
            Ok(true)
        },
        &mut |key, extent, node| {
            let extent =
                extent.map_err(|e| Error::corrupt(format!("extent {key} in node {node:#x}"), e))?;
            let Some((disk, blocks)) = extent.disk_range() else {
                return Ok(());
            };
            if extent.generation <= older {
                return Ok(());
            }
            let first = disk / BLOCK_SIZE;
            // Runs of the extent's blocks the newer tree's new nodes do not name.
            let mut runs: Vec<(u64, u64)> = Vec::new();
            let mut run: Option<(u64, u64)> = None;
            for block in first..first + blocks {
                if newer_blocks.contains(&block) {
                    runs.extend(run.take());
                    continue;
                }
                run = match run {
                    Some((start, len)) => Some((start, len + 1)),
                    None => Some((block, 1)),
                };
            }
            runs.extend(run);
            for (start, len) in runs {
                // A shared (cloned) extent's blocks may also be named from a subtree the
                // victim shares with the newer tree (skipped above), or twice in the victim
                // itself: decided below.
                if extent.shared {
                    shared_candidates.insert(start, start + len);
                } else {
                    frees.push((BlockAddr::new(start * BLOCK_SIZE), BlockCount::new(len)));
                }
            }
            Ok(())
        },
    )?;
    if !shared_candidates.is_empty() {
        let candidates = std::cell::RefCell::new(shared_candidates);
        // The newer tree, for the shared extents its subtrees common with the victim name
        // (each node of one tree is met once). A node written at or before `older` holds only
        // extents born then, none of them a candidate (their births are later), and so do
        // its children: such subtrees are skipped, and the walk stops descending once no
        // candidate is left.
        walk(
            ctx,
            newer,
            &mut |_, generation| Ok(generation > older && !candidates.borrow().is_empty()),
            &mut |key, extent, node| {
                let extent = extent
                    .map_err(|e| Error::corrupt(format!("extent {key} in node {node:#x}"), e))?;
                if let Some((disk, blocks)) = extent.disk_range() {
                    let first = disk / BLOCK_SIZE;
                    candidates.borrow_mut().remove(first, first + blocks);
                }
                Ok(())
            },
        )?;
        frees.extend(candidates.into_inner().iter().map(|(start, end)| {
            (
                BlockAddr::new(start * BLOCK_SIZE),
                BlockCount::new(end - start),
            )
        }));
    }
    frees.extend(node_frees);
    Ok(frees)
}

/// A set of block numbers kept as disjoint, non-adjacent half-open ranges `start → end`.
#[derive(Debug, Default)]
struct BlockRanges(BTreeMap<u64, u64>);

impl BlockRanges {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Adds `[start, end)`, merged with the ranges it overlaps or touches.
    fn insert(&mut self, mut start: u64, mut end: u64) {
        if start >= end {
            return;
        }
        // The range starting at or before `start` that reaches it, then every range starting
        // inside `[start, end]`.
        if let Some((&s, &e)) = self.0.range(..=start).next_back() {
            if e >= start {
                start = s;
                end = end.max(e);
                self.0.remove(&s);
            }
        }
        let inside: Vec<(u64, u64)> = self.0.range(start..=end).map(|(&s, &e)| (s, e)).collect();
        for (s, e) in inside {
            end = end.max(e);
            self.0.remove(&s);
        }
        self.0.insert(start, end);
    }

    /// Takes `[start, end)` out (ranges it cuts keep their parts outside it).
    fn remove(&mut self, start: u64, end: u64) {
        if start >= end || self.0.is_empty() {
            return;
        }
        let mut hit: Vec<(u64, u64)> = Vec::new();
        if let Some((&s, &e)) = self.0.range(..start).next_back() {
            if e > start {
                hit.push((s, e));
            }
        }
        hit.extend(self.0.range(start..end).map(|(&s, &e)| (s, e)));
        for (s, e) in hit {
            self.0.remove(&s);
            if s < start {
                self.0.insert(s, start);
            }
            if e > end {
                self.0.insert(end, e);
            }
        }
    }

    fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.0.iter().map(|(&s, &e)| (s, e))
    }
}

#[cfg(test)]
mod tests {
    use super::BlockRanges;

    fn ranges(r: &BlockRanges) -> Vec<(u64, u64)> {
        r.iter().collect()
    }

    #[test]
    fn block_ranges_merge_and_cut() {
        let mut r = BlockRanges::default();
        assert!(r.is_empty());
        r.insert(10, 20);
        r.insert(30, 40);
        r.insert(20, 25); // touches: merged
        assert_eq!(ranges(&r), [(10, 25), (30, 40)]);
        r.insert(12, 14); // inside: nothing new
        r.insert(24, 31); // bridges the two
        assert_eq!(ranges(&r), [(10, 40)]);
        r.insert(5, 5); // empty
        r.remove(15, 18); // a hole in the middle
        assert_eq!(ranges(&r), [(10, 15), (18, 40)]);
        r.remove(0, 11); // the head
        r.remove(39, 100); // the tail
        assert_eq!(ranges(&r), [(11, 15), (18, 39)]);
        r.remove(14, 19); // across the gap
        assert_eq!(ranges(&r), [(11, 14), (19, 39)]);
        r.remove(0, 1000);
        assert!(r.is_empty());
        // Against a set of blocks, at random.
        let mut model = std::collections::BTreeSet::new();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..2000 {
            let start = next(200);
            let end = start + next(20);
            if next(3) == 0 {
                r.remove(start, end);
                for b in start..end {
                    model.remove(&b);
                }
            } else {
                r.insert(start, end);
                model.extend(start..end);
            }
            let mut got = std::collections::BTreeSet::new();
            let mut last_end = None;
            for (s, e) in r.iter() {
                assert!(s < e, "empty range {s}..{e}");
                if let Some(le) = last_end {
                    assert!(s > le, "ranges touch or overlap: {:?}", ranges(&r));
                }
                last_end = Some(e);
                got.extend(s..e);
            }
            assert_eq!(got, model);
        }
    }
}
