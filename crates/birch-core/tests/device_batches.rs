//! What the engine asks of its device (DESIGN §14.4): node and data writes in batches
//! ([`BlockDevice::write_many`], in flight together on RBD), the ordering rules kept around
//! them (a superblock is written only after its nodes' writes completed and a flush after
//! them; a commit is done only after its superblock and a flush after it), and freed space
//! discarded ([`BlockDevice::discard`]) only once no committed root references it, with
//! nothing assuming it reads back as zeros.

#![allow(clippy::expect_used)]

mod common;

use std::io;
use std::sync::Arc;

use birch_core::check::{check, CheckOptions};
use birch_core::counters::Counters;
use birch_core::device::{BlockDevice, MemDevice};
use birch_core::{Filesystem, MkfsOptions};
use birch_format::superblock::SUPER_OFFSETS;
use parking_lot::Mutex;

/// One request the engine made, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    /// One `write_at`.
    Write(u64, usize),
    /// One `write_many`: its writes.
    Batch(Vec<(u64, usize)>),
    Flush,
    /// One `discard`: its ranges.
    Discard(Vec<(u64, u64)>),
}

/// A memory device that records every request, and fills discarded ranges with junk (a
/// device may return anything for them).
struct Recording {
    base: Arc<MemDevice>,
    events: Mutex<Vec<Event>>,
}

impl Recording {
    fn new(base: Arc<MemDevice>) -> Arc<Recording> {
        Arc::new(Recording {
            base,
            events: Mutex::new(Vec::new()),
        })
    }

    fn take(&self) -> Vec<Event> {
        std::mem::take(&mut *self.events.lock())
    }
}

impl BlockDevice for Recording {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.base.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.events.lock().push(Event::Write(offset, buf.len()));
        self.base.write_at(buf, offset)
    }

    fn write_many(&self, writes: &[(u64, &[u8])]) -> io::Result<()> {
        self.events.lock().push(Event::Batch(
            writes.iter().map(|(o, b)| (*o, b.len())).collect(),
        ));
        // In reverse: nothing may depend on the order within a batch.
        for (offset, bytes) in writes.iter().rev() {
            self.base.write_at(bytes, *offset)?;
        }
        Ok(())
    }

    fn discard(&self, ranges: &[(u64, u64)]) -> io::Result<()> {
        self.events.lock().push(Event::Discard(ranges.to_vec()));
        for (offset, len) in ranges {
            self.base.write_at(&vec![0xDB; *len as usize], *offset)?;
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        self.events.lock().push(Event::Flush);
        self.base.flush()
    }

    fn size_bytes(&self) -> u64 {
        self.base.size_bytes()
    }

    fn counters(&self) -> &Counters {
        self.base.counters()
    }
}

fn open(dev: &Arc<Recording>) -> Filesystem {
    common::open_quiet(dev)
}

fn fresh(bytes: u64) -> (Arc<MemDevice>, Arc<Recording>, Filesystem) {
    let mem = Arc::new(MemDevice::new(bytes));
    let dev = Recording::new(mem.clone());
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    let fs = open(&dev);
    (mem, dev, fs)
}

fn is_superblock(event: &Event) -> bool {
    matches!(event, Event::Write(offset, _) if SUPER_OFFSETS.contains(offset))
}

fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
        .collect()
}

/// Every superblock write comes right after a flush (its nodes, written before, have
/// completed: `write_many` returns only then) and is followed by a flush before anything
/// else is written.
fn assert_ordered(events: &[Event]) {
    for (i, event) in events.iter().enumerate() {
        if !is_superblock(event) {
            continue;
        }
        assert_eq!(
            events.get(i.wrapping_sub(1)),
            Some(&Event::Flush),
            "superblock write {i} not after a flush: {:?}",
            &events[i.saturating_sub(3)..(i + 2).min(events.len())]
        );
        assert_eq!(
            events.get(i + 1),
            Some(&Event::Flush),
            "superblock write {i} not followed by a flush"
        );
    }
}

/// A commit of many changed nodes writes them as batches of several writes, a flush, the
/// superblock, a flush; a buffered file's runs go out as one batch too. The result reads
/// back and checks clean.
#[test]
fn commits_write_nodes_and_data_in_batches_and_keep_the_order() {
    let (mem, dev, fs) = fresh(256 << 20);
    dev.take();
    for i in 0..2000u32 {
        fs.write_file(&format!("/f{i:04}"), &pattern(i, 100))
            .expect("small file");
    }
    fs.sync().expect("commit");
    let events = dev.take();
    assert_ordered(&events);
    let node_batches: Vec<&Vec<(u64, usize)>> = events
        .iter()
        .filter_map(|e| match e {
            Event::Batch(w) => Some(w),
            _ => None,
        })
        .collect();
    assert!(
        node_batches.iter().any(|w| w.len() > 1),
        "a commit of 2000 files writes its nodes in a batch of several writes: {events:?}"
    );
    // A file of 40 MiB: its runs (16 MiB each at most) go out two to a batch.
    let big = pattern(7, 40 << 20);
    fs.write_file("/big", &big).expect("big file");
    fs.sync().expect("commit");
    let events = dev.take();
    assert_ordered(&events);
    assert!(
        events.iter().any(|e| matches!(e, Event::Batch(w)
            if w.len() >= 2 && w.iter().all(|(_, len)| *len >= 1 << 20))),
        "the big file's runs are written as one batch: {events:?}"
    );
    assert_eq!(fs.read_file("/big").expect("read big"), big);
    fs.close().expect("close");
    drop(fs);
    let report = check(&*mem, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{:?}", report.findings);
}

/// Space freed by truncates is discarded only once no committed root (the backup roots
/// included) references it: a device filling discarded ranges with junk loses nothing, the
/// space is reused by later writes (over discarded ranges), and everything reads back and
/// checks clean, data checksums included.
#[test]
fn freed_space_is_discarded_then_reused_and_reads_back() {
    let (mem, dev, fs) = fresh(128 << 20);
    let name = |i: u32| format!("/f{i}");
    let mut discarded: Vec<(u64, u64)> = Vec::new();
    let mut reused = false;
    for round in 0..30u32 {
        // Each round replaces every file's data (truncate to 0, write): the old blocks are
        // freed by this round's commit.
        for i in 0..16u32 {
            fs.write_file(&name(i), &pattern(round * 100 + i, 512 << 10))
                .expect("write");
        }
        fs.sync().expect("commit the round");
        for i in 0..16u32 {
            assert_eq!(
                fs.read_file(&name(i)).expect("read"),
                pattern(round * 100 + i, 512 << 10),
                "round {round} file {i}"
            );
        }
        for event in dev.take() {
            match event {
                Event::Discard(ranges) => discarded.extend(ranges),
                Event::Write(at, len) => reused |= overlaps(&discarded, at, len as u64),
                Event::Batch(writes) => {
                    reused |= writes
                        .iter()
                        .any(|(at, len)| overlaps(&discarded, *at, *len as u64))
                }
                Event::Flush => {}
            }
        }
    }
    assert!(!discarded.is_empty(), "freed space was discarded");
    assert!(reused, "discarded space was written again");
    fs.close().expect("close");
    drop(fs);
    let report = check(&*mem, CheckOptions { data: true }).expect("fsck");
    assert!(report.is_clean(), "{:?}", report.findings);
}

fn overlaps(ranges: &[(u64, u64)], at: u64, len: u64) -> bool {
    ranges.iter().any(|(s, l)| at < s + l && *s < at + len)
}
