//! `birch diff` (DESIGN §15.8, SEMANTICS §9): the paths that changed between two fs trees
//! (two snapshots, or a snapshot and the live tree).
//!
//! Owns: the in-step walk of two trees ([`changed_items`]): both are read in key order side by
//! side, and a child pointer whose address and generation are the same in both is skipped with
//! its whole subtree (the two trees share it), so the cost grows with the change between them,
//! not with the filesystem. It relies on nothing else: not on generations being ordered between
//! the trees (a rollback makes the live root an old snapshot's root) nor on one tree being
//! older. And the turning of changed items into paths ([`diff_trees`]): an inode's paths come
//! from its `InodeRef` items (FORMAT §6.2) resolved in the tree it lives in, each hard link
//! listed.
//!
//! Must not touch: anything that writes. Every read goes through the engine's tree context
//! (checksummed, verified nodes, the node cache); the caller holds the trees (a committed root
//! or a snapshot) for as long as the walk runs.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, HashMap};

use birch_format::items::{decode_inode_refs, FileExtent, InodeItem, Timespec};
use birch_format::node::NodeBody;
use birch_format::superblock::RootPtr;
use birch_format::{BlockAddr, Generation, ItemType, Key, ROOT_OBJECTID};

use crate::btree::{TreeCtx, TreeReader};
use crate::error::{Error, Result};
use crate::txn::Engine;

/// One item that differs between the trees: its value in the old and in the new tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemChange {
    /// The item's key.
    pub key: Key,
    /// Its value in the old tree (`None`: absent there).
    pub old: Option<Vec<u8>>,
    /// Its value in the new tree (`None`: absent there).
    pub new: Option<Vec<u8>>,
}

/// What the walk read: nodes read (through the node cache) and subtrees skipped as shared.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiffStats {
    /// Nodes read, both trees together.
    pub nodes_read: u64,
    /// Child pointers (or roots) equal in both trees, skipped with their subtrees.
    pub shared_skipped: u64,
}

/// One line of `birch diff`, as `zfs diff` prints them.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum PathChange {
    /// `+ /path`: the path exists only in the new tree.
    Created(String),
    /// `- /path`: the path exists only in the old tree.
    Removed(String),
    /// `M /path`: the same inode under the same path, with other contents, attributes (atime
    /// aside) or xattrs; a directory whose entries changed is one.
    Modified(String),
    /// `R /old -> /new`: an inode with one name that moved (with more names changing at once,
    /// each is a `-` and a `+`).
    Renamed(String, String),
}

impl std::fmt::Display for PathChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PathChange::Created(p) => write!(f, "+ {p}"),
            PathChange::Removed(p) => write!(f, "- {p}"),
            PathChange::Modified(p) => write!(f, "M {p}"),
            PathChange::Renamed(from, to) => write!(f, "R {from} -> {to}"),
        }
    }
}

/// An element of one tree's stream in key order: a subtree not yet read, or an item.
enum Head {
    /// A subtree: the lower bound of its keys (`None`: the whole key space), its node.
    Subtree {
        low: Option<Key>,
        addr: u64,
        generation: u64,
        level: u8,
    },
    Item(Key, Vec<u8>),
}

/// One tree's stream: the elements still to come, the next one last.
struct Cursor {
    pending: Vec<Head>,
}

impl Cursor {
    fn new(root: RootPtr) -> Cursor {
        let pending = if root.addr == 0 {
            Vec::new()
        } else {
            vec![Head::Subtree {
                low: None,
                addr: root.addr,
                generation: root.generation,
                level: root.level,
            }]
        };
        Cursor { pending }
    }

    /// Replaces the next element (a subtree) by its node's children or items.
    fn expand(&mut self, ctx: TreeCtx<'_>, stats: &mut DiffStats) -> Result<()> {
        let Some(Head::Subtree {
            addr,
            generation,
            level,
            ..
        }) = self.pending.pop()
        else {
            return Ok(());
        };
        let node = ctx.read(BlockAddr::new(addr), Generation::new(generation), level)?;
        stats.nodes_read += 1;
        match &node.body {
            NodeBody::Internal(ptrs) => {
                for p in ptrs.iter().rev() {
                    self.pending.push(Head::Subtree {
                        low: Some(p.key),
                        addr: p.addr,
                        generation: p.generation,
                        level: level.saturating_sub(1),
                    });
                }
            }
            NodeBody::Leaf(items) => {
                for (key, value) in items.iter().rev() {
                    self.pending.push(Head::Item(*key, value.clone()));
                }
            }
        }
        Ok(())
    }
}

