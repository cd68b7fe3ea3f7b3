#!/usr/bin/env python3
"""Copies SRC to DST and fsyncs DST, timed from the first call to the fsync's return.

    clone-copy.py SRC DST clone   # os.copy_file_range in a loop (shares blocks on birchfs)
    clone-copy.py SRC DST copy    # 1 MiB reads and writes

Used for the 1 GiB shared-copy figure of DESIGN.md §15.8 (remount before each run for a cold
page cache; `birch stats MNT --json` before and after gives the bytes written).
"""
import os
import sys
import time


def main() -> int:
    if len(sys.argv) != 4 or sys.argv[3] not in ("clone", "copy"):
        print(__doc__, file=sys.stderr)
        return 2
    src, dst, mode = sys.argv[1:]
    s = os.open(src, os.O_RDONLY)
    d = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    size = os.fstat(s).st_size
    started = time.monotonic()
    if mode == "clone":
        done = 0
        while done < size:
            n = os.copy_file_range(s, d, size - done, done, done)
            if n == 0:
                break
            done += n
    else:
        while True:
            chunk = os.read(s, 1 << 20)
            if not chunk:
                break
            os.write(d, chunk)
    os.fsync(d)
    print(f"{mode}: {size} bytes, {time.monotonic() - started:.3f} s to durable")
    return 0


if __name__ == "__main__":
    sys.exit(main())
