//! The link between a mount daemon and the `birch mount` command that started it (its
//! "front-end"): a pipe whose write end the daemon inherits, named by the environment variable
//! [`READY_FD_ENV`]. It makes a mount command's success mean that *its own* daemon mounted
//! (not that something is mounted at the mount point), and makes a daemon whose command gave
//! up or was killed stop instead of mounting later, unasked (DESIGN §12.1, "The mount command
//! and its daemon").
//!
//! The daemon writes [`READY`] once its mount is live; the front-end reports success only on
//! that line. The front-end's death (or its giving up, which closes its end) shows at the
//! daemon as an error condition on the pipe: while the daemon waits for the image lock a
//! watcher thread ends the process; after the lock, the daemon checks before it mounts and,
//! if its `READY` finds no reader, unmounts what it just mounted.
//! Owns: the pipe's daemon end, the watcher and the protocol's words. Must not touch: the
//! front-end's side (birch-tools `mount.rs`), opening the image, the FUSE session.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, PoisonError};

/// The environment variable naming the write end of the front-end's pipe in the daemon.
pub const READY_FD_ENV: &str = "BIRCH_MOUNT_READY_FD";

/// What the daemon writes once its mount is live.
pub const READY: &[u8] = b"ready\n";

/// Why a daemon does not mount: the `birch mount` that started it is gone.
pub const GONE: &str =
    "the mount command that started this daemon is gone (it gave up or was killed): not mounting";

/// The daemon's end of the pipe to the command that started it.
pub struct FrontEnd {
    pipe: File,
    /// True while the daemon waits for the image (its lock, a takeover): the watcher may end
    /// the process then, and only then. Cleared under this lock, so the watcher never ends a
    /// daemon that has moved on.
    waiting: Arc<Mutex<bool>>,
}

impl FrontEnd {
    /// The front-end's pipe, if this daemon was started by a `birch mount` that passed one;
    /// the variable is removed, so nothing the daemon starts inherits it. `None` for a daemon
    /// run by hand (`birch mount -f`): it mounts as it always did. Call it first thing in the
    /// daemon's process, before any other thread exists (it changes the environment).
    pub fn from_env() -> Option<FrontEnd> {
        let value = std::env::var(READY_FD_ENV).ok()?;
        // SAFETY: removing a variable while no other thread reads the environment: this runs
        // at the daemon's start, before it starts threads.
        unsafe { std::env::remove_var(READY_FD_ENV) };
        let fd: i32 = match value.parse() {
            Ok(fd) if fd > 2 => fd,
            _ => {
                log::warn!("{READY_FD_ENV}={value:?} is not a descriptor; ignored");
                return None;
            }
        };
        // SAFETY: F_GETFD on any integer is harmless; it tells whether the descriptor is open.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
            log::warn!("{READY_FD_ENV}={fd}: no such open descriptor; ignored");
            return None;
        }
        // SAFETY: the descriptor is open (checked above) and was handed to this process for it
        // alone; from here the File owns it. FD_CLOEXEC keeps it from children.
        let pipe = unsafe {
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
            File::from(OwnedFd::from_raw_fd(fd))
        };
        Some(FrontEnd::from_file(pipe))
    }

    fn from_file(pipe: File) -> FrontEnd {
        FrontEnd {
            pipe,
            waiting: Arc::new(Mutex::new(false)),
        }
    }

    /// Whether the front-end is gone: its end of the pipe is closed (it gave up, or died).
    pub fn gone(&self) -> bool {
        hung_up(self.pipe.as_raw_fd(), 0)
    }

    /// Starts watching while the daemon waits for the image: if the front-end goes meanwhile,
    /// the process ends (exit status 1, saying why) instead of mounting when the wait is over.
    /// Ending here is safe: nothing is open yet but, at worst, a lock just taken, which the
    /// process's end gives back (an RBD image's cluster lock as a killed daemon's: to the
    /// next takeover or the watch's expiry). Call [`FrontEnd::done_waiting`] once the image is
    /// open.
    pub fn watch_while_waiting(&self) {
        *self.waiting.lock().unwrap_or_else(PoisonError::into_inner) = true;
        let waiting = self.waiting.clone();
        let fd = match self.pipe.try_clone() {
            Ok(f) => f,
            Err(e) => {
                log::warn!("cannot watch the mount command while waiting ({e})");
                return;
            }
        };
        let spawned = std::thread::Builder::new()
            .name("front-end watch".into())
            .spawn(move || loop {
                let gone = hung_up(fd.as_raw_fd(), 200);
                let still = waiting.lock().unwrap_or_else(PoisonError::into_inner);
                if !*still {
                    return;
                }
                if gone {
                    log::error!("{GONE}");
                    // _exit, not exit: no atexit handlers or library destructors while other
                    // threads (librados's, mid-connect) still run.
                    // SAFETY: _exit ends the process at once; nothing is touched after it.
                    unsafe { libc::_exit(1) };
                }
            });
        if let Err(e) = spawned {
            log::warn!("cannot watch the mount command while waiting ({e})");
        }
    }

    /// The wait is over (the image is open): the watcher stops without ending anything.
    pub fn done_waiting(&self) {
        *self.waiting.lock().unwrap_or_else(PoisonError::into_inner) = false;
    }

    /// Tells the front-end the mount is live. An error means nobody reads any more: the
    /// front-end went between the daemon's last check and its mount, and the caller unmounts.
    pub fn ready(mut self) -> std::io::Result<()> {
        self.done_waiting();
        self.pipe.write_all(READY)
    }
}

/// Whether the pipe's write end `fd` reports its reader gone (POLLERR; POLLHUP for some
/// kernels' sockets), waiting at most `millis` for it.
fn hung_up(fd: i32, millis: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: 0,
        revents: 0,
    };
    // SAFETY: one pollfd that lives through the call.
    let n = unsafe { libc::poll(&mut p, 1, millis) };
    n > 0 && p.revents & (libc::POLLERR | libc::POLLHUP) != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::time::Duration;

    fn pipe() -> (File, File) {
        let mut fds = [0; 2];
        // SAFETY: pipe2 fills the two-element array.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: both descriptors were just made and are owned here alone.
        unsafe {
            (
                File::from(OwnedFd::from_raw_fd(fds[0])),
                File::from(OwnedFd::from_raw_fd(fds[1])),
            )
        }
    }

    #[test]
    fn a_closed_reader_is_gone_and_ready_fails() {
        let (reader, writer) = pipe();
        let front = FrontEnd::from_file(writer);
        assert!(!front.gone(), "the reader is open");
        drop(reader);
        assert!(front.gone(), "the reader closed");
        assert!(front.ready().is_err(), "nobody reads the ready line");
    }

    #[test]
    fn ready_reaches_an_open_reader() {
        let (mut reader, writer) = pipe();
        FrontEnd::from_file(writer).ready().expect("ready");
        let mut got = Vec::new();
        reader.read_to_end(&mut got).expect("read");
        assert_eq!(
            got, READY,
            "the line, then end of file (the daemon's end closed)"
        );
    }

    #[test]
    fn done_waiting_stops_the_watch_without_ending_the_process() {
        let (reader, writer) = pipe();
        let front = FrontEnd::from_file(writer);
        front.watch_while_waiting();
        front.done_waiting();
        // The watcher sees the reader go only after the wait is over: it must return, not
        // end this test process.
        drop(reader);
        std::thread::sleep(Duration::from_millis(500));
        assert!(front.gone());
    }
}
