//! `fsck --repair`: fixes what [`crate::check`] finds, through the engine's own commits.
//!
//! Owns: the order of a repair (DESIGN §13.4): replay a pending log, or fall back to the
//! newest backup root whose tree is whole when the newest tree is not; then recompute names,
//! link counts, directory sizes and orphans from the raw items and write the differences in
//! one transaction; then check again. Preen ([`RepairMode::Preen`]) writes only what loses
//! nothing; a dry run ([`RepairMode::DryRun`]) does everything on a memory overlay.
//!
//! Must not touch: committed state in place. Every change is a copy-on-write commit of the
//! engine (or, for the fallback, one superblock written to the slot the next commit would
//! use), so a crash mid-repair leaves the old state and the repair can run again. Repair edits
//! only the live fs tree (owner 5), the snapshot list and the superblock, never a snapshot's
//! tree: a damaged block a snapshot holds stays and is named (`--data` checks them too). Every
//! free goes through the engine's snapshot-aware allocator, so a block a snapshot holds is
//! never freed. A snapshot newer than the live tree (after a fallback to an older tree it is
//! not a past state of the live tree, DESIGN §15.4) is deleted from the list, freeing
//! nothing through the deletion walk: the next open derives the free space without it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use birch_format::items::{
    self, DirEntry, ExtentKind, FileExtent, InodeItem, InodeRef, Item, Timespec, Xattr, XattrChunk,
};
use birch_format::superblock::{
    BackupRoot, RootPtr, Superblock, INCOMPAT_XATTR_CHUNKS, SUPER_OFFSETS,
};
use birch_format::{
    BlockAddr, BlockCount, Generation, InodeNo, ItemType, Key, BLOCK_SIZE, INLINE_MAX_BYTES,
    ORPHAN_OBJECTID, ROOT_OBJECTID,
};

use birch_format::node::NodeBody;
use birch_format::{FS_TREE_ID, NODE_BLOCKS, NODE_SIZE};

use crate::alloc::Allocator;
use crate::btree::{TreeCtx, TreeWriter};
use crate::cache::NodeCache;
use crate::check::{check, check_with_root, CheckOptions, FindingKind, Report};
use crate::counters::Counters;
use crate::data::DataLayer;
use crate::device::{BlockDevice, OverlayDevice};
use crate::error::{Error, Result};
use crate::items::{
    dir_index_key, dir_item_key, inode_key, inode_key_range, inode_ref_key, orphan_key,
    xattr_chunk_key,
};
use crate::scrub::read_node;
use crate::txn::{older_roots, Engine, WriteTxn};

/// How much a repair may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepairMode {
    /// Everything §13.4 lists: fall back, drop dangling names and bad extents, reattach
    /// orphans to `/lost+found`, recompute counts (`--repair`, `-y`).
    Full,
    /// Only what loses no data or name: link counts, directory sizes, sizes raised to cover
    /// their extents, stale orphan items and the missing half of a name (`-p`, `-a`).
    Preen,
    /// [`RepairMode::Full`] on a copy-on-write overlay in memory: the image is not written
    /// (`-n`).
    DryRun,
}

/// What a repair did (or, in a dry run, would do).
#[derive(Debug, Default)]
pub struct RepairReport {
    /// The check before any change.
    pub before: Report,
    /// The check after the repair's commit; `None` when nothing was written.
    pub after: Option<Report>,
    /// Each change, in words, with the path it touched where there is one.
    pub actions: Vec<String>,
    /// What the mode did not allow or what could not be repaired, in words.
    pub refused: Vec<String>,
    /// Paths that lost data or a name (also among `actions`).
    pub lost: Vec<String>,
    /// The generation fallen back to, if any.
    pub fell_back_to: Option<u64>,
    /// Whether no older tree was whole and a new tree was salvaged from the readable leaves.
    pub salvaged: bool,
}

impl RepairReport {
    /// fsck(8) exit code: 0 clean before, 1 everything corrected, 4 errors left.
    /// A replayed log alone is not an error corrected (mount would have done the same).
    pub fn exit_code(&self) -> u8 {
        let after_clean = self.after.as_ref().is_none_or(|a| a.is_clean());
        if !self.refused.is_empty() || !after_clean {
            return 4;
        }
        if self.before.is_clean() {
            return 0;
        }
        if self.after.is_some() {
            1
        } else {
            4
        }
    }
}

/// Repairs the image on `device` (DESIGN §13.4). Errors only when the image cannot be read
/// or written at all; everything else is in the report.
pub fn repair(
    device: Arc<dyn BlockDevice>,
    mode: RepairMode,
    options: CheckOptions,
) -> Result<RepairReport> {
    let device: Arc<dyn BlockDevice> = match mode {
        RepairMode::DryRun => Arc::new(OverlayDevice::new(device)),
        _ => device,
    };
    let mut out = RepairReport {
        before: check(&*device, options)?,
        ..Default::default()
    };
    let structural = out.before.findings.iter().any(|f| f.kind.is_structural());
    let outside_lineage = out
        .before
        .findings
        .iter()
        .any(|f| f.kind == FindingKind::SnapshotOutsideLineage);
    if mode == RepairMode::Preen && outside_lineage {
        out.refused.push(
            "a snapshot is newer than the live tree: deleting it needs birch fsck --repair".into(),
        );
        return Ok(out);
    }
    let opens = !structural && Engine::open_for_repair(device.clone()).is_ok();
    // The data blocks that failed their check (with `--data`), in the tree being repaired.
    let mut bad_blocks = bad_data_blocks(&out.before);
    if !opens {
        if mode == RepairMode::Preen {
            out.refused
                .push("the newest tree is damaged: falling back needs birch fsck --repair".into());
            return Ok(out);
        }
        match fall_back(&device, options, &mut out)? {
            Some(chosen) => bad_blocks = bad_data_blocks(&chosen),
            None => {
                if !salvage(&device, &mut out)? {
                    return Ok(out);
                }
                if options.data {
                    bad_blocks = bad_data_blocks(&check(&*device, options)?);
                }
            }
        }
    } else if out.before.log_batches > 0 {
        if let Err(e) = replay_log(device.clone(), &mut out) {
            out.refused.push(format!("{e}"));
            return Ok(out);
        }
        if options.data {
            // The replay wrote data and extents the check before did not see.
            bad_blocks = bad_data_blocks(&check(&*device, options)?);
        }
    }
    let slot_bad = out
        .before
        .findings
        .iter()
        .any(|f| f.kind == FindingKind::SuperblockSlotBad);
    let (engine, bad_extents) = Engine::open_for_repair(device.clone())?;
    let damage = Damage {
        bad_extents: &bad_extents,
        bad_blocks: &bad_blocks,
        slot_bad,
    };
    let forgotten = forget_snapshots(&engine, &mut out);
    let wrote = fix_items(&engine, &damage, mode, &mut out)?;
    if forgotten {
        // The list's rewrite, if the item repairs had nothing to commit.
        engine.commit()?;
    }
    drop(engine);
    if wrote
        || forgotten
        || out.fell_back_to.is_some()
        || out.salvaged
        || out.before.log_batches > 0
    {
        out.after = Some(check(&*device, options)?);
    }
    report_snapshot_damage(&mut out);
    Ok(out)
}

/// Reports the snapshots the repair's open left out because their trees are newer than the
/// live tree (a fallback, this one or an earlier one, left them): the next commit deletes
/// them from the list. Returns whether there were any.
fn forget_snapshots(engine: &Engine, out: &mut RepairReport) -> bool {
    let forgotten = engine.forgotten_snapshots();
    for s in &forgotten {
        let what = format!(
            "snapshot {:?} (id {}, generation {}): deleted, its tree does not read whole or \
             is newer than the live tree (not a past state of it)",
            s.name, s.id, s.generation
        );
        out.lost.push(what.clone());
        out.actions.push(what);
    }
    !forgotten.is_empty()
}

/// Data blocks only snapshots hold that fail their check stay as they are (a snapshot is
/// read-only and repair never edits its tree): each is named, with what to do, and the
/// repair exits with errors left (4).
fn report_snapshot_damage(out: &mut RepairReport) {
    let last = out.after.as_ref().unwrap_or(&out.before);
    let left: Vec<String> = last
        .findings
        .iter()
        .filter(|f| {
            matches!(
                f.kind,
                FindingKind::DataChecksumMismatch | FindingKind::DataUnreadable
            ) && f.location.starts_with("snapshot ")
        })
        .map(|f| {
            format!(
                "{}: the data block at {:#x} {}; snapshots are read-only, so it stays (reads \
                 there answer EIO): birch scrub names the file, and deleting the snapshot \
                 drops the block",
                f.location,
                f.block.unwrap_or_default(),
                if f.kind == FindingKind::DataUnreadable {
                    "cannot be read"
                } else {
                    "fails its checksum"
                }
            )
        })
        .collect();
    out.refused.extend(left);
}

