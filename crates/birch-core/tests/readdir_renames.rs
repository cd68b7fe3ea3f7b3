//! A directory listing ends even when the reader renames every entry it reads away and back
//! (xfstests generic/736, `readdir-while-renames`). Each rename gives the name a new, higher
//! position in the directory index, so a listing that followed the index to its current end
//! met every name again and again ("Found too many directory entries (15001)"). A listing that
//! stops at the end the directory had when it started (`readdir_end`, `readdir_until`, what
//! the FUSE adapter keeps per open directory) returns every name at least once and ends; the
//! same loop over plain `readdir` does not (checked below, bounded). Names made after the
//! listing started are not returned; a new listing sees them. Ends with fsck. Also: the
//! lookup READDIRPLUS makes for each listed entry (`lookup_listed`) answers and counts as a
//! LOOKUP does.

#![allow(clippy::expect_used)]

mod common;

use birch_core::vfs::Caller;
use birch_core::Filesystem;
use birch_format::{InodeNo, ROOT_INO};

const FILES: usize = 2000;

/// Lists `dir` in pages of 64, renaming each entry away and back as it is read; `bounded`:
/// stop at the end the directory had at the start. Returns the entries read (at most
/// 3 * FILES + 1: the reader gives up there) and the distinct names.
fn list_while_renaming(fs: &Filesystem, dir: u64, bounded: bool) -> (usize, usize) {
    let end = bounded.then(|| fs.readdir_end(InodeNo::new(dir)).expect("readdir_end"));
    let mut offset = 0;
    let mut seen = 0;
    let mut names = std::collections::BTreeSet::new();
    loop {
        let page = fs
            .readdir_until(InodeNo::new(dir), offset, 64, end)
            .expect("readdir");
        let Some(last) = page.last() else { break };
        offset = last.next_offset;
        for e in page {
            seen += 1;
            if seen > 3 * FILES {
                return (seen, names.len());
            }
            if e.name == b"." || e.name == b".." {
                continue;
            }
            fs.rename(
                InodeNo::new(dir),
                &e.name,
                InodeNo::new(dir),
                b"TEMPFILE",
                0,
            )
            .expect("rename away");
            fs.rename(
                InodeNo::new(dir),
                b"TEMPFILE",
                InodeNo::new(dir),
                &e.name,
                0,
            )
            .expect("rename back");
            names.insert(e.name);
        }
    }
    (seen, names.len())
}

#[test]
fn listing_ends_while_entries_are_renamed_away_and_back() {
    let (dev, fs) = common::fresh(256 << 20);
    let c = Caller::default();
    let dir = fs.mkdir(c, ROOT_INO, b"d", 0o755).expect("mkdir").ino;
    for i in 1..=FILES {
        fs.create(c, dir, i.to_string().as_bytes(), 0o644, 0)
            .expect("create");
    }
    let (seen, names) = list_while_renaming(&fs, dir.get(), true);
    assert!(
        seen <= 3 * FILES,
        "listing does not end: {seen} entries for {FILES} files"
    );
    assert_eq!(names, FILES, "every name listed at least once");
    assert!(seen >= FILES + 2, "{seen} entries");
    // Without the end the same loop goes on (what generic/736 met).
    let (seen, _) = list_while_renaming(&fs, dir.get(), false);
    assert!(
        seen > 3 * FILES,
        "an unbounded listing ended after {seen} entries"
    );
    // A name made after a listing started is not in it, and is in the next one.
    let end = fs.readdir_end(dir).expect("end");
    let first = fs.readdir_until(dir, 0, 3, Some(end)).expect("readdir");
    fs.create(c, dir, b"late", 0o644, 0).expect("create late");
    let mut rest = Vec::new();
    let mut offset = first.last().expect("entries").next_offset;
    loop {
        let page = fs
            .readdir_until(dir, offset, 100, Some(end))
            .expect("readdir");
        let Some(last) = page.last() else { break };
        offset = last.next_offset;
        rest.extend(page.into_iter().map(|e| e.name));
    }
    assert_eq!(first.len() + rest.len(), FILES + 2);
    assert!(!rest.iter().any(|n| n == b"late"));
    let all = fs.readdir(dir, 0, 10 * FILES).expect("readdir");
    assert_eq!(all.len(), FILES + 3);
    assert!(all.iter().any(|e| e.name == b"late"));
    common::close_and_check_clean(fs, &dev, "after the renames");
}

/// READDIRPLUS answers each listed entry with `lookup_listed` (no second name search): the
/// same attributes as a LOOKUP, one lookup counted per answer (so the kernel's FORGETs free an
/// unlinked inode exactly when they would after LOOKUPs), and the snapshot directory and "."
/// and ".." still answered.
#[test]
fn a_listed_entry_answers_and_counts_as_a_lookup() {
    let (dev, fs) = common::fresh(64 << 20);
    let c = Caller::default();
    let dir = fs.mkdir(c, ROOT_INO, b"d", 0o755).expect("mkdir").ino;
    for name in [&b"a"[..], b"b", b"c"] {
        let (attr, fh) = fs.create(c, dir, name, 0o640, 0).expect("create");
        fs.release(attr.ino, fh).expect("release");
    }
    let listed = fs.readdir_until(dir, 0, 100, None).expect("readdir");
    assert_eq!(listed.len(), 5);
    for e in &listed {
        let by_name = fs.lookup(dir, &e.name).expect("lookup");
        let by_listing = fs
            .lookup_listed(dir, &e.name, e.ino)
            .expect("lookup_listed");
        assert_eq!(by_name, by_listing);
    }
    // "a": one lookup from CREATE, one from `lookup`, one from `lookup_listed`. Unlinked, it
    // lives until the third FORGET.
    let a = listed.iter().find(|e| e.name == b"a").expect("a").ino;
    fs.unlink(dir, b"a").expect("unlink");
    fs.forget(a, 2);
    assert!(
        fs.getattr(a).is_ok(),
        "freed while a lookup is still counted"
    );
    fs.forget(a, 1);
    assert!(fs.getattr(a).is_err(), "kept after its last FORGET");
    for e in &listed {
        if e.name != b"a" && e.name != b"." && e.name != b".." {
            fs.forget(e.ino, 3);
        }
    }
    common::close_and_check_clean(fs, &dev, "after listed lookups");
}
