"""The compression benchmark (issue 37 item 7): stored bytes and speed on compressible corpora,
birchfs beside btrfs with and without compression.  Started through bench/compress.sh, which
installs its tools (fio, btrfs-progs, btrfs-compsize) and runs bench/compress.py.

Owns: the corpora (L: a log file, a SQLite database, a VM-image-like file; S: the W6 source
tree; R: incompressible random data), made deterministically from a seed and cached under
IMAGE_DIR/corpus/; the compression targets (btrfs with compress=zstd:1, compress-force=zstd:1,
compress=lzo and none, birchfs with compression off, birchfs with `-o compress=X` for each --birch-compress X once
birch has that option, and birchfs-defrag-X for each --birch-defrag X: birch written plainly, then
rewritten by `birch defrag --compress=X -r`, a second pass timed on its own); one measurement per (repeat, corpus, target): a fresh mkfs, the copy to
durable (on birch through the daemon's control command `sync`, see CompressTarget.sync),
stored bytes (birch's inline files included), a cold read, fio random 4 KiB reads (corpus L), CPU from /proc; and
its own report (summary.md, results.json).

Reuses, and must not change: birchbench.targets.Target (images written out in full, loop
devices with direct I/O and discard off, btrfs mkfs, birch mkfs/mount/sync/umount, the
counters), birchbench.mounts (commands with a time limit, the cleanup record) and
birchbench.workloads.w6_tree (the W6 tree, the same seed).  Its own image directory
(/var/tmp/birchbench-compress by default), so it never touches a birchbench run's images.
"""
from __future__ import annotations

import argparse
import datetime
import fcntl
import hashlib
import json
import os
import platform
import random
import shutil
import sqlite3
import statistics
import struct
import sys
import time

from . import mounts
from .common import REPO, fmt_num, human, parse_size, str_list
from .mounts import run
from .targets import Target
from .workloads import W6_SEED, w6_tree

CORPUS_VERSION = 1  # bump when a generator changes its output: the cache key changes with it
CORPORA = ("L", "S", "R")
CORPUS_TITLES = {"L": "L: large files (log, SQLite database, VM-image-like)",
                 "S": "S: source tree (W6's)",
                 "R": "R: incompressible (random)"}
REF_TARGET = "btrfs-zstd1"
# (name, kind, options): btrfs's are added to `-o nodiscard`, birch's are `birch mount -o`
# btrfs-zstd1-force: btrfs's compress= gives a file up for good at the first range that does not
# shrink (BTRFS_INODE_NOCOMPRESS); compress-force= keeps trying.  On L's VM-image-like file
# (random regions among compressible ones) that is 72% stored against 45% (L at 448 MiB).
BASE_TARGETS = [("btrfs-zstd1", "btrfs", "compress=zstd:1"),
                ("btrfs-zstd1-force", "btrfs", "compress-force=zstd:1"),
                ("btrfs-lzo", "btrfs", "compress=lzo"),
                ("btrfs", "btrfs", None),
                ("birchfs", "birchfs", None)]
# birch keeps a file of at most this many bytes inside its extent item, in a tree node, not in a
# data block (FORMAT.md INLINE_MAX_BYTES; btrfs's max_inline is the same 2048).  compsize counts
# btrfs's inline extents in its Disk Usage; `birch inspect space` counts data blocks only, so
# birch's stored data adds these bytes to count the same way.
BIRCH_INLINE_MAX = 2048
MiB = 1 << 20
GiB = 1 << 30


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- corpora

LOG_LEVELS = ["INFO"] * 14 + ["DEBUG"] * 4 + ["WARN"] * 2 + ["ERROR"]
LOG_SERVICES = ["api", "auth", "billing", "search", "worker", "scheduler", "gateway", "storage"]
LOG_PATHS = ["/api/v1/users", "/api/v1/orders", "/api/v1/items", "/api/v2/search", "/healthz",
             "/api/v1/login", "/static/app.js", "/api/v1/cart", "/metrics", "/api/v2/reports"]
LOG_MSGS = ["request done", "cache miss", "retrying upstream", "slow query", "session opened",
            "session closed", "queued job", "job finished", "token refreshed", "rate limited"]


def gen_log(path: str, size: int, seed: int) -> None:
    """Text log lines with microsecond timestamps, hosts, pids, request ids, paths, status codes
    and latencies, as a web service writes them (repetitive structure, varying numbers)."""
    rnd = random.Random(seed)
    t = 1767225600.0  # 2026-01-01T00:00:00Z
    with open(path, "w", buffering=1 << 20) as f:
        n = 0
        while n < size:
            lines = []
            for _ in range(512):
                t += rnd.expovariate(200.0)
                sec = int(t)
                ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec)) + f".{int((t - sec) * 1e6):06d}Z"
                svc = LOG_SERVICES[rnd.randrange(len(LOG_SERVICES))]
                lines.append(
                    f"{ts} host-{rnd.randrange(16):02d} {svc}[{1000 + rnd.randrange(64)}]: "
                    f"{LOG_LEVELS[rnd.randrange(len(LOG_LEVELS))]} {LOG_MSGS[rnd.randrange(len(LOG_MSGS))]} "
                    f"req={rnd.getrandbits(64):016x} method={'GET' if rnd.random() < 0.7 else 'POST'} "
                    f"path={LOG_PATHS[rnd.randrange(len(LOG_PATHS))]}/{rnd.randrange(100000)} "
                    f"status={200 if rnd.random() < 0.9 else rnd.choice((301, 404, 500, 503))} "
                    f"latency_ms={rnd.lognormvariate(2.5, 1.0):.2f} bytes={rnd.randrange(100, 90000)}\n")
            chunk = "".join(lines)
            if n + len(chunk) > size:
                chunk = chunk[: size - n]
            f.write(chunk)
            n += len(chunk)


