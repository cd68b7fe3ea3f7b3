//! The COW B-tree against a `BTreeMap` model.
//!
//! Random sequences of insert, delete, range delete and replace-range run on both; every few
//! operations the tree's generation is committed (dirty nodes written, pinned space released)
//! and sometimes "reopened" with a cold node cache, so nodes come back from the device and are
//! verified. After each commit the whole tree is compared with the model and its structure is
//! checked (key order, pointer keys equal to child first keys, levels).
//!
//! Seeds: each case prints its seed; `BIRCH_SEED=N` replays one case, `BIRCH_CASES` and
//! `BIRCH_OPS` scale the run (CI: 24 cases x 2,500 ops; long run: BIRCH_CASES=100 BIRCH_OPS=5000).

#![allow(clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::Arc;

use birch_core::alloc::Allocator;
use birch_core::btree::{TreeCtx, TreeReader, TreeWriter};
use birch_core::cache::NodeCache;
use birch_core::counters::Counters;
use birch_core::device::{BlockDevice, MemDevice};
use birch_format::node::{Node, NodeBody};
use birch_format::superblock::RootPtr;
use birch_format::{BlockAddr, BlockCount, Generation, Key, NODE_BLOCKS};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const FSID: [u8; 16] = [9; 16];

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn key(n: u64) -> Key {
    Key {
        objectid: n / 16,
        item_type: 108,
        offset: (n % 16) * 4096,
    }
}

struct Harness {
    device: Arc<MemDevice>,
    alloc: Allocator,
    cache: NodeCache,
    counters: Counters,
    root: RootPtr,
    generation: u64,
}

impl Harness {
    fn new() -> Harness {
        let device = Arc::new(MemDevice::new(256 << 20));
        let alloc = Allocator::new(256 << 20);
        alloc.mark_used(BlockAddr::new(0), BlockCount::new(32));
        let cache = NodeCache::new(1 << 16);
        let counters = Counters::default();
        let root = {
            let ctx = TreeCtx {
                device: &*device,
                cache: &cache,
                counters: &counters,
                fsid: FSID,
                owner: 5,
            };
            let mut w = TreeWriter::create(ctx, &alloc, Generation::new(1)).expect("create");
            w.write_dirty().expect("write");
            w.root()
        };
        Harness {
            device,
            alloc,
            cache,
            counters,
            root,
            generation: 1,
        }
    }

    fn ctx(&self) -> TreeCtx<'_> {
        TreeCtx {
            device: &*self.device,
            cache: &self.cache,
            counters: &self.counters,
            fsid: FSID,
            owner: 5,
        }
    }
}

/// Walks the tree; checks order, pointer keys and levels; returns every item.
fn walk(h: &Harness) -> Vec<(Key, Vec<u8>)> {
    let ctx = h.ctx();
    let mut out = Vec::new();
    fn visit(
        ctx: &TreeCtx<'_>,
        addr: u64,
        generation: u64,
        level: u8,
        lo: Option<Key>,
        hi: Option<Key>,
        out: &mut Vec<(Key, Vec<u8>)>,
    ) {
        let node: Arc<Node> = ctx
            .read(BlockAddr::new(addr), Generation::new(generation), level)
            .expect("node reads and verifies");
        match &node.body {
            NodeBody::Leaf(items) => {
                for (k, v) in items {
                    assert!(
                        lo.is_none_or(|l| *k >= l) && hi.is_none_or(|h| *k < h),
                        "key {k} outside [{lo:?}, {hi:?})"
                    );
                    out.push((*k, v.clone()));
                }
            }
            NodeBody::Internal(ptrs) => {
                for (i, p) in ptrs.iter().enumerate() {
                    let child = ctx
                        .read(
                            BlockAddr::new(p.addr),
                            Generation::new(p.generation),
                            level - 1,
                        )
                        .expect("child");
                    assert_eq!(
                        child.first_key(),
                        Some(p.key),
                        "pointer key of slot {i} in node {addr:#x}"
                    );
                    visit(
                        ctx,
                        p.addr,
                        p.generation,
                        level - 1,
                        Some(p.key),
                        ptrs.get(i + 1).map(|n| n.key).or(hi),
                        out,
                    );
                }
            }
        }
    }
    visit(
        &ctx,
        h.root.addr,
        h.root.generation,
        h.root.level,
        None,
        None,
        &mut out,
    );
    out
}

