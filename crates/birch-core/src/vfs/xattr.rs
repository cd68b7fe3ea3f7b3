//! Extended attributes: `(ino, Xattr, hash(name))` items holding lists of name/value pairs;
//! a value over `XATTR_VALUE_MAX` bytes is stored out of line in `(ino, XattrChunk, hash(name,
//! index))` items (FORMAT.md §6.5, §6.8), behind the incompat flag `INCOMPAT_XATTR_CHUNKS`.

use std::sync::atomic::Ordering;

use birch_format::items::{
    decode_xattrs, encode_xattrs, xattr_chunk_hash, Xattr, XattrChunk, XattrSpill,
};
use birch_format::superblock::INCOMPAT_XATTR_CHUNKS;
use birch_format::{
    name_hash, FormatError, ItemType, Key, XATTR_CHUNK_BYTES, XATTR_SIZE_MAX, XATTR_VALUE_MAX,
};

use super::{now, Filesystem, InodeData};
use crate::error::{Error, Result};

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

pub(crate) fn xattr_key(ino: u64, name: &[u8]) -> Key {
    Key::new(ino, ItemType::Xattr, name_hash(&[name]))
}

/// The key of chunk `index` of the out-of-line value of xattr `name` of `ino`.
pub(crate) fn xattr_chunk_key(ino: u64, name: &[u8], index: u32) -> Key {
    Key::new(ino, ItemType::XattrChunk, xattr_chunk_hash(name, index))
}

