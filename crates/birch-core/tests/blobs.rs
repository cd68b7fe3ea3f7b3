//! Blob extents (DESIGN §16, FORMAT §6.6 kind 4) through the filesystem: `compress_file`
//! rewrites a file's chunks as blobs, and every operation after it (reads, overwrites of part
//! of a blob, punches in the middle, truncates, zero ranges, clones, snapshots, deletion,
//! crashes and reopens) keeps the bytes a model says and an image fsck finds clean, and gives
//! every block back once the files are gone.
//!
//! Content is stamped (each 4 KiB piece names its file, offset and version, partly random,
//! partly text), so a window or block-order bug inside a blob shows.

#![allow(clippy::expect_used)]

mod common;

use birch_core::check::{check, CheckOptions};
use birch_core::device::MemDevice;
use birch_core::vfs::{snapshot_ino, Caller, SetAttr};
use birch_core::Filesystem;
use birch_format::codec::Codec;
use birch_format::items::{ExtentKind, FileExtent};
use birch_format::superblock::INCOMPAT_BLOB_EXTENTS;
use birch_format::{InodeNo, ItemType, Key, BLOCK_SIZE};

const ROOT: InodeNo = birch_format::ROOT_INO;
const DEVICE_BYTES: u64 = 64 << 20;
const B: u64 = BLOCK_SIZE;

/// `len` bytes of file `file`, version `version`, stamped per 4 KiB piece from `from`: a
/// header naming the piece, a pseudo-random quarter, text for the rest (compresses about 2x).
fn stamped(file: u8, version: u8, from: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut at = from;
    while out.len() < len {
        let piece = at / B;
        let mut block = format!("[file {file} piece {piece} version {version}]").into_bytes();
        let mut x = (piece << 8 | u64::from(file)) ^ u64::from(version) << 40 | 1;
        while block.len() < (B / 4) as usize {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            block.extend_from_slice(&x.to_le_bytes());
        }
        let text = format!("piece {piece} of file {file} at version {version}; ");
        while block.len() < B as usize {
            block.extend_from_slice(text.as_bytes());
        }
        block.truncate(B as usize);
        let skip = (at % B) as usize;
        let take = (B as usize - skip).min(len - out.len());
        out.extend_from_slice(&block[skip..skip + take]);
        at += take as u64;
    }
    out
}

fn create(fs: &Filesystem, name: &str) -> InodeNo {
    let (attr, fh) = fs
        .create(Caller::default(), ROOT, name.as_bytes(), 0o644, 0)
        .expect("create");
    fs.release(attr.ino, fh).expect("release");
    attr.ino
}

fn read_all(fs: &Filesystem, ino: InodeNo) -> Vec<u8> {
    let size = fs.getattr(ino).expect("getattr").size;
    fs.read(ino, 0, size as usize).expect("read")
}

fn extents(fs: &Filesystem, ino: InodeNo) -> Vec<(u64, FileExtent)> {
    let lo = Key::new(ino.get(), ItemType::ExtentData, 0);
    let hi = Key::new(ino.get(), ItemType::ExtentData, u64::MAX);
    fs.engine()
        .range(&lo, &hi, usize::MAX)
        .expect("range")
        .into_iter()
        .map(|(k, v)| (k.offset, FileExtent::decode(&v).expect("extent")))
        .collect()
}

fn blobs(fs: &Filesystem, ino: InodeNo) -> usize {
    extents(fs, ino)
        .iter()
        .filter(|(_, e)| match e.kind {
            ExtentKind::Blob(_) => true,
            ExtentKind::Inline(_) | ExtentKind::Regular { .. } | ExtentKind::Prealloc { .. } => {
                false
            }
        })
        .count()
}

