//! The crash matrix: workloads on a recording device, replayed to every crash state.
//!
//! Owns: the workloads (the btrfs fsync bug classes and ACE-style bounded sequences) and the
//! run of one workload on a recording `MemDevice` that hands its recording to the oracle
//! ([`check_recording`]). Must not touch: production paths; it only drives the public API of
//! `birch-core`, so `birch crashtest` and the tests share it.

use std::sync::Arc;

use birch_core::device::{MemDevice, Recorded};
use birch_core::vfs::{Caller, OpenOptions, SetAttr, ShutdownMode};
use birch_core::{Engine, Error, Filesystem, MkfsOptions, Result};
use birch_format::ROOT_INO;

use crate::oracle::{check_recording, CrashReport, History, RolledBack};
use crate::rng::Rng;
use crate::stamp::fill;

/// The workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// Append then fsync, six times.
    Append,
    /// A WAL: block-aligned appends, each fsync'd or fdatasync'd, to a log-clean file, which
    /// logs them with their bytes (data records, DESIGN §11.1), with a commit in the middle
    /// that writes the placed blocks in place, and an overwrite.
    Wal,
    /// Link then fsync; rename then fsync; rewrite then fsync; a committed file renamed
    /// away and a new one fsync'd under its name (dbench's pattern).
    LinkRename,
    /// Punch hole, fallocate KEEP_SIZE, truncate then grow, each with fsync.
    Holes,
    /// Many files, some fsync'd, a commit in the middle; symlink and xattr changes.
    Many,
    /// Hundreds of small files in two directories (a tree of many leaves), some with xattrs,
    /// some fsync'd, some removed, a commit every 150 files; commits take the parallel apply.
    Tree,
    /// ACE-style: 1-3 operations over A/foo, A/bar, B/foo, B/bar, A/C, each followed by fsync,
    /// fdatasync or a commit, chosen by the seed.
    Ace,
    /// Files written, some fsync'd, some committed, then a shutdown mid-way (commit-then-stop,
    /// log-then-stop or now, by the seed: `seed % 3`); every operation after it must fail
    /// and write nothing. What the shutdown's variant promises is judged like an fsync.
    Shutdown,
    /// Snapshots beside fsyncs: whole and partial overwrites (blocks a snapshot shares are
    /// copied), clones of one file into another (`copy_file_range`), unlinks, fsyncs,
    /// commits, snapshot creations and deletions, chosen by the seed;
    /// every snapshot that exists after a crash must hold exactly what it was made with.
    Snapshots,
    /// Shared extents (DESIGN §15.8): a file cloned by `copy_file_range` into another and
    /// fsync'd (a commit), the source deleted and committed, the clone overwritten in part
    /// and fsync'd (logged pieces of a shared extent), a clone within the file fsync'd, and a
    /// clone of the clone over a committed file fsync'd.
    Clone,
    /// Rollbacks (DESIGN §15.8) among the snapshot steps: twice, the filesystem is closed
    /// cleanly or left with a pending fsync log (one of each per run), the engine alone must
    /// refuse while the log waits, the log is replayed by an open and close, then
    /// `Engine::rollback` on the closed image rolls back to a snapshot the seed picks (refused
    /// while newer snapshots exist, then with `-r`, which deletes them), and the reopened
    /// filesystem goes on with more steps. A crash state shows the whole state before a
    /// rollback or the whole rolled-back one, never a mix.
    Rollback,
    /// Blob extents (DESIGN §16): a file fsync'd, rewritten compressed
    /// (`Filesystem::compress_file`) and fsync'd (its bytes never change), then a punch in the
    /// middle of a blob, a partial overwrite inside one, a clone of a blob window into another
    /// file and a truncate into a blob, each fsync'd. Every crash state reads each file as one
    /// of its versions: never a window of the wrong blob or at the wrong place.
    Blobs,
}

impl Workload {
    /// Every workload, in the order `birch crashtest` runs them.
    pub const ALL: [Workload; 12] = [
        Workload::Append,
        Workload::Wal,
        Workload::LinkRename,
        Workload::Holes,
        Workload::Many,
        Workload::Tree,
        Workload::Ace,
        Workload::Shutdown,
        Workload::Snapshots,
        Workload::Clone,
        Workload::Rollback,
        Workload::Blobs,
    ];

    /// The workload's display name, as reports and the command line use it.
    pub fn name(self) -> &'static str {
        match self {
            Workload::Append => "append+fsync",
            Workload::Wal => "wal appends+fsync",
            Workload::LinkRename => "link/rename+fsync",
            Workload::Holes => "punch/fallocate/truncate+fsync",
            Workload::Many => "many files+symlink+xattr",
            Workload::Tree => "big tree+commits",
            Workload::Ace => "ace",
            Workload::Shutdown => "shutdown",
            Workload::Snapshots => "snapshots+fsync",
            Workload::Clone => "clone+fsync",
            Workload::Rollback => "snapshots+rollback",
            Workload::Blobs => "blobs+fsync",
        }
    }

    /// The workload called `name`: its display name or its variant name (any case);
    /// `None` if there is none.
    pub fn parse(name: &str) -> Option<Workload> {
        Workload::ALL
            .into_iter()
            .find(|w| w.name() == name || format!("{w:?}").eq_ignore_ascii_case(name))
    }
}

