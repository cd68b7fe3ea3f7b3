//! A Ceph RBD image as a block device, through librbd (the `rbd` cargo feature).
//!
//! This first step is synchronous: `rbd_read`, `rbd_write` and `rbd_flush`, one call per
//! device request. The engine's own ordering (nodes written, flush, superblock, flush) carries
//! over unchanged, since `rbd_flush` returns only when every write that completed before it
//! is on the OSDs, librbd's cache or not. Writes in flight (`rbd_aio_*`) come next
//! (DESIGN §14).
//!
//! One writer at a time: a locked open takes this host's [`LocalLock`] and then the image's
//! exclusive lock (`rbd_lock_acquire`) before anything reads the superblock, after listing the
//! current owners: a live owner is refused at once, naming the host, pid and use it recorded
//! in the image metadata (`birch.holder`).
//!
//! librados starts threads at connect, and they do not survive `fork()`: nothing here forks,
//! and the mount daemon connects only in the re-executed child (`birch mount -f`).

use std::ffi::{CStr, CString};
use std::io;
use std::os::raw::{c_char, c_int};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::rbd_ffi as ffi;
use super::rbd_spec::{check_rbd_layout, CephOptions, LocalLock, RbdSpec};
use super::{check_range, BlockDevice, OpenMode};
use crate::counters::Counters;

/// Image metadata key naming the process that holds the image lock.
pub const HOLDER_KEY: &str = "birch.holder";

/// Client timeouts set when neither `ceph.conf` nor `CEPH_ARGS` sets them, as (option,
/// librados default, ours). A dead cluster must give an error, not a hang: librados waits 300 s
/// for the monitors by default and forever for a monitor or OSD operation.
const CLIENT_TIMEOUTS: [(&str, &str, &str); 3] = [
    // Connecting: the monitors must answer within this.
    ("client_mount_timeout", "300", "20"),
    // Monitor commands (pool lookups).
    ("rados_mon_op_timeout", "0", "30"),
    // OSD operations, including every read, write and flush of the image: long enough for an
    // OSD restart, short enough that a dead cluster fails the mount (the watchdog of issue 21
    // item 4 replaces this).
    ("rados_osd_op_timeout", "0", "60"),
];

/// How long a locked open waits for the lock of a holder that is gone from this host: its
/// watch on the image header expires after `osd_client_watch_timeout` (30 s by default), and
/// only then does `rbd_lock_acquire` break its lock (and blocklist it).
const DEAD_HOLDER_WAIT: Duration = Duration::from_secs(90);

/// What an open of an RBD image needs beyond the spec and mode.
#[derive(Debug, Clone, Default)]
pub struct RbdOpenOptions {
    /// How to reach the cluster.
    pub ceph: CephOptions,
    /// What holds the image, recorded in its metadata for a refused second user ("mount at
    /// /mnt/x", "fsck").
    pub holder: String,
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

/// An RBD image opened as a [`BlockDevice`]. Closing (drop) removes the holder record,
/// releases the image lock, closes the image and disconnects, in that order.
pub struct RbdDevice {
    image: ffi::rbd_image_t,
    spec: RbdSpec,
    size: u64,
    writable: bool,
    /// Whether this value took the image's exclusive lock (and wrote `birch.holder`).
    locked: bool,
    counters: Counters,
    /// Dropped after the image is closed (field order is drop order after `Drop::drop`).
    _cluster: Cluster,
    _local: Option<LocalLock>,
}

// SAFETY: librbd's image handle serves concurrent calls from any thread (the image context
// has its own locks); the handle itself is only closed in Drop, with `&mut self`.
unsafe impl Send for RbdDevice {}
// SAFETY: as above.
unsafe impl Sync for RbdDevice {}

impl RbdDevice {
    /// The error of an `rbd_read`/`rbd_write` that returned `n` (a negative errno, or 0:
    /// nothing moved) for `len` bytes at `at`.
    fn short_io(&self, n: isize, what: &str, at: u64, len: usize) -> io::Error {
        let rc = if n == 0 {
            -i64::from(libc::EIO)
        } else {
            n as i64
        };
        rc_error(rc, format!("{}: {what} at {at:#x} length {len}", self.spec))
    }

