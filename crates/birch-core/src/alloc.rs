//! The space allocator.
//!
//! Owns: the in-memory free-space map (one bit per block, split into groups of
//! [`GROUP_BLOCKS`] each behind its own mutex), the metadata reserve, pinning of space
//! freed in a transaction, and the deferred list with the discards in flight of its ranges,
//! and of free ranges a trim (`fstrim`, [`Allocator::trim_free`]) discards.
//!
//! Must not touch: the device. Its state is derived at open from the committed trees (every
//! node and every extent a file references is in use), so it reaches disk only through the
//! commits that change those trees. Space freed in generation N is *pinned*: the engine hands
//! it back with [`Allocator::release`] only after commit N is durable and no reader still walks
//! the committed root that referenced it, so committed state is never overwritten. After that it is
//! *deferred* ([`Allocator::defer`]): still unused by any search until commit N + K + 1 is
//! durable, so the K older trees the superblock names as backups stay whole (DESIGN §13.2).
//! Deferred space counts as free; an allocation that finds nothing else reclaims it at once,
//! giving up those backups ([`Allocator::backup_floor`]). Space leaving the deferred list is
//! handed to the caller's discard first ([`Allocator::commit_durable_with`]) and stays set in
//! the bitmap, out of every search and reclaim, until that discard has returned; no allocator
//! lock is held while it runs.
//!
//! **Sharing with snapshots** (DESIGN §15.4, §15.6 rule 2): every free of a block a committed
//! tree referenced goes through [`Allocator::free_recorded`], told the block's birth
//! generation. A snapshot of commit g holds every block born at or before g that is freed from
//! the live tree after g: such a free is *kept* (the block stays used, nothing recorded), and
//! the snapshot's deletion gives it back. The allocator knows the snapshots as
//! [`SnapshotHold`]s; with none, `free_recorded` is [`Allocator::free_pinned`].
//!
//! Concurrency (seed 002, ext4's `__ext4_new_inode`): each thread prefers its own group, so
//! concurrent writers take space under different locks; a group lock is held only while bits
//! are scanned, never across anything that blocks.

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use birch_format::superblock::BACKUP_ROOTS;
use birch_format::{BlockAddr, BlockCount, Generation, BLOCK_SIZE};
use parking_lot::{Condvar, Mutex, RwLock};

use crate::error::{Error, Result};

/// Blocks per allocation group: 32768 blocks = 128 MiB, 4 KiB of bitmap.
pub const GROUP_BLOCKS: u64 = 32768;

/// Who the space is for: data may not dip into the metadata reserve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// File data: fails with `NoSpace` rather than take the metadata reserve.
    Data,
    /// Tree nodes: may use the metadata reserve, so a commit can still complete when data
    /// has filled the device.
    Metadata,
    /// File data whose space was reserved beforehand ([`Allocator::try_reserve`]: buffered
    /// writes reserve at WRITE and allocate at flush): may take reserved space, not the
    /// metadata reserve. The caller gives the reservation back with [`Allocator::unreserve`].
    Reserved,
}

struct Group {
    first_block: u64,
    blocks: u64,
    bits: Vec<u64>,
    free: u64,
    hint: u64,
}

impl Group {
    fn is_used(&self, rel: u64) -> bool {
        self.bits[(rel / 64) as usize] & (1 << (rel % 64)) != 0
    }

    fn set(&mut self, rel: u64, used: bool) {
        let word = &mut self.bits[(rel / 64) as usize];
        let mask = 1u64 << (rel % 64);
        if used {
            *word |= mask;
        } else {
            *word &= !mask;
        }
    }

    /// Finds a free run of at least `min` blocks (up to `max`), starting at the hint.
    fn find_run(&self, min: u64, max: u64) -> Option<(u64, u64)> {
        if self.free < min {
            return None;
        }
        let mut scanned = 0;
        let mut rel = self.hint % self.blocks;
        while scanned < self.blocks {
            if rel % 64 == 0
                && rel + 64 <= self.blocks
                && self.bits[(rel / 64) as usize] == u64::MAX
            {
                scanned += 64;
                rel = (rel + 64) % self.blocks;
                continue;
            }
            if self.is_used(rel) {
                scanned += 1;
                rel = (rel + 1) % self.blocks;
                continue;
            }
            let start = rel;
            let mut len = 0;
            while len < max && start + len < self.blocks && !self.is_used(start + len) {
                len += 1;
            }
            if len >= min {
                return Some((start, len));
            }
            scanned += len.max(1);
            rel = (start + len.max(1)) % self.blocks;
        }
        None
    }
}

/// The deferred list and the discards in flight, under one lock.
#[derive(Default)]
struct Deferred {
    /// Ranges freed by a durable, unobserved commit, waiting for commit `freed_by + K + 1`:
    /// (freed_by, addr, blocks). Set in the bitmap, counted in `free_blocks`.
    waiting: VecDeque<(Generation, BlockAddr, BlockCount)>,
    /// Ranges taken from `waiting` whose discard is in flight: (batch, freed_by, addr,
    /// blocks). Still set in the bitmap (no search takes them) and counted in `free_blocks`;
    /// a reclaim skips them, so their discard never races a write to them.
    discarding: Vec<(u64, Generation, BlockAddr, BlockCount)>,
    /// Free ranges a trim ([`Allocator::trim_free`]) took out of the searches while their
    /// discard is in flight: (batch, addr, blocks). Set in the bitmap (out of their group's
    /// free count), still counted in `free_blocks`; cleared when the discard ends.
    trimming: Vec<(u64, BlockAddr, BlockCount)>,
    /// The number the next discard batch gets.
    next_batch: u64,
}

impl Deferred {
    /// Whether `addr` lies in a range whose discard is in flight.
    fn is_discarding(&self, addr: BlockAddr) -> bool {
        self.discarding
            .iter()
            .any(|(_, _, a, b)| *a <= addr && addr < *a + *b)
            || self
                .trimming
                .iter()
                .any(|(_, a, b)| *a <= addr && addr < *a + *b)
    }

    /// Whether a discard batch numbered `newest` or lower is still in flight.
    fn any_in_flight_up_to(&self, newest: u64) -> bool {
        self.discarding.iter().any(|(b, ..)| *b <= newest)
            || self.trimming.iter().any(|(b, ..)| *b <= newest)
    }
}

/// Most free ranges one trim batch takes out of the searches at once.
const TRIM_BATCH_RANGES: usize = 64;

thread_local! {
    static PREFERRED_GROUP: Cell<usize> = const { Cell::new(usize::MAX) };
}
static NEXT_THREAD_GROUP: AtomicUsize = AtomicUsize::new(0);

/// The generation a block was born in: a node header's generation, or an extent's recorded
/// one (which may be older than the real birth, never newer). A type of its own, so that the
/// sharing-aware free ([`Allocator::free_recorded`]) cannot take a birth for the generation
/// that frees, or the other way round: swapping them would free a block a snapshot still reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Birth(Generation);

impl Birth {
    /// The birth generation `generation` (as a node header or an extent item records it).
    pub fn new(generation: u64) -> Birth {
        Birth(Generation::new(generation))
    }

    /// The generation itself.
    pub fn generation(self) -> Generation {
        self.0
    }
}

/// A snapshot as the sharing-aware free sees it: it holds the blocks born at or before
/// `generation` that the live tree frees in a generation after `generation`, up to and
/// including `dropped_in`, the commit that deletes it (whose deletion walk frees what only it
/// held, DESIGN §15.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotHold {
    /// The commit whose tree the snapshot keeps.
    pub generation: Generation,
    /// The commit that drops it from the list; [`SnapshotHold::KEPT`] while it is kept.
    pub dropped_in: Generation,
}

impl SnapshotHold {
    /// `dropped_in` of a snapshot still kept.
    pub const KEPT: Generation = Generation::new(u64::MAX);

    /// Whether this snapshot holds a block born in `birth` that generation `freed_in` frees.
    fn holds(&self, freed_in: Generation, birth: Birth) -> bool {
        birth.generation() <= self.generation
            && self.generation < freed_in
            && freed_in <= self.dropped_in
    }
}

/// The free-space map.
pub struct Allocator {
    groups: Vec<Mutex<Group>>,
    free_blocks: AtomicU64,
    total_blocks: u64,
    reserve_blocks: u64,
    pinned: Mutex<Vec<(Generation, BlockAddr, BlockCount)>>,
    pinned_blocks: AtomicU64,
    /// Held for the whole of a trim ([`Allocator::trim_free`]): trims run one at a time.
    trim_lock: Mutex<()>,
    /// Blocks promised to buffered data not yet allocated: other data may not take them.
    reserved: AtomicU64,
    /// Deferred ranges, and those whose discard is in flight. Lock order: this, then a group
    /// (nothing takes it while holding a group); never held across the discard.
    deferred: Mutex<Deferred>,
    /// The blocks of both lists of `deferred` (free, not yet searchable).
    deferred_blocks: AtomicU64,
    /// Signalled (with `deferred`) when a discard batch has ended: its ranges are clear in the
    /// bitmap, or back in the deferred list after a failure.
    discard_ended: Condvar,
    /// The newest commit whose frees a reclaim handed out early: trees older than it are no
    /// longer whole and may not be named as backups.
    backup_floor: AtomicU64,
    /// The snapshots, for [`Allocator::free_recorded`]; usually empty.
    holds: RwLock<Vec<SnapshotHold>>,
    /// The newest generation in `holds` (0 when empty): a birth after it is held by none, and
    /// `free_recorded` decides without the lock.
    newest_hold: AtomicU64,
    /// Blocks `free_recorded` kept because a snapshot holds them (a count of frees, not of
    /// distinct blocks; for tests and stats).
    kept_blocks: AtomicU64,
    /// Shared (cloned) data blocks: block index → references from flagged extent items of
    /// the live tree (DESIGN §15.8). Empty until the first clone; only flagged extents'
    /// blocks are in it.
    shared: Mutex<HashMap<u64, u32>>,
    /// Whether `shared` may hold anything: the common path asks nothing else.
    any_shared: AtomicBool,
}

