//! Snapshots browsed through the POSIX API (DESIGN §15.8, SEMANTICS §9): the hidden
//! `/.snapshot` directory of the root, each snapshot read-only under it with inode numbers
//! that carry its id in bits 48..63, `EROFS` on every change, the reserved name, the refused
//! upgrade, `EBUSY` for a deletion while a file is open in the snapshot, a deleted snapshot's
//! inodes answering an error (never freed blocks), and one snapshot served alone as the root.

#![allow(clippy::expect_used)]

mod common;

use std::sync::Arc;

use birch_core::device::{BlockDevice, MemDevice};
use birch_core::items::{self, Changes, Link};
use birch_core::vfs::{snapshot_ino, Caller, SetAttr};
use birch_core::{Error, Filesystem, OpenOptions};
use birch_format::{InodeNo, Key, SNAPSHOT_DIR_INO, SNAPSHOT_DIR_OBJECTID};

const ROOT: birch_format::InodeNo = birch_format::ROOT_INO;
const MIB: u64 = 1 << 20;
const BLOCK: u64 = birch_format::BLOCK_SIZE;

fn errno(result: Result<impl std::fmt::Debug, Error>) -> i32 {
    match result {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.errno(),
    }
}

fn names(fs: &Filesystem, dir: u64) -> Vec<String> {
    fs.readdir(InodeNo::new(dir), 0, usize::MAX)
        .expect("readdir")
        .into_iter()
        .map(|e| String::from_utf8_lossy(&e.name).into_owned())
        .collect()
}

/// A filesystem with `/a` ("alpha"), `/d/b` (200 KiB in blocks), `/l -> a` and an xattr on
/// `/a`, and snapshot `s1` of it; then the live tree changes (`/a` rewritten, `/d/b` emptied
/// and removed,
/// `/c` made).
fn with_snapshot() -> (Arc<MemDevice>, Filesystem, Vec<u8>) {
    let (dev, fs) = common::fresh(64 * MIB);
    let c = Caller::default();
    fs.write_file("/a", b"alpha").expect("write a");
    let d = fs.mkdir(c, ROOT, b"d", 0o755).expect("mkdir");
    let big: Vec<u8> = (0..200 * 1024u32).map(|i| (i % 251) as u8).collect();
    fs.write_file("/d/b", &big).expect("write b");
    fs.symlink(c, ROOT, b"l", b"a").expect("symlink");
    let a = fs.resolve("/a").expect("a");
    fs.setxattr(a, b"user.k", b"v", 0).expect("setxattr");
    fs.create_snapshot("s1").expect("snapshot");
    fs.write_file("/a", b"changed").expect("rewrite a");
    // Truncated first: the embedded create counted a lookup that is never forgotten, so the
    // unlinked inode would keep its blocks until the close.
    let b = fs.resolve("/d/b").expect("b");
    let truncate = SetAttr {
        size: Some(0),
        ..Default::default()
    };
    fs.setattr(b, &truncate).expect("truncate b");
    fs.unlink(d.ino, b"b").expect("unlink b");
    fs.write_file("/c", b"new").expect("write c");
    fs.sync().expect("sync");
    (dev, fs, big)
}

