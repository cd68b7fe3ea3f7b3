//! Extended attributes and the control channel: SETXATTR, GETXATTR, LISTXATTR, REMOVEXATTR,
//! and the root's `trusted.birch.*` xattrs: `control` (commands to the daemon), `stats`,
//! `scrub`, `snapshots`, `alone` and `diff/...` (reports); and what runs a control command
//! from either channel (this xattr or the daemon's control socket): [`run_control`].
//! Must not touch: what a control command does (birch-core's `Filesystem::control`).

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::{Arc, OnceLock};

use birch_core::control::ControlCommand;
use birch_core::Filesystem;
use fuser::{Errno, INodeNo, ReplyEmpty, ReplyXattr, Request};

use crate::attrs::errno;
use crate::daemon::control_socket::ControlHandler;
use crate::invalidate::{invalidate_attrs, Invalidator};
use crate::{ino_of, BirchFuse};

/// The root xattr through which the mount helper reaches the daemon (remount ro/rw, sync).
pub const CONTROL_XATTR: &[u8] = b"trusted.birch.control";

/// The xattr of a POSIX access ACL, whose change can change the mode.
pub(crate) const ACL_ACCESS: &[u8] = b"system.posix_acl_access";

/// The root xattr that returns every counter as JSON.
pub const STATS_XATTR: &[u8] = b"trusted.birch.stats";

/// The root xattr that returns the online scrub's status and, once done, its report as JSON
/// (`Filesystem::scrub_status`); `scrub-start` and `scrub-cancel` on [`CONTROL_XATTR`] drive it.
pub const SCRUB_XATTR: &[u8] = b"trusted.birch.scrub";

/// The root xattr that lists the files this mount found damaged as JSON
/// (`Filesystem::files_with_errors_json`, at most [`DIFF_CHUNK`] bytes; `birch errors MNT`).
pub const ERRORS_XATTR: &[u8] = b"trusted.birch.errors";

/// The root xattr that lists the snapshots, a line each (`Filesystem::snapshots_text`);
/// `snapshot-create NAME` and `snapshot-delete NAME` on [`CONTROL_XATTR`] change them.
pub const SNAPSHOTS_XATTR: &[u8] = b"trusted.birch.snapshots";

/// The root xattr that names the snapshot a mount serves alone (`-o ro,snapshot=NAME`);
/// `ENODATA` on a mount of the live filesystem (and from daemons older than it).
pub const ALONE_XATTR: &[u8] = b"trusted.birch.alone";

/// The root xattrs `trusted.birch.diff/OFFSET/SNAP1[/SNAP2]` (`birch diff MNT`): the
/// lines of [`birch_core::Engine::diff`] from SNAP1 to SNAP2 (absent: the live state, committed
/// first), from byte OFFSET of the text, at most [`DIFF_CHUNK`] bytes: a shorter piece is the
/// last. The text is computed once per state (`Filesystem::diff_text` keeps the last two).
pub const DIFF_XATTR_PREFIX: &[u8] = b"trusted.birch.diff/";

/// The most bytes one `trusted.birch.diff/...` read returns (under the kernel's 64 KiB).
pub const DIFF_CHUNK: usize = 60_000;

/// The name of the `trusted.birch.diff/OFFSET/SNAP1[/SNAP2]` xattr that reads the piece of
/// the diff from `from` to `to` (none: the live state) at byte `offset` (what `birch diff MNT`
/// reads; `diff_spec` parses it back).
pub fn diff_xattr_name(offset: usize, from: &str, to: Option<&str>) -> String {
    let prefix = String::from_utf8_lossy(DIFF_XATTR_PREFIX);
    match to {
        Some(to) => format!("{prefix}{offset}/{from}/{to}"),
        None => format!("{prefix}{offset}/{from}"),
    }
}

/// The offset and the two states of a diff xattr's name after [`DIFF_XATTR_PREFIX`].
pub(crate) fn diff_spec(spec: &[u8]) -> birch_core::Result<(usize, &str, Option<&str>)> {
    let bad = || birch_core::Error::Invalid("diff xattr: OFFSET/SNAP1[/SNAP2] expected".into());
    let spec = std::str::from_utf8(spec).map_err(|_| bad())?;
    let mut parts = spec.split('/');
    let offset: usize = parts.next().and_then(|o| o.parse().ok()).ok_or_else(bad)?;
    let from = parts.next().filter(|s| !s.is_empty()).ok_or_else(bad)?;
    let to = parts.next();
    if parts.next().is_some() {
        return Err(bad());
    }
    Ok((offset, from, to))
}

