//! Scrub tests: what `birch_core::scrub` reports, and that it reports nothing it should not.
//!
//! What is proven, on one in-memory image with a big file of several extents (with a second
//! name, a hard link), a directory of 3,000 small files (a tree of more than one level) and a
//! nested file:
//!
//! - a clean image scrubs clean, reading every node and every data block once;
//! - one flipped byte in a data block is one damaged data block, owned by the big file at the
//!   right offset, with both of its paths;
//! - one flipped byte in a leaf is one damaged node whose owners include an inode whose items
//!   the leaf holds, by path (found through the directory entries, since its own names sit in
//!   the damaged leaf);
//! - a damaged block two extents reference (a leaf edited and re-sealed so that the big
//!   file's second extent points at its first one's blocks) is read once and names both
//!   owners, by file offset;
//! - a damaged root is one node damage covering every key, and the scrub still reports;
//! - the online job behind the control commands starts, refuses a second start (`Busy`),
//!   cancels, and reports its states as JSON;
//! - an online scrub (the engine's newest committed root per chunk, rate-limited so that it spans
//!   many commits) while other threads create, rewrite and delete files and commit all the
//!   time reports no damage: a block freed between chunks is never read as bad.

#![allow(clippy::expect_used)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use birch_core::device::{BlockDevice, MemDevice};
use birch_core::scrub::{
    scrub, DamageKind, EngineViews, ImageViews, ScrubOptions, ScrubProgress, ScrubReport,
};
use birch_core::vfs::{Caller, OpenOptions};
use birch_core::{Engine, Error, Filesystem, MkfsOptions};
use birch_format::items::{ExtentKind, FileExtent};
use birch_format::node::{Expect, Node, NodeBody};
use birch_format::{ItemType, Key, BLOCK_SIZE, FS_TREE_ID, NODE_SIZE, ROOT_INO};

const IMAGE_BYTES: u64 = 32 << 20;
const MANY_FILES: usize = 3000;
const BIG_BYTES: usize = 3 * (1 << 20) + 12345;

fn quiet() -> OpenOptions {
    OpenOptions {
        commit_interval: None,
        ..Default::default()
    }
}

struct Image {
    bytes: Vec<u8>,
    big_ino: u64,
    many_ino: u64,
}

fn build_image() -> Image {
    let dev = Arc::new(MemDevice::new(IMAGE_BYTES));
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    let fs = Filesystem::open_device(dev.clone(), quiet()).expect("open");
    let c = Caller::default();
    fs.mkdir(c, ROOT_INO, b"dir", 0o755).expect("mkdir dir");
    fs.mkdir(c, ROOT_INO, b"many", 0o755).expect("mkdir many");
    let big: Vec<u8> = (0..BIG_BYTES as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    fs.write_file("/dir/big", &big).expect("big");
    let big_ino = fs.resolve("/dir/big").expect("resolve big");
    fs.link(big_ino, ROOT_INO, b"big-link").expect("link");
    fs.write_file("/dir/medium", &[7u8; 20_000])
        .expect("medium");
    for n in 0..MANY_FILES {
        fs.write_file(&format!("/many/f{n:05}"), format!("file {n}").as_bytes())
            .expect("many");
    }
    let many_ino = fs.resolve("/many").expect("resolve many");
    fs.close().expect("close");
    drop(fs);
    Image {
        bytes: dev.snapshot(),
        big_ino: big_ino.get(),
        many_ino: many_ino.get(),
    }
}

fn scrub_image(bytes: Vec<u8>) -> ScrubReport {
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::from_bytes(bytes));
    let views = ImageViews::open(dev).expect("superblock");
    scrub(&views, ScrubOptions::default(), &ScrubProgress::default()).expect("scrub")
}

/// A regular extent: file offset, disk address, blocks.
type Run = (u64, u64, u64);
/// A leaf: its address and its keys.
type Leaf = (u64, Vec<Key>);

