//! The copy-on-write B-tree.
//!
//! Owns: search, range scans and cursors ([`TreeReader`]), and insert, delete, range delete,
//! split/merge, copy-on-write of the path and replace-range in one descent ([`TreeWriter`]).
//!
//! Must not touch: the meaning of item payloads (it sees keys and byte strings only), the
//! device beyond reading nodes through the cache, and the choice of free space (it asks the
//! allocator it is handed). Committed nodes are immutable: a writer copies a node the first
//! time it changes it in a generation and changes the copy in place after that.

pub mod parallel;
mod writer;

use std::sync::Arc;

use birch_format::node::{ChildPtr, Expect, Node, NodeBody};
use birch_format::superblock::RootPtr;
use birch_format::Key;

use crate::cache::NodeCache;
use crate::counters::Counters;
use crate::device::BlockDevice;
use crate::error::Result;

pub use writer::TreeWriter;

/// What a tree needs to read its nodes.
#[derive(Clone, Copy)]
pub struct TreeCtx<'a> {
    /// The device nodes are read from on a cache miss.
    pub device: &'a dyn BlockDevice,
    /// Cache of verified nodes, consulted before the device.
    pub cache: &'a NodeCache,
    /// Where node reads and cache hits are counted.
    pub counters: &'a Counters,
    /// Filesystem id every node header must carry; a mismatch is `Corrupt`.
    pub fsid: [u8; 16],
    /// Tree id every node header must carry (e.g. `FS_TREE_ID`).
    pub owner: u64,
}

impl<'a> TreeCtx<'a> {
    /// Reads the node a pointer leads to, verified. May do device I/O.
    pub fn read(&self, addr: u64, generation: u64, level: u8) -> Result<Arc<Node>> {
        let expect = Expect {
            fsid: self.fsid,
            addr,
            generation,
            owner: self.owner,
            level: Some(level),
        };
        self.cache.read(self.device, self.counters, &expect)
    }

    /// Reads a root node.
    pub fn read_root(&self, root: &RootPtr) -> Result<Arc<Node>> {
        self.read(root.addr, root.generation, root.level)
    }
}

/// Index of the child whose subtree may hold `key`: the last pointer whose key is <= `key`,
/// or the first pointer when `key` is below them all.
pub(crate) fn child_slot(ptrs: &[ChildPtr], key: &Key) -> usize {
    ptrs.partition_point(|p| p.key <= *key).saturating_sub(1)
}

/// Something that yields nodes: the committed tree, or a writer's mix of dirty and clean nodes.
pub(crate) trait NodeSource {
    fn node(&self, addr: u64, generation: u64, level: u8) -> Result<Arc<Node>>;
}

impl NodeSource for TreeCtx<'_> {
    fn node(&self, addr: u64, generation: u64, level: u8) -> Result<Arc<Node>> {
        self.read(addr, generation, level)
    }
}

/// Point lookup from `root`.
pub(crate) fn lookup(
    source: &dyn NodeSource,
    root: &RootPtr,
    key: &Key,
) -> Result<Option<Vec<u8>>> {
    let mut node = source.node(root.addr, root.generation, root.level)?;
    loop {
        let next = match &node.body {
            NodeBody::Leaf(items) => {
                return Ok(items
                    .binary_search_by(|(k, _)| k.cmp(key))
                    .ok()
                    .map(|i| items[i].1.clone()));
            }
            NodeBody::Internal(ptrs) => {
                let p = ptrs[child_slot(ptrs, key)];
                source.node(p.addr, p.generation, node.header.level - 1)?
            }
        };
        node = next;
    }
}

/// Collects up to `limit` items with `lo <= key < hi`, in key order.
pub(crate) fn scan(
    source: &dyn NodeSource,
    root: &RootPtr,
    lo: &Key,
    hi: &Key,
    limit: usize,
) -> Result<Vec<(Key, Vec<u8>)>> {
    let mut out = Vec::new();
    if lo < hi && limit > 0 {
        let node = source.node(root.addr, root.generation, root.level)?;
        scan_node(source, &node, lo, hi, limit, &mut out)?;
    }
    Ok(out)
}

