//! The block device layer.
//!
//! Owns: aligned reads and writes of whole blocks, alone or as batches in flight together
//! (`read_many`, `write_many`), discard and trim, flush, device size, and the exclusive lock
//! on an image. Implemented for image files and block devices ([`FileDevice`], O_DIRECT so the
//! host page cache never holds our data) and for memory ([`MemDevice`], which can forget
//! unflushed writes to simulate power loss), for Ceph RBD images (`RbdDevice`, through
//! librbd, with the `rbd` cargo feature; `rbd:POOL/IMAGE` names one, see [`open_image`]), and
//! the shutdown [`Fence`] the engine puts in front of any of them.
//!
//! Must not touch: checksums, nodes, trees. It never holds a caller's lock and never decides
//! when to flush: callers do.

mod fence;
mod file;
mod mem;
mod overlay;
#[cfg(feature = "rbd")]
mod rbd;
#[cfg(feature = "rbd")]
mod rbd_ffi;
mod rbd_spec;
mod timeout;

pub use fence::{DeviceErrors, Fence};
pub use file::{FileDevice, OpenMode};
pub use mem::{MemDevice, Recorded};
pub use overlay::OverlayDevice;
#[cfg(feature = "rbd")]
pub use rbd::{RbdDevice, RbdOpenOptions, HOLDER_KEY};
pub use rbd_spec::{
    check_rbd_layout, is_rbd_path, CephOptions, LocalLock, LockState, RbdSpec, Takeover,
    DEFAULT_RBD_TIMEOUT, DEFAULT_TAKEOVER_WAIT, RBD_PREFIX,
};
pub use timeout::TimeoutDevice;

use std::io;
use std::path::Path;
use std::sync::Arc;

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
    /// Writes each `(offset, bytes)` of `writes`, as [`BlockDevice::write_at`] does, and
    /// returns once every one has completed (or the first failed: then some of the others may
    /// have completed, some not). The writes may be in flight together, in any order: their
    /// ranges must not overlap. Not durable until a later [`BlockDevice::flush`] returns. The
    /// default writes them one after the other; a device whose requests have a round trip
    /// (RBD) submits them all before it waits for any.
    fn write_many(&self, writes: &[(u64, &[u8])]) -> io::Result<()> {
        for (offset, bytes) in writes {
            self.write_at(bytes, *offset)?;
        }
        Ok(())
    }
    /// Reads each `(offset, buf)` of `reads`, as [`BlockDevice::read_at`] does, and returns
    /// once every one has completed, or at the first failure (then what any buffer holds is
    /// unspecified). The reads may be in flight together, in any order. Counts one device read
    /// per entry. The default reads them one after the other; a device whose requests have a
    /// round trip (RBD) submits them all before it waits for any. An error names the read
    /// that failed.
    fn read_many(&self, reads: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        read_one_by_one(self, reads)
    }
    /// Whether [`BlockDevice::trim`] can free anything on this device (a writable RBD
    /// image). `fstrim` of a filesystem on a device that cannot is refused as unsupported.
    /// The default: no.
    fn can_trim(&self) -> bool {
        false
    }
    /// Discards `ranges` as [`BlockDevice::discard`] does, for `fstrim` (the free space of
    /// the filesystem, asked for by the administrator): done even where the automatic
    /// discard of freed space is turned off (RBD's `discard=off`), as Linux filesystems
    /// mounted `nodiscard` still trim. The default is [`BlockDevice::discard`].
    fn trim(&self, ranges: &[(u64, u64)]) -> io::Result<()> {
        self.discard(ranges)
    }
    /// Tells the device that each `(offset, length)` of `ranges` holds nothing anyone will
    /// read (space no committed tree references any more), so it may free what backs it (RBD:
    /// `rbd_aio_discard`). Returns once every one has completed. Afterwards a range reads back
    /// as anything (zeros, its old bytes, or other bytes): nothing may rely on either. The
    /// caller writes nothing to a range before its discard has returned. The default does
    /// nothing.
    fn discard(&self, ranges: &[(u64, u64)]) -> io::Result<()> {
        let _ = ranges;
        Ok(())
    }
    /// The span, in bytes, inside which the device applies a write atomically and beyond
    /// which one write may land in parts (RBD: the bytes contiguous in one RADOS object, a
    /// power of two), aligned to device offset 0; 0 when the device promises no such span
    /// (image files, block devices, memory). The fsync log starts a batch at the next such
    /// boundary rather than let it cross one (DESIGN §14.4).
    fn atomic_unit(&self) -> u64 {
        0
    }
    /// Whether one failed write or flush gives the whole device up, every later request
    /// failing too (RBD, DESIGN §14.3). Then a buffered flush for an fsync may leave its data
    /// to the log's leader (one round trip for data and batch): a failure fails everything
    /// either way. Elsewhere a failed data write costs only its file (EIO on its fsyncs), so
    /// the data is written by the fsync itself. The default: no.
    fn write_error_is_fatal(&self) -> bool {
        false
    }
    /// Makes every completed write durable.
    fn flush(&self) -> io::Result<()>;
    /// Size in bytes.
    fn size_bytes(&self) -> u64;
    /// I/O counters of this device.
    fn counters(&self) -> &Counters;
}

