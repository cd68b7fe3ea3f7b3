//! The delta: changed items waiting for commit (btrfs's delayed items, bcachefs's key cache).
//!
//! Owns: an in-memory ordered map from key to new value or tombstone, sharded by object id so
//! that work on different inodes takes different locks. All items of one object live in one
//! shard, so a range scan of an inode or directory takes one lock.
//!
//! Must not touch: the tree or the device. The engine freezes the running delta at commit
//! (generation N) while a new one collects generation N+1; a frozen delta ([`FrozenDelta`])
//! never changes, so it has no locks. The
//! fsync log (later) reads an inode's items here, so it can log them without a commit.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use birch_format::Key;
use parking_lot::Mutex;

use crate::counters::CachePadded;

/// A value in the delta: new bytes, or `None` for a deletion.
pub type DeltaValue = Option<Arc<[u8]>>;

const SHARDS: usize = 64;

/// Leaf bytes of an item besides its value: the key (17 bytes) and the offset and size the
/// leaf keeps for it (FORMAT.md §5).
const ITEM_OVERHEAD: usize = 25;

/// Changed items of one generation.
pub struct Delta {
    /// Each shard on its own cache lines with its entry count beside it: a put writes only its
    /// own shard's lines, never a line that another core's puts write (false sharing; see
    /// DESIGN §8).
    shards: Box<[CachePadded<Shard>]>,
}

#[derive(Default)]
struct Shard {
    map: Mutex<Map>,
    /// Keys in `map`, written under its lock, readable without it.
    entries: AtomicUsize,
    /// Bytes of keys and values put since the last freeze (a replaced value counts again:
    /// an upper bound, for [`Delta::bytes`]).
    bytes: AtomicUsize,
}

impl Default for Delta {
    fn default() -> Self {
        Delta {
            shards: (0..SHARDS).map(|_| CachePadded(Shard::default())).collect(),
        }
    }
}

fn shard_of(objectid: u64) -> usize {
    batch_shard(objectid, SHARDS)
}

/// The shard (of `shards`, at most 64) of object `objectid` in maps sharded by object id.
/// A thread takes object ids in batches of 64 (`Engine::allocate_objectid`): a batch shares a
/// shard, so one thread's new inodes stay in one warm map and two threads' new inodes meet
/// in one shard only by the hash, which spreads the batches. A directory has a batch of its
/// own (`Engine::allocate_objectid_alone`), so two directories that threads fill at once
/// (their entries are items of the directory's object) do not share a shard by birth.
pub(crate) fn batch_shard(objectid: u64, shards: usize) -> usize {
    let batch = objectid >> crate::ids::OBJECTID_BATCH.trailing_zeros();
    (batch.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58) as usize % shards
}

type Map = BTreeMap<Key, DeltaValue>;

fn map_range(map: &Map, lo: &Key, hi: &Key) -> Vec<(Key, DeltaValue)> {
    if lo >= hi {
        return Vec::new();
    }
    map.range((Bound::Included(*lo), Bound::Excluded(*hi)))
        .map(|(k, v)| (*k, v.clone()))
        .collect()
}

fn map_range_limited(
    map: &Map,
    lo: &Key,
    hi: &Key,
    limit: usize,
) -> (Vec<(Key, DeltaValue)>, bool) {
    if lo >= hi {
        return (Vec::new(), false);
    }
    let mut iter = map.range((Bound::Included(*lo), Bound::Excluded(*hi)));
    let out: Vec<(Key, DeltaValue)> = iter
        .by_ref()
        .take(limit)
        .map(|(k, v)| (*k, v.clone()))
        .collect();
    let more = iter.next().is_some();
    (out, more)
}

fn map_last_in(map: &Map, floor: &Key, key: &Key) -> Option<(Key, DeltaValue)> {
    if floor > key {
        return None;
    }
    map.range((Bound::Included(*floor), Bound::Included(*key)))
        .next_back()
        .map(|(k, v)| (*k, v.clone()))
}

