//! Throwaway prototype: a minimal FUSE server on birch-core with two transports,
//! classic /dev/fuse read/write and FUSE over io_uring, sharing one request handler.
//!
//!   proto-uring mkfs IMG SIZE_MIB
//!   proto-uring serve IMG MNT classic|uring [THREADS] [DEPTH] [TTL_SECS]

use std::ffi::CString;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use birch_core::vfs::{Attr, Caller, FileKind};
use birch_core::{Filesystem, MkfsOptions, OpenOptions};
use io_uring::{cqueue, opcode, squeue, types, IoUring};

// ---------------------------------------------------------------- kernel ABI
const FUSE_LOOKUP: u32 = 1;
const FUSE_FORGET: u32 = 2;
const FUSE_GETATTR: u32 = 3;
const FUSE_MKDIR: u32 = 9;
const FUSE_UNLINK: u32 = 10;
const FUSE_RMDIR: u32 = 11;
const FUSE_OPEN: u32 = 14;
const FUSE_WRITE: u32 = 16;
const FUSE_STATFS: u32 = 17;
const FUSE_RELEASE: u32 = 18;
const FUSE_INIT: u32 = 26;
const FUSE_INTERRUPT: u32 = 36;
const FUSE_DESTROY: u32 = 38;
const FUSE_CREATE: u32 = 35;
const FUSE_BATCH_FORGET: u32 = 42;

const FUSE_ASYNC_READ: u32 = 1 << 0;
const FUSE_BIG_WRITES: u32 = 1 << 5;
const FUSE_PARALLEL_DIROPS: u32 = 1 << 18;
const FUSE_INIT_EXT: u32 = 1 << 30;
const FUSE_OVER_IO_URING_FLAGS2: u32 = 1 << (41 - 32);
const FOPEN_DIRECT_IO: u32 = 1 << 0;

const FUSE_IO_URING_CMD_REGISTER: u32 = 1;
const FUSE_IO_URING_CMD_COMMIT_AND_FETCH: u32 = 2;

const IN_HDR: usize = 40;
const OUT_HDR: usize = 16;
const MAX_WRITE: usize = 128 * 1024;
/// Ring payload buffer: >= max(8 KiB, max_write, max_pages * 4 KiB) (dev_uring.c).
const RING_PAYLOAD: usize = 256 * 1024;
/// struct fuse_uring_req_header: in_out[128] op_in[128] ent_in_out[32].
const RING_HDR_SZ: usize = 288;
const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_e500; // _IOR(229, 0, u32)

#[derive(Clone, Copy, Default)]
#[repr(C)]
struct InHeader {
    len: u32,
    opcode: u32,
    unique: u64,
    nodeid: u64,
    uid: u32,
    gid: u32,
    pid: u32,
    total_extlen: u16,
    padding: u16,
}

#[repr(C)]
struct OutHeader {
    len: u32,
    error: i32,
    unique: u64,
}

#[repr(C)]
#[derive(Default)]
struct FuseAttr {
    ino: u64,
    size: u64,
    blocks: u64,
    atime: u64,
    mtime: u64,
    ctime: u64,
    atimensec: u32,
    mtimensec: u32,
    ctimensec: u32,
    mode: u32,
    nlink: u32,
    uid: u32,
    gid: u32,
    rdev: u32,
    blksize: u32,
    flags: u32,
}

#[repr(C)]
struct EntryOut {
    nodeid: u64,
    generation: u64,
    entry_valid: u64,
    attr_valid: u64,
    entry_valid_nsec: u32,
    attr_valid_nsec: u32,
    attr: FuseAttr,
}

#[repr(C)]
struct AttrOut {
    attr_valid: u64,
    attr_valid_nsec: u32,
    dummy: u32,
    attr: FuseAttr,
}

#[repr(C)]
struct OpenOut {
    fh: u64,
    open_flags: u32,
    backing_id: i32,
}

#[repr(C)]
struct InitOut {
    major: u32,
    minor: u32,
    max_readahead: u32,
    flags: u32,
    max_background: u16,
    congestion_threshold: u16,
    max_write: u32,
    time_gran: u32,
    max_pages: u16,
    map_alignment: u16,
    flags2: u32,
    max_stack_depth: u32,
    request_timeout: u16,
    unused: [u16; 11],
}

