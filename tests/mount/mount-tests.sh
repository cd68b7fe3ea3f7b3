#!/usr/bin/env bash
# Tests of the FUSE mount itself, on a real mount of an image file.
#
# Proves: a 256-byte name gives ENAMETOOLONG and leaves no trace (fsck clean); a file
# unlinked while open stays readable and writable and is freed after close; umount is
# synchronous for the image (20 cycles of write -> umount -> immediate mount -> verify);
# fsync, rename, link, symlink, xattrs, truncate, fallocate and SEEK_DATA/SEEK_HOLE work through
# the kernel; clear errors for a missing mountpoint, a missing image and a non-birchfs image; a
# second mount of a mounted image (a bind mount of the first, read-only or not; either unmounted
# first); SIGTERM and SIGKILL of the daemon (fsync'd data replayed from the log,
# fsck checking the pending log replayed in memory); atime under strictatime and after remounts
# with noatime, relatime and strictatime; shutdown through the FS_IOC_SHUTDOWN ioctl and
# `birch shutdown` (EPERM without CAP_SYS_ADMIN, EIO after, umount works, the next mount finds
# what each variant keeps); fstrim (FITRIM: EPERM without CAP_SYS_ADMIN, unsupported on an image
# file, on RBD the bytes trimmed and `rbd du` lower); snapshots made, listed and deleted through the mount, browsed
# read-only at MNT/.snapshot/NAME, and one mounted alone with -o ro,snapshot=NAME; the control
# socket (`birch` commands go through it, root's alone, a stale one replaced, gone after
# umount); fsck clean at the end.
#
# Skips (exit 77) with a printed reason where /dev/fuse is absent or not root.
set -uo pipefail
BIRCH=${BIRCH:-$(pwd)/target/release/birch}
# Extra mount options for every mount, e.g. BIRCH_MOUNT_OPTS=uring=off (/dev/fuse alone).
EXTRA_OPTS=()
if [ -n "${BIRCH_MOUNT_OPTS:-}" ]; then EXTRA_OPTS=(-o "$BIRCH_MOUNT_OPTS"); fi
if [[ ! -e /dev/fuse ]]; then echo "mount-tests: SKIP: /dev/fuse is absent"; exit 77; fi
if [[ $(id -u) != 0 ]]; then echo "mount-tests: SKIP: needs root"; exit 77; fi
[[ -x $BIRCH ]] || { echo "mount-tests: $BIRCH not built"; exit 1; }

WORK=$(mktemp -d /var/tmp/birch-mount-tests.XXXXXX)
# BIRCH_SPEC: a device other than an image file, e.g. rbd:rbd/mount-tests (tests/rbd/rbd-test.sh);
# mkfs creates or reformats it, and the steps that only make sense for an image file (its flock,
# a file that is not a birchfs image) are left out.
IMG=${BIRCH_SPEC:-$WORK/img}
IMAGE_FILE=1
[[ -n ${BIRCH_SPEC:-} ]] && IMAGE_FILE=0
MNT=$WORK/mnt
mkdir -p "$MNT"
passed=0
failed=0
# Cleanup unmounts through the repository's one mount helper (bench/birchbench/mounts.py):
# `birch umount` (60 s), fusermount3 -u, umount, then the FUSE connection aborted, the lazy
# unmounts, and the daemon of the mount point killed if it is still there.
MOUNTS_PY=$(cd "$(dirname "$0")/../.." && pwd)/bench/birchbench/mounts.py
cleanup() {
  for m in "$WORK/mnt3" "$WORK/mnt2" "$MNT"; do
    python3 "$MOUNTS_PY" unmount --fuse --abort --birch "$BIRCH" --birch-timeout 60 --timeout 30 "$m"
  done
  rm -rf "$WORK"
}
trap cleanup EXIT

