//! Targets for the on-disk format's decoders. Each builds a valid structure from the script,
//! encodes it with the format's own encoder, damages named fields (and sometimes any byte),
//! re-seals the checksum so the decoder behind it runs, and decodes. A decode that succeeds
//! must survive a round trip through the encoder: what the decoder accepts, the encoder must
//! write back the same.

use birch_format::codec::Codec;
use birch_format::items::{
    decode_dir_entries, decode_inode_refs, decode_xattrs, encode_dir_entries, encode_inode_refs,
    encode_xattrs, Blob, DirEntry, ExtentKind, FileExtent, InodeItem, InodeRef, Item, SnapshotItem,
    Timespec, Xattr, XattrChunk, XattrSpill,
};
use birch_format::log::{decode_batch, decode_header, encode_batch, LogRecord, LOG_DATA_TYPE};
use birch_format::node::{ChildPtr, Expect, Node, NodeBody, NodeHeader, HEADER_BYTES};
use birch_format::superblock::{RootPtr, Superblock, SUPER_BYTES};
use birch_format::{checksum, FormatError, ItemType, Key, BLOCK_SIZE, FS_TREE_ID, MAX_LEVEL};

use crate::script::{mutate_fields, Field, Script};

/// Every item type, in code order.
pub const KINDS: [ItemType; 9] = [
    ItemType::InodeItem,
    ItemType::InodeRef,
    ItemType::Xattr,
    ItemType::XattrChunk,
    ItemType::Orphan,
    ItemType::DirItem,
    ItemType::DirIndex,
    ItemType::ExtentData,
    ItemType::Snapshot,
];

/// The fsid of every structure the format targets build.
pub const FSID: [u8; 16] = *b"birch-fuzz-fsid!";

/// A class of a decode result: the error's kind and what it names, without the words that
/// carry numbers (addresses, lengths), so the runner can tell outcomes apart without every
/// address making a new one.
pub fn class(e: &FormatError) -> String {
    let plain = |what: &str| -> String {
        what.split_whitespace()
            .filter(|w| !w.chars().any(|c| c.is_ascii_digit()))
            .collect::<Vec<_>>()
            .join(" ")
    };
    match e {
        FormatError::BadMagic { what, .. } => format!("bad magic: {}", plain(what)),
        FormatError::BadChecksum { what, .. } => format!("bad checksum: {}", plain(what)),
        FormatError::BadVersion { .. } => "bad version".into(),
        FormatError::UnknownIncompat { .. } => "unknown incompat".into(),
        FormatError::Invalid { what, .. } => format!("invalid: {}", plain(what)),
        FormatError::Truncated { what, .. } => format!("truncated: {}", plain(what)),
    }
}

fn timespec(s: &mut Script<'_>) -> Timespec {
    Timespec {
        sec: s.u32() as i64,
        nsec: s.u32() % 1_000_000_000,
    }
}

fn name(s: &mut Script<'_>) -> Vec<u8> {
    let len = 1 + s.below(12);
    (0..len).map(|_| b'a' + s.u8() % 26).collect()
}

