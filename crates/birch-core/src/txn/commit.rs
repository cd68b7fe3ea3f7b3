//! The commit: freezing the running delta under the gate, applying it to a copy of the tree
//! (one descent per leaf, or in jobs waiting committers help with: [`Board`]), writing nodes,
//! flush, superblock, flush, then publishing the new committed root and handing the old one
//! the space this commit freed. Also the commit lock and its waiters, the barrier, and the
//! commit-size estimates behind ENOSPC checks.
//!
//! Must not touch: the snapshot list's contents (`snapshots.rs` writes it, called from here),
//! the fsync log's batches (only `retire`/`set_reusable` at the superblock write), any lock
//! across I/O other than the commit lock itself.

#![deny(clippy::too_many_lines)]

#[cfg(feature = "seed-before")]
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use birch_format::node::Node;
use birch_format::superblock::{
    BackupRoot, RootPtr, Superblock, BACKUP_ROOTS, COMPAT_BACKUP_ROOTS, COMPAT_DEVICE_STATS,
    INCOMPAT_LOG_ALIGNED,
};
use birch_format::{BlockCount, Generation, NODE_BLOCKS, NODE_SIZE};
use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::alloc::SnapshotHold;
use crate::btree::parallel::{self, Job, JobOutput};
use crate::btree::TreeWriter;
use crate::delta::FrozenDelta;
use crate::error::{Error, Result};
use crate::readonly::ReadOnlyCause;
use crate::snapshot::{Snapshot, SnapshotOp};

use super::read::{CommittedRootPin, ReleaseOnDrop};
use super::{discard_ranges, now, CommittedRoot, Engine};

/// Commits of at least this many changed items cut their apply into jobs (see [`Board`]).
const PARALLEL_APPLY_MIN: usize = 16_384;
/// How many jobs such a commit is cut into: enough that two or three threads finish close
/// together whatever the jobs' sizes.
const PARALLEL_APPLY_JOBS: usize = 8;
/// Nodes above the leaves' parents that one commit may copy ([`Engine::commit_estimate_blocks`]):
/// at fanouts of 50 or more, a tree of 2.5 GB of metadata has fewer.
const COMMIT_TOP_NODES: u64 = 64;
/// A parallel apply is planned from every this-many-th changed key.
const PARALLEL_SAMPLE_STEP: usize = 16;

/// The jobs of one commit's parallel apply. The committing thread runs them, and so does
/// every caller of [`Engine::commit`] that would otherwise sleep until the commit ends (two
/// threads that sync at once: the second helps the first's commit, then commits what is left).
/// Each job owns its subtrees, so jobs share nothing but the allocator and the cache.
struct Board {
    jobs: Vec<Mutex<Option<Job>>>,
    next: AtomicUsize,
    outputs: Mutex<Vec<Option<Result<JobOutput>>>>,
    done: Condvar,
    frozen: Arc<FrozenDelta>,
    generation: Generation,
}

impl Board {
    fn has_unclaimed(&self) -> bool {
        self.next.load(Ordering::SeqCst) < self.jobs.len()
    }

    /// Claims and runs jobs until none is left unclaimed; `helping` counts them as help.
    fn work(&self, engine: &Engine, helping: bool) {
        loop {
            let index = self.next.fetch_add(1, Ordering::SeqCst);
            let Some(slot) = self.jobs.get(index) else {
                return;
            };
            let Some(job) = slot.lock().take() else {
                continue;
            };
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let changes = self.frozen.sorted_range(&job.lo, job.hi.as_ref());
                parallel::run_job(engine.ctx(), &engine.alloc, self.generation, job, &changes)
            }));
            let result = run.unwrap_or_else(|panic| {
                let why = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                Err(Error::bug(format!(
                    "commit {}: job {index} of the parallel apply panicked: {why}",
                    self.generation
                )))
            });
            engine.counters.add(|c| &c.commit_jobs, 1);
            if helping {
                engine.counters.add(|c| &c.commit_jobs_helped, 1);
            }
            let mut outputs = self.outputs.lock();
            outputs[index] = Some(result);
            self.done.notify_all();
        }
    }

    /// Waits until every job has an output; returns them in job order.
    fn wait_all(&self) -> Vec<Result<JobOutput>> {
        let mut outputs = self.outputs.lock();
        while outputs.iter().any(Option::is_none) {
            self.done.wait(&mut outputs);
        }
        outputs.drain(..).flatten().collect()
    }
}

