//! The fsync log: one write and one flush per fsync, shared by concurrent fsyncs.
//!
//! Owns: placing batches in the circular log area, group commit (the first fsync that finds no
//! batch in flight becomes the leader, writes everything queued so far as one batch, flushes
//! once, and wakes every fsync whose records it carried), retiring batches once a commit covers
//! them, and reading the log back for replay.
//!
//! Must not touch: the trees, the delta, inodes. It is handed records (item changes with the
//! delta generation they belong to) and writes them; no lock is held while the device writes
//! or flushes: the leader works outside the mutex, followers wait on a condition variable.
//!
//! Pipeline: while one batch is written and flushed, every record queued meanwhile waits for
//! the next batch, and the first waiter woken after the flush leads it; so one flush covers
//! every record (and every data write) queued before its batch was taken, and 64 synchronous
//! writers share a few flushes a second rather than one each. The leader encodes the batch
//! with no lock held. A key queued twice before its batch is taken keeps only its later record
//! (in the earlier one's place): replay applies records as whole items in order, so the result
//! is the same and a batch never carries one inode item 64 times.
//!
//! Crash argument, in short (DESIGN.md has the walk-through): a batch is durable only after
//! its flush, and its fsyncs return only then. Every data block a record references was written
//! (O_DIRECT, completed) before the record was queued, or is a placed block the leader writes
//! in the same submission as the batch; either way the flush of the batch, issued after that
//! submission completed, makes it durable. Replay verifies each block's checksum and stops at
//! the first batch that fails, which can only be the one unflushed batch. One batch is in flight at a time, so at most one batch
//! on the device is unflushed and replay never stops before an acknowledged one. A batch is
//! reused only after a superblock that starts the log past it is durable. Queued records whose
//! generation a durable commit covers are dropped unwritten (`set_reusable`): replay would skip
//! them, and the tree holds their values or newer; a ticket left with no records is durable
//! without I/O, because every batch before it is.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};

use birch_format::items::{ExtentKind, FileExtent};
use birch_format::log::{decode_batch, decode_header, encode_batch, LogRecord};
use birch_format::superblock::{Superblock, INCOMPAT_LOG_ALIGNED};
use birch_format::{Generation, ItemType, Key, Lsn, BLOCK_SIZE};
use parking_lot::{Condvar, Mutex};

use crate::counters::Counters;
use crate::device::BlockDevice;
use crate::error::{Error, Result};
use crate::pending::PendingData;
use crate::readonly::ReadOnlyCause;

/// A batch written and not yet retired by a commit.
#[derive(Debug, Clone, Copy)]
struct LiveBatch {
    lsn: Lsn,
    seq: u64,
    max_generation: Generation,
}

struct LogState {
    /// Next byte position to write at.
    tail_lsn: Lsn,
    next_seq: u64,
    /// Space before this position may be overwritten (a durable superblock starts past it).
    reusable_lsn: Lsn,
    live: VecDeque<LiveBatch>,
    /// Records queued for the next batch, and that batch's ticket.
    queued: Vec<LogRecord>,
    /// Where each key's record sits in `queued`: a later record of a key replaces the earlier
    /// one in place (replay would apply both in order; only the last value survives).
    queued_at: HashMap<Key, usize>,
    open_ticket: u64,
    durable_ticket: u64,
    /// The last ticket whose batch did not fit: its fsyncs fall back to a commit.
    full_ticket: u64,
    leader: bool,
    failed: Option<String>,
    /// The generation of the last commit that retired batches; once its superblock is
    /// durable (`set_reusable`), queued records of that generation or older are dropped.
    retired_generation: Generation,
    /// The newest generation a durable commit covers (set by `set_reusable`).
    durable_generation: Generation,
    /// The newest record generation of a batch the log refused (its records are dropped and
    /// its fsyncs commit). Until a durable commit covers it, every wait answers `Full`: an
    /// fsync whose earlier records went into that batch (queued by a write, not waited for)
    /// must not return on a later batch alone.
    refused_generation: Generation,
    /// Waits deferred by [`FsyncLog::defer`]: their tickets and what to call once each is
    /// answered. Non-empty only while a leader is active or about to be started by the thread
    /// that deferred (the leader leads on while any is left).
    deferred: Vec<(u64, Deferred)>,
    /// A [`FsyncLog::lead`] is arranged (by `hand_off`) and has not started yet.
    lead_scheduled: bool,
    /// See [`FsyncLog::set_hand_off`].
    hand_off: Option<HandOff>,
}

/// Arranges a call of [`FsyncLog::lead`] elsewhere ([`FsyncLog::set_hand_off`]).
pub type HandOff = std::sync::Arc<dyn Fn() + Send + Sync>;