/// A valid payload of `kind`, its values from the script.
pub fn item_payload(kind: ItemType, s: &mut Script<'_>) -> Vec<u8> {
    match kind {
        ItemType::InodeItem => InodeItem {
            generation: u64::from(s.u16()),
            transid: u64::from(s.u16()),
            size: u64::from(s.u32()),
            nbytes: u64::from(s.u16()) * BLOCK_SIZE,
            nlink: 1 + u32::from(s.u8() % 4),
            uid: u32::from(s.u8()),
            gid: u32::from(s.u8()),
            mode: [0o100644, 0o40755, 0o120777, 0o10644][s.below(4)],
            rdev: 0,
            flags: 0,
            next_dir_index: u64::from(s.u8()) + 2,
            atime: timespec(s),
            mtime: timespec(s),
            ctime: timespec(s),
            otime: timespec(s),
        }
        .encode(),
        ItemType::InodeRef => {
            let refs: Vec<InodeRef> = (0..1 + s.below(3))
                .map(|_| InodeRef {
                    parent: 1 + u64::from(s.u16()),
                    dir_index: 2 + u64::from(s.u16()),
                    name: name(s),
                })
                .collect();
            encode_inode_refs(&refs)
        }
        ItemType::DirItem | ItemType::DirIndex => {
            let n = if kind == ItemType::DirIndex {
                1
            } else {
                1 + s.below(3)
            };
            let entries: Vec<DirEntry> = (0..n)
                .map(|_| DirEntry {
                    child: 256 + u64::from(s.u16()),
                    dir_index: 2 + u64::from(s.u16()),
                    file_type: [1, 2, 7][s.below(3)],
                    name: name(s),
                })
                .collect();
            encode_dir_entries(&entries)
        }
        ItemType::Xattr => {
            let xattrs: Vec<Xattr> = (0..1 + s.below(3))
                .map(|_| {
                    let spill = s.u8() % 4 == 0;
                    Xattr {
                        name: [b"user.".as_slice(), &name(s)].concat(),
                        value: if spill {
                            Vec::new()
                        } else {
                            let len = s.below(48);
                            s.bytes(len)
                        },
                        spill: spill.then(|| XattrSpill {
                            size: 7169 + s.u16() as u32,
                            crc: s.u32(),
                        }),
                    }
                })
                .collect();
            encode_xattrs(&xattrs)
        }
        ItemType::XattrChunk => {
            let len = 1 + s.below(64);
            XattrChunk {
                name: [b"user.".as_slice(), &name(s)].concat(),
                index: s.below(16) as u32,
                data: s.bytes(len),
            }
            .encode()
        }
        ItemType::Orphan => Vec::new(),
        ItemType::ExtentData => {
            let generation = 1 + u64::from(s.u16());
            let (kind, shared) = match s.below(5) {
                4 => {
                    // A blob window (kind 4), inside the format's ranges (decode's checks
                    // are the item fuzzer's to break).
                    let logical_blocks = 2 + s.below(31) as u64;
                    let codec = Codec::from_byte(s.u8() % 3).unwrap_or(Codec::Lz4);
                    let (stored, encoded_len) = if codec == Codec::None {
                        (logical_blocks, logical_blocks * BLOCK_SIZE)
                    } else {
                        let stored = 1 + s.below(logical_blocks as usize - 1) as u64;
                        let tail = 1 + s.below(BLOCK_SIZE as usize) as u64;
                        (stored, (stored - 1) * BLOCK_SIZE + tail)
                    };
                    let window_offset = s.below(logical_blocks as usize) as u64;
                    let window_len = 1 + s.below((logical_blocks - window_offset) as usize) as u64;
                    (
                        ExtentKind::Blob(Blob {
                            disk_addr: (256 + u64::from(s.u16())) * BLOCK_SIZE,
                            codec,
                            encoded_len: encoded_len as u32,
                            logical: (logical_blocks * BLOCK_SIZE) as u32,
                            window_offset: (window_offset * BLOCK_SIZE) as u32,
                            window_len: (window_len * BLOCK_SIZE) as u32,
                            nonce: 0,
                            csums: (0..stored).map(|_| s.u32()).collect(),
                        }),
                        s.bool(),
                    )
                }
                0 => {
                    let len = 1 + s.below(64);
                    (ExtentKind::Inline(s.bytes(len)), false)
                }
                1 | 2 => {
                    let blocks = 1 + s.below(8);
                    (
                        ExtentKind::Regular {
                            disk_addr: (256 + u64::from(s.u16())) * BLOCK_SIZE,
                            csums: (0..blocks).map(|_| s.u32()).collect(),
                        },
                        s.bool(),
                    )
                }
                _ => (
                    ExtentKind::Prealloc {
                        disk_addr: (256 + u64::from(s.u16())) * BLOCK_SIZE,
                        blocks: 1 + u64::from(s.u8()),
                    },
                    false,
                ),
            };
            FileExtent {
                generation,
                kind,
                shared,
            }
            .encode()
        }
        ItemType::Snapshot => SnapshotItem {
            generation: 1 + u64::from(s.u16()),
            root: RootPtr {
                addr: (64 + u64::from(s.u16())) * BLOCK_SIZE * 4,
                generation: 1 + u64::from(s.u16()),
                level: s.u8() % MAX_LEVEL,
            },
            created: timespec(s),
            name: name(s),
        }
        .encode(),
    }
}

/// Re-encodes a decoded item with the encoder of its type.
fn encode_item(item: &Item) -> Vec<u8> {
    match item {
        Item::Inode(i) => i.encode(),
        Item::InodeRefs(v) => encode_inode_refs(v),
        Item::DirItem(v) => encode_dir_entries(v),
        Item::DirIndex(e) => encode_dir_entries(std::slice::from_ref(e)),
        Item::Xattrs(v) => encode_xattrs(v),
        Item::XattrChunk(c) => c.encode(),
        Item::Extent(e) => e.encode(),
        Item::Orphan => Vec::new(),
        Item::Snapshot(s) => s.encode(),
    }
}

