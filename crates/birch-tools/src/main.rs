//! `birch`: mkfs, mount, umount, sync, stats, shutdown, fsck, scrub and inspect for birchfs
//! images.
//!
//! A thin layer over birch-core and birch-fuse: it parses arguments, prints, and picks exit
//! codes. Installed also as `mkfs.birch`, `fsck.birch` (and `fsck.fuse.birch`, which fsck(8)
//! runs for an image fstab lists as fuse.birch) and `mount.fuse.birch`, so `mkfs -t birch`,
//! `fsck -t birch` and `mount -t fuse.birch` work.
//!
//! Exit codes: 0 success; 1 an operation failed (bad option, image missing or in use, not a
//! birchfs image, mount failed); 2 usage error. fsck follows fsck(8): 0 clean, 4 errors left
//! uncorrected, 8 operational error. scrub: 0 clean, 1 damage found, 2 usage or operational
//! error.

mod defrag;
mod docs;
mod errors;
mod fusecrash;
mod mount;
mod scrub;
mod stats;

/// mimalloc: per-thread heaps, so FUSE threads working on different files do not meet in the
/// allocator (glibc malloc showed as a fifth of create time in the engine bench). Built with
/// `no_thp` (workspace Cargo.toml): mimalloc otherwise asks for transparent huge pages on its
/// arenas, and every page it takes again after returning it to the kernel faults in and zeroes
/// 2 MiB; that was 9% of the daemon's CPU under sysbench random writes with fsync after each.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (the index in `mi_option_e` of the mimalloc 3 that
/// libmimalloc-sys builds: `c_src/mimalloc/v3/include/mimalloc.h`).
const MI_OPTION_PURGE_DELAY: std::ffi::c_int = 15;

/// How long memory mimalloc has freed stays mapped before it goes back to the kernel. Its
/// default (1 s) returned the buffers of one commit or log batch just before the next took
/// them again, and every page came back through a page fault that zeroes it: `clear_page_erms`
/// was 7% of the daemon's CPU under sysbench random writes with fsync after each, and under 1%
/// with 30 s (DESIGN §12.4). An idle daemon still gives the memory back after 30 s.
const PURGE_DELAY_MS: std::ffi::c_long = 30_000;

extern "C" {
    /// mimalloc's `mi_option_set` (the C library libmimalloc-sys links in).
    fn mi_option_set(option: std::ffi::c_int, value: std::ffi::c_long);
}

/// Sets mimalloc's options for a long-running process (see [`PURGE_DELAY_MS`]), unless the
/// environment sets them (`MIMALLOC_PURGE_DELAY`, read by mimalloc itself).
fn tune_allocator() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: mi_option_set only stores the value in mimalloc's option table (atomically);
    // the option index and the value's type are mimalloc 3's (see MI_OPTION_PURGE_DELAY).
    unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS) };
}

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use birch_core::check::{check, check_replayed, CheckOptions, FindingKind, PassId, PASSES};
use birch_core::control::ControlCommand;
use birch_core::device::{
    create_rbd_image, open_image, BlockDevice, CephOptions, ImageOptions, OpenMode, RbdSpec,
};
use birch_core::repair::{repair, RepairMode};
use birch_core::space::SpaceReport;
use birch_core::{Engine, Filesystem, MkfsOptions};
use birch_format::node::{Expect, Node};
use birch_format::{FS_TREE_ID, NODE_SIZE};
use clap::{Parser, Subcommand};
use stats::human_bytes;