struct Recorder<'a> {
    dev: &'a MemDevice,
    events: Vec<Recorded>,
}

impl Recorder<'_> {
    fn mark(&mut self) -> usize {
        self.events.extend(self.dev.take_recording());
        self.events.len()
    }
}

fn write_version(fs: &Filesystem, h: &mut History, path: &str, content: Vec<u8>) -> Result<()> {
    fs.write_file(path, &content)?;
    h.version(path, content);
    Ok(())
}

fn sync_path(
    fs: &Filesystem,
    rec: &mut Recorder<'_>,
    h: &mut History,
    path: &str,
    data_only: bool,
) -> Result<()> {
    let ino = fs.resolve(path)?;
    fs.fsync(ino, data_only)?;
    let mark = rec.mark();
    h.synced(mark, path);
    Ok(())
}

fn run_workload(
    w: Workload,
    seed: u64,
    fs: &Filesystem,
    rec: &mut Recorder<'_>,
    h: &mut History,
) -> Result<()> {
    let c = Caller::default();
    match w {
        Workload::Append => {
            let mut content = Vec::new();
            for i in 0..6u64 {
                let at = content.len() as u64;
                content.extend(fill(0, at, i + 1, 3000 + i as usize * 1500));
                write_version(fs, h, "/A/log", content.clone())?;
                sync_path(fs, rec, h, "/A/log", i % 2 == 1)?;
            }
        }
        Workload::Wal => {
            let path = "/A/wal";
            let mut content = fill(0, 0, 1, 8192);
            write_version(fs, h, path, content.clone())?;
            sync_path(fs, rec, h, path, false)?;
            let ino = fs.resolve(path)?;
            let append = |fs: &Filesystem,
                          rec: &mut Recorder<'_>,
                          h: &mut History,
                          content: &mut Vec<u8>,
                          n: u8,
                          blocks: usize|
             -> Result<()> {
                let at = content.len() as u64;
                let bytes = fill(0, at, u64::from(n), blocks * 4096);
                fs.write(ino, at, &bytes, false)?;
                content.extend_from_slice(&bytes);
                h.version(path, content.clone());
                sync_path(fs, rec, h, path, n % 2 == 0)
            };
            // The first append of a log-clean file asks for the incompat flag; the commit
            // sets it, so the appends after it may log their bytes.
            append(fs, rec, h, &mut content, 2, 1)?;
            fs.sync()?;
            for n in 3..9u8 {
                append(fs, rec, h, &mut content, n, 1 + usize::from(n % 3))?;
            }
            fs.sync()?;
            for n in 9..12u8 {
                append(fs, rec, h, &mut content, n, 1)?;
            }
            // An overwrite inside the file (in place), then more appends.
            let page = fill(0, 4096, 12, 4096);
            fs.write(ino, 4096, &page, false)?;
            content[4096..8192].copy_from_slice(&page);
            h.version(path, content.clone());
            sync_path(fs, rec, h, path, false)?;
            for n in 13..16u8 {
                append(fs, rec, h, &mut content, n, 2)?;
            }
            // The workload is only worth its crash states while the appends do take the
            // data-record path: say so loudly if a change stops them.
            let data_records = fs.engine().counters().values().log_data_records;
            if data_records < 8 {
                return Err(Error::Invalid(format!(
                    "wal workload: {data_records} data records logged, expected at least 8"
                )));
            }
        }
        Workload::LinkRename => {
            write_version(fs, h, "/A/foo", b"foo v1".to_vec())?;
            sync_path(fs, rec, h, "/A/foo", false)?;
            let ino = fs.resolve("/A/foo")?;
            let b = fs.resolve("/B")?;
            fs.link(ino, b, b"bar")?;
            fs.fsync(ino, false)?;
            fs.rename(b, b"bar", b, b"baz", 0)?;
            fs.fsync(ino, false)?;
            write_version(fs, h, "/A/foo", b"foo v2, longer than before".to_vec())?;
            sync_path(fs, rec, h, "/A/foo", false)?;
            // dbench's pattern: a committed file renamed away, in its directory and then to
            // another, and a new file written under its old name and fsync'd (the rename is
            // logged with the new file, DESIGN §11.3).
            fs.sync()?;
            let a = fs.resolve("/A")?;
            fs.rename(a, b"foo", a, b"saved", 0)?;
            h.renamed("/A/foo", "/A/saved");
            write_version(fs, h, "/A/foo", b"foo v3, a new file".to_vec())?;
            sync_path(fs, rec, h, "/A/foo", false)?;
            fs.sync()?;
            fs.rename(a, b"foo", b, b"old", 0)?;
            h.renamed("/A/foo", "/B/old");
            write_version(fs, h, "/A/foo", b"foo v4".to_vec())?;
            sync_path(fs, rec, h, "/A/foo", true)?;
        }
        Workload::Clone => {
            let clone = |from: &str, at: u64, to: &str, to_at: u64, len: u64| -> Result<u64> {
                fs.copy_file_range(fs.resolve(from)?, at, fs.resolve(to)?, to_at, len)
            };
            let src = fill(1, 0, 1, 200_000);
            write_version(fs, h, "/A/src", src.clone())?;
            sync_path(fs, rec, h, "/A/src", false)?;
            write_version(fs, h, "/B/dst", Vec::new())?;
            clone("/A/src", 0, "/B/dst", 0, src.len() as u64)?;
            let mut dst = src.clone();
            h.version("/B/dst", dst.clone());
            sync_path(fs, rec, h, "/B/dst", false)?;
            let a = fs.resolve("/A")?;
            fs.unlink(a, b"src")?;
            h.removed("/A/src");
            fs.sync()?;
            let ino = fs.resolve("/B/dst")?;
            let page = fill(2, 4096, 2, 8192);
            fs.write(ino, 4096, &page, false)?;
            dst[4096..12288].copy_from_slice(&page);
            h.version("/B/dst", dst.clone());
            sync_path(fs, rec, h, "/B/dst", true)?;
            // Within the file: blocks 2..6 to 60..64 (the file grows).
            clone("/B/dst", 8192, "/B/dst", 60 * 4096, 4 * 4096)?;
            dst.resize(64 * 4096, 0);
            dst.copy_within(8192..8192 + 4 * 4096, 60 * 4096);
            h.version("/B/dst", dst.clone());
            sync_path(fs, rec, h, "/B/dst", false)?;
            // Over a committed file, unaligned head and tail copied.
            write_version(fs, h, "/A/other", fill(3, 0, 1, 30_000))?;
            fs.sync()?;
            clone("/B/dst", 100, "/A/other", 100, 20_000)?;
            let mut other = fill(3, 0, 1, 30_000);
            other[100..20_100].copy_from_slice(&dst[100..20_100]);
            h.version("/A/other", other);
            sync_path(fs, rec, h, "/A/other", false)?;
            let clones = fs.engine().counters().values().clone_ranges;
            if clones < 3 {
                return Err(Error::Invalid(format!(
                    "clone workload: {clones} clones shared blocks, expected 3"
                )));
            }
        }
        Workload::Blobs => {
            let mut z = fill(4, 0, 1, 600_000);
            write_version(fs, h, "/A/z", z.clone())?;
            sync_path(fs, rec, h, "/A/z", false)?;
            let ino = fs.resolve("/A/z")?;
            let report = fs.compress_file(ino, birch_format::codec::Codec::Lz4)?;
            if report.compressed < 3 {
                return Err(Error::Invalid(format!(
                    "blobs workload: {report:?}, expected at least 3 chunks compressed"
                )));
            }
            sync_path(fs, rec, h, "/A/z", false)?;
            // A punch in the middle of the second blob: two windows on it.
            fs.fallocate(ino, 128 * 1024 + 8192, 8192, 3)?;
            z[128 * 1024 + 8192..128 * 1024 + 16384].fill(0);
            h.version("/A/z", z.clone());
            sync_path(fs, rec, h, "/A/z", false)?;
            // A partial overwrite inside the third blob, unaligned (logged).
            let page = fill(4, 300_077, 2, 5000);
            fs.write(ino, 300_077, &page, false)?;
            z[300_077..305_077].copy_from_slice(&page);
            h.version("/A/z", z.clone());
            sync_path(fs, rec, h, "/A/z", true)?;
            // A clone of a window of the third blob into another file (a commit).
            write_version(fs, h, "/B/w", Vec::new())?;
            fs.copy_file_range(ino, 256 * 1024, fs.resolve("/B/w")?, 0, 64 * 1024)?;
            h.version("/B/w", z[256 * 1024..320 * 1024].to_vec());
            sync_path(fs, rec, h, "/B/w", false)?;
            // A truncate into the fourth blob.
            fs.setattr(
                ino,
                &SetAttr {
                    size: Some(400_123),
                    ..Default::default()
                },
            )?;
            z.truncate(400_123);
            h.version("/A/z", z.clone());
            sync_path(fs, rec, h, "/A/z", false)?;
        }
        Workload::Holes => {
            let mut content = fill(0, 0, 1, 40_000);
            write_version(fs, h, "/B/sparse", content.clone())?;
            sync_path(fs, rec, h, "/B/sparse", false)?;
            let ino = fs.resolve("/B/sparse")?;
            fs.fallocate(ino, 8192, 16384, 3)?;
            content[8192..24576].fill(0);
            h.versions
                .entry("/B/sparse".into())
                .or_default()
                .push(content.clone());
            sync_path(fs, rec, h, "/B/sparse", false)?;
            fs.fallocate(ino, 40_000, 100_000, 1)?;
            fs.setattr(
                ino,
                &SetAttr {
                    size: Some(1000),
                    ..Default::default()
                },
            )?;
            fs.setattr(
                ino,
                &SetAttr {
                    size: Some(50_000),
                    ..Default::default()
                },
            )?;
            let mut grown = content[..1000].to_vec();
            grown.resize(50_000, 0);
            h.versions
                .entry("/B/sparse".into())
                .or_default()
                .push(grown);
            sync_path(fs, rec, h, "/B/sparse", true)?;
        }
        Workload::Tree => {
            let mut rng = Rng::new(seed);
            let mut live: Vec<String> = Vec::new();
            for i in 0..600usize {
                let path = format!("{}/t{i:04}", if i % 2 == 0 { "/A" } else { "/B" });
                let len = 100 + rng.below(700) as usize;
                write_version(fs, h, &path, fill(i as u64, 0, 1, len))?;
                if i % 4 == 0 {
                    fs.setxattr(fs.resolve(&path)?, b"user.tag", &[i as u8; 40], 0)?;
                }
                if rng.chance(8) {
                    sync_path(fs, rec, h, &path, false)?;
                }
                live.push(path);
                if i % 150 == 149 {
                    for _ in 0..10 {
                        let doomed = live.swap_remove(rng.below(live.len() as u64) as usize);
                        let (dir, name) = doomed.rsplit_once('/').unwrap_or(("/", &doomed));
                        fs.unlink(fs.resolve(dir)?, name.as_bytes())?;
                        h.removed(&doomed);
                    }
                    fs.sync()?;
                    // Nothing new to log: these marks make the oracle read the files from the
                    // committed tree in every later crash state.
                    for _ in 0..5 {
                        let path = live[rng.below(live.len() as u64) as usize].clone();
                        sync_path(fs, rec, h, &path, false)?;
                    }
                }
            }
        }
        Workload::Many => {
            for i in 0..12 {
                let path = format!("/A/f{i}");
                write_version(fs, h, &path, fill(i as u64, 0, 1, 500 + i * 900))?;
                if i % 3 == 0 {
                    sync_path(fs, rec, h, &path, false)?;
                }
                if i == 7 {
                    fs.sync()?;
                }
            }
            let a = fs.resolve("/A")?;
            fs.symlink(c, a, b"link", b"f0")?;
            let f1 = fs.resolve("/A/f1")?;
            fs.setxattr(f1, b"user.k", b"v", 0)?;
            fs.fsync(f1, false)?;
            fs.removexattr(f1, b"user.k")?;
            fs.fsync(f1, false)?;
            // Logged, changed and committed, changed back, fsync'd again: the second fsync
            // must not trust that the first one's record still counts (the commit covered it).
            write_version(fs, h, "/A/flip", b"one".to_vec())?;
            sync_path(fs, rec, h, "/A/flip", false)?;
            write_version(fs, h, "/A/flip", b"two".to_vec())?;
            fs.sync()?;
            write_version(fs, h, "/A/flip", b"one".to_vec())?;
            sync_path(fs, rec, h, "/A/flip", false)?;
        }
        Workload::Shutdown => {
            let mode =
                [ShutdownMode::Commit, ShutdownMode::Log, ShutdownMode::Now][(seed % 3) as usize];
            let mut rng = Rng::new(seed ^ 0x5D);
            let paths = ["/A/f0", "/A/f1", "/B/f2", "/B/f3", "/A/f4"];
            let mut written = Vec::new();
            for (i, path) in paths.iter().enumerate() {
                let len = 1 + rng.below(40_000) as usize;
                write_version(fs, h, path, fill(i as u64, 0, 1, len))?;
                written.push(*path);
                match rng.below(4) {
                    0 => sync_path(fs, rec, h, path, false)?,
                    1 => {
                        fs.sync()?;
                        let mark = rec.mark();
                        for p in &written {
                            h.synced(mark, p);
                        }
                    }
                    _ => {}
                }
                if rng.chance(40) {
                    // A later version, not made durable by anything but the shutdown.
                    write_version(
                        fs,
                        h,
                        path,
                        fill(i as u64, 0, 2, 1 + rng.below(9000) as usize),
                    )?;
                }
            }
            fs.shutdown(mode)?;
            let mark = rec.mark();
            if mode == ShutdownMode::Commit {
                for p in &written {
                    h.synced(mark, p);
                }
            }
            // Every operation after it fails, and nothing reaches the device.
            let after = [
                ("write", fs.write_file(paths[1], &[0xEE; 5000]).err()),
                ("resolve", fs.resolve(paths[0]).err()),
                ("sync", fs.sync().err()),
                ("mkdir", fs.mkdir(c, ROOT_INO, b"late", 0o755).err()),
            ];
            for (what, err) in after {
                if err.is_none_or(|e| e.errno() != libc::EIO) {
                    return Err(Error::Invalid(format!(
                        "{what} after a shutdown ({mode:?}) did not fail with EIO"
                    )));
                }
            }
            if rec.mark() != mark {
                return Err(Error::Invalid(format!(
                    "device I/O after a shutdown ({mode:?})"
                )));
            }
        }
        Workload::Snapshots => snapshot_steps(seed, fs, rec, h)?,
        Workload::Rollback => {
            return Err(Error::Invalid(
                "the rollback workload closes and reopens its filesystem: run_matrix runs it \
                 through rollback_steps"
                    .into(),
            ))
        }
        Workload::Ace => {
            let mut rng = Rng::new(seed ^ 0xACE);
            let paths = ["/A/foo", "/A/bar", "/B/foo", "/B/bar", "/A/C/foo"];
            fs.mkdir(c, fs.resolve("/A")?, b"C", 0o755)?;
            let trace = std::env::var_os("BIRCH_CRASH_TRACE").is_some();
            for step in 0..(1 + rng.below(3)) {
                let file = rng.below(paths.len() as u64);
                let path = paths[file as usize];
                if trace {
                    eprintln!("ace step {step}: {path}");
                }
                match rng.below(5) {
                    0 | 1 => {
                        let len = 1 + rng.below(9000) as usize;
                        if trace {
                            eprintln!("  write {len} bytes, version {}", step + 1);
                        }
                        write_version(fs, h, path, fill(file, 0, step + 1, len))?;
                    }
                    2 => {
                        // link to another name, when the source exists and the target does not
                        let other = paths[rng.below(paths.len() as u64) as usize];
                        if let (Ok(ino), Err(_)) = (fs.resolve(path), fs.resolve(other)) {
                            if trace {
                                eprintln!("  link to {other}");
                            }
                            let (dir, name) = other.rsplit_once('/').unwrap_or(("", other));
                            fs.link(ino, fs.resolve(dir)?, name.as_bytes())?;
                            h.linked(path, other);
                        }
                    }
                    3 => {
                        let other = paths[rng.below(paths.len() as u64) as usize];
                        if other != path && fs.resolve(path).is_ok() {
                            if trace {
                                eprintln!("  rename to {other}");
                            }
                            let (d1, n1) = path.rsplit_once('/').unwrap_or(("", path));
                            let (d2, n2) = other.rsplit_once('/').unwrap_or(("", other));
                            fs.rename(
                                fs.resolve(d1)?,
                                n1.as_bytes(),
                                fs.resolve(d2)?,
                                n2.as_bytes(),
                                0,
                            )?;
                            h.renamed(path, other);
                        }
                    }
                    _ => {
                        if fs.resolve(path).is_ok() {
                            if trace {
                                eprintln!("  unlink");
                            }
                            let (d, n) = path.rsplit_once('/').unwrap_or(("", path));
                            fs.unlink(fs.resolve(d)?, n.as_bytes())?;
                            h.removed(path);
                        }
                    }
                }
                let sync = rng.below(3);
                if trace {
                    eprintln!("  then {}", ["fsync", "fdatasync", "commit"][sync as usize]);
                }
                match sync {
                    0 if fs.resolve(path).is_ok() => sync_path(fs, rec, h, path, false)?,
                    1 if fs.resolve(path).is_ok() => sync_path(fs, rec, h, path, true)?,
                    _ => {
                        fs.sync()?;
                        rec.mark();
                    }
                }
            }
        }
    }
    Ok(())
}