/// Every leaf (address, first key, last key) and the regular extents (file offset, disk
/// address, blocks) of `ino`, walked independently of the scrub.
fn layout(bytes: &[u8], ino: u64) -> (Vec<Leaf>, Vec<Run>, u64, u64) {
    let dev = MemDevice::from_bytes(bytes.to_vec());
    let (sb, _) = Engine::read_superblock(&dev).expect("superblock");
    let mut leaves = Vec::new();
    let mut extents = Vec::new();
    let mut nodes = 0;
    let mut data_blocks = 0;
    let mut stack = vec![(sb.fs_root.addr, sb.fs_root.generation, sb.fs_root.level)];
    while let Some((addr, generation, level)) = stack.pop() {
        let mut buf = vec![0u8; NODE_SIZE];
        dev.read_at(&mut buf, addr).expect("read");
        let expect = Expect {
            fsid: sb.fsid,
            addr,
            generation,
            owner: FS_TREE_ID,
            level: Some(level),
        };
        nodes += 1;
        match Node::decode(&buf, &expect).expect("decode").body {
            NodeBody::Internal(ptrs) => {
                stack.extend(ptrs.iter().map(|p| (p.addr, p.generation, level - 1)))
            }
            NodeBody::Leaf(items) => {
                for (key, value) in &items {
                    if key.kind() == Some(ItemType::ExtentData) {
                        let extent = FileExtent::decode(value).expect("extent");
                        if let ExtentKind::Regular { disk_addr, csums } = extent.kind {
                            data_blocks += csums.len() as u64;
                            if key.objectid == ino {
                                extents.push((key.offset, disk_addr, csums.len() as u64));
                            }
                        }
                    }
                }
                leaves.push((addr, items.iter().map(|(k, _)| *k).collect()));
            }
        }
    }
    extents.sort();
    (leaves, extents, nodes, data_blocks)
}

#[test]
fn a_clean_image_scrubs_clean_reading_everything_once() {
    let image = build_image();
    let (_, _, nodes, data_blocks) = layout(&image.bytes, image.big_ino);
    let report = scrub_image(image.bytes);
    assert!(report.is_clean(), "{:?}", report.damage);
    assert_eq!(report.nodes, nodes, "every node read once");
    assert_eq!(
        report.data_blocks, data_blocks,
        "every data block read once"
    );
    assert_eq!(
        report.bytes,
        nodes * NODE_SIZE as u64 + data_blocks * BLOCK_SIZE
    );
    assert!(report.to_json().contains("\"clean\": true"));
}

#[test]
fn a_flipped_byte_in_a_data_block_names_the_file_and_both_its_paths() {
    let image = build_image();
    let (_, extents, _, _) = layout(&image.bytes, image.big_ino);
    assert!(extents.len() >= 2, "big file extents: {extents:?}");
    let (file_offset, disk_addr, _) = extents[1];
    let bad = disk_addr + 2 * BLOCK_SIZE;
    let mut bytes = image.bytes.clone();
    bytes[bad as usize + 100] ^= 0x5a;
    let report = scrub_image(bytes);
    assert_eq!(report.damage.len(), 1, "{:#?}", report.damage);
    let damage = &report.damage[0];
    assert_eq!(damage.kind, DamageKind::Data);
    assert_eq!(damage.block, bad);
    assert_eq!(damage.owners.len(), 1);
    let owner = &damage.owners[0];
    assert_eq!(owner.inode, image.big_ino);
    assert_eq!(owner.offset, Some(file_offset));
    let mut paths = owner.paths.clone();
    paths.sort();
    assert_eq!(paths, vec!["/big-link".to_string(), "/dir/big".to_string()]);
    let json = report.to_json();
    assert!(
        json.contains("\"kind\": \"data\"") && json.contains("\"/dir/big\""),
        "{json}"
    );
    assert!(json.contains("\"healed\": false"));
}