def gen_db(path: str, size: int, seed: int) -> None:
    """A SQLite database (python3's sqlite3): an orders table with an index, filled until the
    file reaches `size` (then VACUUMed into exactly whole pages): structured records in B-tree
    pages, as a database file on a filesystem looks."""
    rnd = random.Random(seed)
    tmp = path + ".tmp"
    for p in (tmp, tmp + "-journal"):
        if os.path.exists(p):
            os.unlink(p)
    con = sqlite3.connect(tmp)
    con.execute("PRAGMA page_size=4096")
    con.execute("PRAGMA journal_mode=OFF")
    con.execute("PRAGMA synchronous=OFF")
    con.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, ts TEXT, customer TEXT, email TEXT,"
                " sku TEXT, qty INTEGER, amount REAL, status TEXT, note TEXT)")
    con.execute("CREATE INDEX orders_customer ON orders(customer, ts)")
    first = ["ada", "bob", "cleo", "dan", "eve", "finn", "gus", "hana", "ivo", "jo", "kim", "lea"]
    last = ["smith", "jones", "garcia", "müller", "rossi", "dubois", "novak", "tanaka", "kim", "silva"]
    statuses = ["new", "paid", "shipped", "delivered", "returned", "cancelled"]
    notes = ["", "", "", "gift wrap", "leave at door", "call before delivery", "fragile",
             "second attempt", "customer asked for invoice"]
    oid, t = 0, 1767225600
    while True:
        rows = []
        for _ in range(5000):
            oid += 1
            t += rnd.randrange(1, 30)
            name = f"{first[rnd.randrange(len(first))]} {last[rnd.randrange(len(last))]}"
            rows.append((oid, time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)), name,
                         name.replace(" ", ".") + f"{rnd.randrange(1000)}@example.com",
                         f"SKU-{rnd.randrange(20000):05d}", rnd.randrange(1, 9),
                         round(rnd.lognormvariate(3.5, 1.0), 2), statuses[rnd.randrange(len(statuses))],
                         notes[rnd.randrange(len(notes))]))
        con.executemany("INSERT INTO orders VALUES (?,?,?,?,?,?,?,?,?)", rows)
        con.commit()
        if os.path.getsize(tmp) >= size:
            break
    con.close()
    os.replace(tmp, path)


def _semi_binary(rnd: random.Random, n: int) -> bytes:
    """Machine-code-like bytes: fresh random 64-byte pieces, repeats of earlier pieces, and
    little-endian tables of small integers (about 2x compressible, as executables are)."""
    out = bytearray()
    while len(out) < n:
        r = rnd.random()
        if r < 0.35 or len(out) < 256:
            out += rnd.randbytes(64)
        elif r < 0.75:
            off = rnd.randrange(0, len(out) - 64)
            out += out[off: off + 64]
        else:
            out += struct.pack("<16I", *(rnd.randrange(4096) for _ in range(16)))
    return bytes(out[:n])


def gen_vm(path: str, size: int, seed: int) -> None:
    """A VM-image-like file in 1 MiB regions: zero runs (~40%), machine-code-like binary (~25%),
    text (~20%: log and source lines) and incompressible data (~15%: packed/compressed files
    inside the guest), in runs of 1-8 regions."""
    rnd = random.Random(seed)
    text_pool = b"".join(body for _, body in w6_tree(200, seed) if body)[: 4 * MiB]
    with open(path, "wb") as f:
        n = 0
        while n < size:
            r = rnd.random()
            kind = "zero" if r < 0.40 else "bin" if r < 0.65 else "text" if r < 0.85 else "rand"
            for _ in range(rnd.randrange(1, 9)):
                if n >= size:
                    break
                m = min(MiB, size - n)
                if kind == "zero":
                    buf = bytes(m)
                elif kind == "bin":
                    buf = _semi_binary(rnd, m)
                elif kind == "text":
                    off = rnd.randrange(0, max(1, len(text_pool) - m))
                    buf = text_pool[off: off + m].ljust(m, b"\n")
                else:
                    buf = rnd.randbytes(m)
                f.write(buf)
                n += m


def gen_random(path: str, size: int, seed: int) -> None:
    rnd = random.Random(seed)
    with open(path, "wb") as f:
        left = size
        while left > 0:
            m = min(4 * MiB, left)
            f.write(rnd.randbytes(m))
            left -= m


def gen_tree(root: str, files: int) -> None:
    """The W6 source tree (bench/birchbench/workloads.py w6_tree, W6's seed) as files."""
    for path, body in w6_tree(files, W6_SEED):
        full = os.path.join(root, path)
        if body is None:
            os.makedirs(full, exist_ok=True)
        else:
            with open(full, "wb") as f:
                f.write(body)


def corpus_key(name: str, sizes: dict, seed: int) -> str:
    if name == "L":
        return f"L-log{human(sizes['log'])}-db{human(sizes['db'])}-vm{human(sizes['vm'])}-s{seed}-v{CORPUS_VERSION}"
    if name == "S":
        return f"S-w6-{sizes['files']}files-s{W6_SEED}-v{CORPUS_VERSION}"
    if name == "R":
        return f"R-random{human(sizes['random'])}-s{seed}-v{CORPUS_VERSION}"
    raise ValueError(name)


def make_corpus(name: str, base: str, sizes: dict, seed: int) -> dict:
    """The corpus `name` under base/<key>/ (made once, then reused while its manifest is
    there): returns the manifest {name, key, dir, files, bytes, largest, sha256}."""
    key = corpus_key(name, sizes, seed)
    d = os.path.join(base, key)
    man_path = d + ".json"
    try:
        with open(man_path) as f:
            man = json.load(f)
        if os.path.isdir(d):
            return man
    except (OSError, ValueError):
        pass
    t0 = time.time()
    part = d + ".part"
    shutil.rmtree(part, ignore_errors=True)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(part)
    if name == "L":
        gen_log(os.path.join(part, "app.log"), sizes["log"], seed)
        gen_db(os.path.join(part, "orders.sqlite"), sizes["db"], seed + 1)
        gen_vm(os.path.join(part, "guest.img"), sizes["vm"], seed + 2)
    elif name == "S":
        gen_tree(part, sizes["files"])
    elif name == "R":
        gen_random(os.path.join(part, "random.bin"), sizes["random"], seed + 3)
    os.replace(part, d)
    files = list_files(d)
    h = hashlib.sha256()
    total, largest = 0, ("", 0)
    for rel in files:
        full = os.path.join(d, rel)
        sz = os.path.getsize(full)
        total += sz
        if sz > largest[1]:
            largest = (rel, sz)
        h.update(rel.encode() + b"\0")
        with open(full, "rb") as f:
            for chunk in iter(lambda: f.read(MiB), b""):
                h.update(chunk)
    man = {"name": name, "key": key, "dir": d, "files": len(files), "bytes": total,
           "largest": largest[0], "largest_bytes": largest[1], "sha256": h.hexdigest(), "seed": seed}
    with open(man_path, "w") as f:
        json.dump(man, f, indent=1)
    log(f"corpus {key}: made {len(files):,} files, {total / MiB:.1f} MiB in {time.time() - t0:.1f}s")
    return man