/// Decodes `bytes` as `kind` and, when that succeeds, checks the round trip.
fn decode_item_checked(kind: ItemType, bytes: &[u8]) -> String {
    match Item::decode(kind, bytes) {
        Ok(item) => {
            let again = Item::decode(kind, &encode_item(&item));
            assert_eq!(
                again.as_ref().ok(),
                Some(&item),
                "{kind:?}: a decoded item does not survive encode and decode: {again:?}"
            );
            format!("ok {kind:?}")
        }
        Err(e) => format!("{kind:?} {}", class(&e)),
    }
}

/// Target `item_decode`: every item type's payload, built valid, then damaged (fields set to
/// interesting values, bytes replaced, cut or extended) and decoded; the lower-level decoders
/// (`decode_inode_refs`, `decode_dir_entries`, `decode_xattrs`, `FileExtent::decode`,
/// `InodeItem::decode`, `XattrChunk::decode`, `SnapshotItem::decode`) also see every payload.
pub fn item_decode(data: &[u8]) -> String {
    let mut s = Script::new(data);
    let kind = KINDS[s.below(KINDS.len())];
    let mut bytes = item_payload(kind, &mut s);
    // Every 4-byte-aligned field may be a length, a count or an id.
    let fields: Vec<Field> = (0..bytes.len())
        .step_by(2)
        .flat_map(|at| {
            [1, 2, 4, 8]
                .into_iter()
                .map(move |width| Field { at, width })
        })
        .collect();
    mutate_fields(&mut bytes, &fields, &mut s, 4);
    match s.u8() % 8 {
        0 => {
            let cut = s.below(bytes.len() + 1);
            bytes.truncate(cut);
        }
        1 => {
            let more = s.below(16);
            let tail = s.bytes(more);
            bytes.extend_from_slice(&tail);
        }
        _ => {}
    }
    let other = KINDS[s.below(KINDS.len())];
    let _ = decode_inode_refs(&bytes);
    let _ = decode_dir_entries(&bytes);
    let _ = decode_xattrs(&bytes);
    let _ = FileExtent::decode(&bytes);
    let _ = InodeItem::decode(&bytes);
    let _ = XattrChunk::decode(&bytes);
    let _ = SnapshotItem::decode(&bytes);
    let _ = decode_item_checked(other, &bytes);
    decode_item_checked(kind, &bytes)
}

/// The header fields of a node, by offset.
const NODE_HEADER_FIELDS: [Field; 7] = [
    Field { at: 8, width: 8 },
    Field { at: 24, width: 8 },
    Field { at: 32, width: 8 },
    Field { at: 40, width: 8 },
    Field { at: 48, width: 1 },
    Field { at: 49, width: 1 },
    Field { at: 50, width: 2 },
];

/// The fields a node's layout names: header, then per item or pointer its key and either
/// (leaf) payload offset and length or (internal) child address and generation.
pub fn node_fields(node: &Node) -> Vec<Field> {
    let mut out = NODE_HEADER_FIELDS.to_vec();
    let (count, stride) = match &node.body {
        NodeBody::Leaf(items) => (items.len(), 25),
        NodeBody::Internal(ptrs) => (ptrs.len(), 33),
    };
    for i in 0..count {
        let at = HEADER_BYTES + i * stride;
        out.push(Field { at, width: 8 });
        out.push(Field {
            at: at + 8,
            width: 1,
        });
        out.push(Field {
            at: at + 9,
            width: 8,
        });
        if stride == 25 {
            out.push(Field {
                at: at + 17,
                width: 4,
            });
            out.push(Field {
                at: at + 21,
                width: 4,
            });
        } else {
            out.push(Field {
                at: at + 17,
                width: 8,
            });
            out.push(Field {
                at: at + 25,
                width: 8,
            });
        }
    }
    out
}

/// Re-seals a node's checksum (the first 4 bytes cover the rest).
pub fn reseal_node(bytes: &mut [u8]) {
    if bytes.len() >= 4 {
        let sum = checksum(&bytes[4..]);
        bytes[..4].copy_from_slice(&sum.to_le_bytes());
    }
}

