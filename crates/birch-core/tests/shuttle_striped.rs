//! The engine's striped lock (`src/striped_lock.rs`, compiled here as it is) under shuttle's
//! randomized schedulers, with its primitives (`crate::sync`) swapped for shuttle's: shuttle
//! runs the threads one step at a time and explores their interleavings (PCT: random
//! priorities with a few priority changes, which finds starvation and ordering bugs of small
//! depth with a known probability).
//!
//! What must hold in every schedule:
//! - a writer gets in within a bounded number of reader acquisitions once it waits: none that
//!   begins after it counted itself waiting goes ahead of it (readers that hold nothing wait
//!   for it); only the reads already in flight finish first;
//! - a writer's change is seen by every read that starts after the writer ends;
//! - no deadlock (shuttle fails a schedule where every thread is blocked).
//!
//! `BIRCH_SHUTTLE_ITERATIONS` scales the runs (default 2,000 schedules per test).

#![allow(dead_code)]
// The scenarios run inside shuttle (closures, not #[test] functions): a failed join is a
// failed test.
#![allow(clippy::expect_used)]

mod striped {
    include!("../src/striped_lock.rs");
}

/// `crate::sync` of the core, on shuttle's primitives, with parking_lot's method names.
mod sync {
    pub use shuttle::sync::atomic::{AtomicUsize, Ordering};
    pub use shuttle::thread_local;
    pub type RwLockReadGuard<'a, T> = shuttle::sync::RwLockReadGuard<'a, T>;
    pub type RwLockWriteGuard<'a, T> = shuttle::sync::RwLockWriteGuard<'a, T>;

    pub struct RwLock<T>(shuttle::sync::RwLock<T>);
    impl<T> RwLock<T> {
        pub fn new(value: T) -> RwLock<T> {
            RwLock(shuttle::sync::RwLock::new(value))
        }
        pub fn read_recursive(&self) -> RwLockReadGuard<'_, T> {
            self.0.read().unwrap_or_else(|e| e.into_inner())
        }
        pub fn try_read_recursive(&self) -> Option<RwLockReadGuard<'_, T>> {
            self.0.try_read().ok()
        }
        pub fn read(&self) -> RwLockReadGuard<'_, T> {
            self.read_recursive()
        }
        pub fn try_write(&self) -> Option<RwLockWriteGuard<'_, T>> {
            self.0.try_write().ok()
        }
        pub fn write(&self) -> RwLockWriteGuard<'_, T> {
            self.0.write().unwrap_or_else(|e| e.into_inner())
        }
    }

    pub struct Mutex<T>(shuttle::sync::Mutex<T>);
    pub struct MutexGuard<'a, T>(Option<shuttle::sync::MutexGuard<'a, T>>);
    impl<T> Mutex<T> {
        pub fn new(value: T) -> Mutex<T> {
            Mutex(shuttle::sync::Mutex::new(value))
        }
        pub fn lock(&self) -> MutexGuard<'_, T> {
            MutexGuard(Some(self.0.lock().unwrap_or_else(|e| e.into_inner())))
        }
    }

    pub struct Condvar(shuttle::sync::Condvar);
    impl Condvar {
        pub fn new() -> Condvar {
            Condvar(shuttle::sync::Condvar::new())
        }
        pub fn wait<T>(&self, guard: &mut MutexGuard<'_, T>) {
            if let Some(inner) = guard.0.take() {
                guard.0 = Some(self.0.wait(inner).unwrap_or_else(|e| e.into_inner()));
            }
        }
        pub fn notify_all(&self) {
            self.0.notify_all();
        }
    }
}

/// `crate::counters` of the core as far as the lock uses it; stripes handed out round robin
/// per shuttle thread.
mod counters {
    use shuttle::sync::atomic::{AtomicUsize, Ordering};

    pub const STRIPES: usize = 4;

    #[repr(align(128))]
    pub struct CachePadded<T>(pub T);
    impl<T> std::ops::Deref for CachePadded<T> {
        type Target = T;
        fn deref(&self) -> &T {
            &self.0
        }
    }

