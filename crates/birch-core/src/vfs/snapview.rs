//! The snapshot namespace: every snapshot browsable read-only under the hidden directory
//! `/.snapshot` of the root, or one snapshot served alone as the root (DESIGN §15.8,
//! SEMANTICS §9).
//!
//! Owns: which inode numbers name snapshot nodes (subvolume bits 48..63 hold the snapshot id,
//! DESIGN §7; [`SNAPSHOT_DIR_OBJECTID`] is `/.snapshot` itself), the `.snapshot` directory's
//! attributes and listing, every read of a snapshot's tree the POSIX API serves (lookup,
//! getattr, readdir, read, readlink, xattrs, lseek), each through a committed view of the
//! snapshot ([`Engine::snapshot_view`], which keeps its blocks while the view is held), the
//! `EROFS` answer to every change, the reserved name in the root, the count of open files per
//! snapshot that makes a deletion `EBUSY`, and the mount of one snapshot alone
//! ([`Filesystem::serve_snapshot_alone`]).
//!
//! Must not touch: the live tree (nothing here writes an item, moves atime or takes an inode
//! lock of the live table), the snapshot list and its commits (the engine's), FUSE types. No
//! view is kept between operations: a view pins the blocks later commits free, so an open
//! file in a snapshot holds a count here, never a view.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use birch_format::items::InodeItem;
use birch_format::{
    Generation, InodeNo, BLOCK_SIZE, ROOT_INO, ROOT_OBJECTID, SNAPSHOT_DIR_INO,
    SNAPSHOT_DIR_OBJECTID, SUBVOLUME_SHIFT,
};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{attr_of, Attr, DirEntryOut, FileKind, Filesystem};
use crate::error::{Error, Result};
use crate::items;
use crate::snapshot::Snapshot;
use crate::txn::CommittedView;

/// The reserved name of the snapshot directory in the root.
pub const SNAPSHOT_DIR_NAME: &[u8] = b".snapshot";

const OBJECT_MASK: u64 = (1 << SUBVOLUME_SHIFT) - 1;

/// The inode number of object `obj` (its inode number in the snapshot's tree) of snapshot `id`
/// (a subvolume) under `/.snapshot`.
pub fn snapshot_ino(id: u64, obj: InodeNo) -> InodeNo {
    InodeNo::new((id << SUBVOLUME_SHIFT) | (obj.get() & OBJECT_MASK))
}

/// A node of the snapshot namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SnapNode {
    /// `/.snapshot`.
    Dir,
    /// Object `obj` of snapshot `id`.
    In { id: u64, obj: u64 },
}

/// The namespace's state in a [`Filesystem`].
#[derive(Default)]
pub(crate) struct SnapState {
    /// The id of the snapshot served alone as the root (`-o ro,snapshot=NAME`), 0 if none
    /// (snapshot ids start at 1). Set once, before any node is handed out.
    alone: AtomicU64,
    /// Open files per snapshot id, and the snapshots being deleted (no new open then).
    opens: Mutex<Opens>,
    /// The root's text xattrs as last computed ([`Filesystem::snapshots_text`],
    /// [`Filesystem::diff_text`]).
    texts: Mutex<TextCache>,
}

/// Diff texts kept: `birch diff MNT` reads one text in pieces, and two clients may alternate.
const DIFF_TEXTS_KEPT: usize = 2;

/// What a snapshot list's text depends on: the committed generation and the snapshot ids.
type ListState = (Generation, Vec<u64>);

/// Results of the root's text xattrs kept between reads. The kernel asks for an xattr's size,
/// then for its value, and `birch diff MNT` reads its text in pieces of 60,000 bytes: each
/// read would otherwise walk the trees again. A result is kept with the state it was computed
/// from, and served only while that state stands; computing holds no lock here.
#[derive(Default)]
struct TextCache {
    /// [`Filesystem::snapshots_text`], with the committed generation and the snapshot ids it
    /// was computed for: any commit moves the generation (the space a snapshot alone holds
    /// depends on the live tree), a creation or deletion also the ids.
    list: Option<(ListState, Arc<str>)>,
    /// The last [`DIFF_TEXTS_KEPT`] [`Filesystem::diff_text`] results, newest last.
    diffs: VecDeque<(DiffKey, Arc<[u8]>)>,
}

