//! The engine: transactions, commit, and the read path over delta and committed tree.
//!
//! Owns: generation numbers, the running and frozen deltas, the committed root, the commit
//! order (write nodes, flush, write superblock N to slot N mod 2, flush), releasing pinned
//! space once a commit is durable and unobserved, the object id high-water mark, the
//! sticky read-only state after a failed commit, and the shutdown (its device [`Fence`]:
//! once shut down, no I/O reaches the image and every call fails with [`Error::Shutdown`]).
//!
//! Must not touch: files, inodes, names, FUSE. No lock is held across a flush but the commit
//! lock, which only commits take (DESIGN §8): the `gate` (shared by every mutation and, under
//! [`Engine::hold`], across its data writes; exclusive only for the in-memory freeze) and the
//! state lock are released before any flush. Readers never wait for a commit: they read the running
//! delta, then the frozen one, then the immutable committed root.
//!
//! Layout: this file holds [`Engine`] (its fields, small accessors, the read-only state and
//! shutdown), [`WriteTxn`] and `begin`/`hold`; `open` makes and opens images, `commit`
//! commits, `read` reads merged layers and committed trees, `snapshots` runs the snapshot
//! policy, `objectid` hands out object ids, `fsync` wraps the fsync log. Each part's own
//! doc says what it owns and must not touch.

mod commit;
mod fsync;
mod objectid;
mod open;
mod read;
mod snapshots;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use birch_format::superblock::{DeviceStats, Superblock, INCOMPAT_LOG_ALIGNED};
use birch_format::{BlockAddr, BlockCount, Generation, Key, FS_TREE_ID};
use parking_lot::{Mutex, RwLock};

use crate::pending::PendingData;
use crate::striped::Striped;

use crate::alloc::{Allocator, Purpose};
use crate::btree::TreeCtx;
use crate::cache::NodeCache;
use crate::counters::{Counters, LatencyHistogram};
use crate::delta::Delta;
use crate::device::{BlockDevice, Fence};
use crate::error::{Error, Result};
use crate::log::{FsyncLog, Replay};
use crate::readonly::ReadOnlyCause;

/// The union walk moved to `btree::walk`; kept here for callers of `txn::union_walk`.
pub use crate::btree::walk::{union_walk, UnionWalk};
use commit::CommitQueue;
pub use fsync::LogHandle;
use objectid::ObjectIds;
pub(crate) use open::{mark_reserved_areas, older_roots};
pub use open::{MkfsOptions, OpenHead};
use read::ReadState;
pub use read::{CommittedRoot, CommittedView};
use snapshots::SnapshotState;

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
    /// The commit lock, its waiters, the parallel apply in progress and the commit switches.
    commits: CommitQueue,
    superblock: Mutex<Superblock>,
    /// The device's lifetime error counts: what the superblock held at open (zero after a
    /// clear), and this mount's counts at the last clear, to take off. Each commit writes the
    /// first plus this mount's counts less the second ([`Engine::device_stats`]).
    device_stats_base: Mutex<(DeviceStats, DeviceStats)>,
    /// Something only the superblock holds changed (the device counts were cleared): the next
    /// commit writes a superblock even with no other change.
    superblock_changed: AtomicBool,
    /// Incompat feature flags the next commit sets (a change that needs one was recorded).
    incompat_wanted: AtomicU64,
    /// The object-id counter (and its benchmark-only global lock).
    ids: ObjectIds,
    /// The recorded read-only cause (a failed commit or log write, a read-only mount).
    read_only: ReadOnlyState,
    log: FsyncLog,
    /// Decoded blobs read last (DESIGN §16.6); the data layer's read path fills and uses it.
    blobs: crate::data::BlobCache,
    replay: Mutex<Option<Replay>>,
    /// The snapshots as of the last durable commit, and the changes the next commit makes.
    /// Taken only briefly (never across I/O); inside the gate at a freeze.
    snapshots: Mutex<SnapshotState>,
}

