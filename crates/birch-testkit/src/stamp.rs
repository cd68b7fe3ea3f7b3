//! Block stamps: the content of one 4 KiB block of a test file at one version, so that a
//! block read back can be told apart from every other block and version (a constant fill
//! cannot show a block in the wrong place).
//!
//! Owns: the stamp layout (a header of a magic number, the file, the block and the version,
//! then a random half drawn from those three and a compressible half) and its recognition.
//! Must not touch: devices or filesystems; tests decide what a stamp must be.

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
}
