//! The fsync log's group-commit protocol (`src/log/group_commit.rs`, compiled here as it is)
//! under shuttle's PCT scheduler, with its primitives (`crate::sync`) swapped for shuttle's and
//! a fake writer in place of the device: records are numbers handed out in enqueue order, and
//! the "device" keeps the batches it wrote, in order. Shuttle runs the threads one step at a
//! time and explores their interleavings (PCT: random priorities with a few priority changes).
//!
//! What must hold in every schedule:
//! - a wait answers `Logged` only once every record its thread queued is in a written batch
//!   (or covered by a durable commit);
//! - batches are written in ticket order, each carrying the records of one ticket, and the
//!   records keep their enqueue order across batches (a later enqueue never lands in an
//!   earlier batch);
//! - one leader at a time: no batch is taken while another is in flight, and no lock of the
//!   protocol is held while the writer encodes or writes (the fake takes the lock there, and
//!   shuttle fails a task that takes a lock it holds);
//! - every deferred wait is answered exactly once, with or without a hand-off;
//! - after a failed write every wait answers the error, later ones too, and nothing more is
//!   written;
//! - a refused (full) batch makes its waiters and every later wait answer `Full` until a
//!   durable commit covers it (`retire` + `set_reusable`); then waits answer `Logged` again;
//! - no deadlock (shuttle fails a schedule where every thread is blocked).
//!
//! `BIRCH_SHUTTLE_ITERATIONS` scales the runs (default 2,000 schedules per test).

#![allow(dead_code)]
// The scenarios run inside shuttle (closures, not #[test] functions): a failed join is a
// failed test.
#![allow(clippy::expect_used)]

mod group {
    include!("../src/log/group_commit.rs");
}

/// `crate::sync` of the core as far as the protocol uses it, on shuttle's primitives, with
/// parking_lot's method names.
mod sync {
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
    impl<T> std::ops::Deref for MutexGuard<'_, T> {
        type Target = T;
        fn deref(&self) -> &T {
            self.0.as_deref().expect("a guard is held")
        }
    }
    impl<T> std::ops::DerefMut for MutexGuard<'_, T> {
        fn deref_mut(&mut self) -> &mut T {
            self.0.as_deref_mut().expect("a guard is held")
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
        pub fn notify_one(&self) {
            self.0.notify_one();
        }
    }
}

use group::{Answer, Deferral, GroupCommit, Writer};
use shuttle::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use shuttle::sync::{Arc, Mutex};

fn iterations() -> usize {
    std::env::var("BIRCH_SHUTTLE_ITERATIONS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2_000)
}

/// A record: its number (its place in the enqueue order of all threads), its generation, and
/// whether it is too big for the log (its batch is refused).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Rec {
    n: u64,
    generation: u64,
    big: bool,
}

/// The fake writer's queue, under the protocol's lock.
#[derive(Default)]
struct FakeQueue {
    queued: Vec<Rec>,
    next_n: u64,
}

/// What a thread queued: its records, and whether an enqueue was dropped (the log had failed).
#[derive(Debug, Clone, Default)]
struct Mine {
    records: Vec<Rec>,
    dropped: bool,
}

/// The protocol and a fake device.
struct Rig {
    group: GroupCommit<FakeQueue, Done>,
    /// The write (counted from 1) that fails; 0 for none.
    fail_write: usize,
    writes: AtomicUsize,
    /// A batch is taken and not yet written, refused or failed.
    in_flight: AtomicBool,
    /// The batches written, in order.
    disk: Mutex<Vec<Vec<Rec>>>,
    /// The generation the last durable commit covers (set under the protocol's lock).
    covered: AtomicU64,
    /// (record number, ticket) of every record queued.
    tickets: Mutex<Vec<(u64, u64)>>,
    /// The answers each deferred wait got, by its id.
    deferred: Mutex<Vec<Vec<Answer>>>,
    /// Called once, by the next write, with no lock held, before the batch is written: what
    /// other threads do while a leader's batch is in flight, made deterministic.
    on_write: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

/// A deferred wait.
struct Done {
    id: usize,
    mine: Mine,
    rig: Arc<Rig>,
}

impl Deferral for Done {
    fn answer(self, answer: Answer) {
        if answer == Answer::Logged {
            self.rig.check_logged(&self.mine);
        }
        self.rig.deferred.lock().expect("deferred")[self.id].push(answer);
    }
}

impl Rig {
    fn new(fail_write: usize) -> Arc<Rig> {
        Arc::new(Rig {
            group: GroupCommit::new(FakeQueue::default()),
            fail_write,
            writes: AtomicUsize::new(0),
            in_flight: AtomicBool::new(false),
            disk: Mutex::new(Vec::new()),
            covered: AtomicU64::new(0),
            tickets: Mutex::new(Vec::new()),
            deferred: Mutex::new(Vec::new()),
            on_write: Mutex::new(None),
        })
    }

