//! fsync and fdatasync through the log, replay at mount, and the fallbacks to a full commit.
//!
//! What an fsync of inode I logs (btrfs tree-log rules, kept small):
//! - every item of I changed since the last durable commit, from memory (the delta), deleted
//!   items as deletions: the inode item itself, extents (whose data blocks were written at
//!   write time, so the log's one flush makes them durable too), xattrs, inode refs;
//! - for each name of I in those refs, the parent's dir item and dir index, so a new file's
//!   name survives with it;
//! - when a name was added, the deletion of I's committed orphan item (a tmpfile committed
//!   without a name and linked since).
//!
//! fdatasync leaves out the inode item when only its timestamps changed since it was last
//! logged or committed (an overwrite in place): size, block count and mode, which reading the
//! data back needs, always go.
//!
//! Synchronous writes (O_DIRECT|O_SYNC, answered by a write then an fsync) do not scan: once an
//! fsync has queued everything of an inode, the inode is *log-clean* (its inode item is
//! remembered, [`Filesystem::log_clean_ticket`]); a block-aligned write to a log-clean inode
//! queues only what it changed (the extent items of its range and the inode item,
//! [`Filesystem::log_write`]) and keeps it clean, and the fsync after it finds the inode clean
//! and only waits for the batch. So each such write costs one data write and a share of one
//! batch write and flush, whatever the number of extents the inode changed since the commit.
//! A SETATTR of times only (the kernel's mtime and ctime before each FSYNC under the writeback
//! cache) to a log-clean inode queues its inode item the same way and keeps it clean.
//!
//! A name taken by a new file after its previous holder was unlinked and freed (SQLite's
//! rollback journal, deleted and created again for every transaction; an editor or mail
//! spool rewriting a file under its name) does not commit: replay would find the previous
//! inode's entry under the name's dir item, so the fsync logs that inode's deletion in the
//! same batch, before the new entry ([`Filesystem::gone_records`]): its changed items (all
//! deletions), its orphan item, and the dir index of its name as replay would start from it.
//!
//! When logging cannot be safe, fsync commits instead: each case is a named rule,
//! [`CommitReason`] (`fsync_rules.rs`, DESIGN §11.3), with its counter and its test.
//!
//! Replay applies, in log order, the records of generations after the superblock's, then
//! recomputes link counts, directory sizes and next indexes of what it touched, and commits.

#![deny(clippy::too_many_lines)]

use std::collections::{BTreeSet, HashMap};

use birch_format::items::{decode_dir_entries, decode_inode_refs, FileExtent, InodeItem, InodeRef};
use birch_format::log::LogRecord;
use birch_format::superblock::INCOMPAT_LOG_DATA;
use birch_format::{InodeNo, ItemType, Key, ORPHAN_OBJECTID};

use super::fsync_rules::CommitReason;
use super::{log_clean_key, Filesystem, InodeState, Logged};
use crate::counters::Counters;
use crate::error::{Error, Result};
use crate::items::{self, dir_index_key, dir_item_key, inode_key, orphan_key};
use crate::log::LogOutcome;

/// The largest write whose bytes go to the fsync log in data records (a write to a log-clean
/// file, DESIGN §11.1): larger ones are written in place, as logging them would write their
/// bytes twice for little saving (ZFS's `zfs_immediate_write_sz` is the same choice).
pub(crate) const LOG_DATA_WRITE_MAX: usize = 32 * 1024;

/// Placed data blocks (allocated, bytes in memory, not yet written in place: DESIGN §11.1)
/// beyond which small writes to log-clean files are written in place again: 64 MiB.
pub(crate) const PLACED_MAX_BLOCKS: usize = 16384;

/// What a deferred fsync calls with its outcome ([`Filesystem::fsync_defer`]).
pub type FsyncDone = Box<dyn FnOnce(Result<DeferredOutcome>) + Send>;

/// How a deferred fsync ended ([`Filesystem::fsync_defer`]).
#[derive(Debug, PartialEq, Eq)]
pub enum DeferredOutcome {
    /// Durable through the log: answer it.
    Logged,
    /// The log had no room: hand this to [`Filesystem::fsync_after_full`] (a commit, which
    /// blocks) and answer with its result.
    LogFull(LogFull),
}

/// A deferred fsync the log had no room for. It carries the fsync's start, so the latency
/// sample [`Filesystem::fsync_after_full`] takes covers the whole fsync (the wait for the log
/// and the commit), as every other fsync's sample does.
#[derive(Debug, PartialEq, Eq)]
pub struct LogFull {
    started: std::time::Instant,
}

/// How fsync makes a file durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FsyncMode {
    /// Through the fsync log: one write and one flush, shared by concurrent fsyncs.
    #[default]
    Log,
    /// A full commit of everything (the seeds' "before").
    Commit,
}

/// Why an fsync's records were not collected: a rule says commit, or an error.
enum Refusal {
    Commit(CommitReason),
    Failed(Error),
}

impl From<CommitReason> for Refusal {
    fn from(reason: CommitReason) -> Self {
        Refusal::Commit(reason)
    }
}

impl From<Error> for Refusal {
    fn from(e: Error) -> Self {
        Refusal::Failed(e)
    }
}

/// What collecting an fsync's records gives: the records, or why there are none.
type Collected<T> = std::result::Result<T, Refusal>;

/// What changed of an inode renamed away since replay's base ([`Filesystem::moved_records`]).
#[derive(Default)]
struct Moved {
    /// Its inode item now, when it changed (in its times alone).
    inode_item: Option<Vec<u8>>,
    /// Its inode refs that changed, as they are now.
    ref_changes: Vec<(Key, Option<Vec<u8>>)>,
    /// Its names in replay's base, as (parent, name, dir index).
    before: Vec<(u64, Vec<u8>, u64)>,
    /// Its names now.
    now: Vec<(u64, Vec<u8>, u64)>,
}

impl Filesystem {
    /// fsync / fdatasync: makes the file's data and metadata durable. Reports EIO for ever
    /// after a failed write of this file. Holds no inode lock while the device flushes.
    pub fn fsync(&self, ino: InodeNo, datasync: bool) -> Result<()> {
        let ino = ino.get();
        if self.snap_node(ino).is_some() {
            // A snapshot is durable since its commit.
            return Ok(());
        }
        let started = std::time::Instant::now();
        let result = self.fsync_body(ino, datasync);
        self.inner.engine.fsync_latency().record(started.elapsed());
        result
    }

