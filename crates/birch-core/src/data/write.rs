//! The write path of data blocks: data space reservations of buffered blocks, allocation (at
//! a goal, so a file continues on disk, or from a reservation), writing new blocks with their
//! crc32c ([`DataLayer::write_new`], or placing them for the fsync log,
//! [`DataLayer::place_new`]), and a buffered flush's runs, written at once
//! ([`DataLayer::write_reserved`]) or staged for a drain batch of many files ([`Staged`],
//! [`DataLayer::write_staged`]), with the staging buffers' pool ([`Stage`]).
//!
//! Owns: blocks from their allocation until they are handed to the caller as
//! [`WrittenRun`]s to record. Must not touch: the extent map (the caller records the runs with
//! [`DataLayer::replace_range`]; only the continuation goal is read), reads of data blocks,
//! and blocks that any extent item referenced: a failure gives back only what this operation
//! allocated, unrecorded ([`Seen::Unrecorded`], through [`DataLayer::free`]).

use birch_format::codec::Codec;
use birch_format::items::Blob;
use birch_format::{BlockAddr, BlockCount, BLOCK_SIZE, EXTENT_MAX_BLOCKS};
use parking_lot::Mutex;

use super::{BlockRun, DataLayer, Seen, WrittenRun, BLOB_CAP_BYTES};
use crate::alloc::Purpose;
use crate::error::{Error, Result};

/// Most blocks one allocation of a buffered flush asks for (16 extents, 16 MiB): the run is
/// written with one device write.
const FLUSH_RUN_MAX_BLOCKS: u64 = EXTENT_MAX_BLOCKS * 16;

/// Bytes of a buffered flush's runs written as one batch (in flight together where the device
/// can: RBD, where a 16 MiB run is four 4 MiB objects written in parallel), at most about:
/// two runs of the largest size.
const FLUSH_BATCH_BYTES: u64 = 2 * FLUSH_RUN_MAX_BLOCKS * BLOCK_SIZE;

