"""Targets: the filesystems a run measures, from image to mount point and back.

Owns: the images (written out in full once, reused while they are), each target's setup
(mkfs, loop device with direct I/O and discard off), its mount and unmount for every single
run, durability (`Target.sync`), birchfs's counters (`Target.read_stats`), teardown, and
building libfuse's memfs_ll from its tarball.  Every command goes through mounts.run and every
mount and loop device is recorded in mounts.STATE before or as it is made, so a killed run is
undone (mounts.cleanup_from).

Must not touch: workloads (a target is handed a case only to ask `supports`), results, the
report, the command line; nor any mount or loop device it did not make itself.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import shlex
import shutil
import sys
import time

from . import mounts
from .common import REPO, fail_text, human, log, safe_name
from .mounts import is_mounted, run, unmount


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

URING_PARAM = "/sys/module/fuse/parameters/enable_uring"


def allow_fuse_uring() -> str:
    """Turns the fuse module's enable_uring on, as scripts/setup.sh does: birchfs serves over
    FUSE over io_uring by default wherever it is on (DESIGN §12.5), and memfs_ll-uring needs it.
    Returns what was done, for the log."""
    try:
        with open("/dev/fuse", "r+b"):
            pass  # a first open loads the fuse module, and with it the parameter
    except OSError:
        pass
    try:
        with open(URING_PARAM) as f:
            was = f.read().strip()
    except OSError as e:
        return f"no FUSE over io_uring here ({URING_PARAM}: {e.strerror})"
    if was == "Y":
        return f"{URING_PARAM} already Y"
    try:
        with open(URING_PARAM, "w") as f:
            f.write("Y")
    except OSError as e:
        return f"{URING_PARAM} is {was} and cannot be set ({e.strerror}): birchfs serves over /dev/fuse"
    return f"{URING_PARAM} set to Y (was {was}), as scripts/setup.sh does"


class Target:
    def __init__(self, name: str, kind: str, cfg, opts: str | None = None, before: bool = False,
                 rbd: bool = False):
        self.name = name
        self.kind = kind
        self.cfg = cfg
        self.opts = opts
        # the birch binary of a birchfs target: --birch, or --birch-before for birchfs-before,
        # or --rbd-birch (a build with the rbd feature) for birchfs-rbd
        self.before = before and kind == "birchfs"
        self.rbd = rbd and kind == "birchfs"
        self.birch = (cfg.birch_before if self.before else cfg.birch) if kind == "birchfs" else None
        if self.rbd:
            self.birch = getattr(cfg, "rbd_birch", None) or cfg.birch
        self.safe = safe_name(name)
        self.image = os.path.join(cfg.image_dir, "img", self.safe + ".img")
        if self.rbd:  # an RBD image of that name in the pool, made by birch mkfs
            self.image = f"rbd:{cfg.rbd_pool}/birchbench-{self.safe}"
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
        dev = mounts.attach_loop(self.image, direct_io=True, timeout=60)  # recorded in STATE
        self.loop = dev
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
            os.makedirs(self.mnt, exist_ok=True)
            if self.rbd:  # birch mkfs makes the RBD image (--size) or reformats it (--force)
                self.meta["image"] = self.image
                self.mkfs_birch()
                return
            os.makedirs(os.path.dirname(self.image), exist_ok=True)
            t0 = time.time()
            how = ensure_image(self.image, cfg.image_size)
            self.meta["image"] = self.image
            self.meta["image_prep"] = how
            log(f"target {self.name}: image {self.image} {human(cfg.image_size)} {how}"
                f" ({time.time() - t0:.1f}s)")
            if self.is_birch:
                if self.mkfs_birch():
                    self.meta["image_allocated_pct"] = self.allocated()
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

    def mkfs_birch(self) -> bool:
        """`birch mkfs --force --size SIZE IMAGE` and the binary's version; the target is ok
        after it, or failed with the command's output."""
        cmd = [self.birch, "mkfs", "--force", "--size", str(self.cfg.image_size), self.image]
        rc, out, err = run(cmd, timeout=600)
        if rc != 0:
            self.fail(f"`{' '.join(cmd)}` rc={rc}: {(err or out).strip()[-400:]}")
            return False
        rc, out, err = run([self.birch, "--version"], timeout=20)
        self.meta["version"] = (out or err).strip()[:200] if rc == 0 else None
        self.status = "ok"
        return True

    def _mount_item(self, path: str, fuse: bool) -> dict:
        # "birch": the binary that mounted it (cleanup unmounts with that one), else False
        return {"path": path, "fuse": fuse, "birch": self.birch if self.is_birch and path == self.mnt else False}

    def _mount_rec(self, path: str, fuse: bool) -> None:
        mounts.STATE.add("mounts", self._mount_item(path, fuse))

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
            rc, err = mounts.mount_birch(self.birch, self.image, self.mnt, self.opts, timeout=120)
        elif self.kind == "memfs_ll":
            # daemonizes once mounted; multi-threaded (it always runs fuse_session_loop_mt)
            self._mount_rec(self.mnt, True)
            binp = self.meta["memfs_ll"]
            opts = "writeback_cache,no_timeout"
            if self.opts == "io_uring":
                # the kernel offers FUSE over io_uring only with the fuse module's enable_uring
                # (a birch mount sets it too); left on, as a birch mount leaves it
                try:
                    with open(URING_PARAM, "w") as f:
                        f.write("Y")
                except OSError as e:
                    raise RuntimeError(f"cannot set {URING_PARAM}: {e}")
                opts += ",io_uring"
            rc, _, err = run([binp, "-o", opts, self.mnt], timeout=120, env=memfs_env(binp))
        else:
            raise RuntimeError(f"unknown kind {self.kind}")
        if rc != 0 or not is_mounted(self.mnt):
            self.umount()
            raise RuntimeError(f"mount failed rc={rc}: {err.strip()[-400:]}")
        if self.kind == "memfs_ll" and self.opts == "io_uring":
            why = memfs_ring_missing(self.mnt)
            if why:
                # its figures would be memfs_ll over /dev/fuse under the ring's name: the run,
                # and with it the target, fails (cli.py) instead
                self.umount()
                raise RuntimeError(why)
        return self.mnt

    def umount(self) -> str | None:
        if self.kind == "raw":
            return None
        errs = []
        err = unmount(self.mnt, fuse=self.is_fuse, birch=self.birch)
        if err:
            errs.append(err)
        else:
            mounts.STATE.remove("mounts", self._mount_item(self.mnt, self.is_fuse))
        if self.kind == "bindfs-mt":
            err = unmount(self.src)
            if err:
                errs.append(err)
            else:
                mounts.STATE.remove("mounts", {"path": self.src, "fuse": False, "birch": False})
        return "; ".join(errs) or None

    def allocated(self) -> float | None:
        if self.rbd:
            return None
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
            err = mounts.detach_loop(self.loop, self.image, timeout=60, check=False)  # leaves STATE
            if err:
                log(f"losetup -d {self.loop} failed: {err}")
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


