//! `birch snapshot list`, `birch diff` and `birch rollback` on an unmounted image file: what
//! they print, what they refuse, and that fsck is clean after (DESIGN §15.8, SEMANTICS §9).

#![allow(clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use birch_core::device::{BlockDevice, FileDevice, OpenMode};
use birch_core::vfs::OpenOptions;
use birch_core::{Filesystem, MkfsOptions};

struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn birch(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_birch"))
        .args(args)
        .output()
        .expect("run birch");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn open(path: &Path) -> Filesystem {
    let device: Arc<dyn BlockDevice> =
        Arc::new(FileDevice::open(path, OpenMode::ReadWrite).expect("open image"));
    Filesystem::open_device(
        device,
        OpenOptions {
            commit_interval: None,
            ..Default::default()
        },
    )
    .expect("open")
}

fn read(fs: &Filesystem, dir: &str, name: &str) -> Option<Vec<u8>> {
    let d = fs.lookup(1, dir.as_bytes()).ok()?.ino;
    let attr = fs.lookup(d, name.as_bytes()).ok()?;
    Some(fs.read(attr.ino, 0, attr.size as usize).expect("read"))
}

#[test]
fn list_diff_and_rollback_on_an_image() {
    let dir = std::env::temp_dir().join(format!("birch-snapcli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let _scratch = Scratch(dir.clone());
    let img = dir.join("img");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(64 << 20))
        .expect("image file");
    let device: Arc<dyn BlockDevice> =
        Arc::new(FileDevice::open(&img, OpenMode::ReadWrite).expect("open image"));
    Filesystem::mkfs(device, &MkfsOptions::default()).expect("mkfs");
    let path = img.to_str().expect("utf-8 path");
    let fs = open(&img);
    fs.mkdir(Default::default(), 1, b"d", 0o755).expect("mkdir");
    fs.write_file("/d/f", &[1u8; 5000]).expect("write");
    fs.close().expect("close");
    drop(fs);
    assert_eq!(birch(&["snapshot", "create", path, "s1"]).0, 0);
    let fs = open(&img);
    fs.write_file("/d/f", &[2u8; 9000]).expect("write");
    fs.write_file("/d/g", &[3u8; 40000]).expect("write");
    fs.close().expect("close");
    drop(fs);
    assert_eq!(birch(&["snapshot", "create", path, "s2"]).0, 0);
    let fs = open(&img);
    fs.write_file("/d/h", &[4u8; 100]).expect("write");
    fs.close().expect("close");
    drop(fs);

    let (code, out, err) = birch(&["snapshot", "list", path]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].contains("only_bytes"), "{out}");
    assert_eq!(lines.len(), 3, "{out}");
    // s1 alone holds f's first 5000 bytes (two blocks) and the nodes the later commits
    // copied: a figure in bytes, a multiple of the block size.
    let s1_bytes: u64 = lines[1]
        .split_whitespace()
        .nth(5)
        .and_then(|b| b.parse().ok())
        .expect("only_bytes of s1");
    assert!(s1_bytes >= 2 * 4096 && s1_bytes % 4096 == 0, "{out}");

    let (code, out, err) = birch(&["diff", path, "s1", "s2"]);
    assert_eq!(code, 0, "{err}");
    for line in ["M /d", "M /d/f", "+ /d/g"] {
        assert!(out.lines().any(|l| l == line), "{line:?} in {out}");
    }
    assert!(!out.contains("/d/h"), "{out}");
    let (code, out, _) = birch(&["diff", path, "s2"]);
    assert_eq!(code, 0);
    assert!(out.lines().any(|l| l == "+ /d/h"), "{out}");
    assert_ne!(birch(&["diff", path, "none"]).0, 0);

    let (code, _, err) = birch(&["rollback", path, "s1"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("newer snapshots exist") && err.contains("s2"),
        "{err}"
    );
    let (code, out, err) = birch(&["rollback", path, "s1", "-r"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("\"s2\" deleted") && out.contains("rolled back"),
        "{out}"
    );
    let (code, out, err) = birch(&["diff", path, "s1"]);
    assert_eq!((code, out.as_str()), (0, ""), "{err}");
    let (code, out, err) = birch(&["fsck", path]);
    assert_eq!(code, 0, "{out}{err}");
    let fs = open(&img);
    assert_eq!(read(&fs, "d", "f"), Some(vec![1u8; 5000]));
    assert_eq!(read(&fs, "d", "g"), None);
    assert_eq!(read(&fs, "d", "h"), None);
    fs.close().expect("close");
}
