//! The thin end-to-end slice in the library: mkfs, create, write, read, commit, reopen, fsck.
//! Proves that data and names survive a reopen and that fsck finds nothing to report.

#![allow(clippy::expect_used)]

use std::sync::Arc;

use birch_core::check::{check, CheckOptions};
use birch_core::device::{BlockDevice, MemDevice};
use birch_core::vfs::{Caller, OpenOptions};
use birch_core::{Filesystem, MkfsOptions};
use birch_format::ROOT_INO;

fn quiet() -> OpenOptions {
    OpenOptions {
        commit_interval: None,
        ..Default::default()
    }
}

fn assert_clean(dev: &MemDevice) {
    let report = check(dev, CheckOptions { data: true }).expect("fsck runs");
    assert!(report.is_clean(), "fsck findings: {:#?}", report.findings);
}

#[test]
fn files_survive_reopen_and_fsck_is_clean() {
    let dev = Arc::new(MemDevice::new(64 << 20));
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    assert_clean(&dev);
    let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    {
        let fs = Filesystem::open_device(dev.clone(), quiet()).expect("open");
        let c = Caller::default();
        let d = fs.mkdir(c, ROOT_INO, b"dir", 0o755).expect("mkdir");
        fs.write_file("/dir/small", b"hello").expect("small");
        fs.write_file("/big", &big).expect("big");
        let (f, _) = fs.create(c, d.ino, b"sparse", 0o644, 0).expect("create");
        fs.write(f.ino, 10 << 20, b"tail", false)
            .expect("sparse write");
        fs.write(f.ino, 5000, b"middle", false).expect("overwrite");
        fs.symlink(c, ROOT_INO, b"link", b"/dir/small")
            .expect("symlink");
        fs.link(f.ino, ROOT_INO, b"hard").expect("link");
        fs.setxattr(f.ino, b"user.k", b"v", 0).expect("xattr");
        fs.sync().expect("commit");
        assert_eq!(fs.read_file("/dir/small").expect("read"), b"hello");
        fs.close().expect("close");
    }
    assert_clean(&dev);
    let fs = Filesystem::open_device(dev.clone(), quiet()).expect("reopen");
    assert_eq!(fs.read_file("/dir/small").expect("read small"), b"hello");
    assert_eq!(fs.read_file("/big").expect("read big"), big);
    let sparse = fs.read_file("/hard").expect("read sparse");
    assert_eq!(sparse.len(), (10 << 20) + 4);
    assert_eq!(&sparse[5000..5006], b"middle");
    assert!(sparse[..5000].iter().all(|b| *b == 0));
    assert_eq!(&sparse[10 << 20..], b"tail");
    assert_eq!(
        fs.readlink(fs.resolve("/link").expect("link"))
            .expect("readlink"),
        b"/dir/small"
    );
    let ino = fs.resolve("/dir/sparse").expect("resolve");
    assert_eq!(fs.getattr(ino).expect("attr").nlink, 2);
    assert_eq!(fs.getxattr(ino, b"user.k").expect("xattr"), b"v");
    let names: Vec<Vec<u8>> = fs
        .readdir(ROOT_INO, 0, 100)
        .expect("readdir")
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(
        names,
        vec![
            b".".to_vec(),
            b"..".to_vec(),
            b"dir".to_vec(),
            b"big".to_vec(),
            b"link".to_vec(),
            b"hard".to_vec()
        ]
    );
    fs.unlink(ROOT_INO, b"big").expect("unlink");
    fs.rename(ROOT_INO, b"hard", ROOT_INO, b"renamed", 0)
        .expect("rename");
    fs.close().expect("close");
    drop(fs);
    assert_clean(&dev);
    let _ = dev.size_bytes();
}

/// The same inode number in two filesystems carries different generations (in the low 32
/// bits, all a kernel file handle keeps), so an NFS handle of one filesystem never opens a file
/// of another that a server takes for it (tests/nfs: another image at the export path with the
/// old st_dev); a generation stays the same across a reopen.
#[test]
fn the_same_inode_number_in_two_filesystems_has_different_generations() {
    let make = || {
        let dev = Arc::new(MemDevice::new(64 << 20));
        Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
        let fs = Filesystem::open_device(dev.clone(), quiet()).expect("open");
        let c = Caller::default();
        fs.mkdir(c, ROOT_INO, b"d", 0o755).expect("mkdir");
        fs.write_file("/d/f", b"x").expect("write");
        let ino = fs.resolve("/d/f").expect("resolve");
        let generation = fs.getattr(ino).expect("getattr").generation;
        fs.close().expect("close");
        (dev, ino, generation)
    };
    let (dev, ino_a, gen_a) = make();
    let (_, ino_b, gen_b) = make();
    assert_eq!(ino_a, ino_b, "the same steps give the same inode number");
    assert_ne!(
        gen_a as u32, gen_b as u32,
        "generations of inode {ino_a} must differ"
    );
    let fs = Filesystem::open_device(dev, quiet()).expect("reopen");
    assert_eq!(fs.getattr(ino_a).expect("getattr").generation, gen_a);
    assert_eq!(fs.lookup(ino_a, b".").expect("lookup .").generation, gen_a);
    fs.close().expect("close");
}