def list_files(root: str) -> list[str]:
    """Every regular file under root, relative, in a fixed order."""
    out = []
    for dp, dns, fns in os.walk(root):
        dns.sort()
        for fn in sorted(fns):
            out.append(os.path.relpath(os.path.join(dp, fn), root))
    return out


# --------------------------------------------------------------------------- /proc and statfs

def proc_sys_seconds(stat: str = "/proc/stat") -> float:
    """Machine-wide system CPU seconds (system + irq + softirq of the `cpu` line): the kernel's
    work for every process, btrfs's compression workers and FUSE included."""
    with open(stat) as f:
        parts = f.readline().split()
    return (int(parts[3]) + int(parts[6]) + int(parts[7])) / os.sysconf("SC_CLK_TCK")


def proc_cpu_seconds(pid: int, proc: str = "/proc") -> float | None:
    """utime + stime of a process (all its threads), in seconds."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def counter_delta(before: dict | None, after: dict | None) -> dict:
    """The numeric counters that changed between two readings of birch's counters (the root's
    trusted.birch.stats xattr is flat; `birch stats --json` nests them under "counters")."""
    if not before or not after:
        return {}
    b, a = before.get("counters", before), after.get("counters", after)
    return {k: a[k] - b.get(k, 0) for k in a
            if isinstance(a[k], (int, float)) and not isinstance(a[k], bool) and a[k] != b.get(k, 0)}


def statfs_used(path: str) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def parse_compsize(out: str) -> dict | None:
    """`compsize -b DIR`'s TOTAL line: disk usage, uncompressed, referenced (bytes)."""
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] == "TOTAL" and len(parts) >= 5:
            try:
                return {"disk": int(parts[2]), "uncompressed": int(parts[3]), "referenced": int(parts[4])}
            except ValueError:
                return None
    return None


def parse_inspect_space(out: str) -> dict:
    """`birch inspect IMAGE space`: {category: bytes} for its top-level lines (data, tree nodes…)."""
    got = {}
    for line in out.splitlines():
        if " bytes " not in line or line.startswith("  "):
            continue
        head, _, _ = line.partition(" bytes ")
        words = head.split()
        if len(words) >= 2 and words[-1].isdigit():
            got[" ".join(words[:-1])] = int(words[-1])
    return got


DEFRAG_PREFIX = "birchfs-defrag-"


def valid_codec(c: str) -> bool:
    """zstd, zstd:N or lz4: what `birch mount -o compress=` (DESIGN §16.9) and
    `birch defrag --compress=` (SEMANTICS §5b) take."""
    return c in ("lz4", "zstd") or (c.startswith("zstd:") and c[5:].isdigit())


def defrag_codecs(birch_defrag: list[str]) -> dict:
    """{target name: codec} of the --birch-defrag targets: birchfs-defrag-zstd1 for zstd:1."""
    return {DEFRAG_PREFIX + c.replace(":", ""): c for c in birch_defrag}


def birch_supports_defrag_compress(help_text: str) -> bool:
    """`birch defrag --help` names --compress (birch from a004aa5 on)."""
    return "--compress" in help_text


def tree_sha256(root: str) -> tuple[int, str]:
    """(files, sha256) of the tree under root, hashed as make_corpus hashes a corpus (each
    file's relative path, a NUL, its bytes, in list_files order): equal to the manifest's
    sha256 when the tree holds the corpus's bytes."""
    h = hashlib.sha256()
    files = list_files(root)
    for rel in files:
        h.update(rel.encode() + b"\0")
        with open(os.path.join(root, rel), "rb") as f:
            for chunk in iter(lambda: f.read(MiB), b""):
                h.update(chunk)
    return len(files), h.hexdigest()


def du_bytes(path: str) -> int | None:
    """`du -s -B1 PATH`: the allocated bytes (st_blocks) of the tree, as the filesystem reports
    them (btrfs reports a compressed extent's uncompressed size there)."""
    rc, out, _ = run(["du", "-s", "-B1", path], timeout=600)
    try:
        return int(out.split()[0]) if rc == 0 else None
    except (IndexError, ValueError):
        return None


def birch_supports_compress(help_text: str) -> bool:
    """Whether `birch mount --help` lists a compress= option (DESIGN §16.9), which today's
    birch does not: an unknown mount option is an error there."""
    return "compress=" in help_text


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


# --------------------------------------------------------------------------- targets

class CompressTarget(Target):
    """A birchbench Target with a fresh filesystem per measurement (`remake`) and btrfs's
    compress= option added to its mount.  `defrag`: the codec of a birchfs-defrag-X target
    (measure() rewrites the corpus with `birch defrag --compress=X -r` after the copy), else None."""

    defrag: str | None = None

    def remake(self) -> None:
        if self.is_birch:
            if not self.mkfs_birch():
                raise RuntimeError(self.error)
            return
        rc, out, err = run(["mkfs.btrfs", "-q", "-f", "-K", self.loop], timeout=600)
        if rc != 0:
            raise RuntimeError(f"mkfs.btrfs rc={rc}: {(err or out).strip()[-300:]}")

    def mount(self) -> str:
        if self.kind == "btrfs":
            self._mount_rec(self.mnt, False)
            opts = "nodiscard" + (f",{self.opts}" if self.opts else "")
            rc, _, err = run(["mount", "-t", "btrfs", "-o", opts, self.loop, self.mnt], timeout=120)
            if rc != 0 or not mounts.is_mounted(self.mnt):
                self.umount()
                raise RuntimeError(f"mount -o {opts} failed rc={rc}: {err.strip()[-300:]}")
            return self.mnt
        return super().mount()

    def sync(self, path: str, check: bool = False) -> None:
        """To durable.  btrfs: `sync -f` (syncfs(2)).  birch: `sync -f` writes the kernel's dirty
        pages back to the daemon (syncfs goes no further on FUSE), then the daemon's control
        command `sync` (the root's trusted.birch.control xattr), which commits everything it
        buffers.  Not `birch sync`: that is syncfs plus an fsync of the root directory, which
        finds nothing to do and commits nothing when the root itself did not change, leaving
        the data of files in subdirectories buffered (found here, 2026-12-03: a file written
        in a subdirectory after a `birch sync` is gone after a kill -9 of the daemon)."""
        if not self.is_birch:
            return super().sync(path, check)
        code = "import os,sys; os.setxattr(sys.argv[1], 'trusted.birch.control', b'sync')"
        for cmd in (["sync", "-f", self.mnt], [sys.executable, "-c", code, self.mnt]):
            rc, out, err = run(cmd, timeout=1800)
            if rc != 0 and check:
                raise RuntimeError(f"{' '.join(cmd)} rc={rc}: {(err or out).strip()[-300:]}")

    def daemon_pid(self) -> int | None:
        if not self.is_birch:
            return None
        pids = mounts.pids_with_arg(self.mnt)
        return pids[0] if pids else None


