//! A control socket for the daemon: a unix stream socket that takes one [`ControlCommand`]
//! per connection (its wire string, as on the root's `trusted.birch.control` xattr) and answers
//! `ok` or `err ERRNO MESSAGE`, one line. The caller is checked with `SO_PEERCRED`: only a
//! caller with `CAP_SYS_ADMIN` (as the xattr asks) or the mount's owner when that is not root.
//! File descriptors may come with a command (`SCM_RIGHTS`); they are received and closed, and since no command takes one yet, a command that brings any is
//! refused (`EINVAL`), so a later command that does cannot be mistaken for an older one.
//!
//! **Where it lives.** One socket per mount, named from the device number of the FUSE mount
//! (what `stat` of any path on the mount gives as `st_dev`, unique while the mount lives):
//! `ctl-MAJOR:MINOR.sock` in the first of these runtime directories the daemon can use
//! ([`socket_dirs`]): `/run/birch` (mode 0755, created if missing), then, for a daemon not
//! running as root, `$XDG_RUNTIME_DIR/birch` and `/tmp/birch-UID` (mode 0700, its own). A
//! root daemon's socket is thus `/run/birch/ctl-0:53.sock`. The socket file is the mount
//! owner's, mode 0600; `SO_PEERCRED` checks the caller again. The daemon removes it at a
//! clean exit; a socket file left by a killed daemon (connecting is `ECONNREFUSED`) is replaced
//! by the next daemon that gets the same device number. `birch` finds the socket of a mount
//! from its `st_dev` ([`find_socket`]) and falls back to the xattr without one (an older
//! daemon, a socket it may not open).
//! Must not touch: what a command does (the handler given, `BirchFuse::control_handler`),
//! the xattr channel (the adapter's `xattrs`).

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use birch_core::control::ControlCommand;

use crate::ioctls::caller_is_admin;

/// The longest command read (a snapshot name is at most 255 bytes).
const MAX_COMMAND: usize = 4096;

/// How long a connection may take to send its command or read its answer.
const CALLER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The most descriptors received with one command.
const MAX_FDS: usize = 8;

/// What runs a command: the daemon's `Filesystem::control` and what the adapter does after it.
pub type ControlHandler = dyn Fn(&ControlCommand) -> birch_core::Result<()> + Send + Sync;

/// A listening control socket and its thread; dropping it stops the thread and removes the
/// socket file.
pub struct ControlSocket {
    path: PathBuf,
    listener: Arc<UnixListener>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Whether a caller with uid `peer` may send commands to a mount owned by `owner`:
/// `admin`, whether it has `CAP_SYS_ADMIN` (what the `trusted.birch.control` xattr and the
/// shutdown ioctl ask of root too), or the mount's owner when that is not root (a user's own
/// mount). Root without `CAP_SYS_ADMIN` is refused, as on the xattr.
pub fn may_control(peer: u32, admin: bool, owner: u32) -> bool {
    admin || (owner != 0 && peer == owner)
}

impl ControlSocket {
    /// Listens at `path` (a socket left there by a daemon that is gone is replaced; a live one
    /// is `AddrInUse`) for commands from root or `owner`, each run by `handler`.
    pub fn bind(
        path: &Path,
        owner: u32,
        handler: Arc<ControlHandler>,
    ) -> std::io::Result<ControlSocket> {
        let context =
            |e: std::io::Error| std::io::Error::new(e.kind(), format!("{}: {e}", path.display()));
        match UnixStream::connect(path) {
            Ok(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    format!("{}: a daemon already listens there", path.display()),
                ))
            }
            // A socket nobody listens on: left by a daemon that was killed.
            Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => {
                let stale = std::fs::symlink_metadata(path)
                    .map_err(context)?
                    .file_type()
                    .is_socket();
                if stale {
                    log::info!("{}: removing a stale control socket", path.display());
                    std::fs::remove_file(path).map_err(context)?;
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(context(e)),
        }
        let listener = Arc::new(UnixListener::bind(path).map_err(context)?);
        // The owner's alone (root passes anyway); SO_PEERCRED checks again, also for a
        // connection made before this chmod.
        if let Err(e) = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)) {
            let _ = std::fs::remove_file(path);
            return Err(context(e));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            let listener = listener.clone();
            std::thread::Builder::new()
                .name("birch-control".into())
                .spawn(move || {
                    for conn in listener.incoming() {
                        if stop.load(Ordering::Acquire) {
                            return;
                        }
                        match conn {
                            Ok(stream) => serve_one(stream, owner, &*handler),
                            Err(e) => log::warn!("control socket: accept: {e}"),
                        }
                    }
                })?
        };
        Ok(ControlSocket {
            path: path.to_path_buf(),
            listener,
            stop,
            thread: Some(thread),
        })
    }

    /// Where it listens.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ControlSocket {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // SAFETY: shutdown of a listening socket this value keeps open (the Arc): it wakes
        // the thread's accept with an error, and the thread then sees `stop` and ends.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Serves one connection: reads the command and its descriptors, checks the caller, runs it
