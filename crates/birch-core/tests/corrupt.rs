//! Corruption tests: what fsck and mount do with damaged images.
//!
//! The promise under test (DESIGN's non-negotiables: bad input never panics): a damaged image is met with a *named* fsck finding
//! or a clear error, never a panic or a hang. Each test starts from one in-memory image with a
//! few dirs, a symlink, an xattr, a big file of several regular extents and 3,000 small files
//! (enough items for a tree of more than one level), damages a copy of its bytes, and then
//! asks `check()` and `Filesystem::open_device` about it:
//!
//! - one flipped byte in a leaf, an internal node, the newest superblock slot, both slots, and a
//!   data block, each expecting its specific [`FindingKind`] (or, for both slots, the "not a
//!   birchfs image" error) and a clean EIO from the filesystem API;
//! - garbage, truncated, all-zero, wrong-version and unknown-incompat images, each expecting an
//!   error from both open and fsck that says what is wrong;
//! - a seeded sweep of random byte flips in random metadata blocks, where nothing may panic or
//!   hang and fsck must see every change that a checksum covers, and a second sweep that
//!   re-seals the checksum after the flip so that the decoders and validators behind the
//!   checksum are exercised too.
//!
//! Every operation on a damaged image runs on a helper thread under a deadline, so a hang
//! fails the test instead of stalling the suite, and a panic is reported with what was damaged.
//! Seeds: the sweeps print theirs; `BIRCH_SEED=N` replays one exactly, `BIRCH_CASES` changes the
//! number of flips per sweep (default 200).

#![allow(clippy::expect_used)]

use std::collections::HashSet;
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use birch_core::check::{check, CheckOptions, FindingKind, Report};
use birch_core::device::MemDevice;
use birch_core::vfs::{Caller, FileKind, OpenOptions};
use birch_core::{Engine, Filesystem, MkfsOptions, ReadOnlyCause};
use birch_format::items::{ExtentKind, FileExtent};
use birch_format::node::{Expect, Node, NodeBody};
use birch_format::superblock::{Superblock, SUPER_BYTES, SUPER_OFFSETS};
use birch_format::{InodeNo, ItemType, BLOCK_SIZE, FS_TREE_ID, NODE_SIZE, ROOT_INO};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Size of the test image: room for the 4 MiB log area, 3,000 files and a 3 MiB file, and
/// small enough that the sweeps' hundreds of copies stay cheap.
const IMAGE_BYTES: u64 = 32 << 20;
/// Small files in `/many`: about 12,000 items, several leaves under an internal root.
const MANY_FILES: usize = 3000;
/// The big file spans several regular extents (an extent holds at most 256 blocks, 1 MiB).
const BIG_BYTES: usize = 3 * (1 << 20) + 12345;
/// Deadline for one operation on a damaged image; far above what a sound run takes.
const DEADLINE: Duration = Duration::from_secs(120);

/// One committed node of the fs tree, found by walking from the superblock.
#[derive(Debug, Clone, Copy)]
struct NodeInfo {
    addr: u64,
    level: u8,
    is_root: bool,
}

/// The pristine image and where things are in it.
struct Image {
    bytes: Vec<u8>,
    /// Generation of the newest superblock; the older slot holds `generation - 1`.
    generation: u64,
    nodes: Vec<NodeInfo>,
    /// Regular extents of `/big`: (disk address, blocks).
    big_extents: Vec<(u64, u64)>,
    big: Vec<u8>,
}

fn quiet() -> OpenOptions {
    OpenOptions {
        commit_interval: None,
        ..Default::default()
    }
}

