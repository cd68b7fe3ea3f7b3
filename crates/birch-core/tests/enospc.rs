//! A full filesystem: writes fail with ENOSPC (an error, never a panic), the image stays
//! consistent (fsck clean after a reopen), unlink and truncate still work on the full
//! filesystem, and the space they free is usable again after the commit that frees it.

#![allow(clippy::expect_used)]

use std::sync::Arc;

use birch_core::check::{check, CheckOptions};
use birch_core::device::MemDevice;
use birch_core::vfs::{Caller, OpenOptions, SetAttr};
use birch_core::{Filesystem, MkfsOptions};

#[test]
fn full_filesystem_fails_cleanly_and_recovers_after_deletes() {
    let dev = Arc::new(MemDevice::new(24 << 20));
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    let fs = Filesystem::open_device(
        dev.clone(),
        OpenOptions {
            commit_interval: None,
            ..Default::default()
        },
    )
    .expect("open");
    let chunk = vec![0xabu8; 256 * 1024];
    let mut files = Vec::new();
    let mut hit_enospc = false;
    'fill: for n in 0..1000 {
        let (f, _) = match fs.create(Caller::default(), 1, format!("f{n}").as_bytes(), 0o644, 0) {
            Ok(v) => v,
            Err(e) => {
                assert_eq!(e.errno(), libc::ENOSPC, "create on a full fs: {e}");
                hit_enospc = true;
                break;
            }
        };
        files.push(f.ino);
        for part in 0..8u64 {
            if let Err(e) = fs.write(f.ino, part * chunk.len() as u64, &chunk, false) {
                assert_eq!(e.errno(), libc::ENOSPC, "write on a full fs: {e}");
                hit_enospc = true;
                break 'fill;
            }
        }
    }
    assert!(hit_enospc, "a 24 MiB filesystem must fill up");
    // Deletes and truncates always work on a full filesystem.
    fs.setattr(
        files[0],
        &SetAttr {
            size: Some(0),
            ..Default::default()
        },
    )
    .expect("truncate on a full fs");
    for n in 1..files.len().min(6) {
        fs.unlink(1, format!("f{n}").as_bytes())
            .expect("unlink on a full fs");
    }
    fs.sync().expect("commit after deletes");
    // The freed space is usable again.
    let (g, _) = fs
        .create(Caller::default(), 1, b"after", 0o644, 0)
        .expect("create after deletes");
    fs.write(g.ino, 0, &chunk, false)
        .expect("write after deletes");
    fs.close().expect("close");
    drop(fs);
    let report = check(&*dev, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{:#?}", report.findings);
    let fs = Filesystem::open_device(
        dev,
        OpenOptions {
            commit_interval: None,
            ..Default::default()
        },
    )
    .expect("reopen");
    assert_eq!(fs.read_file("/after").expect("read back"), chunk);
}
