//! FUSE over io_uring for the daemon's session: the fuse module's `enable_uring` (read, and
//! set when a mount asks for the ring with `-o uring` as root), whether a mount gets a ring,
//! and the ring's settings (queue depth, the test hook that breaks its registration).
//! Must not touch: the ring transport itself (third_party/fuser) or how requests are served.

use std::path::Path;

use super::mountinfo::canonical;

/// Ring entries per io_uring queue: requests handed to a waiter (fsync, write-through WRITEs)
/// hold their entry until answered, so a queue needs room beyond the `waiters=` default.
const URING_QUEUE_DEPTH: usize = 64;

const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

/// The fuse module's `enable_uring`, or `None` on a kernel without FUSE over io_uring.
pub fn uring_param() -> Option<bool> {
    let v = std::fs::read_to_string(ENABLE_URING).ok()?;
    Some(v.trim() == "Y" || v.trim() == "1")
}

/// Sets the fuse module's `enable_uring` (needs root); a failure is logged.
pub fn set_uring_param(on: bool) {
    if let Err(e) = std::fs::write(ENABLE_URING, if on { "Y" } else { "N" }) {
        log::warn!("uring: cannot set {ENABLE_URING}: {e}");
    }
}

/// The io_uring transport's settings for a mount at `mountpoint`.
/// The ring settings of a mount whose `uring` option is `uring` (`Some(true)`: `-o uring`,
/// `Some(false)`: `-o nouring`, `None`: the default), or none when it serves over /dev/fuse
/// alone: `-o nouring`, or `allowed` (given whether the ring was asked for: `uring_allowed`)
/// says no.
pub(crate) fn ring_for(
    uring: Option<bool>,
    mountpoint: &Path,
    allowed: impl FnOnce(bool) -> bool,
) -> Option<fuser::UringOptions> {
    let asked = uring == Some(true);
    (uring != Some(false) && allowed(asked)).then(|| uring_options(mountpoint, asked))
}

fn uring_options(mountpoint: &Path, asked: bool) -> fuser::UringOptions {
    fuser::UringOptions {
        queue_depth: URING_QUEUE_DEPTH,
        mountpoint: Some(canonical(mountpoint)),
        // Test hook for the fallback (tests/mount/uring-test.sh): registration fails.
        break_register: std::env::var_os("BIRCH_URING_BREAK_REGISTER").is_some(),
        // A fallback to /dev/fuse warns only when the ring was asked for, as in
        // `uring_allowed`.
        asked,
    }
}

/// Loads the fuse module if it is not loaded yet (`/dev/fuse` opened once: the kernel loads the
/// module on a first open), so that its parameters, `enable_uring` among them, can be read.
pub fn load_fuse_module() {
    let _ = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse");
}

/// Whether this mount may serve over FUSE over io_uring: the fuse module's `enable_uring` is
/// Y. It is a machine-wide setting (every FUSE server that asks may then use io_uring), so the
/// default leaves it to the administrator (`scripts/setup.sh` turns it on) and says once, at
/// info level, how to turn it on; a mount that asks for the ring (`asked`, `-o uring`) turns
/// it on itself when run as root, and warns when it cannot have it.
pub(crate) fn uring_allowed(asked: bool) -> bool {
    load_fuse_module();
    let cannot = |why: String| {
        if asked {
            log::warn!("uring: {why}; serving over /dev/fuse");
        } else {
            log::info!("uring: {why}; serving over /dev/fuse");
        }
    };
    match std::fs::read_to_string(ENABLE_URING) {
        Ok(v) if v.trim() == "Y" || v.trim() == "1" => true,
        Ok(_) if !asked => {
            cannot(format!(
                "the kernel's FUSE over io_uring is off ({ENABLE_URING} is N; `echo Y > {ENABLE_URING}`, as scripts/setup.sh does, turns it on for every mount, -o uring for this one)"
            ));
            false
        }
        Ok(_) => match std::fs::write(ENABLE_URING, "Y") {
            Ok(()) => {
                log::warn!(
                    "uring: set {ENABLE_URING} to Y, as -o uring asks (it was N; it stays Y for every FUSE mount)"
                );
                true
            }
            Err(e) => {
                cannot(format!("cannot set {ENABLE_URING}: {e}"));
                false
            }
        },
        Err(e) => {
            cannot(format!(
                "{ENABLE_URING}: {e} (a kernel without FUSE over io_uring, before 6.14)"
            ));
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ring that was only the default falls back to /dev/fuse at info level; one asked for
    /// with `-o uring` (or by crashtest) warns; `-o nouring` makes none.
    #[test]
    fn a_ring_fallback_warns_only_when_the_ring_was_asked_for() {
        let at = Path::new("/nonexistent-birch-mountpoint");
        let default = ring_for(None, at, |asked| !asked).expect("the default ring");
        assert_eq!(default.fallback_level(), log::Level::Info);
        let asked = ring_for(Some(true), at, |asked| asked).expect("the ring asked for");
        assert_eq!(asked.fallback_level(), log::Level::Warn);
        assert!(ring_for(Some(false), at, |_| panic!("-o nouring asks nothing")).is_none());
        assert!(ring_for(None, at, |_| false).is_none(), "not allowed");
    }
}
