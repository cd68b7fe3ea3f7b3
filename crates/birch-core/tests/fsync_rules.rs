//! The named rules under which an fsync commits instead of logging (`CommitReason`, DESIGN
//! §11.3): one test per rule. Each reaches its rule, checks that the fsync committed, that
//! the rule's counter (and the broader counter it is also counted in, if any) went up by one
//! and no other fallback counter moved, and that what the fsync covered survives a power cut.
//! `every_rule_has_a_test` fails to compile when a rule is added without a test here, and
//! fails when `CommitReason::ALL` misses a rule.

#![allow(clippy::expect_used)]

use std::collections::BTreeSet;
use std::sync::Arc;

use birch_core::device::MemDevice;
use birch_core::vfs::{Caller, CommitReason, FsyncMode, OpenOptions};
use birch_core::{Filesystem, MkfsOptions};
use birch_format::InodeNo;

mod common;

const ROOT: birch_format::InodeNo = birch_format::ROOT_INO;

fn fresh() -> (Arc<MemDevice>, Filesystem) {
    common::fresh(96 << 20)
}

/// fsyncs `ino` and asserts that it committed for `reason`: the rule's counter and its
/// broader one went up by one, no other `fsync_fallback_*` counter moved.
fn fsync_commits_for(fs: &Filesystem, ino: u64, reason: CommitReason) {
    let before = fs.engine().counters().values();
    fs.fsync(InodeNo::new(ino), false).expect("fsync");
    let after = fs.engine().counters().values().since(&before);
    assert_eq!(
        (after.fsync_commits, after.fsync_log),
        (1, 0),
        "{reason:?}: {after}"
    );
    let moved: BTreeSet<(&str, u64)> = after
        .pairs()
        .into_iter()
        .filter(|(name, value)| name.starts_with("fsync_fallback_") && *value > 0)
        .collect();
    let want: BTreeSet<(&str, u64)> = std::iter::once(reason.counter_name())
        .chain(reason.broader_counter_name())
        .map(|name| (name, 1))
        .collect();
    assert_eq!(moved, want, "{reason:?}: {after}");
}

/// Cuts the power, reopens (replay), runs `check` on what came back, and fscks.
fn after_a_crash(fs: Filesystem, dev: &MemDevice, what: &str, check: impl FnOnce(&Filesystem)) {
    let (crashed, fs) = common::crash_and_reopen(fs, dev);
    check(&fs);
    common::close_and_check_clean(fs, &crashed, what);
}

/// The test of each rule. A new rule does not compile here until it has one.
fn test_of(reason: CommitReason) -> fn() {
    match reason {
        CommitReason::CommitMode => commit_mode,
        CommitReason::LogFull => log_full,
        CommitReason::Directory => directory,
        CommitReason::Cloned => cloned,
        CommitReason::Unlinked => unlinked,
        CommitReason::IncompatPending => incompat_pending,
        CommitReason::NameRemoved => name_removed,
        CommitReason::NameHeld => name_held,
        CommitReason::NewParent => new_parent,
        CommitReason::HashCollision => hash_collision,
    }
}

#[test]
fn every_rule_has_a_test() {
    let all: BTreeSet<&str> = CommitReason::ALL.iter().map(|r| r.name()).collect();
    assert_eq!(all.len(), CommitReason::ALL.len(), "a rule twice in ALL");
    let tests: BTreeSet<usize> = CommitReason::ALL
        .iter()
        .map(|r| test_of(*r) as usize)
        .collect();
    assert_eq!(
        tests.len(),
        CommitReason::ALL.len(),
        "two rules share a test"
    );
    // Every variant is in ALL: each `test_of` arm's rule, listed once more by hand. A new
    // variant must be added to `test_of` (compile error) and here.
    let variants = [
        CommitReason::CommitMode,
        CommitReason::LogFull,
        CommitReason::Directory,
        CommitReason::Cloned,
        CommitReason::Unlinked,
        CommitReason::IncompatPending,
        CommitReason::NameRemoved,
        CommitReason::NameHeld,
        CommitReason::NewParent,
        CommitReason::HashCollision,
    ];
    for v in variants {
        assert!(CommitReason::ALL.contains(&v), "{v:?} missing from ALL");
    }
    assert_eq!(variants.len(), CommitReason::ALL.len());
}

