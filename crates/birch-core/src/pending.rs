//! Data blocks placed but not yet written in place: the blocks of a small synchronous write
//! whose bytes went to the fsync log in a data record (DESIGN §11.1, FORMAT.md §8.2).
//!
//! Owns: the bytes of each such block by disk address until a commit writes them
//! ([`PendingData::write_out`], called by the engine's commit before it flushes the commit's
//! nodes, so no superblock ever names a block whose bytes are only here), and answering reads
//! of them meanwhile ([`PendingData::overlay`]). A block leaves when it is written or freed.
//! Must not touch: extents, checksums, the log, the allocator. The bytes of an address are
//! fixed while it is placed (copy-on-write never rewrites an allocated block), so a block is
//! written at most once and a read may take a copy at any time.

use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use birch_format::BLOCK_SIZE;
use parking_lot::Mutex;

use birch_format::items::{ExtentKind, FileExtent};
use birch_format::log::LogRecord;
use birch_format::ItemType;

use crate::device::BlockDevice;

/// A placed block's 4 KiB, and whether a data record carrying them was queued in the fsync
/// log ([`PendingData::mark_logged`]).
type Placed = (Arc<[u8]>, bool);

/// The placed blocks of one filesystem.
#[derive(Default)]
pub(crate) struct PendingData {
    /// Block address → the block as placed.
    blocks: Mutex<BTreeMap<u64, Placed>>,
    /// How many blocks are placed: reads skip the map while it is 0.
    count: AtomicUsize,
}

