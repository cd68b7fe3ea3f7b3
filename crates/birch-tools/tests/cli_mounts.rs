//! The `birch mount` command and its daemon, through the real binary.
//!
//! A mount command reports the mount its own daemon made, and a daemon whose command is gone
//! does not mount (DESIGN §12.1, "The mount command and its daemon"). Both run `birch mount`
//! against an image whose lock is held by a stopped daemon (SIGSTOP; its mount detached, as a
//! node an operator drained): before the fix, the command reported whatever got mounted at the
//! mount point meanwhile as its own, and a daemon whose command was killed went on waiting and
//! mounted the image later, unasked.
//!
//! `birch sync MNT` makes durable what was written anywhere in the mount: checked by killing
//! the daemon (SIGKILL) right after it. Before the fix it fsynced the root directory, which
//! commits nothing when the root did not change, and a file in a subdirectory was lost.
//!
//! Need root and /dev/fuse; skip (pass, saying why) without them.

#![allow(clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIRCH: &str = env!("CARGO_BIN_EXE_birch");

/// A scratch directory with an image and mount points, unmounted and removed at the end.
struct Scratch {
    dir: PathBuf,
    img: String,
    stopped: Option<i32>,
}

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("birch-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for m in ["m1", "m2"] {
            std::fs::create_dir_all(dir.join(m)).expect("mount point");
        }
        std::fs::File::create(dir.join("img"))
            .and_then(|f| f.set_len(128 << 20))
            .expect("image");
        let img = dir.join("img").to_str().expect("utf-8 path").to_string();
        let s = Scratch {
            dir,
            img,
            stopped: None,
        };
        assert!(run(&["mkfs", s.img()]).success(), "mkfs");
        s
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn img(&self) -> &str {
        &self.img
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(pid) = self.stopped {
            // SAFETY: kill with a pid this test stopped.
            unsafe { libc::kill(pid, libc::SIGCONT) };
        }
        for m in ["m2", "m1", "m2"] {
            let _ = Command::new("umount")
                .arg("-l")
                .arg(self.dir.join(m))
                .stderr(Stdio::null())
                .status();
        }
        std::thread::sleep(Duration::from_millis(500));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn run(args: &[&str]) -> std::process::ExitStatus {
    Command::new(BIRCH)
        .args(args)
        .stdout(Stdio::null())
        .status()
        .expect("run birch")
}

/// The pid of the daemon serving (or waiting to serve) `img` at `mnt`: `birch mount -f IMG MNT`.
fn daemon_of(img: &str, mnt: &Path) -> Option<i32> {
    let want = format!("mount\0-f\0{img}\0{}\0", mnt.display());
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        String::from_utf8_lossy(&cmdline)
            .contains(&want)
            .then_some(pid)
    })
}

/// The filesystem type mounted at `mnt` (the top one), if any.
fn mounted_at(mnt: &Path) -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/mounts").ok()?;
    let mnt = mnt.to_str()?;
    text.lines()
        .rfind(|l| l.split(' ').nth(1) == Some(mnt))
        .and_then(|l| l.split(' ').nth(2).map(str::to_string))
}

fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Mounts the image at m1, stops its daemon and detaches the mount: the image's lock stays
/// held by a daemon that does nothing, until `SIGCONT`.
fn stopped_holder(s: &mut Scratch) -> i32 {
    let m1 = s.path("m1");
    assert!(
        run(&["mount", s.img(), m1.to_str().expect("path")]).success(),
        "mount at m1"
    );
    let holder = daemon_of(s.img(), &m1).expect("m1's daemon");
    // SAFETY: kill with the pid of the daemon just started.
    unsafe { libc::kill(holder, libc::SIGSTOP) };
    s.stopped = Some(holder);
    let status = Command::new("umount")
        .arg("-l")
        .arg(&m1)
        .status()
        .expect("umount -l");
    assert!(status.success(), "detach m1");
    holder
}

fn go_on(s: &mut Scratch, holder: i32) {
    // SAFETY: kill with the pid this test stopped.
    unsafe { libc::kill(holder, libc::SIGCONT) };
    s.stopped = None;
    // Its mount is detached and unused: it commits, releases the image and exits.
    wait_until("the holder's exit", Duration::from_secs(20), || {
        daemon_of(s.img(), &s.path("m1")).is_none()
    });
}