/// Replays a pending log by opening the filesystem (replay and its commit) and closing it.
fn replay_log(device: Arc<dyn BlockDevice>, out: &mut RepairReport) -> Result<()> {
    let fs = crate::Filesystem::open_device(
        device,
        crate::vfs::OpenOptions {
            commit_interval: None,
            ..Default::default()
        },
    )
    .map_err(|e| Error::Invalid(format!("repair: replaying the fsync log failed: {e}")))?;
    fs.close()?;
    out.actions.push(format!(
        "replayed {} log batches ({} records)",
        out.before.log_batches, out.before.log_records
    ));
    Ok(())
}

/// Finds the newest older root whose tree is whole and writes superblock N+1 naming it.
/// Returns the check of the chosen tree, or `None` (with the reason in `refused`) when no
/// tree is whole.
fn fall_back(
    device: &Arc<dyn BlockDevice>,
    options: CheckOptions,
    out: &mut RepairReport,
) -> Result<Option<Report>> {
    let (sb, _) = Engine::read_superblock(&**device)?;
    let mut chosen: Option<(BackupRoot, Report)> = None;
    for candidate in older_roots(&**device, &sb, false) {
        let report = check_with_root(&**device, Some(candidate.fs_root), options)?;
        let whole = !report.findings.iter().any(|f| f.kind.is_structural());
        out.actions.push(format!(
            "backup root of generation {} (node {:#x}): {}",
            candidate.generation,
            candidate.fs_root.addr,
            if whole {
                "whole".to_string()
            } else {
                format!("damaged ({} findings)", report.findings.len())
            }
        ));
        // Opened as the repair will open it: snapshots newer than the candidate, or whose
        // trees do not read whole, are left out (and deleted by the repair's commit).
        if whole && Engine::open_for_repair(trial_view(device, &sb, candidate.fs_root)?).is_ok() {
            chosen = Some((candidate, report));
            break;
        }
    }
    let Some((chosen, chosen_report)) = chosen else {
        out.actions.push(format!(
            "the tree of generation {} is damaged and no backup root is whole",
            sb.generation
        ));
        return Ok(None);
    };
    let replay = crate::log::read_log(&**device, &sb);
    let mut next = sb.clone();
    next.generation = sb.generation + 1;
    next.fs_root = chosen.fs_root;
    next.backup_roots = sb
        .backup_roots
        .iter()
        .copied()
        .filter(|b| b.generation < chosen.generation)
        .collect();
    next.log_head = replay.tail_lsn.get();
    next.log_generation = replay.next_seq;
    device
        .write_at(&next.encode(), SUPER_OFFSETS[next.slot()])
        .map_err(|e| Error::io(format!("repair: write superblock {}", next.generation), e))?;
    device
        .flush()
        .map_err(|e| Error::io("repair: flush superblock", e))?;
    let lost_commits = sb.generation - chosen.generation;
    out.fell_back_to = Some(chosen.generation);
    out.actions.push(format!(
        "fell back from generation {} to generation {} (superblock {} names it): the last {lost_commits} commits are lost",
        sb.generation, chosen.generation, next.generation
    ));
    out.lost.push(format!(
        "every change after generation {} ({lost_commits} commits)",
        chosen.generation
    ));
    let pending = replay
        .records
        .iter()
        .filter(|r| r.generation > sb.generation)
        .count();
    if pending > 0 {
        out.lost.push(format!(
            "{pending} fsync log records of the damaged generation"
        ));
    }
    Ok(Some(chosen_report))
}

/// The data blocks a check found bad (`--data`): address → why.
fn bad_data_blocks(report: &Report) -> BTreeMap<u64, &'static str> {
    report
        .findings
        .iter()
        .filter_map(|f| match (f.kind, f.block) {
            (FindingKind::DataChecksumMismatch, Some(at)) => Some((at, "fails its checksum")),
            (FindingKind::DataUnreadable, Some(at)) => Some((at, "cannot be read")),
            _ => None,
        })
        .collect()
}

/// What the item repairs are told besides the items: extents the open could not take,
/// data blocks that failed their check, and whether a superblock slot is bad.
struct Damage<'a> {
    bad_extents: &'a [Key],
    bad_blocks: &'a BTreeMap<u64, &'static str>,
    slot_bad: bool,
}

/// A copy-on-write view of `device` whose newest superblock names `root`: lets the
/// fallback try an engine open of a candidate before it writes anything.
fn trial_view(
    device: &Arc<dyn BlockDevice>,
    sb: &Superblock,
    root: RootPtr,
) -> Result<Arc<dyn BlockDevice>> {
    let overlay = OverlayDevice::new(device.clone());
    let mut trial = sb.clone();
    trial.fs_root = root;
    trial.backup_roots.clear();
    overlay
        .write_at(&trial.encode(), SUPER_OFFSETS[trial.slot()])
        .map_err(|e| Error::io("repair: trial superblock", e))?;
    Ok(Arc::new(overlay))
}

/// Everything the item repairs need, decoded once from the raw items.
#[derive(Default)]
struct Facts {
    inodes: BTreeMap<u64, InodeItem>,
    /// The inode items as the tree holds them, to write only those that changed.
    original: BTreeMap<u64, InodeItem>,
    /// (dir, name) → entry, from dir items and dir indexes together.
    entries: BTreeMap<(u64, Vec<u8>), DirEntry>,
    /// (dir, name) → which halves exist: (dir item, dir index).
    halves: HashMap<(u64, Vec<u8>), (bool, bool)>,
    /// ino → its refs.
    refs: BTreeMap<u64, Vec<InodeRef>>,
    orphans: BTreeSet<u64>,
    /// ino → (offset, extent).
    extents: BTreeMap<u64, Vec<(u64, FileExtent)>>,
    /// Object ids that have items.
    objects: BTreeSet<u64>,
    /// Items with an unknown type or a payload that does not decode, and why.
    undecodable: Vec<(Key, String)>,
    /// Xattr list items by key.
    xattrs: BTreeMap<Key, Vec<Xattr>>,
    /// Chunks of out-of-line xattr values by key.
    chunks: BTreeMap<Key, XattrChunk>,
}

fn gather(engine: &Engine) -> Result<Facts> {
    let mut facts = Facts::default();
    for (key, value) in engine.range(&Key::MIN, &Key::MAX, usize::MAX)? {
        let Some(kind) = key.kind() else {
            facts
                .undecodable
                .push((key, format!("unknown type code {}", key.item_type)));
            continue;
        };
        let item = match Item::decode(kind, &value) {
            Ok(Item::Snapshot(_)) => {
                facts
                    .undecodable
                    .push((key, "a snapshot item outside the snapshot list".to_string()));
                continue;
            }
            Ok(item) => item,
            Err(e) => {
                facts.undecodable.push((key, e.to_string()));
                continue;
            }
        };
        if key.objectid != ORPHAN_OBJECTID {
            facts.objects.insert(key.objectid);
        }
        match item {
            Item::Inode(inode) => {
                facts.original.insert(key.objectid, inode.clone());
                facts.inodes.insert(key.objectid, inode);
            }
            Item::InodeRefs(refs) => facts.refs.entry(key.objectid).or_default().extend(refs),
            Item::DirItem(list) => {
                for e in list {
                    let name = (key.objectid, e.name.clone());
                    facts.halves.entry(name.clone()).or_default().0 = true;
                    facts.entries.entry(name).or_insert(e);
                }
            }
            Item::DirIndex(e) => {
                let name = (key.objectid, e.name.clone());
                facts.halves.entry(name.clone()).or_default().1 = true;
                facts.entries.entry(name).or_insert(e);
            }
            Item::Extent(extent) => facts
                .extents
                .entry(key.objectid)
                .or_default()
                .push((key.offset, extent)),
            Item::Orphan => {
                facts.orphans.insert(key.offset);
            }
            Item::Snapshot(_) => {}
            Item::Xattrs(list) => {
                facts.xattrs.insert(key, list);
            }
            Item::XattrChunk(chunk) => {
                facts.chunks.insert(key, chunk);
            }
        }
    }
    Ok(facts)
}