    /// Opens `spec`. Read-write and locked read-only modes take this host's lock and the
    /// image's exclusive lock before returning (so before the caller reads the superblock),
    /// refusing a live holder within a few seconds; `ReadOnlyUnlocked` opens read-only with no
    /// lock (and is the only mode a snapshot opens in). May do network I/O and block for the
    /// client timeouts.
    pub fn open(spec: &RbdSpec, mode: OpenMode, options: &RbdOpenOptions) -> io::Result<RbdDevice> {
        let writable = matches!(mode, OpenMode::ReadWrite | OpenMode::ReadWriteWait);
        let locking = mode != OpenMode::ReadOnlyUnlocked;
        let wait = matches!(mode, OpenMode::ReadWriteWait | OpenMode::ReadOnlyWait);
        if locking && spec.snapshot.is_some() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("{spec}: a snapshot is read without the image lock; only inspect and fsck --force open snapshots so far"),
            ));
        }
        // This host first: a daemon here finishing its final commit is waited for (mount after
        // umount), before its cluster lock could refuse us.
        let local = if locking {
            match LocalLock::acquire(spec, wait) {
                Ok(lock) => Some(lock),
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
        let mut device = RbdDevice {
            image,
            spec: spec.clone(),
            size: 0,
            writable,
            locked: false,
            counters: Counters::default(),
            _cluster: cluster,
            _local: local,
        };
        device.size = device.query_u64("rbd_get_size", ffi::rbd_get_size)?;
        device.size -= device.size % birch_format::BLOCK_SIZE;
        let features = device.query_u64("rbd_get_features", ffi::rbd_get_features)?;
        if let Err(why) = device.check_layout() {
            if writable {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{spec}: refusing to write: {why}"),
                ));
            }
            log::warn!("{spec}: {why}");
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
        device.take_lock(&options.holder)?;
        Ok(device)
    }

    /// The spec this device was opened from.
    pub fn spec(&self) -> &RbdSpec {
        &self.spec
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

    fn check_layout(&self) -> Result<(), String> {
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

    /// Lists the lock owners, refuses a live one, then takes the exclusive lock and records
    /// who holds it.
    fn take_lock(&mut self, holder: &str) -> io::Result<()> {
        let spec = self.spec.clone();
        let owners = self.lock_owners()?;
        let mut deadline = Instant::now() + Duration::from_secs(10);
        if let Some(owner) = owners.first() {
            let record = self.metadata_get(HOLDER_KEY).ok().flatten();
            let record = record.as_deref().map(HolderRecord::parse);
            match record.filter(|r| r.is_owner(owner)) {
                Some(r) if r.is_gone_from_this_host() => {
                    eprintln!(
                        "{spec}: the previous holder ({}) is gone; waiting for its watch to expire (about 30 s) before taking the lock",
                        r.describe()
                    );
                    deadline = Instant::now() + DEAD_HOLDER_WAIT;
                }
                Some(r) => return Err(in_use(&spec, owner, Some(&r))),
                None => return Err(in_use(&spec, owner, None)),
            }
        }
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
        self.locked = true;
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
        locked: false,
        counters: Counters::default(),
        _cluster: cluster,
        _local: None,
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
            "{spec}: image is in use by {who}. Unmount it there first. If that holder is dead, its lock is broken only by a takeover: `-o takeover` is not implemented yet (issue 21); by hand: `rbd lock ls {pool}/{image}`, then `rbd lock rm {pool}/{image} ID LOCKER` (this blocklists the old client)",
            pool = spec.pool,
            image = image_path(spec)
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
        // SAFETY: the image is open until rbd_close here; nothing uses it after.
        unsafe {
            if self.locked {
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
            }
            let rc = ffi::rbd_close(self.image);
            if rc < 0 {
                log::warn!(
                    "{}: rbd_close: {}",
                    self.spec,
                    io::Error::from_raw_os_error(-rc)
                );
            }
        }
    }
}

impl BlockDevice for RbdDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_range(offset, buf.len(), self.size)?;
        self.counters.add(|c| &c.device_reads, 1);
        let mut done = 0usize;
        while done < buf.len() {
            let rest = &mut buf[done..];
            // SAFETY: an open image; librbd writes at most rest.len() bytes into rest.
            let n = unsafe {
                ffi::rbd_read(
                    self.image,
                    offset + done as u64,
                    rest.len(),
                    rest.as_mut_ptr().cast(),
                )
            };
            if n <= 0 {
                return Err(self.short_io(n, "read", offset + done as u64, rest.len()));
            }
            done += n as usize;
        }
        Ok(())
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
        let mut done = 0usize;
        while done < buf.len() {
            let rest = &buf[done..];
            // SAFETY: an open image; librbd reads rest.len() bytes from rest.
            let n = unsafe {
                ffi::rbd_write(
                    self.image,
                    offset + done as u64,
                    rest.len(),
                    rest.as_ptr().cast(),
                )
            };
            if n <= 0 {
                return Err(self.short_io(n, "write", offset + done as u64, rest.len()));
            }
            done += n as usize;
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        self.counters.add(|c| &c.flushes, 1);
        // SAFETY: an open image.
        let rc = unsafe { ffi::rbd_flush(self.image) };
        if rc < 0 {
            return Err(rc_error(rc.into(), format!("{}: flush", self.spec)));
        }
        Ok(())
    }

    fn size_bytes(&self) -> u64 {
        self.size
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