    /// [`Filesystem::fsync`] of a log-clean inode without blocking: when everything of
    /// `ino` is queued in the fsync log already (and nothing is buffered, and no write
    /// failed), defers the wait (`crate::txn::LogHandle::defer`) and returns
    /// `Ok(lead)`: `done` then gets the outcome from whichever thread learns it, and with
    /// `lead` set the caller must call [`Filesystem::fsync_lead`] with it on a thread that may
    /// block. `done` hears [`DeferredOutcome::LogFull`] when the log had no room: the caller
    /// must then call [`Filesystem::fsync_after_full`] (a commit) with it before it answers.
    /// Otherwise, `Err(done)`: the caller runs [`Filesystem::fsync`].
    ///
    /// Why (DESIGN §11.4): with 64 threads that write and fsync, most fsyncs find their records
    /// queued by the write before them; parking a thread per such fsync costs two context
    /// switches and a thread, where the batch's leader can answer them all.
    pub fn fsync_defer(
        &self,
        ino: InodeNo,
        datasync: bool,
        done: FsyncDone,
    ) -> std::result::Result<Option<u64>, FsyncDone> {
        let ino = ino.get();
        if self.inner.fsync_mode != FsyncMode::Log
            || self.snap_node(ino).is_some()
            || self.fsync_after_failure().is_err()
        {
            return Err(done);
        }
        let Ok(state) = self.inode(ino) else {
            return Err(done);
        };
        let ticket = {
            let data = state.data.read();
            if data.write_error || !data.dirty.is_empty() {
                return Err(done);
            }
            match self.log_clean_ticket(ino, &state, datasync) {
                Ok(Some(ticket)) => ticket,
                _ => return Err(done),
            }
        };
        let engine = &self.inner.engine;
        let counters = engine.counters();
        counters.add(|c| &c.fsyncs, 1);
        counters.add(|c| &c.fsync_clean, 1);
        counters.add(|c| &c.fsync_deferred, 1);
        let started = std::time::Instant::now();
        let inner = self.inner.clone();
        let lead = engine.log().defer(
            ticket,
            Box::new(move |outcome| {
                let engine = &inner.engine;
                let outcome = match outcome {
                    // Sampled by `fsync_after_full` once its commit is done: the whole fsync.
                    Ok(LogOutcome::Full) => {
                        return done(Ok(DeferredOutcome::LogFull(LogFull { started })));
                    }
                    Ok(LogOutcome::Logged) => {
                        engine.counters().add(|c| &c.fsync_log, 1);
                        Ok(DeferredOutcome::Logged)
                    }
                    Err(e) => Err(e),
                };
                engine.fsync_latency().record(started.elapsed());
                done(outcome)
            }),
        );
        Ok(lead.then_some(ticket))
    }

    /// Leads the log batch of a deferred fsync's `ticket` ([`Filesystem::fsync_defer`]
    /// returned it): its outcome goes to the deferred fsyncs' callbacks.
    pub fn fsync_lead(&self, ticket: u64) {
        let _ = self.inner.engine.log().wait(ticket);
    }

    /// Leads log batches until no deferred fsync is left waiting: the hand-off a caller of
    /// [`Filesystem::fsync_defer`] sets with [`Filesystem::set_fsync_hand_off`] runs this.
    pub fn fsync_lead_deferred(&self) {
        self.inner.engine.log().lead();
    }

    /// How a thread whose own fsync is answered hands the leading of deferred fsyncs over:
    /// `hand_off` must arrange a call of [`Filesystem::fsync_lead_deferred`] on a thread that
    /// may block. Without it that thread leads on itself. The log keeps `hand_off` as long as
    /// the filesystem lives: it must not own the filesystem (hold a `Weak`).
    pub fn set_fsync_hand_off(&self, hand_off: crate::log::HandOff) {
        self.inner.engine.log().set_hand_off(hand_off);
    }

    /// The commit a deferred fsync makes when the log had no room for it. Its latency sample
    /// runs from the fsync's start ([`Filesystem::fsync_defer`]) to the commit's end.
    pub fn fsync_after_full(&self, full: LogFull) -> Result<()> {
        let result = self.fsync_commit_for(CommitReason::LogFull);
        self.inner
            .engine
            .fsync_latency()
            .record(full.started.elapsed());
        result
    }

    /// [`Filesystem::fsync`] without the latency sample: the file's buffered data, then the
    /// log unless a rule ([`CommitReason`]) says commit.
    fn fsync_body(&self, ino: u64, datasync: bool) -> Result<()> {
        self.fsync_after_failure()?;
        let state = self.inode(ino)?;
        self.fsync_flush(ino, &state)?;
        let counters = self.inner.engine.counters();
        counters.add(|c| &c.fsyncs, 1);
        if let Some(reason) = self.mode_rule() {
            return self.fsync_commit_for(reason);
        }
        let ticket = match self.fsync_enqueue(ino, &state, datasync) {
            Ok(Some(ticket)) => ticket,
            Ok(None) => {
                counters.add(|c| &c.fsync_nothing, 1);
                return Ok(());
            }
            Err(Refusal::Commit(reason)) => return self.fsync_commit_for(reason),
            Err(Refusal::Failed(e)) => return Err(e),
        };
        match self.inner.engine.log().wait(ticket)? {
            LogOutcome::Logged => {
                counters.add(|c| &c.fsync_log, 1);
                Ok(())
            }
            LogOutcome::Full => self.fsync_commit_for(CommitReason::LogFull),
        }
    }

    /// After a failed commit or log write (or a shutdown) no fsync may succeed, also one
    /// that finds nothing of its own to log: what it would vouch for may sit in a delta that
    /// never reaches the disk (found by the fault tests: a commit drained a file's buffered
    /// data into the failing commit, and that file's next fsync, with nothing left to log,
    /// answered success). A read-only mount or remount is not a failure: its fsyncs succeed.
    fn fsync_after_failure(&self) -> Result<()> {
        self.inner.engine.check_up()?;
        match self.inner.engine.read_only_cause() {
            Some(cause) if !cause.is_chosen() => Err(Error::ReadOnly(cause)),
            _ => Ok(()),
        }
    }

    /// [`CommitReason::CommitMode`]: the mount says every fsync commits.
    fn mode_rule(&self) -> Option<CommitReason> {
        (self.inner.fsync_mode == FsyncMode::Commit).then_some(CommitReason::CommitMode)
    }

    /// An fsync's first step: this file's buffered data (its own data only). EIO for ever
    /// after a failed write of this file.
    fn fsync_flush(&self, ino: u64, state: &InodeState) -> Result<()> {
        if state.data.read().write_error {
            return Err(Error::StickyIo(format!("inode {ino}")));
        }
        // Through the log on a device that any failed write gives up (RBD), its blocks are
        // placed: the batch's leader writes them with the batch, in one submission (one round
        // trip, not two), and replay checks every block a batch names. Otherwise they are
        // written now, so a failed write costs only this file (EIO on its fsyncs, DESIGN
        // §10.10). The device is asked first: false on image files, which then skip the log's
        // lock.
        let through_log = self.inner.fsync_mode == FsyncMode::Log
            && self.inner.engine.device().write_error_is_fatal()
            && self.inner.engine.log().fill_bytes().1 > 0;
        let flushed = if through_log {
            self.flush_inode_placed(ino, state)
        } else {
            self.flush_inode(ino, state)
        };
        flushed.map_err(|e| match e {
            Error::Io { .. } => Error::StickyIo(format!("inode {ino}: {e}")),
            other => other,
        })
    }

    /// Collects and queues what an fsync of `ino` logs, under the inode lock: a later fsync of
    /// this file, which sees later state, queues after this one, so replay applies them in
    /// order. The ticket of the batch to wait for, `None` when there is nothing to make
    /// durable, or the rule that makes the fsync commit.
    fn fsync_enqueue(
        &self,
        ino: u64,
        state: &InodeState,
        datasync: bool,
    ) -> Collected<Option<u64>> {
        let data = state.data.read();
        if let Some(ticket) = self.log_clean_ticket(ino, state, datasync)? {
            // Everything of this inode is queued already (a synchronous write logged its own
            // range, `log_write`): wait for that batch, no scan.
            self.inner.engine.counters().add(|c| &c.fsync_clean, 1);
            return Ok(Some(ticket));
        }
        if data.item.mode & libc::S_IFMT == libc::S_IFDIR {
            // Every entry that changed is queued already, by its files' fsyncs: queue the
            // directory's inode item after them and wait for it.
            let records = self.dir_log_records(ino, state)?;
            return Ok(records.map(|records| self.inner.engine.log().enqueue(records)));
        }
        let Some(records) = self.log_records(ino, state, data.item.nlink)? else {
            return Ok(None);
        };
        Ok(self.queue_fresh(ino, state, datasync, records)?)
    }

