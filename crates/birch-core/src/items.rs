//! Items: typed keys, reads and operations over the inode, inode ref, dir item, dir index,
//! orphan and xattr items of the filesystem tree. It sits between the engine (the running
//! transaction and the committed trees) and `vfs`.
//!
//! Owns: the key of every item of those kinds, and the key range of one inode's items
//! ([`inode_key_range`]) and of its names ([`inode_refs_range`]), so that `vfs`, fsync and
//! replay, scrub and the CLI build none by hand (every inode and directory number here is an
//! [`InodeNo`]);
//! decoding with context (which inode or directory, which item); the operations whose items
//! must change together: a link is a dir item entry, a dir index and an inode ref
//! ([`add_link`], [`remove_link`], [`retarget_link`], [`move_ref`]), and an xattr value over
//! `XATTR_VALUE_MAX` bytes is a list entry plus its chunks ([`set_xattr`], [`remove_xattr`]);
//! the one limit it enforces, that a list of entries sharing one hash fits one item (refused as
//! `NoSpace` before anything changes). Every read goes through [`ReadView`], which the live
//! state (`Engine`: running delta over frozen delta over the last commit), one committed tree
//! (`CommittedView`) and a plan ([`Changes`]) implement, so the same code reads a mounted
//! filesystem, a fixed committed root (scrub, snapshot browsing, repair) and an operation's
//! own changes before they are recorded.
//!
//! Must not touch: locks, the in-memory inode table, permissions, ACL rules and which errno a
//! POSIX call returns (`vfs` decides; the kinds here are `NoSpace` for a full item, `Exists`
//! for a name already there, `Corrupt` for bytes that do not decode); link counts, sizes and
//! times (they live in the inode items the caller passes); the fsync log; the device; extent
//! items (the data path in `vfs/file.rs` and `vfs/buffer.rs` owns them). Writes never do I/O:
//! a [`Changes`] collects them and [`Changes::record`] puts them in a transaction in one go.
//! The reads that plan them may do device I/O, with no engine lock held.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use birch_format::items::{
    decode_dir_entries, decode_inode_refs, decode_xattrs, encode_dir_entries, encode_inode_refs,
    encode_xattrs, xattr_chunk_hash, DirEntry, InodeItem, InodeRef, Xattr, XattrChunk, XattrSpill,
};
use birch_format::{
    name_hash, FormatError, InodeNo, ItemType, Key, MAX_ITEM_BYTES, ORPHAN_OBJECTID,
    XATTR_CHUNK_BYTES, XATTR_VALUE_MAX,
};

use crate::error::{Error, Result};
use crate::txn::{CommittedView, Engine, WriteTxn};

// ---------------------------------------------------------------------------------------------
// Keys

/// The key of inode `ino`'s inode item.
pub fn inode_key(ino: InodeNo) -> Key {
    Key::new(ino.get(), ItemType::InodeItem, 0)
}

/// The key range `[lo, hi)` that holds every item of inode `ino` (inode item, refs, xattrs,
/// extents, and a directory's entries), and no item of another inode.
pub fn inode_key_range(ino: InodeNo) -> (Key, Key) {
    Key::object_range(ino.get())
}

/// The key range `[lo, hi)` of every inode ref item of inode `ino` (all its names), whatever
/// their hashes.
pub fn inode_refs_range(ino: InodeNo) -> (Key, Key) {
    let lo = Key::new(ino.get(), ItemType::InodeRef, 0);
    let last = Key::new(ino.get(), ItemType::InodeRef, u64::MAX);
    (lo, last.successor().unwrap_or(Key::MAX))
}

/// The key of the dir item under which `name` is (or would be) in directory `dir`.
pub fn dir_item_key(dir: InodeNo, name: &[u8]) -> Key {
    Key::new(dir.get(), ItemType::DirItem, name_hash(&[name]))
}

/// The key of entry `index` of directory `dir`'s listing.
pub fn dir_index_key(dir: InodeNo, index: u64) -> Key {
    Key::new(dir.get(), ItemType::DirIndex, index)
}

/// The key of inode `ino`'s ref list under which its name `name` in `parent` is (or would be).
pub fn inode_ref_key(ino: InodeNo, parent: InodeNo, name: &[u8]) -> Key {
    Key::new(
        ino.get(),
        ItemType::InodeRef,
        name_hash(&[&parent.get().to_le_bytes(), name]),
    )
}

/// The key of inode `ino`'s xattr list under which `name` is (or would be).
pub fn xattr_key(ino: InodeNo, name: &[u8]) -> Key {
    Key::new(ino.get(), ItemType::Xattr, name_hash(&[name]))
}

/// The key of chunk `index` of the out-of-line value of xattr `name` of `ino`.
pub fn xattr_chunk_key(ino: InodeNo, name: &[u8], index: u32) -> Key {
    Key::new(
        ino.get(),
        ItemType::XattrChunk,
        xattr_chunk_hash(name, index),
    )
}

/// The key of the orphan item that lists inode `ino` (no names left, to be freed).
pub fn orphan_key(ino: InodeNo) -> Key {
    Key::new(ORPHAN_OBJECTID, ItemType::Orphan, ino.get())
}

/// The range `[lo, hi)` of the items of type `item_type` of object `objectid`.
fn type_range(objectid: u64, item_type: ItemType) -> (Key, Key) {
    (
        Key::new(objectid, item_type, 0),
        Key::new(objectid, item_type, u64::MAX),
    )
}

/// The range of every orphan item.
pub fn orphan_range() -> (Key, Key) {
    type_range(ORPHAN_OBJECTID, ItemType::Orphan)
}

// ---------------------------------------------------------------------------------------------
// Views

