"""birchbench's command line without mounts: options, their defaults, --quick's sizes, the
checks apply_defaults makes, and the cases a configuration gives.

Run: python3 -m unittest discover bench/tests (no root, no mounts, a second or two)."""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.dont_write_bytecode = True

from birchbench import cli, common, workloads  # noqa: E402

# a loadfile given, so apply_defaults does not look for dbench's (dpkg -L)
BASE = ["--dbench-loadfile", "client.txt", "--birch", "/bin/true"]


def parse(*argv):
    cfg = cli.make_parser().parse_args(list(argv) + BASE)
    cli.apply_defaults(cfg)
    return cfg


class Options(unittest.TestCase):
    def test_defaults_before_apply(self):
        cfg = cli.make_parser().parse_args([])
        self.assertEqual(cfg.targets, common.ALL_TARGETS)
        self.assertEqual(cfg.workloads, ["W1", "W2", "W3", "W4", "W5", "W6"])
        self.assertEqual(cfg.birch_opts, [])
        self.assertIsNone(cfg.image_size)  # filled by apply_defaults: full or quick
        self.assertEqual(cfg.fio_modes, ["odirect", "osync"])
        self.assertEqual(cfg.fio_bs, "64k")
        self.assertEqual(cfg.sb_block, "8K")
        self.assertEqual(cfg.w5_max_ops, 200000)
        self.assertTrue(cfg.w6_drop_caches)
        self.assertEqual(cfg.run_dir_name, "birchbench.run")
        self.assertFalse(cfg.quick or cfg.detach or cfg.cleanup or cfg.check)

    def test_full_defaults(self):
        cfg = parse()
        self.assertEqual(cfg.image_size, 4 << 30)
        self.assertEqual(cfg.repeats, 2)
        self.assertEqual((cfg.dbench_time, cfg.dbench_clients), (30, [8, 16]))
        self.assertEqual((cfg.fio_threads, cfg.fio_region, cfg.fio_time), (64, 1 << 20, 20))
        self.assertEqual((cfg.md_threads, cfg.md_files), ([1, 2, 8], 8000))
        self.assertEqual(cfg.sb_modes, ["rndwr", "seqwr", "rndwr-fsyncall"])
        self.assertEqual((cfg.sb_files, cfg.sb_total, cfg.sb_threads, cfg.sb_time), (1024, "1G", 64, 20))
        self.assertEqual(cfg.w5_time, 15)
        self.assertEqual((cfg.w6_files, cfg.w6_appends, cfg.w6_sqlite_journal, cfg.w6_sqlite_wal),
                         (10000, 200000, 2000, 5000))

    def test_quick_defaults(self):
        cfg = parse("--quick")
        self.assertEqual(cfg.image_size, 384 << 20)
        self.assertEqual(cfg.repeats, 1)
        self.assertEqual((cfg.dbench_time, cfg.dbench_clients), (2, [4]))
        self.assertEqual((cfg.fio_threads, cfg.fio_region, cfg.fio_time), (16, 256 << 10, 2))
        self.assertEqual(cfg.sb_modes, ["rndwr", "rndwr-fsyncall"])
        self.assertEqual((cfg.w6_files, cfg.w6_appends, cfg.w6_sqlite_journal, cfg.w6_sqlite_wal),
                         (1000, 20000, 100, 250))

    def test_given_values_win_over_quick(self):
        cfg = parse("--quick", "--image-size", "2G", "--repeats", "3", "--md-threads", "1,4")
        self.assertEqual((cfg.image_size, cfg.repeats, cfg.md_threads), (2 << 30, 3, [1, 4]))

    def test_lists_and_sizes(self):
        cfg = parse("--workloads", "w6, w1", "--targets", "ext4,birchfs", "--birch-opts", "fsync=log",
                    "--birch-opts", "threads=2", "--fio-region", "512K", "--no-w6-drop-caches")
        self.assertEqual(cfg.workloads, ["W6", "W1"])
        self.assertEqual(cfg.targets, ["ext4", "birchfs"])
        self.assertEqual(cfg.birch_opts, ["fsync=log", "threads=2"])
        self.assertEqual(cfg.fio_region, 512 << 10)
        self.assertFalse(cfg.w6_drop_caches)

    def test_bad_values(self):
        with self.assertRaises(SystemExit):
            parse("--targets", "ext4,zfs")
        with self.assertRaises(SystemExit):
            parse("--workloads", "W7")
        with self.assertRaises(SystemExit):  # compared with birchfs: needs it in --targets
            parse("--targets", "ext4", "--birch-before", "/bin/true")
        with self.assertRaises(SystemExit):
            parse("--birch-before", "/bin/true", "--no-birch-default")
        with self.assertRaises(SystemExit):
            parse("--birch-before", "/nonexistent/birch")
        with open(os.devnull, "w") as null:
            err, sys.stderr = sys.stderr, null
            try:
                with self.assertRaises(SystemExit):
                    cli.make_parser().parse_args(["--image-size", "lots"])
            finally:
                sys.stderr = err

    def test_the_rbd_target_is_optional(self):
        self.assertNotIn("birchfs-rbd", parse().targets, "not run by default")
        cfg = parse("--targets", "birchfs,birchfs-rbd", "--rbd-birch", "/bin/true", "--rbd-pool", "p")
        self.assertEqual(cfg.targets, ["birchfs", "birchfs-rbd"])
        self.assertEqual(cfg.rbd_birch, "/bin/true")
        from birchbench.targets import Target
        t = Target("birchfs-rbd", "birchfs", cfg, rbd=True)
        self.assertTrue(t.rbd and t.is_birch and t.is_fuse)
        self.assertEqual((t.image, t.birch), ("rbd:p/birchbench-birchfs-rbd", "/bin/true"))
        self.assertIsNone(t.allocated(), "no image file to measure")
        self.assertFalse(Target("birchfs", "birchfs", cfg).rbd)
        with self.assertRaises(SystemExit):
            parse("--targets", "birchfs-rbd", "--rbd-birch", "/nonexistent/birch")

    def test_memfs_ll_runs_over_both_transports(self):
        self.assertIn("memfs_ll-uring", parse().targets, "run by default, beside memfs_ll")
        cfg = parse("--targets", "memfs_ll,memfs_ll-uring,birchfs", "--birch-opts", "uring=off")
        ts = cli.make_targets(cfg)
        self.assertEqual([t.name for t in ts],
                         ["memfs_ll", "memfs_ll-uring", "birchfs", "birchfs[uring=off]"])
        self.assertEqual([(t.kind, t.opts) for t in ts[:2]],
                         [("memfs_ll", None), ("memfs_ll", "io_uring")])
        self.assertTrue(ts[1].is_fuse and not ts[1].is_birch)
        self.assertEqual(ts[3].opts, "uring=off")

    def test_relative_birch_is_from_the_repo(self):
        cfg = cli.make_parser().parse_args(["--dbench-loadfile", "x", "--birch", "target/release/birch"])
        cli.apply_defaults(cfg)
        self.assertEqual(cfg.birch, os.path.join(common.REPO, "target/release/birch"))

    def test_children_run_the_entry_point(self):
        self.assertEqual(common.ENTRY, os.path.join(common.HERE, "birchbench.py"))
        self.assertTrue(os.path.isfile(common.ENTRY))