fn now() -> (i64, u32) {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    (d.as_secs() as i64, d.subsec_nanos())
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

/// The read-only state an engine records ([`Engine::set_read_only`]; a shutdown is its fence's,
/// and only flags this one).
struct ReadOnlyState {
    cause: RwLock<Option<ReadOnlyCause>>,
    /// Whether `cause` holds one, or the engine is shut down: every mutation asks, so the
    /// common answer (no) costs one load instead of a lock on a line every core writes.
    flagged: AtomicBool,
    /// `errors=panic`: a failure aborts the process instead of turning read-only.
    abort_on_failure: AtomicBool,
}

impl ReadOnlyState {
    fn new() -> ReadOnlyState {
        ReadOnlyState {
            cause: RwLock::new(None),
            flagged: AtomicBool::new(false),
            abort_on_failure: AtomicBool::new(false),
        }
    }

    /// Whether a mutation must look closer ([`ReadOnlyState::cause`], the shutdown).
    fn flagged(&self) -> bool {
        self.flagged.load(Ordering::SeqCst)
    }

    /// Sends every mutation down the slow path (a shutdown, which records no cause).
    fn flag(&self) {
        self.flagged.store(true, Ordering::SeqCst);
    }

    /// The recorded cause.
    fn cause(&self) -> Option<ReadOnlyCause> {
        self.cause.read().clone()
    }

    /// Records `cause` unless the recorded one outranks it ([`ReadOnlyCause::replaces`]).
    fn set(&self, cause: ReadOnlyCause) {
        let mut ro = self.cause.write();
        let replace = match ro.as_ref() {
            None => true,
            Some(current) => cause.replaces(current),
        };
        if replace && !cause.is_chosen() && self.abort_on_failure.load(Ordering::SeqCst) {
            log::error!("birchfs stops the process (errors=panic): {cause}");
            std::process::abort();
        }
        if replace {
            log::log!(cause.log_level(), "birchfs is now read-only: {cause}");
            *ro = Some(cause);
            self.flagged.store(true, Ordering::SeqCst);
        }
    }

    /// Drops the recorded cause, unless it is one a remount may not undo.
    fn clear(&self) -> Result<()> {
        let mut ro = self.cause.write();
        if let Some(cause) = ro.as_ref() {
            if !cause.may_become_writable() {
                return Err(Error::ReadOnly(cause.clone()));
            }
        }
        *ro = None;
        self.flagged.store(false, Ordering::SeqCst);
        Ok(())
    }
}

/// A mutation of the running transaction: holds the gate shared, so a commit cannot freeze
/// half of it. Never do I/O while holding one (an operation that must: [`DataHold`]).
pub struct WriteTxn<'e> {
    engine: &'e Engine,
    _guard: crate::striped::StripedRead<'e, ()>,
}

/// The gate held across one multi-step operation ([`Engine::hold`]): while it lives no commit
/// can freeze the running delta, so everything the operation records (each step through its
/// own [`Engine::begin`]) commits together.
///
/// The rule this type stands for, and [`WriteTxn`]'s does not allow: data I/O (allocating,
/// writing and reading data blocks) may happen while it is held, as the steps of a write or a
/// flush need. Never a flush, a commit, a log wait or anything that waits for one: a commit
/// waits for every holder of the gate, so its holder would wait for itself. Hold it with the
/// inode's lock taken first, and no longer than the operation.
#[must_use = "the gate is let go when the hold is dropped"]
pub struct DataHold<'e> {
    gate: WriteTxn<'e>,
}