/// Where items are read from: the live state ([`Engine`]), one committed tree
/// (`CommittedView`), or an operation's changes over either ([`Changes`]).
pub trait ReadView {
    /// The value of `key`, if any. May do device I/O.
    fn get(&self, key: &Key) -> Result<Option<Vec<u8>>>;

    /// Up to `limit` items in `[lo, hi)`, in key order. `lo` and `hi` cover one object id.
    /// May do device I/O.
    fn range(&self, lo: &Key, hi: &Key, limit: usize) -> Result<Vec<(Key, Arc<[u8]>)>>;
}

impl ReadView for Engine {
    fn get(&self, key: &Key) -> Result<Option<Vec<u8>>> {
        Engine::get(self, key)
    }

    fn range(&self, lo: &Key, hi: &Key, limit: usize) -> Result<Vec<(Key, Arc<[u8]>)>> {
        Engine::range(self, lo, hi, limit)
    }
}

impl ReadView for CommittedView<'_> {
    fn get(&self, key: &Key) -> Result<Option<Vec<u8>>> {
        CommittedView::get(self, key)
    }

    fn range(&self, lo: &Key, hi: &Key, limit: usize) -> Result<Vec<(Key, Arc<[u8]>)>> {
        Ok(CommittedView::range(self, lo, hi, limit)?
            .into_iter()
            .map(|(k, v)| (k, Arc::from(v)))
            .collect())
    }
}

/// Where item changes go: a transaction, or a [`Changes`] that records them later.
pub trait ItemWrite {
    /// Sets `key` to `value`.
    fn put(&mut self, key: Key, value: Vec<u8>);
    /// Deletes `key`.
    fn delete(&mut self, key: Key);
}

impl ItemWrite for WriteTxn<'_> {
    fn put(&mut self, key: Key, value: Vec<u8>) {
        WriteTxn::put(self, key, value);
    }

    fn delete(&mut self, key: Key) {
        WriteTxn::delete(self, key);
    }
}

/// The item changes of one operation, planned over a view before any is recorded: reads
/// through it see the changes planned so far over the view (so the steps of a rename build on
/// one another), and each key read from the view is read from it once. [`Changes::record`]
/// puts them all in a transaction; dropping it records nothing.
pub struct Changes<'v, V: ReadView + ?Sized> {
    base: &'v V,
    planned: BTreeMap<Key, Option<Vec<u8>>>,
    /// Values read from `base`, so the checks before an operation and the operation itself
    /// read each item once.
    read: RefCell<HashMap<Key, Option<Vec<u8>>>>,
}

/// A plan over the live state.
pub type LiveChanges<'e> = Changes<'e, Engine>;

impl<'v, V: ReadView + ?Sized> Changes<'v, V> {
    /// No changes yet, over `base`.
    pub fn new(base: &'v V) -> Self {
        Changes {
            base,
            planned: BTreeMap::new(),
            read: RefCell::new(HashMap::new()),
        }
    }

    /// Whether nothing is planned.
    pub fn is_empty(&self) -> bool {
        self.planned.is_empty()
    }

    /// The planned value of `key`: `None` when the plan leaves it alone, `Some(None)` when it
    /// deletes it.
    pub fn planned(&self, key: &Key) -> Option<Option<&[u8]>> {
        self.planned.get(key).map(|v| v.as_deref())
    }

    /// Records every planned change in `txn`. No I/O.
    pub fn record(self, txn: &WriteTxn<'_>) {
        for (key, value) in self.planned {
            match value {
                Some(v) => txn.put(key, v),
                None => txn.delete(key),
            }
        }
    }
}

impl<V: ReadView + ?Sized> ItemWrite for Changes<'_, V> {
    fn put(&mut self, key: Key, value: Vec<u8>) {
        self.planned.insert(key, Some(value));
    }

    fn delete(&mut self, key: Key) {
        self.planned.insert(key, None);
    }
}

impl<V: ReadView + ?Sized> ReadView for Changes<'_, V> {
    fn get(&self, key: &Key) -> Result<Option<Vec<u8>>> {
        if let Some(value) = self.planned.get(key) {
            return Ok(value.clone());
        }
        if let Some(value) = self.read.borrow().get(key) {
            return Ok(value.clone());
        }
        let value = self.base.get(key)?;
        self.read.borrow_mut().insert(*key, value.clone());
        Ok(value)
    }

    fn range(&self, lo: &Key, hi: &Key, limit: usize) -> Result<Vec<(Key, Arc<[u8]>)>> {
        let planned: Vec<_> = self.planned.range(*lo..*hi).collect();
        // Each planned deletion can hide one item of the view: ask for that many more.
        let mut merged: BTreeMap<Key, Arc<[u8]>> = self
            .base
            .range(lo, hi, limit.saturating_add(planned.len()))?
            .into_iter()
            .collect();
        let base_last = merged.keys().next_back().copied();
        let base_full = merged.len() >= limit.saturating_add(planned.len());
        for (key, value) in planned {
            // Past the last item the view returned when it was cut short, a planned put
            // could come before items the view has and did not return.
            if base_full && base_last.is_some_and(|last| *key > last) {
                continue;
            }
            match value {
                Some(v) => merged.insert(*key, Arc::from(v.as_slice())),
                None => merged.remove(key),
            };
        }
        Ok(merged.into_iter().take(limit).collect())
    }
}

// ---------------------------------------------------------------------------------------------
// Inode items and orphans

/// Inode `ino`'s inode item, if it has one.
pub fn get_inode<V: ReadView + ?Sized>(view: &V, ino: InodeNo) -> Result<Option<InodeItem>> {
    match view.get(&inode_key(ino))? {
        Some(bytes) => InodeItem::decode(&bytes)
            .map(Some)
            .map_err(|e| Error::corrupt(format!("inode {ino}"), e)),
        None => Ok(None),
    }
}

