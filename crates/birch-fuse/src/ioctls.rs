//! The ioctls the adapter answers: `FS_IOC_SHUTDOWN` (commit, then shut down), `FITRIM`
//! (discard free space) and `BTRFS_IOC_DEFRAG_RANGE` with its compress flag (rewrite a file
//! compressed: `birch defrag`, `btrfs filesystem defragment -c`), who may send them
//! (`CAP_SYS_ADMIN`), their arguments and answers. Must not touch: what a shutdown, a trim or
//! a rewrite does (birch-core).

use birch_core::vfs::ShutdownMode;
use fuser::{Errno, INodeNo, ReplyIoctl, Request};

use crate::attrs::errno;
use crate::BirchFuse;

/// `FS_IOC_SHUTDOWN`, `_IOR('X', 125, __u32)` (also `XFS_IOC_GOINGDOWN`, what xfstests'
/// `godown` sends). The kernel copies data in only for `_IOC_WRITE` commands, so its flags
/// argument never reaches a FUSE server: through a mount it means "commit, then stop".
pub const FS_IOC_SHUTDOWN: u32 = 0x8004_587d;

/// `FITRIM`, `_IOWR('X', 121, struct fstrim_range)` (what `fstrim(8)` sends to a mount point):
/// in and out, three `u64`s in the host's order: start, len, minlen. The answer's len is the
/// bytes discarded.
pub const FITRIM: u32 = 0xc018_5879;

/// `BTRFS_IOC_DEFRAG_RANGE`, `_IOW(0x94, 16, struct btrfs_ioctl_defrag_range_args)`: 48
/// bytes in, nothing out. birch answers it only with `BTRFS_DEFRAG_RANGE_COMPRESS` set.
pub const BTRFS_IOC_DEFRAG_RANGE: u32 = 0x4030_9410;

/// `flags` bit: compress what is rewritten.
pub const DEFRAG_RANGE_COMPRESS: u64 = 1;
/// `flags` bit: the second byte of the compress field is a level.
pub const DEFRAG_RANGE_COMPRESS_LEVEL: u64 = 4;

/// `struct btrfs_ioctl_defrag_range_args` as birch reads it: the range and the codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DefragRange {
    /// First byte of the range.
    pub start: u64,
    /// Its length (0 or past the end: to the end of the file).
    pub len: u64,
    /// The codec its compress type names: btrfs's zstd (3) is zstd at the level given (1 by
    /// default), btrfs's lzo (2) is lz4 here (the same class: fast, lighter ratio); zlib (1)
    /// and a request without the compress flag are refused (`EOPNOTSUPP`).
    pub codec: birch_format::codec::Codec,
}

impl DefragRange {
    /// The argument as the kernel passes it in (48 bytes, host order): start, len, flags (u64
    /// each), extent_thresh (u32), compress type (u32, or type byte and level byte with
    /// [`DEFRAG_RANGE_COMPRESS_LEVEL`]), 16 unused bytes. `Err(errno)` for another size, a
    /// request without compression, or a codec birch does not have.
    pub fn parse(bytes: &[u8]) -> Result<DefragRange, Errno> {
        use birch_format::codec::Codec;
        if bytes.len() != 48 {
            return Err(Errno::EINVAL);
        }
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[at..at + 8]);
            u64::from_ne_bytes(w)
        };
        let (start, len, flags) = (word(0), word(8), word(16));
        if flags & DEFRAG_RANGE_COMPRESS == 0 {
            return Err(Errno::EOPNOTSUPP);
        }
        let (kind, level) = if flags & DEFRAG_RANGE_COMPRESS_LEVEL != 0 {
            (u32::from(bytes[28]), i32::from(bytes[29] as i8))
        } else {
            let mut t = [0u8; 4];
            t.copy_from_slice(&bytes[28..32]);
            (u32::from_ne_bytes(t), 0)
        };
        let codec = match kind {
            3 if level == 0 => Codec::Zstd(1),
            3 if (1..=19).contains(&level) => Codec::Zstd(level),
            2 => Codec::Lz4,
            _ => return Err(Errno::EOPNOTSUPP),
        };
        Ok(DefragRange { start, len, codec })
    }

    /// The argument a sender passes (`birch defrag`): [`DefragRange::parse`] reads it back.
    pub fn bytes(&self) -> [u8; 48] {
        use birch_format::codec::Codec;
        let mut out = [0u8; 48];
        out[..8].copy_from_slice(&self.start.to_ne_bytes());
        out[8..16].copy_from_slice(&self.len.to_ne_bytes());
        let (kind, level) = match self.codec {
            Codec::Zstd(level) => (3u8, level.clamp(1, 19) as i8),
            Codec::Lz4 | Codec::None => (2u8, 0),
        };
        let flags = DEFRAG_RANGE_COMPRESS | DEFRAG_RANGE_COMPRESS_LEVEL;
        out[16..24].copy_from_slice(&flags.to_ne_bytes());
        out[28] = kind;
        out[29] = level as u8;
        out
    }
}

