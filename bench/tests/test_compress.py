"""bench/birchbench/compress.py (the compression benchmark, issue 37) without mounts: the corpora
are deterministic (same seed, same bytes; another seed, other bytes) and cached, the parsers of
compsize and `birch inspect space`, the /proc readings, the refusal of --birch-compress while
birch has no compress= option, the dry run, and the report of a made-up run.

The smoke run itself (`bench/compress.sh --quick`, about a minute, root, loop devices, btrfs)
runs only with BIRCHBENCH_COMPRESS_QUICK=1 as root; otherwise it is skipped.

Run: python3 -m unittest discover bench/tests (no root, no mounts, a few seconds)."""
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.dont_write_bytecode = True

from birchbench import compress  # noqa: E402

compress.log = lambda msg: None  # the corpora's "made ..." lines

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = os.path.join(BENCH, "compress.py")
TINY = {"log": 256 << 10, "db": 256 << 10, "vm": 3 << 20, "random": 1 << 20, "files": 40}


def fake_birch(d: str, help_text: str) -> str:
    p = os.path.join(d, "birch")
    with open(p, "w") as f:
        f.write("#!/bin/sh\ncat <<'END'\n" + help_text + "\nEND\n")
    os.chmod(p, os.stat(p).st_mode | stat.S_IXUSR)
    return p


class Corpora(unittest.TestCase):
    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.tmp = tmp.name

    def make(self, sub, name, seed):
        return compress.make_corpus(name, os.path.join(self.tmp, sub), TINY, seed)

    def test_same_seed_same_bytes(self):
        for name in compress.CORPORA:
            a, b = self.make("a", name, 5), self.make("b", name, 5)
            self.assertEqual(a["sha256"], b["sha256"], name)
            self.assertEqual((a["files"], a["bytes"]), (b["files"], b["bytes"]), name)
            self.assertGreater(a["bytes"], 0, name)

    def test_other_seed_other_bytes(self):
        for name in ("L", "R"):  # S is the W6 tree: W6's own seed, always
            self.assertNotEqual(self.make("a", name, 5)["sha256"], self.make("b", name, 6)["sha256"], name)
            self.assertNotEqual(compress.corpus_key(name, TINY, 5), compress.corpus_key(name, TINY, 6))

    def test_sizes_and_contents(self):
        man = self.make("a", "L", 5)
        d = man["dir"]
        self.assertEqual(sorted(os.listdir(d)), ["app.log", "guest.img", "orders.sqlite"])
        self.assertEqual(os.path.getsize(os.path.join(d, "app.log")), TINY["log"])
        self.assertEqual(os.path.getsize(os.path.join(d, "guest.img")), TINY["vm"])
        self.assertGreaterEqual(os.path.getsize(os.path.join(d, "orders.sqlite")), TINY["db"])
        with open(os.path.join(d, "orders.sqlite"), "rb") as f:
            self.assertEqual(f.read(16), b"SQLite format 3\0")
        with open(os.path.join(d, "app.log")) as f:
            self.assertRegex(f.readline(), r"^2026-01-01T00:00:\d\d\.\d{6}Z host-\d\d ")
        self.assertEqual(man["largest"], "guest.img")
        self.assertEqual(self.make("a", "S", 5)["files"], TINY["files"])
        self.assertEqual(self.make("a", "R", 5)["bytes"], TINY["random"])

    def test_inline_bytes_are_the_small_files(self):
        for i, n in enumerate((0, 1, 2048, 2049, 70000)):
            os.makedirs(os.path.join(self.tmp, "t", "d"), exist_ok=True)
            with open(os.path.join(self.tmp, "t", "d" if i % 2 else "", f"f{i}"), "wb") as f:
                f.write(b"x" * n)
        self.assertEqual(compress.inline_bytes(os.path.join(self.tmp, "t")), 1 + 2048)

    def test_tree_sha256_is_the_manifests(self):
        for name in ("L", "S"):
            man = self.make("a", name, 5)
            self.assertEqual(compress.tree_sha256(man["dir"]), (man["files"], man["sha256"]), name)
        man = self.make("a", "R", 5)
        with open(os.path.join(man["dir"], "random.bin"), "r+b") as f:
            f.seek(1000)
            f.write(b"\0")
        self.assertNotEqual(compress.tree_sha256(man["dir"])[1], man["sha256"])

    def test_cached_corpus_is_reused(self):
        man = self.make("a", "R", 5)
        path = os.path.join(man["dir"], "random.bin")
        before = os.stat(path).st_mtime_ns
        self.assertEqual(self.make("a", "R", 5), man)
        self.assertEqual(os.stat(path).st_mtime_ns, before)