fn run_case(seed: u64, ops: u64) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut h = Harness::new();
    let mut model: BTreeMap<Key, Vec<u8>> = BTreeMap::new();
    let key_space = rng.gen_range(50..5000u64);
    let mut done = 0;
    while done < ops {
        let batch = rng.gen_range(1..200u64).min(ops - done);
        let generation = h.generation + 1;
        let new_root = {
            let mut w = TreeWriter::new(h.ctx(), &h.alloc, Generation::new(generation), h.root);
            for _ in 0..batch {
                let a = rng.gen_range(0..key_space);
                match rng.gen_range(0..11) {
                    10 => {
                        // A commit-style sorted batch: inserts, overwrites and deletes.
                        let mut batch: BTreeMap<Key, Option<Vec<u8>>> = BTreeMap::new();
                        for _ in 0..rng.gen_range(1..80) {
                            let k = key(rng.gen_range(0..key_space));
                            let v = if rng.gen_ratio(1, 3) {
                                None
                            } else {
                                Some(vec![rng.gen::<u8>(); rng.gen_range(0..400)])
                            };
                            batch.insert(k, v);
                        }
                        let batch: Vec<(Key, Option<Vec<u8>>)> = batch.into_iter().collect();
                        let borrowed: Vec<(Key, Option<&[u8]>)> =
                            batch.iter().map(|(k, v)| (*k, v.as_deref())).collect();
                        w.apply_sorted(&borrowed).expect("apply_sorted");
                        for (k, v) in batch {
                            match v {
                                Some(v) => {
                                    model.insert(k, v);
                                }
                                None => {
                                    model.remove(&k);
                                }
                            }
                        }
                    }
                    0..=4 => {
                        let len = if rng.gen_ratio(1, 50) {
                            rng.gen_range(1000..7800)
                        } else {
                            rng.gen_range(0..200)
                        };
                        let value = vec![rng.gen::<u8>(); len];
                        let old = w.insert(key(a), value.clone()).expect("insert");
                        assert_eq!(
                            old,
                            model.insert(key(a), value),
                            "seed {seed}: insert old value"
                        );
                    }
                    5..=6 => {
                        let old = w.delete(&key(a)).expect("delete");
                        assert_eq!(old, model.remove(&key(a)), "seed {seed}: delete");
                    }
                    7 => {
                        let b = a + rng.gen_range(1..64);
                        let n = w.delete_range(&key(a), &key(b)).expect("delete_range");
                        let doomed: Vec<Key> =
                            model.range(key(a)..key(b)).map(|(k, _)| *k).collect();
                        assert_eq!(n, doomed.len(), "seed {seed}: delete_range count");
                        for k in doomed {
                            model.remove(&k);
                        }
                    }
                    _ => {
                        let b = a + rng.gen_range(1..8);
                        let value = vec![rng.gen::<u8>(); rng.gen_range(0..300)];
                        w.replace_range(&key(a), &key(b), key(a), value.clone())
                            .expect("replace_range");
                        let doomed: Vec<Key> =
                            model.range(key(a)..key(b)).map(|(k, _)| *k).collect();
                        for k in doomed {
                            model.remove(&k);
                        }
                        model.insert(key(a), value);
                    }
                }
                if rng.gen_ratio(1, 100) {
                    let probe = key(rng.gen_range(0..key_space));
                    assert_eq!(
                        w.get(&probe).expect("get"),
                        model.get(&probe).cloned(),
                        "seed {seed}: get before commit"
                    );
                }
            }
            w.write_dirty().expect("write");
            w.root()
        };
        h.device.flush().expect("flush");
        // The old generation's space comes back only now that the new one is durable.
        let pinned = h.alloc.take_pinned(Generation::new(generation));
        h.alloc.release(&pinned);
        h.root = new_root;
        h.generation = generation;
        done += batch;
        if rng.gen_ratio(1, 4) {
            h.cache = NodeCache::new(1 << 16); // reopen: every node comes from the device
        }
        let items = walk(&h);
        let expected: Vec<(Key, Vec<u8>)> = model.iter().map(|(k, v)| (*k, v.clone())).collect();
        assert_eq!(
            items.len(),
            expected.len(),
            "seed {seed}: item count after {done} ops"
        );
        assert!(
            items == expected,
            "seed {seed}: tree differs from model after {done} ops"
        );
        let reader = TreeReader {
            ctx: h.ctx(),
            root: h.root,
        };
        let lo = key(rng.gen_range(0..key_space));
        let hi = key(rng.gen_range(0..key_space));
        let via_cursor: Vec<Key> = reader
            .cursor(lo, hi)
            .map(|r| r.expect("cursor").0)
            .collect();
        let via_model: Vec<Key> = model.range(lo..hi.max(lo)).map(|(k, _)| *k).collect();
        assert_eq!(via_cursor, via_model, "seed {seed}: cursor range");
        // Reverse look: the last item in [floor, at], against the model, also past the ends.
        for _ in 0..8 {
            let at = key(rng.gen_range(0..key_space + 20));
            let floor = key(rng
                .gen_range(0..key_space + 20)
                .saturating_sub(rng.gen_range(0..200)));
            let got = reader.last_in(&floor, &at).expect("last_in");
            let want = if floor <= at {
                model
                    .range(floor..=at)
                    .next_back()
                    .map(|(k, v)| (*k, v.clone()))
            } else {
                None
            };
            assert_eq!(got, want, "seed {seed}: last_in({floor}, {at})");
        }
    }
    // Every allocated block is a reachable node, or reserved.
    let nodes = count_nodes(&h);
    let used = (h.alloc.total_blocks() - h.alloc.free_blocks()).get();
    assert_eq!(
        used,
        32 + nodes * NODE_BLOCKS,
        "seed {seed}: allocator and tree disagree (leak or double free)"
    );
}

