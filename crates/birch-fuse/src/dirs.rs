//! Names and listings: MKNOD, MKDIR, UNLINK, RMDIR, SYMLINK, RENAME, LINK, OPENDIR (answered
//! ENOSYS), READDIR, READDIRPLUS, FSYNCDIR, and the readdir cookies that carry where a listing
//! ends.
//! Must not touch: file data and opens (`file_io`), attributes beyond the entries it answers.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use fuser::{
    Errno, Generation, INodeNo, RenameFlags, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty,
    ReplyEntry, ReplyOpen, Request,
};

use crate::attrs::{caller, errno, file_attr, file_type};
use crate::{ino_of, node_of, BirchFuse};
use birch_format::InodeNo;

/// Readdir cookies that carry where their listing ends.
///
/// A listing stops where the directory ended when it started (a READDIR at offset 0: opendir
/// or `rewinddir`), so one that meets names renamed away and back (each gets a new position)
/// still ends (xfstests generic/736; btrfs does the same). There is no per-open directory
/// state to keep that end in: OPENDIR is answered ENOSYS (FUSE_NO_OPENDIR_SUPPORT), which
/// saves an OPENDIR and a RELEASEDIR per listing, and the kernel then caches every listing
/// (`FOPEN_KEEP_CACHE | FOPEN_CACHE_DIR`). So each entry's cookie (the offset the kernel
/// hands back to continue after it) carries the end beside the position: the position in bits
/// 31..62, the end in bits 0..31. The position leads, so cookies grow along a listing, and any
/// number below the largest cookie a listing gave (xfstests generic/676 seeks to random ones)
/// lands on a position inside it, never past its end. A directory whose positions outgrow 31
/// bits (two billion names made in it over its life) gets plain positions with bit 62 set, and
/// its listings no end.
mod dir_cookie {
    const PLAIN: u64 = 1 << 62;
    const FIELD: u64 = (1 << 31) - 1;

    /// The cookie of position `pos` (the dir index cookie: 0 ".", 1 "..", then index + 1) in
    /// a listing that ends at `end`.
    pub(super) fn encode(pos: u64, end: Option<u64>) -> u64 {
        match end {
            Some(end) if pos <= FIELD && end <= FIELD => (pos << 31) | end,
            _ => PLAIN | pos,
        }
    }

    /// The position and the listing's end of `cookie`.
    pub(super) fn decode(cookie: u64) -> (u64, Option<u64>) {
        if cookie & PLAIN != 0 {
            (cookie & !PLAIN, None)
        } else {
            (cookie >> 31, Some(cookie & FIELD))
        }
    }
}

impl BirchFuse {
    /// Where a READDIR of `ino` at cookie `offset` starts and where its listing ends: a new
    /// listing (offset 0) ends where the directory ends now; a continued one where its cookie
    /// says ([`dir_cookie`]).
    pub(crate) fn dir_range(&self, ino: u64, offset: u64) -> (u64, Option<u64>) {
        if offset == 0 {
            (0, self.fs.readdir_end(InodeNo::new(ino)).ok())
        } else {
            dir_cookie::decode(offset)
        }
    }

