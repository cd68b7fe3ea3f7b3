//! B-tree nodes: a 64-byte header, then item headers (leaf) or child pointers (internal).
//!
//! Leaf payloads are packed from the end of the node towards the headers, in item order, as in
//! btrfs. The decoded form owns its items; encoding lays them out again, so a node's bytes are
//! a pure function of its contents.

use std::fmt;

use crate::bytes::{Reader, Writer};
use crate::key::{Key, KEY_BYTES};
use crate::{checksum, FormatError, MAX_ITEM_BYTES, NODE_SIZE};

/// "BNOD", at byte 4 of every node (after the checksum).
pub const NODE_MAGIC: [u8; 4] = *b"BNOD";
/// Node header size in bytes; item headers or pointers start at this offset.
pub const HEADER_BYTES: usize = 64;
/// Size of one leaf item header: key, data offset, data size.
pub const ITEM_HEADER_BYTES: usize = KEY_BYTES + 8;
/// Size of one internal pointer: key, child address, child generation.
pub const PTR_BYTES: usize = KEY_BYTES + 16;
/// Bytes available for item headers plus payloads in a leaf.
pub const LEAF_SPACE: usize = NODE_SIZE - HEADER_BYTES;
/// Children an internal node holds at most.
pub const MAX_PTRS: usize = LEAF_SPACE / PTR_BYTES;
pub use crate::MAX_LEVEL;

// Any split of a full leaf leaves two valid halves: two items of the largest size, with their
// headers, fit one node beside its header.
const _: () = assert!(MAX_ITEM_BYTES * 2 + 2 * ITEM_HEADER_BYTES + HEADER_BYTES <= NODE_SIZE);

/// Identity fields of a node header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeHeader {
    /// Filesystem id; must equal the superblock's.
    pub fsid: [u8; 16],
    /// Byte address the node is written at; a node read from elsewhere is misplaced.
    pub addr: u64,
    /// Generation the node was written in.
    pub generation: u64,
    /// Tree id that owns the node; in v1 always [`crate::FS_TREE_ID`].
    pub owner: u64,
    /// 0 for leaves, 1.. for internal nodes; < [`MAX_LEVEL`].
    pub level: u8,
}

/// A child pointer in an internal node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChildPtr {
    /// Lowest key in the child's subtree (a lower bound for it).
    pub key: Key,
    /// Byte address of the child node: non-zero, block aligned.
    pub addr: u64,
    /// Generation the child was written in: <= this node's; the child's header must agree.
    pub generation: u64,
}

/// A node's contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeBody {
    /// Level 0: items as `(key, payload)` in strictly ascending key order; headers plus
    /// payloads take at most [`LEAF_SPACE`] bytes.
    Leaf(Vec<(Key, Vec<u8>)>),
    /// Level 1..: 1 ..= [`MAX_PTRS`] child pointers in strictly ascending key order.
    Internal(Vec<ChildPtr>),
}

/// A decoded node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// Identity fields; the checksum and item count are derived at encode.
    pub header: NodeHeader,
    /// Items or child pointers; must match `header.level` (leaf iff level 0).
    pub body: NodeBody,
}

/// What the reader expects of a node, from the pointer that led to it.
#[derive(Debug, Clone, Copy)]
pub struct Expect {
    /// The superblock's fsid.
    pub fsid: [u8; 16],
    /// Byte address the node was read from; the header must name the same.
    pub addr: u64,
    /// Generation from the parent pointer (or the superblock's root pointer).
    pub generation: u64,
    /// Tree id the node must belong to.
    pub owner: u64,
    /// Level the node must have (parent's level - 1, or the root's); `None` accepts any.
    pub level: Option<u8>,
}

/// Bytes one leaf item uses (header plus payload).
pub fn leaf_item_bytes(value_len: usize) -> usize {
    ITEM_HEADER_BYTES + value_len
}

impl Node {
    /// Bytes used by the body (headers and payloads), excluding the node header.
    pub fn used_bytes(&self) -> usize {
        match &self.body {
            NodeBody::Leaf(items) => items.iter().map(|(_, v)| leaf_item_bytes(v.len())).sum(),
            NodeBody::Internal(ptrs) => ptrs.len() * PTR_BYTES,
        }
    }

