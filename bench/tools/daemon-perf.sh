#!/bin/bash
# daemon-perf.sh: the birchfs daemon's CPU and context switches per operation under sysbench
# fileio, as W4 of bench/run.sh runs it (bench/birchbench/workloads.py, w4_sysbench): 1,024
# files, 1 GiB in all, 8 KiB blocks, 64 threads, --file-io-mode=sync, --file-fsync-freq=0,
# and for the rndwr-fsyncall mode --file-fsync-all=on (fsync after every write).
# DESIGN §11.4 and §12.4 quote its figures.
#
# It makes its own image in a temporary directory, mounts it with `birch mount -f` (so the
# daemon's pid is known), runs `sysbench prepare`, syncs, then runs `sysbench run` under
# `perf stat -e task-clock,context-switches -p <daemon pid>` (and, with -r, `perf record -g`
# of the daemon), and prints sysbench's figures, the daemon's CPU and context switches per
# write (per write+fsync in rndwr-fsyncall mode) and the daemon counters that changed during
# the run (`birch stats --json`). The mount and the directory are removed on exit, failure
# included.
#
# Usage: bench/tools/daemon-perf.sh [-b BIRCH] [-t SECONDS] [-m MODE] [-T THREADS]
#                                   [-o MOUNTOPTS] [-r PERF_DATA]
#   -b BIRCH      the birch binary [target/release/birch of this repository]
#   -t SECONDS    length of the timed run [10]
#   -m MODE       rndwr, seqwr or rndwr-fsyncall (rndwr with --file-fsync-all=on) [rndwr-fsyncall]
#   -T THREADS    sysbench threads [64]
#   -o MOUNTOPTS  birch mount options (-o), e.g. writeback=off
#   -r PERF_DATA  also `perf record -F 999 -g` the daemon into PERF_DATA (read it with
#                 `perf report -i PERF_DATA`)
# Needs root (FUSE mounts, perf on another process), sysbench, perf and python3.
# Example (DESIGN §12.4): bench/tools/daemon-perf.sh -t 10 -m rndwr-fsyncall -r /var/tmp/w4.perf
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
birch="$here/../../target/release/birch"
seconds=10
mode=rndwr-fsyncall
threads=64
mount_opts=
perf_data=

usage() {
    sed -n '/^# Usage:/,/^# Example/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

while getopts "b:t:m:T:o:r:h" opt; do
    case $opt in
    b) birch=$OPTARG ;;
    t) seconds=$OPTARG ;;
    m) mode=$OPTARG ;;
    T) threads=$OPTARG ;;
    o) mount_opts=$OPTARG ;;
    r) perf_data=$OPTARG ;;
    *) usage ;;
    esac
done
shift $((OPTIND - 1))
[ $# -eq 0 ] || usage

case $mode in
rndwr | seqwr)
    sb_mode=$mode
    fsync_all=()
    ;;
rndwr-fsyncall)
    sb_mode=rndwr
    fsync_all=(--file-fsync-all=on)
    ;;
*)
    echo "daemon-perf: unknown mode $mode (rndwr, seqwr, rndwr-fsyncall)" >&2
    exit 2
    ;;
esac
[[ $seconds =~ ^[1-9][0-9]*$ ]] || { echo "daemon-perf: -t needs whole seconds" >&2; exit 2; }
[[ $threads =~ ^[1-9][0-9]*$ ]] || { echo "daemon-perf: -T needs a thread count" >&2; exit 2; }
[ -x "$birch" ] || {
    echo "daemon-perf: no birch binary at $birch (cargo build --release -p birch-tools)" >&2
    exit 2
}
for tool in sysbench perf python3 mountpoint; do
    command -v $tool >/dev/null || { echo "daemon-perf: $tool not found" >&2; exit 2; }
done
if [ -n "$perf_data" ]; then
    perf_data=$(realpath -m "$perf_data")
fi

work=$(mktemp -d "${TMPDIR:-/var/tmp}/daemon-perf.XXXXXX")
img=$work/birch.img
mnt=$work/mnt
daemon=
perf_stat=
perf_rec=

