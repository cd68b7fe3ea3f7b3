//! Scrub: read every metadata node and data block the newest committed tree and every
//! snapshot's tree reference once, verify every checksum, and name the inodes and paths each
//! bad block belongs to, in each tree that holds it.
//!
//! Owns: the chunked walk of the committed tree and then of each snapshot's tree by ascending
//! id ([`scrub`]), skipping a subtree (same address and generation) already walked whole and
//! clean from another tree; its rate limit and progress ([`ScrubProgress`]); the resume
//! position of a cancelled scrub ([`ScrubPosition`], [`ScrubOptions::resume_from`]); the report
//! of damaged blocks with their owners ([`ScrubReport`], [`Damage`], [`Owner`]: a snapshot
//! owner carries the snapshot's name and id and its paths under `/.snapshot/NAME`, as a mount
//! shows them) and its JSON form. It works over a [`ViewSource`]: offline the one committed
//! tree of an image and the snapshots its list names, read from the device here
//! ([`ImageViews`]); online the engine's newest committed root and snapshot list
//! ([`EngineViews`]), taken again for every chunk of keys so that a long scrub never pins an
//! old view (a held committed root keeps every block freed after it, DESIGN §5), and a
//! snapshot's chunk read only while the snapshot still exists under that view.
//!
//! Must not touch: any writer, the node cache (it reads the device itself, so it verifies
//! what is on disk, not a cached copy), the running or frozen deltas, the snapshot list (it
//! only reads it). Scrub detects; with one copy of each block it cannot heal, and it never
//! writes.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use birch_format::items::SnapshotItem;
use birch_format::items::{self, ExtentKind, FileExtent};
use birch_format::key::ItemType;
use birch_format::node::{Expect, Node, NodeBody};
use birch_format::superblock::RootPtr;
use birch_format::{
    InodeNo, Key, BLOCK_SIZE, FS_TREE_ID, NODE_SIZE, ROOT_OBJECTID, SNAPSHOT_TREE_ID,
};

use crate::device::BlockDevice;
use crate::error::{Error, Result};
use crate::snapshot::Snapshot;
use crate::txn::{CommittedRoot, Engine};

/// Leaves per chunk: after this many, the walk lets go of its view and takes the newest one.
/// A view is held only while its chunk is read (the rate limit sleeps between chunks, with
/// no view held), so this bounds how long freed space stays pinned: 64 leaves are 1 MiB.
pub const CHUNK_LEAVES: u64 = 64;

/// Data bytes per chunk, for the same reason: 8 MiB is a few tens of milliseconds on a
/// disk, and what commits free meanwhile waits no longer than that.
pub const CHUNK_DATA_BYTES: u64 = 8 << 20;

/// Directory levels a path may have before resolution gives up (a cycle in damaged refs).
const PATH_DEPTH_MAX: usize = 4096;

/// Inodes listed as owners of one damaged node: its key range may span many object ids,
/// and the node itself, which would say which exist, is the one that cannot be read.
const NODE_OWNERS_MAX: u64 = 64;

/// One committed tree to read under, and whatever keeps its blocks from being reused while
/// it is held.
pub struct View {
    /// Root of the fs tree in this view.
    pub root: RootPtr,
    /// Generation that wrote it.
    pub generation: u64,
    _pin: Option<Arc<CommittedRoot>>,
}

/// One snapshot's tree, as scrub walks it: a past state of the fs tree, read-only while the
/// snapshot exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotTree {
    /// The snapshot's id (never reused; ascends with age).
    pub id: u64,
    /// Its name: its files are at `/.snapshot/NAME/...` in a mount.
    pub name: String,
    /// Its fs tree's root.
    pub root: RootPtr,
    /// The commit whose tree it keeps.
    pub generation: u64,
}

impl From<&Snapshot> for SnapshotTree {
    fn from(s: &Snapshot) -> SnapshotTree {
        SnapshotTree {
            id: s.id,
            name: s.name.clone(),
            root: s.root,
            generation: s.generation,
        }
    }
}

/// Where the committed trees come from.
pub trait ViewSource: Send + Sync {
    /// The newest committed view, pinned until the returned value is dropped.
    fn newest(&self) -> Result<View>;
    /// The snapshots, oldest first. Online, take [`ViewSource::newest`] first and hold it: a
    /// snapshot listed then keeps its blocks while the view is held.
    fn snapshots(&self) -> Result<Vec<SnapshotTree>>;
    /// Snapshot `id`, if it exists (same caveat as [`ViewSource::snapshots`]).
    fn snapshot(&self, id: u64) -> Result<Option<SnapshotTree>> {
        Ok(self.snapshots()?.into_iter().find(|s| s.id == id))
    }
    /// Nodes of the snapshot list that failed to verify when it was read (offline only: the
    /// engine verified its list when it opened).
    fn list_damage(&self) -> Vec<Damage> {
        Vec::new()
    }
    /// The device to read nodes and blocks from.
    fn device(&self) -> &dyn BlockDevice;
    /// The filesystem id every node must carry.
    fn fsid(&self) -> [u8; 16];
    /// Bytes in use (the superblock's count: the live tree's, the snapshots' and the
    /// snapshot list's blocks), for the progress estimate.
    fn bytes_used(&self) -> u64;
    /// Bytes in the device (bounds for the seen-block bitmap).
    fn total_bytes(&self) -> u64;
}

/// An unmounted image: its one committed tree and its snapshots, which nothing changes while
/// scrub reads them.
pub struct ImageViews {
    device: Arc<dyn BlockDevice>,
    superblock: birch_format::superblock::Superblock,
    snapshots: Vec<SnapshotTree>,
    list_damage: Vec<Damage>,
}

impl ImageViews {
    /// Reads the newest valid superblock of `device` and its snapshot list (from the device,
    /// each node verified; a list node that fails is reported as damage by the scrub, and
    /// the snapshots it held are not walked).
    pub fn open(device: Arc<dyn BlockDevice>) -> Result<ImageViews> {
        let (superblock, _notes) = Engine::read_superblock(&*device)?;
        let (snapshots, list_damage) =
            read_snapshot_list(&*device, superblock.fsid, superblock.snapshots);
        Ok(ImageViews {
            device,
            superblock,
            snapshots,
            list_damage,
        })
    }
}

/// The snapshot list tree at `root` (address 0: none), oldest first, read from the device;
/// and a damage for every list node that does not verify or holds an item that is not a
/// snapshot.
fn read_snapshot_list(
    device: &dyn BlockDevice,
    fsid: [u8; 16],
    root: RootPtr,
) -> (Vec<SnapshotTree>, Vec<Damage>) {
    let mut list = Vec::new();
    let mut damage = Vec::new();
    if root.addr == 0 {
        return (list, damage);
    }
    let mut stack = vec![(root.addr, root.generation, root.level)];
    while let Some((addr, generation, level)) = stack.pop() {
        let bad = |found: String| Damage {
            kind: DamageKind::Node,
            block: addr,
            generation: root.generation,
            keys: None,
            found,
            expected: format!(
                "a valid snapshot list node of generation {generation}, level {level}"
            ),
            owners: Vec::new(),
        };
        let node = match read_tree_node(device, fsid, addr, generation, level, SNAPSHOT_TREE_ID) {
            Ok(node) => node,
            Err(found) => {
                damage.push(bad(found));
                continue;
            }
        };
        match node.body {
            NodeBody::Internal(ptrs) => {
                stack.extend(
                    ptrs.iter()
                        .map(|p| (p.addr, p.generation, level.saturating_sub(1))),
                );
            }
            NodeBody::Leaf(items) => {
                for (key, value) in items {
                    let item = (key.kind() == Some(ItemType::Snapshot) && key.offset == 0)
                        .then(|| SnapshotItem::decode(&value).ok())
                        .flatten();
                    match item {
                        Some(item) => list.push(SnapshotTree {
                            id: key.objectid,
                            name: String::from_utf8_lossy(&item.name).into_owned(),
                            root: item.root,
                            generation: item.generation,
                        }),
                        None => damage.push(bad(format!("item {key} that is not a snapshot"))),
                    }
                }
            }
        }
    }
    list.sort_by_key(|s| s.id);
    (list, damage)
}

