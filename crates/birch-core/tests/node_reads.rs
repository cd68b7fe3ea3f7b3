//! Tree-node reads of a scan in batches (DESIGN §14.4): at each internal node a scan reads
//! the children in its range that the node cache lacks with one `BlockDevice::read_many` (on
//! RBD: in flight together), each verified as a single read is, before it descends. A cold
//! scan of a tree of many leaves makes far fewer device calls than it reads nodes, returns
//! what the unbatched path returns, and a bad node or a failed read in a batch fails the
//! scan naming the block, never caching a node that did not verify.

#![allow(clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use birch_core::alloc::Allocator;
use birch_core::btree::{TreeCtx, TreeReader, TreeWriter};
use birch_core::cache::NodeCache;
use birch_core::counters::Counters;
use birch_core::device::{BlockDevice, MemDevice};
use birch_format::node::{Node, NodeBody};
use birch_format::superblock::RootPtr;
use birch_format::{BlockAddr, BlockCount, Generation, Key, NODE_SIZE, ROOT_INO};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use common::{Event, Recording};

/// Leaf items, in key order.
type Items = Vec<(Key, Vec<u8>)>;

/// Device calls and node reads (of `NODE_SIZE` bytes) in `events` (reads only, as
/// [`Recording::take_reads`] gives them).
fn calls_and_nodes(events: &[Event]) -> (usize, usize) {
    let nodes = events
        .iter()
        .map(|e| match e {
            Event::Read(_, len) => usize::from(*len == NODE_SIZE),
            Event::ReadMany(reads) => reads.iter().filter(|(_, len)| *len == NODE_SIZE).count(),
            other => unreachable!("not a read: {other:?}"),
        })
        .sum();
    (events.len(), nodes)
}

/// Every offset read, in any call of `events` (reads only).
fn offsets(events: &[Event]) -> Vec<u64> {
    let mut all: Vec<u64> = events
        .iter()
        .flat_map(|e| match e {
            Event::Read(o, _) => vec![*o],
            Event::ReadMany(reads) => reads.iter().map(|(o, _)| *o).collect(),
            other => unreachable!("not a read: {other:?}"),
        })
        .collect();
    all.sort_unstable();
    all
}

const FSID: [u8; 16] = [3; 16];
const OWNER: u64 = 5;

fn key(n: u64) -> Key {
    Key {
        objectid: 256 + n / 8,
        item_type: 84,
        offset: n % 8,
    }
}

fn value(n: u64) -> Vec<u8> {
    let len = 20 + (n % 41) as usize;
    (0..len).map(|i| (n as usize * 7 + i) as u8).collect()
}

/// A committed tree of `count` items (inserted in random order, so leaves are part full)
/// on a recording memory device.
struct Tree {
    mem: Arc<MemDevice>,
    dev: Arc<Recording>,
    counters: Counters,
    root: RootPtr,
    model: BTreeMap<Key, Vec<u8>>,
}

impl Tree {
    fn new(count: u64) -> Tree {
        let mem = Arc::new(MemDevice::new(128 << 20));
        let dev = Recording::new(mem.clone());
        let alloc = Allocator::new(128 << 20);
        alloc.mark_used(BlockAddr::new(0), BlockCount::new(32));
        let counters = Counters::default();
        let cache = NodeCache::new(1 << 16);
        let mut model = BTreeMap::new();
        let ctx = TreeCtx {
            device: &*dev,
            cache: &cache,
            counters: &counters,
            fsid: FSID,
            owner: OWNER,
        };
        let mut w = TreeWriter::create(ctx, &alloc, Generation::new(1)).expect("create");
        let mut order: Vec<u64> = (0..count).collect();
        let mut rng = SmallRng::seed_from_u64(21);
        for i in (1..order.len()).rev() {
            order.swap(i, rng.gen_range(0..=i));
        }
        for n in order {
            w.insert(key(n), value(n)).expect("insert");
            model.insert(key(n), value(n));
        }
        w.write_dirty().expect("write");
        let root = w.root();
        drop(w);
        dev.flush().expect("flush");
        dev.reads.store(true, Ordering::SeqCst);
        Tree {
            mem,
            dev,
            counters,
            root,
            model,
        }
    }

    fn ctx<'a>(&'a self, cache: &'a NodeCache) -> TreeCtx<'a> {
        TreeCtx {
            device: &*self.dev,
            cache,
            counters: &self.counters,
            fsid: FSID,
            owner: OWNER,
        }
    }

