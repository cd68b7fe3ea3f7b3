#!/usr/bin/env bash
# A stand-in for the `birch` binary, for testing these scripts' birch path
# before (or without) the real one: an ext4 image served over FUSE by fuse2fs
# (Debian package fuse2fs). It implements exactly the CLI contract the scripts
# assume from birch:
#
#   birch mkfs --force --size SIZE IMAGE    make a fresh image (SIZE like 1G)
#   birch mount IMAGE MNT [-o OPTS]         returns once MNT is live; serves in the background
#   birch umount MNT                        synchronous: returns after the daemon has flushed and exited
#   birch fsck IMAGE                        exit 0 = clean
#
#   BIRCH=tests/posix/mock-birch.sh tests/posix/pjdfstest.sh birch
#
# Its results are fuse2fs's, not birchfs's: use it only to check the harness.
set -euo pipefail
die() { echo "mock-birch: $*" >&2; exit 1; }
cmd=${1:-}
shift || true
case $cmd in
  mkfs)
    force=0 size=""
    while (($#)); do
      case $1 in
        --force) force=1 ;;
        --size) size=$2; shift ;;
        -*) die "mkfs: unknown option $1" ;;
        *) img=$1 ;;
      esac
      shift
    done
    [[ -n ${img:-} && -n $size ]] || die "usage: mkfs --force --size SIZE IMAGE"
    [[ -e $img && $force == 0 ]] && die "$img exists (use --force)"
    rm -f "$img"
    truncate -s "$size" "$img"
    mkfs.ext4 -q -F "$img"
    ;;
  mount)
    img=${1:?usage: mount IMAGE MNT [-o OPTS]} mnt=${2:?usage: mount IMAGE MNT [-o OPTS]}
    shift 2
    opts=default_permissions
    while (($#)); do
      case $1 in
        -o) opts+=",$2"; shift ;;
        *) die "mount: unknown argument $1" ;;
      esac
      shift
    done
    [[ -d $mnt ]] || die "mount point $mnt is not a directory"
    # fuse2fs daemonizes once the mount is live.
    fuse2fs "$img" "$mnt" -o "$opts" >/dev/null
    mnt_abs=$(realpath "$mnt")
    for _ in $(seq 100); do
      awk -v m="$mnt_abs" '$5 == m { f = 1 } END { exit !f }' /proc/self/mountinfo && exit 0
      sleep 0.1
    done
    die "fuse2fs did not mount $mnt"
    ;;
  umount)
    mnt=$(realpath "${1:?usage: umount MNT}")
    src=$(awk -v m="$mnt" '$5 == m { print $(NF - 1) }' /proc/self/mountinfo | tail -n1)
    pids=$(pgrep -x fuse2fs -a | awk -v s="$src" -v m="$mnt" 'index($0, " " m) || index($0, s) { print $1 }' || true)
    fusermount3 -u "$mnt"
    # Synchronous: wait for the daemon to finish writing the image.
    for p in $pids; do
      while kill -0 "$p" 2>/dev/null; do sleep 0.1; done
    done
    ;;
  fsck)
    e2fsck -fn "${1:?usage: fsck IMAGE}"
    ;;
  *)
    die "usage: mock-birch.sh mkfs|mount|umount|fsck ..."
    ;;
esac
