//! The mutation loop: picks an input from the pool (the corpus, then what the run found),
//! mutates its bytes, runs the target, keeps the input when its outcome class is new, and
//! stops at the first panic or hang with the input saved under `crashes/<target>/`.
//! Deterministic for a seed and an iteration count (a time budget cuts it where it cuts it).

use std::collections::HashSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::coverage::Coverage;
use crate::Target;

/// Longest input the mutator makes; the scripts use far fewer bytes.
pub const MAX_INPUT: usize = 512;

/// Most inputs a run keeps in its pool.
pub const MAX_POOL: usize = 4096;

/// The crate's folder (the corpus and crashes live there).
pub fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `corpus/<target>/`.
pub fn corpus_dir(target: &str) -> PathBuf {
    crate_dir().join("corpus").join(target)
}

/// `crashes/<target>/`.
pub fn crashes_dir(target: &str) -> PathBuf {
    crate_dir().join("crashes").join(target)
}

/// The files of a folder, sorted by name; none when it does not exist.
pub fn load_dir(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(PathBuf, Vec<u8>)> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .filter_map(|p| std::fs::read(&p).ok().map(|bytes| (p, bytes)))
        .collect();
    out.sort();
    out
}

/// FNV-1a, for file names.
pub fn name_of(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// What one input did wrong.
#[derive(Debug)]
pub struct Crash {
    /// The panic message, or "hang".
    pub message: String,
    /// The input.
    pub input: Vec<u8>,
    /// Where it was saved, if it was.
    pub saved: Option<PathBuf>,
}

/// Runs one input, catching a panic.
pub fn run_one(target: &Target, input: &[u8]) -> Result<String, String> {
    catch_unwind(AssertUnwindSafe(|| (target.run)(input))).map_err(|payload| {
        payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a non-string panic".into())
    })
}

/// How long and how far a run goes.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    /// Stop after this many inputs.
    pub iterations: u64,
    /// Stop after this long.
    pub time: Duration,
    /// One input running longer than this is a hang: saved, reported, and the process exits.
    pub hang: Duration,
}

/// What a run did.
#[derive(Debug, Default)]
pub struct Stats {
    /// Inputs run.
    pub iterations: u64,
    /// Distinct outcome classes seen.
    pub classes: usize,
    /// Inputs kept for a new class (beyond the starting corpus).
    pub kept: Vec<Vec<u8>>,
    /// Seconds taken.
    pub seconds: f64,
    /// With an instrumented build: counters hit during the run, and counters in all.
    pub coverage: Option<(usize, usize)>,
}

/// A watchdog for hangs: the running input and when it started; a thread checks every
/// 100 ms and ends the process (exit code 3) with the input saved when one runs too long.
struct Watchdog {
    current: Arc<Mutex<Vec<u8>>>,
    started_ms: Arc<AtomicU64>,
    done: Arc<AtomicBool>,
    epoch: Instant,
}

impl Watchdog {
    fn start(target: &'static str, limit: Duration) -> Watchdog {
        let dog = Watchdog {
            current: Arc::new(Mutex::new(Vec::new())),
            started_ms: Arc::new(AtomicU64::new(u64::MAX)),
            done: Arc::new(AtomicBool::new(false)),
            epoch: Instant::now(),
        };
        let (current, started, done, epoch) = (
            dog.current.clone(),
            dog.started_ms.clone(),
            dog.done.clone(),
            dog.epoch,
        );
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                let at = started.load(Ordering::Relaxed);
                let now = epoch.elapsed().as_millis() as u64;
                if at != u64::MAX && now.saturating_sub(at) > limit.as_millis() as u64 {
                    let input = current.lock().map(|g| g.clone()).unwrap_or_default();
                    let saved = save(&crashes_dir(target), "hang-", &input);
                    eprintln!(
                        "birch-fuzz: {target}: an input ran over {limit:?} (a hang); saved to {} \
                         (hex {})",
                        saved.map(|p| p.display().to_string()).unwrap_or_default(),
                        birch_format::hex(&input)
                    );
                    std::process::exit(3);
                }
            }
        });
        dog
    }

    fn begin(&self, input: &[u8]) {
        if let Ok(mut g) = self.current.lock() {
            g.clear();
            g.extend_from_slice(input);
        }
        let now = self.epoch.elapsed().as_millis() as u64;
        self.started_ms.store(now, Ordering::Relaxed);
    }

    fn end(&self) {
        self.started_ms.store(u64::MAX, Ordering::Relaxed);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
    }
}

