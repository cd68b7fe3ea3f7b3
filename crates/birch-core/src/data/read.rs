//! The read path of data blocks: the bytes of a file's extents read into a caller's buffer
//! ([`DataLayer::read_extents_into`], the one read for the live filesystem and snapshots),
//! several extents' blocks in one batch of device reads, and every block's crc32c verified
//! ([`verify_blocks`]) after the bytes only the fsync log holds yet are laid over it.
//!
//! Owns: reads of data blocks and their checksums, the per-thread read buffer ([`Scratch`]).
//! Must not touch: the extent map (the caller looks the extents up and passes them in), the
//! allocator, any write to the device, inodes and locks (the caller holds the inode's lock
//! for as long as the extents it read must stay valid).

use std::cell::RefCell;
use std::sync::Arc;

use birch_format::items::{Blob, ExtentKind, FileExtent};
use birch_format::BLOCK_SIZE;

use super::DataLayer;
use crate::error::{Error, Result};
use crate::pending::PendingData;

impl DataLayer<'_> {
    /// Copies the bytes of `extents` (inode `ino`'s, as [`DataLayer::extents`] or
    /// [`extents_in`] return them) that fall in `[offset, end)` into `out`, which covers that
    /// range and is zeroed by the caller (holes and preallocated extents read as zeros); data
    /// blocks are read and verified ([`DataLayer::read_verified`]). The one read of extents
    /// for the live filesystem and for snapshots. Does device I/O: one device read for one
    /// regular extent, else one [`BlockDevice::read_many`] of every extent's blocks (extents
    /// adjacent on disk read as one), in flight together where the device can (RBD).
    ///
    /// [`BlockDevice::read_many`]: crate::device::BlockDevice::read_many
    /// [`extents_in`]: super::extents_in
    pub(crate) fn read_extents_into(
        &self,
        ino: u64,
        extents: &[(u64, FileExtent)],
        offset: u64,
        end: u64,
        out: &mut [u8],
    ) -> Result<()> {
        let mut parts: Vec<ExtentPart<'_>> = Vec::new();
        for (start, extent) in extents {
            let start = *start;
            match &extent.kind {
                ExtentKind::Inline(bytes) => {
                    let from = offset.max(start);
                    let to = end.min(start + bytes.len() as u64);
                    if from < to {
                        out[(from - offset) as usize..(to - offset) as usize].copy_from_slice(
                            &bytes[(from - start) as usize..(to - start) as usize],
                        );
                    }
                }
                ExtentKind::Prealloc { .. } => {}
                // A window: the whole blob read, verified and decoded (or taken from the
                // cache), then the wanted bytes copied; its own device read.
                ExtentKind::Blob(blob) => {
                    let from = offset.max(start);
                    let to = end.min(start + extent.len_bytes());
                    if from < to {
                        let decoded = self.blob_bytes(ino, start, blob)?;
                        let skip = u64::from(blob.window_offset) + (from - start);
                        out[(from - offset) as usize..(to - offset) as usize].copy_from_slice(
                            &decoded[skip as usize..(skip + (to - from)) as usize],
                        );
                    }
                }
                ExtentKind::Regular { disk_addr, csums } => {
                    let ext_end = start + csums.len() as u64 * BLOCK_SIZE;
                    let from = offset.max(start);
                    let to = end.min(ext_end);
                    if from < to {
                        parts.push(ExtentPart {
                            start,
                            disk_addr: *disk_addr,
                            csums,
                            from,
                            to,
                        });
                    }
                }
            }
        }
        match parts.as_slice() {
            [] => Ok(()),
            [p] => {
                let part = &mut out[(p.from - offset) as usize..(p.to - offset) as usize];
                self.read_verified(ino, p, part)
            }
            _ => self.read_parts(ino, &parts, offset, out),
        }
    }

    /// The decoded bytes of `blob` (named by inode `ino`'s extent at file offset `start`):
    /// from the decoded-blob cache, else its stored blocks read in one request (with the
    /// bytes only the fsync log holds laid over them), each verified against its crc32c (a
    /// mismatch is [`Error::DataChecksum`] and counts in `checksum_errors`), then decoded into
    /// exactly its logical length (anything else is [`Error::DataChecksum`] naming the blob:
    /// the stored bytes passed their checksums but are no encoding of the blob). Does device
    /// I/O on a miss.
    fn blob_bytes(&self, ino: u64, start: u64, blob: &Blob) -> Result<Arc<[u8]>> {
        let cache = self.engine.blob_cache();
        if let Some(bytes) = cache.get(blob) {
            self.engine.counters().add(|c| &c.blob_cache_hits, 1);
            return Ok(bytes);
        }
        self.engine.counters().add(|c| &c.blob_reads, 1);
        let at = blob.disk_addr;
        let len = blob.stored_blocks() * BLOCK_SIZE;
        let mut buf = Scratch::take(len as usize);
        let placed = self.engine.pending().overlay(at, len);
        self.engine.device().read_at(&mut buf.0, at).map_err(|e| {
            Error::io(
                format!("read inode {ino} offset {start}: blob at {at:#x}"),
                e,
            )
        })?;
        PendingData::lay_over(at, &mut buf.0, &placed);
        for (n, (block, want)) in buf
            .0
            .chunks(BLOCK_SIZE as usize)
            .zip(&blob.csums)
            .enumerate()
        {
            let got = birch_format::checksum(block);
            if got != *want {
                let addr = at + n as u64 * BLOCK_SIZE;
                self.engine.counters().add(|c| &c.checksum_errors, 1);
                log::error!(
                    "inode {ino} offset {start} blob {at:#x} stored block {addr:#x}: data checksum {got:#010x}, expected {want:#010x}"
                );
                return Err(Error::DataChecksum(format!(
                    "inode {ino} offset {start} blob {at:#x} block {addr:#x}"
                )));
            }
        }
        let mut decoded = vec![0u8; blob.logical as usize];
        birch_format::codec::decode(
            blob.codec,
            &buf.0[..blob.encoded_len as usize],
            &mut decoded,
        )
        .map_err(|e| {
            log::error!("inode {ino} offset {start} blob {at:#x}: {e}");
            Error::DataChecksum(format!(
                "inode {ino} offset {start} blob {at:#x} does not decode: {e}"
            ))
        })?;
        let decoded: Arc<[u8]> = decoded.into();
        cache.insert(blob, decoded.clone());
        Ok(decoded)
    }

    /// Reads several extent parts of one request with one [`BlockDevice::read_many`] (parts
    /// adjacent on disk as one read), then verifies every block's checksum as
    /// [`DataLayer::read_verified`] does, and copies each part into `out` (which starts at file
    /// offset `offset`).
    ///
    /// [`BlockDevice::read_many`]: crate::device::BlockDevice::read_many
    fn read_parts(
        &self,
        ino: u64,
        parts: &[ExtentPart<'_>],
        offset: u64,
        out: &mut [u8],
    ) -> Result<()> {
        // Each part's blocks: (first block index in the extent, disk address, bytes), laid
        // one after the other in one buffer.
        let spans: Vec<(u64, u64, usize)> = parts
            .iter()
            .map(|p| {
                let first_block = (p.from - p.start) / BLOCK_SIZE;
                let last_block = (p.to - 1 - p.start) / BLOCK_SIZE;
                let at = p.disk_addr + first_block * BLOCK_SIZE;
                (
                    first_block,
                    at,
                    ((last_block - first_block + 1) * BLOCK_SIZE) as usize,
                )
            })
            .collect();
        let total: usize = spans.iter().map(|(_, _, len)| len).sum();
        let mut buf = Scratch::take(total);
        // Blocks whose bytes only the log holds yet: taken before the device read (a block
        // not placed now was written in place before it left).
        let placed: Vec<Vec<(u64, Arc<[u8]>)>> = spans
            .iter()
            .map(|(_, at, len)| self.engine.pending().overlay(*at, *len as u64))
            .collect();
        // Device reads: a span that continues the previous one on disk extends its read.
        let mut reads: Vec<(u64, usize)> = Vec::with_capacity(spans.len());
        for (_, at, len) in &spans {
            match reads.last_mut() {
                Some((prev, prev_len)) if *prev + *prev_len as u64 == *at => *prev_len += len,
                _ => reads.push((*at, *len)),
            }
        }
        {
            let mut rest: &mut [u8] = &mut buf.0;
            let mut batch: Vec<(u64, &mut [u8])> = Vec::with_capacity(reads.len());
            for (at, len) in &reads {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(*len);
                batch.push((*at, head));
                rest = tail;
            }
            let (first, last) = (parts[0].from, parts[parts.len() - 1].to);
            self.engine.device().read_many(&mut batch).map_err(|e| {
                Error::io(
                    format!(
                        "read inode {ino} offsets {first}..{last}: {} extents in {} device reads",
                        parts.len(),
                        reads.len()
                    ),
                    e,
                )
            })?;
        }
        let mut at_buf = 0usize;
        for ((p, (first_block, at, len)), placed) in parts.iter().zip(&spans).zip(&placed) {
            let span = &mut buf.0[at_buf..at_buf + len];
            at_buf += len;
            PendingData::lay_over(*at, span, placed);
            verify_blocks(ino, p.start, *first_block, *at, p.csums, span)
                .inspect_err(|_| self.engine.counters().add(|c| &c.checksum_errors, 1))?;
            let buf_start = p.start + first_block * BLOCK_SIZE;
            out[(p.from - offset) as usize..(p.to - offset) as usize]
                .copy_from_slice(&span[(p.from - buf_start) as usize..(p.to - buf_start) as usize]);
        }
        Ok(())
    }

    /// Reads bytes `[from, to)` of the file from the regular extent at file offset `start`
    /// (`disk_addr`, `csums`) into `out` (exactly `to - from` bytes), verifying the checksum of
    /// every block it reads. A mismatch is [`Error::DataChecksum`] naming the inode, the file
    /// offset and the block. Does device I/O.
    pub(crate) fn read_verified(
        &self,
        ino: u64,
        part: &ExtentPart<'_>,
        out: &mut [u8],
    ) -> Result<()> {
        let ExtentPart {
            start,
            disk_addr,
            csums,
            from,
            to,
        } = *part;
        debug_assert!(start <= from && from < to && to <= start + csums.len() as u64 * BLOCK_SIZE);
        debug_assert_eq!(out.len() as u64, to - from);
        let first_block = (from - start) / BLOCK_SIZE;
        let last_block = (to - 1 - start) / BLOCK_SIZE;
        let nblocks = last_block - first_block + 1;
        let at = disk_addr + first_block * BLOCK_SIZE;
        let mut buf = Scratch::take((nblocks * BLOCK_SIZE) as usize);
        // Blocks whose bytes only the log holds yet: taken before the device read (a block
        // not placed now was written in place before it left).
        let placed = self.engine.pending().overlay(at, nblocks * BLOCK_SIZE);
        self.engine
            .device()
            .read_at(&mut buf.0, at)
            .map_err(|e| Error::io(format!("read inode {ino} offset {from} block {at:#x}"), e))?;
        PendingData::lay_over(at, &mut buf.0, &placed);
        verify_blocks(ino, start, first_block, at, csums, &buf.0)
            .inspect_err(|_| self.engine.counters().add(|c| &c.checksum_errors, 1))?;
        let buf_start = start + first_block * BLOCK_SIZE;
        out.copy_from_slice(&buf.0[(from - buf_start) as usize..(to - buf_start) as usize]);
        Ok(())
    }
}