/// Stores inode `ino`'s inode item.
pub fn put_inode(w: &mut impl ItemWrite, ino: InodeNo, item: &InodeItem) {
    w.put(inode_key(ino), item.encode());
}

/// Lists inode `ino` as an orphan (no names left; freed at its last close or the next mount).
pub fn put_orphan(w: &mut impl ItemWrite, ino: InodeNo) {
    w.put(orphan_key(ino), Vec::new());
}

/// Takes inode `ino` off the orphan list.
pub fn delete_orphan(w: &mut impl ItemWrite, ino: InodeNo) {
    w.delete(orphan_key(ino));
}

/// Every inode on the orphan list.
pub fn orphans<V: ReadView + ?Sized>(view: &V) -> Result<Vec<InodeNo>> {
    let (lo, hi) = orphan_range();
    Ok(view
        .range(&lo, &hi, usize::MAX)?
        .into_iter()
        .map(|(key, _)| InodeNo::new(key.offset))
        .collect())
}

// ---------------------------------------------------------------------------------------------
// Links: dir items, dir indexes and inode refs

/// One name of an inode: `name` in directory `parent`, entry `dir_index` of its listing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Link<'n> {
    /// The directory that holds the name.
    pub parent: InodeNo,
    /// The name, 1 ..= `NAME_MAX` bytes, never `.` or `..`.
    pub name: &'n [u8],
    /// The inode the name points to.
    pub child: InodeNo,
    /// The child's d_type, as the entry stores it.
    pub file_type: u8,
    /// The entry's position in `parent`'s listing (its dir index item).
    pub dir_index: u64,
}

impl Link<'_> {
    fn entry(&self) -> DirEntry {
        DirEntry {
            child: self.child.get(),
            dir_index: self.dir_index,
            file_type: self.file_type,
            name: self.name.to_vec(),
        }
    }
}

fn shown(name: &[u8]) -> String {
    format!("{:?}", String::from_utf8_lossy(name))
}

/// The entries of directory `dir` under `name`'s hash: the one named `name`, if there is
/// one, and any other names that hash alike.
pub fn dir_entries<V: ReadView + ?Sized>(
    view: &V,
    dir: InodeNo,
    name: &[u8],
) -> Result<Vec<DirEntry>> {
    match view.get(&dir_item_key(dir, name))? {
        Some(bytes) => decode_dir_entries(&bytes)
            .map_err(|e| Error::corrupt(format!("dir {dir} item for {}", shown(name)), e)),
        None => Ok(Vec::new()),
    }
}

/// The entry `name` in directory `dir`, if there is one.
pub fn find_entry<V: ReadView + ?Sized>(
    view: &V,
    dir: InodeNo,
    name: &[u8],
) -> Result<Option<DirEntry>> {
    Ok(dir_entries(view, dir, name)?
        .into_iter()
        .find(|e| e.name == name))
}

/// The names of inode `ino` under the ref key of (`parent`, `name`): that one, if it is a
/// name of `ino`, and any others that hash alike.
pub fn inode_refs<V: ReadView + ?Sized>(
    view: &V,
    ino: InodeNo,
    parent: InodeNo,
    name: &[u8],
) -> Result<Vec<InodeRef>> {
    match view.get(&inode_ref_key(ino, parent, name))? {
        Some(bytes) => {
            decode_inode_refs(&bytes).map_err(|e| Error::corrupt(format!("inode {ino} refs"), e))
        }
        None => Ok(Vec::new()),
    }
}

/// The directory that holds the first name of `ino` in key order (a directory's only name):
/// `None` when it has no names.
pub fn first_parent<V: ReadView + ?Sized>(view: &V, ino: InodeNo) -> Result<Option<InodeNo>> {
    let (lo, hi) = type_range(ino.get(), ItemType::InodeRef);
    let refs = view.range(&lo, &hi, 1)?;
    let Some((key, bytes)) = refs.first() else {
        return Ok(None);
    };
    let refs = decode_inode_refs(bytes).map_err(|e| Error::corrupt(format!("ref {key}"), e))?;
    Ok(refs.first().map(|r| InodeNo::new(r.parent)))
}

/// How many names inode `ino` has, counted from its refs.
pub fn count_names<V: ReadView + ?Sized>(view: &V, ino: InodeNo) -> Result<u32> {
    let (lo, hi) = type_range(ino.get(), ItemType::InodeRef);
    let mut names = 0u32;
    for (key, bytes) in view.range(&lo, &hi, usize::MAX)? {
        let refs =
            decode_inode_refs(&bytes).map_err(|e| Error::corrupt(format!("ref {key}"), e))?;
        names = names.saturating_add(u32::try_from(refs.len()).unwrap_or(u32::MAX));
    }
    Ok(names)
}

/// Up to `limit` entries of directory `dir`'s listing with positions in `[from, to)`, in
/// listing order, each with its position.
pub fn listing<V: ReadView + ?Sized>(
    view: &V,
    dir: InodeNo,
    from: u64,
    to: u64,
    limit: usize,
) -> Result<Vec<(u64, DirEntry)>> {
    let mut out = Vec::new();
    if from >= to {
        return Ok(out);
    }
    for (key, bytes) in view.range(&dir_index_key(dir, from), &dir_index_key(dir, to), limit)? {
        let entries = decode_dir_entries(&bytes)
            .map_err(|e| Error::corrupt(format!("dir index {key}"), e))?;
        if let Some(entry) = entries.into_iter().next() {
            out.push((key.offset, entry));
        }
    }
    Ok(out)
}

