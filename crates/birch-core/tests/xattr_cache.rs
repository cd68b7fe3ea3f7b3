//! The remembered absence of an xattr (`InodeData::xattrs_absent`) never hides one set later:
//! a default ACL set after creates in a directory is inherited by the next create, a
//! `security.capability` set after writes is still dropped by the next unprivileged write, and
//! an access ACL set after a chmod still follows the next chmod. Each case first makes the
//! filesystem remember the absence, then sets the xattr, then checks the effect.

#![allow(clippy::expect_used)]

mod common;

use std::sync::Arc;

use birch_core::check::{check, CheckOptions};
use birch_core::device::MemDevice;
use birch_core::vfs::{Caller, SetAttr};
use birch_core::{Error, Filesystem};
use birch_format::ROOT_INO;

const ACL_ACCESS: &[u8] = b"system.posix_acl_access";
const ACL_DEFAULT: &[u8] = b"system.posix_acl_default";
const CAPABILITY: &[u8] = b"security.capability";

/// A Linux xattr ACL: version 2, then (tag, perm, id) entries.
fn acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut out = 2u32.to_le_bytes().to_vec();
    for &(tag, perm, id) in entries {
        out.extend_from_slice(&tag.to_le_bytes());
        out.extend_from_slice(&perm.to_le_bytes());
        out.extend_from_slice(&id.to_le_bytes());
    }
    out
}

const USER_OBJ: u16 = 0x01;
const USER: u16 = 0x02;
const GROUP_OBJ: u16 = 0x04;
const MASK: u16 = 0x10;
const OTHER: u16 = 0x20;

fn setup() -> (Arc<MemDevice>, Filesystem) {
    common::fresh(64 << 20)
}

fn finish(dev: &MemDevice, fs: Filesystem) {
    fs.close().expect("close");
    let report = check(dev, CheckOptions { data: true }).expect("fsck runs");
    assert!(report.is_clean(), "fsck findings: {:#?}", report.findings);
}

#[test]
fn default_acl_set_after_creates_is_inherited() {
    let (dev, fs) = setup();
    let c = Caller::default();
    let d = fs.mkdir(c, ROOT_INO, b"d", 0o755).expect("mkdir").ino;
    let (before, _) = fs.create(c, d, b"before", 0o666, 0).expect("create");
    assert!(matches!(
        fs.getxattr(before.ino, ACL_ACCESS),
        Err(Error::NoData(_))
    ));
    let default = acl(&[
        (USER_OBJ, 7, 0),
        (USER, 5, 1000),
        (GROUP_OBJ, 5, 0),
        (MASK, 5, 0),
        (OTHER, 0, 0),
    ]);
    fs.setxattr(d, ACL_DEFAULT, &default, 0)
        .expect("set default ACL");
    let (after, _) = fs.create(c, d, b"after", 0o666, 0).expect("create");
    let access = fs
        .getxattr(after.ino, ACL_ACCESS)
        .expect("the new file inherits an access ACL");
    assert!(access.len() > 4);
    // Mode from the ACL and the create mode: other gets nothing, as the default ACL says.
    assert_eq!(after.perm & 0o7, 0, "mode {:o}", after.perm);
    // Removing it again: the next create inherits nothing.
    fs.removexattr(d, ACL_DEFAULT).expect("remove default ACL");
    let (last, _) = fs.create(c, d, b"last", 0o666, 0).expect("create");
    assert!(matches!(
        fs.getxattr(last.ino, ACL_ACCESS),
        Err(Error::NoData(_))
    ));
    finish(&dev, fs);
}

#[test]
fn capability_set_after_writes_is_still_dropped() {
    let (dev, fs) = setup();
    let c = Caller::default();
    let (f, _) = fs.create(c, ROOT_INO, b"f", 0o755, 0).expect("create");
    let groups = [1000u32];
    fs.write_with(f.ino, 0, b"one", false, Some(&groups))
        .expect("unprivileged write");
    assert!(matches!(
        fs.getxattr(f.ino, CAPABILITY),
        Err(Error::NoData(_))
    ));
    fs.setxattr(f.ino, CAPABILITY, b"\x01\x00\x00\x02", 0)
        .expect("set capability");
    assert_eq!(
        fs.getxattr(f.ino, CAPABILITY).expect("capability is there"),
        b"\x01\x00\x00\x02"
    );
    // A privileged write keeps it; an unprivileged one drops it.
    fs.write_with(f.ino, 3, b"two", false, None)
        .expect("privileged write");
    assert!(fs.getxattr(f.ino, CAPABILITY).is_ok());
    let (_, dropped) = fs
        .write_with(f.ino, 6, b"three", false, Some(&groups))
        .expect("unprivileged write");
    assert!(dropped, "the write reports that it dropped privileges");
    assert!(matches!(
        fs.getxattr(f.ino, CAPABILITY),
        Err(Error::NoData(_))
    ));
    finish(&dev, fs);
}

#[test]
fn access_acl_set_after_chmod_follows_the_next_chmod() {
    let (dev, fs) = setup();
    let c = Caller::default();
    let (f, _) = fs.create(c, ROOT_INO, b"f", 0o644, 0).expect("create");
    let chmod = |mode| SetAttr {
        mode: Some(mode),
        ..Default::default()
    };
    fs.setattr(f.ino, &chmod(0o600)).expect("chmod");
    let access = acl(&[
        (USER_OBJ, 6, 0),
        (USER, 7, 1000),
        (GROUP_OBJ, 4, 0),
        (MASK, 7, 0),
        (OTHER, 4, 0),
    ]);
    fs.setxattr(f.ino, ACL_ACCESS, &access, 0)
        .expect("set access ACL");
    fs.setattr(f.ino, &chmod(0o640)).expect("chmod");
    let now = fs.getxattr(f.ino, ACL_ACCESS).expect("ACL kept");
    // The mask entry follows the group bits of the chmod (4 = r--).
    let mask = now[4..]
        .chunks(8)
        .find(|e| u16::from_le_bytes([e[0], e[1]]) == MASK)
        .map(|e| u16::from_le_bytes([e[2], e[3]]))
        .expect("a mask entry");
    assert_eq!(mask, 4);
    finish(&dev, fs);
}