/// Writes the three items of a new name of `ino` in `dir` (a directory repair made or found
/// without this name, so the entry's hash slots hold nothing else): the dir item, the dir index
/// and the inode ref. Returns the ref.
fn put_link(txn: &WriteTxn<'_>, dir: u64, ino: u64, entry: &DirEntry) -> InodeRef {
    let encoded = items::encode_dir_entries(std::slice::from_ref(entry));
    txn.put(
        dir_item_key(InodeNo::new(dir), &entry.name),
        encoded.clone(),
    );
    txn.put(dir_index_key(InodeNo::new(dir), entry.dir_index), encoded);
    let r = InodeRef {
        parent: dir,
        dir_index: entry.dir_index,
        name: entry.name.clone(),
    };
    txn.put(
        inode_ref_key(InodeNo::new(ino), InodeNo::new(dir), &entry.name),
        items::encode_inode_refs(std::slice::from_ref(&r)),
    );
    r
}

const DT_DIR: u8 = 4;
const LOST_AND_FOUND: &[u8] = b"lost+found";

fn is_dir(inode: &InodeItem) -> bool {
    inode.mode & libc::S_IFMT == libc::S_IFDIR
}

fn d_type(mode: u32) -> u8 {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => DT_DIR,
        libc::S_IFLNK => 10,
        libc::S_IFIFO => 1,
        libc::S_IFSOCK => 12,
        libc::S_IFCHR => 2,
        libc::S_IFBLK => 6,
        _ => 8,
    }
}

/// The path of `ino` from its first name, for reports ("/a/b"; "inode N" when unnamed).
fn path_of(facts: &Facts, ino: u64) -> String {
    let mut parts = Vec::new();
    let mut at = ino;
    for _ in 0..256 {
        if at == ROOT_OBJECTID {
            parts.reverse();
            return format!("/{}", parts.join("/"));
        }
        let Some(r) = facts.refs.get(&at).and_then(|refs| refs.first()) else {
            break;
        };
        parts.push(String::from_utf8_lossy(&r.name).into_owned());
        at = r.parent;
    }
    format!("inode {ino}")
}

/// Recomputes names, counts and orphans and writes the differences in one transaction and
/// one commit. Returns whether anything was written.
fn fix_items(
    engine: &Engine,
    damage: &Damage<'_>,
    mode: RepairMode,
    out: &mut RepairReport,
) -> Result<bool> {
    let full = mode != RepairMode::Preen;
    let mut facts = gather(engine)?;
    let txn = engine.begin()?;
    let mut changed = fix_undecodable(&txn, &facts, damage.bad_extents, full, out);
    changed |= make_root(&mut facts, full, out);

    // Extents on blocks that are not the file's to read: dropped, the range reads as a hole.
    for key in damage.bad_extents {
        let path = paths(&facts, key.objectid);
        if !full {
            out.refused.push(format!(
                "{path}: extent at {} points outside its blocks",
                key.offset
            ));
            continue;
        }
        txn.delete(*key);
        if let Some(list) = facts.extents.get_mut(&key.objectid) {
            list.retain(|(offset, _)| *offset != key.offset);
        }
        changed = true;
        let what = format!("{path}: dropped the extent at file offset {} (blocks outside the device, reserved or taken, or an undecodable extent)", key.offset);
        out.lost.push(what.clone());
        out.actions.push(what);
    }

    // Objects with items but no inode item: their items go.
    let strays: Vec<u64> = facts
        .objects
        .iter()
        .copied()
        .filter(|o| !facts.inodes.contains_key(o))
        .collect();
    for object in strays {
        if !full {
            out.refused
                .push(format!("object {object} has items but no inode"));
            continue;
        }
        let (lo, hi) = inode_key_range(InodeNo::new(object));
        for (key, _) in engine.range(&lo, &hi, usize::MAX)? {
            txn.delete(key);
        }
        facts.refs.remove(&object);
        facts.extents.remove(&object);
        changed = true;
        out.actions.push(format!(
            "object {object}: deleted its items (no inode item)"
        ));
    }

    changed |= fix_extents(engine, &txn, &mut facts, damage.bad_blocks, full, out)?;
    changed |= fix_xattrs(engine, &txn, &facts, full, out);
    changed |= fix_names(engine, &txn, &mut facts, full, out)?;
    changed |= fix_orphans(engine, &txn, &mut facts, full, out)?;
    changed |= fix_counts(&txn, &facts, out);
    if damage.slot_bad {
        // The bad slot is the one the next commit writes (the newest valid superblock is in
        // the other): a commit rewrites it, even one that changes nothing else.
        if !changed {
            if let Some(root) = facts.inodes.get(&ROOT_OBJECTID) {
                txn.put(inode_key(InodeNo::new(ROOT_OBJECTID)), root.encode());
                changed = true;
            }
        }
        out.actions
            .push("rewrote the bad superblock slot with the repair's commit".into());
    }
    drop(txn);
    if changed {
        engine.commit()?;
    }
    Ok(changed)
}

/// Items with an unknown type code or a payload that does not decode are deleted; what they
/// held is rebuilt from the other items where it can be (the other half of a name, an inode
/// ref), and reported as lost where it cannot (an inode item, xattrs). Undecodable extents
/// are left to the bad extents (the open returned them).
fn fix_undecodable(
    txn: &WriteTxn<'_>,
    facts: &Facts,
    bad_extents: &[Key],
    full: bool,
    out: &mut RepairReport,
) -> bool {
    let mut changed = false;
    for (key, why) in &facts.undecodable {
        if bad_extents.contains(key) {
            continue;
        }
        let show = format!("item {key} of {}", paths(facts, key.objectid));
        if !full {
            out.refused.push(format!("{show}: undecodable ({why})"));
            continue;
        }
        txn.delete(*key);
        changed = true;
        let what = format!("{show}: deleted (undecodable: {why})");
        let rebuilt = matches!(
            key.kind(),
            Some(ItemType::DirItem | ItemType::DirIndex | ItemType::InodeRef)
        );
        if !rebuilt {
            out.lost.push(what.clone());
        }
        out.actions.push(what);
    }
    changed
}

/// A missing root directory (inode 1) is made anew (mode 0755), its entries kept: its next
/// directory index past every entry it has; link count and size come from `fix_counts`.
fn make_root(facts: &mut Facts, full: bool, out: &mut RepairReport) -> bool {
    if facts.inodes.contains_key(&ROOT_OBJECTID) {
        return false;
    }
    if !full {
        out.refused
            .push("the root directory has no inode item".into());
        return false;
    }
    let next = facts
        .entries
        .iter()
        .filter(|((dir, _), _)| *dir == ROOT_OBJECTID)
        .map(|(_, e)| e.dir_index + 1)
        .max()
        .unwrap_or(2)
        .max(2);
    let root = new_dir_inode(ROOT_OBJECTID, 1, 0o755, next);
    facts.inodes.insert(ROOT_OBJECTID, root);
    out.actions
        .push("made the root directory (inode 1) anew, mode 0755, keeping its entries".into());
    true
}

/// A directory inode item as mkdir makes one, stamped now.
fn new_dir_inode(generation: u64, transid: u64, perm: u32, next_dir_index: u64) -> InodeItem {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let time = Timespec {
        sec: now.as_secs() as i64,
        nsec: now.subsec_nanos(),
    };
    InodeItem {
        generation,
        transid,
        nlink: 2,
        mode: libc::S_IFDIR | perm,
        next_dir_index,
        atime: time,
        mtime: time,
        ctime: time,
        otime: time,
        ..Default::default()
    }
}

/// Why blocks of an extent are not kept.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Cut {
    /// The data is gone: the range reads as a hole.
    Lost(String),
    /// A newer extent holds the range; the older blocks were stale.
    Stale,
}