#[test]
fn commit_mode() {
    let dev = common::fresh_device(96 << 20);
    let fs = Filesystem::open_device(
        dev.clone(),
        OpenOptions {
            commit_interval: None,
            fsync: FsyncMode::Commit,
            ..Default::default()
        },
    )
    .expect("open");
    let (f, _) = fs
        .create(Caller::default(), ROOT, b"f", 0o644, 0)
        .expect("create");
    fs.write(f.ino, 0, b"durable", false).expect("write");
    fsync_commits_for(&fs, f.ino.get(), CommitReason::CommitMode);
    after_a_crash(fs, &dev, "commit_mode", |fs| {
        assert_eq!(fs.read_file("/f").expect("f"), b"durable");
    });
}

#[test]
fn log_full() {
    // An image without a log area (a request under one block rounds down to none): no
    // batch fits.
    let dev = Arc::new(MemDevice::new(96 << 20));
    Filesystem::mkfs(
        dev.clone(),
        &MkfsOptions {
            log_bytes: 1,
            ..Default::default()
        },
    )
    .expect("mkfs");
    let fs = common::open_quiet(&dev);
    let (f, _) = fs
        .create(Caller::default(), ROOT, b"f", 0o644, 0)
        .expect("create");
    fs.sync().expect("commit");
    fs.write(f.ino, 0, b"durable", false).expect("write");
    fsync_commits_for(&fs, f.ino.get(), CommitReason::LogFull);
    after_a_crash(fs, &dev, "log_full", |fs| {
        assert_eq!(fs.read_file("/f").expect("f"), b"durable");
    });
}

#[test]
fn directory() {
    let (dev, fs) = fresh();
    let c = Caller::default();
    let d = fs.mkdir(c, ROOT, b"d", 0o755).expect("mkdir");
    fs.sync().expect("commit");
    // A name created without its file's fsync: the directory's fsync must make it durable.
    fs.create(c, d.ino, b"f", 0o644, 0).expect("create");
    fsync_commits_for(&fs, d.ino.get(), CommitReason::Directory);
    after_a_crash(fs, &dev, "directory", |fs| {
        fs.resolve("/d/f").expect("the name the fsyncdir covered");
    });
}

#[test]
fn cloned() {
    let (dev, fs) = fresh();
    let c = Caller::default();
    let data: Vec<u8> = (0..256 * 1024u32).map(|i| (i % 251) as u8).collect();
    let (a, _) = fs.create(c, ROOT, b"a", 0o644, 0).expect("create a");
    fs.write(a.ino, 0, &data, false).expect("write a");
    fs.sync().expect("commit");
    let (b, _) = fs.create(c, ROOT, b"b", 0o644, 0).expect("create b");
    fs.copy_file_range(a.ino, 0, b.ino, 0, data.len() as u64)
        .expect("clone");
    fsync_commits_for(&fs, b.ino.get(), CommitReason::Cloned);
    after_a_crash(fs, &dev, "cloned", |fs| {
        assert_eq!(fs.read_file("/b").expect("b"), data);
    });
}

#[test]
fn unlinked() {
    let (dev, fs) = fresh();
    let (f, _fh) = fs
        .create(Caller::default(), ROOT, b"f", 0o644, 0)
        .expect("create");
    fs.write(f.ino, 0, b"first", false).expect("write");
    fs.sync().expect("commit");
    // Unlinked while open: link count 0, an orphan item.
    fs.unlink(ROOT, b"f").expect("unlink");
    fs.write(f.ino, 0, b"second", false).expect("write");
    fsync_commits_for(&fs, f.ino.get(), CommitReason::Unlinked);
    after_a_crash(fs, &dev, "unlinked", |fs| {
        assert!(fs.resolve("/f").is_err(), "the name's removal is durable");
    });
}

#[test]
fn incompat_pending() {
    let (dev, fs) = fresh();
    let (f, _) = fs
        .create(Caller::default(), ROOT, b"f", 0o644, 0)
        .expect("create");
    fs.sync().expect("commit");
    // The first out-of-line xattr value wants INCOMPAT_XATTR_CHUNKS, which no commit set yet.
    let big = vec![0x5a; 20_000];
    fs.setxattr(f.ino, b"user.big", &big, 0).expect("setxattr");
    fsync_commits_for(&fs, f.ino.get(), CommitReason::IncompatPending);
    after_a_crash(fs, &dev, "incompat_pending", |fs| {
        let ino = fs.resolve("/f").expect("f");
        assert_eq!(fs.getxattr(ino, b"user.big").expect("xattr"), big);
    });
}

