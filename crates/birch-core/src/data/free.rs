//! The free path of data blocks: [`DataLayer::free`], the one place data blocks go back to
//! the allocator, told each block's birth generation and how far it was seen ([`Seen`]; the
//! contract is `super`'s module doc), and what leads to it: the blocks of an extent item a
//! transaction drops (shared ones lose a reference first), of a deleted file's items, and runs
//! written and never recorded ([`DataLayer::give_back`]); also the marking of a replayed
//! extent's blocks as used ([`DataLayer::mark_replayed_extent`]).
//!
//! Owns: the decision between a recorded free (kept for snapshots, pinned until durable) and
//! an unrecorded one (at once), and the placed bytes of freed blocks. Must not touch: the
//! extent map (callers plan which items go and record the deletions themselves), the device,
//! inodes and locks.

use birch_format::items::FileExtent;
use birch_format::{BlockAddr, BlockCount, Key, BLOCK_SIZE};

use super::{BlockRun, DataLayer, Seen, WrittenRun};
use crate::alloc::Birth;
use crate::txn::WriteTxn;

impl DataLayer<'_> {
    /// Frees the blocks of an extent item that `txn` deletes with the rest of a file (an
    /// unlinked inode's last use, orphan reclaim). An item that does not decode is left (its
    /// blocks stay used until the next mount derives the free-space map again).
    pub(crate) fn free_extent_item(&self, txn: &WriteTxn<'_>, key: &Key, value: &[u8]) {
        match FileExtent::decode(value) {
            Ok(extent) => {
                if let Some((addr, blocks)) = extent.disk_range() {
                    let run = BlockRun { addr, blocks };
                    self.free_extent_blocks(run, extent.generation, extent.shared, txn);
                }
            }
            Err(e) => log::warn!("freeing extent {key}: does not decode ({e}); blocks kept"),
        }
    }

    /// Frees the blocks of an extent item (or a piece of one) that `txn` drops from the live
    /// tree. A shared extent's blocks lose one reference each and only those left with none
    /// are freed ([`crate::alloc::Allocator::drop_shared`]); both then go through
    /// [`DataLayer::free`] with [`Seen::Recorded`] (the allocator's sharing-aware
    /// `free_recorded`, which keeps what a snapshot holds).
    pub(crate) fn free_extent_blocks(
        &self,
        run: BlockRun,
        birth: u64,
        shared: bool,
        txn: &WriteTxn<'_>,
    ) {
        if !shared {
            return self.free(run, birth, Seen::Recorded(txn));
        }
        let unreferenced = self
            .engine
            .allocator()
            .drop_shared(run.disk_addr(), run.block_count());
        for (addr, blocks) in unreferenced {
            self.free(BlockRun::new(addr, blocks), birth, Seen::Recorded(txn));
        }
    }

    /// Marks the blocks of an extent item (regular or preallocated) that log replay applies as used (the
    /// free-space map was derived from the committed tree, which does not reference them).
    pub(crate) fn mark_replayed_extent(&self, value: &[u8]) {
        // Regular and preallocated extents alike hold blocks, as the open walk counts them
        // (`FileExtent::disk_range`): a replayed one left unmarked could be handed out again.
        let Ok(extent) = FileExtent::decode(value) else {
            return;
        };
        let Some((disk_addr, blocks)) = extent.disk_range() else {
            return;
        };
        let (addr, count) = (BlockAddr::new(disk_addr), BlockCount::new(blocks));
        if extent.shared {
            // A shared extent (a piece of a clone an fsync logged after the clone's commit):
            // blocks counted already are one more reference, as the open walk counts them.
            if !self.engine.allocator().mark_shared(addr, count) {
                log::warn!(
                    "replay: shared extent at {disk_addr:#x} x {blocks} on blocks an unshared extent or node holds"
                );
            }
        } else {
            self.engine.allocator().mark_used(addr, count);
        }
    }

    /// Frees written runs that were never recorded (the operation that wrote them failed).
    pub(crate) fn give_back(&self, runs: &[WrittenRun]) {
        for run in runs {
            self.free(run.run(), run.birth, Seen::Unrecorded);
        }
    }

    /// The one free path of data blocks: `run` leaves a file (an extent dropped by truncate,
    /// punch or overwrite, a deleted file's extents) or goes back unrecorded (a failed write).
    /// `birth` is the blocks' birth generation, for a recorded block the generation of the
    /// extent item that referenced it; it may be older than the real birth, never newer (see
    /// the module doc). [`Seen::Recorded`] goes through the allocator's sharing-aware free (kept
    /// while a snapshot holds the blocks, else pinned until the freeing commit is durable);
    /// [`Seen::Unrecorded`] frees them at once.
    pub(crate) fn free(&self, run: BlockRun, birth: u64, seen: Seen<'_, '_>) {
        let alloc = self.engine.allocator();
        // Placed bytes of freed blocks need no write in place when nothing will read them
        // there. Unrecorded blocks: no record ever named them, forgotten. Recorded blocks born
        // in the freeing transaction: only those whose bytes a queued data record carries are
        // forgotten (`forget_logged`); the others may be named by an extent record in the
        // log's queue, or in a batch a leader took and has not written yet, and that leader
        // writes them with the batch (forgetting them there sent a batch out without its
        // blocks: replay stopped at it and dropped every later, acknowledged batch; found by
        // the soak, tests/placed_race.rs). A block an older generation recorded may be named
        // by the frozen transaction whose commit has not written its placed blocks yet (the
        // free runs after the freeze): its bytes stay placed too. What stays placed is written
        // by a leader naming it or by the next commit; the blocks stay pinned until then.
        let pending = self.engine.pending();
        let (at, len) = (run.disk_addr().get(), run.block_count().get() * BLOCK_SIZE);
        let was_placed = match &seen {
            Seen::Unrecorded => pending.forget(at, len) > 0,
            Seen::Recorded(txn) if birth >= txn.generation().get() => {
                pending.forget_logged(at, len);
                false
            }
            Seen::Recorded(_) => false,
        };
        match seen {
            // A commit's `write_out` may have taken these placed bytes already and be about
            // to write them: freed at once, the blocks could be taken and written by another
            // file first, and then overwritten with the stale bytes. Pinned to the running
            // transaction instead, they come back only after its commit, which starts after
            // the commit writing them ended.
            Seen::Unrecorded if was_placed => {
                alloc.free_pinned(
                    self.engine.running_generation(),
                    run.disk_addr(),
                    run.block_count(),
                );
            }
            Seen::Recorded(txn) => {
                let generation = txn.generation();
                // A block cannot be born after the transaction that frees it.
                debug_assert!(
                    birth <= generation.get(),
                    "birth {birth} after {generation}"
                );
                // Kept, not freed, when a snapshot holds the blocks (DESIGN §15.6).
                alloc.free_recorded(
                    generation,
                    Birth::new(birth),
                    run.disk_addr(),
                    run.block_count(),
                );
            }
            Seen::Unrecorded => alloc.free_now(run.disk_addr(), run.block_count()),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The free path over an engine on a memory device: recorded blocks freed from a file stay
    //! pinned until the commit, then deferred for the backup trees, then reusable.

    use birch_format::{BlockAddr, BlockCount};

    use super::*;
    use crate::data::test_support::{pattern, setup, INO};
    use crate::data::BlockDelta;

    /// A placed block whose extent the running transaction drops stays placed (a leader may
    /// have taken a batch naming it) unless a queued data record carries its bytes; the commit
    /// writes what stayed, before the blocks come back.
    #[test]
    fn freed_placed_blocks_stay_until_written_unless_the_log_carries_them() {
        let (mem, engine) = setup();
        let data = DataLayer::new(&engine);
        engine.commit().expect("commit");
        let runs = data.place_new(INO, 0, &pattern(2, 3)).expect("place");
        let (addr, len) = (runs[0].addr, 2 * BLOCK_SIZE);
        // The second block's bytes go to the log in a data record.
        engine.pending().mark_logged(addr + BLOCK_SIZE, BLOCK_SIZE);
        data.replace_range(INO, 0, len, runs, false)
            .expect("record");
        data.drop_range(INO, 0, len).expect("drop");
        let over = engine.pending().overlay(addr, len);
        assert_eq!(
            over.iter().map(|(a, _)| *a).collect::<Vec<_>>(),
            vec![addr],
            "only the block no data record carries stays placed"
        );
        engine.commit().expect("commit");
        assert_eq!(engine.pending().blocks(), 0, "the commit writes it");
        let mut on_disk = vec![0u8; BLOCK_SIZE as usize];
        crate::device::BlockDevice::read_at(&*mem, &mut on_disk, addr).expect("read");
        assert_eq!(on_disk, pattern(2, 3)[..BLOCK_SIZE as usize]);
    }

    /// A placed block born in an older generation and freed while that generation's commit
    /// is frozen but has not written its placed blocks yet stays placed, logged or not: the
    /// frozen transaction names it, and its commit must write it before its superblock does.
    /// [`crate::txn::Engine::commit_then`] runs the drop right after the freeze, before the
    /// commit's write-out. (Found by cargo-mutants: the guard `birth >= txn.generation()` as
    /// `true` forgot the block there, and the commit left it unwritten.)
    #[test]
    fn a_placed_block_the_frozen_commit_names_stays_placed_when_freed_after_the_freeze() {
        let (mem, engine) = setup();
        let data = DataLayer::new(&engine);
        engine.commit().expect("commit");
        let runs = data.place_new(INO, 0, &pattern(1, 11)).expect("place");
        let addr = runs[0].addr;
        // A data record carries its bytes: only the birth spares it from `forget_logged`.
        engine.pending().mark_logged(addr, BLOCK_SIZE);
        data.replace_range(INO, 0, BLOCK_SIZE, runs, false)
            .expect("record");
        let frozen = engine.running_generation();
        let mut dropped = None;
        engine
            .commit_then(|| {
                assert!(engine.running_generation() > frozen, "frozen already");
                dropped = Some(data.drop_range(INO, 0, BLOCK_SIZE).expect("drop"));
                assert_eq!(
                    engine.pending().overlay(addr, BLOCK_SIZE).len(),
                    1,
                    "the frozen commit has not written it: it stays placed"
                );
            })
            .expect("commit");
        assert_eq!(dropped, Some(BlockDelta { added: 0, freed: 1 }));
        assert_eq!(engine.pending().blocks(), 0, "the frozen commit wrote it");
        let mut on_disk = vec![0u8; BLOCK_SIZE as usize];
        crate::device::BlockDevice::read_at(&*mem, &mut on_disk, addr).expect("read");
        assert_eq!(
            on_disk,
            pattern(1, 11),
            "the block the committed tree names holds its bytes"
        );
    }

    /// The forgetting covers the whole run, in bytes: with a run of three blocks whose last
    /// two a data record carries, only the first stays placed. (Found by cargo-mutants: the
    /// two-block run above cannot tell `blocks * BLOCK_SIZE` from `blocks + BLOCK_SIZE`.)
    #[test]
    fn freed_placed_blocks_are_forgotten_to_the_end_of_the_run() {
        let (_mem, engine) = setup();
        let data = DataLayer::new(&engine);
        engine.commit().expect("commit");
        let runs = data.place_new(INO, 0, &pattern(3, 5)).expect("place");
        assert_eq!(runs.len(), 1, "three blocks placed together are one run");
        let (addr, len) = (runs[0].addr, 3 * BLOCK_SIZE);
        engine
            .pending()
            .mark_logged(addr + BLOCK_SIZE, 2 * BLOCK_SIZE);
        data.replace_range(INO, 0, len, runs, false)
            .expect("record");
        data.drop_range(INO, 0, len).expect("drop");
        let over = engine.pending().overlay(addr, len);
        assert_eq!(
            over.iter().map(|(a, _)| *a).collect::<Vec<_>>(),
            vec![addr],
            "the logged blocks are forgotten, the third too"
        );
    }

    /// Placed runs given back unrecorded (a failed write) are forgotten whole, the third block
    /// of a run too, and their blocks are pinned, not free at once.
    #[test]
    fn placed_runs_given_back_are_forgotten_whole_and_pinned() {
        let (_mem, engine) = setup();
        let data = DataLayer::new(&engine);
        engine.commit().expect("commit");
        let runs = data.place_new(INO, 0, &pattern(3, 7)).expect("place");
        assert_eq!(runs.len(), 1, "three blocks placed together are one run");
        let addr = runs[0].addr;
        let pinned_before = engine.allocator().pinned_blocks();
        data.give_back(&runs);
        assert_eq!(engine.pending().blocks(), 0, "every placed block forgotten");
        assert_eq!(
            engine.allocator().pinned_blocks(),
            pinned_before + BlockCount::new(3),
            "pinned to the running transaction"
        );
        assert!(engine.allocator().is_used(BlockAddr::new(addr)));
        // Written in place instead (never placed): free at once, nothing pinned.
        let runs = data.write_new(INO, 0, &pattern(3, 8)).expect("write");
        let addr = runs[0].addr;
        let pinned_before = engine.allocator().pinned_blocks();
        data.give_back(&runs);
        assert_eq!(engine.allocator().pinned_blocks(), pinned_before);
        assert!(!engine.allocator().is_used(BlockAddr::new(addr)));
    }

    #[test]
    fn freed_blocks_stay_pinned_until_the_commit() {
        let (_mem, engine) = setup();
        let data = DataLayer::new(&engine);
        let runs = data.write_new(INO, 0, &pattern(4, 2)).expect("write");
        let addr = runs[0].addr;
        data.replace_range(INO, 0, 4 * BLOCK_SIZE, runs, false)
            .expect("record");
        engine.commit().expect("commit");
        let pinned_before = engine.allocator().pinned_blocks();
        let delta = data.drop_range(INO, 0, 4 * BLOCK_SIZE).expect("drop");
        assert_eq!(delta, BlockDelta { added: 0, freed: 4 });
        let (addr, four) = (BlockAddr::new(addr), BlockCount::new(4));
        assert_eq!(engine.allocator().pinned_blocks(), pinned_before + four);
        assert!(
            engine.allocator().is_used(addr),
            "freed block reusable before the commit"
        );
        // An allocation asking for exactly that place must not get it.
        let (got, blocks) = engine
            .allocate_data_near(addr, BlockCount::new(1), four)
            .expect("allocate");
        assert!(got + blocks <= addr || got >= addr + four);
        engine.allocator().free_now(got, blocks);
        engine.commit().expect("commit");
        // Released by that commit, the space is deferred for the backup trees (DESIGN §13.2):
        // still untouched by any search until DEFER_COMMITS more commits are durable.
        assert!(
            engine.allocator().is_used(addr),
            "reusable while a backup tree may still read it"
        );
        for i in 0..crate::alloc::DEFER_COMMITS {
            // A commit with nothing to write is no commit: give each one a change.
            let other = data
                .write_new(INO + 1, i * BLOCK_SIZE, &pattern(1, 9))
                .expect("write");
            data.replace_range(INO + 1, i * BLOCK_SIZE, BLOCK_SIZE, other, false)
                .expect("record");
            engine.commit().expect("commit");
        }
        assert!(
            !engine.allocator().is_used(addr),
            "not released after the deferral"
        );
        assert_eq!(
            engine
                .allocate_data_near(addr, BlockCount::new(1), four)
                .expect("reuse"),
            (addr, four)
        );
    }
}