fn count_nodes(h: &Harness) -> u64 {
    let ctx = h.ctx();
    let mut stack = vec![(h.root.addr, h.root.generation, h.root.level)];
    let mut n = 0;
    while let Some((a, g, l)) = stack.pop() {
        n += 1;
        if let NodeBody::Internal(ptrs) = &ctx
            .read(BlockAddr::new(a), Generation::new(g), l)
            .expect("node")
            .body
        {
            stack.extend(ptrs.iter().map(|p| (p.addr, p.generation, l - 1)));
        }
    }
    n
}

#[test]
fn btree_matches_model() {
    let ops = env("BIRCH_OPS", 2500);
    let seeds = birch_testkit::seeds::cases("btree_model", 0xb7ee_0000, env("BIRCH_CASES", 24));
    let cases = seeds.len() as u64;
    for (case, seed) in seeds.into_iter().enumerate() {
        eprintln!(
            "btree_model: case {case} seed {seed} ({ops} ops); replay with BIRCH_SEED={seed}"
        );
        run_case(seed, ops);
    }
    eprintln!(
        "btree_model: {cases} cases x {ops} ops = {} operations, all matched",
        cases * ops
    );
}

#[test]
fn overwriting_one_extent_is_one_descent() {
    let h = Harness::new();
    let mut w = TreeWriter::new(h.ctx(), &h.alloc, Generation::new(2), h.root);
    for n in 0..2000u64 {
        w.insert(
            Key {
                objectid: 300,
                item_type: 108,
                offset: n * 4096,
            },
            vec![1; 60],
        )
        .expect("insert");
    }
    let before = h.counters.values();
    let lo = Key {
        objectid: 300,
        item_type: 108,
        offset: 777 * 4096,
    };
    let hi = Key {
        objectid: 300,
        item_type: 108,
        offset: 778 * 4096,
    };
    let dropped = w.replace_range(&lo, &hi, lo, vec![2; 60]).expect("replace");
    let after = h.counters.values().since(&before);
    assert_eq!(dropped, 1);
    assert_eq!(
        after.btree_descents, 1,
        "one extent overwrite must cost exactly one descent"
    );
    assert_eq!(w.get(&lo).expect("get"), Some(vec![2; 60]));
}

