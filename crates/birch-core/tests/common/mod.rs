//! Setup shared by the integration tests: filesystems on memory devices with no background
//! committer, so every commit in a test is one the test asked for.

#![allow(clippy::expect_used, dead_code)]

use std::collections::BTreeMap;
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

/// What a user sees of one path: kind, permissions, size, link count, xattrs, bytes, and
/// (when asked for) mtime and ctime.
pub type Seen = (
    String,
    u32,
    u64,
    u32,
    Vec<(Vec<u8>, Vec<u8>)>,
    Vec<u8>,
    Option<(birch_format::items::Timespec, birch_format::items::Timespec)>,
);

/// Every path under the root (the root included) as the filesystem shows it; `times` adds
/// mtime and ctime (atime never: reads change it).
pub fn tree(fs: &Filesystem, times: bool) -> BTreeMap<String, Seen> {
    use birch_core::vfs::FileKind;
    let mut out = BTreeMap::new();
    let mut stack = vec![("/".to_string(), 1u64)];
    while let Some((path, ino)) = stack.pop() {
        let attr = fs.getattr(ino).expect("getattr");
        let mut xattrs = Vec::new();
        for name in fs.listxattr(ino).expect("listxattr").split(|b| *b == 0) {
            if !name.is_empty() {
                xattrs.push((name.to_vec(), fs.getxattr(ino, name).expect("getxattr")));
            }
        }
        xattrs.sort();
        let mut data = if attr.kind == FileKind::File {
            fs.read(ino, 0, attr.size as usize).expect("read")
        } else {
            Vec::new()
        };
        if attr.kind == FileKind::Dir {
            // A directory's bytes: its entries (name and inode), sorted.
            let mut entries = Vec::new();
            for entry in fs.readdir(ino, 0, usize::MAX).expect("readdir") {
                if entry.name == b"." || entry.name == b".." {
                    continue;
                }
                entries.push((entry.name.clone(), entry.ino));
                let name = String::from_utf8_lossy(&entry.name).into_owned();
                let child = if path == "/" {
                    format!("/{name}")
                } else {
                    format!("{path}/{name}")
                };
                stack.push((child, entry.ino));
            }
            entries.sort();
            for (name, ino) in entries {
                data.extend_from_slice(&name);
                data.extend_from_slice(format!("\0{ino}\n").as_bytes());
            }
        }
        let size = if attr.kind == FileKind::Dir {
            0
        } else {
            attr.size
        };
        let stamp = times.then_some((attr.mtime, attr.ctime));
        out.insert(
            path,
            (
                format!("{:?}", attr.kind),
                attr.perm,
                size,
                attr.nlink,
                xattrs,
                data,
                stamp,
            ),
        );
    }
    out
}

/// A memory device whose every read first goes to `hook` (offset, length), which may count
/// it, hold it, or fail it with the error it returns; everything else goes to `inner`.
pub struct HookedReads<F> {
    pub inner: Arc<MemDevice>,
    pub hook: F,
}

impl<F: Fn(u64, usize) -> std::io::Result<()> + Send + Sync> BlockDevice for HookedReads<F> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        (self.hook)(offset, buf.len())?;
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.inner.flush()
    }
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn counters(&self) -> &birch_core::counters::Counters {
        self.inner.counters()
    }
}
