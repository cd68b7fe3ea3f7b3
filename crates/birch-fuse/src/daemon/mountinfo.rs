//! The few /proc/self/mountinfo readings the daemon and the CLI share: canonical paths, the
//! kernel's escapes, and the mounts of an image.
//! Must not touch: the mounts themselves (no mount(2) or umount(2) here).

use std::path::{Path, PathBuf};

/// `path` with symlinks resolved, or as given when that fails (a path the kernel shows).
pub fn canonical(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

/// The mountpoints of every FUSE mount whose source is `image` (one daemon's mount and its
/// bind mounts), oldest first.
pub fn mounts_of_source(image: &Path) -> Vec<String> {
    let want = image.to_string_lossy().into_owned();
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for line in info.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(dash) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        if fields.get(dash + 1).is_some_and(|t| t.starts_with("fuse"))
            && fields.get(dash + 2).map(|s| unescape(s)) == Some(want.clone())
        {
            found.extend(fields.get(4).map(|m| unescape(m)));
        }
    }
    found
}

/// The device number (`MAJOR:MINOR`, what `stat` gives as `st_dev`) of the mount at
/// `mountpoint` (canonical), the topmost if several are stacked there; read from mountinfo, so
/// it asks nothing of the filesystem (the daemon calls it before it serves requests).
pub fn mount_device(mountpoint: &Path) -> Option<(u32, u32)> {
    let want = mountpoint.to_string_lossy().into_owned();
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mut found = None;
    for line in info.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        if fields.get(4).map(|m| unescape(m)) == Some(want.clone()) {
            found = fields
                .get(2)
                .and_then(|d| d.split_once(':'))
                .and_then(|(major, minor)| Some((major.parse().ok()?, minor.parse().ok()?)));
        }
    }
    found
}

/// A mountinfo field with the kernel's octal escapes (space, tab, newline, backslash) undone.
pub fn unescape(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}
