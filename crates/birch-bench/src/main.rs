//! `birch-engine-bench`: the in-process benchmark of birchfs (no FUSE, no kernel in the path).
//!
//! What it measures, on a [`MemDevice`] (default) or on an image file opened like a mount opens
//! it (`--image PATH`: [`FileDevice`], O_DIRECT, flush = `fdatasync`; the file is created or
//! truncated and made sparse for each part, so its old content is lost):
//!
//! 1. **B-tree** ([`TreeWriter`] and [`TreeReader`] driven directly, like
//!    `crates/birch-core/tests/btree_model.rs`): inserts/s of random and of sequential keys
//!    (32-byte values) into one tree, a generation written out and flushed every `batch`
//!    inserts (the write-out is included in the rate and also shown apart), then lookups/s of
//!    every inserted key in random and in key order from the committed tree (warm cache).
//! 2. **Commits** ([`Engine`]): commits/s and node bytes written per commit when each commit
//!    carries 1, 100 or 10,000 changed items (160-byte inode-sized values, distinct random
//!    keys of a prefilled tree). The rate counts only the time inside `Engine::commit`.
//! 3. **Filesystem API** ([`Filesystem`]): each sustained over 4 commits, the commit cost
//!    included (an explicit `sync` after each quarter, in the timed thread): empty-file
//!    creates/s (`create` + `release`) in one thread, and in two threads each in its own
//!    directory, 5 interleaved rounds with the median reported, the scaling ratio to one thread,
//!    and the scaling a share-nothing calibration got from the machine in the same rounds;
//!    4 KiB appends/s to one file; 4 KiB random overwrites/s inside a 64 MiB file (written and
//!    committed before the clock starts; with `--overwrite-snapshot` a snapshot of it is taken
//!    then, so the overwrites pay what sharing costs the COW path). The MemDevice's pages are mapped before the clock,
//!    and it writes in place (`MemDevice::for_benchmarks`).
//! 4. **Open walk with snapshots** (`--only open`, never in the default run; docs/DECISIONS.md, "Measurements behind the reference-tracking decision"): an
//!    image of `--open-files` files of one 4 KiB block (1,000,000 by default); `Engine::open`
//!    and the union walk (`txn::union_walk`) of the newest tree, then of the newest tree and
//!    `--open-snapshots` kept older roots (each kept before 1% of the files are overwritten at
//!    random), against the trees walked one by one; the COW-path costs of the candidates of
//!    docs/DECISIONS.md, "Reference tracking for snapshots and clones" (an extra item per freed extent in a random leaf and appended; look-ups in
//!    an in-memory reference-count map).
//! 5. **Diff of two snapshots** (`--only diff`, never in the default run; DESIGN §15.8): an
//!    image of `--diff-files` files of 100 bytes (1,000 to a directory), snapshot `before`,
//!    `--diff-changed` files overwritten at random, snapshot `after`; `Engine::diff` of the
//!    two with a cold node cache (a fresh `Engine::open`, then the diff timed): nodes the walk
//!    read, device reads of nodes in all (path look-ups included), and time; the same walk of
//!    `after` against an empty tree (every node) for scale.
//!
//! Every row also gives the engine counters per operation (per commit in part 2):
//! `btree_descents`, `btree_cows`, `nodes_written`, and the device's `flushes` and
//! `bytes_written`. Figures are reported, never asserted.
//!
//! Run:
//!
//! ```sh
//! cargo run --release -p birch-bench -- [--quick] [--image PATH] [--json]
//! ```
//!
//! `--bench-global-objectid-lock` and `--bench-apply-per-item` open part 3's filesystems with
//! seed 002's and seed 003's "before" (benchmark-only `OpenOptions`, docs/BENCHMARKS.md).
//!
//! `--quick` shrinks every part (50,000 B-tree operations instead of 1,000,000) and finishes
//! in well under 20 s on a MemDevice. `--json` prints the figures as JSON on stdout and the
//! table on stderr.

/// The same allocator as the `birch` binary, so the figures here speak for a mount.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::error::Error as StdError;
use std::fmt::Write as _;
use std::hint::black_box;
use std::path::PathBuf;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use birch_core::alloc::Allocator;
use birch_core::btree::{TreeCtx, TreeReader, TreeWriter};
use birch_core::cache::NodeCache;
use birch_core::counters::{CounterValues, Counters};
use birch_core::device::{BlockDevice, FileDevice, MemDevice, OpenMode};
use birch_core::txn::{union_walk, UnionWalk};
use birch_core::vfs::{Caller, OpenOptions};
use birch_core::{Engine, Filesystem, MkfsOptions};
use birch_format::superblock::RootPtr;
use birch_format::{
    BlockAddr, BlockCount, Generation, InodeNo, ItemType, Key, BLOCK_SIZE, NODE_SIZE, ROOT_INO,
};
use clap::Parser;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

type Res<T> = Result<T, Box<dyn StdError + Send + Sync>>;

const SEED: u64 = 0x5eed_b1c4;
const FSID: [u8; 16] = [0xbe; 16];

#[derive(Parser)]
#[command(about = "In-process benchmark of the birchfs engine and filesystem API")]
struct Args {
    /// Small sizes: finishes in seconds (CI smoke run).
    #[arg(long)]
    quick: bool,
    /// Run on this image file (created or truncated; O_DIRECT) instead of memory.
    #[arg(long)]
    image: Option<PathBuf>,
    /// Print JSON on stdout (the table goes to stderr).
    #[arg(long)]
    json: bool,
    /// Run only these parts (repeatable): btree, commit, create, append, overwrite, open,
    /// diff. `open` and `diff` run only when named (they build a large image).
    #[arg(long, value_parser = ["btree", "commit", "create", "append", "overwrite", "open", "diff"])]
    only: Vec<String>,
    /// Part `diff`: files in the image (100 bytes each, 1,000 to a directory; at most 20,000
    /// with `--quick`).
    #[arg(long, default_value_t = 100_000)]
    diff_files: usize,
    /// Part `diff`: files overwritten between the two snapshots.
    #[arg(long, default_value_t = 10)]
    diff_changed: usize,
    /// Part `open`: files in the image (each one 4 KiB block, 1,000 to a directory; at most
    /// 20,000 with `--quick`).
    #[arg(long, default_value_t = 1_000_000)]
    open_files: usize,
    /// Part `open`: older roots kept as simulated snapshots (each after ~1% of the files
    /// were overwritten).
    #[arg(long, default_value_t = 10)]
    open_snapshots: usize,
    /// Seed 002's "before", benchmark only: one mutex on the object id counter for every
    /// create, no batch of ids per thread (`OpenOptions::bench_global_objectid_lock`; only in
    /// a build with the `seed-before` feature).
    #[cfg(feature = "seed-before")]
    #[arg(long)]
    bench_global_objectid_lock: bool,
    /// Seed 003's "before", benchmark only: the commit deletes and inserts each changed extent
    /// item in a descent of its own (`OpenOptions::bench_apply_per_item`; only in a build with
    /// the `seed-before` feature).
    #[cfg(feature = "seed-before")]
    #[arg(long)]
    bench_apply_per_item: bool,
    /// Part `overwrite`: take a snapshot after the file is written and committed, before the
    /// clock starts, so the timed overwrites free blocks the snapshot holds (the COW path's
    /// cost of sharing, DESIGN §15.8; with `--quick` most of the 4,000 overwrites are the
    /// first of their block).
    #[arg(long)]
    overwrite_snapshot: bool,
    /// Part `overwrite`: how many 4 KiB overwrites (default 40,000; 4,000 with `--quick`).
    #[arg(long)]
    overwrites: Option<usize>,
}

