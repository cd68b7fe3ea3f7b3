//! Placed blocks against the log's leader: a small overwrite of a log-clean file places its
//! block in memory and queues its extent record without waiting (DESIGN §11.1); the leader of
//! the batch that takes the record writes the block with the batch. Found by the soak (kill -9
//! under fsx and synchronous writers, 4 acknowledged writes lost in 30 minutes): an overwrite
//! of the same range freed the block and forgot its placed bytes after a leader had taken the
//! batch naming it, so the batch went out without them; replay then stopped at that batch and
//! dropped every later, acknowledged one (DESIGN §11.1, "placed blocks").
//!
//! Writers overwrite blocks of log-clean files and fsync now and then (each fsync leads batches
//! holding the other files' queued records) while a monitor takes crash states (the flushed
//! content, as a power cut would leave it): every crash state must read its log to the end,
//! never stop at a batch whose named blocks fail their checksums.

#![allow(clippy::expect_used)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use birch_core::check::{check, CheckOptions};
use birch_core::vfs::{Caller, OpenOptions};
use birch_core::Filesystem;
use birch_format::{InodeNo, BLOCK_SIZE, ROOT_INO};

mod common;

const FILES: usize = 4;
const FILE_BLOCKS: u64 = 32;

/// A block stamped with who wrote it and when (never the same bytes twice).
fn block(file: usize, round: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK_SIZE as usize];
    for (i, chunk) in b.chunks_mut(8).enumerate() {
        let v = (file as u64) << 56 ^ round << 16 ^ i as u64;
        chunk.copy_from_slice(&v.to_le_bytes());
    }
    b
}

#[test]
fn overwrites_racing_the_leader_never_leave_a_batch_without_its_blocks() {
    let dev = common::fresh_device(128 << 20);
    let opts = OpenOptions {
        commit_interval: None,
        ..Default::default()
    };
    let fs = Arc::new(Filesystem::open_device(dev.clone(), opts).expect("open"));
    let mut inos: Vec<InodeNo> = Vec::new();
    for n in 0..FILES {
        let (f, _) = fs
            .create(
                Caller::default(),
                ROOT_INO,
                format!("f{n}").as_bytes(),
                0o644,
                0,
            )
            .expect("create");
        let whole: Vec<u8> = (0..FILE_BLOCKS).flat_map(|r| block(n, r)).collect();
        fs.write(f.ino, 0, &whole, false).expect("fill");
        inos.push(f.ino);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let writes = Arc::new(AtomicU64::new(0));
    let secs: f64 = std::env::var("BIRCH_PLACED_RACE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let mut bad: Vec<String> = Vec::new();
    let mut states = 0u64;
    // Per file: the rounds written to each block, and each block's round at the last fsync.
    let mut models: Vec<(Vec<Vec<u64>>, Vec<u64>)> = Vec::new();
    std::thread::scope(|s| {
        let mut handles = Vec::new();
        for (n, ino) in inos.iter().copied().enumerate() {
            let (fs, stop, writes) = (fs.clone(), stop.clone(), writes.clone());
            handles.push(s.spawn(move || {
                let mut written: Vec<Vec<u64>> = (0..FILE_BLOCKS).map(|r| vec![r]).collect();
                let mut synced: Vec<u64> = (0..FILE_BLOCKS).collect();
                let mut round = FILE_BLOCKS;
                let mut x = n as u64 * 7919 + 1;
                while !stop.load(Ordering::Relaxed) {
                    // Commit now and then: a commit ends log-cleanness, the next fsync
                    // starts it again, and the log is reused.
                    if n == 0 && round % 400 == 0 {
                        fs.sync().expect("commit");
                    }
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let index = (x >> 33) % FILE_BLOCKS;
                    fs.write(ino, index * BLOCK_SIZE, &block(n, round), false)
                        .expect("overwrite");
                    written[index as usize].push(round);
                    writes.fetch_add(1, Ordering::Relaxed);
                    if round % 4 == 0 {
                        fs.fsync(ino, true).expect("fsync");
                        for (i, w) in written.iter().enumerate() {
                            synced[i] = *w.last().expect("one round at least");
                        }
                    }
                    round += 1;
                }
                (written, synced)
            }));
        }
        while Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(15));
            let crashed = dev.crash();
            let report = check(&crashed, CheckOptions::default()).expect("fsck");
            states += 1;
            if report.log_stop.contains("references") {
                bad.push(format!(
                    "crash state {states}: {} batches, then {}",
                    report.log_batches, report.log_stop
                ));
            }
        }
        stop.store(true, Ordering::Relaxed);
        models = handles
            .into_iter()
            .map(|h| h.join().expect("writer"))
            .collect();
    });
    let counters = fs.engine().counters().values();
    eprintln!(
        "{states} crash states, {} overwrites, {} placed blocks written by leaders, {} batches",
        writes.load(Ordering::Relaxed),
        counters.log_placed_written,
        counters.log_batches
    );
    assert!(
        counters.log_placed_written > 0,
        "no leader wrote a placed block: the test does not exercise the path"
    );
    assert!(bad.is_empty(), "{} bad crash states: {bad:#?}", bad.len());
    // The last state: replay takes every batch, and the image checks clean with its data.
    let fs = Arc::into_inner(fs).expect("the writers are done");
    let (crashed, fs) = common::crash_and_reopen(fs, &dev);
    // Every block holds a round written to it by its file, the one of the last fsync or later.
    for (n, (ino, (written, synced))) in inos.iter().zip(&models).enumerate() {
        let bytes = fs
            .read(*ino, 0, (FILE_BLOCKS * BLOCK_SIZE) as usize)
            .expect("read back");
        for (i, b) in bytes.chunks(BLOCK_SIZE as usize).enumerate() {
            let round = written[i]
                .iter()
                .rev()
                .copied()
                .find(|r| block(n, *r) == b)
                .unwrap_or_else(|| panic!("file {n} block {i}: bytes never written there"));
            assert!(
                round >= synced[i],
                "file {n} block {i}: round {round}, older than the fsync'd {}",
                synced[i]
            );
        }
    }
    common::close_and_check_clean(fs, &crashed, "overwrites racing the leader");
}