impl DataLayer<'_> {
    // ---- Blocks: space and writes ----

    /// Reserves `blocks` of data space for buffered blocks to be allocated at their flush
    /// ([`DataLayer::write_reserved`]); false when fewer are available (the caller commits,
    /// which unpins freed space, and retries).
    pub(crate) fn reserve(&self, blocks: u64) -> bool {
        self.engine.allocator().try_reserve(BlockCount::new(blocks))
    }

    /// Gives back a reservation (its blocks were allocated, or their data dropped).
    pub(crate) fn unreserve(&self, blocks: u64) {
        if blocks > 0 {
            self.engine.allocator().unreserve(BlockCount::new(blocks));
        }
    }

    /// Allocates 1..=`want` data blocks, starting at `goal` when that space is free
    /// (ENOSPC is retried after a commit by the caller, with no lock held).
    pub(super) fn allocate(&self, goal: Option<u64>, want: u64) -> Result<BlockRun> {
        let (one, want) = (BlockCount::new(1), BlockCount::new(want));
        let (addr, blocks) = match goal {
            Some(goal) => self
                .engine
                .allocate_data_near(BlockAddr::new(goal), one, want)?,
            None => self.engine.allocate_data(one, want)?,
        };
        Ok(BlockRun::new(addr, blocks))
    }

    /// Allocates new blocks for `buf` (whole blocks for the block-aligned file offset
    /// `offset`), continuing the file on disk when it can, and writes them; returns the runs
    /// to record. Needs no inode lock: the blocks are new and referenced by nothing until
    /// recorded. On failure gives back what it allocated. Does device I/O.
    pub(crate) fn write_new(&self, ino: u64, offset: u64, buf: &[u8]) -> Result<Vec<WrittenRun>> {
        self.new_blocks(ino, offset, buf, false)
    }

    /// [`DataLayer::write_new`] without the device write: the blocks are allocated and their
    /// bytes *placed* ([`crate::pending::PendingData`]), read from memory until the next
    /// commit writes them in place. Only for a write whose bytes go to the fsync log in data
    /// records before any log record or superblock names the blocks. Blocks no data record
    /// carries stay placed until a commit writes them, or an fsync that logs their extent
    /// without their bytes writes them first (`Filesystem::settle_placed`).
    pub(crate) fn place_new(&self, ino: u64, offset: u64, buf: &[u8]) -> Result<Vec<WrittenRun>> {
        self.new_blocks(ino, offset, buf, true)
    }

    fn new_blocks(
        &self,
        ino: u64,
        offset: u64,
        buf: &[u8],
        place: bool,
    ) -> Result<Vec<WrittenRun>> {
        debug_assert!(offset % BLOCK_SIZE == 0 && buf.len() as u64 % BLOCK_SIZE == 0);
        let total_blocks = buf.len() as u64 / BLOCK_SIZE;
        let birth = self.engine.running_generation().get();
        let mut written: Vec<WrittenRun> = Vec::new();
        let mut done = 0u64;
        let mut goal = self.continuation_goal(ino, offset)?;
        while done < total_blocks {
            let want = (total_blocks - done).min(EXTENT_MAX_BLOCKS);
            let run = match self.allocate(goal, want) {
                Ok(run) => run,
                Err(e) => {
                    self.give_back(&written);
                    return Err(e);
                }
            };
            let slice =
                &buf[(done * BLOCK_SIZE) as usize..((done + run.blocks) * BLOCK_SIZE) as usize];
            let file_offset = offset + done * BLOCK_SIZE;
            if place {
                self.engine.pending().place(run.addr, slice);
            } else if let Err(e) = self.engine.device().write_at(slice, run.addr) {
                self.free(run, birth, Seen::Unrecorded);
                self.give_back(&written);
                return Err(Error::io(
                    format!(
                        "write inode {ino} offset {file_offset} to block {:#x}",
                        run.addr
                    ),
                    e,
                ));
            }
            written.push(WrittenRun {
                file_offset,
                addr: run.addr,
                csums: slice
                    .chunks(BLOCK_SIZE as usize)
                    .map(birch_format::checksum)
                    .collect(),
                birth,
            });
            done += run.blocks;
            goal = Some(run.addr + run.blocks * BLOCK_SIZE);
        }
        Ok(written)
    }

    /// Compresses `logical` (one chunk of a file: 2 ..= [`BLOB_CAP_BYTES`] / 4096 whole
    /// blocks, at file offset `offset` of `ino`, for messages) with `codec` and, when that
    /// saves at least 1/8 (DESIGN §16.4) and one contiguous run of the stored blocks is free,
    /// writes the stored blocks there: returns the blob (its window all of it) and the birth
    /// to give it back with. `None` when the chunk is to be stored as it is (it does not
    /// compress enough, or no contiguous run is free): nothing is allocated then. Needs no
    /// inode lock: the blocks are new. Does device I/O.
    pub(crate) fn write_blob(
        &self,
        ino: u64,
        offset: u64,
        logical: &[u8],
        codec: Codec,
    ) -> Result<Option<(Blob, u64)>> {
        debug_assert!(logical.len() as u64 % BLOCK_SIZE == 0);
        debug_assert!(logical.len() as u64 <= BLOB_CAP_BYTES);
        let mut encoded = Vec::new();
        let Some(encoded_len) = birch_format::codec::encode(codec, logical, &mut encoded) else {
            return Ok(None);
        };
        let stored = (encoded_len as u64).div_ceil(BLOCK_SIZE);
        let birth = self.engine.running_generation().get();
        let count = BlockCount::new(stored);
        let addr = match self.engine.allocate_data(count, count) {
            Ok((addr, _)) => addr.get(),
            Err(Error::NoSpace(_)) => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut stage = Stage::take((stored * BLOCK_SIZE) as usize);
        stage.push(&encoded);
        stage.push(&vec![0u8; (stored * BLOCK_SIZE) as usize - encoded_len]);
        let run = BlockRun::new(BlockAddr::new(addr), count);
        if let Err(e) = self.engine.device().write_at(stage.bytes(), addr) {
            self.free(run, birth, Seen::Unrecorded);
            return Err(Error::io(
                format!("write inode {ino} offset {offset}: blob at {addr:#x}"),
                e,
            ));
        }
        let blob = Blob {
            disk_addr: addr,
            codec: Codec::from_byte(codec.byte()).unwrap_or(codec),
            encoded_len: encoded_len as u32,
            logical: logical.len() as u32,
            window_offset: 0,
            window_len: logical.len() as u32,
            nonce: 0,
            csums: stage
                .bytes()
                .chunks(BLOCK_SIZE as usize)
                .map(birch_format::checksum)
                .collect(),
        };
        Ok(Some((blob, birth)))
    }

    /// Allocates a run of 1 to `left` (at most a flush run) buffered blocks, at `goal` when
    /// that space is free, and takes it out of `reserved` (the blocks held for them): returns
    /// its disk address and length in blocks.
    fn allocate_reserved(
        &self,
        goal: Option<u64>,
        left: u64,
        reserved: &mut u64,
    ) -> Result<(u64, u64)> {
        let alloc = self.engine.allocator();
        let want = left.min(FLUSH_RUN_MAX_BLOCKS);
        let (one, want) = (BlockCount::new(1), BlockCount::new(want));
        let (addr, got) = match goal {
            Some(g) => alloc.allocate_near(BlockAddr::new(g), one, want, Purpose::Reserved),
            None => alloc.allocate(one, want, Purpose::Reserved),
        }?;
        let got = got.get();
        let from_reserve = got.min(*reserved);
        self.unreserve(from_reserve);
        *reserved -= from_reserve;
        Ok((addr.get(), got))
    }

    /// Allocates space for a file's buffered `blocks` (file block index and its 4 KiB, in
    /// file order, not empty) from `reserved` (taking the reservation down as it allocates)
    /// and writes them, one device write per allocated run, the writes of up to
    /// [`FLUSH_BATCH_BYTES`] in flight together ([`crate::device::BlockDevice::write_many`]);
    /// returns the runs to record, each of consecutive file blocks on consecutive disk blocks
    /// and at most one extent long. On failure frees what it took. Does device I/O; the
    /// caller holds the inode lock.
    pub(crate) fn write_reserved(
        &self,
        ino: u64,
        blocks: &[(u64, &[u8])],
        reserved: &mut u64,
    ) -> Result<Vec<WrittenRun>> {
        let Some(&(first_index, _)) = blocks.first() else {
            return Ok(Vec::new());
        };
        let birth = self.engine.running_generation().get();
        let total = blocks.len() as u64;
        let mut goal = self.continuation_goal(ino, first_index * BLOCK_SIZE)?;
        let mut taken: Vec<BlockRun> = Vec::new();
        let mut runs: Vec<WrittenRun> = Vec::new();
        // Allocated and staged, not written yet: (disk address, first block in `blocks`,
        // blocks, staged bytes).
        let mut pending: Vec<(u64, u64, u64, Stage)> = Vec::new();
        let mut pending_bytes = 0u64;
        let mut done = 0u64;
        let fail = |taken: &[BlockRun], e: Error| -> Error {
            for run in taken {
                self.free(*run, birth, Seen::Unrecorded);
            }
            e
        };
        while done < total {
            let (addr, got) = match self.allocate_reserved(goal, total - done, reserved) {
                Ok(run) => run,
                Err(e) => return Err(fail(&taken, e)),
            };
            taken.push(BlockRun { addr, blocks: got });
            let part = &blocks[done as usize..(done + got) as usize];
            // One buffer for the run, filled by copying (never zeroed first), started at a
            // block-aligned address so the device's O_DIRECT write takes it as it is.
            let mut stage = Stage::take((got * BLOCK_SIZE) as usize);
            for (_, bytes) in part {
                stage.push(bytes);
            }
            pending.push((addr, done, got, stage));
            pending_bytes += got * BLOCK_SIZE;
            done += got;
            goal = Some(addr + got * BLOCK_SIZE);
            if pending_bytes < FLUSH_BATCH_BYTES && done < total {
                continue;
            }
            let writes: Vec<(u64, &[u8])> = pending
                .iter()
                .map(|(addr, _, _, stage)| (*addr, stage.bytes()))
                .collect();
            if let Err(e) = self.engine.device().write_many(&writes) {
                let (addr, start, _, _) = &pending[0];
                let first = blocks[*start as usize].0 * BLOCK_SIZE;
                return Err(fail(
                    &taken,
                    Error::io(
                        format!(
                            "flush inode {ino} offset {first} to block {addr:#x} ({} runs)",
                            pending.len()
                        ),
                        e,
                    ),
                ));
            }
            drop(writes);
            for (addr, start, got, stage) in pending.drain(..) {
                drop(stage);
                let part = &blocks[start as usize..(start + got) as usize];
                push_runs(&mut runs, addr, part, birth);
            }
            pending_bytes = 0;
        }
        Ok(runs)
    }

    /// Allocates space for a file's buffered `blocks` (as [`DataLayer::write_reserved`] takes
    /// them) and stages their bytes, without writing anything: the drain writes the staged
    /// runs of many files with one [`BlockDevice::write_many`] ([`DataLayer::write_staged`])
    /// and then hands each file's [`Staged`] to [`DataLayer::staged_done`]. On failure frees
    /// what it took. The caller holds the inode lock (the continuation goal reads the extent
    /// map) until `staged_done`.
    ///
    /// [`BlockDevice::write_many`]: crate::device::BlockDevice::write_many
    pub(crate) fn stage_reserved(
        &self,
        ino: u64,
        blocks: &[(u64, &[u8])],
        reserved: &mut u64,
    ) -> Result<Staged> {
        let birth = self.engine.running_generation().get();
        let mut staged = Staged {
            ino,
            first: blocks.first().map_or(0, |(index, _)| index * BLOCK_SIZE),
            writes: Vec::new(),
            runs: Vec::new(),
        };
        let Some(&(first_index, _)) = blocks.first() else {
            return Ok(staged);
        };
        let total = blocks.len() as u64;
        let mut goal = self.continuation_goal(ino, first_index * BLOCK_SIZE)?;
        let mut done = 0u64;
        while done < total {
            let (addr, got) = match self.allocate_reserved(goal, total - done, reserved) {
                Ok(run) => run,
                Err(e) => {
                    // Every block taken so far is in a run: all go back.
                    self.give_back(&staged.runs);
                    return Err(e);
                }
            };
            let part = &blocks[done as usize..(done + got) as usize];
            let mut stage = Stage::take((got * BLOCK_SIZE) as usize);
            for (_, bytes) in part {
                stage.push(bytes);
            }
            staged.writes.push((addr, stage));
            // The checksums now, from the same bytes the stage holds.
            push_runs(&mut staged.runs, addr, part, birth);
            done += got;
            goal = Some(addr + got * BLOCK_SIZE);
        }
        Ok(staged)
    }

    /// Writes the staged runs of `files` together: one [`BlockDevice::write_many`] for all of
    /// them. Returns, for each file, whether its writes completed. When the batch fails, each
    /// file's writes are tried again on their own (rewriting blocks nothing references yet
    /// is harmless), so a failure costs only the files whose own writes fail.
    ///
    /// [`BlockDevice::write_many`]: crate::device::BlockDevice::write_many
    pub(crate) fn write_staged(&self, files: &[&Staged]) -> Vec<Result<()>> {
        let device = self.engine.device();
        let writes: Vec<(u64, &[u8])> = files
            .iter()
            .flat_map(|f| f.writes.iter().map(|(addr, stage)| (*addr, stage.bytes())))
            .collect();
        if writes.is_empty() {
            return files.iter().map(|_| Ok(())).collect();
        }
        let batch = match device.write_many(&writes) {
            Ok(()) => return files.iter().map(|_| Ok(())).collect(),
            Err(e) => e,
        };
        if device.write_error_is_fatal() {
            // The device is given up (RBD): every retry would fail the same way.
            return files
                .iter()
                .map(|f| {
                    Err(Error::io(
                        format!("flush inode {} in a drain batch of {}", f.ino, files.len()),
                        std::io::Error::new(batch.kind(), batch.to_string()),
                    ))
                })
                .collect();
        }
        log::warn!(
            "drain batch of {} files ({} writes) failed: {batch}; writing each file alone",
            files.len(),
            writes.len()
        );
        files
            .iter()
            .map(|f| {
                let own: Vec<(u64, &[u8])> = f
                    .writes
                    .iter()
                    .map(|(addr, stage)| (*addr, stage.bytes()))
                    .collect();
                if own.is_empty() {
                    return Ok(());
                }
                device.write_many(&own).map_err(|e| {
                    Error::io(
                        format!(
                            "flush inode {} offset {} to block {:#x} ({} runs)",
                            f.ino,
                            f.first,
                            own[0].0,
                            own.len()
                        ),
                        e,
                    )
                })
            })
            .collect()
    }

    /// Ends a staged file without writing it: its bytes are *placed*
    /// ([`crate::pending::PendingData`]), read from memory until the log's leader (for the
    /// batch naming them) or the next commit writes them in place; returns the runs to
    /// record. For a flush an fsync through the log makes (`Filesystem::flush_inode_placed`).
    pub(crate) fn place_staged(&self, staged: Staged) -> Vec<WrittenRun> {
        let Staged { runs, writes, .. } = staged;
        for (addr, stage) in &writes {
            self.engine.pending().place(*addr, stage.bytes());
        }
        runs
    }

    /// Ends a staged file: after its writes completed (`written` is `Ok`) returns the runs to
    /// record, as [`DataLayer::write_reserved`] does; otherwise frees every block it took
    /// (nothing references them) and returns the error.
    pub(crate) fn staged_done(
        &self,
        staged: Staged,
        written: Result<()>,
    ) -> Result<Vec<WrittenRun>> {
        let Staged { runs, writes, .. } = staged;
        drop(writes);
        match written {
            Ok(()) => Ok(runs),
            Err(e) => {
                self.give_back(&runs);
                Err(e)
            }
        }
    }
}

