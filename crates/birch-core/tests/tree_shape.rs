//! Tree shapes that deletes leave behind, on an engine image checked by fsck: no empty node
//! below the root and every pointer key equal to its child's first key.
//!
//! Both cases come from a review of the parallel apply, and both build the exact shape
//! through commits: a level-1 node left with one leaf beside a full neighbour (`MAX_PTRS`
//! children), so it cannot merge. (1) Serial: deleting that leaf's items kept the emptied leaf
//! (the writer removed an empty child only when it had a sibling). (2) Parallel: the same in a
//! job, together with many other changes, left a pointer key that did not match its child.
//! Both fail when the writer keeps an only child that emptied (checked by hand).

#![allow(clippy::expect_used)]

use std::sync::Arc;

use birch_core::btree::TreeCtx;
use birch_core::cache::NodeCache;
use birch_core::check::{check, CheckOptions, FindingKind};
use birch_core::counters::Counters;
use birch_core::device::{BlockDevice, MemDevice};
use birch_core::{Engine, MkfsOptions};
use birch_format::node::{ChildPtr, Node, NodeBody, MAX_PTRS};
use birch_format::{BlockAddr, Generation, Key, FS_TREE_ID};

fn k(n: u64, offset: u64) -> Key {
    Key {
        objectid: 1000 + n,
        item_type: 1,
        offset,
    }
}

/// Reads the committed tree of an engine (its own cache, so every read is from the device).
struct Probe<'e> {
    engine: &'e Engine,
    cache: NodeCache,
    counters: Counters,
}