/// The state of the snapshot steps: the seeded generator, every file of the filesystem
/// (`live`, so each snapshot's expected content is known whole), the snapshots standing
/// (oldest first) with the files each was made with, and how many were made (names are never
/// reused in one run).
struct SnapSteps {
    rng: Rng,
    live: std::collections::BTreeMap<String, Vec<u8>>,
    standing: Vec<(String, std::collections::BTreeMap<String, Vec<u8>>)>,
    made: u32,
    trace: bool,
}

/// The paths the snapshot steps write, clone and unlink.
const SNAP_PATHS: [&str; 3] = ["/A/foo", "/A/bar", "/B/foo"];

impl SnapSteps {
    fn new(seed: u64) -> SnapSteps {
        SnapSteps {
            rng: Rng::new(seed),
            live: std::collections::BTreeMap::new(),
            standing: Vec::new(),
            made: 0,
            trace: std::env::var_os("BIRCH_CRASH_TRACE").is_some(),
        }
    }

    /// Makes the next snapshot (`s0`, `s1`, ...) of `live`.
    fn snapshot(
        &mut self,
        fs: &Filesystem,
        rec: &mut Recorder<'_>,
        h: &mut History,
        step: u8,
    ) -> Result<()> {
        let name = format!("s{}", self.made);
        self.made += 1;
        if self.trace {
            eprintln!("step {step}: snapshot create {name}");
        }
        let asked = rec.mark();
        fs.create_snapshot(&name)?;
        let returned = rec.mark();
        h.snapshot_made(&name, asked, returned, self.live.clone());
        self.standing.push((name, self.live.clone()));
        Ok(())
    }

