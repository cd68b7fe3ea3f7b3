//! Snapshots (DESIGN §15): made at a commit, kept through later overwrites, deletes, crashes
//! and reopens, checked by fsck, and deleted with their space given back. A seeded model test
//! takes snapshots at random points, keeps each snapshot's expected files, and after every step
//! compares the live filesystem and every snapshot (read through a view of its root) with them.
//!
//! Odd seeds run every commit's apply as parallel jobs (the assembly's `retire` path).
//! Seeds: `BIRCH_SEED=N` replays one model case; `BIRCH_SNAP_CASES` and `BIRCH_SNAP_OPS` scale
//! the run (default 6 cases x 150 steps).

#![allow(clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use birch_core::check::{check, CheckOptions, FindingKind};
use birch_core::device::{BlockDevice, MemDevice};
use birch_core::vfs::Caller;
use birch_core::{Error, Filesystem};
use birch_format::items::{decode_dir_entries, ExtentKind, FileExtent, InodeItem};
use birch_format::superblock::INCOMPAT_SNAPSHOTS;
use birch_format::{InodeNo, ItemType, Key, BLOCK_SIZE};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const ROOT: birch_format::InodeNo = birch_format::ROOT_INO;
const DEVICE_BYTES: u64 = 64 << 20;

type Files = BTreeMap<String, Vec<u8>>;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Writes `content` as file `name` in the root (created, or truncated and rewritten).
fn put(fs: &Filesystem, name: &str, content: &[u8]) {
    let ino = match fs.lookup(ROOT, name.as_bytes()) {
        Ok(attr) => {
            fs.setattr(
                attr.ino,
                &birch_core::vfs::SetAttr {
                    size: Some(0),
                    ..Default::default()
                },
            )
            .expect("truncate");
            attr.ino
        }
        Err(_) => {
            let (attr, fh) = fs
                .create(Caller::default(), ROOT, name.as_bytes(), 0o644, 0)
                .expect("create");
            fs.release(attr.ino, fh).expect("release");
            attr.ino
        }
    };
    if !content.is_empty() {
        fs.write(ino, 0, content, false).expect("write");
    }
}

/// Every file of the root directory, read through the filesystem.
fn live_files(fs: &Filesystem) -> Files {
    let mut files = Files::new();
    for (name, ino) in root_entries(&|lo, hi| {
        fs.engine()
            .range(lo, hi, usize::MAX)
            .expect("range")
            .into_iter()
            .map(|(k, v)| (k, v.to_vec()))
            .collect()
    }) {
        let size = fs.getattr(InodeNo::new(ino)).expect("getattr").size;
        let data = fs.read(InodeNo::new(ino), 0, size as usize).expect("read");
        files.insert(name, data);
    }
    files
}

/// Reads the items between two keys (of the live tree or a snapshot).
type RangeReader<'a> = dyn Fn(&Key, &Key) -> Vec<(Key, Vec<u8>)> + 'a;

/// The (name, inode) entries of the root directory, from a range reader; `fill` (the model
/// test's directory of filler files) left out.
fn root_entries(range: &RangeReader<'_>) -> Vec<(String, u64)> {
    let lo = Key::new(ROOT.get(), ItemType::DirIndex, 0);
    let hi = Key::new(ROOT.get(), ItemType::DirIndex, u64::MAX);
    range(&lo, &hi)
        .into_iter()
        .flat_map(|(_, v)| decode_dir_entries(&v).expect("dir index"))
        .map(|e| (String::from_utf8_lossy(&e.name).into_owned(), e.child))
        .filter(|(name, _)| name != "fill")
        .collect()
}

/// Every file of the root directory in snapshot `id`, read through a view of its root: names
/// from the dir index, sizes from the inode items, bytes from the extents (data blocks read
/// from the device).
fn snapshot_files(fs: &Filesystem, dev: &dyn BlockDevice, id: u64) -> Files {
    let view = fs.engine().snapshot_view(id).expect("snapshot view");
    let range = |lo: &Key, hi: &Key| view.range(lo, hi, usize::MAX).expect("snapshot range");
    let mut files = Files::new();
    for (name, ino) in root_entries(&range) {
        let inode = view
            .get(&Key::new(ino, ItemType::InodeItem, 0))
            .expect("get")
            .expect("inode item");
        let inode = InodeItem::decode(&inode).expect("inode");
        let mut data = vec![0u8; inode.size as usize];
        let lo = Key::new(ino, ItemType::ExtentData, 0);
        let hi = Key::new(ino, ItemType::ExtentData, u64::MAX);
        for (key, value) in range(&lo, &hi) {
            let extent = FileExtent::decode(&value).expect("extent");
            let at = key.offset as usize;
            let bytes = match extent.kind {
                ExtentKind::Inline(bytes) => bytes,
                ExtentKind::Regular { disk_addr, csums } => {
                    let mut buf = vec![0u8; csums.len() * BLOCK_SIZE as usize];
                    dev.read_at(&mut buf, disk_addr).expect("read block");
                    buf
                }
                ExtentKind::Prealloc { .. } => continue,
                ExtentKind::Blob(blob) => panic!("no build writes blobs yet: {blob:?}"),
            };
            let end = (at + bytes.len()).min(data.len());
            if at < end {
                data[at..end].copy_from_slice(&bytes[..end - at]);
            }
        }
        files.insert(name, data);
    }
    files
}

