//! Group commit of synchronous writes (DESIGN §1, seed 001): many O_SYNC writers share
//! few flushes, and what they were told is durable survives a power cut.
//!
//! The FUSE adapter answers an O_DIRECT|O_SYNC WRITE with `write` then `fsync`; these tests do
//! the same through the library. Grouping is counted (device flushes against acknowledged
//! writes), never timed: the memory device's flush takes a few milliseconds to return, as a
//! disk's does, so writers that arrive meanwhile must join the next batch.
//!
//! 1. 16 threads of 64 KiB O_SYNC writes to one file: fewer flushes than half the writes,
//!    fewer than two log records per write (its extents, and the inode item once per batch:
//!    not the inode's whole changed-item list, nor the inode item once per writer), and the
//!    data reads back.
//! 2. 16 threads each fsyncing its own file after small writes: the same grouping.
//! 3. Power cut after concurrent synchronous writes (some extending the file, some fdatasync):
//!    every acknowledged write is there after replay, fsck clean.
//! 4. Every crash state of a single writer's mix of aligned, unaligned and extending
//!    synchronous writes, fsync and fdatasync and a commit (the image at each flush, and each
//!    prefix of the writes after it): the file holds the content of the last acknowledged
//!    operation or of the one in flight, fsck clean.
//! 5. Records queued by writes nobody fsyncs are dropped once a commit covers them.

#![allow(clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use birch_core::check::{check, CheckOptions};
use birch_core::device::{BlockDevice, MemDevice, Recorded};
use birch_core::vfs::{Caller, OpenOptions};
use birch_core::{Filesystem, MkfsOptions};
use birch_format::{InodeNo, ROOT_INO};

const KIB: u64 = 1024;

fn opts() -> OpenOptions {
    OpenOptions {
        commit_interval: None,
        ..Default::default()
    }
}

/// A file of `bytes` laid out in blocks and committed.
fn laid_out(fs: &Filesystem, name: &[u8], bytes: u64) -> u64 {
    let (f, _) = fs
        .create(Caller::default(), ROOT_INO, name, 0o644, 0)
        .expect("create");
    let chunk = vec![0xeeu8; (256 * KIB) as usize];
    let mut at = 0;
    while at < bytes {
        fs.write(f.ino, at, &chunk, false).expect("lay out");
        at += chunk.len() as u64;
    }
    fs.sync().expect("commit");
    f.ino.get()
}

/// The block pattern of writer `t`'s `i`-th write.
fn pattern(t: u64, i: u64, len: usize) -> Vec<u8> {
    let mut v = vec![(t * 31 + i + 1) as u8; len];
    v[0] = t as u8;
    v[1] = i as u8;
    v
}

#[test]
fn synchronous_writers_of_one_file_share_flushes() {
    let (dev, fs) = common::fresh(96 << 20);
    let ino = laid_out(&fs, b"f", 4 << 20);
    let fs = Arc::new(fs);
    dev.set_flush_delay(Duration::from_millis(3));
    let threads = 16u64;
    let rounds = 12u64;
    let before = fs.engine().counters().values();
    let flushes_before = dev.counters().values().flushes;
    std::thread::scope(|s| {
        for t in 0..threads {
            let fs = fs.clone();
            s.spawn(move || {
                for i in 0..rounds {
                    // Each writer owns 256 KiB; its writes move around inside it.
                    let at = t * 256 * KIB + (i % 4) * 64 * KIB;
                    fs.write(
                        InodeNo::new(ino),
                        at,
                        &pattern(t, i, (64 * KIB) as usize),
                        false,
                    )
                    .expect("write");
                    fs.fsync(InodeNo::new(ino), false).expect("fsync");
                }
            });
        }
    });
    let writes = threads * rounds;
    let after = fs.engine().counters().values().since(&before);
    let flushes = dev.counters().values().flushes - flushes_before;
    assert_eq!(after.fsync_log, writes, "every fsync took the log: {after}");
    assert!(
        flushes * 2 < writes,
        "{writes} synchronous writes cost {flushes} flushes: not grouped ({after})"
    );
    // Its extents (a write that splits a laid-out extent changes up to three), and the inode
    // item once per batch, not once per write: a later record of a key queued for the same
    // batch replaces the earlier one.
    assert!(
        after.log_records < 2 * writes,
        "a synchronous write logs its extent and the inode item, not more: {after}"
    );
    for t in 0..threads {
        for slot in 0..4 {
            let last = (0..rounds).rev().find(|i| i % 4 == slot).expect("round");
            let at = t * 256 * KIB + slot * 64 * KIB;
            let got = fs
                .read(InodeNo::new(ino), at, (64 * KIB) as usize)
                .expect("read");
            assert!(
                got == pattern(t, last, (64 * KIB) as usize),
                "writer {t} slot {slot}"
            );
        }
    }
}

