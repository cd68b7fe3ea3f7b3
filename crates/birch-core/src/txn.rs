//! The engine: transactions, commit, and the read path over delta and committed tree.
//!
//! Owns: generation numbers, the running and frozen deltas, the committed root, the commit
//! order (write nodes, flush, write superblock N to slot N mod 2, flush), releasing pinned
//! space once a commit is durable and unobserved, the object id high-water mark, the
//! sticky read-only state after a failed commit, and the shutdown (its device [`Fence`]:
//! once shut down, no I/O reaches the image and every call fails with [`Error::Shutdown`]).
//!
//! Must not touch: files, inodes, names, FUSE. It never holds a lock across a flush: the
//! `gate` (shared by every mutation, exclusive only for the in-memory freeze) and the state
//! lock are released before any I/O. Readers never wait for a commit: they read the running
//! delta, then the frozen one, then the immutable committed root.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use birch_format::node::{Node, NodeBody};
use birch_format::superblock::{
    BackupRoot, RootPtr, Superblock, BACKUP_ROOTS, COMPAT_BACKUP_ROOTS, INCOMPAT_LOG_ALIGNED,
    INCOMPAT_SNAPSHOTS, RESERVED_HEAD_BYTES, SUPER_BYTES, SUPER_OFFSETS,
};
use birch_format::{
    BlockAddr, BlockCount, FormatError, Generation, InodeNo, ItemType, Key, Lsn,
    FIRST_FREE_OBJECTID, FORMAT_VERSION, FS_TREE_ID, NODE_BLOCKS, NODE_SIZE, OBJECTID_LIMIT,
    SNAPSHOT_ID_LIMIT, SUBVOLUME_SHIFT,
};
use parking_lot::{Condvar, Mutex, MutexGuard, RwLock};

use crate::pending::PendingData;
use crate::striped::Striped;

use crate::alloc::{Allocator, Purpose};
use crate::btree::parallel::{self, Job, JobOutput};
use crate::btree::{TreeCtx, TreeReader, TreeWriter};
use crate::cache::NodeCache;
use crate::counters::{Counters, LatencyHistogram};
use crate::delta::{merge_layers, Delta, DeltaValue, FrozenDelta};
use crate::device::{BlockDevice, Fence};
use crate::error::{Error, Result};
use crate::ids::{batch_aligned, OBJECTID_BATCH};
use crate::log::{read_log, FsyncLog, LogOutcome, Replay};
use crate::readonly::ReadOnlyCause;
use crate::snapshot::{self, Snapshot, SnapshotOp};
use birch_format::log::LogRecord;

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
    generation: u64,
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

/// The commit lock; releasing it wakes the callers waiting for it.
struct CommitGuard<'e> {
    engine: &'e Engine,
    guard: Option<MutexGuard<'e, ()>>,
}

impl Drop for CommitGuard<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        self.engine.commit_event();
    }
}

/// Options of a new image.
#[derive(Debug, Clone, Default)]
pub struct MkfsOptions {
    /// Volume label, stored in the superblock; at most 63 bytes are kept, longer ones are cut.
    pub label: String,
    /// Bytes of the fsync log area; 0 picks 1/64 of the device, between 4 and 128 MiB.
    pub log_bytes: u64,
}

/// Space released when no committed root that could still read it is held. The list of
/// committed root N holds what commit N+1 freed; it also holds the list of root N+1 (`next`),
/// so a list is dropped, and its space released, only after its own root and every older one
/// are let go. Released space is deferred, not freed: see [`Allocator::defer`].
struct ReleaseOnDrop {
    alloc: Arc<Allocator>,
    /// The commit that freed `ranges` (the one after this list's committed root).
    freed_by: AtomicU64,
    ranges: Mutex<Vec<(BlockAddr, BlockCount)>>,
    next: Mutex<Option<Arc<ReleaseOnDrop>>>,
}

impl ReleaseOnDrop {
    fn new(alloc: Arc<Allocator>) -> Arc<ReleaseOnDrop> {
        Arc::new(ReleaseOnDrop {
            alloc,
            freed_by: AtomicU64::new(0),
            ranges: Mutex::new(Vec::new()),
            next: Mutex::new(None),
        })
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        let ranges = std::mem::take(&mut *self.ranges.lock());
        if !ranges.is_empty() {
            let freed_by = Generation::new(self.freed_by.load(Ordering::SeqCst));
            self.alloc.defer(freed_by, &ranges);
        }
    }
}

/// The read state of one committed, immutable tree version: its root and generation, and,
/// while it is held, a pin on every block later commits free. The engine's own, not a user
/// snapshot of the filesystem.
pub struct CommittedRoot {
    /// Root of the filesystem tree as of this commit.
    pub root: RootPtr,
    /// Generation (commit number) that wrote this tree. While the committed root is held,
    /// space freed by later commits stays pinned.
    pub generation: Generation,
    release: Arc<ReleaseOnDrop>,
}

/// What readers need besides the active delta; each stripe of [`Engine::state`] has a copy.
struct ReadState {
    frozen: Option<Arc<FrozenDelta>>,
    /// The current committed root behind a pin of this stripe's own: a reader clones the pin,
    /// so readers of different stripes count references on different cache lines.
    committed: Arc<CommittedRootPin>,
}

/// One stripe's hold on the current committed root (see [`ReadState::committed`]).
struct CommittedRootPin(Arc<CommittedRoot>);

impl std::ops::Deref for CommittedRootPin {
    type Target = CommittedRoot;
    fn deref(&self) -> &CommittedRoot {
        &self.0
    }
}

/// The copy-on-write engine over one device.
pub struct Engine {
    /// The fence, as the device every I/O of the engine and the filesystem goes through.
    device: Arc<dyn BlockDevice>,
    fence: Arc<Fence>,
    cache: NodeCache,
    alloc: Arc<Allocator>,
    counters: Counters,
    /// How long each commit took from its freeze until its superblock was durable.
    commit_latency: LatencyHistogram,
    /// How long each fsync and fdatasync took, as its caller saw it (`Filesystem::fsync`).
    fsync_latency: LatencyHistogram,
    fsid: [u8; 16],
    /// Shared by every mutation of the running delta; exclusive only for the freeze.
    gate: Striped<()>,
    active: Delta,
    running_generation: AtomicU64,
    state: Striped<ReadState>,
    commit_lock: Mutex<()>,
    /// Bumped (and waiters woken) when the commit lock is released and when a commit posts
    /// jobs for waiters to help with.
    commit_events: (Mutex<u64>, Condvar),
    /// The jobs of the parallel apply in progress, if any.
    board: Mutex<Option<Arc<Board>>>,
    /// Commits of at least this many changed items cut their apply into jobs.
    parallel_apply_min: AtomicUsize,
    superblock: Mutex<Superblock>,
    /// Incompat feature flags the next commit sets (a change that needs one was recorded).
    incompat_wanted: AtomicU64,
    next_objectid: AtomicU64,
    /// Benchmark-only switch (seed 002's "before", [`Engine::set_bench_global_objectid_lock`]):
    /// every object id is taken one at a time under [`Engine::objectid_lock`].
    bench_global_objectid_lock: AtomicBool,
    /// The one lock on the id counter while `bench_global_objectid_lock` is on; unused otherwise.
    objectid_lock: Mutex<()>,
    /// Benchmark-only switch (seed 003's "before", [`Engine::set_bench_apply_per_item`]): the
    /// commit apply deletes and inserts each extent item in a descent of its own.
    bench_apply_per_item: AtomicBool,
    read_only: RwLock<Option<ReadOnlyCause>>,
    /// Whether `read_only` holds a cause: every mutation asks, so the common answer (no)
    /// costs one load instead of a lock on a line every core writes.
    read_only_set: AtomicBool,
    instance: u64,
    log: FsyncLog,
    replay: Mutex<Option<Replay>>,
    /// The snapshots as of the last durable commit, and the changes the next commit makes.
    /// Taken only briefly (never across I/O); inside the gate at a freeze.
    snapshots: Mutex<SnapshotState>,
}

/// [`Engine::snapshots`]' state.
#[derive(Default)]
struct SnapshotState {
    /// Oldest first (ids and generations ascend together).
    list: Vec<Snapshot>,
    /// Queued by [`Engine::create_snapshot`] and [`Engine::delete_snapshot`] for the next
    /// freeze.
    pending: Vec<SnapshotOp>,
}

/// Seed 003's "before" (`bench_apply_per_item`): each changed extent item costs a delete (a
/// lookup, and a descent when the item exists) and an insert descent of its own; the other
/// items still go in one descent per leaf.
fn apply_per_item(writer: &mut TreeWriter<'_>, changes: &[(Key, Option<&[u8]>)]) -> Result<()> {
    let (extents, rest): (Vec<_>, Vec<_>) = changes
        .iter()
        .partition(|(key, _)| key.kind() == Some(ItemType::ExtentData));
    writer.apply_sorted(&rest)?;
    for (key, value) in extents {
        writer.delete(&key)?;
        if let Some(value) = value {
            writer.insert(key, value.to_vec())?;
        }
    }
    Ok(())
}

static INSTANCES: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static OBJECTID_RANGES: RefCell<HashMap<u64, (u64, u64)>> = RefCell::new(HashMap::new());
}

/// Refuses an object id at or past [`OBJECTID_LIMIT`] (DESIGN §7: the bits above name a
/// subvolume). The counter may run past the limit; no id past it is ever handed out.
fn check_objectid(id: u64) -> Result<()> {
    if id >= OBJECTID_LIMIT {
        return Err(Error::NoSpace(format!(
            "new inode: every object id below 2^{SUBVOLUME_SHIFT} is used"
        )));
    }
    Ok(())
}

fn now() -> (i64, u32) {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    (d.as_secs() as i64, d.subsec_nanos())
}

fn random_fsid() -> [u8; 16] {
    let mut id = [0u8; 16];
    if let Ok(bytes) = std::fs::read("/proc/sys/kernel/random/uuid") {
        let hexes: Vec<u8> = bytes
            .iter()
            .filter(|b| b.is_ascii_hexdigit())
            .copied()
            .collect();
        for (i, pair) in hexes.chunks(2).take(16).enumerate() {
            let s = std::str::from_utf8(pair).unwrap_or("0");
            id[i] = u8::from_str_radix(s, 16).unwrap_or(0);
        }
    }
    let (sec, nsec) = now();
    id[0] ^= sec as u8;
    id[1] ^= nsec as u8;
    id
}

/// Where the log area goes and how big it is.
fn log_area(total_bytes: u64, requested: u64) -> (u64, u64) {
    let bytes = if requested > 0 {
        requested
    } else {
        (total_bytes / 64).clamp(4 << 20, 128 << 20)
    };
    let bytes = bytes.min(total_bytes / 8) / birch_format::BLOCK_SIZE * birch_format::BLOCK_SIZE;
    (RESERVED_HEAD_BYTES, bytes)
}

/// What [`Engine::open`] reads before it walks the tree: the superblock (with notes on its
/// copies) and the batches of the fsync log. A read-only open reads it first to learn
/// whether a log is pending ([`OpenHead::log_pending`]), then hands it to
/// [`Engine::open_from`], so neither is read twice.
pub struct OpenHead {
    superblock: Superblock,
    notes: Vec<String>,
    replay: Replay,
}

impl OpenHead {
    /// Reads the superblock and the log of `device` (no tree node).
    pub fn read(device: &dyn BlockDevice) -> Result<OpenHead> {
        let (superblock, notes) = Engine::read_superblock(device)?;
        let replay = read_log(device, &superblock);
        Ok(OpenHead {
            superblock,
            notes,
            replay,
        })
    }

    /// Whether the log holds records ([`Engine::replay_pending`] of the engine this opens).
    pub fn log_pending(&self) -> bool {
        !self.replay.records.is_empty()
    }
}

