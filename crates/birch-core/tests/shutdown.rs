//! Shutdown (`Filesystem::shutdown`, what `birch shutdown` and the `FS_IOC_SHUTDOWN` ioctl
//! reach): each variant keeps what it promises and nothing is written after it.
//!
//! 1. `Commit`: everything written before survives (buffered data too).
//! 2. `Log`: what fsync acknowledged survives; other changes since the last commit do not.
//! 3. `Now`: only what was durable survives; a commit or fsync after it fails.
//! 4. After a shutdown every operation fails with EIO, no device write or flush happens
//!    (close included), and the image reopens by the normal replay, fsck clean, both as the
//!    device holds it and as a power cut right after the shutdown would have left it.

#![allow(clippy::expect_used)]

use std::sync::Arc;

use birch_core::check::{check, CheckOptions};
use birch_core::device::{BlockDevice, MemDevice};
use birch_core::vfs::{Caller, ShutdownMode};
use birch_core::{Error, Filesystem};
use birch_format::ROOT_INO;

mod common;

/// A filesystem with a committed file `old` (1 MiB) and a directory `d`, then:
/// `synced` written and fsync'd, `loose` written and not, and `old` overwritten at its start
/// without fsync. Buffered writes stay in the daemon's memory until a commit or fsync.
fn workload() -> (Arc<MemDevice>, Filesystem) {
    let (dev, fs) = common::fresh(96 << 20);
    fs.write_file("/old", &vec![1u8; 1 << 20]).expect("old");
    fs.mkdir(Caller::default(), ROOT_INO, b"d", 0o755)
        .expect("mkdir");
    fs.sync().expect("commit");
    fs.write_file("/d/synced", &vec![2u8; 300_000])
        .expect("synced");
    let synced = fs.resolve("/d/synced").expect("resolve");
    fs.fsync(synced, false).expect("fsync");
    fs.write_file("/loose", &vec![3u8; 200_000]).expect("loose");
    let old = fs.resolve("/old").expect("resolve");
    fs.write(old, 0, &[4u8; 8192], false).expect("overwrite");
    (dev, fs)
}

/// What a reopened image must hold, per variant.
fn judge(fs: &Filesystem, mode: ShutdownMode, what: &str) {
    let old = fs.read_file("/old").expect("old survives any shutdown");
    assert_eq!(old.len(), 1 << 20, "{what}: size of old");
    let synced = fs.read_file("/d/synced");
    let loose = fs.read_file("/loose");
    match mode {
        ShutdownMode::Commit => {
            assert!(
                old[..8192].iter().all(|&b| b == 4),
                "{what}: overwrite lost"
            );
            assert!(old[8192..].iter().all(|&b| b == 1), "{what}: old garbled");
            assert_eq!(synced.expect("synced"), vec![2u8; 300_000], "{what}");
            assert_eq!(loose.expect("loose"), vec![3u8; 200_000], "{what}");
        }
        ShutdownMode::Log | ShutdownMode::Now => {
            assert!(old.iter().all(|&b| b == 1), "{what}: uncommitted overwrite");
            assert_eq!(synced.expect("fsync'd file"), vec![2u8; 300_000], "{what}");
            assert!(
                matches!(loose, Err(Error::NotFound(_))),
                "{what}: a file neither committed nor fsync'd survived: {:?}",
                loose.map(|v| v.len())
            );
        }
    }
}

fn writes_and_flushes(dev: &MemDevice) -> (u64, u64) {
    let v = dev.counters().values();
    (v.device_writes, v.flushes)
}

