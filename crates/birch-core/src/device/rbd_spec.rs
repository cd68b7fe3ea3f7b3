//! Naming an image: a path, or `rbd:POOL[/NAMESPACE]/IMAGE[@SNAP]` for a Ceph RBD image, and
//! how to reach the cluster (client id, `ceph.conf`, keyring).
//!
//! Compiled in every build, so that a build without the `rbd` feature can still recognise an
//! RBD spec and refuse it clearly ("built without RBD support"), and so that the spec parser,
//! the option parser and the object-layout rule are unit tested without a cluster. The
//! librbd calls live in `rbd.rs`, behind the feature.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use birch_format::superblock::{SUPER_BYTES, SUPER_OFFSETS};
use birch_format::{BLOCK_SIZE, NODE_SIZE};

/// The prefix that makes an image argument an RBD image rather than a path.
pub const RBD_PREFIX: &str = "rbd:";

/// An RBD image named by `rbd:POOL[/NAMESPACE]/IMAGE[@SNAP]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RbdSpec {
    /// The RADOS pool holding the image.
    pub pool: String,
    /// The RADOS namespace inside the pool; empty for the default namespace.
    pub namespace: String,
    /// The image name.
    pub image: String,
    /// A snapshot of the image (read-only, no lock), if named.
    pub snapshot: Option<String>,
}

impl std::fmt::Display for RbdSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{RBD_PREFIX}{}/", self.pool)?;
        if !self.namespace.is_empty() {
            write!(f, "{}/", self.namespace)?;
        }
        write!(f, "{}", self.image)?;
        if let Some(snap) = &self.snapshot {
            write!(f, "@{snap}")?;
        }
        Ok(())
    }
}

impl RbdSpec {
    /// Parses `rbd:POOL[/NAMESPACE]/IMAGE[@SNAP]`. Returns `Ok(None)` for anything that does
    /// not start with `rbd:` (an image path), and an error naming the expected form for a
    /// malformed spec.
    pub fn parse(text: &str) -> io::Result<Option<RbdSpec>> {
        let Some(rest) = text.strip_prefix(RBD_PREFIX) else {
            return Ok(None);
        };
        let bad = |why: &str| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{text}: {why} (expected rbd:POOL/IMAGE, rbd:POOL/NAMESPACE/IMAGE or rbd:POOL/IMAGE@SNAP)"),
            )
        };
        let (path, snapshot) = match rest.split_once('@') {
            Some((path, snap)) => (path, Some(snap)),
            None => (rest, None),
        };
        let parts: Vec<&str> = path.split('/').collect();
        let (pool, namespace, image) = match parts.as_slice() {
            [pool, image] => (*pool, "", *image),
            [pool, namespace, image] => (*pool, *namespace, *image),
            [_] => return Err(bad("no image name")),
            _ => return Err(bad("too many '/'")),
        };
        if pool.is_empty() {
            return Err(bad("empty pool name"));
        }
        if image.is_empty() {
            return Err(bad("empty image name"));
        }
        if parts.len() == 3 && namespace.is_empty() {
            return Err(bad("empty namespace"));
        }
        if snapshot.is_some_and(|s| s.is_empty() || s.contains('@')) {
            return Err(bad("bad snapshot name"));
        }
        if text.contains('\0') {
            return Err(bad("NUL byte in the name"));
        }
        Ok(Some(RbdSpec {
            pool: pool.to_string(),
            namespace: namespace.to_string(),
            image: image.to_string(),
            snapshot: snapshot.map(str::to_string),
        }))
    }

    /// Parses an image argument given as a path: `Ok(None)` when it is a plain path.
    pub fn from_path(path: &Path) -> io::Result<Option<RbdSpec>> {
        match path.to_str() {
            Some(text) => RbdSpec::parse(text),
            // Not UTF-8, so not `rbd:` (pool and image names are UTF-8 in Ceph).
            None => Ok(None),
        }
    }

    /// The file this host's processes lock while they hold the image (see [`LocalLock`]).
    pub fn local_lock_path(&self) -> PathBuf {
        let escape = |s: &str| s.replace('%', "%25").replace('/', "%2F");
        let name = format!(
            "{}.{}.{}.lock",
            escape(&self.pool),
            escape(&self.namespace),
            escape(&self.image)
        );
        local_lock_dir().join(name)
    }
}

