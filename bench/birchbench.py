#!/usr/bin/env python3
"""birchbench: birchfs against the kernel filesystems, side by side.

Runs the seeds' workloads (W1 dbench, W2 fio O_DIRECT writers, W3 create/remove,
W4 sysbench fileio, W5 append+fsync latency) and W6 "everyday work" (unpack a source
tree, git clone/status, tree walk, read back, small appends, SQLite commits, rm -rf;
each step timed to durable) on every target, interleaved
(A B C A B C ...) with repeats, and writes Markdown tables, raw JSON and PNG
charts.  See docs/BENCHMARKS.md for the method.  Normally started through
bench/run.sh, which installs the tools first.

Targets: ext4, xfs, btrfs (each on a `losetup --direct-io=on` loop over its own
image), fuse2fs (over its own image, through a direct-io loop as well), bindfs
--multithreaded over a kernel ext4 directory, libfuse's in-memory example server
memfs_ll (built from the libfuse tarball in ../shared/libfuse; the FUSE floor), the
raw loop device (W2, W5) and birchfs (default options plus every --birch-opts set, and
with --birch-before PATH the same default options on another birch binary: birchfs-before).

Needs root.  Python 3.11 standard library; matplotlib only for the charts.
"""
from __future__ import annotations

import argparse
import datetime
import fcntl
import hashlib
import json
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ALL_TARGETS = ["ext4", "xfs", "btrfs", "fuse2fs", "bindfs-mt", "memfs_ll", "raw", "birchfs"]
KERNEL_KINDS = {"ext4", "xfs", "btrfs", "raw"}


# --------------------------------------------------------------------------- sizes

def parse_size(s: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", str(s))
    if not m:
        raise argparse.ArgumentTypeError(f"bad size: {s!r}")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def human(n: int) -> str:
    for unit, sh in (("G", 30), ("M", 20), ("K", 10)):
        if n >= (1 << sh) and n % (1 << sh) == 0:
            return f"{n >> sh}{unit}"
    return str(n)


def int_list(s: str) -> list[int]:
    return [int(x) for x in str(s).split(",") if x.strip()]


def str_list(s: str) -> list[str]:
    return [x.strip() for x in str(s).split(",") if x.strip()]


def fmt_num(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, str):
        return v
    if float(v).is_integer():
        return f"{int(v):,}"
    a = abs(v)
    if a >= 100:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    if a == 0:
        return "0"
    return f"{v:.3g}"


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")


# --------------------------------------------------------------------------- logging

class Log:
    """Timestamped lines to the log file (and the terminal); a live status line on a tty."""

    def __init__(self, path: str | None, detached: bool):
        self.detached = detached
        self.file = None
        if path and not detached:
            self.file = open(path, "a", buffering=1)
        self.tty = (not detached) and sys.stdout.isatty()
        self.lock = threading.Lock()
        self.status_text = ""

    def line(self, msg: str) -> None:
        ts = datetime.datetime.now().strftime("%H:%M:%S")
        text = f"[{ts}] {msg}"
        with self.lock:
            if self.file:
                self.file.write(text + "\n")
            if self.tty:
                sys.stdout.write("\r\033[K" + text + "\n")
                if self.status_text:
                    sys.stdout.write(self._fit(self.status_text))
                sys.stdout.flush()
            else:
                print(text, flush=True)

    def _fit(self, s: str) -> str:
        width = shutil.get_terminal_size((120, 20)).columns
        return s[: max(10, width - 1)]

    def status(self, msg: str) -> None:
        with self.lock:
            self.status_text = msg
            if self.tty:
                sys.stdout.write("\r\033[K" + self._fit(msg))
                sys.stdout.flush()

    def clear_status(self) -> None:
        with self.lock:
            self.status_text = ""
            if self.tty:
                sys.stdout.write("\r\033[K")
                sys.stdout.flush()


LOG: Log = Log(None, False)


def log(msg: str) -> None:
    LOG.line(msg)


# --------------------------------------------------------------------------- processes

ACTIVE: dict[int, subprocess.Popen] = {}


def run(cmd, timeout: float | None = 120, cwd: str | None = None, env=None,
        stdin=subprocess.DEVNULL) -> tuple[int, str, str]:
    """Run cmd in its own session (so it can be killed as a group); never raises on failure.

    Output goes to temporary files, not pipes: a daemon that forks (a FUSE mount) and keeps
    the descriptors open must not make us wait for it.
    Returns (rc, stdout, stderr); rc is -1000 on timeout, -1001 if it could not start."""
    import tempfile
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        try:
            p = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=stdin, stdout=fo, stderr=fe,
                                 start_new_session=True)
        except OSError as e:
            return -1001, "", f"cannot start {cmd[0]}: {e}"
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


def pids_with_arg(arg: str) -> list[int]:
    """Pids whose command line has `arg` as one argument (our FUSE daemons, by their mount point)."""
    found = []
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if arg.encode() in args:
            found.append(int(d))
    return found


def is_mounted(path: str) -> bool:
    path = os.path.realpath(path)
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 1 and parts[1].replace("\\040", " ") == path:
                    return True
    except OSError:
        pass
    return False


def unmount(path: str, fuse: bool = False, birch: str | None = None) -> str | None:
    """Unmount path with escalating means; returns None on success or an error text."""
    if not is_mounted(path):
        return None
    attempts = []
    if birch:
        attempts.append([birch, "umount", path])
    if fuse:
        attempts.append(["fusermount3", "-u", path])
    attempts.append(["umount", path])
    errs = []
    for cmd in attempts:
        rc, out, err = run(cmd, timeout=120)
        if rc == 0 and not is_mounted(path):
            break
        errs.append(f"{' '.join(cmd)}: rc={rc} {err.strip()[-200:]}")
        time.sleep(0.5)
        if not is_mounted(path):
            break
    else:
        run(["umount", "-l", path], timeout=30)
        if fuse:
            run(["fusermount3", "-uz", path], timeout=30)
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


STATE: State | None = None


def loop_backing(dev: str) -> str | None:
    rc, out, _ = run(["losetup", "-n", "-O", "BACK-FILE", dev], timeout=20)
    if rc != 0:
        return None
    return out.strip().replace(" (deleted)", "") or None


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


def full_cleanup(birch: str | None) -> None:
    kill_active()
    if STATE is None:
        return
    for line in cleanup_from(STATE.data, birch):
        log(f"cleanup: {line}")
    STATE.data["mounts"] = []
    STATE.data["loops"] = []
    STATE.data["groups"] = []
    STATE.save()


# --------------------------------------------------------------------------- images

def file_sha256(path: str) -> str | None:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


def ensure_image(path: str, size: int) -> str:
    """A fully written (not sparse, not merely fallocated) image of exactly `size` bytes."""
    try:
        st = os.stat(path)
        if st.st_size == size and st.st_blocks * 512 >= size:
            return "reused"
    except FileNotFoundError:
        pass
    tmp = path + ".part"
    chunk = 4 << 20
    buf = bytes(chunk)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = size
        while left > 0:
            n = os.write(fd, buf[: min(chunk, left)])
            left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return "written"


# --------------------------------------------------------------------------- targets

