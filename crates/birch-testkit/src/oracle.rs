//! The crash oracle: what a workload did, the crash states of its recording, and the verdict
//! on each.
//!
//! Owns: [`History`] (every version each path held, its fsyncs, directory fsyncs, links,
//! renames and removals), the construction of crash states from a recording (the image at
//! every flush, plus seeded subsets of the writes since the last flush, some torn at 512 B,
//! each a copy-on-write [`OverlayDevice`] over one base image), and the judgement of each
//! state. Must not touch: production paths; it drives only the public API of `birch-core`
//! (open, read, mkdir, close, `check`), so the library matrix, the FUSE-level runs of
//! `birch crashtest` and the core's tests share it.
//!
//! The oracle judges each object on its own: a file fsync'd before the cut (and not renamed or
//! removed after) holds its fsync'd content or a later one; every file reads back content that
//! was written at some point (or a prefix of it); fsck is clean; new creates work.

use std::collections::HashMap;
use std::sync::Arc;

use birch_core::check::{check, CheckOptions};
use birch_core::device::{BlockDevice, MemDevice, OverlayDevice, Recorded};
use birch_core::vfs::{Caller, OpenOptions};
use birch_core::Filesystem;
use birch_format::ROOT_INO;

use crate::rng::Rng;

/// What a workload did, for the oracle. The library workloads (`matrix`) and the FUSE-level
/// matrix of `birch crashtest --fuse-runs`, in `birch-tools`, fill it through the methods.
#[derive(Default, Clone)]
pub struct History {
    pub(crate) versions: HashMap<String, Vec<Vec<u8>>>,
    /// Pairs of names of one file (hard links): a version written through one name is a
    /// version of every name of the file.
    links: Vec<(String, String)>,
    /// (events when the fsync returned, path, index of the fsync'd version, step number).
    pub(crate) synced: Vec<(usize, String, usize, usize)>,
    /// (events when the directory fsync returned, path, step): the name must exist after a
    /// crash past that point, with any content once written under it.
    named: Vec<(usize, String, usize)>,
    /// (step number, path) of paths renamed away or removed: an earlier fsync of that path
    /// is not judged by path any more.
    moved: Vec<(usize, String)>,
    /// Steps so far, to order fsyncs and moves that no device event separates.
    steps: usize,
    /// Snapshots made, in order: each is atomic with one commit, so after a crash it either
    /// does not exist or holds exactly `files`.
    snapshots: Vec<SnapshotMade>,
    /// Snapshot deletions: (name, events when it was asked for, events when it returned).
    deletions: Vec<(String, usize, usize)>,
    /// Rollbacks, in order: each is atomic with one commit, so a crash state shows the whole
    /// state before it or the whole rolled-back one, never a mix.
    rollbacks: Vec<RolledBack>,
    /// The device failed a request during the workload ([`History::faulted`]).
    faulted: bool,
}

/// A rollback a workload made (`Engine::rollback` on the closed image, as `birch rollback`
/// makes it), with the device events that bound it and both whole states it may leave.
#[derive(Clone, Debug)]
pub struct RolledBack {
    /// The snapshot rolled back to.
    pub name: String,
    /// Events once the state before the rollback was durable whole (the filesystem closed,
    /// or every change it held fsync'd): from here on it is exactly `before`.
    pub settled: usize,
    /// Events when the rollback was asked for.
    pub asked: usize,
    /// Events when it returned (its commit durable).
    pub returned: usize,
    /// Events when the workload went on after it (the filesystem reopened): up to here the
    /// state is exactly `after`.
    pub resumed: usize,
    /// The newer snapshots it deleted (`-r`), in the same commit.
    pub deleted: Vec<String>,
    /// Every regular file of the live filesystem before the rollback (path to content).
    pub before: std::collections::BTreeMap<String, Vec<u8>>,
    /// Every regular file of the snapshot rolled back to: the live files after it.
    pub after: std::collections::BTreeMap<String, Vec<u8>>,
}

/// A snapshot a workload made: its name (never reused in one run), the device events when it
/// was asked for and when it returned (its commit durable), and every file of the filesystem
/// at that moment (path to content).
#[derive(Clone)]
struct SnapshotMade {
    name: String,
    asked: usize,
    returned: usize,
    files: std::collections::BTreeMap<String, Vec<u8>>,
}

