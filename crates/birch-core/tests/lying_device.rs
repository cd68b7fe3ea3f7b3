//! A device that lies: writes acknowledged and never stored (lost), stored somewhere else
//! (misdirected), and flushes acknowledged without flushing (a volatile cache that lies), from
//! the test kit's [`FaultDevice`]. No single-copy filesystem keeps acknowledged data through
//! these; what birchfs promises (issue 41, SEMANTICS §2) is that it never serves a wrong byte:
//! a read returns a version of that block that was written, or EIO (every data block and node
//! is checked against its checksum, every node against the generation its parent expects);
//! that scrub names every file a damaged block belongs to; that fsck exits non-zero when
//! anything was hit; and that the image then opens (on what it holds) or refuses with an
//! error, never a panic.
//!
//! Each case writes four files of stamped blocks, commits, arms one lie, goes on writing,
//! fsyncing and committing, and checks every block through the running filesystem; then it
//! checks the image the power cut leaves (for lying flushes: several images, each keeping a
//! random subset of the writes since the last true flush, in order, as a reordering cache may)
//! by opening it, reading every block, scrubbing it and running fsck.

#![allow(clippy::expect_used)]

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use birch_core::check::{check, CheckOptions};
use birch_core::device::{BlockDevice, MemDevice, Recorded};
use birch_core::repair::{repair, RepairMode};
use birch_core::scrub::{scrub, ImageViews, ScrubOptions, ScrubProgress};
use birch_core::vfs::OpenOptions;
use birch_core::{Error, Filesystem, MkfsOptions};
use birch_format::InodeNo;
use birch_testkit::stamp::{file_of, stamp, version_of, STAMP_BYTES as BS};
use birch_testkit::{Effect, FaultDevice, Op, Rng, Rule};

const MAGIC: u64 = 0x11e5_b10c_0000_0041;
const FILES: u64 = 4;
const BLOCKS: u64 = 16;
const STEPS: usize = 80;
/// The file whose data writes the lost and misdirected rules hit.
const VICTIM: u64 = 0;

fn victim_write(bytes: &[u8]) -> bool {
    bytes
        .chunks(BS)
        .any(|block| file_of(block, MAGIC) == Some(VICTIM))
}