/// `struct fstrim_range`, `FITRIM`'s argument and answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FstrimRange {
    start: u64,
    len: u64,
    minlen: u64,
}

impl FstrimRange {
    /// The struct as the kernel passes it in (24 bytes, host order); None for another size.
    pub(crate) fn parse(bytes: &[u8]) -> Option<FstrimRange> {
        if bytes.len() != 24 {
            return None;
        }
        let word = |n: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[n * 8..n * 8 + 8]);
            u64::from_ne_bytes(w)
        };
        Some(FstrimRange {
            start: word(0),
            len: word(1),
            minlen: word(2),
        })
    }

    /// The struct as the kernel copies it out.
    pub(crate) fn bytes(&self) -> [u8; 24] {
        let mut out = [0u8; 24];
        out[..8].copy_from_slice(&self.start.to_ne_bytes());
        out[8..16].copy_from_slice(&self.len.to_ne_bytes());
        out[16..].copy_from_slice(&self.minlen.to_ne_bytes());
        out
    }
}

/// `CAP_SYS_ADMIN`, the capability a shutdown or a trim asks of its caller.
pub(crate) const CAP_SYS_ADMIN: u32 = 21;

/// Whether the process `pid` has `CAP_SYS_ADMIN` in its effective set (`CapEff` of
/// /proc/PID/status); for a process already gone, whether `uid` is root. The kernel checks
/// no capability before it forwards an ioctl to a FUSE server.
pub(crate) fn caller_is_admin(pid: u32, uid: u32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return uid == 0;
    };
    let effective = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok());
    match effective {
        Some(caps) => caps & (1u64 << CAP_SYS_ADMIN) != 0,
        None => uid == 0,
    }
}

impl BirchFuse {
    /// `FITRIM` (`fstrim MOUNTPOINT`): on any inode of the mount (fstrim opens the mount
    /// point), from a caller with `CAP_SYS_ADMIN` only (`EPERM` otherwise, as the kernel's
    /// filesystems answer); discards the free space of the range
    /// ([`Filesystem::trim`]) and answers the range with `len` set to the bytes discarded.
    /// `EOPNOTSUPP` where the device frees nothing on a discard (an image file).
    pub(crate) fn fitrim(&self, req: &Request, ino: INodeNo, in_data: &[u8], reply: ReplyIoctl) {
        if !caller_is_admin(req.pid(), req.uid()) {
            log::warn!(
                "FITRIM on inode {} refused: pid {} (uid {}) lacks CAP_SYS_ADMIN",
                ino.0,
                req.pid(),
                req.uid()
            );
            reply.error(Errno::EPERM);
            return;
        }
        let Some(range) = FstrimRange::parse(in_data) else {
            log::warn!(
                "FITRIM on inode {}: argument of {} bytes, not 24",
                ino.0,
                in_data.len()
            );
            reply.error(Errno::EINVAL);
            return;
        };
        // Discards wait for the device, and a trim of a whole image may take minutes: always
        // on a worker (see `waiters`), never on a request loop.
        let fs = self.fs.clone();
        let job = move || match fs.trim(range.start, range.len, range.minlen) {
            Ok(trimmed) => reply.ioctl(
                0,
                &FstrimRange {
                    len: trimmed,
                    ..range
                }
                .bytes(),
            ),
            Err(e) => reply.error(errno("FITRIM", &e)),
        };
        self.waiters.run(job);
    }

    /// `BTRFS_IOC_DEFRAG_RANGE` with the compress flag (`birch defrag`, `btrfs filesystem
    /// defragment -c`): from a caller with `CAP_SYS_ADMIN` only; rewrites the chunks of the
    /// range compressed ([`birch_core::Filesystem::compress_range`]) on a worker (it reads and
    /// writes the file under its lock), then drops the kernel's cached attributes (st_blocks
    /// moved; the bytes did not).
    pub(crate) fn defrag(&self, req: &Request, ino: INodeNo, in_data: &[u8], reply: ReplyIoctl) {
        if !caller_is_admin(req.pid(), req.uid()) {
            log::warn!(
                "BTRFS_IOC_DEFRAG_RANGE on inode {} refused: pid {} (uid {}) lacks CAP_SYS_ADMIN",
                ino.0,
                req.pid(),
                req.uid()
            );
            reply.error(Errno::EPERM);
            return;
        }
        let range = match DefragRange::parse(in_data) {
            Ok(range) => range,
            Err(e) => {
                log::warn!("BTRFS_IOC_DEFRAG_RANGE on inode {}: refused ({e:?})", ino.0);
                reply.error(e);
                return;
            }
        };
        let fs = self.fs.clone();
        let notifier = self.notifier.clone();
        let job = move || match fs.compress_range(
            crate::ino_of(ino),
            range.codec,
            range.start,
            range.len,
        ) {
            Ok(report) => {
                log::info!("defrag inode {}: {report:?}", ino.0);
                crate::invalidate::invalidate_attrs(&notifier, ino.0);
                reply.ioctl(0, &[]);
            }
            Err(e) => reply.error(errno("defrag", &e)),
        };
        self.waiters.run(job);
    }