/// The piece of `birch diff` text a `trusted.birch.diff/OFFSET/SNAP1[/SNAP2]` name asks for.
pub(crate) fn diff_piece(fs: &Filesystem, spec: &[u8]) -> birch_core::Result<Vec<u8>> {
    let (offset, from, to) = diff_spec(spec)?;
    // Committed first for the live state; computed once per state and kept for later pieces.
    let text = fs.diff_text(from, to)?;
    let start = offset.min(text.len());
    let end = (start + DIFF_CHUNK).min(text.len());
    Ok(text[start..end].to_vec())
}

/// The filesystem's counters plus the adapter's own: how many FUSE requests this process
/// served over /dev/fuse and over io_uring (`fuse_dev_requests`, `fuse_uring_requests`), by
/// opcode over both (`fuse_op_NAME`, opcodes seen at least once), and `extra` (the LOOKUPs of
/// "." and "..").
pub(crate) fn stats_with_transport(mut json: String, extra: &[(&str, u64)]) -> String {
    let (dev, ring) = fuser::transport_counts();
    if json.ends_with('}') {
        json.pop();
        let sep = if json.trim_end().ends_with('{') {
            ""
        } else {
            ", "
        };
        json.push_str(&format!(
            "{sep}\"fuse_dev_requests\": {dev}, \"fuse_uring_requests\": {ring}"
        ));
        for (name, value) in extra {
            json.push_str(&format!(", \"{name}\": {value}"));
        }
        // Requests by opcode (`fuse_op_lookup`, ...): what a workload costs in round trips.
        let mut by_op = std::collections::BTreeMap::new();
        for (name, n) in fuser::opcode_counts() {
            *by_op.entry(name).or_insert(0u64) += n;
        }
        for (name, n) in by_op {
            json.push_str(&format!(", \"fuse_op_{name}\": {n}"));
        }
        json.push('}');
    }
    json
}

/// The xattr size-probe convention: size 0 asks for the length; too small a buffer is ERANGE.
pub(crate) fn xattr_reply(reply: ReplyXattr, size: u32, value: &[u8]) {
    if size == 0 {
        reply.size(value.len() as u32);
    } else if value.len() > size as usize {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(value);
    }
}

/// Runs a control command (its wire string) from either channel, the root's
/// [`CONTROL_XATTR`] or the daemon's control socket, and then what the adapter owes the
/// kernel: a snapshot made or deleted leaves its view of `/.snapshot` stale.
pub(crate) fn run_control(
    fs: &Filesystem,
    notifier: &OnceLock<fuser::Notifier>,
    invalidator: &Invalidator,
    value: &[u8],
) -> birch_core::Result<()> {
    fs.control(value)?;
    if let Ok(ControlCommand::SnapshotCreate(name) | ControlCommand::SnapshotDelete(name)) =
        ControlCommand::parse(value)
    {
        invalidator.snapshot_changed(name.as_bytes());
        invalidate_attrs(notifier, birch_format::SNAPSHOT_DIR_OBJECTID);
    }
    Ok(())
}

impl BirchFuse {
    /// What the daemon's control socket runs a command with: the same as the root's
    /// [`CONTROL_XATTR`] (`run_control`). Holds the filesystem weakly (a command that comes
    /// after it is gone is `Error::Shutdown`) and the invalidation thread's queue, so that
    /// thread lives as long as this does.
    pub fn control_handler(&self) -> Arc<ControlHandler> {
        let fs = Arc::downgrade(&self.fs);
        let notifier = self.notifier.clone();
        let invalidator = self.invalidator.clone();
        Arc::new(move |command: &ControlCommand| match fs.upgrade() {
            Some(fs) => run_control(&fs, &notifier, &invalidator, command.to_string().as_bytes()),
            None => Err(birch_core::Error::Shutdown),
        })
    }

    /// The adapter's own figures for the stats xattr.
    pub(crate) fn adapter_pairs(&self) -> Vec<(&'static str, u64)> {
        let mut pairs = self.handle_lookups.pairs().to_vec();
        pairs.extend(self.sync_writes.pairs());
        pairs
    }

