//! The superblock: two copies at fixed offsets, generation N written to slot N mod 2.

use std::fmt;

use crate::bytes::{Reader, Writer};
use crate::{checksum, hex, FormatError, BLOCK_SIZE, FORMAT_VERSION, NODE_SIZE};

/// "BIRCHFS" + format family byte, at byte 8. Checked before the checksum, so "not birchfs"
/// and "damaged birchfs" are told apart.
pub const SUPER_MAGIC: [u8; 8] = *b"BIRCHFS1";
/// Encoded size of a superblock: one block.
pub const SUPER_BYTES: usize = BLOCK_SIZE as usize;
/// Byte offsets of the two superblock slots. The first 64 KiB are left alone (partition
/// tables, boot code); the slots sit in separate blocks so a torn write hits at most one.
pub const SUPER_OFFSETS: [u64; 2] = [64 * 1024, 68 * 1024];
/// The first byte after the reserved head of the device (superblocks and spare room).
pub const RESERVED_HEAD_BYTES: u64 = 128 * 1024;

/// Feature flags this build understands. An image with an unknown incompat flag is refused;
/// unknown compat flags are ignored; unknown ro_compat flags allow read-only use.
pub const INCOMPAT_SUPPORTED: u64 = INCOMPAT_XATTR_CHUNKS
    | INCOMPAT_LOG_DATA
    | INCOMPAT_SNAPSHOTS
    | INCOMPAT_SHARED_EXTENTS
    | INCOMPAT_LOG_ALIGNED
    | INCOMPAT_BLOB_EXTENTS;
/// Incompat bit 0: xattr values over `XATTR_VALUE_MAX` bytes are stored out of line, in
/// `XattrChunk` items, and an xattr list entry may say so (value length `0xFFFF`). Set by the
/// first commit that holds such a value; an image without one keeps the bit clear.
pub const INCOMPAT_XATTR_CHUNKS: u64 = 1;
/// Incompat bit 1: the fsync log may hold data records (kind 2, FORMAT.md §8.2): file blocks
/// written only in the log until the next commit writes them in place. A build without the
/// bit would stop its replay at the first such record and lose what was fsync'd after it.
/// Set by the first commit after a write asks for it; an fsync logs no data record before the
/// bit is in a durable superblock. Never cleared.
pub const INCOMPAT_LOG_DATA: u64 = 2;
/// Incompat bit 2: the image has (or had) snapshots: the superblock names a snapshot list
/// tree (bytes 336 .. 368, FORMAT.md §3.2) whose snapshots' trees share blocks with the fs
/// tree. A build without the bit would take the blocks only a snapshot holds for free space
/// and overwrite them, so it must refuse the image. Set by the commit that makes the first
/// snapshot; never cleared (the snapshot id counter lives beside the list).
pub const INCOMPAT_SNAPSHOTS: u64 = 4;
/// Incompat bit 3: file extents may be *shared* (kind 3, FORMAT.md §6.6): several flagged
/// extent items name the same data blocks (a clone made by `copy_file_range`). A build
/// without the bit would refuse kind 3 item by item, or free a shared block while another
/// extent still names it, so it must refuse the image. Set by the first commit that records
/// a shared extent; never cleared. An image without it is byte for byte what earlier builds
/// write.
pub const INCOMPAT_SHARED_EXTENTS: u64 = 8;
/// Incompat bit 4: a log batch may start at a boundary of the device's atomic unit rather
/// than right after the batch before it (FORMAT.md §8.4): on an RBD image the writer never
/// lets a batch that fits in one RADOS object cross an object boundary, and skips to the
/// next boundary instead. Replay that finds no batch where the previous one ended tries the
/// next power-of-two boundaries (16 KiB and up) of the lap. A build without the bit would
/// stop its replay at the first skip and lose what was fsync'd after it. Set by the first
/// commit of a writable mount on a device with an atomic unit (RBD); the log skips only
/// once it is in a durable superblock. Never cleared.
pub const INCOMPAT_LOG_ALIGNED: u64 = 16;
/// Incompat bit 5: file extents may be blob windows (kind 4, FORMAT.md §6.6): stored blocks
/// that decode (zstd, lz4, or as they are) to more bytes than one item covers, several items
/// naming one blob when flagged. A build without the bit would refuse kind 4 item by item, so
/// it must refuse the image. Set by the first commit that records a blob; never cleared. An
/// image without it is byte for byte what earlier builds write.
pub const INCOMPAT_BLOB_EXTENTS: u64 = 32;
/// Byte offset of the snapshot list fields in the superblock (with [`INCOMPAT_SNAPSHOTS`]).
pub const SNAPSHOTS_OFFSET: usize = 336;
/// Compatible feature flags this build understands. Unknown bits are ignored.
pub const COMPAT_SUPPORTED: u64 = COMPAT_BACKUP_ROOTS | COMPAT_DEVICE_STATS;
/// Compat bit 1: the superblock carries the device's error counts over its lifetime
/// ([`DeviceStats`], bytes 368 .. 400). A build without the bit ignores those bytes and
/// writes them as zero (it keeps the bit: the counts start again from zero). Informational.
pub const COMPAT_DEVICE_STATS: u64 = 2;
/// Byte offset of the device error counts (with [`COMPAT_DEVICE_STATS`]).
pub const DEVICE_STATS_OFFSET: usize = 368;
/// Compat bit 0: the superblock carries [`BACKUP_ROOTS`] backup roots (bytes 240 .. 336) and
/// the trees they name are kept whole (reuse of freed space deferred, DESIGN §13.1). A build
/// without the bit reads those bytes as zero and writes them as zero: it loses the safety
/// net only. Read only when the bit is set, so images from before it open as they did.
pub const COMPAT_BACKUP_ROOTS: u64 = 1;
/// How many older roots each superblock names (K, DESIGN §13.1).
pub const BACKUP_ROOTS: usize = 3;
/// Byte offset of the first backup root entry in the superblock.
pub const BACKUP_ROOTS_OFFSET: usize = 240;
/// Encoded size of one backup root entry.
pub const BACKUP_ROOT_BYTES: usize = 32;
const _: () = assert!(BACKUP_ROOTS_OFFSET + BACKUP_ROOTS * BACKUP_ROOT_BYTES <= SUPER_BYTES);
/// Read-only-compatible feature flags this build understands: none in v1. An unknown bit
/// allows read-only use only; the writable open refuses it ([`Superblock::validate`] does not).
pub const RO_COMPAT_SUPPORTED: u64 = 0;

