#!/usr/bin/env bash
# Spike for issue 42 item 5: does an NFSv3 file handle that NFS-Ganesha 4.3 (FSAL_VFS) gave out
# for a file on a birch FUSE mount survive a remount of the same image that gets another st_dev?
#
# FSAL_VFS puts an fsid in every handle (src/FSAL/localfs.c posix_get_fsid): the device's UUID
# (blkid), else statfs f_fsid, else st_dev. A FUSE mount has no block device and reports f_fsid
# 0, so the fsid is st_dev, an anonymous device number the kernel hands out at each mount.
# Failover to another node, or a remount here that gets another number, should make every handle
# a client holds STALE, whatever Export_Id and Filesystem_Id say.
#
# What it does (ganesha on 127.0.0.1:2049, the export /birch with a fixed Filesystem_Id):
#   1. mkfs + mount an image (mount A), a file and a directory in it; their NFSv3 handles, in hex
#      and decoded (export id, fsid type, fsid), and the mount's st_dev (and the file's NFSv4
#      handle, presented with PUTFH + READ at each step below);
#   2. ganesha stopped, birch unmounted, a throw-away birch image mounted (it takes the freed
#      st_dev and stays mounted), the first image mounted again at the same path (mount B,
#      another st_dev: asserted), ganesha started with the same configuration; the saved handles
#      presented (GETATTR, READ, READDIR) and the answers printed, with fresh handles for the
#      same paths to show what changed in them;
#   3. the same, but with the throw-away mount gone and the image mounted so that it gets mount
#      A's st_dev back (mount C): the accidental pass;
#   4. the throw-away image (the same names and inode numbers, other bytes) mounted at the
#      export path (mount D): the saved handles must not reach its files (STALE).
# NFS_SPIKE_FSID_TYPE=Major64 runs the same with `fsid_type = Major64` in the export's FSAL
# block (see below): the fsid in the handles is then the device's major alone, 0 for every FUSE
# mount, so it no longer changes with st_dev.
# Prints a RESULT line. Exits 0 when it ran (this demonstrates a behaviour, it is not a
# pass/fail test), 1 when a step failed (a mount, ganesha, st_dev not different when it must
# be), 77 when it cannot run here. Cleans up what it started (trap).
#
# Needs root and /dev/fuse. Works in NFS_SPIKE_DIR (default /tmp/nfs-spike).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIRCH=${BIRCH:-$(pwd)/target/release/birch}
DIR=${NFS_SPIKE_DIR:-/tmp/nfs-spike}
SERVER=127.0.0.1
FSID=4242.42 # Filesystem_Id of the export: the same in every start
# NFS_SPIKE_FSID_TYPE=Major64 (or another FSAL_VFS fsid_type: One64, Two32, Device...) adds
# `fsid_type = ...;` to the export's FSAL block: FSAL_VFS then re-indexes the filesystem's fsid
# (src/FSAL/localfs.c change_fsid_type). Unset: stock behaviour.
FSID_TYPE=${NFS_SPIKE_FSID_TYPE:-}

skip() { echo "handle-spike: SKIP: $*"; exit 77; }
fail() { echo "handle-spike: FAILED: $* (logs: $LOGS)"; exit 1; }
[[ $(id -u) == 0 ]] || skip "needs root"
[[ -e /dev/fuse ]] || skip "/dev/fuse is absent"
[[ -x $BIRCH ]] || { echo "handle-spike: $BIRCH not built (cargo build --release -p birch-tools)"; exit 1; }
if pgrep -x ganesha.nfsd >/dev/null; then skip "another ganesha.nfsd is running"; fi
mkdir -p "$DIR"
source tests/nfs/lib.sh
nfs_setup handle-spike
if ss -ltn 2>/dev/null | grep -q ':2049 '; then skip "port 2049 is in use"; fi

LOGS=$DIR/logs
rm -rf "$LOGS"
mkdir -p "$LOGS" "$DIR/recovery" "$DIR/birch" "$DIR/throwaway"
# tests/nfs/ganesha.conf with its birch export only (the paragraph of Export_Id 2 dropped) and
# a Filesystem_Id set, to show that it does not reach the handles.
nfs_ganesha_conf "$DIR/ganesha.conf" birch_only=1 fsid="$FSID" ${FSID_TYPE:+fsid_type="$FSID_TYPE"} \
  || fail "ganesha.conf: an edit did not apply"

ganesha_pid=
birch_pid=
throw_pid=
rpcbind_pid=
holds=()

stop_ganesha() { nfs_stop_ganesha; }

unmount_fuse() { # mountpoint
  mountpoint -q "$1" || return 0
  "$BIRCH" umount "$1" >>"$LOGS/birch.log" 2>&1 || umount "$1" 2>/dev/null || umount -l "$1" 2>/dev/null || true
}

