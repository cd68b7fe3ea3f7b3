//! The commit drain's cross-file batches (vfs/buffer.rs, DESIGN §10.9.1 and §14.4): a drain of
//! many small dirty files writes their data with a handful of `write_many` calls, not one per
//! file, and every file reads back whole after the commit and after a crash that follows it;
//! a write that fails inside a batch costs only the files it carried (their fsync reports
//! EIO, their growth is undone, their space comes back), the others commit; and writers
//! racing the drain never lose a returned write nor read stale bytes.

#![allow(clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use birch_core::counters::Counters;
use birch_core::device::{BlockDevice, MemDevice};
use birch_core::vfs::Caller;
use birch_core::{Filesystem, MkfsOptions};

use birch_format::{InodeNo, ROOT_INO};
use common::{close_and_check_clean, crash_and_reopen, open_quiet, Recording, POISON};

fn fresh(bytes: u64) -> (Arc<MemDevice>, Arc<Recording>, Filesystem) {
    let mem = Arc::new(MemDevice::new(bytes));
    let dev = Recording::new(mem.clone());
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    let fs = open_quiet(&dev);
    (mem, dev, fs)
}

fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(seed * 7919) as u8)
        .collect()
}

/// Creates `count` files in the root, each written (buffered) with `content(n)`; returns their
/// inode numbers.
fn small_files(fs: &Filesystem, count: u32, content: impl Fn(u32) -> Vec<u8>) -> Vec<InodeNo> {
    (0..count)
        .map(|n| {
            let (f, fh) = fs
                .create(
                    Caller::default(),
                    ROOT_INO,
                    format!("f{n}").as_bytes(),
                    0o644,
                    0,
                )
                .expect("create");
            let bytes = content(n);
            if !bytes.is_empty() {
                fs.write(f.ino, 0, &bytes, false).expect("write");
            }
            fs.release(f.ino, fh).expect("close");
            f.ino
        })
        .collect()
}

fn small(n: u32) -> Vec<u8> {
    pattern(n, 5_000 + n as usize * 13)
}

/// 200 small dirty files: the commit's drain writes their data in a handful of batches (up
/// to 64 writes each), not in 200 device calls; all of them read back identical after the
/// commit and after a power cut that follows it, and fsck finds nothing.
#[test]
fn a_drain_of_many_small_files_writes_them_in_a_few_batches() {
    let (mem, dev, fs) = fresh(128 << 20);
    let files = small_files(&fs, 200, small);
    dev.take();
    let before = fs.engine().counters().values();
    fs.sync().expect("commit");
    let counted = fs.engine().counters().values().since(&before);
    let (batches, singles) = dev.take_write_calls();
    assert_eq!(counted.buffer_flushes, 200, "one flush per file: {counted}");
    assert_eq!(counted.drain_batch_files, 200, "{counted}");
    assert!(
        (1..=8).contains(&counted.drain_batches),
        "200 files of one or two runs each in a handful of batches: {counted}"
    );
    // Every device write call of the commit: the drain's batches, the commit's node batches,
    // the superblock.
    assert!(
        batches.len() + singles as usize <= 20,
        "{} write_many calls {batches:?} and {singles} writes for a commit of 200 files",
        batches.len()
    );
    assert!(
        batches.iter().any(|&n| n >= 32),
        "some batch carries many files: {batches:?}"
    );
    for (n, ino) in files.iter().enumerate() {
        let want = small(n as u32);
        assert_eq!(
            fs.read(InodeNo::new(ino.get()), 0, want.len() + 10)
                .expect("read"),
            want,
            "file {n} after the commit"
        );
    }
    let (crashed, fs) = crash_and_reopen(fs, &mem);
    for (n, ino) in files.iter().enumerate() {
        let want = small(n as u32);
        assert_eq!(
            fs.read(InodeNo::new(ino.get()), 0, want.len() + 10)
                .expect("read"),
            want,
            "file {n} after the crash"
        );
        assert_eq!(
            fs.getattr(InodeNo::new(ino.get())).expect("attr").size,
            want.len() as u64
        );
    }
    close_and_check_clean(fs, &crashed, "after a drain of 200 small files");
}

