//! The block device layer.
//!
//! Owns: aligned reads and writes of whole blocks, flush, device size, and the exclusive lock
//! on an image. Implemented for image files and block devices ([`FileDevice`], O_DIRECT so the
//! host page cache never holds our data) and for memory ([`MemDevice`], which can forget
//! unflushed writes to simulate power loss), and the shutdown [`Fence`] the engine puts in
//! front of either.
//!
//! Must not touch: checksums, nodes, trees. It never holds a caller's lock and never decides
//! when to flush: callers do.

mod fence;
mod file;
mod mem;
mod overlay;

pub use fence::Fence;
pub use file::{FileDevice, OpenMode};
pub use mem::{MemDevice, Recorded};
pub use overlay::OverlayDevice;

use std::io;

use crate::counters::Counters;

/// A device of fixed size read and written in whole 4 KiB blocks.
///
/// Offsets and lengths must be multiples of [`birch_format::BLOCK_SIZE`]. Every method may do
/// device I/O and may block.
pub trait BlockDevice: Send + Sync {
    /// Reads `buf.len()` bytes at `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes `buf` at `offset`. Not durable until [`BlockDevice::flush`] returns.
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes every completed write durable.
    fn flush(&self) -> io::Result<()>;
    /// Size in bytes.
    fn size_bytes(&self) -> u64;
    /// I/O counters of this device.
    fn counters(&self) -> &Counters;
}

/// Checks that an I/O is block aligned and inside the device.
pub(crate) fn check_range(offset: u64, len: usize, size: u64) -> io::Result<()> {
    let block = birch_format::BLOCK_SIZE;
    let len = len as u64;
    if offset % block != 0 || len % block != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("unaligned I/O at {offset:#x} length {len}"),
        ));
    }
    if offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("I/O at {offset:#x} length {len} past device end {size:#x}"),
        ));
    }
    Ok(())
}