fn build_node(s: &mut Script<'_>) -> Node {
    let level = if s.u8() % 3 == 0 {
        1 + s.below(usize::from(MAX_LEVEL) - 1) as u8
    } else {
        0
    };
    let generation = 2 + u64::from(s.u16());
    let header = NodeHeader {
        fsid: FSID,
        addr: (64 + s.below(4096) as u64) * 16384,
        generation,
        owner: FS_TREE_ID,
        level,
    };
    let mut objectid = 256 + s.below(64) as u64;
    let body = if level == 0 {
        let mut items = Vec::new();
        let mut used = 0;
        for _ in 0..s.below(40) {
            objectid += s.below(2) as u64;
            let kind = KINDS[s.below(KINDS.len())];
            let value = item_payload(kind, s);
            used += value.len() + 25;
            if used > 16000 {
                break;
            }
            let key = Key::new(objectid, kind, u64::from(s.u32()));
            items.push((key, value));
        }
        items.sort_by_key(|(k, _)| *k);
        items.dedup_by_key(|(k, _)| *k);
        NodeBody::Leaf(items)
    } else {
        let mut ptrs = Vec::new();
        for _ in 0..1 + s.below(48) {
            objectid += 1 + s.below(50) as u64;
            ptrs.push(ChildPtr {
                key: Key::new(objectid, ItemType::InodeItem, 0),
                addr: (64 + s.below(4096) as u64) * 16384,
                generation: 1 + u64::from(s.u16()) % generation,
            });
        }
        NodeBody::Internal(ptrs)
    };
    Node { header, body }
}

/// Target `node_decode`: a valid leaf (items of every type) or internal node, its header,
/// item headers or child pointers damaged and its checksum re-sealed (most of the time),
/// decoded against an `Expect` that usually matches. A node that decodes must encode again
/// to a node that decodes equal, and its items are decoded by type.
pub fn node_decode(data: &[u8]) -> String {
    let mut s = Script::new(data);
    let node = build_node(&mut s);
    let Ok(mut bytes) = node.encode() else {
        return "base node refused by encode".into();
    };
    let fields = node_fields(&node);
    mutate_fields(&mut bytes, &fields, &mut s, 6);
    if s.u8() % 16 != 0 {
        reseal_node(&mut bytes);
    }
    if s.u8() % 32 == 0 {
        let cut = s.below(bytes.len());
        bytes.truncate(cut);
    }
    let mut expect = Expect {
        fsid: node.header.fsid,
        addr: node.header.addr,
        generation: node.header.generation,
        owner: node.header.owner,
        level: Some(node.header.level),
    };
    match s.u8() % 16 {
        0 => expect.level = None,
        1 => expect.generation = s.interesting(8),
        2 => expect.addr = s.interesting(8),
        3 => expect.owner = s.interesting(8),
        _ => {}
    }
    match Node::decode(&bytes, &expect) {
        Ok(decoded) => {
            if let Err(e) = decoded.validate() {
                panic!("a decoded node breaks its own invariants: {e}");
            }
            let again = decoded
                .encode()
                .and_then(|b| Node::decode(&b, &expect))
                .map_err(|e| e.to_string());
            assert_eq!(
                again.as_ref().ok(),
                Some(&decoded),
                "a decoded node does not survive encode and decode: {again:?}"
            );
            if let NodeBody::Leaf(items) = &decoded.body {
                for (key, value) in items {
                    if let Some(kind) = key.kind() {
                        let _ = Item::decode(kind, value);
                    }
                }
            }
            "ok".into()
        }
        Err(e) => class(&e),
    }
}

/// The fields of a superblock, by offset (superblock.rs, `Superblock::encode`).
pub const SUPER_FIELDS: [Field; 39] = [
    Field { at: 4, width: 4 },
    Field { at: 16, width: 4 },
    Field { at: 20, width: 4 },
    Field { at: 24, width: 4 },
    Field { at: 28, width: 4 },
    Field { at: 32, width: 8 },
    Field { at: 48, width: 8 },
    Field { at: 104, width: 8 },
    Field { at: 112, width: 8 },
    Field { at: 120, width: 8 },
    Field { at: 128, width: 8 },
    Field { at: 136, width: 8 },
    Field { at: 144, width: 8 },
    Field { at: 152, width: 8 },
    Field { at: 160, width: 8 },
    Field { at: 168, width: 8 },
    Field { at: 176, width: 1 },
    Field { at: 177, width: 1 },
    Field { at: 184, width: 8 },
    Field { at: 192, width: 8 },
    Field { at: 200, width: 8 },
    Field { at: 208, width: 8 },
    Field { at: 216, width: 8 },
    Field { at: 224, width: 8 },
    Field { at: 232, width: 4 },
    Field { at: 236, width: 4 },
    Field { at: 240, width: 8 },
    Field { at: 248, width: 8 },
    Field { at: 256, width: 8 },
    Field { at: 264, width: 1 },
    Field { at: 272, width: 8 },
    Field { at: 280, width: 8 },
    Field { at: 288, width: 8 },
    Field { at: 296, width: 1 },
    Field { at: 304, width: 8 },
    Field { at: 336, width: 8 },
    Field { at: 344, width: 8 },
    Field { at: 352, width: 1 },
    Field { at: 360, width: 8 },
];

