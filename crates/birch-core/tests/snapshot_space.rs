//! Space and snapshots (DESIGN §15.8, issue 15): `Engine::space_report` (`birch inspect IMAGE
//! space`) accounts for shared and snapshot-held blocks exactly, and a full filesystem stays
//! full while a snapshot holds the space its deleted files used (ENOSPC after a commit, statfs
//! not back) until the snapshot's deletion gives it back without a reopen: with one snapshot,
//! with two (the older one's deletion returns nothing the newer one holds), and with a clone
//! both of whose files are deleted (the deletion walk frees a deleted snapshot's cloned blocks
//! at once).

#![allow(clippy::expect_used)]

mod common;

use birch_core::space::SpaceReport;
use birch_core::vfs::Caller;
use birch_core::Filesystem;
use birch_format::BLOCK_SIZE;

const ROOT: u64 = 1;
const DEVICE_BYTES: u64 = 64 << 20;

/// Creates file `name` in the root with `content`; returns its inode.
fn put(fs: &Filesystem, name: &str, content: &[u8]) -> u64 {
    let (attr, fh) = fs
        .create(Caller::default(), ROOT, name.as_bytes(), 0o644, 0)
        .expect("create");
    fs.release(attr.ino, fh).expect("release");
    if !content.is_empty() {
        fs.write(attr.ino, 0, content, false).expect("write");
    }
    attr.ino
}

/// Unlinks `name` and forgets the kernel's lookups of it: its data is freed then.
fn remove(fs: &Filesystem, name: &str) {
    let ino = fs.lookup(ROOT, name.as_bytes()).expect("lookup").ino;
    fs.unlink(ROOT, name.as_bytes()).expect("unlink");
    fs.forget(ino, u64::MAX);
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((i / 7) as u8).wrapping_mul(31) ^ seed ^ (i as u8))
        .collect()
}

fn bfree(fs: &Filesystem) -> u64 {
    fs.statfs().bfree
}

/// The report, with the invariants every quiet engine's report keeps: the lines add up to
/// the device, every used block is named by some tree, and free is statfs's.
fn report(fs: &Filesystem, what: &str) -> SpaceReport {
    let r = fs.engine().space_report().expect("space report");
    assert_eq!(
        r.reserved + r.tree_nodes + r.list_nodes + r.data + r.snapshots_only + r.unnamed + r.free,
        r.device,
        "{what}: the lines add up: {r:?}"
    );
    assert_eq!(r.unnamed, 0, "{what}: every used block is named: {r:?}");
    assert_eq!(r.free, bfree(fs), "{what}: free as statfs counts it");
    assert_eq!(r.device, fs.statfs().blocks, "{what}: device blocks");
    assert_eq!(r.block_size, BLOCK_SIZE);
    assert!(r.available <= r.free);
    r
}

/// A file, a clone of half of it, a snapshot, the source deleted: the report names the shared
/// blocks while both files stand, then what only the snapshot holds (the source's unshared
/// half and the nodes the deletion copied); deleting the snapshot gives exactly that back.
#[test]
fn the_space_report_accounts_for_shared_and_snapshot_held_blocks() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    fs.sync().expect("sync");
    let empty = report(&fs, "empty");
    assert_eq!((empty.data, empty.shared, empty.snapshots_only), (0, 0, 0));
    assert_eq!((empty.list_nodes, empty.snapshots.len()), (0, 0));

    let data = pattern(2 << 20, 3);
    let a = put(&fs, "a", &data);
    let b = put(&fs, "b", b"");
    assert_eq!(
        fs.copy_file_range(a, 0, b, 0, 1 << 20).expect("clone"),
        1 << 20
    );
    fs.sync().expect("sync");
    let cloned = report(&fs, "cloned");
    assert_eq!(
        cloned.data, 512,
        "a's 512 blocks, b's 256 of them counted once"
    );
    assert_eq!(cloned.shared, 256, "the cloned MiB");
    assert_eq!(
        cloned.shared,
        fs.engine().allocator().shared_blocks().get(),
        "the allocator's counts"
    );
    assert!(
        fs.stats_json().contains("\"shared_bytes\": 1048576"),
        "the stats gauge says the same"
    );
    assert_eq!(cloned.snapshots_only, 0);

    fs.create_snapshot("s").expect("snapshot");
    remove(&fs, "a");
    fs.sync().expect("sync");
    let held = report(&fs, "source deleted");
    assert_eq!(held.data, 256, "b's blocks");
    assert_eq!(held.shared, 0, "b alone names them now");
    assert_eq!(held.snapshots.len(), 1);
    assert_eq!(held.snapshots[0].snapshot.name, "s");
    assert!(held.list_nodes > 0, "the list has a node");
    // a's second MiB (b never named it) and the nodes the deletion copied, which only the
    // snapshot still names.
    let nodes = held.snapshots_only - 256;
    assert!(
        held.snapshots_only >= 256 && nodes % birch_format::NODE_BLOCKS == 0 && nodes <= 64,
        "the snapshot holds a's unshared half and a few nodes: {held:?}"
    );
    assert_eq!(
        held.snapshots[0].only_blocks, held.snapshots_only,
        "one snapshot: what it alone holds is all snapshots hold"
    );

    fs.delete_snapshot("s").expect("delete snapshot");
    fs.sync().expect("sync");
    let back = report(&fs, "snapshot deleted");
    assert_eq!((back.snapshots_only, back.snapshots.len()), (0, 0));
    assert_eq!(back.list_nodes, 0);
    assert_eq!(back.data, 256);
    assert_eq!(
        back.free,
        held.free + held.snapshots_only + held.list_nodes,
        "the deletion gives back what the snapshot and its list held: {held:?} {back:?}"
    );
    common::close_and_check_clean(fs, &dev, "space report");
}
