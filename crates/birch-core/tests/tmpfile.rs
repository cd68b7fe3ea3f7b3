//! O_TMPFILE at library level: an unnamed file is an orphan from its first transaction.
//!
//! `Filesystem::tmpfile` makes a regular file with no name (link count 0) and puts its orphan
//! item in the same transaction, so nothing can leak it: a power cut before it is named frees
//! it at the next mount, and so does its last close. `link` may give it a name once (Linux's
//! `I_LINKABLE`), removing the orphan item in the same transaction; after a name is gone, or
//! when it was made with `O_EXCL`, it stays nameless (ENOENT), as an ordinary file unlinked
//! while open. The crash tests cut the power (no close, no final commit), reopen, and run fsck.

#![allow(clippy::expect_used)]

use birch_core::vfs::Caller;
use birch_core::Filesystem;
use birch_format::{ItemType, Key, ORPHAN_OBJECTID, ROOT_INO};

mod common;

const MIB: usize = 1 << 20;

fn orphans(fs: &Filesystem) -> Vec<u64> {
    fs.engine()
        .range(
            &Key::new(ORPHAN_OBJECTID, ItemType::Orphan, 0),
            &Key::new(ORPHAN_OBJECTID, ItemType::Orphan, u64::MAX),
            usize::MAX,
        )
        .expect("orphans")
        .into_iter()
        .map(|(k, _)| k.offset)
        .collect()
}

/// The root directory's names, without `.` and `..`.
fn names(fs: &Filesystem) -> Vec<Vec<u8>> {
    fs.readdir(ROOT_INO, 0, 100)
        .expect("readdir")
        .into_iter()
        .map(|e| e.name)
        .filter(|n| n != b"." && n != b"..")
        .collect()
}

fn used_blocks(fs: &Filesystem) -> u64 {
    let s = fs.statfs();
    s.blocks - s.bfree
}

#[test]
fn tmpfile_is_an_unnamed_orphan_and_its_last_close_frees_it() {
    let (dev, fs) = common::fresh(64 << 20);
    fs.sync().expect("commit");
    let used_before = used_blocks(&fs);
    let (a, fh) = fs
        .tmpfile(Caller::default(), ROOT_INO, 0o600, libc::O_RDWR)
        .expect("tmpfile");
    assert_eq!(a.nlink, 0);
    assert_eq!(a.kind, birch_core::vfs::FileKind::File);
    assert_eq!(
        orphans(&fs),
        vec![a.ino.get()],
        "orphan item from the start"
    );
    assert!(names(&fs).is_empty());
    fs.write(a.ino, 0, &[7u8; MIB], false).expect("write");
    fs.fsync(a.ino, false).expect("fsync");
    assert_eq!(fs.read(a.ino, 0, 4).expect("read"), vec![7u8; 4]);
    fs.release(a.ino, fh).expect("release");
    fs.forget(a.ino, 1);
    assert!(
        orphans(&fs).is_empty(),
        "freed at the last close and forget"
    );
    fs.sync().expect("commit");
    assert!(
        used_blocks(&fs) <= used_before + 8,
        "space returned: {} used, {used_before} before",
        used_blocks(&fs)
    );
    common::close_and_check_clean(fs, &dev, "after a tmpfile was closed");
}

#[test]
fn tmpfile_never_linked_leaves_nothing_after_a_power_cut() {
    let (dev, fs) = common::fresh(64 << 20);
    fs.sync().expect("commit");
    let used_before = used_blocks(&fs);
    let (a, _fh) = fs
        .tmpfile(Caller::default(), ROOT_INO, 0o600, libc::O_RDWR)
        .expect("tmpfile");
    fs.write(a.ino, 0, &[3u8; 2 * MIB], false).expect("write");
    // fsync of a nameless file commits: the inode, its data and its orphan item are durable.
    fs.fsync(a.ino, false).expect("fsync");
    let (crashed, fs) = common::crash_and_reopen(fs, &dev);
    assert!(orphans(&fs).is_empty(), "the orphan was reclaimed at mount");
    assert_eq!(
        fs.getattr(a.ino).map_err(|e| e.errno()).err(),
        Some(libc::ENOENT),
        "the tmpfile is gone"
    );
    assert!(names(&fs).is_empty());
    fs.sync().expect("commit");
    assert!(
        used_blocks(&fs) <= used_before + 8,
        "space returned: {} used, {used_before} before",
        used_blocks(&fs)
    );
    common::close_and_check_clean(fs, &crashed, "after a power cut with a tmpfile open");
}