fn fsck_clean(dev: &MemDevice, what: &str) {
    let report = check(dev, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{what}: {:?}", report.findings);
}

fn content(rng: &mut SmallRng, seed: u8) -> Vec<u8> {
    let len = match rng.gen_range(0..4) {
        0 => rng.gen_range(0..100),
        1 => rng.gen_range(1000..3000),
        2 => BLOCK_SIZE as usize * rng.gen_range(1..4),
        _ => rng.gen_range(5000..40000),
    };
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn a_snapshot_keeps_what_the_live_tree_overwrites_and_deletes() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    put(&fs, "a", &[1u8; 20000]);
    put(&fs, "b", &[2u8; 9000]);
    put(&fs, "c", b"small");
    let before = live_files(&fs);
    let snap = fs.create_snapshot("first").expect("snapshot");
    assert_eq!(snap.id, 1);
    assert!(fs.engine().superblock().incompat & INCOMPAT_SNAPSHOTS != 0);
    put(&fs, "a", &[3u8; 12000]);
    fs.unlink(ROOT, b"b").expect("unlink");
    put(&fs, "d", &[4u8; 5000]);
    fs.sync().expect("sync");
    assert!(fs.engine().allocator().kept_blocks().get() > 0);
    assert_eq!(snapshot_files(&fs, &*dev, snap.id), before);
    let live = live_files(&fs);
    assert_eq!(live.get("a"), Some(&vec![3u8; 12000]));
    assert!(!live.contains_key("b"));
    common::close_and_check_clean(fs, &dev, "after overwrites");
    let fs = common::open_quiet(&dev);
    let list = fs.engine().snapshots();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].name, "first");
    assert_eq!(list[0].generation, snap.generation);
    assert_eq!(snapshot_files(&fs, &*dev, snap.id), before);
    assert_eq!(live_files(&fs), live);
    // Writes after the reopen must not take the snapshot's blocks.
    for i in 0..20 {
        put(&fs, &format!("n{i}"), &[9u8; 16384]);
    }
    fs.sync().expect("sync");
    assert_eq!(snapshot_files(&fs, &*dev, snap.id), before);
    common::close_and_check_clean(fs, &dev, "after writes on the reopened image");
}

#[test]
fn snapshot_names_are_checked() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    assert!(matches!(fs.create_snapshot(""), Err(Error::Invalid(_))));
    assert!(matches!(fs.create_snapshot("a/b"), Err(Error::Invalid(_))));
    assert!(matches!(fs.create_snapshot("."), Err(Error::Invalid(_))));
    assert!(matches!(fs.create_snapshot(".."), Err(Error::Invalid(_))));
    assert!(matches!(fs.create_snapshot("a\0b"), Err(Error::Invalid(_))));
    let long = "x".repeat(256);
    assert!(matches!(
        fs.create_snapshot(&long),
        Err(Error::NameTooLong(_))
    ));
    fs.create_snapshot(&"y".repeat(255)).expect("255 bytes");
    fs.create_snapshot("one").expect("create");
    assert!(matches!(fs.create_snapshot("one"), Err(Error::Exists(_))));
    assert!(matches!(
        fs.delete_snapshot("none"),
        Err(Error::NotFound(_))
    ));
    // Ids are never reused.
    fs.delete_snapshot("one").expect("delete");
    let again = fs.create_snapshot("one").expect("create again");
    assert_eq!(again.id, 3);
    common::close_and_check_clean(fs, &dev, "names");
}

#[test]
fn an_image_without_snapshots_keeps_its_superblock_bytes() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    put(&fs, "a", &[1u8; 9000]);
    fs.sync().expect("sync");
    let sb = fs.engine().superblock();
    assert_eq!(sb.incompat & INCOMPAT_SNAPSHOTS, 0);
    let mut bytes = vec![0u8; 4096];
    dev.read_at(
        &mut bytes,
        birch_format::superblock::SUPER_OFFSETS[sb.slot()],
    )
    .expect("read superblock");
    assert!(bytes[336..].iter().all(|b| *b == 0));
    assert_eq!(fs.engine().allocator().kept_blocks().get(), 0);
    common::close_and_check_clean(fs, &dev, "no snapshots");
}