class Parsers(unittest.TestCase):
    def test_compsize(self):
        out = ("Processed 3 files, 456 regular extents (456 refs), 0 inline.\n"
               "Type       Perc     Disk Usage   Uncompressed Referenced  \n"
               "TOTAL       29%     17428480     59277312     59277312    \n"
               "none       100%      4194304      4194304      4194304    \n"
               "zstd        24%     13234176     55083008     55083008    \n")
        self.assertEqual(compress.parse_compsize(out),
                         {"disk": 17428480, "uncompressed": 59277312, "referenced": 59277312})
        self.assertIsNone(compress.parse_compsize("ERROR: not btrfs\n"))

    def test_inspect_space(self):
        out = ("device                1073741824 bytes       262144 blocks    1.0 GiB  the whole image\n"
               "tree nodes                 49152 bytes           12 blocks   48.0 KiB  nodes of the live fs tree\n"
               "data                    20971520 bytes         5120 blocks   20.0 MiB  data blocks the live tree names\n"
               "  shared                       0 bytes            0 blocks        0 B  of data: blocks more than one\n"
               "used 9260 + free 252884 = device 262144 blocks of 4096 bytes\n")
        got = compress.parse_inspect_space(out)
        self.assertEqual(got["data"], 20971520)
        self.assertEqual(got["tree nodes"], 49152)
        self.assertNotIn("shared", got)

    def test_counter_delta_flat_and_nested(self):
        a, b = {"commits": 1, "free_bytes": 100, "x": [1]}, {"commits": 3, "free_bytes": 60, "x": [2]}
        self.assertEqual(compress.counter_delta(a, b), {"commits": 2, "free_bytes": -40})
        self.assertEqual(compress.counter_delta({"counters": a}, {"counters": b}), {"commits": 2, "free_bytes": -40})
        self.assertEqual(compress.counter_delta(None, b), {})

    def test_proc(self):
        self.assertIsNotNone(compress.proc_cpu_seconds(os.getpid()))
        self.assertIsNone(compress.proc_cpu_seconds(0, proc="/nonexistent"))
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "7"))
            hz = os.sysconf("SC_CLK_TCK")
            with open(os.path.join(d, "7", "stat"), "w") as f:  # comm with a space and a paren
                f.write(f"7 (birch (x) y) S 1 7 7 0 -1 4194560 10 0 0 0 {3 * hz} {2 * hz} 0 0 20 0 9 0 1\n")
            self.assertAlmostEqual(compress.proc_cpu_seconds(7, proc=d), 5.0)
            with open(os.path.join(d, "stat"), "w") as f:
                f.write(f"cpu  100 0 {4 * hz} 900 5 {hz} {hz} 0 0 0\ncpu0 1 2 3\n")
            self.assertAlmostEqual(compress.proc_sys_seconds(os.path.join(d, "stat")), 6.0)

    def test_compress_option_detection(self):
        self.assertFalse(compress.birch_supports_compress("Options: ro, rw, commit=SECS, buffer=on|off"))
        self.assertTrue(compress.birch_supports_compress("compress=zstd[:N]|lz4|none (default none)"))


