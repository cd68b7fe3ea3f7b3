//! Making and opening an image: mkfs ([`Engine::create`]), the superblock reads and writes,
//! [`OpenHead`], the open (assembling the engine, the allocator rebuilt from the live tree, the
//! snapshot trees and the backup trees it must keep), and the superblock helpers repair
//! shares (`older_roots`, `mark_reserved_areas`).
//!
//! Must not touch: the running delta, the commit order, the snapshot policy (it only loads the
//! durable list), the fsync log's batches (it only hands the replay read at open to the engine).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use birch_format::superblock::{
    BackupRoot, RootPtr, Superblock, COMPAT_BACKUP_ROOTS, INCOMPAT_LOG_ALIGNED, INCOMPAT_SNAPSHOTS,
    RESERVED_HEAD_BYTES, SUPER_BYTES, SUPER_OFFSETS,
};
use birch_format::{
    BlockAddr, BlockCount, FormatError, Generation, Key, Lsn, FIRST_FREE_OBJECTID, FORMAT_VERSION,
    FS_TREE_ID, NODE_BLOCKS, NODE_SIZE,
};
use parking_lot::Mutex;

use crate::striped::Striped;

use crate::alloc::Allocator;
use crate::btree::walk::walk_tree;
use crate::btree::{TreeCtx, TreeWriter};
use crate::cache::NodeCache;
use crate::counters::{Counters, LatencyHistogram};
use crate::delta::Delta;
use crate::device::{BlockDevice, Fence};
use crate::error::{Error, Result};
use crate::log::{read_log, FsyncLog, Replay};
use crate::snapshot::{self, Snapshot, SnapshotOp};

use super::commit::CommitQueue;
use super::objectid::ObjectIds;
use super::read::{CommittedRootPin, ReadState, ReleaseOnDrop};
use super::snapshots::SnapshotState;
use super::{now, CommittedRoot, Engine, ReadOnlyState};

/// Options of a new image.
#[derive(Debug, Clone, Default)]
pub struct MkfsOptions {
    /// Volume label, stored in the superblock; at most 63 bytes are kept, longer ones are cut.
    pub label: String,
    /// Bytes of the fsync log area; 0 picks 1/64 of the device, between 4 and 128 MiB.
    pub log_bytes: u64,
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

    /// Whether the log holds records ([`super::LogHandle::replay_pending`] of the engine this
    /// opens).
    pub fn log_pending(&self) -> bool {
        !self.replay.records.is_empty()
    }
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

impl Engine {
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
            device_stats: Default::default(),
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
            let mut writer = TreeWriter::create(ctx, &alloc, Generation::new(1))?;
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

