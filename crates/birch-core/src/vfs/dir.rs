//! Namespace operations: lookup, create (and O_TMPFILE), link, unlink, rename (with whiteouts),
//! readdir.

#![deny(clippy::too_many_lines)]

use std::sync::atomic::Ordering;
use std::sync::Arc;

use birch_format::items::{DirEntry, InodeItem, Timespec};
use birch_format::{InodeNo, LINK_MAX, ROOT_OBJECTID};
use parking_lot::RwLockWriteGuard;

use super::{attr_of, check_name, now, Attr, Caller, FileKind, Filesystem, InodeData, InodeState};
use crate::error::{Error, Result};
use crate::items::{self, Changes, Link, LiveChanges};

/// One readdir entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntryOut {
    /// Inode number the entry names.
    pub ino: InodeNo,
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

fn is_dir(item: &InodeItem) -> bool {
    item.mode & libc::S_IFMT == libc::S_IFDIR
}

impl Filesystem {
    /// Finds `name` in `dir`.
    pub(crate) fn find_entry(&self, dir: u64, name: &[u8]) -> Result<Option<DirEntry>> {
        items::find_entry(&*self.inner.engine, InodeNo::new(dir), name)
    }

    /// A plan of item changes over the live state.
    fn changes(&self) -> LiveChanges<'_> {
        Changes::new(&*self.inner.engine)
    }

    fn dir_state(&self, dir: u64) -> Result<Arc<InodeState>> {
        let state = self.inode(dir)?;
        if !is_dir(&state.data.read().item) {
            return Err(Error::NotDir(format!("inode {dir}")));
        }
        Ok(state)
    }

    /// Looks up `name` in `parent`; counts a lookup.
    pub fn lookup(&self, parent: InodeNo, name: &[u8]) -> Result<Attr> {
        let parent = parent.get();
        check_name_or_dots(name)?;
        if let Some(node) = self.snap_node(parent) {
            return self.snap_lookup(node, name);
        }
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
            b".." => self.parent_of_raw(parent)?,
            _ => {
                let _d = dir.data.read();
                match self.find_entry(parent, name)? {
                    Some(entry) => entry.child,
                    // The hidden snapshot directory, when no real entry has its name (an
                    // image made before the name was reserved keeps its own).
                    None if self.is_snapshot_dir_name(parent, name) => {
                        drop(_d);
                        return self.getattr(birch_format::SNAPSHOT_DIR_INO);
                    }
                    None => {
                        return Err(Error::NotFound(format!(
                            "{:?} in dir {parent}",
                            String::from_utf8_lossy(name)
                        )))
                    }
                }
            }
        };
        let state = self.inode(ino)?;
        self.remember(&state);
        let data = state.data.read();
        Ok(attr_of(ino, &data.item))
    }

    /// LOOKUP's answer for an entry that a listing of `parent` ([`Filesystem::readdir_until`])
    /// just returned as `ino` under `name`, without searching for the name again: for
    /// READDIRPLUS, which the kernel serves with `parent` locked, so no rename, unlink or
    /// create in it can come between the listing and this. Counts a lookup as
    /// [`Filesystem::lookup`] does, and falls back to it for ".", "..", snapshots, the
    /// snapshot directory and an inode that has lost its last name.
    pub fn lookup_listed(&self, parent: InodeNo, name: &[u8], ino: InodeNo) -> Result<Attr> {
        let parent = parent.get();
        let ino = ino.get();
        if name == b"."
            || name == b".."
            || ino == birch_format::SNAPSHOT_DIR_OBJECTID
            || self.snap_node(parent).is_some()
        {
            return self.lookup(InodeNo::new(parent), name);
        }
        let state = self.inode(ino)?;
        let data = state.data.read();
        if data.item.nlink == 0 {
            drop(data);
            return self.lookup(InodeNo::new(parent), name);
        }
        self.remember(&state);
        Ok(attr_of(ino, &data.item))
    }

    /// The parent of a directory (its one inode ref), or itself for the root.
    pub fn parent_of(&self, dir: InodeNo) -> Result<InodeNo> {
        self.parent_of_raw(dir.get()).map(InodeNo::new)
    }

    /// [`Filesystem::parent_of`] of the bare number `dir`.
    fn parent_of_raw(&self, dir: u64) -> Result<u64> {
        if let Some(node) = self.snap_node(dir) {
            return self.snap_parent_of(node);
        }
        if dir == ROOT_OBJECTID {
            return Ok(ROOT_OBJECTID);
        }
        items::first_parent(&*self.inner.engine, InodeNo::new(dir))?
            .map(InodeNo::get)
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
        self.refuse_snapshot_change("create", &[parent])?;
        self.refuse_reserved_name(parent, name)?;
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
        let mut changes = self.changes();
        if items::find_entry(&changes, InodeNo::new(parent), name)?.is_some() {
            return Err(Error::Exists(format!(
                "{:?} in dir {parent}",
                String::from_utf8_lossy(name)
            )));
        }
        items::check_dir_room(&changes, InodeNo::new(parent), name, "create")?;
        let nlink = if kind == FileKind::Dir { 2 } else { 1 };
        let (ino, mut item, inherited) =
            self.new_inode_item(caller, parent, &d, mode, nlink, symlink.is_some())?;
        item.rdev = rdev;
        let index = d.item.next_dir_index;
        let link = Link {
            parent: InodeNo::new(parent),
            name,
            child: InodeNo::new(ino),
            file_type: kind.dtype(),
            dir_index: index,
        };
        // Read above: this plans without reading again.
        items::add_first_link(&mut changes, &link, "create")?;
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
        d.item.next_dir_index += 1;
        d.item.size += 1;
        if kind == FileKind::Dir {
            d.item.nlink += 1;
        }
        d.item.mtime = t;
        d.item.ctime = t;
        {
            let mut txn = self.inner.engine.begin()?;
            c.item.transid = txn.generation().get();
            d.item.transid = txn.generation().get();
            items::put_inode(&mut txn, InodeNo::new(ino), &c.item);
            items::put_inode(&mut txn, InodeNo::new(parent), &d.item);
            put_inherited_acls(&mut txn, ino, inherited);
            changes.record(&txn);
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
            self.inner.engine.allocate_objectid_alone()?
        } else {
            self.inner.engine.allocate_objectid()?
        }
        .get();
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
        parent: InodeNo,
        mode: u32,
        flags: i32,
    ) -> Result<(Attr, u64)> {
        let parent = parent.get();
        self.refuse_snapshot_change("tmpfile", &[parent])?;
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
        self.note_unlinked(ino, &c.item);
        set_absent_xattrs(&mut c, &inherited);
        c.linkable = flags & libc::O_EXCL == 0;
        {
            let _op = self.inner.engine.hold()?;
            let mut txn = self.inner.engine.begin()?;
            c.item.transid = txn.generation().get();
            items::put_inode(&mut txn, InodeNo::new(ino), &c.item);
            items::put_orphan(&mut txn, InodeNo::new(ino));
            put_inherited_acls(&mut txn, ino, inherited);
        }
        self.remember(&state);
        let attr = attr_of(ino, &c.item);
        drop(c);
        let fh = self.open_file(InodeNo::new(ino), flags & !libc::O_TMPFILE)?;
        self.maybe_commit();
        Ok((attr, fh))
    }

    /// mknod: regular files, fifos, sockets, device nodes.
    pub fn mknod(
        &self,
        caller: Caller,
        parent: InodeNo,
        name: &[u8],
        mode: u32,
        rdev: u64,
    ) -> Result<Attr> {
        let parent = parent.get();
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
    pub fn mkdir(&self, caller: Caller, parent: InodeNo, name: &[u8], mode: u32) -> Result<Attr> {
        let parent = parent.get();
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
    pub fn symlink(
        &self,
        caller: Caller,
        parent: InodeNo,
        name: &[u8],
        target: &[u8],
    ) -> Result<Attr> {
        let parent = parent.get();
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
    pub fn readlink(&self, ino: InodeNo) -> Result<Vec<u8>> {
        let ino = ino.get();
        if let Some(node) = self.snap_node(ino) {
            return self.snap_readlink(node);
        }
        let state = self.inode(ino)?;
        let data = state.data.read();
        if data.item.mode & libc::S_IFMT != libc::S_IFLNK {
            return Err(Error::Invalid(format!("readlink of non-symlink {ino}")));
        }
        self.read_locked(ino, &data, 0, data.item.size as usize)
    }

    /// link: a new name for `ino`.
    pub fn link(&self, ino: InodeNo, newparent: InodeNo, newname: &[u8]) -> Result<Attr> {
        let ino = ino.get();
        let newparent = newparent.get();
        check_name_or_dots(newname)?;
        self.refuse_snapshot_change("link", &[ino, newparent])?;
        self.refuse_reserved_name(newparent, newname)?;
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
        let index = d.item.next_dir_index;
        let mut changes = self.changes();
        items::add_link(
            &mut changes,
            &Link {
                parent: InodeNo::new(newparent),
                name: newname,
                child: InodeNo::new(ino),
                file_type: FileKind::from_mode(c.item.mode).dtype(),
                dir_index: index,
            },
            "link",
        )?;
        let t = now();
        d.item.next_dir_index += 1;
        d.item.size += 1;
        d.item.mtime = t;
        d.item.ctime = t;
        c.item.nlink += 1;
        c.item.ctime = t;
        {
            let mut txn = self.inner.engine.begin()?;
            c.item.transid = txn.generation().get();
            d.item.transid = txn.generation().get();
            items::put_inode(&mut txn, InodeNo::new(ino), &c.item);
            items::put_inode(&mut txn, InodeNo::new(newparent), &d.item);
            self.unmark_log_clean(ino);
            if c.item.nlink == 1 {
                // A tmpfile getting its first name leaves the orphan list, and may not be
                // linked again once its names are gone.
                items::delete_orphan(&mut txn, InodeNo::new(ino));
                c.linkable = false;
                self.drop_unlinked(ino);
            }
            changes.record(&txn);
        }
        target.lookups.fetch_add(1, Ordering::SeqCst);
        Ok(attr_of(ino, &c.item))
    }

    /// unlink a non-directory.
    pub fn unlink(&self, parent: InodeNo, name: &[u8]) -> Result<()> {
        let parent = parent.get();
        self.refuse_snapshot_change("unlink", &[parent])?;
        self.refuse_snapshot_dir_change("unlink", parent, name)?;
        self.admit(false)?;
        self.remove_entry(parent, name, false)
    }

    /// rmdir an empty directory.
    pub fn rmdir(&self, parent: InodeNo, name: &[u8]) -> Result<()> {
        let parent = parent.get();
        check_name_or_dots(name)?;
        self.refuse_snapshot_change("rmdir", &[parent])?;
        self.refuse_snapshot_dir_change("rmdir", parent, name)?;
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
        let mut changes = self.changes();
        let Some(entry) = items::find_entry(&changes, InodeNo::new(parent), name)? else {
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
        items::remove_link(&mut changes, InodeNo::new(parent), &entry)?;
        self.unlink_locked(parent, &mut d, child_ino, c, changes, now())?;
        drop(d);
        Ok(())
    }

    /// Records `changes` (the removal of a name of `child_ino` from the locked dir, planned by
    /// [`items::remove_link`]) and drops the child's link; puts an orphan item when the child
    /// has no names left.
    fn unlink_locked(
        &self,
        parent: u64,
        d: &mut InodeData,
        child_ino: u64,
        c: &mut InodeData,
        changes: LiveChanges<'_>,
        t: Timespec,
    ) -> Result<()> {
        let child_is_dir = is_dir(&c.item);
        d.item.size = d.item.size.saturating_sub(1);
        d.item.mtime = t;
        d.item.ctime = t;
        if child_is_dir {
            d.item.nlink = d.item.nlink.saturating_sub(1);
            c.item.nlink = 0;
        } else {
            c.item.nlink = c.item.nlink.saturating_sub(1);
        }
        self.note_unlinked(child_ino, &c.item);
        c.item.ctime = t;
        let mut txn = self.inner.engine.begin()?;
        d.item.transid = txn.generation().get();
        c.item.transid = txn.generation().get();
        items::put_inode(&mut txn, InodeNo::new(parent), &d.item);
        items::put_inode(&mut txn, InodeNo::new(child_ino), &c.item);
        self.unmark_log_clean(child_ino);
        if c.item.nlink == 0 {
            items::put_orphan(&mut txn, InodeNo::new(child_ino));
        }
        changes.record(&txn);
        Ok(())
    }

    /// rename with Linux flags (RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT); a
    /// whiteout is owned by root ([`Filesystem::rename_as`] names its owner).
    pub fn rename(
        &self,
        parent: InodeNo,
        name: &[u8],
        newparent: InodeNo,
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
        parent: InodeNo,
        name: &[u8],
        newparent: InodeNo,
        newname: &[u8],
        flags: u32,
    ) -> Result<()> {
        let parent = parent.get();
        let newparent = newparent.get();
        check_rename_flags(flags)?;
        check_name_or_dots(name)?;
        check_name_or_dots(newname)?;
        self.refuse_snapshot_change("rename", &[parent, newparent])?;
        self.refuse_snapshot_dir_change("rename", parent, name)?;
        self.refuse_reserved_name(newparent, newname)?;
        self.admit(true)?;
        let _rename = self.inner.rename_lock.lock();
        let src_dir = self.dir_state(parent)?;
        let dst_dir = self.dir_state(newparent)?;
        refuse_dot_rename(name, newname, flags)?;
        if dst_dir.data.read().item.nlink == 0 {
            return Err(Error::NotFound(format!("dir {newparent} was removed")));
        }
        let Some(ends) = self.rename_ends(parent, name, newparent, newname, flags)? else {
            return Ok(()); // two names of one inode: POSIX says do nothing
        };
        self.refuse_rename_loop(parent, newparent, &ends, flags)?;
        if flags & RENAME_EXCHANGE == 0 {
            refuse_replace_mismatch(&ends)?;
        }
        // Lock every inode involved in ascending order.
        let inos = rename_lock_order((parent, &src_dir), (newparent, &dst_dir), &ends);
        let mut guards: Vec<(u64, RwLockWriteGuard<'_, InodeData>)> =
            inos.iter().map(|(i, s)| (*i, s.data.write())).collect();
        let t = now();
        let mut plan = self.changes();
        let dst = ends.dst.as_ref().map(|(d, _)| d);
        let rename = Rename {
            parent,
            name,
            newparent,
            newname,
            src: ends.src,
            t,
        };
        // Every item is planned before any locked inode changes; then all of them, the
        // inodes' items too, are recorded in one transaction.
        let whiteout = self.plan_rename(caller, &rename, dst, flags, &mut plan, &mut guards)?;
        self.record_rename(whiteout, &mut guards, plan)
    }

    /// A rename's source and target: the source entry and inode, and the target entry and
    /// inode when the new name exists. None when both names name one inode (POSIX: the rename
    /// does nothing). Errors for a missing source, a missing target of `RENAME_EXCHANGE`, an
    /// existing one of `RENAME_NOREPLACE`.
    fn rename_ends(
        &self,
        parent: u64,
        name: &[u8],
        newparent: u64,
        newname: &[u8],
        flags: u32,
    ) -> Result<Option<RenameEnds>> {
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
                return Ok(None);
            }
        }
        let src_state = self.inode(src.child)?;
        let dst = match dst {
            Some(d) => {
                let state = self.inode(d.child)?;
                Some((d, state))
            }
            None => None,
        };
        Ok(Some(RenameEnds {
            src,
            src_state,
            dst,
        }))
    }

    /// Refuses a rename that would make a directory its own ancestor: a target that is an
    /// ancestor of the source, a directory moved into its own subtree, or (exchanged) a target
    /// directory moved into its own subtree.
    fn refuse_rename_loop(
        &self,
        parent: u64,
        newparent: u64,
        ends: &RenameEnds,
        flags: u32,
    ) -> Result<()> {
        let src = &ends.src;
        let src_is_dir = is_dir(&ends.src_state.data.read().item);
        if let Some((d, _)) = &ends.dst {
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
        match &ends.dst {
            Some((dentry, ds)) if flags & RENAME_EXCHANGE != 0 => {
                let dst_is_dir = is_dir(&ds.data.read().item);
                if dst_is_dir && self.is_ancestor(dentry.child, parent)? {
                    return Err(Error::Invalid(format!(
                        "exchange of dir {} into its own subtree",
                        dentry.child
                    )));
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Plans a rename's items over the locked inodes (`plan_exchange`, or `plan_move` and
    /// with `RENAME_WHITEOUT` `plan_whiteout`); returns the whiteout's number and item.
    fn plan_rename(
        &self,
        caller: Caller,
        rename: &Rename<'_>,
        dst: Option<&DirEntry>,
        flags: u32,
        plan: &mut LiveChanges<'_>,
        guards: &mut [(u64, RwLockWriteGuard<'_, InodeData>)],
    ) -> Result<Option<(u64, InodeItem)>> {
        if flags & RENAME_EXCHANGE != 0 {
            let dst = dst.ok_or_else(|| Error::NotFound("exchange target".into()))?;
            plan_exchange(rename, dst, plan, guards)?;
            return Ok(None);
        }
        // The new name must fit before anything is planned.
        items::check_dir_room(
            plan,
            InodeNo::new(rename.newparent),
            rename.newname,
            "rename",
        )?;
        items::check_ref_room(
            plan,
            InodeNo::new(rename.src.child),
            InodeNo::new(rename.newparent),
            rename.newname,
            "rename",
        )?;
        plan_move(rename, dst, plan, guards)?;
        if flags & RENAME_WHITEOUT != 0 {
            return Ok(Some(self.plan_whiteout(caller, rename, plan, guards)?));
        }
        Ok(None)
    }

    /// Records a planned rename in one transaction: the whiteout's inode item, every locked
    /// inode's item, and the planned items.
    fn record_rename(
        &self,
        whiteout: Option<(u64, InodeItem)>,
        guards: &mut [(u64, RwLockWriteGuard<'_, InodeData>)],
        plan: LiveChanges<'_>,
    ) -> Result<()> {
        let mut txn = self.inner.engine.begin()?;
        if let Some((ino, mut item)) = whiteout {
            item.transid = txn.generation().get();
            items::put_inode(&mut txn, InodeNo::new(ino), &item);
        }
        for (ino, g) in guards.iter_mut() {
            g.item.transid = txn.generation().get();
            items::put_inode(&mut txn, InodeNo::new(*ino), &g.item);
            self.unmark_log_clean(*ino);
            // The replaced target, when it lost its last name.
            self.note_unlinked(*ino, &g.item);
        }
        plan.record(&txn);
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
            dir = self.parent_of_raw(dir)?;
        }
        Err(Error::Loop("directory tree deeper than 4096 levels".into()))
    }

    /// Adds to a planned move the whiteout that takes the source name (RENAME_WHITEOUT): a
    /// new inode, a character device 0:0 with mode 0 and one link, whose number and item it
    /// returns for the rename's transaction to store.
    fn plan_whiteout(
        &self,
        caller: Caller,
        rename: &Rename<'_>,
        plan: &mut LiveChanges<'_>,
        guards: &mut [(u64, RwLockWriteGuard<'_, InodeData>)],
    ) -> Result<(u64, InodeItem)> {
        let (parent, t) = (rename.parent, rename.t);
        let ino = self.inner.engine.allocate_objectid()?.get();
        let p = guard(guards, parent)?;
        let index = p.item.next_dir_index;
        // The move planned the source name's dir item without the source: the whiteout joins
        // what is left there (other names that hash alike, or the new name's entry when both
        // names share the item).
        items::add_first_link(
            plan,
            &Link {
                parent: InodeNo::new(parent),
                name: rename.name,
                child: InodeNo::new(ino),
                file_type: libc::DT_CHR,
                dir_index: index,
            },
            "rename whiteout",
        )?;
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
        Ok((ino, item))
    }

    /// Up to `limit` entries of `dir` from cookie `offset` ("." is 0, ".." is 1, then the
    /// dir index order). Lists to the end of the directory as it is at each call.
    pub fn readdir(&self, dir: InodeNo, offset: u64, limit: usize) -> Result<Vec<DirEntryOut>> {
        self.readdir_until(dir, offset, limit, None)
    }

    /// The end of `dir`'s listing as it is now, for [`Filesystem::readdir_until`]: the
    /// position the next name made in it (created, or renamed into it or within it) will take.
    pub fn readdir_end(&self, dir: InodeNo) -> Result<u64> {
        let dir = dir.get();
        if let Some(node) = self.snap_node(dir) {
            return self.snap_readdir_end(node);
        }
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
        dir: InodeNo,
        offset: u64,
        limit: usize,
        end: Option<u64>,
    ) -> Result<Vec<DirEntryOut>> {
        let dir = dir.get();
        if let Some(node) = self.snap_node(dir) {
            return self.snap_readdir(node, offset, limit, end);
        }
        let state = self.dir_state(dir)?;
        let _d = state.data.read();
        let mut out = Vec::new();
        if offset == 0 {
            out.push(DirEntryOut {
                ino: InodeNo::new(dir),
                next_offset: 1,
                kind: FileKind::Dir,
                name: b".".to_vec(),
            });
        }
        if offset <= 1 && out.len() < limit {
            out.push(DirEntryOut {
                ino: self.parent_of(InodeNo::new(dir))?,
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
        let listed = items::listing(
            &*self.inner.engine,
            InodeNo::new(dir),
            lo_index,
            hi_index,
            limit - out.len(),
        )?;
        for (index, e) in listed {
            out.push(DirEntryOut {
                ino: InodeNo::new(e.child),
                next_offset: index + 1,
                kind: FileKind::from_dtype(e.file_type),
                name: e.name,
            });
        }
        Ok(out)
    }

    /// [`Filesystem::read`] without touching atime: for a `noatime` mount, where no read
    /// moves it (Linux: `MNT_NOATIME`, which the kernel cannot apply for a FUSE filesystem:
    /// its inodes are `S_NOATIME` and atime is the filesystem's).
    pub fn read_without_atime(&self, ino: InodeNo, offset: u64, size: usize) -> Result<Vec<u8>> {
        let ino = ino.get();
        if let Some(node) = self.snap_node(ino) {
            return self.snap_read(node, offset, size);
        }
        let state = self.inode(ino)?;
        let data = state.data.read();
        if data.item.mode & libc::S_IFMT == libc::S_IFDIR {
            return Err(Error::IsDir(format!("read of dir {ino}")));
        }
        self.read_locked(ino, &data, offset, size)
            .inspect_err(|e| self.inner.error_files.note_read(ino, offset, e))
    }

    /// Resolves an absolute path inside the filesystem to an inode (embedded use). Follows no
    /// symlinks.
    pub fn resolve(&self, path: &str) -> Result<InodeNo> {
        self.resolve_raw(path).map(InodeNo::new)
    }

    /// [`Filesystem::resolve`], as the bare number.
    fn resolve_raw(&self, path: &str) -> Result<u64> {
        let mut ino = ROOT_OBJECTID;
        for part in path.split('/').filter(|p| !p.is_empty()) {
            if let Some(node) = self.snap_node(ino) {
                ino = self.snap_lookup(node, part.as_bytes())?.ino.get();
                continue;
            }
            let entry = match part.as_bytes() {
                b"." => continue,
                b".." => {
                    ino = self.parent_of_raw(ino)?;
                    continue;
                }
                name => match self.find_entry(ino, name)? {
                    Some(entry) => entry,
                    None if self.is_snapshot_dir_name(ino, name) => {
                        ino = birch_format::SNAPSHOT_DIR_OBJECTID;
                        continue;
                    }
                    None => return Err(Error::NotFound(path.to_string())),
                },
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

/// Refuses rename flags Linux refuses: unknown ones, and `RENAME_EXCHANGE` with
/// `RENAME_NOREPLACE` or `RENAME_WHITEOUT`.
fn check_rename_flags(flags: u32) -> Result<()> {
    if flags & !(RENAME_NOREPLACE | RENAME_EXCHANGE | RENAME_WHITEOUT) != 0
        || (flags & (RENAME_NOREPLACE | RENAME_WHITEOUT) != 0 && flags & RENAME_EXCHANGE != 0)
    {
        return Err(Error::Invalid(format!("rename flags {flags:#x}")));
    }
    Ok(())
}

/// Refuses a rename of or onto "." or "..".
fn refuse_dot_rename(name: &[u8], newname: &[u8], flags: u32) -> Result<()> {
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
    Ok(())
}

/// Refuses a rename (not an exchange) that would replace a target of the other type, or a
/// directory that is not empty.
fn refuse_replace_mismatch(ends: &RenameEnds) -> Result<()> {
    let Some((dentry, ds)) = &ends.dst else {
        return Ok(());
    };
    let src_is_dir = is_dir(&ends.src_state.data.read().item);
    let dst_is_dir = is_dir(&ds.data.read().item);
    if src_is_dir && !dst_is_dir {
        return Err(Error::NotDir(format!("inode {}", dentry.child)));
    }
    if !src_is_dir && dst_is_dir {
        return Err(Error::IsDir(format!("inode {}", dentry.child)));
    }
    if dst_is_dir && ds.data.read().item.size > 0 {
        return Err(Error::NotEmpty(format!("dir {}", dentry.child)));
    }
    Ok(())
}

/// Every inode a rename changes, each once, in ascending order: the order their locks are
/// taken in.
fn rename_lock_order(
    src_dir: (u64, &Arc<InodeState>),
    dst_dir: (u64, &Arc<InodeState>),
    ends: &RenameEnds,
) -> Vec<(u64, Arc<InodeState>)> {
    let mut inos: Vec<(u64, Arc<InodeState>)> = vec![
        (src_dir.0, src_dir.1.clone()),
        (dst_dir.0, dst_dir.1.clone()),
        (ends.src.child, ends.src_state.clone()),
    ];
    if let Some((dentry, ds)) = &ends.dst {
        inos.push((dentry.child, ds.clone()));
    }
    inos.sort_by_key(|(i, _)| *i);
    inos.dedup_by_key(|(i, _)| *i);
    inos
}

/// A rename's two ends, found before any inode lock ([`Filesystem::rename_ends`]): the source
/// entry and its inode, and the target entry and its inode when the new name exists.
struct RenameEnds {
    src: DirEntry,
    src_state: Arc<InodeState>,
    dst: Option<(DirEntry, Arc<InodeState>)>,
}

/// What a rename moves: the source name, the target name, the source's entry, and the time
/// it stamps.
struct Rename<'n> {
    parent: u64,
    name: &'n [u8],
    newparent: u64,
    newname: &'n [u8],
    src: DirEntry,
    t: Timespec,
}

/// Plans a move of `rename.src` to the new name, replacing `dst` (the entry there, if any),
/// and updates the locked inodes' counts and times. Every item is planned before any
/// inode in `guards` changes.
fn plan_move(
    rename: &Rename<'_>,
    dst: Option<&DirEntry>,
    plan: &mut LiveChanges<'_>,
    guards: &mut [(u64, RwLockWriteGuard<'_, InodeData>)],
) -> Result<()> {
    let Rename {
        parent,
        newparent,
        newname,
        t,
        ..
    } = *rename;
    let src = &rename.src;
    let src_is_dir = src.file_type == libc::DT_DIR;
    // Remove the source name and any target: other names under their hashes stay.
    items::remove_link(plan, InodeNo::new(parent), src)?;
    if let Some(dst) = dst {
        items::remove_link(plan, InodeNo::new(newparent), dst)?;
    }
    let index = guard(guards, newparent)?.item.next_dir_index;
    items::add_link(
        plan,
        &Link {
            parent: InodeNo::new(newparent),
            name: newname,
            child: InodeNo::new(src.child),
            file_type: src.file_type,
            dir_index: index,
        },
        "rename",
    )?;
    if let Some(dst) = dst {
        let dst_is_dir = dst.file_type == libc::DT_DIR;
        let g = guard(guards, dst.child)?;
        if dst_is_dir {
            g.item.nlink = 0;
        } else {
            g.item.nlink = g.item.nlink.saturating_sub(1);
        }
        g.item.ctime = t;
        if g.item.nlink == 0 {
            items::put_orphan(plan, InodeNo::new(dst.child));
        }
        let np = guard(guards, newparent)?;
        np.item.size = np.item.size.saturating_sub(1);
        if dst_is_dir {
            np.item.nlink = np.item.nlink.saturating_sub(1);
        }
    }
    {
        let np = guard(guards, newparent)?;
        np.item.next_dir_index += 1;
        np.item.size += 1;
        np.item.mtime = t;
        np.item.ctime = t;
        if src_is_dir && parent != newparent {
            np.item.nlink += 1;
        }
    }
    {
        let p = guard(guards, parent)?;
        p.item.size = p.item.size.saturating_sub(1);
        p.item.mtime = t;
        p.item.ctime = t;
        if src_is_dir && parent != newparent {
            p.item.nlink = p.item.nlink.saturating_sub(1);
        }
    }
    guard(guards, src.child)?.item.ctime = t;
    Ok(())
}

/// Plans a RENAME_EXCHANGE of `rename.src` and `dst`: the entries keep their names and
/// positions and swap the inodes they name; each inode's ref moves to its new name. Updates
/// the locked inodes' counts and times once every item is planned.
fn plan_exchange(
    rename: &Rename<'_>,
    dst: &DirEntry,
    plan: &mut LiveChanges<'_>,
    guards: &mut [(u64, RwLockWriteGuard<'_, InodeData>)],
) -> Result<()> {
    let Rename {
        parent,
        name,
        newparent,
        newname,
        t,
        ..
    } = *rename;
    let src = &rename.src;
    // The source's name now names dst, at the source's position; and the other way round.
    let at_src = Link {
        parent: InodeNo::new(parent),
        name,
        child: InodeNo::new(dst.child),
        file_type: dst.file_type,
        dir_index: src.dir_index,
    };
    let at_dst = Link {
        parent: InodeNo::new(newparent),
        name: newname,
        child: InodeNo::new(src.child),
        file_type: src.file_type,
        dir_index: dst.dir_index,
    };
    items::retarget_link(plan, &at_src)?;
    items::retarget_link(plan, &at_dst)?;
    items::move_ref(plan, InodeNo::new(parent), name, &at_dst, "rename")?;
    items::move_ref(plan, InodeNo::new(newparent), newname, &at_src, "rename")?;
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
fn put_inherited_acls(w: &mut impl items::ItemWrite, ino: u64, inherited: super::acl::Inherited) {
    for (acl_name, acl) in [
        (super::acl::ACL_ACCESS, inherited.access),
        (super::acl::ACL_DEFAULT, inherited.default),
    ] {
        if let Some(acl) = acl {
            // An ACL is at most XATTR_VALUE_MAX bytes (setxattr refuses more): inline.
            items::put_new_xattr(w, InodeNo::new(ino), acl_name, acl);
        }
    }
}