/// Each file's extents made valid: an invalid inline extent (not at 0, too large, or not
/// alone) is rewritten as regular blocks; a misaligned regular or prealloc extent is
/// dropped; where extents overlap, the newer (by generation) keeps the range and the older
/// is trimmed to what is left; data blocks that failed their check are punched out. Every
/// byte range that lost data is reported with the file's paths.
fn fix_extents(
    engine: &Engine,
    txn: &WriteTxn<'_>,
    facts: &mut Facts,
    bad_blocks: &BTreeMap<u64, &'static str>,
    full: bool,
    out: &mut RepairReport,
) -> Result<bool> {
    let mut changed = false;
    let inos: Vec<u64> = facts.extents.keys().copied().collect();
    for ino in inos {
        let Some(list) = facts.extents.get(&ino).cloned() else {
            continue;
        };
        let problems = extent_problems(&list, bad_blocks);
        if problems.is_empty() {
            continue;
        }
        let path = paths(facts, ino);
        if !full {
            for p in problems {
                out.refused.push(format!("{path}: {p}"));
            }
            continue;
        }
        let mut cuts: Vec<(u64, u64, Cut)> = Vec::new();
        // Candidates: (file offset, extent); the extent's generation gives precedence.
        let mut candidates: Vec<(u64, FileExtent)> = Vec::new();
        for (offset, extent) in &list {
            match &extent.kind {
                ExtentKind::Inline(data) if !inline_valid(*offset, data, list.len()) => {
                    let aligned = offset - offset % BLOCK_SIZE;
                    let lead = (offset - aligned) as usize;
                    let mut buf = vec![
                        0u8;
                        (lead + data.len()).div_ceil(BLOCK_SIZE as usize)
                            * BLOCK_SIZE as usize
                    ];
                    buf[lead..lead + data.len()].copy_from_slice(data);
                    let runs = DataLayer::new(engine)
                        .write_new(ino, aligned, &buf)
                        .map_err(|e| Error::Invalid(format!("repair: {path}: rewriting the inline extent at {offset} as blocks: {e}")))?;
                    for run in runs {
                        candidates.push((
                            run.file_offset,
                            FileExtent {
                                generation: extent.generation,
                                kind: ExtentKind::Regular {
                                    disk_addr: run.addr,
                                    csums: run.csums,
                                },
                                shared: false,
                            },
                        ));
                    }
                    out.actions.push(format!(
                        "{path}: rewrote the inline extent at {offset} ({} bytes) as data blocks",
                        data.len()
                    ));
                }
                ExtentKind::Regular { .. } | ExtentKind::Prealloc { .. } | ExtentKind::Blob(_)
                    if offset % BLOCK_SIZE != 0 =>
                {
                    cuts.push((
                        *offset,
                        offset.saturating_add(extent.len_bytes()),
                        Cut::Lost("a misaligned extent".into()),
                    ));
                }
                ExtentKind::Inline(_)
                | ExtentKind::Regular { .. }
                | ExtentKind::Prealloc { .. }
                | ExtentKind::Blob(_) => candidates.push((*offset, extent.clone())),
            }
        }
        // Newest first: each extent keeps the blocks no newer extent holds.
        candidates.sort_by_key(|(offset, e)| (std::cmp::Reverse(e.generation), *offset));
        let mut claimed: Vec<(u64, u64)> = Vec::new();
        let mut kept: Vec<(u64, FileExtent)> = Vec::new();
        for (offset, extent) in candidates {
            let end = offset.saturating_add(extent.len_bytes());
            let (addr, csums, blocks) = match &extent.kind {
                ExtentKind::Inline(_) => {
                    if claimed.iter().any(|(s, e)| *s < end && offset < *e) {
                        cuts.push((offset, end, Cut::Stale));
                    } else {
                        kept.push((offset, extent.clone()));
                    }
                    claimed.push((offset, end));
                    continue;
                }
                ExtentKind::Regular { disk_addr, csums } => {
                    (*disk_addr, Some(csums.clone()), csums.len() as u64)
                }
                ExtentKind::Prealloc { disk_addr, blocks } => (*disk_addr, None, *blocks),
                // A blob decodes whole or not at all: one bad stored block loses the window;
                // a window a newer extent overlaps is kept only where not overlapped, as
                // narrower windows on the blob.
                ExtentKind::Blob(blob) => {
                    let bad = (0..blob.stored_blocks()).find_map(|n| {
                        let at = blob.disk_addr + n * BLOCK_SIZE;
                        bad_blocks.get(&at).map(|why| (at, why))
                    });
                    if let Some((at, why)) = bad {
                        cuts.push((offset, end, Cut::Lost(format!("blob block {at:#x} {why}"))));
                    } else {
                        kept_blob_pieces(offset, &extent, blob, &claimed, &mut kept, &mut cuts);
                    }
                    claimed.push((offset, end));
                    continue;
                }
            };
            let mut run_start: Option<u64> = None;
            for i in 0..=blocks {
                let at = offset.saturating_add(i * BLOCK_SIZE);
                let keep = i < blocks && {
                    let stale = claimed
                        .iter()
                        .any(|(s, e)| *s < at.saturating_add(BLOCK_SIZE) && at < *e);
                    let bad = csums
                        .is_some()
                        .then(|| bad_blocks.get(&(addr + i * BLOCK_SIZE)))
                        .flatten();
                    if stale {
                        cuts.push((at, at.saturating_add(BLOCK_SIZE), Cut::Stale));
                    } else if let Some(why) = bad {
                        cuts.push((
                            at,
                            at.saturating_add(BLOCK_SIZE),
                            Cut::Lost(format!("data block {:#x} {why}", addr + i * BLOCK_SIZE)),
                        ));
                    }
                    !stale && bad.is_none()
                };
                match (keep, run_start) {
                    (true, None) => run_start = Some(i),
                    (false, Some(first)) => {
                        let kind = match &csums {
                            Some(c) => ExtentKind::Regular {
                                disk_addr: addr + first * BLOCK_SIZE,
                                csums: c[first as usize..i as usize].to_vec(),
                            },
                            None => ExtentKind::Prealloc {
                                disk_addr: addr + first * BLOCK_SIZE,
                                blocks: i - first,
                            },
                        };
                        kept.push((
                            offset.saturating_add(first * BLOCK_SIZE),
                            FileExtent {
                                generation: extent.generation,
                                shared: extent.shared && kind.may_be_shared(),
                                kind,
                            },
                        ));
                        run_start = None;
                    }
                    _ => {}
                }
            }
            claimed.push((offset, end));
        }
        kept.sort_by_key(|(offset, _)| *offset);
        // Write the difference: keys that went are deleted, new or changed ones put.
        let old: BTreeMap<u64, &FileExtent> = list.iter().map(|(o, e)| (*o, e)).collect();
        let new: BTreeMap<u64, &FileExtent> = kept.iter().map(|(o, e)| (*o, e)).collect();
        for offset in old.keys() {
            if !new.contains_key(offset) {
                txn.delete(Key::new(ino, ItemType::ExtentData, *offset));
            }
        }
        for (offset, extent) in &new {
            if old.get(offset) != Some(extent) {
                txn.put(
                    Key::new(ino, ItemType::ExtentData, *offset),
                    extent.encode(),
                );
            }
        }
        let blocks_of = |l: &[(u64, FileExtent)]| -> u64 {
            l.iter()
                .filter_map(|(_, e)| e.disk_range().map(|(_, b)| b))
                .sum()
        };
        let (before, after) = (blocks_of(&list), blocks_of(&kept));
        if let Some(inode) = facts.inodes.get_mut(&ino) {
            inode.nbytes = inode
                .nbytes
                .saturating_add(after * BLOCK_SIZE)
                .saturating_sub(before * BLOCK_SIZE);
        }
        let size = facts.inodes.get(&ino).map_or(u64::MAX, |i| i.size);
        report_cuts(&path, size, cuts, out);
        facts.extents.insert(ino, kept);
        changed = true;
    }
    Ok(changed)
}

/// The parts of a blob window (file offset `offset`) that no newer extent in `claimed`
/// overlaps, kept as narrower windows on the same blob in `kept` (flagged when more than one);
/// what is overlapped is cut as stale.
fn kept_blob_pieces(
    offset: u64,
    extent: &FileExtent,
    blob: &birch_format::items::Blob,
    claimed: &[(u64, u64)],
    kept: &mut Vec<(u64, FileExtent)>,
    cuts: &mut Vec<(u64, u64, Cut)>,
) {
    let blocks = extent.len_bytes() / BLOCK_SIZE;
    let mut pieces: Vec<(u64, u64)> = Vec::new();
    for i in 0..blocks {
        let at = offset.saturating_add(i * BLOCK_SIZE);
        let end = at.saturating_add(BLOCK_SIZE);
        if claimed.iter().any(|(s, e)| *s < end && at < *e) {
            cuts.push((at, end, Cut::Stale));
        } else {
            match pieces.last_mut() {
                Some((_, hi)) if *hi == at => *hi = end,
                _ => pieces.push((at, end)),
            }
        }
    }
    // Two pieces are two items on the blob: flagged, so the next open counts them.
    let shared = extent.shared || pieces.len() > 1;
    for (lo, hi) in pieces {
        kept.push((
            lo,
            FileExtent {
                generation: extent.generation,
                kind: ExtentKind::Blob(blob.narrowed(lo - offset, hi - lo)),
                shared,
            },
        ));
    }
}

