//! Rewriting a file's data compressed (`birch defrag --compress`, DESIGN §16.4): each chunk of
//! up to 128 KiB at a chunk-aligned offset, held whole in unshared regular extents, is read,
//! compressed and, when that saves at least 1/8, written as one blob whose window replaces the
//! chunk's extents. What the write paths leave uncompressed (small appends, placed overwrites,
//! partial blocks) can be compressed this way later.
//!
//! Owns: the choice of chunks and the per-file report. Must not touch: extents, blocks and the
//! allocator (the data layer writes the blob and replaces the range), the fsync log (the inode
//! is stored, which makes its next fsync log or commit it whole). Holds the inode's write lock
//! for one chunk at a time, as a write of that chunk would.

use birch_format::codec::Codec;
use birch_format::items::ExtentKind;
use birch_format::{InodeNo, BLOCK_SIZE};

use super::Filesystem;
use crate::error::{Error, Result};

/// What [`Filesystem::compress_file`] did to one file.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CompressReport {
    /// Chunks written as blobs.
    pub compressed: u64,
    /// Chunks looked at and left as they were: they did not save 1/8, or no contiguous run of
    /// the stored size was free.
    pub kept: u64,
    /// Chunks not looked at: holes, preallocated or shared (cloned) extents, blobs already,
    /// or a single block.
    pub skipped: u64,
    /// File bytes of the chunks compressed.
    pub logical_bytes: u64,
    /// Bytes their blobs take on disk.
    pub stored_bytes: u64,
}

impl Filesystem {
    /// Rewrites the data of regular file `ino` compressed with `codec`, chunk by chunk
    /// ([`CompressReport`]). The file reads the same before and after; its times do not
    /// change; `st_blocks` follows the stored size. The old blocks are freed as an overwrite
    /// frees them (kept for snapshots, reused after the next durable commit). `IsDir` for a
    /// directory, `Invalid` for another non-regular file.
    pub fn compress_file(&self, ino: InodeNo, codec: Codec) -> Result<CompressReport> {
        self.compress_range(ino, codec, 0, u64::MAX)
    }

    /// [`Filesystem::compress_file`] for the chunks that overlap `[start, start + len)` only
    /// (`BTRFS_IOC_DEFRAG_RANGE`'s range; `len` 0 or past the end: to the end).
    pub fn compress_range(
        &self,
        ino: InodeNo,
        codec: Codec,
        start: u64,
        len: u64,
    ) -> Result<CompressReport> {
        let range_end = match len {
            0 => u64::MAX,
            n => start.saturating_add(n),
        };
        let ino = ino.get();
        self.refuse_snapshot_change("compress", &[ino])?;
        let state = self.inode(ino)?;
        let cap = crate::data::BLOB_CAP_BYTES;
        let range_end = range_end.saturating_add(cap - 1) / cap * cap;
        let mut report = CompressReport::default();
        let mut next = start / cap * cap;
        // One chunk per hold of the inode's write lock: reads and writes of the file wait for
        // one chunk's read, compression and write at most, not the whole file's.
        loop {
            let mut data = state.data.write();
            match data.item.mode & libc::S_IFMT {
                libc::S_IFREG => {}
                libc::S_IFDIR => return Err(Error::IsDir(format!("compress dir {ino}"))),
                _ => return Err(Error::Invalid(format!("compress of special file {ino}"))),
            }
            if data.freed {
                return Ok(report);
            }
            // Buffered data goes to disk first: the chunks are chosen from extents.
            self.flush_locked(ino, &mut data)?;
            let _op = self.inner.engine.hold()?;
            if self.data().inline_data(ino)?.is_some() {
                return Ok(report);
            }
            let end = (data.item.size.div_ceil(BLOCK_SIZE) * BLOCK_SIZE).min(range_end);
            if next >= end {
                return Ok(report);
            }
            let chunk = next;
            let chunk_end = (chunk + cap).min(end);
            let len = chunk_end - chunk;
            next = chunk_end;
            if len < 2 * BLOCK_SIZE || !self.chunk_is_plain(ino, chunk, chunk_end)? {
                report.skipped += 1;
                continue;
            }
            let mut bytes = self.read_locked(ino, &data, chunk, len as usize)?;
            // Past the size the last block holds zeros (FORMAT §6.6).
            bytes.resize(len as usize, 0);
            let data_layer = self.data();
            match data_layer.write_blob(ino, chunk, &bytes, codec)? {
                Some((blob, birth)) => {
                    let stored = blob.stored_blocks() * BLOCK_SIZE;
                    let delta = data_layer.replace_with_blob(ino, chunk, blob, birth)?;
                    data.item.nbytes = delta.apply_to(data.item.nbytes);
                    self.store_inode(ino, &mut data)?;
                    report.compressed += 1;
                    report.logical_bytes += len;
                    report.stored_bytes += stored;
                    let counters = self.inner.engine.counters();
                    counters.add(|c| &c.compress_chunks, 1);
                    counters.add(|c| &c.compress_logical_bytes, len);
                    counters.add(|c| &c.compress_stored_bytes, stored);
                }
                None => {
                    report.kept += 1;
                    self.inner.engine.counters().add(|c| &c.compress_kept, 1);
                }
            }
        }
    }

    /// Notes that `[lo, hi)` of `ino` was written, for the next compression pass
    /// ([`Filesystem::compress_written`]; only with `compress=`).
    pub(crate) fn note_written(&self, ino: u64, lo: u64, hi: u64) {
        let mut pending = self.inner.to_compress.lock();
        let range = pending.entry(ino).or_insert((lo, hi));
        range.0 = range.0.min(lo);
        range.1 = range.1.max(hi);
    }

    /// The compression pass of `compress=` (DESIGN §16.4, background compression): every
    /// range written since the last pass is rewritten compressed
    /// ([`Filesystem::compress_range`]: whole chunks in plain blocks only), so the commit that
    /// follows records blobs. Runs before the background committer's commits, `sync` and the
    /// final commit; the buffered data is flushed chunk by chunk under each file's lock.
    /// Errors are logged, never returned: the data is then committed as it was written.
    pub(crate) fn compress_written(&self) {
        let Some(codec) = self.inner.compress else {
            return;
        };
        if self.inner.engine.read_only_reason().is_some() || self.inner.engine.is_shut_down() {
            return;
        }
        let pending = std::mem::take(&mut *self.inner.to_compress.lock());
        for (ino, (lo, hi)) in pending {
            let len = hi.saturating_sub(lo).max(1);
            match self.compress_range(InodeNo::new(ino), codec, lo, len) {
                Ok(_) => {}
                // Deleted since, or a directory now at that number: nothing to compress.
                Err(Error::NotFound(_) | Error::IsDir(_) | Error::Invalid(_)) => {}
                Err(e) => log::warn!("compress inode {ino}: {e}"),
            }
        }
    }

    /// Whether `[from, to)` of `ino` is held whole by unshared regular extents: no hole, no
    /// preallocated, inline or blob extent, and nothing cloned (rewriting a shared extent
    /// would store its bytes twice).
    fn chunk_is_plain(&self, ino: u64, from: u64, to: u64) -> Result<bool> {
        let mut cursor = from;
        for (start, extent) in self.data().extents(ino, from, to)? {
            let plain = match extent.kind {
                ExtentKind::Regular { .. } => !extent.shared,
                ExtentKind::Inline(_) | ExtentKind::Prealloc { .. } | ExtentKind::Blob(_) => false,
            };
            if !plain || start > cursor {
                return Ok(false);
            }
            cursor = cursor.max(start + extent.len_bytes());
        }
        Ok(cursor >= to)
    }
}
