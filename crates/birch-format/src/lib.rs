//! The birchfs on-disk format, version 1.
//!
//! Owns: the byte layout of the superblock, B-tree nodes, keys and item payloads; their
//! encoding and decoding; the crc32c checksums; per-node and per-item validation (the
//! tree-checker); and the `Display` printers that `inspect`, fsck and failing tests share.
//!
//! Must not touch: I/O, block allocation, locks or transactions. Decoding never trusts disk
//! bytes: every failure is a [`FormatError`] that says where and what, never a panic.
//! `docs/FORMAT.md` documents every byte defined here; change both in one commit.

#![warn(missing_docs)]

pub mod bytes;
pub mod codec;
pub mod items;
pub mod key;
pub mod log;
pub mod node;
pub mod superblock;
pub mod units;

pub use key::{ItemType, Key};
pub use units::{BlockAddr, BlockCount, Generation, InodeNo, Lsn};

/// Size of a data block and the unit of allocation. 4 KiB matches the host page size, so
/// O_DIRECT I/O and FUSE page-sized writes line up with it.
pub const BLOCK_SIZE: u64 = 4096;
/// Size of a metadata node. 16 KiB (btrfs's default) keeps trees shallow and fits items up to
/// [`MAX_ITEM_BYTES`] while a leaf still holds at least two of them.
pub const NODE_SIZE: usize = 16384;
/// Blocks per node.
pub const NODE_BLOCKS: u64 = NODE_SIZE as u64 / BLOCK_SIZE;
/// The on-disk format version this code writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Largest item payload. Half a leaf's payload space minus headers, so that any split of a
/// full leaf leaves both halves valid.
pub const MAX_ITEM_BYTES: usize = 7800;
/// Longest file name in bytes, as on Linux (NAME_MAX).
pub const NAME_MAX: usize = 255;
/// Largest xattr value in bytes: it must fit one item beside its name and header.
pub const XATTR_VALUE_MAX: usize = 7168;
/// Largest xattr value of all (Linux's `XATTR_SIZE_MAX`): one over [`XATTR_VALUE_MAX`] is
/// stored out of line, in [`XATTR_CHUNK_BYTES`]-byte chunk items (`XattrChunk`), behind the
/// incompat flag `INCOMPAT_XATTR_CHUNKS`.
pub const XATTR_SIZE_MAX: usize = 65536;
/// Value bytes in one xattr chunk item (the last chunk of a value may hold fewer).
pub const XATTR_CHUNK_BYTES: usize = 4096;
/// Largest inline file: files up to this size live in their extent item (btrfs's max_inline
/// default). Larger files go to data blocks.
pub const INLINE_MAX_BYTES: usize = 2048;
/// Largest regular extent in blocks: its per-block checksums (4 bytes each) must fit one item.
pub const EXTENT_MAX_BLOCKS: u64 = 256;
/// Link limit of one inode, as ext4's EXT4_LINK_MAX.
pub const LINK_MAX: u32 = 65000;
/// Largest file size: 2^62 bytes keeps every offset + length computation far from u64 overflow.
pub const MAX_FILE_BYTES: u64 = 1 << 62;
/// Tree height limit: 8 levels of 494-way nodes address far more than 2^64 bytes. Here, not
/// in `node`, because the superblock's root pointer is checked against it too.
pub const MAX_LEVEL: u8 = 8;

// The limits are checked in every build, not only by a test: a change that breaks one does
// not compile. (The leaf-size check sits beside the node header it needs, in `node`.)
// An xattr value up to the inline limit fits one item beside its name and header.
const _: () = assert!(XATTR_VALUE_MAX + NAME_MAX + 8 <= MAX_ITEM_BYTES);
// An xattr chunk fits one item beside its name, the name length and the chunk index.
const _: () = assert!(XATTR_CHUNK_BYTES + NAME_MAX + 2 + 4 <= MAX_ITEM_BYTES);
// The largest xattr value takes at most 16 chunks.
const _: () = assert!(XATTR_SIZE_MAX.div_ceil(XATTR_CHUNK_BYTES) <= 16);
// A full extent's per-block checksums fit one item beside the extent's fields.
const _: () = assert!(EXTENT_MAX_BLOCKS as usize * 4 + 64 <= MAX_ITEM_BYTES);

/// Tree ids, recorded as the owner of every node.
pub const FS_TREE_ID: u64 = 5;
/// Owner of the snapshot list tree's nodes (FORMAT.md §3.2): items `(id, Snapshot, 0)`.
pub const SNAPSHOT_TREE_ID: u64 = 7;