/// Whether every key of the subtree with lower bound `low` is above `key`.
fn above(low: &Option<Key>, key: &Key) -> bool {
    low.as_ref().is_some_and(|low| low > key)
}

/// The items that differ between the trees at `old` and `new` (address 0: an empty tree), in
/// key order, with what the walk read. Both trees are read in step; a subtree both reach by
/// the same address and generation is skipped unread.
pub fn changed_items(
    ctx: TreeCtx<'_>,
    old: RootPtr,
    new: RootPtr,
) -> Result<(Vec<ItemChange>, DiffStats)> {
    let mut stats = DiffStats::default();
    let mut out = Vec::new();
    let mut a = Cursor::new(old);
    let mut b = Cursor::new(new);
    loop {
        // Which side to expand, or which items to take; decided on borrowed heads.
        enum Step {
            Done,
            SkipBoth,
            ExpandA,
            ExpandB,
            ExpandBoth,
            TakeA,
            TakeB,
            TakeBoth,
        }
        let step = match (a.pending.last(), b.pending.last()) {
            (None, None) => Step::Done,
            (Some(Head::Item(..)), None) => Step::TakeA,
            (None, Some(Head::Item(..))) => Step::TakeB,
            (Some(Head::Subtree { .. }), None) => Step::ExpandA,
            (None, Some(Head::Subtree { .. })) => Step::ExpandB,
            (Some(Head::Item(ka, _)), Some(Head::Item(kb, _))) => match ka.cmp(kb) {
                Ordering::Less => Step::TakeA,
                Ordering::Greater => Step::TakeB,
                Ordering::Equal => Step::TakeBoth,
            },
            (Some(Head::Item(ka, _)), Some(Head::Subtree { low, .. })) => {
                if above(low, ka) {
                    Step::TakeA
                } else {
                    Step::ExpandB
                }
            }
            (Some(Head::Subtree { low, .. }), Some(Head::Item(kb, _))) => {
                if above(low, kb) {
                    Step::TakeB
                } else {
                    Step::ExpandA
                }
            }
            (
                Some(Head::Subtree {
                    low: la,
                    addr: aa,
                    generation: ga,
                    level: va,
                }),
                Some(Head::Subtree {
                    low: lb,
                    addr: ab,
                    generation: gb,
                    level: vb,
                }),
            ) => {
                if aa == ab && ga == gb {
                    Step::SkipBoth
                } else {
                    match va.cmp(vb).then_with(|| lb.cmp(la)) {
                        Ordering::Greater => Step::ExpandA,
                        Ordering::Less => Step::ExpandB,
                        Ordering::Equal => Step::ExpandBoth,
                    }
                }
            }
        };
        match step {
            Step::Done => break,
            Step::SkipBoth => {
                a.pending.pop();
                b.pending.pop();
                stats.shared_skipped += 1;
            }
            Step::ExpandA => a.expand(ctx, &mut stats)?,
            Step::ExpandB => b.expand(ctx, &mut stats)?,
            Step::ExpandBoth => {
                a.expand(ctx, &mut stats)?;
                b.expand(ctx, &mut stats)?;
            }
            Step::TakeA => {
                if let Some(Head::Item(key, value)) = a.pending.pop() {
                    out.push(ItemChange {
                        key,
                        old: Some(value),
                        new: None,
                    });
                }
            }
            Step::TakeB => {
                if let Some(Head::Item(key, value)) = b.pending.pop() {
                    out.push(ItemChange {
                        key,
                        old: None,
                        new: Some(value),
                    });
                }
            }
            Step::TakeBoth => {
                if let (Some(Head::Item(key, old)), Some(Head::Item(_, new))) =
                    (a.pending.pop(), b.pending.pop())
                {
                    if old != new {
                        out.push(ItemChange {
                            key,
                            old: Some(old),
                            new: Some(new),
                        });
                    }
                }
            }
        }
    }
    Ok((out, stats))
}