/// The part `[from, to)` of a regular extent at file offset `start` that one read covers.
#[derive(Clone, Copy)]
pub(crate) struct ExtentPart<'a> {
    /// File offset of the regular extent.
    pub(crate) start: u64,
    /// Its disk address.
    pub(crate) disk_addr: u64,
    /// The crc32c of each of its blocks.
    pub(crate) csums: &'a [u32],
    /// The bytes `[from, to)` of the file wanted from it.
    pub(crate) from: u64,
    pub(crate) to: u64,
}

/// Verifies the checksum of every block of `buf`, blocks `first_block..` of the regular
/// extent at file offset `start` (`csums`), read from disk address `at`. A mismatch is
/// [`Error::DataChecksum`] naming the inode, the file offset and the block.
fn verify_blocks(
    ino: u64,
    start: u64,
    first_block: u64,
    at: u64,
    csums: &[u32],
    buf: &[u8],
) -> Result<()> {
    for (n, block) in buf.chunks(BLOCK_SIZE as usize).enumerate() {
        let index = first_block + n as u64;
        let want = csums.get(index as usize).copied();
        let got = birch_format::checksum(block);
        if want != Some(got) {
            let addr = at + n as u64 * BLOCK_SIZE;
            let offset = start + index * BLOCK_SIZE;
            let want = want.unwrap_or_default();
            log::error!(
                "inode {ino} offset {offset} block {addr:#x}: data checksum {got:#010x}, expected {want:#010x}"
            );
            return Err(Error::DataChecksum(format!(
                "inode {ino} offset {offset} block {addr:#x}"
            )));
        }
    }
    Ok(())
}

