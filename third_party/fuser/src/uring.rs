//! FUSE over io_uring (birchfs patch, see BIRCH-PATCH.md).
//!
//! One io_uring per possible CPU ("queue"), each served by one thread pinned to its CPU. Every
//! queue registers `queue_depth` ring entries with `FUSE_IO_URING_CMD_REGISTER`; the kernel
//! fills an entry with a request (in_header and the per-opcode header in the entry's header
//! buffer, the rest in its payload buffer) and completes the command. The queue thread copies
//! the request into one contiguous buffer, parses it with fuser's parser and dispatches it to
//! the same `Filesystem` methods as the /dev/fuse loops. The reply (from the queue thread or
//! from any thread the filesystem hands the reply to) is written into the entry's buffers and
//! the entry is handed back to the queue thread, which alone submits
//! `FUSE_IO_URING_CMD_COMMIT_AND_FETCH` (a command is tied to the task that submitted it: a
//! worker thread that exits would cancel it). A reply from another thread wakes the queue
//! thread through an eventfd read the ring keeps posted.
//!
//! Fail-closed rules: `FUSE_OVER_IO_URING` is asked for in INIT only if the kernel offers it
//! and every queue's ring and buffers exist. If REGISTER fails the kernel clears io_uring for
//! the connection and requests keep flowing through /dev/fuse (whose loops always run; they
//! also carry FORGET, INTERRUPT and notifications). A queue thread that ends before its
//! registrations were submitted would leave requests waiting forever for the ring: the
//! connection is aborted (`/sys/fs/fuse/connections/N/abort`) instead.
//!
//! Layouts: `fuse_uring_req_header` (in_out[128], op_in[128], ring_ent_in_out[32]),
//! `fuse_uring_cmd_req` and the command numbers as in Linux 6.18 `fuse.h` (protocol 7.42+).

use std::cell::Cell;
use std::fmt;
use std::io;
use std::io::IoSlice;
use std::os::fd::AsRawFd;
use std::os::fd::FromRawFd;
use std::os::fd::OwnedFd;
use std::os::fd::RawFd;
use std::path::Path;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;

use io_uring::IoUring;
use io_uring::cqueue;
use io_uring::opcode;
use io_uring::squeue;
use io_uring::types;
use log::debug;
use log::error;
use log::info;
use log::warn;
use parking_lot::Mutex;

use crate::Filesystem;
use crate::ReplyEmpty;
use crate::channel::ChannelSender;
use crate::ll::Operation;
use crate::request::RequestWithSender;
use crate::session::SessionEventLoop;

/// Settings of the io_uring transport (`Config::uring`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UringOptions {
    /// Ring entries per queue: requests a queue can hold at once (the kernel queues the rest).
    /// A reply handed to another thread keeps its entry until it is sent.
    pub queue_depth: usize,
    /// The mount point, used to find the connection to abort if a queue cannot register.
    pub mountpoint: Option<PathBuf>,
    /// Test hook: register payload buffers of 4 KiB, which the kernel refuses, so that
    /// registration fails after INIT agreed to io_uring (the fallback test).
    pub break_register: bool,
    /// Whether the ring was asked for (birchfs's `-o uring`) rather than only the default: a
    /// fallback to /dev/fuse (ring setup failed, or the kernel does not offer io_uring) then
    /// warns, and is logged at info level otherwise ([`UringOptions::fallback_level`]). True
    /// by default: a caller that sets `Config::uring` asks for the ring unless it says not.
    pub asked: bool,
}

impl Default for UringOptions {
    fn default() -> Self {
        UringOptions {
            queue_depth: 64,
            mountpoint: None,
            break_register: false,
            asked: true,
        }
    }
}

impl UringOptions {
    /// The level at which serving over /dev/fuse instead of the ring is logged: warn when
    /// the ring was asked for, info when it was only the default.
    pub fn fallback_level(&self) -> log::Level {
        if self.asked {
            log::Level::Warn
        } else {
            log::Level::Info
        }
    }
}

static DEV_SERVED: AtomicU64 = AtomicU64::new(0);
static RING_SERVED: AtomicU64 = AtomicU64::new(0);

/// Requests served in this process so far: `(over /dev/fuse, over io_uring)`.
pub fn transport_counts() -> (u64, u64) {
    (
        DEV_SERVED.load(Ordering::Relaxed),
        RING_SERVED.load(Ordering::Relaxed),
    )
}

pub(crate) fn count_dev_request(request: &[u8]) {
    DEV_SERVED.fetch_add(1, Ordering::Relaxed);
    count_opcode(request);
}