fn open(dev: Arc<dyn BlockDevice>) -> Result<Filesystem, Error> {
    Filesystem::open_device(
        dev,
        OpenOptions {
            commit_interval: None,
            ..Default::default()
        },
    )
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Lie {
    Lost,
    Misdirected,
    LyingFlush,
}

/// What the checks saw, summed over cases.
#[derive(Default, Debug)]
struct Tally {
    cases: u64,
    injected: u64,
    reads_checked: u64,
    reads_eio: u64,
    wrong_bytes: u64,
    images: u64,
    images_refused: u64,
    images_damaged: u64,
    fsck_nonzero: u64,
    files_hit: u64,
    files_named_by_scrub: u64,
    repaired: u64,
    repaired_clean: u64,
    repair_fell_back: u64,
    repair_refused: u64,
}

/// Every version ever written to each block: a read may return any of them (a lie may
/// bring back an older one only if it is whole and its checksum matches, which a stale
/// block never does; that is what the reads check), or fail.
type Written = HashMap<(u64, u64), BTreeSet<u64>>;

/// Reads every block of every file through `fs`; returns the inodes that answered EIO.
/// A read that returns bytes that are not a version written to that block is a wrong byte.
fn read_all(fs: &Filesystem, inos: &[InodeNo], written: &Written, t: &mut Tally) -> BTreeSet<u64> {
    let mut hit = BTreeSet::new();
    for (f, ino) in inos.iter().enumerate() {
        let f = f as u64;
        for b in 0..BLOCKS {
            t.reads_checked += 1;
            match fs.read(*ino, b * BS as u64, BS) {
                Ok(bytes) => {
                    let ok = bytes.len() == BS
                        && version_of(&bytes, MAGIC, f, b).is_some_and(|v| {
                            written.get(&(f, b)).is_some_and(|set| set.contains(&v))
                        });
                    if !ok {
                        t.wrong_bytes += 1;
                        eprintln!(
                            "WRONG BYTES: file {f} block {b}: {:02x?}",
                            &bytes[..32.min(bytes.len())]
                        );
                    }
                }
                Err(e) => {
                    assert_eq!(e.errno(), libc::EIO, "file {f} block {b}: {e}");
                    t.reads_eio += 1;
                    hit.insert(ino.get());
                }
            }
        }
    }
    hit
}

/// Opens, reads, scrubs and checks one image a power cut left.
fn check_image(bytes: Vec<u8>, inos: &[InodeNo], written: &Written, t: &mut Tally, what: &str) {
    t.images += 1;
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::from_bytes(bytes.clone()));
    let hit = match open(dev.clone()) {
        Err(e) => {
            // Refused: with an error, not a panic. fsck must not call it clean.
            t.images_refused += 1;
            eprintln!("{what}: the image refuses to open: {e}");
            BTreeSet::new()
        }
        Ok(fs) => {
            let hit = read_all(&fs, inos, written, t);
            drop(fs); // no close: nothing of this check may reach the image
            hit
        }
    };
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::from_bytes(bytes));
    let named: BTreeSet<u64> = match ImageViews::open(dev.clone()) {
        Ok(views) => match scrub(&views, ScrubOptions::default(), &ScrubProgress::default()) {
            Ok(report) => report
                .damage
                .iter()
                .flat_map(|d| d.owners.iter().map(|o| o.inode))
                .collect(),
            Err(e) => {
                eprintln!("{what}: scrub stopped: {e}");
                BTreeSet::new()
            }
        },
        Err(e) => {
            eprintln!("{what}: scrub cannot open the image: {e}");
            BTreeSet::new()
        }
    };
    let fsck_clean = match check(&*dev, CheckOptions { data: true }) {
        Ok(report) => report.is_clean(),
        Err(_) => false,
    };
    if !fsck_clean {
        t.fsck_nonzero += 1;
    }
    if !hit.is_empty() {
        t.images_damaged += 1;
        t.files_hit += hit.len() as u64;
        t.files_named_by_scrub += hit.intersection(&named).count() as u64;
        assert!(
            !fsck_clean,
            "{what}: files {hit:?} answer EIO but fsck calls the image clean"
        );
        // Scrub names every file a damaged block belongs to, unless the tree itself is too
        // damaged to walk (then fsck says so, checked above).
        let missing: Vec<_> = hit.difference(&named).collect();
        assert!(
            named.is_empty() || missing.is_empty(),
            "{what}: files {missing:?} answer EIO and scrub names only {named:?}"
        );
    }
    if fsck_clean {
        return;
    }
    // `birch fsck --repair`: the image must come back to one that opens and checks clean
    // (an older tree, or damaged extents dropped and named), serving only versions written
    // or holes where repair dropped a block.
    let report = repair(dev.clone(), RepairMode::Full, CheckOptions { data: true })
        .unwrap_or_else(|e| panic!("{what}: repair failed outright: {e}"));
    t.repaired += 1;
    if report.fell_back_to.is_some() {
        t.repair_fell_back += 1;
    }
    if report.after.as_ref().is_some_and(|a| a.is_clean()) {
        t.repaired_clean += 1;
    }
    if !report.refused.is_empty() {
        // Nothing whole to go back to (every backup root was written after the last true
        // flush): repair says so (exit 4) and leaves the image as it was.
        assert_eq!(report.exit_code(), 4, "{what}: {:?}", report.refused);
        t.repair_refused += 1;
        return;
    }
    let fs = open(dev.clone()).unwrap_or_else(|e| {
        panic!(
            "{what}: the repaired image refuses to open: {e}\nrepair: exit {}, fell back to \
             {:?}, salvaged {}, actions {:?}, refused {:?}, after {:?}",
            report.exit_code(),
            report.fell_back_to,
            report.salvaged,
            report.actions,
            report.refused,
            report.after.as_ref().map(|a| &a.findings)
        )
    });
    for (f, ino) in inos.iter().enumerate() {
        let f = f as u64;
        for b in 0..BLOCKS {
            // A file repair could not keep is gone (named in its report): nothing to read.
            let Ok(bytes) = fs.read(*ino, b * BS as u64, BS) else {
                continue;
            };
            let ok = bytes.len() < BS
                || version_of(&bytes, MAGIC, f, b).is_some_and(|v| {
                    v == 0 || written.get(&(f, b)).is_some_and(|set| set.contains(&v))
                });
            if !ok {
                t.wrong_bytes += 1;
                eprintln!("WRONG BYTES after repair: {what}: file {f} block {b}");
            }
        }
    }
    drop(fs);
}

