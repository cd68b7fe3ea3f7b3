//! The fuzz corpus as ordinary tests: every input kept in `corpus/<target>/` and every fixed
//! crash in `crashes/<target>/` runs without a panic, and each target runs a few hundred
//! seeded mutations beyond it (the image targets fewer: each input opens a whole image).
//! A crash that is not fixed yet lives in `crashes/<target>/open/`, replayed by the ignored
//! test `open_crashes` (`cargo test -p birch-fuzz -- --ignored`).

use std::time::Duration;

use birch_fuzz::runner::{corpus_dir, crashes_dir, fuzz, load_dir, run_one, Budget};
use birch_fuzz::{Target, TARGETS};

fn replay_dir(t: &Target, dir: &std::path::Path) -> usize {
    let inputs = load_dir(dir);
    for (path, input) in &inputs {
        if let Err(message) = run_one(t, input) {
            panic!("{}: {}: panicked: {message}", t.name, path.display());
        }
    }
    inputs.len()
}

#[test]
fn corpus_and_fixed_crashes_replay_without_a_panic() {
    for t in TARGETS {
        let corpus = replay_dir(&t, &corpus_dir(t.name));
        assert!(corpus > 0, "{}: the corpus is empty", t.name);
        let crashes = replay_dir(&t, &crashes_dir(t.name));
        println!(
            "{}: {corpus} corpus inputs, {crashes} fixed crashes",
            t.name
        );
    }
}

#[test]
fn seeded_mutations_do_not_panic() {
    for t in TARGETS {
        let pool: Vec<Vec<u8>> = load_dir(&corpus_dir(t.name))
            .into_iter()
            .map(|(_, bytes)| bytes)
            .collect();
        let iterations = if t.whole_image { 40 } else { 2000 };
        let budget = Budget {
            iterations: pool.len() as u64 + iterations,
            time: Duration::from_secs(60),
            hang: Duration::from_secs(60),
        };
        match fuzz(&t, pool, 20261202, budget, false) {
            Ok(stats) => println!(
                "{}: {} inputs, {} outcome classes",
                t.name, stats.iterations, stats.classes
            ),
            Err(crash) => panic!(
                "{}: panicked: {}\ninput (hex): {}",
                t.name,
                crash.message,
                birch_format::hex(&crash.input)
            ),
        }
    }
}

#[test]
#[ignore = "crashes not fixed yet (crashes/<target>/open/): see the file names and docs/TESTING.md"]
fn open_crashes() {
    for t in TARGETS {
        replay_dir(&t, &crashes_dir(t.name).join("open"));
    }
}