    /// Queues the part of a file's `records` this inode has not queued before, and marks the
    /// inode log-clean. The ticket to wait for, `None` when nothing was ever queued.
    ///
    /// An item queued earlier with the same value is in a batch that is durable, or will be
    /// once the ticket of that batch is, or was retired by the commit that made it durable. A
    /// queued record only counts while replay would still apply it: once a commit covers its
    /// generation, replay skips it, and the committed value may differ (changed and changed
    /// back), so it is logged again.
    fn queue_fresh(
        &self,
        ino: u64,
        state: &InodeState,
        datasync: bool,
        records: Vec<LogRecord>,
    ) -> Result<Option<u64>> {
        let engine = &self.inner.engine;
        let committed = engine.committed_generation().get();
        let mut logged = state.logged.lock();
        let mut fresh: Vec<LogRecord> = records
            .into_iter()
            .filter(|r| {
                !logged
                    .values
                    .get(&r.key)
                    .is_some_and(|(v, g)| *v == r.value && *g > committed)
            })
            .collect();
        let times_left_out =
            datasync && self.leave_out_times(ino, &logged, &mut fresh, committed)?;
        if fresh.is_empty() {
            if logged.ticket == 0 {
                return Ok(None);
            }
            self.mark_log_clean(ino, &mut logged, times_left_out)?;
            return Ok(Some(logged.ticket));
        }
        forget_committed(&mut logged, ino, committed);
        for r in &fresh {
            logged.values.insert(r.key, (r.value.clone(), r.generation));
        }
        remember_names(&mut self.inner.logged_names.lock(), ino, &fresh);
        let entries: Vec<(Key, Option<Vec<u8>>, u64)> = fresh
            .iter()
            .filter(|r| matches!(r.key.kind(), Some(ItemType::DirItem | ItemType::DirIndex)))
            .map(|r| (r.key, r.value.clone(), r.generation))
            .collect();
        let moves: Vec<LogRecord> = fresh
            .iter()
            .filter(|r| r.key.objectid != ino && is_inode_record(r))
            .cloned()
            .collect();
        let ticket = engine.log().enqueue(fresh);
        // After the enqueue: an fsync of the directory that finds these takes a ticket no
        // earlier than theirs.
        self.remember_entries(entries, committed);
        self.remember_moves(moves, committed);
        logged.ticket = ticket;
        self.mark_log_clean(ino, &mut logged, times_left_out)?;
        Ok(Some(ticket))
    }

    /// fdatasync: drops from `fresh` an inode item whose only change is its timestamps (not
    /// needed to read the data back: size, blocks and mode are). Whether it dropped it.
    fn leave_out_times(
        &self,
        ino: u64,
        logged: &Logged,
        fresh: &mut Vec<LogRecord>,
        committed: u64,
    ) -> Result<bool> {
        let engine = &self.inner.engine;
        let key = inode_key(InodeNo::new(ino));
        let before = fresh.len();
        let reference = match logged.values.get(&key) {
            Some((v, g)) if *g > committed => v.clone(),
            _ => engine.committed_get(&key)?,
        };
        fresh.retain(|r| {
            let same = match (r.value.as_deref(), reference.as_deref()) {
                (Some(new), Some(old)) => differs_only_in_times(new, old, true),
                _ => false,
            };
            r.key != key || !same
        });
        Ok(fresh.len() != before)
    }

    /// Everything changed is queued once an fsync's fresh records are (all of it but the inode
    /// item's times after an fdatasync that left those out): marks the inode log-clean as of
    /// its current inode item.
    fn mark_log_clean(&self, ino: u64, logged: &mut Logged, times_left_out: bool) -> Result<()> {
        let engine = &self.inner.engine;
        let current = engine.get(&inode_key(InodeNo::new(ino)))?;
        let generation = engine.running_generation().get();
        logged
            .values
            .insert(log_clean_key(ino, false), (current.clone(), generation));
        if !times_left_out {
            logged
                .values
                .insert(log_clean_key(ino, true), (current, generation));
        }
        Ok(())
    }

    /// The ticket of the batch that carries everything of `ino` not yet committed, when the
    /// inode is *log-clean*: every item of it changed since the last commit is queued in the
    /// log (with `data_only`, every item but the inode item's timestamps, which fdatasync
    /// leaves out). Call with the inode lock held.
    ///
    /// The witness is the inode item: an fsync that queued everything, or a write that found
    /// the inode log-clean and queued every item it changed, remembers the inode item as it
    /// was then (under [`log_clean_key`], in `Logged::values`, with the running generation).
    /// Every operation that changes any item of an inode stores its inode item, and all but
    /// such a write clear the mark as they do ([`Filesystem::unmark_log_clean`]): an equal
    /// inode item alone proves nothing, since the kernel's SETATTR can restore a ctime it owns.
    /// The mark lapses once a commit covers its generation, as queued records do.
    pub(super) fn log_clean_ticket(
        &self,
        ino: u64,
        state: &InodeState,
        data_only: bool,
    ) -> Result<Option<u64>> {
        let engine = &self.inner.engine;
        // No fsync of this inode queued anything: nothing to compare (and no tree search).
        if state.logged.lock().ticket == 0 {
            return Ok(None);
        }
        let Some(current) = engine.get(&inode_key(InodeNo::new(ino)))? else {
            return Ok(None);
        };
        let committed = engine.committed_generation().get();
        let logged = state.logged.lock();
        if logged.ticket == 0 {
            return Ok(None);
        }
        let marked = |all: bool| {
            matches!(logged.values.get(&log_clean_key(ino, all)),
                Some((Some(v), g)) if *g > committed && *v == current)
        };
        Ok((marked(true) || (data_only && marked(false))).then_some(logged.ticket))
    }

    /// A write's own part of the log: called under the inode's write lock by a write that
    /// found the inode log-clean before it changed anything ([`Filesystem::log_clean_ticket`]),
    /// with every item the write changed (the inode item last). Queues them (no I/O; the data
    /// blocks they name are written already) so the inode stays log-clean and the fsync that
    /// follows a synchronous write only waits for the batch: a synchronous write logs the range
    /// it wrote and the inode item, not the inode's whole changed-item list.
    pub(super) fn log_write(
        &self,
        ino: u64,
        state: &InodeState,
        generation: u64,
        items: Vec<(Key, Option<Vec<u8>>)>,
    ) {
        let engine = &self.inner.engine;
        let committed = engine.committed_generation().get();
        let records: Vec<LogRecord> = items
            .into_iter()
            .map(|(key, value)| LogRecord {
                generation,
                key,
                value,
            })
            .collect();
        let inode = records.last().map(|r| r.value.clone());
        let mut logged = state.logged.lock();
        forget_committed(&mut logged, ino, committed);
        for r in records.iter().filter(|r| !r.is_data()) {
            logged.values.insert(r.key, (r.value.clone(), r.generation));
        }
        logged.ticket = engine.log().enqueue(records);
        if let Some(inode) = inode {
            // The inode item went too: everything is queued, times included.
            for all in [false, true] {
                logged
                    .values
                    .insert(log_clean_key(ino, all), (inode.clone(), generation));
            }
        }
    }

    /// Whether a write may log its bytes in data records: the image's durable superblock has
    /// `INCOMPAT_LOG_DATA` (if not, asks the next commit to set it, so writes after that
    /// commit may, and answers no), and the log is less than half full (past that, data
    /// would fill it before the commit the committer was woken for frees it, and every
    /// fsync would then commit: such writes go in place until the commit).
    pub(super) fn log_data_allowed(&self) -> bool {
        let engine = &self.inner.engine;
        if !engine.incompat_durable(INCOMPAT_LOG_DATA) {
            engine.want_incompat(INCOMPAT_LOG_DATA);
            return false;
        }
        let (used, size) = engine.log().fill_bytes();
        used < size / 2
    }

