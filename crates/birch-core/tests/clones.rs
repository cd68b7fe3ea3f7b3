//! Shared extents (DESIGN §15.8): `copy_file_range` of whole
//! blocks shares them instead of copying (both extents flagged, counts in memory), a later
//! write unshares only what it touches, the last sharer's deletion frees the blocks, and
//! crashes, reopens, snapshots and fsck see all of it right.

#![allow(clippy::expect_used)]

mod common;

use birch_core::check::{check, CheckOptions};
use birch_core::device::{BlockDevice, MemDevice};
use birch_core::vfs::Caller;
use birch_core::{Error, Filesystem};
use birch_format::items::{ExtentKind, FileExtent};
use birch_format::superblock::INCOMPAT_SHARED_EXTENTS;
use birch_format::{InodeNo, ItemType, Key, BLOCK_SIZE};

const ROOT: birch_format::InodeNo = birch_format::ROOT_INO;
const DEVICE_BYTES: u64 = 64 << 20;

/// Creates file `name` in the root with `content`; returns its inode.
fn put(fs: &Filesystem, name: &str, content: &[u8]) -> u64 {
    let (attr, fh) = fs
        .create(Caller::default(), ROOT, name.as_bytes(), 0o644, 0)
        .expect("create");
    fs.release(attr.ino, fh).expect("release");
    if !content.is_empty() {
        fs.write(attr.ino, 0, content, false).expect("write");
    }
    attr.ino.get()
}

/// Unlinks `name` and forgets the kernel's lookups of it (as the kernel does once nothing
/// holds the inode): its data is freed then.
fn remove(fs: &Filesystem, name: &str) {
    let ino = ino(fs, name);
    fs.unlink(ROOT, name.as_bytes()).expect("unlink");
    fs.forget(InodeNo::new(ino), u64::MAX);
}

fn ino(fs: &Filesystem, name: &str) -> u64 {
    (fs.lookup(ROOT, name.as_bytes()).expect("lookup").ino).get()
}

fn read_all(fs: &Filesystem, name: &str) -> Vec<u8> {
    let ino = ino(fs, name);
    let size = fs.getattr(InodeNo::new(ino)).expect("getattr").size;
    fs.read(InodeNo::new(ino), 0, size as usize).expect("read")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((i / 7) as u8).wrapping_mul(31) ^ seed ^ (i as u8))
        .collect()
}

