//! Tree shapes that deletes leave behind, on an engine image checked by fsck: no empty node
//! below the root and every pointer key equal to its child's first key.
//!
//! Both cases come from a review of the parallel apply. (1) The serial commit kept an emptied
//! leaf when it was its parent's only child and the parent could not merge (its neighbour was
//! full). (2) A parallel job pruned such a leaf after its parent had merged into a sibling,
//! which changed the merged node's first key without updating the pointer to it. Each builds
//! the exact shape (a full neighbour of `MAX_PTRS` children) through commits, deletes, commits
//! and runs fsck. Both fail on the code before the fixes (checked by hand): (1) when the
//! writer keeps an only child that emptied, (2) when, in addition, a subtree writer's pointer
//! keys are not refreshed after pruning.

#![allow(clippy::expect_used)]
use std::sync::Arc;

use birch_core::btree::TreeCtx;
use birch_core::cache::NodeCache;
use birch_core::check::{check, CheckOptions};
use birch_core::counters::Counters;
use birch_core::device::{BlockDevice, MemDevice};
use birch_core::{Engine, MkfsOptions};
use birch_format::node::{ChildPtr, NodeBody, MAX_PTRS};
use birch_format::{Key, FS_TREE_ID};

fn k(n: u64, off: u64) -> Key {
    Key {
        objectid: 1000 + n,
        item_type: 1,
        offset: off,
    }
}

fn root_children(engine: &Engine) -> (u8, Vec<ChildPtr>) {
    let cache = NodeCache::new(16);
    let counters = Counters::default();
    let ctx = TreeCtx {
        device: &**engine.device(),
        cache: &cache,
        counters: &counters,
        fsid: engine.fsid(),
        owner: FS_TREE_ID,
    };
    let root = engine.superblock().fs_root;
    let node = ctx
        .read(root.addr, root.generation, root.level)
        .expect("root");
    match &node.body {
        NodeBody::Internal(p) => (root.level, p.clone()),
        _ => (0, vec![]),
    }
}

fn children_of(engine: &Engine, p: ChildPtr, level: u8) -> Vec<ChildPtr> {
    let cache = NodeCache::new(16);
    let counters = Counters::default();
    let ctx = TreeCtx {
        device: &**engine.device(),
        cache: &cache,
        counters: &counters,
        fsid: engine.fsid(),
        owner: FS_TREE_ID,
    };
    match &ctx.read(p.addr, p.generation, level).expect("node").body {
        NodeBody::Internal(c) => c.clone(),
        _ => vec![],
    }
}

fn leaf_keys(engine: &Engine, p: ChildPtr) -> Vec<Key> {
    let cache = NodeCache::new(16);
    let counters = Counters::default();
    let ctx = TreeCtx {
        device: &**engine.device(),
        cache: &cache,
        counters: &counters,
        fsid: engine.fsid(),
        owner: FS_TREE_ID,
    };
    match &ctx.read(p.addr, p.generation, 0).expect("leaf").body {
        NodeBody::Leaf(i) => i.iter().map(|x| x.0).collect(),
        _ => vec![],
    }
}

#[test]
fn serial_commit_removes_an_only_child_left_empty() {
    let dev: Arc<MemDevice> = Arc::new(MemDevice::new(512 << 20));
    let dyn_dev: Arc<dyn BlockDevice> = dev.clone();
    let engine = Engine::create(dyn_dev, &MkfsOptions::default(), Vec::new()).expect("create");
    engine.set_parallel_apply_min(usize::MAX);
    for chunk in 0..8u64 {
        let txn = engine.begin().expect("begin");
        for n in chunk * 10_000..(chunk + 1) * 10_000 {
            txn.put(k(n, 0), vec![7u8; 100]);
        }
        drop(txn);
        engine.commit().expect("commit");
    }
    let (level, top) = root_children(&engine);
    assert_eq!(level, 2, "three levels");
    eprintln!("root children: {}", top.len());
    // Fill slot 1 to exactly MAX_PTRS children.
    let mut off = 1u64;
    loop {
        let (_, top) = root_children(&engine);
        let p1 = top[1];
        let kids = children_of(&engine, p1, 1);
        eprintln!("p1 has {} children", kids.len());
        if kids.len() == MAX_PTRS {
            break;
        }
        assert!(kids.len() < MAX_PTRS, "overshot");
        let want = (MAX_PTRS - kids.len()).min(kids.len());
        let txn = engine.begin().expect("begin");
        for leaf in kids.iter().take(want) {
            let keys = leaf_keys(&engine, *leaf);
            let first = keys[0];
            for i in 0..(140 - keys.len() as u64) {
                txn.put(
                    Key {
                        offset: first.offset + off + i,
                        ..first
                    },
                    vec![1u8; 100],
                );
            }
        }
        off += 1000;
        drop(txn);
        engine.commit().expect("commit");
    }
    // Delete everything under slot 0 (its right neighbour is full, so it cannot merge).
    let (_, top) = root_children(&engine);
    let hi = top[1].key;
    let txn = engine.begin().expect("begin");
    let mut all = Vec::new();
    for leaf in children_of(&engine, top[0], 1) {
        all.extend(leaf_keys(&engine, leaf));
    }
    for key in all.iter().filter(|k| **k < hi) {
        txn.delete(*key);
    }
    drop(txn);
    engine.commit().expect("commit");
    let (_, top) = root_children(&engine);
    let kids = children_of(&engine, top[0], 1);
    eprintln!(
        "slot 0 now has {} children; first leaf has {} items",
        kids.len(),
        leaf_keys(&engine, kids[0]).len()
    );
    let report = check(&*dev, CheckOptions::default()).expect("check");
    let empty: Vec<_> = report
        .findings
        .iter()
        .filter(|f| f.found.contains("empty node"))
        .collect();
    for f in &empty {
        eprintln!("{f:?}");
    }
    assert!(
        empty.is_empty(),
        "fsck reports an empty node made by the serial commit path"
    );
}

