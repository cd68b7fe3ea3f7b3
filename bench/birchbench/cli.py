"""The command line and the run: options, defaults, the lock, detaching, the interleaved loop.

Owns: every option and its default (`make_parser`, `apply_defaults`: the full and the
--quick sizes), the dispatch of the child modes (--_w5, --_w6, --_mdcr), --report, --cleanup,
the image directory's lock and state file (mounts.STATE), --detach, the output directory and
run.log (common.LOG), the machine description, the plan (repeat x case x target, interleaved)
and its loop (mount, run, counters, unmount per run), signal handling and the final cleanup,
then results.json, summary.md and the charts through report.py.

Must not touch: how a target mounts (targets.py), what a workload runs (workloads.py), how
the report looks (report.py).  Option names, defaults and the output directory layout are the
harness's interface (bench/run.sh, scripts/test.sh, docs/BENCHMARKS.md): keep them.
"""
from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import platform
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time

from . import common, mounts
from .common import ALL_TARGETS, OPTIONAL_TARGETS, ENTRY, HERE, REPO, Log, fmt_num, int_list, log, parse_size, str_list
from .mounts import State, cleanup_from, kill_active, run
from .report import (before_after, before_after_table, counter_delta, do_check, rerender, summarize,
                     write_charts, write_markdown)
from .targets import allow_fuse_uring, RbdCluster, Target
from .workloads import WL_TITLES, build_cases, build_mdcr, mdcr_py, w5_child, w6_assets, w6_child

# the first paragraph of bench/birchbench.py's docstring: --help's description
DESCRIPTION = "birchbench: birchfs against the kernel filesystems, side by side."


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
        prog="birchbench", description=DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes, one repeat, ~2 s per run; then check every target produced numbers")
    ap.add_argument("--targets", type=str_list, default=ALL_TARGETS,
                    help="comma list of " + ",".join(ALL_TARGETS) + " (the default), and " + ",".join(OPTIONAL_TARGETS))
    ap.add_argument("--workloads", type=lambda s: [x.upper() for x in str_list(s)],
                    default=["W1", "W2", "W3", "W4", "W5", "W6"], help="comma list of W1..W6")
    ap.add_argument("--birch-opts", action="append", default=[], metavar="OPTS",
                    help="extra birchfs target mounted with -o OPTS (repeatable); the seeds' before "
                         "switches (bench_*) need a birch built with the seed-before feature, which "
                         "bench/run.sh builds and uses when one is named")
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
    g = ap.add_argument_group("birchfs-rbd (birch on a Ceph RBD image)")
    g.add_argument("--rbd-birch", metavar="PATH", default=None,
                   help="birch built with --features rbd [--birch]")
    g.add_argument("--rbd-conf", metavar="CEPH_CONF", default=None,
                   help="ceph.conf of an existing cluster [bring up tests/rbd/single-node.sh under IMAGE_DIR/ceph]")
    g.add_argument("--rbd-pool", default="rbd", help="pool for the image birchbench-birchfs-rbd [rbd]")
    g.add_argument("--rbd-opts", metavar="OPTS", default=None,
                   help="mount options for birchfs-rbd (ceph_id=, keyring=, ...)")
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
    bad = [t for t in cfg.targets if t not in ALL_TARGETS + OPTIONAL_TARGETS]
    if bad:
        raise SystemExit(f"unknown targets {bad}; choose from {ALL_TARGETS + OPTIONAL_TARGETS}")
    if cfg.rbd_birch is not None:
        rb = cfg.rbd_birch if os.path.isabs(cfg.rbd_birch) else os.path.abspath(cfg.rbd_birch)
        if not (os.path.isfile(rb) and os.access(rb, os.X_OK)):
            raise SystemExit(f"--rbd-birch: no executable birch binary at {rb}")
        cfg.rbd_birch = rb
    badw = [w for w in cfg.workloads if w not in WL_TITLES]
    if badw:
        raise SystemExit(f"unknown workloads {badw}")


def full_cleanup(birch: str | None) -> None:
    kill_active()
    state = mounts.STATE
    if state is None:
        return
    for line in cleanup_from(state.data, birch):
        log(f"cleanup: {line}")
    state.data["mounts"] = []
    state.data["loops"] = []
    state.data["groups"] = []
    state.save()


def make_targets(cfg) -> list[Target]:
    """The targets of a run, in --targets order: birchfs brings birchfs-before (--birch-before)
    and one birchfs[OPTS] per --birch-opts beside it; memfs_ll-uring is memfs_ll over FUSE over
    io_uring."""
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
        elif name == "memfs_ll-uring":
            targets.append(Target(name, "memfs_ll", cfg, opts="io_uring"))
        elif name == "birchfs-rbd":
            targets.append(Target("birchfs-rbd", "birchfs", cfg, opts=cfg.rbd_opts, rbd=True))
        else:
            targets.append(Target(name, name, cfg))
    return targets


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
    lockf = open(os.path.join(cfg.image_dir, "lock"), "w")
    try:
        fcntl.flock(lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"another birchbench run holds {cfg.image_dir}/lock", file=sys.stderr)
        return 2
    mounts.STATE = state = State(os.path.join(cfg.image_dir, "state.json"))
    leftover = state.load()
    if leftover.get("mounts") or leftover.get("loops") or leftover.get("groups"):
        for line in cleanup_from(leftover, cfg.birch if os.path.isabs(cfg.birch) else os.path.join(REPO, cfg.birch)):
            print(f"cleanup of an earlier run: {line}", flush=True)
    state.save()
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
            p = subprocess.Popen([sys.executable, ENTRY] + args, stdin=subprocess.DEVNULL,
                                 stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=os.getcwd())
        print(f"birchbench running detached, pid {p.pid}")
        print(f"log: {logpath}")
        print(f"results: {out}/summary.md (when done); follow with: tail -f {logpath}")
        return 0

    common.LOG = Log(logpath, detached_child)
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
    targets = make_targets(cfg)
    if any(t.is_fuse for t in targets):
        log(f"FUSE over io_uring: {allow_fuse_uring()}")
    cases = build_cases(cfg)
    cluster = None
    runs: list[dict] = []
    interrupted = False
    res = {}
    rc_final = 0
    try:
        cfg.mdcr = build_mdcr(cfg) if "W3" in cfg.workloads else None
        cfg.w6 = w6_assets(cfg) if "W6" in cfg.workloads else None
        meta_machine = machine_info(cfg.image_dir)
        if any(t.rbd for t in targets):
            cluster = RbdCluster(cfg)
            why = cluster.start()
            if why:
                for t in targets:
                    if t.rbd:
                        t.fail(why, "skipped")
        for t in targets:
            if t.status == "pending":
                t.setup()
                if t.rbd and t.status == "ok" and cluster is not None:
                    t.meta.update(cluster.floor(t))
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
                    common.LOG.status(f"{current['text']} | run {time.time() - current['t0']:.0f}s | "
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
            common.LOG.status(current["text"])
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
        common.LOG.clear_status()
    except KeyboardInterrupt as e:
        interrupted = True
        common.LOG.clear_status()
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
        if cluster is not None:
            cluster.stop()
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
