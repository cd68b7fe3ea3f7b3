//! `birch fsck` with `--repair`, `-p` and `-n` as a person runs it, on image files: the
//! exit codes of fsck(8) (0 clean, 1 corrected, 4 left), a dry run that does not change a
//! byte, preen that leaves what only a full repair may do; and the format fixture from
//! before the backup roots (FORMAT.md §9) checked, written, repaired and given its flag by
//! this build. The damage is made through the library on purpose (DESIGN §13.4).

#![allow(clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use birch_core::device::{BlockDevice, FileDevice, OpenMode};
use birch_core::vfs::OpenOptions;
use birch_core::{Engine, Filesystem, MkfsOptions};
use birch_format::items::{decode_dir_entries, InodeItem};
use birch_format::superblock::COMPAT_BACKUP_ROOTS;
use birch_format::{name_hash, ItemType, Key, ROOT_INO};

/// A fresh directory under the system temp dir, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("birch-fsck-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `birch ARGS`; returns the exit code and stdout plus stderr. A closed filesystem's
/// threads may hold the image lock a moment longer, so "in use" (exit 8) is retried, as
/// `tests/images/check-fixtures.sh` does after an unmount.
fn birch(args: &[&str]) -> (i32, String) {
    let mut last = (-1, String::new());
    for _ in 0..100 {
        let out = Command::new(env!("CARGO_BIN_EXE_birch"))
            .args(args)
            .output()
            .expect("run birch");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        last = (out.status.code().unwrap_or(-1), text);
        if !(last.0 == 8 && last.1.contains("in use")) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    last
}

/// The image, read-write, waiting up to 10 s for a holder that is letting go (see
/// [`birch`]); a holder that never lets go fails the test instead of hanging it.
fn device(path: &Path) -> Arc<dyn BlockDevice> {
    for _ in 0..100 {
        match FileDevice::open(path, OpenMode::ReadWrite) {
            Ok(device) => return Arc::new(device),
            Err(e) if e.kind() == std::io::ErrorKind::ResourceBusy => {
                std::thread::sleep(std::time::Duration::from_millis(100))
            }
            Err(e) => panic!("open {}: {e}", path.display()),
        }
    }
    panic!("{}: still in use after 10 s", path.display())
}

fn quiet() -> OpenOptions {
    OpenOptions {
        commit_interval: None,
        ..Default::default()
    }
}

/// An image file with `/d/f` (a few KiB) and a few commits behind it.
fn image(dir: &Path) -> PathBuf {
    let path = dir.join("img");
    std::fs::File::create(&path)
        .and_then(|f| f.set_len(64 << 20))
        .expect("image file");
    Filesystem::mkfs(device(&path), &MkfsOptions::default()).expect("mkfs");
    let fs = Filesystem::open_device(device(&path), quiet()).expect("open");
    fs.mkdir(Default::default(), ROOT_INO, b"d", 0o755)
        .expect("mkdir");
    for round in 0..4u8 {
        fs.write_file("/d/f", &[round; 5000]).expect("write");
        fs.sync().expect("sync");
    }
    fs.close().expect("close");
    path
}

/// The inode number of `/d/f` and of `/d`.
fn inos(engine: &Engine) -> (u64, u64) {
    let entry = |dir: u64, name: &[u8]| {
        let bytes = engine
            .get(&Key::new(dir, ItemType::DirItem, name_hash(&[name])))
            .expect("get")
            .expect("entry");
        decode_dir_entries(&bytes).expect("decode")[0].clone()
    };
    let d = entry(1, b"d").child;
    (entry(d, b"f").child, d)
}

#[test]
fn exit_codes_dry_run_and_preen() {
    let scratch = Scratch::new("codes");
    let img = image(&scratch.0);
    let img_s = img.to_str().expect("path");
    assert_eq!(birch(&["fsck", img_s]).0, 0);
    assert_eq!(
        birch(&["fsck", "--repair", img_s]).0,
        0,
        "clean: nothing to do"
    );
    {
        let engine = Engine::open(device(&img)).expect("engine");
        let (f, _) = inos(&engine);
        let key = Key::new(f, ItemType::InodeItem, 0);
        let mut item =
            InodeItem::decode(&engine.get(&key).expect("get").expect("inode")).expect("decode");
        item.nlink = 9;
        let txn = engine.begin().expect("begin");
        txn.put(key, item.encode());
        drop(txn);
        engine.commit().expect("commit");
    }
    assert_eq!(birch(&["fsck", img_s]).0, 4);
    let before = std::fs::read(&img).expect("read image");
    let (code, out) = birch(&["fsck", "-n", img_s]);
    assert_eq!(code, 4, "{out}");
    assert!(
        out.contains("would repair: /d/f: link count 9 -> 1"),
        "{out}"
    );
    assert!(
        std::fs::read(&img).expect("read image") == before,
        "-n wrote"
    );
    let (code, out) = birch(&["fsck", "-p", img_s]);
    assert_eq!(code, 1, "{out}");
    assert_eq!(birch(&["fsck", img_s]).0, 0);
}

#[test]
fn preen_leaves_an_unnamed_inode_and_repair_reattaches_it() {
    let scratch = Scratch::new("orphan");
    let img = image(&scratch.0);
    let img_s = img.to_str().expect("path");
    let f = {
        let engine = Engine::open(device(&img)).expect("engine");
        let (f, d) = inos(&engine);
        let item = Key::new(d, ItemType::DirItem, name_hash(&[b"f"]));
        let entry = decode_dir_entries(&engine.get(&item).expect("get").expect("entry"))
            .expect("decode")[0]
            .clone();
        let txn = engine.begin().expect("begin");
        txn.delete(item);
        txn.delete(Key::new(d, ItemType::DirIndex, entry.dir_index));
        txn.delete(Key::new(
            f,
            ItemType::InodeRef,
            name_hash(&[&d.to_le_bytes(), b"f"]),
        ));
        drop(txn);
        engine.commit().expect("commit");
        f
    };
    let (code, out) = birch(&["fsck", "-a", img_s]);
    assert_eq!(code, 4, "{out}");
    assert!(out.contains("run birch fsck --repair"), "{out}");
    let (code, out) = birch(&["fsck", "-y", img_s]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains(&format!("/lost+found/#{f}")), "{out}");
    assert_eq!(birch(&["fsck", "--data", img_s]).0, 0);
    let fs = Filesystem::open_device(device(&img), quiet()).expect("open");
    let data = fs
        .read_file(&format!("/lost+found/#{f}"))
        .expect("reattached");
    assert_eq!(data, vec![3u8; 5000]);
    fs.close().expect("close");
}

/// The fixture made before `COMPAT_BACKUP_ROOTS` (and before `INCOMPAT_XATTR_CHUNKS`):
/// clean as made, opens, takes writes from this build, gains the flag and three backup
/// roots, stays clean, and a repair finds nothing to do.
#[test]
fn the_image_from_before_the_backup_roots_opens_and_gains_them() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/images/v1-before-xattr-chunks.img.gz");
    let scratch = Scratch::new("fixture");
    let img = scratch.0.join("v1.img");
    let out = Command::new("gzip")
        .arg("-dc")
        .arg(&fixture)
        .output()
        .expect("gzip");
    assert!(out.status.success(), "gzip -dc {}", fixture.display());
    std::fs::write(&img, out.stdout).expect("write image");
    let img_s = img.to_str().expect("path");
    let (code, out) = birch(&["fsck", "--data", img_s]);
    assert_eq!(code, 0, "as made: {out}");
    let (sb, _) = Engine::read_superblock(&*device(&img)).expect("superblock");
    assert_eq!(sb.compat & COMPAT_BACKUP_ROOTS, 0, "made before the flag");
    let fs = Filesystem::open_device(device(&img), quiet()).expect("open");
    assert_eq!(
        fs.read_file("/dir/hello.txt").expect("hello"),
        b"hello birch v1\n"
    );
    for round in 0..4u8 {
        fs.write_file("/new", &[round; 3000]).expect("write");
        fs.sync().expect("sync");
    }
    fs.close().expect("close");
    drop(fs);
    let (sb, _) = Engine::read_superblock(&*device(&img)).expect("superblock");
    assert_ne!(sb.compat & COMPAT_BACKUP_ROOTS, 0);
    assert_eq!(sb.backup_roots.len(), 3, "{:?}", sb.backup_roots);
    assert_eq!(birch(&["fsck", "--data", img_s]).0, 0);
    assert_eq!(birch(&["fsck", "--repair", img_s]).0, 0);
}