#[derive(Parser)]
#[command(
    name = "birch",
    version,
    about = "birchfs: a copy-on-write B-tree filesystem in userspace",
    after_help = "Exit codes: 0 success, 1 operation failed, 2 usage error; fsck: 0 clean, 1 errors corrected (--repair, -p), 4 errors left, 8 operational error; scrub: 0 clean, 1 damage found, 2 usage or operational error."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Make a new birchfs filesystem in an image file (created if missing), on a block device,
    /// or on a Ceph RBD image `rbd:POOL/IMAGE` (created with --size if missing; needs a build
    /// with the `rbd` feature).
    Mkfs {
        /// Size of the image, e.g. 1G, 512M (an image file is created or grown to it).
        #[arg(long, short)]
        size: Option<String>,
        /// Volume label.
        #[arg(long, short = 'L', default_value = "")]
        label: String,
        /// Overwrite an existing filesystem.
        #[arg(long, short)]
        force: bool,
        image: PathBuf,
        /// Size in 1 KiB blocks, as `mkfs -t birch DEVICE BLOCKS` passes it (the same as
        /// --size BLOCKSK).
        #[arg(conflicts_with = "size")]
        blocks: Option<u64>,
        #[command(flatten)]
        ceph: CephArgs,
    },
    /// Mount an image. Returns once the mount is live; the daemon serves in the background.
    Mount {
        image: PathBuf,
        mountpoint: PathBuf,
        /// Options: ro, rw, allow_other, commit=SECS (default 5), threads=N (request loops,
        /// default one per CPU, 2..8), waiters=N (requests waiting for the device at once,
        /// default 64), ttl=SECS (default 60), fsync=log|commit, compress=zstd|zstd:N|lz4|none (store written data compressed, default none), writeback=on|off (default on),
        /// keep_cache=on|off (default on), buffer=on|off (default on), uring=on|off (FUSE
        /// over io_uring, by default wherever the kernel's enable_uring allows it), and the
        /// usual VFS options (defaults, noatime, relatime, strictatime, nodiratime, nodev,
        /// nosuid, noexec, _netdev). An unknown option is an error.
        #[arg(short = 'o')]
        options: Vec<String>,
        /// Stay in the foreground.
        #[arg(short = 'f', long)]
        foreground: bool,
    },
    /// Unmount; returns after the daemon's final commit released the image.
    Umount { mountpoint: PathBuf },
    /// Commit everything on a live mount now, with the pages the kernel holds dirty for it
    /// (sync(2) writes those back but never reaches a FUSE daemon).
    Sync { mountpoint: PathBuf },
    /// Rewrite files of a live mount compressed: each 128 KiB chunk held in plain blocks is
    /// compressed and kept if it saves at least 1/8 (holes, preallocated and cloned ranges
    /// are left as they are). The bytes read the same; times do not change. Prints each
    /// file's size on disk before and after. Needs root.
    Defrag {
        /// The codec: zstd (level 1), zstd:N (N from 1 to 19) or lz4.
        #[arg(long, value_name = "CODEC", num_args = 0..=1, require_equals = true, default_missing_value = "zstd", required = true)]
        compress: Option<String>,
        /// Directories: every regular file under them, on the same mount.
        #[arg(short = 'r', long)]
        recursive: bool,
        /// Files (directories with -r) on a birch mount.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Shut a live mount down, as a crash would but after a last step: by default the
    /// kernel's dirty pages are written back and everything is committed (what the
    /// FS_IOC_SHUTDOWN ioctl does through a mount). Afterwards every operation on the mount
    /// fails with EIO and nothing more reaches the image; unmount it, and the next mount
    /// recovers (log replay). Needs root.
    Shutdown {
        mountpoint: PathBuf,
        /// Write the fsync log only, then stop: what fsync acknowledged survives, nothing
        /// else since the last commit.
        #[arg(long, conflicts_with = "now")]
        log: bool,
        /// Stop now: no commit and no log write; only what was already durable survives.
        #[arg(long)]
        now: bool,
    },
    /// Print the live counters of a mount: free space, dirty (buffered) bytes, log fill,
    /// node cache hit rate, commit and fsync latency percentiles, and every counter since
    /// the mount. Needs root (the counters are the root's trusted.birch.stats xattr).
    Stats {
        mountpoint: PathBuf,
        /// Print rates per second every SECS seconds (default 1), one row per interval, like
        /// iostat; latencies are those of the interval.
        #[arg(long, short = 'w', value_name = "SECS", num_args = 0..=1, default_missing_value = "1")]
        watch: Option<f64>,
        /// With --watch: stop after N intervals.
        #[arg(long, short = 'c', value_name = "N", requires = "watch")]
        count: Option<u64>,
        /// JSON for scripts: one object, or one per line with --watch.
        #[arg(long, conflicts_with = "prometheus")]
        json: bool,
        /// The Prometheus text format (node_exporter's textfile collector): counters as
        /// birch_NAME_total, gauges as birch_NAME, latency percentiles; one reading.
        #[arg(long, conflicts_with = "watch")]
        prometheus: bool,
    },
    /// Check an image (read-only unless --repair or -p). Refuses an image a live mount
    /// holds. Each finding is printed with its kind and stable number, e.g.
    /// `NodeUnreadable [002]: ...`.
    Fsck {
        /// The image (not needed with --list-passes).
        #[arg(required_unless_present = "list_passes")]
        image: Option<PathBuf>,
        /// Print the passes (id, name, dependencies, what each checks) and the finding kinds
        /// with their numbers, then exit.
        #[arg(long)]
        list_passes: bool,
        /// Also read every data block and verify its checksum; with --repair, punch the
        /// blocks that fail out of their files (the ranges read as zeros and are printed).
        #[arg(long)]
        data: bool,
        /// Look at an image even while it is mounted (results may be inconsistent).
        #[arg(long)]
        force: bool,
        /// Repair what the check finds (DESIGN §13.4): fall back to the newest whole backup
        /// root when the newest tree is damaged (with none whole, salvage every readable
        /// leaf into a new tree and print the key ranges lost), drop dangling names, undecodable items,
        /// misaligned extents and extents on blocks that are not the file's (every path and
        /// byte range that lost data is printed), trim overlapping extents, rewrite bad inline
        /// extents as blocks, remove xattrs whose chunks are damaged, remake a missing root
        /// directory, reattach inodes without names under /lost+found, recompute link counts
        /// and sizes, rewrite a bad superblock copy. Each repair is a copy-on-write commit. A
        /// pending fsync log is replayed first. -y and -r are the same.
        #[arg(long, short = 'y', short_alias = 'r', conflicts_with_all = ["preen", "dry_run"])]
        repair: bool,
        /// Preen (fsck(8) -p, -a): fix only what loses nothing (link counts, directory sizes,
        /// sizes that must cover their extents, stale orphan items, the missing half of a
        /// name, a bad superblock copy); anything else is reported and left (exit 4).
        #[arg(long, short = 'p', short_alias = 'a', conflicts_with = "dry_run")]
        preen: bool,
        /// Dry run: do the whole repair on a copy in memory, print what it would do and what
        /// a second check would find; the image is not written. Exit 0 clean, 4 errors.
        #[arg(long = "dry-run", short = 'n')]
        dry_run: bool,
        /// Accepted for fsck(8) (e2fsck's "check even if clean"): birch fsck always checks.
        #[arg(short = 'f', hide = true)]
        always: bool,
        /// Accepted for fsck(8)'s -C (progress to a file descriptor); no progress is written.
        #[arg(short = 'C', value_name = "FD", num_args = 0..=1, hide = true)]
        progress_fd: Option<Option<String>>,
        #[command(flatten)]
        ceph: CephArgs,
    },
    /// Verify every checksum of a filesystem, offline (image) or online (mount point).
    ///
    /// Reads every node and data block the filesystem references once, in the live tree and
    /// in every snapshot: offline on an unmounted IMAGE, or online through the root of a live
    /// mount (the daemon scrubs in a thread of its own; needs root; the mount commits first).
    /// Each damaged block is printed with the inodes and paths it belongs to (a snapshot's
    /// under /.snapshot/NAME). Scrub only detects: with one copy of each block it cannot
    /// heal. An interrupted scrub prints the position to go on from with --resume. Exit
    /// codes: 0 clean, 1 damage found, 2 usage or operational error (including an
    /// interrupted or cancelled scrub).
    Scrub {
        /// An image file or block device (offline), or a mount point (online).
        target: PathBuf,
        /// Read at most this many MB/s (10^6 bytes); 0 is unlimited. Default: unlimited
        /// offline, 100 online.
        #[arg(long, value_name = "MB/s")]
        rate: Option<f64>,
        /// Print the report as one JSON object.
        #[arg(long)]
        json: bool,
        /// Offline: read an image even while it is mounted (a live mount changes it under
        /// the scrub, so damage may be misreported; scrub the mount point instead).
        #[arg(long)]
        force: bool,
        /// Start where an interrupted scrub stopped: the position it printed
        /// (`live@OBJECTID:TYPE:OFFSET` or `snapshot-ID@OBJECTID:TYPE:OFFSET`).
        #[arg(long, value_name = "POSITION")]
        resume: Option<String>,
    },
    /// List the files a mount found damaged: data reads that failed (device error or checksum),
    /// written data the device lost, blocks the last online scrub found damaged (what `zpool
    /// status -v` calls permanent errors). The list lasts for the mount; the device's error
    /// counts across mounts are in `birch stats` (lifetime_*). Exit codes: 0 none, 1 some, 2
    /// the list could not be read. Root only.
    Errors {
        /// The mount point.
        mountpoint: PathBuf,
        /// Print the daemon's JSON.
        #[arg(long, conflicts_with = "clear")]
        json: bool,
        /// Forget the listed files and set the lifetime device error counts to zero (after
        /// the damage was dealt with: files restored, disk replaced), as `zpool clear` and
        /// `btrfs device stats -z` do; written by a commit before this returns.
        #[arg(long)]
        clear: bool,
    },
    /// Test builds only (a daemon built with the `fault-injection` feature): tell the mount's
    /// fault-injecting device to add RULE (`OP:EFFECT[,range=START-END][,after=N][,percent=P]
    /// [,times=N]`; OP read, write or flush; EFFECT eio, nospace, lose, misdirect=DELTA, lie,
    /// delay=MS or hang), `clear` every rule, or `release` hung requests.
    #[command(hide = true)]
    Fault {
        /// The mount point.
        mountpoint: PathBuf,
        /// A rule, `clear` or `release`.
        command: String,
    },
    /// Run the crash matrix: each workload on a recording in-memory device, then every crash
    /// state (each flush point, plus seeded subsets of unflushed writes, some torn) recovered,
    /// fsck'd and judged. Exit 0 when every state passes.
    Crashtest {
        /// Workloads: append+fsync, wal appends+fsync, link/rename+fsync,
        /// punch/fallocate/truncate+fsync, many files+symlink+xattr, big tree+commits, ace,
        /// shutdown (three runs: commit, log, now), snapshots+fsync (four seeded runs),
        /// clone+fsync, snapshots+rollback (four seeded runs: snapshot steps, two rollbacks
        /// of the closed image, one after a clean close and one with the fsync log pending,
        /// then more steps), blobs+fsync (a file compressed, then cut, overwritten in part,
        /// cloned and truncated inside its blobs) (default: all).
        #[arg(long)]
        workload: Vec<String>,
        /// Seed (printed; the same seed replays the same states).
        #[arg(long)]
        seed: Option<u64>,
        /// Crash states per workload run.
        #[arg(long, default_value_t = 100)]
        states: usize,
        /// Runs of the ACE workload (each with the next seed).
        #[arg(long, default_value_t = 10)]
        ace_runs: u64,
        /// Runs of the FUSE-level workload: real system calls on a mount of this process
        /// over a recording device: the writeback cache in two runs of three, ttl=0 and
        /// keep_cache=off in every other run. Needs root and /dev/fuse.
        #[arg(long, default_value_t = 0)]
        fuse_runs: u64,
    },
    /// Snapshots (read-only copies of the whole filesystem at a commit) of a mounted
    /// filesystem (MNT, its mount point: through the daemon) or of an unmounted image:
    /// create, list, delete. Each is browsable read-only at MNT/.snapshot/NAME.
    Snapshot {
        #[command(subcommand)]
        action: SnapshotAction,
    },
    /// Roll an unmounted image back to snapshot NAME: one commit makes the snapshot's tree
    /// the live one (the fsync log is replayed first); the snapshot stays, inode numbers are
    /// never reused, and the space only the replaced state held is free again. Refused while
    /// newer snapshots exist, unless -r destroys them in the same commit. A mounted image is
    /// locked: unmount it first.
    Rollback {
        image: PathBuf,
        name: String,
        /// Delete the snapshots newer than NAME (ZFS's rollback -r).
        #[arg(short = 'r', long)]
        destroy_newer: bool,
        #[command(flatten)]
        ceph: CephArgs,
    },
    /// The paths that changed from snapshot SNAP1 to snapshot SNAP2 (absent: the live state
    /// as last committed) of an unmounted image, or of a mounted one when IMAGE is its mount
    /// point (the live state then committed first; needs root), one line each as `zfs diff` prints them:
    /// `+ /path` created, `- /path` removed, `M /path` modified (contents, attributes other
    /// than atime, xattrs; a directory whose entries changed), `R /old -> /new` renamed. Each
    /// hard link is listed. The walk skips what both trees share: its cost grows with the
    /// change, not with the filesystem.
    Diff {
        image: PathBuf,
        snap1: String,
        snap2: Option<String>,
        /// Print the nodes the walk read and the shared subtrees it skipped (on stderr).
        #[arg(long)]
        stats: bool,
        #[command(flatten)]
        ceph: CephArgs,
    },
    /// Print on-disk structures: super, tree fs, node ADDR, inode N, log; or where the
    /// space goes: space.
    ///
    /// `space` opens the image read-only (a pending fsync log is replayed in memory) and
    /// prints one line per category, in bytes and blocks, with what it means: the device;
    /// reserved (superblocks and the fsync log area); the live tree's nodes; the snapshot
    /// list's nodes; the data the live tree names (each block once), of which shared (blocks
    /// more than one extent names: clones); what only snapshots hold (blocks their trees name
    /// and the live tree does not, in total, then per snapshot what deleting it alone gives
    /// back); unnamed (used blocks no tree names: 0 on a healthy image); free as statfs counts
    /// it, of which available to data. Used + free = device. A replayed log's data counts as
    /// the live tree's.
    Inspect {
        image: PathBuf,
        #[arg(num_args = 1..=2)]
        what: Vec<String>,
        #[command(flatten)]
        ceph: CephArgs,
    },
}