    /// Up to `limit` items of `[lo, hi)` through `cache`.
    fn range(
        &self,
        cache: &NodeCache,
        lo: &Key,
        hi: &Key,
        limit: usize,
    ) -> birch_core::Result<Vec<(Key, Vec<u8>)>> {
        TreeReader {
            ctx: self.ctx(cache),
            root: self.root,
        }
        .range(lo, hi, limit)
    }

    /// Every node of the tree, by level: address, and the items of each leaf. Read one node
    /// at a time (`TreeCtx::read`, no batch): the unbatched path.
    fn walk(&self) -> (Vec<(u64, u8)>, Items) {
        let cache = NodeCache::new(1 << 16);
        let ctx = self.ctx(&cache);
        let mut nodes = Vec::new();
        let mut items = Vec::new();
        let mut stack = vec![(self.root.addr, self.root.generation, self.root.level)];
        while let Some((addr, generation, level)) = stack.pop() {
            let node: Arc<Node> = ctx
                .read(BlockAddr::new(addr), Generation::new(generation), level)
                .expect("node");
            nodes.push((addr, level));
            match &node.body {
                NodeBody::Leaf(leaf) => items.extend(leaf.iter().cloned()),
                NodeBody::Internal(ptrs) => {
                    for p in ptrs.iter().rev() {
                        stack.push((p.addr, p.generation, level - 1));
                    }
                }
            }
        }
        (nodes, items)
    }

    /// The leaves, in key order.
    fn leaves(&self) -> Vec<u64> {
        self.walk()
            .0
            .into_iter()
            .filter(|(_, level)| *level == 0)
            .map(|(addr, _)| addr)
            .collect()
    }

    fn model_range(&self, lo: &Key, hi: &Key, limit: usize) -> Vec<(Key, Vec<u8>)> {
        self.model
            .range(*lo..*hi)
            .take(limit)
            .map(|(k, v)| (*k, v.clone()))
            .collect()
    }
}

/// A cold scan of a whole tree of hundreds of leaves reads every node once, in far fewer
/// device calls than nodes (batches of up to 64), and returns exactly what the unbatched
/// walk and the model hold.
#[test]
fn a_cold_scan_reads_the_children_of_each_node_in_batches() {
    let tree = Tree::new(150_000);
    tree.dev.reads.store(false, Ordering::SeqCst);
    let (all_nodes, walked) = tree.walk();
    tree.dev.reads.store(true, Ordering::SeqCst);
    let levels = all_nodes.iter().map(|(_, l)| *l).max().expect("root") + 1;
    assert!(levels >= 3, "a tree of three levels at least: {levels}");
    let leaves = all_nodes.iter().filter(|(_, l)| *l == 0).count();
    assert!(leaves > 500, "{leaves} leaves");

    let cache = NodeCache::new(1 << 16);
    tree.dev.take();
    let got = tree
        .range(&cache, &Key::MIN, &Key::MAX, usize::MAX)
        .expect("scan");
    let events = tree.dev.take_reads();
    let (calls, nodes) = calls_and_nodes(&events);
    eprintln!(
        "cold whole scan: {nodes} nodes ({leaves} leaves, {levels} levels) in {calls} device \
         calls"
    );
    assert_eq!(
        got, walked,
        "the batched scan returns what the unbatched walk does"
    );
    assert_eq!(got, tree.model_range(&Key::MIN, &Key::MAX, usize::MAX));
    assert_eq!(nodes, all_nodes.len(), "each node read once");
    let mut want: Vec<u64> = all_nodes.iter().map(|(a, _)| *a).collect();
    want.sort_unstable();
    assert_eq!(offsets(&events), want, "each node read once");
    assert!(
        calls * 10 <= nodes,
        "{calls} device calls for {nodes} nodes: {:?}",
        &events[..events.len().min(8)]
    );
    assert!(
        events.iter().all(|e| match e {
            Event::ReadMany(reads) => reads.len() <= 64,
            Event::Read(..) => true,
            other => unreachable!("not a read: {other:?}"),
        }),
        "at most 64 nodes per read_many"
    );

    // Warm: no device read at all.
    let again = tree
        .range(&cache, &Key::MIN, &Key::MAX, usize::MAX)
        .expect("warm scan");
    assert_eq!(again, got);
    assert!(
        tree.dev.take_reads().is_empty(),
        "a warm scan reads nothing"
    );
}