fn fsck_clean(dev: &MemDevice, what: &str) {
    let report = check(dev, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{what}: {:?}", report.findings);
}

/// The extent items of `ino` in the live tree: (file offset, extent).
fn extents(fs: &Filesystem, ino: u64) -> Vec<(u64, FileExtent)> {
    let lo = Key::new(ino, ItemType::ExtentData, 0);
    let hi = Key::new(ino, ItemType::ExtentData, u64::MAX);
    fs.engine()
        .range(&lo, &hi, usize::MAX)
        .expect("range")
        .into_iter()
        .map(|(k, v)| (k.offset, FileExtent::decode(&v).expect("extent")))
        .collect()
}

/// Fills most of the free space with new files (committed), then deletes them: a block freed
/// while something still names it would be taken and overwritten here.
fn churn(fs: &Filesystem) {
    let mut made = Vec::new();
    for round in 0..2 {
        loop {
            let name = format!("churn{}", made.len());
            let ino = put(fs, &name, b"");
            made.push(name);
            let chunk = vec![0xC7; 64 << 10];
            match fs
                .write(InodeNo::new(ino), 0, &chunk, false)
                .and_then(|_| fs.fsync(InodeNo::new(ino), false))
            {
                Ok(()) => {}
                Err(Error::NoSpace(_)) => break,
                Err(e) => panic!("churn round {round}: {e}"),
            }
        }
        fs.sync().expect("sync");
    }
    for name in made {
        remove(fs, &name);
    }
    fs.sync().expect("sync");
}

fn shared_blocks(fs: &Filesystem) -> u64 {
    fs.engine().allocator().shared_blocks().get()
}

#[test]
fn a_clone_shares_the_blocks_and_reads_the_same() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    // 1 MiB and 100 bytes: 256 whole blocks shared, the 100-byte tail copied.
    let data = pattern((1 << 20) + 100, 1);
    let a = put(&fs, "a", &data);
    fs.sync().expect("sync");
    let free_before = fs.statfs().bfree;
    let written_before = fs.engine().counters().values();
    let b = put(&fs, "b", b"");
    let n = fs
        .copy_file_range(InodeNo::new(a), 0, InodeNo::new(b), 0, data.len() as u64)
        .expect("copy_file_range");
    assert_eq!(n, data.len() as u64);
    assert_eq!(read_all(&fs, "b"), data);
    assert_eq!(read_all(&fs, "a"), data);
    let c = fs.engine().counters().values().since(&written_before);
    assert_eq!(c.clone_ranges, 1);
    assert_eq!(c.clone_blocks, 256);
    assert_eq!(c.clone_copied_bytes, 100);
    assert!(extents(&fs, a)[0].1.shared, "source flagged");
    assert!(
        extents(&fs, b)
            .iter()
            .any(|(_, e)| e.shared && matches!(e.kind, ExtentKind::Regular { .. })),
        "clone flagged"
    );
    fs.sync().expect("sync");
    assert!(fs.engine().superblock().incompat & INCOMPAT_SHARED_EXTENTS != 0);
    // df shows the shared bytes once: only the tail block and metadata are new.
    let free_after = fs.statfs().bfree;
    assert!(
        free_after + 16 > free_before,
        "a clone takes metadata only: {free_after} vs {free_before}"
    );
    // 256 shared blocks of the source, plus none of the tail.
    assert_eq!(shared_blocks(&fs), 256);
    assert!(
        fs.stats_json().contains("\"shared_bytes\": 1048576"),
        "{}",
        fs.stats_json()
    );
    // The clone's attributes: size, and its own count of blocks (as btrfs: each file counts
    // the blocks it names).
    let attr = fs.getattr(InodeNo::new(b)).expect("getattr");
    assert_eq!(attr.size, data.len() as u64);
    common::close_and_check_clean(fs, &dev, "after a clone");
    let fs = common::open_quiet(&dev);
    assert_eq!(read_all(&fs, "a"), data);
    assert_eq!(read_all(&fs, "b"), data);
    assert_eq!(shared_blocks(&fs), 256, "the open walk counts them again");
    common::close_and_check_clean(fs, &dev, "reopened");
}

#[test]
fn a_write_unshares_only_the_blocks_it_touches() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    let data = pattern(64 * 4096, 2);
    let a = put(&fs, "a", &data);
    let b = put(&fs, "b", b"");
    assert_eq!(
        fs.copy_file_range(InodeNo::new(a), 0, InodeNo::new(b), 0, data.len() as u64)
            .expect("clone"),
        data.len() as u64
    );
    fs.sync().expect("sync");
    assert_eq!(shared_blocks(&fs), 64);
    // Overwrite two blocks of the clone and one of the source (different ones).
    fs.write(InodeNo::new(b), 8192, &[0xEE; 8192], false)
        .expect("write b");
    fs.write(InodeNo::new(a), 40960, &[0xAA; 100], false)
        .expect("write a");
    fs.sync().expect("sync");
    let mut want_a = data.clone();
    want_a[40960..41060].fill(0xAA);
    let mut want_b = data.clone();
    want_b[8192..16384].fill(0xEE);
    assert_eq!(read_all(&fs, "a"), want_a);
    assert_eq!(read_all(&fs, "b"), want_b);
    // Blocks 2, 3 (b's overwrite) and 10 (a's) are each named once now: no longer shared.
    assert_eq!(shared_blocks(&fs), 61);
    assert_eq!(
        fs.engine()
            .allocator()
            .shared_references(birch_format::BlockAddr::new(
                match &extents(&fs, a)[0].1.kind {
                    ExtentKind::Regular { disk_addr, .. } => *disk_addr,
                    _ => unreachable!(),
                }
            )),
        2
    );
    // Pieces cut from a shared extent stay shared.
    let pieces: Vec<bool> = extents(&fs, b).iter().map(|(_, e)| e.shared).collect();
    assert!(
        pieces.contains(&true) && pieces.contains(&false),
        "{pieces:?}"
    );
    common::close_and_check_clean(fs, &dev, "after unsharing writes");
    let fs = common::open_quiet(&dev);
    assert_eq!(read_all(&fs, "a"), want_a);
    assert_eq!(read_all(&fs, "b"), want_b);
    common::close_and_check_clean(fs, &dev, "reopened");
}