/// What a diff text was computed from: snapshot ids (never reused, so a name deleted and made
/// again is another key), and for the live state the committed generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DiffKey {
    from: u64,
    to: DiffTo,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DiffTo {
    Snapshot(u64),
    Live(Generation),
}

#[derive(Default)]
struct Opens {
    counts: HashMap<u64, u64>,
    deleting: HashSet<u64>,
}

/// `EROFS` for a change of `what` in a snapshot.
fn read_only(what: impl std::fmt::Display) -> Error {
    Error::SnapshotReadOnly(what.to_string())
}

impl Filesystem {
    /// The snapshot node `ino` names, or `None` for a node of the live tree. Costs a shift
    /// and a compare for a live node.
    #[inline]
    pub(crate) fn snap_node(&self, ino: u64) -> Option<SnapNode> {
        let id = ino >> SUBVOLUME_SHIFT;
        if id != 0 {
            return Some(SnapNode::In {
                id,
                obj: ino & OBJECT_MASK,
            });
        }
        if ino == SNAPSHOT_DIR_OBJECTID {
            return Some(SnapNode::Dir);
        }
        if ino == ROOT_OBJECTID {
            if let Some(id) = self.alone() {
                return Some(SnapNode::In {
                    id,
                    obj: ROOT_OBJECTID,
                });
            }
        }
        None
    }

    /// `EROFS` when any of `inos` is a snapshot node: the check every change makes first.
    #[inline]
    pub(crate) fn refuse_snapshot_change(&self, op: &str, inos: &[u64]) -> Result<()> {
        for &ino in inos {
            if self.snap_node(ino).is_some() {
                return Err(read_only(format!("{op} of inode {ino}")));
            }
        }
        Ok(())
    }

    /// Refuses a new name `.snapshot` in the root (create, mkdir, mknod, symlink, link,
    /// rename onto it): `EEXIST`, since a lookup finds the snapshot directory there.
    pub(crate) fn refuse_reserved_name(&self, parent: u64, name: &[u8]) -> Result<()> {
        if parent == ROOT_OBJECTID && name == SNAPSHOT_DIR_NAME && self.alone().is_none() {
            return Err(Error::Exists(
                "\".snapshot\" in the root: the name is reserved for the snapshot directory".into(),
            ));
        }
        Ok(())
    }

    /// `EROFS` for removing or renaming `/.snapshot` itself (no real entry of that name).
    pub(crate) fn refuse_snapshot_dir_change(
        &self,
        op: &str,
        parent: u64,
        name: &[u8],
    ) -> Result<()> {
        if self.is_snapshot_dir_name(parent, name) && self.find_entry(parent, name)?.is_none() {
            return Err(read_only(format!("{op} of /.snapshot")));
        }
        Ok(())
    }

    /// Whether `name` in `parent` is the snapshot directory (the caller found no real entry).
    pub(crate) fn is_snapshot_dir_name(&self, parent: u64, name: &[u8]) -> bool {
        parent == ROOT_OBJECTID && name == SNAPSHOT_DIR_NAME && self.alone().is_none()
    }

    /// The inode number a snapshot object is shown with: the root's (1) for the root of a
    /// snapshot served alone, else [`snapshot_ino`].
    fn shown_ino(&self, id: u64, obj: u64) -> u64 {
        if obj == ROOT_OBJECTID && self.alone() == Some(id) {
            ROOT_OBJECTID
        } else {
            snapshot_ino(id, InodeNo::new(obj)).get()
        }
    }