class Defrag(unittest.TestCase):
    def test_codecs_and_names(self):
        self.assertEqual(compress.defrag_codecs(["zstd:1", "lz4", "zstd"]),
                         {"birchfs-defrag-zstd1": "zstd:1", "birchfs-defrag-lz4": "lz4", "birchfs-defrag-zstd": "zstd"})
        for c in ("zstd", "zstd:1", "zstd:19", "lz4"):
            self.assertTrue(compress.valid_codec(c), c)
        for c in ("gzip", "zstd:", "zstd:x", "lzo", ""):
            self.assertFalse(compress.valid_codec(c), c)

    def test_plan_appends_defrag_targets_after_the_others(self):
        base = compress.plan_targets([])
        self.assertEqual(base, compress.BASE_TARGETS)  # the existing targets, unchanged
        plan = compress.plan_targets(["lz4"], ["zstd:1", "lz4"])
        self.assertEqual(plan[: len(base)], base)
        self.assertEqual(plan[len(base):], [("birchfs-lz4", "birchfs", "compress=lz4"),
                                            ("birchfs-defrag-zstd1", "birchfs", None),
                                            ("birchfs-defrag-lz4", "birchfs", None)])

    def test_defrag_help_detection(self):
        self.assertTrue(compress.birch_supports_defrag_compress(
            "Usage: birch defrag --compress[=zstd|zstd:N|lz4] [-r] PATH..."))
        self.assertFalse(compress.birch_supports_defrag_compress("error: unknown command defrag"))

    def test_du_bytes(self):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "f"), "wb") as f:
                f.write(b"x" * 100000)
            os.sync()
            n = compress.du_bytes(d)
            self.assertIsInstance(n, int)
            self.assertGreaterEqual(n, 100000)
            self.assertIsNone(compress.du_bytes(os.path.join(d, "missing")))