#[test]
fn the_last_sharer_frees_the_blocks() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    fs.sync().expect("sync");
    let empty = fs.statfs().bfree;
    let data = pattern(4 << 20, 3);
    let a = put(&fs, "a", &data);
    let b = put(&fs, "b", b"");
    let c = put(&fs, "c", b"");
    fs.copy_file_range(InodeNo::new(a), 0, InodeNo::new(b), 0, data.len() as u64)
        .expect("clone to b");
    // A clone of a clone.
    fs.copy_file_range(InodeNo::new(b), 0, InodeNo::new(c), 0, data.len() as u64)
        .expect("clone to c");
    fs.sync().expect("sync");
    let full = fs.statfs().bfree;
    assert!(
        empty - full >= 1024 && empty - full < 1100,
        "{empty} {full}"
    );
    remove(&fs, "a");
    fs.sync().expect("sync");
    assert!(fs.statfs().bfree < full + 16, "b and c keep the blocks");
    churn(&fs);
    assert_eq!(read_all(&fs, "b"), data);
    remove(&fs, "b");
    fs.sync().expect("sync");
    assert_eq!(read_all(&fs, "c"), data);
    assert!(fs.statfs().bfree < full + 16, "c keeps the blocks");
    common::close_and_check_clean(fs, &dev, "c alone");
    let fs = common::open_quiet(&dev);
    assert_eq!(read_all(&fs, "c"), data);
    remove(&fs, "c");
    fs.sync().expect("sync");
    let back = fs.statfs().bfree;
    assert!(back + 16 >= empty, "space back: {back} vs {empty}");
    assert_eq!(shared_blocks(&fs), 0);
    common::close_and_check_clean(fs, &dev, "all gone");
}

#[test]
fn a_clone_within_one_file_and_unaligned_ranges() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    let data = pattern(16 * 4096, 4);
    let a = put(&fs, "a", &data);
    // Within one file, same offset within the block: blocks 1..3 shared, head and tail copied.
    let n = fs
        .copy_file_range(
            InodeNo::new(a),
            4096 + 100,
            InodeNo::new(a),
            20 * 4096 + 100,
            3 * 4096,
        )
        .expect("clone within");
    assert_eq!(n, 3 * 4096);
    let mut want = data.clone();
    want.resize(20 * 4096 + 100, 0);
    want.extend_from_slice(&data[4096 + 100..4 * 4096 + 100]);
    assert_eq!(read_all(&fs, "a"), want);
    assert_eq!(fs.engine().counters().values().clone_blocks, 2);
    // Offsets that differ within a block: bytes.
    let b = put(&fs, "b", b"");
    let n = fs
        .copy_file_range(InodeNo::new(a), 10, InodeNo::new(b), 0, 5 * 4096)
        .expect("unaligned copy");
    assert_eq!(n, 5 * 4096);
    assert_eq!(read_all(&fs, "b"), &want[10..10 + 5 * 4096]);
    assert_eq!(fs.engine().counters().values().clone_blocks, 2);
    // An inline source is copied.
    let small = put(&fs, "small", b"inline bytes");
    let c = put(&fs, "c", b"");
    assert_eq!(
        fs.copy_file_range(InodeNo::new(small), 0, InodeNo::new(c), 0, 100)
            .expect("inline"),
        12
    );
    assert_eq!(read_all(&fs, "c"), b"inline bytes");
    // Past the source's end: nothing.
    assert_eq!(
        fs.copy_file_range(InodeNo::new(small), 12, InodeNo::new(c), 0, 100)
            .expect("eof"),
        0
    );
    // Into the middle of a file with data: the range is replaced, the rest stays.
    let d = put(&fs, "d", &pattern(8 * 4096, 9));
    fs.copy_file_range(InodeNo::new(a), 0, InodeNo::new(d), 4096, 2 * 4096)
        .expect("into d");
    let mut want_d = pattern(8 * 4096, 9);
    want_d[4096..3 * 4096].copy_from_slice(&data[..2 * 4096]);
    assert_eq!(read_all(&fs, "d"), want_d);
    fs.sync().expect("sync");
    common::close_and_check_clean(fs, &dev, "after copies");
    let fs = common::open_quiet(&dev);
    assert_eq!(read_all(&fs, "a"), want);
    assert_eq!(read_all(&fs, "d"), want_d);
    common::close_and_check_clean(fs, &dev, "reopened");
}