/// Requests served by opcode (both transports), opcodes 0..64; birch's addition.
static BY_OPCODE: [AtomicU64; 64] = [const { AtomicU64::new(0) }; 64];

/// Counts one request by the opcode in its `fuse_in_header` (bytes 4..8).
fn count_opcode(request: &[u8]) {
    if let Some(op) = request.get(4..8) {
        let op = u32::from_ne_bytes([op[0], op[1], op[2], op[3]]) as usize;
        if let Some(slot) = BY_OPCODE.get(op) {
            slot.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Requests served in this process so far by opcode: `(opcode name in lower case, count)` for
/// each opcode seen at least once (FORGET and BATCH_FORGET included: they get no reply).
pub fn opcode_counts() -> Vec<(&'static str, u64)> {
    BY_OPCODE
        .iter()
        .enumerate()
        .filter_map(|(op, n)| {
            let n = n.load(Ordering::Relaxed);
            (n > 0).then(|| (opcode_name(op as u32), n))
        })
        .collect()
}

/// The name of a FUSE opcode (include/uapi/linux/fuse.h), lower case without `FUSE_`.
fn opcode_name(op: u32) -> &'static str {
    match op {
        1 => "lookup",
        2 => "forget",
        3 => "getattr",
        4 => "setattr",
        5 => "readlink",
        6 => "symlink",
        8 => "mknod",
        9 => "mkdir",
        10 => "unlink",
        11 => "rmdir",
        12 => "rename",
        13 => "link",
        14 => "open",
        15 => "read",
        16 => "write",
        17 => "statfs",
        18 => "release",
        20 => "fsync",
        21 => "setxattr",
        22 => "getxattr",
        23 => "listxattr",
        24 => "removexattr",
        25 => "flush",
        26 => "init",
        27 => "opendir",
        28 => "readdir",
        29 => "releasedir",
        30 => "fsyncdir",
        31 => "getlk",
        32 => "setlk",
        33 => "setlkw",
        34 => "access",
        35 => "create",
        36 => "interrupt",
        37 => "bmap",
        38 => "destroy",
        39 => "ioctl",
        40 => "poll",
        41 => "notify_reply",
        42 => "batch_forget",
        43 => "fallocate",
        44 => "readdirplus",
        45 => "rename2",
        46 => "lseek",
        47 => "copy_file_range",
        48 => "setupmapping",
        49 => "removemapping",
        50 => "syncfs",
        51 => "tmpfile",
        52 => "statx",
        _ => "other",
    }
}

use crate::uring_abi::{
    ENT_COMMIT_ID, ENT_PAYLOAD_SZ, FUSE_IO_URING_CMD_COMMIT_AND_FETCH,
    FUSE_IO_URING_CMD_REGISTER, IN_HDR, OP_IN, OUT_HDR, RING_HDR_SZ, uring_cmd,
};
/// user_data of the eventfd read.
const WAKE_TAG: u64 = u64::MAX;

/// Anonymous memory shared with the kernel (it copies requests in and replies out).
struct Mapped {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain memory; who may touch it when is ruled by the entry's ownership (module doc).
unsafe impl Send for Mapped {}
unsafe impl Sync for Mapped {}

impl Mapped {
    fn new(len: usize) -> io::Result<Mapped> {
        // SAFETY: anonymous private mapping, checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapped { ptr: p.cast(), len })
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

struct RingEntry {
    header: Mapped,
    payload: Mapped,
    iov: Box<[libc::iovec; 2]>,
}

// SAFETY: the iovecs only point into this entry's own mappings.
unsafe impl Send for RingEntry {}
unsafe impl Sync for RingEntry {}

/// What repliers share with a queue thread.
pub(crate) struct QueueShared {
    qid: u16,
    entries: Vec<RingEntry>,
    /// Entries whose reply is written, to be committed by the queue thread: (index, commit_id).
    done: Mutex<Vec<(u16, u64)>>,
    /// Whether `done` holds entries: set and cleared under its lock, read without it by the
    /// queue thread's backlog check (one load per request instead of a lock).
    done_waiting: AtomicBool,
    wake: OwnedFd,
}

impl fmt::Debug for QueueShared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "QueueShared(q{})", self.qid)
    }
}

thread_local! {
    /// The queue this thread serves (its `QueueShared` address), 0 for other threads.
    static ON_QUEUE: Cell<usize> = const { Cell::new(0) };
    /// On a queue thread, while it serves a request: whether anything else waits for it
    /// (requests fetched and not served yet, or replies to commit). See [`ring_queue_idle`].
    static QUEUE_BACKLOG: Cell<bool> = const { Cell::new(true) };
}

/// Whether the calling thread is an io_uring queue thread with nothing but the request it
/// serves now to do: no other request of its queue fetched and waiting, no reply waiting to be
/// committed. A request that waits for the device may then be served here, holding up only
/// requests that arrive while it waits, rather than pay the hand-off to a worker and back
/// (birchfs leads a lone fsync's log batch here). False on any other thread.
pub fn ring_queue_idle() -> bool {
    on_ring_queue() && !QUEUE_BACKLOG.with(Cell::get)
}

/// Whether the calling thread is an io_uring queue thread: its queue's only request loop, so a
/// filesystem must not wait for the device there (birchfs hands such requests to workers).
pub fn on_ring_queue() -> bool {
    ON_QUEUE.with(|q| q.get() != 0)
}

/// The ring entry a reply goes to: the sender of a request that came over io_uring.
#[derive(Debug, Clone)]
pub(crate) struct RingReply {
    queue: Arc<QueueShared>,
    idx: u16,
    commit_id: u64,
}

impl RingReply {
    /// Writes the reply (out header then arguments, as for writev on /dev/fuse) into the
    /// entry and hands the entry back to its queue thread.
    pub(crate) fn send(&self, bufs: &[IoSlice<'_>]) -> io::Result<()> {
        let ent = &self.queue.entries[self.idx as usize];
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let mut result = Ok(());
        // SAFETY: the entry belongs to this reply until it is pushed to `done` below: the
        // kernel does not touch it and the queue thread copied the request out already.
        unsafe {
            let hdr = std::slice::from_raw_parts_mut(ent.header.ptr, RING_HDR_SZ);
            let payload = std::slice::from_raw_parts_mut(ent.payload.ptr, ent.iov[1].iov_len);
            let mut payload_sz = total.saturating_sub(OUT_HDR);
            if total < OUT_HDR || payload_sz > payload.len() {
                // Cannot happen with the negotiated sizes; fail the request, not the entry.
                let mut flat = Vec::with_capacity(OUT_HDR);
                for b in bufs {
                    flat.extend_from_slice(&b[..b.len().min(OUT_HDR - flat.len().min(OUT_HDR))]);
                }
                flat.resize(OUT_HDR, 0);
                hdr[..OUT_HDR].copy_from_slice(&flat);
                hdr[0..4].copy_from_slice(&(OUT_HDR as u32).to_ne_bytes());
                hdr[4..8].copy_from_slice(&(-libc::EIO).to_ne_bytes());
                payload_sz = 0;
                result = Err(io::Error::other(format!(
                    "reply of {total} bytes does not fit a ring entry"
                )));
            } else {
                let mut pos = 0usize;
                for b in bufs {
                    let mut src: &[u8] = b;
                    if pos < OUT_HDR {
                        let n = src.len().min(OUT_HDR - pos);
                        hdr[pos..pos + n].copy_from_slice(&src[..n]);
                        pos += n;
                        src = &src[n..];
                    }
                    let at = pos - OUT_HDR;
                    payload[at..at + src.len()].copy_from_slice(src);
                    pos += src.len();
                }
            }
            hdr[ENT_PAYLOAD_SZ..ENT_PAYLOAD_SZ + 4]
                .copy_from_slice(&(payload_sz as u32).to_ne_bytes());
        }
        {
            let mut done = self.queue.done.lock();
            done.push((self.idx, self.commit_id));
            self.queue.done_waiting.store(true, Ordering::Release);
        }
        let here = Arc::as_ptr(&self.queue) as usize;
        if ON_QUEUE.with(Cell::get) != here {
            // SAFETY: eventfd_write on our eventfd.
            unsafe { libc::eventfd_write(self.queue.wake.as_raw_fd(), 1) };
        }
        result
    }
}

/// One queue, owned by its thread.
pub(crate) struct Queue {
    shared: Arc<QueueShared>,
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
}

/// The queues made before INIT is answered.
pub(crate) struct Rings {
    pub(crate) queues: Vec<Queue>,
    pub(crate) mountpoint: Option<PathBuf>,
    /// [`UringOptions::fallback_level`]: for entries the kernel refuses to register.
    pub(crate) fallback_level: log::Level,
    payload_len: usize,
}

impl fmt::Debug for Rings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Rings({} queues, payload {})",
            self.queues.len(),
            self.payload_len
        )
    }
}