/// Writes `input` to `dir/<prefix><hash>`.
pub fn save(dir: &Path, prefix: &str, input: &[u8]) -> Option<PathBuf> {
    std::fs::create_dir_all(dir).ok()?;
    let path = dir.join(format!("{prefix}{}", name_of(input)));
    std::fs::write(&path, input).ok()?;
    Some(path)
}

/// One byte-level mutation of `input`, sometimes spliced with `other`.
pub fn mutate(rng: &mut SmallRng, input: &[u8], other: &[u8]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..rng.gen_range(1..=4) {
        match rng.gen_range(0..8) {
            0 if !out.is_empty() => {
                let at = rng.gen_range(0..out.len());
                out[at] ^= 1 << rng.gen_range(0..8);
            }
            1 | 2 if !out.is_empty() => {
                let at = rng.gen_range(0..out.len());
                out[at] = rng.gen();
            }
            3 => {
                let at = rng.gen_range(0..=out.len());
                let n = rng.gen_range(1..=8);
                let bytes: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
                out.splice(at..at, bytes);
            }
            4 if !out.is_empty() => {
                let at = rng.gen_range(0..out.len());
                let end = (at + rng.gen_range(1..=8)).min(out.len());
                out.drain(at..end);
            }
            5 if !other.is_empty() => {
                let cut = rng.gen_range(0..=out.len());
                let from = rng.gen_range(0..other.len());
                out.truncate(cut);
                out.extend_from_slice(&other[from..]);
            }
            6 if !out.is_empty() => {
                let at = rng.gen_range(0..out.len());
                let v = match rng.gen_range(0..4) {
                    0 => 0,
                    1 => 0xff,
                    2 => 1,
                    _ => 0x80,
                };
                out[at] = v;
            }
            _ => {
                let n = rng.gen_range(1..=32);
                out.extend((0..n).map(|_| rng.gen::<u8>()));
            }
        }
    }
    out.truncate(MAX_INPUT);
    out
}

/// Fuzzes `target` from `pool` (the corpus; an empty input if none) for `budget`. Returns the
/// stats, or the first crash (saved under `crashes/<target>/` when `save_crash`).
pub fn fuzz(
    target: &Target,
    pool: Vec<Vec<u8>>,
    seed: u64,
    budget: Budget,
    save_crash: bool,
) -> Result<Stats, Crash> {
    let start = Instant::now();
    let dog = Watchdog::start(target.name, budget.hang);
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut pool = if pool.is_empty() {
        vec![Vec::new()]
    } else {
        pool
    };
    let mut classes = HashSet::new();
    let mut stats = Stats::default();
    // With an instrumented build, an input that reaches a new edge is kept too.
    let mut coverage = Coverage::enabled().then(Coverage::new);
    if let Some(c) = coverage.as_mut() {
        // What ran before the first input (startup, an image built by an earlier target).
        c.collect();
    }
    // The pool itself first: its classes are known, not new.
    let mut queue: Vec<Vec<u8>> = pool.clone();
    queue.reverse();
    while stats.iterations < budget.iterations && start.elapsed() < budget.time {
        let from_pool = queue.pop();
        let is_new_input = from_pool.is_none();
        let input = from_pool.unwrap_or_else(|| {
            let a = &pool[rng.gen_range(0..pool.len())];
            let b = &pool[rng.gen_range(0..pool.len())];
            mutate(&mut rng, a, b)
        });
        dog.begin(&input);
        let outcome = run_one(target, &input);
        dog.end();
        stats.iterations += 1;
        let new_edges = coverage.as_mut().map_or(0, |c| c.collect());
        match outcome {
            Ok(class) => {
                let new_class = classes.insert(class);
                if (new_class || new_edges > 0) && is_new_input && pool.len() < MAX_POOL {
                    pool.push(input.clone());
                    stats.kept.push(input);
                }
            }
            Err(message) => {
                let saved = if save_crash {
                    save(&crashes_dir(target.name), "crash-", &input)
                } else {
                    None
                };
                return Err(Crash {
                    message,
                    input,
                    saved,
                });
            }
        }
    }
    stats.classes = classes.len();
    stats.coverage = coverage.map(|c| (c.hit(), c.counters()));
    stats.seconds = start.elapsed().as_secs_f64();
    Ok(stats)
}
