//! Object ids (inode numbers): the high-water mark, the per-thread batches, and the
//! benchmark-only global-lock switch, all owned by [`ObjectIds`].
//!
//! Must not touch: anything but the id counter (the commit only reads its high-water mark
//! into the superblock).

use std::cell::RefCell;
use std::collections::HashMap;
#[cfg(feature = "seed-before")]
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicU64, Ordering};

use birch_format::{InodeNo, OBJECTID_LIMIT, SUBVOLUME_SHIFT};
#[cfg(feature = "seed-before")]
use parking_lot::{Mutex, MutexGuard};

use crate::counters::Counters;
use crate::error::{Error, Result};
use crate::ids::{batch_aligned, OBJECTID_BATCH};

use super::Engine;

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

/// The object-id counter of one engine: [`Engine::allocate_objectid`] and its kin.
pub(super) struct ObjectIds {
    /// The next id no batch has taken (batch aligned at open; the superblock's
    /// `next_objectid` at each commit).
    next: AtomicU64,
    /// Benchmark-only switch (seed 002's "before", [`Engine::set_bench_global_objectid_lock`];
    /// only in builds with the `seed-before` feature): every object id is taken one at a time
    /// under [`ObjectIds::lock`].
    #[cfg(feature = "seed-before")]
    bench_global_lock: AtomicBool,
    /// The one lock on the id counter while `bench_global_lock` is on; unused otherwise.
    #[cfg(feature = "seed-before")]
    pub(super) lock: Mutex<()>,
    /// This engine among the engines of the process: the key of its per-thread batches.
    instance: u64,
}

impl ObjectIds {
    /// The counter of an image whose superblock says `next_objectid`.
    pub(super) fn new(next_objectid: u64) -> ObjectIds {
        ObjectIds {
            next: AtomicU64::new(batch_aligned(next_objectid)),
            #[cfg(feature = "seed-before")]
            bench_global_lock: AtomicBool::new(false),
            #[cfg(feature = "seed-before")]
            lock: Mutex::new(()),
            instance: INSTANCES.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// The next id no batch has taken: what the superblock records.
    pub(super) fn high_water(&self) -> u64 {
        self.next.load(Ordering::Relaxed)
    }

    /// See [`Engine::raise_objectid`].
    fn raise(&self, min: u64) {
        self.next.fetch_max(batch_aligned(min), Ordering::SeqCst);
    }

    /// Takes the id counter's one mutex (`bench_global_lock`), counting a wait when another
    /// thread holds it.
    #[cfg(feature = "seed-before")]
    fn locked(&self, counters: &Counters) -> MutexGuard<'_, ()> {
        if let Some(guard) = self.lock.try_lock() {
            return guard;
        }
        counters.add(|c| &c.objectid_lock_waits, 1);
        self.lock.lock()
    }

    /// See [`Engine::allocate_objectid`].
    // `counters` counts waits for the seed-before switch's mutex alone.
    #[cfg_attr(not(feature = "seed-before"), allow(unused_variables))]
    fn allocate(&self, counters: &Counters) -> Result<InodeNo> {
        #[cfg(feature = "seed-before")]
        if self.bench_global_lock.load(Ordering::Relaxed) {
            let _guard = self.locked(counters);
            let id = self.next.load(Ordering::Relaxed);
            check_objectid(id)?;
            self.next.store(id + 1, Ordering::Relaxed);
            return Ok(InodeNo::new(id));
        }
        let id = OBJECTID_RANGES.with(|ranges| {
            let mut ranges = ranges.borrow_mut();
            let range = ranges.entry(self.instance).or_insert((0, 0));
            if range.0 == range.1 {
                let start = self.next.fetch_add(OBJECTID_BATCH, Ordering::Relaxed);
                *range = (start, start + OBJECTID_BATCH);
            }
            let id = range.0;
            range.0 += 1;
            id
        });
        check_objectid(id)?;
        Ok(InodeNo::new(id))
    }

    /// See [`Engine::allocate_objectid_alone`].
    // `counters` counts waits for the seed-before switch's mutex alone.
    #[cfg_attr(not(feature = "seed-before"), allow(unused_variables))]
    fn allocate_alone(&self, counters: &Counters) -> Result<InodeNo> {
        #[cfg(feature = "seed-before")]
        if self.bench_global_lock.load(Ordering::Relaxed) {
            // Ids taken one at a time leave the counter anywhere inside a batch.
            let _guard = self.locked(counters);
            let id = batch_aligned(self.next.load(Ordering::Relaxed));
            check_objectid(id)?;
            self.next.store(id + OBJECTID_BATCH, Ordering::Relaxed);
            return Ok(InodeNo::new(id));
        }
        let id = self.next.fetch_add(OBJECTID_BATCH, Ordering::Relaxed);
        check_objectid(id)?;
        Ok(InodeNo::new(id))
    }
}

impl Engine {
    /// Makes sure new object ids are above `min` (replay of inodes created after the commit).
    pub fn raise_objectid(&self, min: u64) {
        self.ids.raise(min);
    }

    /// Benchmark only (mount option `bench_global_objectid_lock`, seed 002's "before"): every
    /// object id is taken from the counter under one mutex, one id at a time, with no batch per
    /// thread; waits for the mutex count in `objectid_lock_waits`. Off by default; only in
    /// builds with the `seed-before` feature (benchmark builds, never the shipped binary).
    #[cfg(feature = "seed-before")]
    pub fn set_bench_global_objectid_lock(&self, on: bool) {
        self.ids.bench_global_lock.store(on, Ordering::Relaxed);
    }

    /// A new inode number (object id), never used before in this filesystem. `NoSpace` once
    /// the ids reach [`OBJECTID_LIMIT`] (2^48: bits 48..63 of an inode number name its
    /// subvolume, DESIGN §7).
    pub fn allocate_objectid(&self) -> Result<InodeNo> {
        self.ids.allocate(&self.counters)
    }

    /// A new object id that shares its batch of 64 with no other object (a directory: its
    /// entries then get a delta shard and inode-table shard of their own, see
    /// `delta::batch_shard`). The rest of the batch is never used.
    /// `NoSpace` as [`Engine::allocate_objectid`].
    pub fn allocate_objectid_alone(&self) -> Result<InodeNo> {
        self.ids.allocate_alone(&self.counters)
    }
}