fn fsck_clean(dev: &MemDevice, what: &str) {
    let report = check(dev, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{what}: {:?}", report.findings);
}

fn truncate(fs: &Filesystem, ino: InodeNo, size: u64) {
    let set = SetAttr {
        size: Some(size),
        ..Default::default()
    };
    fs.setattr(ino, &set).expect("truncate");
}

/// Fills the free space with a file (synced), then deletes it: a block freed while something
/// still names it is taken and overwritten here.
fn churn(fs: &Filesystem) {
    let ino = create(fs, "churn");
    let chunk = stamped(9, 9, 0, 1 << 20);
    let mut at = 0u64;
    loop {
        match fs.write(ino, at, &chunk, false).and_then(|_| fs.sync()) {
            Ok(()) => at += chunk.len() as u64,
            Err(birch_core::Error::NoSpace(_)) => break,
            Err(e) => panic!("churn: {e}"),
        }
    }
    fs.unlink(ROOT, b"churn").expect("unlink churn");
    fs.forget(ino, u64::MAX);
    fs.sync().expect("sync");
    fs.sync().expect("sync");
}

/// The model's bytes after a write of `bytes` at `offset`.
fn model_write(model: &mut Vec<u8>, offset: u64, bytes: &[u8]) {
    let end = offset as usize + bytes.len();
    if model.len() < end {
        model.resize(end, 0);
    }
    model[offset as usize..end].copy_from_slice(bytes);
}

/// A file compressed in place reads the same, holds blobs, charges fewer blocks, survives a
/// crash and reopen (the open walk counts its blobs), and sets the image's blob flag; random
/// data is kept as it is.
#[test]
fn a_compressed_file_reads_the_same_and_costs_less() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    let ino = create(&fs, "f");
    let data = stamped(1, 1, 0, (1 << 20) + 5000);
    fs.write(ino, 0, &data, false).expect("write");
    let noise = create(&fs, "noise");
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let random: Vec<u8> = (0..256 * 1024)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    fs.write(noise, 0, &random, false).expect("write noise");
    fs.sync().expect("sync");
    let blocks_before = fs.getattr(ino).expect("getattr").blocks;
    let free_before = fs.statfs().bfree;

    let report = fs.compress_file(ino, Codec::Zstd(1)).expect("compress");
    assert_eq!(
        report.compressed, 9,
        "{report:?}: 8 chunks of 128 KiB and the 2-block tail"
    );
    assert!(
        report.stored_bytes * 10 < report.logical_bytes * 7,
        "{report:?}"
    );
    assert_eq!(blobs(&fs, ino), 9);
    assert_eq!(read_all(&fs, ino), data);
    let blocks_after = fs.getattr(ino).expect("getattr").blocks;
    assert!(
        blocks_after < blocks_before * 7 / 10,
        "{blocks_before} -> {blocks_after}"
    );
    let kept = fs.compress_file(noise, Codec::Lz4).expect("compress noise");
    assert_eq!((kept.compressed, kept.kept), (0, 2), "{kept:?}");
    assert_eq!(read_all(&fs, noise), random);

    fs.sync().expect("sync");
    fs.sync().expect("sync: the old blocks come back");
    assert!(fs.statfs().bfree > free_before, "space saved");
    assert_ne!(fs.engine().superblock().incompat & INCOMPAT_BLOB_EXTENTS, 0);
    fsck_clean(&dev, "compressed");
    let (dev, fs) = common::crash_and_reopen(fs, &dev);
    assert_eq!(read_all(&fs, ino), data);
    assert_eq!(read_all(&fs, noise), random);
    common::close_and_check_clean(fs, &dev, "reopened");
}