impl Delta {
    /// The delta's entry for `key`: `Some(None)` is a deletion, `None` means unchanged.
    pub fn get(&self, key: &Key) -> Option<DeltaValue> {
        self.shards[shard_of(key.objectid)]
            .map
            .lock()
            .get(key)
            .cloned()
    }

    /// Records a new value or a deletion.
    pub fn put(&self, key: Key, value: DeltaValue) {
        let shard = &self.shards[shard_of(key.objectid)];
        let bytes = ITEM_OVERHEAD + value.as_ref().map_or(0, |v| v.len());
        if shard.map.lock().insert(key, value).is_none() {
            shard.entries.fetch_add(1, Ordering::Relaxed);
        }
        shard.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Entries in `[lo, hi)`. Both keys must have the same object id (one shard).
    pub fn range(&self, lo: &Key, hi: &Key) -> Vec<(Key, DeltaValue)> {
        debug_assert!(
            lo.objectid == hi.objectid
                || hi.objectid == lo.objectid + 1 && hi.item_type == 0 && hi.offset == 0
        );
        map_range(&self.shards[shard_of(lo.objectid)].map.lock(), lo, hi)
    }

    /// At most `limit` entries in `[lo, hi)` (deletions included) of one object id, and
    /// whether more remain.
    pub fn range_limited(
        &self,
        lo: &Key,
        hi: &Key,
        limit: usize,
    ) -> (Vec<(Key, DeltaValue)>, bool) {
        map_range_limited(
            &self.shards[shard_of(lo.objectid)].map.lock(),
            lo,
            hi,
            limit,
        )
    }

    /// The entry (a value or a deletion) with the greatest key in `[floor, key]`. Both keys
    /// must have the same object id (one shard).
    pub fn last_in(&self, floor: &Key, key: &Key) -> Option<(Key, DeltaValue)> {
        map_last_in(&self.shards[shard_of(key.objectid)].map.lock(), floor, key)
    }

    /// Number of entries: exact when no `put` runs at the same time; a load per shard and no
    /// lock in any case.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.entries.load(Ordering::Relaxed))
            .sum()
    }

    /// Whether there are no entries (as exact as [`Delta::len`]).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the entries take in leaves, item headers included: at least what the next
    /// commit adds to the tree (a replaced value counts twice). A load per shard, no lock.
    pub fn bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.bytes.load(Ordering::Relaxed))
            .sum()
    }

    /// Moves every entry out into a frozen delta (the freeze at commit). The caller must keep
    /// `put` out while this runs (the engine holds its gate exclusively), or the entry count
    /// drifts.
    pub fn take(&self) -> FrozenDelta {
        let mut bytes = 0;
        let shards: Vec<Map> = self
            .shards
            .iter()
            .map(|s| {
                let mut map = s.map.lock();
                s.entries.store(0, Ordering::Relaxed);
                bytes += s.bytes.swap(0, Ordering::Relaxed);
                std::mem::take(&mut *map)
            })
            .collect();
        FrozenDelta { shards, bytes }
    }
}

/// A delta after the freeze: the same maps, never changed again, so readers and the commit
/// read them with no lock at all.
pub struct FrozenDelta {
    shards: Vec<Map>,
    /// [`Delta::bytes`] at the freeze.
    bytes: usize,
}

impl FrozenDelta {
    /// [`Delta::bytes`] at the freeze.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The entry for `key`: `Some(None)` is a deletion, `None` means unchanged.
    pub fn get(&self, key: &Key) -> Option<DeltaValue> {
        self.shards[shard_of(key.objectid)].get(key).cloned()
    }

    /// Entries in `[lo, hi)` of one object id.
    pub fn range(&self, lo: &Key, hi: &Key) -> Vec<(Key, DeltaValue)> {
        map_range(&self.shards[shard_of(lo.objectid)], lo, hi)
    }

