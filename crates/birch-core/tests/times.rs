//! Inode times: the clock birchfs stamps them from, and when reads move atime (relatime,
//! strictatime, noatime). SEMANTICS.md §1 "Timestamps".

#![allow(clippy::expect_used)]

use std::sync::Arc;

use birch_core::device::MemDevice;
use birch_core::vfs::{Caller, OpenOptions};
use birch_core::{Filesystem, MkfsOptions};
use birch_format::items::Timespec;

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
        let (f, _) = fs.create(c, 1, name.as_bytes(), 0o644, 0).expect("create");
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
        let root = fs.getattr(1).expect("root");
        assert!(
            root.mtime <= later && root.ctime <= later,
            "create {i}: root times"
        );
    }
}
