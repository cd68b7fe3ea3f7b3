//! fsck: read-only checks of everything the format promises, as ordered named passes.
//!
//! Owns: the passes (superblocks; node validity, key order and pointer keys; reachability:
//! every block referenced once, inside the device, outside reserved areas; items: inode ↔
//! names ↔ nlink, dir item ↔ dir index, orphans, extents against size and overlap, data
//! checksums), listed with stable ids, names and dependencies in [`PASSES`], and the named
//! [`FindingKind`]s they report, each with a stable number ([`FindingKind::code`]).
//!
//! Must not touch: any writer. It recomputes what it expects from the raw items and never
//! reuses writer helpers for the "expected" side. (The one exception, [`check_replayed`],
//! lets the filesystem replay a pending log into a memory overlay, then checks the result
//! with the same passes; the image is never written.)

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use birch_format::items::SnapshotItem;
use birch_format::items::{self, ExtentKind, FileExtent, InodeItem};
use birch_format::node::{Expect, Node, NodeBody};
use birch_format::superblock::{
    Superblock, INCOMPAT_BLOB_EXTENTS, INCOMPAT_SHARED_EXTENTS, INCOMPAT_SNAPSHOTS,
    RESERVED_HEAD_BYTES, SUPER_BYTES, SUPER_OFFSETS,
};
use birch_format::{
    ItemType, Key, BLOCK_SIZE, FS_TREE_ID, INLINE_MAX_BYTES, NODE_BLOCKS, NODE_SIZE, ROOT_OBJECTID,
    SNAPSHOT_TREE_ID,
};

use crate::device::{BlockDevice, OverlayDevice};
use crate::error::Result;
use crate::txn::Engine;

/// Every kind of problem fsck names. Each has a stable number ([`FindingKind::code`], printed
/// with every finding) that scripts may match: a number is never reused or changed, and a new
/// kind takes the next one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u16)]
pub enum FindingKind {
    /// A superblock copy is unreadable or invalid, or the two copies disagree on the fsid.
    SuperblockSlotBad = 1,
    /// A tree node cannot be read from the device or fails to decode (checksum, header,
    /// expected owner, generation or level).
    NodeUnreadable = 2,
    /// A key in a node lies outside the key range its parent pointer allows.
    NodeKeyOutOfRange = 3,
    /// An internal node's pointer key differs from the first key of the child it points to.
    PointerKeyMismatch = 4,
    /// A block is referenced by two nodes or extents (or a node and an extent).
    BlockReferencedTwice = 5,
    /// A node or extent lies (partly) past the end of the device or is not block-aligned.
    BlockOutOfBounds = 6,
    /// A node or extent overlaps the reserved head (superblocks) or the fsync log area.
    BlockInReservedArea = 7,
    /// A leaf item has an unknown type code or a payload that does not decode.
    ItemUndecodable = 8,
    /// Items exist for an object id that has no inode item.
    ItemWithoutInode = 9,
    /// An inode's nlink differs from its inode refs (files) or 2 + subdirectories (dirs).
    InodeNlinkMismatch = 10,
    /// A dir item (by name hash) has no matching dir index entry.
    DirItemWithoutIndex = 11,
    /// A dir index entry has no matching dir item, or its stored index differs from its key.
    DirIndexWithoutItem = 12,
    /// A directory entry names an inode that does not exist.
    DirEntryDangling = 13,
    /// An inode ref names a parent entry that does not exist.
    InodeRefWithoutDirEntry = 14,
    /// A directory entry whose child has no inode ref back to it.
    DirEntryWithoutInodeRef = 15,
    /// A directory's size differs from its number of entries.
    DirSizeMismatch = 16,
    /// An inode with no names and no orphan item: it would leak.
    OrphanMissing = 17,
    /// An orphan item for an inode that no longer exists.
    OrphanStale = 18,
    /// A regular extent starts at a file offset that is not block-aligned.
    ExtentMisaligned = 19,
    /// A file extent starts before the end of the previous one.
    ExtentOverlap = 20,
    /// An extent starts (regular) or ends (inline) past the file size.
    ExtentPastSize = 21,
    /// An inline extent not at offset 0, larger than `INLINE_MAX_BYTES`, or not the
    /// file's only extent.
    InlineExtentInvalid = 22,
    /// A data block's crc32c differs from its extent's checksum (only with
    /// [`CheckOptions::data`]).
    DataChecksumMismatch = 23,
    /// A data block could not be read (only with [`CheckOptions::data`]).
    DataUnreadable = 24,
    /// The root directory (inode 1) has no inode item.
    RootDirMissing = 25,
    /// An out-of-line xattr value (FORMAT.md §6.8) whose chunks are missing, misnamed,
    /// misplaced or do not add up to its size and crc32c; a chunk no xattr entry claims; or
    /// chunks on an image without the `INCOMPAT_XATTR_CHUNKS` flag.
    XattrChunkMismatch = 26,
    /// The snapshot list (FORMAT.md §3.2) cannot be read, or an item in it does not decode, or
    /// its snapshots' ids, generations and names are not in order and unique.
    SnapshotListUnreadable = 27,
    /// A snapshot's tree cannot be read whole: its root or a node does not read or verify, is
    /// newer than the snapshot, or is reached at another generation than another tree has it;
    /// or an extent in it is newer than the snapshot.
    SnapshotTreeDamaged = 28,
    /// A snapshot's node lies on blocks another tree's node or extent holds (not the same,
    /// shared node), or a snapshot's extent lies on a node's blocks, outside the device or in
    /// a reserved area.
    SnapshotBlockConflict = 29,
    /// A shared (flagged, kind 3) extent on blocks an unshared extent or a node also holds,
    /// or a shared extent on an image without the `INCOMPAT_SHARED_EXTENTS` flag.
    SharedExtentConflict = 30,
    /// A snapshot whose tree is newer than the live tree (its root node was written after
    /// the live tree's): not a past state of the live tree, as every kept tree must be
    /// (DESIGN §15.4); left by a fallback to an older tree. Deleting it or a neighbour could
    /// free blocks the live tree uses, so a mount refuses snapshot changes while it exists;
    /// `fsck --repair` deletes it.
    SnapshotOutsideLineage = 31,
    /// Log replay stops at a batch that verifies but names a data block that fails its
    /// checksum (or lies outside the data area), and a valid batch follows it. The writer
    /// starts a batch only after the previous one's flush, so the rejected batch was durable
    /// and the fsyncs of it and of every later batch were answered: replay drops them. The
    /// block was lost or overwritten after the flush (a device that loses writes, or a bug).
    LogBatchesLost = 32,
    /// A blob extent (kind 4) on an image without the `INCOMPAT_BLOB_EXTENTS` flag, or items
    /// naming one blob (its address) that disagree on anything but their windows: codec,
    /// lengths, stored blocks or their checksums.
    BlobExtentConflict = 33,
}

impl FindingKind {
    /// Every kind, in number order.
    pub const ALL: [FindingKind; 33] = [
        FindingKind::SuperblockSlotBad,
        FindingKind::NodeUnreadable,
        FindingKind::NodeKeyOutOfRange,
        FindingKind::PointerKeyMismatch,
        FindingKind::BlockReferencedTwice,
        FindingKind::BlockOutOfBounds,
        FindingKind::BlockInReservedArea,
        FindingKind::ItemUndecodable,
        FindingKind::ItemWithoutInode,
        FindingKind::InodeNlinkMismatch,
        FindingKind::DirItemWithoutIndex,
        FindingKind::DirIndexWithoutItem,
        FindingKind::DirEntryDangling,
        FindingKind::InodeRefWithoutDirEntry,
        FindingKind::DirEntryWithoutInodeRef,
        FindingKind::DirSizeMismatch,
        FindingKind::OrphanMissing,
        FindingKind::OrphanStale,
        FindingKind::ExtentMisaligned,
        FindingKind::ExtentOverlap,
        FindingKind::ExtentPastSize,
        FindingKind::InlineExtentInvalid,
        FindingKind::DataChecksumMismatch,
        FindingKind::DataUnreadable,
        FindingKind::RootDirMissing,
        FindingKind::XattrChunkMismatch,
        FindingKind::SnapshotListUnreadable,
        FindingKind::SnapshotTreeDamaged,
        FindingKind::SnapshotBlockConflict,
        FindingKind::SharedExtentConflict,
        FindingKind::SnapshotOutsideLineage,
        FindingKind::LogBatchesLost,
        FindingKind::BlobExtentConflict,
    ];