    /// After a write logged data records: wakes the committer once a quarter of the log is
    /// used, so a commit writes the placed blocks and frees log space early.
    pub(super) fn log_data_room(&self) {
        let (used, size) = self.inner.engine.log().fill_bytes();
        if used > size / 4 {
            self.wake_committer();
        }
    }

    fn fsync_commit(&self) -> Result<()> {
        let counters = self.inner.engine.counters();
        counters.add(|c| &c.fsync_commits, 1);
        self.commit_now().map(|_| ())
    }

    /// The commit of an fsync that `reason` keeps from the log, counted under its rule.
    fn fsync_commit_for(&self, reason: CommitReason) -> Result<()> {
        reason.count(self.inner.engine.counters());
        self.fsync_commit()
    }

    /// The records an fsync of file `ino` writes, `None` when nothing changed since the last
    /// commit, or the rule that makes it commit: first the file's own ([`Filesystem::file_rule`]),
    /// then those of each name in its changed inode refs ([`Filesystem::name_records`]).
    fn log_records(
        &self,
        ino: u64,
        state: &InodeState,
        nlink: u32,
    ) -> Collected<Option<Vec<LogRecord>>> {
        let engine = &self.inner.engine;
        let (generation, changed) = engine.changed_items(InodeNo::new(ino));
        let generation = generation.get();
        if changed.is_empty() || self.only_atime_changed(ino, &changed) {
            // An atime-only change (relatime on read) never costs a log write.
            return Ok(None);
        }
        if let Some(reason) = self.file_rule(state, nlink, &changed) {
            return Err(reason.into());
        }
        let mut records = Vec::with_capacity(changed.len() + 4);
        for (key, value) in &changed {
            if key.kind() == Some(ItemType::InodeRef) {
                self.name_records(ino, state, key, value, generation, &mut records)?;
            }
            records.push(LogRecord {
                generation,
                key: *key,
                value: value.as_ref().map(|v| v.to_vec()),
            });
        }
        if changed
            .iter()
            .any(|(key, _)| key.kind() == Some(ItemType::InodeRef))
        {
            records.extend(self.orphan_deletion(ino, generation)?);
        }
        Ok(Some(records))
    }

    /// The rules about a file as a whole, before its names: [`CommitReason::Cloned`],
    /// [`CommitReason::Unlinked`], [`CommitReason::IncompatPending`], in that order.
    fn file_rule(
        &self,
        state: &InodeState,
        nlink: u32,
        changed: &[(Key, crate::delta::DeltaValue)],
    ) -> Option<CommitReason> {
        if self.cloned_since_commit(state, changed) {
            return Some(CommitReason::Cloned);
        }
        if nlink == 0 {
            return Some(CommitReason::Unlinked);
        }
        if self.inner.engine.incompat_pending() {
            // An incompat flag no durable commit has set yet (the first out-of-line xattr
            // value): a commit sets it, so no log record needs a flag the image lacks.
            return Some(CommitReason::IncompatPending);
        }
        None
    }

    /// [`CommitReason::Cloned`]: shared by a clone since the last commit (DESIGN §15.8). The
    /// commit makes the flags of source and clone durable together; a log batch could name a
    /// shared extent whose source the committed tree holds unflagged, which the next open
    /// would refuse.
    fn cloned_since_commit(
        &self,
        state: &InodeState,
        changed: &[(Key, crate::delta::DeltaValue)],
    ) -> bool {
        use std::sync::atomic::Ordering::Acquire;
        let committed = self.inner.engine.committed_generation().get();
        if state.cloned_in.load(Acquire) > committed {
            return true;
        }
        // The same when the inode's state was evicted since the clone (its mark went with
        // it): any uncommitted clone, and a shared extent among the changes, commits.
        self.inner.last_clone.load(Acquire) > committed
            && changed.iter().any(|(key, value)| {
                key.kind() == Some(ItemType::ExtentData)
                    && value
                        .as_deref()
                        .is_some_and(|v| FileExtent::decode(v).is_ok_and(|e| e.shared))
            })
    }

    /// The records of the names in a file's changed inode ref `key` (`value` now), pushed to
    /// `records`; or [`CommitReason::NameRemoved`] when the ref was deleted or lost a name
    /// replay starts from, else the first rule a name breaks ([`Filesystem::name_record`]).
    fn name_records(
        &self,
        ino: u64,
        state: &InodeState,
        key: &Key,
        value: &crate::delta::DeltaValue,
        generation: u64,
        records: &mut Vec<LogRecord>,
    ) -> Collected<()> {
        let Some(bytes) = value else {
            return Err(CommitReason::NameRemoved.into());
        };
        let refs = decode_inode_refs(bytes)
            .map_err(|e| Error::corrupt(format!("inode {ino} ref {key}"), e))?;
        if self.lost_a_base_name(ino, state, key, &refs)? {
            return Err(CommitReason::NameRemoved.into());
        }
        for r in &refs {
            self.name_record(ino, r, generation, records)?;
        }
        Ok(())
    }

    /// [`CommitReason::NameRemoved`]: every name replay starts from (committed, or queued by
    /// an earlier fsync of this inode) must still be in `refs` with the same directory index:
    /// a name renamed away, even one given back by a link (a new index), leaves its old entry
    /// behind, which only a commit removes.
    fn lost_a_base_name(
        &self,
        ino: u64,
        state: &InodeState,
        key: &Key,
        refs: &[InodeRef],
    ) -> Result<bool> {
        let Some(base) = self.replay_base(state, key)? else {
            return Ok(false);
        };
        let before = decode_inode_refs(&base)
            .map_err(|e| Error::corrupt(format!("inode {ino} ref {key}"), e))?;
        Ok(before.iter().any(|o| {
            !refs
                .iter()
                .any(|r| r.name == o.name && r.dir_index == o.dir_index)
        }))
    }

    /// The records of one name `r` of file `ino`: the records that take the name's other
    /// holders out of replay's way ([`Filesystem::holder_records`]), then the parent's dir
    /// item and dir index. Commits for [`CommitReason::NewParent`],
    /// [`CommitReason::NameRemoved`] (its dir item is missing),
    /// [`CommitReason::HashCollision`] and [`CommitReason::NameHeld`], in that order.
    fn name_record(
        &self,
        ino: u64,
        r: &InodeRef,
        generation: u64,
        records: &mut Vec<LogRecord>,
    ) -> Collected<()> {
        let engine = &self.inner.engine;
        let parent = InodeNo::new(r.parent);
        if engine.committed_get(&inode_key(parent))?.is_none() {
            return Err(CommitReason::NewParent.into());
        }
        let item_key = dir_item_key(parent, &r.name);
        let item = engine.get(&item_key)?;
        let entries = match &item {
            Some(bytes) => decode_dir_entries(bytes)
                .map_err(|e| Error::corrupt(format!("dir item {item_key}"), e))?,
            None => return Err(CommitReason::NameRemoved.into()),
        };
        if entries.len() != 1 {
            return Err(CommitReason::HashCollision.into());
        }
        records.extend(self.holder_records(ino, &item_key, generation)?);
        let index_key = dir_index_key(parent, r.dir_index);
        let index = engine.get(&index_key)?;
        records.push(LogRecord {
            generation,
            key: item_key,
            value: item,
        });
        records.push(LogRecord {
            generation,
            key: index_key,
            value: index,
        });
        Ok(())
    }

