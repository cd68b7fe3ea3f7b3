//! Extended attributes: `(ino, Xattr, hash(name))` items holding lists of name/value pairs;
//! a value over `XATTR_VALUE_MAX` bytes is stored out of line in `(ino, XattrChunk, hash(name,
//! index))` items (FORMAT.md §6.5, §6.8), behind the incompat flag `INCOMPAT_XATTR_CHUNKS`.
//! Those items are read and planned by [`crate::items`]; this file keeps the POSIX rules:
//! the create/replace flags, the size limits, what an access ACL does to the mode, and the
//! in-memory absence bits.

use std::sync::atomic::Ordering;

use birch_format::superblock::INCOMPAT_XATTR_CHUNKS;
use birch_format::{InodeNo, XATTR_SIZE_MAX, XATTR_VALUE_MAX};

use super::{now, Filesystem, InodeData};
use crate::error::{Error, Result};
use crate::items::{self, Changes, XattrStored};

/// The key of an inode's xattr list under a name's hash (the chmod path writes the access
/// ACL's).
pub(crate) use crate::items::xattr_key;

/// setxattr flags.
pub const XATTR_CREATE: i32 = 1;
pub const XATTR_REPLACE: i32 = 2;

/// [`InodeData::xattrs_absent`] bit: no `system.posix_acl_default` (asked by every create in
/// the directory).
pub(crate) const ABSENT_ACL_DEFAULT: u8 = 1;
/// No `system.posix_acl_access` (asked by chmod).
pub(crate) const ABSENT_ACL_ACCESS: u8 = 2;
/// No `security.capability` (asked by every write of a caller without CAP_FSETID).
pub(crate) const ABSENT_CAPABILITY: u8 = 4;

const CAPABILITY: &[u8] = b"security.capability";

/// The absent-bit that stands for `name`, if it has one.
fn absent_bit(name: &[u8]) -> Option<u8> {
    match name {
        super::acl::ACL_DEFAULT => Some(ABSENT_ACL_DEFAULT),
        super::acl::ACL_ACCESS => Some(ABSENT_ACL_ACCESS),
        CAPABILITY => Some(ABSENT_CAPABILITY),
        _ => None,
    }
}

fn check_xattr_name(name: &[u8]) -> Result<()> {
    if name.is_empty() {
        return Err(Error::Range("empty xattr name".into()));
    }
    if name.len() > birch_format::NAME_MAX {
        return Err(Error::Range(format!("xattr name of {} bytes", name.len())));
    }
    Ok(())
}

impl Filesystem {
    /// The value of an xattr, if set. The caller holds the inode's lock (read or write) and
    /// passes its data: an absence is remembered there ([`InodeData::xattrs_absent`]).
    pub(crate) fn xattr_value(
        &self,
        ino: u64,
        data: &InodeData,
        name: &[u8],
    ) -> Result<Option<Vec<u8>>> {
        let bit = absent_bit(name);
        if let Some(bit) = bit {
            if data.xattrs_absent.load(Ordering::Relaxed) & bit != 0 {
                return Ok(None);
            }
        }
        let value = items::get_xattr(&*self.inner.engine, InodeNo::new(ino), name)?;
        if let (None, Some(bit)) = (&value, bit) {
            data.xattrs_absent.fetch_or(bit, Ordering::Relaxed);
        }
        Ok(value)
    }

    /// Sets an xattr (XATTR_CREATE: must not exist; XATTR_REPLACE: must exist). Setting the
    /// access ACL also sets the mode, as [`Filesystem::setxattr_by`] does for a caller with
    /// CAP_FSETID.
    pub fn setxattr(&self, ino: InodeNo, name: &[u8], value: &[u8], flags: i32) -> Result<()> {
        self.setxattr_by(ino, name, value, flags, None)
    }