/// What a deferred wait calls with its outcome ([`FsyncLog::defer`]).
pub type Deferred = Box<dyn FnOnce(Result<LogOutcome>) + Send>;

/// The outcome of a wait for `ticket` if the log's state decides it already.
fn outcome_of(st: &LogState, ticket: u64) -> Option<Result<LogOutcome>> {
    if let Some(reason) = &st.failed {
        return Some(Err(Error::ReadOnly(ReadOnlyCause::LogWriteFailed {
            error: reason.clone(),
        })));
    }
    if (st.full_ticket >= ticket && st.durable_ticket < ticket)
        || st.refused_generation > st.durable_generation
    {
        return Some(Ok(LogOutcome::Full));
    }
    (st.durable_ticket >= ticket).then_some(Ok(LogOutcome::Logged))
}

/// Takes the deferred waits whose outcome is decided, with their outcomes.
fn take_answered(st: &mut LogState) -> Vec<(Result<LogOutcome>, Deferred)> {
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

/// What became of an fsync's records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogOutcome {
    /// Durable in the log.
    Logged,
    /// The log area had no room: the caller must commit.
    Full,
}

/// The fsync log of one filesystem.
pub struct FsyncLog {
    state: Mutex<LogState>,
    /// Waiters sleep on the condition variable of their ticket's parity: only two tickets are
    /// ever waited for (the batch in flight and the open one), so a finished batch wakes its
    /// own waiters and one waiter of the next batch to lead it, not everyone.
    wake: [Condvar; 2],
    start: u64,
    bytes: u64,
    fsid: [u8; 16],
    /// Data blocks allocated and not yet written in place ([`PendingData`]): a leader writes
    /// those its batch's extent records name (and no data record carries) before the batch.
    placed: PendingData,
    /// The device's atomic unit once the image's superblock says batches may skip to its
    /// boundaries (`INCOMPAT_LOG_ALIGNED`); 0 while they may not ([`FsyncLog::set_align`]).
    align: AtomicU64,
}

impl FsyncLog {
    /// A log continuing after `tail_lsn` / `next_seq` (the end of what replay read), with
    /// space before `head_lsn` reusable.
    pub fn new(sb: &Superblock, tail_lsn: Lsn, next_seq: u64) -> FsyncLog {
        FsyncLog {
            state: Mutex::new(LogState {
                tail_lsn,
                next_seq,
                reusable_lsn: Lsn::new(sb.log_head),
                live: VecDeque::new(),
                queued: Vec::new(),
                queued_at: HashMap::new(),
                open_ticket: 1,
                durable_ticket: 0,
                full_ticket: 0,
                leader: false,
                failed: None,
                retired_generation: Generation::default(),
                durable_generation: Generation::default(),
                refused_generation: Generation::default(),
                deferred: Vec::new(),
                lead_scheduled: false,
                hand_off: None,
            }),
            wake: [Condvar::new(), Condvar::new()],
            start: sb.log_start,
            bytes: sb.log_bytes,
            fsid: sb.fsid,
            placed: PendingData::default(),
            align: AtomicU64::new(0),
        }
    }

    /// From now on, a batch that fits in `unit` bytes (the device's atomic unit, a power of
    /// two: an RBD object) never crosses a multiple of `unit` in device offsets: it starts at
    /// the next one instead. Only once `INCOMPAT_LOG_ALIGNED` is in a durable superblock, so
    /// every replay of this log knows to look there. 0 turns it off.
    pub fn set_align(&self, unit: u64) {
        let unit = if unit.is_power_of_two() && unit >= BLOCK_SIZE {
            unit
        } else {
            0
        };
        self.align.store(unit, AtomicOrdering::SeqCst);
    }

    /// Where a batch of `len` bytes that would start at `lsn` goes: at `lsn`, unless it would
    /// straddle the end of the area (then at the start of the next lap) or, with an atomic
    /// unit set, cross a unit boundary that it fits within (then at that boundary).
    fn place_batch(&self, lsn: u64, len: u64) -> u64 {
        if len > self.bytes / 2 {
            // Refused by the caller (`fits`): never moved, so never wrapped for ever.
            return lsn;
        }
        let unit = self.align.load(AtomicOrdering::SeqCst);
        let mut lsn = lsn;
        // A skip, the wrap it may cause, and a skip from the start of the next lap (the area
        // need not start on a boundary): then it stays. A skip never goes past the start of
        // the next lap, where replay looks after the boundaries of this one.
        for _ in 0..3 {
            let before = lsn;
            if unit != 0 && len <= unit {
                let at = self.start + lsn % self.bytes;
                if at / unit != (at + len - 1) / unit {
                    let next_lap = (lsn / self.bytes + 1) * self.bytes;
                    lsn = (lsn + unit - at % unit).min(next_lap);
                }
            }
            if lsn % self.bytes + len > self.bytes {
                lsn = (lsn / self.bytes + 1) * self.bytes; // never straddle the end
            }
            if lsn == before {
                break;
            }
        }
        lsn
    }

