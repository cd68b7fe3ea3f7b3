//! What the engine asks of its device (DESIGN §14.4): node and data writes in batches
//! (`BlockDevice::write_many`, in flight together on RBD), the ordering rules kept around
//! them (a superblock is written only after its nodes' writes completed and a flush after
//! them; a commit is done only after its superblock and a flush after it), and freed space
//! discarded (`BlockDevice::discard`) only once no committed root references it, with
//! nothing assuming it reads back as zeros; a read of a file of many extents asks for them
//! as one batch (`BlockDevice::read_many`, in flight together on RBD).

#![allow(clippy::expect_used)]

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use birch_core::device::MemDevice;
use birch_core::{Filesystem, MkfsOptions};
use birch_format::superblock::SUPER_OFFSETS;

use birch_format::InodeNo;
use common::{Event, Recording};

fn open(dev: &Arc<Recording>) -> Filesystem {
    common::open_quiet(dev)
}

fn fresh(bytes: u64) -> (Arc<MemDevice>, Arc<Recording>, Filesystem) {
    let mem = Arc::new(MemDevice::new(bytes));
    let dev = Recording::trimming(mem.clone());
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
            Event::WriteMany(w) => Some(w),
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
        events.iter().any(|e| matches!(e, Event::WriteMany(w)
            if w.len() >= 2 && w.iter().all(|(_, len)| *len >= 1 << 20))),
        "the big file's runs are written as one batch: {events:?}"
    );
    assert_eq!(fs.read_file("/big").expect("read big"), big);
    common::close_and_check_clean(fs, &mem, "the batched commits");
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
                Event::WriteMany(writes) => {
                    reused |= writes
                        .iter()
                        .any(|(at, len)| overlaps(&discarded, *at, *len as u64))
                }
                Event::Flush | Event::Read(..) | Event::ReadMany(_) => {}
            }
        }
    }
    assert!(!discarded.is_empty(), "freed space was discarded");
    assert!(reused, "discarded space was written again");
    common::close_and_check_clean(fs, &mem, "the discards and reuse");
}

fn overlaps(ranges: &[(u64, u64)], at: u64, len: u64) -> bool {
    ranges.iter().any(|(s, l)| at < s + l && *s < at + len)
}

/// Writes `blocks` blocks to `/a` and `/b` one block each in turn, a commit after each
/// pair, so each file's blocks lie every other block on disk: `/a` has `blocks` extents, none
/// adjacent to another. Returns `/a`'s inode and content.
fn fragmented(fs: &Filesystem, blocks: u32) -> (u64, Vec<u8>) {
    fs.write_file("/a", b"").expect("create a");
    fs.write_file("/b", b"").expect("create b");
    let a = fs.resolve("/a").expect("resolve a");
    let b = fs.resolve("/b").expect("resolve b");
    let mut content = Vec::new();
    for i in 0..blocks {
        let block = pattern(i, 4096);
        fs.write(a, u64::from(i) * 4096, &block, false)
            .expect("write a");
        fs.write(b, u64::from(i) * 4096, &pattern(1000 + i, 4096), false)
            .expect("write b");
        fs.sync().expect("commit");
        content.extend_from_slice(&block);
    }
    (a.get(), content)
}

/// A fresh filesystem on a recording device with `/a` in `blocks` extents ([`fragmented`]):
/// the setup's events taken, reads recorded from now on. Returns the memory device below,
/// the recording one, the filesystem, and `/a`'s inode and content.
fn fragmented_recording(blocks: u32) -> (Arc<MemDevice>, Arc<Recording>, Filesystem, u64, Vec<u8>) {
    let (mem, dev, fs) = fresh(64 << 20);
    let (a, content) = fragmented(&fs, blocks);
    dev.take();
    dev.reads.store(true, Ordering::SeqCst);
    (mem, dev, fs, a, content)
}

/// A read that covers many extents not adjacent on disk asks the device for all of them
/// in one `read_many` (on RBD: in flight together), and reads back what was written, every
/// block's checksum verified; a read of one extent stays one `read_at`.
#[test]
fn a_read_of_many_extents_is_one_read_many() {
    let (mem, dev, fs, a, content) = fragmented_recording(24);
    let got = fs.read(InodeNo::new(a), 0, content.len()).expect("read a");
    assert_eq!(got, content, "the fragmented file reads back");
    let batches = dev.take_read_batches();
    assert_eq!(
        batches.len(),
        1,
        "one read_many for the request: {batches:?}"
    );
    assert_eq!(batches[0].len(), 24, "one read per extent: {batches:?}");
    assert!(
        batches[0].iter().all(|(_, len)| *len == 4096),
        "{batches:?}"
    );
    // A read inside one extent: a single read_at, no batch.
    let got = fs
        .read(InodeNo::new(a), 4096 * 3 + 100, 1000)
        .expect("read in one extent");
    assert_eq!(got, content[4096 * 3 + 100..4096 * 3 + 1100]);
    let events = dev.take();
    assert!(
        !events.iter().any(|e| matches!(e, Event::ReadMany(_))),
        "{events:?}"
    );
    dev.reads.store(false, Ordering::SeqCst);
    common::close_and_check_clean(fs, &mem, "the batched reads");
}