/// One round of a parallel apply: `changes` cut by `plan` into jobs that `threads` threads
/// claim and run, then assembled. Falls back to the serial apply when the plan declines.
/// Returns (new root, whether the parallel path ran).
fn parallel_round(
    h: &Harness,
    generation: u64,
    changes: &[(Key, Option<Vec<u8>>)],
    weight: usize,
    jobs: usize,
    threads: usize,
) -> (RootPtr, bool) {
    use birch_core::btree::parallel;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    let borrowed: Vec<(Key, Option<&[u8]>)> =
        changes.iter().map(|(k, v)| (*k, v.as_deref())).collect();
    let sample: Vec<Key> = borrowed.iter().step_by(weight).map(|(k, _)| *k).collect();
    let mut w = TreeWriter::new(h.ctx(), &h.alloc, Generation::new(generation), h.root);
    let Some(mut plan) = parallel::plan(h.ctx(), h.root, &sample, weight, jobs).expect("plan")
    else {
        w.apply_sorted(&borrowed).expect("serial apply");
        w.write_dirty().expect("write");
        return (w.root(), false);
    };
    let cut: Vec<Mutex<Option<parallel::Job>>> = std::mem::take(&mut plan.jobs)
        .into_iter()
        .map(|j| Mutex::new(Some(j)))
        .collect();
    // Every change belongs to exactly one job, and the jobs are in key order.
    let mut covered = 0;
    let mut previous_hi: Option<Key> = Some(Key::MIN);
    for slot in &cut {
        let guard = slot.lock().expect("job lock");
        let job = guard.as_ref().expect("job");
        assert_eq!(previous_hi, Some(job.lo), "jobs are contiguous");
        previous_hi = job.hi;
        let from = borrowed.partition_point(|(k, _)| *k < job.lo);
        let to = job.hi.map_or(borrowed.len(), |hi| {
            borrowed.partition_point(|(k, _)| *k < hi)
        });
        covered += to.saturating_sub(from);
    }
    assert_eq!(previous_hi, None, "the last job owns every key above it");
    assert_eq!(covered, borrowed.len(), "jobs cover every change once");
    let next = AtomicUsize::new(0);
    let outputs: Vec<Mutex<Option<parallel::JobOutput>>> =
        cut.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(slot) = cut.get(i) else { return };
                let job = slot.lock().expect("job lock").take().expect("job");
                let from = borrowed.partition_point(|(k, _)| *k < job.lo);
                let to = job.hi.map_or(borrowed.len(), |hi| {
                    borrowed.partition_point(|(k, _)| *k < hi)
                });
                let out = parallel::run_job(
                    h.ctx(),
                    &h.alloc,
                    Generation::new(generation),
                    job,
                    &borrowed[from..to],
                )
                .expect("job");
                *outputs[i].lock().expect("output lock") = Some(out);
            });
        }
    });
    let outputs: Vec<parallel::JobOutput> = outputs
        .into_iter()
        .map(|o| o.into_inner().expect("output lock").expect("every job ran"))
        .collect();
    parallel::assemble(&mut w, plan, outputs).expect("assemble");
    w.write_dirty().expect("write");
    (w.root(), true)
}

/// Makes a round's tree current (flush, release what it pinned) and applies its changes to
/// the model.
fn finish_round(
    h: &mut Harness,
    root: RootPtr,
    generation: u64,
    changes: Vec<(Key, Option<Vec<u8>>)>,
    model: &mut BTreeMap<Key, Vec<u8>>,
) {
    h.device.flush().expect("flush");
    let pinned = h.alloc.take_pinned(Generation::new(generation));
    h.alloc.release(&pinned);
    h.root = root;
    h.generation = generation;
    for (k, v) in changes {
        match v {
            Some(v) => model.insert(k, v),
            None => model.remove(&k),
        };
    }
}

fn run_parallel_case(seed: u64, rounds: u64) -> u64 {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut h = Harness::new();
    let mut model: BTreeMap<Key, Vec<u8>> = BTreeMap::new();
    let mut top = 0u64; // appends go above every key so far
    let mut parallel_rounds = 0;
    for round in 0..rounds {
        let mut batch: BTreeMap<Key, Option<Vec<u8>>> = BTreeMap::new();
        let count = rng.gen_range(1..3000);
        let shape = rng.gen_range(0..6);
        if shape == 5 && !model.is_empty() {
            // A contiguous run of existing keys deleted (a directory removed with its files).
            let keys: Vec<Key> = model.keys().copied().collect();
            let from = rng.gen_range(0..keys.len());
            let to = (from + rng.gen_range(1..4000)).min(keys.len());
            for k in &keys[from..to] {
                batch.insert(*k, None);
            }
        }
        for _ in 0..count {
            let n = match shape {
                // Appends past the right edge (new inodes), with a few random changes.
                0 | 1 if rng.gen_ratio(9, 10) => {
                    top += rng.gen_range(1..4);
                    top
                }
                // A dense run somewhere in the middle (one directory's entries).
                2 => {
                    let base = rng.gen_range(0..top.max(1) + 1);
                    base + rng.gen_range(0..64)
                }
                _ => rng.gen_range(0..top.max(100) + 100),
            };
            top = top.max(n);
            let value = if shape == 4 && rng.gen_ratio(2, 3) || rng.gen_ratio(1, 6) {
                None
            } else {
                Some(vec![rng.gen::<u8>(); rng.gen_range(0..300)])
            };
            batch.insert(key(n), value);
        }
        if rng.gen_ratio(1, 12) {
            // Delete everything: the tree must end as one empty leaf.
            for k in model.keys() {
                batch.insert(*k, None);
            }
        }
        let changes: Vec<(Key, Option<Vec<u8>>)> = batch.into_iter().collect();
        let generation = h.generation + 1;
        let weight = rng.gen_range(1..9);
        let jobs = rng.gen_range(2..12);
        let threads = rng.gen_range(1..4);
        let (root, parallel) = parallel_round(&h, generation, &changes, weight, jobs, threads);
        parallel_rounds += u64::from(parallel);
        finish_round(&mut h, root, generation, changes, &mut model);
        if rng.gen_ratio(1, 3) {
            h.cache = NodeCache::new(1 << 16);
        }
        let items = walk(&h);
        let expected: Vec<(Key, Vec<u8>)> = model.iter().map(|(k, v)| (*k, v.clone())).collect();
        assert!(
            items == expected,
            "seed {seed}: tree differs from model after round {round} (parallel: {parallel})"
        );
        if parallel {
            // Deletes shrink the tree: an emptied tree is one leaf, and a root never keeps a
            // single child.
            if model.is_empty() {
                assert_eq!(h.root.level, 0, "seed {seed}: an empty tree is one leaf");
            }
            if h.root.level > 0 {
                let root = h
                    .ctx()
                    .read(
                        BlockAddr::new(h.root.addr),
                        Generation::new(h.root.generation),
                        h.root.level,
                    )
                    .expect("root");
                assert!(
                    root.len() > 1,
                    "seed {seed}: a root with one child after round {round}"
                );
            }
        }
        let nodes = count_nodes(&h);
        let used = (h.alloc.total_blocks() - h.alloc.free_blocks()).get();
        assert_eq!(
            used,
            32 + nodes * NODE_BLOCKS,
            "seed {seed}: allocator and tree disagree after round {round} (parallel: {parallel})"
        );
    }
    parallel_rounds
}