/// Re-seals a superblock slot's checksum.
pub fn reseal_super(bytes: &mut [u8]) {
    if bytes.len() >= SUPER_BYTES {
        let sum = checksum(&bytes[4..SUPER_BYTES]);
        bytes[..4].copy_from_slice(&sum.to_le_bytes());
    }
}

/// Target `superblock_decode`: a valid superblock (that of the fuzz image, so every feature
/// flag in use is set), its fields damaged and the checksum re-sealed, decoded and validated;
/// what decodes must survive encode and decode.
pub fn superblock_decode(data: &[u8]) -> String {
    let mut s = Script::new(data);
    let mut bytes = crate::image::base().super_bytes.clone();
    mutate_fields(&mut bytes, &SUPER_FIELDS, &mut s, 6);
    if s.u8() % 16 != 0 {
        reseal_super(&mut bytes);
    }
    if s.u8() % 32 == 0 {
        let cut = s.below(bytes.len());
        bytes.truncate(cut);
    }
    match Superblock::decode(&bytes, "fuzz slot") {
        Ok(sb) => {
            let again = Superblock::decode(&sb.encode(), "fuzz slot");
            assert_eq!(
                again.as_ref().ok(),
                Some(&sb),
                "a decoded superblock does not survive encode and decode: {again:?}"
            );
            "ok".into()
        }
        Err(e) => class(&e),
    }
}

/// Log records built from the script: item sets and deletions of every type, and data records.
pub fn log_records(s: &mut Script<'_>) -> Vec<LogRecord> {
    (0..s.below(8))
        .map(|_| {
            let generation = 1 + u64::from(s.u8());
            let objectid = 256 + u64::from(s.u8());
            match s.below(4) {
                0 => LogRecord::data(
                    generation,
                    objectid,
                    (1024 + u64::from(s.u16())) * BLOCK_SIZE,
                    vec![s.u8(); BLOCK_SIZE as usize],
                ),
                1 => LogRecord {
                    generation,
                    key: Key::new(objectid, KINDS[s.below(KINDS.len())], u64::from(s.u32())),
                    value: None,
                },
                _ => {
                    let kind = KINDS[s.below(KINDS.len())];
                    LogRecord {
                        generation,
                        key: Key::new(objectid, kind, u64::from(s.u32())),
                        value: Some(item_payload(kind, s)),
                    }
                }
            }
        })
        .collect()
}

/// The fields of an encoded batch: header, then per record its generation, key, kind byte and
/// value length.
pub fn batch_fields(records: &[LogRecord]) -> Vec<Field> {
    let mut out = vec![
        Field { at: 8, width: 8 },
        Field { at: 24, width: 8 },
        Field { at: 32, width: 8 },
        Field { at: 40, width: 4 },
        Field { at: 44, width: 4 },
        Field { at: 48, width: 4 },
        Field { at: 52, width: 4 },
    ];
    let mut at = 64;
    for r in records {
        out.push(Field { at, width: 8 });
        out.push(Field {
            at: at + 8,
            width: 8,
        });
        out.push(Field {
            at: at + 16,
            width: 1,
        });
        out.push(Field {
            at: at + 17,
            width: 8,
        });
        out.push(Field {
            at: at + 25,
            width: 1,
        });
        at += 26;
        if let Some(v) = &r.value {
            out.push(Field { at, width: 4 });
            at += 4 + v.len();
        }
    }
    out
}

/// Re-seals a batch's checksum (bytes 4..8 cover everything from byte 8).
pub fn reseal_batch(bytes: &mut [u8]) {
    if bytes.len() >= 8 {
        let sum = checksum(&bytes[8..]);
        bytes[4..8].copy_from_slice(&sum.to_le_bytes());
    }
}

