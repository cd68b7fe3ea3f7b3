//! Faults of the device under a running filesystem, through the fault-injecting
//! device of the test kit ([`FaultDevice`]): EIO on writes, flushes and reads, a full device,
//! slow requests. Each case runs a seeded workload of several files (stamped block writes,
//! fsyncs, commits, reads) with one kind of fault armed, checks as it goes what the
//! filesystem promises (a read returns the bytes last written or fails, never other bytes;
//! once a file's fsync failed, every later fsync of it fails), then cuts the power, reopens
//! the image without faults and checks every acknowledged write against the oracle (each
//! block holds the version its last successful fsync or commit covered, or a later one it
//! was written with, never anything else) and fsck, data included.
//!
//! Lost and misdirected writes and lying flushes are not here: no single-copy filesystem
//! keeps acknowledged data through them; what birchfs promises for them (no wrong byte
//! served, fsck and scrub name what they hit) is another test.

#![allow(clippy::expect_used)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use birch_core::check::{check, CheckOptions};
use birch_core::device::{BlockDevice, MemDevice};
use birch_core::vfs::{Caller, OpenOptions};
use birch_core::{Error, Filesystem, MkfsOptions};
use birch_format::{InodeNo, ROOT_INO};
use birch_testkit::{Effect, FaultDevice, Op, Rng, Rule};

const BS: usize = birch_format::BLOCK_SIZE as usize;
const FILES: usize = 4;
const BLOCKS: u64 = 24;
const STEPS: usize = 160;
const MAGIC: u64 = 0xb1c4_fa17_0000_0001;

/// Block `block` of file `file` at `version`: a header naming all three, then bytes drawn
/// from them (half random, half a repeated pattern, so it also compresses).
fn stamp(file: usize, block: u64, version: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(BS);
    for word in [MAGIC, file as u64, block, version] {
        out.extend_from_slice(&word.to_le_bytes());
    }
    let mut rng = Rng::new(((file as u64) << 48) ^ (block << 24) ^ version);
    while out.len() < BS / 2 {
        out.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    while out.len() < BS {
        out.push((version as u8).wrapping_add(out.len() as u8 & 0x0f));
    }
    out
}

/// The version a block holds, if it is a whole stamp of `file`'s `block`; `Some(0)` for
/// zeros (never written, or a hole).
fn version_of(bytes: &[u8], file: usize, block: u64) -> Option<u64> {
    if bytes.iter().all(|b| *b == 0) {
        return Some(0);
    }
    let word = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(bytes.get(i * 8..i * 8 + 8)?);
        Some(u64::from_le_bytes(w))
    };
    let version = word(3)?;
    (word(0)? == MAGIC && bytes == stamp(file, block, version).as_slice()).then_some(version)
}

/// What the workload wrote and what it was told is durable, per file and block.
#[derive(Default, Clone)]
struct Oracle {
    /// Newest version written (0: never).
    latest: Vec<[u64; BLOCKS as usize]>,
    /// Version a successful fsync or commit covered (0: none): the floor after a crash.
    acked: Vec<[u64; BLOCKS as usize]>,
    /// Files whose fsync failed once: every later one must fail.
    fsync_failed: Vec<bool>,
    /// The newest version of each block when a sync reported lost data (0: none): which
    /// file lost it is not said (the log names it), so until a block is written again no
    /// later sync vouches for it (a sync reports a loss once, as syncfs does).
    uncertain: Vec<[u64; BLOCKS as usize]>,
}

impl Oracle {
    fn new() -> Oracle {
        Oracle {
            latest: vec![[0; BLOCKS as usize]; FILES],
            acked: vec![[0; BLOCKS as usize]; FILES],
            fsync_failed: vec![false; FILES],
            uncertain: vec![[0; BLOCKS as usize]; FILES],
        }
    }

    /// A sync or close succeeded: every block of every file whose fsync has not failed is
    /// durable at its newest version, but a block a reported loss may have taken.
    fn synced(&mut self) {
        for f in 0..FILES {
            if self.fsync_failed[f] {
                continue;
            }
            for b in 0..BLOCKS as usize {
                if self.latest[f][b] != self.uncertain[f][b] {
                    self.acked[f][b] = self.latest[f][b];
                }
            }
        }
    }

