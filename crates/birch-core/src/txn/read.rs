//! The read path: merged reads over the running delta, the frozen delta and the committed
//! tree ([`Engine::get`], [`Engine::range`], [`Engine::last_in`], `changed_items`), reads of
//! committed trees alone ([`CommittedView`]), and the committed-root pins
//! ([`CommittedRoot`], its release list) that keep freed space until no reader can see it.
//!
//! Must not touch: the running delta's contents (reads only), the device beyond node reads,
//! the commit (it publishes the roots read here).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use birch_format::superblock::RootPtr;
use birch_format::{BlockAddr, BlockCount, Generation, InodeNo, Key};
use parking_lot::Mutex;

use crate::alloc::Allocator;
use crate::btree::TreeReader;
use crate::delta::{merge_layers, DeltaValue, FrozenDelta};
use crate::error::Result;

use super::Engine;

/// Space released when no committed root that could still read it is held. The list of
/// committed root N holds what commit N+1 freed; it also holds the list of root N+1 (`next`),
/// so a list is dropped, and its space released, only after its own root and every older one
/// are let go. Released space is deferred, not freed: see [`Allocator::defer`].
pub(super) struct ReleaseOnDrop {
    alloc: Arc<Allocator>,
    /// The commit that freed `ranges` (the one after this list's committed root).
    pub(super) freed_by: AtomicU64,
    pub(super) ranges: Mutex<Vec<(BlockAddr, BlockCount)>>,
    pub(super) next: Mutex<Option<Arc<ReleaseOnDrop>>>,
}

impl ReleaseOnDrop {
    pub(super) fn new(alloc: Arc<Allocator>) -> Arc<ReleaseOnDrop> {
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
    pub(super) release: Arc<ReleaseOnDrop>,
}

/// What readers need besides the active delta; each stripe of [`Engine::state`] has a copy.
pub(super) struct ReadState {
    pub(super) frozen: Option<Arc<FrozenDelta>>,
    /// The current committed root behind a pin of this stripe's own: a reader clones the pin,
    /// so readers of different stripes count references on different cache lines.
    pub(super) committed: Arc<CommittedRootPin>,
}

/// One stripe's hold on the current committed root (see [`ReadState::committed`]).
pub(super) struct CommittedRootPin(pub(super) Arc<CommittedRoot>);

impl std::ops::Deref for CommittedRootPin {
    type Target = CommittedRoot;
    fn deref(&self) -> &CommittedRoot {
        &self.0
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

impl Engine {
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
}
