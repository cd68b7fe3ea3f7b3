//! Image files and block devices, opened O_DIRECT under an exclusive lock.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{check_range, BlockDevice};
use crate::counters::Counters;

const ALIGN: usize = 4096;

/// How to open an image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// Read and write; fail at once if another process holds the image.
    ReadWrite,
    /// Read and write; wait for another holder to let go (a mount right after an unmount).
    ReadWriteWait,
    /// Read only; still takes the lock, so a live mount is refused.
    ReadOnly,
    /// Read only, waiting for another holder to let go (a read-only mount right after an
    /// unmount, while the previous daemon finishes its final commit).
    ReadOnlyWait,
    /// Read only without the lock: a look at a live image, which may be inconsistent.
    ReadOnlyUnlocked,
}

/// An image file or block device. The image lock is held for the life of this value, so it is
/// released only after the last flush and close.
pub struct FileDevice {
    file: File,
    path: PathBuf,
    size: u64,
    direct: bool,
    counters: Counters,
    /// The io_uring of [`BlockDevice::write_many`], made on first use; `None` inside when
    /// this kernel refused one (then writes go one by one).
    ring: parking_lot::Mutex<Option<Option<io_uring::IoUring>>>,
    /// Set when the ring failed with writes possibly still in flight from buffers their
    /// callers may since have freed (see [`BlockDevice::write_many`]): every later write and
    /// flush fails, so blocks such a late write may still reach are never reused and
    /// referenced by a later commit.
    ring_failed: std::sync::atomic::AtomicBool,
    /// The io_uring of [`BlockDevice::read_many`], made on first use, as `ring` is; a ring of
    /// its own, so a batch of reads never waits behind a commit's writes. `None` inside once
    /// this kernel refused one or it failed with reads in flight (then reads go one by one).
    read_ring: parking_lot::Mutex<Option<Option<io_uring::IoUring>>>,
}

/// Submission queue entries of each of [`FileDevice`]'s rings: at most this many writes (or
/// reads) per submission.
const RING_ENTRIES: u32 = 64;

impl FileDevice {
    /// EIO once the ring failed with writes in flight (`ring_failed`).
    fn refuse_after_ring_failure(&self) -> io::Result<()> {
        if self.ring_failed.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(io::Error::other(format!(
                "{}: refused: an earlier batch of writes may still be in flight after its io_uring failed",
                self.path.display()
            )));
        }
        Ok(())
    }

    /// Opens `path`. O_DIRECT is used when the host filesystem accepts it; otherwise a warning
    /// says so and buffered I/O with fdatasync is used.
    pub fn open(path: &Path, mode: OpenMode) -> io::Result<FileDevice> {
        let writable = matches!(mode, OpenMode::ReadWrite | OpenMode::ReadWriteWait);
        let is_block = std::fs::metadata(path)
            .map(|m| m.file_type().is_block_device())
            .map_err(|e| with_path(e, path, "open"))?;
        let open = |direct: bool| {
            let mut options = OpenOptions::new();
            options.read(true).write(writable);
            let mut flags = 0;
            if direct {
                flags |= libc::O_DIRECT;
            }
            if is_block && writable {
                flags |= libc::O_EXCL;
            }
            options.custom_flags(flags);
            options.open(path)
        };
        let (mut file, direct) = match open(true) {
            Ok(file) => (file, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                log::warn!("{}: the host filesystem refuses O_DIRECT; using buffered I/O (fsync cost then grows with the host's dirty pages)", path.display());
                (open(false).map_err(|e| with_path(e, path, "open"))?, false)
            }
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                return Err(io::Error::new(
                    io::ErrorKind::ResourceBusy,
                    format!(
                        "{}: block device is in use (mounted or opened exclusively)",
                        path.display()
                    ),
                ));
            }
            Err(e) => return Err(with_path(e, path, "open")),
        };
        if mode != OpenMode::ReadOnlyUnlocked {
            lock_image(
                &file,
                path,
                writable,
                matches!(mode, OpenMode::ReadWriteWait | OpenMode::ReadOnlyWait),
            )?;
        }
        let size = file
            .seek(SeekFrom::End(0))
            .map_err(|e| with_path(e, path, "size"))?;
        let size = size - size % birch_format::BLOCK_SIZE;
        let mut device = FileDevice {
            file,
            path: path.to_path_buf(),
            size,
            direct,
            counters: Counters::default(),
            ring: parking_lot::Mutex::new(None),
            ring_failed: std::sync::atomic::AtomicBool::new(false),
            read_ring: parking_lot::Mutex::new(None),
        };
        if direct && size >= birch_format::BLOCK_SIZE {
            // Some filesystems accept O_DIRECT at open but refuse the I/O; probe once.
            let mut probe = vec![0u8; birch_format::BLOCK_SIZE as usize];
            if let Err(e) = device.read_at(&mut probe, 0) {
                if e.raw_os_error() == Some(libc::EINVAL) {
                    log::warn!(
                        "{}: O_DIRECT read refused; using buffered I/O",
                        path.display()
                    );
                    let file = open(false).map_err(|e| with_path(e, path, "open"))?;
                    device.file = file;
                    device.direct = false;
                } else {
                    return Err(e);
                }
            }
        }
        Ok(device)
    }

    /// Whether I/O bypasses the host page cache.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// The path this device was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn with_path(e: io::Error, path: &Path, what: &str) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {what}: {e}", path.display()))
}

