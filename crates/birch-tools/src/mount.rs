//! `birch mount`, the `mount.fuse.birch` helper, and `birch umount`: option parsing, the
//! checks before a mount, bind mounts of a served image, starting the daemon process (`birch
//! mount -f`, re-executed), remounts, and sending control commands to a mount.
//! The daemon itself (serving, signals, io_uring setup, the dirty cap, the final commit) is
//! birch-fuse's [`birch_fuse::daemon`]; this file must not grow it back.

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use birch_core::control::ControlCommand;
use birch_core::device::{
    is_rbd_path, CephOptions, FileDevice, LocalLock, OpenMode, RbdSpec, RBD_SUPPORTED,
};
use birch_core::vfs::{AtimeMode, FsyncMode};
use birch_fuse::daemon::front_end::{FrontEnd, GONE, READY, READY_FD_ENV};
use birch_fuse::daemon::mountinfo::{canonical, mounts_of_source, unescape};
use birch_fuse::daemon::{default_threads, lazy_unmount, MountConfig};

use crate::fail;

/// Every mount option `parse_options` accepts, as (example, what it does): the text of the
/// birchfs(5) man page (`docs.rs`). A unit test parses each example, so the page cannot name an
/// option the parser refuses.
pub(crate) const MOUNT_OPTIONS: &[(&str, &str)] = &[
    ("ro", "Mount read-only: the daemon never writes the image, and a log left by fsync is not replayed (a later read-write mount replays it)."),
    ("snapshot=NAME", "With ro: serve snapshot NAME alone as the mount's root, read-only (every change is EROFS). Only while the live filesystem is not mounted: its daemon holds the image lock, and the snapshot is then at MNT/.snapshot/NAME of that mount."),
    ("rw", "Mount read-write (the default)."),
    ("allow_other", "Let users other than the one who mounted use the mount (FUSE's allow_other)."),
    ("commit=SECS", "Commit in the background every SECS seconds (default 5; 0 turns background commits off)."),
    ("threads=N", "FUSE request loops (default one per CPU, at least 2 and at most 8)."),
    ("waiters=N", "Requests that wait for the device, served at once on worker threads (default 64)."),
    ("ttl=SECS", "How long the kernel caches attributes, entries and negative entries (default 60). attr_timeout= and entry_timeout= are accepted as aliases."),
    ("compress=zstd", "Store written data compressed (zstd at level 1; zstd:N for levels 1 to 19, lz4 for the fastest, none, the default, for never). Data is written as it comes and rewritten compressed before the commit that would record it (every commit= seconds, birch sync, unmount): each 128 KiB chunk written whole is kept compressed if that saves at least 1/8. fsync'd data reaches the disk plainly first. birch defrag --compress compresses existing files."),
    ("fsync=log", "fsync makes a file durable through the log: one device flush, no commit (the default)."),
    ("fsync=commit", "Every fsync commits the whole filesystem."),
    ("errors=continue", "What a device error that loses written data does: continue (the default) fails that file's fsyncs for ever and lets every other file go on; errors=remount-ro turns the whole filesystem read-only; errors=panic stops the daemon (the mount then answers ENOTCONN; what was durable stays, as after a power cut). A failed commit or log write always turns the filesystem read-only, or with errors=panic stops the daemon."),
    ("io_timeout=SECS", "Image files and block devices: a read, write or flush the device has not answered in SECS seconds (0.1 to 86400; off by default) gives the device up: that request and every later one that needs the device answer EIO, the filesystem turns read-only (the cause in the log and in birch stats), and what needs no device I/O (cached attributes, names and data) is still served. Each request then costs a copy of its bytes and a hand-off to an I/O thread. rbd: images have rbd_timeout= instead."),
    ("writeback=on", "The kernel's writeback cache: writes are gathered in the page cache (default on; writeback=off sends each write to the daemon)."),
    ("keep_cache=on", "Keep a file's pages in the page cache across opens (default on)."),
    ("buffer=on", "The daemon buffers writes that are neither direct nor synchronous until the next commit or fsync (default on)."),
    ("uring=on", "FUSE over io_uring beside /dev/fuse, one ring per CPU. By default the mount uses it wherever the kernel allows it (Linux 6.14 and later, with the fuse module's enable_uring set to Y, which scripts/setup.sh does); uring (or uring=on) asks for it and, run as root, sets enable_uring to Y if it is N; uring=off serves every request over /dev/fuse."),
    ("noatime", "Reads never update atime. relatime (the default; also atime) and strictatime are the other choices; the last one given counts."),
    ("nodiratime", "Reads of directories never update atime (diratime undoes it)."),
    ("nodev", "Device files on the mount cannot be opened (dev undoes it)."),
    ("nosuid", "set-user-ID and set-group-ID bits are ignored (suid undoes it)."),
    ("noexec", "Files on the mount cannot be executed (exec undoes it)."),
    // The seeds' "before" switches exist only in benchmark builds (feature `seed-before`,
    // built by bench/run.sh); the shipped binary refuses them as unknown options.
    #[cfg(feature = "seed-before")]
    ("bench_serialize_sync_writes", "Benchmark only, never for use (seed 001's \"before\"): synchronous and direct writes to one file are serialized in the daemon for the write and its flush. Off by default."),
    #[cfg(feature = "seed-before")]
    ("bench_global_objectid_lock", "Benchmark only, never for use (seed 002's \"before\"): every create takes its object id under one mutex, with no batch of ids per thread. Off by default."),
    #[cfg(feature = "seed-before")]
    ("bench_apply_per_item", "Benchmark only, never for use (seed 003's \"before\"): a commit deletes and inserts each changed extent item in a B-tree descent of its own instead of one descent per leaf. Off by default."),
    ("ceph_id=ID", "rbd: images: the Ceph client id to connect as, without client. (as rbd --id; default admin, or --id in CEPH_ARGS)."),
    ("ceph_conf=PATH", "rbd: images: the ceph.conf to read (default: CEPH_CONF, then /etc/ceph/ceph.conf)."),
    ("keyring=PATH", "rbd: images: the keyring holding the client's key (default: as ceph.conf says)."),
    ("takeover", "rbd: images: take the image from a holder that no longer answers: wait (takeover_wait=) until its watch on the image expires, then blocklist it and break its lock; a holder still answering is refused. takeover=force fences the holder at once, alive or not; takeover=off is the default."),
    ("takeover_wait=SECS", "rbd: images: how long takeover waits for the holder to stop answering (default 60, 1 to 86400)."),
    ("rbd_timeout=SECS", "rbd: images: the watchdog: a request the cluster has not answered in SECS seconds (default 60, 1 to 86400) gives the image up: every request on the mount then answers EIO."),
    ("discard=off", "rbd: images: keep freed space allocated in the cluster. By default (discard, discard=on) space no committed tree references any more (freed, and past the backup roots) is discarded on the image (rbd_aio_discard), so the cluster can free it; nodiscard is discard=off. fstrim(8) of the mount discards the free space either way. Image files and block devices ignore it."),
    ("defaults", "Accepted and ignored, as are auto, noauto, user, nouser, users, nofail, _netdev, async and default_permissions: mount(8) and fstab handle them."),
];