/// The benchmark-only switches every filesystem of part 3 is opened with (set once in `run`).
#[cfg(feature = "seed-before")]
static SWITCHES: std::sync::OnceLock<(bool, bool)> = std::sync::OnceLock::new();

impl Args {
    fn wants(&self, part: &str) -> bool {
        (self.only.is_empty() && part != "open" && part != "diff")
            || self.only.iter().any(|p| p == part)
    }
}

/// How big each part is.
struct Sizes {
    btree_ops: usize,
    btree_batch: usize,
    commit_prefill: usize,
    commit_budget: Duration,
    commit_max: [usize; 3],
    creates: usize,
    appends: usize,
    overwrites: usize,
}

impl Sizes {
    fn new(quick: bool) -> Sizes {
        if quick {
            Sizes {
                btree_ops: 50_000,
                btree_batch: 10_000,
                commit_prefill: 50_000,
                commit_budget: Duration::from_millis(500),
                commit_max: [300, 100, 5],
                creates: 20_000,
                appends: 4_000,
                overwrites: 4_000,
            }
        } else {
            Sizes {
                btree_ops: 1_000_000,
                btree_batch: 100_000,
                commit_prefill: 200_000,
                commit_budget: Duration::from_secs(3),
                commit_max: [2_000, 500, 30],
                creates: 200_000,
                appends: 40_000,
                overwrites: 40_000,
            }
        }
    }
}

/// Where the bench runs.
enum Target {
    Mem,
    Image(PathBuf),
}

impl Target {
    /// A fresh device of `size` bytes. For an image the file is truncated to zero first, so
    /// nothing of an earlier part survives and the image is sparse as `birch mkfs` leaves it.
    fn device(&self, size: u64) -> Res<Arc<dyn BlockDevice>> {
        match self {
            Target::Mem => Ok(Arc::new(MemDevice::for_benchmarks(size))),
            Target::Image(path) => {
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .write(true)
                    .truncate(true)
                    .open(path)
                    .map_err(|e| format!("{}: create image: {e}", path.display()))?;
                file.set_len(size)?;
                drop(file);
                let dev = FileDevice::open(path, OpenMode::ReadWrite)?;
                if !dev.is_direct() {
                    eprintln!("note: {}: O_DIRECT refused, buffered I/O", path.display());
                }
                Ok(Arc::new(dev))
            }
        }
    }

    fn describe(&self) -> String {
        match self {
            Target::Mem => "MemDevice".to_string(),
            Target::Image(path) => format!("FileDevice O_DIRECT {}", path.display()),
        }
    }
}

/// Engine and device counters at one moment.
#[derive(Clone, Default)]
struct Snap {
    engine: CounterValues,
    device: CounterValues,
}

impl Snap {
    fn of(engine: &Counters, device: &dyn BlockDevice) -> Snap {
        Snap {
            engine: engine.values(),
            device: device.counters().values(),
        }
    }

    fn since(&self, earlier: &Snap) -> Snap {
        Snap {
            engine: self.engine.since(&earlier.engine),
            device: self.device.since(&earlier.device),
        }
    }
}

/// One measured figure.
struct Row {
    section: &'static str,
    name: String,
    ops: u64,
    secs: f64,
    unit: &'static str,
    delta: Snap,
    extra: Vec<(&'static str, f64)>,
}

impl Row {
    fn rate(&self) -> f64 {
        if self.secs > 0.0 {
            self.ops as f64 / self.secs
        } else {
            0.0
        }
    }

