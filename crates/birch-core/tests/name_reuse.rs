//! A name deleted and created again, as SQLite's rollback journal does for every transaction:
//! create `db-journal`, write, fsync it, write and fsync `db`, close and unlink `db-journal`.
//! The next transaction's journal is a new inode under the same name, whose dir item replay
//! would find holding the previous journal (committed, or logged by its fsync). That journal
//! is gone (unlinked and freed), so the fsync logs its deletion with the new file's records
//! instead of committing (DESIGN.md §11.3).
//!
//! 1. Counters: every fsync of the pattern takes the log; no `fsync_fallback_names`, and the
//!    only commits are the explicit ones. A journal still open when the next one is fsync'd
//!    (unlinked, not freed) still commits.
//! 2. Power cut at every fsync point (the durable image as it was when the fsync returned),
//!    with the previous journal only logged, committed, or both by turns, and the journal
//!    unlinked before or after its close: replay gives `db` its fsync'd content, the journal
//!    name the newest fsync'd journal, and fsck (with data) is clean.
//! 3. Every crash state of the pattern (each flush, and seeded subsets of the writes after
//!    it, some torn), opened, judged by the crash oracle and fsck'd (`check_recording`).
//!    `BIRCH_SEED` replays; `BIRCH_CRASH_STATES` scales.

#![allow(clippy::expect_used)]

use std::sync::Arc;

use birch_core::check::{check, CheckOptions};
use birch_core::device::{MemDevice, Recorded};
use birch_core::vfs::{Caller, OpenOptions};
use birch_core::Filesystem;
use birch_format::{InodeNo, ROOT_INO};
use birch_testkit::{check_recording, History};

mod common;

fn opts() -> OpenOptions {
    OpenOptions {
        commit_interval: None,
        ..Default::default()
    }
}

fn fresh() -> Arc<MemDevice> {
    common::fresh_device(96 << 20)
}

/// How one run of the pattern goes.
#[derive(Debug, Clone, Copy)]
struct Pattern {
    /// Commit after the journal's fsync of every n-th transaction (the next journal then
    /// finds the previous one committed); `None`: never, every journal is only logged.
    commit_every: Option<usize>,
    /// Unlink the journal while it is still open, and close it after.
    unlink_open: bool,
    /// fsync the directory after the journal's first fsync, as SQLite does for a journal it
    /// created (`SQLITE_OPEN_MAIN_JOURNAL` with `UNIXFILE_DIRSYNC`).
    dirsync: bool,
}

/// The bytes transaction `k` writes to its journal (distinct lengths and contents).
fn journal_content(k: usize) -> Vec<u8> {
    vec![k as u8 + 1; 700 + k * 300]
}

/// The database after transaction `k`: a page per transaction, rewritten in place.
fn db_content(k: usize) -> Vec<u8> {
    let mut v = Vec::new();
    for page in 0..=k {
        v.extend(std::iter::repeat_n((page + 100) as u8, 4096));
    }
    v
}

/// One rollback-journal transaction. Calls `after_fsync` after each fsync returns, with
/// what must survive a crash from then on: the journal's content (the newest journal is
/// fsync'd and still named) and the database's.
/// What a transaction calls after each of its fsyncs: the filesystem, the path, the bytes.
type AfterFsync<'a> = dyn FnMut(&Filesystem, &[u8], &[u8]) + 'a;

fn transaction(
    fs: &Filesystem,
    dir: u64,
    db: u64,
    k: usize,
    p: Pattern,
    after_fsync: &mut AfterFsync<'_>,
) {
    let c = Caller::default();
    let (j, fh) = fs
        .create(c, InodeNo::new(dir), b"db-journal", 0o644, 0)
        .expect("create journal");
    let journal = journal_content(k);
    fs.write(j.ino, 0, &journal, false).expect("write journal");
    fs.fsync(j.ino, false).expect("fsync journal");
    let old_db = if k == 0 {
        Vec::new()
    } else {
        db_content(k - 1)
    };
    after_fsync(fs, &journal, &old_db);
    if p.dirsync {
        fs.fsync(InodeNo::new(dir), false)
            .expect("fsync the directory");
        after_fsync(fs, &journal, &old_db);
    }
    if p.commit_every.is_some_and(|n| k % n == n - 1) {
        fs.sync().expect("commit");
    }
    let db_now = db_content(k);
    fs.write(
        InodeNo::new(db),
        (k * 4096) as u64,
        &db_now[k * 4096..],
        false,
    )
    .expect("write db");
    fs.fsync(InodeNo::new(db), true).expect("fdatasync db");
    after_fsync(fs, &journal, &db_now);
    if p.unlink_open {
        fs.unlink(InodeNo::new(dir), b"db-journal")
            .expect("unlink journal");
        fs.release(j.ino, fh).expect("close journal");
    } else {
        fs.release(j.ino, fh).expect("close journal");
        fs.unlink(InodeNo::new(dir), b"db-journal")
            .expect("unlink journal");
    }
    // The kernel forgets the unlinked inode: it is freed now.
    fs.forget(j.ino, 1);
}

