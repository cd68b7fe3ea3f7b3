//! `fsck --repair` (DESIGN §13.4): each finding kind repair handles is made on purpose on a
//! small image (an nlink bumped, an inode's names removed, an inode item deleted, an extent
//! pointed past the device, the newest tree's root node corrupted), repaired, and then a
//! second check must be clean and the data that could be kept must read back. Preen must
//! leave what loses data; a dry run must not write; a repair whose writes fail must leave the
//! image as it was (copy-on-write: the old superblock still names the old tree).

#![allow(clippy::expect_used)]

use std::sync::Arc;

use birch_core::check::{check, CheckOptions, FindingKind};
use birch_core::device::{BlockDevice, MemDevice};
use birch_core::repair::{repair, RepairMode, RepairReport};
use birch_core::vfs::OpenOptions;
use birch_core::{Engine, Filesystem, MkfsOptions};
use birch_format::items::{ExtentKind, FileExtent, InodeItem};
use birch_format::{name_hash, ItemType, Key};

const BIG: usize = 40_000;

fn big() -> Vec<u8> {
    (0..BIG as u32).map(|i| (i % 251) as u8).collect()
}

/// A filesystem with `/a/small` (inline), `/a/big` (regular extents) and `/b`, committed
/// several times so the superblock has its backup roots. Returns the device and the inode
/// numbers of small and big.
fn image() -> (Arc<MemDevice>, u64, u64) {
    let dev = Arc::new(MemDevice::new(64 << 20));
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    let fs = open(&dev);
    fs.mkdir(Default::default(), 1, b"a", 0o755).expect("mkdir");
    fs.write_file("/a/small", b"small file").expect("small");
    fs.write_file("/a/big", &big()).expect("big");
    fs.sync().expect("sync");
    for round in 0..4u8 {
        fs.write_file("/b", &[round; 100]).expect("b");
        fs.sync().expect("sync");
    }
    let small = fs.resolve("/a/small").expect("small");
    let big = fs.resolve("/a/big").expect("big");
    fs.close().expect("close");
    assert_clean(&dev, "as made");
    (dev, small, big)
}

fn open(dev: &Arc<MemDevice>) -> Filesystem {
    Filesystem::open_device(
        dev.clone(),
        OpenOptions {
            commit_interval: None,
            ..Default::default()
        },
    )
    .expect("open")
}