fn big_content() -> Vec<u8> {
    (0..BIG_BYTES as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

/// Builds the image once per test binary; every test damages its own copy of the bytes.
fn image() -> &'static Image {
    static IMAGE: OnceLock<Image> = OnceLock::new();
    IMAGE.get_or_init(build_image)
}

fn build_image() -> Image {
    let dev = Arc::new(MemDevice::new(IMAGE_BYTES));
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    let big = big_content();
    {
        let fs = Filesystem::open_device(dev.clone(), quiet()).expect("open");
        let c = Caller::default();
        fs.mkdir(c, ROOT_INO, b"dir", 0o755).expect("mkdir dir");
        fs.mkdir(c, ROOT_INO, b"many", 0o755).expect("mkdir many");
        fs.write_file("/dir/small", b"hello").expect("small");
        fs.write_file("/dir/medium", &[7u8; 20_000])
            .expect("medium");
        fs.write_file("/big", &big).expect("big");
        fs.symlink(c, ROOT_INO, b"link", b"/dir/small")
            .expect("symlink");
        let small = fs.resolve("/dir/small").expect("resolve small");
        fs.setxattr(small, b"user.k", b"v", 0).expect("xattr");
        for n in 0..MANY_FILES {
            fs.write_file(&format!("/many/f{n:05}"), format!("file {n}").as_bytes())
                .expect("many");
        }
        fs.sync().expect("sync");
        // One more commit, so the older slot holds a complete tree one change behind.
        fs.write_file("/last", b"only in the newest generation")
            .expect("last");
        fs.close().expect("close");
    }
    let report = check(&*dev, CheckOptions { data: true }).expect("fsck of the pristine image");
    assert!(report.is_clean(), "pristine image: {:#?}", report.findings);
    let (sb, notes) = Engine::read_superblock(&*dev).expect("superblock");
    assert!(notes.is_empty(), "pristine superblocks: {notes:?}");
    let big_ino = {
        let fs = Filesystem::open_device(dev.clone(), quiet()).expect("reopen");
        let ino = fs.resolve("/big").expect("resolve big");
        // Read-only use only: no atime update, so no further commit moves the tree.
        fs.engine().set_read_only(ReadOnlyCause::Mounted);
        ino
    };
    let (nodes, big_extents) = walk_nodes(&dev, &sb, big_ino.get());
    assert!(
        nodes.iter().any(|n| n.level > 0),
        "the tree has only a leaf; add items"
    );
    assert!(big_extents.len() >= 3, "big file extents: {big_extents:?}");
    Image {
        bytes: dev.snapshot(),
        generation: sb.generation,
        nodes,
        big_extents,
        big,
    }
}

/// Every node of the fs tree and the regular extents of inode `big_ino`.
fn walk_nodes(dev: &MemDevice, sb: &Superblock, big_ino: u64) -> (Vec<NodeInfo>, Vec<(u64, u64)>) {
    let mut nodes = Vec::new();
    let mut extents = Vec::new();
    let root = sb.fs_root;
    let mut stack = vec![(root.addr, root.generation, root.level)];
    while let Some((addr, generation, level)) = stack.pop() {
        let mut bytes = vec![0u8; NODE_SIZE];
        birch_core::device::BlockDevice::read_at(dev, &mut bytes, addr).expect("read node");
        let expect = Expect {
            fsid: sb.fsid,
            addr,
            generation,
            owner: FS_TREE_ID,
            level: Some(level),
        };
        let node = Node::decode(&bytes, &expect).expect("decode node");
        nodes.push(NodeInfo {
            addr,
            level,
            is_root: addr == root.addr,
        });
        match node.body {
            NodeBody::Internal(ptrs) => {
                stack.extend(ptrs.iter().map(|p| (p.addr, p.generation, level - 1)));
            }
            NodeBody::Leaf(items) => {
                for (key, value) in items {
                    if key.objectid == big_ino && key.kind() == Some(ItemType::ExtentData) {
                        let extent = FileExtent::decode(&value).expect("extent");
                        if let ExtentKind::Regular { disk_addr, csums } = extent.kind {
                            extents.push((disk_addr, csums.len() as u64));
                        }
                    }
                }
            }
        }
    }
    (nodes, extents)
}

/// Runs `f` on a helper thread; `Err` says it panicked (with the message) or hung.
fn within<T: Send + 'static>(
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(DEADLINE) {
        Ok(value) => {
            let _ = handle.join();
            Ok(value)
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            let message = match handle.join() {
                Err(payload) => payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "a non-string panic".into()),
                Ok(()) => "the thread ended without a result".into(),
            };
            Err(format!("{what}: panicked: {message}"))
        }
        // The thread is left behind: it cannot be stopped, and the test fails anyway.
        Err(mpsc::RecvTimeoutError::Timeout) => Err(format!("{what}: no answer in {DEADLINE:?}")),
    }
}

/// `within`, failing the test on a panic or a hang.
fn must<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    within(what, f).unwrap_or_else(|e| panic!("{e}"))
}