    #[allow(
        clippy::too_many_arguments,
        reason = "the arguments of fuser's `Filesystem::mknod`, which lib.rs forwards as they come"
    )]
    pub(crate) fn op_mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        refuse_if_down!(self, reply);
        match self.fs.mknod(
            caller(req, self.umask(umask)),
            ino_of(parent),
            name.as_bytes(),
            mode,
            u64::from(rdev),
        ) {
            Ok(a) => reply.entry(&self.options.ttl, &file_attr(&a), Generation(a.generation)),
            Err(e) => reply.error(errno("mknod", &e)),
        }
    }

    pub(crate) fn op_mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        refuse_if_down!(self, reply);
        match self.fs.mkdir(
            caller(req, self.umask(umask)),
            ino_of(parent),
            name.as_bytes(),
            mode,
        ) {
            Ok(a) => reply.entry(&self.options.ttl, &file_attr(&a), Generation(a.generation)),
            Err(e) => reply.error(errno("mkdir", &e)),
        }
    }

    pub(crate) fn op_unlink(&self, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        refuse_if_down!(self, reply);
        match self.fs.unlink(ino_of(parent), name.as_bytes()) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("unlink", &e)),
        }
    }

    pub(crate) fn op_rmdir(&self, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        refuse_if_down!(self, reply);
        match self.fs.rmdir(ino_of(parent), name.as_bytes()) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("rmdir", &e)),
        }
    }

    pub(crate) fn op_symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        refuse_if_down!(self, reply);
        match self.fs.symlink(
            caller(req, 0),
            ino_of(parent),
            link_name.as_bytes(),
            target.as_os_str().as_bytes(),
        ) {
            Ok(a) => reply.entry(&self.options.ttl, &file_attr(&a), Generation(a.generation)),
            Err(e) => reply.error(errno("symlink", &e)),
        }
    }

    #[allow(
        clippy::too_many_arguments,
        reason = "the arguments of fuser's `Filesystem::rename`, which lib.rs forwards as they come"
    )]
    pub(crate) fn op_rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        refuse_if_down!(self, reply);
        match self.fs.rename_as(
            caller(req, 0),
            ino_of(parent),
            name.as_bytes(),
            ino_of(newparent),
            newname.as_bytes(),
            flags.bits(),
        ) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("rename", &e)),
        }
    }

    pub(crate) fn op_link(
        &self,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        refuse_if_down!(self, reply);
        match self
            .fs
            .link(ino_of(ino), ino_of(newparent), newname.as_bytes())
        {
            Ok(a) => reply.entry(&self.options.ttl, &file_attr(&a), Generation(a.generation)),
            Err(e) => reply.error(errno("link", &e)),
        }
    }

    pub(crate) fn op_opendir(&self, ino: INodeNo, reply: ReplyOpen) {
        refuse_if_down!(self, reply);
        // No per-open directory state: ENOSYS (with FUSE_NO_OPENDIR_SUPPORT) makes the kernel
        // stop sending OPENDIR and RELEASEDIR, two round trips per listing, and cache every
        // listing (`FOPEN_KEEP_CACHE | FOPEN_CACHE_DIR`), dropping it whenever the directory
        // changes through it; the daemon never changes a directory behind the kernel. Where a
        // listing ends travels in its cookies instead (`dir_cookie`). An inode that is gone
        // still answers as before (ENOENT), and a non-directory ENOTDIR.
        match self.fs.readdir_end(ino_of(ino)) {
            Ok(_) => reply.error(Errno::ENOSYS),
            Err(e) => reply.error(errno("opendir", &e)),
        }
    }

    pub(crate) fn op_readdir(&self, ino: INodeNo, offset: u64, mut reply: ReplyDirectory) {
        refuse_if_down!(self, reply);
        let (pos, end) = self.dir_range(ino.0, offset);
        match self.fs.readdir_until(ino_of(ino), pos, 512, end) {
            Ok(entries) => {
                for e in entries {
                    if reply.add(
                        node_of(e.ino),
                        dir_cookie::encode(e.next_offset, end),
                        file_type(e.kind),
                        OsStr::from_bytes(&e.name),
                    ) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(errno("readdir", &e)),
        }
    }

    pub(crate) fn op_readdirplus(&self, ino: INodeNo, offset: u64, mut reply: ReplyDirectoryPlus) {
        refuse_if_down!(self, reply);
        let (pos, end) = self.dir_range(ino.0, offset);
        match self.fs.readdir_until(ino_of(ino), pos, 256, end) {
            Ok(entries) => {
                for e in entries {
                    // Entries other than "." and ".." count as lookups the kernel later forgets.
                    let attr = if e.name == b"." || e.name == b".." {
                        self.fs.getattr(e.ino)
                    } else {
                        self.fs.lookup_listed(ino_of(ino), &e.name, e.ino)
                    };
                    let Ok(a) = attr else { continue };
                    if reply.add(
                        node_of(e.ino),
                        dir_cookie::encode(e.next_offset, end),
                        OsStr::from_bytes(&e.name),
                        &self.options.ttl,
                        &file_attr(&a),
                        Generation(a.generation),
                    ) {
                        if e.name != b"." && e.name != b".." {
                            self.fs.forget(e.ino, 1);
                        }
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(errno("readdirplus", &e)),
        }
    }

    pub(crate) fn op_fsyncdir(&self, ino: INodeNo, datasync: bool, reply: ReplyEmpty) {
        refuse_if_down!(self, reply);
        let fs = self.fs.clone();
        let job = move || match fs.fsync(ino_of(ino), datasync) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("fsyncdir", &e)),
        };
        self.serve_waiting(job);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_readdir_cookie_carries_its_listing_end() {
        for (pos, end) in [
            (0, 0),
            (1, 5),
            (2, 2),
            (77, 1 << 20),
            ((1 << 31) - 1, (1 << 31) - 1),
        ] {
            let c = dir_cookie::encode(pos, Some(end));
            assert!(c < (1 << 63), "a non-negative loff_t");
            assert_eq!(dir_cookie::decode(c), (pos, Some(end)));
        }
        // Positions or ends past 31 bits: a plain position, no end.
        assert_eq!(
            dir_cookie::decode(dir_cookie::encode(1 << 31, Some(3))),
            (1 << 31, None)
        );
        assert_eq!(
            dir_cookie::decode(dir_cookie::encode(9, Some(1 << 31))),
            (9, None)
        );
        assert_eq!(dir_cookie::decode(dir_cookie::encode(9, None)), (9, None));
        // Cookies grow with the position within a listing, and a number below a listing's
        // largest cookie is a position inside it.
        let a = dir_cookie::encode(10, Some(100));
        let b = dir_cookie::encode(11, Some(100));
        assert!(a < b);
        let (pos, end) = dir_cookie::decode(b - 1);
        assert!(pos <= 11 && end.is_some());
    }
}