/// and answers.
fn serve_one(mut stream: UnixStream, owner: u32, handler: &ControlHandler) {
    // The command is read before the caller is judged, so a refused caller still gets its
    // answer (a socket closed before it sent would be EPIPE to it); its descriptors are
    // closed either way.
    // One connection at a time: a caller that sends nothing holds the socket at most this long.
    let _ = stream.set_read_timeout(Some(CALLER_TIMEOUT));
    let _ = stream.set_write_timeout(Some(CALLER_TIMEOUT));
    let received = receive(&stream);
    let answer = match (peer_cred(&stream), received) {
        (Err(e), _) => Err((libc::EIO, format!("SO_PEERCRED: {e}"))),
        (Ok((pid, uid)), _) if !may_control(uid, caller_is_admin(pid, uid), owner) => {
            log::warn!(
                "control socket: pid {pid} (uid {uid}) refused: neither CAP_SYS_ADMIN nor the \
                 mount's owner {owner}"
            );
            Err((
                libc::EPERM,
                "only CAP_SYS_ADMIN or the mount's owner".into(),
            ))
        }
        (Ok(_), Err(e)) => Err((libc::EIO, format!("receiving the command: {e}"))),
        (Ok(_), Ok((_, fds))) if !fds.is_empty() => Err((
            libc::EINVAL,
            format!("no command takes a descriptor ({} passed)", fds.len()),
        )),
        (Ok(_), Ok((bytes, _))) => {
            let bytes = bytes.strip_suffix(b"\n").unwrap_or(&bytes);
            ControlCommand::parse(bytes)
                .and_then(|command| handler(&command))
                .map_err(|e| (e.errno(), e.to_string()))
        }
    };
    let line = match answer {
        Ok(()) => "ok\n".to_string(),
        Err((errno, message)) => format!("err {errno} {}\n", message.replace('\n', " ")),
    };
    let _ = stream.write_all(line.as_bytes());
}

/// The pid and uid of the process at the other end (`SO_PEERCRED`).
fn peer_cred(stream: &UnixStream) -> std::io::Result<(u32, u32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which outlives the call.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((cred.pid as u32, cred.uid))
}

/// Space for the `SCM_RIGHTS` message of [`MAX_FDS`] descriptors, aligned for `cmsghdr`.
#[repr(C)]
struct CmsgBuffer {
    _align: [libc::cmsghdr; 0],
    bytes: [u8; 128],
}

/// Reads the command (one message, up to [`MAX_COMMAND`] bytes) and any descriptors sent
/// with it; the descriptors are owned, so they are closed when dropped.
fn receive(stream: &UnixStream) -> std::io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut data = vec![0u8; MAX_COMMAND];
    let mut control = CmsgBuffer {
        _align: [],
        bytes: [0; 128],
    };
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    };
    // SAFETY: an all-zero msghdr is valid; the pointers set below outlive the recvmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.bytes.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is arithmetic on its argument.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) };
    msg.msg_controllen = (space as usize).min(control.bytes.len());
    // SAFETY: recvmsg with a msghdr whose buffers are valid for their stated lengths;
    // MSG_CMSG_CLOEXEC so a received descriptor never leaks into a child.
    let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: walking the control messages recvmsg filled in, with the libc CMSG helpers;
    // each SCM_RIGHTS payload is an array of descriptors now owned by this process.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let payload = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                for i in 0..payload / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(std::io::Error::other(format!(
            "more than {MAX_FDS} descriptors sent"
        )));
    }
    data.truncate(n as usize);
    Ok((data, fds))
}