    /// Bytes between the space a durable commit made reusable and the next write position
    /// (batches replay would still read), capped at the area's size; and the area's size.
    pub fn fill_bytes(&self) -> (u64, u64) {
        let st = self.state.lock();
        (
            st.tail_lsn
                .get()
                .saturating_sub(st.reusable_lsn.get())
                .min(self.bytes),
            self.bytes,
        )
    }

    /// Queues `records` and returns once they are durable (or the log is full). Concurrent
    /// callers share one write and one flush. Does device I/O with no lock held.
    pub fn submit(
        &self,
        device: &dyn BlockDevice,
        counters: &Counters,
        records: Vec<LogRecord>,
    ) -> Result<LogOutcome> {
        let ticket = self.enqueue(records);
        self.wait(device, counters, ticket)
    }

    /// Queues records for the next batch; returns its ticket. Records queued earlier are
    /// written no later than these, so a caller that orders its enqueues orders replay.
    /// Without a log area, or once the log failed, the records are dropped: the ticket's wait
    /// answers `Full` or the error.
    pub fn enqueue(&self, records: Vec<LogRecord>) -> u64 {
        let mut st = self.state.lock();
        if self.bytes == 0 || st.failed.is_some() {
            return st.open_ticket;
        }
        for record in records {
            let st = &mut *st;
            match st.queued_at.get(&record.key) {
                Some(&at) => st.queued[at] = record,
                None => {
                    st.queued_at.insert(record.key, st.queued.len());
                    st.queued.push(record);
                }
            }
        }
        st.open_ticket
    }

    /// Waits until the batch of `ticket` is durable, leading the write if no one else is.
    /// A leader also answers the deferred waits ([`FsyncLog::defer`]) its batches decide.
    pub fn wait(
        &self,
        device: &dyn BlockDevice,
        counters: &Counters,
        ticket: u64,
    ) -> Result<LogOutcome> {
        self.run(device, counters, ticket, false)
    }