def plan_targets(birch_compress: list[str], birch_defrag: list[str] = ()) -> list[tuple[str, str, str | None]]:
    """The targets: the base ones, birchfs-X per --birch-compress X, birchfs-defrag-X per
    --birch-defrag X (default mount options; the defrag pass is measure()'s, see defrag_codecs)."""
    out = list(BASE_TARGETS)
    for c in birch_compress:
        out.append((f"birchfs-{c.replace(':', '')}", "birchfs", f"compress={c}"))
    for name in defrag_codecs(list(birch_defrag)):
        out.append((name, "birchfs", None))
    return out


# --------------------------------------------------------------------------- one measurement

def copy_in(man: dict, dst: str) -> None:
    src = man["dir"]
    for rel in list_files(src):
        s, t = os.path.join(src, rel), os.path.join(dst, rel)
        os.makedirs(os.path.dirname(t), exist_ok=True)
        with open(s, "rb") as fi, open(t, "wb") as fo:
            while True:
                buf = fi.read(MiB)
                if not buf:
                    break
                fo.write(buf)


def read_all(root: str) -> int:
    n = 0
    for rel in list_files(root):
        with open(os.path.join(root, rel), "rb", buffering=0) as f:
            while True:
                b = f.read(MiB)
                if not b:
                    break
                n += len(b)
    return n


def inline_bytes(root: str, limit: int = BIRCH_INLINE_MAX) -> int:
    """The bytes of the files under root of 1..limit bytes: those birch stores inline."""
    total = 0
    for rel in list_files(root):
        n = os.path.getsize(os.path.join(root, rel))
        if 0 < n <= limit:
            total += n
    return total


def warm_source(man: dict) -> None:
    """Read the corpus once so its copy reads the host's page cache, not the host's disk."""
    read_all(man["dir"])


def cold_mount(t: CompressTarget) -> str:
    """Unmount (birch: the daemon exits and its caches with it), drop the host's page cache,
    mount again."""
    err = t.umount()
    if err:
        raise RuntimeError(f"umount: {err}")
    drop_caches()
    return t.mount()


def fio_randread(path: str, seconds: int, out_path: str) -> dict:
    cmd = ["fio", "--name=randread", f"--filename={path}", "--rw=randread", "--bs=4k", "--direct=1",
           "--readonly", "--ioengine=psync", "--numjobs=1", "--time_based", f"--runtime={seconds}",
           "--output-format=json"]
    rc, out, err = run(cmd, timeout=seconds + 120)
    with open(out_path, "w") as f:
        f.write(out + err)
    if rc != 0:
        raise RuntimeError(f"fio rc={rc}: {(err or out).strip()[-300:]}")
    j = json.loads(out[out.index("{"):])
    rd = j["jobs"][0]["read"]
    return {"iops": rd["iops"], "lat_p50_us": rd.get("clat_ns", {}).get("percentile", {}).get("50.000000", 0) / 1000}


