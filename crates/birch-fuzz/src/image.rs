//! Targets on a whole small image: the fsync log's replay and the open and walk of a tree.
//! One image is built per process (mkfs, a few dirs, files, a symlink, xattrs, a big file and
//! enough small files for a tree of more than one level; then a few fsyncs whose batches stay
//! in the log); each input damages a copy of its bytes structurally, re-sealing checksums, and
//! then opens it (which replays the log), reads everything and runs fsck. Any result is fine
//! but a panic or a hang (the runner's deadline).

use std::collections::HashSet;
use std::sync::{Arc, OnceLock};

use birch_core::check::{check, CheckOptions};
use birch_core::device::MemDevice;
use birch_core::log::read_log;
use birch_core::vfs::{Caller, FileKind, OpenOptions};
use birch_core::{Engine, Filesystem, MkfsOptions};
use birch_format::log::{decode_batch, decode_header, encode_batch, LogRecord};
use birch_format::node::{Expect, Node, NodeBody};
use birch_format::superblock::{Superblock, SUPER_BYTES, SUPER_OFFSETS};
use birch_format::{Key, BLOCK_SIZE, FS_TREE_ID, NODE_SIZE, ROOT_INO};

use crate::format::{
    batch_fields, item_payload, node_fields, reseal_batch, reseal_node, reseal_super, KINDS,
    SUPER_FIELDS,
};
use crate::script::{mutate_fields, Script};

/// Size of the fuzz image: the 4 MiB log area and a few hundred files.
const IMAGE_BYTES: u64 = 16 << 20;
/// Small files: enough items for several leaves under an internal root.
const SMALL_FILES: usize = 300;

/// One batch of the pending log.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Device byte offset.
    pub offset: u64,
    /// Its header fields.
    pub fsid: [u8; 16],
    /// Sequence number.
    pub seq: u64,
    /// Lsn.
    pub lsn: u64,
    /// Encoded length.
    pub len: usize,
    /// Records.
    pub records: Vec<LogRecord>,
}

/// The base image and where things are in it.
pub struct Base {
    /// The image with log batches not yet covered by a commit.
    pub logged: Vec<u8>,
    /// Those batches, in log order.
    pub batches: Vec<Batch>,
    /// The same image after the log was replayed and committed (a clean close).
    pub committed: Vec<u8>,
    /// Every node of the committed image's fs tree: (address, generation, level).
    pub nodes: Vec<(u64, u64, u8)>,
    /// The committed image's newest superblock.
    pub sb: Superblock,
    /// Its encoded slot.
    pub super_bytes: Vec<u8>,
}

fn quiet() -> OpenOptions {
    OpenOptions {
        commit_interval: None,
        ..Default::default()
    }
}

/// The base image, built once per process.
pub fn base() -> &'static Base {
    static BASE: OnceLock<Base> = OnceLock::new();
    BASE.get_or_init(|| build().unwrap_or_else(|e| panic!("building the fuzz image: {e}")))
}