    pub(crate) fn op_setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        reply: ReplyEmpty,
    ) {
        refuse_if_down!(self, reply);
        if ino.0 == 1 && name.as_bytes() == CONTROL_XATTR {
            match run_control(&self.fs, &self.notifier, &self.invalidator, value) {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno("control", &e)),
            }
            return;
        }
        let acl = name.as_bytes() == ACL_ACCESS;
        // Setting an access ACL clears sgid for a caller outside the file's group without
        // CAP_FSETID (the kernel says so only with FUSE_SETXATTR_EXT, which fuser 0.18 does
        // not parse): for us a caller other than root, as for truncate.
        let groups = (acl && req.uid() != 0).then(|| self.all_groups(req));
        match self.fs.setxattr_by(
            ino_of(ino),
            name.as_bytes(),
            value,
            flags,
            groups.as_deref(),
        ) {
            Ok(()) => {
                if acl {
                    // An access ACL sets the mode (the kernel refreshes it after SETXATTR of
                    // an ACL; other callers of the library have no cache to drop).
                    self.invalidate_attrs(ino.0);
                }
                reply.ok()
            }
            Err(e) => reply.error(errno("setxattr", &e)),
        }
    }

    pub(crate) fn op_getxattr(&self, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        refuse_if_down!(self, reply);
        if ino.0 == 1 && name.as_bytes() == STATS_XATTR {
            xattr_reply(
                reply,
                size,
                stats_with_transport(self.fs.stats_json(), &self.adapter_pairs()).as_bytes(),
            );
            return;
        }
        if ino.0 == 1 && name.as_bytes() == SCRUB_XATTR {
            xattr_reply(reply, size, self.fs.scrub_status().as_bytes());
            return;
        }
        if ino.0 == 1 && name.as_bytes() == ERRORS_XATTR {
            xattr_reply(
                reply,
                size,
                self.fs.files_with_errors_json(DIFF_CHUNK).as_bytes(),
            );
            return;
        }
        if ino.0 == 1 && name.as_bytes() == SNAPSHOTS_XATTR {
            xattr_reply(reply, size, self.fs.snapshots_text().as_bytes());
            return;
        }
        if ino.0 == 1 && name.as_bytes() == ALONE_XATTR {
            match self.fs.serving_alone() {
                Some(name) => xattr_reply(reply, size, name.as_bytes()),
                None => reply.error(Errno::from_i32(libc::ENODATA)),
            }
            return;
        }
        if let (1, Some(spec)) = (ino.0, name.as_bytes().strip_prefix(DIFF_XATTR_PREFIX)) {
            match diff_piece(&self.fs, spec) {
                Ok(piece) => xattr_reply(reply, size, &piece),
                Err(e) => reply.error(errno("getxattr diff", &e)),
            }
            return;
        }
        match self.fs.getxattr(ino_of(ino), name.as_bytes()) {
            Ok(value) => xattr_reply(reply, size, &value),
            Err(e) => reply.error(errno("getxattr", &e)),
        }
    }

    pub(crate) fn op_listxattr(&self, ino: INodeNo, size: u32, reply: ReplyXattr) {
        refuse_if_down!(self, reply);
        match self.fs.listxattr(ino_of(ino)) {
            Ok(names) => xattr_reply(reply, size, &names),
            Err(e) => reply.error(errno("listxattr", &e)),
        }
    }

    pub(crate) fn op_removexattr(&self, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        refuse_if_down!(self, reply);
        match self.fs.removexattr(ino_of(ino), name.as_bytes()) {
            Ok(()) => {
                if name.as_bytes() == ACL_ACCESS {
                    self.invalidate_attrs(ino.0);
                }
                reply.ok()
            }
            Err(e) => reply.error(errno("removexattr", &e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The name `birch diff` reads is the one the adapter parses, with or without SNAP2.
    #[test]
    fn diff_xattr_names_parse_back() -> birch_core::Result<()> {
        for (offset, from, to) in [(0, "s1", None), (120_000, "a", Some("b"))] {
            let name = diff_xattr_name(offset, from, to);
            let spec = name
                .as_bytes()
                .strip_prefix(DIFF_XATTR_PREFIX)
                .expect("the prefix");
            assert_eq!(diff_spec(spec)?, (offset, from, to));
        }
        assert_eq!(diff_xattr_name(0, "s1", None), "trusted.birch.diff/0/s1");
        assert!(diff_spec(b"x/s1").is_err() && diff_spec(b"0/").is_err());
        assert!(diff_spec(b"0/a/b/c").is_err());
        Ok(())
    }
}
