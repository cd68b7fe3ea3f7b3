//! Coverage feedback on the stable toolchain: SanitizerCoverage's inline 8-bit counters.
//!
//! Built with `-C passes=sancov-module -C llvm-args=-sanitizer-coverage-level=3
//! -C llvm-args=-sanitizer-coverage-inline-8bit-counters` (scripts/fuzz-guided.sh), every
//! instrumented module (each crate: the decoders, the engine, this crate) keeps one byte
//! counter per edge and hands its counters' range to `__sanitizer_cov_8bit_counters_init`
//! before `main`, the hook libFuzzer uses. This module defines the hook, so the runner can
//! read the counters after each input and keep the inputs that reach an edge, or an edge's
//! hit-count bucket, not seen before: coverage-guided fuzzing with no fuzzer engine and no
//! nightly flag. In a plain build the hook is never called and [`Coverage::enabled`] is false;
//! the runner then falls back to outcome classes.

use std::sync::Mutex;

/// The counter ranges the instrumented modules registered: (address, length).
static REGIONS: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

/// Called by each instrumented module's constructor with its counters' range.
///
/// # Safety
/// Called by the instrumentation with a valid `[start, stop)` range that lives as long as the
/// program; it only records the addresses.
#[no_mangle]
pub unsafe extern "C" fn __sanitizer_cov_8bit_counters_init(start: *mut u8, stop: *mut u8) {
    let (start, stop) = (start as usize, stop as usize);
    if stop > start {
        if let Ok(mut regions) = REGIONS.lock() {
            regions.push((start, stop - start));
        }
    }
}

/// The hit-count bucket of a counter, as AFL and libFuzzer bucket them: one bit each for
/// 1, 2, 3, 4-7, 8-15, 16-31, 32-127, 128+.
fn bucket(count: u8) -> u8 {
    match count {
        0 => 0,
        1 => 1,
        2 => 2,
        3 => 4,
        4..=7 => 8,
        8..=15 => 16,
        16..=31 => 32,
        32..=127 => 64,
        _ => 128,
    }
}

/// What the run has seen of the counters: per counter, the buckets reached.
pub struct Coverage {
    regions: Vec<(usize, usize)>,
    seen: Vec<u8>,
}

impl Coverage {
    /// Whether this build is instrumented (some module registered counters).
    pub fn enabled() -> bool {
        REGIONS.lock().map(|r| !r.is_empty()).unwrap_or(false)
    }

    /// Coverage over every registered counter, none seen yet.
    pub fn new() -> Coverage {
        let regions = REGIONS.lock().map(|r| r.clone()).unwrap_or_default();
        let total = regions.iter().map(|(_, len)| len).sum();
        Coverage {
            regions,
            seen: vec![0; total],
        }
    }

    /// Counters in all.
    pub fn counters(&self) -> usize {
        self.seen.len()
    }

    /// Counters ever hit.
    pub fn hit(&self) -> usize {
        self.seen.iter().filter(|b| **b != 0).count()
    }

    /// Reads and clears the counters since the last call; returns how many counters were hit
    /// for the first time (new edges; the buckets reached are recorded, not counted, which
    /// keeps the corpus to inputs that reach code no earlier one did). Other threads of the engine count into the same bytes: a count read
    /// while one writes is off by one at worst, which only nudges a bucket.
    pub fn collect(&mut self) -> usize {
        let mut new = 0;
        let mut index = 0;
        for &(start, len) in &self.regions {
            let base = start as *mut u8;
            let mut i = 0;
            while i < len {
                // Skip zero words fast: most counters stay zero for one input.
                if i + 8 <= len {
                    // SAFETY: [start, start + len) is the module's counter array, alive for
                    // the whole program; unaligned reads of plain bytes.
                    let word = unsafe { (base.add(i) as *const u64).read_unaligned() };
                    if word == 0 {
                        i += 8;
                        continue;
                    }
                }
                let end = (i + 8).min(len);
                for j in i..end {
                    // SAFETY: as above, j < len.
                    let count = unsafe { base.add(j).read_volatile() };
                    if count != 0 {
                        let b = bucket(count);
                        let slot = &mut self.seen[index + j];
                        if *slot == 0 {
                            new += 1;
                        }
                        *slot |= b;
                        // SAFETY: as above.
                        unsafe { base.add(j).write_volatile(0) };
                    }
                }
                i = end;
            }
            index += len;
        }
        new
    }
}

impl Default for Coverage {
    fn default() -> Self {
        Coverage::new()
    }
}