#[test]
fn a_snapshot_is_browsable_under_the_hidden_directory() {
    let (dev, fs, big) = with_snapshot();
    let id = fs.engine().snapshots()[0].id;

    // Hidden from the root's listing, found by name.
    assert!(!names(&fs, ROOT.get()).contains(&".snapshot".to_string()));
    let dir = fs.lookup(ROOT, b".snapshot").expect("lookup .snapshot");
    assert_eq!(dir.ino, SNAPSHOT_DIR_INO);
    assert_eq!(dir.perm, 0o555);
    assert_eq!(names(&fs, SNAPSHOT_DIR_OBJECTID), [".", "..", "s1"]);
    let listed = fs.readdir(SNAPSHOT_DIR_INO, 0, 10).expect("readdir");
    assert_eq!(listed[1].ino, ROOT, "`..` of /.snapshot is the root");
    assert_eq!(fs.lookup(SNAPSHOT_DIR_INO, b"..").expect("..").ino, ROOT);

    // The snapshot's root: inode numbers with the snapshot id in bits 48..63.
    let s1 = fs.lookup(SNAPSHOT_DIR_INO, b"s1").expect("lookup s1");
    assert_eq!(s1.ino, snapshot_ino(id, ROOT));
    assert_eq!(s1.ino.get() >> 48, id);
    assert_eq!(listed[2].ino, s1.ino, "d_ino is st_ino");
    assert_eq!(names(&fs, s1.ino.get()), [".", "..", "a", "d", "l"]);
    let entries = fs.readdir(s1.ino, 0, 10).expect("readdir s1");
    assert_eq!(entries[1].ino, SNAPSHOT_DIR_INO, "`..` of a snapshot root");
    assert_eq!(fs.parent_of(s1.ino).expect("parent"), SNAPSHOT_DIR_INO);
    assert_eq!(fs.lookup(s1.ino, b"..").expect("..").ino, SNAPSHOT_DIR_INO);

    // Files as they were, the live tree as it is.
    let live_a = fs.resolve("/a").expect("live a");
    let a = fs.lookup(s1.ino, b"a").expect("lookup a");
    assert_eq!(
        a.ino,
        snapshot_ino(id, live_a),
        "same object id, other subvolume"
    );
    assert_eq!(entries[2].ino, a.ino);
    assert_eq!(fs.read(a.ino, 0, 100).expect("read a"), b"alpha");
    assert_eq!(fs.read(live_a, 0, 100).expect("read live a"), b"changed");
    assert_eq!(fs.getattr(a.ino).expect("getattr").size, 5);
    let d = fs.lookup(s1.ino, b"d").expect("lookup d");
    assert_eq!(fs.lookup(d.ino, b"..").expect("..").ino, s1.ino);
    let b = fs.lookup(d.ino, b"b").expect("lookup b in the snapshot");
    assert_eq!(fs.read(b.ino, 0, big.len() + 10).expect("read b"), big);
    assert_eq!(
        fs.read(b.ino, 4000, 9000).expect("read b middle"),
        &big[4000..13000]
    );
    assert_eq!(
        fs.lseek(b.ino, 10, libc::SEEK_HOLE).expect("seek hole"),
        big.len() as u64
    );
    assert_eq!(errno(fs.lookup(s1.ino, b"c")), libc::ENOENT);
    let l = fs.lookup(s1.ino, b"l").expect("lookup l");
    assert_eq!(fs.readlink(l.ino).expect("readlink"), b"a");
    assert_eq!(fs.getxattr(a.ino, b"user.k").expect("getxattr"), b"v");
    assert_eq!(fs.listxattr(a.ino).expect("listxattr"), b"user.k\0");
    assert_eq!(errno(fs.getxattr(a.ino, b"user.none")), libc::ENODATA);

    // Paths resolve through it too.
    assert_eq!(fs.resolve("/.snapshot/s1/d/b").expect("resolve"), b.ino);

    // Reads move no atime: the snapshot's inode stays as it was.
    let before = fs.getattr(a.ino).expect("getattr");
    let fh = fs.open_file(a.ino, libc::O_RDONLY).expect("open");
    fs.read(a.ino, 0, 5).expect("read");
    fs.release(a.ino, fh).expect("release");
    assert_eq!(fs.getattr(a.ino).expect("getattr"), before);

    common::close_and_check_clean(fs, &dev, "after browsing");
}

#[test]
fn every_change_in_a_snapshot_is_erofs() {
    let (dev, fs, _) = with_snapshot();
    let c = Caller::default();
    let s1 = fs.lookup(SNAPSHOT_DIR_INO, b"s1").expect("s1");
    let a = fs.lookup(s1.ino, b"a").expect("a");
    let d = fs.lookup(s1.ino, b"d").expect("d");
    let erofs = libc::EROFS;
    assert_eq!(errno(fs.create(c, s1.ino, b"x", 0o644, 0)), erofs);
    assert_eq!(errno(fs.mkdir(c, d.ino, b"x", 0o755)), erofs);
    assert_eq!(
        errno(fs.mknod(c, s1.ino, b"x", libc::S_IFIFO | 0o644, 0)),
        erofs
    );
    assert_eq!(errno(fs.symlink(c, s1.ino, b"x", b"a")), erofs);
    assert_eq!(errno(fs.tmpfile(c, s1.ino, 0o644, 0)), erofs);
    assert_eq!(errno(fs.write(a.ino, 0, b"x", false)), erofs);
    let truncate = SetAttr {
        size: Some(0),
        ..Default::default()
    };
    assert_eq!(errno(fs.setattr(a.ino, &truncate)), erofs);
    let chmod = SetAttr {
        mode: Some(0o600),
        ..Default::default()
    };
    assert_eq!(errno(fs.setattr(s1.ino, &chmod)), erofs);
    assert_eq!(errno(fs.setxattr(a.ino, b"user.k", b"w", 0)), erofs);
    assert_eq!(errno(fs.removexattr(a.ino, b"user.k")), erofs);
    assert_eq!(errno(fs.fallocate(a.ino, 0, 4096, 0)), erofs);
    assert_eq!(errno(fs.unlink(s1.ino, b"a")), erofs);
    assert_eq!(errno(fs.rmdir(s1.ino, b"d")), erofs);
    assert_eq!(
        errno(fs.link(a.ino, ROOT, b"hard")),
        erofs,
        "link out of a snapshot"
    );
    let live_a = fs.resolve("/a").expect("live a");
    assert_eq!(
        errno(fs.link(live_a, d.ino, b"hard")),
        erofs,
        "link into a snapshot"
    );
    assert_eq!(
        errno(fs.rename(s1.ino, b"a", ROOT, b"z", 0)),
        erofs,
        "rename out"
    );
    assert_eq!(
        errno(fs.rename(ROOT, b"a", s1.ino, b"z", 0)),
        erofs,
        "rename in"
    );
    assert_eq!(
        errno(fs.rename(s1.ino, b"a", s1.ino, b"z", 0)),
        erofs,
        "rename within"
    );
    assert_eq!(errno(fs.open_file(a.ino, libc::O_WRONLY)), erofs);
    assert_eq!(
        errno(fs.open_file(a.ino, libc::O_RDONLY | libc::O_TRUNC)),
        erofs
    );
    assert_eq!(errno(fs.copy_file_range(live_a, 0, a.ino, 0, 5)), erofs);
    // The snapshot directory itself.
    assert_eq!(errno(fs.create(c, SNAPSHOT_DIR_INO, b"x", 0o644, 0)), erofs);
    assert_eq!(errno(fs.rmdir(SNAPSHOT_DIR_INO, b"s1")), erofs);
    assert_eq!(errno(fs.rmdir(ROOT, b".snapshot")), erofs);
    assert_eq!(errno(fs.rename(ROOT, b".snapshot", ROOT, b"y", 0)), erofs);
    // Copying out of a snapshot is a read of it.
    let (out, fh) = fs.create(c, ROOT, b"copy", 0o644, 0).expect("create copy");
    assert_eq!(
        fs.copy_file_range(a.ino, 0, out.ino, 0, 5).expect("copy"),
        5
    );
    fs.release(out.ino, fh).expect("release");
    assert_eq!(fs.read_file("/copy").expect("read copy"), b"alpha");
    // Nothing changed in it.
    assert_eq!(fs.read(a.ino, 0, 10).expect("read"), b"alpha");
    assert_eq!(fs.getxattr(a.ino, b"user.k").expect("getxattr"), b"v");
    common::close_and_check_clean(fs, &dev, "after refused changes");
}