    /// [`CommitReason::NameHeld`] unless every other inode replay would find under dir item
    /// `item_key` can go in the batch: then the records that take them out of its way.
    ///
    /// The name's key may hold another inode's entry that replay would bring back (committed,
    /// or logged by that inode's fsync) before the new record overwrites it: that inode would
    /// keep a name without an entry. btrfs logs the conflicting inode or commits. birchfs logs
    /// its deletion when it is gone (unlinked and freed: a journal deleted and created again
    /// under its name, as SQLite does for every transaction), and its move when it is still
    /// there, renamed away (the seeds' dbench saves a file under a temporary name and writes a
    /// new one under the old name, then fsyncs the new one). Anything else commits.
    fn holder_records(
        &self,
        ino: u64,
        item_key: &Key,
        generation: u64,
    ) -> Collected<Vec<LogRecord>> {
        let engine = &self.inner.engine;
        let Some(holders) = self.name_holders(ino, item_key)? else {
            return Err(CommitReason::NameHeld.into());
        };
        let mut records = Vec::new();
        for other in holders {
            let exists = engine.get(&inode_key(InodeNo::new(other)))?.is_some();
            let found = if exists {
                self.moved_records(other, item_key, generation)?
            } else {
                self.gone_records(other, item_key, generation)?
            };
            let Some(more) = found else {
                return Err(CommitReason::NameHeld.into());
            };
            records.extend(more);
        }
        Ok(records)
    }

    /// The deletion of a file's committed orphan item when it got a name since: a tmpfile
    /// committed without a name and linked since. Its orphan item is gone from the running
    /// state, and replay must remove it too, or the next mount's orphan reclaim would see a
    /// named inode listed as an orphan.
    fn orphan_deletion(&self, ino: u64, generation: u64) -> Result<Option<LogRecord>> {
        let engine = &self.inner.engine;
        let orphan = orphan_key(InodeNo::new(ino));
        if engine.get(&orphan)?.is_none() && engine.committed_get(&orphan)?.is_some() {
            return Ok(Some(LogRecord {
                generation,
                key: orphan,
                value: None,
            }));
        }
        Ok(None)
    }

    /// What an fsync of directory `dir` logs: its inode item, when every other item of it
    /// changed since the last commit is a dir item or dir index whose current value an fsync
    /// of a file queued (the names of new files, and the dir index deletions of gone ones,
    /// remembered in the directory's `Logged::values` by [`Filesystem::remember_entries`]) in
    /// a batch no commit covers yet. The directory's entries are then as durable as those
    /// batches, which come no later than the one the inode item goes in. Otherwise (a name
    /// removed or renamed without a file's fsync, a new directory, its own name or xattrs
    /// changed, its state evicted and the values with it) it commits.
    fn dir_log_records(&self, dir: u64, state: &InodeState) -> Collected<Option<Vec<LogRecord>>> {
        let engine = &self.inner.engine;
        let (generation, changed) = engine.changed_items(InodeNo::new(dir));
        let generation = generation.get();
        if changed.is_empty() || self.only_atime_changed(dir, &changed) {
            return Ok(None);
        }
        let key = inode_key(InodeNo::new(dir));
        if engine.committed_get(&key)?.is_none() {
            return Err(CommitReason::Directory.into());
        }
        let committed = engine.committed_generation().get();
        {
            let logged = state.logged.lock();
            for (k, value) in &changed {
                if *k == key {
                    continue;
                }
                let queued = matches!(k.kind(), Some(ItemType::DirItem | ItemType::DirIndex))
                    && logged
                        .values
                        .get(k)
                        .is_some_and(|(v, g)| *g > committed && v.as_deref() == value.as_deref());
                if !queued {
                    return Err(CommitReason::Directory.into());
                }
            }
        }
        let Some(item) = engine.get(&key)? else {
            return Err(CommitReason::Directory.into());
        };
        Ok(Some(vec![LogRecord {
            generation,
            key,
            value: Some(item.to_vec()),
        }]))
    }

    /// Remembers, in each directory's `Logged::values`, the dir item and dir index records a
    /// file's fsync queued (`entries`: key, value, generation), for [`Filesystem::dir_log_records`].
    /// Only directories whose state is in memory: one loaded later has no values, and its
    /// fsync commits.
    fn remember_entries(&self, entries: Vec<(Key, Option<Vec<u8>>, u64)>, committed: u64) {
        let mut at = 0;
        while at < entries.len() {
            let dir = entries[at].0.objectid;
            let end = entries[at..]
                .iter()
                .position(|(k, _, _)| k.objectid != dir)
                .map_or(entries.len(), |n| at + n);
            let state = self.shard(dir).lock().get(&dir).cloned();
            if let Some(state) = state {
                let mut logged = state.logged.lock();
                forget_committed(&mut logged, dir, committed);
                for (key, value, generation) in &entries[at..end] {
                    logged.values.insert(*key, (value.clone(), *generation));
                }
            }
            at = end;
        }
    }

    /// Remembers, in the `Logged::values` of each inode moved away by this batch
    /// ([`Filesystem::moved_records`]), its inode item and refs as queued, so a later move of
    /// it starts from them. Only inodes whose state is in memory; one loaded later falls back
    /// to a commit ([`Filesystem::moved_base`]).
    fn remember_moves(&self, records: Vec<LogRecord>, committed: u64) {
        for r in records {
            let other = r.key.objectid;
            let state = self.shard(other).lock().get(&other).cloned();
            if let Some(state) = state {
                let mut logged = state.logged.lock();
                forget_committed(&mut logged, other, committed);
                logged.values.insert(r.key, (r.value, r.generation));
            }
        }
    }

    /// The value of `key` that replay of the log would start from before this inode's next
    /// batch: the one queued by an earlier fsync of the inode while a commit has not covered
    /// it, else the committed one.
    fn replay_base(&self, state: &super::InodeState, key: &Key) -> Result<Option<Vec<u8>>> {
        let engine = &self.inner.engine;
        let committed = engine.committed_generation().get();
        if let Some((value, generation)) = state.logged.lock().values.get(key) {
            if *generation > committed {
                return Ok(value.clone());
            }
        }
        engine.committed_get(key)
    }

    /// The inodes other than `ino` whose entry replay could find under dir item `key` before
    /// applying a record of `ino` for it: the children of the committed item's entries, and the
    /// child of the last record of `key` that another inode's fsync queued and a commit has not
    /// covered yet. `None` when the committed item holds several entries (a hash collision).
    fn name_holders(&self, ino: u64, key: &Key) -> Result<Option<Vec<u64>>> {
        let engine = &self.inner.engine;
        let mut others = Vec::new();
        if let Some(bytes) = engine.committed_get(key)? {
            let entries = decode_dir_entries(&bytes)
                .map_err(|e| Error::corrupt(format!("committed dir item {key}"), e))?;
            if entries.len() > 1 && entries.iter().any(|e| e.child != ino) {
                return Ok(None);
            }
            others.extend(entries.iter().map(|e| e.child).filter(|c| *c != ino));
        }
        let committed = engine.committed_generation().get();
        let mut logged = self.inner.logged_names.lock();
        logged.retain(|_, (_, g)| *g > committed);
        if let Some((child, _)) = logged.get(key) {
            if *child != ino && !others.contains(child) {
                others.push(*child);
            }
        }
        Ok(Some(others))
    }

