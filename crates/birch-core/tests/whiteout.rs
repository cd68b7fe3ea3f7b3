//! RENAME_WHITEOUT: the source name is taken by a whiteout in the rename's own transaction.
//!
//! overlayfs renames out of its upper layer with `RENAME_WHITEOUT` and relies on never seeing
//! the file gone from both names, or at both. These tests check the whiteout Linux makes
//! (a character device 0:0, mode 0, owned by the caller), the flag combinations Linux allows,
//! and atomicity under power loss: the rename and a commit are recorded on a `MemDevice`, and
//! every crash state (each prefix of the recorded writes, and each with one write of the
//! unflushed window dropped) must open to either the old names or the new ones with the
//! whiteout, and pass fsck.

#![allow(clippy::expect_used)]

use std::sync::Arc;

use birch_core::check::{check, CheckOptions};
use birch_core::device::{MemDevice, Recorded};
use birch_core::vfs::{Caller, FileKind};
use birch_format::ROOT_INO;

mod common;

const RENAME_NOREPLACE: u32 = 1;
const RENAME_EXCHANGE: u32 = 2;
const RENAME_WHITEOUT: u32 = 4;

fn user() -> Caller {
    Caller {
        uid: 1000,
        gid: 1000,
        umask: 0o022,
    }
}

#[test]
fn rename_whiteout_leaves_a_character_device_0_0_with_mode_0() {
    let (dev, fs) = common::fresh(64 << 20);
    fs.write_file("/a", b"upper").expect("write");
    fs.rename_as(user(), ROOT_INO, b"a", ROOT_INO, b"b", RENAME_WHITEOUT)
        .expect("rename whiteout");
    assert_eq!(fs.read_file("/b").expect("read"), b"upper");
    let w = fs.lookup(ROOT_INO, b"a").expect("whiteout");
    assert_eq!(w.kind, FileKind::CharDevice);
    assert_eq!((w.perm, w.rdev, w.nlink), (0, 0, 1));
    assert_eq!((w.uid, w.gid), (1000, 1000));
    // Into another directory, over an existing file, with a whiteout.
    let d = fs
        .mkdir(Caller::default(), ROOT_INO, b"d", 0o755)
        .expect("mkdir");
    fs.write_file("/c", b"new").expect("write");
    fs.write_file("/d/c", b"old").expect("write");
    fs.rename_as(user(), ROOT_INO, b"c", d.ino, b"c", RENAME_WHITEOUT)
        .expect("rename over a file");
    assert_eq!(fs.read_file("/d/c").expect("read"), b"new");
    assert_eq!(
        fs.lookup(ROOT_INO, b"c").expect("whiteout").kind,
        FileKind::CharDevice
    );
    // A directory can be renamed with a whiteout too.
    fs.mkdir(Caller::default(), ROOT_INO, b"sub", 0o755)
        .expect("mkdir");
    fs.rename_as(user(), ROOT_INO, b"sub", d.ino, b"sub", RENAME_WHITEOUT)
        .expect("rename a dir");
    assert_eq!(fs.lookup(d.ino, b"sub").expect("moved").kind, FileKind::Dir);
    assert_eq!(
        fs.lookup(ROOT_INO, b"sub").expect("whiteout").kind,
        FileKind::CharDevice
    );
    common::close_and_check_clean(fs, &dev, "after whiteout renames");
}

