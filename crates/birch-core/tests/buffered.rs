//! The buffered data path (vfs/buffer.rs): what a buffered write promises before and after the
//! commit or fsync that writes it, and what its flush costs in device writes and extents.

#![allow(clippy::expect_used)]

mod common;

use birch_core::vfs::{Caller, SetAttr};
use birch_format::{InodeNo, BLOCK_SIZE, ROOT_INO};

use common::{close_and_check_clean, crash_and_reopen, fresh};

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A buffered write is not on the device until something flushes it: a power cut before any
/// commit or fsync loses it whole (the file stays as committed, never half-written); after
/// a commit or an fsync of the file, it is there.
#[test]
fn buffered_data_is_durable_after_commit_or_fsync_and_absent_before() {
    let (dev, fs) = fresh(64 << 20);
    let (a, _) = fs
        .create(Caller::default(), ROOT_INO, b"a", 0o644, 0)
        .expect("create");
    let (b, _) = fs
        .create(Caller::default(), ROOT_INO, b"b", 0o644, 0)
        .expect("create");
    let (c, _) = fs
        .create(Caller::default(), ROOT_INO, b"c", 0o644, 0)
        .expect("create");
    fs.sync().expect("commit the names");
    let writes_before = fs.engine().device().counters().values().device_writes;
    fs.write(a.ino, 0, &pattern(1, 300_000), false)
        .expect("write a");
    fs.write(b.ino, 0, &pattern(2, 300_000), false)
        .expect("write b");
    fs.write(c.ino, 0, &pattern(3, 300_000), false)
        .expect("write c");
    assert_eq!(
        fs.engine().device().counters().values().device_writes,
        writes_before,
        "buffered writes reach no device"
    );
    assert_eq!(
        fs.read(a.ino, 0, 300_000).expect("read"),
        pattern(1, 300_000)
    );
    fs.fsync(b.ino, false).expect("fsync b");
    let (dev2, fs) = crash_and_reopen(fs, &dev);
    assert_eq!(fs.getattr(a.ino).expect("a").size, 0, "a was never flushed");
    assert_eq!(
        fs.read(b.ino, 0, 300_000).expect("read b"),
        pattern(2, 300_000)
    );
    assert_eq!(
        fs.getattr(c.ino).expect("c").size,
        0,
        "fsync of b wrote only b"
    );
    fs.write(a.ino, 0, &pattern(4, 300_000), false)
        .expect("write a");
    fs.sync().expect("commit");
    let (dev3, fs) = crash_and_reopen(fs, &dev2);
    assert_eq!(
        fs.read(a.ino, 0, 300_000).expect("read a"),
        pattern(4, 300_000)
    );
    close_and_check_clean(fs, &dev3, "after the commit");
}

/// The replace-by-rename pattern (write a temporary file, rename it over the old one, no
/// fsync): the commit that holds the rename holds the new file's data too.
#[test]
fn a_rename_never_commits_without_the_data_written_before_it() {
    let (dev, fs) = fresh(64 << 20);
    fs.write_file("/config", &pattern(9, 50_000)).expect("old");
    fs.sync().expect("commit the old file");
    let (tmp, _) = fs
        .create(Caller::default(), ROOT_INO, b"config.tmp", 0o644, 0)
        .expect("create tmp");
    fs.write(tmp.ino, 0, &pattern(10, 70_000), false)
        .expect("write tmp");
    fs.rename(ROOT_INO, b"config.tmp", ROOT_INO, b"config", 0)
        .expect("rename");
    fs.sync().expect("commit");
    let (dev2, fs) = crash_and_reopen(fs, &dev);
    assert_eq!(fs.read_file("/config").expect("read"), pattern(10, 70_000));
    close_and_check_clean(fs, &dev2, "after the rename");
}