impl History {
    /// `path` now holds `content` (a write, truncate or hole punch through any name); so does
    /// every other name of the same file.
    pub fn version(&mut self, path: &str, content: Vec<u8>) {
        for name in self.names_of(path) {
            self.versions.entry(name).or_default().push(content.clone());
        }
    }

    /// Every name of the file `path` names, `path` first (the closure of `links`).
    fn names_of(&self, path: &str) -> Vec<String> {
        let mut names = vec![path.to_string()];
        let mut i = 0;
        while i < names.len() {
            for (a, b) in &self.links {
                for (x, y) in [(a, b), (b, a)] {
                    if *x == names[i] && !names.contains(y) {
                        names.push(y.clone());
                    }
                }
            }
            i += 1;
        }
        names
    }

    /// `path` was made a name of the file `from` names (a link): it shares the history, and
    /// later versions through either name are versions of both.
    pub fn linked(&mut self, from: &str, path: &str) {
        if let Some(v) = self.versions.get(from).cloned() {
            self.versions.insert(path.to_string(), v);
        }
        self.links.push((from.to_string(), path.to_string()));
    }

    /// The device failed a request (a fault-injecting device's EIO or ENOSPC): written data a
    /// failed write carried may be gone from any file without its fsync ever succeeding, so
    /// from here on file contents are judged block by block, not whole. Each byte must be
    /// that byte of an allowed version (for a file fsync'd before the crash, the fsync'd
    /// version or a later one), or zero, and the length one of theirs: acknowledged data is
    /// still owed, garbage and older data still fail.
    pub fn faulted(&mut self) {
        self.faulted = true;
    }

    /// An fsync of `path` returned once `mark` device events were recorded: its current
    /// version (or a later one) must survive any crash after `mark`.
    pub fn synced(&mut self, mark: usize, path: &str) {
        self.steps += 1;
        if let Some(v) = self.versions.get(path) {
            self.synced
                .push((mark, path.to_string(), v.len() - 1, self.steps));
        }
    }

    /// A directory fsync returned at `mark`: the name `path` in it must survive.
    pub fn named(&mut self, mark: usize, path: &str) {
        self.steps += 1;
        if self.versions.contains_key(path) {
            self.named.push((mark, path.to_string(), self.steps));
        }
    }

    /// `from` was renamed to `to` (replacing whatever `to` named).
    pub fn renamed(&mut self, from: &str, to: &str) {
        self.steps += 1;
        self.moved.push((self.steps, from.to_string()));
        self.moved.push((self.steps, to.to_string()));
        // `from` keeps its versions: a crash before the rename is durable shows them there,
        // also once a new file took the name (ACE seed 1795610327756327763).
        if let Some(v) = self.versions.get(from).cloned() {
            self.versions.entry(to.to_string()).or_default().extend(v);
        }
        // The file `to` named loses that name; `from`'s file is now called `to`.
        self.links.retain(|(a, b)| a != to && b != to);
        for (a, b) in &mut self.links {
            for name in [a, b] {
                if name == from {
                    *name = to.to_string();
                }
            }
        }
    }

    /// Snapshot `name` was asked for once `asked` device events were recorded and returned at
    /// `returned`, holding exactly `files` (every regular file of the filesystem by path).
    pub fn snapshot_made(
        &mut self,
        name: &str,
        asked: usize,
        returned: usize,
        files: std::collections::BTreeMap<String, Vec<u8>>,
    ) {
        self.snapshots.push(SnapshotMade {
            name: name.to_string(),
            asked,
            returned,
            files,
        });
    }

    /// The deletion of snapshot `name` was asked for at `asked` and returned at `returned`.
    pub fn snapshot_deleted(&mut self, name: &str, asked: usize, returned: usize) {
        self.deletions.push((name.to_string(), asked, returned));
    }

    /// A rollback was made (its newer snapshots deleted with it, if `-r`): a crash state
    /// before it is exactly `before` once `settled` is durable; one cut while its commit is
    /// under way shows the whole state before it (`before`, the deleted snapshots there) or the
    /// whole rolled-back one (`after`, the deleted snapshots gone); from its return until
    /// `resumed` exactly the rolled-back one; after it, the files fsync'd before it are no
    /// longer judged by path. The snapshots it deleted are recorded as deletions asked and
    /// returned with it.
    pub fn rolled_back(&mut self, rollback: RolledBack) {
        for name in &rollback.deleted {
            self.deletions
                .push((name.clone(), rollback.asked, rollback.returned));
        }
        self.rollbacks.push(rollback);
    }

