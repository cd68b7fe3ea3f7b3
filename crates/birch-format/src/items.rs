//! Item payloads: inode, inode ref, dir item, dir index, xattr, file extent, orphan, and the
//! snapshot list's snapshot item.

use std::fmt;

use crate::bytes::{Reader, Writer};
use crate::codec::Codec;
use crate::key::ItemType;
use crate::{
    FormatError, BLOCK_SIZE, EXTENT_MAX_BLOCKS, INLINE_MAX_BYTES, NAME_MAX, XATTR_CHUNK_BYTES,
    XATTR_SIZE_MAX, XATTR_VALUE_MAX,
};

/// A point in time with nanoseconds; 12 bytes on disk (i64 seconds, then u32 nanoseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Hash)]
pub struct Timespec {
    /// Seconds since the Unix epoch; negative before 1970.
    pub sec: i64,
    /// Nanoseconds within the second, < 10^9; the decoder refuses larger values (`Invalid`).
    pub nsec: u32,
}

impl Timespec {
    fn encode(&self, w: &mut Writer) {
        w.i64(self.sec);
        w.u32(self.nsec);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Timespec, FormatError> {
        let sec = r.i64()?;
        let nsec = r.u32()?;
        if nsec >= 1_000_000_000 {
            return Err(FormatError::invalid("timestamp nanoseconds", nsec, "< 1e9"));
        }
        Ok(Timespec { sec, nsec })
    }
}

/// Encoded size of an inode item in bytes, exactly; the last 40 are reserved zeros.
pub const INODE_ITEM_BYTES: usize = 160;

/// `(ino, InodeItem, 0)`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct InodeItem {
    /// NFS generation: stays fixed for the inode's life.
    pub generation: u64,
    /// Transaction generation of the last change.
    pub transid: u64,
    /// st_size in bytes. For a directory: its entry count, without `.` and `..`.
    pub size: u64,
    /// Bytes of data blocks the inode references (st_blocks * 512).
    pub nbytes: u64,
    /// Link count, at most [`crate::LINK_MAX`]; a directory's is 2 + its subdirectories. 0
    /// while the inode is an orphan.
    pub nlink: u32,
    /// Owner user id.
    pub uid: u32,
    /// Owner group id.
    pub gid: u32,
    /// File type and permission bits, as st_mode.
    pub mode: u32,
    /// Device number of a character or block device node; 0 otherwise.
    pub rdev: u64,
    /// Inode flags; none defined in v1, written as 0.
    pub flags: u64,
    /// The next dir index a new entry of this directory gets; never reused, so readdir
    /// cookies stay valid while entries come and go.
    pub next_dir_index: u64,
    /// Last access time.
    pub atime: Timespec,
    /// Last data modification time.
    pub mtime: Timespec,
    /// Last status (inode) change time.
    pub ctime: Timespec,
    /// Creation time; set once when the inode is made.
    pub otime: Timespec,
}

impl InodeItem {
    /// Encodes to exactly [`INODE_ITEM_BYTES`], reserved bytes zero.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(INODE_ITEM_BYTES);
        w.u64(self.generation);
        w.u64(self.transid);
        w.u64(self.size);
        w.u64(self.nbytes);
        w.u32(self.nlink);
        w.u32(self.uid);
        w.u32(self.gid);
        w.u32(self.mode);
        w.u64(self.rdev);
        w.u64(self.flags);
        w.u64(self.next_dir_index);
        for t in [&self.atime, &self.mtime, &self.ctime, &self.otime] {
            t.encode(&mut w);
        }
        let mut bytes = w.into_bytes();
        bytes.resize(INODE_ITEM_BYTES, 0);
        bytes
    }

    /// Decodes an inode payload. `Invalid` if it is not exactly [`INODE_ITEM_BYTES`] long or
    /// a timestamp has nanoseconds >= 10^9. Reserved bytes are not checked.
    pub fn decode(bytes: &[u8]) -> Result<InodeItem, FormatError> {
        if bytes.len() != INODE_ITEM_BYTES {
            return Err(FormatError::invalid(
                "inode item size",
                bytes.len(),
                INODE_ITEM_BYTES,
            ));
        }
        let mut r = Reader::new(bytes, "inode item");
        Ok(InodeItem {
            generation: r.u64()?,
            transid: r.u64()?,
            size: r.u64()?,
            nbytes: r.u64()?,
            nlink: r.u32()?,
            uid: r.u32()?,
            gid: r.u32()?,
            mode: r.u32()?,
            rdev: r.u64()?,
            flags: r.u64()?,
            next_dir_index: r.u64()?,
            atime: Timespec::decode(&mut r)?,
            mtime: Timespec::decode(&mut r)?,
            ctime: Timespec::decode(&mut r)?,
            otime: Timespec::decode(&mut r)?,
        })
    }
}

fn encode_name(w: &mut Writer, name: &[u8]) {
    // Cast: names are at most NAME_MAX (255) bytes, checked before any item is built.
    w.u16(name.len() as u16);
    w.put(name);
}

fn decode_name(r: &mut Reader<'_>) -> Result<Vec<u8>, FormatError> {
    let len = usize::from(r.u16()?);
    if len == 0 || len > NAME_MAX {
        return Err(FormatError::invalid(
            "name length",
            len,
            format!("1..={NAME_MAX}"),
        ));
    }
    Ok(r.take(len)?.to_vec())
}

/// One name of an inode: `(ino, InodeRef, hash(parent, name))` holds a list of these (more
/// than one only on a hash collision), so tens of thousands of links cost one item each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InodeRef {
    /// Object id of the directory holding the name.
    pub parent: u64,
    /// Index of the matching `(parent, DirIndex, index)` item.
    pub dir_index: u64,
    /// The name within `parent`, 1 ..= [`NAME_MAX`] bytes.
    pub name: Vec<u8>,
}