class Target:
    def __init__(self, name: str, kind: str, cfg, opts: str | None = None, before: bool = False):
        self.name = name
        self.kind = kind
        self.cfg = cfg
        self.opts = opts
        # the birch binary of a birchfs target: --birch, or --birch-before for birchfs-before
        self.before = before and kind == "birchfs"
        self.birch = (cfg.birch_before if self.before else cfg.birch) if kind == "birchfs" else None
        self.safe = safe_name(name)
        self.image = os.path.join(cfg.image_dir, "img", self.safe + ".img")
        self.mnt = os.path.join(cfg.image_dir, "mnt", self.safe)
        self.src = self.mnt + ".src"  # bindfs: the kernel ext4 directory below it
        self.loop: str | None = None
        self.status = "pending"  # ok | skipped | failed
        self.error = ""
        self.meta: dict = {}

    @property
    def is_birch(self) -> bool:
        return self.kind == "birchfs"

    @property
    def is_fuse(self) -> bool:
        return self.kind in ("fuse2fs", "bindfs-mt", "memfs_ll", "birchfs")

    def supports(self, case) -> bool:
        return case.raw_ok if self.kind == "raw" else True

    def fail(self, msg: str, status: str = "failed") -> None:
        self.status = status
        self.error = msg
        log(f"target {self.name}: {status}: {msg}")

    # -- loop devices
    def attach(self) -> str:
        rc, out, err = run(["losetup", "--direct-io=on", "--find", "--show", self.image], timeout=60)
        if rc != 0:
            raise RuntimeError(f"losetup: {err.strip()}")
        dev = out.strip()
        self.loop = dev
        STATE.add("loops", {"dev": dev, "image": self.image})
        try:
            with open(f"/sys/block/{os.path.basename(dev)}/loop/dio") as f:
                self.meta["loop_dio"] = f.read().strip() == "1"
        except OSError:
            self.meta["loop_dio"] = None
        if self.meta["loop_dio"] is False:
            log(f"WARNING {self.name}: loop device {dev} did not enable direct I/O")
        # A discard on a loop device punches holes into the image file: the image would turn
        # sparse again and first writes would pay host allocation.  Switch discard off.
        try:
            with open(f"/sys/block/{os.path.basename(dev)}/queue/discard_max_bytes", "w") as f:
                f.write("0")
        except OSError:
            pass
        try:
            with open(f"/sys/block/{os.path.basename(dev)}/queue/discard_max_bytes") as f:
                self.meta["loop_discard"] = f.read().strip() != "0"
        except OSError:
            self.meta["loop_discard"] = None
        self.meta["loop"] = dev
        return dev

    def setup(self) -> None:
        cfg = self.cfg
        try:
            if self.is_birch:
                if not (os.path.isfile(self.birch) and os.access(self.birch, os.X_OK)):
                    self.fail(f"birch binary not found at {self.birch} (build it: cargo build --release)",
                              "skipped")
                    return
                self.meta["birch"] = self.birch
                self.meta["birch_sha256"] = file_sha256(self.birch)
                self.meta["birch_mtime"] = datetime.datetime.fromtimestamp(
                    os.stat(self.birch).st_mtime).isoformat(timespec="seconds")
            if self.kind == "memfs_ll":  # no image: everything lives in the daemon's memory
                os.makedirs(self.mnt, exist_ok=True)
                binp, why = build_memfs(cfg)
                if binp is None:
                    self.fail(why, "skipped" if why.startswith("no libfuse") else "failed")
                    return
                self.meta["memfs_ll"] = binp
                rc, out, err = run([binp, "--version"], timeout=20, env=memfs_env(binp))
                lib = re.search(r"FUSE library version (\S+)", out + err)
                self.meta["version"] = f"libfuse {lib.group(1)}" if rc == 0 and lib else None
                self.status = "ok"
                return
            os.makedirs(os.path.dirname(self.image), exist_ok=True)
            os.makedirs(self.mnt, exist_ok=True)
            t0 = time.time()
            how = ensure_image(self.image, cfg.image_size)
            self.meta["image"] = self.image
            self.meta["image_prep"] = how
            log(f"target {self.name}: image {self.image} {human(cfg.image_size)} {how}"
                f" ({time.time() - t0:.1f}s)")
            if self.is_birch:
                cmd = [self.birch, "mkfs", "--force", "--size", str(cfg.image_size), self.image]
                rc, out, err = run(cmd, timeout=600)
                if rc != 0:
                    self.fail(f"`{' '.join(cmd)}` rc={rc}: {(err or out).strip()[-400:]}")
                    return
                rc, out, err = run([self.birch, "--version"], timeout=20)
                self.meta["version"] = (out or err).strip()[:200] if rc == 0 else None
                self.meta["image_allocated_pct"] = self.allocated()
                self.status = "ok"
                return
            dev = self.attach()
            if self.kind in ("ext4", "fuse2fs", "bindfs-mt"):
                cmd = ["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0,nodiscard", dev]
            elif self.kind == "xfs":
                cmd = ["mkfs.xfs", "-q", "-f", "-K", dev]
            elif self.kind == "btrfs":
                cmd = ["mkfs.btrfs", "-q", "-f", "-K", dev]
            else:
                cmd = None
            if cmd:
                rc, out, err = run(cmd, timeout=600)
                if rc != 0:
                    self.fail(f"`{' '.join(cmd)}` rc={rc}: {(err or out).strip()[-400:]}")
                    return
            if self.kind == "bindfs-mt":
                os.makedirs(self.src, exist_ok=True)
            self.meta["image_allocated_pct"] = self.allocated()
            self.status = "ok"
        except Exception as e:  # noqa: BLE001 - a failing target is reported, not fatal
            self.fail(f"setup: {e}")

    def _mount_item(self, path: str, fuse: bool) -> dict:
        # "birch": the binary that mounted it (cleanup unmounts with that one), else False
        return {"path": path, "fuse": fuse, "birch": self.birch if self.is_birch and path == self.mnt else False}

    def _mount_rec(self, path: str, fuse: bool) -> None:
        STATE.add("mounts", self._mount_item(path, fuse))

    def mount(self) -> str:
        """Mount for one run; returns the directory (or device, for raw) the workload uses."""
        cfg = self.cfg
        if self.kind == "raw":
            return self.loop
        if self.kind in ("ext4", "xfs", "btrfs"):
            self._mount_rec(self.mnt, False)
            cmd = ["mount", "-t", self.kind, self.loop, self.mnt]
            if self.kind == "btrfs":
                cmd[1:1] = ["-o", "nodiscard"]  # btrfs turns discard=async on by itself
            rc, _, err = run(cmd, timeout=120)
        elif self.kind == "fuse2fs":
            self._mount_rec(self.mnt, True)
            rc, _, err = run(["fuse2fs", self.loop, self.mnt], timeout=120)
        elif self.kind == "bindfs-mt":
            self._mount_rec(self.src, False)
            rc, _, err = run(["mount", "-t", "ext4", self.loop, self.src], timeout=120)
            if rc == 0:
                self._mount_rec(self.mnt, True)
                rc, _, err = run(["bindfs", "--multithreaded", self.src, self.mnt], timeout=120)
        elif self.kind == "birchfs":
            self._mount_rec(self.mnt, True)
            cmd = [self.birch, "mount", self.image, self.mnt]
            if self.opts:
                cmd += ["-o", self.opts]
            rc, _, err = run(cmd, timeout=120)
        elif self.kind == "memfs_ll":
            # daemonizes once mounted; multi-threaded (it always runs fuse_session_loop_mt)
            self._mount_rec(self.mnt, True)
            binp = self.meta["memfs_ll"]
            rc, _, err = run([binp, "-o", "writeback_cache,no_timeout", self.mnt], timeout=120,
                             env=memfs_env(binp))
        else:
            raise RuntimeError(f"unknown kind {self.kind}")
        if rc != 0 or not is_mounted(self.mnt):
            self.umount()
            raise RuntimeError(f"mount failed rc={rc}: {err.strip()[-400:]}")
        return self.mnt

    def umount(self) -> str | None:
        if self.kind == "raw":
            return None
        errs = []
        err = unmount(self.mnt, fuse=self.is_fuse, birch=self.birch)
        if err:
            errs.append(err)
        else:
            STATE.remove("mounts", self._mount_item(self.mnt, self.is_fuse))
        if self.kind == "bindfs-mt":
            err = unmount(self.src)
            if err:
                errs.append(err)
            else:
                STATE.remove("mounts", {"path": self.src, "fuse": False, "birch": False})
        return "; ".join(errs) or None

    def allocated(self) -> float | None:
        try:
            st = os.stat(self.image)
            return round(100.0 * st.st_blocks * 512 / st.st_size, 1) if st.st_size else None
        except OSError:
            return None

    def teardown(self) -> None:
        self.umount()
        if self.status == "ok" and self.kind != "memfs_ll":
            self.meta["image_allocated_pct_end"] = self.allocated()
        if self.loop:
            rc, _, err = run(["losetup", "-d", self.loop], timeout=60)
            if rc == 0:
                STATE.remove("loops", {"dev": self.loop, "image": self.image})
            else:
                log(f"losetup -d {self.loop} failed: {err.strip()}")
            self.loop = None

    def sync(self, path: str, check: bool = False) -> None:
        """Make what is written so far durable.  `sync -f` (syncfs(2)) is all a kernel
        filesystem needs.  On a FUSE mount it only writes the kernel's dirty pages back to the
        daemon, so birchfs then gets `birch sync` (a commit), and bindfs-mt `sync -f` of the
        kernel ext4 below it.  fuse2fs and memfs_ll get `sync -f` alone (memfs_ll keeps nothing).
        With check, a failing command raises (timed steps must not pass on a failed sync)."""
        cmds = [["sync", "-f", path]]
        if self.is_birch:
            cmds.append([self.birch, "sync", self.mnt])
        elif self.kind == "bindfs-mt":
            cmds.append(["sync", "-f", self.src])
        for cmd in cmds:
            rc, out, err = run(cmd, timeout=1800)
            if rc != 0 and check:
                raise RuntimeError(fail_text(shlex.join(cmd), rc, out, err))

    def read_stats(self) -> dict | None:
        """birchfs's counters: the file MNT/.birch-stats if there is one, else the root's
        `trusted.birch.stats` xattr; JSON either way.  Read in a child with a timeout: a hung
        mount must not hang the harness."""
        if not self.is_birch:
            return None
        path = os.path.join(self.mnt, ".birch-stats")
        code = ("import os,sys\n"
                "p=sys.argv[1]\n"
                "if os.path.isfile(os.path.join(p,'.birch-stats')):\n"
                "    sys.stdout.write(open(os.path.join(p,'.birch-stats')).read())\n"
                "else:\n"
                "    sys.stdout.buffer.write(os.getxattr(p,'trusted.birch.stats'))\n")
        rc, out, _ = run([sys.executable, "-c", code, self.mnt], timeout=15)
        if rc != 0 or not out.strip():
            return None
        try:
            return json.loads(out)
        except ValueError:
            return {"_unparsed": out[:2000]}


# --------------------------------------------------------------------------- workloads

class Metric:
    def __init__(self, key, label, unit, kind="other", ratio=False, maxlat=False, chart=None):
        self.key, self.label, self.unit, self.kind = key, label, unit, kind
        self.ratio = ratio      # gets a birchfs/peer ratio column
        self.maxlat = maxlat    # the "max latency" of the before/after line
        self.chart = (kind == "tp") if chart is None else chart

    @property
    def head(self) -> str:
        return f"{self.label} ({self.unit})" if self.unit else self.label


class Case:
    def __init__(self, cid, wl, title, short, metrics, fn, params, raw_ok=False):
        self.id, self.wl, self.title, self.short = cid, wl, title, short
        self.metrics, self.fn, self.params, self.raw_ok = metrics, fn, params, raw_ok

    @property
    def headline(self) -> Metric:
        return next(m for m in self.metrics if m.ratio)


WL_TITLES = {
    "W1": "W1 dbench (seed 000): client.txt load",
    "W2": "W2 concurrent O_DIRECT writers, one file (seed 001): fio",
    "W3": "W3 create/remove, each thread its own directory (seed 002)",
    "W4": "W4 sysbench fileio (seed 003)",
    "W5": "W5 append 4 KiB + fsync latency, one thread",
    "W6": "W6 everyday work: unpack, git, walk, read, appends, SQLite, rm (seconds, to durable)",
}


def raw_path(ctx, suffix="txt") -> str:
    return os.path.join(ctx["rawdir"], f"{ctx['case'].id}__{ctx['target'].safe}__r{ctx['rep']}.{suffix}")


def save_raw(ctx, text: str, suffix="txt") -> str:
    p = raw_path(ctx, suffix)
    with open(p, "w") as f:
        f.write(text)
    return os.path.relpath(p, ctx["out"])


def fail_text(what, rc, out, err) -> str:
    tail = (err.strip() or out.strip())[-600:]
    return f"{what} rc={rc}: {tail}"


def w1_dbench(ctx, wd, p):
    cmd = ["dbench", "-t", str(p["time"]), "-D", wd, "-c", p["loadfile"], str(p["clients"])]
    rc, out, err = run(cmd, timeout=p["time"] * 2 + 300, cwd=wd)
    ctx["raw"] = save_raw(ctx, f"$ {shlex.join(cmd)}\n{out}\n--- stderr\n{err}")
    m = re.search(r"Throughput\s+([\d.]+)\s+MB/sec.*?max_latency=([\d.]+)\s*ms", out)
    if rc != 0 or not m:
        raise RuntimeError(fail_text("dbench", rc, out, err))
    res = {"mbps": float(m.group(1)), "max_lat_ms": float(m.group(2))}
    f = re.search(r"^\s*Flush\s+(\d+)\s+([\d.]+)\s+([\d.]+)", out, re.M)
    if f:
        res.update(flush_count=int(f.group(1)), flush_avg_ms=float(f.group(2)),
                   flush_max_ms=float(f.group(3)))
    return res


def w2_fio(ctx, wd, p):
    threads, region = p["threads"], p["region"]
    if ctx["target"].kind == "raw":
        fname = wd
    else:
        fname = os.path.join(wd, "fio.dat")
        # the file is written out before the timed part: the workload overwrites in place
        cmd = ["dd", "if=/dev/zero", f"of={fname}", "bs=1M", f"count={max(1, threads * region >> 20)}",
               "conv=fsync", "status=none"]
        rc, out, err = run(cmd, timeout=900)
        if rc != 0:
            raise RuntimeError(fail_text("dd (layout)", rc, out, err))
    cmd = ["fio", "--name=w2", f"--filename={fname}", "--thread", f"--numjobs={threads}",
           f"--bs={p['bs']}", "--rw=write", "--direct=1", f"--sync={1 if p['osync'] else 0}",
           "--ioengine=psync", f"--size={region}", f"--offset_increment={region}",
           "--time_based", f"--runtime={p['time']}", "--group_reporting",
           "--output-format=json"]
    rc, out, err = run(cmd, timeout=p["time"] * 3 + 300)
    ctx["raw"] = save_raw(ctx, out if out.strip() else err, "json")
    try:
        js = json.loads(out[out.index("{"):])
        w = js["jobs"][0]["write"]
        pct = w["clat_ns"].get("percentile", {})
    except (ValueError, KeyError, IndexError):
        raise RuntimeError(fail_text("fio", rc, out, err))
    if rc != 0 or w.get("io_bytes", 0) == 0:
        raise RuntimeError(fail_text("fio", rc, out, err))
    ms = lambda ns: ns / 1e6 if ns is not None else None  # noqa: E731
    return {"mibps": w["bw_bytes"] / 1048576, "iops": w["iops"],
            "p50_ms": ms(pct.get("50.000000")), "p99_ms": ms(pct.get("99.000000")),
            "p999_ms": ms(pct.get("99.900000")), "max_ms": ms(w["clat_ns"].get("max")),
            "percentiles_ms": {k: v / 1e6 for k, v in pct.items()}}


