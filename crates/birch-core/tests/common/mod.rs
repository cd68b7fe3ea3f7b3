//! Setup shared by the integration tests: filesystems on memory devices with no background
//! committer, so every commit in a test is one the test asked for, and memory devices that
//! hook or record the requests the engine makes of them.

#![allow(clippy::expect_used, dead_code)]

use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use birch_core::check::{check, CheckOptions};
use birch_core::device::{BlockDevice, MemDevice};
use birch_core::vfs::OpenOptions;
use birch_core::{Filesystem, MkfsOptions};
use birch_format::{InodeNo, BLOCK_SIZE};
use parking_lot::Mutex;

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
        let attr = fs.getattr(InodeNo::new(ino)).expect("getattr");
        let mut xattrs = Vec::new();
        for name in fs
            .listxattr(InodeNo::new(ino))
            .expect("listxattr")
            .split(|b| *b == 0)
        {
            if !name.is_empty() {
                xattrs.push((
                    name.to_vec(),
                    fs.getxattr(InodeNo::new(ino), name).expect("getxattr"),
                ));
            }
        }
        xattrs.sort();
        let mut data = if attr.kind == FileKind::File {
            fs.read(InodeNo::new(ino), 0, attr.size as usize)
                .expect("read")
        } else {
            Vec::new()
        };
        if attr.kind == FileKind::Dir {
            // A directory's bytes: its entries (name and inode), sorted.
            let mut entries = Vec::new();
            for entry in fs
                .readdir(InodeNo::new(ino), 0, usize::MAX)
                .expect("readdir")
            {
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
                stack.push((child, entry.ino.get()));
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

/// One request a [`Recording`] device got, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// One `write_at`: its offset and length.
    Write(u64, usize),
    /// One `write_many`: its writes.
    WriteMany(Vec<(u64, usize)>),
    Flush,
    /// One `discard`: its ranges.
    Discard(Vec<(u64, u64)>),
    /// One `read_at` (recorded only while `reads` is on).
    Read(u64, usize),
    /// One `read_many`: its reads (recorded only while `reads` is on).
    ReadMany(Vec<(u64, usize)>),
}

/// Bytes at the start of a block that make a [`Recording`] device fail the write carrying
/// it while its `poison` is on.
pub const POISON: &[u8; 8] = b"FAILFAIL";

/// A memory device that records every request it gets as an [`Event`] (reads only while
/// `reads` is on), carries out the entries of a `read_many` or `write_many` in reverse
/// (nothing may depend on the order within a batch), and can fail requests: a read covering
/// `fail_read_at`, and, while `poison` is on, any write of a block starting with [`POISON`]
/// (the whole `write_many` carrying one fails, once the entries after it, carried out first,
/// are written). Made with
/// [`Recording::trimming`], it can trim and fills discarded ranges with junk (a device may
/// return anything for them); made with [`Recording::new`], a discard does nothing, as by
/// default.
pub struct Recording {
    pub base: Arc<MemDevice>,
    events: Mutex<Vec<Event>>,
    /// Whether reads are recorded too (off at first).
    pub reads: AtomicBool,
    /// A read covering this byte address fails (`u64::MAX`: none).
    pub fail_read_at: AtomicU64,
    /// Whether a write of a block starting with [`POISON`] fails.
    pub poison: AtomicBool,
    /// Whether the device can trim, a discard filling its ranges with junk.
    trims: bool,
}

impl Recording {
    /// A recording device over `base` whose discards do nothing.
    pub fn new(base: Arc<MemDevice>) -> Arc<Recording> {
        Self::make(base, false)
    }

    /// A recording device over `base` that can trim, and fills discarded ranges with junk.
    pub fn trimming(base: Arc<MemDevice>) -> Arc<Recording> {
        Self::make(base, true)
    }

    fn make(base: Arc<MemDevice>, trims: bool) -> Arc<Recording> {
        Arc::new(Recording {
            base,
            events: Mutex::new(Vec::new()),
            reads: AtomicBool::new(false),
            fail_read_at: AtomicU64::new(u64::MAX),
            poison: AtomicBool::new(false),
            trims,
        })
    }

    fn read_one(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let bad = self.fail_read_at.load(Ordering::SeqCst);
        if offset <= bad && bad < offset + buf.len() as u64 {
            return Err(io::Error::other(format!(
                "injected read failure at {offset:#x}"
            )));
        }
        self.base.read_at(buf, offset)
    }

    fn write_one(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        if self.poison.load(Ordering::SeqCst)
            && buf
                .chunks(BLOCK_SIZE as usize)
                .any(|block| block.starts_with(POISON))
        {
            return Err(io::Error::other(format!(
                "injected write failure at {offset:#x}"
            )));
        }
        self.base.write_at(buf, offset)
    }

    /// Every event since the last take.
    pub fn take(&self) -> Vec<Event> {
        std::mem::take(&mut *self.events.lock())
    }

    /// The reads (`read_at` and `read_many`) since the last take (the other events are
    /// dropped).
    pub fn take_reads(&self) -> Vec<Event> {
        self.take()
            .into_iter()
            .filter(|e| matches!(e, Event::Read(..) | Event::ReadMany(_)))
            .collect()
    }

    /// The batched reads (`read_many`) since the last take, each as (offset, length) pairs
    /// (the other events are dropped).
    pub fn take_read_batches(&self) -> Vec<Vec<(u64, usize)>> {
        self.take()
            .into_iter()
            .filter_map(|e| match e {
                Event::ReadMany(reads) => Some(reads),
                _ => None,
            })
            .collect()
    }

    /// The write calls since the last take: the number of writes in each `write_many`, in
    /// order, and the number of `write_at` calls (the other events are dropped).
    pub fn take_write_calls(&self) -> (Vec<usize>, u64) {
        let mut batches = Vec::new();
        let mut singles = 0;
        for event in self.take() {
            match event {
                Event::WriteMany(writes) => batches.push(writes.len()),
                Event::Write(..) => singles += 1,
                _ => {}
            }
        }
        (batches, singles)
    }

    /// The ranges discarded since the last take (the other events are dropped).
    pub fn take_discards(&self) -> Vec<(u64, u64)> {
        self.take()
            .into_iter()
            .filter_map(|e| match e {
                Event::Discard(ranges) => Some(ranges),
                _ => None,
            })
            .flatten()
            .collect()
    }
}

impl BlockDevice for Recording {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if self.reads.load(Ordering::SeqCst) {
            self.events.lock().push(Event::Read(offset, buf.len()));
        }
        self.read_one(buf, offset)
    }

    fn read_many(&self, reads: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        if self.reads.load(Ordering::SeqCst) {
            self.events.lock().push(Event::ReadMany(
                reads.iter().map(|(o, b)| (*o, b.len())).collect(),
            ));
        }
        for (offset, buf) in reads.iter_mut().rev() {
            self.read_one(buf, *offset)?;
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.events.lock().push(Event::Write(offset, buf.len()));
        self.write_one(buf, offset)
    }

    fn write_many(&self, writes: &[(u64, &[u8])]) -> io::Result<()> {
        self.events.lock().push(Event::WriteMany(
            writes.iter().map(|(o, b)| (*o, b.len())).collect(),
        ));
        for (offset, bytes) in writes.iter().rev() {
            self.write_one(bytes, *offset)?;
        }
        Ok(())
    }

    fn discard(&self, ranges: &[(u64, u64)]) -> io::Result<()> {
        self.events.lock().push(Event::Discard(ranges.to_vec()));
        if self.trims {
            for (offset, len) in ranges {
                self.base.write_at(&vec![0xDB; *len as usize], *offset)?;
            }
        }
        Ok(())
    }

    fn can_trim(&self) -> bool {
        self.trims
    }

    fn flush(&self) -> io::Result<()> {
        self.events.lock().push(Event::Flush);
        self.base.flush()
    }

    fn size_bytes(&self) -> u64 {
        self.base.size_bytes()
    }

    fn counters(&self) -> &birch_core::counters::Counters {
        self.base.counters()
    }
}
