//! Tests of the engine across its parts: backup roots over commits, open of older images,
//! object-id locking, merged reads past deletions, the union walk.

use std::sync::Arc;

use birch_format::node::{Node, NodeBody};
use birch_format::superblock::{
    RootPtr, Superblock, BACKUP_ROOTS, COMPAT_BACKUP_ROOTS, SUPER_BYTES, SUPER_OFFSETS,
};
use birch_format::{BlockAddr, BlockCount, ItemType, Key, FS_TREE_ID, NODE_SIZE};

use crate::device::BlockDevice;
#[cfg(feature = "seed-before")]
use crate::ids::OBJECTID_BATCH;

use super::*;
use crate::device::MemDevice;

fn k(offset: u64) -> Key {
    Key::new(300, ItemType::ExtentData, offset)
}

/// Every item of the tree at `root`, read straight from the device (no node cache, so
/// an overwritten node shows): `None` when a node no longer verifies.
fn raw_items(
    device: &dyn BlockDevice,
    fsid: [u8; 16],
    root: RootPtr,
) -> Option<Vec<(Key, Vec<u8>)>> {
    raw_tree(device, fsid, root).map(|(items, _)| items)
}

/// A tree's items, in key order.
type Items = Vec<(Key, Vec<u8>)>;

/// [`raw_items`] and the addresses of the tree's nodes.
fn raw_tree(device: &dyn BlockDevice, fsid: [u8; 16], root: RootPtr) -> Option<(Items, Vec<u64>)> {
    let mut items = Vec::new();
    let mut nodes = Vec::new();
    let mut stack = vec![(root.addr, root.generation, root.level)];
    while let Some((addr, generation, level)) = stack.pop() {
        let mut bytes = vec![0u8; NODE_SIZE];
        device.read_at(&mut bytes, addr).ok()?;
        nodes.push(addr);
        let expect = birch_format::node::Expect {
            fsid,
            addr,
            generation,
            owner: FS_TREE_ID,
            level: Some(level),
        };
        match Node::decode(&bytes, &expect).ok()?.body {
            NodeBody::Internal(ptrs) => {
                stack.extend(ptrs.iter().map(|p| (p.addr, p.generation, level - 1)))
            }
            NodeBody::Leaf(leaf) => items.extend(leaf),
        }
    }
    items.sort_by_key(|(key, _)| *key);
    Some((items, nodes))
}

/// Whether no node of the tree at `root` is free in the allocator (so no commit may
/// write there).
fn tree_held(engine: &Engine, root: RootPtr) -> bool {
    raw_tree(&**engine.device(), engine.fsid(), root).is_some_and(|(_, nodes)| {
        nodes
            .iter()
            .all(|a| engine.allocator().is_used(BlockAddr::new(*a)))
    })
}

/// Rewrites every one of `count` items with values of `round`, then commits.
fn rewrite_all(engine: &Engine, count: u64, round: u8) -> u64 {
    let txn = engine.begin().expect("begin");
    for i in 0..count {
        txn.put(Key::new(1000 + i, ItemType::Xattr, 0), vec![round; 300]);
    }
    drop(txn);
    engine.commit().expect("commit").get()
}