/// Bytes flipped in a data block of `/d/f`: `fsck --data` finds it (exit 4), `--repair
/// --data` punches the block out and prints the path and byte range lost (exit 1), a second
/// `fsck --data` is clean and the file's other block reads as written.
#[test]
fn repair_with_data_punches_out_a_bad_block_and_prints_the_range() {
    use birch_format::items::{ExtentKind, FileExtent};
    let scratch = Scratch::new("data");
    let img = image(&scratch.0);
    let img_s = img.to_str().expect("path");
    let addr = {
        let engine = Engine::open(device(&img)).expect("engine");
        let (f, _) = inos(&engine);
        let key = Key::new(f, ItemType::ExtentData, 0);
        let extent =
            FileExtent::decode(&engine.get(&key).expect("get").expect("extent")).expect("decode");
        match extent.kind {
            ExtentKind::Regular { disk_addr, .. } => disk_addr,
            other => panic!("{other:?}"),
        }
    };
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .open(&img)
            .expect("open image");
        file.seek(SeekFrom::Start(addr + 100)).expect("seek");
        file.write_all(&[0xa5; 8]).expect("flip");
    }
    assert_eq!(
        birch(&["fsck", img_s]).0,
        0,
        "data is read only with --data"
    );
    let (code, out) = birch(&["fsck", "--data", img_s]);
    assert_eq!(code, 4, "{out}");
    assert!(out.contains("DataChecksumMismatch [023]"), "{out}");
    let (code, out) = birch(&["fsck", "--repair", "--data", img_s]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("lost: /d/f: lost bytes 0..4096"), "{out}");
    assert_eq!(birch(&["fsck", "--data", img_s]).0, 0);
    let fs = Filesystem::open_device(device(&img), quiet()).expect("open");
    let data = fs.read_file("/d/f").expect("read");
    assert_eq!(data.len(), 5000);
    assert!(data[..4096].iter().all(|b| *b == 0));
    assert!(data[4096..].iter().all(|b| *b == 3));
    fs.close().expect("close");
}