fn build() -> Result<Base, String> {
    let err = |what: &str| {
        let what = what.to_string();
        move |e: birch_core::Error| format!("{what}: {e}")
    };
    let dev = Arc::new(MemDevice::new(IMAGE_BYTES));
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).map_err(err("mkfs"))?;
    let fs = Filesystem::open_device(dev.clone(), quiet()).map_err(err("open"))?;
    let c = Caller::default();
    fs.mkdir(c, ROOT_INO, b"dir", 0o755).map_err(err("mkdir"))?;
    fs.mkdir(c, ROOT_INO, b"many", 0o755)
        .map_err(err("mkdir"))?;
    fs.write_file("/dir/small", b"hello")
        .map_err(err("small"))?;
    fs.write_file("/dir/medium", &[7u8; 20_000])
        .map_err(err("medium"))?;
    let big: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 4096) as u8).collect();
    fs.write_file("/big", &big).map_err(err("big"))?;
    fs.symlink(c, ROOT_INO, b"link", b"/dir/small")
        .map_err(err("symlink"))?;
    let small = fs.resolve("/dir/small").map_err(err("resolve"))?;
    fs.setxattr(small, b"user.k", b"v", 0)
        .map_err(err("xattr"))?;
    fs.setxattr(small, b"user.big", &[3u8; 9000], 0)
        .map_err(err("big xattr"))?;
    for n in 0..SMALL_FILES {
        fs.write_file(&format!("/many/f{n:04}"), format!("file {n}").as_bytes())
            .map_err(err("many"))?;
    }
    fs.sync().map_err(err("sync"))?;
    // Changes that only the log holds: an append, a new file, an xattr, a rename, each fsynced.
    let medium = fs.resolve("/dir/medium").map_err(err("resolve"))?;
    fs.write(medium, 20_000, &[9u8; 5000], false)
        .map_err(err("append"))?;
    fs.fsync(medium, false).map_err(err("fsync"))?;
    let (f, _) = fs
        .create(c, ROOT_INO, b"fresh", 0o644, 0)
        .map_err(err("create"))?;
    fs.write(f.ino, 0, b"fresh data", false)
        .map_err(err("write"))?;
    fs.fsync(f.ino, false).map_err(err("fsync"))?;
    fs.setxattr(f.ino, b"user.x", b"y", 0)
        .map_err(err("xattr"))?;
    fs.fsync(f.ino, false).map_err(err("fsync"))?;
    fs.write(small, 0, &[1u8; 6000], false)
        .map_err(err("rewrite"))?;
    fs.fsync(small, true).map_err(err("fsync"))?;
    let logged = dev.snapshot();
    drop(fs);
    let logged_dev = MemDevice::from_bytes(logged.clone());
    let (sb, _) = Engine::read_superblock(&logged_dev).map_err(err("superblock"))?;
    let batches = read_batches(&logged, &sb);
    if batches.is_empty() {
        return Err("the fuzz image has no pending log batch".into());
    }
    let dev = Arc::new(MemDevice::from_bytes(logged.clone()));
    let fs = Filesystem::open_device(dev.clone(), quiet()).map_err(err("reopen"))?;
    fs.close().map_err(err("close"))?;
    drop(fs);
    let committed = dev.snapshot();
    let (sb, _) = Engine::read_superblock(&*dev).map_err(err("superblock"))?;
    let nodes = tree_nodes(&committed, &sb)?;
    let super_bytes = slot_bytes(&committed, &sb).to_vec();
    Ok(Base {
        logged,
        batches,
        committed,
        nodes,
        sb,
        super_bytes,
    })
}

fn slot_bytes<'a>(image: &'a [u8], sb: &Superblock) -> &'a [u8] {
    let at = SUPER_OFFSETS[sb.slot()] as usize;
    &image[at..at + SUPER_BYTES]
}

/// The batches from the superblock's log head, while they decode in sequence.
fn read_batches(image: &[u8], sb: &Superblock) -> Vec<Batch> {
    let mut out = Vec::new();
    let mut lsn = sb.log_head;
    let mut seq = sb.log_generation;
    if sb.log_bytes == 0 {
        return out;
    }
    loop {
        let offset = sb.log_start + lsn % sb.log_bytes;
        let at = offset as usize;
        let Some(header) = image
            .get(at..at + BLOCK_SIZE as usize)
            .and_then(decode_header)
        else {
            break;
        };
        let len = header.len_bytes as usize;
        let Some(Ok((header, records))) = image.get(at..at + len).map(decode_batch) else {
            break;
        };
        if header.seq != seq || header.lsn != lsn {
            break;
        }
        out.push(Batch {
            offset,
            fsid: header.fsid,
            seq: header.seq,
            lsn: header.lsn,
            len,
            records,
        });
        lsn += len as u64;
        seq += 1;
    }
    out
}