/// Pointer to a tree root.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RootPtr {
    /// Byte address of the root node.
    pub addr: u64,
    /// Generation the root node was written in; the node's header must agree.
    pub generation: u64,
    /// Level of the root node (0 = leaf).
    pub level: u8,
}

/// An older commit's root, kept whole for a fallback (`fsck --repair`, DESIGN §13).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BackupRoot {
    /// Generation of the commit (its superblock's generation).
    pub generation: u64,
    /// That commit's fs tree root.
    pub fs_root: RootPtr,
}

/// Generations stay below this (2^63), so that adding to one never wraps.
pub const GENERATION_LIMIT: u64 = 1 << 63;

/// Log positions (`log_head`) and the log area's size stay below this (2^62 bytes), so that
/// adding laps and lengths to them never wraps.
pub const LSN_LIMIT: u64 = 1 << 62;

/// Errors of the device over the filesystem's life (since mkfs, or since they were last
/// reset), as of a commit: what `btrfs device stats` keeps. Informational: nothing reads
/// them to decide anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceStats {
    /// Reads the device failed.
    pub read_errors: u64,
    /// Writes the device failed.
    pub write_errors: u64,
    /// Flushes the device failed.
    pub flush_errors: u64,
    /// Blocks (data or node) read whole whose checksum did not match.
    pub checksum_errors: u64,
}

/// The decoded superblock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    /// Format version; decoding refuses anything but [`FORMAT_VERSION`] (`BadVersion`).
    pub version: u32,
    /// Block size in bytes; must be [`BLOCK_SIZE`] (4096).
    pub block_size: u32,
    /// Node size in bytes; must be [`NODE_SIZE`] (16384).
    pub node_size: u32,
    /// Filesystem id, random at mkfs; every node header and log batch repeats it.
    pub fsid: [u8; 16],
    /// Volume label, UTF-8 in a 64-byte NUL-padded field: at most 63 bytes are stored
    /// (longer labels are cut); read up to the first NUL.
    pub label: String,
    /// Generation of the commit this superblock describes.
    pub generation: u64,
    /// Incompatible feature flags; a bit outside [`INCOMPAT_SUPPORTED`] is refused
    /// (`UnknownIncompat`).
    pub incompat: u64,
    /// Compatible feature flags; unknown bits are ignored.
    pub compat: u64,
    /// Read-only-compatible feature flags; an unknown bit allows read-only use only.
    pub ro_compat: u64,
    /// Size of the filesystem in bytes (a multiple of the block size).
    pub total_bytes: u64,
    /// Blocks in use at this commit x [`BLOCK_SIZE`], pinned space included. Informational.
    pub bytes_used: u64,
    /// The fs tree, holding every inode, name, extent and xattr.
    pub fs_root: RootPtr,
    /// Next object id never handed out. Ids are never reused; replay raises it.
    pub next_objectid: u64,
    /// The fsync log area: a fixed region reserved at mkfs.
    pub log_start: u64,
    /// Size of the log area in bytes (mkfs rounds it down to a block); 0 means no log area.
    /// When non-zero, `log_start + log_bytes` must not pass `total_bytes`.
    pub log_bytes: u64,
    /// The lsn (byte position in the endless circular log) of the first batch this commit did
    /// not retire; replay starts here. Batches before it are covered by this commit.
    pub log_head: u64,
    /// The sequence number the batch at `log_head` must carry; a stale batch from an earlier
    /// lap carries another and ends replay.
    pub log_generation: u64,
    /// Wall-clock time of the commit, seconds since the Unix epoch (signed).
    pub commit_time_sec: i64,
    /// Nanoseconds of the commit time (not range-checked on decode).
    pub commit_time_nsec: u32,
    /// Roots of older commits, newest first, at most [`BACKUP_ROOTS`]; stored only with
    /// [`COMPAT_BACKUP_ROOTS`] (empty otherwise). Each names a generation below `generation`.
    pub backup_roots: Vec<BackupRoot>,
    /// Root of the snapshot list tree (owner [`crate::SNAPSHOT_TREE_ID`]); address 0 when no
    /// snapshot exists. Stored only with [`INCOMPAT_SNAPSHOTS`] (zero otherwise).
    pub snapshots: RootPtr,
    /// The id the next snapshot gets; ids are never reused. Stored only with
    /// [`INCOMPAT_SNAPSHOTS`] (0 otherwise; the first snapshot gets 1).
    pub next_snapshot_id: u64,
    /// The device's error counts; stored only with [`COMPAT_DEVICE_STATS`] (zero otherwise).
    pub device_stats: DeviceStats,
}

