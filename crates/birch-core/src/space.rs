//! Where a filesystem's blocks go (`birch inspect IMAGE space`, DESIGN §15.8): the reserved
//! areas, the live tree's nodes and data (and of that data what clones share), what only
//! snapshots hold, and the free space as statfs counts it.
//!
//! Owns: the walk that sorts the used blocks into those categories ([`Engine::space_report`])
//! and the arithmetic on block ranges it needs. The live committed tree is walked whole (each
//! data block counted once however many extents name it), then every snapshot's tree newest
//! first with the subtrees it shares with trees walked before skipped, as the open does.
//!
//! Must not touch: anything that writes, the allocator's state (read only for the free
//! figures), the deletion walk (the per-snapshot figures come from
//! [`Engine::snapshot_space`], the same walk a deletion runs).

use std::collections::HashMap;

use birch_format::superblock::RESERVED_HEAD_BYTES;
use birch_format::{FormatError, BLOCK_SIZE, NODE_BLOCKS};

use crate::btree::walk::walk_tree;
use crate::error::{Error, Result};
use crate::snapshot::{self, Snapshot};
use crate::txn::Engine;

/// One snapshot's line of a [`SpaceReport`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotSpace {
    /// The snapshot (id, name, generation).
    pub snapshot: Snapshot,
    /// Blocks only it holds: what deleting it alone gives back ([`Engine::snapshot_space`]).
    /// Blocks two snapshots share (and the live tree does not name) are in neither's figure.
    pub only_blocks: u64,
}

/// Where the blocks of a filesystem go, in blocks of [`SpaceReport::block_size`] bytes.
///
/// `reserved + tree_nodes + list_nodes + data + snapshots_only + unnamed + free = device`
/// ([`SpaceReport::used`] is everything but `free`). The figures are exact on an engine no
/// one changes meanwhile (a read-only open, or after a sync with nothing buffered); a commit
/// running during the walk shows up in `unnamed`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpaceReport {
    /// Bytes per block.
    pub block_size: u64,
    /// Blocks in the device.
    pub device: u64,
    /// The head (superblocks) and the fsync log area: used, named by no tree.
    pub reserved: u64,
    /// Nodes of the live fs tree (the last committed one).
    pub tree_nodes: u64,
    /// Nodes of the snapshot list tree (0 without snapshots).
    pub list_nodes: u64,
    /// Data blocks the live tree names, each once however many extents name it.
    pub data: u64,
    /// Of `data`: blocks more than one extent of the live tree names (clones by
    /// `copy_file_range`). On a quiet engine the allocator's shared counts say the same
    /// (`Allocator::shared_blocks`, the `shared_bytes` gauge of the stats).
    pub shared: u64,
    /// Blocks of the snapshots' trees (nodes and data) the live tree and the list do not
    /// name: what deleting every snapshot would give back. Includes blocks several snapshots
    /// share, which no single snapshot's figure in `snapshots` counts.
    pub snapshots_only: u64,
    /// Each snapshot, oldest first, with the blocks only it holds.
    pub snapshots: Vec<SnapshotSpace>,
    /// Used blocks no tree names: on a running engine, data written since the last commit
    /// or a leak the next open frees; 0 on a quiet, healthy engine and right after an open
    /// (which derives the used blocks from the trees; a pending fsync log replayed by a
    /// read-only open is in the live tree it reports).
    pub unnamed: u64,
    /// Free blocks as statfs counts them (`bfree`: pinned blocks count as free).
    pub free: u64,
    /// Of `free`: what data may take (statfs `bavail`; the rest is the metadata reserve).
    pub available: u64,
}

impl SpaceReport {
    /// Used blocks: the device less `free`.
    pub fn used(&self) -> u64 {
        self.device.saturating_sub(self.free)
    }

    /// Blocks some tree or reserved area names: every used category but `unnamed`. Above
    /// [`SpaceReport::used`] only when the allocator counts as free a block a tree names
    /// (damage, or the report raced a commit); then the lines do not add up.
    pub fn named(&self) -> u64 {
        self.reserved + self.tree_nodes + self.list_nodes + self.data + self.snapshots_only
    }
}

/// The blocks of an extent at byte `disk` of `blocks` blocks as (first block, blocks), cut
/// to a device of `device` blocks (an open refuses extents outside the device; this only
/// keeps the arithmetic below from overflowing on one).
fn inside(disk: u64, blocks: u64, device: u64) -> (u64, u64) {
    let first = (disk / BLOCK_SIZE).min(device);
    (first, blocks.min(device - first))
}

/// The number of blocks `ranges` (first block, blocks) cover at least once and at least
/// twice.
fn coverage(ranges: &[(u64, u64)]) -> (u64, u64) {
    let mut events: Vec<(u64, i64)> = Vec::with_capacity(ranges.len() * 2);
    for &(first, blocks) in ranges {
        if blocks > 0 {
            events.push((first, 1));
            events.push((first + blocks, -1));
        }
    }
    events.sort_unstable();
    let (mut once, mut twice, mut depth, mut at) = (0u64, 0u64, 0i64, 0u64);
    for (block, step) in events {
        let len = block - at;
        if depth >= 1 {
            once += len;
        }
        if depth >= 2 {
            twice += len;
        }
        depth += step;
        at = block;
    }
    (once, twice)
}

/// `ranges` (first block, blocks) as sorted, disjoint, non-adjacent runs.
fn merged(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.retain(|r| r.1 > 0);
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (first, blocks) in ranges {
        match out.last_mut() {
            Some((start, len)) if first <= *start + *len => {
                *len = (*len).max(first + blocks - *start);
            }
            _ => out.push((first, blocks)),
        }
    }
    out
}