/// One entry of a directory: `(dir, DirItem, hash(name))` holds a list of these (more than
/// one only on a hash collision); `(dir, DirIndex, index)` holds exactly one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    /// Object id of the inode the name points to.
    pub child: u64,
    /// Index of the entry's `(dir, DirIndex, index)` item: >= 2, never reused in its directory.
    pub dir_index: u64,
    /// d_type (DT_REG = 8, DT_DIR = 4, ...).
    pub file_type: u8,
    /// The name, 1 ..= [`NAME_MAX`] bytes.
    pub name: Vec<u8>,
}

/// One xattr: `(ino, Xattr, hash(name))` holds a list of these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Xattr {
    /// Full name with its namespace prefix (e.g. `user.k`), 1 ..= [`NAME_MAX`] bytes.
    pub name: Vec<u8>,
    /// The value, 0 ..= [`XATTR_VALUE_MAX`] bytes; empty when `spill` is set.
    pub value: Vec<u8>,
    /// A value over [`XATTR_VALUE_MAX`] bytes, stored out of line in [`XattrChunk`] items.
    pub spill: Option<XattrSpill>,
}

/// Value length that marks an xattr list entry whose value is stored out of line.
pub const XATTR_SPILL_MARK: u16 = 0xFFFF;

/// What an xattr list entry says of a value stored out of line: its chunks are the
/// `(ino, XattrChunk, xattr_chunk_hash(name, i))` items for `i` in `0 .. chunks()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XattrSpill {
    /// Value bytes, `XATTR_VALUE_MAX + 1 ..= XATTR_SIZE_MAX`.
    pub size: u32,
    /// crc32c of the whole value.
    pub crc: u32,
}

impl XattrSpill {
    /// The number of chunk items the value takes.
    pub fn chunks(&self) -> u32 {
        (self.size as usize).div_ceil(XATTR_CHUNK_BYTES) as u32
    }
}

/// The key offset of chunk `index` of the out-of-line value of xattr `name`:
/// `name_hash(name ‖ index as u32 LE)`.
pub fn xattr_chunk_hash(name: &[u8], index: u32) -> u64 {
    crate::name_hash(&[name, &index.to_le_bytes()])
}

/// One chunk of an out-of-line xattr value: `(ino, XattrChunk, xattr_chunk_hash(name, index))`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XattrChunk {
    /// The xattr's full name (a key collision of two names is told apart by it).
    pub name: Vec<u8>,
    /// Chunk number from 0: value bytes `index × XATTR_CHUNK_BYTES ..`.
    pub index: u32,
    /// 1 ..= [`XATTR_CHUNK_BYTES`] value bytes.
    pub data: Vec<u8>,
}

impl XattrChunk {
    /// Encodes: name, u32 index, the data (the rest of the payload).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        encode_name(&mut w, &self.name);
        w.u32(self.index);
        w.put(&self.data);
        w.into_bytes()
    }

    /// Decodes a chunk payload. `Invalid` for a bad name length, an index of 16 or more, or
    /// data of 0 or over [`XATTR_CHUNK_BYTES`] bytes; `Truncated` for a cut payload.
    pub fn decode(bytes: &[u8]) -> Result<XattrChunk, FormatError> {
        let mut r = Reader::new(bytes, "xattr chunk");
        let name = decode_name(&mut r)?;
        let index = r.u32()?;
        let max_index = XATTR_SIZE_MAX.div_ceil(XATTR_CHUNK_BYTES) as u32;
        if index >= max_index {
            return Err(FormatError::invalid(
                "xattr chunk index",
                index,
                format!("< {max_index}"),
            ));
        }
        let len = r.remaining();
        if len == 0 || len > XATTR_CHUNK_BYTES {
            return Err(FormatError::invalid(
                "xattr chunk data length",
                len,
                format!("1..={XATTR_CHUNK_BYTES}"),
            ));
        }
        Ok(XattrChunk {
            name,
            index,
            data: r.take(len)?.to_vec(),
        })
    }
}

/// Encoded size of a snapshot item's fixed fields, before its name.
pub const SNAPSHOT_ITEM_FIXED_BYTES: usize = 48;

/// One snapshot, `(id, Snapshot, 0)` in the snapshot list tree (FORMAT.md §3.2): the fs tree
/// of commit `generation`, kept read-only. Ids are never reused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotItem {
    /// The commit whose fs tree the snapshot keeps; every block the tree references was born
    /// at or before it.
    pub generation: u64,
    /// That commit's fs tree root.
    pub root: crate::superblock::RootPtr,
    /// When the snapshot was made (wall clock).
    pub created: Timespec,
    /// 1 ..= [`NAME_MAX`] bytes, no `/` and no NUL.
    pub name: Vec<u8>,
}

impl SnapshotItem {
    /// Encodes: generation, root (addr, generation, level, 7 zero bytes), creation time,
    /// 4 zero bytes, then the name (u16 length and bytes).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u64(self.generation);
        w.u64(self.root.addr);
        w.u64(self.root.generation);
        w.u8(self.root.level);
        w.zeros(7);
        self.created.encode(&mut w);
        w.u32(0);
        encode_name(&mut w, &self.name);
        w.into_bytes()
    }

    /// Decodes a snapshot payload. `Invalid` for a root generation above the snapshot's, a
    /// level of [`crate::MAX_LEVEL`] or more, a root address that is not block aligned, a bad
    /// name (length, `/`, NUL) or bytes after the name; `Truncated` for a cut payload.
    pub fn decode(bytes: &[u8]) -> Result<SnapshotItem, FormatError> {
        let mut r = Reader::new(bytes, "snapshot item");
        let generation = r.u64()?;
        let addr = r.u64()?;
        let root_generation = r.u64()?;
        let level = r.u8()?;
        r.skip(7)?;
        let created = Timespec::decode(&mut r)?;
        r.skip(4)?;
        let name = decode_name(&mut r)?;
        if r.remaining() != 0 {
            return Err(FormatError::invalid(
                "snapshot item length",
                bytes.len(),
                SNAPSHOT_ITEM_FIXED_BYTES + 2 + name.len(),
            ));
        }
        if root_generation > generation || level >= crate::MAX_LEVEL {
            return Err(FormatError::invalid(
                "snapshot root",
                format!("generation {root_generation} level {level}"),
                format!("generation <= {generation}, level < {}", crate::MAX_LEVEL),
            ));
        }
        if addr == 0 || addr % BLOCK_SIZE != 0 {
            return Err(FormatError::invalid(
                "snapshot root address",
                format!("{addr:#x}"),
                "a non-zero block-aligned address",
            ));
        }
        if name.iter().any(|b| *b == b'/' || *b == 0) {
            return Err(FormatError::invalid(
                "snapshot name",
                show_name(&name),
                "no '/' and no NUL",
            ));
        }
        Ok(SnapshotItem {
            generation,
            root: crate::superblock::RootPtr {
                addr,
                generation: root_generation,
                level,
            },
            created,
            name,
        })
    }
}

