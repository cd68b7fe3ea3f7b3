#!/usr/bin/env bash
# `birch stats` on a real mount: `--json` has the counters, the gauges (dirty bytes, log fill,
# free space), the cache hit rate and the commit and fsync latencies; counters move after
# writes, fsyncs and a commit (`birch sync`); the table and `--watch --count 2` print; a
# directory that is not a birchfs mount is a clear error (exit 1).
# Skips (exit 77) when not root or without /dev/fuse.
set -uo pipefail
BIRCH=${BIRCH:-$(pwd)/target/release/birch}
if [[ ! -e /dev/fuse ]]; then echo "stats-test: SKIP: /dev/fuse is absent"; exit 77; fi
if [[ $(id -u) != 0 ]]; then echo "stats-test: SKIP: needs root (trusted.birch.stats)"; exit 77; fi
[[ -x $BIRCH ]] || { echo "stats-test: $BIRCH not built"; exit 1; }

WORK=$(mktemp -d /var/tmp/birch-stats-test.XXXXXX)
MNT=$WORK/mnt
IMG=$WORK/disk.img
mkdir -p "$MNT"
# Cleanup unmounts through the repository's one mount helper (bench/birchbench/mounts.py):
# `birch umount` (60 s), fusermount3 -u, umount, then the FUSE connection aborted, the lazy
# unmounts, and the daemon of the mount point killed if it is still there.
MOUNTS_PY=$(cd "$(dirname "$0")/../.." && pwd)/bench/birchbench/mounts.py
cleanup() {
  python3 "$MOUNTS_PY" unmount --fuse --abort --birch "$BIRCH" --birch-timeout 60 --timeout 30 "$MNT"
  rm -rf "$WORK"
}
trap cleanup EXIT
FAIL=0
ok() { echo "ok   $*"; }
bad() { echo "FAIL $*"; FAIL=1; }

"$BIRCH" mkfs --size 256M "$IMG" >/dev/null || { echo "stats-test: mkfs failed"; exit 1; }
# commit=0: no background commits, so the commit counter moves only when the test commits.
"$BIRCH" mount -o commit=0 "$IMG" "$MNT" || { echo "stats-test: mount failed"; exit 1; }

"$BIRCH" stats --json "$MNT" >"$WORK/before.json" || bad "birch stats --json exited $?"
# 4 MiB buffered, then 16 small fsync'd writes, read back at once.
head -c $((4 << 20)) /dev/urandom >"$MNT/big"
python3 - "$MNT/small" <<'EOF'
import os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY, 0o644)
for i in range(16):
    os.pwrite(fd, b"s" * 4096, i * 4096)
    os.fsync(fd)
os.close(fd)
EOF
cat "$MNT/big" "$MNT/small" >/dev/null
"$BIRCH" stats --json "$MNT" >"$WORK/written.json" || bad "birch stats --json exited $?"
"$BIRCH" sync "$MNT"
"$BIRCH" stats --json "$MNT" >"$WORK/synced.json" || bad "birch stats --json exited $?"

if python3 - "$WORK" <<'EOF'
import json, sys
w = sys.argv[1]
before, written, synced = (json.load(open(f"{w}/{n}.json")) for n in ("before", "written", "synced"))
problems = []
for name, s in (("before", before), ("written", written), ("synced", synced)):
    for key in ("mountpoint", "counters", "cache_hit_rate", "log_fill", "free_fraction", "latency"):
        if key not in s:
            problems.append(f"{name}: no {key}")
    for key in ("commits", "fsyncs", "bytes_written", "cache_hits", "cache_misses", "dirty_bytes",
                "log_used_bytes", "log_size_bytes", "free_bytes", "size_bytes", "fuse_dev_requests"):
        if key not in s.get("counters", {}):
            problems.append(f"{name}: no counter {key}")
    for lat in ("commit_latency", "fsync_latency"):
        for key in ("count", "p50_us", "p90_us", "p99_us"):
            if key not in s.get("latency", {}).get(lat, {}):
                problems.append(f"{name}: no {lat}.{key}")
c0, c1, c2 = before["counters"], written["counters"], synced["counters"]
def want(cond, text):
    if not cond:
        problems.append(text)
want(c1["fsyncs"] - c0["fsyncs"] == 16, f"fsyncs moved by {c1['fsyncs'] - c0['fsyncs']}, expected 16")
want(written["latency"]["fsync_latency"]["count"] - before["latency"]["fsync_latency"]["count"] == 16,
     "the fsync latency histogram did not count 16 fsyncs")
