//! A full disk under the kernel's writeback cache: the one owner of how a writer hears ENOSPC
//! when the kernel, not the daemon, holds its data (DESIGN §12.4).
//!
//! The problem: with FUSE_WRITEBACK_CACHE a write(2) ends in the kernel's page cache, and the
//! daemon sees the data only when the kernel writes it back. If the filesystem is full by
//! then, ENOSPC can no longer reach that write(2): the kernel drops the pages and keeps the
//! error for fsync(2) and close(2).
//!
//! Where ENOSPC is raised: only in birch-core, as `Error::NoSpace` from allocation (the vfs
//! layer and below; that part, with the wait for releases of unlinked open files,
//! `Filesystem::wait_for_releases` / `release_may_free_space` / `set_release_wait`, stays
//! there). This module decides *when* a request meets it and *who* reports it:
//!
//! 1. **The dirty cap** ([`DirtyCap`], sized by [`size_for_mount`], run by the daemon's serve
//!    loop, `crate::daemon`): the kernel may hold at most the mount's writeback device's
//!    `max_bytes` dirty. The base cap is a sixteenth of the filesystem (16 to 256 MiB); the
//!    *headroom* (`FuseOptions::write_through_below`) is twice the base. Every
//!    [`DIRTY_CAP_EVERY`] (100 ms) the cap is fitted to free space: half the free space above
//!    the headroom, at most an eighth of memory, at least the base. What the kernel holds
//!    dirty therefore always fits in free space when it is written back.
//! 2. **Write-through below the headroom**: an open for writing while free space is below the
//!    headroom gets `FOPEN_DIRECT_IO` (`BirchFuse::opened`), so its WRITEs reach the daemon
//!    at write(2) and ENOSPC comes back from write(2) itself.
//! 3. **Opens cached earlier** ([`LostWrites`], [`WriteVerdict`]): a write-back WRITE
//!    (`FUSE_WRITE_CACHE`) that fails with ENOSPC, or that leaves less than the headroom,
//!    marks its inode and drops the kernel's attributes of it; the next write(2) on the file
//!    starts with a GETATTR carrying the handle, which `getattr` answers ENOSPC, once per mark.
//!    The last release of a write handle of the inode clears the mark.
//! 4. **Space about to come back**: a request served on a request loop that finds no space
//!    while an unlinked file the kernel still holds may be released is served again on a
//!    worker ([`BirchFuse::retry_on_worker`]; WRITE, at most [`MAX_WRITE_WAITS`] at once, and
//!    FALLOCATE), which waits for the release before it answers ENOSPC; a write-back that left
//!    less than the headroom is answered at once and a worker decides later whether its
//!    writer hears ENOSPC ([`BirchFuse::decide_low_space_later`]).
//!
//! Who reports it: write(2) (a written-through WRITE, or the GETATTR of step 3); fsync(2) and
//! close(2) only for pages the kernel had to drop, which the cap and the headroom prevent.
//! Must not touch: allocation and space accounting (birch-core), the session (the daemon's),
//! any writeback device but the mount's own.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use birch_core::{Error, Filesystem};
use fuser::ReplyWrite;

use crate::attrs::errno;
use crate::daemon::mountinfo::{canonical, unescape};
use crate::invalidate::invalidate_attrs;
use crate::{waiters, BirchFuse};

/// Inodes whose writer should hear ENOSPC at its next write(2): a write-back WRITE arrived
/// while free space was below the write-through headroom, or the daemon refused one with
/// ENOSPC, since the last report.
///
/// With the writeback cache a write(2) ends in the kernel's page cache; the daemon sees the
/// data only when the kernel writes it back, and if the filesystem is full by then the kernel
/// drops those pages and keeps the error for fsync(2) and close(2). A writer that never closes
/// (`dd` filling the disk) would never hear of it and write on forever, and one that checks
/// only write(2) would lose data silently. So such a write-back marks its inode and drops the
/// kernel's attributes of it; the kernel asks for them again (GETATTR with the file handle)
/// at the start of the next write(2) on the file, and that GETATTR is answered ENOSPC, once per
/// mark, which write(2) returns. Marked below the headroom, the writer stops while what the
/// kernel holds dirty still fits, so nothing is lost (xfstests generic/015: dd's write fails,
/// its close does not). A GETATTR without a handle (stat) is answered as always. The last close
/// of the inode clears the mark.
pub(crate) struct LostWrites {
    any: std::sync::atomic::AtomicBool,
    inodes: parking_lot::Mutex<std::collections::HashSet<u64>>,
}