/// Records the deletion of chunks `from ..` of an xattr list entry's out-of-line value.
fn delete_chunks(txn: &crate::txn::WriteTxn<'_>, ino: u64, entry: &Xattr, from: u32) {
    if let Some(spill) = entry.spill {
        for index in from..spill.chunks() {
            txn.delete(xattr_chunk_key(ino, &entry.name, index));
        }
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
    fn xattr_list(&self, ino: u64, name: &[u8]) -> Result<Vec<Xattr>> {
        match self.inner.engine.get(&xattr_key(ino, name))? {
            Some(bytes) => {
                decode_xattrs(&bytes).map_err(|e| Error::corrupt(format!("inode {ino} xattr"), e))
            }
            None => Ok(Vec::new()),
        }
    }

    /// The value an xattr list entry holds: inline, or read from its chunk items (each checked
    /// for its name and index, the whole for its size and crc32c).
    fn entry_value(&self, ino: u64, entry: Xattr) -> Result<Vec<u8>> {
        let Some(spill) = entry.spill else {
            return Ok(entry.value);
        };
        let what = || {
            format!(
                "inode {ino} xattr {:?}",
                String::from_utf8_lossy(&entry.name)
            )
        };
        let mut out = Vec::with_capacity(spill.size as usize);
        for index in 0..spill.chunks() {
            let bytes = self
                .inner
                .engine
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
                        format!(
                            "{:?} chunk {}",
                            String::from_utf8_lossy(&chunk.name),
                            chunk.index
                        ),
                        format!("chunk {index} of this name"),
                    ),
                ));
            }
            out.extend_from_slice(&chunk.data);
        }
        if out.len() != spill.size as usize || birch_format::checksum(&out) != spill.crc {
            return Err(Error::corrupt(
                what(),
                FormatError::invalid(
                    "out-of-line xattr value",
                    format!(
                        "{} bytes, crc {:#010x}",
                        out.len(),
                        birch_format::checksum(&out)
                    ),
                    format!("{} bytes, crc {:#010x}", spill.size, spill.crc),
                ),
            ));
        }
        Ok(out)
    }

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
        let value = match self
            .xattr_list(ino, name)?
            .into_iter()
            .find(|x| x.name == name)
        {
            Some(entry) => Some(self.entry_value(ino, entry)?),
            None => None,
        };
        if let (None, Some(bit)) = (&value, bit) {
            data.xattrs_absent.fetch_or(bit, Ordering::Relaxed);
        }
        Ok(value)
    }

    /// Sets an xattr (XATTR_CREATE: must not exist; XATTR_REPLACE: must exist). Setting the
    /// access ACL also sets the mode, as [`Filesystem::setxattr_by`] does for a caller with
    /// CAP_FSETID.
    pub fn setxattr(&self, ino: u64, name: &[u8], value: &[u8], flags: i32) -> Result<()> {
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
        ino: u64,
        name: &[u8],
        value: &[u8],
        flags: i32,
        caller_groups: Option<&[u32]>,
    ) -> Result<()> {
        check_xattr_name(name)?;
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
        let mut list = self.xattr_list(ino, name)?;
        let old = list.iter().find(|x| x.name == name).cloned();
        let exists = old.is_some();
        if flags & XATTR_CREATE != 0 && exists {
            return Err(Error::Exists(format!("xattr on inode {ino}")));
        }
        if flags & XATTR_REPLACE != 0 && !exists {
            return Err(Error::NoData(format!("xattr on inode {ino}")));
        }
        list.retain(|x| x.name != name);
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
        // A value over XATTR_VALUE_MAX goes out of line, in chunks.
        let spill = (store && value.len() > XATTR_VALUE_MAX).then(|| XattrSpill {
            size: value.len() as u32,
            crc: birch_format::checksum(value),
        });
        if store {
            list.push(Xattr {
                name: name.to_vec(),
                value: if spill.is_some() {
                    Vec::new()
                } else {
                    value.to_vec()
                },
                spill,
            });
        }
        let encoded = encode_xattrs(&list);
        if encoded.len() > birch_format::MAX_ITEM_BYTES {
            return Err(Error::NoSpace(format!(
                "xattrs of inode {ino} sharing one hash"
            )));
        }
        if let Some(spill) = spill {
            // A chunk key another name of this inode holds (a hash collision) cannot be used.
            for index in 0..spill.chunks() {
                if let Some(bytes) = self.inner.engine.get(&xattr_chunk_key(ino, name, index))? {
                    let chunk = XattrChunk::decode(&bytes)
                        .map_err(|e| Error::corrupt(format!("inode {ino} xattr chunk"), e))?;
                    if chunk.name != name {
                        return Err(Error::NoSpace(format!(
                            "xattr chunks of inode {ino} sharing one hash"
                        )));
                    }
                }
            }
        }
        let _op = self.inner.engine.hold()?;
        if spill.is_some() {
            // Before the chunks are recorded: the commit that holds them sets the flag.
            self.inner.engine.want_incompat(INCOMPAT_XATTR_CHUNKS);
        }
        data.item.ctime = now();
        if store || exists {
            let txn = self.inner.engine.begin()?;
            if list.is_empty() {
                txn.delete(xattr_key(ino, name));
            } else {
                txn.put(xattr_key(ino, name), encoded);
            }
            let chunks = spill.map_or(0, |s| s.chunks());
            for (index, data) in (0..chunks).zip(value.chunks(XATTR_CHUNK_BYTES)) {
                let chunk = XattrChunk {
                    name: name.to_vec(),
                    index,
                    data: data.to_vec(),
                };
                txn.put(xattr_chunk_key(ino, name, index), chunk.encode());
            }
            if let Some(old) = &old {
                delete_chunks(&txn, ino, old, chunks);
            }
        }
        if let Some(mode) = new_mode {
            data.item.mode = mode;
        }
        *data.xattrs_absent.get_mut() = 0;
        self.store_inode(ino, &mut data)
    }

    /// The value of an xattr.
    pub fn getxattr(&self, ino: u64, name: &[u8]) -> Result<Vec<u8>> {
        check_xattr_name(name)?;
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
    pub fn listxattr(&self, ino: u64) -> Result<Vec<u8>> {
        let state = self.inode(ino)?;
        let _data = state.data.read();
        let lo = Key::new(ino, ItemType::Xattr, 0);
        let hi = Key::new(ino, ItemType::Xattr, u64::MAX);
        let mut out = Vec::new();
        for (key, bytes) in self.inner.engine.range(&lo, &hi, usize::MAX)? {
            // Keys of type Xattr only (chunks sort after them, outside the range).
            for x in decode_xattrs(&bytes).map_err(|e| Error::corrupt(format!("xattr {key}"), e))? {
                out.extend_from_slice(&x.name);
                out.push(0);
            }
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
            let mut list = self.xattr_list(ino, cap)?;
            let old = list.iter().find(|x| x.name == cap).cloned();
            list.retain(|x| x.name != cap);
            if let Some(old) = old {
                let txn = self.inner.engine.begin()?;
                if list.is_empty() {
                    txn.delete(xattr_key(ino, cap));
                } else {
                    txn.put(xattr_key(ino, cap), encode_xattrs(&list));
                }
                delete_chunks(&txn, ino, &old, 0);
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
    pub fn kill_privs(&self, ino: u64, caller_groups: &[u32]) -> Result<bool> {
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
    pub fn removexattr(&self, ino: u64, name: &[u8]) -> Result<()> {
        check_xattr_name(name)?;
        self.admit(false)?;
        let state = self.inode(ino)?;
        let mut data = state.data.write();
        let mut list = self.xattr_list(ino, name)?;
        let Some(old) = list.iter().find(|x| x.name == name).cloned() else {
            return Err(Error::NoData(format!("xattr of inode {ino}")));
        };
        list.retain(|x| x.name != name);
        data.item.ctime = now();
        {
            let txn = self.inner.engine.begin()?;
            if list.is_empty() {
                txn.delete(xattr_key(ino, name));
            } else {
                txn.put(xattr_key(ino, name), encode_xattrs(&list));
            }
            delete_chunks(&txn, ino, &old, 0);
        }
        *data.xattrs_absent.get_mut() = 0;
        self.store_inode(ino, &mut data)
    }
}