cleanup() {
  local st=$?
  set +e
  stop_ganesha
  unmount_fuse "$DIR/birch"
  unmount_fuse "$DIR/throwaway"
  [[ -n $birch_pid ]] && wait "$birch_pid" 2>/dev/null
  [[ -n $throw_pid ]] && wait "$throw_pid" 2>/dev/null
  for h in "${holds[@]}"; do umount "$h" 2>/dev/null; done
  rmdir "$DIR"/hold* 2>/dev/null
  [[ -n $rpcbind_pid ]] && { kill "$rpcbind_pid" 2>/dev/null; wait "$rpcbind_pid" 2>/dev/null; }
  rm -f "$DIR"/*.img
  exit $st
}
trap cleanup EXIT

client() { timeout 30 "$CLIENT" "$SERVER" "$@" 2>>"$LOGS/client.err"; }

birch_served() { [[ $(client v4fh /birch "" || true) =~ ^[0-9a-f]+$ ]]; }

start_ganesha() {
  nfs_start_ganesha "$DIR/ganesha.conf" "$DIR/ganesha.pid" "${NFS_SPIKE_GANESHA_LOG:-NIV_EVENT}" birch_served \
    && return 0
  echo "handle-spike: ganesha did not serve /birch; its log ends:"
  tail -20 "$LOGS/ganesha.log"
  return 1
}

mount_image() { # image mountpoint -> pid in $mounted_pid
  setsid "$BIRCH" mount -f -o allow_other "$1" "$2" </dev/null >>"$LOGS/birch.log" 2>&1 &
  mounted_pid=$!
  local i
  for ((i = 0; i < 100; i++)); do
    mountpoint -q "$2" && return 0
    kill -0 "$mounted_pid" 2>/dev/null || break
    sleep 0.1
  done
  echo "handle-spike: $1 did not mount at $2"; tail -5 "$LOGS/birch.log"
  return 1
}
mount_birch() { mount_image "$DIR/birch.img" "$DIR/birch" && birch_pid=$mounted_pid; }
umount_birch() {
  "$BIRCH" umount "$DIR/birch" >>"$LOGS/birch.log" 2>&1 || return 1
  wait "$birch_pid" 2>/dev/null || true
  birch_pid=
}

# Mounts birch so that it gets st_dev $1 back if that number is free: the kernel hands out the
# lowest free anonymous device number, so tmpfs mounts take the free ones below it first
# (as tests/nfs/nfs-test.sh does).
mount_birch_at_dev() {
  local want=$1 i d
  for ((i = 0; i < 32; i++)); do
    mkdir -p "$DIR/hold$i" && mount -t tmpfs -o size=1M none "$DIR/hold$i" || break
    d=$(stat -c %d "$DIR/hold$i")
    if [[ $d == "$want" ]]; then umount "$DIR/hold$i"; break; fi
    holds+=("$DIR/hold$i")
    ((d > want)) && break
  done
  local rc=0
  mount_birch || rc=$?
  for h in "${holds[@]}"; do umount "$h"; done
  holds=()
  rmdir "$DIR"/hold* 2>/dev/null || true
  return $rc
}

dev_of() { stat -c '%d (%Hd:%Ld)' "$1"; }

# The layout of a Ganesha 4.3 NFSv3 handle of FSAL_VFS on Linux (src/include/nfs_fh.h
# file_handle_v3, src/FSAL/FSAL_VFS/os/linux/handle_syscalls.c):
#   fhversion(1) fhflags(1) exportid(2) fs_len(1) | vfs flags = fsid_type | handle-type size bits (1)
#   fsid (8 bytes for FSID_TWO_UINT32 / FSID_DEVICE: major, minor as host-order u32; 16 for UUID)
#   kernel handle type (1, 2 or 4 bytes), the kernel's handle (FUSE: node id + generation)
le32() { # hex of 4 bytes, little-endian -> decimal
  local h=$1
  echo $((16#${h:6:2}${h:4:2}${h:2:2}${h:0:2}))
}
decode() { # hex handle -> one line
  local h=$1 t fl n k
  [[ $h =~ ^[0-9a-f]+$ ]] || { echo "(not a handle: $h)"; return; }
  t=$((16#${h:10:2} & 0x1f)) fl=$((16#${h:8:2}))
  local names=(NO_TYPE ONE_UINT64 MAJOR_64 TWO_UINT64 TWO_UINT32 DEVICE) sizes=(0 8 8 16 8 8)
  n=${sizes[t]:-0}
  local out="version 0x${h:0:2}, export id bytes ${h:4:4}, fsal length $fl, fsid type ${names[t]:-?}($t)"
  case $t in
    4 | 5) out+=", fsid ${h:12:16} = $(le32 "${h:12:8}").$(le32 "${h:20:8}")" ;;
    *) out+=", fsid ${h:12:$((2 * n))}" ;;
  esac
  # the kernel's handle type is 1 byte when the flags say HANDLE_TYPE_8 (0x40)
  k=$((12 + 2 * n))
  out+=", kernel handle type 0x${h:k:2}, kernel handle ${h:$((k + 2)):$((2 * fl - 2 * n - 4))}"
  echo "$out"
}

show() { echo "handle-spike: $*"; }

# Presents the handles saved on mount A; sets ANS_FILE / ANS_DIR (the answers, one line each).
present() { # label
  local fg fr dg dl
  fg=$(client v3fileid "$FH_FILE" || echo "transport error")
  fr=$(client v3read "$FH_FILE" || echo "transport error")
  dg=$(client v3fileid "$FH_DIR" || echo "transport error")
  dl=$(client v3ls "$FH_DIR" || echo "transport error")
  show "  $1: file handle: GETATTR -> $fg; GETATTR+READ -> $fr"
  show "  $1: dir handle:  GETATTR -> $dg; READDIR -> $dl"
  ANS_V4=$(client v4read "$FH4_FILE" || echo "transport error")
  show "  $1: NFSv4 file handle: PUTFH+READ -> $ANS_V4"
  ANS_FILE="$fg / $fr" ANS_DIR="$dg / $dl"
}

# A summary of the four answers: NFS3ERR_STALE, OK (the right file: fileid and bytes), or what came.
v4verdict() {
  case $ANS_V4 in
    "ERR STALE 70") echo "NFS4ERR_STALE" ;;
    "OK $DATA") echo "OK" ;;
    *) echo "other ($ANS_V4)" ;;
  esac
}
verdict() {
  local want_f="OK $INO_FILE / OK $DATA" want_d="OK $INO_DIR / OK inside"
  if [[ $ANS_FILE == "ERR STALE 70 / ERR STALE 70" && $ANS_DIR == "ERR STALE 70 / ERR STALE 70" ]]; then
    echo "NFS3ERR_STALE"
  elif [[ $ANS_FILE == "$want_f" && $ANS_DIR == "$want_d" ]]; then
    echo "OK"
  else
    echo "other (file: $ANS_FILE; dir: $ANS_DIR)"
  fi
}

# --- rpcbind, mount A, ganesha -----------------------------------------------------------------
if ! pgrep -x rpcbind >/dev/null; then
  nfs_start_rpcbind "$LOGS/rpcbind.log" || skip "rpcbind does not start"
fi
"$BIRCH" mkfs --size 128M "$DIR/birch.img" >>"$LOGS/birch.log" 2>&1 || fail "mkfs"
"$BIRCH" mkfs --size 64M "$DIR/throwaway.img" >>"$LOGS/birch.log" 2>&1 || fail "mkfs of the throw-away image"
mount_birch || fail "mount A"
DATA="a file whose handle is kept across remounts"
printf %s "$DATA" >"$DIR/birch/file"
mkdir "$DIR/birch/dir"
: >"$DIR/birch/dir/inside"
sync -f "$DIR/birch"
INO_FILE=$(stat -c %i "$DIR/birch/file") INO_DIR=$(stat -c %i "$DIR/birch/dir")
DEV_A=$(stat -c %d "$DIR/birch")
start_ganesha || skip "ganesha cannot start here (log: $LOGS/ganesha.log)"

echo "== mount A: handles taken"
show "nfs-ganesha $(dpkg-query -W -f='${Version}' nfs-ganesha 2>/dev/null || echo '?'), export /birch: Export_Id 1, Filesystem_Id $FSID, FSAL fsid_type ${FSID_TYPE:-(not set)}"
show "mount A st_dev: $(dev_of "$DIR/birch"); statfs f_fsid: $(stat -f -c %i "$DIR/birch")"
show "file inode $INO_FILE, dir inode $INO_DIR"
FH_FILE=$(client v3fh /birch file) FH_DIR=$(client v3fh /birch dir)
[[ $FH_FILE =~ ^[0-9a-f]+$ && $FH_DIR =~ ^[0-9a-f]+$ ]] || fail "no handles: file '$FH_FILE', dir '$FH_DIR'"
FH4_FILE=$(client v4fh /birch file)
[[ $FH4_FILE =~ ^[0-9a-f]+$ ]] || fail "no NFSv4 handle: '$FH4_FILE'"
show "NFSv4 file handle A: $FH4_FILE"
show "file handle A: $FH_FILE"
show "               $(decode "$FH_FILE")"
show "dir handle A:  $FH_DIR"
show "               $(decode "$FH_DIR")"
present "mount A, same ganesha"
[[ $(verdict) == OK ]] || fail "the handles do not work on the mount they came from: $(verdict)"

# --- mount B: another st_dev -------------------------------------------------------------------
echo "== mount B: ganesha stopped, unmount, a throw-away FUSE mount takes the freed st_dev, the image mounted again"
stop_ganesha
umount_birch || fail "unmount A"
mount_image "$DIR/throwaway.img" "$DIR/throwaway" || fail "throw-away mount"
throw_pid=$mounted_pid
# The same names in the throw-away image (the same inode numbers, other bytes), for mount D.
printf %s "the throw-away image's file" >"$DIR/throwaway/file"
mkdir "$DIR/throwaway/dir"
: >"$DIR/throwaway/dir/other"
show "throw-away mount st_dev: $(dev_of "$DIR/throwaway"); its file inode $(stat -c %i "$DIR/throwaway/file"), dir inode $(stat -c %i "$DIR/throwaway/dir")"
mount_birch || fail "mount B"
DEV_B=$(stat -c %d "$DIR/birch")
show "mount B st_dev: $(dev_of "$DIR/birch") (mount A's was $DEV_A); file inode $(stat -c %i "$DIR/birch/file"), dir inode $(stat -c %i "$DIR/birch/dir")"
[[ $DEV_B != "$DEV_A" ]] || fail "mount B got mount A's st_dev $DEV_A although the throw-away mount holds another number"
start_ganesha || fail "ganesha did not start again"
sync
echo 3 >/proc/sys/vm/drop_caches
present "mount B, ganesha restarted"
RES_B=$(verdict) V4_B=$(v4verdict)
NB_FILE=$(client v3fh /birch file) NB_DIR=$(client v3fh /birch dir)
show "fresh file handle B: $NB_FILE"
show "                     $(decode "$NB_FILE")"
show "fresh dir handle B:  $NB_DIR"
show "                     $(decode "$NB_DIR")"
if [[ $NB_FILE == "$FH_FILE" && $NB_DIR == "$FH_DIR" ]]; then
  show "A and B handles are identical"
elif [[ ${NB_FILE:0:12}${NB_FILE:28} == "${FH_FILE:0:12}${FH_FILE:28}" && ${NB_FILE:12:16} != "${FH_FILE:12:16}" ]]; then
  show "A and B handles differ only in the fsid bytes (${FH_FILE:12:16} -> ${NB_FILE:12:16})"
else
  show "A and B handles differ elsewhere than in the fsid bytes too"
fi

# --- mount C: mount A's st_dev back ------------------------------------------------------------
echo "== mount C: ganesha stopped, unmount, the throw-away mount gone, the image mounted again on mount A's st_dev"
stop_ganesha
umount_birch || fail "unmount B"
unmount_fuse "$DIR/throwaway"
wait "$throw_pid" 2>/dev/null || true
throw_pid=
mount_birch_at_dev "$DEV_A" || fail "mount C"
DEV_C=$(stat -c %d "$DIR/birch")
show "mount C st_dev: $(dev_of "$DIR/birch") (mount A's was $DEV_A)"
start_ganesha || fail "ganesha did not start again"
sync
echo 3 >/proc/sys/vm/drop_caches
present "mount C, ganesha restarted"
RES_C=$(verdict) V4_C=$(v4verdict)

# --- mount D: another image at the export path --------------------------------------------------
# What keeps a handle from reaching another filesystem that the export path now holds: with the
# stock fsid only an st_dev that differs by luck; birch's generation is salted per filesystem
# (docs/SEMANTICS.md), so its kernel handle (node id + generation) must not resolve there.
echo "== mount D: ganesha stopped, unmount, the throw-away image (same inode numbers) mounted at the export path"
stop_ganesha
umount_birch || fail "unmount C"
mount_image "$DIR/throwaway.img" "$DIR/birch" || fail "mount D"
birch_pid=$mounted_pid
DEV_D=$(stat -c %d "$DIR/birch")
show "mount D st_dev: $(dev_of "$DIR/birch"); file inode $(stat -c %i "$DIR/birch/file"), dir inode $(stat -c %i "$DIR/birch/dir")"
start_ganesha || fail "ganesha did not start again"
sync
echo 3 >/proc/sys/vm/drop_caches
present "mount D (another image), ganesha restarted"
RES_D=$(verdict) V4_D=$(v4verdict)
stop_ganesha

if [[ $DEV_C == "$DEV_A" ]]; then same="with the same st_dev ($DEV_A -> $DEV_C)"; else same="with st_dev $DEV_A -> $DEV_C (the same could not be had)"; fi
echo
echo "RESULT: handle after a remount with a different st_dev ($DEV_A -> $DEV_B): $RES_B; $same: $RES_C;" \
  "another image at the export path (st_dev $DEV_D): $RES_D" \
  "(NFSv4 file handle: $V4_B; $V4_C; $V4_D)" \
  "(Export_Id 1, Filesystem_Id $FSID, fsid_type ${FSID_TYPE:-not set})"
exit 0