    /// `path` was unlinked.
    pub fn removed(&mut self, path: &str) {
        self.steps += 1;
        self.moved.push((self.steps, path.to_string()));
        self.links.retain(|(a, b)| a != path && b != path);
    }
}

/// Result of a matrix run.
#[derive(Debug, Default)]
pub struct CrashReport {
    /// Crash states checked (the initial image, every flush point, then seeded cuts).
    pub states: usize,
    /// One line per state the oracle rejected: workload, seed, state, cut and why.
    pub failures: Vec<String>,
}

/// Checks `states` crash states of a recorded run (`base` is the image when recording
/// started): the image at every flush first, then seeded cuts with subsets of the unflushed
/// writes, some torn at 512 B. Each state is opened (replay), judged by the oracle against
/// `history`, and checked by fsck.
pub fn check_recording(
    name: &str,
    seed: u64,
    base: &[u8],
    events: &[Recorded],
    history: &History,
    states: usize,
    progress: &mut dyn FnMut(),
) -> CrashReport {
    let flushes: Vec<usize> = events
        .iter()
        .enumerate()
        .filter(|(_, e)| matches!(e, Recorded::Flush))
        .map(|(i, _)| i + 1)
        .collect();
    let mut rng = Rng::new(seed);
    let mut cuts: Vec<(usize, u64)> = vec![(0, 0)];
    cuts.extend(flushes.iter().map(|f| (*f, 0)));
    while cuts.len() < states {
        cuts.push((
            rng.below(events.len() as u64 + 1) as usize,
            rng.next_u64() | 1,
        ));
    }
    let mut report = CrashReport::default();
    // One copy of the base image per run; each state is an overlay of its writes.
    let base: Arc<dyn BlockDevice> = Arc::new(MemDevice::from_bytes(base.to_vec()));
    for (n, (cut, subset)) in cuts.iter().enumerate() {
        if let Err(failure) = check_state(&base, events, *cut, *subset, history) {
            report.failures.push(format!(
                "{name} seed {seed} state {n} (cut {cut}, subset {subset}): {failure}"
            ));
        }
        report.states += 1;
        progress();
    }
    report
}

fn check_state(
    base: &Arc<dyn BlockDevice>,
    events: &[Recorded],
    cut: usize,
    subset: u64,
    history: &History,
) -> std::result::Result<(), String> {
    let durable_upto = events[..cut]
        .iter()
        .rposition(|e| matches!(e, Recorded::Flush))
        .map_or(0, |i| i + 1);
    let crashed = Arc::new(OverlayDevice::new(base.clone()));
    let mut rng = Rng::new(subset);
    for (i, e) in events[..cut].iter().enumerate() {
        let Recorded::Write { offset, bytes } = e else {
            continue;
        };
        let landed = if i < durable_upto {
            Some(bytes.len())
        } else if subset != 0 && rng.chance(50) {
            // An unflushed write lands whole, not at all, or torn at 512 B.
            Some(if rng.chance(30) {
                (rng.below(bytes.len() as u64 / 512) as usize + 1) * 512
            } else {
                bytes.len()
            })
        } else {
            None
        };
        if let Some(len) = landed {
            crashed
                .patch(*offset, &bytes[..len])
                .map_err(|e| format!("building the crash state: {e}"))?;
        }
    }
    let fs = Filesystem::open_device(
        crashed.clone(),
        OpenOptions {
            commit_interval: None,
            ..Default::default()
        },
    )
    .map_err(|e| format!("open failed: {e}"))?;
    // Fsyncs before a rollback this state shows are replaced by it: not judged by path.
    let rolled = check_rollbacks(&fs, history, cut, durable_upto)?;
    for (mark, path, version, step) in &history.synced {
        if *mark > durable_upto
            || *mark <= rolled
            || history.moved.iter().any(|(s, p)| p == path && s > step)
        {
            continue;
        }
        let got = fs
            .read_file(path)
            .map_err(|e| format!("fsync'd {path} missing: {e}"))?;
        let allowed = &history.versions[path][*version..];
        if !(allowed.contains(&got) || history.faulted && made_of(&got, allowed, true)) {
            return Err(format!(
                "{path} is not a version at or after the fsync'd one: {}",
                departure(&got, allowed)
            ));
        }
    }
    for (mark, path, step) in &history.named {
        if *mark > durable_upto
            || *mark <= rolled
            || history.moved.iter().any(|(s, p)| p == path && s > step)
        {
            continue;
        }
        fs.resolve(path)
            .map_err(|e| format!("{path}, made durable by a directory fsync, missing: {e}"))?;
    }
    for (path, versions) in &history.versions {
        if let Ok(got) = fs.read_file(path) {
            if !once_written(&got, versions, history.faulted) {
                return Err(format!(
                    "{path} holds content never written: {}",
                    departure(&got, versions)
                ));
            }
        }
    }
    check_snapshots(&fs, history, cut, durable_upto)?;
    fs.mkdir(Caller::default(), ROOT_INO, b"new-after-crash", 0o755)
        .map_err(|e| format!("create after recovery: {e}"))?;
    fs.close().map_err(|e| format!("close: {e}"))?;
    drop(fs);
    let report = check(&*crashed, CheckOptions { data: true }).map_err(|e| format!("fsck: {e}"))?;
    if !report.is_clean() {
        return Err(format!(
            "fsck: {}",
            report
                .findings
                .iter()
                .map(|f| f.to_string())
                .collect::<Vec<_>>()
                .join("; ")
        ));
    }
    Ok(())
}