impl LostWrites {
    pub(crate) fn new() -> LostWrites {
        LostWrites {
            any: std::sync::atomic::AtomicBool::new(false),
            inodes: parking_lot::Mutex::new(std::collections::HashSet::new()),
        }
    }

    /// Marks `ino`: a write-back of it was refused with ENOSPC.
    pub(crate) fn mark(&self, ino: u64) {
        let mut inodes = self.inodes.lock();
        inodes.insert(ino);
        self.any.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Whether `ino` was marked, clearing the mark (one report per mark).
    pub(crate) fn take(&self, ino: u64) -> bool {
        if !self.any.load(std::sync::atomic::Ordering::Acquire) {
            return false;
        }
        let mut inodes = self.inodes.lock();
        let found = inodes.remove(&ino);
        if inodes.is_empty() {
            self.any.store(false, std::sync::atomic::Ordering::Release);
        }
        found
    }
}

/// At most this many WRITEs wait for releases at once (see `BirchFuse::write`). Write-backs
/// are background requests, and the kernel has at most `max_background` (64, set in `init`)
/// of them in flight, RELEASE included: were all of them waiting for a RELEASE queued behind
/// them, none would end before the wait runs out. Past this many, a WRITE is answered at once.
pub(crate) const MAX_WRITE_WAITS: usize = 8;

/// Default free-space headroom below which writes are written through: twice the 48 MiB the
/// kernel lets a FUSE mount hold dirty on this class of machine (1% of dirtyable memory), for
/// the copy-on-write overhead of each block written back.
pub const DEFAULT_WRITE_THROUGH_BELOW: u64 = 128 << 20;

impl BirchFuse {
    /// Whether free space is below the write-through headroom.
    pub(crate) fn low_on_space(&self) -> bool {
        low_on_space(&self.fs, self.options.write_through_below)
    }

    /// After a write-back of `ino` left less than the headroom while an unlinked file the
    /// kernel holds may be released: a worker waits for releases until free space is back
    /// above the headroom, then marks the writer for ENOSPC (see [`LostWrites`]) only if it
    /// is not. One decision per inode at a time: later write-backs meanwhile are covered by it.
    pub(crate) fn decide_low_space_later(&self, ino: u64) {
        if !self.deciding.lock().insert(ino) {
            return;
        }
        let fs = self.fs.clone();
        let notifier = self.notifier.clone();
        let lost_writes = self.lost_writes.clone();
        let deciding = self.deciding.clone();
        let headroom = self.options.write_through_below;
        self.waiters.run(move || {
            // Each freed file may not be enough: wait again while space is still low.
            loop {
                let seen = fs.releases_seen();
                let freed = fs.wait_for_releases(seen, || !low_on_space(&fs, headroom));
                if !freed || !low_on_space(&fs, headroom) {
                    break;
                }
            }
            deciding.lock().remove(&ino);
            if low_on_space(&fs, headroom) {
                lost_writes.mark(ino);
                invalidate_attrs(&notifier, ino);
            }
        });
    }

    /// Whether a request that found no space (or, for a write-back, too little) should be
    /// served again on a worker, where it may wait for releases: it runs on a request loop,
    /// and an unlinked file the kernel still holds may be released soon (its RELEASE can
    /// arrive after later requests over io_uring, DESIGN §12.5).
    pub(crate) fn retry_on_worker(&self) -> bool {
        !waiters::on_worker() && self.fs.release_may_free_space()
    }
}

/// One of the [`MAX_WRITE_WAITS`] slots, given back when dropped.
pub(crate) struct WaitSlot(pub(crate) Arc<AtomicUsize>);

impl Drop for WaitSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How a WRITE served without the worker pool's write-through is answered.
pub(crate) struct WriteVerdict<'a> {
    pub(crate) fs: &'a Filesystem,
    pub(crate) notifier: &'a OnceLock<fuser::Notifier>,
    pub(crate) lost_writes: &'a LostWrites,
    /// The write-through headroom ([`crate::FuseOptions::write_through_below`]).
    pub(crate) headroom: u64,
    pub(crate) ino: u64,
    /// A write-back of the kernel's cache (`FUSE_WRITE_CACHE`).
    pub(crate) cached: bool,
}