/// Sends `command` to the control socket at `path`, with `fds` (`SCM_RIGHTS`), and waits for
/// the answer: an `err ERRNO MESSAGE` answer is that errno with the message.
pub fn send(path: &Path, command: &ControlCommand, fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
    let stream = UnixStream::connect(path)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    exchange(stream, command, fds)
}

/// Sends `command` with `fds` on `stream`, a connection to a control socket, and waits for the
/// answer: an `err ERRNO MESSAGE` answer is an error whose inner error is a [`Refused`].
pub fn exchange(
    mut stream: UnixStream,
    command: &ControlCommand,
    fds: &[BorrowedFd<'_>],
) -> std::io::Result<()> {
    let text = command.to_string();
    let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    send_with_fds(&stream, text.as_bytes(), &raw)?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    parse_answer(answer.trim_end())
}

/// One message of `bytes` with `fds` attached.
fn send_with_fds(stream: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
    if fds.len() > MAX_FDS {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("at most {MAX_FDS} descriptors"),
        ));
    }
    let mut control = CmsgBuffer {
        _align: [],
        bytes: [0; 128],
    };
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr().cast_mut().cast(),
        iov_len: bytes.len(),
    };
    // SAFETY: an all-zero msghdr is valid; the pointers set below outlive the sendmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let payload = std::mem::size_of_val(fds) as u32;
        msg.msg_control = control.bytes.as_mut_ptr().cast();
        // SAFETY: CMSG_SPACE is arithmetic; the header written is inside `control`, which
        // has room for MAX_FDS descriptors (checked above).
        unsafe {
            msg.msg_controllen = libc::CMSG_SPACE(payload) as usize;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(payload) as usize;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(cmsg),
                payload as usize,
            );
        }
    }
    // SAFETY: sendmsg with a msghdr whose buffers are valid for their stated lengths.
    let n = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if n as usize != bytes.len() {
        return Err(std::io::Error::other("command sent in part"));
    }
    Ok(())
}

/// What the daemon answered to a command it refused or that failed: `err ERRNO MESSAGE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// The errno the command failed with (what the xattr channel would have returned).
    pub errno: i32,
    /// The daemon's message.
    pub message: String,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (errno {})", self.message, self.errno)
    }
}

impl std::error::Error for Refused {}

/// `ok`, or `err ERRNO MESSAGE` as an error of that errno's kind carrying a [`Refused`].
fn parse_answer(answer: &str) -> std::io::Result<()> {
    if answer == "ok" {
        return Ok(());
    }
    let bad = || std::io::Error::other(format!("control socket answered {answer:?}"));
    let rest = answer.strip_prefix("err ").ok_or_else(bad)?;
    let (errno, message) = rest.split_once(' ').unwrap_or((rest, ""));
    let errno: i32 = errno.parse().map_err(|_| bad())?;
    let kind = std::io::Error::from_raw_os_error(errno).kind();
    Err(std::io::Error::new(
        kind,
        Refused {
            errno,
            message: message.to_string(),
        },
    ))
}

/// The name of the control socket of the mount whose device number is `major:minor`.
pub fn socket_name(major: u32, minor: u32) -> String {
    format!("ctl-{major}:{minor}.sock")
}

/// The runtime directories a daemon running as `uid` may put its control socket in, in the
/// order tried (and searched by `birch` running as `uid`): `/run/birch`, then for a uid other
/// than root `$XDG_RUNTIME_DIR/birch` (`xdg_runtime_dir`, if set and absolute) and
/// `/tmp/birch-UID`.
pub fn socket_dirs(uid: u32, xdg_runtime_dir: Option<&OsStr>) -> Vec<PathBuf> {
    let mut dirs = vec![PathBuf::from("/run/birch")];
    if uid != 0 {
        if let Some(xdg) = xdg_runtime_dir.map(Path::new).filter(|p| p.is_absolute()) {
            dirs.push(xdg.join("birch"));
        }
        dirs.push(PathBuf::from(format!("/tmp/birch-{uid}")));
    }
    dirs
}

