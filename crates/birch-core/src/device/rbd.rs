//! A Ceph RBD image as a block device, through librbd (the `rbd` cargo feature).
//!
//! Every request is an `rbd_aio_*` call. A single request (`read_at`, `write_at`, `flush`)
//! is waited for before it returns; a batch (`write_many`, `read_many`, `discard`) is
//! submitted whole, up to [`MAX_IN_FLIGHT`] requests at a time, before anything waits, so a
//! commit's node writes, a write-back's runs and a read of many extents pay about one round
//! trip, not one each (DESIGN §14.4). The engine's own
//! ordering (nodes written, flush, superblock, flush) carries over unchanged: `write_many`
//! returns only once every write of the batch has completed, and `rbd_aio_flush` completes
//! only when every write that completed before it is on the OSDs, librbd's cache or not. A
//! flush orders nothing submitted after it, so nothing here submits a flush with writes still
//! in flight.
//!
//! One writer at a time: a locked open takes this host's [`LocalLock`] and then the image's
//! exclusive lock (`rbd_lock_acquire`) before anything reads the superblock, after listing the
//! current owners: a live owner is refused at once, naming the host, pid and use it recorded
//! in the image metadata (`birch.holder`).
//!
//! librados starts threads at connect, and they do not survive `fork()`: nothing here forks,
//! and the mount daemon connects only in the re-executed child (`birch mount -f`).
//!
//! Takeover, fencing and the watchdog (DESIGN §14.3): `takeover` waits for a holder's watch to
//! expire, `takeover=force` does not; both blocklist the holder before breaking its lock. Each
//! request is an `rbd_aio_*` call waited for with the `rbd_timeout=` watchdog. A device whose
//! lock is lost, whose client is fenced, whose I/O fails or times out is given up for good
//! ([`LockState::Lost`]): nothing more passes, the lock is never taken back, and its user hears
//! of it ([`DeviceEvents::device_lost`]).

use std::ffi::{CStr, CString};
use std::io;
use std::mem::ManuallyDrop;
use std::os::raw::{c_char, c_int};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::rbd_ffi as ffi;
use super::rbd_spec::{
    check_rbd_layout, CephOptions, FlushesInFlight, LocalLock, LockState, RbdSpec, Takeover,
    DEFAULT_RBD_TIMEOUT, DEFAULT_TAKEOVER_WAIT,
};
use super::{check_range, BlockDevice, DeviceEvents, OpenMode};
use crate::counters::Counters;

/// Image metadata key naming the process that holds the image lock.
pub const HOLDER_KEY: &str = "birch.holder";

/// Client timeouts set when neither `ceph.conf` nor `CEPH_ARGS` sets them, as (option,
/// librados default, ours). A dead cluster must give an error, not a hang: librados waits 300 s
/// for the monitors by default and forever for a monitor or OSD operation. The OSD operation
/// timeout (every lock check, metadata call and lock break) is the watchdog's
/// ([`CephOptions::io_timeout`]), set in `configure`.
const CLIENT_TIMEOUTS: [(&str, &str, &str); 2] = [
    // Connecting: the monitors must answer within this.
    ("client_mount_timeout", "300", "20"),
    // Monitor commands (pool lookups, blocklisting).
    ("rados_mon_op_timeout", "0", "30"),
];

/// How often a request waiting for the cluster looks whether the device was given up.
const LOST_POLL: Duration = Duration::from_millis(100);

/// How often a device holding the lock asks the OSD whether it still does.
const LOCK_CHECK_EVERY: Duration = Duration::from_secs(2);

/// How long a locked open waits for the lock of a holder that is gone from this host: its
/// watch on the image header expires after `osd_client_watch_timeout` (30 s by default), and
/// only then does `rbd_lock_acquire` break its lock (and blocklist it).
const DEAD_HOLDER_WAIT: Duration = Duration::from_secs(90);

/// What an open of an RBD image needs beyond the spec and mode.
#[derive(Clone, Default)]
pub struct RbdOpenOptions {
    /// How to reach the cluster.
    pub ceph: CephOptions,
    /// What holds the image, recorded in its metadata for a refused second user ("mount at
    /// /mnt/x", "fsck").
    pub holder: String,
    /// Who hears that the device is lost, and answers quiesce requests.
    pub events: Option<Arc<dyn DeviceEvents>>,
}

/// A librados cluster connection with an I/O context on the image's pool and namespace.
struct Cluster {
    handle: ffi::rados_t,
    ioctx: ffi::rados_ioctx_t,
    /// `client.N`: this client's name, as `rbd lock ls` shows it.
    client: String,
    /// This session's address, as `rbd_lock_get_owners` names a lock owner.
    address: String,
}

// SAFETY: librados handles may be used from any thread; the I/O context is only used by
// librbd calls, which are thread safe.
unsafe impl Send for Cluster {}
// SAFETY: as above.
unsafe impl Sync for Cluster {}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: both handles were created by this value and are destroyed once, context first.
        unsafe {
            if !self.ioctx.is_null() {
                ffi::rados_ioctx_destroy(self.ioctx);
            }
            ffi::rados_shutdown(self.handle);
        }
    }
}

fn cstring(text: &str, what: &str) -> io::Result<CString> {
    CString::new(text).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{what} {text:?} contains a NUL byte"),
        )
    })
}

/// An error from a librados/librbd return code (`-errno`), with context.
fn rc_error(rc: i64, context: impl std::fmt::Display) -> io::Error {
    let errno = i32::try_from(-rc).unwrap_or(libc::EIO);
    let os = io::Error::from_raw_os_error(errno);
    io::Error::new(os.kind(), format!("{context}: {os}"))
}

impl Cluster {
    /// Reads the configuration as `rbd` does and connects; fails within the client timeouts.
    fn connect(spec: &RbdSpec, ceph: &CephOptions) -> io::Result<Cluster> {
        let ceph_args = std::env::var("CEPH_ARGS").ok();
        let id = ceph.client_id(ceph_args.as_deref());
        let name = format!("client.{}", id.as_deref().unwrap_or("admin"));
        let id_c = id.as_deref().map(|i| cstring(i, "client id")).transpose()?;
        let mut handle: ffi::rados_t = std::ptr::null_mut();
        // SAFETY: rados_create writes a handle into `handle`; the id outlives the call.
        let rc = unsafe {
            ffi::rados_create(
                &mut handle,
                id_c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            )
        };
        if rc < 0 {
            return Err(rc_error(rc.into(), format!("{spec}: rados_create({name})")));
        }
        let mut cluster = Cluster {
            handle,
            ioctx: std::ptr::null_mut(),
            client: String::new(),
            address: String::new(),
        };
        cluster.configure(spec, ceph, &name)?;
        // SAFETY: a configured handle that has not connected yet.
        let rc = unsafe { ffi::rados_connect(cluster.handle) };
        if rc < 0 {
            let timeout = cluster.conf_get("client_mount_timeout").unwrap_or_default();
            return Err(rc_error(
                rc.into(),
                format!("{spec}: cannot connect to the Ceph cluster as {name} (client_mount_timeout {timeout} s; is the cluster up, and are ceph.conf and the keyring right?)"),
            ));
        }
        // SAFETY: a connected handle.
        cluster.client = format!("client.{}", unsafe {
            ffi::rados_get_instance_id(cluster.handle)
        });
        cluster.address = cluster.address_string();
        let pool = cstring(&spec.pool, "pool name")?;
        // SAFETY: a connected handle; the pool name outlives the call; ioctx is written.
        let rc =
            unsafe { ffi::rados_ioctx_create(cluster.handle, pool.as_ptr(), &mut cluster.ioctx) };
        if rc < 0 {
            cluster.ioctx = std::ptr::null_mut();
            return Err(rc_error(rc.into(), format!("{spec}: pool {:?}", spec.pool)));
        }
        if !spec.namespace.is_empty() {
            let ns = cstring(&spec.namespace, "namespace")?;
            // SAFETY: a valid I/O context; librados copies the name.
            unsafe { ffi::rados_ioctx_set_namespace(cluster.ioctx, ns.as_ptr()) };
        }
        Ok(cluster)
    }

