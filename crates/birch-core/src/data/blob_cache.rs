//! The decoded-blob cache (DESIGN §16.6): the logical bytes of the blobs read last, so that
//! reads of one blob's window in pieces (4 KiB reads, readahead split across FUSE threads)
//! read and decode it once.
//!
//! Owns: the cache's entries and its bounds ([`BLOB_CACHE_ENTRIES`], [`BLOB_CACHE_BYTES`]).
//! An entry is keyed by everything that fixes a blob's decoded bytes: its address, codec,
//! encoded and logical lengths and the crc32c of every stored block. An address alone is not a
//! key (a freed blob's blocks are reused); a reused address with other stored bytes has other
//! checksums, and identical stored bytes decode to identical logical bytes. Only bytes that
//! were verified and decoded are inserted (`read.rs`).
//!
//! Must not touch: the device, the extent map, the allocator. One short mutex hold per look-up
//! or insert; never held across I/O or decoding.

use std::collections::VecDeque;
use std::sync::Arc;

use birch_format::items::Blob;
use parking_lot::Mutex;

/// Blobs kept at most.
pub(crate) const BLOB_CACHE_ENTRIES: usize = 32;
/// Decoded bytes kept at most.
pub(crate) const BLOB_CACHE_BYTES: usize = 4 << 20;

/// What identifies a blob's decoded bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct BlobId {
    disk_addr: u64,
    codec: u8,
    encoded_len: u32,
    logical: u32,
    csums: Vec<u32>,
}

impl BlobId {
    fn of(blob: &Blob) -> BlobId {
        BlobId {
            disk_addr: blob.disk_addr,
            codec: blob.codec.byte(),
            encoded_len: blob.encoded_len,
            logical: blob.logical,
            csums: blob.csums.clone(),
        }
    }
}

/// Decoded blobs, most recently used first.
#[derive(Default)]
pub(crate) struct BlobCache {
    entries: Mutex<VecDeque<(BlobId, Arc<[u8]>)>>,
}

impl BlobCache {
    /// The decoded bytes of `blob`, if cached (and now most recently used).
    pub(crate) fn get(&self, blob: &Blob) -> Option<Arc<[u8]>> {
        let id = BlobId::of(blob);
        let mut entries = self.entries.lock();
        let at = entries.iter().position(|(k, _)| *k == id)?;
        let entry = entries.remove(at)?;
        let bytes = entry.1.clone();
        entries.push_front(entry);
        Some(bytes)
    }

    /// Keeps `decoded` (verified, exactly `blob.logical` bytes) as `blob`'s decoded bytes,
    /// dropping the least recently used past the bounds.
    pub(crate) fn insert(&self, blob: &Blob, decoded: Arc<[u8]>) {
        debug_assert_eq!(decoded.len(), blob.logical as usize);
        let id = BlobId::of(blob);
        let mut entries = self.entries.lock();
        entries.retain(|(k, _)| *k != id);
        entries.push_front((id, decoded));
        let mut bytes: usize = entries.iter().map(|(_, b)| b.len()).sum();
        while entries.len() > BLOB_CACHE_ENTRIES || (bytes > BLOB_CACHE_BYTES && entries.len() > 1)
        {
            match entries.pop_back() {
                Some((_, b)) => bytes -= b.len(),
                None => break,
            }
        }
    }

    /// Blobs cached now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use birch_format::codec::Codec;

    use super::*;

    fn blob(addr: u64, csum: u32, logical_blocks: u32) -> Blob {
        Blob {
            disk_addr: addr,
            codec: Codec::Lz4,
            encoded_len: 4000,
            logical: logical_blocks * 4096,
            window_offset: 0,
            window_len: 4096,
            nonce: 0,
            csums: vec![csum],
        }
    }

    /// A hit needs every identifying field; a reused address with other checksums misses; the
    /// window does not matter; the bounds evict the least recently used.
    #[test]
    fn hits_need_the_same_stored_bytes_and_bounds_hold() {
        let cache = BlobCache::default();
        let a = blob(0x10000, 7, 2);
        cache.insert(&a, vec![1u8; 8192].into());
        assert!(cache.get(&a).is_some());
        let other_window = Blob {
            window_offset: 4096,
            ..a.clone()
        };
        assert!(
            cache.get(&other_window).is_some(),
            "the window is not part of the key"
        );
        assert!(cache.get(&blob(0x10000, 8, 2)).is_none(), "reused address");
        assert!(cache.get(&blob(0x20000, 7, 2)).is_none());
        for n in 0..BLOB_CACHE_ENTRIES as u64 {
            cache.insert(&blob(0x100000 + n * 0x10000, 1, 2), vec![0u8; 8192].into());
            if n == 3 {
                assert!(cache.get(&a).is_some(), "used again: kept longer");
            }
        }
        assert_eq!(cache.len(), BLOB_CACHE_ENTRIES);
        assert!(cache.get(&a).is_some(), "recently used survives");
        assert!(
            cache.get(&blob(0x100000, 1, 2)).is_none(),
            "the oldest went"
        );
        // Large blobs: the byte bound (4 MiB) keeps 4 of 1 MiB.
        for n in 0..6u64 {
            cache.insert(
                &blob(0x900000 + n * 0x100000, 2, 256),
                vec![0u8; 1 << 20].into(),
            );
        }
        let held: usize = cache.entries.lock().iter().map(|(_, b)| b.len()).sum();
        assert!(held <= BLOB_CACHE_BYTES, "{held}");
    }
}
