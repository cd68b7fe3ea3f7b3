//! Remount and the read-only state: what a remount may undo, and what it keeps.
//!
//! Two things broke here once. Whether `remount,rw` may make the engine writable
//! was decided by the text of the read-only reason (`starts_with("mounted read-only")`), so a
//! reworded message could change durability behaviour; it is now the variant of
//! `ReadOnlyCause`. And a mount that started read-only and was remounted rw got a background
//! committer at a fixed 5 s, whatever `commit=` said; it now gets the mount's interval. The
//! tests open filesystems on `MemDevice`, switch them with the control commands the mount
//! helper sends (`ro`, `rw`), and read the engine's cause and the committer's interval.

#![allow(clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use birch_core::check::{check, CheckOptions};
use birch_core::device::MemDevice;
use birch_core::vfs::{Caller, FsyncMode, OpenOptions};
use birch_core::{Filesystem, MkfsOptions, ReadOnlyCause};
use birch_format::ROOT_INO;

fn image() -> Arc<MemDevice> {
    let dev = Arc::new(MemDevice::new(64 << 20));
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    dev
}

fn options(read_only: bool, commit_interval: Option<Duration>) -> OpenOptions {
    OpenOptions {
        read_only,
        commit_interval,
        ..Default::default()
    }
}

/// A mount that started read-only has no committer; `rw` starts one with the mount's own
/// `commit=` (here 7 s), not the default 5 s.
#[test]
fn remount_rw_of_a_read_only_mount_keeps_its_commit_interval() {
    let dev = image();
    let interval = Duration::from_secs(7);
    let fs = Filesystem::open_device(dev.clone(), options(true, Some(interval))).expect("open");
    assert_eq!(fs.engine().read_only_cause(), Some(ReadOnlyCause::Mounted));
    assert_eq!(
        fs.committer_interval(),
        None,
        "a read-only mount commits nothing"
    );
    fs.control(b"rw").expect("remount rw");
    assert_eq!(fs.engine().read_only_cause(), None);
    assert_eq!(fs.committer_interval(), Some(interval));
    fs.write_file("/after-rw", b"writable").expect("write");
    fs.close().expect("close");
    let report = check(&*dev, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{:#?}", report.findings);
}

/// A mount without a background committer (`commit_interval: None`) stays without one
/// after `rw`, as a writable open would.
#[test]
fn remount_rw_without_a_commit_interval_starts_no_committer() {
    let fs = Filesystem::open_device(image(), options(true, None)).expect("open");
    fs.control(b"rw").expect("remount rw");
    assert_eq!(fs.committer_interval(), None);
    fs.close().expect("close");
}

/// `ro` then `rw` on a writable mount: the cause is `Remounted` in between, and the committer
/// that ran from the open keeps its interval.
#[test]
fn remount_ro_then_rw_keeps_the_running_committer() {
    let interval = Duration::from_millis(2500);
    let fs = Filesystem::open_device(image(), options(false, Some(interval))).expect("open");
    assert_eq!(fs.committer_interval(), Some(interval));
    fs.write_file("/before", b"committed by ro").expect("write");
    fs.control(b"ro").expect("remount ro");
    assert_eq!(
        fs.engine().read_only_cause(),
        Some(ReadOnlyCause::Remounted)
    );
    let err = fs.write_file("/refused", b"x").expect_err("read-only");
    assert_eq!(err.errno(), libc::EROFS, "{err}");
    fs.control(b"rw").expect("remount rw");
    assert_eq!(fs.engine().read_only_cause(), None);
    assert_eq!(fs.committer_interval(), Some(interval));
    fs.close().expect("close");
}

/// A failed write of the fsync log turns the engine read-only with `LogWriteFailed`, and a
/// remount cannot undo it (DESIGN §10.11).
#[test]
fn a_failed_log_write_is_read_only_for_good() {
    let dev = image();
    let fs = Filesystem::open_device(
        dev.clone(),
        OpenOptions {
            commit_interval: None,
            fsync: FsyncMode::Log,
            ..Default::default()
        },
    )
    .expect("open");
    let (file, _) = fs
        .create(Caller::default(), ROOT_INO, b"f", 0o644, 0)
        .expect("create");
    fs.sync()
        .expect("commit the name, so the fsync below may use the log");
    // Written through, so the data is on the device before it dies and the fsync's only
    // write is its log batch.
    fs.write_mode(file.ino, 0, &[7u8; 4096], false, None, true)
        .expect("write");
    dev.fail_writes(true);
    fs.fsync(file.ino, false)
        .expect_err("fsync on a dead disk fails");
    let cause = fs.engine().read_only_cause().expect("read-only");
    assert!(
        matches!(cause, ReadOnlyCause::LogWriteFailed { .. }),
        "the log's failure is the cause: {cause:?}"
    );
    assert!(!cause.may_become_writable());
    dev.fail_writes(false);
    let err = fs
        .control(b"rw")
        .expect_err("no remount rw after a failed log write");
    assert_eq!(err.errno(), libc::EROFS, "{err}");
    let err = fs
        .mkdir(Caller::default(), ROOT_INO, b"d", 0o755)
        .expect_err("read-only");
    assert_eq!(err.errno(), libc::EROFS, "{err}");
    fs.power_cut();
}