/// Whether an image argument names an RBD image (starts with `rbd:`), well formed or not.
pub fn is_rbd_path(path: &Path) -> bool {
    path.to_str().is_some_and(|t| t.starts_with(RBD_PREFIX))
}

/// How to reach the Ceph cluster, as the `rbd` command takes it: a client id (`--id`,
/// `ceph_id=`), a configuration file (`-c`, `ceph_conf=`, else `CEPH_CONF` and the default
/// search path) and a keyring (`--keyring`, `keyring=`). Anything unset is left to librados,
/// which also reads `CEPH_ARGS`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CephOptions {
    /// Client id without the `client.` prefix (`admin` when unset, as for `rbd`).
    pub id: Option<String>,
    /// Path of `ceph.conf`.
    pub conf: Option<PathBuf>,
    /// Path of the keyring.
    pub keyring: Option<PathBuf>,
    /// Whether and how a mount takes the image from a holder that still has its lock
    /// (`takeover`, `takeover=force`; DESIGN §14.3).
    pub takeover: Takeover,
    /// How long `takeover` waits for the holder's watch to expire (`takeover_wait=SECS`);
    /// [`DEFAULT_TAKEOVER_WAIT`] when unset.
    pub takeover_wait: Option<Duration>,
    /// The watchdog: how long one device request may wait for the cluster before the device
    /// is given up (`rbd_timeout=SECS`); [`DEFAULT_RBD_TIMEOUT`] when unset.
    pub io_timeout: Option<Duration>,
    /// Whether space freed for good is discarded on the image (`discard=on|off`, `nodiscard`;
    /// on when unset).
    pub discard: Option<bool>,
}

/// How long `-o takeover` waits for a holder's watch to expire by default: the OSDs drop a
/// watch 30 s (`osd_client_watch_timeout`) after its last ping, plus a margin.
pub const DEFAULT_TAKEOVER_WAIT: Duration = Duration::from_secs(60);

/// The watchdog's default (`rbd_timeout=`): longer than an OSD restart here, short enough that
/// an unreachable cluster gives EIO rather than a hang.
pub const DEFAULT_RBD_TIMEOUT: Duration = Duration::from_secs(60);

/// Taking an image from a holder that still has its lock (DESIGN §14.3).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Takeover {
    /// Refuse a holder (but one gone from this host, whose watch is waited out).
    #[default]
    No,
    /// `takeover`: wait until the holder's watch expires (it answers no more), then blocklist
    /// it and break its lock; a holder still watching at the deadline is refused.
    Wait,
    /// `takeover=force`: blocklist the holder and break its lock at once.
    Force,
}