cleanup() {
    local rc=$?
    set +e
    cd /
    for p in $perf_stat $perf_rec; do
        kill -INT "$p" 2>/dev/null && wait "$p" 2>/dev/null
    done
    if mountpoint -q "$mnt"; then
        "$birch" umount "$mnt" || fusermount3 -u "$mnt" || umount -l "$mnt"
    fi
    if [ -n "$daemon" ] && kill -0 "$daemon" 2>/dev/null; then
        # Unmounted, the daemon makes its final commit and exits; give it time, then stop it.
        for _ in $(seq 100); do
            kill -0 "$daemon" 2>/dev/null || break
            sleep 0.1
        done
        kill "$daemon" 2>/dev/null
    fi
    [ -n "$daemon" ] && wait "$daemon" 2>/dev/null
    if [ $rc -ne 0 ] && [ -s "$work/daemon.log" ]; then
        echo "daemon-perf: failed; the daemon's log:" >&2
        tail -n 20 "$work/daemon.log" >&2
    fi
    rm -rf "$work"
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir "$mnt"
"$birch" mkfs --size 4G "$img" >/dev/null
mount_args=()
[ -z "$mount_opts" ] || mount_args=(-o "$mount_opts")
"$birch" mount -f "$img" "$mnt" "${mount_args[@]}" 2>"$work/daemon.log" &
daemon=$!
for _ in $(seq 600); do
    mountpoint -q "$mnt" && break
    kill -0 "$daemon" 2>/dev/null || { echo "daemon-perf: the mount daemon exited" >&2; exit 1; }
    sleep 0.1
done
mountpoint -q "$mnt" || { echo "daemon-perf: the mount did not come up in 60 s" >&2; exit 1; }

sb=(sysbench fileio --file-num=1024 --file-total-size=1G --file-block-size=8K
    --file-test-mode="$sb_mode" --file-fsync-freq=0 --file-io-mode=sync --threads="$threads"
    --time="$seconds" --events=0 --percentile=99 "${fsync_all[@]}")
echo "daemon-perf: $(${birch} --version 2>/dev/null || echo birch), mode $mode, $seconds s, $threads threads${mount_opts:+, -o $mount_opts}"
echo "\$ ${sb[*]} run"
cd "$mnt"
"${sb[@]}" prepare >"$work/prepare.txt"
# The prepared files on disk before the timed part, as the harness does.
sync -f .
"$birch" sync "$mnt"
"$birch" stats --json "$mnt" >"$work/stats.before.json"

if [ -n "$perf_data" ]; then
    perf record -q -F 999 -g -o "$perf_data" -p "$daemon" 2>"$work/perf-record.txt" &
    perf_rec=$!
fi
perf stat -x, -e task-clock,context-switches -p "$daemon" -o "$work/perf-stat.txt" &
perf_stat=$!
sleep 0.2
"${sb[@]}" run >"$work/run.txt"
kill -INT $perf_stat
wait $perf_stat || true
perf_stat=
if [ -n "$perf_rec" ]; then
    kill -INT $perf_rec
    wait $perf_rec || true
    perf_rec=
fi
"$birch" stats --json "$mnt" >"$work/stats.after.json"

grep -E "writes/s|fsyncs/s|written, MiB|total time|avg:|99th|max:" "$work/run.txt"
python3 - "$work" "$mode" <<'PY'
import json, re, sys
work, mode = sys.argv[1], sys.argv[2]
run = open(f"{work}/run.txt").read()

def grab(rx):
    m = re.search(rx, run)
    if not m:
        sys.exit(f"daemon-perf: no '{rx}' in sysbench's output")
    return float(m.group(1))

secs = grab(r"total time:\s+([\d.]+)s")
writes = grab(r"writes/s:\s+([\d.]+)") * secs
fsyncs = grab(r"fsyncs/s:\s+([\d.]+)") * secs
stat = {}
for line in open(f"{work}/perf-stat.txt"):
    f = line.strip().split(",")
    if len(f) > 2 and f[0] and f[0][0].isdigit():
        stat[f[2]] = float(f[0])
cpu_ms, switches = stat.get("task-clock"), stat.get("context-switches")
if cpu_ms is None or switches is None or not writes:
    sys.exit(f"daemon-perf: no figures (perf stat: {stat}, writes {writes:.0f})")
per = "write+fsync" if mode.endswith("fsyncall") else "write"
print(f"daemon: {cpu_ms / 1000:.2f} s CPU, {switches:.0f} context switches over "
      f"{writes:.0f} writes and {fsyncs:.0f} fsyncs")
print(f"daemon per {per}: {cpu_ms * 1000 / writes:.1f} us CPU, "
      f"{switches / writes:.2f} context switches")
a = json.load(open(f"{work}/stats.before.json")).get("counters", {})
b = json.load(open(f"{work}/stats.after.json")).get("counters", {})
moved = {k: v - a.get(k, 0) for k, v in sorted(b.items())
         if isinstance(v, (int, float)) and v - a.get(k, 0)}
print("counters changed: " + " ".join(f"{k}={v}" for k, v in moved.items()))
PY
if [ -n "$perf_data" ]; then
    echo "perf record: $perf_data (perf report -i $perf_data --no-children)"
fi
