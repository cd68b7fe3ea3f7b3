#!/usr/bin/env python3
"""Soak with a durability oracle (issue 41, item 5): load on a real mount, cycles ended at random
by kill -9 of the daemon, `birch shutdown` (commit, --log, --now) or a clean unmount, and after
each cycle fsck and a check of every write that was acknowledged.

    sudo python3 tests/soak/soak.py [--minutes 30] [--seed N] [--cycle-seconds A:B]
                                    [--fsstress-procs N] [--writers N] [--keep-going]

One image (`birch mkfs`), mounted at a fresh mount point. A cycle: mount (options drawn from a
list: defaults, fsync=commit, buffer=off, writeback=off, commit=1, uring=off, keep_cache=off,
threads=2), start the load, wait a random number of seconds within --cycle-seconds, end the
cycle in one of five ways drawn at random:

  kill9          SIGKILL to the daemon while the load runs, then `umount -l`; the image must be
                 released (no process holds it open) before anything else touches it
  shutdown       `birch shutdown MNT` (write back, commit, then EIO), then unmount
  shutdown-log   `birch shutdown --log MNT` (only what fsync acknowledged survives)
  shutdown-now   `birch shutdown --now MNT` (nothing more is written)
  umount         the writers stop, the other load is killed, `birch umount MNT`

then `birch fsck --data IMG` must exit 0 (a log replayed in memory by fsck counts as clean); then
the image is mounted read-only (the log replayed in memory, the image left in its crash state)
and the oracle checked, unmounted, mounted read-write with the cycle's options (the log replayed
on the image) and the oracle checked again; the next cycle's load starts on that mount.

The load: fsx 0.3.2 (tests/posix/setup.sh; buffered, every operation of tests/posix/fsx.toml), the
C fsx of xfstests with O_DIRECT (-Z; the Rust fsx has no O_DIRECT) when xfstests is built, fsstress
of xfstests (--fsstress-procs processes, 0 leaves it out; skipped with a printed reason when it is
not built: tests/xfstests/setup.sh builds both into /var/tmp/birch-xfstests, or set FSSTRESS and
FSX_C), and the oracle writers (--writers processes). The writers share four block files (each
writes its own blocks of them, so their fsyncs of one file race) and have a private block file
and an append log each. A block is 4 KiB stamped with run, file, block and version in a header,
then random bytes and compressible text, all derived from those four (never a constant fill).
Patterns: pwrite of several blocks + fsync or fdatasync, O_SYNC and O_DSYNC pwrites, O_DIRECT
pwrite + fdatasync, small O_APPEND records + fsync, overwrite of an acknowledged block of a file
with nothing dirty followed by fsync at once (a database's overwrite-after-fsync), buffered
writes left for a later fsync. Each writer keeps a journal OUTSIDE the mount: the versions it
issues before each write (I), writes completed (W, with the time) and, after each fsync or
synchronous write returned, the versions it acknowledged (A).

The check (every acknowledged block and log record, after every cycle, twice): a block holds the
acknowledged version or a later one that was issued for it (never older, never another block's
bytes, never garbage); a block never acknowledged holds zeros or a version issued for it; an append
log holds every acknowledged record byte for byte. After `umount` every write that completed must
be there, after `shutdown` (which commits) every write that completed before it started.
Lost = an older version or zeros where a version was acknowledged; wrong = bytes no writer wrote
there. Also a failure: fsck not clean, a daemon log with 'panicked', a load process failing
before the end of its cycle (an fsx miscompare), a step exceeding its time limit (a hang).

Exit 0 when nothing failed; 1 on any failure (evidence kept: the image, copied while it was
still in its crash state when the read-only check failed, logs, journals, the seed, under
--evidence, default /var/tmp/soak-evidence/); 77 when it cannot run here (not root, no
/dev/fuse, no birch binary). Python 3 standard library only; uses bench/birchbench/mounts.py.
"""
from __future__ import annotations

import argparse
import collections
import errno
import hashlib
import json
import mmap
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "bench"))

BS = 4096
N_SHARED = 4          # shared block files, fids 0..3
SHARED_BLOCKS = 256   # 1 MiB each
PRIVATE_BLOCKS = 128  # fid 100 + writer
LOG_FID = 200         # fid 200 + writer
BLK_MAGIC = b"BSOAKBLK"
LOG_MAGIC = b"BSOAKLOG"
BLK_HDR = struct.Struct("<8sQIIQ")   # magic, run, fid, block, version (32 bytes)
LOG_HDR = struct.Struct("<8sQIIQ")   # magic, run, fid, length, seq (32 bytes)

END_KINDS = ["kill9", "shutdown", "shutdown-log", "shutdown-now", "umount"]
END_WEIGHTS = [30, 15, 15, 15, 25]
OVERHEAD = 10         # seconds a cycle takes beyond its load: end, fsck, two mounts, checks
MOUNT_OPTS = ["", "", "", "fsync=commit", "buffer=off", "writeback=off", "commit=1",
              "uring=off", "keep_cache=off", "threads=2"]
# --faults: one kind a cycle, armed through `birch fault MNT RULE` while the load runs (a birch
# built with the fault-injection feature: the test kit's FaultDevice between the image and the
# filesystem). Lost and misdirected writes and lying flushes are not here: no single-copy
# filesystem keeps acknowledged data through them (tests/lying_device.rs covers what birch
# promises there). (name, rules, seconds after which hung requests are released or None)
FAULT_KINDS = [
    ("write-eio-once", ["write:eio,times=1"], None),
    ("write-eio-some", ["write:eio,percent=3,times=8"], None),
    ("flush-eio-once", ["flush:eio,times=1"], None),
    ("read-eio-some", ["read:eio,percent=10,times=20"], None),
    ("device-full", ["write:nospace,percent=20,times=20"], None),
    ("slow-device", ["write:delay=20,percent=25", "flush:delay=50,percent=50"], None),
    ("hang-released", ["write:hang,times=1"], 1.5),
]


# --------------------------------------------------------------------------- stamped content