/// Where a file extent's bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtentKind {
    /// Bytes stored in the item itself (kind 0): the whole file, at most
    /// [`INLINE_MAX_BYTES`], in the one extent at file offset 0.
    Inline(Vec<u8>),
    /// Blocks on disk with one crc32c per block (kind 1).
    Regular {
        /// Byte address of the first block: non-zero, block aligned.
        disk_addr: u64,
        /// crc32c of each 4096-byte block, in order; its length is the extent's block count,
        /// 1 ..= [`EXTENT_MAX_BLOCKS`].
        csums: Vec<u32>,
    },
    /// Allocated blocks that read as zeros (fallocate) (kind 2).
    Prealloc {
        /// Byte address of the first block: non-zero, block aligned.
        disk_addr: u64,
        /// Length in blocks, 1 ..= [`EXTENT_MAX_BLOCKS`].
        blocks: u64,
    },
    /// A window over a blob: stored blocks that decode to more file bytes than the item covers
    /// (kind 4, FORMAT.md §6.6, DESIGN §16.2; incompat flag `INCOMPAT_BLOB_EXTENTS`).
    Blob(Blob),
}

/// Integrity bytes per stored block of a blob (crc32c; a wider tag comes with encryption).
pub const BLOB_INTEGRITY_WIDTH: u8 = 4;

/// The most logical bytes one blob decodes to, as the format allows (DESIGN §16.3: a build
/// writes at most 128 KiB; up to 1 MiB keeps every extent look-up's look-back valid).
pub const BLOB_MAX_LOGICAL: u64 = EXTENT_MAX_BLOCKS * BLOCK_SIZE;

/// Encoded size of a blob extent's fixed fields (before the integrity array).
pub const BLOB_FIXED_BYTES: usize = 46;

/// A blob and the window of it one extent item covers (DESIGN §16.2): file bytes
/// `[key.offset, key.offset + window_len)` are decoded bytes
/// `[window_offset, window_offset + window_len)` of the blob stored at `disk_addr`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blob {
    /// Byte address of the blob's first stored block: non-zero, block aligned.
    pub disk_addr: u64,
    /// How the stored bytes encode the logical ones. Decoding yields `Codec::Zstd(0)` for zstd
    /// (the level is not stored).
    pub codec: Codec,
    /// Bytes of the codec's output: `(n-1)·4096 < encoded_len <= n·4096` for `n` stored
    /// blocks; equal to `logical` for [`Codec::None`].
    pub encoded_len: u32,
    /// Bytes the blob decodes to: a multiple of 4096, 4096 ..= [`BLOB_MAX_LOGICAL`].
    pub logical: u32,
    /// First decoded byte of the window: a multiple of 4096, below `logical`.
    pub window_offset: u32,
    /// Bytes of the window: a non-zero multiple of 4096, `window_offset + window_len <=
    /// logical`.
    pub window_len: u32,
    /// Nonce input of an encrypted blob; zero without encryption.
    pub nonce: u64,
    /// crc32c of each stored 4096-byte block (zero-padded past `encoded_len`), in order; its
    /// length is the stored block count, 1 ..= the logical block count.
    pub csums: Vec<u32>,
}

impl Blob {
    /// Blocks the blob occupies on disk.
    pub fn stored_blocks(&self) -> u64 {
        self.csums.len() as u64
    }

    /// Blocks of decoded bytes.
    pub fn logical_blocks(&self) -> u64 {
        u64::from(self.logical) / BLOCK_SIZE
    }

    /// The same blob with the window `[window_offset + skip, .. + len)` of this one: the piece
    /// a cut keeps (`skip` and `len` in bytes, block multiples, inside this window).
    pub fn narrowed(&self, skip: u64, len: u64) -> Blob {
        debug_assert!(skip % BLOCK_SIZE == 0 && len % BLOCK_SIZE == 0 && len > 0);
        debug_assert!(skip + len <= u64::from(self.window_len));
        Blob {
            window_offset: self.window_offset + skip as u32,
            window_len: len as u32,
            ..self.clone()
        }
    }

    /// Blocks an item with this window charges to its inode's `st_blocks` (DESIGN §16.8):
    /// `ceil(stored · window_len / logical)`, at least 1.
    pub fn charged_blocks(&self) -> u64 {
        let stored = self.stored_blocks();
        (stored * u64::from(self.window_len))
            .div_ceil(u64::from(self.logical).max(1))
            .max(1)
    }

    /// Whether `other` names the same stored blob (every field but the window agrees).
    pub fn same_blob(&self, other: &Blob) -> bool {
        self.disk_addr == other.disk_addr
            && self.codec.byte() == other.codec.byte()
            && self.encoded_len == other.encoded_len
            && self.logical == other.logical
            && self.nonce == other.nonce
            && self.csums == other.csums
    }

    fn encode(&self, shared: bool, w: &mut Writer) {
        w.u8(u8::from(shared));
        w.u8(self.codec.byte());
        w.u8(BLOB_INTEGRITY_WIDTH);
        w.u64(self.disk_addr);
        w.u16(self.csums.len() as u16);
        w.u32(self.encoded_len);
        w.u32(self.logical);
        w.u32(self.window_offset);
        w.u32(self.window_len);
        w.u64(self.nonce);
        for c in &self.csums {
            w.u32(*c);
        }
    }

