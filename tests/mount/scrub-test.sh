#!/usr/bin/env bash
# `birch scrub` on images and on a real mount: a clean image scrubs clean offline and online
# (exit 0, --json with its fields); Ctrl-C of an online scrub cancels it (exit 2, the report and
# the daemon's status say cancelled); an image in use is refused offline (exit 2); one flipped
# byte in a data block is found offline and online (exit 1) with the file's inode and both
# of its paths (it has a hard link); one flipped byte in a leaf is found offline with an
# inode whose items the leaf holds and its path; the text output says scrub cannot heal; a
# missing target is exit 2; a block only a snapshot holds, damaged, is found offline and online
# and named under /.snapshot/NAME, and --resume starts at a snapshot. Runs in a few seconds.
# Skips (exit 77) when not root or without /dev/fuse.
set -uo pipefail
BIRCH=${BIRCH:-$(pwd)/target/release/birch}
if [[ ! -e /dev/fuse ]]; then echo "scrub-test: SKIP: /dev/fuse is absent"; exit 77; fi
if [[ $(id -u) != 0 ]]; then echo "scrub-test: SKIP: needs root (trusted.birch.scrub)"; exit 77; fi
[[ -x $BIRCH ]] || { echo "scrub-test: $BIRCH not built"; exit 1; }

WORK=$(mktemp -d /tmp/scrub-test.XXXXXX)
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

# expect_rc WANT WHAT -- command...: runs the command (stdout to $WORK/out), checks its exit code.
expect_rc() {
  local want=$1 what=$2; shift 3
  "$@" >"$WORK/out" 2>"$WORK/err"
  local rc=$?
  if [[ $rc == "$want" ]]; then ok "$what: exit $rc"; else bad "$what: exit $rc, expected $want: $(cat "$WORK/err")"; fi
}

# json_check FILE PYTHON-EXPR WHAT: the expression over `r` (the parsed JSON) must be true.
json_check() {
  if python3 - "$1" "$2" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
sys.exit(0 if eval(sys.argv[2]) else 1)
EOF
  then ok "$3"; else bad "$3: $(head -c 600 "$1")"; fi
}

"$BIRCH" mkfs --size 256M "$IMG" >/dev/null || { echo "scrub-test: mkfs failed"; exit 1; }
"$BIRCH" mount "$IMG" "$MNT" || { echo "scrub-test: mount failed"; exit 1; }
mkdir -p "$MNT/d/e"
head -c $((8 << 20)) /dev/urandom >"$MNT/d/e/big"
ln "$MNT/d/e/big" "$MNT/big-link"
for i in $(seq 1 400); do echo "small $i" >"$MNT/d/s$i"; done
BIG_INO=$(stat -c %i "$MNT/d/e/big")

# Online, clean: exit 0 and the JSON fields scripts read.
expect_rc 0 "online scrub of a clean mount" -- "$BIRCH" scrub --json --rate 0 "$MNT"
cp "$WORK/out" "$WORK/online-clean.json"
json_check "$WORK/online-clean.json" \
  'r["clean"] and r["damaged"] == 0 and r["damage"] == [] and r["nodes"] > 1 and r["data_blocks"] >= 2048 and r["healed"] is False and r["chunks"] >= 1 and "rate_mb_per_sec" in r' \
  "online clean JSON: clean, counts, healed false"
expect_rc 0 "online scrub with the default rate (text)" -- "$BIRCH" scrub "$MNT"
grep -q "0 damaged blocks" "$WORK/out" && ok "text summary" || bad "text summary: $(cat "$WORK/out")"