#[test]
fn the_reserved_name_cannot_be_made_in_the_root() {
    let (dev, fs) = common::fresh(32 * MIB);
    let c = Caller::default();
    // Also before any snapshot exists: the name is the snapshot directory's.
    assert_eq!(
        errno(fs.create(c, ROOT, b".snapshot", 0o644, 0)),
        libc::EEXIST
    );
    assert_eq!(errno(fs.mkdir(c, ROOT, b".snapshot", 0o755)), libc::EEXIST);
    assert_eq!(errno(fs.symlink(c, ROOT, b".snapshot", b"x")), libc::EEXIST);
    fs.write_file("/f", b"f").expect("write");
    let f = fs.resolve("/f").expect("f");
    assert_eq!(errno(fs.link(f, ROOT, b".snapshot")), libc::EEXIST);
    assert_eq!(
        errno(fs.rename(ROOT, b"f", ROOT, b".snapshot", 0)),
        libc::EEXIST
    );
    // Anywhere else it is an ordinary name.
    let d = fs.mkdir(c, ROOT, b"d", 0o755).expect("mkdir");
    fs.mkdir(c, d.ino, b".snapshot", 0o755)
        .expect("mkdir d/.snapshot");
    // An empty /.snapshot before the first snapshot.
    assert_eq!(names(&fs, SNAPSHOT_DIR_OBJECTID), [".", ".."]);
    common::close_and_check_clean(fs, &dev, "reserved name");
}

/// Gives file `/name` the name `.snapshot` in the root behind the API's back, as an image
/// made by a build that did not reserve the name would have it.
fn rename_raw(fs: &Filesystem, name: &[u8], new: &[u8]) {
    let engine = fs.engine();
    let entry = items::find_entry(&**engine, InodeNo::new(ROOT.get()), name)
        .expect("find")
        .expect("entry");
    let mut changes = Changes::new(&**engine);
    items::remove_link(&mut changes, InodeNo::new(ROOT.get()), &entry).expect("remove");
    items::add_link(
        &mut changes,
        &Link {
            parent: InodeNo::new(ROOT.get()),
            name: new,
            child: InodeNo::new(entry.child),
            file_type: entry.file_type,
            dir_index: entry.dir_index,
        },
        "test rename",
    )
    .expect("add");
    changes.record(&engine.begin().expect("begin"));
}

#[test]
fn an_image_with_a_snapshot_entry_in_the_root_refuses_the_upgrade() {
    let (dev, fs) = common::fresh(32 * MIB);
    fs.write_file("/old", b"mine").expect("write");
    rename_raw(&fs, b"old", b".snapshot");
    fs.close().expect("close");
    drop(fs);
    let fs = common::open_quiet(&dev);
    // The real entry is served as it is.
    let own = fs.lookup(ROOT, b".snapshot").expect("lookup");
    assert_ne!(own.ino.get(), SNAPSHOT_DIR_OBJECTID);
    assert_eq!(fs.read(own.ino, 0, 10).expect("read"), b"mine");
    let refused = fs.create_snapshot("s1").expect_err("upgrade refused");
    assert_eq!(refused.errno(), libc::EEXIST);
    assert!(refused.to_string().contains(".snapshot"), "{refused}");
    assert!(fs.engine().snapshots().is_empty());
    // Renamed away, the upgrade goes ahead.
    fs.rename(ROOT, b".snapshot", ROOT, b"mine", 0)
        .expect("rename away");
    fs.create_snapshot("s1").expect("snapshot");
    assert_eq!(
        fs.lookup(ROOT, b".snapshot").expect("lookup").ino,
        SNAPSHOT_DIR_INO
    );
    common::close_and_check_clean(fs, &dev, "upgrade");
}