impl ImageViews {
    /// Records of the fsync log newer than the committed tree: what the next read-write
    /// mount replays (after a crash). Scrub does not cover them; the caller says so. Reads
    /// the log area.
    pub fn pending_log_records(&self) -> u64 {
        let replay = crate::log::read_log(&*self.device, &self.superblock);
        replay
            .records
            .iter()
            .filter(|r| r.generation > self.superblock.generation)
            .count() as u64
    }
}

impl ViewSource for ImageViews {
    fn newest(&self) -> Result<View> {
        Ok(View {
            root: self.superblock.fs_root,
            generation: self.superblock.generation,
            _pin: None,
        })
    }
    fn snapshots(&self) -> Result<Vec<SnapshotTree>> {
        Ok(self.snapshots.clone())
    }
    fn list_damage(&self) -> Vec<Damage> {
        self.list_damage.clone()
    }
    fn device(&self) -> &dyn BlockDevice {
        &*self.device
    }
    fn fsid(&self) -> [u8; 16] {
        self.superblock.fsid
    }
    fn bytes_used(&self) -> u64 {
        self.superblock.bytes_used
    }
    fn total_bytes(&self) -> u64 {
        self.superblock.total_bytes
    }
}

/// A live engine: each chunk reads under the newest committed root, held only for that
/// chunk.
pub struct EngineViews {
    engine: Arc<Engine>,
}

impl EngineViews {
    /// Views of `engine`'s commits.
    pub fn new(engine: Arc<Engine>) -> EngineViews {
        EngineViews { engine }
    }
}

impl ViewSource for EngineViews {
    fn newest(&self) -> Result<View> {
        self.engine.check_up()?;
        let committed = self.engine.committed_root();
        Ok(View {
            root: committed.root,
            generation: committed.generation.get(),
            _pin: Some(committed),
        })
    }
    fn snapshots(&self) -> Result<Vec<SnapshotTree>> {
        Ok(self
            .engine
            .snapshots()
            .iter()
            .map(SnapshotTree::from)
            .collect())
    }
    fn snapshot(&self, id: u64) -> Result<Option<SnapshotTree>> {
        Ok(self.engine.snapshot(id).as_ref().map(SnapshotTree::from))
    }
    fn device(&self) -> &dyn BlockDevice {
        &**self.engine.device()
    }
    fn fsid(&self) -> [u8; 16] {
        self.engine.fsid()
    }
    fn bytes_used(&self) -> u64 {
        self.engine.superblock().bytes_used
    }
    fn total_bytes(&self) -> u64 {
        self.engine.superblock().total_bytes
    }
}

/// Which tree a scrub position is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScrubTree {
    /// The live fs tree (the newest committed root).
    Live,
    /// The snapshot of this id.
    Snapshot(u64),
}

/// Where a cancelled scrub stopped, to resume from ([`ScrubOptions::resume_from`]): the tree
/// and the first key of the chunk that was not finished. The walk order is the live tree,
/// then each snapshot by ascending id; resuming at a snapshot that was deleted meanwhile
/// goes on with the next id. Written `live@OBJECTID:TYPE:OFFSET` or
/// `snapshot-ID@OBJECTID:TYPE:OFFSET` (its [`std::fmt::Display`] and [`std::str::FromStr`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScrubPosition {
    /// The tree.
    pub tree: ScrubTree,
    /// The key in it to start at.
    pub key: Key,
}

impl std::fmt::Display for ScrubPosition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.tree {
            ScrubTree::Live => write!(f, "live")?,
            ScrubTree::Snapshot(id) => write!(f, "snapshot-{id}")?,
        }
        write!(
            f,
            "@{}:{}:{}",
            self.key.objectid, self.key.item_type, self.key.offset
        )
    }
}

impl std::str::FromStr for ScrubPosition {
    type Err = Error;

    fn from_str(text: &str) -> Result<ScrubPosition> {
        let bad = || {
            Error::Invalid(format!(
                "scrub position {text:?}: expected live@OBJECTID:TYPE:OFFSET or \
                 snapshot-ID@OBJECTID:TYPE:OFFSET"
            ))
        };
        let (tree, key) = text.split_once('@').ok_or_else(bad)?;
        let tree = match tree {
            "live" => ScrubTree::Live,
            other => ScrubTree::Snapshot(
                other
                    .strip_prefix("snapshot-")
                    .and_then(|id| id.parse().ok())
                    .ok_or_else(bad)?,
            ),
        };
        let mut parts = key.split(':');
        let (Some(objectid), Some(item_type), Some(offset), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad());
        };
        let key = Key {
            objectid: objectid.parse().map_err(|_| bad())?,
            item_type: item_type.parse().map_err(|_| bad())?,
            offset: offset.parse().map_err(|_| bad())?,
        };
        Ok(ScrubPosition { tree, key })
    }
}

/// Scrub settings.
#[derive(Debug, Clone, Copy, Default)]
pub struct ScrubOptions {
    /// Read at most this many bytes per second (nodes and data together, over every tree);
    /// `None`: as fast as the device goes.
    pub rate_bytes_per_sec: Option<u64>,
    /// Start where a cancelled scrub stopped ([`ScrubReport::resume`]); `None`: at the start
    /// of the live tree.
    pub resume_from: Option<ScrubPosition>,
}

/// Live progress, shared with whoever shows it (a progress bar, the online status xattr).
#[derive(Debug, Default)]
pub struct ScrubProgress {
    /// Bytes read and verified so far.
    pub bytes_done: AtomicU64,
    /// Estimate of the bytes to read (what the superblock says is in use).
    pub bytes_total: AtomicU64,
    /// Damaged blocks found so far.
    pub damaged: AtomicU64,
    /// Set to stop the scrub at the next block; it then returns what it found so far.
    pub cancel: AtomicBool,
}

/// What a damaged block is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DamageKind {
    /// A tree node that cannot be read or fails to verify (checksum, header, owner, level).
    Node,
    /// A file data block whose crc32c differs from its extent's, or that cannot be read.
    Data,
}

impl DamageKind {
    /// `node` or `data`, as printed and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            DamageKind::Node => "node",
            DamageKind::Data => "data",
        }
    }
}

/// One inode a damaged block belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// Inode number.
    pub inode: u64,
    /// File offset of the block (data), if it has one.
    pub offset: Option<u64>,
    /// The snapshot whose tree the inode was found in (its name); `None`: the live tree.
    pub snapshot: Option<String>,
    /// That snapshot's id.
    pub snapshot_id: Option<u64>,
    /// Every path of the inode in that tree (one per hard link), as a mount shows it: a
    /// snapshot's under `/.snapshot/NAME`; empty when no name could be read.
    pub paths: Vec<String>,
}