    /// One step (`choice`, 0..9) over a path the generator picks. `step` + 1 is the version
    /// of the bytes it writes ([`fill`] of the path's index in `SNAP_PATHS`), which tells them
    /// apart.
    fn step(
        &mut self,
        fs: &Filesystem,
        rec: &mut Recorder<'_>,
        h: &mut History,
        step: u8,
        choice: u64,
    ) -> Result<()> {
        let trace = self.trace;
        let rng = &mut self.rng;
        let live = &mut self.live;
        let file = rng.below(SNAP_PATHS.len() as u64);
        let path = SNAP_PATHS[file as usize];
        let version = u64::from(step) + 1;
        match choice {
            // A whole new content (the file made if missing).
            0 | 1 => {
                let len = 100 + rng.below(14_000) as usize;
                let content = fill(file, 0, version, len);
                if trace {
                    eprintln!("step {step}: write {path} ({len} bytes)");
                }
                write_version(fs, h, path, content.clone())?;
                live.insert(path.to_string(), content);
                if rng.chance(50) {
                    sync_path(fs, rec, h, path, rng.chance(30))?;
                }
            }
            // A partial overwrite inside the file: the blocks it touches are copied, the rest
            // stay shared with any snapshot that holds them.
            2 => {
                if let Some(mut content) = live.get(path).cloned() {
                    let at = rng.below(content.len() as u64) as usize;
                    let len = (1 + rng.below(6000) as usize).min(content.len() - at);
                    if trace {
                        eprintln!("step {step}: overwrite {path} at {at} ({len} bytes)");
                    }
                    let bytes = fill(file, at as u64, version, len);
                    fs.write(fs.resolve(path)?, at as u64, &bytes, false)?;
                    content[at..at + len].copy_from_slice(&bytes);
                    h.version(path, content.clone());
                    live.insert(path.to_string(), content);
                    if rng.chance(50) {
                        sync_path(fs, rec, h, path, false)?;
                    }
                }
            }
            3 => {
                if live.remove(path).is_some() {
                    if trace {
                        eprintln!("step {step}: unlink {path}");
                    }
                    let (d, n) = path.rsplit_once('/').unwrap_or(("", path));
                    fs.unlink(fs.resolve(d)?, n.as_bytes())?;
                    h.removed(path);
                }
            }
            4 | 5 => self.snapshot(fs, rec, h, step)?,
            6 => {
                if !self.standing.is_empty() {
                    let (name, _) = self
                        .standing
                        .remove(rng.below(self.standing.len() as u64) as usize);
                    if trace {
                        eprintln!("step {step}: snapshot delete {name}");
                    }
                    let asked = rec.mark();
                    fs.delete_snapshot(&name)?;
                    let returned = rec.mark();
                    h.snapshot_deleted(&name, asked, returned);
                }
            }
            // A clone: the whole of another file shared into this one (copy_file_range of
            // whole blocks; the tail copied), whose later partial overwrites unshare.
            7 => {
                let from = SNAP_PATHS[rng.below(SNAP_PATHS.len() as u64) as usize];
                if from != path {
                    if let Some(source) = live.get(from).cloned() {
                        if trace {
                            eprintln!("step {step}: clone {from} to {path}");
                        }
                        let mut content = live.get(path).cloned().unwrap_or_default();
                        if content.is_empty() {
                            write_version(fs, h, path, Vec::new())?;
                        }
                        let n = fs.copy_file_range(
                            fs.resolve(from)?,
                            0,
                            fs.resolve(path)?,
                            0,
                            source.len() as u64,
                        )?;
                        if n != source.len() as u64 {
                            return Err(Error::Invalid(format!(
                                "snapshot workload: clone of {from} copied {n} of {} bytes",
                                source.len()
                            )));
                        }
                        if content.len() < source.len() {
                            content.resize(source.len(), 0);
                        }
                        content[..source.len()].copy_from_slice(&source);
                        h.version(path, content.clone());
                        live.insert(path.to_string(), content);
                        if rng.chance(50) {
                            sync_path(fs, rec, h, path, false)?;
                        }
                    }
                }
            }
            _ => {
                if trace {
                    eprintln!("step {step}: commit");
                }
                fs.sync()?;
                rec.mark();
            }
        }
        Ok(())
    }
}