/// Cuts, overwrites, clones and a snapshot over blobs follow a byte model through commits,
/// crashes and reopens; the snapshot keeps the old bytes; once everything is gone the free
/// space is what it was before the files existed.
#[test]
fn cuts_clones_and_snapshots_over_blobs_follow_the_model() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    fs.sync().expect("sync");
    let free_empty = fs.statfs().bfree;
    let a = create(&fs, "a");
    let b = create(&fs, "b");
    let mut ma = stamped(1, 1, 0, 1 << 20);
    let mut mb = stamped(2, 1, 0, 512 * 1024);
    fs.write(a, 0, &ma, false).expect("write a");
    fs.write(b, 0, &mb, false).expect("write b");
    for ino in [a, b] {
        let r = fs.compress_file(ino, Codec::Lz4).expect("compress");
        assert!(r.compressed > 0 && r.kept == 0, "{r:?}");
    }
    fs.sync().expect("sync");
    let snap = fs.create_snapshot("before").expect("snapshot");
    let snap_a = ma.clone();

    let check_all = |fs: &Filesystem, ma: &[u8], mb: &[u8], what: &str| {
        assert!(read_all(fs, a) == ma, "{what}: a");
        assert!(read_all(fs, b) == mb, "{what}: b");
    };
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // A punch in the middle of a blob: two flagged windows on it.
    fs.fallocate(a, 128 * 1024 + 3 * B, 2 * B, punch)
        .expect("punch");
    ma[(128 * 1024 + 3 * B) as usize..(128 * 1024 + 5 * B) as usize].fill(0);
    check_all(&fs, &ma, &mb, "punch");
    assert!(
        extents(&fs, a).iter().any(|(_, e)| e.shared),
        "pieces flagged"
    );
    // An overwrite of part of a blob, unaligned: head and tail blocks read from the blob.
    let over = stamped(1, 2, 300 * 1024 + 100, 10_000);
    fs.write(a, 300 * 1024 + 100, &over, false)
        .expect("overwrite");
    model_write(&mut ma, 300 * 1024 + 100, &over);
    // A zero range across two blobs, unaligned.
    fs.fallocate(a, 500 * 1024 + 77, 200 * 1024, libc::FALLOC_FL_ZERO_RANGE)
        .expect("zero range");
    ma[(500 * 1024 + 77) as usize..(700 * 1024 + 77) as usize].fill(0);
    // A clone of whole blocks out of the middle of b's blobs into a, and of a into b.
    let n = fs
        .copy_file_range(b, 64 * 1024, a, 800 * 1024, 96 * 1024)
        .expect("clone b -> a");
    assert_eq!(n, 96 * 1024);
    let piece = mb[64 * 1024..160 * 1024].to_vec();
    model_write(&mut ma, 800 * 1024, &piece);
    let n = fs
        .copy_file_range(a, 0, b, 400 * 1024, 200 * 1024)
        .expect("clone a -> b");
    assert_eq!(n, 200 * 1024);
    let piece = ma[..200 * 1024].to_vec();
    model_write(&mut mb, 400 * 1024, &piece);
    check_all(&fs, &ma, &mb, "clones");
    // A truncate into the middle of a blob, then growing again (the tail reads zeros).
    truncate(&fs, b, 450 * 1024 + 1234);
    mb.truncate(450 * 1024 + 1234);
    truncate(&fs, b, 460 * 1024);
    mb.resize(460 * 1024, 0);
    check_all(&fs, &ma, &mb, "truncate");

    fs.sync().expect("sync");
    fsck_clean(&dev, "after the cuts");
    let (dev, fs) = common::crash_and_reopen(fs, &dev);
    check_all(&fs, &ma, &mb, "reopened");
    let in_snap = snapshot_ino(snap.id, a);
    assert!(
        read_all(&fs, in_snap) == snap_a,
        "the snapshot keeps the old bytes"
    );

    // Cut the remaining windows of one cut blob away one by one, fsync'd, then crash: replay.
    fs.fallocate(a, 128 * 1024, 3 * B, punch)
        .expect("punch left");
    ma[128 * 1024..(128 * 1024 + 3 * B) as usize].fill(0);
    fs.fsync(a, false).expect("fsync");
    let (dev, fs) = common::crash_and_reopen(fs, &dev);
    check_all(&fs, &ma, &mb, "replayed");
    fs.sync().expect("sync");
    fsck_clean(&dev, "after replay");

    // No snapshot holds the blobs from here on: a block freed too early is reused.
    fs.delete_snapshot("before").expect("delete snapshot");
    // A middle cut of a blob a clone shares (b's chunk at 128 KiB, cloned into a at 800 KiB):
    // then a's clone and b's left piece go; the right piece's blob must stay whole through a
    // churn that takes every free block.
    fs.fallocate(b, 200 * 1024 + 2 * B, B, punch)
        .expect("punch b");
    mb[(200 * 1024 + 2 * B) as usize..(200 * 1024 + 3 * B) as usize].fill(0);
    let over = stamped(1, 3, 800 * 1024, 96 * 1024);
    fs.write(a, 800 * 1024, &over, false)
        .expect("overwrite the clone");
    model_write(&mut ma, 800 * 1024, &over);
    fs.fallocate(b, 128 * 1024, 72 * 1024 + 2 * B, punch)
        .expect("punch b's left piece");
    mb[128 * 1024..(200 * 1024 + 2 * B) as usize].fill(0);
    // And a middle cut of an unflagged blob (a's last chunk), both pieces gone with a below.
    fs.fallocate(a, 960 * 1024, B, punch).expect("punch a");
    ma[960 * 1024..(960 * 1024 + B) as usize].fill(0);
    fs.sync().expect("sync");
    fs.sync().expect("sync");
    churn(&fs);
    check_all(&fs, &ma, &mb, "after the churn");
    // Read from the device again, not from the decoded-blob cache.
    let (dev, fs) = common::crash_and_reopen(fs, &dev);
    check_all(&fs, &ma, &mb, "after the churn, reopened");

    for name in ["a", "b"] {
        let ino = fs.lookup(ROOT, name.as_bytes()).expect("lookup").ino;
        fs.unlink(ROOT, name.as_bytes()).expect("unlink");
        fs.forget(ino, u64::MAX);
    }
    fs.sync().expect("sync");
    fs.sync().expect("sync");
    fs.sync().expect("sync");
    // In this mount (the counts kept as items came and went) and after a reopen (the counts
    // derived again from the tree).
    assert_eq!(fs.statfs().bfree, free_empty, "every block given back");
    let (dev, fs) = common::crash_and_reopen(fs, &dev);
    assert_eq!(
        fs.statfs().bfree,
        free_empty,
        "every block given back, reopened"
    );
    common::close_and_check_clean(fs, &dev, "emptied");
}