/// Whether an inline extent at `offset` among `count` extents is as the format wants it.
fn inline_valid(offset: u64, data: &[u8], count: usize) -> bool {
    offset == 0 && data.len() <= INLINE_MAX_BYTES && count == 1
}

/// What is wrong with a file's extents, in words; empty when nothing is.
fn extent_problems(
    list: &[(u64, FileExtent)],
    bad_blocks: &BTreeMap<u64, &'static str>,
) -> Vec<String> {
    let mut problems = Vec::new();
    let mut end_prev = 0u64;
    for (offset, extent) in list {
        if *offset < end_prev {
            problems.push(format!("the extent at {offset} overlaps the one before it"));
        }
        end_prev = end_prev.max(offset.saturating_add(extent.len_bytes()));
        match &extent.kind {
            ExtentKind::Inline(data) => {
                if !inline_valid(*offset, data, list.len()) {
                    problems.push(format!(
                        "the inline extent at {offset} is not alone at 0 or too large"
                    ));
                }
            }
            ExtentKind::Regular { disk_addr, csums } => {
                if offset % BLOCK_SIZE != 0 {
                    problems.push(format!("the extent at {offset} is misaligned"));
                }
                for n in 0..csums.len() as u64 {
                    if let Some(why) = bad_blocks.get(&(disk_addr + n * BLOCK_SIZE)) {
                        problems.push(format!(
                            "bytes {}..{}: data block {:#x} {why}",
                            offset.saturating_add(n * BLOCK_SIZE),
                            offset.saturating_add((n + 1) * BLOCK_SIZE),
                            disk_addr + n * BLOCK_SIZE
                        ));
                    }
                }
            }
            ExtentKind::Prealloc { .. } => {
                if offset % BLOCK_SIZE != 0 {
                    problems.push(format!("the extent at {offset} is misaligned"));
                }
            }
            ExtentKind::Blob(blob) => {
                if offset % BLOCK_SIZE != 0 {
                    problems.push(format!("the extent at {offset} is misaligned"));
                }
                for n in 0..blob.stored_blocks() {
                    let at = blob.disk_addr + n * BLOCK_SIZE;
                    if let Some(why) = bad_blocks.get(&at) {
                        problems.push(format!(
                            "bytes {}..{}: blob block {at:#x} {why}",
                            offset,
                            offset.saturating_add(extent.len_bytes()),
                        ));
                    }
                }
            }
        }
    }
    problems
}

/// Reports the byte ranges cut from a file, adjacent ranges of one cause merged: lost data
/// in `lost` and `actions` (up to the file's `size`: bytes past it held no data), stale
/// blocks in `actions`.
fn report_cuts(path: &str, size: u64, mut cuts: Vec<(u64, u64, Cut)>, out: &mut RepairReport) {
    cuts.sort_by_key(|(start, _, _)| *start);
    let mut merged: Vec<(u64, u64, Cut)> = Vec::new();
    for (start, end, cut) in cuts {
        match merged.last_mut() {
            Some(last) if last.1 == start && last.2 == cut => last.1 = end,
            _ => merged.push((start, end, cut)),
        }
    }
    for (start, end, cut) in merged {
        match cut {
            Cut::Lost(why) => {
                let end = end.min(size);
                if start >= end {
                    out.actions.push(format!(
                        "{path}: dropped an extent past the end of the file at {start} ({why})"
                    ));
                    continue;
                }
                let what = format!("{path}: lost bytes {start}..{end} ({why}); they read as zeros");
                out.lost.push(what.clone());
                out.actions.push(what);
            }
            Cut::Stale => out.actions.push(format!(
                "{path}: dropped stale blocks at bytes {start}..{end} (a newer extent holds them)"
            )),
        }
    }
}

/// Out-of-line xattr values whose chunks are missing or do not add up are removed (the xattr
/// is lost and reported); chunks no xattr claims are deleted; an image with whole
/// out-of-line values but without `INCOMPAT_XATTR_CHUNKS` gets the flag.
fn fix_xattrs(
    engine: &Engine,
    txn: &WriteTxn<'_>,
    facts: &Facts,
    full: bool,
    out: &mut RepairReport,
) -> bool {
    let mut changed = false;
    let mut claimed: BTreeSet<Key> = BTreeSet::new();
    let mut spilled_kept = false;
    let mut refused = false;
    for (key, list) in &facts.xattrs {
        let ino = key.objectid;
        if !facts.inodes.contains_key(&ino) {
            continue;
        }
        let mut kept = Vec::new();
        let mut dropped = Vec::new();
        for x in list {
            let Some(spill) = x.spill else {
                kept.push(x.clone());
                continue;
            };
            let mut value = Vec::with_capacity(spill.size as usize);
            let mut keys = Vec::new();
            let mut whole = true;
            for index in 0..spill.chunks() {
                let at = xattr_chunk_key(InodeNo::new(ino), &x.name, index);
                match facts.chunks.get(&at) {
                    Some(c) if c.name == x.name && c.index == index => {
                        value.extend_from_slice(&c.data);
                        keys.push(at);
                    }
                    _ => whole = false,
                }
            }
            if whole
                && value.len() == spill.size as usize
                && birch_format::checksum(&value) == spill.crc
            {
                claimed.extend(keys);
                spilled_kept = true;
                kept.push(x.clone());
            } else {
                dropped.push(x.name.clone());
            }
        }
        let path = paths(facts, ino);
        for name in &dropped {
            let name = String::from_utf8_lossy(name);
            if !full {
                out.refused.push(format!(
                    "{path}: xattr {name:?}: its out-of-line value is damaged"
                ));
                refused = true;
                continue;
            }
            let what = format!("{path}: removed xattr {name:?} (its out-of-line value is damaged)");
            out.lost.push(what.clone());
            out.actions.push(what);
        }
        if full && !dropped.is_empty() {
            if kept.is_empty() {
                txn.delete(*key);
            } else {
                txn.put(*key, items::encode_xattrs(&kept));
            }
            changed = true;
        }
    }
    if refused {
        return changed;
    }
    for (key, chunk) in &facts.chunks {
        if claimed.contains(key) || !facts.inodes.contains_key(&key.objectid) {
            continue;
        }
        let show = format!(
            "{}: chunk {} of xattr {:?}",
            paths(facts, key.objectid),
            chunk.index,
            String::from_utf8_lossy(&chunk.name)
        );
        if !full {
            out.refused.push(format!("{show}: claimed by no xattr"));
            continue;
        }
        txn.delete(*key);
        changed = true;
        out.actions
            .push(format!("{show}: deleted (claimed by no xattr)"));
    }
    if full && spilled_kept && engine.superblock().incompat & INCOMPAT_XATTR_CHUNKS == 0 {
        engine.want_incompat(INCOMPAT_XATTR_CHUNKS);
        out.actions.push(
            "set the incompat flag INCOMPAT_XATTR_CHUNKS: the image holds out-of-line xattr values"
                .into(),
        );
        // The flag goes with a commit: rewrite an item so there is one.
        if let Some((key, list)) = facts
            .xattrs
            .iter()
            .find(|(k, _)| facts.inodes.contains_key(&k.objectid))
        {
            txn.put(*key, items::encode_xattrs(list));
            changed = true;
        }
    }
    changed
}

/// Every path of `ino` ("/a/b and /c/d"), for reports; "inode N" when it has none.
fn paths(facts: &Facts, ino: u64) -> String {
    let refs = facts.refs.get(&ino).map(Vec::as_slice).unwrap_or_default();
    if refs.is_empty() {
        return path_of(facts, ino);
    }
    refs.iter()
        .map(|r| {
            format!(
                "{}/{}",
                path_of(facts, r.parent).trim_end_matches('/'),
                String::from_utf8_lossy(&r.name)
            )
        })
        .collect::<Vec<_>>()
        .join(" and ")
}