/// Bytes written by a snapshot of an idle filesystem of `files` files.
fn idle_snapshot_bytes(files: usize) -> u64 {
    let (_dev, fs) = common::fresh(DEVICE_BYTES * 2);
    for i in 0..files {
        put(&fs, &format!("f{i:05}"), b"x");
    }
    fs.sync().expect("sync");
    let before = fs.engine().device().counters().values();
    fs.create_snapshot("idle").expect("snapshot");
    let after = fs.engine().device().counters().values();
    fs.close().expect("close");
    after.bytes_written - before.bytes_written
}

#[test]
fn a_snapshot_of_an_idle_filesystem_writes_the_same_whatever_the_tree_size() {
    let small = idle_snapshot_bytes(10);
    let large = idle_snapshot_bytes(3000);
    assert_eq!(small, large);
    // One list leaf and one superblock.
    assert_eq!(small, 16384 + 4096);
}

#[test]
fn deleting_a_snapshot_gives_its_space_back() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    put(&fs, "big", &vec![5u8; 4 << 20]);
    fs.sync().expect("sync");
    let free_before = fs.statfs().bfree;
    fs.create_snapshot("s").expect("snapshot");
    put(&fs, "big", &vec![6u8; 4 << 20]);
    fs.sync().expect("sync");
    let free_held = fs.statfs().bfree;
    assert!(
        free_held + 1000 < free_before,
        "the snapshot holds the old 1024 blocks: {free_held} vs {free_before}"
    );
    fs.delete_snapshot("s").expect("delete");
    fs.sync().expect("sync");
    let free_after = fs.statfs().bfree;
    assert!(
        free_after + 16 >= free_before,
        "space back: {free_after} vs {free_before} (held {free_held})"
    );
    assert!(fs.engine().snapshots().is_empty());
    common::close_and_check_clean(fs, &dev, "after the deletion");
    let fs = common::open_quiet(&dev);
    let reopened = fs.statfs().bfree;
    assert!(reopened + 16 >= free_before, "{reopened} vs {free_before}");
    common::close_and_check_clean(fs, &dev, "reopened");
}

#[test]
fn deleting_the_middle_snapshot_keeps_its_neighbours_whole() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    let mut kept: Vec<(u64, Files)> = Vec::new();
    for round in 0..4u8 {
        put(&fs, "a", &vec![round; 9000 + round as usize * 4096]);
        put(&fs, &format!("r{round}"), &vec![round; 5000]);
        if round == 2 {
            fs.unlink(ROOT, b"r0").expect("unlink");
        }
        let snap = fs.create_snapshot(&format!("s{round}")).expect("snapshot");
        kept.push((snap.id, live_files(&fs)));
    }
    put(&fs, "a", b"final");
    fs.sync().expect("sync");
    fs.delete_snapshot("s1").expect("delete s1");
    fs.delete_snapshot("s2").expect("delete s2");
    for (id, files) in [&kept[0], &kept[3]] {
        assert_eq!(&snapshot_files(&fs, &*dev, *id), files, "snapshot {id}");
    }
    common::close_and_check_clean(fs, &dev, "after deleting the middle");
    let fs = common::open_quiet(&dev);
    for (id, files) in [&kept[0], &kept[3]] {
        assert_eq!(&snapshot_files(&fs, &*dev, *id), files, "snapshot {id}");
    }
    fs.delete_snapshot("s0").expect("delete s0");
    fs.delete_snapshot("s3").expect("delete s3");
    common::close_and_check_clean(fs, &dev, "all deleted");
}

#[test]
fn a_crash_after_a_snapshot_keeps_it_intact() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    put(&fs, "a", &[1u8; 30000]);
    put(&fs, "b", &[2u8; 7000]);
    let expected = live_files(&fs);
    let snap = fs.create_snapshot("before").expect("snapshot");
    put(&fs, "a", &[3u8; 30000]);
    fs.unlink(ROOT, b"b").expect("unlink");
    // No commit: the power goes.
    let (crashed, fs) = common::crash_and_reopen(fs, &dev);
    fsck_clean(&crashed, "after the crash");
    assert_eq!(snapshot_files(&fs, &*crashed, snap.id), expected);
    // Delete it, commit: the blocks only it held come back.
    let free_held = fs.statfs().bfree;
    put(&fs, "a", &[4u8; 30000]);
    fs.sync().expect("sync");
    fs.delete_snapshot("before").expect("delete");
    fs.sync().expect("sync");
    assert!(fs.statfs().bfree > free_held, "space returned");
    common::close_and_check_clean(fs, &crashed, "deleted after the crash");
}