/// A per-thread buffer of `len` bytes for a device read, reused so a read does not fault in
/// and zero fresh pages each time (kept only up to [`Scratch::KEEP`] bytes). The read
/// overwrites all of it; it is zeroed on take only where it grew.
struct Scratch(Vec<u8>);

impl Scratch {
    const KEEP: usize = 4 << 20;

    thread_local! {
        static SPARE: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    }

    fn take(len: usize) -> Scratch {
        let mut v = Self::SPARE.with(|s| std::mem::take(&mut *s.borrow_mut()));
        v.resize(len, 0);
        Scratch(v)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if self.0.capacity() <= Self::KEEP {
            let v = std::mem::take(&mut self.0);
            Self::SPARE.with(|s| *s.borrow_mut() = v);
        }
    }
}

#[cfg(test)]
mod tests {
    //! Reads over an engine on a memory device: a written run reads back verified (whole, and a
    //! part of a block), and a corrupted block fails its read naming the block.

    use birch_format::codec::Codec;

    use super::*;
    use crate::data::test_support::{pattern, read_back, setup, INO};
    use crate::data::BlockDelta;

    #[test]
    fn written_blocks_read_back_verified() {
        let (_mem, engine) = setup();
        let data = DataLayer::new(&engine);
        let bytes = pattern(3, 7);
        let runs = data.write_new(INO, 0, &bytes).expect("write");
        assert_eq!(runs.iter().map(|r| r.csums.len()).sum::<usize>(), 3);
        assert_eq!(read_back(&data, &runs).expect("read"), bytes);
        // A part of a block, in the middle of the run.
        let run = &runs[0];
        let mut part = vec![0u8; 100];
        let wanted = ExtentPart {
            start: 0,
            disk_addr: run.addr,
            csums: &run.csums,
            from: 5000,
            to: 5100,
        };
        data.read_verified(INO, &wanted, &mut part)
            .expect("read part");
        assert_eq!(part, bytes[5000..5100]);
        // Recorded and looked up through the extent map.
        let (delta, _) = data
            .replace_range(INO, 0, bytes.len() as u64, runs, false)
            .expect("record");
        assert_eq!(delta, BlockDelta { added: 3, freed: 0 });
        let extents = data.extents(INO, 0, 3 * BLOCK_SIZE).expect("extents");
        assert_eq!(extents.len(), 1);
        assert_eq!(extents[0].1.len_bytes(), 3 * BLOCK_SIZE);
    }