    /// Queues one record; returns its ticket.
    fn enqueue(&self, mine: &mut Mine, generation: u64, big: bool) -> u64 {
        let mut pushed = None;
        let ticket = self.group.enqueue(|q| {
            let rec = Rec {
                n: q.next_n,
                generation,
                big,
            };
            q.next_n += 1;
            q.queued.push(rec);
            pushed = Some(rec);
        });
        match pushed {
            Some(rec) => {
                mine.records.push(rec);
                self.tickets.lock().expect("tickets").push((rec.n, ticket));
            }
            None => mine.dropped = true,
        }
        ticket
    }

    /// Waits for `ticket`; checks a `Logged` answer against what the thread queued.
    fn wait(&self, mine: &Mine, ticket: u64) -> Answer {
        let answer = self.group.run(self, ticket, false);
        if answer == Answer::Logged {
            self.check_logged(mine);
        }
        answer
    }

    /// Defers a wait for `ticket`; leads if asked to.
    fn defer(self: &Arc<Rig>, mine: &Mine, ticket: u64) {
        if self.defer_only(mine, ticket) {
            self.group.lead(&**self);
        }
    }

    /// Defers a wait for `ticket` (its id is the next in `deferred`); returns whether the
    /// caller must bring a leader ([`GroupCommit::defer`]), without leading.
    fn defer_only(self: &Arc<Rig>, mine: &Mine, ticket: u64) -> bool {
        let id = {
            let mut deferred = self.deferred.lock().expect("deferred");
            deferred.push(Vec::new());
            deferred.len() - 1
        };
        let done = Done {
            id,
            mine: mine.clone(),
            rig: self.clone(),
        };
        self.group.defer(ticket, done)
    }

    /// A `Logged` answer: every record the thread queued is written or covered by a durable
    /// commit, and none of its enqueues was dropped.
    fn check_logged(&self, mine: &Mine) {
        assert!(!mine.dropped, "Logged for a record the log dropped");
        let covered = self.covered.load(Ordering::SeqCst);
        let disk = self.disk.lock().expect("disk");
        for rec in &mine.records {
            let written = disk.iter().flatten().any(|r| r == rec);
            assert!(
                written || rec.generation <= covered,
                "Logged before record {rec:?} was written (covered {covered}, disk {disk:?})"
            );
        }
    }

    /// After every thread ended: batches in ticket order, one ticket each, records in enqueue
    /// order; every deferred wait answered once.
    fn check_end(&self) {
        let disk = self.disk.lock().expect("disk");
        let tickets = self.tickets.lock().expect("tickets");
        let ticket_of = |n: u64| {
            tickets
                .iter()
                .find(|(m, _)| *m == n)
                .map(|(_, t)| *t)
                .expect("a written record was queued")
        };
        let mut last_n = None;
        let mut last_ticket = 0;
        for batch in disk.iter() {
            assert!(!batch.is_empty(), "an empty batch was written");
            let ticket = ticket_of(batch[0].n);
            assert!(
                ticket > last_ticket,
                "batch of ticket {ticket} after ticket {last_ticket}: {disk:?}"
            );
            last_ticket = ticket;
            for rec in batch {
                assert_eq!(ticket_of(rec.n), ticket, "a batch of two tickets: {disk:?}");
                assert!(
                    last_n.is_none_or(|l| rec.n > l),
                    "record {} written after {last_n:?}: {disk:?}",
                    rec.n
                );
                last_n = Some(rec.n);
                assert!(!rec.big, "a big record was written");
            }
        }
        for (id, answers) in self.deferred.lock().expect("deferred").iter().enumerate() {
            assert_eq!(answers.len(), 1, "deferred wait {id} answered {answers:?}");
        }
        assert!(!self.in_flight.load(Ordering::SeqCst));
    }

