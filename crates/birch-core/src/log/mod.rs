//! The fsync log: one write and one flush per fsync, shared by concurrent fsyncs.
//!
//! Owns: placing batches in the circular log area, group commit (the first fsync that finds no
//! batch in flight becomes the leader, writes everything queued so far as one batch, flushes
//! once, and wakes every fsync whose records it carried), retiring batches once a commit covers
//! them, and reading the log back for replay. The group-commit protocol itself (tickets, the
//! leader, deferred waits, the lock and condition variables) is `group`'s (`log/group.rs`);
//! this module is its `Writer` (taking the queue, encoding and placing a batch, whether it
//! fits, the write and the flush) and keeps its position and queue under the protocol's lock.
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

use crate::counters::Counters;
use crate::device::BlockDevice;
use crate::error::{Error, Result};
use crate::pending::PendingData;
use crate::readonly::ReadOnlyCause;

mod group;

pub use group::HandOff;
use group::{Answer, Deferral, GroupCommit, Writer};

/// A batch written and not yet retired by a commit.
#[derive(Debug, Clone, Copy)]
struct LiveBatch {
    lsn: Lsn,
    seq: u64,
    max_generation: Generation,
}

/// What the log keeps under the group-commit protocol's lock: its position in the area and
/// the records queued for the next batch.
struct LogQueue {
    /// Next byte position to write at.
    tail_lsn: Lsn,
    next_seq: u64,
    /// Space before this position may be overwritten (a durable superblock starts past it).
    reusable_lsn: Lsn,
    live: VecDeque<LiveBatch>,
    /// Records queued for the next batch.
    queued: Vec<LogRecord>,
    /// Where each key's record sits in `queued`: a later record of a key replaces the earlier
    /// one in place (replay would apply both in order; only the last value survives).
    queued_at: HashMap<Key, usize>,
}

/// What a deferred wait calls with its outcome ([`FsyncLog::defer`]).
pub type Deferred = Box<dyn FnOnce(Result<LogOutcome>) + Send>;

impl Deferral for Deferred {
    fn answer(self, answer: Answer) {
        self(outcome(answer))
    }
}

/// The outcome a wait returns for the protocol's answer.
fn outcome(answer: Answer) -> Result<LogOutcome> {
    match answer {
        Answer::Logged => Ok(LogOutcome::Logged),
        Answer::Full => Ok(LogOutcome::Full),
        Answer::Failed(error) => Err(Error::ReadOnly(ReadOnlyCause::LogWriteFailed { error })),
        Answer::Shutdown => Err(Error::Shutdown),
    }
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
    /// Tickets, leader, deferred waits (`group`), over the log's position and queue.
    group: GroupCommit<LogQueue, Deferred>,
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

/// A batch taken from the queue: its records and where the log stood.
struct Taken {
    records: Vec<LogRecord>,
    seq: u64,
    tail_lsn: u64,
}

/// A batch encoded for where it goes.
struct Encoded {
    records: Vec<LogRecord>,
    seq: u64,
    lsn: u64,
    bytes: Vec<u8>,
    max_generation: Generation,
}

/// The leader's device work for one wait: [`FsyncLog`]'s side of [`GroupCommit`].
struct LogWriter<'a> {
    log: &'a FsyncLog,
    device: &'a dyn BlockDevice,
    counters: &'a Counters,
}