impl<'e> Probe<'e> {
    fn new(engine: &'e Engine) -> Probe<'e> {
        Probe {
            engine,
            cache: NodeCache::new(16),
            counters: Counters::default(),
        }
    }

    fn node(&self, addr: u64, generation: u64, level: u8) -> Arc<Node> {
        TreeCtx {
            device: &**self.engine.device(),
            cache: &self.cache,
            counters: &self.counters,
            fsid: self.engine.fsid(),
            owner: FS_TREE_ID,
        }
        .read(BlockAddr::new(addr), Generation::new(generation), level)
        .expect("node reads")
    }

    /// The root's level and pointers.
    fn root(&self) -> (u8, Vec<ChildPtr>) {
        let root = self.engine.superblock().fs_root;
        match &self.node(root.addr, root.generation, root.level).body {
            NodeBody::Internal(ptrs) => (root.level, ptrs.clone()),
            NodeBody::Leaf(_) => (0, Vec::new()),
        }
    }

    fn children(&self, ptr: ChildPtr, level: u8) -> Vec<ChildPtr> {
        match &self.node(ptr.addr, ptr.generation, level).body {
            NodeBody::Internal(ptrs) => ptrs.clone(),
            NodeBody::Leaf(_) => Vec::new(),
        }
    }

    fn leaf_keys(&self, ptr: ChildPtr) -> Vec<Key> {
        match &self.node(ptr.addr, ptr.generation, 0).body {
            NodeBody::Leaf(items) => items.iter().map(|(k, _)| *k).collect(),
            NodeBody::Internal(_) => Vec::new(),
        }
    }
}

/// An engine holding `items` keys `k(0..items, 0)`, committed `chunk` at a time, serially.
fn filled(dev: &Arc<MemDevice>, items: u64, chunk: u64) -> Arc<Engine> {
    let dyn_dev: Arc<dyn BlockDevice> = dev.clone();
    let engine = Engine::create(dyn_dev, &MkfsOptions::default(), Vec::new()).expect("create");
    engine.set_parallel_apply_min(usize::MAX);
    for start in (0..items).step_by(chunk as usize) {
        let txn = engine.begin().expect("begin");
        for n in start..(start + chunk).min(items) {
            txn.put(k(n, 0), vec![7u8; 100]);
        }
        drop(txn);
        engine.commit().expect("commit");
    }
    assert_eq!(Probe::new(&engine).root().0, 2, "three levels");
    engine
}

/// Grows the level-1 node at root slot `slot` to exactly `MAX_PTRS` leaves, by filling its
/// leaves until they split.
fn fill_to_max_ptrs(engine: &Engine, slot: usize) {
    let mut offset = 1u64;
    loop {
        let probe = Probe::new(engine);
        let leaves = probe.children(probe.root().1[slot], 1);
        if leaves.len() == MAX_PTRS {
            return;
        }
        assert!(leaves.len() < MAX_PTRS, "overshot");
        let want = (MAX_PTRS - leaves.len()).min(leaves.len());
        let txn = engine.begin().expect("begin");
        for leaf in leaves.iter().take(want) {
            let keys = probe.leaf_keys(*leaf);
            let first = keys[0];
            for i in 0..(140 - keys.len() as u64) {
                let key = Key {
                    offset: first.offset + offset + i,
                    ..first
                };
                txn.put(key, vec![1u8; 100]);
            }
        }
        offset += 1000;
        drop(txn);
        engine.commit().expect("commit");
    }
}

/// fsck finds nothing wrong with the tree's structure. (The items are raw engine bytes, not
/// filesystem items, so item-level findings are expected and ignored.)
fn assert_tree_clean(dev: &MemDevice, what: &str) {
    let report = check(dev, CheckOptions::default()).expect("fsck runs");
    let structural: Vec<_> = report
        .findings
        .iter()
        .filter(|f| {
            matches!(
                f.kind,
                FindingKind::PointerKeyMismatch
                    | FindingKind::NodeKeyOutOfRange
                    | FindingKind::NodeUnreadable
            )
        })
        .collect();
    assert!(structural.is_empty(), "{what}: {structural:#?}");
}

#[test]
fn serial_commit_removes_an_only_child_left_empty() {
    let dev = Arc::new(MemDevice::new(512 << 20));
    let engine = filled(&dev, 80_000, 10_000);
    fill_to_max_ptrs(&engine, 1);
    // Delete everything under slot 0: its right neighbour is full, so it cannot merge.
    let probe = Probe::new(&engine);
    let top = probe.root().1;
    let txn = engine.begin().expect("begin");
    for leaf in probe.children(top[0], 1) {
        for key in probe
            .leaf_keys(leaf)
            .into_iter()
            .filter(|k| *k < top[1].key)
        {
            txn.delete(key);
        }
    }
    drop(txn);
    engine.commit().expect("commit");
    assert_tree_clean(&dev, "after the serial delete");
}

#[test]
fn parallel_commit_keeps_pointer_keys_exact() {
    let dev = Arc::new(MemDevice::new(1 << 30));
    let total = 300_000u64;
    let engine = filled(&dev, total, 20_000);
    let probe = Probe::new(&engine);
    let m_slot = probe.root().1.len() - 1;
    let n1_slot = m_slot - 1;
    fill_to_max_ptrs(&engine, m_slot);
    // Serial: N1 keeps only its last leaf.
    let probe = Probe::new(&engine);
    let n1_leaves = probe.children(probe.root().1[n1_slot], 1);
    let txn = engine.begin().expect("begin");
    for leaf in &n1_leaves[..n1_leaves.len() - 1] {
        for key in probe.leaf_keys(*leaf) {
            txn.delete(key);
        }
    }
    drop(txn);
    engine.commit().expect("commit");
    let probe = Probe::new(&engine);
    let top = probe.root().1;
    assert_eq!(probe.children(top[n1_slot], 1).len(), 1, "N1 has one leaf");
    assert_eq!(probe.children(top[m_slot], 1).len(), MAX_PTRS, "M is full");
    // Parallel: empty N1's leaf, delete most of M, and change many keys elsewhere so that N1
    // and M stay in one job.
    engine.set_parallel_apply_min(1);
    let txn = engine.begin().expect("begin");
    for key in probe.leaf_keys(probe.children(top[n1_slot], 1)[0]) {
        txn.delete(key);
    }
    let m_leaves = probe.children(top[m_slot], 1);
    for leaf in &m_leaves[..m_leaves.len() - 100] {
        for key in probe.leaf_keys(*leaf) {
            txn.delete(key);
        }
    }
    let (lo, hi) = (top[n1_slot - 1].key, top[n1_slot].key);
    let (mut others, mut heavy) = (0, 0);
    for n in 0..total {
        let key = k(n, 0);
        if key < lo && others < 172_000 {
            txn.put(key, vec![9u8; 100]);
            others += 1;
        }
        if key >= lo && key < hi {
            for offset in 1..=3u64 {
                if heavy < 40_000 {
                    txn.put(k(n, offset), vec![3u8; 100]);
                    heavy += 1;
                }
            }
        }
    }
    drop(txn);
    let jobs_before = engine.counters().values().commit_jobs;
    engine.commit().expect("commit");
    assert!(
        engine.counters().values().commit_jobs > jobs_before,
        "the commit took the parallel path"
    );
    assert_tree_clean(&dev, "after the parallel commit");
}
