//! Block stamps: the content of one 4 KiB block of a test file at one version, so that a
//! block read back can be told apart from every other block and version (a constant fill
//! cannot show a block in the wrong place).
//!
//! Owns: the stamp layout (a header of a magic number, the file, the block and the version,
//! then a random half drawn from those three and a compressible half) and its recognition;
//! and [`fill`], the content of any byte range of a test file at one version (what the crash
//! matrix writes instead of constant fills), with [`fill_header`] to read back whose piece a
//! block holds. Must not touch: devices or filesystems; tests decide what a stamp must be.

use crate::rng::Rng;

/// Bytes in a stamp: one filesystem block.
pub const STAMP_BYTES: usize = birch_format::BLOCK_SIZE as usize;

/// The stamp of block `block` of file `file` at `version`, under `magic` (each test its own).
pub fn stamp(magic: u64, file: u64, block: u64, version: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(STAMP_BYTES);
    for word in [magic, file, block, version] {
        out.extend_from_slice(&word.to_le_bytes());
    }
    let mut rng = Rng::new(magic ^ (file << 48) ^ (block << 24) ^ version);
    while out.len() < STAMP_BYTES / 2 {
        out.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    while out.len() < STAMP_BYTES {
        out.push((version as u8).wrapping_add(out.len() as u8 & 0x0f));
    }
    out
}

/// What `bytes` (one block) holds: `Some(0)` for zeros (never written, a hole), `Some(v)` for
/// the whole stamp of `file`'s `block` at version `v` under `magic`, `None` for anything else
/// (another file's or block's stamp, a torn or damaged block).
pub fn version_of(bytes: &[u8], magic: u64, file: u64, block: u64) -> Option<u64> {
    if bytes.iter().all(|b| *b == 0) {
        return Some(0);
    }
    let version = u64::from_le_bytes(bytes.get(24..32)?.try_into().ok()?);
    (bytes == stamp(magic, file, block, version).as_slice()).then_some(version)
}

/// The file a block-aligned stamp under `magic` names, if `bytes` starts with one.
pub fn file_of(bytes: &[u8], magic: u64) -> Option<u64> {
    let word = |i: usize| -> Option<u64> {
        Some(u64::from_le_bytes(
            bytes.get(i * 8..i * 8 + 8)?.try_into().ok()?,
        ))
    };
    (word(0)? == magic).then(|| word(1)).flatten()
}

/// The first word of every [`fill`] piece's header (`birchfil`).
pub const FILL_TAG: u64 = u64::from_le_bytes(*b"birchfil");

/// Bytes in a [`fill`] piece's header: the tag, the file, the piece's file offset, the version.
pub const FILL_HEADER: usize = 32;

/// Bytes of a [`fill`] piece in one unit of its body: [`FILL_RANDOM`] random bytes, then text.
const FILL_UNIT: usize = 384;

/// Random bytes at the start of each unit of a [`fill`] piece's body (a third of it).
const FILL_RANDOM: usize = 128;

/// The bytes of file `file` at file offset `offset..offset + len` at `version`, as a test
/// writes them: never a constant fill, so a block read back in the wrong place, from the wrong
/// file or of the wrong version does not pass for the right one.
///
/// The range is cut into pieces at every 4 KiB file offset (so a block-aligned write is whole
/// pieces, an unaligned one a partial piece at either end). Each piece starts with a header of
/// [`FILL_HEADER`] bytes (a piece shorter than that holds its first bytes): [`FILL_TAG`], the
/// file, the piece's own file offset and the version, little-endian; then units of 384 bytes,
/// each 128 bytes drawn from a generator seeded by (file, piece offset, version)
/// (incompressible) and 256 bytes of repetitive text naming the same three with a line count
/// (compressible: a 4 KiB block is about a third random and compresses about 2-3x). A piece's
/// bytes depend only on (file, its offset, version): the same call gives the same bytes, a
/// shorter piece at the same offset is a prefix of a longer one, and block-aligned calls
/// concatenate (`fill(f, 0, v, 8192)` is `fill(f, 0, v, 4096)` then `fill(f, 4096, v, 4096)`).
pub fn fill(file: u64, offset: u64, version: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let end = offset + len as u64;
    let mut at = offset;
    while at < end {
        let room = STAMP_BYTES as u64 - at % STAMP_BYTES as u64;
        let piece = room.min(end - at) as usize;
        fill_piece(&mut out, file, at, version, piece);
        at += piece as u64;
    }
    out
}

/// Appends the first `len` bytes of the piece of `file` at `offset` (up to the next 4 KiB
/// offset) at `version`.
fn fill_piece(out: &mut Vec<u8>, file: u64, offset: u64, version: u64, len: usize) {
    let seed = mix(mix(mix(file) ^ offset) ^ version);
    let mut rng = Rng::new(seed);
    let mut piece = Vec::with_capacity(len + FILL_UNIT);
    for word in [FILL_TAG, file, offset, version] {
        piece.extend_from_slice(&word.to_le_bytes());
    }
    // The text: lines naming the piece, entered at a place and under a byte mask of the
    // seed's choosing, so that two pieces' texts differ byte for byte, not only in the digits.
    let mut text = Vec::new();
    let mut line = 0u32;
    let skip = (seed % 61) as usize;
    let mask = (seed >> 56) as u8;
    while piece.len() < len {
        for _ in 0..FILL_RANDOM / 8 {
            piece.extend_from_slice(&rng.next_u64().to_le_bytes());
        }
        while text.len() < skip + FILL_UNIT - FILL_RANDOM {
            text.extend(
                format!(
                    "birch file {file} offset {offset} version {version} line {line:04}: \
                     the quick brown fox jumps over the lazy dog\n"
                )
                .bytes()
                .map(|b| b ^ mask),
            );
            line += 1;
        }
        piece.extend(text.drain(skip..skip + FILL_UNIT - FILL_RANDOM));
    }
    out.extend_from_slice(&piece[..len]);
}

/// A 64-bit mix (splitmix64's finaliser): nearby inputs give unrelated seeds.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The (file, file offset, version) a [`fill`] piece header at the start of `bytes` names, if
/// there is one: what a block read back in the wrong place holds instead.
pub fn fill_header(bytes: &[u8]) -> Option<(u64, u64, u64)> {
    let word = |i: usize| -> Option<u64> {
        Some(u64::from_le_bytes(
            bytes.get(i * 8..i * 8 + 8)?.try_into().ok()?,
        ))
    };
    (word(0)? == FILL_TAG).then_some((word(1)?, word(2)?, word(3)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stamp_is_recognised_only_as_itself() {
        let s = stamp(7, 1, 2, 3);
        assert_eq!(s.len(), STAMP_BYTES);
        assert_eq!(version_of(&s, 7, 1, 2), Some(3));
        assert_eq!(version_of(&s, 7, 1, 3), None, "another block");
        assert_eq!(version_of(&s, 7, 2, 2), None, "another file");
        assert_eq!(version_of(&s, 8, 1, 2), None, "another magic");
        assert_eq!(version_of(&vec![0; STAMP_BYTES], 7, 1, 2), Some(0));
        let mut torn = s.clone();
        torn[STAMP_BYTES - 1] ^= 1;
        assert_eq!(version_of(&torn, 7, 1, 2), None, "one byte changed");
        assert_ne!(stamp(7, 1, 2, 3), stamp(7, 1, 2, 4), "versions differ");
        assert_eq!(file_of(&s, 7), Some(1));
        assert_eq!(file_of(&s, 8), None);
    }

    #[test]
    fn a_fill_is_deterministic_and_cut_at_block_offsets() {
        let a = fill(3, 100, 7, 20_000);
        assert_eq!(a.len(), 20_000);
        assert!(a == fill(3, 100, 7, 20_000));
        assert!(
            fill(3, 100, 7, 50) == a[..50],
            "a shorter piece is a prefix"
        );
        assert!(fill(3, 100, 7, 5) == a[..5], "even inside the header");
        // A header at the start and at every 4 KiB file offset in the range.
        assert_eq!(fill_header(&a), Some((3, 100, 7)));
        for block in 1..5u64 {
            let at = (block * 4096 - 100) as usize;
            assert_eq!(fill_header(&a[at..]), Some((3, block * 4096, 7)));
        }
        let whole = fill(3, 0, 7, 3 * 4096);
        let pieces = [fill(3, 0, 7, 4096), fill(3, 4096, 7, 8192)].concat();
        assert!(whole == pieces, "block-aligned calls concatenate");
        assert!(
            whole[100..4096] != a[..3996],
            "an unaligned piece has a header of its own"
        );
        assert!(fill(3, 0, 7, 0).is_empty());
    }

    #[test]
    fn fills_differ_across_offsets_files_and_versions() {
        let base = fill(1, 0, 1, 4 * 4096);
        let blocks: Vec<&[u8]> = base.chunks(4096).collect();
        for (i, x) in blocks.iter().enumerate() {
            for y in &blocks[i + 1..] {
                assert!(x != y, "two blocks of one version");
            }
        }
        for other in [fill(1, 0, 2, 4 * 4096), fill(2, 0, 1, 4 * 4096)] {
            for (x, y) in base.chunks(4096).zip(other.chunks(4096)) {
                // Not just the header: most bytes past it differ.
                let same = x[FILL_HEADER..]
                    .iter()
                    .zip(&y[FILL_HEADER..])
                    .filter(|(a, b)| a == b)
                    .count();
                assert!(same < 4096 / 4, "{same} bytes alike");
            }
        }
        // A block taken from another offset (the same version) differs in most bytes too.
        let same = blocks[1][FILL_HEADER..]
            .iter()
            .zip(&blocks[2][FILL_HEADER..])
            .filter(|(a, b)| a == b)
            .count();
        assert!(same < 4096 / 4, "{same} bytes alike");
        // Short pieces (small files) differ by version as well.
        assert!(fill(4, 0, 1, 40) != fill(4, 0, 2, 40));
        assert!(fill(4, 0, 1, 40) != fill(4, 40, 1, 40));
    }

    /// About a third of a block is random, the rest repetitive text: counted in distinct
    /// 8-byte windows (random bytes make nearly one a position, the text few).
    #[test]
    fn a_fill_block_is_partly_random_partly_repetitive() {
        let block = fill(9, 8192, 3, 4096);
        let windows: std::collections::HashSet<&[u8]> = block.windows(8).collect();
        let share = windows.len() as f64 / block.len() as f64;
        assert!(
            (0.3..0.6).contains(&share),
            "{share:.2} of windows distinct"
        );
    }
}