/// Links a tmpfile, fsyncs it and cuts the power; `commit_nameless` commits it first, so its
/// orphan item is durable and the fsync log must remove it.
fn linked_and_fsynced_survives(commit_nameless: bool) {
    let (dev, fs) = common::fresh(64 << 20);
    let (a, _fh) = fs
        .tmpfile(Caller::default(), ROOT_INO, 0o640, libc::O_RDWR)
        .expect("tmpfile");
    fs.write(a.ino, 0, b"journal", false).expect("write");
    if commit_nameless {
        fs.sync().expect("commit the nameless file");
    }
    let linked = fs.link(a.ino, ROOT_INO, b"named").expect("linkat");
    assert_eq!(linked.nlink, 1);
    assert!(orphans(&fs).is_empty(), "the link removes the orphan item");
    let before = fs.engine().counters().values();
    fs.fsync(a.ino, false).expect("fsync");
    let after = fs.engine().counters().values().since(&before);
    if commit_nameless {
        // The name's directory was committed: the log path, which carries the deletion of
        // the committed orphan item.
        assert_eq!(after.fsync_log, 1, "{after}");
    }
    let (crashed, fs) = common::crash_and_reopen(fs, &dev);
    assert!(orphans(&fs).is_empty(), "no orphan item for a named file");
    assert_eq!(fs.read_file("/named").expect("read"), b"journal");
    let attr = fs.getattr(a.ino).expect("getattr");
    assert_eq!((attr.nlink, attr.perm), (1, 0o640));
    common::close_and_check_clean(fs, &crashed, "after a linked tmpfile's fsync");
}

#[test]
fn tmpfile_linked_and_fsynced_survives_a_power_cut() {
    linked_and_fsynced_survives(false);
}

#[test]
fn tmpfile_committed_nameless_then_linked_and_fsynced_survives_a_power_cut() {
    linked_and_fsynced_survives(true);
}

#[test]
fn only_a_tmpfile_never_named_and_not_o_excl_can_be_linked() {
    let (dev, fs) = common::fresh(64 << 20);
    let enoent = Some(libc::ENOENT);
    // O_EXCL: never linkable.
    let (x, _) = fs
        .tmpfile(
            Caller::default(),
            ROOT_INO,
            0o600,
            libc::O_RDWR | libc::O_EXCL,
        )
        .expect("tmpfile");
    assert_eq!(
        fs.link(x.ino, ROOT_INO, b"x").map_err(|e| e.errno()).err(),
        enoent
    );
    // Linked, then unlinked to 0: no longer linkable.
    let (t, _) = fs
        .tmpfile(Caller::default(), ROOT_INO, 0o600, libc::O_RDWR)
        .expect("tmpfile");
    fs.link(t.ino, ROOT_INO, b"t").expect("first link");
    fs.unlink(ROOT_INO, b"t").expect("unlink");
    assert_eq!(
        fs.link(t.ino, ROOT_INO, b"t2").map_err(|e| e.errno()).err(),
        enoent
    );
    // An ordinary file unlinked while open: ENOENT.
    let (f, _) = fs
        .create(Caller::default(), ROOT_INO, b"f", 0o600, libc::O_RDWR)
        .expect("create");
    fs.unlink(ROOT_INO, b"f").expect("unlink");
    assert_eq!(
        fs.link(f.ino, ROOT_INO, b"f2").map_err(|e| e.errno()).err(),
        enoent
    );
    assert!(names(&fs).is_empty());
    let mut left = orphans(&fs);
    left.sort_unstable();
    assert_eq!(
        left,
        vec![x.ino.get(), t.ino.get(), f.ino.get()],
        "all three still open orphans"
    );
    common::close_and_check_clean(fs, &dev, "after the link refusals");
}

#[test]
fn tmpfile_takes_the_default_acl_and_setgid_group_of_its_directory() {
    let (dev, fs) = common::fresh(64 << 20);
    let dir = fs
        .mkdir(Caller::default(), ROOT_INO, b"d", 0o2775)
        .expect("mkdir");
    fs.setattr(
        dir.ino,
        &birch_core::vfs::SetAttr {
            gid: Some(4242),
            ..Default::default()
        },
    )
    .expect("chgrp");
    let caller = Caller {
        uid: 1000,
        gid: 1000,
        umask: 0o077,
    };
    let (a, _) = fs
        .tmpfile(caller, dir.ino, 0o666, libc::O_RDWR)
        .expect("tmpfile");
    assert_eq!((a.uid, a.gid), (1000, 4242), "setgid directory's group");
    assert_eq!(a.perm, 0o600, "umask applied");
    common::close_and_check_clean(fs, &dev, "after a tmpfile in a setgid directory");
}
