//! Device faults through a real FUSE mount with the kernel's writeback cache: a
//! birchfs over the test kit's fault-injecting device is mounted in this process, writers make
//! real system calls on it, and the device fails every write of one file's data (its blocks
//! carry a stamp the fault rule recognises, wherever the allocator puts them). Checked: that
//! file's fsync reports EIO, and every later one; reads of it through the mount never return
//! bytes the filesystem does not hold; the other writers' fsyncs all succeed, and after a
//! power cut every block they were told is durable is there. Needs root and /dev/fuse; skips
//! (passes, saying why) without them.

#![allow(clippy::expect_used)]

mod common;

use std::fs::OpenOptions as FileOptions;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use birch_core::check::{check, CheckOptions};
use birch_core::device::{BlockDevice, MemDevice};
use birch_core::vfs::OpenOptions;
use birch_core::{Filesystem, MkfsOptions};
use birch_fuse::daemon::InProcessMount;
use birch_testkit::{Effect, FaultDevice, Op, Rng, Rule};

const BS: usize = 4096;
const BLOCKS: u64 = 16;
const MAGIC: u64 = 0x5a17_b10c_0000_0000;
const VICTIM: u64 = 9;
const WRITERS: u64 = 3;

/// Block `block` of file `file` at `version`: a header naming all three, random bytes, then
/// a repeated pattern.
fn stamp(file: u64, block: u64, version: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(BS);
    for word in [MAGIC | file, block, version] {
        out.extend_from_slice(&word.to_le_bytes());
    }
    let mut rng = Rng::new((file << 40) ^ (block << 20) ^ version);
    while out.len() < BS / 2 {
        out.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    while out.len() < BS {
        out.push(version as u8 ^ (out.len() as u8 & 7));
    }
    out
}

/// The version `bytes` holds as block `block` of `file`: `Some(0)` for zeros, `None` for
/// anything that is not a whole stamp.
fn version_of(bytes: &[u8], file: u64, block: u64) -> Option<u64> {
    if bytes.iter().all(|b| *b == 0) {
        return Some(0);
    }
    let version = u64::from_le_bytes(bytes.get(16..24)?.try_into().ok()?);
    (bytes == stamp(file, block, version).as_slice()).then_some(version)
}

/// Whether a write carries a block of the victim file (a block-aligned stamp of it).
fn victim_bytes(bytes: &[u8]) -> bool {
    bytes
        .chunks(BS)
        .any(|b| b.get(..8) == Some(&(MAGIC | VICTIM).to_le_bytes()[..]))
}

/// One other writer: stamped writes at random blocks of its own file, an fsync every few;
/// returns the version each block's last successful fsync covered, and the newest written.
fn writer(path: PathBuf, file: u64, seed: u64) -> (Vec<u64>, Vec<u64>) {
    let handle = FileOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .expect("open");
    let mut rng = Rng::new(seed);
    let mut latest = vec![0u64; BLOCKS as usize];
    let mut acked = vec![0u64; BLOCKS as usize];
    for version in 1..=60u64 {
        let block = rng.below(BLOCKS);
        handle
            .write_all_at(&stamp(file, block, version), block * BS as u64)
            .expect("write");
        latest[block as usize] = version;
        if version % 4 == 0 {
            handle
                .sync_all()
                .unwrap_or_else(|e| panic!("fsync of writer {file} failed: {e}"));
            acked.clone_from(&latest);
        }
    }
    handle.sync_all().expect("last fsync");
    acked.clone_from(&latest);
    (acked, latest)
}

#[test]
fn a_data_write_error_costs_only_its_file() {
    if let Some(why) = common::mount_unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let mem = Arc::new(MemDevice::new(64 << 20));
    Filesystem::mkfs(mem.clone(), &MkfsOptions::default()).expect("mkfs");
    let fault = Arc::new(FaultDevice::new(mem.clone(), 41));
    fault.add(Rule::always(Op::Write, Effect::Eio).matching(victim_bytes));
    let fs = Arc::new(
        Filesystem::open_device(
            fault.clone(),
            OpenOptions {
                commit_interval: Some(Duration::from_millis(30)),
                ..Default::default()
            },
        )
        .expect("open"),
    );
    let mnt = std::env::temp_dir().join(format!("birch-fault-mount-{}", std::process::id()));
    std::fs::create_dir_all(&mnt).expect("mountpoint");
    let mount = InProcessMount::start(fs.clone(), &mnt, true, true, false).expect("mount");

    let others: Vec<_> = (0..WRITERS)
        .map(|w| {
            let path = mnt.join(format!("w{w}"));
            std::thread::spawn(move || writer(path, w, 0x41_0000 + w))
        })
        .collect();
    // The victim: every flush of its data fails.
    let victim_path = mnt.join("victim");
    let victim = FileOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&victim_path)
        .expect("victim");
    let mut failures = 0;
    for version in 1..=8u64 {
        let block = version % BLOCKS;
        victim
            .write_all_at(&stamp(VICTIM, block, version), block * BS as u64)
            .expect("a buffered write succeeds");
        match victim.sync_all() {
            Ok(()) => assert_eq!(failures, 0, "an fsync succeeded after one failed"),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
                failures += 1;
            }
        }
    }
    assert!(
        failures > 0,
        "the victim's fsync never reported the lost data"
    );
    let results: Vec<_> = others
        .into_iter()
        .map(|h| h.join().expect("a writer's fsync failed"))
        .collect();
    // Reads of the victim through the mount: only what the filesystem holds (the kernel's
    // copy of the dropped pages must be gone).
    let ino = fs.resolve("/victim").expect("resolve");
    for block in 0..BLOCKS {
        let mut seen = vec![0u8; BS];
        let n = victim
            .read_at(&mut seen, block * BS as u64)
            .expect("read the victim");
        seen.truncate(n);
        seen.resize(BS, 0);
        let mut held = fs.read(ino, block * BS as u64, BS).expect("library read");
        held.resize(BS, 0);
        assert!(
            seen == held,
            "victim block {block}: the mount served {:?}, the filesystem holds {:?}",
            version_of(&seen, VICTIM, block),
            version_of(&held, VICTIM, block)
        );
    }
    drop(victim);
    let injected = fault.stats.total();
    // Power cut while still mounted: what was flushed survives.
    let crashed = Arc::new(mem.crash());
    mount.stop();
    drop(fs);
    let _ = std::fs::remove_dir(&mnt);
    let fs = Filesystem::open_device(
        crashed.clone(),
        OpenOptions {
            commit_interval: None,
            ..Default::default()
        },
    )
    .expect("reopen after the power cut");
    for (w, (acked, latest)) in results.iter().enumerate() {
        let ino = fs.resolve(&format!("/w{w}")).expect("writer file");
        for block in 0..BLOCKS {
            let mut bytes = fs.read(ino, block * BS as u64, BS).expect("read");
            bytes.resize(BS, 0);
            let got = version_of(&bytes, w as u64, block);
            let (a, l) = (acked[block as usize], latest[block as usize]);
            assert!(
                got.is_some_and(|v| a <= v && v <= l),
                "writer {w} block {block}: {got:?} after the crash, fsynced {a}, newest {l}"
            );
        }
    }
    fs.close().expect("close");
    let report = check(&*crashed, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{:#?}", report.findings);
    eprintln!(
        "fault mount: {injected} writes failed; victim fsyncs failed {failures} of 8; {WRITERS} \
         other writers, every fsync acknowledged and found after the power cut"
    );
    let _: &dyn BlockDevice = &*crashed;
}
