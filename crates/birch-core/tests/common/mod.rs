//! Setup shared by the integration tests: filesystems on memory devices with no background
//! committer, so every commit in a test is one the test asked for.

#![allow(clippy::expect_used, dead_code)]

use std::sync::Arc;

use birch_core::device::MemDevice;
use birch_core::vfs::OpenOptions;
use birch_core::{Filesystem, MkfsOptions};

/// Opens the filesystem on `dev` with no background commits.
pub fn open_quiet(dev: &Arc<MemDevice>) -> Filesystem {
    Filesystem::open_device(
        dev.clone(),
        OpenOptions {
            commit_interval: None,
            ..Default::default()
        },
    )
    .expect("open")
}

/// A new filesystem of `bytes` on a memory device, opened with no background commits.
pub fn fresh(bytes: u64) -> (Arc<MemDevice>, Filesystem) {
    let dev = Arc::new(MemDevice::new(bytes));
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    let fs = open_quiet(&dev);
    (dev, fs)
}
