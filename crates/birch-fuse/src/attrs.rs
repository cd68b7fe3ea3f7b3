//! Attributes and lookups: LOOKUP (negative entries included), GETATTR (where a refused
//! write-back is reported, see `full_disk`), SETATTR, READLINK; the conversions between
//! birch-core's types and the kernel's (times, kinds, attributes, callers), the errno of an
//! error, the caller's groups for the suid/sgid rules, and the counts of handle lookups.
//! Must not touch: names and listings (`dirs`), file data (`file_io`).

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use birch_core::vfs::{Attr, Caller, FileKind, SetAttr, SetTime};
use birch_core::Error;
use birch_format::items::Timespec;
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Generation, INodeNo, ReplyAttr, ReplyData, ReplyEntry,
    Request, TimeOrNow,
};

use crate::{ino_of, node_of, BirchFuse};
use birch_format::InodeNo;

/// Counters of the LOOKUPs the kernel sends to resolve a file handle: LOOKUP(node id, ".")
/// when it no longer caches the inode the handle names (any kind of inode), and
/// LOOKUP(dir, "..") when it reconnects a directory to its parent (exportfs `get_parent`).
/// Shown in the stats xattr as `lookup_dot`, `lookup_dotdot` (answered with an entry) and
/// `lookup_dot_stale` (the inode is gone: the kernel answers the handle ESTALE).
#[derive(Default)]
pub(crate) struct HandleLookups {
    dot: AtomicU64,
    dotdot: AtomicU64,
    dot_stale: AtomicU64,
}

impl HandleLookups {
    /// Counts one LOOKUP of `name` and what it found.
    pub(crate) fn count(&self, name: &[u8], found: &birch_core::Result<Attr>) {
        let counter = match (name, found) {
            (b".", Ok(_)) => &self.dot,
            (b".", Err(Error::NotFound(_))) => &self.dot_stale,
            (b"..", Ok(_)) => &self.dotdot,
            _ => return,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn pairs(&self) -> [(&'static str, u64); 3] {
        [
            ("lookup_dot", self.dot.load(Ordering::Relaxed)),
            ("lookup_dotdot", self.dotdot.load(Ordering::Relaxed)),
            ("lookup_dot_stale", self.dot_stale.load(Ordering::Relaxed)),
        ]
    }
}

/// Logs a failed request at the error's own level ([`Error::log_level`]) and gives the errno
/// to reply with ([`Error::errno`]).
pub(crate) fn errno(op: &str, e: &Error) -> Errno {
    log::log!(e.log_level(), "{op}: {e}");
    Errno::from_i32(e.errno())
}

pub(crate) fn system_time(t: Timespec) -> SystemTime {
    if t.sec >= 0 {
        UNIX_EPOCH + Duration::new(t.sec as u64, t.nsec)
    } else {
        UNIX_EPOCH - Duration::from_secs(t.sec.unsigned_abs())
            + Duration::from_nanos(u64::from(t.nsec))
    }
}

pub(crate) fn timespec(t: SystemTime) -> Timespec {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => Timespec {
            sec: d.as_secs() as i64,
            nsec: d.subsec_nanos(),
        },
        Err(e) => {
            let d = e.duration();
            let (sec, nsec) = if d.subsec_nanos() == 0 {
                (-(d.as_secs() as i64), 0)
            } else {
                (-(d.as_secs() as i64) - 1, 1_000_000_000 - d.subsec_nanos())
            };
            Timespec { sec, nsec }
        }
    }
}

pub(crate) fn file_type(kind: FileKind) -> FileType {
    match kind {
        FileKind::File => FileType::RegularFile,
        FileKind::Dir => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Fifo => FileType::NamedPipe,
        FileKind::Socket => FileType::Socket,
        FileKind::CharDevice => FileType::CharDevice,
        FileKind::BlockDevice => FileType::BlockDevice,
    }
}

pub(crate) fn file_attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: node_of(a.ino),
        size: a.size,
        blocks: a.blocks,
        atime: system_time(a.atime),
        mtime: system_time(a.mtime),
        ctime: system_time(a.ctime),
        crtime: system_time(a.crtime),
        kind: file_type(a.kind),
        perm: a.perm as u16,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev as u32,
        blksize: a.blksize,
        flags: 0,
    }
}

pub(crate) fn caller(req: &Request, umask: u32) -> Caller {
    Caller {
        uid: req.uid(),
        gid: req.gid(),
        umask,
    }
}

pub(crate) fn set_time(t: TimeOrNow) -> SetTime {
    match t {
        TimeOrNow::Now => SetTime::Now,
        TimeOrNow::SpecificTime(t) => SetTime::At(timespec_from_kernel(t)),
    }
}