# Ctrl-C of an online scrub: SIGINT to `birch scrub MNT` while the daemon's scrub runs (1 MB/s
# over 8 MB, so it is still running) cancels it: exit 2, its report says cancelled with a
# position to resume from, and so does the daemon's status afterwards.
scrub_status() { python3 -c '
import json, os, sys
s = json.loads(os.getxattr(sys.argv[1], "trusted.birch.scrub"))
r = s.get("report") or {}
print(s.get("state"), s.get("bytes_done", 0), r.get("cancelled"), r.get("resume") is not None)' "$MNT"; }
"$BIRCH" scrub --json --rate 1 "$MNT" >"$WORK/cancel.json" 2>"$WORK/cancel.err" &
SCRUB_PID=$!
running=0
for _ in $(seq 100); do
  read -r state done_bytes _ _ < <(scrub_status)
  if [[ $state == running && $done_bytes -gt 0 ]]; then running=1; break; fi
  sleep 0.1
done
if ((running)); then ok "online scrub at 1 MB/s running ($done_bytes bytes done)"; else bad "online scrub at 1 MB/s: not seen running (status: $(scrub_status))"; fi
kill -INT "$SCRUB_PID"
wait "$SCRUB_PID"
rc=$?
if [[ $rc == 2 ]]; then ok "Ctrl-C of an online scrub: exit 2"; else bad "Ctrl-C of an online scrub: exit $rc, expected 2: $(cat "$WORK/cancel.err")"; fi
json_check "$WORK/cancel.json" 'r["cancelled"] and r["resume"] is not None' "Ctrl-C of an online scrub: its report says cancelled, with a position to resume from"
read -r state _ cancelled resumable < <(scrub_status)
if [[ $state == done && $cancelled == True && $resumable == True ]]; then
  ok "Ctrl-C of an online scrub: the daemon's status says cancelled"
else
  bad "Ctrl-C of an online scrub: the daemon's status: state $state, cancelled $cancelled, resume given $resumable"
fi

# Offline while mounted: refused like fsck.
expect_rc 2 "offline scrub of a mounted image is refused" -- "$BIRCH" scrub "$IMG"

"$BIRCH" umount "$MNT" || { echo "scrub-test: umount failed"; exit 1; }
expect_rc 0 "offline scrub of a clean image" -- "$BIRCH" scrub --json "$IMG"
json_check "$WORK/out" 'r["clean"] and r["data_blocks"] >= 2048' "offline clean JSON"
cp "$IMG" "$WORK/clean.img"
cp "$IMG" "$WORK/snap-base.img"

# One byte of the big file's second extent, flipped.
EXTENT=$("$BIRCH" inspect "$IMG" inode "$BIG_INO" | awk '/extent regular/ {print $7}' | sed -n 2p)
[[ -n $EXTENT ]] || { echo "scrub-test: no second extent of inode $BIG_INO"; exit 1; }
BAD=$((EXTENT + 3 * 4096))
python3 - "$IMG" "$BAD" <<'EOF'
import sys
with open(sys.argv[1], "r+b") as f:
    f.seek(int(sys.argv[2]) + 77)
    b = f.read(1)
    f.seek(int(sys.argv[2]) + 77)
    f.write(bytes([b[0] ^ 0xFF]))
EOF
expect_rc 1 "offline scrub finds a flipped data byte" -- "$BIRCH" scrub --json "$IMG"
json_check "$WORK/out" \
  "r['damaged'] == 1 and r['damage'][0]['kind'] == 'data' and r['damage'][0]['block'] == $BAD and r['damage'][0]['owners'][0]['inode'] == $BIG_INO and sorted(r['damage'][0]['owners'][0]['paths']) == ['/big-link', '/d/e/big']" \
  "offline data damage: block, inode and both paths"
expect_rc 1 "offline scrub (text) of the damaged image" -- "$BIRCH" scrub "$IMG"
grep -q "/d/e/big" "$WORK/out" && grep -q "cannot be rebuilt" "$WORK/out" \
  && ok "text names the path and says scrub cannot heal" || bad "text: $(cat "$WORK/out")"

"$BIRCH" mount "$IMG" "$MNT" || { echo "scrub-test: mount of the damaged image failed"; exit 1; }
expect_rc 1 "online scrub finds the flipped data byte" -- "$BIRCH" scrub --json --rate 200 "$MNT"
json_check "$WORK/out" \
  "r['damaged'] == 1 and r['damage'][0]['block'] == $BAD and '/d/e/big' in r['damage'][0]['owners'][0]['paths']" \
  "online data damage: block and path"
# The list of files with errors (`birch errors`): the scrub's damaged block, then a read that
# fails its checksum, both on the file with its two paths.
expect_rc 1 "birch errors after the online scrub" -- "$BIRCH" errors --json "$MNT"
json_check "$WORK/out" \
  "len(r['files']) == 1 and r['files'][0]['inode'] == $BIG_INO and sorted(r['files'][0]['paths']) == ['/big-link', '/d/e/big'] and r['files'][0]['scrub_damaged_blocks'] == 1" \
  "errors: the damaged file, both paths, one damaged block"
echo 3 >/proc/sys/vm/drop_caches
if cat "$MNT/d/e/big" >/dev/null 2>"$WORK/err"; then bad "a read of the damaged file succeeded"; else ok "a read of the damaged file fails"; fi
expect_rc 1 "birch errors after the failed read" -- "$BIRCH" errors "$MNT"
grep -q "inode $BIG_INO: .*checksum error" "$WORK/out" && grep -q "/big-link" "$WORK/out" && grep -q "/d/e/big" "$WORK/out" \
  && ok "errors (text): paths and the checksum error" || bad "errors (text): $(cat "$WORK/out")"
expect_rc 0 "birch errors --clear" -- "$BIRCH" errors --clear "$MNT"
expect_rc 0 "birch errors after the clear: none" -- "$BIRCH" errors "$MNT"
"$BIRCH" stats --json "$MNT" >"$WORK/stats.json"
json_check "$WORK/stats.json" "r['counters']['lifetime_checksum_errors'] == 0" "lifetime checksum errors cleared"
"$BIRCH" umount "$MNT" || { echo "scrub-test: umount failed"; exit 1; }

# One byte of a leaf holding the small files' items, flipped (in a copy of the clean image).
# The root node's pointers: "slot N key (INO, inode, 0) -> ADDR ..."; the first leaf that
# starts at a small file's inode item, past /d's own items (its entries stay readable).
LEAF=$("$BIRCH" inspect "$WORK/clean.img" tree fs \
  | awk '$1 == "slot" && $5 == "inode," { ino = substr($4, 2) + 0; if (!done && ino > 300) { print ino, $8; done = 1 } }')
LEAF_INO=$(echo "$LEAF" | awk '{print $1}')
LEAF_ADDR=$(echo "$LEAF" | awk '{print $2}')
[[ -n $LEAF_ADDR ]] || { echo "scrub-test: no leaf found"; exit 1; }
python3 - "$WORK/clean.img" "$LEAF_ADDR" <<'EOF'
import sys
with open(sys.argv[1], "r+b") as f:
    at = int(sys.argv[2], 16) + 8000
    f.seek(at)
    b = f.read(1)
    f.seek(at)
    f.write(bytes([b[0] ^ 0x01]))
EOF
expect_rc 1 "offline scrub finds a flipped leaf byte" -- "$BIRCH" scrub --json "$WORK/clean.img"
json_check "$WORK/out" \
  "r['damaged'] == 1 and r['damage'][0]['kind'] == 'node' and r['damage'][0]['block'] == $((LEAF_ADDR)) and any(o['inode'] == $LEAF_INO and o['paths'] and o['paths'][0].startswith('/d/s') for o in r['damage'][0]['owners'])" \
  "node damage: block, inode $LEAF_INO and its path"

expect_rc 2 "a missing target" -- "$BIRCH" scrub "$WORK/no-such-image"

# Snapshots (issue 41): a block only snapshot s1 holds, damaged, is found offline and online
# and named by its path under /.snapshot/s1; reading it there fails with EIO; --resume starts
# at the position given (a bad one is exit 2).
cp "$WORK/snap-base.img" "$IMG"
"$BIRCH" mount "$IMG" "$MNT" || { echo "scrub-test: mount failed"; exit 1; }
python3 - "$MNT/only-s1" <<'EOF'
import sys
# Each 16 bytes: offset, a version word, a marker: every block differs from every other.
with open(sys.argv[1], "wb") as f:
    for off in range(0, 64 * 4096, 16):
        f.write(off.to_bytes(8, "little") + (7).to_bytes(4, "little") + (0x5C5C1D41).to_bytes(4, "little"))
EOF
"$BIRCH" snapshot create "$MNT" s1 >/dev/null || bad "snapshot create"
rm "$MNT/only-s1"
"$BIRCH" umount "$MNT" || { echo "scrub-test: umount failed"; exit 1; }
expect_rc 0 "offline scrub of a clean image with a snapshot" -- "$BIRCH" scrub --json "$IMG"
json_check "$WORK/out" 'r["clean"] and r["snapshots"] == 1 and r["resume"] is None' "offline clean JSON with a snapshot"
SNAP_BAD=$(python3 - "$IMG" <<'EOF'
import sys
want = (5 * 4096).to_bytes(8, "little") + (7).to_bytes(4, "little") + (0x5C5C1D41).to_bytes(4, "little")
data = open(sys.argv[1], "rb").read()
at = data.find(want)
while at >= 0 and at % 4096:
    at = data.find(want, at + 1)
print(at)
EOF
)
[[ $SNAP_BAD -gt 0 ]] || { echo "scrub-test: the snapshot's block was not found"; exit 1; }
python3 - "$IMG" "$SNAP_BAD" <<'EOF'
import sys
with open(sys.argv[1], "r+b") as f:
    f.seek(int(sys.argv[2]) + 100)
    b = f.read(1)
    f.seek(int(sys.argv[2]) + 100)
    f.write(bytes([b[0] ^ 0x10]))
EOF
expect_rc 1 "offline scrub finds a block only a snapshot holds" -- "$BIRCH" scrub --json "$IMG"
json_check "$WORK/out" \
  "r['damaged'] == 1 and r['damage'][0]['block'] == $SNAP_BAD and r['damage'][0]['owners'][0]['snapshot'] == 's1' and r['damage'][0]['owners'][0]['paths'] == ['/.snapshot/s1/only-s1']" \
  "offline snapshot damage: named /.snapshot/s1/only-s1"
expect_rc 1 "offline scrub resumed at the snapshot" -- "$BIRCH" scrub --json --resume snapshot-1@0:0:0 "$IMG"
json_check "$WORK/out" "r['damaged'] == 1 and r['snapshots'] == 1" "resumed at snapshot 1: its damage found"
expect_rc 2 "a bad --resume position" -- "$BIRCH" scrub --resume nowhere "$IMG"
"$BIRCH" mount "$IMG" "$MNT" || { echo "scrub-test: mount of the damaged image failed"; exit 1; }
expect_rc 1 "online scrub finds a block only a snapshot holds" -- "$BIRCH" scrub --json --rate 0 "$MNT"
json_check "$WORK/out" \
  "r['damaged'] == 1 and r['damage'][0]['block'] == $SNAP_BAD and r['damage'][0]['owners'][0]['paths'] == ['/.snapshot/s1/only-s1']" \
  "online snapshot damage: named /.snapshot/s1/only-s1"
if cat "$MNT/.snapshot/s1/only-s1" >/dev/null 2>"$WORK/err"; then
  bad "reading the damaged snapshot file succeeded"
else
  grep -qi "input/output error" "$WORK/err" && ok "reading it through the mount is EIO" || bad "read error: $(cat "$WORK/err")"
fi
"$BIRCH" umount "$MNT" || { echo "scrub-test: umount failed"; exit 1; }

if [[ $FAIL == 0 ]]; then echo "scrub-test: all passed"; else echo "scrub-test: FAILED"; fi
exit $FAIL