fn parse_options(raw: &[String]) -> Result<MountConfig, String> {
    let mut c = MountConfig {
        read_only: false,
        allow_other: false,
        commit_secs: 5,
        threads: default_threads(),
        waiters: birch_fuse::DEFAULT_WAITERS,
        ttl_secs: birch_fuse::DEFAULT_TTL_SECS as f64,
        vfs_flags: 0,
        atime: None,
        nodiratime: None,
        fsync: FsyncMode::Log,
        errors: Default::default(),
        io_timeout: None,
        writeback: true,
        keep_cache: true,
        buffer: true,
        uring: None,
        compress: None,
        #[cfg(feature = "seed-before")]
        bench_serialize_sync_writes: false,
        #[cfg(feature = "seed-before")]
        bench_global_objectid_lock: false,
        #[cfg(feature = "seed-before")]
        bench_apply_per_item: false,
        ceph: CephOptions::default(),
        snapshot: None,
        faults: Vec::new(),
        fault_seed: None,
    };
    for opt in raw
        .iter()
        .flat_map(|o| o.split(','))
        .map(str::trim)
        .filter(|o| !o.is_empty())
    {
        let (key, value) = opt
            .split_once('=')
            .map_or((opt, None), |(k, v)| (k, Some(v)));
        let number = |v: Option<&str>| {
            v.and_then(|v| v.parse::<f64>().ok())
                .filter(|n| *n >= 0.0)
                .ok_or_else(|| format!("option {opt}: needs a non-negative number"))
        };
        if c.ceph.take_mount_option(key, value)? {
            continue;
        }
        match key {
            "ro" => c.read_only = true,
            "rw" => c.read_only = false,
            "snapshot" => match value {
                Some(name) if !name.is_empty() => c.snapshot = Some(name.to_string()),
                _ => return Err(format!("option {opt}: expected snapshot=NAME")),
            },
            "allow_other" => c.allow_other = true,
            "commit" => c.commit_secs = number(value)? as u64,
            "threads" => c.threads = (number(value)? as usize).clamp(1, 64),
            "waiters" => c.waiters = (number(value)? as usize).clamp(1, 256),
            "ttl" | "attr_timeout" | "entry_timeout" => c.ttl_secs = number(value)?,
            "compress" => {
                c.compress = match value.map(birch_format::codec::Codec::parse) {
                    Some(Some(birch_format::codec::Codec::None)) => None,
                    Some(Some(codec)) => Some(codec),
                    _ => {
                        return Err(format!(
                    "option {opt}: expected compress=zstd, zstd:N (N from 1 to 19), lz4 or none"
                ))
                    }
                }
            }
            "fsync" => match value {
                Some("log") => c.fsync = FsyncMode::Log,
                Some("commit") => c.fsync = FsyncMode::Commit,
                _ => return Err(format!("option {opt}: expected fsync=log or fsync=commit")),
            },
            "errors" => {
                c.errors = value
                    .and_then(birch_core::vfs::ErrorPolicy::parse)
                    .ok_or_else(|| {
                        format!("option {opt}: expected errors=continue, remount-ro or panic")
                    })?
            }
            "io_timeout" => {
                let secs = number(value)?;
                c.io_timeout = if secs == 0.0 {
                    None
                } else if (0.1..=86400.0).contains(&secs) {
                    Some(Duration::from_secs_f64(secs))
                } else {
                    return Err(format!(
                        "option {opt}: io_timeout takes 0 (off) or 0.1 to 86400 seconds"
                    ));
                }
            }
            "writeback" => c.writeback = on_off(opt, value)?,
            "buffer" => c.buffer = on_off(opt, value)?,
            "uring" => c.uring = Some(value.is_none() || on_off(opt, value)?),
            "keep_cache" => c.keep_cache = on_off(opt, value)?,
            #[cfg(feature = "seed-before")]
            "bench_serialize_sync_writes" => {
                c.bench_serialize_sync_writes = value.is_none() || on_off(opt, value)?
            }
            #[cfg(feature = "seed-before")]
            "bench_global_objectid_lock" => {
                c.bench_global_objectid_lock = value.is_none() || on_off(opt, value)?
            }
            #[cfg(feature = "seed-before")]
            "bench_apply_per_item" => {
                c.bench_apply_per_item = value.is_none() || on_off(opt, value)?
            }
            "fault" => c.faults.push(fault_rule(opt, value)?),
            "fault_seed" => c.fault_seed = Some(fault_seed(opt, value)?),
            "noatime" | "atime" | "relatime" | "strictatime" => {
                c.atime = AtimeMode::from_option(key);
            }
            "nodiratime" => c.nodiratime = Some(true),
            "diratime" => c.nodiratime = Some(false),
            "nodev" => c.vfs_flags |= libc::MS_NODEV,
            "dev" => c.vfs_flags &= !libc::MS_NODEV,
            "nosuid" => c.vfs_flags |= libc::MS_NOSUID,
            "suid" => c.vfs_flags &= !libc::MS_NOSUID,
            "noexec" => c.vfs_flags |= libc::MS_NOEXEC,
            "exec" => c.vfs_flags &= !libc::MS_NOEXEC,
            "defaults"
            | "_netdev"
            | "auto"
            | "noauto"
            | "user"
            | "nouser"
            | "users"
            | "nofail"
            | "async"
            | "default_permissions" => {}
            "fsname" | "subtype" | "user_id" | "group_id" | "rootmode" | "max_read" | "blksize" => {
            }
            other => {
                return Err(format!(
                    "unknown mount option {other:?} (see birch mount --help)"
                ))
            }
        }
    }
    Ok(c)
}