want(written["latency"]["fsync_latency"]["p50_us"] is not None, "no fsync p50")
want(c1["log_batches"] > c0["log_batches"], "log_batches did not move after fsyncs")
want(c1["log_used_bytes"] > 0, "log_used_bytes is 0 after logged fsyncs")
want(c1["dirty_bytes"] > 0, "dirty_bytes is 0 with 4 MiB buffered")
want(c2["commits"] > c1["commits"], "birch sync did not move commits")
want(synced["latency"]["commit_latency"]["count"] > 0, "no commit latency after birch sync")
want(c2["dirty_bytes"] == 0, f"dirty_bytes {c2['dirty_bytes']} after birch sync")
# Requests by opcode: the 16 fsyncs are 16 FSYNC requests, and no opcode counts more requests
# than were served in all.
want(c1.get("fuse_op_fsync", 0) - c0.get("fuse_op_fsync", 0) == 16,
     f"fuse_op_fsync moved by {c1.get('fuse_op_fsync', 0) - c0.get('fuse_op_fsync', 0)}, expected 16")
want(c1.get("fuse_op_create", 0) - c0.get("fuse_op_create", 0) >= 2, "fuse_op_create did not count 2 creates")
served = c2["fuse_dev_requests"] + c2.get("fuse_uring_requests", 0)
by_op = sum(v for k, v in c2.items() if k.startswith("fuse_op_"))
want(0 < by_op <= served, f"requests by opcode {by_op}, served {served}")
want(c2["bytes_written"] - c0["bytes_written"] >= 4 << 20, "bytes_written moved less than 4 MiB")
want(c2["free_bytes"] < c0["free_bytes"], "free_bytes did not drop after writing 4 MiB")
want(0 < synced["free_fraction"] < 1, f"free_fraction {synced['free_fraction']}")
want(synced["cache_hit_rate"] is None or 0 <= synced["cache_hit_rate"] <= 1, "cache_hit_rate out of range")
for p in problems:
    print("  " + p)
print(f"  fsyncs {c0['fsyncs']} -> {c1['fsyncs']}, commits {c1['commits']} -> {c2['commits']}, "
      f"dirty {c1['dirty_bytes']} -> {c2['dirty_bytes']}, log used {c1['log_used_bytes']} -> {c2['log_used_bytes']}, "
      f"fsync p50 <= {written['latency']['fsync_latency']['p50_us']} us")
sys.exit(1 if problems else 0)
EOF
then ok "stats --json: fields present; fsyncs, log, dirty bytes, commits and latencies move"
else bad "stats --json: see above"; fi

table=$("$BIRCH" stats "$MNT") || bad "birch stats exited $?"
missing=0
for line in "available of" "buffered, not yet written" "in use" "hit rate" "commit time" "fsync time" "counters since mount"; do
  grep -q "$line" <<<"$table" || { bad "birch stats: no line with '$line'"; missing=1; }
done
[[ $missing == 0 ]] && ok "stats table"

watch=$("$BIRCH" stats --watch 0.2 --count 2 "$MNT") || bad "birch stats --watch exited $?"
[[ $(wc -l <<<"$watch") == 3 ]] || bad "birch stats --watch 0.2 --count 2: expected a header and 2 rows, got: $watch"
json_lines=$("$BIRCH" stats --json --watch 0.2 --count 2 "$MNT" | python3 -c '
import json, sys
rows = [json.loads(l) for l in sys.stdin]
assert len(rows) == 2 and all("rates_per_sec" in r and "gauges" in r for r in rows), rows
print(len(rows))') || bad "birch stats --json --watch: not 2 JSON rows with rates"
[[ $json_lines == 2 ]] && ok "stats --watch (table and JSON)"

if "$BIRCH" stats "$WORK" 2>"$WORK/err"; then
  bad "birch stats on a plain directory succeeded"
elif grep -q "not the root of a birchfs mount" "$WORK/err"; then
  ok "stats on a plain directory: $(cat "$WORK/err")"
else
  bad "birch stats on a plain directory: unclear error: $(cat "$WORK/err")"
fi

"$BIRCH" umount "$MNT" || bad "umount"
"$BIRCH" fsck "$IMG" >/dev/null || bad "fsck after the stats test"
if [[ $FAIL == 0 ]]; then echo "stats-test: all passed"; else echo "stats-test: FAILED"; fi
exit $FAIL
