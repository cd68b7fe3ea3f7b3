//! Namespace operations: lookup, create (and O_TMPFILE), link, unlink, rename (with whiteouts),
//! readdir.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use birch_format::items::{
    decode_dir_entries, decode_inode_refs, encode_dir_entries, encode_inode_refs, DirEntry,
    InodeItem, InodeRef,
};
use birch_format::{name_hash, ItemType, Key, LINK_MAX, ORPHAN_OBJECTID, ROOT_OBJECTID};
use parking_lot::RwLockWriteGuard;

use super::{attr_of, check_name, now, Attr, Caller, FileKind, Filesystem, InodeData, InodeState};
use crate::error::{Error, Result};

/// One readdir entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntryOut {
    /// Inode number the entry names.
    pub ino: u64,
    /// The offset of the entry after this one (the cookie to continue from).
    pub next_offset: u64,
    /// File type of the child, as stored in the entry (the d_type).
    pub kind: FileKind,
    /// Entry name in bytes, without a NUL; never contains `/`.
    pub name: Vec<u8>,
}

pub(crate) const RENAME_NOREPLACE: u32 = 1;
pub(crate) const RENAME_EXCHANGE: u32 = 2;
pub(crate) const RENAME_WHITEOUT: u32 = 4;
/// A whiteout's permission bits and device number, as Linux's `vfs_whiteout` makes it
/// (`WHITEOUT_MODE`, `WHITEOUT_DEV`): overlayfs recognises a whiteout by them.
const WHITEOUT_MODE: u32 = 0;
const WHITEOUT_DEV: u64 = 0;

fn dir_item_key(dir: u64, name: &[u8]) -> Key {
    Key::new(dir, ItemType::DirItem, name_hash(&[name]))
}

fn dir_index_key(dir: u64, index: u64) -> Key {
    Key::new(dir, ItemType::DirIndex, index)
}

fn inode_ref_key(ino: u64, parent: u64, name: &[u8]) -> Key {
    Key::new(
        ino,
        ItemType::InodeRef,
        name_hash(&[&parent.to_le_bytes(), name]),
    )
}

/// A dir item or inode ref list grows with names that share one hash. It must fit one item;
/// past that the name is refused before anything changes.
fn check_list_size(bytes: &[u8], what: &str) -> Result<()> {
    if bytes.len() > birch_format::MAX_ITEM_BYTES {
        return Err(Error::NoSpace(format!(
            "{what}: too many names share one hash"
        )));
    }
    Ok(())
}

/// `list` with one more entry named `name`, to size a change before making it.
fn with_probe_entry(list: &[DirEntry], name: &[u8]) -> Vec<DirEntry> {
    let mut probe = list.to_vec();
    probe.push(DirEntry {
        child: 0,
        dir_index: 0,
        file_type: 0,
        name: name.to_vec(),
    });
    probe
}

fn with_probe_ref(list: &[InodeRef], parent: u64, name: &[u8]) -> Vec<InodeRef> {
    let mut probe = list.to_vec();
    probe.push(InodeRef {
        parent,
        dir_index: 0,
        name: name.to_vec(),
    });
    probe
}

fn is_dir(item: &InodeItem) -> bool {
    item.mode & libc::S_IFMT == libc::S_IFDIR
}

/// What an entry change needs read before it takes the write gate.
struct EntrySlot {
    dir_item: Vec<DirEntry>,
}

struct RefSlot {
    refs: Vec<InodeRef>,
}

impl Filesystem {
    fn read_dir_item(&self, dir: u64, name: &[u8]) -> Result<EntrySlot> {
        let dir_item = match self.inner.engine.get(&dir_item_key(dir, name))? {
            Some(bytes) => decode_dir_entries(&bytes).map_err(|e| {
                Error::corrupt(
                    format!("dir {dir} item for {:?}", String::from_utf8_lossy(name)),
                    e,
                )
            })?,
            None => Vec::new(),
        };
        Ok(EntrySlot { dir_item })
    }

    fn read_refs(&self, ino: u64, parent: u64, name: &[u8]) -> Result<RefSlot> {
        let refs = match self.inner.engine.get(&inode_ref_key(ino, parent, name))? {
            Some(bytes) => decode_inode_refs(&bytes)
                .map_err(|e| Error::corrupt(format!("inode {ino} refs"), e))?,
            None => Vec::new(),
        };
        Ok(RefSlot { refs })
    }

    /// Finds `name` in `dir`.
    pub(crate) fn find_entry(&self, dir: u64, name: &[u8]) -> Result<Option<DirEntry>> {
        Ok(self
            .read_dir_item(dir, name)?
            .dir_item
            .into_iter()
            .find(|e| e.name == name))
    }

    fn dir_state(&self, dir: u64) -> Result<Arc<InodeState>> {
        let state = self.inode(dir)?;
        if !is_dir(&state.data.read().item) {
            return Err(Error::NotDir(format!("inode {dir}")));
        }
        Ok(state)
    }

    /// Looks up `name` in `parent`; counts a lookup.
    pub fn lookup(&self, parent: u64, name: &[u8]) -> Result<Attr> {
        check_name_or_dots(name)?;
        if name == b"." {
            // "." names any inode, not only a directory: the kernel resolves a file handle
            // whose inode it no longer caches (open_by_handle_at, an NFS export) with
            // LOOKUP(ino, "."). An inode with no names left answers ENOENT, which the kernel
            // turns into ESTALE, as ext4 does for an unlinked inode.
            let state = self.inode(parent)?;
            if state.data.read().item.nlink == 0 {
                return Err(Error::NotFound(format!(
                    "lookup of . in unlinked inode {parent}"
                )));
            }
            self.remember(&state);
            let data = state.data.read();
            return Ok(attr_of(parent, &data.item));
        }
        let dir = self.dir_state(parent)?;
        if dir.data.read().item.nlink == 0 {
            // A removed directory has no entries, not even "." and ".." (Linux: dead dir).
            return Err(Error::NotFound(format!("lookup in removed dir {parent}")));
        }
        let ino = match name {
            b"." => parent,
            b".." => self.parent_of(parent)?,
            _ => {
                let _d = dir.data.read();
                self.find_entry(parent, name)?
                    .ok_or_else(|| {
                        Error::NotFound(format!(
                            "{:?} in dir {parent}",
                            String::from_utf8_lossy(name)
                        ))
                    })?
                    .child
            }
        };
        let state = self.inode(ino)?;
        self.remember(&state);
        let data = state.data.read();
        Ok(attr_of(ino, &data.item))
    }