/// Commits after the one that freed a range before the range may be reused: K + 1, because a
/// tree is named as a backup by the K superblocks after it and the older of the two durable
/// slots is one commit behind (DESIGN §13.2).
pub const DEFER_COMMITS: u64 = BACKUP_ROOTS as u64 + 1;

impl Allocator {
    /// An allocator for a device of `total_bytes` with everything free.
    pub fn new(total_bytes: u64) -> Allocator {
        let total_blocks = total_bytes / BLOCK_SIZE;
        let mut groups = Vec::new();
        let mut first = 0;
        while first < total_blocks {
            let blocks = GROUP_BLOCKS.min(total_blocks - first);
            groups.push(Mutex::new(Group {
                first_block: first,
                blocks,
                bits: vec![0; blocks.div_ceil(64) as usize],
                free: blocks,
                hint: 0,
            }));
            first += blocks;
        }
        // The reserve keeps commits and deletes possible on a full filesystem: 1/32 of the
        // device, at least 1 MiB and at most 256 MiB.
        let reserve_blocks = (total_blocks / 32).clamp(256, 65536).min(total_blocks / 2);
        Allocator {
            groups,
            free_blocks: AtomicU64::new(total_blocks),
            total_blocks,
            reserve_blocks,
            pinned: Mutex::new(Vec::new()),
            pinned_blocks: AtomicU64::new(0),
            trim_lock: Mutex::new(()),
            reserved: AtomicU64::new(0),
            deferred: Mutex::new(Deferred::default()),
            deferred_blocks: AtomicU64::new(0),
            discard_ended: Condvar::new(),
            backup_floor: AtomicU64::new(0),
            holds: RwLock::new(Vec::new()),
            newest_hold: AtomicU64::new(0),
            kept_blocks: AtomicU64::new(0),
            shared: Mutex::new(HashMap::new()),
            any_shared: AtomicBool::new(false),
        }
    }

    /// Blocks in the device.
    pub fn total_blocks(&self) -> BlockCount {
        BlockCount::new(self.total_blocks)
    }

    /// Free blocks, pinned ones excluded, deferred ones included (an allocation takes them
    /// when nothing else is left).
    pub fn free_blocks(&self) -> BlockCount {
        BlockCount::new(self.free_blocks.load(Ordering::Relaxed))
    }

    /// Blocks freed but not yet reusable.
    pub fn pinned_blocks(&self) -> BlockCount {
        BlockCount::new(self.pinned_blocks.load(Ordering::Relaxed))
    }

    /// Blocks data may still take (free minus the metadata reserve and the space reserved
    /// for buffered data).
    pub fn available_blocks(&self) -> BlockCount {
        self.free_blocks()
            .saturating_sub(self.metadata_reserve_blocks())
            .saturating_sub(self.reserved_blocks())
    }

    /// Free blocks as statfs counts them (`bfree`): free and pinned blocks (freed since the
    /// last commit: reusable once the next commit is durable, and an allocation that finds
    /// too little forces that commit, DESIGN §10.7), less the space reserved for buffered data.
    pub fn statfs_free_blocks(&self) -> BlockCount {
        (self.free_blocks() + self.pinned_blocks()).saturating_sub(self.reserved_blocks())
    }

    /// Blocks data may take as statfs counts them (`bavail`): [`Allocator::available_blocks`]
    /// and the pinned blocks.
    pub fn statfs_available_blocks(&self) -> BlockCount {
        self.available_blocks() + self.pinned_blocks()
    }

    /// Blocks data may never take (the metadata reserve, DESIGN §10.7).
    pub fn metadata_reserve_blocks(&self) -> BlockCount {
        BlockCount::new(self.reserve_blocks)
    }

    /// Blocks reserved for buffered data and not yet allocated.
    pub fn reserved_blocks(&self) -> BlockCount {
        BlockCount::new(self.reserved.load(Ordering::Relaxed))
    }