    /// ceph.conf (the given one, else `CEPH_CONF` and the default search path), then
    /// `CEPH_ARGS`, then the keyring option, then our timeouts where still at their defaults.
    fn configure(&mut self, spec: &RbdSpec, ceph: &CephOptions, name: &str) -> io::Result<()> {
        let conf = match &ceph.conf {
            Some(p) => Some(cstring(&p.to_string_lossy(), "ceph.conf path")?),
            None => None,
        };
        // SAFETY: a handle that has not connected; the path outlives the call (NULL searches).
        let rc = unsafe {
            ffi::rados_conf_read_file(
                self.handle,
                conf.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            )
        };
        if rc < 0 {
            let which = match &ceph.conf {
                Some(p) => format!("reading {}", p.display()),
                None => match std::env::var("CEPH_CONF") {
                    Ok(p) => format!("reading {p} (CEPH_CONF)"),
                    Err(_) => "no ceph.conf in the default places (/etc/ceph/ceph.conf, ...): set CEPH_CONF, --ceph-conf or -o ceph_conf=".into(),
                },
            };
            return Err(rc_error(rc.into(), format!("{spec}: {which}")));
        }
        // SAFETY: as above; NULL means the CEPH_ARGS variable.
        let rc = unsafe { ffi::rados_conf_parse_env(self.handle, std::ptr::null()) };
        if rc < 0 {
            return Err(rc_error(rc.into(), format!("{spec}: parsing CEPH_ARGS")));
        }
        if let Some(keyring) = &ceph.keyring {
            self.conf_set("keyring", &keyring.to_string_lossy())
                .map_err(|e| {
                    io::Error::new(e.kind(), format!("{spec}: keyring for {name}: {e}"))
                })?;
        }
        for (option, default, ours) in CLIENT_TIMEOUTS {
            if self.conf_get(option).as_deref() == Some(default) {
                self.conf_set(option, ours)?;
            }
        }
        if self.conf_get("rados_osd_op_timeout").as_deref() == Some("0") {
            // A little longer than the watchdog, which then speaks first (naming the cluster
            // and the timeout); it still bounds every call the watchdog does not cover.
            let secs = ceph.io_timeout.unwrap_or(DEFAULT_RBD_TIMEOUT).as_secs() + 5;
            self.conf_set("rados_osd_op_timeout", &secs.to_string())?;
        }
        // rbd_cache is left as librbd, ceph.conf, CEPH_ARGS or the image's config set it
        // (Ceph 16: on, writearound): measured faster than off for fsync latency, bulk writes
        // and many small files (DESIGN §14.4), and nothing relies on it either way: every
        // ordering point waits for completions and then for a flush.
        // A broken lock fences its holder, whatever the cluster's default says (birch also
        // blocklists explicitly before it breaks a lock, so an image's own config cannot
        // turn this off either).
        self.conf_set("rbd_blocklist_on_break_lock", "true")?;
        Ok(())
    }

    /// This session's address (`rados_getaddrs`), or "" when librados cannot say.
    fn address_string(&self) -> String {
        let mut addrs: *mut c_char = std::ptr::null_mut();
        // SAFETY: a connected handle; librados stores a malloc'ed string in addrs.
        let rc = unsafe { ffi::rados_getaddrs(self.handle, &mut addrs) };
        if rc < 0 || addrs.is_null() {
            return String::new();
        }
        // SAFETY: a NUL-terminated string from librados, freed once after the copy.
        unsafe {
            let text = CStr::from_ptr(addrs).to_string_lossy().into_owned();
            libc::free(addrs.cast());
            text
        }
    }

    fn conf_set(&self, option: &str, value: &str) -> io::Result<()> {
        let (o, v) = (cstring(option, "option")?, cstring(value, "value")?);
        // SAFETY: a handle that has not connected; both strings outlive the call.
        let rc = unsafe { ffi::rados_conf_set(self.handle, o.as_ptr(), v.as_ptr()) };
        if rc < 0 {
            return Err(rc_error(rc.into(), format!("setting {option}={value}")));
        }
        Ok(())
    }

    fn conf_get(&self, option: &str) -> Option<String> {
        let o = cstring(option, "option").ok()?;
        let mut buf = [0 as c_char; 256];
        // SAFETY: the buffer and its length are valid for the call; librados NUL-terminates.
        let rc =
            unsafe { ffi::rados_conf_get(self.handle, o.as_ptr(), buf.as_mut_ptr(), buf.len()) };
        if rc < 0 {
            return None;
        }
        // SAFETY: librados wrote a NUL-terminated string into buf.
        Some(
            unsafe { CStr::from_ptr(buf.as_ptr()) }
                .to_string_lossy()
                .into_owned(),
        )
    }
}

/// Creates the image `spec` of `size_bytes` with the features birch needs set explicitly
/// (layering and exclusive-lock; a cluster's `rbd_default_features` may lack them). Returns
/// `Ok(false)` when an image of that name exists already (it is not touched).
pub fn create_image(spec: &RbdSpec, size_bytes: u64, ceph: &CephOptions) -> io::Result<bool> {
    if spec.snapshot.is_some() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{spec}: cannot make a filesystem on a snapshot"),
        ));
    }
    let cluster = Cluster::connect(spec, ceph)?;
    let name = cstring(&spec.image, "image name")?;
    let mut opts: ffi::rbd_image_options_t = std::ptr::null_mut();
    // SAFETY: creates an options object we destroy below.
    unsafe { ffi::rbd_image_options_create(&mut opts) };
    let features = ffi::RBD_FEATURE_LAYERING | ffi::RBD_FEATURE_EXCLUSIVE_LOCK;
    // SAFETY: a valid options object; the name outlives rbd_create4.
    let rc = unsafe {
        let rc = ffi::rbd_image_options_set_uint64(opts, ffi::RBD_IMAGE_OPTION_FEATURES, features);
        let rc = if rc < 0 {
            rc
        } else {
            ffi::rbd_create4(cluster.ioctx, name.as_ptr(), size_bytes, opts)
        };
        ffi::rbd_image_options_destroy(opts);
        rc
    };
    match rc {
        0 => Ok(true),
        rc if rc == -libc::EEXIST => Ok(false),
        rc => Err(rc_error(
            rc.into(),
            format!("{spec}: creating a {size_bytes}-byte image"),
        )),
    }
}

/// What the device, its lock monitor and its quiesce watch share.
struct Shared {
    spec: RbdSpec,
    state: Mutex<LockState>,
    events: Option<Arc<dyn DeviceEvents>>,
    /// This host's lock on the image. Missing after a takeover from a holder on this host
    /// (stopped, still holding it): the lock monitor takes it once that process is gone, so
    /// that `birch umount` here waits for this daemon's final commit.
    local: Mutex<Option<LocalLock>>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, LockState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Gives the device up for good (once): logs why and tells the user.
    fn lose(&self, why: String) {
        if !self.state().lose(&why) {
            // Lost already (the lock monitor, or another request, was first): this failing
            // request too is answered as lost once the user's shutdown has taken effect.
            if let Some(events) = &self.events {
                let until = Instant::now() + Duration::from_millis(500);
                while !events.lost_in_effect() && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            return;
        }
        log::error!(
            "{}: {why}; this client does no more I/O on the image and never takes its lock back: every request now fails with EIO",
            self.spec
        );
        if let Some(events) = self.events.clone() {
            // A thread of its own: the user may shut the filesystem down, which waits for I/O
            // in flight, this very request included. Its first step (refusing requests) is
            // waited for a moment, so this request is answered as lost too.
            let user = events.clone();
            let _ = std::thread::Builder::new()
                .name("birch-rbd-lost".into())
                .spawn(move || user.device_lost(&why));
            let until = Instant::now() + Duration::from_millis(500);
            while !events.lost_in_effect() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    /// Takes this host's lock if this device lacks it (after a takeover from a holder here)
    /// and its holder is gone.
    fn take_local_lock(&self) -> bool {
        let mut local = self.local.lock().unwrap_or_else(|e| e.into_inner());
        if local.is_none() {
            *local = LocalLock::acquire(&self.spec, false).ok();
        }
        local.is_some()
    }

    /// Ok unless the device is lost (or closed): then EIO with the reason.
    fn check(&self) -> io::Result<()> {
        self.state()
            .may_do_io()
            .map_err(|why| io::Error::other(format!("{}: {why}", self.spec)))
    }
}

/// One asynchronous request: its buffer (owned here, not by the caller: librbd aio cannot be
/// cancelled, so a request the watchdog gave up on may still fill or read it later) and its
/// result. The completion callback holds one reference until librbd calls it.
struct AioOp {
    buf: *mut u8,
    len: usize,
    result: Mutex<Option<isize>>,
    done: Condvar,
}

// SAFETY: the buffer is only touched by librbd (between submit and completion) and by the
// waiter after completion; the result is under its mutex.
unsafe impl Send for AioOp {}
// SAFETY: as above.
unsafe impl Sync for AioOp {}

impl AioOp {
    fn new(len: usize, data: Option<&[u8]>) -> AioOp {
        let mut buf = vec![0u8; len].into_boxed_slice();
        if let Some(data) = data {
            buf.copy_from_slice(data);
        }
        AioOp {
            buf: Box::into_raw(buf).cast::<u8>(),
            len,
            result: Mutex::new(None),
            done: Condvar::new(),
        }
    }
}

impl Drop for AioOp {
    fn drop(&mut self) {
        // SAFETY: the buffer came from Box::into_raw of a boxed slice of `len` bytes; the last
        // reference (after completion) frees it once.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.buf, self.len,
            )))
        };
    }
}

