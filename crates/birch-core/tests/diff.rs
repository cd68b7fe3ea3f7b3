//! `birch diff` (DESIGN §15.8): the paths that changed between two snapshots, or a snapshot
//! and the live tree, against a model (two dumps of the tree compared path by path), also
//! after a rollback; and its cost: a small change in a large tree reads few nodes.
//!
//! Seeds: `BIRCH_SEED=N` replays one model case; `BIRCH_DIFF_CASES` scales the run.

#![allow(clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use birch_core::device::{BlockDevice, MemDevice};
use birch_core::diff::PathChange;
use birch_core::vfs::{Caller, SetAttr};
use birch_core::Filesystem;
use birch_format::InodeNo;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// A changed item as the diff reports it: key, old value, new value.
type Change = (birch_format::Key, Option<Vec<u8>>, Option<Vec<u8>>);

const ROOT: birch_format::InodeNo = birch_format::ROOT_INO;
const DEVICE_BYTES: u64 = 64 << 20;

type Lines = BTreeSet<(char, String)>;

/// The lines a model expects between two dumps: `-` only before, `+` only after, `M` in both
/// and different.
fn model_lines(
    before: &BTreeMap<String, common::Seen>,
    after: &BTreeMap<String, common::Seen>,
) -> Lines {
    let mut out = Lines::new();
    for (path, seen) in before {
        match after.get(path) {
            None => {
                out.insert(('-', path.clone()));
            }
            Some(now) if now != seen => {
                out.insert(('M', path.clone()));
            }
            Some(_) => {}
        }
    }
    for path in after.keys() {
        if !before.contains_key(path) {
            out.insert(('+', path.clone()));
        }
    }
    out
}

/// The diff's lines in the model's terms: a rename is its `-` and `+`; a path both removed
/// and created (another inode under the same name) is an `M`.
fn diff_lines(changes: &[PathChange]) -> Lines {
    let mut out = Lines::new();
    for change in changes {
        match change {
            PathChange::Created(p) => out.insert(('+', p.clone())),
            PathChange::Removed(p) => out.insert(('-', p.clone())),
            PathChange::Modified(p) => out.insert(('M', p.clone())),
            PathChange::Renamed(from, to) => {
                out.insert(('-', from.clone()));
                out.insert(('+', to.clone()))
            }
        };
    }
    // The model sees a moved inode's new path as new, whatever else changed.
    let created: Vec<String> = out
        .iter()
        .filter(|(c, _)| *c == '+')
        .map(|(_, p)| p.clone())
        .collect();
    for p in created {
        out.remove(&('M', p));
    }
    let both: Vec<String> = out
        .iter()
        .filter(|(c, p)| *c == '-' && out.contains(&('+', p.clone())))
        .map(|(_, p)| p.clone())
        .collect();
    for p in both {
        out.remove(&('-', p.clone()));
        out.remove(&('+', p.clone()));
        out.remove(&('M', p.clone()));
        out.insert(('M', p));
    }
    out
}

/// The inode of `path`, looked up name by name.
fn lookup(fs: &Filesystem, path: &str) -> Option<u64> {
    let mut ino = ROOT;
    for name in path.split('/').filter(|n| !n.is_empty()) {
        ino = fs.lookup(ino, name.as_bytes()).ok()?.ino;
    }
    Some(ino.get())
}

fn split(path: &str) -> (&str, &str) {
    let at = path.rfind('/').expect("a slash");
    (if at == 0 { "/" } else { &path[..at] }, &path[at + 1..])
}