    /// A sync or close reported lost data (somewhere): blocks not yet acknowledged may be
    /// among it.
    fn sync_lost(&mut self) {
        for f in 0..FILES {
            for b in 0..BLOCKS as usize {
                if self.latest[f][b] != self.acked[f][b] {
                    self.uncertain[f][b] = self.latest[f][b];
                }
            }
        }
    }
}

/// Outcome counts of one case, for the test's summary line.
#[derive(Default, Debug)]
struct Tally {
    acked_fsyncs: u64,
    failed_fsyncs: u64,
    acked_commits: u64,
    failed_ops: u64,
    reads_checked: u64,
    failed_opens: u64,
    injected: u64,
}

fn mount(dev: Arc<dyn BlockDevice>) -> Result<Filesystem, Error> {
    Filesystem::open_device(
        dev,
        OpenOptions {
            commit_interval: None,
            ..Default::default()
        },
    )
}

/// The fault a case arms, drawn from its seed.
fn fault_for(rng: &mut Rng) -> (Rule, &'static str) {
    let after = rng.below(40);
    match rng.below(6) {
        0 => (
            Rule::always(Op::Write, Effect::Eio)
                .after(after)
                .percent(1 + rng.below(10)),
            "EIO on some writes",
        ),
        1 => (
            Rule::always(Op::Write, Effect::Eio).after(after).times(1),
            "EIO on one write",
        ),
        2 => (
            Rule::always(Op::Flush, Effect::Eio)
                .after(rng.below(20))
                .times(1),
            "EIO on one flush",
        ),
        3 => (
            Rule::always(Op::Read, Effect::Eio)
                .after(rng.below(10))
                .percent(5 + rng.below(20)),
            "EIO on some reads",
        ),
        4 => (
            Rule::always(Op::Write, Effect::NoSpace)
                .after(after)
                .percent(1 + rng.below(5)),
            "a full device (ENOSPC from the device)",
        ),
        _ => (
            Rule::always(Op::Write, Effect::Delay(Duration::from_micros(200)))
                .after(after)
                .percent(20),
            "slow writes",
        ),
    }
}

/// Closes `fs` and mounts the device
/// again with the fault still armed; an open the fault fails must fail cleanly, and the next
/// one, without faults, must succeed. A fresh mount clears sticky errors.
fn remount(
    fs: Filesystem,
    fault: &Arc<FaultDevice>,
    oracle: &mut Oracle,
    tally: &mut Tally,
) -> Filesystem {
    // A close reports no lost data (the final commit has no caller to tell): the blocks are
    // read back below instead.
    if fs.close().is_err() {
        tally.failed_ops += 1;
    }
    drop(fs);
    oracle.fsync_failed = vec![false; FILES];
    let fs = match mount(fault.clone()) {
        Ok(fs) => fs,
        Err(_) => {
            tally.failed_opens += 1;
            let rules = fault.take_rules();
            let fs = mount(fault.clone()).expect("an open without faults");
            fault.restore_rules(rules);
            fs
        }
    };
    // What the new mount reads is what the device holds: between the acknowledged version
    // and the newest written, and from now on both.
    let rules = fault.take_rules();
    for f in 0..FILES {
        let ino = fs
            .resolve(&format!("/f{f}"))
            .expect("resolve after the remount");
        for block in 0..BLOCKS {
            let got = read_block(&fs, ino, f, block);
            let (acked, latest) = (
                oracle.acked[f][block as usize],
                oracle.latest[f][block as usize],
            );
            let Some(v) = got.filter(|v| acked <= *v && *v <= latest) else {
                panic!(
                    "after a remount f{f} block {block} holds {got:?}, acknowledged {acked}, \
                     newest written {latest}"
                );
            };
            oracle.acked[f][block as usize] = v;
            oracle.latest[f][block as usize] = v;
        }
    }
    oracle.uncertain = vec![[0; BLOCKS as usize]; FILES];
    fault.restore_rules(rules);
    fs
}

/// The version block `block` of file `f` (inode `ino`) holds, read through `fs` (past the
/// end of the file: zeros).
fn read_block(fs: &Filesystem, ino: InodeNo, f: usize, block: u64) -> Option<u64> {
    let mut bytes = fs
        .read(ino, block * BS as u64, BS)
        .unwrap_or_else(|e| panic!("read f{f} block {block}: {e}"));
    bytes.resize(BS, 0);
    version_of(&bytes, f, block)
}