impl PendingData {
    /// Places `bytes` (whole blocks) at disk byte `addr`.
    pub(crate) fn place(&self, addr: u64, bytes: &[u8]) {
        debug_assert!(addr % BLOCK_SIZE == 0 && bytes.len() as u64 % BLOCK_SIZE == 0);
        let mut blocks = self.blocks.lock();
        for (n, block) in bytes.chunks(BLOCK_SIZE as usize).enumerate() {
            let at = addr + n as u64 * BLOCK_SIZE;
            if blocks.insert(at, (Arc::from(block), false)).is_none() {
                self.count.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    /// Notes that a data record carrying the placed blocks in `[addr, addr + len)` is queued
    /// in the fsync log: [`PendingData::write_range`] leaves them placed.
    pub(crate) fn mark_logged(&self, addr: u64, len: u64) {
        for (_, (_, logged)) in self.blocks.lock().range_mut(addr..addr + len) {
            *logged = true;
        }
    }

    /// Forgets the placed blocks in `[addr, addr + len)` (freed, or written by their owner).
    /// Returns how many were placed.
    pub(crate) fn forget(&self, addr: u64, len: u64) -> usize {
        if self.count.load(Ordering::SeqCst) == 0 {
            return 0;
        }
        let mut blocks = self.blocks.lock();
        let gone: Vec<u64> = blocks.range(addr..addr + len).map(|(a, _)| *a).collect();
        for at in &gone {
            blocks.remove(at);
            self.count.fetch_sub(1, Ordering::SeqCst);
        }
        gone.len()
    }

    /// Forgets the placed blocks in `[addr, addr + len)` whose bytes a queued data record
    /// carries ([`PendingData::mark_logged`]): freed, they need no write in place, as the log
    /// has their bytes for any batch naming them. The others stay: an extent record naming
    /// them may sit in the log's queue or in a batch a leader has taken and not yet written,
    /// and that leader must still find them (`write_named_with`). Returns how many it forgot.
    pub(crate) fn forget_logged(&self, addr: u64, len: u64) -> usize {
        if self.count.load(Ordering::SeqCst) == 0 {
            return 0;
        }
        let mut blocks = self.blocks.lock();
        let gone: Vec<u64> = blocks
            .range(addr..addr + len)
            .filter(|(_, (_, logged))| *logged)
            .map(|(a, _)| *a)
            .collect();
        for at in &gone {
            blocks.remove(at);
            self.count.fetch_sub(1, Ordering::SeqCst);
        }
        gone.len()
    }

    /// The placed blocks in `[addr, addr + len)`, to lay over a device read of that range
    /// ([`PendingData::lay_over`]). Take them before the device read: a block that is not
    /// placed then was written in place before it left.
    pub(crate) fn overlay(&self, addr: u64, len: u64) -> Vec<(u64, Arc<[u8]>)> {
        if self.count.load(Ordering::SeqCst) == 0 {
            return Vec::new();
        }
        self.blocks
            .lock()
            .range(addr..addr + len)
            .map(|(a, (b, _))| (*a, b.clone()))
            .collect()
    }

    /// Copies `over` (from [`PendingData::overlay`]) into `buf`, the bytes read at `addr`.
    pub(crate) fn lay_over(addr: u64, buf: &mut [u8], over: &[(u64, Arc<[u8]>)]) {
        for (at, block) in over {
            let from = (at - addr) as usize;
            if let Some(dst) = buf.get_mut(from..from + block.len()) {
                dst.copy_from_slice(block);
            }
        }
    }

    /// Writes every block placed now in place (contiguous blocks in one write each), then
    /// forgets them. Blocks placed meanwhile stay for the next call. No lock is held during
    /// the writes. Not durable until the caller's flush.
    pub(crate) fn write_out(&self, device: &dyn BlockDevice) -> io::Result<u64> {
        if self.count.load(Ordering::SeqCst) == 0 {
            return Ok(0);
        }
        let taken: Vec<(u64, Arc<[u8]>)> = self
            .blocks
            .lock()
            .iter()
            .map(|(a, (b, _))| (*a, b.clone()))
            .collect();
        self.write_taken(device, &taken, None)
    }

    /// Writes in place, in one [`BlockDevice::write_many`] together with `batch` (the log
    /// batch naming them, `(device offset, bytes)`), the placed blocks that the regular
    /// extent records among `records` name and that no queued data record carries, and
    /// forgets them; returns the bytes of placed blocks written. What the log's leader does
    /// for a batch of `records`: one round trip for the batch and its data, then the flush.
    /// Another writer of the same blocks (a commit) writes the same bytes.
    pub(crate) fn write_named_with(
        &self,
        device: &dyn BlockDevice,
        records: &[LogRecord],
        batch: (u64, &[u8]),
    ) -> io::Result<u64> {
        let taken = self.named(records);
        self.write_taken(device, &taken, Some(batch))
    }

    /// The placed blocks, not carried by a queued data record, that the regular and blob
    /// extent records among `records` name, in address order with their bytes.
    fn named(&self, records: &[LogRecord]) -> Vec<(u64, Arc<[u8]>)> {
        if self.count.load(Ordering::SeqCst) == 0 {
            return Vec::new();
        }
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for r in records {
            let (Some(ItemType::ExtentData), Some(value)) = (r.key.kind(), &r.value) else {
                continue;
            };
            let Ok(extent) = FileExtent::decode(value) else {
                continue;
            };
            // Blocks whose bytes a placed write holds: a regular extent's, a blob's stored
            // run (a compressed flush places them as the bytes a read verifies).
            match extent.kind {
                ExtentKind::Regular { disk_addr, csums } => {
                    ranges.push((disk_addr, csums.len() as u64 * BLOCK_SIZE));
                }
                ExtentKind::Blob(blob) => {
                    ranges.push((blob.disk_addr, blob.stored_blocks() * BLOCK_SIZE));
                }
                ExtentKind::Inline(_) | ExtentKind::Prealloc { .. } => {}
            }
        }
        if ranges.is_empty() {
            return Vec::new();
        }
        let mut taken: BTreeMap<u64, Arc<[u8]>> = BTreeMap::new();
        let blocks = self.blocks.lock();
        for (addr, len) in ranges {
            for (at, (block, logged)) in blocks.range(addr..addr + len) {
                if !logged {
                    taken.insert(*at, block.clone());
                }
            }
        }
        taken.into_iter().collect()
    }

    /// Writes `taken` (placed blocks in address order, each with the bytes it had when
    /// taken) in runs of consecutive blocks (at most 1 MiB each), all in one
    /// [`BlockDevice::write_many`] with `extra` if given (a log batch, outside the data area),
    /// then forgets each block that still holds those bytes: an address freed and placed
    /// again since (after a durable commit) keeps its new bytes. Returns the bytes of placed
    /// blocks written.
    fn write_taken(
        &self,
        device: &dyn BlockDevice,
        taken: &[(u64, Arc<[u8]>)],
        extra: Option<(u64, &[u8])>,
    ) -> io::Result<u64> {
        let mut runs: Vec<(u64, Vec<u8>)> = Vec::new();
        for (at, block) in taken {
            match runs.last_mut() {
                Some((start, bytes))
                    if *start + bytes.len() as u64 == *at && bytes.len() < 1 << 20 =>
                {
                    bytes.extend_from_slice(block)
                }
                _ => runs.push((*at, block.to_vec())),
            }
        }
        let mut writes: Vec<(u64, &[u8])> = runs.iter().map(|(a, b)| (*a, b.as_slice())).collect();
        writes.extend(extra);
        if writes.is_empty() {
            return Ok(0);
        }
        device.write_many(&writes)?;
        if taken.is_empty() {
            return Ok(0);
        }
        let mut blocks = self.blocks.lock();
        for (at, block) in taken {
            if blocks.get(at).is_some_and(|(b, _)| Arc::ptr_eq(b, block)) {
                blocks.remove(at);
                self.count.fetch_sub(1, Ordering::SeqCst);
            }
        }
        Ok(taken.len() as u64 * BLOCK_SIZE)
    }

    /// Blocks placed now.
    pub(crate) fn blocks(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::MemDevice;

    const B: u64 = BLOCK_SIZE;

    #[test]
    fn placed_blocks_are_read_until_written_and_written_in_runs() -> io::Result<()> {
        let dev = MemDevice::new(64 * B);
        let pending = PendingData::default();
        pending.place(4 * B, &[1u8; 2 * B as usize]);
        pending.place(9 * B, &[3u8; B as usize]);
        assert_eq!(pending.blocks(), 3);
        // A read over blocks 3..=5: block 3 from the device, 4 and 5 placed.
        let over = pending.overlay(3 * B, 3 * B);
        let mut buf = vec![0u8; 3 * B as usize];
        dev.read_at(&mut buf, 3 * B)?;
        PendingData::lay_over(3 * B, &mut buf, &over);
        assert!(buf[..B as usize].iter().all(|&b| b == 0));
        assert!(buf[B as usize..].iter().all(|&b| b == 1));
        // Freed: block 9 is never written.
        pending.forget(9 * B, B);
        let before = dev.counters().values().device_writes;
        assert_eq!(pending.write_out(&dev)?, 2 * B);
        assert_eq!(
            dev.counters().values().device_writes - before,
            1,
            "one write per run"
        );
        assert_eq!(pending.blocks(), 0);
        assert!(pending.overlay(0, 64 * B).is_empty());
        let mut back = vec![0u8; 2 * B as usize];
        dev.read_at(&mut back, 4 * B)?;
        assert!(back.iter().all(|&b| b == 1));
        let mut nine = vec![9u8; B as usize];
        dev.read_at(&mut nine, 9 * B)?;
        assert!(
            nine.iter().all(|&b| b == 0),
            "a forgotten block is not written"
        );
        Ok(())
    }
}