#[derive(Subcommand)]
enum SnapshotAction {
    /// Make snapshot NAME of the filesystem as it is now (atomic with one commit; through a
    /// mount, the kernel's dirty pages are written first). The first snapshot sets an
    /// incompat flag: older builds then refuse the image.
    Create {
        /// The image, or the mount point of a mounted birchfs.
        #[arg(value_name = "IMAGE|MNT")]
        image: PathBuf,
        name: String,
        #[command(flatten)]
        ceph: CephArgs,
    },
    /// List the snapshots: id, generation, creation time (UTC seconds), the space only the
    /// snapshot holds (what deleting it alone gives back: human-readable and exact bytes),
    /// name.
    List {
        /// The image, or the mount point of a mounted birchfs.
        #[arg(value_name = "IMAGE|MNT")]
        image: PathBuf,
        #[command(flatten)]
        ceph: CephArgs,
    },
    /// Delete snapshot NAME; the blocks only it held are free once its commit is durable.
    /// Through a mount, refused (EBUSY) while a file is open under MNT/.snapshot/NAME.
    Delete {
        /// The image, or the mount point of a mounted birchfs.
        #[arg(value_name = "IMAGE|MNT")]
        image: PathBuf,
        name: String,
        #[command(flatten)]
        ceph: CephArgs,
    },
}

/// Cluster access for an `rbd:POOL/IMAGE` image, as `rbd --id/-c/--keyring` and the mount
/// options `ceph_id=`, `ceph_conf=`, `keyring=`; unset, librados reads `CEPH_CONF`,
/// `CEPH_ARGS` and /etc/ceph.
#[derive(clap::Args, Clone, Default)]
struct CephArgs {
    /// rbd: images: Ceph client id (without `client.`; default admin).
    #[arg(long, value_name = "ID")]
    ceph_id: Option<String>,
    /// rbd: images: ceph.conf to read (default: CEPH_CONF, then /etc/ceph/ceph.conf).
    #[arg(long, value_name = "PATH")]
    ceph_conf: Option<PathBuf>,
    /// rbd: images: keyring holding the client's key.
    #[arg(long, value_name = "PATH")]
    keyring: Option<PathBuf>,
}

impl CephArgs {
    fn image_options(&self, holder: &str) -> ImageOptions {
        ImageOptions {
            ceph: CephOptions {
                id: self.ceph_id.clone(),
                conf: self.ceph_conf.clone(),
                keyring: self.keyring.clone(),
                ..CephOptions::default()
            },
            holder: holder.to_string(),
            events: None,
        }
    }
}

fn main() -> ExitCode {
    tune_allocator();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let argv0 = std::env::args().next().unwrap_or_default();
    let name = Path::new(&argv0)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut args: Vec<String> = std::env::args().collect();
    match name.as_str() {
        "mkfs.birch" => args.insert(1, "mkfs".into()),
        // fsck(8) runs fsck.fuse.birch for an image that fstab lists with type fuse.birch.
        "fsck.birch" | "fsck.fuse.birch" => args.insert(1, "fsck".into()),
        "mount.fuse.birch" | "mount.birch" => return mount::helper_main(&args[1..]),
        _ => {}
    }
    // `birch gen-docs DIR` writes the man pages and completions (scripts/package.sh). Kept out
    // of the clap definitions so that neither the help, the pages nor the completions it
    // writes offer it.
    if let [_, command, dir] = args.as_slice() {
        if command == "gen-docs" && !dir.starts_with('-') {
            return match docs::generate(Path::new(dir)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => fail(format!("gen-docs: {e}")),
            };
        }
    }
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    // Output into a closed pipe (`birch inspect IMG tree fs | head`) ends a command quietly,
    // as for any Unix tool, instead of a panic in println!. Not for a mount: its daemon must
    // outlive whatever its stderr was piped into.
    if !matches!(
        cli.command,
        Command::Mount { .. } | Command::Crashtest { .. }
    ) {
        // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    match cli.command {
        Command::Mkfs {
            size,
            label,
            force,
            image,
            blocks,
            ceph,
        } => {
            let size = size.or_else(|| blocks.map(|b| format!("{b}K")));
            mkfs(&image, size.as_deref(), label, force, &ceph)
        }
        Command::Mount {
            image,
            mountpoint,
            options,
            foreground,
        } => mount::mount_main(&image, &mountpoint, &options, foreground),
        Command::Umount { mountpoint } => mount::umount(&mountpoint),
        Command::Sync { mountpoint } => sync(&mountpoint),
        Command::Defrag {
            compress,
            recursive,
            paths,
        } => defrag::defrag(&paths, compress.as_deref().unwrap_or("zstd"), recursive),
        Command::Stats {
            mountpoint,
            watch,
            count,
            json,
            prometheus,
        } => {
            let format = match (json, prometheus) {
                (_, true) => stats::Format::Prometheus,
                (true, false) => stats::Format::Json,
                (false, false) => stats::Format::Table,
            };
            stats::stats_main(&mountpoint, watch, count, format)
        }
        Command::Shutdown {
            mountpoint,
            log,
            now,
        } => shutdown(&mountpoint, log, now),
        Command::Fsck {
            image,
            list_passes,
            data,
            force,
            ceph,
            repair,
            preen,
            dry_run,
            ..
        } => match image {
            Some(image) if !list_passes => {
                let mode = if repair {
                    Some(RepairMode::Full)
                } else if preen {
                    Some(RepairMode::Preen)
                } else if dry_run {
                    Some(RepairMode::DryRun)
                } else {
                    None
                };
                match mode {
                    Some(mode) => fsck_repair(&image, data, force, mode, &ceph),
                    None => fsck(&image, data, force, &ceph),
                }
            }
            _ => list_fsck_passes(),
        },
        Command::Scrub {
            target,
            rate,
            json,
            force,
            resume,
        } => scrub::scrub_main(&target, rate, json, force, resume.as_deref()),
        Command::Errors {
            mountpoint,
            json,
            clear,
        } => errors::errors_main(&mountpoint, json, clear),
        Command::Fault {
            mountpoint,
            command,
        } => fault(&mountpoint, command),
        Command::Inspect { image, what, ceph } => inspect(&image, &what, &ceph),
        Command::Snapshot { action } => snapshot(action),
        Command::Diff {
            image,
            snap1,
            snap2,
            stats,
            ceph,
        } => diff(&image, &snap1, snap2.as_deref(), stats, &ceph),
        Command::Rollback {
            image,
            name,
            destroy_newer,
            ceph,
        } => rollback(&image, &name, destroy_newer, &ceph),
        Command::Crashtest {
            workload,
            seed,
            states,
            ace_runs,
            fuse_runs,
        } => crashtest(&workload, seed, states, ace_runs, fuse_runs),
    }
}