    /// Reserves `blocks` for data to be allocated later with [`Purpose::Reserved`]; false
    /// when fewer are available (the caller commits, which frees pinned space, and retries).
    pub fn try_reserve(&self, blocks: BlockCount) -> bool {
        let blocks = blocks.get();
        let free = self.free_blocks_raw().saturating_sub(self.reserve_blocks);
        self.reserved
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |r| {
                (free.saturating_sub(r) >= blocks).then_some(r + blocks)
            })
            .is_ok()
    }

    /// Gives back a reservation (allocated, or its data dropped).
    pub fn unreserve(&self, blocks: BlockCount) {
        let blocks = blocks.get();
        let _ = self
            .reserved
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |r| {
                Some(r.saturating_sub(blocks))
            });
    }

    /// [`Allocator::free_blocks`] as a plain number, for the arithmetic on block indices.
    fn free_blocks_raw(&self) -> u64 {
        self.free_blocks.load(Ordering::Relaxed)
    }

    /// The free blocks below which an allocation for `purpose` fails.
    fn floor(&self, purpose: Purpose) -> u64 {
        match purpose {
            Purpose::Data => self.reserve_blocks + self.reserved.load(Ordering::Relaxed),
            Purpose::Reserved => self.reserve_blocks,
            Purpose::Metadata => 0,
        }
    }

    /// The group holding `block`; `None` past the device. The last group may be partial, so
    /// its index alone does not say the block is in it: a block past the device's end but
    /// inside the last group's span indexed past its bitmap (a log record naming an extent
    /// beyond the device panicked replay; found by the birch-fuzz target log_replay).
    fn group_of(&self, block: u64) -> Option<&Mutex<Group>> {
        if block >= self.total_blocks {
            return None;
        }
        self.groups.get((block / GROUP_BLOCKS) as usize)
    }

    /// Marks a range used, at open (from the trees) and for reserved areas. Returns false if
    /// any block was already used (a double reference, which fsck reports).
    pub fn mark_used(&self, addr: BlockAddr, blocks: BlockCount) -> bool {
        let mut clean = true;
        let first = addr.block_index();
        for block in first..first + blocks.get() {
            let Some(group) = self.group_of(block) else {
                return false;
            };
            let mut g = group.lock();
            let rel = block - g.first_block;
            if g.is_used(rel) {
                drop(g);
                // A deferred block is free to the current tree (replay of a log written
                // after a reclaim may claim one): it leaves the deferred list, and the
                // backup tree it belonged to is no longer whole.
                if self.undefer(block) {
                    continue;
                }
                // A deferred range released meanwhile leaves the block free: take it.
                let mut g = group.lock();
                if g.is_used(rel) {
                    clean = false;
                } else {
                    g.set(rel, true);
                    g.free -= 1;
                    self.free_blocks.fetch_sub(1, Ordering::Relaxed);
                }
            } else {
                g.set(rel, true);
                g.free -= 1;
                self.free_blocks.fetch_sub(1, Ordering::Relaxed);
            }
        }
        clean
    }

    /// Whether a block is in use.
    pub fn is_used(&self, addr: BlockAddr) -> bool {
        let block = addr.block_index();
        self.group_of(block).is_some_and(|g| {
            let g = g.lock();
            g.is_used(block - g.first_block)
        })
    }

    /// Allocates a contiguous run of `min..=max` blocks; returns its address and length.
    pub fn allocate(
        &self,
        min: BlockCount,
        max: BlockCount,
        purpose: Purpose,
    ) -> Result<(BlockAddr, BlockCount)> {
        let floor = self.floor(purpose);
        if self.free_blocks_raw().saturating_sub(floor) < min.get() {
            return Err(Error::NoSpace(format!("allocate {min} {purpose:?} blocks")));
        }
        if let Some(found) = self.search(min, max) {
            return Ok(found);
        }
        // A trim (`fstrim`) holds free runs out of the searches while their discard is in
        // flight: wait for it and search again before giving up the backup roots below.
        if self.trim_in_flight() && self.wait_for_discards() {
            if let Some(found) = self.search(min, max) {
                return Ok(found);
            }
        }
        // Search again even when this reclaim found the list empty: another thread may have
        // just reclaimed it (a reclaim clears its ranges before it lets go of the list, so
        // once this call returns they are searchable). A commit's node allocation that lost
        // that race failed the commit and turned the filesystem read-only.
        self.reclaim_deferred();
        if let Some(found) = self.search(min, max) {
            return Ok(found);
        }
        // The last resort: space whose discard is in flight counts as free but neither a
        // search nor a reclaim takes it. Wait for those discards to end (no lock is held
        // meanwhile), take back what a failed one returned to the list, and search once more,
        // rather than fail with space counted free.
        // A few rounds: a trim's next batch may take the runs the last one gave back before
        // this search sees them (trims run one at a time, `trim_free`).
        for _ in 0..4 {
            if !self.wait_for_discards() {
                break;
            }
            self.reclaim_deferred();
            if let Some(found) = self.search(min, max) {
                return Ok(found);
            }
        }
        Err(Error::NoSpace(format!(
            "allocate {min} contiguous {purpose:?} blocks"
        )))
    }

    /// Whether a trim batch ([`Allocator::trim_free`]) is in flight.
    fn trim_in_flight(&self) -> bool {
        !self.deferred.lock().trimming.is_empty()
    }

    /// One pass over the groups from this thread's preferred one: the first free run of
    /// `min..=max` blocks, marked used.
    fn search(&self, min: BlockCount, max: BlockCount) -> Option<(BlockAddr, BlockCount)> {
        let (min, max) = (min.get(), max.get());
        let count = self.groups.len();
        let preferred = PREFERRED_GROUP.with(|p| {
            if p.get() == usize::MAX {
                p.set(NEXT_THREAD_GROUP.fetch_add(1, Ordering::Relaxed));
            }
            p.get()
        }) % count;
        for step in 0..count {
            let index = (preferred + step) % count;
            let mut g = self.groups[index].lock();
            let Some((rel, len)) = g.find_run(min, max) else {
                continue;
            };
            for b in rel..rel + len {
                g.set(b, true);
            }
            g.free -= len;
            g.hint = rel + len;
            self.free_blocks.fetch_sub(len, Ordering::Relaxed);
            return Some((
                BlockAddr::from_block_index(g.first_block + rel),
                BlockCount::new(len),
            ));
        }
        None
    }

    /// Like [`Allocator::allocate`], but first tries a run that starts exactly at `goal` (a
    /// byte address, e.g. the end of a file's previous extent), so appends stay contiguous on
    /// disk and their extents merge.
    pub fn allocate_near(
        &self,
        goal: BlockAddr,
        min: BlockCount,
        max: BlockCount,
        purpose: Purpose,
    ) -> Result<(BlockAddr, BlockCount)> {
        let floor = self.floor(purpose);
        let block = goal.block_index();
        if goal.is_block_aligned() && self.free_blocks_raw().saturating_sub(floor) >= min.get() {
            if let Some(group) = self.group_of(block) {
                let mut g = group.lock();
                let rel = block - g.first_block;
                let mut len = 0;
                while len < max.get() && rel + len < g.blocks && !g.is_used(rel + len) {
                    len += 1;
                }
                if len >= min.get() && len > 0 {
                    for b in rel..rel + len {
                        g.set(b, true);
                    }
                    g.free -= len;
                    self.free_blocks.fetch_sub(len, Ordering::Relaxed);
                    return Ok((goal, BlockCount::new(len)));
                }
            }
        }
        self.allocate(min, max, purpose)
    }

    /// Records that the running transaction `generation` freed a range. It stays allocated
    /// until the engine releases it after the commit is durable.
    pub fn free_pinned(&self, generation: Generation, addr: BlockAddr, blocks: BlockCount) {
        self.pinned.lock().push((generation, addr, blocks));
        self.pinned_blocks
            .fetch_add(blocks.get(), Ordering::Relaxed);
    }

    /// The one free of blocks a committed tree (or an fsync log batch) referenced: nodes the
    /// B-tree writer copies or retires, data blocks an extent stops referencing (DESIGN §15.6
    /// rule 2). `birth` is the blocks' birth generation (a node's generation, an extent's
    /// recorded one, which may be older than the real birth, never newer). Held by a snapshot
    /// ([`SnapshotHold`]), the blocks stay used and nothing is recorded; otherwise they are
    /// pinned in `freed_in` as [`Allocator::free_pinned`] does. Returns whether they were freed.
    /// With no snapshot this is exactly `free_pinned`.
    pub fn free_recorded(
        &self,
        freed_in: Generation,
        birth: Birth,
        addr: BlockAddr,
        blocks: BlockCount,
    ) -> bool {
        if self.held(freed_in, birth) {
            self.kept_blocks.fetch_add(blocks.get(), Ordering::Relaxed);
            return false;
        }
        self.free_pinned(freed_in, addr, blocks);
        true
    }

    /// The open walk met a flagged (shared) extent of the live tree on `blocks` at `addr`:
    /// one more reference to each block. A block not counted yet must be free and is marked
    /// used; one counted already is another flagged extent's (fine). False when a block is
    /// outside the device or used by something that is not a flagged extent (damage).
    pub fn mark_shared(&self, addr: BlockAddr, blocks: BlockCount) -> bool {
        self.any_shared.store(true, Ordering::Release);
        let mut shared = self.shared.lock();
        let first = addr.block_index();
        let mut clean = true;
        for block in first..first.saturating_add(blocks.get()) {
            match shared.get_mut(&block) {
                Some(n) => *n = n.saturating_add(1),
                None => {
                    if !self.mark_used(BlockAddr::from_block_index(block), BlockCount::new(1)) {
                        clean = false;
                        continue;
                    }
                    shared.insert(block, 1);
                }
            }
        }
        clean
    }

    /// A clone (DESIGN §15.8): the source extent on `source` becomes flagged (each of its
    /// blocks not counted yet gets its one reference, the source's own), then each block of
    /// `cloned` (inside `source`) gets one more, the clone's. Called before the clone's items
    /// are recorded: an increment is never late (a late one could let a drop free a block
    /// the clone names); one whose items then fail to record only keeps blocks until the
    /// next open counts again.
    pub fn add_shared(&self, source: (BlockAddr, BlockCount), cloned: (BlockAddr, BlockCount)) {
        self.any_shared.store(true, Ordering::Release);
        let mut shared = self.shared.lock();
        let first = source.0.block_index();
        for block in first..first + source.1.get() {
            shared.entry(block).or_insert(1);
        }
        let first = cloned.0.block_index();
        for block in first..first + cloned.1.get() {
            let n = shared.entry(block).or_insert(1);
            *n = n.saturating_add(1);
        }
    }

    /// Forgets any reference count of `blocks` at `addr`: blocks no tree names any more,
    /// which a deleted snapshot's walk gives back (DESIGN §15.8). A count can be left there
    /// only too high (a clone whose items failed to record, an engine that rolled back), and
    /// once the blocks are free again it would keep a later clone of them counted high.
    pub fn forget_shared(&self, addr: BlockAddr, blocks: BlockCount) {
        if !self.any_shared.load(Ordering::Acquire) {
            return;
        }
        let mut shared = self.shared.lock();
        let first = addr.block_index();
        let end = first.saturating_add(blocks.get());
        if blocks.get() > shared.len() as u64 {
            shared.retain(|block, _| !(first..end).contains(block));
        } else {
            for block in first..end {
                shared.remove(&block);
            }
        }
    }

    /// A flagged extent's blocks leave the live tree: one reference less for each. Returns
    /// the runs whose last reference this was, which the caller frees through
    /// [`Allocator::free_recorded`]. A block without a count (never expected: every flagged
    /// block is counted at open or by its clone) is kept and logged: a leak until the next
    /// open, never a free of a block something may still name.
    pub fn drop_shared(&self, addr: BlockAddr, blocks: BlockCount) -> Vec<(BlockAddr, BlockCount)> {
        let mut out: Vec<(BlockAddr, BlockCount)> = Vec::new();
        let mut missing = 0u64;
        {
            let mut shared = self.shared.lock();
            let first = addr.block_index();
            for block in first..first + blocks.get() {
                let last = match shared.get_mut(&block) {
                    Some(n) if *n > 1 => {
                        *n -= 1;
                        false
                    }
                    Some(_) => {
                        shared.remove(&block);
                        true
                    }
                    None => {
                        missing += 1;
                        false
                    }
                };
                if last {
                    let at = BlockAddr::from_block_index(block);
                    match out.last_mut() {
                        Some((start, len)) if *start + *len == at => *len += BlockCount::new(1),
                        _ => out.push((at, BlockCount::new(1))),
                    }
                }
            }
        }
        if missing > 0 {
            log::warn!(
                "shared extent at {:#x} x {}: {missing} blocks without a reference count are kept until the next open",
                addr.get(),
                blocks.get()
            );
        }
        out
    }

    /// References the live tree holds to shared block `addr` (0: not shared).
    pub fn shared_references(&self, addr: BlockAddr) -> u32 {
        if !self.any_shared.load(Ordering::Acquire) {
            return 0;
        }
        self.shared
            .lock()
            .get(&addr.block_index())
            .copied()
            .unwrap_or(0)
    }

    /// Blocks the live tree names more than once (through flagged extents), each counted
    /// once: the space sharing saves is this many blocks times their references less one.
    /// A scan of the counts (for stats and tests).
    pub fn shared_blocks(&self) -> BlockCount {
        if !self.any_shared.load(Ordering::Acquire) {
            return BlockCount::new(0);
        }
        BlockCount::new(self.shared.lock().values().filter(|n| **n > 1).count() as u64)
    }

    /// Whether a snapshot holds a block born in `birth` that generation `freed_in` frees.
    pub fn held(&self, freed_in: Generation, birth: Birth) -> bool {
        let newest = self.newest_hold.load(Ordering::Acquire);
        if newest == 0 || birth.generation().get() > newest {
            return false;
        }
        self.holds
            .read()
            .iter()
            .any(|hold| hold.holds(freed_in, birth))
    }

    /// Adds a snapshot of commit `generation` (at open, or at the freeze of the commit that
    /// makes it: frees of later generations see it).
    pub fn add_hold(&self, generation: Generation) {
        let mut holds = self.holds.write();
        holds.push(SnapshotHold {
            generation,
            dropped_in: SnapshotHold::KEPT,
        });
        self.newest_hold
            .fetch_max(generation.get(), Ordering::AcqRel);
    }

    /// Marks a kept snapshot of commit `dropped.generation` as dropped by commit
    /// `dropped.dropped_in` (at its freeze): it holds no block freed after that commit. The
    /// two generations come as the named fields of one [`SnapshotHold`], so they cannot be
    /// swapped. Two snapshots made by one commit have one hold each: only one is dropped, so
    /// the other still keeps what the live tree frees later.
    pub fn drop_hold(&self, dropped: SnapshotHold) {
        let mut holds = self.holds.write();
        if let Some(hold) = holds.iter_mut().find(|hold| {
            hold.generation == dropped.generation && hold.dropped_in == SnapshotHold::KEPT
        }) {
            hold.dropped_in = dropped.dropped_in;
        }
    }

    /// Forgets the snapshots dropped by commits up to `generation` (once that commit is
    /// durable and its deletion walk has freed their blocks: no later free can ask).
    pub fn forget_holds(&self, generation: Generation) {
        let mut holds = self.holds.write();
        holds.retain(|hold| hold.dropped_in > generation);
        let newest = holds.iter().map(|h| h.generation.get()).max().unwrap_or(0);
        self.newest_hold.store(newest, Ordering::Release);
    }

    /// The newest snapshot generation the free knows (0: none). An extent born at or before
    /// it is not merged with newer blocks (DESIGN §15.6 rule 1).
    pub fn newest_snapshot_generation(&self) -> Generation {
        Generation::new(self.newest_hold.load(Ordering::Acquire))
    }

    /// The snapshots the free knows.
    pub fn holds(&self) -> Vec<SnapshotHold> {
        self.holds.read().clone()
    }

    /// Blocks kept because a snapshot held them, since the allocator was made.
    pub fn kept_blocks(&self) -> BlockCount {
        BlockCount::new(self.kept_blocks.load(Ordering::Relaxed))
    }

    /// Frees at once a range allocated in the running transaction that no committed state has
    /// seen (an allocation that a failed operation gives back).
    pub fn free_now(&self, addr: BlockAddr, blocks: BlockCount) {
        self.release(&[(addr, blocks)]);
    }

    /// Takes the ranges pinned by generations `<= generation`.
    pub fn take_pinned(&self, generation: Generation) -> Vec<(BlockAddr, BlockCount)> {
        let mut pinned = self.pinned.lock();
        let mut out = Vec::new();
        pinned.retain(|(g, addr, blocks)| {
            if *g <= generation {
                out.push((*addr, *blocks));
                false
            } else {
                true
            }
        });
        out
    }

    /// Makes ranges free again (pinned ranges whose commit is durable and unobserved).
    pub fn release(&self, ranges: &[(BlockAddr, BlockCount)]) {
        for &(addr, blocks) in ranges {
            let cleared = self.clear_used(addr, blocks, "release of free block");
            self.free_blocks.fetch_add(cleared, Ordering::Relaxed);
        }
    }

    /// Clears the used bits of `blocks` blocks at byte address `addr` in their groups and
    /// returns how many it cleared (blocks past the device are skipped). A bit already clear
    /// means the allocator's state is wrong: `what` names the caller in the panic.
    fn clear_used(&self, addr: BlockAddr, blocks: BlockCount, what: &str) -> u64 {
        let first = addr.block_index();
        let mut cleared = 0;
        for block in first..first + blocks.get() {
            let Some(group) = self.group_of(block) else {
                continue;
            };
            let mut g = group.lock();
            let rel = block - g.first_block;
            assert!(g.is_used(rel), "{what} {block}: allocator state is wrong");
            g.set(rel, false);
            g.free += 1;
            cleared += 1;
        }
        cleared
    }

    /// Defers ranges that commit `freed_by` freed and no reader holds any more: they stay
    /// out of every search until commit `freed_by + DEFER_COMMITS` is durable
    /// ([`Allocator::commit_durable`]) or a reclaim needs them, and count as free meanwhile.
    pub fn defer(&self, freed_by: Generation, ranges: &[(BlockAddr, BlockCount)]) {
        let blocks: u64 = ranges.iter().map(|(_, b)| b.get()).sum();
        let mut deferred = self.deferred.lock();
        deferred
            .waiting
            .extend(ranges.iter().map(|(addr, b)| (freed_by, *addr, *b)));
        self.deferred_blocks.fetch_add(blocks, Ordering::Relaxed);
        self.free_blocks.fetch_add(blocks, Ordering::Relaxed);
    }

    /// At open: marks the blocks of `[addr, addr + blocks)` that no newer tree holds as used
    /// and defers them as if commit `freed_by` had freed them (an older tree's own blocks,
    /// DESIGN §13.3). Returns how many blocks it deferred.
    pub fn defer_unused(
        &self,
        freed_by: Generation,
        addr: BlockAddr,
        blocks: BlockCount,
    ) -> BlockCount {
        let first = addr.block_index();
        let mut runs: Vec<(BlockAddr, BlockCount)> = Vec::new();
        for block in first..first.saturating_add(blocks.get()) {
            let Some(group) = self.group_of(block) else {
                break;
            };
            let mut g = group.lock();
            let rel = block - g.first_block;
            if g.is_used(rel) {
                continue;
            }
            g.set(rel, true);
            g.free -= 1;
            self.free_blocks.fetch_sub(1, Ordering::Relaxed);
            let addr = BlockAddr::from_block_index(block);
            match runs.last_mut() {
                Some((start, len)) if *start + *len == addr => *len += BlockCount::new(1),
                _ => runs.push((addr, BlockCount::new(1))),
            }
        }
        self.defer(freed_by, &runs);
        runs.iter().map(|(_, b)| b).sum()
    }

    /// Commit `generation` is durable: ranges deferred by commits up to
    /// `generation - DEFER_COMMITS` become free for searches.
    pub fn commit_durable(&self, generation: Generation) {
        let _ = self.commit_durable_with(generation, |_| Ok(()));
    }

    /// As [`Allocator::commit_durable`], but first hands the ranges that become free to
    /// `discard` (the device's discard, DESIGN §14.4): no committed root, backups included,
    /// references them any more. `discard` runs with no allocator lock held; meanwhile the
    /// ranges are in neither the deferred list nor the searches (their bits stay set), so no
    /// allocation can take them, and so no write to them can overtake the discard, while a
    /// reclaim or an allocation elsewhere goes on without waiting for it. Only an allocation
    /// that finds no other space waits for the discard to end. When `discard` fails, the
    /// ranges go back to the deferred list (still free, kept out of searches until a later
    /// commit or a reclaim) and its error is returned.
    pub fn commit_durable_with(
        &self,
        generation: Generation,
        discard: impl FnOnce(&[(BlockAddr, BlockCount)]) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let (batch, ranges) = {
            let mut deferred = self.deferred.lock();
            let mut ranges = Vec::new();
            let mut taken = Vec::new();
            deferred.waiting.retain(|(freed_by, addr, blocks)| {
                if freed_by.saturating_add(DEFER_COMMITS) <= generation {
                    taken.push((*freed_by, *addr, *blocks));
                    ranges.push((*addr, *blocks));
                    false
                } else {
                    true
                }
            });
            if ranges.is_empty() {
                return Ok(());
            }
            let batch = deferred.next_batch;
            deferred.next_batch += 1;
            deferred
                .discarding
                .extend(taken.into_iter().map(|(g, a, b)| (batch, g, a, b)));
            (batch, ranges)
        };
        // A panic in `discard` must not leave the batch in flight for ever (an allocation
        // would wait on it): the guard ends it as failed.
        let mut in_flight = DiscardInFlight {
            alloc: self,
            batch,
            ended: false,
        };
        let result = discard(&ranges);
        in_flight.end(result.is_ok());
        result
    }

    /// Discards the free space in blocks `[first, end)` (block indices) in runs of at least
    /// `min` blocks (`fstrim`, DESIGN §14.4): batch by batch (at most [`TRIM_BATCH_RANGES`]
    /// runs, within one group), the runs free now are taken out of the searches (their bits
    /// set; still counted free), handed to `discard` with no allocator lock held, and made
    /// searchable again when it returns, failed or not (the space was free and stays free).
    /// So no allocation can take a block, and no write reach it, while its discard is in
    /// flight; an allocation that finds no other space waits for the batch, as for a commit's
    /// discards. A free run that crosses a group boundary counts as two runs for `min`.
    /// Returns the blocks discarded; at the first failed `discard`, its error.
    pub fn trim_free(
        &self,
        first: u64,
        end: u64,
        min: u64,
        mut discard: impl FnMut(&[(BlockAddr, BlockCount)]) -> std::io::Result<()>,
    ) -> std::io::Result<u64> {
        // One trim at a time (two `fstrim`s would take turns holding the same runs out of the
        // searches, and an allocation waiting for one batch could find the next one).
        let _one = self.trim_lock.lock();
        let end = end.min(self.total_blocks);
        let min = min.max(1);
        let mut cursor = first;
        let mut trimmed = 0;
        while cursor < end {
            let (batch, ranges, next) = self.take_free_for_trim(cursor, end, min);
            cursor = next;
            if ranges.is_empty() {
                continue;
            }
            let mut in_flight = DiscardInFlight {
                alloc: self,
                batch,
                ended: false,
            };
            let result = discard(&ranges);
            in_flight.end(result.is_ok());
            result?;
            trimmed += ranges.iter().map(|(_, b)| b.get()).sum::<u64>();
        }
        Ok(trimmed)
    }

    /// One trim batch: from block `cursor` to the end of its group or `end`, the free runs of
    /// at least `min` blocks (up to [`TRIM_BATCH_RANGES`]) taken out of the searches and
    /// recorded as discard batch `batch`. Returns the batch, its ranges and where the next
    /// batch starts.
    fn take_free_for_trim(
        &self,
        cursor: u64,
        end: u64,
        min: u64,
    ) -> (u64, Vec<(BlockAddr, BlockCount)>, u64) {
        let Some(group) = self.group_of(cursor) else {
            return (0, Vec::new(), end);
        };
        // Lock order: the list, then the group. The batch is registered before either lock
        // is let go, so an allocation that finds no space sees it and waits for it.
        let mut deferred = self.deferred.lock();
        let mut g = group.lock();
        let stop = end.min(g.first_block + g.blocks) - g.first_block;
        let mut rel = cursor - g.first_block;
        let mut ranges = Vec::new();
        while rel < stop && ranges.len() < TRIM_BATCH_RANGES {
            if g.is_used(rel) {
                rel += 1;
                continue;
            }
            let start = rel;
            while rel < stop && !g.is_used(rel) {
                rel += 1;
            }
            let len = rel - start;
            if len >= min {
                for b in start..rel {
                    g.set(b, true);
                }
                g.free -= len;
                ranges.push((
                    BlockAddr::from_block_index(g.first_block + start),
                    BlockCount::new(len),
                ));
            }
        }
        let next = g.first_block + rel;
        drop(g);
        if ranges.is_empty() {
            return (0, ranges, next);
        }
        let batch = deferred.next_batch;
        deferred.next_batch += 1;
        deferred
            .trimming
            .extend(ranges.iter().map(|(a, b)| (batch, *a, *b)));
        (batch, ranges, next)
    }

    /// Ends discard batch `batch`: on success clears its ranges' bits (searchable from now
    /// on), else puts them back in the deferred list; a trim's ranges are cleared either way
    /// (they were free). Then wakes whoever waits for it.
    fn end_discard(&self, batch: u64, discarded: bool) {
        let mut deferred = self.deferred.lock();
        let mut trimmed = Vec::new();
        deferred.trimming.retain(|(b, addr, blocks)| {
            if *b == batch {
                trimmed.push((*addr, *blocks));
                false
            } else {
                true
            }
        });
        for (addr, blocks) in trimmed {
            // Still counted in `free_blocks`: only the group's count comes back.
            self.clear_used(addr, blocks, "end of trim of free block");
        }
        let mut ended = Vec::new();
        deferred.discarding.retain(|(b, freed_by, addr, blocks)| {
            if *b == batch {
                ended.push((*freed_by, *addr, *blocks));
                false
            } else {
                true
            }
        });
        if discarded {
            // Cleared with the list locked, as a reclaim clears: a waiter that wakes finds
            // them searchable.
            let ranges: Vec<(BlockAddr, BlockCount)> =
                ended.iter().map(|(_, a, b)| (*a, *b)).collect();
            self.clear_deferred(&ranges);
        } else {
            deferred.waiting.extend(ended);
        }
        drop(deferred);
        self.discard_ended.notify_all();
    }

    /// Waits until the discard batches in flight now have ended; false when there was none.
    fn wait_for_discards(&self) -> bool {
        let mut deferred = self.deferred.lock();
        let newest = deferred
            .discarding
            .iter()
            .map(|(b, ..)| *b)
            .chain(deferred.trimming.iter().map(|(b, ..)| *b))
            .max();
        let Some(newest) = newest else {
            return false;
        };
        while deferred.any_in_flight_up_to(newest) {
            self.discard_ended.wait(&mut deferred);
        }
        true
    }

    /// Hands every deferred range to the searches now (the device is full otherwise), and
    /// raises the backup floor past the commits that freed them. Ranges whose discard is in
    /// flight are not taken (nor waited for): they become searchable when it ends. Returns
    /// whether there was any range to take.
    pub fn reclaim_deferred(&self) -> bool {
        // The list stays locked until its ranges are clear (lock order: the list, then
        // groups; nothing takes the list while holding a group).
        let mut deferred = self.deferred.lock();
        let taken: Vec<(Generation, BlockAddr, BlockCount)> = deferred.waiting.drain(..).collect();
        if taken.is_empty() {
            return false;
        }
        let newest = taken.iter().map(|(g, _, _)| *g).max().unwrap_or_default();
        self.backup_floor.fetch_max(newest.get(), Ordering::SeqCst);
        let ranges: Vec<(BlockAddr, BlockCount)> = taken.iter().map(|(_, a, b)| (*a, *b)).collect();
        self.clear_deferred(&ranges);
        drop(deferred);
        log::info!(
            "space: reclaimed {} deferred blocks; older backup roots up to generation {newest} given up",
            ranges.iter().map(|(_, b)| b).sum::<BlockCount>()
        );
        true
    }

    /// Clears the bits of deferred ranges (already counted in `free_blocks`).
    fn clear_deferred(&self, ranges: &[(BlockAddr, BlockCount)]) {
        for &(addr, blocks) in ranges {
            self.clear_used(addr, blocks, "free deferred block");
            self.deferred_blocks
                .fetch_sub(blocks.get(), Ordering::Relaxed);
        }
    }

    /// Takes one block out of the deferred list, if it is there: it becomes used (it stays
    /// set in the bitmap and leaves the free count). Raises the backup floor past the commit
    /// that freed it.
    fn undefer(&self, block: u64) -> bool {
        let addr = BlockAddr::from_block_index(block);
        let one = BlockCount::new(1);
        let mut deferred = self.deferred.lock();
        // A block being discarded is in neither list: wait for its discard to end (the
        // block is then clear, or back in the list after a failure). Only an open's replay
        // claims deferred blocks, before any commit discards.
        while deferred.is_discarding(addr) {
            self.discard_ended.wait(&mut deferred);
        }
        let Some(index) = deferred
            .waiting
            .iter()
            .position(|(_, a, b)| *a <= addr && addr < *a + *b)
        else {
            return false;
        };
        let Some((freed_by, start, blocks)) = deferred.waiting.remove(index) else {
            return false;
        };
        let before = BlockCount::new(block - start.block_index());
        if before > BlockCount::new(0) {
            deferred.waiting.push_back((freed_by, start, before));
        }
        if blocks > before + one {
            deferred
                .waiting
                .push_back((freed_by, addr + one, blocks - before - one));
        }
        drop(deferred);
        self.backup_floor
            .fetch_max(freed_by.get(), Ordering::SeqCst);
        self.deferred_blocks.fetch_sub(1, Ordering::Relaxed);
        self.free_blocks.fetch_sub(1, Ordering::Relaxed);
        true
    }

    /// Blocks deferred (free, but kept out of searches for the backup trees).
    pub fn deferred_blocks(&self) -> BlockCount {
        BlockCount::new(self.deferred_blocks.load(Ordering::Relaxed))
    }

    /// Trees of a generation below this may have lost blocks to a reclaim: they may not be
    /// named as backups. 0 while no reclaim happened.
    pub fn backup_floor(&self) -> Generation {
        Generation::new(self.backup_floor.load(Ordering::SeqCst))
    }

    /// Un-counts pinned blocks once their release is scheduled (they are counted in
    /// `pinned_blocks` from free until the engine hands them to a committed root's pin).
    pub fn unpin_count(&self, blocks: BlockCount) {
        self.pinned_blocks
            .fetch_sub(blocks.get(), Ordering::Relaxed);
    }
}