/// Adds the blocks of `part` (file block index and bytes, in file order), written from disk
/// address `addr` on, to `runs`: a block continues the last run when it follows it in the
/// file and on disk and the run is shorter than an extent, else starts a new one.
fn push_runs(runs: &mut Vec<WrittenRun>, addr: u64, part: &[(u64, &[u8])], birth: u64) {
    for (n, (index, bytes)) in part.iter().enumerate() {
        let disk = addr + n as u64 * BLOCK_SIZE;
        let file = index * BLOCK_SIZE;
        let csum = birch_format::checksum(bytes);
        match runs.last_mut() {
            Some(run)
                if run.file_offset + run.csums.len() as u64 * BLOCK_SIZE == file
                    && run.addr + run.csums.len() as u64 * BLOCK_SIZE == disk
                    && (run.csums.len() as u64) < EXTENT_MAX_BLOCKS =>
            {
                run.csums.push(csum)
            }
            _ => runs.push(WrittenRun {
                file_offset: file,
                addr: disk,
                csums: vec![csum],
                birth,
            }),
        }
    }
}

/// A file's buffered blocks allocated and staged by [`DataLayer::stage_reserved`], not
/// written yet: its runs go into a drain batch ([`DataLayer::write_staged`]), then to
/// [`DataLayer::staged_done`], which returns the runs to record or frees them.
pub(crate) struct Staged {
    ino: u64,
    /// File offset of the first block (for error messages).
    first: u64,
    /// One device write per allocated run: its disk address and staged bytes.
    writes: Vec<(u64, Stage)>,
    /// What to record once written (checksums computed when staged).
    runs: Vec<WrittenRun>,
}