/// Dir items, dir indexes and inode refs: entries naming a missing inode go, a missing half
/// of a name is written back, refs without an entry go, entries without a ref get one.
fn fix_names(
    _engine: &Engine,
    txn: &WriteTxn<'_>,
    facts: &mut Facts,
    full: bool,
    out: &mut RepairReport,
) -> Result<bool> {
    let mut changed = false;
    let names: Vec<((u64, Vec<u8>), DirEntry)> = facts
        .entries
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    // Dir items are lists keyed by hash: rebuild each touched list from what is kept.
    let mut dir_item_lists: BTreeMap<Key, Vec<DirEntry>> = BTreeMap::new();
    let mut touched_lists: BTreeSet<Key> = BTreeSet::new();
    for ((dir, name), entry) in &names {
        let key = dir_item_key(InodeNo::new(*dir), name);
        dir_item_lists.entry(key).or_default();
        let dangling = !facts.inodes.contains_key(&entry.child) || !facts.inodes.contains_key(dir);
        let show = format!(
            "{}/{}",
            path_of(facts, *dir).trim_end_matches('/'),
            String::from_utf8_lossy(name)
        );
        if dangling {
            if !full {
                out.refused.push(format!(
                    "{show}: names inode {} that does not exist",
                    entry.child
                ));
                if let Some(list) = dir_item_lists.get_mut(&key) {
                    list.push(entry.clone());
                }
                continue;
            }
            touched_lists.insert(key);
            txn.delete(dir_index_key(InodeNo::new(*dir), entry.dir_index));
            facts.entries.remove(&(*dir, name.clone()));
            changed = true;
            let what = format!(
                "{show}: removed the entry (inode {} does not exist)",
                entry.child
            );
            out.lost.push(what.clone());
            out.actions.push(what);
            continue;
        }
        if let Some(list) = dir_item_lists.get_mut(&key) {
            list.push(entry.clone());
        }
        let (has_item, has_index) = facts
            .halves
            .get(&(*dir, name.clone()))
            .copied()
            .unwrap_or_default();
        if !has_item {
            touched_lists.insert(key);
            changed = true;
            out.actions.push(format!("{show}: wrote back its dir item"));
        }
        if !has_index {
            txn.put(
                dir_index_key(InodeNo::new(*dir), entry.dir_index),
                items::encode_dir_entries(std::slice::from_ref(entry)),
            );
            changed = true;
            out.actions
                .push(format!("{show}: wrote back its dir index"));
        }
        let refs = facts.refs.entry(entry.child).or_default();
        if !refs.iter().any(|r| r.parent == *dir && r.name == *name) {
            let r = InodeRef {
                parent: *dir,
                dir_index: entry.dir_index,
                name: name.clone(),
            };
            refs.push(r.clone());
            txn.put(
                inode_ref_key(InodeNo::new(entry.child), InodeNo::new(*dir), name),
                items::encode_inode_refs(&[r]),
            );
            changed = true;
            out.actions
                .push(format!("{show}: wrote back the inode's ref to it"));
        }
    }
    for key in touched_lists {
        match dir_item_lists.get(&key) {
            Some(list) if !list.is_empty() => txn.put(key, items::encode_dir_entries(list)),
            _ => txn.delete(key),
        }
    }
    // Refs naming no entry.
    let all_refs: Vec<(u64, Vec<InodeRef>)> =
        facts.refs.iter().map(|(k, v)| (*k, v.clone())).collect();
    for (ino, refs) in all_refs {
        let mut kept = Vec::new();
        for r in refs {
            let named = facts
                .entries
                .get(&(r.parent, r.name.clone()))
                .is_some_and(|e| e.child == ino);
            if named {
                kept.push(r);
                continue;
            }
            let show = format!(
                "inode {ino} ref {}/{}",
                r.parent,
                String::from_utf8_lossy(&r.name)
            );
            if !full {
                out.refused
                    .push(format!("{show}: no entry in the directory"));
                kept.push(r);
                continue;
            }
            txn.delete(inode_ref_key(
                InodeNo::new(ino),
                InodeNo::new(r.parent),
                &r.name,
            ));
            changed = true;
            out.actions.push(format!("{show}: removed (no such entry)"));
        }
        facts.refs.insert(ino, kept);
    }
    Ok(changed)
}

/// Inodes without names: to `/lost+found` (full) or left (preen); orphan items of inodes
/// that are gone are removed.
fn fix_orphans(
    engine: &Engine,
    txn: &WriteTxn<'_>,
    facts: &mut Facts,
    full: bool,
    out: &mut RepairReport,
) -> Result<bool> {
    let mut changed = false;
    let stale: Vec<u64> = facts
        .orphans
        .iter()
        .copied()
        .filter(|ino| !facts.inodes.contains_key(ino))
        .collect();
    for ino in stale {
        txn.delete(orphan_key(InodeNo::new(ino)));
        facts.orphans.remove(&ino);
        changed = true;
        out.actions.push(format!(
            "orphan item for inode {ino}: removed (no such inode)"
        ));
    }
    let unnamed: Vec<u64> = facts
        .inodes
        .keys()
        .copied()
        .filter(|ino| {
            *ino != ROOT_OBJECTID
                && facts.refs.get(ino).is_none_or(|r| r.is_empty())
                && !facts.orphans.contains(ino)
        })
        .collect();
    if unnamed.is_empty() {
        return Ok(changed);
    }
    if !full {
        for ino in unnamed {
            out.refused.push(format!(
                "inode {ino}: no name and no orphan item (needs lost+found)"
            ));
        }
        return Ok(changed);
    }
    let lost_found = lost_and_found(engine, txn, facts, out)?;
    for ino in unnamed {
        let Some(inode) = facts.inodes.get(&ino) else {
            continue;
        };
        let name = format!("#{ino}").into_bytes();
        let file_type = d_type(inode.mode);
        let Some(dir) = facts.inodes.get_mut(&lost_found) else {
            continue;
        };
        let index = dir.next_dir_index.max(2);
        dir.next_dir_index = index + 1;
        let entry = DirEntry {
            child: ino,
            dir_index: index,
            file_type,
            name: name.clone(),
        };
        let r = put_link(txn, lost_found, ino, &entry);
        facts.refs.entry(ino).or_default().push(r);
        facts.entries.insert((lost_found, name), entry);
        changed = true;
        out.actions.push(format!(
            "inode {ino}: had no name, reattached as /lost+found/#{ino}"
        ));
    }
    Ok(changed)
}

/// The inode number of `/lost+found`, made (mode 0700, in this transaction) when missing.
fn lost_and_found(
    engine: &Engine,
    txn: &WriteTxn<'_>,
    facts: &mut Facts,
    out: &mut RepairReport,
) -> Result<u64> {
    if let Some(entry) = facts.entries.get(&(ROOT_OBJECTID, LOST_AND_FOUND.to_vec())) {
        if facts.inodes.get(&entry.child).is_some_and(is_dir) {
            return Ok(entry.child);
        }
        return Err(Error::Invalid(
            "repair: /lost+found exists and is not a directory; rename it and run again".into(),
        ));
    }
    let ino = engine.allocate_objectid_alone()?.get();
    let Some(root) = facts.inodes.get_mut(&ROOT_OBJECTID) else {
        return Err(Error::Invalid(
            "repair: the root directory is missing; cannot make /lost+found".into(),
        ));
    };
    let index = root.next_dir_index.max(2);
    root.next_dir_index = index + 1;
    let inode = new_dir_inode(ino, txn.generation().get(), 0o700, 2);
    txn.put(inode_key(InodeNo::new(ino)), inode.encode());
    facts.inodes.insert(ino, inode);
    let entry = DirEntry {
        child: ino,
        dir_index: index,
        file_type: DT_DIR,
        name: LOST_AND_FOUND.to_vec(),
    };
    let r = put_link(txn, ROOT_OBJECTID, ino, &entry);
    facts.refs.entry(ino).or_default().push(r);
    facts
        .entries
        .insert((ROOT_OBJECTID, LOST_AND_FOUND.to_vec()), entry);
    out.actions.push(format!("made /lost+found (inode {ino})"));
    Ok(ino)
}