/// A time the kernel sent (SETATTR). fuser 0.18 decodes a negative (sec, nsec) as
/// `UNIX_EPOCH - (|sec| s + nsec ns)`, subtracting the nanoseconds that should be added;
/// undo that, so 1969-12-31 23:59:59.25 stays .25 and does not become .75 of the second
/// before. (Its encoding of replies is right: [`system_time`] is its inverse.)
pub(crate) fn timespec_from_kernel(t: SystemTime) -> Timespec {
    match t.duration_since(UNIX_EPOCH) {
        Ok(_) => timespec(t),
        Err(e) => {
            let d = e.duration();
            Timespec {
                sec: -(d.as_secs() as i64),
                nsec: d.subsec_nanos(),
            }
        }
    }
}

/// The attributes of a negative entry: node id 0 tells the kernel the name does not exist,
/// and the entry timeout lets it remember that.
pub(crate) fn negative_attr() -> FileAttr {
    FileAttr {
        ino: INodeNo(0),
        size: 0,
        blocks: 0,
        atime: UNIX_EPOCH,
        mtime: UNIX_EPOCH,
        ctime: UNIX_EPOCH,
        crtime: UNIX_EPOCH,
        kind: FileType::RegularFile,
        perm: 0,
        nlink: 0,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 0,
        flags: 0,
    }
}

impl BirchFuse {
    /// LOOKUP of `name` in `parent`, counting the lookups of "." and ".." (see
    /// [`HandleLookups`]).
    pub(crate) fn lookup_counted(&self, parent: u64, name: &[u8]) -> birch_core::Result<Attr> {
        let found = self.fs.lookup(InodeNo::new(parent), name);
        self.handle_lookups.count(name, &found);
        found
    }

    /// The groups of a caller that lacks CAP_FSETID, primary first, as far as the sgid rule
    /// of a write, truncate or chown of `ino` needs them: the supplementary groups (from
    /// /proc) only matter, and are only read, when the file has sgid without group-execute.
    pub(crate) fn caller_groups(&self, req: &Request, ino: u64) -> Vec<u32> {
        let needs_all = self
            .fs
            .getattr(InodeNo::new(ino))
            .is_ok_and(|a| a.perm & libc::S_ISGID != 0 && a.perm & libc::S_IXGRP == 0);
        if needs_all {
            self.all_groups(req)
        } else {
            vec![req.gid()]
        }
    }

    /// What Linux's `file_modified` does to a file changed by FALLOCATE or COPY_FILE_RANGE,
    /// which with FUSE_HANDLE_KILLPRIV_V2 the kernel leaves to us without saying so: for a
    /// caller without CAP_FSETID (for us, a caller other than root, as for truncate) suid
    /// goes, and sgid as for a write. The caller invalidates the kernel's attributes.
    pub(crate) fn kill_privs_of_modify(&self, req: &Request, ino: u64) -> birch_core::Result<()> {
        if self.killpriv && req.uid() != 0 {
            self.fs
                .kill_privs(InodeNo::new(ino), &self.caller_groups(req, ino))?;
        }
        Ok(())
    }

    /// The caller's groups, primary first, then its supplementary groups (from /proc).
    pub(crate) fn all_groups(&self, req: &Request) -> Vec<u32> {
        let mut groups = vec![req.gid()];
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", req.pid())).unwrap_or_default();
        if let Some(line) = status.lines().find(|l| l.starts_with("Groups:")) {
            groups.extend(
                line["Groups:".len()..]
                    .split_whitespace()
                    .filter_map(|g| g.parse::<u32>().ok()),
            );
        }
        groups
    }

    pub(crate) fn op_lookup(&self, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        refuse_if_down!(self, reply);
        match self.lookup_counted(parent.0, name.as_bytes()) {
            Ok(a) => reply.entry(&self.options.ttl, &file_attr(&a), Generation(a.generation)),
            // A negative entry: the kernel remembers the absence (build tools, $PATH searches
            // and dbench ask again and again). A CREATE of the name replaces it in the kernel.
            Err(Error::NotFound(_)) if !self.options.ttl.is_zero() => {
                reply.entry(&self.options.ttl, &negative_attr(), Generation(0))
            }
            Err(e) => reply.error(errno("lookup", &e)),
        }
    }

    pub(crate) fn op_getattr(&self, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        refuse_if_down!(self, reply);
        // With a handle, this is the kernel starting a write(2) (or a read or lseek) on a file
        // whose write-back the daemon refused: report it there (see `LostWrites`).
        if fh.is_some() && self.lost_writes.take(ino.0) {
            reply.error(Errno::ENOSPC);
            return;
        }
        match self.fs.getattr(ino_of(ino)) {
            Ok(a) => reply.attr(&self.options.ttl, &file_attr(&a)),
            Err(e) => reply.error(errno("getattr", &e)),
        }
    }