impl Writer for LogWriter<'_> {
    type Queue = LogQueue;
    type Taken = Taken;
    type Batch = Encoded;
    /// Bytes of placed data blocks written with the batch.
    type Written = u64;

    fn take(&self, q: &mut LogQueue) -> Option<Taken> {
        let records = std::mem::take(&mut q.queued);
        q.queued_at.clear();
        if records.is_empty() {
            return None;
        }
        Some(Taken {
            records,
            seq: q.next_seq,
            tail_lsn: q.tail_lsn.get(),
        })
    }

    fn encode(&self, taken: Taken) -> Encoded {
        // Only the leader moves the tail and the sequence, and the reusable point only grows.
        let log = self.log;
        let Taken {
            records,
            seq,
            tail_lsn,
        } = taken;
        let max_generation =
            Generation::new(records.iter().map(|r| r.generation).max().unwrap_or(0));
        let mut bytes = encode_batch(log.fsid, seq, tail_lsn, &records);
        let len = bytes.len() as u64;
        let lsn = log.place_batch(tail_lsn, len);
        if lsn != tail_lsn {
            bytes = encode_batch(log.fsid, seq, lsn, &records);
            if lsn % log.bytes != 0 {
                self.counters.add(|c| &c.log_aligned_skips, 1);
            }
        }
        Encoded {
            records,
            seq,
            lsn,
            bytes,
            max_generation,
        }
    }

    fn fits(&self, q: &LogQueue, batch: &Encoded) -> std::result::Result<(), u64> {
        let reusable_lsn = q.reusable_lsn.get();
        let (lsn, len, area) = (batch.lsn, batch.bytes.len() as u64, self.log.bytes);
        let fits = lsn + len - reusable_lsn <= area && len <= area / 2;
        if fits {
            Ok(())
        } else {
            Err(batch.max_generation.get())
        }
    }

    fn write(&self, batch: &Encoded) -> std::result::Result<u64, String> {
        // The batch and the placed blocks it names go in one submission (one round trip),
        // then one flush. They may land in any order: replay checks every block an extent
        // record of a batch names and stops at the first batch that fails, and that can
        // only be this one, which no fsync was told is durable (one batch in flight).
        let log = self.log;
        let at = log.start + batch.lsn % log.bytes;
        log.placed
            .write_named_with(self.device, &batch.records, (at, &batch.bytes))
            .and_then(|placed| self.device.flush().map(|()| placed))
            .map_err(|e| format!("write or flush of batch {} at {at:#x}: {e}", batch.seq))
    }

    fn written(&self, q: &mut LogQueue, batch: Encoded, placed: u64) {
        let counters = self.counters;
        let len = batch.bytes.len() as u64;
        counters.add(|c| &c.log_placed_written, placed / BLOCK_SIZE);
        q.live.push_back(LiveBatch {
            lsn: Lsn::new(batch.lsn),
            seq: batch.seq,
            max_generation: batch.max_generation,
        });
        q.tail_lsn = Lsn::new(batch.lsn + len);
        q.next_seq = batch.seq + 1;
        counters.add(|c| &c.log_batches, 1);
        counters.add(|c| &c.log_records, batch.records.len() as u64);
        counters.add(|c| &c.log_bytes, len);
    }
}