/// Link counts, directory sizes and sizes that must cover their extents, recomputed from
/// the names and extents as they are now; each inode whose item differs is written.
fn fix_counts(txn: &WriteTxn<'_>, facts: &Facts, out: &mut RepairReport) -> bool {
    let mut entries: HashMap<u64, u64> = HashMap::new();
    let mut subdirs: HashMap<u64, u64> = HashMap::new();
    for ((dir, _), entry) in &facts.entries {
        *entries.entry(*dir).or_default() += 1;
        if entry.file_type == DT_DIR {
            *subdirs.entry(*dir).or_default() += 1;
        }
    }
    let mut changed = false;
    for (ino, inode) in &facts.inodes {
        let mut fixed = inode.clone();
        let path = path_of(facts, *ino);
        if is_dir(inode) {
            fixed.nlink = (2 + subdirs.get(ino).copied().unwrap_or(0)) as u32;
            fixed.size = entries.get(ino).copied().unwrap_or(0);
        } else {
            let names = facts.refs.get(ino).map_or(0, |r| r.len());
            fixed.nlink = names as u32;
            if let Some(end) = extent_end(facts.extents.get(ino)) {
                if inode.mode & libc::S_IFMT != libc::S_IFLNK {
                    let rounded = inode.size.div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
                    if end.0 > rounded || end.1 > inode.size.max(1) {
                        fixed.size = fixed.size.max(end.2);
                    }
                }
            }
        }
        // Compared with the tree's item: a change made above (a new entry's index) is
        // written even when the counts agree.
        let stored = facts.original.get(ino);
        if let Some(stored) = stored {
            if fixed.nlink != stored.nlink {
                out.actions.push(format!(
                    "{path}: link count {} -> {}",
                    stored.nlink, fixed.nlink
                ));
            }
            if fixed.size != stored.size {
                out.actions
                    .push(format!("{path}: size {} -> {}", stored.size, fixed.size));
            }
        }
        if stored != Some(&fixed) {
            txn.put(inode_key(InodeNo::new(*ino)), fixed.encode());
            changed = true;
        }
    }
    changed
}

/// For a file's extents: (start of the last regular extent + 1, end of an inline extent,
/// end of the data), or `None` without extents. Prealloc extents may lie past the size
/// (fallocate with keep-size) and do not count.
fn extent_end(extents: Option<&Vec<(u64, FileExtent)>>) -> Option<(u64, u64, u64)> {
    let mut result: Option<(u64, u64, u64)> = None;
    for (offset, extent) in extents? {
        let end = offset.saturating_add(extent.len_bytes());
        let (regular_start, inline_end) = match extent.kind {
            ExtentKind::Regular { .. } | ExtentKind::Blob(_) => (offset.saturating_add(1), 0),
            ExtentKind::Inline(_) => (0, end),
            ExtentKind::Prealloc { .. } => continue,
        };
        let r = result.get_or_insert((0, 0, 0));
        r.0 = r.0.max(regular_start);
        r.1 = r.1.max(inline_end);
        r.2 = r.2.max(end);
    }
    result
}

/// Which kinds a repair of `mode` may fix (for the report's summary).
pub fn repairable(kind: FindingKind, mode: RepairMode) -> bool {
    use FindingKind::*;
    let preen = matches!(
        kind,
        InodeNlinkMismatch
            | DirSizeMismatch
            | OrphanStale
            | ExtentPastSize
            | DirItemWithoutIndex
            | DirIndexWithoutItem
            | DirEntryWithoutInodeRef
            | SuperblockSlotBad
    );
    match mode {
        RepairMode::Preen => preen,
        RepairMode::Full | RepairMode::DryRun => {
            preen
                || matches!(
                    kind,
                    NodeUnreadable
                        | NodeKeyOutOfRange
                        | PointerKeyMismatch
                        | BlockReferencedTwice
                        | BlockOutOfBounds
                        | BlockInReservedArea
                        | ItemWithoutInode
                        | DirEntryDangling
                        | InodeRefWithoutDirEntry
                        | OrphanMissing
                        | ItemUndecodable
                        | ExtentMisaligned
                        | ExtentOverlap
                        | InlineExtentInvalid
                        | XattrChunkMismatch
                        | RootDirMissing
                        | DataChecksumMismatch
                        | DataUnreadable
                )
        }
    }
}

/// A key range `[low, high)`; `None` is past every key.
type KeyRange = (Key, Option<Key>);

/// The part of `a` inside `b`, if any.
fn intersect(a: &KeyRange, b: &KeyRange) -> Option<KeyRange> {
    let low = a.0.max(b.0);
    let high = match (a.1, b.1) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    };
    high.is_none_or(|h| low < h).then_some((low, high))
}

fn in_range(key: &Key, range: &KeyRange) -> bool {
    *key >= range.0 && range.1.is_none_or(|h| *key < h)
}

/// What the salvage reads out of the trees.
#[derive(Default)]
struct Harvest {
    /// Items kept, the first tree's version of each key winning.
    items: BTreeMap<Key, Vec<u8>>,
    /// Every node address the trees name, read or not: the new tree must not overwrite them
    /// (a crash before its superblock leaves the old state).
    nodes: BTreeSet<u64>,
    /// Every extent's blocks in the leaves read, for the same reason.
    extents: Vec<(u64, u64)>,
    /// Blocks the extents kept from the trees walked before this one point at: an older
    /// tree's extent over any of them is not kept (the newer tree may have reused those
    /// blocks for another file; keeping both would show that file's bytes in the older one).
    claimed: Claims,
    /// Extents not kept for that reason, reported as lost.
    dropped: Vec<String>,
}

/// Block ranges, merged where they overlap or touch, as `start -> end` (exclusive).
#[derive(Default)]
struct Claims(BTreeMap<u64, u64>);

impl Claims {
    /// Whether any claimed block lies in `[start, start + blocks)`.
    fn overlaps(&self, start: u64, blocks: u64) -> bool {
        let end = start.saturating_add(blocks);
        self.0
            .range(..end)
            .next_back()
            .is_some_and(|(_, claimed_end)| *claimed_end > start)
    }

    /// Claims `[start, start + blocks)`.
    fn claim(&mut self, start: u64, blocks: u64) {
        let (mut lo, mut hi) = (start, start.saturating_add(blocks));
        // Merge with every range that overlaps or touches [lo, hi).
        while let Some((&s, &e)) = self.0.range(..=hi).next_back() {
            if e < lo {
                break;
            }
            self.0.remove(&s);
            lo = lo.min(s);
            hi = hi.max(e);
        }
        self.0.insert(lo, hi);
    }
}

/// Walks the tree at `root` whole, tolerating damage: every node that reads and verifies
/// gives its items that lie in its parent's key range and in one of `want` (and are not
/// held yet); the key ranges under nodes that do not read are returned (as far as they lie
/// in `want`).
fn harvest(
    device: &dyn BlockDevice,
    sb: &Superblock,
    root: RootPtr,
    want: &[KeyRange],
    h: &mut Harvest,
) -> Vec<KeyRange> {
    let mut lost = Vec::new();
    let mut kept_extents = Vec::new();
    let mut visited = BTreeSet::new();
    let mut stack = vec![(
        root.addr,
        root.generation,
        root.level,
        Key::MIN,
        None::<Key>,
    )];
    while let Some((addr, generation, level, low, high)) = stack.pop() {
        h.nodes.insert(addr);
        let node = visited
            .insert(addr)
            .then(|| {
                let inside = addr.saturating_add(NODE_SIZE as u64) <= sb.total_bytes;
                inside
                    .then(|| read_node(device, sb.fsid, addr, generation, level).ok())
                    .flatten()
            })
            .flatten();
        let Some(node) = node else {
            lost.extend(want.iter().filter_map(|w| intersect(w, &(low, high))));
            continue;
        };
        match node.body {
            NodeBody::Leaf(leaf) => {
                for (key, value) in leaf {
                    let mut range = None;
                    if key.kind() == Some(ItemType::ExtentData) {
                        range = FileExtent::decode(&value).ok().and_then(|e| e.disk_range());
                        if let Some(range) = range {
                            h.extents.push(range);
                        }
                    }
                    if in_range(&key, &(low, high))
                        && want.iter().any(|w| in_range(&key, w))
                        && !h.items.contains_key(&key)
                    {
                        if let Some((addr, blocks)) = range {
                            if h.claimed.overlaps(addr, blocks) {
                                h.dropped.push(format!(
                                    "inode {} bytes from {}: the extent of an older tree points \
                                     at blocks {addr:#x}+{blocks} a newer tree's extent holds; \
                                     not kept",
                                    key.objectid, key.offset
                                ));
                                continue;
                            }
                            kept_extents.push((addr, blocks));
                        }
                        h.items.insert(key, value);
                    }
                }
            }
            NodeBody::Internal(ptrs) => {
                for (slot, ptr) in ptrs.iter().enumerate() {
                    let child_high = ptrs.get(slot + 1).map(|p| p.key).or(high);
                    stack.push((
                        ptr.addr,
                        ptr.generation,
                        level.saturating_sub(1),
                        ptr.key.max(low),
                        child_high,
                    ));
                }
            }
        }
    }
    // Claimed only now: within one tree, two extents over the same blocks are damage the
    // open after the repair finds and settles (`rebuild_allocator`), as without salvage.
    for (addr, blocks) in kept_extents {
        h.claimed.claim(addr, blocks);
    }
    lost
}