const LABEL_BYTES: usize = 64;

impl Superblock {
    /// Slot this superblock belongs in.
    pub fn slot(&self) -> usize {
        (self.generation % 2) as usize
    }

    /// Encodes to exactly [`SUPER_BYTES`], checksum first.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(SUPER_BYTES);
        w.u32(0); // checksum, filled below
        w.u32(0);
        w.put(&SUPER_MAGIC);
        w.u32(self.version);
        w.u32(self.block_size);
        w.u32(self.node_size);
        w.u32(0);
        w.put(&self.fsid);
        let mut label = [0u8; LABEL_BYTES];
        let bytes = self.label.as_bytes();
        let len = bytes.len().min(LABEL_BYTES - 1);
        label[..len].copy_from_slice(&bytes[..len]);
        w.put(&label);
        w.u64(self.generation);
        w.u64(self.incompat);
        w.u64(self.compat);
        w.u64(self.ro_compat);
        w.u64(self.total_bytes);
        w.u64(self.bytes_used);
        w.u64(self.fs_root.addr);
        w.u64(self.fs_root.generation);
        w.u8(self.fs_root.level);
        w.zeros(7);
        w.u64(self.next_objectid);
        w.u64(self.log_start);
        w.u64(self.log_bytes);
        w.u64(self.log_head);
        w.u64(self.log_generation);
        w.i64(self.commit_time_sec);
        w.u32(self.commit_time_nsec);
        w.u32(0);
        if self.compat & COMPAT_BACKUP_ROOTS != 0 {
            for backup in self.backup_roots.iter().take(BACKUP_ROOTS) {
                w.u64(backup.generation);
                w.u64(backup.fs_root.addr);
                w.u64(backup.fs_root.generation);
                w.u8(backup.fs_root.level);
                w.zeros(7);
            }
        }
        let mut bytes = w.into_bytes();
        bytes.resize(SUPER_BYTES, 0);
        if self.incompat & INCOMPAT_SNAPSHOTS != 0 {
            let mut w = Writer::with_capacity(32);
            w.u64(self.snapshots.addr);
            w.u64(self.snapshots.generation);
            w.u8(self.snapshots.level);
            w.zeros(7);
            w.u64(self.next_snapshot_id);
            let fields = w.into_bytes();
            bytes[SNAPSHOTS_OFFSET..SNAPSHOTS_OFFSET + fields.len()].copy_from_slice(&fields);
        }
        if self.compat & COMPAT_DEVICE_STATS != 0 {
            let mut w = Writer::with_capacity(32);
            let d = &self.device_stats;
            for count in [
                d.read_errors,
                d.write_errors,
                d.flush_errors,
                d.checksum_errors,
            ] {
                w.u64(count);
            }
            let fields = w.into_bytes();
            bytes[DEVICE_STATS_OFFSET..DEVICE_STATS_OFFSET + fields.len()].copy_from_slice(&fields);
        }
        let sum = checksum(&bytes[4..]);
        bytes[..4].copy_from_slice(&sum.to_le_bytes());
        bytes
    }

    /// Decodes and validates one slot's bytes. `what` names the slot for messages. Errors:
    /// `Truncated` (under [`SUPER_BYTES`]), `BadMagic`, `BadChecksum`, `BadVersion`, then
    /// those of [`Superblock::validate`]. Does not check the slot matches the generation.
    pub fn decode(bytes: &[u8], what: &str) -> Result<Superblock, FormatError> {
        if bytes.len() < SUPER_BYTES {
            return Err(FormatError::Truncated {
                what: what.to_string(),
                need: SUPER_BYTES,
                have: bytes.len(),
            });
        }
        let bytes = &bytes[..SUPER_BYTES];
        let mut r = Reader::new(bytes, "superblock");
        let stored = r.u32()?;
        r.skip(4)?;
        let magic: [u8; 8] = r.array()?;
        if magic != SUPER_MAGIC {
            return Err(FormatError::BadMagic {
                what: what.to_string(),
                found: magic.to_vec(),
            });
        }
        let computed = checksum(&bytes[4..]);
        if stored != computed {
            return Err(FormatError::BadChecksum {
                what: what.to_string(),
                stored,
                computed,
            });
        }
        let version = r.u32()?;
        if version != FORMAT_VERSION {
            return Err(FormatError::BadVersion {
                what: what.to_string(),
                found: version,
            });
        }
        let block_size = r.u32()?;
        let node_size = r.u32()?;
        r.skip(4)?;
        let fsid: [u8; 16] = r.array()?;
        let label_bytes: [u8; LABEL_BYTES] = r.array()?;
        let label_len = label_bytes
            .iter()
            .position(|b| *b == 0)
            .unwrap_or(LABEL_BYTES);
        let label = String::from_utf8_lossy(&label_bytes[..label_len]).into_owned();
        let mut sb = Superblock {
            version,
            block_size,
            node_size,
            fsid,
            label,
            generation: r.u64()?,
            incompat: r.u64()?,
            compat: r.u64()?,
            ro_compat: r.u64()?,
            total_bytes: r.u64()?,
            bytes_used: r.u64()?,
            fs_root: {
                let addr = r.u64()?;
                let generation = r.u64()?;
                let level = r.u8()?;
                r.skip(7)?;
                RootPtr {
                    addr,
                    generation,
                    level,
                }
            },
            next_objectid: r.u64()?,
            log_start: r.u64()?,
            log_bytes: r.u64()?,
            log_head: r.u64()?,
            log_generation: r.u64()?,
            commit_time_sec: r.i64()?,
            commit_time_nsec: r.u32()?,
            backup_roots: Vec::new(),
            snapshots: RootPtr::default(),
            next_snapshot_id: 0,
            device_stats: DeviceStats::default(),
        };
        if sb.compat & COMPAT_DEVICE_STATS != 0 {
            let mut d = Reader::new(&bytes[DEVICE_STATS_OFFSET..], "superblock device stats");
            sb.device_stats = DeviceStats {
                read_errors: d.u64()?,
                write_errors: d.u64()?,
                flush_errors: d.u64()?,
                checksum_errors: d.u64()?,
            };
        }
        if sb.incompat & INCOMPAT_SNAPSHOTS != 0 {
            let mut s = Reader::new(&bytes[SNAPSHOTS_OFFSET..], "superblock snapshot list");
            sb.snapshots.addr = s.u64()?;
            sb.snapshots.generation = s.u64()?;
            sb.snapshots.level = s.u8()?;
            s.skip(7)?;
            sb.next_snapshot_id = s.u64()?;
        }
        if sb.compat & COMPAT_BACKUP_ROOTS != 0 {
            r.skip(4)?;
            for _ in 0..BACKUP_ROOTS {
                let generation = r.u64()?;
                let addr = r.u64()?;
                let root_generation = r.u64()?;
                let level = r.u8()?;
                r.skip(7)?;
                if generation != 0 {
                    sb.backup_roots.push(BackupRoot {
                        generation,
                        fs_root: RootPtr {
                            addr,
                            generation: root_generation,
                            level,
                        },
                    });
                }
            }
        }
        sb.validate(what)?;
        Ok(sb)
    }

    /// Checks the fields against each other and against what this build supports:
    /// `UnknownIncompat` for unknown incompat bits, `Invalid` for a wrong block or node size,
    /// a bad `total_bytes`, a root pointer outside the device or ahead of `generation`, a root
    /// level >= [`crate::MAX_LEVEL`], or a log area outside the device.
    pub fn validate(&self, what: &str) -> Result<(), FormatError> {
        let unknown = self.incompat & !INCOMPAT_SUPPORTED;
        if unknown != 0 {
            return Err(FormatError::UnknownIncompat { flags: unknown });
        }
        if u64::from(self.block_size) != BLOCK_SIZE {
            return Err(FormatError::invalid(
                format!("{what} block size"),
                self.block_size,
                BLOCK_SIZE,
            ));
        }
        if self.node_size as usize != NODE_SIZE {
            return Err(FormatError::invalid(
                format!("{what} node size"),
                self.node_size,
                NODE_SIZE,
            ));
        }
        if self.total_bytes % BLOCK_SIZE != 0
            || self.total_bytes < RESERVED_HEAD_BYTES + 4 * NODE_SIZE as u64
        {
            return Err(FormatError::invalid(
                format!("{what} total bytes"),
                self.total_bytes,
                "a block multiple of at least 192 KiB",
            ));
        }
        // Every commit adds one, and the engine's arithmetic on generations must not wrap: a
        // re-sealed slot claiming generation u64::MAX opened and then panicked at its first
        // commit ("a tree root from the future"; found by the image_open_walk fuzz target).
        // No image commits 2^63 times.
        if self.generation >= GENERATION_LIMIT {
            return Err(FormatError::invalid(
                format!("{what} generation"),
                self.generation,
                format!("< {GENERATION_LIMIT}"),
            ));
        }
        let root = self.fs_root;
        if root.addr % BLOCK_SIZE != 0
            || root.addr < RESERVED_HEAD_BYTES
            || root.addr.saturating_add(NODE_SIZE as u64) > self.total_bytes
        {
            return Err(FormatError::invalid(
                format!("{what} fs root address"),
                format!("{:#x}", root.addr),
                "a block-aligned address inside the device",
            ));
        }
        if root.generation > self.generation {
            return Err(FormatError::invalid(
                format!("{what} fs root generation"),
                root.generation,
                format!("<= superblock generation {}", self.generation),
            ));
        }
        if root.level >= crate::MAX_LEVEL {
            return Err(FormatError::invalid(
                format!("{what} fs root level"),
                root.level,
                format!("< {}", crate::MAX_LEVEL),
            ));
        }
        if self.backup_roots.len() > BACKUP_ROOTS {
            return Err(FormatError::invalid(
                format!("{what} backup roots"),
                self.backup_roots.len(),
                format!("at most {BACKUP_ROOTS}"),
            ));
        }
        let mut above = self.generation;
        for (i, backup) in self.backup_roots.iter().enumerate() {
            self.validate_backup(what, i, backup, above)?;
            above = backup.generation;
        }
        self.validate_snapshots(what)?;
        // Replay and the log writer add laps and lengths to these: they must not wrap (a
        // re-sealed slot with a log head near u64::MAX overflowed in replay; found by the
        // log_replay fuzz target). No log writes 2^62 bytes or 2^63 batches.
        if self.log_head >= LSN_LIMIT || self.log_bytes >= LSN_LIMIT {
            return Err(FormatError::invalid(
                format!("{what} log head and size"),
                format!("{:#x}, {:#x}", self.log_head, self.log_bytes),
                format!("< {LSN_LIMIT:#x}"),
            ));
        }
        if self.log_generation >= GENERATION_LIMIT {
            return Err(FormatError::invalid(
                format!("{what} log sequence"),
                self.log_generation,
                format!("< {GENERATION_LIMIT}"),
            ));
        }
        let log_end = self.log_start.checked_add(self.log_bytes);
        if self.log_bytes != 0
            && (self.log_start < RESERVED_HEAD_BYTES
                || log_end.is_none_or(|end| end > self.total_bytes))
        {
            return Err(FormatError::invalid(
                format!("{what} log area"),
                format!("{:#x}+{:#x}", self.log_start, self.log_bytes),
                "inside the device",
            ));
        }
        Ok(())
    }
}

