//! The kernel structures FUSE over io_uring exchanges (birchfs patch, see BIRCH-PATCH.md), as
//! `repr(C)` types with compile-time size and offset checks.
//!
//! Owns: the layouts of `fuse_in_header`, `fuse_out_header`, `fuse_uring_ent_in_out`,
//! `fuse_uring_req_header` and `fuse_uring_cmd_req` (Linux 6.18 `include/uapi/linux/fuse.h`,
//! protocol 7.42+), the fields of `io_uring_sqe` (`include/uapi/linux/io_uring.h`) that the
//! `io-uring` crate has no setter for, and the building of the URING_CMD entries the
//! transport submits ([`uring_cmd`]). `uring.rs` reads and writes the ring's buffers only
//! through the offsets defined here.
//!
//! Must not touch: rings, threads, requests. The `io-uring` dependency is pinned to the exact
//! version whose `squeue::Entry128` layout (`io_uring_sqe` followed by 64 more bytes) the
//! `len` write in [`uring_cmd`] relies on; birch-fuse's `tests/uring_abi.rs` compares the
//! bytes of built entries with the kernel's offsets.

use std::mem::{offset_of, size_of};

use io_uring::opcode;
use io_uring::squeue;
use io_uring::types;

/// `struct fuse_in_header`: the first bytes of every request.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct FuseInHeader {
    /// Bytes of the whole request.
    pub len: u32,
    /// The operation.
    pub opcode: u32,
    /// The request's id.
    pub unique: u64,
    /// The inode the request is about.
    pub nodeid: u64,
    /// Caller's uid.
    pub uid: u32,
    /// Caller's gid.
    pub gid: u32,
    /// Caller's pid.
    pub pid: u32,
    /// Length of extensions, in 8-byte units.
    pub total_extlen: u16,
    /// Padding.
    pub padding: u16,
}

/// `struct fuse_out_header`: the first bytes of every reply.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct FuseOutHeader {
    /// Bytes of the whole reply.
    pub len: u32,
    /// 0 or a negated errno.
    pub error: i32,
    /// The id of the request answered.
    pub unique: u64,
}

/// `struct fuse_uring_ent_in_out`: the ring entry's own header.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct FuseUringEntInOut {
    /// Flags (none used).
    pub flags: u64,
    /// The id to name in COMMIT_AND_FETCH for this entry's reply.
    pub commit_id: u64,
    /// Bytes of the payload buffer used, in either direction.
    pub payload_sz: u32,
    /// Padding.
    pub padding: u32,
    /// Reserved.
    pub reserved: u64,
}

/// `struct fuse_uring_req_header`: the header buffer of one ring entry.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct FuseUringReqHeader {
    /// `fuse_in_header` of a request, or `fuse_out_header` of a reply.
    pub in_out: [u8; 128],
    /// The opcode's own header (`fuse_write_in` and the like).
    pub op_in: [u8; 128],
    /// The entry's header.
    pub ring_ent_in_out: FuseUringEntInOut,
}

/// `struct fuse_uring_cmd_req`: the command area of REGISTER and COMMIT_AND_FETCH.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct FuseUringCmdReq {
    /// Flags (none used).
    pub flags: u64,
    /// The entry whose reply is committed (COMMIT_AND_FETCH).
    pub commit_id: u64,
    /// The queue (CPU) the entry belongs to.
    pub qid: u16,
    /// Padding.
    pub padding: [u8; 6],
}

/// `struct io_uring_sqe` as a URING_CMD uses it; in an SQE128 ring the command area (`cmd`,
/// at the offset of `addr3`) runs on for 64 more bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IoUringSqe {
    /// IORING_OP_*.
    pub opcode: u8,
    /// IOSQE_* flags.
    pub flags: u8,
    /// I/O priority.
    pub ioprio: u16,
    /// The file descriptor (/dev/fuse).
    pub fd: i32,
    /// `cmd_op` of a URING_CMD in its low 32 bits.
    pub off: u64,
    /// The iovec array's address.
    pub addr: u64,
    /// Number of iovecs.
    pub len: u32,
    /// `uring_cmd_flags`.
    pub op_flags: u32,
    /// Handed back in the completion.
    pub user_data: u64,
    /// Fixed buffer index.
    pub buf_index: u16,
    /// Personality.
    pub personality: u16,
    /// Splice fd or file index.
    pub splice_fd_in: i32,
    /// Start of the URING_CMD command area.
    pub addr3: u64,
    /// Rest of the first 64 bytes.
    pub pad2: u64,
}