/// What commits share besides the engine's deltas and roots: the commit lock, its waiters,
/// the parallel apply in progress, and the switches of the apply.
pub(super) struct CommitQueue {
    lock: Mutex<()>,
    /// Bumped (and waiters woken) when the commit lock is released and when a commit posts
    /// jobs for waiters to help with.
    events: (Mutex<u64>, Condvar),
    /// The jobs of the parallel apply in progress, if any.
    board: Mutex<Option<Arc<Board>>>,
    /// Commits of at least this many changed items cut their apply into jobs.
    parallel_apply_min: AtomicUsize,
    /// Benchmark-only switch (seed 003's "before", [`Engine::set_bench_apply_per_item`]): the
    /// commit apply deletes and inserts each extent item in a descent of its own. Only in
    /// builds with the `seed-before` feature.
    #[cfg(feature = "seed-before")]
    bench_apply_per_item: AtomicBool,
}

impl CommitQueue {
    pub(super) fn new() -> CommitQueue {
        CommitQueue {
            lock: Mutex::new(()),
            events: (Mutex::new(0), Condvar::new()),
            board: Mutex::new(None),
            parallel_apply_min: AtomicUsize::new(PARALLEL_APPLY_MIN),
            #[cfg(feature = "seed-before")]
            bench_apply_per_item: AtomicBool::new(false),
        }
    }

    /// Wakes the callers waiting in [`Engine::lock_commit`] to look again.
    fn event(&self) {
        let (lock, cvar) = &self.events;
        *lock.lock() += 1;
        cvar.notify_all();
    }
}

/// The commit lock; releasing it wakes the callers waiting for it.
struct CommitGuard<'e> {
    engine: &'e Engine,
    guard: Option<MutexGuard<'e, ()>>,
}

impl Drop for CommitGuard<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        self.engine.commits.event();
    }
}

/// Seed 003's "before" (`bench_apply_per_item`): each changed extent item costs a delete (a
/// lookup, and a descent when the item exists) and an insert descent of its own; the other
/// items still go in one descent per leaf.
#[cfg(feature = "seed-before")]
fn apply_per_item(
    writer: &mut TreeWriter<'_>,
    changes: &[(birch_format::Key, Option<&[u8]>)],
) -> Result<()> {
    let (extents, rest): (Vec<_>, Vec<_>) = changes
        .iter()
        .partition(|(key, _)| key.kind() == Some(birch_format::ItemType::ExtentData));
    writer.apply_sorted(&rest)?;
    for (key, value) in extents {
        writer.delete(&key)?;
        if let Some(value) = value {
            writer.insert(key, value.to_vec())?;
        }
    }
    Ok(())
}

/// The backup roots the commit after `previous` names: `previous`'s own root, then its
/// backups, newest first, at most [`BACKUP_ROOTS`], none below `floor` (a tree a reclaim may
/// have broken, DESIGN §13.2).
fn backups_after(previous: &Superblock, floor: Generation) -> Vec<BackupRoot> {
    let newest = BackupRoot {
        generation: previous.generation,
        fs_root: previous.fs_root,
    };
    std::iter::once(newest)
        .chain(previous.backup_roots.iter().copied())
        .filter(|b| b.generation >= floor.get() && b.generation > 0)
        .take(BACKUP_ROOTS)
        .collect()
}

/// A frozen commit: its delta, its generation, the committed root it applies to, and the
/// snapshot ops it carries.
struct Frozen {
    delta: Arc<FrozenDelta>,
    generation: Generation,
    committed: Arc<CommittedRoot>,
    ops: Vec<SnapshotOp>,
}