/// fsck of `bytes`, as a string error so it crosses the thread boundary.
fn check_bytes(bytes: Vec<u8>, data: bool) -> Result<Report, String> {
    must("check", move || {
        let dev = MemDevice::from_bytes(bytes);
        check(&dev, CheckOptions { data }).map_err(|e| e.to_string())
    })
}

/// What opening `bytes` gave: the error (message, errno) or nothing.
fn open_error(bytes: Vec<u8>) -> Option<(String, i32)> {
    must("open_device", move || {
        let dev = Arc::new(MemDevice::from_bytes(bytes));
        match Filesystem::open_device(dev, quiet()) {
            Ok(fs) => {
                let _ = fs.close();
                None
            }
            Err(e) => Some((e.to_string(), e.errno())),
        }
    })
}

fn kinds(report: &Report) -> HashSet<FindingKind> {
    report.findings.iter().map(|f| f.kind).collect()
}

fn flip(bytes: &mut [u8], at: u64) {
    bytes[at as usize] ^= 0x5a;
}

/// Re-encodes both superblock slots after `change`, with valid checksums.
fn rewrite_superblocks(bytes: &mut [u8], change: impl Fn(&mut Superblock)) {
    for offset in SUPER_OFFSETS {
        let at = offset as usize;
        let mut sb = Superblock::decode(&bytes[at..at + SUPER_BYTES], "test").expect("decode");
        change(&mut sb);
        bytes[at..at + SUPER_BYTES].copy_from_slice(&sb.encode());
    }
}

fn newest_slot_offset(image: &Image) -> u64 {
    SUPER_OFFSETS[(image.generation % 2) as usize]
}

/// A flipped node byte: fsck names the node as unreadable, and open refuses with EIO.
fn assert_node_flip_found(node: NodeInfo) {
    let mut bytes = image().bytes.clone();
    flip(&mut bytes, node.addr + 200);
    let report = check_bytes(bytes.clone(), false).expect("fsck runs");
    assert!(
        report
            .findings
            .iter()
            .any(|f| f.kind == FindingKind::NodeUnreadable && f.block == Some(node.addr)),
        "node {:#x} level {}: findings {:#?}",
        node.addr,
        node.level,
        report.findings
    );
    let (message, errno) = open_error(bytes).expect("open must refuse a tree it cannot read");
    assert_eq!(errno, libc::EIO, "{message}");
    assert!(
        message.contains("checksum") && message.contains(&format!("{:#x}", node.addr)),
        "the error should name the node and the checksum: {message}"
    );
    assert!(
        message.contains("birch fsck"),
        "the error should say to run fsck: {message}"
    );
}

#[test]
fn flipped_byte_in_a_leaf_is_node_unreadable() {
    let leaf = image()
        .nodes
        .iter()
        .copied()
        .filter(|n| n.level == 0)
        .nth(1)
        .expect("a leaf");
    assert_node_flip_found(leaf);
}

#[test]
fn flipped_byte_in_an_internal_node_is_node_unreadable() {
    let internal = image()
        .nodes
        .iter()
        .copied()
        .filter(|n| n.level > 0)
        .min_by_key(|n| (n.is_root, n.level))
        .expect("an internal node");
    assert_node_flip_found(internal);
}

#[test]
fn flipped_byte_in_the_newest_superblock_falls_back_to_the_other_slot() {
    let image = image();
    let mut bytes = image.bytes.clone();
    flip(&mut bytes, newest_slot_offset(image) + 40);
    let report = check_bytes(bytes.clone(), true).expect("fsck works from the other slot");
    assert_eq!(
        kinds(&report),
        HashSet::from([FindingKind::SuperblockSlotBad]),
        "findings: {:#?}",
        report.findings
    );
    let used = report.superblock.as_ref().map(|sb| sb.generation);
    assert_eq!(used, Some(image.generation - 1), "fsck used the older slot");
    let big = image.big.clone();
    must("open and read from the older slot", move || {
        let fs = Filesystem::open_device(Arc::new(MemDevice::from_bytes(bytes)), quiet())
            .expect("open falls back to the older slot");
        assert_eq!(fs.read_file("/big").expect("big"), big);
        assert_eq!(fs.read_file("/dir/small").expect("small"), b"hello");
        assert_eq!(fs.read_file("/many/f02999").expect("many"), b"file 2999");
        // The older generation predates `/last`.
        let last = fs
            .resolve("/last")
            .expect_err("/last is one generation newer");
        assert_eq!(last.errno(), libc::ENOENT);
        fs.close().expect("close");
    });
}