/// A device write that fails inside a drain batch: only the files whose blocks it carried are
/// lost (their fsync reports EIO every time, their size goes back to before the lost write;
/// the sync reports the loss, once);
/// every other file of the batch commits whole; the lost files' space comes back (the free
/// count equals what a fresh mount computes from the tree) and fsck finds nothing.
#[test]
fn a_failed_write_in_a_batch_loses_only_its_files() {
    let (mem, dev, fs) = fresh(128 << 20);
    let bad = |n: u32| n % 17 == 5;
    let content = |n: u32| {
        let mut bytes = small(n);
        if bad(n) {
            bytes[..POISON.len()].copy_from_slice(POISON);
        }
        bytes
    };
    // The names commit first: the lost files then go back to size 0, not away.
    let files = small_files(&fs, 120, |_| Vec::new());
    fs.sync().expect("commit the names");
    let free_before = fs.statfs().bfree;
    for (n, ino) in files.iter().enumerate() {
        fs.write(InodeNo::new(ino.get()), 0, &content(n as u32), false)
            .expect("write");
    }
    dev.poison.store(true, Ordering::SeqCst);
    let before = fs.engine().counters().values();
    // The commit goes on without the lost files, and says that data was lost (once, as
    // syncfs reports a writeback error).
    let synced = fs.sync();
    assert!(
        matches!(synced, Err(birch_core::Error::StickyIo(_))),
        "the sync reports the lost files: {synced:?}"
    );
    fs.sync().expect("a loss is reported once");
    let counted = fs.engine().counters().values().since(&before);
    assert!(counted.drain_batches >= 1, "{counted}");
    assert!(
        counted.drain_batch_files >= 100,
        "the files were batched: {counted}"
    );
    dev.poison.store(false, Ordering::SeqCst);
    let lost: Vec<u32> = (0..120).filter(|n| bad(*n)).collect();
    assert!(lost.len() >= 5);
    for (n, ino) in files.iter().enumerate() {
        let n = n as u32;
        if bad(n) {
            for attempt in 0..2 {
                let err = fs
                    .fsync(InodeNo::new(ino.get()), false)
                    .expect_err("fsync of a lost file");
                assert_eq!(err.errno(), libc::EIO, "file {n}, attempt {attempt}: {err}");
            }
            assert_eq!(
                fs.getattr(InodeNo::new(ino.get())).expect("attr").size,
                0,
                "file {n}: the lost write's growth is undone"
            );
        } else {
            fs.fsync(InodeNo::new(ino.get()), false)
                .expect("fsync of a file that committed");
            let want = content(n);
            assert_eq!(
                fs.read(InodeNo::new(ino.get()), 0, want.len() + 10)
                    .expect("read"),
                want,
                "file {n}"
            );
        }
    }
    // Space: the good files' blocks are taken, the lost files' are free again, and no
    // reservation is left behind (a reserved block does not count as free).
    fs.sync().expect("commit");
    let free_live = fs.statfs().bfree;
    assert!(free_live < free_before, "{free_live} {free_before}");
    let (crashed, fs) = crash_and_reopen(fs, &mem);
    assert_eq!(
        fs.statfs().bfree,
        free_live,
        "the free space the live filesystem counted is what the tree leaves free"
    );
    for (n, ino) in files.iter().enumerate() {
        let n = n as u32;
        let want = if bad(n) { Vec::new() } else { content(n) };
        assert_eq!(
            fs.read(InodeNo::new(ino.get()), 0, want.len() + 10)
                .expect("read"),
            want,
            "file {n} after the crash"
        );
    }
    close_and_check_clean(fs, &crashed, "after a failed batch write");
}