/// Takes the image lock: flock (per open file, so a second open in one process is refused
/// too) plus a POSIX record lock whose holder's pid F_GETLK can report.
pub(super) fn lock_image(file: &File, path: &Path, writable: bool, wait: bool) -> io::Result<()> {
    let fd = file.as_raw_fd();
    let started = Instant::now();
    let mut told = false;
    loop {
        // SAFETY: flock on a valid descriptor we own; no memory is passed.
        let rc = unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            break;
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(with_path(err, path, "lock"));
        }
        let holder = lock_holder(fd);
        let who = match holder {
            Some(pid) => format!("in use by pid {pid}"),
            None => "in use by this process or another".to_string(),
        };
        if !wait {
            return Err(io::Error::new(
                io::ErrorKind::ResourceBusy,
                format!(
                    "{}: image is {who} (mounted, or being checked)",
                    path.display()
                ),
            ));
        }
        if !told && started.elapsed() > Duration::from_secs(2) {
            eprintln!(
                "{}: image is {who}; waiting for it to be released",
                path.display()
            );
            told = true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut lock = flock_struct(if writable {
        libc::F_WRLCK
    } else {
        libc::F_RDLCK
    });
    // SAFETY: fcntl F_SETLK with a properly initialised struct flock that outlives the call.
    unsafe { libc::fcntl(fd, libc::F_SETLK, &mut lock) };
    Ok(())
}

fn flock_struct(kind: libc::c_int) -> libc::flock {
    // SAFETY: libc::flock is plain old data; all-zero is a valid value.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = 0;
    lock.l_len = 1;
    lock
}

/// The pid holding the record lock on byte 0, if another process holds it.
fn lock_holder(fd: libc::c_int) -> Option<i32> {
    let mut lock = flock_struct(libc::F_WRLCK);
    // SAFETY: fcntl F_GETLK fills the struct we pass; it lives across the call.
    let rc = unsafe { libc::fcntl(fd, libc::F_GETLK, &mut lock) };
    (rc == 0 && lock.l_type != libc::F_UNLCK as libc::c_short).then_some(lock.l_pid)
}

/// Bounce buffers up to this size are kept per thread and reused; larger ones are not kept.
const KEEP_BOUNCE: usize = 256 * 1024;

thread_local! {
    /// This thread's bounce buffer for O_DIRECT I/O of unaligned caller buffers (a FUSE
    /// request's data is not page aligned): reused, so a 64 KiB synchronous write costs one
    /// copy, not an allocation, zeroing and page faults as well.
    static BOUNCE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` on an aligned buffer of `len` bytes (content unspecified) without unsafe code:
/// over-allocate and slice.
fn with_aligned<T>(len: usize, f: impl FnOnce(&mut [u8]) -> T) -> T {
    let run = |buf: &mut Vec<u8>| {
        if buf.len() < len + ALIGN {
            buf.clear();
            buf.resize(len + ALIGN, 0);
        }
        let start = buf.as_ptr().align_offset(ALIGN);
        f(&mut buf[start..start + len])
    };
    if len > KEEP_BOUNCE {
        return run(&mut Vec::new());
    }
    BOUNCE.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => run(&mut buf),
        Err(_) => run(&mut Vec::new()),
    })
}

/// A heap buffer aligned for O_DIRECT holding a copy of some slices, one after the other.
/// It is filled by the copy straight from the slices, never zeroed first.
struct AlignedBuf {
    /// The allocation, `ALIGN`-aligned; dangling (nothing allocated) when `len` is 0.
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    layout: std::alloc::Layout,
}

impl AlignedBuf {
    /// The bytes of `parts` back to back in fresh `ALIGN`-aligned memory.
    fn copy_of(parts: &[&[u8]]) -> io::Result<AlignedBuf> {
        let len = parts
            .iter()
            .try_fold(0usize, |sum, part| sum.checked_add(part.len()))
            .ok_or_else(|| io::Error::other("aligned copy: length overflows"))?;
        let layout = std::alloc::Layout::from_size_align(len, ALIGN)
            .map_err(|e| io::Error::other(format!("aligned copy of {len} bytes: {e}")))?;
        if len == 0 {
            return Ok(AlignedBuf {
                ptr: std::ptr::NonNull::dangling(),
                len,
                layout,
            });
        }
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { std::alloc::alloc(layout) };
        let Some(ptr) = std::ptr::NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout);
        };
        let mut at = 0;
        for part in parts {
            // SAFETY: the parts' lengths sum to `len`, so `at + part.len() <= len`: the
            // destination lies inside the allocation, which no slice overlaps (it is new).
            unsafe {
                std::ptr::copy_nonoverlapping(part.as_ptr(), ptr.as_ptr().add(at), part.len());
            }
            at += part.len();
        }
        // Every byte of the allocation is written now: only from here on may a slice of it
        // exist (`as_slice`).
        debug_assert_eq!(at, len);
        Ok(AlignedBuf { ptr, len, layout })
    }

    /// `len` zero bytes in fresh `ALIGN`-aligned memory.
    fn zeroed(len: usize) -> io::Result<AlignedBuf> {
        let layout = std::alloc::Layout::from_size_align(len, ALIGN)
            .map_err(|e| io::Error::other(format!("aligned buffer of {len} bytes: {e}")))?;
        if len == 0 {
            return Ok(AlignedBuf {
                ptr: std::ptr::NonNull::dangling(),
                len,
                layout,
            });
        }
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = std::ptr::NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout);
        };
        Ok(AlignedBuf { ptr, len, layout })
    }

    /// Where the bytes start, for the kernel to fill (`read_many`). Writing through it while
    /// a slice from [`AlignedBuf::as_slice`] lives is not allowed.
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` bytes (or dangling and aligned with `len` 0), all
        // of them initialised by `copy_of`, and borrowed from `self` for as long as it lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated by `copy_of` with this very layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
        }
    }
}

