//! The copy-on-write B-tree.
//!
//! Owns: search, range scans and cursors ([`TreeReader`]), and insert, delete, range delete,
//! split/merge, copy-on-write of the path and replace-range in one descent ([`TreeWriter`]).
//!
//! Must not touch: the meaning of item payloads (it sees keys and byte strings only; the
//! whole-tree walks of [`walk`] decode extent items for their visitors), the
//! device beyond reading nodes through the cache, and the choice of free space (it asks the
//! allocator it is handed). Committed nodes are immutable: a writer copies a node the first
//! time it changes it in a generation and changes the copy in place after that.

pub mod parallel;
pub mod walk;
mod writer;

use std::sync::Arc;

use birch_format::node::{ChildPtr, Expect, Node, NodeBody, ITEM_HEADER_BYTES, LEAF_SPACE};
use birch_format::superblock::RootPtr;
use birch_format::{BlockAddr, Generation, Key};

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
    /// Reads the node a pointer leads to (its address, the generation the pointer records,
    /// its level), verified. May do device I/O.
    pub fn read(&self, addr: BlockAddr, generation: Generation, level: u8) -> Result<Arc<Node>> {
        let expect = Expect {
            fsid: self.fsid,
            addr: addr.get(),
            generation: generation.get(),
            owner: self.owner,
            level: Some(level),
        };
        self.cache.read(self.device, self.counters, &expect)
    }

    /// Reads a root node.
    pub fn read_root(&self, root: &RootPtr) -> Result<Arc<Node>> {
        self.read(
            BlockAddr::new(root.addr),
            Generation::new(root.generation),
            root.level,
        )
    }

    /// Reads the child `ptr` leads to, at `level`.
    pub fn read_child(&self, ptr: &ChildPtr, level: u8) -> Result<Arc<Node>> {
        self.read(
            BlockAddr::new(ptr.addr),
            Generation::new(ptr.generation),
            level,
        )
    }

    /// Reads the nodes of `children` (address, generation, level) the cache does not hold in
    /// one batch and caches those that verify ([`NodeCache::prefetch`]). May do device I/O.
    pub fn prefetch(&self, children: &[(BlockAddr, Generation, u8)]) -> Result<()> {
        let expects: Vec<Expect> = children
            .iter()
            .map(|&(addr, generation, level)| Expect {
                fsid: self.fsid,
                addr: addr.get(),
                generation: generation.get(),
                owner: self.owner,
                level: Some(level),
            })
            .collect();
        self.cache.prefetch(self.device, self.counters, &expects)
    }
}

/// Index of the child whose subtree may hold `key`: the last pointer whose key is <= `key`,
/// or the first pointer when `key` is below them all.
pub(crate) fn child_slot(ptrs: &[ChildPtr], key: &Key) -> usize {
    ptrs.partition_point(|p| p.key <= *key).saturating_sub(1)
}

/// Something that yields nodes: the committed tree, or a writer's mix of dirty and clean nodes.
pub(crate) trait NodeSource {
    /// The node a pointer leads to (address, generation, level), verified.
    fn node(&self, addr: BlockAddr, generation: Generation, level: u8) -> Result<Arc<Node>>;

    /// The root node `root` names.
    fn root_node(&self, root: &RootPtr) -> Result<Arc<Node>> {
        self.node(
            BlockAddr::new(root.addr),
            Generation::new(root.generation),
            root.level,
        )
    }

    /// The child `ptr` leads to, at `level`.
    fn child(&self, ptr: &ChildPtr, level: u8) -> Result<Arc<Node>> {
        self.node(
            BlockAddr::new(ptr.addr),
            Generation::new(ptr.generation),
            level,
        )
    }

    /// A hint that `node` will soon be asked for each of `children` (address, generation,
    /// level), in order: a source with a cache may read the ones it lacks together. Changes
    /// no answer of `node`; an error is a device error reading them. The default does
    /// nothing.
    fn prefetch(&self, children: &[(BlockAddr, Generation, u8)]) -> Result<()> {
        let _ = children;
        Ok(())
    }
}