/// The paths of inodes in one tree, resolved through `InodeRef` items and memoized.
struct Paths<'a> {
    reader: TreeReader<'a>,
    known: HashMap<u64, Vec<String>>,
}

impl Paths<'_> {
    /// Every path of `ino` in this tree (empty for an inode with no name: an orphan, or
    /// absent). A directory has one; a file one per hard link.
    fn of(&mut self, ino: u64) -> Result<Vec<String>> {
        self.resolve(ino, 0)
    }

    fn resolve(&mut self, ino: u64, depth: usize) -> Result<Vec<String>> {
        if self.reader.root.addr == 0 {
            return Ok(Vec::new());
        }
        if ino == ROOT_OBJECTID {
            return Ok(vec!["/".to_string()]);
        }
        if let Some(paths) = self.known.get(&ino) {
            return Ok(paths.clone());
        }
        if depth > 4096 {
            return Err(Error::Invalid(format!(
                "diff: inode {ino}: its parents do not reach the root"
            )));
        }
        let lo = Key::new(ino, ItemType::InodeRef, 0);
        let hi = Key::new(ino, ItemType::InodeRef, u64::MAX);
        let mut paths = Vec::new();
        for (key, value) in self.reader.range(&lo, &hi, usize::MAX)? {
            let refs = decode_inode_refs(&value)
                .map_err(|e| Error::corrupt(format!("diff: inode ref {key}"), e))?;
            for r in refs {
                let name = String::from_utf8_lossy(&r.name).into_owned();
                for parent in self.resolve(r.parent, depth + 1)? {
                    if parent == "/" {
                        paths.push(format!("/{name}"));
                    } else {
                        paths.push(format!("{parent}/{name}"));
                    }
                }
            }
        }
        paths.sort();
        self.known.insert(ino, paths.clone());
        Ok(paths)
    }
}

/// An item's value before and after (`None`: absent).
type BeforeAfter = (Option<Vec<u8>>, Option<Vec<u8>>);

/// What changed for one inode.
#[derive(Default)]
struct InodeChange {
    /// Its inode item: (old, new), when it changed.
    item: Option<BeforeAfter>,
    /// Any item other than the inode item and its names changed.
    contents: bool,
    /// Its names changed.
    names: bool,
}

/// Whether two inode items differ in anything but atime and the last transaction (and the
/// ctime, with `ignore_ctime`).
fn inode_differs(old: &[u8], new: &[u8], ignore_ctime: bool) -> Result<bool> {
    let decode = |bytes: &[u8]| {
        InodeItem::decode(bytes).map_err(|e| Error::corrupt("diff: inode item".to_string(), e))
    };
    let (mut a, mut b) = (decode(old)?, decode(new)?);
    for item in [&mut a, &mut b] {
        item.atime = Timespec { sec: 0, nsec: 0 };
        item.transid = 0;
        if ignore_ctime {
            item.ctime = Timespec { sec: 0, nsec: 0 };
        }
    }
    Ok(a != b)
}

/// Whether two extent items name the same bytes and differ at most in the shared flag (a
/// clone rewrites its source's extents flagged, DESIGN §15.8). An item that does not decode
/// counts as changed.
fn only_shared_flag_differs(old: &[u8], new: &[u8]) -> bool {
    match (FileExtent::decode(old), FileExtent::decode(new)) {
        (Ok(mut a), Ok(b)) => {
            a.shared = b.shared;
            a == b
        }
        _ => false,
    }
}

