#!/usr/bin/env python3
"""Writes ci-tests.txt, the xfstests subset scripts/test.sh runs, from a full run's results.

    tests/xfstests/make-ci-list.py RESULTS_DIR [SECONDS]     (default 24)

The CI subset is every generic/quick test that passed on birch in the full run in RESULTS_DIR
(RESULTS_DIR/passed.txt, written by run.sh), less those that took SECONDS or more there
(RESULTS_DIR/results/check.time). Why a subset: the full generic/quick run takes about 30
minutes on this machine (2 shared cores), of which about 6 minutes go to the 447 tests that
cannot run on a FUSE filesystem (each still sources the suite and checks its requirements)
and about 9 to the per-test unmount, fsck and mount; CI must stay under 45 minutes in all.
A test that fails today is not in the subset (the full run lists it); a test that birch
learns to pass joins it when the list is made again.
"""
import os
import sys

results = sys.argv[1]
limit = float(sys.argv[2]) if len(sys.argv) > 2 else 24.0
here = os.path.dirname(os.path.abspath(__file__))
passed = [t.strip() for t in open(os.path.join(results, "passed.txt")) if t.strip()]
times = {}
for line in open(os.path.join(results, "results", "check.time")):
    name, secs = line.split()
    times[name] = float(secs)
keep = [t for t in passed if times.get(t, 0) < limit]
slow = sorted((t for t in passed if times.get(t, 0) >= limit), key=lambda t: -times[t])
with open(os.path.join(here, "ci-tests.txt"), "w") as f:
    f.write("# The xfstests subset CI runs (tests/xfstests/run.sh --ci, from scripts/test.sh).\n")
    f.write("# Made by tests/xfstests/make-ci-list.py from a full generic/quick run: every test\n")
    f.write(f"# that passed there, less those that took {limit:g} s or more (only in the full run):\n")
    for t in slow:
        f.write(f"#   {t} ({times[t]:g} s)\n")
    f.write(f"# {len(keep)} tests, {sum(times.get(t, 0) for t in keep):g} s of test time in that run.\n")
    for t in keep:
        f.write(t + "\n")
print(f"ci-tests.txt: {len(keep)} tests ({sum(times.get(t, 0) for t in keep):g} s), "
      f"{len(slow)} left out for time: {' '.join(slow)}")
