"""birchbench's results and report without mounts: number formats, medians, ratios, the
before/after lines, the tables of summary.md, counter deltas and the --quick check, on
made-up runs of made-up targets.

Run: python3 -m unittest discover bench/tests (no root, no mounts)."""
import argparse
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.dont_write_bytecode = True

from birchbench import common, report  # noqa: E402
from birchbench.targets import Target  # noqa: E402
from birchbench.workloads import Case, Metric  # noqa: E402


class QuietLog(common.Log):
    """The harness's log prints every line: keep the test output clean."""

    def __init__(self):
        super().__init__(None, True)
        self.lines = []

    def line(self, msg):
        self.lines.append(msg)


def quiet():
    common.LOG = QuietLog()
    return common.LOG


def setup_run(tmp):
    cfg = argparse.Namespace(image_dir=tmp, birch="/opt/birch", birch_before=None)
    cases = [
        Case("w1-dbench-8", "W1", "dbench 8 clients", "8cl", [
            Metric("mbps", "MB/s", "", "tp", ratio=True),
            Metric("max_lat_ms", "max lat", "ms", "lat", maxlat=True)], None, {"clients": 8, "time": 30}),
        Case("w5-fsync", "W5", "append 4 KiB + fsync (raw: write + flush)", "fsync", [
            Metric("ops_per_s", "ops/s", "", "tp"),
            Metric("p50_ms", "p50", "ms", "lat", ratio=True)], None, {"time": 15}, raw_ok=True),
    ]
    targets = [Target("ext4", "ext4", cfg), Target("raw", "raw", cfg), Target("birchfs", "birchfs", cfg)]
    for t in targets:
        t.status = "ok"
    runs = []

    def add(case, target, rep, **metrics):
        runs.append({"case": case, "target": target, "rep": rep, "ok": bool(metrics), "metrics": metrics,
                     "error": None if metrics else "boom", "mounted": True})
    add("w1-dbench-8", "ext4", 1, mbps=100.0, max_lat_ms=10.0)
    add("w1-dbench-8", "ext4", 2, mbps=200.0, max_lat_ms=30.0)
    add("w1-dbench-8", "birchfs", 1, mbps=75.0, max_lat_ms=40.0)
    add("w1-dbench-8", "birchfs", 2, mbps=75.0, max_lat_ms=20.0)
    add("w5-fsync", "ext4", 1, ops_per_s=1000.0, p50_ms=0.5)
    add("w5-fsync", "raw", 1, ops_per_s=2000.0, p50_ms=0.25)
    add("w5-fsync", "birchfs", 1)  # a failed run
    return cfg, cases, targets, runs


class Numbers(unittest.TestCase):
    def test_ratio(self):
        self.assertEqual(report.ratio(1, 2), 0.5)
        self.assertEqual(report.ratio(3.0, 1.5), 2.0)
        self.assertIsNone(report.ratio(None, 1))
        self.assertIsNone(report.ratio(1, None))
        self.assertIsNone(report.ratio(1, 0))

    def test_fmt_num(self):
        self.assertEqual([common.fmt_num(v) for v in (None, "n/a", 0, 0.0, 1234567, 0.00012345, 0.5,
                                                      1.5, 12.34, 123.4, 12345.6, -5.5)],
                         ["—", "n/a", "0", "0", "1,234,567", "0.000123", "0.5", "1.50", "12.3", "123",
                          "12,346", "-5.50"])

    def test_counter_delta(self):
        before = {"commits": 3, "fsync": {"log": 1, "p99_ms": 2.5}, "name": "x", "flag": True}
        after = {"commits": 5, "fsync": {"log": 4, "p99_ms": 2.0}, "new": 7, "name": "x", "flag": False}
        self.assertEqual(report.counter_delta(before, after),
                         {"commits": 2, "fsync.log": 3, "fsync.p99_ms": -0.5, "new": 7})
        self.assertIsNone(report.counter_delta(before, None))
        self.assertEqual(report.counter_delta(None, {"a": 1}), {"a": 1})