def measure(t: CompressTarget, man: dict, cfg, raw_dir: str, tag: str) -> dict:
    """Fresh filesystem; copy the corpus in and make it durable; stored bytes; cold read;
    fio random reads (corpus L).  Returns the figures."""
    r: dict = {"target": t.name, "corpus": man["name"], "logical_bytes": man["bytes"], "files": man["files"]}
    t.remake()
    mnt = t.mount()
    wd = os.path.join(mnt, "corpus")
    try:
        os.mkdir(wd)
        t.sync(mnt, check=True)
        warm_source(man)
        used0 = statfs_used(mnt)
        pid = t.daemon_pid()
        stats0 = t.read_stats() if t.is_birch else None
        d0 = proc_cpu_seconds(pid) if pid else None
        s0 = proc_sys_seconds()
        t0 = time.monotonic()
        copy_in(man, wd)
        t.sync(mnt, check=True)  # sync -f, then on birch the daemon's commit (CompressTarget.sync)
        dt = time.monotonic() - t0
        s1 = proc_sys_seconds()
        d1 = proc_cpu_seconds(pid) if pid else None
        stats1 = t.read_stats() if t.is_birch else None
        r["write_s"] = dt
        r["write_mibs"] = man["bytes"] / MiB / dt
        r["sys_cpu_s_per_gib_w"] = (s1 - s0) / (man["bytes"] / GiB)
        if d0 is not None and d1 is not None:
            r["daemon_cpu_s_per_gib_w"] = (d1 - d0) / (man["bytes"] / GiB)
        r["statfs_delta_bytes"] = statfs_used(mnt) - used0
        if t.is_birch:
            r["birch_counters_write"] = counter_delta(stats0, stats1)
        codec = getattr(t, "defrag", None)
        if codec:  # the second pass: rewrite every file compressed, then the daemon's commit
            r["defrag_codec"] = codec
            r["statfs_delta_plain_bytes"] = r["statfs_delta_bytes"]
            r["du_plain_bytes"] = du_bytes(wd)
            stats0 = t.read_stats()
            d0 = proc_cpu_seconds(pid) if pid else None
            s0 = proc_sys_seconds()
            t0 = time.monotonic()
            rc, out, err = run([t.birch, "defrag", f"--compress={codec}", "-r", wd], timeout=7200)
            with open(os.path.join(raw_dir, f"defrag__{tag}.txt"), "w") as f:
                f.write(out + err)
            if rc != 0:
                raise RuntimeError(f"birch defrag --compress={codec} -r rc={rc}: {(err or out).strip()[-300:]}")
            t.sync(mnt, check=True)
            dt = time.monotonic() - t0
            s1 = proc_sys_seconds()
            d1 = proc_cpu_seconds(pid) if pid else None
            r["defrag_s"] = dt
            r["defrag_mibs"] = man["bytes"] / MiB / dt
            r["sys_cpu_s_per_gib_defrag"] = (s1 - s0) / (man["bytes"] / GiB)
            if d0 is not None and d1 is not None:
                r["daemon_cpu_s_per_gib_defrag"] = (d1 - d0) / (man["bytes"] / GiB)
            r["birch_counters_defrag"] = counter_delta(stats0, t.read_stats())
            r["statfs_delta_bytes"] = statfs_used(mnt) - used0
        r["du_bytes"] = du_bytes(wd)
        if t.kind == "btrfs":
            rc, out, err = run(["compsize", "-b", wd], timeout=600)
            with open(os.path.join(raw_dir, f"compsize__{tag}.txt"), "w") as f:
                f.write(out + err)
            cs = parse_compsize(out)
            if cs is None:
                raise RuntimeError(f"compsize rc={rc}: {(err or out).strip()[-300:]}")
            r["stored_data_bytes"] = cs["disk"]
            r["compsize"] = cs
        # cold read: a new daemon, an empty host page cache
        if t.is_birch:
            err = t.umount()
            if err:
                raise RuntimeError(f"umount: {err}")
            rc, out, err = run([t.birch, "inspect", t.image, "space"], timeout=600)
            with open(os.path.join(raw_dir, f"inspect-space__{tag}.txt"), "w") as f:
                f.write(out + err)
            sp = parse_inspect_space(out)
            if rc != 0 or "data" not in sp:
                raise RuntimeError(f"birch inspect space rc={rc}: {(err or out).strip()[-300:]}")
            if codec:  # a defrag pass rewrote every extent: the image must check clean
                rc, out, err = run([t.birch, "fsck", t.image], timeout=1800)
                with open(os.path.join(raw_dir, f"fsck__{tag}.txt"), "w") as f:
                    f.write(out + err)
                if rc != 0:
                    raise RuntimeError(f"birch fsck after defrag rc={rc}: {(err or out).strip()[-500:]}")
            r["birch_inline_bytes"] = inline_bytes(man["dir"])
            r["stored_data_bytes"] = sp["data"] + r["birch_inline_bytes"]
            r["inspect_space"] = sp
            drop_caches()
            mnt = t.mount()
        else:
            mnt = cold_mount(t)
        wd = os.path.join(mnt, "corpus")
        pid = t.daemon_pid()
        d0 = proc_cpu_seconds(pid) if pid else None
        s0 = proc_sys_seconds()
        t0 = time.monotonic()
        n = read_all(wd)
        dt = time.monotonic() - t0
        s1 = proc_sys_seconds()
        d1 = proc_cpu_seconds(pid) if pid else None
        if n != man["bytes"]:
            raise RuntimeError(f"cold read returned {n} bytes, the corpus has {man['bytes']}")
        r["read_mibs"] = n / MiB / dt
        r["sys_cpu_s_per_gib_r"] = (s1 - s0) / (n / GiB)
        if d0 is not None and d1 is not None:
            r["daemon_cpu_s_per_gib_r"] = (d1 - d0) / (n / GiB)
        if codec:  # after the timed read: the rewritten files hold the corpus's bytes
            nf, sha = tree_sha256(wd)
            if (nf, sha) != (man["files"], man["sha256"]):
                raise RuntimeError(f"after birch defrag --compress={codec}: the tree reads back as {nf} files "
                                   f"sha256 {sha}, the corpus is {man['files']} files sha256 {man['sha256']}")
            r["verified"] = 1
        if man["name"] == "L" and cfg.fio_time > 0:
            mnt = cold_mount(t)
            stats0 = t.read_stats() if t.is_birch else None
            big = os.path.join(mnt, "corpus", man["largest"])
            fr = fio_randread(big, cfg.fio_time, os.path.join(raw_dir, f"fio-randread__{tag}.json"))
            stats1 = t.read_stats() if t.is_birch else None
            r["randread_iops"] = fr["iops"]
            # how much of the file the host's page cache holds after O_DIRECT random reads:
            # btrfs reads compressed extents through it (so its IOPS turn into the cache's)
            rc, out, _ = run(["fincore", "-b", "-n", "-o", "RES", big], timeout=60)
            if rc == 0 and out.strip().isdigit():
                r["randread_page_cache_pct"] = 100.0 * int(out.strip()) / man["largest_bytes"]
            r["randread_p50_us"] = fr["lat_p50_us"]
            if t.is_birch:
                c = counter_delta(stats0, stats1)
                h, m = c.get("cache_hits", 0), c.get("cache_misses", 0)
                r["randread_node_cache_hit_pct"] = 100.0 * h / (h + m) if h + m else None
    finally:
        t.umount()
    return r


# --------------------------------------------------------------------------- report

COLUMNS = [  # key, header, format
    ("logical_bytes", "logical MiB", lambda v: v / MiB),
    ("write_mibs", "write MiB/s", None),
    ("stored_data_bytes", "stored data MiB", lambda v: v / MiB),  # compsize / birch inspect space
    ("stored_pct", "stored/logical %", None),
    ("ratio", "ratio logical/stored", None),
    ("statfs_delta_bytes", "statfs Δ MiB", lambda v: v / MiB),
    ("du_bytes", "du MiB", lambda v: v / MiB),
    ("write_s", "copy s", None),
    ("statfs_delta_plain_bytes", "statfs Δ before defrag MiB", lambda v: v / MiB),
    ("defrag_s", "defrag s", None),
    ("defrag_mibs", "defrag MiB/s", None),
    ("daemon_cpu_s_per_gib_defrag", "daemon CPU s/GiB defrag", None),
    ("read_mibs", "cold read MiB/s", None),
    ("randread_iops", "4k randread IOPS", None),
    ("randread_page_cache_pct", "file in page cache after fio %", None),
    ("randread_node_cache_hit_pct", "randread node cache hit %", None),
    ("daemon_cpu_s_per_gib_w", "daemon CPU s/GiB w", None),
    ("sys_cpu_s_per_gib_w", "sys CPU s/GiB w", None),
    ("daemon_cpu_s_per_gib_r", "daemon CPU s/GiB r", None),
]
RATIOS = [("stored_data_bytes", "stored ×"), ("write_mibs", "write ×"), ("read_mibs", "read ×"),
          ("randread_iops", "IOPS ×")]


def medians(runs: list[dict]) -> dict:
    """{(corpus, target): {key: {median, min, max, n}}} over the repeats."""
    groups: dict = {}
    for r in runs:
        if "error" in r:
            continue
        g = groups.setdefault((r["corpus"], r["target"]), {})
        if r.get("stored_data_bytes") is not None and r.get("logical_bytes"):
            r["stored_pct"] = 100.0 * r["stored_data_bytes"] / r["logical_bytes"]
            if r["stored_data_bytes"]:
                r["ratio"] = r["logical_bytes"] / r["stored_data_bytes"]
        for k, v in r.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                g.setdefault(k, []).append(v)
    return {key: {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
                  for k, v in g.items()} for key, g in groups.items()}