impl NodeSource for TreeCtx<'_> {
    fn node(&self, addr: BlockAddr, generation: Generation, level: u8) -> Result<Arc<Node>> {
        self.read(addr, generation, level)
    }

    fn prefetch(&self, children: &[(BlockAddr, Generation, u8)]) -> Result<()> {
        TreeCtx::prefetch(self, children)
    }
}

/// Children a scan asks its source to prefetch at most at once ([`NodeCache::prefetch`]'s
/// bound: 64 nodes, 1 MiB per `read_many`).
const PREFETCH_WINDOW: usize = crate::cache::PREFETCH_MAX;

/// A scan still wanting at least this many items prefetches full windows from its first
/// child on; one wanting fewer starts with a window of one child and doubles it each time.
const PREFETCH_UNBOUNDED: usize = 1 << 16;

/// Most items a leaf can hold (every item with an empty payload).
const MAX_LEAF_ITEMS: usize = LEAF_SPACE / ITEM_HEADER_BYTES;

/// The first prefetch window, in children of level `child_level`, of a scan that still wants
/// `remaining` items.
///
/// A scan with a limit (a readdir page, a cursor batch) may stop after its first child or
/// two, and how many items a child holds is not known before reading it. So a bounded scan
/// prefetches only children it is sure to need if the range holds that many items: leaves,
/// `remaining / MAX_LEAF_ITEMS` rounded up (no leaf holds more), at least one; internal
/// children, one. Each later window doubles, up to [`PREFETCH_WINDOW`]: past what the limit
/// consumes, at most about as many children are read as were consumed, and a long scan
/// reaches full batches after a few round trips. A scan wanting everything (`usize::MAX`:
/// a file's extents, a directory's whole listing in the engine) or at least
/// [`PREFETCH_UNBOUNDED`] items starts with full windows.
fn first_window(remaining: usize, child_level: u8) -> usize {
    if remaining >= PREFETCH_UNBOUNDED {
        PREFETCH_WINDOW
    } else if child_level == 0 {
        remaining.div_ceil(MAX_LEAF_ITEMS).clamp(1, PREFETCH_WINDOW)
    } else {
        1
    }
}