def w3_mdcr(ctx, wd, p):
    tool = ctx["cfg"].mdcr
    cmd = tool + [wd, str(p["threads"]), str(p["files"])]
    rc, out, err = run(cmd, timeout=3600)
    ctx["raw"] = save_raw(ctx, f"$ {shlex.join(cmd)}\n{out}\n--- stderr\n{err}")
    try:
        js = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(fail_text("mdcr", rc, out, err))
    if rc != 0 or js.get("error"):
        raise RuntimeError(f"mdcr rc={rc}: {js.get('error') or err.strip()[-300:]}")
    return {"creates_per_s": js["creates_per_s"], "removes_per_s": js["removes_per_s"],
            "files": js["created"]}


def w4_sysbench(ctx, wd, p):
    base = ["sysbench", "fileio", f"--file-num={p['files']}", f"--file-total-size={p['total']}",
            f"--file-block-size={p['block']}", f"--file-test-mode={p['mode']}",
            "--file-fsync-freq=0", "--file-io-mode=sync", f"--threads={p['threads']}",
            f"--time={p['time']}", "--events=0", "--percentile=99"]
    if p["fsync_all"]:
        base.append("--file-fsync-all=on")
    log_parts = []
    rc, out, err = run(base + ["prepare"], timeout=1800, cwd=wd)
    log_parts.append(f"$ {shlex.join(base + ['prepare'])}\nrc={rc}\n{out[-2000:]}\n{err[-2000:]}")
    if rc != 0:
        ctx["raw"] = save_raw(ctx, "\n".join(log_parts))
        raise RuntimeError(fail_text("sysbench prepare", rc, out, err))
    ctx["target"].sync(wd)  # prepared data on disk before the timed part
    rc, out, err = run(base + ["run"], timeout=p["time"] * 3 + 600, cwd=wd)
    log_parts.append(f"$ {shlex.join(base + ['run'])}\nrc={rc}\n{out}\n{err}")
    run(base + ["cleanup"], timeout=900, cwd=wd)
    ctx["raw"] = save_raw(ctx, "\n".join(log_parts))

    def grab(rx):
        m = re.search(rx, out)
        return float(m.group(1)) if m else None
    mib = grab(r"written, MiB/s:\s+([\d.]+)")
    if rc != 0 or mib is None:
        raise RuntimeError(fail_text("sysbench run", rc, out, err))
    return {"mibps": mib, "writes_per_s": grab(r"writes/s:\s+([\d.]+)"),
            "fsyncs_per_s": grab(r"fsyncs/s:\s+([\d.]+)"),
            "p99_ms": grab(r"99th percentile:\s+([\d.]+)"), "max_ms": grab(r"max:\s+([\d.]+)")}


def w5_fsync(ctx, wd, p):
    raw = ctx["target"].kind == "raw"
    path = wd if raw else os.path.join(wd, "append.dat")
    cmd = [sys.executable, os.path.abspath(__file__), "--_w5", path, "raw" if raw else "append",
           str(p["time"]), str(p["max_ops"])]
    rc, out, err = run(cmd, timeout=p["time"] * 4 + 300)
    ctx["raw"] = save_raw(ctx, out if out.strip() else err, "json")
    try:
        js = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(fail_text("w5", rc, out, err))
    if rc != 0 or not js.get("ops"):
        raise RuntimeError(fail_text("w5", rc, out, err))
    return js


def w5_child(path: str, mode: str, seconds: float, max_ops: int) -> None:
    """One thread: 4 KiB append + fsync (a file), or 4 KiB O_DIRECT write + flush (the raw device)."""
    import mmap
    lat = []
    if mode == "raw":
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, 4096)  # page aligned, as O_DIRECT needs
        buf.write(b"\xa5" * 4096)
        span = min(os.lseek(fd, 0, os.SEEK_END), 256 << 20) // 4096
        off = 0
        end = time.monotonic() + seconds
        while len(lat) < max_ops and time.monotonic() < end:
            t0 = time.perf_counter_ns()
            os.pwrite(fd, buf, (off % span) * 4096)
            os.fsync(fd)  # on a block device: a cache flush
            lat.append(time.perf_counter_ns() - t0)
            off += 1
    else:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        buf = b"\xa5" * 4096
        end = time.monotonic() + seconds
        while len(lat) < max_ops and time.monotonic() < end:
            t0 = time.perf_counter_ns()
            os.write(fd, buf)
            os.fsync(fd)
            lat.append(time.perf_counter_ns() - t0)
    os.close(fd)
    total = sum(lat)
    lat.sort()

    def pct(q):
        return lat[min(len(lat) - 1, int(q / 100 * len(lat)))] / 1e6
    res = {"ops": len(lat), "ops_per_s": len(lat) / (total / 1e9) if total else 0,
           "p50_ms": pct(50), "p90_ms": pct(90), "p99_ms": pct(99), "p999_ms": pct(99.9),
           "max_ms": lat[-1] / 1e6, "mean_ms": total / len(lat) / 1e6,
           "percentiles_ms": {str(q): pct(q) for q in (1, 5, 10, 25, 50, 75, 90, 95, 99, 99.5, 99.9)}}
    print(json.dumps(res))


# --------------------------------------------------------------------------- W6 everyday work

W6_STEPS = [  # (metric key, label): the order the steps run in
    ("unpack_s", "unpack+sync"),
    ("clone_s", "git clone+sync"),
    ("status_s", "git status"),
    ("walk_s", "walk"),
    ("read_s", "read all"),
    ("walk_cold_s", "walk cold"),
    ("read_cold_s", "read all cold"),
    ("append_s", "4 B appends+fsync"),
    ("sqlite_journal_s", "SQLite journal"),
    ("sqlite_wal_s", "SQLite WAL"),
    ("rm_s", "rm -rf+sync"),
    ("total_s", "total w/o cold"),
]
W6_COLD = ("walk_cold_s", "read_cold_s")  # not in the total: memfs_ll cannot do them
W6_SEED = 6
W6_DATE = "2026-01-0{}T12:00:00+00:00"  # commit k of the W6 repository


def git_env(home: str, day: int = 1) -> dict:
    """git without the machine's or the user's configuration, with fixed names and dates."""
    date = W6_DATE.format(day)
    return dict(os.environ, HOME=home, GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL="/dev/null",
                GIT_AUTHOR_NAME="birchbench", GIT_AUTHOR_EMAIL="birchbench@birchfs.invalid",
                GIT_COMMITTER_NAME="birchbench", GIT_COMMITTER_EMAIL="birchbench@birchfs.invalid",
                GIT_AUTHOR_DATE=date, GIT_COMMITTER_DATE=date, LC_ALL="C")