/// One damaged block and everything that references it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damage {
    /// Node or data.
    pub kind: DamageKind,
    /// Byte address of the block (the node's first block).
    pub block: u64,
    /// Generation of the tree it was found (and confirmed) in: the newest committed view's
    /// for the live tree, the snapshot's own for a snapshot's.
    pub generation: u64,
    /// For a node: the key range its parent pointer gives it, `[low, high)`.
    pub keys: Option<(Key, Option<Key>)>,
    /// What was found, e.g. `crc32c 0x1234abcd` or the decode error.
    pub found: String,
    /// What the format requires, e.g. `crc32c 0xdeadbeef`.
    pub expected: String,
    /// Every owner: each inode (and file offset) that references the block, in every tree
    /// (live, snapshots) that references it; for a node, the inodes whose items its key
    /// range covers, in each tree it is part of.
    pub owners: Vec<Owner>,
}

/// What a scrub read and found.
#[derive(Debug, Default, Clone)]
pub struct ScrubReport {
    /// Tree nodes read and verified.
    pub nodes: u64,
    /// Data blocks read and verified.
    pub data_blocks: u64,
    /// Bytes read (nodes and data).
    pub bytes: u64,
    /// Chunks of keys walked, each under the newest view at its start.
    pub chunks: u64,
    /// Snapshot trees walked to their end.
    pub snapshots: u64,
    /// Snapshots deleted while the scrub walked them (the rest of their tree was skipped).
    pub snapshots_deleted_during_scrub: u64,
    /// Subtrees not walked again: already walked whole and clean in another tree (a
    /// snapshot shares them with the live tree or an older snapshot).
    pub shared_subtrees_skipped: u64,
    /// Distinct committed generations the chunks read under.
    pub generations: u64,
    /// Blocks that failed under one view but were no longer referenced (or changed) under
    /// the newest one: freed or rewritten during the scrub, not reported.
    pub changed_during_scrub: u64,
    /// Damaged blocks, in the order found.
    pub damage: Vec<Damage>,
    /// The scrub was cancelled before it finished.
    pub cancelled: bool,
    /// When cancelled: where to resume ([`ScrubOptions::resume_from`]).
    pub resume: Option<ScrubPosition>,
    /// Wall-clock time of the scrub.
    pub elapsed: Duration,
}

impl ScrubReport {
    /// No damage found.
    pub fn is_clean(&self) -> bool {
        self.damage.is_empty()
    }

    /// Average read rate in MB/s (10^6 bytes).
    pub fn rate_mb_per_sec(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs > 0.0 {
            self.bytes as f64 / 1e6 / secs
        } else {
            0.0
        }
    }

    /// The report as one JSON object (the format `birch scrub --json` prints and the online
    /// status carries): counts, `clean`, `cancelled`, `resume` (the position to resume a
    /// cancelled scrub from, or null), `healed` (always false: scrub cannot heal with one
    /// copy of each block) and `damage`, each with its kind, block, generation, found,
    /// expected and owners (inode, offset, snapshot name and id or null for the live tree,
    /// paths).
    pub fn to_json(&self) -> String {
        let damage: Vec<String> = self.damage.iter().map(damage_json).collect();
        format!(
            "{{\"clean\": {}, \"cancelled\": {}, \"resume\": {}, \"healed\": false, \"nodes\": {}, \"data_blocks\": {}, \"bytes\": {}, \"chunks\": {}, \"snapshots\": {}, \"snapshots_deleted_during_scrub\": {}, \"shared_subtrees_skipped\": {}, \"generations\": {}, \"changed_during_scrub\": {}, \"elapsed_sec\": {:.3}, \"rate_mb_per_sec\": {:.1}, \"damaged\": {}, \"damage\": [{}]}}",
            self.is_clean(),
            self.cancelled,
            self.resume
                .map_or("null".to_string(), |p| json_string(&p.to_string())),
            self.nodes,
            self.data_blocks,
            self.bytes,
            self.chunks,
            self.snapshots,
            self.snapshots_deleted_during_scrub,
            self.shared_subtrees_skipped,
            self.generations,
            self.changed_during_scrub,
            self.elapsed.as_secs_f64(),
            self.rate_mb_per_sec(),
            self.damage.len(),
            damage.join(", ")
        )
    }
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "damaged {} block {:#x} (generation {})",
            self.kind.name(),
            self.block,
            self.generation
        )?;
        if let Some((low, high)) = &self.keys {
            match high {
                Some(h) => write!(f, ", keys [{low}, {h})")?,
                None => write!(f, ", keys [{low}, end)")?,
            }
        }
        write!(f, ": found {}, expected {}", self.found, self.expected)?;
        for owner in &self.owners {
            write!(f, "; inode {}", owner.inode)?;
            if let Some(offset) = owner.offset {
                write!(f, " offset {offset}")?;
            }
            if owner.paths.is_empty() {
                match &owner.snapshot {
                    Some(name) => write!(f, " (path unknown, in snapshot {name:?})")?,
                    None => write!(f, " (path unknown)")?,
                }
            }
            for path in &owner.paths {
                write!(f, " {path}")?;
            }
        }
        Ok(())
    }
}

/// JSON string literal of `text`.
pub fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn damage_json(d: &Damage) -> String {
    let owners: Vec<String> = d
        .owners
        .iter()
        .map(|o| {
            let paths: Vec<String> = o.paths.iter().map(|p| json_string(p)).collect();
            let offset = o.offset.map_or("null".to_string(), |v| v.to_string());
            let snapshot = o.snapshot.as_deref().map_or("null".to_string(), json_string);
            let snapshot_id = o.snapshot_id.map_or("null".to_string(), |v| v.to_string());
            format!(
                "{{\"inode\": {}, \"offset\": {offset}, \"snapshot\": {snapshot}, \"snapshot_id\": {snapshot_id}, \"paths\": [{}]}}",
                o.inode,
                paths.join(", ")
            )
        })
        .collect();
    let keys = match &d.keys {
        Some((low, high)) => format!(
            "{{\"low\": {}, \"high\": {}}}",
            json_string(&low.to_string()),
            high.map_or("null".to_string(), |h| json_string(&h.to_string()))
        ),
        None => "null".to_string(),
    };
    format!(
        "{{\"kind\": \"{}\", \"block\": {}, \"generation\": {}, \"keys\": {keys}, \"found\": {}, \"expected\": {}, \"owners\": [{}]}}",
        d.kind.name(),
        d.block,
        d.generation,
        json_string(&d.found),
        json_string(&d.expected),
        owners.join(", ")
    )
}