fn last_in_node(
    source: &dyn NodeSource,
    node: &Node,
    floor: &Key,
    key: &Key,
) -> Result<Option<(Key, Vec<u8>)>> {
    match &node.body {
        NodeBody::Leaf(items) => {
            let end = items.partition_point(|(k, _)| k <= key);
            Ok(end
                .checked_sub(1)
                .map(|i| &items[i])
                .filter(|(k, _)| k >= floor)
                .map(|(k, v)| (*k, v.clone())))
        }
        NodeBody::Internal(ptrs) => {
            // The child that would hold `key` (as `child_slot` routes: the first child also
            // takes keys below its separator), then, when that child has nothing in range, the
            // ones before it, until a separator shows everything earlier is below `floor`.
            if ptrs.is_empty() {
                return Ok(None);
            }
            let end = ptrs.partition_point(|p| p.key <= *key).clamp(1, ptrs.len());
            for p in ptrs[..end].iter().rev() {
                let child = source.node(p.addr, p.generation, node.header.level - 1)?;
                if let Some(found) = last_in_node(source, &child, floor, key)? {
                    return Ok(Some(found));
                }
                if p.key <= *floor {
                    break;
                }
            }
            Ok(None)
        }
    }
}

fn scan_node(
    source: &dyn NodeSource,
    node: &Node,
    lo: &Key,
    hi: &Key,
    limit: usize,
    out: &mut Vec<(Key, Vec<u8>)>,
) -> Result<()> {
    match &node.body {
        NodeBody::Leaf(items) => {
            let start = items.partition_point(|(k, _)| k < lo);
            for (k, v) in &items[start..] {
                if k >= hi || out.len() >= limit {
                    break;
                }
                out.push((*k, v.clone()));
            }
        }
        NodeBody::Internal(ptrs) => {
            let first = child_slot(ptrs, lo);
            for p in &ptrs[first..] {
                if p.key >= *hi || out.len() >= limit {
                    break;
                }
                let child = source.node(p.addr, p.generation, node.header.level - 1)?;
                scan_node(source, &child, lo, hi, limit, out)?;
            }
        }
    }
    Ok(())
}

/// Read access to one committed tree.
pub struct TreeReader<'a> {
    /// How to read and verify nodes.
    pub ctx: TreeCtx<'a>,
    /// Root of the committed tree to read: address, generation and level. The engine's
    /// committed root it names must stay held while the reader is in use.
    pub root: RootPtr,
}

impl TreeReader<'_> {
    /// The value at `key`. May do device I/O.
    pub fn get(&self, key: &Key) -> Result<Option<Vec<u8>>> {
        lookup(&self.ctx, &self.root, key)
    }

    /// Up to `limit` items in `[lo, hi)`. May do device I/O.
    pub fn range(&self, lo: &Key, hi: &Key, limit: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        scan(&self.ctx, &self.root, lo, hi, limit)
    }

    /// The item with the greatest key in `[floor, key]`, if any: one descent (two when the
    /// answer is the last item of the leaf before). May do device I/O.
    pub fn last_in(&self, floor: &Key, key: &Key) -> Result<Option<(Key, Vec<u8>)>> {
        if floor > key {
            return Ok(None);
        }
        let node = self
            .ctx
            .node(self.root.addr, self.root.generation, self.root.level)?;
        last_in_node(&self.ctx, &node, floor, key)
    }

    /// A cursor over `[lo, hi)`.
    pub fn cursor(&self, lo: Key, hi: Key) -> Cursor<'_> {
        Cursor {
            reader: self,
            next: Some(lo),
            hi,
            batch: Vec::new(),
        }
    }
}

/// Iterates a key range in batches of a leaf or so, re-descending from the root per batch.
pub struct Cursor<'a> {
    reader: &'a TreeReader<'a>,
    next: Option<Key>,
    hi: Key,
    batch: Vec<(Key, Vec<u8>)>,
}

/// Items a cursor fetches per descent.
const CURSOR_BATCH: usize = 256;

impl Iterator for Cursor<'_> {
    type Item = Result<(Key, Vec<u8>)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.batch.is_empty() {
            let lo = self.next?;
            match self.reader.range(&lo, &self.hi, CURSOR_BATCH) {
                Ok(mut items) => {
                    self.next = items
                        .last()
                        .and_then(|(k, _)| k.successor())
                        .filter(|_| items.len() == CURSOR_BATCH);
                    items.reverse();
                    self.batch = items;
                }
                Err(e) => {
                    self.next = None;
                    return Some(Err(e));
                }
            }
        }
        self.batch.pop().map(Ok)
    }
}