/// Whether `got` is content a file with these `versions` may read back after a crash: nothing,
/// a prefix of a version, or a version followed by bytes each that byte of some version or
/// zero (a later version's data past an earlier size, or a size ahead of its data); after a
/// device fault, made of them byte by byte ([`made_of`]). Every byte is compared with the
/// versions' bytes at its own offset, so with content that differs from offset to offset
/// ([`crate::stamp::fill`]) a block of the right file and version in the wrong place fails.
fn once_written(got: &[u8], versions: &[Vec<u8>], faulted: bool) -> bool {
    let at_its_offset =
        |at: usize, b: &u8| *b == 0 || versions.iter().any(|w| w.get(at) == Some(b));
    got.is_empty()
        || versions.iter().any(|v| {
            v.starts_with(got)
                || got.starts_with(v)
                    && got[v.len()..]
                        .iter()
                        .enumerate()
                        .all(|(i, b)| at_its_offset(v.len() + i, b))
        })
        || faulted && made_of(got, versions, false)
}

/// For a failure message: how long `got` is, which of `versions` it follows longest and up to
/// which offset, and what the 4 KiB block there holds (zeros, or the [`crate::stamp::fill`]
/// piece its header names: file, offset, version).
fn departure(got: &[u8], versions: &[Vec<u8>]) -> String {
    let (index, common) = versions
        .iter()
        .enumerate()
        .map(|(i, v)| (i, v.iter().zip(got).take_while(|(a, b)| a == b).count()))
        .max_by_key(|(_, common)| *common)
        .unwrap_or((0, 0));
    let block = common / 4096 * 4096;
    let bytes = &got[block.min(got.len())..(block + 4096).min(got.len())];
    let holds = if bytes.is_empty() {
        "nothing (past the end)".to_string()
    } else if bytes.iter().all(|b| *b == 0) {
        "zeros".to_string()
    } else if let Some((file, offset, version)) = crate::stamp::fill_header(bytes) {
        format!("the piece of file {file} at offset {offset}, version {version}")
    } else {
        "no piece header at its start".to_string()
    };
    format!(
        "{} bytes; it follows version {index} of {} ({} bytes) up to offset {common}; the block \
         at {block} holds {holds}",
        got.len(),
        versions.len(),
        versions.get(index).map_or(0, Vec::len)
    )
}

/// Whether `got` is made of the `allowed` versions byte by byte (each byte that byte of one
/// of them, or zero), as a file whose failed writes lost some blocks reads: with `whole_length`
/// its length must also be one of theirs, else at most the longest.
fn made_of(got: &[u8], allowed: &[Vec<u8>], whole_length: bool) -> bool {
    let longest = allowed.iter().map(Vec::len).max().unwrap_or(0);
    let length_fits = if whole_length {
        allowed.iter().any(|v| v.len() == got.len())
    } else {
        got.len() <= longest
    };
    length_fits
        && got
            .iter()
            .enumerate()
            .all(|(i, b)| *b == 0 || allowed.iter().any(|v| v.get(i) == Some(b)))
}