/// Scrubs the trees `views` gives: the live tree, then every snapshot's by ascending id (a
/// snapshot made during the scrub included), each walked through its key space in chunks,
/// each chunk under the newest view at its start, reading every node and every data block
/// it references. A block referenced twice (by two extents, or by the live tree and a
/// snapshot) is read once and reported with every owner; a subtree already walked whole and
/// clean in another tree (same address and generation: the same content) is not walked
/// again, so each snapshot costs what changed since its neighbour. Checksums are verified,
/// and each failure is confirmed under the newest view (a snapshot's: while the snapshot
/// still exists) before it is reported. Starts at [`ScrubOptions::resume_from`]; when
/// cancelled, [`ScrubReport::resume`] says where to go on. Errors only when the walk cannot
/// go on at all (no view, the engine shut down); a bad block is a [`Damage`]. Does device
/// I/O; holds no engine lock while it does.
pub fn scrub(
    views: &dyn ViewSource,
    options: ScrubOptions,
    progress: &ScrubProgress,
) -> Result<ScrubReport> {
    let started = Instant::now();
    progress
        .bytes_total
        .store(views.bytes_used(), Ordering::Relaxed);
    let mut walk = Walk {
        views,
        fsid: views.fsid(),
        options,
        progress,
        started,
        seen_nodes: HashSet::new(),
        walked: HashMap::new(),
        failures: 0,
        node_trees: HashMap::new(),
        seen_blocks: Bitmap::new(views.total_bytes() / BLOCK_SIZE),
        pending: Vec::new(),
        report: ScrubReport::default(),
        leaves: 0,
        data_bytes: 0,
    };
    for damage in views.list_damage() {
        progress.damaged.fetch_add(1, Ordering::Relaxed);
        walk.report.damage.push(damage);
    }
    let mut generations = BTreeSet::new();
    let (mut tree, mut cursor) = start_at(views, options.resume_from)?;
    while let Some(current) = tree.clone() {
        if progress.cancel.load(Ordering::Relaxed) {
            walk.cancel_at(&current, cursor);
            break;
        }
        let view = views.newest()?;
        // The view is taken first: a snapshot still listed now keeps its blocks while the
        // view is held (a deletion's frees wait for every older view).
        let root = match &current {
            Tree::Live => view.root,
            Tree::Snapshot(snapshot) => match views.snapshot(snapshot.id)? {
                Some(now) if now.root == snapshot.root => snapshot.root,
                _ => {
                    drop(view);
                    walk.report.snapshots_deleted_during_scrub += 1;
                    tree = next_snapshot(views, Some(snapshot.id))?;
                    cursor = Key::MIN;
                    continue;
                }
            },
        };
        generations.insert(view.generation);
        walk.report.chunks += 1;
        walk.leaves = 0;
        walk.data_bytes = 0;
        let place = Place {
            tree: &current,
            generation: match &current {
                Tree::Live => view.generation,
                Tree::Snapshot(s) => s.generation,
            },
        };
        let flow = walk.visit(
            &place,
            NodeRef {
                addr: root.addr,
                generation: root.generation,
                level: root.level,
            },
            (Key::MIN, None),
            cursor,
        )?;
        drop(view);
        match flow {
            Flow::Done => {
                if let Tree::Snapshot(s) = &current {
                    walk.report.snapshots += 1;
                    tree = next_snapshot(views, Some(s.id))?;
                } else {
                    tree = next_snapshot(views, None)?;
                }
                cursor = Key::MIN;
            }
            Flow::StopAt(next) => cursor = next,
            Flow::Cancelled(at) => {
                walk.cancel_at(&current, at);
                tree = None;
            }
        }
        walk.confirm_pending()?;
        walk.throttle();
    }
    let node_trees = std::mem::take(&mut walk.node_trees);
    let mut report = walk.report;
    report.generations = generations.len() as u64;
    resolve_owners(views, &mut report, &node_trees)?;
    report.elapsed = started.elapsed();
    Ok(report)
}

/// The tree and key a scrub starts at: the live tree's start, or `resume`'s (a snapshot
/// deleted since: the next one's start).
fn start_at(views: &dyn ViewSource, resume: Option<ScrubPosition>) -> Result<(Option<Tree>, Key)> {
    match resume {
        None => Ok((Some(Tree::Live), Key::MIN)),
        Some(ScrubPosition {
            tree: ScrubTree::Live,
            key,
        }) => Ok((Some(Tree::Live), key)),
        Some(ScrubPosition {
            tree: ScrubTree::Snapshot(id),
            key,
        }) => match views.snapshot(id)? {
            Some(s) => Ok((Some(Tree::Snapshot(s)), key)),
            None => Ok((next_snapshot(views, Some(id))?, Key::MIN)),
        },
    }
}

/// The first snapshot with an id above `after` (`None`: the oldest).
fn next_snapshot(views: &dyn ViewSource, after: Option<u64>) -> Result<Option<Tree>> {
    Ok(views
        .snapshots()?
        .into_iter()
        .find(|s| after.is_none_or(|a| s.id > a))
        .map(Tree::Snapshot))
}

/// A tree the walk reads.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Tree {
    /// The live fs tree: the newest committed root, taken again for every chunk.
    Live,
    /// A snapshot's tree, fixed while it exists.
    Snapshot(SnapshotTree),
}

impl Tree {
    fn position(&self, key: Key) -> ScrubPosition {
        ScrubPosition {
            tree: match self {
                Tree::Live => ScrubTree::Live,
                Tree::Snapshot(s) => ScrubTree::Snapshot(s.id),
            },
            key,
        }
    }

    /// An owner in this tree.
    fn owner(&self, inode: u64, offset: Option<u64>) -> Owner {
        let (snapshot, snapshot_id) = match self {
            Tree::Live => (None, None),
            Tree::Snapshot(s) => (Some(s.name.clone()), Some(s.id)),
        };
        Owner {
            inode,
            offset,
            snapshot,
            snapshot_id,
            paths: Vec::new(),
        }
    }
}

/// The tree a chunk walks and the generation its damage is reported with.
struct Place<'a> {
    tree: &'a Tree,
    generation: u64,
}

enum Flow {
    /// The subtree is walked to its end.
    Done,
    /// The chunk's budget ran out: the next chunk starts at this key.
    StopAt(Key),
    /// The scrub was cancelled in the middle of the subtree: every key before this one
    /// was walked (a scrub resumes here).
    Cancelled(Key),
}

/// A failure seen under one view, to be confirmed under the newest before it is reported.
struct Pending {
    damage: Damage,
    /// The tree it was found in.
    tree: Tree,
    /// For data: the extent item that referenced the block and the block's index in it.
    extent: Option<(Key, usize)>,
}

struct Walk<'a> {
    views: &'a dyn ViewSource,
    fsid: [u8; 16],
    options: ScrubOptions,
    progress: &'a ScrubProgress,
    started: Instant,
    /// Nodes verified, by (address, generation): a node rewritten in place of a freed one is
    /// new content and is read again.
    seen_nodes: HashSet<(u64, u64)>,
    /// Nodes whose whole subtree was walked in one chunk, by (address, generation), and
    /// whether a failure was found (or an owner added) beneath: a clean one is not walked
    /// again from another tree, one with damage is (to add that tree's owners).
    walked: HashMap<(u64, u64), bool>,
    /// Failures found and owners added so far: a subtree's walk that leaves it unchanged
    /// found nothing beneath.
    failures: u64,
    /// Every tree each damaged node was found in, by address (its owners are named per
    /// tree).
    node_trees: HashMap<u64, Vec<Tree>>,
    /// Data blocks read, by block number.
    seen_blocks: Bitmap,
    pending: Vec<Pending>,
    report: ScrubReport,
    /// Leaves and data bytes of the current chunk.
    leaves: u64,
    data_bytes: u64,
}

