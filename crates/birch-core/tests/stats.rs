//! The live-mount stats (`Filesystem::stats_json`, what `trusted.birch.stats` and `birch stats`
//! show): the gauges and latency histograms are present and move with the work that drives
//! them.

#![allow(clippy::expect_used)]

use std::sync::Arc;

use birch_core::counters::LATENCY_BUCKETS;
use birch_core::device::MemDevice;
use birch_core::vfs::{Caller, OpenOptions};
use birch_core::{Filesystem, MkfsOptions};
use birch_format::ROOT_INO;

/// The number after `"name": ` in the stats JSON.
fn number(json: &str, name: &str) -> u64 {
    let at = json
        .find(&format!("\"{name}\": "))
        .unwrap_or_else(|| panic!("{name} missing from {json}"));
    let rest = &json[at + name.len() + 4..];
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end]
        .parse()
        .unwrap_or_else(|e| panic!("{name}: {e} in {json}"))
}

/// The array after `"name": ` in the stats JSON.
fn array(json: &str, name: &str) -> Vec<u64> {
    let at = json
        .find(&format!("\"{name}\": ["))
        .unwrap_or_else(|| panic!("{name} missing from {json}"));
    let rest = &json[at + name.len() + 5..];
    let end = rest.find(']').expect("array closes");
    rest[..end]
        .split(',')
        .map(|n| n.trim().parse().expect("a count"))
        .collect()
}

#[test]
fn gauges_and_latencies_move_with_writes_fsyncs_and_commits() {
    let dev = Arc::new(MemDevice::new(64 << 20));
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    let fs = Filesystem::open_device(
        dev,
        OpenOptions {
            commit_interval: None,
            ..Default::default()
        },
    )
    .expect("open");
    let before = fs.stats_json();
    assert_eq!(number(&before, "dirty_bytes"), 0);
    assert!(number(&before, "log_size_bytes") > 0);
    let size = number(&before, "size_bytes");
    let free = number(&before, "free_bytes");
    assert!(free > 0 && free < size, "free {free} of {size}");
    for name in ["commit_latency_us_log2", "fsync_latency_us_log2"] {
        let buckets = array(&before, name);
        assert_eq!(buckets.len(), LATENCY_BUCKETS, "{name}");
    }

    let (file, _) = fs
        .create(Caller::default(), ROOT_INO, b"f", 0o644, 0)
        .expect("create");
    fs.write(file.ino, 0, &vec![7u8; 64 << 10], false)
        .expect("buffered write");
    let buffered = fs.stats_json();
    assert_eq!(number(&buffered, "dirty_bytes"), 64 << 10, "{buffered}");

    fs.fsync(file.ino, false).expect("fsync");
    let synced = fs.stats_json();
    assert_eq!(number(&synced, "dirty_bytes"), 0);
    assert_eq!(
        array(&synced, "fsync_latency_us_log2").iter().sum::<u64>(),
        1
    );
    assert!(number(&synced, "log_used_bytes") > 0, "{synced}");
    assert!(number(&synced, "free_bytes") < free);

    fs.sync().expect("commit");
    let committed = fs.stats_json();
    assert!(
        array(&committed, "commit_latency_us_log2")
            .iter()
            .sum::<u64>()
            >= 1
    );
    assert_eq!(
        number(&committed, "log_used_bytes"),
        0,
        "a durable commit makes the log reusable"
    );
    fs.close().expect("close");
}
