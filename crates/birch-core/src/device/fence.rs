//! The shutdown fence: a device that passes I/O to another until it is shut down, and fails
//! every I/O with `EIO` after.
//!
//! Owns: the shut-down flag of one open filesystem and the wait for I/O in flight when it is
//! set, and the count of the errors the device returned ([`DeviceErrors`], for `birch stats`).
//! Must not touch: what is written; it decides nothing but "before" or "after".
//!
//! The engine reaches its device only through its fence, so once [`Fence::shut_down`] returns
//! nothing more reaches the image: each write or flush either completed before (as before a
//! power cut) or fails. Reads fail too: a shut-down filesystem answers nothing.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::BlockDevice;
use crate::counters::Counters;

/// Passes I/O to `base` until shut down.
pub struct Fence {
    base: Arc<dyn BlockDevice>,
    /// I/Os in flight (counted before each looks at `down`): the shutdown waits for them. A
    /// counter, not a lock: nothing is held across the device's I/O or flush.
    in_flight: AtomicUsize,
    down: AtomicBool,
    errors: DeviceErrors,
}

/// Errors the device returned since the open, by request kind (not the fence's own refusals
/// after a shutdown).
#[derive(Debug, Default)]
pub struct DeviceErrors {
    /// Failed reads (a batch counts once).
    pub reads: AtomicU64,
    /// Failed writes (a batch counts once).
    pub writes: AtomicU64,
    /// Failed flushes.
    pub flushes: AtomicU64,
}

impl Fence {
    /// A fence over `base`, open.
    pub fn new(base: Arc<dyn BlockDevice>) -> Fence {
        Fence {
            base,
            in_flight: AtomicUsize::new(0),
            down: AtomicBool::new(false),
            errors: DeviceErrors::default(),
        }
    }

    /// The errors the device returned since the open.
    pub fn errors(&self) -> &DeviceErrors {
        &self.errors
    }

    /// The device behind the fence.
    pub fn base(&self) -> &Arc<dyn BlockDevice> {
        &self.base
    }

    /// Closes the fence: waits for I/O in flight, after which every I/O fails. Returns whether
    /// this call closed it (false: it was closed already).
    pub fn shut_down(&self) -> bool {
        let first = !self.down.swap(true, Ordering::SeqCst);
        // Every I/O counted before `down` was set may be under way; every later one sees
        // `down` (both sides use SeqCst: the count comes before the look, the flag before the
        // wait). A shutdown is rare: poll.
        while self.in_flight.load(Ordering::SeqCst) != 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        first
    }

    /// Whether the fence is closed.
    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::SeqCst)
    }

    fn pass<T>(
        &self,
        errors: Option<&AtomicU64>,
        io: impl FnOnce(&dyn BlockDevice) -> io::Result<T>,
    ) -> io::Result<T> {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let result = if self.down.load(Ordering::SeqCst) {
            Err(io::Error::other("the filesystem is shut down"))
        } else {
            let result = io(&*self.base);
            if let (Err(_), Some(count)) = (&result, errors) {
                count.fetch_add(1, Ordering::Relaxed);
            }
            result
        };
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        result
    }
}

impl BlockDevice for Fence {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.pass(Some(&self.errors.reads), |d| d.read_at(buf, offset))
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.pass(Some(&self.errors.writes), |d| d.write_at(buf, offset))
    }

    fn write_many(&self, writes: &[(u64, &[u8])]) -> io::Result<()> {
        // One pass for the batch: the shutdown waits for all of it, and nothing of a batch
        // begun after the shutdown reaches the device.
        self.pass(Some(&self.errors.writes), |d| d.write_many(writes))
    }

    fn read_many(&self, reads: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        // One pass for the batch, as for writes: the device gets it whole (RBD: in flight
        // together).
        self.pass(Some(&self.errors.reads), |d| d.read_many(reads))
    }

    fn can_trim(&self) -> bool {
        self.base.can_trim()
    }

    fn trim(&self, ranges: &[(u64, u64)]) -> io::Result<()> {
        self.pass(None, |d| d.trim(ranges))
    }

    fn discard(&self, ranges: &[(u64, u64)]) -> io::Result<()> {
        self.pass(None, |d| d.discard(ranges))
    }

    fn flush(&self) -> io::Result<()> {
        self.pass(Some(&self.errors.flushes), |d| d.flush())
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
        self.base.counters()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::MemDevice;

    #[test]
    fn device_errors_are_counted_and_the_fences_own_refusals_are_not() {
        let mem = Arc::new(MemDevice::new(1 << 20));
        let fence = Fence::new(mem.clone());
        let block = vec![7u8; 4096];
        fence.write_at(&block, 0).expect("write");
        mem.fail_writes(true);
        assert!(fence.write_at(&block, 0).is_err());
        assert!(fence.write_many(&[(4096, &block[..])]).is_err());
        assert!(fence.flush().is_err());
        mem.fail_writes(false);
        fence.shut_down();
        assert!(fence.write_at(&block, 0).is_err());
        assert!(fence.flush().is_err());
        let errors = fence.errors();
        assert_eq!(errors.writes.load(Ordering::Relaxed), 2);
        assert_eq!(errors.flushes.load(Ordering::Relaxed), 1);
        assert_eq!(errors.reads.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn io_passes_until_shut_down_and_fails_after() {
        let fence = Fence::new(Arc::new(MemDevice::new(1 << 20)));
        let block = vec![7u8; 4096];
        fence.write_at(&block, 0).expect("write before");
        fence
            .write_many(&[(8192, &block[..]), (16384, &block[..])])
            .expect("batch before");
        fence.flush().expect("flush before");
        let (mut one, mut two) = (vec![0u8; 4096], vec![0u8; 4096]);
        fence
            .read_many(&mut [(0, &mut one[..]), (16384, &mut two[..])])
            .expect("read batch before");
        assert_eq!((one[0], two[4095]), (7, 7));
        assert!(fence.shut_down());
        assert!(!fence.shut_down(), "the second call finds it down");
        assert!(fence.write_at(&block, 4096).is_err());
        assert!(fence.write_many(&[(4096, &block[..])]).is_err());
        assert!(fence.discard(&[(0, 4096)]).is_err());
        let (mut one, mut two) = (vec![0u8; 4096], vec![0u8; 4096]);
        assert!(fence
            .read_many(&mut [(0, &mut one[..]), (8192, &mut two[..])])
            .is_err());
        assert!(fence.flush().is_err());
        let mut back = vec![0u8; 4096];
        assert!(fence.read_at(&mut back, 0).is_err());
        fence
            .base()
            .read_at(&mut back, 0)
            .expect("the base still reads");
        assert_eq!(back, block);
        for offset in [8192, 16384] {
            fence.base().read_at(&mut back, offset).expect("read batch");
            assert_eq!(back, block, "batch write at {offset}");
        }
        fence.base().read_at(&mut back, 4096).expect("read after");
        assert_eq!(back, vec![0u8; 4096], "nothing passed after the shutdown");
    }
}