impl Staged {
    /// Device writes this file adds to a batch.
    pub(crate) fn writes(&self) -> usize {
        self.writes.len()
    }

    /// Bytes this file adds to a batch.
    pub(crate) fn bytes(&self) -> u64 {
        self.writes
            .iter()
            .map(|(_, stage)| stage.bytes().len() as u64)
            .sum()
    }
}

/// Block-aligned staging buffers for flush runs, shared by every thread (a drain flushes
/// from threads it starts for each commit, so per-thread buffers would die with them): a
/// fresh buffer of a 16 MiB run cost the kernel's zeroing of 4,096 new pages on every flush.
/// Kept up to [`Stage::POOL_BYTES`] in all.
static STAGE_POOL: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

/// A run being staged for one device write: filled only by copying ([`Stage::push`]), so no
/// byte is zeroed only to be overwritten and none is read before it is written.
struct Stage {
    raw: Vec<u8>,
    /// Bytes before the block-aligned start.
    pad: usize,
}

impl Stage {
    /// Most capacity the pool keeps, all buffers together: two batches of two runs of the
    /// largest size ([`FLUSH_BATCH_BYTES`]).
    const POOL_BYTES: usize = 4 * (FLUSH_RUN_MAX_BLOCKS as usize + 1) * BLOCK_SIZE as usize;

