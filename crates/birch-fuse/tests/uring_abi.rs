//! The bytes of the io_uring entries the vendored fuser's transport submits, against the
//! kernel's layouts written out here independently (Linux 6.18 `include/uapi/linux/io_uring.h`
//! `struct io_uring_sqe` and `include/uapi/linux/fuse.h` `struct fuse_uring_cmd_req`): a
//! change of the `io-uring` crate's entry layout, or of our structs, fails here rather than
//! on a mount.

use fuser::uring_abi::{
    entry_bytes, uring_cmd, FUSE_IO_URING_CMD_COMMIT_AND_FETCH, FUSE_IO_URING_CMD_REGISTER,
    IORING_OP_URING_CMD,
};

// struct io_uring_sqe (64 bytes; SQE128 doubles it, the command area running on).
const SQE_OPCODE: usize = 0;
const SQE_FD: usize = 4;
// union with off: `struct { __u32 cmd_op; __u32 __pad1; }`
const SQE_CMD_OP: usize = 8;
const SQE_ADDR: usize = 16;
const SQE_LEN: usize = 24;
const SQE_USER_DATA: usize = 32;
// union with addr3: `__u8 cmd[0]`
const SQE_CMD: usize = 48;

// struct fuse_uring_cmd_req { __u64 flags; __u64 commit_id; __u16 qid; __u8 padding[6]; }
const CMD_FLAGS: usize = 0;
const CMD_COMMIT_ID: usize = 8;
const CMD_QID: usize = 16;
const CMD_REQ_BYTES: usize = 24;

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_ne_bytes(w)
}
fn i32_at(b: &[u8], at: usize) -> i32 {
    u32_at(b, at) as i32
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_ne_bytes(w)
}

#[test]
fn a_register_entry_has_the_kernels_layout() {
    let iov = 0x7f00_1234_5000u64;
    let e = uring_cmd(17, 3, 41, FUSE_IO_URING_CMD_REGISTER, 0, Some(iov));
    let b = entry_bytes(&e);
    assert_eq!(b[SQE_OPCODE], IORING_OP_URING_CMD);
    assert_eq!(
        IORING_OP_URING_CMD, 46,
        "IORING_OP_URING_CMD in the kernel's enum"
    );
    assert_eq!(i32_at(&b, SQE_FD), 17);
    assert_eq!(u32_at(&b, SQE_CMD_OP), FUSE_IO_URING_CMD_REGISTER);
    assert_eq!(u64_at(&b, SQE_ADDR), iov, "the iovec array");
    assert_eq!(u32_at(&b, SQE_LEN), 2, "two iovecs: header and payload");
    assert_eq!(u64_at(&b, SQE_USER_DATA), 41, "the entry index");
    let cmd = &b[SQE_CMD..];
    assert_eq!(u64_at(cmd, CMD_FLAGS), 0);
    assert_eq!(u64_at(cmd, CMD_COMMIT_ID), 0);
    assert_eq!(u16_at(cmd, CMD_QID), 3);
    assert!(
        cmd[CMD_QID + 2..].iter().all(|&x| x == 0),
        "padding is zero"
    );
}

#[test]
fn a_commit_and_fetch_entry_names_its_commit_id_and_queue() {
    let commit = 0x0102_0304_0506_0708u64;
    let e = uring_cmd(
        9,
        65_535,
        63,
        FUSE_IO_URING_CMD_COMMIT_AND_FETCH,
        commit,
        None,
    );
    let b = entry_bytes(&e);
    assert_eq!(b[SQE_OPCODE], IORING_OP_URING_CMD);
    assert_eq!(i32_at(&b, SQE_FD), 9);
    assert_eq!(u32_at(&b, SQE_CMD_OP), FUSE_IO_URING_CMD_COMMIT_AND_FETCH);
    assert_eq!(u64_at(&b, SQE_ADDR), 0, "no iovecs");
    assert_eq!(u32_at(&b, SQE_LEN), 0);
    assert_eq!(u64_at(&b, SQE_USER_DATA), 63);
    let cmd = &b[SQE_CMD..];
    assert_eq!(u64_at(cmd, CMD_COMMIT_ID), commit);
    assert_eq!(u16_at(cmd, CMD_QID), 65_535);
    assert!(cmd[CMD_REQ_BYTES..].iter().all(|&x| x == 0));
}

#[test]
fn the_header_buffer_offsets_are_the_kernels() {
    use fuser::uring_abi::{ENT_COMMIT_ID, ENT_PAYLOAD_SZ, IN_HDR, OP_IN, OUT_HDR, RING_HDR_SZ};
    // struct fuse_uring_req_header { in_out[128]; op_in[128]; struct fuse_uring_ent_in_out }
    // struct fuse_uring_ent_in_out { u64 flags; u64 commit_id; u32 payload_sz; u32 pad; u64 }
    assert_eq!((IN_HDR, OUT_HDR), (40, 16));
    assert_eq!(OP_IN, 128);
    assert_eq!(ENT_COMMIT_ID, 256 + 8);
    assert_eq!(ENT_PAYLOAD_SZ, 256 + 16);
    assert_eq!(RING_HDR_SZ, 256 + 32);
}
