//! The fsync log: cost and crash safety at library level.
//!
//! 1. A 4 KiB append plus fsync takes the log path: exactly one device flush and no superblock
//!    write (seeds 000/004: fsync = one write + one flush, never a transaction commit).
//! 2. Power cut right after fsync: reopening replays the log, the fsync'd bytes are there and
//!    fsck is clean.
//! 3. A crash matrix: each workload runs on a recording device; every crash state (the image
//!    at every flush, plus seeded subsets of the writes since the last flush, some torn at
//!    512 B) is opened (replay), checked by fsck, and judged object by object: every file
//!    fsync'd before the cut has its fsync'd content or a later one written; no other file
//!    holds garbage; new creates work. `BIRCH_SEED` replays; `BIRCH_CRASH_STATES` scales.

#![allow(clippy::expect_used)]

use std::collections::HashMap;
use std::sync::Arc;

use birch_core::check::{check, CheckOptions};
use birch_core::device::{BlockDevice, MemDevice, Recorded};
use birch_core::vfs::{Caller, OpenOptions};
use birch_core::{Filesystem, MkfsOptions};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

fn opts() -> OpenOptions {
    OpenOptions {
        commit_interval: None,
        ..Default::default()
    }
}

fn fresh() -> Arc<MemDevice> {
    let dev = Arc::new(MemDevice::new(96 << 20));
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    dev
}

#[test]
fn append_and_fsync_is_one_flush_and_no_superblock_write() {
    let dev = fresh();
    let fs = Filesystem::open_device(dev.clone(), opts()).expect("open");
    let (f, _) = fs
        .create(Caller::default(), 1, b"db", 0o644, 0)
        .expect("create");
    fs.write(f.ino, 0, &[1u8; 8192], false).expect("write");
    fs.sync().expect("commit the file first");
    let dev_before = dev.counters().values();
    let eng_before = fs.engine().counters().values();
    fs.write(f.ino, 8192, &[2u8; 4096], false).expect("append");
    fs.fsync(f.ino, false).expect("fsync");
    let dev_after = dev.counters().values().since(&dev_before);
    let eng_after = fs.engine().counters().values().since(&eng_before);
    assert_eq!(
        eng_after.fsync_log, 1,
        "fsync must take the log path: {eng_after}"
    );
    assert_eq!(dev_after.flushes, 1, "exactly one flush per fsync");
    assert_eq!(
        eng_after.superblock_writes, 0,
        "no superblock write on the fsync path"
    );
    assert_eq!(eng_after.commits, 0, "no commit on the fsync path");
    assert_eq!(
        dev_after.device_writes, 2,
        "one data write and one log batch write"
    );
    // A second fsync with nothing new costs nothing... beyond the log of unchanged items.
    drop(fs);
}