#[test]
fn fsck_names_a_damaged_snapshot_tree() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    put(&fs, "a", &[1u8; 9000]);
    let snap = fs.create_snapshot("s").expect("snapshot");
    put(&fs, "a", &[2u8; 9000]);
    fs.sync().expect("sync");
    fs.close().expect("close");
    drop(fs);
    fsck_clean(&dev, "before the damage");
    let mut block = vec![0u8; 4096];
    dev.read_at(&mut block, snap.root.addr).expect("read");
    block[100..164].fill(0xAB);
    dev.write_at(&block, snap.root.addr)
        .expect("damage the snapshot's root");
    let report = check(&*dev, CheckOptions::default()).expect("fsck");
    assert!(
        report
            .findings
            .iter()
            .any(|f| f.kind == FindingKind::SnapshotTreeDamaged),
        "{:?}",
        report.findings
    );
    // The open refuses the image rather than hand out the snapshot's blocks.
    let opened = Filesystem::open_device(
        dev.clone() as Arc<dyn BlockDevice>,
        birch_core::OpenOptions {
            commit_interval: None,
            ..Default::default()
        },
    );
    assert!(opened.is_err());
}

/// One model case: random writes, unlinks, commits, snapshots, snapshot deletions and
/// reopens; every snapshot's files and the live files compared after every step.
/// One `copy_file_range` step of the model with clones: a random range of a live file into
/// another (or the same) file, at offsets that share blocks three times in four; the model
/// copies the bytes. Returns false when the step does nothing (no source, or a range that
/// overlaps itself, which the kernel refuses).
fn clone_step(fs: &Filesystem, rng: &mut SmallRng, live: &mut Files, dst_name: &str) -> bool {
    let names: Vec<String> = live.keys().cloned().collect();
    if names.is_empty() {
        return false;
    }
    let src_name = names[rng.gen_range(0..names.len())].clone();
    let src = live[&src_name].clone();
    let bs = BLOCK_SIZE as usize;
    let src_off = match rng.gen_range(0..3) {
        0 => 0,
        1 => rng.gen_range(0..4) * bs,
        _ => rng.gen_range(0..src.len().max(1)),
    };
    let len = match rng.gen_range(0..3) {
        0 => src.len(),
        1 => rng.gen_range(1..6) * bs,
        _ => rng.gen_range(1..20000),
    };
    let dst_off = if rng.gen_range(0..4) == 0 {
        rng.gen_range(0..30000)
    } else {
        rng.gen_range(0..6) * bs + src_off % bs
    };
    let n = len.min(src.len().saturating_sub(src_off));
    if src_name == dst_name && n > 0 && src_off < dst_off + n && dst_off < src_off + n {
        return false;
    }
    let src_ino = fs.lookup(ROOT, src_name.as_bytes()).expect("lookup").ino;
    let dst_ino = match fs.lookup(ROOT, dst_name.as_bytes()) {
        Ok(attr) => attr.ino,
        Err(_) => {
            let (attr, fh) = fs
                .create(Caller::default(), ROOT, dst_name.as_bytes(), 0o644, 0)
                .expect("create");
            fs.release(attr.ino, fh).expect("release");
            live.insert(dst_name.to_string(), Vec::new());
            attr.ino
        }
    };
    let got = fs
        .copy_file_range(src_ino, src_off as u64, dst_ino, dst_off as u64, len as u64)
        .expect("copy_file_range");
    assert_eq!(
        got, n as u64,
        "copy_file_range {src_name}@{src_off} -> {dst_name}@{dst_off} x {len}"
    );
    if n > 0 {
        let dst = live.get_mut(dst_name).expect("dst");
        if dst.len() < dst_off + n {
            dst.resize(dst_off + n, 0);
        }
        dst[dst_off..dst_off + n].copy_from_slice(&src[src_off..src_off + n]);
    }
    if rng.gen_range(0..3) == 0 {
        fs.fsync(dst_ino, false).expect("fsync");
    }
    true
}