    /// The parent of a directory (its one inode ref), or itself for the root.
    pub fn parent_of(&self, dir: u64) -> Result<u64> {
        if dir == ROOT_OBJECTID {
            return Ok(ROOT_OBJECTID);
        }
        let lo = Key::new(dir, ItemType::InodeRef, 0);
        let hi = Key::new(dir, ItemType::InodeRef, u64::MAX);
        let refs = self.inner.engine.range(&lo, &hi, 1)?;
        let (key, bytes) = refs
            .first()
            .ok_or_else(|| Error::NotFound(format!("parent of dir {dir}")))?;
        let refs = decode_inode_refs(bytes).map_err(|e| Error::corrupt(format!("ref {key}"), e))?;
        refs.first()
            .map(|r| r.parent)
            .ok_or_else(|| Error::NotFound(format!("parent of dir {dir}")))
    }

    /// Makes a new inode named `name` in `parent`. `mode` includes the file type.
    pub(crate) fn make_node(
        &self,
        caller: Caller,
        parent: u64,
        name: &[u8],
        mode: u32,
        rdev: u64,
        symlink: Option<&[u8]>,
    ) -> Result<Attr> {
        check_name_or_dots(name)?;
        self.admit(true)?;
        let dir = self.dir_state(parent)?;
        let mut d = dir.data.write();
        if is_dot(name) {
            return Err(Error::Exists(format!(
                "{:?} in dir {parent}",
                String::from_utf8_lossy(name)
            )));
        }
        if d.item.nlink == 0 {
            return Err(Error::NotFound(format!("dir {parent} was removed")));
        }
        let kind = FileKind::from_mode(mode);
        if kind == FileKind::Dir && d.item.nlink >= LINK_MAX {
            return Err(Error::TooManyLinks(format!("dir {parent}")));
        }
        let slot = self.read_dir_item(parent, name)?;
        if slot.dir_item.iter().any(|e| e.name == name) {
            return Err(Error::Exists(format!(
                "{:?} in dir {parent}",
                String::from_utf8_lossy(name)
            )));
        }
        check_list_size(
            &encode_dir_entries(&with_probe_entry(&slot.dir_item, name)),
            "create",
        )?;
        let nlink = if kind == FileKind::Dir { 2 } else { 1 };
        let (ino, mut item, inherited) =
            self.new_inode_item(caller, parent, &d, mode, nlink, symlink.is_some())?;
        item.rdev = rdev;
        let t = item.ctime;
        let state = self.insert_inode(ino, item);
        let mut c = state.data.write();
        set_absent_xattrs(&mut c, &inherited);
        let _op = self.inner.engine.hold()?;
        if let Some(target) = symlink {
            self.write_locked(ino, &mut c, 0, target, None)?;
            c.item.mtime = t;
            c.item.ctime = t;
        }
        let index = d.item.next_dir_index;
        d.item.next_dir_index += 1;
        d.item.size += 1;
        if kind == FileKind::Dir {
            d.item.nlink += 1;
        }
        d.item.mtime = t;
        d.item.ctime = t;
        let entry = DirEntry {
            child: ino,
            dir_index: index,
            file_type: kind.dtype(),
            name: name.to_vec(),
        };
        let mut dir_item = slot.dir_item;
        dir_item.push(entry.clone());
        let refs = vec![InodeRef {
            parent,
            dir_index: index,
            name: name.to_vec(),
        }];
        {
            let txn = self.inner.engine.begin()?;
            c.item.transid = txn.generation();
            d.item.transid = txn.generation();
            txn.put(super::inode_key(ino), c.item.encode());
            txn.put(super::inode_key(parent), d.item.encode());
            txn.put(dir_item_key(parent, name), encode_dir_entries(&dir_item));
            txn.put(
                dir_index_key(parent, index),
                encode_dir_entries(std::slice::from_ref(&entry)),
            );
            txn.put(inode_ref_key(ino, parent, name), encode_inode_refs(&refs));
            put_inherited_acls(&txn, ino, inherited);
        }
        drop(_op);
        self.remember(&state);
        let attr = attr_of(ino, &c.item);
        drop(c);
        drop(d);
        self.maybe_commit();
        Ok(attr)
    }

    /// A new inode item for a node of `mode` (type included) made in directory `parent`
    /// (locked as `d`) by `caller`, with its number: the directory's default ACL or the
    /// umask applied (symlinks are always 0777), and the setgid directory rules (new entries
    /// take its group, new directories stay setgid).
    fn new_inode_item(
        &self,
        caller: Caller,
        parent: u64,
        d: &InodeData,
        mode: u32,
        nlink: u32,
        symlink: bool,
    ) -> Result<(u64, InodeItem, super::acl::Inherited)> {
        let kind = FileKind::from_mode(mode);
        let inherited = if symlink {
            super::acl::Inherited {
                mode,
                access: None,
                default: None,
            }
        } else {
            let parent_default = self.xattr_value(parent, d, super::acl::ACL_DEFAULT)?;
            super::acl::inherit(
                parent_default.as_deref(),
                mode,
                caller.umask,
                kind == FileKind::Dir,
            )?
        };
        let ino = if kind == FileKind::Dir {
            self.inner.engine.allocate_objectid_alone()
        } else {
            self.inner.engine.allocate_objectid()
        };
        let t = now();
        let mut gid = caller.gid;
        let mut mode = inherited.mode;
        if d.item.mode & libc::S_ISGID != 0 {
            gid = d.item.gid;
            if kind == FileKind::Dir {
                mode |= libc::S_ISGID;
            }
        }
        let item = InodeItem {
            generation: super::new_generation(&self.inner.engine.fsid(), ino),
            transid: 0,
            size: 0,
            nbytes: 0,
            nlink,
            uid: caller.uid,
            gid,
            mode,
            rdev: 0,
            flags: 0,
            next_dir_index: 2,
            atime: t,
            mtime: t,
            ctime: t,
            otime: t,
        };
        Ok((ino, item, inherited))
    }