fn tree_nodes(image: &[u8], sb: &Superblock) -> Result<Vec<(u64, u64, u8)>, String> {
    let mut out = Vec::new();
    let mut stack = vec![(sb.fs_root.addr, sb.fs_root.generation, sb.fs_root.level)];
    while let Some((addr, generation, level)) = stack.pop() {
        let at = addr as usize;
        let bytes = image
            .get(at..at + NODE_SIZE)
            .ok_or_else(|| format!("node {addr:#x} past the image"))?;
        let expect = Expect {
            fsid: sb.fsid,
            addr,
            generation,
            owner: FS_TREE_ID,
            level: Some(level),
        };
        let node = Node::decode(bytes, &expect).map_err(|e| e.to_string())?;
        out.push((addr, generation, level));
        if let NodeBody::Internal(ptrs) = node.body {
            stack.extend(
                ptrs.iter()
                    .map(|p| (p.addr, p.generation, level.saturating_sub(1))),
            );
        }
    }
    Ok(out)
}

/// Damages the fields of both superblock slots the same way, re-sealing them.
fn mutate_supers(image: &mut [u8], s: &mut Script<'_>) {
    let mut slot = slot_bytes(image, &base().sb).to_vec();
    mutate_fields(&mut slot, &SUPER_FIELDS, s, 2);
    reseal_super(&mut slot);
    for offset in SUPER_OFFSETS {
        let at = offset as usize;
        if let Some(dst) = image.get_mut(at..at + SUPER_BYTES) {
            dst.copy_from_slice(&slot);
        }
    }
}

/// Mutates one record: its generation, key, value (a valid payload of another type, or bytes
/// changed), or turns it into a deletion.
fn mutate_record(r: &mut LogRecord, s: &mut Script<'_>) {
    match s.u8() % 8 {
        0 => r.generation = s.interesting(8),
        1 => r.key.objectid = s.interesting(8),
        2 => r.key.offset = s.interesting(8),
        3 => r.key.item_type = KINDS[s.below(KINDS.len())] as u8,
        4 => r.value = None,
        5 => {
            let kind = KINDS[s.below(KINDS.len())];
            r.value = Some(item_payload(kind, s));
        }
        _ => {
            if let Some(v) = r.value.as_mut().filter(|v| !v.is_empty()) {
                for _ in 0..1 + s.below(4) {
                    let at = s.below(v.len());
                    v[at] = s.u8();
                }
            }
        }
    }
}

/// Reads everything the filesystem shows: every directory (bounded), every file's bytes,
/// symlink targets and xattrs. Errors are answers too; only panics and hangs are findings.
fn walk(fs: &Filesystem) -> usize {
    let mut seen = HashSet::new();
    let mut stack = vec![(ROOT_INO, 0usize)];
    let mut errors = 0;
    let mut visited = 0;
    while let Some((dir, depth)) = stack.pop() {
        if !seen.insert(dir) || depth > 16 || visited > 5000 {
            continue;
        }
        let mut offset = 0;
        for _ in 0..64 {
            let entries = match fs.readdir(dir, offset, 256) {
                Ok(entries) => entries,
                Err(_) => {
                    errors += 1;
                    break;
                }
            };
            let Some(last) = entries.last() else { break };
            offset = last.next_offset;
            for e in &entries {
                if e.name == b"." || e.name == b".." {
                    continue;
                }
                visited += 1;
                let attr = match fs.lookup(dir, &e.name) {
                    Ok(attr) => attr,
                    Err(_) => {
                        errors += 1;
                        continue;
                    }
                };
                match attr.kind {
                    FileKind::Dir => stack.push((attr.ino, depth + 1)),
                    FileKind::File => {
                        let len = attr.size.min(1 << 20) as usize;
                        errors += usize::from(fs.read(attr.ino, 0, len.max(1)).is_err());
                    }
                    FileKind::Symlink => errors += usize::from(fs.readlink(attr.ino).is_err()),
                    _ => {}
                }
                match fs.listxattr(attr.ino) {
                    Ok(names) => {
                        for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
                            errors += usize::from(fs.getxattr(attr.ino, name).is_err());
                        }
                    }
                    Err(_) => errors += 1,
                }
            }
        }
    }
    errors
}