/// Scans of random ranges with random limits, each on a cold cache and again on a warm one,
/// return what the model returns; a scan with a small limit reads few nodes past what it
/// needs.
#[test]
fn cold_scans_of_any_range_and_limit_return_the_model() {
    let tree = Tree::new(30_000);
    let mut rng = SmallRng::seed_from_u64(7);
    for round in 0..60 {
        let a = rng.gen_range(0..30_000u64);
        let b = rng.gen_range(0..30_000u64);
        let (lo, hi) = (key(a.min(b)), key(a.max(b) + 1));
        let limit = match round % 4 {
            0 => usize::MAX,
            1 => rng.gen_range(1..20),
            2 => rng.gen_range(1..2_000),
            _ => rng.gen_range(1..70_000),
        };
        let cache = NodeCache::new(1 << 16);
        let got = tree.range(&cache, &lo, &hi, limit).expect("cold scan");
        assert_eq!(
            got,
            tree.model_range(&lo, &hi, limit),
            "round {round}: [{lo}, {hi}) limit {limit}"
        );
        let warm = tree.range(&cache, &lo, &hi, limit).expect("warm scan");
        assert_eq!(warm, got, "round {round}");
    }
    // A small limit reads a path and a leaf or two, not a batch of leaves.
    tree.dev.take();
    let cache = NodeCache::new(1 << 16);
    let got = tree
        .range(&cache, &key(100), &Key::MAX, 10)
        .expect("small scan");
    assert_eq!(got.len(), 10);
    let (_, nodes) = calls_and_nodes(&tree.dev.take_reads());
    assert!(nodes <= 6, "{nodes} nodes read for 10 items");
}

/// The error text of a scan that must fail (without printing every item when it did not).
fn failure(result: birch_core::Result<Vec<(Key, Vec<u8>)>>, what: &str) -> String {
    match result {
        Ok(items) => panic!("{what}: the scan returned {} items", items.len()),
        Err(e) => e.to_string(),
    }
}

/// The `NODE_SIZE` bytes at `addr`.
fn saved(mem: &MemDevice, addr: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; NODE_SIZE];
    mem.read_at(&mut bytes, addr).expect("read node");
    bytes
}

/// A child of a batch that does not verify fails the scan with an error naming its block;
/// the rest of the batch is used, the bad node is never served from the cache (a second scan
/// fails again; once the block holds its node again the scan returns the model). Two kinds:
/// a bad checksum, and a valid node of another address (what a misdirected write leaves).
#[test]
fn a_bad_child_in_a_batch_fails_the_scan_and_is_not_cached() {
    let tree = Tree::new(30_000);
    let leaves = tree.leaves();
    assert!(leaves.len() > 40, "{} leaves", leaves.len());
    let victim = leaves[leaves.len() / 2];
    let good = saved(&tree.mem, victim);
    let other = saved(&tree.mem, leaves[3]);
    let mut bad_checksum = good.clone();
    bad_checksum[NODE_SIZE / 2] ^= 0x5A;
    for (what, bytes) in [("bad checksum", &bad_checksum), ("misplaced node", &other)] {
        tree.mem.corrupt(victim, bytes);
        let cache = NodeCache::new(1 << 16);
        tree.dev.take();
        for attempt in 0..2 {
            let text = failure(
                tree.range(&cache, &Key::MIN, &Key::MAX, usize::MAX),
                "a bad node fails the scan",
            );
            assert!(
                text.contains(&format!("read node {victim:#x}")),
                "{what}, attempt {attempt}: {text}"
            );
            let events = tree.dev.take_reads();
            // The bad node came in a batch the first time (the second time it is the only
            // node of its batch missing from the cache: read alone), and each attempt reads
            // it again.
            assert!(
                attempt > 0
                    || events.iter().any(|e| matches!(e, Event::ReadMany(reads)
                    if reads.iter().any(|(o, _)| *o == victim))),
                "{what}: {:?}",
                &events[..events.len().min(8)]
            );
            assert!(
                offsets(&events).contains(&victim),
                "{what}, attempt {attempt}: read again, not cached"
            );
        }
        // A scan that stops before the bad leaf succeeds, even when the bad leaf was in
        // the same batch as the leaves it used.
        let first = {
            let cache = NodeCache::new(1 << 16);
            failure(
                tree.range(&cache, &Key::MIN, &Key::MAX, usize::MAX),
                "still bad",
            );
            cache
        };
        let before_victim = tree.model.len() / 4;
        let got = tree
            .range(&first, &Key::MIN, &Key::MAX, before_victim)
            .expect("a scan that stops before the bad leaf");
        assert_eq!(got, tree.model_range(&Key::MIN, &Key::MAX, before_victim));
        // Repaired: the same cache now serves the whole tree.
        tree.mem.corrupt(victim, &good);
        let got = tree
            .range(&cache, &Key::MIN, &Key::MAX, usize::MAX)
            .expect("scan after the repair");
        assert_eq!(
            got,
            tree.model_range(&Key::MIN, &Key::MAX, usize::MAX),
            "{what}"
        );
    }
}

