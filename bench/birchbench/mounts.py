#!/usr/bin/env python3
"""The one mount/loop helper of the repository: processes, mounts, loop devices, abort, cleanup.

Owns: running a command in its own session with a time limit (`run`, the process group killed
on timeout or interrupt), whether a path is mounted, unmounting with escalating means and
retries (`birch umount`, `fusermount3 -u`, `umount`, then the lazy ones; with `abort`, the FUSE
connection is aborted first so a hung daemon cannot keep it), aborting the FUSE connection
behind a mount point (read from mountinfo: no access to a possibly hung mount), attaching and
detaching loop devices, `birch mount` with the daemon's output kept out of the caller's pipes,
and the on-disk record of what a run created (`State`) with `cleanup_from`, which undoes it.

Used by:
  - the benchmark harness (bench/birchbench/targets.py, cli.py): every command it runs goes
    through `run`, every mount and loop device it makes is recorded in `STATE`;
  - tests/mount/fuse-ops.py: `mount_birch`, `unmount`, `fuse_abort`, `abort_mount`;
  - tests/posix/lib.sh (and so pjdfstest.sh, fsx.sh, differential.sh, tests/xfstests/run.sh):
    through the command line below, for the cleanup unmount, the FUSE abort of the watchdog
    and the loop-device detach;
  - the cleanup traps of tests/mount/{mount-tests,scrub-test,stats-test,uring-test}.sh,
    tests/images/check-fixtures.sh and tests/nfs/nfs-test.sh: `unmount --fuse --abort`.
So a change here changes all of them: keep the command line and the return conventions.

Must not touch: anything of the harness's (no logging, no report, no configuration; it is
standard library only and imports nothing of its package, so the test scripts can use it
alone and it runs as a plain script), and nothing it did not create or was not named: it
unmounts only the paths it is given and detaches a loop device only while its backing file is
the image it is told.

Command line (exit 0 done, 1 failed, 2 usage; messages on stdout):
  mounts.py unmount [--fuse] [--birch BIN] [--timeout S] [--birch-timeout S] [--abort] MNT
  mounts.py abort MNT                  abort the FUSE connection of MNT
  mounts.py detach-loop DEV [IMAGE]    losetup -d DEV (only while its backing file is IMAGE)
  mounts.py is-mounted MNT             exit 0 when MNT is a mount point, else 1
(The harness's own record is undone by `bench/run.sh --cleanup`, which holds the harness's lock;
there is deliberately no command here that undoes it behind a running harness.)

Python 3.11 standard library.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

# --------------------------------------------------------------------------- processes

ACTIVE: dict[int, subprocess.Popen] = {}


def run(cmd, timeout: float | None = 120, cwd: str | None = None, env=None,
        stdin=subprocess.DEVNULL, log_path: str | None = None) -> tuple[int, str, str]:
    """Run cmd in its own session (so it can be killed as a group); never raises on failure.

    Output goes to temporary files, not pipes: a daemon that forks (a FUSE mount) and keeps
    the descriptors open must not make us wait for it.  With log_path, stdout and stderr are
    appended to that file instead (a daemon's later output stays readable there); then out is
    "" and err the last 2,000 characters of the file.
    Returns (rc, stdout, stderr); rc is -1000 on timeout, -1001 if it could not start."""
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        lf = open(log_path, "ab") if log_path else None
        try:
            try:
                p = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=stdin, stdout=lf or fo, stderr=lf or fe,
                                     start_new_session=True)
            except OSError as e:
                return -1001, "", f"cannot start {cmd[0]}: {e}"
        finally:
            if lf:
                lf.close()
        ACTIVE[p.pid] = p
        if STATE is not None:
            STATE.add("groups", {"pgid": p.pid, "exe": os.path.basename(cmd[0])})
        note = ""
        try:
            rc = p.wait(timeout=timeout)
        except BaseException as e:
            kill_group(p)  # timeout or interrupted: the whole group goes
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            rc = -1000
            note = f"\n[birchbench] timeout after {timeout}s"
        finally:
            ACTIVE.pop(p.pid, None)
            if STATE is not None:
                STATE.remove("groups", {"pgid": p.pid, "exe": os.path.basename(cmd[0])})
        if log_path:
            try:
                with open(log_path, "rb") as f:
                    f.seek(max(0, os.path.getsize(log_path) - 2000))
                    return rc, "", f.read().decode(errors="replace") + note
            except OSError:
                return rc, "", note
        fo.seek(0)
        fe.seek(0)
        out = fo.read().decode(errors="replace")
        err = fe.read().decode(errors="replace") + note
        return rc, out, err


def kill_group(p: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            p.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def kill_active() -> None:
    for p in list(ACTIVE.values()):
        kill_group(p)


def _ancestors() -> set[int]:
    """This process and its ancestors (a caller such as `timeout` may name the mount point)."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return pids


def pids_with_arg(arg: str) -> list[int]:
    """Pids whose command line has `arg` as one argument (our FUSE daemons, by their mount
    point); never this process or one of its ancestors."""
    found = []
    mine = _ancestors()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in mine:
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if arg.encode() in args:
            found.append(int(d))
    return found


# --------------------------------------------------------------------------- mounts

def _unescape(field: str) -> str:
    """A path field of /proc/self/mounts or mountinfo: space, tab, newline and backslash are
    written as \\040, \\011, \\012, \\134."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and len(field[i + 1:i + 4]) == 3 and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def is_mounted(path: str) -> bool:
    path = os.path.realpath(path)
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 1 and _unescape(parts[1]) == path:
                    return True
    except OSError:
        pass
    return False


def mount_device(path: str) -> str | None:
    """The "major:minor" of the newest mount at path, from /proc/self/mountinfo (no stat of
    the mount point: that would wait on a hung FUSE daemon)."""
    dev = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 4 and _unescape(parts[4]) == path:
                    dev = parts[2]
    except OSError:
        pass
    return dev


FUSECTL = "/sys/fs/fuse/connections"


def fuse_abort(path: str) -> str | None:
    """Abort the FUSE connection behind the mount at path: every request it has pending or gets
    fails with ENOTCONN, which unblocks processes waiting on a hung daemon.  Mounts fusectl when
    it is not.  Returns what it did ("aborted FUSE connection N of PATH") or None (not a
    mount, or no connection to abort)."""
    dev = mount_device(path)
    if not dev:
        return None
    if not os.path.isdir(FUSECTL) or not os.path.ismount(FUSECTL):
        subprocess.run(["mount", "-t", "fusectl", "fusectl", FUSECTL], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    minor = dev.split(":", 1)[-1]
    try:
        with open(os.path.join(FUSECTL, minor, "abort"), "w") as f:
            f.write("1")
    except OSError:
        return None
    return f"aborted FUSE connection {minor} of {path}"


def unmount(path: str, fuse: bool = False, birch: str | None = None, timeout: float = 120,
            birch_timeout: float | None = None, abort: bool = False,
            errors: list[str] | None = None) -> str | None:
    """Unmount path with escalating means; returns None on success or an error text.

    `birch umount` (with birch; time limit birch_timeout, default timeout), `fusermount3 -u`
    (fuse), `umount`; when none of them worked: the FUSE connection aborted (fuse and abort),
    `umount -l`, `fusermount3 -uz` (fuse).  For a FUSE mount, the daemon started for path
    (a process with path as an argument) must be gone too: it gets 10 s, then SIGKILL.
    errors, when given, receives a line for every attempt that failed and for an abort."""
    if not is_mounted(path):
        return None
    attempts = []
    if birch:
        attempts.append(([birch, "umount", path], birch_timeout or timeout))
    if fuse:
        attempts.append((["fusermount3", "-u", path], timeout))
    attempts.append((["umount", path], timeout))
    errs = []
    for cmd, limit in attempts:
        rc, out, err = run(cmd, timeout=limit)
        if rc == 0 and not is_mounted(path):
            break
        errs.append(f"{' '.join(cmd)}: rc={rc} {err.strip()[-200:]}")
        time.sleep(0.5)
        if not is_mounted(path):
            break
    else:
        if fuse and abort:
            done = fuse_abort(path)
            if done and errors is not None:
                errors.append(done)
        run(["umount", "-l", path], timeout=30)
        if fuse:
            run(["fusermount3", "-uz", path], timeout=30)
    if errors is not None:
        errors[:0] = errs
    if fuse:
        # the daemon of this mount point (started by us) must be gone too
        deadline = time.time() + 10
        while time.time() < deadline and pids_with_arg(path):
            time.sleep(0.2)
        for pid in pids_with_arg(path):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    if is_mounted(path):
        return "; ".join(errs) or "still mounted"
    return None


def abort_mount(path: str) -> str | None:
    """For a FUSE mount whose daemon hangs: abort its connection, then `umount -l`.
    Returns what fuse_abort did."""
    done = fuse_abort(path)
    run(["umount", "-l", path], timeout=30)
    return done


def mount_birch(birch: str, image: str, mnt: str, opts: str | None = None, timeout: float = 120,
                log_path: str | None = None) -> tuple[int, str]:
    """`birch mount IMAGE MNT [-o OPTS]`, which returns once MNT is live and leaves the daemon
    serving.  With log_path the daemon's output is appended there (else it is dropped once the
    mount returned).  Returns (rc, stderr or the log's tail); the caller checks is_mounted(mnt)
    as well (a mount that returned 0 with nothing mounted is a failure too)."""
    cmd = [birch, "mount", image, mnt]
    if opts:
        cmd += ["-o", opts]
    rc, _, err = run(cmd, timeout=timeout, log_path=log_path)
    return rc, err


# --------------------------------------------------------------------------- loop devices

def attach_loop(image: str, direct_io: bool = True, timeout: float = 60) -> str:
    """A new loop device over image (`losetup [--direct-io=on] --find --show`); recorded in
    STATE when there is one.  Raises RuntimeError when losetup fails."""
    cmd = ["losetup"] + (["--direct-io=on"] if direct_io else []) + ["--find", "--show", image]
    rc, out, err = run(cmd, timeout=timeout)
    if rc != 0:
        raise RuntimeError(f"losetup: {err.strip()}")
    dev = out.strip()
    if STATE is not None:
        STATE.add("loops", {"dev": dev, "image": image})
    return dev


def loop_backing(dev: str) -> str | None:
    rc, out, _ = run(["losetup", "-n", "-O", "BACK-FILE", dev], timeout=20)
    if rc != 0:
        return None
    return out.strip().replace(" (deleted)", "") or None


def detach_loop(dev: str, image: str | None = None, timeout: float = 60, check: bool = True) -> str | None:
    """`losetup -d dev`; with image (and check), only while dev's backing file is image (a loop
    device someone else attached since is left alone).  Returns None or an error text; on
    success the entry {dev, image} leaves STATE."""
    if image is not None and check:
        back = loop_backing(dev)
        if not back or os.path.realpath(back) != os.path.realpath(image):
            return None
    rc, _, err = run(["losetup", "-d", dev], timeout=timeout)
    if rc != 0:
        return err.strip() or f"losetup -d {dev}: rc={rc}"
    if STATE is not None and image is not None:
        STATE.remove("loops", {"dev": dev, "image": image})
    return None


# --------------------------------------------------------------------------- state (cleanup)

class State:
    """What we created (mounts, loop devices), kept on disk so even a killed run is cleaned up."""

    def __init__(self, path: str):
        self.path = path
        self.data = {"pid": os.getpid(), "mounts": [], "loops": [], "groups": []}
        self.lock = threading.Lock()

    def load(self) -> dict:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {"mounts": [], "loops": [], "groups": []}

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)

    def add(self, kind: str, item) -> None:
        with self.lock:
            if item not in self.data.setdefault(kind, []):
                self.data[kind].append(item)
            self.save()

    def remove(self, kind: str, item) -> None:
        with self.lock:
            if item in self.data.setdefault(kind, []):
                self.data[kind].remove(item)
            self.save()


# The record of the running harness (set by bench/birchbench/cli.py); None elsewhere.
STATE: State | None = None


def cleanup_from(data: dict, birch: str | None) -> list[str]:
    """Undo everything recorded in a state dict (mounts newest first, then loop devices)."""
    done = []
    for g in data.get("groups", []):
        # workload process groups a killed run left running (each was started in its own session)
        pgid = g["pgid"]
        members = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[2]) == pgid:
                            members.append(int(d))
                except (OSError, IndexError, ValueError):
                    pass
        if members:
            try:
                os.killpg(pgid, signal.SIGKILL)
                done.append(f"killed process group {pgid} ({g.get('exe')})")
            except OSError:
                pass
    if data.get("groups"):
        time.sleep(0.5)
    for m in reversed(data.get("mounts", [])):
        path, fuse = m["path"], m.get("fuse", False)
        if is_mounted(path) or (fuse and pids_with_arg(path)):
            mb = m.get("birch")  # the binary that mounted it (older state files: True)
            err = unmount(path, fuse=fuse, birch=mb if isinstance(mb, str) else (birch if mb else None))
            done.append(f"umount {path}" + (f" FAILED: {err}" if err else ""))
    for lp in data.get("loops", []):
        dev, img = lp["dev"], lp["image"]
        back = loop_backing(dev)
        if back and os.path.realpath(back) == os.path.realpath(img):
            rc, _, err = run(["losetup", "-d", dev], timeout=30)
            done.append(f"losetup -d {dev}" + (f" FAILED: {err.strip()}" if rc else ""))
    return done


# --------------------------------------------------------------------------- command line

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mounts.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("unmount", help="unmount with escalating means (see unmount())")
    u.add_argument("--fuse", action="store_true", help="a FUSE mount: fusermount3 too, and its daemon must go")
    u.add_argument("--birch", default=None, help="try `BIRCH umount MNT` first")
    u.add_argument("--timeout", type=float, default=120, help="seconds per attempt")
    u.add_argument("--birch-timeout", type=float, default=None, help="seconds for `birch umount` [--timeout]")
    u.add_argument("--abort", action="store_true", help="abort the FUSE connection before the lazy unmounts")
    u.add_argument("mnt")
    a = sub.add_parser("abort", help="abort the FUSE connection of a mount")
    a.add_argument("mnt")
    d = sub.add_parser("detach-loop", help="losetup -d DEV, only while its backing file is IMAGE")
    d.add_argument("dev")
    d.add_argument("image", nargs="?", default=None)
    m = sub.add_parser("is-mounted", help="exit 0 when MNT is a mount point")
    m.add_argument("mnt")
    args = ap.parse_args(argv)
    if args.cmd == "unmount":
        notes: list[str] = []
        err = unmount(args.mnt, fuse=args.fuse, birch=args.birch, timeout=args.timeout,
                      birch_timeout=args.birch_timeout, abort=args.abort, errors=notes)
        for n in notes:
            print(n, flush=True)
        if err:
            print(f"{args.mnt} is still mounted", flush=True)
            return 1
        return 0
    if args.cmd == "abort":
        done = fuse_abort(args.mnt)
        if done:
            print(done, flush=True)
        return 0
    if args.cmd == "detach-loop":
        err = detach_loop(args.dev, args.image)
        if err:
            print(f"losetup -d {args.dev}: {err}", flush=True)
            return 1
        return 0
    if args.cmd == "is-mounted":
        return 0 if is_mounted(args.mnt) else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