def render(results: dict) -> str:
    meds = medians(results["runs"])
    targets = [t["name"] for t in results["targets"]]
    status = {t["name"]: t for t in results["targets"]}
    lines = [f"# Compression benchmark ({results['started']}{', quick' if results['config']['quick'] else ''})", ""]
    lines.append(f"Command: `{results['command']}`  ")
    lines.append(f"Repeats {results['config']['repeats']} (medians, with min–max after them when more than one), images "
                 f"{human(results['config']['image_size'])} each on {results['machine'].get('image_fs', '?')}, "
                 f"{results['machine'].get('cores')} cores, kernel {results['machine'].get('kernel')}.")
    lines.append("")
    for t in results["targets"]:
        if t["status"] != "ok":
            lines.append(f"- target **{t['name']}**: {t['status']}: {t['error']}")
    for cname in results["config"]["corpora"]:
        man = results["corpora"].get(cname)
        if not man:
            continue
        lines += ["", f"## {CORPUS_TITLES[cname]}", "",
                  f"{man['files']:,} file{'s' if man['files'] != 1 else ''}, {man['bytes'] / MiB:.1f} MiB (`{man['key']}`)", ""]
        cols = [c for c in COLUMNS if any(k[0] == cname and c[0] in v for k, v in meds.items())]
        ref = meds.get((cname, REF_TARGET), {})
        rats = [r for r in RATIOS if r[0] in ref]
        lines.append("| target | " + " | ".join(c[1] for c in cols) + "".join(
            f" | {h} {REF_TARGET}" for _, h in rats) + " |")
        lines.append("|---" * (1 + len(cols) + len(rats)) + "|")
        for tn in targets:
            st = status[tn]
            if st["status"] != "ok":
                lines.append(f"| {tn} | " + " | ".join([st["status"]] * (len(cols) + len(rats))) + " |")
                continue
            m = meds.get((cname, tn))
            errs = [r["error"] for r in results["runs"] if r["corpus"] == cname and r["target"] == tn and "error" in r]
            if not m:
                lines.append(f"| {tn} | " + " | ".join(["FAIL"] * (len(cols) + len(rats))) + " |")
                continue
            cells = []
            for key, _, conv in cols:
                f = m.get(key, {})
                v = f.get("median")
                if v is None:
                    cells.append("n/a (kernel)" if key.startswith("daemon_") and not key.endswith("_defrag")
                                 and not tn.startswith("birch") else "—")
                    continue
                cv = conv or (lambda x: x)
                cell = fmt_num(cv(v))
                if f["n"] > 1:  # the spread over the repeats
                    cell += f" ({fmt_num(cv(f['min']))}–{fmt_num(cv(f['max']))})"
                cells.append(cell)
            for key, _ in rats:
                v, rv = m.get(key, {}).get("median"), ref.get(key, {}).get("median")
                cells.append(f"{v / rv:.2f}" if v is not None and rv else "—")
            nruns = sum(1 for r in results["runs"] if r["corpus"] == cname and r["target"] == tn)
            failed = f" ({len(errs)} of {nruns} runs failed)" if errs else ""
            lines.append(f"| {tn}{failed} | " + " | ".join(cells) + " |")
    lines += ["", "Columns: *write MiB/s* the corpus copied in (1 MiB writes) until durable (`sync -f`; on birch "
              "then the daemon's commit, its control command `sync`, since syncfs(2) never reaches a FUSE daemon and "
              "`birch sync` commits nothing when the root directory did not change), over its logical size. "
              "*stored data* = data only: btrfs `compsize -b` (Disk Usage, its inline extents included), birch `birch inspect IMAGE "
              "space` (\"data\", each block once) plus the bytes of the files of at most 2048 bytes, which birch keeps inline. *statfs Δ* = used bytes after the sync minus before the copy, "
              "metadata included (btrfs keeps metadata twice, DUP, so its Δ has two copies of every tree block; "
              "birch one). *cold read*: birch unmounted (the daemon and its caches gone) and mounted again, btrfs "
              "unmounted and mounted, the host page cache dropped, then every file read in 1 MiB reads. "
              "*4k randread IOPS*: `fio --rw=randread --bs=4k --direct=1 --ioengine=psync` on the largest file of L, "
              "one job, after another cold restart (btrfs reads a compressed extent through the page cache even "
              "with O_DIRECT, so once the file is cached its IOPS are the page cache's); *file in page cache after fio %*: "
              "`fincore` of that file right after fio, the share of it the host's page cache then held; *randread node cache hit %*: "
              "birch's node cache (cache_hits/cache_misses counters) during fio (birch has no blob cache yet). *daemon CPU*: utime+stime of the birch daemon from /proc/PID/stat; btrfs's "
              "compression runs in kernel workers no process is charged for, hence n/a. *sys CPU*: system+irq+"
              "softirq from /proc/stat, the whole machine (other work on it counts too), for both. "
              "Ratios: this row's median over btrfs-zstd1's (stored × below 1 = fewer bytes stored). "
              "*ratio logical/stored*: logical over stored data. *du*: `du -s -B1` of the corpus after the sync (btrfs "
              "counts a compressed extent at its uncompressed size there). *copy s*: the seconds of the write MiB/s figure. "
              "birchfs-defrag-X rows (--birch-defrag X): the corpus written plainly (write MiB/s, copy s, *statfs Δ before "
              "defrag*), then `birch defrag --compress=X -r` of it and the daemon's commit (*defrag s*; *defrag MiB/s* over "
              "the logical bytes; daemon CPU of that pass); stored data, statfs Δ, du, the cold read and fio are after "
              "the defrag; `birch fsck` of the image and a sha256 of the tree read back checked each run."]
    fails = [r for r in results["runs"] if "error" in r]
    if fails:
        lines += ["", "## Failed runs", ""]
        for r in fails:
            lines.append(f"- {r['corpus']} / {r['target']} (repeat {r['repeat']}): {r['error']}")
    cnt = [r for r in results["runs"] if r.get("birch_counters_defrag")]
    if cnt:
        lines += ["", "## birch counters during the defrag pass (first repeat)", ""]
        seen = set()
        for r in cnt:
            if (r["corpus"], r["target"]) in seen:
                continue
            seen.add((r["corpus"], r["target"]))
            c = r["birch_counters_defrag"]
            keep = {k: c[k] for k in ("bytes_written", "nodes_written", "commits", "device_writes",
                                      "free_bytes") if k in c}
            lines.append(f"- {r['corpus']} / {r['target']}: " + ", ".join(f"{k} {fmt_num(v)}" for k, v in keep.items()))
    cnt = [r for r in results["runs"] if r.get("birch_counters_write")]
    if cnt:
        lines += ["", "## birch counters during the copy (first repeat)", ""]
        seen = set()
        for r in cnt:
            if (r["corpus"], r["target"]) in seen:
                continue
            seen.add((r["corpus"], r["target"]))
            c = r["birch_counters_write"]
            keep = {k: c[k] for k in ("bytes_written", "nodes_written", "commits", "device_writes",
                                      "buffer_flushes", "free_bytes") if k in c}
            lines.append(f"- {r['corpus']} / {r['target']}: " + ", ".join(f"{k} {fmt_num(v)}" for k, v in keep.items()))
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- command line