#[test]
fn a_flipped_byte_in_a_leaf_names_an_inode_it_holds_by_path() {
    let image = build_image();
    let (leaves, _, _, _) = layout(&image.bytes, image.big_ino);
    // A leaf in the middle of /many's files, holding none of /many's own items (its
    // directory entries stay readable, so the files' paths can be found through them).
    let (leaf, keys) = leaves
        .iter()
        .filter(|(_, keys)| {
            keys.iter().all(|k| k.objectid > image.many_ino + 10)
                && keys.iter().any(|k| k.kind() == Some(ItemType::InodeItem))
        })
        .nth(3)
        .expect("a leaf of small files");
    let held = keys
        .iter()
        .find(|k| k.kind() == Some(ItemType::InodeItem))
        .map(|k| k.objectid)
        .expect("an inode item");
    let mut bytes = image.bytes.clone();
    bytes[*leaf as usize + NODE_SIZE / 2] ^= 0x01;
    let report = scrub_image(bytes);
    assert_eq!(report.damage.len(), 1, "{:#?}", report.damage);
    let damage = &report.damage[0];
    assert_eq!(damage.kind, DamageKind::Node);
    assert_eq!(damage.block, *leaf);
    let owner = damage
        .owners
        .iter()
        .find(|o| o.inode == held)
        .unwrap_or_else(|| panic!("inode {held} among the owners: {:#?}", damage.owners));
    assert_eq!(owner.paths.len(), 1, "{owner:?}");
    assert!(owner.paths[0].starts_with("/many/f"), "{owner:?}");
    assert!(damage.to_string().contains(&owner.paths[0]));
}

thread_local! {
    /// Reads on this thread are slowed down ([`SlowReads`]).
    static SLOW: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A memory device whose reads sleep on the scrub's thread: each chunk then takes long
/// enough for the writer to commit, free and reuse blocks while the chunk reads them, so a
/// scrub that did not hold its view (or did not confirm) would see rewritten blocks. (With
/// the view dropped before the reads and no confirmation, this test failed in 3 runs of 3;
/// the small device makes the allocator reuse freed blocks soon.)
struct SlowReads(MemDevice);

impl BlockDevice for SlowReads {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        if SLOW.with(|s| s.get()) {
            std::thread::sleep(std::time::Duration::from_micros(300));
        }
        self.0.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.0.write_at(buf, offset)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.0.flush()
    }
    fn size_bytes(&self) -> u64 {
        self.0.size_bytes()
    }
    fn counters(&self) -> &birch_core::counters::Counters {
        self.0.counters()
    }
}

#[test]
fn an_online_scrub_under_writes_and_deletes_reports_no_false_damage() {
    let dev = Arc::new(SlowReads(MemDevice::new(48 << 20)));
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    let fs = Arc::new(Filesystem::open_device(dev.clone(), quiet()).expect("open"));
    let c = Caller::default();
    fs.mkdir(c, ROOT_INO, b"w", 0o755).expect("mkdir");
    for n in 0..400 {
        fs.write_file(&format!("/w/f{n}"), &vec![n as u8; 4096 * (1 + n % 20)])
            .expect("write");
    }
    fs.sync().expect("sync");
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let fs = fs.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut round = 0u64;
            while !stop.load(Ordering::SeqCst) {
                for n in (round as usize % 7..400).step_by(7) {
                    let path = format!("/w/f{n}");
                    if round % 2 == 0 {
                        let dir = fs.resolve("/w").expect("resolve");
                        if let Ok(ino) = fs.resolve(&path) {
                            match fs.unlink(dir, format!("f{n}").as_bytes()) {
                                Ok(()) | Err(Error::NoSpace(_)) => {}
                                Err(e) => panic!("unlink in round {round}: {e}"),
                            }
                            // Drop the lookups the embedded calls counted, as the kernel's FORGET
                            // would: the inode and its blocks are freed now.
                            fs.forget(ino, u64::MAX);
                        }
                    } else {
                        let bytes = vec![(round + n as u64) as u8; 4096 * (1 + n % 13)];
                        match fs.write_file(&path, &bytes) {
                            // The slowed reads stretch each chunk's held view far beyond a
                            // disk's few milliseconds, so the space it pins may run out: a
                            // write may fail for that, never the scrub.
                            Ok(()) | Err(Error::NoSpace(_)) => {}
                            Err(e) => panic!("rewrite in round {round}: {e}"),
                        }
                    }
                }
                match fs.sync() {
                    Ok(()) | Err(Error::NoSpace(_)) => {}
                    Err(e) => panic!("commit in round {round}: {e}"),
                }
                round += 1;
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            round
        })
    };
    let views = EngineViews::new(fs.engine().clone());
    let mut chunks = 0;
    let mut generations = 0;
    SLOW.with(|s| s.set(true));
    for _ in 0..3 {
        // Slow enough to span many commits, fast enough for the suite.
        let options = ScrubOptions {
            rate_bytes_per_sec: Some(40_000_000),
        };
        let report = scrub(&views, options, &ScrubProgress::default()).expect("scrub");
        assert!(report.is_clean(), "false damage: {:#?}", report.damage);
        chunks += report.chunks;
        generations += report.generations;
    }
    stop.store(true, Ordering::SeqCst);
    let rounds = writer.join().expect("writer");
    assert!(rounds > 3, "the writer committed only {rounds} rounds");
    assert!(chunks > 3, "the scrubs walked {chunks} chunks");
    assert!(
        generations > 3,
        "the scrubs read under {generations} generations: not under concurrent commits"
    );
    fs.close().expect("close");
}