/// A node the walk is to visit: where it is, the generation its parent names, its level.
#[derive(Clone, Copy)]
struct NodeRef {
    addr: u64,
    generation: u64,
    level: u8,
}

impl Walk<'_> {
    /// Records a cancel in `tree` with every key before `key` walked: the scrub resumes there.
    fn cancel_at(&mut self, tree: &Tree, key: Key) {
        self.report.cancelled = true;
        self.report.resume = Some(tree.position(key));
    }

    /// Visits the subtree at `node` covering `range` (`[low, high)`), skipping keys before
    /// `from`.
    fn visit(
        &mut self,
        place: &Place<'_>,
        node: NodeRef,
        range: (Key, Option<Key>),
        from: Key,
    ) -> Result<Flow> {
        let NodeRef {
            addr,
            generation,
            level,
        } = node;
        let (low, high) = range;
        if self.progress.cancel.load(Ordering::Relaxed) {
            // The subtrees before this one were walked to their ends, in key order.
            return Ok(Flow::Cancelled(low.max(from)));
        }
        let whole = from <= low;
        if whole && self.walked.get(&(addr, generation)) == Some(&false) {
            self.report.shared_subtrees_skipped += 1;
            return Ok(Flow::Done);
        }
        let first_visit = !self.seen_nodes.contains(&(addr, generation));
        let node = match read_tree_node(
            self.views.device(),
            self.fsid,
            addr,
            generation,
            level,
            FS_TREE_ID,
        ) {
            Ok(node) => node,
            Err(found) => {
                self.node_failed(place, node, range, found, first_visit);
                return Ok(Flow::Done);
            }
        };
        if first_visit {
            self.seen_nodes.insert((addr, generation));
            self.report.nodes += 1;
            self.account(NODE_SIZE as u64);
        }
        let before = self.failures;
        let flow = match node.body {
            NodeBody::Internal(ptrs) => {
                let mut flow = Flow::Done;
                for (slot, ptr) in ptrs.iter().enumerate() {
                    let child_high = ptrs.get(slot + 1).map(|p| p.key).or(high);
                    if child_high.is_some_and(|h| h <= from) {
                        continue;
                    }
                    let child_low = if slot == 0 { low } else { ptr.key };
                    flow = self.visit(
                        place,
                        NodeRef {
                            addr: ptr.addr,
                            generation: ptr.generation,
                            level: level.saturating_sub(1),
                        },
                        (child_low, child_high),
                        from,
                    )?;
                    if !matches!(flow, Flow::Done) {
                        break;
                    }
                }
                if whole && matches!(flow, Flow::Done) {
                    self.walked
                        .insert((addr, generation), self.failures != before);
                }
                flow
            }
            NodeBody::Leaf(leaf) => {
                for (key, value) in &leaf {
                    if *key < from || key.item_type != ItemType::ExtentData as u8 {
                        continue;
                    }
                    // An extent that does not decode is fsck's finding, not scrub's: its
                    // node verified, so the bytes are what was written.
                    if let Ok(items::Item::Extent(extent)) =
                        items::Item::decode(ItemType::ExtentData, value)
                    {
                        self.scrub_extent(place, key, &extent)?;
                    }
                }
                // Every item from `from` on was read: with nothing skipped, the leaf is whole.
                if whole {
                    self.walked
                        .insert((addr, generation), self.failures != before);
                }
                self.leaves += 1;
                if self.leaves >= CHUNK_LEAVES || self.data_bytes >= CHUNK_DATA_BYTES {
                    match high {
                        Some(h) => Flow::StopAt(h),
                        None => Flow::Done,
                    }
                } else {
                    Flow::Done
                }
            }
        };
        Ok(flow)
    }

    /// A node that does not read or verify: a failure to confirm the first time, one more
    /// tree it is part of after that.
    fn node_failed(
        &mut self,
        place: &Place<'_>,
        node: NodeRef,
        range: (Key, Option<Key>),
        found: String,
        first_visit: bool,
    ) {
        let NodeRef {
            addr,
            generation,
            level,
        } = node;
        self.failures += 1;
        let trees = self.node_trees.entry(addr).or_default();
        if !trees.contains(place.tree) {
            trees.push(place.tree.clone());
        }
        if !first_visit {
            return;
        }
        self.seen_nodes.insert((addr, generation));
        self.account(NODE_SIZE as u64);
        self.pending.push(Pending {
            damage: Damage {
                kind: DamageKind::Node,
                block: addr,
                generation: place.generation,
                keys: Some(range),
                found,
                expected: format!("a valid fs tree node of generation {generation}, level {level}"),
                owners: Vec::new(),
            },
            tree: place.tree.clone(),
            extent: None,
        });
    }

    /// Reads the blocks of one regular extent not read before, in one I/O where possible, and
    /// checks each against its crc32c.
    fn scrub_extent(&mut self, place: &Place<'_>, key: &Key, extent: &FileExtent) -> Result<()> {
        let (disk_addr, csums) = match &extent.kind {
            ExtentKind::Regular { disk_addr, csums } => (disk_addr, csums),
            // A blob's stored blocks carry a crc32c each: checked without decoding.
            ExtentKind::Blob(blob) => (&blob.disk_addr, &blob.csums),
            // No data block with a checksum to read: inline bytes are in the leaf (checked
            // with it), preallocated blocks read as zeros.
            ExtentKind::Inline(_) | ExtentKind::Prealloc { .. } => return Ok(()),
        };
        let owner = place.tree.owner(key.objectid, Some(key.offset));
        // A block read before: clean, or damaged and waiting; add this owner to its damage.
        let mut to_read = Vec::with_capacity(csums.len());
        for index in 0..csums.len() {
            let at = disk_addr.saturating_add(index as u64 * BLOCK_SIZE);
            let block = at / BLOCK_SIZE;
            if self.seen_blocks.get(block) {
                self.add_owner(at, &owner);
            } else {
                self.seen_blocks.set(block);
                to_read.push(index);
            }
        }
        let (first, last) = match (to_read.first(), to_read.last()) {
            (Some(f), Some(l)) => (*f, *l),
            _ => return Ok(()),
        };
        let span = last - first + 1;
        let start = disk_addr.saturating_add(first as u64 * BLOCK_SIZE);
        let mut buf = vec![0u8; span * BLOCK_SIZE as usize];
        let whole = self.views.device().read_at(&mut buf, start);
        self.account(to_read.len() as u64 * BLOCK_SIZE);
        self.data_bytes += to_read.len() as u64 * BLOCK_SIZE;
        for index in to_read {
            self.report.data_blocks += 1;
            let at = disk_addr.saturating_add(index as u64 * BLOCK_SIZE);
            let expected = csums.get(index).copied().unwrap_or_default();
            let found = match &whole {
                Ok(()) => {
                    let from = (index - first) * BLOCK_SIZE as usize;
                    let bytes = buf.get(from..from + BLOCK_SIZE as usize).unwrap_or(&[]);
                    let got = birch_format::checksum(bytes);
                    if got == expected {
                        continue;
                    }
                    format!("crc32c {got:#010x}")
                }
                // One bad sector fails the whole read: read this block alone to tell.
                Err(_) => match read_block_crc(self.views.device(), at) {
                    Ok(got) if got == expected => continue,
                    Ok(got) => format!("crc32c {got:#010x}"),
                    Err(e) => format!("a read error: {e}"),
                },
            };
            self.failures += 1;
            self.pending.push(Pending {
                damage: Damage {
                    kind: DamageKind::Data,
                    block: at,
                    generation: place.generation,
                    keys: None,
                    found,
                    expected: format!("crc32c {expected:#010x}"),
                    owners: vec![owner.clone()],
                },
                tree: place.tree.clone(),
                extent: Some((*key, index)),
            });
        }
        Ok(())
    }

    /// Another extent (in this tree or another) references a block already read: if it is
    /// damaged, this is one more owner of it.
    fn add_owner(&mut self, at: u64, owner: &Owner) {
        let found = self
            .pending
            .iter_mut()
            .map(|p| &mut p.damage)
            .chain(self.report.damage.iter_mut())
            .find(|d| d.kind == DamageKind::Data && d.block == at);
        if let Some(damage) = found {
            self.failures += 1;
            if !damage.owners.contains(owner) {
                damage.owners.push(owner.clone());
            }
        }
    }

    /// Counts bytes read.
    fn account(&mut self, bytes: u64) {
        self.report.bytes += bytes;
        let done = self.progress.bytes_done.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if done > self.progress.bytes_total.load(Ordering::Relaxed) {
            self.progress.bytes_total.store(done, Ordering::Relaxed);
        }
    }

    /// Sleeps as long as the rate limit asks (over everything read since the scrub started,
    /// in every tree). Called between chunks, with no view held: a slow scrub must not keep
    /// freed space pinned while it waits.
    fn throttle(&self) {
        if let Some(rate) = self.options.rate_bytes_per_sec.filter(|r| *r > 0) {
            let due = Duration::from_secs_f64(self.report.bytes as f64 / rate as f64);
            // In slices, so that a cancel is seen soon.
            while !self.progress.cancel.load(Ordering::Relaxed) {
                let elapsed = self.started.elapsed();
                if due <= elapsed {
                    break;
                }
                std::thread::sleep((due - elapsed).min(Duration::from_millis(100)));
            }
        }
    }

    /// Confirms each failure of the last chunk under the newest view: a data block still
    /// referenced by the same extent item with the same checksum and still failing is
    /// damage; one freed or rewritten since is not. A node still reachable at the same
    /// address and generation and still failing is damage. A snapshot's failure is looked
    /// up under the snapshot's root, while the snapshot (same id, same root) still exists;
    /// a deleted one's is not damage. What is not confirmed is forgotten as read, so that
    /// another tree that still references it reads it again.
    fn confirm_pending(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let view = self.views.newest()?;
        let device = self.views.device();
        for pending in std::mem::take(&mut self.pending) {
            let mut damage = pending.damage;
            let root = match &pending.tree {
                Tree::Live => Some((view.root, view.generation)),
                Tree::Snapshot(s) => self
                    .views
                    .snapshot(s.id)?
                    .filter(|now| now.root == s.root)
                    .map(|now| (now.root, now.generation)),
            };
            let still = root.is_some_and(|(root, _)| match (damage.kind, pending.extent) {
                (DamageKind::Data, Some((key, index))) => {
                    confirm_data(device, self.fsid, root, &key, index, damage.block)
                }
                _ => confirm_node(device, self.fsid, root, &damage),
            });
            match root {
                Some((_, generation)) if still => {
                    damage.generation = generation;
                    self.progress.damaged.fetch_add(1, Ordering::Relaxed);
                    self.report.damage.push(damage);
                }
                _ => {
                    self.report.changed_during_scrub += 1;
                    self.forget_read(&damage);
                }
            }
        }
        Ok(())
    }

    /// Forgets that the block of an unconfirmed failure was read.
    fn forget_read(&mut self, damage: &Damage) {
        match damage.kind {
            DamageKind::Data => self.seen_blocks.clear(damage.block / BLOCK_SIZE),
            DamageKind::Node => {
                self.seen_nodes.retain(|(addr, _)| *addr != damage.block);
                self.node_trees.remove(&damage.block);
            }
        }
    }
}