    #[allow(
        clippy::too_many_arguments,
        reason = "the arguments of fuser's `Filesystem::setattr`, which lib.rs forwards as they come"
    )]
    pub(crate) fn op_setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        reply: ReplyAttr,
    ) {
        refuse_if_down!(self, reply);
        let set = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime: atime.map(set_time),
            mtime: mtime.map(set_time),
            ctime: ctime.map(timespec_from_kernel),
            // fuser does not pass FATTR_KILL_SUIDGID on; the kernel sets it on a truncate by
            // a caller without CAP_FSETID, which for us is a caller other than root.
            kill_privs: self.killpriv && size.is_some() && req.uid() != 0,
            caller_groups: (req.uid() != 0 && (size.is_some() || uid.is_some() || gid.is_some()))
                .then(|| self.caller_groups(req, ino.0)),
        };
        match self.fs.setattr(ino_of(ino), &set) {
            Ok(a) => reply.attr(&self.options.ttl, &file_attr(&a)),
            Err(e) => reply.error(errno("setattr", &e)),
        }
    }

    pub(crate) fn op_readlink(&self, ino: INodeNo, reply: ReplyData) {
        refuse_if_down!(self, reply);
        match self.fs.readlink(ino_of(ino)) {
            Ok(target) => reply.data(&target),
            Err(e) => reply.error(errno("readlink", &e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use birch_core::Filesystem;
    use birch_format::ROOT_INO;

    use super::*;
    use crate::xattrs::stats_with_transport;
    use crate::FuseOptions;

    /// The LOOKUPs the kernel sends to resolve an uncached file handle are counted in the
    /// stats: "." of a file and of a directory, ".." of a directory, and "." of a removed file
    /// (stale); an ordinary name counts in none of them.
    #[test]
    fn lookups_of_dot_and_dotdot_are_counted_in_the_stats() -> birch_core::Result<()> {
        use birch_core::device::MemDevice;
        use birch_core::vfs::Caller;
        use birch_core::{MkfsOptions, OpenOptions};
        let dev = Arc::new(MemDevice::new(64 << 20));
        Filesystem::mkfs(dev.clone(), &MkfsOptions::default())?;
        let options = OpenOptions {
            commit_interval: None,
            ..Default::default()
        };
        let fs = Arc::new(Filesystem::open_device(dev, options)?);
        let c = Caller::default();
        let dir = fs.mkdir(c, ROOT_INO, b"d", 0o755)?;
        let sub = fs.mkdir(c, dir.ino, b"e", 0o755)?;
        fs.write_file("/d/e/f", b"data")?;
        fs.write_file("/d/gone", b"x")?;
        let file = fs.resolve("/d/e/f")?;
        let gone = fs.resolve("/d/gone")?;
        fs.unlink(dir.ino, b"gone")?;
        let adapter = BirchFuse::new(fs.clone(), FuseOptions::default());

        assert_eq!(adapter.lookup_counted(file.get(), b".")?.ino, file);
        assert_eq!(adapter.lookup_counted(sub.ino.get(), b".")?.ino, sub.ino);
        assert_eq!(adapter.lookup_counted(sub.ino.get(), b"..")?.ino, dir.ino);
        assert_eq!(adapter.lookup_counted(dir.ino.get(), b"..")?.ino, ROOT_INO);
        assert_eq!(adapter.lookup_counted(dir.ino.get(), b"e")?.ino, sub.ino);
        assert!(matches!(
            adapter.lookup_counted(gone.get(), b"."),
            Err(Error::NotFound(_))
        ));
        let stats = stats_with_transport(fs.stats_json(), &adapter.handle_lookups.pairs());
        for want in [
            "\"lookup_dot\": 2",
            "\"lookup_dotdot\": 2",
            "\"lookup_dot_stale\": 1",
        ] {
            assert!(stats.contains(want), "{want} missing in {stats}");
        }
        assert!(stats.ends_with('}'), "{stats}");
        fs.close()
    }

    #[test]
    fn times_before_1970_from_the_kernel_keep_their_nanoseconds() {
        // What fuser 0.18 hands over for the wire value (-86400 s, 999999999 ns).
        let from_fuser = UNIX_EPOCH - Duration::new(86_400, 999_999_999);
        let t = timespec_from_kernel(from_fuser);
        assert_eq!((t.sec, t.nsec), (-86_400, 999_999_999));
        // Whole seconds and times after 1970 are unchanged.
        let t = timespec_from_kernel(UNIX_EPOCH - Duration::from_secs(5));
        assert_eq!((t.sec, t.nsec), (-5, 0));
        let t = timespec_from_kernel(UNIX_EPOCH + Duration::new(7, 3));
        assert_eq!((t.sec, t.nsec), (7, 3));
        // Our replies encode through system_time, which fuser turns back into (sec, nsec).
        let back = system_time(Timespec {
            sec: -86_400,
            nsec: 999_999_999,
        });
        assert_eq!(
            back,
            UNIX_EPOCH - Duration::from_secs(86_400) + Duration::from_nanos(999_999_999)
        );
    }
}
