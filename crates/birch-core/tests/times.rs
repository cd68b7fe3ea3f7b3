//! Inode times: the clock birchfs stamps them from, and when reads move atime (relatime,
//! strictatime, noatime). SEMANTICS.md §1 "Timestamps".

#![allow(clippy::expect_used)]

use std::sync::Arc;

use birch_core::device::MemDevice;
use birch_core::vfs::{Caller, OpenOptions};
use birch_core::{Filesystem, MkfsOptions};
use birch_format::items::Timespec;
use birch_format::ROOT_INO;

fn fresh() -> Filesystem {
    let dev = Arc::new(MemDevice::new(64 << 20));
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    Filesystem::open_device(
        dev,
        OpenOptions {
            commit_interval: None,
            ..Default::default()
        },
    )
    .expect("open")
}

/// The kernel's coarse clock, the one it stamps inode times from (`current_time`), which it
/// uses for a file's mtime and ctime under the FUSE writeback cache.
fn kernel_clock() -> Timespec {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec that we own.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_REALTIME_COARSE)");
    Timespec {
        sec: ts.tv_sec,
        nsec: ts.tv_nsec as u32,
    }
}

/// xfstests generic/423 and the relatime half of generic/003: a time birchfs stamps (a create)
/// must never be after a time the kernel stamps later (a write under the writeback cache), so
/// it must not run ahead of the kernel's coarse clock read just after it. A fine-grained
/// clock is ahead of the coarse one by up to a tick nearly every time.
#[test]
fn stamped_times_never_run_ahead_of_the_kernels_clock() {
    let fs = fresh();
    let c = Caller::default();
    for i in 0..200u32 {
        let name = format!("f{i}");
        let (f, _) = fs
            .create(c, ROOT_INO, name.as_bytes(), 0o644, 0)
            .expect("create");
        let later = kernel_clock();
        let a = fs.getattr(f.ino).expect("getattr");
        for (what, t) in [
            ("atime", a.atime),
            ("mtime", a.mtime),
            ("ctime", a.ctime),
            ("crtime", a.crtime),
        ] {
            assert!(
                t <= later,
                "create {i}: {what} {t:?} is after the kernel's clock read afterwards {later:?}"
            );
        }
        let root = fs.getattr(ROOT_INO).expect("root");
        assert!(
            root.mtime <= later && root.ctime <= later,
            "create {i}: root times"
        );
    }
}

/// Waits until the filesystem's clock has moved past `t` (it ticks every few milliseconds).
fn after(t: Timespec) {
    while birch_core::vfs::clock() <= t {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// xfstests generic/003: relatime moves atime at the first read after a write only;
/// strictatime at every read and open for reading; noatime never. The mode comes from the
/// mount options and from a remount, through the control command `atime=MODE`.
#[test]
fn atime_follows_the_mode_set_by_the_mount() {
    let fs = fresh();
    let c = Caller::default();
    let (f, _) = fs.create(c, ROOT_INO, b"f", 0o644, 0).expect("create");
    fs.write(f.ino, 0, b"data", false).expect("write");
    let atime = |fs: &Filesystem| fs.getattr(f.ino).expect("getattr").atime;

    // relatime (the default): the first read after the write moves atime, the next does not.
    let t0 = atime(&fs);
    after(t0);
    fs.read(f.ino, 0, 4).expect("read");
    let t1 = atime(&fs);
    assert!(t1 > t0, "relatime: first read after a write moves atime");
    after(t1);
    fs.read(f.ino, 0, 4).expect("read");
    assert_eq!(atime(&fs), t1, "relatime: a second read does not");
    assert!(!fs.atime_at_open(f.ino).expect("open"), "nor an open");

    // strictatime: every read and every open for reading.
    fs.control(b"atime=strictatime")
        .expect("control atime=strictatime");
    assert_eq!(fs.atime_mode(), birch_core::vfs::AtimeMode::StrictAtime);
    fs.read(f.ino, 0, 4).expect("read");
    let t2 = atime(&fs);
    assert!(t2 > t1, "strictatime: every read moves atime");
    after(t2);
    assert!(
        fs.atime_at_open(f.ino).expect("open"),
        "strictatime: an open moves it"
    );
    let t3 = atime(&fs);
    assert!(t3 > t2);
    assert!(
        !fs.atime_at_open(f.ino).expect("open"),
        "not when atime already says now"
    );

    // noatime: nothing, not even a read after a write.
    fs.control(b"atime=noatime").expect("control atime=noatime");
    after(t3);
    fs.write(f.ino, 0, b"more", false).expect("write");
    fs.read(f.ino, 0, 4).expect("read");
    assert!(!fs.atime_at_open(f.ino).expect("open"));
    assert_eq!(atime(&fs), t3, "noatime: nothing moves atime");

    // Back to relatime: the read after that write moves it.
    fs.control(b"atime=relatime")
        .expect("control atime=relatime");
    fs.read(f.ino, 0, 4).expect("read");
    assert!(atime(&fs) > t3, "relatime again");
    assert!(
        fs.control(b"atime=sometimes").is_err(),
        "unknown mode: EINVAL"
    );
}