fn model_case(seed: u64, steps: u64, clones: bool) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let (mut dev, mut fs) = common::fresh(DEVICE_BYTES);
    // Odd seeds cut every commit's apply into jobs, so the nodes the assembly replaces go
    // through TreeWriter::retire (the parallel path's free) as well as cow.
    let parallel = seed % 2 == 1;
    let mut jobs = 0;
    if parallel {
        fs.engine().set_parallel_apply_min(1);
        // A tree of many leaves (items outside the root directory the model compares), so
        // the apply has subtrees to cut.
        let fill = fs
            .mkdir(Caller::default(), ROOT, b"fill", 0o755)
            .expect("mkdir")
            .ino;
        for i in 0..400 {
            let (attr, fh) = fs
                .create(
                    Caller::default(),
                    fill,
                    format!("f{i}").as_bytes(),
                    0o644,
                    0,
                )
                .expect("create");
            fs.release(attr.ino, fh).expect("release");
        }
        fs.sync().expect("sync");
    }
    let mut live = Files::new();
    let mut snaps: BTreeMap<String, (u64, Files)> = BTreeMap::new();
    let mut made = 0u64;
    let mut rollbacks = 0u64;
    for step in 0..steps {
        let what = rng.gen_range(0..100);
        let name = format!("{}", (b'a' + rng.gen_range(0..6u8)) as char);
        match what {
            // With clones, a fifth of the writes become copy_file_range steps (drawn only
            // then: the cases without clones keep their sequences).
            0..=19 if clones => {
                clone_step(&fs, &mut rng, &mut live, &name);
            }
            0..=44 => {
                let data = content(&mut rng, step as u8);
                put(&fs, &name, &data);
                live.insert(name, data);
            }
            45..=59 => {
                if live.remove(&name).is_some() {
                    fs.unlink(ROOT, name.as_bytes()).expect("unlink");
                }
            }
            60..=69 => fs.sync().expect("sync"),
            70..=81 => {
                made += 1;
                let snap_name = format!("s{made}");
                let snap = fs.create_snapshot(&snap_name).expect("snapshot");
                snaps.insert(snap_name, (snap.id, live.clone()));
            }
            82..=89 => {
                if let Some(victim) = snaps.keys().nth(rng.gen_range(0..snaps.len().max(1))) {
                    let victim = victim.clone();
                    fs.delete_snapshot(&victim).expect("delete");
                    snaps.remove(&victim);
                }
            }
            90..=93 => {
                jobs += fs.engine().counters().values().commit_jobs;
                common::close_and_check_clean(fs, &dev, &format!("seed {seed} step {step}"));
                fs = common::open_quiet(&dev);
                if parallel {
                    fs.engine().set_parallel_apply_min(1);
                }
            }
            94..=96 if !snaps.is_empty() => {
                // birch rollback -r to a random snapshot on the closed image.
                jobs += fs.engine().counters().values().commit_jobs;
                let target = snaps
                    .keys()
                    .nth(rng.gen_range(0..snaps.len()))
                    .cloned()
                    .expect("a snapshot");
                common::close_and_check_clean(fs, &dev, &format!("seed {seed} step {step}"));
                rollback(&dev, &target, true).expect("rollback");
                rollbacks += 1;
                fsck_clean(
                    &dev,
                    &format!("seed {seed} step {step}: rollback to {target}"),
                );
                let (id, files) = snaps[&target].clone();
                snaps.retain(|_, (other, _)| *other <= id);
                live = files;
                fs = common::open_quiet(&dev);
                if parallel {
                    fs.engine().set_parallel_apply_min(1);
                }
            }
            _ => {
                jobs += fs.engine().counters().values().commit_jobs;
                let (crashed, reopened) = common::crash_and_reopen(fs, &dev);
                fsck_clean(&crashed, &format!("seed {seed} step {step} crash"));
                // Uncommitted changes are gone: the model follows what the image kept.
                live = live_files(&reopened);
                dev = crashed;
                fs = reopened;
                if parallel {
                    fs.engine().set_parallel_apply_min(1);
                }
                let listed: Vec<String> = fs
                    .engine()
                    .snapshots()
                    .into_iter()
                    .map(|s| s.name)
                    .collect();
                snaps.retain(|name, _| listed.contains(name));
            }
        }
        assert_eq!(live_files(&fs), live, "seed {seed} step {step}: live files");
        for (name, (id, files)) in &snaps {
            assert_eq!(
                &snapshot_files(&fs, &*dev, *id),
                files,
                "seed {seed} step {step}: snapshot {name}"
            );
        }
    }
    jobs += fs.engine().counters().values().commit_jobs;
    eprintln!("seed {seed}: {made} snapshots, {rollbacks} rollbacks");
    assert!(
        !parallel || jobs > 0,
        "seed {seed}: no commit ran parallel jobs"
    );
    common::close_and_check_clean(fs, &dev, &format!("seed {seed} end"));
}