/// Number of queues the kernel expects: one per possible CPU.
pub(crate) fn possible_cpus() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| {
            s.trim()
                .rsplit(['-', ','])
                .next()
                .and_then(|x| x.parse::<usize>().ok())
        })
        .map_or(1, |m| m + 1)
}

/// Makes every queue's ring and buffers; `payload` is the payload buffer size the kernel
/// requires (at least max_write and max_pages pages).
pub(crate) fn setup(opts: &UringOptions, payload: usize) -> io::Result<Rings> {
    let depth = opts.queue_depth.clamp(1, 1024);
    let page = page_size::get();
    let payload = payload.div_ceil(page) * page;
    let mut queues = Vec::new();
    for qid in 0..possible_cpus() {
        let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
            .build((2 * depth + 2).next_power_of_two() as u32)?;
        let mut entries = Vec::with_capacity(depth);
        for _ in 0..depth {
            let header = Mapped::new(page)?;
            let payload_map = Mapped::new(payload)?;
            let iov = Box::new([
                libc::iovec {
                    iov_base: header.ptr.cast(),
                    iov_len: RING_HDR_SZ,
                },
                libc::iovec {
                    iov_base: payload_map.ptr.cast(),
                    iov_len: if opts.break_register { 4096 } else { payload },
                },
            ]);
            entries.push(RingEntry {
                header,
                payload: payload_map,
                iov,
            });
        }
        // SAFETY: eventfd(2); checked below.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(io::Error::last_os_error());
        }
        queues.push(Queue {
            shared: Arc::new(QueueShared {
                qid: qid as u16,
                entries,
                done: Mutex::new(Vec::with_capacity(depth)),
                done_waiting: AtomicBool::new(false),
                // SAFETY: a descriptor we just opened and own.
                wake: unsafe { OwnedFd::from_raw_fd(efd) },
            }),
            ring,
        });
    }
    Ok(Rings {
        queues,
        mountpoint: opts.mountpoint.clone(),
        fallback_level: opts.fallback_level(),
        payload_len: payload,
    })
}

fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t with one CPU set, for this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) != 0 {
            debug!("uring: pin to CPU {cpu}: {}", io::Error::last_os_error());
        }
    }
}

/// Aborts the FUSE connection mounted at `mountpoint` (found in /proc/self/mountinfo, never
/// through the mount itself, which may not answer).
pub(crate) fn abort_connection(mountpoint: Option<&Path>) {
    let Some(mnt) = mountpoint else {
        error!("uring: cannot abort the connection: mount point unknown");
        return;
    };
    let target = mnt.to_string_lossy().into_owned();
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let dev = info
        .lines()
        .rev()
        .map(|l| l.split(' ').collect::<Vec<_>>())
        .find(|f| {
            f.get(4).map(|m| unescape(m)) == Some(target.clone())
                && f.iter()
                    .position(|x| *x == "-")
                    .and_then(|d| f.get(d + 1))
                    .is_some_and(|t| t.starts_with("fuse"))
        })
        .and_then(|f| {
            f.get(2)
                .and_then(|d| d.split(':').nth(1))
                .map(str::to_string)
        });
    let Some(minor) = dev else {
        error!("uring: cannot abort the connection: {target} not in /proc/self/mountinfo");
        return;
    };
    let path = format!("/sys/fs/fuse/connections/{minor}/abort");
    match std::fs::write(&path, "1") {
        Ok(()) => error!("uring: aborted the FUSE connection ({path})"),
        Err(e) => error!("uring: abort the FUSE connection: {path}: {e}"),
    }
}

fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(u8::is_ascii_digit) {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Aborts the connection when dropped while armed: a queue thread that ends (or panics)
/// before its registrations went to the kernel.
struct AbortUnlessRegistered<'a> {
    armed: bool,
    qid: u16,
    mountpoint: Option<&'a Path>,
}

impl Drop for AbortUnlessRegistered<'_> {
    fn drop(&mut self) {
        if self.armed {
            error!(
                "uring: queue {} ended before registering with the kernel, which would wait for it forever",
                self.qid
            );
            abort_connection(self.mountpoint);
        }
    }
}