/// Judges the rollbacks of a crash state cut at event `cut`, durable up to `durable_upto`, as
/// [`History::rolled_back`] says: the live files (read through the filesystem, every
/// directory walked) and the snapshots a rollback deleted must make one whole state, the one
/// before it or the rolled-back one. Returns the events when the latest rollback this state
/// shows was asked for (0: none), before which fsyncs are not judged by path.
fn check_rollbacks(
    fs: &Filesystem,
    history: &History,
    cut: usize,
    durable_upto: usize,
) -> std::result::Result<usize, String> {
    let mut rolled = 0;
    if history.rollbacks.is_empty() {
        return Ok(rolled);
    }
    let live = live_files(fs)?;
    let standing: Vec<String> = fs
        .engine()
        .snapshots()
        .into_iter()
        .map(|s| s.name)
        .collect();
    for r in &history.rollbacks {
        if cut <= r.asked && durable_upto < r.settled {
            continue;
        }
        let before = live == r.before && r.deleted.iter().all(|n| standing.contains(n));
        let after = live == r.after && !r.deleted.iter().any(|n| standing.contains(n));
        let mix = || {
            let differ = |model: &std::collections::BTreeMap<String, Vec<u8>>| {
                model
                    .keys()
                    .chain(live.keys())
                    .filter(|p| model.get(*p) != live.get(*p))
                    .cloned()
                    .collect::<std::collections::BTreeSet<String>>()
            };
            let gone: Vec<&String> = r.deleted.iter().filter(|n| !standing.contains(n)).collect();
            format!(
                "files differing from the state before it at {:?}, from the rolled-back one at \
                 {:?}; of the newer snapshots it deletes ({:?}) gone: {gone:?}",
                differ(&r.before),
                differ(&r.after),
                r.deleted
            )
        };
        if cut <= r.asked {
            if !before {
                return Err(format!(
                    "before the rollback to {:?} was asked for, the state is not the one before \
                     it: {}",
                    r.name,
                    mix()
                ));
            }
        } else if cut < r.returned {
            if !before && !after {
                return Err(format!(
                    "during the rollback to {:?}, neither the state before it nor the \
                     rolled-back one: {}",
                    r.name,
                    mix()
                ));
            }
            if after {
                rolled = r.asked;
            }
        } else {
            // Returned: durable.
            if cut <= r.resumed && !after {
                return Err(format!(
                    "after the rollback to {:?} returned, the state is not the rolled-back \
                     one: {}",
                    r.name,
                    mix()
                ));
            }
            rolled = r.asked;
        }
    }
    Ok(rolled)
}

/// Every regular file of the live filesystem by path (`/A/foo`), through `readdir` and
/// `read_file` from the root down.
fn live_files(
    fs: &Filesystem,
) -> std::result::Result<std::collections::BTreeMap<String, Vec<u8>>, String> {
    use birch_core::vfs::FileKind;
    let mut files = std::collections::BTreeMap::new();
    let mut dirs = vec![(String::new(), ROOT_INO)];
    while let Some((path, dir)) = dirs.pop() {
        let entries = fs
            .readdir(dir, 0, usize::MAX)
            .map_err(|e| format!("readdir {path}/: {e}"))?;
        for entry in entries {
            if entry.name == b"." || entry.name == b".." {
                continue;
            }
            let child = format!("{path}/{}", String::from_utf8_lossy(&entry.name));
            match entry.kind {
                FileKind::Dir => dirs.push((child, entry.ino)),
                FileKind::File => {
                    let bytes = fs
                        .read_file(&child)
                        .map_err(|e| format!("{child} does not read: {e}"))?;
                    files.insert(child, bytes);
                }
                other => return Err(format!("{child}: a {other:?}, not a file or directory")),
            }
        }
    }
    Ok(files)
}