#[test]
fn deleting_a_snapshot_with_a_file_open_in_it_is_ebusy() {
    let (dev, fs, _) = with_snapshot();
    let s1 = fs.lookup(SNAPSHOT_DIR_INO, b"s1").expect("s1");
    let id = s1.ino.get() >> 48;
    let a = fs.lookup(s1.ino, b"a").expect("a");
    let fh = fs.open_file(a.ino, libc::O_RDONLY).expect("open");
    assert_eq!(fs.snapshot_open_files(id), 1);
    assert_eq!(errno(fs.delete_snapshot("s1")), libc::EBUSY);
    assert_eq!(errno(fs.control(b"snapshot-delete s1")), libc::EBUSY);
    assert_eq!(fs.read(a.ino, 0, 10).expect("read"), b"alpha");
    fs.release(a.ino, fh).expect("release");
    assert_eq!(fs.snapshot_open_files(id), 0);
    fs.control(b"snapshot-delete s1").expect("delete");
    assert!(fs.engine().snapshots().is_empty());
    common::close_and_check_clean(fs, &dev, "after delete");
}

#[test]
fn a_deleted_snapshots_inodes_answer_an_error_not_data() {
    let (dev, fs, big) = with_snapshot();
    let s1 = fs.lookup(SNAPSHOT_DIR_INO, b"s1").expect("s1");
    let d = fs.lookup(s1.ino, b"d").expect("d");
    let b = fs.lookup(d.ino, b"b").expect("b");
    let id = s1.ino.get() >> 48;
    // A reader of the snapshot's tree that started before the deletion (`/d/b` only the
    // snapshot holds: the live tree unlinked it).
    let view = fs.engine().snapshot_view(id).expect("view");
    let b_obj = b.ino.get() & ((1 << 48) - 1);
    let lo = Key::new(b_obj, birch_format::ItemType::ExtentData, 0);
    let hi = Key::new(b_obj, birch_format::ItemType::ExtentData, u64::MAX);
    let mut blocks = Vec::new();
    for (_, value) in view.range(&lo, &hi, usize::MAX).expect("range") {
        let extent = birch_format::items::FileExtent::decode(&value).expect("extent");
        if let birch_format::items::ExtentKind::Regular { disk_addr, csums } = extent.kind {
            blocks.extend((0..csums.len() as u64).map(|i| disk_addr + i * BLOCK));
        }
    }
    let n = blocks.len() as u64;
    assert_eq!(n, (big.len() as u64).div_ceil(BLOCK));
    let alloc = fs.engine().allocator();
    let free_before = alloc.free_blocks().get();
    fs.delete_snapshot("s1").expect("delete");

    // While the view is held, the blocks only the snapshot held are not given back (not
    // even deferred: deferred space is handed out when an allocation finds no room).
    let free_held = alloc.free_blocks().get();
    assert!(
        free_held < free_before + n / 2,
        "the deletion gave back {} blocks under a reader of the snapshot",
        free_held.saturating_sub(free_before)
    );
    assert!(blocks
        .iter()
        .all(|&addr| alloc.is_used(birch_format::BlockAddr::new(addr))));

    // The deleted snapshot's inodes answer ENOENT (ESTALE through a file handle).
    for ino in [s1.ino, d.ino, b.ino] {
        assert_eq!(errno(fs.getattr(ino)), libc::ENOENT);
    }
    assert_eq!(errno(fs.read(b.ino, 0, 10)), libc::ENOENT);
    assert_eq!(errno(fs.open_file(b.ino, libc::O_RDONLY)), libc::ENOENT);
    assert_eq!(errno(fs.lookup(SNAPSHOT_DIR_INO, b"s1")), libc::ENOENT);
    assert_eq!(names(&fs, SNAPSHOT_DIR_OBJECTID), [".", ".."]);
    assert_eq!(
        errno(fs.engine().snapshot_view(id).map(|_| ())),
        libc::ENOENT
    );

    // The held view still reads the file whole.
    let mut data = Vec::new();
    for &addr in &blocks {
        let mut buf = vec![0u8; BLOCK as usize];
        dev.read_at(&mut buf, addr).expect("read");
        data.extend_from_slice(&buf);
    }
    data.truncate(big.len());
    assert_eq!(data, big);

    // Let go, the space comes back at once.
    drop(view);
    let free_after = alloc.free_blocks().get();
    assert!(
        free_after >= free_before + n,
        "{free_after} free after the view went, {free_before} before the deletion"
    );

    // Snapshot ids are never reused: a new snapshot's inodes are not the old one's.
    fs.create_snapshot("s1").expect("again");
    let again = fs.lookup(SNAPSHOT_DIR_INO, b"s1").expect("s1 again");
    assert_ne!(again.ino, s1.ino);
    assert_eq!(errno(fs.getattr(b.ino)), libc::ENOENT);
    common::close_and_check_clean(fs, &dev, "after delete");
}