/// Pushes `entries` (their `user_data` their index) to `ring`, submits them and waits for every
/// completion. Returns each entry's result (bytes done, or minus an errno), by index; an
/// error means the ring failed with some of them possibly still in flight (an `io_uring_enter`
/// error other than EINTR, EAGAIN or EBUSY, or no room in the submission queue): the caller
/// must then keep every buffer they name alive for good.
fn run_batch(
    ring: &mut io_uring::IoUring,
    entries: &[io_uring::squeue::Entry],
) -> io::Result<Vec<i32>> {
    for entry in entries {
        // SAFETY: the caller keeps the buffers the entries name alive until every completion
        // is reaped, or for good when this fails.
        if unsafe { ring.submission().push(entry) }.is_err() {
            return Err(io::Error::other("io_uring submission queue full"));
        }
    }
    let mut results: Vec<Option<i32>> = vec![None; entries.len()];
    let mut reaped = 0usize;
    while reaped < entries.len() {
        match ring.submit_and_wait(entries.len() - reaped) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EBUSY)) => {
                // Completions to reap first, or the kernel short of memory a moment.
                if ring.completion().is_empty() {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            Err(e) => return Err(e),
        }
        for cqe in ring.completion() {
            let n = cqe.user_data() as usize;
            match results.get_mut(n) {
                Some(slot @ None) => {
                    *slot = Some(cqe.result());
                    reaped += 1;
                }
                _ => {
                    return Err(io::Error::other(format!(
                        "io_uring: unexpected completion {n} of a batch of {}",
                        entries.len()
                    )))
                }
            }
        }
    }
    Ok(results
        .into_iter()
        .map(|r| r.unwrap_or(-libc::EIO))
        .collect())
}

/// The context of a failed read of a batch, as [`super::read_one_by_one`] words it.
fn read_context(e: &io::Error, n: usize, count: usize, offset: u64, len: usize) -> io::Error {
    io::Error::new(
        e.kind(),
        format!("read {} of {count} at {offset:#x} length {len}: {e}", n + 1),
    )
}

