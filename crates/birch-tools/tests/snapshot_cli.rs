//! `birch snapshot list`, `birch diff`, `birch rollback` and `birch inspect IMAGE space` on
//! an unmounted image file: what they print, what they refuse, and that fsck is clean after
//! (DESIGN §15.8, SEMANTICS §9).

#![allow(clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use birch_core::device::{BlockDevice, FileDevice, OpenMode};
use birch_core::vfs::OpenOptions;
use birch_core::{Filesystem, MkfsOptions};
use birch_format::ROOT_INO;

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
    let d = fs.lookup(ROOT_INO, dir.as_bytes()).ok()?.ino;
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
    fs.mkdir(Default::default(), ROOT_INO, b"d", 0o755)
        .expect("mkdir");
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

/// The blocks column of `birch inspect IMAGE space`'s line `label` (the label as printed,
/// indentation included); every such line also says its bytes, blocks times the block size.
fn space_blocks(out: &str, label: &str) -> u64 {
    let line = out
        .lines()
        .find(|l| {
            l.strip_prefix(label).is_some_and(|rest| {
                rest.starts_with(' ') && !rest.trim_start().starts_with(char::is_alphabetic)
            })
        })
        .unwrap_or_else(|| panic!("no line {label:?} in {out}"));
    let fields: Vec<&str> = line[label.len()..].split_whitespace().collect();
    assert_eq!((fields[1], fields[3]), ("bytes", "blocks"), "{line}");
    let bytes: u64 = fields[0].parse().expect("bytes");
    let blocks: u64 = fields[2].parse().expect("blocks");
    assert_eq!(bytes, blocks * 4096, "{line}");
    blocks
}

#[test]
fn inspect_space_accounts_for_clones_and_snapshots() {
    let dir = std::env::temp_dir().join(format!("birch-space-{}", std::process::id()));
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

    // a (1 MiB), b a clone of it, c (1 MiB of its own); a snapshot; c deleted.
    let fs = open(&img);
    fs.write_file("/a", &[7u8; 1 << 20]).expect("write a");
    fs.write_file("/b", b"").expect("write b");
    fs.write_file("/c", &[8u8; 1 << 20]).expect("write c");
    let a = fs.lookup(ROOT_INO, b"a").expect("a").ino;
    let b = fs.lookup(ROOT_INO, b"b").expect("b").ino;
    assert_eq!(
        fs.copy_file_range(a, 0, b, 0, 1 << 20).expect("clone"),
        1 << 20
    );
    fs.close().expect("close");
    drop(fs);
    assert_eq!(birch(&["snapshot", "create", path, "s1"]).0, 0);
    let fs = open(&img);
    fs.unlink(ROOT_INO, b"c").expect("unlink c");
    fs.close().expect("close");
    drop(fs);

    let (code, out, err) = birch(&["inspect", path, "space"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(space_blocks(&out, "device"), 16384, "{out}");
    assert_eq!(space_blocks(&out, "data"), 256, "a and b, once: {out}");
    assert_eq!(space_blocks(&out, "  shared"), 256, "the clone: {out}");
    let snapshots = space_blocks(&out, "snapshots");
    assert!(snapshots >= 256, "c's blocks: {out}");
    assert_eq!(
        space_blocks(&out, "  snapshot"),
        snapshots,
        "one snapshot: {out}"
    );
    assert!(out.contains("generation") && out.contains("s1"), "{out}");
    assert!(space_blocks(&out, "snapshot list") > 0, "{out}");
    assert_eq!(space_blocks(&out, "unnamed"), 0, "{out}");
    let used = space_blocks(&out, "used");
    let parts = [
        "reserved",
        "tree nodes",
        "snapshot list",
        "data",
        "snapshots",
        "unnamed",
    ];
    assert_eq!(
        parts.iter().map(|l| space_blocks(&out, l)).sum::<u64>(),
        used,
        "the used lines add up: {out}"
    );
    let free = space_blocks(&out, "free");
    assert_eq!(used + free, 16384, "{out}");
    assert!(space_blocks(&out, "  available") <= free, "{out}");
    assert!(
        out.contains(&format!("used {used} + free {free} = device 16384 blocks")),
        "{out}"
    );

    // The snapshot's deletion gives its blocks back: the same report shows them free.
    assert_eq!(birch(&["snapshot", "delete", path, "s1"]).0, 0);
    let (code, after, err) = birch(&["inspect", path, "space"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(space_blocks(&after, "snapshots"), 0, "{after}");
    assert!(!after.contains("  snapshot "), "{after}");
    assert!(
        space_blocks(&after, "free") >= free + snapshots,
        "{out}{after}"
    );
    let (code, out, err) = birch(&["fsck", path]);
    assert_eq!(code, 0, "{out}{err}");

    // A pending fsync log is replayed in memory: its data is the live tree's.
    let fs = open(&img);
    let (attr, _) = fs
        .create(Default::default(), ROOT_INO, b"d", 0o644, 0)
        .expect("create d");
    fs.write(attr.ino, 0, &[9u8; 65536], false)
        .expect("write d");
    fs.fsync(attr.ino, false).expect("fsync d");
    fs.power_cut();
    let (code, out, err) = birch(&["inspect", path, "space"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(space_blocks(&out, "data"), 256 + 16, "d's 64 KiB: {out}");
    assert_eq!(space_blocks(&out, "unnamed"), 0, "{out}");
    let (code, log, err) = birch(&["inspect", path, "log"]);
    assert_eq!(code, 0, "{err}");
    assert!(log.contains("(replays)"), "the image keeps its log: {log}");
}