/// One seeded case: the workload under the fault, the power cut, the check.
fn run_case(seed: u64) -> (Tally, &'static str) {
    let mut rng = Rng::new(seed);
    let mem = Arc::new(MemDevice::new(32 << 20));
    Filesystem::mkfs(mem.clone(), &MkfsOptions::default()).expect("mkfs");
    let fault = Arc::new(FaultDevice::new(mem.clone(), seed));
    let fs = mount(fault.clone()).expect("mount");
    let mut inos = Vec::new();
    for f in 0..FILES {
        let path = format!("/f{f}");
        fs.write_file(&path, b"").expect("create");
        inos.push(fs.resolve(&path).expect("resolve"));
    }
    fs.sync().expect("first commit");
    let (rule, what) = fault_for(&mut rng);
    fault.add(rule);
    let mut oracle = Oracle::new();
    let mut tally = Tally::default();
    let mut version = 0u64;
    let context = |step: usize| format!("seed {seed} ({what}), step {step}");
    let mut fs = fs;
    let trace = std::env::var_os("BIRCH_FAULT_TRACE").is_some();
    for step in 0..STEPS {
        if trace {
            eprintln!("step {step}: injected so far {}", fault.stats.total());
        }
        if step == STEPS / 2 {
            // A remount under the fault: the caches start cold, so reads reach the device.
            fs = remount(fs, &fault, &mut oracle, &mut tally);
        }
        let f = rng.below(FILES as u64) as usize;
        let ino = inos[f];
        match rng.below(10) {
            0..=5 => {
                let block = rng.below(BLOCKS);
                version += 1;
                let bytes = stamp(f, block, version);
                let result = fs.write(ino, block * BS as u64, &bytes, false);
                if trace {
                    eprintln!("  write f{f} block {block} v{version}: {result:?}");
                }
                match result {
                    Ok(_) => oracle.latest[f][block as usize] = version,
                    Err(_) => tally.failed_ops += 1,
                }
            }
            6 | 7 => match fs
                .fsync(ino, rng.chance(30))
                .inspect(|()| {
                    if trace {
                        eprintln!("  fsync f{f}: ok");
                    }
                })
                .inspect_err(|e| {
                    if trace {
                        eprintln!("  fsync f{f}: {e}");
                    }
                }) {
                Ok(()) => {
                    assert!(
                        !oracle.fsync_failed[f],
                        "{}: fsync of f{f} succeeded after one failed",
                        context(step)
                    );
                    oracle.acked[f] = oracle.latest[f];
                    tally.acked_fsyncs += 1;
                }
                Err(_) => {
                    oracle.fsync_failed[f] = true;
                    tally.failed_fsyncs += 1;
                }
            },
            8 => match fs.sync().inspect_err(|e| {
                if trace {
                    eprintln!("  sync: {e}");
                }
            }) {
                Ok(()) => {
                    oracle.synced();
                    tally.acked_commits += 1;
                }
                Err(e) => {
                    if matches!(e, Error::StickyIo(_)) {
                        oracle.sync_lost();
                    }
                    tally.failed_ops += 1;
                }
            },
            _ => {
                let block = rng.below(BLOCKS);
                if let Ok(bytes) = fs.read(ino, block * BS as u64, BS) {
                    let padded = if bytes.is_empty() { vec![0; BS] } else { bytes };
                    let got = version_of(&padded, f, block);
                    let latest = oracle.latest[f][block as usize];
                    let acked = oracle.acked[f][block as usize];
                    // A read serves a version written, never other bytes, and never one
                    // older than what an fsync or commit made durable.
                    assert!(
                        got.is_some_and(|v| acked <= v && v <= latest),
                        "{}: f{f} block {block} read {got:?}, acknowledged {acked}, newest \
                         written {latest}",
                        context(step)
                    );
                    tally.reads_checked += 1;
                }
            }
        }
    }
    tally.injected = fault.stats.total();
    // Power cut: only what the device flushed survives.
    let crashed = Arc::new(mem.crash());
    drop(fs);
    let fs = mount(crashed.clone()).unwrap_or_else(|e| panic!("seed {seed} ({what}): reopen: {e}"));
    for (f, ino) in inos.iter().enumerate() {
        for block in 0..BLOCKS {
            let got = read_block(&fs, *ino, f, block);
            let (acked, latest) = (
                oracle.acked[f][block as usize],
                oracle.latest[f][block as usize],
            );
            assert!(
                got.is_some_and(|v| v >= acked && v <= latest),
                "seed {seed} ({what}): after the crash f{f} block {block} holds {got:?}, \
                 acknowledged {acked}, newest written {latest}"
            );
        }
    }
    fs.close().expect("close");
    let report = check(&*crashed, CheckOptions { data: true }).expect("fsck");
    assert!(
        report.is_clean(),
        "seed {seed} ({what}): fsck after the crash: {:#?}",
        report.findings
    );
    (tally, what)
}

