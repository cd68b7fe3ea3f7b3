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
use birch_format::node::{Expect, Node, NodeBody};
use birch_format::superblock::RootPtr;
use birch_format::{name_hash, BlockCount, InodeNo, ItemType, Key, ROOT_INO};

mod common;

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
    fs.mkdir(Default::default(), ROOT_INO, b"a", 0o755)
        .expect("mkdir");
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
    (dev, small.get(), big.get())
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

/// Some line of `report.lost` holds every one of `parts`.
fn assert_lost(report: &RepairReport, parts: &[&str]) {
    assert!(
        report
            .lost
            .iter()
            .any(|l| parts.iter().all(|p| l.contains(p))),
        "{parts:?} not among {:#?}",
        report.lost
    );
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
    assert_lost(&report, &["/a/small"]);
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
    assert_lost(&report, &["/a/big", "offset 0"]);
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

/// The regular extent of `ino` that covers file offset `at`: (key offset, disk address).
fn extent_at(dev: &Arc<MemDevice>, ino: u64, at: u64) -> (u64, FileExtent) {
    let engine = Engine::open(dev.clone()).expect("engine");
    let lo = Key::new(ino, ItemType::ExtentData, 0);
    let hi = Key::new(ino, ItemType::ExtentData, u64::MAX);
    engine
        .range(&lo, &hi, usize::MAX)
        .expect("range")
        .into_iter()
        .map(|(k, v)| (k.offset, FileExtent::decode(&v).expect("decode")))
        .find(|(offset, e)| *offset <= at && at < offset + e.len_bytes())
        .expect("an extent there")
}

fn disk_addr(extent: &FileExtent) -> u64 {
    match extent.kind {
        ExtentKind::Regular { disk_addr, .. } => disk_addr,
        _ => panic!("not regular: {extent:?}"),
    }
}

const BS: u64 = birch_format::BLOCK_SIZE;

/// Bytes flipped in one data block of `/a/big`: repair punches that block out of its extent
/// (the extent splits in two), the file reads zeros there and its other data as written, and
/// the path and byte range are reported.
#[test]
fn a_data_block_failing_its_checksum_is_punched_out_and_reported() {
    let (dev, _, big_ino) = image();
    let (offset, extent) = extent_at(&dev, big_ino, 3 * BS);
    let block = disk_addr(&extent) + (3 * BS - offset);
    dev.corrupt(block + 10, &[0x5a; 16]);
    let report = check(&*dev, CheckOptions { data: true }).expect("fsck");
    let found: Vec<_> = report.findings.iter().map(|f| f.kind).collect();
    assert_eq!(found, vec![FindingKind::DataChecksumMismatch]);
    assert_eq!(kinds(&dev), vec![], "without --data the block is not read");
    let preen = run(&dev, RepairMode::Preen);
    assert_eq!(preen.exit_code(), 4, "preen drops no data");
    let report = repaired(&dev, "bad data block");
    let range = format!("/a/big: lost bytes {}..{}", 3 * BS, 4 * BS);
    assert_lost(&report, &[&range]);
    let fs = open(&dev);
    let data = fs.read_file("/a/big").expect("read");
    let mut want = big();
    want[3 * BS as usize..4 * BS as usize].fill(0);
    assert!(
        data == want,
        "a hole where the bad block was, the rest intact"
    );
    assert_eq!(fs.read_file("/a/small").expect("small"), b"small file");
}

#[test]
fn an_unreadable_data_block_is_punched_out_and_reported() {
    let (dev, _, big_ino) = image();
    let (offset, extent) = extent_at(&dev, big_ino, 9 * BS);
    let block = disk_addr(&extent) + (9 * BS - offset);
    // Reads of that block fail (a bad sector).
    let bad = block..block + BS;
    let device: Arc<dyn BlockDevice> = Arc::new(common::HookedReads {
        inner: dev.clone(),
        hook: move |offset: u64, len: usize| {
            if offset < bad.end && bad.start < offset + len as u64 {
                return Err(std::io::Error::from_raw_os_error(libc::EIO));
            }
            Ok(())
        },
    });
    let before = check(&*device, CheckOptions { data: true }).expect("fsck");
    let found: Vec<_> = before.findings.iter().map(|f| f.kind).collect();
    assert_eq!(found, vec![FindingKind::DataUnreadable]);
    let report = repair(
        device.clone(),
        RepairMode::Full,
        CheckOptions { data: true },
    )
    .expect("repair");
    assert_eq!(report.exit_code(), 1, "{:#?}", report.actions);
    // The last block holds the file's tail: the range reported ends at the size.
    let range = format!("/a/big: lost bytes {}..{BIG}", 9 * BS);
    assert_lost(&report, &[&range, "cannot be read"]);
    let after = check(&*device, CheckOptions { data: true }).expect("fsck");
    assert!(after.is_clean(), "{:#?}", after.findings);
    let fs = open(&dev);
    let data = fs.read_file("/a/big").expect("read");
    let mut want = big();
    want[9 * BS as usize..].fill(0);
    assert!(data == want);
}

/// An item of an unknown type and an inode ref whose payload does not decode: both are
/// deleted; the ref is written back from the directory entry, so nothing is lost.
#[test]
fn undecodable_items_are_deleted_and_a_ref_is_written_back() {
    let (dev, small, _) = image();
    damage(&dev, |engine| {
        let refs = Key::new(small, ItemType::InodeRef, 0);
        let ref_key = engine
            .range(&refs, &Key::new(small, ItemType::InodeRef, u64::MAX), 1)
            .expect("range")[0]
            .0;
        let txn = engine.begin().expect("begin");
        txn.put(
            Key {
                objectid: small,
                item_type: 200,
                offset: 7,
            },
            vec![1, 2, 3],
        );
        txn.put(ref_key, vec![0xff; 5]);
    });
    let found = kinds(&dev);
    assert_eq!(
        found
            .iter()
            .filter(|k| **k == FindingKind::ItemUndecodable)
            .count(),
        2,
        "{found:?}"
    );
    let report = repaired(&dev, "undecodable items");
    assert!(
        report
            .actions
            .iter()
            .any(|a| a.contains("wrote back the inode's ref")),
        "{:#?}",
        report.actions
    );
    let fs = open(&dev);
    assert_eq!(fs.read_file("/a/small").expect("small"), b"small file");
}

/// Moves the extent of `ino` at file offset 0 to the offset `to` gives; returns its offset.
fn move_first_extent(dev: &Arc<MemDevice>, ino: u64, to: impl Fn(u64) -> u64) -> u64 {
    let (offset, extent) = extent_at(dev, ino, 0);
    damage(dev, |engine| {
        let txn = engine.begin().expect("begin");
        txn.delete(Key::new(ino, ItemType::ExtentData, offset));
        txn.put(
            Key::new(ino, ItemType::ExtentData, to(offset)),
            extent.encode(),
        );
    });
    offset
}

/// A regular extent moved to an offset that is not block-aligned: dropped, reported, the
/// file keeps its size and reads zeros.
#[test]
fn a_misaligned_extent_is_dropped_and_reported() {
    let (dev, _, big_ino) = image();
    let offset = move_first_extent(&dev, big_ino, |offset| offset + 100);
    assert_eq!(kinds(&dev), vec![FindingKind::ExtentMisaligned]);
    let report = repaired(&dev, "misaligned extent");
    assert_lost(
        &report,
        &[&format!("/a/big: lost bytes {}..", offset + 100)],
    );
    let fs = open(&dev);
    let data = fs.read_file("/a/big").expect("read");
    assert_eq!(data.len(), BIG);
    assert!(data[offset as usize..].iter().all(|b| *b == 0));
}

/// An extent moved to a garbage offset near the end of the key space (misaligned, past the
/// size): dropped without an overflow; no data of the file's size was in it, so nothing is
/// reported lost.
#[test]
fn an_extent_at_a_garbage_offset_is_dropped() {
    let (dev, _, big_ino) = image();
    move_first_extent(&dev, big_ino, |_| u64::MAX - 100);
    let found = kinds(&dev);
    assert!(found.contains(&FindingKind::ExtentMisaligned), "{found:?}");
    let report = repaired(&dev, "garbage offset");
    assert!(report.lost.is_empty(), "{:#?}", report.lost);
    let fs = open(&dev);
    assert_eq!(fs.read_file("/a/big").expect("read").len(), BIG);
}

/// A newer extent written over two blocks of `/a/big` without the older extent being cut:
/// the newer one keeps the range, the older is split around it, nothing is lost.
#[test]
fn overlapping_extents_keep_the_newer_data() {
    let (dev, _, big_ino) = image();
    damage(&dev, |engine| {
        let two = BlockCount::new(2);
        let (addr, blocks) = engine.allocate_data(two, two).expect("allocate");
        assert_eq!(blocks, two);
        let addr = addr.get();
        let block = vec![7u8; BS as usize];
        engine.device().write_at(&block, addr).expect("write");
        engine.device().write_at(&block, addr + BS).expect("write");
        let csum = birch_format::checksum(&block);
        let extent = FileExtent {
            generation: engine.running_generation().get(),
            kind: ExtentKind::Regular {
                disk_addr: addr,
                csums: vec![csum, csum],
            },
            shared: false,
        };
        let txn = engine.begin().expect("begin");
        txn.put(Key::new(big_ino, ItemType::ExtentData, BS), extent.encode());
    });
    assert_eq!(kinds(&dev), vec![FindingKind::ExtentOverlap]);
    let report = repaired(&dev, "overlap");
    assert!(report.lost.is_empty(), "{:#?}", report.lost);
    assert!(
        report.actions.iter().any(|a| a.contains(&format!(
            "stale blocks at bytes {}..{}",
            BS,
            3 * BS
        ))),
        "{:#?}",
        report.actions
    );
    let fs = open(&dev);
    let mut want = big();
    want[BS as usize..3 * BS as usize].fill(7);
    assert!(fs.read_file("/a/big").expect("read") == want);
}

/// An inline extent moved off offset 0 (the size raised to cover it): rewritten as a data
/// block at the aligned offset, its bytes where they were.
#[test]
fn an_inline_extent_off_zero_is_rewritten_as_a_block() {
    let (dev, small, _) = image();
    damage(&dev, |engine| {
        let key = Key::new(small, ItemType::ExtentData, 0);
        let value = engine.get(&key).expect("get").expect("inline");
        let mut item = inode(engine, small);
        item.size = 5000 + 10;
        let txn = engine.begin().expect("begin");
        txn.delete(key);
        txn.put(Key::new(small, ItemType::ExtentData, 5000), value);
        txn.put(Key::new(small, ItemType::InodeItem, 0), item.encode());
    });
    assert_eq!(kinds(&dev), vec![FindingKind::InlineExtentInvalid]);
    let report = repaired(&dev, "inline off zero");
    assert!(report.lost.is_empty(), "{:#?}", report.lost);
    let fs = open(&dev);
    let data = fs.read_file("/a/small").expect("read");
    assert_eq!(data.len(), 5010);
    assert!(data[..5000].iter().all(|b| *b == 0));
    assert_eq!(&data[5000..], b"small file");
}

/// One chunk of an out-of-line xattr value deleted: the xattr is removed and reported, its
/// other chunks go, the file's small xattr stays.
#[test]
fn an_xattr_with_a_missing_chunk_is_removed_and_reported() {
    let (dev, small, _) = image();
    let fs = open(&dev);
    let value: Vec<u8> = (0..20_000u32).map(|i| (i % 253) as u8).collect();
    fs.setxattr(InodeNo::new(small), b"user.big", &value, 0)
        .expect("big xattr");
    fs.setxattr(InodeNo::new(small), b"user.small", b"v", 0)
        .expect("small xattr");
    fs.close().expect("close");
    assert_clean(&dev, "with the xattrs");
    damage(&dev, |engine| {
        let txn = engine.begin().expect("begin");
        txn.delete(birch_core::items::xattr_chunk_key(
            InodeNo::new(small),
            b"user.big",
            1,
        ));
    });
    let found = kinds(&dev);
    assert!(
        found.contains(&FindingKind::XattrChunkMismatch),
        "{found:?}"
    );
    let report = repaired(&dev, "xattr chunk");
    assert_lost(&report, &["/a/small", "user.big"]);
    let fs = open(&dev);
    assert!(fs.getxattr(InodeNo::new(small), b"user.big").is_err());
    assert_eq!(
        fs.getxattr(InodeNo::new(small), b"user.small")
            .expect("small"),
        b"v"
    );
}

/// The root directory's inode item deleted: made anew with its entries, everything under it
/// reachable again.
#[test]
fn a_missing_root_directory_is_made_anew() {
    let (dev, _, _) = image();
    damage(&dev, |engine| {
        let txn = engine.begin().expect("begin");
        txn.delete(Key::new(1, ItemType::InodeItem, 0));
    });
    assert!(kinds(&dev).contains(&FindingKind::RootDirMissing));
    let report = repaired(&dev, "root missing");
    assert!(report.lost.is_empty(), "{:#?}", report.lost);
    let fs = open(&dev);
    assert_eq!(fs.read_file("/a/big").expect("big"), big());
    assert_eq!(fs.read_file("/b").expect("b").len(), 100);
    let root = inode(fs.engine(), 1);
    assert_eq!(root.mode & libc::S_IFMT, libc::S_IFDIR);
    assert_eq!(root.nlink, 3, "2 + the directory a");
}

/// The older superblock slot overwritten: preen rewrites it with its commit (nothing is
/// lost), and both slots are valid again.
#[test]
fn a_bad_superblock_slot_is_rewritten_by_preen() {
    let (dev, _, _) = image();
    let (sb, _) = Engine::read_superblock(&*dev).expect("superblock");
    let other = birch_format::superblock::SUPER_OFFSETS[1 - sb.slot()];
    dev.corrupt(other + 64, &[0xee; 32]);
    assert_eq!(kinds(&dev), vec![FindingKind::SuperblockSlotBad]);
    let report = run(&dev, RepairMode::Preen);
    assert_eq!(report.exit_code(), 1, "{:#?}", report.actions);
    assert_clean(&dev, "after preen");
    let (_, notes) = Engine::read_superblock(&*dev).expect("superblock");
    assert!(notes.is_empty(), "{notes:?}");
    assert_eq!(run(&dev, RepairMode::Full).exit_code(), 0);
}

/// The address of the leaf that holds (or would hold) `key` in the tree at `root`.
fn leaf_of(dev: &MemDevice, fsid: [u8; 16], root: RootPtr, key: Key) -> u64 {
    let (mut addr, mut generation, mut level) = (root.addr, root.generation, root.level);
    loop {
        let mut bytes = vec![0u8; birch_format::NODE_SIZE];
        dev.read_at(&mut bytes, addr).expect("read node");
        let expect = Expect {
            fsid,
            addr,
            generation,
            owner: birch_format::FS_TREE_ID,
            level: Some(level),
        };
        match Node::decode(&bytes, &expect).expect("node").body {
            NodeBody::Leaf(_) => return addr,
            NodeBody::Internal(ptrs) => {
                let ptr = ptrs
                    .iter()
                    .rev()
                    .find(|p| p.key <= key)
                    .or(ptrs.first())
                    .expect("a pointer");
                (addr, generation, level) = (ptr.addr, ptr.generation, level - 1);
            }
        }
    }
}

/// A leaf shared by the newest tree and every backup is corrupted, and so is the newest
/// tree's own leaf that holds `/b`: no backup is whole. Repair salvages: the newest tree's
/// readable leaves, `/b`'s leaf from the newest backup, and the shared leaf's key range is
/// reported lost; the names into it go, everything else reads back, a second check is clean.
#[test]
fn with_no_whole_backup_the_readable_leaves_are_salvaged() {
    let dev = Arc::new(MemDevice::new(64 << 20));
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    let fs = open(&dev);
    fs.mkdir(Default::default(), ROOT_INO, b"many", 0o755)
        .expect("mkdir");
    for i in 0..300 {
        fs.write_file(&format!("/many/f{i:03}"), format!("file {i}").as_bytes())
            .expect("write");
    }
    fs.mkdir(Default::default(), ROOT_INO, b"a", 0o755)
        .expect("mkdir");
    fs.write_file("/a/big", &big()).expect("big");
    fs.sync().expect("sync");
    for round in 0..4u8 {
        fs.write_file("/b", &[round; 100]).expect("b");
        fs.sync().expect("sync");
    }
    let victim = fs.resolve("/many/f150").expect("f150");
    let b = fs.resolve("/b").expect("b");
    let inos: Vec<(usize, InodeNo)> = (0..300)
        .map(|i| (i, fs.resolve(&format!("/many/f{i:03}")).expect("resolve")))
        .collect();
    fs.close().expect("close");
    let (sb, _) = Engine::read_superblock(&*dev).expect("superblock");
    assert_eq!(sb.backup_roots.len(), 3);
    let key = |ino| Key::new(ino, ItemType::InodeItem, 0);
    let shared = leaf_of(&dev, sb.fsid, sb.fs_root, key(victim.get()));
    for backup in &sb.backup_roots {
        assert_eq!(
            leaf_of(&dev, sb.fsid, backup.fs_root, key(victim.get())),
            shared,
            "the leaf is in every backup"
        );
    }
    let newest_b = leaf_of(&dev, sb.fsid, sb.fs_root, key(b.get()));
    assert_ne!(newest_b, shared);
    assert_ne!(
        leaf_of(&dev, sb.fsid, sb.backup_roots[0].fs_root, key(b.get())),
        newest_b,
        "the newest backup has its own copy of /b's leaf"
    );
    let kept: Vec<(usize, InodeNo)> = inos
        .iter()
        .copied()
        .filter(|(_, ino)| {
            // All of its items: the first and the last key it may have.
            let first = Key {
                objectid: ino.get(),
                item_type: 0,
                offset: 0,
            };
            let last = Key {
                objectid: ino.get(),
                item_type: u8::MAX,
                offset: u64::MAX,
            };
            leaf_of(&dev, sb.fsid, sb.fs_root, first) != shared
                && leaf_of(&dev, sb.fsid, sb.fs_root, last) != shared
        })
        .collect();
    assert!(kept.len() > 100 && kept.len() < 300, "{}", kept.len());
    dev.corrupt(shared + 100, &[0xff; 8]);
    dev.corrupt(newest_b + 100, &[0xff; 8]);
    assert!(kinds(&dev).contains(&FindingKind::NodeUnreadable));
    assert_eq!(run(&dev, RepairMode::Preen).exit_code(), 4);
    let report = repaired(&dev, "salvage");
    assert!(report.salvaged, "{:#?}", report.actions);
    assert_eq!(report.fell_back_to, None);
    assert_lost(&report, &["unreadable in every tree"]);
    assert_lost(&report, &["/many/f150"]);
    let fs = open(&dev);
    assert_eq!(fs.read_file("/a/big").expect("big"), big());
    assert_eq!(
        fs.read_file("/b").expect("b"),
        vec![2u8; 100],
        "from the newest backup"
    );
    assert!(fs.resolve("/many/f150").is_err());
    for (i, _) in kept {
        assert_eq!(
            fs.read_file(&format!("/many/f{i:03}")).expect("kept"),
            format!("file {i}").as_bytes()
        );
    }
}

/// Every root node corrupted, the newest and the backups': nothing reads, so repair refuses
/// (exit 4) and writes nothing rather than an empty filesystem.
#[test]
fn with_nothing_readable_repair_refuses_and_writes_nothing() {
    let (dev, _, _) = image();
    let (sb, _) = Engine::read_superblock(&*dev).expect("superblock");
    let other = {
        use birch_format::superblock::{Superblock, SUPER_BYTES, SUPER_OFFSETS};
        let mut bytes = vec![0u8; SUPER_BYTES];
        dev.read_at(&mut bytes, SUPER_OFFSETS[1 - sb.slot()])
            .expect("read");
        Superblock::decode(&bytes, "other slot").expect("other slot")
    };
    dev.corrupt(sb.fs_root.addr + 100, &[0xff; 8]);
    for backup in sb.backup_roots.iter().chain(&other.backup_roots) {
        dev.corrupt(backup.fs_root.addr + 100, &[0xff; 8]);
    }
    let before = dev.snapshot();
    let report = run(&dev, RepairMode::Full);
    assert_eq!(report.exit_code(), 4, "{:#?}", report.actions);
    assert!(!report.salvaged);
    assert!(
        report
            .refused
            .iter()
            .any(|r| r.contains("no leaf of any tree reads")),
        "{:#?}",
        report.refused
    );
    assert!(dev.snapshot() == before, "a refused repair wrote");
}

/// Out-of-line xattr chunks on an image whose superblock lost `INCOMPAT_XATTR_CHUNKS`: the
/// values are whole, so repair keeps them and sets the flag again with its commit.
#[test]
fn chunks_without_their_flag_get_the_flag_back() {
    use birch_format::superblock::{INCOMPAT_XATTR_CHUNKS, SUPER_OFFSETS};
    let (dev, small, _) = image();
    let fs = open(&dev);
    let value: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
    fs.setxattr(InodeNo::new(small), b"user.big", &value, 0)
        .expect("big xattr");
    fs.close().expect("close");
    let (mut sb, _) = Engine::read_superblock(&*dev).expect("superblock");
    assert_ne!(sb.incompat & INCOMPAT_XATTR_CHUNKS, 0);
    sb.incompat &= !INCOMPAT_XATTR_CHUNKS;
    dev.write_at(&sb.encode(), SUPER_OFFSETS[sb.slot()])
        .expect("write superblock");
    assert_eq!(kinds(&dev), vec![FindingKind::XattrChunkMismatch]);
    let report = repaired(&dev, "flag");
    assert!(report.lost.is_empty(), "{:#?}", report.lost);
    let (sb, _) = Engine::read_superblock(&*dev).expect("superblock");
    assert_ne!(sb.incompat & INCOMPAT_XATTR_CHUNKS, 0);
    let fs = open(&dev);
    assert_eq!(
        fs.getxattr(InodeNo::new(small), b"user.big").expect("kept"),
        value
    );
}

/// Contents of a file of `len` bytes stamped with each 8-byte word's offset and `version`,
/// so a block read from the wrong place or the wrong version is seen.
fn stamped(len: usize, version: u64) -> Vec<u8> {
    (0..len.div_ceil(8) as u64)
        .flat_map(|w| ((w * 8) ^ version.rotate_left(40)).to_le_bytes())
        .take(len)
        .collect()
}

/// Every finding of `kinds` whose location names snapshot `name`.
fn snapshot_findings(dev: &MemDevice, name: &str, kind: FindingKind) -> usize {
    let report = check(dev, CheckOptions { data: true }).expect("fsck");
    report
        .findings
        .iter()
        .filter(|f| f.kind == kind && f.location.contains(&format!("snapshot {name:?}")))
        .count()
}

/// A data block only a snapshot holds (the live file was rewritten since): `fsck --data`
/// reads it and names the snapshot; repair leaves it (snapshots are read-only), says so and
/// exits 4, and frees nothing the snapshot holds; deleting the snapshot drops it.
#[test]
fn a_damaged_block_only_a_snapshot_holds_is_found_and_named() {
    let (dev, _, big_ino) = image();
    let fs = open(&dev);
    fs.create_snapshot("s1").expect("snapshot");
    fs.write_file("/a/big", &stamped(BIG, 2))
        .expect("rewrite big");
    fs.sync().expect("sync");
    fs.close().expect("close");
    assert_clean(&dev, "before the damage");
    // The snapshot's copy of /a/big: its extents are in the snapshot's tree only.
    let snap_block = {
        let engine = Engine::open(dev.clone()).expect("engine");
        let snap = engine.snapshots().into_iter().next().expect("s1");
        let view = engine.snapshot_view(snap.id).expect("view");
        let lo = Key::new(big_ino, ItemType::ExtentData, 0);
        let hi = Key::new(big_ino, ItemType::ExtentData, u64::MAX);
        let (_, value) = view
            .range(&lo, &hi, 1)
            .expect("range")
            .into_iter()
            .next()
            .expect("an extent");
        disk_addr(&FileExtent::decode(&value).expect("decode")) + BS
    };
    dev.corrupt(snap_block + 7, &[0xa5; 32]);
    assert_eq!(kinds(&dev), vec![], "without --data no block is read");
    assert_eq!(
        snapshot_findings(&dev, "s1", FindingKind::DataChecksumMismatch),
        1
    );
    let report = run(&dev, RepairMode::Full);
    assert_eq!(report.exit_code(), 4, "{:#?}", report.refused);
    assert!(
        report
            .refused
            .iter()
            .any(|r| r.contains("snapshot \"s1\"") && r.contains("read-only")),
        "{:#?}",
        report.refused
    );
    // The live file is whole, and new writes take no block the snapshot holds.
    let fs = open(&dev);
    assert!(fs.read_file("/a/big").expect("big") == stamped(BIG, 2));
    for i in 0..8u64 {
        fs.write_file(&format!("/fill{i}"), &stamped(BIG, 10 + i))
            .expect("fill");
    }
    fs.sync().expect("sync");
    fs.close().expect("close");
    let report = check(&*dev, CheckOptions { data: true }).expect("fsck");
    let found: Vec<_> = report.findings.iter().map(|f| f.kind).collect();
    assert_eq!(
        found,
        vec![FindingKind::DataChecksumMismatch],
        "{report:#?}"
    );
    let fs = open(&dev);
    fs.delete_snapshot("s1").expect("delete");
    fs.sync().expect("sync");
    for i in 0..8u64 {
        let path = format!("/fill{i}");
        assert!(fs.read_file(&path).expect("fill") == stamped(BIG, 10 + i));
    }
    fs.close().expect("close");
    assert_clean(&dev, "after the snapshot went");
}

/// A damaged block the live file and a snapshot share: repair punches it out of the live
/// file (reported lost), the snapshot keeps it and is named as holding a damaged block, and
/// the punch frees nothing the snapshot holds.
#[test]
fn a_damaged_block_shared_with_a_snapshot_is_punched_from_the_live_file_only() {
    let (dev, _, big_ino) = image();
    let fs = open(&dev);
    fs.create_snapshot("s1").expect("snapshot");
    fs.close().expect("close");
    let (offset, extent) = extent_at(&dev, big_ino, 2 * BS);
    let block = disk_addr(&extent) + (2 * BS - offset);
    dev.corrupt(block + 100, &[0x3c; 16]);
    let report = check(&*dev, CheckOptions { data: true }).expect("fsck");
    let found: Vec<_> = report.findings.iter().map(|f| f.kind).collect();
    assert_eq!(
        found,
        vec![FindingKind::DataChecksumMismatch],
        "one block, read once"
    );
    let report = run(&dev, RepairMode::Full);
    assert_eq!(report.exit_code(), 4, "{:#?}", report.refused);
    assert_lost(
        &report,
        &[&format!("/a/big: lost bytes {}..{}", 2 * BS, 3 * BS)],
    );
    assert!(
        report.refused.iter().any(|r| r.contains("snapshot \"s1\"")),
        "{:#?}",
        report.refused
    );
    assert_eq!(
        snapshot_findings(&dev, "s1", FindingKind::DataChecksumMismatch),
        1,
        "the snapshot still holds the damaged block"
    );
    let fs = open(&dev);
    let mut want = big();
    want[2 * BS as usize..3 * BS as usize].fill(0);
    assert!(fs.read_file("/a/big").expect("big") == want);
    for i in 0..8u64 {
        fs.write_file(&format!("/fill{i}"), &stamped(BIG, 20 + i))
            .expect("fill");
    }
    fs.sync().expect("sync");
    fs.delete_snapshot("s1").expect("delete");
    fs.sync().expect("sync");
    fs.close().expect("close");
    assert_clean(&dev, "after the snapshot went");
    let fs = open(&dev);
    for i in 0..8u64 {
        assert!(fs.read_file(&format!("/fill{i}")).expect("fill") == stamped(BIG, 20 + i));
    }
}

/// The newest tree and the snapshot made with it are damaged: repair falls back to an older
/// tree, which the snapshot is newer than, so the snapshot is deleted from the list (a kept
/// tree must be a past state of the live one); an older snapshot stays, and deleting it later
/// frees nothing the live tree uses.
#[test]
fn a_fallback_past_a_snapshot_deletes_it_and_keeps_the_older_ones() {
    let (dev, _, _) = image();
    let fs = open(&dev);
    fs.create_snapshot("old").expect("old");
    fs.write_file("/c", &stamped(3 * BS as usize, 1))
        .expect("c");
    fs.sync().expect("sync");
    fs.write_file("/d", &stamped(3 * BS as usize, 2))
        .expect("d");
    // The snapshot's commit writes the tree too: its root is that commit's.
    fs.create_snapshot("new").expect("new");
    fs.write_file("/e", b"after").expect("e");
    fs.sync().expect("sync");
    fs.close().expect("close");
    let (sb, _) = Engine::read_superblock(&*dev).expect("superblock");
    let new_root = {
        let engine = Engine::open(dev.clone()).expect("engine");
        let list = engine.snapshots();
        assert_eq!(list.len(), 2);
        list[1].root
    };
    assert_eq!(
        sb.backup_roots[0].fs_root, new_root,
        "{:?}",
        sb.backup_roots
    );
    // The newest root and the snapshot's (the newest backup) are both damaged.
    dev.corrupt(sb.fs_root.addr + 100, &[0xff; 8]);
    dev.corrupt(new_root.addr + 100, &[0xff; 8]);
    let report = run(&dev, RepairMode::Full);
    assert_eq!(
        report.exit_code(),
        1,
        "{:#?} {:#?}",
        report.actions,
        report.refused
    );
    assert_eq!(report.fell_back_to, Some(sb.backup_roots[1].generation));
    assert_lost(&report, &["snapshot \"new\"", "deleted"]);
    assert_clean(&dev, "after the fallback");
    let fs = open(&dev);
    let names: Vec<String> = fs
        .engine()
        .snapshots()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, vec!["old".to_string()]);
    assert!(fs.read_file("/c").expect("c") == stamped(3 * BS as usize, 1));
    fs.delete_snapshot("old").expect("delete old");
    fs.sync().expect("sync");
    fs.close().expect("close");
    assert_clean(&dev, "after the old snapshot went");
    let fs = open(&dev);
    assert!(fs.read_file("/c").expect("c") == stamped(3 * BS as usize, 1));
    assert!(fs.read_file("/a/big").expect("big") == big());
}