    /// Decodes the fields after the kind byte; returns the blob and its shared flag.
    fn decode(r: &mut Reader<'_>) -> Result<(Blob, bool), FormatError> {
        let flags = r.u8()?;
        if flags & !1 != 0 {
            return Err(FormatError::invalid("blob extent flags", flags, "0 or 1"));
        }
        let codec_byte = r.u8()?;
        let codec = Codec::from_byte(codec_byte)
            .ok_or_else(|| FormatError::invalid("blob codec", codec_byte, "0, 1 or 2"))?;
        let width = r.u8()?;
        if width != BLOB_INTEGRITY_WIDTH {
            return Err(FormatError::invalid(
                "blob integrity width",
                width,
                BLOB_INTEGRITY_WIDTH,
            ));
        }
        let disk_addr = r.u64()?;
        let stored = u64::from(r.u16()?);
        let encoded_len = r.u32()?;
        let logical = r.u32()?;
        let window_offset = r.u32()?;
        let window_len = r.u32()?;
        let nonce = r.u64()?;
        let bad = |what: &'static str, value: String, want: String| {
            Err(FormatError::invalid(what, value, want))
        };
        if disk_addr == 0 || disk_addr % BLOCK_SIZE != 0 {
            return bad(
                "blob address",
                format!("{disk_addr:#x}"),
                "non-zero, block aligned".into(),
            );
        }
        let logical64 = u64::from(logical);
        if logical64 == 0 || logical64 % BLOCK_SIZE != 0 || logical64 > BLOB_MAX_LOGICAL {
            return bad(
                "blob logical bytes",
                logical.to_string(),
                format!("a multiple of {BLOCK_SIZE} in {BLOCK_SIZE}..={BLOB_MAX_LOGICAL}"),
            );
        }
        if stored == 0 || stored > logical64 / BLOCK_SIZE {
            return bad(
                "blob stored blocks",
                stored.to_string(),
                format!("1..={}", logical64 / BLOCK_SIZE),
            );
        }
        let encoded = u64::from(encoded_len);
        let fits = (stored - 1) * BLOCK_SIZE < encoded && encoded <= stored * BLOCK_SIZE;
        if !fits || (codec == Codec::None && encoded != logical64) {
            return bad(
                "blob encoded length",
                format!("{encoded_len} in {stored} blocks, codec {codec_byte}"),
                "more than the blocks before the last, at most all of them (= logical for codec 0)"
                    .into(),
            );
        }
        let (off, len) = (u64::from(window_offset), u64::from(window_len));
        if off % BLOCK_SIZE != 0 || len == 0 || len % BLOCK_SIZE != 0 || off + len > logical64 {
            return bad(
                "blob window",
                format!("{off}+{len} of {logical}"),
                "block multiples, non-empty, inside the logical bytes".into(),
            );
        }
        let mut csums = Vec::with_capacity(stored as usize);
        for _ in 0..stored {
            csums.push(r.u32()?);
        }
        Ok((
            Blob {
                disk_addr,
                codec,
                encoded_len,
                logical,
                window_offset,
                window_len,
                nonce,
                csums,
            },
            flags & 1 == 1,
        ))
    }
}

impl ExtentKind {
    /// Whether an extent of this kind may be flagged shared (FORMAT.md §6.6: only a regular
    /// extent, stored as kind 3). A piece cut from a shared extent is shared only if this holds
    /// for the piece's kind. Exhaustive: a new kind decides here.
    pub fn may_be_shared(&self) -> bool {
        match self {
            ExtentKind::Regular { .. } | ExtentKind::Blob(_) => true,
            ExtentKind::Inline(_) | ExtentKind::Prealloc { .. } => false,
        }
    }
}

/// `(ino, ExtentData, file_offset)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileExtent {
    /// Generation the extent was written in.
    pub generation: u64,
    /// Where the bytes are: inline, regular blocks or preallocated blocks.
    pub kind: ExtentKind,
    /// Shared (regular and blob extents only): its blocks may be named by other flagged
    /// extents too (a clone made by `copy_file_range`), stored as kind 3 (FORMAT.md §6.6,
    /// incompat flag `INCOMPAT_SHARED_EXTENTS`), or a blob's flag bit 0 (DESIGN §16.5). A
    /// piece cut from a shared extent stays shared.
    pub shared: bool,
}

impl FileExtent {
    /// Bytes of the file this extent covers.
    pub fn len_bytes(&self) -> u64 {
        match &self.kind {
            ExtentKind::Inline(data) => data.len() as u64,
            ExtentKind::Regular { csums, .. } => csums.len() as u64 * BLOCK_SIZE,
            ExtentKind::Prealloc { blocks, .. } => blocks * BLOCK_SIZE,
            ExtentKind::Blob(blob) => u64::from(blob.window_len),
        }
    }

    /// Disk range `(addr, blocks)` if the extent holds blocks.
    pub fn disk_range(&self) -> Option<(u64, u64)> {
        match &self.kind {
            ExtentKind::Inline(_) => None,
            ExtentKind::Regular { disk_addr, csums } => Some((*disk_addr, csums.len() as u64)),
            ExtentKind::Prealloc { disk_addr, blocks } => Some((*disk_addr, *blocks)),
            ExtentKind::Blob(blob) => Some((blob.disk_addr, blob.stored_blocks())),
        }
    }

    /// Encodes the payload: 13 + len bytes inline, 21 + 4 x blocks regular (shared or not),
    /// 25 prealloc, 46 + 4 x stored blocks a blob.
    pub fn encode(&self) -> Vec<u8> {
        debug_assert!(
            !self.shared || self.kind.may_be_shared(),
            "only a regular or blob extent is shared"
        );
        let mut w = Writer::default();
        w.u64(self.generation);
        match &self.kind {
            ExtentKind::Inline(data) => {
                w.u8(0);
                w.u32(data.len() as u32);
                w.put(data);
            }
            ExtentKind::Regular { disk_addr, csums } => {
                w.u8(if self.shared { 3 } else { 1 });
                w.u64(*disk_addr);
                w.u32(csums.len() as u32);
                for c in csums {
                    w.u32(*c);
                }
            }
            ExtentKind::Prealloc { disk_addr, blocks } => {
                w.u8(2);
                w.u64(*disk_addr);
                w.u64(*blocks);
            }
            ExtentKind::Blob(blob) => {
                w.u8(4);
                blob.encode(self.shared, &mut w);
            }
        }
        w.into_bytes()
    }