fn errno_of(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

/// The queue thread: registers the entries, then serves requests until every entry has ended.
pub(crate) fn queue_loop<FS: Filesystem>(
    mut q: Queue,
    dev: ChannelSender,
    fd: RawFd,
    se: SessionEventLoop<FS>,
    mountpoint: Option<PathBuf>,
    fallback_level: log::Level,
) {
    let shared = q.shared.clone();
    let qid = shared.qid;
    let mut guard = AbortUnlessRegistered {
        armed: true,
        qid,
        mountpoint: mountpoint.as_deref(),
    };
    pin_to_cpu(qid as usize);
    ON_QUEUE.with(|c| c.set(Arc::as_ptr(&shared) as usize));
    let mut wake_buf = Box::new(0u64);
    let wake_read = |buf: &mut u64| {
        squeue::Entry128::from(
            opcode::Read::new(
                types::Fd(shared.wake.as_raw_fd()),
                std::ptr::from_mut(buf).cast::<u8>(),
                8,
            )
            .build()
            .user_data(WAKE_TAG),
        )
    };
    {
        let mut sq = q.ring.submission();
        for (i, ent) in shared.entries.iter().enumerate() {
            let e = uring_cmd(
                fd,
                qid,
                i as u16,
                FUSE_IO_URING_CMD_REGISTER,
                0,
                Some(ent.iov.as_ptr() as u64),
            );
            // SAFETY: the iovecs and buffers live as long as `shared`, which outlives the ring.
            if unsafe { sq.push(&e) }.is_err() {
                error!("uring: queue {qid}: submission queue full");
                return;
            }
        }
        // SAFETY: `wake_buf` outlives the ring's use of it (dropped after the ring).
        if unsafe { sq.push(&wake_read(&mut wake_buf)) }.is_err() {
            error!("uring: queue {qid}: submission queue full");
            return;
        }
    }
    loop {
        match q.ring.submit() {
            Ok(_) => break,
            Err(e) if errno_of(&e) == libc::EINTR => continue,
            Err(e) => {
                error!("uring: queue {qid}: submitting registrations: {e}");
                return;
            }
        }
    }
    guard.armed = false;
    debug!(
        "uring: queue {qid}: {} entries registered",
        shared.entries.len()
    );

    let payload_len = shared.entries.first().map_or(0, |e| e.iov[1].iov_len);
    let mut buf = vec![0u8; IN_HDR + OP_IN + payload_len];
    let mut live = shared.entries.len();
    let mut completions: Vec<(u64, i32)> = Vec::with_capacity(2 * live + 2);
    let mut served_any = false;
    // Whether an entry ended the way the connection's end ends them (unmount, abort), and
    // whether the loop stopped on an error of its own: a queue that stops while the connection
    // lives leaves the requests of its CPU waiting for entries that never come back (the kernel
    // does not fall back to /dev/fuse once the ring is ready), so it aborts the connection.
    let mut teardown_seen = false;
    let mut broken = false;
    while live > 0 {
        let done = if shared.done_waiting.load(Ordering::Acquire) {
            let mut waiting = shared.done.lock();
            shared.done_waiting.store(false, Ordering::Release);
            std::mem::take(&mut *waiting)
        } else {
            Vec::new()
        };
        if !done.is_empty() {
            let mut sq = q.ring.submission();
            for (idx, commit_id) in done {
                let e = uring_cmd(
                    fd,
                    qid,
                    idx,
                    FUSE_IO_URING_CMD_COMMIT_AND_FETCH,
                    commit_id,
                    None,
                );
                // SAFETY: as for REGISTER. The ring has room for every entry twice.
                if unsafe { sq.push(&e) }.is_err() {
                    error!("uring: queue {qid}: submission queue full, entry {idx} lost");
                    live -= 1;
                }
            }
        }
        if let Err(e) = q.ring.submit_and_wait(1) {
            match errno_of(&e) {
                libc::EINTR => continue,
                // Completions to reap first, or the kernel short of memory for a moment: reap
                // what there is, and wait a little rather than spin when there is nothing.
                libc::EAGAIN | libc::EBUSY => {
                    if q.ring.completion().is_empty() {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                        continue;
                    }
                }
                _ => {
                    error!("uring: queue {qid}: io_uring_enter: {e}");
                    broken = true;
                    break;
                }
            }
        }
        completions.clear();
        completions.extend(q.ring.completion().map(|c| (c.user_data(), c.result())));
        for (k, &(tag, res)) in completions.iter().enumerate() {
            if tag == WAKE_TAG {
                let e = wake_read(&mut wake_buf);
                // SAFETY: as above.
                let _ = unsafe { q.ring.submission().push(&e) };
                continue;
            }
            let idx = tag as u16;
            if res < 0 {
                live -= 1;
                let err = io::Error::from_raw_os_error(-res);
                match -res {
                    libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED | libc::ENODEV => {
                        teardown_seen = true;
                        debug!("uring: queue {qid}: entry {idx} ended: {err}");
                    }
                    _ if !served_any => log::log!(
                        fallback_level,
                        "uring: queue {qid}: entry {idx} not registered ({err}); the kernel serves over /dev/fuse"
                    ),
                    _ => warn!("uring: queue {qid}: entry {idx} failed: {err}"),
                }
                continue;
            }
            served_any = true;
            // Anything else to do: completions after this one (requests, or the eventfd that
            // says replies wait to be committed), completions the kernel posted since, or
            // replies already waiting.
            let backlog = k + 1 < completions.len()
                || !q.ring.completion().is_empty()
                || shared.done_waiting.load(Ordering::Acquire);
            QUEUE_BACKLOG.with(|b| b.set(backlog));
            serve_entry(&shared, idx, &mut buf, &dev, &se);
            QUEUE_BACKLOG.with(|b| b.set(true));
        }
    }
    debug!("uring: queue {qid} ended");
    if broken || (served_any && !teardown_seen) {
        error!(
            "uring: queue {qid} stopped while the connection lives; aborting the connection rather than leave requests waiting for it"
        );
        abort_connection(mountpoint.as_deref());
    }
    // The ring (and with it the eventfd read into `wake_buf`) goes before `wake_buf`.
    drop(q);
    drop(wake_buf);
}

/// Copies the request of entry `idx` into `buf`, dispatches it, counts it.
fn serve_entry<FS: Filesystem>(
    shared: &Arc<QueueShared>,
    idx: u16,
    buf: &mut [u8],
    dev: &ChannelSender,
    se: &SessionEventLoop<FS>,
) {
    let ent = &shared.entries[idx as usize];
    // SAFETY: the kernel filled the entry and completed its command; until the reply is
    // committed only this request's reply touches the entry, and it has not been made yet.
    let (hdr, payload) = unsafe {
        (
            std::slice::from_raw_parts(ent.header.ptr, RING_HDR_SZ),
            std::slice::from_raw_parts(ent.payload.ptr, ent.iov[1].iov_len),
        )
    };
    let u32_at = |b: &[u8], o: usize| u32::from_ne_bytes(b[o..o + 4].try_into().unwrap_or([0; 4]));
    let u64_at = |b: &[u8], o: usize| u64::from_ne_bytes(b[o..o + 8].try_into().unwrap_or([0; 8]));
    let len = u32_at(hdr, 0) as usize;
    let commit_id = u64_at(hdr, ENT_COMMIT_ID);
    let payload_sz = (u32_at(hdr, ENT_PAYLOAD_SZ) as usize).min(payload.len());
    let op_len = len.saturating_sub(IN_HDR + payload_sz).min(OP_IN);
    buf[..IN_HDR].copy_from_slice(&hdr[..IN_HDR]);
    buf[IN_HDR..IN_HDR + op_len].copy_from_slice(&hdr[OP_IN..OP_IN + op_len]);
    let total = IN_HDR + op_len + payload_sz;
    buf[IN_HDR + op_len..total].copy_from_slice(&payload[..payload_sz]);
    RING_SERVED.fetch_add(1, Ordering::Relaxed);
    count_opcode(&buf[..total]);
    let sender = dev.with_ring(RingReply {
        queue: shared.clone(),
        idx,
        commit_id,
    });
    match RequestWithSender::new(sender.clone(), &buf[..total]) {
        Some(req) => {
            if let Ok(Operation::Destroy(_)) = req.request.operation() {
                req.reply::<ReplyEmpty>().ok();
            } else {
                req.dispatch(se);
            }
        }
        None => {
            // Unparsable: answer EIO so that the entry comes back.
            let unique = u64_at(hdr, 8);
            let mut out = [0u8; OUT_HDR];
            out[0..4].copy_from_slice(&(OUT_HDR as u32).to_ne_bytes());
            out[4..8].copy_from_slice(&(-libc::EIO).to_ne_bytes());
            out[8..16].copy_from_slice(&unique.to_ne_bytes());
            if let Err(e) = sender.send(&[IoSlice::new(&out)]) {
                warn!("uring: reply EIO: {e}");
            }
        }
    }
}

/// Logs where requests went (at unmount).
pub(crate) fn log_counts() {
    let (dev, ring) = transport_counts();
    info!("FUSE requests served: {ring} over io_uring, {dev} over /dev/fuse");
}