/// The path changes between the fs trees at `old` and `new`, sorted by path, and what the
/// walk read. Only the changed items are read beyond the walk, and the `InodeRef` chains of
/// the inodes they belong to.
pub fn diff_trees(
    ctx: TreeCtx<'_>,
    old: RootPtr,
    new: RootPtr,
) -> Result<(Vec<PathChange>, DiffStats)> {
    let (items, stats) = changed_items(ctx, old, new)?;
    let mut inodes: BTreeMap<u64, InodeChange> = BTreeMap::new();
    for change in items {
        let ino = change.key.objectid;
        match change.key.kind() {
            Some(ItemType::Orphan) | Some(ItemType::Snapshot) | None => continue,
            Some(ItemType::InodeItem) => {
                inodes.entry(ino).or_default().item = Some((change.old, change.new));
            }
            Some(ItemType::InodeRef) => inodes.entry(ino).or_default().names = true,
            // A clone flags its source's extents shared: the source's bytes did not change.
            Some(ItemType::ExtentData)
                if change
                    .old
                    .as_deref()
                    .zip(change.new.as_deref())
                    .is_some_and(|(old, new)| only_shared_flag_differs(old, new)) => {}
            Some(_) => inodes.entry(ino).or_default().contents = true,
        }
    }
    let mut old_paths = Paths {
        reader: TreeReader { ctx, root: old },
        known: HashMap::new(),
    };
    let mut new_paths = Paths {
        reader: TreeReader { ctx, root: new },
        known: HashMap::new(),
    };
    let mut out = Vec::new();
    for (ino, change) in inodes {
        let was = old_paths.of(ino)?;
        let is = new_paths.of(ino)?;
        let (created, removed) = match &change.item {
            Some((None, Some(_))) => (true, false),
            Some((Some(_), None)) => (false, true),
            _ => (false, false),
        };
        if created {
            out.extend(is.into_iter().map(PathChange::Created));
            continue;
        }
        if removed {
            out.extend(was.into_iter().map(PathChange::Removed));
            continue;
        }
        let before: BTreeSet<&String> = was.iter().collect();
        let after: BTreeSet<&String> = is.iter().collect();
        let gone: Vec<&String> = before.difference(&after).copied().collect();
        let came: Vec<&String> = after.difference(&before).copied().collect();
        let renamed = change.names && (!gone.is_empty() || !came.is_empty());
        let attributes = match &change.item {
            Some((Some(o), Some(n))) => inode_differs(o, n, false)?,
            _ => false,
        };
        if gone.len() == 1 && came.len() == 1 {
            out.push(PathChange::Renamed(gone[0].clone(), came[0].clone()));
        } else {
            out.extend(gone.iter().map(|p| PathChange::Removed((*p).clone())));
            out.extend(came.iter().map(|p| PathChange::Created((*p).clone())));
        }
        // The paths it kept show a change of contents or attributes (a new or lost hard
        // link changes the link count and ctime); an inode that kept none of its paths (a
        // move) shows `M` at its new path only for a change of contents or of attributes
        // other than the ctime the move itself set.
        let moved_changed = match &change.item {
            Some((Some(o), Some(n))) if renamed => change.contents || inode_differs(o, n, true)?,
            _ => change.contents,
        };
        let kept_any = after.iter().any(|p| before.contains(p));
        for path in after.iter() {
            let kept = before.contains(path);
            if (kept && (change.contents || attributes)) || (!kept_any && moved_changed) {
                out.push(PathChange::Modified((*path).clone()));
            }
        }
    }
    out.sort_by(|a, b| path_of(a).cmp(path_of(b)).then_with(|| a.cmp(b)));
    Ok((out, stats))
}

/// The path a change is sorted by (a rename's new path).
fn path_of(change: &PathChange) -> &str {
    match change {
        PathChange::Created(p) | PathChange::Removed(p) | PathChange::Modified(p) => p,
        PathChange::Renamed(_, to) => to,
    }
}

impl Engine {
    /// `birch diff`: the path changes from snapshot `from` to snapshot `to` (`None`: the live
    /// tree as of the last durable commit), sorted by path, and what the walk read. Errors:
    /// no such snapshot (`NotFound`), a tree that does not read (`Corrupt`).
    pub fn diff(&self, from: &str, to: Option<&str>) -> Result<(Vec<PathChange>, DiffStats)> {
        let committed = self.committed_root();
        let list = self.snapshots();
        let root_of = |name: &str| {
            list.iter()
                .find(|s| s.name == name)
                .map(|s| s.root)
                .ok_or_else(|| Error::NotFound(format!("snapshot {name:?}")))
        };
        let old = root_of(from)?;
        let new = match to {
            Some(name) => root_of(name)?,
            None => committed.root,
        };
        let result = diff_trees(self.ctx(), old, new);
        drop(committed);
        result
    }

    /// [`diff_trees`] of two fs tree roots the caller keeps (snapshots' roots, or a committed
    /// root it holds; address 0 is an empty tree).
    pub fn diff_roots(&self, old: RootPtr, new: RootPtr) -> Result<(Vec<PathChange>, DiffStats)> {
        diff_trees(self.ctx(), old, new)
    }
}