/// The rule of a `fault=RULE` option: the test kit's rule text with `+` for its commas (mount
/// options are split at commas), e.g. `fault=write:eio+percent=5+after=100`. Only a build with
/// the `fault-injection` feature takes it; the shipped binary says so.
fn fault_rule(opt: &str, value: Option<&str>) -> Result<String, String> {
    let Some(text) = value.filter(|v| !v.is_empty()) else {
        return Err(format!("option {opt}: expected fault=RULE"));
    };
    let text = text.replace('+', ",");
    if !cfg!(feature = "fault-injection") {
        return Err(format!(
            "option {opt}: this birch was built without fault injection (a test build: cargo \
             build --release -p birch-tools --features fault-injection)"
        ));
    }
    birch_testkit::Rule::parse(&text).map_err(|e| format!("option {opt}: {e}"))?;
    Ok(text)
}

/// The seed of a `fault_seed=N` option (the fault device's chances; test builds only).
fn fault_seed(opt: &str, value: Option<&str>) -> Result<u64, String> {
    if !cfg!(feature = "fault-injection") {
        return Err(format!(
            "option {opt}: this birch was built without fault injection (a test build: cargo \
             build --release -p birch-tools --features fault-injection)"
        ));
    }
    value
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("option {opt}: expected fault_seed=N (an unsigned integer)"))
}

/// The atime mode the kernel's mount table gives the mount at `mountpoint` (its per-mount
/// options: `noatime`, `relatime`, or neither for strictatime), after a remount has set it.
fn mounted_atime(mountpoint: &Path) -> Option<AtimeMode> {
    let target = canonical(mountpoint).to_string_lossy().into_owned();
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let line = info
        .lines()
        .rev()
        .map(|l| l.split(' ').collect::<Vec<_>>())
        .find(|f| f.get(4).map(|m| unescape(m)) == Some(target.clone()))?;
    let options = line.get(5)?.split(',').collect::<Vec<_>>();
    Some(if options.contains(&"noatime") {
        AtimeMode::NoAtime
    } else if options.contains(&"relatime") {
        AtimeMode::Relatime
    } else {
        AtimeMode::StrictAtime
    })
}

/// The value of an `on|off` option.
fn on_off(opt: &str, value: Option<&str>) -> Result<bool, String> {
    match value {
        Some("on") => Ok(true),
        Some("off") => Ok(false),
        _ => Err(format!("option {opt}: expected on or off")),
    }
}

/// The mountinfo line of a birch mount at `mountpoint`: returns its source (the image path).
/// Of several FUSE mounts stacked there, the newest (the last line; the one umount(2) takes
/// off first unless something else is mounted above it).
fn mounted_source(mountpoint: &Path) -> Option<String> {
    let target = canonical(mountpoint);
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    for line in info.lines().rev() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(dash) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        if fields.get(4).map(|m| unescape(m)) == Some(target.to_string_lossy().into_owned())
            && fields.get(dash + 1).is_some_and(|t| t.starts_with("fuse"))
        {
            return fields.get(dash + 2).map(|s| unescape(s));
        }
    }
    None
}

/// The mountpoint of a FUSE mount whose source is `image`, if any.
fn mount_of_source(image: &Path) -> Option<String> {
    mounts_of_source(image).into_iter().next()
}

/// Whether the mount at `mountpoint` is read-only (its per-mount options, or its superblock's).
fn mount_is_read_only(mountpoint: &str) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    info.lines()
        .rev()
        .map(|l| l.split(' ').collect::<Vec<_>>())
        .find(|f| f.get(4).map(|m| unescape(m)).as_deref() == Some(mountpoint))
        .is_some_and(|f| {
            let dash = f.iter().position(|x| *x == "-").unwrap_or(f.len());
            let ro = |opts: Option<&&str>| opts.is_some_and(|o| o.split(',').any(|x| x == "ro"));
            ro(f.get(5)) || ro(f.get(dash + 3))
        })
}

