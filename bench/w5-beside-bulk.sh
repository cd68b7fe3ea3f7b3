#!/usr/bin/env bash
# W5's append + fsync latency on a fresh birch mount, alone and then beside a bulk writer (dd of
# 2.5 GB to another file of the same mount): the check that the daemon's dirty limit keeps
# fsync latency bounded (docs/BENCHMARKS-HISTORY.md, issue 18 session 6). Needs root.
#   bench/w5-beside-bulk.sh [BIRCH] [MOUNT_OPTS]      e.g. bench/w5-beside-bulk.sh target/release/birch buffer=off
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
B=$(realpath "${1:-$HERE/../target/release/birch}")
O=${2:-}
work=$(mktemp -d /var/tmp/w5bulk.XXXXXX)
img=$work/img; mnt=$work/mnt
mkdir -p "$mnt"
trap '"$B" umount "$mnt" 2>/dev/null || true; rm -rf "$work"' EXIT
"$B" mkfs --size 4G "$img" >/dev/null
"$B" mount "$img" "$mnt" ${O:+-o "$O"}
fmt='import json,sys; d=json.load(sys.stdin); print("p50 %.2f p99 %.2f ms" % (d["p50_ms"], d["p99_ms"]))'
alone=$(python3 "$HERE/birchbench.py" --_w5 "$mnt/a" file 8 100000 | python3 -c "$fmt")
dd if=/dev/zero of="$mnt/bulk" bs=1M count=2500 2>/dev/null &
bulk=$!
sleep 1
beside=$(python3 "$HERE/birchbench.py" --_w5 "$mnt/b" file 8 100000 | python3 -c "$fmt")
wait $bulk
echo "[${O:-defaults}] alone: $alone | beside a bulk writer: $beside"
