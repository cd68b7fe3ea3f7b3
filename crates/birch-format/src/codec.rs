//! The compression codecs of blob extents (DESIGN §16; not yet written by any write path):
//! zstd and lz4 over one chunk of whole blocks, and the rule that decides whether a compressed
//! chunk is worth keeping.
//!
//! Owns: encoding a chunk into at most a given number of bytes and decoding stored bytes into
//! exactly the chunk's declared length. Decoding uses only fixed-size block APIs
//! (`zstd::bulk::Decompressor::decompress_to_buffer`, `lz4_flex::block::decompress_into`)
//! into a caller's buffer of the declared length: a hostile image can make a decode fail, never
//! allocate more than that buffer or panic.
//!
//! Must not touch: where blobs live, their items, their checksums, I/O (the data layer's).

use crate::BLOCK_SIZE;

/// How a blob's stored bytes encode its logical bytes (the blob item's codec byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// Stored as they are (a window over plain bytes; encryption's kind without compression).
    None,
    /// zstd at a level (1 ..= 19; the level is not stored: decoding does not need it).
    Zstd(i32),
    /// lz4 (block format).
    Lz4,
}

impl Codec {
    /// The codec byte of the blob item: 0 none, 1 zstd, 2 lz4.
    pub fn byte(self) -> u8 {
        match self {
            Codec::None => 0,
            Codec::Zstd(_) => 1,
            Codec::Lz4 => 2,
        }
    }

    /// The codec a user names: `zstd` (level 1), `zstd:N` (N in 1 ..= 19), `lz4`, `none`.
    pub fn parse(name: &str) -> Option<Codec> {
        match name {
            "none" => Some(Codec::None),
            "lz4" => Some(Codec::Lz4),
            "zstd" => Some(Codec::Zstd(1)),
            other => {
                let level: i32 = other.strip_prefix("zstd:")?.parse().ok()?;
                (1..=19).contains(&level).then_some(Codec::Zstd(level))
            }
        }
    }

    /// The name [`Codec::parse`] reads back.
    pub fn name(self) -> String {
        match self {
            Codec::None => "none".into(),
            Codec::Zstd(level) => format!("zstd:{level}"),
            Codec::Lz4 => "lz4".into(),
        }
    }

    /// The codec a blob item's byte names, for decoding (zstd's level is then irrelevant).
    pub fn from_byte(byte: u8) -> Option<Codec> {
        match byte {
            0 => Some(Codec::None),
            1 => Some(Codec::Zstd(0)),
            2 => Some(Codec::Lz4),
            _ => None,
        }
    }
}

/// Why a chunk could not be decoded: the stored bytes are not an encoding of exactly the
/// declared length (corrupt, or written by something else).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{codec:?} blob: {why}")]
pub struct DecodeError {
    /// The codec the item names.
    pub codec: Codec,
    /// What was wrong.
    pub why: String,
}

/// Whether a chunk of `logical_blocks` blocks stored in `stored_blocks` blocks saves enough to
/// be kept compressed: at least 1/8 (`stored · 8 ≤ logical · 7`, ZFS's rule). A 1-block chunk
/// never does.
pub fn worth_keeping(logical_blocks: u64, stored_blocks: u64) -> bool {
    stored_blocks.saturating_mul(8) <= logical_blocks.saturating_mul(7)
}

/// Encodes `input` (whole blocks) with `codec` into `out` (cleared first), unless the result
/// would not be worth keeping by [`worth_keeping`]: then `None`, and the chunk is to be stored
/// as it is. `Codec::None` is never worth keeping as a compression.
pub fn encode(codec: Codec, input: &[u8], out: &mut Vec<u8>) -> Option<usize> {
    let logical_blocks = (input.len() as u64).div_ceil(BLOCK_SIZE);
    // The most the encoding may take and still be kept.
    let limit = usize::try_from(logical_blocks * 7 / 8 * BLOCK_SIZE).ok()?;
    if limit == 0 {
        return None;
    }
    out.clear();
    let written = match codec {
        Codec::None => return None,
        Codec::Zstd(level) => {
            out.resize(limit, 0);
            let mut compressor = zstd::bulk::Compressor::new(level).ok()?;
            compressor.compress_to_buffer(input, &mut out[..]).ok()?
        }
        Codec::Lz4 => {
            out.resize(lz4_flex::block::get_maximum_output_size(input.len()), 0);
            let n = lz4_flex::block::compress_into(input, out).ok()?;
            if n > limit {
                return None;
            }
            n
        }
    };
    out.truncate(written);
    let stored_blocks = (written as u64).div_ceil(BLOCK_SIZE);
    worth_keeping(logical_blocks, stored_blocks).then_some(written)
}

