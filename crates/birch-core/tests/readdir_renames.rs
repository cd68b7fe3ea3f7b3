//! A directory listing ends even when the reader renames every entry it reads away and back
//! (xfstests generic/736, `readdir-while-renames`). Each rename gives the name a new, higher
//! position in the directory index, so a listing that followed the index to its current end
//! met every name again and again ("Found too many directory entries (15001)"): it must stop
//! at the last position that existed when it started, return every name at least once, and
//! never return one more than three times in all (the test's bound). Names created after the
//! listing started are not returned; a new listing (offset 0) sees them. Ends with fsck.

#![allow(clippy::expect_used)]

mod common;

use birch_core::vfs::Caller;

const FILES: usize = 2000;

#[test]
fn listing_ends_while_entries_are_renamed_away_and_back() {
    let (dev, fs) = common::fresh(256 << 20);
    let c = Caller::default();
    let dir = fs.mkdir(c, 1, b"d", 0o755).expect("mkdir").ino;
    for i in 1..=FILES {
        fs.create(c, dir, i.to_string().as_bytes(), 0o644, 0)
            .expect("create");
    }
    let mut offset = 0;
    let mut seen = 0;
    let mut names = std::collections::BTreeSet::new();
    loop {
        let page = fs.readdir(dir, offset, 64).expect("readdir");
        let Some(last) = page.last() else { break };
        offset = last.next_offset;
        for e in page {
            seen += 1;
            assert!(
                seen <= 3 * FILES,
                "listing does not end: {seen} entries for {FILES} files"
            );
            if e.name == b"." || e.name == b".." {
                continue;
            }
            fs.rename(dir, &e.name, dir, b"TEMPFILE", 0)
                .expect("rename away");
            fs.rename(dir, b"TEMPFILE", dir, &e.name, 0)
                .expect("rename back");
            names.insert(e.name);
        }
    }
    assert_eq!(names.len(), FILES, "every name listed at least once");
    assert!(seen >= FILES + 2, "{seen} entries");
    // A new listing sees every name once, at its new position, and a name made after a
    // listing started is seen by the next one.
    let first = fs.readdir(dir, 0, 3).expect("readdir");
    fs.create(c, dir, b"late", 0o644, 0).expect("create late");
    let mut rest = Vec::new();
    let mut offset = first.last().expect("entries").next_offset;
    loop {
        let page = fs.readdir(dir, offset, 100).expect("readdir");
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