/// Judges the snapshots of a crash state cut at event `cut`, durable up to `durable_upto`: a
/// snapshot whose creation returned before the last flush exists unless its deletion was asked
/// for before the cut; one asked for after the cut does not exist, nor one whose deletion
/// returned before the last flush; and any snapshot that exists holds exactly the files it was
/// made with (its creation is atomic with one commit, and nothing changes it afterwards).
fn check_snapshots(
    fs: &Filesystem,
    history: &History,
    cut: usize,
    durable_upto: usize,
) -> std::result::Result<(), String> {
    if history.snapshots.is_empty() {
        return Ok(());
    }
    let standing = fs.engine().snapshots();
    for made in &history.snapshots {
        let deletion = history.deletions.iter().find(|(n, _, _)| *n == made.name);
        let found = standing.iter().find(|s| s.name == made.name);
        let must_exist =
            made.returned <= durable_upto && deletion.is_none_or(|(_, asked, _)| cut <= *asked);
        let must_not =
            cut <= made.asked || deletion.is_some_and(|(_, _, returned)| *returned <= durable_upto);
        match found {
            None if must_exist => {
                return Err(format!(
                    "snapshot {:?}, made durable before the cut, is missing",
                    made.name
                ))
            }
            None => {}
            Some(_) if must_not => {
                return Err(format!(
                    "snapshot {:?} exists, though {}",
                    made.name,
                    if cut <= made.asked {
                        "it was asked for after the cut"
                    } else {
                        "its deletion was durable"
                    }
                ))
            }
            Some(s) => {
                let got = snapshot_files(fs, s.id)
                    .map_err(|e| format!("snapshot {:?} does not read: {e}", made.name))?;
                if got != made.files {
                    let differ: Vec<&String> = made
                        .files
                        .keys()
                        .chain(got.keys())
                        .filter(|p| made.files.get(*p) != got.get(*p))
                        .collect();
                    return Err(format!(
                        "snapshot {:?} differs from the files it was made with at {differ:?}",
                        made.name
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Every regular file of snapshot `id` by path (`/A/foo`), read from the snapshot's tree
/// through a committed view: names from the directory index, sizes from the inode items,
/// bytes from the extents, each data block checked against its recorded crc32c.
fn snapshot_files(
    fs: &Filesystem,
    id: u64,
) -> std::result::Result<std::collections::BTreeMap<String, Vec<u8>>, String> {
    use birch_format::items::{decode_dir_entries, ExtentKind, FileExtent, InodeItem};
    use birch_format::{ItemType, Key, BLOCK_SIZE};

    let view = fs
        .engine()
        .snapshot_view(id)
        .map_err(|e| format!("view: {e}"))?;
    let device = fs.engine().device();
    let mut files = std::collections::BTreeMap::new();
    let mut dirs = vec![(String::new(), 1u64)];
    while let Some((path, dir)) = dirs.pop() {
        let lo = Key::new(dir, ItemType::DirIndex, 0);
        let hi = Key::new(dir, ItemType::DirIndex, u64::MAX);
        let items = view
            .range(&lo, &hi, usize::MAX)
            .map_err(|e| format!("dir {path}/: {e}"))?;
        for (_, value) in items {
            for entry in decode_dir_entries(&value).map_err(|e| format!("dir {path}/: {e}"))? {
                let child = format!("{path}/{}", String::from_utf8_lossy(&entry.name));
                let inode = view
                    .get(&Key::new(entry.child, ItemType::InodeItem, 0))
                    .map_err(|e| format!("{child}: {e}"))?
                    .ok_or_else(|| format!("{child}: no inode item"))?;
                let inode = InodeItem::decode(&inode).map_err(|e| format!("{child}: {e}"))?;
                match inode.mode & libc::S_IFMT {
                    libc::S_IFDIR => dirs.push((child, entry.child)),
                    libc::S_IFREG => {
                        let mut data = vec![0u8; inode.size as usize];
                        let lo = Key::new(entry.child, ItemType::ExtentData, 0);
                        let hi = Key::new(entry.child, ItemType::ExtentData, u64::MAX);
                        let extents = view
                            .range(&lo, &hi, usize::MAX)
                            .map_err(|e| format!("{child}: {e}"))?;
                        for (key, value) in extents {
                            let extent =
                                FileExtent::decode(&value).map_err(|e| format!("{child}: {e}"))?;
                            let bytes = match extent.kind {
                                ExtentKind::Inline(bytes) => bytes,
                                ExtentKind::Regular { disk_addr, csums } => {
                                    let mut buf = vec![0u8; csums.len() * BLOCK_SIZE as usize];
                                    device
                                        .read_at(&mut buf, disk_addr)
                                        .map_err(|e| format!("{child}: {e}"))?;
                                    for (n, (block, crc)) in
                                        buf.chunks(BLOCK_SIZE as usize).zip(&csums).enumerate()
                                    {
                                        if birch_format::checksum(block) != *crc {
                                            return Err(format!(
                                                "{child}: block {n} of the extent at {} fails its checksum",
                                                key.offset
                                            ));
                                        }
                                    }
                                    buf
                                }
                                ExtentKind::Prealloc { .. } => continue,
                                ExtentKind::Blob(blob) => read_blob_window(device.as_ref(), &blob)
                                    .map_err(|e| {
                                        format!("{child}: the blob extent at {}: {e}", key.offset)
                                    })?,
                            };
                            let at = key.offset as usize;
                            let end = (at + bytes.len()).min(data.len());
                            if at < end {
                                data[at..end].copy_from_slice(&bytes[..end - at]);
                            }
                        }
                        files.insert(child, data);
                    }
                    _ => {}
                }
            }
        }
    }
    Ok(files)
}

/// The bytes of a blob extent's window, read on the oracle's own: every stored block checked
/// against its crc32c, the blob decoded to exactly its logical length, the window copied.
fn read_blob_window(
    device: &dyn BlockDevice,
    blob: &birch_format::items::Blob,
) -> Result<Vec<u8>, String> {
    use birch_format::BLOCK_SIZE;
    let mut stored = vec![0u8; blob.csums.len() * BLOCK_SIZE as usize];
    device
        .read_at(&mut stored, blob.disk_addr)
        .map_err(|e| e.to_string())?;
    for (n, (block, crc)) in stored
        .chunks(BLOCK_SIZE as usize)
        .zip(&blob.csums)
        .enumerate()
    {
        if birch_format::checksum(block) != *crc {
            return Err(format!("stored block {n} fails its checksum"));
        }
    }
    let mut logical = vec![0u8; blob.logical as usize];
    birch_format::codec::decode(
        blob.codec,
        &stored[..blob.encoded_len as usize],
        &mut logical,
    )
    .map_err(|e| e.to_string())?;
    let from = blob.window_offset as usize;
    Ok(logical[from..from + blob.window_len as usize].to_vec())
}

#[cfg(test)]
mod blob_tests {
    use birch_core::device::{BlockDevice, MemDevice};
    use birch_format::codec::{encode, Codec};
    use birch_format::items::Blob;
    use birch_format::BLOCK_SIZE;

    use super::read_blob_window;

    /// The oracle decodes a blob on its own: the window's bytes come back for each codec, and a
    /// damaged stored block is an error, not wrong bytes.
    #[test]
    fn the_oracle_reads_blob_windows_and_refuses_damage() {
        let bs = BLOCK_SIZE as usize;
        let logical: Vec<u8> = (0..8 * bs)
            .map(|i| {
                if i % 3 == 0 {
                    (i / bs) as u8
                } else {
                    b"oracle"[i % 6]
                }
            })
            .collect();
        for codec in [Codec::Zstd(1), Codec::Lz4] {
            let mut stored = Vec::new();
            let n = encode(codec, &logical, &mut stored).expect("compressible");
            stored.resize(n.div_ceil(bs) * bs, 0);
            let device = MemDevice::new(64 * BLOCK_SIZE);
            device.write_at(&stored, 16 * BLOCK_SIZE).expect("write");
            let blob = Blob {
                disk_addr: 16 * BLOCK_SIZE,
                codec: Codec::from_byte(codec.byte()).expect("byte"),
                encoded_len: n as u32,
                logical: logical.len() as u32,
                window_offset: 2 * BLOCK_SIZE as u32,
                window_len: 3 * BLOCK_SIZE as u32,
                nonce: 0,
                csums: stored.chunks(bs).map(birch_format::checksum).collect(),
            };
            let window = read_blob_window(&device, &blob).expect("read");
            assert_eq!(window, logical[2 * bs..5 * bs], "{codec:?}");
            let mut damaged = stored[..bs].to_vec();
            damaged[40] ^= 0xee;
            device.write_at(&damaged, 16 * BLOCK_SIZE).expect("damage");
            assert!(read_blob_window(&device, &blob).is_err(), "{codec:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_through_one_link_is_a_version_of_every_name() {
        let mut h = History::default();
        h.version("/B/bar", vec![7; 3]);
        h.linked("/B/bar", "/B/foo");
        h.version("/B/foo", vec![9; 5]);
        assert_eq!(h.versions["/B/bar"], vec![vec![7; 3], vec![9; 5]]);
        assert_eq!(h.versions["/B/foo"], vec![vec![7; 3], vec![9; 5]]);
        // After the name goes, its file's later versions are not its own.
        h.removed("/B/bar");
        h.version("/B/foo", vec![1; 2]);
        assert_eq!(h.versions["/B/bar"].len(), 2);
        assert_eq!(h.versions["/B/foo"].len(), 3);
    }

    /// After a device fault, content is judged block by block: bytes of allowed versions or
    /// zeros pass, a byte of an older (un-allowed) version or one never written fails, and a
    /// fsync'd file's length must be one of its allowed versions'.
    #[test]
    fn a_faulted_file_is_judged_byte_by_byte() {
        let (v3, v4) = (vec![3u8; 8], vec![4u8; 12]);
        let allowed = [v3.clone(), v4.clone()];
        let mixed: Vec<u8> = [vec![3u8; 4], vec![4u8; 4], vec![0u8; 4]].concat();
        assert!(
            made_of(&mixed, &allowed, true),
            "mixed allowed bytes and zeros"
        );
        assert!(
            !made_of(&mixed[..10], &allowed, true),
            "a length no version had"
        );
        assert!(
            made_of(&mixed[..10], &allowed, false),
            "shorter, not fsync'd"
        );
        let older = [vec![2u8; 4], vec![4u8; 8]].concat();
        assert!(!made_of(&older, &allowed, true), "an older version's bytes");
        assert!(!made_of(&[9u8; 12], &allowed, false), "never written");
    }

    /// With content stamped by offset, a block of the right file and version in the wrong place
    /// fails every judgement: whole versions, once written (also past a version's end) and
    /// byte by byte after a fault.
    #[test]
    fn a_block_from_another_offset_is_never_written_content() {
        use crate::stamp::fill;
        let v1 = fill(1, 0, 1, 3 * 4096);
        let v2 = [v1.clone(), fill(1, 3 * 4096, 2, 2 * 4096)].concat();
        let versions = [v1.clone(), v2.clone()];
        for good in [&v1[..], &v2[..], &v2[..20_000], &v1[..100]] {
            assert!(once_written(good, &versions, false));
        }
        // Past v1's end: zeros (a size ahead of its data) pass.
        let grown = [v1.clone(), vec![0; 4096]].concat();
        assert!(once_written(&grown, &versions, false));
        // Block 1 swapped with block 2, in v2 and in the tail past v1.
        let mut swapped = v2.clone();
        swapped[4096..8192].copy_from_slice(&v2[8192..12288]);
        assert!(!once_written(&swapped, &versions, false));
        assert!(!once_written(&swapped, &versions, true));
        assert!(!made_of(&swapped, &versions, true));
        let mut tail = v2.clone();
        tail[4 * 4096..].copy_from_slice(&v2[3 * 4096..4 * 4096]);
        assert!(
            !once_written(&tail, &versions, false),
            "a wrong block past v1"
        );
        assert!(departure(&tail, &versions).contains("offset 12288, version 2"));
        // Another version's block at the right offset, where no version had it.
        let v3 = [v1.clone(), fill(1, 3 * 4096, 3, 2 * 4096)].concat();
        assert!(!once_written(&v3, &versions, false));
    }

    /// A rename leaves the old name's versions valid for it: a crash before the rename is
    /// durable shows the old content there, also once a new file took the name.
    #[test]
    fn a_renamed_name_keeps_its_versions() {
        let mut h = History::default();
        h.version("/B/bar", vec![7; 3]);
        h.renamed("/B/bar", "/A/C/foo");
        h.version("/B/bar", vec![9; 5]);
        assert_eq!(h.versions["/B/bar"], vec![vec![7; 3], vec![9; 5]]);
        assert_eq!(h.versions["/A/C/foo"], vec![vec![7; 3]]);
    }
}
