//! Space and snapshots (DESIGN §15.8): `Engine::space_report` (`birch inspect IMAGE
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
use birch_core::{Error, Filesystem};
use birch_format::{InodeNo, BLOCK_SIZE};

const ROOT: birch_format::InodeNo = birch_format::ROOT_INO;
const DEVICE_BYTES: u64 = 64 << 20;
/// One write of the fill (and the probe that must find no space).
const CHUNK: usize = 256 << 10;
/// Blocks statfs may differ by between two states with the same files (metadata: nodes of
/// the tree and the snapshot list written differently).
const MARGIN: u64 = 64;

/// Creates file `name` in the root with `content`; returns its inode.
fn put(fs: &Filesystem, name: &str, content: &[u8]) -> u64 {
    let (attr, fh) = fs
        .create(Caller::default(), ROOT, name.as_bytes(), 0o644, 0)
        .expect("create");
    fs.release(attr.ino, fh).expect("release");
    if !content.is_empty() {
        fs.write(attr.ino, 0, content, false).expect("write");
    }
    attr.ino.get()
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

fn is_enospc(e: &Error) -> bool {
    matches!(e, Error::NoSpace(_))
}

/// Writes files `{prefix}N` of [`CHUNK`]-sized writes (4 each) until a create or a write
/// answers ENOSPC, with `limit` bytes at most (None: until full); returns the names made and
/// the bytes written. The data is committed.
fn fill(fs: &Filesystem, prefix: &str, limit: Option<u64>) -> (Vec<String>, u64, bool) {
    let mut names = Vec::new();
    let mut written = 0u64;
    let mut full = false;
    'files: for n in 0.. {
        let name = format!("{prefix}{n}");
        let ino = match fs.create(Caller::default(), ROOT, name.as_bytes(), 0o644, 0) {
            Ok((attr, fh)) => {
                fs.release(attr.ino, fh).expect("release");
                attr.ino
            }
            Err(e) if is_enospc(&e) => {
                full = true;
                break;
            }
            Err(e) => panic!("create {name}: {e}"),
        };
        names.push(name.clone());
        for part in 0..4u64 {
            if limit.is_some_and(|l| written >= l) {
                break 'files;
            }
            let chunk = vec![(n as u8) ^ (part as u8) ^ 0x5a; CHUNK];
            match fs.write(ino, part * CHUNK as u64, &chunk, false) {
                Ok(_) => written += CHUNK as u64,
                Err(e) if is_enospc(&e) => {
                    full = true;
                    break 'files;
                }
                Err(e) => panic!("write {name}: {e}"),
            }
        }
    }
    fs.sync().expect("sync after the fill");
    (names, written, full)
}

/// Whether a new file of one [`CHUNK`] finds no space (the file is removed again).
fn no_space_for_a_chunk(fs: &Filesystem, name: &str) -> bool {
    let ino = match fs.create(Caller::default(), ROOT, name.as_bytes(), 0o644, 0) {
        Ok((attr, fh)) => {
            fs.release(attr.ino, fh).expect("release");
            attr.ino
        }
        Err(e) if is_enospc(&e) => return true,
        Err(e) => panic!("create {name}: {e}"),
    };
    let result = fs
        .write(ino, 0, &vec![0xEE; CHUNK], false)
        .and_then(|_| fs.sync());
    remove(fs, name);
    fs.sync().expect("sync after the probe");
    match result {
        Ok(()) => false,
        Err(e) if is_enospc(&e) => true,
        Err(e) => panic!("probe write: {e}"),
    }
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
        fs.copy_file_range(InodeNo::new(a), 0, InodeNo::new(b), 0, 1 << 20)
            .expect("clone"),
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

/// Files written until ENOSPC, a snapshot, every file deleted: the snapshot holds their
/// blocks, so writes still find no space after a commit and statfs shows none back; deleting
/// the snapshot gives the space back at its commit, and the same amount fits again.
#[test]
fn a_snapshot_keeps_a_full_filesystem_full_until_it_is_deleted() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    fs.sync().expect("sync");
    let empty = bfree(&fs);
    let (names, written, full) = fill(&fs, "f", None);
    assert!(full && written >= 40 << 20, "filled: {written} bytes");
    let at_full = bfree(&fs);
    fs.create_snapshot("s").expect("snapshot");
    for name in &names {
        remove(&fs, name);
    }
    fs.sync().expect("sync");
    let deleted = bfree(&fs);
    assert!(
        deleted <= at_full + MARGIN,
        "the snapshot holds the deleted files: {deleted} free after, {at_full} when full"
    );
    assert!(no_space_for_a_chunk(&fs, "probe"), "still full");
    let r = report(&fs, "files deleted under a snapshot");
    assert!(r.snapshots_only * BLOCK_SIZE >= written, "{r:?}");
    assert_eq!(r.snapshots[0].only_blocks, r.snapshots_only);

    fs.delete_snapshot("s").expect("delete snapshot");
    fs.sync().expect("sync");
    let back = bfree(&fs);
    assert!(
        back + MARGIN >= empty,
        "free again without a reopen: {back} vs {empty} empty"
    );
    assert_eq!(report(&fs, "snapshot deleted").snapshots_only, 0);
    let (_, again, _) = fill(&fs, "g", Some(written));
    assert_eq!(again, written, "the same amount fits again");
    common::close_and_check_clean(fs, &dev, "one snapshot");
}