/// Random 4 KiB writes into a file: the flush writes them as one device write (delayed
/// allocation places them side by side) and one extent per file run; reads, st_blocks and
/// the content after a crash agree.
#[test]
fn scattered_writes_flush_in_one_device_write() {
    let (dev, fs) = fresh(64 << 20);
    let (f, _) = fs
        .create(Caller::default(), ROOT_INO, b"f", 0o644, 0)
        .expect("create");
    let blocks: Vec<u64> = (0..64u64).map(|i| (i * 37) % 256 * 2).collect();
    for (n, block) in blocks.iter().enumerate() {
        fs.write(
            f.ino,
            block * BLOCK_SIZE,
            &pattern(n as u8, BLOCK_SIZE as usize),
            false,
        )
        .expect("write");
    }
    let attr = fs.getattr(f.ino).expect("attr");
    assert_eq!(
        attr.blocks,
        64 * BLOCK_SIZE / 512,
        "st_blocks counts buffered blocks"
    );
    let before = fs.engine().device().counters().values().device_writes;
    let runs_before = fs.engine().counters().values().buffer_flush_runs;
    fs.fsync(f.ino, false).expect("fsync");
    let writes = fs.engine().device().counters().values().device_writes - before;
    // One data write, then the log batch (and its flush is no write).
    assert!(
        writes <= 2,
        "{writes} device writes for 64 scattered blocks"
    );
    assert_eq!(
        fs.engine().counters().values().buffer_flush_runs - runs_before,
        64,
        "one extent per separate file block"
    );
    assert_eq!(fs.getattr(f.ino).expect("attr").blocks, attr.blocks);
    let (dev2, fs) = crash_and_reopen(fs, &dev);
    for (n, block) in blocks.iter().enumerate() {
        assert_eq!(
            fs.read(f.ino, block * BLOCK_SIZE, BLOCK_SIZE as usize)
                .expect("read"),
            pattern(n as u8, BLOCK_SIZE as usize),
            "block {block}"
        );
    }
    close_and_check_clean(fs, &dev2, "after scattered writes");
}

/// Truncate drops buffered blocks past the new size and zeroes the rest of the block that
/// holds it; growing again reads zeros there, before and after the commit.
#[test]
fn truncate_cuts_buffered_data() {
    let (dev, fs) = fresh(64 << 20);
    let (f, _) = fs
        .create(Caller::default(), ROOT_INO, b"f", 0o644, 0)
        .expect("create");
    fs.write(f.ino, 0, &pattern(5, 20_000), false)
        .expect("write");
    let truncate = |size| {
        fs.setattr(
            f.ino,
            &SetAttr {
                size: Some(size),
                ..Default::default()
            },
        )
        .expect("truncate")
    };
    truncate(5_000);
    assert_eq!(
        truncate(16_384).blocks,
        16,
        "two buffered blocks left, 8 KiB"
    );
    let mut want = pattern(5, 5_000);
    want.resize(16_384, 0);
    assert_eq!(fs.read(f.ino, 0, 20_000).expect("read"), want);
    fs.sync().expect("commit");
    let (dev2, fs) = crash_and_reopen(fs, &dev);
    assert_eq!(fs.read(f.ino, 0, 20_000).expect("read"), want);
    close_and_check_clean(fs, &dev2, "after truncates");
}

/// Buffered blocks hold their disk space from WRITE on: statfs counts them as used, and a
/// full filesystem answers ENOSPC at write(2), not later at the commit.
#[test]
fn buffered_blocks_reserve_their_space_at_write() {
    let (dev, fs) = fresh(32 << 20);
    let (f, _) = fs
        .create(Caller::default(), ROOT_INO, b"f", 0o644, 0)
        .expect("create");
    let avail = fs.statfs().bavail;
    fs.write(f.ino, 0, &vec![7u8; 1 << 20], false)
        .expect("write 1 MiB");
    let taken = avail - fs.statfs().bavail;
    assert!(
        taken >= (1 << 20) / BLOCK_SIZE,
        "1 MiB buffered takes {taken} blocks of statfs"
    );
    let chunk = vec![8u8; 1 << 20];
    let mut written = 1u64;
    let err = loop {
        match fs.write(f.ino, written << 20, &chunk, false) {
            Ok(_) => written += 1,
            Err(e) => break e,
        }
        assert!(written < 64, "a 32 MiB filesystem took {written} MiB");
    };
    assert_eq!(err.errno(), libc::ENOSPC, "{err}");
    fs.sync()
        .expect("the commit of everything accepted finds its space");
    let (dev2, fs) = crash_and_reopen(fs, &dev);
    assert_eq!(fs.getattr(f.ino).expect("f").size, written << 20);
    assert_eq!(
        fs.read(f.ino, (written - 1) << 20, 1 << 20).expect("read"),
        chunk
    );
    close_and_check_clean(fs, &dev2, "after a full buffered fill");
}