class Cases(unittest.TestCase):
    def test_quick_cases(self):
        cases = workloads.build_cases(parse("--quick"))
        self.assertEqual([c.id for c in cases], [
            "w1-dbench-4", "w2-fio-odirect", "w2-fio-osync", "w3-mdtest-2", "w4-sysbench-rndwr",
            "w4-sysbench-rndwr-fsyncall", "w5-fsync", "w6-everyday"])
        for c in cases:
            self.assertTrue(any(m.ratio for m in c.metrics), c.id)  # a headline for the ratio columns
            self.assertIn(c.wl, workloads.WL_TITLES)
        self.assertEqual([c.id for c in cases if c.raw_ok], ["w2-fio-odirect", "w2-fio-osync", "w5-fsync"])
        w6 = cases[-1]
        self.assertEqual([m.key for m in w6.metrics], [k for k, _ in workloads.W6_STEPS])

    def test_w6_tree_is_deterministic(self):
        a, b = workloads.w6_tree(200, 6), workloads.w6_tree(200, 6)
        self.assertEqual(a, b)
        files = [(p, body) for p, body in a if body is not None]
        self.assertEqual(len(files), 200)
        self.assertEqual(sum(1 for _, body in a if body is None), 30)  # files*3/20 directories
        self.assertNotEqual(a, workloads.w6_tree(200, 7))


class Sizes(unittest.TestCase):
    def test_parse_and_print(self):
        self.assertEqual([common.parse_size(s) for s in ("4G", "384M", "1.5k", "12", "2GiB", "3 mb")],
                         [4 << 30, 384 << 20, 1536, 12, 2 << 30, 3 << 20])
        self.assertEqual([common.human(n) for n in (1, 1024, 1536, 4 << 30, 256 << 10)],
                         ["1", "1K", "1536", "4G", "256K"])
        self.assertEqual(common.int_list("8, 16,"), [8, 16])
        self.assertEqual(common.str_list(" a ,b,,"), ["a", "b"])
        self.assertEqual(common.safe_name("birchfs[threads=2,uring]"), "birchfs_threads_2_uring")


if __name__ == "__main__":
    unittest.main()