    /// Decodes an extent payload. `Invalid` for an unknown kind, an inline length over
    /// [`INLINE_MAX_BYTES`], a zero or unaligned address, a block count outside
    /// 1 ..= [`EXTENT_MAX_BLOCKS`], or trailing bytes; `Truncated` if the payload is cut short.
    /// A blob (kind 4) gets every range check of FORMAT.md §6.6.
    pub fn decode(bytes: &[u8]) -> Result<FileExtent, FormatError> {
        let mut r = Reader::new(bytes, "file extent");
        let generation = r.u64()?;
        let kind_byte = r.u8()?;
        let mut shared = kind_byte == 3;
        let kind = match kind_byte {
            0 => {
                let len = r.u32()? as usize;
                if len > INLINE_MAX_BYTES {
                    return Err(FormatError::invalid(
                        "inline extent length",
                        len,
                        format!("<= {INLINE_MAX_BYTES}"),
                    ));
                }
                ExtentKind::Inline(r.take(len)?.to_vec())
            }
            1 | 3 => {
                let disk_addr = r.u64()?;
                let blocks = u64::from(r.u32()?);
                if blocks == 0
                    || blocks > EXTENT_MAX_BLOCKS
                    || disk_addr == 0
                    || disk_addr % BLOCK_SIZE != 0
                {
                    return Err(FormatError::invalid(
                        "regular extent",
                        format!("{disk_addr:#x} x {blocks} blocks"),
                        format!("an aligned address and 1..={EXTENT_MAX_BLOCKS} blocks"),
                    ));
                }
                let mut csums = Vec::with_capacity(blocks as usize);
                for _ in 0..blocks {
                    csums.push(r.u32()?);
                }
                ExtentKind::Regular { disk_addr, csums }
            }
            2 => {
                let disk_addr = r.u64()?;
                let blocks = r.u64()?;
                if blocks == 0
                    || blocks > EXTENT_MAX_BLOCKS
                    || disk_addr == 0
                    || disk_addr % BLOCK_SIZE != 0
                {
                    return Err(FormatError::invalid(
                        "prealloc extent",
                        format!("{disk_addr:#x} x {blocks} blocks"),
                        format!("an aligned address and 1..={EXTENT_MAX_BLOCKS} blocks"),
                    ));
                }
                ExtentKind::Prealloc { disk_addr, blocks }
            }
            4 => {
                let (blob, flagged) = Blob::decode(&mut r)?;
                shared = flagged;
                ExtentKind::Blob(blob)
            }
            other => return Err(FormatError::invalid("extent kind", other, "0 ..= 4")),
        };
        if r.remaining() != 0 {
            return Err(FormatError::invalid(
                "file extent trailing bytes",
                r.remaining(),
                0,
            ));
        }
        Ok(FileExtent {
            generation,
            kind,
            shared,
        })
    }
}

/// Encodes a list of inode refs.
pub fn encode_inode_refs(refs: &[InodeRef]) -> Vec<u8> {
    let mut w = Writer::default();
    for r in refs {
        w.u64(r.parent);
        w.u64(r.dir_index);
        encode_name(&mut w, &r.name);
    }
    w.into_bytes()
}

/// Decodes an inode ref payload: one or more entries back to back. `Invalid` for a name
/// length outside 1 ..= [`NAME_MAX`] or an empty payload; `Truncated` for a cut entry.
pub fn decode_inode_refs(bytes: &[u8]) -> Result<Vec<InodeRef>, FormatError> {
    let mut r = Reader::new(bytes, "inode ref");
    let mut out = Vec::new();
    while r.remaining() > 0 {
        out.push(InodeRef {
            parent: r.u64()?,
            dir_index: r.u64()?,
            name: decode_name(&mut r)?,
        });
    }
    if out.is_empty() {
        return Err(FormatError::invalid(
            "inode ref",
            "no entries",
            "at least one",
        ));
    }
    Ok(out)
}

/// Encodes a list of dir entries (a dir item) or one (a dir index).
pub fn encode_dir_entries(entries: &[DirEntry]) -> Vec<u8> {
    let mut w = Writer::default();
    for e in entries {
        w.u64(e.child);
        w.u64(e.dir_index);
        w.u8(e.file_type);
        encode_name(&mut w, &e.name);
    }
    w.into_bytes()
}

/// Decodes a dir item payload: one or more entries back to back. `Invalid` for a name length
/// outside 1 ..= [`NAME_MAX`] or an empty payload; `Truncated` for a cut entry. The file type
/// is not checked.
pub fn decode_dir_entries(bytes: &[u8]) -> Result<Vec<DirEntry>, FormatError> {
    let mut r = Reader::new(bytes, "dir entry");
    let mut out = Vec::new();
    while r.remaining() > 0 {
        out.push(DirEntry {
            child: r.u64()?,
            dir_index: r.u64()?,
            file_type: r.u8()?,
            name: decode_name(&mut r)?,
        });
    }
    if out.is_empty() {
        return Err(FormatError::invalid(
            "dir entry",
            "no entries",
            "at least one",
        ));
    }
    Ok(out)
}

/// Encodes a list of xattrs, back to back: name, u16 value length, value; or for a value
/// stored out of line: name, u16 `0xFFFF`, u32 size, u32 crc32c.
pub fn encode_xattrs(xattrs: &[Xattr]) -> Vec<u8> {
    let mut w = Writer::default();
    for x in xattrs {
        encode_name(&mut w, &x.name);
        match x.spill {
            Some(spill) => {
                w.u16(XATTR_SPILL_MARK);
                w.u32(spill.size);
                w.u32(spill.crc);
            }
            None => {
                w.u16(x.value.len() as u16);
                w.put(&x.value);
            }
        }
    }
    w.into_bytes()
}