/// The snapshot workload: 16 steps over three paths (clones among them), chosen by the seed,
/// after a first file and a first snapshot.
fn snapshot_steps(
    seed: u64,
    fs: &Filesystem,
    rec: &mut Recorder<'_>,
    h: &mut History,
) -> Result<()> {
    let mut s = SnapSteps::new(seed);
    for step in 0..16u8 {
        let choice = match step {
            0 => 0,
            1 => 4,
            _ => s.rng.below(9),
        };
        s.step(fs, rec, h, step, choice)?;
    }
    Ok(())
}

/// The rollback workload: 12 snapshot steps, then two rounds of a rollback of the closed
/// image and 10 more steps on the reopened filesystem. Takes the filesystem and returns the
/// one open at the end.
fn rollback_steps(
    seed: u64,
    fs: Filesystem,
    dev: &Arc<MemDevice>,
    rec: &mut Recorder<'_>,
    h: &mut History,
) -> Result<Filesystem> {
    let mut s = SnapSteps::new(seed ^ 0x0B0C_4B4C);
    let mut fs = fs;
    for step in 0..12u8 {
        let choice = match step {
            0 => 0,
            1 => 4,
            _ => s.rng.below(9),
        };
        s.step(&fs, rec, h, step, choice)?;
    }
    for round in 0..2u8 {
        // One round of each kind per run: the filesystem closed cleanly, or left with
        // records only the fsync log holds.
        let clean = (seed + u64::from(round)) % 2 == 0;
        fs = rollback_round(seed, round, clean, fs, dev, rec, h, &mut s)?;
        let first = 20 + 20 * round;
        for step in first..first + 10 {
            let choice = s.rng.below(9);
            s.step(&fs, rec, h, step, choice)?;
        }
    }
    Ok(fs)
}