fn assert_clean(dev: &MemDevice, what: &str) {
    let report = check(dev, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{what}: {:?}", report.findings);
}

fn run(mode: ShutdownMode) {
    let (dev, fs) = workload();
    fs.shutdown(mode).expect("shutdown");
    assert!(fs.is_shut_down());
    let after = writes_and_flushes(&dev);
    // A power cut right after the shutdown: the durable image.
    let crashed = Arc::new(dev.crash());
    // Nothing more reaches the device, not even at close (no final commit, no orphan
    // reclaim, buffered data dropped).
    fs.close().expect("close after shutdown");
    drop(fs);
    assert_eq!(
        writes_and_flushes(&dev),
        after,
        "{mode:?}: I/O after the shutdown"
    );
    for (image, what) in [(dev, "as written"), (crashed, "power cut after")] {
        let what = format!("{mode:?}, {what}");
        let fs = common::open_quiet(&image);
        judge(&fs, mode, &what);
        // The reopened filesystem works.
        fs.write_file("/after", b"new").expect("write after reopen");
        fs.close().expect("close");
        drop(fs);
        assert_clean(&image, &what);
    }
}

#[test]
fn commit_then_stop_keeps_everything_written_before() {
    run(ShutdownMode::Commit);
}

#[test]
fn log_then_stop_keeps_fsynced_data_only() {
    run(ShutdownMode::Log);
}

#[test]
fn now_keeps_only_what_was_durable() {
    run(ShutdownMode::Now);
}

#[test]
fn after_shutdown_every_operation_fails_with_eio() {
    let (dev, fs) = workload();
    let old = fs.resolve("/old").expect("resolve");
    let d = fs.resolve("/d").expect("resolve");
    fs.setxattr(old, b"user.k", b"v", 0).expect("setxattr");
    fs.shutdown(ShutdownMode::Now).expect("shutdown");
    let before = writes_and_flushes(&dev);
    let eio = |what: &str, r: Result<(), Error>| match r {
        Err(e) => assert_eq!(e.errno(), libc::EIO, "{what}: {e}"),
        Ok(()) => panic!("{what} succeeded after shutdown"),
    };
    let c = Caller::default();
    eio("getattr", fs.getattr(old).map(drop));
    eio("lookup", fs.lookup(ROOT_INO, b"old").map(drop));
    eio(
        "lookup of a missing name",
        fs.lookup(ROOT_INO, b"nope").map(drop),
    );
    eio("read", fs.read(old, 0, 4096).map(drop));
    eio("write", fs.write(old, 0, b"x", false).map(drop));
    eio("create", fs.create(c, ROOT_INO, b"new", 0o644, 0).map(drop));
    eio("mkdir", fs.mkdir(c, ROOT_INO, b"nd", 0o755).map(drop));
    eio("symlink", fs.symlink(c, ROOT_INO, b"sl", b"old").map(drop));
    eio("link", fs.link(old, d, b"l").map(drop));
    eio("unlink", fs.unlink(ROOT_INO, b"old"));
    eio("rmdir", fs.rmdir(ROOT_INO, b"d"));
    eio("rename", fs.rename(ROOT_INO, b"old", ROOT_INO, b"o2", 0));
    eio("readdir", fs.readdir(ROOT_INO, 0, 100).map(drop));
    eio("setxattr", fs.setxattr(old, b"user.k", b"w", 0));
    eio("getxattr", fs.getxattr(old, b"user.k").map(drop));
    eio("listxattr", fs.listxattr(old).map(drop));
    eio("removexattr", fs.removexattr(old, b"user.k"));
    eio("fallocate", fs.fallocate(old, 0, 4096, 0));
    eio("open", fs.open_file(old, libc::O_RDWR).map(drop));
    eio("fsync", fs.fsync(old, false));
    eio("sync", fs.sync());
    eio("control sync", fs.control(b"sync"));
    eio("control rw", fs.control(b"rw"));
    assert!(
        fs.shutdown(ShutdownMode::Commit).is_ok(),
        "a second shutdown does nothing"
    );
    fs.forget(old, 1);
    assert_eq!(writes_and_flushes(&dev), before, "I/O after the shutdown");
    fs.close().expect("close");
    drop(fs);
    assert_eq!(writes_and_flushes(&dev), before, "I/O at close");
    let fs = common::open_quiet(&dev);
    judge(&fs, ShutdownMode::Now, "reopened");
    common::close_and_check_clean(fs, &dev, "reopened after shutdown");
}

#[test]
fn the_control_commands_shut_down() {
    for (command, mode) in [
        (&b"shutdown"[..], ShutdownMode::Commit),
        (b"shutdown-log", ShutdownMode::Log),
        (b"shutdown-now", ShutdownMode::Now),
    ] {
        let (dev, fs) = workload();
        fs.control(command).expect("control");
        assert!(fs.is_shut_down());
        fs.close().expect("close");
        drop(fs);
        let fs = common::open_quiet(&dev);
        judge(&fs, mode, &String::from_utf8_lossy(command));
        common::close_and_check_clean(fs, &dev, "after a control shutdown");
    }
}

#[test]
fn an_open_unlinked_file_is_freed_at_the_next_open() {
    let (dev, fs) = common::fresh(64 << 20);
    let (f, _) = fs
        .create(Caller::default(), ROOT_INO, b"tmp", 0o644, 0)
        .expect("create");
    fs.write(f.ino, 0, &[7u8; 100_000], false).expect("write");
    fs.sync().expect("commit");
    fs.unlink(ROOT_INO, b"tmp").expect("unlink while open");
    fs.shutdown(ShutdownMode::Commit).expect("shutdown");
    fs.close().expect("close");
    drop(fs);
    let fs = common::open_quiet(&dev);
    assert!(matches!(
        fs.lookup(ROOT_INO, b"tmp"),
        Err(Error::NotFound(_))
    ));
    common::close_and_check_clean(fs, &dev, "orphan after shutdown");
}