/// Decodes an xattr payload: one or more entries back to back. `Invalid` for a name length
/// outside 1 ..= [`NAME_MAX`], a value over [`XATTR_VALUE_MAX`] or an empty payload;
/// `Truncated` for a cut entry.
pub fn decode_xattrs(bytes: &[u8]) -> Result<Vec<Xattr>, FormatError> {
    let mut r = Reader::new(bytes, "xattr");
    let mut out = Vec::new();
    while r.remaining() > 0 {
        let name = decode_name(&mut r)?;
        let len = r.u16()?;
        if len == XATTR_SPILL_MARK {
            let size = r.u32()?;
            if (size as usize) <= XATTR_VALUE_MAX || size as usize > XATTR_SIZE_MAX {
                return Err(FormatError::invalid(
                    "out-of-line xattr size",
                    size,
                    format!("{}..={XATTR_SIZE_MAX}", XATTR_VALUE_MAX + 1),
                ));
            }
            let crc = r.u32()?;
            out.push(Xattr {
                name,
                value: Vec::new(),
                spill: Some(XattrSpill { size, crc }),
            });
            continue;
        }
        let len = usize::from(len);
        if len > XATTR_VALUE_MAX {
            return Err(FormatError::invalid(
                "xattr value length",
                len,
                format!("<= {XATTR_VALUE_MAX}"),
            ));
        }
        out.push(Xattr {
            name,
            value: r.take(len)?.to_vec(),
            spill: None,
        });
    }
    if out.is_empty() {
        return Err(FormatError::invalid(
            "xattr item",
            "no entries",
            "at least one",
        ));
    }
    Ok(out)
}

/// Any item, decoded by its key type. Used by printers and checkers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    /// An [`ItemType::InodeItem`] payload.
    Inode(InodeItem),
    /// An [`ItemType::InodeRef`] payload: one or more names (several only on a hash collision).
    InodeRefs(Vec<InodeRef>),
    /// An [`ItemType::DirItem`] payload: one or more entries (several only on a hash collision).
    DirItem(Vec<DirEntry>),
    /// An [`ItemType::DirIndex`] payload: exactly one entry.
    DirIndex(DirEntry),
    /// An [`ItemType::Xattr`] payload: one or more xattrs.
    Xattrs(Vec<Xattr>),
    /// An [`ItemType::XattrChunk`] payload: one chunk of an out-of-line value.
    XattrChunk(XattrChunk),
    /// An [`ItemType::ExtentData`] payload.
    Extent(FileExtent),
    /// An [`ItemType::Orphan`] item; its payload is empty.
    Orphan,
    /// An [`ItemType::Snapshot`] payload (snapshot list tree only).
    Snapshot(SnapshotItem),
}

impl Item {
    /// Decodes a payload of the given type, with that type's errors; also `Invalid` for a
    /// dir index that is not exactly one entry or an orphan with a non-empty payload.
    pub fn decode(kind: ItemType, bytes: &[u8]) -> Result<Item, FormatError> {
        Ok(match kind {
            ItemType::InodeItem => Item::Inode(InodeItem::decode(bytes)?),
            ItemType::InodeRef => Item::InodeRefs(decode_inode_refs(bytes)?),
            ItemType::DirItem => Item::DirItem(decode_dir_entries(bytes)?),
            ItemType::DirIndex => {
                let mut entries = decode_dir_entries(bytes)?;
                if entries.len() != 1 {
                    return Err(FormatError::invalid("dir index entries", entries.len(), 1));
                }
                Item::DirIndex(entries.remove(0))
            }
            ItemType::Xattr => Item::Xattrs(decode_xattrs(bytes)?),
            ItemType::XattrChunk => Item::XattrChunk(XattrChunk::decode(bytes)?),
            ItemType::ExtentData => Item::Extent(FileExtent::decode(bytes)?),
            ItemType::Orphan => {
                if !bytes.is_empty() {
                    return Err(FormatError::invalid("orphan item size", bytes.len(), 0));
                }
                Item::Orphan
            }
            ItemType::Snapshot => Item::Snapshot(SnapshotItem::decode(bytes)?),
        })
    }
}

fn show_name(name: &[u8]) -> String {
    String::from_utf8_lossy(name).into_owned()
}

impl fmt::Display for Item {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Item::Inode(i) => write!(
                f,
                "inode mode {:o} nlink {} uid {} gid {} size {} nbytes {} rdev {} generation {} transid {} next_index {} atime {}.{:09} mtime {}.{:09} ctime {}.{:09}",
                i.mode, i.nlink, i.uid, i.gid, i.size, i.nbytes, i.rdev, i.generation, i.transid, i.next_dir_index, i.atime.sec, i.atime.nsec, i.mtime.sec, i.mtime.nsec, i.ctime.sec, i.ctime.nsec
            ),
            Item::InodeRefs(refs) => {
                for (n, r) in refs.iter().enumerate() {
                    if n > 0 {
                        f.write_str("; ")?;
                    }
                    write!(f, "ref parent {} index {} name {:?}", r.parent, r.dir_index, show_name(&r.name))?;
                }
                Ok(())
            }
            Item::DirItem(entries) => {
                for (n, e) in entries.iter().enumerate() {
                    if n > 0 {
                        f.write_str("; ")?;
                    }
                    write!(f, "entry {:?} -> {} type {} index {}", show_name(&e.name), e.child, e.file_type, e.dir_index)?;
                }
                Ok(())
            }
            Item::DirIndex(e) => write!(f, "index {} -> {} {:?} type {}", e.dir_index, e.child, show_name(&e.name), e.file_type),
            Item::Xattrs(xs) => {
                for (n, x) in xs.iter().enumerate() {
                    if n > 0 {
                        f.write_str("; ")?;
                    }
                    match x.spill {
                        Some(s) => write!(f, "xattr {:?} ({} bytes out of line in {} chunks, crc {:#010x})", show_name(&x.name), s.size, s.chunks(), s.crc)?,
                        None => write!(f, "xattr {:?} ({} bytes)", show_name(&x.name), x.value.len())?,
                    }
                }
                Ok(())
            }
            Item::XattrChunk(c) => write!(f, "xattr chunk {} of {:?} ({} bytes)", c.index, show_name(&c.name), c.data.len()),
            Item::Extent(e) => match &e.kind {
                ExtentKind::Inline(data) => write!(f, "extent inline {} bytes generation {}", data.len(), e.generation),
                ExtentKind::Regular { disk_addr, csums } => write!(f, "extent regular{} disk {:#x} blocks {} generation {}", if e.shared { " shared" } else { "" }, disk_addr, csums.len(), e.generation),
                ExtentKind::Prealloc { disk_addr, blocks } => write!(f, "extent prealloc disk {:#x} blocks {} generation {}", disk_addr, blocks, e.generation),
                ExtentKind::Blob(b) => write!(f, "extent blob{} disk {:#x} stored {} encoded {} logical {} codec {} window {}+{} generation {}", if e.shared { " shared" } else { "" }, b.disk_addr, b.csums.len(), b.encoded_len, b.logical, b.codec.byte(), b.window_offset, b.window_len, e.generation),
            },
            Item::Orphan => f.write_str("orphan"),
            Item::Snapshot(s) => write!(f, "snapshot {:?} generation {} root {:#x} generation {} level {} created {}.{:09}", show_name(&s.name), s.generation, s.root.addr, s.root.generation, s.root.level, s.created.sec, s.created.nsec),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot_item() -> SnapshotItem {
        SnapshotItem {
            generation: 9,
            root: crate::superblock::RootPtr {
                addr: 0x40000,
                generation: 8,
                level: 1,
            },
            created: Timespec { sec: 5, nsec: 6 },
            name: b"daily".to_vec(),
        }
    }