/// A list of names sharing one hash must fit one item: past that, the name is refused
/// before anything changes.
fn check_list_size(bytes: &[u8], op: &str) -> Result<()> {
    if bytes.len() > MAX_ITEM_BYTES {
        return Err(Error::NoSpace(format!(
            "{op}: too many names share one hash"
        )));
    }
    Ok(())
}

/// Refuses (`NoSpace`, naming `op`) a new name `name` in `dir` whose dir item would not fit
/// one item with it. Reads what [`add_link`] reads; through a [`Changes`], only once.
pub fn check_dir_room<V: ReadView + ?Sized>(
    view: &V,
    dir: InodeNo,
    name: &[u8],
    op: &str,
) -> Result<()> {
    let mut probe = dir_entries(view, dir, name)?;
    probe.push(DirEntry {
        child: 0,
        dir_index: 0,
        file_type: 0,
        name: name.to_vec(),
    });
    check_list_size(&encode_dir_entries(&probe), op)
}

/// Refuses (`NoSpace`, naming `op`) a new name `name` in `parent` for inode `ino` whose ref
/// list would not fit one item with it.
pub fn check_ref_room<V: ReadView + ?Sized>(
    view: &V,
    ino: InodeNo,
    parent: InodeNo,
    name: &[u8],
    op: &str,
) -> Result<()> {
    let mut probe = inode_refs(view, ino, parent, name)?;
    probe.push(InodeRef {
        parent: parent.get(),
        dir_index: 0,
        name: name.to_vec(),
    });
    check_list_size(&encode_inode_refs(&probe), op)
}

/// The dir item of `link`'s name with its entry added, after checking that the name is not
/// taken (`Exists`) and that the item fits (`NoSpace`, naming `op`).
fn entries_with<V: ReadView + ?Sized>(view: &V, link: &Link<'_>, op: &str) -> Result<Vec<u8>> {
    let mut list = dir_entries(view, link.parent, link.name)?;
    if list.iter().any(|e| e.name == link.name) {
        return Err(Error::Exists(format!(
            "{} in dir {}",
            shown(link.name),
            link.parent
        )));
    }
    list.push(link.entry());
    let bytes = encode_dir_entries(&list);
    check_list_size(&bytes, op)?;
    Ok(bytes)
}

/// Plans `link`'s dir item (`item`, from [`entries_with`]) and its dir index.
fn put_entry(w: &mut impl ItemWrite, link: &Link<'_>, item: Vec<u8>) {
    w.put(dir_item_key(link.parent, link.name), item);
    w.put(
        dir_index_key(link.parent, link.dir_index),
        encode_dir_entries(&[link.entry()]),
    );
}

/// Plans the inode ref of `link` into the child's ref list (replacing a stale ref of the same
/// name), checking that the list fits (`NoSpace`, naming `op`).
pub fn add_ref<V: ReadView + ?Sized>(
    changes: &mut Changes<'_, V>,
    link: &Link<'_>,
    op: &str,
) -> Result<()> {
    let mut refs = inode_refs(changes, link.child, link.parent, link.name)?;
    refs.retain(|r| !(r.parent == link.parent.get() && r.name == link.name));
    refs.push(InodeRef {
        parent: link.parent.get(),
        dir_index: link.dir_index,
        name: link.name.to_vec(),
    });
    let bytes = encode_inode_refs(&refs);
    check_list_size(&bytes, op)?;
    changes.put(inode_ref_key(link.child, link.parent, link.name), bytes);
    Ok(())
}

/// Plans removing the ref of inode `ino` for its name `name` in `parent` (the ref list keeps
/// any other names that hash alike; an empty list is deleted). A name that is not there is
/// left alone.
pub fn remove_ref<V: ReadView + ?Sized>(
    changes: &mut Changes<'_, V>,
    ino: InodeNo,
    parent: InodeNo,
    name: &[u8],
) -> Result<()> {
    let refs = inode_refs(changes, ino, parent, name)?;
    let kept: Vec<InodeRef> = refs
        .into_iter()
        .filter(|r| !(r.parent == parent.get() && r.name == name))
        .collect();
    let key = inode_ref_key(ino, parent, name);
    if kept.is_empty() {
        changes.delete(key);
    } else {
        changes.put(key, encode_inode_refs(&kept));
    }
    Ok(())
}

/// Plans a new name: the dir item entry, the dir index and the inode ref of `link`, as one
/// change. `Exists` when the name is taken, `NoSpace` (naming `op`) when its dir item or the
/// child's ref list would not fit one item; nothing is planned then. The link count and the
/// directory's size, times and next index are the caller's (its inode items).
pub fn add_link<V: ReadView + ?Sized>(
    changes: &mut Changes<'_, V>,
    link: &Link<'_>,
    op: &str,
) -> Result<()> {
    let item = entries_with(changes, link, op)?;
    check_ref_room(changes, link.child, link.parent, link.name, op)?;
    put_entry(changes, link, item);
    add_ref(changes, link, op)
}

/// [`add_link`] for the first name of an inode made by the same operation: it has no refs to
/// read, so its ref list is this one name.
pub fn add_first_link<V: ReadView + ?Sized>(
    changes: &mut Changes<'_, V>,
    link: &Link<'_>,
    op: &str,
) -> Result<()> {
    let item = entries_with(changes, link, op)?;
    put_entry(changes, link, item);
    changes.put(
        inode_ref_key(link.child, link.parent, link.name),
        encode_inode_refs(&[InodeRef {
            parent: link.parent.get(),
            dir_index: link.dir_index,
            name: link.name.to_vec(),
        }]),
    );
    Ok(())
}