#[test]
fn holes_and_preallocated_space_stay_zeros_in_the_clone() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    let a = put(&fs, "a", b"");
    fs.write(InodeNo::new(a), 0, &pattern(2 * 4096, 5), false)
        .expect("head");
    fs.write(InodeNo::new(a), 6 * 4096, &pattern(2 * 4096, 6), false)
        .expect("tail");
    fs.fallocate(
        InodeNo::new(a),
        3 * 4096,
        2 * 4096,
        libc::FALLOC_FL_KEEP_SIZE,
    )
    .expect("prealloc");
    let want = read_all(&fs, "a");
    let b = put(&fs, "b", &pattern(8 * 4096, 7));
    fs.copy_file_range(InodeNo::new(a), 0, InodeNo::new(b), 0, 8 * 4096)
        .expect("clone");
    assert_eq!(read_all(&fs, "b"), want);
    fs.sync().expect("sync");
    common::close_and_check_clean(fs, &dev, "holes");
}

#[test]
fn buffered_data_is_written_before_it_is_shared() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    let a = put(&fs, "a", &pattern(8 * 4096, 8));
    fs.sync().expect("sync");
    // Buffered, not yet on disk.
    fs.write(InodeNo::new(a), 4096, &[0x55; 4096], false)
        .expect("buffered write");
    let want = read_all(&fs, "a");
    let b = put(&fs, "b", b"");
    fs.copy_file_range(InodeNo::new(a), 0, InodeNo::new(b), 0, 8 * 4096)
        .expect("clone");
    assert_eq!(read_all(&fs, "b"), want);
    fs.sync().expect("sync");
    common::close_and_check_clean(fs, &dev, "buffered");
    let fs = common::open_quiet(&dev);
    assert_eq!(read_all(&fs, "b"), want);
    common::close_and_check_clean(fs, &dev, "reopened");
}

#[test]
fn clone_fsync_delete_the_source_crash() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    let data = pattern(300 * 1024, 10);
    let a = put(&fs, "a", &data);
    fs.sync().expect("sync");
    let b = put(&fs, "b", b"");
    fs.copy_file_range(InodeNo::new(a), 0, InodeNo::new(b), 0, data.len() as u64)
        .expect("clone");
    let before = fs.engine().counters().values();
    fs.fsync(InodeNo::new(b), false).expect("fsync");
    let c = fs.engine().counters().values().since(&before);
    assert_eq!(c.fsync_fallback_clone, 1, "an fsync after a clone commits");
    remove(&fs, "a");
    // Committed now: a's deletion leaves b's blocks.
    fs.sync().expect("sync");
    churn(&fs);
    assert_eq!(read_all(&fs, "b"), data);
    // Then a write to b, logged by its fsync (the clone is committed: pieces of the shared
    // extent go to the log), and the power goes.
    fs.write(InodeNo::new(b), 4096, &[0x77; 4096], false)
        .expect("write");
    let before = fs.engine().counters().values();
    fs.fsync(InodeNo::new(b), false)
        .expect("fsync after the commit");
    let c = fs.engine().counters().values().since(&before);
    assert_eq!(c.fsync_fallback_clone, 0);
    let (crashed, fs) = common::crash_and_reopen(fs, &dev);
    let mut want = data.clone();
    want[4096..8192].fill(0x77);
    assert_eq!(read_all(&fs, "b"), want);
    assert!(fs.lookup(ROOT, b"a").is_err());
    common::close_and_check_clean(fs, &crashed, "after the crash");
}