fn assert_clean(dev: &MemDevice, what: &str) {
    let report = check(dev, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{what}: {:#?}", report.findings);
}

fn kinds(dev: &MemDevice) -> Vec<FindingKind> {
    let report = check(dev, CheckOptions::default()).expect("fsck");
    report.findings.iter().map(|f| f.kind).collect()
}

/// Changes raw items through the engine, in one commit: the damage a bug would leave.
fn damage(dev: &Arc<MemDevice>, change: impl FnOnce(&Engine)) {
    let engine = Engine::open(dev.clone()).expect("engine");
    change(&engine);
    engine.commit().expect("commit the damage");
}

fn run(dev: &Arc<MemDevice>, mode: RepairMode) -> RepairReport {
    let device: Arc<dyn BlockDevice> = dev.clone();
    repair(device, mode, CheckOptions { data: true }).expect("repair")
}

fn inode(engine: &Engine, ino: u64) -> InodeItem {
    let bytes = engine
        .get(&Key::new(ino, ItemType::InodeItem, 0))
        .expect("get")
        .expect("inode item");
    InodeItem::decode(&bytes).expect("decode")
}

/// Full repair of `dev`: exit 1, a second check clean, and the second repair has nothing to
/// do (exit 0).
fn repaired(dev: &Arc<MemDevice>, what: &str) -> RepairReport {
    let report = run(dev, RepairMode::Full);
    assert_eq!(
        report.exit_code(),
        1,
        "{what}: {:#?} {:#?}",
        report.actions,
        report.refused
    );
    assert_clean(dev, what);
    assert_eq!(
        run(dev, RepairMode::Full).exit_code(),
        0,
        "{what}: second run"
    );
    report
}

#[test]
fn a_bumped_link_count_is_recomputed_by_preen() {
    let (dev, small, _) = image();
    damage(&dev, |engine| {
        let mut item = inode(engine, small);
        item.nlink += 3;
        let txn = engine.begin().expect("begin");
        txn.put(Key::new(small, ItemType::InodeItem, 0), item.encode());
    });
    assert_eq!(kinds(&dev), vec![FindingKind::InodeNlinkMismatch]);
    let report = run(&dev, RepairMode::Preen);
    assert_eq!(report.exit_code(), 1, "{:#?}", report.actions);
    assert!(report
        .actions
        .iter()
        .any(|a| a.contains("/a/small: link count 4 -> 1")));
    assert_clean(&dev, "after preen");
    let fs = open(&dev);
    assert_eq!(fs.read_file("/a/small").expect("read"), b"small file");
}

#[test]
fn a_wrong_directory_size_is_recomputed() {
    let (dev, _, _) = image();
    damage(&dev, |engine| {
        let a = {
            let bytes = engine
                .get(&Key::new(1, ItemType::DirItem, name_hash(&[b"a"])))
                .expect("get")
                .expect("dir item");
            birch_format::items::decode_dir_entries(&bytes).expect("decode")[0].child
        };
        let mut item = inode(engine, a);
        item.size = 9;
        let txn = engine.begin().expect("begin");
        txn.put(Key::new(a, ItemType::InodeItem, 0), item.encode());
    });
    assert_eq!(kinds(&dev), vec![FindingKind::DirSizeMismatch]);
    repaired(&dev, "dir size");
}

#[test]
fn an_inode_without_names_goes_to_lost_and_found() {
    let (dev, _, big_ino) = image();
    damage(&dev, |engine| {
        let a = Key::new(1, ItemType::DirItem, name_hash(&[b"a"]));
        let a = birch_format::items::decode_dir_entries(&engine.get(&a).expect("get").expect("a"))
            .expect("decode")[0]
            .child;
        let item = Key::new(a, ItemType::DirItem, name_hash(&[b"big"]));
        let entry = birch_format::items::decode_dir_entries(
            &engine.get(&item).expect("get").expect("entry"),
        )
        .expect("decode")[0]
            .clone();
        let txn = engine.begin().expect("begin");
        txn.delete(item);
        txn.delete(Key::new(a, ItemType::DirIndex, entry.dir_index));
        txn.delete(Key::new(
            big_ino,
            ItemType::InodeRef,
            name_hash(&[&a.to_le_bytes(), b"big"]),
        ));
    });
    let found = kinds(&dev);
    assert!(found.contains(&FindingKind::OrphanMissing), "{found:?}");
    let preen = run(&dev, RepairMode::Preen);
    assert_eq!(preen.exit_code(), 4, "preen must not move names");
    let report = repaired(&dev, "orphan");
    assert!(report
        .actions
        .iter()
        .any(|a| a.contains("made /lost+found")));
    let fs = open(&dev);
    let path = format!("/lost+found/#{big_ino}");
    assert_eq!(fs.read_file(&path).expect("reattached"), big());
    assert!(fs.resolve("/a/big").is_err());
}

#[test]
fn an_entry_naming_a_missing_inode_is_dropped_and_reported() {
    let (dev, small, _) = image();
    damage(&dev, |engine| {
        let txn = engine.begin().expect("begin");
        txn.delete(Key::new(small, ItemType::InodeItem, 0));
    });
    let found = kinds(&dev);
    assert!(found.contains(&FindingKind::DirEntryDangling), "{found:?}");
    assert!(found.contains(&FindingKind::ItemWithoutInode), "{found:?}");
    let report = repaired(&dev, "dangling");
    assert!(
        report.lost.iter().any(|l| l.contains("/a/small")),
        "the lost path is reported: {:#?}",
        report.lost
    );
    let fs = open(&dev);
    assert!(fs.resolve("/a/small").is_err());
    assert_eq!(fs.read_file("/a/big").expect("big kept"), big());
}

#[test]
fn an_extent_past_the_device_is_dropped_and_the_rest_of_the_file_kept() {
    let (dev, _, big_ino) = image();
    damage(&dev, |engine| {
        let key = Key::new(big_ino, ItemType::ExtentData, 0);
        let mut extent =
            FileExtent::decode(&engine.get(&key).expect("get").expect("extent")).expect("decode");
        if let ExtentKind::Regular { disk_addr, .. } = &mut extent.kind {
            *disk_addr = 1 << 40;
        }
        let txn = engine.begin().expect("begin");
        txn.put(key, extent.encode());
    });
    assert!(kinds(&dev).contains(&FindingKind::BlockOutOfBounds));
    assert!(
        Engine::open(dev.clone()).is_err(),
        "a plain open refuses the image"
    );
    let report = repaired(&dev, "extent past the device");
    assert!(
        report
            .lost
            .iter()
            .any(|l| l.contains("/a/big") && l.contains("offset 0")),
        "{:#?}",
        report.lost
    );
    let fs = open(&dev);
    let data = fs.read_file("/a/big").expect("read");
    assert_eq!(
        data.len(),
        BIG,
        "the size is kept; the dropped range is a hole"
    );
    assert_eq!(fs.read_file("/a/small").expect("small"), b"small file");
}

#[test]
fn a_damaged_newest_tree_falls_back_to_a_whole_backup() {
    let (dev, _, _) = image();
    let (sb, _) = Engine::read_superblock(&*dev).expect("superblock");
    assert_eq!(sb.backup_roots.len(), 3, "{:?}", sb.backup_roots);
    dev.corrupt(sb.fs_root.addr + 100, &[0xff; 8]);
    assert!(kinds(&dev).contains(&FindingKind::NodeUnreadable));
    let preen = run(&dev, RepairMode::Preen);
    assert_eq!(preen.exit_code(), 4, "preen never falls back");
    let report = repaired(&dev, "fallback");
    let backup = sb.backup_roots[0].generation;
    assert_eq!(report.fell_back_to, Some(backup));
    assert!(report.lost.iter().any(|l| l.contains("after generation")));
    let fs = open(&dev);
    assert_eq!(fs.read_file("/a/big").expect("big"), big());
    assert_eq!(fs.read_file("/b").expect("b").len(), 100);
}

#[test]
fn a_dry_run_writes_nothing() {
    let (dev, small, _) = image();
    damage(&dev, |engine| {
        let mut item = inode(engine, small);
        item.nlink = 7;
        let txn = engine.begin().expect("begin");
        txn.put(Key::new(small, ItemType::InodeItem, 0), item.encode());
    });
    let before = dev.snapshot();
    let report = run(&dev, RepairMode::DryRun);
    assert!(report.after.as_ref().is_some_and(|a| a.is_clean()));
    assert!(dev.snapshot() == before, "a dry run wrote to the image");
    assert_eq!(kinds(&dev), vec![FindingKind::InodeNlinkMismatch]);
}

/// A repair whose writes fail leaves the image as it was: its changes were going to new
/// blocks and a new superblock, never over the committed tree.
#[test]
fn a_failed_repair_leaves_the_old_state() {
    let (dev, small, _) = image();
    damage(&dev, |engine| {
        let mut item = inode(engine, small);
        item.nlink = 7;
        let txn = engine.begin().expect("begin");
        txn.put(Key::new(small, ItemType::InodeItem, 0), item.encode());
    });
    dev.fail_writes(true);
    let device: Arc<dyn BlockDevice> = dev.clone();
    assert!(repair(device, RepairMode::Full, CheckOptions::default()).is_err());
    dev.fail_writes(false);
    let crashed = Arc::new(dev.crash());
    assert_eq!(kinds(&crashed), vec![FindingKind::InodeNlinkMismatch]);
    repaired(&crashed, "after the failed repair");
}
