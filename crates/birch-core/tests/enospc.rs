//! A full filesystem: writes fail with ENOSPC (an error, never a panic), the image stays
//! consistent (fsck clean after a reopen), unlink and truncate still work on the full
//! filesystem, and the space they free is usable again after the commit that frees it.

#![allow(clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use birch_core::check::{check, CheckOptions};
use birch_core::vfs::{Caller, OpenOptions, SetAttr};
use birch_core::Filesystem;

use birch_format::{InodeNo, ROOT_INO};
use common::fresh;

#[test]
fn full_filesystem_fails_cleanly_and_recovers_after_deletes() {
    let (dev, fs) = fresh(24 << 20);
    let chunk = vec![0xabu8; 256 * 1024];
    let mut files = Vec::new();
    let mut hit_enospc = false;
    'fill: for n in 0..1000 {
        let (f, _) = match fs.create(
            Caller::default(),
            ROOT_INO,
            format!("f{n}").as_bytes(),
            0o644,
            0,
        ) {
            Ok(v) => v,
            Err(e) => {
                assert_eq!(e.errno(), libc::ENOSPC, "create on a full fs: {e}");
                hit_enospc = true;
                break;
            }
        };
        files.push(f.ino);
        for part in 0..8u64 {
            if let Err(e) = fs.write(f.ino, part * chunk.len() as u64, &chunk, false) {
                assert_eq!(e.errno(), libc::ENOSPC, "write on a full fs: {e}");
                hit_enospc = true;
                break 'fill;
            }
        }
    }
    assert!(hit_enospc, "a 24 MiB filesystem must fill up");
    // Deletes and truncates always work on a full filesystem.
    fs.setattr(
        files[0],
        &SetAttr {
            size: Some(0),
            ..Default::default()
        },
    )
    .expect("truncate on a full fs");
    for n in 1..files.len().min(6) {
        fs.unlink(ROOT_INO, format!("f{n}").as_bytes())
            .expect("unlink on a full fs");
    }
    fs.sync().expect("commit after deletes");
    // The freed space is usable again.
    let (g, _) = fs
        .create(Caller::default(), ROOT_INO, b"after", 0o644, 0)
        .expect("create after deletes");
    fs.write(g.ino, 0, &chunk, false)
        .expect("write after deletes");
    fs.close().expect("close");
    drop(fs);
    let report = check(&*dev, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{:#?}", report.findings);
    let fs = Filesystem::open_device(
        dev,
        OpenOptions {
            commit_interval: None,
            ..Default::default()
        },
    )
    .expect("reopen");
    assert_eq!(fs.read_file("/after").expect("read back"), chunk);
}

/// A dying disk: once writes fail, the commit fails, the filesystem turns read-only and says
/// why, fsync reports the failure (never success), and the image still holds the last good
/// commit, fsck clean.
#[test]
fn failed_commit_turns_read_only_and_never_half_commits() {
    let (dev, fs) = fresh(32 << 20);
    fs.write_file("/kept", b"committed before the disk died")
        .expect("write");
    fs.sync().expect("commit");
    let (f, _) = fs
        .create(Caller::default(), ROOT_INO, b"lost", 0o644, 0)
        .expect("create");
    dev.fail_writes(true);
    let err = fs.sync().expect_err("commit on a dead disk fails");
    assert_eq!(err.errno(), libc::EIO, "{err}");
    let reason = fs
        .engine()
        .read_only_reason()
        .expect("read-only after a failed commit");
    assert!(
        reason.contains("commit"),
        "the reason says what failed: {reason}"
    );
    assert!(
        fs.fsync(f.ino, false).is_err(),
        "fsync after a failed commit must not report success"
    );
    assert_eq!(
        fs.mkdir(Caller::default(), ROOT_INO, b"new", 0o755)
            .expect_err("read-only")
            .errno(),
        libc::EROFS
    );
    fs.power_cut();
    let crashed = Arc::new(dev.crash());
    let report = check(&*crashed, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{:#?}", report.findings);
    let fs = Filesystem::open_device(
        crashed,
        OpenOptions {
            commit_interval: None,
            ..Default::default()
        },
    )
    .expect("reopen");
    assert_eq!(
        fs.read_file("/kept").expect("kept"),
        b"committed before the disk died"
    );
    assert!(
        fs.resolve("/lost").is_err(),
        "nothing of the failed commit is visible"
    );
}

/// A commit that fails on a read-only (re)mount turns the read-only state into a failure:
/// `rw` is refused and no later commit runs, so the failed commit's changes can never be
/// replaced by a newer freeze and lost to readers (review of the striped read state).
#[test]
fn failed_commit_on_a_read_only_remount_sticks() {
    let (dev, fs) = fresh(32 << 20);
    fs.write_file("/kept", b"committed").expect("write");
    fs.sync().expect("commit");
    fs.write_file("/pending", b"in the delta").expect("write");
    dev.fail_writes(true);
    fs.control(b"ro").expect_err("the remount's commit fails");
    let reason = fs.engine().read_only_reason().expect("read-only");
    assert!(
        reason.contains("commit"),
        "the failure replaces the remount's reason: {reason}"
    );
    dev.fail_writes(false);
    fs.control(b"rw")
        .expect_err("no remount rw after a failed commit");
    fs.sync().expect_err("no commit after a failed one");
    assert_eq!(
        fs.read_file("/pending")
            .expect("still readable from memory"),
        b"in the delta"
    );
    fs.power_cut();
    let crashed = Arc::new(dev.crash());
    let report = check(&*crashed, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{:#?}", report.findings);
}

/// A filesystem filled with metadata alone (empty files with long names, then xattrs)
/// answers ENOSPC and stays writable: no commit runs out of space (which would turn it
/// read-only and lose every change since the last commit). Deletes still work on the full
/// filesystem, and what was committed survives a crash with fsck clean.
#[test]
fn metadata_fill_ends_in_enospc_never_read_only() {
    let (dev, fs) = fresh(16 << 20);
    let long = "n".repeat(200);
    let mut made = 0u32;
    let err = loop {
        let name = format!("{made:06}{long}");
        match fs.mknod(
            Caller::default(),
            ROOT_INO,
            name.as_bytes(),
            libc::S_IFREG | 0o644,
            0,
        ) {
            Ok(_) => made += 1,
            Err(e) => break e,
        }
        assert!(made < 1_000_000, "never full");
    };
    assert_eq!(err.errno(), libc::ENOSPC, "{err}");
    assert!(made > 1000, "only {made} files before ENOSPC");
    // xattrs on a full filesystem: ENOSPC too, and the filesystem is still writable.
    let err = (0..100_000)
        .map(|i| fs.setxattr(ROOT_INO, format!("user.x{i}").as_bytes(), &[7u8; 512], 0))
        .find_map(|r| r.err())
        .expect("xattrs end in an error");
    assert_eq!(err.errno(), libc::ENOSPC, "{err}");
    // Deletes work on the full filesystem; then creating works again.
    for i in (0..made).step_by(2) {
        fs.unlink(ROOT_INO, format!("{i:06}{long}").as_bytes())
            .expect("unlink on a full filesystem");
    }
    fs.mknod(
        Caller::default(),
        ROOT_INO,
        b"after",
        libc::S_IFREG | 0o644,
        0,
    )
    .expect("create after deletes");
    fs.sync().expect("commit");
    fs.power_cut();
    let crashed = Arc::new(dev.crash());
    let report = check(&*crashed, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{:#?}", report.findings);
    let fs = common::open_quiet(&crashed);
    fs.getattr(fs.lookup(ROOT_INO, b"after").expect("after").ino)
        .expect("the last file survived");
}

/// `df` right after `rm` shows the space back (xfstests generic/015): blocks freed since the
/// last commit count as free in statfs, and a writer gets them (its allocation forces the
/// commit that makes them reusable).
#[test]
fn space_freed_since_the_last_commit_counts_as_free() {
    let (_dev, fs) = fresh(32 << 20);
    let free_before = fs.statfs().bfree;
    let avail_before = fs.statfs().bavail;
    let (attr, fh) = fs
        .create(Caller::default(), ROOT_INO, b"big", 0o644, 0)
        .expect("create");
    let data = vec![0x33u8; 8 << 20];
    fs.write(attr.ino, 0, &data, false).expect("write");
    fs.release(attr.ino, fh).expect("release");
    fs.sync().expect("commit the file");
    assert!(fs.statfs().bfree + 2048 <= free_before, "8 MiB taken");
    fs.unlink(ROOT_INO, b"big").expect("unlink");
    fs.forget(attr.ino, 1);
    let st = fs.statfs();
    assert!(
        st.bfree + 16 >= free_before && st.bavail + 16 >= avail_before,
        "freed space counts before the commit: bfree {} of {free_before}, bavail {} of {avail_before}",
        st.bfree,
        st.bavail
    );
    // And a writer really gets it: fill what statfs says is available (less the extent
    // items' metadata a reservation also counts), with no commit of its own in between.
    let (attr, _fh) = fs
        .create(Caller::default(), ROOT_INO, b"again", 0o644, 0)
        .expect("create again");
    let want = (st.bavail * 9 / 10 * 4096) as usize;
    assert!(
        want as u64 > (avail_before - 2048) * 4096,
        "more than was available while the 8 MiB file existed"
    );
    fs.write(attr.ino, 0, &vec![0x44u8; want], false)
        .expect("what statfs reports as available can be written");
    fs.fsync(attr.ino, false).expect("fsync");
}

/// A file unlinked while open keeps its data through its handle; after a crash with the
/// handle still open (no release, no close) the committed orphan is reclaimed at mount: the
/// inode is gone, its space is free again and fsck is clean.
#[test]
fn orphan_of_a_crash_is_reclaimed_at_mount() {
    let (dev, fs) = fresh(32 << 20);
    let free_before = fs.statfs().bfree;
    let (attr, fh) = fs
        .create(Caller::default(), ROOT_INO, b"doomed", 0o644, 0)
        .expect("create");
    let data = vec![0x5au8; 1 << 20];
    fs.write(attr.ino, 0, &data, false).expect("write");
    fs.unlink(ROOT_INO, b"doomed").expect("unlink while open");
    assert_eq!(
        fs.read(attr.ino, 0, data.len())
            .expect("read through the handle"),
        data
    );
    fs.sync().expect("commit the orphan");
    assert!(
        fs.statfs().bfree < free_before,
        "the open orphan holds its blocks"
    );
    let _ = fh; // still open at the crash
    fs.power_cut();
    let crashed = Arc::new(dev.crash());
    let fs = common::open_quiet(&crashed);
    assert_eq!(
        fs.getattr(attr.ino).expect_err("reclaimed").errno(),
        libc::ENOENT
    );
    // The reclaim frees the blocks in the running transaction; they are usable once it is
    // committed (space freed in a transaction is reused only after the next commit).
    fs.sync().expect("commit the reclaim");
    assert_eq!(
        fs.statfs().bfree,
        free_before,
        "the orphan's space is free again"
    );
    fs.close().expect("close");
    drop(fs);
    let report = check(&*crashed, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{:#?}", report.findings);
}

/// A data write that fails makes fsync of that file answer EIO, and keep answering it after
/// the device recovers: the error is not lost by being reported once.
#[test]
fn fsync_after_a_failed_write_reports_eio_every_time() {
    let (dev, fs) = fresh(32 << 20);
    let (attr, _) = fs
        .create(Caller::default(), ROOT_INO, b"f", 0o644, 0)
        .expect("create");
    fs.write(attr.ino, 0, &[1u8; 8192], false).expect("write");
    fs.fsync(attr.ino, false).expect("fsync before the failure");
    dev.fail_writes(true);
    let err = fs
        .write_mode(attr.ino, 0, &[2u8; 1 << 20], false, None, true)
        .expect_err("write-through write on a failing device");
    assert_eq!(err.errno(), libc::EIO, "{err}");
    dev.fail_writes(false);
    for attempt in 0..3 {
        let err = fs
            .fsync(attr.ino, false)
            .expect_err("fsync after the failed write");
        assert_eq!(err.errno(), libc::EIO, "attempt {attempt}: {err}");
    }
}

/// A buffered write returns before its data is written; when the flush at fsync fails, that
/// fsync answers EIO, and so does every later one after the device recovers.
#[test]
fn fsync_after_a_failed_buffered_flush_reports_eio_every_time() {
    let (dev, fs) = fresh(32 << 20);
    let (attr, _) = fs
        .create(Caller::default(), ROOT_INO, b"f", 0o644, 0)
        .expect("create");
    fs.write(attr.ino, 0, &[1u8; 8192], false).expect("write");
    fs.fsync(attr.ino, false).expect("fsync before the failure");
    // A commit ends the file's log-clean state (whole-block writes to a log-clean file go
    // through), so the next write is buffered.
    fs.sync().expect("commit");
    dev.fail_writes(true);
    fs.write(attr.ino, 0, &[2u8; 1 << 20], false)
        .expect("a buffered write does not touch the device");
    let err = fs
        .fsync(attr.ino, false)
        .expect_err("fsync flushes on a failing device");
    assert_eq!(err.errno(), libc::EIO, "{err}");
    dev.fail_writes(false);
    for attempt in 0..3 {
        let err = fs
            .fsync(attr.ino, false)
            .expect_err("fsync after the failed flush");
        assert_eq!(err.errno(), libc::EIO, "attempt {attempt}: {err}");
    }
    assert_eq!(
        fs.getattr(attr.ino).expect("attr").size,
        8192,
        "the lost write's growth of the file is undone"
    );
    assert_eq!(fs.read(attr.ino, 0, 8192).expect("read"), vec![1u8; 8192]);
}

/// A file unlinked while open keeps its space until its last handle is released and the
/// kernel forgets it. The FUSE kernel module sends RELEASE in the background, and over
/// FUSE-over-io_uring on the queue of the CPU that closed the file, where it can wait behind
/// that queue's write-back while the program's `rm` and its next requests arrive on another
/// queue (xfstests generic/371, DESIGN §12.5). An operation that finds no space while such a
/// file is held waits for its release instead of answering ENOSPC for space the program has
/// already given back.
#[test]
fn enospc_waits_for_the_release_of_an_unlinked_file() {
    let (dev, fs) = fresh(64 << 20);
    let (a, fh) = fs
        .create(Caller::default(), ROOT_INO, b"a", 0o644, 0)
        .expect("create a");
    fs.fallocate(a.ino, 0, 36 << 20, 0).expect("fallocate a");
    fs.unlink(ROOT_INO, b"a").expect("unlink a while open");
    let (b, fh_b) = fs
        .create(Caller::default(), ROOT_INO, b"b", 0o644, 0)
        .expect("create b");
    std::thread::scope(|s| {
        // The kernel's late RELEASE and FORGET of `a`.
        s.spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(300));
            fs.release(a.ino, fh).expect("release a");
            fs.forget(a.ino, 1);
        });
        fs.fallocate(b.ino, 0, 36 << 20, 0)
            .expect("the space of the released file");
    });
    fs.release(b.ino, fh_b).expect("release b");
    common::close_and_check_clean(fs, &dev, "after the late release");
}

/// A thread that may not wait for releases (a FUSE request loop: the adapter hands the
/// operation to a worker instead) gets ENOSPC at once, and says so is worth a wait.
#[test]
fn enospc_without_waiting_where_release_waits_are_not_allowed() {
    let (dev, fs) = fresh(64 << 20);
    fs.set_release_wait(Arc::new(|| false));
    let (a, fh) = fs
        .create(Caller::default(), ROOT_INO, b"a", 0o644, 0)
        .expect("create a");
    fs.fallocate(a.ino, 0, 36 << 20, 0).expect("fallocate a");
    fs.unlink(ROOT_INO, b"a").expect("unlink a while open");
    let (b, fh_b) = fs
        .create(Caller::default(), ROOT_INO, b"b", 0o644, 0)
        .expect("create b");
    let started = std::time::Instant::now();
    let err = fs
        .fallocate(b.ino, 0, 36 << 20, 0)
        .expect_err("no room while a is held");
    assert_eq!(err.errno(), libc::ENOSPC);
    assert!(
        started.elapsed() < birch_core::vfs::RELEASE_WAIT,
        "no wait on a thread that may not wait"
    );
    assert!(fs.release_may_free_space(), "a's release may free space");
    fs.release(a.ino, fh).expect("release a");
    fs.forget(a.ino, 1);
    assert!(!fs.release_may_free_space(), "nothing left to wait for");
    fs.fallocate(b.ino, 0, 36 << 20, 0)
        .expect("the space of the released file");
    fs.release(b.ino, fh_b).expect("release b");
    common::close_and_check_clean(fs, &dev, "after the release");
}

/// An inline (small) file that would grow past the inline limit on a full filesystem: the
/// write, the truncate and the fallocate each answer ENOSPC and leave its bytes as they were
/// (moving them to a block failed; the inline extent is put back), also after a reopen.
#[test]
fn an_inline_file_that_cannot_grow_keeps_its_bytes() {
    let (dev, fs) = fresh(24 << 20);
    let (small, _) = fs
        .create(Caller::default(), ROOT_INO, b"small", 0o644, 0)
        .expect("create small");
    let content: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
    fs.write(small.ino, 0, &content, false)
        .expect("write small");
    fs.sync().expect("sync");
    let (fill, _) = fs
        .create(Caller::default(), ROOT_INO, b"fill", 0o644, 0)
        .expect("create fill");
    let mut at = 0u64;
    for chunk in [256usize << 10, 4096] {
        loop {
            match fs.write(fill.ino, at, &vec![0xEE; chunk], false) {
                Ok(_) => at += chunk as u64,
                Err(e) => {
                    assert_eq!(e.errno(), libc::ENOSPC, "fill: {e}");
                    break;
                }
            }
        }
        fs.sync().expect("sync");
    }
    let check_small = |fs: &Filesystem, what: &str| {
        assert_eq!(fs.getattr(small.ino).expect("getattr").size, 1000, "{what}");
        let got = fs.read(small.ino, 0, 4096).expect("read small");
        assert_eq!(got, content, "{what}: the inline bytes");
    };
    let err = fs
        .write(small.ino, 3000, b"past the inline limit", false)
        .expect_err("no block for the inline bytes");
    assert_eq!(err.errno(), libc::ENOSPC, "{err}");
    check_small(&fs, "after the write");
    let err = fs
        .fallocate(small.ino, 0, 8192, 0)
        .expect_err("no block for the inline bytes");
    assert_eq!(err.errno(), libc::ENOSPC, "{err}");
    check_small(&fs, "after the fallocate");
    // A truncate may take a block from the reserve that writes leave (deletes and truncates
    // work on a full filesystem); either it fails and the bytes stay inline, or the file
    // holds them in a block followed by zeros.
    let grown = fs.setattr(
        small.ino,
        &SetAttr {
            size: Some(10_000),
            ..Default::default()
        },
    );
    let mut expect = content.clone();
    match grown {
        Err(e) => {
            assert_eq!(e.errno(), libc::ENOSPC, "{e}");
            check_small(&fs, "after the truncate");
        }
        Ok(_) => {
            expect.resize(10_000, 0);
            assert_eq!(fs.read(small.ino, 0, 20_000).expect("read"), expect);
        }
    }
    fs.sync().expect("sync");
    fs.close().expect("close");
    drop(fs);
    let fs = common::open_quiet(&dev);
    assert_eq!(
        fs.read(small.ino, 0, 20_000).expect("read"),
        expect,
        "after a reopen"
    );
    common::close_and_check_clean(fs, &dev, "inline file on a full filesystem");
}

/// A full filesystem can be emptied while commits run beside the deletes (the background
/// committer, woken by the deletes themselves, starts a commit of its own right after the one
/// an unlink forced; while it runs, both deltas count their top nodes). Every unlink must
/// succeed: `admit` commits again while a commit has something to do. One forced commit was
/// not enough: an unlink on a full 64 MiB mount answered ENOSPC in a CI run.
#[test]
fn a_full_filesystem_empties_while_commits_run_beside_the_deletes() {
    let (dev, fs) = fresh(16 << 20);
    let long = "n".repeat(200);
    let mut made = 0u32;
    loop {
        let name = format!("{made:06}{long}");
        match fs.mknod(
            Caller::default(),
            ROOT_INO,
            name.as_bytes(),
            libc::S_IFREG | 0o644,
            0,
        ) {
            Ok(_) => made += 1,
            Err(e) => {
                assert_eq!(e.errno(), libc::ENOSPC, "{e}");
                break;
            }
        }
        assert!(made < 1_000_000, "never full");
    }
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        // The committer: a commit after every few deletes, racing the ones they force.
        s.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                fs.sync().expect("a commit beside the deletes");
            }
        });
        // Two deleters: one refills the delta between the commit the other forced and its
        // second look.
        let deleters: Vec<_> = (0..2u32)
            .map(|t| {
                let (fs, long, stop) = (&fs, &long, &stop);
                s.spawn(move || {
                    for i in (t..made).step_by(2) {
                        let name = format!("{i:06}{long}");
                        if let Err(e) = fs.unlink(ROOT_INO, name.as_bytes()) {
                            stop.store(true, std::sync::atomic::Ordering::Relaxed);
                            return Err(format!("unlink {i} of {made}: {e}"));
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        let results: Vec<_> = deleters.into_iter().map(|h| h.join()).collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for r in results {
            if let Err(e) = r.expect("a deleter panicked") {
                panic!("on a full filesystem with commits beside the deletes: {e}");
            }
        }
    });
    common::close_and_check_clean(fs, &dev, "emptied with commits beside the deletes");
}

/// Forty writers fill the filesystem at once (issue 41: "a full filesystem under forty
/// writers"): each writes stamped 64 KiB pieces to files of its own and fsyncs after each,
/// while a deleter removes the oldest files of a few writers and commits run beside them.
/// Every failure is ENOSPC (never EROFS or EIO: the filesystem never turns read-only), every
/// delete succeeds, writes succeed again once space was freed, and after a power cut every
/// piece whose fsync succeeded (of a file not deleted) holds its stamp; fsck with data is clean.
#[test]
fn forty_writers_fill_the_filesystem_and_nothing_acknowledged_is_lost() {
    use birch_testkit::stamp::{stamp, version_of, STAMP_BYTES};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Mutex;

    const WRITERS: u64 = 40;
    const PIECE_BLOCKS: u64 = 16;
    const MAGIC: u64 = 0x40_f111_0000_0041;
    let (dev, fs) = fresh(48 << 20);
    // (writer, file) -> (inode, pieces acknowledged)
    let acked: Mutex<HashMap<(u64, u64), (u64, u64)>> = Mutex::new(HashMap::new());
    let deleted: Mutex<Vec<(u64, u64)>> = Mutex::new(Vec::new());
    let enospc = AtomicU64::new(0);
    let writes_after_full = AtomicU64::new(0);
    let full = AtomicBool::new(false);
    let stop = AtomicBool::new(false);
    let piece = |w: u64, f: u64, p: u64| -> Vec<u8> {
        (0..PIECE_BLOCKS)
            .flat_map(|b| stamp(MAGIC, w << 16 | f, p * PIECE_BLOCKS + b, 1))
            .collect()
    };
    std::thread::scope(|s| {
        for w in 0..WRITERS {
            let (fs, acked, enospc, full, stop, piece, writes_after_full) = (
                &fs,
                &acked,
                &enospc,
                &full,
                &stop,
                &piece,
                &writes_after_full,
            );
            s.spawn(move || {
                let mut file = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let name = format!("w{w}-{file}");
                    let (attr, fh) =
                        match fs.create(Caller::default(), ROOT_INO, name.as_bytes(), 0o644, 0) {
                            Ok(v) => v,
                            Err(e) => {
                                assert_eq!(e.errno(), libc::ENOSPC, "writer {w}: create: {e}");
                                enospc.fetch_add(1, Ordering::Relaxed);
                                full.store(true, Ordering::Relaxed);
                                std::thread::sleep(std::time::Duration::from_millis(5));
                                continue;
                            }
                        };
                    for p in 0..4u64 {
                        let off = p * PIECE_BLOCKS * STAMP_BYTES as u64;
                        let r = fs
                            .write(attr.ino, off, &piece(w, file, p), false)
                            .and_then(|_| fs.fsync(attr.ino, false));
                        match r {
                            Ok(()) => {
                                if full.load(Ordering::Relaxed) {
                                    writes_after_full.fetch_add(1, Ordering::Relaxed);
                                }
                                acked
                                    .lock()
                                    .expect("acked")
                                    .insert((w, file), (attr.ino.get(), p + 1));
                            }
                            Err(e) => {
                                assert_eq!(e.errno(), libc::ENOSPC, "writer {w}: write/fsync: {e}");
                                enospc.fetch_add(1, Ordering::Relaxed);
                                full.store(true, Ordering::Relaxed);
                                break;
                            }
                        }
                    }
                    fs.release(attr.ino, fh).expect("release");
                    // The kernel forgets the inode it was handed by the create.
                    fs.forget(attr.ino, 1);
                    file += 1;
                }
            });
        }
        // The deleter: once full, removes whole files of the first few writers, oldest first.
        {
            let (fs, acked, deleted, full, stop) = (&fs, &acked, &deleted, &full, &stop);
            s.spawn(move || {
                let started = std::time::Instant::now();
                let mut next = [0u64; 4];
                let mut rounds = 0;
                while started.elapsed() < std::time::Duration::from_secs(8) && rounds < 60 {
                    if !full.load(Ordering::Relaxed) {
                        std::thread::sleep(std::time::Duration::from_millis(5));
                        continue;
                    }
                    rounds += 1;
                    for w in 0..4u64 {
                        let f = next[w as usize];
                        let name = format!("w{w}-{f}");
                        match fs.lookup(ROOT_INO, name.as_bytes()) {
                            Ok(attr) => {
                                fs.unlink(ROOT_INO, name.as_bytes()).unwrap_or_else(|e| {
                                    panic!("unlink {name} on a full filesystem: {e}")
                                });
                                fs.forget(attr.ino, 1);
                                acked.lock().expect("acked").remove(&(w, f));
                                deleted.lock().expect("deleted").push((w, f));
                                next[w as usize] += 1;
                            }
                            Err(e) => assert_eq!(e.errno(), libc::ENOENT, "{name}: {e}"),
                        }
                    }
                    fs.sync().expect("a commit on a full filesystem");
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                stop.store(true, Ordering::Relaxed);
            });
        }
    });
    assert!(
        fs.engine().read_only_cause().is_none(),
        "read-only: {:?}",
        fs.engine().read_only_cause()
    );
    let enospc = enospc.load(Ordering::Relaxed);
    let after = writes_after_full.load(Ordering::Relaxed);
    let deleted = deleted.lock().expect("deleted").len();
    eprintln!(
        "forty writers: {} files with acknowledged pieces, {enospc} ENOSPC, {deleted} files deleted, \
         {after} pieces acknowledged after the first ENOSPC",
        acked.lock().expect("acked").len()
    );
    assert!(enospc > 0, "the filesystem never filled");
    assert!(
        deleted > 0 && after > 0,
        "deletes made no room for new writes"
    );
    let acked = acked.into_inner().expect("acked");
    let (crashed, fs) = common::crash_and_reopen(fs, &dev);
    let mut checked = 0u64;
    for ((w, f), (ino, pieces)) in &acked {
        let data = fs
            .read(
                InodeNo::new(*ino),
                0,
                (pieces * PIECE_BLOCKS) as usize * STAMP_BYTES,
            )
            .unwrap_or_else(|e| panic!("w{w}-{f}: {e}"));
        for (b, block) in data.chunks(STAMP_BYTES).enumerate() {
            assert_eq!(
                version_of(block, MAGIC, w << 16 | f, b as u64),
                Some(1),
                "w{w}-{f} block {b}: an acknowledged piece is not there"
            );
            checked += 1;
        }
    }
    eprintln!("forty writers: {checked} acknowledged blocks checked after the power cut");
    common::close_and_check_clean(fs, &crashed, "forty writers after the power cut");
}