    /// The records that remove `other` from what replay starts from, when `other` holds an
    /// entry under dir item `key` there but is gone from the running state (unlinked and
    /// freed; inode numbers are never reused, so it stays gone): every item of it changed
    /// since the last commit (all deletions, its inode item among them), its orphan item, and
    /// the dir index of its one name in replay's base. The caller's record for `key` replaces
    /// the entry itself. Records of keys replay does not hold (an inode only ever logged)
    /// delete nothing there.
    ///
    /// `None` (commit instead) when `other` still exists (renamed away, linked elsewhere,
    /// unlinked but open), its free has not finished, or its names in replay's base are not
    /// exactly one under `key`. Those names come from its inode refs as replay would start
    /// from them: queued by its own fsync or a logged move of it (`logged_names` keeps what
    /// such a ref named, or that a move deleted it, since the inode's in-memory state goes
    /// with the inode), else committed.
    fn gone_records(
        &self,
        other: u64,
        key: &Key,
        generation: u64,
    ) -> Result<Option<Vec<LogRecord>>> {
        let engine = &self.inner.engine;
        let orphan = orphan_key(InodeNo::new(other));
        // `free_inode` deletes every item of the inode, then its orphan item: both gone means
        // the free is complete.
        if engine.get(&inode_key(InodeNo::new(other)))?.is_some() || engine.get(&orphan)?.is_some()
        {
            return Ok(None);
        }
        let committed = engine.committed_generation().get();
        // Its deletion is in the log already (an earlier fsync took its name; the committed
        // dir item still names it): replay removes it before this batch.
        if self
            .inner
            .logged_names
            .lock()
            .get(&inode_key(InodeNo::new(other)))
            .is_some_and(|(mark, g)| *mark == GONE && *g > committed)
        {
            return Ok(Some(Vec::new()));
        }
        let (lo, hi) = crate::items::inode_key_range(InodeNo::new(other));
        if !engine.range(&lo, &hi, 1)?.is_empty() {
            return Ok(None);
        }
        let (_, changed) = engine.changed_items(InodeNo::new(other));
        if changed.iter().any(|(_, v)| v.is_some()) {
            return Ok(None);
        }
        let Some(indexes) = self.gone_base_indexes(other, key, &changed, committed)? else {
            return Ok(None);
        };
        let parent = key.objectid;
        let [index] = indexes[..] else {
            return Ok(None);
        };
        let index_key = dir_index_key(InodeNo::new(parent), index);
        if engine.get(&index_key)?.is_some() {
            return Ok(None);
        }
        let mut records: Vec<LogRecord> = changed
            .into_iter()
            .map(|(key, _)| LogRecord {
                generation,
                key,
                value: None,
            })
            .collect();
        for key in [orphan, index_key] {
            records.push(LogRecord {
                generation,
                key,
                value: None,
            });
        }
        Ok(Some(records))
    }

    /// The dir indexes of gone inode `other`'s names in replay's base, for
    /// [`Filesystem::gone_records`], from its deleted inode refs (`changed`): the one a ref
    /// queued by its fsync or a logged move named (`logged_names`), skipping a ref such a move
    /// deleted, else those of its committed ref. `None` when a queued ref named several
    /// entries or not one of `key`'s directory queued for `other`, or a committed name is not
    /// under `key`.
    fn gone_base_indexes(
        &self,
        other: u64,
        key: &Key,
        changed: &[(Key, crate::delta::DeltaValue)],
        committed: u64,
    ) -> Result<Option<Vec<u64>>> {
        let engine = &self.inner.engine;
        let parent = key.objectid;
        let mut indexes = Vec::new();
        for (ref_key, _) in changed
            .iter()
            .filter(|(k, _)| k.kind() == Some(ItemType::InodeRef))
        {
            let logged = {
                let names = self.inner.logged_names.lock();
                match names.get(ref_key) {
                    // A name a logged move took away: not in replay's base.
                    Some((REF_DELETED, g)) if *g > committed => continue,
                    Some((index, g)) if *g > committed => {
                        // The ref queued named one entry, in `parent` (its dir index was
                        // queued for this inode too), or the inode falls back.
                        let index_key = dir_index_key(InodeNo::new(parent), *index);
                        let ours = *index != SEVERAL_NAMES
                            && names
                                .get(&index_key)
                                .is_some_and(|(child, g)| *child == other && *g > committed);
                        if !ours {
                            return Ok(None);
                        }
                        Some(*index)
                    }
                    _ => None,
                }
            };
            match logged {
                Some(index) => indexes.push(index),
                None => {
                    if let Some(bytes) = engine.committed_get(ref_key)? {
                        let refs = decode_inode_refs(&bytes).map_err(|e| {
                            Error::corrupt(format!("committed inode ref {ref_key}"), e)
                        })?;
                        for r in refs {
                            if dir_item_key(InodeNo::new(r.parent), &r.name) != *key {
                                return Ok(None);
                            }
                            indexes.push(r.dir_index);
                        }
                    }
                }
            }
        }
        Ok(Some(indexes))
    }

    /// The value of `other`'s item `k` that replay would start from, for
    /// [`Filesystem::moved_records`]: the one queued by an fsync a commit has not covered yet
    /// (its own, or one that logged its move; both remembered in its `Logged::values`), else
    /// the committed one. `None` (commit instead) when a queued name record of `other` is
    /// known (`logged_names`) but not in its `Logged::values` with the same generation: its
    /// state was evicted and reloaded since, and the base is unknown.
    fn moved_base(
        &self,
        state: Option<&InodeState>,
        k: &Key,
        committed: u64,
    ) -> Result<Option<Option<Vec<u8>>>> {
        let queued_name = self
            .inner
            .logged_names
            .lock()
            .get(k)
            .filter(|(_, g)| *g > committed)
            .map(|(_, g)| *g);
        let queued = state.and_then(|st| {
            st.logged
                .lock()
                .values
                .get(k)
                .filter(|(_, g)| *g > committed)
                .cloned()
        });
        match (queued, queued_name) {
            (Some((value, g)), name) if name.is_none_or(|n| n == g) => Ok(Some(value)),
            (None, None) => Ok(Some(self.inner.engine.committed_get(k)?)),
            _ => Ok(None),
        }
    }

    /// The records that move `other` away from dir item `key` in what replay starts from,
    /// when `other` still exists but no longer has the name `key` stands for (renamed away,
    /// in the same directory or another): its inode item, its inode refs as they are now, the
    /// dir item and dir index of each name it gained, and the deletion of the dir index of the
    /// name it lost. The caller's record for `key` replaces the old entry itself. btrfs logs
    /// such a conflicting inode too (`log_conflicting_inodes`).
    ///
    /// `None` (commit instead) unless the move is all that changed: `other` is not a
    /// directory; since the last commit only its inode item (in its times alone) and its
    /// inode refs changed, and no fsync of it queued refs a commit has not covered (replay's
    /// base for its names is then the committed tree); it lost exactly one committed name,
    /// the one under `key`, and its dir index there is gone; and each name it gained is under
    /// a committed directory, its dir item holds just `other`, and any other inode that holds
    /// that key in replay's base is gone (`other` was renamed over a file since unlinked and
    /// freed): that inode's deletion ([`Filesystem::gone_records`]) comes first in the
    /// records. A rename over a file that still exists (open, or not yet forgotten by the
    /// kernel) commits.
    fn moved_records(
        &self,
        other: u64,
        key: &Key,
        generation: u64,
    ) -> Result<Option<Vec<LogRecord>>> {
        let engine = &self.inner.engine;
        let Some(moved) = self.moved_changes(other)? else {
            return Ok(None);
        };
        let Moved {
            inode_item,
            ref_changes,
            before,
            now,
        } = moved;
        let inode_item = match inode_item {
            Some(item) => item,
            // The rename moved ctime; an equal inode item would mean the kernel restored it.
            None => match engine.get(&inode_key(InodeNo::new(other)))? {
                Some(item) => item.to_vec(),
                None => return Ok(None),
            },
        };
        let lost: Vec<_> = before.iter().filter(|b| !now.contains(b)).collect();
        let [(parent, name, index)] = lost[..] else {
            return Ok(None);
        };
        if dir_item_key(InodeNo::new(*parent), name) != *key {
            return Ok(None);
        }
        let old_index = dir_index_key(InodeNo::new(*parent), *index);
        if engine.get(&old_index)?.is_some() {
            return Ok(None);
        }
        let mut records = vec![LogRecord {
            generation,
            key: inode_key(InodeNo::new(other)),
            value: Some(inode_item),
        }];
        // Deletions of files `other` was renamed over; they go first in what this returns.
        let mut gone = Vec::new();
        for (k, value) in ref_changes {
            records.push(LogRecord {
                generation,
                key: k,
                value,
            });
        }
        for (parent, name, index) in now.iter().filter(|n| !before.contains(n)) {
            let gained = self.gained_name_records(other, *parent, name, *index, generation)?;
            let Some((holders, entry)) = gained else {
                return Ok(None);
            };
            gone.extend(holders);
            records.extend(entry);
        }
        records.push(LogRecord {
            generation,
            key: old_index,
            value: None,
        });
        self.inner
            .engine
            .counters()
            .add(|c| &c.fsync_logged_moves, 1);
        gone.extend(records);
        Ok(Some(gone))
    }

