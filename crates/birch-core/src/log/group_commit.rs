// The group-commit protocol's code, without its module doc: `log/group.rs` (the module) and
// `tests/shuttle_group_commit.rs` (the same code on shuttle's primitives) both `include!` it.
// Its only names from the crate come from `crate::sync`.

use crate::sync::{Condvar, Mutex};

/// Arranges a call of `lead` elsewhere (`FsyncLog::set_hand_off`, `GroupCommit::set_hand_off`).
pub type HandOff = std::sync::Arc<dyn Fn() + Send + Sync>;

/// How a wait is answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Answer {
    /// The ticket's batch is durable (or had nothing left to write, every batch before it
    /// being durable).
    Logged,
    /// The ticket's batch was refused, or a refused batch's records are not yet covered by a
    /// durable commit: the caller must commit.
    Full,
    /// A batch's write or flush failed (why): every wait answers this from then on.
    Failed(String),
    /// Undecided when the deferred waits were abandoned ([`GroupCommit::abandon_deferred`]).
    Shutdown,
}

/// What a deferred wait calls with its answer ([`GroupCommit::defer`]).
pub(crate) trait Deferral: Send {
    /// Called once, with no lock of the protocol held.
    fn answer(self, answer: Answer);
}

/// What a leader does with a batch, for [`GroupCommit`]: everything but the protocol. `Queue`
/// is what the writer keeps under the protocol's lock (the records queued for the next batch
/// and its own position); the other methods run with no lock held.
pub(crate) trait Writer {
    type Queue;
    /// A batch as taken from the queue, with what it needs of the position.
    type Taken;
    /// A batch ready to write (encoded, placed).
    type Batch;
    /// What a write reports back ([`Writer::written`]).
    type Written;

    /// Under the lock: takes everything queued as the next batch; `None` when nothing is
    /// queued (the ticket is durable without I/O).
    fn take(&self, queue: &mut Self::Queue) -> Option<Self::Taken>;
    /// No lock held: makes the batch ready to write.
    fn encode(&self, taken: Self::Taken) -> Self::Batch;
    /// Under the lock: `Ok` if the batch fits, else `Err` with the newest generation of its
    /// records (the batch is refused and dropped).
    fn fits(&self, queue: &Self::Queue, batch: &Self::Batch) -> Result<(), u64>;
    /// No lock held: writes the batch and makes it durable; `Err` says why not (the log fails).
    fn write(&self, batch: &Self::Batch) -> Result<Self::Written, String>;
    /// Under the lock, after a successful write: moves the writer's position past the batch.
    fn written(&self, queue: &mut Self::Queue, batch: Self::Batch, written: Self::Written);
}

struct GroupState<Q, D> {
    /// The writer's queue and position.
    queue: Q,
    /// The ticket of the records queued now (the next batch's).
    open_ticket: u64,
    durable_ticket: u64,
    /// The last ticket whose batch did not fit: its waits answer `Full`.
    full_ticket: u64,
    leader: bool,
    failed: Option<String>,
    /// The generation of the last commit that retired batches; once its superblock is
    /// durable (`set_reusable`), queued records of that generation or older are dropped.
    retired_generation: u64,
    /// The newest generation a durable commit covers (set by `set_reusable`).
    durable_generation: u64,
    /// The newest record generation of a batch the writer refused (its records are dropped
    /// and its fsyncs commit). Until a durable commit covers it, every wait answers `Full`: an
    /// fsync whose earlier records went into that batch (queued by a write, not waited for)
    /// must not return on a later batch alone.
    refused_generation: u64,
    /// Waits deferred by [`GroupCommit::defer`]: their tickets and what to call once each is
    /// answered. Non-empty only while a leader is active or about to be started by the thread
    /// that deferred (the leader leads on while any is left).
    deferred: Vec<(u64, D)>,
    /// A [`GroupCommit::lead`] is arranged (by the hand-off) and has not started yet.
    lead_scheduled: bool,
    /// See [`GroupCommit::set_hand_off`].
    hand_off: Option<HandOff>,
}

/// The answer to a wait for `ticket` if the state decides it already.
fn outcome_of<Q, D>(st: &GroupState<Q, D>, ticket: u64) -> Option<Answer> {
    if let Some(reason) = &st.failed {
        return Some(Answer::Failed(reason.clone()));
    }
    if (st.full_ticket >= ticket && st.durable_ticket < ticket)
        || st.refused_generation > st.durable_generation
    {
        return Some(Answer::Full);
    }
    (st.durable_ticket >= ticket).then_some(Answer::Logged)
}

