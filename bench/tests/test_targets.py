"""bench/birchbench/targets.py without mounts: the check that memfs_ll-uring really serves over
FUSE over io_uring (its memfs_ll has fuse-ring-* threads), on a fake /proc.

Run: python3 -m unittest discover bench/tests (no root, no mounts)."""
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.dont_write_bytecode = True

from birchbench import targets  # noqa: E402


def add_thread(proc: str, pid: int, tid: int, comm: str) -> None:
    d = os.path.join(proc, str(pid), "task", str(tid))
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "comm"), "w") as f:
        f.write(comm + "\n")


class MemfsRing(unittest.TestCase):
    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.proc = os.path.join(tmp.name, "proc")
        self.mnt = os.path.join(tmp.name, "mnt")
        os.makedirs(self.mnt)
        add_thread(self.proc, 4242, 4242, "memfs_ll")
        add_thread(self.proc, 4242, 4243, "memfs_ll")
        self.asked = []

    def find(self, mnt):
        self.asked.append(mnt)
        return [4242]

    def missing(self, **kw):
        return targets.memfs_ring_missing(self.mnt, proc=self.proc, find=self.find,
                                          sleep=lambda _: None, **kw)

    def test_ring_threads_are_named_by_libfuse(self):
        add_thread(self.proc, 4242, 4245, "fuse-ring-1")
        add_thread(self.proc, 4242, 4244, "fuse-ring-0")
        self.assertEqual(targets.ring_threads(4242, self.proc), ["fuse-ring-0", "fuse-ring-1"])
        self.assertEqual(targets.ring_threads(7, self.proc), [])  # no such process

    def test_a_daemon_with_ring_threads_passes(self):
        add_thread(self.proc, 4242, 4244, "fuse-ring-0")
        self.assertIsNone(self.missing(wait=0))
        self.assertEqual(self.asked, [self.mnt], "the daemon is found by its mount point")

    def test_a_daemon_without_ring_threads_fails_the_target(self):
        why = self.missing(wait=0)
        self.assertIsNotNone(why)
        self.assertIn("without FUSE over io_uring", why)
        self.assertIn("pid 4242", why)
        self.assertIn("built without io_uring", why)

    def test_threads_that_start_late_are_waited_for(self):
        def sleep(_):
            add_thread(self.proc, 4242, 4244, "fuse-ring-0")
        why = targets.memfs_ring_missing(self.mnt, proc=self.proc, find=self.find, sleep=sleep,
                                         wait=60)
        self.assertIsNone(why)
        self.assertEqual(len(self.asked), 2, "looked again after a sleep")

    def test_no_daemon(self):
        why = targets.memfs_ring_missing(self.mnt, proc=self.proc, find=lambda _: [],
                                         sleep=lambda _: None, wait=0)
        self.assertIn("no process with", why)

    def test_mount_fails_and_unmounts_without_the_ring(self):
        class Cfg:
            image_dir = os.path.dirname(self.mnt)
        t = targets.Target("memfs_ll-uring", "memfs_ll", Cfg(), opts="io_uring")
        t.mnt = self.mnt
        t.meta["memfs_ll"] = "/bin/true"
        calls = []
        saved = (targets.run, targets.is_mounted, targets.memfs_ring_missing, targets.URING_PARAM)
        param = os.path.join(os.path.dirname(self.mnt), "enable_uring")
        try:
            targets.run = lambda cmd, **kw: (calls.append(cmd), (0, "", ""))[1]
            targets.is_mounted = lambda path: True
            targets.memfs_ring_missing = lambda mnt: f"no ring on {mnt}"
            targets.URING_PARAM = param
            t.umount = lambda: calls.append("umount")
            t._mount_rec = lambda path, fuse: None  # no mounts.STATE outside a run
            with self.assertRaises(RuntimeError) as e:
                t.mount()
            self.assertEqual(str(e.exception), f"no ring on {self.mnt}")
            self.assertEqual(calls[-1], "umount", "unmounted before failing")
            self.assertIn("writeback_cache,no_timeout,io_uring", calls[0])
            # memfs_ll over /dev/fuse is not checked
            calls.clear()
            t.opts = None
            self.assertEqual(t.mount(), self.mnt)
            self.assertNotIn("umount", calls)
        finally:
            targets.run, targets.is_mounted, targets.memfs_ring_missing, targets.URING_PARAM = saved


if __name__ == "__main__":
    unittest.main()