#[test]
fn parallel_prune_keeps_pointer_keys_exact() {
    let dev: Arc<MemDevice> = Arc::new(MemDevice::new(1 << 30));
    let dyn_dev: Arc<dyn BlockDevice> = dev.clone();
    let engine = Engine::create(dyn_dev, &MkfsOptions::default(), Vec::new()).expect("create");
    engine.set_parallel_apply_min(usize::MAX);
    let total = 300_000u64;
    for chunk in 0..total / 20_000 {
        let txn = engine.begin().expect("begin");
        for n in chunk * 20_000..(chunk + 1) * 20_000 {
            txn.put(k(n, 0), vec![7u8; 100]);
        }
        drop(txn);
        engine.commit().expect("commit");
    }
    let (level, top) = root_children(&engine);
    assert_eq!(level, 2, "three levels");
    let m_slot = top.len() - 1;
    let n1_slot = top.len() - 2;
    eprintln!("root children: {}", top.len());
    // Fill M (last child) to exactly MAX_PTRS children.
    let mut off = 1u64;
    loop {
        let (_, top) = root_children(&engine);
        assert_eq!(top.len() - 1, m_slot);
        let kids = children_of(&engine, top[m_slot], 1);
        if kids.len() == MAX_PTRS {
            break;
        }
        assert!(kids.len() < MAX_PTRS, "overshot");
        let want = (MAX_PTRS - kids.len()).min(kids.len());
        let txn = engine.begin().expect("begin");
        for leaf in kids.iter().take(want) {
            let keys = leaf_keys(&engine, *leaf);
            let first = keys[0];
            for i in 0..(140 - keys.len() as u64) {
                txn.put(
                    Key {
                        offset: first.offset + off + i,
                        ..first
                    },
                    vec![1u8; 100],
                );
            }
        }
        off += 1000;
        drop(txn);
        engine.commit().expect("commit");
    }
    // Serial: N1 keeps only its last leaf.
    let (_, top) = root_children(&engine);
    let n1_kids = children_of(&engine, top[n1_slot], 1);
    let txn = engine.begin().expect("begin");
    for leaf in &n1_kids[..n1_kids.len() - 1] {
        for key in leaf_keys(&engine, *leaf) {
            txn.delete(key);
        }
    }
    drop(txn);
    engine.commit().expect("commit");
    let (_, top) = root_children(&engine);
    assert_eq!(
        children_of(&engine, top[n1_slot], 1).len(),
        1,
        "N1 has one leaf"
    );
    assert_eq!(
        children_of(&engine, top[m_slot], 1).len(),
        MAX_PTRS,
        "M is full"
    );
    // Parallel: empty N1's leaf, delete most of M, and overwrite many keys elsewhere so that
    // N1 and M stay in one job.
    engine.set_parallel_apply_min(1);
    let txn = engine.begin().expect("begin");
    let n1_leaf = children_of(&engine, top[n1_slot], 1)[0];
    for key in leaf_keys(&engine, n1_leaf) {
        txn.delete(key);
    }
    let m_kids = children_of(&engine, top[m_slot], 1);
    for leaf in &m_kids[..m_kids.len() - 100] {
        for key in leaf_keys(&engine, *leaf) {
            txn.delete(key);
        }
    }
    let lo = top[n1_slot - 1].key;
    let hi = top[n1_slot].key;
    let mut others = 0;
    let mut heavy = 0;
    for n in 0..total {
        let key = k(n, 0);
        if key < lo && others < 172_000 {
            txn.put(key, vec![9u8; 100]);
            others += 1;
        }
        if key >= lo && key < hi {
            for off in 1..=3u64 {
                if heavy < 40_000 {
                    txn.put(k(n, off), vec![3u8; 100]);
                    heavy += 1;
                }
            }
        }
    }
    eprintln!("others {others} heavy {heavy}");
    drop(txn);
    let jobs_before = engine.counters().values().commit_jobs;
    engine.commit().expect("commit");
    eprintln!(
        "jobs run: {}",
        engine.counters().values().commit_jobs - jobs_before
    );
    let report = check(&*dev, CheckOptions::default()).expect("check");
    let tree: Vec<_> = report
        .findings
        .iter()
        .filter(|f| f.found.contains("pointer key"))
        .collect();
    for f in &tree {
        eprintln!("{f:?}");
    }
    assert!(
        tree.is_empty(),
        "fsck reports pointer-key findings after a parallel commit"
    );
}