/// A commit while other threads keep writing: every write that returned before the commit
/// began is in it, and the image is clean.
#[test]
fn commits_during_buffered_writes_keep_every_returned_write() {
    let (dev, fs) = fresh(128 << 20);
    let fs = std::sync::Arc::new(fs);
    let files: Vec<InodeNo> = (0..4)
        .map(|n| {
            fs.create(
                Caller::default(),
                ROOT_INO,
                format!("f{n}").as_bytes(),
                0o644,
                0,
            )
            .expect("create")
            .0
            .ino
        })
        .collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = files
        .iter()
        .map(|&ino| {
            let fs = fs.clone();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut off = 0u64;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) && off < (8 << 20) {
                    fs.write(
                        InodeNo::new(ino.get()),
                        off,
                        &pattern((off / 7) as u8, 7_000),
                        false,
                    )
                    .expect("write");
                    off += 7_000;
                }
            })
        })
        .collect();
    let mut sizes = Vec::new();
    for _ in 0..5 {
        std::thread::sleep(std::time::Duration::from_millis(20));
        let before: Vec<u64> = files
            .iter()
            .map(|&ino| fs.getattr(InodeNo::new(ino.get())).expect("attr").size)
            .collect();
        fs.sync().expect("commit");
        sizes = before;
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for w in writers {
        w.join().expect("writer");
    }
    let fs = std::sync::Arc::into_inner(fs).expect("last handle");
    let (dev2, fs) = crash_and_reopen(fs, &dev);
    for (ino, size) in files.iter().zip(sizes) {
        let got = fs.getattr(InodeNo::new(ino.get())).expect("attr").size;
        assert!(
            got >= size,
            "inode {ino}: {got} bytes after the crash, {size} before the last commit"
        );
        let data = fs
            .read(InodeNo::new(ino.get()), 0, got as usize)
            .expect("read");
        for (n, chunk) in data.chunks(7_000).enumerate() {
            let off = n as u64 * 7_000;
            assert_eq!(
                chunk,
                &pattern((off / 7) as u8, 7_000)[..chunk.len()],
                "inode {ino} at {off}"
            );
        }
    }
    close_and_check_clean(fs, &dev2, "after concurrent commits");
}

/// With buffering off (`OpenOptions::buffered` false) every write reaches the device before
/// it returns, as before the buffered path existed.
#[test]
fn buffering_off_writes_through() {
    let dev = common::fresh_device(32 << 20);
    let fs = birch_core::Filesystem::open_device(
        dev.clone(),
        birch_core::vfs::OpenOptions {
            commit_interval: None,
            buffered: false,
            ..Default::default()
        },
    )
    .expect("open");
    let (f, _) = fs
        .create(Caller::default(), ROOT_INO, b"f", 0o644, 0)
        .expect("create");
    let before = fs.engine().device().counters().values().device_writes;
    fs.write(f.ino, 0, &pattern(1, 100_000), false)
        .expect("write");
    assert!(fs.engine().device().counters().values().device_writes > before);
    assert_eq!(fs.engine().counters().values().buffered_blocks, 0);
    close_and_check_clean(fs, &dev, "write-through");
}

/// A file fsync'd write by write (a database's pages): once an fsync has queued everything of
/// it, whole-block writes go through and queue their own records, so each fsync only waits for
/// the log batch; nothing is buffered and nothing commits. Unaligned writes still buffer.
#[test]
fn whole_block_writes_to_a_log_clean_file_go_through() {
    let (dev, fs) = fresh(64 << 20);
    let (f, _) = fs
        .create(Caller::default(), ROOT_INO, b"db", 0o644, 0)
        .expect("create");
    fs.write(f.ino, 0, &pattern(1, 64 * 1024), false)
        .expect("write");
    fs.fsync(f.ino, false).expect("first fsync");
    let before = fs.engine().counters().values();
    for n in 0..20u64 {
        fs.write(f.ino, (n % 16) * BLOCK_SIZE, &pattern(n as u8, 4096), false)
            .expect("page write");
        fs.fsync(f.ino, false).expect("fsync");
    }
    let after = fs.engine().counters().values();
    assert_eq!(
        after.buffered_blocks, before.buffered_blocks,
        "nothing buffered"
    );
    assert_eq!(
        after.fsync_log - before.fsync_log,
        20,
        "every fsync through the log"
    );
    assert_eq!(after.commits, before.commits, "no commit");
    fs.write(f.ino, 100, b"unaligned", false).expect("write");
    assert_eq!(
        fs.engine().counters().values().buffered_blocks,
        after.buffered_blocks + 1,
        "a partial block is buffered"
    );
    fs.fsync(f.ino, false).expect("fsync");
    let (dev2, fs) = crash_and_reopen(fs, &dev);
    let mut want = pattern(1, 64 * 1024);
    for n in 0..20u64 {
        let at = ((n % 16) * BLOCK_SIZE) as usize;
        want[at..at + 4096].copy_from_slice(&pattern(n as u8, 4096));
    }
    want[100..109].copy_from_slice(b"unaligned");
    assert_eq!(fs.read(f.ino, 0, 64 * 1024).expect("read"), want);
    close_and_check_clean(fs, &dev2, "after page writes");
}