#[test]
fn snapshots_are_made_listed_and_deleted_through_the_control_commands() {
    let (dev, fs) = common::fresh(32 * MIB);
    fs.write_file("/f", b"one").expect("write");
    fs.control(b"snapshot-create first").expect("create");
    fs.write_file("/f", b"two").expect("write");
    fs.control(b"snapshot-create second").expect("create");
    let text = fs.snapshots_text();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(
        lines[0].starts_with("1\t") && lines[0].ends_with("\tfirst"),
        "{text}"
    );
    assert!(
        lines[1].starts_with("2\t") && lines[1].ends_with("\tsecond"),
        "{text}"
    );
    // id, generation, time, the bytes only it holds, name: the first snapshot's leaf with
    // the old /f is held by it alone.
    let fields: Vec<&str> = lines[0].split('\t').collect();
    assert_eq!(fields.len(), 5, "{text}");
    let only: u64 = fields[3].parse().expect("bytes only it holds");
    assert!(only > 0, "{text}");
    assert_eq!(
        fs.read_file("/.snapshot/first/f").expect("read_file"),
        b"one"
    );
    let f1 = fs.resolve("/.snapshot/first/f").expect("first/f");
    let f2 = fs.resolve("/.snapshot/second/f").expect("second/f");
    assert_eq!(fs.read(f1, 0, 10).expect("read"), b"one");
    assert_eq!(fs.read(f2, 0, 10).expect("read"), b"two");
    assert_eq!(errno(fs.control(b"snapshot-create first")), libc::EEXIST);
    assert_eq!(errno(fs.control(b"snapshot-create a/b")), libc::EINVAL);
    assert_eq!(errno(fs.control(b"snapshot-delete none")), libc::ENOENT);
    fs.control(b"snapshot-delete first").expect("delete");
    assert_eq!(names(&fs, SNAPSHOT_DIR_OBJECTID), [".", "..", "second"]);
    common::close_and_check_clean(fs, &dev, "control");
}

/// Nodes the engine looked up (node cache hits and misses): a tree walk reads nodes, a
/// served copy reads none.
fn node_reads(fs: &Filesystem) -> u64 {
    let c = fs.engine().counters().values();
    c.cache_hits + c.cache_misses
}

/// `trusted.birch.snapshots` (the kernel asks for it twice: the size, then the value) walks
/// the trees once per committed state: a second read in the same state reads no node; a
/// commit, a new snapshot and a deletion each make the next read walk again, with the new
/// figures.
#[test]
fn the_snapshot_list_text_is_walked_once_per_committed_state() {
    let (dev, fs) = common::fresh(32 * MIB);
    let block = vec![7u8; 64 * 1024];
    fs.write_file("/f", &block).expect("write");
    fs.create_snapshot("one").expect("snapshot");
    fs.write_file("/f", &vec![8u8; 64 * 1024])
        .expect("overwrite");
    fs.create_snapshot("two").expect("snapshot");

    let before = node_reads(&fs);
    let first = fs.snapshots_text();
    assert!(node_reads(&fs) > before, "the first read walks: {first}");
    let before = node_reads(&fs);
    let second = fs.snapshots_text();
    assert_eq!(node_reads(&fs), before, "a second read walked again");
    assert_eq!(first, second);
    let only = |text: &str, line: usize| -> u64 {
        let fields: Vec<&str> = text.lines().nth(line).expect("line").split('\t').collect();
        fields[3].parse().expect("bytes only it holds")
    };
    // `two` holds /f's blocks with the live tree: nothing alone.
    assert_eq!(only(&first, 1), 0, "{first}");

    // A commit that overwrites /f leaves `two` the only holder of its blocks.
    fs.write_file("/f", &vec![9u8; 64 * 1024])
        .expect("overwrite");
    fs.sync().expect("sync");
    let before = node_reads(&fs);
    let third = fs.snapshots_text();
    assert!(
        node_reads(&fs) > before,
        "a commit did not make the read walk"
    );
    assert!(only(&third, 1) >= 64 * 1024, "{third}");
    let before = node_reads(&fs);
    assert_eq!(fs.snapshots_text(), third);
    assert_eq!(node_reads(&fs), before);

    // A new snapshot and a deletion change the list.
    fs.create_snapshot("three").expect("snapshot");
    let fourth = fs.snapshots_text();
    assert_eq!(fourth.lines().count(), 3, "{fourth}");
    assert!(fourth.ends_with("\tthree\n"), "{fourth}");
    fs.delete_snapshot("one").expect("delete");
    let fifth = fs.snapshots_text();
    assert_eq!(fifth.lines().count(), 2, "{fifth}");
    assert!(!fifth.contains("\tone\n"), "{fifth}");
    common::close_and_check_clean(fs, &dev, "list text");
}