#[test]
fn snapshots_match_their_models() {
    let steps = env("BIRCH_SNAP_OPS", 150);
    let cases = env("BIRCH_SNAP_CASES", 6);
    for seed in birch_testkit::seeds::cases("snapshot model", 0x5a9_0000, cases) {
        eprintln!("snapshot model case seed {seed}");
        model_case(seed, steps, false);
    }
}

/// The same model with `copy_file_range` steps (clones within and between files, aligned and
/// not, some fsync'd) among the writes, unlinks, snapshots, deletions, reopens and crashes:
/// every snapshot and the live files match their models after every step, fsck (with data)
/// is clean at every reopen and crash. `BIRCH_CLONE_SEED=N` replays one case.
#[test]
fn snapshots_and_clones_match_their_models() {
    if let Some(seed) = std::env::var("BIRCH_CLONE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        model_case(seed, env("BIRCH_SNAP_OPS", 150), true);
        return;
    }
    let cases = env("BIRCH_SNAP_CASES", 6);
    let steps = env("BIRCH_SNAP_OPS", 150);
    for case in 0..cases {
        let seed = 0xc10_0000 + case;
        eprintln!("snapshot and clone model case seed {seed}");
        model_case(seed, steps, true);
    }
}

fn tree(fs: &Filesystem) -> BTreeMap<String, common::Seen> {
    common::tree(fs, false)
}

fn mkfile(fs: &Filesystem, parent: u64, name: &str, data: &[u8]) -> u64 {
    let (attr, fh) = fs
        .create(
            Caller::default(),
            InodeNo::new(parent),
            name.as_bytes(),
            0o644,
            0,
        )
        .expect("create");
    if !data.is_empty() {
        fs.write(attr.ino, 0, data, false).expect("write");
    }
    fs.release(attr.ino, fh).expect("release");
    attr.ino.get()
}

/// `birch rollback` on the unmounted image on `dev`: an engine of its own, dropped after.
fn rollback(
    dev: &Arc<MemDevice>,
    name: &str,
    destroy_newer: bool,
) -> birch_core::Result<Vec<String>> {
    let engine = birch_core::Engine::open(dev.clone() as Arc<dyn BlockDevice>)?;
    let result = engine
        .rollback(name, destroy_newer)
        .map(|(_, deleted)| deleted);
    // The blocks the rollback gave back, as this engine counts them, against a fresh open's
    // derivation of the same image: no leak, no double free.
    if result.is_ok() {
        engine.commit().expect("commit");
        let counted = engine.allocator().free_blocks() + engine.allocator().pinned_blocks();
        let fresh = birch_core::Engine::open(
            Arc::new(MemDevice::from_bytes(dev.snapshot())) as Arc<dyn BlockDevice>
        )
        .expect("fresh open");
        // Blocks of shared (cloned) extents that only the replaced tree named come back at
        // the rollback too (the deletion walk reads the new live tree for them).
        assert_eq!(
            counted,
            fresh.allocator().free_blocks(),
            "free blocks after the rollback against a fresh open"
        );
    }
    drop(engine);
    result
}