#[repr(C)]
struct Kstatfs {
    blocks: u64,
    bfree: u64,
    bavail: u64,
    files: u64,
    ffree: u64,
    bsize: u32,
    namelen: u32,
    frsize: u32,
    padding: u32,
    spare: [u32; 6],
}

#[repr(C)]
struct WriteOut {
    size: u32,
    padding: u32,
}

const _: () = assert!(std::mem::size_of::<InHeader>() == IN_HDR);
const _: () = assert!(std::mem::size_of::<FuseAttr>() == 88);
const _: () = assert!(std::mem::size_of::<EntryOut>() == 128);
const _: () = assert!(std::mem::size_of::<AttrOut>() == 104);
const _: () = assert!(std::mem::size_of::<InitOut>() == 64);
const _: () = assert!(std::mem::size_of::<Kstatfs>() == 80);

fn rd<T: Copy>(b: &[u8], off: usize) -> T {
    assert!(off + std::mem::size_of::<T>() <= b.len(), "short request");
    unsafe { std::ptr::read_unaligned(b.as_ptr().add(off) as *const T) }
}
fn rd_u32(b: &[u8], off: usize) -> u32 {
    rd::<u32>(b, off)
}
fn rd_u64(b: &[u8], off: usize) -> u64 {
    rd::<u64>(b, off)
}
fn put<T>(out: &mut [u8], v: T) -> usize {
    let n = std::mem::size_of::<T>();
    assert!(n <= out.len());
    unsafe { std::ptr::write_unaligned(out.as_mut_ptr() as *mut T, v) };
    n
}
fn name_of(b: &[u8]) -> &[u8] {
    match b.iter().position(|&c| c == 0) {
        Some(i) => &b[..i],
        None => b,
    }
}

/// Size of the fixed per-opcode header (in_args[0]) for the opcodes served here.
fn op_in_size(opcode: u32) -> usize {
    match opcode {
        FUSE_FORGET => 8,
        FUSE_GETATTR => 16,
        FUSE_MKDIR => 8,
        FUSE_OPEN => 8,
        FUSE_WRITE => 40,
        FUSE_RELEASE => 24,
        FUSE_CREATE => 16,
        FUSE_BATCH_FORGET => 8,
        FUSE_INTERRUPT => 8,
        _ => 0,
    }
}

// ---------------------------------------------------------------- request handling

struct Server {
    fs: Filesystem,
    ttl: u64,
    /// Requests answered through each transport: [classic, uring].
    served: [AtomicU64; 2],
}

enum Reply {
    None,
    Ok(usize),
    Err(i32),
}

fn fuse_attr(a: &Attr) -> FuseAttr {
    let t = match a.kind {
        FileKind::File => libc::S_IFREG,
        FileKind::Dir => libc::S_IFDIR,
        FileKind::Symlink => libc::S_IFLNK,
        FileKind::Fifo => libc::S_IFIFO,
        FileKind::Socket => libc::S_IFSOCK,
        FileKind::CharDevice => libc::S_IFCHR,
        FileKind::BlockDevice => libc::S_IFBLK,
    };
    FuseAttr {
        ino: a.ino,
        size: a.size,
        blocks: a.blocks,
        atime: a.atime.sec as u64,
        mtime: a.mtime.sec as u64,
        ctime: a.ctime.sec as u64,
        atimensec: a.atime.nsec,
        mtimensec: a.mtime.nsec,
        ctimensec: a.ctime.nsec,
        mode: t | a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev as u32,
        blksize: a.blksize,
        flags: 0,
    }
}

impl Server {
    fn entry(&self, a: &Attr) -> EntryOut {
        EntryOut {
            nodeid: a.ino,
            generation: a.generation,
            entry_valid: self.ttl,
            attr_valid: self.ttl,
            entry_valid_nsec: 0,
            attr_valid_nsec: 0,
            attr: fuse_attr(a),
        }
    }