/// A file whose state leaves the inode table (closed, forgotten by the kernel) with buffered
/// data: the data goes to disk on the way out, so the state loaded next reads it.
#[test]
fn an_evicted_file_keeps_its_buffered_data() {
    let (dev, fs) = fresh(64 << 20);
    let (f, fh) = fs
        .create(Caller::default(), ROOT_INO, b"f", 0o644, 0)
        .expect("create");
    fs.write(f.ino, 0, &pattern(3, 100_000), false)
        .expect("write");
    fs.release(f.ino, fh).expect("close");
    let flushes = fs.engine().counters().values().buffer_flushes;
    fs.forget(f.ino, 1);
    assert_eq!(
        fs.engine().counters().values().buffer_flushes,
        flushes + 1,
        "eviction flushed"
    );
    assert_eq!(
        fs.read(f.ino, 0, 100_000).expect("read"),
        pattern(3, 100_000)
    );
    fs.sync().expect("commit");
    let (dev2, fs) = crash_and_reopen(fs, &dev);
    assert_eq!(
        fs.read(f.ino, 0, 100_000).expect("read"),
        pattern(3, 100_000)
    );
    close_and_check_clean(fs, &dev2, "after eviction");
}

/// A commit after writing many small files (an unpacked tree): the drain flushes them from
/// several threads, and every file is whole after a crash that follows the commit.
#[test]
fn a_drain_of_many_files_keeps_them_all() {
    let (dev, fs) = fresh(128 << 20);
    let files: Vec<InodeNo> = (0..300u32)
        .map(|n| {
            let (f, fh) = fs
                .create(
                    Caller::default(),
                    ROOT_INO,
                    format!("f{n}").as_bytes(),
                    0o644,
                    0,
                )
                .expect("create");
            fs.write(f.ino, 0, &pattern(n as u8, 3_000 + n as usize * 37), false)
                .expect("write");
            fs.release(f.ino, fh).expect("close");
            f.ino
        })
        .collect();
    let flushes = fs.engine().counters().values().buffer_flushes;
    fs.sync().expect("commit");
    assert_eq!(
        fs.engine().counters().values().buffer_flushes - flushes,
        300,
        "one flush per file"
    );
    let (dev2, fs) = crash_and_reopen(fs, &dev);
    for (n, ino) in files.iter().enumerate() {
        let len = 3_000 + n * 37;
        assert_eq!(
            fs.read(InodeNo::new(ino.get()), 0, len + 10).expect("read"),
            pattern(n as u8, len)
        );
    }
    close_and_check_clean(fs, &dev2, "after a drain of many files");
}

/// A read of a range the write buffer holds whole is answered from the buffer, with no
/// device read; a range that is partly on disk still reads the disk for the rest.
#[test]
fn a_read_of_buffered_blocks_does_not_read_the_device() {
    let (dev, fs) = fresh(64 << 20);
    let (f, _) = fs
        .create(Caller::default(), ROOT_INO, b"f", 0o644, 0)
        .expect("create");
    let old = pattern(1, 8 * BLOCK_SIZE as usize);
    fs.write(f.ino, 0, &old, false).expect("write");
    fs.sync().expect("commit");
    let new = pattern(2, 4 * BLOCK_SIZE as usize);
    fs.write(f.ino, 2 * BLOCK_SIZE, &new, false)
        .expect("overwrite");
    let reads = || fs.engine().device().counters().values().device_reads;
    let before = reads();
    let got = fs
        .read(f.ino, 2 * BLOCK_SIZE, 4 * BLOCK_SIZE as usize)
        .expect("read buffered");
    assert_eq!(got, new);
    assert_eq!(reads() - before, 0, "buffered blocks read from the device");
    let got = fs
        .read(f.ino, BLOCK_SIZE, 6 * BLOCK_SIZE as usize)
        .expect("read across");
    let mut want = old[BLOCK_SIZE as usize..7 * BLOCK_SIZE as usize].to_vec();
    want[BLOCK_SIZE as usize..5 * BLOCK_SIZE as usize].copy_from_slice(&new);
    assert_eq!(got, want, "buffered blocks over the disk's");
    assert!(reads() > before, "blocks 1 and 6 come from the device");
    fs.sync().expect("commit");
    close_and_check_clean(fs, &dev, "after buffered reads");
}
