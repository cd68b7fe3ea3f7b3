//! A copy-on-write overlay over another device: reads fall through to the base, writes stay
//! in memory.
//!
//! Owns: the overlay's changed blocks. Must not touch: the base device, which it only reads,
//! so `fsck` can replay a pending fsync log over a read-only image, and the crash matrix
//! (`birch-testkit`) can build each crash state from a shared base image without copying it.

use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;

use parking_lot::RwLock;

use super::{check_range, BlockDevice};
use crate::counters::Counters;

const BLOCK: usize = birch_format::BLOCK_SIZE as usize;

/// Reads `base` and whatever was written over it; never writes to `base`.
pub struct OverlayDevice {
    base: Arc<dyn BlockDevice>,
    blocks: RwLock<BTreeMap<u64, Box<[u8]>>>,
    counters: Counters,
}

impl OverlayDevice {
    /// An empty overlay over `base`: it reads exactly like `base` until written. Does no I/O.
    pub fn new(base: Arc<dyn BlockDevice>) -> OverlayDevice {
        OverlayDevice {
            base,
            blocks: RwLock::new(BTreeMap::new()),
            counters: Counters::default(),
        }
    }

    /// Writes `bytes` at any byte `offset` (a torn write ends mid-block): the blocks touched
    /// are read, patched and stored.
    pub fn patch(&self, offset: u64, bytes: &[u8]) -> io::Result<()> {
        let block = BLOCK as u64;
        let first = offset / block;
        let end = offset + bytes.len() as u64;
        let last = end.div_ceil(block);
        let mut buf = vec![0u8; ((last - first) * block) as usize];
        self.read_at(&mut buf, first * block)?;
        let rel = (offset - first * block) as usize;
        buf[rel..rel + bytes.len()].copy_from_slice(bytes);
        self.write_at(&buf, first * block)
    }

    /// Number of blocks held in memory.
    pub fn changed_blocks(&self) -> usize {
        self.blocks.read().len()
    }
}

impl BlockDevice for OverlayDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_range(offset, buf.len(), self.size_bytes())?;
        let first = offset / BLOCK as u64;
        let count = (buf.len() / BLOCK) as u64;
        let blocks = self.blocks.read();
        let overlaid = blocks.range(first..first + count).count() as u64;
        if overlaid < count {
            self.base.read_at(buf, offset)?;
        }
        for (b, data) in blocks.range(first..first + count) {
            let rel = (b - first) as usize * BLOCK;
            buf[rel..rel + BLOCK].copy_from_slice(data);
        }
        self.counters.add(|c| &c.device_reads, 1);
        Ok(())
    }

    fn read_many(&self, reads: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        for (offset, buf) in reads.iter() {
            check_range(*offset, buf.len(), self.size_bytes())?;
        }
        let blocks = self.blocks.read();
        let overlaid = |offset: u64, len: usize| {
            let first = offset / BLOCK as u64;
            let count = (len / BLOCK) as u64;
            (
                first,
                count,
                blocks.range(first..first + count).count() as u64,
            )
        };
        // The reads the overlay does not cover whole go to the base as one batch (in flight
        // together where the base can).
        let mut from_base: Vec<(u64, &mut [u8])> = reads
            .iter_mut()
            .filter(|(offset, buf)| {
                let (_, count, held) = overlaid(*offset, buf.len());
                held < count
            })
            .map(|(offset, buf)| (*offset, &mut **buf))
            .collect();
        if !from_base.is_empty() {
            self.base.read_many(&mut from_base)?;
        }
        drop(from_base);
        for (offset, buf) in reads.iter_mut() {
            let (first, count, _) = overlaid(*offset, buf.len());
            for (b, data) in blocks.range(first..first + count) {
                let rel = (b - first) as usize * BLOCK;
                buf[rel..rel + BLOCK].copy_from_slice(data);
            }
        }
        self.counters.add(|c| &c.device_reads, reads.len() as u64);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        check_range(offset, buf.len(), self.size_bytes())?;
        let first = offset / BLOCK as u64;
        let mut blocks = self.blocks.write();
        for (n, chunk) in buf.chunks(BLOCK).enumerate() {
            blocks.insert(first + n as u64, chunk.into());
        }
        self.counters.add(|c| &c.device_writes, 1);
        self.counters.add(|c| &c.bytes_written, buf.len() as u64);
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        self.counters.add(|c| &c.flushes, 1);
        Ok(())
    }

    fn size_bytes(&self) -> u64 {
        self.base.size_bytes()
    }

    fn atomic_unit(&self) -> u64 {
        self.base.atomic_unit()
    }

    fn write_error_is_fatal(&self) -> bool {
        self.base.write_error_is_fatal()
    }

    fn counters(&self) -> &Counters {
        &self.counters
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::MemDevice;

    #[test]
    fn writes_stay_in_the_overlay_and_patches_may_be_torn() {
        let base = Arc::new(MemDevice::new(64 * 1024));
        base.write_at(&[1u8; BLOCK * 2], 0).expect("base write");
        base.flush().expect("flush");
        let overlay = OverlayDevice::new(base.clone());
        overlay
            .write_at(&[2u8; BLOCK], BLOCK as u64)
            .expect("write");
        overlay.patch(100, &[3u8; 512]).expect("torn patch");
        let mut got = vec![0u8; BLOCK * 2];
        overlay.read_at(&mut got, 0).expect("read");
        assert!(got[..100].iter().all(|&b| b == 1));
        assert!(got[100..612].iter().all(|&b| b == 3));
        assert!(got[612..BLOCK].iter().all(|&b| b == 1));
        assert!(got[BLOCK..].iter().all(|&b| b == 2));
        let mut base_view = vec![0u8; BLOCK * 2];
        base.read_at(&mut base_view, 0).expect("base read");
        assert!(
            base_view.iter().all(|&b| b == 1),
            "the base is never written"
        );
        assert_eq!(overlay.changed_blocks(), 2);
        // A batch: one read wholly in the overlay, one partly, one from the base only.
        let (mut a, mut b, mut c) = (vec![0u8; BLOCK], vec![0u8; 2 * BLOCK], vec![0u8; BLOCK]);
        overlay
            .read_many(&mut [
                (BLOCK as u64, &mut a[..]),
                (0, &mut b[..]),
                (2 * BLOCK as u64, &mut c[..]),
            ])
            .expect("read_many");
        assert!(a.iter().all(|&x| x == 2));
        assert_eq!(b[..BLOCK], got[..BLOCK]);
        assert!(b[BLOCK..].iter().all(|&x| x == 2));
        assert!(c.iter().all(|&x| x == 0));
    }
}
