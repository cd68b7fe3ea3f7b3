//! What the in-process mount tests of this crate share: why a FUSE mount cannot be made here.

use std::path::Path;

/// Why an in-process FUSE mount cannot be made here (not root, no /dev/fuse), if it cannot;
/// such tests then pass, saying why.
pub fn mount_unavailable() -> Option<&'static str> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (mount(2))");
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("/dev/fuse is absent");
    }
    None
}
