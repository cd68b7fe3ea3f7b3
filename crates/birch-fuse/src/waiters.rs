//! Threads for requests that wait for the device, so the request loops never do.
//!
//! Owns: a pool of worker threads that grows on demand (up to a limit) and shrinks when idle,
//! and the queue of jobs handed to it. The adapter hands it the requests whose answer waits for
//! a device write or flush (FSYNC, FSYNCDIR, WRITEs that go to the device before the
//! reply) or a device read (READs, which the kernel sends only when its page cache cannot answer, so they
//! read the device); everything else is answered on the request loop that read it.
//! Must not touch: filesystem state, replies' contents, or which requests are handed over
//! (the adapter decides).
//!
//! Why (DESIGN §12.4): a request loop blocked in an fsync cannot read the next request, so
//! with N loops at most N fsyncs and synchronous writes can wait together, and group commit
//! never covers more than N of them. Many loops fix that but slow every other request: on this
//! 2-core machine a server with 32 loops answers a round trip 2–2.5x slower than one with 2
//! (each request wakes a different, cold thread). With this pool a few loops read requests,
//! and every waiting request gets a thread of its own, up to [`Waiters::new`]'s limit; past the
//! limit jobs queue, and a full queue is served in order as workers free up.
//!
//! A hand-off costs a thread wake-up (tens of µs on a busy machine), which a lone fsync or a
//! lone reader would pay on every request. So a loop serves a waiting request itself while
//! that leaves at least one other loop free to read ([`Waiters::serve_here`]); only requests
//! beyond that are handed off.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

thread_local! {
    /// Set on the pool's worker threads.
    static ON_WORKER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread is one of a pool's workers: the only threads where a request
/// may wait for another request (a RELEASE that frees space, see
/// `birch_core::Filesystem::set_release_wait`); a request loop must not.
pub(crate) fn on_worker() -> bool {
    ON_WORKER.with(std::cell::Cell::get)
}

/// A job: a request's work and its reply, moved off the request loop.
type Job = Box<dyn FnOnce() + Send + 'static>;

/// How long an idle worker waits for a job before it ends.
const IDLE_EXIT: Duration = Duration::from_secs(10);

/// The pool (cheap to clone: one shared state).
#[derive(Clone)]
pub(crate) struct Waiters {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    /// Workers wait here for jobs.
    work: Condvar,
    /// [`Waiters::wait_idle`] waits here for the last job to end.
    idle: Condvar,
    /// At most this many workers.
    max: usize,
    /// Request loops of the session.
    loops: usize,
    /// Loops now serving a waiting request themselves.
    loops_waiting: AtomicUsize,
}

struct State {
    queue: VecDeque<Job>,
    /// Workers alive.
    workers: usize,
    /// Workers waiting for a job.
    waiting: usize,
    /// Jobs queued or running.
    pending: usize,
    /// Set at shutdown: workers end once the queue is empty.
    closing: bool,
}

impl Waiters {
    /// A pool of at most `max` workers (at least 1) for a session of `loops` request loops.
    /// Starts no thread.
    pub(crate) fn new(max: usize, loops: usize) -> Waiters {
        Waiters {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    queue: VecDeque::new(),
                    workers: 0,
                    waiting: 0,
                    pending: 0,
                    closing: false,
                }),
                work: Condvar::new(),
                idle: Condvar::new(),
                max: max.max(1),
                loops,
                loops_waiting: AtomicUsize::new(0),
            }),
        }
    }

    /// Runs `job` on a worker: a waiting one, else a new one while fewer than the limit are
    /// alive, else the first to become free. If no thread can be started and none is alive,
    /// runs it on the caller's thread (the request is answered late, never lost).
    pub(crate) fn run(&self, job: impl FnOnce() + Send + 'static) {
        let job: Job = Box::new(job);
        let mut state = self.shared.state.lock();
        if state.closing {
            drop(state);
            job();
            return;
        }
        state.pending += 1;
        state.queue.push_back(job);
        if state.waiting > state.queue.len() - 1 {
            // A waiting worker takes it (one per queued job beyond the ones already woken).
            self.shared.work.notify_one();
            return;
        }
        if state.workers < self.shared.max {
            state.workers += 1;
            drop(state);
            let shared = self.shared.clone();
            let spawned = std::thread::Builder::new()
                .name("birch-wait".into())
                .spawn(move || worker(&shared));
            if let Err(e) = spawned {
                log::warn!("cannot start a worker thread: {e}");
                let mut state = self.shared.state.lock();
                state.workers -= 1;
                if state.workers == 0 {
                    // Nobody would run it: run the queue here.
                    let jobs: Vec<Job> = state.queue.drain(..).collect();
                    drop(state);
                    for job in jobs {
                        job();
                        self.finished();
                    }
                }
            }
        }
        // Otherwise every worker is busy and the job waits its turn.
    }

    /// Whether the calling request loop may serve a waiting request itself: yes while at
    /// least one other loop stays free to read requests. Hold the guard while serving it.
    pub(crate) fn serve_here(&self) -> Option<ServingHere<'_>> {
        let waiting = self.shared.loops_waiting.fetch_add(1, Ordering::AcqRel) + 1;
        if waiting < self.shared.loops {
            Some(ServingHere(&self.shared.loops_waiting))
        } else {
            self.shared.loops_waiting.fetch_sub(1, Ordering::AcqRel);
            None
        }
    }

    /// Counts one job as done and wakes [`Waiters::wait_idle`] after the last.
    fn finished(&self) {
        finished(&self.shared);
    }

    /// Waits until no job is queued or running, then lets idle workers end. Jobs handed in
    /// afterwards run on the caller's thread.
    pub(crate) fn close(&self) {
        let mut state = self.shared.state.lock();
        while state.pending > 0 {
            self.shared.idle.wait(&mut state);
        }
        state.closing = true;
        self.shared.work.notify_all();
    }

    /// Workers alive now (for tests).
    #[cfg(test)]
    fn workers(&self) -> usize {
        self.shared.state.lock().workers
    }

    /// Workers waiting for a job now (for tests).
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.shared.state.lock().waiting
    }
}