/// DESIGN §13.2: the K commits after generation N rewrite every item of the tree, and
/// generation N's tree is still whole on the device after each of them (no block of it
/// was reused), is named among the superblock's backup roots, and survives a reopen (the
/// open walk keeps it), its nodes never free in the allocator meanwhile. With
/// `DEFER_COMMITS` at 0 (`scripts/sabotage/backup-defer-zero.toml`) tree N's nodes are free
/// after commit N+2.
#[test]
fn the_k_commits_after_n_leave_tree_n_whole() {
    // 6000 items of 300 bytes take about 960 blocks per tree (leaves half full after
    // the rewrites); 32 MiB leaves about 7,100 blocks, room for the live tree, the
    // K + 1 kept and the one being written, and little more, so the allocator wraps.
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(32 << 20));
    drop(Engine::create(dev.clone(), &MkfsOptions::default(), Vec::new()).expect("create"));
    let engine = Engine::open(dev.clone()).expect("open");
    let fsid = engine.fsid();
    let count = 6000;
    let n = rewrite_all(&engine, count, 1);
    let root_n = engine.superblock().fs_root;
    let items_n = raw_items(&*dev, fsid, root_n).expect("tree N reads");
    assert_eq!(items_n.len() as u64, count);
    for round in 0..BACKUP_ROOTS as u8 {
        let g = rewrite_all(&engine, count, 2 + round);
        let sb = engine.superblock();
        assert_eq!(sb.generation, g);
        assert!(
            sb.backup_roots
                .iter()
                .any(|b| b.generation == n && b.fs_root == root_n),
            "superblock {g} names generation {n}: {:?}",
            sb.backup_roots
        );
        assert!(
            raw_items(&*dev, fsid, root_n).as_ref() == Some(&items_n),
            "tree {n} after commit {g}"
        );
        assert!(tree_held(&engine, root_n), "tree {n} free after commit {g}");
    }
    drop(engine);
    let engine = Engine::open(dev.clone()).expect("reopen");
    assert!(
        engine.allocator().deferred_blocks() > BlockCount::new(0),
        "the open walk defers backup-only blocks"
    );
    let sb = engine.superblock();
    assert_eq!(sb.backup_roots.len(), BACKUP_ROOTS);
    let oldest = sb.backup_roots[BACKUP_ROOTS - 1];
    let items_oldest = raw_items(&*dev, fsid, oldest.fs_root).expect("oldest backup reads");
    // Tree G is named by superblocks up to G+K, so it stays held until commit G+K+2
    // is durable (DESIGN §13.2) and whole until then.
    let held_until = oldest.generation + BACKUP_ROOTS as u64 + 1;
    for round in 0..BACKUP_ROOTS as u8 {
        let g = rewrite_all(&engine, count, 10 + round);
        if g <= held_until + 1 {
            assert!(
                raw_items(&*dev, fsid, oldest.fs_root).as_ref() == Some(&items_oldest),
                "backup {} after reopen and commit {g}",
                oldest.generation
            );
        }
        if g <= held_until {
            assert!(
                tree_held(&engine, oldest.fs_root),
                "backup free after commit {g}"
            );
        }
    }
}

/// An image from before the flag (compat bit clear, backup bytes zero) opens; its first
/// commit by this build sets the flag and names the previous root.
#[test]
fn an_image_without_the_flag_opens_and_gains_it() {
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(16 << 20));
    drop(Engine::create(dev.clone(), &MkfsOptions::default(), Vec::new()).expect("create"));
    for offset in SUPER_OFFSETS {
        let mut bytes = vec![0u8; SUPER_BYTES];
        dev.read_at(&mut bytes, offset).expect("read");
        let mut sb = Superblock::decode(&bytes, "slot").expect("decode");
        sb.compat = 0;
        sb.backup_roots.clear();
        dev.write_at(&sb.encode(), offset).expect("write");
    }
    let engine = Engine::open(dev.clone()).expect("open an image without the flag");
    assert!(engine.superblock().backup_roots.is_empty());
    let before = engine.superblock();
    rewrite_all(&engine, 10, 1);
    let after = engine.superblock();
    assert_ne!(after.compat & COMPAT_BACKUP_ROOTS, 0);
    assert_eq!(after.backup_roots[0].generation, before.generation);
    assert_eq!(after.backup_roots[0].fs_root, before.fs_root);
}

fn last(engine: &Engine, floor: u64, key: u64) -> Option<u64> {
    engine
        .last_in(&k(floor), &k(key))
        .expect("last_in")
        .map(|(key, _)| key.offset)
}

