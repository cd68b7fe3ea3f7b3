//! Changing a tree inside one generation, copy-on-write.

use std::collections::HashMap;
use std::sync::Arc;

use birch_format::node::{
    leaf_item_bytes, ChildPtr, Node, NodeBody, NodeHeader, LEAF_SPACE, MAX_PTRS,
};
use birch_format::superblock::RootPtr;
use birch_format::{
    BlockAddr, BlockCount, Generation, Key, MAX_ITEM_BYTES, NODE_BLOCKS, NODE_SIZE,
};

use super::{child_slot, lookup, scan, NodeSource, TreeCtx};
use crate::alloc::{Allocator, Birth, Purpose};
use crate::error::{Error, Result};

/// One node's run of blocks, as the allocator counts it.
const NODE_RUN: BlockCount = BlockCount::new(NODE_BLOCKS);

/// Under this many bytes a leaf (or under a quarter of the pointers an internal node) tries
/// to merge with a sibling.
const LEAF_UNDERFLOW_BYTES: usize = LEAF_SPACE / 4;
const INTERNAL_UNDERFLOW_PTRS: usize = MAX_PTRS / 4;

/// Address of a subtree writer's top node: never allocated (addresses are block-aligned) and
/// never written.
const SUBTREE_TOP: BlockAddr = BlockAddr::new(u64::MAX);

/// What one descent does when it reaches its leaf.
enum LeafOp<'c> {
    /// Insert or overwrite; the old value is returned in `old`.
    Insert {
        key: Key,
        value: Vec<u8>,
        old: Option<Vec<u8>>,
    },
    /// Remove the items in `[lo, hi)` of this leaf.
    Remove { lo: Key, hi: Key, removed: usize },
    /// Remove `[lo, hi)` and insert `key` if the whole range lies in this leaf; otherwise set
    /// `fits = false` and change nothing.
    Replace {
        lo: Key,
        hi: Key,
        key: Key,
        value: Vec<u8>,
        removed: usize,
        fits: bool,
    },
    /// Apply `changes[next..]` while their keys belong to this leaf and it has not overflowed;
    /// `next` advances past what was applied.
    Batch {
        changes: &'c [(Key, Option<&'c [u8]>)],
        next: usize,
    },
}

/// A leaf made before its writer (a piece of a leaf cut for the parallel apply): its low key
/// and its items.
pub(crate) type PremadeLeaf = (Key, Vec<(Key, Vec<u8>)>);

/// A writer over one tree for one generation. Dirty nodes live in memory until
/// [`TreeWriter::write_dirty`]; every node copied away from is freed (pinned) in `generation`.
pub struct TreeWriter<'a> {
    ctx: TreeCtx<'a>,
    alloc: &'a Allocator,
    generation: Generation,
    root: RootPtr,
    dirty: HashMap<BlockAddr, Arc<Node>>,
}

struct WriterSource<'w, 'a> {
    writer: &'w TreeWriter<'a>,
}

impl NodeSource for WriterSource<'_, '_> {
    fn node(&self, addr: BlockAddr, generation: Generation, level: u8) -> Result<Arc<Node>> {
        self.writer.load(addr, generation, level)
    }

    fn prefetch(&self, children: &[(BlockAddr, Generation, u8)]) -> Result<()> {
        // Dirty nodes are in memory already; the others come through the cache.
        let clean: Vec<(BlockAddr, Generation, u8)> = children
            .iter()
            .filter(|(addr, generation, _)| {
                *generation != self.writer.generation || !self.writer.dirty.contains_key(addr)
            })
            .copied()
            .collect();
        self.writer.ctx.prefetch(&clean)
    }
}

