#!/usr/bin/env python3
"""birchbench: birchfs against the kernel filesystems, side by side.

Runs the seeds' workloads (W1 dbench, W2 fio O_DIRECT writers, W3 create/remove,
W4 sysbench fileio, W5 append+fsync latency) and W6 "everyday work" (unpack a source
tree, git clone/status, tree walk, read back, small appends, SQLite commits, rm -rf;
each step timed to durable) on every target, interleaved
(A B C A B C ...) with repeats, and writes Markdown tables, raw JSON and PNG
charts.  See docs/BENCHMARKS.md for the method.  Normally started through
bench/run.sh, which installs the tools first.

Targets: ext4, xfs, btrfs (each on a `losetup --direct-io=on` loop over its own
image), fuse2fs (over its own image, through a direct-io loop as well), bindfs
--multithreaded over a kernel ext4 directory, libfuse's in-memory example server
memfs_ll (built from the libfuse tarball in ../shared/libfuse; the FUSE floor), the
raw loop device (W2, W5) and birchfs (default options plus every --birch-opts set, and
with --birch-before PATH the same default options on another birch binary: birchfs-before).

Needs root.  Python 3.11 standard library; matplotlib only for the charts.

This file is only the entry point (bench/run.sh and the harness's own child processes run it);
the harness is the package bench/birchbench/ beside it: cli.py (options, the run loop),
targets.py, workloads.py, report.py, and mounts.py, the mount/loop/cleanup helper the test
scripts share (tests/mount/fuse-ops.py, tests/posix/lib.sh).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # run as a script, sys.path[0] is already bench/
    sys.path.insert(0, HERE)

from birchbench.cli import main  # noqa: E402  (the package bench/birchbench/, not this file)

if __name__ == "__main__":
    sys.exit(main())