/// Both superblock copies carry the magic but fail their checksums: damage to a birchfs
/// image, so open says EIO and names both slots (it used to say EINVAL, "not a birchfs
/// image", as for bytes that were never birchfs).
#[test]
fn flipped_bytes_in_both_superblocks_is_a_damaged_image_and_eio() {
    let mut bytes = image().bytes.clone();
    for offset in SUPER_OFFSETS {
        flip(&mut bytes, offset + 40);
    }
    let err = check_bytes(bytes.clone(), false).expect_err("fsck has no superblock to start");
    assert!(
        err.contains("no valid superblock") && err.contains("checksum"),
        "{err}"
    );
    let (message, errno) = open_error(bytes).expect("open must refuse");
    assert_eq!(errno, libc::EIO, "{message}");
    assert!(
        message.contains("damaged birchfs image") && message.contains("birch fsck"),
        "{message}"
    );
    for offset in SUPER_OFFSETS {
        assert!(
            message.contains(&format!("{offset:#x}")),
            "the error names the slot at {offset:#x}: {message}"
        );
    }
}

#[test]
fn flipped_byte_in_a_data_block_is_a_data_checksum_mismatch_and_eio() {
    let image = image();
    let (disk_addr, blocks) = image.big_extents[1];
    let block = disk_addr + (blocks / 2) * BLOCK_SIZE;
    let mut bytes = image.bytes.clone();
    flip(&mut bytes, block + 77);
    // Without the data pass fsck reads metadata only, and the metadata is sound.
    let metadata_only = check_bytes(bytes.clone(), false).expect("fsck runs");
    assert!(metadata_only.is_clean(), "{:#?}", metadata_only.findings);
    let report = check_bytes(bytes.clone(), true).expect("fsck runs");
    assert_eq!(
        kinds(&report),
        HashSet::from([FindingKind::DataChecksumMismatch])
    );
    assert_eq!(report.findings.len(), 1);
    assert_eq!(report.findings[0].block, Some(block));
    must("read of the damaged file", move || {
        let fs = Filesystem::open_device(Arc::new(MemDevice::from_bytes(bytes)), quiet())
            .expect("metadata is sound: open works");
        let err = fs
            .read_file("/big")
            .expect_err("damaged block must not be returned");
        assert_eq!(err.errno(), libc::EIO, "{err}");
        assert!(err.to_string().contains("checksum"), "{err}");
        // Other files and undamaged ranges of the same file still read.
        assert_eq!(fs.read_file("/dir/small").expect("small"), b"hello");
        let ino = fs.resolve("/big").expect("resolve");
        let head = fs.read(ino, 0, 4096).expect("first block is sound");
        assert_eq!(head, image.big[..4096]);
        fs.close().expect("close");
    });
}

/// Both open and fsck refuse `bytes`; every message contains one of `words`.
fn assert_refused(what: &str, bytes: Vec<u8>, words: &[&str]) {
    let says = |m: &str| words.iter().any(|w| m.contains(w));
    let err = check_bytes(bytes.clone(), true)
        .map(|r| r.findings)
        .expect_err(what);
    assert!(
        says(&err),
        "{what}: fsck said {err:?}, expected one of {words:?}"
    );
    let (message, errno) = open_error(bytes).unwrap_or_else(|| panic!("{what}: open worked"));
    assert!(
        says(&message),
        "{what}: open said {message:?}, expected one of {words:?}"
    );
    assert_ne!(errno, 0);
}

#[test]
fn garbage_image_is_refused() {
    let mut rng = SmallRng::seed_from_u64(1);
    let mut bytes = vec![0u8; 8 << 20];
    rng.fill(&mut bytes[..]);
    assert_refused("garbage", bytes, &["not a birchfs image"]);
}

#[test]
fn all_zero_image_is_refused() {
    assert_refused("all zero", vec![0u8; 8 << 20], &["not a birchfs image"]);
}