/// `FUSE_IO_URING_CMD_REGISTER`.
pub const FUSE_IO_URING_CMD_REGISTER: u32 = 1;
/// `FUSE_IO_URING_CMD_COMMIT_AND_FETCH`.
pub const FUSE_IO_URING_CMD_COMMIT_AND_FETCH: u32 = 2;
/// `IORING_OP_URING_CMD`.
pub const IORING_OP_URING_CMD: u8 = 46;
/// Bytes of a request's `fuse_in_header`.
pub const IN_HDR: usize = size_of::<FuseInHeader>();
/// Bytes of a reply's `fuse_out_header`.
pub const OUT_HDR: usize = size_of::<FuseOutHeader>();
/// Bytes of an entry's header buffer.
pub const RING_HDR_SZ: usize = size_of::<FuseUringReqHeader>();
/// Offset of `op_in` in the header buffer.
pub const OP_IN: usize = offset_of!(FuseUringReqHeader, op_in);
/// Offset of `ring_ent_in_out` in the header buffer.
pub const ENT_IN_OUT: usize = offset_of!(FuseUringReqHeader, ring_ent_in_out);
/// Offset of `commit_id` in the header buffer.
pub const ENT_COMMIT_ID: usize = ENT_IN_OUT + offset_of!(FuseUringEntInOut, commit_id);
/// Offset of `payload_sz` in the header buffer.
pub const ENT_PAYLOAD_SZ: usize = ENT_IN_OUT + offset_of!(FuseUringEntInOut, payload_sz);
/// Offset of the command area in an SQE.
pub const SQE_CMD: usize = offset_of!(IoUringSqe, addr3);
/// Bytes of the command area of an SQE128.
pub const SQE128_CMD_BYTES: usize = 2 * size_of::<IoUringSqe>() - SQE_CMD;

// The kernel's sizes and offsets (Linux 6.18), checked at compile time.
const _: () = {
    assert!(IN_HDR == 40);
    assert!(OUT_HDR == 16);
    assert!(offset_of!(FuseInHeader, unique) == 8);
    assert!(offset_of!(FuseOutHeader, error) == 4);
    assert!(offset_of!(FuseOutHeader, unique) == 8);
    assert!(size_of::<FuseUringEntInOut>() == 32);
    assert!(RING_HDR_SZ == 288);
    assert!(OP_IN == 128);
    assert!(ENT_IN_OUT == 256);
    assert!(ENT_COMMIT_ID == 264);
    assert!(ENT_PAYLOAD_SZ == 272);
    assert!(size_of::<FuseUringCmdReq>() == 24);
    assert!(offset_of!(FuseUringCmdReq, commit_id) == 8);
    assert!(offset_of!(FuseUringCmdReq, qid) == 16);
    assert!(size_of::<IoUringSqe>() == 64);
    assert!(offset_of!(IoUringSqe, fd) == 4);
    assert!(offset_of!(IoUringSqe, off) == 8);
    assert!(offset_of!(IoUringSqe, addr) == 16);
    assert!(offset_of!(IoUringSqe, len) == 24);
    assert!(offset_of!(IoUringSqe, user_data) == 32);
    assert!(SQE_CMD == 48);
    assert!(SQE128_CMD_BYTES == 80);
    assert!(size_of::<FuseUringCmdReq>() <= SQE128_CMD_BYTES);
    // The io-uring crate's 128-byte entry is two kernel SQEs: `uring_cmd` writes `len` into it.
    assert!(size_of::<squeue::Entry128>() == 2 * size_of::<IoUringSqe>());
};

impl FuseUringCmdReq {
    /// The command area of an SQE128 holding this request (native byte order, zero padded).
    pub fn to_cmd_bytes(self) -> [u8; SQE128_CMD_BYTES] {
        let mut cmd = [0u8; SQE128_CMD_BYTES];
        let flags = offset_of!(FuseUringCmdReq, flags);
        let commit = offset_of!(FuseUringCmdReq, commit_id);
        let qid = offset_of!(FuseUringCmdReq, qid);
        cmd[flags..flags + 8].copy_from_slice(&self.flags.to_ne_bytes());
        cmd[commit..commit + 8].copy_from_slice(&self.commit_id.to_ne_bytes());
        cmd[qid..qid + 2].copy_from_slice(&self.qid.to_ne_bytes());
        cmd
    }
}

/// The URING_CMD entry of a REGISTER (`iov`: the address of the entry's two iovecs, header
/// and payload) or a COMMIT_AND_FETCH (`iov` None) for entry `idx` of queue `qid`; `idx` is
/// the entry's user_data.
pub fn uring_cmd(
    fd: i32,
    qid: u16,
    idx: u16,
    cmd_op: u32,
    commit_id: u64,
    iov: Option<u64>,
) -> squeue::Entry128 {
    let req = FuseUringCmdReq {
        commit_id,
        qid,
        ..FuseUringCmdReq::default()
    };
    let mut b = opcode::UringCmd80::new(types::Fd(fd), cmd_op).cmd(req.to_cmd_bytes());
    if iov.is_some() {
        b = b.addr(iov);
    }
    let mut e = b.build().user_data(u64::from(idx));
    if iov.is_some() {
        // sqe->len = 2 iovecs (header, payload); io-uring 0.7 has no setter for it.
        let raw = (&raw mut e).cast::<u8>();
        // SAFETY: `len` lies inside the entry's first SQE (sizes asserted above), and the
        // entry is plain bytes.
        unsafe { std::ptr::write_unaligned(raw.add(offset_of!(IoUringSqe, len)).cast::<u32>(), 2) };
    }
    e
}

/// The 128 bytes of an entry as the kernel reads them.
pub fn entry_bytes(e: &squeue::Entry128) -> [u8; 128] {
    // SAFETY: Entry128 is 128 bytes of plain data (asserted above); any bytes are valid u8.
    unsafe { std::ptr::read_unaligned((e as *const squeue::Entry128).cast::<[u8; 128]>()) }
}