/// librbd's completion callback: records the result and drops the callback's reference.
unsafe extern "C" fn aio_done(c: ffi::rbd_completion_t, arg: *mut libc::c_void) {
    // SAFETY: `arg` is the reference `submit` gave up with Arc::into_raw, taken back once here.
    let op = unsafe { Arc::from_raw(arg.cast::<AioOp>().cast_const()) };
    // SAFETY: a completed completion, released once.
    let rc = unsafe {
        let rc = ffi::rbd_aio_get_return_value(c);
        ffi::rbd_aio_release(c);
        rc
    };
    *op.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(rc);
    op.done.notify_all();
}

#[derive(Clone, Copy, Debug)]
enum AioKind {
    Read,
    Write,
    Discard,
    Flush,
}

/// Most requests of one batch ([`BlockDevice::write_many`], [`BlockDevice::read_many`],
/// [`BlockDevice::discard`]) in flight at once: each holds a buffer of its own until it
/// completes.
const MAX_IN_FLIGHT: usize = 64;
/// Most bytes of one batch's reads or writes in flight at once.
const MAX_IN_FLIGHT_BYTES: usize = 64 << 20;

/// A submitted request: its op, when the watchdog gives up on it, and what it is (for errors).
struct InFlight {
    op: Arc<AioOp>,
    deadline: Instant,
    kind: AioKind,
    offset: u64,
    len: usize,
}

/// The quiesce watch's context: lives until the watch is gone (leaked when the device is
/// lost, like the image).
struct QuiesceCtx {
    image: usize,
    handle: AtomicU64,
    shared: Arc<Shared>,
    /// Held while answering librbd; false once the device is closing.
    open: Mutex<bool>,
}

unsafe extern "C" fn on_quiesce(arg: *mut libc::c_void) {
    // SAFETY: `arg` is the Arc<QuiesceCtx> the device keeps for the life of the watch; one
    // more reference for the thread below.
    let ctx = unsafe {
        Arc::increment_strong_count(arg.cast::<QuiesceCtx>().cast_const());
        Arc::from_raw(arg.cast::<QuiesceCtx>().cast_const())
    };
    // A librbd callback must not call librbd synchronously (a commit writes): answer from a
    // thread of our own.
    let _ = std::thread::Builder::new()
        .name("birch-rbd-quiesce".into())
        .spawn(move || {
            let result = match (&ctx.shared.events, ctx.shared.check()) {
                (_, Err(e)) => Err(e),
                (Some(events), Ok(())) => events.quiesce(),
                (None, Ok(())) => Ok(()),
            };
            let rc = match &result {
                Ok(()) => 0,
                Err(e) => {
                    log::warn!(
                        "{}: quiesce for a snapshot: commit failed: {e}",
                        ctx.shared.spec
                    );
                    -e.raw_os_error().unwrap_or(libc::EIO)
                }
            };
            let open = ctx.open.lock().unwrap_or_else(|e| e.into_inner());
            if *open {
                log::info!(
                    "{}: quiesced for a snapshot (committed first)",
                    ctx.shared.spec
                );
                // SAFETY: the image stays open while `open` is true (the device clears it,
                // under this mutex, before unwatching and closing).
                unsafe {
                    ffi::rbd_quiesce_complete(
                        ctx.image as ffi::rbd_image_t,
                        ctx.handle.load(Ordering::SeqCst),
                        rc,
                    )
                };
            }
        });
}

unsafe extern "C" fn on_unquiesce(_arg: *mut libc::c_void) {}

/// An RBD image opened as a [`BlockDevice`]. Closing (drop) removes the holder record,
/// releases the image lock, closes the image and disconnects, in that order; a lost device
/// (DESIGN §14.3) does none of that, since the cluster may not answer and the record is the
/// new holder's: it leaks its handles, for a process that is about to exit.
pub struct RbdDevice {
    image: ffi::rbd_image_t,
    spec: RbdSpec,
    size: u64,
    writable: bool,
    /// The watchdog: how long one request may take.
    timeout: Duration,
    /// Whether [`BlockDevice::discard`] reaches the image (`discard=off` turns it off).
    discard: bool,
    shared: Arc<Shared>,
    /// Dropping it stops the lock monitor; the monitor drops its sender when it ends.
    monitor_stop: Option<mpsc::Sender<()>>,
    monitor_done: Option<mpsc::Receiver<()>>,
    quiesce: Option<Arc<QuiesceCtx>>,
    counters: Counters,
    /// The flushes in flight ([`FlushesInFlight`]).
    flushes: FlushesInFlight,
    /// Bytes contiguous in one RADOS object (the object size, or the stripe unit when
    /// striped), once the layout check passed; 0 otherwise ([`BlockDevice::atomic_unit`]).
    object_unit: u64,
    /// Dropped after the image is closed, unless the device is lost.
    _cluster: ManuallyDrop<Cluster>,
}

// SAFETY: librbd's image handle serves concurrent calls from any thread (the image context
// has its own locks); the handle itself is only closed in Drop, with `&mut self`.
unsafe impl Send for RbdDevice {}
// SAFETY: as above.
unsafe impl Sync for RbdDevice {}