/// Plans removing the name `entry` from directory `parent`: its dir item entry (other names
/// under the same hash stay; an empty item is deleted), its dir index, and the child's ref
/// for it, as one change. Entries are matched by name; a name that is not there is left
/// alone. Link counts, sizes and the orphan item are the caller's.
pub fn remove_link<V: ReadView + ?Sized>(
    changes: &mut Changes<'_, V>,
    parent: InodeNo,
    entry: &DirEntry,
) -> Result<()> {
    let name = entry.name.as_slice();
    let kept: Vec<DirEntry> = dir_entries(changes, parent, name)?
        .into_iter()
        .filter(|e| e.name != name)
        .collect();
    let key = dir_item_key(parent, name);
    if kept.is_empty() {
        changes.delete(key);
    } else {
        changes.put(key, encode_dir_entries(&kept));
    }
    changes.delete(dir_index_key(parent, entry.dir_index));
    remove_ref(changes, InodeNo::new(entry.child), parent, name)
}

/// Plans pointing the existing name of `link` (its directory, name and dir index) at
/// `link.child` of type `link.file_type`: its dir item entry and dir index change, the name
/// and position stay (a rename exchange). Refs are the caller's ([`move_ref`]).
pub fn retarget_link<V: ReadView + ?Sized>(
    changes: &mut Changes<'_, V>,
    link: &Link<'_>,
) -> Result<()> {
    let list: Vec<DirEntry> = dir_entries(changes, link.parent, link.name)?
        .into_iter()
        .map(|mut e| {
            if e.name == link.name {
                e.child = link.child.get();
                e.file_type = link.file_type;
            }
            e
        })
        .collect();
    changes.put(
        dir_item_key(link.parent, link.name),
        encode_dir_entries(&list),
    );
    changes.put(
        dir_index_key(link.parent, link.dir_index),
        encode_dir_entries(&[link.entry()]),
    );
    Ok(())
}

/// Plans moving the ref of `to.child` for its name `from_name` in `from_parent` to the name
/// `to` ([`remove_ref`] then [`add_ref`]).
pub fn move_ref<V: ReadView + ?Sized>(
    changes: &mut Changes<'_, V>,
    from_parent: InodeNo,
    from_name: &[u8],
    to: &Link<'_>,
    op: &str,
) -> Result<()> {
    remove_ref(changes, to.child, from_parent, from_name)?;
    add_ref(changes, to, op)
}

// ---------------------------------------------------------------------------------------------
// Xattrs

/// The xattrs of inode `ino` under `name`'s hash: the one named `name`, if set, and any
/// others that hash alike.
pub fn xattr_list<V: ReadView + ?Sized>(view: &V, ino: InodeNo, name: &[u8]) -> Result<Vec<Xattr>> {
    match view.get(&xattr_key(ino, name))? {
        Some(bytes) => {
            decode_xattrs(&bytes).map_err(|e| Error::corrupt(format!("inode {ino} xattr"), e))
        }
        None => Ok(Vec::new()),
    }
}

/// The value an xattr list entry of inode `ino` holds: inline, or read from its chunk items
/// (each checked for its name and index, the whole for its size and crc32c).
pub fn xattr_value<V: ReadView + ?Sized>(view: &V, ino: InodeNo, entry: Xattr) -> Result<Vec<u8>> {
    let Some(spill) = entry.spill else {
        return Ok(entry.value);
    };
    let what = || format!("inode {ino} xattr {}", shown(&entry.name));
    let mut out = Vec::with_capacity(spill.size as usize);
    for index in 0..spill.chunks() {
        let bytes = view
            .get(&xattr_chunk_key(ino, &entry.name, index))?
            .ok_or_else(|| {
                Error::corrupt(
                    what(),
                    FormatError::invalid("xattr chunk", format!("{index} missing"), "present"),
                )
            })?;
        let chunk = XattrChunk::decode(&bytes).map_err(|e| Error::corrupt(what(), e))?;
        if chunk.name != entry.name || chunk.index != index {
            return Err(Error::corrupt(
                what(),
                FormatError::invalid(
                    "xattr chunk",
                    format!("{} chunk {}", shown(&chunk.name), chunk.index),
                    format!("chunk {index} of this name"),
                ),
            ));
        }
        out.extend_from_slice(&chunk.data);
    }
    let crc = birch_format::checksum(&out);
    if out.len() != spill.size as usize || crc != spill.crc {
        return Err(Error::corrupt(
            what(),
            FormatError::invalid(
                "out-of-line xattr value",
                format!("{} bytes, crc {crc:#010x}", out.len()),
                format!("{} bytes, crc {:#010x}", spill.size, spill.crc),
            ),
        ));
    }
    Ok(out)
}

/// The value of xattr `name` of inode `ino`, if set.
pub fn get_xattr<V: ReadView + ?Sized>(
    view: &V,
    ino: InodeNo,
    name: &[u8],
) -> Result<Option<Vec<u8>>> {
    match xattr_list(view, ino, name)?
        .into_iter()
        .find(|x| x.name == name)
    {
        Some(entry) => xattr_value(view, ino, entry).map(Some),
        None => Ok(None),
    }
}

/// Every xattr name of inode `ino`, in key order (by hash).
pub fn xattr_names<V: ReadView + ?Sized>(view: &V, ino: InodeNo) -> Result<Vec<Vec<u8>>> {
    // Keys of type Xattr only: chunks sort after them, outside the range.
    let (lo, hi) = type_range(ino.get(), ItemType::Xattr);
    let mut out = Vec::new();
    for (key, bytes) in view.range(&lo, &hi, usize::MAX)? {
        let list = decode_xattrs(&bytes).map_err(|e| Error::corrupt(format!("xattr {key}"), e))?;
        out.extend(list.into_iter().map(|x| x.name));
    }
    Ok(out)
}