/// A commit's new tree, before it is durable.
struct NewTree {
    root: RootPtr,
    /// The nodes written for it (and, later, for the snapshot list), cached once durable.
    nodes: Vec<Arc<Node>>,
    /// A rollback's replaced live tree, as a snapshot the commit deletes.
    replaced: Option<Snapshot>,
}

/// A commit's change to the snapshot list ([`Engine::write_snapshot_list`]).
struct ListChange {
    /// The new list, published with the commit.
    list: Vec<Snapshot>,
    /// The snapshots the commit deletes.
    deleted: Vec<Snapshot>,
    /// The list before the commit.
    before: Vec<Snapshot>,
}

/// The snapshot a commit's ops roll back to, if any.
fn rollback_target(ops: &[SnapshotOp]) -> Option<u64> {
    ops.iter().find_map(|op| match op {
        SnapshotOp::Rollback { id } => Some(*id),
        _ => None,
    })
}

/// Runs its function when dropped (once).
struct OnDrop<F: FnOnce()>(Option<F>);

impl<F: FnOnce()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

impl Engine {
    /// Number of changed items waiting for commit.
    pub fn pending_items(&self) -> usize {
        self.active.len()
    }

    /// Whether a commit's frozen delta is still being written (its blocks count in
    /// [`Engine::commit_estimate_blocks`] until it is durable).
    pub fn commit_in_flight(&self) -> bool {
        self.state.read().frozen.is_some()
    }

    /// An upper bound on the blocks the commits of the running delta (and of a frozen one
    /// still being written) take: each changed item may copy its own leaf and that leaf's
    /// parent, new bytes fill leaves at least half, and the levels above take at most
    /// [`COMMIT_TOP_NODES`]. Loads only, no lock.
    pub fn commit_estimate_blocks(&self) -> BlockCount {
        let nodes = |items: usize, bytes: usize| -> u64 {
            2 * items as u64 + 2 * bytes.div_ceil(NODE_SIZE) as u64 + COMMIT_TOP_NODES
        };
        let mut total = nodes(self.active.len(), self.active.bytes());
        if let Some(frozen) = self.state.read().frozen.clone() {
            total += nodes(frozen.len(), frozen.bytes());
        }
        BlockCount::new(total * NODE_BLOCKS)
    }

    /// Whether the metadata of the changes so far fits in the space left, keeping `keep`
    /// blocks besides (blocks reserved for buffered data are not there to take). A commit
    /// that ran out of space would turn the filesystem read-only; an operation asks this
    /// first and gets ENOSPC instead (`Filesystem::admit`, DESIGN §10.7).
    pub fn metadata_fits(&self, keep: BlockCount) -> bool {
        let room = self
            .alloc
            .free_blocks()
            .saturating_sub(self.alloc.reserved_blocks());
        self.commit_estimate_blocks() + keep <= room
    }

    /// Benchmark only (mount option `bench_apply_per_item`, seed 003's "before"): the commit
    /// apply deletes each changed extent item in a descent of its own and inserts it in another,
    /// instead of one descent per leaf of changes; such commits never run the parallel apply.
    /// Off by default; only in builds with the `seed-before` feature (benchmark builds, never
    /// the shipped binary).
    #[cfg(feature = "seed-before")]
    pub fn set_bench_apply_per_item(&self, on: bool) {
        self.commits
            .bench_apply_per_item
            .store(on, Ordering::Relaxed);
    }

    /// Commits the running transaction; returns the new durable generation (or the current one
    /// when nothing changed). Concurrent callers queue; mutations go on during the commit.
    /// Does device I/O with no engine lock held except the commit lock itself.
    pub fn commit(&self) -> Result<Generation> {
        self.commit_then(|| {})
    }