    /// Number of items or pointers.
    pub fn len(&self) -> usize {
        match &self.body {
            NodeBody::Leaf(items) => items.len(),
            NodeBody::Internal(ptrs) => ptrs.len(),
        }
    }

    /// True when the node holds no items or pointers (only an empty leaf can be valid).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// First key, if any.
    pub fn first_key(&self) -> Option<Key> {
        match &self.body {
            NodeBody::Leaf(items) => items.first().map(|(k, _)| *k),
            NodeBody::Internal(ptrs) => ptrs.first().map(|p| p.key),
        }
    }

    /// Checks the node's own invariants: level matches the body, keys strictly ascend,
    /// sizes fit. Run before encoding for a write and after decoding a read.
    pub fn validate(&self) -> Result<(), FormatError> {
        let at = || {
            format!(
                "node {:#x} (owner {}, generation {})",
                self.header.addr, self.header.owner, self.header.generation
            )
        };
        if self.header.level >= MAX_LEVEL {
            return Err(FormatError::invalid(
                format!("{} level", at()),
                self.header.level,
                format!("< {MAX_LEVEL}"),
            ));
        }
        if self.used_bytes() > LEAF_SPACE {
            return Err(FormatError::invalid(
                format!("{} used bytes", at()),
                self.used_bytes(),
                format!("<= {LEAF_SPACE}"),
            ));
        }
        let keys: Vec<Key> = match &self.body {
            NodeBody::Leaf(items) => {
                if self.header.level != 0 {
                    return Err(FormatError::invalid(
                        format!("{} level", at()),
                        self.header.level,
                        "0 for a leaf",
                    ));
                }
                items.iter().map(|(k, _)| *k).collect()
            }
            NodeBody::Internal(ptrs) => {
                if self.header.level == 0 {
                    return Err(FormatError::invalid(
                        format!("{} level", at()),
                        0,
                        "> 0 for an internal node",
                    ));
                }
                if ptrs.is_empty() {
                    return Err(FormatError::invalid(
                        format!("{} pointers", at()),
                        0,
                        "at least one",
                    ));
                }
                for (slot, ptr) in ptrs.iter().enumerate() {
                    if ptr.addr == 0 || ptr.addr % crate::BLOCK_SIZE != 0 {
                        return Err(FormatError::invalid(
                            format!("{} slot {slot} child address", at()),
                            format!("{:#x}", ptr.addr),
                            "a non-zero block-aligned address",
                        ));
                    }
                    if ptr.generation > self.header.generation {
                        return Err(FormatError::invalid(
                            format!("{} slot {slot} child generation", at()),
                            ptr.generation,
                            format!("<= {}", self.header.generation),
                        ));
                    }
                }
                ptrs.iter().map(|p| p.key).collect()
            }
        };
        for (slot, pair) in keys.windows(2).enumerate() {
            if pair[0] >= pair[1] {
                return Err(FormatError::invalid(
                    format!("{} slot {}", at(), slot + 1),
                    format!("key {}", pair[1]),
                    format!("a key after {}", pair[0]),
                ));
            }
        }
        Ok(())
    }

    /// Encodes to exactly [`NODE_SIZE`] bytes with the checksum in place. Validates first:
    /// a node that breaks its invariants is never written.
    pub fn encode(&self) -> Result<Vec<u8>, FormatError> {
        self.validate()?;
        let mut w = Writer::with_capacity(NODE_SIZE);
        w.u32(0);
        w.put(&NODE_MAGIC);
        w.put(&self.header.fsid);
        w.u64(self.header.addr);
        w.u64(self.header.generation);
        w.u64(self.header.owner);
        w.u8(self.header.level);
        w.u8(0);
        let count = u16::try_from(self.len())
            .map_err(|_| FormatError::invalid("node item count", self.len(), "<= 65535"))?;
        w.u16(count);
        w.zeros(HEADER_BYTES - 52);
        let mut bytes = match &self.body {
            NodeBody::Leaf(items) => {
                let mut data_end = NODE_SIZE;
                let mut payload = Vec::with_capacity(items.len());
                for (key, value) in items {
                    let data_offset = data_end - value.len();
                    key.encode(&mut w);
                    // Casts: offsets and sizes are below NODE_SIZE (16 KiB), checked by validate.
                    w.u32(data_offset as u32);
                    w.u32(value.len() as u32);
                    payload.push((data_offset, value));
                    data_end = data_offset;
                }
                let mut bytes = w.into_bytes();
                bytes.resize(NODE_SIZE, 0);
                for (offset, value) in payload {
                    bytes[offset..offset + value.len()].copy_from_slice(value);
                }
                bytes
            }
            NodeBody::Internal(ptrs) => {
                for ptr in ptrs {
                    ptr.key.encode(&mut w);
                    w.u64(ptr.addr);
                    w.u64(ptr.generation);
                }
                let mut bytes = w.into_bytes();
                bytes.resize(NODE_SIZE, 0);
                bytes
            }
        };
        let sum = checksum(&bytes[4..]);
        bytes[..4].copy_from_slice(&sum.to_le_bytes());
        Ok(bytes)
    }