/// Review finding: the per-inode mark that makes an fsync after a clone commit went with the
/// inode's state when the kernel forgot it; an fsync of the clone after that logged its shared
/// pieces while the committed source was unflagged, and the image no longer opened after a
/// crash. An engine-wide mark now makes that fsync commit too.
#[test]
fn an_fsync_after_a_clone_commits_also_once_the_inode_was_evicted() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    // An earlier clone, committed: the incompat flag is durable.
    let first = pattern(64 * 1024, 3);
    let x = put(&fs, "x", &first);
    let y = put(&fs, "y", b"");
    fs.copy_file_range(InodeNo::new(x), 0, InodeNo::new(y), 0, first.len() as u64)
        .expect("first clone");
    fs.sync().expect("sync");
    let data = pattern(200 * 1024, 11);
    let a = put(&fs, "a", &data);
    fs.sync().expect("sync");
    let b = put(&fs, "b", b"");
    fs.copy_file_range(InodeNo::new(a), 0, InodeNo::new(b), 0, data.len() as u64)
        .expect("clone");
    // The kernel forgets b (no opens, no lookups): its state is evicted.
    fs.forget(InodeNo::new(b), u64::MAX);
    let b = ino(&fs, "b");
    let before = fs.engine().counters().values();
    fs.fsync(InodeNo::new(b), false).expect("fsync");
    let c = fs.engine().counters().values().since(&before);
    assert_eq!(c.fsync_fallback_clone, 1, "the fsync commits");
    let (crashed, fs) = common::crash_and_reopen(fs, &dev);
    assert_eq!(read_all(&fs, "b"), data);
    assert_eq!(read_all(&fs, "a"), data);
    common::close_and_check_clean(fs, &crashed, "after the crash");
}

#[test]
fn a_crash_before_the_clone_commits_loses_only_the_clone() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    let data = pattern(200 * 1024, 11);
    let a = put(&fs, "a", &data);
    let b = put(&fs, "b", b"");
    fs.sync().expect("sync");
    fs.copy_file_range(InodeNo::new(a), 0, InodeNo::new(b), 0, data.len() as u64)
        .expect("clone");
    // The source is fsync'd (it changed: flagged): that commits too.
    fs.fsync(InodeNo::new(a), false).expect("fsync a");
    fs.write(InodeNo::new(b), 0, &[1u8; 4096], false)
        .expect("write b");
    remove(&fs, "a");
    let (crashed, fs) = common::crash_and_reopen(fs, &dev);
    assert_eq!(read_all(&fs, "a"), data);
    assert_eq!(
        read_all(&fs, "b"),
        data,
        "the clone was committed by a's fsync"
    );
    fsck_clean(&crashed, "after the crash");
    drop(fs);
    // Without any fsync: the crash loses the clone whole, and the source is unflagged.
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    let a = put(&fs, "a", &data);
    let b = put(&fs, "b", b"");
    fs.sync().expect("sync");
    fs.copy_file_range(InodeNo::new(a), 0, InodeNo::new(b), 0, data.len() as u64)
        .expect("clone");
    let (crashed, fs) = common::crash_and_reopen(fs, &dev);
    assert_eq!(read_all(&fs, "a"), data);
    assert_eq!(read_all(&fs, "b"), b"");
    assert_eq!(shared_blocks(&fs), 0);
    common::close_and_check_clean(fs, &crashed, "clone lost");
}