#[test]
fn truncated_images_are_refused() {
    let image = image();
    // Both superblocks survive in the first 100 KiB: the size check catches it.
    let head = image.bytes[..100 << 10].to_vec();
    assert_refused("first 100 KiB", head, &["truncated"]);
    // Cut in the middle of the tree: half the nodes lie past the end.
    let mut addrs: Vec<u64> = image.nodes.iter().map(|n| n.addr).collect();
    addrs.sort_unstable();
    let cut = addrs[addrs.len() / 2] as usize;
    assert_refused("cut mid-tree", image.bytes[..cut].to_vec(), &["truncated"]);
    // Shorter than the superblock slots: nothing to read at all.
    let tiny = image.bytes[..32 << 10].to_vec();
    assert_refused("first 32 KiB", tiny, &["not a birchfs image"]);
}

#[test]
fn wrong_version_is_refused() {
    let mut bytes = image().bytes.clone();
    rewrite_superblocks(&mut bytes, |sb| sb.version = 2);
    assert_refused("version 2", bytes, &["unsupported format version 2"]);
}

#[test]
fn unknown_incompat_flag_is_refused() {
    let mut bytes = image().bytes.clone();
    rewrite_superblocks(&mut bytes, |sb| sb.incompat |= 1 << 40);
    assert_refused("incompat 1<<40", bytes, &["incompatible feature flags"]);
}

/// Opens `bytes` and touches everything reachable: every dir listed, every file read, every
/// symlink read. Errors are fine; only panics and hangs are failures. Returns whether open
/// worked and how many errors the walk met.
fn open_and_walk(bytes: Vec<u8>) -> (bool, usize) {
    let dev = Arc::new(MemDevice::from_bytes(bytes));
    let Ok(fs) = Filesystem::open_device(dev, quiet()) else {
        return (false, 0);
    };
    let mut errors = 0;
    let mut seen = HashSet::from([1u64]);
    let mut dirs = vec![1u64];
    while let Some(dir) = dirs.pop() {
        let mut cookie = 0;
        loop {
            let Ok(page) = fs.readdir(InodeNo::new(dir), cookie, 512) else {
                errors += 1;
                break;
            };
            let Some(last) = page.last() else { break };
            cookie = last.next_offset;
            for entry in &page {
                if entry.name == b"." || entry.name == b".." || !seen.insert(entry.ino.get()) {
                    continue;
                }
                errors += usize::from(!touch(&fs, entry.ino.get(), entry.kind, &mut dirs));
            }
        }
    }
    errors += usize::from(fs.close().is_err());
    (true, errors)
}

/// Reads one inode the way a mount would; false on an error.
fn touch(fs: &Filesystem, ino: u64, kind: FileKind, dirs: &mut Vec<u64>) -> bool {
    match kind {
        FileKind::Dir => {
            dirs.push(ino);
            true
        }
        FileKind::Symlink => fs.readlink(InodeNo::new(ino)).is_ok(),
        _ => {
            let Ok(attr) = fs.getattr(InodeNo::new(ino)) else {
                return false;
            };
            // Read in 1 MiB pieces, as the kernel would: a damaged size must not become one
            // giant buffer here.
            let mut offset = 0;
            while offset < attr.size.min(64 << 20) {
                match fs.read(InodeNo::new(ino), offset, 1 << 20) {
                    Ok(data) if !data.is_empty() => offset += data.len() as u64,
                    Ok(_) => break,
                    Err(_) => return false,
                }
            }
            true
        }
    }
}

fn env(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// A metadata block of the image: a superblock slot or one block of a node.
#[derive(Debug, Clone, Copy)]
enum Target {
    Superblock(usize),
    Node(NodeInfo),
}

/// What one sweep case damaged, for the failure report.
struct Damage {
    target: Target,
    /// Absolute byte offsets changed.
    offsets: Vec<u64>,
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at: Vec<String> = self.offsets.iter().map(|o| format!("{o:#x}")).collect();
        write!(f, "{:?}, bytes at {}", self.target, at.join(", "))
    }
}