class CommandLine(unittest.TestCase):
    def run_entry(self, *args, env=None):
        return subprocess.run([sys.executable, ENTRY, *args], capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1", **(env or {})))

    def test_dry_run_plan(self):
        p = self.run_entry("--dry-run", "--quick", "--birch", "/bin/true")
        self.assertEqual(p.returncode, 0, p.stderr)
        for name in ("btrfs-zstd1", "btrfs-zstd1-force", "btrfs-lzo", "btrfs", "birchfs"):
            self.assertIn(f"target {name}:", p.stdout)
        self.assertIn("-o compress=zstd:1", p.stdout)
        self.assertIn("btrfs-zstd1-force: btrfs -o compress-force=zstd:1", p.stdout)
        self.assertIn("corpus L: L-log16M-db8M-vm32M-s37-v1", p.stdout)
        self.assertEqual(p.stdout.count("run: repeat 1 corpus"), 3)

    def test_birch_compress_refused_until_birch_has_it(self):
        with tempfile.TemporaryDirectory() as d:
            b = fake_birch(d, "Options: ro, rw, commit=SECS (default 5), buffer=on|off")
            p = self.run_entry("--dry-run", "--quick", "--birch", b, env={"BIRCH_COMPRESS": "zstd:1,lz4"})
            self.assertEqual(p.returncode, 2)
            self.assertIn("no compress= mount option yet", p.stderr)
            b = fake_birch(d, "Options: compress=zstd[:N]|lz4|none, commit=SECS")
            p = self.run_entry("--dry-run", "--quick", "--birch", b, "--birch-compress", "zstd:1,lz4")
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("target birchfs-zstd1: birchfs -o compress=zstd:1", p.stdout)
            self.assertIn("target birchfs-lz4: birchfs -o compress=lz4", p.stdout)

    def test_birch_defrag_plan_and_refusal(self):
        with tempfile.TemporaryDirectory() as d:
            b = fake_birch(d, "Usage: birch defrag --compress[=zstd|zstd:N|lz4] [-r] PATH...")
            p = self.run_entry("--dry-run", "--quick", "--birch", b, env={"BIRCH_DEFRAG": "zstd:1,lz4"})
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("target birchfs-defrag-zstd1: birchfs, then birch defrag --compress=zstd:1 -r", p.stdout)
            self.assertIn("target birchfs-defrag-lz4: birchfs, then birch defrag --compress=lz4 -r", p.stdout)
            self.assertIn("target birchfs: birchfs\n", p.stdout)  # the plain target stays plain
            self.assertIn("btrfs-zstd1-force: btrfs -o compress-force=zstd:1\n", p.stdout)
            p = self.run_entry("--dry-run", "--quick", "--birch", b, "--birch-defrag", "lz4",
                               "--targets", "btrfs-zstd1,birchfs-defrag-lz4")
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertEqual(p.stdout.count("target "), 2, p.stdout)
            b = fake_birch(d, "Usage: birch defrag [-r] PATH...")
            p = self.run_entry("--dry-run", "--quick", "--birch", b, "--birch-defrag", "zstd:1")
            self.assertEqual(p.returncode, 2)
            self.assertIn("names no --compress", p.stderr)
            p = self.run_entry("--dry-run", "--quick", "--birch", "/nonexistent/birch", "--birch-defrag", "lz4")
            self.assertEqual(p.returncode, 2)
        self.assertNotEqual(self.run_entry("--dry-run", "--birch-defrag", "gzip").returncode, 0)
        self.assertNotEqual(self.run_entry("--dry-run", "--birch-defrag", "zstd:1,zstd:1").returncode, 0)

    def test_bad_options(self):
        self.assertNotEqual(self.run_entry("--dry-run", "--corpora", "L,X").returncode, 0)
        self.assertNotEqual(self.run_entry("--dry-run", "--targets", "zfs").returncode, 0)
        self.assertNotEqual(self.run_entry("--dry-run", "--birch-compress", "gzip").returncode, 0)
        self.assertNotEqual(self.run_entry("--dry-run", "--image-size", "1G").returncode, 0)  # L needs ~2.2G


class Report(unittest.TestCase):
    def test_render_ratios_and_cells(self):
        run = lambda t, stored, w, **kw: dict(target=t, corpus="L", repeat=1, logical_bytes=100 << 20,  # noqa: E731
                                              files=3, stored_data_bytes=stored << 20, write_mibs=w,
                                              read_mibs=200.0, randread_iops=1000.0, **kw)
        results = {"started": "x", "command": "bench/compress.sh --quick", "seconds": 1,
                   "config": {"quick": True, "repeats": 1, "image_size": 512 << 20, "corpora": ["L"]},
                   "machine": {"cores": 2, "kernel": "k", "image_fs": "ext4"},
                   "corpora": {"L": {"files": 3, "bytes": 100 << 20, "key": "L-x"}},
                   "targets": [{"name": n, "status": "ok", "error": ""} for n in ("btrfs-zstd1", "btrfs", "birchfs")]
                   + [{"name": "birchfs-lz4", "status": "skipped", "error": "no"}],
                   "runs": [run("btrfs-zstd1", 30, 50.0), run("btrfs", 100, 100.0), run("btrfs", 100, 120.0),
                            run("birchfs", 100, 75.0, daemon_cpu_s_per_gib_w=2.0),
                            {"target": "birchfs", "corpus": "L", "repeat": 2, "error": "boom"}]}
        md = compress.render(results)
        row = [ln for ln in md.splitlines() if ln.startswith("| birchfs (1 of 2 runs failed)")]
        self.assertEqual(len(row), 1, md)
        self.assertIn("| 3.33 | 1.50 | 1.00 | 1.00 |", row[0])  # stored, write, read, IOPS x btrfs-zstd1
        btrfs_row = [ln for ln in md.splitlines() if ln.startswith("| btrfs |")][0]
        self.assertIn("n/a (kernel)", btrfs_row)
        self.assertIn("| 110 (100–120) |", btrfs_row)  # two repeats: the median, then the spread
        self.assertIn("| birchfs-lz4 | skipped", md)
        self.assertIn("boom", md)


    def test_render_defrag_columns(self):
        base = dict(corpus="L", repeat=1, logical_bytes=100 << 20, files=3, write_mibs=100.0, write_s=1.0,
                    read_mibs=200.0, statfs_delta_bytes=100 << 20, du_bytes=100 << 20)
        results = {"started": "x", "command": "bench/compress.sh --birch-defrag zstd:1", "seconds": 1,
                   "config": {"quick": False, "repeats": 1, "image_size": 1 << 30, "corpora": ["L"]},
                   "machine": {"cores": 2, "kernel": "k", "image_fs": "ext4"},
                   "corpora": {"L": {"files": 3, "bytes": 100 << 20, "key": "L-x"}},
                   "targets": [{"name": n, "status": "ok", "error": ""}
                               for n in ("btrfs-zstd1", "birchfs", "birchfs-defrag-zstd1")],
                   "runs": [dict(base, target="btrfs-zstd1", stored_data_bytes=25 << 20),
                            dict(base, target="birchfs", stored_data_bytes=100 << 20, daemon_cpu_s_per_gib_w=2.0),
                            dict(base, target="birchfs-defrag-zstd1", stored_data_bytes=40 << 20,
                                 statfs_delta_plain_bytes=100 << 20, statfs_delta_bytes=41 << 20,
                                 defrag_s=4.0, defrag_mibs=25.0, daemon_cpu_s_per_gib_defrag=30.0,
                                 daemon_cpu_s_per_gib_w=2.0,
                                 birch_counters_defrag={"bytes_written": 42 << 20, "commits": 3})]}
        md = compress.render(results)
        lines = md.splitlines()
        head = [ln for ln in lines if ln.startswith("| target |")][0].split(" | ")
        row = [ln for ln in lines if ln.startswith("| birchfs-defrag-zstd1 |")][0].split(" | ")
        cell = lambda r, h: r[head.index(h)]  # noqa: E731
        self.assertEqual(cell(row, "ratio logical/stored"), "2.50")
        self.assertEqual(cell(row, "statfs Δ before defrag MiB"), "100")
        self.assertEqual(cell(row, "statfs Δ MiB"), "41")
        self.assertEqual(cell(row, "defrag s"), "4")
        self.assertEqual(cell(row, "defrag MiB/s"), "25")
        self.assertEqual(cell(row, "daemon CPU s/GiB defrag"), "30")
        self.assertEqual(cell(row, "du MiB"), "100")
        self.assertEqual(cell(row, "stored × btrfs-zstd1"), "1.60")
        brow = [ln for ln in lines if ln.startswith("| btrfs-zstd1 |")][0].split(" | ")
        self.assertEqual(cell(brow, "ratio logical/stored"), "4")
        self.assertEqual(cell(brow, "defrag s"), "—")  # only the defrag rows have a defrag pass
        self.assertEqual(cell(brow, "daemon CPU s/GiB defrag"), "—")
        self.assertEqual(cell(brow, "daemon CPU s/GiB w"), "n/a (kernel)")
        self.assertIn("## birch counters during the defrag pass", md)
        self.assertIn("L / birchfs-defrag-zstd1: bytes_written 44,040,192, commits 3", md)

    def test_render_without_defrag_has_no_defrag_columns(self):
        results = {"started": "x", "command": "c", "seconds": 1,
                   "config": {"quick": True, "repeats": 1, "image_size": 1 << 29, "corpora": ["R"]},
                   "machine": {}, "corpora": {"R": {"files": 1, "bytes": 1 << 20, "key": "R-x"}},
                   "targets": [{"name": "btrfs-zstd1", "status": "ok", "error": ""}],
                   "runs": [dict(target="btrfs-zstd1", corpus="R", repeat=1, logical_bytes=1 << 20,
                                 stored_data_bytes=1 << 20, write_mibs=1.0)]}
        md = compress.render(results)
        self.assertNotIn("defrag s |", md)
        self.assertNotIn("counters during the defrag", md)


@unittest.skipUnless(os.environ.get("BIRCHBENCH_COMPRESS_QUICK") == "1" and os.geteuid() == 0
                     and shutil.which("mkfs.btrfs"), "the smoke run needs BIRCHBENCH_COMPRESS_QUICK=1, root and btrfs")
class QuickRun(unittest.TestCase):
    def test_quick(self):
        with tempfile.TemporaryDirectory(dir="/var/tmp") as out:
            p = subprocess.run(["bash", os.path.join(BENCH, "compress.sh"), "--quick", "--out", out],
                               capture_output=True, text=True, timeout=1200)
            self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-2000:])
            with open(os.path.join(out, "results.json")) as f:
                res = json.load(f)
            self.assertTrue(all("error" not in r for r in res["runs"]), res["runs"])


if __name__ == "__main__":
    unittest.main()
