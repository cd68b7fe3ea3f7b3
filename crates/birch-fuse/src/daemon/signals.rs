//! The daemon's signals: SIGTERM, SIGINT and SIGHUP are blocked in every thread of the
//! daemon and waited for by one thread, which unmounts the daemon's mount and every bind mount
//! of it (the session then ends with the last, and the daemon commits and exits).
//! Must not touch: the session or the filesystem (the serve loop's end does the final commit).

use std::path::Path;

use super::mountinfo::mounts_of_source;

fn signal_set() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise a sigset_t we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGHUP);
        set
    }
}

pub(crate) fn block_signals() {
    let set = signal_set();
    // SAFETY: blocks the signals in this thread; threads spawned later inherit the mask.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
}

/// Waits for SIGTERM, SIGINT or SIGHUP, then unmounts the daemon's mount at `target` and every
/// bind mount of it (every mount of `image`): the session ends with the last.
pub(crate) fn wait_for_signal_then_unmount(target: &Path, image: &Path) {
    let set = signal_set();
    let mut sig: libc::c_int = 0;
    // SAFETY: sigwait on a valid set with the signals blocked in every thread.
    unsafe { libc::sigwait(&set, &mut sig) };
    log::warn!("signal {sig}: unmounting {}", target.display());
    let mut targets = mounts_of_source(image);
    targets.retain(|t| Path::new(t) != target);
    targets.insert(0, target.to_string_lossy().into_owned());
    for t in targets.iter().rev() {
        let Ok(c) = std::ffi::CString::new(t.as_bytes()) else {
            continue;
        };
        // SAFETY: umount2 with a valid NUL-terminated path.
        let rc = unsafe { libc::umount2(c.as_ptr(), 0) };
        if rc != 0 {
            // SAFETY: as above.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
    }
}