    /// An empty stage with room for `len` bytes after a block-aligned start.
    fn take(len: usize) -> Stage {
        let mut raw = STAGE_POOL.lock().pop().unwrap_or_default();
        raw.clear();
        raw.reserve(len + BLOCK_SIZE as usize);
        let pad = raw.as_ptr().align_offset(BLOCK_SIZE as usize);
        // Only the few bytes before the aligned start are zeroed; they are never written.
        raw.resize(pad, 0);
        Stage { raw, pad }
    }

    fn push(&mut self, bytes: &[u8]) {
        self.raw.extend_from_slice(bytes);
    }

    /// The staged bytes, from the block-aligned start.
    fn bytes(&self) -> &[u8] {
        &self.raw[self.pad..]
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        let raw = std::mem::take(&mut self.raw);
        let mut pool = STAGE_POOL.lock();
        let kept: usize = pool.iter().map(Vec::capacity).sum();
        if kept + raw.capacity() <= Self::POOL_BYTES {
            pool.push(raw);
        }
    }
}

#[cfg(test)]
mod tests {
    //! Writes over an engine on a memory device: a failed write gives its blocks back at once,
    //! a reserved flush's runs follow file and disk order, and staged files write as one batch
    //! and give their blocks back when it fails.

    use birch_format::BlockCount;