impl CephOptions {
    /// Takes one mount option if it is a Ceph one (`ceph_id=`, `ceph_conf=`, `keyring=`):
    /// `Ok(true)` when taken, `Ok(false)` when the key is not ours, an error for an empty value.
    pub fn take_mount_option(&mut self, key: &str, value: Option<&str>) -> Result<bool, String> {
        let seconds = |v: Option<&str>| -> Result<Duration, String> {
            v.and_then(|v| v.parse::<u64>().ok())
                .filter(|n| (1..=86_400).contains(n))
                .map(Duration::from_secs)
                .ok_or_else(|| {
                    format!(
                        "option {key}={}: needs a whole number of seconds from 1 to 86400",
                        v.unwrap_or("")
                    )
                })
        };
        match key {
            "takeover" => {
                self.takeover = match value {
                    None | Some("wait") | Some("on") => Takeover::Wait,
                    Some("force") => Takeover::Force,
                    Some("off") => Takeover::No,
                    Some(v) => {
                        return Err(format!(
                            "option takeover={v}: expected takeover (wait for the holder's watch to expire), takeover=force (fence it at once) or takeover=off"
                        ))
                    }
                };
                return Ok(true);
            }
            "takeover_wait" => {
                self.takeover_wait = Some(seconds(value)?);
                return Ok(true);
            }
            "rbd_timeout" => {
                self.io_timeout = Some(seconds(value)?);
                return Ok(true);
            }
            "discard" | "nodiscard" => {
                self.discard = Some(match (key, value) {
                    ("nodiscard", None) | ("discard", Some("off")) => false,
                    ("discard", None | Some("on")) => true,
                    _ => {
                        return Err(format!(
                        "option {key}{}: expected discard, discard=on, discard=off or nodiscard",
                        value.map(|v| format!("={v}")).unwrap_or_default()
                    ))
                    }
                });
                return Ok(true);
            }
            _ => {}
        }
        let slot = match key {
            "ceph_id" | "ceph_conf" | "keyring" => value
                .filter(|v| !v.is_empty())
                .ok_or_else(|| format!("option {key}: needs a value ({key}=...)"))?,
            _ => return Ok(false),
        };
        match key {
            "ceph_id" => self.id = Some(strip_client(slot).to_string()),
            "ceph_conf" => self.conf = Some(PathBuf::from(slot)),
            _ => self.keyring = Some(PathBuf::from(slot)),
        }
        Ok(true)
    }

    /// The client id to connect as: the one given, else `--id`/`--user`/`--name`/`-n` from
    /// `ceph_args` (the `CEPH_ARGS` variable, which librados only reads for configuration,
    /// not for the client name), else none (librados's default, `client.admin`).
    pub fn client_id(&self, ceph_args: Option<&str>) -> Option<String> {
        if let Some(id) = &self.id {
            return Some(strip_client(id).to_string());
        }
        let args: Vec<&str> = ceph_args?.split_whitespace().collect();
        let mut found = None;
        for (i, arg) in args.iter().enumerate() {
            let (key, inline) = match arg.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (*arg, None),
            };
            if matches!(key, "--id" | "--user" | "--name" | "-n" | "-i") {
                let value = inline.or_else(|| args.get(i + 1).copied());
                found = value.map(|v| strip_client(v).to_string());
            }
        }
        found
    }
}

fn strip_client(id: &str) -> &str {
    id.strip_prefix("client.").unwrap_or(id)
}

/// Checks that an RBD image's layout keeps every write birch needs atomic inside one RADOS
/// object. RADOS applies a write atomically only within one object; a write that spans two is
/// two operations, and a crash between them tears it. So the bytes contiguous in one object
/// (the object size, or the stripe unit when the image is striped over several objects) must
/// be a multiple of the tree node size: nodes are allocated at node-aligned addresses
/// ([`NODE_SIZE`]), and the superblock slots ([`SUPER_OFFSETS`], [`SUPER_BYTES`]) are block
/// aligned inside the first node-sized span, so neither can then cross an object boundary.
///
/// A log batch (a run of whole blocks holding records) can still span two objects; its
/// checksum covers every byte, so a torn batch never verifies and replay ends before it, and
/// its fsync was not acknowledged (the batch's flush had not completed). Aligning batches to
/// objects needs a change in the log writer (next step, DESIGN §14).
pub fn check_rbd_layout(
    object_bytes: u64,
    stripe_unit_bytes: u64,
    stripe_count: u64,
) -> Result<u64, String> {
    let node = NODE_SIZE as u64;
    let contiguous = if stripe_count > 1 {
        stripe_unit_bytes
    } else {
        object_bytes
    };
    let what = if stripe_count > 1 {
        format!("stripe unit {stripe_unit_bytes} bytes (stripe count {stripe_count})")
    } else {
        format!("object size {object_bytes} bytes")
    };
    if contiguous == 0 || contiguous % node != 0 {
        return Err(format!(
            "{what}: a {node}-byte tree node could cross a RADOS object boundary and tear on a crash; birchfs needs the bytes contiguous in one object to be a multiple of {node} (the default 4 MiB objects without fancy striping are fine: rbd create --object-size 4M)"
        ));
    }
    // The rule above implies this; kept as a pair check on the constants it relies on.
    debug_assert!(SUPER_OFFSETS
        .iter()
        .all(|o| o % BLOCK_SIZE == 0 && o / node == (o + SUPER_BYTES as u64 - 1) / node));
    Ok(contiguous)
}