/// `bench_global_objectid_lock` (seed 002's "before"): ids come one at a time from the
/// shared counter (a second thread's id follows the first's, no batch in between), and a
/// create that finds the counter's mutex held waits for it and counts the wait. Off, a
/// thread takes a batch of its own and never touches the mutex. Only with the `seed-before`
/// feature (CI: scripts/test.sh, tier "core tests, checked").
#[cfg(feature = "seed-before")]
#[test]
fn the_global_objectid_lock_switch_takes_one_lock_per_id_and_counts_waits() {
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(32 << 20));
    drop(Engine::create(dev.clone(), &MkfsOptions::default(), Vec::new()).expect("create"));
    let engine = Engine::open(dev).expect("open");
    let other_thread = |engine: &Arc<Engine>| {
        let engine = engine.clone();
        std::thread::spawn(move || engine.allocate_objectid().expect("id").get())
            .join()
            .expect("thread")
    };

    // Off: each thread has a batch of its own; the mutex is never asked for.
    let a = engine.allocate_objectid().expect("id").get();
    let b = other_thread(&engine);
    assert!(b.abs_diff(a) >= OBJECTID_BATCH, "{a} and {b} share a batch");
    let held = engine.ids.lock.lock();
    let c = other_thread(&engine);
    drop(held);
    assert!(c > b);
    assert_eq!(engine.counters().values().objectid_lock_waits, 0);

    // On: one id at a time, the next thread's id right after.
    engine.set_bench_global_objectid_lock(true);
    let d = engine.allocate_objectid().expect("id").get();
    let e = other_thread(&engine);
    assert_eq!(e, d + 1);
    let dir = engine.allocate_objectid_alone().expect("id").get();
    assert_eq!(dir % OBJECTID_BATCH, 0, "a directory still starts a batch");
    assert!(engine.allocate_objectid().expect("id").get() >= dir + OBJECTID_BATCH);

    // A create that finds the mutex held waits until it is released, and says so.
    let held = engine.ids.lock.lock();
    let waiter = {
        let engine = engine.clone();
        std::thread::spawn(move || engine.allocate_objectid().expect("id").get())
    };
    while engine.counters().values().objectid_lock_waits == 0 {
        assert!(!waiter.is_finished(), "allocated past a held lock");
        std::thread::yield_now();
    }
    assert!(!waiter.is_finished());
    drop(held);
    waiter.join().expect("waiter");
    assert_eq!(engine.counters().values().objectid_lock_waits, 1);
}

#[test]
fn a_short_range_sees_past_many_deletions_in_the_delta() {
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(32 << 20));
    drop(Engine::create(dev.clone(), &MkfsOptions::default(), Vec::new()).expect("create"));
    let engine = Engine::open(dev).expect("open");
    {
        let txn = engine.begin().expect("begin");
        for offset in 0..600 {
            txn.put(k(offset), vec![offset as u8; 40]);
        }
    }
    engine.commit().expect("commit");
    // A truncate's worth of deletions in the delta, over items still in the tree.
    {
        let txn = engine.begin().expect("begin");
        for offset in 0..590 {
            txn.delete(k(offset));
        }
    }
    let firsts = |limit| -> Vec<u64> {
        engine
            .range(&k(0), &k(u64::MAX), limit)
            .expect("range")
            .into_iter()
            .map(|(key, _)| key.offset)
            .collect()
    };
    assert_eq!(firsts(1), vec![590]);
    assert_eq!(firsts(3), vec![590, 591, 592]);
    assert_eq!(firsts(100), (590..600).collect::<Vec<_>>());
    // Everything deleted: nothing, not an endless look.
    {
        let txn = engine.begin().expect("begin");
        for offset in 590..600 {
            txn.delete(k(offset));
        }
    }
    assert_eq!(firsts(1), Vec::<u64>::new());
}