impl WriteVerdict<'_> {
    /// Replies with `result`, marking the inode's writer for ENOSPC (see [`LostWrites`])
    /// when a write-back failed for lack of space or left less than the headroom.
    pub(crate) fn reply(&self, result: birch_core::Result<u32>, reply: ReplyWrite) {
        match result {
            Ok(n) => {
                // A write-back below the headroom: the writer, whose open was cached while
                // space was plentiful, hears ENOSPC at its next write(2), while what the
                // kernel still holds dirty (at most half the headroom) fits.
                if self.cached && low_on_space(self.fs, self.headroom) {
                    self.lost_writes.mark(self.ino);
                    invalidate_attrs(self.notifier, self.ino);
                }
                reply.written(n)
            }
            Err(e) => {
                if self.cached && matches!(e, Error::NoSpace(_)) {
                    self.lost_writes.mark(self.ino);
                    invalidate_attrs(self.notifier, self.ino);
                }
                reply.error(errno("write", &e))
            }
        }
    }
}

/// Whether `fs` has less free space than `headroom` bytes.
pub(crate) fn low_on_space(fs: &Filesystem, headroom: u64) -> bool {
    let s = fs.statfs();
    s.bavail.saturating_mul(u64::from(s.bsize)) < headroom
}

/// The write-through headroom of a mount just made at `mountpoint` and, with the writeback
/// cache, the dirty-page cap to keep (set once here; the daemon then runs
/// [`DirtyCap::follow`]). The *base* cap is a sixteenth of the filesystem, between 16 and
/// 256 MiB; opens for writing are written through once free space falls below twice the base
/// (the headroom). Above that, the cap follows free space. Without a cap that can be set, the
/// kernel's own (1% of dirtyable memory) is unknown: the headroom is then at least
/// [`DEFAULT_WRITE_THROUGH_BELOW`].
pub(crate) fn size_for_mount(
    fs: &Filesystem,
    mountpoint: &Path,
    writeback: bool,
) -> (u64, Option<DirtyCap>) {
    let size = fs.statfs();
    let size = size.blocks.saturating_mul(u64::from(size.bsize));
    let base = (size / 16).clamp(16 << 20, 256 << 20);
    let mut write_through_below = 2 * base;
    let mut cap = None;
    if writeback {
        match bdi_max_bytes(mountpoint) {
            Ok(path) => {
                let mut live = DirtyCap::new(path, base, write_through_below);
                match live.update(free_bytes(fs)) {
                    Ok(()) => cap = Some(live),
                    Err(e) => {
                        log::warn!("dirty limit of {}: {e}", mountpoint.display());
                        write_through_below = write_through_below.max(DEFAULT_WRITE_THROUGH_BELOW);
                    }
                }
            }
            Err(e) => {
                log::warn!("dirty limit of {}: {e}", mountpoint.display());
                // The kernel's own cap (1% of dirtyable memory) is unknown: be generous.
                write_through_below = write_through_below.max(DEFAULT_WRITE_THROUGH_BELOW);
            }
        }
    }
    (write_through_below, cap)
}

/// Free space as `df` shows it (blocks freed since the last commit included: DESIGN §10.7).
fn free_bytes(fs: &Filesystem) -> u64 {
    let s = fs.statfs();
    s.bavail.saturating_mul(u64::from(s.bsize))
}

/// How often the dirty cap is fitted to free space. Free space cannot fall by the headroom plus
/// the cap (at least 48 MiB) in this time on any device birch serves, so what the kernel holds
/// dirty always fits when it is written back.
const DIRTY_CAP_EVERY: Duration = Duration::from_millis(100);

/// The mount's dirty-page cap, fitted to free space (DESIGN §12.4). A small fixed cap made a
/// writer of more than the cap run at the daemon's speed of taking random write-backs
/// (sysbench random 8 KiB writes: 208 MiB/s with 128 MiB, 767 MiB/s with 768 MiB). The cap is
/// half the free space above the headroom, at least the base and at most an eighth of the
/// machine's memory: what the kernel holds dirty then fits in free space with the headroom to
/// spare, and as free space falls the cap falls with it (the kernel throttles writers above a
/// lowered cap at once), down to the base when free space nears the headroom, where the
/// headroom rules of the fixed cap take over unchanged.
pub(crate) struct DirtyCap {
    /// `/sys/class/bdi/MAJ:MIN/max_bytes` of the mount.
    path: String,
    /// The smallest cap.
    base: u64,
    /// Free space below which opens are written through.
    headroom: u64,
    /// An eighth of the machine's memory.
    memory: u64,
    /// The cap last set, as the kernel reported it back.
    current: u64,
}

