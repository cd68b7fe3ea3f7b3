"""bench/birchbench/mounts.py (the mount/loop helper the harness and the test scripts share),
the parts that need no mount, no loop device and no root: the escapes of mount tables,
whether a path is mounted, commands in their own session with a time limit, finding a process
by an argument, and the command line tests/posix/lib.sh calls.

Run: python3 -m unittest discover bench/tests."""
import os
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.dont_write_bytecode = True

from birchbench import mounts  # noqa: E402

MOUNTS_PY = mounts.__file__


class Tables(unittest.TestCase):
    def test_unescape(self):
        self.assertEqual(mounts._unescape("/mnt/a\\040b"), "/mnt/a b")
        self.assertEqual(mounts._unescape("/x\\011y\\012z\\134w"), "/x\ty\nz\\w")
        self.assertEqual(mounts._unescape("/plain"), "/plain")
        self.assertEqual(mounts._unescape("/end\\04"), "/end\\04")  # not an escape: left as it is

    def test_is_mounted(self):
        self.assertTrue(mounts.is_mounted("/"))
        self.assertIsNotNone(mounts.mount_device("/"))
        with tempfile.TemporaryDirectory() as d:
            self.assertFalse(mounts.is_mounted(d))
            self.assertIsNone(mounts.mount_device(d))
            self.assertIsNone(mounts.fuse_abort(d))  # not a mount: nothing to abort
            self.assertIsNone(mounts.unmount(d, fuse=True))  # not mounted: nothing to do


class Processes(unittest.TestCase):
    def setUp(self):
        self.saved, mounts.STATE = mounts.STATE, None

    def tearDown(self):
        mounts.STATE = self.saved

    def test_run(self):
        self.assertEqual(mounts.run(["sh", "-c", "echo out; echo err >&2; exit 3"]), (3, "out\n", "err\n"))
        rc, out, err = mounts.run(["/nonexistent/tool"])
        self.assertEqual((rc, out), (-1001, ""))
        self.assertIn("cannot start /nonexistent/tool", err)

    def test_timeout_kills_the_group(self):
        with tempfile.TemporaryDirectory() as d:
            mark = os.path.join(d, "child-alive")
            t0 = time.monotonic()
            # the grandchild would touch the file after 1 s unless the whole group is killed
            rc, _, err = mounts.run(["sh", "-c", f"(sleep 1; touch {mark}) & sleep 30"], timeout=0.5)
            self.assertEqual(rc, -1000)
            self.assertIn("timeout after 0.5s", err)
            self.assertLess(time.monotonic() - t0, 10)
            time.sleep(1.5)
            self.assertFalse(os.path.exists(mark))
        self.assertEqual(mounts.ACTIVE, {})

    def test_run_log_path(self):
        with tempfile.TemporaryDirectory() as d:
            log = os.path.join(d, "daemon.log")
            with open(log, "w") as f:
                f.write("earlier\n")
            rc, out, err = mounts.run(["sh", "-c", "echo to-out; echo to-err >&2"], log_path=log)
            self.assertEqual((rc, out), (0, ""))
            self.assertEqual(err, "earlier\nto-out\nto-err\n")

    def test_state_records_groups(self):
        with tempfile.TemporaryDirectory() as d:
            mounts.STATE = st = mounts.State(os.path.join(d, "state.json"))
            seen = []
            st_add = st.add
            st.add = lambda kind, item: (seen.append((kind, item)), st_add(kind, item))
            mounts.run(["true"])
            self.assertEqual(seen[0][0], "groups")
            self.assertEqual(seen[0][1]["exe"], "true")
            self.assertEqual(st.load()["groups"], [])  # removed once it ended

    def test_pids_with_arg(self):
        arg = f"/tmp/birchbench-test-{os.getpid()}-{time.time()}"
        q = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", arg], stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10  # until the child has exec'd
            while not mounts.pids_with_arg(arg) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertEqual(mounts.pids_with_arg(arg), [q.pid])
            self.assertEqual(mounts.pids_with_arg(arg + "/sub"), [])  # whole arguments only
            me = open("/proc/self/cmdline", "rb").read().split(b"\0")[0].decode()
            self.assertNotIn(os.getpid(), mounts.pids_with_arg(me))  # never itself
        finally:
            q.kill()
            q.wait()


class CommandLine(unittest.TestCase):
    def cli(self, *args):
        return subprocess.run([sys.executable, MOUNTS_PY, *args], capture_output=True, text=True,
                              env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))

    def test_is_mounted(self):
        self.assertEqual(self.cli("is-mounted", "/").returncode, 0)
        with tempfile.TemporaryDirectory() as d:
            self.assertEqual(self.cli("is-mounted", d).returncode, 1)
            r = self.cli("unmount", "--fuse", "--abort", "--timeout", "5", d)
            self.assertEqual((r.returncode, r.stdout), (0, ""))  # not mounted: done
            r = self.cli("abort", d)
            self.assertEqual((r.returncode, r.stdout), (0, ""))

    def test_usage(self):
        self.assertEqual(self.cli().returncode, 2)
        self.assertEqual(self.cli("mount", "x").returncode, 2)
        r = self.cli("--help")
        self.assertEqual(r.returncode, 0)
        for sub in ("unmount", "abort", "detach-loop", "is-mounted"):
            self.assertIn(sub, r.stdout)


if __name__ == "__main__":
    unittest.main()