    /// One request: `op` is the fixed per-opcode struct, `payload` the rest (names, data);
    /// the reply's arguments (no out header) go to `out`.
    fn handle(&self, h: &InHeader, op: &[u8], payload: &[u8], out: &mut [u8]) -> Reply {
        let fs = &self.fs;
        let err = |e: birch_core::Error| Reply::Err(e.errno());
        match h.opcode {
            FUSE_LOOKUP => match fs.lookup(h.nodeid, name_of(payload)) {
                Ok(a) => Reply::Ok(put(out, self.entry(&a))),
                Err(e) => err(e),
            },
            FUSE_FORGET => {
                fs.forget(h.nodeid, rd_u64(op, 0));
                Reply::None
            }
            FUSE_BATCH_FORGET => {
                let count = rd_u32(op, 0) as usize;
                for i in 0..count {
                    let ino = rd_u64(payload, i * 16);
                    let n = rd_u64(payload, i * 16 + 8);
                    fs.forget(ino, n);
                }
                Reply::None
            }
            FUSE_INTERRUPT => Reply::None,
            FUSE_GETATTR => match fs.getattr(h.nodeid) {
                Ok(a) => Reply::Ok(put(
                    out,
                    AttrOut {
                        attr_valid: self.ttl,
                        attr_valid_nsec: 0,
                        dummy: 0,
                        attr: fuse_attr(&a),
                    },
                )),
                Err(e) => err(e),
            },
            FUSE_CREATE => {
                let flags = rd_u32(op, 0) as i32;
                let mode = rd_u32(op, 4);
                let caller = Caller {
                    uid: h.uid,
                    gid: h.gid,
                    umask: 0,
                };
                match fs.create(caller, h.nodeid, name_of(payload), mode, flags) {
                    Ok((a, fh)) => {
                        let n = put(out, self.entry(&a));
                        let n2 = put(
                            &mut out[n..],
                            OpenOut {
                                fh,
                                open_flags: open_flags(flags),
                                backing_id: 0,
                            },
                        );
                        Reply::Ok(n + n2)
                    }
                    Err(e) => err(e),
                }
            }
            FUSE_MKDIR => {
                let mode = rd_u32(op, 0);
                let caller = Caller {
                    uid: h.uid,
                    gid: h.gid,
                    umask: 0,
                };
                match fs.mkdir(caller, h.nodeid, name_of(payload), mode) {
                    Ok(a) => Reply::Ok(put(out, self.entry(&a))),
                    Err(e) => err(e),
                }
            }
            FUSE_OPEN => {
                let flags = rd_u32(op, 0) as i32;
                match fs.open_file(h.nodeid, flags) {
                    Ok(fh) => Reply::Ok(put(
                        out,
                        OpenOut {
                            fh,
                            open_flags: open_flags(flags),
                            backing_id: 0,
                        },
                    )),
                    Err(e) => err(e),
                }
            }
            FUSE_RELEASE => match fs.release(h.nodeid, rd_u64(op, 0)) {
                Ok(()) => Reply::Ok(0),
                Err(e) => err(e),
            },
            FUSE_WRITE => {
                let offset = rd_u64(op, 8);
                let size = rd_u32(op, 16) as usize;
                let flags = rd_u32(op, 32) as i32;
                let data = &payload[..size.min(payload.len())];
                match fs.write(h.nodeid, offset, data, flags & libc::O_APPEND != 0) {
                    Ok(n) => Reply::Ok(put(
                        out,
                        WriteOut {
                            size: n,
                            padding: 0,
                        },
                    )),
                    Err(e) => err(e),
                }
            }
            FUSE_UNLINK => match fs.unlink(h.nodeid, name_of(payload)) {
                Ok(()) => Reply::Ok(0),
                Err(e) => err(e),
            },
            FUSE_RMDIR => match fs.rmdir(h.nodeid, name_of(payload)) {
                Ok(()) => Reply::Ok(0),
                Err(e) => err(e),
            },
            FUSE_STATFS => {
                let s = fs.statfs();
                Reply::Ok(put(
                    out,
                    Kstatfs {
                        blocks: s.blocks,
                        bfree: s.bfree,
                        bavail: s.bavail,
                        files: s.files,
                        ffree: s.ffree,
                        bsize: s.bsize,
                        namelen: s.namelen,
                        frsize: s.frsize,
                        padding: 0,
                        spare: [0; 6],
                    },
                ))
            }
            FUSE_DESTROY => Reply::Ok(0),
            // FLUSH, GETXATTR, SETATTR, ACCESS, OPENDIR, ...: the kernel stops sending
            // FLUSH/GETXATTR/ACCESS after the first ENOSYS.
            _ => Reply::Err(libc::ENOSYS),
        }
    }
}