    /// O_TMPFILE: a new regular file in `parent` without a name (link count 0), open as
    /// `flags` say; returns its attributes and a handle. Its orphan item is put in the same
    /// transaction, so a crash before a `link` gives it a name frees it at the next mount,
    /// as for a file unlinked while open; so does its last close and forget. The directory
    /// supplies its default ACL and setgid group as for `create` and is not changed. Unless
    /// `flags` has `O_EXCL`, `link` may give it a name (Linux's `I_LINKABLE`).
    pub fn tmpfile(
        &self,
        caller: Caller,
        parent: u64,
        mode: u32,
        flags: i32,
    ) -> Result<(Attr, u64)> {
        self.admit(true)?;
        let dir = self.dir_state(parent)?;
        let d = dir.data.read();
        if d.item.nlink == 0 {
            return Err(Error::NotFound(format!("dir {parent} was removed")));
        }
        let (ino, item, inherited) = self.new_inode_item(
            caller,
            parent,
            &d,
            libc::S_IFREG | (mode & 0o7777),
            0,
            false,
        )?;
        drop(d);
        let state = self.insert_inode(ino, item);
        let mut c = state.data.write();
        set_absent_xattrs(&mut c, &inherited);
        c.linkable = flags & libc::O_EXCL == 0;
        {
            let _op = self.inner.engine.hold()?;
            let txn = self.inner.engine.begin()?;
            c.item.transid = txn.generation();
            txn.put(super::inode_key(ino), c.item.encode());
            txn.put(Key::new(ORPHAN_OBJECTID, ItemType::Orphan, ino), Vec::new());
            put_inherited_acls(&txn, ino, inherited);
        }
        self.remember(&state);
        let attr = attr_of(ino, &c.item);
        drop(c);
        let fh = self.open_file(ino, flags & !libc::O_TMPFILE)?;
        self.maybe_commit();
        Ok((attr, fh))
    }

    /// mknod: regular files, fifos, sockets, device nodes.
    pub fn mknod(
        &self,
        caller: Caller,
        parent: u64,
        name: &[u8],
        mode: u32,
        rdev: u64,
    ) -> Result<Attr> {
        let kind = mode & libc::S_IFMT;
        let mode = if kind == 0 {
            mode | libc::S_IFREG
        } else {
            mode
        };
        match mode & libc::S_IFMT {
            libc::S_IFREG | libc::S_IFIFO | libc::S_IFSOCK | libc::S_IFCHR | libc::S_IFBLK => {
                self.make_node(caller, parent, name, mode, rdev, None)
            }
            libc::S_IFDIR => Err(Error::NotPermitted(
                "mknod of a directory (use mkdir)".into(),
            )),
            _ => Err(Error::Invalid(format!("mknod mode {mode:o}"))),
        }
    }

    /// mkdir.
    pub fn mkdir(&self, caller: Caller, parent: u64, name: &[u8], mode: u32) -> Result<Attr> {
        self.make_node(
            caller,
            parent,
            name,
            libc::S_IFDIR | (mode & 0o7777),
            0,
            None,
        )
    }

    /// symlink: `name` in `parent` pointing at `target`.
    pub fn symlink(&self, caller: Caller, parent: u64, name: &[u8], target: &[u8]) -> Result<Attr> {
        if target.len() >= libc::PATH_MAX as usize {
            return Err(Error::NameTooLong(format!(
                "symlink target of {} bytes",
                target.len()
            )));
        }
        if target.is_empty() {
            return Err(Error::NotFound("empty symlink target".into()));
        }
        self.make_node(caller, parent, name, libc::S_IFLNK | 0o777, 0, Some(target))
    }

    /// readlink.
    pub fn readlink(&self, ino: u64) -> Result<Vec<u8>> {
        let state = self.inode(ino)?;
        let data = state.data.read();
        if data.item.mode & libc::S_IFMT != libc::S_IFLNK {
            return Err(Error::Invalid(format!("readlink of non-symlink {ino}")));
        }
        self.read_locked(ino, &data, 0, data.item.size as usize)
    }

    /// link: a new name for `ino`.
    pub fn link(&self, ino: u64, newparent: u64, newname: &[u8]) -> Result<Attr> {
        check_name_or_dots(newname)?;
        self.admit(true)?;
        let target = self.inode(ino)?;
        let dir = self.dir_state(newparent)?;
        // Linux's order: the new name's directory and the name itself, then the source.
        {
            let d = dir.data.read();
            if is_dot(newname) {
                return Err(Error::Exists(format!(
                    "{:?} in dir {newparent}",
                    String::from_utf8_lossy(newname)
                )));
            }
            if d.item.nlink == 0 {
                return Err(Error::NotFound(format!("dir {newparent} was removed")));
            }
            if self.find_entry(newparent, newname)?.is_some() {
                return Err(Error::Exists(format!(
                    "{:?} in dir {newparent}",
                    String::from_utf8_lossy(newname)
                )));
            }
        }
        if is_dir(&target.data.read().item) {
            return Err(Error::NotPermitted(format!("hard link to directory {ino}")));
        }
        let (mut d, mut c) = lock_two(&dir, newparent, &target, ino);
        let c = c
            .as_mut()
            .ok_or_else(|| Error::Invalid("link to own parent".into()))?;
        if d.item.nlink == 0 {
            return Err(Error::NotFound(format!("dir {newparent} was removed")));
        }
        if c.item.nlink == 0 && !c.linkable {
            return Err(Error::NotFound(format!("inode {ino} was removed")));
        }
        if c.item.nlink >= LINK_MAX {
            return Err(Error::TooManyLinks(format!("inode {ino}")));
        }
        let slot = self.read_dir_item(newparent, newname)?;
        if slot.dir_item.iter().any(|e| e.name == newname) {
            return Err(Error::Exists(format!(
                "{:?} in dir {newparent}",
                String::from_utf8_lossy(newname)
            )));
        }
        let refs = self.read_refs(ino, newparent, newname)?;
        check_list_size(
            &encode_dir_entries(&with_probe_entry(&slot.dir_item, newname)),
            "link",
        )?;
        check_list_size(
            &encode_inode_refs(&with_probe_ref(&refs.refs, newparent, newname)),
            "link",
        )?;
        let t = now();
        let index = d.item.next_dir_index;
        d.item.next_dir_index += 1;
        d.item.size += 1;
        d.item.mtime = t;
        d.item.ctime = t;
        c.item.nlink += 1;
        c.item.ctime = t;
        let kind = FileKind::from_mode(c.item.mode);
        let entry = DirEntry {
            child: ino,
            dir_index: index,
            file_type: kind.dtype(),
            name: newname.to_vec(),
        };
        let mut dir_item = slot.dir_item;
        dir_item.push(entry.clone());
        let mut ref_list = refs.refs;
        ref_list.push(InodeRef {
            parent: newparent,
            dir_index: index,
            name: newname.to_vec(),
        });
        {
            let txn = self.inner.engine.begin()?;
            c.item.transid = txn.generation();
            d.item.transid = txn.generation();
            txn.put(super::inode_key(ino), c.item.encode());
            txn.put(super::inode_key(newparent), d.item.encode());
            self.unmark_log_clean(ino);
            txn.put(
                dir_item_key(newparent, newname),
                encode_dir_entries(&dir_item),
            );
            txn.put(
                dir_index_key(newparent, index),
                encode_dir_entries(std::slice::from_ref(&entry)),
            );
            txn.put(
                inode_ref_key(ino, newparent, newname),
                encode_inode_refs(&ref_list),
            );
            if c.item.nlink == 1 {
                // A tmpfile getting its first name leaves the orphan list, and may not be
                // linked again once its names are gone.
                txn.delete(Key::new(ORPHAN_OBJECTID, ItemType::Orphan, ino));
                c.linkable = false;
            }
        }
        target.lookups.fetch_add(1, Ordering::SeqCst);
        Ok(attr_of(ino, &c.item))
    }

