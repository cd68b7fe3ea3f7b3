"""Results and reports: medians, ratios, before/after, summary.md, the charts, the check.

Owns: the per-run counter deltas, the summary of every (case, target) cell (medians, min,
max), the birchfs/peer ratios, the before/after lines and table, summary.md (its layout, its
tables and their cells), the PNG charts (matplotlib, optional), the --quick/--check verdict
and --report (writing summary.md and the charts again from a results.json).

Must not touch: targets or mounts (it reads a target's name, kind, status, error and meta,
never mounts or unmounts), the workloads' runners, the command line.  The report's file
names (summary.md, results.json, wN_throughput.png, wN_times.png, wN_latency.png) and
layout are what docs/BENCHMARKS.md and bench/reference/ quote: keep them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from .common import KERNEL_KINDS, fmt_num, human, log
from .targets import Target
from .workloads import WL_TITLES, build_cases


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
        det = t.error or ", ".join(f"{k}={v}" for k, v in t.meta.items() if k in ("loop", "loop_dio", "loop_discard", "image_allocated_pct", "image_allocated_pct_end", "version",
                                                                               "image", "librbd_4k_write_us", "librbd_4k_write_flush_p50_ms",
                                                                               "rbd_bench_64k_seq_mibs"))
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