impl DataHold<'_> {
    /// The generation the operation's changes will commit in.
    pub fn generation(&self) -> Generation {
        self.gate.generation()
    }
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

    /// The device, behind the engine's shutdown fence: I/O through it fails once the engine
    /// is shut down.
    pub fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.device
    }

    /// The errors the device returned since the open (reads, writes, flushes).
    pub fn device_errors(&self) -> &crate::device::DeviceErrors {
        self.fence.errors()
    }

    /// The device's error counts over the filesystem's life: those the superblock held at
    /// open plus this mount's (device errors, checksum failures). What the next commit
    /// writes (compat flag `COMPAT_DEVICE_STATS`, FORMAT.md §3).
    pub fn device_stats(&self) -> DeviceStats {
        let (add, sub) = *self.device_stats_base.lock();
        let now = self.mount_device_stats();
        DeviceStats {
            read_errors: (add.read_errors + now.read_errors).saturating_sub(sub.read_errors),
            write_errors: (add.write_errors + now.write_errors).saturating_sub(sub.write_errors),
            flush_errors: (add.flush_errors + now.flush_errors).saturating_sub(sub.flush_errors),
            checksum_errors: (add.checksum_errors + now.checksum_errors)
                .saturating_sub(sub.checksum_errors),
        }
    }

    /// This mount's device error counts.
    fn mount_device_stats(&self) -> DeviceStats {
        let now = self.fence.errors();
        DeviceStats {
            read_errors: now.reads.load(Ordering::Relaxed),
            write_errors: now.writes.load(Ordering::Relaxed),
            flush_errors: now.flushes.load(Ordering::Relaxed),
            checksum_errors: self.counters.values().checksum_errors,
        }
    }

    /// Sets the lifetime device error counts to zero (`birch errors --clear`, as `btrfs
    /// device stats -z` and `zpool clear` do); the next commit writes them, and writes a
    /// superblock for it even when nothing else changed. This mount's own counts (`birch
    /// stats`' `device_*_errors`) are left as they are.
    pub fn clear_device_stats(&self) {
        *self.device_stats_base.lock() = (DeviceStats::default(), self.mount_device_stats());
        self.superblock_changed.store(true, Ordering::SeqCst);
    }

    /// Discards the space free now in device bytes `[start, start + len)`, in free runs of
    /// at least `minlen` bytes (`fstrim`, the `FITRIM` ioctl; DESIGN §14.4): the space free at
    /// mount, and any freed since, is otherwise never discarded. Runs are taken out of the
    /// allocator's searches while their discard is in flight, a batch at a time
    /// (`Allocator::trim_free`), so no allocation gets a block under discard and none waits
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
        self.read_only.flag();
        // No leader comes for deferred waits any more (`LogHandle::wait` and `LogHandle::lead`
        // refuse).
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

    /// The decoded-blob cache of the data layer's reads.
    pub(crate) fn blob_cache(&self) -> &crate::data::BlobCache {
        &self.blobs
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
    /// One atomic load in the common case (nothing recorded, not shut down): every fsync asks.
    pub fn read_only_cause(&self) -> Option<ReadOnlyCause> {
        if self.is_shut_down() {
            return Some(ReadOnlyCause::Shutdown);
        }
        if !self.read_only.flagged() {
            return None;
        }
        self.read_only.cause()
    }

    /// The cause [`Engine::set_read_only`] recorded, as text (a shutdown is not recorded:
    /// [`Engine::is_shut_down`] tells it, and [`Engine::read_only_cause`] includes it).
    pub fn read_only_reason(&self) -> Option<String> {
        self.read_only.cause().map(|cause| cause.to_string())
    }

    /// `errors=panic`: from now on a failure (a failed commit or log write, a device error
    /// the policy turns into one) aborts the process, as ext4's `errors=panic` panics the
    /// kernel, instead of turning the engine read-only. What was durable stays so; what was
    /// not acknowledged is lost, as at a power cut.
    pub fn abort_on_failure(&self, abort: bool) {
        self.read_only
            .abort_on_failure
            .store(abort, Ordering::SeqCst);
    }

    /// Turns the engine read-only (a failed commit or log write; or a read-only mount). A
    /// failure replaces a chosen read-only state ([`ReadOnlyCause::replaces`]): once a commit
    /// has failed, no later commit may run and no remount may make the engine writable.
    pub fn set_read_only(&self, cause: ReadOnlyCause) {
        if self.is_shut_down() {
            // The failure is the shutdown's doing (its fence refused the I/O).
            return;
        }
        self.read_only.set(cause);
    }

    /// Makes the engine writable again (remount rw), unless its read-only state is one a
    /// remount may not undo ([`ReadOnlyCause::may_become_writable`]).
    pub fn clear_read_only(&self) -> Result<()> {
        self.check_up()?;
        self.read_only.clear()
    }

    /// Starts a mutation of the running transaction. Hold it only for in-memory work.
    pub fn begin(&self) -> Result<WriteTxn<'_>> {
        // Recursive: an operation that holds [`Engine::hold`] records its items through here.
        let guard = self.gate.read();
        if self.read_only.flagged() {
            self.check_up()?;
            if let Some(cause) = self.read_only.cause() {
                return Err(Error::ReadOnly(cause));
            }
        }
        Ok(WriteTxn {
            engine: self,
            _guard: guard,
        })
    }

    /// Keeps every change of one multi-step operation (a write that allocates, writes data and
    /// then records extents and the inode) in the same transaction: a commit cannot freeze the
    /// delta between the steps. Data I/O may happen under it, never a flush or a commit (the
    /// rule `DataHold` carries). The same gate and checks as [`Engine::begin`]; the
    /// operation records its items through `begin` meanwhile.
    pub fn hold(&self) -> Result<DataHold<'_>> {
        Ok(DataHold {
            gate: self.begin()?,
        })
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
}