    /// A view of snapshot `id`: `NotFound` (`ENOENT`, which the kernel turns into `ESTALE`
    /// for a file handle) once it is deleted.
    fn snap_view(&self, id: u64) -> Result<CommittedView<'_>> {
        self.inner.engine.check_up()?;
        self.inner.engine.snapshot_view(id)
    }

    fn snap_inode(view: &CommittedView<'_>, id: u64, obj: u64) -> Result<InodeItem> {
        items::get_inode(view, InodeNo::new(obj))?
            .ok_or_else(|| Error::NotFound(format!("inode {obj} of snapshot id {id}")))
    }

    /// The attributes of `/.snapshot`: a directory of mode 0555 owned by root, its times those
    /// of the newest snapshot (the root's when there is none).
    fn snapshot_dir_attr(&self) -> Result<Attr> {
        let root = self.getattr(ROOT_INO)?;
        let list = self.inner.engine.snapshots();
        let t = list.last().map(|s| s.created).unwrap_or(root.ctime);
        Ok(Attr {
            ino: SNAPSHOT_DIR_INO,
            size: 0,
            blocks: 0,
            atime: t,
            mtime: t,
            ctime: t,
            crtime: t,
            kind: FileKind::Dir,
            perm: 0o555,
            nlink: 2 + list.len() as u32,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: BLOCK_SIZE as u32,
            generation: 0,
        })
    }

    fn snapshot_named(&self, name: &[u8]) -> Result<Snapshot> {
        self.inner
            .engine
            .snapshots()
            .into_iter()
            .find(|s| s.name.as_bytes() == name)
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "snapshot {:?} in /.snapshot",
                    String::from_utf8_lossy(name)
                ))
            })
    }

    pub(crate) fn snap_getattr(&self, node: SnapNode) -> Result<Attr> {
        match node {
            SnapNode::Dir => self.snapshot_dir_attr(),
            SnapNode::In { id, obj } => {
                let view = self.snap_view(id)?;
                let item = Self::snap_inode(&view, id, obj)?;
                Ok(attr_of(self.shown_ino(id, obj), &item))
            }
        }
    }

    /// The parent of a snapshot directory: `/.snapshot` for a snapshot's root (itself when
    /// served alone), the root for `/.snapshot`.
    pub(crate) fn snap_parent_of(&self, node: SnapNode) -> Result<u64> {
        match node {
            SnapNode::Dir => Ok(ROOT_OBJECTID),
            SnapNode::In { id, obj } if obj == ROOT_OBJECTID => {
                if self.alone() == Some(id) {
                    Ok(ROOT_OBJECTID)
                } else {
                    Ok(SNAPSHOT_DIR_OBJECTID)
                }
            }
            SnapNode::In { id, obj } => {
                let view = self.snap_view(id)?;
                let parent = items::first_parent(&view, InodeNo::new(obj))?
                    .ok_or_else(|| {
                        Error::NotFound(format!("parent of dir {obj} of snapshot id {id}"))
                    })?
                    .get();
                Ok(self.shown_ino(id, parent))
            }
        }
    }

    pub(crate) fn snap_lookup(&self, parent: SnapNode, name: &[u8]) -> Result<Attr> {
        if name == b"." {
            return self.snap_getattr(parent);
        }
        if name == b".." {
            let up = self.snap_parent_of(parent)?;
            return self.getattr(InodeNo::new(up));
        }
        match parent {
            SnapNode::Dir => {
                let s = self.snapshot_named(name)?;
                self.snap_getattr(SnapNode::In {
                    id: s.id,
                    obj: ROOT_OBJECTID,
                })
            }
            SnapNode::In { id, obj } => {
                let view = self.snap_view(id)?;
                let dir = Self::snap_inode(&view, id, obj)?;
                if dir.mode & libc::S_IFMT != libc::S_IFDIR {
                    return Err(Error::NotDir(format!("inode {obj} of snapshot id {id}")));
                }
                let child = items::find_entry(&view, InodeNo::new(obj), name)?
                    .ok_or_else(|| {
                        Error::NotFound(format!(
                            "{:?} in dir {obj} of snapshot id {id}",
                            String::from_utf8_lossy(name)
                        ))
                    })?
                    .child;
                let item = Self::snap_inode(&view, id, child)?;
                Ok(attr_of(self.shown_ino(id, child), &item))
            }
        }
    }

    /// Where a listing of a snapshot directory ends ([`Filesystem::readdir_end`]).
    pub(crate) fn snap_readdir_end(&self, node: SnapNode) -> Result<u64> {
        match node {
            // A snapshot's position is its id + 2: ids are never reused, so a position
            // stays its snapshot's across deletions.
            SnapNode::Dir => Ok(self.inner.engine.superblock().next_snapshot_id.max(1) + 2),
            SnapNode::In { id, obj } => {
                let view = self.snap_view(id)?;
                let item = Self::snap_inode(&view, id, obj)?;
                if item.mode & libc::S_IFMT != libc::S_IFDIR {
                    return Err(Error::NotDir(format!("inode {obj} of snapshot id {id}")));
                }
                Ok(item.next_dir_index)
            }
        }
    }

    pub(crate) fn snap_readdir(
        &self,
        node: SnapNode,
        offset: u64,
        limit: usize,
        end: Option<u64>,
    ) -> Result<Vec<DirEntryOut>> {
        let mut out = Vec::new();
        let (this, view) = match node {
            SnapNode::Dir => (SNAPSHOT_DIR_OBJECTID, None),
            SnapNode::In { id, obj } => {
                let view = self.snap_view(id)?;
                let item = Self::snap_inode(&view, id, obj)?;
                if item.mode & libc::S_IFMT != libc::S_IFDIR {
                    return Err(Error::NotDir(format!("inode {obj} of snapshot id {id}")));
                }
                (self.shown_ino(id, obj), Some(view))
            }
        };
        if offset == 0 {
            out.push(DirEntryOut {
                ino: InodeNo::new(this),
                next_offset: 1,
                kind: FileKind::Dir,
                name: b".".to_vec(),
            });
        }
        if offset <= 1 && out.len() < limit {
            out.push(DirEntryOut {
                ino: InodeNo::new(self.snap_parent_of(node)?),
                next_offset: 2,
                kind: FileKind::Dir,
                name: b"..".to_vec(),
            });
        }
        let lo = offset.max(2);
        let hi = end.unwrap_or(u64::MAX);
        if out.len() >= limit || lo >= hi {
            return Ok(out);
        }
        match (node, view) {
            (SnapNode::In { id, obj }, Some(view)) => {
                for (index, e) in
                    items::listing(&view, InodeNo::new(obj), lo, hi, limit - out.len())?
                {
                    out.push(DirEntryOut {
                        ino: InodeNo::new(self.shown_ino(id, e.child)),
                        next_offset: index + 1,
                        kind: FileKind::from_dtype(e.file_type),
                        name: e.name,
                    });
                }
            }
            _ => {
                for s in self.inner.engine.snapshots() {
                    let at = s.id + 2;
                    if at < lo || at >= hi || out.len() >= limit {
                        continue;
                    }
                    out.push(DirEntryOut {
                        ino: snapshot_ino(s.id, ROOT_INO),
                        next_offset: at + 1,
                        kind: FileKind::Dir,
                        name: s.name.into_bytes(),
                    });
                }
            }
        }
        Ok(out)
    }

    pub(crate) fn snap_readlink(&self, node: SnapNode) -> Result<Vec<u8>> {
        let SnapNode::In { id, obj } = node else {
            return Err(Error::Invalid("readlink of /.snapshot".into()));
        };
        let view = self.snap_view(id)?;
        let item = Self::snap_inode(&view, id, obj)?;
        if item.mode & libc::S_IFMT != libc::S_IFLNK {
            return Err(Error::Invalid(format!(
                "readlink of non-symlink {obj} of snapshot id {id}"
            )));
        }
        // The size comes from the tree: capped, so a damaged item cannot ask for a huge buffer.
        let len = (item.size as usize).min(libc::PATH_MAX as usize);
        self.snap_read_item(&view, obj, &item, 0, len)
    }

    /// Reads up to `size` bytes at `offset` of a file of a snapshot. No atime moves.
    pub(crate) fn snap_read(&self, node: SnapNode, offset: u64, size: usize) -> Result<Vec<u8>> {
        let SnapNode::In { id, obj } = node else {
            return Err(Error::IsDir("read of /.snapshot".into()));
        };
        let view = self.snap_view(id)?;
        let item = Self::snap_inode(&view, id, obj)?;
        if item.mode & libc::S_IFMT == libc::S_IFDIR {
            return Err(Error::IsDir(format!(
                "read of dir {obj} of snapshot id {id}"
            )));
        }
        self.snap_read_item(&view, obj, &item, offset, size)
    }

    fn snap_read_item(
        &self,
        view: &CommittedView<'_>,
        obj: u64,
        item: &InodeItem,
        offset: u64,
        size: usize,
    ) -> Result<Vec<u8>> {
        if offset >= item.size || size == 0 {
            return Ok(Vec::new());
        }
        let end = item.size.min(offset.saturating_add(size as u64));
        let mut out = vec![0u8; (end - offset) as usize];
        let extents = crate::data::extents_in(view, obj, offset, end)?;
        self.data()
            .read_extents_into(obj, &extents, offset, end, &mut out)?;
        Ok(out)
    }

    /// SEEK_DATA and SEEK_HOLE in a file of a snapshot.
    pub(crate) fn snap_lseek(&self, node: SnapNode, offset: u64, whence: i32) -> Result<u64> {
        let SnapNode::In { id, obj } = node else {
            return Err(Error::Invalid("lseek in /.snapshot".into()));
        };
        let view = self.snap_view(id)?;
        let size = Self::snap_inode(&view, id, obj)?.size;
        crate::data::seek_data_or_hole(
            format_args!("inode {obj} of snapshot id {id}"),
            size,
            offset,
            whence,
            |from, to| crate::data::extents_in(&view, obj, from, to),
        )
    }

    pub(crate) fn snap_getxattr(&self, node: SnapNode, name: &[u8]) -> Result<Vec<u8>> {
        let missing = || {
            Error::NoData(format!(
                "xattr {:?} of {node:?}",
                String::from_utf8_lossy(name)
            ))
        };
        let SnapNode::In { id, obj } = node else {
            return Err(missing());
        };
        let view = self.snap_view(id)?;
        items::get_xattr(&view, InodeNo::new(obj), name)?.ok_or_else(missing)
    }

    pub(crate) fn snap_listxattr(&self, node: SnapNode) -> Result<Vec<u8>> {
        let SnapNode::In { id, obj } = node else {
            return Ok(Vec::new());
        };
        let view = self.snap_view(id)?;
        let mut out = Vec::new();
        for name in items::xattr_names(&view, InodeNo::new(obj))? {
            out.extend_from_slice(&name);
            out.push(0);
        }
        Ok(out)
    }

    /// Opens a file of a snapshot: read-only (`EROFS` for a write or a truncate), and counted
    /// until its release, so that the snapshot's deletion answers `EBUSY` meanwhile.
    pub(crate) fn snap_open(&self, node: SnapNode, flags: i32) -> Result<u64> {
        if flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0 {
            return Err(read_only(format!("open for writing of {node:?}")));
        }
        if let SnapNode::In { id, .. } = node {
            let mut opens = self.inner.snaps.opens.lock();
            if opens.deleting.contains(&id) || self.inner.engine.snapshot(id).is_none() {
                return Err(Error::NotFound(format!("snapshot id {id} (deleted)")));
            }
            *opens.counts.entry(id).or_insert(0) += 1;
        }
        Ok(self.new_fh())
    }

    pub(crate) fn snap_release(&self, node: SnapNode) {
        if let SnapNode::In { id, .. } = node {
            let mut opens = self.inner.snaps.opens.lock();
            if let Some(n) = opens.counts.get_mut(&id) {
                *n -= 1;
                if *n == 0 {
                    opens.counts.remove(&id);
                }
            }
        }
    }

    /// Files open in snapshot `id` (through [`Filesystem::open_file`]).
    pub fn snapshot_open_files(&self, id: u64) -> u64 {
        self.inner
            .snaps
            .opens
            .lock()
            .counts
            .get(&id)
            .copied()
            .unwrap_or(0)
    }

    /// Deletes snapshot `name` unless a file is open in it (`Busy`, `EBUSY`); no file of it
    /// can be opened while the deletion runs.
    pub(crate) fn delete_snapshot_unless_busy(&self, name: &str) -> Result<Snapshot> {
        let Some(snapshot) = self
            .inner
            .engine
            .snapshots()
            .into_iter()
            .find(|s| s.name == name)
        else {
            return Err(Error::NotFound(format!("snapshot {name:?}")));
        };
        if self.alone() == Some(snapshot.id) {
            return Err(Error::Busy(format!(
                "snapshot {name:?}: it is served as this mount's root"
            )));
        }
        {
            let mut opens = self.inner.snaps.opens.lock();
            if let Some(n) = opens.counts.get(&snapshot.id) {
                return Err(Error::Busy(format!(
                    "snapshot {name:?}: {n} file(s) open in /.snapshot/{name}"
                )));
            }
            opens.deleting.insert(snapshot.id);
        }
        // Queued, then the filesystem's commit (never the engine's alone: it would record
        // buffered writes' sizes without their data).
        let deleted = self
            .inner
            .engine
            .queue_snapshot_delete_id(snapshot.id)
            .and_then(|victim| self.commit_now().map(|_| victim));
        self.inner.snaps.opens.lock().deleting.remove(&snapshot.id);
        deleted
    }

    /// Refuses the first snapshot of an image whose root has a real entry `.snapshot` (made
    /// by a build that did not reserve the name): it would hide the snapshot directory.
    pub(crate) fn check_snapshot_dir_free(&self) -> Result<()> {
        if self.find_entry(ROOT_OBJECTID, SNAPSHOT_DIR_NAME)?.is_some() {
            return Err(Error::Exists(
                "the root directory has an entry \".snapshot\", the name snapshots are shown \
                 under: rename or remove it before making a snapshot"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Serves snapshot `name` alone as the root from now on (`birch mount -o
    /// ro,snapshot=NAME`): node 1 is that snapshot's root, every other node number carries
    /// its id, `/.snapshot` is not there, and every change is `EROFS`. Only on a read-only
    /// filesystem, right after the open (before any node was handed out).
    pub fn serve_snapshot_alone(&self, name: &str) -> Result<Snapshot> {
        if self.inner.engine.read_only_reason().is_none() {
            return Err(Error::Invalid(format!(
                "snapshot {name:?}: a snapshot is mounted read-only only (-o ro,snapshot={name})"
            )));
        }
        let snapshot = self
            .inner
            .engine
            .snapshots()
            .into_iter()
            .find(|s| s.name == name)
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "snapshot {name:?} (see `birch snapshot list IMAGE`)"
                ))
            })?;
        self.inner.snaps.alone.store(snapshot.id, Ordering::SeqCst);
        Ok(snapshot)
    }

    /// The id of the snapshot served alone as the root, if any.
    #[inline]
    pub fn snapshot_alone(&self) -> Option<u64> {
        self.alone()
    }

    #[inline]
    fn alone(&self) -> Option<u64> {
        match self.inner.snaps.alone.load(Ordering::Relaxed) {
            0 => None,
            id => Some(id),
        }
    }

    /// The name of the snapshot this mount serves alone as its root (`-o ro,snapshot=`), or
    /// `None` for a mount of the live filesystem (`trusted.birch.alone` on the root, which
    /// `birch mount` asks before it shares an existing mount).
    pub fn serving_alone(&self) -> Option<String> {
        let id = self.alone()?;
        self.inner
            .engine
            .snapshots()
            .into_iter()
            .find(|s| s.id == id)
            .map(|s| s.name)
    }

    /// The snapshots as text, one line each: id, generation, creation time (seconds.nanos),
    /// the bytes only it holds ([`crate::Engine::snapshot_space`]; `-` if that walk fails) and
    /// name, separated by tabs (`trusted.birch.snapshots` on the root of a mount, which
    /// `birch snapshot list MNT` reads). A name with a tab or newline is escaped as Rust
    /// escapes a string's debug form. Kept until the next commit: a second read in the same
    /// committed state (the kernel asks for the size, then the value) walks no tree.
    pub fn snapshots_text(&self) -> String {
        let engine = &self.inner.engine;
        // The pin first, then the list (as `Engine::snapshot_space`): the list may already
        // name a snapshot the next root makes, which the key's ids then tell apart.
        let committed = engine.committed_root();
        let list = engine.snapshots();
        let key = (
            committed.generation,
            list.iter().map(|s| s.id).collect::<Vec<_>>(),
        );
        if let Some((at, text)) = &self.inner.snaps.texts.lock().list {
            if *at == key {
                return text.to_string();
            }
        }
        let space = match engine.snapshot_space_in(&committed, &list) {
            Ok(space) => Some(space),
            Err(e) => {
                log::warn!("snapshot list: the space only each holds: {e}");
                None
            }
        };
        drop(committed);
        let mut out = String::new();
        for (i, s) in list.iter().enumerate() {
            let name = if s.name.contains(['\t', '\n', '\\']) {
                format!("{:?}", s.name)
            } else {
                s.name.clone()
            };
            let only = space
                .as_ref()
                .and_then(|v| v.get(i))
                .map_or_else(|| "-".to_string(), |n| n.to_string());
            out.push_str(&format!(
                "{}\t{}\t{}.{:09}\t{}\t{}\n",
                s.id, s.generation, s.created.sec, s.created.nsec, only, name
            ));
        }
        // A failed walk is not kept: the next read tries again.
        if space.is_some() {
            self.inner.snaps.texts.lock().list = Some((key, Arc::from(out.as_str())));
        }
        out
    }

    /// `birch diff` through a mount (the root's `trusted.birch.diff/OFFSET/SNAP1[/SNAP2]`):
    /// the changes from snapshot `from` to snapshot `to` ([`crate::Engine::diff`]; `None`:
    /// the live state, committed first), a line each. The last [`DIFF_TEXTS_KEPT`] texts are
    /// kept, by snapshot ids and, for the live state, the committed generation, so the
    /// pieces of one text are cut from one walk. A change committed between two pieces of a
    /// diff to the live state makes the later piece one of the new state's text (not
    /// guarded, as before the cache).
    pub fn diff_text(&self, from: &str, to: Option<&str>) -> Result<Arc<[u8]>> {
        if to.is_none() {
            self.sync()?;
        }
        let engine = &self.inner.engine;
        // The pin first, then the list: the snapshots found keep their blocks while it is held
        // (as `Engine::diff`).
        let committed = engine.committed_root();
        let list = engine.snapshots();
        let find = |name: &str| {
            list.iter()
                .find(|s| s.name == name)
                .ok_or_else(|| Error::NotFound(format!("snapshot {name:?}")))
        };
        let old = find(from)?;
        let (new_root, to_key) = match to {
            Some(name) => {
                let s = find(name)?;
                (s.root, DiffTo::Snapshot(s.id))
            }
            None => (committed.root, DiffTo::Live(committed.generation)),
        };
        let key = DiffKey {
            from: old.id,
            to: to_key,
        };
        if let Some((_, text)) = self
            .inner
            .snaps
            .texts
            .lock()
            .diffs
            .iter()
            .find(|(k, _)| *k == key)
        {
            return Ok(text.clone());
        }
        let (changes, _) = engine.diff_roots(old.root, new_root)?;
        drop(committed);
        let mut text = Vec::new();
        for change in changes {
            text.extend_from_slice(change.to_string().as_bytes());
            text.push(b'\n');
        }
        let text: Arc<[u8]> = Arc::from(text);
        let mut texts = self.inner.snaps.texts.lock();
        if !texts.diffs.iter().any(|(k, _)| *k == key) {
            texts.diffs.push_back((key, text.clone()));
            while texts.diffs.len() > DIFF_TEXTS_KEPT {
                texts.diffs.pop_front();
            }
        }
        Ok(text)
    }
}