def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="compress.sh", description="birchfs against btrfs with compression: stored bytes, write to durable, "
        "cold read, random 4 KiB reads, CPU (issue 37; docs/BENCHMARKS.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small corpora and images: a smoke run of a minute or two")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan (corpora, targets, order) and check the options; no root, no mounts")
    ap.add_argument("--corpora", type=lambda s: [x.upper() for x in str_list(s)], default=list(CORPORA),
                    help="comma list of L,S,R")
    ap.add_argument("--targets", type=str_list, default=None,
                    help="comma list of " + ",".join(n for n, _, _ in BASE_TARGETS) + " [all], plus birchfs-X of --birch-compress "
                    "and birchfs-defrag-X of --birch-defrag")
    ap.add_argument("--birch-compress", type=str_list, default=str_list(os.environ.get("BIRCH_COMPRESS", "")),
                    metavar="ALGS", help="add a birchfs target mounted -o compress=X per X (zstd:1, lz4; env "
                    "BIRCH_COMPRESS); refused when `birch mount --help` names no compress= option")
    ap.add_argument("--birch-defrag", type=str_list, default=str_list(os.environ.get("BIRCH_DEFRAG", "")),
                    metavar="CODECS", help="add a birchfs-defrag-X target per X (zstd, zstd:N, lz4; env BIRCH_DEFRAG): "
                    "the corpus written plainly, then `birch defrag --compress=X -r` of it, timed on its own")
    ap.add_argument("--birch", default=os.environ.get("BIRCH", "target/release/birch"),
                    help="birch binary (env BIRCH); relative paths from the repo root")
    ap.add_argument("--image-dir", default=os.environ.get("BIRCHBENCH_COMPRESS_DIR", "/var/tmp/birchbench-compress"),
                    help="images, mount points and the corpus cache (env BIRCHBENCH_COMPRESS_DIR)")
    ap.add_argument("--image-size", type=parse_size, default=None, help="every target's image [6G; quick 512M]")
    ap.add_argument("--out", default=None, help="output dir [bench/results/compress-DATE; quick IMAGE_DIR/results/DATE-quick]")
    ap.add_argument("--repeats", type=int, default=1, help="repeats, interleaved (aims tighter than 20%% need 3)")
    ap.add_argument("--seed", type=int, default=37)
    ap.add_argument("--log-size", type=parse_size, default=None, help="L's log file [512M; quick 16M]")
    ap.add_argument("--db-size", type=parse_size, default=None, help="L's SQLite file [256M; quick 8M]")
    ap.add_argument("--vm-size", type=parse_size, default=None, help="L's VM-image-like file [1G; quick 32M]")
    ap.add_argument("--random-size", type=parse_size, default=None, help="R's file [512M; quick 16M]")
    ap.add_argument("--files", type=int, default=None, help="S: files of the W6 tree [10000; quick 1000]")
    ap.add_argument("--fio-time", type=int, default=None, help="seconds of random reads on L (0: none) [30; quick 3]")
    ap.add_argument("--cleanup", action="store_true", help="undo mounts/loop devices a killed run left, then exit")
    return ap


def apply_defaults(cfg) -> None:
    q = cfg.quick

    def d(name, full, quick):
        if getattr(cfg, name) is None:
            setattr(cfg, name, quick if q else full)
    d("image_size", 6 * GiB, 512 * MiB)
    d("log_size", 512 * MiB, 16 * MiB)
    d("db_size", 256 * MiB, 8 * MiB)
    d("vm_size", 1 * GiB, 32 * MiB)
    d("random_size", 512 * MiB, 16 * MiB)
    d("files", 10000, 1000)
    d("fio_time", 30, 3)
    if not os.path.isabs(cfg.birch):
        cfg.birch = os.path.join(REPO, cfg.birch)
    cfg.birch_before = None
    bad = [c for c in cfg.corpora if c not in CORPORA]
    if bad:
        raise SystemExit(f"--corpora: unknown {','.join(bad)} (L, S, R)")
    for c in cfg.birch_compress:
        if not valid_codec(c):
            raise SystemExit(f"--birch-compress: {c!r} is not zstd[:N] or lz4")
    for c in cfg.birch_defrag:
        if not valid_codec(c):
            raise SystemExit(f"--birch-defrag: {c!r} is not zstd[:N] or lz4")
    if len(set(defrag_codecs(cfg.birch_defrag))) != len(cfg.birch_defrag):
        raise SystemExit(f"--birch-defrag: {','.join(cfg.birch_defrag)} names a codec twice")
    names = [n for n, _, _ in plan_targets(cfg.birch_compress, cfg.birch_defrag)]
    if cfg.targets is None:
        cfg.targets = names
    else:
        bad = [t for t in cfg.targets if t not in names]
        if bad:
            raise SystemExit(f"--targets: unknown {','.join(bad)} (known: {','.join(names)})")
    need = cfg.log_size + cfg.db_size + cfg.vm_size if "L" in cfg.corpora else 0
    need = max(need, cfg.random_size if "R" in cfg.corpora else 0)
    if need * 1.25 + 64 * MiB > cfg.image_size:
        raise SystemExit(f"--image-size {human(cfg.image_size)} is too small for a corpus of "
                         f"{need / MiB:.0f} MiB stored uncompressed (needs ~1.25x + 64 MiB)")


def check_birch_compress(cfg) -> str | None:
    """Why the --birch-compress targets cannot run, or None."""
    if not cfg.birch_compress:
        return None
    if not os.access(cfg.birch, os.X_OK):
        return f"--birch-compress needs the birch binary, not found at {cfg.birch}"
    rc, out, err = run([cfg.birch, "mount", "--help"], timeout=30)
    if not birch_supports_compress(out + err):
        return (f"--birch-compress {','.join(cfg.birch_compress)}: {cfg.birch} has no compress= mount option yet "
                f"(issue 37; `birch mount --help` lists none, and an unknown option is an error): refused")
    return None


