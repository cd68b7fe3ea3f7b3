//! Object-id batching: the one number the engine's id allocator and every map sharded by object
//! id must agree on.
//!
//! Owns: [`OBJECTID_BATCH`], the ids a thread takes from the shared counter at once, and
//! [`batch_aligned`]. The engine (`txn`) hands ids out in these batches; the delta, the inode
//! table and the other maps sharded by object id (`delta::batch_shard`) put one batch in one
//! shard. Both depend on this module, so neither depends on the other for it.
//!
//! Must not touch: the counter itself (the engine keeps it), shards, locks, I/O.

/// Object ids a thread takes from the shared counter at once, so creates on different threads
/// do not bounce one cache line (the ext4 lesson of seed 002). A power of two: shard maps find
/// the batch of an id with a shift.
pub(crate) const OBJECTID_BATCH: u64 = 64;

const _: () = assert!(OBJECTID_BATCH.is_power_of_two());

/// `id` rounded up to a whole batch. The object-id mark is kept so (at open, after replay), so
/// a batch taken later is one whole shard's batch: a directory's must share its shard with
/// nothing (`Engine::allocate_objectid_alone`).
pub(crate) fn batch_aligned(id: u64) -> u64 {
    id.div_ceil(OBJECTID_BATCH).saturating_mul(OBJECTID_BATCH)
}