/// Writers keep rewriting small files (each write the whole file, a new version) and read
/// each back at once, and again before the next write, while commits drain them: a read
/// always returns the newest version (a drain never records older bytes over a newer write);
/// every commit holds, for each file, at least the version whose write returned before the
/// commit began (a copy of what the device kept, opened on its own); after the last commit
/// and a power cut, every file holds its last version.
#[test]
fn writes_racing_a_drain_are_in_this_commit_or_the_next() {
    const FILES: u32 = 96;
    const WRITERS: u32 = 3;
    let (mem, _dev, fs) = fresh(256 << 20);
    let files = small_files(&fs, FILES, |n| version(n, 0));
    fs.sync().expect("commit");
    let fs = Arc::new(fs);
    // The last version of each file whose write returned.
    let done: Arc<Vec<AtomicU64>> = Arc::new((0..FILES).map(|_| AtomicU64::new(0)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (fs, done, stop, files) = (fs.clone(), done.clone(), stop.clone(), files.clone());
            std::thread::spawn(move || {
                let mut v = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    v += 1;
                    for n in (w..FILES).step_by(WRITERS as usize) {
                        let ino = files[n as usize];
                        // Only this thread writes file n: whatever drained meanwhile, the
                        // file still reads as the version this thread wrote last.
                        let last = done[n as usize].load(Ordering::SeqCst);
                        let now = fs.read(InodeNo::new(ino.get()), 0, 1 << 20).expect("read");
                        assert_eq!(
                            which_version(n, &now),
                            Some(last),
                            "file {n}: reads as the last version written"
                        );
                        let bytes = version(n, v);
                        fs.write(InodeNo::new(ino.get()), 0, &bytes, false)
                            .expect("write");
                        done[n as usize].store(v, Ordering::SeqCst);
                        assert_eq!(
                            fs.read(InodeNo::new(ino.get()), 0, bytes.len() + 10)
                                .expect("read"),
                            bytes,
                            "file {n}: a read returns the newest write"
                        );
                    }
                }
                v
            })
        })
        .collect();
    let mut drained = 0;
    for round in 0..6 {
        let floor: Vec<u64> = done.iter().map(|d| d.load(Ordering::SeqCst)).collect();
        let before = fs.engine().counters().values();
        fs.sync().expect("commit");
        drained += fs
            .engine()
            .counters()
            .values()
            .since(&before)
            .drain_batch_files;
        // What the device holds now, opened on its own (its own replay, no log to replay:
        // nothing here fsyncs).
        let copy = Arc::new(mem.crash());
        let seen = open_quiet(&copy);
        for (n, ino) in files.iter().enumerate() {
            let got = seen
                .read(InodeNo::new(ino.get()), 0, 1 << 20)
                .expect("read the copy");
            let v = which_version(n as u32, &got).unwrap_or_else(|| {
                panic!(
                    "round {round}, file {n}: the commit holds no whole version ({} bytes)",
                    got.len()
                )
            });
            assert!(
                v >= floor[n],
                "round {round}, file {n}: version {v} committed, {} had returned before",
                floor[n]
            );
        }
        seen.close().expect("close the copy");
    }
    stop.store(true, Ordering::SeqCst);
    for writer in writers {
        writer.join().expect("writer");
    }
    assert!(drained > 0, "the commits drained buffered files");
    fs.sync().expect("last commit");
    let fs = Arc::into_inner(fs).expect("the writers are gone");
    let (crashed, fs) = crash_and_reopen(fs, &mem);
    let last: HashMap<usize, u64> = done
        .iter()
        .enumerate()
        .map(|(n, d)| (n, d.load(Ordering::SeqCst)))
        .collect();
    for (n, ino) in files.iter().enumerate() {
        let want = version(n as u32, last[&n]);
        assert_eq!(
            fs.read(InodeNo::new(ino.get()), 0, 1 << 20).expect("read"),
            want,
            "file {n} after the crash"
        );
    }
    close_and_check_clean(fs, &crashed, "after writes racing the drains");
}