/// One random change to the tree: writes, new files and directories, unlinks, renames to
/// new names, hard links, chmod, xattrs.
fn change(fs: &Filesystem, rng: &mut SmallRng, step: u64) {
    if step >= 60 {
        // Inode times come from a coarse clock (a tick of up to 4 ms): a tick between
        // changes lets the model see, by its mtime, a directory that got an entry and lost
        // it again (the diff sees its entry counter move).
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let files: Vec<String> = common::tree(fs, false)
        .into_iter()
        .filter(|(_, s)| s.0 == "File")
        .map(|(p, _)| p)
        .collect();
    let dirs: Vec<String> = common::tree(fs, false)
        .into_iter()
        .filter(|(_, s)| s.0 == "Dir")
        .map(|(p, _)| p)
        .collect();
    let dir = &dirs[rng.gen_range(0..dirs.len())];
    let dir_ino = lookup(fs, dir).expect("dir");
    let fresh = format!("n{step}x{}", rng.gen_range(0..1000));
    let file = (!files.is_empty()).then(|| files[rng.gen_range(0..files.len())].clone());
    match (rng.gen_range(0..9), file) {
        (0, _) | (_, None) => {
            let (attr, fh) = fs
                .create(
                    Caller::default(),
                    InodeNo::new(dir_ino),
                    fresh.as_bytes(),
                    0o644,
                    0,
                )
                .expect("create");
            fs.write(
                attr.ino,
                0,
                &vec![step as u8; rng.gen_range(0..9000)],
                false,
            )
            .expect("write");
            fs.release(attr.ino, fh).expect("release");
        }
        (1, _) => {
            fs.mkdir(
                Caller::default(),
                InodeNo::new(dir_ino),
                fresh.as_bytes(),
                0o755,
            )
            .expect("mkdir");
        }
        (2, Some(f)) => {
            let ino = lookup(fs, &f).expect("file");
            fs.write(
                InodeNo::new(ino),
                rng.gen_range(0..5000),
                &[step as u8; 700],
                false,
            )
            .expect("write");
        }
        (3, Some(f)) => {
            let (parent, name) = split(&f);
            fs.unlink(
                InodeNo::new(lookup(fs, parent).expect("parent")),
                name.as_bytes(),
            )
            .expect("unlink");
        }
        (4, Some(f)) => {
            let (parent, name) = split(&f);
            fs.rename(
                InodeNo::new(lookup(fs, parent).expect("parent")),
                name.as_bytes(),
                InodeNo::new(dir_ino),
                fresh.as_bytes(),
                0,
            )
            .expect("rename");
        }
        (5, Some(f)) => {
            let ino = lookup(fs, &f).expect("file");
            fs.link(InodeNo::new(ino), InodeNo::new(dir_ino), fresh.as_bytes())
                .expect("link");
        }
        (6, Some(f)) => {
            let ino = lookup(fs, &f).expect("file");
            fs.setattr(
                InodeNo::new(ino),
                &SetAttr {
                    mode: Some(0o600 + rng.gen_range(0..8u32)),
                    ..Default::default()
                },
            )
            .expect("chmod");
        }
        (7, Some(f)) => {
            let ino = lookup(fs, &f).expect("file");
            fs.setxattr(
                InodeNo::new(ino),
                b"user.k",
                format!("v{step}").as_bytes(),
                0,
            )
            .expect("setxattr");
        }
        (_, Some(f)) => {
            let ino = lookup(fs, &f).expect("file");
            fs.setattr(
                InodeNo::new(ino),
                &SetAttr {
                    size: Some(rng.gen_range(0..3000)),
                    ..Default::default()
                },
            )
            .expect("truncate");
        }
    }
}

fn diff(dev: &Arc<MemDevice>, from: &str, to: Option<&str>) -> Vec<PathChange> {
    let fs = common::open_quiet(dev);
    let (changes, _) = fs.engine().diff(from, to).expect("diff");
    fs.close().expect("close");
    changes
}

fn model_case(seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    for step in 0..60 {
        change(&fs, &mut rng, step);
    }
    fs.create_snapshot("a").expect("snapshot");
    let a = common::tree(&fs, true);
    for step in 60..60 + rng.gen_range(1..30) {
        change(&fs, &mut rng, step);
        if rng.gen_range(0..5) == 0 {
            fs.sync().expect("sync");
        }
    }
    fs.create_snapshot("b").expect("snapshot");
    let b = common::tree(&fs, true);
    fs.close().expect("close");
    drop(fs);
    let expected = model_lines(&a, &b);
    assert_eq!(
        diff_lines(&diff(&dev, "a", Some("b"))),
        expected,
        "seed {seed}: a..b"
    );
    assert_eq!(
        diff_lines(&diff(&dev, "a", None)),
        expected,
        "seed {seed}: a..live"
    );
    assert_eq!(
        diff_lines(&diff(&dev, "b", Some("a"))),
        model_lines(&b, &a),
        "seed {seed}: b..a"
    );
    // Roll back to a: the live root is a's root; then change on.
    let engine = birch_core::Engine::open(dev.clone() as Arc<dyn BlockDevice>).expect("open");
    engine.rollback("a", true).expect("rollback");
    drop(engine);
    assert!(
        diff(&dev, "a", None).is_empty(),
        "seed {seed}: after the rollback"
    );
    let fs = common::open_quiet(&dev);
    for step in 100..100 + rng.gen_range(1..20) {
        change(&fs, &mut rng, step);
    }
    fs.create_snapshot("c").expect("snapshot");
    let c = common::tree(&fs, true);
    for step in 200..205 {
        change(&fs, &mut rng, step);
    }
    fs.sync().expect("sync");
    let live = common::tree(&fs, true);
    fs.close().expect("close");
    drop(fs);
    assert_eq!(
        diff_lines(&diff(&dev, "a", Some("c"))),
        model_lines(&a, &c),
        "seed {seed}: a..c after the rollback"
    );
    assert_eq!(
        diff_lines(&diff(&dev, "c", None)),
        model_lines(&c, &live),
        "seed {seed}: c..live after the rollback"
    );
}

#[test]
fn diff_matches_the_model() {
    let cases = std::env::var("BIRCH_DIFF_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20u64);
    for seed in birch_testkit::seeds::cases("diff model", 0xd1ff_0000, cases) {
        model_case(seed);
    }
}

#[test]
fn a_small_change_in_a_large_tree_reads_few_nodes() {
    let (dev, fs) = common::fresh(DEVICE_BYTES * 2);
    let dir = fs
        .mkdir(Caller::default(), ROOT, b"d", 0o755)
        .expect("mkdir")
        .ino;
    let mut inos = Vec::new();
    for i in 0..20_000 {
        let (attr, fh) = fs
            .create(
                Caller::default(),
                dir,
                format!("f{i:05}").as_bytes(),
                0o644,
                0,
            )
            .expect("create");
        fs.release(attr.ino, fh).expect("release");
        inos.push(attr.ino);
    }
    fs.create_snapshot("before").expect("snapshot");
    for i in (0..20_000).step_by(2_000) {
        fs.write(inos[i], 0, b"changed", false).expect("write");
    }
    fs.create_snapshot("after").expect("snapshot");
    fs.close().expect("close");
    drop(fs);
    // A cold cache: a fresh engine (its open walked the live tree only).
    let engine = birch_core::Engine::open(dev.clone() as Arc<dyn BlockDevice>).expect("open");
    let before = engine.counters().values();
    let (changes, stats) = engine.diff("before", Some("after")).expect("diff");
    let after = engine.counters().values();
    let modified: Vec<&PathChange> = changes
        .iter()
        .filter(|c| matches!(c, PathChange::Modified(_)))
        .collect();
    assert_eq!(modified.len(), 10, "{changes:?}");
    // Every node of the tree, for scale: its diff against an empty tree.
    let root = engine
        .snapshots()
        .into_iter()
        .find(|s| s.name == "after")
        .expect("after")
        .root;
    let total = engine
        .diff_roots(Default::default(), root)
        .expect("whole tree")
        .1
        .nodes_read;
    let reads = (after.cache_hits + after.cache_misses) - (before.cache_hits + before.cache_misses);
    eprintln!(
        "diff of 10 changed files in 20,000: {} nodes read by the walk ({} shared subtrees \
         skipped), {reads} node reads in all (paths included), of {total} nodes in the tree",
        stats.nodes_read, stats.shared_skipped
    );
    assert!(
        stats.nodes_read * 10 < total,
        "{} of {total}",
        stats.nodes_read
    );
    assert!(reads * 5 < total, "{reads} of {total}");
}

/// The in-step walk against a full comparison, on raw trees of random shapes: each tree a
/// few commits of random inserts, updates and deletes after the one before (so they share
/// subtrees at every level), compared in both orders, with itself, and with an unrelated
/// tree (nothing shared).
#[test]
fn the_in_step_walk_finds_every_changed_item() {
    use birch_core::alloc::Allocator;
    use birch_core::btree::{TreeCtx, TreeReader, TreeWriter};
    use birch_core::cache::NodeCache;
    use birch_core::counters::Counters;
    use birch_core::diff::changed_items;
    use birch_format::superblock::RootPtr;
    use birch_format::{BlockAddr, BlockCount, Generation, Key};

    let device = MemDevice::new(512 << 20);
    let alloc = Allocator::new(512 << 20);
    alloc.mark_used(BlockAddr::new(0), BlockCount::new(32));
    let cache = NodeCache::new(1 << 16);
    let counters = Counters::default();
    let ctx = TreeCtx {
        device: &device,
        cache: &cache,
        counters: &counters,
        fsid: [3; 16],
        owner: 5,
    };
    let key = |n: u64| Key {
        objectid: n / 8,
        item_type: 108,
        offset: n % 8,
    };
    let items = |root: RootPtr| -> BTreeMap<Key, Vec<u8>> {
        if root.addr == 0 {
            return BTreeMap::new();
        }
        TreeReader { ctx, root }
            .range(
                &Key::new(0, birch_format::ItemType::InodeItem, 0),
                &Key::new(u64::MAX, birch_format::ItemType::Snapshot, u64::MAX),
                usize::MAX,
            )
            .expect("range")
            .into_iter()
            .collect()
    };
    let mut generation = 1;
    let mut build = |rng: &mut SmallRng, from: Option<RootPtr>, changes: usize, span: u64| {
        generation += 1;
        let mut w = match from {
            Some(root) => TreeWriter::new(ctx, &alloc, Generation::new(generation), root),
            None => TreeWriter::create(ctx, &alloc, Generation::new(generation)).expect("create"),
        };
        for _ in 0..changes {
            let k = key(rng.gen_range(0..span));
            if rng.gen_range(0..4) == 0 {
                w.delete(&k).expect("delete");
            } else {
                let len = rng.gen_range(1..200);
                w.insert(k, vec![rng.gen::<u8>(); len]).expect("insert");
            }
        }
        w.write_dirty().expect("write");
        w.root()
    };
    let mut skipped = 0;
    for seed in 0..12u64 {
        let mut rng = SmallRng::seed_from_u64(0xd1ff_7000 + seed);
        let span = [200, 3_000, 20_000][seed as usize % 3];
        let base = build(&mut rng, None, span as usize, span);
        let mut roots = vec![base];
        for _ in 0..4 {
            let last = *roots.last().expect("a root");
            let n = [1, 10, 300, 3_000][rng.gen_range(0..4)];
            roots.push(build(&mut rng, Some(last), n, span));
        }
        roots.push(build(&mut rng, None, span as usize / 2, span));
        roots.push(RootPtr::default());
        for &a in &roots {
            for &b in &roots {
                let (changes, stats) = changed_items(ctx, a, b).expect("walk");
                skipped += stats.shared_skipped;
                let (old, new) = (items(a), items(b));
                let mut expected = Vec::new();
                let keys: BTreeSet<&Key> = old.keys().chain(new.keys()).collect();
                for k in keys {
                    let (o, n) = (old.get(k), new.get(k));
                    if o != n {
                        expected.push((*k, o.cloned(), n.cloned()));
                    }
                }
                let got: Vec<Change> = changes.into_iter().map(|c| (c.key, c.old, c.new)).collect();
                assert_eq!(got, expected, "seed {seed}: {a:?} -> {b:?}");
            }
        }
    }
    assert!(skipped > 1000, "shared subtrees skipped: {skipped}");
}

/// A clone flags its source's extents shared without changing its bytes: the diff lists the
/// clone (and its directory), not its source (the source's extent items differ only in the
/// flag).
#[test]
fn a_clone_source_is_not_listed_as_modified() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    let make = |name: &str| {
        let (attr, fh) = fs
            .create(Caller::default(), ROOT, name.as_bytes(), 0o644, 0)
            .expect("create");
        fs.release(attr.ino, fh).expect("release");
        attr.ino
    };
    let a = make("a");
    fs.write(a, 0, &vec![0x5A; 64 << 10], false)
        .expect("write a");
    fs.create_snapshot("before").expect("snapshot");
    let b = make("b");
    assert_eq!(
        fs.copy_file_range(a, 0, b, 0, 64 << 10).expect("clone"),
        64 << 10
    );
    fs.create_snapshot("after").expect("snapshot");
    fs.close().expect("close");
    drop(fs);
    let changes = diff(&dev, "before", Some("after"));
    let lines: Vec<String> = changes.iter().map(ToString::to_string).collect();
    assert_eq!(lines, ["M /", "+ /b"], "{changes:?}");
}
