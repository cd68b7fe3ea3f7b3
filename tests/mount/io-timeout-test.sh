#!/usr/bin/env bash
# A device that stops answering, through a real mount with `-o io_timeout=1`: the image file
# lives on a small ext4 filesystem (on a loop device) that `fsfreeze -f` freezes, so every
# write and flush the daemon sends it blocks until `fsfreeze -u`, as a hung disk's would.
# Checked: an fsync in flight, and one started later, each fail (EIO or EROFS) within a few
# seconds instead of hanging; the filesystem turns read-only (a create answers EROFS) and
# `birch stats` names the cause; stat, readdir and reads of cached pages are still served;
# after the thaw the mount unmounts, fsck is clean, and every file fsync'd before the freeze
# holds its bytes. About 15 s. Skips (exit 77) when not root, without /dev/fuse, a loop
# device, mkfs.ext4 or fsfreeze.
set -uo pipefail
BIRCH=${BIRCH:-$(pwd)/target/release/birch}
NAME=io-timeout-test
if [[ ! -e /dev/fuse ]]; then echo "$NAME: SKIP: /dev/fuse is absent"; exit 77; fi
if [[ $(id -u) != 0 ]]; then echo "$NAME: SKIP: needs root (loop device, fsfreeze)"; exit 77; fi
for tool in losetup mkfs.ext4 fsfreeze; do
  command -v $tool >/dev/null || { echo "$NAME: SKIP: no $tool"; exit 77; }
done
[[ -x $BIRCH ]] || { echo "$NAME: $BIRCH not built"; exit 1; }

WORK=$(mktemp -d /var/tmp/$NAME.XXXXXX)
HOST=$WORK/host
MNT=$WORK/mnt
mkdir -p "$HOST" "$MNT"
LOOP=
MOUNTS_PY=$(cd "$(dirname "$0")/../.." && pwd)/bench/birchbench/mounts.py
cleanup() {
  [[ -n $LOOP ]] && fsfreeze -u "$HOST" 2>/dev/null
  python3 "$MOUNTS_PY" unmount --fuse --abort --birch "$BIRCH" --birch-timeout 60 --timeout 30 "$MNT"
  mountpoint -q "$HOST" && umount "$HOST"
  [[ -n $LOOP ]] && losetup -d "$LOOP"
  rm -rf "$WORK"
}
trap cleanup EXIT
FAIL=0
ok() { echo "ok   $*"; }
bad() { echo "FAIL $*"; FAIL=1; }
t0=$(date +%s.%N)
log() { printf '[%s +%.1fs] %s\n' "$NAME" "$(echo "$(date +%s.%N) - $t0" | bc)" "$*"; }

truncate -s 160M "$WORK/host.img"
LOOP=$(losetup -f --show "$WORK/host.img") || { echo "$NAME: SKIP: no loop device"; LOOP=; exit 77; }
mkfs.ext4 -q -F "$LOOP" && mount "$LOOP" "$HOST" || { echo "$NAME: ext4 on $LOOP failed"; exit 1; }
IMG=$HOST/disk.img
"$BIRCH" mkfs --size 128M "$IMG" >/dev/null || { echo "$NAME: mkfs failed"; exit 1; }
"$BIRCH" mount "$IMG" "$MNT" -o io_timeout=1 || { echo "$NAME: mount failed"; exit 1; }
log "mounted with -o io_timeout=1 on an image on ext4 ($LOOP)"

# Files fsync'd before the freeze: content stamped with name, offset and a random part.
python3 - "$MNT" "$WORK" <<'EOF'
import hashlib, os, sys
mnt, work = sys.argv[1], sys.argv[2]
for n in range(4):
    data = b"".join(
        f"file{n} offset {off:08d} ".encode() + os.urandom(24) + b"z" * 4056
        for off in range(0, 96 * 4096, 4096))
    fd = os.open(f"{mnt}/kept{n}", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, data)
    os.fsync(fd)
    os.close(fd)
    open(f"{work}/kept{n}.sha", "w").write(hashlib.sha256(data).hexdigest())
EOF
[[ $? == 0 ]] && ok "4 files written and fsync'd" || bad "writing the files before the freeze"
sync -f "$MNT/kept0"; cat "$MNT"/kept* >/dev/null   # their pages cached in the kernel