    /// The kind's stable number (see [`FindingKind`]).
    pub fn code(self) -> u16 {
        self as u16
    }
}

/// The stable id of an fsck pass ([`PASSES`]): its number never changes, a new pass takes the
/// next one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum PassId {
    /// Both superblock copies.
    Superblocks = 1,
    /// The nodes of the fs tree and the blocks they take.
    Tree = 2,
    /// Every leaf item on its own.
    Items = 3,
    /// Out-of-line xattr values and their chunks.
    XattrChunks = 4,
    /// Directory entries, inode refs and link counts.
    Names = 5,
    /// Orphan items.
    Orphans = 6,
    /// File extents and the blocks they take.
    Extents = 7,
    /// Data block checksums (`--data`).
    Data = 8,
    /// The fsync log waiting for replay.
    Log = 9,
    /// The snapshot list and every snapshot's tree.
    Snapshots = 10,
}

/// One fsck pass: what it checks and what it needs checked first. A pass is a set of checks
/// with the findings they report, not necessarily a walk of its own: the item passes
/// (`items` to `data`) run in one sweep over the sorted items, `extents` and `data` per inode
/// inside the loop over inodes that `names` and `orphans` make, so their findings interleave
/// by inode.
#[derive(Debug, Clone, Copy)]
pub struct Pass {
    /// Stable id.
    pub id: PassId,
    /// Short name, as `birch fsck --list-passes` prints it.
    pub name: &'static str,
    /// Passes whose results this one reads.
    pub depends_on: &'static [PassId],
    /// What it checks, in one line.
    pub checks: &'static str,
    /// The kinds of finding it may report (the block kinds come from two passes).
    pub finds: &'static [FindingKind],
}

/// The passes of [`check`], in the order they run.
pub const PASSES: [Pass; 10] = [
    Pass {
        id: PassId::Superblocks,
        name: "superblocks",
        depends_on: &[],
        checks: "both superblock copies decode, sit in their own slots and share one fsid; the newest names the tree",
        finds: &[FindingKind::SuperblockSlotBad],
    },
    Pass {
        id: PassId::Tree,
        name: "tree",
        depends_on: &[PassId::Superblocks],
        checks: "every node reachable from the root reads and verifies, keeps its keys in its parent's range and its pointer keys equal to its children's first keys; its blocks are in bounds, outside the reserved areas and referenced once",
        finds: &[
            FindingKind::NodeUnreadable,
            FindingKind::NodeKeyOutOfRange,
            FindingKind::PointerKeyMismatch,
            FindingKind::BlockReferencedTwice,
            FindingKind::BlockOutOfBounds,
            FindingKind::BlockInReservedArea,
        ],
    },
    Pass {
        id: PassId::Items,
        name: "items",
        depends_on: &[PassId::Tree],
        checks: "every leaf item has a known type and decodes, and every object with items has an inode item",
        finds: &[FindingKind::ItemUndecodable, FindingKind::ItemWithoutInode],
    },
    Pass {
        id: PassId::XattrChunks,
        name: "xattr-chunks",
        depends_on: &[PassId::Items],
        checks: "every out-of-line xattr value has exactly its chunks, adding up to its size and crc32c, on an image with the chunk flag",
        finds: &[FindingKind::XattrChunkMismatch],
    },
    Pass {
        id: PassId::Names,
        name: "names",
        depends_on: &[PassId::Items],
        checks: "dir items and dir indexes mirror each other, entries name inodes that ref them back, refs name entries, the root directory exists, link counts and directory sizes match the names",
        finds: &[
            FindingKind::DirItemWithoutIndex,
            FindingKind::DirIndexWithoutItem,
            FindingKind::DirEntryDangling,
            FindingKind::DirEntryWithoutInodeRef,
            FindingKind::RootDirMissing,
            FindingKind::InodeRefWithoutDirEntry,
            FindingKind::InodeNlinkMismatch,
            FindingKind::DirSizeMismatch,
        ],
    },
    Pass {
        id: PassId::Orphans,
        name: "orphans",
        depends_on: &[PassId::Names],
        checks: "an inode without names has an orphan item, and every orphan item names an inode",
        finds: &[FindingKind::OrphanMissing, FindingKind::OrphanStale],
    },
    Pass {
        id: PassId::Extents,
        name: "extents",
        depends_on: &[PassId::Tree, PassId::Items],
        checks: "each file's extents are block-aligned, ordered without overlap and within its size (an inline one alone at offset 0 and small); their blocks are in bounds, outside the reserved areas and referenced once, or only by shared (flagged) extents",
        finds: &[
            FindingKind::ExtentMisaligned,
            FindingKind::ExtentOverlap,
            FindingKind::ExtentPastSize,
            FindingKind::InlineExtentInvalid,
            FindingKind::BlockReferencedTwice,
            FindingKind::BlockOutOfBounds,
            FindingKind::BlockInReservedArea,
            FindingKind::SharedExtentConflict,
            FindingKind::BlobExtentConflict,
        ],
    },
    Pass {
        id: PassId::Data,
        name: "data",
        depends_on: &[PassId::Extents],
        checks: "with --data: every data block a live extent references reads and matches the extent's crc32c (the blocks only snapshots hold: the snapshots pass)",
        finds: &[FindingKind::DataChecksumMismatch, FindingKind::DataUnreadable],
    },
    Pass {
        id: PassId::Log,
        name: "log",
        depends_on: &[PassId::Superblocks],
        checks: "counts the log batches the next read-write mount replays, and finds a batch replay must stop at (it names data that fails its checksum) with a valid batch after it: acknowledged fsyncs replay would drop (with batches, birch fsck also checks the log replayed in memory)",
        finds: &[FindingKind::LogBatchesLost],
    },
    Pass {
        id: PassId::Snapshots,
        name: "snapshots",
        depends_on: &[PassId::Tree, PassId::Extents],
        checks: "the snapshot list reads, its snapshots are in order with unique names and none is newer than the live tree; every snapshot's tree reads whole (nodes shared with newer trees at the same generation, nothing newer than the snapshot), and its own nodes and extents take blocks no other node or different extent holds; with --data, the data blocks only snapshots hold read and match their crc32c",
        finds: &[
            FindingKind::SnapshotListUnreadable,
            FindingKind::SnapshotTreeDamaged,
            FindingKind::SnapshotBlockConflict,
            FindingKind::SnapshotOutsideLineage,
            FindingKind::DataChecksumMismatch,
            FindingKind::DataUnreadable,
        ],
    },
];

impl FindingKind {
    /// Whether the kind says the tree itself is damaged (the `tree` pass): its nodes cannot
    /// all be read or trusted, so no item repair can work on it (`fsck --repair` falls back
    /// to an older root instead, DESIGN §13.4).
    pub fn is_structural(self) -> bool {
        matches!(
            self,
            FindingKind::NodeUnreadable
                | FindingKind::NodeKeyOutOfRange
                | FindingKind::PointerKeyMismatch
        )
    }
}