    /// unlink a non-directory.
    pub fn unlink(&self, parent: u64, name: &[u8]) -> Result<()> {
        self.admit(false)?;
        self.remove_entry(parent, name, false)
    }

    /// rmdir an empty directory.
    pub fn rmdir(&self, parent: u64, name: &[u8]) -> Result<()> {
        check_name_or_dots(name)?;
        self.dir_state(parent)?;
        if name == b"." {
            return Err(Error::Invalid("rmdir of \".\"".into()));
        }
        if name == b".." {
            return Err(Error::NotEmpty("rmdir of \"..\"".into()));
        }
        self.admit(false)?;
        self.remove_entry(parent, name, true)
    }

    fn remove_entry(&self, parent: u64, name: &[u8], want_dir: bool) -> Result<()> {
        check_name_or_dots(name)?;
        let dir = self.dir_state(parent)?;
        if is_dot(name) {
            return Err(Error::IsDir(format!(
                "unlink of {:?}",
                String::from_utf8_lossy(name)
            )));
        }
        let child_ino = {
            let _d = dir.data.read();
            self.find_entry(parent, name)?
                .ok_or_else(|| {
                    Error::NotFound(format!(
                        "{:?} in dir {parent}",
                        String::from_utf8_lossy(name)
                    ))
                })?
                .child
        };
        let child = self.inode(child_ino)?;
        let (mut d, mut c) = lock_two(&dir, parent, &child, child_ino);
        let c = c
            .as_mut()
            .ok_or_else(|| Error::Invalid("remove of a directory from itself".into()))?;
        // Re-check under the locks: the entry may have changed.
        let slot = self.read_dir_item(parent, name)?;
        let Some(entry) = slot.dir_item.iter().find(|e| e.name == name).cloned() else {
            return Err(Error::NotFound(format!(
                "{:?} in dir {parent}",
                String::from_utf8_lossy(name)
            )));
        };
        if entry.child != child_ino {
            return Err(Error::Busy(format!(
                "{:?} changed during unlink",
                String::from_utf8_lossy(name)
            )));
        }
        let child_is_dir = is_dir(&c.item);
        if want_dir && !child_is_dir {
            return Err(Error::NotDir(format!("inode {child_ino}")));
        }
        if !want_dir && child_is_dir {
            return Err(Error::IsDir(format!("inode {child_ino}")));
        }
        if child_is_dir && c.item.size > 0 {
            return Err(Error::NotEmpty(format!("dir {child_ino}")));
        }
        let refs = self.read_refs(child_ino, parent, name)?;
        let t = now();
        self.unlink_locked(
            parent,
            &mut d,
            slot.dir_item,
            &entry,
            child_ino,
            c,
            refs.refs,
            t,
        )?;
        drop(d);
        Ok(())
    }

    /// Removes `entry` from the locked dir and drops the child's link; puts an orphan item when
    /// the child has no names left.
    fn unlink_locked(
        &self,
        parent: u64,
        d: &mut InodeData,
        dir_item: Vec<DirEntry>,
        entry: &DirEntry,
        child_ino: u64,
        c: &mut InodeData,
        refs: Vec<InodeRef>,
        t: birch_format::items::Timespec,
    ) -> Result<()> {
        let child_is_dir = is_dir(&c.item);
        let name = &entry.name;
        let remaining: Vec<DirEntry> = dir_item.into_iter().filter(|e| e.name != *name).collect();
        let remaining_refs: Vec<InodeRef> = refs
            .into_iter()
            .filter(|r| !(r.parent == parent && r.name == *name))
            .collect();
        d.item.size = d.item.size.saturating_sub(1);
        d.item.mtime = t;
        d.item.ctime = t;
        if child_is_dir {
            d.item.nlink = d.item.nlink.saturating_sub(1);
            c.item.nlink = 0;
        } else {
            c.item.nlink = c.item.nlink.saturating_sub(1);
        }
        c.item.ctime = t;
        let txn = self.inner.engine.begin()?;
        d.item.transid = txn.generation();
        c.item.transid = txn.generation();
        txn.put(super::inode_key(parent), d.item.encode());
        txn.put(super::inode_key(child_ino), c.item.encode());
        self.unmark_log_clean(child_ino);
        let dkey = dir_item_key(parent, name);
        if remaining.is_empty() {
            txn.delete(dkey);
        } else {
            txn.put(dkey, encode_dir_entries(&remaining));
        }
        txn.delete(dir_index_key(parent, entry.dir_index));
        let rkey = inode_ref_key(child_ino, parent, name);
        if remaining_refs.is_empty() {
            txn.delete(rkey);
        } else {
            txn.put(rkey, encode_inode_refs(&remaining_refs));
        }
        if c.item.nlink == 0 {
            txn.put(
                Key::new(ORPHAN_OBJECTID, ItemType::Orphan, child_ino),
                Vec::new(),
            );
        }
        Ok(())
    }

    /// rename with Linux flags (RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT); a
    /// whiteout is owned by root ([`Filesystem::rename_as`] names its owner).
    pub fn rename(
        &self,
        parent: u64,
        name: &[u8],
        newparent: u64,
        newname: &[u8],
        flags: u32,
    ) -> Result<()> {
        self.rename_as(Caller::default(), parent, name, newparent, newname, flags)
    }