impl<'a> TreeWriter<'a> {
    /// A writer starting from `root` (a committed root, or one made with [`TreeWriter::create`]).
    pub fn new(
        ctx: TreeCtx<'a>,
        alloc: &'a Allocator,
        generation: Generation,
        root: RootPtr,
    ) -> TreeWriter<'a> {
        assert!(
            root.generation <= generation.get(),
            "a tree root from the future"
        );
        TreeWriter {
            ctx,
            alloc,
            generation,
            root,
            dirty: HashMap::new(),
        }
    }

    /// A writer with no root yet and nothing dirty; its constructors give it one.
    fn rootless(ctx: TreeCtx<'a>, alloc: &'a Allocator, generation: Generation) -> TreeWriter<'a> {
        TreeWriter {
            ctx,
            alloc,
            generation,
            root: RootPtr::default(),
            dirty: HashMap::new(),
        }
    }

    /// A writer over a new empty tree (mkfs).
    pub fn create(
        ctx: TreeCtx<'a>,
        alloc: &'a Allocator,
        generation: Generation,
    ) -> Result<TreeWriter<'a>> {
        let mut w = TreeWriter::rootless(ctx, alloc, generation);
        let addr = w.new_node(0, NodeBody::Leaf(Vec::new()))?;
        w.root = w.root_at(addr, 0);
        Ok(w)
    }

    /// The current root.
    pub fn root(&self) -> RootPtr {
        self.root
    }

    /// The generation this writer writes.
    pub(crate) fn generation(&self) -> Generation {
        self.generation
    }

    /// A root at the node `addr` of this generation, at `level`.
    fn root_at(&self, addr: BlockAddr, level: u8) -> RootPtr {
        RootPtr {
            addr: addr.get(),
            generation: self.generation.get(),
            level,
        }
    }

    /// A pointer, under `key`, to the node `addr` of this generation.
    fn ptr_to(&self, key: Key, addr: BlockAddr) -> ChildPtr {
        ChildPtr {
            key,
            addr: addr.get(),
            generation: self.generation.get(),
        }
    }

    /// The root node's address.
    fn root_addr(&self) -> BlockAddr {
        BlockAddr::new(self.root.addr)
    }

    /// How this writer reads nodes.
    pub(crate) fn ctx(&self) -> TreeCtx<'a> {
        self.ctx
    }

    /// Number of nodes changed in this generation.
    pub fn dirty_count(&self) -> usize {
        self.dirty.len()
    }

    fn load(&self, addr: BlockAddr, generation: Generation, level: u8) -> Result<Arc<Node>> {
        if generation == self.generation {
            if let Some(node) = self.dirty.get(&addr) {
                return Ok(node.clone());
            }
        }
        self.ctx.read(addr, generation, level)
    }

    fn new_node(&mut self, level: u8, body: NodeBody) -> Result<BlockAddr> {
        let (addr, _) = self.alloc.allocate(NODE_RUN, NODE_RUN, Purpose::Metadata)?;
        let header = NodeHeader {
            fsid: self.ctx.fsid,
            addr: addr.get(),
            generation: self.generation.get(),
            owner: self.ctx.owner,
            level,
        };
        self.dirty.insert(addr, Arc::new(Node { header, body }));
        Ok(addr)
    }

    /// Drops a node made in this generation that nothing references any more. No committed
    /// state has seen it, so its space is free at once.
    fn drop_dirty(&mut self, addr: BlockAddr) {
        if self.dirty.remove(&addr).is_some() {
            self.alloc.free_now(addr, NODE_RUN);
        }
    }

    /// Returns the address of a copy of the node that this generation may change, copying
    /// it on first change and pinning the old copy's space.
    /// `birth` is the generation the node's pointer records.
    fn cow(&mut self, addr: BlockAddr, birth: Birth, level: u8) -> Result<BlockAddr> {
        if birth.generation() == self.generation && self.dirty.contains_key(&addr) {
            return Ok(addr);
        }
        let old = self.ctx.read(addr, birth.generation(), level)?;
        let (new_addr, _) = self.alloc.allocate(NODE_RUN, NODE_RUN, Purpose::Metadata)?;
        let mut node = (*old).clone();
        node.header.addr = new_addr.get();
        node.header.generation = self.generation.get();
        self.dirty.insert(new_addr, Arc::new(node));
        // Through the sharing-aware free: a snapshot may still hold the old copy.
        self.alloc
            .free_recorded(self.generation, birth, addr, NODE_RUN);
        self.ctx.counters.add(|c| &c.btree_cows, 1);
        Ok(new_addr)
    }

    fn node_mut(&mut self, addr: BlockAddr) -> &mut Node {
        let slot = self
            .dirty
            .get_mut(&addr)
            .unwrap_or_else(|| panic!("node {addr:#x} is not dirty in generation"));
        Arc::make_mut(slot)
    }

    fn node_ref(&self, addr: BlockAddr) -> &Node {
        self.dirty
            .get(&addr)
            .unwrap_or_else(|| panic!("node {addr:#x} is not dirty in generation"))
    }

    /// The value at `key`, seeing this generation's changes.
    pub fn get(&self, key: &Key) -> Result<Option<Vec<u8>>> {
        lookup(&WriterSource { writer: self }, &self.root, key)
    }

    /// Up to `limit` items in `[lo, hi)`, seeing this generation's changes.
    pub fn range(&self, lo: &Key, hi: &Key, limit: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        scan(&WriterSource { writer: self }, &self.root, lo, hi, limit)
    }

    /// Inserts or overwrites; returns the old value.
    pub fn insert(&mut self, key: Key, value: Vec<u8>) -> Result<Option<Vec<u8>>> {
        check_item(&key, &value)?;
        let mut op = LeafOp::Insert {
            key,
            value,
            old: None,
        };
        self.descend(key, &mut op)?;
        match op {
            LeafOp::Insert { old, .. } => Ok(old),
            _ => unreachable!("op kind is fixed"),
        }
    }

    /// Deletes `key`; returns the old value.
    pub fn delete(&mut self, key: &Key) -> Result<Option<Vec<u8>>> {
        // A read-only look first: deleting a missing key must not copy a path.
        let Some(old) = self.get(key)? else {
            return Ok(None);
        };
        let hi = key.successor().unwrap_or(Key::MAX);
        let mut op = LeafOp::Remove {
            lo: *key,
            hi,
            removed: 0,
        };
        self.descend(*key, &mut op)?;
        Ok(Some(old))
    }

    /// Deletes every item in `[lo, hi)`, one descent per leaf; returns how many.
    pub fn delete_range(&mut self, lo: &Key, hi: &Key) -> Result<usize> {
        let mut total = 0;
        loop {
            let first = self.range(lo, hi, 1)?;
            let Some((start, _)) = first.first() else {
                return Ok(total);
            };
            let mut op = LeafOp::Remove {
                lo: *start,
                hi: *hi,
                removed: 0,
            };
            self.descend(*start, &mut op)?;
            let LeafOp::Remove { removed, .. } = op else {
                unreachable!("op kind is fixed")
            };
            if removed == 0 {
                return Err(Error::bug(format!(
                    "delete_range {lo}..{hi}: descent to {start} removed nothing"
                )));
            }
            total += removed;
        }
    }

    /// Drops the items in `[lo, hi)` and inserts `key` (which must lie in the range). When the
    /// range sits in one leaf this is one descent (btrfs's extent replace, seed 003); otherwise
    /// it falls back to a range delete and an insert. Returns how many items were dropped.
    pub fn replace_range(&mut self, lo: &Key, hi: &Key, key: Key, value: Vec<u8>) -> Result<usize> {
        if !(*lo <= key && key < *hi) {
            return Err(Error::bug(format!(
                "replace_range: key {key} outside {lo}..{hi}"
            )));
        }
        check_item(&key, &value)?;
        let mut op = LeafOp::Replace {
            lo: *lo,
            hi: *hi,
            key,
            value,
            removed: 0,
            fits: true,
        };
        self.descend(*lo, &mut op)?;
        let LeafOp::Replace {
            removed,
            fits,
            value,
            ..
        } = op
        else {
            unreachable!("op kind is fixed")
        };
        if fits {
            return Ok(removed);
        }
        let removed = self.delete_range(lo, hi)?;
        self.insert(key, value)?;
        Ok(removed)
    }

    /// One root-to-leaf descent by `search`, copying the path, applying `op` at the leaf and
    /// splitting or merging on the way back up.
    fn descend(&mut self, search: Key, op: &mut LeafOp<'_>) -> Result<()> {
        self.ctx.counters.add(|c| &c.btree_descents, 1);
        let root = self.cow(
            self.root_addr(),
            Birth::new(self.root.generation),
            self.root.level,
        )?;
        self.root = self.root_at(root, self.root.level);
        let split = self.descend_node(root, search, Key::MAX, op)?;
        if let Some((sep, right)) = split {
            let left_key = self.node_ref(root).first_key().unwrap_or(Key::MIN);
            let level = self.root.level + 1;
            let ptrs = vec![self.ptr_to(left_key, root), self.ptr_to(sep, right)];
            let new_root = self.new_node(level, NodeBody::Internal(ptrs))?;
            self.root = self.root_at(new_root, level);
        }
        self.collapse_root();
        let root_emptied = self.root.level > 0 && self.node_ref(self.root_addr()).is_empty();
        if root_emptied {
            // Every item is gone (its last leaf was removed, and with it each emptied parent).
            let old = self.root_addr();
            let leaf = self.new_node(0, NodeBody::Leaf(Vec::new()))?;
            self.root = self.root_at(leaf, 0);
            self.drop_dirty(old);
        }
        Ok(())
    }

    /// An internal root with one child gives way to the child.
    fn collapse_root(&mut self) {
        loop {
            let node = self.node_ref(self.root_addr());
            let NodeBody::Internal(ptrs) = &node.body else {
                return;
            };
            if ptrs.len() != 1 {
                return;
            }
            let child = ptrs[0];
            let old = self.root_addr();
            // The child was changed in this descent, so it is dirty and of this generation.
            if child.generation != self.generation.get() {
                return;
            }
            self.root = RootPtr {
                addr: child.addr,
                generation: child.generation,
                level: self.root.level - 1,
            };
            self.drop_dirty(old);
        }
    }

    /// Applies `op` below the dirty node `addr`; returns a split (separator, right node).
    /// `upper` is the smallest key known to belong to a later subtree.
    fn descend_node(
        &mut self,
        addr: BlockAddr,
        search: Key,
        upper: Key,
        op: &mut LeafOp<'_>,
    ) -> Result<Option<(Key, BlockAddr)>> {
        if self.node_ref(addr).header.level == 0 {
            self.apply_leaf(addr, upper, op);
        } else {
            self.descend_child(addr, search, upper, op)?;
        }
        self.split_if_needed(addr)
    }

    /// The part of a descent below the dirty internal node `addr`: copies and descends into
    /// the child for `search`, then records the child's new address, first key and split in
    /// `addr` and merges the child when it became small. Leaves splitting `addr` itself to the
    /// caller (a subtree writer's top never splits).
    fn descend_child(
        &mut self,
        addr: BlockAddr,
        search: Key,
        upper: Key,
        op: &mut LeafOp<'_>,
    ) -> Result<()> {
        let level = self.node_ref(addr).header.level;
        let (slot, child, child_upper) = {
            let NodeBody::Internal(ptrs) = &self.node_ref(addr).body else {
                unreachable!("level > 0 is internal")
            };
            let slot = child_slot(ptrs, &search);
            let child_upper = ptrs.get(slot + 1).map_or(upper, |p| p.key);
            (slot, ptrs[slot], child_upper)
        };
        let new_child = self.cow(
            BlockAddr::new(child.addr),
            Birth::new(child.generation),
            level - 1,
        )?;
        let split = self.descend_node(new_child, search, child_upper, op)?;
        let child_first = self.node_ref(new_child).first_key();
        let new_ptr = self.ptr_to(child_first.unwrap_or(child.key), new_child);
        let right_ptr = split.map(|(sep, right)| self.ptr_to(sep, right));
        {
            let NodeBody::Internal(ptrs) = &mut self.node_mut(addr).body else {
                unreachable!("level > 0 is internal")
            };
            ptrs[slot] = new_ptr;
            if let Some(right) = right_ptr {
                ptrs.insert(slot + 1, right);
            }
        }
        if split.is_none() {
            self.merge_if_underfull(addr, slot, level)?;
        }
        Ok(())
    }

    fn apply_leaf(&mut self, addr: BlockAddr, upper: Key, op: &mut LeafOp<'_>) {
        let NodeBody::Leaf(items) = &mut self.node_mut(addr).body else {
            unreachable!("level 0 is a leaf")
        };
        match op {
            LeafOp::Insert { key, value, old } => match items.binary_search_by(|(k, _)| k.cmp(key))
            {
                Ok(i) => *old = Some(std::mem::replace(&mut items[i].1, std::mem::take(value))),
                Err(i) => items.insert(i, (*key, std::mem::take(value))),
            },
            LeafOp::Remove { lo, hi, removed } => {
                let start = items.partition_point(|(k, _)| k < lo);
                let end = items.partition_point(|(k, _)| k < hi);
                *removed = end.saturating_sub(start);
                items.drain(start..end.max(start));
            }
            LeafOp::Batch { changes, next } => {
                // One merge of the leaf's items with the run of changes that belongs here: an
                // insert into the middle of the item vector would shift the tail once per item.
                let mut used: usize = items.iter().map(|(_, v)| leaf_item_bytes(v.len())).sum();
                let old = std::mem::take(items);
                let mut merged: Vec<(Key, Vec<u8>)> = Vec::with_capacity(old.len() + 16);
                let mut old = old.into_iter().peekable();
                while let Some((key, value)) = changes.get(*next) {
                    if *key >= upper || used > LEAF_SPACE {
                        break;
                    }
                    while let Some(item) = old.next_if(|(k, _)| k < key) {
                        merged.push(item);
                    }
                    let existing = old.next_if(|(k, _)| k == key);
                    match (existing, value) {
                        (Some((_, prev)), Some(v)) => {
                            used = used + v.len() - prev.len();
                            merged.push((*key, v.to_vec()));
                        }
                        (None, Some(v)) => {
                            used += leaf_item_bytes(v.len());
                            merged.push((*key, v.to_vec()));
                        }
                        (Some((_, prev)), None) => used -= leaf_item_bytes(prev.len()),
                        (None, None) => {}
                    }
                    *next += 1;
                }
                merged.extend(old);
                *items = merged;
            }
            LeafOp::Replace {
                lo,
                hi,
                key,
                value,
                removed,
                fits,
            } => {
                if *hi > upper {
                    *fits = false;
                    return;
                }
                let start = items.partition_point(|(k, _)| k < lo);
                let end = items.partition_point(|(k, _)| k < hi);
                *removed = end.saturating_sub(start);
                items.drain(start..end.max(start));
                let at = items.partition_point(|(k, _)| k < key);
                items.insert(at, (*key, std::mem::take(value)));
            }
        }
    }

    /// Splits an overfull dirty node in two; returns (first key of the right half, its address).
    fn split_if_needed(&mut self, addr: BlockAddr) -> Result<Option<(Key, BlockAddr)>> {
        let node = self.node_ref(addr);
        let level = node.header.level;
        let right_body = match &node.body {
            NodeBody::Leaf(items) => {
                if node.used_bytes() <= LEAF_SPACE {
                    return Ok(None);
                }
                let at = leaf_split_point(items);
                let NodeBody::Leaf(items) = &mut self.node_mut(addr).body else {
                    unreachable!("leaf")
                };
                NodeBody::Leaf(items.split_off(at))
            }
            NodeBody::Internal(ptrs) => {
                if ptrs.len() <= MAX_PTRS {
                    return Ok(None);
                }
                let at = ptrs.len() / 2;
                let NodeBody::Internal(ptrs) = &mut self.node_mut(addr).body else {
                    unreachable!("internal")
                };
                NodeBody::Internal(ptrs.split_off(at))
            }
        };
        self.ctx.counters.add(|c| &c.btree_splits, 1);
        let sep = match &right_body {
            NodeBody::Leaf(items) => items.first().map(|(k, _)| *k),
            NodeBody::Internal(ptrs) => ptrs.first().map(|p| p.key),
        }
        .unwrap_or(Key::MAX);
        let right = self.new_node(level, right_body)?;
        Ok(Some((sep, right)))
    }

    /// After a descent through child `slot` of the dirty node `addr`, merges that child with a
    /// neighbour when it has become small, and drops it when it is empty.
    fn merge_if_underfull(&mut self, addr: BlockAddr, slot: usize, level: u8) -> Result<()> {
        let (count, child) = {
            let NodeBody::Internal(ptrs) = &self.node_ref(addr).body else {
                unreachable!("internal")
            };
            (ptrs.len(), ptrs[slot])
        };
        let child_node = self.node_ref(BlockAddr::new(child.addr));
        let underfull = match &child_node.body {
            NodeBody::Leaf(_) => child_node.used_bytes() < LEAF_UNDERFLOW_BYTES,
            NodeBody::Internal(ptrs) => ptrs.len() < INTERNAL_UNDERFLOW_PTRS,
        };
        // An empty child goes even when it is the only one: its parent, now empty too, goes
        // on the way up, and an emptied root becomes an empty leaf (`descend`). Only a subtree
        // writer's top keeps its last child (`finish_subtree` drops it if empty).
        if child_node.is_empty() && (count >= 2 || addr != SUBTREE_TOP) {
            let NodeBody::Internal(ptrs) = &mut self.node_mut(addr).body else {
                unreachable!("internal")
            };
            ptrs.remove(slot);
            self.drop_dirty(BlockAddr::new(child.addr));
            return Ok(());
        }
        if !underfull || count < 2 {
            return Ok(());
        }
        let (left_slot, right_slot) = if slot + 1 < count {
            (slot, slot + 1)
        } else {
            (slot - 1, slot)
        };
        let (left_ptr, right_ptr) = {
            let NodeBody::Internal(ptrs) = &self.node_ref(addr).body else {
                unreachable!("internal")
            };
            (ptrs[left_slot], ptrs[right_slot])
        };
        // Only merge when the two fit one node, so a merge never needs a split.
        let left_peek = self.load(
            BlockAddr::new(left_ptr.addr),
            Generation::new(left_ptr.generation),
            level - 1,
        )?;
        let right_peek = self.load(
            BlockAddr::new(right_ptr.addr),
            Generation::new(right_ptr.generation),
            level - 1,
        )?;
        let fits = match (&left_peek.body, &right_peek.body) {
            (NodeBody::Leaf(_), NodeBody::Leaf(_)) => {
                left_peek.used_bytes() + right_peek.used_bytes() <= LEAF_SPACE
            }
            (NodeBody::Internal(a), NodeBody::Internal(b)) => a.len() + b.len() <= MAX_PTRS,
            _ => false,
        };
        if !fits {
            return Ok(());
        }
        let left = self.cow(
            BlockAddr::new(left_ptr.addr),
            Birth::new(left_ptr.generation),
            level - 1,
        )?;
        let right = self.cow(
            BlockAddr::new(right_ptr.addr),
            Birth::new(right_ptr.generation),
            level - 1,
        )?;
        let right_body =
            std::mem::replace(&mut self.node_mut(right).body, NodeBody::Leaf(Vec::new()));
        match (&mut self.node_mut(left).body, right_body) {
            (NodeBody::Leaf(a), NodeBody::Leaf(b)) => a.extend(b),
            (NodeBody::Internal(a), NodeBody::Internal(b)) => a.extend(b),
            _ => unreachable!("siblings share a level"),
        }
        self.drop_dirty(right);
        let left_ptr = self.ptr_to(left_ptr.key, left);
        let NodeBody::Internal(ptrs) = &mut self.node_mut(addr).body else {
            unreachable!("internal")
        };
        ptrs[left_slot] = left_ptr;
        ptrs.remove(right_slot);
        self.ctx.counters.add(|c| &c.btree_merges, 1);
        Ok(())
    }

    /// A writer over a run of sibling subtrees (`ptrs`, at `level`) instead of a whole tree:
    /// its top is an unwritten internal node that holds the run, may grow past [`MAX_PTRS`]
    /// and never splits, so [`TreeWriter::apply_sorted`] below it changes only nodes inside
    /// the run. With `premade`, the run is instead one new leaf of those items (a piece of a
    /// leaf cut for parallel apply). [`TreeWriter::finish_subtree`] returns the new run.
    pub(crate) fn subtree(
        ctx: TreeCtx<'a>,
        alloc: &'a Allocator,
        generation: Generation,
        level: u8,
        ptrs: Vec<ChildPtr>,
        premade: Option<PremadeLeaf>,
    ) -> Result<TreeWriter<'a>> {
        let mut w = TreeWriter::rootless(ctx, alloc, generation);
        let ptrs = match premade {
            Some((lo, items)) => {
                let key = items.first().map_or(lo, |(k, _)| *k);
                let addr = w.new_node(0, NodeBody::Leaf(items))?;
                vec![w.ptr_to(key, addr)]
            }
            None => ptrs,
        };
        if ptrs.is_empty() {
            return Err(Error::bug("subtree writer over no subtrees"));
        }
        let header = NodeHeader {
            fsid: ctx.fsid,
            addr: SUBTREE_TOP.get(),
            generation: generation.get(),
            owner: ctx.owner,
            level: level + 1,
        };
        w.dirty.insert(
            SUBTREE_TOP,
            Arc::new(Node {
                header,
                body: NodeBody::Internal(ptrs),
            }),
        );
        w.root = w.root_at(SUBTREE_TOP, level + 1);
        Ok(w)
    }

    /// Ends a subtree writer's changes: returns the run of subtrees that replaces the one it
    /// started from, without the nodes that became empty (possibly none at all).
    pub(crate) fn finish_subtree(&mut self) -> Vec<ChildPtr> {
        let Some(top) = self.dirty.remove(&SUBTREE_TOP) else {
            return Vec::new();
        };
        let NodeBody::Internal(ptrs) = &top.body else {
            return Vec::new();
        };
        // Descents remove every node they empty, up to the top's children; the top keeps
        // its last child even when it is empty (`merge_if_underfull`), so only a direct child
        // can be empty here.
        let mut kept = Vec::with_capacity(ptrs.len());
        for ptr in ptrs {
            let addr = BlockAddr::new(ptr.addr);
            let empty = ptr.generation == self.generation.get()
                && self.dirty.get(&addr).is_some_and(|n| n.is_empty());
            if empty {
                self.drop_dirty(addr);
            } else {
                kept.push(*ptr);
            }
        }
        self.root = RootPtr::default();
        kept
    }

    /// A node this writer made in this generation and still holds, if `addr` is one.
    pub(crate) fn dirty_node(&self, addr: BlockAddr) -> Option<Arc<Node>> {
        self.dirty.get(&addr).cloned()
    }

    /// Drops a node this writer made (`dirty_node`); its space is free at once.
    pub(crate) fn discard(&mut self, addr: BlockAddr) {
        self.drop_dirty(addr);
    }

    /// Frees a node made in this generation by another writer (a job of a parallel apply) that
    /// nothing will reference: no committed state has seen it.
    pub(crate) fn free_new(&mut self, addr: BlockAddr) {
        self.alloc.free_now(addr, NODE_RUN);
    }

    /// New internal nodes at `level` over `children` (in key order), as few as hold them and
    /// evenly filled; returns pointers to them. Assembly of a parallel apply uses this to
    /// rebuild the nodes above the subtrees its jobs changed.
    pub(crate) fn build_level(
        &mut self,
        level: u8,
        children: Vec<ChildPtr>,
    ) -> Result<Vec<ChildPtr>> {
        let count = children.len().div_ceil(MAX_PTRS);
        let mut out = Vec::with_capacity(count);
        let mut rest = children.into_iter();
        for i in 0..count {
            let take = (rest.len()) / (count - i);
            let chunk: Vec<ChildPtr> = rest.by_ref().take(take).collect();
            let key = chunk[0].key;
            let addr = self.new_node(level, NodeBody::Internal(chunk))?;
            out.push(self.ptr_to(key, addr));
        }
        Ok(out)
    }

    /// Frees a committed node, born in `birth`, that this generation replaces without copying
    /// it (pinned until the commit is durable).
    pub(crate) fn retire(&mut self, addr: BlockAddr, birth: Birth) {
        debug_assert!(
            birth.generation() < self.generation,
            "retire of a dirty node"
        );
        self.alloc
            .free_recorded(self.generation, birth, addr, NODE_RUN);
    }

    /// Makes `root` the tree's root (assembly of a parallel apply); `None` makes it one new
    /// empty leaf.
    pub(crate) fn set_root(&mut self, root: Option<RootPtr>) -> Result<()> {
        self.root = match root {
            Some(root) => root,
            None => {
                let leaf = self.new_node(0, NodeBody::Leaf(Vec::new()))?;
                self.root_at(leaf, 0)
            }
        };
        Ok(())
    }

    /// Encodes and writes every dirty node (no flush). Returns the written nodes so the
    /// caller can put them in the cache once the commit is durable. May do device I/O: the
    /// writes go to the device in batches ([`crate::device::BlockDevice::write_many`]), so a
    /// device with round trips (RBD) has them in flight together; every write has completed
    /// when this returns.
    pub fn write_dirty(&mut self) -> Result<Vec<Arc<Node>>> {
        /// Adjacent nodes go out in one write of at most this many bytes.
        const WRITE_RUN_BYTES: usize = 1 << 20;
        /// Encoded bytes handed to the device in one batch, at most (about).
        const BATCH_BYTES: usize = 32 << 20;
        let mut written = Vec::with_capacity(self.dirty.len());
        let mut addrs: Vec<BlockAddr> = self.dirty.keys().copied().collect();
        addrs.sort_unstable();
        // Runs of adjacent nodes: (start, bytes).
        let mut runs: Vec<(u64, Vec<u8>)> = Vec::new();
        let mut batch_bytes = 0usize;
        for addr in addrs {
            let node = self.dirty[&addr].clone();
            let bytes = node
                .encode()
                .map_err(|e| Error::corrupt(format!("encode node {addr:#x} for commit"), e))?;
            debug_assert_eq!(bytes.len(), NODE_SIZE);
            let contiguous = runs.last().is_some_and(|(start, run)| {
                start + run.len() as u64 == addr.get() && run.len() + NODE_SIZE <= WRITE_RUN_BYTES
            });
            if !contiguous {
                if batch_bytes >= BATCH_BYTES {
                    self.write_runs(&runs)?;
                    runs.clear();
                    batch_bytes = 0;
                }
                runs.push((addr.get(), Vec::with_capacity(NODE_SIZE)));
            }
            if let Some((_, run)) = runs.last_mut() {
                run.extend_from_slice(&bytes);
            }
            batch_bytes += NODE_SIZE;
            written.push(node);
        }
        self.write_runs(&runs)?;
        self.ctx
            .counters
            .add(|c| &c.nodes_written, written.len() as u64);
        Ok(written)
    }

    /// Writes runs of encoded nodes as one batch (all in flight together where the device
    /// can); returns once every one has completed.
    fn write_runs(&self, runs: &[(u64, Vec<u8>)]) -> Result<()> {
        if runs.is_empty() {
            return Ok(());
        }
        let writes: Vec<(u64, &[u8])> = runs.iter().map(|(at, run)| (*at, &run[..])).collect();
        self.ctx.device.write_many(&writes).map_err(|e| {
            let (first, last) = (runs[0].0, runs[runs.len() - 1].0);
            Error::io(
                format!(
                    "write nodes at {first:#x} ({} runs, the last at {last:#x})",
                    runs.len()
                ),
                e,
            )
        })
    }

    /// Applies a sorted run of changes (`None` deletes), as many as fit in each leaf per
    /// descent: a commit of N changed items costs about N / (items per leaf) descents. Values
    /// are borrowed: each is copied once, into its leaf.
    pub fn apply_sorted(&mut self, changes: &[(Key, Option<&[u8]>)]) -> Result<()> {
        for (key, value) in changes {
            if let Some(v) = value {
                check_item(key, v)?;
            }
        }
        let below_top = self.root_addr() == SUBTREE_TOP;
        let mut done = 0;
        while done < changes.len() {
            let mut op = LeafOp::Batch {
                changes,
                next: done,
            };
            if below_top {
                self.ctx.counters.add(|c| &c.btree_descents, 1);
                self.descend_child(SUBTREE_TOP, changes[done].0, Key::MAX, &mut op)?;
            } else {
                self.descend(changes[done].0, &mut op)?;
            }
            let LeafOp::Batch { next, .. } = op else {
                unreachable!("op kind is fixed")
            };
            if next == done {
                return Err(Error::bug(format!(
                    "apply_sorted: no progress at {}",
                    changes[done].0
                )));
            }
            done = next;
        }
        Ok(())
    }
}

fn check_item(key: &Key, value: &[u8]) -> Result<()> {
    if value.len() > MAX_ITEM_BYTES {
        return Err(Error::Invalid(format!(
            "item {key}: {} bytes exceeds the {MAX_ITEM_BYTES}-byte item limit",
            value.len()
        )));
    }
    Ok(())
}

/// The split point of an overfull leaf: both halves fit, as even as possible. One always
/// exists because an item is at most half a leaf.
fn leaf_split_point(items: &[(Key, Vec<u8>)]) -> usize {
    let sizes: Vec<usize> = items
        .iter()
        .map(|(_, v)| leaf_item_bytes(v.len()))
        .collect();
    let total: usize = sizes.iter().sum();
    let mut best = (usize::MAX, items.len() / 2);
    let mut left = 0;
    for (i, size) in sizes.iter().enumerate().take(items.len().saturating_sub(1)) {
        left += size;
        let right = total - left;
        if left <= LEAF_SPACE && right <= LEAF_SPACE {
            let skew = left.abs_diff(right);
            if skew < best.0 {
                best = (skew, i + 1);
            }
        }
    }
    best.1
}
