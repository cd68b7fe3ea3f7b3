//! xattr values over one item (XATTR_VALUE_MAX, 7168 bytes) up to Linux's XATTR_SIZE_MAX
//! (65,536 bytes, what xfstests generic/020 sets): stored out of line in chunk items behind
//! the incompat flag INCOMPAT_XATTR_CHUNKS (FORMAT.md §6.5, §6.8, §9), set only by the first
//! commit that holds such a value; fsync logs them once the flag is durable; fsck checks them.

#![allow(clippy::expect_used)]

mod common;

use birch_core::check::{check, CheckOptions, FindingKind};
use birch_core::vfs::Caller;
use birch_core::Error;
use birch_format::superblock::INCOMPAT_XATTR_CHUNKS;
use birch_format::ROOT_INO;

fn value(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn a_65536_byte_value_round_trips_and_sets_the_flag_at_its_commit() {
    let (dev, fs) = common::fresh(96 << 20);
    let c = Caller::default();
    let (f, _) = fs.create(c, ROOT_INO, b"f", 0o644, 0).expect("create");
    fs.setxattr(f.ino, b"user.small", b"v", 0).expect("small");
    fs.sync().expect("commit");
    assert_eq!(
        fs.engine().superblock().incompat,
        0,
        "small values leave the image readable by older builds"
    );
    let big = value(65536, 1);
    fs.setxattr(f.ino, b"user.big", &big, 0)
        .expect("a 65536-byte value (XATTR_SIZE_MAX)");
    assert_eq!(fs.getxattr(f.ino, b"user.big").expect("get"), big);
    let names = fs.listxattr(f.ino).expect("list");
    assert!(names.windows(9).any(|w| w == b"user.big\0"), "listed");
    fs.sync().expect("commit");
    assert_eq!(
        fs.engine().superblock().incompat & INCOMPAT_XATTR_CHUNKS,
        INCOMPAT_XATTR_CHUNKS,
        "the commit that holds the value sets the flag"
    );
    match fs.setxattr(f.ino, b"user.toobig", &value(65537, 2), 0) {
        Err(Error::TooLong(_)) => {}
        other => panic!("65537 bytes: {other:?}, expected E2BIG"),
    }
    common::close_and_check_clean(fs, &dev, "after a big value");
    let fs = common::open_quiet(&dev);
    let f = fs.resolve("/f").expect("resolve");
    assert_eq!(fs.getxattr(f, b"user.big").expect("get after reopen"), big);
    assert_eq!(fs.getxattr(f, b"user.small").expect("small"), b"v");
    common::close_and_check_clean(fs, &dev, "reopened");
}

#[test]
fn replacing_and_removing_big_values_leaves_no_chunk_behind() {
    let (dev, fs) = common::fresh(96 << 20);
    let c = Caller::default();
    let (f, _) = fs.create(c, ROOT_INO, b"f", 0o644, 0).expect("create");
    let (g, _) = fs.create(c, ROOT_INO, b"g", 0o644, 0).expect("create");
    // 16 chunks, then 3, then inline, then 2, then removed.
    for (len, seed) in [(65536, 1u8), (9000, 2), (100, 3), (7169, 4)] {
        let v = value(len, seed);
        fs.setxattr(f.ino, b"user.x", &v, 0).expect("set");
        assert_eq!(fs.getxattr(f.ino, b"user.x").expect("get"), v, "{len}");
        fs.sync().expect("commit");
        let report = check(&*dev, CheckOptions { data: true }).expect("fsck");
        assert!(report.is_clean(), "after {len}: {:?}", report.findings);
    }
    fs.removexattr(f.ino, b"user.x").expect("remove");
    assert!(fs.getxattr(f.ino, b"user.x").is_err());
    // A file with a big value, unlinked: its chunks go with it.
    fs.setxattr(g.ino, b"trusted.big", &value(30000, 5), 0)
        .expect("set");
    fs.sync().expect("commit");
    fs.unlink(ROOT_INO, b"g").expect("unlink");
    common::close_and_check_clean(fs, &dev, "after replace, remove and unlink");
}

#[test]
fn fsync_of_a_big_value_commits_first_then_logs() {
    let (dev, fs) = common::fresh(96 << 20);
    let c = Caller::default();
    let (f, _) = fs.create(c, ROOT_INO, b"f", 0o644, 0).expect("create");
    fs.sync().expect("commit");
    let first = value(20000, 7);
    fs.setxattr(f.ino, b"user.a", &first, 0).expect("set");
    let before = fs.engine().counters().values();
    fs.fsync(f.ino, false).expect("fsync");
    let after = fs.engine().counters().values().since(&before);
    assert_eq!(
        after.fsync_commits, 1,
        "the flag is not durable yet: a commit: {after}"
    );
    let second = value(65536, 8);
    fs.setxattr(f.ino, b"user.b", &second, 0).expect("set");
    let before = fs.engine().counters().values();
    fs.fsync(f.ino, false).expect("fsync");
    let after = fs.engine().counters().values().since(&before);
    assert_eq!(after.fsync_log, 1, "then the log: {after}");
    let (crashed, fs) = common::crash_and_reopen(fs, &dev);
    let f = fs.resolve("/f").expect("resolve");
    assert_eq!(fs.getxattr(f, b"user.a").expect("a"), first);
    assert_eq!(
        fs.getxattr(f, b"user.b").expect("b replayed from the log"),
        second
    );
    common::close_and_check_clean(fs, &crashed, "after replay");
}

#[test]
fn fsck_finds_a_missing_chunk() {
    let (dev, fs) = common::fresh(96 << 20);
    let c = Caller::default();
    let (f, _) = fs.create(c, ROOT_INO, b"f", 0o644, 0).expect("create");
    fs.setxattr(f.ino, b"user.big", &value(10000, 9), 0)
        .expect("set");
    fs.sync().expect("commit");
    // Drop chunk 1 behind the library's back.
    {
        let txn = fs.engine().begin().expect("txn");
        txn.delete(birch_format::Key::new(
            f.ino.get(),
            birch_format::ItemType::XattrChunk,
            birch_format::items::xattr_chunk_hash(b"user.big", 1),
        ));
    }
    assert!(
        fs.getxattr(f.ino, b"user.big").is_err(),
        "a value with a chunk missing is EIO"
    );
    fs.close().expect("close");
    drop(fs);
    let report = check(&*dev, CheckOptions { data: true }).expect("fsck");
    assert!(
        report
            .findings
            .iter()
            .any(|f| f.kind == FindingKind::XattrChunkMismatch),
        "{:?}",
        report.findings
    );
}