fsfreeze -f "$HOST" || { echo "$NAME: fsfreeze -f failed"; exit 1; }
log "the image's filesystem is frozen: the daemon's writes and flushes block"
# An fsync in flight when the device stops answering.
python3 - "$MNT" >"$WORK/fsync1" 2>&1 <<'EOF' &
import os, sys, time
t = time.monotonic()
fd = os.open(sys.argv[1] + "/during", os.O_CREAT | os.O_WRONLY, 0o644)
os.write(fd, b"during the freeze " * 1000)
try:
    os.fsync(fd)
    print(f"fsync succeeded after {time.monotonic() - t:.1f} s")
except OSError as e:
    print(f"fsync failed: errno {e.errno} after {time.monotonic() - t:.1f} s")
EOF
PID=$!
waited=0
while kill -0 $PID 2>/dev/null && (( waited < 30 )); do sleep 0.5; waited=$((waited + 1)); done
if kill -0 $PID 2>/dev/null; then
  bad "the fsync in flight still waits after 15 s on a device given up after 1 s"
else
  out=$(cat "$WORK/fsync1")
  if [[ $out == "fsync failed: errno "* ]]; then ok "the fsync in flight: $out"; else bad "the fsync in flight: $out"; fi
fi
# A later fsync fails at once.
out=$(timeout 10 python3 -c '
import os, sys, time
t = time.monotonic()
fd = os.open(sys.argv[1] + "/kept1", os.O_WRONLY)
os.pwrite(fd, b"after", 0)
try:
    os.fsync(fd); print("fsync succeeded")
except OSError as e:
    print(f"fsync failed: errno {e.errno} after {time.monotonic() - t:.1f} s")
' "$MNT" 2>&1)
[[ $out == "fsync failed: errno "* ]] && ok "a later fsync: $out" || bad "a later fsync: $out"
# Read-only, the cause named; what needs no device I/O is served.
if timeout 10 touch "$MNT/new" 2>"$WORK/err"; then bad "a create succeeded on a given-up device"
elif grep -q "Read-only file system" "$WORK/err"; then ok "a create answers EROFS"
else bad "a create: $(cat "$WORK/err")"; fi
timeout 10 stat "$MNT/kept0" >/dev/null && ok "stat is served" || bad "stat after the give-up"
n=$(timeout 10 ls "$MNT" | wc -l)
(( n >= 4 )) && ok "readdir is served ($n names)" || bad "readdir after the give-up: $n names"
sum=$(timeout 10 sha256sum <"$MNT/kept2" | cut -d' ' -f1)
[[ $sum == "$(cat "$WORK/kept2.sha")" ]] && ok "cached pages of kept2 are served, its bytes" \
  || bad "kept2 read after the give-up: ${sum:-failed}"
timeout 10 "$BIRCH" stats --json "$MNT" >"$WORK/stats" 2>&1
if python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))
cause = r.get("read_only_cause") or ""
sys.exit(0 if r["counters"].get("read_only_failure") == 1 and "io_timeout" in cause else 1)' "$WORK/stats"; then ok "birch stats names the cause"
else bad "birch stats: $(head -c 400 "$WORK/stats")"; fi

fsfreeze -u "$HOST" && log "thawed"
if timeout 90 "$BIRCH" umount "$MNT" >"$WORK/err" 2>&1; then ok "unmounted after the thaw"
else bad "birch umount after the thaw: $(cat "$WORK/err")"; fi
if "$BIRCH" fsck "$IMG" >"$WORK/fsck" 2>&1; then ok "fsck clean: $(tail -1 "$WORK/fsck")"
else bad "fsck: $(cat "$WORK/fsck")"; fi
"$BIRCH" mount "$IMG" "$MNT" || { bad "remount failed"; exit 1; }
for n in 0 1 2 3; do
  sum=$(sha256sum <"$MNT/kept$n" | cut -d' ' -f1)
  # kept1 took 5 unacknowledged bytes at offset 0 before its failed fsync: either version.
  if [[ $sum == "$(cat "$WORK/kept$n.sha")" ]]; then ok "kept$n holds what its fsync acknowledged"
  elif [[ $n == 1 ]] && [[ $(head -c 5 "$MNT/kept1") == after ]]; then ok "kept1: the later write landed"
  else bad "kept$n after the remount: $sum"; fi
done
"$BIRCH" umount "$MNT" || bad "final umount"
log "$( ((FAIL)) && echo FAILED || echo "all checks passed")"
exit $FAIL