/// Takes the deferred waits whose answer is decided, with their answers.
fn take_answered<Q, D>(st: &mut GroupState<Q, D>) -> Vec<(Answer, D)> {
    if st.deferred.is_empty() {
        return Vec::new();
    }
    let mut answered = Vec::new();
    let mut left = Vec::new();
    for (ticket, done) in std::mem::take(&mut st.deferred) {
        match outcome_of(st, ticket) {
            Some(outcome) => answered.push((outcome, done)),
            None => left.push((ticket, done)),
        }
    }
    st.deferred = left;
    answered
}

/// The group-commit protocol over a writer's queue `Q`, with deferred waits `D`.
pub(crate) struct GroupCommit<Q, D> {
    state: Mutex<GroupState<Q, D>>,
    /// Waiters sleep on the condition variable of their ticket's parity: only two tickets are
    /// ever waited for (the batch in flight and the open one), so a finished batch wakes its
    /// own waiters and one waiter of the next batch to lead it, not everyone.
    wake: [Condvar; 2],
}

impl<Q, D: Deferral> GroupCommit<Q, D> {
    /// A protocol with nothing queued (`queue` is the writer's) and no ticket durable yet.
    pub(crate) fn new(queue: Q) -> GroupCommit<Q, D> {
        GroupCommit {
            state: Mutex::new(GroupState {
                queue,
                open_ticket: 1,
                durable_ticket: 0,
                full_ticket: 0,
                leader: false,
                failed: None,
                retired_generation: 0,
                durable_generation: 0,
                refused_generation: 0,
                deferred: Vec::new(),
                lead_scheduled: false,
                hand_off: None,
            }),
            wake: [Condvar::new(), Condvar::new()],
        }
    }

    /// Calls `f` on the writer's queue and position, under the lock.
    pub(crate) fn with_queue<R>(&self, f: impl FnOnce(&mut Q) -> R) -> R {
        f(&mut self.state.lock().queue)
    }

    /// Queues records for the next batch (`push`, under the lock; not called once the log
    /// failed) and returns its ticket.
    pub(crate) fn enqueue(&self, push: impl FnOnce(&mut Q)) -> u64 {
        let mut st = self.state.lock();
        if st.failed.is_none() {
            push(&mut st.queue);
        }
        st.open_ticket
    }

    /// Waits until the batch of `ticket` is durable (or refused, or the log failed), leading
    /// the write through `writer` if no one else is; with `dedicated`, the loop of
    /// [`GroupCommit::lead`].
    pub(crate) fn run<W: Writer<Queue = Q>>(
        &self,
        writer: &W,
        ticket: u64,
        dedicated: bool,
    ) -> Answer {
        let mut st = self.state.lock();
        if dedicated {
            st.lead_scheduled = false;
        }
        loop {
            let answered = take_answered(&mut st);
            if !answered.is_empty() {
                drop(st);
                for (outcome, done) in answered {
                    done.answer(outcome);
                }
                st = self.state.lock();
                continue;
            }
            if let Some(outcome) = outcome_of(&st, ticket) {
                if st.leader || st.deferred.is_empty() || st.lead_scheduled {
                    return outcome;
                }
                // Deferred waits are left and no one leads: the thread that deferred them
                // counted on a leader to come. A dedicated leader leads on; a caller whose
                // own wait is answered hands the leading over when it can (so it is never
                // kept from returning by others' fsyncs), else leads on.
                if !dedicated {
                    if let Some(hand_off) = st.hand_off.clone() {
                        st.lead_scheduled = true;
                        drop(st);
                        hand_off();
                        return outcome;
                    }
                }
            } else if st.leader {
                self.wake[(ticket & 1) as usize].wait(&mut st);
                continue;
            }
            // Become the leader for everything queued so far. Records queued while this
            // batch is written and flushed go into the next one.
            st.leader = true;
            let batch_ticket = st.open_ticket;
            st.open_ticket += 1;
            let Some(taken) = writer.take(&mut st.queue) else {
                // Everything this ticket queued was dropped by a durable commit that covers
                // it (`set_reusable`): nothing to write. Earlier batches are durable already
                // (one leader at a time).
                st.durable_ticket = batch_ticket;
                st.leader = false;
                self.wake_all();
                continue;
            };
            drop(st);
            // Encode with no lock held: only the leader moves the writer's position.
            let batch = writer.encode(taken);
            let fits = writer.fits(&self.state.lock().queue, &batch);
            if let Err(generation) = fits {
                st = self.state.lock();
                st.full_ticket = batch_ticket;
                st.refused_generation = st.refused_generation.max(generation);
                st.leader = false;
                self.wake_all();
                continue;
            }
            let written = writer.write(&batch);
            st = self.state.lock();
            st.leader = false;
            match written {
                Ok(written) => {
                    writer.written(&mut st.queue, batch, written);
                    st.durable_ticket = batch_ticket;
                }
                Err(reason) => {
                    st.failed = Some(reason);
                    self.wake_all();
                    continue;
                }
            }
            // This batch's waiters return; one waiter of the next ticket leads it.
            self.wake[(batch_ticket & 1) as usize].notify_all();
            self.wake[((batch_ticket + 1) & 1) as usize].notify_one();
        }
    }