impl Superblock {
    /// The snapshot list fields (with [`INCOMPAT_SNAPSHOTS`]): no list (address 0, the rest
    /// zero) or a root inside the device no newer than the superblock, a level below the
    /// limit; an id counter of at least 1.
    fn validate_snapshots(&self, what: &str) -> Result<(), FormatError> {
        if self.incompat & INCOMPAT_SNAPSHOTS == 0 {
            return Ok(());
        }
        let root = self.snapshots;
        if self.next_snapshot_id == 0 {
            return Err(FormatError::invalid(
                format!("{what} next snapshot id"),
                0,
                ">= 1",
            ));
        }
        if root.addr == 0 {
            if root.generation != 0 || root.level != 0 {
                return Err(FormatError::invalid(
                    format!("{what} snapshot list root"),
                    format!("generation {} level {}", root.generation, root.level),
                    "zero with address 0",
                ));
            }
            return Ok(());
        }
        if root.addr % BLOCK_SIZE != 0
            || root.addr < RESERVED_HEAD_BYTES
            || root.addr.saturating_add(NODE_SIZE as u64) > self.total_bytes
        {
            return Err(FormatError::invalid(
                format!("{what} snapshot list address"),
                format!("{:#x}", root.addr),
                "a block-aligned address inside the device",
            ));
        }
        if root.generation > self.generation || root.level >= crate::MAX_LEVEL {
            return Err(FormatError::invalid(
                format!("{what} snapshot list root"),
                format!("generation {} level {}", root.generation, root.level),
                format!(
                    "generation <= {}, level < {}",
                    self.generation,
                    crate::MAX_LEVEL
                ),
            ));
        }
        Ok(())
    }

