//! Named counters and latency histograms: cheap relaxed atomics that tests, `birch stats` and
//! the benchmark read.
//!
//! Owns only the numbers; it makes no decisions. Each thread adds to its own stripe (a
//! cache-line-aligned copy of every counter) and a read sums the stripes, so counting on one
//! core never invalidates another core's cache line: the hot read paths (a node cache hit, a
//! descent) count on every call from every thread.

use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// A value alone on its cache lines (two lines: the adjacent-line prefetcher pairs them), so
/// that shards of a map that different cores lock do not share a line (false sharing).
#[repr(align(128))]
#[derive(Debug, Default)]
pub struct CachePadded<T>(pub T);

impl<T> std::ops::Deref for CachePadded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// Stripes per counter set; threads beyond this share stripes (still correct, just slower).
pub(crate) const STRIPES: usize = 8;

static NEXT_STRIPE: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static STRIPE: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// This thread's stripe index, handed out round robin on first use.
pub(crate) fn stripe_index() -> usize {
    STRIPE.with(|s| {
        if s.get() == usize::MAX {
            s.set(NEXT_STRIPE.fetch_add(1, Ordering::Relaxed) % STRIPES);
        }
        s.get()
    })
}

/// One stripe on its own cache lines (128 bytes covers adjacent-line prefetch).
#[derive(Default, Debug)]
#[repr(align(128))]
struct Padded(CounterStripe);

macro_rules! counters {
    ($($name:ident: $doc:literal),* $(,)?) => {
        /// One thread's copy of every counter; [`Counters::add`] picks the field.
        #[derive(Default, Debug)]
        pub struct CounterStripe {
            $(#[doc = $doc] pub $name: AtomicU64,)*
        }

        /// A set of named counters, striped by thread.
        #[derive(Default, Debug)]
        pub struct Counters {
            stripes: [Padded; STRIPES],
        }

        /// A plain copy of [`Counters`] at one moment.
        #[derive(Default, Debug, Clone, PartialEq, Eq)]
        pub struct CounterValues {
            $(#[doc = $doc] pub $name: u64,)*
        }

        impl Counters {
            /// Reads every counter.
            pub fn values(&self) -> CounterValues {
                let mut v = CounterValues::default();
                for stripe in &self.stripes {
                    $(v.$name += stripe.0.$name.load(Ordering::Relaxed);)*
                }
                v
            }
        }

        impl CounterValues {
            /// Every counter as (name, value).
            pub fn pairs(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name),)*]
            }

            /// Differences since `earlier`.
            pub fn since(&self, earlier: &CounterValues) -> CounterValues {
                CounterValues { $($name: self.$name.saturating_sub(earlier.$name),)* }
            }
        }
    };
}