/// Decodes `stored` (exactly the encoding's bytes) with `codec` into `out`, whose length is
/// the blob's declared logical length; an encoding of any other length is an error.
pub fn decode(codec: Codec, stored: &[u8], out: &mut [u8]) -> Result<(), DecodeError> {
    let bad = |why: String| DecodeError { codec, why };
    let produced = match codec {
        Codec::None => {
            if stored.len() != out.len() {
                return Err(bad(format!(
                    "{} stored bytes for {} logical",
                    stored.len(),
                    out.len()
                )));
            }
            out.copy_from_slice(stored);
            stored.len()
        }
        Codec::Zstd(_) => {
            let mut decompressor =
                zstd::bulk::Decompressor::new().map_err(|e| bad(format!("decoder: {e}")))?;
            decompressor
                .decompress_to_buffer(stored, out)
                .map_err(|e| bad(e.to_string()))?
        }
        Codec::Lz4 => {
            lz4_flex::block::decompress_into(stored, out).map_err(|e| bad(e.to_string()))?
        }
    };
    if produced != out.len() {
        return Err(bad(format!(
            "decodes to {produced} bytes, the item says {}",
            out.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: usize = BLOCK_SIZE as usize;

    /// `blocks` blocks, each a header naming it, a random half and a text half (compressible,
    /// never a constant fill).
    fn chunk(blocks: usize, seed: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(blocks * BS);
        let mut x = seed | 1;
        for b in 0..blocks {
            let start = out.len();
            out.extend_from_slice(&(b as u64).to_le_bytes());
            while out.len() < start + BS / 2 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                out.extend_from_slice(&x.to_le_bytes());
            }
            let text = format!("block {b} of a chunk seeded {seed}: the quick brown fox. ");
            while out.len() < start + BS {
                let room = start + BS - out.len();
                out.extend_from_slice(&text.as_bytes()[..room.min(text.len())]);
            }
        }
        out
    }

    #[test]
    fn each_codec_round_trips_a_compressible_chunk() {
        let input = chunk(32, 7);
        for codec in [Codec::Zstd(1), Codec::Zstd(9), Codec::Lz4] {
            let mut stored = Vec::new();
            let n = encode(codec, &input, &mut stored).expect("half text compresses");
            assert!(n < input.len() * 7 / 8, "{codec:?}: {n}");
            let mut back = vec![0u8; input.len()];
            decode(codec, &stored, &mut back).expect("decode");
            assert_eq!(back, input, "{codec:?}");
            let from_byte = Codec::from_byte(codec.byte()).expect("byte");
            decode(from_byte, &stored, &mut back).expect("decode by the item's byte");
        }
    }

    #[test]
    fn random_bytes_and_single_blocks_are_not_kept() {
        let mut x = 99u64;
        let random: Vec<u8> = (0..16 * BS)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 56) as u8
            })
            .collect();
        let mut out = Vec::new();
        for codec in [Codec::Zstd(3), Codec::Lz4, Codec::None] {
            assert_eq!(encode(codec, &random, &mut out), None, "{codec:?}");
            assert_eq!(
                encode(codec, &vec![0u8; BS], &mut out),
                None,
                "one block: {codec:?}"
            );
        }
        assert!(worth_keeping(32, 28) && !worth_keeping(32, 29));
        assert!(worth_keeping(2, 1) && !worth_keeping(1, 1));
    }

    /// Stored bytes that are damaged, cut, or decode to another length are errors, never a
    /// panic, and never write past the declared length.
    #[test]
    fn bad_stored_bytes_are_errors() {
        let input = chunk(8, 3);
        for codec in [Codec::Zstd(1), Codec::Lz4] {
            let mut stored = Vec::new();
            encode(codec, &input, &mut stored).expect("encode");
            let mut out = vec![0u8; input.len()];
            assert!(decode(codec, &stored[..stored.len() / 2], &mut out).is_err());
            let mut shorter = vec![0u8; input.len() - BS];
            assert!(
                decode(codec, &stored, &mut shorter).is_err(),
                "{codec:?} too long"
            );
            let mut longer = vec![0u8; input.len() + BS];
            assert!(
                decode(codec, &stored, &mut longer).is_err(),
                "{codec:?} too short"
            );
            for i in (0..stored.len()).step_by(7) {
                let mut damaged = stored.clone();
                damaged[i] ^= 0x5a;
                // Either an error or some bytes of the right length: never a panic.
                let _ = decode(codec, &damaged, &mut out);
            }
        }
        let mut out = vec![0u8; BS];
        assert!(decode(Codec::None, &[1u8; 100], &mut out).is_err());
        // A zstd frame that claims 4 GiB of content is refused without that allocation.
        let mut claim = vec![0x28, 0xb5, 0x2f, 0xfd, 0xa0];
        claim.extend_from_slice(&u32::MAX.to_le_bytes());
        claim.extend_from_slice(&[0u8; 16]);
        assert!(decode(Codec::Zstd(0), &claim, &mut out).is_err());
        assert_eq!(Codec::from_byte(3), None);
    }

    #[test]
    fn names_parse_and_round_trip() {
        for codec in [Codec::None, Codec::Lz4, Codec::Zstd(1), Codec::Zstd(19)] {
            assert_eq!(Codec::parse(&codec.name()), Some(codec));
        }
        assert_eq!(Codec::parse("zstd"), Some(Codec::Zstd(1)));
        for bad in ["zstd:0", "zstd:20", "zstd:", "zstd:x", "gzip", "", "LZ4"] {
            assert_eq!(Codec::parse(bad), None, "{bad}");
        }
    }
}
