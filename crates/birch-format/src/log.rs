//! The fsync log: batches of item records in the log area reserved at mkfs.
//!
//! A batch is one write of whole blocks: a 64-byte header, then records, zero padded. Its
//! crc32c covers every byte after the checksum field, so a torn or partly written batch never
//! verifies. The log is circular: a batch lives at `log_start + lsn % log_bytes`, where `lsn`
//! (log sequence number, in bytes) only grows; a batch never straddles the end of the area
//! (the writer skips to the next lap instead). The superblock names the first live batch
//! (`log_head` = its lsn, `log_generation` = its sequence number); replay reads forward while
//! each batch verifies and carries the next sequence number.

use crate::bytes::{Reader, Writer};
use crate::key::Key;
use crate::{checksum, FormatError, BLOCK_SIZE};

/// "BLOG", at byte 0 of every batch (the checksum follows it, at byte 4).
pub const LOG_MAGIC: [u8; 4] = *b"BLOG";
/// Batch header size in bytes; records start at this offset.
pub const LOG_HEADER_BYTES: usize = 64;

/// The key type of a data record (never an item type in a tree): `(ino, LOG_DATA_TYPE,
/// disk byte address)`, its value the bytes of whole blocks written at that address (kind 2
/// on disk). Replay writes them there before it applies the batch's items.
pub const LOG_DATA_TYPE: u8 = 0xF0;
/// The largest data record, in bytes.
pub const LOG_DATA_MAX: usize = 1 << 20;

/// One record: an item change of the running transaction `generation`, or (a key of type
/// [`LOG_DATA_TYPE`]) the bytes of data blocks that change placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRecord {
    /// Delta generation the change belongs to; replay skips records the superblock's
    /// generation already covers.
    pub generation: u64,
    /// Key of the item the record sets or deletes (17 bytes at record offset 8).
    pub key: Key,
    /// New value, or `None` for a deletion; for a data record, the blocks' bytes.
    pub value: Option<Vec<u8>>,
}

impl LogRecord {
    /// A data record: `bytes` (whole blocks) written at disk byte `addr` for inode `ino`.
    pub fn data(generation: u64, ino: u64, addr: u64, bytes: Vec<u8>) -> LogRecord {
        LogRecord {
            generation,
            key: Key {
                objectid: ino,
                item_type: LOG_DATA_TYPE,
                offset: addr,
            },
            value: Some(bytes),
        }
    }

    /// Whether this is a data record; its key's offset is then the disk byte address.
    pub fn is_data(&self) -> bool {
        self.key.item_type == LOG_DATA_TYPE
    }
}

/// The smallest record: generation, key and kind byte (a deletion).
const MIN_RECORD_BYTES: usize = 8 + crate::key::KEY_BYTES + 1;

/// A decoded batch header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchHeader {
    /// Filesystem id; replay refuses a batch whose fsid is not the superblock's.
    pub fsid: [u8; 16],
    /// Sequence number: consecutive batches carry consecutive numbers.
    pub seq: u64,
    /// Byte position in the endless log this batch was written at.
    pub lsn: u64,
    /// Total length, a multiple of the block size.
    pub len_bytes: u32,
    /// Number of records in the batch body.
    pub records: u32,
}

/// Encodes a batch, padded to whole blocks.
pub fn encode_batch(fsid: [u8; 16], seq: u64, lsn: u64, records: &[LogRecord]) -> Vec<u8> {
    let mut body = Writer::default();
    for r in records {
        body.u64(r.generation);
        r.key.encode(&mut body);
        match &r.value {
            Some(v) if r.is_data() => {
                body.u8(2);
                body.u32(v.len() as u32);
                body.put(v);
            }
            Some(v) => {
                body.u8(1);
                body.u32(v.len() as u32);
                body.put(v);
            }
            None => body.u8(0),
        }
    }
    let body = body.into_bytes();
    let len = (LOG_HEADER_BYTES + body.len()).div_ceil(BLOCK_SIZE as usize) * BLOCK_SIZE as usize;
    let mut w = Writer::with_capacity(len);
    w.put(&LOG_MAGIC);
    w.u32(0); // checksum, filled below
    w.put(&fsid);
    w.u64(seq);
    w.u64(lsn);
    w.u32(len as u32);
    w.u32(records.len() as u32);
    w.u32(body.len() as u32);
    let mut bytes = w.into_bytes();
    bytes.resize(LOG_HEADER_BYTES, 0);
    bytes.extend_from_slice(&body);
    bytes.resize(len, 0);
    let sum = checksum(&bytes[8..]);
    bytes[4..8].copy_from_slice(&sum.to_le_bytes());
    bytes
}