#[test]
fn last_in_merges_the_delta_over_the_tree() {
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(32 << 20));
    drop(Engine::create(dev.clone(), &MkfsOptions::default(), Vec::new()).expect("create"));
    let engine = Engine::open(dev).expect("open");
    {
        let txn = engine.begin().expect("begin");
        for offset in [10, 20, 30] {
            txn.put(k(offset), vec![offset as u8]);
        }
    }
    engine.commit().expect("commit");
    assert_eq!(last(&engine, 0, 35), Some(30));
    {
        // Newer layer: 30 deleted, 25 added; the tree still has 30.
        let txn = engine.begin().expect("begin");
        txn.delete(k(30));
        txn.put(k(25), vec![25]);
    }
    assert_eq!(last(&engine, 0, 35), Some(25));
    assert_eq!(
        last(&engine, 26, 35),
        None,
        "a deletion hides the tree's item"
    );
    engine.begin().expect("begin").delete(k(25));
    assert_eq!(last(&engine, 0, 35), Some(20));
    assert_eq!(last(&engine, 0, 19), Some(10));
    assert_eq!(last(&engine, 11, 19), None);
    assert_eq!(last(&engine, 0, 9), None);
    let value = engine.last_in(&k(0), &k(20)).expect("last_in");
    assert_eq!(value.map(|(_, v)| v.to_vec()), Some(vec![20]));
}

/// DESIGN §15.6: the union walk over trees that share subtrees reads each distinct node
/// once (a device read per node, counted), skips a shared subtree at its top, and marks
/// the data blocks an extent of a changed leaf reaches again only once.
#[test]
fn the_union_walk_reads_each_distinct_node_once() {
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(64 << 20));
    drop(Engine::create(dev.clone(), &MkfsOptions::default(), Vec::new()).expect("create"));
    let engine = Engine::open(dev.clone()).expect("open");
    let fsid = engine.fsid();
    let extent = |block: u64| {
        birch_format::items::FileExtent {
            generation: 1,
            kind: birch_format::items::ExtentKind::Regular {
                disk_addr: (4096 + block) * birch_format::BLOCK_SIZE,
                csums: vec![0],
            },
            shared: false,
        }
        .encode()
    };
    let txn = engine.begin().expect("begin");
    for i in 0..3000u64 {
        txn.put(k(i * birch_format::BLOCK_SIZE), extent(i));
    }
    drop(txn);
    engine.commit().expect("commit");
    // Keep each tree whole (its reader pins what later commits free), change a few
    // items, commit: three trees sharing most of their nodes.
    let mut kept = vec![engine.committed_root()];
    for round in 0..2u64 {
        let txn = engine.begin().expect("begin");
        txn.put(
            k(round * 1000 * birch_format::BLOCK_SIZE),
            extent(5000 + round),
        );
        drop(txn);
        engine.commit().expect("commit");
        kept.push(engine.committed_root());
    }
    let roots: Vec<RootPtr> = kept.iter().rev().map(|c| c.root).collect();
    let mut distinct = std::collections::HashSet::new();
    let mut total = 0;
    for root in &roots {
        let (_, nodes) = raw_tree(&*dev, fsid, *root).expect("tree reads");
        total += nodes.len();
        distinct.extend(nodes);
    }
    assert!(distinct.len() < total, "the trees share nodes");
    let reads = dev.counters().values().device_reads;
    let walk = union_walk(&*dev, fsid, dev.size_bytes(), &roots, true).expect("union walk");
    let reads = dev.counters().values().device_reads - reads;
    assert_eq!(walk.nodes_read, distinct.len() as u64);
    assert_eq!(reads, walk.nodes_read, "one device read per distinct node");
    assert!(
        walk.nodes_shared >= 2,
        "a shared subtree is skipped: {walk:?}"
    );
    // Every extent's blocks once (3000, and the 2 new ones); an extent of a copied leaf
    // is decoded again but its blocks are marked once.
    assert_eq!(walk.data_blocks, 3002);
    assert_eq!(walk.counted_blocks, walk.data_blocks_again);
    assert!(walk.extents < 3 * 3000);
}