/// Opens the image (replaying its log), walks it, closes it, and runs fsck on what is left.
/// With `BIRCH_FUZZ_DUMP=PATH` set, the damaged image is first written to PATH (to replay a
/// finding with `birch fsck` or the printers); with `BIRCH_FUZZ_VERBOSE` set, fsck's findings
/// are printed.
fn open_walk_check(image: Vec<u8>) -> String {
    if let Some(path) = std::env::var_os("BIRCH_FUZZ_DUMP") {
        if let Err(e) = std::fs::write(&path, &image) {
            eprintln!("birch-fuzz: BIRCH_FUZZ_DUMP: {e}");
        }
    }
    let dev = Arc::new(MemDevice::from_bytes(image));
    let opened = match Filesystem::open_device(dev.clone(), quiet()) {
        Ok(fs) => {
            let errors = walk(&fs);
            let closed = fs.close().is_ok();
            format!("open ok, walk errors {}, close {closed}", errors.min(1))
        }
        Err(e) => format!("open err {}", e.errno()),
    };
    let checked = match check(&*dev, CheckOptions { data: true }) {
        Ok(report) => {
            if std::env::var_os("BIRCH_FUZZ_VERBOSE").is_some() {
                for f in &report.findings {
                    eprintln!("finding: {f:?}");
                }
            }
            let mut kinds: Vec<String> = report
                .findings
                .iter()
                .map(|f| format!("{:?}", f.kind))
                .collect();
            kinds.sort();
            kinds.dedup();
            format!(
                "fsck {} kinds, first {:?}",
                kinds.len().min(2),
                kinds.first()
            )
        }
        Err(e) => format!("fsck err {}", e.errno()),
    };
    format!("{opened}; {checked}")
}

/// Target `log_replay`: the image with pending fsync batches; one batch's records are
/// changed (generation, key, value, deleted, duplicated, dropped, reordered) or its header's
/// sequence, lsn or fsid, re-encoded with the format's encoder (so its checksum is valid) and
/// written back; sometimes a field of the encoded batch is changed and re-sealed, or the
/// superblock's log fields. Then `read_log`, open (replay), walk, close and fsck.
pub fn log_replay(data: &[u8]) -> String {
    let base = base();
    let mut s = Script::new(data);
    let mut image = base.logged.clone();
    let batch = &base.batches[s.below(base.batches.len())];
    let mut records = batch.records.clone();
    let (mut fsid, mut seq, mut lsn) = (batch.fsid, batch.seq, batch.lsn);
    for _ in 0..1 + s.below(4) {
        match s.u8() % 10 {
            0 if !records.is_empty() => {
                let i = s.below(records.len());
                records.remove(i);
            }
            1 if !records.is_empty() => {
                let i = s.below(records.len());
                let r = records[i].clone();
                records.insert(s.below(records.len() + 1), r);
            }
            2 if records.len() > 1 => {
                let (i, j) = (s.below(records.len()), s.below(records.len()));
                records.swap(i, j);
            }
            3 => seq = s.interesting(8),
            4 => lsn = s.interesting(8),
            5 => fsid[s.below(16)] ^= 1 + s.u8() % 255,
            6 => {
                let kind = KINDS[s.below(KINDS.len())];
                records.push(LogRecord {
                    generation: base.sb.generation + u64::from(s.u8() % 3),
                    key: Key::new(256 + u64::from(s.u16() % 512), kind, u64::from(s.u32())),
                    value: Some(item_payload(kind, &mut s)),
                });
            }
            _ if !records.is_empty() => {
                let i = s.below(records.len());
                mutate_record(&mut records[i], &mut s);
            }
            _ => {}
        }
    }
    let mut bytes = encode_batch(fsid, seq, lsn, &records);
    if s.u8() % 4 == 0 {
        let fields = batch_fields(&records);
        mutate_fields(&mut bytes, &fields, &mut s, 3);
        reseal_batch(&mut bytes);
    }
    // Written where the batch was; one that grew may run over the next batch (the log area
    // ends well past the image's few batches), never past the log area.
    let at = batch.offset as usize;
    let end = (base.sb.log_start + base.sb.log_bytes) as usize;
    let room = end.saturating_sub(at).min(bytes.len());
    if let Some(dst) = image.get_mut(at..at + room) {
        dst.copy_from_slice(&bytes[..room]);
    }
    if bytes.len() < batch.len && s.bool() {
        // The old batch's tail stays as it was, or is zeroed.
        if let Some(dst) = image.get_mut(at + bytes.len()..at + batch.len) {
            dst.fill(0);
        }
    }
    if s.u8() % 8 == 0 {
        mutate_supers(&mut image, &mut s);
    }
    let dev = MemDevice::from_bytes(image);
    let stop = match Engine::read_superblock(&dev) {
        Ok((sb, _)) => {
            let replay = read_log(&dev, &sb);
            let stop: String = replay
                .stop
                .chars()
                .filter(|c| !c.is_ascii_digit())
                .take(40)
                .collect();
            stop
        }
        Err(e) => format!("no superblock {}", e.errno()),
    };
    format!("{stop}; {}", open_walk_check(dev.snapshot()))
}