impl Engine {
    pub(crate) fn ctx(&self) -> TreeCtx<'_> {
        TreeCtx {
            device: &*self.device,
            cache: &self.cache,
            counters: &self.counters,
            fsid: self.fsid,
            owner: FS_TREE_ID,
        }
    }

    /// The fsid of the image.
    pub fn fsid(&self) -> [u8; 16] {
        self.fsid
    }

    /// Empties the node cache (benchmarks and tests measure cold walks with it).
    pub fn clear_node_cache(&self) {
        self.cache.clear();
    }

    /// Engine counters (device counters are separate: [`Engine::device`]).
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Latencies of the commits that wrote something (freeze to durable superblock).
    pub fn commit_latency(&self) -> &LatencyHistogram {
        &self.commit_latency
    }

    /// Latencies of fsync and fdatasync calls (recorded by the filesystem layer).
    pub fn fsync_latency(&self) -> &LatencyHistogram {
        &self.fsync_latency
    }

    /// Bytes of the log area that hold batches no durable commit has covered yet, and the
    /// size of the area: how close fsyncs are to falling back to commits for want of room.
    pub fn log_fill_bytes(&self) -> (u64, u64) {
        self.log.fill_bytes()
    }

    /// The device, behind the engine's shutdown fence: I/O through it fails once the engine
    /// is shut down.
    pub fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.device
    }

    /// Discards the space free now in device bytes `[start, start + len)`, in free runs of
    /// at least `minlen` bytes (`fstrim`, the `FITRIM` ioctl; DESIGN §14.4): the space free at
    /// mount, and any freed since, is otherwise never discarded. Runs are taken out of the
    /// allocator's searches while their discard is in flight, a batch at a time
    /// ([`Allocator::trim_free`]), so no allocation gets a block under discard and none waits
    /// long. Returns the bytes discarded. `NotSupported` when the device frees nothing on a
    /// discard (image files, block devices; an RBD image trims even with `discard=off`);
    /// `ReadOnly` on a read-only filesystem; `Invalid` for a range shorter than a block, as
    /// Linux filesystems answer. Does device I/O.
    pub fn trim(&self, start: u64, len: u64, minlen: u64) -> Result<u64> {
        if self.is_shut_down() {
            return Err(Error::Shutdown);
        }
        if let Some(cause) = self.read_only_cause() {
            return Err(Error::ReadOnly(cause));
        }
        if !self.device.can_trim() {
            return Err(Error::NotSupported(
                "trim: this device frees nothing on a discard (only an RBD image does)".to_string(),
            ));
        }
        let block = birch_format::BLOCK_SIZE;
        if len < block {
            return Err(Error::Invalid(format!(
                "trim: range length {len} is shorter than a block ({block})"
            )));
        }
        let size = self.device.size_bytes();
        if start >= size {
            return Err(Error::Invalid(format!(
                "trim: range start {start} is at or past the end of the device ({size} bytes)"
            )));
        }
        let end = start.saturating_add(len);
        let device = &self.device;
        let blocks = self
            .alloc
            .trim_free(
                start.div_ceil(block),
                end / block,
                minlen.div_ceil(block),
                |ranges| device.trim(&discard_ranges(ranges)),
            )
            .map_err(|e| Error::io(format!("trim of free space in {start:#x}..{end:#x}"), e))?;
        Ok(blocks * block)
    }

    /// The device the engine was opened on (without the fence): to open it again.
    pub fn base_device(&self) -> &Arc<dyn BlockDevice> {
        self.fence.base()
    }

    /// Shuts the engine down: waits for device I/O in flight, then lets none through, and
    /// every later call fails with [`Error::Shutdown`]. The image stays as a power cut at
    /// this moment would leave it (the next open replays the log). Returns whether this call
    /// shut it down (false: it was down already).
    pub fn shut_down(&self) -> bool {
        let first = self.fence.shut_down();
        // Mutations take the slow path of `begin`, which finds the shutdown.
        self.read_only_set.store(true, Ordering::SeqCst);
        // No leader comes for deferred waits any more (`log_wait` and `log_lead` refuse).
        self.log.abandon_deferred();
        if first {
            log::warn!(
                "birchfs is shut down: nothing more reaches the image (durable: commit {})",
                self.committed_generation()
            );
        }
        first
    }

    /// Whether the engine is shut down.
    pub fn is_shut_down(&self) -> bool {
        self.fence.is_down()
    }

    /// `Err(Error::Shutdown)` once the engine is shut down.
    pub fn check_up(&self) -> Result<()> {
        if self.fence.is_down() {
            return Err(Error::Shutdown);
        }
        Ok(())
    }

    /// Writes the fsync records queued so far (group commit: waits for a batch in flight) and
    /// returns once they are durable. The `log` variant of a shutdown runs this first.
    pub fn log_flush(&self) -> Result<LogOutcome> {
        self.log_wait(self.log.enqueue(Vec::new()))
    }

    /// Data blocks placed by the log and not yet written in place ([`PendingData`]).
    pub(crate) fn pending(&self) -> &PendingData {
        self.log.placed()
    }

    /// Whether every incompat flag of `bits` is in the last durable superblock.
    pub fn incompat_durable(&self, bits: u64) -> bool {
        self.superblock.lock().incompat & bits == bits
    }

    /// The allocator.
    pub fn allocator(&self) -> &Allocator {
        &self.alloc
    }

    /// A copy of the last committed superblock.
    pub fn superblock(&self) -> Superblock {
        self.superblock.lock().clone()
    }

    /// Asks the next commit to set incompat feature flag(s) `bits`. Call it before recording
    /// the change that needs them: a commit reads the wanted flags after it froze its changes,
    /// so the commit that holds the change sets them.
    pub fn want_incompat(&self, bits: u64) {
        self.incompat_wanted.fetch_or(bits, Ordering::SeqCst);
    }

    /// Whether an incompat flag is wanted that no durable commit has set yet: an fsync must
    /// then commit (a log record needing the flag must not be replayable on an image without
    /// it). Not `INCOMPAT_LOG_DATA`: the records that need it (data records) are logged only
    /// once it is durable ([`Engine::incompat_durable`]), and other records do not need it.
    pub fn incompat_pending(&self) -> bool {
        let wanted = self.incompat_wanted.load(Ordering::SeqCst)
            & !(birch_format::superblock::INCOMPAT_LOG_DATA | INCOMPAT_LOG_ALIGNED);
        wanted != 0 && wanted & !self.superblock.lock().incompat != 0
    }

    /// Creates a new filesystem tree on `device` and commits it twice (generations 1 and 2),
    /// so that both superblock slots hold a valid copy.
    /// `initial` items (the root directory) go into the first tree, so no durable state ever
    /// lacks them.
    pub fn create(
        device: Arc<dyn BlockDevice>,
        options: &MkfsOptions,
        initial: Vec<(Key, Vec<u8>)>,
    ) -> Result<Arc<Engine>> {
        let total_bytes = device.size_bytes();
        let (log_start, log_bytes) = log_area(total_bytes, options.log_bytes);
        if total_bytes < RESERVED_HEAD_BYTES + log_bytes + 64 * NODE_SIZE as u64 {
            return Err(Error::Invalid(format!(
                "device of {total_bytes} bytes is too small (need at least {} bytes)",
                RESERVED_HEAD_BYTES + log_bytes + 64 * NODE_SIZE as u64
            )));
        }
        // Write the log area out once: a sparse image would make each first write into it a
        // host-filesystem allocation (and journal commit) on the fsync path. In batches of
        // 1 MiB writes (in flight together on RBD).
        let zeros = vec![0u8; 1 << 20];
        let mut at = log_start;
        while at < log_start + log_bytes {
            let mut batch: Vec<(u64, &[u8])> = Vec::new();
            let batch_start = at;
            while at < log_start + log_bytes && batch.len() < 64 {
                let len = (log_start + log_bytes - at).min(zeros.len() as u64) as usize;
                batch.push((at, &zeros[..len]));
                at += len as u64;
            }
            device
                .write_many(&batch)
                .map_err(|e| Error::io(format!("mkfs: write log area at {batch_start:#x}"), e))?;
        }
        // Clear both superblock slots, so an older filesystem's copy cannot win.
        let clear = [0u8; SUPER_BYTES];
        let clears: Vec<(u64, &[u8])> = SUPER_OFFSETS.iter().map(|o| (*o, &clear[..])).collect();
        device
            .write_many(&clears)
            .map_err(|e| Error::io("mkfs: clear superblock", e))?;
        let fsid = random_fsid();
        let alloc = Arc::new(Allocator::new(total_bytes));
        mark_reserved_areas(&alloc, log_start, log_bytes);
        let (sec, nsec) = now();
        let superblock = Superblock {
            version: FORMAT_VERSION,
            block_size: birch_format::BLOCK_SIZE as u32,
            node_size: NODE_SIZE as u32,
            fsid,
            label: options.label.clone(),
            generation: 0,
            incompat: 0,
            compat: COMPAT_BACKUP_ROOTS,
            ro_compat: 0,
            total_bytes,
            bytes_used: 0,
            fs_root: RootPtr::default(),
            next_objectid: FIRST_FREE_OBJECTID,
            log_start,
            log_bytes,
            log_head: 0,
            log_generation: 1,
            commit_time_sec: sec,
            commit_time_nsec: nsec,
            backup_roots: Vec::new(),
            snapshots: RootPtr::default(),
            next_snapshot_id: 0,
        };
        let counters = Counters::default();
        let cache = NodeCache::new(4096);
        let root = {
            let ctx = TreeCtx {
                device: &*device,
                cache: &cache,
                counters: &counters,
                fsid,
                owner: FS_TREE_ID,
            };
            let mut writer = TreeWriter::create(ctx, &alloc, 1)?;
            for (key, value) in initial {
                writer.insert(key, value)?;
            }
            for node in writer.write_dirty()? {
                cache.insert(node);
            }
            writer.root()
        };
        let engine = Engine::assemble(
            device,
            alloc,
            fsid,
            superblock,
            RootPtr {
                generation: 0,
                ..root
            },
            counters,
            cache,
            None,
        );
        // Generation 1 carries the empty root; write it as a real commit.
        engine.write_superblock_pair(root)?;
        Ok(engine)
    }

    fn assemble(
        device: Arc<dyn BlockDevice>,
        alloc: Arc<Allocator>,
        fsid: [u8; 16],
        superblock: Superblock,
        root: RootPtr,
        counters: Counters,
        cache: NodeCache,
        replay: Option<Replay>,
    ) -> Arc<Engine> {
        let generation = superblock.generation;
        let log = match &replay {
            Some(r) => FsyncLog::new(&superblock, r.tail_lsn, r.next_seq),
            None => FsyncLog::new(
                &superblock,
                Lsn::new(superblock.log_head),
                superblock.log_generation,
            ),
        };
        let device_unit = device.atomic_unit();
        if superblock.incompat & INCOMPAT_LOG_ALIGNED != 0 {
            log.set_align(device_unit);
        }
        let committed = Arc::new(CommittedRoot {
            root,
            generation: Generation::new(generation),
            release: ReleaseOnDrop::new(alloc.clone()),
        });
        let fence = Arc::new(Fence::new(device));
        Arc::new(Engine {
            device: fence.clone(),
            fence,
            cache,
            alloc,
            counters,
            commit_latency: LatencyHistogram::default(),
            fsync_latency: LatencyHistogram::default(),
            fsid,
            gate: Striped::new(|| ()),
            active: Delta::default(),
            running_generation: AtomicU64::new(generation + 1),
            state: Striped::new(|| ReadState {
                frozen: None,
                committed: Arc::new(CommittedRootPin(committed.clone())),
            }),
            commit_lock: Mutex::new(()),
            commit_events: (Mutex::new(0), Condvar::new()),
            board: Mutex::new(None),
            parallel_apply_min: AtomicUsize::new(PARALLEL_APPLY_MIN),
            next_objectid: AtomicU64::new(batch_aligned(superblock.next_objectid)),
            bench_global_objectid_lock: AtomicBool::new(false),
            objectid_lock: Mutex::new(()),
            bench_apply_per_item: AtomicBool::new(false),
            superblock: Mutex::new(superblock),
            // A device with an atomic unit (RBD) asks for the flag that lets log batches start
            // at its boundaries; the first commit of a writable mount sets it.
            incompat_wanted: AtomicU64::new(if device_unit != 0 {
                INCOMPAT_LOG_ALIGNED
            } else {
                0
            }),
            read_only: RwLock::new(None),
            read_only_set: AtomicBool::new(false),
            instance: INSTANCES.fetch_add(1, Ordering::Relaxed),
            log,
            replay: Mutex::new(replay),
            snapshots: Mutex::new(SnapshotState::default()),
        })
    }

    /// mkfs helper: writes generation 1 (slot 1) and 2 (slot 0) with the new root.
    fn write_superblock_pair(&self, root: RootPtr) -> Result<()> {
        self.device
            .flush()
            .map_err(|e| Error::io("mkfs: flush", e))?;
        for generation in [1u64, 2] {
            let mut sb = self.superblock.lock();
            sb.generation = generation;
            sb.fs_root = root;
            self.write_superblock(&sb)?;
            self.device
                .flush()
                .map_err(|e| Error::io("mkfs: flush", e))?;
        }
        self.running_generation.store(3, Ordering::SeqCst);
        let committed = Arc::new(CommittedRoot {
            root,
            generation: Generation::new(2),
            release: ReleaseOnDrop::new(self.alloc.clone()),
        });
        self.state
            .write()
            .each(|state| state.committed = Arc::new(CommittedRootPin(committed.clone())));
        Ok(())
    }

    fn write_superblock(&self, sb: &Superblock) -> Result<()> {
        let offset = SUPER_OFFSETS[sb.slot()];
        self.device.write_at(&sb.encode(), offset).map_err(|e| {
            Error::io(
                format!(
                    "write superblock generation {} slot {}",
                    sb.generation,
                    sb.slot()
                ),
                e,
            )
        })?;
        self.counters.add(|c| &c.superblock_writes, 1);
        Ok(())
    }

    /// Reads both superblock slots and picks the newest valid one. Returns it and a note for
    /// each slot that was unreadable.
    pub fn read_superblock(device: &dyn BlockDevice) -> Result<(Superblock, Vec<String>)> {
        let mut best: Option<Superblock> = None;
        let mut notes = Vec::new();
        let mut errors = Vec::new();
        for (slot, offset) in SUPER_OFFSETS.iter().enumerate() {
            let mut bytes = vec![0u8; SUPER_BYTES];
            if let Err(e) = device.read_at(&mut bytes, *offset) {
                notes.push(format!("superblock slot {slot} at {offset:#x}: {e}"));
                errors.push(Error::io(format!("read superblock slot {slot}"), e));
                continue;
            }
            match Superblock::decode(&bytes, &format!("superblock slot {slot} at {offset:#x}")) {
                Ok(sb) if sb.slot() != slot => notes.push(format!(
                    "superblock slot {slot}: generation {} belongs in slot {}",
                    sb.generation,
                    sb.slot()
                )),
                Ok(sb) => {
                    if best.as_ref().is_none_or(|b| sb.generation > b.generation) {
                        best = Some(sb);
                    }
                }
                Err(e @ birch_format::FormatError::UnknownIncompat { .. })
                | Err(e @ birch_format::FormatError::BadVersion { .. }) => {
                    return Err(Error::corrupt(format!("superblock slot {slot}"), e));
                }
                Err(e) => {
                    notes.push(e.to_string());
                    errors.push(Error::corrupt(format!("superblock slot {slot}"), e));
                }
            }
        }
        if let Some(sb) = best {
            if sb.total_bytes > device.size_bytes() {
                return Err(Error::Invalid(format!(
                    "image is truncated: superblock says {} bytes, device has {}",
                    sb.total_bytes,
                    device.size_bytes()
                )));
            }
            return Ok((sb, notes));
        }
        // A slot that carries the magic but fails its checksum or its checks is damage to a
        // birchfs image (EIO); slots without the magic (or unreadable) are not birchfs at all.
        let damage = errors.into_iter().find_map(|e| match e {
            Error::Corrupt { source, .. }
                if !matches!(source, birch_format::FormatError::BadMagic { .. }) =>
            {
                Some(source)
            }
            _ => None,
        });
        match damage {
            Some(source) => Err(Error::corrupt(
                format!(
                    "damaged birchfs image, no valid superblock ({})",
                    notes.join("; ")
                ),
                source,
            )),
            None => Err(Error::Invalid(format!(
                "not a birchfs image (no valid superblock: {})",
                notes.join("; ")
            ))),
        }
    }

    /// Opens an existing image: reads the superblock, walks the tree to rebuild the free-space
    /// map, and returns the engine. May do much device I/O.
    pub fn open(device: Arc<dyn BlockDevice>) -> Result<Arc<Engine>> {
        Engine::open_inner(device, None)
    }

    /// [`Engine::open`] for `fsck --repair` (DESIGN §13.4): an extent whose blocks lie
    /// outside the device, in the reserved areas or on blocks a node or an earlier extent
    /// holds does not fail the open; its key is returned instead, for the repair to delete.
    /// Nodes must still all read.
    pub fn open_for_repair(device: Arc<dyn BlockDevice>) -> Result<(Arc<Engine>, Vec<Key>)> {
        let mut bad = Vec::new();
        let engine = Engine::open_inner(device, Some(&mut bad))?;
        Ok((engine, bad))
    }

    /// [`Engine::open`] from what [`OpenHead::read`] already read of `device` (the same
    /// bytes: `device` may be a fresh overlay of the device it was read from). Saves reading
    /// the superblock and the log again where the caller had to look at them first.
    pub fn open_from(device: Arc<dyn BlockDevice>, head: OpenHead) -> Result<Arc<Engine>> {
        Engine::open_head(device, head, None)
    }

    fn open_inner(
        device: Arc<dyn BlockDevice>,
        bad_extents: Option<&mut Vec<Key>>,
    ) -> Result<Arc<Engine>> {
        let head = OpenHead::read(&*device)?;
        Engine::open_head(device, head, bad_extents)
    }

    fn open_head(
        device: Arc<dyn BlockDevice>,
        head: OpenHead,
        bad_extents: Option<&mut Vec<Key>>,
    ) -> Result<Arc<Engine>> {
        let OpenHead {
            superblock,
            notes,
            replay,
        } = head;
        for note in notes {
            log::warn!("{note}");
        }
        let alloc = Arc::new(Allocator::new(superblock.total_bytes));
        mark_reserved_areas(&alloc, superblock.log_start, superblock.log_bytes);
        let fsid = superblock.fsid;
        let root = superblock.fs_root;
        let engine = Engine::assemble(
            device,
            alloc,
            fsid,
            superblock,
            root,
            Counters::default(),
            NodeCache::new(65536),
            Some(replay),
        );
        let mut seen = HashMap::new();
        engine.rebuild_allocator(&mut seen, bad_extents)?;
        engine.keep_snapshot_trees(&mut seen)?;
        engine.keep_backup_trees(&mut seen);
        Ok(engine)
    }

    /// The snapshot list and every snapshot's tree (DESIGN §15.4): the list's nodes and each
    /// snapshot's nodes and blocks that the live tree does not hold are marked used, and the
    /// allocator learns each snapshot, so that frees of the blocks they hold keep them. A
    /// list or a snapshot tree that does not read whole fails the open, naming it.
    fn keep_snapshot_trees(&self, seen: &mut HashMap<u64, u64>) -> Result<()> {
        let sb = self.superblock.lock().clone();
        if sb.incompat & INCOMPAT_SNAPSHOTS == 0 || sb.snapshots.addr == 0 {
            return Ok(());
        }
        let (list, nodes) = snapshot::read_list(self.ctx(), sb.snapshots)
            .map_err(|e| Error::Invalid(format!("open: snapshot list: {e} (run fsck)")))?;
        for addr in nodes {
            if !self
                .alloc
                .mark_used(BlockAddr::new(addr), BlockCount::new(NODE_BLOCKS))
            {
                return Err(Error::corrupt(
                    format!("open: snapshot list node {addr:#x}"),
                    FormatError::invalid(
                        format!("node {addr:#x}"),
                        "on blocks another tree holds",
                        "one reference to a free block",
                    ),
                ));
            }
        }
        snapshot::mark_snapshot_trees(self.ctx(), &self.alloc, &list, seen)?;
        for s in &list {
            self.alloc.add_hold(s.generation);
        }
        self.snapshots.lock().list = list;
        Ok(())
    }

    /// The snapshots, oldest first, as of the last durable commit.
    pub fn snapshots(&self) -> Vec<Snapshot> {
        self.snapshots.lock().list.clone()
    }

    /// Makes a snapshot named `name` of the filesystem as the commit this call runs leaves
    /// it (atomic with that commit; on an idle filesystem that commit writes the list's leaf
    /// and the superblock, whatever the size of the tree). Errors: a bad name
    /// ([`snapshot::check_name`]), a name in use (`Exists`), a read-only engine, the commit's.
    ///
    /// On a [`crate::Filesystem`] use its `create_snapshot`: this commit alone would record
    /// the sizes of buffered writes without their data, which only the filesystem's commit
    /// writes first.
    pub fn create_snapshot(&self, name: &str) -> Result<Snapshot> {
        self.queue_snapshot_create(name)?;
        self.commit()?;
        self.made_snapshot(name)
    }

    /// Queues snapshot `name` for the next commit (which makes it; see
    /// [`Engine::create_snapshot`] for the errors).
    pub fn queue_snapshot_create(&self, name: &str) -> Result<()> {
        snapshot::check_name(name)?;
        self.check_snapshot_writable()?;
        {
            let mut state = self.snapshots.lock();
            let taken = state.list.iter().any(|s| s.name == name)
                || state.pending.iter().any(
                    |op| matches!(op, SnapshotOp::Create { name: n, .. } if n.as_str() == name),
                );
            if taken {
                return Err(Error::Exists(format!("snapshot {name:?}")));
            }
            // Ids are never reused, and a snapshot's id is the subvolume of its inode
            // numbers (DESIGN §7): 16 bits.
            let queued = state
                .pending
                .iter()
                .filter(|op| matches!(op, SnapshotOp::Create { .. }))
                .count() as u64;
            let next_id = self.superblock.lock().next_snapshot_id.max(1);
            if next_id + queued >= SNAPSHOT_ID_LIMIT {
                return Err(Error::NoSpace(format!(
                    "snapshot {name:?}: every snapshot id below 2^{} was used (ids are never \
                     reused)",
                    64 - SUBVOLUME_SHIFT
                )));
            }
            let (sec, nsec) = now();
            state.pending.push(SnapshotOp::Create {
                name: name.to_string(),
                created: birch_format::items::Timespec { sec, nsec },
            });
        }
        Ok(())
    }

    /// Snapshot `name` once the commit that took its queued creation is done.
    pub fn made_snapshot(&self, name: &str) -> Result<Snapshot> {
        self.snapshots
            .lock()
            .list
            .iter()
            .find(|s| s.name == name)
            .cloned()
            .ok_or_else(|| Error::Invalid(format!("snapshot {name:?}: its commit did not make it")))
    }

    /// Deletes snapshot `name`: the commit this call runs drops it from the list and gives
    /// back the blocks no other snapshot and not the live tree reference (DESIGN §15.4; free
    /// once that commit is durable, as any freed space). Returns what was deleted. Errors: no
    /// such snapshot (`NotFound`), a read-only engine, the commit's.
    ///
    /// On a [`crate::Filesystem`] use its `delete_snapshot`, for the reason
    /// [`Engine::create_snapshot`] gives.
    pub fn delete_snapshot(&self, name: &str) -> Result<Snapshot> {
        let victim = self.queue_snapshot_delete(name)?;
        self.commit()?;
        Ok(victim)
    }

    /// Queues the deletion of snapshot `name` for the next commit; returns the snapshot.
    pub fn queue_snapshot_delete(&self, name: &str) -> Result<Snapshot> {
        self.queue_snapshot_delete_where(|s| s.name == name, || format!("snapshot {name:?}"))
    }

    /// Queues the deletion of snapshot `id` (a name may have been deleted and made again
    /// since the caller looked it up; an id never names another snapshot).
    pub fn queue_snapshot_delete_id(&self, id: u64) -> Result<Snapshot> {
        self.queue_snapshot_delete_where(|s| s.id == id, || format!("snapshot id {id}"))
    }

    fn queue_snapshot_delete_where(
        &self,
        which: impl Fn(&Snapshot) -> bool,
        what: impl Fn() -> String,
    ) -> Result<Snapshot> {
        self.check_snapshot_writable()?;
        let victim = {
            let mut state = self.snapshots.lock();
            let Some(victim) = state.list.iter().find(|s| which(s)).cloned() else {
                return Err(Error::NotFound(what()));
            };
            let queued = state
                .pending
                .contains(&SnapshotOp::Delete { id: victim.id });
            if !queued {
                state.pending.push(SnapshotOp::Delete { id: victim.id });
            }
            victim
        };
        Ok(victim)
    }

    /// Rolls the live filesystem back to snapshot `name` (`birch rollback`, DESIGN §15.8):
    /// one commit, at a generation above every earlier one, whose fs tree root is the
    /// snapshot's; the snapshot stays; `next_objectid` is kept (ids are never reused); the
    /// blocks only the replaced live tree held are given back once that commit is durable
    /// (the deletion walk against the snapshot, [`snapshot::deletion_frees`]). Snapshots newer
    /// than `name` make it refuse (`Exists`, naming them) unless `destroy_newer`, which
    /// deletes them in the same commit. Returns the snapshot and the names of the deleted
    /// ones.
    ///
    /// For an engine with no filesystem above it (an unmounted image): the filesystem's
    /// caches would still show the old tree. Refused while log records wait for replay (open
    /// the image read-write through the filesystem first, which replays and commits them)
    /// and when the running delta is not empty after a commit (a concurrent writer).
    pub fn rollback(&self, name: &str, destroy_newer: bool) -> Result<(Snapshot, Vec<String>)> {
        self.check_snapshot_writable()?;
        if self.replay_pending() {
            return Err(Error::Invalid(format!(
                "rollback to {name:?}: the fsync log holds records not yet replayed; open the \
                 image read-write once (e.g. birch fsck) to replay them first"
            )));
        }
        // What the delta holds goes in first, so that the rollback's freeze finds it empty.
        self.commit()?;
        let (target, newer) = {
            let mut state = self.snapshots.lock();
            if !state.pending.is_empty() {
                return Err(Error::Invalid(format!(
                    "rollback to {name:?}: other snapshot changes wait for a commit"
                )));
            }
            let Some(target) = state.list.iter().find(|s| s.name == name).cloned() else {
                return Err(Error::NotFound(format!("snapshot {name:?}")));
            };
            let newer: Vec<Snapshot> = state
                .list
                .iter()
                .filter(|s| s.id > target.id)
                .cloned()
                .collect();
            if !newer.is_empty() && !destroy_newer {
                let names: Vec<String> = newer.iter().map(|s| format!("{:?}", s.name)).collect();
                return Err(Error::Exists(format!(
                    "rollback to {name:?}: newer snapshots exist ({}); destroy them with -r",
                    names.join(", ")
                )));
            }
            for s in &newer {
                state.pending.push(SnapshotOp::Delete { id: s.id });
            }
            state.pending.push(SnapshotOp::Rollback { id: target.id });
            (target, newer)
        };
        self.commit()?;
        let rolled = self.superblock.lock().fs_root == target.root;
        if !rolled {
            return Err(Error::Invalid(format!(
                "rollback to {name:?}: its commit did not make it"
            )));
        }
        Ok((target, newer.into_iter().map(|s| s.name).collect()))
    }

    /// The bytes only each snapshot holds, oldest first: what deleting it alone would give
    /// back (`birch snapshot list`), found by the deletion walk ([`snapshot::deletion_frees`])
    /// against its neighbours without freeing anything. Reads the changed part of each pair
    /// of neighbouring trees; the committed root is held meanwhile.
    pub fn snapshot_space(&self) -> Result<Vec<(Snapshot, u64)>> {
        let committed = self.committed_root();
        let list = self.snapshots();
        let space = self.snapshot_space_in(&committed, &list)?;
        drop(committed);
        Ok(list.into_iter().zip(space).collect())
    }

    /// [`Engine::snapshot_space`] of the snapshots `list` (oldest first, as
    /// [`Engine::snapshots`] gave it after `committed` was taken) with `committed` as the live
    /// tree: the bytes only each holds, in `list`'s order. The caller holds `committed`, so
    /// it can key a cached result by `committed.generation` and the list's ids.
    pub(crate) fn snapshot_space_in(
        &self,
        committed: &CommittedRoot,
        list: &[Snapshot],
    ) -> Result<Vec<u64>> {
        let mut out = Vec::with_capacity(list.len());
        for (i, victim) in list.iter().enumerate() {
            let older = if i == 0 { 0 } else { list[i - 1].generation };
            let newer = list.get(i + 1).map_or(committed.root, |s| s.root);
            let frees =
                snapshot::deletion_frees(self.ctx(), victim, older, newer).map_err(|e| {
                    Error::Invalid(format!(
                        "snapshot {:?} (id {}): the space only it holds: {e}",
                        victim.name, victim.id
                    ))
                })?;
            let blocks: u64 = frees.iter().map(|(_, n)| n.get()).sum();
            out.push(blocks * birch_format::BLOCK_SIZE);
        }
        Ok(out)
    }

    /// A read view of snapshot `id`'s tree (items through the node cache; no delta).
    ///
    /// While the view is held its blocks stay allocated, also when the snapshot is deleted
    /// meanwhile: the view holds the release list of the committed root current when it was
    /// made, as any reader of a committed root does (DESIGN §5 pinning, §13.2). A deletion's
    /// frees go on the list of the root before the deleting commit D, and the list of
    /// snapshots is updated before root D is published, so a view that still found the
    /// snapshot holds a root older than D, whose list keeps D's. `NotFound` for a deleted
    /// (or never made) snapshot: never a view of freed blocks.
    pub fn snapshot_view(&self, id: u64) -> Result<CommittedView<'_>> {
        // The pin first, then the look-up (see above for why this order is safe).
        let pin = self.committed_root();
        let snapshot = self
            .snapshots
            .lock()
            .list
            .iter()
            .find(|s| s.id == id)
            .cloned()
            .ok_or_else(|| Error::NotFound(format!("snapshot id {id} (deleted)")))?;
        Ok(self.committed_view(Arc::new(CommittedRoot {
            root: snapshot.root,
            generation: Generation::new(snapshot.generation),
            release: pin.release.clone(),
        })))
    }

    /// Snapshot `id` as of the last durable commit, if it stands.
    pub fn snapshot(&self, id: u64) -> Option<Snapshot> {
        self.snapshots
            .lock()
            .list
            .iter()
            .find(|s| s.id == id)
            .cloned()
    }

    /// Snapshots are changed only by a writable engine.
    fn check_snapshot_writable(&self) -> Result<()> {
        self.check_up()?;
        match self.read_only_cause() {
            Some(cause) => Err(Error::ReadOnly(cause)),
            None => Ok(()),
        }
    }

    /// The backup trees of both slots, newest first (DESIGN §13.3): each one's blocks that no
    /// newer tree holds are marked used and deferred as if the commit after it had freed them.
    /// A tree that does not read whole is dropped from the superblock's list with a warning.
    /// `seen` holds the nodes (address → generation) of the trees walked so far.
    fn keep_backup_trees(&self, seen: &mut HashMap<u64, u64>) {
        let current = self.superblock.lock().clone();
        let mut whole = Vec::new();
        for backup in older_roots(&*self.device, &current, true) {
            match self.backup_tree_ranges(&backup, seen) {
                Ok(ranges) => {
                    let freed_by = Generation::new(backup.generation).next();
                    for (addr, blocks) in ranges {
                        self.alloc.defer_unused(freed_by, addr, blocks);
                    }
                    whole.push(backup.generation);
                }
                Err(e) => log::warn!(
                    "open: backup root of generation {} is not whole and is dropped: {e}",
                    backup.generation
                ),
            }
        }
        self.superblock
            .lock()
            .backup_roots
            .retain(|b| whole.contains(&b.generation));
    }

    /// The nodes and extents of a backup tree that the trees walked before did not reach.
    /// A node already seen at the same generation is shared with them, subtree and all; at
    /// another generation its block was reused and the tree is not whole.
    fn backup_tree_ranges(
        &self,
        backup: &BackupRoot,
        seen: &mut HashMap<u64, u64>,
    ) -> Result<Vec<(BlockAddr, BlockCount)>> {
        let total = self.alloc.total_blocks().bytes();
        let mut nodes = Vec::new();
        let mut extents = Vec::new();
        let mut visited = Vec::new();
        self.walk_tree(
            backup.fs_root,
            |addr, generation| match seen.get(&addr) {
                Some(g) if *g == generation => Ok(false),
                Some(g) => Err(Error::corrupt(
                    format!("backup generation {}", backup.generation),
                    FormatError::invalid(
                        format!("node {addr:#x}"),
                        format!("generation {g} there now"),
                        format!("generation {generation}"),
                    ),
                )),
                None => {
                    visited.push((addr, generation));
                    nodes.push((BlockAddr::new(addr), BlockCount::new(NODE_BLOCKS)));
                    Ok(true)
                }
            },
            |key, extent, addr| {
                let extent = extent.map_err(|e| Error::corrupt(format!("extent {key}"), e))?;
                if let Some((disk, blocks)) = extent.disk_range() {
                    if disk < RESERVED_HEAD_BYTES
                        || disk.saturating_add(blocks * birch_format::BLOCK_SIZE) > total
                    {
                        return Err(Error::corrupt(
                            format!("extent {key} in node {addr:#x}"),
                            FormatError::invalid(
                                format!("extent at {disk:#x} x {blocks} blocks"),
                                "outside the device",
                                "blocks inside the device",
                            ),
                        ));
                    }
                    extents.push((BlockAddr::new(disk), BlockCount::new(blocks)));
                }
                Ok(())
            },
        )?;
        seen.extend(visited);
        nodes.extend(extents);
        Ok(nodes)
    }

    /// Marks every node and every extent the committed tree references as used, and records
    /// each node's address and generation in `seen`.
    fn rebuild_allocator(
        &self,
        seen: &mut HashMap<u64, u64>,
        mut bad_extents: Option<&mut Vec<Key>>,
    ) -> Result<()> {
        let root = self.state.read().committed.root;
        self.walk_tree(
            root,
            |addr, generation| {
                seen.insert(addr, generation);
                if !self
                    .alloc
                    .mark_used(BlockAddr::new(addr), BlockCount::new(NODE_BLOCKS))
                {
                    return Err(Error::corrupt(
                        format!("open: node {addr:#x} (generation {generation})"),
                        FormatError::invalid(
                            format!("node {addr:#x}"),
                            "referenced twice or overlapping other metadata",
                            "one reference to a free block",
                        ),
                    ));
                }
                Ok(true)
            },
            |key, extent, addr| {
                let extent = match extent {
                    Ok(extent) => extent,
                    Err(_) if bad_extents.is_some() => {
                        if let Some(bad) = bad_extents.as_deref_mut() {
                            bad.push(key);
                        }
                        return Ok(());
                    }
                    Err(e) => {
                        return Err(Error::corrupt(format!("extent {key} in node {addr:#x}"), e))
                    }
                };
                if let Some((disk, blocks)) = extent.disk_range() {
                    // A shared (flagged) extent counts one reference per block and may lie
                    // on blocks other flagged extents name; anything else on a used block is
                    // damage (DESIGN §15.7).
                    let (at, count) = (BlockAddr::new(disk), BlockCount::new(blocks));
                    if disk.saturating_add(blocks * birch_format::BLOCK_SIZE)
                        > self.alloc.total_blocks().bytes()
                        || !(if extent.shared {
                            self.alloc.mark_shared(at, count)
                        } else {
                            self.alloc.mark_used(at, count)
                        })
                    {
                        if let Some(bad) = bad_extents.as_deref_mut() {
                            bad.push(key);
                            return Ok(());
                        }
                        return Err(Error::corrupt(
                            format!("open: extent {key} in node {addr:#x}"),
                            FormatError::invalid(
                                format!("extent at {disk:#x} x {blocks} blocks"),
                                "out of range or overlapping other space",
                                "free blocks inside the device",
                            ),
                        ));
                    }
                }
                Ok(())
            },
        )
    }

    /// Walks the tree at `root` depth first, reading and verifying every node. `node(addr,
    /// generation)` is called before a node is read; `Ok(false)` skips it and its subtree.
    /// `extent(key, decoded extent, node addr)` is called for every extent item. The first
    /// error (a node that does not read, or a visitor's) ends the walk.
    fn walk_tree(
        &self,
        root: RootPtr,
        node: impl FnMut(u64, u64) -> Result<bool>,
        extent: impl FnMut(
            Key,
            std::result::Result<birch_format::items::FileExtent, FormatError>,
            u64,
        ) -> Result<()>,
    ) -> Result<()> {
        walk_tree(self.ctx(), root, node, extent)
    }

    /// The running transaction's generation.
    pub fn running_generation(&self) -> Generation {
        Generation::new(self.running_generation.load(Ordering::SeqCst))
    }

    /// The generation of the last durable commit.
    pub fn committed_generation(&self) -> Generation {
        self.state.read().committed.generation
    }

    /// Why the engine is read-only, if it is: the shutdown, else the cause recorded by
    /// [`Engine::set_read_only`].
    pub fn read_only_cause(&self) -> Option<ReadOnlyCause> {
        if self.is_shut_down() {
            return Some(ReadOnlyCause::Shutdown);
        }
        self.read_only.read().clone()
    }

    /// The cause [`Engine::set_read_only`] recorded, as text (a shutdown is not recorded:
    /// [`Engine::is_shut_down`] tells it, and [`Engine::read_only_cause`] includes it).
    pub fn read_only_reason(&self) -> Option<String> {
        self.read_only
            .read()
            .as_ref()
            .map(|cause| cause.to_string())
    }

    /// Turns the engine read-only (a failed commit or log write; or a read-only mount). A
    /// failure replaces a chosen read-only state ([`ReadOnlyCause::replaces`]): once a commit
    /// has failed, no later commit may run and no remount may make the engine writable.
    pub fn set_read_only(&self, cause: ReadOnlyCause) {
        if self.is_shut_down() {
            // The failure is the shutdown's doing (its fence refused the I/O).
            return;
        }
        let mut ro = self.read_only.write();
        let replace = match ro.as_ref() {
            None => true,
            Some(current) => cause.replaces(current),
        };
        if replace {
            log::log!(cause.log_level(), "birchfs is now read-only: {cause}");
            *ro = Some(cause);
            self.read_only_set.store(true, Ordering::SeqCst);
        }
    }

    /// Makes the engine writable again (remount rw), unless its read-only state is one a
    /// remount may not undo ([`ReadOnlyCause::may_become_writable`]).
    pub fn clear_read_only(&self) -> Result<()> {
        self.check_up()?;
        let mut ro = self.read_only.write();
        if let Some(cause) = ro.as_ref() {
            if !cause.may_become_writable() {
                return Err(Error::ReadOnly(cause.clone()));
            }
        }
        *ro = None;
        self.read_only_set.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// The value of `key` as of now. May do device I/O (no lock held while it does).
    pub fn get(&self, key: &Key) -> Result<Option<Vec<u8>>> {
        self.check_up()?;
        let committed = {
            let _gate = self.gate.read();
            if let Some(value) = self.active.get(key) {
                return Ok(value.map(|v| v.to_vec()));
            }
            let state = self.state.read();
            if let Some(frozen) = &state.frozen {
                if let Some(value) = frozen.get(key) {
                    return Ok(value.map(|v| v.to_vec()));
                }
            }
            state.committed.clone()
        };
        TreeReader {
            ctx: self.ctx(),
            root: committed.root,
        }
        .get(key)
    }

    /// Items in `[lo, hi)` as of now, at most `limit` of them. `lo` and `hi` must cover one
    /// object id (one delta shard). May do device I/O.
    pub fn range(&self, lo: &Key, hi: &Key, limit: usize) -> Result<Vec<(Key, Arc<[u8]>)>> {
        self.check_up()?;
        let mut out: Vec<(Key, Arc<[u8]>)> = Vec::new();
        let mut from = *lo;
        // Deletions in the delta can hide what a chunk brings (a file just truncated): each
        // pass that comes back short asks for twice as much, up to 64 times.
        let mut widen = 1usize;
        while out.len() < limit && from < *hi {
            // Each source gives a chunk; the merge is exact up to the smallest last key of a
            // source that had more, so work stays proportional to what is returned. Twice
            // what is wanted, at least 2: a first-item look (`limit` 1) clones 2 values per
            // source, not 8 (extent items carry their checksums).
            let chunk = (limit - out.len())
                .saturating_mul(2)
                .max(2)
                .saturating_mul(widen);
            widen = (widen * 2).min(64);
            let ((active, active_more), (frozen, frozen_more), committed) = {
                let _gate = self.gate.read();
                let active = self.active.range_limited(&from, hi, chunk);
                let state = self.state.read();
                let frozen = state
                    .frozen
                    .as_ref()
                    .map(|f| f.range_limited(&from, hi, chunk))
                    .unwrap_or_default();
                (active, frozen, state.committed.clone())
            };
            let tree = TreeReader {
                ctx: self.ctx(),
                root: committed.root,
            }
            .range(&from, hi, chunk)?;
            let tree_more = tree.len() == chunk;
            let mut bound: Option<Key> = None;
            for (more, last) in [
                (active_more, active.last().map(|e| e.0)),
                (frozen_more, frozen.last().map(|e| e.0)),
                (tree_more, tree.last().map(|e| e.0)),
            ] {
                if let (true, Some(last)) = (more, last) {
                    bound = Some(bound.map_or(last, |b| b.min(last)));
                }
            }
            let mut merged = merge_layers(tree, &[active, frozen]);
            if let Some(bound) = bound {
                merged.retain(|(k, _)| *k <= bound);
            }
            let room = limit - out.len();
            out.extend(merged.into_iter().take(room));
            match bound.and_then(|b| b.successor()) {
                Some(next) => from = next,
                None => break,
            }
        }
        Ok(out)
    }

    /// The item with the greatest key in `[floor, key]` as of now (a deletion in the delta
    /// hides older layers' items). Both keys must have the same object id. One look per layer
    /// (a descent of the tree), again only past a deleted key. May do device I/O.
    pub fn last_in(&self, floor: &Key, key: &Key) -> Result<Option<(Key, Arc<[u8]>)>> {
        self.check_up()?;
        let mut upper = *key;
        while *floor <= upper {
            let (active, frozen, committed) = {
                let _gate = self.gate.read();
                let active = self.active.last_in(floor, &upper);
                let state = self.state.read();
                let frozen = state.frozen.as_ref().and_then(|f| f.last_in(floor, &upper));
                (active, frozen, state.committed.clone())
            };
            let tree = TreeReader {
                ctx: self.ctx(),
                root: committed.root,
            }
            .last_in(floor, &upper)?;
            // The greatest key any layer has; its value comes from the newest layer that
            // holds it (a layer whose own last key is smaller holds nothing at that key).
            let Some(top) = [
                active.as_ref().map(|e| e.0),
                frozen.as_ref().map(|e| e.0),
                tree.as_ref().map(|e| e.0),
            ]
            .into_iter()
            .flatten()
            .max() else {
                return Ok(None);
            };
            let value = match (active, frozen, tree) {
                (Some((k, v)), _, _) if k == top => v,
                (_, Some((k, v)), _) if k == top => v,
                (_, _, Some((_, v))) => Some(Arc::from(v)),
                _ => None,
            };
            match value {
                Some(v) => return Ok(Some((top, v))),
                None => match top.predecessor() {
                    Some(p) => upper = p,
                    None => break,
                },
            }
        }
        Ok(None)
    }

    /// Starts a mutation of the running transaction. Hold it only for in-memory work.
    pub fn begin(&self) -> Result<WriteTxn<'_>> {
        // Recursive: an operation that holds [`Engine::hold`] records its items through here.
        let guard = self.gate.read();
        if self.read_only_set.load(Ordering::SeqCst) {
            self.check_up()?;
            if let Some(cause) = self.read_only.read().as_ref() {
                return Err(Error::ReadOnly(cause.clone()));
            }
        }
        Ok(WriteTxn {
            engine: self,
            _guard: guard,
        })
    }

    /// Keeps every change of one multi-step operation (a write that allocates, writes data and
    /// then records extents and the inode) in the same transaction: a commit cannot freeze the
    /// delta between the steps. Data I/O may happen under it, never a flush or a commit.
    pub fn hold(&self) -> Result<WriteTxn<'_>> {
        self.begin()
    }

    /// Writes fsync records to the log (group commit); returns once durable or when the log is
    /// full. Does device I/O with no engine lock held.
    pub fn log_submit(&self, records: Vec<LogRecord>) -> Result<LogOutcome> {
        self.check_up()?;
        let result = self.log.submit(&*self.device, &self.counters, records);
        if self.is_shut_down() && result.is_err() {
            return Err(Error::Shutdown);
        }
        result
    }

    /// Queues fsync records (no I/O); see [`Engine::log_wait`].
    pub fn log_enqueue(&self, records: Vec<LogRecord>) -> u64 {
        self.log.enqueue(records)
    }

    /// [`Engine::log_wait`] without blocking: `done` gets the outcome (errors mapped as
    /// `log_wait` maps them) from whichever thread learns it ([`FsyncLog::defer`]). Returns
    /// true when the caller must arrange a leader: a call of [`Engine::log_wait`] for `ticket`
    /// (or of [`Engine::log_lead`]) on a thread that may block.
    pub fn log_defer(&self, ticket: u64, done: crate::log::Deferred) -> bool {
        if let Err(e) = self.check_up() {
            done(Err(e));
            return false;
        }
        let fence = self.fence.clone();
        self.log.defer(
            ticket,
            Box::new(move |result| {
                done(match result {
                    Err(_) if fence.is_down() => Err(Error::Shutdown),
                    other => other,
                })
            }),
        )
    }

    /// Leads log batches until every deferred wait is answered ([`FsyncLog::lead`]); what the
    /// hand-off of [`Engine::set_log_hand_off`] must arrange.
    pub fn log_lead(&self) {
        if self.check_up().is_err() {
            self.log.abandon_deferred();
            return;
        }
        let _ = self.log.lead(&*self.device, &self.counters);
        // The leader's own outcome is no error (it waited for nothing): a failure it met
        // turns the engine read-only here, as `log_wait` would.
        if let Some(error) = self.log.failure() {
            self.set_read_only(ReadOnlyCause::LogWriteFailed { error });
        }
    }

    /// How a waiter hands the leading of deferred waits over ([`FsyncLog::set_hand_off`]).
    pub fn set_log_hand_off(&self, hand_off: crate::log::HandOff) {
        self.log.set_hand_off(hand_off);
    }

    /// Waits for queued records to be durable (group commit). A failed log write turns the
    /// engine read-only. Does device I/O with no engine lock held.
    pub fn log_wait(&self, ticket: u64) -> Result<LogOutcome> {
        if let Err(e) = self.check_up() {
            // It may have been asked to lead for deferred waits: they hear the shutdown.
            self.log.abandon_deferred();
            return Err(e);
        }
        let result = self.log.wait(&*self.device, &self.counters, ticket);
        if self.is_shut_down() && result.is_err() {
            return Err(Error::Shutdown);
        }
        if let Err(e) = &result {
            self.set_read_only(ReadOnlyCause::LogWriteFailed {
                error: e.to_string(),
            });
        }
        result
    }

    /// For a writable open, before the log writes again: erases the first block of the
    /// batch replay stopped at because the data it names did not verify (a batch that landed
    /// without its data: never acknowledged, §11.1), so that no later replay takes it, once a
    /// commit covers its records, for the batch that will carry its sequence number
    /// elsewhere (a unit skip or a wrap). [`crate::log::Replay::rejected_at`].
    pub fn erase_rejected_batch(&self) -> Result<()> {
        let at = self.replay.lock().as_ref().and_then(|r| r.rejected_at);
        let Some(at) = at else {
            return Ok(());
        };
        log::info!("erasing the log batch at {at:#x} that replay rejected for its data");
        self.device
            .write_at(&[0u8; birch_format::BLOCK_SIZE as usize], at)
            .and_then(|()| self.device.flush())
            .map_err(|e| Error::io(format!("erase the rejected log batch at {at:#x}"), e))?;
        if let Some(r) = self.replay.lock().as_mut() {
            r.rejected_at = None;
        }
        Ok(())
    }

    /// Whether log records read at open still wait for replay (a read-only open).
    pub fn replay_pending(&self) -> bool {
        self.replay
            .lock()
            .as_ref()
            .is_some_and(|r| !r.records.is_empty())
    }

    /// The items of inode `ino` changed since the last durable commit (running delta over
    /// frozen delta), with the running generation they will commit in.
    pub fn changed_items(&self, ino: InodeNo) -> (Generation, Vec<(Key, DeltaValue)>) {
        // The range `items::inode_key_range` names too (the engine sits below `items`).
        let (lo, hi) = Key::object_range(ino.get());
        let _gate = self.gate.read();
        let generation = self.running_generation.load(Ordering::SeqCst);
        let active = self.active.range(&lo, &hi);
        let state = self.state.read();
        let mut merged: std::collections::BTreeMap<Key, DeltaValue> = state
            .frozen
            .as_ref()
            .map(|f| f.range(&lo, &hi))
            .unwrap_or_default()
            .into_iter()
            .collect();
        merged.extend(active);
        (Generation::new(generation), merged.into_iter().collect())
    }

    /// The newest durable commit's tree. While the returned root is held, every block
    /// freed by later commits stays pinned (DESIGN §5): hold it briefly (scrub takes it
    /// again for every chunk of keys).
    pub fn committed_root(&self) -> Arc<CommittedRoot> {
        self.state.read().committed.0.clone()
    }

    /// A reader of the committed tree `root` (from [`Engine::committed_root`]): what that
    /// commit held, whatever commits and deltas come after, for as long as it is kept (it
    /// pins the blocks later commits free, as the committed root does).
    pub fn committed_view(&self, root: Arc<CommittedRoot>) -> CommittedView<'_> {
        CommittedView { engine: self, root }
    }

    /// The value of `key` in the last durable commit (no delta).
    pub fn committed_get(&self, key: &Key) -> Result<Option<Vec<u8>>> {
        let committed = self.state.read().committed.clone();
        TreeReader {
            ctx: self.ctx(),
            root: committed.root,
        }
        .get(key)
    }

    /// Takes what the log held at open (once).
    pub fn take_replay(&self) -> Option<Replay> {
        self.replay.lock().take()
    }

    /// Makes sure new object ids are above `min` (replay of inodes created after the commit).
    pub fn raise_objectid(&self, min: u64) {
        self.next_objectid
            .fetch_max(batch_aligned(min), Ordering::SeqCst);
    }

    /// Number of changed items waiting for commit.
    pub fn pending_items(&self) -> usize {
        self.active.len()
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

    /// Benchmark only (mount option `bench_global_objectid_lock`, seed 002's "before"): every
    /// object id is taken from the counter under one mutex, one id at a time, with no batch per
    /// thread; waits for the mutex count in `objectid_lock_waits`. Off by default.
    pub fn set_bench_global_objectid_lock(&self, on: bool) {
        self.bench_global_objectid_lock.store(on, Ordering::Relaxed);
    }

    /// Benchmark only (mount option `bench_apply_per_item`, seed 003's "before"): the commit
    /// apply deletes each changed extent item in a descent of its own and inserts it in another,
    /// instead of one descent per leaf of changes; such commits never run the parallel apply.
    /// Off by default.
    pub fn set_bench_apply_per_item(&self, on: bool) {
        self.bench_apply_per_item.store(on, Ordering::Relaxed);
    }

    /// Takes the id counter's one mutex (`bench_global_objectid_lock`), counting a wait
    /// when another thread holds it.
    fn objectid_locked(&self) -> MutexGuard<'_, ()> {
        if let Some(guard) = self.objectid_lock.try_lock() {
            return guard;
        }
        self.counters.add(|c| &c.objectid_lock_waits, 1);
        self.objectid_lock.lock()
    }

    /// A new inode number (object id), never used before in this filesystem. `NoSpace` once
    /// the ids reach [`OBJECTID_LIMIT`] (2^48: bits 48..63 of an inode number name its
    /// subvolume, DESIGN §7).
    pub fn allocate_objectid(&self) -> Result<InodeNo> {
        if self.bench_global_objectid_lock.load(Ordering::Relaxed) {
            let _guard = self.objectid_locked();
            let id = self.next_objectid.load(Ordering::Relaxed);
            check_objectid(id)?;
            self.next_objectid.store(id + 1, Ordering::Relaxed);
            return Ok(InodeNo::new(id));
        }
        let id = OBJECTID_RANGES.with(|ranges| {
            let mut ranges = ranges.borrow_mut();
            let range = ranges.entry(self.instance).or_insert((0, 0));
            if range.0 == range.1 {
                let start = self
                    .next_objectid
                    .fetch_add(OBJECTID_BATCH, Ordering::Relaxed);
                *range = (start, start + OBJECTID_BATCH);
            }
            let id = range.0;
            range.0 += 1;
            id
        });
        check_objectid(id)?;
        Ok(InodeNo::new(id))
    }

    /// A new object id that shares its batch of 64 with no other object (a directory: its
    /// entries then get a delta shard and inode-table shard of their own, see
    /// `delta::batch_shard`). The rest of the batch is never used.
    /// `NoSpace` as [`Engine::allocate_objectid`].
    pub fn allocate_objectid_alone(&self) -> Result<InodeNo> {
        if self.bench_global_objectid_lock.load(Ordering::Relaxed) {
            // Ids taken one at a time leave the counter anywhere inside a batch.
            let _guard = self.objectid_locked();
            let id = batch_aligned(self.next_objectid.load(Ordering::Relaxed));
            check_objectid(id)?;
            self.next_objectid
                .store(id + OBJECTID_BATCH, Ordering::Relaxed);
            return Ok(InodeNo::new(id));
        }
        let id = self
            .next_objectid
            .fetch_add(OBJECTID_BATCH, Ordering::Relaxed);
        check_objectid(id)?;
        Ok(InodeNo::new(id))
    }

    /// Allocates data blocks: a run of `min..=max` blocks.
    pub fn allocate_data(
        &self,
        min: BlockCount,
        max: BlockCount,
    ) -> Result<(BlockAddr, BlockCount)> {
        self.alloc.allocate(min, max, Purpose::Data)
    }

    /// Data space starting at `goal` if it is free there, anywhere otherwise.
    pub fn allocate_data_near(
        &self,
        goal: BlockAddr,
        min: BlockCount,
        max: BlockCount,
    ) -> Result<(BlockAddr, BlockCount)> {
        self.alloc.allocate_near(goal, min, max, Purpose::Data)
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
        if let Some(cause) = self.read_only.read().clone() {
            // A read-only mount commits what reached the delta before it turned read-only
            // (remount,ro sets read-only first, then commits); after a failure, nothing more
            // is durable, and callers (fsync) must hear so.
            if !cause.allows_commit() {
                return Err(Error::ReadOnly(cause));
            }
        }
        let (frozen, generation, committed, ops) = {
            let _gate = self.gate.write();
            let generation = self.running_generation.load(Ordering::SeqCst);
            let mut snapshots = self.snapshots.lock();
            let idle = self.active.is_empty()
                && self.alloc.pinned_blocks() == BlockCount::new(0)
                && self.next_objectid.load(Ordering::Relaxed)
                    == self.superblock.lock().next_objectid
                && snapshots.pending.is_empty();
            if idle {
                return Ok(self.committed_generation());
            }
            let rollback = snapshots
                .pending
                .iter()
                .any(|op| matches!(op, SnapshotOp::Rollback { .. }));
            if rollback && !self.active.is_empty() {
                // The rollback's tree is the snapshot's: a change made since its caller's
                // commit would be lost. Its ops stay queued for the caller to withdraw.
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
                        if let Some(s) = snapshots.list.iter().find(|s| s.id == *id) {
                            self.alloc.drop_hold(s.generation, generation);
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
                .store(generation + 1, Ordering::SeqCst);
            let mut state = self.state.write();
            state.each(|s| s.frozen = Some(frozen.clone()));
            (frozen, generation, state.first().committed.0.clone(), ops)
        };
        drop(after_freeze);
        let started = std::time::Instant::now();
        let result = match self.write_commit(&frozen, generation, &committed, &ops) {
            Ok(()) => {
                self.commit_latency.record(started.elapsed());
                Ok(Generation::new(generation))
            }
            Err(_) if self.is_shut_down() => Err(Error::Shutdown),
            Err(e) => {
                self.set_read_only(ReadOnlyCause::CommitFailed {
                    generation,
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

    /// Waits until no mutation holds the gate: every [`WriteTxn`] begun before this call has
    /// ended. No lock may be held by the caller that a mutation waits for.
    pub fn barrier(&self) {
        drop(self.gate.write());
    }

    /// Takes the commit lock. A caller that finds it held helps with the jobs of the commit
    /// in progress while it waits (see [`Board`]).
    fn lock_commit(&self) -> CommitGuard<'_> {
        if let Some(guard) = self.commit_lock.try_lock() {
            return CommitGuard {
                engine: self,
                guard: Some(guard),
            };
        }
        let start = std::time::Instant::now();
        let guard = loop {
            let board = self.board.lock().clone();
            if let Some(board) = board {
                let helping = std::time::Instant::now();
                board.work(self, true);
                let helped = helping.elapsed().as_micros() as u64;
                self.counters.add(|c| &c.commit_help_us, helped);
            }
            let (lock, cvar) = &self.commit_events;
            let mut epoch = lock.lock();
            if let Some(guard) = self.commit_lock.try_lock() {
                break guard;
            }
            // A board posted since the look above bumped the epoch before this lock was
            // taken, or bumps it after the wait below begins: either way it is seen.
            if self
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

    /// Wakes the callers waiting in [`Engine::lock_commit`] to look again.
    fn commit_event(&self) {
        let (lock, cvar) = &self.commit_events;
        *lock.lock() += 1;
        cvar.notify_all();
    }

    /// The smallest commit, in changed items, whose apply is cut into jobs that waiting
    /// committers help with (default 16,384). Tests lower it to run the parallel apply on
    /// small trees.
    pub fn set_parallel_apply_min(&self, items: usize) {
        self.parallel_apply_min.store(items, Ordering::Relaxed);
    }

    /// Applies `frozen` to the tree of `writer`; returns the nodes already written (by jobs).
    fn apply(
        &self,
        writer: &mut TreeWriter<'_>,
        frozen: &Arc<FrozenDelta>,
        generation: u64,
    ) -> Result<Vec<Arc<Node>>> {
        if self.bench_apply_per_item.load(Ordering::Relaxed) {
            apply_per_item(writer, &frozen.sorted())?;
            return Ok(Vec::new());
        }
        let min = self.parallel_apply_min.load(Ordering::Relaxed);
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
        *self.board.lock() = Some(board.clone());
        self.commit_event();
        board.work(self, false);
        let results = board.wait_all();
        *self.board.lock() = None;
        let outputs = results.into_iter().collect::<Result<Vec<JobOutput>>>()?;
        parallel::assemble(writer, plan, outputs)
    }

    fn write_commit(
        &self,
        frozen: &Arc<FrozenDelta>,
        generation: u64,
        committed: &CommittedRoot,
        ops: &[SnapshotOp],
    ) -> Result<()> {
        // Blocks whose bytes only the log holds go in place first: the flush below makes
        // them durable before any superblock names them.
        self.pending().write_out(&*self.device).map_err(|e| {
            Error::io(
                format!("commit {generation}: write data blocks placed by the log"),
                e,
            )
        })?;
        let ctx = self.ctx();
        let rollback = ops.iter().find_map(|op| match op {
            SnapshotOp::Rollback { id } => Some(*id),
            _ => None,
        });
        let (root, mut nodes, replaced) = match rollback {
            // The freeze made sure the delta is empty: no fs node is written.
            Some(id) => {
                let target = self
                    .snapshots
                    .lock()
                    .list
                    .iter()
                    .find(|s| s.id == id)
                    .cloned();
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
                (target.root, Vec::new(), Some(replaced))
            }
            None => {
                let mut writer = TreeWriter::new(ctx, &self.alloc, generation, committed.root);
                let mut nodes = self.apply(&mut writer, frozen, generation)?;
                nodes.extend(writer.write_dirty()?);
                (writer.root(), nodes, None)
            }
        };
        let mut sb = self.superblock.lock().clone();
        let list_change = if ops.is_empty() {
            None
        } else {
            Some(self.write_snapshot_list(ops, generation, root, &mut sb, &mut nodes)?)
        };
        self.device
            .flush()
            .map_err(|e| Error::io(format!("commit {generation}: flush nodes"), e))?;
        let (sec, nsec) = now();
        sb.incompat |= self.incompat_wanted.load(Ordering::SeqCst);
        sb.backup_roots = backups_after(&sb, self.alloc.backup_floor().get());
        sb.compat |= COMPAT_BACKUP_ROOTS;
        sb.generation = generation;
        sb.fs_root = root;
        sb.next_objectid = self.next_objectid.load(Ordering::Relaxed);
        sb.bytes_used = (self.alloc.total_blocks() - self.alloc.free_blocks()).bytes();
        sb.commit_time_sec = sec;
        sb.commit_time_nsec = nsec;
        let (log_head, log_seq) = self.log.retire(Generation::new(generation));
        sb.log_head = log_head.get();
        sb.log_generation = log_seq;
        self.write_superblock(&sb)?;
        self.device
            .flush()
            .map_err(|e| Error::io(format!("commit {generation}: flush superblock"), e))?;
        self.log.set_reusable(log_head);
        if sb.incompat & INCOMPAT_LOG_ALIGNED != 0 {
            // Durable with the flag: every replay now looks for skipped batches.
            self.log.set_align(self.device.atomic_unit());
        }
        // Durable. Publish the new committed root; the old one releases the space this commit
        // freed once its last reader drops it.
        for node in nodes {
            self.cache.insert(node);
        }
        *self.superblock.lock() = sb;
        let new_release = ReleaseOnDrop::new(self.alloc.clone());
        let new_root = Arc::new(CommittedRoot {
            root,
            generation: Generation::new(generation),
            release: new_release.clone(),
        });
        // The new list before the new root: a snapshot view that still finds a deleted
        // snapshot then holds a root older than this one, whose release list keeps what the
        // deletion frees (`Engine::snapshot_view`).
        let list_change = list_change.map(|(list, deleted, before)| {
            self.snapshots.lock().list = list;
            (deleted, before)
        });
        let old = {
            let mut state = self.state.write();
            let old = state.first().committed.0.clone();
            state.each(|s| {
                s.frozen = None;
                s.committed = Arc::new(CommittedRootPin(new_root.clone()));
            });
            old
        };
        if let Some((mut deleted, mut before)) = list_change {
            if let Some(replaced) = replaced {
                before.push(replaced.clone());
                deleted.push(replaced);
            }
            self.give_back_deleted(generation, root, &before, &deleted);
            self.alloc.forget_holds(generation);
        }
        let freed = self.alloc.take_pinned(Generation::new(generation));
        self.alloc.unpin_count(freed.iter().map(|(_, b)| b).sum());
        old.release.freed_by.store(generation, Ordering::SeqCst);
        old.release.ranges.lock().extend(freed);
        // Space no committed root (backups included) references any more is discarded on the
        // device before any search can hand it out (DESIGN §14.4); a failed discard leaves
        // it deferred, and the commit stands.
        let device = &self.device;
        let discarded = self
            .alloc
            .commit_durable_with(Generation::new(generation), |ranges| {
                device.discard(&discard_ranges(ranges))
            });
        if let Err(e) = discarded {
            log::warn!("commit {generation}: discarding freed space: {e}");
        }
        *old.release.next.lock() = Some(new_release);
        self.counters.add(|c| &c.commits, 1);
        Ok(())
    }
}

impl Engine {
    /// Applies `ops` to the snapshot list for commit `generation` (whose fs tree is
    /// `fs_root`): writes the new list tree (its nodes join `nodes`), frees the old one's
    /// nodes (never shared: pinned in this commit), and sets the superblock's list fields
    /// and, with a first snapshot, `INCOMPAT_SNAPSHOTS`. Returns the new list, the deleted
    /// snapshots and the list before.
    #[allow(clippy::type_complexity)]
    fn write_snapshot_list(
        &self,
        ops: &[SnapshotOp],
        generation: u64,
        fs_root: RootPtr,
        sb: &mut Superblock,
        nodes: &mut Vec<Arc<Node>>,
    ) -> Result<(Vec<Snapshot>, Vec<Snapshot>, Vec<Snapshot>)> {
        let before = self.snapshots.lock().list.clone();
        let mut list = before.clone();
        let mut deleted = Vec::new();
        let mut next_id = sb.next_snapshot_id.max(1);
        for op in ops {
            match op {
                SnapshotOp::Create { name, created } => {
                    list.push(Snapshot {
                        id: next_id,
                        name: name.clone(),
                        generation,
                        root: fs_root,
                        created: *created,
                    });
                    next_id += 1;
                    sb.incompat |= INCOMPAT_SNAPSHOTS;
                }
                SnapshotOp::Delete { id } => {
                    if let Some(at) = list.iter().position(|s| s.id == *id) {
                        deleted.push(list.remove(at));
                    }
                }
                // The snapshot stays; the commit's root is its root.
                SnapshotOp::Rollback { .. } => {}
            }
        }
        if sb.snapshots.addr != 0 {
            let (_, old_nodes) = snapshot::read_list(self.ctx(), sb.snapshots)?;
            for addr in old_nodes {
                self.alloc.free_pinned(
                    Generation::new(generation),
                    BlockAddr::new(addr),
                    BlockCount::new(NODE_BLOCKS),
                );
            }
        }
        let (list_root, list_nodes) =
            snapshot::write_list(self.ctx(), &self.alloc, generation, &list)?;
        nodes.extend(list_nodes);
        if sb.incompat & INCOMPAT_SNAPSHOTS != 0 {
            sb.snapshots = list_root;
            sb.next_snapshot_id = next_id;
        }
        Ok((list, deleted, before))
    }

    /// After commit `generation` (fs tree `fs_root`) dropped `deleted` from the list `before`
    /// held: pins, in that commit, the blocks only they held (DESIGN §15.4), one after the
    /// other, oldest first, each against the snapshots and tree still standing then. A walk
    /// that fails leaves its blocks used until the next open derives the free space again (a
    /// leak, never damage); it is logged.
    fn give_back_deleted(
        &self,
        generation: u64,
        fs_root: RootPtr,
        before: &[Snapshot],
        deleted: &[Snapshot],
    ) {
        // Ordered by age: generation, then id (snapshots of one commit share a tree; a
        // rollback's replaced live tree has the largest id).
        let age = |s: &Snapshot| (s.generation, s.id);
        let mut standing: Vec<Snapshot> = before.to_vec();
        let mut victims = deleted.to_vec();
        victims.sort_by_key(age);
        for victim in victims {
            standing.retain(|s| s.id != victim.id);
            let older = standing
                .iter()
                .filter(|s| age(s) < age(&victim))
                .map(|s| s.generation)
                .max()
                .unwrap_or(0);
            let newer = standing
                .iter()
                .filter(|s| age(s) > age(&victim))
                .min_by_key(|s| age(s))
                .map(|s| s.root)
                .unwrap_or(fs_root);
            match snapshot::deletion_frees(self.ctx(), &victim, older, newer) {
                Ok(frees) => {
                    let blocks: u64 = frees.iter().map(|(_, n)| n.get()).sum();
                    for (addr, count) in frees {
                        self.alloc.forget_shared(addr, count);
                        self.alloc
                            .free_pinned(Generation::new(generation), addr, count);
                    }
                    log::debug!(
                        "commit {generation}: snapshot {:?} (id {}) gave back {blocks} blocks",
                        victim.name,
                        victim.id
                    );
                }
                Err(e) => log::warn!(
                    "commit {generation}: deleting snapshot {:?} (id {}): its blocks stay used \
                     until the next open: {e}",
                    victim.name,
                    victim.id
                ),
            }
        }
    }
}

/// Byte ranges for the device's discard of freed block ranges: sorted, adjacent ones merged.
fn discard_ranges(ranges: &[(BlockAddr, BlockCount)]) -> Vec<(u64, u64)> {
    let mut sorted: Vec<(u64, u64)> = ranges
        .iter()
        .map(|(addr, blocks)| (addr.get(), blocks.bytes()))
        .collect();
    sorted.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(sorted.len());
    for (start, len) in sorted {
        match merged.last_mut() {
            Some((s, l)) if *s + *l == start => *l += len,
            _ => merged.push((start, len)),
        }
    }
    merged
}

/// Marks the areas no tree references as used: the head (superblocks) and the log area.
pub(crate) fn mark_reserved_areas(alloc: &Allocator, log_start: u64, log_bytes: u64) {
    alloc.mark_used(
        BlockAddr::new(0),
        BlockCount::new(RESERVED_HEAD_BYTES / birch_format::BLOCK_SIZE),
    );
    alloc.mark_used(
        BlockAddr::new(log_start),
        BlockCount::new(log_bytes / birch_format::BLOCK_SIZE),
    );
}

/// The other slot's superblock, when it decodes, sits in its own slot, shares the fsid, is
/// older, and (with `need_flag`) keeps backup roots; `None` otherwise.
fn other_slot(
    device: &dyn BlockDevice,
    current: &Superblock,
    need_flag: bool,
) -> Option<Superblock> {
    let slot = 1 - current.slot();
    let mut bytes = vec![0u8; SUPER_BYTES];
    device.read_at(&mut bytes, SUPER_OFFSETS[slot]).ok()?;
    let other = Superblock::decode(&bytes, "other superblock slot").ok()?;
    (other.slot() == slot
        && other.fsid == current.fsid
        && other.generation < current.generation
        && (!need_flag || other.compat & COMPAT_BACKUP_ROOTS != 0))
        .then_some(other)
}

/// The older roots the superblocks name, newest first, one per generation (DESIGN §13.3,
/// §13.4): `current`'s backups, then the other slot's root and its backups. With `need_flag`
/// the other slot counts only when it carries `COMPAT_BACKUP_ROOTS` (the open, which keeps
/// these trees' blocks); without, its root is named even when an older build wrote it
/// (`fsck --repair`, which validates every tree it would fall back to).
pub(crate) fn older_roots(
    device: &dyn BlockDevice,
    current: &Superblock,
    need_flag: bool,
) -> Vec<BackupRoot> {
    let mut roots = current.backup_roots.clone();
    if let Some(other) = other_slot(device, current, need_flag) {
        roots.push(BackupRoot {
            generation: other.generation,
            fs_root: other.fs_root,
        });
        roots.extend(other.backup_roots);
    }
    roots.retain(|b| b.generation < current.generation);
    roots.sort_by_key(|b| std::cmp::Reverse(b.generation));
    roots.dedup_by_key(|b| b.generation);
    roots
}

/// The backup roots the commit after `previous` names: `previous`'s own root, then its
/// backups, newest first, at most [`BACKUP_ROOTS`], none below `floor` (a tree a reclaim may
/// have broken, DESIGN §13.2).
pub(crate) fn backups_after(previous: &Superblock, floor: u64) -> Vec<BackupRoot> {
    let newest = BackupRoot {
        generation: previous.generation,
        fs_root: previous.fs_root,
    };
    std::iter::once(newest)
        .chain(previous.backup_roots.iter().copied())
        .filter(|b| b.generation >= floor && b.generation > 0)
        .take(BACKUP_ROOTS)
        .collect()
}

/// [`Engine::walk_tree`] over any tree context (the open's walk, [`union_walk`], and the
/// snapshot walks of `snapshot.rs`).
pub(crate) fn walk_tree(
    ctx: TreeCtx<'_>,
    root: RootPtr,
    mut node: impl FnMut(u64, u64) -> Result<bool>,
    mut extent: impl FnMut(
        Key,
        std::result::Result<birch_format::items::FileExtent, FormatError>,
        u64,
    ) -> Result<()>,
) -> Result<()> {
    let mut stack = vec![(root.addr, root.generation, root.level)];
    while let Some((addr, generation, level)) = stack.pop() {
        if !node(addr, generation)? {
            continue;
        }
        let read = ctx.read(addr, generation, level)?;
        match &read.body {
            NodeBody::Internal(ptrs) => {
                stack.extend(ptrs.iter().map(|p| (p.addr, p.generation, level - 1)))
            }
            NodeBody::Leaf(items) => {
                for (key, value) in items {
                    if key.kind() == Some(ItemType::ExtentData) {
                        extent(*key, birch_format::items::FileExtent::decode(value), addr)?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// What [`union_walk`] found (DESIGN §15.6).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UnionWalk {
    /// Distinct nodes read (and verified), each once.
    pub nodes_read: u64,
    /// Child pointers (or roots) not followed because their node was already reached from
    /// an earlier root: a shared subtree is skipped whole.
    pub nodes_shared: u64,
    /// Extent items decoded (in the distinct leaves only).
    pub extents: u64,
    /// Data blocks marked used (distinct).
    pub data_blocks: u64,
    /// Data blocks an extent of a distinct leaf reached when an earlier leaf had marked them
    /// already: the same block referenced from a leaf another root's copy replaced.
    pub data_blocks_again: u64,
    /// With `count_refs`: blocks in the map of multiply referenced blocks.
    pub counted_blocks: u64,
}

/// The open walk over the union of several trees (DESIGN §15.6), as snapshots will need it (rule 3):
/// each distinct node is read once (a pointer to a node already reached at the same
/// generation is shared, its subtree skipped; at another generation the image is corrupt),
/// every node and extent is marked in a fresh allocator, and with `count_refs` every data
/// block reached again gets a reference count in a map (the cost of deriving counts for all
/// multiply referenced blocks). Reads through a fresh node cache as an open does. Today only
/// the engine benchmark (`birch-engine-bench --only open`) and a test call it; the open
/// itself walks the newest tree and the backup roots the same way
/// ([`Engine::open`]).
pub fn union_walk(
    device: &dyn BlockDevice,
    fsid: [u8; 16],
    total_bytes: u64,
    roots: &[RootPtr],
    count_refs: bool,
) -> Result<UnionWalk> {
    let cache = NodeCache::new(65536);
    let counters = Counters::default();
    let ctx = TreeCtx {
        device,
        cache: &cache,
        counters: &counters,
        fsid,
        owner: FS_TREE_ID,
    };
    let alloc = Allocator::new(total_bytes);
    let mut seen: HashMap<u64, u64> = HashMap::new();
    let mut refs: HashMap<u64, u32> = HashMap::new();
    let mut walk = UnionWalk::default();
    for root in roots {
        walk_tree(
            ctx,
            *root,
            |addr, generation| match seen.get(&addr) {
                Some(g) if *g == generation => {
                    walk.nodes_shared += 1;
                    Ok(false)
                }
                Some(g) => Err(Error::corrupt(
                    format!("union walk: node {addr:#x}"),
                    FormatError::invalid(
                        format!("node {addr:#x}"),
                        format!("generation {generation} from another root"),
                        format!("generation {g}"),
                    ),
                )),
                None => {
                    seen.insert(addr, generation);
                    walk.nodes_read += 1;
                    if !alloc.mark_used(BlockAddr::new(addr), BlockCount::new(NODE_BLOCKS)) {
                        return Err(Error::corrupt(
                            format!("union walk: node {addr:#x}"),
                            FormatError::invalid(
                                format!("node {addr:#x}"),
                                "on blocks an extent holds",
                                "one reference to a free block",
                            ),
                        ));
                    }
                    Ok(true)
                }
            },
            |key, extent, addr| {
                let extent =
                    extent.map_err(|e| Error::corrupt(format!("extent {key} in {addr:#x}"), e))?;
                walk.extents += 1;
                if let Some((disk, blocks)) = extent.disk_range() {
                    if alloc.mark_used(BlockAddr::new(disk), BlockCount::new(blocks)) {
                        walk.data_blocks += blocks;
                    } else {
                        walk.data_blocks_again += blocks;
                        if count_refs {
                            let first = disk / birch_format::BLOCK_SIZE;
                            for block in first..first + blocks {
                                *refs.entry(block).or_insert(1) += 1;
                            }
                        }
                    }
                }
                Ok(())
            },
        )?;
    }
    walk.counted_blocks = refs.len() as u64;
    Ok(walk)
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

/// The items of one committed tree, read through the engine's node cache: no delta, no
/// later commit. Built by [`Engine::committed_view`]; `items::ReadView` reads through it.
pub struct CommittedView<'e> {
    engine: &'e Engine,
    root: Arc<CommittedRoot>,
}

impl CommittedView<'_> {
    /// The committed tree this view reads.
    pub fn root(&self) -> &CommittedRoot {
        &self.root
    }

    fn reader(&self) -> TreeReader<'_> {
        TreeReader {
            ctx: self.engine.ctx(),
            root: self.root.root,
        }
    }

    /// The value of `key` in this tree. May do device I/O.
    pub fn get(&self, key: &Key) -> Result<Option<Vec<u8>>> {
        self.engine.check_up()?;
        self.reader().get(key)
    }

    /// Up to `limit` items of this tree in `[lo, hi)`. May do device I/O.
    pub fn range(&self, lo: &Key, hi: &Key, limit: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        self.engine.check_up()?;
        self.reader().range(lo, hi, limit)
    }
}

/// A mutation of the running transaction: holds the gate shared, so a commit cannot freeze
/// half of it. Never do I/O while holding one.
pub struct WriteTxn<'e> {
    engine: &'e Engine,
    _guard: crate::striped::StripedRead<'e, ()>,
}

impl WriteTxn<'_> {
    /// Sets `key` to `value`.
    pub fn put(&self, key: Key, value: Vec<u8>) {
        self.engine.active.put(key, Some(Arc::from(value)));
    }

    /// Deletes `key`.
    pub fn delete(&self, key: Key) {
        self.engine.active.put(key, None);
    }

    /// The generation these changes will commit in.
    pub fn generation(&self) -> Generation {
        self.engine.running_generation()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::MemDevice;

    fn k(offset: u64) -> Key {
        Key::new(300, ItemType::ExtentData, offset)
    }

    /// Every item of the tree at `root`, read straight from the device (no node cache, so
    /// an overwritten node shows): `None` when a node no longer verifies.
    fn raw_items(
        device: &dyn BlockDevice,
        fsid: [u8; 16],
        root: RootPtr,
    ) -> Option<Vec<(Key, Vec<u8>)>> {
        raw_tree(device, fsid, root).map(|(items, _)| items)
    }

    /// [`raw_items`] and the addresses of the tree's nodes.
    fn raw_tree(
        device: &dyn BlockDevice,
        fsid: [u8; 16],
        root: RootPtr,
    ) -> Option<(Vec<(Key, Vec<u8>)>, Vec<u64>)> {
        let mut items = Vec::new();
        let mut nodes = Vec::new();
        let mut stack = vec![(root.addr, root.generation, root.level)];
        while let Some((addr, generation, level)) = stack.pop() {
            let mut bytes = vec![0u8; NODE_SIZE];
            device.read_at(&mut bytes, addr).ok()?;
            nodes.push(addr);
            let expect = birch_format::node::Expect {
                fsid,
                addr,
                generation,
                owner: FS_TREE_ID,
                level: Some(level),
            };
            match Node::decode(&bytes, &expect).ok()?.body {
                NodeBody::Internal(ptrs) => {
                    stack.extend(ptrs.iter().map(|p| (p.addr, p.generation, level - 1)))
                }
                NodeBody::Leaf(leaf) => items.extend(leaf),
            }
        }
        items.sort_by_key(|(key, _)| *key);
        Some((items, nodes))
    }

    /// Whether no node of the tree at `root` is free in the allocator (so no commit may
    /// write there).
    fn tree_held(engine: &Engine, root: RootPtr) -> bool {
        raw_tree(&**engine.device(), engine.fsid(), root).is_some_and(|(_, nodes)| {
            nodes
                .iter()
                .all(|a| engine.allocator().is_used(BlockAddr::new(*a)))
        })
    }

    /// Rewrites every one of `count` items with values of `round`, then commits.
    fn rewrite_all(engine: &Engine, count: u64, round: u8) -> u64 {
        let txn = engine.begin().expect("begin");
        for i in 0..count {
            txn.put(Key::new(1000 + i, ItemType::Xattr, 0), vec![round; 300]);
        }
        drop(txn);
        engine.commit().expect("commit").get()
    }

    /// DESIGN §13.2: the K commits after generation N rewrite every item of the tree, and
    /// generation N's tree is still whole on the device after each of them (no block of it
    /// was reused), is named among the superblock's backup roots, and survives a reopen (the
    /// open walk keeps it), its nodes never free in the allocator meanwhile. With
    /// `DEFER_COMMITS` at 0 (checked by hand) tree N's nodes are free after commit N+2.
    #[test]
    fn the_k_commits_after_n_leave_tree_n_whole() {
        // 6000 items of 300 bytes take about 960 blocks per tree (leaves half full after
        // the rewrites); 32 MiB leaves about 7,100 blocks, room for the live tree, the
        // K + 1 kept and the one being written, and little more, so the allocator wraps.
        let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(32 << 20));
        drop(Engine::create(dev.clone(), &MkfsOptions::default(), Vec::new()).expect("create"));
        let engine = Engine::open(dev.clone()).expect("open");
        let fsid = engine.fsid();
        let count = 6000;
        let n = rewrite_all(&engine, count, 1);
        let root_n = engine.superblock().fs_root;
        let items_n = raw_items(&*dev, fsid, root_n).expect("tree N reads");
        assert_eq!(items_n.len() as u64, count);
        for round in 0..BACKUP_ROOTS as u8 {
            let g = rewrite_all(&engine, count, 2 + round);
            let sb = engine.superblock();
            assert_eq!(sb.generation, g);
            assert!(
                sb.backup_roots
                    .iter()
                    .any(|b| b.generation == n && b.fs_root == root_n),
                "superblock {g} names generation {n}: {:?}",
                sb.backup_roots
            );
            assert!(
                raw_items(&*dev, fsid, root_n).as_ref() == Some(&items_n),
                "tree {n} after commit {g}"
            );
            assert!(tree_held(&engine, root_n), "tree {n} free after commit {g}");
        }
        drop(engine);
        let engine = Engine::open(dev.clone()).expect("reopen");
        assert!(
            engine.allocator().deferred_blocks() > BlockCount::new(0),
            "the open walk defers backup-only blocks"
        );
        let sb = engine.superblock();
        assert_eq!(sb.backup_roots.len(), BACKUP_ROOTS);
        let oldest = sb.backup_roots[BACKUP_ROOTS - 1];
        let items_oldest = raw_items(&*dev, fsid, oldest.fs_root).expect("oldest backup reads");
        // Tree G is named by superblocks up to G+K, so it stays held until commit G+K+2
        // is durable (DESIGN §13.2) and whole until then.
        let held_until = oldest.generation + BACKUP_ROOTS as u64 + 1;
        for round in 0..BACKUP_ROOTS as u8 {
            let g = rewrite_all(&engine, count, 10 + round);
            if g <= held_until + 1 {
                assert!(
                    raw_items(&*dev, fsid, oldest.fs_root).as_ref() == Some(&items_oldest),
                    "backup {} after reopen and commit {g}",
                    oldest.generation
                );
            }
            if g <= held_until {
                assert!(
                    tree_held(&engine, oldest.fs_root),
                    "backup free after commit {g}"
                );
            }
        }
    }

    /// An image from before the flag (compat bit clear, backup bytes zero) opens; its first
    /// commit by this build sets the flag and names the previous root.
    #[test]
    fn an_image_without_the_flag_opens_and_gains_it() {
        let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(16 << 20));
        drop(Engine::create(dev.clone(), &MkfsOptions::default(), Vec::new()).expect("create"));
        for offset in SUPER_OFFSETS {
            let mut bytes = vec![0u8; SUPER_BYTES];
            dev.read_at(&mut bytes, offset).expect("read");
            let mut sb = Superblock::decode(&bytes, "slot").expect("decode");
            sb.compat = 0;
            sb.backup_roots.clear();
            dev.write_at(&sb.encode(), offset).expect("write");
        }
        let engine = Engine::open(dev.clone()).expect("open an image without the flag");
        assert!(engine.superblock().backup_roots.is_empty());
        let before = engine.superblock();
        rewrite_all(&engine, 10, 1);
        let after = engine.superblock();
        assert_ne!(after.compat & COMPAT_BACKUP_ROOTS, 0);
        assert_eq!(after.backup_roots[0].generation, before.generation);
        assert_eq!(after.backup_roots[0].fs_root, before.fs_root);
    }

    fn last(engine: &Engine, floor: u64, key: u64) -> Option<u64> {
        engine
            .last_in(&k(floor), &k(key))
            .expect("last_in")
            .map(|(key, _)| key.offset)
    }

    /// `bench_global_objectid_lock` (seed 002's "before"): ids come one at a time from the
    /// shared counter (a second thread's id follows the first's, no batch in between), and a
    /// create that finds the counter's mutex held waits for it and counts the wait. Off, a
    /// thread takes a batch of its own and never touches the mutex.
    #[test]
    fn the_global_objectid_lock_switch_takes_one_lock_per_id_and_counts_waits() {
        let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(32 << 20));
        drop(Engine::create(dev.clone(), &MkfsOptions::default(), Vec::new()).expect("create"));
        let engine = Engine::open(dev).expect("open");
        let other_thread = |engine: &Arc<Engine>| {
            let engine = engine.clone();
            std::thread::spawn(move || engine.allocate_objectid().expect("id").get())
                .join()
                .expect("thread")
        };

        // Off: each thread has a batch of its own; the mutex is never asked for.
        let a = engine.allocate_objectid().expect("id").get();
        let b = other_thread(&engine);
        assert!(b.abs_diff(a) >= OBJECTID_BATCH, "{a} and {b} share a batch");
        let held = engine.objectid_lock.lock();
        let c = other_thread(&engine);
        drop(held);
        assert!(c > b);
        assert_eq!(engine.counters().values().objectid_lock_waits, 0);

        // On: one id at a time, the next thread's id right after.
        engine.set_bench_global_objectid_lock(true);
        let d = engine.allocate_objectid().expect("id").get();
        let e = other_thread(&engine);
        assert_eq!(e, d + 1);
        let dir = engine.allocate_objectid_alone().expect("id").get();
        assert_eq!(dir % OBJECTID_BATCH, 0, "a directory still starts a batch");
        assert!(engine.allocate_objectid().expect("id").get() >= dir + OBJECTID_BATCH);

        // A create that finds the mutex held waits until it is released, and says so.
        let held = engine.objectid_lock.lock();
        let waiter = {
            let engine = engine.clone();
            std::thread::spawn(move || engine.allocate_objectid().expect("id").get())
        };
        while engine.counters().values().objectid_lock_waits == 0 {
            assert!(!waiter.is_finished(), "allocated past a held lock");
            std::thread::yield_now();
        }
        assert!(!waiter.is_finished());
        drop(held);
        waiter.join().expect("waiter");
        assert_eq!(engine.counters().values().objectid_lock_waits, 1);
    }

    #[test]
    fn a_short_range_sees_past_many_deletions_in_the_delta() {
        let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(32 << 20));
        drop(Engine::create(dev.clone(), &MkfsOptions::default(), Vec::new()).expect("create"));
        let engine = Engine::open(dev).expect("open");
        {
            let txn = engine.begin().expect("begin");
            for offset in 0..600 {
                txn.put(k(offset), vec![offset as u8; 40]);
            }
        }
        engine.commit().expect("commit");
        // A truncate's worth of deletions in the delta, over items still in the tree.
        {
            let txn = engine.begin().expect("begin");
            for offset in 0..590 {
                txn.delete(k(offset));
            }
        }
        let firsts = |limit| -> Vec<u64> {
            engine
                .range(&k(0), &k(u64::MAX), limit)
                .expect("range")
                .into_iter()
                .map(|(key, _)| key.offset)
                .collect()
        };
        assert_eq!(firsts(1), vec![590]);
        assert_eq!(firsts(3), vec![590, 591, 592]);
        assert_eq!(firsts(100), (590..600).collect::<Vec<_>>());
        // Everything deleted: nothing, not an endless look.
        {
            let txn = engine.begin().expect("begin");
            for offset in 590..600 {
                txn.delete(k(offset));
            }
        }
        assert_eq!(firsts(1), Vec::<u64>::new());
    }

    #[test]
    fn last_in_merges_the_delta_over_the_tree() {
        let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(32 << 20));
        drop(Engine::create(dev.clone(), &MkfsOptions::default(), Vec::new()).expect("create"));
        let engine = Engine::open(dev).expect("open");
        {
            let txn = engine.begin().expect("begin");
            for offset in [10, 20, 30] {
                txn.put(k(offset), vec![offset as u8]);
            }
        }
        engine.commit().expect("commit");
        assert_eq!(last(&engine, 0, 35), Some(30));
        {
            // Newer layer: 30 deleted, 25 added; the tree still has 30.
            let txn = engine.begin().expect("begin");
            txn.delete(k(30));
            txn.put(k(25), vec![25]);
        }
        assert_eq!(last(&engine, 0, 35), Some(25));
        assert_eq!(
            last(&engine, 26, 35),
            None,
            "a deletion hides the tree's item"
        );
        engine.begin().expect("begin").delete(k(25));
        assert_eq!(last(&engine, 0, 35), Some(20));
        assert_eq!(last(&engine, 0, 19), Some(10));
        assert_eq!(last(&engine, 11, 19), None);
        assert_eq!(last(&engine, 0, 9), None);
        let value = engine.last_in(&k(0), &k(20)).expect("last_in");
        assert_eq!(value.map(|(_, v)| v.to_vec()), Some(vec![20]));
    }

    /// DESIGN §15.6: the union walk over trees that share subtrees reads each distinct node
    /// once (a device read per node, counted), skips a shared subtree at its top, and marks
    /// the data blocks an extent of a changed leaf reaches again only once.
    #[test]
    fn the_union_walk_reads_each_distinct_node_once() {
        let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(64 << 20));
        drop(Engine::create(dev.clone(), &MkfsOptions::default(), Vec::new()).expect("create"));
        let engine = Engine::open(dev.clone()).expect("open");
        let fsid = engine.fsid();
        let extent = |block: u64| {
            birch_format::items::FileExtent {
                generation: 1,
                kind: birch_format::items::ExtentKind::Regular {
                    disk_addr: (4096 + block) * birch_format::BLOCK_SIZE,
                    csums: vec![0],
                },
                shared: false,
            }
            .encode()
        };
        let txn = engine.begin().expect("begin");
        for i in 0..3000u64 {
            txn.put(k(i * birch_format::BLOCK_SIZE), extent(i));
        }
        drop(txn);
        engine.commit().expect("commit");
        // Keep each tree whole (its reader pins what later commits free), change a few
        // items, commit: three trees sharing most of their nodes.
        let mut kept = vec![engine.committed_root()];
        for round in 0..2u64 {
            let txn = engine.begin().expect("begin");
            txn.put(
                k(round * 1000 * birch_format::BLOCK_SIZE),
                extent(5000 + round),
            );
            drop(txn);
            engine.commit().expect("commit");
            kept.push(engine.committed_root());
        }
        let roots: Vec<RootPtr> = kept.iter().rev().map(|c| c.root).collect();
        let mut distinct = std::collections::HashSet::new();
        let mut total = 0;
        for root in &roots {
            let (_, nodes) = raw_tree(&*dev, fsid, *root).expect("tree reads");
            total += nodes.len();
            distinct.extend(nodes);
        }
        assert!(distinct.len() < total, "the trees share nodes");
        let reads = dev.counters().values().device_reads;
        let walk = union_walk(&*dev, fsid, dev.size_bytes(), &roots, true).expect("union walk");
        let reads = dev.counters().values().device_reads - reads;
        assert_eq!(walk.nodes_read, distinct.len() as u64);
        assert_eq!(reads, walk.nodes_read, "one device read per distinct node");
        assert!(
            walk.nodes_shared >= 2,
            "a shared subtree is skipped: {walk:?}"
        );
        // Every extent's blocks once (3000, and the 2 new ones); an extent of a copied leaf
        // is decoded again but its blocks are marked once.
        assert_eq!(walk.data_blocks, 3002);
        assert_eq!(walk.counted_blocks, walk.data_blocks_again);
        assert!(walk.extents < 3 * 3000);
    }
}