ok() { echo "ok   $1"; passed=$((passed + 1)); }
bad() { echo "FAIL $1"; failed=$((failed + 1)); }
check() { local name=$1; shift; if "$@"; then ok "$name"; else bad "$name"; fi; }
# The control socket of the mount at $1 (default $MNT): /run/birch/ctl-MAJOR:MINOR.sock, from
# the mount's st_dev.
sock_of() { echo "/run/birch/ctl-$(stat -c '%Hd:%Ld' "${1:-$MNT}").sock"; }
# sock_say SOCKET COMMAND: sends COMMAND on the control socket, prints the answer (or the
# errno name of a failed connect).
sock_say() { python3 -c "
import socket, sys, errno
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print(errno.errorcode[e.errno]); sys.exit(0)
s.send(sys.argv[2].encode())
print(s.recv(300).decode().strip())" "$1" "$2"; }

MKFS_FORCE=()
((IMAGE_FILE)) || MKFS_FORCE=(--force)
"$BIRCH" mkfs "${MKFS_FORCE[@]}" --size 256M "$IMG" >/dev/null || { echo "mkfs failed"; exit 1; }
"$BIRCH" mount "${EXTRA_OPTS[@]}" "$IMG" "$MNT" || { echo "mount failed"; exit 1; }

# --- error paths -------------------------------------------------------------
long=$(printf 'x%.0s' $(seq 256))
py_errno() { python3 -c "
import os, sys, errno
try:
    $1
    print('OK')
except OSError as e:
    print(errno.errorcode[e.errno])
"; }
check "256-byte name is ENAMETOOLONG" test "$(py_errno "open('$MNT/$long','w')")" = ENAMETOOLONG
check "255-byte name works" test "$(py_errno "open('$MNT/${long:1}','w').close()")" = OK
check "ENOTEMPTY" test "$(mkdir -p "$MNT/d/e"; py_errno "os.rmdir('$MNT/d')")" = ENOTEMPTY
check "EEXIST" test "$(py_errno "os.mkdir('$MNT/d')")" = EEXIST
check "EISDIR on unlink of dir" test "$(py_errno "os.unlink('$MNT/d')")" = EISDIR
check "ENOTDIR" test "$(touch "$MNT/f"; py_errno "os.listdir('$MNT/f')")" = ENOTDIR
check "ENODATA for missing xattr" test "$(py_errno "os.getxattr('$MNT/f','user.none')")" = ENODATA
check "xattr round trip" test "$(python3 -c "import os; os.setxattr('$MNT/f','user.k',b'v'); print(os.getxattr('$MNT/f','user.k').decode())")" = v
check "RENAME_NOREPLACE gives EEXIST" test "$(python3 -c "
import ctypes, os, errno
libc = ctypes.CDLL(None, use_errno=True)
r = libc.renameat2(-100, b'$MNT/f', -100, b'$MNT/d', 1)
print(errno.errorcode[ctypes.get_errno()] if r else 'OK')")" = EEXIST

# --- data paths --------------------------------------------------------------
head -c 3000000 /dev/urandom > "$WORK/data"
cp "$WORK/data" "$MNT/big"
check "large file round trip" cmp -s "$WORK/data" "$MNT/big"
check "fsync works" python3 -c "import os; f=os.open('$MNT/big', os.O_RDWR); os.write(f, b'z'); os.fsync(f); os.fdatasync(f)"
check "O_DIRECT|O_SYNC write" python3 -c "
import os, mmap
f = os.open('$MNT/direct', os.O_CREAT|os.O_RDWR|os.O_DIRECT|os.O_SYNC, 0o644)
buf = mmap.mmap(-1, 65536); buf.write(b'q'*65536)
assert os.pwrite(f, buf, 65536) == 65536
os.close(f)
assert open('$MNT/direct','rb').read()[65536:] == b'q'*65536"
check "truncate and sparse read" python3 -c "
import os
f = os.open('$MNT/sparse', os.O_CREAT|os.O_RDWR, 0o644)
os.pwrite(f, b'end', 10_000_000); os.ftruncate(f, 5_000_000)
assert os.fstat(f).st_size == 5_000_000
assert os.pread(f, 100, 4_999_000) == bytes(100)"
check "SEEK_DATA/SEEK_HOLE" python3 -c "
import os
f = os.open('$MNT/holes', os.O_CREAT|os.O_RDWR, 0o644)
os.pwrite(f, b'a'*4096, 1<<20)
assert os.lseek(f, 0, os.SEEK_DATA) == 1<<20, os.lseek(f, 0, os.SEEK_DATA)
assert os.lseek(f, 1<<20, os.SEEK_HOLE) == (1<<20) + 4096"
check "fallocate punch hole" python3 -c "
import os, ctypes
libc = ctypes.CDLL(None, use_errno=True)
f = os.open('$MNT/punch', os.O_CREAT|os.O_RDWR, 0o644)
os.write(f, b'b'*16384)
assert libc.fallocate(f, 3, ctypes.c_long(4096), ctypes.c_long(8192)) == 0, ctypes.get_errno()
assert os.pread(f, 16384, 0) == b'b'*4096 + bytes(8192) + b'b'*4096"
check "hard link and symlink" bash -c "ln '$MNT/big' '$MNT/big2' && ln -s big '$MNT/sym' && test \$(stat -c %h '$MNT/big') = 2 && cmp -s '$MNT/sym' '$MNT/big'"
check "rename over existing" bash -c "echo one > '$MNT/r1' && echo two > '$MNT/r2' && mv '$MNT/r1' '$MNT/r2' && test \"\$(cat '$MNT/r2')\" = one && test ! -e '$MNT/r1'"
check "d_ino equals st_ino" python3 -c "
import os
for e in os.scandir('$MNT'):
    assert e.inode() == os.lstat(e.path).st_ino, e.name"
check "nanosecond timestamps" python3 -c "
import os
os.utime('$MNT/f', ns=(1_000_000_123, 2_000_000_456))
st = os.stat('$MNT/f'); assert st.st_mtime_ns == 2_000_000_456, st.st_mtime_ns"
check "unlinked-while-open file stays usable" python3 -c "
import os
f = os.open('$MNT/gone', os.O_CREAT|os.O_RDWR, 0o644)
os.write(f, b'x'*100000); os.unlink('$MNT/gone')
os.pwrite(f, b'y', 5); assert os.pread(f, 6, 0) == b'xxxxxy'
os.close(f)"

"$BIRCH" umount "$MNT"
check "fsck clean after error paths and data ops" "$BIRCH" fsck "$IMG"

# --- synchronous unmount: 20 cycles ------------------------------------------
cycle_ok=1
for i in $(seq 1 20); do
  "$BIRCH" mount "${EXTRA_OPTS[@]}" "$IMG" "$MNT" || { cycle_ok=0; break; }
  if [[ $i -gt 1 ]]; then cmp -s "$WORK/cycle" "$MNT/cycle" || { echo "cycle $i: data of cycle $((i - 1)) missing"; cycle_ok=0; }; fi
  head -c $((100000 + i * 777)) /dev/urandom > "$WORK/cycle"
  cp "$WORK/cycle" "$MNT/cycle"
  "$BIRCH" umount "$MNT" || { cycle_ok=0; break; }
done
check "20 cycles of write, umount, immediate mount, verify" test $cycle_ok = 1
check "fsck clean after cycles" "$BIRCH" fsck "$IMG"

# umount(8) of a FUSE mount returns before the daemon's final commit, which holds the image
# lock until it is done; a mount right after it, read-only or not, waits for the lock instead of
# failing "image is in use". Here another process holds the lock for 2 s, as such a daemon would.
for opts in ro rw; do
  ((IMAGE_FILE)) || break
  flock -x "$IMG" sleep 2 &
  holder=$!
  sleep 0.3
  out=$("$BIRCH" mount "${EXTRA_OPTS[@]}" -o "$opts" "$IMG" "$MNT" 2>&1)
  rc=$?
  wait "$holder"
  if [[ $rc == 0 ]] && cmp -s "$WORK/cycle" "$MNT/cycle"; then
    ok "mount -o $opts waits for the image lock of a finishing daemon"
  else
    bad "mount -o $opts waits for the image lock of a finishing daemon (rc $rc: $out)"
  fi
  mountpoint -q "$MNT" && "$BIRCH" umount "$MNT"
done

# A writer still exiting holds the mount for a moment: birch umount waits for it (EBUSY is
# retried for a few seconds) instead of failing.
if "$BIRCH" mount "${EXTRA_OPTS[@]}" "$IMG" "$MNT"; then
  python3 -c "import time; f = open('$MNT/held', 'w'); f.write('x' * 100000); time.sleep(1.5)" &
  held=$!
  sleep 0.3
  check "birch umount waits for a file held open a moment longer" "$BIRCH" umount "$MNT"
  wait "$held"
  grep -q " $MNT " /proc/self/mountinfo && "$BIRCH" umount "$MNT"
else
  bad "mount for the busy umount test"
fi

# --- clear errors ------------------------------------------------------------
expect_fail() { local name=$1 pattern=$2; shift 2; local out; out=$("$@" 2>&1); local rc=$?; if [[ $rc -ne 0 && $out == *"$pattern"* ]]; then ok "$name"; else bad "$name (rc $rc: $out)"; fi; }
expect_fail "missing mountpoint" "does not exist" "$BIRCH" mount "$IMG" "$WORK/nowhere"
if ((IMAGE_FILE)); then
  expect_fail "missing image" "does not exist" "$BIRCH" mount "$WORK/none.img" "$MNT"
  head -c 1M /dev/zero > "$WORK/zero.img"
  expect_fail "not a birchfs image" "not a birchfs image" "$BIRCH" mount "$WORK/zero.img" "$MNT"
fi
# Output into a closed pipe (`birch inspect IMG tree fs | head`) ends the command by SIGPIPE,
# as any Unix tool, never a panic.
closed_pipe() {
  python3 - "$BIRCH" "$IMG" <<'PYEOF2'
import os, subprocess, sys
r, w = os.pipe()
os.close(r)
p = subprocess.run([sys.argv[1], "inspect", sys.argv[2], "super"], stdout=w, stderr=subprocess.PIPE)
sys.exit(0 if p.returncode == -13 and b"panicked" not in p.stderr else 1)
PYEOF2
}
check "inspect into a closed pipe ends by SIGPIPE, no panic" closed_pipe
"$BIRCH" mount "${EXTRA_OPTS[@]}" "$IMG" "$MNT"
mkdir -p "$WORK/mnt2" "$WORK/mnt3"
expect_fail "fsck refuses a mounted image" "in use" "$BIRCH" fsck "$IMG"
expect_fail "unknown mount option" "unknown mount option" "$BIRCH" mount "$IMG" "$WORK/mnt2" -o bogus
"$BIRCH" umount "$MNT"

# --- the same image mounted twice at once (xfstests generic/732): the second mount is a bind
# mount of the first (one daemon); either can be unmounted first ----------------------------
M2=$WORK/mnt2
M3=$WORK/mnt3
if ((!IMAGE_FILE)); then
  echo "skip: a second mount of a mounted $IMG (a bind mount of the first for image files; an RBD image is refused as in use)"
elif "$BIRCH" mount "$IMG" "$MNT" && "$BIRCH" mount "$IMG" "$M2"; then
  check "a second mount of an image is in the mount table as fuse.birch" \
    grep -q " $M2 .* - fuse.birch $IMG " /proc/self/mountinfo
  mkdir -p "$MNT/two/A" "$MNT/two/B"
  echo both > "$MNT/two/A/f"
  mv "$MNT/two/A/f" "$MNT/two/B/"
  check "the second mount sees the first's changes" test "$(cat "$M2/two/B/f")" = both
  mv "$M2/two/B/f" "$M2/two/A/"
  check "and the first the second's" test "$(cat "$MNT/two/A/f")" = both
  if "$BIRCH" mount "$IMG" "$M3" -o ro; then
    check "a read-only second mount reads" test "$(cat "$M3/two/A/f")" = both
    check "and refuses writes (EROFS)" test "$(py_errno "open('$M3/two/x','w')")" = EROFS
    check "while the first stays writable" test "$(py_errno "open('$MNT/two/x','w').close()")" = OK
    "$BIRCH" umount "$M3"
  else
    bad "a read-only second mount"
  fi
  "$BIRCH" umount "$MNT"
  check "after unmounting the first, the second still writes" \
    test "$(py_errno "open('$M2/two/y','w').write('y')")" = OK
  check "and reads" test "$(cat "$M2/two/A/f")" = both
  expect_fail "and the image stays in use" "in use" "$BIRCH" fsck "$IMG"
  "$BIRCH" umount "$M2"
  check "unmounting the last releases the image (fsck runs)" "$BIRCH" fsck "$IMG"
else
  bad "a second mount of a mounted image"
  "$BIRCH" umount "$MNT" 2>/dev/null
fi
served_ro="served read-only"
((IMAGE_FILE)) || served_ro="in use"   # an RBD image's lock refuses the second client
if "$BIRCH" mount "$IMG" "$MNT" -o ro; then
  expect_fail "a read-write mount of an image served read-only is refused" "$served_ro" \
    "$BIRCH" mount "$IMG" "$M2"
  "$BIRCH" umount "$MNT"
else
  bad "read-only mount"
fi

# --- fstab line and mount -t fuse.birch (through mount.fuse.birch) ----------------------------
if ((!IMAGE_FILE)); then
  # mount(8) runs the machine's mount.fuse.birch, which scripts/test.sh installs from the
  # default build (no RBD support); the remounts below use this build's helper.
  echo "skip fstab/mount -t tests for $IMG: the installed mount.fuse.birch is not this build"
elif command -v mount.fuse.birch >/dev/null || [[ -x /usr/sbin/mount.fuse.birch ]]; then
  echo "$IMG $MNT fuse.birch defaults,noatime 0 0" > "$WORK/fstab"
  if mount -T "$WORK/fstab" "$MNT" && grep -q " $MNT fuse.birch " /proc/mounts; then
    check "fstab line mounts (mount -T)" test -f "$MNT/cycle"
    "$BIRCH" umount "$MNT"
  else
    bad "fstab line mounts (mount -T)"
  fi
  if mount -t fuse.birch "$IMG" "$MNT"; then
    check "mount -t fuse.birch" cmp -s "$WORK/cycle" "$MNT/cycle"
    "$BIRCH" umount "$MNT"
  else
    bad "mount -t fuse.birch"
  fi
else
  echo "skip fstab/mount -t tests: mount.fuse.birch is not installed (scripts/test.sh installs it)"
fi

# --- atime modes (xfstests generic/003): strictatime from the mount options, and remounts with
# other atime flags through mount.fuse.birch (called as mount(8) would: a link of this binary,
# so the test does not depend on the machine-wide helper) --------------------------------------
ln -sf "$BIRCH" "$WORK/mount.fuse.birch"
atime_step() { # atime_step WHAT EXPECT(moved|same) ACTION...: runs ACTION, compares atime of $MNT/at
  local what=$1 expect=$2; shift 2
  local before after
  before=$(python3 -c "import os; print(os.stat('$MNT/at').st_atime_ns)")
  sleep 0.02
  "$@"
  after=$(python3 -c "import os; print(os.stat('$MNT/at').st_atime_ns)")
  if [[ $expect == moved ]]; then check "$what" test "$after" -gt "$before"
  else check "$what" test "$after" -eq "$before"; fi
}
read_at() { cat "$MNT/at" >/dev/null; }
remount_with() { "$WORK/mount.fuse.birch" "$IMG" "$MNT" -o "remount,$1"; }
if "$BIRCH" mount "$IMG" "$MNT" -o strictatime; then
  echo data > "$MNT/at"
  atime_step "strictatime: first read moves atime" moved read_at
  atime_step "strictatime: second read moves atime" moved read_at
  remount_with noatime
  check "remount,noatime is in the mount table" grep -q " $MNT .*noatime" /proc/self/mountinfo
  atime_step "remount,noatime: a read after a write does not move atime" same \
    bash -c "echo more >> '$MNT/at'; cat '$MNT/at' >/dev/null"
  remount_with ro
  remount_with rw
  atime_step "a remount without atime flags keeps noatime" same read_at
  remount_with relatime
  atime_step "remount,relatime: the first read after a write moves atime" moved \
    bash -c "echo more >> '$MNT/at'; sleep 0.02; cat '$MNT/at' >/dev/null"
  atime_step "remount,relatime: the second does not" same read_at
  remount_with strictatime
  atime_step "remount,strictatime: a read moves atime again" moved read_at
  # A read-write open that only fsyncs (xfs_io's default open, xfstests generic/392 and 468)
  # moves nothing, even under strictatime; an open for reading does.
  atime_step "strictatime: an O_RDWR open and fsync do not move atime" same \
    python3 -c "import os; fd = os.open('$MNT/at', os.O_RDWR); os.fsync(fd); os.close(fd)"
  atime_step "strictatime: an O_RDONLY open moves atime" moved \
    python3 -c "import os; os.close(os.open('$MNT/at', os.O_RDONLY))"
  "$BIRCH" umount "$MNT"
else
  bad "mount -o strictatime"
fi

# --- SIGTERM to the daemon: final commit, unmount, image released -----------------------------
"$BIRCH" mount "${EXTRA_OPTS[@]}" "$IMG" "$MNT"
head -c 300000 /dev/urandom > "$WORK/term"
cp "$WORK/term" "$MNT/term"
daemon=$(pgrep -f "birch mount -f $IMG" | head -1)
if [[ -n $daemon ]]; then
  kill -TERM "$daemon"
  for _ in $(seq 1 200); do kill -0 "$daemon" 2>/dev/null || break; sleep 0.05; done
  check "SIGTERM unmounts and the daemon exits" bash -c "! mountpoint -q '$MNT' && ! kill -0 $daemon 2>/dev/null"
  "$BIRCH" mount "${EXTRA_OPTS[@]}" "$IMG" "$MNT"
  check "data written before SIGTERM is there" cmp -s "$WORK/term" "$MNT/term"
  "$BIRCH" umount "$MNT"
else
  bad "SIGTERM test: daemon pid not found"
fi
# --- SIGKILL after fsync: the log holds the file; fsck replays it in memory, mount replays it ---
"$BIRCH" mount "${EXTRA_OPTS[@]}" -o commit=0 "$IMG" "$MNT"
head -c 200000 /dev/urandom > "$WORK/killed"
python3 -c "
import os, sys
fd = os.open('$MNT/killed', os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
os.write(fd, open('$WORK/killed', 'rb').read())
os.fsync(fd)
"
daemon=$(pgrep -f "birch mount -f $IMG" | head -1)
if [[ -n $daemon ]]; then
  killed_sock=$(sock_of)
  kill -KILL "$daemon"
  for _ in $(seq 1 200); do kill -0 "$daemon" 2>/dev/null || break; sleep 0.05; done
  umount -l "$MNT" 2>/dev/null
  check "a killed daemon's control socket is stale (ECONNREFUSED)" test "$(sock_say "$killed_sock" sync)" = ECONNREFUSED
  out=$("$BIRCH" fsck "$IMG" 2>&1); rc=$?
  seen=no
  [[ $rc -eq 0 && $out == *'wait for replay'* && $out == *'with the log replayed in memory'*', 0 findings'* ]] && seen=yes
  check "fsck after SIGKILL sees the pending log and checks it replayed in memory" test "$seen" = yes
  [[ $seen = yes ]] || echo "$out"
  # A read-only mount shows the fsync'd file too (the log replayed in memory), leaves the log
  # on the image and refuses remount,rw.
  if "$BIRCH" mount "${EXTRA_OPTS[@]}" -o ro "$IMG" "$MNT"; then
    check "the next mount's control socket answers (a stale one is replaced)" test "$(sock_say "$(sock_of)" sync)" = ok
    check "a read-only mount after SIGKILL shows the fsync'd data (log replayed in memory)" cmp -s "$WORK/killed" "$MNT/killed"
    if "$WORK/mount.fuse.birch" "$IMG" "$MNT" -o remount,rw 2>/dev/null; then
      bad "remount,rw of a mount whose log was replayed in memory was allowed"
    else
      ok "remount,rw of a mount whose log was replayed in memory is refused"
    fi
    "$BIRCH" umount "$MNT"
    out=$("$BIRCH" fsck "$IMG" 2>&1)
    check "and the log still waits for replay on the image" test "${out/wait for replay/}" != "$out"
  else
    bad "read-only mount after SIGKILL"
  fi
  "$BIRCH" mount "${EXTRA_OPTS[@]}" "$IMG" "$MNT"
  check "fsync'd data survives SIGKILL (log replay at mount)" cmp -s "$WORK/killed" "$MNT/killed"
  "$BIRCH" umount "$MNT"
else
  bad "SIGKILL test: daemon pid not found"
fi
# --- The writeback cache: `birch sync` makes pages the kernel holds dirty durable (the file is
# still open, so close has not written them back), and close(2) writes a file's pages back so
# the next commit holds them; both checked by SIGKILL of the daemon and a remount ---
"$BIRCH" mount "${EXTRA_OPTS[@]}" -o commit=0 "$IMG" "$MNT"
head -c 300000 /dev/urandom > "$WORK/cached-open"
head -c 300000 /dev/urandom > "$WORK/cached-closed"
python3 -c "
import os, subprocess, sys
fd = os.open('$MNT/cached-open', os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
os.write(fd, open('$WORK/cached-open', 'rb').read())
with open('$MNT/cached-closed', 'wb') as f:
    f.write(open('$WORK/cached-closed', 'rb').read())
sys.exit(subprocess.call(['$BIRCH', 'sync', '$MNT']))
" # the open fd is closed only when python exits, after the daemon has committed
daemon=$(pgrep -f "birch mount -f $IMG" | head -1)
if [[ -n $daemon ]]; then
  kill -KILL "$daemon"
  for _ in $(seq 1 200); do kill -0 "$daemon" 2>/dev/null || break; sleep 0.05; done
  umount -l "$MNT" 2>/dev/null
  "$BIRCH" mount "${EXTRA_OPTS[@]}" "$IMG" "$MNT"
  check "birch sync commits pages the kernel held dirty for an open file" cmp -s "$WORK/cached-open" "$MNT/cached-open"
  check "close(2) hands a file's cached pages to the daemon before birch sync commits" cmp -s "$WORK/cached-closed" "$MNT/cached-closed"
  "$BIRCH" umount "$MNT"
else
  bad "writeback SIGKILL test: daemon pid not found"
fi
# --- Shutdown: the FS_IOC_SHUTDOWN ioctl (what xfstests' godown sends) commits, then every
# request fails with EIO; a caller without CAP_SYS_ADMIN gets EPERM; umount works; the next
# mount finds what was written. `birch shutdown --now` keeps only what fsync made durable. ---
chmod 0755 "$WORK" # the unprivileged caller must reach the mountpoint
"$BIRCH" mount -o commit=0,allow_other "$IMG" "$MNT"
head -c 200000 /dev/urandom > "$WORK/sd-data"
cp "$WORK/sd-data" "$MNT/sd-closed"
shutdown_py="
import os, fcntl, errno, sys
try:
    fd = os.open('$MNT', os.O_RDONLY)
    fcntl.ioctl(fd, 0x8004587d, b'\0' * 4)
    print('OK')
except OSError as e:
    print(errno.errorcode[e.errno])
"
check "FS_IOC_SHUTDOWN by a user is EPERM" test "$(setpriv --reuid=65534 --regid=65534 --clear-groups /usr/bin/python3 -c "$shutdown_py")" = EPERM
check "FS_IOC_SHUTDOWN by root without CAP_SYS_ADMIN is EPERM" test "$(setpriv --bounding-set -sys_admin --inh-caps -sys_admin python3 -c "$shutdown_py")" = EPERM
check "an unknown ioctl is ENOTTY" test "$(python3 -c "
import os, fcntl, errno
fd = os.open('$MNT/sd-closed', os.O_RDONLY)
try:
    fcntl.ioctl(fd, 0x80086601, b'\0' * 8); print('OK')
except OSError as e:
    print(errno.errorcode[e.errno])")" = ENOTTY
check "FS_IOC_SHUTDOWN by root succeeds" test "$(python3 -c "$shutdown_py")" = OK
check "after shutdown a create is EIO" test "$(py_errno "open('$MNT/sd-new','w')")" = EIO
check "after shutdown a lookup is EIO" test "$(py_errno "os.stat('$MNT/sd-missing')")" = EIO
check "after shutdown a listing is EIO" test "$(py_errno "os.listdir('$MNT')")" = EIO
check "after shutdown statfs is EIO" test "$(py_errno "os.statvfs('$MNT')")" = EIO
check "after shutdown a second shutdown is EIO" test "$(python3 -c "$shutdown_py")" = EIO
check "umount after shutdown" "$BIRCH" umount "$MNT"
check "fsck clean after shutdown" "$BIRCH" fsck "$IMG"
"$BIRCH" mount -o commit=0 "$IMG" "$MNT"
check "shutdown committed what was written before it" cmp -s "$WORK/sd-data" "$MNT/sd-closed"
python3 -c "
import os
with open('$MNT/sd-fsynced', 'wb') as f:
    f.write(b'durable' * 1000); f.flush(); os.fsync(f.fileno())
with open('$MNT/sd-loose', 'wb') as f:
    f.write(b'lost' * 1000)
"
check "birch shutdown --now" "$BIRCH" shutdown --now "$MNT"
check "after birch shutdown --now a read is EIO" test "$(py_errno "open('$MNT/sd-fsynced','rb').read()")" = EIO
check "umount after birch shutdown --now" "$BIRCH" umount "$MNT"
"$BIRCH" mount "$IMG" "$MNT"
check "birch shutdown --now keeps what fsync acknowledged" test "$(cat "$MNT/sd-fsynced" 2>&1)" = "$(python3 -c "print('durable' * 1000, end='')")"
check "birch shutdown --now keeps nothing else" test ! -e "$MNT/sd-loose"
python3 -c "
import os
fd = os.open('$MNT/sd-open', os.O_CREAT | os.O_WRONLY, 0o644)
os.write(fd, b'still open' * 1000)
os.system('$BIRCH shutdown $MNT')
"
check "umount after birch shutdown" "$BIRCH" umount "$MNT"
"$BIRCH" mount "$IMG" "$MNT"
check "birch shutdown commits pages the kernel held dirty for an open file" test "$(cat "$MNT/sd-open" 2>&1)" = "$(python3 -c "print('still open' * 1000, end='')")"
"$BIRCH" umount "$MNT"
# --- fstrim (the FITRIM ioctl through the mount point or any directory of the mount; SEMANTICS
# §8): EPERM without CAP_SYS_ADMIN; on an image file (never discarded) fstrim(8) says "the
# discard operation is not supported"; on RBD, files written and deleted under -o discard=off
# (freed space never discarded by the commits) stay allocated in the cluster until fstrim, which
# reports the bytes it trimmed and leaves `rbd du` lower; fsck clean after. ---
"$BIRCH" mount -o allow_other,discard=off "$IMG" "$MNT"
mkdir -p "$MNT/trimdir"
fitrim_py() { # fitrim_py DIR: FITRIM over the whole device; prints OK BYTES or the errno's name
  echo "
import os, fcntl, errno, struct
try:
    fd = os.open('$1', os.O_RDONLY)
    out = fcntl.ioctl(fd, 0xc0185879, struct.pack('QQQ', 0, 2**64 - 1, 0))
    print('OK', struct.unpack('QQQ', out)[1])
except OSError as e:
    print(errno.errorcode[e.errno])
"
}
check "FITRIM by a user is EPERM" test "$(setpriv --reuid=65534 --regid=65534 --clear-groups /usr/bin/python3 -c "$(fitrim_py "$MNT")")" = EPERM
check "FITRIM by root without CAP_SYS_ADMIN is EPERM" test "$(setpriv --bounding-set -sys_admin --inh-caps -sys_admin python3 -c "$(fitrim_py "$MNT")")" = EPERM
if ((IMAGE_FILE)); then
  out=$(fstrim -v "$MNT" 2>&1)
  rc=$?
  check "fstrim on an image file: the discard operation is not supported" \
    test $rc -ne 0 -a -n "$(grep -F 'the discard operation is not supported' <<<"$out")"
  check "FITRIM on a subdirectory of an image file is EOPNOTSUPP" test "$(python3 -c "$(fitrim_py "$MNT/trimdir")")" = ENOTSUP # Python names errno 95 ENOTSUP
else
  rbd_used() { # bytes the cluster holds for the image
    rbd du --format json "${IMG#rbd:}" 2>/dev/null | python3 -c "import json, sys; print(sum(i['used_size'] for i in json.load(sys.stdin)['images']))"
  }
  dd if=/dev/urandom of="$MNT/trim-big" bs=1M count=64 conv=fsync status=none
  "$BIRCH" sync "$MNT"
  rm "$MNT/trim-big"
  for i in 1 2 3 4 5 6 7 8; do touch "$MNT/trim-t$i"; "$BIRCH" sync "$MNT"; done
  before=$(rbd_used)
  out=$(fstrim -v "$MNT" 2>&1)
  trimmed=$(sed -n 's/.*(\([0-9]*\) bytes) trimmed.*/\1/p' <<<"$out")
  after=$(rbd_used)
  echo "     fstrim: $out; rbd du: $before -> $after bytes"
  check "fstrim on RBD trims free space (64 MiB deleted)" test "${trimmed:-0}" -ge $((64 << 20))
  check "rbd du shows less used after fstrim" test "${after:-0}" -lt "$((${before:-0} - (32 << 20)))"
  check "FITRIM on a subdirectory trims too" test "$(python3 -c "$(fitrim_py "$MNT/trimdir")" | cut -d' ' -f1)" = OK
fi
"$BIRCH" umount "$MNT"
check "fsck clean after fstrim" "$BIRCH" fsck "$IMG"
# --- Snapshots through the mount (DESIGN §15.8, SEMANTICS §9): made, listed and deleted by
# `birch snapshot ... MNT`, browsed read-only at MNT/.snapshot/NAME (hidden from the root's
# listing, inode numbers carrying the snapshot id in bits 48..63), EBUSY for a deletion while a
# file is open in it, one mounted alone with -o ro,snapshot=NAME. ---
"$BIRCH" mount "${EXTRA_OPTS[@]}" "$IMG" "$MNT"
mkdir -p "$MNT/snapdir"
printf 'before' > "$MNT/snapdir/f" # in the kernel's writeback cache: create must syncfs first
ln -s f "$MNT/snapdir/l"
check "birch snapshot create MNT" "$BIRCH" snapshot create "$MNT" s1
printf 'after!' > "$MNT/snapdir/f"
check "ls MNT/.snapshot lists the snapshot" test "$(ls "$MNT/.snapshot" 2>&1)" = s1
check "ls MNT/.snapshot/s1 shows the tree" test "$(ls "$MNT/.snapshot/s1/snapdir" 2>&1 | tr '\n' ' ')" = "f l "
check "cat of a file in a snapshot" test "$(cat "$MNT/.snapshot/s1/snapdir/f" 2>&1)" = before
check "readlink in a snapshot" test "$(readlink "$MNT/.snapshot/s1/snapdir/l" 2>&1)" = f
check "the live file moved on" test "$(cat "$MNT/snapdir/f")" = 'after!'
check "a write in a snapshot is EROFS" test "$(py_errno "open('$MNT/.snapshot/s1/snapdir/f','w')")" = EROFS
check "a create in a snapshot is EROFS" test "$(py_errno "open('$MNT/.snapshot/s1/new','w')")" = EROFS
check "a rename out of a snapshot is EROFS" test "$(py_errno "os.rename('$MNT/.snapshot/s1/snapdir/f', '$MNT/stolen')")" = EROFS
check "mkdir in .snapshot is EROFS" test "$(py_errno "os.mkdir('$MNT/.snapshot/x')")" = EROFS
check "mkdir .snapshot in the root is EEXIST" test "$(py_errno "os.mkdir('$MNT/.snapshot')")" = EEXIST
check ".snapshot is not listed by ls -a" test -z "$(ls -a "$MNT" | grep -x .snapshot)"
check "a snapshot's inode numbers carry its id" test $(( $(stat -c %i "$MNT/.snapshot/s1/snapdir/f") >> 48 )) -eq 1
check "birch snapshot list MNT" test -n "$("$BIRCH" snapshot list "$MNT" | grep ' s1$')"
check "birch snapshot delete MNT is EBUSY while a file is open in the snapshot" python3 -c "
import subprocess, sys
f = open('$MNT/.snapshot/s1/snapdir/f', 'rb')
p = subprocess.run(['$BIRCH', 'snapshot', 'delete', '$MNT', 's1'], capture_output=True, text=True)
sys.exit(0 if p.returncode != 0 and 'open' in p.stderr and f.read() == b'before' else 1)"
check "birch snapshot delete MNT" "$BIRCH" snapshot delete "$MNT" s1
check "a deleted snapshot leaves the listing" test -z "$(ls "$MNT/.snapshot")"
check "a deleted snapshot's path is ENOENT" test "$(py_errno "os.stat('$MNT/.snapshot/s1')")" = ENOENT
# --- The control socket (/run/birch/ctl-MAJOR:MINOR.sock from the mount's st_dev): `birch`
# sends its commands there, root's alone; a user is refused (and `birch` falls back to the
# xattr, EPERM as before); gone after umount. ---
SOCK=$(sock_of)
check "the control socket exists while mounted" test -S "$SOCK"
check "the control socket is root's, mode 0600" test "$(stat -c '%U %a' "$SOCK")" = "root 600"
if command -v strace >/dev/null; then
  check "birch snapshot create goes through the control socket, not the xattr" bash -c "
    strace -f -qq -e trace=connect,setxattr -o '$WORK/strace' '$BIRCH' snapshot create '$MNT' viasock >/dev/null &&
    grep -q 'connect(.*$SOCK' '$WORK/strace' && ! grep -q trusted.birch.control '$WORK/strace'"
else
  echo "skip birch snapshot create through the control socket: no strace"
  "$BIRCH" snapshot create "$MNT" viasock >/dev/null
fi
check "a snapshot made through the socket is in MNT/.snapshot at once" test "$(ls "$MNT/.snapshot" 2>&1)" = viasock
check "a command on the socket answers ok" test "$(sock_say "$SOCK" 'snapshot-delete viasock')" = ok
check "a failed one answers its errno" test "$(sock_say "$SOCK" 'snapshot-delete viasock' | cut -d' ' -f1-2)" = "err 2"
check "a snapshot deleted through the socket leaves MNT/.snapshot at once" test -z "$(ls "$MNT/.snapshot")"
check "the control socket refuses a user" test "$(setpriv --reuid=65534 --regid=65534 --clear-groups bash -c "$(declare -f sock_say); sock_say '$SOCK' shutdown-now")" = EACCES
expect_fail "birch shutdown by a user is EPERM" "Operation not permitted" setpriv --reuid=65534 --regid=65534 --clear-groups "$BIRCH" shutdown --now "$MNT"
check "the control socket refuses root without CAP_SYS_ADMIN (err 1, EPERM)" test "$(setpriv --bounding-set -sys_admin --inh-caps -sys_admin bash -c "$(declare -f sock_say); sock_say '$SOCK' shutdown-now" | cut -d' ' -f1-2)" = "err 1"
expect_fail "birch shutdown by root without CAP_SYS_ADMIN is EPERM" "Operation not permitted" setpriv --bounding-set -sys_admin --inh-caps -sys_admin "$BIRCH" shutdown --now "$MNT"
check "and the mount still serves" test -d "$MNT/snapdir"
"$BIRCH" snapshot create "$MNT" s2 >/dev/null
printf 'later' > "$MNT/snapdir/f"
expect_fail "-o ro,snapshot= while the live filesystem is mounted says where it is" ".snapshot/s2" "$BIRCH" mount -o ro,snapshot=s2 "$IMG" "$WORK/mnt2"
"$BIRCH" umount "$MNT"
check "the control socket is gone after umount" test ! -e "$SOCK"
expect_fail "-o snapshot= without ro is refused" "-o ro,snapshot=s2" "$BIRCH" mount -o snapshot=s2 "$IMG" "$MNT"
check "birch mount -o ro,snapshot=NAME" "$BIRCH" mount -o ro,snapshot=s2 "$IMG" "$MNT"
check "the snapshot is the mount's root" test "$(cat "$MNT/snapdir/f" 2>&1)" = 'after!'
check "no .snapshot in a snapshot mounted alone" test "$(py_errno "os.stat('$MNT/.snapshot')")" = ENOENT
check "a change to a snapshot mounted alone is EROFS" test "$(py_errno "open('$MNT/x','w')")" = EROFS
"$BIRCH" umount "$MNT"
"$BIRCH" mount "${EXTRA_OPTS[@]}" "$IMG" "$MNT"
check "the live filesystem after the snapshot mount" test "$(cat "$MNT/snapdir/f" 2>&1)" = later
"$BIRCH" umount "$MNT"
check "fsck clean at the end" "$BIRCH" fsck "$IMG"

echo "mount-tests: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
