#!/bin/bash
# The 1 GiB shared-copy figures of DESIGN §15.8 (issue 15's aim: a clone at least 50x faster
# than a byte copy, to durable, cold cache). Makes a 6 GiB image, writes two 1 GiB files of
# random bytes, then remounts before each step (a cold page cache) and times: a byte copy
# (clone-copy.py copy), a first and a later clone by copy_file_range (clone-copy.py clone),
# and `cp --reflink=auto` then fsync (timed from before cp starts), with the bytes the daemon
# wrote (`birch stats MNT --json`). Ends with `birch fsck --data` of the image.
# Usage: sudo bench/tools/clone-bench.sh [BIRCH]   (default target/release/birch)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
B=${1:-$HERE/../../target/release/birch}
T=$HERE/clone-copy.py
IMG=${IMG:-/var/tmp/clone-bench.img}
MNT=${MNT:-/mnt/clone-bench}
mkdir -p "$MNT"
rm -f "$IMG"; truncate -s 6G "$IMG"
"$B" mkfs "$IMG" >/dev/null
mnt() { "$B" mount "$IMG" "$MNT"; }
um() {
  "$B" umount "$MNT" 2>/dev/null || umount "$MNT"
  for _ in $(seq 50); do mountpoint -q "$MNT" || break; sleep 0.1; done
  sleep 0.5
}
written() { "$B" stats "$MNT" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["counters"]["bytes_written"])'; }
reflink() { # SRC DST: cp --reflink=auto, then fsync DST; prints the time to durable
  python3 - "$1" "$2" <<'PYEND'
import os, subprocess, sys, time
src, dst = sys.argv[1:3]
t0 = time.monotonic()
subprocess.run(["cp", "--reflink=auto", src, dst], check=True)
fd = os.open(dst, os.O_RDONLY)
os.fsync(fd)
os.close(fd)
print(f"cp --reflink=auto + fsync: {time.monotonic() - t0:.3f} s to durable")
PYEND
}
step() { # LABEL CMD...
  local label=$1; shift
  mnt; local w0; w0=$(written)
  echo "== $label"
  "$@"
  echo "   bytes written: $(( $(written) - w0 ))"
  um
}
mnt
for f in big1 big2; do head -c 1G /dev/urandom > "$MNT/$f"; done
python3 -c "import os,sys; [os.fsync(os.open(p, os.O_RDONLY)) for p in sys.argv[1:]]" "$MNT/big1" "$MNT/big2"
um
step "byte copy of big1" python3 "$T" "$MNT/big1" "$MNT/copy1" copy
step "first clone of big1 (copy_file_range)" python3 "$T" "$MNT/big1" "$MNT/c1" clone
step "later clone of big1 (copy_file_range)" python3 "$T" "$MNT/big1" "$MNT/c2" clone
step "cp --reflink=auto of big2 (its first clone)" reflink "$MNT/big2" "$MNT/r1"
step "cp --reflink=auto of big2 (a later clone)" reflink "$MNT/big2" "$MNT/r2"
step "byte copy of big2" python3 "$T" "$MNT/big2" "$MNT/copy2" copy
"$B" fsck --data "$IMG" | tail -1
rm -f "$IMG"