/// Checks a mount of `image` at `mountpoint` can go ahead. Returns the mountpoint of a live
/// mount of the same image, served by a running daemon, which the new mount is to be a bind
/// mount of.
fn preflight(image: &Path, mountpoint: &Path) -> Result<Option<String>, String> {
    match std::fs::metadata(mountpoint) {
        Err(_) => {
            return Err(format!(
                "{}: mountpoint does not exist",
                mountpoint.display()
            ))
        }
        Ok(m) if !m.is_dir() => {
            return Err(format!(
                "{}: mountpoint is not a directory",
                mountpoint.display()
            ))
        }
        Ok(_) => {}
    }
    if is_rbd_path(image) {
        // Checked here, in the parent, without connecting: librados threads would not survive
        // the daemon's fork, and the daemon (a new process) reports cluster errors itself.
        RbdSpec::from_path(image).map_err(|e| e.to_string())?;
        if !RBD_SUPPORTED {
            return Err(format!("{}: birch was built without RBD support (rebuild with `cargo build --release --features rbd`)", image.display()));
        }
    } else if !image.exists() {
        return Err(format!("{}: image does not exist", image.display()));
    }
    if !Path::new("/dev/fuse").exists() {
        return Err(
            "/dev/fuse is missing: load the fuse module (modprobe fuse) or install fuse3".into(),
        );
    }
    if let Some(source) = mounted_source(mountpoint) {
        // This image's own mount there may be on its way out: an unmount run in the background
        // and a mount at once (xfstests generic/604) meet it still in the mount table for the
        // moment the kernel takes to detach it. Waited for a little; anything else mounted
        // there is refused at once.
        let ours = Path::new(&source) == canonical(image).as_path();
        let deadline = Instant::now() + Duration::from_secs(5);
        while ours && mounted_source(mountpoint).is_some() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if !ours || mounted_source(mountpoint).is_some() {
            return Err(format!(
                "{}: something is already mounted there",
                mountpoint.display()
            ));
        }
    }
    // A live mount of this image (its daemon holds the image lock) is shared: the new mount is
    // a bind mount of it, since the kernel cannot give one FUSE connection a second superblock.
    // A mount whose daemon is gone is an error; a daemon still finishing its final commit after
    // an unmount is waited for (the image lock), so an immediate remount works.
    // An RBD image is never shared this way yet: a second mount on this host is refused by the
    // image lock like one on another host.
    if is_rbd_path(image) {
        return Ok(None);
    }
    if let Some(at) = mount_of_source(&canonical(image)) {
        return match FileDevice::open(image, OpenMode::ReadOnly) {
            Err(e) if e.kind() == std::io::ErrorKind::ResourceBusy => Ok(Some(at)),
            Err(e) => Err(format!("{e}; it is mounted at {at}")),
            Ok(_) => Err(format!(
                "{}: mounted at {at}, but no daemon serves it: unmount it first",
                image.display()
            )),
        };
    }
    Ok(None)
}

/// A second mount of an image a daemon already serves at `at`: a bind mount of that mount at
/// `mountpoint` (the same filesystem, one daemon), with this mount's own VFS flags (`ro`,
/// `nosuid`, `nodev`, `noexec`, atime flags in the kernel's mount table). birch options
/// (`commit=`, `writeback=`, the atime mode the daemon applies, ...) stay the first mount's. A
/// read-write mount of an image served read-only is refused. The daemon serves until the last
/// of its mounts is unmounted (the kernel ends the FUSE connection with the superblock).
fn bind_mount(at: &str, mountpoint: &Path, config: &MountConfig) -> ExitCode {
    if !config.read_only && mount_is_read_only(at) {
        return fail(format!(
            "the image is served read-only at {at}: mount it with -o ro, or remount that mount rw first"
        ));
    }
    let cstr = |p: &[u8]| std::ffi::CString::new(p).map_err(|_| "path with a NUL byte".to_string());
    let (source, target) = match (
        cstr(at.as_bytes()),
        cstr(canonical(mountpoint).as_os_str().as_encoded_bytes()),
    ) {
        (Ok(s), Ok(t)) => (s, t),
        (Err(e), _) | (_, Err(e)) => return fail(e),
    };
    // SAFETY: mount(2) with valid NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return fail(format!(
            "bind mount of {at} on {}: {}",
            mountpoint.display(),
            std::io::Error::last_os_error()
        ));
    }
    // A bind mount starts with the flags of the mount it binds; set this mount's own.
    let mut flags = libc::MS_REMOUNT | libc::MS_BIND | config.vfs_flags | config.atime_flags();
    if config.read_only {
        flags |= libc::MS_RDONLY;
    }
    // SAFETY: as above; a per-mount remount with no source, type or data.
    let rc = unsafe {
        libc::mount(
            std::ptr::null(),
            target.as_ptr(),
            std::ptr::null(),
            flags,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        lazy_unmount(mountpoint);
        return fail(format!(
            "bind mount of {at} on {}: setting its flags: {err}",
            mountpoint.display()
        ));
    }
    ExitCode::SUCCESS
}