/// A damaged stored block of a blob: fsck names it, a read of the window is EIO, and
/// `fsck --repair` loses that window (never the other blobs' bytes), naming the path and the
/// range; the image is clean afterwards and the file reads zeros there.
#[test]
fn repair_loses_the_window_of_a_damaged_blob() {
    use birch_core::repair::{repair, RepairMode};

    let (dev, fs) = common::fresh(DEVICE_BYTES);
    let ino = create(&fs, "f");
    let data = stamped(3, 1, 0, 512 * 1024);
    fs.write(ino, 0, &data, false).expect("write");
    let r = fs.compress_file(ino, Codec::Zstd(3)).expect("compress");
    assert_eq!(r.compressed, 4, "{r:?}");
    fs.sync().expect("sync");
    let (second, blob) = extents(&fs, ino)
        .into_iter()
        .find_map(|(at, e)| match e.kind {
            ExtentKind::Blob(b) if at == 128 * 1024 => Some((at, b)),
            ExtentKind::Blob(_)
            | ExtentKind::Inline(_)
            | ExtentKind::Regular { .. }
            | ExtentKind::Prealloc { .. } => None,
        })
        .expect("a blob at 128 KiB");
    fs.close().expect("close");
    drop(fs);
    dev.corrupt(blob.disk_addr + 100, &[0xde, 0xad]);
    let report = check(&*dev, CheckOptions { data: true }).expect("fsck");
    let kinds: Vec<_> = report.findings.iter().map(|f| f.kind).collect();
    assert_eq!(
        kinds,
        vec![birch_core::check::FindingKind::DataChecksumMismatch],
        "{:?}",
        report.findings
    );
    let fs = common::open_quiet(&dev);
    assert!(
        fs.read(ino, second + 4096, 100).is_err(),
        "a read of the damaged blob fails"
    );
    assert_eq!(
        fs.read(ino, 0, 4096).expect("another blob reads"),
        data[..4096]
    );
    fs.close().expect("close");
    drop(fs);
    let fixed = repair(dev.clone(), RepairMode::Full, CheckOptions { data: true }).expect("repair");
    let lost = fixed.lost.join("\n");
    assert!(
        lost.contains("/f") && lost.contains(&format!("{second}")),
        "lost: {lost}"
    );
    fsck_clean(&dev, "repaired");
    let fs = common::open_quiet(&dev);
    let mut want = data.clone();
    want[second as usize..second as usize + 128 * 1024].fill(0);
    assert!(
        read_all(&fs, ino) == want,
        "the window reads zeros, the rest as written"
    );
    common::close_and_check_clean(fs, &dev, "reopened after repair");
}