    /// Decodes node bytes and checks them against what the parent pointer promised.
    /// Errors: `Truncated` if `bytes` is not [`NODE_SIZE`] long, `BadMagic`, `BadChecksum`,
    /// then `Invalid` for a header field that differs from `expect`, a count that cannot fit,
    /// a payload range not packed as the format requires, or a broken [`Node::validate`] rule.
    pub fn decode(bytes: &[u8], expect: &Expect) -> Result<Node, FormatError> {
        let at = format!("node {:#x} (owner {})", expect.addr, expect.owner);
        if bytes.len() != NODE_SIZE {
            return Err(FormatError::Truncated {
                what: at,
                need: NODE_SIZE,
                have: bytes.len(),
            });
        }
        let mut r = Reader::new(bytes, "node header");
        let stored = r.u32()?;
        let magic: [u8; 4] = r.array()?;
        if magic != NODE_MAGIC {
            return Err(FormatError::BadMagic {
                what: at,
                found: magic.to_vec(),
            });
        }
        let computed = checksum(&bytes[4..]);
        if stored != computed {
            return Err(FormatError::BadChecksum {
                what: at,
                stored,
                computed,
            });
        }
        let header = NodeHeader {
            fsid: r.array()?,
            addr: r.u64()?,
            generation: r.u64()?,
            owner: r.u64()?,
            level: r.u8()?,
        };
        r.skip(1)?;
        let count = usize::from(r.u16()?);
        r.skip(HEADER_BYTES - 52)?;
        if header.fsid != expect.fsid {
            return Err(FormatError::invalid(
                format!("{at} fsid"),
                crate::hex(&header.fsid),
                crate::hex(&expect.fsid),
            ));
        }
        if header.addr != expect.addr {
            return Err(FormatError::invalid(
                format!("{at} address"),
                format!("{:#x}", header.addr),
                format!("{:#x}", expect.addr),
            ));
        }
        if header.generation != expect.generation {
            return Err(FormatError::invalid(
                format!("{at} generation"),
                header.generation,
                expect.generation,
            ));
        }
        if header.owner != expect.owner {
            return Err(FormatError::invalid(
                format!("{at} owner"),
                header.owner,
                expect.owner,
            ));
        }
        if let Some(level) = expect.level {
            if header.level != level {
                return Err(FormatError::invalid(
                    format!("{at} level"),
                    header.level,
                    level,
                ));
            }
        }
        let body = if header.level == 0 {
            if count * ITEM_HEADER_BYTES > LEAF_SPACE {
                return Err(FormatError::invalid(
                    format!("{at} item count"),
                    count,
                    "items that fit the node",
                ));
            }
            let mut items = Vec::with_capacity(count);
            let mut data_end = NODE_SIZE;
            let headers_end = HEADER_BYTES + count * ITEM_HEADER_BYTES;
            for slot in 0..count {
                let key = Key::decode(&mut r)?;
                let offset = r.u32()? as usize;
                let size = r.u32()? as usize;
                if offset.checked_add(size) != Some(data_end) || offset < headers_end {
                    return Err(FormatError::invalid(
                        format!("{at} slot {slot} data range"),
                        format!("{offset}+{size}"),
                        format!("a range ending at {data_end}, after the headers"),
                    ));
                }
                items.push((key, bytes[offset..data_end].to_vec()));
                data_end = offset;
            }
            NodeBody::Leaf(items)
        } else {
            if count * PTR_BYTES > LEAF_SPACE {
                return Err(FormatError::invalid(
                    format!("{at} pointer count"),
                    count,
                    format!("<= {MAX_PTRS}"),
                ));
            }
            let mut ptrs = Vec::with_capacity(count);
            for _ in 0..count {
                ptrs.push(ChildPtr {
                    key: Key::decode(&mut r)?,
                    addr: r.u64()?,
                    generation: r.u64()?,
                });
            }
            NodeBody::Internal(ptrs)
        };
        let node = Node { header, body };
        node.validate()?;
        Ok(node)
    }
}