    shuttle::lazy_static! {
        static ref NEXT: AtomicUsize = AtomicUsize::new(0);
    }
    shuttle::thread_local! {
        static STRIPE: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
    }

    pub fn stripe_index() -> usize {
        STRIPE.with(|s| {
            if s.get() == usize::MAX {
                s.set(NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES);
            }
            s.get()
        })
    }
}

use shuttle::sync::atomic::{AtomicUsize, Ordering};
use shuttle::sync::Arc;
use striped::Striped;

fn iterations() -> usize {
    std::env::var("BIRCH_SHUTTLE_ITERATIONS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2_000)
}

const READERS: usize = 3;
const READS_EACH: usize = 12;

/// Readers in a loop of short reads; one writer adding 1. A read that begins after the
/// writer counted itself waiting must not go ahead of it: it sees the writer's 1, never the
/// 0 before it. Without the writers-waiting count, a stream of readers on the stripes the
/// writer is not waiting for slips in ahead of it again and again.
fn readers_and_a_writer() {
    let lock = Arc::new(Striped::new(|| 0u64));
    let ahead = Arc::new(AtomicUsize::new(0));
    let readers: Vec<_> = (0..READERS)
        .map(|_| {
            let lock = lock.clone();
            let ahead = ahead.clone();
            shuttle::thread::spawn(move || {
                let mut last = 0u64;
                for _ in 0..READS_EACH {
                    let writer_waits = lock.writers_waiting() > 0;
                    let value = *lock.read();
                    if writer_waits && value == 0 {
                        ahead.fetch_add(1, Ordering::SeqCst);
                    }
                    assert!(
                        value >= last,
                        "a read went back in time: {value} after {last}"
                    );
                    last = value;
                    shuttle::thread::yield_now();
                }
            })
        })
        .collect();
    let writer = {
        let lock = lock.clone();
        shuttle::thread::spawn(move || {
            lock.write().each(|v| *v += 1);
            assert_eq!(
                *lock.read(),
                1,
                "the writer's own later read sees its change"
            );
        })
    };
    for r in readers {
        r.join().expect("reader");
    }
    writer.join().expect("writer");
    assert_eq!(*lock.read(), 1);
    let ahead = ahead.load(Ordering::SeqCst);
    assert_eq!(ahead, 0, "{ahead} reads went ahead of a waiting writer");
}

#[test]
fn a_writer_gets_in_within_a_bounded_number_of_reads_pct() {
    shuttle::check_pct(readers_and_a_writer, iterations(), 3);
}

#[test]
fn a_writer_gets_in_within_a_bounded_number_of_reads_random() {
    shuttle::check_random(readers_and_a_writer, iterations());
}

/// Two writers and readers: no deadlock (shuttle fails a schedule where every thread is
/// blocked), both changes land, and every read sees 0, 1 or 2 in order. (Nested reads are
/// covered by `striped.rs`'s unit tests: shuttle's RwLock refuses a task's second read.)
#[test]
fn two_writers_and_readers_never_deadlock() {
    shuttle::check_pct(
        || {
            let lock = Arc::new(Striped::new(|| 0u64));
            let readers: Vec<_> = (0..2)
                .map(|_| {
                    let lock = lock.clone();
                    shuttle::thread::spawn(move || {
                        let mut last = 0;
                        for _ in 0..6 {
                            let v = *lock.read();
                            assert!(v >= last && v <= 2, "read {v} after {last}");
                            last = v;
                        }
                    })
                })
                .collect();
            let writers: Vec<_> = (0..2)
                .map(|_| {
                    let lock = lock.clone();
                    shuttle::thread::spawn(move || lock.write().each(|v| *v += 1))
                })
                .collect();
            for t in readers.into_iter().chain(writers) {
                t.join().expect("thread");
            }
            assert_eq!(*lock.read(), 2);
        },
        iterations(),
        3,
    );
}