fn mount_command(s: &Scratch) -> Child {
    Command::new(BIRCH)
        .args(["mount", s.img()])
        .arg(s.path("m2"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start birch mount")
}

#[test]
fn a_daemon_whose_mount_command_was_killed_never_mounts() {
    if let Some(why) = common::mount_unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let mut s = Scratch::new("race-killed");
    let holder = stopped_holder(&mut s);
    let m2 = s.path("m2");
    let mut command = mount_command(&s);
    wait_until("m2's daemon waiting", Duration::from_secs(10), || {
        daemon_of(s.img(), &m2).is_some()
    });
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        command.try_wait().expect("wait").is_none(),
        "the command waits while the image is held"
    );
    command.kill().expect("kill the mount command");
    let _ = command.wait();
    // Its daemon sees the command's end of the pipe closed and ends, still waiting.
    wait_until("m2's daemon ending", Duration::from_secs(5), || {
        daemon_of(s.img(), &m2).is_none()
    });
    go_on(&mut s, holder);
    // The image is free now: nothing may take it and mount it at m2.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        mounted_at(&m2),
        None,
        "an abandoned daemon mounted the image"
    );
    // And a mount asked for now works, and the image is clean.
    assert!(
        run(&["mount", s.img(), m2.to_str().expect("path")]).success(),
        "mount at m2"
    );
    assert_eq!(mounted_at(&m2).as_deref(), Some("fuse.birch"));
    assert!(
        run(&["umount", m2.to_str().expect("path")]).success(),
        "umount"
    );
    assert!(run(&["fsck", s.img()]).success(), "fsck clean");
}

#[test]
fn a_mount_command_reports_only_its_own_daemons_mount() {
    if let Some(why) = common::mount_unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let mut s = Scratch::new("race-other");
    let holder = stopped_holder(&mut s);
    let m2 = s.path("m2");
    let mut command = mount_command(&s);
    wait_until("m2's daemon waiting", Duration::from_secs(10), || {
        daemon_of(s.img(), &m2).is_some()
    });
    // Another birch filesystem is mounted at m2 while the command's daemon waits for the
    // image (before the fix, the command took any FUSE mount there for its own).
    let other = s.path("other.img");
    std::fs::File::create(&other)
        .and_then(|f| f.set_len(64 << 20))
        .expect("second image");
    let other = other.to_str().expect("utf-8 path");
    assert!(run(&["mkfs", other]).success(), "mkfs of the second image");
    assert!(
        run(&["mount", other, m2.to_str().expect("path")]).success(),
        "the second image at m2"
    );
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        command.try_wait().expect("wait").is_none(),
        "the command took the other image's mount at m2 for its own"
    );
    // The holder goes: the command's daemon takes the image, mounts over the other mount, and
    // only now does the command report success.
    go_on(&mut s, holder);
    let start = Instant::now();
    let status = loop {
        if let Some(status) = command.try_wait().expect("wait") {
            break status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the mount never came up"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        status.success(),
        "the command's own mount came up: {status}"
    );
    assert_eq!(
        daemon_of(s.img(), &m2).map(|_| mounted_at(&m2)),
        Some(Some("fuse.birch".into())),
        "the command's daemon serves the top mount at m2"
    );
    for what in ["the command's mount", "the other image's mount"] {
        assert!(
            run(&["umount", m2.to_str().expect("path")]).success(),
            "umount {what}"
        );
    }
    assert!(run(&["fsck", s.img()]).success(), "fsck clean");
    assert!(
        run(&["fsck", other]).success(),
        "fsck of the second image clean"
    );
}

#[test]
fn birch_sync_makes_a_file_in_a_subdirectory_durable() {
    if let Some(why) = common::mount_unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let s = Scratch::new("sync");
    let m1 = s.path("m1");
    let m1s = m1.to_str().expect("path");
    // No background commit during the test: only `birch sync` may commit.
    assert!(
        run(&["mount", s.img(), m1s, "-o", "commit=600"]).success(),
        "mount"
    );
    std::fs::create_dir(m1.join("d")).expect("mkdir");
    assert!(run(&["sync", m1s]).success(), "first sync");
    // Offset-stamped bytes, so a block in the wrong place shows.
    let data: Vec<u8> = (0..(1u32 << 20) / 4)
        .flat_map(|i| (i.wrapping_mul(2_654_435_761) ^ i).to_le_bytes())
        .collect();
    std::fs::write(m1.join("d/f"), &data).expect("write d/f");
    assert!(run(&["sync", m1s]).success(), "sync after the write");
    let daemon = daemon_of(s.img(), &m1).expect("the daemon");
    // SAFETY: kill with the pid of the daemon this test started.
    unsafe { libc::kill(daemon, libc::SIGKILL) };
    wait_until("the killed daemon's exit", Duration::from_secs(10), || {
        daemon_of(s.img(), &m1).is_none()
    });
    let _ = Command::new("umount")
        .arg("-l")
        .arg(&m1)
        .stderr(Stdio::null())
        .status();
    assert!(run(&["mount", s.img(), m1s]).success(), "mount again");
    let back = std::fs::read(m1.join("d/f"));
    assert!(run(&["umount", m1s]).success(), "umount");
    let back = back.expect("d/f after the crash: birch sync did not make it durable");
    assert!(back == data, "d/f has other bytes after the crash");
    assert!(run(&["fsck", s.img()]).success(), "fsck clean");
}