impl fmt::Display for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let h = &self.header;
        writeln!(
            f,
            "node {:#x} owner {} generation {} level {} items {} used {}/{}",
            h.addr,
            h.owner,
            h.generation,
            h.level,
            self.len(),
            self.used_bytes(),
            LEAF_SPACE
        )?;
        match &self.body {
            NodeBody::Leaf(items) => {
                for (slot, (key, value)) in items.iter().enumerate() {
                    writeln!(f, "  slot {slot} key {key} size {}", value.len())?;
                    if let Some(item) = key
                        .kind()
                        .and_then(|kind| crate::items::Item::decode(kind, value).ok())
                    {
                        writeln!(f, "    {item}")?;
                    }
                }
            }
            NodeBody::Internal(ptrs) => {
                for (slot, ptr) in ptrs.iter().enumerate() {
                    writeln!(
                        f,
                        "  slot {slot} key {} -> {:#x} generation {}",
                        ptr.key, ptr.addr, ptr.generation
                    )?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn expect_for(node: &Node) -> Expect {
        Expect {
            fsid: node.header.fsid,
            addr: node.header.addr,
            generation: node.header.generation,
            owner: node.header.owner,
            level: Some(node.header.level),
        }
    }

    fn leaf(items: Vec<(Key, Vec<u8>)>) -> Node {
        Node {
            header: NodeHeader {
                fsid: [1; 16],
                addr: 0x40000,
                generation: 3,
                owner: 5,
                level: 0,
            },
            body: NodeBody::Leaf(items),
        }
    }

    proptest! {
        #[test]
        fn leaf_round_trip(mut keys in proptest::collection::btree_map(any::<(u64, u8, u64)>(), proptest::collection::vec(any::<u8>(), 0..300), 0..40)) {
            let items: Vec<(Key, Vec<u8>)> = std::mem::take(&mut keys).into_iter().map(|((o, t, f), v)| (Key { objectid: o, item_type: t, offset: f }, v)).collect();
            let node = leaf(items);
            let bytes = node.encode().map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(Node::decode(&bytes, &expect_for(&node)), Ok(node));
        }
    }

    #[test]
    fn flipped_bytes_are_caught() {
        let node = leaf(vec![(
            Key {
                objectid: 1,
                item_type: 1,
                offset: 0,
            },
            vec![9; 100],
        )]);
        let bytes = node.encode().expect("valid node");
        for i in (0..NODE_SIZE).step_by(97) {
            let mut bad = bytes.clone();
            bad[i] ^= 1;
            assert!(
                Node::decode(&bad, &expect_for(&node)).is_err(),
                "flip at {i}"
            );
        }
    }

    #[test]
    fn misplaced_node_is_caught() {
        let node = leaf(vec![]);
        let bytes = node.encode().expect("valid node");
        let mut expect = expect_for(&node);
        expect.addr += 4096;
        assert!(matches!(
            Node::decode(&bytes, &expect),
            Err(FormatError::Invalid { .. })
        ));
        let mut expect = expect_for(&node);
        expect.generation += 1;
        assert!(Node::decode(&bytes, &expect).is_err());
    }

    #[test]
    fn unordered_keys_are_refused_before_write() {
        let k = |o| Key {
            objectid: o,
            item_type: 1,
            offset: 0,
        };
        let node = leaf(vec![(k(2), vec![]), (k(1), vec![])]);
        assert!(node.encode().is_err());
    }
}