#[test]
fn snapshot_and_clone() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    fs.sync().expect("sync");
    let empty = fs.statfs().bfree;
    let data = pattern(1 << 20, 12);
    let a = put(&fs, "a", &data);
    let b = put(&fs, "b", b"");
    fs.copy_file_range(InodeNo::new(a), 0, InodeNo::new(b), 0, data.len() as u64)
        .expect("clone");
    let snap = fs.create_snapshot("s").expect("snapshot");
    // Overwrite all of a and half of b, then a clone of b's other half into c.
    fs.write(InodeNo::new(a), 0, &vec![0xA1; 1 << 20], false)
        .expect("overwrite a");
    fs.write(InodeNo::new(b), 0, &vec![0xB2; 512 << 10], false)
        .expect("overwrite b");
    let c = put(&fs, "c", b"");
    fs.copy_file_range(InodeNo::new(b), 512 << 10, InodeNo::new(c), 0, 512 << 10)
        .expect("clone b to c");
    fs.sync().expect("sync");
    let view = fs.engine().snapshot_view(snap.id).expect("view");
    let root_b = view.get(&Key::new(b, ItemType::InodeItem, 0)).expect("get");
    assert!(root_b.is_some(), "b in the snapshot");
    drop(view);
    remove(&fs, "b");
    fs.sync().expect("sync");
    churn(&fs);
    assert_eq!(read_all(&fs, "c"), &data[512 << 10..]);
    common::close_and_check_clean(fs, &dev, "snapshot holds the clone's old blocks");
    let fs = common::open_quiet(&dev);
    assert_eq!(read_all(&fs, "c"), &data[512 << 10..]);
    // Reading the snapshot's old a and b through their extents.
    let view = fs.engine().snapshot_view(snap.id).expect("view");
    for ino in [a, b] {
        let lo = Key::new(ino, ItemType::ExtentData, 0);
        let hi = Key::new(ino, ItemType::ExtentData, u64::MAX);
        let mut got = vec![0u8; data.len()];
        for (key, value) in view.range(&lo, &hi, usize::MAX).expect("range") {
            let e = FileExtent::decode(&value).expect("extent");
            if let ExtentKind::Regular { disk_addr, csums } = e.kind {
                let mut buf = vec![0u8; csums.len() * BLOCK_SIZE as usize];
                dev.read_at(&mut buf, disk_addr).expect("read");
                let at = key.offset as usize;
                let end = (at + buf.len()).min(got.len());
                got[at..end].copy_from_slice(&buf[..end - at]);
            }
        }
        assert_eq!(got, data, "snapshot's inode {ino}");
    }
    drop(view);
    fs.delete_snapshot("s").expect("delete snapshot");
    fs.sync().expect("sync");
    churn(&fs);
    assert_eq!(read_all(&fs, "c"), &data[512 << 10..]);
    common::close_and_check_clean(fs, &dev, "snapshot deleted");
    let fs = common::open_quiet(&dev);
    assert_eq!(read_all(&fs, "c"), &data[512 << 10..]);
    remove(&fs, "a");
    remove(&fs, "c");
    fs.sync().expect("sync");
    let back = fs.statfs().bfree;
    assert!(back + 32 >= empty, "space back: {back} vs {empty}");
    common::close_and_check_clean(fs, &dev, "all gone");
}

/// Deleting the only snapshot that still names a clone's blocks gives them back at that
/// commit, without a reopen (the deletion walk frees the victim's shared blocks no tree
/// names; it left them to the next open before).
#[test]
fn deleting_a_snapshot_gives_back_cloned_blocks_at_once() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    fs.sync().expect("sync");
    let empty = fs.statfs().bfree;
    let data = pattern(2 << 20, 21);
    let a = put(&fs, "a", &data);
    let b = put(&fs, "b", b"");
    fs.copy_file_range(InodeNo::new(a), 0, InodeNo::new(b), 0, data.len() as u64)
        .expect("clone");
    fs.create_snapshot("s").expect("snapshot");
    remove(&fs, "a");
    remove(&fs, "b");
    fs.sync().expect("sync");
    let held = fs.statfs().bfree;
    assert!(
        held + 512 <= empty,
        "the snapshot holds the 512 shared blocks: {held} vs {empty}"
    );
    fs.delete_snapshot("s").expect("delete snapshot");
    fs.sync().expect("sync");
    let back = fs.statfs().bfree;
    assert!(
        back + 32 >= empty,
        "the shared blocks are free after the deletion: {back} vs {empty}"
    );
    churn(&fs);
    common::close_and_check_clean(fs, &dev, "snapshot with a clone deleted");
}