/// [`BlockDevice::read_many`] as one [`BlockDevice::read_at`] after the other, each error
/// naming the read of the batch that failed.
pub(crate) fn read_one_by_one<D: BlockDevice + ?Sized>(
    device: &D,
    reads: &mut [(u64, &mut [u8])],
) -> io::Result<()> {
    let count = reads.len();
    for (n, (offset, buf)) in reads.iter_mut().enumerate() {
        device.read_at(buf, *offset).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "read {} of {count} at {:#x} length {}: {e}",
                    n + 1,
                    *offset,
                    buf.len()
                ),
            )
        })?;
    }
    Ok(())
}

/// Whether this build can open RBD images (the `rbd` cargo feature).
pub const RBD_SUPPORTED: bool = cfg!(feature = "rbd");

/// What opening an image needs besides its name and mode: cluster access for an RBD image,
/// and what the opener is, recorded on the image while it holds it ("mount at /mnt/x").
/// Ignored for image files and block devices.
#[derive(Clone, Default)]
pub struct ImageOptions {
    /// How to reach the Ceph cluster.
    pub ceph: CephOptions,
    /// What holds the image (shown to a refused second user).
    pub holder: String,
    /// Who hears of the device's events (an RBD image: the lock lost, a snapshot wanting a
    /// committed state).
    pub events: Option<Arc<dyn DeviceEvents>>,
}

impl std::fmt::Debug for ImageOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageOptions")
            .field("ceph", &self.ceph)
            .field("holder", &self.holder)
            .field("events", &self.events.is_some())
            .finish()
    }
}

/// What a device tells its user outside of I/O (an RBD image, DESIGN §14.3). Each call comes
/// on a thread of its own, which may do I/O through the filesystem.
pub trait DeviceEvents: Send + Sync {
    /// The device is given up for good (its lock lost or taken over, the client fenced, the
    /// cluster not answering): every later I/O fails. Called once.
    fn device_lost(&self, why: &str);
    /// Whether what `device_lost` does has taken effect (the filesystem refuses requests), so
    /// that the failing request itself is answered as lost (EIO). The device waits for it a
    /// moment (the call runs on another thread, since it waits for I/O in flight).
    fn lost_in_effect(&self) -> bool {
        true
    }
    /// A snapshot of the image is about to be taken: make what is on the device a committed
    /// state. The snapshot waits for the answer.
    fn quiesce(&self) -> io::Result<()>;
}

/// Opens an image argument: `rbd:POOL[/NAMESPACE]/IMAGE[@SNAP]` as an RBD image, anything
/// else as an image file or block device ([`FileDevice`]). May do I/O (network I/O for RBD)
/// and block for the image lock in the waiting modes.
pub fn open_image(
    path: &Path,
    mode: OpenMode,
    options: &ImageOptions,
) -> io::Result<Arc<dyn BlockDevice>> {
    match RbdSpec::from_path(path)? {
        None => Ok(Arc::new(FileDevice::open(path, mode)?)),
        Some(spec) => open_rbd(&spec, mode, options),
    }
}

#[cfg(feature = "rbd")]
fn open_rbd(
    spec: &RbdSpec,
    mode: OpenMode,
    options: &ImageOptions,
) -> io::Result<Arc<dyn BlockDevice>> {
    let options = RbdOpenOptions {
        ceph: options.ceph.clone(),
        holder: options.holder.clone(),
        events: options.events.clone(),
    };
    Ok(Arc::new(RbdDevice::open(spec, mode, &options)?))
}

#[cfg(not(feature = "rbd"))]
fn open_rbd(
    spec: &RbdSpec,
    _mode: OpenMode,
    _options: &ImageOptions,
) -> io::Result<Arc<dyn BlockDevice>> {
    Err(no_rbd(spec))
}

/// Creates an RBD image of `size_bytes` with the features birch needs (layering,
/// exclusive-lock); `Ok(false)` when it exists already (untouched).
pub fn create_rbd_image(spec: &RbdSpec, size_bytes: u64, ceph: &CephOptions) -> io::Result<bool> {
    #[cfg(feature = "rbd")]
    return rbd::create_image(spec, size_bytes, ceph);
    #[cfg(not(feature = "rbd"))]
    {
        let _ = (size_bytes, ceph);
        Err(no_rbd(spec))
    }
}

/// The error for an `rbd:` image in a build without the `rbd` feature.
#[cfg(not(feature = "rbd"))]
fn no_rbd(spec: &RbdSpec) -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        format!("{spec}: birch was built without RBD support (rebuild with `cargo build --release --features rbd`, which needs librbd-dev and librados-dev)"),
    )
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