/// Every fault kind over fixed seeds plus a fresh one: nothing acknowledged is lost, no
/// wrong byte is read, failed fsyncs stay failed, and the image is clean after a power cut.
#[test]
fn acknowledged_writes_survive_device_faults() {
    let seeds = birch_testkit::seeds::cases("device_faults", 0xfa_0170_0000, 36);
    let mut by_kind: HashMap<&'static str, Tally> = HashMap::new();
    for seed in seeds {
        let (tally, what) = run_case(seed);
        let sum = by_kind.entry(what).or_default();
        sum.acked_fsyncs += tally.acked_fsyncs;
        sum.failed_fsyncs += tally.failed_fsyncs;
        sum.acked_commits += tally.acked_commits;
        sum.failed_ops += tally.failed_ops;
        sum.reads_checked += tally.reads_checked;
        sum.injected += tally.injected;
        sum.failed_opens += tally.failed_opens;
    }
    let mut kinds: Vec<_> = by_kind.into_iter().collect();
    kinds.sort_by_key(|(what, _)| *what);
    for (what, t) in &kinds {
        eprintln!(
            "faults: {what}: {} injected; fsyncs acknowledged {} failed {}; commits \
             acknowledged {}; other failed ops {}; reads checked {}; opens failed cleanly {}",
            t.injected,
            t.acked_fsyncs,
            t.failed_fsyncs,
            t.acked_commits,
            t.failed_ops,
            t.reads_checked,
            t.failed_opens
        );
    }
    assert!(
        kinds.iter().map(|(_, t)| t.injected).sum::<u64>() > 0,
        "no fault was injected: the test checked nothing"
    );
}

/// EIO on one file's data only (its blocks' addresses learnt from a first write): its fsync
/// fails, and keeps failing; another file written and fsynced meanwhile is unaffected, and
/// both are as the oracle says after a power cut.
#[test]
fn an_eio_on_one_files_data_costs_only_that_file() {
    let mem = Arc::new(MemDevice::new(32 << 20));
    Filesystem::mkfs(mem.clone(), &MkfsOptions::default()).expect("mkfs");
    let fault = Arc::new(FaultDevice::new(mem.clone(), 1));
    let fs = mount(fault.clone()).expect("mount");
    fs.write_file("/victim", b"").expect("victim");
    fs.write_file("/other", b"").expect("other");
    let victim = fs.resolve("/victim").expect("victim");
    let other = fs.resolve("/other").expect("other");
    fs.sync().expect("commit");
    // Every write from here on fails while the victim's data goes out; the other file's
    // fsync comes after the rule is gone.
    fs.write(victim, 0, &stamp(0, 0, 1), false)
        .expect("buffered");
    fault.add(Rule::always(Op::Write, Effect::Eio));
    assert!(
        fs.fsync(victim, false).is_err(),
        "the victim's fsync reports the EIO"
    );
    fault.clear();
    assert!(fs.fsync(victim, false).is_err(), "errors stick");
    // The list of files with errors names the victim, by its path, and only it.
    let (listed, not_listed) = fs.files_with_errors();
    assert_eq!(not_listed, 0);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(
        (listed[0].ino, listed[0].paths.clone()),
        (victim, vec!["/victim".to_string()])
    );
    assert!(listed[0].errors.lost_writes >= 1, "{listed:?}");
    fs.write(other, 0, &stamp(1, 0, 2), false)
        .expect("other write");
    match fs.fsync(other, false) {
        Ok(()) => {}
        // A failed log or commit write turns the whole filesystem read-only: then the
        // other file's fsync fails too, and says so.
        Err(Error::ReadOnly(_)) => {
            eprintln!("the failed write was the log's: read-only");
            return;
        }
        Err(e) => panic!("other file: {e}"),
    }
    let crashed = Arc::new(mem.crash());
    drop(fs);
    let fs = mount(crashed.clone()).expect("reopen");
    let data = fs.read(other, 0, BS).expect("other");
    assert_eq!(
        version_of(&data, 1, 0),
        Some(2),
        "the other file's fsync held"
    );
    let data = fs.read(victim, 0, BS).expect("victim");
    let got = version_of(&data, 0, 0);
    assert!(matches!(got, Some(0) | Some(1)), "{got:?}");
    fs.close().expect("close");
    assert!(check(&*crashed, CheckOptions { data: true })
        .expect("fsck")
        .is_clean());
}