/// A clone's block named by a leaf only the deleted snapshot has (the clone's, since removed)
/// and by a leaf the snapshot shares with a newer one (the source's, untouched) stays used:
/// the deletion reads the newer tree's shared subtrees for it. Files made between the clone
/// and the source and after the source put the source's items in a leaf of their own, which
/// removing the clone (its inode and the root directory's entries, lower keys) leaves alone.
#[test]
fn a_cloned_block_a_newer_snapshot_still_names_stays_used() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    let data = pattern(1 << 20, 22);
    let b = put(&fs, "b", b"");
    for i in 0..300 {
        put(&fs, &format!("filler{i:04}"), &[i as u8; 300]);
    }
    let a = put(&fs, "a", &data);
    for i in 300..600 {
        put(&fs, &format!("filler{i:04}"), &[i as u8; 300]);
    }
    fs.copy_file_range(InodeNo::new(a), 0, InodeNo::new(b), 0, data.len() as u64)
        .expect("clone");
    fs.create_snapshot("older").expect("snapshot older");
    remove(&fs, "b");
    fs.create_snapshot("newer").expect("snapshot newer");
    fs.delete_snapshot("older").expect("delete older");
    fs.sync().expect("sync");
    churn(&fs);
    assert_eq!(read_all(&fs, "a"), data, "a after the older snapshot went");
    common::close_and_check_clean(fs, &dev, "older snapshot deleted");
    let fs = common::open_quiet(&dev);
    assert_eq!(read_all(&fs, "a"), data);
    fs.delete_snapshot("newer").expect("delete newer");
    fs.sync().expect("sync");
    churn(&fs);
    assert_eq!(read_all(&fs, "a"), data, "a after both snapshots went");
    remove(&fs, "a");
    fs.sync().expect("sync");
    churn(&fs);
    common::close_and_check_clean(fs, &dev, "both snapshots and the source gone");
}

#[test]
fn a_clone_succeeds_where_a_byte_copy_finds_no_space() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    // More than half of what is free: a second copy of the bytes cannot fit.
    let avail = fs.statfs().bavail;
    let blocks = avail * 6 / 10;
    let data = pattern((blocks * BLOCK_SIZE) as usize, 13);
    let a = put(&fs, "a", &data);
    fs.sync().expect("sync");
    let b = put(&fs, "b", b"");
    // Offsets that differ within a block: a byte copy, which runs out of space part-way and
    // answers the bytes it copied (a short count, as write(2)); the next call finds no space.
    let n = fs
        .copy_file_range(
            InodeNo::new(a),
            1,
            InodeNo::new(b),
            0,
            data.len() as u64 - 1,
        )
        .expect("a short byte copy");
    assert!(n < data.len() as u64 - 1, "a byte copy does not fit: {n}");
    assert_eq!(read_all(&fs, "b"), &data[1..1 + n as usize]);
    let err = fs
        .copy_file_range(
            InodeNo::new(a),
            1 + n,
            InodeNo::new(b),
            n,
            data.len() as u64 - 1 - n,
        )
        .expect_err("no space left for the rest");
    assert!(matches!(err, Error::NoSpace(_)), "{err:?}");
    fs.setattr(
        InodeNo::new(b),
        &birch_core::vfs::SetAttr {
            size: Some(0),
            ..Default::default()
        },
    )
    .expect("truncate b");
    fs.sync().expect("sync");
    let c = put(&fs, "c", b"");
    let n = fs
        .copy_file_range(InodeNo::new(a), 0, InodeNo::new(c), 0, data.len() as u64)
        .expect("a clone takes metadata only");
    assert_eq!(n, data.len() as u64);
    fs.sync().expect("sync");
    assert_eq!(read_all(&fs, "c"), data);
    common::close_and_check_clean(fs, &dev, "clone on a full filesystem");
}