/// Target `log_batch_decode`: a valid batch of item and data records, its header and record
/// fields damaged, sometimes cut or extended, the checksum re-sealed (most of the time), then
/// `decode_header` and `decode_batch`. What decodes must survive encode and decode.
pub fn log_batch_decode(data: &[u8]) -> String {
    let mut s = Script::new(data);
    let records = log_records(&mut s);
    let mut bytes = encode_batch(
        FSID,
        1 + u64::from(s.u16()),
        u64::from(s.u16()) * 4096,
        &records,
    );
    let fields = batch_fields(&records);
    mutate_fields(&mut bytes, &fields, &mut s, 6);
    match s.u8() % 16 {
        0 => {
            let cut = s.below(bytes.len() + 1);
            bytes.truncate(cut);
        }
        1 => bytes.resize(bytes.len() + BLOCK_SIZE as usize, 0),
        _ => {}
    }
    if s.u8() % 16 != 0 {
        reseal_batch(&mut bytes);
    }
    let _ = decode_header(&bytes);
    match decode_batch(&bytes) {
        Ok((header, recs)) => {
            let again = encode_batch(header.fsid, header.seq, header.lsn, &recs);
            let back = decode_batch(&again).map(|(_, r)| r);
            assert_eq!(
                back.as_ref().ok(),
                Some(&recs),
                "a decoded batch does not survive encode and decode: {back:?}"
            );
            let data = recs
                .iter()
                .filter(|r| r.key.item_type == LOG_DATA_TYPE)
                .count();
            format!("ok, {} records, data {}", recs.len().min(4), data.min(2))
        }
        Err(e) => class(&e),
    }
}

/// A blob's stored bytes (DESIGN §16, `birch_format::codec`): a chunk of 2 to 32 blocks (each
/// a header, random bytes and text, never a constant fill) encoded by a codec the script picks,
/// then sometimes damaged (bytes changed, cut, extended), decoded as another codec, or decoded
/// into another declared length. Anything may come back but a panic; a decode that succeeds
/// gives exactly the declared length, and the chunk itself when nothing was changed.
pub fn blob_decode(data: &[u8]) -> String {
    use birch_format::codec::{decode, encode, Codec};
    let mut s = Script::new(data);
    let blocks = 2 + s.below(31);
    let bs = BLOCK_SIZE as usize;
    let mut chunk = Vec::with_capacity(blocks * bs);
    let text_share = s.below(bs + 1);
    for b in 0..blocks {
        let start = chunk.len();
        chunk.extend_from_slice(&(b as u64).to_le_bytes());
        while chunk.len() < start + bs - text_share {
            chunk.push(s.u8());
        }
        while chunk.len() < start + bs {
            chunk.push(b"a blob of text "[chunk.len() % 15]);
        }
    }
    let wanted = match s.u8() % 3 {
        0 => Codec::None,
        1 => Codec::Zstd(1 + i32::from(s.u8() % 9)),
        _ => Codec::Lz4,
    };
    let mut stored = Vec::new();
    let codec = match wanted {
        Codec::None => None,
        other => encode(other, &chunk, &mut stored).map(|_| other),
    }
    .unwrap_or_else(|| {
        stored = chunk.clone();
        Codec::None
    });
    let mut changed = false;
    for _ in 0..s.below(4) {
        changed = true;
        match s.u8() % 4 {
            0 if !stored.is_empty() => {
                let at = s.below(stored.len());
                stored[at] ^= s.u8() | 1;
            }
            1 => {
                let cut = s.below(stored.len() + 1);
                stored.truncate(cut);
            }
            2 => {
                let n = 1 + s.below(64);
                let more = s.bytes(n);
                stored.extend_from_slice(&more);
            }
            _ => {
                let at = s.below(stored.len() + 1);
                let byte = s.u8();
                stored.insert(at.min(stored.len()), byte);
            }
        }
    }
    let read_as = if s.u8() % 8 == 0 {
        changed = true;
        Codec::from_byte(s.u8() % 3).unwrap_or(Codec::None)
    } else {
        codec
    };
    let declared = if s.u8() % 8 == 0 {
        changed = true;
        (1 + s.below(33)) * bs
    } else {
        chunk.len()
    };
    let mut out = vec![0u8; declared];
    match decode(read_as, &stored, &mut out) {
        Ok(()) => {
            if !changed {
                assert!(out == chunk, "an unchanged blob decodes to other bytes");
            }
            format!("ok {read_as:?}").replace(|c: char| c.is_ascii_digit(), "")
        }
        Err(e) => e
            .to_string()
            .split_whitespace()
            .filter(|w| !w.chars().any(|c| c.is_ascii_digit()))
            .take(8)
            .collect::<Vec<_>>()
            .join(" "),
    }
}
