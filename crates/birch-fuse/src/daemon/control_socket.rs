//! A control socket for the daemon: a unix stream socket that takes one [`ControlCommand`]
//! per connection (its wire string, as on the root's `trusted.birch.control` xattr) and answers
//! `ok` or `err ERRNO MESSAGE`, one line. The caller is checked with `SO_PEERCRED`: root or the
//! mount's owner only. File descriptors may come with a command (`SCM_RIGHTS`); they are
//! received and closed, and since no command takes one yet, a command that brings any is
//! refused (`EINVAL`), so a later command that does cannot be mistaken for an older one.
//! Not started by `serve` yet (where the socket lives is a user-visible choice still to make):
//! see the issue. Must not touch: what a command does (the handler given, e.g.
//! `Filesystem::control`), the xattr channel (the adapter's `xattrs`).

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use birch_core::control::ControlCommand;

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

/// Whether a caller with uid `peer` may send commands to a mount owned by `owner`.
pub fn may_control(peer: u32, owner: u32) -> bool {
    peer == 0 || peer == owner
}

impl ControlSocket {
    /// Listens at `path` (a socket left there by a daemon that is gone is replaced; a live one
    /// is `AddrInUse`) for commands from root or `owner`, each run by `handler`.
    pub fn bind(
        path: &Path,
        owner: u32,
        handler: Arc<ControlHandler>,
    ) -> std::io::Result<ControlSocket> {
        if UnixStream::connect(path).is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!("{}: a daemon already listens there", path.display()),
            ));
        }
        if std::fs::symlink_metadata(path).is_ok_and(|m| {
            use std::os::unix::fs::FileTypeExt;
            m.file_type().is_socket()
        }) {
            std::fs::remove_file(path)?;
        }
        let listener = Arc::new(
            UnixListener::bind(path)
                .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?,
        );
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
    let answer = match (peer_uid(&stream), received) {
        (Err(e), _) => Err((libc::EIO, format!("SO_PEERCRED: {e}"))),
        (Ok(uid), _) if !may_control(uid, owner) => {
            log::warn!("control socket: uid {uid} refused (neither root nor the owner {owner})");
            Err((libc::EPERM, "only root or the mount's owner".into()))
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

/// The uid of the process at the other end (`SO_PEERCRED`).
fn peer_uid(stream: &UnixStream) -> std::io::Result<u32> {
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
    Ok(cred.uid)
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
    let mut stream = UnixStream::connect(path)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
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

/// `ok`, or `err ERRNO MESSAGE` as an error of that errno.
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
        format!("{message} (errno {errno})"),
    ))
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

    /// Root and the owner may send commands; nobody else.
    #[test]
    fn only_root_or_the_owner_may_control() {
        assert!(may_control(0, 1000));
        assert!(may_control(1000, 1000));
        assert!(!may_control(1001, 1000));
    }

    /// SO_PEERCRED names this process's own uid at the other end of a pair.
    #[test]
    fn the_peer_is_who_connected() {
        let (a, _b) = UnixStream::pair().expect("pair");
        // SAFETY: geteuid has no preconditions.
        assert_eq!(peer_uid(&a).expect("SO_PEERCRED"), unsafe {
            libc::geteuid()
        });
    }
}