#[test]
fn fsyncs_of_different_files_share_flushes() {
    let (dev, fs) = common::fresh(96 << 20);
    let threads = 16u64;
    let rounds = 12u64;
    let inos: Vec<u64> = (0..threads)
        .map(|t| laid_out(&fs, format!("f{t}").as_bytes(), 256 * KIB))
        .collect();
    let fs = Arc::new(fs);
    dev.set_flush_delay(Duration::from_millis(3));
    let flushes_before = dev.counters().values().flushes;
    let before = fs.engine().counters().values();
    std::thread::scope(|s| {
        for (t, &ino) in inos.iter().enumerate() {
            let fs = fs.clone();
            s.spawn(move || {
                for i in 0..rounds {
                    // Unaligned: the general write path, then a scanning fsync.
                    fs.write(
                        InodeNo::new(ino),
                        100 + i * 5000,
                        &pattern(t as u64, i, 3000),
                        false,
                    )
                    .expect("write");
                    fs.fsync(InodeNo::new(ino), i % 2 == 0).expect("fsync");
                }
            });
        }
    });
    let fsyncs = threads * rounds;
    let after = fs.engine().counters().values().since(&before);
    let flushes = dev.counters().values().flushes - flushes_before;
    assert_eq!(after.fsync_log, fsyncs, "every fsync took the log: {after}");
    assert!(
        flushes * 2 < fsyncs,
        "{fsyncs} fsyncs of {threads} files cost {flushes} flushes: not grouped ({after})"
    );
}

