#!/usr/bin/env bash
# Images of older on-disk formats (FORMAT.md §9: a layout change needs a new version or flag,
# and a fixture image of the old format here) must stay readable and writable by this build.
#
# Each fixture NAME.img.gz was made by an older birch build (README.md beside it says which,
# and what it holds); NAME.manifest is `find` of its tree as that build showed it. For each:
# decompress to a temporary directory, `birch fsck` it (clean), mount it with this build and
# compare the tree with the manifest and the contents checked below, then write through this
# build (a new file, and an xattr value large enough to need the out-of-line chunks of
# INCOMPAT_XATTR_CHUNKS, which sets that flag), unmount, fsck again, and check the flag.
#
# Needs root and /dev/fuse (exit 77 otherwise). BIRCH: the binary (default target/release/birch).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BIRCH=${BIRCH:-$HERE/../../target/release/birch}
[[ $(id -u) == 0 ]] || { echo "format fixtures: needs root (skipped)"; exit 77; }
[[ -e /dev/fuse ]] || { echo "format fixtures: no /dev/fuse (skipped)"; exit 77; }
[[ -x $BIRCH ]] || { echo "format fixtures: no birch binary at $BIRCH" >&2; exit 1; }
WORK=$(mktemp -d /tmp/birch-fixtures.XXXXXX)
MNT=$WORK/mnt
mkdir -p "$MNT"
# Cleanup unmounts through the repository's one mount helper (bench/birchbench/mounts.py):
# `birch umount` (60 s), fusermount3 -u, umount, then the FUSE connection aborted, the lazy
# unmounts, and the daemon of the mount point killed if it is still there.
MOUNTS_PY=$HERE/../../bench/birchbench/mounts.py
cleanup() {
  python3 "$MOUNTS_PY" unmount --fuse --abort --birch "$BIRCH" --birch-timeout 60 --timeout 30 "$MNT"
  rm -rf "$WORK"
}
trap cleanup EXIT
fail=0
bad() { echo "FAIL $1: $2"; fail=1; }

fsck_clean() { # IMAGE WHEN
  local out rc i
  for i in $(seq 100); do # an unmount returns before the daemon has let go of the image
    out=$("$BIRCH" fsck "$1" 2>&1); rc=$?
    [[ $rc == 8 && $out == *"in use"* ]] || break
    sleep 0.1
  done
  if [[ $rc != 0 || $out != *" 0 findings"* ]]; then
    bad "$name" "fsck $2: rc=$rc: $(echo "$out" | tail -3)"
    return 1
  fi
}

n=0
for gz in "$HERE"/*.img.gz; do
  name=$(basename "$gz" .img.gz)
  before=$fail
  fail=0
  img=$WORK/$name.img
  gzip -dc "$gz" >"$img" || { bad "$name" "cannot decompress"; continue; }
  fsck_clean "$img" "as made" || continue
  "$BIRCH" mount "$img" "$MNT" || { bad "$name" "mount failed"; continue; }
  got=$(cd "$MNT" && find . -mindepth 1 \( -type d -printf "%P %y %m %n\n" \) -o \( -printf "%P %y %m %s %n\n" \) | sort)
  diff <(echo "$got") "$HERE/$name.manifest" >"$WORK/diff" || bad "$name" "tree differs from the manifest: $(head -5 "$WORK/diff")"
  case $name in
    v1-before-xattr-chunks)
      [[ $(cat "$MNT/dir/hello.txt") == "hello birch v1" ]] || bad "$name" "dir/hello.txt content"
      [[ $(sha256sum <"$MNT/dir/sub/random.bin" | cut -d' ' -f1) == 1b7bf07465a4d284032bfc169825dc9691f7bf892e6f88daa1454fa6cf7236f6 ]] ||
        bad "$name" "dir/sub/random.bin content"
      [[ $(stat -c %Y "$MNT/dir/hello.txt") == 1577934245 ]] || bad "$name" "dir/hello.txt mtime"
      [[ $(getfattr --only-values -n user.note "$MNT/dir/hello.txt" 2>/dev/null) == "small value" ]] || bad "$name" "xattr user.note"
      getfacl -pn "$MNT/dir/hello.txt" 2>/dev/null >"$WORK/acl"
      grep -q '^user:1000:r--' "$WORK/acl" || bad "$name" "ACL user:1000:r--"
      [[ $(readlink "$MNT/link") == dir/hello.txt ]] || bad "$name" "symlink target"
      [[ $(stat -c %s "$MNT/sparse") == 10000001 && $(stat -c %b "$MNT/sparse") -lt 100 ]] || bad "$name" "sparse file"
      ;;
  esac
  # This build writes to it: a file, and a value that needs the out-of-line chunks.
  echo "written by this build" >"$MNT/new" || bad "$name" "create"
  head -c 20000 /dev/zero | tr '\0' x >"$WORK/big"
  setfattr -n user.big -v "$(cat "$WORK/big")" "$MNT/dir/hello.txt" || bad "$name" "a 20,000-byte xattr value"
  "$BIRCH" umount "$MNT" || bad "$name" "umount"
  fsck_clean "$img" "after this build wrote" || continue
  # Read whole before matching: under pipefail, `grep -q` leaving early would fail the
  # pipeline with inspect's SIGPIPE (seen once in CI under load).
  "$BIRCH" inspect "$img" super >"$WORK/super" 2>&1 || bad "$name" "inspect super failed"
  grep -q "incompat 0x1 " "$WORK/super" || bad "$name" "incompat flag 0x1 not set after the big xattr: $(grep incompat "$WORK/super")"
  "$BIRCH" mount "$img" "$MNT" || { bad "$name" "second mount failed"; continue; }
  [[ $(cat "$MNT/new") == "written by this build" ]] || bad "$name" "new file after remount"
  [[ $(getfattr --only-values -n user.big "$MNT/dir/hello.txt" 2>/dev/null | wc -c) == 20000 ]] || bad "$name" "big xattr after remount"
  "$BIRCH" umount "$MNT" || bad "$name" "second umount"
  n=$((n + 1))
  ((fail)) || echo "ok   $name: fsck clean, tree and contents as made, written by this build, fsck clean"
  fail=$((fail | before))
done
((n > 0)) || { echo "format fixtures: no fixture checked"; exit 1; }
exit $fail