    use super::*;
    use crate::data::test_support::{pattern, read_back, setup, INO};
    use crate::device::BlockDevice;

    #[test]
    fn failed_write_gives_its_blocks_back() {
        let (mem, engine) = setup();
        let data = DataLayer::new(&engine);
        let free_before = engine.allocator().free_blocks();
        let pinned_before = engine.allocator().pinned_blocks();
        mem.fail_writes(true);
        match data.write_new(INO, 0, &pattern(300, 3)) {
            Err(Error::Io { context, .. }) => {
                assert!(context.contains(&format!("inode {INO}")), "{context}");
                assert!(context.contains("block 0x"), "{context}");
            }
            other => panic!("expected an I/O error, got {other:?}"),
        }
        let mut reserved = 0;
        let block = pattern(1, 4);
        let blocks = [(9u64, &block[..]), (10, &block[..])];
        assert!(matches!(
            data.write_reserved(INO, &blocks, &mut reserved),
            Err(Error::Io { .. })
        ));
        mem.fail_writes(false);
        assert_eq!(engine.allocator().free_blocks(), free_before);
        assert_eq!(engine.allocator().pinned_blocks(), pinned_before);
        // Given back, not pinned: the space is taken again at once.
        let runs = data.write_new(INO, 0, &pattern(2, 5)).expect("write after");
        assert_eq!(read_back(&data, &runs).expect("read"), pattern(2, 5));
    }