/// Stores the first xattrs of an inode made by the same operation, each alone under its hash
/// (an inherited ACL): nothing to read. Each value fits inline.
pub fn put_new_xattr(w: &mut impl ItemWrite, ino: InodeNo, name: &[u8], value: Vec<u8>) {
    let xattrs = [Xattr {
        name: name.to_vec(),
        value,
        spill: None,
    }];
    w.put(xattr_key(ino, name), encode_xattrs(&xattrs));
}

/// Stores `list` as inode `ino`'s xattr list under `name`'s hash (deleting an empty one),
/// with no chunks of its own: the caller keeps every entry's values inline.
pub fn put_xattr_list(w: &mut impl ItemWrite, ino: InodeNo, name: &[u8], list: &[Xattr]) {
    if list.is_empty() {
        w.delete(xattr_key(ino, name));
    } else {
        w.put(xattr_key(ino, name), encode_xattrs(list));
    }
}

/// How a [`set_xattr`] stored its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XattrStored {
    /// Nothing changed: the value was to be removed and was not there.
    Unchanged,
    /// In the list item.
    Inline,
    /// Out of line in chunk items: the commit that holds them must set
    /// `INCOMPAT_XATTR_CHUNKS`.
    Chunks,
}

/// Plans setting xattr `name` of inode `ino` to `value` (`None`: removing it), replacing
/// what it held. A value over `XATTR_VALUE_MAX` bytes goes out of line, in chunks of
/// `XATTR_CHUNK_BYTES`; chunks of the old value beyond the new ones are deleted. `NoSpace`
/// when the list under the name's hash would not fit one item, or a chunk key is held by
/// another name of the inode (a hash collision); nothing is planned then. The caller checks
/// the value's size limit.
pub fn set_xattr<V: ReadView + ?Sized>(
    changes: &mut Changes<'_, V>,
    ino: InodeNo,
    name: &[u8],
    value: Option<&[u8]>,
) -> Result<XattrStored> {
    let mut list = xattr_list(changes, ino, name)?;
    let old = list.iter().find(|x| x.name == name).cloned();
    let Some(value) = value else {
        if old.is_none() {
            return Ok(XattrStored::Unchanged);
        }
        list.retain(|x| x.name != name);
        put_xattr_list(changes, ino, name, &list);
        delete_chunks(changes, ino, old.as_ref(), 0);
        return Ok(XattrStored::Inline);
    };
    list.retain(|x| x.name != name);
    let spill = (value.len() > XATTR_VALUE_MAX).then(|| XattrSpill {
        // A value is at most XATTR_SIZE_MAX (64 KiB) bytes, checked by the caller.
        size: u32::try_from(value.len()).unwrap_or(u32::MAX),
        crc: birch_format::checksum(value),
    });
    list.push(Xattr {
        name: name.to_vec(),
        value: if spill.is_some() {
            Vec::new()
        } else {
            value.to_vec()
        },
        spill,
    });
    let encoded = encode_xattrs(&list);
    if encoded.len() > MAX_ITEM_BYTES {
        return Err(Error::NoSpace(format!(
            "xattrs of inode {ino} sharing one hash"
        )));
    }
    let chunks = spill.map_or(0, |s| s.chunks());
    // A chunk key another name of this inode holds (a hash collision) cannot be used.
    for index in 0..chunks {
        if let Some(bytes) = changes.get(&xattr_chunk_key(ino, name, index))? {
            let chunk = XattrChunk::decode(&bytes)
                .map_err(|e| Error::corrupt(format!("inode {ino} xattr chunk"), e))?;
            if chunk.name != name {
                return Err(Error::NoSpace(format!(
                    "xattr chunks of inode {ino} sharing one hash"
                )));
            }
        }
    }
    changes.put(xattr_key(ino, name), encoded);
    for (index, data) in (0..chunks).zip(value.chunks(XATTR_CHUNK_BYTES)) {
        let chunk = XattrChunk {
            name: name.to_vec(),
            index,
            data: data.to_vec(),
        };
        changes.put(xattr_chunk_key(ino, name, index), chunk.encode());
    }
    delete_chunks(changes, ino, old.as_ref(), chunks);
    Ok(if spill.is_some() {
        XattrStored::Chunks
    } else {
        XattrStored::Inline
    })
}

/// Plans removing xattr `name` of inode `ino` and its chunks; whether it was set.
pub fn remove_xattr<V: ReadView + ?Sized>(
    changes: &mut Changes<'_, V>,
    ino: InodeNo,
    name: &[u8],
) -> Result<bool> {
    Ok(set_xattr(changes, ino, name, None)? != XattrStored::Unchanged)
}

/// Plans deleting chunks `from ..` of an xattr list entry's out-of-line value.
fn delete_chunks(w: &mut impl ItemWrite, ino: InodeNo, entry: Option<&Xattr>, from: u32) {
    let Some(entry) = entry else {
        return;
    };
    if let Some(spill) = entry.spill {
        for index in from..spill.chunks() {
            w.delete(xattr_chunk_key(ino, &entry.name, index));
        }
    }
}

#[cfg(test)]
mod tests {
    //! The items layer on a fresh engine: a link added and removed leaves no item behind; the
    //! same reads answer through the live state and through a committed root, each seeing its
    //! own version; and an inode's key range holds all of its items and none of its
    //! neighbours'.

    use std::sync::Arc;

    use birch_format::items::{InodeItem, Xattr};
    use birch_format::{ItemType, Key, FIRST_FREE_OBJECTID};

    use super::*;
    use crate::device::{BlockDevice, MemDevice};
    use crate::txn::{Engine, MkfsOptions};

