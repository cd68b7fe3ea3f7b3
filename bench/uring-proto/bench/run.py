#!/usr/bin/env python3
"""Interleaved classic vs io_uring measurement of the proto-uring server.

usage: run.py REPS OUT.json
Needs root. Sets /sys/module/fuse/parameters/enable_uring to 1 while it runs and restores the
original value at the end (also on error).
"""
import json, os, resource, subprocess, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRV = f"{ROOT}/target/release/proto-uring"
BIN = f"{ROOT}/bin"
IMG = os.environ.get("PU_IMG", "/var/tmp/pu/img")
MNT = "/tmp/pu-mnt"
PARAM = "/sys/module/fuse/parameters/enable_uring"
HZ = os.sysconf("SC_CLK_TCK")

CONFIGS = {
    # name: (transport, classic threads)
    "classic-2": ("classic", 2),
    "classic-32": ("classic", 32),
    "uring": ("uring", 2),
}

WORK = [
    ("fstat", [f"{BIN}/fstatbench", f"{MNT}/f", "200000"]),
    ("create-1t", [f"{BIN}/mdcr", MNT, "1", "20000"]),
    ("create-2t", [f"{BIN}/mdcr", MNT, "2", "20000"]),
    ("write4k-1t", [f"{BIN}/writebench", MNT, "1", "64", "4096"]),
    ("write4k-2t", [f"{BIN}/writebench", MNT, "2", "32", "4096"]),
]


def proc_cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / HZ  # utime + stime


def sys_busy():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return (sum(v) - idle) / HZ, sum(v) / HZ


def mounted():
    with open("/proc/mounts") as f:
        return any(l.split()[1] == MNT for l in f)


def run_config(name, rep, results):
    transport, threads = CONFIGS[name]
    subprocess.run([SRV, "mkfs", IMG, "4096"], check=True)
    log = open(f"/tmp/pu-{name}-{rep}.log", "w")
    srv = subprocess.Popen([SRV, "serve", IMG, MNT, transport, str(threads), "8", "0"],
                           stderr=log, stdout=log)
    for _ in range(200):
        if mounted():
            break
        time.sleep(0.02)
    else:
        raise SystemExit(f"{name}: no mount")
    os.stat(MNT)
    time.sleep(0.3)
    for wname, cmd in WORK:
        c0 = proc_cpu(srv.pid)
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        b0, t0 = sys_busy()
        w0 = time.monotonic()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        w1 = time.monotonic()
        b1, t1 = sys_busy()
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        c1 = proc_cpu(srv.pid)
        if out.returncode != 0:
            print(f"{name} {wname}: failed: {out.stdout} {out.stderr}", file=sys.stderr)
        j = json.loads(out.stdout.strip().splitlines()[-1])
        rec = {
            "config": name, "rep": rep, "work": wname, "result": j, "wall_s": w1 - w0,
            "server_cpu_s": c1 - c0,
            "client_cpu_s": (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime),
            "system_busy_s": b1 - b0, "system_total_s": t1 - t0,
            "loadavg": open("/proc/loadavg").read().split()[0],
        }
        results.append(rec)
        key = {"fstat": "us_per_call", "create-1t": "creates_per_s", "create-2t": "creates_per_s",
               "write4k-1t": "mib_per_s", "write4k-2t": "mib_per_s"}[wname]
        print(f"rep {rep} {name:10s} {wname:11s} {j[key]:>10} srv_cpu {rec['server_cpu_s']:.2f}s "
              f"cli_cpu {rec['client_cpu_s']:.2f}s busy {rec['system_busy_s']:.2f}/{rec['system_total_s']:.2f}s load {rec['loadavg']}",
              flush=True)
    subprocess.run(["umount", MNT], check=True)
    srv.wait(timeout=60)
    log.close()
    served = open(f"/tmp/pu-{name}-{rep}.log").read().strip().splitlines()
    print(f"rep {rep} {name}: {served[1]} | {served[-1]}", flush=True)
    results.append({"config": name, "rep": rep, "work": "log", "log": served})


def main():
    reps = int(sys.argv[1])
    out = sys.argv[2]
    os.makedirs(os.path.dirname(IMG), exist_ok=True)
    os.makedirs(MNT, exist_ok=True)
    orig = open(PARAM).read().strip()
    saved = f"{ROOT}/enable_uring.orig"  # value found before this prototype first touched it
    if os.path.exists(saved):
        orig = open(saved).read().strip().split("=")[1]
    results = []
    try:
        with open(PARAM, "w") as f:
            f.write("1")
        names = list(CONFIGS)
        for rep in range(reps):
            order = names if rep % 2 == 0 else list(reversed(names))
            for name in order:
                run_config(name, rep, results)
                with open(out, "w") as f:
                    json.dump(results, f, indent=1)
    finally:
        if mounted():
            subprocess.run(["umount", "-l", MNT])
        with open(PARAM, "w") as f:
            f.write("1" if orig in ("Y", "1") else "0")
        print(f"enable_uring restored to {open(PARAM).read().strip()} (was {orig})", flush=True)


if __name__ == "__main__":
    main()
