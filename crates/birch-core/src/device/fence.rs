//! The shutdown fence: a device that passes I/O to another until it is shut down, and fails
//! every I/O with `EIO` after.
//!
//! Owns: the shut-down flag of one open filesystem and the wait for I/O in flight when it is
//! set. Must not touch: what is written; it decides nothing but "before" or "after".
//!
//! The engine reaches its device only through its fence, so once [`Fence::shut_down`] returns
//! nothing more reaches the image: each write or flush either completed before (as before a
//! power cut) or fails. Reads fail too: a shut-down filesystem answers nothing.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

use super::BlockDevice;
use crate::counters::Counters;

/// Passes I/O to `base` until shut down.
pub struct Fence {
    base: Arc<dyn BlockDevice>,
    /// Held shared by each I/O and exclusively by the shutdown, which so waits for I/O in
    /// flight.
    gate: RwLock<()>,
    down: AtomicBool,
}

impl Fence {
    /// A fence over `base`, open.
    pub fn new(base: Arc<dyn BlockDevice>) -> Fence {
        Fence {
            base,
            gate: RwLock::new(()),
            down: AtomicBool::new(false),
        }
    }

    /// The device behind the fence.
    pub fn base(&self) -> &Arc<dyn BlockDevice> {
        &self.base
    }

    /// Closes the fence: waits for I/O in flight, after which every I/O fails. Returns whether
    /// this call closed it (false: it was closed already).
    pub fn shut_down(&self) -> bool {
        let _gate = self.gate.write();
        !self.down.swap(true, Ordering::SeqCst)
    }

    /// Whether the fence is closed.
    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::SeqCst)
    }

    fn pass<T>(&self, io: impl FnOnce(&dyn BlockDevice) -> io::Result<T>) -> io::Result<T> {
        let _gate = self.gate.read();
        if self.down.load(Ordering::SeqCst) {
            return Err(io::Error::other("the filesystem is shut down"));
        }
        io(&*self.base)
    }
}

impl BlockDevice for Fence {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.pass(|d| d.read_at(buf, offset))
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.pass(|d| d.write_at(buf, offset))
    }

    fn flush(&self) -> io::Result<()> {
        self.pass(|d| d.flush())
    }

    fn size_bytes(&self) -> u64 {
        self.base.size_bytes()
    }

    fn counters(&self) -> &Counters {
        self.base.counters()
    }
}