    /// [`Engine::commit`], calling `after_freeze` once: as soon as the running transaction
    /// is frozen (mutations go on into the next one), or when the commit returns without
    /// freezing (nothing to commit, read-only). The filesystem's buffered data path uses it
    /// to write data through only between its drain and the freeze.
    pub fn commit_then(&self, after_freeze: impl FnOnce()) -> Result<Generation> {
        let after_freeze = OnDrop(Some(after_freeze));
        let _commit = self.lock_commit();
        self.check_up()?;
        if let Some(cause) = self.read_only.cause() {
            // A read-only mount commits what reached the delta before it turned read-only
            // (remount,ro sets read-only first, then commits); after a failure, nothing more
            // is durable, and callers (fsync) must hear so.
            if !cause.allows_commit() {
                return Err(Error::ReadOnly(cause));
            }
        }
        let Some(Frozen {
            delta: frozen,
            generation,
            committed,
            ops,
        }) = self.freeze()?
        else {
            return Ok(self.committed_generation());
        };
        drop(after_freeze);
        let started = std::time::Instant::now();
        let result = match self.write_commit(&frozen, generation, &committed, &ops) {
            Ok(()) => {
                self.commit_latency.record(started.elapsed());
                Ok(generation)
            }
            Err(_) if self.is_shut_down() => Err(Error::Shutdown),
            Err(e) => {
                self.set_read_only(ReadOnlyCause::CommitFailed {
                    generation: generation.get(),
                    error: e.to_string(),
                });
                Err(e)
            }
        };
        // The old committed root goes first, under the lock: its release list holds the space
        // this commit freed, and a caller that waited for the lock (an ENOSPC retry) must find
        // that space back. Freeing the frozen items (the last reference to them is ours once the
        // new root is published) happens outside the lock; the next commit may start now.
        drop(committed);
        drop(_commit);
        drop(frozen);
        result
    }

    /// Freezes the running delta under the gate: takes it and the queued snapshot ops (their
    /// holds change with this commit), and starts the next generation. `None` when there is
    /// nothing to commit.
    fn freeze(&self) -> Result<Option<Frozen>> {
        let _gate = self.gate.write();
        let generation = Generation::new(self.running_generation.load(Ordering::SeqCst));
        let mut snapshots = self.snapshots.lock();
        let idle = self.active.is_empty()
            && self.alloc.pinned_blocks() == BlockCount::new(0)
            && self.ids.high_water() == self.superblock.lock().next_objectid
            && snapshots.pending.is_empty()
            && !self.superblock_changed.load(Ordering::SeqCst);
        if idle {
            return Ok(None);
        }
        self.superblock_changed.store(false, Ordering::SeqCst);
        let rollback = snapshots
            .pending
            .iter()
            .any(|op| matches!(op, SnapshotOp::Rollback { .. }));
        if rollback && !self.active.is_empty() {
            // The rollback's tree is the snapshot's: a change made since its caller's
            // commit would be lost. Every queued snapshot op goes with it, other callers'
            // too (a known gap: a create queued meanwhile then fails in `made_snapshot`,
            // and a deletion queued meanwhile does not happen though its caller is told
            // it did).
            snapshots.pending.clear();
            return Err(Error::Invalid(
                "rollback: the filesystem changed while it waited for its commit".into(),
            ));
        }
        // Snapshot changes take effect for every free after this commit's: a new one holds
        // what later generations free, a deleted one nothing freed after this commit.
        let ops = std::mem::take(&mut snapshots.pending);
        for op in &ops {
            match op {
                SnapshotOp::Create { .. } => self.alloc.add_hold(generation),
                SnapshotOp::Delete { id } => {
                    if let Some(s) = snapshots.by_id(*id) {
                        self.alloc.drop_hold(SnapshotHold {
                            generation: Generation::new(s.generation),
                            dropped_in: generation,
                        });
                    }
                }
                // Frees nothing through the allocator's holds: the replaced tree's blocks
                // are given back by the deletion walk once the commit is durable.
                SnapshotOp::Rollback { .. } => {}
            }
        }
        drop(snapshots);
        let frozen = Arc::new(self.active.take());
        self.running_generation
            .store(generation.next().get(), Ordering::SeqCst);
        let mut state = self.state.write();
        state.each(|s| s.frozen = Some(frozen.clone()));
        Ok(Some(Frozen {
            committed: state.first().committed.0.clone(),
            delta: frozen,
            generation,
            ops,
        }))
    }

    /// Waits until no mutation holds the gate: every `WriteTxn` begun before this call has
    /// ended. No lock may be held by the caller that a mutation waits for.
    pub fn barrier(&self) {
        drop(self.gate.write());
    }

