#!/usr/bin/env python3
"""summarize.py RESULTS.json... : markdown table of min / median / max per config and work."""
import json, statistics, sys

recs = []
for p in sys.argv[1:]:
    recs += [r for r in json.load(open(p)) if r["work"] != "log"]

KEY = {"fstat": ("us_per_call", "µs/call", 200000),
       "create-1t": ("creates_per_s", "creates/s", 20000 * 1),
       "create-2t": ("creates_per_s", "creates/s", 20000 * 2),
       "write4k-1t": ("mib_per_s", "MiB/s", 64 * 256),
       "write4k-2t": ("mib_per_s", "MiB/s", 2 * 32 * 256)}
CONFIGS = ["classic-2", "classic-32", "uring"]


def fmt(v):
    return f"{v:,.1f}" if v < 1000 else f"{v:,.0f}"


print("| work | unit | " + " | ".join(f"{c} min / median / max" for c in CONFIGS) + " | uring ÷ classic-2 (medians) |")
print("|---|---|" + "---|" * len(CONFIGS) + "---|")
for work, (key, unit, nops) in KEY.items():
    cells, med = [], {}
    for c in CONFIGS:
        v = sorted(r["result"][key] for r in recs if r["config"] == c and r["work"] == work)
        if not v:
            cells.append("—")
            continue
        med[c] = statistics.median(v)
        cells.append(f"{fmt(v[0])} / {fmt(med[c])} / {fmt(v[-1])} (n={len(v)})")
    ratio = med.get("uring", 0) / med["classic-2"] if med.get("classic-2") else 0
    print(f"| {work} | {unit} | " + " | ".join(cells) + f" | {ratio:.2f} |")

print()
print("CPU per operation, medians (µs): server process (all its threads: transport, birch-core,")
print("committer) / the benchmark client (user+sys, includes the kernel's FUSE send path).")
print("fstat: per fstat; create: per file (create + close + unlink, mdcr's both phases);")
print("write: per 4 KiB write.")
print()
print("| work | " + " | ".join(f"{c} server / client" for c in CONFIGS) + " |")
print("|---|" + "---|" * len(CONFIGS))
for work, (key, unit, nops) in KEY.items():
    cells = []
    for c in CONFIGS:
        rs = [r for r in recs if r["config"] == c and r["work"] == work]
        if not rs:
            cells.append("—")
            continue
        s = statistics.median(r["server_cpu_s"] for r in rs) * 1e6 / nops
        k = statistics.median(r["client_cpu_s"] for r in rs) * 1e6 / nops
        cells.append(f"{s:.1f} / {k:.1f}")
    print(f"| {work} | " + " | ".join(cells) + " |")