impl FsyncLog {
    /// A log continuing after `tail_lsn` / `next_seq` (the end of what replay read), with
    /// space before `head_lsn` reusable.
    pub fn new(sb: &Superblock, tail_lsn: Lsn, next_seq: u64) -> FsyncLog {
        FsyncLog {
            group: GroupCommit::new(LogQueue {
                tail_lsn,
                next_seq,
                reusable_lsn: Lsn::new(sb.log_head),
                live: VecDeque::new(),
                queued: Vec::new(),
                queued_at: HashMap::new(),
            }),
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
        let used = self.group.with_queue(|q| {
            q.tail_lsn
                .get()
                .saturating_sub(q.reusable_lsn.get())
                .min(self.bytes)
        });
        (used, self.bytes)
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
        self.group.enqueue(|q| {
            if self.bytes == 0 {
                return;
            }
            for record in records {
                match q.queued_at.get(&record.key) {
                    Some(&at) => q.queued[at] = record,
                    None => {
                        q.queued_at.insert(record.key, q.queued.len());
                        q.queued.push(record);
                    }
                }
            }
        })
    }

    /// Waits until the batch of `ticket` is durable, leading the write if no one else is.
    /// A leader also answers the deferred waits ([`FsyncLog::defer`]) its batches decide.
    pub fn wait(
        &self,
        device: &dyn BlockDevice,
        counters: &Counters,
        ticket: u64,
    ) -> Result<LogOutcome> {
        if self.bytes == 0 {
            return Ok(LogOutcome::Full);
        }
        let writer = LogWriter {
            log: self,
            device,
            counters,
        };
        outcome(self.group.run(&writer, ticket, false))
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
        self.group.defer(ticket, done)
    }

    /// Leads batches until no deferred wait is left unanswered (or another leader took over),
    /// answering them. What a [`FsyncLog::defer`] that returned true asks for.
    pub fn lead(&self, device: &dyn BlockDevice, counters: &Counters) -> Result<LogOutcome> {
        if self.bytes == 0 {
            return Ok(LogOutcome::Full);
        }
        let writer = LogWriter {
            log: self,
            device,
            counters,
        };
        outcome(self.group.lead(&writer))
    }

    /// Sets how a waiter whose own wait is answered hands the leading of deferred waits over
    /// (it must arrange a call of [`FsyncLog::lead`] on a thread that may block, such as a
    /// worker of the FUSE adapter's pool). Without it such a waiter leads on itself.
    pub fn set_hand_off(&self, hand_off: HandOff) {
        self.group.set_hand_off(hand_off);
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
        self.group.abandon_deferred();
    }

    /// Why the log failed (a batch's write or flush), if it did: every wait answers an error.
    pub fn failure(&self) -> Option<String> {
        self.group.failure()
    }

    /// Called by commit `generation` before it writes its superblock: drops the batches the
    /// commit covers and returns where the live log starts (lsn, seq).
    pub fn retire(&self, generation: Generation) -> (Lsn, u64) {
        self.group.retire(generation.get(), |q| {
            while q
                .live
                .front()
                .is_some_and(|b| b.max_generation <= generation)
            {
                q.live.pop_front();
            }
            match q.live.front() {
                Some(b) => (b.lsn, b.seq),
                None => (q.tail_lsn, q.next_seq),
            }
        })
    }

    /// Called once the superblock naming `head_lsn` is durable: space before it is reusable,
    /// and queued records the commit covers (generation at most the retiring commit's) are
    /// dropped: replay would skip them, and the durable tree holds their values or newer.
    pub fn set_reusable(&self, head_lsn: Lsn) {
        self.group.set_reusable(|q, covered| {
            q.reusable_lsn = q.reusable_lsn.max(head_lsn);
            if q.queued.iter().any(|r| r.generation <= covered) {
                q.queued.retain(|r| r.generation > covered);
                q.queued_at.clear();
                for (at, r) in q.queued.iter().enumerate() {
                    q.queued_at.insert(r.key, at);
                }
            }
        });
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
            let stop = format!("batch {} has {bad}", out.next_seq);
            return rejected(out, device, sb, (at, len), stop);
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
            let stop = format!("batch {} references {bad}", out.next_seq);
            return rejected(out, device, sb, (at, len), stop);
        }
        out.records.extend(records);
        out.batches += 1;
        read_total += len;
        lsn = at + len;
        out.tail_lsn = Lsn::new(lsn);
        out.next_seq += 1;
    }
}

/// Ends a read at the batch at lsn `at` (`len` bytes), which verified but is rejected for
/// `stop`: where it is, and whether a valid batch follows it ([`Replay::followed_by`]).
fn rejected(
    mut out: Replay,
    device: &dyn BlockDevice,
    sb: &Superblock,
    (at, len): (u64, u64),
    stop: String,
) -> Replay {
    out.stop = stop;
    out.rejected_at = Some(sb.log_start + at % sb.log_bytes);
    let next = out.next_seq + 1;
    out.followed_by = find_batch(device, sb, at + len, next).map(|_| next);
    out
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
        // A blob's stored blocks, each with its crc32c, as a regular extent's.
        ExtentKind::Blob(blob) => (blob.disk_addr, blob.csums),
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