/// A discard batch in flight: ended as failed if the discard unwinds before it is ended.
struct DiscardInFlight<'a> {
    alloc: &'a Allocator,
    batch: u64,
    ended: bool,
}

impl DiscardInFlight<'_> {
    fn end(&mut self, discarded: bool) {
        self.ended = true;
        self.alloc.end_discard(self.batch, discarded);
    }
}

impl Drop for DiscardInFlight<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.alloc.end_discard(self.batch, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` blocks.
    fn b(n: u64) -> BlockCount {
        BlockCount::new(n)
    }

    fn g(n: u64) -> Generation {
        Generation::new(n)
    }

    /// Blocks past the device's end, inside the span of a partial last group: not used, and
    /// marking them fails without a panic (replay of an extent the log names there).
    #[test]
    fn blocks_past_a_partial_last_group_are_refused() {
        let a = Allocator::new(16 << 20);
        let past = BlockAddr::from_block_index(5000);
        assert!(!a.is_used(past));
        assert!(!a.mark_used(past, b(4)));
        assert!(!a.mark_shared(past, b(1)));
        let inside = BlockAddr::from_block_index(4000);
        assert!(a.mark_used(inside, b(1)));
        assert!(a.is_used(inside));
    }

    /// Shared counts: a clone counts the source's blocks once and the cloned ones once more;
    /// drops free only the blocks left with no reference; the open walk's marking refuses a
    /// shared extent on a block something unshared holds.
    #[test]
    fn shared_counts_free_at_the_last_reference() {
        let a = Allocator::new(64 * GROUP_BLOCKS * BLOCK_SIZE);
        let (addr, _) = a.allocate(b(8), b(8), Purpose::Data).expect("space");
        assert_eq!(a.shared_blocks(), b(0));
        // Blocks 2..4 of the 8-block source are cloned.
        let cloned = addr + b(2);
        a.add_shared((addr, b(8)), (cloned, b(2)));
        assert_eq!(a.shared_references(addr), 1);
        assert_eq!(a.shared_references(cloned), 2);
        assert_eq!(a.shared_blocks(), b(2));
        // The source's whole extent goes: only the blocks the clone does not name come back.
        let freed = a.drop_shared(addr, b(8));
        assert_eq!(freed, vec![(addr, b(2)), (addr + b(4), b(4))]);
        assert_eq!(a.shared_references(cloned), 1);
        // The clone goes: its blocks come back.
        assert_eq!(a.drop_shared(cloned, b(2)), vec![(cloned, b(2))]);
        // A block without a count is kept (a leak until the next open), never freed.
        assert!(a.drop_shared(cloned, b(1)).is_empty());
        // The open walk: a shared extent first on a free block marks it; a second shared
        // extent on it counts; a shared extent on a block marked otherwise is refused.
        let b2 = Allocator::new(64 * GROUP_BLOCKS * BLOCK_SIZE);
        let at = BlockAddr::from_block_index(100);
        assert!(b2.mark_shared(at, b(2)));
        assert!(b2.mark_shared(at, b(2)));
        assert_eq!(b2.shared_references(at), 2);
        let other = BlockAddr::from_block_index(200);
        assert!(b2.mark_used(other, b(1)));
        assert!(!b2.mark_shared(other, b(1)));
        assert!(!b2.mark_used(at, b(1)), "a shared block is used");
    }

    /// Two snapshots of one commit: deleting one leaves the other's hold standing (review
    /// finding: every hold of the generation used to be dropped).
    #[test]
    fn deleting_one_of_two_snapshots_of_a_commit_keeps_the_others_hold() {
        let a = Allocator::new(64 * GROUP_BLOCKS * BLOCK_SIZE);
        let (addr, _) = a.allocate(b(4), b(4), Purpose::Data).expect("space");
        a.add_hold(g(6));
        a.add_hold(g(6));
        a.drop_hold(SnapshotHold {
            generation: g(6),
            dropped_in: g(8),
        });
        a.forget_holds(g(8));
        assert_eq!(a.holds().len(), 1);
        assert_eq!(a.newest_snapshot_generation(), g(6));
        // Born before the snapshots, freed after the deletion: the other one keeps it.
        assert!(!a.free_recorded(g(9), Birth::new(3), addr, b(1)));
    }

    #[test]
    fn a_snapshot_holds_what_it_saw_freed_after_it_until_its_deletion() {
        let a = Allocator::new(64 * GROUP_BLOCKS * BLOCK_SIZE);
        let (addr, _) = a.allocate(b(8), b(8), Purpose::Data).expect("space");
        // No snapshot: every free is pinned.
        assert!(a.free_recorded(g(5), Birth::new(3), addr, b(1)));
        a.add_hold(g(6));
        // Born at or before 6, freed after it: kept.
        assert!(!a.free_recorded(g(7), Birth::new(6), addr + b(1), b(1)));
        assert!(!a.free_recorded(g(7), Birth::new(2), addr + b(2), b(1)));
        // Born after the snapshot: freed.
        assert!(a.free_recorded(g(7), Birth::new(7), addr + b(3), b(1)));
        // Freed by the commit the snapshot keeps (6 itself): not in its tree, freed.
        assert!(a.free_recorded(g(6), Birth::new(4), addr + b(4), b(1)));
        assert_eq!(a.kept_blocks(), b(2));
        // Dropped by commit 9: frees up to 9 are its deletion walk's, later ones are freed.
        a.drop_hold(SnapshotHold {
            generation: g(6),
            dropped_in: g(9),
        });
        assert!(!a.free_recorded(g(9), Birth::new(5), addr + b(5), b(1)));
        assert!(a.free_recorded(g(10), Birth::new(5), addr + b(6), b(1)));
        a.forget_holds(g(9));
        assert!(a.holds().is_empty());
        assert!(a.free_recorded(g(10), Birth::new(1), addr + b(7), b(1)));
        let pinned: u64 = a
            .take_pinned(Generation::new(10))
            .iter()
            .map(|(_, n)| n.get())
            .sum();
        assert_eq!(pinned, 5);
    }

    /// Deleting the newer of two snapshots drops its hold, not the older one's (found by
    /// cargo-mutants: no test had two kept snapshots of different commits).
    #[test]
    fn deleting_a_snapshot_drops_its_own_hold_only() {
        let a = Allocator::new(64 * GROUP_BLOCKS * BLOCK_SIZE);
        let (addr, _) = a.allocate(b(2), b(2), Purpose::Data).expect("space");
        a.add_hold(g(4));
        a.add_hold(g(6));
        a.drop_hold(SnapshotHold {
            generation: g(6),
            dropped_in: g(8),
        });
        assert_eq!(
            a.holds(),
            vec![
                SnapshotHold {
                    generation: g(4),
                    dropped_in: SnapshotHold::KEPT,
                },
                SnapshotHold {
                    generation: g(6),
                    dropped_in: g(8),
                },
            ]
        );
        // Born after 4, freed after the deletion of 6: no snapshot holds it.
        assert!(a.free_recorded(g(9), Birth::new(5), addr, b(1)));
        // Born before 4: the older snapshot still holds it.
        assert!(!a.free_recorded(g(9), Birth::new(3), addr + b(1), b(1)));
    }

    #[test]
    fn allocate_near_takes_the_goal_when_free_and_falls_back_when_not() {
        let a = Allocator::new(64 * GROUP_BLOCKS * BLOCK_SIZE);
        let (first, n) = a.allocate(b(1), b(1), Purpose::Data).expect("space");
        assert_eq!(n, b(1));
        let (next, n) = a
            .allocate_near(first + b(1), b(1), b(4), Purpose::Data)
            .expect("space");
        assert_eq!((next, n), (first + b(1), b(4)));
        // The goal is taken now: the fallback finds another place.
        let (other, _) = a
            .allocate_near(first + b(1), b(1), b(1), Purpose::Data)
            .expect("space");
        assert_ne!(other, first + b(1));
        assert!(a.is_used(other));
        assert_eq!(a.free_blocks(), a.total_blocks() - b(6));
    }

    #[test]
    fn allocate_free_release() {
        let a = Allocator::new(64 << 20);
        let total = a.free_blocks();
        let (addr, len) = a.allocate(b(4), b(4), Purpose::Metadata).expect("space");
        assert_eq!(len, b(4));
        assert_eq!(a.free_blocks(), total - b(4));
        a.free_pinned(Generation::new(1), addr, len);
        assert_eq!(
            a.free_blocks(),
            total - b(4),
            "pinned space is not free yet"
        );
        let ranges = a.take_pinned(Generation::new(1));
        a.release(&ranges);
        assert_eq!(a.free_blocks(), total);
    }

    /// A full device whose only space is deferred, and many threads allocating at once: every
    /// allocation that fits gets space, also the ones that turn to the deferred list just after
    /// another thread emptied it (a commit's node allocation lost that race, failed the commit
    /// and turned the filesystem read-only: bench quick, W1 then W2 on 384 MiB).
    #[test]
    fn concurrent_allocations_all_see_a_reclaim() {
        for round in 0..300 {
            let a = std::sync::Arc::new(Allocator::new(16 << 20));
            let mut held = Vec::new();
            while let Ok(run) = a.allocate(b(1), b(64), Purpose::Metadata) {
                held.push(run);
            }
            assert_eq!(a.free_blocks(), b(0));
            // Everything but the first run deferred, in many ranges.
            a.defer(Generation::new(7), &held[1..]);
            let start = std::sync::Arc::new(std::sync::Barrier::new(8));
            let threads: Vec<_> = (0..8)
                .map(|_| {
                    let (a, start) = (a.clone(), start.clone());
                    std::thread::spawn(move || {
                        start.wait();
                        (0..16).all(|_| a.allocate(b(4), b(4), Purpose::Metadata).is_ok())
                    })
                })
                .collect();
            for t in threads {
                assert!(
                    t.join().expect("thread"),
                    "round {round}: an allocation failed with deferred space left"
                );
            }
        }
    }

    /// The discard of deferred space (DESIGN §14.4) comes when the space leaves the deferred
    /// list and before any search can take it; a failed one leaves it deferred, and a later
    /// commit discards it again; an allocation that finds no other space waits for a discard
    /// in progress, then takes its space.
    #[test]
    fn deferred_space_is_discarded_before_it_is_searchable() {
        let a = std::sync::Arc::new(Allocator::new(64 << 20));
        let total = a.free_blocks();
        let (addr, len) = a.allocate(b(8), b(8), Purpose::Metadata).expect("space");
        let g = Generation::new;
        a.defer(g(10), &[(addr, len)]);
        let called = |gen: u64, fail: bool| {
            let mut seen = Vec::new();
            let r = a.commit_durable_with(g(gen), |ranges| {
                assert!(a.is_used(addr), "not searchable while discarded");
                seen.extend_from_slice(ranges);
                if fail {
                    Err(std::io::Error::other("discard failed"))
                } else {
                    Ok(())
                }
            });
            (r.is_ok(), seen)
        };
        assert_eq!(
            called(10 + DEFER_COMMITS - 1, false),
            (true, vec![]),
            "too early"
        );
        assert_eq!(called(10 + DEFER_COMMITS, true), (false, vec![(addr, len)]));
        assert!(
            a.is_used(addr),
            "a failed discard leaves the range deferred"
        );
        assert_eq!((a.free_blocks(), a.deferred_blocks()), (total, b(8)));
        assert_eq!(called(11 + DEFER_COMMITS, false), (true, vec![(addr, len)]));
        assert!(!a.is_used(addr));
        assert_eq!((a.free_blocks(), a.deferred_blocks()), (total, b(0)));
        assert_eq!(called(12 + DEFER_COMMITS, false), (true, vec![]), "once");

        // The device full and its only free space being discarded: an allocation waits for
        // the discard (the last resort), then finds the space.
        let mut held = Vec::new();
        while let Ok(run) = a.allocate(b(1), b(64), Purpose::Metadata) {
            held.push(run);
        }
        a.defer(g(20), &held);
        let (entered, release) = (std::sync::mpsc::channel(), std::sync::mpsc::channel::<()>());
        let discarding = {
            let a = a.clone();
            let entered = entered.0;
            std::thread::spawn(move || {
                a.commit_durable_with(g(20 + DEFER_COMMITS), |_| {
                    entered.send(()).expect("send");
                    release.1.recv().expect("recv");
                    Ok(())
                })
            })
        };
        entered.1.recv().expect("the discard started");
        let allocating = {
            let a = a.clone();
            std::thread::spawn(move || a.allocate(b(4), b(4), Purpose::Metadata).is_ok())
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!allocating.is_finished(), "no space but the discarded one");
        release.0.send(()).expect("release");
        assert!(discarding.join().expect("discard thread").is_ok());
        assert!(
            allocating.join().expect("allocating thread"),
            "the allocation waited for the discard and found its space"
        );
    }

    /// A trim (`fstrim`) discards exactly the free runs inside its range of at least its
    /// minimum length, clipped to the range and split at group boundaries; nothing used,
    /// nothing outside; while a batch's discard runs its ranges are out of the searches, and
    /// afterwards everything is free as before, the free count never changing.
    #[test]
    fn trim_discards_exactly_the_free_runs_in_its_range() {
        let a = Allocator::new(2 * GROUP_BLOCKS * BLOCK_SIZE);
        let at = BlockAddr::from_block_index;
        // Used: blocks 0..10, 20..21, 40..100, and 32760..32780 (across the group boundary).
        for (start, len) in [(0, 10), (20, 1), (40, 60), (GROUP_BLOCKS - 8, 20)] {
            assert!(a.mark_used(at(start), b(len)));
        }
        let free = a.free_blocks();
        let mut seen: Vec<(u64, u64)> = Vec::new();
        let trimmed = a
            .trim_free(5, GROUP_BLOCKS + 100, 5, |ranges| {
                for &(addr, len) in ranges {
                    for n in 0..len.get() {
                        assert!(
                            a.is_used(addr + BlockCount::new(n)),
                            "out of the searches while discarded"
                        );
                    }
                    seen.push((addr.block_index(), len.get()));
                }
                assert_eq!(a.free_blocks(), free, "still counted free");
                Ok(())
            })
            .expect("trim");
        // 10..20 (10 blocks), 21..40 (19), 100..32760 (the rest of group 0), and in group 1
        // 32780..32868 (to the range's end); nothing below 5 blocks, nothing used.
        assert_eq!(
            seen,
            vec![
                (10, 10),
                (21, 19),
                (100, GROUP_BLOCKS - 8 - 100),
                (GROUP_BLOCKS + 12, 88),
            ]
        );
        assert_eq!(trimmed, seen.iter().map(|(_, l)| l).sum::<u64>());
        assert_eq!(a.free_blocks(), free);
        for (start, len) in &seen {
            assert!(!a.is_used(at(*start)) && !a.is_used(at(start + len - 1)));
        }
        assert!(
            a.is_used(at(20)) && a.is_used(at(GROUP_BLOCKS)),
            "used stays used"
        );
        // A minimum above every run: nothing. A range of used blocks: nothing.
        let mut calls = 0;
        let none = a
            .trim_free(0, GROUP_BLOCKS, GROUP_BLOCKS, |_| {
                calls += 1;
                Ok(())
            })
            .expect("trim");
        assert_eq!((none, calls), (0, 0));
        let none = a.trim_free(40, 100, 1, |_| Ok(())).expect("trim");
        assert_eq!(none, 0);
        // A failed discard: its error, and the space is free again all the same.
        let err = a
            .trim_free(10, 20, 1, |_| Err(std::io::Error::other("discard failed")))
            .expect_err("the discard's error");
        assert_eq!(err.to_string(), "discard failed");
        assert!(!a.is_used(at(10)) && a.free_blocks() == free);
    }

    /// A trim of blocks `0..end` on its own thread whose discard is held (`finish` lets it
    /// return); `ranges` are what that discard got.
    struct HeldTrim {
        ranges: Vec<(BlockAddr, BlockCount)>,
        release: std::sync::mpsc::Sender<()>,
        thread: std::thread::JoinHandle<std::io::Result<u64>>,
    }

    impl HeldTrim {
        fn start(a: &std::sync::Arc<Allocator>, end: u64) -> HeldTrim {
            use std::sync::mpsc;
            let (entered_tx, entered_rx) = mpsc::channel();
            let (release, release_rx) = mpsc::channel::<()>();
            let thread = {
                let a = a.clone();
                std::thread::spawn(move || {
                    a.trim_free(0, end, 1, |ranges| {
                        entered_tx.send(ranges.to_vec()).expect("send");
                        release_rx.recv().expect("recv");
                        Ok(())
                    })
                })
            };
            let ranges = entered_rx.recv().expect("the trim's discard started");
            HeldTrim {
                ranges,
                release,
                thread,
            }
        }

        /// Lets the discard return; the blocks the trim discarded.
        fn finish(self) -> u64 {
            self.release.send(()).expect("release");
            self.thread.join().expect("trim thread").expect("trim")
        }
    }

    /// An allocation of 8 metadata blocks on its own thread, checked to be still waiting
    /// 50 ms on (`why`).
    fn waiting_allocation(
        a: &std::sync::Arc<Allocator>,
        why: &str,
    ) -> std::thread::JoinHandle<Result<(BlockAddr, BlockCount)>> {
        let allocating = {
            let a = a.clone();
            std::thread::spawn(move || a.allocate(b(8), b(8), Purpose::Metadata))
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!allocating.is_finished(), "{why}");
        allocating
    }

    /// An allocation beside a trim never gets a block whose discard is in flight, completes
    /// while the discard is blocked when other space is free, and, on a device whose only
    /// free space is being trimmed, waits for the trim's batch and then gets its space.
    #[test]
    fn an_allocation_never_gets_a_block_under_trim() {
        let a = std::sync::Arc::new(Allocator::new(GROUP_BLOCKS * BLOCK_SIZE));
        let at = BlockAddr::from_block_index;
        // Everything used but 1000..2000 and 5000..5100.
        assert!(a.mark_used(at(0), b(GROUP_BLOCKS)));
        a.release(&[(at(1000), b(1000)), (at(5000), b(100))]);
        // Only the first run is trimmed: the range ends at 2000.
        let trim = HeldTrim::start(&a, 2000);
        assert_eq!(trim.ranges, vec![(at(1000), b(1000))]);
        // The other free run is handed out while the discard is blocked.
        let mut got = Vec::new();
        while got.len() < 10 {
            let run = a
                .allocate(b(1), b(10), Purpose::Metadata)
                .expect("space outside the trim");
            assert!(
                run.0.block_index() >= 5000 && run.0.block_index() < 5100,
                "{run:?} lies outside the trimmed run"
            );
            got.push(run);
        }
        // Take the rest of 5000..5100; then the only free space is under trim: an allocation
        // waits for the batch to end.
        while a.free_blocks().get() > 1000 {
            a.allocate(b(1), b(100), Purpose::Metadata)
                .expect("the rest of 5000..5100");
        }
        let allocating = waiting_allocation(&a, "no space but the one under trim");
        assert_eq!(trim.finish(), 1000);
        let (addr, _) = allocating
            .join()
            .expect("allocating thread")
            .expect("the allocation waited for the trim and found its space");
        assert!((1000..2000).contains(&addr.block_index()));
    }

    /// An allocation whose only free space is under a trim waits for the trim rather than
    /// give up the backup roots: deferred space stays deferred, and the allocation gets a
    /// block of the trimmed run once its discard has ended.
    #[test]
    fn an_allocation_waits_for_a_trim_before_it_reclaims_deferred_space() {
        let a = std::sync::Arc::new(Allocator::new(GROUP_BLOCKS * BLOCK_SIZE));
        let at = BlockAddr::from_block_index;
        // Everything used but 1000..2000 (free) and 3000..3100 (deferred by commit 7).
        assert!(a.mark_used(at(0), b(GROUP_BLOCKS)));
        a.release(&[(at(1000), b(1000))]);
        a.defer(Generation::new(7), &[(at(3000), b(100))]);
        let deferred = a.deferred_blocks();
        assert_eq!(deferred, b(100));
        let trim = HeldTrim::start(&a, 2000);
        assert_eq!(trim.ranges, vec![(at(1000), b(1000))]);
        let allocating = waiting_allocation(&a, "it waits for the trim");
        assert_eq!(
            a.deferred_blocks(),
            deferred,
            "the backup roots' space is kept"
        );
        assert_eq!(trim.finish(), 1000);
        let (addr, _) = allocating
            .join()
            .expect("allocating thread")
            .expect("space once the trim ended");
        assert!((1000..2000).contains(&addr.block_index()), "{addr:?}");
        assert_eq!(a.deferred_blocks(), deferred, "still deferred");
    }

    /// No allocator lock is held across a discard (DESIGN §14.4): while one is in flight, an
    /// allocation on a full device reclaims the other deferred space and completes, and never
    /// gets a block whose discard is in flight; when the discard returns, its space is free.
    #[test]
    fn an_allocation_completes_while_a_discard_is_in_flight() {
        use std::sync::{mpsc, Arc};
        use std::time::Duration;
        let a = Arc::new(Allocator::new(16 << 20));
        let g = Generation::new;
        let mut held = Vec::new();
        while let Ok(run) = a.allocate(b(1), b(64), Purpose::Metadata) {
            held.push(run);
        }
        assert_eq!(a.free_blocks(), b(0));
        // The first half freed by commit 10 (its discard will block), the rest by commit 20
        // (deferred still when commit 10 + DEFER_COMMITS is durable).
        let (first, rest) = held.split_at(held.len() / 2);
        a.defer(g(10), first);
        a.defer(g(20), rest);
        let (entered_tx, entered_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let discarding = {
            let a = a.clone();
            std::thread::spawn(move || {
                a.commit_durable_with(g(10 + DEFER_COMMITS), |ranges| {
                    entered_tx.send(ranges.to_vec()).expect("send");
                    // A slow device: the discard returns when the test says so.
                    release_rx.recv().expect("recv");
                    Ok(())
                })
            })
        };
        let in_flight = entered_rx.recv().expect("the discard started");
        assert_eq!(in_flight, first.to_vec());
        let overlaps = |(addr, len): (BlockAddr, BlockCount)| {
            in_flight
                .iter()
                .any(|&(a, l)| addr < a + l && a < addr + len)
        };
        let (done_tx, done_rx) = mpsc::channel();
        let allocating = {
            let a = a.clone();
            std::thread::spawn(move || {
                let got: Vec<_> = (0..8)
                    .map(|_| a.allocate(b(1), b(4), Purpose::Metadata))
                    .collect();
                done_tx.send(()).expect("send");
                got
            })
        };
        // The allocation completes while the discard is still blocked.
        done_rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the allocation completed with the discard in flight");
        let got = allocating.join().expect("allocating thread");
        for run in got {
            let run = run.expect("space from the reclaimed deferred list");
            assert!(!overlaps(run), "{run:?} is being discarded");
        }
        assert_eq!(
            a.backup_floor(),
            g(20),
            "the reclaim took commit 20's space"
        );
        for &(addr, _) in &in_flight {
            assert!(
                a.is_used(addr),
                "not searchable while its discard is in flight"
            );
        }
        assert!(!discarding.is_finished());
        release_tx.send(()).expect("release");
        assert!(discarding.join().expect("discard thread").is_ok());
        for &(addr, len) in &in_flight {
            assert!(!a.is_used(addr) && !a.is_used(addr + (len - b(1))));
        }
        assert_eq!(a.deferred_blocks(), b(0));
        let goal = in_flight[0].0;
        let (addr, _) = a
            .allocate_near(goal, b(1), b(1), Purpose::Metadata)
            .expect("space");
        assert_eq!(addr, goal, "the discarded space is free now");
    }

    /// A discard that panics ends its batch as failed: the ranges are deferred again, and
    /// nothing waits on them for ever.
    #[test]
    fn a_panicking_discard_leaves_its_ranges_deferred() {
        let a = Allocator::new(16 << 20);
        let (addr, len) = a.allocate(b(8), b(8), Purpose::Metadata).expect("space");
        a.defer(Generation::new(1), &[(addr, len)]);
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            a.commit_durable_with(Generation::new(1 + DEFER_COMMITS), |_| panic!("device"))
        }));
        assert!(unwound.is_err());
        assert_eq!(a.deferred_blocks(), b(8));
        assert!(a.is_used(addr));
        assert!(a.reclaim_deferred());
        assert!(!a.is_used(addr));
    }

    /// Deferred space (DESIGN §13.2) is counted free but no search finds it until commit
    /// `freed_by + DEFER_COMMITS` is durable; when nothing else is left an allocation
    /// reclaims it at once and the backup floor rises past the commit that freed it.
    #[test]
    fn deferred_space_waits_its_commits_and_is_reclaimed_when_full() {
        let a = Allocator::new(64 << 20);
        let total = a.free_blocks();
        let (addr, len) = a.allocate(b(8), b(8), Purpose::Metadata).expect("space");
        let g = Generation::new;
        a.defer(g(10), &[(addr, len)]);
        assert_eq!(a.free_blocks(), total, "deferred space counts as free");
        assert_eq!(a.deferred_blocks(), b(8));
        assert!(a.is_used(addr), "no search may find it");
        a.commit_durable(g(10 + DEFER_COMMITS - 1));
        assert!(a.is_used(addr), "one commit too early");
        a.commit_durable(g(10 + DEFER_COMMITS));
        assert!(!a.is_used(addr));
        assert_eq!((a.free_blocks(), a.deferred_blocks()), (total, b(0)));
        assert_eq!(a.backup_floor(), g(0));

        // Full device: everything allocated, then a range deferred by commit 20.
        let mut held = Vec::new();
        while let Ok(run) = a.allocate(b(1), b(256), Purpose::Metadata) {
            held.push(run);
        }
        assert_eq!(a.free_blocks(), b(0));
        let (addr, len) = held[0];
        a.defer(g(20), &[(addr, len)]);
        assert_eq!(a.free_blocks(), len);
        let got = a.allocate(b(1), len, Purpose::Metadata).expect("reclaimed");
        assert_eq!(got, (addr, len));
        assert_eq!(a.backup_floor(), g(20));
        assert_eq!(a.deferred_blocks(), b(0));
    }

    /// Replay of a log written after a reclaim may claim a block the open walk deferred for
    /// a backup tree: it leaves the deferred list (never released under the file) and the
    /// floor rises.
    #[test]
    fn marking_a_deferred_block_used_takes_it_out_of_the_list() {
        let a = Allocator::new(64 << 20);
        let g = Generation::new;
        let base = BlockAddr::new(1 << 20);
        assert_eq!(a.defer_unused(g(7), base, b(4)), b(4));
        assert!(
            a.mark_used(base + b(1), b(1)),
            "a deferred block is free to the tree"
        );
        assert_eq!(a.deferred_blocks(), b(3));
        assert_eq!(a.backup_floor(), g(7));
        a.commit_durable(g(7 + DEFER_COMMITS));
        assert!(a.is_used(base + b(1)));
        assert!(!a.is_used(base) && !a.is_used(base + b(2)) && !a.is_used(base + b(3)));
        assert!(
            !a.mark_used(base + b(1), b(1)),
            "a used block is a double reference"
        );
    }

    #[test]
    fn data_cannot_take_the_reserve_and_no_space_is_an_error() {
        let a = Allocator::new(8 << 20);
        let mut got = 0;
        while let Ok((_, len)) = a.allocate(b(1), b(64), Purpose::Data) {
            got += len.get();
        }
        assert!(got < a.total_blocks().get());
        assert!(matches!(
            a.allocate(b(1), b(1), Purpose::Data),
            Err(Error::NoSpace(_))
        ));
        assert!(
            a.allocate(b(4), b(4), Purpose::Metadata).is_ok(),
            "metadata may use the reserve"
        );
    }

    #[test]
    fn threads_allocate_disjoint_ranges() {
        let a = std::sync::Arc::new(Allocator::new(512 << 20));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let a = a.clone();
                std::thread::spawn(move || {
                    (0..500)
                        .map(|_| a.allocate(b(1), b(8), Purpose::Data).expect("space"))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut all: Vec<(BlockAddr, BlockCount)> = handles
            .into_iter()
            .flat_map(|h| h.join().expect("thread"))
            .collect();
        all.sort();
        for pair in all.windows(2) {
            assert!(pair[0].0 + pair[0].1 <= pair[1].0, "overlap {pair:?}");
        }
    }
}