    /// Waits for `ticket` without blocking the caller: `done` is answered with what
    /// [`GroupCommit::run`] would return, by whichever thread learns it (this one, if it is
    /// known now; else the leader that writes the batch, after the batch is durable, with no
    /// lock held). Returns true when no leader is active: the caller must then make sure one
    /// comes ([`GroupCommit::lead`], on a thread that may block), or `done` is never answered.
    pub(crate) fn defer(&self, ticket: u64, done: D) -> bool {
        let mut st = self.state.lock();
        if let Some(outcome) = outcome_of(&st, ticket) {
            drop(st);
            done.answer(outcome);
            return false;
        }
        st.deferred.push((ticket, done));
        !st.leader && !st.lead_scheduled
    }

    /// Leads batches until no deferred wait is left unanswered (or another leader took over),
    /// answering them. What a [`GroupCommit::defer`] that returned true asks for.
    pub(crate) fn lead<W: Writer<Queue = Q>>(&self, writer: &W) -> Answer {
        // Ticket 0 is answered from the start: this call only leads for the deferred waits.
        self.run(writer, 0, true)
    }

    /// Sets how a waiter whose own wait is answered hands the leading of deferred waits over
    /// (it must arrange a call of [`GroupCommit::lead`] on a thread that may block). Without
    /// it such a waiter leads on itself.
    pub(crate) fn set_hand_off(&self, hand_off: HandOff) {
        self.state.lock().hand_off = Some(hand_off);
    }

    /// Answers every deferred wait: with its answer if the state decides it, else with
    /// `Shutdown`; and forgets a scheduled lead. Answers them with no lock held.
    pub(crate) fn abandon_deferred(&self) {
        let taken = {
            let mut st = self.state.lock();
            st.lead_scheduled = false;
            let taken = std::mem::take(&mut st.deferred);
            taken
                .into_iter()
                .map(|(ticket, done)| (outcome_of(&st, ticket), done))
                .collect::<Vec<_>>()
        };
        for (outcome, done) in taken {
            done.answer(outcome.unwrap_or(Answer::Shutdown));
        }
    }

    /// Why a batch's write or flush failed, if one did.
    pub(crate) fn failure(&self) -> Option<String> {
        self.state.lock().failed.clone()
    }

    fn wake_all(&self) {
        for wake in &self.wake {
            wake.notify_all();
        }
    }

    /// For commit `generation`, before it writes its superblock: records that the commit
    /// covers records of `generation` or older, and calls `f` on the writer's queue and
    /// position (to drop the batches it covers), under the lock.
    pub(crate) fn retire<R>(&self, generation: u64, f: impl FnOnce(&mut Q) -> R) -> R {
        let mut st = self.state.lock();
        st.retired_generation = st.retired_generation.max(generation);
        f(&mut st.queue)
    }

    /// Once the superblock of the last retiring commit is durable: a refused batch no newer
    /// than it stops answering `Full`, and `f` is called, under the lock, with the writer's
    /// queue and the generation the commit covers (queued records of that generation or older
    /// are to be dropped: replay would skip them).
    pub(crate) fn set_reusable(&self, f: impl FnOnce(&mut Q, u64)) {
        let mut st = self.state.lock();
        let covered = st.retired_generation;
        st.durable_generation = st.durable_generation.max(covered);
        f(&mut st.queue, covered);
    }
}
