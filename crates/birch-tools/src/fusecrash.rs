//! The crash matrix through a real FUSE mount (`birch crashtest --fuse-runs N`).
//!
//! Owns: the FUSE-level workloads and their model. A birchfs over a recording in-memory device
//! is mounted in this process; the workload makes real system calls on the mount (buffered
//! writes, O_APPEND, O_DIRECT|O_SYNC writes whose WRITE must be durable when it returns,
//! truncate, hole punching, links, renames, unlinks, xattrs; then fsync, fdatasync, a
//! directory fsync or a commit; in one run of three, `FS_IOC_SHUTDOWN` on the mount mid-way,
//! after which every request must fail and nothing reach the device; in one run of four, the
//! test kit's fault device fails a write or a flush with EIO or ENOSPC, the workload ends at the
//! first call that fails, and the oracle then judges contents block by block
//! ([`History::faulted`]): acknowledged data is still owed, garbage still fails), so the
//! kernel's side (its page cache with `writeback=on`,
//! the FSYNC after writeback, FSYNCDIR, direct-I/O handles) is in the recording too. The
//! crash states, the oracle and the generator are the library matrix's, from `birch-testkit`
//! ([`check_recording`], [`History`], [`Rng`]).
//!
//! Must not touch: the filesystem's internals; it goes through the kernel only (plus the
//! in-process commit that stands in for `birch sync`). It lives here and not in the testkit
//! because its mount ([`InProcessMount`]) is the FUSE adapter's, set up as `birch mount` sets
//! it up; the testkit knows no FUSE (DESIGN §2).

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use birch_core::device::BlockDevice;
use birch_core::device::{MemDevice, Recorded};
use birch_core::vfs::{Caller, OpenOptions};
use birch_core::{Filesystem, MkfsOptions};
use birch_format::ROOT_INO;
use birch_testkit::stamp::fill;
use birch_testkit::{check_recording, CrashReport, Effect, FaultDevice, History, Op, Rng, Rule};

use birch_fuse::daemon::InProcessMount;

const PATHS: [&str; 5] = ["/A/foo", "/A/bar", "/B/foo", "/B/bar", "/A/C/foo"];

/// Why the FUSE matrix cannot run here, if it cannot (not root, no /dev/fuse).
pub fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (mount(2))".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("/dev/fuse is absent".into());
    }
    None
}

/// The files the workload made, as the oracle needs them: which inode each path names and
/// what each inode holds.
#[derive(Default)]
struct Model {
    names: HashMap<&'static str, usize>,
    contents: Vec<Vec<u8>>,
}

impl Model {
    /// Records the new content of inode `ino` under every name it has.
    fn changed(&self, h: &mut History, ino: usize) {
        for (path, i) in &self.names {
            if *i == ino {
                h.version(path, self.contents[ino].clone());
            }
        }
    }

    /// `bytes` were written at `off` through `path` (creating it if new).
    fn wrote(&mut self, h: &mut History, path: &'static str, off: usize, bytes: &[u8]) {
        let ino = self.inode_of(path, h);
        let c = &mut self.contents[ino];
        let end = off + bytes.len();
        if c.len() < end {
            c.resize(end, 0);
        }
        c[off..end].copy_from_slice(bytes);
        self.changed(h, ino);
    }

    fn inode_of(&mut self, path: &'static str, h: &mut History) -> usize {
        if let Some(i) = self.names.get(path) {
            return *i;
        }
        self.contents.push(Vec::new());
        let i = self.contents.len() - 1;
        self.names.insert(path, i);
        h.version(path, Vec::new());
        i
    }
}

struct Run<'a> {
    mnt: PathBuf,
    dev: &'a MemDevice,
    fs: &'a Filesystem,
    events: Vec<Recorded>,
    history: History,
    model: Model,
}

fn io(what: &str, path: &str, e: std::io::Error) -> String {
    format!("{what} {path}: {e}")
}

