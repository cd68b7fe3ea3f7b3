#!/usr/bin/env bash
# Seed 001's workload, small, to compare two birch binaries side by side (the harness compares
# option sets of one binary; this compares builds). Each round mounts a fresh 2 GiB image with
# each binary in turn and runs fio: 32 threads, each rewriting its own 1 MiB region of ONE file
# with 64 KiB O_DIRECT writes for 6 s (add "sync" for O_DIRECT|O_SYNC). Prints MiB/s per run.
#
#   sudo bench/w2-binaries.sh OLD_BIRCH NEW_BIRCH [sync] [rounds]
set -euo pipefail
old=$1 new=$2 mode=${3:-nosync} rounds=${4:-2}
command -v fio >/dev/null || { echo "w2-binaries: needs fio (apt-get install fio)" >&2; exit 2; }
work=$(mktemp -d /var/tmp/birch-w2.XXXXXX)
mnt=$work/mnt; img=$work/img; mkdir -p "$mnt"
cleanup() { mountpoint -q "$mnt" && { "$new" umount "$mnt" 2>/dev/null || umount -l "$mnt"; }; rm -rf "$work"; }
trap cleanup EXIT
sync_flag=""; [[ $mode == sync ]] && sync_flag="--sync=1"
run() {
  local b=$1
  "$b" mkfs --force --size 2G "$img" >/dev/null
  "$b" mount "$img" "$mnt"
  fio --name=prep --filename="$mnt/f" --size=32M --rw=write --bs=1M --direct=1 --output=/dev/null >/dev/null 2>&1
  "$b" sync "$mnt"
  fio --name=w2 --filename="$mnt/f" --rw=randwrite --bs=64k --direct=1 $sync_flag --numjobs=32 \
    --thread --size=1M --offset_increment=1M --time_based --runtime=6 --group_reporting \
    --output-format=terse 2>/dev/null | awk -F';' '{printf "%.0f MiB/s\n", $48/1024}'
  "$b" umount "$mnt"
}
for r in $(seq 1 "$rounds"); do
  echo "round $r ($mode): old $(run "$old"), new $(run "$new")"
done
