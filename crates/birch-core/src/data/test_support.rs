//! Helpers the data layer's unit tests share: an engine on a memory device, block patterns,
//! and reading written runs back verified. Test code only.

use std::sync::Arc;

use super::read::ExtentPart;
use super::{DataLayer, WrittenRun};
use crate::device::{BlockDevice, MemDevice};
use crate::error::Result;
use crate::txn::Engine;
use crate::txn::MkfsOptions;
use birch_format::BLOCK_SIZE;

pub(super) const INO: u64 = 300;

pub(super) fn setup() -> (Arc<MemDevice>, Arc<Engine>) {
    let mem = Arc::new(MemDevice::new(32 << 20));
    let dev: Arc<dyn BlockDevice> = mem.clone();
    let engine = Engine::create(dev, &MkfsOptions::default(), Vec::new()).expect("create");
    (mem, engine)
}

pub(super) fn pattern(blocks: u64, seed: u8) -> Vec<u8> {
    (0..blocks * BLOCK_SIZE)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

pub(super) fn read_back(data: &DataLayer<'_>, runs: &[WrittenRun]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    for run in runs {
        let len = run.csums.len() as u64 * BLOCK_SIZE;
        let mut part = vec![0u8; len as usize];
        data.read_verified(
            INO,
            &ExtentPart {
                start: run.file_offset,
                disk_addr: run.addr,
                csums: &run.csums,
                from: run.file_offset,
                to: run.file_offset + len,
            },
            &mut part,
        )?;
        out.extend_from_slice(&part);
    }
    Ok(out)
}

/// Two blocks written together (contiguous on disk) and split into two runs: the file's
/// first block and its second, to record separately (an append that may merge).
pub(super) fn two_contiguous_runs(data: &DataLayer<'_>) -> (WrittenRun, WrittenRun) {
    let runs = data.write_new(INO, 0, &pattern(2, 1)).expect("write");
    assert_eq!(runs.len(), 1, "two blocks written together are one run");
    let run = &runs[0];
    let first = WrittenRun {
        csums: run.csums[..1].to_vec(),
        ..run.clone()
    };
    let second = WrittenRun {
        file_offset: BLOCK_SIZE,
        addr: run.addr + BLOCK_SIZE,
        csums: run.csums[1..].to_vec(),
        birth: run.birth,
    };
    (first, second)
}