    /// [`FsyncLog::wait`], or with `dedicated` the loop of [`FsyncLog::lead`].
    fn run(
        &self,
        device: &dyn BlockDevice,
        counters: &Counters,
        ticket: u64,
        dedicated: bool,
    ) -> Result<LogOutcome> {
        if self.bytes == 0 {
            return Ok(LogOutcome::Full);
        }
        let mut st = self.state.lock();
        if dedicated {
            st.lead_scheduled = false;
        }
        loop {
            let answered = take_answered(&mut st);
            if !answered.is_empty() {
                drop(st);
                for (outcome, done) in answered {
                    done(outcome);
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
            let records = std::mem::take(&mut st.queued);
            st.queued_at.clear();
            if records.is_empty() {
                // Everything this ticket queued was dropped by a durable commit that covers
                // it (`set_reusable`): nothing to write. Earlier batches are durable already
                // (one leader at a time).
                st.durable_ticket = batch_ticket;
                st.leader = false;
                self.wake_all();
                continue;
            }
            let seq = st.next_seq;
            let tail_lsn = st.tail_lsn.get();
            drop(st);
            // Encode with no lock held: only the leader moves the tail and the sequence, and
            // the reusable point only grows.
            let max_generation =
                Generation::new(records.iter().map(|r| r.generation).max().unwrap_or(0));
            let mut bytes = encode_batch(self.fsid, seq, tail_lsn, &records);
            let len = bytes.len() as u64;
            let lsn = self.place_batch(tail_lsn, len);
            if lsn != tail_lsn {
                bytes = encode_batch(self.fsid, seq, lsn, &records);
                if lsn % self.bytes != 0 {
                    counters.add(|c| &c.log_aligned_skips, 1);
                }
            }
            let reusable_lsn = self.state.lock().reusable_lsn.get();
            let fits = lsn + len - reusable_lsn <= self.bytes && len <= self.bytes / 2;
            if !fits {
                st = self.state.lock();
                st.full_ticket = batch_ticket;
                st.refused_generation = st.refused_generation.max(max_generation);
                st.leader = false;
                self.wake_all();
                continue;
            }
            // The batch and the placed blocks it names go in one submission (one round trip),
            // then one flush. They may land in any order: replay checks every block an extent
            // record of a batch names and stops at the first batch that fails, and that can
            // only be this one, which no fsync was told is durable (one batch in flight).
            let at = self.start + lsn % self.bytes;
            let written = self
                .placed
                .write_named_with(device, &records, (at, &bytes))
                .and_then(|placed| device.flush().map(|()| placed));
            st = self.state.lock();
            st.leader = false;
            match written {
                Ok(placed) => {
                    counters.add(|c| &c.log_placed_written, placed / BLOCK_SIZE);
                    st.live.push_back(LiveBatch {
                        lsn: Lsn::new(lsn),
                        seq,
                        max_generation,
                    });
                    st.tail_lsn = Lsn::new(lsn + len);
                    st.next_seq = seq + 1;
                    st.durable_ticket = batch_ticket;
                    counters.add(|c| &c.log_batches, 1);
                    counters.add(|c| &c.log_records, records.len() as u64);
                    counters.add(|c| &c.log_bytes, len);
                }
                Err(e) => {
                    st.failed = Some(format!("write or flush of batch {seq} at {at:#x}: {e}"));
                    self.wake_all();
                    continue;
                }
            }
            // This batch's waiters return; one waiter of the next ticket leads it.
            self.wake[(batch_ticket & 1) as usize].notify_all();
            self.wake[((batch_ticket + 1) & 1) as usize].notify_one();
        }
    }

    /// Waits for `ticket` without blocking the caller: `done` is called with the outcome
    /// [`FsyncLog::wait`] would return, by whichever thread learns it (this one, if it is
    /// known now; else the leader that writes the batch, after the batch's flush, with no lock
    /// held). Returns true when no leader is active: the caller must then make sure one comes
    /// ([`FsyncLog::lead`], on a thread that may block), or `done` is never called.
    ///
    /// Why (DESIGN §11.4): an fsync whose records are queued already (a log-clean inode) only
    /// waits; a thread parked per such fsync costs two context switches and a thread of the
    /// request pool, where the leader can answer every fsync of its batch itself.
    pub fn defer(&self, ticket: u64, done: Deferred) -> bool {
        if self.bytes == 0 {
            done(Ok(LogOutcome::Full));
            return false;
        }
        let mut st = self.state.lock();
        if let Some(outcome) = outcome_of(&st, ticket) {
            drop(st);
            done(outcome);
            return false;
        }
        st.deferred.push((ticket, done));
        !st.leader && !st.lead_scheduled
    }

    /// Leads batches until no deferred wait is left unanswered (or another leader took over),
    /// answering them. What a [`FsyncLog::defer`] that returned true asks for.
    pub fn lead(&self, device: &dyn BlockDevice, counters: &Counters) -> Result<LogOutcome> {
        // Ticket 0 is answered from the start: this call only leads for the deferred waits.
        self.run(device, counters, 0, true)
    }

    /// Sets how a waiter whose own wait is answered hands the leading of deferred waits over
    /// (it must arrange a call of [`FsyncLog::lead`] on a thread that may block, such as a
    /// worker of the FUSE adapter's pool). Without it such a waiter leads on itself.
    pub fn set_hand_off(&self, hand_off: HandOff) {
        self.state.lock().hand_off = Some(hand_off);
    }

    /// The placed data blocks ([`PendingData`]).
    pub(crate) fn placed(&self) -> &PendingData {
        &self.placed
    }

    /// Answers every deferred wait: with its outcome if the log's state decides it, else with
    /// `Error::Shutdown`; and forgets a scheduled lead. For an engine that shut down: no
    /// leader may come any more, and a deferred wait left unanswered is a caller blocked for
    /// good (its callback holds the FUSE reply). Calls them with no lock held.
    pub fn abandon_deferred(&self) {
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
            done(outcome.unwrap_or(Err(Error::Shutdown)));
        }
    }

    /// Why the log failed (a batch's write or flush), if it did: every wait answers an error.
    pub fn failure(&self) -> Option<String> {
        self.state.lock().failed.clone()
    }

    fn wake_all(&self) {
        for wake in &self.wake {
            wake.notify_all();
        }
    }

    /// Called by commit `generation` before it writes its superblock: drops the batches the
    /// commit covers and returns where the live log starts (lsn, seq).
    pub fn retire(&self, generation: Generation) -> (Lsn, u64) {
        let mut st = self.state.lock();
        st.retired_generation = st.retired_generation.max(generation);
        while st
            .live
            .front()
            .is_some_and(|b| b.max_generation <= generation)
        {
            st.live.pop_front();
        }
        match st.live.front() {
            Some(b) => (b.lsn, b.seq),
            None => (st.tail_lsn, st.next_seq),
        }
    }

    /// Called once the superblock naming `head_lsn` is durable: space before it is reusable,
    /// and queued records the commit covers (generation at most the retiring commit's) are
    /// dropped: replay would skip them, and the durable tree holds their values or newer.
    pub fn set_reusable(&self, head_lsn: Lsn) {
        let mut st = self.state.lock();
        st.reusable_lsn = st.reusable_lsn.max(head_lsn);
        let covered = st.retired_generation;
        st.durable_generation = st.durable_generation.max(covered);
        if st.queued.iter().any(|r| r.generation <= covered.get()) {
            let st = &mut *st;
            st.queued.retain(|r| r.generation > covered.get());
            st.queued_at.clear();
            for (at, r) in st.queued.iter().enumerate() {
                st.queued_at.insert(r.key, at);
            }
        }
    }
}

/// What replay found in the log.
#[derive(Debug, Default)]
pub struct Replay {
    /// Records of every verified batch, in log order. Includes records whose generation the
    /// committed tree already covers; replay applies only those newer than the superblock's.
    pub records: Vec<LogRecord>,
    /// Number of batches that verified and were read.
    pub batches: u64,
    /// Where the next batch goes.
    pub tail_lsn: Lsn,
    /// Sequence number the next batch written must carry.
    pub next_seq: u64,
    /// Why reading stopped (end of log, torn batch, data checksum).
    pub stop: String,
    /// The device offset of the batch replay stopped at when that batch itself verified
    /// (header, sequence, lsn, checksum) but named data that did not (a batch that landed
    /// without its data, §11.1). A writable open erases its header before the log writes
    /// again (`LogHandle::erase_rejected_batch`): a later batch with the same sequence number
    /// may go elsewhere (a skip, a wrap), and once a commit covers this one's generation its
    /// data is no longer checked, so replay would take it in that batch's place.
    pub rejected_at: Option<u64>,
    /// When replay stopped at a batch that verified but was rejected (`rejected_at`): the
    /// sequence number of a valid batch right after it. The writer starts a batch only after
    /// the previous one's flush, so the rejected batch was durable and its fsyncs answered:
    /// its data was lost or overwritten since (a device that lost writes, or a bug), and the
    /// batches after it, fsync'd too, are not replayed. fsck reports it
    /// (`FindingKind::LogBatchesLost`).
    pub followed_by: Option<u64>,
}

/// Reads every batch from the superblock's log head while each verifies, has the next
/// sequence number, and references only data blocks whose checksums match. May do much I/O.
pub fn read_log(device: &dyn BlockDevice, sb: &Superblock) -> Replay {
    let mut out = Replay {
        tail_lsn: Lsn::new(sb.log_head),
        next_seq: sb.log_generation,
        ..Default::default()
    };
    if sb.log_bytes == 0 {
        out.stop = "no log area".into();
        return out;
    }
    let mut lsn = sb.log_head;
    let mut read_total = 0u64;
    let mut placed: HashMap<u64, u32> = HashMap::new();
    loop {
        if read_total >= sb.log_bytes {
            out.stop = "read a whole lap".into();
            return out;
        }
        let batch = find_batch(device, sb, lsn, out.next_seq);
        let Some((at, (len, records))) = batch else {
            out.stop = format!("no valid batch with sequence {} at lsn {lsn}", out.next_seq);
            return out;
        };
        // Replay writes a data record's bytes at its address: one that is not in the data
        // area (the superblocks, the log itself, past the end) makes the batch invalid.
        if let Some(bad) = records
            .iter()
            .filter(|r| r.is_data())
            .find_map(|r| bad_data_address(sb, r))
        {
            out.stop = format!("batch {} has {bad}", out.next_seq);
            out.rejected_at = Some(sb.log_start + at % sb.log_bytes);
            out.followed_by =
                find_batch(device, sb, at + len, out.next_seq + 1).map(|_| out.next_seq + 1);
            return out;
        }
        // Only records replay will apply need their data: older ones are covered by the commit
        // and their blocks may have been reused since. A block a data record of this batch or
        // an earlier one carries is checked against those bytes (replay writes them there).
        for r in records
            .iter()
            .filter(|r| r.generation > sb.generation && r.is_data())
        {
            if let Some(bytes) = &r.value {
                for (n, block) in bytes.chunks(BLOCK_SIZE as usize).enumerate() {
                    let at = r.key.offset + n as u64 * BLOCK_SIZE;
                    placed.insert(at, birch_format::checksum(block));
                }
            }
        }
        if let Some(bad) = records
            .iter()
            .filter(|r| r.generation > sb.generation)
            .find_map(|r| bad_data(device, r, &placed))
        {
            out.stop = format!("batch {} references {bad}", out.next_seq);
            out.rejected_at = Some(sb.log_start + at % sb.log_bytes);
            out.followed_by =
                find_batch(device, sb, at + len, out.next_seq + 1).map(|_| out.next_seq + 1);
            return out;
        }
        out.records.extend(records);
        out.batches += 1;
        read_total += len;
        lsn = at + len;
        out.tail_lsn = Lsn::new(lsn);
        out.next_seq += 1;
    }
}

/// The batch with sequence `seq` that the writer put at `lsn` or where it skips to from
/// there: to the next lap when a batch would straddle the end, and with `INCOMPAT_LOG_ALIGNED`
/// to the next boundary of the device's atomic unit when a batch would cross one. A batch is
/// taken only where its header names that very lsn and the expected sequence, so trying
/// several places never takes a stale one.
fn find_batch(
    device: &dyn BlockDevice,
    sb: &Superblock,
    lsn: u64,
    seq: u64,
) -> Option<(u64, (u64, Vec<LogRecord>))> {
    let next_lap = (lsn / sb.log_bytes + 1) * sb.log_bytes;
    let aligned = sb.incompat & INCOMPAT_LOG_ALIGNED != 0;
    read_batch(device, sb, lsn, seq)
        .or_else(|| {
            if !aligned {
                return None;
            }
            unit_boundaries(sb, lsn, next_lap).find_map(|at| read_batch(device, sb, at, seq))
        })
        .or_else(|| {
            if lsn % sb.log_bytes == 0 {
                return None;
            }
            read_batch(device, sb, next_lap, seq).or_else(|| {
                if !aligned {
                    return None;
                }
                unit_boundaries(sb, next_lap, next_lap + sb.log_bytes)
                    .find_map(|at| read_batch(device, sb, at, seq))
            })
        })
}

/// The log positions after `lsn` and before `next_lap` where a batch skipped to the next
/// boundary of an atomic unit would start: for each power of two from 16 KiB up to the
/// area's size, the first multiple of it in device offsets past `lsn`'s, in increasing order.
fn unit_boundaries(sb: &Superblock, lsn: u64, next_lap: u64) -> impl Iterator<Item = u64> {
    let at = sb.log_start + lsn % sb.log_bytes;
    let mut found: Vec<u64> = (14..64)
        .map(|shift| 1u64 << shift)
        .take_while(|unit| *unit <= sb.log_bytes)
        .map(|unit| lsn + (unit - at % unit))
        .filter(|b| *b < next_lap)
        .collect();
    found.sort_unstable();
    found.dedup();
    found.into_iter()
}

/// A description of a data record whose blocks are not all inside the data area: block
/// aligned, past the reserved head, clear of the log area, inside the image.
fn bad_data_address(sb: &Superblock, record: &LogRecord) -> Option<String> {
    let at = record.key.offset;
    let len = record.value.as_ref().map_or(0, |v| v.len() as u64);
    let end = at.checked_add(len);
    let log_end = sb.log_start.saturating_add(sb.log_bytes);
    let inside = at % BLOCK_SIZE == 0
        && at >= birch_format::superblock::RESERVED_HEAD_BYTES
        && end.is_some_and(|end| end <= sb.total_bytes && (end <= sb.log_start || at >= log_end));
    (!inside).then(|| {
        format!(
            "a data record of inode {} for {len} bytes at {at:#x}, outside the data area",
            record.key.objectid
        )
    })
}

/// Reads and verifies the batch at `lsn`, which must carry sequence `seq`.
fn read_batch(
    device: &dyn BlockDevice,
    sb: &Superblock,
    lsn: u64,
    seq: u64,
) -> Option<(u64, (u64, Vec<LogRecord>))> {
    let offset = lsn % sb.log_bytes;
    let mut first = vec![0u8; BLOCK_SIZE as usize];
    device.read_at(&mut first, sb.log_start + offset).ok()?;
    let header = decode_header(&first)?;
    let len = u64::from(header.len_bytes);
    if header.fsid != sb.fsid
        || header.seq != seq
        || header.lsn != lsn
        || len == 0
        || len % BLOCK_SIZE != 0
        || offset + len > sb.log_bytes
    {
        return None;
    }
    let mut bytes = vec![0u8; len as usize];
    device.read_at(&mut bytes, sb.log_start + offset).ok()?;
    let (_, records) = decode_batch(&bytes).ok()?;
    Some((lsn, (len, records)))
}

/// A description of the first data block of a record's extent whose checksum fails; a block
/// in `placed` (address → checksum of the bytes a data record carries for it) is checked
/// against those.
fn bad_data(
    device: &dyn BlockDevice,
    record: &LogRecord,
    placed: &HashMap<u64, u32>,
) -> Option<String> {
    if record.key.kind() != Some(ItemType::ExtentData) {
        return None;
    }
    let value = record.value.as_ref()?;
    let extent = FileExtent::decode(value).ok()?;
    let (disk_addr, csums) = match extent.kind {
        ExtentKind::Regular { disk_addr, csums } => (disk_addr, csums),
        // No block with a checksum: inline bytes are in the record, preallocated blocks read
        // as zeros.
        ExtentKind::Inline(_) | ExtentKind::Prealloc { .. } => return None,
    };
    let mut block = vec![0u8; BLOCK_SIZE as usize];
    for (n, want) in csums.iter().enumerate() {
        let at = disk_addr + n as u64 * BLOCK_SIZE;
        let sum = match placed.get(&at) {
            Some(sum) => Some(*sum),
            None => device
                .read_at(&mut block, at)
                .ok()
                .map(|()| birch_format::checksum(&block)),
        };
        if sum != Some(*want) {
            return Some(format!(
                "data block {at:#x} of {} that fails its checksum",
                record.key
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use birch_format::{ItemType, Key};

    use super::*;
    use crate::device::MemDevice;
    use crate::{Filesystem, MkfsOptions};

    fn record(generation: u64, bytes: usize) -> LogRecord {
        LogRecord {
            generation,
            key: Key::new(300, ItemType::InodeItem, 0),
            value: Some(vec![7; bytes]),
        }
    }

    /// A batch the log refuses (too large) drops its records; an fsync whose earlier records
    /// were in it but that waits on a later, written batch must still hear `Full` (and commit)
    /// until a durable commit covers the refused records.
    #[test]
    fn after_a_refused_batch_waits_are_full_until_a_commit_covers_it() -> Result<()> {
        let dev = Arc::new(MemDevice::new(64 << 20));
        Filesystem::mkfs(dev.clone(), &MkfsOptions::default())?;
        let fs = Filesystem::open_device(dev.clone(), Default::default())?;
        let mut sb = fs.engine().superblock();
        sb.log_bytes = 8 * BLOCK_SIZE;
        let log = FsyncLog::new(&sb, Lsn::new(sb.log_head), 1);
        let counters = fs.engine().counters();
        let refused = log.enqueue(vec![record(5, 5 * BLOCK_SIZE as usize)]);
        assert_eq!(log.wait(&*dev, counters, refused)?, LogOutcome::Full);
        let later = log.enqueue(vec![record(6, 10)]);
        assert_eq!(log.wait(&*dev, counters, later)?, LogOutcome::Full);
        // A durable commit of generation 6 covers the refused records.
        log.retire(Generation::new(6));
        log.set_reusable(Lsn::new(sb.log_head));
        let after = log.enqueue(vec![record(7, 10)]);
        assert_eq!(log.wait(&*dev, counters, after)?, LogOutcome::Logged);
        Ok(())
    }

    /// With an atomic unit, a batch that fits in one unit never crosses a boundary of it (in
    /// device offsets, whatever the log area's start); a larger one, or one without a unit,
    /// goes where the last ended; none straddles the end of the area.
    #[test]
    fn batches_skip_to_the_next_unit_boundary_rather_than_cross_it() {
        let dev = Arc::new(MemDevice::new(64 << 20));
        Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
        let fs = Filesystem::open_device(dev, Default::default()).expect("open");
        let mut sb = fs.engine().superblock();
        sb.log_start = 160 * 1024; // not a multiple of the unit
        sb.log_bytes = 1 << 20;
        let log = FsyncLog::new(&sb, Lsn::new(0), 1);
        let unit = 64 * 1024;
        // No unit yet: only the end of the area matters.
        assert_eq!(log.place_batch(20 * 1024, 16 * 1024), 20 * 1024);
        log.set_align(3 * 4096); // not a power of two: ignored
        assert_eq!(log.place_batch(20 * 1024, 16 * 1024), 20 * 1024);
        log.set_align(unit);
        // Device offset 180 KiB; 16 KiB would cross 192 KiB: skip to lsn 32 KiB.
        assert_eq!(log.place_batch(20 * 1024, 16 * 1024), 32 * 1024);
        // Ends exactly at the boundary: stays.
        assert_eq!(log.place_batch(16 * 1024, 16 * 1024), 16 * 1024);
        // Larger than a unit: stays where it is.
        assert_eq!(log.place_batch(20 * 1024, 2 * unit), 20 * 1024);
        // Larger than half the area (refused by the writer) or than the area: never moved,
        // where it used to wrap from lap to lap for ever.
        assert_eq!(log.place_batch(20 * 1024, sb.log_bytes + 4096), 20 * 1024);
        assert_eq!(
            log.place_batch(20 * 1024, sb.log_bytes / 2 + 4096),
            20 * 1024
        );
        for lsn in (0..(3u64 << 20)).step_by(4096) {
            for len in [4096u64, 12288, 32768, unit] {
                let at = log.place_batch(lsn, len);
                let dev = sb.log_start + at % sb.log_bytes;
                assert!(at >= lsn, "{lsn} {len}");
                assert_eq!(dev / unit, (dev + len - 1) / unit, "{lsn} {len} at {at}");
                assert!(
                    at % sb.log_bytes + len <= sb.log_bytes,
                    "{lsn} {len} at {at}"
                );
            }
        }
    }

    /// Whatever the area's start and size, the unit, the tail and the batch's length, the
    /// position the writer picks is one replay finds: a batch written by the log at a tail
    /// reads back from that tail (two bugs this caught: a skip past the end of the area used
    /// to land where replay never looks, and a batch longer than the area used to spin the
    /// leader for ever).
    #[test]
    fn replay_finds_every_batch_wherever_the_writer_placed_it() -> Result<()> {
        let dev = Arc::new(MemDevice::new(80 << 20));
        Filesystem::mkfs(dev.clone(), &MkfsOptions::default())?;
        let fs = Filesystem::open_device(dev.clone(), Default::default())?;
        let counters = fs.engine().counters();
        let base = fs.engine().superblock();
        let mut case = 0u64;
        let mut written = 0;
        for unit in [16u64 << 10, 64 << 10, 4 << 20] {
            for log_bytes in [8060u64 << 10, 1 << 20, 6 << 20] {
                let mut sb = base.clone();
                sb.log_start = 128 << 10;
                sb.log_bytes = log_bytes;
                sb.incompat |= INCOMPAT_LOG_ALIGNED;
                let log_end = sb.log_start + log_bytes;
                // Tails near the unit boundaries of the area, near its end, and around laps.
                let mut tails = Vec::new();
                for lap in 0..2u64 {
                    for back in [0u64, 4096, 12288, 40960, 262144] {
                        let ends = [log_end, sb.log_start + unit - sb.log_start % unit];
                        for end in ends {
                            let off = end.saturating_sub(back).max(sb.log_start) - sb.log_start;
                            tails.push(lap * log_bytes + off % log_bytes);
                        }
                    }
                }
                for tail in tails {
                    for len in [4000usize, 15000, 60000, 300_000, 5 << 20] {
                        case += 1;
                        sb.fsid[..8].copy_from_slice(&case.to_le_bytes());
                        let log = FsyncLog::new(&sb, Lsn::new(tail), 7);
                        log.set_reusable(Lsn::new(tail));
                        log.set_align(unit);
                        // Records of an item's size: a batch of about `len` bytes.
                        let records: Vec<LogRecord> = (0..len.div_ceil(1000))
                            .map(|n| LogRecord {
                                generation: 5,
                                key: Key::new(300 + n as u64, ItemType::InodeItem, 0),
                                value: Some(vec![7; 1000]),
                            })
                            .collect();
                        let ticket = log.enqueue(records);
                        let outcome = log.wait(&*dev, counters, ticket)?;
                        if outcome == LogOutcome::Full {
                            continue;
                        }
                        let mut from = sb.clone();
                        from.log_head = tail;
                        from.log_generation = 7;
                        let replay = read_log(&*dev, &from);
                        assert_eq!(
                            replay.batches, 1,
                            "unit {unit} area {log_bytes} tail {tail} len {len}: {}",
                            replay.stop
                        );
                        written += 1;
                    }
                }
            }
        }
        assert!(written > 300, "{written} of {case} cases written");
        Ok(())
    }

    /// Replay writes a data record's bytes at its address: a batch whose data record names
    /// the superblocks, the log area or a place past the image is invalid, and replay stops
    /// before it instead of overwriting them.
    #[test]
    fn a_data_record_outside_the_data_area_stops_the_replay() -> Result<()> {
        let dev = Arc::new(MemDevice::new(64 << 20));
        Filesystem::mkfs(dev.clone(), &MkfsOptions::default())?;
        let (sb, _) = crate::txn::Engine::read_superblock(&*dev)?;
        let block = vec![9u8; BLOCK_SIZE as usize];
        for at in [
            0,
            sb.log_start,
            sb.total_bytes,
            u64::MAX - BLOCK_SIZE + 1,
            birch_format::superblock::RESERVED_HEAD_BYTES + 1,
        ] {
            let records = vec![LogRecord::data(sb.generation + 1, 300, at, block.clone())];
            let bytes = encode_batch(sb.fsid, sb.log_generation, sb.log_head, &records);
            dev.write_at(&bytes, sb.log_start + sb.log_head % sb.log_bytes)
                .map_err(|e| Error::io("write the batch", e))?;
            let replay = read_log(&*dev, &sb);
            assert!(
                replay.records.is_empty() && replay.stop.contains("outside the data area"),
                "{at:#x}: {}",
                replay.stop
            );
        }
        Ok(())
    }
}