fn fail(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("birch: {message}");
    ExitCode::from(1)
}

/// Parses sizes like 1G, 512M, 4096.
pub(crate) fn parse_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, unit) = text.split_at(
        text.find(|c: char| !c.is_ascii_digit())
            .unwrap_or(text.len()),
    );
    let n: u64 = digits.parse().ok()?;
    let mult = match unit
        .trim_end_matches(['B', 'b', 'i'])
        .to_ascii_uppercase()
        .as_str()
    {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        "T" => 1 << 40,
        _ => return None,
    };
    n.checked_mul(mult)
}

/// Names a filesystem signature found on the device, if any.
fn existing_signature(path: &Path) -> Option<&'static str> {
    let dev = open_image(path, OpenMode::ReadOnlyUnlocked, &ImageOptions::default()).ok()?;
    signature_of(&*dev)
}

/// Names a filesystem signature found on an open device, if any.
fn signature_of(dev: &dyn BlockDevice) -> Option<&'static str> {
    let mut head = vec![0u8; 128 * 1024];
    let len = (dev.size_bytes() as usize).min(head.len()) / 4096 * 4096;
    dev.read_at(&mut head[..len], 0).ok()?;
    if Engine::read_superblock(dev).is_ok() {
        return Some("birchfs");
    }
    if len > 0x438 + 2 && head[0x438] == 0x53 && head[0x439] == 0xef {
        return Some("ext2/3/4");
    }
    if len >= 4 && &head[0..4] == b"XFSB" {
        return Some("xfs");
    }
    if len > 0x10040 + 8 && &head[0x10040..0x10048] == b"_BHRfS_M" {
        return Some("btrfs");
    }
    None
}

fn mkfs(image: &Path, size: Option<&str>, label: String, force: bool, ceph: &CephArgs) -> ExitCode {
    let size = match size.map(parse_size) {
        Some(None) => {
            return fail(format!(
                "--size {size:?}: not a size (examples: 1G, 512M, 65536)"
            ))
        }
        Some(Some(s)) => Some(s),
        None => None,
    };
    match RbdSpec::from_path(image) {
        Ok(Some(spec)) => return mkfs_rbd(&spec, image, size, label, force, ceph),
        Ok(None) => {}
        Err(e) => return fail(e),
    }
    if size.is_none() && !image.exists() {
        return fail(format!(
            "{}: does not exist; give --size to create an image file",
            image.display()
        ));
    }
    if image.exists() && !force {
        if let Some(kind) = existing_signature(image) {
            return fail(format!(
                "{}: holds a {kind} filesystem; use --force to overwrite it",
                image.display()
            ));
        }
    }
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_message(format!(
        "writing {} (log area, superblocks, root)",
        image.display()
    ));
    spinner.enable_steady_tick(std::time::Duration::from_millis(120));
    let result = Filesystem::mkfs_path(
        image,
        size,
        &MkfsOptions {
            label,
            log_bytes: 0,
        },
    );
    spinner.finish_and_clear();
    match result {
        Ok(()) => {
            println!("birch: made a birchfs filesystem on {}", image.display());
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}

/// `birch mkfs rbd:POOL/IMAGE`: creates the image (layering and exclusive-lock set
/// explicitly) when --size is given and it does not exist, then formats it under the image
/// lock; an existing birchfs (or other filesystem) only with --force.
fn mkfs_rbd(
    spec: &RbdSpec,
    image: &Path,
    size: Option<u64>,
    label: String,
    force: bool,
    ceph: &CephArgs,
) -> ExitCode {
    let options = ceph.image_options("mkfs");
    let created = match size {
        Some(size) => match create_rbd_image(spec, size, &options.ceph) {
            Ok(created) => created,
            Err(e) => return fail(e),
        },
        None => false,
    };
    let device = match open_image(image, OpenMode::ReadWrite, &options) {
        Ok(d) => d,
        Err(e) => return fail(e),
    };
    if !created {
        if let Some(size) = size.filter(|s| *s != device.size_bytes()) {
            eprintln!(
                "birch: {spec} exists with {} bytes, not {size}: formatting it at its own size (rbd resize changes it)",
                device.size_bytes()
            );
        }
        if !force {
            if let Some(kind) = signature_of(&*device) {
                return fail(format!(
                    "{spec}: holds a {kind} filesystem; use --force to overwrite it"
                ));
            }
        }
    }
    let result = Filesystem::mkfs(
        device,
        &MkfsOptions {
            label,
            log_bytes: 0,
        },
    );
    match result {
        Ok(()) => {
            let how = if created { "created and made" } else { "made" };
            println!("birch: {how} a birchfs filesystem on {spec}");
            ExitCode::SUCCESS
        }
        Err(e) => fail(format!("{spec}: {e}")),
    }
}

/// `birch fault MNT COMMAND`: a command for a test build's fault-injecting device.
fn fault(mountpoint: &Path, command: String) -> ExitCode {
    match mount::control(mountpoint, &ControlCommand::Fault(command.clone())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => fail(format!(
            "{}: fault {command:?}: the mount's daemon was built without fault injection",
            mountpoint.display()
        )),
        Err(e) => fail(format!(
            "{}: fault {command:?}: {e} (a rule is OP:EFFECT[,range=START-END][,after=N]\
             [,percent=P][,times=N]; the daemon's log says why it refused)",
            mountpoint.display()
        )),
    }
}

fn sync(mountpoint: &Path) -> ExitCode {
    let dir = match std::fs::File::open(mountpoint) {
        Ok(f) => f,
        Err(e) => return fail(format!("{}: sync: {e}", mountpoint.display())),
    };
    // syncfs(2) writes back the pages the kernel holds dirty for the mount (it never reaches
    // the daemon itself); then the control command `sync` commits everything the daemon holds,
    // its write buffer included. (An fsync of the root directory would not: it logs or commits
    // the root's own changes only, and with none it does nothing.) The commit goes ahead after
    // a failed writeback: what was written back is committed.
    let written_back = mount::syncfs(mountpoint);
    match mount::control(mountpoint, &ControlCommand::Sync) {
        Ok(()) => {}
        // Control commands need CAP_SYS_ADMIN (or, on a user's own mount, its owner). What an
        // unprivileged caller can still do is fsync the root directory; it is said plainly
        // that this does not make the other files durable.
        Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM | libc::EACCES)) => {
            let _ = dir.sync_all();
            return fail(format!(
                "{}: sync: committing everything the daemon holds needs CAP_SYS_ADMIN (or, on \
                 a user's own mount, its owner) ({e}); the kernel's cached pages were written \
                 back to the daemon and the root directory was fsynced, but other files are \
                 durable only at the next commit (commit= seconds) or their own fsync",
                mountpoint.display()
            ));
        }
        Err(e) if e.raw_os_error() == Some(libc::EIO) => {
            return fail(format!(
                "{}: sync: committed, but the buffered data of some file was lost since the \
                 last sync ({e}; the daemon's log names the inodes, whose fsync reports EIO)",
                mountpoint.display()
            ))
        }
        Err(e) => return fail(format!("{}: sync: commit: {e}", mountpoint.display())),
    }
    match written_back {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(format!(
            "{}: sync: committed, but writing back cached pages failed: {e} (the application \
             that wrote them sees this error from fsync or close)",
            mountpoint.display()
        )),
    }
}