/// The parallel apply (plan, jobs on several threads, assembly) gives the same tree as the
/// model, with pointer keys, key ranges and levels intact and no node leaked or freed twice,
/// for appends at the right edge (cut leaves), dense runs, random changes and mass deletes.
#[test]
fn parallel_apply_matches_model() {
    let rounds = env("BIRCH_OPS", 2500) / 25;
    let cases = env("BIRCH_CASES", 24) / 2;
    let seeds = birch_testkit::seeds::cases("parallel_apply", 0x9a7a_0000, cases);
    let mut parallel = 0;
    for (case, seed) in seeds.into_iter().enumerate() {
        eprintln!("parallel_apply: case {case} seed {seed} ({rounds} rounds); BIRCH_SEED={seed}");
        parallel += run_parallel_case(seed, rounds);
    }
    assert!(parallel > 0, "no round took the parallel path");
    eprintln!("parallel_apply: {parallel} parallel rounds matched the model");
}

/// Deleting nearly everything from a tree of three levels through the parallel apply leaves
/// no empty leaf and no chain of one-child nodes: the tree shrinks to one leaf, as the serial
/// apply's merges and root collapse make it (review of the parallel apply: a job over one
/// internal subtree that deleted all of it left that subtree's last, empty leaf behind).
#[test]
fn parallel_apply_shrinks_a_deep_tree() {
    let mut h = Harness::new();
    let mut model: BTreeMap<Key, Vec<u8>> = BTreeMap::new();
    let fill: Vec<(Key, Option<Vec<u8>>)> = (0..80_000u64)
        .map(|n| (key(n), Some(vec![(n % 251) as u8; 150])))
        .collect();
    let mut generation = h.generation;
    // Two jobs for the big delete: each gets whole subtrees of internal nodes, not leaves.
    for (keep, threads, jobs) in [(usize::MAX, 1, 8), (10, 2, 2), (0, 3, 8)] {
        generation += 1;
        let changes: Vec<(Key, Option<Vec<u8>>)> = if keep == usize::MAX {
            fill.clone()
        } else {
            model.keys().skip(keep).map(|k| (*k, None)).collect()
        };
        let (root, parallel) = parallel_round(&h, generation, &changes, 4, jobs, threads);
        assert_eq!(
            parallel,
            h.root.level > 0,
            "a tree of more than one leaf is cut"
        );
        finish_round(&mut h, root, generation, changes, &mut model);
        let expected: Vec<(Key, Vec<u8>)> = model.iter().map(|(k, v)| (*k, v.clone())).collect();
        assert!(
            walk(&h) == expected,
            "tree differs from model (keep {keep})"
        );
        let used = (h.alloc.total_blocks() - h.alloc.free_blocks()).get();
        assert_eq!(
            used,
            32 + count_nodes(&h) * NODE_BLOCKS,
            "leak (keep {keep})"
        );
        match keep {
            usize::MAX => assert!(h.root.level >= 2, "80,000 items make three levels"),
            _ => assert_eq!(
                h.root.level,
                0,
                "{} items left in a tree of level {}",
                model.len(),
                h.root.level
            ),
        }
    }
}