/// One rollback, as `birch rollback IMAGE NAME [-r]` makes it: the filesystem `fs` is closed
/// (`clean`) or, after a commit and fsync'd writes, cut off with its log pending; the engine
/// alone must refuse the rollback while the log waits; an open and close replays it; an
/// engine of its own rolls back to a snapshot the seed picks (first without `-r`, which must
/// be refused while newer snapshots exist, then with it). Returns the reopened filesystem.
#[allow(clippy::too_many_arguments)]
fn rollback_round(
    seed: u64,
    round: u8,
    clean: bool,
    fs: Filesystem,
    dev: &Arc<MemDevice>,
    rec: &mut Recorder<'_>,
    h: &mut History,
    s: &mut SnapSteps,
) -> Result<Filesystem> {
    let first = 20 + 20 * round;
    if s.standing.is_empty() {
        s.snapshot(&fs, rec, h, first - 1)?;
    }
    let at = s.rng.below(s.standing.len() as u64) as usize;
    let (name, after) = s.standing[at].clone();
    let newer: Vec<String> = s.standing[at + 1..]
        .iter()
        .map(|(n, _)| n.clone())
        .collect();
    if after == s.live {
        // Something for the rollback to undo.
        s.step(&fs, rec, h, first - 2, 0)?;
    }
    if s.trace {
        eprintln!(
            "round {round}: rollback to {name} ({}), newer {newer:?}",
            if clean { "closed" } else { "log pending" }
        );
    }
    if clean {
        fs.close()?;
        drop(fs);
    } else {
        // Everything committed, then whole new contents only the log holds.
        fs.sync()?;
        rec.mark();
        for step in [first - 3, first - 4] {
            let file = s.rng.below(SNAP_PATHS.len() as u64);
            let path = SNAP_PATHS[file as usize];
            let content = fill(
                file,
                0,
                u64::from(step) + 1,
                100 + s.rng.below(14_000) as usize,
            );
            if s.trace {
                eprintln!("step {step}: write {path} ({} bytes), fsync", content.len());
            }
            write_version(&fs, h, path, content.clone())?;
            s.live.insert(path.to_string(), content);
            sync_path(&fs, rec, h, path, false)?;
        }
        fs.power_cut();
    }
    let settled = rec.mark();
    let before = s.live.clone();
    if !clean {
        // `Engine::rollback` refuses while replay is pending (the CLI replays first).
        let engine = Engine::open(dev.clone())?;
        if !engine.log().replay_pending() {
            return Err(Error::Invalid(
                "rollback workload: no fsync log pending after the fsync'd writes".into(),
            ));
        }
        if engine.rollback(&name, true).is_ok() {
            return Err(Error::Invalid(format!(
                "rollback workload: the rollback to {name:?} went ahead with the log pending"
            )));
        }
        drop(engine);
        let fs = Filesystem::open_device(dev.clone(), quiet_options())?;
        fs.close()?;
        drop(fs);
    }
    let engine = Engine::open(dev.clone())?;
    if !newer.is_empty() {
        match engine.rollback(&name, false) {
            Err(Error::Exists(_)) => {}
            Ok(_) => {
                return Err(Error::Invalid(format!(
                    "rollback workload: the rollback to {name:?} without -r went ahead though \
                     {newer:?} are newer"
                )))
            }
            Err(e) => return Err(e),
        }
    }
    let destroy = !newer.is_empty() || s.rng.chance(30);
    let (generation, next_objectid) = {
        let sb = engine.superblock();
        (sb.generation, sb.next_objectid)
    };
    let asked = rec.mark();
    let (target, deleted) = engine.rollback(&name, destroy)?;
    let returned = rec.mark();
    if deleted != newer || target.name != name {
        return Err(Error::Invalid(format!(
            "rollback workload: the rollback to {name:?} rolled back to {:?} and deleted \
             {deleted:?}, not {newer:?}",
            target.name
        )));
    }
    let sb = engine.superblock();
    if sb.generation <= generation || sb.next_objectid < next_objectid {
        return Err(Error::Invalid(format!(
            "rollback workload: the rollback's commit has generation {} and next object id {}, \
             not above {generation} and at least {next_objectid} (ids are never reused)",
            sb.generation, sb.next_objectid
        )));
    }
    drop(engine);
    let fs = Filesystem::open_device(dev.clone(), quiet_options())?;
    if seed % 2 == 1 {
        fs.engine().set_parallel_apply_min(16);
    }
    let resumed = rec.mark();
    if s.trace {
        eprintln!(
            "round {round}: settled at event {settled}, asked {asked}, returned {returned}, \
             resumed {resumed}; deleted {deleted:?}"
        );
    }
    h.rolled_back(RolledBack {
        name,
        settled,
        asked,
        returned,
        resumed,
        deleted,
        before,
        after: after.clone(),
    });
    // Durable since it returned: every file holds the snapshot's content or a later one in
    // every later crash state (a commit after it must build on the rolled-back tree).
    for (path, content) in &after {
        h.version(path, content.clone());
        h.synced(returned, path);
    }
    s.standing.truncate(at + 1);
    s.live = after;
    Ok(fs)
}

