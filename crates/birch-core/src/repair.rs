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
//! use), so a crash mid-repair leaves the old state and the repair can run again. Snapshot
//! trees do not exist in v1; repair edits only the fs tree (owner 5).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use birch_format::items::{
    self, DirEntry, ExtentKind, FileExtent, InodeItem, InodeRef, Item, Timespec,
};
use birch_format::superblock::{BackupRoot, RootPtr, Superblock, SUPER_OFFSETS};
use birch_format::{InodeNo, Key, BLOCK_SIZE, ORPHAN_OBJECTID, ROOT_OBJECTID};

use crate::check::{check, check_with_root, CheckOptions, FindingKind, Report};
use crate::device::{BlockDevice, OverlayDevice};
use crate::error::{Error, Result};
use crate::items::{
    dir_index_key, dir_item_key, inode_key, inode_key_range, inode_ref_key, orphan_key,
};
use crate::txn::{Engine, WriteTxn};

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
    let opens = !structural && Engine::open_for_repair(device.clone()).is_ok();
    if !opens {
        if mode == RepairMode::Preen {
            out.refused
                .push("the newest tree is damaged: falling back needs birch fsck --repair".into());
            return Ok(out);
        }
        if !fall_back(&device, options, &mut out)? {
            return Ok(out);
        }
    } else if out.before.log_batches > 0 {
        if let Err(e) = replay_log(device.clone(), &mut out) {
            out.refused.push(format!("{e}"));
            return Ok(out);
        }
    }
    let (engine, bad_extents) = Engine::open_for_repair(device.clone())?;
    let wrote = fix_items(&engine, &bad_extents, mode, &mut out)?;
    drop(engine);
    if wrote || out.fell_back_to.is_some() || out.before.log_batches > 0 {
        out.after = Some(check(&*device, options)?);
    }
    Ok(out)
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

/// The roots to try, newest first: the newest slot's backups, then the other slot's root
/// and its backups.
fn candidates(device: &dyn BlockDevice, sb: &Superblock) -> Vec<BackupRoot> {
    let mut roots = sb.backup_roots.clone();
    let other = 1 - sb.slot();
    let mut bytes = vec![0u8; birch_format::superblock::SUPER_BYTES];
    if device.read_at(&mut bytes, SUPER_OFFSETS[other]).is_ok() {
        if let Ok(o) = Superblock::decode(&bytes, "other superblock slot") {
            if o.fsid == sb.fsid && o.generation < sb.generation && o.slot() == other {
                roots.push(BackupRoot {
                    generation: o.generation,
                    fs_root: o.fs_root,
                });
                roots.extend(o.backup_roots);
            }
        }
    }
    roots.sort_by_key(|b| std::cmp::Reverse(b.generation));
    roots.dedup_by_key(|b| b.generation);
    roots
}

/// Finds the newest older root whose tree is whole and writes superblock N+1 naming it.
/// Returns false (with the reason in `refused`) when none is.
fn fall_back(
    device: &Arc<dyn BlockDevice>,
    options: CheckOptions,
    out: &mut RepairReport,
) -> Result<bool> {
    let (sb, _) = Engine::read_superblock(&**device)?;
    let mut chosen: Option<BackupRoot> = None;
    for candidate in candidates(&**device, &sb) {
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
        if whole && Engine::open(trial_view(device, &sb, candidate.fs_root)?).is_ok() {
            chosen = Some(candidate);
            break;
        }
    }
    let Some(chosen) = chosen else {
        out.refused.push(format!(
            "the tree of generation {} is damaged and no backup root is whole",
            sb.generation
        ));
        return Ok(false);
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
    Ok(true)
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
}

fn gather(engine: &Engine) -> Result<Facts> {
    let mut facts = Facts::default();
    for (key, value) in engine.range(&Key::MIN, &Key::MAX, usize::MAX)? {
        let Some(kind) = key.kind() else { continue };
        let Ok(item) = Item::decode(kind, &value) else {
            continue;
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
            Item::Xattrs(_) | Item::XattrChunk(_) => {}
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
    bad_extents: &[Key],
    mode: RepairMode,
    out: &mut RepairReport,
) -> Result<bool> {
    let full = mode != RepairMode::Preen;
    let mut facts = gather(engine)?;
    let txn = engine.begin()?;
    let mut changed = false;

    // Extents on blocks that are not the file's to read: dropped, the range reads as a hole.
    for key in bad_extents {
        let path = path_of(&facts, key.objectid);
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
        let what = format!("{path}: dropped the extent at file offset {} (blocks outside the device, reserved or taken)", key.offset);
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

    changed |= fix_names(engine, &txn, &mut facts, full, out)?;
    changed |= fix_orphans(engine, &txn, &mut facts, full, out)?;
    changed |= fix_counts(&txn, &facts, out);
    drop(txn);
    if changed {
        engine.commit()?;
    }
    Ok(changed)
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
    let ino = engine.allocate_objectid_alone().get();
    let Some(root) = facts.inodes.get_mut(&ROOT_OBJECTID) else {
        return Err(Error::Invalid(
            "repair: the root directory is missing; cannot make /lost+found".into(),
        ));
    };
    let index = root.next_dir_index.max(2);
    root.next_dir_index = index + 1;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let time = Timespec {
        sec: now.as_secs() as i64,
        nsec: now.subsec_nanos(),
    };
    let inode = InodeItem {
        generation: ino,
        transid: txn.generation().get(),
        nlink: 2,
        mode: libc::S_IFDIR | 0o700,
        next_dir_index: 2,
        atime: time,
        mtime: time,
        ctime: time,
        otime: time,
        ..Default::default()
    };
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
            ExtentKind::Regular { .. } => (offset + 1, 0),
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
                )
        }
    }
}