/// An image an earlier repair left with a snapshot newer than its live tree (its fallback
/// kept the list as it was): fsck names it, a mount refuses snapshot changes, preen refuses,
/// and a full repair deletes it; the older snapshot's deletion then frees nothing live.
#[test]
fn a_snapshot_newer_than_the_live_tree_is_found_refused_and_repaired() {
    let (dev, _, _) = image();
    let fs = open(&dev);
    fs.create_snapshot("old").expect("old");
    fs.write_file("/c", &stamped(5 * BS as usize, 1))
        .expect("c");
    fs.sync().expect("sync");
    fs.write_file("/d", &stamped(5 * BS as usize, 2))
        .expect("d");
    fs.create_snapshot("new").expect("new");
    fs.close().expect("close");
    // What the old fallback wrote: superblock N+1 naming an older tree, the list kept.
    let (sb, _) = Engine::read_superblock(&*dev).expect("superblock");
    let older = sb.backup_roots[1];
    let mut next = sb.clone();
    next.generation = sb.generation + 1;
    next.fs_root = older.fs_root;
    next.backup_roots.clear();
    dev.write_at(
        &next.encode(),
        birch_format::superblock::SUPER_OFFSETS[next.slot()],
    )
    .expect("write superblock");
    let report = check(&*dev, CheckOptions { data: true }).expect("fsck");
    let found: Vec<_> = report.findings.iter().map(|f| f.kind).collect();
    assert_eq!(
        found,
        vec![FindingKind::SnapshotOutsideLineage],
        "{report:#?}"
    );
    let fs = open(&dev);
    let refused = fs.delete_snapshot("old").expect_err("refused");
    assert!(refused.to_string().contains("fsck --repair"), "{refused}");
    assert!(fs.create_snapshot("third").is_err());
    fs.close().expect("close");
    assert_eq!(run(&dev, RepairMode::Preen).exit_code(), 4);
    let report = repaired(&dev, "a snapshot newer than the live tree");
    assert_lost(&report, &["snapshot \"new\"", "deleted"]);
    let fs = open(&dev);
    fs.delete_snapshot("old").expect("delete old");
    fs.write_file("/f", &stamped(20 * BS as usize, 3))
        .expect("f");
    fs.sync().expect("sync");
    fs.close().expect("close");
    assert_clean(&dev, "after the old snapshot went");
    let fs = open(&dev);
    assert!(fs.read_file("/a/big").expect("big") == big());
    assert!(fs.read_file("/f").expect("f") == stamped(20 * BS as usize, 3));
}