/// Damages a copy of the image: 1-4 bytes of one random metadata block. With `reseal`, the
/// checksum of the damaged superblock or node is recomputed, so the damage reaches decoding.
fn damage(rng: &mut SmallRng, reseal: bool) -> (Vec<u8>, Damage) {
    let image = image();
    let target = if rng.gen_ratio(1, 10) {
        Target::Superblock(rng.gen_range(0..2))
    } else {
        Target::Node(image.nodes[rng.gen_range(0..image.nodes.len())])
    };
    let (start, len) = match target {
        Target::Superblock(slot) => (SUPER_OFFSETS[slot], SUPER_BYTES as u64),
        Target::Node(node) => (node.addr, NODE_SIZE as u64),
    };
    // Half the cases aim at the first 512 bytes, where the header, item headers and child
    // pointers sit (the bytes decoding trusts most); the rest pick any block of the target.
    // Resealed damage skips the checksum field itself.
    let (block, span) = if rng.gen_bool(0.5) {
        (start, 512)
    } else {
        (
            start + rng.gen_range(0..len / BLOCK_SIZE) * BLOCK_SIZE,
            BLOCK_SIZE,
        )
    };
    let first = if reseal && block == start { 4 } else { 0 };
    let mut bytes = image.bytes.clone();
    let mut offsets: Vec<u64> = (0..rng.gen_range(1..=4))
        .map(|_| block + rng.gen_range(first..span))
        .collect();
    offsets.sort_unstable();
    offsets.dedup();
    for at in &offsets {
        bytes[*at as usize] ^= rng.gen_range(1..=255u8);
    }
    if reseal {
        let range = start as usize..(start + len) as usize;
        let sum = birch_format::checksum(&bytes[range.start + 4..range.end]);
        bytes[range.start..range.start + 4].copy_from_slice(&sum.to_le_bytes());
    }
    (bytes, Damage { target, offsets })
}

/// How the cases of one sweep ended, printed so a run shows what it exercised.
#[derive(Debug, Default)]
struct Tally {
    fsck_refused: u64,
    fsck_found: u64,
    fsck_clean: u64,
    open_refused: u64,
    walks_with_errors: u64,
    walks_clean: u64,
}

/// Runs one sweep; returns the failures (empty when sound).
fn sweep(name: &str, reseal: bool) -> Vec<String> {
    let all_cases = env("BIRCH_CASES").unwrap_or(200);
    let fixed = if reseal { 0xc0_5ea1 } else { 0xc0_f11b };
    let seeds = birch_testkit::seeds::fixed_and_fresh(name, fixed);
    let mut failures = Vec::new();
    for (index, &seed) in seeds.iter().enumerate() {
        let cases = birch_testkit::seeds::share(all_cases, index, seeds.len());
        failures.extend(sweep_seed(name, reseal, seed, cases));
    }
    failures
}

/// One seed's share of a sweep: `cases` damaged images from `seed`.
fn sweep_seed(name: &str, reseal: bool, seed: u64, cases: u64) -> Vec<String> {
    println!("{name}: seed {seed} ({cases} cases; replay with BIRCH_SEED={seed})");
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut failures = Vec::new();
    let mut tally = Tally::default();
    for case in 0..cases {
        let (bytes, damage) = damage(&mut rng, reseal);
        let context = format!("{name} seed {seed} case {case}: {damage}");
        let checked = within(&format!("{context}: check"), {
            let bytes = bytes.clone();
            move || {
                let dev = MemDevice::from_bytes(bytes);
                check(&dev, CheckOptions { data: true }).map(|r| r.findings.len())
            }
        });
        match checked {
            Err(e) => {
                failures.push(e);
                continue;
            }
            Ok(Err(_)) => tally.fsck_refused += 1,
            Ok(Ok(0)) => {
                tally.fsck_clean += 1;
                // A change under an intact checksum must never go unseen.
                if !reseal {
                    failures.push(format!("{context}: fsck found nothing"));
                }
            }
            Ok(Ok(_)) => tally.fsck_found += 1,
        }
        match within(&format!("{context}: open and walk"), move || {
            open_and_walk(bytes)
        }) {
            Err(e) => failures.push(e),
            Ok((false, _)) => {
                tally.open_refused += 1;
                // One superblock slot is always intact: the image must still open.
                if !reseal && matches!(damage.target, Target::Superblock(_)) {
                    failures.push(format!("{context}: open failed with one good slot"));
                }
            }
            Ok((true, 0)) => tally.walks_clean += 1,
            Ok((true, _)) => tally.walks_with_errors += 1,
        }
    }
    println!("{name}: {tally:?}");
    failures
}

#[test]
fn random_metadata_flips_are_found_and_never_panic() {
    let failures = sweep("flip sweep", false);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn random_flips_behind_a_valid_checksum_never_panic() {
    let failures = sweep("resealed flip sweep", true);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