/// A request loop serving a waiting request itself (see [`Waiters::serve_here`]).
pub(crate) struct ServingHere<'a>(&'a AtomicUsize);

impl Drop for ServingHere<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn finished(shared: &Shared) {
    let mut state = shared.state.lock();
    state.pending -= 1;
    if state.pending == 0 {
        shared.idle.notify_all();
    }
}

/// A worker: runs jobs until it has waited [`IDLE_EXIT`] for one, or the pool closes.
fn worker(shared: &Arc<Shared>) {
    ON_WORKER.with(|w| w.set(true));
    let mut state = shared.state.lock();
    loop {
        if let Some(job) = state.queue.pop_front() {
            drop(state);
            // A panicking job must still count as done, or `close` would wait forever; its
            // reply is dropped unanswered, which fuser answers with EIO.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                log::error!("a request's worker job panicked");
            }
            finished(shared);
            state = shared.state.lock();
            continue;
        }
        if state.closing {
            break;
        }
        state.waiting += 1;
        let timed_out = shared.work.wait_for(&mut state, IDLE_EXIT).timed_out();
        state.waiting -= 1;
        if timed_out && state.queue.is_empty() {
            break;
        }
    }
    state.workers -= 1;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Barrier;

    #[test]
    fn blocked_jobs_each_get_a_thread_up_to_the_limit() {
        // 8 jobs that all wait for each other can only finish if 8 run at once.
        let pool = Waiters::new(8, 2);
        let barrier = Arc::new(Barrier::new(9));
        for _ in 0..8 {
            let b = barrier.clone();
            pool.run(move || {
                b.wait();
            });
        }
        barrier.wait();
        pool.close();
        assert!(pool.workers() <= 8);
    }

    #[test]
    fn jobs_beyond_the_limit_queue_and_all_run() {
        let pool = Waiters::new(2, 2);
        let done = Arc::new(AtomicUsize::new(0));
        for _ in 0..100 {
            let d = done.clone();
            pool.run(move || {
                std::thread::sleep(Duration::from_micros(100));
                d.fetch_add(1, Ordering::SeqCst);
            });
            assert!(pool.workers() <= 2);
        }
        pool.close();
        assert_eq!(done.load(Ordering::SeqCst), 100);
    }

    #[test]
    fn idle_workers_are_reused() {
        let pool = Waiters::new(16, 2);
        let done = Arc::new(AtomicUsize::new(0));
        for i in 0..50 {
            let d = done.clone();
            pool.run(move || {
                d.fetch_add(1, Ordering::SeqCst);
            });
            // Let the worker finish and wait again before the next job.
            while done.load(Ordering::SeqCst) <= i || pool.waiting() == 0 {
                std::thread::yield_now();
            }
            assert_eq!(pool.workers(), 1);
        }
        pool.close();
        assert_eq!(done.load(Ordering::SeqCst), 50);
    }

    #[test]
    fn a_panicking_job_does_not_stall_close() {
        let pool = Waiters::new(2, 2);
        pool.run(|| panic!("job panics on purpose"));
        let done = Arc::new(AtomicUsize::new(0));
        let d = done.clone();
        pool.run(move || {
            d.fetch_add(1, Ordering::SeqCst);
        });
        pool.close();
        assert_eq!(done.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_loop_serves_here_only_while_another_stays_free() {
        let pool = Waiters::new(4, 3);
        let first = pool.serve_here();
        let second = pool.serve_here();
        assert!(first.is_some() && second.is_some());
        // A third would leave no loop reading requests.
        assert!(pool.serve_here().is_none());
        drop(first);
        assert!(pool.serve_here().is_some());
        // One loop alone never serves a waiting request itself.
        assert!(Waiters::new(4, 1).serve_here().is_none());
    }

    #[test]
    fn after_close_jobs_run_inline() {
        let pool = Waiters::new(4, 2);
        pool.close();
        let here = std::thread::current().id();
        let ran_on = Arc::new(Mutex::new(None));
        let r = ran_on.clone();
        pool.run(move || *r.lock() = Some(std::thread::current().id()));
        assert_eq!(*ran_on.lock(), Some(here));
    }
}
