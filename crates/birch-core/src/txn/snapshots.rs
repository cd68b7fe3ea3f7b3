//! The snapshot policy (DESIGN §15): queueing creations and deletions for the next commit,
//! rollback, the space only each snapshot holds, snapshot views, and, called by the commit,
//! writing the new snapshot list and giving back what deleted snapshots held.
//! [`SnapshotState`] owns the durable list and the queued operations.
//!
//! Must not touch: the tree walks themselves (`crate::snapshot` does them), the commit order
//! (it queues and lets `commit.rs` freeze), the live tree's items.

use std::sync::Arc;

use birch_format::node::Node;
use birch_format::superblock::{RootPtr, Superblock, INCOMPAT_SNAPSHOTS};
use birch_format::{
    BlockAddr, BlockCount, Generation, NODE_BLOCKS, SNAPSHOT_ID_LIMIT, SUBVOLUME_SHIFT,
};

use crate::error::{Error, Result};
use crate::snapshot::{self, Snapshot, SnapshotOp};

use super::{now, CommittedRoot, CommittedView, Engine};

/// [`Engine::snapshots`]' state.
#[derive(Default)]
pub(super) struct SnapshotState {
    /// Oldest first (ids and generations ascend together).
    pub(super) list: Vec<Snapshot>,
    /// Queued by [`Engine::create_snapshot`] and [`Engine::delete_snapshot`] for the next
    /// freeze.
    pub(super) pending: Vec<SnapshotOp>,
    /// Snapshots newer than the live tree, kept by a mount's open: every snapshot change is
    /// refused while there is one (`Engine::keep_snapshot_trees`).
    pub(super) outside_lineage: Vec<Snapshot>,
    /// Snapshots a repair's open left out of `list` (newer than the live tree, or a tree that
    /// does not read whole); the next commit drops them from the durable list.
    pub(super) forgotten: Vec<Snapshot>,
}

impl SnapshotState {
    /// Snapshot `id` in the durable list.
    pub(super) fn by_id(&self, id: u64) -> Option<&Snapshot> {
        self.list.iter().find(|s| s.id == id)
    }

    /// Snapshot `name` in the durable list.
    fn by_name(&self, name: &str) -> Option<&Snapshot> {
        self.list.iter().find(|s| s.name == name)
    }
}

impl Engine {
    /// The snapshots, oldest first, as of the last durable commit.
    pub fn snapshots(&self) -> Vec<Snapshot> {
        self.snapshots.lock().list.clone()
    }

    /// Makes a snapshot named `name` of the filesystem as the commit this call runs leaves
    /// it (atomic with that commit; on an idle filesystem that commit writes the list's leaf
    /// and the superblock, whatever the size of the tree). Errors: a bad name
    /// (`snapshot::check_name`), a name in use (`Exists`), a read-only engine, the commit's.
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
            .by_name(name)
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

    /// The snapshots a repair's open left out because their trees are newer than the live
    /// tree (see [`crate::snapshot::outside_lineage`]) or do not read whole; its next commit
    /// deletes them from the list. Empty for any other open.
    pub fn forgotten_snapshots(&self) -> Vec<Snapshot> {
        self.snapshots.lock().forgotten.clone()
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
    /// (the deletion walk against the snapshot, `snapshot::deletion_frees`). Snapshots newer
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
        if self.log().replay_pending() {
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
            let Some(target) = state.by_name(name).cloned() else {
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
    /// back (`birch snapshot list`), found by the deletion walk (`snapshot::deletion_frees`)
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
            let older = Generation::new(if i == 0 { 0 } else { list[i - 1].generation });
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
            .by_id(id)
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
        self.snapshots.lock().by_id(id).cloned()
    }

    /// Snapshots are changed only by a writable engine.
    fn check_snapshot_writable(&self) -> Result<()> {
        self.check_up()?;
        if let Some(s) = self.snapshots.lock().outside_lineage.first() {
            return Err(Error::Invalid(format!(
                "snapshot {:?} (generation {}) is newer than the live tree, not a past state of \
                 it (left by a fallback to an older tree): snapshot changes are refused until \
                 birch fsck --repair deletes it",
                s.name, s.generation
            )));
        }
        match self.read_only_cause() {
            Some(cause) => Err(Error::ReadOnly(cause)),
            None => Ok(()),
        }
    }

    /// Applies `ops` to the snapshot list for commit `generation` (whose fs tree is
    /// `fs_root`): writes the new list tree (its nodes join `nodes`), frees the old one's
    /// nodes (never shared: pinned in this commit), and sets the superblock's list fields
    /// and, with a first snapshot, `INCOMPAT_SNAPSHOTS`. Returns the new list, the deleted
    /// snapshots and the list before.
    #[allow(clippy::type_complexity)]
    pub(super) fn write_snapshot_list(
        &self,
        ops: &[SnapshotOp],
        generation: Generation,
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
                        generation: generation.get(),
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
                    generation,
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
    pub(super) fn give_back_deleted(
        &self,
        generation: Generation,
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
                .map(|s| Generation::new(s.generation))
                .max()
                .unwrap_or_default();
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
                        self.alloc.free_pinned(generation, addr, count);
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