fn run_case(seed: u64, lie: Lie, t: &mut Tally) {
    let what = format!("seed {seed} {lie:?}");
    let mut rng = Rng::new(seed);
    let mem = Arc::new(MemDevice::new(32 << 20));
    Filesystem::mkfs(mem.clone(), &MkfsOptions::default()).expect("mkfs");
    let fault = Arc::new(FaultDevice::new(mem.clone(), seed));
    let fs = open(fault.clone()).expect("mount");
    let mut inos = Vec::new();
    let mut written: Written = HashMap::new();
    for f in 0..FILES {
        let name = format!("/f{f}");
        fs.write_file(&name, b"").expect("create");
        let ino = fs.resolve(&name).expect("resolve");
        for b in 0..BLOCKS {
            fs.write(ino, b * BS as u64, &stamp(MAGIC, f, b, 1), false)
                .expect("first version");
            written.entry((f, b)).or_default().insert(1);
        }
        inos.push(ino);
    }
    fs.sync().expect("commit");
    let base = mem.crash().snapshot();
    mem.start_recording();
    let rule = match lie {
        Lie::Lost => Rule::always(Op::Write, Effect::Lose)
            .matching(victim_write)
            .after(rng.below(3))
            .times(1 + rng.below(3)),
        Lie::Misdirected => Rule::always(
            Op::Write,
            Effect::Misdirect {
                delta: BS as u64 * (1 + rng.below(256)),
            },
        )
        .matching(victim_write)
        .after(rng.below(3))
        .times(1 + rng.below(2)),
        Lie::LyingFlush => Rule::always(Op::Flush, Effect::Lie).after(rng.below(3)),
    };
    fault.add(rule);
    let mut version = 1;
    for _ in 0..STEPS {
        version += 1;
        let f = rng.below(FILES);
        let b = rng.below(BLOCKS);
        let ino = inos[f as usize];
        match fs.write(ino, b * BS as u64, &stamp(MAGIC, f, b, version), false) {
            Ok(_) => {
                written.entry((f, b)).or_default().insert(version);
            }
            Err(e) => {
                // The block may hold the new version or not: both are versions written.
                written.entry((f, b)).or_default().insert(version);
                assert!(
                    matches!(e.errno(), libc::EIO | libc::EROFS),
                    "{what}: write: {e}"
                );
            }
        }
        match rng.below(10) {
            0..=2 => {
                let _ = fs.fsync(ino, false);
            }
            3 => {
                let _ = fs.sync();
            }
            _ => {}
        }
    }
    let _ = fs.sync();
    t.injected += fault.stats.total();
    // The running filesystem first: what it serves.
    // (A lost or misdirected write may carry other files' blocks too: the daemon writes a
    // run of blocks contiguous on disk as one write, whichever files they belong to.)
    read_all(&fs, &inos, &written, t);
    fs.power_cut();
    match lie {
        Lie::Lost | Lie::Misdirected => {
            check_image(mem.crash().snapshot(), &inos, &written, t, &what);
        }
        Lie::LyingFlush => {
            // What a lying cache may have kept: any subset of the writes since the last true
            // flush (the lie began after it), applied in order.
            let writes: Vec<(u64, Arc<[u8]>)> = mem
                .take_recording()
                .into_iter()
                .filter_map(|r| match r {
                    Recorded::Write { offset, bytes } => Some((offset, bytes)),
                    Recorded::Flush => None,
                })
                .collect();
            for state in 0..3 {
                let mut image = base.clone();
                let keep = rng.below(101);
                for (offset, bytes) in &writes {
                    if rng.below(100) < keep {
                        let at = *offset as usize;
                        image[at..at + bytes.len()].copy_from_slice(bytes);
                    }
                }
                check_image(
                    image,
                    &inos,
                    &written,
                    t,
                    &format!("{what} state {state} keep {keep}%"),
                );
            }
        }
    }
    t.cases += 1;
}

#[test]
fn a_lying_device_never_makes_birch_serve_a_wrong_byte() {
    let mut by_lie: Vec<(Lie, Tally)> = Vec::new();
    for lie in [Lie::Lost, Lie::Misdirected, Lie::LyingFlush] {
        let mut t = Tally::default();
        for seed in 0..6u64 {
            run_case(0x41_0000 + seed, lie, &mut t);
        }
        eprintln!(
            "lying device: {lie:?}: {} cases, {} injected; reads checked {} (EIO {}), wrong \
             bytes {}; images {} (refused {}, damaged {}), fsck non-zero {}; files hit {}, \
             named by scrub {}; repaired {} (clean after {}, fell back to an older tree {}, \
             refused {})",
            t.cases,
            t.injected,
            t.reads_checked,
            t.reads_eio,
            t.wrong_bytes,
            t.images,
            t.images_refused,
            t.images_damaged,
            t.fsck_nonzero,
            t.files_hit,
            t.files_named_by_scrub,
            t.repaired,
            t.repaired_clean,
            t.repair_fell_back,
            t.repair_refused
        );
        by_lie.push((lie, t));
    }
    for (lie, t) in &by_lie {
        assert_eq!(t.wrong_bytes, 0, "{lie:?}: wrong bytes served");
        assert!(
            t.injected > 0,
            "{lie:?}: nothing injected: the test checked nothing"
        );
    }
    // The lies must have hit something a read could see, or the checks above saw nothing.
    let eio: u64 = by_lie.iter().map(|(_, t)| t.reads_eio).sum();
    assert!(eio > 0, "no read ever met a lie's damage");
}