    pub(crate) fn op_ioctl(
        &self,
        req: &Request,
        ino: INodeNo,
        cmd: u32,
        in_data: &[u8],
        reply: ReplyIoctl,
    ) {
        refuse_if_down!(self, reply);
        if cmd == FITRIM {
            self.fitrim(req, ino, in_data, reply);
            return;
        }
        if cmd == BTRFS_IOC_DEFRAG_RANGE {
            self.defrag(req, ino, in_data, reply);
            return;
        }
        if cmd != FS_IOC_SHUTDOWN {
            reply.error(Errno::ENOTTY);
            return;
        }
        if !caller_is_admin(req.pid(), req.uid()) {
            log::warn!(
                "FS_IOC_SHUTDOWN on inode {} refused: pid {} (uid {}) lacks CAP_SYS_ADMIN",
                ino.0,
                req.pid(),
                req.uid()
            );
            reply.error(Errno::EPERM);
            return;
        }
        log::warn!(
            "FS_IOC_SHUTDOWN from pid {} on inode {}: commit, then shut down",
            req.pid(),
            ino.0
        );
        // Its commit waits for the device: served as FSYNC is (see `waiters`).
        let fs = self.fs.clone();
        let job = move || match fs.shutdown(ShutdownMode::Commit) {
            Ok(()) => reply.ioctl(0, &[]),
            Err(e) => reply.error(errno("shutdown", &e)),
        };
        self.serve_waiting(job);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `FITRIM` is `_IOWR('X', 121, struct fstrim_range)`, and its argument round-trips in
    /// the kernel's layout; another size is refused.
    #[test]
    fn fitrim_number_and_argument_match_the_kernel() {
        let iowr = |kind: u8, nr: u8, size: u32| {
            (3u32 << 30) | (size << 16) | (u32::from(kind) << 8) | u32::from(nr)
        };
        assert_eq!(FITRIM, iowr(b'X', 121, 24));
        let mut raw = Vec::new();
        for word in [4096u64, u64::MAX, 65536] {
            raw.extend_from_slice(&word.to_ne_bytes());
        }
        let range = FstrimRange::parse(&raw).expect("24 bytes parse");
        assert_eq!(
            range,
            FstrimRange {
                start: 4096,
                len: u64::MAX,
                minlen: 65536
            }
        );
        assert_eq!(range.bytes().as_slice(), raw.as_slice());
        assert_eq!(FstrimRange::parse(&raw[..16]), None);
    }

    /// `BTRFS_IOC_DEFRAG_RANGE` is `_IOW(0x94, 16, 48 bytes)`; birch's own argument round
    /// trips; btrfs-progs' forms (a u32 compress type, no level) read as documented.
    #[test]
    fn defrag_range_number_and_argument() {
        use birch_format::codec::Codec;
        assert_eq!(
            BTRFS_IOC_DEFRAG_RANGE,
            (1u32 << 30) | (48 << 16) | (0x94 << 8) | 16
        );
        for codec in [Codec::Zstd(1), Codec::Zstd(19), Codec::Lz4] {
            let range = DefragRange {
                start: 4096,
                len: 0,
                codec,
            };
            assert_eq!(DefragRange::parse(&range.bytes()), Ok(range));
        }
        let progs = |flags: u64, kind: u32| {
            let mut raw = [0u8; 48];
            raw[8..16].copy_from_slice(&u64::MAX.to_ne_bytes());
            raw[16..24].copy_from_slice(&flags.to_ne_bytes());
            raw[28..32].copy_from_slice(&kind.to_ne_bytes());
            DefragRange::parse(&raw).map(|r| r.codec)
        };
        assert_eq!(progs(1, 3), Ok(Codec::Zstd(1)));
        assert_eq!(progs(1, 2), Ok(Codec::Lz4));
        assert_eq!(progs(1, 1), Err(Errno::EOPNOTSUPP), "zlib");
        assert_eq!(progs(0, 3), Err(Errno::EOPNOTSUPP), "no compress flag");
        assert_eq!(DefragRange::parse(&[0u8; 40]), Err(Errno::EINVAL));
    }

    #[test]
    fn the_shutdown_ioctl_is_ior_x_125_of_a_u32() {
        // _IOR(type, nr, size) = read (2) << 30 | size << 16 | type << 8 | nr.
        let ior = (2u32 << 30) | (4 << 16) | (u32::from(b'X') << 8) | 125;
        assert_eq!(FS_IOC_SHUTDOWN, ior);
    }
}