/// Decodes the header in the first block of a batch (no checksum check: that needs the whole
/// batch). Returns `None` when the magic is absent.
pub fn decode_header(first_block: &[u8]) -> Option<BatchHeader> {
    let mut r = Reader::new(first_block, "log batch header");
    let magic: [u8; 4] = r.array().ok()?;
    if magic != LOG_MAGIC {
        return None;
    }
    r.u32().ok()?;
    Some(BatchHeader {
        fsid: r.array().ok()?,
        seq: r.u64().ok()?,
        lsn: r.u64().ok()?,
        len_bytes: r.u32().ok()?,
        records: r.u32().ok()?,
    })
}

/// Verifies and decodes a whole batch; `bytes` must be exactly `len_bytes` long. Errors:
/// `BadMagic` (no `BLOG` or a cut header), `Invalid` (length mismatch, record kind not 0/1,
/// value over [`crate::MAX_ITEM_BYTES`]), `BadChecksum`, `Truncated` (records overrun the body).
/// Does not check fsid, seq or lsn: that is the caller's.
pub fn decode_batch(bytes: &[u8]) -> Result<(BatchHeader, Vec<LogRecord>), FormatError> {
    let header = decode_header(bytes).ok_or_else(|| FormatError::BadMagic {
        what: "log batch".into(),
        found: bytes.iter().take(4).copied().collect(),
    })?;
    if header.len_bytes as usize != bytes.len() {
        return Err(FormatError::invalid(
            "log batch length",
            bytes.len(),
            header.len_bytes,
        ));
    }
    if bytes.len() < LOG_HEADER_BYTES {
        return Err(FormatError::invalid(
            "log batch shorter than its header",
            bytes.len(),
            LOG_HEADER_BYTES,
        ));
    }
    let stored = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
    let computed = checksum(&bytes[8..]);
    if stored != computed {
        return Err(FormatError::BadChecksum {
            what: format!("log batch seq {}", header.seq),
            stored,
            computed,
        });
    }
    // The body length sits after magic, checksum, fsid, seq, lsn, length and record count.
    let body_len = u32::from_le_bytes([bytes[48], bytes[49], bytes[50], bytes[51]]) as usize;
    let mut r = Reader::new(&bytes[LOG_HEADER_BYTES..], "log batch body");
    let body = r.take(body_len)?;
    let mut r = Reader::new(body, "log record");
    // The count is on disk: reserve no more than the body can hold (a record takes at least
    // its generation, key and kind byte), so a sealed batch with a huge count is refused as
    // truncated instead of aborting on the allocation (found by the birch-fuzz target
    // log_batch_decode).
    let mut records =
        Vec::with_capacity((header.records as usize).min(body.len() / MIN_RECORD_BYTES));
    for _ in 0..header.records {
        let generation = r.u64()?;
        let key = Key::decode(&mut r)?;
        let kind = r.u8()?;
        let value = match kind {
            0 => None,
            1 => {
                let len = r.u32()? as usize;
                if len > crate::MAX_ITEM_BYTES {
                    return Err(FormatError::invalid(
                        "log record value length",
                        len,
                        format!("<= {}", crate::MAX_ITEM_BYTES),
                    ));
                }
                Some(r.take(len)?.to_vec())
            }
            2 => {
                let len = r.u32()? as usize;
                if len == 0 || len > LOG_DATA_MAX || len % BLOCK_SIZE as usize != 0 {
                    return Err(FormatError::invalid(
                        "log data record length",
                        len,
                        format!("whole blocks, at most {LOG_DATA_MAX} bytes"),
                    ));
                }
                Some(r.take(len)?.to_vec())
            }
            other => return Err(FormatError::invalid("log record kind", other, "0, 1 or 2")),
        };
        // A data record's kind and its key's type go together.
        if (key.item_type == LOG_DATA_TYPE) != (kind == 2) {
            return Err(FormatError::invalid(
                "log record kind for its key type",
                kind,
                if key.item_type == LOG_DATA_TYPE {
                    "2"
                } else {
                    "0 or 1"
                },
            ));
        }
        records.push(LogRecord {
            generation,
            key,
            value,
        });
    }
    Ok((header, records))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ItemType;

    /// A batch whose checksum verifies but whose record count is 4 billion: refused as
    /// truncated, without reserving room for 4 billion records first (it aborted the process
    /// on a 120 GB allocation; found by birch-fuzz's log_batch_decode).
    #[test]
    fn a_sealed_batch_with_a_huge_record_count_is_an_error_not_an_abort() {
        let records = vec![LogRecord {
            generation: 1,
            key: Key::new(300, ItemType::InodeItem, 0),
            value: None,
        }];
        let mut bytes = encode_batch([1; 16], 1, 0, &records);
        bytes[44..48].copy_from_slice(&u32::MAX.to_le_bytes());
        let sum = checksum(&bytes[8..]);
        bytes[4..8].copy_from_slice(&sum.to_le_bytes());
        assert!(matches!(
            decode_batch(&bytes),
            Err(FormatError::Truncated { .. })
        ));
    }

    #[test]
    fn batch_round_trip_and_torn_batches_fail() {
        let records = vec![
            LogRecord {
                generation: 7,
                key: Key::new(300, ItemType::InodeItem, 0),
                value: Some(vec![1; 160]),
            },
            LogRecord {
                generation: 7,
                key: Key::new(300, ItemType::ExtentData, 4096),
                value: None,
            },
        ];
        let bytes = encode_batch([3; 16], 11, 8192, &records);
        assert_eq!(bytes.len() % BLOCK_SIZE as usize, 0);
        let (header, back) = decode_batch(&bytes).expect("valid batch");
        assert_eq!((header.seq, header.lsn, back), (11, 8192, records));
        for at in [8usize, 70, 200, bytes.len() - 1] {
            let mut torn = bytes.clone();
            torn[at] ^= 1;
            assert!(decode_batch(&torn).is_err(), "flip at {at}");
        }
    }

    /// A data record (kind 2) round-trips; its kind and key type must agree, and its length
    /// must be whole blocks.
    #[test]
    fn data_records_round_trip_and_are_checked() {
        let records = vec![
            LogRecord::data(9, 300, 0x40_0000, vec![5; 2 * BLOCK_SIZE as usize]),
            LogRecord {
                generation: 9,
                key: Key::new(300, ItemType::ExtentData, 0),
                value: Some(vec![2; 40]),
            },
        ];
        let bytes = encode_batch([3; 16], 2, 0, &records);
        let (_, back) = decode_batch(&bytes).expect("valid batch");
        assert!(back[0].is_data() && !back[1].is_data());
        assert_eq!(back, records);
        // Re-seal a batch after changing one byte, so only the record checks can refuse it.
        let reseal = |at: usize, to: u8| {
            let mut b = bytes.clone();
            b[at] = to;
            let sum = checksum(&b[8..]);
            b[4..8].copy_from_slice(&sum.to_le_bytes());
            b
        };
        // The first record's kind byte sits after its generation (8) and key (17).
        let kind_at = LOG_HEADER_BYTES + 25;
        assert!(
            decode_batch(&reseal(kind_at, 1)).is_err(),
            "data key, kind 1"
        );
        // The second record's kind byte: after the first record (26 + 4 + 8192 bytes).
        let second = LOG_HEADER_BYTES + 30 + 2 * BLOCK_SIZE as usize;
        assert!(
            decode_batch(&reseal(second + 25, 2)).is_err(),
            "item key, kind 2"
        );
        // A data length that is not whole blocks (the length's low byte).
        assert!(decode_batch(&reseal(kind_at + 1, 1)).is_err(), "cut data");
    }

    #[test]
    fn a_sealed_batch_shorter_than_its_header_is_an_error_not_a_panic() {
        let full = encode_batch([3; 16], 1, 0, &[]);
        for len in 48..LOG_HEADER_BYTES {
            let mut cut = full[..len].to_vec();
            // magic, checksum, fsid, seq, lsn, then the length at byte 40
            cut[40..44].copy_from_slice(&(len as u32).to_le_bytes());
            let sum = checksum(&cut[8..]);
            cut[4..8].copy_from_slice(&sum.to_le_bytes());
            assert!(decode_batch(&cut).is_err(), "length {len}");
        }
    }
}