    /// [`Filesystem::setxattr`] by a caller whose groups (primary first) are `caller_groups`,
    /// `None` for a caller with CAP_FSETID. Setting the access ACL
    /// (`system.posix_acl_access`) does what Linux's `posix_acl_update_mode` does, which the
    /// kernel leaves to a FUSE filesystem: the mode's permission bits follow the ACL (owner,
    /// mask or else group, other); an ACL the mode says all of (only the base entries) is not
    /// stored, and one stored before is removed; sgid is cleared when the caller is not in the
    /// file's group and lacks CAP_FSETID.
    pub fn setxattr_by(
        &self,
        ino: InodeNo,
        name: &[u8],
        value: &[u8],
        flags: i32,
        caller_groups: Option<&[u32]>,
    ) -> Result<()> {
        let ino = ino.get();
        check_xattr_name(name)?;
        self.refuse_snapshot_change("setxattr", &[ino])?;
        if value.len() > XATTR_SIZE_MAX {
            return Err(Error::TooLong(format!(
                "xattr value of {} bytes (limit {XATTR_SIZE_MAX})",
                value.len()
            )));
        }
        if (name == super::acl::ACL_ACCESS || name == super::acl::ACL_DEFAULT)
            && value.len() > XATTR_VALUE_MAX
        {
            // ACLs are copied and rewritten inline (inheritance, chmod): they stay in one item.
            return Err(Error::TooLong(format!(
                "ACL of {} bytes (limit {XATTR_VALUE_MAX})",
                value.len()
            )));
        }
        self.admit(true)?;
        let acl_mode = if name == super::acl::ACL_ACCESS {
            Some(super::acl::equiv_mode(value)?)
        } else {
            None
        };
        let state = self.inode(ino)?;
        let mut data = state.data.write();
        let mut changes = Changes::new(&*self.inner.engine);
        let exists = items::xattr_list(&changes, InodeNo::new(ino), name)?
            .iter()
            .any(|x| x.name == name);
        if flags & XATTR_CREATE != 0 && exists {
            return Err(Error::Exists(format!("xattr on inode {ino}")));
        }
        if flags & XATTR_REPLACE != 0 && !exists {
            return Err(Error::NoData(format!("xattr on inode {ino}")));
        }
        let mut store = true;
        // The mode an access ACL gives, set only once nothing can fail any more: a setfacl
        // that fails (ENOSPC, xfstests generic/449) leaves the mode as it was.
        let mut new_mode = None;
        if let Some((bits, equivalent)) = acl_mode {
            let mut mode = (data.item.mode & !0o777) | bits;
            if caller_groups.is_some_and(|g| !g.contains(&data.item.gid)) {
                mode &= !libc::S_ISGID;
            }
            new_mode = Some(mode);
            store = !equivalent;
        }
        // An ACL the mode says all of is not stored: one stored before is removed.
        let stored = items::set_xattr(
            &mut changes,
            InodeNo::new(ino),
            name,
            store.then_some(value),
        )?;
        let _op = self.inner.engine.hold()?;
        if stored == XattrStored::Chunks {
            // Before the chunks are recorded: the commit that holds them sets the flag.
            self.inner.engine.want_incompat(INCOMPAT_XATTR_CHUNKS);
        }
        data.item.ctime = now();
        if !changes.is_empty() {
            changes.record(&self.inner.engine.begin()?);
        }
        if let Some(mode) = new_mode {
            data.item.mode = mode;
        }
        *data.xattrs_absent.get_mut() = 0;
        self.store_inode(ino, &mut data)
    }

    /// The value of an xattr.
    pub fn getxattr(&self, ino: InodeNo, name: &[u8]) -> Result<Vec<u8>> {
        let ino = ino.get();
        check_xattr_name(name)?;
        if let Some(node) = self.snap_node(ino) {
            return self.snap_getxattr(node, name);
        }
        let state = self.inode(ino)?;
        let data = state.data.read();
        // security.capability is asked before every write by a kernel without KILLPRIV_V2:
        // after the first miss the answer comes from memory.
        self.xattr_value(ino, &data, name)?.ok_or_else(|| {
            Error::NoData(format!(
                "xattr {:?} of inode {ino}",
                String::from_utf8_lossy(name)
            ))
        })
    }

