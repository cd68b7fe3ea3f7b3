//! The benchmark-only switches of the core do what they say (DESIGN §1 and BENCHMARKS: the seeds' "before"): a figure differs with
//! the switch on. `bench_apply_per_item` (seed 003's "before") makes a commit of overwritten
//! extents cost a delete and an insert descent per extent item instead of one descent per leaf.
//! (`bench_global_objectid_lock` is tested beside `Engine::allocate_objectid`.)

//! Only with the `seed-before` feature (benchmark builds): CI runs it in scripts/test.sh's tier
//! "core tests, checked" (`--features seed-before --test bench_switches`).

#![cfg(feature = "seed-before")]
#![allow(clippy::expect_used)]

use std::sync::Arc;

use birch_core::device::MemDevice;
use birch_core::vfs::{Caller, OpenOptions};
use birch_core::{Filesystem, MkfsOptions};
use birch_format::ROOT_INO;

const BLOCK: u64 = 4096;
const BLOCKS: u64 = 64;

/// Descents of the commit that applies 32 overwrites of every other block of a 64-block file.
fn descents_of_overwrite_commit(per_item: bool) -> u64 {
    let dev = Arc::new(MemDevice::new(64 << 20));
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    let options = OpenOptions {
        commit_interval: None,
        bench_apply_per_item: per_item,
        ..Default::default()
    };
    let fs = Filesystem::open_device(dev, options).expect("open");
    let (f, _) = fs
        .create(Caller::default(), ROOT_INO, b"f", 0o644, 0)
        .expect("create");
    let block = vec![7u8; BLOCK as usize];
    for i in 0..BLOCKS {
        fs.write_mode(f.ino, i * BLOCK, &block, false, None, true)
            .expect("write");
    }
    fs.sync().expect("commit");
    let block = vec![9u8; BLOCK as usize];
    for i in (0..BLOCKS).step_by(2) {
        fs.write_mode(f.ino, i * BLOCK, &block, false, None, true)
            .expect("overwrite");
    }
    let before = fs.engine().counters().values();
    fs.sync().expect("commit");
    let descents = fs
        .engine()
        .counters()
        .values()
        .since(&before)
        .btree_descents;
    let data = fs.read_file("/f").expect("read");
    assert_eq!(data.len() as u64, BLOCKS * BLOCK);
    assert!(data[..BLOCK as usize].iter().all(|b| *b == 9));
    assert!(data[BLOCK as usize..2 * BLOCK as usize]
        .iter()
        .all(|b| *b == 7));
    fs.close().expect("close");
    descents
}

#[test]
fn apply_per_item_costs_two_descents_per_overwritten_extent() {
    let batched = descents_of_overwrite_commit(false);
    let per_item = descents_of_overwrite_commit(true);
    let overwrites = BLOCKS / 2;
    assert!(
        batched < overwrites / 4,
        "one descent per leaf: {batched} for {overwrites} extents"
    );
    assert!(
        per_item >= 2 * overwrites,
        "a delete and an insert descent per extent: {per_item} for {overwrites} extents"
    );
}