/// A filesystem with directory `/D` and an empty `/D/db`, committed. Returns (dir, db).
fn setup(fs: &Filesystem) -> (u64, u64) {
    let c = Caller::default();
    let d = fs.mkdir(c, ROOT_INO, b"D", 0o755).expect("mkdir");
    let (db, fh) = fs.create(c, d.ino, b"db", 0o644, 0).expect("create db");
    fs.release(db.ino, fh).expect("close db");
    fs.sync().expect("commit");
    (d.ino.get(), db.ino.get())
}

#[test]
fn every_fsync_of_the_journal_pattern_takes_the_log() {
    const N: usize = 40;
    let dev = fresh();
    let fs = Filesystem::open_device(dev.clone(), opts()).expect("open");
    let (dir, db) = setup(&fs);
    let before = fs.engine().counters().values();
    let p = Pattern {
        commit_every: None,
        unlink_open: false,
        dirsync: true,
    };
    let started = std::time::Instant::now();
    for k in 0..N {
        transaction(&fs, dir, db, k, p, &mut |_, _, _| {});
    }
    let elapsed = started.elapsed();
    let after = fs.engine().counters().values().since(&before);
    eprintln!("{N} transactions in {elapsed:?}: {after}");
    assert_eq!(after.fsyncs, 3 * N as u64, "{after}");
    assert_eq!(after.fsync_log, 3 * N as u64, "{after}");
    assert_eq!(after.fsync_fallback_names, 0, "{after}");
    assert_eq!(after.fsync_fallback_dir, 0, "{after}");
    assert_eq!(after.fsync_commits, 0, "{after}");
    assert_eq!(after.commits, 0, "no commit but the explicit ones: {after}");

    // With a commit now and then, the previous journal is sometimes committed: still logged.
    let before = fs.engine().counters().values();
    let p = Pattern {
        commit_every: Some(3),
        unlink_open: true,
        dirsync: false,
    };
    for k in N..2 * N {
        transaction(&fs, dir, db, k, p, &mut |_, _, _| {});
    }
    let after = fs.engine().counters().values().since(&before);
    assert_eq!(after.fsync_log, 2 * N as u64, "{after}");
    assert_eq!(after.fsync_fallback_names, 0, "{after}");
    assert_eq!(
        after.commits,
        (N / 3) as u64,
        "only the explicit commits: {after}"
    );

    // A previous journal still open (unlinked, not freed) is not gone: that fsync commits.
    let c = Caller::default();
    let (j1, fh1) = fs
        .create(c, InodeNo::new(dir), b"db-journal", 0o644, 0)
        .expect("create");
    fs.write(j1.ino, 0, b"open", false).expect("write");
    fs.fsync(j1.ino, false).expect("fsync");
    fs.unlink(InodeNo::new(dir), b"db-journal")
        .expect("unlink while open");
    let (j2, fh2) = fs
        .create(c, InodeNo::new(dir), b"db-journal", 0o644, 0)
        .expect("create");
    fs.write(j2.ino, 0, b"next", false).expect("write");
    let before = fs.engine().counters().values();
    fs.fsync(j2.ino, false).expect("fsync");
    let after = fs.engine().counters().values().since(&before);
    assert_eq!(
        (after.fsync_fallback_names, after.fsync_commits),
        (1, 1),
        "{after}"
    );
    fs.release(j1.ino, fh1).expect("close");
    fs.forget(j1.ino, 1);
    fs.release(j2.ino, fh2).expect("close");
    fs.close().expect("close");
    drop(fs);
    assert!(check(&*dev, CheckOptions { data: true })
        .expect("fsck")
        .is_clean());
}