/// Salvage (DESIGN §13.4): the newest tree is damaged and no older root is whole. Every item
/// of the newest tree's readable leaves is kept; the key ranges under its unreadable nodes
/// are looked up in the older trees, newest first; what no tree holds readable is lost and
/// reported by key range. The items go into a new tree written to blocks none of those trees
/// names, and superblock N+1 names it (no backups: the older trees are not whole). Returns
/// false (with the reason in `refused`) when nothing could be read.
fn salvage(device: &Arc<dyn BlockDevice>, out: &mut RepairReport) -> Result<bool> {
    let (sb, _) = Engine::read_superblock(&**device)?;
    let mut h = Harvest::default();
    let everything = [(Key::MIN, None)];
    let mut lost = harvest(&**device, &sb, sb.fs_root, &everything, &mut h);
    out.actions.push(format!(
        "salvage: {} items read from the tree of generation {}, {} key ranges unreadable",
        h.items.len(),
        sb.generation,
        lost.len()
    ));
    for older in older_roots(&**device, &sb, false) {
        if lost.is_empty() {
            break;
        }
        let before = h.items.len();
        lost = harvest(&**device, &sb, older.fs_root, &lost, &mut h);
        out.actions.push(format!(
            "salvage: {} items of those ranges read from the tree of generation {}",
            h.items.len() - before,
            older.generation
        ));
    }
    if h.items.is_empty() {
        out.refused.push(format!(
            "the tree of generation {} is damaged, no backup root is whole, and no leaf of any tree reads",
            sb.generation
        ));
        return Ok(false);
    }
    out.lost.append(&mut h.dropped);
    for (low, high) in &lost {
        let high = high.map_or("the end".to_string(), |h| h.to_string());
        out.lost.push(format!(
            "keys {low} up to {high}: unreadable in every tree (objects {} ..)",
            low.objectid
        ));
    }
    let alloc = Allocator::new(sb.total_bytes);
    crate::txn::mark_reserved_areas(&alloc, sb.log_start, sb.log_bytes);
    for addr in &h.nodes {
        alloc.mark_used(BlockAddr::new(*addr), BlockCount::new(NODE_BLOCKS));
    }
    for (addr, blocks) in &h.extents {
        alloc.mark_used(BlockAddr::new(*addr), BlockCount::new(*blocks));
    }
    let counters = Counters::default();
    let cache = NodeCache::new(1024);
    let ctx = TreeCtx {
        device: &**device,
        cache: &cache,
        counters: &counters,
        fsid: sb.fsid,
        owner: FS_TREE_ID,
    };
    let generation = sb.generation + 1;
    let mut writer = TreeWriter::create(ctx, &alloc, Generation::new(generation))?;
    let count = h.items.len();
    for (key, value) in h.items {
        if let Err(e) = writer.insert(key, value) {
            out.lost.push(format!("item {key}: not kept ({e})"));
        }
    }
    writer.write_dirty()?;
    let root = writer.root();
    device
        .flush()
        .map_err(|e| Error::io("repair: flush the salvaged tree", e))?;
    let replay = crate::log::read_log(&**device, &sb);
    let mut next = sb.clone();
    next.generation = generation;
    next.fs_root = root;
    next.backup_roots.clear();
    next.log_head = replay.tail_lsn.get();
    next.log_generation = replay.next_seq;
    device
        .write_at(&next.encode(), SUPER_OFFSETS[next.slot()])
        .map_err(|e| Error::io(format!("repair: write superblock {generation}"), e))?;
    device
        .flush()
        .map_err(|e| Error::io("repair: flush superblock", e))?;
    out.salvaged = true;
    out.actions.push(format!(
        "salvage: wrote a new tree of {count} items (node {:#x}), named by superblock {generation}",
        root.addr
    ));
    if replay.records.iter().any(|r| r.generation > sb.generation) {
        out.lost
            .push("the fsync log records of the damaged generation".to_string());
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use birch_format::codec::Codec;
    use birch_format::items::{Blob, ExtentKind, FileExtent};

    use super::{extent_end, extent_problems, kept_blob_pieces, Claims, Cut};

    const B: u64 = birch_format::BLOCK_SIZE;

    fn blob_at(window_blocks: u32) -> FileExtent {
        FileExtent {
            generation: 3,
            kind: ExtentKind::Blob(Blob {
                disk_addr: 0x80000,
                codec: Codec::Zstd(0),
                encoded_len: 2 * 4096,
                logical: 8 * 4096,
                window_offset: 0,
                window_len: window_blocks * 4096,
                nonce: 0,
                csums: vec![1, 2],
            }),
            shared: false,
        }
    }

    /// Repair keeps the parts of a blob window no newer extent overlaps as narrower windows on
    /// the same blob, flagged when there are two (the next open counts them); overlapped
    /// blocks are stale.
    #[test]
    fn a_blob_window_keeps_its_unclaimed_pieces() {
        let extent = blob_at(8);
        let ExtentKind::Blob(blob) = &extent.kind else {
            unreachable!()
        };
        let (mut kept, mut cuts) = (Vec::new(), Vec::new());
        // Newer extents over file blocks 2..3 and 6..8 (the window is at 0, 8 blocks).
        let claimed = [(2 * B, 3 * B), (6 * B, 8 * B)];
        kept_blob_pieces(0, &extent, blob, &claimed, &mut kept, &mut cuts);
        let windows: Vec<(u64, u32, u32, bool)> = kept
            .iter()
            .map(|(at, e)| match &e.kind {
                ExtentKind::Blob(b) => {
                    assert!(b.same_blob(blob));
                    (*at, b.window_offset, b.window_len, e.shared)
                }
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            windows,
            vec![(0, 0, 2 * 4096, true), (3 * B, 3 * 4096, 3 * 4096, true)]
        );
        assert_eq!(cuts.len(), 3);
        assert!(cuts.iter().all(|(_, _, c)| matches!(c, Cut::Stale)));
        // One piece stays unflagged.
        let (mut kept, mut cuts) = (Vec::new(), Vec::new());
        kept_blob_pieces(0, &extent, blob, &claimed[1..], &mut kept, &mut cuts);
        assert_eq!(kept.len(), 1);
        assert!(!kept[0].1.shared);
    }

    /// A bad stored block of a blob is a problem for the whole window; a blob counts as data
    /// for the file's end.
    #[test]
    fn a_bad_blob_block_names_the_window() {
        let list = vec![(4 * B, blob_at(5))];
        let mut bad = BTreeMap::new();
        assert!(extent_problems(&list, &bad).is_empty());
        bad.insert(0x81000, "fails its checksum");
        let problems = extent_problems(&list, &bad);
        assert_eq!(problems.len(), 1);
        assert!(
            problems[0].contains(&format!("bytes {}..{}", 4 * B, 9 * B)),
            "{problems:?}"
        );
        assert_eq!(extent_end(Some(&list)), Some((4 * B + 1, 0, 9 * B)));
    }

    #[test]
    fn claims_merge_and_find_any_overlap() {
        let mut c = Claims::default();
        c.claim(100, 10); // 100..110
        c.claim(200, 5); // 200..205
        assert!(!c.overlaps(110, 90), "110..200 lies between");
        assert!(c.overlaps(109, 1));
        assert!(c.overlaps(50, 51), "50..101 reaches 100");
        assert!(!c.overlaps(50, 50), "50..100 stops before");
        c.claim(105, 100); // 105..205 joins both
        assert_eq!(c.0.len(), 1, "{:?}", c.0);
        assert!(c.overlaps(150, 1));
        c.claim(0, 10);
        c.claim(20, 10);
        // A range inside a long earlier one with a later start between is still found.
        assert!(c.overlaps(120, 2));
        assert!(!c.overlaps(10, 10), "10..20 is free");
        assert!(!c.overlaps(u64::MAX - 1, 5), "past every claim");
    }
}