    /// Every xattr name, each followed by a NUL byte.
    pub fn listxattr(&self, ino: InodeNo) -> Result<Vec<u8>> {
        let ino = ino.get();
        if let Some(node) = self.snap_node(ino) {
            return self.snap_listxattr(node);
        }
        let state = self.inode(ino)?;
        let _data = state.data.read();
        let mut out = Vec::new();
        for name in items::xattr_names(&*self.inner.engine, InodeNo::new(ino))? {
            out.extend_from_slice(&name);
            out.push(0);
        }
        Ok(out)
    }

    /// What Linux does to a file written, truncated or chowned (`file_remove_privs`,
    /// `setattr_should_drop_sgid`): clears suid; clears sgid when group-execute is set, or when
    /// the caller (its groups in `caller_groups`, `None` for a caller with CAP_FSETID) is not
    /// in the file's group; drops `security.capability`. With the inode lock held; the caller
    /// stores the inode item. Returns whether anything was dropped.
    pub(crate) fn kill_privs_locked(
        &self,
        ino: u64,
        data: &mut InodeData,
        caller_groups: Option<&[u32]>,
    ) -> Result<bool> {
        let mode = data.item.mode;
        if mode & libc::S_IFMT != libc::S_IFREG {
            return Ok(false);
        }
        let mut killed = mode & !libc::S_ISUID;
        let outside_group = caller_groups.is_some_and(|g| !g.contains(&data.item.gid));
        if mode & libc::S_IXGRP != 0 || outside_group {
            killed &= !libc::S_ISGID;
        }
        data.item.mode = killed;
        let mut dropped = killed != mode;
        let cap = CAPABILITY;
        if data.xattrs_absent.load(Ordering::Relaxed) & ABSENT_CAPABILITY == 0 {
            // One search: the list under the name's hash, without the capability if it is there.
            let mut changes = Changes::new(&*self.inner.engine);
            if items::remove_xattr(&mut changes, InodeNo::new(ino), cap)? {
                changes.record(&self.inner.engine.begin()?);
                dropped = true;
            }
            data.xattrs_absent
                .fetch_or(ABSENT_CAPABILITY, Ordering::Relaxed);
        }
        Ok(dropped)
    }

    /// [`Filesystem::kill_privs_locked`] as its own operation, for a change whose call carries
    /// no caller: a fallocate (plain, punch hole, zero range) or a copy_file_range into `ino`
    /// by a caller without CAP_FSETID (its groups, primary first, in `caller_groups`), which
    /// Linux's `file_modified` treats as a write. Sets ctime when something was dropped.
    /// Returns whether anything was dropped (a mode the kernel cached is stale then).
    pub fn kill_privs(&self, ino: InodeNo, caller_groups: &[u32]) -> Result<bool> {
        let ino = ino.get();
        self.refuse_snapshot_change("write", &[ino])?;
        let state = self.inode(ino)?;
        let mut data = state.data.write();
        let mode = data.item.mode;
        if mode & libc::S_IFMT != libc::S_IFREG
            || (mode & (libc::S_ISUID | libc::S_ISGID) == 0
                && data.xattrs_absent.load(Ordering::Relaxed) & ABSENT_CAPABILITY != 0)
        {
            return Ok(false);
        }
        let _op = self.inner.engine.hold()?;
        let dropped = self.kill_privs_locked(ino, &mut data, Some(caller_groups))?;
        if dropped {
            data.item.ctime = now();
            self.store_inode(ino, &mut data)?;
        }
        Ok(dropped)
    }

    /// Removes an xattr.
    pub fn removexattr(&self, ino: InodeNo, name: &[u8]) -> Result<()> {
        let ino = ino.get();
        check_xattr_name(name)?;
        self.refuse_snapshot_change("removexattr", &[ino])?;
        self.admit(false)?;
        let state = self.inode(ino)?;
        let mut data = state.data.write();
        let mut changes = Changes::new(&*self.inner.engine);
        if !items::remove_xattr(&mut changes, InodeNo::new(ino), name)? {
            return Err(Error::NoData(format!("xattr of inode {ino}")));
        }
        data.item.ctime = now();
        changes.record(&self.inner.engine.begin()?);
        *data.xattrs_absent.get_mut() = 0;
        self.store_inode(ino, &mut data)
    }
}