/// Blocks of the runs `a` that the runs `b` do not cover (both from [`merged`]).
fn outside(a: &[(u64, u64)], b: &[(u64, u64)]) -> u64 {
    let mut count = 0;
    let mut j = 0;
    for &(first, blocks) in a {
        let end = first + blocks;
        let mut at = first;
        while j < b.len() && b[j].0 + b[j].1 <= at {
            j += 1;
        }
        let mut k = j;
        while at < end {
            match b.get(k) {
                Some(&(bf, bn)) if bf < end => {
                    if bf > at {
                        count += bf - at;
                    }
                    at = at.max(bf + bn);
                    k += 1;
                }
                _ => {
                    count += end - at;
                    at = end;
                }
            }
        }
    }
    count
}

impl Engine {
    /// Where the blocks go (`birch inspect IMAGE space`): the reserved areas, the live
    /// committed tree's nodes and data (of which what clones share), the snapshot list's
    /// nodes, what the snapshots' trees hold beyond the live tree (in total, and only each
    /// one, from [`Engine::snapshot_space`]), used blocks no tree names, and the free space
    /// as statfs counts it; see [`SpaceReport`] for how they add up. Reads every node of
    /// the live tree and every node of the snapshots' trees that it does not share, as the
    /// open does; the committed root is held meanwhile. Errors: a node or extent that does
    /// not read or decode.
    pub fn space_report(&self) -> Result<SpaceReport> {
        let committed = self.committed_root();
        let sb = self.superblock();
        let device = self.allocator().total_blocks().get();
        let ctx = self.ctx();
        let mut seen: HashMap<u64, u64> = HashMap::new();
        let mut live: Vec<(u64, u64)> = Vec::new();
        walk_tree(
            ctx,
            committed.root,
            |addr, generation| {
                seen.insert(addr, generation);
                Ok(true)
            },
            |key, extent, node| {
                let extent = extent
                    .map_err(|e| Error::corrupt(format!("extent {key} in node {node:#x}"), e))?;
                if let Some((disk, blocks)) = extent.disk_range() {
                    live.push(inside(disk, blocks, device));
                }
                Ok(())
            },
        )?;
        let tree_nodes = seen.len() as u64 * NODE_BLOCKS;
        let (data, shared) = coverage(&live);
        let live = merged(live);

        let (list, list_addrs) = snapshot::read_list(ctx, sb.snapshots)?;
        let list_nodes = list_addrs.len() as u64 * NODE_BLOCKS;
        let mut snapshot_nodes = 0u64;
        let mut held: Vec<(u64, u64)> = Vec::new();
        for s in list.iter().rev() {
            walk_tree(
                ctx,
                s.root,
                |addr, generation| match seen.get(&addr) {
                    Some(g) if *g == generation => Ok(false),
                    Some(g) => Err(Error::corrupt(
                        format!("snapshot {:?} (id {})", s.name, s.id),
                        FormatError::invalid(
                            format!("node {addr:#x}"),
                            format!("generation {generation}"),
                            format!("generation {g} as another tree has it"),
                        ),
                    )),
                    None => {
                        seen.insert(addr, generation);
                        snapshot_nodes += NODE_BLOCKS;
                        Ok(true)
                    }
                },
                |key, extent, node| {
                    let extent = extent.map_err(|e| {
                        Error::corrupt(
                            format!("snapshot {:?}: extent {key} in node {node:#x}", s.name),
                            e,
                        )
                    })?;
                    if let Some((disk, blocks)) = extent.disk_range() {
                        held.push(inside(disk, blocks, device));
                    }
                    Ok(())
                },
            )?;
        }
        let snapshots_only = snapshot_nodes + outside(&merged(held), &live);
        let snapshots = self
            .snapshot_space()?
            .into_iter()
            .map(|(snapshot, bytes)| SnapshotSpace {
                snapshot,
                only_blocks: bytes / BLOCK_SIZE,
            })
            .collect();
        drop(committed);

        let alloc = self.allocator();
        let reserved = RESERVED_HEAD_BYTES / BLOCK_SIZE + sb.log_bytes / BLOCK_SIZE;
        let free = alloc.statfs_free_blocks().get().min(device);
        let mut report = SpaceReport {
            block_size: BLOCK_SIZE,
            device,
            reserved,
            tree_nodes,
            list_nodes,
            data,
            shared,
            snapshots_only,
            snapshots,
            unnamed: 0,
            free,
            available: alloc.statfs_available_blocks().get().min(free),
        };
        report.unnamed = report.used().saturating_sub(report.named());
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coverage_counts_blocks_once_and_twice() {
        assert_eq!(coverage(&[]), (0, 0));
        assert_eq!(coverage(&[(10, 5)]), (5, 0));
        assert_eq!(coverage(&[(10, 5), (12, 5)]), (7, 3));
        assert_eq!(coverage(&[(10, 5), (10, 5), (10, 5)]), (5, 5));
        assert_eq!(coverage(&[(10, 5), (15, 5)]), (10, 0));
        assert_eq!(coverage(&[(0, 2), (20, 4), (1, 0)]), (6, 0));
    }

    #[test]
    fn outside_counts_what_the_other_runs_miss() {
        let b = merged(vec![(10, 5), (20, 5), (12, 1)]);
        assert_eq!(b, vec![(10, 5), (20, 5)]);
        assert_eq!(outside(&merged(vec![(0, 30)]), &b), 20);
        assert_eq!(outside(&merged(vec![(11, 2), (21, 10)]), &b), 6);
        assert_eq!(outside(&merged(vec![(15, 5)]), &b), 5);
        assert_eq!(outside(&[], &b), 0);
        assert_eq!(outside(&merged(vec![(3, 4)]), &[]), 4);
        assert_eq!(merged(vec![(1, 2), (3, 2)]), vec![(1, 4)]);
    }
}
