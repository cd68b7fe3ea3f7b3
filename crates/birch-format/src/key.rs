//! Item keys: `(objectid, type, offset)`, ordered field by field, as in btrfs.

use std::fmt;

use crate::bytes::{Reader, Writer};
use crate::FormatError;

/// Encoded size of a key in bytes: objectid (8), type (1), offset (8).
pub const KEY_BYTES: usize = 17;

/// Item type codes. The numbers are on disk; the gaps match btrfs's numbering for familiarity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum ItemType {
    /// `(ino, InodeItem, 0)`: the inode's attributes.
    InodeItem = 1,
    /// `(ino, InodeRef, hash(parent, name))`: a name of the inode, for nlink and paths.
    InodeRef = 12,
    /// `(ino, Xattr, hash(name))`: extended attributes.
    Xattr = 24,
    /// `(ino, XattrChunk, hash(name, index))`: one chunk of an xattr value stored out of line
    /// (a value over `XATTR_VALUE_MAX` bytes; incompat flag `INCOMPAT_XATTR_CHUNKS`).
    XattrChunk = 25,
    /// `(ORPHAN_OBJECTID, Orphan, ino)`: an inode with no names still to be freed.
    Orphan = 48,
    /// `(dir, DirItem, hash(name))`: name lookup.
    DirItem = 84,
    /// `(dir, DirIndex, index)`: readdir order; the index is the readdir cookie.
    DirIndex = 96,
    /// `(ino, ExtentData, file_offset)`: file data, inline or in blocks.
    ExtentData = 108,
    /// `(snapshot_id, Snapshot, 0)`: one snapshot, in the snapshot list tree only
    /// ([`crate::SNAPSHOT_TREE_ID`]; incompat flag `INCOMPAT_SNAPSHOTS`).
    Snapshot = 132,
}

impl ItemType {
    /// Decodes a type code.
    pub fn from_u8(code: u8) -> Option<ItemType> {
        Some(match code {
            1 => ItemType::InodeItem,
            12 => ItemType::InodeRef,
            24 => ItemType::Xattr,
            25 => ItemType::XattrChunk,
            48 => ItemType::Orphan,
            84 => ItemType::DirItem,
            96 => ItemType::DirIndex,
            108 => ItemType::ExtentData,
            132 => ItemType::Snapshot,
            _ => return None,
        })
    }

    /// The lowest type code, for range scans over every type of one object. Not a valid
    /// type: no item is written with it.
    pub const MIN: u8 = 0;
    /// The highest type code, the upper bound of such range scans. Not a valid type.
    pub const MAX: u8 = u8::MAX;
}

impl fmt::Display for ItemType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            ItemType::InodeItem => "inode",
            ItemType::InodeRef => "inode_ref",
            ItemType::Xattr => "xattr",
            ItemType::XattrChunk => "xattr_chunk",
            ItemType::Orphan => "orphan",
            ItemType::DirItem => "dir_item",
            ItemType::DirIndex => "dir_index",
            ItemType::ExtentData => "extent",
            ItemType::Snapshot => "snapshot",
        };
        f.write_str(name)
    }
}

/// An item key. The type is kept as a raw byte so that range bounds may use any code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Key {
    /// The object the item belongs to: an inode number, or a reserved id such as
    /// [`crate::ORPHAN_OBJECTID`]. Bytes 0..8; sorts first.
    pub objectid: u64,
    /// Raw [`ItemType`] code, byte 8; sorts second. Unknown codes are kept, not rejected.
    pub item_type: u8,
    /// Byte 9..17; its meaning depends on the type: 0, a name hash, a dir index, a file
    /// offset in bytes, or an inode number. Sorts last.
    pub offset: u64,
}

impl Key {
    /// The smallest key, `(0, 0, 0)`: the lower bound of a scan over the whole tree.
    pub const MIN: Key = Key {
        objectid: 0,
        item_type: 0,
        offset: 0,
    };
    /// The largest key, all ones: the upper bound of a scan over the whole tree.
    pub const MAX: Key = Key {
        objectid: u64::MAX,
        item_type: u8::MAX,
        offset: u64::MAX,
    };

    /// A key of a known type.
    pub const fn new(objectid: u64, item_type: ItemType, offset: u64) -> Key {
        Key {
            objectid,
            item_type: item_type as u8,
            offset,
        }
    }

    /// The key range `[lo, hi)` that holds every key of object `objectid` (for an inode: its
    /// inode item, refs, xattrs, extents, and a directory's entries) and no key of another.
    pub fn object_range(objectid: u64) -> (Key, Key) {
        let at = |objectid| Key {
            objectid,
            item_type: 0,
            offset: 0,
        };
        // Object ids stop well below u64::MAX (the orphan list's id is the highest in use), so
        // the next id exists for every object.
        (at(objectid), at(objectid.saturating_add(1)))
    }

    /// The key's type, if it is a known one.
    pub fn kind(&self) -> Option<ItemType> {
        ItemType::from_u8(self.item_type)
    }

    /// Encodes the key (17 bytes).
    pub fn encode(&self, out: &mut Writer) {
        out.u64(self.objectid);
        out.u8(self.item_type);
        out.u64(self.offset);
    }

    /// Decodes a key.
    pub fn decode(input: &mut Reader<'_>) -> Result<Key, FormatError> {
        Ok(Key {
            objectid: input.u64()?,
            item_type: input.u8()?,
            offset: input.u64()?,
        })
    }

    /// The previous key in order, or `None` at the minimum.
    pub fn predecessor(&self) -> Option<Key> {
        if let Some(offset) = self.offset.checked_sub(1) {
            return Some(Key { offset, ..*self });
        }
        if let Some(item_type) = self.item_type.checked_sub(1) {
            return Some(Key {
                item_type,
                offset: u64::MAX,
                ..*self
            });
        }
        self.objectid.checked_sub(1).map(|objectid| Key {
            objectid,
            item_type: u8::MAX,
            offset: u64::MAX,
        })
    }

    /// The next key in order, or `None` at the maximum.
    pub fn successor(&self) -> Option<Key> {
        if let Some(offset) = self.offset.checked_add(1) {
            return Some(Key { offset, ..*self });
        }
        if let Some(item_type) = self.item_type.checked_add(1) {
            return Some(Key {
                item_type,
                offset: 0,
                ..*self
            });
        }
        self.objectid.checked_add(1).map(|objectid| Key {
            objectid,
            item_type: 0,
            offset: 0,
        })
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind() {
            Some(kind) => write!(f, "({}, {}, {})", self.objectid, kind, self.offset),
            None => write!(
                f,
                "({}, type#{}, {})",
                self.objectid, self.item_type, self.offset
            ),
        }
    }
}
