#!/usr/bin/env bash
# FUSE over io_uring (used by default wherever the fuse module's enable_uring allows it; mount
# option `uring=on|off`, DESIGN §12.5), five cases:
#  0. no option with enable_uring N: every request over /dev/fuse, and enable_uring left N (the
#     default leaves that machine-wide setting to the administrator).
#  1. `-o uring` (with enable_uring still N): create, write, fsync, read, rename, unlink, mkdir, readdir through the mount;
#     the stats xattr must show requests served over the ring (fuse_uring_requests) and the
#     daemon log must say so at unmount; then `birch fsck` is clean.
#     `-o uring` turns enable_uring on; no option with it Y: over the ring, as in 1;
#     `-o uring=off` with it Y: every request over /dev/fuse.
#  2. Registration forced to fail after INIT agreed to io_uring (BIRCH_URING_BREAK_REGISTER=1:
#     payload buffers the kernel refuses): the same work must run over /dev/fuse (no hang,
#     fuse_uring_requests 0), then fsck is clean.
# Sets /sys/module/fuse/parameters/enable_uring to Y (the mount does) and puts back what it was.
# Skips (exit 77) when not root, without /dev/fuse, or on a kernel without FUSE over io_uring.
set -uo pipefail
BIRCH=${BIRCH:-$(pwd)/target/release/birch}
PARAM=/sys/module/fuse/parameters/enable_uring
if [[ ! -e /dev/fuse ]]; then echo "uring-test: SKIP: /dev/fuse is absent"; exit 77; fi
if [[ $(id -u) != 0 ]]; then echo "uring-test: SKIP: needs root"; exit 77; fi
if [[ ! -e $PARAM ]]; then echo "uring-test: SKIP: no $PARAM (kernel without FUSE over io_uring)"; exit 77; fi
[[ -x $BIRCH ]] || { echo "uring-test: $BIRCH not built"; exit 1; }

WORK=$(mktemp -d /var/tmp/birch-uring-test.XXXXXX)
MNT=$WORK/mnt
mkdir -p "$MNT"
WAS=$(cat "$PARAM")
FAIL=0
DAEMON=
# Cleanup unmounts through the repository's one mount helper (bench/birchbench/mounts.py):
# `birch umount` (60 s), fusermount3 -u, umount, then the FUSE connection aborted, the lazy
# unmounts, and the daemon of the mount point killed if it is still there.
MOUNTS_PY=$(cd "$(dirname "$0")/../.." && pwd)/bench/birchbench/mounts.py
cleanup() {
  python3 "$MOUNTS_PY" unmount --fuse --abort --birch "$BIRCH" --birch-timeout 60 --timeout 30 "$MNT"
  [[ -n $DAEMON ]] && kill "$DAEMON" 2>/dev/null
  echo "$WAS" > "$PARAM" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
ok() { echo "ok   $*"; }
bad() { echo "FAIL $*"; FAIL=1; }

stat_of() { # counter name -> value from trusted.birch.stats
  getfattr --absolute-names -n trusted.birch.stats --only-values "$MNT" 2>/dev/null |
    python3 -c "import json,sys; print(json.load(sys.stdin).get('$1', -1))"
}

# One case: $1 name, $2 "ring" or "dev" (where requests must go), $3 mount options ("" for
# none), rest: env for the daemon.
run_case() {
  local name=$1 want=$2 opts=$3; shift 3
  local img=$WORK/$name.img log=$WORK/$name.log
  "$BIRCH" mkfs --size 256M "$img" >/dev/null || { bad "$name: mkfs"; return; }
  env "$@" RUST_LOG=info "$BIRCH" mount -f ${opts:+-o "$opts"} "$img" "$MNT" >"$log" 2>&1 &
  DAEMON=$!
  for _ in $(seq 200); do mountpoint -q "$MNT" && break; sleep 0.05; done
  mountpoint -q "$MNT" || { bad "$name: mount did not come up"; cat "$log"; return; }
  # The work, with a watchdog: a transport that lost requests hangs here.
  if timeout 60 python3 - "$MNT" <<'EOF'
import os, sys
m = sys.argv[1]
os.mkdir(f"{m}/d")
data = os.urandom(3 * 1024 * 1024 + 123)
with open(f"{m}/d/a", "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
fd = os.open(f"{m}/d/s", os.O_CREAT | os.O_WRONLY | os.O_SYNC, 0o644)
for i in range(64):
    os.write(fd, b"x" * 4096)
os.close(fd)
os.rename(f"{m}/d/a", f"{m}/d/b")
with open(f"{m}/d/b", "rb") as f:
    assert f.read() == data, "read back differs"
fd = os.open(f"{m}/d/direct", os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o644)
import mmap
buf = mmap.mmap(-1, 1 << 20)
buf.write(os.urandom(1 << 20))
assert os.pwrite(fd, buf, 0) == 1 << 20
back = mmap.mmap(-1, 1 << 20)
assert os.preadv(fd, [back], 0) == 1 << 20 and back[:] == buf[:], "O_DIRECT read back differs"
os.close(fd)
for i in range(200):
    open(f"{m}/d/f{i}", "w").close()
names = sorted(os.listdir(f"{m}/d"))
assert len(names) == 203, len(names)
for i in range(200):
    os.unlink(f"{m}/d/f{i}")
os.unlink(f"{m}/d/s")
assert sorted(os.listdir(f"{m}/d")) == ["b", "direct"]
EOF
  then ok "$name: create/write/fsync/O_SYNC/O_DIRECT/read/rename/unlink/readdir"
  else bad "$name: the work failed or hung"; fi
  local ring dev
  ring=$(stat_of fuse_uring_requests)
  dev=$(stat_of fuse_dev_requests)
  echo "     $name: requests over io_uring $ring, over /dev/fuse $dev"
  if [[ $want == ring ]]; then
    if (( ring > 500 )); then ok "$name: requests went over the ring"; else bad "$name: only $ring requests over the ring"; fi
  else
    if (( ring == 0 && dev > 500 )); then ok "$name: requests went over /dev/fuse"; else bad "$name: ring $ring, /dev/fuse $dev"; fi
  fi
  timeout 60 "$BIRCH" umount "$MNT" || bad "$name: umount"
  wait "$DAEMON" || bad "$name: daemon exit status $?"
  DAEMON=
  if grep -q "FUSE requests served" "$log"; then ok "$name: $(grep -o 'FUSE requests served.*' "$log")"; else bad "$name: no count in the log"; fi
  if [[ $want == dev && $opts == uring ]]; then
    grep -q "not registered" "$log" && ok "$name: the log names the failed registration" || bad "$name: no registration failure in the log"
  fi
  if "$BIRCH" fsck "$img" >/dev/null; then ok "$name: fsck clean"; else bad "$name: fsck"; fi
}

echo N > "$PARAM"
run_case default-param-off dev ""
if [[ $(cat "$PARAM") == N ]]; then ok "the default mount left enable_uring N"; else bad "the default mount changed enable_uring"; fi
run_case uring ring uring
if [[ $(cat "$PARAM") == Y ]]; then ok "-o uring set enable_uring"; else bad "enable_uring not set by -o uring"; fi
run_case default-param-on ring ""
run_case uring-off dev uring=off
run_case broken-register dev uring BIRCH_URING_BREAK_REGISTER=1

if (( FAIL )); then echo "uring-test: FAILED"; exit 1; fi
echo "uring-test: all passed"