/// On a full filesystem a copy whose middle can be shared but whose unaligned tail needs a
/// data block answers the bytes up to the tail (a short count, the destination holding exactly
/// that prefix); one whose unaligned head finds no block copies nothing and answers ENOSPC.
/// The head is copied before the middle is shared, so no failure leaves shared blocks behind
/// an uncopied head.
#[test]
fn a_copy_that_runs_out_of_space_after_sharing_answers_a_short_count() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    let aligned = 256 * BLOCK_SIZE as usize;
    let data = pattern(aligned + 100, 23);
    put(&fs, "a", &data);
    let a = ino(&fs, "a");
    fs.sync().expect("sync");
    // Fill the data space: large writes, then single blocks, until ENOSPC.
    let fill = put(&fs, "fill", b"");
    let mut at = 0u64;
    for chunk in [64usize << 10, BLOCK_SIZE as usize] {
        loop {
            match fs.write(InodeNo::new(fill), at, &vec![0xEE; chunk], false) {
                Ok(_) => at += chunk as u64,
                Err(Error::NoSpace(_)) => break,
                Err(e) => panic!("fill: {e}"),
            }
        }
    }
    fs.sync().expect("sync");
    let c = put(&fs, "c", b"");
    let n = fs
        .copy_file_range(InodeNo::new(a), 0, InodeNo::new(c), 0, data.len() as u64)
        .expect("a short count");
    assert_eq!(n, aligned as u64, "the shared middle, not the tail");
    assert_eq!(read_all(&fs, "c"), &data[..aligned]);
    let d = put(&fs, "d", b"");
    let err = fs
        .copy_file_range(InodeNo::new(a), 100, InodeNo::new(d), 100, aligned as u64)
        .expect_err("no block for the head");
    assert!(matches!(err, Error::NoSpace(_)), "{err:?}");
    assert_eq!(
        fs.getattr(InodeNo::new(d)).expect("getattr d").size,
        0,
        "nothing copied"
    );
    remove(&fs, "fill");
    fs.sync().expect("sync");
    let rest = fs
        .copy_file_range(
            InodeNo::new(a),
            n,
            InodeNo::new(c),
            n,
            data.len() as u64 - n,
        )
        .expect("the tail");
    assert_eq!(rest, 100);
    assert_eq!(read_all(&fs, "c"), data);
    common::close_and_check_clean(fs, &dev, "short copies on a full filesystem");
}

#[test]
fn fsck_names_a_shared_extent_on_an_unshared_block() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    let data = pattern(8 * 4096, 14);
    let a = put(&fs, "a", &data);
    let b = put(&fs, "b", b"");
    fs.copy_file_range(InodeNo::new(a), 0, InodeNo::new(b), 0, data.len() as u64)
        .expect("clone");
    fs.sync().expect("sync");
    // Unflag the source's extent by hand: b's shared extent now names blocks an unshared
    // extent holds.
    let (key, mut extent) = {
        let lo = Key::new(a, ItemType::ExtentData, 0);
        let (k, v) = fs
            .engine()
            .range(&lo, &Key::new(a, ItemType::ExtentData, u64::MAX), 1)
            .expect("range")
            .remove(0);
        (k, FileExtent::decode(&v).expect("extent"))
    };
    extent.shared = false;
    fs.engine()
        .begin()
        .expect("begin")
        .put(key, extent.encode());
    fs.close().expect("close");
    drop(fs);
    let report = check(&*dev, CheckOptions { data: true }).expect("fsck");
    assert!(
        report
            .findings
            .iter()
            .any(|f| f.kind == birch_core::check::FindingKind::SharedExtentConflict),
        "{:?}",
        report.findings
    );
    // And the open refuses it.
    assert!(Filesystem::open_device(
        dev.clone() as std::sync::Arc<dyn BlockDevice>,
        Default::default()
    )
    .is_err());
}

#[test]
fn fsck_repair_leaves_clones_alone() {
    use birch_core::repair::{repair, RepairMode};
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    let data = pattern(40 * 4096, 15);
    let a = put(&fs, "a", &data);
    let b = put(&fs, "b", b"");
    fs.copy_file_range(InodeNo::new(a), 0, InodeNo::new(b), 0, data.len() as u64)
        .expect("clone");
    fs.write(InodeNo::new(b), 4096, &[3u8; 4096], false)
        .expect("write");
    common::close_and_check_clean(fs, &dev, "before the repair");
    let image = dev.snapshot();
    let report = repair(
        dev.clone() as std::sync::Arc<dyn BlockDevice>,
        RepairMode::Full,
        CheckOptions { data: true },
    )
    .expect("repair");
    assert_eq!(report.exit_code(), 0, "{:?}", report.actions);
    assert!(report.actions.is_empty(), "{:?}", report.actions);
    assert!(dev.snapshot() == image, "a clean image is left as it is");
    let fs = common::open_quiet(&dev);
    assert_eq!(read_all(&fs, "a"), data);
    common::close_and_check_clean(fs, &dev, "after the repair");
}