/// Object id of the root directory. FUSE requires node id 1 for the root.
pub const ROOT_OBJECTID: u64 = 1;
/// [`ROOT_OBJECTID`] as an inode number.
pub const ROOT_INO: InodeNo = InodeNo::new(ROOT_OBJECTID);
/// The first object id handed to new inodes.
pub const FIRST_FREE_OBJECTID: u64 = 256;
/// Bits 48..63 of an inode number (FUSE node id, `st_ino`, `d_ino`) are a subvolume id: 0 is
/// the live tree, a snapshot's id is its subvolume (DESIGN §7). Object ids stay below
/// [`OBJECTID_LIMIT`], snapshot ids below [`SNAPSHOT_ID_LIMIT`].
pub const SUBVOLUME_SHIFT: u32 = 48;
/// Object ids are below 2^48: the allocator refuses to hand out more (DESIGN §7).
pub const OBJECTID_LIMIT: u64 = 1 << SUBVOLUME_SHIFT;
/// Snapshot ids are below 2^16, so that every snapshot's inode numbers fit (DESIGN §7).
pub const SNAPSHOT_ID_LIMIT: u64 = 1 << (64 - SUBVOLUME_SHIFT);
/// Reserved object id of the hidden snapshot directory `/.snapshot` (node id 2 of the live
/// subvolume; never an inode in any tree).
pub const SNAPSHOT_DIR_OBJECTID: u64 = 2;
/// [`SNAPSHOT_DIR_OBJECTID`] as an inode number.
pub const SNAPSHOT_DIR_INO: InodeNo = InodeNo::new(SNAPSHOT_DIR_OBJECTID);
/// Object id under which orphan items are keyed: (ORPHAN_OBJECTID, Orphan, inode).
pub const ORPHAN_OBJECTID: u64 = u64::MAX - 5;

/// Lowercase hex of a byte slice (fsids in printers and messages).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// crc32c (Castagnoli) of a byte slice: the checksum of every node, superblock, data block and
/// log batch.
pub fn checksum(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// A 64-bit FNV-1a hash. Stable forever: it keys dir items, inode refs and xattrs on disk.
pub fn name_hash(parts: &[&[u8]]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for byte in part.iter() {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

/// Everything that can be wrong with bytes read from disk.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// The magic bytes are not this structure's (`BIRCHFS1`, `BNOD`, `BLOG`): not birchfs
    /// data at all, as opposed to damaged birchfs data. Checked before the checksum.
    #[error("bad magic at {what}: found {found:02x?}")]
    BadMagic {
        /// The structure and where it was read, e.g. `slot 0` or `node 0x24000 (owner 5)`.
        what: String,
        /// The bytes found where the magic belongs.
        found: Vec<u8>,
    },
    /// The stored crc32c does not match the bytes it covers: a torn write or media damage.
    #[error("checksum mismatch at {what}: stored {stored:#010x}, computed {computed:#010x}")]
    BadChecksum {
        /// The structure and where it was read.
        what: String,
        /// The checksum read from disk.
        stored: u32,
        /// The crc32c of the bytes as read.
        computed: u32,
    },
    /// A valid superblock of a format version other than [`FORMAT_VERSION`]: a newer (or
    /// older) image, not damage. Stops the open even if the other slot is fine.
    #[error(
        "unsupported format version {found} at {what} (this build reads version {FORMAT_VERSION})"
    )]
    BadVersion {
        /// The superblock slot it was read from.
        what: String,
        /// The version stored on disk.
        found: u32,
    },
    /// The superblock sets `incompat` feature bits this build does not know, so it cannot
    /// read the image safely. Stops the open even if the other slot is fine.
    #[error(
        "unknown incompatible feature flags {flags:#x}: this build cannot read the image safely"
    )]
    UnknownIncompat {
        /// The unknown bits only (the stored mask minus [`superblock::INCOMPAT_SUPPORTED`]).
        flags: u64,
    },
    /// A field decoded but breaks an invariant of the format (a range, an alignment, an
    /// ordering, a count). Built with [`FormatError::invalid`].
    #[error("{what}: {found}, expected {expected}")]
    Invalid {
        /// The field and where it was read, e.g. `node 0x24000 (owner 5) slot 3 data range`.
        what: String,
        /// The value found, printed.
        found: String,
        /// What the format requires there, printed.
        expected: String,
    },
    /// The bytes end before the structure does.
    #[error("{what}: truncated, need {need} bytes, have {have}")]
    Truncated {
        /// The structure being decoded.
        what: String,
        /// Bytes needed to finish the read that failed, counted from the start of the input.
        need: usize,
        /// Bytes the input holds.
        have: usize,
    },
}

impl FormatError {
    /// Builds an [`FormatError::Invalid`] with its three parts.
    pub fn invalid(what: impl Into<String>, found: impl ToString, expected: impl ToString) -> Self {
        FormatError::Invalid {
            what: what.into(),
            found: found.to_string(),
            expected: expected.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn name_hash_is_stable() {
        // Pinned values: the hash keys items on disk and must never change.
        assert_eq!(name_hash(&[b""]), 0xcbf2_9ce4_8422_2325);
        assert_eq!(name_hash(&[b"a"]), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(name_hash(&[b"ab"]), name_hash(&[b"a", b"b"]));
    }
}
