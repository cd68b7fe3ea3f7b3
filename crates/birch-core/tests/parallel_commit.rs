//! Commits whose apply is cut into jobs, with threads that sync at once helping each other's
//! commits: every file each thread made, wrote, renamed and removed reads back as that thread
//! left it, before and after a reopen, and fsck finds nothing. The test also sees that jobs ran
//! on threads other than the committing one (`commit_jobs_helped`), so the helping path itself
//! is what is being checked.

#![allow(clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use birch_core::check::{check, CheckOptions};
use birch_core::device::MemDevice;
use birch_core::vfs::Caller;
use birch_core::{Filesystem, MkfsOptions};
use birch_format::{InodeNo, ROOT_INO};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const THREADS: usize = 3;

fn open(dev: &Arc<MemDevice>) -> Filesystem {
    let fs = common::open_quiet(dev);
    fs.engine().set_parallel_apply_min(64);
    fs
}

/// One thread's work in its own directory; returns what the directory must hold.
fn worker(fs: &Filesystem, dir: u64, seed: u64, rounds: usize) -> BTreeMap<String, Vec<u8>> {
    let c = Caller::default();
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut model: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let mut next = 0u64;
    for _ in 0..rounds {
        for _ in 0..rng.gen_range(50..400) {
            match rng.gen_range(0..10) {
                0..=5 => {
                    let name = format!("f{next:06}");
                    next += 1;
                    let (attr, fh) = fs
                        .create(c, InodeNo::new(dir), name.as_bytes(), 0o644, 0)
                        .expect("create");
                    let data = vec![rng.gen::<u8>(); rng.gen_range(0..5000)];
                    fs.write(attr.ino, 0, &data, false).expect("write");
                    fs.release(attr.ino, fh).expect("release");
                    model.insert(name, data);
                }
                6 | 7 if !model.is_empty() => {
                    let pick = rng.gen_range(0..model.len());
                    let Some(name) = model.keys().nth(pick).cloned() else {
                        continue;
                    };
                    fs.unlink(InodeNo::new(dir), name.as_bytes())
                        .expect("unlink");
                    model.remove(&name);
                }
                8 if !model.is_empty() => {
                    let pick = rng.gen_range(0..model.len());
                    let Some(name) = model.keys().nth(pick).cloned() else {
                        continue;
                    };
                    let to = format!("r{next:06}");
                    next += 1;
                    fs.rename(
                        InodeNo::new(dir),
                        name.as_bytes(),
                        InodeNo::new(dir),
                        to.as_bytes(),
                        0,
                    )
                    .expect("rename");
                    let data = model.remove(&name).expect("renamed file in the model");
                    model.insert(to, data);
                }
                _ => {}
            }
        }
        fs.sync().expect("sync");
    }
    model
}

fn verify(fs: &Filesystem, models: &[BTreeMap<String, Vec<u8>>], what: &str) {
    for (t, model) in models.iter().enumerate() {
        let dir = fs
            .lookup(ROOT_INO, format!("t{t}").as_bytes())
            .expect("dir")
            .ino;
        let mut names = Vec::new();
        let mut offset = 0;
        loop {
            let batch = fs.readdir(dir, offset, 256).expect("readdir");
            let Some(last) = batch.last() else { break };
            offset = last.next_offset;
            names.extend(
                batch
                    .iter()
                    .map(|e| String::from_utf8_lossy(&e.name).into_owned())
                    .filter(|n| n != "." && n != ".."),
            );
        }
        names.sort();
        let expected: Vec<String> = model.keys().cloned().collect();
        assert_eq!(names, expected, "{what}: names of t{t}");
        for (name, data) in model {
            let got = fs.read_file(&format!("/t{t}/{name}")).expect("read back");
            assert!(got == *data, "{what}: contents of t{t}/{name}");
        }
    }
}

#[test]
fn concurrent_syncs_help_parallel_commits() {
    let dev = Arc::new(MemDevice::new(256 << 20));
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    let fs = open(&dev);
    let c = Caller::default();
    let dirs: Vec<InodeNo> = (0..THREADS)
        .map(|t| {
            fs.mkdir(c, ROOT_INO, format!("t{t}").as_bytes(), 0o755)
                .expect("mkdir")
                .ino
        })
        .collect();
    // One seed: the threads' timing varies the run anyway. `BIRCH_SEED` replays another.
    let base = birch_testkit::seeds::replay().unwrap_or(0x9c0_0001);
    eprintln!("parallel_commit: seed {base} (BIRCH_SEED=N for another)");
    let mut models: Vec<BTreeMap<String, Vec<u8>>> = vec![BTreeMap::new(); THREADS];
    // Rounds until some job ran on a helping thread (a 2-core machine may need a few).
    for attempt in 0..20u64 {
        let seed = base.wrapping_add(attempt * 101);
        let round: Vec<BTreeMap<String, Vec<u8>>> = std::thread::scope(|s| {
            let handles: Vec<_> = dirs
                .iter()
                .enumerate()
                .map(|(t, &dir)| {
                    let fs = &fs;
                    s.spawn(move || worker(fs, dir.get(), seed.wrapping_add(t as u64), 12))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("worker"))
                .collect()
        });
        // Each attempt works on its own new names, so its model adds to the last one.
        for (t, model) in round.into_iter().enumerate() {
            models[t].extend(model);
        }
        let counters = fs.engine().counters().values();
        if counters.commit_jobs_helped > 0 {
            break;
        }
        // Keep names unique across attempts: rename this attempt's files out of the way.
        for (t, &dir) in dirs.iter().enumerate() {
            let names: Vec<String> = models[t].keys().cloned().collect();
            let mut renamed = BTreeMap::new();
            for name in names {
                let to = format!("a{attempt:02}-{name}");
                fs.rename(
                    InodeNo::new(dir.get()),
                    name.as_bytes(),
                    InodeNo::new(dir.get()),
                    to.as_bytes(),
                    0,
                )
                .expect("rename");
                if let Some(data) = models[t].remove(&name) {
                    renamed.insert(to, data);
                }
            }
            models[t] = renamed;
        }
    }
    let counters = fs.engine().counters().values();
    assert!(counters.commit_jobs > 0, "no commit took the parallel path");
    assert!(
        counters.commit_jobs_helped > 0,
        "no job ran on a helping thread ({} jobs)",
        counters.commit_jobs
    );
    verify(&fs, &models, "before reopen");
    fs.close().expect("close");
    drop(fs);
    let report = check(&*dev, CheckOptions { data: true }).expect("fsck runs");
    assert!(report.is_clean(), "fsck findings: {:#?}", report.findings);
    let fs = open(&dev);
    verify(&fs, &models, "after reopen");
    fs.close().expect("close");
}