impl PassId {
    /// The pass's stable number.
    pub fn number(self) -> u8 {
        self as u8
    }
}

/// One problem: where, what was found, what was expected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// What kind of problem.
    pub kind: FindingKind,
    /// Block (byte address) or node, if the finding has one.
    pub block: Option<u64>,
    /// Tree, generation and slot, where known.
    pub location: String,
    /// What fsck found there, in words.
    pub found: String,
    /// What the format requires instead.
    pub expected: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} [{:03}]: ", self.kind, self.kind.code())?;
        if let Some(block) = self.block {
            write!(f, "block {block:#x} ")?;
        }
        write!(
            f,
            "{}: found {}, expected {}",
            self.location, self.found, self.expected
        )
    }
}

/// What fsck looked at and found.
#[derive(Debug, Default)]
pub struct Report {
    /// The superblock the check used (the newest valid copy); set when the check finished.
    pub superblock: Option<Superblock>,
    /// Every problem found, in pass order; empty for a clean image.
    pub findings: Vec<Finding>,
    /// Tree nodes visited.
    pub nodes: u64,
    /// Leaf items visited.
    pub items: u64,
    /// Inode items checked.
    pub inodes: u64,
    /// Data blocks referenced by regular extents (in blocks, not bytes).
    pub data_blocks: u64,
    /// Log batches after the last commit that the next read-write open will replay, their
    /// records, and why reading the log stopped. A torn tail is normal after a crash, not a
    /// finding: the committed tree checked here is consistent on its own, and replay applies
    /// only batches that verify.
    pub log_batches: u64,
    /// Records in those batches newer than the committed generation.
    pub log_records: u64,
    /// Why reading the log stopped (end of log, torn batch, ...).
    pub log_stop: String,
}

impl Report {
    /// No findings.
    pub fn is_clean(&self) -> bool {
        self.findings.is_empty()
    }

    fn add(
        &mut self,
        kind: FindingKind,
        block: Option<u64>,
        location: impl Into<String>,
        found: impl ToString,
        expected: impl ToString,
    ) {
        self.findings.push(Finding {
            kind,
            block,
            location: location.into(),
            found: found.to_string(),
            expected: expected.to_string(),
        });
    }
}

/// fsck options.
#[derive(Debug, Clone, Copy, Default)]
pub struct CheckOptions {
    /// Also read every data block and verify its checksum.
    pub data: bool,
}

/// Checks the state a read-write mount would see: the log's batches replayed and committed
/// into a copy-on-write overlay in memory, the image itself untouched. For an image whose
/// [`Report::log_batches`] is not zero (after a crash with fsyncs since the last commit).
pub fn check_replayed(device: Arc<dyn BlockDevice>, options: CheckOptions) -> Result<Report> {
    let overlay = Arc::new(OverlayDevice::new(device));
    let fs = crate::Filesystem::open_device(
        overlay.clone(),
        crate::vfs::OpenOptions {
            commit_interval: None,
            ..Default::default()
        },
    )?;
    fs.close()?;
    drop(fs);
    check(&*overlay, options)
}

/// Checks the committed state on `device`. Errors only when the image cannot be read at all
/// (no valid superblock); every problem inside is a finding.
pub fn check(device: &dyn BlockDevice, options: CheckOptions) -> Result<Report> {
    check_with_root(device, None, options)
}

/// [`check`] of the tree at `root` instead of the newest superblock's `fs_root` (a backup
/// root, for `fsck --repair`'s fallback; DESIGN §13.4). The other superblock fields are the
/// newest copy's.
pub fn check_with_root(
    device: &dyn BlockDevice,
    root: Option<birch_format::superblock::RootPtr>,
    options: CheckOptions,
) -> Result<Report> {
    let mut report = Report::default();
    let (mut sb, notes) = Engine::read_superblock(device)?;
    if let Some(root) = root {
        sb.fs_root = root;
    }
    for note in notes {
        report.add(
            FindingKind::SuperblockSlotBad,
            None,
            "superblock",
            note,
            "two valid copies",
        );
    }
    check_superblock_pair(device, &sb, &mut report);
    let mut used: HashMap<u64, &'static str> = HashMap::new();
    let mut items: Vec<(Key, Vec<u8>)> = Vec::new();
    let mut nodes: HashMap<u64, u64> = HashMap::new();
    walk_tree(device, &sb, &mut report, &mut used, &mut items, &mut nodes);
    // The walk visits leaves depth-first from a stack; the item passes want key order.
    items.sort_by_key(|a| a.0);
    report.items = items.len() as u64;
    check_items(device, &sb, &items, &mut used, options, &mut report);
    check_snapshots(device, &sb, options, &mut used, &mut nodes, &mut report);
    let replay = crate::log::read_log(device, &sb);
    report.log_batches = replay.batches;
    report.log_records = replay
        .records
        .iter()
        .filter(|r| r.generation > sb.generation)
        .count() as u64;
    if let Some(next) = replay.followed_by {
        report.add(
            FindingKind::LogBatchesLost,
            replay.rejected_at,
            "fsync log",
            format!(
                "replay stops ({}) and batch {next} follows: it and every later batch were acknowledged",
                replay.stop
            ),
            "every batch followed by another names only blocks that verify",
        );
    }
    report.log_stop = replay.stop;
    report.superblock = Some(sb);
    Ok(report)
}

fn check_superblock_pair(device: &dyn BlockDevice, sb: &Superblock, report: &mut Report) {
    let other = 1 - sb.slot();
    let mut bytes = vec![0u8; SUPER_BYTES];
    if device.read_at(&mut bytes, SUPER_OFFSETS[other]).is_ok() {
        if let Ok(o) = Superblock::decode(&bytes, "superblock") {
            if o.fsid != sb.fsid {
                report.add(
                    FindingKind::SuperblockSlotBad,
                    Some(SUPER_OFFSETS[other]),
                    format!("superblock slot {other}"),
                    "a different fsid",
                    "the fsid of the newest slot",
                );
            }
        }
    }
}