def w6_tree(files: int, seed: int) -> list[tuple[str, bytes | None]]:
    """A deterministic source tree: (path, content) in tar order, None for a directory.

    `files` files in files*3/20 directories (10,000 in 1,500), at most 7 deep; sizes
    log-normal around 3 KB (mean ~7 KB, 3% empty, at most 1 MiB); the text is slices of one
    pseudo-source pool, so it compresses and deltas like code does."""
    import math
    import random
    rnd = random.Random(seed)
    pick = lambda seq: seq[int(rnd.random() * len(seq))]  # noqa: E731  (stable across versions)
    words = ["static", "int", "return", "if", "else", "for", "while", "struct", "fn", "let", "mut",
             "self", "def", "class", "import", "const", "void", "char", "size_t", "u64", "match",
             "err", "buf", "len", "node", "tree", "key", "value", "ptr", "out", "inode", "offset",
             "{", "}", "(", ")", ";", "=", "==", "+", "->", "&&", "0", "1", "NULL", "None", "Ok"]
    lines, n = [], 0
    while n < (1 << 20):
        depth = int(rnd.random() * 4)
        line = "    " * depth + " ".join(pick(words) for _ in range(3 + int(rnd.random() * 9)))
        if rnd.random() < 0.08:
            line = "    " * depth + "// " + " ".join(pick(words) for _ in range(6))
        lines.append(line)
        n += len(line) + 1
    pool = ("\n".join(lines) + "\n").encode()
    dnames = ["src", "lib", "include", "core", "net", "fs", "util", "test", "docs", "drivers",
              "arch", "tools", "api", "io", "mem", "sched", "crypto", "block"]
    exts = [".c", ".c", ".h", ".h", ".rs", ".rs", ".py", ".go", ".md", ".txt", ".json", ".sh", ".S"]
    dirs = ["tree"]
    for i in range(max(1, files * 3 // 20) - 1):
        parent = pick(dirs)
        if parent.count("/") >= 7:
            parent = "tree"
        dirs.append(f"{parent}/{pick(dnames)}{i}")
    out: list[tuple[str, bytes | None]] = [(d, None) for d in dirs]
    for j in range(files):
        path = f"{pick(dirs)}/{pick(['file', 'mod', 'util', 'test', 'impl', 'ops'])}_{j}{pick(exts)}"
        size = 0 if rnd.random() < 0.03 else min(int(rnd.lognormvariate(math.log(3000), 1.3)), 1 << 20)
        body = f"// {path}\n".encode()
        while len(body) < size:
            off = int(rnd.random() * (len(pool) - 4096))
            body += pool[off: off + size - len(body)]
        out.append((path, body[:size]))
    return out


def w6_assets(cfg) -> dict:
    """The W6 tarball and git repository, made once and kept in IMAGE_DIR/w6/ (no network).

    Tarball: w6_tree as an uncompressed tar (fixed owner, modes and mtimes), so unpacking times
    the filesystem, not gzip.  Repository: the same tree as a first commit, then three commits
    that change, delete and add files, repacked; cloned with `git clone --no-hardlinks file://`."""
    import tarfile
    files = cfg.w6_files
    key = f"tree-{files}-s{W6_SEED}-v1"
    base = os.path.join(cfg.image_dir, "w6")
    os.makedirs(base, exist_ok=True)
    tar, repo, meta = (os.path.join(base, key + ext) for ext in (".tar", ".repo", ".json"))
    try:
        with open(meta) as f:
            info = json.load(f)
        if os.path.isfile(tar) and os.path.isdir(os.path.join(repo, ".git")):
            return info
    except (OSError, ValueError):
        pass
    t0 = time.time()
    tree = w6_tree(files, W6_SEED)
    mtime = 1767268800  # 2026-01-01
    with tarfile.open(tar + ".part", "w", format=tarfile.GNU_FORMAT) as tf:
        for path, body in tree:
            ti = tarfile.TarInfo(path)
            ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = mtime, 0, 0, "root", "root"
            if body is None:
                ti.type, ti.mode = tarfile.DIRTYPE, 0o755
                tf.addfile(ti)
            else:
                import io
                ti.size, ti.mode = len(body), 0o755 if path.endswith(".sh") else 0o644
                tf.addfile(ti, io.BytesIO(body))
    os.replace(tar + ".part", tar)
    # the repository: tree as commit 1, three more commits on top
    part = repo + ".part"
    shutil.rmtree(part, ignore_errors=True)
    shutil.rmtree(repo, ignore_errors=True)
    os.makedirs(part)

    def git(*args, day=1):
        rc, out, err = run(["git", *args], timeout=900, cwd=part, env=git_env(base, day))
        if rc != 0:
            raise RuntimeError(fail_text("git " + " ".join(args), rc, out, err))
    rc, out, err = run(["tar", "-xf", tar, "-C", part, "--strip-components=1"], timeout=900)
    if rc != 0:
        raise RuntimeError(fail_text("tar -xf (W6 repository)", rc, out, err))
    git("init", "-q", "-b", "main")
    git("add", "-A")
    git("commit", "-q", "-m", "import the tree")
    paths = [p[len("tree/"):] for p, body in tree if body is not None]
    for k in (2, 3, 4):
        for i, p in enumerate(paths):
            full = os.path.join(part, p)
            if not os.path.exists(full):
                continue
            if i % (97 + k) == 0:
                os.unlink(full)
            elif i % (23 + k) == 0:
                with open(full, "ab") as f:
                    f.write(f"// change {k} of {p}\n".encode())
        for i in range(10):
            with open(os.path.join(part, os.path.dirname(paths[i * 31 % len(paths)]), f"new_{k}_{i}.c"), "w") as f:
                f.write(f"// added in commit {k}\nint new_{k}_{i}(void) {{ return {i}; }}\n")
        git("add", "-A", day=k)
        git("commit", "-q", "-m", f"change {k}", day=k)
    git("repack", "-adq")
    git("gc", "-q", "--prune=now")
    os.replace(part, repo)
    info = {"tar": tar, "repo": repo, "files": files, "dirs": sum(1 for _, b in tree if b is None),
            "bytes": sum(len(b) for _, b in tree if b is not None), "seed": W6_SEED}
    with open(meta, "w") as f:
        json.dump(info, f)
    log(f"W6: made {tar} ({info['files']:,} files, {info['dirs']:,} directories, "
        f"{info['bytes'] / 1e6:.1f} MB) and the repository {repo} ({time.time() - t0:.1f}s)")
    return info


def drop_caches() -> None:
    """Write back, then drop the page cache, dentries and inodes (every filesystem's)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def w6_everyday(ctx, wd, p):
    """Every step is timed from its start until the target says its result is durable
    (Target.sync with check); the walk, read and git status steps write nothing to wait for.

    The cold walk and read follow a drop of the machine's caches.  Not on memfs_ll: its
    lookup replies carry no size or times, and with no_timeout the kernel keeps those
    zeros for good once it has forgotten an inode (a cold walk finds every file empty)."""
    t, a = ctx["target"], ctx["cfg"].w6
    tree, clone = os.path.join(wd, "tree"), os.path.join(wd, "clone")
    genv = git_env(os.path.join(ctx["cfg"].image_dir, "w6"))
    res: dict = {}
    trace: list[str] = []

    def cmd(what, argv, cwd=None, env=None):
        rc, out, err = run(argv, timeout=3600, cwd=cwd, env=env)
        trace.append(f"$ {shlex.join(argv)}\nrc={rc}\n{out[-1500:]}{err[-1500:]}")
        if rc != 0:
            raise RuntimeError(fail_text(f"W6 {what}: {shlex.join(argv)}", rc, out, err))
        return out

    def child(what, *args):
        out = cmd(what, [sys.executable, os.path.abspath(__file__), "--_w6", *map(str, args)])
        return json.loads(out.strip().splitlines()[-1])

    def step(key, fn, durable=True):
        t0 = time.perf_counter()
        fn()
        if durable:
            t.sync(wd, check=True)
        res[key] = time.perf_counter() - t0
        trace.append(f"# {key} = {res[key]:.3f} s")

    def walk():
        sizes = cmd("walk", ["find", ".", "-type", "f", "-printf", "%s\\n"], cwd=tree).split()
        if len(sizes) != a["files"] or sum(map(int, sizes)) != a["bytes"]:
            raise RuntimeError(f"W6 walk: found {len(sizes)} files, {sum(map(int, sizes))} bytes; "
                               f"the tarball has {a['files']} files, {a['bytes']} bytes")

    def read_all():
        out = cmd("read", ["bash", "-c", "set -o pipefail; find . -type f -print0 | xargs -0 cat | wc -c"],
                  cwd=tree)
        if int(out.split()[0]) != a["bytes"]:
            raise RuntimeError(f"W6 read: read {out.split()[0]} bytes, the tarball has {a['bytes']}")

    def status():
        out = cmd("git status", ["git", "-C", clone, "status", "--porcelain"], env=genv)
        if out.strip():
            raise RuntimeError(f"W6 git status: a fresh clone is not clean: {out.strip()[:300]}")

    def timed_child(key, *args):
        js = child(key, *args)
        res[key] = js["seconds"]  # timed inside the child: writes + fsyncs, no interpreter start
        trace.append(f"# {key} = {res[key]:.3f} s ({json.dumps(js)})")

    try:
        step("unpack_s", lambda: cmd("unpack", ["tar", "-xf", a["tar"], "-C", wd]))
        step("clone_s", lambda: cmd("git clone", ["git", "clone", "-q", "--no-hardlinks",
                                                   "file://" + a["repo"], clone], env=genv))
        step("status_s", status, durable=False)
        step("walk_s", walk, durable=False)
        step("read_s", read_all, durable=False)
        if p["drop_caches"] and t.kind != "memfs_ll":
            drop_caches()
            step("walk_cold_s", walk, durable=False)
            step("read_cold_s", read_all, durable=False)
        else:
            trace.append("# cold walk and read skipped" + (" (memfs_ll keeps no attributes "
                         "for the kernel to look up again)" if p["drop_caches"] else ""))
        timed_child("append_s", "append", os.path.join(wd, "append.log"), p["appends"])
        timed_child("sqlite_journal_s", "sqlite", os.path.join(wd, "journal.db"), p["sqlite_journal"], "delete")
        timed_child("sqlite_wal_s", "sqlite", os.path.join(wd, "wal.db"), p["sqlite_wal"], "wal")
        step("rm_s", lambda: cmd("rm", ["rm", "-rf", tree]))
        if os.path.exists(tree):
            raise RuntimeError(f"W6 rm: {tree} still exists after rm -rf")
    finally:
        ctx["raw"] = save_raw(ctx, "\n".join(trace))
    res["total_s"] = sum(v for k, v in res.items() if k not in W6_COLD)
    return res


def w6_child(argv: list[str]) -> None:
    """W6's own steps, each timed in this process; prints one JSON line.

    append PATH N: N writes of 4 bytes to a file opened O_APPEND, then one fsync.
    sqlite PATH N MODE: N commits of one small INSERT each, journal_mode=MODE
    (delete = the rollback journal, or wal), synchronous=FULL."""
    what, path, n = argv[0], argv[1], int(argv[2])
    if what == "append":
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        t0 = time.perf_counter()
        for _ in range(n):
            os.write(fd, b"abc\n")
        os.fsync(fd)
        secs = time.perf_counter() - t0
        os.close(fd)
        size = os.stat(path).st_size
        if size != 4 * n:
            raise SystemExit(f"append: file has {size} bytes after {n} appends of 4")
        print(json.dumps({"seconds": secs, "writes": n, "writes_per_s": n / secs}))
    elif what == "sqlite":
        import sqlite3
        mode = argv[3]
        db = sqlite3.connect(path, isolation_level=None)  # autocommit: one INSERT, one commit
        got = db.execute(f"PRAGMA journal_mode={mode}").fetchone()[0]
        if got.lower() != mode:
            raise SystemExit(f"sqlite: asked journal_mode={mode}, got {got}")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, at REAL, note TEXT)")
        t0 = time.perf_counter()
        for i in range(n):
            db.execute("INSERT INTO t (at, note) VALUES (?, ?)", (time.time(), f"commit {i} " + "x" * 64))
        secs = time.perf_counter() - t0
        rows = db.execute("SELECT count(*) FROM t").fetchone()[0]
        db.close()
        if rows != n:
            raise SystemExit(f"sqlite: {rows} rows after {n} commits")
        print(json.dumps({"seconds": secs, "commits": n, "commits_per_s": n / secs, "journal_mode": got}))
    else:
        raise SystemExit(f"unknown W6 step {what}")


# --------------------------------------------------------------------------- memfs_ll

def libfuse_tar() -> str:
    return os.path.abspath(os.environ.get("BIRCHBENCH_LIBFUSE_TAR")
                           or os.path.join(REPO, "..", "shared", "libfuse", "libfuse-e8d407ce.tar.gz"))


def memfs_env(binp: str) -> dict:
    """memfs_ll runs from the build tree: its libfuse3.so is in build/lib."""
    return dict(os.environ, LD_LIBRARY_PATH=os.path.join(os.path.dirname(os.path.dirname(binp)), "lib"))


def build_memfs(cfg) -> tuple[str | None, str]:
    """libfuse's example/memfs_ll, built once from the tarball into IMAGE_DIR/<name>/build
    (meson + ninja, about 40 s on 2 cores).  Returns (binary, "") or (None, why not)."""
    tar = libfuse_tar()
    if not os.path.isfile(tar):
        return None, f"no libfuse source: {tar} not found (set BIRCHBENCH_LIBFUSE_TAR)"
    name = re.sub(r"\.(tar\.gz|tgz|tar\.xz|tar)$", "", os.path.basename(tar))
    src = os.path.join(cfg.image_dir, name)
    binp = os.path.join(src, "build", "example", "memfs_ll")
    stamp = os.path.join(src, ".birchbench-built")
    want = f"{tar} {os.path.getsize(tar)} {int(os.path.getmtime(tar))}\n"
    try:
        with open(stamp) as f:
            if f.read() == want and os.access(binp, os.X_OK):
                return binp, ""
    except OSError:
        pass
    missing = [t for t in ("meson", "ninja", "c++", "pkg-config") if not shutil.which(t)]
    if missing:
        return None, f"cannot build memfs_ll: {', '.join(missing)} missing (bench/run.sh installs them)"
    log(f"memfs_ll: building libfuse from {tar} into {src}/build")
    t0 = time.time()
    shutil.rmtree(src, ignore_errors=True)
    os.makedirs(src)
    for what, cmd in (("tar", ["tar", "-xzf", tar, "-C", src, "--strip-components=1"]),
                      ("meson setup", ["meson", "setup", "build", "-Dexamples=true", "-Dtests=false",
                                       "-Duseroot=false", "-Dinitscriptdir="]),
                      ("ninja", ["ninja", "-C", "build"])):
        rc, out, err = run(cmd, timeout=1800, cwd=src)
        if rc != 0:
            return None, fail_text(f"memfs_ll build: {what}", rc, out, err)
    if not os.access(binp, os.X_OK):
        return None, f"memfs_ll build: {binp} missing after ninja"
    with open(stamp, "w") as f:
        f.write(want)
    log(f"memfs_ll: built in {time.time() - t0:.0f}s")
    return binp, ""


def build_cases(cfg) -> list[Case]:
    cases = []
    if "W1" in cfg.workloads:
        for n in cfg.dbench_clients:
            cases.append(Case(f"w1-dbench-{n}", "W1", f"dbench {n} clients", f"{n}cl", [
                Metric("mbps", "MB/s", "", "tp", ratio=True),
                Metric("max_lat_ms", "max lat", "ms", "lat", maxlat=True),
                Metric("flush_avg_ms", "Flush avg", "ms", "lat"),
                Metric("flush_max_ms", "Flush max", "ms", "lat"),
            ], w1_dbench, {"clients": n, "time": cfg.dbench_time, "loadfile": cfg.dbench_loadfile}))
    if "W2" in cfg.workloads:
        for mode in cfg.fio_modes:
            osync = mode == "osync"
            label = "O_DIRECT|O_SYNC" if osync else "O_DIRECT"
            cases.append(Case(f"w2-fio-{mode}", "W2", f"fio {cfg.fio_threads} threads {label}", label, [
                Metric("mibps", "MiB/s", "", "tp", ratio=True),
                Metric("p50_ms", "p50", "ms", "lat"),
                Metric("p99_ms", "p99", "ms", "lat"),
                Metric("max_ms", "max", "ms", "lat", maxlat=True),
            ], w2_fio, {"threads": cfg.fio_threads, "bs": cfg.fio_bs, "region": cfg.fio_region,
                        "time": cfg.fio_time, "osync": osync}, raw_ok=True))
    if "W3" in cfg.workloads:
        for n in cfg.md_threads:
            cases.append(Case(f"w3-mdtest-{n}", "W3", f"create/remove {n} threads", f"{n}thr", [
                Metric("creates_per_s", "creates/s", "", "tp", ratio=True),
                Metric("removes_per_s", "removes/s", "", "tp", ratio=True),
            ], w3_mdcr, {"threads": n, "files": cfg.md_files}))
    if "W4" in cfg.workloads:
        for mode in cfg.sb_modes:
            fsync_all = mode.endswith("-fsyncall")
            tm = mode.replace("-fsyncall", "")
            short = tm + (" fsync-all" if fsync_all else "")
            cases.append(Case(f"w4-sysbench-{mode}", "W4", f"sysbench {short}", short, [
                Metric("mibps", "MiB/s", "", "tp", ratio=True),
                Metric("fsyncs_per_s", "fsyncs/s", "", "tp", chart=fsync_all),
                Metric("p99_ms", "p99", "ms", "lat"),
                Metric("max_ms", "max", "ms", "lat", maxlat=True),
            ], w4_sysbench, {"mode": tm, "fsync_all": fsync_all, "files": cfg.sb_files,
                             "total": cfg.sb_total, "block": cfg.sb_block,
                             "threads": cfg.sb_threads, "time": cfg.sb_time}))
    if "W5" in cfg.workloads:
        cases.append(Case("w5-fsync", "W5", "append 4 KiB + fsync (raw: write + flush)", "fsync", [
            Metric("ops_per_s", "ops/s", "", "tp"),
            Metric("p50_ms", "p50", "ms", "lat", ratio=True),
            Metric("p99_ms", "p99", "ms", "lat", ratio=True),
            Metric("max_ms", "max", "ms", "lat", maxlat=True),
        ], w5_fsync, {"time": cfg.w5_time, "max_ops": cfg.w5_max_ops}, raw_ok=True))
    if "W6" in cfg.workloads:
        cases.append(Case("w6-everyday", "W6", f"everyday work, {cfg.w6_files:,} files", "W6", [
            Metric(key, label, "s", "time", ratio=True, chart=True) for key, label in W6_STEPS
        ], w6_everyday, {"files": cfg.w6_files, "appends": cfg.w6_appends,
                         "sqlite_journal": cfg.w6_sqlite_journal, "sqlite_wal": cfg.w6_sqlite_wal,
                         "drop_caches": cfg.w6_drop_caches}))
    return cases


# --------------------------------------------------------------------------- counters

def flatten(d, prefix="") -> dict:
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        out[prefix[:-1]] = d
    return out


def counter_delta(before, after) -> dict | None:
    if after is None:
        return None
    a, b = flatten(after), flatten(before or {})
    return {k: (v - b[k] if k in b else v) for k, v in a.items()}


# --------------------------------------------------------------------------- aggregation

def summarize(runs, cases, targets) -> dict:
    summ = {}
    for c in cases:
        for t in targets:
            rs = [r for r in runs if r["case"] == c.id and r["target"] == t.name]
            ok = [r for r in rs if r["ok"]]
            entry = {"runs": len(rs), "ok": len(ok), "median": {}, "min": {}, "max": {}}
            for m in c.metrics:
                vals = [r["metrics"][m.key] for r in ok if r["metrics"].get(m.key) is not None]
                if vals:
                    entry["median"][m.key] = statistics.median(vals)
                    entry["min"][m.key] = min(vals)
                    entry["max"][m.key] = max(vals)
            cnt = [r["counters_delta"] for r in ok if r.get("counters_delta")]
            if cnt:
                keys = sorted(set().union(*cnt))
                entry["counters"] = {k: statistics.median([d[k] for d in cnt if k in d]) for k in keys}
            summ.setdefault(c.id, {})[t.name] = entry
    return summ


def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def before_after(summ, cases, a: str, b: str) -> list[dict]:
    lines = []
    for c in cases:
        sa, sb = summ.get(c.id, {}).get(a), summ.get(c.id, {}).get(b)
        if not sa or not sb:
            continue
        tp = next((m for m in c.metrics if m.kind == "tp"), None)
        ml = next((m for m in c.metrics if m.maxlat), None)
        item = {"case": c.id, "title": c.title}
        va, vb = sa["median"].get(tp.key) if tp else None, sb["median"].get(tp.key) if tp else None
        if va and vb is not None:
            item["throughput_pct"] = (vb / va - 1) * 100
        la, lb = sa["median"].get(ml.key) if ml else None, sb["median"].get(ml.key) if ml else None
        if la and lb is not None:
            item["max_latency_pct"] = (lb / la - 1) * 100
        tt = next((m for m in c.metrics if m.key == "total_s"), None)
        ta, tb = sa["median"].get(tt.key) if tt else None, sb["median"].get(tt.key) if tt else None
        if ta and tb is not None:
            item["time_pct"] = (tb / ta - 1) * 100
        if len(item) > 2:
            parts = []
            if "time_pct" in item:
                parts.append(f"{item['time_pct']:+.1f}% total time")
            if "throughput_pct" in item:
                parts.append(f"{item['throughput_pct']:+.1f}% throughput")
            if "max_latency_pct" in item:
                parts.append(f"{item['max_latency_pct']:+.1f}% max latency")
            item["text"] = ", ".join(parts)
            lines.append(item)
    return lines


def before_after_table(summ, cases, a: str, b: str) -> list[dict]:
    """Every figure of every case both targets have: a's and b's medians and b/a."""
    rows = []
    for c in cases:
        sa, sb = summ.get(c.id, {}).get(a), summ.get(c.id, {}).get(b)
        if not sa or not sb:
            continue
        for m in c.metrics:
            va, vb = sa["median"].get(m.key), sb["median"].get(m.key)
            if va is None and vb is None:
                continue
            rows.append({"case": c.id, "title": c.title, "metric": m.key, "head": m.head, "kind": m.kind,
                         "a": va, "b": vb, "ratio": ratio(vb, va)})
    return rows


# --------------------------------------------------------------------------- reports

def cell(entry, key, t, case):
    if not t.supports(case):
        return "n/a"
    if entry is None or entry["runs"] == 0:
        return t.status if t.status in ("failed", "skipped") else "—"
    if entry["ok"] == 0:
        return "FAIL"
    v = entry["median"].get(key)
    return fmt_num(v)


def write_markdown(res, cases, targets, out) -> str:
    summ = res["summary"]
    birch = [t for t in targets if t.is_birch]
    # the ratio columns are against birchfs on the --birch binary, never birchfs-before
    primary = next((t for t in birch if t.status == "ok" and not t.before),
                   next((t for t in birch if not t.before), birch[0] if birch else None))
    peers = [t for t in targets if not t.is_birch]
    L = []
    meta = res["meta"]
    L.append(f"# birchbench results, {meta['date']}\n")
    L.append(f"- command: `{meta['command']}`")
    L.append(f"- birch binary: `{meta['config'].get('birch')}`")
    if meta["config"].get("birch_before"):
        L.append(f"- birch binary of birchfs-before (`--birch-before`): `{meta['config']['birch_before']}`")
    L.append(f"- machine: {meta['machine']['cpu']} ({meta['machine']['cores']} cores, "
             f"{meta['machine']['mem_gib']} GiB), kernel {meta['machine']['kernel']}")
    L.append(f"- images: {human(meta['config']['image_size'])} each in `{meta['config']['image_dir']}` "
             f"on host {meta['machine']['image_fs']}, written out in full; loop devices with direct I/O")
    L.append(f"- repeats: {meta['config']['repeats']} (figures are medians), order interleaved "
             f"(every case runs on all targets in turn, repeat after repeat); each run on a fresh mount")
    L.append(f"- duration of the whole run: {res['meta'].get('elapsed_s', 0) / 60:.1f} min"
             + (" (INTERRUPTED: partial results)" if res["meta"].get("interrupted") else ""))
    L.append("")
    L.append("## Targets\n")
    L.append("| target | status | detail |")
    L.append("|---|---|---|")
    for t in targets:
        det = t.error or ", ".join(f"{k}={v}" for k, v in t.meta.items() if k in ("loop", "loop_dio", "loop_discard", "image_allocated_pct", "image_allocated_pct_end", "version"))
        if t.is_birch:
            det += f"; binary `{t.birch}`" + (f" sha256 {t.meta['birch_sha256'][:16]}…" if t.meta.get("birch_sha256") else "")
        L.append(f"| {t.name} | {t.status} | {det.replace('|', '/')} |")
    L.append("")
    if res.get("before_after_binary"):
        ba = res["before_after_binary"]
        L.append(f"## Before/after birch binary: {ba['a']} → {ba['b']}\n")
        for n in (ba["a"], ba["b"]):
            bi = ba["binaries"][n]
            L.append(f"- {n}: `{bi['path']}`, `{bi.get('version')}`, sha256 `{bi.get('sha256')}`")
        L.append("")
        for it in ba["lines"]:
            L.append(f"- {it['title']}: **{it['text']}**")
        if not ba["lines"]:
            L.append("- no case produced numbers on both binaries")
        L.append("")
        if ba.get("table"):
            L.append(f"Medians; {ba['b']}/{ba['a']} above 1 means the new binary is faster for throughput "
                     "(MB/s, ops/s, …) and slower for latency and time (ms, s).\n")
            L.append(f"| case | figure | {ba['a']} | {ba['b']} | {ba['b']}/{ba['a']} |")
            L.append("|---|---|---|---|---|")
            for row in ba["table"]:
                L.append(f"| {row['title'].replace('|', chr(92) + '|')} | {row['head'].replace('|', chr(92) + '|')} | "
                         f"{fmt_num(row['a'])} | {fmt_num(row['b'])} | "
                         + (f"{row['ratio']:.2f}" if row["ratio"] is not None else "—") + " |")
            L.append("")
    if res.get("before_after"):
        ba = res["before_after"]
        L.append(f"## Before/after on birchfs: {ba['a']} → {ba['b']}\n")
        for it in ba["lines"]:
            L.append(f"- {it['title']}: **{it['text']}**")
        if not ba["lines"]:
            L.append("- no case produced numbers on both option sets")
        L.append("")
    ratio_rows = []
    for wl in sorted({c.wl for c in cases}):
        wcases = [c for c in cases if c.wl == wl]
        L.append(f"## {WL_TITLES[wl]}\n")
        for c in wcases:
            L.append(f"- **{c.short}**: {c.title}; params: "
                     + ", ".join(f"{k}={human(v) if isinstance(v, int) and v >= 1024 else v}"
                                 for k, v in c.params.items() if k != "loadfile"))
        L.append("")
        cols = [(c, m) for c in wcases for m in c.metrics]
        rcols = [(c, m) for c in wcases for m in c.metrics if m.ratio] if primary else []
        head = ["target"] + [f"{c.short} {m.head}" for c, m in cols]
        head += [f"{primary.name}/peer {c.short} {m.label}" for c, m in rcols] if primary else []
        L.append("| " + " | ".join(h.replace("|", "\\|") for h in head) + " |")
        L.append("|" + "---|" * len(head))
        for t in targets:
            row = [t.name]
            for c, m in cols:
                row.append(cell(summ[c.id].get(t.name), m.key, t, c))
            for c, m in rcols:
                if t is primary:
                    row.append("1")
                    continue
                pv = summ[c.id].get(primary.name, {}).get("median", {}).get(m.key)
                tv = summ[c.id].get(t.name, {}).get("median", {}).get(m.key)
                if not t.supports(c):
                    row.append("n/a")
                    continue
                r = ratio(pv, tv)
                row.append(f"{r:.2f}" if r is not None else "—")
            L.append("| " + " | ".join(row) + " |")
        L.append("")
        for c, m in rcols:
            for b in birch:
                for t in peers:
                    if not t.supports(c):
                        continue
                    r = ratio(summ[c.id].get(b.name, {}).get("median", {}).get(m.key),
                              summ[c.id].get(t.name, {}).get("median", {}).get(m.key))
                    ratio_rows.append((c, m, b, t, r))
        for png in res["charts"].get(wl, []):
            L.append(f"![{wl} {os.path.splitext(png)[0]}]({png})")
        L.append("")
        # birchfs counters per case
        crow = []
        for c in wcases:
            for b in birch:
                cnt = summ[c.id].get(b.name, {}).get("counters")
                if cnt:
                    crow.append((c, b, cnt))
        if birch:
            if crow:
                L.append(f"birchfs counters ({wl}, medians of the per-run deltas of `trusted.birch.stats`, zeros left out):\n")
                for c, b, cnt in crow:
                    L.append(f"- {b.name} {c.short}: " + ", ".join(f"{k}={fmt_num(v)}" for k, v in cnt.items() if v))
            elif any(t.status == "ok" for t in birch):
                L.append(f"birchfs counters ({wl}): none (this build exposes neither `.birch-stats` "
                         "nor the `trusted.birch.stats` xattr)")
            L.append("")
    if birch and ratio_rows:
        L.append("## Ratios birchfs/peer (medians)\n")
        L.append("Throughput ratios above 1 mean birchfs is faster; latency and time (W6, seconds) "
                 "ratios above 1 mean birchfs is slower.\n")
        pnames = [t.name for t in peers]
        for b in birch:
            L.append(f"### {b.name}\n")
            L.append("| case | figure | " + " | ".join(f"{b.name}/{p}" for p in pnames) + " |")
            L.append("|---|---|" + "---|" * len(pnames))
            seen = []
            for c, m, bb, t, r in ratio_rows:
                if bb is b and (c.id, m.key) not in seen:
                    seen.append((c.id, m.key))
            for cid, key in seen:
                c = next(x for x in cases if x.id == cid)
                m = next(x for x in c.metrics if x.key == key)
                vals = {t.name: r for cc, mm, bb, t, r in ratio_rows if bb is b and cc.id == cid and mm.key == key}
                L.append(f"| {c.title.replace('|', chr(92) + '|')} | {m.head} | "
                         + " | ".join((f"{vals[p]:.2f}" if vals.get(p) is not None else
                                       ("n/a" if p not in vals else "—")) for p in pnames) + " |")
            L.append("")
    fails = [r for r in res["runs"] if not r["ok"]]
    if fails:
        L.append("## Failed runs\n")
        for r in fails:
            L.append(f"- {r['case']} on {r['target']} (repeat {r['rep']}): {str(r['error'])[:400].replace(chr(10), ' ')}")
        L.append("")
    L.append(f"Raw results: `results.json`; tool outputs: `raw/`; log: `run.log`.\n")
    text = "\n".join(L)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    return text


def write_charts(res, cases, targets, out) -> dict:
    charts: dict[str, list[str]] = {}
    try:
        try:
            import matplotlib
        except ImportError:  # another python than Debian's: try the python3-matplotlib package
            sys.path.append("/usr/lib/python3/dist-packages")
            import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        log(f"charts skipped: matplotlib not available ({e})")
        return charts
    summ = res["summary"]

    def color(t):
        return ("#f59f00" if t.before else "#d9480f") if t.is_birch else ("#868e96" if t.kind in ("raw", "memfs_ll") else "#1c7ed6")

    for wl in sorted({c.wl for c in cases}):
        wcases = [c for c in cases if c.wl == wl]
        panels = [(c, m) for c in wcases for m in c.metrics if m.chart]
        if panels:
            nc = min(3, len(panels))
            nr = (len(panels) + nc - 1) // nc
            fig, axes = plt.subplots(nr, nc, figsize=(max(7, 4.6 * nc), 4.0 * nr), squeeze=False)
            flat = [ax for row in axes for ax in row]
            for ax in flat[len(panels):]:
                ax.axis("off")
            for ax, (c, m) in zip(flat, panels):
                ts = [t for t in targets if t.supports(c)]
                names, vals, lo, hi, cols = [], [], [], [], []
                for t in ts:
                    e = summ[c.id].get(t.name) or {}
                    v = e.get("median", {}).get(m.key)
                    names.append(t.name)
                    vals.append(v or 0)
                    lo.append((v - e["min"][m.key]) if v is not None else 0)
                    hi.append((e["max"][m.key] - v) if v is not None else 0)
                    cols.append(color(t))
                x = range(len(names))
                ax.bar(x, vals, color=cols, yerr=[lo, hi], capsize=3)
                for i, v in enumerate(vals):
                    ax.text(i, v, fmt_num(v) if v else "×", ha="center", va="bottom", fontsize=7)
                ax.set_xticks(list(x))
                ax.set_xticklabels(names, rotation=40, ha="right", fontsize=8)
                ax.set_title(f"{c.title}\n{m.head}", fontsize=9)
                ax.grid(axis="y", alpha=0.3)
            fig.suptitle(f"{WL_TITLES[wl]}\nmedians; whiskers: min–max over repeats", fontsize=10)
            fig.tight_layout()
            name = f"{wl.lower()}_{'times' if all(m.kind == 'time' for _, m in panels) else 'throughput'}.png"
            fig.savefig(os.path.join(out, name), dpi=90)
            plt.close(fig)
            charts.setdefault(wl, []).append(name)
        lat_cases = [c for c in wcases if any(m.kind == "lat" for m in c.metrics)]
        if lat_cases:
            nc = min(2, len(lat_cases))
            nr = (len(lat_cases) + nc - 1) // nc
            fig, axes = plt.subplots(nr, nc, figsize=(max(7, 5.5 * nc), 4.2 * nr), squeeze=False)
            flat = [ax for row in axes for ax in row]
            for ax in flat[len(lat_cases):]:
                ax.axis("off")
            for ax, c in zip(flat, lat_cases):
                lms = [m for m in c.metrics if m.kind == "lat"]
                ts = [t for t in targets if t.supports(c)]
                width = 0.8 / max(1, len(lms))
                for j, m in enumerate(lms):
                    vals = [(summ[c.id].get(t.name) or {}).get("median", {}).get(m.key) or 0 for t in ts]
                    ax.bar([i + j * width for i in range(len(ts))], vals, width, label=m.label)
                ax.set_xticks([i + width * (len(lms) - 1) / 2 for i in range(len(ts))])
                ax.set_xticklabels([t.name for t in ts], rotation=40, ha="right", fontsize=8)
                if any((summ[c.id].get(t.name) or {}).get("median", {}).get(m.key) for m in lms for t in ts):
                    ax.set_yscale("log")
                ax.set_ylabel("ms (log)")
                ax.set_title(f"{c.title}: latency", fontsize=9)
                ax.legend(fontsize=7)
                ax.grid(axis="y", alpha=0.3)
            fig.suptitle(f"{WL_TITLES[wl]}\nlatency percentiles, medians over repeats", fontsize=10)
            fig.tight_layout()
            name = f"{wl.lower()}_latency.png"
            fig.savefig(os.path.join(out, name), dpi=90)
            plt.close(fig)
            charts.setdefault(wl, []).append(name)
    return charts


# --------------------------------------------------------------------------- machine

def machine_info(image_dir) -> dict:
    cpu = "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) / (1 << 20)
    except (OSError, ValueError, IndexError):
        pass
    rc, out, _ = run(["findmnt", "-n", "-o", "FSTYPE,SOURCE", "--target", image_dir], timeout=10)
    tools = {}
    for name, cmd in (("fio", ["fio", "--version"]), ("sysbench", ["sysbench", "--version"]),
                      ("dbench", ["dpkg-query", "-W", "-f=${Version}", "dbench"]),
                      ("fuse2fs", ["dpkg-query", "-W", "-f=${Version}", "fuse2fs"]),
                      ("bindfs", ["bindfs", "--version"])):
        r, o, e = run(cmd, timeout=10)
        tools[name] = (o or e).strip().splitlines()[0] if r == 0 and (o or e).strip() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem, 1),
            "kernel": platform.release(), "image_fs": " ".join(out.split()) if rc == 0 else "?", "tools": tools}


# --------------------------------------------------------------------------- main

def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="birchbench", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes, one repeat, ~2 s per run; then check every target produced numbers")
    ap.add_argument("--targets", type=str_list, default=ALL_TARGETS, help="comma list of " + ",".join(ALL_TARGETS))
    ap.add_argument("--workloads", type=lambda s: [x.upper() for x in str_list(s)],
                    default=["W1", "W2", "W3", "W4", "W5", "W6"], help="comma list of W1..W6")
    ap.add_argument("--birch-opts", action="append", default=[], metavar="OPTS",
                    help="extra birchfs target mounted with -o OPTS (repeatable)")
    ap.add_argument("--no-birch-default", action="store_true",
                    help="do not run birchfs with default options (only the --birch-opts sets)")
    ap.add_argument("--birch", default=os.environ.get("BIRCH", "target/release/birch"),
                    help="birch binary (env BIRCH); relative paths are taken from the repo root")
    ap.add_argument("--birch-before", metavar="PATH", default=None,
                    help="another birch binary (an older build): adds the target birchfs-before, default "
                         "mount options, its own image, mkfs/mount/sync/umount all with PATH, interleaved "
                         "with the others; the report compares it with birchfs (needs birchfs in --targets)")
    ap.add_argument("--image-dir", default=os.environ.get("BIRCHBENCH_DIR", "/var/tmp/birchbench"),
                    help="directory on the host fs for images, mount points and tools (env BIRCHBENCH_DIR)")
    ap.add_argument("--image-size", type=parse_size, default=None, help="size of every image [4G; quick 384M]")
    ap.add_argument("--out", default=None,
                    help="output dir [bench/results/DATE; quick: IMAGE_DIR/results/DATE-quick]")
    ap.add_argument("--repeats", type=int, default=None, help="repeats per case [2; quick 1]")
    ap.add_argument("--detach", action="store_true", help="run in the background; print the log path")
    ap.add_argument("--cleanup", action="store_true",
                    help="only undo mounts/loop devices a previous (killed) run left behind, then exit")
    ap.add_argument("--report", metavar="DIR", default=None,
                    help="only rewrite DIR/summary.md and the charts from DIR/results.json")
    ap.add_argument("--check", action="store_true", help="check that every target produced numbers (implied by --quick)")
    g = ap.add_argument_group("W1 dbench")
    g.add_argument("--dbench-time", type=int, default=None, help="seconds [30; quick 2]")
    g.add_argument("--dbench-clients", type=int_list, default=None, help="[8,16; quick 4]")
    g.add_argument("--dbench-loadfile", default=None, help="client.txt [from the dbench package]")
    g = ap.add_argument_group("W2 fio")
    g.add_argument("--fio-threads", type=int, default=None, help="[64; quick 16]")
    g.add_argument("--fio-bs", default="64k")
    g.add_argument("--fio-region", type=parse_size, default=None,
                   help="bytes each thread rewrites; the file is threads*region [1M; quick 256K]")
    g.add_argument("--fio-time", type=int, default=None, help="seconds [20; quick 2]")
    g.add_argument("--fio-modes", type=str_list, default=["odirect", "osync"], help="odirect,osync")
    g = ap.add_argument_group("W3 create/remove")
    g.add_argument("--md-threads", type=int_list, default=None, help="[1,2,8; quick 2]")
    g.add_argument("--md-files", type=int, default=None, help="files per thread [8000; quick 1000]")
    g = ap.add_argument_group("W4 sysbench fileio")
    g.add_argument("--sb-files", type=int, default=None, help="[1024; quick 64]")
    g.add_argument("--sb-total", default=None, help="total size [1G; quick 16M]")
    g.add_argument("--sb-threads", type=int, default=None, help="[64; quick 16]")
    g.add_argument("--sb-block", default="8K")
    g.add_argument("--sb-time", type=int, default=None, help="seconds [20; quick 2]")
    g.add_argument("--sb-modes", type=str_list, default=None,
                   help="rndwr,seqwr,rndwr-fsyncall (…-fsyncall adds --file-fsync-all) [all three; quick rndwr,rndwr-fsyncall]")
    g = ap.add_argument_group("W5 fsync latency")
    g.add_argument("--w5-time", type=int, default=None, help="seconds [15; quick 2]")
    g.add_argument("--w5-max-ops", type=int, default=200000)
    g = ap.add_argument_group("W6 everyday work")
    g.add_argument("--w6-files", type=int, default=None,
                   help="files in the source tree (in files*3/20 directories) [10000; quick 1000]")
    g.add_argument("--w6-appends", type=int, default=None, help="4-byte O_APPEND writes [200000; quick 20000]")
    g.add_argument("--w6-sqlite-journal", type=int, default=None,
                   help="SQLite commits, rollback journal [2000; quick 100]")
    g.add_argument("--w6-sqlite-wal", type=int, default=None, help="SQLite commits, WAL [5000; quick 250]")
    g.add_argument("--w6-drop-caches", action=argparse.BooleanOptionalAction, default=True,
                   help="drop the caches (all of the machine's), then walk and read again, cold (never on memfs_ll)")
    ap.add_argument("--run-dir-name", default="birchbench.run", help=argparse.SUPPRESS)
    return ap


def apply_defaults(cfg) -> None:
    q = cfg.quick
    d = lambda name, full, quick: setattr(cfg, name, getattr(cfg, name) if getattr(cfg, name) is not None  # noqa: E731
                                          else (quick if q else full))
    d("image_size", 4 << 30, 384 << 20)
    d("repeats", 2, 1)
    d("dbench_time", 30, 2)
    d("dbench_clients", [8, 16], [4])
    d("fio_threads", 64, 16)
    d("fio_region", 1 << 20, 256 << 10)
    d("fio_time", 20, 2)
    d("md_threads", [1, 2, 8], [2])
    d("md_files", 8000, 1000)
    d("sb_files", 1024, 64)
    d("sb_total", "1G", "16M")
    d("sb_threads", 64, 16)
    d("sb_time", 20, 2)
    d("sb_modes", ["rndwr", "seqwr", "rndwr-fsyncall"], ["rndwr", "rndwr-fsyncall"])
    d("w5_time", 15, 2)
    d("w6_files", 10000, 1000)
    d("w6_appends", 200000, 20000)
    d("w6_sqlite_journal", 2000, 100)
    d("w6_sqlite_wal", 5000, 250)
    if not os.path.isabs(cfg.birch):
        cand = os.path.join(REPO, cfg.birch)
        cfg.birch = cand if os.path.exists(cand) or not os.path.exists(cfg.birch) else os.path.abspath(cfg.birch)
    if cfg.birch_before is not None:
        bb = cfg.birch_before
        if not os.path.isabs(bb):
            cand = os.path.join(REPO, bb)
            bb = cand if os.path.exists(cand) or not os.path.exists(bb) else os.path.abspath(bb)
        if not (os.path.isfile(bb) and os.access(bb, os.X_OK)):
            raise SystemExit(f"--birch-before: no executable birch binary at {bb}")
        if "birchfs" not in cfg.targets:
            raise SystemExit("--birch-before needs birchfs in --targets (it is compared with birchfs)")
        if cfg.no_birch_default:
            raise SystemExit("--birch-before compares against birchfs with default options: "
                             "drop --no-birch-default")
        cfg.birch_before = bb
    if cfg.dbench_loadfile is None:
        for p in ("/usr/share/dbench/client.txt", "/usr/share/doc/dbench/loadfiles/client.txt",
                  "/usr/local/share/client.txt", "/usr/local/share/dbench/client.txt"):
            if os.path.exists(p):
                cfg.dbench_loadfile = p
                break
        else:
            rc, out, _ = run(["dpkg", "-L", "dbench"], timeout=20)
            hits = [l for l in out.splitlines() if l.endswith("client.txt")] if rc == 0 else []
            cfg.dbench_loadfile = hits[0] if hits else "client.txt"
    bad = [t for t in cfg.targets if t not in ALL_TARGETS]
    if bad:
        raise SystemExit(f"unknown targets {bad}; choose from {ALL_TARGETS}")
    badw = [w for w in cfg.workloads if w not in WL_TITLES]
    if badw:
        raise SystemExit(f"unknown workloads {badw}")


def build_mdcr(cfg) -> list[str]:
    src = os.path.join(HERE, "mdcr.c")
    binp = os.path.join(cfg.image_dir, "bin", "mdcr")
    os.makedirs(os.path.dirname(binp), exist_ok=True)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc and os.path.exists(src):
        if not os.path.exists(binp) or os.path.getmtime(binp) < os.path.getmtime(src):
            rc, out, err = run([cc, "-O2", "-pthread", "-o", binp, src], timeout=120)
            if rc != 0:
                log(f"mdcr build failed ({err.strip()[-300:]}); using the Python fallback")
                return [sys.executable, os.path.abspath(__file__), "--_mdcr"]
        return [binp]
    log("no C compiler: W3 uses the Python fallback of mdcr")
    return [sys.executable, os.path.abspath(__file__), "--_mdcr"]


def mdcr_py(base: str, threads: int, files: int) -> None:
    """Python fallback of mdcr.c (processes, one directory each); same JSON output."""
    import multiprocessing as mp
    bar = mp.Barrier(threads + 1)
    errq = mp.Queue()

    def worker(i):
        d = os.path.join(base, f"mdtest_tree.{i}")
        os.makedirs(d, exist_ok=True)
        bar.wait()
        try:
            for k in range(files):
                os.close(os.open(os.path.join(d, f"file.mdtest.{i}.{k}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except OSError as e:
            errq.put(str(e))
        bar.wait()
        bar.wait()
        try:
            for k in range(files):
                os.unlink(os.path.join(d, f"file.mdtest.{i}.{k}"))
        except OSError as e:
            errq.put(str(e))
        bar.wait()
        os.rmdir(d)

    ps = [mp.Process(target=worker, args=(i,)) for i in range(threads)]
    for p in ps:
        p.start()
    bar.wait()
    c0 = time.perf_counter()
    bar.wait()
    c1 = time.perf_counter()
    bar.wait()
    r0 = time.perf_counter()
    bar.wait()
    r1 = time.perf_counter()
    for p in ps:
        p.join()
    err = "" if errq.empty() else errq.get()
    n = threads * files
    print(json.dumps({"threads": threads, "files_per_thread": files, "created": n, "removed": n,
                      "create_s": c1 - c0, "remove_s": r1 - r0, "creates_per_s": n / (c1 - c0),
                      "removes_per_s": n / (r1 - r0), "error": err}))


def do_check(cfg, cases, targets, runs) -> int:
    """Every target that ran must have produced numbers for every case it supports."""
    bad = 0
    for t in targets:
        if t.status == "skipped":
            log(f"check: {t.name}: skipped ({t.error})")
            continue
        missing = []
        for c in cases:
            if not t.supports(c):
                continue
            if not any(r["ok"] and r["metrics"] for r in runs if r["case"] == c.id and r["target"] == t.name):
                missing.append(c.id)
        mounted = any(r.get("mounted") for r in runs if r["target"] == t.name)
        if not missing:
            log(f"check: {t.name}: ok (numbers for {sum(1 for c in cases if t.supports(c))} cases)")
            continue
        required = t.kind in KERNEL_KINDS or t.kind == "bindfs-mt" or \
            (t.kind in ("birchfs", "memfs_ll") and mounted)
        why = t.error or ("no numbers for " + ", ".join(missing))
        if required:
            bad += 1
            log(f"check: {t.name}: FAILED: {why}")
        else:
            log(f"check: {t.name}: not counted ({'did not mount' if t.kind in ('birchfs', 'memfs_ll') else 'optional target'}): {why}")
    log(f"check: {'FAILED' if bad else 'ok'} ({bad} required target(s) without numbers)")
    return 1 if bad else 0


def rerender(out: str) -> int:
    """Write summary.md and the charts again from OUT/results.json (no benchmark runs)."""
    with open(os.path.join(out, "results.json")) as f:
        res = json.load(f)
    cfg = argparse.Namespace(**{"birch_before": None, **res["meta"]["config"]})
    cases = [c for c in build_cases(cfg) if c.id in res["cases"]]
    targets = []
    for name, info in res["targets"].items():
        t = Target(name, info["kind"], cfg, info.get("opts"), before=info.get("before", False))
        t.status, t.error, t.meta = info["status"], info["error"], info["meta"]
        targets.append(t)
    res["summary"] = summarize(res["runs"], cases, targets)
    res["charts"] = write_charts(res, cases, targets, out)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    write_markdown(res, cases, targets, out)
    print(f"rewrote {out}/summary.md and charts")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--_w5":
        w5_child(argv[1], argv[2], float(argv[3]), int(argv[4]))
        return 0
    if argv and argv[0] == "--_w6":
        w6_child(argv[1:])
        return 0
    if argv and argv[0] == "--_mdcr":
        mdcr_py(argv[1], int(argv[2]), int(argv[3]))
        return 0
    cfg = make_parser().parse_args(argv)
    if cfg.report:
        return rerender(os.path.abspath(cfg.report))
    if os.geteuid() != 0:
        print("birchbench needs root (loop devices, mounts)", file=sys.stderr)
        return 2
    os.makedirs(cfg.image_dir, exist_ok=True)
    global STATE, LOG
    lockf = open(os.path.join(cfg.image_dir, "lock"), "w")
    try:
        fcntl.flock(lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"another birchbench run holds {cfg.image_dir}/lock", file=sys.stderr)
        return 2
    STATE = State(os.path.join(cfg.image_dir, "state.json"))
    leftover = STATE.load()
    if leftover.get("mounts") or leftover.get("loops") or leftover.get("groups"):
        for line in cleanup_from(leftover, cfg.birch if os.path.isabs(cfg.birch) else os.path.join(REPO, cfg.birch)):
            print(f"cleanup of an earlier run: {line}", flush=True)
    STATE.save()
    if cfg.cleanup:
        return 0

    detached_child = os.environ.get("BIRCHBENCH_DETACHED") == "1"
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S") + ("-quick" if cfg.quick else "")
    # quick runs are smoke tests: their results stay out of the work tree unless --out says so
    out = os.path.abspath(cfg.out or os.path.join(cfg.image_dir if cfg.quick else HERE, "results", stamp))
    os.makedirs(os.path.join(out, "raw"), exist_ok=True)
    logpath = os.path.join(out, "run.log")
    if cfg.detach and not detached_child:
        args = [a for a in argv if a != "--detach"]
        if cfg.out is None:
            args += ["--out", out]
        env = dict(os.environ, BIRCHBENCH_DETACHED="1", BIRCHBENCH_CMD=(
            ("bench/run.sh " if os.environ.get("BIRCHBENCH_VIA_RUNSH") else "bench/birchbench.py ") + shlex.join(argv)))
        lockf.close()  # the child takes the lock
        with open(logpath, "a") as lf:
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__)] + args, stdin=subprocess.DEVNULL,
                                 stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=os.getcwd())
        print(f"birchbench running detached, pid {p.pid}")
        print(f"log: {logpath}")
        print(f"results: {out}/summary.md (when done); follow with: tail -f {logpath}")
        return 0

    LOG = Log(logpath, detached_child)
    apply_defaults(cfg)
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, on_signal)

    command = os.environ.get("BIRCHBENCH_CMD") or (
        ("bench/run.sh " if os.environ.get("BIRCHBENCH_VIA_RUNSH") else "bench/birchbench.py ") + shlex.join(argv))
    if "BIRCH" in os.environ and "BIRCH=" not in command:
        command = f"BIRCH={shlex.quote(os.environ['BIRCH'])} {command}"
    t_start = time.time()
    log(f"birchbench: {command}")
    log(f"output: {out}")
    targets: list[Target] = []
    for name in cfg.targets:
        if name == "birchfs":
            if not cfg.no_birch_default:
                targets.append(Target("birchfs", "birchfs", cfg))
            if cfg.birch_before:
                # right after birchfs, so the two alternate closely in the interleaved order
                targets.append(Target("birchfs-before", "birchfs", cfg, before=True))
            for o in cfg.birch_opts:
                targets.append(Target(f"birchfs[{o}]", "birchfs", cfg, opts=o))
        else:
            targets.append(Target(name, name, cfg))
    cases = build_cases(cfg)
    runs: list[dict] = []
    interrupted = False
    res = {}
    rc_final = 0
    try:
        cfg.mdcr = build_mdcr(cfg) if "W3" in cfg.workloads else None
        cfg.w6 = w6_assets(cfg) if "W6" in cfg.workloads else None
        meta_machine = machine_info(cfg.image_dir)
        for t in targets:
            t.setup()
        plan = [(rep, c, t) for rep in range(1, cfg.repeats + 1) for c in cases for t in targets if t.supports(c)]
        log(f"{len(plan)} runs: {len(cases)} cases x {len(targets)} targets x {cfg.repeats} repeats "
            f"(targets: {', '.join(t.name + ('' if t.status == 'ok' else ' [' + t.status + ']') for t in targets)})")
        durations = []
        ticker_stop = threading.Event()
        current = {"text": "", "t0": time.time()}

        def ticker():
            while not ticker_stop.wait(1.0):
                if current["text"]:
                    el = time.time() - t_start
                    LOG.status(f"{current['text']} | run {time.time() - current['t0']:.0f}s | "
                               f"total {el / 60:.1f} min{current.get('eta', '')}")
        th = threading.Thread(target=ticker, daemon=True)
        th.start()
        for k, (rep, c, t) in enumerate(plan, 1):
            if t.status != "ok":
                continue
            done_runs = [d for d in durations]
            if done_runs:
                remaining = len([1 for (_, _, tt) in plan[k - 1:] if tt.status == "ok"])
                current["eta"] = f" | eta ~{statistics.mean(done_runs) * remaining / 60:.0f} min"
            current.update(text=f"[{k}/{len(plan)}] rep {rep}/{cfg.repeats} {c.title} on {t.name}", t0=time.time())
            LOG.status(current["text"])
            r = {"case": c.id, "workload": c.wl, "target": t.name, "rep": rep, "ok": False,
                 "metrics": {}, "error": None, "mounted": False}
            t0 = time.time()
            ctx = {"cfg": cfg, "case": c, "target": t, "rep": rep, "rawdir": os.path.join(out, "raw"), "out": out}
            try:
                try:
                    base = t.mount()
                    r["mounted"] = True
                except Exception as e:  # noqa: BLE001
                    t.fail(str(e))
                    raise
                if t.kind == "raw":
                    wd = base
                else:
                    wd = os.path.join(base, f"{cfg.run_dir_name}.{c.id}.r{rep}")
                    os.makedirs(wd, exist_ok=True)
                before = t.read_stats()
                r["metrics"] = c.fn(ctx, wd, c.params)
                r["ok"] = True
                after = t.read_stats()
                if after is not None:
                    r["counters"] = after
                    r["counters_delta"] = counter_delta(before, after)
                if t.kind != "raw":
                    rc, _, err = run(["rm", "-rf", wd], timeout=1800)
                    if rc != 0:
                        log(f"warning: could not remove {wd}: {err.strip()[-200:]}")
            except KeyboardInterrupt:
                r["error"] = "interrupted"
                raise
            except Exception as e:  # noqa: BLE001 - one failing run is reported, not fatal
                r["error"] = str(e)
            finally:
                r["raw"] = ctx.get("raw")
                r["duration_s"] = round(time.time() - t0, 2)
                if r["mounted"]:
                    err = t.umount()
                    if err:
                        t.fail(f"unmount failed: {err}")
                runs.append(r)
            durations.append(r["duration_s"])
            hl = ", ".join(f"{m.label} {fmt_num(r['metrics'].get(m.key))}{(' ' + m.unit) if m.unit else ''}"
                           for m in c.metrics if r["metrics"].get(m.key) is not None)
            log(f"[{k}/{len(plan)}] {c.id} {t.name} r{rep}: " + (hl if r["ok"] else f"FAILED: {str(r['error'])[:300]}")
                + f" ({r['duration_s']:.1f}s)")
        ticker_stop.set()
        LOG.clear_status()
    except KeyboardInterrupt as e:
        interrupted = True
        LOG.clear_status()
        log(f"interrupted ({e or 'SIGINT'}): cleaning up, writing partial results")
        rc_final = 130
    finally:
        # block further signals while cleaning up
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        kill_active()
        for t in targets:
            try:
                t.teardown()
            except Exception as e:  # noqa: BLE001
                log(f"teardown {t.name}: {e}")
        full_cleanup(cfg.birch)
        if targets:
            res = {
                "meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": command,
                         "machine": locals().get("meta_machine") or {"cpu": "?", "cores": os.cpu_count(),
                                                                      "mem_gib": "?", "kernel": platform.release(),
                                                                      "image_fs": "?"},
                         "config": {k: v for k, v in vars(cfg).items() if k not in ("mdcr", "w6")},
                         "w6_assets": getattr(cfg, "w6", None),
                         "elapsed_s": round(time.time() - t_start, 1), "interrupted": interrupted},
                "targets": {t.name: {"kind": t.kind, "opts": t.opts, "status": t.status, "error": t.error,
                                     "birch": t.birch, "before": t.before, "meta": t.meta}
                            for t in targets},
                "cases": {c.id: {"workload": c.wl, "title": c.title, "params": c.params,
                                 "metrics": {m.key: {"label": m.label, "unit": m.unit, "kind": m.kind}
                                             for m in c.metrics}} for c in cases},
                "runs": runs,
            }
            res["summary"] = summarize(runs, cases, targets)
            bt = {t.name: t for t in targets}
            if "birchfs-before" in bt and "birchfs" in bt:
                a, b = "birchfs-before", "birchfs"
                res["before_after_binary"] = {
                    "a": a, "b": b, "lines": before_after(res["summary"], cases, a, b),
                    "table": before_after_table(res["summary"], cases, a, b),
                    "binaries": {n: {"path": bt[n].birch, "version": bt[n].meta.get("version"),
                                     "sha256": bt[n].meta.get("birch_sha256")} for n in (a, b)}}
                for it in res["before_after_binary"]["lines"]:
                    log(f"before/after binary {a} -> {b}: {it['title']}: {it['text']}")
            # option sets: among the targets on the --birch binary
            birch = [t.name for t in targets if t.is_birch and not t.before]
            if len(birch) >= 2:
                a, b = (birch[1], birch[2]) if len(cfg.birch_opts) >= 2 and not cfg.no_birch_default and len(birch) >= 3 \
                    else (birch[0], birch[1])
                res["before_after"] = {"a": a, "b": b, "lines": before_after(res["summary"], cases, a, b)}
                for it in res["before_after"]["lines"]:
                    log(f"before/after {a} -> {b}: {it['title']}: {it['text']}")
            try:
                res["charts"] = write_charts(res, cases, targets, out) if runs else {}
            except Exception as e:  # noqa: BLE001
                log(f"charts failed: {e}")
                res["charts"] = {}
            with open(os.path.join(out, "results.json"), "w") as f:
                json.dump(res, f, indent=1, default=str)
            write_markdown(res, cases, targets, out)
            log(f"report: {out}/summary.md  (raw: results.json, charts: *.png)")
    if not interrupted and (cfg.quick or cfg.check):
        rc_final = do_check(cfg, cases, targets, runs)
    log(f"done in {(time.time() - t_start) / 60:.1f} min")
    return rc_final


if __name__ == "__main__":
    sys.exit(main())