/// `birch mount IMAGE MNT [-o opts] [-f]`.
pub fn mount_main(image: &Path, mountpoint: &Path, raw: &[String], foreground: bool) -> ExitCode {
    // A daemon started by a mount command (`-f` with the command's pipe): taken first, while
    // this process has no other thread (the variable is removed from the environment).
    let front = if foreground {
        FrontEnd::from_env()
    } else {
        None
    };
    let config = match parse_options(raw) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    if let Some(name) = &config.snapshot {
        if !config.read_only {
            return fail(format!(
                "snapshot={name}: a snapshot is read-only: mount it with -o ro,snapshot={name}"
            ));
        }
    }
    match preflight(image, mountpoint) {
        Err(e) => return fail(e),
        Ok(Some(at)) => {
            if let Some(name) = &config.snapshot {
                return fail(format!(
                    "{}: the image is in use: mounted at {at}, whose daemon holds the image \
                     lock; snapshot {name:?} is browsable there at {at}/.snapshot/{name}",
                    image.display()
                ));
            }
            // A mount that serves one snapshot alone is no mount of the live filesystem: its
            // daemon names the snapshot in the root's trusted.birch.alone (a live mount, and a
            // daemon older than the xattr, answer ENODATA).
            if let Ok(name) = crate::stats::getxattr(Path::new(&at), "trusted.birch.alone") {
                return fail(format!(
                    "{}: the image is in use: mounted at {at}, which serves snapshot {:?} alone \
                     (-o ro,snapshot=); unmount it first",
                    image.display(),
                    String::from_utf8_lossy(&name)
                ));
            }
            // Mounted meanwhile elsewhere (this is the daemon of a command that found it
            // unmounted): a bind mount of it, made only while the command waits, and then the
            // command's success.
            if front.as_ref().is_some_and(FrontEnd::gone) {
                return fail(GONE);
            }
            let bound = bind_mount(&at, mountpoint, &config);
            if let Some(front) = front {
                if bound == ExitCode::SUCCESS && front.ready().is_err() {
                    lazy_unmount(mountpoint);
                    return fail(GONE);
                }
            }
            return bound;
        }
        Ok(None) => {}
    }
    if foreground {
        return match birch_fuse::daemon::serve(image, mountpoint, &config, front) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(e),
        };
    }
    // A takeover may wait for the holder's watch to expire before the mount comes up.
    let takeover = match config.ceph.takeover {
        birch_core::device::Takeover::No => Duration::ZERO,
        _ => config
            .ceph
            .takeover_wait
            .unwrap_or(birch_core::device::DEFAULT_TAKEOVER_WAIT),
    };
    spawn_daemon(image, mountpoint, raw, Duration::from_secs(120) + takeover)
}

/// How long a mount command that gives up waits for its daemon to stop (the daemon ends
/// itself once it sees the command's end of the pipe closed: `birch_fuse::daemon::front_end`).
const STOP_WAIT: Duration = Duration::from_secs(5);