/// `birch diff MNT` reads its text in pieces (`trusted.birch.diff/OFFSET/...`): the text is
/// computed once per state and the later pieces are served from it. Between two snapshots the
/// text stays across commits; to the live state a commit makes a new one; a name deleted and
/// made again is another snapshot; only the last two texts are kept.
#[test]
fn a_diff_text_is_walked_once_and_served_again() {
    let (dev, fs) = common::fresh(32 * MIB);
    fs.write_file("/f", b"one").expect("write");
    fs.create_snapshot("a").expect("snapshot");
    fs.write_file("/g", b"new").expect("write");
    fs.create_snapshot("b").expect("snapshot");

    let before = node_reads(&fs);
    let ab = fs.diff_text("a", Some("b")).expect("diff a b");
    assert!(node_reads(&fs) > before);
    assert_eq!(&ab[..], b"M /\n+ /g\n", "{}", String::from_utf8_lossy(&ab));
    let before = node_reads(&fs);
    assert_eq!(fs.diff_text("a", Some("b")).expect("again"), ab);
    assert_eq!(node_reads(&fs), before, "a second piece walked again");

    // To the live state: committed first; the same state serves the same text unwalked.
    let before = node_reads(&fs);
    let live = fs.diff_text("a", None).expect("diff a live");
    assert!(node_reads(&fs) > before);
    assert_eq!(&live[..], &ab[..]);
    let before = node_reads(&fs);
    assert_eq!(fs.diff_text("a", None).expect("again"), live);
    assert_eq!(node_reads(&fs), before, "a second piece walked again");

    // The text between the two snapshots stays cached across a commit; the next read to the
    // live state sees the change (and commits one itself first).
    fs.write_file("/h", b"later").expect("write");
    fs.sync().expect("sync");
    let before = node_reads(&fs);
    assert_eq!(fs.diff_text("a", Some("b")).expect("again"), ab);
    assert_eq!(
        node_reads(&fs),
        before,
        "a..b was walked again after a commit"
    );
    fs.write_file("/i", b"uncommitted").expect("write");
    let live2 = fs.diff_text("a", None).expect("diff a live");
    assert_eq!(
        &live2[..],
        b"M /\n+ /g\n+ /h\n+ /i\n",
        "{}",
        String::from_utf8_lossy(&live2)
    );

    // `b` deleted and made again (now with /h and /i): another id, another text.
    fs.delete_snapshot("b").expect("delete");
    fs.create_snapshot("b").expect("snapshot");
    let ab2 = fs.diff_text("a", Some("b")).expect("diff a new b");
    assert_eq!(&ab2[..], &live2[..], "{}", String::from_utf8_lossy(&ab2));

    // Bounded: after two other texts, the first is walked again.
    fs.diff_text("b", Some("a")).expect("diff b a");
    fs.diff_text("b", None).expect("diff b live");
    let before = node_reads(&fs);
    assert_eq!(fs.diff_text("a", Some("b")).expect("again"), ab2);
    assert!(node_reads(&fs) > before, "more than two texts kept");
    assert_eq!(errno(fs.diff_text("none", None)), libc::ENOENT);
    common::close_and_check_clean(fs, &dev, "diff text");
}

#[test]
fn one_snapshot_is_served_alone_as_the_root_of_a_read_only_open() {
    let (dev, fs, big) = with_snapshot();
    let id = fs.engine().snapshots()[0].id;
    fs.close().expect("close");
    drop(fs);
    let open = |read_only| {
        Filesystem::open_device(
            dev.clone() as Arc<dyn BlockDevice>,
            OpenOptions {
                commit_interval: None,
                read_only,
                ..Default::default()
            },
        )
        .expect("open")
    };
    let rw = open(false);
    assert_eq!(errno(rw.serve_snapshot_alone("s1")), libc::EINVAL);
    rw.close().expect("close");
    drop(rw);
    let fs = open(true);
    assert_eq!(errno(fs.serve_snapshot_alone("none")), libc::ENOENT);
    fs.serve_snapshot_alone("s1").expect("alone");
    assert_eq!(fs.snapshot_alone(), Some(id));
    let root = fs.getattr(ROOT).expect("root");
    assert_eq!(root.ino, ROOT);
    assert_eq!(names(&fs, ROOT.get()), [".", "..", "a", "d", "l"]);
    let entries = fs.readdir(ROOT, 0, 10).expect("readdir");
    assert_eq!(entries[1].ino, ROOT, "`..` of the root is the root");
    assert_eq!(errno(fs.lookup(ROOT, b".snapshot")), libc::ENOENT);
    let a = fs.lookup(ROOT, b"a").expect("a");
    assert_eq!(a.ino.get() >> 48, id);
    assert_eq!(fs.read(a.ino, 0, 10).expect("read"), b"alpha");
    let d = fs.lookup(ROOT, b"d").expect("d");
    assert_eq!(fs.lookup(d.ino, b"..").expect("..").ino, ROOT);
    let b = fs.lookup(d.ino, b"b").expect("b");
    assert_eq!(fs.read(b.ino, 0, big.len()).expect("read b"), big);
    assert_eq!(
        errno(fs.create(Caller::default(), ROOT, b"x", 0o644, 0)),
        libc::EROFS
    );
    let chmod = SetAttr {
        mode: Some(0o700),
        ..Default::default()
    };
    assert_eq!(errno(fs.setattr(ROOT, &chmod)), libc::EROFS);
    fs.close().expect("close");
}

#[test]
fn object_ids_stop_below_the_subvolume_bits() {
    let (dev, fs) = common::fresh(32 * MIB);
    fs.engine()
        .raise_objectid(birch_format::OBJECTID_LIMIT - 64);
    let last = fs
        .mkdir(Caller::default(), ROOT, b"last", 0o755)
        .expect("the last batch below 2^48");
    assert!(last.ino < InodeNo::new(birch_format::OBJECTID_LIMIT));
    let refused = fs
        .mkdir(Caller::default(), ROOT, b"past", 0o755)
        .expect_err("an id at 2^48");
    assert_eq!(refused.errno(), libc::ENOSPC, "{refused}");
    assert_eq!(errno(fs.lookup(ROOT, b"past")), libc::ENOENT);
    common::close_and_check_clean(fs, &dev, "ids used up");
}

