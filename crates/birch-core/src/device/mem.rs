//! A device in memory that keeps unflushed writes apart, so tests can cut power.
//!
//! Used by the core's tests, by the crash matrix of `birch-testkit` and `birch crashtest`
//! (which record its writes and flushes), and by the engine benchmark (`for_benchmarks`), so
//! it is part of the device layer rather than test-only code.

use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::{check_range, BlockDevice};
use crate::counters::Counters;

const BLOCK: usize = birch_format::BLOCK_SIZE as usize;

/// One recorded device event, for crash tests that rebuild states between flushes.
#[derive(Debug, Clone)]
pub enum Recorded {
    /// A write of `bytes` at byte `offset`, as the device received it (not yet durable).
    Write {
        /// Byte offset on the device.
        offset: u64,
        /// The bytes written, shared with the device's own copy.
        bytes: Arc<[u8]>,
    },
    /// A flush: every write recorded before it is durable.
    Flush,
}

struct State {
    durable: Vec<u8>,
    /// Unflushed blocks by block index, newest content: the write that carried the block
    /// and where in it the block starts (one shared copy per write, not one per block).
    pending: BTreeMap<u64, (Arc<[u8]>, usize)>,
    record: Option<Vec<Recorded>>,
    fail_writes: bool,
    /// Writes land in `durable` at once (a benchmark device: one copy per write, as a page
    /// cache makes, and nothing for `crash` to drop). Recording turns it off.
    write_through: bool,
    /// How long a flush takes to return after it made the writes before it durable (tests of
    /// group commit: a slow flush lets callers queue behind it, as on a disk).
    flush_delay: Duration,
}

/// A memory device. Writes stay pending until `flush`; `crash` drops what is pending.
pub struct MemDevice {
    state: Mutex<State>,
    size: u64,
    counters: Counters,
}

impl MemDevice {
    /// A zero-filled device of `size` bytes (rounded down to blocks).
    pub fn new(size: u64) -> MemDevice {
        let size = size - size % birch_format::BLOCK_SIZE;
        MemDevice::from_bytes(vec![0; size as usize])
    }

    /// A device for benchmarks: every page is written once now, so the kernel's zeroing of
    /// fresh memory is paid here and not inside whatever the caller times next, and writes
    /// land in place (one copy each, as a page cache takes them; `crash` keeps them all).
    pub fn for_benchmarks(size: u64) -> MemDevice {
        let size = size - size % birch_format::BLOCK_SIZE;
        let mut bytes = vec![0u8; size as usize];
        for page in bytes.chunks_mut(4096) {
            // The zeroed allocation leaves pages unmapped; one store per page maps each.
            page[0] = 0;
            std::hint::black_box(&mut page[0]);
        }
        let dev = MemDevice::from_bytes(bytes);
        dev.state.lock().write_through = true;
        dev
    }

    /// A device holding `bytes` as its durable content.
    pub fn from_bytes(bytes: Vec<u8>) -> MemDevice {
        let size = bytes.len() as u64;
        MemDevice {
            state: Mutex::new(State {
                durable: bytes,
                pending: BTreeMap::new(),
                record: None,
                fail_writes: false,
                write_through: false,
                flush_delay: Duration::ZERO,
            }),
            size,
            counters: Counters::default(),
        }
    }

    /// Simulates power loss: returns a new device with only the flushed content.
    pub fn crash(&self) -> MemDevice {
        MemDevice::from_bytes(self.state.lock().durable.clone())
    }

    /// The content as reads see it (flushed and pending).
    pub fn snapshot(&self) -> Vec<u8> {
        let state = self.state.lock();
        let mut bytes = state.durable.clone();
        for (block, (data, from)) in &state.pending {
            let at = *block as usize * BLOCK;
            bytes[at..at + BLOCK].copy_from_slice(&data[*from..*from + BLOCK]);
        }
        bytes
    }

    /// Starts recording every write and flush.
    pub fn start_recording(&self) {
        let mut state = self.state.lock();
        state.record = Some(Vec::new());
        state.write_through = false;
    }

    /// Takes the recording so far.
    pub fn take_recording(&self) -> Vec<Recorded> {
        self.state
            .lock()
            .record
            .replace(Vec::new())
            .unwrap_or_default()
    }

    /// Makes every later flush take `delay` to return. What it makes durable is decided when
    /// it is issued: writes completed during the delay stay pending, as on a disk.
    pub fn set_flush_delay(&self, delay: Duration) {
        self.state.lock().flush_delay = delay;
    }

    /// Makes every later write and flush fail with EIO (a dying disk).
    pub fn fail_writes(&self, fail: bool) {
        self.state.lock().fail_writes = fail;
    }

    /// Overwrites durable bytes directly (corruption tests).
    pub fn corrupt(&self, offset: u64, bytes: &[u8]) {
        let mut state = self.state.lock();
        let at = offset as usize;
        state.durable[at..at + bytes.len()].copy_from_slice(bytes);
        let first = offset / birch_format::BLOCK_SIZE;
        let last = (offset + bytes.len() as u64).div_ceil(birch_format::BLOCK_SIZE);
        for block in first..last {
            state.pending.remove(&block);
        }
    }
}