/// Starts the daemon (`birch mount -f`, re-executed, in its own process group) and waits for
/// *its* mount: success only when the daemon says on the pipe it inherits
/// (`front_end::READY_FD_ENV`) that its mount is live, never because something else got
/// mounted at the mount point meanwhile. Giving up (the daemon exited, or `limit` passed)
/// closes the pipe, which makes a daemon still waiting for the image stop instead of mounting
/// later, unasked.
fn spawn_daemon(image: &Path, mountpoint: &Path, raw: &[String], limit: Duration) -> ExitCode {
    use std::os::unix::process::CommandExt;
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => return fail(format!("cannot find own executable: {e}")),
    };
    let log_path = std::env::temp_dir().join(format!("birch-mount-{}.log", std::process::id()));
    let log = match std::fs::File::create(&log_path) {
        Ok(f) => f,
        Err(e) => return fail(format!("{}: {e}", log_path.display())),
    };
    let (mut ready, daemon_end) = match ready_pipe() {
        Ok(p) => p,
        Err(e) => return fail(format!("cannot make the mount daemon's pipe: {e}")),
    };
    let daemon_fd = daemon_end.as_raw_fd();
    let mut cmd = Command::new(exe);
    // argv[0] "birch": when this runs as mount.fuse.birch, the daemon must still parse as birch.
    cmd.arg0("birch");
    cmd.arg("mount").arg("-f").arg(image).arg(mountpoint);
    for o in raw {
        cmd.arg("-o").arg(o);
    }
    cmd.env(READY_FD_ENV, daemon_fd.to_string());
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .process_group(0);
    // SAFETY: between fork and exec only fcntl runs (async-signal-safe): the daemon's end of
    // the pipe, made close-on-exec, is kept open across the exec in the child alone.
    unsafe {
        cmd.pre_exec(move || {
            if libc::fcntl(daemon_fd, libc::F_SETFD, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return fail(format!("cannot start the mount daemon: {e}")),
    };
    drop(daemon_end);
    let started = Instant::now();
    // What the daemon said so far is passed on while it waits (for a lock, or for a dead RBD
    // holder's watch to expire), so a slow mount says why.
    let mut shown = 0;
    let mut said = Vec::new();
    loop {
        let mut buf = [0u8; 64];
        match ready.read(&mut buf) {
            Ok(n) => said.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                drop(ready);
                let stopped = stop_daemon(&mut child);
                return fail(format!("mount daemon's pipe: {e}; {stopped}"));
            }
        }
        if said.starts_with(READY) {
            let _ = std::fs::remove_file(&log_path);
            return ExitCode::SUCCESS;
        }
        if let Ok(Some(status)) = child.try_wait() {
            let text = std::fs::read_to_string(&log_path).unwrap_or_default();
            let _ = std::fs::remove_file(&log_path);
            eprint!("{}", text.get(shown..).unwrap_or_default());
            return fail(format!(
                "mount daemon exited ({status}) before the mount was live"
            ));
        }
        if started.elapsed() > limit {
            drop(ready);
            let stopped = stop_daemon(&mut child);
            return fail(format!(
                "mount of {} did not come up in {} s; {stopped}; daemon log: {}",
                image.display(),
                limit.as_secs(),
                log_path.display()
            ));
        }
        if started.elapsed() > Duration::from_secs(1) {
            let text = std::fs::read_to_string(&log_path).unwrap_or_default();
            // Whole lines only, so the rest is printed once at exit.
            if let Some(end) = text.get(shown..).and_then(|t| t.rfind('\n')) {
                eprint!("{}", &text[shown..shown + end + 1]);
                shown += end + 1;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The pipe between a mount command and its daemon: (this end, non-blocking; the daemon's
/// end), both close-on-exec (the daemon's is let through to the one child that needs it).
fn ready_pipe() -> std::io::Result<(std::fs::File, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills the two-element array it is given.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just made and are owned here alone.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // pipe2 made both ends non-blocking; the daemon's end blocks, as a pipe's usually does.
    // SAFETY: F_SETFL on a descriptor owned here.
    if unsafe { libc::fcntl(write.as_raw_fd(), libc::F_SETFL, 0) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((std::fs::File::from(read), write))
}

/// After the mount command gave up (its end of the pipe is closed): waits up to
/// [`STOP_WAIT`] for the daemon to end itself, and says what became of it.
fn stop_daemon(child: &mut std::process::Child) -> String {
    let until = Instant::now() + STOP_WAIT;
    while Instant::now() < until {
        if let Ok(Some(status)) = child.try_wait() {
            return format!("its daemon stopped ({status})");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    format!(
        "its daemon (pid {}) has not stopped yet; it sees its command gone and does not mount \
         (or, if it is mounting right now, unmounts at once)",
        child.id()
    )
}
/// How long `birch umount` retries an unmount the kernel answers EBUSY.
const UMOUNT_BUSY_WAIT: Duration = Duration::from_secs(5);

/// `birch umount MNT`: unmounts, then waits until the daemon has released the image.
pub fn umount(mountpoint: &Path) -> ExitCode {
    let Some(source) = mounted_source(mountpoint) else {
        return fail(format!("{}: not a birch mount", mountpoint.display()));
    };
    let target = canonical(mountpoint);
    let Ok(c) = std::ffi::CString::new(target.as_os_str().as_encoded_bytes()) else {
        return fail("bad mountpoint path");
    };
    // A file closed by a process that just exited can hold the mount for a moment after
    // (the kernel releases it from a workqueue, and its release writes back its dirty pages
    // first): EBUSY is retried for a few seconds before giving up.
    let started = Instant::now();
    let unmounted = loop {
        // SAFETY: umount2 with a valid NUL-terminated path.
        if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
            break Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EBUSY) || started.elapsed() > UMOUNT_BUSY_WAIT {
            break Err(err);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if let Err(err) = unmounted {
        let status = Command::new("fusermount3").arg("-u").arg(&target).status();
        if !status.is_ok_and(|s| s.success()) {
            return fail(format!("{}: umount: {err}", mountpoint.display()));
        }
    }
    if let Some(other) = mount_of_source(Path::new(&source)) {
        // Another mount of the image (a bind mount) keeps the daemon serving.
        log::info!("{source} is still mounted at {other}");
        return ExitCode::SUCCESS;
    }
    wait_for_release(Path::new(&source))
}

fn wait_for_release(image: &Path) -> ExitCode {
    match RbdSpec::from_path(image) {
        Ok(Some(spec)) => return wait_for_rbd_release(&spec),
        Ok(None) => {}
        Err(e) => return fail(e),
    }
    let started = Instant::now();
    let mut told = false;
    loop {
        match FileDevice::open(image, OpenMode::ReadOnly) {
            Ok(_) => return ExitCode::SUCCESS,
            Err(e) if e.kind() == std::io::ErrorKind::ResourceBusy => {}
            Err(e) => return fail(format!("{}: {e}", image.display())),
        }
        if !told && started.elapsed() > Duration::from_secs(3) {
            eprintln!(
                "birch: waiting for the daemon to finish its final commit of {}",
                image.display()
            );
            told = true;
        }
        if started.elapsed() > Duration::from_secs(300) {
            return fail(format!("{}: still held after 300 s", image.display()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// After unmounting an `rbd:` image: waits for the daemon on this host to release it (its
/// [`LocalLock`], held until the image lock is released and the image closed); `birch umount`
/// has no cluster credentials of its own.
fn wait_for_rbd_release(spec: &RbdSpec) -> ExitCode {
    if spec.snapshot.is_some() {
        // A snapshot is served read-only and takes no lock: nothing to wait for (the image's
        // own lock may be held by its live mount here).
        return ExitCode::SUCCESS;
    }
    match LocalLock::wait_released(spec, Duration::from_secs(3)) {
        Ok(true) => return ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("birch: waiting for the daemon to finish its final commit of {spec}")
        }
        Err(e) => return fail(e),
    }
    match LocalLock::wait_released(spec, Duration::from_secs(300)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => fail(format!("{spec}: still held after 300 s")),
        Err(e) => fail(e),
    }
}

/// `mount.fuse.birch IMAGE MNT [-o opts]`, as mount(8) calls it.
pub fn helper_main(args: &[String]) -> ExitCode {
    let mut positional = Vec::new();
    let mut options = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-o" => {
                if let Some(o) = it.next() {
                    options.push(o.clone());
                }
            }
            "-n" | "-v" | "-s" | "-f" => {}
            s if s.starts_with("-o") => options.push(s[2..].to_string()),
            s => positional.push(s.to_string()),
        }
    }
    let [image, mountpoint] = positional.as_slice() else {
        eprintln!("usage: mount.fuse.birch IMAGE MOUNTPOINT [-o options]");
        return ExitCode::from(2);
    };
    if options
        .iter()
        .flat_map(|o| o.split(','))
        .any(|o| o == "remount")
    {
        return remount(Path::new(mountpoint), &options);
    }
    mount_main(Path::new(image), Path::new(mountpoint), &options, false)
}

/// `mount -o remount,ro|rw MNT`: the daemon commits and stops writing before the kernel turns
/// the mount read-only, and is told after the kernel made it writable again.
fn remount(mountpoint: &Path, raw: &[String]) -> ExitCode {
    let rest: Vec<String> = raw
        .iter()
        .flat_map(|o| o.split(','))
        .filter(|o| *o != "remount")
        .map(str::to_string)
        .collect();
    let config = match parse_options(&rest) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    let target = canonical(mountpoint);
    let tell = |command: ControlCommand| control(&target, &command);
    let kernel = |flags: libc::c_ulong| -> std::io::Result<()> {
        let path = std::ffi::CString::new(target.as_os_str().as_encoded_bytes())
            .map_err(|_| std::io::ErrorKind::InvalidInput)?;
        // SAFETY: mount(2) remount with a valid target and no source, type or data.
        let rc = unsafe {
            libc::mount(
                std::ptr::null(),
                path.as_ptr(),
                std::ptr::null(),
                libc::MS_REMOUNT | flags,
                std::ptr::null(),
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    // One of several mounts of the image (bind mounts of one daemon's mount): ro and rw are this
    // mount's own, so the daemon, which serves the others too, is not told; only the atime
    // mode, which the daemon applies for all of them (the last remount sets it).
    let shared =
        mounted_source(&target).is_some_and(|image| mounts_of_source(Path::new(&image)).len() > 1);
    let result = if shared {
        kernel(libc::MS_BIND | config.vfs_flags | config.atime_flags()).and_then(|()| {
            match mounted_atime(&target) {
                Some(mode) if !config.read_only && config.atime.is_some() => {
                    tell(ControlCommand::Atime(mode))
                }
                _ => Ok(()),
            }
        })
    } else if config.read_only {
        // The kernel writes its dirty pages back at the remount, after the daemon refused
        // changes: write them back first (files still open for writing make the kernel refuse
        // the remount, so no new dirty pages can follow).
        if let Err(e) = syncfs(&target) {
            eprintln!(
                "birch: {}: writing back cached pages before remount,ro: {e}",
                target.display()
            );
        }
        tell(ControlCommand::ReadOnly).and_then(|()| {
            kernel(config.vfs_flags | config.atime_flags() | libc::MS_RDONLY).inspect_err(|_| {
                let _ = tell(ControlCommand::ReadWrite);
            })
        })
    } else {
        // The kernel applies the atime flags to its mount (a remount without any keeps what it
        // had) but cannot to FUSE inodes: the daemon is told what the mount table now says.
        kernel(config.vfs_flags | config.atime_flags())
            .and_then(|()| tell(ControlCommand::ReadWrite))
            .and_then(|()| match mounted_atime(&target) {
                Some(mode) => tell(ControlCommand::Atime(mode)),
                None => Ok(()),
            })
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(format!("{}: remount: {e}", mountpoint.display())),
    }
}

/// Sends a control command to the daemon serving the mount at `mountpoint`: through its
/// control socket (found from the mount's `st_dev`, birch-fuse `daemon::control_socket`;
/// root or the mount's owner), else, when there is none or it cannot be opened (an older
/// daemon, a stale socket, a caller it is not for), as before on the root's
/// `trusted.birch.control` xattr (root only). Every sender uses this. A command the daemon
/// refuses is the errno it answered, as the xattr would have returned it.
pub(crate) fn control(mountpoint: &Path, command: &ControlCommand) -> std::io::Result<()> {
    use birch_fuse::daemon::control_socket::{exchange, find_socket, Refused};
    if let Some(path) = find_socket(mountpoint) {
        match std::os::unix::net::UnixStream::connect(&path) {
            Ok(stream) => {
                return exchange(stream, command, &[]).map_err(|e| {
                    match e
                        .get_ref()
                        .and_then(|inner| inner.downcast_ref::<Refused>())
                    {
                        Some(refused) => std::io::Error::from_raw_os_error(refused.errno),
                        None => std::io::Error::new(
                            e.kind(),
                            format!("control socket {}: {e}", path.display()),
                        ),
                    }
                });
            }
            // Nothing listens (a daemon that was killed), or not for this caller: the xattr
            // answers as it always did.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ECONNREFUSED | libc::ENOENT | libc::EACCES | libc::EPERM)
                ) => {}
            Err(e) => {
                return Err(std::io::Error::new(
                    e.kind(),
                    format!("control socket {}: {e}", path.display()),
                ))
            }
        }
    }
    control_xattr(mountpoint, command)
}

/// [`control`] through the root's `trusted.birch.control` xattr (its wire string; root only).
fn control_xattr(mountpoint: &Path, command: &ControlCommand) -> std::io::Result<()> {
    let command = command.to_string();
    let path = std::ffi::CString::new(mountpoint.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::ErrorKind::InvalidInput)?;
    let name = std::ffi::CString::new(birch_fuse::CONTROL_XATTR)
        .map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: setxattr with valid NUL-terminated strings and a buffer of the given length.
    let rc = unsafe {
        libc::setxattr(
            path.as_ptr(),
            name.as_ptr(),
            command.as_ptr().cast(),
            command.len(),
            0,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// syncfs(2) of the filesystem mounted at `path`: the kernel writes back the pages it holds
/// dirty for it (on a FUSE mount it never reaches the daemon) and reports a writeback that
/// failed since the last syncfs.
pub(crate) fn syncfs(path: &Path) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let dir = std::fs::File::open(path)?;
    // SAFETY: syncfs on a descriptor this function owns.
    if unsafe { libc::syncfs(dir.as_raw_fd()) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every option the man page lists parses, with a number where it names one.
    #[test]
    fn documented_mount_options_parse() {
        for (example, _) in MOUNT_OPTIONS {
            let option = example.replace("SECS", "5").replace('N', "4");
            if let Err(e) = parse_options(std::slice::from_ref(&option)) {
                panic!("documented option {example} ({option}) does not parse: {e}");
            }
        }
        assert!(parse_options(&["no_such_option".into()]).is_err());
    }

    /// The benchmark switches are off unless named, and each sets its own field (benchmark
    /// builds: the `seed-before` feature).
    #[cfg(feature = "seed-before")]
    #[test]
    fn benchmark_switches_are_off_by_default_and_parse() -> Result<(), String> {
        let c = parse_options(&[])?;
        assert!(
            !c.bench_serialize_sync_writes
                && !c.bench_global_objectid_lock
                && !c.bench_apply_per_item
        );
        let c = parse_options(&["bench_serialize_sync_writes,bench_apply_per_item=on".into()])?;
        assert!(c.bench_serialize_sync_writes && c.bench_apply_per_item);
        assert!(!c.bench_global_objectid_lock);
        let c = parse_options(&["bench_global_objectid_lock".into()])?;
        assert!(c.bench_global_objectid_lock && !c.bench_apply_per_item);
        assert!(parse_options(&["bench_apply_per_item=maybe".into()]).is_err());
        Ok(())
    }

    #[test]
    fn errors_takes_three_policies_and_refuses_others() {
        use birch_core::vfs::ErrorPolicy;
        for (text, want) in [
            ("errors=continue", ErrorPolicy::Continue),
            ("errors=remount-ro", ErrorPolicy::RemountRo),
            ("errors=panic", ErrorPolicy::Panic),
        ] {
            let c = parse_options(&[text.to_string()]).expect(text);
            assert_eq!(c.errors, want, "{text}");
        }
        assert_eq!(
            parse_options(&[]).expect("defaults").errors,
            ErrorPolicy::Continue
        );
        for bad in ["errors", "errors=", "errors=ignore"] {
            let e = parse_options(&[bad.to_string()]).err().unwrap_or_default();
            assert!(
                e.contains("errors=continue, remount-ro or panic"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn fault_rules_only_in_a_test_build() {
        let given = parse_options(&["fault=write:eio+percent=5+times=2,fault=flush:lie".into()]);
        if cfg!(feature = "fault-injection") {
            let c = given.expect("a test build takes fault rules");
            assert_eq!(c.faults, ["write:eio,percent=5,times=2", "flush:lie"]);
            let e = parse_options(&["fault=flush:lose".into()]).expect_err("lose is for writes");
            assert!(e.contains("option fault=flush:lose"), "{e}");
            let c = parse_options(&["fault_seed=42".into()]).expect("a seed");
            assert_eq!(c.fault_seed, Some(42));
            for bad in ["fault_seed", "fault_seed=", "fault_seed=-1", "fault_seed=x"] {
                let e = parse_options(&[bad.into()]).expect_err(bad);
                assert!(e.contains("expected fault_seed=N"), "{bad}: {e}");
            }
        } else {
            let e = parse_options(&["fault_seed=42".into()]).expect_err("a seed, shipped");
            assert!(e.contains("built without fault injection"), "{e}");
            let e = match given {
                Err(e) => e,
                Ok(_) => panic!("the shipped build took a fault rule"),
            };
            assert!(e.contains("built without fault injection"), "{e}");
        }
        assert!(parse_options(&["fault=".into()]).is_err());
    }

    #[test]
    fn io_timeout_takes_seconds_and_zero_turns_it_off() {
        assert_eq!(parse_options(&[]).expect("defaults").io_timeout, None);
        for (text, want) in [
            ("io_timeout=1", Some(Duration::from_secs(1))),
            ("io_timeout=0.5", Some(Duration::from_millis(500))),
            ("io_timeout=86400", Some(Duration::from_secs(86400))),
            ("io_timeout=0", None),
        ] {
            assert_eq!(
                parse_options(&[text.into()]).expect(text).io_timeout,
                want,
                "{text}"
            );
        }
        for bad in [
            "io_timeout",
            "io_timeout=",
            "io_timeout=-1",
            "io_timeout=0.05",
            "io_timeout=86401",
            "io_timeout=x",
        ] {
            let e = parse_options(&[bad.into()]).err().unwrap_or_default();
            assert!(e.contains("option io_timeout"), "{bad}: {e}");
        }
    }

    /// Without the `seed-before` feature (the shipped binary) the seeds' "before" switches
    /// are unknown options, refused like any other, and the man page does not list them.
    #[cfg(not(feature = "seed-before"))]
    #[test]
    fn benchmark_switches_are_unknown_options_without_the_feature() {
        for switch in [
            "bench_serialize_sync_writes",
            "bench_global_objectid_lock",
            "bench_apply_per_item",
            "bench_apply_per_item=on",
            "bench_global_objectid_lock=off",
        ] {
            match parse_options(&[format!("rw,{switch}")]) {
                Err(e) => assert!(e.starts_with("unknown mount option"), "{switch}: {e}"),
                Ok(_) => panic!("{switch} accepted without the seed-before feature"),
            }
        }
        assert!(MOUNT_OPTIONS
            .iter()
            .all(|(name, _)| !name.starts_with("bench_")));
    }

    /// FUSE over io_uring is the default (used where the kernel has it), `uring` and
    /// `uring=on` ask for it, `uring=off` turns it off, and the last one given counts.
    #[test]
    fn uring_is_on_by_default_and_can_be_turned_off() -> Result<(), String> {
        assert_eq!(parse_options(&[])?.uring, None);
        assert_eq!(parse_options(&["uring".into()])?.uring, Some(true));
        assert_eq!(parse_options(&["uring=on".into()])?.uring, Some(true));
        assert_eq!(parse_options(&["uring=off".into()])?.uring, Some(false));
        assert_eq!(
            parse_options(&["uring=off,uring".into()])?.uring,
            Some(true)
        );
        assert!(parse_options(&["uring=maybe".into()]).is_err());
        Ok(())
    }
}