/// Point lookup from `root`.
pub(crate) fn lookup(
    source: &dyn NodeSource,
    root: &RootPtr,
    key: &Key,
) -> Result<Option<Vec<u8>>> {
    let mut node = source.root_node(root)?;
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
                source.child(&p, node.header.level - 1)?
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
        let node = source.root_node(root)?;
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
                let child = source.child(p, node.header.level - 1)?;
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
            // The children in range: from `first` up to the first whose key is >= `hi`.
            let end = first + ptrs[first..].partition_point(|p| p.key < *hi);
            let level = node.header.level - 1;
            let mut window = first_window(limit.saturating_sub(out.len()), level);
            // Index of the first child not yet covered by a prefetch.
            let mut fetched = first;
            for (i, p) in ptrs.iter().enumerate().take(end).skip(first) {
                if out.len() >= limit {
                    break;
                }
                if i == fetched {
                    let upto = end.min(i + window);
                    if upto - i > 1 {
                        let children: Vec<(BlockAddr, Generation, u8)> = ptrs[i..upto]
                            .iter()
                            .map(|c| (BlockAddr::new(c.addr), Generation::new(c.generation), level))
                            .collect();
                        // Best effort: a failed batch (a device error on a child this scan
                        // may never reach, past its limit) is left to the read of each child
                        // that needs it, which fails as a scan without prefetch would.
                        if let Err(e) = source.prefetch(&children) {
                            log::debug!("prefetch of {} nodes: {e}", children.len());
                        }
                    }
                    fetched = upto;
                    window = (window * 2).min(PREFETCH_WINDOW);
                }
                let child = source.child(p, level)?;
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
        let node = self.ctx.root_node(&self.root)?;
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

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::collections::HashMap;

    use birch_format::node::NodeHeader;

    use super::*;

    /// What a scan asked its source for, in order.
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Call {
        Node(u64),
        Prefetch(Vec<u64>),
    }

    /// Nodes in memory; records every call.
    struct Recorder {
        nodes: HashMap<u64, Arc<Node>>,
        calls: RefCell<Vec<Call>>,
    }

    impl NodeSource for Recorder {
        fn node(&self, addr: BlockAddr, generation: Generation, level: u8) -> Result<Arc<Node>> {
            let (addr, generation) = (addr.get(), generation.get());
            self.calls.borrow_mut().push(Call::Node(addr));
            let node = self.nodes[&addr].clone();
            assert_eq!(
                (node.header.generation, node.header.level),
                (generation, level)
            );
            Ok(node)
        }

        fn prefetch(&self, children: &[(BlockAddr, Generation, u8)]) -> Result<()> {
            for &(addr, generation, level) in children {
                let (addr, generation) = (addr.get(), generation.get());
                let node = &self.nodes[&addr];
                assert_eq!(
                    (node.header.generation, node.header.level),
                    (generation, level)
                );
            }
            self.calls
                .borrow_mut()
                .push(Call::Prefetch(children.iter().map(|c| c.0.get()).collect()));
            Ok(())
        }
    }

    fn key(n: u64) -> Key {
        Key {
            objectid: 1000 + n,
            item_type: 1,
            offset: 0,
        }
    }

    fn header(addr: u64, level: u8) -> NodeHeader {
        NodeHeader {
            fsid: [1; 16],
            addr,
            generation: 3,
            owner: 5,
            level,
        }
    }

    /// A root over `leaves` leaves of `per_leaf` items each: item `n` is key `n`, value `n`.
    fn two_levels(leaves: u64, per_leaf: u64) -> (Recorder, RootPtr) {
        let mut nodes = HashMap::new();
        let mut ptrs = Vec::new();
        for l in 0..leaves {
            let addr = (l + 1) << 16;
            let items = (l * per_leaf..(l + 1) * per_leaf)
                .map(|n| (key(n), n.to_le_bytes().to_vec()))
                .collect();
            nodes.insert(
                addr,
                Arc::new(Node {
                    header: header(addr, 0),
                    body: NodeBody::Leaf(items),
                }),
            );
            ptrs.push(ChildPtr {
                key: if l == 0 { Key::MIN } else { key(l * per_leaf) },
                addr,
                generation: 3,
            });
        }
        let root = 1 << 40;
        nodes.insert(
            root,
            Arc::new(Node {
                header: header(root, 1),
                body: NodeBody::Internal(ptrs),
            }),
        );
        let source = Recorder {
            nodes,
            calls: RefCell::new(Vec::new()),
        };
        let ptr = RootPtr {
            addr: root,
            generation: 3,
            level: 1,
        };
        (source, ptr)
    }

    fn leaf_addr(l: u64) -> u64 {
        (l + 1) << 16
    }

    /// Children a scan prefetched, in order.
    fn prefetched(calls: &[Call]) -> Vec<u64> {
        calls
            .iter()
            .filter_map(|c| match c {
                Call::Prefetch(addrs) => Some(addrs.clone()),
                Call::Node(_) => None,
            })
            .flatten()
            .collect()
    }

    fn nodes_asked(calls: &[Call]) -> Vec<u64> {
        calls
            .iter()
            .filter_map(|c| match c {
                Call::Node(a) => Some(*a),
                Call::Prefetch(_) => None,
            })
            .collect()
    }

    /// A scan of everything prefetches the children in full windows, each before it is
    /// asked for, and returns every item in order.
    #[test]
    fn a_whole_scan_prefetches_full_windows_ahead_of_each_child() {
        let (source, root) = two_levels(150, 3);
        let items = scan(&source, &root, &Key::MIN, &Key::MAX, usize::MAX).expect("scan");
        let want: Vec<u64> = (0..450).collect();
        let got: Vec<u64> = items.iter().map(|(k, _)| k.objectid - 1000).collect();
        assert_eq!(got, want);
        let calls = source.calls.borrow();
        let windows: Vec<usize> = calls
            .iter()
            .filter_map(|c| match c {
                Call::Prefetch(a) => Some(a.len()),
                Call::Node(_) => None,
            })
            .collect();
        assert_eq!(windows, [64, 64, 22]);
        let leaves: Vec<u64> = (0..150).map(leaf_addr).collect();
        assert_eq!(prefetched(&calls), leaves);
        assert_eq!(nodes_asked(&calls)[1..], leaves[..]);
        // Each window comes before the first child it covers is asked for.
        for (i, c) in calls.iter().enumerate() {
            if let Call::Prefetch(addrs) = c {
                assert_eq!(calls[i + 1], Call::Node(addrs[0]), "{calls:?}");
            }
        }
    }

    /// Only the children in the scan's range are prefetched: from the one holding `lo` to
    /// the last whose key is below `hi`.
    #[test]
    fn only_children_in_range_are_prefetched() {
        let (source, root) = two_levels(100, 4);
        // Items 41 ..= 200: leaves 10 ..= 50 (leaf 50 starts with item 200).
        let items = scan(&source, &root, &key(41), &key(201), usize::MAX).expect("scan");
        assert_eq!(items.len(), 160);
        assert_eq!(items[0].0, key(41));
        assert_eq!(items[159].0, key(200));
        let calls = source.calls.borrow();
        let want: Vec<u64> = (10..=50).map(leaf_addr).collect();
        assert_eq!(prefetched(&calls), want);
        assert_eq!(nodes_asked(&calls)[1..], want[..]);
        drop(calls);
        // A range inside one leaf prefetches nothing.
        source.calls.borrow_mut().clear();
        let items = scan(&source, &root, &key(41), &key(43), usize::MAX).expect("scan");
        assert_eq!(items.len(), 2);
        assert!(prefetched(&source.calls.borrow()).is_empty());
    }

    /// A scan with a small limit reads its first child alone, then windows of 2, 4, ...: it
    /// never prefetches more children past what the limit consumed than it consumed, and an
    /// exhausted limit stops the prefetching.
    #[test]
    fn a_limited_scan_prefetches_little_past_its_limit() {
        let (source, root) = two_levels(200, 10);
        for limit in [1usize, 5, 10, 11, 35, 70, 256, 700, 1999] {
            source.calls.borrow_mut().clear();
            let items = scan(&source, &root, &Key::MIN, &Key::MAX, limit).expect("scan");
            assert_eq!(items.len(), limit.min(2000));
            let calls = source.calls.borrow();
            let used = nodes_asked(&calls).len() - 1;
            assert_eq!(used, limit.div_ceil(10), "limit {limit}");
            let fetched = prefetched(&calls);
            let mut reached: Vec<u64> = nodes_asked(&calls)[1..].to_vec();
            // Every child is asked for at most once and read at most once.
            reached.extend(fetched.iter().copied());
            reached.sort_unstable();
            reached.dedup();
            let extra = reached.len() - used;
            assert!(
                extra <= used,
                "limit {limit}: {used} children used, {extra} more read: {calls:?}"
            );
            if limit <= 10 {
                assert!(fetched.is_empty(), "limit {limit}: {calls:?}");
            }
        }
    }

    #[test]
    fn the_first_window_follows_the_limit() {
        assert_eq!(first_window(usize::MAX, 0), PREFETCH_WINDOW);
        assert_eq!(first_window(usize::MAX, 3), PREFETCH_WINDOW);
        assert_eq!(first_window(PREFETCH_UNBOUNDED, 1), PREFETCH_WINDOW);
        assert_eq!(first_window(1, 0), 1);
        assert_eq!(first_window(MAX_LEAF_ITEMS, 0), 1);
        assert_eq!(first_window(MAX_LEAF_ITEMS + 1, 0), 2);
        assert_eq!(first_window(4096, 1), 1);
        assert_eq!(first_window(PREFETCH_UNBOUNDED - 1, 0), PREFETCH_WINDOW);
    }
}