/// Directory of this host's per-image lock files: `/run/birch` for root, else
/// `$XDG_RUNTIME_DIR/birch` or the temporary directory.
fn local_lock_dir() -> PathBuf {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/run/birch");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) => PathBuf::from(dir).join("birch"),
        None => std::env::temp_dir().join("birch-run"),
    }
}

/// A lock on this host that a process holds for as long as it has an RBD image open with the
/// cluster lock: `birch umount` waits on it for the daemon's final commit and release (it has
/// no cluster credentials of its own, and must not connect), and a mount right after an
/// unmount waits on it instead of being refused by the departing daemon's cluster lock.
pub struct LocalLock {
    _file: File,
}

impl LocalLock {
    /// Takes the lock for `spec`; with `wait`, waits for another holder on this host to let
    /// go (telling stderr after 2 s) as long as `spec` is not mounted here (a daemon finishing
    /// its final commit after an unmount); fails at once with the holder's pid otherwise.
    pub fn acquire(spec: &RbdSpec, wait: bool) -> io::Result<LocalLock> {
        let path = spec.local_lock_path();
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", dir.display())))?;
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .open(&path)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        let started = Instant::now();
        let mut told = false;
        loop {
            match super::file::lock_image(&file, &path, true, false) {
                Ok(()) => return Ok(LocalLock { _file: file }),
                Err(e) if e.kind() != io::ErrorKind::ResourceBusy => return Err(e),
                Err(e) if !wait || is_mounted_here(spec) => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("{spec}: open on this host ({e})"),
                    ))
                }
                Err(e) => {
                    if !told && started.elapsed() > Duration::from_secs(2) {
                        eprintln!("{spec}: {e}; waiting for it to be released");
                        told = true;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until no process on this host holds `spec` (after an unmount, the daemon's final
    /// commit and release), for at most `limit`. Returns whether it was released.
    pub fn wait_released(spec: &RbdSpec, limit: Duration) -> io::Result<bool> {
        let path = spec.local_lock_path();
        if !path.exists() {
            return Ok(true);
        }
        let started = Instant::now();
        loop {
            match LocalLock::acquire(spec, false) {
                Ok(_) => return Ok(true),
                Err(e) if e.kind() == io::ErrorKind::ResourceBusy => {}
                Err(e) => return Err(e),
            }
            if started.elapsed() > limit {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The image lock as an open device sees it (DESIGN §14.3). `Lost` is terminal: a device
/// that lost the lock (taken over, fenced, or given up by the watchdog) never does I/O again
/// and never takes the lock back, whatever librbd does underneath.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockState {
    /// No lock taken (yet, or an unlocked read-only open).
    Unlocked,
    /// This device holds the exclusive lock.
    Held,
    /// Released by a clean close.
    Released,
    /// Lost, with the reason; nothing more passes.
    Lost(String),
}

impl LockState {
    /// The lock was taken. Only from `Unlocked`: a lost or released lock is never taken back.
    pub fn acquired(&mut self) -> Result<(), String> {
        match self {
            LockState::Unlocked => {
                *self = LockState::Held;
                Ok(())
            }
            other => Err(format!("the image lock cannot be taken again ({other:?})")),
        }
    }

    /// The lock is gone (or the device is given up): returns whether this call made it so
    /// (false: it was lost already, and the first reason stays).
    pub fn lose(&mut self, why: &str) -> bool {
        if matches!(self, LockState::Lost(_)) {
            return false;
        }
        *self = LockState::Lost(why.to_string());
        true
    }

    /// A clean close released it (a lost lock stays lost: it is not ours to release).
    pub fn released(&mut self) {
        if *self == LockState::Held {
            *self = LockState::Released;
        }
    }

    /// Whether I/O may pass: unless lost or released.
    pub fn may_do_io(&self) -> Result<(), String> {
        match self {
            LockState::Lost(why) => Err(why.clone()),
            LockState::Released => Err("the image is closed".into()),
            LockState::Unlocked | LockState::Held => Ok(()),
        }
    }

    /// Whether the device is lost.
    pub fn is_lost(&self) -> bool {
        matches!(self, LockState::Lost(_))
    }
}

/// Whether a FUSE mount on this host has `spec` as its source (`/proc/self/mountinfo`).
fn is_mounted_here(spec: &RbdSpec) -> bool {
    let want = spec.to_string();
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    info.lines().any(|line| {
        let fields: Vec<&str> = line.split(' ').collect();
        fields.iter().position(|f| *f == "-").is_some_and(|dash| {
            fields.get(dash + 1).is_some_and(|t| t.starts_with("fuse"))
                && fields.get(dash + 2) == Some(&want.as_str())
        })
    })
}

/// The flushes in flight, numbered in the order they were submitted. librbd reports a failed
/// write only to the flushes that finish in its batch (with its cache on, writes complete
/// before the OSDs have them): when two flushes run side by side (a commit's and a log
/// batch's), one may take the error of a write made before the other, which then completes
/// successfully. So a flush that succeeds waits for every flush submitted before it finished,
/// and fails if the device was given up meanwhile (the other's failure gives it up before
/// that flush leaves this set). Seen on the RBD tier: a fenced daemon resumed after SIGSTOP
/// acknowledged an fsync whose writes had failed with -EBLOCKLISTED.
#[derive(Default)]
#[cfg_attr(not(feature = "rbd"), allow(dead_code))] // used by rbd.rs; unit tested here
pub(crate) struct FlushesInFlight {
    state: std::sync::Mutex<(u64, std::collections::BTreeSet<u64>)>,
    done: std::sync::Condvar,
}

#[cfg_attr(not(feature = "rbd"), allow(dead_code))]
impl FlushesInFlight {
    /// Numbers a flush about to be submitted.
    pub(crate) fn begin(&self) -> u64 {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let seq = st.0;
        st.0 += 1;
        st.1.insert(seq);
        seq
    }

    /// Flush `seq` finished; returns how many flushes were submitted by then.
    pub(crate) fn end(&self, seq: u64) -> u64 {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.1.remove(&seq);
        self.done.notify_all();
        st.0
    }

    /// Waits until no flush numbered below `upto` is in flight, or `stop` says to stop
    /// waiting (checked at least every `poll`). No lock is held across any I/O: this waits
    /// for other threads' flushes to complete.
    pub(crate) fn wait_before(&self, upto: u64, poll: Duration, stop: impl Fn() -> bool) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while st.1.first().is_some_and(|&s| s < upto) && !stop() {
            st = self
                .done
                .wait_timeout(st, poll)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_flush_waits_for_the_flushes_submitted_before_it_finished() {
        let f = std::sync::Arc::new(FlushesInFlight::default());
        let earlier = f.begin();
        let this = f.begin();
        let upto = f.end(this);
        assert_eq!(upto, 2, "two flushes were submitted by then");
        let lost = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (f2, lost2) = (f.clone(), lost.clone());
        let ender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            // The earlier flush failed: the device is given up before it leaves the set.
            lost2.store(true, std::sync::atomic::Ordering::SeqCst);
            f2.end(earlier);
        });
        let started = Instant::now();
        f.wait_before(upto, Duration::from_secs(10), || false);
        assert!(
            started.elapsed() >= Duration::from_millis(40),
            "returned before the earlier flush ended"
        );
        assert!(
            lost.load(std::sync::atomic::Ordering::SeqCst),
            "its failure is seen"
        );
        ender.join().expect("ender");
        // A flush begun after this one finished is not waited for.
        let later = f.begin();
        let started = Instant::now();
        f.wait_before(upto, Duration::from_secs(10), || false);
        assert!(started.elapsed() < Duration::from_secs(1));
        f.end(later);
        // Nor is anything once the device is lost.
        let stuck = f.begin();
        let upto = f.begin() + 1;
        let started = Instant::now();
        f.wait_before(upto, Duration::from_millis(5), || true);
        assert!(started.elapsed() < Duration::from_secs(1));
        f.end(stuck);
    }

    use super::*;

    #[test]
    fn plain_paths_are_not_rbd() {
        assert_eq!(RbdSpec::parse("/var/tmp/img").ok(), Some(None));
        assert_eq!(RbdSpec::parse("rbd").ok(), Some(None));
        assert_eq!(RbdSpec::parse("./rbd:x/y").ok(), Some(None));
        assert!(!is_rbd_path(Path::new("/dev/sdb")));
        assert!(is_rbd_path(Path::new("rbd:")));
    }

    #[test]
    fn specs_parse_into_pool_namespace_image_and_snapshot() {
        let spec = |t: &str| RbdSpec::parse(t).ok().flatten();
        let s = spec("rbd:rbd/img0").expect("pool/image");
        assert_eq!(
            (s.pool.as_str(), s.namespace.as_str(), s.image.as_str()),
            ("rbd", "", "img0")
        );
        assert_eq!(s.snapshot, None);
        assert_eq!(s.to_string(), "rbd:rbd/img0");
        let s = spec("rbd:p/ns/i@snap1").expect("pool/ns/image@snap");
        assert_eq!(
            (s.pool.as_str(), s.namespace.as_str(), s.image.as_str()),
            ("p", "ns", "i")
        );
        assert_eq!(s.snapshot.as_deref(), Some("snap1"));
        assert_eq!(s.to_string(), "rbd:p/ns/i@snap1");
    }

    #[test]
    fn malformed_specs_say_what_is_wrong() {
        for (text, why) in [
            ("rbd:", "no image name"),
            ("rbd:pool", "no image name"),
            ("rbd:/img", "empty pool name"),
            ("rbd:pool/", "empty image name"),
            ("rbd:a/b/c/d", "too many"),
            ("rbd:a//c", "empty namespace"),
            ("rbd:a/b@", "bad snapshot"),
            ("rbd:a/b@x@y", "bad snapshot"),
        ] {
            let err = RbdSpec::parse(text).err().map(|e| e.to_string());
            let err = err.unwrap_or_else(|| panic!("{text} must be refused"));
            assert!(
                err.contains(why) && err.contains("expected rbd:POOL/IMAGE"),
                "{text}: {err}"
            );
        }
    }

    #[test]
    fn lock_file_names_cannot_collide_through_slashes() {
        let a = RbdSpec::parse("rbd:a/b/c").ok().flatten().expect("spec");
        let b = RbdSpec::parse("rbd:a/b%2Fc").ok().flatten();
        // '%' is escaped too, so "b%2Fc" as an image name is not namespace b, image c.
        let b = b.expect("spec");
        assert_ne!(a.local_lock_path(), b.local_lock_path());
    }

    #[test]
    fn mount_options_set_the_ceph_fields() {
        let mut c = CephOptions::default();
        assert_eq!(
            c.take_mount_option("ceph_id", Some("client.birch")),
            Ok(true)
        );
        assert_eq!(
            c.take_mount_option("ceph_conf", Some("/etc/ceph/x.conf")),
            Ok(true)
        );
        assert_eq!(c.take_mount_option("keyring", Some("/k")), Ok(true));
        assert_eq!(c.take_mount_option("commit", Some("5")), Ok(false));
        assert!(c.take_mount_option("keyring", None).is_err());
        assert!(c.take_mount_option("ceph_id", Some("")).is_err());
        assert_eq!(c.id.as_deref(), Some("birch"));
        assert_eq!(c.conf.as_deref(), Some(Path::new("/etc/ceph/x.conf")));
        assert_eq!(c.keyring.as_deref(), Some(Path::new("/k")));
    }

    #[test]
    fn takeover_and_timeout_options_parse_and_bad_values_are_refused() {
        let mut c = CephOptions::default();
        assert_eq!(c.takeover, Takeover::No);
        assert_eq!(c.take_mount_option("takeover", None), Ok(true));
        assert_eq!(c.takeover, Takeover::Wait);
        assert_eq!(c.take_mount_option("takeover", Some("force")), Ok(true));
        assert_eq!(c.takeover, Takeover::Force);
        assert_eq!(c.take_mount_option("takeover", Some("off")), Ok(true));
        assert_eq!(c.takeover, Takeover::No);
        assert_eq!(c.take_mount_option("takeover", Some("wait")), Ok(true));
        assert_eq!(c.takeover, Takeover::Wait);
        let err = c.take_mount_option("takeover", Some("now")).err();
        assert!(err.is_some_and(|e| e.contains("takeover=force")));
        assert_eq!(c.take_mount_option("rbd_timeout", Some("15")), Ok(true));
        assert_eq!(c.io_timeout, Some(Duration::from_secs(15)));
        assert_eq!(c.take_mount_option("takeover_wait", Some("90")), Ok(true));
        assert_eq!(c.takeover_wait, Some(Duration::from_secs(90)));
        for (key, bad) in [
            ("rbd_timeout", None),
            ("rbd_timeout", Some("0")),
            ("rbd_timeout", Some("-3")),
            ("rbd_timeout", Some("1.5")),
            ("rbd_timeout", Some("ten")),
            ("takeover_wait", Some("")),
            ("takeover_wait", Some("100000")),
        ] {
            let err = c.take_mount_option(key, bad).err();
            assert!(
                err.as_deref()
                    .is_some_and(|e| e.contains("whole number of seconds")),
                "{key}={bad:?}: {err:?}"
            );
        }
        // Unchanged by the refused values.
        assert_eq!(c.io_timeout, Some(Duration::from_secs(15)));
        assert_eq!(c.discard, None, "discard is on unless turned off");
        assert_eq!(c.take_mount_option("discard", Some("off")), Ok(true));
        assert_eq!(c.discard, Some(false));
        assert_eq!(c.take_mount_option("discard", None), Ok(true));
        assert_eq!(c.discard, Some(true));
        assert_eq!(c.take_mount_option("nodiscard", None), Ok(true));
        assert_eq!(c.discard, Some(false));
        assert_eq!(c.take_mount_option("discard", Some("on")), Ok(true));
        assert_eq!(c.discard, Some(true));
        for bad in [Some("yes"), Some("")] {
            let err = c.take_mount_option("discard", bad).err();
            assert!(err.is_some_and(|e| e.contains("discard=off")), "{bad:?}");
        }
        assert!(c.take_mount_option("nodiscard", Some("x")).is_err());
        assert_eq!(c.discard, Some(true));
    }

    #[test]
    fn a_lost_lock_is_never_taken_back() {
        let mut s = LockState::Unlocked;
        assert!(s.may_do_io().is_ok());
        assert!(s.acquired().is_ok());
        assert_eq!(s, LockState::Held);
        assert!(s.acquired().is_err(), "held already");
        assert!(s.lose("blocklisted"));
        assert!(!s.lose("watchdog"), "the first reason stays");
        assert_eq!(s.may_do_io(), Err("blocklisted".to_string()));
        assert!(s.acquired().is_err(), "a lost lock is never re-acquired");
        s.released();
        assert!(s.is_lost(), "a lost lock is not released by a close");
        let mut s = LockState::Unlocked;
        assert!(s.acquired().is_ok());
        s.released();
        assert_eq!(s, LockState::Released);
        assert!(s.may_do_io().is_err());
        assert!(
            s.acquired().is_err(),
            "nor is a released one, by the same device"
        );
        // An unlocked (read-only) device can be given up too.
        let mut s = LockState::Unlocked;
        assert!(s.lose("the cluster did not answer"));
        assert!(s.may_do_io().is_err());
    }

    #[test]
    fn client_id_comes_from_the_option_then_ceph_args() {
        let given = CephOptions {
            id: Some("a".into()),
            ..Default::default()
        };
        assert_eq!(given.client_id(Some("--id b")).as_deref(), Some("a"));
        let none = CephOptions::default();
        assert_eq!(none.client_id(None), None);
        assert_eq!(none.client_id(Some("--id b")).as_deref(), Some("b"));
        assert_eq!(
            none.client_id(Some("--name=client.c --keyring /k"))
                .as_deref(),
            Some("c")
        );
        assert_eq!(none.client_id(Some("-n client.d")).as_deref(), Some("d"));
        assert_eq!(none.client_id(Some("--keyring /k")), None);
    }

    #[cfg(not(feature = "rbd"))]
    #[test]
    fn rbd_images_without_the_feature_are_refused_clearly() {
        let options = crate::device::ImageOptions::default();
        let mode = crate::device::OpenMode::ReadOnly;
        let err = crate::device::open_image(Path::new("rbd:rbd/img0"), mode, &options)
            .err()
            .map(|e| (e.kind(), e.to_string()));
        let (kind, text) = err.unwrap_or_else(|| panic!("an rbd: image must be refused"));
        assert_eq!(kind, io::ErrorKind::Unsupported);
        assert!(
            text.contains("rbd:rbd/img0") && text.contains("built without RBD support"),
            "{text}"
        );
        let bad = crate::device::open_image(Path::new("rbd:img0"), mode, &options).err();
        assert!(bad.is_some_and(|e| e.to_string().contains("no image name")));
    }

    #[test]
    fn object_layout_must_hold_whole_nodes() {
        // The default: 4 MiB objects, no striping.
        // The bytes contiguous in one object come back: the log's atomic unit.
        assert_eq!(check_rbd_layout(4 << 20, 4 << 20, 1), Ok(4 << 20));
        // Smallest object size that still holds whole nodes.
        assert!(check_rbd_layout(16 << 10, 16 << 10, 1).is_ok());
        // 4 KiB and 8 KiB objects (rbd create --object-size 4K) split a node.
        let err = check_rbd_layout(8 << 10, 8 << 10, 1)
            .err()
            .unwrap_or_default();
        assert!(
            err.contains("object size 8192") && err.contains("cross"),
            "{err}"
        );
        assert!(check_rbd_layout(4 << 10, 4 << 10, 1).is_err());
        // Fancy striping: the stripe unit is what one object holds contiguously.
        assert_eq!(check_rbd_layout(4 << 20, 64 << 10, 16), Ok(64 << 10));
        let err = check_rbd_layout(4 << 20, 4 << 10, 8)
            .err()
            .unwrap_or_default();
        assert!(err.contains("stripe unit 4096"), "{err}");
        // A stripe unit smaller than the object but with one stripe: objects are filled in order.
        assert_eq!(check_rbd_layout(4 << 20, 4 << 10, 1), Ok(4 << 20));
        assert!(check_rbd_layout(0, 0, 1).is_err());
    }
}