/// Whether `key` still names an extent with the block at `at` as its `index`th, and that
/// block still fails its checksum.
fn confirm_data(
    device: &dyn BlockDevice,
    fsid: [u8; 16],
    root: RootPtr,
    key: &Key,
    index: usize,
    at: u64,
) -> bool {
    let Ok(Some(value)) = lookup(device, fsid, root, key) else {
        // The item is gone, or the path to it no longer reads (that node is then reported
        // on its own).
        return false;
    };
    let Ok(items::Item::Extent(extent)) = items::Item::decode(ItemType::ExtentData, &value) else {
        return false;
    };
    let (disk_addr, csums) = match &extent.kind {
        ExtentKind::Regular { disk_addr, csums } => (disk_addr, csums),
        ExtentKind::Blob(blob) => (&blob.disk_addr, &blob.csums),
        // Only a regular extent or a blob has a checksummed data block to fail.
        ExtentKind::Inline(_) | ExtentKind::Prealloc { .. } => return false,
    };
    if disk_addr.saturating_add(index as u64 * BLOCK_SIZE) != at {
        return false;
    }
    let Some(expected) = csums.get(index) else {
        return false;
    };
    !matches!(read_block_crc(device, at), Ok(got) if got == *expected)
}

/// Whether the node of `damage` is still part of the tree at `root` and still fails.
fn confirm_node(device: &dyn BlockDevice, fsid: [u8; 16], root: RootPtr, damage: &Damage) -> bool {
    let Some((low, _)) = damage.keys else {
        return true;
    };
    // Descend toward the node's low key; the damaged node must be on that path.
    let mut addr = root.addr;
    let mut generation = root.generation;
    let mut level = root.level;
    loop {
        let node = match read_node(device, fsid, addr, generation, level) {
            Ok(node) => node,
            Err(_) => return addr == damage.block,
        };
        if addr == damage.block {
            // It reads now: whatever failed was not on disk (a transient read error).
            return false;
        }
        let NodeBody::Internal(ptrs) = node.body else {
            return false;
        };
        let Some(ptr) = ptrs.iter().rev().find(|p| p.key <= low).or(ptrs.first()) else {
            return false;
        };
        addr = ptr.addr;
        generation = ptr.generation;
        level = level.saturating_sub(1);
    }
}

/// Reads and verifies one node of the fs tree (also `fsck --repair`'s salvage); the error
/// says what was wrong, in words.
pub(crate) fn read_node(
    device: &dyn BlockDevice,
    fsid: [u8; 16],
    addr: u64,
    generation: u64,
    level: u8,
) -> std::result::Result<Node, String> {
    read_tree_node(device, fsid, addr, generation, level, FS_TREE_ID)
}

/// Reads and verifies one node of the tree `owner` (the fs tree, whose snapshots' nodes
/// carry the same owner, or the snapshot list) from the device.
fn read_tree_node(
    device: &dyn BlockDevice,
    fsid: [u8; 16],
    addr: u64,
    generation: u64,
    level: u8,
    owner: u64,
) -> std::result::Result<Node, String> {
    let mut bytes = vec![0u8; NODE_SIZE];
    device
        .read_at(&mut bytes, addr)
        .map_err(|e| format!("a read error: {e}"))?;
    let expect = Expect {
        fsid,
        addr,
        generation,
        owner,
        level: Some(level),
    };
    Node::decode(&bytes, &expect).map_err(|e| e.to_string())
}