#[test]
fn rollback_restores_the_snapshot_exactly() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    let d = fs
        .mkdir(Caller::default(), ROOT, b"d", 0o755)
        .expect("mkdir")
        .ino;
    let e = fs
        .mkdir(Caller::default(), d, b"e", 0o700)
        .expect("mkdir")
        .ino;
    let a = mkfile(&fs, ROOT.get(), "a", &[1u8; 20000]);
    mkfile(&fs, d.get(), "b", &[2u8; 9000]);
    mkfile(&fs, e.get(), "c", b"small");
    fs.link(InodeNo::new(a), d, b"a-link").expect("link");
    fs.setxattr(InodeNo::new(a), b"user.one", b"first", 0)
        .expect("setxattr");
    fs.setxattr(d, b"user.dir", &[7u8; 300], 0)
        .expect("setxattr");
    // A file unlinked while open when the snapshot is made: an orphan in its tree.
    let (orphan, fh) = fs
        .create(Caller::default(), ROOT, b"orphan", 0o644, 0)
        .expect("create");
    fs.write(orphan.ino, 0, &[3u8; 12288], false)
        .expect("write");
    fs.unlink(ROOT, b"orphan").expect("unlink");
    let expected = tree(&fs);
    let snap = fs.create_snapshot("s").expect("snapshot");
    let orphan_range = (
        birch_format::Key::new(birch_format::ORPHAN_OBJECTID, ItemType::Orphan, 0),
        birch_format::Key::new(birch_format::ORPHAN_OBJECTID, ItemType::Orphan, u64::MAX),
    );
    let in_snapshot = fs
        .engine()
        .snapshot_view(snap.id)
        .expect("view")
        .range(&orphan_range.0, &orphan_range.1, usize::MAX)
        .expect("range");
    assert_eq!(in_snapshot.len(), 1, "the snapshot keeps the orphan");
    fs.release(orphan.ino, fh).expect("release");
    // Change everything after it.
    put(&fs, "a", &[9u8; 40000]);
    fs.setxattr(InodeNo::new(a), b"user.one", b"second", 0)
        .expect("setxattr");
    fs.setxattr(InodeNo::new(a), b"user.two", b"new", 0)
        .expect("setxattr");
    fs.removexattr(d, b"user.dir").expect("removexattr");
    fs.unlink(e, b"c").expect("unlink");
    fs.rmdir(d, b"e").expect("rmdir");
    fs.rename(d, b"b", ROOT, b"b-moved", 0).expect("rename");
    let mut max_ino = a;
    for i in 0..30 {
        max_ino = max_ino.max(mkfile(&fs, ROOT.get(), &format!("n{i}"), &[i as u8; 16384]));
    }
    common::close_and_check_clean(fs, &dev, "before the rollback");
    let free_before_rollback = {
        let fs = common::open_quiet(&dev);
        let free = fs.statfs().bfree;
        fs.close().expect("close");
        free
    };
    assert_eq!(
        rollback(&dev, "s", false).expect("rollback"),
        Vec::<String>::new()
    );
    fsck_clean(&dev, "after the rollback");
    let fs = common::open_quiet(&dev);
    assert_eq!(tree(&fs), expected, "the rolled-back tree");
    // The open reclaimed the snapshot's orphan in the live tree: the sharing-aware free kept
    // its blocks for the snapshot (a fresh open derives the same free space).
    fs.sync().expect("sync");
    let orphans = fs
        .engine()
        .range(&orphan_range.0, &orphan_range.1, usize::MAX)
        .expect("orphans");
    assert!(orphans.is_empty(), "orphan reclaimed at the open");
    let counted = fs.engine().allocator().free_blocks() + fs.engine().allocator().pinned_blocks();
    let fresh = birch_core::Engine::open(
        Arc::new(MemDevice::from_bytes(dev.snapshot())) as Arc<dyn BlockDevice>
    )
    .expect("fresh open");
    assert_eq!(
        counted,
        fresh.allocator().free_blocks(),
        "orphan's blocks kept"
    );
    drop(fresh);
    assert!(
        fs.statfs().bfree > free_before_rollback + 30 * 4,
        "the new files' blocks came back"
    );
    assert_eq!(fs.engine().snapshots().len(), 1, "the snapshot stays");
    // Ids are never reused.
    let fresh = mkfile(&fs, ROOT.get(), "after", &[5u8; 8192]);
    assert!(
        fresh > max_ino,
        "ino {fresh} after the rollback, {max_ino} used before"
    );
    put(&fs, "a", &[6u8; 30000]);
    fs.unlink(d, b"b").expect("unlink");
    let mut after = tree(&fs);
    common::close_and_check_clean(fs, &dev, "writes after the rollback");
    let fs = common::open_quiet(&dev);
    assert_eq!(tree(&fs), after, "reopened after writes");
    // The snapshot is still whole, and a second rollback returns to it.
    fs.close().expect("close");
    drop(fs);
    rollback(&dev, "s", false).expect("second rollback");
    let fs = common::open_quiet(&dev);
    assert_eq!(tree(&fs), expected, "the second rollback");
    after.clear();
    fs.delete_snapshot("s").expect("delete");
    common::close_and_check_clean(fs, &dev, "snapshot deleted after the rollbacks");
}

#[test]
fn rollback_refuses_newer_snapshots_unless_told_to_destroy_them() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    put(&fs, "a", &[1u8; 9000]);
    let first = tree(&fs);
    fs.create_snapshot("s1").expect("snapshot");
    put(&fs, "a", &[2u8; 20000]);
    put(&fs, "b", &[3u8; 20000]);
    fs.create_snapshot("s2").expect("snapshot");
    fs.create_snapshot("s2b")
        .expect("snapshot of the same tree");
    put(&fs, "b", &[4u8; 30000]);
    put(&fs, "c", &[5u8; 5000]);
    fs.close().expect("close");
    drop(fs);
    match rollback(&dev, "s1", false) {
        Err(Error::Exists(what)) => assert!(what.contains("s2"), "{what}"),
        other => panic!("rollback with newer snapshots: {other:?}"),
    }
    assert!(matches!(
        rollback(&dev, "none", false),
        Err(Error::NotFound(_))
    ));
    fsck_clean(&dev, "after the refusals");
    let deleted = rollback(&dev, "s1", true).expect("rollback -r");
    assert_eq!(deleted, vec!["s2".to_string(), "s2b".to_string()]);
    fsck_clean(&dev, "after rollback -r");
    let fs = common::open_quiet(&dev);
    assert_eq!(tree(&fs), first);
    let names: Vec<String> = fs
        .engine()
        .snapshots()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, vec!["s1".to_string()]);
    put(&fs, "z", &[8u8; 12000]);
    common::close_and_check_clean(fs, &dev, "writes after rollback -r");
}