/// Two snapshots, the older of part of the files, the newer of all of them, then every file
/// deleted: deleting the older snapshot gives back nothing the newer one holds (still full),
/// deleting the newer gives it all back.
#[test]
fn deleting_the_older_of_two_snapshots_returns_nothing_the_newer_holds() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    fs.sync().expect("sync");
    let empty = bfree(&fs);
    let (first, half, full) = fill(&fs, "a", Some(24 << 20));
    assert!(!full, "half of the device fits");
    fs.create_snapshot("older").expect("snapshot older");
    let (second, rest, full) = fill(&fs, "b", None);
    assert!(full, "filled");
    let at_full = bfree(&fs);
    fs.create_snapshot("newer").expect("snapshot newer");
    for name in first.iter().chain(&second) {
        remove(&fs, name);
    }
    fs.sync().expect("sync");
    assert!(
        no_space_for_a_chunk(&fs, "probe1"),
        "both snapshots hold it"
    );
    let r = report(&fs, "two snapshots");
    assert_eq!(r.snapshots.len(), 2);
    assert!(
        r.snapshots[0].only_blocks <= MARGIN,
        "the older holds nothing alone but nodes: {r:?}"
    );
    assert!(
        r.snapshots[1].only_blocks * BLOCK_SIZE >= rest,
        "the newer alone holds the second fill: {r:?}"
    );
    assert!(r.snapshots_only * BLOCK_SIZE >= half + rest, "{r:?}");

    fs.delete_snapshot("older").expect("delete older");
    fs.sync().expect("sync");
    let after_older = bfree(&fs);
    assert!(
        after_older <= at_full + MARGIN,
        "the newer snapshot still holds everything: {after_older} vs {at_full} when full"
    );
    assert!(no_space_for_a_chunk(&fs, "probe2"), "still full");
    let r = report(&fs, "older deleted");
    assert_eq!(r.snapshots.len(), 1);
    assert!(r.snapshots_only * BLOCK_SIZE >= half + rest, "{r:?}");

    fs.delete_snapshot("newer").expect("delete newer");
    fs.sync().expect("sync");
    let back = bfree(&fs);
    assert!(
        back + MARGIN >= empty,
        "free again without a reopen: {back} vs {empty} empty"
    );
    let (_, again, _) = fill(&fs, "c", Some(half + rest));
    assert_eq!(again, half + rest, "the same amount fits again");
    common::close_and_check_clean(fs, &dev, "two snapshots");
}

/// A large file cloned into a second one, the rest of the space filled, a snapshot, then
/// both files and the fill deleted: the cloned blocks stay used while the snapshot stands and
/// come back at its deletion's commit, without a reopen.
#[test]
fn cloned_blocks_a_snapshot_holds_come_back_at_its_deletion() {
    let (dev, fs) = common::fresh(DEVICE_BYTES);
    fs.sync().expect("sync");
    let empty = bfree(&fs);
    let big = pattern(24 << 20, 9);
    let a = put(&fs, "a", &big);
    let b = put(&fs, "b", b"");
    assert_eq!(
        fs.copy_file_range(InodeNo::new(a), 0, InodeNo::new(b), 0, big.len() as u64)
            .expect("clone"),
        big.len() as u64
    );
    fs.sync().expect("sync");
    assert_eq!(report(&fs, "cloned").shared, (24 << 20) / BLOCK_SIZE);
    let (names, rest, full) = fill(&fs, "f", None);
    assert!(full, "filled");
    let at_full = bfree(&fs);
    fs.create_snapshot("s").expect("snapshot");
    remove(&fs, "a");
    remove(&fs, "b");
    for name in &names {
        remove(&fs, name);
    }
    fs.sync().expect("sync");
    let deleted = bfree(&fs);
    assert!(
        deleted <= at_full + MARGIN,
        "the snapshot holds both files' blocks: {deleted} vs {at_full} when full"
    );
    assert!(no_space_for_a_chunk(&fs, "probe"), "still full");
    let r = report(&fs, "clone under a snapshot");
    assert!(
        r.snapshots[0].only_blocks * BLOCK_SIZE >= big.len() as u64 + rest,
        "the snapshot alone holds the clone and the fill: {r:?}"
    );

    fs.delete_snapshot("s").expect("delete snapshot");
    fs.sync().expect("sync");
    let back = bfree(&fs);
    assert!(
        back + MARGIN >= empty,
        "the cloned blocks are free again without a reopen: {back} vs {empty} empty"
    );
    let (_, again, _) = fill(&fs, "g", Some(big.len() as u64 + rest));
    assert_eq!(again, big.len() as u64 + rest, "the same amount fits again");
    common::close_and_check_clean(fs, &dev, "clone and snapshot");
}