impl BlockDevice for MemDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_range(offset, buf.len(), self.size)?;
        let state = self.state.lock();
        let at = offset as usize;
        buf.copy_from_slice(&state.durable[at..at + buf.len()]);
        let first = offset / birch_format::BLOCK_SIZE;
        let count = (buf.len() / BLOCK) as u64;
        for (block, (data, from)) in state.pending.range(first..first + count) {
            let rel = (block - first) as usize * BLOCK;
            buf[rel..rel + BLOCK].copy_from_slice(&data[*from..*from + BLOCK]);
        }
        self.counters.add(|c| &c.device_reads, 1);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        check_range(offset, buf.len(), self.size)?;
        let mut state = self.state.lock();
        if state.fail_writes {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        let first = offset / birch_format::BLOCK_SIZE;
        if state.write_through {
            let at = offset as usize;
            state.durable[at..at + buf.len()].copy_from_slice(buf);
            self.counters.add(|c| &c.device_writes, 1);
            self.counters.add(|c| &c.bytes_written, buf.len() as u64);
            return Ok(());
        }
        let bytes: Arc<[u8]> = buf.into();
        for n in 0..buf.len() / BLOCK {
            state
                .pending
                .insert(first + n as u64, (bytes.clone(), n * BLOCK));
        }
        if let Some(record) = state.record.as_mut() {
            record.push(Recorded::Write { offset, bytes });
        }
        self.counters.add(|c| &c.device_writes, 1);
        self.counters.add(|c| &c.bytes_written, buf.len() as u64);
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        let mut state = self.state.lock();
        if state.fail_writes {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        let pending = std::mem::take(&mut state.pending);
        for (block, (data, from)) in pending {
            let at = block as usize * BLOCK;
            state.durable[at..at + BLOCK].copy_from_slice(&data[from..from + BLOCK]);
        }
        if let Some(record) = state.record.as_mut() {
            record.push(Recorded::Flush);
        }
        self.counters.add(|c| &c.flushes, 1);
        let delay = state.flush_delay;
        drop(state);
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        Ok(())
    }

    fn size_bytes(&self) -> u64 {
        self.size
    }

    fn counters(&self) -> &Counters {
        &self.counters
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crash_drops_unflushed_writes() {
        let dev = MemDevice::new(64 * 1024);
        dev.write_at(&[1; BLOCK], 0).expect("write");
        dev.flush().expect("flush");
        dev.write_at(&[2; BLOCK], 0).expect("write");
        dev.write_at(&[3; BLOCK], 4096).expect("write");
        let mut buf = vec![0; 2 * BLOCK];
        dev.read_at(&mut buf, 0).expect("read");
        assert_eq!((buf[0], buf[BLOCK]), (2, 3));
        let after = dev.crash();
        after.read_at(&mut buf, 0).expect("read");
        assert_eq!((buf[0], buf[BLOCK]), (1, 0));
    }

    #[test]
    fn a_benchmark_device_writes_in_place() {
        let dev = MemDevice::for_benchmarks(64 * 1024);
        dev.write_at(&[7; 2 * BLOCK], BLOCK as u64).expect("write");
        let mut buf = vec![0; 3 * BLOCK];
        dev.read_at(&mut buf, 0).expect("read");
        assert_eq!((buf[0], buf[BLOCK], buf[2 * BLOCK + 1]), (0, 7, 7));
        let after = dev.crash();
        after.read_at(&mut buf, 0).expect("read");
        assert_eq!((buf[0], buf[BLOCK], buf[2 * BLOCK + 1]), (0, 7, 7));
    }

    /// The default `read_many` reads each buffer, and one failed read fails the whole call
    /// with an error naming which read of the batch and where.
    #[test]
    fn read_many_reads_each_and_names_the_one_that_failed() {
        let dev = MemDevice::new(64 * 1024);
        dev.write_at(&[1; BLOCK], 0).expect("write");
        dev.write_at(&[2; BLOCK], 3 * BLOCK as u64).expect("write");
        let (mut a, mut b) = (vec![0u8; BLOCK], vec![0u8; 2 * BLOCK]);
        dev.read_many(&mut [(3 * BLOCK as u64, &mut a[..]), (0, &mut b[..])])
            .expect("read_many");
        assert_eq!((a[0], b[0], b[BLOCK]), (2, 1, 0));
        let reads = dev.counters().values().device_reads;
        assert_eq!(reads, 2, "one device read counted per entry");
        let mut c = vec![0u8; BLOCK];
        let err = dev
            .read_many(&mut [(0, &mut a[..]), (0, &mut b[..]), (64 * 1024, &mut c[..])])
            .expect_err("a read past the end fails the batch");
        let text = err.to_string();
        assert!(text.contains("read 3 of 3 at 0x10000"), "{text}");
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn unaligned_and_out_of_range_io_is_refused() {
        let dev = MemDevice::new(64 * 1024);
        assert!(dev.write_at(&[0; 100], 0).is_err());
        assert!(dev.write_at(&[0; BLOCK], 1).is_err());
        assert!(dev.write_at(&[0; BLOCK], 64 * 1024).is_err());
    }
}