/// The directories for this process ([`socket_dirs`] of its euid and environment).
fn own_socket_dirs() -> Vec<PathBuf> {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    socket_dirs(uid, std::env::var_os("XDG_RUNTIME_DIR").as_deref())
}

/// Makes `dir` ready for a socket of a daemon running as `uid`: created if missing (mode 0755
/// for `/run/birch`, else 0700), and refused unless it is a directory, not a symlink, owned by
/// `uid` or root, that nobody else may write in (`/run/birch`) or use (a private one), and
/// `uid` may write in it.
pub fn prepare_dir(dir: &Path, uid: u32) -> std::io::Result<()> {
    let shared = dir == Path::new("/run/birch");
    let context =
        |e: std::io::Error| std::io::Error::new(e.kind(), format!("{}: {e}", dir.display()));
    match std::fs::DirBuilder::new()
        .mode(if shared { 0o755 } else { 0o700 })
        .create(dir)
    {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(context(e)),
    }
    let meta = std::fs::symlink_metadata(dir).map_err(context)?;
    if let Err(why) = trusted_dir(dir, &meta, uid) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("{}: {why}", dir.display()),
        ));
    }
    let cpath = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "a NUL byte"))?;
    // SAFETY: access(2) with a valid NUL-terminated path.
    if unsafe { libc::access(cpath.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
        return Err(context(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Whether `dir` (whose `lstat` is `meta`) may hold the control sockets of `uid`: a directory,
/// not a symlink, owned by `uid` or root, that nobody else may write in (`/run/birch`), or
/// use at all (a private one).
fn trusted_dir(dir: &Path, meta: &std::fs::Metadata, uid: u32) -> Result<(), String> {
    if !meta.file_type().is_dir() {
        return Err("not a directory".into());
    }
    if meta.uid() != uid && meta.uid() != 0 {
        return Err(format!("owned by uid {}, not {uid} or root", meta.uid()));
    }
    let shared = dir == Path::new("/run/birch");
    if shared && meta.mode() & 0o022 != 0 {
        return Err("others may write in it (mode should be 0755)".into());
    }
    if !shared && meta.mode() & 0o077 != 0 {
        return Err("others may use it (mode should be 0700)".into());
    }
    Ok(())
}

/// Where this daemon's control socket for the mount `major:minor` goes: in the first of its
/// [`socket_dirs`] that [`prepare_dir`] accepts. The error names every directory tried.
pub fn socket_path_for(major: u32, minor: u32) -> std::io::Result<PathBuf> {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let mut why = Vec::new();
    for dir in own_socket_dirs() {
        match prepare_dir(&dir, uid) {
            Ok(()) => return Ok(dir.join(socket_name(major, minor))),
            Err(e) => why.push(e.to_string()),
        }
    }
    Err(std::io::Error::other(format!(
        "no runtime directory for the control socket: {}",
        why.join("; ")
    )))
}

/// The control socket of the mount `path` is on (its `st_dev`), as `birch` looks for it: a
/// socket file of that name, owned by root or this process's euid, in one of its
/// [`socket_dirs`] that nobody else may write in. `None` without one.
pub fn find_socket(path: &Path) -> Option<PathBuf> {
    let dev = std::fs::metadata(path).ok()?.dev();
    let name = socket_name(libc::major(dev), libc::minor(dev));
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    own_socket_dirs()
        .into_iter()
        .filter(|dir| {
            std::fs::symlink_metadata(dir).is_ok_and(|meta| trusted_dir(dir, &meta, uid).is_ok())
        })
        .map(|dir| dir.join(&name))
        .find(|p| {
            std::fs::symlink_metadata(p)
                .is_ok_and(|m| m.file_type().is_socket() && (m.uid() == uid || m.uid() == 0))
        })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use birch_core::device::MemDevice;
    use birch_core::{Filesystem, MkfsOptions, OpenOptions};

    use super::*;

    fn errno_of(result: std::io::Result<()>) -> Option<i32> {
        let e = result.expect_err("an error answer");
        let text = e.to_string();
        let at = text.rfind("(errno ")?;
        text[at + 7..].trim_end_matches(')').parse().ok()
    }

    /// Commands sent over the socket run on the filesystem; a bad one, or one that brings a
    /// descriptor, is EINVAL; the socket file goes with the socket.
    #[test]
    fn commands_run_over_the_socket() -> birch_core::Result<()> {
        let dev = Arc::new(MemDevice::new(64 << 20));
        Filesystem::mkfs(dev.clone(), &MkfsOptions::default())?;
        let options = OpenOptions {
            commit_interval: None,
            ..Default::default()
        };
        let fs = Arc::new(Filesystem::open_device(dev, options)?);
        let dir = std::env::temp_dir().join(format!("birch-control-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("control.sock");
        let weak = Arc::downgrade(&fs);
        let handler: Arc<ControlHandler> =
            Arc::new(move |command: &ControlCommand| match weak.upgrade() {
                Some(fs) => fs.control(command.to_string().as_bytes()),
                None => Err(birch_core::Error::Invalid("gone".into())),
            });
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        let socket = ControlSocket::bind(&path, me, handler.clone()).expect("bind");
        assert!(
            ControlSocket::bind(&path, me, handler).is_err(),
            "a live socket is not replaced"
        );

        send(&path, &ControlCommand::Sync, &[]).expect("sync");
        send(&path, &ControlCommand::SnapshotCreate("s1".into()), &[]).expect("create");
        assert!(
            fs.snapshots_text().contains("s1"),
            "{}",
            fs.snapshots_text()
        );
        assert_eq!(
            errno_of(send(
                &path,
                &ControlCommand::SnapshotCreate("s1".into()),
                &[]
            )),
            Some(libc::EEXIST)
        );
        // A command no parser accepts, sent raw.
        let raw = UnixStream::connect(&path).expect("connect");
        send_with_fds(&raw, b"bogus", &[]).expect("send");
        let mut answer = String::new();
        (&raw).read_to_string(&mut answer).expect("answer");
        assert!(
            answer.starts_with(&format!("err {} ", libc::EINVAL)),
            "{answer}"
        );
        // A descriptor passed with a command: received (SCM_RIGHTS), closed, refused.
        let null = std::fs::File::open("/dev/null").expect("/dev/null");
        use std::os::fd::AsFd;
        assert_eq!(
            errno_of(send(&path, &ControlCommand::Sync, &[null.as_fd()])),
            Some(libc::EINVAL)
        );
        send(&path, &ControlCommand::SnapshotDelete("s1".into()), &[]).expect("delete");
        assert!(!fs.snapshots_text().contains("s1"));

        drop(socket);
        assert!(!path.exists(), "the socket file is removed");
        let _ = std::fs::remove_dir(&dir);
        fs.close()
    }

    /// End to end through SO_PEERCRED: a caller running as `nobody` (65534) is refused with
    /// EPERM, and its command does not run. Needs root (to run the caller as another uid) and
    /// python3 (the caller); skipped without them.
    #[test]
    fn a_caller_neither_root_nor_owner_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        use std::os::unix::process::CommandExt;
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: needs root");
            return;
        }
        let dir = std::env::temp_dir().join(format!("birch-control-cred-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let path = dir.join("control.sock");
        let ran = Arc::new(AtomicBool::new(false));
        let handler: Arc<ControlHandler> = {
            let ran = ran.clone();
            Arc::new(move |_: &ControlCommand| {
                ran.store(true, Ordering::SeqCst);
                Ok(())
            })
        };
        let socket = ControlSocket::bind(&path, 0, handler).expect("bind");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let script = "import socket,sys\n\
                      s=socket.socket(socket.AF_UNIX)\n\
                      s.connect(sys.argv[1])\n\
                      s.send(b'sync')\n\
                      print(s.recv(200).decode(), end='')\n";
        let out = match std::process::Command::new("python3")
            .arg("-c")
            .arg(script)
            .arg(&path)
            .uid(65534)
            .gid(65534)
            .output()
        {
            Ok(out) => out,
            Err(e) => {
                eprintln!("skipped: python3: {e}");
                return;
            }
        };
        let answer = String::from_utf8_lossy(&out.stdout);
        assert!(
            answer.starts_with(&format!("err {} ", libc::EPERM)),
            "{answer:?} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!ran.load(Ordering::SeqCst), "the command did not run");
        // Root, the same socket: allowed.
        send(&path, &ControlCommand::Sync, &[]).expect("root may");
        assert!(ran.load(Ordering::SeqCst));
        drop(socket);
        let _ = std::fs::remove_dir(&dir);
    }

    /// The socket's name comes from the mount's device number; root's lives in /run/birch
    /// alone, another user's also in its runtime directory and its own directory in /tmp.
    #[test]
    fn socket_paths_follow_the_rule() {
        assert_eq!(socket_name(0, 53), "ctl-0:53.sock");
        assert_eq!(
            socket_dirs(0, Some(OsStr::new("/run/user/0"))),
            [PathBuf::from("/run/birch")]
        );
        assert_eq!(
            socket_dirs(1000, Some(OsStr::new("/run/user/1000"))),
            [
                PathBuf::from("/run/birch"),
                PathBuf::from("/run/user/1000/birch"),
                PathBuf::from("/tmp/birch-1000")
            ]
        );
        assert_eq!(
            socket_dirs(1000, Some(OsStr::new("relative"))),
            [
                PathBuf::from("/run/birch"),
                PathBuf::from("/tmp/birch-1000")
            ]
        );
    }

    /// A socket file nobody listens on (its daemon killed) is replaced; a file that is not a
    /// socket is left alone and the bind fails.
    #[test]
    fn a_stale_socket_is_replaced() {
        let dir = std::env::temp_dir().join(format!("birch-control-stale-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join(socket_name(0, 99));
        // A socket whose listener is gone, as a SIGKILLed daemon leaves it.
        drop(UnixListener::bind(&path).expect("bind"));
        assert!(path.exists(), "the stale file stays");
        let ran = Arc::new(AtomicBool::new(false));
        let handler: Arc<ControlHandler> = {
            let ran = ran.clone();
            Arc::new(move |_: &ControlCommand| {
                ran.store(true, Ordering::SeqCst);
                Ok(())
            })
        };
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        let socket = ControlSocket::bind(&path, me, handler.clone()).expect("stale replaced");
        let mode = std::fs::metadata(&path).expect("socket").mode() & 0o777;
        assert_eq!(mode, 0o600, "the owner's alone");
        send(&path, &ControlCommand::Sync, &[]).expect("sync");
        assert!(ran.load(Ordering::SeqCst));
        drop(socket);
        assert!(!path.exists());
        std::fs::write(&path, b"not a socket").expect("file");
        assert!(ControlSocket::bind(&path, me, handler).is_err());
        assert_eq!(std::fs::read(&path).expect("kept"), b"not a socket");
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_dir(&dir);
    }

    /// A private directory is made 0700; one others may use, or a symlink, is refused.
    #[test]
    fn private_socket_dirs_are_checked() {
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        let base = std::env::temp_dir().join(format!("birch-control-dirs-{}", std::process::id()));
        std::fs::create_dir_all(&base).expect("temp dir");
        let private = base.join("mine");
        prepare_dir(&private, me).expect("made");
        assert_eq!(
            std::fs::metadata(&private).expect("dir").mode() & 0o777,
            0o700
        );
        prepare_dir(&private, me).expect("made before");
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        assert!(prepare_dir(&private, me).is_err(), "open to others");
        let link = base.join("link");
        std::os::unix::fs::symlink(&private, &link).expect("symlink");
        assert!(prepare_dir(&link, me).is_err(), "a symlink");
        let _ = std::fs::remove_file(&link);
        let _ = std::fs::remove_dir(&private);
        let _ = std::fs::remove_dir(&base);
    }

    /// A caller with CAP_SYS_ADMIN and a non-root owner may send commands; nobody else.
    #[test]
    fn only_an_admin_or_the_owner_may_control() {
        assert!(may_control(0, true, 1000));
        assert!(may_control(1000, false, 1000));
        assert!(!may_control(1001, false, 1000));
        // Root without CAP_SYS_ADMIN, on root's mount and on a user's.
        assert!(!may_control(0, false, 0));
        assert!(!may_control(0, false, 1000));
        assert!(may_control(0, true, 0));
    }

    /// SO_PEERCRED names this process's own pid and uid at the other end of a pair.
    #[test]
    fn the_peer_is_who_connected() {
        let (a, _b) = UnixStream::pair().expect("pair");
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        assert_eq!(
            peer_cred(&a).expect("SO_PEERCRED"),
            (std::process::id(), uid)
        );
    }
}