fn shutdown(mountpoint: &Path, log: bool, now: bool) -> ExitCode {
    let command = match (log, now) {
        (_, true) => ControlCommand::ShutdownNow,
        (true, false) => ControlCommand::ShutdownLog,
        (false, false) => {
            // The default commits what the daemon has; first the pages the kernel holds
            // dirty reach it (a failed writeback is reported by the application's fsync or
            // close, as for `birch sync`).
            if let Err(e) = mount::syncfs(mountpoint) {
                eprintln!(
                    "birch: {}: shutdown: writing back cached pages: {e}",
                    mountpoint.display()
                );
            }
            ControlCommand::Shutdown
        }
    };
    match mount::control(mountpoint, &command) {
        Ok(()) => ExitCode::SUCCESS,
        // The daemon shuts down even when the step before it fails (a filesystem an error
        // already turned read-only cannot commit or write its log).
        Err(e) if matches!(e.raw_os_error(), Some(libc::EROFS | libc::EIO)) => fail(format!(
            "{}: shutdown: the filesystem is shut down, but the {} before it failed ({e}): \
             what fsync acknowledged is durable, later changes are not",
            mountpoint.display(),
            if log { "log write" } else { "commit" }
        )),
        Err(e) => fail(format!("{}: shutdown: {e}", mountpoint.display())),
    }
}

/// `birch fsck --list-passes`: the pass table, then every finding kind with its number and
/// the pass that reports it.
fn list_fsck_passes() -> ExitCode {
    let name_of = |id: PassId| PASSES.iter().find(|p| p.id == id).map_or("?", |p| p.name);
    println!("passes (in run order):");
    for pass in &PASSES {
        let deps: Vec<&str> = pass.depends_on.iter().map(|d| name_of(*d)).collect();
        let deps = if deps.is_empty() {
            "-".to_string()
        } else {
            deps.join(",")
        };
        println!(
            "{:>2} {:<13} after: {:<17} {}",
            pass.id.number(),
            pass.name,
            deps,
            pass.checks
        );
    }
    println!("findings:");
    for kind in FindingKind::ALL {
        let passes: Vec<&str> = PASSES
            .iter()
            .filter(|p| p.finds.contains(&kind))
            .map(|p| p.name)
            .collect();
        println!(
            "{:03} {:<24} {}",
            kind.code(),
            format!("{kind:?}"),
            passes.join(",")
        );
    }
    ExitCode::SUCCESS
}

fn fsck(image: &Path, data: bool, force: bool, ceph: &CephArgs) -> ExitCode {
    let mode = if force {
        OpenMode::ReadOnlyUnlocked
    } else {
        OpenMode::ReadOnly
    };
    let device = match open_image(image, mode, &ceph.image_options("fsck")) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("birch fsck: {e}");
            return ExitCode::from(8);
        }
    };
    // A spinner on a terminal while the passes run (silent when not a terminal).
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_message(format!("checking {}", image.display()));
    spinner.enable_steady_tick(std::time::Duration::from_millis(120));
    let result = check(&*device, CheckOptions { data });
    // With fsyncs logged since the last commit, also check what the next mount will see: the
    // log replayed in memory (the image is not written).
    let replayed = match &result {
        Ok(report) if report.log_batches > 0 => {
            Some(check_replayed(device.clone(), CheckOptions { data }))
        }
        _ => None,
    };
    spinner.finish_and_clear();
    match result {
        Ok(report) => {
            for finding in &report.findings {
                println!("{finding}");
            }
            let generation = report.superblock.as_ref().map_or(0, |s| s.generation);
            println!("{}: generation {generation}, {} nodes, {} items, {} inodes, {} data blocks, {} findings", image.display(), report.nodes, report.items, report.inodes, report.data_blocks, report.findings.len());
            let mut clean = report.is_clean();
            if report.log_batches > 0 {
                println!(
                    "{}: {} log batches ({} records) wait for replay at the next read-write mount",
                    image.display(),
                    report.log_batches,
                    report.log_records
                );
            }
            match replayed {
                Some(Ok(after)) => {
                    for finding in &after.findings {
                        println!("after replay: {finding}");
                    }
                    println!(
                        "{}: with the log replayed in memory: {} inodes, {} findings",
                        image.display(),
                        after.inodes,
                        after.findings.len()
                    );
                    clean &= after.is_clean();
                }
                Some(Err(e)) => {
                    println!(
                        "{}: replaying the log in memory failed: {e}",
                        image.display()
                    );
                    clean = false;
                }
                None => {}
            }
            if clean {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(4)
            }
        }
        Err(e) => {
            eprintln!("birch fsck: {}: {e}", image.display());
            ExitCode::from(8)
        }
    }
}

/// `birch fsck --repair`, `-p` / `-a`, `-n`: repairs (or, with -n, repairs a copy in
/// memory), printing the findings before, each change, what was left, and the check after.
/// Exit codes as fsck(8): 0 clean, 1 errors corrected, 4 errors left, 8 operational error.
fn fsck_repair(
    image: &Path,
    data: bool,
    force: bool,
    mode: RepairMode,
    ceph: &CephArgs,
) -> ExitCode {
    let open_mode = match (mode, force) {
        (RepairMode::DryRun, true) => OpenMode::ReadOnlyUnlocked,
        (RepairMode::DryRun, false) => OpenMode::ReadOnly,
        _ => OpenMode::ReadWrite,
    };
    let device = match open_image(image, open_mode, &ceph.image_options("fsck")) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("birch fsck: {e}");
            return ExitCode::from(8);
        }
    };
    let report = match repair(device, mode, CheckOptions { data }) {
        Ok(report) => report,
        Err(e) => {
            eprintln!("birch fsck: {}: repair failed: {e}", image.display());
            return ExitCode::from(8);
        }
    };
    let show = image.display();
    for finding in &report.before.findings {
        println!("{finding}");
    }
    println!(
        "{show}: generation {}, {} findings before repair",
        report
            .before
            .superblock
            .as_ref()
            .map_or(0, |s| s.generation),
        report.before.findings.len()
    );
    let verb = if mode == RepairMode::DryRun {
        "would repair"
    } else {
        "repaired"
    };
    for action in &report.actions {
        println!("{verb}: {action}");
    }
    for lost in &report.lost {
        println!("lost: {lost}");
    }
    for refused in &report.refused {
        println!("left: {refused}");
    }
    if let Some(after) = &report.after {
        for finding in &after.findings {
            println!("after repair: {finding}");
        }
        println!(
            "{show}: after repair: generation {}, {} findings",
            after.superblock.as_ref().map_or(0, |s| s.generation),
            after.findings.len()
        );
    }
    let code = report.exit_code();
    let code = match mode {
        // A dry run corrected nothing on the image: its code is the check's.
        RepairMode::DryRun if code == 1 => 4,
        _ => code,
    };
    if code == 4 && mode == RepairMode::Preen {
        eprintln!("birch fsck: {show}: errors left; run birch fsck --repair {show}");
    }
    ExitCode::from(code)
}