    /// At most `limit` entries in `[lo, hi)` of one object id, and whether more remain.
    pub fn range_limited(
        &self,
        lo: &Key,
        hi: &Key,
        limit: usize,
    ) -> (Vec<(Key, DeltaValue)>, bool) {
        map_range_limited(&self.shards[shard_of(lo.objectid)], lo, hi, limit)
    }

    /// The entry with the greatest key in `[floor, key]` (one object id).
    pub fn last_in(&self, floor: &Key, key: &Key) -> Option<(Key, DeltaValue)> {
        map_last_in(&self.shards[shard_of(key.objectid)], floor, key)
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.len()).sum()
    }

    /// Every `step`-th key of each shard, sorted: a sample in which each key stands for about
    /// `step` entries (plans a parallel apply without sorting everything first).
    pub fn sample(&self, step: usize) -> Vec<Key> {
        let mut out: Vec<Key> = Vec::with_capacity(self.len() / step.max(1) + SHARDS);
        for shard in &self.shards {
            out.extend(shard.keys().step_by(step.max(1)).copied());
        }
        out.sort_unstable();
        out
    }

    /// The entries with `lo <= key < hi` (`hi` None: no upper bound), sorted, values borrowed.
    pub fn sorted_range(&self, lo: &Key, hi: Option<&Key>) -> Vec<(Key, Option<&[u8]>)> {
        let upper = match hi {
            Some(h) if h <= lo => return Vec::new(),
            Some(h) => Bound::Excluded(*h),
            None => Bound::Unbounded,
        };
        let mut out: Vec<(Key, Option<&[u8]>)> = Vec::new();
        for shard in &self.shards {
            out.extend(
                shard
                    .range((Bound::Included(*lo), upper))
                    .map(|(k, v)| (*k, v.as_deref())),
            );
        }
        out.sort_unstable_by_key(|e| e.0);
        out
    }

    /// Every entry in key order, borrowed (`None` deletes): what a commit applies. The
    /// shards are sorted runs, which the stable sort merges.
    pub fn sorted(&self) -> Vec<(Key, Option<&[u8]>)> {
        let mut out: Vec<(Key, Option<&[u8]>)> = Vec::with_capacity(self.len());
        for shard in &self.shards {
            out.extend(shard.iter().map(|(k, v)| (*k, v.as_deref())));
        }
        out.sort_by_key(|e| e.0);
        out
    }
}