    #[test]
    fn snapshot_item_round_trips_at_its_offsets() {
        let item = snapshot_item();
        let bytes = item.encode();
        assert_eq!(bytes.len(), SNAPSHOT_ITEM_FIXED_BYTES + 2 + 5);
        assert_eq!(bytes[0], 9);
        assert_eq!(&bytes[8..16], &0x40000u64.to_le_bytes());
        assert_eq!(bytes[24], 1);
        assert_eq!(&bytes[48..50], &5u16.to_le_bytes());
        assert_eq!(SnapshotItem::decode(&bytes), Ok(item));
    }

    #[test]
    fn bad_snapshot_items_are_refused() {
        let mut item = snapshot_item();
        item.root.generation = 10;
        assert!(SnapshotItem::decode(&item.encode()).is_err());
        let mut item = snapshot_item();
        item.name = b"a/b".to_vec();
        assert!(SnapshotItem::decode(&item.encode()).is_err());
        let mut item = snapshot_item();
        item.root.addr = 0x40001;
        assert!(SnapshotItem::decode(&item.encode()).is_err());
        let mut bytes = snapshot_item().encode();
        bytes.push(0);
        assert!(SnapshotItem::decode(&bytes).is_err());
        let bytes = snapshot_item().encode();
        for cut in 0..bytes.len() {
            assert!(SnapshotItem::decode(&bytes[..cut]).is_err());
        }
    }

    #[test]
    fn inode_round_trip() {
        let item = InodeItem {
            size: 5,
            nlink: 2,
            mode: 0o100644,
            atime: Timespec {
                sec: -3,
                nsec: 999_999_999,
            },
            next_dir_index: 7,
            ..Default::default()
        };
        assert_eq!(InodeItem::decode(&item.encode()), Ok(item));
    }

    #[test]
    fn extent_round_trip() {
        for kind in [
            ExtentKind::Inline(b"hello".to_vec()),
            ExtentKind::Regular {
                disk_addr: 0x20000,
                csums: vec![1, 2, 3],
            },
            ExtentKind::Prealloc {
                disk_addr: 0x30000,
                blocks: 9,
            },
        ] {
            let e = FileExtent {
                generation: 4,
                kind,
                shared: false,
            };
            assert_eq!(FileExtent::decode(&e.encode()), Ok(e));
        }
    }

    /// A shared regular extent is kind 3 with kind 1's layout, byte for byte.
    #[test]
    fn shared_extent_is_kind_3() {
        let mut e = FileExtent {
            generation: 7,
            kind: ExtentKind::Regular {
                disk_addr: 0x20000,
                csums: vec![0xdead_beef, 2],
            },
            shared: false,
        };
        let plain = e.encode();
        e.shared = true;
        let shared = e.encode();
        assert_eq!(plain[8], 1);
        assert_eq!(shared[8], 3);
        assert_eq!(plain[..8], shared[..8]);
        assert_eq!(plain[9..], shared[9..]);
        assert_eq!(FileExtent::decode(&shared), Ok(e));
        let mut bad = shared.clone();
        bad[8] = 5;
        assert!(FileExtent::decode(&bad).is_err());
    }

    fn blob(stored: usize, logical_blocks: u32, window: (u32, u32)) -> Blob {
        Blob {
            disk_addr: 0x40000,
            codec: Codec::Zstd(0),
            encoded_len: stored as u32 * 4096 - 100,
            logical: logical_blocks * 4096,
            window_offset: window.0 * 4096,
            window_len: window.1 * 4096,
            nonce: 0,
            csums: (0..stored as u32).map(|i| 0x1000 + i).collect(),
        }
    }

