//! Named counters: cheap relaxed atomics that tests, `inspect` and the benchmark read.
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
    btree_cows: "Nodes copied on write.",
    btree_splits: "Node splits.",
    btree_merges: "Node merges.",
    cache_hits: "Node cache hits.",
    cache_misses: "Node cache misses (device reads of nodes).",
    fsyncs: "fsync and fdatasync calls.",
    buffered_blocks: "Blocks that entered a file's write buffer (buffered writes).",
    buffer_flushes: "Flushes of a file's write buffer (commit drain, fsync, dirty limit).",
    buffer_flush_runs: "Extents recorded by buffer flushes (runs of blocks contiguous in file and on disk).",
    buffer_throttled: "Buffered writes that flushed their own file above twice the dirty limit.",
    fsync_commits: "fsyncs answered by a full commit (all reasons).",
    fsync_log: "fsyncs made durable through the log.",
    fsync_nothing: "fsyncs that found nothing to make durable.",
    fsync_fallback_mode: "fsync commits because the mount uses fsync=commit.",
    fsync_fallback_log_full: "fsync commits because the log area had no room.",
    fsync_fallback_names: "fsync commits because a name of the inode was removed or renamed.",
    fsync_logged_moves: "Inodes renamed away from a name an fsync'd inode took, logged with it instead of a commit.",
    fsync_fallback_new_parent: "fsync commits because a new name's directory is itself uncommitted.",
    fsync_fallback_dir: "fsync commits of directories (fsyncdir).",
    metadata_full_commits: "Commits an operation forced because the changes so far left too little room for the next commit's metadata.",
    fsync_fallback_other: "fsync commits for other unsafe cases (unlinked inode, hash collision).",
    log_batches: "Log batches written (one write and one flush each).",
    log_records: "Item records written to the log.",
    log_bytes: "Bytes written to the log.",
    replayed_batches: "Log batches replayed at mount.",
    replayed_records: "Log records applied at mount.",
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