/// `errors=remount-ro`: the first lost data write turns the whole filesystem read-only (the
/// device error named), where `errors=continue` (the test above) costs only the file.
#[test]
fn with_errors_remount_ro_a_lost_data_write_turns_the_filesystem_read_only() {
    let mem = Arc::new(MemDevice::new(32 << 20));
    Filesystem::mkfs(mem.clone(), &MkfsOptions::default()).expect("mkfs");
    let fault = Arc::new(FaultDevice::new(mem.clone(), 2));
    let fs = Filesystem::open_device(
        fault.clone(),
        OpenOptions {
            commit_interval: None,
            errors: birch_core::vfs::ErrorPolicy::RemountRo,
            ..Default::default()
        },
    )
    .expect("mount");
    fs.write_file("/victim", b"").expect("victim");
    fs.write_file("/other", &stamp(1, 0, 1)).expect("other");
    let victim = fs.resolve("/victim").expect("victim");
    fs.sync().expect("commit");
    fault.add(Rule::always(Op::Write, Effect::Eio).matching(|b| {
        b.chunks(BS)
            .any(|c| c.get(..16) == Some(&stamp(0, 0, 7)[..16]))
    }));
    fs.write(victim, 0, &stamp(0, 0, 7), false)
        .expect("buffered");
    assert!(fs.fsync(victim, false).is_err(), "the victim's fsync fails");
    let err = fs.write_file("/other", b"more").expect_err("read-only now");
    assert!(
        matches!(
            err,
            Error::ReadOnly(birch_core::ReadOnlyCause::DeviceError { .. })
        ),
        "{err}"
    );
    assert!(err.to_string().contains("inode"), "{err}");
    let crashed = Arc::new(mem.crash());
    drop(fs);
    let fs = mount(crashed.clone()).expect("reopen");
    assert_eq!(
        version_of(&fs.read_file("/other").expect("other"), 1, 0),
        Some(1)
    );
    fs.close().expect("close");
    assert!(check(&*crashed, CheckOptions { data: true })
        .expect("fsck")
        .is_clean());
}