/// Every leaf of the image, decoded, with its address.
fn decoded_leaves(bytes: &[u8]) -> Vec<(u64, Node)> {
    let dev = MemDevice::from_bytes(bytes.to_vec());
    let (sb, _) = Engine::read_superblock(&dev).expect("superblock");
    let mut out = Vec::new();
    let mut stack = vec![(sb.fs_root.addr, sb.fs_root.generation, sb.fs_root.level)];
    while let Some((addr, generation, level)) = stack.pop() {
        let mut buf = vec![0u8; NODE_SIZE];
        dev.read_at(&mut buf, addr).expect("read");
        let expect = Expect {
            fsid: sb.fsid,
            addr,
            generation,
            owner: FS_TREE_ID,
            level: Some(level),
        };
        let node = Node::decode(&buf, &expect).expect("decode");
        match &node.body {
            NodeBody::Internal(ptrs) => {
                stack.extend(ptrs.iter().map(|p| (p.addr, p.generation, level - 1)))
            }
            NodeBody::Leaf(_) => out.push((addr, node)),
        }
    }
    out
}

/// A block two extents reference (as a damaged image may have; birchfs itself never shares
/// one) is read once, and its damage names both owners: here the big file's second extent is
/// pointed at its first one's blocks.
#[test]
fn a_damaged_block_two_extents_share_is_read_once_and_names_both_owners() {
    let image = build_image();
    let mut bytes = image.bytes.clone();
    let mut shared = None;
    for (addr, mut node) in decoded_leaves(&bytes) {
        let NodeBody::Leaf(items) = &mut node.body else {
            continue;
        };
        let extents: Vec<usize> = items
            .iter()
            .enumerate()
            .filter(|(_, (k, _))| {
                k.objectid == image.big_ino && k.kind() == Some(ItemType::ExtentData)
            })
            .map(|(slot, _)| slot)
            .collect();
        let [first, second, ..] = extents[..] else {
            continue;
        };
        let source = FileExtent::decode(&items[first].1).expect("first extent");
        let mut extent = FileExtent::decode(&items[second].1).expect("second extent");
        extent.kind = source.kind.clone();
        items[second].1 = extent.encode();
        let offsets = (items[first].0.offset, items[second].0.offset);
        // Re-sealed: the leaf's checksum still holds, only the data is damaged below.
        let sealed = node.encode().expect("encode");
        bytes[addr as usize..addr as usize + NODE_SIZE].copy_from_slice(&sealed);
        if let ExtentKind::Regular { disk_addr, .. } = source.kind {
            shared = Some((disk_addr, offsets.0, offsets.1));
        }
        break;
    }
    let (disk_addr, first_offset, second_offset) =
        shared.expect("a leaf holding two of the big file's extents");
    let (_, _, _, data_blocks) = layout(&bytes, image.big_ino);
    bytes[disk_addr as usize + 10] ^= 0x80;
    let report = scrub_image(bytes);
    assert_eq!(report.damage.len(), 1, "{:#?}", report.damage);
    let damage = &report.damage[0];
    assert_eq!((damage.kind, damage.block), (DamageKind::Data, disk_addr));
    let mut owners: Vec<(u64, Option<u64>)> =
        damage.owners.iter().map(|o| (o.inode, o.offset)).collect();
    owners.sort();
    assert_eq!(
        owners,
        vec![
            (image.big_ino, Some(first_offset)),
            (image.big_ino, Some(second_offset))
        ]
    );
    assert!(damage
        .owners
        .iter()
        .all(|o| o.paths.contains(&"/dir/big".to_string())));
    // Read once: the shared blocks count once, not once per reference.
    let shared_blocks = (data_blocks - report.data_blocks) as usize;
    assert!(
        shared_blocks > 0,
        "{} of {data_blocks} blocks read",
        report.data_blocks
    );
}