/// A node only a snapshot holds is damaged: the mount's open refuses the image, fsck names
/// the snapshot's tree, and a full repair deletes that snapshot (reported lost) and keeps the
/// live tree and the other snapshot as they are.
#[test]
fn a_snapshot_whose_own_node_is_damaged_is_deleted_and_the_live_tree_kept() {
    let (dev, _, _) = image();
    let fs = open(&dev);
    fs.create_snapshot("keep").expect("keep");
    fs.write_file("/c", &stamped(4 * BS as usize, 1))
        .expect("c");
    fs.create_snapshot("hurt").expect("hurt");
    // The live tree moves on: the snapshot's root node is its own.
    fs.write_file("/d", &stamped(4 * BS as usize, 2))
        .expect("d");
    fs.sync().expect("sync");
    fs.close().expect("close");
    let hurt_root = {
        let engine = Engine::open(dev.clone()).expect("engine");
        engine.snapshots()[1].root
    };
    let (sb, _) = Engine::read_superblock(&*dev).expect("superblock");
    assert_ne!(hurt_root.addr, sb.fs_root.addr);
    dev.corrupt(hurt_root.addr + 100, &[0xff; 8]);
    assert!(kinds(&dev).contains(&FindingKind::SnapshotTreeDamaged));
    assert!(Engine::open(dev.clone()).is_err(), "a mount's open refuses");
    let report = repaired(&dev, "a damaged snapshot node");
    assert_eq!(report.fell_back_to, None);
    assert!(!report.salvaged);
    assert_lost(&report, &["snapshot \"hurt\"", "deleted"]);
    let fs = open(&dev);
    let names: Vec<String> = fs
        .engine()
        .snapshots()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, vec!["keep".to_string()]);
    assert!(fs.read_file("/c").expect("c") == stamped(4 * BS as usize, 1));
    assert!(fs.read_file("/d").expect("d") == stamped(4 * BS as usize, 2));
    assert!(fs.read_file("/a/big").expect("big") == big());
}
