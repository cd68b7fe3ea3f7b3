//! Seeds of the randomized tests: a fixed set, so two runs of the same commit test the same
//! cases, plus one fresh seed a run, printed, so runs keep exploring.
//!
//! Owns: the rule every model and crash test of the workspace draws its seeds by, and the
//! environment variables that steer it:
//!
//! - `BIRCH_SEED=N`: replay the one case of seed N (nothing fixed, nothing fresh);
//! - `BIRCH_FRESH_SEED=N`: use N as the fresh seed (replays a whole run printed earlier);
//! - `BIRCH_FRESH_SEED=0`: no fresh seed, the fixed set alone (a fully repeatable run).
//!
//! Must not touch: what a test does with its seeds.

/// The seeds of a test of `cases` cases: `BIRCH_SEED` alone when set; otherwise the fixed
/// seeds `fixed_base`, `fixed_base + 1`, … (`cases - 1` of them) and one fresh seed, unless
/// `BIRCH_FRESH_SEED=0` makes it `cases` fixed seeds. Prints which, and how to replay one.
pub fn cases(test: &str, fixed_base: u64, cases: u64) -> Vec<u64> {
    if let Some(seed) = replay() {
        eprintln!("{test}: replaying seed {seed} (BIRCH_SEED)");
        return vec![seed];
    }
    let cases = cases.max(1);
    match fresh() {
        Some(fresh) => {
            let mut seeds: Vec<u64> = (0..cases - 1).map(|c| fixed_base.wrapping_add(c)).collect();
            seeds.push(fresh);
            eprintln!(
                "{test}: {} fixed seeds from {fixed_base} and fresh seed {fresh}; replay one \
                 case with BIRCH_SEED=N, this run with BIRCH_FRESH_SEED={fresh}",
                cases - 1
            );
            seeds
        }
        None => {
            eprintln!("{test}: {cases} fixed seeds from {fixed_base} (BIRCH_FRESH_SEED=0)");
            (0..cases).map(|c| fixed_base.wrapping_add(c)).collect()
        }
    }
}

/// The seeds of a test that runs from one seed: `BIRCH_SEED` alone when set; otherwise
/// `fixed`, then a fresh seed unless `BIRCH_FRESH_SEED=0`. The test shares its work between
/// them (each seed's share of its cases or states: [`share`]).
pub fn fixed_and_fresh(test: &str, fixed: u64) -> Vec<u64> {
    if let Some(seed) = replay() {
        eprintln!("{test}: replaying seed {seed} (BIRCH_SEED)");
        return vec![seed];
    }
    match fresh() {
        Some(fresh) => {
            eprintln!(
                "{test}: fixed seed {fixed} and fresh seed {fresh}; replay one with BIRCH_SEED=N"
            );
            vec![fixed, fresh]
        }
        None => {
            eprintln!("{test}: fixed seed {fixed} (BIRCH_FRESH_SEED=0)");
            vec![fixed]
        }
    }
}

/// Seed `index`'s share of `total` units of work among `seeds` seeds: the fixed seed (index
/// 0) takes what the others leave, each fresh one a quarter of an even share (at least 1),
/// so most of the work repeats from run to run; a lone seed takes all of it.
pub fn share(total: u64, index: usize, seeds: usize) -> u64 {
    if seeds <= 1 {
        return total;
    }
    let fresh_each = (total / seeds as u64 / 4).max(1);
    if index == 0 {
        total.saturating_sub(fresh_each * (seeds as u64 - 1)).max(1)
    } else {
        fresh_each
    }
}

/// `BIRCH_SEED`, when set to a number.
pub fn replay() -> Option<u64> {
    std::env::var("BIRCH_SEED").ok()?.trim().parse().ok()
}

/// This run's fresh seed: `BIRCH_FRESH_SEED` when set (`0`: none), otherwise drawn from the
/// clock and the process id.
fn fresh() -> Option<u64> {
    if let Ok(v) = std::env::var("BIRCH_FRESH_SEED") {
        if let Ok(seed) = v.trim().parse::<u64>() {
            return (seed != 0).then_some(seed);
        }
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let mixed = (t.as_nanos() as u64 ^ u64::from(std::process::id()).rotate_left(32))
        .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    Some(mixed.max(1))
}

#[cfg(test)]
mod tests {
    use super::share;

    #[test]
    fn shares_add_up_and_favour_the_fixed_seed() {
        for total in [1u64, 2, 7, 60, 150, 200] {
            for seeds in 1..4usize {
                let parts: Vec<u64> = (0..seeds).map(|i| share(total, i, seeds)).collect();
                assert!(parts.iter().all(|&p| p >= 1), "{total} {seeds}: {parts:?}");
                if total >= 4 * seeds as u64 {
                    assert_eq!(parts.iter().sum::<u64>(), total, "{parts:?}");
                    assert!(parts[0] >= parts[parts.len() - 1], "{parts:?}");
                }
            }
        }
        assert_eq!(share(60, 0, 2), 53);
        assert_eq!(share(60, 1, 2), 7);
    }
}