    /// A blob written as `stored` (whole blocks holding the encoding of `logical`): the item
    /// names its run with the window `[wstart, wstart + wlen)` blocks.
    fn blob_of(data: &DataLayer<'_>, codec: Codec, logical: &[u8], window: (u32, u32)) -> Blob {
        let mut stored = Vec::new();
        let n = birch_format::codec::encode(codec, logical, &mut stored).expect("compresses");
        stored.resize(n.div_ceil(BLOCK_SIZE as usize) * BLOCK_SIZE as usize, 0);
        let runs = data.write_new(INO, 0, &stored).expect("write");
        assert_eq!(runs.len(), 1);
        Blob {
            disk_addr: runs[0].addr,
            codec: Codec::from_byte(codec.byte()).expect("byte"),
            encoded_len: n as u32,
            logical: logical.len() as u32,
            window_offset: window.0 * BLOCK_SIZE as u32,
            window_len: window.1 * BLOCK_SIZE as u32,
            nonce: 0,
            csums: runs[0].csums.clone(),
        }
    }

    /// Half stamped, half text: compressible, never a constant fill.
    fn logical_bytes(blocks: usize) -> Vec<u8> {
        let mut out = pattern(blocks as u64, 9);
        for (i, b) in out.iter_mut().enumerate() {
            if i % 2 == 1 {
                *b = b"window"[(i / 2) % 6];
            }
        }
        out
    }