/// Holds up the first device read touching `gated` (byte ranges of data blocks) until the test
/// opens the gate (a memory device's read hook, [`ReadGate::device`]): the read has looked up
/// its extents and waits to read the blocks, which is where a deletion that freed them and a
/// write that took them would show.
#[derive(Default)]
struct ReadGate {
    gate: std::sync::Mutex<Gate>,
    changed: std::sync::Condvar,
}

#[derive(Default)]
struct Gate {
    /// Byte ranges whose first read is held up; cleared once that read goes on.
    gated: Vec<(u64, u64)>,
    /// A read waits at the gate.
    waiting: bool,
    /// The test let it go on.
    open: bool,
}

impl ReadGate {
    /// A device over `mem` whose reads pass this gate.
    fn device(
        self: &Arc<Self>,
        mem: Arc<MemDevice>,
    ) -> Arc<common::HookedReads<impl Fn(u64, usize) -> std::io::Result<()> + Send + Sync>> {
        let gate = self.clone();
        Arc::new(common::HookedReads {
            inner: mem,
            hook: move |offset: u64, len: usize| {
                gate.pass(offset, offset + len as u64);
                Ok(())
            },
        })
    }

    /// A read of `offset..end`: held while it touches a gated range and the gate is shut.
    fn pass(&self, offset: u64, end: u64) {
        let mut gate = self.gate.lock().expect("gate");
        if gate
            .gated
            .iter()
            .any(|&(from, to)| offset < to && from < end)
        {
            gate.gated.clear();
            gate.waiting = true;
            self.changed.notify_all();
            while !gate.open {
                gate = self.changed.wait(gate).expect("gate");
            }
        }
    }

    fn arm(&self, gated: Vec<(u64, u64)>) {
        *self.gate.lock().expect("gate") = Gate {
            gated,
            ..Gate::default()
        };
    }

    /// Waits until a read is held at the gate (a minute at most).
    fn wait_for_reader(&self) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let mut gate = self.gate.lock().expect("gate");
        while !gate.waiting {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            assert!(!left.is_zero(), "no read reached the gate");
            gate = self.changed.wait_timeout(gate, left).expect("gate").0;
        }
    }

    fn open(&self) {
        self.gate.lock().expect("gate").open = true;
        self.changed.notify_all();
    }
}

/// Opens the gate when dropped: a test that fails while a read is held does not hang.
struct OpenOnDrop<'a>(&'a ReadGate);

impl Drop for OpenOnDrop<'_> {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// The data blocks of snapshot object `obj` (byte ranges on the device), read through a view
/// dropped before it returns.
fn snapshot_file_blocks(fs: &Filesystem, id: u64, obj: u64) -> Vec<(u64, u64)> {
    let view = fs.engine().snapshot_view(id).expect("view");
    let lo = Key::new(obj, birch_format::ItemType::ExtentData, 0);
    let hi = Key::new(obj, birch_format::ItemType::ExtentData, u64::MAX);
    let mut out = Vec::new();
    for (_, value) in view.range(&lo, &hi, usize::MAX).expect("range") {
        let extent = birch_format::items::FileExtent::decode(&value).expect("extent");
        if let birch_format::items::ExtentKind::Regular { disk_addr, csums } = extent.kind {
            out.push((disk_addr, disk_addr + csums.len() as u64 * BLOCK));
        }
    }
    out
}

/// Writes files of `byte` until the filesystem is full (files of 1 MiB, then halves down to a
/// block once one does not fit), committing after each: every block free for data but the
/// metadata reserve is taken, so most blocks a deletion gave back are written over. Returns
/// their names.
fn fill_up(fs: &Filesystem, prefix: &str, byte: u8) -> Vec<String> {
    let mut names = Vec::new();
    let mut size = MIB;
    let mut n = 0;
    while size >= BLOCK {
        let name = format!("{prefix}{n}");
        n += 1;
        let result = fs.write_file(&format!("/{name}"), &vec![byte; size as usize]);
        // Made, partly written, or not made at all.
        if fs.resolve(&format!("/{name}")).is_ok() {
            names.push(name.clone());
        }
        match result {
            Ok(()) => {}
            Err(e) if e.errno() == libc::ENOSPC => size /= 2,
            Err(e) => panic!("fill {name}: {e}"),
        }
        fs.sync().expect("sync");
    }
    names
}

/// Blocks of `runs` (byte ranges) the allocator has in use.
fn used_blocks(fs: &Filesystem, runs: &[(u64, u64)]) -> u64 {
    let alloc = fs.engine().allocator();
    runs.iter()
        .flat_map(|&(from, to)| (from..to).step_by(BLOCK as usize))
        .filter(|&addr| alloc.is_used(birch_format::BlockAddr::new(addr)))
        .count() as u64
}