# --------------------------------------------------------------------------- Ceph RBD

class RbdCluster:
    """The cluster of the birchfs-rbd target: --rbd-conf names an existing one, else the
    throw-away single-node cluster of tests/rbd/single-node.sh (one monitor, one manager, one
    OSD with BlueStore on a file under IMAGE_DIR/ceph, cephx off, about 1.7 GB of memory) is
    brought up before the targets are set up and stopped by PID at the end of the run."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.script = os.path.join(REPO, "tests", "rbd", "single-node.sh")
        self.base = os.path.join(cfg.image_dir, "ceph")
        self.started = False

    def start(self) -> str | None:
        """Makes the cluster reachable (CEPH_CONF in this process's environment, which every
        birch, rbd and ceph command inherits); returns why not, if it cannot."""
        if self.cfg.rbd_conf:
            os.environ["CEPH_CONF"] = os.path.abspath(self.cfg.rbd_conf)
        else:
            if not (shutil.which("ceph-mon") and shutil.which("rbd")):
                return ("no Ceph packages (ceph-mon, ceph-common): `apt-get install ceph-mon ceph-mgr "
                        "ceph-osd ceph-common librbd-dev librados-dev`, or --rbd-conf of a cluster")
            env = dict(os.environ, BASE=self.base, IMAGE_SIZE="64M",
                       MON_DATA_AVAIL_WARN="1", MON_DATA_AVAIL_CRIT="0")
            log(f"birchfs-rbd: bringing up a single-node Ceph cluster under {self.base}")
            t0 = time.time()
            rc, out, err = run(["bash", self.script, "up"], timeout=400, env=env)
            self.started = True  # stop what came up, even after a failure
            if rc != 0:
                return fail_text("tests/rbd/single-node.sh up", rc, out, err)
            os.environ["CEPH_CONF"] = os.path.join(self.base, "ceph.conf")
            log(f"birchfs-rbd: cluster healthy in {time.time() - t0:.0f}s")
        rc, out, err = run(["ceph", "-s", "--connect-timeout", "20"], timeout=40)
        if rc != 0:
            return fail_text("ceph -s", rc, out, err)
        return None

    def floor(self, t: "Target") -> dict:
        """librbd's own figures on this cluster, beside birch's (an image of their own, removed
        after): a 4 KiB write with one in flight and the cache off, a 4 KiB write + flush p50
        (W5's floor: issue 21 aims at 1.2x of it), and 64 KiB sequential writes with 16 in
        flight (the floor of a sequential write to durable)."""
        pool = self.cfg.rbd_pool
        img = f"{pool}/birchbench-floor"
        got: dict = {}
        run(["rbd", "rm", img], timeout=120)
        rc, out, err = run(["rbd", "create", "--size", "512M", img], timeout=120)
        if rc != 0:
            log(f"birchfs-rbd: rbd create {img}: {(err or out).strip()[-200:]}")
            return got
        bench = ["rbd", "bench", "--io-type", "write", "--rbd-cache=false"]
        for key, args, parse in (
                ("librbd_4k_write_us", ["--io-size", "4K", "--io-threads", "1", "--io-total", "8M",
                                        "--io-pattern", "seq"], "us"),
                ("rbd_bench_64k_seq_mibs", ["--io-size", "64K", "--io-threads", "16", "--io-total", "256M",
                                            "--io-pattern", "seq"], "mibs")):
            rc, out, err = run(bench + args + [img], timeout=300)
            m = re.search(r"elapsed:\s*([\d.]+)\s+ops:\s*(\d+)\s+ops/sec:\s*([\d.]+)\s+bytes/sec:\s*([\d.]+)\s*(\w+)/s",
                          out.replace(",", ""))
            if rc != 0 or not m:
                log(f"birchfs-rbd: `{' '.join(bench + args)}` rc={rc}: {(err or out).strip()[-200:]}")
                continue
            ops = float(m.group(3))
            if parse == "us" and ops > 0:
                got[key] = round(1e6 / ops, 1)
            elif parse == "mibs":
                val, unit = float(m.group(4)), m.group(5)
                scale = {"B": 1 / (1 << 20), "KiB": 1 / 1024, "MiB": 1, "GiB": 1024}.get(unit)
                if scale is not None:
                    got[key] = round(val * scale, 1)
        # W5's floor: a 4 KiB write and a flush, one after the other, through librbd itself with
        # the cluster's own settings (the cache as birch gets it), p50 over 5 s (python3-rbd).
        code = ("import rados, rbd, sys, time\n"
                "c = rados.Rados(conffile=''); c.connect(timeout=30)\n"
                "io = c.open_ioctx(sys.argv[1]); im = rbd.Image(io, sys.argv[2])\n"
                "buf = b'x' * 4096; lat = []; off = 0; end = time.monotonic() + 5\n"
                "while time.monotonic() < end:\n"
                "    t = time.perf_counter(); im.write(buf, off); im.flush()\n"
                "    lat.append(time.perf_counter() - t); off = (off + 4096) % (256 << 20)\n"
                "im.close(); io.close(); c.shutdown(); lat.sort()\n"
                "print('%.4f %d' % (lat[len(lat) // 2] * 1e3, len(lat)))\n")
        rc, out, err = run(["/usr/bin/python3", "-c", code, pool, "birchbench-floor"], timeout=120)
        try:
            p50, n = out.split()
            got["librbd_4k_write_flush_p50_ms"] = round(float(p50), 3)
            got["librbd_4k_write_flush_n"] = int(n)
        except ValueError:
            log(f"birchfs-rbd: librbd write + flush (python3-rbd) rc={rc}: {(err or out).strip()[-200:]}")
        run(["rbd", "rm", img], timeout=120)
        log(f"birchfs-rbd: librbd floor {got}")
        return got

    def stop(self) -> None:
        if self.started:
            env = dict(os.environ, BASE=self.base)
            rc, out, err = run(["bash", self.script, "stop"], timeout=180, env=env)
            if rc != 0:
                log(f"birchfs-rbd: stopping the cluster: {(err or out).strip()[-300:]}")
            self.started = False


# --------------------------------------------------------------------------- memfs_ll

def libfuse_tar() -> str:
    return os.path.abspath(os.environ.get("BIRCHBENCH_LIBFUSE_TAR")
                           or os.path.join(REPO, "..", "shared", "libfuse", "libfuse-e8d407ce.tar.gz"))


def memfs_env(binp: str) -> dict:
    """memfs_ll runs from the build tree: its libfuse3.so is in build/lib."""
    return dict(os.environ, LD_LIBRARY_PATH=os.path.join(os.path.dirname(os.path.dirname(binp)), "lib"))


def ring_threads(pid: int, proc: str = "/proc") -> list[str]:
    """The names of the FUSE-over-io_uring queue threads of `pid`: libfuse names each
    `fuse-ring-<queue>` (lib/fuse_uring.c) and starts them only once the kernel agreed to the
    ring in FUSE_INIT."""
    names = []
    try:
        tasks = os.listdir(os.path.join(proc, str(pid), "task"))
    except OSError:
        return names
    for tid in tasks:
        try:
            with open(os.path.join(proc, str(pid), "task", tid, "comm")) as f:
                comm = f.read().strip()
        except OSError:
            continue
        if comm.startswith("fuse-ring-"):
            names.append(comm)
    return sorted(names)


def memfs_ring_missing(mnt: str, proc: str = "/proc", wait: float = 5.0, sleep=time.sleep,
                       find=mounts.pids_with_arg) -> str | None:
    """None when the memfs_ll serving `mnt` serves over FUSE over io_uring (it has
    fuse-ring-* threads), else why the memfs_ll-uring target must not report figures: a
    libfuse built without io_uring (no liburing-dev at meson setup) takes `-o io_uring` and
    serves over /dev/fuse without a word.  A stat of `mnt` first, so FUSE_INIT (where the
    threads start) is done; then up to `wait` seconds for the threads."""
    try:
        os.stat(mnt)
    except OSError as e:
        return f"memfs_ll-uring: stat {mnt}: {e.strerror}"
    deadline = time.monotonic() + wait
    while True:
        pids = find(mnt)  # the daemon, by its mount point: memfs_ll daemonized
        if any(ring_threads(pid, proc) for pid in pids):
            return None
        if time.monotonic() >= deadline:
            break
        sleep(0.1)
    if not pids:
        return f"memfs_ll-uring: no process with {mnt} on its command line (the memfs_ll serving it)"
    return (f"memfs_ll-uring: memfs_ll (pid {', '.join(map(str, pids))}) serves {mnt} without "
            f"FUSE over io_uring (no fuse-ring-* thread in {proc}/PID/task/*/comm after {wait:g} s): "
            f"libfuse was built without io_uring support (liburing-dev missing at meson setup; "
            f"delete the build under the image dir to rebuild) or the kernel refused the ring. "
            f"Its figures would be those of /dev/fuse, so the target fails")


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
