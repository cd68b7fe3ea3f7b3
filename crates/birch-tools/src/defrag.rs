//! `birch defrag --compress[=CODEC] [-r] PATH...`: rewrite files of a live mount compressed
//! (DESIGN §16.4). Each regular file is asked of its daemon with `BTRFS_IOC_DEFRAG_RANGE` and
//! its compress flag (btrfs's zstd, or its lzo for lz4), as `btrfs filesystem defragment -c`
//! sends it; the daemon runs `Filesystem::compress_range` on it. An ioctl, not an xattr: a
//! write of an xattr moves the file's ctime. Prints each file's size on disk before and after.
//!
//! Owns: the command line's walk (directories only with `-r`, never across a mount), the check
//! that a path is on a birch mount before anything is sent, and the report. Must not touch:
//! what a rewrite does (birch-core) or how the adapter answers (birch-fuse).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use birch_format::codec::Codec;

/// `statfs` `f_type` of every FUSE mount.
const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

/// What one file's rewrite did to its size on disk.
struct Done {
    size: u64,
    before: u64,
    after: u64,
}

pub(crate) fn defrag(paths: &[PathBuf], compress: &str, recursive: bool) -> ExitCode {
    let Some(codec) = Codec::parse(compress).filter(|c| *c != Codec::None) else {
        eprintln!(
            "birch defrag: --compress={compress}: expected zstd, zstd:N (N from 1 to 19) or lz4"
        );
        return ExitCode::from(2);
    };
    let mut files: Vec<PathBuf> = Vec::new();
    let mut failed = 0u64;
    for path in paths {
        match collect(path, recursive, &mut files) {
            Ok(()) => {}
            Err(e) => {
                eprintln!("birch defrag: {}: {e}", path.display());
                failed += 1;
            }
        }
    }
    // The kernel's dirty pages of these files reach the daemon first (a FUSE mount's
    // writeback never does on its own before the rewrite).
    let mut synced: Vec<u64> = Vec::new();
    for file in &files {
        if let Ok(meta) = std::fs::metadata(file) {
            if !synced.contains(&meta.dev()) {
                synced.push(meta.dev());
                if let Some(dir) = file.parent() {
                    let _ = crate::mount::syncfs(dir);
                }
            }
        }
    }
    let (mut before, mut after, mut bytes, mut rewritten) = (0u64, 0u64, 0u64, 0u64);
    for file in &files {
        match rewrite(file, codec) {
            Ok(done) => {
                println!(
                    "{}: {} bytes, {} KiB -> {} KiB on disk",
                    file.display(),
                    done.size,
                    done.before / 1024,
                    done.after / 1024
                );
                before += done.before;
                after += done.after;
                bytes += done.size;
                rewritten += 1;
            }
            Err(e) => {
                eprintln!("birch defrag: {}: {e}", file.display());
                failed += 1;
            }
        }
    }
    println!(
        "birch defrag: {} files ({bytes} bytes) with {}: {} KiB -> {} KiB on disk{}",
        rewritten,
        codec.name(),
        before / 1024,
        after / 1024,
        if failed > 0 {
            format!(", {failed} failed")
        } else {
            String::new()
        }
    );
    if failed > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// The regular files `path` names: itself, or with `recursive` every regular file under a
/// directory on the same mount. Anything else named explicitly is an error; met in a walk,
/// skipped.
fn collect(path: &Path, recursive: bool, out: &mut Vec<PathBuf>) -> Result<(), String> {
    let meta = std::fs::symlink_metadata(path).map_err(|e| e.to_string())?;
    if meta.is_file() {
        on_birch(path)?;
        out.push(path.to_path_buf());
        return Ok(());
    }
    if !meta.is_dir() {
        return Err("not a regular file or a directory".into());
    }
    if !recursive {
        return Err("a directory (use -r)".into());
    }
    on_birch(path)?;
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        for entry in entries {
            let entry = entry.map_err(|e| format!("{}: {e}", dir.display()))?;
            let Ok(m) = entry.path().symlink_metadata() else {
                continue;
            };
            if m.dev() != meta.dev() {
                continue;
            }
            if m.is_dir() {
                stack.push(entry.path());
            } else if m.is_file() {
                out.push(entry.path());
            }
        }
    }
    out.sort();
    Ok(())
}

/// Whether `path` is on a birch mount: a FUSE filesystem whose daemon has a control socket
/// for it. Checked before anything is sent (on btrfs the same ioctl would defragment).
fn on_birch(path: &Path) -> Result<(), String> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| "a NUL in the path")?;
    // SAFETY: statfs with a NUL-terminated path and a zeroed struct it fills.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error().to_string());
    }
    if st.f_type as i64 != FUSE_SUPER_MAGIC
        || birch_fuse::daemon::control_socket::find_socket(path).is_none()
    {
        return Err("not on a birch mount".into());
    }
    Ok(())
}

/// Asks the daemon to rewrite `file` (`BTRFS_IOC_DEFRAG_RANGE` with the compress flag, on a
/// read-only descriptor); its size and blocks before and after.
fn rewrite(file: &Path, codec: Codec) -> Result<Done, String> {
    use std::os::fd::AsRawFd;
    let handle = std::fs::File::open(file).map_err(|e| e.to_string())?;
    let before = handle.metadata().map_err(|e| e.to_string())?;
    let arg = birch_fuse::DefragRange {
        start: 0,
        len: 0,
        codec,
    }
    .bytes();
    // SAFETY: an ioctl on a descriptor this function owns, with a 48-byte argument the
    // command's size says; the kernel only reads it.
    let rc = unsafe {
        libc::ioctl(
            handle.as_raw_fd(),
            birch_fuse::BTRFS_IOC_DEFRAG_RANGE as _,
            arg.as_ptr(),
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::EPERM) => format!("{e}: rewriting needs CAP_SYS_ADMIN"),
            Some(libc::EROFS) => format!("{e}: the mount is read-only"),
            _ => e.to_string(),
        });
    }
    let after = std::fs::metadata(file).map_err(|e| e.to_string())?;
    Ok(Done {
        size: after.len(),
        before: before.blocks() * 512,
        after: after.blocks() * 512,
    })
}
