#!/usr/bin/env python3
"""The compression benchmark (issue 37): birchfs beside btrfs compress=zstd:1, compress=lzo and
no compression, on corpus L (log, SQLite database, VM-image-like file), S (the W6 source tree)
and R (random).  Normally started through bench/compress.sh, which installs fio, btrfs-progs
and btrfs-compsize first.  See docs/BENCHMARKS.md, "Compression (issue 37): the harness".

This file is only the entry point; the code is bench/birchbench/compress.py."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from birchbench.compress import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