class Summary(unittest.TestCase):
    def setUp(self):
        self.saved_log = common.LOG
        self.log = quiet()
        self.tmp = tempfile.mkdtemp(prefix="birchbench-test.")
        self.cfg, self.cases, self.targets, self.runs = setup_run(self.tmp)
        self.summ = report.summarize(self.runs, self.cases, self.targets)

    def tearDown(self):
        import shutil
        common.LOG = self.saved_log
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_medians(self):
        e = self.summ["w1-dbench-8"]["ext4"]
        self.assertEqual((e["runs"], e["ok"]), (2, 2))
        self.assertEqual(e["median"], {"mbps": 150.0, "max_lat_ms": 20.0})
        self.assertEqual((e["min"]["mbps"], e["max"]["mbps"]), (100.0, 200.0))
        b = self.summ["w5-fsync"]["birchfs"]
        self.assertEqual((b["runs"], b["ok"], b["median"]), (1, 0, {}))
        self.assertEqual(self.summ["w1-dbench-8"]["raw"]["runs"], 0)  # raw does not run W1

    def test_before_after(self):
        lines = report.before_after(self.summ, self.cases, "ext4", "birchfs")
        self.assertEqual(len(lines), 1)  # W5 has no numbers on birchfs
        self.assertEqual(lines[0]["case"], "w1-dbench-8")
        self.assertAlmostEqual(lines[0]["throughput_pct"], -50.0)
        self.assertAlmostEqual(lines[0]["max_latency_pct"], 50.0)
        self.assertEqual(lines[0]["text"], "-50.0% throughput, +50.0% max latency")
        table = report.before_after_table(self.summ, self.cases, "ext4", "birchfs")
        self.assertEqual([(r["metric"], r["ratio"]) for r in table if r["case"] == "w1-dbench-8"],
                         [("mbps", 0.5), ("max_lat_ms", 1.5)])

    def test_markdown_tables(self):
        res = {"summary": self.summ, "runs": self.runs, "charts": {"W1": ["w1_throughput.png"]},
               "meta": {"date": "2026-11-26T08:00:00", "command": "bench/run.sh --quick",
                        "config": {"birch": "/opt/birch", "image_size": 384 << 20, "image_dir": self.tmp,
                                   "repeats": 2},
                        "machine": {"cpu": "cpu", "cores": 2, "mem_gib": 4, "kernel": "6.18", "image_fs": "ext4 /dev/vda"},
                        "elapsed_s": 90}}
        text = report.write_markdown(res, self.cases, self.targets, self.tmp)
        with open(os.path.join(self.tmp, "summary.md")) as f:
            self.assertEqual(f.read(), text)
        lines = text.splitlines()
        self.assertEqual(lines[0], "# birchbench results, 2026-11-26T08:00:00")
        self.assertIn("- images: 384M each in `%s` on host ext4 /dev/vda, written out in full; "
                      "loop devices with direct I/O" % self.tmp, lines)
        # W1: targets are rows, the case's figures columns, then birchfs/peer for the headline
        i = lines.index("## W1 dbench (seed 000): client.txt load")
        self.assertEqual(lines[i + 2], "- **8cl**: dbench 8 clients; params: clients=8, time=30")
        self.assertEqual(lines[i + 4], "| target | 8cl MB/s | 8cl max lat (ms) | birchfs/peer 8cl MB/s |")
        self.assertEqual(lines[i + 5], "|---|---|---|---|")
        self.assertEqual(lines[i + 6], "| ext4 | 150 | 20 | 0.50 |")
        self.assertEqual(lines[i + 7], "| raw | n/a | n/a | n/a |")
        self.assertEqual(lines[i + 8], "| birchfs | 75 | 30 | 1 |")
        self.assertIn("![W1 w1_throughput](w1_throughput.png)", lines)
        # W5: birchfs's only run failed
        j = lines.index("## W5 append 4 KiB + fsync latency, one thread")
        self.assertEqual(lines[j + 6], "| ext4 | 1,000 | 0.5 | — |")
        self.assertEqual(lines[j + 7], "| raw | 2,000 | 0.25 | — |")
        self.assertEqual(lines[j + 8], "| birchfs | FAIL | FAIL | 1 |")
        # the ratio section, and the failed run listed
        k = lines.index("### birchfs")
        self.assertEqual(lines[k + 2], "| case | figure | birchfs/ext4 | birchfs/raw |")
        self.assertEqual(lines[k + 4], "| dbench 8 clients | MB/s | 0.50 | n/a |")
        self.assertEqual(lines[k + 5], "| append 4 KiB + fsync (raw: write + flush) | p50 (ms) | — | — |")
        self.assertIn("birchfs counters (W1): none (this build exposes neither `.birch-stats` "
                      "nor the `trusted.birch.stats` xattr)", lines)
        self.assertIn("- w5-fsync on birchfs (repeat 1): boom", lines)
        self.assertEqual(lines[-1], "Raw results: `results.json`; tool outputs: `raw/`; log: `run.log`.")

    def test_check(self):
        self.assertEqual(report.do_check(self.cfg, self.cases, self.targets, self.runs), 1)  # birchfs mounted, no W5
        self.assertIn("check: birchfs: FAILED: no numbers for w5-fsync", self.log.lines)
        ok_runs = [r for r in self.runs if r["target"] != "birchfs"]
        self.targets[2].status, self.targets[2].error = "skipped", "no binary"
        self.assertEqual(report.do_check(self.cfg, self.cases, self.targets, ok_runs), 0)
        self.assertEqual(report.do_check(self.cfg, self.cases, self.targets[:2], ok_runs[:-1]), 1)  # raw: no W5


if __name__ == "__main__":
    unittest.main()