    /// A read across a regular extent and two blob windows returns each window's decoded
    /// bytes at its file offset (zstd and lz4), holes as zeros; the blob is read and decoded
    /// once (the cache serves the second read even after its blocks change on disk).
    #[test]
    fn blob_windows_read_back_decoded() {
        let bs = BLOCK_SIZE as usize;
        for codec in [Codec::Zstd(1), Codec::Lz4] {
            let (mem, engine) = setup();
            let data = DataLayer::new(&engine);
            let logical = logical_bytes(16);
            let blob = blob_of(&data, codec, &logical, (3, 5));
            let regular = data.write_new(INO, 0, &pattern(2, 4)).expect("write");
            let extents = vec![
                (
                    0,
                    FileExtent {
                        generation: 1,
                        kind: ExtentKind::Regular {
                            disk_addr: regular[0].addr,
                            csums: regular[0].csums.clone(),
                        },
                        shared: false,
                    },
                ),
                (
                    4 * BLOCK_SIZE,
                    FileExtent {
                        generation: 1,
                        kind: ExtentKind::Blob(blob.clone()),
                        shared: false,
                    },
                ),
                (
                    9 * BLOCK_SIZE,
                    FileExtent {
                        generation: 1,
                        kind: ExtentKind::Blob(blob.narrowed(4 * BLOCK_SIZE, BLOCK_SIZE)),
                        shared: true,
                    },
                ),
            ];
            let end = 10 * BLOCK_SIZE;
            let mut out = vec![0u8; end as usize];
            data.read_extents_into(INO, &extents, 0, end, &mut out)
                .expect("read");
            let mut want = vec![0u8; end as usize];
            want[..2 * bs].copy_from_slice(&pattern(2, 4));
            want[4 * bs..9 * bs].copy_from_slice(&logical[3 * bs..8 * bs]);
            want[9 * bs..10 * bs].copy_from_slice(&logical[7 * bs..8 * bs]);
            assert!(out == want, "{codec:?}");
            // A part of a window, from the middle of a block.
            let mut part = vec![0u8; 5000];
            let from = 5 * BLOCK_SIZE + 100;
            data.read_extents_into(INO, &extents[1..2], from, from + 5000, &mut part)
                .expect("part");
            assert!(part == want[from as usize..from as usize + 5000]);
            assert_eq!(engine.blob_cache().len(), 1, "one blob, decoded once");
            mem.corrupt(blob.disk_addr + 10, &[0xff; 4]);
            data.read_extents_into(INO, &extents[1..2], from, from + 5000, &mut part)
                .expect("served by the cache");
        }
    }