impl Run<'_> {
    fn real(&self, path: &str) -> PathBuf {
        self.mnt.join(path.trim_start_matches('/'))
    }

    fn mark(&mut self) -> usize {
        self.events.extend(self.dev.take_recording());
        self.events.len()
    }

    fn open(&self, path: &str, flags: i32) -> Result<std::fs::File, String> {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .custom_flags(flags)
            .open(self.real(path))
            .map_err(|e| io("open", path, e))
    }

    /// One operation on `path`, chosen by the generator, recorded in the model and history.
    /// The bytes it writes are the test kit's [`fill`] of the path's index in `PATHS`, at their
    /// file offset, with `step` + 1 as the version.
    fn operation(&mut self, rng: &mut Rng, step: u8, path: &'static str) -> Result<(), String> {
        let file = PATHS.iter().position(|p| *p == path).unwrap_or(PATHS.len()) as u64;
        let version = u64::from(step) + 1;
        let op = rng.below(9);
        if std::env::var_os("BIRCH_CRASH_TRACE").is_some() {
            eprintln!("  operation {op} (0-1 pwrite, 2 append, 3 O_DIRECT|O_SYNC, 4 truncate, 5 link, 6 rename, 7 unlink/punch, 8 xattr)");
        }
        match op {
            0 | 1 => {
                let off = rng.below(12_000) as usize;
                let len = 1 + rng.below(9_000) as usize;
                let bytes = fill(file, off as u64, version, len);
                let f = self.open(path, 0)?;
                let written = f.write_all_at(&bytes, off as u64);
                // Recorded before the result is looked at: a write a device fault failed may
                // still have reached the device, whole or in part. Not owed (nothing vouched
                // for it), but a crash state may hold it.
                self.model.wrote(&mut self.history, path, off, &bytes);
                written.map_err(|e| io("pwrite", path, e))?;
            }
            2 => {
                let len = 1 + rng.below(6_000) as usize;
                let mut f = self.open(path, libc::O_APPEND)?;
                let ino = self.model.inode_of(path, &mut self.history);
                // O_APPEND writes at the end: the model's size, which the file's is.
                let at = self.model.contents[ino].len();
                let bytes = fill(file, at as u64, version, len);
                let written = std::io::Write::write_all(&mut f, &bytes);
                // As for pwrite: recorded whether or not the fault failed it.
                self.model.wrote(&mut self.history, path, at, &bytes);
                written.map_err(|e| io("append", path, e))?;
            }
            3 => {
                // O_DIRECT|O_SYNC: the WRITE is durable before it is answered, with no fsync.
                let off = 4096 * rng.below(4) as usize;
                let len = 4096 * (1 + rng.below(2) as usize);
                // O_DIRECT wants a 4 KiB-aligned buffer: take an aligned window of a larger one.
                let bytes = fill(file, off as u64, version, len);
                let mut backing = vec![0u8; len + 4096];
                let at = backing.as_ptr().align_offset(4096).min(4096);
                backing[at..at + len].copy_from_slice(&bytes);
                let f = self.open(path, libc::O_DIRECT | libc::O_SYNC)?;
                let written = f.write_all_at(&backing[at..at + len], off as u64);
                drop(f);
                // A failed one may have reached the device too (its data written, the flush
                // or the commit after it failed): a possible version, owed only once answered.
                self.model.wrote(&mut self.history, path, off, &bytes);
                written.map_err(|e| io("O_DIRECT|O_SYNC pwrite", path, e))?;
                let mark = self.mark();
                self.history.synced(mark, path);
            }
            4 if self.model.names.contains_key(path) => {
                let size = rng.below(15_000) as usize;
                let f = self.open(path, 0)?;
                let cut = f.set_len(size as u64);
                // As for writes: a truncate the fault failed may have happened.
                let ino = self.model.names[path];
                self.model.contents[ino].resize(size, 0);
                self.model.changed(&mut self.history, ino);
                cut.map_err(|e| io("truncate", path, e))?;
            }
            5 if self.model.names.contains_key(path) => {
                let other = PATHS[rng.below(PATHS.len() as u64) as usize];
                if !self.model.names.contains_key(other) {
                    std::fs::hard_link(self.real(path), self.real(other))
                        .map_err(|e| io("link", path, e))?;
                    self.model.names.insert(other, self.model.names[path]);
                    self.history.linked(path, other);
                }
            }
            6 if self.model.names.contains_key(path) => {
                let other = PATHS[rng.below(PATHS.len() as u64) as usize];
                if other != path {
                    std::fs::rename(self.real(path), self.real(other))
                        .map_err(|e| io("rename", path, e))?;
                    // Two names of one inode: rename(2) does nothing.
                    if self.model.names.get(other) != self.model.names.get(path) {
                        let ino = self.model.names.remove(path).unwrap_or_default();
                        self.model.names.insert(other, ino);
                        self.history.renamed(path, other);
                    }
                }
            }
            7 if self.model.names.contains_key(path) => {
                if rng.chance(50) {
                    std::fs::remove_file(self.real(path)).map_err(|e| io("unlink", path, e))?;
                    self.model.names.remove(path);
                    self.history.removed(path);
                } else {
                    let off = 4096 * rng.below(3);
                    let f = self.open(path, 0)?;
                    // SAFETY: fallocate on an open descriptor with plain integer arguments.
                    let rc = unsafe {
                        libc::fallocate(
                            f.as_raw_fd(),
                            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                            off as i64,
                            4096,
                        )
                    };
                    if rc != 0 {
                        return Err(io("punch hole", path, std::io::Error::last_os_error()));
                    }
                    let ino = self.model.names[path];
                    let c = &mut self.model.contents[ino];
                    let end = (off as usize + 4096).min(c.len());
                    if (off as usize) < end {
                        c[off as usize..end].fill(0);
                    }
                    self.model.changed(&mut self.history, ino);
                }
            }
            _ if self.model.names.contains_key(path) => {
                let name = CString::new("user.k").map_err(|e| e.to_string())?;
                let p = CString::new(self.real(path).as_os_str().as_encoded_bytes())
                    .map_err(|e| e.to_string())?;
                // SAFETY: valid NUL-terminated strings and a buffer of the given length.
                let rc = unsafe {
                    if rng.chance(60) {
                        libc::setxattr(p.as_ptr(), name.as_ptr(), [step].as_ptr().cast(), 1, 0)
                    } else {
                        libc::removexattr(p.as_ptr(), name.as_ptr())
                    }
                };
                let e = std::io::Error::last_os_error();
                if rc != 0 && e.raw_os_error() != Some(libc::ENODATA) {
                    return Err(io("xattr", path, e));
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// `FS_IOC_SHUTDOWN` on the mount (commit, then stop): every file's content and names as
    /// of now must survive; afterwards a create fails with EIO and the device sees no I/O.
    fn shutdown(&mut self) -> Result<(), String> {
        let root = std::fs::File::open(&self.mnt).map_err(|e| io("open", "/", e))?;
        let mut flags = 0u32;
        // SAFETY: the ioctl writes at most a u32 through the pointer, which outlives the call.
        let rc = unsafe {
            libc::ioctl(
                root.as_raw_fd(),
                birch_fuse::FS_IOC_SHUTDOWN as _,
                &mut flags as *mut u32,
            )
        };
        if rc != 0 {
            return Err(io("FS_IOC_SHUTDOWN", "/", std::io::Error::last_os_error()));
        }
        let mark = self.mark();
        let paths: Vec<&'static str> = self.model.names.keys().copied().collect();
        for path in paths {
            self.history.synced(mark, path);
        }
        match self.open("/A/after-shutdown", 0) {
            Err(e) if e.contains("Input/output error") => {}
            other => return Err(format!("create after a shutdown: {other:?}, not EIO")),
        }
        if self.mark() != mark {
            return Err("device I/O after a shutdown".into());
        }
        Ok(())
    }

    /// What follows an operation: fsync, fdatasync, a directory fsync, a commit, or nothing.
    fn durability(
        &mut self,
        rng: &mut Rng,
        path: &'static str,
        writeback: bool,
    ) -> Result<(), String> {
        let exists = self.model.names.contains_key(path);
        // With the writeback cache, dirty pages of other files could be caught half-flushed
        // by a commit, which no version of the file ever held: there every content change is
        // fsync'd at once, and nothing else commits.
        let choice = if writeback {
            rng.below(2)
        } else {
            rng.below(5)
        };
        if std::env::var_os("BIRCH_CRASH_TRACE").is_some() {
            eprintln!("  durability {choice} (0 fsync, 1 fdatasync, 2 fsyncdir, 3 commit, 4 none)");
        }
        match choice {
            0 | 1 if exists => {
                let f = self.open(path, 0)?;
                if choice == 0 {
                    f.sync_all().map_err(|e| io("fsync", path, e))?;
                } else {
                    f.sync_data().map_err(|e| io("fdatasync", path, e))?;
                }
                drop(f);
                let mark = self.mark();
                self.history.synced(mark, path);
            }
            2 => {
                let dir = path.rsplit_once('/').map_or("/", |(d, _)| d);
                let d = std::fs::File::open(self.real(dir)).map_err(|e| io("open dir", dir, e))?;
                d.sync_all().map_err(|e| io("fsyncdir", dir, e))?;
                let mark = self.mark();
                if exists {
                    self.history.named(mark, path);
                }
            }
            3 => {
                self.fs.sync().map_err(|e| format!("commit: {e}"))?;
                self.mark();
            }
            _ => {}
        }
        Ok(())
    }
}

/// One FUSE-level run: a seeded sequence of 4–10 operations, each followed by a durability
/// call, on a mount over a recording device; then `states` crash states checked.
pub fn run(seed: u64, variant: Variant, states: usize, progress: &mut dyn FnMut()) -> FuseRun {
    let name = variant.name();
    match record(seed, variant) {
        Ok(recording) => FuseRun {
            report: check_recording(
                &name,
                seed,
                &recording.base,
                &recording.events,
                &recording.history,
                states,
                progress,
            ),
            fault: recording.fault,
        },
        Err(e) => FuseRun {
            report: CrashReport {
                states: 0,
                failures: vec![format!("{name} seed {seed}: workload failed: {e}")],
            },
            fault: FaultOutcome::default(),
        },
    }
}

/// What a FUSE-level run gives: the crash states' verdicts, and what its device fault did.
pub struct FuseRun {
    /// The crash states checked and their failures.
    pub report: CrashReport,
    /// The run's device fault, if it had one.
    pub fault: FaultOutcome,
}

/// What the device fault of a run with [`Variant::faults`] did (all false without one).
#[derive(Default, Clone, Copy)]
pub struct FaultOutcome {
    /// The fault was injected before the power cut.
    pub injected: bool,
    /// A call it failed ended the workload.
    pub ended_the_workload: bool,
}

/// A run's base image, its device events, what its workload did, and what its fault did.
struct Recording {
    base: Vec<u8>,
    events: Vec<Recorded>,
    history: History,
    fault: FaultOutcome,
}

/// Whether the mount at `mnt` served requests over FUSE over io_uring (its stats counter).
fn served_over_ring(mnt: &Path) -> Result<(), String> {
    let Ok(raw) = crate::stats::getxattr(mnt, "trusted.birch.stats") else {
        // Shut down: the counters are gone with the mount.
        return Ok(());
    };
    let text = String::from_utf8_lossy(&raw);
    let ring = text
        .split("\"fuse_uring_requests\":")
        .nth(1)
        .and_then(|rest| {
            rest.trim_start()
                .split(|c: char| !c.is_ascii_digit())
                .next()
        })
        .and_then(|n| n.parse::<u64>().ok());
    match ring {
        Some(n) if n > 0 => Ok(()),
        other => Err(format!(
            "the uring variant served no request over the ring (fuse_uring_requests {other:?})"
        )),
    }
}

/// How a FUSE run's mount is set up.
#[derive(Debug, Clone, Copy)]
pub struct Variant {
    /// The kernel's writeback cache (`writeback=`).
    pub writeback: bool,
    /// Name, attribute and page caches (`ttl=`, `keep_cache=`); off: ttl=0, keep_cache=off.
    pub caches: bool,
    /// The daemon's write buffer (`buffer=`).
    pub buffered: bool,
    /// FUSE over io_uring (`uring`).
    pub uring: bool,
    /// A device fault during the workload ([`fault_rule`] draws it from the seed).
    pub faults: bool,
}

impl Variant {
    /// The mount options of this variant, as its report names it.
    pub fn name(&self) -> String {
        let on = |b: bool| if b { "on" } else { "off" };
        let mut name = format!("fuse writeback={}", on(self.writeback));
        if !self.caches {
            name.push_str(",ttl=0,keep_cache=off");
        }
        if !self.buffered {
            name.push_str(",buffer=off");
        }
        if self.uring {
            name.push_str(",uring");
        }
        if self.faults {
            name.push_str(" +device fault");
        }
        name
    }
}

/// The fault of a run with [`Variant::faults`], drawn from its seed: EIO on a few writes, on one
/// write or one flush after some pass, or ENOSPC from the device (a thin pool that filled).
pub fn fault_rule(seed: u64) -> Rule {
    let mut rng = Rng::new(seed ^ 0xFA17);
    // A run makes a few dozen device writes and a few flushes: these odds put a fault in
    // most runs.
    match rng.below(4) {
        0 => Rule::always(Op::Write, Effect::Eio).percent(15).times(2),
        1 => Rule::always(Op::Flush, Effect::Eio)
            .after(rng.below(3))
            .times(1),
        2 => Rule::always(Op::Write, Effect::Eio)
            .after(rng.below(20))
            .times(1),
        _ => Rule::always(Op::Write, Effect::NoSpace)
            .percent(15)
            .times(3),
    }
}

/// Whether `error` (a failed call's message) is what a device fault makes a call answer.
fn from_a_fault(error: &str) -> bool {
    // The kernel's words for a call's errno, and the engine's for the in-process commit.
    [
        "Input/output error",
        "Read-only file system",
        "No space left on device",
        "I/O error",
    ]
    .iter()
    .any(|e| error.contains(e))
}

fn record(seed: u64, variant: Variant) -> Result<Recording, String> {
    let Variant {
        writeback,
        caches,
        buffered,
        uring,
        faults,
    } = variant;
    let mut rng = Rng::new(seed);
    let quiet = OpenOptions {
        commit_interval: None,
        buffered,
        ..Default::default()
    };
    let dev = Arc::new(MemDevice::new(96 << 20));
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).map_err(|e| e.to_string())?;
    let base = {
        let fs = Filesystem::open_device(dev.clone(), quiet.clone()).map_err(|e| e.to_string())?;
        let c = Caller::default();
        let a = fs
            .mkdir(c, ROOT_INO, b"A", 0o755)
            .map_err(|e| e.to_string())?;
        fs.mkdir(c, ROOT_INO, b"B", 0o755)
            .map_err(|e| e.to_string())?;
        fs.mkdir(c, a.ino, b"C", 0o755).map_err(|e| e.to_string())?;
        fs.close().map_err(|e| e.to_string())?;
        dev.snapshot()
    };
    dev.start_recording();
    // Background commits race with the workload, except under the writeback cache (above).
    let options = OpenOptions {
        commit_interval: (!writeback && rng.chance(50))
            .then(|| Duration::from_millis(5 + rng.below(40))),
        ..quiet
    };
    // A faulty run's filesystem sees the device through the fault device, armed once the
    // filesystem is open (the recording below it keeps only what reached the device).
    let fault = faults.then(|| Arc::new(FaultDevice::new(dev.clone(), seed)));
    let device: Arc<dyn BlockDevice> = match &fault {
        Some(f) => f.clone(),
        None => dev.clone(),
    };
    let fs = Arc::new(Filesystem::open_device(device, options).map_err(|e| e.to_string())?);
    if let Some(f) = &fault {
        f.add(fault_rule(seed));
    }
    let mnt = std::env::temp_dir().join(format!("birch-crashtest-{}-{seed}", std::process::id()));
    std::fs::create_dir_all(&mnt).map_err(|e| io("mkdir", &mnt.display().to_string(), e))?;
    let mount = InProcessMount::start(fs.clone(), &mnt, writeback, caches, uring)?;
    let mut run = Run {
        mnt: mnt.clone(),
        dev: &dev,
        fs: &fs,
        events: Vec::new(),
        history: History::default(),
        model: Model::default(),
    };
    let steps = 4 + rng.below(7);
    // One run in three shuts down after a step (its own generator: other seeds replay as
    // before). Not a faulty run: a shutdown commits, and makes every file's content durable
    // as the workload sees it, which a write lost to the fault no longer is.
    let shutdown_after = (seed % 3 == 0 && !faults).then(|| Rng::new(seed ^ 0x5D).below(steps));
    let trace = std::env::var_os("BIRCH_CRASH_TRACE").is_some();
    let mut result = Ok(());
    let mut outcome = FaultOutcome::default();
    for step in 0..steps {
        let path = PATHS[rng.below(PATHS.len() as u64) as usize];
        if trace {
            let events = run.mark();
            eprintln!(
                "fuse step {step} on {path}: events so far {events}, names {:?}",
                run.model.names
            );
        }
        result = run
            .operation(&mut rng, step as u8, path)
            .and_then(|()| run.durability(&mut rng, path, writeback));
        // A call that failed because of the fault ends the workload; it is not a failure.
        let injected = fault.as_ref().is_some_and(|f| f.stats.total() > 0);
        if matches!(&result, Err(e) if injected && from_a_fault(e)) {
            if trace {
                eprintln!("fuse step {step}: ended by the device fault: {result:?}");
            }
            outcome.ended_the_workload = true;
            result = Ok(());
            break;
        }
        if result.is_err() {
            break;
        }
        if shutdown_after == Some(step) {
            if trace {
                eprintln!("fuse step {step}: FS_IOC_SHUTDOWN");
            }
            result = run.shutdown();
            break;
        }
    }
    // A run of the io_uring variant must have been served over the ring (a fallback to
    // /dev/fuse would test the other transport again); a shut-down mount answers nothing.
    if uring && result.is_ok() {
        result = served_over_ring(&mnt);
    }
    // Power cut: what reached the device so far is all a crash can keep.
    run.mark();
    outcome.injected = fault.as_ref().is_some_and(|f| f.stats.total() > 0);
    if outcome.injected {
        run.history.faulted();
    }
    let Run {
        events, history, ..
    } = run;
    mount.stop();
    let _ = std::fs::remove_dir(&mnt);
    result.map(|()| Recording {
        base,
        events,
        history,
        fault: outcome,
    })
}
