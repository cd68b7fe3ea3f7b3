//! `birch scrub`: read and verify every block a filesystem references, offline on an image
//! or online through a mount, and print what is damaged with its inodes and paths.
//!
//! Owns: choosing offline or online by the target, the progress bar, `--resume` (a position
//! an interrupted scrub printed, passed to the library offline or to `scrub-start` online),
//! printing (text or `--json`) and the exit codes: 0 clean, 1 damage found, 2 usage or
//! operational error.
//! Must not touch: the scrub itself, which lives in `birch_core::scrub` (offline it runs in
//! this process, online in the daemon, started and read through root xattrs).

use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use birch_core::control::ControlCommand;
use birch_core::device::{open_image, BlockDevice, ImageOptions, OpenMode};
use birch_core::scrub::{
    scrub, ImageViews, ScrubOptions, ScrubPosition, ScrubProgress, ViewSource,
    ONLINE_RATE_DEFAULT_BYTES_PER_SEC,
};
use serde_json::Value;

/// Exit code: every block verified.
const EXIT_CLEAN: u8 = 0;
/// Exit code: at least one damaged block.
const EXIT_DAMAGE: u8 = 1;
/// Exit code: usage or operational error (the scrub did not finish).
const EXIT_ERROR: u8 = 2;

/// The root xattr with the online scrub's status (`birch_fuse::SCRUB_XATTR`).
const SCRUB_XATTR: &str = "trusted.birch.scrub";

/// How often the online scrub's status is read.
const POLL_INTERVAL: Duration = Duration::from_millis(200);

/// What every report ends with: scrub cannot heal.
const NO_HEAL: &str = "scrub only detects: birchfs keeps one copy of each block, so a damaged \
block cannot be rebuilt; restore the files named above from a backup (or delete them)";

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_signal: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// `birch scrub TARGET`: offline when TARGET is an image, online when it is a mount's root.
/// `rate_mb` is in MB/s (10^6 bytes); 0 is unlimited. `resume`: the position an interrupted
/// scrub printed, to start from.
pub(crate) fn scrub_main(
    target: &Path,
    rate_mb: Option<f64>,
    json: bool,
    force: bool,
    resume: Option<&str>,
) -> ExitCode {
    if rate_mb.is_some_and(|r| !r.is_finite() || r < 0.0) {
        eprintln!("birch scrub: --rate must be a number of MB/s, 0 or more");
        return ExitCode::from(EXIT_ERROR);
    }
    let resume = match resume.map(str::parse::<ScrubPosition>).transpose() {
        Ok(resume) => resume,
        Err(e) => {
            eprintln!("birch scrub: --resume: {e}");
            return ExitCode::from(EXIT_ERROR);
        }
    };
    let rate = |default: Option<u64>| match rate_mb {
        Some(r) if r > 0.0 => Some((r * 1e6) as u64),
        Some(_) => None,
        None => default,
    };
    let result = if target.is_dir() {
        online(
            target,
            rate(Some(ONLINE_RATE_DEFAULT_BYTES_PER_SEC)),
            resume,
        )
    } else {
        let options = ScrubOptions {
            rate_bytes_per_sec: rate(None),
            resume_from: resume,
        };
        offline(target, options, force)
    };
    match result {
        Ok(report) => print_report(target, &report, json),
        Err(e) => {
            eprintln!("birch scrub: {}: {e}", target.display());
            ExitCode::from(EXIT_ERROR)
        }
    }
}