fn walk_tree(
    device: &dyn BlockDevice,
    sb: &Superblock,
    report: &mut Report,
    used: &mut HashMap<u64, &'static str>,
    items: &mut Vec<(Key, Vec<u8>)>,
    nodes: &mut HashMap<u64, u64>,
) {
    // (addr, generation, level, low bound, high bound, parent description)
    let root = sb.fs_root;
    let mut stack = vec![(
        root.addr,
        root.generation,
        root.level,
        Key::MIN,
        None::<Key>,
        "fs tree root".to_string(),
    )];
    while let Some((addr, generation, level, low, high, from)) = stack.pop() {
        let location = format!("fs tree node from {from}, generation {generation}");
        if !claim(sb, used, addr, NODE_BLOCKS, "node", &location, report) {
            continue;
        }
        let mut bytes = vec![0u8; NODE_SIZE];
        if let Err(e) = device.read_at(&mut bytes, addr) {
            report.add(
                FindingKind::NodeUnreadable,
                Some(addr),
                location,
                e,
                "a readable node",
            );
            continue;
        }
        let expect = Expect {
            fsid: sb.fsid,
            addr,
            generation,
            owner: FS_TREE_ID,
            level: Some(level),
        };
        let node = match Node::decode(&bytes, &expect) {
            Ok(node) => node,
            Err(e) => {
                report.add(
                    FindingKind::NodeUnreadable,
                    Some(addr),
                    location,
                    e,
                    "a valid node",
                );
                continue;
            }
        };
        report.nodes += 1;
        nodes.insert(addr, generation);
        let keys: Vec<Key> = match &node.body {
            NodeBody::Leaf(leaf) => leaf.iter().map(|(k, _)| *k).collect(),
            NodeBody::Internal(ptrs) => ptrs.iter().map(|p| p.key).collect(),
        };
        for (slot, key) in keys.iter().enumerate() {
            if *key < low || high.is_some_and(|h| *key >= h) {
                let bound = match high {
                    Some(h) => format!("a key in [{low}, {h})"),
                    None => format!("a key >= {low}"),
                };
                report.add(
                    FindingKind::NodeKeyOutOfRange,
                    Some(addr),
                    format!("{location}, slot {slot}"),
                    format!("key {key}"),
                    bound,
                );
            }
        }
        match node.body {
            NodeBody::Leaf(leaf) => items.extend(leaf),
            NodeBody::Internal(ptrs) => {
                for (slot, ptr) in ptrs.iter().enumerate() {
                    let child_high = ptrs.get(slot + 1).map(|p| p.key).or(high);
                    stack.push((
                        ptr.addr,
                        ptr.generation,
                        level - 1,
                        ptr.key,
                        child_high,
                        format!("node {addr:#x} slot {slot}"),
                    ));
                }
                // Pointer keys must equal the child's first key: check lazily by reading the
                // first child key when the child is visited (NodeKeyOutOfRange covers order;
                // here we check the exact bound).
                for (slot, ptr) in ptrs.iter().enumerate() {
                    let mut child = vec![0u8; NODE_SIZE];
                    if device.read_at(&mut child, ptr.addr).is_ok() {
                        let expect = Expect {
                            fsid: sb.fsid,
                            addr: ptr.addr,
                            generation: ptr.generation,
                            owner: FS_TREE_ID,
                            level: Some(level - 1),
                        };
                        if let Ok(c) = Node::decode(&child, &expect) {
                            if c.is_empty() {
                                // Only a root may be empty (an empty filesystem tree is one
                                // empty leaf); an empty child has no key for its pointer.
                                report.add(
                                    FindingKind::PointerKeyMismatch,
                                    Some(addr),
                                    format!("fs tree node generation {generation}, slot {slot}"),
                                    format!("pointer key {} to an empty node", ptr.key),
                                    "a child holding the pointer's key",
                                );
                            }
                            if let Some(first) = c.first_key() {
                                if first != ptr.key {
                                    report.add(
                                        FindingKind::PointerKeyMismatch,
                                        Some(addr),
                                        format!(
                                            "fs tree node generation {generation}, slot {slot}"
                                        ),
                                        format!("pointer key {}", ptr.key),
                                        format!("the child's first key {first}"),
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Reads and decodes the node at `addr` as its parent (or the superblock) promised it.
fn read_node(
    device: &dyn BlockDevice,
    sb: &Superblock,
    addr: u64,
    generation: u64,
    level: u8,
    owner: u64,
) -> std::result::Result<Node, String> {
    let mut bytes = vec![0u8; NODE_SIZE];
    device
        .read_at(&mut bytes, addr)
        .map_err(|e| e.to_string())?;
    let expect = Expect {
        fsid: sb.fsid,
        addr,
        generation,
        owner,
        level: Some(level),
    };
    Node::decode(&bytes, &expect).map_err(|e| e.to_string())
}

/// The snapshots pass (DESIGN §15.7): the list, then every snapshot's tree, newest first,
/// each distinct node once. `used` holds the blocks the live tree took ("node", "data"),
/// `nodes` its nodes (address → generation); both grow with what the snapshots add. A data
/// block an earlier tree's extent took is accepted as shared when the snapshot's extent was
/// born at or before the snapshot (the blocks' owners are not kept, so two different extents
/// on one block across trees are not told apart here).
fn check_snapshots(
    device: &dyn BlockDevice,
    sb: &Superblock,
    options: CheckOptions,
    used: &mut HashMap<u64, &'static str>,
    nodes: &mut HashMap<u64, u64>,
    report: &mut Report,
) {
    if sb.incompat & INCOMPAT_SNAPSHOTS == 0 || sb.snapshots.addr == 0 {
        return;
    }
    let mut list: Vec<(u64, SnapshotItem)> = Vec::new();
    let root = sb.snapshots;
    let mut stack = vec![(root.addr, root.generation, root.level)];
    while let Some((addr, generation, level)) = stack.pop() {
        let location = format!("snapshot list node, generation {generation}");
        if !claim(
            sb,
            used,
            addr,
            NODE_BLOCKS,
            "snapshot list node",
            &location,
            report,
        ) {
            continue;
        }
        let node = match read_node(device, sb, addr, generation, level, SNAPSHOT_TREE_ID) {
            Ok(node) => node,
            Err(e) => {
                report.add(
                    FindingKind::SnapshotListUnreadable,
                    Some(addr),
                    location,
                    e,
                    "a valid snapshot list node",
                );
                continue;
            }
        };
        match node.body {
            NodeBody::Internal(ptrs) => {
                stack.extend(ptrs.iter().map(|p| (p.addr, p.generation, level - 1)));
            }
            NodeBody::Leaf(leaf) => {
                for (key, value) in leaf {
                    let decoded = if key.kind() == Some(ItemType::Snapshot) && key.offset == 0 {
                        SnapshotItem::decode(&value).map_err(|e| e.to_string())
                    } else {
                        Err(format!("item {key}"))
                    };
                    match decoded {
                        Ok(item) => list.push((key.objectid, item)),
                        Err(e) => report.add(
                            FindingKind::SnapshotListUnreadable,
                            Some(addr),
                            format!("snapshot list item {key}"),
                            e,
                            "a snapshot item (id, snapshot, 0)",
                        ),
                    }
                }
            }
        }
    }
    list.sort_by_key(|(id, _)| *id);
    let mut names = HashSet::new();
    let mut above = 0;
    for (id, item) in &list {
        let name = String::from_utf8_lossy(&item.name).into_owned();
        if *id >= sb.next_snapshot_id
            || item.generation <= above
            || item.generation > sb.generation
            || !names.insert(name.clone())
        {
            report.add(
                FindingKind::SnapshotListUnreadable,
                None,
                format!("snapshot {name:?} (id {id})"),
                format!("generation {} after {above}", item.generation),
                format!(
                    "an id below {}, generations ascending with ids up to {}, a unique name",
                    sb.next_snapshot_id, sb.generation
                ),
            );
        }
        above = above.max(item.generation);
        if item.root.generation > sb.fs_root.generation {
            report.add(
                FindingKind::SnapshotOutsideLineage,
                Some(item.root.addr),
                format!(
                    "snapshot {name:?} (id {id}, generation {})",
                    item.generation
                ),
                format!(
                    "a tree whose root node has generation {}",
                    item.root.generation
                ),
                format!(
                    "a past state of the live tree: a root node of generation {} or older",
                    sb.fs_root.generation
                ),
            );
        }
    }
    let tree = SnapshotTreeCheck {
        device,
        sb,
        options,
    };
    for (id, item) in list.iter().rev() {
        tree.check(*id, item, used, nodes, report);
    }
}

/// What every snapshot's check shares, for [`check_snapshots`].
struct SnapshotTreeCheck<'a> {
    device: &'a dyn BlockDevice,
    sb: &'a Superblock,
    options: CheckOptions,
}

impl SnapshotTreeCheck<'_> {
    /// One snapshot's tree.
    fn check(
        &self,
        id: u64,
        item: &SnapshotItem,
        used: &mut HashMap<u64, &'static str>,
        nodes: &mut HashMap<u64, u64>,
        report: &mut Report,
    ) {
        let SnapshotTreeCheck { device, sb, .. } = *self;
        let name = format!(
            "snapshot {:?} (id {id}, generation {})",
            String::from_utf8_lossy(&item.name),
            item.generation
        );
        let root = item.root;
        let mut stack = vec![(root.addr, root.generation, root.level, "root".to_string())];
        while let Some((addr, generation, level, from)) = stack.pop() {
            let location = format!("{name}: node {addr:#x} from {from}, generation {generation}");
            match nodes.get(&addr) {
                Some(g) if *g == generation => continue,
                Some(g) => {
                    report.add(
                        FindingKind::SnapshotTreeDamaged,
                        Some(addr),
                        location,
                        format!("generation {generation}"),
                        format!("generation {g}, as another tree has the node"),
                    );
                    continue;
                }
                None => {}
            }
            if generation > item.generation {
                report.add(
                    FindingKind::SnapshotTreeDamaged,
                    Some(addr),
                    location,
                    format!("generation {generation}"),
                    format!("a node born at or before generation {}", item.generation),
                );
                continue;
            }
            let node = match read_node(device, sb, addr, generation, level, FS_TREE_ID) {
                Ok(node) => node,
                Err(e) => {
                    report.add(
                        FindingKind::SnapshotTreeDamaged,
                        Some(addr),
                        location,
                        e,
                        "a valid node",
                    );
                    continue;
                }
            };
            nodes.insert(addr, generation);
            report.nodes += 1;
            if let Some(prev) = (0..NODE_BLOCKS)
                .map(|b| addr + b * BLOCK_SIZE)
                .find_map(|at| used.get(&at).copied())
            {
                report.add(
                    FindingKind::SnapshotBlockConflict,
                    Some(addr),
                    location,
                    format!("a node on a block a {prev} holds"),
                    "a node on blocks of its own",
                );
                continue;
            }
            for b in 0..NODE_BLOCKS {
                used.insert(addr + b * BLOCK_SIZE, "snapshot node");
            }
            match node.body {
                NodeBody::Internal(ptrs) => {
                    for (slot, p) in ptrs.iter().enumerate() {
                        stack.push((
                            p.addr,
                            p.generation,
                            level - 1,
                            format!("node {addr:#x} slot {slot}"),
                        ));
                    }
                }
                NodeBody::Leaf(leaf) => {
                    for (key, value) in leaf {
                        if key.kind() != Some(ItemType::ExtentData) {
                            continue;
                        }
                        let Ok(extent) = FileExtent::decode(&value) else {
                            report.add(
                                FindingKind::SnapshotTreeDamaged,
                                Some(addr),
                                format!("{name}: extent {key}"),
                                "an extent that does not decode",
                                "a valid extent",
                            );
                            continue;
                        };
                        if extent.generation > item.generation {
                            report.add(
                                FindingKind::SnapshotTreeDamaged,
                                Some(addr),
                                format!("{name}: extent {key}"),
                                format!("generation {}", extent.generation),
                                format!("born at or before {}", item.generation),
                            );
                        }
                        let Some((disk, blocks)) = extent.disk_range() else {
                            continue;
                        };
                        let end = disk.saturating_add(blocks.saturating_mul(BLOCK_SIZE));
                        let log_end = sb.log_start + sb.log_bytes;
                        let outside = disk % BLOCK_SIZE != 0
                            || end > sb.total_bytes
                            || disk < RESERVED_HEAD_BYTES
                            || (disk < log_end && end > sb.log_start);
                        let on_node = (0..blocks)
                            .map(|b| disk + b * BLOCK_SIZE)
                            .find_map(|at| used.get(&at).copied().filter(|w| w.contains("node")));
                        if outside || on_node.is_some() {
                            report.add(
                                FindingKind::SnapshotBlockConflict,
                                Some(disk),
                                format!("{name}: extent {key}"),
                                format!(
                                    "blocks {disk:#x} x {blocks} {}",
                                    on_node
                                        .map_or("outside the data area".to_string(), |w| format!(
                                            "on a {w}"
                                        ))
                                ),
                                "data blocks of the data area, shared only with extents",
                            );
                            continue;
                        }
                        let csums = match &extent.kind {
                            ExtentKind::Regular { csums, .. } => csums.as_slice(),
                            ExtentKind::Blob(blob) => blob.csums.as_slice(),
                            ExtentKind::Inline(_) | ExtentKind::Prealloc { .. } => &[],
                        };
                        for b in 0..blocks {
                            let at = disk + b * BLOCK_SIZE;
                            if used.contains_key(&at) {
                                // Checked with the tree that took it first.
                                continue;
                            }
                            used.insert(at, "snapshot data");
                            report.data_blocks += 1;
                            if let (true, Some(csum)) = (self.options.data, csums.get(b as usize)) {
                                let location = format!("{name}: extent {key}, block {b}");
                                verify_block(device, at, *csum, &location, report);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Reads the data block at `at` and reports it if it does not read or its crc32c is not
/// `csum` (the data pass, for one block).
fn verify_block(device: &dyn BlockDevice, at: u64, csum: u32, location: &str, report: &mut Report) {
    let mut block = vec![0u8; BLOCK_SIZE as usize];
    match device.read_at(&mut block, at) {
        Ok(()) => {
            let got = birch_format::checksum(&block);
            if got != csum {
                report.add(
                    FindingKind::DataChecksumMismatch,
                    Some(at),
                    location,
                    format!("crc32c {got:#010x}"),
                    format!("{csum:#010x}"),
                );
            }
        }
        Err(e) => report.add(
            FindingKind::DataUnreadable,
            Some(at),
            location,
            e,
            "a readable block",
        ),
    }
}

/// What [`claim`] records for the blocks of a shared (flagged) extent.
const SHARED_DATA: &str = "shared data";

/// Records that `blocks` at `addr` are referenced; reports overlaps and bad addresses.
/// Blocks claimed as [`SHARED_DATA`] may be claimed so again.
fn claim(
    sb: &Superblock,
    used: &mut HashMap<u64, &'static str>,
    addr: u64,
    blocks: u64,
    what: &'static str,
    location: &str,
    report: &mut Report,
) -> bool {
    let end = addr.saturating_add(blocks.saturating_mul(BLOCK_SIZE));
    if addr % BLOCK_SIZE != 0 || end > sb.total_bytes {
        report.add(
            FindingKind::BlockOutOfBounds,
            Some(addr),
            location,
            format!("{what} at {addr:#x} x {blocks} blocks"),
            format!("an aligned range inside {} bytes", sb.total_bytes),
        );
        return false;
    }
    let log_end = sb.log_start + sb.log_bytes;
    if addr < RESERVED_HEAD_BYTES || (addr < log_end && end > sb.log_start) {
        report.add(
            FindingKind::BlockInReservedArea,
            Some(addr),
            location,
            format!("{what} at {addr:#x}"),
            format!("a block outside the head (< {RESERVED_HEAD_BYTES:#x}) and log area"),
        );
        return false;
    }
    let mut clean = true;
    for block in 0..blocks {
        let at = addr + block * BLOCK_SIZE;
        if let Some(prev) = used.insert(at, what) {
            // Shared extents may name a block any number of times; a shared and anything
            // else on one block is the sharing gone wrong.
            if what == SHARED_DATA && prev == SHARED_DATA {
                continue;
            }
            if what == SHARED_DATA || prev == SHARED_DATA {
                used.insert(at, prev);
                report.add(
                    FindingKind::SharedExtentConflict,
                    Some(at),
                    location,
                    format!("{what} on a block already used by a {prev}"),
                    "a shared block named by shared extents only",
                );
                clean = false;
                break;
            }
            report.add(
                FindingKind::BlockReferencedTwice,
                Some(at),
                location,
                format!("{what} on a block already used by a {prev}"),
                "each block referenced once",
            );
            clean = false;
            break;
        }
    }
    clean
}

#[derive(Default)]
struct InodeFacts {
    item: Option<InodeItem>,
    refs: Vec<(u64, u64, Vec<u8>)>,
    extents: Vec<(u64, FileExtent)>,
    subdirs: u64,
    entries: u64,
}

fn check_items(
    device: &dyn BlockDevice,
    sb: &Superblock,
    items: &[(Key, Vec<u8>)],
    used: &mut HashMap<u64, &'static str>,
    options: CheckOptions,
    report: &mut Report,
) {
    let mut inodes: BTreeMap<u64, InodeFacts> = BTreeMap::new();
    let mut dir_items: HashMap<(u64, Vec<u8>), (u64, u64, u8)> = HashMap::new();
    let mut dir_index: HashMap<(u64, u64), (u64, Vec<u8>, u8)> = HashMap::new();
    let mut orphans: HashSet<u64> = HashSet::new();
    // Out-of-line xattr values (inode, name, spill) and chunk items by key.
    let mut spilled: Vec<(u64, Vec<u8>, items::XattrSpill)> = Vec::new();
    let mut chunks: BTreeMap<Key, items::XattrChunk> = BTreeMap::new();
    for (key, value) in items {
        let Some(kind) = key.kind() else {
            report.add(
                FindingKind::ItemUndecodable,
                None,
                format!("item {key}"),
                format!("type code {}", key.item_type),
                "a known item type",
            );
            continue;
        };
        let item = match items::Item::decode(kind, value) {
            Ok(item) => item,
            Err(e) => {
                report.add(
                    FindingKind::ItemUndecodable,
                    None,
                    format!("item {key}"),
                    e,
                    "a valid payload",
                );
                continue;
            }
        };
        match item {
            items::Item::Inode(inode) => inodes.entry(key.objectid).or_default().item = Some(inode),
            items::Item::InodeRefs(refs) => {
                for r in refs {
                    inodes.entry(key.objectid).or_default().refs.push((
                        r.parent,
                        r.dir_index,
                        r.name,
                    ));
                }
            }
            items::Item::DirItem(entries) => {
                for e in entries {
                    dir_items.insert(
                        (key.objectid, e.name.clone()),
                        (e.child, e.dir_index, e.file_type),
                    );
                }
            }
            items::Item::DirIndex(e) => {
                if e.dir_index != key.offset {
                    report.add(
                        FindingKind::DirIndexWithoutItem,
                        None,
                        format!("dir index {key}"),
                        format!("index {}", e.dir_index),
                        key.offset,
                    );
                }
                dir_index.insert((key.objectid, key.offset), (e.child, e.name, e.file_type));
            }
            items::Item::Xattrs(list) => {
                inodes.entry(key.objectid).or_default();
                for x in list {
                    if let Some(spill) = x.spill {
                        spilled.push((key.objectid, x.name, spill));
                    }
                }
            }
            items::Item::XattrChunk(chunk) => {
                inodes.entry(key.objectid).or_default();
                chunks.insert(*key, chunk);
            }
            items::Item::Extent(extent) => inodes
                .entry(key.objectid)
                .or_default()
                .extents
                .push((key.offset, extent)),
            items::Item::Orphan => {
                orphans.insert(key.offset);
            }
            items::Item::Snapshot(_) => report.add(
                FindingKind::ItemUndecodable,
                None,
                format!("item {key}"),
                "a snapshot item in the fs tree",
                "snapshot items only in the snapshot list",
            ),
        }
    }
    check_xattr_chunks(sb, &spilled, &mut chunks, report);
    // Dir items and dir indexes must mirror each other.
    for ((dir, name), (child, index, file_type)) in &dir_items {
        let show = String::from_utf8_lossy(name);
        match dir_index.get(&(*dir, *index)) {
            Some((c, n, t)) if c == child && n == name && t == file_type => {}
            other => report.add(
                FindingKind::DirItemWithoutIndex,
                None,
                format!("dir {dir} entry {show:?}"),
                format!("{other:?}"),
                format!("a dir index {index} -> {child}"),
            ),
        }
        let facts = inodes.entry(*dir).or_default();
        facts.entries += 1;
        if *file_type == DT_DIR {
            facts.subdirs += 1;
        }
        match inodes.get(child).and_then(|f| f.item.as_ref()) {
            None => report.add(
                FindingKind::DirEntryDangling,
                None,
                format!("dir {dir} entry {show:?}"),
                format!("inode {child} missing"),
                "an inode item",
            ),
            Some(_) => {
                let has_ref = inodes.get(child).is_some_and(|f| {
                    f.refs
                        .iter()
                        .any(|(p, i, n)| p == dir && i == index && n == name)
                });
                if !has_ref {
                    report.add(
                        FindingKind::DirEntryWithoutInodeRef,
                        None,
                        format!("dir {dir} entry {show:?}"),
                        format!("inode {child} without that ref"),
                        "an inode ref back to the entry",
                    );
                }
            }
        }
    }
    for ((dir, index), (_, name, _)) in &dir_index {
        if !dir_items.contains_key(&(*dir, name.clone())) {
            report.add(
                FindingKind::DirIndexWithoutItem,
                None,
                format!("dir {dir} index {index}"),
                format!("name {:?} without dir item", String::from_utf8_lossy(name)),
                "a matching dir item",
            );
        }
    }
    if inodes
        .get(&ROOT_OBJECTID)
        .and_then(|f| f.item.as_ref())
        .is_none()
    {
        report.add(
            FindingKind::RootDirMissing,
            None,
            "inode 1",
            "no inode item",
            "the root directory",
        );
    }
    let blobs = RefCell::new(HashMap::new());
    for (ino, facts) in &inodes {
        let Some(inode) = &facts.item else {
            report.add(
                FindingKind::ItemWithoutInode,
                None,
                format!("object {ino}"),
                "items without an inode item",
                "an inode item",
            );
            continue;
        };
        report.inodes += 1;
        for (parent, index, name) in &facts.refs {
            if !dir_items
                .get(&(*parent, name.clone()))
                .is_some_and(|(c, i, _)| c == ino && i == index)
            {
                report.add(
                    FindingKind::InodeRefWithoutDirEntry,
                    None,
                    format!("inode {ino}"),
                    format!("ref to {parent}/{:?}", String::from_utf8_lossy(name)),
                    "a dir entry in the parent",
                );
            }
        }
        let is_dir = inode.mode & libc::S_IFMT == libc::S_IFDIR;
        let expected_nlink = if is_dir {
            2 + facts.subdirs
        } else {
            facts.refs.len() as u64
        };
        if u64::from(inode.nlink) != expected_nlink {
            report.add(
                FindingKind::InodeNlinkMismatch,
                None,
                format!("inode {ino}"),
                format!("nlink {}", inode.nlink),
                expected_nlink,
            );
        }
        if is_dir && inode.size != facts.entries {
            report.add(
                FindingKind::DirSizeMismatch,
                None,
                format!("dir {ino}"),
                format!("size {}", inode.size),
                format!("{} entries", facts.entries),
            );
        }
        let has_names = !facts.refs.is_empty() || *ino == ROOT_OBJECTID;
        if !has_names && !orphans.contains(ino) {
            report.add(
                FindingKind::OrphanMissing,
                None,
                format!("inode {ino}"),
                "no names and no orphan item",
                "an orphan item",
            );
        }
        let ctx = ExtentCheckCtx {
            device,
            sb,
            options,
            blobs: &blobs,
        };
        check_extents(&ctx, *ino, inode, &facts.extents, used, report);
    }
    for ino in &orphans {
        if inodes.get(ino).and_then(|f| f.item.as_ref()).is_none() {
            report.add(
                FindingKind::OrphanStale,
                None,
                format!("orphan item for {ino}"),
                "no inode",
                "an inode to free",
            );
        }
    }
}

const DT_DIR: u8 = 4;

/// What the extent checks read besides the extents: the device, the superblock, the options.
struct ExtentCheckCtx<'a> {
    device: &'a dyn BlockDevice,
    sb: &'a Superblock,
    options: CheckOptions,
    /// The first item seen naming each blob (by its address): every later one must agree.
    blobs: &'a RefCell<HashMap<u64, items::Blob>>,
}

fn check_extents(
    ctx: &ExtentCheckCtx<'_>,
    ino: u64,
    inode: &InodeItem,
    extents: &[(u64, FileExtent)],
    used: &mut HashMap<u64, &'static str>,
    report: &mut Report,
) {
    let ExtentCheckCtx {
        device,
        sb,
        options,
        blobs,
    } = *ctx;
    let mut end_prev = 0u64;
    for (offset, extent) in extents {
        let location = format!("inode {ino} extent at {offset}");
        if *offset < end_prev {
            report.add(
                FindingKind::ExtentOverlap,
                None,
                &location,
                format!("start {offset}"),
                format!(">= {end_prev}, the end of the previous extent"),
            );
        }
        let end = offset.saturating_add(extent.len_bytes());
        end_prev = end_prev.max(end);
        match &extent.kind {
            ExtentKind::Inline(data) => {
                if *offset != 0 || data.len() > INLINE_MAX_BYTES || extents.len() != 1 {
                    report.add(
                        FindingKind::InlineExtentInvalid,
                        None,
                        &location,
                        format!(
                            "{} inline bytes at {offset} among {} extents",
                            data.len(),
                            extents.len()
                        ),
                        "one inline extent at 0",
                    );
                }
                if end > inode.size.max(1) && inode.mode & libc::S_IFMT != libc::S_IFLNK {
                    report.add(
                        FindingKind::ExtentPastSize,
                        None,
                        &location,
                        format!("end {end}"),
                        format!("<= size {}", inode.size),
                    );
                }
            }
            // A regular extent's blocks, or a window over a blob, whose stored blocks are
            // claimed and verified alike (a flagged blob's may be named again). That every
            // item naming one blob agrees, and that windows of one file over one blob do not
            // overlap, is DESIGN §16.12 step 5.
            ExtentKind::Regular { .. } | ExtentKind::Blob(_) => {
                let (disk_addr, csums, unit, blob) = match &extent.kind {
                    ExtentKind::Regular { disk_addr, csums } => (disk_addr, csums, "block", None),
                    ExtentKind::Blob(blob) => {
                        (&blob.disk_addr, &blob.csums, "stored block", Some(blob))
                    }
                    ExtentKind::Inline(_) | ExtentKind::Prealloc { .. } => continue,
                };
                if blob.is_some() && sb.incompat & INCOMPAT_BLOB_EXTENTS == 0 {
                    report.add(
                        FindingKind::BlobExtentConflict,
                        Some(*disk_addr),
                        &location,
                        "a blob extent",
                        "the INCOMPAT_BLOB_EXTENTS flag in the superblock",
                    );
                }
                if let Some(blob) = blob {
                    check_blob_agrees(blobs, blob, &location, report);
                }
                if offset % BLOCK_SIZE != 0 {
                    report.add(
                        FindingKind::ExtentMisaligned,
                        None,
                        &location,
                        offset,
                        "a block-aligned offset",
                    );
                }
                if *offset >= inode.size.div_ceil(BLOCK_SIZE) * BLOCK_SIZE {
                    report.add(
                        FindingKind::ExtentPastSize,
                        None,
                        &location,
                        format!("start {offset}"),
                        format!("< size {}", inode.size),
                    );
                }
                if extent.shared && sb.incompat & INCOMPAT_SHARED_EXTENTS == 0 {
                    report.add(
                        FindingKind::SharedExtentConflict,
                        Some(*disk_addr),
                        &location,
                        "a shared extent",
                        "the INCOMPAT_SHARED_EXTENTS flag in the superblock",
                    );
                }
                // A shared block counts once, whatever names it.
                let fresh = (0..csums.len() as u64)
                    .filter(|b| !used.contains_key(&(disk_addr + b * BLOCK_SIZE)))
                    .count() as u64;
                if claim(
                    sb,
                    used,
                    *disk_addr,
                    csums.len() as u64,
                    if extent.shared { SHARED_DATA } else { "data" },
                    &location,
                    report,
                ) {
                    report.data_blocks += fresh;
                    if options.data {
                        for (n, csum) in csums.iter().enumerate() {
                            let at = disk_addr + n as u64 * BLOCK_SIZE;
                            verify_block(
                                device,
                                at,
                                *csum,
                                &format!("{location}, {unit} {n}"),
                                report,
                            );
                        }
                    }
                }
            }
            ExtentKind::Prealloc { disk_addr, blocks } => {
                if offset % BLOCK_SIZE != 0 {
                    report.add(
                        FindingKind::ExtentMisaligned,
                        None,
                        &location,
                        offset,
                        "a block-aligned offset",
                    );
                }
                if claim(sb, used, *disk_addr, *blocks, "data", &location, report) {
                    report.data_blocks += blocks;
                }
            }
        }
    }
}

/// Every item naming one blob agrees on everything but its window (DESIGN §16.5 rule 3): the
/// first one seen stands for the blob; another that names its address with other fields is
/// finding 33.
fn check_blob_agrees(
    blobs: &RefCell<HashMap<u64, items::Blob>>,
    blob: &items::Blob,
    location: &str,
    report: &mut Report,
) {
    let mut seen = blobs.borrow_mut();
    match seen.get(&blob.disk_addr) {
        Some(first) if !first.same_blob(blob) => {
            let show = |b: &items::Blob| {
                format!(
                    "codec {} encoded {} logical {} stored {} blocks",
                    b.codec.byte(),
                    b.encoded_len,
                    b.logical,
                    b.csums.len()
                )
            };
            report.add(
                FindingKind::BlobExtentConflict,
                Some(blob.disk_addr),
                location,
                format!("the blob at {:#x} as {}", blob.disk_addr, show(blob)),
                format!("as the other items name it: {}", show(first)),
            );
        }
        Some(_) => {}
        None => {
            seen.insert(blob.disk_addr, blob.clone());
        }
    }
}

/// Every out-of-line xattr value has its chunks, each named and numbered for it, adding up to
/// its size and crc32c; every chunk belongs to one; and the image has the flag that allows them.
fn check_xattr_chunks(
    sb: &Superblock,
    spilled: &[(u64, Vec<u8>, items::XattrSpill)],
    chunks: &mut BTreeMap<Key, items::XattrChunk>,
    report: &mut Report,
) {
    use birch_format::superblock::INCOMPAT_XATTR_CHUNKS;
    let any = !spilled.is_empty() || !chunks.is_empty();
    if any && sb.incompat & INCOMPAT_XATTR_CHUNKS == 0 {
        report.add(
            FindingKind::XattrChunkMismatch,
            None,
            "superblock".to_string(),
            format!("out-of-line xattr values, incompat {:#x}", sb.incompat),
            "incompat flag INCOMPAT_XATTR_CHUNKS (0x1) set",
        );
    }
    for (ino, name, spill) in spilled {
        let show = String::from_utf8_lossy(name);
        let mut value = Vec::with_capacity(spill.size as usize);
        let mut whole = true;
        for index in 0..spill.chunks() {
            let key = Key::new(
                *ino,
                birch_format::ItemType::XattrChunk,
                items::xattr_chunk_hash(name, index),
            );
            match chunks.remove(&key) {
                Some(c) if c.name == *name && c.index == index => value.extend_from_slice(&c.data),
                other => {
                    report.add(
                        FindingKind::XattrChunkMismatch,
                        None,
                        format!("inode {ino} xattr {show:?} chunk {index}"),
                        match other {
                            Some(c) => format!(
                                "chunk {} of {:?}",
                                c.index,
                                String::from_utf8_lossy(&c.name)
                            ),
                            None => "no chunk item".to_string(),
                        },
                        "that chunk of this xattr",
                    );
                    whole = false;
                }
            }
        }
        if whole
            && (value.len() != spill.size as usize || birch_format::checksum(&value) != spill.crc)
        {
            report.add(
                FindingKind::XattrChunkMismatch,
                None,
                format!("inode {ino} xattr {show:?}"),
                format!(
                    "{} bytes, crc {:#010x}",
                    value.len(),
                    birch_format::checksum(&value)
                ),
                format!("{} bytes, crc {:#010x}", spill.size, spill.crc),
            );
        }
    }
    for (key, c) in chunks.iter() {
        report.add(
            FindingKind::XattrChunkMismatch,
            None,
            format!("item {key}"),
            format!(
                "chunk {} of {:?}, claimed by no xattr",
                c.index,
                String::from_utf8_lossy(&c.name)
            ),
            "a chunk of an out-of-line xattr value",
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scripts match findings by number: the numbers are pinned here, and a change to one
    /// fails this test.
    #[test]
    fn finding_codes_are_stable_and_unique() {
        assert_eq!(FindingKind::SuperblockSlotBad.code(), 1);
        assert_eq!(FindingKind::NodeUnreadable.code(), 2);
        assert_eq!(FindingKind::DataChecksumMismatch.code(), 23);
        assert_eq!(FindingKind::RootDirMissing.code(), 25);
        assert_eq!(FindingKind::XattrChunkMismatch.code(), 26);
        for (i, kind) in FindingKind::ALL.iter().enumerate() {
            assert_eq!(usize::from(kind.code()), i + 1, "{kind:?}");
        }
    }

    #[test]
    fn every_finding_kind_belongs_to_a_pass() {
        for kind in FindingKind::ALL {
            assert!(
                PASSES.iter().any(|p| p.finds.contains(&kind)),
                "{kind:?} is in no pass"
            );
        }
    }

    /// Ids are unique and ascending in run order, and a pass depends only on passes that ran
    /// before it.
    #[test]
    fn passes_run_after_what_they_depend_on() {
        for (i, pass) in PASSES.iter().enumerate() {
            assert_eq!(usize::from(pass.id.number()), i + 1, "{}", pass.name);
            for dep in pass.depends_on {
                assert!(
                    dep.number() < pass.id.number(),
                    "{} depends on a later pass {dep:?}",
                    pass.name
                );
            }
        }
    }

    /// A blob window is claimed by its stored blocks and, with the data pass, verified block by
    /// block; two unflagged items naming one blob are a block referenced twice, flagged ones
    /// are not (DESIGN §16.5; the agreement of the items is step 5's).
    #[test]
    fn a_blob_window_is_claimed_and_verified_by_its_stored_blocks() {
        use birch_format::codec::Codec;
        use birch_format::items::Blob;

        let device: Arc<dyn BlockDevice> = Arc::new(crate::device::MemDevice::new(64 << 20));
        crate::Filesystem::mkfs(device.clone(), &crate::MkfsOptions::default()).expect("mkfs");
        let sb = crate::txn::Engine::open(device.clone())
            .expect("open")
            .superblock();
        let log_end = sb.log_start + sb.log_bytes;
        let mut addr = RESERVED_HEAD_BYTES + (8 << 20);
        if addr < log_end && addr + (1 << 20) > sb.log_start {
            addr = log_end + (1 << 20);
        }
        let stored: Vec<u8> = (0..3 * BLOCK_SIZE).map(|i| (i % 251) as u8).collect();
        device.write_at(&stored, addr).expect("write");
        let csums: Vec<u32> = stored
            .chunks(BLOCK_SIZE as usize)
            .map(birch_format::checksum)
            .collect();
        let item = |shared: bool, window_offset: u32, csums: Vec<u32>| FileExtent {
            generation: 1,
            kind: ExtentKind::Blob(Blob {
                disk_addr: addr,
                codec: Codec::Zstd(0),
                encoded_len: 3 * 4096 - 10,
                logical: 8 * 4096,
                window_offset,
                window_len: 4096,
                nonce: 0,
                csums,
            }),
            shared,
        };
        let inode = InodeItem {
            size: 1 << 20,
            mode: libc::S_IFREG | 0o644,
            ..Default::default()
        };
        let run = |extents: Vec<(u64, FileExtent)>, mut sb: Superblock| {
            sb.incompat |= INCOMPAT_SHARED_EXTENTS | INCOMPAT_BLOB_EXTENTS;
            let blobs = RefCell::new(HashMap::new());
            let ctx = ExtentCheckCtx {
                device: device.as_ref(),
                sb: &sb,
                options: CheckOptions { data: true },
                blobs: &blobs,
            };
            let mut report = Report::default();
            let mut used = HashMap::new();
            check_extents(&ctx, 300, &inode, &extents, &mut used, &mut report);
            report
        };
        let kinds = |r: &Report| r.findings.iter().map(|f| f.kind).collect::<Vec<_>>();
        let clean = run(vec![(0, item(false, 0, csums.clone()))], sb.clone());
        assert_eq!(kinds(&clean), vec![]);
        assert_eq!(
            clean.data_blocks, 3,
            "stored blocks, not the window or logical"
        );
        let mut wrong = csums.clone();
        wrong[1] ^= 1;
        let damaged = run(vec![(0, item(false, 0, wrong))], sb.clone());
        assert_eq!(kinds(&damaged), vec![FindingKind::DataChecksumMismatch]);
        assert_eq!(damaged.findings[0].block, Some(addr + BLOCK_SIZE));
        let twice = vec![
            (0, item(false, 0, csums.clone())),
            (8192, item(false, 4096, csums.clone())),
        ];
        assert!(kinds(&run(twice, sb.clone())).contains(&FindingKind::BlockReferencedTwice));
        let flagged = vec![
            (0, item(true, 0, csums.clone())),
            (8192, item(true, 4096, csums.clone())),
        ];
        let flagged = run(flagged, sb.clone());
        assert_eq!(kinds(&flagged), vec![]);
        assert_eq!(flagged.data_blocks, 3, "a shared blob counts once");
        // Without the flag: finding 33.
        let mut plain = sb.clone();
        plain.incompat &= !INCOMPAT_BLOB_EXTENTS;
        let blobs = RefCell::new(HashMap::new());
        let ctx = ExtentCheckCtx {
            device: device.as_ref(),
            sb: &plain,
            options: CheckOptions { data: false },
            blobs: &blobs,
        };
        let mut report = Report::default();
        let extents = vec![(0, item(false, 0, csums.clone()))];
        check_extents(
            &ctx,
            300,
            &inode,
            &extents,
            &mut HashMap::new(),
            &mut report,
        );
        assert_eq!(kinds(&report), vec![FindingKind::BlobExtentConflict]);
        // Two flagged items that disagree on the blob they name: finding 33 too.
        let mut other = item(true, 4096, csums.clone());
        if let ExtentKind::Blob(b) = &mut other.kind {
            b.encoded_len -= 1;
        }
        let disagree = run(
            vec![(0, item(true, 0, csums.clone())), (8192, other)],
            sb.clone(),
        );
        assert_eq!(kinds(&disagree), vec![FindingKind::BlobExtentConflict]);
    }

    #[test]
    fn a_finding_prints_its_number() {
        let finding = Finding {
            kind: FindingKind::NodeUnreadable,
            block: Some(0x3a000),
            location: "fs tree".into(),
            found: "a bad checksum".into(),
            expected: "a valid node".into(),
        };
        assert_eq!(
            finding.to_string(),
            "NodeUnreadable [002]: block 0x3a000 fs tree: found a bad checksum, expected a valid node"
        );
    }
}