counters! {
    device_reads: "Read calls to the device.",
    device_writes: "Write calls to the device.",
    bytes_written: "Bytes written to the device.",
    flushes: "Device flushes.",
    superblock_writes: "Superblock writes.",
    commits: "Transactions committed.",
    commit_wait_us: "Microseconds callers of commit spent waiting for (or helping) another commit.",
    commit_jobs: "Jobs of parallel commit applies (runs of subtrees applied as one piece).",
    commit_jobs_helped: "Jobs of parallel commit applies run by a caller waiting for the commit.",
    commit_help_us: "Microseconds callers of commit spent running jobs of another's commit.",
    nodes_written: "B-tree nodes written by commits.",
    btree_descents: "Root-to-leaf descents of the B-tree writer.",
    objectid_lock_waits: "Object ids that waited for the id counter's mutex (only with the benchmark switch bench_global_objectid_lock, in a build with the seed-before feature; always 0 otherwise).",
    btree_cows: "Nodes copied on write.",
    btree_splits: "Node splits.",
    btree_merges: "Node merges.",
    cache_hits: "Node cache hits.",
    cache_misses: "Node cache misses (device reads of nodes).",
    checksum_errors: "Blocks read whole that failed verification: a data block whose crc32c did not match its extent's, or a node whose checksum, address, generation, owner or level was not what its parent names.",
    compress_chunks: "Chunks of up to 128 KiB rewritten as compressed blobs (by the compress= pass or birch defrag --compress).",
    compress_kept: "Chunks looked at for compression and left as written: they did not save 1/8, or no contiguous run of their compressed size was free.",
    compress_logical_bytes: "File bytes of the chunks compressed.",
    compress_stored_bytes: "Bytes those chunks take on disk compressed.",
    blob_reads: "Compressed blobs read from the device and decoded (a read of a window the decoded-blob cache did not hold).",
    blob_cache_hits: "Reads of a compressed window served by the decoded-blob cache.",
    fsyncs: "fsync and fdatasync calls.",
    buffered_blocks: "Blocks that entered a file's write buffer (buffered writes).",
    buffer_flushes: "Flushes of a file's write buffer (commit drain, fsync, dirty limit).",
    buffer_flush_runs: "Extents recorded by buffer flushes (runs of blocks contiguous in file and on disk).",
    drain_batches: "Device write batches of a commit drain that carried the staged blocks of several files together (one write_many each).",
    drain_batch_files: "Files whose buffered blocks a commit drain wrote in a batch with other files'.",
    buffer_throttled: "Buffered writes that flushed their own file above twice the dirty limit.",
    fsync_commits: "fsyncs answered by a full commit (all reasons).",
    fsync_log: "fsyncs made durable through the log.",
    fsync_nothing: "fsyncs that found nothing to make durable.",
    fsync_clean: "fsyncs through the log that found the inode log-clean (everything queued by its writes and SETATTRs): no scan, only a wait for the batch.",
    fsync_deferred: "log-clean fsyncs that did not park a thread: the FUSE adapter deferred them and the batch's leader answered them.",
    fsync_fallback_mode: "fsync commits because the mount uses fsync=commit.",
    fsync_fallback_log_full: "fsync commits because the log area had no room.",
    fsync_fallback_names: "fsync commits because a name of the inode was removed or renamed.",
    fsync_fallback_name_held: "Of fsync_fallback_names, those whose name's dir item holds, in what replay starts from, another inode that cannot be logged with it.",
    fsync_logged_moves: "Inodes renamed away from a name an fsync'd inode took, logged with it instead of a commit.",
    fsync_fallback_new_parent: "fsync commits because a new name's directory is itself uncommitted.",
    fsync_fallback_dir: "fsync commits of directories (fsyncdir).",
    metadata_full_commits: "Commits an operation forced because the changes so far left too little room for the next commit's metadata.",
    fsync_fallback_other: "fsync commits for other unsafe cases (unlinked inode, incompat flag pending, hash collision): the sum of fsync_fallback_unlinked, _incompat and _collision.",
    fsync_fallback_unlinked: "fsync commits because the inode has link count 0 (its orphan item would have to be logged).",
    fsync_fallback_incompat: "fsync commits because an incompat flag no durable commit has set yet is wanted (the first out-of-line xattr value).",
    fsync_fallback_collision: "fsync commits because a name's dir item holds several entries (a hash collision).",
    fsync_fallback_clone: "fsync commits because the inode was a copy_file_range clone's source or destination since the last commit.",
    clone_ranges: "copy_file_range calls that shared blocks instead of copying them.",
    clone_blocks: "Blocks shared by copy_file_range (named by one more extent, not written).",
    clone_copied_bytes: "Bytes copy_file_range copied as bytes (unaligned heads and tails, inline files, offsets that differ within a block).",
    log_batches: "Log batches written (one write and one flush each).",
    log_records: "Item records written to the log.",
    log_bytes: "Bytes written to the log.",
    buffer_placed_blocks: "Buffered blocks an fsync placed for the log's leader to write with its batch (one submission for the data and the batch).",
    log_aligned_skips: "Log batches started at the next boundary of the device's atomic unit (an RBD object) rather than cross it.",
    replayed_batches: "Log batches replayed at mount.",
    replayed_records: "Log records applied at mount.",
    replayed_data_bytes: "Bytes of data records the last replay wrote in place.",
    log_data_records: "Data records queued in the fsync log (the bytes of a small synchronous write, written in place by the next commit).",
    log_data_bytes: "Bytes of data records queued in the fsync log.",
    log_placed_written: "Placed blocks an fsync wrote in place because it logged their extent without their data.",
}

impl Counters {
    /// Adds `n` to the counter that `field` picks, in this thread's stripe:
    /// `counters.add(|c| &c.commits, 1)`.
    pub fn add(&self, field: impl Fn(&CounterStripe) -> &AtomicU64, n: u64) {
        field(&self.stripes[stripe_index()].0).fetch_add(n, Ordering::Relaxed);
    }
}