/// A durable batch with a valid batch after it never fails replay's data check by itself:
/// fsck names the batches replay would drop (`LogBatchesLost`) when a block the first names is
/// clobbered after the fact, says nothing for the same damage to the last batch (a torn last
/// batch is what a power cut leaves), and nothing for the untouched image.
#[test]
fn fsck_names_acknowledged_batches_behind_a_batch_replay_must_stop_at() {
    use birch_core::check::FindingKind;
    use birch_core::device::BlockDevice;
    use birch_format::items::{ExtentKind, FileExtent};
    use birch_format::ItemType;

    let dev = common::fresh_device(64 << 20);
    let opts = OpenOptions {
        commit_interval: None,
        ..Default::default()
    };
    let fs = Filesystem::open_device(dev.clone(), opts).expect("open");
    // Two one-block files, committed; then one overwrite and fsync each: one batch each.
    let mut inos = Vec::new();
    for n in 0..2usize {
        let (f, _) = fs
            .create(
                Caller::default(),
                ROOT_INO,
                format!("f{n}").as_bytes(),
                0o644,
                0,
            )
            .expect("create");
        fs.write(f.ino, 0, &block(n, 0), false).expect("fill");
        inos.push(f.ino);
    }
    fs.sync().expect("commit");
    for (n, ino) in inos.iter().enumerate() {
        fs.write(*ino, 0, &block(n, 1), false).expect("overwrite");
        fs.fsync(*ino, true).expect("fsync");
    }
    fs.power_cut();
    let crashed = dev.crash();
    let report = check(&crashed, CheckOptions::default()).expect("fsck");
    assert!(report.is_clean(), "{:#?}", report.findings);
    assert_eq!(report.log_batches, 2, "{}", report.log_stop);
    let sb = report.superblock.expect("superblock");
    // The block each batch's extent record names (batch n: file n's).
    let records = birch_core::log::read_log(&crashed, &sb).records;
    let blocks: Vec<u64> = inos
        .iter()
        .map(|ino| {
            records
                .iter()
                .filter(|r| {
                    r.key.kind() == Some(ItemType::ExtentData) && r.key.objectid == ino.get()
                })
                .find_map(|r| match FileExtent::decode(r.value.as_ref()?).ok()?.kind {
                    ExtentKind::Regular { disk_addr, .. } => Some(disk_addr),
                    _ => None,
                })
                .expect("an extent record")
        })
        .collect();
    for (which, addr) in blocks.iter().enumerate() {
        let damaged = birch_core::device::MemDevice::from_bytes(crashed.snapshot());
        damaged
            .write_at(&vec![0xee; BLOCK_SIZE as usize], *addr)
            .expect("clobber");
        damaged.flush().expect("flush");
        let report = check(&damaged, CheckOptions::default()).expect("fsck");
        let lost = report
            .findings
            .iter()
            .filter(|f| f.kind == FindingKind::LogBatchesLost)
            .count();
        assert!(
            report.log_stop.contains("references"),
            "batch {which}: {}",
            report.log_stop
        );
        assert_eq!(
            lost,
            usize::from(which == 0),
            "batch {which} clobbered: {:#?}",
            report.findings
        );
    }
}