    const DIR: InodeNo = InodeNo::new(FIRST_FREE_OBJECTID);
    const FILE: InodeNo = InodeNo::new(FIRST_FREE_OBJECTID + 1);

    /// The inode number `n` after `ino`.
    fn after(ino: InodeNo, n: u64) -> InodeNo {
        InodeNo::new(ino.get() + n)
    }

    fn engine() -> Arc<Engine> {
        let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(32 << 20));
        drop(Engine::create(dev.clone(), &MkfsOptions::default(), Vec::new()).expect("create"));
        Engine::open(dev).expect("open")
    }

    fn link(name: &[u8], index: u64) -> Link<'_> {
        Link {
            parent: DIR,
            name,
            child: FILE,
            file_type: libc::DT_REG,
            dir_index: index,
        }
    }

    /// Every key of object `ino` in the live state.
    fn keys_of(engine: &Engine, ino: InodeNo) -> Vec<Key> {
        let (lo, hi) = inode_key_range(ino);
        ReadView::range(engine, &lo, &hi, usize::MAX)
            .expect("range")
            .into_iter()
            .map(|(k, _)| k)
            .collect()
    }

    fn record(engine: &Engine, changes: Changes<'_, Engine>) {
        changes.record(&engine.begin().expect("begin"));
    }

    #[test]
    fn add_then_remove_link_round_trips() {
        let engine = engine();
        let mut changes = Changes::new(&*engine);
        add_link(&mut changes, &link(b"a", 2), "test").expect("add a");
        add_link(&mut changes, &link(b"b", 3), "test").expect("add b");
        // The plan reads its own changes: a second add of a name is refused.
        assert!(matches!(
            add_link(&mut changes, &link(b"a", 4), "test"),
            Err(Error::Exists(_))
        ));
        record(&engine, changes);

        let found = find_entry(&*engine, DIR, b"a").expect("find").expect("a");
        assert_eq!((found.child, found.dir_index), (FILE.get(), 2));
        assert_eq!(count_names(&*engine, FILE).expect("count"), 2);
        assert_eq!(first_parent(&*engine, FILE).expect("parent"), Some(DIR));
        let listed: Vec<(u64, Vec<u8>)> = listing(&*engine, DIR, 0, u64::MAX, usize::MAX)
            .expect("listing")
            .into_iter()
            .map(|(i, e)| (i, e.name))
            .collect();
        assert_eq!(listed, vec![(2, b"a".to_vec()), (3, b"b".to_vec())]);

        let mut changes = Changes::new(&*engine);
        for name in [&b"a"[..], b"b"] {
            let entry = find_entry(&changes, DIR, name)
                .expect("find")
                .expect("entry");
            remove_link(&mut changes, DIR, &entry).expect("remove");
        }
        record(&engine, changes);
        assert!(find_entry(&*engine, DIR, b"a").expect("find").is_none());
        assert_eq!(count_names(&*engine, FILE).expect("count"), 0);
        assert!(keys_of(&engine, DIR).is_empty(), "dir items left behind");
        assert!(keys_of(&engine, FILE).is_empty(), "refs left behind");
    }

    #[test]
    fn a_full_dir_item_refuses_the_name_before_planning() {
        let engine = engine();
        let mut changes = Changes::new(&*engine);
        // Names that hash alike are not at hand: the dir item under the hash of "x" is
        // planned by hand, full of other names as a run of collisions would leave it.
        let mut list = Vec::new();
        while encode_dir_entries(&list).len() <= MAX_ITEM_BYTES - 8 {
            list.push(DirEntry {
                child: FILE.get(),
                dir_index: 100 + list.len() as u64,
                file_type: libc::DT_REG,
                name: vec![b'y'; 255],
            });
        }
        changes.put(dir_item_key(DIR, b"x"), encode_dir_entries(&list));
        let before = changes.planned.clone();
        assert!(matches!(
            check_dir_room(&changes, DIR, b"x", "test"),
            Err(Error::NoSpace(_))
        ));
        assert!(matches!(
            add_link(&mut changes, &link(b"x", 2), "test"),
            Err(Error::NoSpace(_))
        ));
        assert_eq!(changes.planned, before, "nothing planned on refusal");
        // A name under another hash still fits.
        add_link(&mut changes, &link(b"w", 2), "test").expect("add w");
    }

    #[test]
    fn reads_answer_through_live_and_committed_views() {
        let engine = engine();
        let item = InodeItem {
            nlink: 1,
            mode: libc::S_IFREG | 0o644,
            ..Default::default()
        };
        let mut changes = Changes::new(&*engine);
        put_inode(&mut changes, FILE, &item);
        add_link(&mut changes, &link(b"old", 2), "test").expect("add");
        set_xattr(&mut changes, FILE, b"user.k", Some(b"v1")).expect("xattr");
        record(&engine, changes);
        engine.commit().expect("commit");
        let root = engine.committed_root();

        // After the commit: rename "old" to "new", change the xattr, add a big one.
        let mut changes = Changes::new(&*engine);
        let old = find_entry(&changes, DIR, b"old")
            .expect("find")
            .expect("old");
        remove_link(&mut changes, DIR, &old).expect("remove");
        add_link(&mut changes, &link(b"new", 3), "test").expect("add");
        set_xattr(&mut changes, FILE, b"user.k", Some(b"v2")).expect("xattr");
        let big = vec![7u8; XATTR_VALUE_MAX + 1];
        let stored = set_xattr(&mut changes, FILE, b"user.big", Some(&big)).expect("big");
        assert_eq!(stored, XattrStored::Chunks);
        record(&engine, changes);

        let live: &Engine = &engine;
        let committed = engine.committed_view(root);
        fn names<V: ReadView + ?Sized>(view: &V) -> Vec<Vec<u8>> {
            listing(view, DIR, 0, u64::MAX, usize::MAX)
                .expect("listing")
                .into_iter()
                .map(|(_, e)| e.name)
                .collect()
        }
        assert_eq!(names(live), vec![b"new".to_vec()]);
        assert_eq!(names(&committed), vec![b"old".to_vec()]);
        assert_eq!(
            get_xattr(live, FILE, b"user.k").expect("get"),
            Some(b"v2".to_vec())
        );
        assert_eq!(
            get_xattr(&committed, FILE, b"user.k").expect("get"),
            Some(b"v1".to_vec())
        );
        assert_eq!(get_xattr(live, FILE, b"user.big").expect("get"), Some(big));
        assert_eq!(get_xattr(&committed, FILE, b"user.big").expect("get"), None);
        let mut live_names = xattr_names(live, FILE).expect("names");
        live_names.sort();
        assert_eq!(live_names, vec![b"user.big".to_vec(), b"user.k".to_vec()]);
        for view in [live as &dyn ReadView, &committed] {
            assert_eq!(get_inode(view, FILE).expect("inode"), Some(item.clone()));
            assert_eq!(count_names(view, FILE).expect("count"), 1);
        }

        // Removing the big value takes its chunks with it.
        let mut changes = Changes::new(&*engine);
        assert!(remove_xattr(&mut changes, FILE, b"user.big").expect("remove"));
        assert!(!remove_xattr(&mut changes, FILE, b"user.none").expect("remove"));
        record(&engine, changes);
        let chunks = keys_of(&engine, FILE)
            .into_iter()
            .filter(|k| k.kind() == Some(ItemType::XattrChunk))
            .count();
        assert_eq!(chunks, 0);
    }

    #[test]
    fn a_plan_reads_its_own_changes_over_the_view() {
        let engine = engine();
        let mut changes = Changes::new(&*engine);
        put_new_xattr(&mut changes, FILE, b"user.a", b"1".to_vec());
        put_orphan(&mut changes, FILE);
        record(&engine, changes);

        let mut changes = Changes::new(&*engine);
        delete_orphan(&mut changes, FILE);
        put_orphan(&mut changes, DIR);
        assert_eq!(orphans(&changes).expect("orphans"), vec![DIR]);
        assert_eq!(orphans(&*engine).expect("orphans"), vec![FILE]);
        let list: Vec<Xattr> = Vec::new();
        put_xattr_list(&mut changes, FILE, b"user.a", &list);
        assert_eq!(get_xattr(&changes, FILE, b"user.a").expect("get"), None);
        assert_eq!(
            get_xattr(&*engine, FILE, b"user.a").expect("get"),
            Some(b"1".to_vec())
        );
        // A range cut short by its limit still answers in key order.
        put_orphan(&mut changes, after(FILE, 5));
        put_orphan(&mut changes, after(FILE, 6));
        let (lo, hi) = orphan_range();
        let first: Vec<u64> = changes
            .range(&lo, &hi, 2)
            .expect("range")
            .into_iter()
            .map(|(k, _)| k.offset)
            .collect();
        assert_eq!(first, vec![DIR.get(), after(FILE, 5).get()]);
    }

    #[test]
    fn an_inode_key_range_holds_exactly_its_items() {
        let engine = engine();
        let item = InodeItem::default();
        let mut changes = Changes::new(&*engine);
        for ino in [DIR, FILE, after(FILE, 1)] {
            put_inode(&mut changes, ino, &item);
            put_new_xattr(&mut changes, ino, b"user.x", b"v".to_vec());
        }
        add_link(&mut changes, &link(b"f", 2), "test").expect("add");
        let tail = Key::new(FILE.get(), ItemType::ExtentData, u64::MAX);
        changes.put(tail, vec![1]);
        record(&engine, changes);

        let (lo, hi) = inode_key_range(FILE);
        assert_eq!((lo.objectid, hi.objectid), (FILE.get(), FILE.get() + 1));
        let keys = keys_of(&engine, FILE);
        assert!(keys.iter().all(|k| k.objectid == FILE.get()));
        // Inode item, ref, xattr, and the greatest key an inode can have.
        assert_eq!(keys.len(), 4);
        assert_eq!(keys.first(), Some(&inode_key(FILE)));
        assert_eq!(keys.last(), Some(&tail));
        for key in [
            inode_key(FILE),
            inode_ref_key(FILE, DIR, b"f"),
            xattr_key(FILE, b"user.x"),
            xattr_chunk_key(FILE, b"user.x", 0),
        ] {
            assert!(lo <= key && key < hi, "{key} outside the range");
        }
        for key in [
            inode_key(after(FILE, 1)),
            dir_item_key(DIR, b"f"),
            dir_index_key(DIR, 2),
            orphan_key(FILE),
        ] {
            assert!(!(lo <= key && key < hi), "{key} inside the range");
        }
    }

    /// The refs range (scrub's path lookup reads it) holds every ref of the inode, also one
    /// whose hash is the greatest, and nothing else of it.
    #[test]
    fn an_inode_refs_range_holds_exactly_its_refs() {
        let (lo, hi) = inode_refs_range(FILE);
        let inside = |key: Key| lo <= key && key < hi;
        assert!(inside(inode_ref_key(FILE, DIR, b"f")));
        assert!(inside(Key::new(FILE.get(), ItemType::InodeRef, u64::MAX)));
        assert!(!inside(inode_key(FILE)));
        assert!(!inside(Key::new(FILE.get(), ItemType::Xattr, 0)));
        assert!(!inside(inode_ref_key(after(FILE, 1), DIR, b"f")));
    }
}