impl fmt::Display for CounterValues {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (name, value) in self.pairs() {
            writeln!(f, "{name:<20} {value}")?;
        }
        Ok(())
    }
}

/// Buckets of a [`LatencyHistogram`]: bucket `i` counts latencies of `2^i` to `2^(i+1) - 1`
/// microseconds (bucket 0 also counts those under 1 µs); the last one, from 2^31 µs (about
/// 36 minutes), counts everything longer. Powers of two keep the buckets fixed and the
/// percentiles within a factor of two, which is what a live view needs.
pub const LATENCY_BUCKETS: usize = 32;

/// A latency histogram with fixed log2 buckets of microseconds: one relaxed atomic add per
/// sample, no lock, so the commit and fsync paths can record every call.
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    buckets: [AtomicU64; LATENCY_BUCKETS],
}

impl LatencyHistogram {
    /// Counts one sample.
    pub fn record(&self, elapsed: std::time::Duration) {
        let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        self.buckets[latency_bucket(micros)].fetch_add(1, Ordering::Relaxed);
    }

    /// A copy of the bucket counts.
    pub fn values(&self) -> LatencyValues {
        LatencyValues {
            buckets: std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed)),
        }
    }
}

/// The bucket a latency of `micros` microseconds falls in.
pub fn latency_bucket(micros: u64) -> usize {
    if micros == 0 {
        0
    } else {
        (micros.ilog2() as usize).min(LATENCY_BUCKETS - 1)
    }
}

/// Bucket counts of a [`LatencyHistogram`] at one moment.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct LatencyValues {
    /// Samples per bucket (see [`LATENCY_BUCKETS`]).
    pub buckets: [u64; LATENCY_BUCKETS],
}

impl LatencyValues {
    /// Samples counted.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// Samples counted since `earlier`.
    pub fn since(&self, earlier: &LatencyValues) -> LatencyValues {
        LatencyValues {
            buckets: std::array::from_fn(|i| self.buckets[i].saturating_sub(earlier.buckets[i])),
        }
    }

    /// The latency below which `percent` of the samples fall, as the upper bound of its
    /// bucket in microseconds (so within a factor of two above the true value); `None` with
    /// no samples.
    pub fn percentile_micros(&self, percent: f64) -> Option<u64> {
        let count = self.count();
        if count == 0 {
            return None;
        }
        // The rank of the sample wanted, 1-based: the 50th percentile of 3 samples is the 2nd.
        let rank = ((percent / 100.0 * count as f64).ceil() as u64).clamp(1, count);
        let mut seen = 0;
        for (i, n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Some((1u64 << (i + 1)) - 1);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn latency_buckets_are_powers_of_two() {
        assert_eq!(latency_bucket(0), 0);
        assert_eq!(latency_bucket(1), 0);
        assert_eq!(latency_bucket(2), 1);
        assert_eq!(latency_bucket(3), 1);
        assert_eq!(latency_bucket(1024), 10);
        assert_eq!(latency_bucket(u64::MAX), LATENCY_BUCKETS - 1);
    }

    #[test]
    fn percentiles_name_the_bucket_bound() {
        let h = LatencyHistogram::default();
        assert_eq!(h.values().percentile_micros(50.0), None);
        // 90 samples of 100 µs (bucket 6, 64..127) and 10 of 5 ms (bucket 12, 4096..8191).
        for _ in 0..90 {
            h.record(Duration::from_micros(100));
        }
        for _ in 0..10 {
            h.record(Duration::from_millis(5));
        }
        let v = h.values();
        assert_eq!(v.count(), 100);
        assert_eq!(v.percentile_micros(50.0), Some(127));
        assert_eq!(v.percentile_micros(90.0), Some(127));
        assert_eq!(v.percentile_micros(91.0), Some(8191));
        assert_eq!(v.percentile_micros(100.0), Some(8191));
        let later = {
            h.record(Duration::from_millis(5));
            h.values()
        };
        let delta = later.since(&v);
        assert_eq!(delta.count(), 1);
        assert_eq!(delta.percentile_micros(50.0), Some(8191));
    }
}