/// `birch snapshot create|list|delete IMAGE [NAME]` on an unmounted image (locked while
/// open; a mounted image is refused as by every other command that writes it).
fn snapshot(action: SnapshotAction) -> ExitCode {
    let (image, ceph, writable) = match &action {
        SnapshotAction::Create { image, ceph, .. } | SnapshotAction::Delete { image, ceph, .. } => {
            (image, ceph, true)
        }
        SnapshotAction::List { image, ceph } => (image, ceph, false),
    };
    let show = image.display();
    if image.is_dir() {
        return snapshot_through_mount(&action, image);
    }
    let mode = if writable {
        OpenMode::ReadWrite
    } else {
        OpenMode::ReadOnly
    };
    let device = match open_image(image, mode, &ceph.image_options("snapshot")) {
        Ok(d) => d,
        Err(e) => return fail(format!("{show}: {e}")),
    };
    let fs = match Filesystem::open_device(
        device,
        birch_core::OpenOptions {
            commit_interval: None,
            read_only: !writable,
            wait_for_lock: false,
            ..Default::default()
        },
    ) {
        Ok(fs) => fs,
        Err(e) => return fail(format!("{show}: {e}")),
    };
    let result = match &action {
        SnapshotAction::Create { name, .. } => fs.create_snapshot(name).map(|s| {
            println!(
                "{show}: snapshot {:?} created: id {}, generation {}",
                s.name, s.id, s.generation
            );
        }),
        SnapshotAction::Delete { name, .. } => fs.delete_snapshot(name).map(|s| {
            println!(
                "{show}: snapshot {:?} (id {}, generation {}) deleted",
                s.name, s.id, s.generation
            );
        }),
        SnapshotAction::List { .. } => fs.engine().snapshot_space().map(|list| {
            println!(
                "{:>6} {:>12} {:>20} {:>10} {:>14}  name",
                "id", "generation", "created", "only", "only_bytes"
            );
            for (s, only) in list {
                println!(
                    "{:>6} {:>12} {:>10}.{:09} {:>10} {:>14}  {}",
                    s.id,
                    s.generation,
                    s.created.sec,
                    s.created.nsec,
                    human_bytes(only),
                    only,
                    s.name
                );
            }
        }),
    };
    let verb = match &action {
        SnapshotAction::Create { name, .. } => format!("snapshot create {name:?}"),
        SnapshotAction::Delete { name, .. } => format!("snapshot delete {name:?}"),
        SnapshotAction::List { .. } => "snapshot list".to_string(),
    };
    let closed = fs.close();
    if let Err(e) = result {
        return fail(format!("{show}: {verb}: {e}"));
    }
    if let Err(e) = closed {
        return fail(format!("{show}: {verb}: close: {e}"));
    }
    ExitCode::SUCCESS
}

/// `birch snapshot create|list|delete MNT [NAME]`: through the daemon serving the mount at
/// `mnt` (the root's control xattr for create and delete, `trusted.birch.snapshots` for the
/// list; root only, as every control command).
fn snapshot_through_mount(action: &SnapshotAction, mnt: &Path) -> ExitCode {
    let show = mnt.display();
    if let Err(e) = stats::getxattr(mnt, "trusted.birch.stats") {
        return fail(match e.raw_os_error() {
            Some(libc::ENODATA) | Some(libc::ENOTSUP) => format!(
                "{show}: a directory that is not the root of a birchfs mount (snapshot takes an \
                 image or a mount point)"
            ),
            Some(libc::EPERM) => format!("{show}: snapshots through a mount need root"),
            _ => format!("{show}: reading trusted.birch.stats: {e}"),
        });
    }
    let list = || -> Result<Vec<Vec<String>>, String> {
        let bytes = stats::getxattr(mnt, "trusted.birch.snapshots").map_err(|e| {
            match e.raw_os_error() {
                Some(libc::ENODATA) => {
                    format!("{show}: the daemon serving it lists no snapshots (an older build?)")
                }
                _ => format!("{show}: reading trusted.birch.snapshots: {e}"),
            }
        })?;
        Ok(String::from_utf8_lossy(&bytes)
            .lines()
            .map(|line| line.splitn(5, '\t').map(str::to_string).collect())
            .collect())
    };
    let explain = |verb: &str, name: &str, e: std::io::Error| -> String {
        let why = match e.raw_os_error() {
            Some(libc::EBUSY) => format!(
                "files are open in {show}/.snapshot/{name} (or it is mounted alone); close them first"
            ),
            Some(libc::EEXIST) if verb == "create" => format!(
                "a snapshot of that name exists, or the root has an entry .snapshot of its own \
                 (rename it): {e}"
            ),
            Some(libc::ENOENT) => "no such snapshot".to_string(),
            Some(libc::EROFS) => format!("the mount is read-only: {e}"),
            Some(libc::EPERM) => "needs root (the control xattr is trusted.*)".to_string(),
            _ => e.to_string(),
        };
        format!("{show}: snapshot {verb} {name:?}: {why}")
    };
    let found = |name: &str| -> Option<Vec<String>> {
        list()
            .ok()?
            .into_iter()
            .find(|f| f.get(4).map(String::as_str) == Some(name))
    };
    match action {
        SnapshotAction::Create { name, .. } => {
            // The kernel's dirty pages (writeback cache) never reach the daemon by themselves.
            if let Err(e) = mount::syncfs(mnt) {
                return fail(format!("{show}: snapshot create {name:?}: syncfs: {e}"));
            }
            if let Err(e) = mount::control(mnt, &ControlCommand::SnapshotCreate(name.to_string())) {
                return fail(explain("create", name, e));
            }
            match found(name) {
                Some(f) => println!(
                    "{show}: snapshot {name:?} created: id {}, generation {}; browse it at \
                     {show}/.snapshot/{name}",
                    f[0], f[1]
                ),
                None => println!("{show}: snapshot {name:?} created"),
            }
        }
        SnapshotAction::Delete { name, .. } => {
            let before = found(name);
            if let Err(e) = mount::control(mnt, &ControlCommand::SnapshotDelete(name.to_string())) {
                return fail(explain("delete", name, e));
            }
            match before {
                Some(f) => println!(
                    "{show}: snapshot {name:?} (id {}, generation {}) deleted",
                    f[0], f[1]
                ),
                None => println!("{show}: snapshot {name:?} deleted"),
            }
        }
        SnapshotAction::List { .. } => {
            let rows = match list() {
                Ok(rows) => rows,
                Err(e) => return fail(e),
            };
            println!(
                "{:>6} {:>12} {:>20} {:>10} {:>14}  name",
                "id", "generation", "created", "only", "only_bytes"
            );
            for f in rows {
                if let [id, generation, created, only, name] = f.as_slice() {
                    let human = only.parse::<u64>().map_or_else(|_| "-".into(), human_bytes);
                    println!(
                        "{id:>6} {generation:>12} {created:>20} {human:>10} {only:>14}  {name}"
                    );
                }
            }
        }
    }
    ExitCode::SUCCESS
}