/// Scrubs an unmounted image in this process; the report as JSON.
fn offline(image: &Path, options: ScrubOptions, force: bool) -> Result<Value, String> {
    let mode = if force {
        OpenMode::ReadOnlyUnlocked
    } else {
        OpenMode::ReadOnly
    };
    // An rbd: image reaches the cluster as `rbd` does without options (CEPH_CONF, CEPH_ARGS).
    let holder = ImageOptions {
        holder: "scrub".into(),
        ..Default::default()
    };
    let device: Arc<dyn BlockDevice> =
        open_image(image, mode, &holder).map_err(|e| e.to_string())?;
    let views = ImageViews::open(device).map_err(|e| e.to_string())?;
    let pending = views.pending_log_records();
    if pending > 0 {
        eprintln!(
            "birch scrub: {}: {pending} fsync log records wait for replay (after a crash); \
             the blocks they reference are not scrubbed until a read-write mount replays them",
            image.display()
        );
    }
    let progress = Arc::new(ScrubProgress::default());
    catch_interrupt();
    let bar = progress_bar(views.bytes_used());
    let worker = {
        let progress = progress.clone();
        std::thread::spawn(move || scrub(&views, options, &progress))
    };
    while !worker.is_finished() {
        if INTERRUPTED.load(Ordering::SeqCst) {
            progress.cancel.store(true, Ordering::SeqCst);
        }
        // The total is 0 until the scrub thread has read the superblock: keep the bar's.
        let total = progress.bytes_total.load(Ordering::Relaxed);
        if total > 0 {
            bar.set_length(total);
        }
        bar.set_position(progress.bytes_done.load(Ordering::Relaxed));
        std::thread::sleep(POLL_INTERVAL.min(Duration::from_millis(100)));
    }
    bar.finish_and_clear();
    let report = worker
        .join()
        .map_err(|_| "the scrub thread panicked".to_string())?
        .map_err(|e| e.to_string())?;
    let mut report: Value =
        serde_json::from_str(&report.to_json()).map_err(|e| format!("report: {e}"))?;
    if let Some(obj) = report.as_object_mut() {
        obj.insert("pending_log_records".into(), pending.into());
    }
    Ok(report)
}

/// Starts a scrub in the daemon serving the mount at `mountpoint` (from `resume`, if given),
/// follows its progress and returns its report. Ctrl-C cancels it; the report then says
/// where to resume.
fn online(
    mountpoint: &Path,
    rate: Option<u64>,
    resume: Option<ScrubPosition>,
) -> Result<Value, String> {
    // Scrub reads committed trees: commit what was written so far (the kernel's dirty pages
    // first), so the scrub covers it. A read-only mount has nothing to commit; that failure
    // is not one.
    let _ = crate::mount::syncfs(mountpoint);
    let _ = crate::mount::control(mountpoint, &ControlCommand::Sync);
    // Rate 0 (or none) is unlimited.
    let command = ControlCommand::ScrubStart {
        rate: rate.filter(|r| *r > 0),
        resume,
    };
    crate::mount::control(mountpoint, &command).map_err(|e| match e.raw_os_error() {
        Some(libc::EBUSY) => "a scrub is already running on this mount".to_string(),
        Some(libc::EPERM) => "an online scrub needs root (CAP_SYS_ADMIN)".to_string(),
        Some(libc::ENOTSUP) | Some(libc::ENODATA) | Some(libc::EINVAL) => {
            format!("not the root of a birchfs mount that can scrub ({e})")
        }
        _ => format!("starting the scrub: {e}"),
    })?;
    catch_interrupt();
    let mut bar: Option<indicatif::ProgressBar> = None;
    let mut cancel_sent = false;
    loop {
        // Cancelled, the job stops at its next block and reports where to resume: wait for
        // that report.
        if INTERRUPTED.load(Ordering::SeqCst) && !cancel_sent {
            crate::mount::control(mountpoint, &ControlCommand::ScrubCancel)
                .map_err(|e| format!("interrupted, and cancelling the scrub failed: {e}"))?;
            cancel_sent = true;
        }
        let status = read_status(mountpoint)?;
        let number = |name: &str| status.get(name).and_then(Value::as_u64).unwrap_or(0);
        // Made once the total is known (the scrub thread sets it as it starts), so it never
        // draws a 0-byte bar.
        if number("bytes_total") > 0 {
            let bar = bar.get_or_insert_with(|| progress_bar(number("bytes_total")));
            bar.set_length(number("bytes_total"));
            bar.set_position(number("bytes_done"));
        }
        match status.get("state").and_then(Value::as_str) {
            Some("running") => std::thread::sleep(POLL_INTERVAL),
            Some("done") => {
                if let Some(bar) = &bar {
                    bar.finish_and_clear();
                }
                let mut report = status
                    .get("report")
                    .cloned()
                    .ok_or("the status has no report")?;
                // The status lists at most 100 damaged blocks; `damaged` counts them all.
                if let (Some(obj), Some(all)) = (report.as_object_mut(), status.get("damaged")) {
                    obj.insert("damaged".into(), all.clone());
                }
                return Ok(report);
            }
            Some("failed") => {
                if let Some(bar) = &bar {
                    bar.finish_and_clear();
                }
                let error = status.get("error").and_then(Value::as_str).unwrap_or("?");
                return Err(format!("the scrub failed in the daemon: {error}"));
            }
            other => {
                if let Some(bar) = &bar {
                    bar.finish_and_clear();
                }
                return Err(format!("unexpected scrub state {other:?}"));
            }
        }
    }
}