    /// (name, value per op) of the counters every row reports.
    fn per_op(&self) -> Vec<(&'static str, f64)> {
        let n = self.ops.max(1) as f64;
        vec![
            (
                "btree_descents",
                self.delta.engine.btree_descents as f64 / n,
            ),
            ("btree_cows", self.delta.engine.btree_cows as f64 / n),
            ("nodes_written", self.delta.engine.nodes_written as f64 / n),
            ("flushes", self.delta.device.flushes as f64 / n),
            ("bytes_written", self.delta.device.bytes_written as f64 / n),
        ]
    }
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("birch-engine-bench: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Res<()> {
    let mut sizes = Sizes::new(args.quick);
    if let Some(n) = args.overwrites {
        sizes.overwrites = n;
    }
    let target = match &args.image {
        Some(path) => Target::Image(path.clone()),
        None => Target::Mem,
    };
    #[cfg(feature = "seed-before")]
    let _ = SWITCHES.set((args.bench_global_objectid_lock, args.bench_apply_per_item));
    let started = Instant::now();
    let mut rows = Vec::new();
    eprintln!("birch-engine-bench on {}", target.describe());
    if args.wants("btree") {
        bench_btree(&target, &sizes, &mut rows)?;
    }
    if args.wants("commit") {
        bench_commits(&target, &sizes, &mut rows)?;
    }
    bench_fs(&target, &sizes, args, &mut rows)?;
    if args.wants("open") {
        bench_open(&target, args, &mut rows)?;
        bench_refcount_map(&mut rows);
    }
    if args.wants("diff") {
        bench_diff(&target, args, &mut rows)?;
    }
    let total = started.elapsed().as_secs_f64();
    let table = table(&rows, &target, args.quick, total);
    if args.json {
        eprint!("{table}");
        println!("{}", json(&rows, &target, args.quick, total));
    } else {
        print!("{table}");
    }
    if let Target::Image(path) = &target {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 1. B-tree

/// One tree on a device, committed by hand the way the engine does it.
struct Tree {
    dev: Arc<dyn BlockDevice>,
    alloc: Allocator,
    cache: NodeCache,
    counters: Counters,
    root: RootPtr,
    generation: u64,
}

impl Tree {
    fn new(dev: Arc<dyn BlockDevice>) -> Res<Tree> {
        let alloc = Allocator::new(dev.size_bytes());
        alloc.mark_used(BlockAddr::new(0), BlockCount::new(64));
        let mut tree = Tree {
            dev,
            alloc,
            cache: NodeCache::new(1 << 17),
            counters: Counters::default(),
            root: RootPtr::default(),
            generation: 1,
        };
        let root = {
            let mut w = TreeWriter::create(tree.ctx(), &tree.alloc, Generation::new(1))?;
            for node in w.write_dirty()? {
                tree.cache.insert(node);
            }
            w.root()
        };
        tree.dev.flush()?;
        tree.root = root;
        Ok(tree)
    }

    fn ctx(&self) -> TreeCtx<'_> {
        TreeCtx {
            device: &*self.dev,
            cache: &self.cache,
            counters: &self.counters,
            fsid: FSID,
            owner: birch_format::FS_TREE_ID,
        }
    }

    fn snap(&self) -> Snap {
        Snap::of(&self.counters, &*self.dev)
    }

    /// Inserts `keys` in generations of `batch`; returns (time in inserts, time in
    /// write-out + flush + release).
    fn insert_all(&mut self, keys: &[Key], value: &[u8], batch: usize) -> Res<(f64, f64)> {
        let (mut t_insert, mut t_commit) = (0.0, 0.0);
        for chunk in keys.chunks(batch) {
            let generation = self.generation + 1;
            let start = Instant::now();
            let mut w = TreeWriter::new(
                self.ctx(),
                &self.alloc,
                Generation::new(generation),
                self.root,
            );
            for key in chunk {
                w.insert(*key, value.to_vec())?;
            }
            let mid = Instant::now();
            for node in w.write_dirty()? {
                self.cache.insert(node);
            }
            let root = w.root();
            drop(w);
            self.dev.flush()?;
            let pinned = self.alloc.take_pinned(Generation::new(generation));
            self.alloc.release(&pinned);
            self.root = root;
            self.generation = generation;
            t_insert += (mid - start).as_secs_f64();
            t_commit += mid.elapsed().as_secs_f64();
        }
        Ok((t_insert, t_commit))
    }

    /// Looks up every key; returns how many were found.
    fn lookup_all(&self, keys: &[Key]) -> Res<usize> {
        let reader = TreeReader {
            ctx: self.ctx(),
            root: self.root,
        };
        let mut found = 0;
        for key in keys {
            if black_box(reader.get(key)?).is_some() {
                found += 1;
            }
        }
        Ok(found)
    }
}

fn bench_btree(target: &Target, sizes: &Sizes, rows: &mut Vec<Row>) -> Res<()> {
    let n = sizes.btree_ops;
    let value = [0xa5u8; 32];
    let mut rng = SmallRng::seed_from_u64(SEED);
    let random: Vec<Key> = (0..n)
        .map(|_| Key::new(rng.gen::<u64>() >> 2, ItemType::InodeItem, 0))
        .collect();
    let sequential: Vec<Key> = (0..n as u64)
        .map(|i| Key::new(256 + i, ItemType::InodeItem, 0))
        .collect();
    for (label, keys) in [("random", random), ("sequential", sequential)] {
        eprintln!("b-tree: {n} {label} inserts ...");
        let mut tree = Tree::new(target.device(2 << 30)?)?;
        let before = tree.snap();
        let (t_insert, t_commit) = tree.insert_all(&keys, &value, sizes.btree_batch)?;
        let delta = tree.snap().since(&before);
        let generations = n.div_ceil(sizes.btree_batch) as f64;
        rows.push(Row {
            section: "btree",
            name: format!("insert {label} (gen every {})", sizes.btree_batch),
            ops: n as u64,
            secs: t_insert + t_commit,
            unit: "inserts/s",
            extra: vec![
                ("inserts_per_s_excl_writeout", n as f64 / t_insert.max(1e-9)),
                ("writeout_share", t_commit / (t_insert + t_commit).max(1e-9)),
                (
                    "nodes_per_generation",
                    delta.engine.nodes_written as f64 / generations,
                ),
                ("tree_levels", f64::from(tree.root.level) + 1.0),
            ],
            delta,
        });
        let mut order = keys.clone();
        if label == "random" {
            order.shuffle(&mut rng);
        } else {
            order.sort_unstable();
        }
        let before = tree.snap();
        let start = Instant::now();
        let found = tree.lookup_all(&order)?;
        let secs = start.elapsed().as_secs_f64();
        let delta = tree.snap().since(&before);
        rows.push(Row {
            section: "btree",
            name: format!("lookup {label} (warm cache)"),
            ops: n as u64,
            secs,
            unit: "lookups/s",
            extra: vec![
                ("found", found as f64),
                (
                    "cache_misses_per_op",
                    delta.engine.cache_misses as f64 / n as f64,
                ),
            ],
            delta,
        });
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 2. Commits

fn bench_commits(target: &Target, sizes: &Sizes, rows: &mut Vec<Row>) -> Res<()> {
    let dev = target.device(2 << 30)?;
    drop(Engine::create(
        dev.clone(),
        &MkfsOptions::default(),
        Vec::new(),
    )?);
    // Reopen, so the node cache is the size a mount gets.
    let engine = Engine::open(dev.clone())?;
    let value = vec![0x3cu8; 160];
    let key = |i: usize| Key::new(256 + i as u64, ItemType::InodeItem, 0);
    let prefill = sizes.commit_prefill;
    eprintln!("commits: prefill {prefill} items ...");
    for lo in (0..prefill).step_by(50_000) {
        {
            let txn = engine.begin()?;
            for i in lo..(lo + 50_000).min(prefill) {
                txn.put(key(i), value.clone());
            }
        }
        engine.commit()?;
    }
    let mut rng = SmallRng::seed_from_u64(SEED ^ 1);
    for (items, max) in [1usize, 100, 10_000].into_iter().zip(sizes.commit_max) {
        eprintln!("commits: {items} item(s) per commit ...");
        let before = Snap::of(engine.counters(), &*dev);
        let wall = Instant::now();
        let mut in_commit = Duration::ZERO;
        let mut commits = 0u64;
        while (commits as usize) < max && (commits < 3 || wall.elapsed() < sizes.commit_budget) {
            let picks = rand::seq::index::sample(&mut rng, prefill, items.min(prefill));
            {
                let txn = engine.begin()?;
                for i in picks {
                    txn.put(key(i), value.clone());
                }
            }
            let start = Instant::now();
            engine.commit()?;
            in_commit += start.elapsed();
            commits += 1;
        }
        let delta = Snap::of(engine.counters(), &*dev).since(&before);
        let node_bytes = delta.engine.nodes_written as f64 * NODE_SIZE as f64 / commits as f64;
        rows.push(Row {
            section: "commit",
            name: format!("commit of {items} changed item(s)"),
            ops: commits,
            secs: in_commit.as_secs_f64(),
            unit: "commits/s",
            extra: vec![
                ("node_bytes_per_commit", node_bytes),
                (
                    "ms_per_commit",
                    in_commit.as_secs_f64() * 1e3 / commits as f64,
                ),
                (
                    "items_per_s",
                    (commits as usize * items) as f64 / in_commit.as_secs_f64(),
                ),
            ],
            delta,
        });
    }
    drop(engine);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 3. Filesystem API

const CHUNKS: usize = 4;

/// Rounds of the create part (medians reported): the machine's noise needs several.
const REPEATS: usize = 5;

fn new_fs(target: &Target, size: u64) -> Res<Filesystem> {
    let dev = target.device(size)?;
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default())?;
    #[cfg(feature = "seed-before")]
    let (bench_global_objectid_lock, bench_apply_per_item) =
        SWITCHES.get().copied().unwrap_or_default();
    Ok(Filesystem::open_device(
        dev,
        OpenOptions {
            commit_interval: None,
            #[cfg(feature = "seed-before")]
            bench_global_objectid_lock,
            #[cfg(feature = "seed-before")]
            bench_apply_per_item,
            ..Default::default()
        },
    )?)
}

fn fs_snap(fs: &Filesystem) -> Snap {
    Snap::of(fs.engine().counters(), &**fs.engine().device())
}

/// Creates `n` empty files in `dir` in CHUNKS parts with a sync after each; returns (time in
/// creates, time in sync).
fn create_files(
    fs: &Filesystem,
    dir: InodeNo,
    n: usize,
    ready: Option<&Barrier>,
) -> Res<(Duration, Duration)> {
    let c = Caller::default();
    if let Some(barrier) = ready {
        barrier.wait();
    }
    let (mut in_create, mut in_sync) = (Duration::ZERO, Duration::ZERO);
    let per = n / CHUNKS;
    for chunk in 0..CHUNKS {
        let start = Instant::now();
        for i in chunk * per..(chunk + 1) * per {
            let name = format!("f{i:07}");
            let (attr, fh) = fs.create(c, dir, name.as_bytes(), 0o644, 0)?;
            fs.release(attr.ino, fh)?;
        }
        let mid = Instant::now();
        fs.sync()?;
        in_create += mid - start;
        in_sync += mid.elapsed();
    }
    Ok((in_create, in_sync))
}

fn fs_row(name: &str, unit: &'static str, ops: usize, secs: f64, in_sync: f64, delta: Snap) -> Row {
    let commits = delta.engine.commits as f64;
    Row {
        section: "fs",
        name: name.to_string(),
        ops: ops as u64,
        secs,
        unit,
        extra: vec![
            ("commits", commits),
            ("commit_share", in_sync / secs.max(1e-9)),
            (
                "commit_wait_share",
                delta.engine.commit_wait_us as f64 / 1e6 / secs.max(1e-9),
            ),
            (
                "commit_help_share",
                delta.engine.commit_help_us as f64 / 1e6 / secs.max(1e-9),
            ),
            ("commit_jobs", delta.engine.commit_jobs as f64),
            ("commit_jobs_helped", delta.engine.commit_jobs_helped as f64),
            (
                "objectid_lock_waits",
                delta.engine.objectid_lock_waits as f64,
            ),
        ],
        delta,
    }
}

/// Writes 4 KiB blocks to one file, `n` in all, in CHUNKS parts with a sync after each; the
/// offset of each write comes from `at` (None = append). Returns (seconds, seconds in sync).
fn write_blocks(
    fs: &Filesystem,
    ino: u64,
    n: usize,
    mut at: impl FnMut() -> Option<u64>,
) -> Res<(f64, f64)> {
    let block = vec![0x77u8; BLOCK_SIZE as usize];
    let start = Instant::now();
    let mut in_sync = Duration::ZERO;
    for _ in 0..CHUNKS {
        for _ in 0..n / CHUNKS {
            match at() {
                Some(offset) => fs.write(InodeNo::new(ino), offset, &block, false)?,
                None => fs.write(InodeNo::new(ino), 0, &block, true)?,
            };
        }
        let t = Instant::now();
        fs.sync()?;
        in_sync += t.elapsed();
    }
    Ok((start.elapsed().as_secs_f64(), in_sync.as_secs_f64()))
}

/// One run of `threads` threads, each creating `n / threads` files in its own directory of a
/// new filesystem. Returns the row (rate over the wall time, commits included).
fn create_run(target: &Target, n: usize, threads: usize) -> Res<Row> {
    let c = Caller::default();
    let fs = new_fs(target, 1 << 30)?;
    let dirs = (0..threads)
        .map(|t| {
            Ok(fs
                .mkdir(c, ROOT_INO, format!("d{t}").as_bytes(), 0o755)?
                .ino)
        })
        .collect::<Res<Vec<InodeNo>>>()?;
    fs.sync()?;
    let per = n / threads;
    let barrier = Barrier::new(threads + 1);
    let before = fs_snap(&fs);
    let (secs, in_create, in_sync) = std::thread::scope(|s| -> Res<(f64, f64, f64)> {
        let workers: Vec<_> = dirs
            .iter()
            .map(|&dir| {
                let (fs, barrier) = (&fs, &barrier);
                s.spawn(move || create_files(fs, dir, per, Some(barrier)))
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let (mut in_create, mut in_sync) = (0.0f64, 0.0f64);
        for w in workers {
            let (create, sync) = w.join().map_err(|_| "create worker panicked")??;
            in_create = in_create.max(create.as_secs_f64());
            in_sync = in_sync.max(sync.as_secs_f64());
        }
        Ok((start.elapsed().as_secs_f64(), in_create, in_sync))
    })?;
    let delta = fs_snap(&fs).since(&before);
    let name = if threads == 1 {
        "create empty file, 1 thread".to_string()
    } else {
        format!("create empty file, {threads} threads / {threads} dirs")
    };
    let ops = per * threads;
    let mut row = fs_row(&name, "creates/s", ops, secs, in_sync, delta);
    row.extra.push((
        "creates_per_s_excl_commit",
        ops as f64 / in_create.max(1e-9),
    ));
    Ok(row)
}

/// What this machine gives two threads that share nothing: each inserts the same number of
/// random keys into its own `BTreeMap` (memory-bound like the creates). Returns the ratio of
/// two threads' throughput to one thread's. A shared, virtualised 2-core machine often gives
/// well under 2; the create scaling is read against this.
fn machine_scaling(keys: usize) -> f64 {
    fn work(keys: usize, seed: u64) -> usize {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut map = std::collections::BTreeMap::new();
        for _ in 0..keys {
            map.insert(rng.gen::<u64>(), [0u8; 64]);
        }
        black_box(map.len())
    }
    let start = Instant::now();
    work(keys, 1);
    let one = start.elapsed().as_secs_f64();
    let start = Instant::now();
    std::thread::scope(|s| {
        let a = s.spawn(|| work(keys, 2));
        let b = s.spawn(|| work(keys, 3));
        let _ = (a.join(), b.join());
    });
    2.0 * one / start.elapsed().as_secs_f64().max(1e-9)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Creates in 1 and in 2 threads, REPEATS rounds interleaved (1 thread, 2 threads, machine
/// calibration), so a slow moment of a shared machine hits both sides; each reported row is
/// the round with the median rate, with the medians of the ratios beside it.
fn bench_creates(target: &Target, sizes: &Sizes, rows: &mut Vec<Row>) -> Res<()> {
    let n = sizes.creates / CHUNKS / 2 * CHUNKS * 2;
    let mut ones: Vec<Row> = Vec::new();
    let mut twos: Vec<Row> = Vec::new();
    let (mut ratios, mut machine) = (Vec::new(), Vec::new());
    for round in 0..REPEATS {
        eprintln!(
            "fs: {n} creates, 1 thread, then 2 threads in 2 directories (round {}/{REPEATS}) ...",
            round + 1
        );
        let one = create_run(target, n, 1)?;
        let two = create_run(target, n, 2)?;
        ratios.push(two.rate() / one.rate().max(1e-9));
        machine.push(machine_scaling(sizes.creates));
        ones.push(one);
        twos.push(two);
    }
    let pick = |mut v: Vec<Row>| -> Option<Row> {
        v.sort_by(|a, b| a.rate().total_cmp(&b.rate()));
        let mid = v.len() / 2;
        v.into_iter().nth(mid)
    };
    let (Some(mut one), Some(mut two)) = (pick(ones), pick(twos)) else {
        return Err("no create rounds ran".into());
    };
    one.extra.push(("rounds", REPEATS as f64));
    two.extra.push(("rounds", REPEATS as f64));
    let scaling = median(ratios);
    let machine = median(machine);
    two.extra.push(("scaling_vs_1_thread", scaling));
    two.extra.push(("machine_scaling", machine));
    two.extra
        .push(("scaling_of_machine_share", scaling / machine.max(1e-9)));
    rows.push(one);
    rows.push(two);
    Ok(())
}

fn bench_fs(target: &Target, sizes: &Sizes, args: &Args, rows: &mut Vec<Row>) -> Res<()> {
    let c = Caller::default();
    if args.wants("create") {
        bench_creates(target, sizes, rows)?;
    }

    if args.wants("append") {
        let n = sizes.appends / CHUNKS * CHUNKS;
        eprintln!("fs: {n} 4 KiB appends ...");
        let fs = new_fs(target, 2 << 30)?;
        let (attr, fh) = fs.create(c, ROOT_INO, b"append", 0o644, 0)?;
        fs.sync()?;
        let before = fs_snap(&fs);
        let (secs, in_sync) = write_blocks(&fs, attr.ino.get(), n, || None)?;
        let delta = fs_snap(&fs).since(&before);
        let mut row = fs_row("append 4 KiB", "writes/s", n, secs, in_sync, delta);
        row.extra
            .push(("MiB_per_s", n as f64 * 4096.0 / secs / (1 << 20) as f64));
        rows.push(row);
        fs.release(attr.ino, fh)?;
    }

    if args.wants("overwrite") {
        let n = sizes.overwrites / CHUNKS * CHUNKS;
        const FILE_BYTES: u64 = 64 << 20;
        eprintln!("fs: {n} 4 KiB random overwrites in a 64 MiB file ...");
        let fs = new_fs(target, 2 << 30)?;
        let (attr, fh) = fs.create(c, ROOT_INO, b"overwrite", 0o644, 0)?;
        let mib = vec![0x11u8; 1 << 20];
        for at in (0..FILE_BYTES).step_by(mib.len()) {
            fs.write(attr.ino, at, &mib, false)?;
        }
        fs.sync()?;
        if args.overwrite_snapshot {
            fs.create_snapshot("bench")?;
        }
        let mut rng = SmallRng::seed_from_u64(SEED ^ 2);
        let before = fs_snap(&fs);
        let (secs, in_sync) = write_blocks(&fs, attr.ino.get(), n, || {
            Some(rng.gen_range(0..FILE_BYTES / BLOCK_SIZE) * BLOCK_SIZE)
        })?;
        let delta = fs_snap(&fs).since(&before);
        let mut row = fs_row(
            if args.overwrite_snapshot {
                "random overwrite 4 KiB in 64 MiB, after a snapshot"
            } else {
                "random overwrite 4 KiB in 64 MiB"
            },
            "writes/s",
            n,
            secs,
            in_sync,
            delta,
        );
        let (extents, _) = count_extents(&fs, attr.ino.get())?;
        row.extra.push(("file_extents_after", extents as f64));
        rows.push(row);
        fs.release(attr.ino, fh)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 5. Diff of two snapshots (DESIGN §15.8)

/// `--only diff`: see the module doc, part 5.
fn bench_diff(target: &Target, args: &Args, rows: &mut Vec<Row>) -> Res<()> {
    let c = Caller::default();
    let files = if args.quick {
        args.diff_files.min(20_000)
    } else {
        args.diff_files
    };
    let files = files.max(1000) / 1000 * 1000;
    let size = ((files as u64 * 2048 + (1 << 30)) / BLOCK_SIZE) * BLOCK_SIZE;
    eprintln!(
        "diff: building {files} files on a {} MiB device ...",
        size >> 20
    );
    let fs = new_fs(target, size)?;
    let bytes = vec![0x5au8; 100];
    let mut inos = Vec::with_capacity(files);
    let start = Instant::now();
    for d in 0..files / 1000 {
        let dir = fs
            .mkdir(c, ROOT_INO, format!("d{d:05}").as_bytes(), 0o755)?
            .ino;
        for i in 0..1000 {
            let (attr, fh) = fs.create(c, dir, format!("f{i:04}").as_bytes(), 0o644, 0)?;
            fs.write(attr.ino, 0, &bytes, false)?;
            fs.release(attr.ino, fh)?;
            inos.push(attr.ino);
        }
        if (d + 1) % 100 == 0 {
            fs.sync()?;
        }
    }
    fs.create_snapshot("before")?;
    let build = start.elapsed().as_secs_f64();
    let mut rng = SmallRng::seed_from_u64(SEED ^ 0xd1ff);
    let changed = args.diff_changed.min(files);
    for ino in inos.choose_multiple(&mut rng, changed) {
        fs.write(*ino, 0, b"changed", false)?;
    }
    fs.create_snapshot("after")?;
    let dev = fs.engine().base_device().clone();
    let after_root = fs
        .engine()
        .snapshots()
        .into_iter()
        .find(|s| s.name == "after")
        .ok_or("no snapshot after")?
        .root;
    fs.close()?;
    drop(fs);
    eprintln!("diff: built in {build:.1} s");
    for (name, whole) in [
        (
            format!("diff before..after, {changed} of {files} files changed"),
            false,
        ),
        (
            format!("diff of every node of {files} files (against an empty tree)"),
            true,
        ),
    ] {
        let mut secs = Vec::new();
        let mut last = None;
        for _ in 0..3 {
            // A cold node cache: a fresh engine (its open walks the live tree and fills the
            // cache with what it read; the walk below counts device reads from here).
            let engine = Engine::open(dev.clone())?;
            engine.clear_node_cache();
            let before = engine.counters().values();
            let t = Instant::now();
            let (changes, stats) = if whole {
                engine.diff_roots(RootPtr::default(), after_root)?
            } else {
                engine.diff("before", Some("after"))?
            };
            secs.push(t.elapsed().as_secs_f64());
            let after = engine.counters().values();
            last = Some((
                changes.len(),
                stats,
                after.cache_misses - before.cache_misses,
            ));
        }
        let (paths, stats, device_reads) = last.ok_or("no repeat ran")?;
        let secs = median(secs);
        rows.push(Row {
            section: "diff",
            name,
            ops: stats.nodes_read,
            secs,
            unit: "nodes/s",
            delta: Snap::default(),
            extra: vec![
                ("files", files as f64),
                ("changed", changed as f64),
                ("paths", paths as f64),
                ("ms", secs * 1e3),
                ("nodes_read_by_walk", stats.nodes_read as f64),
                ("shared_skipped", stats.shared_skipped as f64),
                ("node_device_reads", device_reads as f64),
                ("build_s", build),
            ],
        });
    }
    Ok(())
}

// 4. Open walk with retained older roots (docs/DECISIONS.md, "Measurements behind the reference-tracking decision")

/// Times `f` `OPEN_REPEATS` times and returns the median seconds and the last result.
fn timed<T>(mut f: impl FnMut() -> Res<T>) -> Res<(f64, T)> {
    const OPEN_REPEATS: usize = 3;
    let mut secs = Vec::new();
    let mut last = None;
    for _ in 0..OPEN_REPEATS {
        let start = Instant::now();
        last = Some(f()?);
        secs.push(start.elapsed().as_secs_f64());
    }
    let last = last.ok_or("no repeat ran")?;
    Ok((median(secs), last))
}

fn walk_row(name: String, secs: f64, walk: &UnionWalk, roots: usize, files: usize) -> Row {
    Row {
        section: "open",
        name,
        ops: walk.nodes_read,
        secs,
        unit: "nodes/s",
        delta: Snap::default(),
        extra: vec![
            ("files", files as f64),
            ("roots", roots as f64),
            ("ms", secs * 1e3),
            ("nodes_read", walk.nodes_read as f64),
            ("nodes_shared", walk.nodes_shared as f64),
            ("extents", walk.extents as f64),
            ("data_blocks", walk.data_blocks as f64),
            ("data_blocks_again", walk.data_blocks_again as f64),
            ("counted_blocks", walk.counted_blocks as f64),
        ],
    }
}

/// An image of `--open-files` files of one 4 KiB block each (1,000 to a directory); the
/// open walk's time with the newest tree alone, then after `--open-snapshots` rounds of
/// "keep the committed root (its reader pins every block later commits free), overwrite 1%
/// of the files at random, commit": the union of the kept roots and the newest tree walked
/// once per distinct node ([`union_walk`]), against the sum of the trees walked one by one.
/// Every walk is cold (a fresh node cache; on `--image`, O_DIRECT reads). Also the real
/// [`Engine::open`] of the image (the newest tree and its backup roots) before the rounds.
fn bench_open(target: &Target, args: &Args, rows: &mut Vec<Row>) -> Res<()> {
    let c = Caller::default();
    let files = if args.quick {
        args.open_files.min(20_000)
    } else {
        args.open_files
    };
    let files = files.max(1000) / 1000 * 1000;
    let snapshots = args.open_snapshots;
    let change = (files / 100).max(1);
    let data = (files + snapshots * change) as u64 * BLOCK_SIZE;
    // Metadata: a tree takes about 800 bytes of nodes per file, the union of 11 trees about
    // 2,300 (measured with 20,000 files); room for the commits' copies on top.
    let meta = files as u64 * (1200 + 200 * snapshots as u64);
    let size = (data + meta + (1 << 30)) / BLOCK_SIZE * BLOCK_SIZE;
    eprintln!(
        "open: building {files} files of 4 KiB on a {} MiB device ...",
        size >> 20
    );
    let fs = new_fs(target, size)?;
    let block = vec![0x5au8; BLOCK_SIZE as usize];
    let start = Instant::now();
    let mut inos = Vec::with_capacity(files);
    for d in 0..files / 1000 {
        let dir = fs
            .mkdir(c, ROOT_INO, format!("d{d:05}").as_bytes(), 0o755)?
            .ino;
        for i in 0..1000 {
            let (attr, fh) = fs.create(c, dir, format!("f{i:04}").as_bytes(), 0o644, 0)?;
            fs.write(attr.ino, 0, &block, false)?;
            fs.release(attr.ino, fh)?;
            inos.push(attr.ino);
        }
        if (d + 1) % 100 == 0 {
            fs.sync()?;
        }
    }
    fs.sync()?;
    let build = start.elapsed().as_secs_f64();
    eprintln!("open: built in {build:.1} s");
    let engine = fs.engine().clone();
    let dev = engine.base_device().clone();
    let fsid = engine.fsid();
    let total = dev.size_bytes();

    let (secs, opened) = timed(|| Ok(Engine::open(dev.clone())?.counters().values()))?;
    rows.push(Row {
        section: "open",
        name: "Engine::open, newest tree + backups".to_string(),
        ops: opened.cache_misses,
        secs,
        unit: "nodes/s",
        delta: Snap::default(),
        extra: vec![
            ("files", files as f64),
            ("ms", secs * 1e3),
            ("build_s", build),
        ],
    });
    // The aim of DESIGN §15.8: a snapshot of an idle filesystem costs an empty commit plus at most
    // 1 ms and writes the same whatever the tree's size (the list's leaf and the
    // superblock). Each timed three times (median); the snapshots are deleted again.
    let (empty_secs, _) = timed(|| {
        engine.commit()?;
        Ok(())
    })?;
    let before = Snap::of(engine.counters(), &*dev);
    let mut made = 0;
    let (snap_secs, _) = timed(|| {
        made += 1;
        fs.create_snapshot(&format!("idle{made}"))?;
        Ok(())
    })?;
    let delta = Snap::of(engine.counters(), &*dev).since(&before);
    rows.push(Row {
        section: "open",
        name: "snapshot create, idle filesystem".to_string(),
        ops: 1,
        secs: snap_secs,
        unit: "snapshots/s",
        extra: vec![
            ("files", files as f64),
            ("ms", snap_secs * 1e3),
            ("empty_commit_ms", empty_secs * 1e3),
            (
                "nodes_written_each",
                delta.engine.nodes_written as f64 / 3.0,
            ),
            (
                "bytes_written_each",
                delta.device.bytes_written as f64 / 3.0,
            ),
        ],
        delta: Snap::default(),
    });
    for n in 1..=made {
        fs.delete_snapshot(&format!("idle{n}"))?;
    }
    let live = engine.committed_root().root;
    for count in [false, true] {
        let (secs, walk) = timed(|| Ok(union_walk(&*dev, fsid, total, &[live], count)?))?;
        let name = format!(
            "union walk, 0 snapshots{}",
            if count { ", all refs counted" } else { "" }
        );
        rows.push(walk_row(name, secs, &walk, 1, files));
    }

    let mut rng = SmallRng::seed_from_u64(SEED ^ 15);
    let mut kept = Vec::new();
    let (mut in_writes, mut in_sync) = (0.0, 0.0);
    for round in 0..snapshots {
        // A real snapshot of this commit (its creation changes no fs item, so its tree is
        // the committed root kept beside it for the union walks).
        fs.create_snapshot(&format!("round{round}"))?;
        kept.push(engine.committed_root());
        let t = Instant::now();
        for ino in inos.choose_multiple(&mut rng, change) {
            fs.write(*ino, 0, &block, false)?;
        }
        let mid = Instant::now();
        fs.sync()?;
        in_writes += (mid - t).as_secs_f64();
        in_sync += mid.elapsed().as_secs_f64();
        eprintln!("open: round {}/{snapshots} done", round + 1);
    }
    let overwrites = (snapshots * change).max(1) as f64;
    // The real open path with the snapshots: the live tree, the list, every snapshot's tree
    // (each distinct node once) and the backups.
    let (secs, opened) = timed(|| Ok(Engine::open(dev.clone())?.counters().values()))?;
    rows.push(Row {
        section: "open",
        name: format!("Engine::open, {snapshots} snapshots"),
        ops: opened.cache_misses,
        secs,
        unit: "nodes/s",
        delta: Snap::default(),
        extra: vec![("files", files as f64), ("ms", secs * 1e3)],
    });
    let mut roots = vec![engine.committed_root().root];
    roots.extend(kept.iter().rev().map(|k| k.root));
    for count in [false, true] {
        let (secs, walk) = timed(|| Ok(union_walk(&*dev, fsid, total, &roots, count)?))?;
        let name = format!(
            "union walk, {snapshots} snapshots{}",
            if count { ", all refs counted" } else { "" }
        );
        let mut row = walk_row(name, secs, &walk, roots.len(), files);
        if !count {
            row.extra
                .push(("overwrite_us_excl_commit", in_writes / overwrites * 1e6));
            row.extra.push((
                "overwrite_us_incl_commit",
                (in_writes + in_sync) / overwrites * 1e6,
            ));
        }
        rows.push(row);
    }
    // Without the dedupe: every tree walked on its own.
    let start = Instant::now();
    let mut sum = UnionWalk::default();
    for root in &roots {
        let walk = union_walk(&*dev, fsid, total, &[*root], false)?;
        sum.nodes_read += walk.nodes_read;
        sum.extents += walk.extents;
        sum.data_blocks += walk.data_blocks;
    }
    let secs = start.elapsed().as_secs_f64();
    rows.push(walk_row(
        format!("{} trees walked one by one", roots.len()),
        secs,
        &sum,
        roots.len(),
        files,
    ));

    // Candidate A's COW-path cost, approximated: one more item per freed extent (a back
    // reference) in the delta and in the commit, in a random leaf of a tree as large as the
    // file tree (an extent tree holds an item per extent): here an item beside a random
    // file's items, deleted again afterwards.
    let refs = change;
    let keys: Vec<Key> = inos
        .choose_multiple(&mut rng, refs)
        .map(|ino| Key::new(ino.get(), ItemType::Xattr, 0x15))
        .collect();
    rows.push(extra_items_row(
        &engine,
        &keys,
        "one extra item per freed extent, random leaf",
    )?);
    // The same number of items appended in key order past every file (a dead list: one
    // entry per freed extent a snapshot keeps, keyed by the freeing generation and address),
    // deleted again afterwards.
    let keys: Vec<Key> = (0..refs as u64)
        .map(|i| Key::new(1 << 40, ItemType::Xattr, i))
        .collect();
    rows.push(extra_items_row(
        &engine,
        &keys,
        "one extra item per freed extent, appended",
    )?);
    drop(kept);
    fs.close()?;
    Ok(())
}

/// One row of candidate A's or B's COW-path cost: `keys` put (40-byte values) and committed,
/// timed, then deleted and committed again (untimed).
fn extra_items_row(engine: &Engine, keys: &[Key], name: &str) -> Res<Row> {
    let start = Instant::now();
    {
        let txn = engine.begin()?;
        for key in keys {
            txn.put(*key, vec![0u8; 40]);
        }
    }
    engine.commit()?;
    let secs = start.elapsed().as_secs_f64();
    {
        let txn = engine.begin()?;
        for key in keys {
            txn.delete(*key);
        }
    }
    engine.commit()?;
    Ok(Row {
        section: "open",
        name: name.to_string(),
        ops: keys.len() as u64,
        secs,
        unit: "items/s",
        delta: Snap::default(),
        extra: vec![("us_per_item_incl_commit", secs / keys.len() as f64 * 1e6)],
    })
}

/// The COW-path cost of an in-memory reference-count map (docs/DECISIONS.md, "Reference tracking for snapshots and clones"): a look-up per freed
/// extent in a `HashMap<u64, u32>` of 1,000 and of 1,000,000 counted blocks, for absent keys
/// (the common case: the block is not shared) and for present ones (a decrement).
fn bench_refcount_map(rows: &mut Vec<Row>) {
    use std::collections::HashMap;
    const LOOKUPS: usize = 2_000_000;
    let mut rng = SmallRng::seed_from_u64(SEED ^ 16);
    for entries in [1_000usize, 1_000_000] {
        let mut map: HashMap<u64, u32> = HashMap::with_capacity(entries);
        let keys: Vec<u64> = (0..entries).map(|_| rng.gen::<u64>() >> 12).collect();
        for k in &keys {
            map.insert(*k, 2);
        }
        let probes: Vec<u64> = (0..LOOKUPS).map(|_| rng.gen::<u64>() >> 12).collect();
        let start = Instant::now();
        let mut found = 0u64;
        for p in &probes {
            if let Some(n) = map.get_mut(p) {
                *n -= 1;
                found += 1;
            }
        }
        black_box(found);
        let miss = start.elapsed().as_secs_f64();
        let hits: Vec<u64> = (0..LOOKUPS).map(|i| keys[i % entries]).collect();
        let start = Instant::now();
        for p in &hits {
            if let Some(n) = map.get_mut(p) {
                *n = n.wrapping_add(1);
            }
        }
        black_box(&map);
        let hit = start.elapsed().as_secs_f64();
        rows.push(Row {
            section: "open",
            name: format!("refcount map look-up, {entries} entries"),
            ops: LOOKUPS as u64,
            secs: miss,
            unit: "lookups/s",
            delta: Snap::default(),
            extra: vec![
                ("ns_absent", miss / LOOKUPS as f64 * 1e9),
                ("ns_present", hit / LOOKUPS as f64 * 1e9),
            ],
        });
    }
}

/// Number of extent items of `ino` (and their total bytes), read through the engine.
fn count_extents(fs: &Filesystem, ino: u64) -> Res<(usize, usize)> {
    let lo = Key::new(ino, ItemType::ExtentData, 0);
    let hi = Key::new(ino, ItemType::ExtentData, u64::MAX);
    let items = fs.engine().range(&lo, &hi, usize::MAX)?;
    Ok((items.len(), items.iter().map(|(_, v)| v.len()).sum()))
}

// ---------------------------------------------------------------------------------------------
// Output

fn short(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.4}")
    }
}

fn table(rows: &[Row], target: &Target, quick: bool, total: f64) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "birch-engine-bench: {}{}, total {total:.1} s",
        target.describe(),
        if quick { ", --quick" } else { "" }
    );
    let _ = writeln!(
        out,
        "{:<7} {:<40} {:>9} {:>8} {:>12} {:<10} {:>8} {:>8} {:>9} {:>9} {:>10}",
        "part",
        "benchmark",
        "ops",
        "secs",
        "rate",
        "unit",
        "desc/op",
        "cows/op",
        "nodes/op",
        "flush/op",
        "bytes/op"
    );
    for row in rows {
        let p = row.per_op();
        let _ = writeln!(
            out,
            "{:<7} {:<40} {:>9} {:>8.3} {:>12.0} {:<10} {:>8} {:>8} {:>9} {:>9} {:>10}",
            row.section,
            row.name,
            row.ops,
            row.secs,
            row.rate(),
            row.unit,
            short(p[0].1),
            short(p[1].1),
            short(p[2].1),
            short(p[3].1),
            short(p[4].1),
        );
        let extra: Vec<String> = row
            .extra
            .iter()
            .map(|(k, v)| format!("{k}={}", short(*v)))
            .collect();
        let _ = writeln!(out, "{:<7} {:<40}   {}", "", "", extra.join("  "));
    }
    let _ = writeln!(
        out,
        "(part commit: ops = commits, per-op columns are per commit; bytes/op = device bytes incl. data and superblocks)"
    );
    out
}

fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn json_num(v: f64) -> String {
    if v.is_finite() {
        format!("{v}")
    } else {
        "null".into()
    }
}

fn json_map(pairs: &[(&str, f64)]) -> String {
    let inner: Vec<String> = pairs
        .iter()
        .map(|(k, v)| format!("{}: {}", json_str(k), json_num(*v)))
        .collect();
    format!("{{{}}}", inner.join(", "))
}

fn json(rows: &[Row], target: &Target, quick: bool, total: f64) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{{");
    let _ = writeln!(out, "  \"target\": {},", json_str(&target.describe()));
    let _ = writeln!(out, "  \"quick\": {quick},");
    let _ = writeln!(out, "  \"total_seconds\": {},", json_num(total));
    let _ = writeln!(out, "  \"results\": [");
    for (i, row) in rows.iter().enumerate() {
        let _ = writeln!(
            out,
            "    {{\"section\": {}, \"name\": {}, \"ops\": {}, \"seconds\": {}, \"rate\": {}, \"unit\": {}, \"per_op\": {}, \"extra\": {}}}{}",
            json_str(row.section),
            json_str(&row.name),
            row.ops,
            json_num(row.secs),
            json_num(row.rate()),
            json_str(row.unit),
            json_map(&row.per_op()),
            json_map(&row.extra),
            if i + 1 < rows.len() { "," } else { "" }
        );
    }
    let _ = writeln!(out, "  ]");
    let _ = write!(out, "}}");
    out
}