    #[test]
    fn reserved_flush_runs_follow_file_and_disk_order() {
        let (_mem, engine) = setup();
        let data = DataLayer::new(&engine);
        assert!(data.reserve(3));
        let mut reserved = 3;
        let (a, b, c) = (pattern(1, 1), pattern(1, 2), pattern(1, 3));
        let blocks = [(0u64, &a[..]), (1, &b[..]), (5, &c[..])];
        let runs = data
            .write_reserved(INO, &blocks, &mut reserved)
            .expect("flush");
        assert_eq!(reserved, 0);
        assert_eq!(engine.allocator().reserved_blocks(), BlockCount::new(0));
        assert_eq!(runs.len(), 2);
        assert_eq!((runs[0].file_offset, runs[0].csums.len()), (0, 2));
        assert_eq!(
            (runs[1].file_offset, runs[1].csums.len()),
            (5 * BLOCK_SIZE, 1)
        );
        let mut both = a.clone();
        both.extend_from_slice(&b);
        assert_eq!(read_back(&data, &runs[..1]).expect("read"), both);
        assert_eq!(read_back(&data, &runs[1..]).expect("read"), c);
    }

    /// Two files staged and written as one batch: the runs `staged_done` returns are what
    /// `write_reserved` would return and read back verified; a failed batch frees every block
    /// the files took, at once (never recorded, so not pinned).
    #[test]
    fn staged_files_write_as_one_batch_and_give_back_on_failure() {
        let (mem, engine) = setup();
        let data = DataLayer::new(&engine);
        let free_before = engine.allocator().free_blocks();
        let (a, b, c) = (pattern(1, 1), pattern(1, 2), pattern(1, 3));
        assert!(data.reserve(3));
        let mut reserved = 3;
        let one = data
            .stage_reserved(INO, &[(0u64, &a[..]), (1, &b[..])], &mut reserved)
            .expect("stage one");
        let two = data
            .stage_reserved(INO + 1, &[(4u64, &c[..])], &mut reserved)
            .expect("stage two");
        assert_eq!(reserved, 0);
        assert_eq!((one.writes(), one.bytes()), (1, 2 * BLOCK_SIZE));
        let writes = mem.counters().values().device_writes;
        let results = data.write_staged(&[&one, &two]);
        assert!(results.iter().all(|r| r.is_ok()));
        assert_eq!(mem.counters().values().device_writes - writes, 2);
        let runs_one = data.staged_done(one, Ok(())).expect("one");
        let runs_two = data.staged_done(two, Ok(())).expect("two");
        assert_eq!((runs_one.len(), runs_one[0].csums.len()), (1, 2));
        assert_eq!(runs_two[0].file_offset, 4 * BLOCK_SIZE);
        let mut both = a.clone();
        both.extend_from_slice(&b);
        assert_eq!(read_back(&data, &runs_one).expect("read"), both);
        let free_written = engine.allocator().free_blocks();
        assert_eq!(free_written, free_before - BlockCount::new(3));

        let mut reserved = 0;
        let three = data
            .stage_reserved(INO, &[(7u64, &a[..])], &mut reserved)
            .expect("stage three");
        let four = data
            .stage_reserved(INO + 1, &[(8u64, &b[..]), (9, &c[..])], &mut reserved)
            .expect("stage four");
        mem.fail_writes(true);
        let results = data.write_staged(&[&three, &four]);
        mem.fail_writes(false);
        assert!(results.iter().all(|r| r.is_err()));
        for (staged, result) in [three, four].into_iter().zip(results) {
            assert!(data.staged_done(staged, result).is_err());
        }
        assert_eq!(engine.allocator().free_blocks(), free_written);
    }
}
