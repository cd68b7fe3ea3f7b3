#!/bin/bash
# Counts the FUSE requests of each W6 step (unpack, walk twice, read all, rm -rf) for birchfs
# and memfs_ll, by opcode, from their debug logs. docs/BENCHMARKS-HISTORY.md "Issue 18, session 8".
# Usage: sudo bench/tools/reqcount.sh [BIRCH]; needs the W6 tree and memfs_ll the harness builds.
# requests per step for birch (RUST_LOG=fuser=debug) and memfs_ll (-d): unpack, sync, warm walk, read all, rm -rf
T=/var/tmp/birchbench/w6/tree-10000-s6-v1.tar
count() { # logfile from-line
  tail -n +$2 $1 | grep -a -o "opcode: [A-Z_]*\|ino 0x[0-9a-f]* [A-Z_]*" | awk '{print $NF}' | sort | uniq -c | sort -rn | awk '{t+=$1; s=s $2 "=" $1 " "} END {print t, s}'
}
step() { # name logfile cmd...
  local name=$1 log=$2; shift 2
  sleep 0.5; local from=$(($(wc -l < $log) + 1))
  "$@" > /dev/null 2>&1; sleep 1
  echo "$name: $(count $log $from)"
}
run_target() {
  local t=$1 mnt=$2 log=$3
  step "$t unpack" $log tar -xf $T -C $mnt
  step "$t walk1" $log find $mnt -type f -printf "%s\n"
  step "$t walk2" $log find $mnt -type f -printf "%s\n"
  step "$t readall" $log sh -c "find $mnt -type f -print0 | xargs -0 cat"
  step "$t rm" $log rm -rf $mnt/tree
}
B=${1:-/work/main/target/release/birch}
mkdir -p /tmp/rc-b /tmp/rc-m
rm -f /tmp/rc.img; $B mkfs --size 2G /tmp/rc.img >/dev/null
RUST_LOG=fuser=debug $B mount -f /tmp/rc.img /tmp/rc-b > /tmp/rc-b.log 2>&1 & sleep 2
run_target birch /tmp/rc-b /tmp/rc-b.log
$B umount /tmp/rc-b
M=$(ls -d /var/tmp/birchbench/libfuse-*/build/example/memfs_ll | head -1)
LD_LIBRARY_PATH=$(dirname $(dirname $M))/lib $M -d -o writeback_cache,no_timeout /tmp/rc-m > /tmp/rc-m.log 2>&1 & sleep 2
run_target memfs_ll /tmp/rc-m /tmp/rc-m.log
umount /tmp/rc-m