/// A device that stops answering (`io_timeout=`, [`TimeoutDevice`]): the flush of the fsync
/// in flight hangs; that fsync, and the fsyncs of two other threads waiting meanwhile, answer
/// an error within a bounded time (none waits for the device), the filesystem turns read-only
/// naming the hang, and what needs no device I/O (attributes, names) is still served; a read
/// that needs the device answers EIO. After a power cut the image holds every fsync acknowledged before the hang, and
/// fsck is clean.
#[test]
fn a_hung_device_is_given_up_after_its_io_timeout() {
    use birch_core::device::TimeoutDevice;
    use birch_core::ReadOnlyCause;
    use std::time::Instant;

    let mem = Arc::new(MemDevice::new(32 << 20));
    Filesystem::mkfs(mem.clone(), &MkfsOptions::default()).expect("mkfs");
    let fault = Arc::new(FaultDevice::new(mem.clone(), 1));
    let timed = TimeoutDevice::new(fault.clone(), Duration::from_millis(300));
    let fs = Arc::new(mount(timed.clone()).expect("mount"));
    let weak = Arc::downgrade(&fs);
    timed.on_give_up(Box::new(move |why| {
        if let Some(fs) = weak.upgrade() {
            fs.engine().set_read_only(ReadOnlyCause::DeviceError {
                error: why.to_string(),
            });
        }
    }));
    let names = ["/kept", "/a", "/b", "/c"];
    let mut inos = Vec::new();
    for name in names {
        fs.write_file(name, b"").expect("create");
        inos.push(fs.resolve(name).expect("resolve"));
    }
    fs.sync().expect("commit");
    // Acknowledged before the hang: must survive.
    fs.write(inos[0], 0, &stamp(0, 0, 1), false)
        .expect("write kept");
    fs.fsync(inos[0], false).expect("fsync kept");
    let cached = fs.read(inos[0], 0, BS).expect("read kept");
    // Every flush from here on hangs until released.
    fault.add(Rule::always(Op::Flush, Effect::Hang));
    let started = Instant::now();
    let results: Vec<(usize, Result<(), Error>, Duration)> = std::thread::scope(|s| {
        let handles: Vec<_> = (1..4)
            .map(|i| {
                let fs = &fs;
                let ino = inos[i];
                s.spawn(move || {
                    fs.write(ino, 0, &stamp(i, 0, 2), false)
                        .expect("a buffered write");
                    let r = fs.fsync(ino, false);
                    (i, r, started.elapsed())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("an fsync thread panicked"))
            .collect()
    });
    for (i, r, took) in &results {
        assert!(r.is_err(), "file {i}: an fsync on a hung device succeeded");
        assert!(
            *took < Duration::from_secs(10),
            "file {i}: its fsync waited {took:?} for a device given up after 0.3 s"
        );
    }
    match fs.engine().read_only_cause() {
        Some(ReadOnlyCause::DeviceError { error }) => {
            assert!(error.contains("io_timeout"), "cause: {error}")
        }
        other => panic!("not read-only for the hang: {other:?}"),
    }
    assert!(timed.given_up().is_some());
    // Served with no device I/O: attributes, names, cached data.
    fs.getattr(inos[0]).expect("getattr after the give-up");
    assert_eq!(fs.resolve("/kept").expect("lookup"), inos[0]);
    // The core keeps no data cache (the kernel's page cache does, through a mount): a read
    // that needs the device answers EIO, never other bytes.
    match fs.read(inos[0], 0, BS) {
        Ok(bytes) => assert_eq!(bytes, cached, "a read after the give-up"),
        Err(e) => assert_eq!(e.errno(), libc::EIO, "{e}"),
    }
    let err = fs.write_file("/new", b"x").expect_err("a change");
    assert_eq!(err.errno(), libc::EROFS, "{err}");
    // The device answers again, too late: the power goes.
    fault.release_hangs();
    fault.clear();
    let crashed = Arc::new(mem.crash());
    drop(fs);
    let fs = mount(crashed.clone()).expect("reopen");
    let kept = fs.resolve("/kept").expect("kept");
    assert_eq!(
        version_of(&fs.read(kept, 0, BS).expect("read"), 0, 0),
        Some(1),
        "the fsync acknowledged before the hang"
    );
    fs.close().expect("close");
    let report = check(&*crashed, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{:#?}", report.findings);
}

/// The device's error counts outlive the mount (`COMPAT_DEVICE_STATS`, as `btrfs device
/// stats`): read errors and a checksum failure counted in one mount are in the superblock
/// its commits write, and the next mount starts from them and adds its own.
#[test]
fn device_error_counts_are_kept_across_mounts() {
    let mem = Arc::new(MemDevice::new(32 << 20));
    Filesystem::mkfs(mem.clone(), &MkfsOptions::default()).expect("mkfs");
    let fault = Arc::new(FaultDevice::new(mem.clone(), 7));
    let fs = mount(fault.clone()).expect("mount");
    fs.write_file("/f", b"").expect("create");
    let ino = fs.resolve("/f").expect("resolve");
    fs.write(ino, 0, &stamp(0, 0, 1), false).expect("write");
    fs.sync().expect("commit");
    assert_eq!(
        fs.engine().device_stats(),
        Default::default(),
        "nothing yet"
    );
    fault.add(Rule::always(Op::Read, Effect::Eio).times(2));
    assert!(fs.read(ino, 0, BS).is_err(), "an injected read error");
    assert!(fs.read(ino, 0, BS).is_err(), "and another");
    fault.clear();
    let stats = fs.engine().device_stats();
    assert_eq!(
        (stats.read_errors, stats.checksum_errors),
        (2, 0),
        "{stats:?}"
    );
    let (listed, _) = fs.files_with_errors();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].paths, vec!["/f".to_string()]);
    assert_eq!(
        (listed[0].errors.read_errors, listed[0].errors.first_offset),
        (2, Some(0))
    );
    // A file under a directory, by its full path; and the cap on the text.
    let d = fs
        .mkdir(Caller::default(), ROOT_INO, b"d", 0o755)
        .expect("mkdir")
        .ino;
    fs.mkdir(Caller::default(), d, b"e", 0o755).expect("mkdir");
    fs.write_file("/d/e/g", b"").expect("create");
    let g = fs.resolve("/d/e/g").expect("resolve");
    fs.write(g, 0, &stamp(1, 0, 1), false).expect("write");
    fs.sync().expect("commit");
    fault.add(Rule::always(Op::Read, Effect::Eio).times(1));
    assert!(fs.read(g, 0, BS).is_err(), "an injected read error");
    fault.clear();
    let (listed, _) = fs.files_with_errors();
    assert_eq!(
        listed.iter().map(|f| f.paths.clone()).collect::<Vec<_>>(),
        vec![vec!["/f".to_string()], vec!["/d/e/g".to_string()]]
    );
    assert!(fs.files_with_errors_json(300).contains("\"not_listed\": 1"));
    fs.write_file("/g", b"x").expect("a change to commit");
    fs.close().expect("close");
    drop(fs);
    // Damage the file's block on the image: the next mount's read fails its checksum.
    let fs = mount(mem.clone()).expect("remount");
    let stats = fs.engine().device_stats();
    assert_eq!(stats.read_errors, 3, "kept across the remount: {stats:?}");
    let image = mem.snapshot();
    let want = stamp(0, 0, 1);
    let addr = (0..image.len() / BS)
        .map(|b| b * BS)
        .find(|at| image[*at..*at + BS] == want[..])
        .expect("the file's block on the image") as u64;
    assert!(
        fs.files_with_errors().0.is_empty(),
        "the list is the mount's"
    );
    mem.corrupt(addr + 100, &[0xde, 0xad]);
    assert!(fs.read(ino, 0, BS).is_err(), "a checksum failure");
    let json = fs.files_with_errors_json(60_000);
    assert!(
        json.contains("\"paths\": [\"/f\"]") && json.contains("\"checksum_errors\": 1"),
        "{json}"
    );
    let stats = fs.engine().device_stats();
    assert_eq!(
        (stats.read_errors, stats.checksum_errors),
        (3, 1),
        "{stats:?}"
    );
    assert!(fs.stats_json().contains("\"lifetime_checksum_errors\": 1"));
    fs.write_file("/h", b"y").expect("a change to commit");
    fs.close().expect("close");
    drop(fs);
    let fs = mount(mem.clone()).expect("third mount");
    let stats = fs.engine().device_stats();
    assert_eq!(
        (stats.read_errors, stats.checksum_errors),
        (3, 1),
        "both kinds kept: {stats:?}"
    );
    // `birch errors --clear`: a read error listed, then cleared; the zeros are in the
    // superblock the clear's commit writes (no other change), and only new errors count.
    assert!(fs.read(ino, 0, BS).is_err(), "still damaged");
    assert_eq!(fs.files_with_errors().0.len(), 1);
    fs.control(b"errors-clear").expect("clear");
    assert!(fs.files_with_errors().0.is_empty(), "list cleared");
    assert_eq!(fs.engine().device_stats(), Default::default());
    assert!(fs.read(ino, 0, BS).is_err(), "a new checksum failure");
    assert_eq!(
        fs.engine().device_stats().checksum_errors,
        1,
        "counted anew"
    );
    fs.control(b"errors-clear").expect("clear again");
    fs.close().expect("close");
    drop(fs);
    let fs = mount(mem.clone()).expect("fourth mount");
    assert_eq!(
        fs.engine().device_stats(),
        Default::default(),
        "the clear is durable"
    );
    fs.close().expect("close");
}
