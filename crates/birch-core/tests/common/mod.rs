//! Setup shared by the integration tests: filesystems on memory devices with no background
//! committer, so every commit in a test is one the test asked for.

#![allow(clippy::expect_used, dead_code)]

use std::sync::Arc;

use birch_core::check::{check, CheckOptions};
use birch_core::device::{BlockDevice, MemDevice};
use birch_core::vfs::OpenOptions;
use birch_core::{Filesystem, MkfsOptions};

/// Opens the filesystem on `dev` with no background commits.
pub fn open_quiet<D: BlockDevice + 'static>(dev: &Arc<D>) -> Filesystem {
    Filesystem::open_device(
        dev.clone() as Arc<dyn BlockDevice>,
        OpenOptions {
            commit_interval: None,
            ..Default::default()
        },
    )
    .expect("open")
}

/// A memory device of `bytes` with a new filesystem on it.
pub fn fresh_device(bytes: u64) -> Arc<MemDevice> {
    let dev = Arc::new(MemDevice::new(bytes));
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    dev
}

/// A new filesystem of `bytes` on a memory device, opened with no background commits.
pub fn fresh(bytes: u64) -> (Arc<MemDevice>, Filesystem) {
    let dev = fresh_device(bytes);
    let fs = open_quiet(&dev);
    (dev, fs)
}

/// Cuts the power under `fs` (no close, no final commit) and opens what `dev` kept, which
/// replays the fsync log. Returns the crashed device and the reopened filesystem.
pub fn crash_and_reopen(fs: Filesystem, dev: &MemDevice) -> (Arc<MemDevice>, Filesystem) {
    fs.power_cut();
    let crashed = Arc::new(dev.crash());
    let fs = open_quiet(&crashed);
    (crashed, fs)
}

/// Closes `fs` and asserts that fsck, data checksums included, finds nothing on `dev`.
pub fn close_and_check_clean(fs: Filesystem, dev: &MemDevice, what: &str) {
    fs.close().expect("close");
    drop(fs);
    let report = check(dev, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{what}: {:?}", report.findings);
}