fn catch_interrupt() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(
            libc::SIGINT,
            on_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
}

/// A bar with bytes done, rate and ETA on a terminal; hidden when stderr is not one.
fn progress_bar(total_bytes: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total_bytes);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "scrub [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Reads the root's scrub status xattr.
fn read_status(mountpoint: &Path) -> Result<Value, String> {
    let buf = crate::stats::getxattr(mountpoint, SCRUB_XATTR)
        .map_err(|e| format!("reading {SCRUB_XATTR}: {e}"))?;
    serde_json::from_slice(&buf).map_err(|e| format!("{SCRUB_XATTR}: {e}"))
}

/// Prints the report (text, or the JSON object with `--json`) and picks the exit code.
fn print_report(target: &Path, report: &Value, json: bool) -> ExitCode {
    let damaged = report.get("damaged").and_then(Value::as_u64).unwrap_or(0);
    let cancelled = report
        .get("cancelled")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if json {
        println!("{report}");
    } else {
        for damage in report
            .get("damage")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            println!("{}", damage_line(damage));
        }
        let number = |name: &str| report.get(name).and_then(Value::as_u64).unwrap_or(0);
        let real = |name: &str| report.get(name).and_then(Value::as_f64).unwrap_or(0.0);
        let resume = report.get("resume").and_then(Value::as_str);
        println!(
            "{}: {} nodes, {} data blocks, {:.1} MB in {:.1} s ({:.1} MB/s, {} chunks, {} snapshots), {} damaged blocks{}",
            target.display(),
            number("nodes"),
            number("data_blocks"),
            number("bytes") as f64 / 1e6,
            real("elapsed_sec"),
            real("rate_mb_per_sec"),
            number("chunks"),
            number("snapshots"),
            damaged,
            match (cancelled, resume) {
                (true, Some(position)) => {
                    format!(", cancelled before the end: go on with --resume {position}")
                }
                (true, None) => ", cancelled before the end".to_string(),
                _ => String::new(),
            }
        );
        if damaged > 0 {
            println!("{NO_HEAL}");
        }
    }
    if damaged > 0 {
        ExitCode::from(EXIT_DAMAGE)
    } else if cancelled {
        ExitCode::from(EXIT_ERROR)
    } else {
        ExitCode::from(EXIT_CLEAN)
    }
}

/// One damaged block in a line: what, where, found and expected, and every owner's paths.
fn damage_line(damage: &Value) -> String {
    let text = |name: &str| damage.get(name).and_then(Value::as_str).unwrap_or("?");
    let block = damage.get("block").and_then(Value::as_u64).unwrap_or(0);
    let generation = damage
        .get("generation")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let mut line = format!(
        "damaged {} block {block:#x} (generation {generation})",
        text("kind")
    );
    if let Some(keys) = damage.get("keys").filter(|k| !k.is_null()) {
        let low = keys.get("low").and_then(Value::as_str).unwrap_or("?");
        let high = keys.get("high").and_then(Value::as_str).unwrap_or("end");
        line.push_str(&format!(", keys [{low}, {high})"));
    }
    line.push_str(&format!(
        ": found {}, expected {}",
        text("found"),
        text("expected")
    ));
    for owner in damage
        .get("owners")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let inode = owner.get("inode").and_then(Value::as_u64).unwrap_or(0);
        line.push_str(&format!("; inode {inode}"));
        if let Some(offset) = owner.get("offset").and_then(Value::as_u64) {
            line.push_str(&format!(" offset {offset}"));
        }
        let paths: Vec<&str> = owner
            .get("paths")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        let snapshot = owner.get("snapshot").and_then(Value::as_str);
        if paths.is_empty() {
            match snapshot {
                Some(name) => line.push_str(&format!(" (path unknown, in snapshot {name:?})")),
                None => line.push_str(" (path unknown)"),
            }
        } else {
            line.push_str(&format!(" {}", paths.join(" ")));
        }
    }
    line
}