    /// What changed of `other` since replay's base, for [`Filesystem::moved_records`]; `None`
    /// when it is more than a move: anything but its inode refs and its inode item's times, a
    /// directory, or a base an eviction lost ([`Filesystem::moved_base`]).
    fn moved_changes(&self, other: u64) -> Result<Option<Moved>> {
        let engine = &self.inner.engine;
        let committed = engine.committed_generation().get();
        let (_, changed) = engine.changed_items(InodeNo::new(other));
        let state = self.shard(other).lock().get(&other).cloned();
        let mut moved = Moved::default();
        for (k, value) in &changed {
            let Some(base) = self.moved_base(state.as_deref(), k, committed)? else {
                return Ok(None);
            };
            if base.as_deref() == value.as_deref() {
                // Queued as it is now: replay has it already.
                continue;
            }
            match k.kind() {
                Some(ItemType::InodeItem) if *k == inode_key(InodeNo::new(other)) => {
                    let (Some(current), Some(base)) = (value, base) else {
                        return Ok(None);
                    };
                    let item = InodeItem::decode(current)
                        .map_err(|e| Error::corrupt(format!("inode {other}"), e))?;
                    if item.mode & libc::S_IFMT == libc::S_IFDIR
                        || !differs_only_in_times(current, &base, true)
                    {
                        return Ok(None);
                    }
                    moved.inode_item = Some(current.to_vec());
                }
                Some(ItemType::InodeRef) => {
                    if let Some(bytes) = &base {
                        let refs = decode_inode_refs(bytes).map_err(|e| {
                            Error::corrupt(format!("inode ref {k} in replay's base"), e)
                        })?;
                        let names = refs.into_iter().map(|r| (r.parent, r.name, r.dir_index));
                        moved.before.extend(names);
                    }
                    if let Some(bytes) = value {
                        let refs = decode_inode_refs(bytes)
                            .map_err(|e| Error::corrupt(format!("inode ref {k}"), e))?;
                        let names = refs.into_iter().map(|r| (r.parent, r.name, r.dir_index));
                        moved.now.extend(names);
                    }
                    moved
                        .ref_changes
                        .push((*k, value.as_ref().map(|v| v.to_vec())));
                }
                _ => return Ok(None),
            }
        }
        Ok(Some(moved))
    }

    /// For a name `other` gained by its move (`name` in `parent`, dir index `index`): the
    /// deletions of the gone inodes replay's base holds under its dir item, and its dir item
    /// and dir index records. `None` (commit instead) unless the directory is committed, the
    /// dir item holds just `other`, and every other holder is gone.
    fn gained_name_records(
        &self,
        other: u64,
        parent: u64,
        name: &[u8],
        index: u64,
        generation: u64,
    ) -> Result<Option<(Vec<LogRecord>, [LogRecord; 2])>> {
        let engine = &self.inner.engine;
        if engine
            .committed_get(&inode_key(InodeNo::new(parent)))?
            .is_none()
        {
            return Ok(None);
        }
        let item_key = dir_item_key(InodeNo::new(parent), name);
        let Some(item) = engine.get(&item_key)? else {
            return Ok(None);
        };
        let entries = decode_dir_entries(&item)
            .map_err(|e| Error::corrupt(format!("dir item {item_key}"), e))?;
        if entries.len() != 1 || entries[0].child != other {
            return Ok(None);
        }
        // A name it took by a rename over another file (dbench renames over files it
        // closed): that file's deletion goes in the batch when it is gone (unlinked and
        // freed), as for the fsync'd inode's own names; a holder still there commits.
        let Some(holders) = self.name_holders(other, &item_key)? else {
            return Ok(None);
        };
        let mut gone = Vec::new();
        for holder in holders {
            match self.gone_records(holder, &item_key, generation)? {
                Some(more) => gone.extend(more),
                None => return Ok(None),
            }
        }
        let index_key = dir_index_key(InodeNo::new(parent), index);
        let Some(index_item) = engine.get(&index_key)? else {
            return Ok(None);
        };
        let entry = [
            LogRecord {
                generation,
                key: item_key,
                value: Some(item.to_vec()),
            },
            LogRecord {
                generation,
                key: index_key,
                value: Some(index_item.to_vec()),
            },
        ];
        Ok(Some((gone, entry)))
    }

    /// Whether the only change since the last commit is the inode item's atime.
    fn only_atime_changed(&self, ino: u64, changed: &[(Key, crate::delta::DeltaValue)]) -> bool {
        let [(key, Some(now))] = changed else {
            return false;
        };
        if *key != inode_key(InodeNo::new(ino)) {
            return false;
        }
        let Ok(Some(committed)) = self.inner.engine.committed_get(key) else {
            return false;
        };
        differs_only_in_times(now, &committed, false)
    }

    /// Applies what the log holds beyond the last commit, fixes up counts, and commits.
    /// Returns whether anything was applied.
    pub(crate) fn replay_log(&self) -> Result<bool> {
        let engine = &self.inner.engine;
        let Some(replay) = engine.log().take_replay() else {
            return Ok(false);
        };
        if let Some(next) = replay.followed_by {
            // Not a torn last batch: this one was durable and answered its fsyncs, and so
            // were the batches from `next` on, which replay drops (`FindingKind::LogBatchesLost`).
            log::error!(
                "log replay stops at a durable batch ({}) with batch {next} after it: fsyncs answered by those batches are lost",
                replay.stop
            );
        }
        let committed = engine.committed_generation().get();
        let live: Vec<LogRecord> = replay
            .records
            .into_iter()
            .filter(|r| r.generation > committed)
            .collect();
        if live.is_empty() {
            return Ok(false);
        }
        log::warn!(
            "replaying {} log records from {} batches ({})",
            live.len(),
            replay.batches,
            replay.stop
        );
        let counters: &Counters = engine.counters();
        counters.add(|c| &c.replayed_batches, replay.batches);
        counters.add(|c| &c.replayed_records, live.len() as u64);
        let mut dirs = BTreeSet::new();
        let mut inodes = BTreeSet::new();
        let mut max_objectid = 0;
        self.replay_data(&live)?;
        {
            let txn = engine.begin()?;
            for r in live.iter().filter(|r| !r.is_data()) {
                match r.key.kind() {
                    Some(ItemType::DirItem | ItemType::DirIndex) => {
                        dirs.insert(r.key.objectid);
                    }
                    Some(ItemType::InodeRef) => {
                        inodes.insert(r.key.objectid);
                    }
                    Some(ItemType::XattrChunk) if r.value.is_some() => {
                        // The replay's commit holds an out-of-line xattr value: it sets the
                        // flag (an fsync logs one only once the flag is durable, so this
                        // repeats what the superblock says).
                        engine.want_incompat(birch_format::superblock::INCOMPAT_XATTR_CHUNKS);
                    }
                    _ => {}
                }
                if r.key.objectid != ORPHAN_OBJECTID {
                    max_objectid = max_objectid.max(r.key.objectid);
                }
                if let (Some(ItemType::ExtentData), Some(value)) = (r.key.kind(), &r.value) {
                    self.data().mark_replayed_extent(value);
                }
                match &r.value {
                    Some(v) => txn.put(r.key, v.clone()),
                    None => txn.delete(r.key),
                }
            }
        }
        // Saturating: a record of object id u64::MAX (a damaged but sealed batch) overflowed
        // here (found by the log_replay fuzz target; its input is kept in
        // crates/birch-fuzz/crashes/log_replay/).
        engine.raise_objectid(max_objectid.saturating_add(1));
        for ino in inodes {
            self.fix_nlink(ino)?;
        }
        for dir in dirs {
            self.fix_dir(dir)?;
        }
        engine.commit()?;
        Ok(true)
    }