/// A damaged root hides the whole tree: one node damage, at the root, covering every key; the
/// scrub still ends with a report (no owner can be named: every name is under it).
#[test]
fn a_damaged_root_is_one_node_damage_covering_every_key() {
    let image = build_image();
    let dev = MemDevice::from_bytes(image.bytes.clone());
    let (sb, _) = Engine::read_superblock(&dev).expect("superblock");
    assert!(sb.fs_root.level > 0, "the tree has only a leaf");
    let mut bytes = image.bytes.clone();
    bytes[sb.fs_root.addr as usize + 200] ^= 0x10;
    let report = scrub_image(bytes);
    assert_eq!(report.damage.len(), 1, "{:#?}", report.damage);
    let damage = &report.damage[0];
    assert_eq!(
        (damage.kind, damage.block),
        (DamageKind::Node, sb.fs_root.addr)
    );
    assert_eq!(damage.keys, Some((Key::MIN, None)));
    assert_eq!((report.nodes, report.data_blocks), (0, 0));
}

/// The online job a mount drives through control commands: `scrub-start` runs it in its own
/// thread, a second start while it runs is `Busy`, `scrub-cancel` stops it, and the status
/// JSON says each state; a full run at no limit ends `done` and clean.
#[test]
fn the_online_job_starts_refuses_a_second_start_cancels_and_reports() {
    let image = build_image();
    let dev = Arc::new(MemDevice::from_bytes(image.bytes));
    let fs = Filesystem::open_device(dev, quiet()).expect("open");
    assert!(fs.scrub_status().contains("\"idle\""));
    // More data than one chunk (8 MiB) holds, so a rate-limited job is still sleeping between
    // chunks when the cancel comes, however fast the first chunk went.
    let (big, fh) = fs
        .create(Caller::default(), ROOT_INO, b"big", 0o644, 0)
        .expect("create big");
    fs.write(big.ino, 0, &vec![0x5cu8; 12 << 20], false)
        .expect("write big");
    fs.release(big.ino, fh).expect("release big");
    fs.sync().expect("commit big");
    let wait_done = |fs: &Filesystem| {
        for _ in 0..600 {
            let status = fs.scrub_status();
            if !status.contains("\"running\"") {
                return status;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        panic!("the scrub did not end: {}", fs.scrub_status());
    };
    // 1 MB/s: slow enough to be running when the second start comes.
    fs.control(b"scrub-start rate=1000000").expect("start");
    assert!(matches!(fs.control(b"scrub-start"), Err(Error::Busy(_))));
    fs.control(b"scrub-cancel").expect("cancel");
    let status = wait_done(&fs);
    assert!(
        status.contains("\"state\": \"done\"") && status.contains("\"cancelled\": true"),
        "{status}"
    );
    fs.control(b"scrub-start rate=0").expect("start again");
    let status = wait_done(&fs);
    assert!(
        status.contains("\"clean\": true") && status.contains("\"cancelled\": false"),
        "{status}"
    );
    assert!(matches!(
        fs.control(b"scrub-start rate=fast"),
        Err(Error::Invalid(_))
    ));
    fs.close().expect("close");
}