/// Options for the matrix's filesystems: no background commits (the workload's own steps
/// decide every commit).
fn quiet_options() -> OpenOptions {
    OpenOptions {
        commit_interval: None,
        ..Default::default()
    }
}

/// Runs `workload` once on a recording device and checks `states` crash states (every flush
/// point first, then seeded cuts). `progress` is called after each state.
pub fn run_matrix(
    workload: Workload,
    seed: u64,
    states: usize,
    progress: &mut dyn FnMut(),
) -> Result<CrashReport> {
    let quiet = quiet_options;
    let dev = Arc::new(MemDevice::new(96 << 20));
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default())?;
    let base = {
        let fs = Filesystem::open_device(dev.clone(), quiet())?;
        fs.mkdir(Caller::default(), ROOT_INO, b"A", 0o755)?;
        fs.mkdir(Caller::default(), ROOT_INO, b"B", 0o755)?;
        fs.close()?;
        dev.snapshot()
    };
    dev.start_recording();
    let mut history = History::default();
    let events = {
        let fs = Filesystem::open_device(dev.clone(), quiet())?;
        if seed % 2 == 1 || workload == Workload::Tree {
            // Odd seeds and the tree workload commit through the parallel apply (jobs write
            // their nodes, then the committer writes the rebuilt top).
            fs.engine().set_parallel_apply_min(16);
        }
        let mut rec = Recorder {
            dev: &dev,
            events: Vec::new(),
        };
        let fs = if workload == Workload::Rollback {
            rollback_steps(seed, fs, &dev, &mut rec, &mut history)?
        } else {
            run_workload(workload, seed, &fs, &mut rec, &mut history)?;
            fs
        };
        rec.mark();
        if std::env::var_os("BIRCH_CRASH_TRACE").is_some() {
            eprintln!("counters: {}", fs.engine().counters().values());
            let kinds: Vec<String> = rec
                .events
                .iter()
                .map(|e| match e {
                    Recorded::Write { offset, bytes } => format!("W{:#x}+{}", offset, bytes.len()),
                    Recorded::Flush => "F".into(),
                })
                .collect();
            eprintln!("events: {}", kinds.join(" "));
            eprintln!("synced: {:?}", history.synced);
        }
        fs.power_cut(); // power cut: no final commit
        rec.events
    };
    Ok(check_recording(
        workload.name(),
        seed,
        &base,
        &events,
        &history,
        states,
        progress,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// /A/C/foo, commit, write a new /B/bar, fsync; a crash before the second commit shows the
    /// first content under /B/bar, which was judged as never written.
    #[test]
    fn ace_seed_with_a_name_reused_after_a_rename_passes() {
        let report = run_matrix(Workload::Ace, 1_795_610_327_756_327_763, 60, &mut || {})
            .expect("workload runs");
        assert!(report.failures.is_empty(), "{:#?}", report.failures);
    }

    /// The seed that found the oracle's bug: fsync /B/bar after linking it to /B/foo, then
    /// write through /B/foo and fsync; a crash state with the new content under /B/bar was
    /// judged as lost data.
    #[test]
    fn snapshot_workloads_pass_the_oracle() {
        for seed in 0..4 {
            let report =
                run_matrix(Workload::Snapshots, seed, 40, &mut || {}).expect("workload runs");
            assert!(report.failures.is_empty(), "{:#?}", report.failures);
            assert_eq!(report.states, 40);
        }
    }

    /// Two rollbacks per run (one after a clean close, one with the log pending), `-r` when
    /// newer snapshots exist: every crash state the whole state before a rollback or the whole
    /// rolled-back one.
    #[test]
    fn rollback_workloads_pass_the_oracle() {
        for seed in 0..2 {
            let report =
                run_matrix(Workload::Rollback, seed, 40, &mut || {}).expect("workload runs");
            assert!(report.failures.is_empty(), "{:#?}", report.failures);
            // Every flush point is a state, also past the number asked for.
            assert!(report.states >= 40, "{} states", report.states);
        }
    }

    /// The seed that found a commit without buffered data: a snapshot deletion committed
    /// through the engine alone recorded a new file's size but not its buffered bytes, so a
    /// crash after it showed 2,436 zero bytes.
    #[test]
    fn snapshot_seed_with_buffered_data_at_a_deletion_passes() {
        let report =
            run_matrix(Workload::Snapshots, 13_002, 60, &mut || {}).expect("workload runs");
        assert!(report.failures.is_empty(), "{:#?}", report.failures);
    }

    #[test]
    fn ace_seed_with_a_write_through_a_link_passes() {
        let report = run_matrix(Workload::Ace, 12_734_447_248_753_962_714, 60, &mut || {})
            .expect("workload runs");
        assert!(report.failures.is_empty(), "{:#?}", report.failures);
    }
}