/// Opens the durable image `image` (replaying its log), checks `/D/db` and `/D/db-journal`,
/// closes and runs fsck.
fn judge(image: MemDevice, journal: &[u8], db: &[u8], what: &str) {
    let crashed = Arc::new(image);
    let fs = Filesystem::open_device(crashed.clone(), opts()).expect("open (replay)");
    assert_eq!(fs.read_file("/D/db").expect("db"), db, "{what}: db");
    assert_eq!(
        fs.read_file("/D/db-journal").expect("journal"),
        journal,
        "{what}: the journal name holds the newest fsync'd journal"
    );
    let dir = fs.resolve("/D").expect("D");
    let names = fs.readdir(dir, 0, 100).expect("readdir");
    assert_eq!(names.len(), 4, "{what}: ., .., db, db-journal: {names:?}");
    fs.close().expect("close");
    drop(fs);
    let report = check(&*crashed, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{what}: {:?}", report.findings);
}

#[test]
fn a_power_cut_after_any_fsync_of_the_journal_pattern_keeps_it() {
    for commit_every in [None, Some(1), Some(2)] {
        for (unlink_open, dirsync) in [(false, true), (true, false)] {
            let p = Pattern {
                commit_every,
                unlink_open,
                dirsync,
            };
            let dev = fresh();
            let fs = Filesystem::open_device(dev.clone(), opts()).expect("open");
            let (dir, db) = setup(&fs);
            let mut images = Vec::new();
            for k in 0..6 {
                transaction(&fs, dir, db, k, p, &mut |_, journal, db| {
                    images.push((dev.crash(), journal.to_vec(), db.to_vec()));
                });
            }
            let counters = fs.engine().counters().values();
            assert_eq!(counters.fsync_fallback_names, 0, "{p:?}: {counters}");
            assert_eq!(counters.fsync_fallback_dir, 0, "{p:?}: {counters}");
            fs.power_cut();
            for (n, (image, journal, db)) in images.into_iter().enumerate() {
                judge(image, &journal, &db, &format!("{p:?}, fsync {n}"));
            }
        }
    }
}

#[test]
fn every_crash_state_of_the_journal_pattern_recovers() {
    let all_states: u64 = std::env::var("BIRCH_CRASH_STATES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(150);
    let seeds = birch_testkit::seeds::fixed_and_fresh("journal pattern", 0x5e9_0001);
    let mut failures = Vec::new();
    for (index, &seed) in seeds.iter().enumerate() {
        let states = birch_testkit::seeds::share(all_states, index, seeds.len()) as usize;
        eprintln!("journal pattern crash states: seed {seed}; replay with BIRCH_SEED={seed}");
        journal_pattern_seed(seed, states, &mut failures);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// One seed's share of the journal pattern's crash states, both patterns.
fn journal_pattern_seed(seed: u64, states: usize, failures: &mut Vec<String>) {
    for (run, p) in [
        Pattern {
            commit_every: None,
            unlink_open: false,
            dirsync: true,
        },
        Pattern {
            commit_every: Some(2),
            unlink_open: true,
            dirsync: true,
        },
    ]
    .into_iter()
    .enumerate()
    {
        let dev = fresh();
        let (dir, db) = {
            let fs = Filesystem::open_device(dev.clone(), opts()).expect("open");
            let ids = setup(&fs);
            fs.close().expect("close");
            ids
        };
        let base = dev.snapshot();
        dev.start_recording();
        let mut history = History::default();
        let mut events: Vec<Recorded> = Vec::new();
        {
            let fs = Filesystem::open_device(dev.clone(), opts()).expect("open");
            for k in 0..5 {
                history.version("/D/db-journal", journal_content(k));
                let mut fsyncs = 0;
                transaction(&fs, dir, db, k, p, &mut |_, _, _| {
                    events.extend(dev.take_recording());
                    if fsyncs == 0 || (p.dirsync && fsyncs == 1) {
                        history.synced(events.len(), "/D/db-journal");
                    } else {
                        history.version("/D/db", db_content(k));
                        history.synced(events.len(), "/D/db");
                    }
                    fsyncs += 1;
                });
                history.removed("/D/db-journal");
            }
            let counters = fs.engine().counters().values();
            assert_eq!(counters.fsync_fallback_names, 0, "{p:?}: {counters}");
            assert_eq!(counters.fsync_fallback_dir, 0, "{p:?}: {counters}");
            events.extend(dev.take_recording());
            fs.power_cut();
        }
        let report = check_recording(
            &format!("journal pattern {p:?}"),
            seed.wrapping_add(run as u64),
            &base,
            &events,
            &history,
            states,
            &mut || {},
        );
        assert!(report.states >= states);
        failures.extend(report.failures);
    }
}

/// fsync of a directory logs only when every entry that changed is queued already: a name
/// removed, or a file created and not fsync'd, still commits, and the name (or its absence)
/// survives a power cut.
#[test]
fn a_directory_fsync_commits_unless_its_changed_entries_are_logged() {
    let dev = fresh();
    let fs = Filesystem::open_device(dev.clone(), opts()).expect("open");
    let c = Caller::default();
    // (what, counters): judged after the crash checks, so those run first.
    let mut costs = Vec::new();
    let d = fs.mkdir(c, ROOT_INO, b"D", 0o755).expect("mkdir");
    let (gone, fh) = fs.create(c, d.ino, b"gone", 0o644, 0).expect("create");
    fs.release(gone.ino, fh).expect("close");
    fs.sync().expect("commit");
    // A new file fsync'd: the directory's fsync only waits for it.
    let (f, fh) = fs.create(c, d.ino, b"synced", 0o644, 0).expect("create");
    fs.write(f.ino, 0, b"synced", false).expect("write");
    fs.fsync(f.ino, false).expect("fsync");
    let before = fs.engine().counters().values();
    fs.fsync(d.ino, false).expect("fsyncdir");
    let after = fs.engine().counters().values().since(&before);
    costs.push(("logged", after));
    fs.release(f.ino, fh).expect("close");
    // A new file not fsync'd: its entry is not in the log.
    let (u, fh) = fs.create(c, d.ino, b"unsynced", 0o644, 0).expect("create");
    fs.write(u.ino, 0, b"named", false).expect("write");
    let before = fs.engine().counters().values();
    fs.fsync(d.ino, false).expect("fsyncdir");
    let after = fs.engine().counters().values().since(&before);
    costs.push(("committed", after));
    fs.release(u.ino, fh).expect("close");
    // A name removed with no file's fsync to carry it.
    fs.unlink(d.ino, b"gone").expect("unlink");
    let before = fs.engine().counters().values();
    fs.fsync(d.ino, false).expect("fsyncdir");
    let after = fs.engine().counters().values().since(&before);
    costs.push(("committed", after));
    // Another logged name, then a power cut right after the directory's fsync.
    let (g, fh) = fs.create(c, d.ino, b"last", 0o644, 0).expect("create");
    fs.write(g.ino, 0, b"last", false).expect("write");
    fs.fsync(g.ino, false).expect("fsync");
    fs.release(g.ino, fh).expect("close");
    let before = fs.engine().counters().values();
    fs.fsync(d.ino, false).expect("fsyncdir");
    let after = fs.engine().counters().values().since(&before);
    costs.push(("logged", after));
    fs.power_cut();
    let crashed = Arc::new(dev.crash());
    let fs = Filesystem::open_device(crashed.clone(), opts()).expect("replay");
    assert_eq!(fs.read_file("/D/synced").expect("synced"), b"synced");
    assert_eq!(fs.read_file("/D/unsynced").expect("unsynced"), b"named");
    assert_eq!(fs.read_file("/D/last").expect("last"), b"last");
    assert!(
        fs.resolve("/D/gone").is_err(),
        "the unlink was made durable"
    );
    fs.close().expect("close");
    drop(fs);
    let report = check(&*crashed, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{:?}", report.findings);
    for (what, after) in costs {
        let got = (after.fsync_log, after.fsync_fallback_dir, after.commits);
        let want = if what == "logged" {
            (1, 0, 0)
        } else {
            (0, 1, 1)
        };
        assert_eq!(got, want, "{what}: {after}");
    }
}
