"""Workloads: what runs on a mounted target, and what it measures.

Owns: the cases of W1-W6 (`build_cases`: ids, titles, parameters, metrics and which get a
ratio column), each workload's runner (dbench, fio, mdcr, sysbench, the W5 append+fsync child,
W6 everyday work with its deterministic tree and git repository), the child entry points the
harness script dispatches (`w5_child`, `w6_child`, `mdcr_py` behind --_w5, --_w6, --_mdcr), the
raw output files under OUT/raw/, and building bench/mdcr.c.

Must not touch: mounting, unmounting or cleaning up (a runner gets a working directory on a
mounted target, or the raw device, and may ask the target to sync); results across runs, the
report, the command line.  Case ids, metric keys and raw file names are part of results.json
and the report: changing one changes both.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
import time

from .common import ENTRY, HERE, fail_text, log
from .mounts import run


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
    cmd = [sys.executable, ENTRY, "--_w5", path, "raw" if raw else "append",
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
        out = cmd(what, [sys.executable, ENTRY, "--_w6", *map(str, args)])
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
                return [sys.executable, ENTRY, "--_mdcr"]
        return [binp]
    log("no C compiler: W3 uses the Python fallback of mdcr")
    return [sys.executable, ENTRY, "--_mdcr"]


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