/// Target `image_open_walk`: the committed image, one node of its fs tree changed: an item's
/// payload replaced by a valid payload of any type, bytes of it changed, an item dropped or
/// its key moved, a child pointer's address or generation changed (re-encoded by the format's
/// encoder), or header and item-header fields damaged in the encoded node and its checksum
/// re-sealed; sometimes a superblock field too. Then open, walk, close and fsck.
pub fn image_open_walk(data: &[u8]) -> String {
    let base = base();
    let mut s = Script::new(data);
    let mut image = base.committed.clone();
    let (addr, generation, level) = base.nodes[s.below(base.nodes.len())];
    let at = addr as usize;
    let expect = Expect {
        fsid: base.sb.fsid,
        addr,
        generation,
        owner: FS_TREE_ID,
        level: Some(level),
    };
    let Some(Ok(mut node)) = image
        .get(at..at + NODE_SIZE)
        .map(|b| Node::decode(b, &expect))
    else {
        return "base node unreadable".into();
    };
    let raw = s.u8() % 3 == 0;
    if !raw {
        for _ in 0..1 + s.below(3) {
            match &mut node.body {
                NodeBody::Leaf(items) if !items.is_empty() => {
                    let i = s.below(items.len());
                    match s.u8() % 6 {
                        0 => {
                            items.remove(i);
                        }
                        1 => items[i].0.offset = s.interesting(8),
                        2 => items[i].0.objectid = s.interesting(8),
                        3 | 4 => {
                            let kind = items[i].0.kind().unwrap_or(KINDS[0]);
                            let kind = if s.u8() % 4 == 0 {
                                KINDS[s.below(KINDS.len())]
                            } else {
                                kind
                            };
                            items[i].1 = item_payload(kind, &mut s);
                        }
                        _ => {
                            let v = &mut items[i].1;
                            if !v.is_empty() {
                                for _ in 0..1 + s.below(4) {
                                    let j = s.below(v.len());
                                    v[j] = s.u8();
                                }
                            }
                        }
                    }
                }
                NodeBody::Internal(ptrs) if !ptrs.is_empty() => {
                    let i = s.below(ptrs.len());
                    match s.u8() % 4 {
                        0 => ptrs[i].addr = s.interesting(8),
                        1 => ptrs[i].generation = s.interesting(8),
                        2 => ptrs[i].key.objectid = s.interesting(8),
                        _ => {
                            let (a, b) = (s.below(ptrs.len()), s.below(ptrs.len()));
                            let addr = ptrs[a].addr;
                            ptrs[a].addr = ptrs[b].addr;
                            ptrs[b].addr = addr;
                        }
                    }
                }
                _ => {}
            }
        }
    }
    let mut bytes = match node.encode() {
        Ok(bytes) => bytes,
        // A change that breaks the node's own rules (keys out of order): damage the bytes.
        Err(_) => match image.get(at..at + NODE_SIZE) {
            Some(b) => b.to_vec(),
            None => return "base node past the image".into(),
        },
    };
    if raw || s.u8() % 4 == 0 {
        mutate_fields(&mut bytes, &node_fields(&node), &mut s, 4);
        reseal_node(&mut bytes);
    }
    if let Some(dst) = image.get_mut(at..at + NODE_SIZE) {
        dst.copy_from_slice(&bytes);
    }
    if s.u8() % 8 == 0 {
        mutate_supers(&mut image, &mut s);
    }
    open_walk_check(image)
}