/// Version `v` of file `n` (the same length for every version of a file, so a whole-file write
/// replaces all of it): its first 8 bytes and the pattern after them tell the version.
fn version(n: u32, v: u64) -> Vec<u8> {
    let len = 4_096 + (n as usize * 997) % 9_000;
    let mut bytes = pattern(n * 1_000 + v as u32, len);
    bytes[..8].copy_from_slice(&v.to_le_bytes());
    bytes
}

/// Which version of file `n` `bytes` are, if exactly one.
fn which_version(n: u32, bytes: &[u8]) -> Option<u64> {
    let v = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    (version(n, v) == bytes).then_some(v)
}

/// Counts the write calls a device gets (a `write_many` once) and their entries.
struct Counting {
    base: Arc<dyn BlockDevice>,
    calls: AtomicU64,
    entries: AtomicU64,
}

impl BlockDevice for Counting {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.base.read_at(buf, offset)
    }

    fn read_many(&self, reads: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        self.base.read_many(reads)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.entries.fetch_add(1, Ordering::Relaxed);
        self.base.write_at(buf, offset)
    }

    fn write_many(&self, writes: &[(u64, &[u8])]) -> io::Result<()> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.entries
            .fetch_add(writes.len() as u64, Ordering::Relaxed);
        self.base.write_many(writes)
    }

    fn flush(&self) -> io::Result<()> {
        self.base.flush()
    }

    fn size_bytes(&self) -> u64 {
        self.base.size_bytes()
    }

    fn counters(&self) -> &Counters {
        self.base.counters()
    }
}

/// Not a check: the device write calls and the time of a commit of 10,000 small dirty files
/// (3-8 KiB, names committed before), on a memory device or, with
/// `BIRCH_MEASURE_IMAGE=PATH`, on a 1 GiB image file made there. Run with
/// `cargo test -p birch-core --release --locked --test drain_batches -- --ignored --nocapture`.
#[test]
#[ignore]
fn measure_a_drain_of_10000_small_files() {
    let base: Arc<dyn BlockDevice> = match std::env::var_os("BIRCH_MEASURE_IMAGE") {
        Some(path) => {
            let path = std::path::PathBuf::from(path);
            let _ = std::fs::remove_file(&path);
            std::fs::File::create(&path)
                .and_then(|f| f.set_len(1 << 30))
                .expect("image");
            Arc::new(
                birch_core::device::FileDevice::open(
                    &path,
                    birch_core::device::OpenMode::ReadWrite,
                )
                .expect("open image"),
            )
        }
        None => Arc::new(MemDevice::new(1 << 30)),
    };
    let dev = Arc::new(Counting {
        base,
        calls: AtomicU64::new(0),
        entries: AtomicU64::new(0),
    });
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    let fs = open_quiet(&dev);
    let files = small_files(&fs, 10_000, |_| Vec::new());
    fs.sync().expect("commit the names");
    let len = |n: u32| 3_000 + (n as usize * 523) % 5_200;
    for (n, ino) in files.iter().enumerate() {
        fs.write(
            InodeNo::new(ino.get()),
            0,
            &pattern(n as u32, len(n as u32)),
            false,
        )
        .expect("write");
    }
    let (calls, entries) = (
        dev.calls.swap(0, Ordering::SeqCst),
        dev.entries.swap(0, Ordering::SeqCst),
    );
    println!("while writing: {calls} device write calls ({entries} writes)");
    let started = std::time::Instant::now();
    fs.sync().expect("commit");
    let took = started.elapsed();
    println!(
        "commit of 10,000 small files: {:.1} ms, {} device write calls ({} writes)",
        took.as_secs_f64() * 1e3,
        dev.calls.load(Ordering::SeqCst),
        dev.entries.load(Ordering::SeqCst)
    );
    for (n, ino) in files.iter().enumerate().step_by(97) {
        let want = pattern(n as u32, len(n as u32));
        assert_eq!(
            fs.read(InodeNo::new(ino.get()), 0, want.len())
                .expect("read"),
            want
        );
    }
    fs.close().expect("close");
}