#[test]
fn whiteout_flags_combine_as_linux() {
    let (dev, fs) = common::fresh(64 << 20);
    fs.write_file("/a", b"a").expect("write");
    fs.write_file("/b", b"b").expect("write");
    let err = |r: birch_core::Result<()>| r.map_err(|e| e.errno()).err();
    assert_eq!(
        err(fs.rename_as(
            user(),
            ROOT_INO,
            b"a",
            ROOT_INO,
            b"b",
            RENAME_WHITEOUT | RENAME_EXCHANGE
        )),
        Some(libc::EINVAL)
    );
    assert_eq!(
        err(fs.rename_as(
            user(),
            ROOT_INO,
            b"a",
            ROOT_INO,
            b"b",
            RENAME_WHITEOUT | RENAME_NOREPLACE
        )),
        Some(libc::EEXIST)
    );
    assert_eq!(
        err(fs.rename_as(user(), ROOT_INO, b"x", ROOT_INO, b"y", RENAME_WHITEOUT)),
        Some(libc::ENOENT)
    );
    fs.rename_as(
        user(),
        ROOT_INO,
        b"a",
        ROOT_INO,
        b"c",
        RENAME_WHITEOUT | RENAME_NOREPLACE,
    )
    .expect("whiteout with noreplace to a free name");
    assert_eq!(fs.read_file("/c").expect("read"), b"a");
    assert_eq!(
        fs.lookup(ROOT_INO, b"a").expect("wh").kind,
        FileKind::CharDevice
    );
    // Renaming the whiteout itself away with another whiteout: a new one takes its place.
    fs.rename_as(user(), ROOT_INO, b"a", ROOT_INO, b"w", RENAME_WHITEOUT)
        .expect("rename a whiteout");
    assert_eq!(
        fs.lookup(ROOT_INO, b"a").expect("wh").kind,
        FileKind::CharDevice
    );
    assert_eq!(
        fs.lookup(ROOT_INO, b"w").expect("wh").kind,
        FileKind::CharDevice
    );
    common::close_and_check_clean(fs, &dev, "after the flag checks");
}

#[test]
fn a_whiteout_rename_is_atomic_in_every_crash_state() {
    let (dev, fs) = common::fresh(64 << 20);
    let d = fs
        .mkdir(Caller::default(), ROOT_INO, b"d", 0o755)
        .expect("mkdir");
    fs.write_file("/src", b"the file").expect("write");
    fs.write_file("/d/dst", b"replaced").expect("write");
    fs.sync().expect("commit the old state");
    let base = dev.snapshot();
    dev.start_recording();
    fs.rename_as(user(), ROOT_INO, b"src", d.ino, b"dst", RENAME_WHITEOUT)
        .expect("rename whiteout");
    fs.sync().expect("commit the rename");
    let events = dev.take_recording();
    fs.power_cut();
    assert!(
        events.iter().any(|e| matches!(e, Recorded::Flush)),
        "the commit flushed"
    );
    let mut states: Vec<Vec<bool>> = Vec::new();
    // Every prefix of the recorded writes, and within the window after the last flush of
    // each prefix, the prefix with one of that window's writes dropped.
    for end in 0..=events.len() {
        let keep: Vec<bool> = (0..events.len()).map(|i| i < end).collect();
        let window_start = events[..end]
            .iter()
            .rposition(|e| matches!(e, Recorded::Flush))
            .map_or(0, |i| i + 1);
        for drop in window_start..end {
            let mut k = keep.clone();
            k[drop] = false;
            states.push(k);
        }
        states.push(keep);
    }
    let (mut old, mut new) = (0, 0);
    for keep in &states {
        let mut bytes = base.clone();
        for (event, kept) in events.iter().zip(keep) {
            if let (
                Recorded::Write {
                    offset,
                    bytes: data,
                },
                true,
            ) = (event, kept)
            {
                let at = *offset as usize;
                bytes[at..at + data.len()].copy_from_slice(data);
            }
        }
        let crashed = Arc::new(MemDevice::from_bytes(bytes));
        let fs = common::open_quiet(&crashed);
        let src = fs
            .lookup(ROOT_INO, b"src")
            .expect("src name exists in either state");
        let dst = fs.read_file("/d/dst").expect("dst exists in either state");
        if src.kind == FileKind::CharDevice {
            assert_eq!((src.perm, src.rdev), (0, 0), "a whiteout");
            assert_eq!(dst, b"the file", "new state: the file under its new name");
            new += 1;
        } else {
            assert_eq!(fs.read_file("/src").expect("read"), b"the file");
            assert_eq!(dst, b"replaced", "old state: the replaced file still there");
            old += 1;
        }
        fs.close().expect("close");
        drop(fs);
        let report = check(&*crashed, CheckOptions { data: true }).expect("fsck");
        assert!(report.is_clean(), "crash state: {:?}", report.findings);
    }
    assert!(
        old > 0 && new > 0,
        "both outcomes seen: {old} old, {new} new"
    );
}
