#!/usr/bin/env python3
"""paired.py RESULTS.json...: per repeat, uring vs classic-2 and vs classic-32 in the same repeat
(the configs of one repeat ran back to back); min / median / max of the ratios (>1 = uring better)."""
import json, statistics, sys
KEY = {"fstat": "us_per_call", "create-1t": "creates_per_s", "create-2t": "creates_per_s",
       "write4k-1t": "mib_per_s", "write4k-2t": "mib_per_s"}
for p in sys.argv[1:]:
    recs = [r for r in json.load(open(p)) if r["work"] != "log"]
    print(f"{p}:")
    for work, key in KEY.items():
        out = []
        for base in ("classic-2", "classic-32"):
            rs = []
            for rep in sorted({r["rep"] for r in recs}):
                v = {r["config"]: r["result"][key] for r in recs if r["rep"] == rep and r["work"] == work}
                if "uring" in v and base in v:
                    rs.append(v[base] / v["uring"] if work == "fstat" else v["uring"] / v[base])
            rs.sort()
            out.append(f"vs {base}: {rs[0]:.2f} / {statistics.median(rs):.2f} / {rs[-1]:.2f}")
        print(f"  {work:11s} " + "   ".join(out))