    /// A damaged stored block fails the read naming the blob and counts a checksum error;
    /// stored bytes that pass their checksums but do not decode to the logical length fail too.
    #[test]
    fn a_bad_blob_fails_its_read() {
        let (mem, engine) = setup();
        let data = DataLayer::new(&engine);
        let logical = logical_bytes(8);
        let blob = blob_of(&data, Codec::Lz4, &logical, (0, 8));
        let extent = |blob: Blob| {
            vec![(
                0,
                FileExtent {
                    generation: 1,
                    kind: ExtentKind::Blob(blob),
                    shared: false,
                },
            )]
        };
        mem.corrupt(blob.disk_addr + 17, &[0xff, 0x00, 0xaa]);
        let mut out = vec![0u8; 4096];
        let before = engine.counters().values().checksum_errors;
        match data.read_extents_into(INO, &extent(blob.clone()), 0, 4096, &mut out) {
            Err(Error::DataChecksum(what)) => {
                assert!(
                    what.contains(&format!("blob {:#x}", blob.disk_addr)),
                    "{what}"
                )
            }
            other => panic!("expected a checksum error, got {other:?}"),
        }
        assert_eq!(engine.counters().values().checksum_errors, before + 1);
        // Claims 2 more logical blocks than the encoding holds: passes its checksums (a fresh
        // blob), fails to decode.
        let fresh = blob_of(&data, Codec::Lz4, &logical, (0, 8));
        let longer = Blob {
            logical: fresh.logical + 2 * BLOCK_SIZE as u32,
            ..fresh
        };
        match data.read_extents_into(INO, &extent(longer), 0, 4096, &mut out) {
            Err(Error::DataChecksum(what)) => assert!(what.contains("does not decode"), "{what}"),
            other => panic!("expected a decode error, got {other:?}"),
        }
    }

    /// Encoded garbage under valid checksums (each byte of the stored stream changed in turn,
    /// the item's crc32c made to match): every read is an error or bytes of the right length,
    /// never a panic or an allocation sized by the input.
    #[test]
    fn encoded_garbage_under_valid_checksums_never_panics() {
        use crate::device::BlockDevice;
        let bs = BLOCK_SIZE as usize;
        for codec in [Codec::Zstd(1), Codec::Lz4] {
            let (mem, engine) = setup();
            let data = DataLayer::new(&engine);
            let logical = logical_bytes(8);
            let blob = blob_of(&data, codec, &logical, (1, 6));
            let mut stored = vec![0u8; blob.csums.len() * bs];
            mem.read_at(&mut stored, blob.disk_addr).expect("read");
            let (mut errors, mut reads) = (0, 0);
            for at in (0..blob.encoded_len as usize).step_by(3) {
                let mut bad = stored.clone();
                bad[at] ^= 0x5a ^ (at as u8);
                mem.write_at(&bad, blob.disk_addr).expect("write");
                let lying = Blob {
                    csums: bad.chunks(bs).map(birch_format::checksum).collect(),
                    ..blob.clone()
                };
                let extent = vec![(
                    0,
                    FileExtent {
                        generation: 1,
                        kind: ExtentKind::Blob(lying),
                        shared: false,
                    },
                )];
                let mut out = vec![0u8; 6 * bs];
                match data.read_extents_into(INO, &extent, 0, 6 * BLOCK_SIZE, &mut out) {
                    Ok(()) => reads += 1,
                    Err(Error::DataChecksum(_)) => errors += 1,
                    Err(other) => panic!("{codec:?} byte {at}: {other:?}"),
                }
            }
            assert!(
                errors > 0,
                "{codec:?}: some garbage must fail to decode ({reads} read)"
            );
        }
    }

    #[test]
    fn corrupted_block_fails_naming_the_block() {
        let (mem, engine) = setup();
        let data = DataLayer::new(&engine);
        let runs = data.write_new(INO, 0, &pattern(2, 1)).expect("write");
        let bad = runs[0].addr + BLOCK_SIZE;
        mem.corrupt(bad + 17, &[0xff, 0x00, 0xaa]);
        match read_back(&data, &runs) {
            Err(Error::DataChecksum(what)) => {
                assert!(what.contains(&format!("block {bad:#x}")), "{what}");
                assert!(
                    what.contains(&format!("inode {INO} offset {BLOCK_SIZE}")),
                    "{what}"
                );
            }
            other => panic!("expected a data checksum error, got {other:?}"),
        }
    }
}