/// A read of a snapshot's file racing the snapshot's deletion and writes that reuse the freed
/// space, made certain: the read (of the whole file) is held up at the device after it found
/// its extents (the snapshot stood then) and before it reads the blocks; meanwhile the
/// snapshot is deleted and the filesystem filled up with another pattern, a commit after each
/// file, until fewer blocks are free than half the file's. That read must return exactly the
/// snapshot's bytes (its view keeps the blocks: the deletion gives them back only when it
/// ends), and every later read `ENOENT`; never other bytes, never `EIO` (a checksum failure
/// over reused blocks). Then, the reader gone, a second fill writes over at least half of the
/// file's blocks, as the first would have without the reader's pin. Checked by breaking the
/// pin (`give_back_deleted` freeing at once instead of pinning): the held read then fails with
/// `EIO`.
#[test]
fn reads_racing_a_deletion_get_the_data_or_enoent() {
    for round in 0..2u8 {
        let mem = common::fresh_device(16 * MIB);
        let gate = Arc::new(ReadGate::default());
        let dev = gate.device(mem.clone());
        let fs = common::open_quiet(&dev);
        let pattern: Vec<u8> = (0..4 * MIB as u32)
            .map(|i| (i % 253) as u8 ^ round)
            .collect();
        fs.write_file("/big", &pattern).expect("write");
        fs.create_snapshot("s").expect("snapshot");
        let live = fs.resolve("/big").expect("big");
        let truncate = SetAttr {
            size: Some(0),
            ..Default::default()
        };
        fs.setattr(live, &truncate).expect("truncate");
        fs.sync().expect("sync");
        let ino = fs.resolve("/.snapshot/s/big").expect("snapshot's big");
        let blocks = snapshot_file_blocks(&fs, ino.get() >> 48, ino.get() & ((1 << 48) - 1));
        let held: u64 = blocks.iter().map(|(from, to)| (to - from) / BLOCK).sum();
        assert_eq!(held, 4 * MIB / BLOCK);
        gate.arm(blocks.clone());
        let fill = 0xee ^ round;
        let alloc = fs.engine().allocator();
        let (results, free_after_fill, kept) = std::thread::scope(|scope| {
            let reader = scope.spawn(|| {
                // The held read, then the file again in pieces.
                let mut results = vec![(0, fs.read(ino, 0, pattern.len()))];
                for at in (0..pattern.len() as u64).step_by(256 * 1024) {
                    results.push((at, fs.read(ino, at, 256 * 1024)));
                }
                results
            });
            let opened = OpenOnDrop(&gate);
            gate.wait_for_reader();
            fs.delete_snapshot("s").expect("delete");
            let names = fill_up(&fs, "fill", fill);
            let free = alloc.free_blocks().get();
            let kept = used_blocks(&fs, &blocks);
            drop(opened);
            let results = reader.join().expect("reader");
            for name in names {
                fs.unlink(ROOT, name.as_bytes()).expect("unlink fill");
            }
            fs.sync().expect("sync");
            (results, free, kept)
        });
        let (_, first) = &results[0];
        match first {
            Ok(data) => assert!(
                data.as_slice() == pattern.as_slice(),
                "round {round}: the held read returned other bytes"
            ),
            Err(e) => panic!("round {round}: the held read: {e}"),
        }
        // Every read after the deletion answers ENOENT.
        for (at, result) in &results[1..] {
            match result {
                Ok(data) => panic!(
                    "round {round}: read at {at} after the deletion returned {} bytes",
                    data.len()
                ),
                Err(e) => assert_eq!(e.errno(), libc::ENOENT, "round {round}: read at {at}: {e}"),
            }
        }
        // The reader's view kept every block of the snapshot's file through the fill.
        assert_eq!(
            kept, held,
            "round {round}: blocks of the deleted snapshot's file given back under a reader"
        );
        // Without the pin the file's blocks would have been free too, and the fill would have
        // stopped with as few free: most of them written over.
        assert!(
            free_after_fill < held / 2,
            "round {round}: {free_after_fill} blocks free after the fill"
        );
        // The reader gone, its blocks are free: a fill takes them (here and in the first fill
        // had they not been held).
        let names = fill_up(&fs, "again", fill);
        let reused = used_blocks(&fs, &blocks);
        assert!(
            reused >= held / 2,
            "round {round}: {reused} of {held} blocks of the file taken by a fill"
        );
        for name in names {
            fs.unlink(ROOT, name.as_bytes()).expect("unlink fill");
        }
        common::close_and_check_clean(fs, &mem, "after the race");
    }
}

/// READDIRPLUS's `lookup_listed` answers every listed entry of /.snapshot and of a
/// snapshot's directories exactly as LOOKUP does (session-17 review).
#[test]
fn lookup_listed_answers_in_snapshots_as_lookup_does() {
    let (_dev, fs, _big) = with_snapshot();
    let mut dirs = vec![SNAPSHOT_DIR_OBJECTID];
    let mut seen = 0;
    while let Some(dir) = dirs.pop() {
        for e in fs.readdir(InodeNo::new(dir), 0, 100).expect("readdir") {
            if e.name == b"." || e.name == b".." {
                continue;
            }
            let by_name = fs.lookup(InodeNo::new(dir), &e.name).expect("lookup");
            let listed = fs
                .lookup_listed(InodeNo::new(dir), &e.name, e.ino)
                .expect("lookup_listed");
            assert_eq!(
                by_name,
                listed,
                "{dir} {:?}",
                String::from_utf8_lossy(&e.name)
            );
            assert_eq!(listed.ino, e.ino);
            seen += 1;
            if listed.kind == birch_core::vfs::FileKind::Dir {
                dirs.push(e.ino.get());
            }
        }
    }
    assert!(seen >= 4, "{seen}");
}