impl BlockDevice for FileDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_range(offset, buf.len(), self.size)?;
        self.counters.add(|c| &c.device_reads, 1);
        if !self.direct || buf.as_ptr().align_offset(ALIGN) == 0 {
            return self.file.read_exact_at(buf, offset);
        }
        with_aligned(buf.len(), |region| {
            self.file.read_exact_at(region, offset)?;
            buf.copy_from_slice(region);
            Ok(())
        })
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.refuse_after_ring_failure()?;
        check_range(offset, buf.len(), self.size)?;
        self.counters.add(|c| &c.device_writes, 1);
        self.counters.add(|c| &c.bytes_written, buf.len() as u64);
        if !self.direct || buf.as_ptr().align_offset(ALIGN) == 0 {
            return self.file.write_all_at(buf, offset);
        }
        with_aligned(buf.len(), |region| {
            region.copy_from_slice(buf);
            self.file.write_all_at(region, offset)
        })
    }

    /// Several writes in one io_uring submission (the block layer then hands them to the
    /// device together: one notification of a virtio disk instead of one per write, and one
    /// wait instead of one per write), copied into one aligned buffer for O_DIRECT.
    fn write_many(&self, writes: &[(u64, &[u8])]) -> io::Result<()> {
        self.refuse_after_ring_failure()?;
        if writes.len() < 2 || !self.direct {
            for (offset, bytes) in writes {
                self.write_at(bytes, *offset)?;
            }
            return Ok(());
        }
        for (offset, bytes) in writes {
            check_range(*offset, bytes.len(), self.size)?;
        }
        let mut slot = self.ring.lock();
        let ring = slot.get_or_insert_with(|| match io_uring::IoUring::new(RING_ENTRIES) {
            Ok(ring) => Some(ring),
            Err(e) => {
                log::warn!(
                    "{}: no io_uring ({e}): several writes go one by one",
                    self.path.display()
                );
                None
            }
        });
        let Some(ring) = ring.as_mut() else {
            drop(slot);
            for (offset, bytes) in writes {
                self.write_at(bytes, *offset)?;
            }
            return Ok(());
        };
        let total: usize = writes.iter().map(|(_, b)| b.len()).sum();
        self.counters.add(|c| &c.device_writes, writes.len() as u64);
        self.counters.add(|c| &c.bytes_written, total as u64);
        // O_DIRECT wants aligned memory: the callers' buffers when all are aligned (the
        // commit's nodes, write-back runs), else one aligned copy of them all.
        let aligned = writes
            .iter()
            .all(|(_, b)| b.as_ptr().align_offset(ALIGN) == 0);
        let region = if aligned {
            AlignedBuf::copy_of(&[])?
        } else {
            let parts: Vec<&[u8]> = writes.iter().map(|(_, b)| *b).collect();
            AlignedBuf::copy_of(&parts)?
        };
        let mut at = 0usize;
        // (device offset, address of the bytes, length)
        let mut placed: Vec<(u64, *const u8, usize)> = Vec::with_capacity(writes.len());
        for (offset, bytes) in writes {
            if aligned {
                placed.push((*offset, bytes.as_ptr(), bytes.len()));
            } else {
                let copy = &region.as_slice()[at..at + bytes.len()];
                placed.push((*offset, copy.as_ptr(), bytes.len()));
                at += bytes.len();
            }
        }
        let fd = io_uring::types::Fd(self.file.as_raw_fd());
        // A ring that failed with writes of ours possibly still in it (an io_uring_enter
        // error other than EINTR/EAGAIN/EBUSY, or a submission queue that was not empty) is
        // given up: its unreaped writes may still read `region`, which is then leaked rather
        // than freed. Writes from the callers' own (aligned) buffers cannot be held back that
        // way: once the caller frees them, such a late write may put other bytes in its
        // blocks, which the failed write's caller may give back to the allocator. So the
        // device refuses every later write and flush (`ring_failed`): nothing reuses those
        // blocks, and nothing after the failure becomes durable.
        let mut broken: Option<io::Error> = None;
        'chunks: for chunk in placed.chunks(RING_ENTRIES as usize) {
            for (n, (offset, ptr, len)) in chunk.iter().enumerate() {
                // The bytes live until every completion of this chunk is reaped below.
                let entry = io_uring::opcode::Write::new(fd, *ptr, *len as u32)
                    .offset(*offset)
                    .build()
                    .user_data(n as u64);
                // SAFETY: `ptr .. + len` is one of the callers' buffers or lies inside
                // `region`; both outlive the submission: this function waits for all of the
                // chunk's completions before it returns or moves on, and a ring given up
                // before that leaks `region` (`broken` below).
                if unsafe { ring.submission().push(&entry) }.is_err() {
                    broken = Some(io::Error::other("io_uring submission queue full"));
                    break 'chunks;
                }
            }
            let mut reaped = 0usize;
            let mut failed: Option<io::Error> = None;
            let mut short: Vec<usize> = Vec::new();
            while reaped < chunk.len() {
                match ring.submit_and_wait(chunk.len() - reaped) {
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e)
                        if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EBUSY)) =>
                    {
                        // Completions to reap first, or the kernel short of memory a moment.
                        if ring.completion().is_empty() {
                            std::thread::sleep(std::time::Duration::from_millis(1));
                        }
                    }
                    Err(e) => {
                        broken = Some(e);
                        break 'chunks;
                    }
                }
                for cqe in ring.completion() {
                    reaped += 1;
                    let n = cqe.user_data() as usize;
                    let res = cqe.result();
                    if res < 0 {
                        failed.get_or_insert(io::Error::from_raw_os_error(-res));
                    } else if chunk.get(n).is_some_and(|(_, _, len)| res as usize != *len) {
                        short.push(n);
                    }
                }
            }
            if let Some(e) = failed {
                return Err(e);
            }
            // A short write (rare) is written again the ordinary way, whole.
            for n in short {
                let (offset, _, _) = chunk[n];
                if let Some((_, bytes)) = writes.iter().find(|(o, _)| *o == offset) {
                    self.write_at(bytes, offset)?;
                }
            }
        }
        if let Some(e) = broken {
            std::mem::forget(region);
            self.ring_failed
                .store(true, std::sync::atomic::Ordering::SeqCst);
            log::error!(
                "{}: io_uring failed with writes in flight ({e}); every later write and flush of this device fails",
                self.path.display()
            );
            return Err(e);
        }
        Ok(())
    }

    /// Several reads in one io_uring submission (up to 64 at a time: the block layer hands
    /// them to the device together, and the caller waits once instead of once per read),
    /// each into an aligned buffer of the device's own, copied to the caller's buffers once
    /// all completed. Own buffers even where the caller's are aligned: should the ring fail
    /// with reads in flight, the kernel may still write into their buffers later, and only a
    /// buffer of ours can be kept from being freed (leaked). A short read (the image shrank
    /// under us) is read again whole the ordinary way, and fails with the read named if it
    /// is still short. Falls back to one read after the other without O_DIRECT, without an
    /// io_uring, for a single read, or while another thread's batch holds the ring.
    fn read_many(&self, reads: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        let count = reads.len();
        if count < 2 || !self.direct || reads.iter().any(|(_, b)| b.len() > u32::MAX as usize) {
            return super::read_one_by_one(self, reads);
        }
        for (n, (offset, buf)) in reads.iter().enumerate() {
            check_range(*offset, buf.len(), self.size)
                .map_err(|e| read_context(&e, n, count, *offset, buf.len()))?;
        }
        // A busy ring (another thread's batch) is not waited for: its reads may take a round
        // trip each, and ours are no slower one by one than they were before batches.
        let Some(mut slot) = self.read_ring.try_lock() else {
            return super::read_one_by_one(self, reads);
        };
        let ring = slot.get_or_insert_with(|| match io_uring::IoUring::new(RING_ENTRIES) {
            Ok(ring) => Some(ring),
            Err(e) => {
                log::warn!(
                    "{}: no io_uring for reads ({e}): several reads go one by one",
                    self.path.display()
                );
                None
            }
        });
        let Some(ring) = ring.as_mut() else {
            drop(slot);
            return super::read_one_by_one(self, reads);
        };
        self.counters.add(|c| &c.device_reads, count as u64);
        let fd = io_uring::types::Fd(self.file.as_raw_fd());
        let chunk_len = RING_ENTRIES as usize;
        for (c, chunk) in reads.chunks_mut(chunk_len).enumerate() {
            let first = c * chunk_len;
            let total: usize = chunk.iter().map(|(_, b)| b.len()).sum();
            let mut region = AlignedBuf::zeroed(total)?;
            let base = region.as_mut_ptr();
            let mut entries = Vec::with_capacity(chunk.len());
            let mut at = 0usize;
            for (n, (offset, buf)) in chunk.iter().enumerate() {
                // SAFETY: `at + buf.len() <= total`: inside the region.
                let ptr = unsafe { base.add(at) };
                entries.push(
                    io_uring::opcode::Read::new(fd, ptr, buf.len() as u32)
                        .offset(*offset)
                        .build()
                        .user_data(n as u64),
                );
                at += buf.len();
            }
            // `region` outlives every read of the chunk: `run_batch` waits for all their
            // completions, and a ring that failed before that leaks it (below).
            let results = match run_batch(ring, &entries) {
                Ok(results) => results,
                Err(e) => {
                    std::mem::forget(region);
                    // The failed ring may still hold our reads: never use it again (nor
                    // close it, which would not wait for them either); reads go one by one.
                    if let Some(ring) = slot.take().flatten() {
                        std::mem::forget(ring);
                    }
                    *slot = Some(None);
                    log::error!(
                        "{}: io_uring failed with reads in flight ({e}); later reads go one by one",
                        self.path.display()
                    );
                    return Err(io::Error::new(
                        e.kind(),
                        format!(
                            "read {} to {} of {count}: io_uring failed: {e}",
                            first + 1,
                            first + chunk.len()
                        ),
                    ));
                }
            };
            let mut at = 0usize;
            let mut failed: Option<io::Error> = None;
            for (n, ((offset, buf), res)) in chunk.iter_mut().zip(results).enumerate() {
                let len = buf.len();
                let got = &region.as_slice()[at..at + len];
                at += len;
                if failed.is_some() {
                    continue;
                }
                if res < 0 {
                    let e = io::Error::from_raw_os_error(-res);
                    failed = Some(read_context(&e, first + n, count, *offset, len));
                } else if res as usize == len {
                    buf.copy_from_slice(got);
                } else {
                    // Short (rare): read it again whole, as `read_at` does.
                    let retried = with_aligned(len, |bounce| {
                        self.file.read_exact_at(bounce, *offset)?;
                        buf.copy_from_slice(bounce);
                        Ok::<(), io::Error>(())
                    });
                    if let Err(e) = retried {
                        let e = io::Error::new(
                            e.kind(),
                            format!("short read ({res} bytes), again: {e}"),
                        );
                        failed = Some(read_context(&e, first + n, count, *offset, len));
                    }
                }
            }
            if let Some(e) = failed {
                return Err(e);
            }
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        self.refuse_after_ring_failure()?;
        self.counters.add(|c| &c.flushes, 1);
        self.file.sync_data()
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
    fn second_open_is_refused_with_a_clear_error() {
        let dir = std::env::temp_dir().join(format!("birch-dev-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp dir");
        let path = dir.join("img");
        std::fs::write(&path, vec![0u8; 1 << 20]).expect("image");
        let first = FileDevice::open(&path, OpenMode::ReadWrite).expect("first open");
        let err = FileDevice::open(&path, OpenMode::ReadWrite)
            .err()
            .expect("second open must fail");
        assert!(err.to_string().contains("in use"), "{err}");
        first.write_at(&[7u8; 4096], 8192).expect("write");
        first.flush().expect("flush");
        let mut back = vec![0u8; 4096];
        first.read_at(&mut back, 8192).expect("read");
        assert_eq!(back, vec![7u8; 4096]);
        drop(first);
        FileDevice::open(&path, OpenMode::ReadWrite).expect("open after release");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Once its ring failed with writes in flight, the device refuses every write and flush
    /// (reads still work), so nothing reuses the blocks a late write may still reach.
    #[test]
    fn a_failed_ring_refuses_every_later_write_and_flush() {
        let dir = std::env::temp_dir().join(format!("birch-dev-ringfail-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp dir");
        let path = dir.join("img");
        std::fs::write(&path, vec![0u8; 1 << 20]).expect("image");
        let dev = FileDevice::open(&path, OpenMode::ReadWrite).expect("open");
        dev.write_at(&[1u8; 4096], 0).expect("write before");
        dev.ring_failed
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let a = [2u8; 4096];
        assert!(dev.write_at(&a, 4096).is_err());
        assert!(dev.write_many(&[(8192, &a[..]), (16384, &a[..])]).is_err());
        assert!(dev.flush().is_err());
        let mut back = vec![0u8; 4096];
        dev.read_at(&mut back, 0).expect("reads still work");
        assert_eq!(back, vec![1u8; 4096]);
        drop(dev);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Scattered writes of one `write_many` (one io_uring submission, more writes than one
    /// submission holds, unaligned source buffers) all land, and an out-of-range one fails
    /// the call before anything is submitted.
    #[test]
    fn write_many_lands_every_write() {
        let dir = std::env::temp_dir().join(format!("birch-dev-many-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp dir");
        let path = dir.join("img");
        std::fs::write(&path, vec![0u8; 4 << 20]).expect("image");
        let dev = FileDevice::open(&path, OpenMode::ReadWrite).expect("open");
        let n = RING_ENTRIES as usize + 10;
        // Bytes at an odd address: the copy into the aligned buffer must happen.
        let source: Vec<u8> = (0..(n * 8192 + 1)).map(|i| (i / 4096) as u8).collect();
        let writes: Vec<(u64, &[u8])> = (0..n)
            .map(|k| {
                let at = 1 + k * 4096;
                ((k as u64) * 3 * 4096, &source[at..at + 4096])
            })
            .collect();
        let before = dev.counters().values();
        dev.write_many(&writes).expect("write_many");
        assert_eq!(
            dev.counters().values().since(&before).device_writes,
            n as u64
        );
        for (offset, bytes) in &writes {
            let mut back = vec![0u8; 4096];
            dev.read_at(&mut back, *offset).expect("read");
            assert_eq!(&back[..], *bytes, "offset {offset}");
        }
        // Aligned buffers are submitted as they are (no copy).
        let aligned = AlignedBuf::copy_of(&[&[0xA5; 3 * 4096]]).expect("aligned copy");
        let whole = aligned.as_slice();
        let (a, b) = whole.split_at(4096);
        dev.write_many(&[(40 * 4096, a), (50 * 4096, &b[4096..])])
            .expect("aligned write_many");
        for at in [40u64, 50] {
            let mut back = vec![0u8; 4096];
            dev.read_at(&mut back, at * 4096).expect("read");
            assert!(back.iter().all(|&x| x == 0xA5), "block {at}");
        }
        let bad = [(0u64, &source[..4096]), (4 << 20, &source[..4096])];
        assert!(dev.write_many(&bad).is_err());
        drop(dev);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A fresh image of `bytes` whose blocks all differ, opened read-write, in a new
    /// directory (returned, for the caller to remove).
    fn numbered_image(name: &str, bytes: usize) -> (std::path::PathBuf, FileDevice) {
        let dir = std::env::temp_dir().join(format!("birch-dev-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp dir");
        let path = dir.join("img");
        let content: Vec<u8> = (0..bytes)
            .map(|i| ((i / 4096) as u8) ^ ((i % 4096) as u8).wrapping_mul(31))
            .collect();
        std::fs::write(&path, &content).expect("image");
        let dev = FileDevice::open(&path, OpenMode::ReadWrite).expect("open");
        (dir, dev)
    }

    /// `read_many` (one io_uring submission per 64 reads where O_DIRECT and io_uring are
    /// available) returns what one `read_at` after the other returns, for more reads than
    /// one submission holds, of mixed lengths, into aligned and unaligned buffers, and
    /// counts one device read per entry.
    #[test]
    fn read_many_equals_one_read_at_a_time() {
        let (dir, dev) = numbered_image("readmany", 4 << 20);
        let n = RING_ENTRIES as usize * 2 + 7;
        // (offset, length): scattered, not in order, 4 to 16 KiB each.
        let wanted: Vec<(u64, usize)> = (0..n)
            .map(|k| {
                let block = (k * 37) % 1000;
                ((block as u64) * 4096, 4096 * (1 + k % 4))
            })
            .collect();
        let mut expected = Vec::new();
        for (offset, len) in &wanted {
            let mut one = vec![0u8; *len];
            dev.read_at(&mut one, *offset).expect("read_at");
            expected.push(one);
        }
        // Unaligned: each buffer starts one byte into its allocation.
        let mut storage: Vec<Vec<u8>> = wanted.iter().map(|(_, len)| vec![0xEE; len + 1]).collect();
        let before = dev.counters().values();
        {
            let mut reads: Vec<(u64, &mut [u8])> = wanted
                .iter()
                .zip(storage.iter_mut())
                .map(|((offset, len), buf)| (*offset, &mut buf[1..1 + *len]))
                .collect();
            assert!(reads
                .iter()
                .any(|(_, b)| b.as_ptr().align_offset(ALIGN) != 0));
            dev.read_many(&mut reads).expect("read_many");
        }
        assert_eq!(
            dev.counters().values().since(&before).device_reads,
            n as u64
        );
        assert!(dev.is_direct(), "the image is opened O_DIRECT");
        // Where this kernel gives an io_uring, the batch went through it.
        if io_uring::IoUring::new(4).is_ok() {
            assert!(matches!(*dev.read_ring.lock(), Some(Some(_))));
        } else {
            eprintln!("no io_uring here: read_many went one by one");
        }
        for (k, (buf, want)) in storage.iter().zip(&expected).enumerate() {
            assert_eq!(&buf[1..], &want[..], "read {k} at {:#x}", wanted[k].0);
        }
        // Aligned buffers, the same answer.
        let mut region = AlignedBuf::zeroed(wanted.iter().map(|(_, l)| l).sum()).expect("region");
        let whole = region.as_mut_ptr();
        // SAFETY: the region is `total` bytes, initialised (zeroed), and no other slice of
        // it lives while this one does.
        let whole = unsafe { std::slice::from_raw_parts_mut(whole, region.len) };
        {
            let mut rest = &mut whole[..];
            let mut reads: Vec<(u64, &mut [u8])> = Vec::new();
            for (offset, len) in &wanted {
                let (head, tail) = rest.split_at_mut(*len);
                reads.push((*offset, head));
                rest = tail;
            }
            assert!(reads
                .iter()
                .all(|(_, b)| b.as_ptr().align_offset(ALIGN) == 0));
            dev.read_many(&mut reads).expect("aligned read_many");
        }
        assert_eq!(whole, &expected.concat()[..]);
        drop(region);
        // A single read and an empty batch.
        let mut one = vec![0u8; 4096];
        dev.read_many(&mut [(8192, &mut one[..])]).expect("one");
        assert_eq!(one, block_of(&dev, 2));
        dev.read_many(&mut []).expect("none");
        drop(dev);
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn block_of(dev: &FileDevice, block: u64) -> Vec<u8> {
        let mut buf = vec![0u8; 4096];
        dev.read_at(&mut buf, block * 4096).expect("read_at");
        buf
    }

    /// A read of a batch past the end of the device fails the call before anything is
    /// read, naming the read (which of how many, where, how long); a read of a block the
    /// image no longer has (it shrank under the device: a short read) fails naming it too;
    /// and the device reads on after either.
    #[test]
    fn a_bad_read_of_a_batch_fails_with_context() {
        let (dir, dev) = numbered_image("readmany-end", 1 << 20);
        let mut a = vec![0u8; 4096];
        let mut b = vec![0u8; 8192];
        let mut c = vec![0u8; 4096];
        let err = dev
            .read_many(&mut [
                (0, &mut a[..]),
                ((1 << 20) - 4096, &mut b[..]),
                (4096, &mut c[..]),
            ])
            .expect_err("past the end");
        let text = err.to_string();
        assert!(
            text.contains("read 2 of 3 at 0xff000 length 8192") && text.contains("past device end"),
            "{text}"
        );
        // Shrink the image under the open device: the last blocks read short.
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("img"))
            .expect("open to shrink");
        file.set_len(512 * 1024).expect("shrink");
        drop(file);
        let err = dev
            .read_many(&mut [
                (0, &mut a[..]),
                (4096, &mut c[..]),
                (600 * 1024, &mut b[..]),
            ])
            .expect_err("short read");
        let text = err.to_string();
        assert!(
            text.contains("read 3 of 3 at 0x96000 length 8192"),
            "{text}"
        );
        dev.read_many(&mut [(0, &mut a[..]), (4096, &mut c[..])])
            .expect("reads on after a failed batch");
        assert_eq!(c, block_of(&dev, 1));
        drop(dev);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The aligned copy holds the parts back to back, at an aligned address, with no
    /// zeroing first: every byte comes from a part.
    #[test]
    fn aligned_copy_holds_the_parts_back_to_back() {
        let source: Vec<u8> = (0..3 * 4096 + 7).map(|i| (i % 251) as u8).collect();
        let parts: [&[u8]; 4] = [&source[1..4097], &[], &source[5..8192], &source[9000..]];
        let copy = AlignedBuf::copy_of(&parts).expect("aligned copy");
        assert_eq!(copy.as_slice().as_ptr().align_offset(ALIGN), 0);
        assert_eq!(copy.as_slice(), parts.concat().as_slice());
        let empty = AlignedBuf::copy_of(&[&[], &[]]).expect("empty copy");
        assert!(empty.as_slice().is_empty());
    }
}