    /// rename by `caller`, with Linux flags. With `RENAME_WHITEOUT` the source name is taken,
    /// in the same transaction, by a whiteout: a character device 0:0 with mode 0, owned by
    /// `caller` (the directory's group when it is setgid), as Linux's `vfs_whiteout` makes for
    /// overlayfs. `RENAME_EXCHANGE` with `RENAME_NOREPLACE` or `RENAME_WHITEOUT` is EINVAL.
    /// Permissions (creating in the source directory, Linux's `CAP_MKNOD` for a whiteout) are
    /// the kernel's to check, as for every call.
    pub fn rename_as(
        &self,
        caller: Caller,
        parent: u64,
        name: &[u8],
        newparent: u64,
        newname: &[u8],
        flags: u32,
    ) -> Result<()> {
        if flags & !(RENAME_NOREPLACE | RENAME_EXCHANGE | RENAME_WHITEOUT) != 0
            || (flags & (RENAME_NOREPLACE | RENAME_WHITEOUT) != 0 && flags & RENAME_EXCHANGE != 0)
        {
            return Err(Error::Invalid(format!("rename flags {flags:#x}")));
        }
        check_name_or_dots(name)?;
        check_name_or_dots(newname)?;
        self.admit(true)?;
        let _rename = self.inner.rename_lock.lock();
        let src_dir = self.dir_state(parent)?;
        let dst_dir = self.dir_state(newparent)?;
        if is_dot(name) {
            return Err(Error::Busy("rename of \".\" or \"..\"".into()));
        }
        if is_dot(newname) {
            // Linux: EEXIST with RENAME_NOREPLACE, EBUSY otherwise.
            return Err(if flags & RENAME_NOREPLACE != 0 {
                Error::Exists("rename onto \".\" or \"..\"".into())
            } else {
                Error::Busy("rename onto \".\" or \"..\"".into())
            });
        }
        if dst_dir.data.read().item.nlink == 0 {
            return Err(Error::NotFound(format!("dir {newparent} was removed")));
        }
        let src = self.find_entry(parent, name)?.ok_or_else(|| {
            Error::NotFound(format!(
                "{:?} in dir {parent}",
                String::from_utf8_lossy(name)
            ))
        })?;
        let dst = self.find_entry(newparent, newname)?;
        if flags & RENAME_EXCHANGE != 0 && dst.is_none() {
            return Err(Error::NotFound(format!(
                "{:?} in dir {newparent}",
                String::from_utf8_lossy(newname)
            )));
        }
        if flags & RENAME_NOREPLACE != 0 && dst.is_some() {
            return Err(Error::Exists(format!(
                "{:?} in dir {newparent}",
                String::from_utf8_lossy(newname)
            )));
        }
        if let Some(dst) = &dst {
            if dst.child == src.child {
                return Ok(()); // two names of one inode: POSIX says do nothing
            }
        }
        let src_state = self.inode(src.child)?;
        let dst_state = match &dst {
            Some(d) => Some(self.inode(d.child)?),
            None => None,
        };
        let src_is_dir = is_dir(&src_state.data.read().item);
        if let Some(d) = &dst {
            // The target is an ancestor of the source: Linux's lock_rename answers ENOTEMPTY.
            if d.file_type == libc::DT_DIR && self.is_ancestor(d.child, parent)? {
                let what = format!("dir {} is an ancestor of the source", d.child);
                return Err(if flags & RENAME_EXCHANGE != 0 {
                    Error::Invalid(what)
                } else {
                    Error::NotEmpty(what)
                });
            }
        }
        if src_is_dir && self.is_ancestor(src.child, newparent)? {
            return Err(Error::Invalid(format!(
                "rename of dir {} into its own subtree",
                src.child
            )));
        }
        if let (Some(ds), Some(dentry)) = (&dst_state, &dst) {
            let dst_is_dir = is_dir(&ds.data.read().item);
            if flags & RENAME_EXCHANGE == 0 {
                if src_is_dir && !dst_is_dir {
                    return Err(Error::NotDir(format!("inode {}", dentry.child)));
                }
                if !src_is_dir && dst_is_dir {
                    return Err(Error::IsDir(format!("inode {}", dentry.child)));
                }
                if dst_is_dir && ds.data.read().item.size > 0 {
                    return Err(Error::NotEmpty(format!("dir {}", dentry.child)));
                }
            } else if dst_is_dir && self.is_ancestor(dentry.child, parent)? {
                return Err(Error::Invalid(format!(
                    "exchange of dir {} into its own subtree",
                    dentry.child
                )));
            }
        }
        // Lock every inode involved in ascending order.
        let mut inos: Vec<(u64, Arc<InodeState>)> = vec![
            (parent, src_dir.clone()),
            (newparent, dst_dir.clone()),
            (src.child, src_state.clone()),
        ];
        if let (Some(ds), Some(dentry)) = (&dst_state, &dst) {
            inos.push((dentry.child, ds.clone()));
        }
        inos.sort_by_key(|(i, _)| *i);
        inos.dedup_by_key(|(i, _)| *i);
        let mut guards: Vec<(u64, RwLockWriteGuard<'_, InodeData>)> =
            inos.iter().map(|(i, s)| (*i, s.data.write())).collect();
        let t = now();
        let mut plan = RenamePlan::default();
        let mut whiteout = None;
        // Reads first: every list we change.
        let src_slot = self.read_dir_item(parent, name)?;
        let src_refs = self.read_refs(src.child, parent, name)?;
        if flags & RENAME_EXCHANGE != 0 {
            let dst = dst
                .as_ref()
                .ok_or_else(|| Error::NotFound("exchange target".into()))?;
            let dst_slot = self.read_dir_item(newparent, newname)?;
            let dst_refs = self.read_refs(dst.child, newparent, newname)?;
            let new_src_refs = self.read_refs(src.child, newparent, newname)?;
            let new_dst_refs = self.read_refs(dst.child, parent, name)?;
            self.plan_exchange(
                &mut plan,
                &mut guards,
                parent,
                name,
                newparent,
                newname,
                &src,
                dst,
                src_slot,
                dst_slot,
                src_refs,
                dst_refs,
                new_src_refs,
                new_dst_refs,
                t,
            )?;
        } else {
            let dst_slot = self.read_dir_item(newparent, newname)?;
            let new_refs = self.read_refs(src.child, newparent, newname)?;
            check_list_size(
                &encode_dir_entries(&with_probe_entry(&dst_slot.dir_item, newname)),
                "rename",
            )?;
            check_list_size(
                &encode_inode_refs(&with_probe_ref(&new_refs.refs, newparent, newname)),
                "rename",
            )?;
            let dst_refs = match &dst {
                Some(d) => Some(self.read_refs(d.child, newparent, newname)?),
                None => None,
            };
            self.plan_move(
                &mut plan,
                &mut guards,
                parent,
                name,
                newparent,
                newname,
                &src,
                dst.as_ref(),
                src_slot,
                dst_slot,
                src_refs,
                new_refs,
                dst_refs,
                t,
            )?;
            if flags & RENAME_WHITEOUT != 0 {
                whiteout =
                    Some(self.plan_whiteout(caller, &mut plan, &mut guards, parent, name, t)?);
            }
        }
        let txn = self.inner.engine.begin()?;
        if let Some((ino, mut item)) = whiteout {
            item.transid = txn.generation();
            txn.put(super::inode_key(ino), item.encode());
        }
        for (ino, g) in guards.iter_mut() {
            g.item.transid = txn.generation();
            txn.put(super::inode_key(*ino), g.item.encode());
            self.unmark_log_clean(*ino);
        }
        for (key, value) in plan.puts {
            match value {
                Some(v) => txn.put(key, v),
                None => txn.delete(key),
            }
        }
        Ok(())
    }

    fn is_ancestor(&self, ancestor: u64, mut dir: u64) -> Result<bool> {
        for _ in 0..4096 {
            if dir == ancestor {
                return Ok(true);
            }
            if dir == ROOT_OBJECTID {
                return Ok(false);
            }
            dir = self.parent_of(dir)?;
        }
        Err(Error::Loop("directory tree deeper than 4096 levels".into()))
    }

    #[allow(clippy::too_many_arguments)]
    fn plan_move(
        &self,
        plan: &mut RenamePlan,
        guards: &mut [(u64, RwLockWriteGuard<'_, InodeData>)],
        parent: u64,
        name: &[u8],
        newparent: u64,
        newname: &[u8],
        src: &DirEntry,
        dst: Option<&DirEntry>,
        src_slot: EntrySlot,
        dst_slot: EntrySlot,
        src_refs: RefSlot,
        new_refs: RefSlot,
        dst_refs: Option<RefSlot>,
        t: birch_format::items::Timespec,
    ) -> Result<()> {
        let src_is_dir = src.file_type == libc::DT_DIR;
        // Remove the source entry.
        let same_item =
            parent == newparent && dir_item_key(parent, name) == dir_item_key(newparent, newname);
        let mut src_list: Vec<DirEntry> = src_slot
            .dir_item
            .into_iter()
            .filter(|e| e.name != name)
            .collect();
        plan.puts.push((dir_index_key(parent, src.dir_index), None));
        let src_ref_list: Vec<InodeRef> = src_refs
            .refs
            .into_iter()
            .filter(|r| !(r.parent == parent && r.name == name))
            .collect();
        let same_ref =
            inode_ref_key(src.child, parent, name) == inode_ref_key(src.child, newparent, newname);
        // Replace a target.
        let mut dst_list = if same_item {
            std::mem::take(&mut src_list)
        } else {
            dst_slot.dir_item
        };
        if let (Some(dst), Some(dst_refs)) = (dst, dst_refs) {
            dst_list.retain(|e| e.name != newname);
            plan.puts
                .push((dir_index_key(newparent, dst.dir_index), None));
            let remaining: Vec<InodeRef> = dst_refs
                .refs
                .into_iter()
                .filter(|r| !(r.parent == newparent && r.name == newname))
                .collect();
            plan.set(
                inode_ref_key(dst.child, newparent, newname),
                if remaining.is_empty() {
                    None
                } else {
                    Some(encode_inode_refs(&remaining))
                },
            );
            let dst_is_dir = dst.file_type == libc::DT_DIR;
            let g = guard(guards, dst.child)?;
            if dst_is_dir {
                g.item.nlink = 0;
            } else {
                g.item.nlink = g.item.nlink.saturating_sub(1);
            }
            g.item.ctime = t;
            if g.item.nlink == 0 {
                plan.puts.push((
                    Key::new(ORPHAN_OBJECTID, ItemType::Orphan, dst.child),
                    Some(Vec::new()),
                ));
            }
            let np = guard(guards, newparent)?;
            np.item.size = np.item.size.saturating_sub(1);
            if dst_is_dir {
                np.item.nlink = np.item.nlink.saturating_sub(1);
            }
        }
        // Add the new entry.
        let index = {
            let np = guard(guards, newparent)?;
            let index = np.item.next_dir_index;
            np.item.next_dir_index += 1;
            np.item.size += 1;
            np.item.mtime = t;
            np.item.ctime = t;
            if src_is_dir && parent != newparent {
                np.item.nlink += 1;
            }
            index
        };
        {
            let p = guard(guards, parent)?;
            p.item.size = p.item.size.saturating_sub(1);
            p.item.mtime = t;
            p.item.ctime = t;
            if src_is_dir && parent != newparent {
                p.item.nlink = p.item.nlink.saturating_sub(1);
            }
        }
        let entry = DirEntry {
            child: src.child,
            dir_index: index,
            file_type: src.file_type,
            name: newname.to_vec(),
        };
        dst_list.push(entry.clone());
        if !same_item {
            plan.set(
                dir_item_key(parent, name),
                if src_list.is_empty() {
                    None
                } else {
                    Some(encode_dir_entries(&src_list))
                },
            );
        }
        plan.set(
            dir_item_key(newparent, newname),
            Some(encode_dir_entries(&dst_list)),
        );
        plan.puts.push((
            dir_index_key(newparent, index),
            Some(encode_dir_entries(std::slice::from_ref(&entry))),
        ));
        let mut new_ref_list = if same_ref {
            src_ref_list.clone()
        } else {
            new_refs.refs
        };
        new_ref_list.retain(|r| !(r.parent == newparent && r.name == newname));
        new_ref_list.push(InodeRef {
            parent: newparent,
            dir_index: index,
            name: newname.to_vec(),
        });
        if !same_ref {
            // The old ref key keeps any other names that hash alike.
            plan.set(
                inode_ref_key(src.child, parent, name),
                if src_ref_list.is_empty() {
                    None
                } else {
                    Some(encode_inode_refs(&src_ref_list))
                },
            );
        }
        plan.set(
            inode_ref_key(src.child, newparent, newname),
            Some(encode_inode_refs(&new_ref_list)),
        );
        guard(guards, src.child)?.item.ctime = t;
        Ok(())
    }

    /// Adds to a planned move the whiteout that takes the source name `name` in `parent`
    /// (RENAME_WHITEOUT): a new inode, a character device 0:0 with mode 0 and one link, whose
    /// number and item it returns for the rename's transaction to store.
    fn plan_whiteout(
        &self,
        caller: Caller,
        plan: &mut RenamePlan,
        guards: &mut [(u64, RwLockWriteGuard<'_, InodeData>)],
        parent: u64,
        name: &[u8],
        t: birch_format::items::Timespec,
    ) -> Result<(u64, InodeItem)> {
        let ino = self.inner.engine.allocate_objectid();
        let p = guard(guards, parent)?;
        let index = p.item.next_dir_index;
        p.item.next_dir_index += 1;
        p.item.size += 1;
        let gid = if p.item.mode & libc::S_ISGID != 0 {
            p.item.gid
        } else {
            caller.gid
        };
        let item = InodeItem {
            generation: super::new_generation(&self.inner.engine.fsid(), ino),
            transid: 0,
            size: 0,
            nbytes: 0,
            nlink: 1,
            uid: caller.uid,
            gid,
            mode: libc::S_IFCHR | WHITEOUT_MODE,
            rdev: WHITEOUT_DEV,
            flags: 0,
            next_dir_index: 2,
            atime: t,
            mtime: t,
            ctime: t,
            otime: t,
        };
        let entry = DirEntry {
            child: ino,
            dir_index: index,
            file_type: libc::DT_CHR,
            name: name.to_vec(),
        };
        // The move planned the source name's dir item without the source: the whiteout joins
        // what is left there (other names that hash alike, or the new name's entry when both
        // names share the item).
        let item_key = dir_item_key(parent, name);
        let mut list = match plan.get(&item_key) {
            Some(Some(bytes)) => decode_dir_entries(bytes)
                .map_err(|e| Error::corrupt(format!("planned dir item {item_key}"), e))?,
            Some(None) => Vec::new(),
            None => return Err(Error::bug("rename: whiteout without the source's dir item")),
        };
        list.push(entry.clone());
        check_list_size(&encode_dir_entries(&list), "rename whiteout")?;
        plan.set(item_key, Some(encode_dir_entries(&list)));
        plan.puts.push((
            dir_index_key(parent, index),
            Some(encode_dir_entries(std::slice::from_ref(&entry))),
        ));
        plan.puts.push((
            inode_ref_key(ino, parent, name),
            Some(encode_inode_refs(&[InodeRef {
                parent,
                dir_index: index,
                name: name.to_vec(),
            }])),
        ));
        Ok((ino, item))
    }

    #[allow(clippy::too_many_arguments)]
    fn plan_exchange(
        &self,
        plan: &mut RenamePlan,
        guards: &mut [(u64, RwLockWriteGuard<'_, InodeData>)],
        parent: u64,
        name: &[u8],
        newparent: u64,
        newname: &[u8],
        src: &DirEntry,
        dst: &DirEntry,
        src_slot: EntrySlot,
        dst_slot: EntrySlot,
        src_refs: RefSlot,
        dst_refs: RefSlot,
        new_src_refs: RefSlot,
        new_dst_refs: RefSlot,
        t: birch_format::items::Timespec,
    ) -> Result<()> {
        // Entries keep their names and indexes; only the child (and type) swap.
        let swap = |list: Vec<DirEntry>, n: &[u8], child: u64, ftype: u8| -> Vec<DirEntry> {
            list.into_iter()
                .map(|mut e| {
                    if e.name == n {
                        e.child = child;
                        e.file_type = ftype;
                    }
                    e
                })
                .collect()
        };
        let same_item = dir_item_key(parent, name) == dir_item_key(newparent, newname);
        let src_list = swap(src_slot.dir_item, name, dst.child, dst.file_type);
        let src_list = if same_item {
            swap(src_list, newname, src.child, src.file_type)
        } else {
            src_list
        };
        plan.set(
            dir_item_key(parent, name),
            Some(encode_dir_entries(&src_list)),
        );
        if !same_item {
            let dst_list = swap(dst_slot.dir_item, newname, src.child, src.file_type);
            plan.set(
                dir_item_key(newparent, newname),
                Some(encode_dir_entries(&dst_list)),
            );
        }
        plan.puts.push((
            dir_index_key(parent, src.dir_index),
            Some(encode_dir_entries(&[DirEntry {
                child: dst.child,
                dir_index: src.dir_index,
                file_type: dst.file_type,
                name: name.to_vec(),
            }])),
        ));
        plan.puts.push((
            dir_index_key(newparent, dst.dir_index),
            Some(encode_dir_entries(&[DirEntry {
                child: src.child,
                dir_index: dst.dir_index,
                file_type: src.file_type,
                name: newname.to_vec(),
            }])),
        ));
        // Refs: src now lives at (newparent, newname), dst at (parent, name).
        let move_ref = |plan: &mut RenamePlan,
                        ino: u64,
                        old_parent: u64,
                        old_name: &[u8],
                        old_refs: Vec<InodeRef>,
                        new_parent: u64,
                        new_name: &[u8],
                        new_refs: Vec<InodeRef>,
                        index: u64| {
            let old_key = inode_ref_key(ino, old_parent, old_name);
            let new_key = inode_ref_key(ino, new_parent, new_name);
            let kept: Vec<InodeRef> = old_refs
                .into_iter()
                .filter(|r| !(r.parent == old_parent && r.name == old_name))
                .collect();
            let mut added = if old_key == new_key {
                kept.clone()
            } else {
                new_refs
            };
            added.retain(|r| !(r.parent == new_parent && r.name == new_name));
            added.push(InodeRef {
                parent: new_parent,
                dir_index: index,
                name: new_name.to_vec(),
            });
            if old_key != new_key {
                plan.set(
                    old_key,
                    if kept.is_empty() {
                        None
                    } else {
                        Some(encode_inode_refs(&kept))
                    },
                );
            }
            plan.set(new_key, Some(encode_inode_refs(&added)));
        };
        move_ref(
            plan,
            src.child,
            parent,
            name,
            src_refs.refs,
            newparent,
            newname,
            new_src_refs.refs,
            dst.dir_index,
        );
        move_ref(
            plan,
            dst.child,
            newparent,
            newname,
            dst_refs.refs,
            parent,
            name,
            new_dst_refs.refs,
            src.dir_index,
        );
        let src_is_dir = src.file_type == libc::DT_DIR;
        let dst_is_dir = dst.file_type == libc::DT_DIR;
        if parent != newparent && src_is_dir != dst_is_dir {
            let (gain, lose) = if src_is_dir {
                (newparent, parent)
            } else {
                (parent, newparent)
            };
            guard(guards, gain)?.item.nlink += 1;
            let l = guard(guards, lose)?;
            l.item.nlink = l.item.nlink.saturating_sub(1);
        }
        for dir in [parent, newparent] {
            let g = guard(guards, dir)?;
            g.item.mtime = t;
            g.item.ctime = t;
        }
        guard(guards, src.child)?.item.ctime = t;
        guard(guards, dst.child)?.item.ctime = t;
        Ok(())
    }

    /// Up to `limit` entries of `dir` from cookie `offset` ("." is 0, ".." is 1, then the
    /// dir index order). Lists to the end of the directory as it is at each call.
    pub fn readdir(&self, dir: u64, offset: u64, limit: usize) -> Result<Vec<DirEntryOut>> {
        self.readdir_until(dir, offset, limit, None)
    }

    /// The end of `dir`'s listing as it is now, for [`Filesystem::readdir_until`]: the
    /// position the next name made in it (created, or renamed into it or within it) will take.
    pub fn readdir_end(&self, dir: u64) -> Result<u64> {
        let state = self.dir_state(dir)?;
        let end = state.data.read().item.next_dir_index;
        Ok(end)
    }

    /// [`Filesystem::readdir`] that stops at position `end` (from [`Filesystem::readdir_end`]
    /// when the listing started; `None`: no stop). A name made after that, which includes a
    /// name renamed away and back (each rename gives it a new position), is then not
    /// returned, so a reader that renames entries as it reads still comes to an end (xfstests
    /// generic/736; btrfs does the same). The FUSE adapter keeps one end per open directory.
    pub fn readdir_until(
        &self,
        dir: u64,
        offset: u64,
        limit: usize,
        end: Option<u64>,
    ) -> Result<Vec<DirEntryOut>> {
        let state = self.dir_state(dir)?;
        let _d = state.data.read();
        let mut out = Vec::new();
        if offset == 0 {
            out.push(DirEntryOut {
                ino: dir,
                next_offset: 1,
                kind: FileKind::Dir,
                name: b".".to_vec(),
            });
        }
        if offset <= 1 && out.len() < limit {
            out.push(DirEntryOut {
                ino: self.parent_of(dir)?,
                next_offset: 2,
                kind: FileKind::Dir,
                name: b"..".to_vec(),
            });
        }
        let lo_index = offset.max(2);
        let hi_index = end.unwrap_or(u64::MAX);
        if out.len() >= limit || lo_index >= hi_index {
            return Ok(out);
        }
        let lo = dir_index_key(dir, lo_index);
        let hi = Key::new(dir, ItemType::DirIndex, hi_index);
        for (key, bytes) in self.inner.engine.range(&lo, &hi, limit - out.len())? {
            let entries = decode_dir_entries(&bytes)
                .map_err(|e| Error::corrupt(format!("dir index {key}"), e))?;
            let Some(e) = entries.into_iter().next() else {
                continue;
            };
            out.push(DirEntryOut {
                ino: e.child,
                next_offset: key.offset + 1,
                kind: FileKind::from_dtype(e.file_type),
                name: e.name,
            });
        }
        Ok(out)
    }

    /// [`Filesystem::read`] without touching atime: for a `noatime` mount, where no read
    /// moves it (Linux: `MNT_NOATIME`, which the kernel cannot apply for a FUSE filesystem:
    /// its inodes are `S_NOATIME` and atime is the filesystem's).
    pub fn read_without_atime(&self, ino: u64, offset: u64, size: usize) -> Result<Vec<u8>> {
        let state = self.inode(ino)?;
        let data = state.data.read();
        if data.item.mode & libc::S_IFMT == libc::S_IFDIR {
            return Err(Error::IsDir(format!("read of dir {ino}")));
        }
        self.read_locked(ino, &data, offset, size)
    }

    /// Resolves an absolute path inside the filesystem to an inode (embedded use). Follows no
    /// symlinks.
    pub fn resolve(&self, path: &str) -> Result<u64> {
        let mut ino = ROOT_OBJECTID;
        for part in path.split('/').filter(|p| !p.is_empty()) {
            let entry = match part.as_bytes() {
                b"." => continue,
                b".." => {
                    ino = self.parent_of(ino)?;
                    continue;
                }
                name => self
                    .find_entry(ino, name)?
                    .ok_or_else(|| Error::NotFound(path.to_string()))?,
            };
            ino = entry.child;
        }
        Ok(ino)
    }
}

fn is_dot(name: &[u8]) -> bool {
    name == b"." || name == b".."
}

fn check_name_or_dots(name: &[u8]) -> Result<()> {
    if name == b"." || name == b".." {
        return Ok(());
    }
    check_name(name)
}

/// Locks a directory and a child in inode order; the child guard is `None` when it is the
/// directory itself.
fn lock_two<'a>(
    dir: &'a InodeState,
    dir_ino: u64,
    child: &'a InodeState,
    child_ino: u64,
) -> (
    RwLockWriteGuard<'a, InodeData>,
    Option<RwLockWriteGuard<'a, InodeData>>,
) {
    if dir_ino == child_ino {
        return (dir.data.write(), None);
    }
    if dir_ino < child_ino {
        let d = dir.data.write();
        let c = child.data.write();
        (d, Some(c))
    } else {
        let c = child.data.write();
        let d = dir.data.write();
        (d, Some(c))
    }
}

fn guard<'g, 'a>(
    guards: &'g mut [(u64, RwLockWriteGuard<'a, InodeData>)],
    ino: u64,
) -> Result<&'g mut InodeData> {
    guards
        .iter_mut()
        .find(|(i, _)| *i == ino)
        .map(|(_, g)| &mut **g)
        .ok_or_else(|| Error::bug(format!("rename: inode {ino} not locked")))
}

/// Item changes of a rename, applied under one write gate.
#[derive(Default)]
struct RenamePlan {
    puts: Vec<(Key, Option<Vec<u8>>)>,
}

impl RenamePlan {
    fn set(&mut self, key: Key, value: Option<Vec<u8>>) {
        self.puts.retain(|(k, _)| *k != key);
        self.puts.push((key, value));
    }

    /// The planned value of `key`: `None` when the plan leaves it alone.
    fn get(&self, key: &Key) -> Option<Option<&[u8]>> {
        self.puts
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_deref())
    }
}

/// Marks the xattrs a new inode lacks: all but the ACLs it inherits (put by
/// [`put_inherited_acls`]).
fn set_absent_xattrs(c: &mut InodeData, inherited: &super::acl::Inherited) {
    *c.xattrs_absent.get_mut() = super::xattr::ABSENT_CAPABILITY
        | if inherited.default.is_none() {
            super::xattr::ABSENT_ACL_DEFAULT
        } else {
            0
        }
        | if inherited.access.is_none() {
            super::xattr::ABSENT_ACL_ACCESS
        } else {
            0
        };
}

/// Stores the ACLs a new inode inherits from its directory.
fn put_inherited_acls(txn: &crate::txn::WriteTxn<'_>, ino: u64, inherited: super::acl::Inherited) {
    for (acl_name, acl) in [
        (super::acl::ACL_ACCESS, inherited.access),
        (super::acl::ACL_DEFAULT, inherited.default),
    ] {
        if let Some(acl) = acl {
            let xattrs = [birch_format::items::Xattr {
                name: acl_name.to_vec(),
                value: acl,
                spill: None,
            }];
            txn.put(
                super::xattr::xattr_key(ino, acl_name),
                birch_format::items::encode_xattrs(&xattrs),
            );
        }
    }
}