/// A failed device read in a prefetch batch does not fail the scan by itself (the child it
/// hit may lie past what the scan needs): a scan whose limit stops before that child
/// succeeds, and one that reaches it fails with the child's own read error (which node,
/// where, the device's error), as without prefetch; nothing wrong is cached, and a later scan
/// succeeds.
#[test]
fn a_failed_read_in_a_batch_fails_only_a_scan_that_needs_that_node() {
    let tree = Tree::new(30_000);
    // A scan with a limit: the last node of its last batch is one it prefetched beyond what
    // the limit let it use.
    let limit = 5000;
    tree.dev.take();
    let dry = NodeCache::new(1 << 16);
    tree.range(&dry, &Key::MIN, &Key::MAX, limit)
        .expect("dry run");
    let unused = tree
        .dev
        .take_reads()
        .iter()
        .rev()
        .find_map(|e| match e {
            Event::ReadMany(reads) => reads.last().map(|(o, _)| *o),
            Event::Read(..) => None,
            other => unreachable!("not a read: {other:?}"),
        })
        .expect("the limited scan read a batch");
    tree.dev.fail_read_at.store(unused + 4096, Ordering::SeqCst);
    let cache = NodeCache::new(1 << 16);
    let short = tree
        .range(&cache, &Key::MIN, &Key::MAX, limit)
        .expect("a scan whose batch hit a failing node it never needs");
    assert_eq!(short, tree.model_range(&Key::MIN, &Key::MAX, limit));
    let victim = unused;
    tree.dev.take();
    let text = failure(
        tree.range(&cache, &Key::MIN, &Key::MAX, usize::MAX),
        "a failed read fails the scan that needs it",
    );
    assert!(
        text.contains("read node 0x")
            && text.contains(&format!("injected read failure at {victim:#x}")),
        "{text}"
    );
    let events = tree.dev.take_reads();
    assert!(
        events.iter().any(
            |e| matches!(e, Event::ReadMany(reads) if reads.iter().any(|(o, _)| *o == victim))
        ),
        "the failing node was in a batch first"
    );
    assert!(
        matches!(events.last(), Some(Event::Read(o, _)) if *o == victim),
        "then read alone: {:?}",
        events.last()
    );
    tree.dev.fail_read_at.store(u64::MAX, Ordering::SeqCst);
    let got = tree
        .range(&cache, &Key::MIN, &Key::MAX, usize::MAX)
        .expect("scan after the device recovered");
    assert_eq!(got, tree.model_range(&Key::MIN, &Key::MAX, usize::MAX));
}