#[test]
fn name_removed() {
    let (dev, fs) = fresh();
    let (f, _) = fs
        .create(Caller::default(), ROOT, b"a", 0o644, 0)
        .expect("create");
    fs.write(f.ino, 0, b"data", false).expect("write");
    fs.sync().expect("commit");
    fs.rename(ROOT, b"a", ROOT, b"b", 0).expect("rename");
    fsync_commits_for(&fs, f.ino.get(), CommitReason::NameRemoved);
    after_a_crash(fs, &dev, "name_removed", |fs| {
        assert!(fs.resolve("/a").is_err(), "old name gone");
        assert_eq!(fs.read_file("/b").expect("b"), b"data");
    });
}

#[test]
fn name_held() {
    let (dev, fs) = fresh();
    let c = Caller::default();
    let (x, _fh) = fs.create(c, ROOT, b"foo", 0o644, 0).expect("create x");
    fs.write(x.ino, 0, b"first", false).expect("write x");
    fs.sync().expect("commit");
    // x keeps its committed entry under "foo" in replay's base and still exists (open): its
    // unlink is more than a move, so it cannot be logged with the new file.
    fs.unlink(ROOT, b"foo").expect("unlink x");
    let (y, _) = fs.create(c, ROOT, b"foo", 0o644, 0).expect("create y");
    fs.write(y.ino, 0, b"second", false).expect("write y");
    fsync_commits_for(&fs, y.ino.get(), CommitReason::NameHeld);
    after_a_crash(fs, &dev, "name_held", |fs| {
        assert_eq!(fs.read_file("/foo").expect("foo"), b"second");
    });
}

#[test]
fn new_parent() {
    let (dev, fs) = fresh();
    let c = Caller::default();
    let d = fs.mkdir(c, ROOT, b"d", 0o755).expect("mkdir");
    let (f, _) = fs.create(c, d.ino, b"f", 0o644, 0).expect("create");
    fs.write(f.ino, 0, b"data", false).expect("write");
    fsync_commits_for(&fs, f.ino.get(), CommitReason::NewParent);
    after_a_crash(fs, &dev, "new_parent", |fs| {
        assert_eq!(fs.read_file("/d/f").expect("d/f"), b"data");
    });
}

/// Two names with the same 64-bit FNV-1a hash (found by a Pollard rho search): one dir item
/// holds both entries.
const COLLIDING: [&[u8]; 2] = [
    &[0xbf, 0xf4, 0xfb, 0x9c, 0xc1, 0x85, 0xd0, 0xe1, 0xe0, 0x81],
    &[0xf0, 0xeb, 0xdf, 0x93, 0x8e, 0xeb, 0x88, 0xef, 0xcb, 0x80],
];

#[test]
fn hash_collision() {
    assert_eq!(
        birch_format::name_hash(&[COLLIDING[0]]),
        birch_format::name_hash(&[COLLIDING[1]])
    );
    let (dev, fs) = fresh();
    let c = Caller::default();
    let (a, _) = fs
        .create(c, ROOT, COLLIDING[0], 0o644, 0)
        .expect("create a");
    fs.write(a.ino, 0, b"first", false).expect("write a");
    fs.sync().expect("commit");
    let (b, _) = fs
        .create(c, ROOT, COLLIDING[1], 0o644, 0)
        .expect("create b");
    fs.write(b.ino, 0, b"second", false).expect("write b");
    fsync_commits_for(&fs, b.ino.get(), CommitReason::HashCollision);
    after_a_crash(fs, &dev, "hash_collision", |fs| {
        let a = fs.lookup(ROOT, COLLIDING[0]).expect("a").ino;
        let b = fs.lookup(ROOT, COLLIDING[1]).expect("b").ino;
        assert_eq!(fs.read(a, 0, 100).expect("read a"), b"first");
        assert_eq!(fs.read(b, 0, 100).expect("read b"), b"second");
    });
}