    /// One backup entry: a generation below the previous entry's (or the superblock's), a
    /// root inside the device no newer than that generation, a level below the limit.
    fn validate_backup(
        &self,
        what: &str,
        index: usize,
        backup: &BackupRoot,
        above: u64,
    ) -> Result<(), FormatError> {
        let root = backup.fs_root;
        let field = format!("{what} backup root {index}");
        if backup.generation >= above {
            return Err(FormatError::invalid(
                format!("{field} generation"),
                backup.generation,
                format!("< {above} (newest first, below the superblock's)"),
            ));
        }
        if root.addr % BLOCK_SIZE != 0
            || root.addr < RESERVED_HEAD_BYTES
            || root.addr.saturating_add(NODE_SIZE as u64) > self.total_bytes
        {
            return Err(FormatError::invalid(
                format!("{field} address"),
                format!("{:#x}", root.addr),
                "a block-aligned address inside the device",
            ));
        }
        if root.generation > backup.generation || root.level >= crate::MAX_LEVEL {
            return Err(FormatError::invalid(
                format!("{field} root"),
                format!("generation {} level {}", root.generation, root.level),
                format!(
                    "generation <= {}, level < {}",
                    backup.generation,
                    crate::MAX_LEVEL
                ),
            ));
        }
        Ok(())
    }
}