    /// The engine over `superblock` (whose fsid it takes) and the tree at `root`.
    fn assemble(
        device: Arc<dyn BlockDevice>,
        alloc: Arc<Allocator>,
        superblock: Superblock,
        root: RootPtr,
        counters: Counters,
        cache: NodeCache,
        replay: Option<Replay>,
    ) -> Arc<Engine> {
        let fsid = superblock.fsid;
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
            commits: CommitQueue::new(),
            ids: ObjectIds::new(superblock.next_objectid),
            device_stats_base: Mutex::new((superblock.device_stats, Default::default())),
            superblock_changed: std::sync::atomic::AtomicBool::new(false),
            superblock: Mutex::new(superblock),
            // A device with an atomic unit (RBD) asks for the flag that lets log batches start
            // at its boundaries; the first commit of a writable mount sets it.
            incompat_wanted: AtomicU64::new(if device_unit != 0 {
                INCOMPAT_LOG_ALIGNED
            } else {
                0
            }),
            read_only: ReadOnlyState::new(),
            log,
            blobs: crate::data::BlobCache::default(),
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

    pub(super) fn write_superblock(&self, sb: &Superblock) -> Result<()> {
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

    /// [`Engine::open`] from what `OpenHead::read` already read of `device` (the same
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
        let root = superblock.fs_root;
        let engine = Engine::assemble(
            device,
            alloc,
            superblock,
            root,
            Counters::default(),
            NodeCache::new(65536),
            Some(replay),
        );
        let mut seen = HashMap::new();
        let for_repair = bad_extents.is_some();
        engine.rebuild_allocator(&mut seen, bad_extents)?;
        engine.keep_snapshot_trees(&mut seen, for_repair)?;
        engine.keep_backup_trees(&mut seen);
        Ok(engine)
    }

    /// The snapshot list and every snapshot's tree (DESIGN §15.4): the list's nodes and each
    /// snapshot's nodes and blocks that the live tree does not hold are marked used, and the
    /// allocator learns each snapshot, so that frees of the blocks they hold keep them. A
    /// list or a snapshot tree that does not read whole fails the open, naming it.
    ///
    /// A snapshot whose tree is newer than the live tree ([`snapshot::outside_lineage`], left
    /// by a fallback to an older tree) is not a past state of it, and the deletion walk's
    /// reasoning does not hold for it: deleting it, or a neighbour, could free blocks the live
    /// tree uses. For a mount it is kept (its blocks stay used) and every snapshot change is
    /// refused until `fsck --repair`; for the repair (`for_repair`) it is forgotten: not
    /// marked, not held, and dropped from the list by the next commit, which gives back
    /// nothing (the next open derives the free space without it). The repair forgets a
    /// snapshot whose tree does not read whole the same way, where a mount's open fails.
    fn keep_snapshot_trees(&self, seen: &mut HashMap<u64, u64>, for_repair: bool) -> Result<()> {
        let sb = self.superblock.lock().clone();
        if sb.incompat & INCOMPAT_SNAPSHOTS == 0 || sb.snapshots.addr == 0 {
            return Ok(());
        }
        let (mut list, nodes) = snapshot::read_list(self.ctx(), sb.snapshots)
            .map_err(|e| Error::Invalid(format!("open: snapshot list: {e} (run fsck)")))?;
        let mut outside: Vec<Snapshot> = list
            .iter()
            .filter(|s| snapshot::outside_lineage(s, sb.fs_root))
            .cloned()
            .collect();
        if for_repair {
            list.retain(|s| !outside.contains(s));
        }
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
        if for_repair {
            // Newest first, as one walk of the whole list goes. A tree that does not read
            // whole is forgotten too: what it alone held becomes free (a walk cut short may
            // leave some of it used until the next open: a leak, never damage).
            let mut whole = Vec::with_capacity(list.len());
            for s in list.into_iter().rev() {
                match snapshot::mark_snapshot_trees(
                    self.ctx(),
                    &self.alloc,
                    std::slice::from_ref(&s),
                    seen,
                ) {
                    Ok(()) => whole.push(s),
                    Err(e) => {
                        log::warn!(
                            "repair: snapshot {:?} (id {}) does not read whole: {e}",
                            s.name,
                            s.id
                        );
                        outside.push(s);
                    }
                }
            }
            whole.reverse();
            list = whole;
        } else {
            snapshot::mark_snapshot_trees(self.ctx(), &self.alloc, &list, seen)?;
        }
        for s in &list {
            self.alloc.add_hold(Generation::new(s.generation));
        }
        let mut state = self.snapshots.lock();
        state.list = list;
        if for_repair {
            // A deletion of an id no longer in the list rewrites the list and gives back
            // nothing: what a forgotten snapshot needs (its blocks were never marked).
            state
                .pending
                .extend(outside.iter().map(|s| SnapshotOp::Delete { id: s.id }));
            state.forgotten = outside;
        } else {
            for s in &outside {
                log::warn!(
                    "open: snapshot {:?} (id {}, generation {}) is newer than the live tree: \
                     snapshot changes are refused until birch fsck --repair deletes it",
                    s.name,
                    s.id,
                    s.generation
                );
            }
            state.outside_lineage = outside;
        }
        Ok(())
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
        walk_tree(
            self.ctx(),
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
        walk_tree(
            self.ctx(),
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
}