    /// A blob item round-trips, flagged or not, byte for byte as FORMAT.md §6.6's table says.
    #[test]
    fn blob_layout_and_round_trip() {
        for shared in [false, true] {
            let e = FileExtent {
                generation: 0x0102_0304_0506_0708,
                kind: ExtentKind::Blob(blob(3, 8, (2, 5))),
                shared,
            };
            let bytes = e.encode();
            assert_eq!(bytes.len(), BLOB_FIXED_BYTES + 3 * 4);
            assert_eq!(bytes[0..8], 0x0102_0304_0506_0708u64.to_le_bytes());
            assert_eq!(bytes[8], 4, "kind");
            assert_eq!(bytes[9], u8::from(shared), "flags");
            assert_eq!(bytes[10], 1, "codec zstd");
            assert_eq!(bytes[11], 4, "integrity width");
            assert_eq!(bytes[12..20], 0x40000u64.to_le_bytes());
            assert_eq!(bytes[20..22], 3u16.to_le_bytes());
            assert_eq!(bytes[22..26], (3u32 * 4096 - 100).to_le_bytes());
            assert_eq!(bytes[26..30], (8u32 * 4096).to_le_bytes());
            assert_eq!(bytes[30..34], (2u32 * 4096).to_le_bytes());
            assert_eq!(bytes[34..38], (5u32 * 4096).to_le_bytes());
            assert_eq!(bytes[38..46], [0u8; 8]);
            assert_eq!(bytes[46..50], 0x1000u32.to_le_bytes());
            assert_eq!(FileExtent::decode(&bytes), Ok(e.clone()));
            assert_eq!(e.len_bytes(), 5 * 4096);
            assert_eq!(e.disk_range(), Some((0x40000, 3)));
            assert!(e.kind.may_be_shared());
        }
        // The longest blob item fits in an item with room to spare.
        let longest = FileExtent {
            generation: 1,
            kind: ExtentKind::Blob(Blob {
                codec: Codec::None,
                encoded_len: BLOB_MAX_LOGICAL as u32,
                ..blob(256, 256, (0, 256))
            }),
            shared: true,
        };
        let bytes = longest.encode();
        assert!(bytes.len() <= crate::MAX_ITEM_BYTES);
        assert_eq!(FileExtent::decode(&bytes), Ok(longest));
    }

    /// Every field out of range is refused, never accepted or a panic.
    #[test]
    fn blob_fields_out_of_range_are_refused() {
        let good = FileExtent {
            generation: 9,
            kind: ExtentKind::Blob(blob(2, 4, (1, 2))),
            shared: false,
        }
        .encode();
        assert!(FileExtent::decode(&good).is_ok());
        let patch = |at: usize, value: &[u8]| {
            let mut b = good.clone();
            b[at..at + value.len()].copy_from_slice(value);
            b
        };
        let bad: Vec<(&str, Vec<u8>)> = vec![
            ("flag bit 1", patch(9, &[2])),
            ("codec 3", patch(10, &[3])),
            ("width 16", patch(11, &[16])),
            ("address 0", patch(12, &0u64.to_le_bytes())),
            ("unaligned address", patch(12, &0x40001u64.to_le_bytes())),
            ("no stored blocks", patch(20, &0u16.to_le_bytes())),
            ("more stored than logical", patch(20, &5u16.to_le_bytes())),
            (
                "encoded fills a block less",
                patch(22, &4096u32.to_le_bytes()),
            ),
            ("encoded over the blocks", patch(22, &8193u32.to_le_bytes())),
            ("codec none, encoded not logical", patch(10, &[0])),
            ("logical 0", patch(26, &0u32.to_le_bytes())),
            ("logical unaligned", patch(26, &16385u32.to_le_bytes())),
            (
                "logical over the cap",
                patch(26, &(BLOB_MAX_LOGICAL as u32 + 4096).to_le_bytes()),
            ),
            ("window offset unaligned", patch(30, &4097u32.to_le_bytes())),
            ("window empty", patch(34, &0u32.to_le_bytes())),
            ("window unaligned", patch(34, &5000u32.to_le_bytes())),
            (
                "window past logical",
                patch(34, &(4u32 * 4096).to_le_bytes()),
            ),
            ("trailing byte", [good.clone(), vec![0]].concat()),
            ("cut short", good[..good.len() - 1].to_vec()),
            ("cut in the fixed fields", good[..30].to_vec()),
        ];
        for (what, bytes) in bad {
            assert!(FileExtent::decode(&bytes).is_err(), "{what} accepted");
        }
    }

    #[test]
    fn lists_round_trip() {
        let refs = vec![
            InodeRef {
                parent: 1,
                dir_index: 2,
                name: b"a".to_vec(),
            },
            InodeRef {
                parent: 3,
                dir_index: 4,
                name: vec![b'x'; 255],
            },
        ];
        assert_eq!(decode_inode_refs(&encode_inode_refs(&refs)), Ok(refs));
        let entries = vec![DirEntry {
            child: 300,
            dir_index: 9,
            file_type: 8,
            name: b"f".to_vec(),
        }];
        assert_eq!(
            decode_dir_entries(&encode_dir_entries(&entries)),
            Ok(entries)
        );
        let xs = vec![
            Xattr {
                name: b"user.a".to_vec(),
                value: vec![0; 7168],
                spill: None,
            },
            Xattr {
                name: b"user.big".to_vec(),
                value: Vec::new(),
                spill: Some(XattrSpill {
                    size: 65536,
                    crc: 0xdead_beef,
                }),
            },
        ];
        assert_eq!(decode_xattrs(&encode_xattrs(&xs)), Ok(xs.clone()));
        // Byte by byte (FORMAT.md §6.5): name, 0xFFFF, size, crc.
        let spilled = encode_xattrs(&xs[1..]);
        assert_eq!(
            spilled,
            [
                &[8u8, 0][..],
                b"user.big",
                &[0xff, 0xff],
                &65536u32.to_le_bytes(),
                &0xdead_beefu32.to_le_bytes()
            ]
            .concat()
        );
        let chunk = XattrChunk {
            name: b"user.big".to_vec(),
            index: 15,
            data: vec![7; 4096],
        };
        assert_eq!(XattrChunk::decode(&chunk.encode()), Ok(chunk.clone()));
        assert_eq!(chunk.encode().len(), 2 + 8 + 4 + 4096);
        let bad = XattrChunk { index: 16, ..chunk };
        assert!(XattrChunk::decode(&bad.encode()).is_err());
        assert_eq!(XattrSpill { size: 7169, crc: 0 }.chunks(), 2);
    }

    #[test]
    fn garbage_is_an_error() {
        for kind in [
            ItemType::InodeItem,
            ItemType::InodeRef,
            ItemType::DirItem,
            ItemType::DirIndex,
            ItemType::Xattr,
            ItemType::ExtentData,
            ItemType::Orphan,
        ] {
            for len in [1usize, 3, 17, 200] {
                let bytes = vec![0xffu8; len];
                assert!(Item::decode(kind, &bytes).is_err(), "{kind} len {len}");
            }
        }
    }
}