def check_birch_defrag(cfg) -> str | None:
    """Why the --birch-defrag targets cannot run, or None."""
    if not cfg.birch_defrag:
        return None
    if not os.access(cfg.birch, os.X_OK):
        return f"--birch-defrag needs the birch binary, not found at {cfg.birch}"
    rc, out, err = run([cfg.birch, "defrag", "--help"], timeout=30)
    if not birch_supports_defrag_compress(out + err):
        return (f"--birch-defrag {','.join(cfg.birch_defrag)}: `{cfg.birch} defrag --help` names no --compress "
                f"(birch before a004aa5?): refused")
    return None


def sizes_of(cfg) -> dict:
    return {"log": cfg.log_size, "db": cfg.db_size, "vm": cfg.vm_size, "random": cfg.random_size, "files": cfg.files}


def main(argv=None) -> int:
    ap = make_parser()
    cfg = ap.parse_args(argv)
    state_path = os.path.join(cfg.image_dir, "state.json")
    if cfg.cleanup:
        st = mounts.State(state_path)
        for line in mounts.cleanup_from(st.load(), None):
            print(line)
        try:
            os.unlink(state_path)
        except OSError:
            pass
        return 0
    apply_defaults(cfg)
    why = check_birch_compress(cfg) or check_birch_defrag(cfg)
    if why:
        print(f"compress: {why}", file=sys.stderr)
        return 2
    plan = [p for p in plan_targets(cfg.birch_compress, cfg.birch_defrag) if p[0] in cfg.targets]
    codecs = defrag_codecs(cfg.birch_defrag)
    sizes = sizes_of(cfg)
    if cfg.dry_run:
        print(f"image dir {cfg.image_dir}, images {human(cfg.image_size)} each, repeats {cfg.repeats}")
        for c in cfg.corpora:
            print(f"corpus {c}: {corpus_key(c, sizes, cfg.seed)}")
        for name, kind, opts in plan:
            print(f"target {name}: {kind}" + (f" -o {opts}" if opts else "")
                  + (f", then birch defrag --compress={codecs[name]} -r" if name in codecs else ""))
        for rep in range(cfg.repeats):
            for c in cfg.corpora:
                print(f"run: repeat {rep + 1} corpus {c}: " + " ".join(n for n, _, _ in plan))
        return 0
    if os.geteuid() != 0:
        print("compress: needs root (loop devices, mounts, drop_caches): run bench/compress.sh with sudo", file=sys.stderr)
        return 2
    os.makedirs(cfg.image_dir, exist_ok=True)
    lock = open(os.path.join(cfg.image_dir, "lock"), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        print(f"compress: another run holds {cfg.image_dir}/lock (or use --image-dir)", file=sys.stderr)
        return 2
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    out = cfg.out or (os.path.join(cfg.image_dir, "results", stamp + "-quick") if cfg.quick
                      else os.path.join(REPO, "bench", "results", "compress-" + stamp))
    raw_dir = os.path.join(out, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    old = mounts.State(state_path).load()
    if old.get("mounts") or old.get("loops"):
        for line in mounts.cleanup_from(old, cfg.birch):
            log(f"cleanup of an earlier run: {line}")
    mounts.STATE = mounts.State(state_path)
    mounts.STATE.save()
    rc_fs, fs_out, _ = run(["findmnt", "-n", "-o", "FSTYPE,SOURCE", "--target", cfg.image_dir], timeout=10)
    env = " ".join(f"{k}={os.environ[k]}" for k in ("BIRCH_COMPRESS", "BIRCH_DEFRAG") if os.environ.get(k))
    results = {"started": stamp, "command": (env + " " if env else "") + "bench/compress.sh "
               + " ".join(sys.argv[1:] if argv is None else argv),
               "config": {k: v for k, v in vars(cfg).items() if isinstance(v, (int, str, list, bool, type(None)))},
               "machine": {"cores": os.cpu_count(), "kernel": platform.release(),
                           "image_fs": " ".join(fs_out.split()) if rc_fs == 0 else "?"},
               "corpora": {}, "targets": [], "runs": []}
    t_start = time.time()
    targets: list[CompressTarget] = []
    try:
        for c in cfg.corpora:
            results["corpora"][c] = make_corpus(c, os.path.join(cfg.image_dir, "corpus"), sizes, cfg.seed)
        for name, kind, opts in plan:
            t = CompressTarget(name, kind, cfg, opts)
            t.defrag = codecs.get(name)
            t.setup()
            targets.append(t)
        for rep in range(cfg.repeats):
            for c in cfg.corpora:
                man = results["corpora"][c]
                for t in targets:
                    if t.status != "ok":
                        continue
                    tag = f"{c}__{t.safe}__r{rep + 1}"
                    log(f"repeat {rep + 1}/{cfg.repeats} corpus {c} target {t.name}")
                    try:
                        r = measure(t, man, cfg, raw_dir, tag)
                        log("  " + ", ".join(f"{k} {fmt_num(v)}" for k, v in r.items()
                                             if k in ("write_mibs", "defrag_mibs", "stored_data_bytes", "statfs_delta_bytes",
                                                      "read_mibs", "randread_iops")))
                    except Exception as e:  # noqa: BLE001 - a failed run is a result
                        r = {"target": t.name, "corpus": c, "error": str(e)[-500:]}
                        log(f"  FAILED: {e}")
                    r["repeat"] = rep + 1
                    results["runs"].append(r)
    finally:
        for t in targets:
            t.teardown()
            results["targets"].append({"name": t.name, "kind": t.kind, "opts": t.opts, "defrag": t.defrag, "status": t.status,
                                       "error": t.error, "meta": t.meta})
        mounts.STATE.save()
    results["seconds"] = round(time.time() - t_start, 1)
    results["medians"] = {f"{c}/{t}": v for (c, t), v in medians(results["runs"]).items()}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    md = render(results)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(md)
    print(md)
    log(f"done in {results['seconds']:.0f}s: {out}/summary.md, results.json, raw/")
    ok_runs = [r for r in results["runs"] if "error" not in r]
    if cfg.quick:  # the smoke check: every target that was set up produced numbers for every corpus
        missing = [(c, t.name) for c in cfg.corpora for t in targets if t.status == "ok"
                   and not any(r["corpus"] == c and r["target"] == t.name for r in ok_runs)]
        bad_setup = [t.name for t in targets if t.status == "failed"]
        if missing or bad_setup:
            log(f"quick check FAILED: no numbers for {missing}, failed targets {bad_setup}")
            return 1
        log("quick check passed: every target produced numbers for every corpus")
    return 0