    /// Takes the commit lock. A caller that finds it held helps with the jobs of the commit
    /// in progress while it waits (see [`Board`]).
    fn lock_commit(&self) -> CommitGuard<'_> {
        if let Some(guard) = self.commits.lock.try_lock() {
            return CommitGuard {
                engine: self,
                guard: Some(guard),
            };
        }
        let start = std::time::Instant::now();
        let guard = loop {
            let board = self.commits.board.lock().clone();
            if let Some(board) = board {
                let helping = std::time::Instant::now();
                board.work(self, true);
                let helped = helping.elapsed().as_micros() as u64;
                self.counters.add(|c| &c.commit_help_us, helped);
            }
            let (lock, cvar) = &self.commits.events;
            let mut epoch = lock.lock();
            if let Some(guard) = self.commits.lock.try_lock() {
                break guard;
            }
            // A board posted since the look above bumped the epoch before this lock was
            // taken, or bumps it after the wait below begins: either way it is seen.
            if self
                .commits
                .board
                .lock()
                .as_ref()
                .is_some_and(|b| b.has_unclaimed())
            {
                continue;
            }
            let seen = *epoch;
            while *epoch == seen {
                cvar.wait(&mut epoch);
            }
        };
        let waited = start.elapsed().as_micros() as u64;
        self.counters.add(|c| &c.commit_wait_us, waited);
        CommitGuard {
            engine: self,
            guard: Some(guard),
        }
    }

    /// The smallest commit, in changed items, whose apply is cut into jobs that waiting
    /// committers help with (default 16,384). Tests lower it to run the parallel apply on
    /// small trees.
    pub fn set_parallel_apply_min(&self, items: usize) {
        self.commits
            .parallel_apply_min
            .store(items, Ordering::Relaxed);
    }

    /// Applies `frozen` to the tree of `writer`; returns the nodes already written (by jobs).
    fn apply(
        &self,
        writer: &mut TreeWriter<'_>,
        frozen: &Arc<FrozenDelta>,
        generation: Generation,
    ) -> Result<Vec<Arc<Node>>> {
        #[cfg(feature = "seed-before")]
        if self.commits.bench_apply_per_item.load(Ordering::Relaxed) {
            apply_per_item(writer, &frozen.sorted())?;
            return Ok(Vec::new());
        }
        let min = self.commits.parallel_apply_min.load(Ordering::Relaxed);
        let planned = if frozen.len() >= min.max(1) {
            let sample = frozen.sample(PARALLEL_SAMPLE_STEP);
            parallel::plan(
                self.ctx(),
                writer.root(),
                &sample,
                PARALLEL_SAMPLE_STEP,
                PARALLEL_APPLY_JOBS,
            )?
        } else {
            None
        };
        let Some(mut plan) = planned else {
            // One descent per leaf of changed items, not one per item.
            writer.apply_sorted(&frozen.sorted())?;
            return Ok(Vec::new());
        };
        let jobs = std::mem::take(&mut plan.jobs);
        let board = Arc::new(Board {
            outputs: Mutex::new(jobs.iter().map(|_| None).collect()),
            jobs: jobs.into_iter().map(|j| Mutex::new(Some(j))).collect(),
            next: AtomicUsize::new(0),
            done: Condvar::new(),
            frozen: frozen.clone(),
            generation,
        });
        *self.commits.board.lock() = Some(board.clone());
        self.commits.event();
        board.work(self, false);
        let results = board.wait_all();
        *self.commits.board.lock() = None;
        let outputs = results.into_iter().collect::<Result<Vec<JobOutput>>>()?;
        parallel::assemble(writer, plan, outputs)
    }

    /// Writes one commit, in the order crash safety rests on: the log's placed data blocks;
    /// the new tree (the frozen delta applied, its dirty nodes written) and the snapshot list;
    /// flush; the superblock of `generation` (slot `generation` mod 2), retiring the log
    /// batches it makes redundant; flush. Only then, durable: publish the new committed root,
    /// give back what deleted snapshots alone held, hand the old root the space this commit
    /// freed (released once no reader observes it), and discard what nothing references.
    fn write_commit(
        &self,
        frozen: &Arc<FrozenDelta>,
        generation: Generation,
        committed: &CommittedRoot,
        ops: &[SnapshotOp],
    ) -> Result<()> {
        // Blocks whose bytes only the log holds go in place first: the flush below makes
        // them durable before any superblock names them.
        self.write_log_placed(generation)?;
        let NewTree {
            root,
            mut nodes,
            replaced,
        } = match rollback_target(ops) {
            // The freeze made sure the delta is empty: no fs node is written.
            Some(id) => self.rollback_tree(id, generation, committed)?,
            None => self.apply_and_write(frozen, generation, committed)?,
        };
        let mut sb = self.superblock.lock().clone();
        let mut list_change = if ops.is_empty() {
            None
        } else {
            let (list, deleted, before) =
                self.write_snapshot_list(ops, generation, root, &mut sb, &mut nodes)?;
            Some(ListChange {
                list,
                deleted,
                before,
            })
        };
        self.flush_commit(generation, "flush nodes")?;
        self.fill_superblock(&mut sb, generation, root);
        let (log_head, log_seq) = self.log.retire(generation);
        sb.log_head = log_head.get();
        sb.log_generation = log_seq;
        self.write_superblock(&sb)?;
        self.flush_commit(generation, "flush superblock")?;
        self.log.set_reusable(log_head);
        if sb.incompat & INCOMPAT_LOG_ALIGNED != 0 {
            // Durable with the flag: every replay now looks for skipped batches.
            self.log.set_align(self.device.atomic_unit());
        }
        // Durable. Publish the new committed root; the old one releases the space this commit
        // freed once its last reader drops it.
        let new_release = ReleaseOnDrop::new(self.alloc.clone());
        let old = self.publish(
            sb,
            generation,
            root,
            nodes,
            &new_release,
            list_change.as_mut(),
        );
        self.give_back_snapshots(generation, root, list_change, replaced);
        self.release_freed(generation, &old);
        // Space no committed root (backups included) references any more is discarded on the
        // device before any search can hand it out (DESIGN §14.4); a failed discard leaves
        // it deferred, and the commit stands.
        self.discard_unreferenced(generation);
        *old.release.next.lock() = Some(new_release);
        self.counters.add(|c| &c.commits, 1);
        Ok(())
    }

    /// Writes in place the data blocks whose bytes only the fsync log holds.
    fn write_log_placed(&self, generation: Generation) -> Result<()> {
        self.pending().write_out(&*self.device).map_err(|e| {
            Error::io(
                format!("commit {generation}: write data blocks placed by the log"),
                e,
            )
        })?;
        Ok(())
    }

    /// A rollback's new tree: the snapshot `id`'s, replacing the live tree of `committed`.
    fn rollback_tree(
        &self,
        id: u64,
        generation: Generation,
        committed: &CommittedRoot,
    ) -> Result<NewTree> {
        let target = self.snapshots.lock().by_id(id).cloned();
        let target = target.ok_or_else(|| {
            Error::Invalid(format!(
                "commit {generation}: rollback to snapshot id {id}: no such snapshot"
            ))
        })?;
        // The live tree the rollback replaces, as a snapshot the commit deletes.
        let replaced = Snapshot {
            id: u64::MAX,
            name: "(the live tree before the rollback)".into(),
            generation: committed.generation.get(),
            root: committed.root,
            created: birch_format::items::Timespec { sec: 0, nsec: 0 },
        };
        Ok(NewTree {
            root: target.root,
            nodes: Vec::new(),
            replaced: Some(replaced),
        })
    }

    /// Applies the frozen delta to a copy of the committed tree and writes its dirty nodes.
    fn apply_and_write(
        &self,
        frozen: &Arc<FrozenDelta>,
        generation: Generation,
        committed: &CommittedRoot,
    ) -> Result<NewTree> {
        let mut writer = TreeWriter::new(self.ctx(), &self.alloc, generation, committed.root);
        let mut nodes = self.apply(&mut writer, frozen, generation)?;
        nodes.extend(writer.write_dirty()?);
        Ok(NewTree {
            root: writer.root(),
            nodes,
            replaced: None,
        })
    }

    /// Flushes the device; `what` names the step in the error.
    fn flush_commit(&self, generation: Generation, what: &str) -> Result<()> {
        self.device
            .flush()
            .map_err(|e| Error::io(format!("commit {generation}: {what}"), e))
    }

    /// Fills in the superblock of `generation` naming `root` (all but its log head).
    fn fill_superblock(&self, sb: &mut Superblock, generation: Generation, root: RootPtr) {
        let (sec, nsec) = now();
        sb.incompat |= self.incompat_wanted.load(Ordering::SeqCst);
        sb.backup_roots = backups_after(sb, self.alloc.backup_floor());
        sb.compat |= COMPAT_BACKUP_ROOTS | COMPAT_DEVICE_STATS;
        sb.device_stats = self.device_stats();
        sb.generation = generation.get();
        sb.fs_root = root;
        sb.next_objectid = self.ids.high_water();
        sb.bytes_used = (self.alloc.total_blocks() - self.alloc.free_blocks()).bytes();
        sb.commit_time_sec = sec;
        sb.commit_time_nsec = nsec;
    }

    /// Publishes a durable commit: its nodes into the cache, its superblock, the new snapshot
    /// list, then the new committed root (releasing through `release`). Returns the old root.
    fn publish(
        &self,
        sb: Superblock,
        generation: Generation,
        root: RootPtr,
        nodes: Vec<Arc<Node>>,
        release: &Arc<ReleaseOnDrop>,
        list_change: Option<&mut ListChange>,
    ) -> Arc<CommittedRoot> {
        for node in nodes {
            self.cache.insert(node);
        }
        *self.superblock.lock() = sb;
        let new_root = Arc::new(CommittedRoot {
            root,
            generation,
            release: release.clone(),
        });
        // The new list before the new root: a snapshot view that still finds a deleted
        // snapshot then holds a root older than this one, whose release list keeps what the
        // deletion frees (`Engine::snapshot_view`).
        if let Some(change) = list_change {
            self.snapshots.lock().list = std::mem::take(&mut change.list);
        }
        let mut state = self.state.write();
        let old = state.first().committed.0.clone();
        state.each(|s| {
            s.frozen = None;
            s.committed = Arc::new(CommittedRootPin(new_root.clone()));
        });
        old
    }

    /// The snapshot deletion walk, once durable: gives back what the deleted snapshots (and
    /// a rollback's replaced tree) alone held, and forgets their holds.
    fn give_back_snapshots(
        &self,
        generation: Generation,
        root: RootPtr,
        list_change: Option<ListChange>,
        replaced: Option<Snapshot>,
    ) {
        let Some(ListChange {
            mut deleted,
            mut before,
            ..
        }) = list_change
        else {
            return;
        };
        if let Some(replaced) = replaced {
            before.push(replaced.clone());
            deleted.push(replaced);
        }
        self.give_back_deleted(generation, root, &before, &deleted);
        self.alloc.forget_holds(generation);
    }

    /// Hands `old` the space this commit freed: pinned until then, it is released once the
    /// old root's last reader drops it.
    fn release_freed(&self, generation: Generation, old: &CommittedRoot) {
        let freed = self.alloc.take_pinned(generation);
        self.alloc.unpin_count(freed.iter().map(|(_, b)| b).sum());
        old.release
            .freed_by
            .store(generation.get(), Ordering::SeqCst);
        old.release.ranges.lock().extend(freed);
    }

    /// Discards the space no committed root references any more now that `generation` is
    /// durable; a failure is logged and leaves it deferred.
    fn discard_unreferenced(&self, generation: Generation) {
        let device = &self.device;
        let discarded = self
            .alloc
            .commit_durable_with(generation, |ranges| device.discard(&discard_ranges(ranges)));
        if let Err(e) = discarded {
            log::warn!("commit {generation}: discarding freed space: {e}");
        }
    }
}