impl fmt::Display for Superblock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "superblock (slot {})", self.slot())?;
        writeln!(f, "  version          {}", self.version)?;
        writeln!(f, "  fsid             {}", hex(&self.fsid))?;
        writeln!(f, "  label            {:?}", self.label)?;
        writeln!(f, "  generation       {}", self.generation)?;
        writeln!(
            f,
            "  features         incompat {:#x} compat {:#x} ro_compat {:#x}",
            self.incompat, self.compat, self.ro_compat
        )?;
        writeln!(
            f,
            "  block/node size  {} / {}",
            self.block_size, self.node_size
        )?;
        writeln!(f, "  total bytes      {}", self.total_bytes)?;
        writeln!(f, "  bytes used       {}", self.bytes_used)?;
        writeln!(
            f,
            "  fs root          addr {:#x} generation {} level {}",
            self.fs_root.addr, self.fs_root.generation, self.fs_root.level
        )?;
        writeln!(f, "  next objectid    {}", self.next_objectid)?;
        writeln!(
            f,
            "  log area         {:#x} + {} bytes, head {:#x}, log generation {}",
            self.log_start, self.log_bytes, self.log_head, self.log_generation
        )?;
        write!(
            f,
            "  commit time      {}.{:09}",
            self.commit_time_sec, self.commit_time_nsec
        )?;
        for backup in &self.backup_roots {
            write!(
                f,
                "\n  backup root      generation {}: addr {:#x} generation {} level {}",
                backup.generation,
                backup.fs_root.addr,
                backup.fs_root.generation,
                backup.fs_root.level
            )?;
        }
        if self.incompat & INCOMPAT_SNAPSHOTS != 0 {
            write!(
                f,
                "\n  snapshot list    addr {:#x} generation {} level {}, next id {}",
                self.snapshots.addr,
                self.snapshots.generation,
                self.snapshots.level,
                self.next_snapshot_id
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sealed slot whose generation leaves no room for the next commit is refused.
    #[test]
    fn a_generation_at_the_limit_is_refused() {
        let mut sb = sample();
        sb.generation = u64::MAX;
        let err = Superblock::decode(&sb.encode(), "slot").expect_err("u64::MAX");
        assert!(err.to_string().contains("generation"), "{err}");
        sb.generation = GENERATION_LIMIT - 1;
        assert!(Superblock::decode(&sb.encode(), "slot").is_ok());
    }

    /// A sealed slot whose log head or sequence leaves no room to add to is refused.
    #[test]
    fn a_log_head_or_sequence_at_the_limit_is_refused() {
        let mut sb = sample();
        sb.log_head = u64::MAX - 4096;
        let err = Superblock::decode(&sb.encode(), "slot").expect_err("huge head");
        assert!(err.to_string().contains("log head"), "{err}");
        sb.log_head = LSN_LIMIT - 4096;
        assert!(Superblock::decode(&sb.encode(), "slot").is_ok());
        sb.log_generation = u64::MAX;
        let err = Superblock::decode(&sb.encode(), "slot").expect_err("huge sequence");
        assert!(err.to_string().contains("log sequence"), "{err}");
    }

    pub(crate) fn sample() -> Superblock {
        Superblock {
            version: FORMAT_VERSION,
            block_size: BLOCK_SIZE as u32,
            node_size: NODE_SIZE as u32,
            fsid: [7; 16],
            label: "test".into(),
            generation: 9,
            incompat: 0,
            compat: 0,
            ro_compat: 0,
            total_bytes: 64 << 20,
            bytes_used: 1 << 20,
            fs_root: RootPtr {
                addr: RESERVED_HEAD_BYTES + 4096 * 8,
                generation: 8,
                level: 1,
            },
            next_objectid: 300,
            log_start: RESERVED_HEAD_BYTES,
            log_bytes: 1 << 20,
            log_head: 0,
            log_generation: 1,
            commit_time_sec: 1_700_000_000,
            commit_time_nsec: 5,
            backup_roots: Vec::new(),
            snapshots: RootPtr::default(),
            next_snapshot_id: 0,
            device_stats: DeviceStats::default(),
        }
    }

    #[test]
    fn device_stats_round_trip_with_their_bit_and_are_ignored_without_it() {
        let mut sb = sample();
        sb.compat |= COMPAT_DEVICE_STATS;
        sb.device_stats = DeviceStats {
            read_errors: 1,
            write_errors: 2,
            flush_errors: 3,
            checksum_errors: 4,
        };
        let bytes = sb.encode();
        assert_eq!(
            bytes[DEVICE_STATS_OFFSET..DEVICE_STATS_OFFSET + 8],
            1u64.to_le_bytes()
        );
        assert_eq!(Superblock::decode(&bytes, "s").expect("decode"), sb);
        // Without the bit the bytes are neither written nor read.
        let mut plain = sb.clone();
        plain.compat &= !COMPAT_DEVICE_STATS;
        let bytes = plain.encode();
        assert!(bytes[DEVICE_STATS_OFFSET..DEVICE_STATS_OFFSET + 32]
            .iter()
            .all(|b| *b == 0));
        let back = Superblock::decode(&bytes, "s").expect("decode");
        assert_eq!(back.device_stats, DeviceStats::default());
    }

    fn with_backups() -> Superblock {
        let mut sb = sample();
        sb.compat = COMPAT_BACKUP_ROOTS;
        sb.backup_roots = (0..3)
            .map(|i| BackupRoot {
                generation: 8 - i,
                fs_root: RootPtr {
                    addr: RESERVED_HEAD_BYTES + 4096 * (16 + i),
                    generation: 7 - i,
                    level: 1,
                },
            })
            .collect();
        sb
    }

    #[test]
    fn backup_roots_round_trip_at_their_offset() {
        let sb = with_backups();
        let bytes = sb.encode();
        assert_eq!(Superblock::decode(&bytes, "slot 1"), Ok(sb.clone()));
        let at = BACKUP_ROOTS_OFFSET;
        assert_eq!(bytes[at..at + 8], 8u64.to_le_bytes());
        assert_eq!(
            bytes[at + 8..at + 16],
            (RESERVED_HEAD_BYTES + 4096 * 16).to_le_bytes()
        );
        assert_eq!(bytes[at + 16..at + 24], 7u64.to_le_bytes());
        assert_eq!(bytes[at + 24], 1);
        let third = at + 2 * BACKUP_ROOT_BYTES;
        assert_eq!(bytes[third..third + 8], 6u64.to_le_bytes());
        assert!(bytes[at + BACKUP_ROOTS * BACKUP_ROOT_BYTES..]
            .iter()
            .all(|b| *b == 0));
    }

    #[test]
    fn backup_bytes_are_ignored_without_the_flag() {
        // An older build never wrote them; with the flag clear they are not read.
        let mut sb = with_backups();
        let encoded = sb.encode();
        sb.compat = 0;
        let mut bytes = sb.encode();
        bytes[BACKUP_ROOTS_OFFSET..BACKUP_ROOTS_OFFSET + 96]
            .copy_from_slice(&encoded[BACKUP_ROOTS_OFFSET..BACKUP_ROOTS_OFFSET + 96]);
        let sum = checksum(&bytes[4..]);
        bytes[..4].copy_from_slice(&sum.to_le_bytes());
        let decoded = Superblock::decode(&bytes, "slot 1");
        assert_eq!(decoded.map(|s| s.backup_roots.len()), Ok(0));
    }

    #[test]
    fn backups_out_of_order_or_outside_are_refused() {
        let mut sb = with_backups();
        sb.backup_roots.swap(0, 1);
        assert!(Superblock::decode(&sb.encode(), "slot 1").is_err());
        let mut sb = with_backups();
        sb.backup_roots[0].generation = sb.generation;
        assert!(Superblock::decode(&sb.encode(), "slot 1").is_err());
        let mut sb = with_backups();
        sb.backup_roots[2].fs_root.addr = sb.total_bytes;
        assert!(Superblock::decode(&sb.encode(), "slot 1").is_err());
        let mut sb = with_backups();
        sb.backup_roots[1].fs_root.generation = 99;
        assert!(Superblock::decode(&sb.encode(), "slot 1").is_err());
    }

    fn with_snapshots() -> Superblock {
        let mut sb = with_backups();
        sb.incompat |= INCOMPAT_SNAPSHOTS;
        sb.snapshots = RootPtr {
            addr: 0x80000,
            generation: sb.generation - 1,
            level: 0,
        };
        sb.next_snapshot_id = 4;
        sb
    }

    #[test]
    fn snapshot_list_round_trips_at_its_offset() {
        let sb = with_snapshots();
        let bytes = sb.encode();
        let at = SNAPSHOTS_OFFSET;
        assert_eq!(&bytes[at..at + 8], &0x80000u64.to_le_bytes());
        assert_eq!(&bytes[at + 8..at + 16], &(sb.generation - 1).to_le_bytes());
        assert_eq!(bytes[at + 16], 0);
        assert_eq!(&bytes[at + 24..at + 32], &4u64.to_le_bytes());
        assert!(bytes[at + 32..].iter().all(|b| *b == 0));
        assert_eq!(Superblock::decode(&bytes, "slot 1"), Ok(sb));
        // Without the flag the bytes are neither written nor read.
        let mut plain = with_snapshots();
        plain.incompat &= !INCOMPAT_SNAPSHOTS;
        assert!(plain.encode()[at..].iter().all(|b| *b == 0));
        let decoded = Superblock::decode(&plain.encode(), "slot 1").map(|s| s.snapshots);
        assert_eq!(decoded, Ok(RootPtr::default()));
    }

    #[test]
    fn bad_snapshot_list_fields_are_refused() {
        let mut sb = with_snapshots();
        sb.next_snapshot_id = 0;
        assert!(Superblock::decode(&sb.encode(), "slot 1").is_err());
        let mut sb = with_snapshots();
        sb.snapshots.addr = sb.total_bytes;
        assert!(Superblock::decode(&sb.encode(), "slot 1").is_err());
        let mut sb = with_snapshots();
        sb.snapshots.generation = sb.generation + 1;
        assert!(Superblock::decode(&sb.encode(), "slot 1").is_err());
        let mut sb = with_snapshots();
        sb.snapshots = RootPtr {
            addr: 0,
            generation: 3,
            level: 0,
        };
        assert!(Superblock::decode(&sb.encode(), "slot 1").is_err());
        let mut sb = with_snapshots();
        sb.snapshots = RootPtr::default();
        assert!(Superblock::decode(&sb.encode(), "slot 1").is_ok());
    }

    #[test]
    fn a_build_without_the_snapshot_flag_refuses_the_image() {
        // What an older build sees: its supported mask lacks bit 2.
        let sb = with_snapshots();
        let unknown = sb.incompat & !(INCOMPAT_XATTR_CHUNKS | INCOMPAT_LOG_DATA);
        assert_eq!(unknown, INCOMPAT_SNAPSHOTS);
        let message = FormatError::UnknownIncompat { flags: unknown }.to_string();
        assert!(message.contains("0x4"), "{message}");
    }

    #[test]
    fn a_build_without_the_shared_extents_flag_refuses_the_image() {
        let mut sb = sample();
        sb.incompat |= INCOMPAT_SHARED_EXTENTS;
        let back = Superblock::decode(&sb.encode(), "slot 1").expect("decodes with bit 3");
        assert_eq!(
            back.incompat & INCOMPAT_SHARED_EXTENTS,
            INCOMPAT_SHARED_EXTENTS
        );
        // What an older build sees: its supported mask lacks bit 3.
        let older = INCOMPAT_XATTR_CHUNKS | INCOMPAT_LOG_DATA | INCOMPAT_SNAPSHOTS;
        let unknown = sb.incompat & !older;
        assert_eq!(unknown, INCOMPAT_SHARED_EXTENTS);
        let message = FormatError::UnknownIncompat { flags: unknown }.to_string();
        assert!(message.contains("0x8"), "{message}");
    }

    #[test]
    fn a_build_without_the_log_aligned_flag_refuses_the_image() {
        let mut sb = sample();
        sb.incompat |= INCOMPAT_LOG_ALIGNED;
        let back = Superblock::decode(&sb.encode(), "slot 1").expect("decodes with bit 4");
        assert_eq!(back.incompat & INCOMPAT_LOG_ALIGNED, INCOMPAT_LOG_ALIGNED);
        // What an older build sees: its supported mask lacks bit 4.
        let older = INCOMPAT_SUPPORTED & !INCOMPAT_LOG_ALIGNED;
        let unknown = sb.incompat & !older;
        assert_eq!(unknown, INCOMPAT_LOG_ALIGNED);
        let message = FormatError::UnknownIncompat { flags: unknown }.to_string();
        assert!(message.contains("0x10"), "{message}");
    }

    #[test]
    fn round_trip() {
        let sb = sample();
        let bytes = sb.encode();
        assert_eq!(bytes.len(), SUPER_BYTES);
        assert_eq!(Superblock::decode(&bytes, "slot 1"), Ok(sb));
    }

    #[test]
    fn every_flipped_byte_is_caught() {
        let bytes = sample().encode();
        for i in 0..200 {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(
                Superblock::decode(&bad, "slot 0").is_err(),
                "flip at {i} went unnoticed"
            );
        }
    }

    #[test]
    fn unknown_incompat_is_refused() {
        let mut sb = sample();
        sb.incompat = 1 << 40;
        let err = Superblock::decode(&sb.encode(), "slot 1").err();
        assert_eq!(err, Some(FormatError::UnknownIncompat { flags: 1 << 40 }));
    }

    #[test]
    fn wrong_version_is_refused() {
        let mut sb = sample();
        sb.version = 2;
        assert!(matches!(
            Superblock::decode(&sb.encode(), "slot 1"),
            Err(FormatError::BadVersion { found: 2, .. })
        ));
    }

    #[test]
    fn garbage_never_panics() {
        let mut state = 0x1234_5678_u64;
        for _ in 0..200 {
            let mut bytes = vec![0u8; SUPER_BYTES];
            for b in bytes.iter_mut() {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                *b = (state >> 33) as u8;
            }
            bytes[8..16].copy_from_slice(&SUPER_MAGIC);
            assert!(Superblock::decode(&bytes, "slot 0").is_err());
            assert!(Superblock::decode(&bytes[..100], "slot 0").is_err());
        }
    }
}