impl DirtyCap {
    fn new(path: String, base: u64, headroom: u64) -> DirtyCap {
        // SAFETY: sysconf has no preconditions.
        let (pages, page) = unsafe {
            (
                libc::sysconf(libc::_SC_PHYS_PAGES),
                libc::sysconf(libc::_SC_PAGESIZE),
            )
        };
        let memory = (pages.max(0) as u64).saturating_mul(page.max(0) as u64) / 8;
        DirtyCap {
            path,
            base,
            headroom,
            memory: memory.max(base),
            current: 0,
        }
    }

    /// The cap for `free` bytes of free space.
    fn target(&self, free: u64) -> u64 {
        (free.saturating_sub(self.headroom) / 2)
            .min(self.memory)
            .max(self.base)
    }

    /// Sets the cap for `free` bytes of free space if it moved by more than an eighth of the
    /// current cap (smaller moves are not worth a write; the headroom covers them).
    fn update(&mut self, free: u64) -> Result<(), String> {
        let want = self.target(free);
        if self.current != 0 && want.abs_diff(self.current) <= self.current / 8 {
            return Ok(());
        }
        std::fs::write(&self.path, want.to_string()).map_err(|e| format!("{}: {e}", self.path))?;
        let back = std::fs::read_to_string(&self.path)
            .map_err(|e| format!("{}: {e}", self.path))?
            .trim()
            .parse::<u64>()
            .map_err(|e| format!("{}: {e}", self.path))?;
        self.current = back;
        Ok(())
    }

    /// Fits the cap to free space every [`DIRTY_CAP_EVERY`] until the filesystem is gone.
    pub(crate) fn follow(mut self, fs: std::sync::Weak<Filesystem>, stop: Arc<AtomicBool>) {
        while !stop.load(Ordering::Relaxed) {
            let Some(fs) = fs.upgrade() else { return };
            let free = free_bytes(&fs);
            drop(fs);
            if let Err(e) = self.update(free) {
                log::warn!("dirty limit: {e}; keeping {} bytes", self.current);
                return;
            }
            std::thread::sleep(DIRTY_CAP_EVERY);
        }
    }
}

/// The `max_bytes` file of the writeback device of the mount at `mountpoint`. Reads
/// /proc/self/mountinfo (never the mount itself, which nobody serves yet).
fn bdi_max_bytes(mountpoint: &Path) -> Result<String, String> {
    let target = canonical(mountpoint).to_string_lossy().into_owned();
    let info = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| e.to_string())?;
    let dev = info
        .lines()
        .rev()
        .map(|l| l.split(' ').collect::<Vec<_>>())
        .find(|f| f.get(4).map(|m| unescape(m)) == Some(target.clone()))
        .and_then(|f| f.get(2).map(|d| d.to_string()))
        .ok_or_else(|| format!("{target} not in /proc/self/mountinfo"))?;
    Ok(format!("/sys/class/bdi/{dev}/max_bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_write_back_is_reported_once_and_only_for_its_inode() {
        let lost = LostWrites::new();
        assert!(!lost.take(7), "nothing marked yet");
        lost.mark(7);
        lost.mark(9);
        assert!(!lost.take(8), "another inode");
        assert!(lost.take(7));
        assert!(!lost.take(7), "reported once per mark");
        lost.mark(7);
        assert!(lost.take(7), "a new refusal is reported again");
        assert!(lost.take(9));
        assert!(
            !lost.any.load(std::sync::atomic::Ordering::Acquire),
            "empty again"
        );
    }

    /// The dirty cap is half the free space above the headroom, never below the base nor above
    /// an eighth of memory, and falls as free space falls.
    #[test]
    fn dirty_cap_follows_free_space() {
        const MIB: u64 = 1 << 20;
        let mut cap = DirtyCap::new(
            "/nonexistent-birch-dir/max_bytes".into(),
            128 * MIB,
            256 * MIB,
        );
        cap.memory = 1024 * MIB;
        assert_eq!(cap.target(922 * MIB), 333 * MIB);
        assert_eq!(
            cap.target(300 * MIB),
            128 * MIB,
            "near the headroom: the base"
        );
        assert_eq!(cap.target(0), 128 * MIB);
        assert_eq!(
            cap.target(100 << 30),
            1024 * MIB,
            "an eighth of memory at most"
        );
        let mut last = u64::MAX;
        for free in (0..4096).rev().map(|m| m * MIB) {
            let t = cap.target(free);
            assert!(t <= last && t >= cap.base);
            // What the kernel may hold dirty fits in free space with the headroom left.
            if t > cap.base {
                assert!(free >= cap.headroom + 2 * t);
            }
            last = t;
        }
        // A cap that cannot be written is an error, never a panic.
        assert!(cap.update(922 * MIB).is_err());
    }
}
