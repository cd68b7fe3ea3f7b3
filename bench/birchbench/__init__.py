"""birchbench, the benchmark harness of birchfs, as a package (bench/birchbench.py runs it).

Modules, each with what it owns and what it must not touch in its own docstring:
  common     paths, target names, size and number formats, the log
  mounts     the repository's one mount/loop helper: commands in their own session, unmount
             with retries, FUSE abort, loop devices, the cleanup record (also used by
             tests/mount/fuse-ops.py and, through its command line, tests/posix/lib.sh)
  targets    the filesystems under test: images, mkfs, mount/unmount per run, sync, counters
  workloads  W1-W6: cases, metrics, runners, the child processes they start
  report     medians, ratios, before/after, summary.md, charts, the --quick check
  cli        options and defaults, the lock, --detach, the interleaved run loop

Importing the package imports none of them: `from birchbench import mounts` costs only that
module (standard library only).
"""