fn read_block_crc(device: &dyn BlockDevice, at: u64) -> Result<u32> {
    let mut block = vec![0u8; BLOCK_SIZE as usize];
    device
        .read_at(&mut block, at)
        .map_err(|e| Error::io(format!("scrub: data block {at:#x}"), e))?;
    Ok(birch_format::checksum(&block))
}

/// The value of `key` in the tree at `root`, read from the device.
fn lookup(
    device: &dyn BlockDevice,
    fsid: [u8; 16],
    root: RootPtr,
    key: &Key,
) -> std::result::Result<Option<Vec<u8>>, String> {
    let mut out = Vec::new();
    let hi = key.successor().unwrap_or(Key::MAX);
    collect_range(device, fsid, root, key, &hi, &mut out)?;
    Ok(out.into_iter().find(|(k, _)| k == key).map(|(_, v)| v))
}

/// Every item in `[lo, hi)` of the tree at `root`, read from the device. Fails on the first
/// node that does not verify.
fn collect_range(
    device: &dyn BlockDevice,
    fsid: [u8; 16],
    root: RootPtr,
    lo: &Key,
    hi: &Key,
    out: &mut Vec<(Key, Vec<u8>)>,
) -> std::result::Result<(), String> {
    let mut stack = vec![(root.addr, root.generation, root.level, None::<Key>)];
    while let Some((addr, generation, level, high)) = stack.pop() {
        let node = read_node(device, fsid, addr, generation, level)
            .map_err(|e| format!("fs tree node {addr:#x} generation {generation}: {e}"))?;
        match node.body {
            NodeBody::Leaf(leaf) => out.extend(leaf.into_iter().filter(|(k, _)| k >= lo && k < hi)),
            NodeBody::Internal(ptrs) => {
                // Push in reverse so children pop in key order.
                for (slot, ptr) in ptrs.iter().enumerate().rev() {
                    let child_high = ptrs.get(slot + 1).map(|p| p.key).or(high);
                    if ptr.key >= *hi && slot > 0 {
                        continue;
                    }
                    if child_high.is_some_and(|h| h <= *lo) {
                        continue;
                    }
                    stack.push((
                        ptr.addr,
                        ptr.generation,
                        level.saturating_sub(1),
                        child_high,
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Fills in the owners of every damage: a node's inodes (the object ids its key range
/// covers, at most [`NODE_OWNERS_MAX`], in each tree of `node_trees` it was found in) and
/// every path of every owner, in the owner's tree: the live tree's under the newest view, a
/// snapshot's under its root (while it still exists), prefixed `/.snapshot/NAME`.
fn resolve_owners(
    views: &dyn ViewSource,
    report: &mut ScrubReport,
    node_trees: &HashMap<u64, Vec<Tree>>,
) -> Result<()> {
    if report.damage.is_empty() {
        return Ok(());
    }
    let view = views.newest()?;
    let device = views.device();
    let fsid = views.fsid();
    for damage in &mut report.damage {
        if damage.kind != DamageKind::Node {
            continue;
        }
        let Some((low, high)) = damage.keys else {
            continue;
        };
        let first = low.objectid.max(ROOT_OBJECTID);
        let last = high.map_or(first, |h| {
            if h.item_type == 0 && h.offset == 0 {
                h.objectid.saturating_sub(1)
            } else {
                h.objectid
            }
        });
        let last = last.min(first.saturating_add(NODE_OWNERS_MAX - 1));
        let live = [Tree::Live];
        let trees = node_trees.get(&damage.block).map_or(&live[..], |t| &t[..]);
        damage.owners = trees
            .iter()
            .flat_map(|tree| {
                (first..=last.max(first))
                    .filter(|ino| *ino < birch_format::ORPHAN_OBJECTID)
                    .map(|inode| tree.owner(inode, None))
            })
            .collect();
    }
    let mut resolvers: HashMap<Option<u64>, PathResolver<'_>> = HashMap::new();
    for damage in &mut report.damage {
        for owner in &mut damage.owners {
            let resolver = match resolvers.entry(owner.snapshot_id) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    // A snapshot deleted since has no paths: its blocks may be reused.
                    let (root, prefix) = match owner.snapshot_id {
                        None => (Some(view.root), String::new()),
                        Some(id) => match views.snapshot(id)? {
                            Some(s) => (Some(s.root), format!("/.snapshot/{}", s.name)),
                            None => (None, String::new()),
                        },
                    };
                    e.insert(PathResolver {
                        device,
                        fsid,
                        root,
                        prefix,
                        names: HashMap::new(),
                        by_entries: None,
                    })
                }
            };
            owner.paths = resolver.paths(owner.inode);
        }
        // A node's owners whose names cannot be read are only a guess from its key range.
        if damage.kind == DamageKind::Node && damage.owners.len() > 1 {
            damage.owners.retain(|o| !o.paths.is_empty());
        }
    }
    Ok(())
}

/// Turns inode numbers into paths by walking inode refs up to the root; where a ref cannot
/// be read (it sits in a damaged node), by the directory entries naming the inode instead.
struct PathResolver<'a> {
    device: &'a dyn BlockDevice,
    fsid: [u8; 16],
    /// The tree's root; `None`: the tree is gone (a deleted snapshot), no paths.
    root: Option<RootPtr>,
    /// What the tree's paths are shown under in a mount: empty for the live tree,
    /// `/.snapshot/NAME` for a snapshot's.
    prefix: String,
    /// Names of an inode: (parent, name), cached.
    names: HashMap<u64, Vec<(u64, String)>>,
    /// child -> (parent, name) from every readable dir index, built on first need.
    by_entries: Option<BTreeMap<u64, Vec<(u64, String)>>>,
}

impl PathResolver<'_> {
    fn names_of(&mut self, inode: u64) -> Vec<(u64, String)> {
        if let Some(names) = self.names.get(&inode) {
            return names.clone();
        }
        let Some(root) = self.root else {
            return Vec::new();
        };
        let (lo, hi) = crate::items::inode_refs_range(InodeNo::new(inode));
        let mut items_out = Vec::new();
        let names = match collect_range(self.device, self.fsid, root, &lo, &hi, &mut items_out) {
            Ok(()) => items_out
                .iter()
                .filter_map(|(_, v)| match items::Item::decode(ItemType::InodeRef, v) {
                    Ok(items::Item::InodeRefs(refs)) => Some(refs),
                    _ => None,
                })
                .flatten()
                .map(|r| (r.parent, String::from_utf8_lossy(&r.name).into_owned()))
                .collect(),
            Err(_) => self.names_by_entries(inode),
        };
        self.names.insert(inode, names.clone());
        names
    }

    /// The names of `inode` by the directory entries that point to it (a full walk of the
    /// readable tree, once).
    fn names_by_entries(&mut self, inode: u64) -> Vec<(u64, String)> {
        if self.by_entries.is_none() {
            let mut map: BTreeMap<u64, Vec<(u64, String)>> = BTreeMap::new();
            let mut leaves = Vec::new();
            if let Some(root) = self.root {
                readable_items(self.device, self.fsid, root, &mut leaves);
            }
            for (key, value) in leaves {
                if key.item_type != ItemType::DirIndex as u8 {
                    continue;
                }
                if let Ok(items::Item::DirIndex(e)) =
                    items::Item::decode(ItemType::DirIndex, &value)
                {
                    map.entry(e.child)
                        .or_default()
                        .push((key.objectid, String::from_utf8_lossy(&e.name).into_owned()));
                }
            }
            self.by_entries = Some(map);
        }
        self.by_entries
            .as_ref()
            .and_then(|m| m.get(&inode).cloned())
            .unwrap_or_default()
    }

    /// Every path of `inode`: one per name, each parent by its first name; under the
    /// tree's prefix.
    fn paths(&mut self, inode: u64) -> Vec<String> {
        if self.root.is_none() {
            return Vec::new();
        }
        if inode == ROOT_OBJECTID {
            return vec![self.shown("/")];
        }
        let mut out = Vec::new();
        for (parent, name) in self.names_of(inode) {
            if let Some(dir) = self.dir_path(parent) {
                let sep = if dir.ends_with('/') { "" } else { "/" };
                out.push(self.shown(&format!("{dir}{sep}{name}")));
            }
        }
        out
    }

    /// `path` of the tree as a mount shows it.
    fn shown(&self, path: &str) -> String {
        match (self.prefix.is_empty(), path) {
            (true, _) => path.to_string(),
            (false, "/") => self.prefix.clone(),
            (false, _) => format!("{}{path}", self.prefix),
        }
    }

    fn dir_path(&mut self, mut dir: u64) -> Option<String> {
        let mut parts = Vec::new();
        for _ in 0..PATH_DEPTH_MAX {
            if dir == ROOT_OBJECTID {
                parts.reverse();
                return Some(format!("/{}", parts.join("/")));
            }
            let (parent, name) = self.names_of(dir).into_iter().next()?;
            parts.push(name);
            dir = parent;
        }
        None
    }
}

/// Every item of every node under `root` that reads and verifies (damaged subtrees skipped).
fn readable_items(
    device: &dyn BlockDevice,
    fsid: [u8; 16],
    root: RootPtr,
    out: &mut Vec<(Key, Vec<u8>)>,
) {
    let mut stack = vec![(root.addr, root.generation, root.level)];
    while let Some((addr, generation, level)) = stack.pop() {
        let Ok(node) = read_node(device, fsid, addr, generation, level) else {
            continue;
        };
        match node.body {
            NodeBody::Leaf(leaf) => out.extend(leaf),
            NodeBody::Internal(ptrs) => {
                for ptr in ptrs {
                    stack.push((ptr.addr, ptr.generation, level.saturating_sub(1)));
                }
            }
        }
    }
}

/// One bit per device block.
struct Bitmap {
    words: Vec<u64>,
}

impl Bitmap {
    fn new(bits: u64) -> Bitmap {
        Bitmap {
            words: vec![0; bits.div_ceil(64) as usize],
        }
    }

    fn get(&self, bit: u64) -> bool {
        self.words
            .get((bit / 64) as usize)
            .is_some_and(|w| w & (1 << (bit % 64)) != 0)
    }

    fn set(&mut self, bit: u64) {
        if let Some(w) = self.words.get_mut((bit / 64) as usize) {
            *w |= 1 << (bit % 64);
        }
    }

    fn clear(&mut self, bit: u64) {
        if let Some(w) = self.words.get_mut((bit / 64) as usize) {
            *w &= !(1 << (bit % 64));
        }
    }
}

/// Online scrub rate when the caller names none: 100 MB/s leaves most of a disk's bandwidth
/// to the filesystem's users.
pub const ONLINE_RATE_DEFAULT_BYTES_PER_SEC: u64 = 100_000_000;

/// Damage entries the online status carries: the status is an xattr value, at most 64 KiB.
const STATUS_DAMAGE_MAX: usize = 100;

/// A scrub running in a thread of its own (the online scrub a mount serves): its progress is
/// read while it runs, its report once it is done.
pub struct ScrubJob {
    progress: Arc<ScrubProgress>,
    outcome: Arc<parking_lot::Mutex<Option<std::result::Result<ScrubReport, String>>>>,
    handle: Option<std::thread::JoinHandle<()>>,
    options: ScrubOptions,
    started: Instant,
}

impl ScrubJob {
    /// Starts a scrub of `views` in a new thread.
    pub fn start(views: Arc<dyn ViewSource>, options: ScrubOptions) -> Result<ScrubJob> {
        let progress = Arc::new(ScrubProgress::default());
        let outcome = Arc::new(parking_lot::Mutex::new(None));
        let handle = {
            let progress = progress.clone();
            let outcome = outcome.clone();
            std::thread::Builder::new()
                .name("birch-scrub".into())
                .spawn(move || {
                    let result = scrub(&*views, options, &progress).map_err(|e| e.to_string());
                    if let Err(e) = &result {
                        log::warn!("scrub failed: {e}");
                    }
                    *outcome.lock() = Some(result);
                })
                .map_err(|e| Error::io("scrub: starting its thread", e))?
        };
        Ok(ScrubJob {
            progress,
            outcome,
            handle: Some(handle),
            options,
            started: Instant::now(),
        })
    }

    /// Whether the scrub is still running.
    pub fn is_running(&self) -> bool {
        self.outcome.lock().is_none()
    }

    /// The report once the scrub is done (`None` while it runs or when it failed).
    pub fn report(&self) -> Option<ScrubReport> {
        match self.outcome.lock().as_ref() {
            Some(Ok(report)) => Some(report.clone()),
            _ => None,
        }
    }

    /// Asks the scrub to stop at its next block.
    pub fn cancel(&self) {
        self.progress.cancel.store(true, Ordering::SeqCst);
    }

    /// Cancels the scrub and waits for its thread.
    pub fn stop(&mut self) {
        self.cancel();
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }

    /// The status as JSON: `state` (`running`, `done` or `failed`), `bytes_done`,
    /// `bytes_total`, `damaged`, `rate_bytes_per_sec` (0: unlimited), `elapsed_sec`, and once
    /// done `report` (as [`ScrubReport::to_json`], with at most 100 damage entries; `damaged`
    /// counts them all) or once failed `error`.
    pub fn status_json(&self) -> String {
        let outcome = self.outcome.lock();
        let (state, tail) = match outcome.as_ref() {
            None => ("running", String::new()),
            Some(Ok(report)) => {
                let mut shown = report.clone();
                shown.damage.truncate(STATUS_DAMAGE_MAX);
                ("done", format!(", \"report\": {}", shown.to_json()))
            }
            Some(Err(e)) => ("failed", format!(", \"error\": {}", json_string(e))),
        };
        format!(
            "{{\"state\": \"{state}\", \"bytes_done\": {}, \"bytes_total\": {}, \"damaged\": {}, \"rate_bytes_per_sec\": {}, \"elapsed_sec\": {:.3}{tail}}}",
            self.progress.bytes_done.load(Ordering::Relaxed),
            self.progress.bytes_total.load(Ordering::Relaxed),
            outcome
                .as_ref()
                .and_then(|o| o.as_ref().ok())
                .map_or(self.progress.damaged.load(Ordering::Relaxed), |r| r.damage.len() as u64),
            self.options.rate_bytes_per_sec.unwrap_or(0),
            self.started.elapsed().as_secs_f64()
        )
    }
}

impl Drop for ScrubJob {
    fn drop(&mut self) {
        self.stop();
    }
}