impl RbdDevice {
    /// Opens `spec`. Read-write and locked read-only modes take this host's lock and the
    /// image's exclusive lock before returning (so before the caller reads the superblock),
    /// refusing a live holder within a few seconds unless told to take over
    /// ([`CephOptions::takeover`]); `ReadOnlyUnlocked` opens read-only with no lock (and is
    /// the only mode a snapshot opens in). May do network I/O and block for the client
    /// timeouts, and for `takeover_wait`.
    pub fn open(spec: &RbdSpec, mode: OpenMode, options: &RbdOpenOptions) -> io::Result<RbdDevice> {
        let writable = matches!(mode, OpenMode::ReadWrite | OpenMode::ReadWriteWait);
        let locking = mode != OpenMode::ReadOnlyUnlocked;
        let wait = matches!(mode, OpenMode::ReadWriteWait | OpenMode::ReadOnlyWait);
        if locking && spec.snapshot.is_some() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("{spec}: a snapshot is read without the image lock: inspect it, check it with fsck --force, or mount it with -o ro"),
            ));
        }
        // This host first: a daemon here finishing its final commit is waited for (mount after
        // umount), before its cluster lock could refuse us. A takeover goes on to the image
        // lock: the holder here may be stopped, holding this host's lock too (then the lock
        // file is taken over with the image).
        let local = if locking {
            match LocalLock::acquire(spec, wait) {
                Ok(lock) => Some(lock),
                Err(e)
                    if e.kind() == io::ErrorKind::ResourceBusy
                        && options.ceph.takeover != Takeover::No =>
                {
                    None
                }
                // Held by a live process here: name it as the image metadata has it.
                Err(e) if e.kind() == io::ErrorKind::ResourceBusy => {
                    return Err(name_holder(spec, &options.ceph).unwrap_or(e))
                }
                Err(e) => return Err(e),
            }
        } else {
            None
        };
        let cluster = Cluster::connect(spec, &options.ceph)?;
        let image = open_image(&cluster, spec, locking)?;
        let shared = Arc::new(Shared {
            spec: spec.clone(),
            state: Mutex::new(LockState::Unlocked),
            events: options.events.clone(),
            local: Mutex::new(local),
        });
        let mut device = RbdDevice {
            image,
            spec: spec.clone(),
            size: 0,
            writable,
            timeout: options.ceph.io_timeout.unwrap_or(DEFAULT_RBD_TIMEOUT),
            discard: writable && options.ceph.discard.unwrap_or(true),
            shared,
            monitor_stop: None,
            monitor_done: None,
            quiesce: None,
            counters: Counters::default(),
            flushes: FlushesInFlight::default(),
            object_unit: 0,
            _cluster: ManuallyDrop::new(cluster),
        };
        device.size = device.query_u64("rbd_get_size", ffi::rbd_get_size)?;
        device.size -= device.size % birch_format::BLOCK_SIZE;
        let features = device.query_u64("rbd_get_features", ffi::rbd_get_features)?;
        match device.check_layout() {
            Ok(unit) => device.object_unit = unit,
            Err(why) => {
                if writable {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("{spec}: refusing to write: {why}"),
                    ));
                }
                log::warn!("{spec}: {why}");
            }
        }
        if !locking {
            return Ok(device);
        }
        if features & ffi::RBD_FEATURE_EXCLUSIVE_LOCK == 0 {
            if writable {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{spec}: the image lacks the exclusive-lock feature, so a second writer could not be fenced; enable it with: rbd feature enable {}/{} exclusive-lock", spec.pool, image_path(spec)),
                ));
            }
            log::warn!("{spec}: no exclusive-lock feature: reading without the image lock");
            return Ok(device);
        }
        let takeover_wait = options.ceph.takeover_wait.unwrap_or(DEFAULT_TAKEOVER_WAIT);
        device.take_lock(&options.holder, options.ceph.takeover, takeover_wait)?;
        // Taken over from a holder on this host: its lock file follows the image lock once
        // that process is gone (the lock monitor tries again).
        let _ = device.shared.take_local_lock();
        device.start_monitor();
        if writable {
            device.watch_quiesce();
        }
        Ok(device)
    }

    /// The spec this device was opened from.
    pub fn spec(&self) -> &RbdSpec {
        &self.spec
    }

    /// Starts the thread that asks the OSD every [`LOCK_CHECK_EVERY`] whether this client
    /// still holds the lock, and gives the device up when it does not (taken over, fenced) or
    /// when the cluster does not say within the OSD operation timeout.
    fn start_monitor(&mut self) {
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let shared = self.shared.clone();
        let image = self.image as usize;
        let spawned = std::thread::Builder::new()
            .name("birch-rbd-lock".into())
            .spawn(move || {
                let _done = done_tx;
                let mut last_check = Instant::now();
                loop {
                    // Waiting for this host's lock after a takeover: poll it often, so that an
                    // unmount here right after the old holder exits still waits for us.
                    let has_local = shared.take_local_lock();
                    let tick = if has_local {
                        LOCK_CHECK_EVERY.saturating_sub(last_check.elapsed())
                    } else {
                        Duration::from_millis(20)
                    };
                    if let Err(mpsc::RecvTimeoutError::Disconnected) = stop_rx.recv_timeout(tick) {
                        return;
                    }
                    if shared.state().is_lost() {
                        return;
                    }
                    if last_check.elapsed() < LOCK_CHECK_EVERY {
                        continue;
                    }
                    last_check = Instant::now();
                    let mut owner: c_int = 0;
                    // SAFETY: the image is open until the device stops this thread (or, lost,
                    // never closes it).
                    let rc = unsafe {
                        ffi::rbd_is_exclusive_lock_owner(image as ffi::rbd_image_t, &mut owner)
                    };
                    if rc < 0 {
                        shared.lose(format!(
                            "checking the image lock with the cluster failed: {}",
                            io::Error::from_raw_os_error(-rc)
                        ));
                        return;
                    }
                    if owner == 0 {
                        shared.lose("the image lock is no longer ours (taken over by another client, or this client was fenced)".into());
                        return;
                    }
                }
            });
        if spawned.is_ok() {
            self.monitor_stop = Some(stop_tx);
            self.monitor_done = Some(done_rx);
        } else {
            log::warn!("{}: cannot start the lock monitor thread", self.spec);
        }
    }

    /// Registers the quiesce watch (`rbd snap create` of the mounted image gets a committed
    /// state); a failure is only logged.
    fn watch_quiesce(&mut self) {
        let ctx = Arc::new(QuiesceCtx {
            image: self.image as usize,
            handle: AtomicU64::new(0),
            shared: self.shared.clone(),
            open: Mutex::new(true),
        });
        let mut handle = 0u64;
        // SAFETY: an open image; `ctx` outlives the watch (kept in the device, unwatched in
        // Drop, or leaked with a lost device).
        let rc = unsafe {
            ffi::rbd_quiesce_watch(
                self.image,
                Some(on_quiesce),
                Some(on_unquiesce),
                Arc::as_ptr(&ctx).cast_mut().cast(),
                &mut handle,
            )
        };
        if rc < 0 {
            log::warn!(
                "{}: rbd_quiesce_watch: {} (snapshots of the mounted image get a crash-consistent state, not a committed one)",
                self.spec,
                io::Error::from_raw_os_error(-rc)
            );
            return;
        }
        ctx.handle.store(handle, Ordering::SeqCst);
        self.quiesce = Some(ctx);
    }

    /// One request: submitted with `rbd_aio_*`, waited for with the watchdog. Any failure
    /// gives the device up. Returns the request's buffer and librbd's result.
    fn submit(
        &self,
        kind: AioKind,
        offset: u64,
        len: usize,
        data: Option<&[u8]>,
    ) -> io::Result<Arc<AioOp>> {
        let request = self.start(kind, offset, len, data)?;
        self.wait(&request)?;
        Ok(request.op)
    }

    /// Submits requests of `kind` (writes with their bytes, reads and discards with `data`
    /// None and a length) all before waiting for any, at most [`MAX_IN_FLIGHT`] requests and
    /// [`MAX_IN_FLIGHT_BYTES`] of read or write buffers at a time, each under the watchdog;
    /// returns once all completed, having called `done(index, op)` for each request as it is
    /// found complete (a read's bytes are in `op`'s buffer then). The first failure gives the
    /// device up (as one request's does) and is returned at once: the requests still in
    /// flight are never waited for, nor retried (their buffers stay with librbd's callbacks
    /// until they complete, so a late read fills a buffer of its own, never the caller's).
    fn submit_many(
        &self,
        kind: AioKind,
        requests: &[(u64, usize, Option<&[u8]>)],
        mut done: impl FnMut(usize, &AioOp),
    ) -> io::Result<()> {
        let buffered = matches!(kind, AioKind::Read | AioKind::Write);
        let mut in_flight: std::collections::VecDeque<(usize, InFlight)> =
            std::collections::VecDeque::with_capacity(requests.len().min(MAX_IN_FLIGHT));
        let mut bytes = 0usize;
        for (index, &(offset, len, data)) in requests.iter().enumerate() {
            while in_flight.len() >= MAX_IN_FLIGHT
                || (buffered && !in_flight.is_empty() && bytes + len > MAX_IN_FLIGHT_BYTES)
            {
                let Some((n, oldest)) = in_flight.pop_front() else {
                    break;
                };
                self.wait(&oldest)?;
                done(n, &oldest.op);
                if buffered {
                    bytes -= oldest.len;
                }
            }
            in_flight.push_back((index, self.start(kind, offset, len, data)?));
            if buffered {
                bytes += len;
            }
        }
        for (n, request) in &in_flight {
            self.wait(request)?;
            done(*n, &request.op);
        }
        Ok(())
    }

    /// What a request is, for its errors.
    fn describe(kind: AioKind, offset: u64, len: usize) -> String {
        match kind {
            AioKind::Read => format!("read at {offset:#x} length {len}"),
            AioKind::Write => format!("write at {offset:#x} length {len}"),
            AioKind::Discard => format!("discard at {offset:#x} length {len}"),
            AioKind::Flush => "flush".to_string(),
        }
    }

    /// Submits one request with `rbd_aio_*` (a write copies `data` into a buffer of its own
    /// first). A failed submission gives the device up.
    fn start(
        &self,
        kind: AioKind,
        offset: u64,
        len: usize,
        data: Option<&[u8]>,
    ) -> io::Result<InFlight> {
        self.shared.check()?;
        // A discard carries no bytes: its buffer is empty.
        let buf_len = if matches!(kind, AioKind::Discard) {
            0
        } else {
            len
        };
        let op = Arc::new(AioOp::new(buf_len, data));
        let arg = Arc::into_raw(op.clone()).cast_mut().cast::<libc::c_void>();
        let mut c: ffi::rbd_completion_t = std::ptr::null_mut();
        // SAFETY: `arg` is one reference to `op`, given to the callback (or taken back below
        // if nothing was submitted); the buffer lives as long as `op`.
        let rc = unsafe {
            let rc = ffi::rbd_aio_create_completion(arg, Some(aio_done), &mut c);
            if rc < 0 {
                drop(Arc::from_raw(arg.cast::<AioOp>().cast_const()));
                rc
            } else {
                let rc = match kind {
                    AioKind::Read => ffi::rbd_aio_read(self.image, offset, len, op.buf.cast(), c),
                    AioKind::Write => {
                        ffi::rbd_aio_write(self.image, offset, len, op.buf.cast_const().cast(), c)
                    }
                    AioKind::Discard => ffi::rbd_aio_discard(self.image, offset, len as u64, c),
                    AioKind::Flush => ffi::rbd_aio_flush(self.image, c),
                };
                if rc < 0 {
                    ffi::rbd_aio_release(c);
                    drop(Arc::from_raw(arg.cast::<AioOp>().cast_const()));
                }
                rc
            }
        };
        if rc < 0 {
            return Err(self.failed(rc.into(), &Self::describe(kind, offset, len)));
        }
        Ok(InFlight {
            op,
            deadline: Instant::now() + self.timeout,
            kind,
            offset,
            len,
        })
    }

    /// Waits for a submitted request, until its watchdog deadline. Any failure gives the
    /// device up.
    fn wait(&self, request: &InFlight) -> io::Result<()> {
        let InFlight {
            op,
            deadline,
            kind,
            offset,
            len,
        } = request;
        let (deadline, kind, offset, len) = (*deadline, *kind, *offset, *len);
        let mut result = op.result.lock().unwrap_or_else(|e| e.into_inner());
        let rc = loop {
            if let Some(rc) = *result {
                break rc;
            }
            let now = Instant::now();
            if now >= deadline {
                drop(result);
                let why = format!(
                    "the Ceph cluster did not answer a {} within {} s (rbd_timeout); it may still land",
                    Self::describe(kind, offset, len),
                    self.timeout.as_secs()
                );
                self.shared.lose(why.clone());
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{}: {why}", self.spec),
                ));
            }
            // Given up meanwhile (another request timed out, the lock was lost): this one
            // stops waiting too, so a shutdown or an unmount does not wait out its timeout.
            if self.shared.state().is_lost() {
                drop(result);
                return Err(self
                    .shared
                    .check()
                    .err()
                    .unwrap_or_else(|| io::Error::other(format!("{}: lost", self.spec))));
            }
            result = op
                .done
                .wait_timeout(result, (deadline - now).min(LOST_POLL))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        drop(result);
        if rc < 0 {
            return Err(self.failed(rc as i64, &Self::describe(kind, offset, len)));
        }
        if matches!(kind, AioKind::Read) && rc as usize != len {
            return Err(self.failed(
                -i64::from(libc::EIO),
                &format!("{} (short: {rc})", Self::describe(kind, offset, len)),
            ));
        }
        Ok(())
    }

    /// The error of a failed request, after giving the device up: a failed write or flush may
    /// have lost acknowledged data, and a fenced client (-EBLOCKLISTED) must not serve reads.
    fn failed(&self, rc: i64, what: &str) -> io::Error {
        let err = rc_error(rc, format!("{}: {what}", self.spec));
        self.shared.lose(if rc == -i64::from(libc::ESHUTDOWN) {
            format!("{what}: this client is blocklisted (fenced by a takeover): {err}")
        } else if rc == -i64::from(libc::ETIMEDOUT) {
            format!("the Ceph cluster did not answer a {what} (rados_osd_op_timeout): {err}")
        } else {
            format!("{what} failed: {err}")
        });
        err
    }

    fn query_u64(
        &self,
        what: &str,
        call: unsafe extern "C" fn(ffi::rbd_image_t, *mut u64) -> c_int,
    ) -> io::Result<u64> {
        let mut value = 0u64;
        // SAFETY: an open image; the call writes one u64 we own.
        let rc = unsafe { call(self.image, &mut value) };
        if rc < 0 {
            return Err(rc_error(rc.into(), format!("{}: {what}", self.spec)));
        }
        Ok(value)
    }

    /// Checks the image's layout (`check_rbd_layout`); returns the bytes contiguous in one
    /// object.
    fn check_layout(&self) -> Result<u64, String> {
        // SAFETY: rbd_image_info_t is plain old data; all-zero is a valid value.
        let mut info: ffi::rbd_image_info_t = unsafe { std::mem::zeroed() };
        // SAFETY: an open image; rbd_stat fills the struct whose size we pass.
        let rc = unsafe {
            ffi::rbd_stat(
                self.image,
                &mut info,
                std::mem::size_of::<ffi::rbd_image_info_t>(),
            )
        };
        if rc < 0 {
            return Err(rc_error(rc.into(), "rbd_stat").to_string());
        }
        let unit = self
            .query_u64("rbd_get_stripe_unit", ffi::rbd_get_stripe_unit)
            .map_err(|e| e.to_string())?;
        let count = self
            .query_u64("rbd_get_stripe_count", ffi::rbd_get_stripe_count)
            .map_err(|e| e.to_string())?;
        check_rbd_layout(info.obj_size, unit, count)
    }

    /// Lists the lock owners; refuses a live one unless told to take over (DESIGN §14.3);
    /// takes the exclusive lock and records who holds it.
    fn take_lock(&mut self, holder: &str, takeover: Takeover, wait: Duration) -> io::Result<()> {
        let spec = self.spec.clone();
        let owners = self.lock_owners()?;
        if let Some(owner) = owners.first() {
            let record = self.metadata_get(HOLDER_KEY).ok().flatten();
            let record = record.as_deref().map(HolderRecord::parse);
            let record = record.filter(|r| r.is_owner(owner));
            let who = match &record {
                Some(r) => format!("{owner}: {}", r.describe()),
                None => format!("{owner} (no {HOLDER_KEY} record)"),
            };
            let (mode, wait) = match takeover {
                Takeover::No => match &record {
                    Some(r) if r.is_gone_from_this_host() => {
                        eprintln!(
                            "{spec}: the previous holder ({}) is gone; waiting for its watch to expire (about 30 s) before taking the lock",
                            r.describe()
                        );
                        (Takeover::Wait, DEAD_HOLDER_WAIT)
                    }
                    _ => return Err(in_use(&spec, owner, record.as_ref())),
                },
                mode => (mode, wait),
            };
            if mode == Takeover::Wait {
                eprintln!(
                    "{spec}: takeover: waiting up to {} s for the holder {who} to stop answering (its watch on the image expires osd_client_watch_timeout, 30 s by default, after its last ping)",
                    wait.as_secs()
                );
                match self.wait_for_silence(owner, wait)? {
                    Silence::Released => {}
                    Silence::Gone => self.fence(owner, &who)?,
                    Silence::Answering => {
                        return Err(io::Error::new(
                            io::ErrorKind::ResourceBusy,
                            format!(
                                "{spec}: the holder {who} still answers after {} s: it is alive. Unmount it there; if it must stop writing now, mount with -o takeover=force (this blocklists it: the cluster refuses its writes)",
                                wait.as_secs()
                            ),
                        ))
                    }
                    Silence::Other(new_owner) => {
                        return Err(in_use(&spec, &new_owner, None));
                    }
                }
            } else {
                eprintln!("{spec}: takeover=force: fencing the holder {who} without waiting");
                self.fence(owner, &who)?;
            }
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            // SAFETY: an open image.
            let rc = unsafe { ffi::rbd_lock_acquire(self.image, ffi::RBD_LOCK_MODE_EXCLUSIVE) };
            if rc == 0 {
                break;
            }
            if rc != -libc::EROFS || Instant::now() >= deadline {
                if rc == -libc::EROFS {
                    // Someone took it between our listing and our request: name them.
                    let owner = self.lock_owners().ok().and_then(|o| o.into_iter().next());
                    let record = self.metadata_get(HOLDER_KEY).ok().flatten();
                    let record = record.as_deref().map(HolderRecord::parse);
                    return Err(in_use(
                        &spec,
                        owner.as_deref().unwrap_or("another client"),
                        record.as_ref(),
                    ));
                }
                return Err(rc_error(rc.into(), format!("{spec}: rbd_lock_acquire")));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        self.shared
            .state()
            .acquired()
            .map_err(|e| io::Error::other(format!("{spec}: {e}")))?;
        let record = HolderRecord {
            client: self._cluster.client.clone(),
            address: self._cluster.address.clone(),
            host: hostname(),
            pid: std::process::id(),
            since_secs: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            holder: holder.to_string(),
        };
        self.metadata_set(HOLDER_KEY, &record.to_string())
    }

    /// Waits, for at most `wait`, until the lock owner `owner` stops answering: its watch on
    /// the image header is gone (the OSDs drop a watch that has not pinged for
    /// `osd_client_watch_timeout`). Also ends when the lock is released or changes hands.
    fn wait_for_silence(&self, owner: &str, wait: Duration) -> io::Result<Silence> {
        let deadline = Instant::now() + wait;
        loop {
            match self.lock_owners()?.into_iter().next() {
                None => return Ok(Silence::Released),
                Some(o) if o != owner => return Ok(Silence::Other(o)),
                Some(_) => {}
            }
            let watchers = self.watchers()?;
            if !watchers.iter().any(|w| same_address(w, owner)) {
                return Ok(Silence::Gone);
            }
            if Instant::now() >= deadline {
                return Ok(Silence::Answering);
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// Fences the lock owner `owner` and breaks its lock: blocklists its address first (the
    /// OSDs then refuse its every operation for Ceph's default blocklist time, one hour,
    /// whatever its librbd believes), then `rbd_lock_break`.
    fn fence(&self, owner: &str, who: &str) -> io::Result<()> {
        let spec = &self.spec;
        let mut address = cstring(owner, "lock owner address")?.into_bytes_with_nul();
        // SAFETY: a connected cluster handle; the address is NUL-terminated and outlives the
        // call (librados takes it as char * but does not keep it).
        let rc = unsafe {
            ffi::rados_blocklist_add(self._cluster.handle, address.as_mut_ptr().cast(), 0)
        };
        if rc < 0 {
            return Err(rc_error(
                rc.into(),
                format!("{spec}: takeover: blocklisting the holder {who} (needs the mon capability `osd blocklist`, part of `profile rbd`)"),
            ));
        }
        let owner_c = cstring(owner, "lock owner address")?;
        // SAFETY: an open image; the owner string outlives the call.
        let rc = unsafe {
            ffi::rbd_lock_break(self.image, ffi::RBD_LOCK_MODE_EXCLUSIVE, owner_c.as_ptr())
        };
        if rc < 0 && rc != -libc::ENOENT {
            return Err(rc_error(
                rc.into(),
                format!("{spec}: takeover: breaking the lock of {who}"),
            ));
        }
        eprintln!(
            "{spec}: takeover: blocklisted {owner} (it can no longer write to the cluster) and broke its lock"
        );
        log::warn!("{spec}: took the image over from {who}: blocklisted and lock broken");
        Ok(())
    }

    /// The addresses watching the image header (every client with the image open).
    fn watchers(&self) -> io::Result<Vec<String>> {
        const MAX_WATCHERS: usize = 64;
        // SAFETY: rbd_image_watcher_t is plain data; all-zero is a valid value.
        let mut list: Vec<ffi::rbd_image_watcher_t> = (0..MAX_WATCHERS)
            .map(|_| unsafe { std::mem::zeroed() })
            .collect();
        let mut count: libc::size_t = MAX_WATCHERS;
        // SAFETY: an open image; the array has room for `count` entries, given back through
        // rbd_watchers_list_cleanup.
        let rc = unsafe { ffi::rbd_watchers_list(self.image, list.as_mut_ptr(), &mut count) };
        if rc < 0 {
            return Err(rc_error(
                rc.into(),
                format!("{}: rbd_watchers_list", self.spec),
            ));
        }
        let count = count.min(MAX_WATCHERS);
        let addrs = list[..count]
            .iter()
            .filter(|w| !w.addr.is_null())
            // SAFETY: librbd filled NUL-terminated strings in the first `count` entries.
            .map(|w| {
                unsafe { CStr::from_ptr(w.addr) }
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        // SAFETY: the entries librbd filled, given back once.
        unsafe { ffi::rbd_watchers_list_cleanup(list.as_mut_ptr(), count) };
        Ok(addrs)
    }

    fn lock_owners(&self) -> io::Result<Vec<String>> {
        const MAX_OWNERS: usize = 8;
        let mut mode: c_int = 0;
        let mut owners: [*mut c_char; MAX_OWNERS] = [std::ptr::null_mut(); MAX_OWNERS];
        let mut count: libc::size_t = MAX_OWNERS;
        // SAFETY: an open image; the array has room for `count` pointers, which librbd fills
        // with strings we give back through rbd_lock_get_owners_cleanup.
        let rc = unsafe {
            ffi::rbd_lock_get_owners(self.image, &mut mode, owners.as_mut_ptr(), &mut count)
        };
        if rc == -libc::ENOENT {
            return Ok(Vec::new());
        }
        if rc < 0 {
            return Err(rc_error(
                rc.into(),
                format!("{}: rbd_lock_get_owners", self.spec),
            ));
        }
        let count = count.min(MAX_OWNERS);
        let names = owners[..count]
            .iter()
            .filter(|p| !p.is_null())
            // SAFETY: librbd returned NUL-terminated strings in the first `count` slots.
            .map(|p| unsafe { CStr::from_ptr(*p) }.to_string_lossy().into_owned())
            .collect();
        // SAFETY: the pointers librbd returned, given back once.
        unsafe { ffi::rbd_lock_get_owners_cleanup(owners.as_mut_ptr(), count) };
        Ok(names)
    }

    fn metadata_get(&self, key: &str) -> io::Result<Option<String>> {
        let k = cstring(key, "metadata key")?;
        let mut buf = vec![0 as c_char; 1024];
        let mut len: libc::size_t = buf.len();
        // SAFETY: an open image; the buffer and its length are valid for the call.
        let rc =
            unsafe { ffi::rbd_metadata_get(self.image, k.as_ptr(), buf.as_mut_ptr(), &mut len) };
        if rc == -libc::ENOENT {
            return Ok(None);
        }
        if rc < 0 {
            return Err(rc_error(
                rc.into(),
                format!("{}: metadata {key}", self.spec),
            ));
        }
        let bytes: Vec<u8> = buf
            .iter()
            .take(len.min(buf.len()))
            .take_while(|c| **c != 0)
            .map(|c| *c as u8)
            .collect();
        Ok(Some(String::from_utf8_lossy(&bytes).into_owned()))
    }

    fn metadata_set(&self, key: &str, value: &str) -> io::Result<()> {
        let (k, v) = (
            cstring(key, "metadata key")?,
            cstring(value, "metadata value")?,
        );
        // SAFETY: an open image; both strings outlive the call.
        let rc = unsafe { ffi::rbd_metadata_set(self.image, k.as_ptr(), v.as_ptr()) };
        if rc < 0 {
            return Err(rc_error(
                rc.into(),
                format!("{}: setting metadata {key}", self.spec),
            ));
        }
        Ok(())
    }
}

/// The "in use" error naming the current lock owner and its `birch.holder` record, read
/// through an open that neither writes nor locks (read-write, since librbd turns the lock
/// feature off, owners included, in a read-only open); `None` when there is no owner or the
/// cluster cannot say.
fn name_holder(spec: &RbdSpec, ceph: &CephOptions) -> Option<io::Error> {
    let cluster = Cluster::connect(spec, ceph).ok()?;
    let image = open_image(&cluster, spec, true).ok()?;
    let device = RbdDevice {
        image,
        spec: spec.clone(),
        size: 0,
        writable: false,
        timeout: DEFAULT_RBD_TIMEOUT,
        discard: false,
        shared: Arc::new(Shared {
            spec: spec.clone(),
            state: Mutex::new(LockState::Unlocked),
            events: None,
            local: Mutex::new(None),
        }),
        monitor_stop: None,
        monitor_done: None,
        quiesce: None,
        counters: Counters::default(),
        flushes: FlushesInFlight::default(),
        object_unit: 0,
        _cluster: ManuallyDrop::new(cluster),
    };
    let owner = device.lock_owners().ok()?.into_iter().next()?;
    let record = device.metadata_get(HOLDER_KEY).ok().flatten();
    let record = record.as_deref().map(HolderRecord::parse);
    Some(in_use(spec, &owner, record.as_ref()))
}

fn image_path(spec: &RbdSpec) -> String {
    if spec.namespace.is_empty() {
        spec.image.clone()
    } else {
        format!("{}/{}", spec.namespace, spec.image)
    }
}

fn open_image(cluster: &Cluster, spec: &RbdSpec, writable: bool) -> io::Result<ffi::rbd_image_t> {
    let name = cstring(&spec.image, "image name")?;
    let snap = spec
        .snapshot
        .as_deref()
        .map(|s| cstring(s, "snapshot name"))
        .transpose()?;
    let snap_ptr = snap.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
    let mut image: ffi::rbd_image_t = std::ptr::null_mut();
    // SAFETY: a valid I/O context; name and snapshot outlive the call; image is written.
    let rc = unsafe {
        if writable {
            ffi::rbd_open(cluster.ioctx, name.as_ptr(), &mut image, snap_ptr)
        } else {
            ffi::rbd_open_read_only(cluster.ioctx, name.as_ptr(), &mut image, snap_ptr)
        }
    };
    if rc == -libc::ENOENT {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("{spec}: no such image (birch mkfs {spec} --size SIZE creates one)"),
        ));
    }
    if rc < 0 {
        return Err(rc_error(rc.into(), format!("{spec}: rbd_open")));
    }
    Ok(image)
}

fn in_use(spec: &RbdSpec, owner: &str, record: Option<&HolderRecord>) -> io::Error {
    let who = match record {
        Some(r) => format!("{owner}: {}", r.describe()),
        None => format!("{owner}, not a birch process (no {HOLDER_KEY} record)"),
    };
    io::Error::new(
        io::ErrorKind::ResourceBusy,
        format!(
            "{spec}: image is in use by {who}. Unmount it there first. If that holder is dead or hangs, mount with -o takeover (waits until it no longer answers, then blocklists it and breaks its lock) or -o takeover=force (at once, even if it still answers)"
        ),
    )
}

/// What `birch.holder` records: the lock owner's client name, host, pid, start time and use.
#[derive(Debug, Clone, PartialEq, Eq)]
struct HolderRecord {
    client: String,
    /// The session address librbd names the owner by.
    address: String,
    host: String,
    pid: u32,
    since_secs: u64,
    holder: String,
}

impl std::fmt::Display for HolderRecord {
    /// `client=client.N host=H pid=P since=SECS use=TEXT` (the use last: it may hold spaces).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "client={} address={} host={} pid={} since={} use={}",
            self.client, self.address, self.host, self.pid, self.since_secs, self.holder
        )
    }
}

impl HolderRecord {
    fn parse(text: &str) -> HolderRecord {
        let (head, holder) = text.split_once(" use=").unwrap_or((text, ""));
        let field = |name: &str| {
            head.split(' ')
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                .unwrap_or("")
                .to_string()
        };
        HolderRecord {
            client: field("client"),
            address: field("address"),
            host: field("host"),
            pid: field("pid").parse().unwrap_or(0),
            since_secs: field("since").parse().unwrap_or(0),
            holder: holder.to_string(),
        }
    }

    /// Whether this record is about the lock owner `owner` (an address, as
    /// `rbd_lock_get_owners` gives it; a record left by an earlier holder is not).
    fn is_owner(&self, owner: &str) -> bool {
        !self.address.is_empty()
            && (owner == self.address
                || owner.contains(&self.address)
                || self.address.contains(owner))
    }

    fn describe(&self) -> String {
        format!(
            "{} ({}) on host {} pid {} since {} (unix time)",
            if self.holder.is_empty() {
                "birch"
            } else {
                &self.holder
            },
            self.client,
            self.host,
            self.pid,
            self.since_secs
        )
    }

    /// Whether the holder ran on this host and its process is gone (a crash or kill -9): then
    /// nothing can still write through it, and waiting out its watch is safe.
    fn is_gone_from_this_host(&self) -> bool {
        if self.host != hostname() || self.pid == 0 {
            return false;
        }
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", self.pid));
        !cmdline.is_ok_and(|c| c.windows(5).any(|w| w == b"birch"))
    }
}

/// How a wait for a lock owner to stop answering ended.
#[derive(Debug, PartialEq, Eq)]
enum Silence {
    /// Its watch is gone: it answers no more (stopped, dead, or cut off).
    Gone,
    /// It released the lock.
    Released,
    /// Another client holds the lock now.
    Other(String),
    /// It still watches the image: alive.
    Answering,
}

/// Whether a watcher's address and a lock owner's address name one client session. Both are
/// librados entity addresses (`IP:PORT/NONCE`, maybe with a `v1:`/`v2:` prefix); the nonce
/// tells sessions of one host apart.
fn same_address(watcher: &str, owner: &str) -> bool {
    let bare = |a: &str| -> Vec<String> {
        a.trim()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .split(',')
            .map(|one| {
                let one = one.trim();
                one.strip_prefix("v2:")
                    .or_else(|| one.strip_prefix("v1:"))
                    .unwrap_or(one)
                    .to_string()
            })
            .filter(|one| !one.is_empty())
            .collect()
    };
    let owners = bare(owner);
    bare(watcher).iter().any(|w| owners.contains(w))
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

impl Drop for RbdDevice {
    fn drop(&mut self) {
        // Stop the lock monitor first (it uses the image); a lost device does not wait for
        // it, nor for anything else that may need the cluster.
        drop(self.monitor_stop.take());
        let lost = self.shared.state().is_lost();
        if let Some(done) = self.monitor_done.take() {
            // The monitor never sends: its end drops the sender (Disconnected). Still in a
            // librbd call past the watchdog's time: the cluster is gone, and the image must not
            // be closed under that call (the device is given up and leaks it, below).
            if !lost
                && matches!(
                    done.recv_timeout(self.timeout),
                    Err(mpsc::RecvTimeoutError::Timeout)
                )
            {
                self.shared.lose(format!(
                    "the Ceph cluster did not answer the lock check within {} s (rbd_timeout) at close",
                    self.timeout.as_secs()
                ));
            }
        }
        if let Some(ctx) = &self.quiesce {
            *ctx.open.lock().unwrap_or_else(|e| e.into_inner()) = false;
        }
        let state = self.shared.state().clone();
        if let LockState::Lost(why) = state {
            // The record is the new holder's (or the cluster does not answer), rbd_close and
            // rados_shutdown could block: leak the handles (and the quiesce context) for a
            // process that is about to exit. This host's lock is released (below, by drop).
            log::warn!(
                "{}: closing without touching the cluster (the device was given up: {why})",
                self.spec
            );
            if let Some(ctx) = self.quiesce.take() {
                std::mem::forget(ctx);
            }
            drop(
                self.shared
                    .local
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take(),
            );
            return;
        }
        // SAFETY: the image is open until rbd_close here; nothing uses it after (the monitor
        // ended or was never started; the quiesce watch is removed first).
        unsafe {
            if let Some(ctx) = &self.quiesce {
                let rc = ffi::rbd_quiesce_unwatch(self.image, ctx.handle.load(Ordering::SeqCst));
                if rc < 0 {
                    log::warn!(
                        "{}: rbd_quiesce_unwatch: {}",
                        self.spec,
                        io::Error::from_raw_os_error(-rc)
                    );
                }
            }
            if state == LockState::Held {
                if let Ok(key) = CString::new(HOLDER_KEY) {
                    ffi::rbd_metadata_remove(self.image, key.as_ptr());
                }
                let rc = ffi::rbd_lock_release(self.image);
                if rc < 0 {
                    log::warn!(
                        "{}: releasing the image lock: {}",
                        self.spec,
                        io::Error::from_raw_os_error(-rc)
                    );
                }
                self.shared.state().released();
            }
            let rc = ffi::rbd_close(self.image);
            if rc < 0 {
                log::warn!(
                    "{}: rbd_close: {}",
                    self.spec,
                    io::Error::from_raw_os_error(-rc)
                );
            }
            // The image is closed: disconnect.
            ManuallyDrop::drop(&mut self._cluster);
        }
        drop(
            self.shared
                .local
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
    }
}

impl BlockDevice for RbdDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_range(offset, buf.len(), self.size)?;
        self.counters.add(|c| &c.device_reads, 1);
        let op = self.submit(AioKind::Read, offset, buf.len(), None)?;
        // SAFETY: the request completed, so librbd no longer touches the buffer, which holds
        // `buf.len()` bytes.
        buf.copy_from_slice(unsafe { std::slice::from_raw_parts(op.buf, op.len) });
        Ok(())
    }

    fn read_many(&self, reads: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        for (offset, buf) in reads.iter() {
            check_range(*offset, buf.len(), self.size)?;
        }
        self.counters.add(|c| &c.device_reads, reads.len() as u64);
        let requests: Vec<(u64, usize, Option<&[u8]>)> = reads
            .iter()
            .map(|(offset, buf)| (*offset, buf.len(), None))
            .collect();
        self.submit_many(AioKind::Read, &requests, |n, op| {
            // SAFETY: the request completed, so librbd no longer touches its buffer, which
            // holds `op.len` bytes: the length of read `n`.
            reads[n]
                .1
                .copy_from_slice(unsafe { std::slice::from_raw_parts(op.buf, op.len) });
        })
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        check_range(offset, buf.len(), self.size)?;
        if !self.writable {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "{}: write at {offset:#x}: image opened read-only",
                    self.spec
                ),
            ));
        }
        self.counters.add(|c| &c.device_writes, 1);
        self.counters.add(|c| &c.bytes_written, buf.len() as u64);
        self.submit(AioKind::Write, offset, buf.len(), Some(buf))?;
        Ok(())
    }

    fn write_many(&self, writes: &[(u64, &[u8])]) -> io::Result<()> {
        for (offset, bytes) in writes {
            check_range(*offset, bytes.len(), self.size)?;
        }
        if !self.writable {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{}: write: image opened read-only", self.spec),
            ));
        }
        let total: usize = writes.iter().map(|(_, b)| b.len()).sum();
        self.counters.add(|c| &c.device_writes, writes.len() as u64);
        self.counters.add(|c| &c.bytes_written, total as u64);
        let requests: Vec<(u64, usize, Option<&[u8]>)> = writes
            .iter()
            .map(|(offset, bytes)| (*offset, bytes.len(), Some(*bytes)))
            .collect();
        self.submit_many(AioKind::Write, &requests, |_, _| {})
    }

    fn discard(&self, ranges: &[(u64, u64)]) -> io::Result<()> {
        if !self.discard {
            return Ok(());
        }
        self.trim(ranges)
    }

    fn can_trim(&self) -> bool {
        self.writable
    }

    fn trim(&self, ranges: &[(u64, u64)]) -> io::Result<()> {
        for (offset, len) in ranges {
            check_range(*offset, *len as usize, self.size)?;
        }
        if !self.writable {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{}: discard: image opened read-only", self.spec),
            ));
        }
        let requests: Vec<(u64, usize, Option<&[u8]>)> = ranges
            .iter()
            .map(|(offset, len)| (*offset, *len as usize, None))
            .collect();
        self.submit_many(AioKind::Discard, &requests, |_, _| {})
    }

    fn flush(&self) -> io::Result<()> {
        self.counters.add(|c| &c.flushes, 1);
        let seq = self.flushes.begin();
        let result = self.submit(AioKind::Flush, 0, 0, None);
        let upto = self.flushes.end(seq);
        result?;
        // A flush beside this one may have taken the error of a write before this one
        // (`FlushesInFlight`): wait for the earlier ones, then ask whether the device is
        // still good.
        self.flushes
            .wait_before(upto, LOST_POLL, || self.shared.state().is_lost());
        self.shared.check()
    }

    fn size_bytes(&self) -> u64 {
        self.size
    }

    fn atomic_unit(&self) -> u64 {
        self.object_unit
    }

    fn write_error_is_fatal(&self) -> bool {
        true
    }

    fn counters(&self) -> &Counters {
        &self.counters
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holder_records_round_trip_with_spaces_in_the_use() {
        let r = HolderRecord {
            client: "client.4242".into(),
            address: "127.0.0.1:0/2392921740".into(),
            host: "node-a".into(),
            pid: 77,
            since_secs: 1_800_000_000,
            holder: "mount at /mnt/my data".into(),
        };
        assert_eq!(HolderRecord::parse(&r.to_string()), r);
        let d = r.describe();
        assert!(
            d.contains("node-a") && d.contains("pid 77") && d.contains("/mnt/my data"),
            "{d}"
        );
        assert!(r.is_owner("127.0.0.1:0/2392921740"));
        assert!(!r.is_owner("127.0.0.1:0/1"));
    }

    #[test]
    fn watcher_and_owner_addresses_match_by_session() {
        assert!(same_address(
            "127.0.0.1:0/3215528417",
            "127.0.0.1:0/3215528417"
        ));
        assert!(same_address(
            "v2:127.0.0.1:0/3215528417",
            "127.0.0.1:0/3215528417"
        ));
        assert!(same_address(
            "[v2:10.0.0.5:0/77,v1:10.0.0.5:0/77]",
            "10.0.0.5:0/77"
        ));
        assert!(!same_address("127.0.0.1:0/1", "127.0.0.1:0/2"));
        // One nonce a prefix of another is another session.
        assert!(!same_address("127.0.0.1:0/123", "127.0.0.1:0/12"));
        assert!(!same_address("127.0.0.1:0/12", "127.0.0.1:0/123"));
        assert!(!same_address("", "127.0.0.1:0/2"));
    }

    #[test]
    fn a_holder_on_another_host_is_never_taken_for_dead() {
        let r =
            HolderRecord::parse("client=client.1 host=surely-not-this-host pid=1 since=0 use=x");
        assert!(!r.is_gone_from_this_host());
        let r = HolderRecord::parse(&format!(
            "client=client.1 host={} pid=0 since=0 use=x",
            hostname()
        ));
        assert!(!r.is_gone_from_this_host(), "pid 0 is no process");
    }
}