#[test]
fn acknowledged_synchronous_writes_survive_a_power_cut() {
    let (dev, fs) = common::fresh(96 << 20);
    let size = 2 << 20;
    let ino = laid_out(&fs, b"f", size);
    let fs = Arc::new(fs);
    dev.set_flush_delay(Duration::from_millis(1));
    let threads = 8u64;
    let rounds = 16u64;
    let block = (64 * KIB) as usize;
    std::thread::scope(|s| {
        for t in 0..threads {
            let fs = fs.clone();
            s.spawn(move || {
                for i in 0..rounds {
                    let at = if t == 0 {
                        size + i * 64 * KIB // extends the file
                    } else {
                        t * 128 * KIB + (i % 2) * 64 * KIB
                    };
                    fs.write(InodeNo::new(ino), at, &pattern(t, i, block), false)
                        .expect("write");
                    fs.fsync(InodeNo::new(ino), t % 2 == 1).expect("fsync");
                }
            });
        }
    });
    let fs = Arc::into_inner(fs).expect("last reference");
    fs.power_cut();
    let crashed = Arc::new(dev.crash());
    let fs = Filesystem::open_device(crashed.clone(), opts()).expect("replay");
    assert_eq!(
        fs.getattr(InodeNo::new(ino)).expect("getattr").size,
        size + rounds * 64 * KIB,
        "the extending writes' size"
    );
    for t in 0..threads {
        for i in 0..rounds {
            let (at, latest) = if t == 0 {
                (size + i * 64 * KIB, true)
            } else {
                (t * 128 * KIB + (i % 2) * 64 * KIB, i + 2 >= rounds)
            };
            if !latest {
                continue;
            }
            let got = fs.read(InodeNo::new(ino), at, block).expect("read");
            assert!(got == pattern(t, i, block), "writer {t} write {i} lost");
        }
    }
    fs.close().expect("close");
    drop(fs);
    let report = check(&*crashed, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{report:?}");
}

/// One step of the single-writer crash workload.
enum Step {
    Write { at: u64, len: usize, datasync: bool },
    Commit,
}

#[test]
fn every_crash_state_of_synchronous_writes_keeps_acknowledged_data() {
    let dev = Arc::new(MemDevice::new(48 << 20));
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    let fs = common::open_quiet(&dev);
    let size = 512 * KIB;
    let ino = laid_out(&fs, b"f", size);
    let base = dev.snapshot();
    dev.start_recording();
    let steps = [
        Step::Write {
            at: 0,
            len: 65536,
            datasync: false,
        }, // scanning fsync: marks the inode log-clean
        Step::Write {
            at: 128 * KIB,
            len: 65536,
            datasync: false,
        }, // logs only its own range
        Step::Write {
            at: 64 * KIB,
            len: 8192,
            datasync: true,
        },
        Step::Write {
            at: 1000,
            len: 5000,
            datasync: false,
        }, // unaligned: not log-clean after it, scans again
        Step::Write {
            at: 4096,
            len: 4096,
            datasync: true,
        },
        Step::Write {
            at: size,
            len: 65536,
            datasync: true,
        }, // extends the file
        Step::Commit,
        Step::Write {
            at: 256 * KIB,
            len: 16384,
            datasync: false,
        },
        Step::Write {
            at: 260 * KIB,
            len: 4096,
            datasync: false,
        },
        Step::Write {
            at: size + 32 * KIB,
            len: 65536,
            datasync: false,
        },
        Step::Write {
            at: 0,
            len: 4096,
            datasync: true,
        },
    ];
    // The content after each acknowledged step, and the device's flush count at its answer.
    let mut model = fs.read(InodeNo::new(ino), 0, size as usize).expect("read");
    let mut acked: Vec<(u64, Vec<u8>)> = vec![(0, model.clone())];
    let mut flushes = 0u64;
    let flush_base = dev.counters().values().flushes;
    for (n, step) in steps.iter().enumerate() {
        match *step {
            Step::Write { at, len, datasync } => {
                let bytes = pattern(n as u64, 0, len);
                fs.write(InodeNo::new(ino), at, &bytes, false)
                    .expect("write");
                fs.fsync(InodeNo::new(ino), datasync).expect("fsync");
                let end = at as usize + len;
                if model.len() < end {
                    model.resize(end, 0);
                }
                model[at as usize..end].copy_from_slice(&bytes);
            }
            Step::Commit => fs.sync().expect("commit"),
        }
        flushes = dev.counters().values().flushes - flush_base;
        acked.push((flushes, model.clone()));
    }
    let recording = dev.take_recording();
    assert_eq!(
        recording
            .iter()
            .filter(|r| matches!(r, Recorded::Flush))
            .count() as u64,
        flushes
    );
    fs.power_cut();
    // State (j, k): everything up to flush j durable, plus the first k writes after it.
    let mut image = base;
    let mut j = 0u64;
    let mut states = 0;
    let mut at = 0;
    while at <= recording.len() {
        let pending: Vec<&Recorded> = recording[at..]
            .iter()
            .take_while(|r| !matches!(r, Recorded::Flush))
            .collect();
        // What may be found: the last step answered by flush j, or the next one.
        let done = acked.iter().rposition(|(f, _)| *f <= j).expect("step");
        let allowed: Vec<&Vec<u8>> = acked[done..(done + 2).min(acked.len())]
            .iter()
            .map(|(_, m)| m)
            .collect();
        for k in 0..=pending.len() {
            let mut state = image.clone();
            for r in &pending[..k] {
                if let Recorded::Write { offset, bytes } = r {
                    let o = *offset as usize;
                    state[o..o + bytes.len()].copy_from_slice(bytes);
                }
            }
            let crashed = Arc::new(MemDevice::from_bytes(state));
            let fs = Filesystem::open_device(crashed.clone(), opts()).expect("open crash state");
            let len = fs.getattr(InodeNo::new(ino)).expect("getattr").size as usize;
            let got = fs.read(InodeNo::new(ino), 0, len).expect("read");
            assert!(
                allowed.iter().any(|m| **m == got),
                "crash after flush {j} and {k} more writes: the file is neither step {} \
                 nor the one after it",
                done
            );
            fs.close().expect("close");
            drop(fs);
            let report = check(&*crashed, CheckOptions { data: true }).expect("fsck");
            assert!(report.is_clean(), "flush {j} + {k}: {report:?}");
            states += 1;
        }
        for r in &pending {
            if let Recorded::Write { offset, bytes } = r {
                let o = *offset as usize;
                image[o..o + bytes.len()].copy_from_slice(bytes);
            }
        }
        at += pending.len() + 1; // past the flush
        j += 1;
    }
    assert!(states > steps.len(), "{states} crash states");
}

#[test]
fn records_of_writes_nobody_fsyncs_are_dropped_by_a_commit() {
    let (_dev, fs) = common::fresh(96 << 20);
    let ino = laid_out(&fs, b"f", 2 << 20);
    let (g, _) = fs
        .create(Caller::default(), ROOT_INO, b"g", 0o644, 0)
        .expect("create");
    fs.sync().expect("commit");
    // An O_SYNC write makes the file log-clean; the writes after it queue their own records.
    fs.write(InodeNo::new(ino), 0, &[1u8; 65536], false)
        .expect("write");
    fs.fsync(InodeNo::new(ino), false).expect("fsync");
    for i in 1..32u64 {
        fs.write(InodeNo::new(ino), i * 64 * KIB, &[2u8; 65536], false)
            .expect("write");
    }
    fs.sync().expect("commit covers them");
    fs.write(g.ino, 0, b"small", false).expect("write");
    let before = fs.engine().counters().values();
    fs.fsync(g.ino, false).expect("fsync");
    let after = fs.engine().counters().values().since(&before);
    assert!(
        after.log_records <= 4,
        "the batch carries only g's records, not the committed writes of f: {after}"
    );
    assert_eq!(
        fs.read(InodeNo::new(ino), 31 * 64 * KIB, 4).expect("read"),
        vec![2u8; 4],
        "the data itself is committed"
    );
}