/// A rewrite runs beside writes, reads and truncates of the same file (it takes the file's
/// lock one chunk at a time): whatever the interleaving, the file ends as the writes made it.
#[test]
fn compression_beside_writers_keeps_their_bytes() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    let ino = create(&fs, "f");
    let data = stamped(5, 1, 0, 2 << 20);
    fs.write(ino, 0, &data, false).expect("write");
    fs.sync().expect("sync");
    let mut want = data.clone();
    let writes: Vec<(u64, Vec<u8>)> = (0..40u64)
        .map(|i| {
            let at = (i * 52_711) % (2 << 20);
            (at, stamped(6, i as u8, at, 3000 + (i as usize * 97) % 9000))
        })
        .collect();
    for (at, bytes) in &writes {
        model_write(&mut want, *at, bytes);
    }
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for codec in [Codec::Lz4, Codec::Zstd(1)] {
                fs.compress_file(ino, codec).expect("compress");
            }
        });
        scope.spawn(|| {
            for (at, bytes) in &writes {
                fs.write(ino, *at, bytes, false).expect("write beside");
                let _ = fs.read(ino, *at, 5000).expect("read beside");
            }
        });
    });
    assert!(read_all(&fs, ino) == want, "the writes as made");
    assert!(blobs(&fs, ino) > 0, "something was compressed");
    fs.sync().expect("sync");
    fsck_clean(&dev, "after the race");
    let (dev, fs) = common::crash_and_reopen(fs, &dev);
    assert!(read_all(&fs, ino) == want, "reopened");
    common::close_and_check_clean(fs, &dev, "closed");
}

/// `compress=` (OpenOptions::compress): data written plainly is rewritten compressed before
/// the commit a `sync` makes, counted in the stats; files written only in part of a chunk,
/// random data and later overwrites stay right; a crash after the sync keeps it all.
#[test]
fn the_compress_option_compresses_before_the_commit() {
    use birch_core::vfs::OpenOptions;
    use std::sync::Arc;

    let dev = common::fresh_device(DEVICE_BYTES);
    let open = |dev: &Arc<MemDevice>| {
        Filesystem::open_device(
            dev.clone() as Arc<dyn birch_core::device::BlockDevice>,
            OpenOptions {
                commit_interval: None,
                compress: Some(Codec::Zstd(1)),
                ..Default::default()
            },
        )
        .expect("open")
    };
    let fs = open(&dev);
    let a = create(&fs, "a");
    let mut ma = stamped(7, 1, 0, 700 * 1024 + 99);
    fs.write(a, 0, &ma, false).expect("write a");
    let small = create(&fs, "small");
    let ms = stamped(8, 1, 0, 20_000);
    fs.write(small, 0, &ms, false).expect("write small");
    fs.sync().expect("sync");
    assert!(blobs(&fs, a) >= 5, "a: {:?}", extents(&fs, a));
    assert_eq!(blobs(&fs, small), 1, "a small file is one chunk");
    let c = fs.engine().counters().values();
    assert!(c.compress_chunks >= 6 && c.compress_stored_bytes < c.compress_logical_bytes);
    // An overwrite of part of a compressed chunk: rewritten at the next pass (the chunk is
    // then no longer plain: its blob keeps the rest).
    let over = stamped(7, 2, 200 * 1024 + 5, 50_000);
    fs.write(a, 200 * 1024 + 5, &over, false)
        .expect("overwrite");
    model_write(&mut ma, 200 * 1024 + 5, &over);
    fs.sync().expect("sync");
    assert!(read_all(&fs, a) == ma);
    assert!(read_all(&fs, small) == ms);
    fsck_clean(&dev, "compress=");
    let (dev, fs) = common::crash_and_reopen(fs, &dev);
    assert!(read_all(&fs, a) == ma);
    assert!(read_all(&fs, small) == ms);
    common::close_and_check_clean(fs, &dev, "reopened");
}