    /// Takes the protocol's lock: fails the schedule (shuttle: a task that takes a lock it
    /// holds) if the caller holds it.
    fn no_lock_held(&self) {
        let _ = self.group.failure();
    }
}

impl Writer for Rig {
    type Queue = FakeQueue;
    type Taken = Vec<Rec>;
    type Batch = Vec<Rec>;
    type Written = ();

    fn take(&self, queue: &mut FakeQueue) -> Option<Vec<Rec>> {
        assert!(
            !self.in_flight.load(Ordering::SeqCst),
            "a second leader took a batch while one was in flight"
        );
        if queue.queued.is_empty() {
            return None;
        }
        self.in_flight.store(true, Ordering::SeqCst);
        Some(std::mem::take(&mut queue.queued))
    }

    fn encode(&self, taken: Vec<Rec>) -> Vec<Rec> {
        self.no_lock_held();
        assert!(self.in_flight.load(Ordering::SeqCst));
        taken
    }

    fn fits(&self, _queue: &FakeQueue, batch: &Vec<Rec>) -> Result<(), u64> {
        if batch.iter().any(|r| r.big) {
            self.in_flight.store(false, Ordering::SeqCst);
            return Err(batch.iter().map(|r| r.generation).max().unwrap_or(0));
        }
        Ok(())
    }

    fn write(&self, batch: &Vec<Rec>) -> Result<(), String> {
        self.no_lock_held();
        let n = self.writes.fetch_add(1, Ordering::SeqCst) + 1;
        let hook = self.on_write.lock().expect("on_write").take();
        if let Some(hook) = hook {
            hook();
        }
        shuttle::thread::yield_now();
        if n == self.fail_write {
            self.in_flight.store(false, Ordering::SeqCst);
            return Err(format!("write {n} failed"));
        }
        self.disk.lock().expect("disk").push(batch.clone());
        Ok(())
    }