/// `birch diff IMAGE SNAP1 [SNAP2]` on an unmounted image, opened read-only (a pending
/// fsync log is replayed in memory): [`Engine::diff`].
fn diff(image: &Path, from: &str, to: Option<&str>, stats: bool, ceph: &CephArgs) -> ExitCode {
    let show = image.display();
    if image.is_dir() {
        return diff_mounted(image, from, to);
    }
    let device = match open_image(image, OpenMode::ReadOnly, &ceph.image_options("diff")) {
        Ok(d) => d,
        Err(e) => return fail(format!("{show}: {e}")),
    };
    let fs = match Filesystem::open_device(
        device,
        birch_core::OpenOptions {
            commit_interval: None,
            read_only: true,
            wait_for_lock: false,
            ..Default::default()
        },
    ) {
        Ok(fs) => fs,
        Err(e) => return fail(format!("{show}: {e}")),
    };
    let started = std::time::Instant::now();
    let result = fs.engine().diff(from, to);
    let elapsed = started.elapsed();
    let _ = fs.close();
    match result {
        Ok((changes, walked)) => {
            use std::io::Write;
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            for change in &changes {
                if writeln!(out, "{change}").is_err() {
                    return ExitCode::from(1);
                }
            }
            if out.flush().is_err() {
                return ExitCode::from(1);
            }
            if stats {
                eprintln!(
                    "birch diff: {} paths, {} nodes read, {} shared subtrees skipped, {:.3} ms",
                    changes.len(),
                    walked.nodes_read,
                    walked.shared_skipped,
                    elapsed.as_secs_f64() * 1000.0
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            let to = to.map_or("the live state".to_string(), |t| format!("{t:?}"));
            fail(format!("{show}: diff {from:?} .. {to}: {e}"))
        }
    }
}

/// `birch diff MNT SNAP1 [SNAP2]` through a mount: the root's
/// `trusted.birch.diff/OFFSET/SNAP1[/SNAP2]` xattrs (birch-fuse's `DIFF_XATTR_PREFIX`), read
/// piece by piece until one is shorter than a full piece (`DIFF_CHUNK`, 60,000 bytes).
fn diff_mounted(mountpoint: &Path, from: &str, to: Option<&str>) -> ExitCode {
    use birch_fuse::DIFF_CHUNK;
    use std::io::Write;
    let show = mountpoint.display();
    let mut offset = 0usize;
    let mut out = std::io::stdout().lock();
    loop {
        let name = birch_fuse::diff_xattr_name(offset, from, to);
        let piece = match stats::getxattr(mountpoint, &name) {
            Ok(piece) => piece,
            Err(e) => {
                return fail(format!(
                    "{show}: diff {from:?} through the mount: {e} (is it a birchfs mount, \
                     and are you root?)"
                ))
            }
        };
        if out.write_all(&piece).is_err() {
            return ExitCode::from(1);
        }
        offset += piece.len();
        if piece.len() < DIFF_CHUNK {
            break;
        }
    }
    if out.flush().is_err() {
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

/// `birch rollback IMAGE NAME [-r]` on an unmounted image (DESIGN §15.8, SEMANTICS §9): a
/// read-write open through the filesystem replays the fsync log and commits, then an engine
/// of its own makes the rollback's commit ([`Engine::rollback`]).
fn rollback(image: &Path, name: &str, destroy_newer: bool, ceph: &CephArgs) -> ExitCode {
    let show = image.display();
    let device = match open_image(image, OpenMode::ReadWrite, &ceph.image_options("rollback")) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::ResourceBusy => {
            return fail(format!(
                "{show}: {e}; rollback works on an unmounted image only (unmount it first)"
            ))
        }
        Err(e) => return fail(format!("{show}: {e}")),
    };
    let replay = Filesystem::open_device(
        device.clone(),
        birch_core::OpenOptions {
            commit_interval: None,
            wait_for_lock: false,
            ..Default::default()
        },
    )
    .and_then(|fs| fs.close());
    if let Err(e) = replay {
        return fail(format!("{show}: rollback: replaying the fsync log: {e}"));
    }
    let engine = match Engine::open(device) {
        Ok(engine) => engine,
        Err(e) => return fail(format!("{show}: rollback: open: {e}")),
    };
    match engine.rollback(name, destroy_newer) {
        Ok((snapshot, deleted)) => {
            for gone in &deleted {
                println!("{show}: snapshot {gone:?} deleted (newer than {name:?})");
            }
            println!(
                "{show}: rolled back to snapshot {:?} (id {}, generation {}) by commit {}",
                snapshot.name,
                snapshot.id,
                snapshot.generation,
                engine.superblock().generation
            );
            ExitCode::SUCCESS
        }
        Err(e) => fail(format!("{show}: {e}")),
    }
}

fn inspect(image: &Path, what: &[String], ceph: &CephArgs) -> ExitCode {
    let device = match open_image(
        image,
        OpenMode::ReadOnlyUnlocked,
        &ceph.image_options("inspect"),
    ) {
        Ok(d) => d,
        Err(e) => return fail(e),
    };
    let (sb, notes) = match Engine::read_superblock(&*device) {
        Ok(v) => v,
        Err(e) => return fail(format!("{}: {e}", image.display())),
    };
    for note in notes {
        eprintln!("note: {note}");
    }
    let read_node =
        |addr: u64, generation: Option<u64>, level: Option<u8>| -> Result<Node, String> {
            let mut bytes = vec![0u8; NODE_SIZE];
            device
                .read_at(&mut bytes, addr)
                .map_err(|e| format!("read {addr:#x}: {e}"))?;
            let generation = match generation {
                Some(g) => g,
                None => u64::from_le_bytes(bytes[32..40].try_into().map_err(|_| "short node")?),
            };
            Node::decode(
                &bytes,
                &Expect {
                    fsid: sb.fsid,
                    addr,
                    generation,
                    owner: FS_TREE_ID,
                    level,
                },
            )
            .map_err(|e| e.to_string())
        };
    // The filesystem over the image, read-only (a pending fsync log replayed in memory).
    let open_read_only = || {
        Filesystem::open_device(
            device.clone(),
            birch_core::OpenOptions {
                commit_interval: None,
                read_only: true,
                wait_for_lock: false,
                ..Default::default()
            },
        )
    };
    match what
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["super"] | [] => println!("{sb}"),
        ["tree", "fs"] | ["tree"] => {
            let mut stack = vec![(sb.fs_root.addr, sb.fs_root.generation, sb.fs_root.level)];
            while let Some((addr, generation, level)) = stack.pop() {
                match read_node(addr, Some(generation), Some(level)) {
                    Ok(node) => {
                        print!("{node}");
                        if let birch_format::node::NodeBody::Internal(ptrs) = &node.body {
                            stack.extend(
                                ptrs.iter().rev().map(|p| (p.addr, p.generation, level - 1)),
                            );
                        }
                    }
                    Err(e) => println!("node {addr:#x}: {e}"),
                }
            }
        }
        ["log"] => {
            let replay = birch_core::log::read_log(&*device, &sb);
            println!(
                "log area {:#x} + {} bytes, head lsn {} seq {}",
                sb.log_start, sb.log_bytes, sb.log_head, sb.log_generation
            );
            println!(
                "{} batches, {} records readable; stopped: {}",
                replay.batches,
                replay.records.len(),
                replay.stop
            );
            for r in &replay.records {
                let shown = match (&r.value, r.key.kind()) {
                    (Some(v), _) if r.is_data() => format!(
                        "data of inode {}: {} bytes for block {:#x}",
                        r.key.objectid,
                        v.len(),
                        r.key.offset
                    ),
                    (Some(v), Some(kind)) => birch_format::items::Item::decode(kind, v)
                        .map_or_else(|e| format!("undecodable: {e}"), |i| i.to_string()),
                    (Some(v), None) => format!("{} bytes", v.len()),
                    (None, _) => "deleted".to_string(),
                };
                let applies = if r.generation > sb.generation {
                    "replays"
                } else {
                    "covered by the commit"
                };
                println!(
                    "  generation {} {} {} ({applies})",
                    r.generation, r.key, shown
                );
            }
        }
        ["node", addr] => {
            let parsed = if let Some(hex) = addr.strip_prefix("0x") {
                u64::from_str_radix(hex, 16).ok()
            } else {
                addr.parse().ok()
            };
            let Some(addr) = parsed else {
                return fail(format!("node address {addr:?}: not a number"));
            };
            match read_node(addr, None, None) {
                Ok(node) => print!("{node}"),
                Err(e) => return fail(e),
            }
        }
        ["inode", ino] => {
            let Ok(ino) = ino.parse::<u64>() else {
                return fail(format!("inode {ino:?}: not a number"));
            };
            let fs = match open_read_only() {
                Ok(fs) => fs,
                Err(e) => return fail(e),
            };
            let (lo, hi) = birch_core::items::inode_key_range(birch_format::InodeNo::new(ino));
            match fs.engine().range(&lo, &hi, usize::MAX) {
                Ok(items) if items.is_empty() => return fail(format!("inode {ino}: no items")),
                Ok(items) => {
                    for (key, value) in items {
                        let shown = key
                            .kind()
                            .and_then(|k| birch_format::items::Item::decode(k, &value).ok());
                        match shown {
                            Some(item) => println!("{key} {item}"),
                            None => println!("{key} ({} bytes, undecodable)", value.len()),
                        }
                    }
                }
                Err(e) => return fail(e),
            }
        }
        ["space"] => {
            let fs = match open_read_only() {
                Ok(fs) => fs,
                Err(e) => return fail(format!("{}: {e}", image.display())),
            };
            let report = fs.engine().space_report();
            let closed = fs.close();
            match report {
                Ok(report) => print_space(&report),
                Err(e) => return fail(format!("{}: inspect space: {e}", image.display())),
            }
            if let Err(e) = closed {
                return fail(format!("{}: inspect space: close: {e}", image.display()));
            }
        }
        other => {
            return fail(format!(
                "inspect {other:?}: expected super, tree fs, node ADDR, inode N, log or space"
            ))
        }
    }
    ExitCode::SUCCESS
}

/// `birch inspect IMAGE space`: one line per category of [`SpaceReport`] (label, bytes,
/// blocks, human-readable size, what it means), then the sum.
fn print_space(r: &SpaceReport) {
    let bytes = |blocks: u64| blocks.saturating_mul(r.block_size);
    let line = |label: &str, blocks: u64, meaning: &str| {
        println!(
            "{label:<15} {:>16} bytes {:>12} blocks {:>10}  {meaning}",
            bytes(blocks),
            blocks,
            human_bytes(bytes(blocks))
        );
    };
    line("device", r.device, "the whole image");
    line("reserved", r.reserved, "superblocks and the fsync log area");
    line("tree nodes", r.tree_nodes, "nodes of the live fs tree");
    line(
        "snapshot list",
        r.list_nodes,
        "nodes of the snapshot list tree",
    );
    line(
        "data",
        r.data,
        "data blocks the live tree names, each counted once",
    );
    line(
        "  shared",
        r.shared,
        "of data: blocks more than one extent names (clones)",
    );
    line(
        "snapshots",
        r.snapshots_only,
        "held only by snapshots: their blocks the live tree does not name (free if all went)",
    );
    for s in &r.snapshots {
        line(
            "  snapshot",
            s.only_blocks,
            &format!(
                "only this one holds (deleting it alone frees it): id {}, generation {}, {}",
                s.snapshot.id, s.snapshot.generation, s.snapshot.name
            ),
        );
    }
    line(
        "unnamed",
        r.unnamed,
        "used, named by no tree (0 on a healthy image)",
    );
    line(
        "used",
        r.used(),
        "reserved + tree nodes + snapshot list + data + snapshots + unnamed",
    );
    line("free", r.free, "free as statfs counts it");
    line(
        "  available",
        r.available,
        "of free: what data may take (the rest is kept for metadata)",
    );
    println!(
        "used {} + free {} = device {} blocks of {} bytes",
        r.used(),
        r.free,
        r.device,
        r.block_size
    );
    if r.named() > r.used() {
        eprintln!(
            "note: the trees name {} blocks more than are used: run birch fsck",
            r.named() - r.used()
        );
    }
}

fn crashtest(
    names: &[String],
    seed: Option<u64>,
    states: usize,
    ace_runs: u64,
    fuse_runs: u64,
) -> ExitCode {
    use birch_testkit::{run_matrix, Workload};
    // Every crash state replays a log; those notes would drown the summary.
    log::set_max_level(log::LevelFilter::Error);
    let mut workloads = Vec::new();
    for name in names {
        match Workload::parse(name) {
            Some(w) => workloads.push(w),
            None => {
                return fail(format!(
                    "unknown workload {name:?}; known: {}",
                    Workload::ALL.map(|w| w.name()).join(", ")
                ))
            }
        }
    }
    if workloads.is_empty() {
        workloads = Workload::ALL.to_vec();
    }
    let seed = seed.unwrap_or_else(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        t.as_nanos() as u64 ^ u64::from(std::process::id())
    });
    println!("birch crashtest: seed {seed} (replay with --seed {seed}), {states} states per run");
    let runs: Vec<(Workload, u64)> = workloads
        .iter()
        .flat_map(|w| {
            let n = match *w {
                Workload::Ace => ace_runs.max(1),
                // One run per variant (commit, log, now: the seed modulo 3).
                Workload::Shutdown => 3,
                // Four seeds: the steps are the seed's choice.
                Workload::Snapshots | Workload::Rollback => 4,
                _ => 1,
            };
            (0..n).map(move |i| (*w, seed.wrapping_add(i)))
        })
        .collect();
    let fuse_skip = if fuse_runs > 0 {
        fusecrash::unavailable()
    } else {
        None
    };
    let fuse_runs = if fuse_skip.is_some() { 0 } else { fuse_runs };
    let bar = indicatif::ProgressBar::new(((runs.len() as u64 + fuse_runs) * states as u64).max(1));
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} crash states {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut total = 0;
    let mut failures = Vec::new();
    for (workload, run_seed) in runs {
        bar.set_message(workload.name());
        match run_matrix(workload, run_seed, states, &mut || bar.inc(1)) {
            Ok(report) => {
                total += report.states;
                failures.extend(report.failures);
            }
            Err(e) => failures.push(format!(
                "{} seed {run_seed}: workload failed: {e}",
                workload.name()
            )),
        }
    }
    // FUSE over io_uring (the mount's default where allowed) in three runs of five where the
    // kernel has it (a ring run turns enable_uring on, as `-o uring` does),
    // /dev/fuse alone in the rest; the fuse module's enable_uring is put back as it was found.
    let uring_was = if fuse_runs >= 2 {
        birch_fuse::daemon::uring_setup::load_fuse_module();
        birch_fuse::daemon::uring_setup::uring_param()
    } else {
        None
    };
    let (mut faulty, mut injected, mut ended_by_fault) = (0u64, 0u64, 0u64);
    for i in 0..fuse_runs {
        // Every setting of the mount's caches in turn: the writeback cache in two runs of
        // three, the name/attribute and page caches (ttl, keep_cache) in every other run, the
        // daemon's write buffer in three runs of four.
        let variant = fusecrash::Variant {
            writeback: i % 3 != 2,
            caches: i % 2 == 0,
            buffered: i % 4 != 3,
            uring: uring_was.is_some() && matches!(i % 5, 1 | 2 | 4),
            faults: i % 4 == 1,
        };
        bar.set_message(variant.name());
        let run_seed = seed.wrapping_add(1_000_000 + i);
        let run = fusecrash::run(run_seed, variant, states, &mut || bar.inc(1));
        faulty += u64::from(variant.faults);
        injected += u64::from(run.fault.injected);
        ended_by_fault += u64::from(run.fault.ended_the_workload);
        total += run.report.states;
        failures.extend(run.report.failures);
    }
    if uring_was == Some(false) {
        birch_fuse::daemon::uring_setup::set_uring_param(false);
    }
    bar.finish_and_clear();
    if let Some(reason) = fuse_skip {
        println!("birch crashtest: FUSE-level runs skipped: {reason}");
    } else if fuse_runs > 0 {
        println!(
            "birch crashtest: {fuse_runs} FUSE-level runs (seeds {} ..); {} with a device \
             fault, injected in {}, the workload ended by a failed call in {}",
            seed.wrapping_add(1_000_000),
            faulty,
            injected,
            ended_by_fault,
        );
    }
    for f in &failures {
        println!("FAIL {f}");
    }
    println!(
        "birch crashtest: {total} crash states, {} failed (seed {seed})",
        failures.len()
    );
    if failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