#[test]
fn a_crash_during_or_right_after_the_rollback_leaves_one_state_or_the_other() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    put(&fs, "a", &[1u8; 30000]);
    let old_state = {
        fs.create_snapshot("s").expect("snapshot");
        tree(&fs)
    };
    put(&fs, "a", &[2u8; 30000]);
    put(&fs, "b", &[3u8; 50000]);
    let newer = tree(&fs);
    fs.close().expect("close");
    drop(fs);
    let base = dev.snapshot();
    dev.start_recording();
    rollback(&dev, "s", false).expect("rollback");
    let writes = dev.take_recording();
    // Every prefix of what the rollback wrote, as the device may have kept it.
    let mut states = 0;
    for cut in 0..=writes.len() {
        let image = MemDevice::from_bytes(base.clone());
        for w in &writes[..cut] {
            if let birch_core::device::Recorded::Write { offset, bytes } = w {
                image.write_at(bytes, *offset).expect("write");
            }
        }
        image.flush().expect("flush");
        let image = Arc::new(image);
        fsck_clean(&image, &format!("cut at {cut} of {}", writes.len()));
        let fs = common::open_quiet(&image);
        let seen = tree(&fs);
        assert!(
            seen == old_state || seen == newer,
            "cut at {cut}: neither state"
        );
        common::close_and_check_clean(fs, &image, &format!("cut at {cut}: closed"));
        states += 1;
    }
    assert!(states >= 2);
    let crashed = Arc::new(dev.crash());
    let fs = common::open_quiet(&crashed);
    assert_eq!(tree(&fs), old_state, "crash right after the rollback");
    common::close_and_check_clean(fs, &crashed, "crash after the rollback");
}

#[test]
fn the_space_only_a_snapshot_holds_is_what_its_deletion_gives_back() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    for i in 0..40 {
        put(&fs, &format!("f{i}"), &[i as u8; 3 * 4096]);
    }
    fs.create_snapshot("s1").expect("snapshot");
    for i in 0..10 {
        put(&fs, &format!("f{i}"), &[100 + i as u8; 5 * 4096]);
    }
    put(&fs, "g", &[7u8; 40000]);
    fs.create_snapshot("s2").expect("snapshot");
    fs.create_snapshot("s3")
        .expect("a snapshot of the same tree");
    for i in 5..20 {
        put(&fs, &format!("f{i}"), &[200 + i as u8; 2 * 4096]);
    }
    fs.unlink(ROOT, b"g").expect("unlink");
    fs.sync().expect("sync");
    let space = fs.engine().snapshot_space().expect("space");
    let by_name: BTreeMap<String, u64> = space.into_iter().map(|(s, b)| (s.name, b)).collect();
    // s2 and s3 share one tree: neither alone holds anything.
    assert_eq!(by_name["s2"], 0, "{by_name:?}");
    assert_eq!(by_name["s3"], 0, "{by_name:?}");
    assert!(by_name["s1"] >= 10 * 3 * 4096, "{by_name:?}");
    for name in ["s1", "s3", "s2"] {
        let expect = fs
            .engine()
            .snapshot_space()
            .expect("space")
            .into_iter()
            .find(|(s, _)| s.name == name)
            .expect("listed")
            .1;
        if name == "s2" {
            // Alone now: the blocks of f5..f9 and g that the live tree dropped.
            assert!(expect >= (5 * 5 + 10) * 4096, "s2 alone: {expect}");
        }
        let before = fs.statfs().bfree;
        fs.delete_snapshot(name).expect("delete");
        fs.sync().expect("sync");
        let after = fs.statfs().bfree;
        // The list's leaf is rewritten (same size) while a snapshot remains; the last
        // deletion frees the list's node too.
        let list_node = if fs.engine().snapshots().is_empty() {
            birch_format::NODE_BLOCKS
        } else {
            0
        };
        assert_eq!(
            (after - before) * BLOCK_SIZE,
            expect + list_node * BLOCK_SIZE,
            "deleting {name}"
        );
    }
    common::close_and_check_clean(fs, &dev, "after the deletions");
}