    fn written(&self, _queue: &mut FakeQueue, _batch: Vec<Rec>, _written: ()) {
        self.in_flight.store(false, Ordering::SeqCst);
    }
}

fn join_all(threads: Vec<shuttle::thread::JoinHandle<()>>) {
    for t in threads {
        t.join().expect("thread");
    }
}

/// Three threads, two rounds each: queue one or two records, wait for the last ticket. Every
/// wait answers `Logged` after its records are written; batches in ticket and enqueue order.
fn waiters() {
    let rig = Rig::new(0);
    let threads = (0..3)
        .map(|i| {
            let rig = rig.clone();
            shuttle::thread::spawn(move || {
                let mut mine = Mine::default();
                for round in 0..2 {
                    let mut ticket = rig.enqueue(&mut mine, 1, false);
                    if (i + round) % 2 == 1 {
                        ticket = rig.enqueue(&mut mine, 1, false);
                    }
                    assert_eq!(rig.wait(&mine, ticket), Answer::Logged);
                }
            })
        })
        .collect();
    join_all(threads);
    rig.check_end();
    assert_eq!(rig.disk.lock().expect("disk").iter().flatten().count(), 9);
}

#[test]
fn waiters_return_after_their_records_are_written_in_ticket_order_pct() {
    shuttle::check_pct(waiters, iterations(), 3);
}

/// Two threads defer their waits (leading when asked), one waits; with `hand_off`, a waiter
/// whose own wait is answered while deferred waits are left hands the leading to a new thread.
fn deferred(hand_off: bool) {
    let rig = Rig::new(0);
    let spawned = Arc::new(Mutex::new(Vec::new()));
    if hand_off {
        let weak = Arc::downgrade(&rig);
        let spawned = spawned.clone();
        rig.group.set_hand_off(std::sync::Arc::new(move || {
            let rig = weak.upgrade().expect("the rig");
            let leader = shuttle::thread::spawn(move || {
                rig.group.lead(&*rig);
            });
            spawned.lock().expect("spawned").push(leader);
        }));
    }
    let threads = (0..3)
        .map(|i| {
            let rig = rig.clone();
            shuttle::thread::spawn(move || {
                let mut mine = Mine::default();
                for _ in 0..2 {
                    let ticket = rig.enqueue(&mut mine, 1, false);
                    if i < 2 {
                        rig.defer(&mine, ticket);
                    } else {
                        assert_eq!(rig.wait(&mine, ticket), Answer::Logged);
                    }
                }
            })
        })
        .collect();
    join_all(threads);
    join_all(std::mem::take(&mut *spawned.lock().expect("spawned")));
    rig.check_end();
    let deferred = rig.deferred.lock().expect("deferred");
    assert_eq!(deferred.len(), 4);
    assert!(deferred.iter().flatten().all(|a| *a == Answer::Logged));
}

#[test]
fn deferred_waits_are_answered_once_pct() {
    shuttle::check_pct(|| deferred(false), iterations(), 3);
}

#[test]
fn deferred_waits_are_answered_once_with_a_hand_off_pct() {
    shuttle::check_pct(|| deferred(true), iterations(), 3);
}

/// The second write fails: every wait answers `Logged` (its records written) or the error,
/// a thread that heard the error hears it again, and a wait after the failure hears it too.
fn failure() {
    let rig = Rig::new(2);
    let threads = (0..3)
        .map(|i| {
            let rig = rig.clone();
            shuttle::thread::spawn(move || {
                let mut mine = Mine::default();
                let mut failed = false;
                for _ in 0..2 {
                    let ticket = rig.enqueue(&mut mine, 1, false);
                    if i == 0 {
                        rig.defer(&mine, ticket);
                        continue;
                    }
                    match rig.wait(&mine, ticket) {
                        Answer::Logged => assert!(!failed, "Logged after the error"),
                        Answer::Failed(_) => failed = true,
                        other => panic!("{other:?}"),
                    }
                }
            })
        })
        .collect();
    join_all(threads);
    rig.check_end();
    let failure = rig.group.failure();
    if rig.writes.load(Ordering::SeqCst) >= 2 {
        assert!(failure.is_some());
        assert_eq!(
            rig.writes.load(Ordering::SeqCst),
            2,
            "a write after the failure"
        );
        let mut mine = Mine::default();
        let ticket = rig.enqueue(&mut mine, 1, false);
        assert!(mine.dropped, "a record queued after the failure");
        assert!(matches!(rig.wait(&mine, ticket), Answer::Failed(_)));
    } else {
        assert!(failure.is_none());
    }
    for answers in rig.deferred.lock().expect("deferred").iter() {
        assert!(matches!(
            answers[..],
            [Answer::Logged] | [Answer::Failed(_)]
        ));
    }
}

#[test]
fn a_failed_write_answers_every_waiter_with_the_error_pct() {
    shuttle::check_pct(failure, iterations(), 3);
}

/// One thread queues a record too big for the log and then a small one, and waits for the
/// small one's ticket; another queues and waits twice; a committer, once the big record is
/// queued, retires generation 1 and makes it reusable, then queues a record of generation 2.
/// Until the commit, every wait that could have carried the big record answers `Full` (a
/// `Logged` needs every record of its thread written or covered); after it, waits answer
/// `Logged` again.
fn refused() {
    let rig = Rig::new(0);
    let big_queued = Arc::new(AtomicBool::new(false));
    let fsyncer = {
        let rig = rig.clone();
        let big_queued = big_queued.clone();
        shuttle::thread::spawn(move || {
            let mut mine = Mine::default();
            rig.enqueue(&mut mine, 1, true);
            big_queued.store(true, Ordering::SeqCst);
            let ticket = rig.enqueue(&mut mine, 1, false);
            let answer = rig.wait(&mine, ticket);
            assert!(
                matches!(answer, Answer::Full | Answer::Logged),
                "{answer:?}"
            );
        })
    };
    let other = {
        let rig = rig.clone();
        shuttle::thread::spawn(move || {
            let mut mine = Mine::default();
            for _ in 0..2 {
                let ticket = rig.enqueue(&mut mine, 1, false);
                let answer = rig.wait(&mine, ticket);
                assert!(
                    matches!(answer, Answer::Full | Answer::Logged),
                    "{answer:?}"
                );
            }
        })
    };
    let committer = {
        let rig = rig.clone();
        shuttle::thread::spawn(move || {
            while !big_queued.load(Ordering::SeqCst) {
                shuttle::thread::yield_now();
            }
            rig.group.retire(1, |_| ());
            rig.group.set_reusable(|q, covered| {
                rig.covered.store(covered, Ordering::SeqCst);
                q.queued.retain(|r| r.generation > covered);
            });
            let mut mine = Mine::default();
            let ticket = rig.enqueue(&mut mine, 2, false);
            assert_eq!(rig.wait(&mine, ticket), Answer::Logged);
        })
    };
    join_all(vec![fsyncer, other, committer]);
    rig.check_end();
}

#[test]
fn a_refused_batch_answers_full_until_a_commit_covers_it_pct() {
    shuttle::check_pct(refused, iterations(), 3);
}

/// One thread, in order: ticket 1 written, ticket 2 refused (a big record), a commit covering
/// the refusal; then a wait for ticket 1 again (a waiter woken late, or a deferred wait)
/// answers `Logged`: a ticket whose batch is durable is `Full` only while a refusal is
/// uncovered; and no failure is reported. (Found by cargo-mutants: `durable_ticket <= ticket`
/// in `outcome_of`, and a `failure` always `Some`, passed every schedule above.)
fn durable_after_a_covered_refusal() {
    let rig = Rig::new(0);
    let mut mine = Mine::default();
    let first = rig.enqueue(&mut mine, 1, false);
    assert_eq!(rig.wait(&mine, first), Answer::Logged);
    let mut big = Mine::default();
    let second = rig.enqueue(&mut big, 1, true);
    assert_eq!(rig.wait(&big, second), Answer::Full);
    assert_eq!(
        rig.wait(&mine, first),
        Answer::Full,
        "the refusal is uncovered"
    );
    rig.group.retire(1, |_| ());
    rig.group.set_reusable(|q, covered| {
        rig.covered.store(covered, Ordering::SeqCst);
        q.queued.retain(|r| r.generation > covered);
    });
    assert_eq!(rig.wait(&mine, first), Answer::Logged);
    // No write failed (`lead` turns the engine read-only on a failure it reports).
    assert_eq!(rig.group.failure(), None);
    rig.check_end();
}

#[test]
fn a_durable_ticket_answers_logged_once_a_later_refusal_is_covered() {
    shuttle::check_random(durable_after_a_covered_refusal, 1);
}

/// A deferred wait no leader came for is answered `Shutdown` by `abandon_deferred`, once.
/// (Found by cargo-mutants: an `abandon_deferred` doing nothing passed every test.)
fn abandoned() {
    let rig = Rig::new(0);
    let mut mine = Mine::default();
    let ticket = rig.enqueue(&mut mine, 1, false);
    rig.deferred.lock().expect("deferred").push(Vec::new());
    let done = Done {
        id: 0,
        mine,
        rig: rig.clone(),
    };
    assert!(
        rig.group.defer(ticket, done),
        "no leader: the caller must bring one"
    );
    rig.group.abandon_deferred();
    assert_eq!(
        rig.deferred.lock().expect("deferred")[0],
        vec![Answer::Shutdown]
    );
}

#[test]
fn an_abandoned_deferred_wait_answers_shutdown() {
    shuttle::check_random(abandoned, 1);
}

/// A hand-off that only counts its calls (the test calls `lead` itself, when it chooses).
fn counting_hand_off(rig: &Rig) -> Arc<AtomicUsize> {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    rig.group.set_hand_off(std::sync::Arc::new(move || {
        counted.fetch_add(1, Ordering::SeqCst);
    }));
    calls
}

/// Who leads, in one thread: a waiter leads ticket 1; while its batch is written, a second
/// record is queued and its wait deferred (a leader is active: nobody is asked to come). The
/// waiter's own wait is then answered with the deferred one left: with a hand-off set, it
/// hands the leading over once and returns, without writing ticket 2. Then `lead` (what the
/// hand-off arranges) writes it and answers the deferred wait, leading on itself rather than
/// handing off again. (Found by cargo-mutants: a `set_hand_off` doing nothing, and `!`
/// deleted before `dedicated` in `run`, passed every test above, which check the answers,
/// not who leads.)
fn answered_waiter_hands_off() {
    let rig = Rig::new(0);
    let hand_offs = counting_hand_off(&rig);
    let weak = Arc::downgrade(&rig);
    *rig.on_write.lock().expect("on_write") = Some(Box::new(move || {
        let rig = weak.upgrade().expect("the rig");
        let mut mine = Mine::default();
        let ticket = rig.enqueue(&mut mine, 1, false);
        assert_eq!(ticket, 2, "queued behind the batch in flight");
        assert!(
            !rig.defer_only(&mine, ticket),
            "a leader is active: the deferring thread need not bring one"
        );
    }));
    let mut mine = Mine::default();
    let first = rig.enqueue(&mut mine, 1, false);
    assert_eq!(rig.wait(&mine, first), Answer::Logged);
    assert_eq!(
        hand_offs.load(Ordering::SeqCst),
        1,
        "the answered waiter hands the leading of the deferred wait over"
    );
    assert_eq!(
        rig.writes.load(Ordering::SeqCst),
        1,
        "the answered waiter did not lead on"
    );
    assert_eq!(
        rig.deferred.lock().expect("deferred")[0],
        Vec::<Answer>::new(),
        "the deferred wait waits for the lead handed over"
    );
    assert_eq!(rig.group.lead(&*rig), Answer::Logged);
    assert_eq!(
        rig.writes.load(Ordering::SeqCst),
        2,
        "`lead` wrote ticket 2"
    );
    assert_eq!(
        hand_offs.load(Ordering::SeqCst),
        1,
        "a dedicated leader leads on, it does not hand off"
    );
    rig.check_end();
    assert_eq!(
        rig.deferred.lock().expect("deferred")[0],
        vec![Answer::Logged]
    );
}

#[test]
fn an_answered_waiter_hands_the_leading_of_deferred_waits_over() {
    shuttle::check_random(answered_waiter_hands_off, 1);
}

/// A wait deferred with no leader active asks its caller for one; `lead` then writes the
/// batch and answers it itself, with a hand-off set: it never hands the leading off. (Found
/// by cargo-mutants: `!` deleted before `dedicated` in `run` made `lead` hand off and return.)
fn dedicated_leader_leads() {
    let rig = Rig::new(0);
    let hand_offs = counting_hand_off(&rig);
    let mut mine = Mine::default();
    let ticket = rig.enqueue(&mut mine, 1, false);
    assert!(
        rig.defer_only(&mine, ticket),
        "no leader: the caller must bring one"
    );
    assert_eq!(rig.group.lead(&*rig), Answer::Logged);
    assert_eq!(hand_offs.load(Ordering::SeqCst), 0, "`lead` handed off");
    assert_eq!(rig.writes.load(Ordering::SeqCst), 1);
    rig.check_end();
    assert_eq!(
        rig.deferred.lock().expect("deferred")[0],
        vec![Answer::Logged]
    );
}

#[test]
fn a_dedicated_leader_leads_deferred_waits_itself() {
    shuttle::check_random(dedicated_leader_leads, 1);
}