    /// Replay's first step: the blocks of data records go in place (the replay's commit
    /// flushes them before its superblock names them). The blocks were allocated by the running
    /// transaction the crash ended, from space no committed tree holds (DESIGN §10.2).
    fn replay_data(&self, live: &[LogRecord]) -> Result<()> {
        let engine = &self.inner.engine;
        let counters: &Counters = engine.counters();
        for r in live.iter().filter(|r| r.is_data()) {
            if let Some(bytes) = &r.value {
                let at = r.key.offset;
                engine.device().write_at(bytes, at).map_err(|e| {
                    Error::io(
                        format!(
                            "replay: write the logged data of inode {} at block {at:#x}",
                            r.key.objectid
                        ),
                        e,
                    )
                })?;
                counters.add(|c| &c.replayed_data_bytes, bytes.len() as u64);
            }
        }
        Ok(())
    }

    /// Recomputes a non-directory's link count from its refs.
    fn fix_nlink(&self, ino: u64) -> Result<()> {
        let engine = &*self.inner.engine;
        let Some(mut item) = items::get_inode(engine, InodeNo::new(ino))? else {
            return Ok(());
        };
        if item.mode & libc::S_IFMT == libc::S_IFDIR {
            return Ok(());
        }
        let names = items::count_names(engine, InodeNo::new(ino))?;
        if item.nlink != names {
            item.nlink = names;
            let mut txn = engine.begin()?;
            items::put_inode(&mut txn, InodeNo::new(ino), &item);
            if names == 0 {
                items::put_orphan(&mut txn, InodeNo::new(ino));
            }
        }
        Ok(())
    }

    /// Recomputes a directory's size, link count and next index from its entries.
    fn fix_dir(&self, dir: u64) -> Result<()> {
        let engine = &*self.inner.engine;
        let Some(mut item) = items::get_inode(engine, InodeNo::new(dir))? else {
            return Ok(());
        };
        let mut entries = 0u64;
        let mut subdirs = 0u32;
        let mut next_index = item.next_dir_index;
        for (index, entry) in items::listing(engine, InodeNo::new(dir), 0, u64::MAX, usize::MAX)? {
            entries += 1;
            if entry.file_type == libc::DT_DIR {
                subdirs += 1;
            }
            next_index = next_index.max(index + 1);
        }
        if (item.size, item.nlink, item.next_dir_index) != (entries, 2 + subdirs, next_index) {
            item.size = entries;
            item.nlink = 2 + subdirs;
            item.next_dir_index = next_index;
            items::put_inode(&mut engine.begin()?, InodeNo::new(dir), &item);
        }
        Ok(())
    }
}

/// What `logged_names` remembers of an inode ref whose entries are not exactly one.
const SEVERAL_NAMES: u64 = u64::MAX;

/// What `logged_names` remembers of an inode ref a record deleted (a name a logged move took
/// away): replay's base no longer has it, whatever the committed tree says.
const REF_DELETED: u64 = u64::MAX - 1;

/// What `logged_names` remembers, under an inode item's key, of an inode whose deletion a
/// batch holds ([`Filesystem::gone_records`]): replay removes it, whatever the committed tree
/// still names.
const GONE: u64 = u64::MAX - 2;

/// Remembers, in `Inner::logged_names`, the names an fsync queued: each dir item and dir
/// index key with the inode it names (its one entry's child; `ino`, the inode fsync'd, if it
/// holds several), and each inode ref key with the dir index of its one name
/// ([`SEVERAL_NAMES`] otherwise), each with its record's generation. The records may name
/// other inodes than `ino` (one renamed away from a name `ino` took, [`Filesystem::moved_records`]).
/// A later fsync of another inode under the same dir item key learns from them that replay
/// would find that inode there, and, once it is gone, which dir index to delete with it
/// ([`Filesystem::gone_records`]). A deleted inode ref is remembered as [`REF_DELETED`], so
/// that a later deletion of the inode does not take the committed name it lost for one of its
/// names in replay's base, and a deleted inode item as [`GONE`], so that a later fsync that
/// still finds the inode in a committed dir item adds nothing for it; other deletions are not
/// remembered.
fn remember_names(names: &mut HashMap<Key, (u64, u64)>, ino: u64, records: &[LogRecord]) {
    for r in records {
        let Some(value) = &r.value else {
            match r.key.kind() {
                Some(ItemType::InodeRef) => {
                    names.insert(r.key, (REF_DELETED, r.generation));
                }
                Some(ItemType::InodeItem) => {
                    names.insert(r.key, (GONE, r.generation));
                }
                _ => {}
            }
            continue;
        };
        match r.key.kind() {
            Some(ItemType::DirItem | ItemType::DirIndex) => {
                let child = match decode_dir_entries(value).as_deref() {
                    Ok([one]) => one.child,
                    _ => ino,
                };
                names.insert(r.key, (child, r.generation));
            }
            Some(ItemType::InodeRef) => {
                let index = match decode_inode_refs(value).as_deref() {
                    Ok([one]) => one.dir_index,
                    _ => SEVERAL_NAMES,
                };
                names.insert(r.key, (index, r.generation));
            }
            _ => {}
        }
    }
}

/// Whether `r` is an item of an inode itself (its inode item or a ref), not of a directory's
/// entries.
fn is_inode_record(r: &LogRecord) -> bool {
    matches!(r.key.kind(), Some(ItemType::InodeItem | ItemType::InodeRef))
}

/// Drops what `logged` remembers of generations a commit covers: replay skips those records.
/// Scans only when the committed generation moved since the last sweep (remembered under a
/// key of its own), so a synchronous write does not walk every extent logged since the commit.
fn forget_committed(logged: &mut Logged, ino: u64, committed: u64) {
    let mut swept = inode_key(InodeNo::new(ino));
    swept.offset = u64::MAX - 2;
    if logged
        .values
        .get(&swept)
        .is_some_and(|(_, g)| *g == committed)
    {
        return;
    }
    logged.values.retain(|_, (_, g)| *g > committed);
    logged.values.insert(swept, (None, committed));
}

/// Whether two encoded inode items differ only in atime (and, with `modify_times`, also
/// mtime and ctime) and the transaction id.
fn differs_only_in_times(new: &[u8], old: &[u8], modify_times: bool) -> bool {
    let (Ok(mut a), Ok(b)) = (InodeItem::decode(new), InodeItem::decode(old)) else {
        return false;
    };
    a.atime = b.atime;
    a.transid = b.transid;
    if modify_times {
        a.mtime = b.mtime;
        a.ctime = b.ctime;
    }
    a == b
}