fn open_flags(flags: i32) -> u32 {
    if flags & libc::O_DIRECT != 0 {
        FOPEN_DIRECT_IO
    } else {
        0
    }
}

// ---------------------------------------------------------------- mount

fn mount(fd: i32, mnt: &str) -> io::Result<()> {
    let src = CString::new("birchproto").unwrap();
    let target = CString::new(mnt).unwrap();
    let fstype = CString::new("fuse.birchproto").unwrap();
    let data = CString::new(format!(
        "fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other"
    ))
    .unwrap();
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            data.as_ptr() as *const libc::c_void,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn open_dev() -> io::Result<i32> {
    let fd = unsafe { libc::open(c"/dev/fuse".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

fn clone_fd(master: i32) -> io::Result<i32> {
    let fd = open_dev()?;
    let m: u32 = master as u32;
    let rc = unsafe { libc::ioctl(fd, FUSE_DEV_IOC_CLONE, &m as *const u32) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        unsafe { libc::close(fd) };
        return Err(e);
    }
    Ok(fd)
}

// ---------------------------------------------------------------- classic transport

fn classic_loop(srv: Arc<Server>, fd: i32, stop: Arc<AtomicBool>) {
    let mut buf = vec![0u8; MAX_WRITE + 64 * 1024];
    let mut reply = vec![0u8; 64 * 1024];
    loop {
        let n = unsafe { libc::read(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error().raw_os_error().unwrap_or(0);
            match e {
                libc::EINTR | libc::EAGAIN | libc::ENOENT => continue,
                libc::ENODEV => break,
                _ => {
                    eprintln!("classic: read /dev/fuse: errno {e}");
                    break;
                }
            }
        }
        let msg = &buf[..n as usize];
        let h: InHeader = rd(msg, 0);
        let args = &msg[IN_HDR..h.len as usize];
        let split = op_in_size(h.opcode).min(args.len());
        let (op, payload) = args.split_at(split);
        let (hdr_out, out) = reply.split_at_mut(OUT_HDR);
        let r = srv.handle(&h, op, payload, out);
        srv.served[0].fetch_add(1, Ordering::Relaxed);
        let (error, len) = match r {
            Reply::None => continue,
            Reply::Ok(len) => (0, len),
            Reply::Err(e) => (-e, 0),
        };
        put(
            hdr_out,
            OutHeader {
                len: (OUT_HDR + len) as u32,
                error,
                unique: h.unique,
            },
        );
        let w = unsafe { libc::write(fd, reply.as_ptr() as *const libc::c_void, OUT_HDR + len) };
        if w < 0 {
            let e = io::Error::last_os_error().raw_os_error().unwrap_or(0);
            if e == libc::ENODEV {
                break;
            }
            // ENOENT: the request was interrupted; nothing to do.
            if e != libc::ENOENT {
                eprintln!("classic: write reply op {}: errno {e}", h.opcode);
            }
        }
    }
    stop.store(true, Ordering::SeqCst);
}

// ---------------------------------------------------------------- io_uring transport

struct Mapped {
    ptr: *mut u8,
    len: usize,
}
unsafe impl Send for Mapped {}
impl Mapped {
    fn new(len: usize) -> io::Result<Mapped> {
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapped {
            ptr: p as *mut u8,
            len,
        })
    }
    #[allow(clippy::mut_from_ref)]
    fn bytes(&self) -> &mut [u8] {
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}
impl Drop for Mapped {
    fn drop(&mut self) {
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

struct RingEnt {
    header: Mapped,
    payload: Mapped,
    iov: Box<[libc::iovec; 2]>,
    commit_id: u64,
}

unsafe impl Send for RingEnt {}

struct Queue {
    qid: u16,
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    ents: Vec<RingEnt>,
}

/// Everything that can fail before INIT is answered: ring creation and buffers.
fn queue_setup(qid: u16, depth: usize) -> io::Result<Queue> {
    let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder().build((depth * 2) as u32)?;
    let mut ents = Vec::with_capacity(depth);
    for _ in 0..depth {
        let header = Mapped::new(4096)?;
        let payload = Mapped::new(RING_PAYLOAD)?;
        // PU_BREAK_REGISTER=1 (fail-closed test): a payload buffer smaller than the kernel's
        // max_payload_sz, so every REGISTER fails with EINVAL after INIT agreed to io_uring.
        let payload_len = if std::env::var_os("PU_BREAK_REGISTER").is_some() {
            4096
        } else {
            RING_PAYLOAD
        };
        let iov = Box::new([
            libc::iovec {
                iov_base: header.ptr as *mut libc::c_void,
                iov_len: RING_HDR_SZ,
            },
            libc::iovec {
                iov_base: payload.ptr as *mut libc::c_void,
                iov_len: payload_len,
            },
        ]);
        ents.push(RingEnt {
            header,
            payload,
            iov,
            commit_id: 0,
        });
    }
    Ok(Queue { qid, ring, ents })
}

fn uring_cmd(fd: i32, qid: u16, idx: usize, cmd_op: u32, commit_id: u64, iov: Option<u64>) -> squeue::Entry128 {
    let mut cmd = [0u8; 80];
    // struct fuse_uring_cmd_req { u64 flags; u64 commit_id; u16 qid; u8 padding[6]; }
    cmd[8..16].copy_from_slice(&commit_id.to_ne_bytes());
    cmd[16..18].copy_from_slice(&qid.to_ne_bytes());
    let mut b = opcode::UringCmd80::new(types::Fd(fd), cmd_op).cmd(cmd);
    if let Some(addr) = iov {
        b = b.addr(Some(addr));
    }
    let mut e = b.build().user_data(idx as u64);
    if iov.is_some() {
        // sqe->len = 2 (header and payload iovecs); the crate has no setter for it.
        let raw = &mut e as *mut squeue::Entry128 as *mut u8;
        unsafe { std::ptr::write_unaligned(raw.add(24) as *mut u32, 2) };
    }
    e
}

fn pin_to_cpu(cpu: usize) {
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn uring_loop(srv: Arc<Server>, fd: i32, mut q: Queue, go: Arc<Barrier>) {
    pin_to_cpu(q.qid as usize);
    go.wait(); // INIT has been answered: the kernel accepts registrations now
    let qid = q.qid;
    for (i, ent) in q.ents.iter().enumerate() {
        let e = uring_cmd(fd, qid, i, FUSE_IO_URING_CMD_REGISTER, 0, Some(ent.iov.as_ptr() as u64));
        unsafe { q.ring.submission().push(&e).expect("sq full") };
    }
    let mut done: Vec<(u64, i32)> = Vec::with_capacity(q.ents.len());
    let mut scratch = vec![0u8; 64 * 1024];
    loop {
        if let Err(e) = q.ring.submit_and_wait(1) {
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            eprintln!("uring q{qid}: submit_and_wait: {e}");
            return;
        }
        done.clear();
        done.extend(q.ring.completion().map(|c| (c.user_data(), c.result())));
        for &(idx, res) in &done {
            let idx = idx as usize;
            if res < 0 {
                let e = -res;
                if e == libc::ENOTCONN || e == libc::ECONNABORTED || e == libc::ECANCELED {
                    return; // unmounted
                }
                eprintln!(
                    "uring q{qid}: entry {idx} command failed: errno {e} ({})",
                    io::Error::from_raw_os_error(e)
                );
                return;
            }
            let ent = &mut q.ents[idx];
            let hb = ent.header.bytes();
            let h: InHeader = rd(hb, 0);
            // fuse_uring_ent_in_out at 256: flags u64, commit_id u64, payload_sz u32
            ent.commit_id = rd_u64(hb, 256 + 8);
            let payload_sz = rd_u32(hb, 256 + 16) as usize;
            let op_len = (h.len as usize).saturating_sub(IN_HDR + payload_sz).min(128);
            let pb = ent.payload.bytes();
            // The request's arguments are read before the reply overwrites the payload
            // buffer: copy op header (<=128 bytes) to the stack.
            let mut op_copy = [0u8; 128];
            op_copy[..op_len].copy_from_slice(&hb[128..128 + op_len]);
            let want = op_in_size(h.opcode);
            // Replies here are small (<= 144 bytes): built in a scratch buffer, then copied
            // into the payload buffer, so input and output never alias.
            let r = if op_len == want {
                srv.handle(&h, &op_copy[..op_len], &pb[..payload_sz], &mut scratch)
            } else {
                // Layout differs from the table: join op_in and payload and split by table.
                let mut args = op_copy[..op_len].to_vec();
                args.extend_from_slice(&pb[..payload_sz]);
                let split = want.min(args.len());
                let (op, payload) = args.split_at(split);
                srv.handle(&h, op, payload, &mut scratch)
            };
            if let Reply::Ok(len) = r {
                pb[..len].copy_from_slice(&scratch[..len]);
            }
            srv.served[1].fetch_add(1, Ordering::Relaxed);
            let (error, len) = match r {
                Reply::None => (0, 0), // FORGET does not travel over the ring; answer anyway
                Reply::Ok(len) => (0, len),
                Reply::Err(e) => (-e, 0),
            };
            put(
                &mut hb[..OUT_HDR],
                OutHeader {
                    len: (OUT_HDR + len) as u32,
                    error,
                    unique: h.unique,
                },
            );
            hb[256 + 16..256 + 20].copy_from_slice(&(len as u32).to_ne_bytes());
            let e = uring_cmd(fd, qid, idx, FUSE_IO_URING_CMD_COMMIT_AND_FETCH, ent.commit_id, None);
            unsafe { q.ring.submission().push(&e).expect("sq full") };
        }
    }
}

// ---------------------------------------------------------------- main

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("mkfs") => {
            let size: u64 = args[3].parse().expect("size MiB");
            let _ = std::fs::remove_file(&args[2]);
            Filesystem::mkfs_path(Path::new(&args[2]), Some(size << 20), &MkfsOptions::default())
                .expect("mkfs");
        }
        Some("serve") => serve(&args[2..]),
        _ => {
            eprintln!("usage: proto-uring mkfs IMG SIZE_MIB | serve IMG MNT classic|uring [THREADS] [DEPTH] [TTL]");
            std::process::exit(2);
        }
    }
}

fn serve(a: &[String]) {
    let img = &a[0];
    let mnt = &a[1];
    let want_uring = match a[2].as_str() {
        "classic" => false,
        "uring" => true,
        t => panic!("transport {t}"),
    };
    let threads: usize = a.get(3).map(|s| s.parse().unwrap()).unwrap_or(2);
    let depth: usize = a.get(4).map(|s| s.parse().unwrap()).unwrap_or(8);
    let ttl: u64 = a.get(5).map(|s| s.parse().unwrap()).unwrap_or(0);

    let fs = Filesystem::open(Path::new(img), OpenOptions::default()).expect("open image");
    let srv = Arc::new(Server {
        fs,
        ttl,
        served: [AtomicU64::new(0), AtomicU64::new(0)],
    });
    let fd = open_dev().expect("open /dev/fuse");
    mount(fd, mnt).expect("mount");

    // INIT arrives first on the master descriptor.
    let mut buf = vec![0u8; MAX_WRITE + 64 * 1024];
    let n = unsafe { libc::read(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len()) };
    assert!(n > 0, "read INIT: {}", io::Error::last_os_error());
    let h: InHeader = rd(&buf, 0);
    assert_eq!(h.opcode, FUSE_INIT);
    let major = rd_u32(&buf, IN_HDR);
    let minor = rd_u32(&buf, IN_HDR + 4);
    let max_readahead = rd_u32(&buf, IN_HDR + 8);
    let kflags = rd_u32(&buf, IN_HDR + 12);
    let kflags2 = if kflags & FUSE_INIT_EXT != 0 {
        rd_u32(&buf, IN_HDR + 16)
    } else {
        0
    };
    eprintln!("INIT: kernel {major}.{minor} flags {kflags:#x} flags2 {kflags2:#x}");

    // Fail closed: agree to io_uring only if the kernel offers it AND every queue's ring and
    // buffers exist already. Registration (after the reply) can still fail; the kernel then
    // clears fc->io_uring and requests keep flowing through /dev/fuse, which the classic
    // threads below always serve (they also carry FORGET and INTERRUPT in uring mode).
    let nqueues = std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| s.trim().rsplit(['-', ',']).next().and_then(|x| x.parse::<usize>().ok()))
        .map(|m| m + 1)
        .unwrap_or(1);
    let mut queues = Vec::new();
    let mut use_uring = false;
    if want_uring {
        if kflags2 & FUSE_OVER_IO_URING_FLAGS2 == 0 {
            eprintln!("uring: kernel does not offer FUSE_OVER_IO_URING (enable_uring off?); classic");
        } else {
            match (0..nqueues).map(|q| queue_setup(q as u16, depth)).collect::<io::Result<Vec<_>>>() {
                Ok(qs) => {
                    queues = qs;
                    use_uring = true;
                }
                Err(e) => eprintln!("uring: ring setup failed ({e}); classic"),
            }
        }
    }

    let want = FUSE_ASYNC_READ | FUSE_BIG_WRITES | FUSE_PARALLEL_DIROPS | FUSE_INIT_EXT;
    let init = InitOut {
        major: 7,
        minor,
        max_readahead,
        flags: kflags & want,
        max_background: 64,
        congestion_threshold: 48,
        max_write: MAX_WRITE as u32,
        time_gran: 1,
        max_pages: 0,
        map_alignment: 0,
        flags2: if use_uring { FUSE_OVER_IO_URING_FLAGS2 } else { 0 },
        max_stack_depth: 0,
        request_timeout: 0,
        unused: [0; 11],
    };
    let mut reply = vec![0u8; OUT_HDR + 64];
    put(
        &mut reply[..],
        OutHeader {
            len: (OUT_HDR + 64) as u32,
            error: 0,
            unique: h.unique,
        },
    );
    put(&mut reply[OUT_HDR..], init);
    let w = unsafe { libc::write(fd, reply.as_ptr() as *const libc::c_void, reply.len()) };
    assert_eq!(w as usize, reply.len(), "INIT reply: {}", io::Error::last_os_error());
    eprintln!(
        "serving {mnt}: transport {} ({} classic threads{})",
        if use_uring { "uring" } else { "classic" },
        threads,
        if use_uring {
            format!(", {nqueues} ring queues of depth {depth}")
        } else {
            String::new()
        }
    );

    let stop = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    for i in 0..threads {
        let f = if i == 0 { fd } else { clone_fd(fd).expect("FUSE_DEV_IOC_CLONE") };
        let (srv, stop) = (srv.clone(), stop.clone());
        handles.push(std::thread::spawn(move || classic_loop(srv, f, stop)));
    }
    let go = Arc::new(Barrier::new(queues.len() + 1));
    let mut ring_handles = Vec::new();
    for q in queues {
        let (srv, go) = (srv.clone(), go.clone());
        ring_handles.push(std::thread::spawn(move || uring_loop(srv, fd, q, go)));
    }
    go.wait();
    for h in handles {
        let _ = h.join();
    }
    // Unmounted: ring entries were torn down by the kernel.
    for h in ring_handles {
        let _ = h.join();
    }
    std::thread::sleep(Duration::from_millis(10));
    eprintln!(
        "served: classic {} uring {}",
        srv.served[0].load(Ordering::Relaxed),
        srv.served[1].load(Ordering::Relaxed)
    );
    if let Err(e) = srv.fs.close() {
        eprintln!("close: {e}");
    }
}