#[test]
fn fsynced_data_survives_power_loss_through_replay() {
    let dev = fresh();
    {
        let fs = Filesystem::open_device(dev.clone(), opts()).expect("open");
        let c = Caller::default();
        let d = fs.mkdir(c, 1, b"dir", 0o755).expect("mkdir");
        fs.sync().expect("commit dir");
        let (f, _) = fs.create(c, d.ino, b"new", 0o644, 0).expect("create");
        fs.write(f.ino, 0, b"hello log", false).expect("write");
        fs.write(f.ino, 100_000, &[7u8; 10_000], false)
            .expect("write far");
        fs.setxattr(f.ino, b"user.x", b"y", 0).expect("xattr");
        fs.fsync(f.ino, false).expect("fsync");
        let (g, _) = fs
            .create(c, d.ino, b"unsynced", 0o644, 0)
            .expect("create other");
        fs.write(g.ino, 0, b"maybe", false).expect("write other");
        assert_eq!(
            fs.engine().counters().values().commits,
            1,
            "only the explicit commit ran"
        );
        std::mem::forget(fs); // power cut: no close, no final commit
    }
    let crashed = Arc::new(dev.crash());
    let fs = Filesystem::open_device(crashed.clone(), opts()).expect("reopen with replay");
    let data = fs.read_file("/dir/new").expect("fsync'd file exists");
    assert_eq!(&data[..9], b"hello log");
    assert_eq!(data.len(), 110_000);
    assert_eq!(&data[100_000..], &[7u8; 10_000][..]);
    let ino = fs.resolve("/dir/new").expect("resolve");
    assert_eq!(fs.getxattr(ino, b"user.x").expect("xattr"), b"y");
    fs.mkdir(Caller::default(), 1, b"after", 0o755)
        .expect("creates work after replay");
    fs.close().expect("close");
    drop(fs);
    let report = check(&*crashed, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{:#?}", report.findings);
}

/// What a workload did, for the oracle.
#[derive(Default, Clone)]
struct History {
    /// Every content each path ever had, in order.
    versions: HashMap<String, Vec<Vec<u8>>>,
    /// (event count when fsync returned, path, index into versions).
    synced: Vec<(usize, String, usize)>,
}

type Workload = fn(&Filesystem, &MemDevice, &mut History);

fn write_version(fs: &Filesystem, h: &mut History, path: &str, content: Vec<u8>) -> u64 {
    fs.write_file(path, &content).expect("write_file");
    h.versions
        .entry(path.to_string())
        .or_default()
        .push(content);
    fs.resolve(path).expect("resolve")
}

fn sync_path(fs: &Filesystem, dev: &MemDevice, h: &mut History, path: &str) {
    let ino = fs.resolve(path).expect("resolve");
    fs.fsync(ino, false).expect("fsync");
    let events = dev.take_recording_len();
    let version = h.versions[path].len() - 1;
    h.synced.push((events, path.to_string(), version));
}

fn w_append(fs: &Filesystem, dev: &MemDevice, h: &mut History) {
    let mut content = Vec::new();
    for i in 0..6u8 {
        content.extend(std::iter::repeat_n(i + 1, 3000 + i as usize * 1500));
        write_version(fs, h, "/a/log", content.clone());
        sync_path(fs, dev, h, "/a/log");
    }
}

fn w_link_rename(fs: &Filesystem, dev: &MemDevice, h: &mut History) {
    write_version(fs, h, "/a/foo", b"foo v1".to_vec());
    sync_path(fs, dev, h, "/a/foo");
    let ino = fs.resolve("/a/foo").expect("foo");
    let b = fs.resolve("/b").expect("b");
    fs.link(ino, b, b"bar").expect("link");
    fs.fsync(ino, false).expect("fsync after link");
    fs.rename(b, b"bar", b, b"baz", 0).expect("rename");
    fs.fsync(ino, false).expect("fsync after rename");
    write_version(fs, h, "/a/foo", b"foo v2, longer than before".to_vec());
    sync_path(fs, dev, h, "/a/foo");
}

fn w_holes(fs: &Filesystem, dev: &MemDevice, h: &mut History) {
    let mut content = vec![5u8; 40_000];
    write_version(fs, h, "/b/sparse", content.clone());
    sync_path(fs, dev, h, "/b/sparse");
    let ino = fs.resolve("/b/sparse").expect("sparse");
    fs.fallocate(ino, 8192, 16384, 3).expect("punch");
    content[8192..24576].fill(0);
    h.versions
        .get_mut("/b/sparse")
        .expect("versions")
        .push(content.clone());
    sync_path(fs, dev, h, "/b/sparse");
    fs.fallocate(ino, 40_000, 100_000, 1).expect("keep size");
    fs.setattr(
        ino,
        &birch_core::vfs::SetAttr {
            size: Some(1000),
            ..Default::default()
        },
    )
    .expect("truncate");
    fs.setattr(
        ino,
        &birch_core::vfs::SetAttr {
            size: Some(50_000),
            ..Default::default()
        },
    )
    .expect("grow");
    let mut grown = content[..1000].to_vec();
    grown.resize(50_000, 0);
    h.versions
        .get_mut("/b/sparse")
        .expect("versions")
        .push(grown);
    sync_path(fs, dev, h, "/b/sparse");
}

fn w_many(fs: &Filesystem, dev: &MemDevice, h: &mut History) {
    for i in 0..12 {
        let path = format!("/a/f{i}");
        write_version(fs, h, &path, vec![i as u8 + 1; 500 + i * 900]);
        if i % 3 == 0 {
            sync_path(fs, dev, h, &path);
        }
        if i == 7 {
            fs.sync().expect("a commit in the middle");
        }
    }
}

trait RecordingLen {
    fn take_recording_len(&self) -> usize;
}

impl RecordingLen for MemDevice {
    /// Events recorded so far (the recording keeps going).
    fn take_recording_len(&self) -> usize {
        let events = self.take_recording();
        let n = events.len();
        RECORDED.with(|r| r.borrow_mut().extend(events));
        RECORDED.with(|r| r.borrow().len()).max(n)
    }
}

thread_local! {
    static RECORDED: std::cell::RefCell<Vec<Recorded>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn run_matrix(name: &str, workload: Workload, seed: u64, states: usize) -> usize {
    let dev = fresh();
    let base = {
        let fs = Filesystem::open_device(dev.clone(), opts()).expect("open");
        fs.mkdir(Caller::default(), 1, b"a", 0o755).expect("a");
        fs.mkdir(Caller::default(), 1, b"b", 0o755).expect("b");
        fs.close().expect("close");
        dev.snapshot()
    };
    RECORDED.with(|r| r.borrow_mut().clear());
    dev.start_recording();
    let mut history = History::default();
    {
        let fs = Filesystem::open_device(dev.clone(), opts()).expect("open");
        workload(&fs, &dev, &mut history);
        dev.take_recording_len();
        std::mem::forget(fs);
    }
    let events: Vec<Recorded> = RECORDED.with(|r| r.borrow().clone());
    let flushes: Vec<usize> = events
        .iter()
        .enumerate()
        .filter(|(_, e)| matches!(e, Recorded::Flush))
        .map(|(i, _)| i)
        .collect();
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut cuts: Vec<(usize, u64)> = flushes.iter().map(|f| (f + 1, 0)).collect();
    cuts.push((0, 0));
    while cuts.len() < states {
        cuts.push((rng.gen_range(0..=events.len()), rng.gen()));
    }
    for (n, (cut, subset_seed)) in cuts.iter().enumerate() {
        let last_flush = events[..*cut]
            .iter()
            .rposition(|e| matches!(e, Recorded::Flush));
        let durable_upto = last_flush.map_or(0, |i| i + 1);
        let mut image = base.clone();
        let mut srng = SmallRng::seed_from_u64(*subset_seed);
        for (i, e) in events[..*cut].iter().enumerate() {
            let Recorded::Write { offset, bytes } = e else {
                continue;
            };
            let at = *offset as usize;
            if i < durable_upto {
                image[at..at + bytes.len()].copy_from_slice(bytes);
            } else if *subset_seed != 0 && srng.gen_bool(0.5) {
                // An unflushed write may land whole, not at all, or torn at 512 B.
                let len = if srng.gen_bool(0.3) {
                    (srng.gen_range(0..bytes.len() / 512) + 1) * 512
                } else {
                    bytes.len()
                };
                image[at..at + len].copy_from_slice(&bytes[..len]);
            }
        }
        let crashed = Arc::new(MemDevice::from_bytes(image));
        let fs = Filesystem::open_device(crashed.clone(), opts()).unwrap_or_else(|e| {
            panic!("{name} seed {seed} state {n} (cut {cut}): open failed: {e}")
        });
        for (mark, path, version) in &history.synced {
            if *mark > durable_upto {
                continue;
            }
            let got = fs.read_file(path).unwrap_or_else(|e| {
                panic!("{name} seed {seed} state {n} (cut {cut}): fsync'd {path} missing: {e}")
            });
            let allowed = &history.versions[path][*version..];
            assert!(allowed.contains(&got), "{name} seed {seed} state {n} (cut {cut}): {path} has {} bytes, not a version at or after the fsync'd one", got.len());
        }
        for (path, versions) in &history.versions {
            if let Ok(got) = fs.read_file(path) {
                assert!(
                    got.is_empty()
                        || versions.contains(&got)
                        || versions
                            .iter()
                            .any(|v| v.starts_with(&got) || got.starts_with(v)),
                    "{name} seed {seed} state {n}: {path} holds content never written"
                );
            }
        }
        fs.mkdir(Caller::default(), 1, b"new-after-crash", 0o755)
            .expect("creates work after recovery");
        fs.close().expect("close");
        drop(fs);
        let report = check(&*crashed, CheckOptions { data: true }).expect("fsck runs");
        assert!(
            report.is_clean(),
            "{name} seed {seed} state {n} (cut {cut}): fsck: {:#?}",
            report.findings
        );
    }
    cuts.len()
}

#[test]
fn crash_matrix() {
    let seed: u64 = std::env::var("BIRCH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let states: usize = std::env::var("BIRCH_CRASH_STATES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    eprintln!(
        "crash_matrix: seed {seed} ({states} states per workload); replay with BIRCH_SEED={seed}"
    );
    let workloads: [(&str, Workload); 4] = [
        ("append+fsync", w_append),
        ("link/rename+fsync", w_link_rename),
        ("punch/fallocate/truncate+fsync", w_holes),
        ("many files, some fsync'd, a commit between", w_many),
    ];
    let mut total = 0;
    for (name, w) in workloads {
        total += run_matrix(name, w, seed, states);
    }
    eprintln!("crash_matrix: {total} crash states checked, 0 failures");
}