/// Through the filesystem: listing a directory of thousands of entries after a reopen (a
/// cold node cache) reads its leaves in batches, with the paged readdir FUSE uses (512
/// entries a page) and with one scan of the whole listing; both list every name.
#[test]
fn a_cold_directory_listing_reads_leaves_in_batches() {
    let (mem, fs) = common::fresh(256 << 20);
    let dir = fs
        .mkdir(Default::default(), ROOT_INO, b"d", 0o755)
        .expect("mkdir")
        .ino;
    let n = 20_000usize;
    for i in 0..n {
        fs.mknod(
            Default::default(),
            dir,
            format!("entry-with-a-longer-name-{i:08}").as_bytes(),
            libc::S_IFREG | 0o644,
            0,
        )
        .expect("mknod");
    }
    fs.close().expect("close");
    drop(fs);

    let list = |paged: bool| -> (Vec<Vec<u8>>, usize, usize) {
        let dev = Recording::new(mem.clone());
        let fs = common::open_quiet(&dev);
        // Opening walks the trees (and caches their nodes): start the listing cold.
        fs.engine().clear_node_cache();
        dev.reads.store(true, Ordering::SeqCst);
        let mut names = Vec::new();
        if paged {
            let mut offset = 0;
            loop {
                let page = fs.readdir(dir, offset, 512).expect("readdir");
                let Some(last) = page.last() else { break };
                offset = last.next_offset;
                names.extend(page.into_iter().map(|e| e.name));
            }
        } else {
            names.extend(
                fs.readdir(dir, 0, usize::MAX)
                    .expect("readdir")
                    .into_iter()
                    .map(|e| e.name),
            );
        }
        let (calls, nodes) = calls_and_nodes(&dev.take_reads());
        fs.close().expect("close");
        (names, calls, nodes)
    };
    let mut want: Vec<Vec<u8>> = (0..n)
        .map(|i| format!("entry-with-a-longer-name-{i:08}").into_bytes())
        .collect();
    want.extend([b".".to_vec(), b"..".to_vec()]);
    want.sort();
    for paged in [false, true] {
        let (mut names, calls, nodes) = list(paged);
        names.sort();
        assert_eq!(names, want, "paged {paged}");
        eprintln!(
            "cold listing of {n} entries ({}): {nodes} nodes read in {calls} device calls",
            if paged { "pages of 512" } else { "one scan" }
        );
        if paged {
            assert!(calls * 3 < nodes * 2, "{calls} calls for {nodes} nodes");
        } else {
            assert!(calls * 5 < nodes, "{calls} calls for {nodes} nodes");
        }
    }
}

/// On an image file (O_DIRECT, `read_many` through io_uring where the kernel has it): a cold
/// listing of a directory of thousands of entries, read in batches, lists every name, reads
/// each node once (the batches' nodes verify and are used from the cache), and counts one
/// device read per node as single reads do.
#[test]
fn a_cold_listing_on_an_image_file_lists_every_name() {
    use birch_core::device::{FileDevice, OpenMode};
    let dir = std::env::temp_dir().join(format!("birch-node-reads-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let path = dir.join("img");
    let file = std::fs::File::create(&path).expect("image");
    file.set_len(256 << 20).expect("size");
    drop(file);
    let open = || Arc::new(FileDevice::open(&path, OpenMode::ReadWrite).expect("open image"));
    let dev = open();
    birch_core::Filesystem::mkfs(dev.clone(), &Default::default()).expect("mkfs");
    let fs = common::open_quiet(&dev);
    let d = fs
        .mkdir(Default::default(), ROOT_INO, b"d", 0o755)
        .expect("mkdir")
        .ino;
    let n = 8_000usize;
    for i in 0..n {
        fs.mknod(
            Default::default(),
            d,
            format!("file-{i:06}").as_bytes(),
            libc::S_IFREG | 0o644,
            0,
        )
        .expect("mknod");
    }
    fs.close().expect("close");
    drop(fs);
    drop(dev);

    let dev = open();
    let fs = common::open_quiet(&dev);
    fs.engine().clear_node_cache();
    let before = dev.counters().values().device_reads;
    let engine_before = fs.engine().counters().values();
    let mut names: Vec<Vec<u8>> = fs
        .readdir(d, 0, usize::MAX)
        .expect("readdir")
        .into_iter()
        .map(|e| e.name)
        .collect();
    let reads = dev.counters().values().device_reads - before;
    let engine = fs.engine().counters().values().since(&engine_before);
    let nodes = engine.cache_misses;
    names.sort();
    let mut want: Vec<Vec<u8>> = (0..n)
        .map(|i| format!("file-{i:06}").into_bytes())
        .collect();
    want.extend([b".".to_vec(), b"..".to_vec()]);
    want.sort();
    assert_eq!(names, want);
    assert!(nodes > 20, "{nodes} nodes read");
    assert_eq!(reads, nodes, "one device read counted per node read");
    // The leaves came from the batches, verified: each read once, then a cache hit.
    assert!(
        engine.cache_hits * 10 >= nodes * 9,
        "{} hits, {nodes} misses",
        engine.cache_hits
    );
    fs.close().expect("close");
    drop(fs);
    drop(dev);
    let _ = std::fs::remove_dir_all(&dir);
}