/// Every read of any range of a file of many fragmented extents, on a plain memory device
/// (the default `read_many`, one read after the other), returns what was written.
#[test]
fn fragmented_extents_read_back_at_every_range() {
    let mem = Arc::new(MemDevice::new(64 << 20));
    Filesystem::mkfs(mem.clone(), &MkfsOptions::default()).expect("mkfs");
    let fs = common::open_quiet(&mem);
    let (a, content) = fragmented(&fs, 40);
    for (offset, len) in [
        (0usize, content.len()),
        (1, content.len() - 1),
        (4095, 4098),
        (4096 * 7 + 13, 4096 * 20),
        (4096 * 39, 4096),
        (4096 * 10, 4096 * 30 + 5000),
    ] {
        let got = fs.read(InodeNo::new(a), offset as u64, len).expect("read");
        let end = (offset + len).min(content.len());
        assert_eq!(got, content[offset..end], "read at {offset} length {len}");
    }
    common::close_and_check_clean(fs, &mem, "fragmented reads");
}

/// One failed read of a batch fails the whole request, with an error naming the inode and
/// the device's own error (which read, where).
#[test]
fn a_failed_read_of_a_batch_fails_the_request_with_context() {
    let (_mem, dev, fs, a, content) = fragmented_recording(8);
    fs.read(InodeNo::new(a), 0, content.len()).expect("read a");
    let reads = dev
        .take_read_batches()
        .into_iter()
        .next()
        .expect("one read_many");
    // Fail the fifth extent's read.
    dev.fail_read_at.store(reads[4].0, Ordering::SeqCst);
    let err = fs
        .read(InodeNo::new(a), 0, content.len())
        .expect_err("a failed read fails the request");
    let text = err.to_string();
    assert!(
        text.contains(&format!("inode {a}")) && text.contains("injected read failure"),
        "{text}"
    );
    dev.fail_read_at.store(u64::MAX, Ordering::SeqCst);
    assert_eq!(
        fs.read(InodeNo::new(a), 0, content.len())
            .expect("read again"),
        content
    );
}

/// Writes `/{prefix}0` to `/{prefix}7`, each `len` bytes of `pattern(seed + i)`, and commits.
fn fill(fs: &Filesystem, prefix: &str, seed: u32, len: usize) {
    for i in 0..8u32 {
        fs.write_file(&format!("/{prefix}{i}"), &pattern(seed + i, len))
            .expect("write");
    }
    fs.sync().expect("commit");
}

/// The files [`fill`] wrote read back.
fn assert_filled(fs: &Filesystem, prefix: &str, seed: u32, len: usize) {
    for i in 0..8u32 {
        assert_eq!(
            fs.read_file(&format!("/{prefix}{i}")).expect("read"),
            pattern(seed + i, len),
            "/{prefix}{i}"
        );
    }
}

/// `fstrim` (`Filesystem::trim`): discards the space free now, never a block in use (the
/// device fills discarded ranges with junk, and every file reads back and checks clean with
/// data checksums), keeps inside the asked range, skips runs below the minimum, answers the
/// bytes discarded, and leaves the space usable. On a device that frees nothing on a discard
/// it is refused as unsupported (EOPNOTSUPP).
#[test]
fn trim_discards_free_space_only_within_the_range() {
    let (mem, dev, fs) = fresh(64 << 20);
    fill(&fs, "f", 0, 300 << 10);
    dev.take();
    let alloc = fs.engine().allocator();
    let searchable = (alloc.free_blocks() - alloc.deferred_blocks()).get() * 4096;
    let trimmed = fs.trim(0, u64::MAX, 0).expect("trim everything");
    let discarded = dev.take_discards();
    assert_eq!(
        trimmed,
        discarded.iter().map(|(_, l)| l).sum::<u64>(),
        "answers what it discarded"
    );
    assert_eq!(trimmed, searchable, "all the searchable free space");
    assert_filled(&fs, "f", 0, 300 << 10);
    // A range: nothing outside it. A minimum: no shorter run.
    let (start, len) = (8u64 << 20, 4u64 << 20);
    let part = fs.trim(start, len, 0).expect("trim a range");
    let ranges = dev.take_discards();
    assert!(part > 0 && part <= len, "{part}");
    assert!(
        ranges
            .iter()
            .all(|(at, l)| *at >= start && at + l <= start + len),
        "{ranges:?}"
    );
    let past_end = fs.trim(u64::MAX - 4096, 4096, 0);
    assert!(
        matches!(past_end, Err(birch_core::Error::Invalid(_))),
        "a range starting past the device is EINVAL, as on ext4: {past_end:?}"
    );
    let big = fs.trim(0, u64::MAX, 1 << 20).expect("trim with a minimum");
    let ranges = dev.take_discards();
    assert!(big > 0);
    assert!(ranges.iter().all(|(_, l)| *l >= 1 << 20), "{ranges:?}");
    assert!(matches!(
        fs.trim(0, 100, 0),
        Err(birch_core::Error::Invalid(_))
    ));
    // The space is usable after: new files over trimmed space read back.
    fill(&fs, "g", 50, 1 << 20);
    assert_filled(&fs, "g", 50, 1 << 20);
    common::close_and_check_clean(fs, &mem, "the trims");
    // A memory device frees nothing on a discard: unsupported.
    let (_mem, plain) = common::fresh(16 << 20);
    let err = plain.trim(0, u64::MAX, 0).expect_err("unsupported");
    assert_eq!(err.errno(), libc::EOPNOTSUPP, "{err}");
}