/// Overlays delta entries (newer first in `layers`) on tree items, in key order.
pub fn merge_layers(
    tree: Vec<(Key, Vec<u8>)>,
    layers: &[Vec<(Key, DeltaValue)>],
) -> Vec<(Key, Arc<[u8]>)> {
    // One pass over the sorted sources (no map): at each step the smallest key at the head of
    // any source, its value from the newest layer that holds it, else from the tree. A tree
    // value a layer overrides is never copied.
    let mut out = Vec::with_capacity(tree.len() + layers.iter().map(Vec::len).sum::<usize>());
    let mut tree = tree.into_iter().peekable();
    let mut pos = vec![0usize; layers.len()];
    loop {
        let mut next = tree.peek().map(|(k, _)| *k);
        for (layer, &p) in layers.iter().zip(&pos) {
            if let Some((k, _)) = layer.get(p) {
                if next.is_none_or(|n| *k < n) {
                    next = Some(*k);
                }
            }
        }
        let Some(key) = next else {
            break;
        };
        let mut newest: Option<&DeltaValue> = None;
        for (layer, p) in layers.iter().zip(pos.iter_mut()) {
            if let Some((k, v)) = layer.get(*p) {
                if *k == key {
                    newest = newest.or(Some(v));
                    *p += 1;
                }
            }
        }
        let in_tree = match tree.peek() {
            Some((k, _)) if *k == key => tree.next().map(|(_, v)| v),
            _ => None,
        };
        match (newest, in_tree) {
            (Some(Some(v)), _) => out.push((key, v.clone())),
            // Deleted in a delta: hidden, whatever the tree holds.
            (Some(None), _) => {}
            (None, Some(v)) => out.push((key, Arc::from(v))),
            (None, None) => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use birch_format::ItemType;

    #[test]
    fn newer_layers_win_and_tombstones_hide() {
        let k = |o| Key::new(o, ItemType::InodeItem, 0);
        let tree = vec![(k(1), vec![1]), (k(2), vec![2]), (k(3), vec![3])];
        let frozen = vec![(k(2), None), (k(4), Some(Arc::from(vec![4u8])))];
        let active = vec![(k(2), Some(Arc::from(vec![22u8]))), (k(3), None)];
        let out = merge_layers(tree, &[active, frozen]);
        let keys: Vec<(u64, u8)> = out.iter().map(|(k, v)| (k.objectid, v[0])).collect();
        assert_eq!(keys, vec![(1, 1), (2, 22), (4, 4)]);
    }

    /// The one-pass merge against the obvious one (a map the tree fills and each layer,
    /// oldest first, overwrites), over random sorted sources with shared keys and deletions.
    #[test]
    fn the_one_pass_merge_matches_a_map_merge() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(17);
        let k = |o| Key::new(9, ItemType::DirIndex, o);
        for _ in 0..500 {
            let mut pick = |n: u64| -> Vec<u64> {
                let mut v: Vec<u64> = (0..n).filter(|_| rng.gen_bool(0.4)).collect();
                v.dedup();
                v
            };
            let tree: Vec<(Key, Vec<u8>)> = pick(40)
                .into_iter()
                .map(|o| (k(o), vec![o as u8]))
                .collect();
            let mut layers = Vec::new();
            for layer in 0..2u8 {
                let keys = pick(40);
                layers.push(
                    keys.into_iter()
                        .map(|o| {
                            let value = (o % 3 != 0).then(|| Arc::from(vec![o as u8, layer + 1]));
                            (k(o), value)
                        })
                        .collect::<Vec<(Key, DeltaValue)>>(),
                );
            }
            let mut reference: BTreeMap<Key, DeltaValue> = tree
                .iter()
                .map(|(k, v)| (*k, Some(Arc::from(v.clone()))))
                .collect();
            for layer in layers.iter().rev() {
                for (k, v) in layer {
                    reference.insert(*k, v.clone());
                }
            }
            let expected: Vec<(Key, Arc<[u8]>)> = reference
                .into_iter()
                .filter_map(|(k, v)| v.map(|v| (k, v)))
                .collect();
            assert_eq!(merge_layers(tree, &layers), expected);
        }
    }

    #[test]
    fn last_in_sees_deletions_and_stays_in_bounds() {
        let k = |o| Key::new(7, ItemType::ExtentData, o);
        let d = Delta::default();
        d.put(k(10), Some(Arc::from(vec![1u8])));
        d.put(k(20), None);
        assert_eq!(
            d.last_in(&k(0), &k(25)).map(|e| (e.0, e.1.is_some())),
            Some((k(20), false))
        );
        assert_eq!(d.last_in(&k(0), &k(19)).map(|e| e.0), Some(k(10)));
        assert_eq!(d.last_in(&k(11), &k(19)), None);
        assert_eq!(d.last_in(&k(30), &k(19)), None);
    }

    #[test]
    fn len_counts_keys_not_puts_and_moves_with_take() {
        let k = |o| Key::new(o, ItemType::InodeItem, 0);
        let d = Delta::default();
        d.put(k(1), None);
        d.put(k(1), Some(Arc::from(vec![1u8])));
        d.put(k(70), None);
        assert_eq!(d.len(), 2);
        let frozen = d.take();
        assert_eq!((d.len(), frozen.len()), (0, 2));
        let keys: Vec<u64> = frozen.sorted().iter().map(|e| e.0.objectid).collect();
        assert_eq!(keys, vec![1, 70]);
        assert_eq!(frozen.last_in(&k(0), &k(80)).map(|e| e.0), Some(k(70)));
        assert!(d.is_empty());
        d.put(k(1), None);
        assert_eq!(d.len(), 1);
    }
}