def gen_block(run: int, fid: int, blk: int, ver: int) -> bytes:
    """4 KiB: header, 1,984 random bytes, 2,048 bytes of text; all from (run, fid, blk, ver)."""
    r = random.Random(f"b:{run}:{fid}:{blk}:{ver}")
    hdr = BLK_HDR.pack(BLK_MAGIC, run, fid, blk, ver)
    line = f"run {run} file {fid} block {blk} version {ver} {r.randrange(1 << 30)}\n".encode()
    text = (line * (2048 // len(line) + 1))[:2048]
    return hdr + r.randbytes(BS - len(hdr) - 2048) + text


def gen_record(run: int, fid: int, seq: int) -> bytes:
    r = random.Random(f"l:{run}:{fid}:{seq}")
    n = r.randint(48, 1500)
    body_len = n - LOG_HDR.size
    rnd = r.randbytes(body_len // 2)
    line = f"log {fid} record {seq} of run {run};".encode()
    text = (line * (body_len // len(line) + 2))[:body_len - len(rnd)]
    return LOG_HDR.pack(LOG_MAGIC, run, fid, n, seq) + rnd + text


# --------------------------------------------------------------------------- writer process

def writer_main(cfg: dict) -> int:
    """One oracle writer (a subprocess): runs until SIGTERM (then finishes its operation and
    exits 0) or an I/O error (journals it and exits 3)."""
    wid, nw, run, cyc = cfg["wid"], cfg["writers"], cfg["run"], cfg["cycle"]
    odir = cfg["dir"]
    rng = random.Random(f"{cfg['seed']}:{cyc}:writer{wid}")
    jfd = os.open(cfg["journal"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))

    def jw(s: str) -> None:
        os.write(jfd, (s + "\n").encode())

    ver = cfg["next_ver"]
    have = {int(k): set(v) for k, v in cfg["have"].items()}   # fid -> blocks with content
    own = {f: [b for b in range(SHARED_BLOCKS) if b % nw == wid] for f in range(N_SHARED)}
    pfid, lfid = 100 + wid, LOG_FID + wid
    own[pfid] = list(range(PRIVATE_BLOCKS))
    for f in own:
        have.setdefault(f, set())
    path = {f: f"{odir}/s{f}" for f in range(N_SHARED)}
    path[pfid] = f"{odir}/p{wid}"
    fds = {f: os.open(p, os.O_RDWR) for f, p in path.items()}
    sync_fds = {"O_SYNC": os.open(path[pfid], os.O_RDWR | os.O_SYNC),
                "O_DSYNC": os.open(path[pfid], os.O_RDWR | os.O_DSYNC)}
    try:
        dfd = os.open(path[pfid], os.O_RDWR | os.O_DIRECT)
    except OSError as e:
        print(f"writer {wid}: O_DIRECT open refused ({e}); no direct writes", file=sys.stderr)
        dfd = None
    dbuf = mmap.mmap(-1, BS)
    # The append log restarts at its acknowledged end: the records after it are written again
    # with the same bytes at the same offsets.
    seq, end = cfg["log_seq"], cfg["log_end"]
    lfd = os.open(f"{odir}/log{wid}", os.O_WRONLY | os.O_APPEND)
    os.ftruncate(lfd, end)
    pending: dict[int, dict[int, int]] = collections.defaultdict(dict)

    def fmt(bv) -> str:
        return ",".join(f"{b}:{v}" for b, v in bv)

    def write_blocks(f: int, fd: int, blocks: list[int]) -> list[tuple[int, int]]:
        nonlocal ver
        out = []
        for b in blocks:
            ver += 1
            out.append((b, ver))
        jw(f"I {cyc} {f} {fmt(out)}")
        # contiguous runs go out as one pwrite
        i = 0
        while i < len(out):
            j = i
            while j + 1 < len(out) and out[j + 1][0] == out[j][0] + 1:
                j += 1
            data = b"".join(gen_block(run, f, b, v) for b, v in out[i:j + 1])
            n = os.pwrite(fd, data, out[i][0] * BS)
            if n != len(data):
                raise OSError(0, f"short write {n} of {len(data)}")
            i = j + 1
        jw(f"W {cyc} {time.monotonic():.6f} {f} {fmt(out)}")
        have[f].update(b for b, _ in out)
        return out

    def fsync(f: int, fd: int, data_only: bool) -> None:
        covered = sorted(pending[f].items())
        (os.fdatasync if data_only else os.fsync)(fd)
        if covered:
            jw(f"A {cyc} {f} {fmt(covered)}")
        for b, v in covered:
            if pending[f].get(b) == v:
                del pending[f][b]

    def pick(f: int, k: int, old: bool) -> list[int]:
        pool = sorted(have[f]) if old and have[f] else own[f]
        return sorted(rng.sample(pool, min(k, len(pool))))

    ops = ["batch", "overwrite", "osync", "append", "direct", "buffered"]
    weights = [30, 22, 14, 16, 6 if dfd is not None else 0, 12]
    try:
        while not stop[0]:
            op = rng.choices(ops, weights)[0]
            if op == "batch":        # several blocks, old and new, then fsync or fdatasync
                f = rng.choice(list(range(N_SHARED)) + [pfid])
                for b, v in write_blocks(f, fds[f], pick(f, rng.randint(1, 6), rng.random() < 0.5)):
                    pending[f][b] = v
                fsync(f, fds[f], rng.random() < 0.5)
            elif op == "overwrite":  # a file with nothing dirty: overwrite an acknowledged block, fsync
                clean = [f for f in fds if not pending[f] and have[f]]
                if not clean:
                    continue
                f = rng.choice(clean)
                for b, v in write_blocks(f, fds[f], pick(f, 1, True)):
                    pending[f][b] = v
                fsync(f, fds[f], rng.random() < 0.5)
            elif op == "osync":      # O_SYNC / O_DSYNC: acknowledged when pwrite returns
                kind = rng.choice(list(sync_fds))
                b0 = rng.randrange(PRIVATE_BLOCKS - 2)
                blocks = list(range(b0, b0 + rng.randint(1, 2)))
                out = write_blocks(pfid, sync_fds[kind], blocks)
                jw(f"A {cyc} {pfid} {fmt(out)}")
                for b, v in out:
                    if pending[pfid].get(b, -1) <= v:
                        pending[pfid].pop(b, None)
            elif op == "direct":     # O_DIRECT from an aligned buffer, then fdatasync
                b = rng.randrange(PRIVATE_BLOCKS)
                ver += 1
                jw(f"I {cyc} {pfid} {b}:{ver}")
                dbuf[:] = gen_block(run, pfid, b, ver)
                if os.pwrite(dfd, dbuf, b * BS) != BS:
                    raise OSError(0, "short direct write")
                jw(f"W {cyc} {time.monotonic():.6f} {pfid} {b}:{ver}")
                have[pfid].add(b)
                pending[pfid][b] = ver
                fsync(pfid, dfd, True)
            elif op == "append":     # small records appended, then fsync or fdatasync
                for _ in range(rng.randint(1, 3)):
                    rec = gen_record(run, lfid, seq + 1)
                    jw(f"LI {cyc} {lfid} {seq + 1} {end + len(rec)}")
                    if os.write(lfd, rec) != len(rec):
                        raise OSError(0, "short append")
                    seq, end = seq + 1, end + len(rec)
                    jw(f"LW {cyc} {time.monotonic():.6f} {lfid} {seq} {end}")
                (os.fdatasync if rng.random() < 0.5 else os.fsync)(lfd)
                jw(f"LA {cyc} {lfid} {seq} {end}")
            elif op == "buffered":   # left dirty for a later fsync of the file
                f = rng.choice(list(fds))
                for b, v in write_blocks(f, fds[f], pick(f, rng.randint(1, 4), rng.random() < 0.5)):
                    pending[f][b] = v
            if rng.random() < 0.2:
                time.sleep(rng.random() * 0.004)
    except OSError as e:
        jw(f"E {cyc} {time.monotonic():.6f} {e.errno} {e.strerror or e}")
        print(f"writer {wid}: {e}", file=sys.stderr)
        return 3
    return 0


# --------------------------------------------------------------------------- oracle state

class Oracle:
    """What the writers issued and acknowledged, read incrementally from their journals."""

    def __init__(self, run: int, writers: int, work: str):
        self.run, self.writers, self.work = run, writers, work
        self.issued: dict[tuple[int, int], int] = {}
        self.acked: dict[tuple[int, int], int] = {}
        self.next_ver = [0] * writers
        self.log_acked = {LOG_FID + w: (0, 0) for w in range(writers)}   # fid -> (seq, end)
        self.log_hash = {LOG_FID + w: (0, 0, hashlib.sha256()) for w in range(writers)}
        self.offsets = [0] * writers
        self.tainted: set = set()
        self.cycle_w: dict = {}   # this cycle's completed writes: (fid, blk) -> [(t, v)]
        self.cycle_lw: dict = {}  # fid -> [(t, seq, end)]
        self.acks_this_cycle = collections.Counter()
        self.errors: list[tuple[int, float, str]] = []

    def journal(self, w: int) -> str:
        return os.path.join(self.work, f"journal-{w}.txt")

    def new_cycle(self) -> None:
        self.cycle_w, self.cycle_lw = {}, {}
        self.acks_this_cycle = collections.Counter()
        self.errors = []

    def read_journals(self, cycle: int) -> None:
        for w in range(self.writers):
            p = self.journal(w)
            if not os.path.exists(p):
                continue
            with open(p, "rb") as f:
                f.seek(self.offsets[w])
                data = f.read()
            cut = data.rfind(b"\n") + 1
            self.offsets[w] += cut
            for line in data[:cut].decode().splitlines():
                self._line(w, line, cycle)

    def _line(self, w: int, line: str, cycle: int) -> None:
        p = line.split()
        kind, cyc = p[0], int(p[1])
        if kind in ("I", "A"):
            fid = int(p[2])
            for bv in p[3].split(","):
                b, v = map(int, bv.split(":"))
                key = (fid, b)
                if kind == "I":
                    self.issued[key] = max(self.issued.get(key, 0), v)
                    self.next_ver[w] = max(self.next_ver[w], v)
                else:
                    if v > self.acked.get(key, 0):
                        self.acked[key] = v
                    self.acks_this_cycle["blocks"] += 1
        elif kind == "W":
            t, fid = float(p[2]), int(p[3])
            if cyc == cycle:
                for bv in p[4].split(","):
                    b, v = map(int, bv.split(":"))
                    self.cycle_w.setdefault((fid, b), []).append((t, v))
        elif kind == "LA":
            fid, seq, end = int(p[2]), int(p[3]), int(p[4])
            old = self.log_acked[fid]
            if seq > old[0]:
                self.acks_this_cycle["records"] += seq - old[0]
                self.log_acked[fid] = (seq, end)
        elif kind == "LW":
            if cyc == cycle:
                self.cycle_lw.setdefault(int(p[3]), []).append((float(p[2]), int(p[4]), int(p[5])))
        elif kind == "E":
            self.errors.append((w, float(p[2]), " ".join(p[3:])))

    def writer_cfg(self, w: int, seed: int, cycle: int, odir: str) -> dict:
        have = collections.defaultdict(list)
        for (fid, b) in self.issued:
            if fid < N_SHARED and b % self.writers == w or fid == 100 + w:
                have[fid].append(b)
        seq, end = self.log_acked[LOG_FID + w]
        return {"wid": w, "writers": self.writers, "run": self.run, "cycle": cycle, "seed": seed,
                "dir": odir, "journal": self.journal(w), "next_ver": self.next_ver[w],
                "have": have, "log_seq": seq, "log_end": end}

    # ----------------------------------------------------------------------- the check

    def check(self, odir: str, cut: float | None, label: str) -> dict:
        """cut: completed writes before this monotonic time must be there too (None: only
        acknowledged ones). Returns counts and up to 30 problem descriptions."""
        res = {"checked": 0, "lost": 0, "wrong": 0, "written_lost": 0, "problems": [],
               "records": 0}

        def problem(kind: str, text: str) -> None:
            res[kind] += 1
            if len(res["problems"]) < 30:
                res["problems"].append(f"{label}: {kind}: {text}")

        files = [(f, f"{odir}/s{f}", SHARED_BLOCKS) for f in range(N_SHARED)]
        files += [(100 + w, f"{odir}/p{w}", PRIVATE_BLOCKS) for w in range(self.writers)]
        for fid, path, nblocks in files:
            try:
                with open(path, "rb") as fh:
                    content = fh.read()
            except OSError as e:
                content = b""
                problem("lost", f"file {path} unreadable: {e}")
            for b in range(nblocks):
                key = (fid, b)
                if key in self.tainted:
                    continue
                a = self.acked.get(key)
                need = a or 0
                if cut is not None:
                    for t, v in self.cycle_w.get(key, ()):
                        if t < cut and v > need:
                            need = v
                got = content[b * BS:(b + 1) * BS]
                if a:
                    res["checked"] += 1
                if not got.strip(b"\0"):
                    if need:
                        kind = "lost" if a and need == a else "written_lost"
                        problem(kind, f"fid {fid} block {b}: zeros, version {need} "
                                      f"{'acknowledged' if kind == 'lost' else 'written before the cut'}")
                        self.tainted.add(key)
                    continue
                if len(got) < BS:
                    got = got + bytes(BS - len(got))
                magic, run, f2, b2, v = BLK_HDR.unpack_from(got)
                issued = self.issued.get(key, 0)
                if magic != BLK_MAGIC or run != self.run or f2 != fid or b2 != b or v > issued \
                        or got != gen_block(self.run, fid, b, v):
                    what = (f"header says fid {f2} block {b2} version {v}" if magic == BLK_MAGIC
                            else f"no stamp (first bytes {got[:16].hex()})")
                    if magic == BLK_MAGIC and (f2, b2) == (fid, b) and v <= issued:
                        what += " but the bytes differ from that version's"
                    problem("wrong", f"fid {fid} block {b}: {what}; issued up to {issued}, "
                                     f"acknowledged {a}")
                    self.tainted.add(key)
                elif v < need:
                    kind = "lost" if a and v < a else "written_lost"
                    problem(kind, f"fid {fid} block {b}: version {v}, {need} "
                                  f"{'acknowledged' if kind == 'lost' else 'written before the cut'}")
                    self.tainted.add(key)
        for w in range(self.writers):
            fid = LOG_FID + w
            if fid in self.tainted:
                continue
            seq, end = self.log_acked[fid]
            need_end = end
            if cut is not None:
                for t, s, e in self.cycle_lw.get(fid, ()):
                    if t < cut and e > need_end:
                        need_end = e
            # expected bytes: a running hash of the acknowledged prefix, extended as it grows
            hseq, hend, h = self.log_hash[fid]
            while hseq < seq:
                hseq += 1
                rec = gen_record(self.run, fid, hseq)
                h.update(rec)
                hend += len(rec)
            self.log_hash[fid] = (hseq, hend, h)
            try:
                with open(f"{odir}/log{w}", "rb") as fh:
                    content = fh.read()
            except OSError as e:
                content = b""
            res["checked"] += seq
            res["records"] += seq
            if hend != end:
                problem("wrong", f"log {fid}: journal end {end} != records' end {hend} (oracle bug)")
            if len(content) < end or hashlib.sha256(content[:end]).digest() != h.digest():
                good_seq, off = 0, 0
                while good_seq < seq:
                    rec = gen_record(self.run, fid, good_seq + 1)
                    if content[off:off + len(rec)] != rec:
                        break
                    good_seq, off = good_seq + 1, off + len(rec)
                problem("lost", f"log {fid}: {seq} records ({end} bytes) acknowledged, file has "
                                f"{len(content)} bytes, intact through record {good_seq} "
                                f"(byte {off}); record {good_seq + 1}: "
                                f"{content[off:off + 32].hex() or 'absent'}")
                self.tainted.add(fid)
            elif need_end > end:
                if len(content) < need_end:
                    problem("written_lost", f"log {fid}: {len(content)} bytes, {need_end} written "
                                            f"before the cut ({end} acknowledged)")
        return res


# --------------------------------------------------------------------------- the soak

class Failure(Exception):
    pass


class Soak:
    def __init__(self, args):
        from birchbench import mounts
        self.m = mounts
        self.a = args
        self.birch = args.birch
        self.rng = random.Random(args.seed)
        self.run_id = self.rng.randrange(1 << 62)
        self.work = args.workdir or f"/var/tmp/birch-soak.{os.getpid()}"
        os.makedirs(self.work, exist_ok=True)
        self.img = os.path.join(self.work, "soak.img")
        self.mnt = os.path.join(self.work, "mnt")
        os.makedirs(self.mnt, exist_ok=True)
        self.odir = os.path.join(self.mnt, "oracle")
        self.oracle = Oracle(self.run_id, args.writers, self.work)
        self.procs: list[tuple[str, subprocess.Popen, str]] = []
        self.failures: list[str] = []
        self.stats = collections.Counter()
        self.ends = collections.Counter()
        self.fsck_clean = 0
        self.fsck_runs = 0
        self.hangs = 0
        self.panics = 0
        self.t0 = time.monotonic()
        self.cycle = 0
        self.daemon_log = ""
        self.daemon: subprocess.Popen | None = None
        self.panic_offset = 0
        self.daemon_errors = 0
        self.kind = ""
        self.evidence_root = args.evidence
        self.tools = self.find_tools()
        # --faults: per fault kind, what was injected and what the load and daemon saw.
        self.fault_seen: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.fault_kind = "none"

    # ------------------------------------------------------------------- helpers

    def log(self, msg: str) -> None:
        print(f"[soak +{time.monotonic() - self.t0:7.1f}s] {msg}", flush=True)

    def cmd(self, argv: list[str], limit: float, what: str, log_path: str | None = None):
        rc, out, err = self.m.run(argv, timeout=limit, log_path=log_path)
        if rc == -1000:
            self.hangs += 1
            raise Failure(f"hang: {what} did not finish in {limit:.0f} s")
        return rc, out, err

    def find_tools(self) -> dict:
        t = {}
        fsx = shutil.which("fsx") or os.path.expanduser("~/.cargo/bin/fsx")
        t["fsx"] = fsx if os.access(fsx, os.X_OK) else None
        xdirs = [os.environ.get("XFSTESTS_DIR", "/var/tmp/birch-xfstests")]
        for name, env in (("fsstress", "FSSTRESS"), ("fsx_c", "FSX_C")):
            cands = [os.environ[env]] if os.environ.get(env) else []
            cands += [os.path.join(d, "ltp", "fsx" if name == "fsx_c" else "fsstress") for d in xdirs]
            for c in cands:
                if os.access(c, os.X_OK):
                    # a private copy: the CI's xfstests tier may rebuild its tree under us
                    dst = os.path.join(self.work, name)
                    shutil.copy2(c, dst)
                    t[name] = dst
                    break
            else:
                t[name] = None
        return t

    def mounted(self) -> bool:
        return self.m.is_mounted(self.mnt)

    def daemon_pids(self) -> list[int]:
        return self.m.pids_with_arg(self.mnt)

    def image_holders(self) -> list[int]:
        out = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                for fd in os.listdir(f"/proc/{d}/fd"):
                    if os.readlink(f"/proc/{d}/fd/{fd}") == self.img:
                        out.append(int(d))
                        break
            except OSError:
                continue
        return out

    def mount(self, opts: str, what: str) -> None:
        """`birch mount -f`: the daemon is our child, its stderr goes to daemon.log (`birch mount`
        without -f gives the daemon a log file that it deletes once the mount is live)."""
        if self.a.faults:
            # The fault device's chances come from the run's seed and the cycle, so a failing
            # run replays with --seed (the daemon's log names the seed too).
            seed = (self.a.seed * 1_000_003 + self.cycle) % (1 << 63)
            opts = ",".join(o for o in (opts, f"fault_seed={seed}") if o)
        argv = [self.birch, "mount", "-f", self.img, self.mnt] + (["-o", opts] if opts else [])
        with open(self.daemon_log, "ab") as lf:
            lf.write(f"=== cycle {self.cycle}: {' '.join(argv[1:])} ({what})\n".encode())
            lf.flush()
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=lf, stderr=lf,
                                 start_new_session=True)
        deadline = time.monotonic() + 120
        while not self.mounted():
            if p.poll() is not None:
                raise Failure(f"mount ({what}, -o {opts or 'defaults'}): the daemon exited "
                              f"{p.returncode} before the mount was live: {tail(self.daemon_log, 400)}")
            if time.monotonic() > deadline:
                self.hangs += 1
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                raise Failure(f"hang: mount ({what}) not live after 120 s")
            time.sleep(0.02)
        self.daemon = p

    def reap_daemon(self, killed: bool) -> None:
        """The daemon must exit after its mount went; a signal we did not send is a failure."""
        p, self.daemon = self.daemon, None
        if p is None:
            return
        try:
            rc = p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.hangs += 1
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise Failure(f"hang: the daemon (pid {p.pid}) still runs 60 s after its unmount")
        if rc < 0 and not (killed and rc == -signal.SIGKILL):
            raise Failure(f"the daemon died of signal {-rc}: {tail(self.daemon_log, 400)}")
        if rc != 0 and not killed:
            self.log(f"  note: the daemon exited {rc}")

    def unmount(self, what: str, limit: float = 120) -> None:
        errs: list[str] = []
        t = time.monotonic()
        err = self.m.unmount(self.mnt, fuse=True, birch=self.birch, timeout=limit,
                             birch_timeout=limit, abort=True, errors=errs)
        if err or errs:
            if time.monotonic() - t >= limit:
                self.hangs += 1
            raise Failure(f"unmount ({what}): {err or ''} {'; '.join(errs)}".strip())

    # ------------------------------------------------------------------- load

    def start(self, name: str, argv: list[str], **kw) -> None:
        logp = os.path.join(self.cdir, f"{name}.log")
        lf = open(logp, "wb")
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=lf, stderr=subprocess.STDOUT,
                             start_new_session=True, **kw)
        lf.close()
        self.procs.append((name, p, logp))

    def start_load(self) -> None:
        c, rng, mnt = self.cycle, self.crng, self.mnt
        self.procs = []
        for w in range(self.a.writers):
            cfg = self.oracle.writer_cfg(w, self.a.seed, c, self.odir)
            self.start(f"writer{w}", [sys.executable, os.path.abspath(__file__), "--writer",
                                      json.dumps(cfg)])
        fseed = rng.randrange(1, 1 << 31)
        if self.tools["fsx"] and self.a.fsx:
            cfgf = os.path.join(HERE, "fsx.toml")
            art = os.path.join(self.cdir, "fsx-buffered")
            os.makedirs(art, exist_ok=True)
            self.start("fsx-buffered", [self.tools["fsx"], "-f", cfgf, "-S", str(fseed), "-P", art,
                                        f"{mnt}/fsx-buffered.dat"])
        if self.tools["fsx_c"] and self.a.fsx:
            art = os.path.join(self.cdir, "fsx-direct")
            os.makedirs(art, exist_ok=True)
            self.start("fsx-direct", [self.tools["fsx_c"], "-q", "-Z", "-R", "-W", "-r", "4096",
                                      "-w", "4096", "-t", "4096", "-l", "1048576", "-S",
                                      str(fseed + 1), "-P", art, f"{mnt}/fsx-direct.dat"])
        if self.tools["fsstress"] and self.a.fsstress_procs > 0:
            d = f"{mnt}/fsstress"
            os.makedirs(d, exist_ok=True)
            self.start("fsstress", [self.tools["fsstress"], "-d", d, "-p", str(self.a.fsstress_procs),
                                    "-n", "2000", "-l", "0", "-c", "-s", str(fseed + 2)])

    def load_early_exits(self) -> list[str]:
        out = []
        for name, p, logp in self.procs:
            rc = p.poll()
            if rc is not None:
                out.append(f"{name} exited {rc} before the end of the cycle (log {logp}: "
                           f"{tail(logp, 400)})")
        return out

    def stop_load(self, writers_gracefully: bool) -> None:
        for name, p, _ in self.procs:
            if p.poll() is not None:
                continue
            try:
                if name.startswith("writer") and writers_gracefully:
                    p.send_signal(signal.SIGTERM)
                else:
                    os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 60
        for name, p, _ in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=30)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    self.hangs += 1
                    raise Failure(f"hang: {name} (pid {p.pid}) does not exit")

    # ------------------------------------------------------------------- one cycle

    def end_cycle(self, kind: str) -> float | None:
        """Ends the cycle; returns the cut (completed writes before it must survive) or None."""
        if kind == "kill9":
            if self.daemon is None or self.daemon_pids() != [self.daemon.pid]:
                raise Failure(f"kill9: daemon pids for {self.mnt}: {self.daemon_pids()}")
            os.kill(self.daemon.pid, signal.SIGKILL)
            self.reap_daemon(True)
            self.stop_load(False)
            self.cmd(["umount", "-l", self.mnt], 30, "umount -l")
            if self.mounted():
                self.cmd(["fusermount3", "-uz", self.mnt], 30, "fusermount3 -uz")
            if self.mounted():
                raise Failure("still mounted after the lazy unmounts")
            return None
        if kind.startswith("shutdown"):
            argv = [self.birch, "shutdown"] + {"shutdown": [], "shutdown-log": ["--log"],
                                                "shutdown-now": ["--now"]}[kind] + [self.mnt]
            t = time.monotonic()
            rc, out, err = self.cmd(argv, 120, " ".join(argv[1:]))
            if rc != 0 and self.a.faults:
                # A filesystem a fault turned read-only cannot commit: the shutdown says so,
                # and the unmount below ends the cycle.
                self.log(f"  {' '.join(argv[1:])}: rc={rc} {err.strip()[-200:]}")
            elif rc != 0:
                raise Failure(f"{' '.join(argv[1:])}: rc={rc} {err.strip()[-300:]}")
            self.stop_load(False)
            self.unmount(kind)
            self.reap_daemon(False)
            return t if kind == "shutdown" else None
        # umount: the writers finish their operation and stop, the rest is killed
        self.stop_load(True)
        t = time.monotonic()
        self.unmount("clean umount")
        self.reap_daemon(False)
        return t

    def fault_command(self, text: str) -> None:
        rc, out, err = self.cmd([self.birch, "fault", self.mnt, text], 30, f"birch fault {text}")
        if rc != 0:
            raise Failure(f"birch fault {self.mnt} {text!r}: rc={rc} {err.strip()[-300:]} (a birch "
                          f"built with --features fault-injection is needed: --birch)")

    def note_fault_cycle(self, name: str, early: list[str]) -> None:
        """Counts this cycle's injections (the daemon logs the device's totals at each `birch
        fault` command; a mount's first rule is armed in this cycle) and the load that stopped."""
        self.fault_kind = name
        seen = self.fault_seen[name]
        seen["cycles"] += 1
        try:
            with open(self.daemon_log, "rb") as f:
                text = f.read().decode(errors="replace")
        except OSError:
            text = ""
        lines = [l for l in text.splitlines() if "injected so far:" in l]
        if lines:
            for part in lines[-1].split("injected so far:")[1].split(","):
                what, n = part.split()
                seen[f"injected {what}"] += int(n)
        seen["load stopped early"] += len(early)

    def check_panics(self) -> None:
        try:
            with open(self.daemon_log, "rb") as f:
                f.seek(self.panic_offset)
                text = f.read().decode(errors="replace")
                self.panic_offset = f.tell()
        except OSError:
            return
        if "panicked" in text:
            self.panics += 1
            lines = [l for l in text.splitlines() if "panicked" in l]
            raise Failure(f"daemon panicked: {lines[0][:300]}")
        # The engine's errors (a lost log batch at replay, a failed commit, an internal error);
        # after a shutdown, those that say the filesystem is shut down are expected.
        errors = [l for l in text.splitlines() if " ERROR birch_" in l
                  and not (self.kind.startswith("shutdown") and "shut down" in l)]
        if errors and self.a.faults:
            # Under faults the engine's errors are what a user sees: counted, not failures
            # (a panic above still is).
            self.fault_seen[self.fault_kind]["daemon ERROR lines"] += len(errors)
            self.fault_seen[self.fault_kind]["cycles turned read-only"] += any(
                "read-only" in l for l in errors)
            errors = []
        if errors:
            self.daemon_errors += len(errors)
            raise Failure(f"the daemon logged {len(errors)} errors: {errors[0][:300]}")

    def one_cycle(self, seconds: float) -> None:
        c = self.cycle
        self.crng = random.Random(f"{self.a.seed}:cycle{c}")
        self.cdir = os.path.join(self.work, f"cycle-{c:03d}")
        os.makedirs(self.cdir, exist_ok=True)
        self.oracle.new_cycle()
        self.tidy()
        self.start_load()
        kind = self.kind = self.crng.choices(END_KINDS, END_WEIGHTS)[0]
        self.ends[kind] += 1
        t_end = time.monotonic() + seconds
        early = []
        fault = None
        if self.a.faults:
            fault = self.crng.choice(FAULT_KINDS)
            t_arm = time.monotonic() + seconds * self.crng.uniform(0.15, 0.5)
        armed_at = None
        while time.monotonic() < t_end:
            time.sleep(0.25)
            if fault and armed_at is None and time.monotonic() >= t_arm:
                armed_at = time.monotonic()
                for rule in fault[1]:
                    self.fault_command(rule)
                self.log(f"  fault {fault[0]} armed: {' + '.join(fault[1])}")
            if fault and fault[2] is not None and armed_at is not None \
                    and time.monotonic() - armed_at >= fault[2]:
                self.fault_command("release")
                fault = (fault[0], fault[1], None)
            early = self.load_early_exits()
            if early and not self.a.faults:
                break
        if self.a.faults:
            # What the device injected, from the daemon's log line of this command; then the
            # end runs without faults (but kill -9, which meets the device as it is).
            if kind != "kill9":
                self.fault_command("clear")
            self.fault_command("release")
            self.note_fault_cycle(fault[0] if fault else "none", early)
            early = []
        t_action = time.monotonic()
        cut = self.end_cycle(kind)
        if self.a.faults:
            # A write that failed on its way to the device is lost unless it was acknowledged:
            # only acknowledged writes are owed.
            cut = None
        self.oracle.read_journals(c)
        errs = [f"writer {w}: {msg}" for w, t, msg in self.oracle.errors if t < t_action]
        if self.a.faults:
            # Under faults a writer stops at its first failed call (EIO, ENOSPC, EROFS): what
            # it saw is counted, not a failure.
            for _, t, msg in self.oracle.errors:
                if t >= t_action:   # the end of the cycle (a killed daemon), not the fault
                    continue
                code = msg.split()[0] if msg else "?"
                name = errno.errorcode.get(int(code), code) if code.isdigit() else code
                self.fault_seen[self.fault_kind][f"writer stopped by {name}"] += 1
            errs = []
        acks = self.oracle.acks_this_cycle
        self.stats["acked_blocks"] += acks["blocks"]
        self.stats["acked_records"] += acks["records"]
        self.log(f"cycle {c}: ended by {kind} after {t_action - self.cstart:.1f} s; acknowledged "
                 f"{acks['blocks']} block writes, {acks['records']} log records")
        if self.daemon_pids():
            raise Failure(f"daemon still running after the end ({self.daemon_pids()})")
        deadline = time.monotonic() + 20
        while self.image_holders() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.image_holders():
            raise Failure(f"image still held open by {self.image_holders()} (lock not released)")
        self.check_panics()
        self.fsck()
        # fsck ran; now problems of the load can be reported (the image is kept as it is)
        if early or errs:
            raise Failure("load failed before the end of the cycle: " + "; ".join(early + errs))
        if self.a.inject_loss == c:
            key = max(self.oracle.acked)
            self.oracle.issued[key] += 1
            self.oracle.acked[key] = self.oracle.issued[key]
            self.log(f"  --inject-loss: the oracle now believes version {self.oracle.acked[key]} "
                     f"of fid {key[0]} block {key[1]} was acknowledged (never written)")
        self.mount("ro", "read-only check")
        res = self.guarded(lambda: self.oracle.check(self.odir, cut, "read-only mount (log replayed in memory)"),
                           300, "the check on the read-only mount")
        self.unmount("read-only check")
        self.reap_daemon(False)
        self.report_check(res, ro=True)
        self.opts = self.rng.choice(MOUNT_OPTS)  # the next cycle's
        self.mount(self.opts, "read-write")
        res = self.guarded(lambda: self.oracle.check(self.odir, cut, "read-write mount (log replayed)"),
                           300, "the check on the read-write mount")
        self.report_check(res, ro=False)
        self.check_panics()
        for name in ("fsx-buffered", "fsx-direct"):   # a passed cycle's fsx artifacts
            shutil.rmtree(os.path.join(self.cdir, name), ignore_errors=True)

    def guarded(self, fn, limit: float, what: str):
        """fn() with a watchdog: past limit the FUSE connection is aborted (reads then fail)."""
        fired = []

        def fire():
            fired.append(self.m.fuse_abort(self.mnt))
        t = threading.Timer(limit, fire)
        t.start()
        try:
            return fn()
        finally:
            t.cancel()
            if fired:
                self.hangs += 1
                raise Failure(f"hang: {what} took more than {limit:.0f} s ({fired[0]})")

    def report_check(self, res: dict, ro: bool) -> None:
        self.stats["checked"] += res["checked"]
        self.stats["lost"] += res["lost"]
        self.stats["wrong"] += res["wrong"]
        self.stats["written_lost"] += res["written_lost"]
        bad = res["lost"] + res["wrong"] + res["written_lost"]
        self.log(f"  check on the {'read-only' if ro else 'read-write'} mount: {res['checked']} "
                 f"acknowledged writes checked ({res['records']} log records), lost {res['lost']}, "
                 f"wrong {res['wrong']}, completed-before-cut lost {res['written_lost']}")
        for p in res["problems"]:
            self.log("    " + p)
        if bad:
            if ro:
                self.keep_image("crash state, before the read-write mount's replay")
            raise Failure(f"oracle: lost {res['lost']}, wrong {res['wrong']}, completed-before-cut "
                          f"lost {res['written_lost']}: {res['problems'][0]}")

    def fsck(self) -> None:
        out_path = os.path.join(self.cdir, "fsck.txt")
        rc, out, err = self.cmd([self.birch, "fsck", "--data", self.img], 600, "fsck --data")
        with open(out_path, "w") as f:
            f.write(out + err)
        self.fsck_runs += 1
        last = (out.strip().splitlines() or [""])[-1]
        if rc != 0:
            self.keep_image("fsck not clean")
            raise Failure(f"fsck --data exit {rc}: {(out + err).strip()[-600:]}")
        self.fsck_clean += 1
        replay = " (log replayed in memory)" if "replayed in memory" in out else ""
        self.log(f"  fsck --data clean{replay}: {last[:160]}")

    def keep_image(self, why: str) -> None:
        if getattr(self, "kept", False):
            return
        d = self.evidence_dir()
        subprocess.run(["cp", "--sparse=always", self.img, os.path.join(d, "soak.img")])
        with open(os.path.join(d, "image.txt"), "w") as f:
            f.write(f"image copied at cycle {self.cycle}: {why}\n")
        self.kept = True

    def evidence_dir(self) -> str:
        d = os.path.join(self.evidence_root, f"seed-{self.a.seed}", f"cycle-{self.cycle:03d}")
        os.makedirs(d, exist_ok=True)
        return d

    def keep_evidence(self, msg: str) -> None:
        d = self.evidence_dir()
        self.keep_image("after the failure")
        for name in os.listdir(self.work):
            p = os.path.join(self.work, name)
            if name.startswith("journal-") or name == "daemon.log":
                shutil.copy2(p, d)
        if os.path.isdir(self.cdir):
            shutil.copytree(self.cdir, os.path.join(d, "cycle"), dirs_exist_ok=True)
        with open(os.path.join(d, "failure.txt"), "w") as f:
            f.write(f"seed {self.a.seed} run {self.run_id} cycle {self.cycle} mount options "
                    f"'{self.opts}' end {self.kind}\n{msg}\n"
                    f"replay: sudo python3 tests/soak/soak.py --seed {self.a.seed} "
                    f"--minutes {self.a.minutes} --cycle-seconds {self.a.cycle_seconds} "
                    f"--fsstress-procs {self.a.fsstress_procs} --writers {self.a.writers}\n")
        self.log(f"  evidence kept in {d}")

    def tidy(self) -> None:
        """Keeps the image from filling: fsx files are rewritten each cycle anyway."""
        for name in ("fsx-buffered.dat", "fsx-direct.dat"):
            try:
                os.unlink(os.path.join(self.mnt, name))
            except OSError:
                pass
        st = os.statvfs(self.mnt)
        if st.f_bavail < st.f_blocks * 0.4:
            shutil.rmtree(os.path.join(self.mnt, "fsstress"), ignore_errors=True)

    # ------------------------------------------------------------------- the whole run

    def setup(self) -> None:
        self.daemon_log = os.path.join(self.work, "daemon.log")
        rc, out, err = self.cmd([self.birch, "mkfs", "--size", self.a.image_size, self.img], 120, "mkfs")
        if rc != 0:
            raise Failure(f"mkfs: {err.strip()}")
        self.opts = self.rng.choice(MOUNT_OPTS)
        self.cdir = os.path.join(self.work, "setup")
        os.makedirs(self.cdir, exist_ok=True)
        self.mount(self.opts, "first")
        os.makedirs(self.odir)
        names = [f"s{f}" for f in range(N_SHARED)]
        names += [f"p{w}" for w in range(self.a.writers)] + [f"log{w}" for w in range(self.a.writers)]
        for n in names:
            fd = os.open(os.path.join(self.odir, n), os.O_CREAT | os.O_RDWR, 0o644)
            os.fsync(fd)
            os.close(fd)
        dfd = os.open(self.odir, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
        rc, _, err = self.cmd([self.birch, "sync", self.mnt], 120, "birch sync")
        if rc != 0:
            raise Failure(f"birch sync: {err.strip()}")

    def main(self) -> int:
        a = self.a
        lo, hi = (float(x) for x in a.cycle_seconds.split(":"))
        self.log(f"seed {a.seed} (replay with --seed {a.seed}); work dir {self.work}; image "
                 f"{a.image_size}; {a.writers} oracle writers; fsx buffered: "
                 f"{self.tools['fsx'] or 'NOT FOUND (tests/posix/setup.sh), skipped'}; fsx O_DIRECT: "
                 f"{self.tools['fsx_c'] or 'xfstests ltp/fsx not built, skipped'}; fsstress: "
                 + (f"{a.fsstress_procs} procs ({self.tools['fsstress']})" if self.tools["fsstress"]
                    and a.fsstress_procs else "off (--fsstress-procs 0)" if not a.fsstress_procs
                    else "NOT BUILT (tests/xfstests/setup.sh builds it), skipped"))
        budget = a.minutes * 60
        try:
            self.setup()
        except Failure as e:
            self.log(f"FAILED in setup: {e}")
            return 1
        while True:
            left = budget - (time.monotonic() - self.t0)
            if left < lo + OVERHEAD and self.cycle > 0:
                break
            self.cycle += 1
            self.cstart = time.monotonic()
            seconds = min(self.rng.uniform(lo, hi), max(lo, left - OVERHEAD))
            self.log(f"cycle {self.cycle}: mount options '{self.opts or 'defaults'}', load for "
                     f"{seconds:.1f} s")
            self.kept = False
            try:
                if not self.mounted():
                    self.mount(self.opts, "start of cycle")
                self.one_cycle(seconds)
            except Failure as e:
                msg = str(e)
                self.failures.append(f"cycle {self.cycle}: {msg}")
                self.log(f"FAILED cycle {self.cycle}: {msg}")
                try:
                    self.stop_load(False)
                except Failure:
                    pass
                if self.mounted():
                    self.m.unmount(self.mnt, fuse=True, birch=self.birch, timeout=60, abort=True)
                try:
                    self.reap_daemon(True)
                except Failure as e2:
                    self.log(f"  {e2}")
                self.keep_evidence(msg)
                if not a.keep_going:
                    break
                # go on from what is there: the oracle keeps what it found (tainted blocks
                # are no longer checked)
                self.oracle.read_journals(self.cycle)
        # the end: a clean unmount and a last fsck
        if self.mounted():
            try:
                self.unmount("final")
                self.reap_daemon(False)
                self.fsck()
            except Failure as e:
                self.failures.append(f"final: {e}")
        self.summary()
        # the work dir goes (a failure's evidence was copied out); never while it has a mount
        if not a.keep_work and not self.mounted():
            shutil.rmtree(self.work, ignore_errors=True)
        return 1 if self.failures else 0

    def summary(self) -> None:
        s = self.stats
        ends = ", ".join(f"{k} {self.ends[k]}" for k in END_KINDS)
        print("=== soak summary", flush=True)
        print(f"seed {self.a.seed}, {time.monotonic() - self.t0:.0f} s, cycles {self.cycle} ({ends})")
        print(f"acknowledgements recorded: {s['acked_blocks']} block writes, {s['acked_records']} "
              f"log records (by fsync, fdatasync, O_SYNC, O_DSYNC)")
        print(f"acknowledged writes checked {s['checked']} (each check counts every acknowledged "
              f"block and log record; two checks a cycle), lost {s['lost']}, wrong {s['wrong']}, "
              f"completed-before-cut lost {s['written_lost']}")
        print(f"fsck clean {self.fsck_clean}/{self.fsck_runs}, daemon panics {self.panics}, daemon "
              f"errors {self.daemon_errors}, hangs {self.hangs}")
        if self.a.faults:
            print("faults (per kind: cycles, injections, what the load saw; the checks above "
                  "cover every cycle):")
            for name, seen in sorted(self.fault_seen.items()):
                print(f"  {name}: " + ", ".join(f"{k} {v}" for k, v in sorted(seen.items()) if v))
        for f in self.failures:
            print(f"FAILURE {f}")
        print("soak: " + ("FAILED" if self.failures else "ok"), flush=True)


def tail(path: str, n: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - n))
            return f.read().decode(errors="replace").strip().replace("\n", " | ")
    except OSError:
        return ""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--writer":
        return writer_main(json.loads(argv[1]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=None, help="default: a fresh one (printed)")
    p.add_argument("--cycle-seconds", default="5:25", help="load time of a cycle, A:B (default 5:25)")
    p.add_argument("--fsstress-procs", type=int, default=2, help="0 leaves fsstress out")
    p.add_argument("--writers", type=int, default=3, help="oracle writer processes (default 3)")
    p.add_argument("--no-fsx", dest="fsx", action="store_false", help="leave fsx out")
    p.add_argument("--keep-going", action="store_true", help="go on after a failure")
    p.add_argument("--inject-loss", type=int, default=0, metavar="CYCLE",
                   help="test of the oracle itself: after cycle CYCLE it believes a version that "
                        "was never written was acknowledged; the check must report it lost")
    p.add_argument("--evidence", default="/var/tmp/soak-evidence")
    p.add_argument("--image-size", default="2G")
    p.add_argument("--workdir", default=None)
    p.add_argument("--keep-work", action="store_true", help="keep the work dir after a clean run")
    p.add_argument("--faults", action="store_true",
                   help="arm one device fault a cycle (FAULT_KINDS) through `birch fault`; needs a "
                        "birch built with --features fault-injection (default --birch: "
                        "target/fault-injection/birch)")
    p.add_argument("--birch", default=None)
    args = p.parse_args(argv)
    if args.birch is None:
        default = ("fault-injection" if args.faults else "release")
        args.birch = (os.environ.get("BIRCH_FAULT" if args.faults else "BIRCH")
                      or os.path.join(REPO, "target", default, "birch"))
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little")
    if os.geteuid() != 0:
        print("soak: SKIP: needs root")
        return 77
    if not os.path.exists("/dev/fuse"):
        print("soak: SKIP: /dev/fuse is absent")
        return 77
    if not os.access(args.birch, os.X_OK):
        print(f"soak: {args.birch} not built (cargo build --release -p birch-tools)")
        return 77
    if ":" not in args.cycle_seconds:
        p.error("--cycle-seconds A:B")
    soak = Soak(args)

    def interrupted(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupted)
    try:
        return soak.main()
    except KeyboardInterrupt:
        soak.log("interrupted")
        try:
            soak.stop_load(False)
        except Exception:
            pass
        soak.m.unmount(soak.mnt, fuse=True, birch=soak.birch, timeout=30, abort=True)
        soak.summary()
        return 1


if __name__ == "__main__":
    sys.exit(main())
