#!/usr/bin/env bash
# The compression benchmark (issue 37 item 7): install what it needs, then run bench/compress.py.
#
#   sudo bench/compress.sh --quick            # smoke run, ~40 s: every target gives numbers
#   sudo bench/compress.sh                    # full sizes (L 1.75 GiB, S 10,000 files, R 512 MiB)
#   sudo bench/compress.sh --repeats 3 --corpora L
#   sudo BIRCH_COMPRESS=zstd:1,lz4 bench/compress.sh   # + birchfs -o compress=X (refused by a birch without it)
#   sudo BIRCH_DEFRAG=zstd:1,lz4 bench/compress.sh     # + birchfs-defrag-zstd1, birchfs-defrag-lz4: written
#                                             #   plainly, then `birch defrag --compress=X -r`, timed apart
#                                             #   (same as --birch-defrag zstd:1,lz4)
#   bench/compress.sh --dry-run               # the plan, no root
#   sudo bench/compress.sh --cleanup          # undo mounts / loop devices a killed run left
#   bench/compress.sh --help
#
# Environment: BIRCH (birch binary, default target/release/birch), BIRCH_COMPRESS, BIRCH_DEFRAG (see above),
# BIRCHBENCH_COMPRESS_DIR (images, mount points, corpus cache; default /var/tmp/birchbench-compress),
# BIRCHBENCH_NO_INSTALL=1 (skip apt).  See docs/BENCHMARKS.md.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
cd "$REPO"
PY=/usr/bin/python3
[ -x "$PY" ] || PY="$(command -v python3)"
export PYTHONDONTWRITEBYTECODE=1

for a in "$@"; do
  case "$a" in
    -h|--help|--dry-run) exec "$PY" "$HERE/compress.py" "$@" ;;
  esac
done

if [ "$(id -u)" != 0 ]; then
  echo "compress.sh needs root (loop devices, mounts, drop_caches): run it with sudo" >&2
  exit 2
fi

PKGS=(fio btrfs-progs btrfs-compsize util-linux python3 fuse3)
if [ "${BIRCHBENCH_NO_INSTALL:-0}" != 1 ]; then
  missing=()
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "compress.sh: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi
modprobe loop 2>/dev/null || true
modprobe fuse 2>/dev/null || true
modprobe btrfs 2>/dev/null || true

for a in "$@"; do
  case "$a" in --cleanup) exec "$PY" "$HERE/compress.py" "$@" ;; esac
done

# Python undoes its mounts on the way out; this trap is the safety net for a hard kill
# (it undoes only what the state file under the image directory records).
child=""
on_signal() {
  trap - INT TERM
  if [ -n "$child" ]; then kill -TERM "$child" 2>/dev/null || true; wait "$child" 2>/dev/null || true; fi
  exit 130
}
on_exit() {
  rc=$?
  "$PY" "$HERE/compress.py" --cleanup "$@" >/dev/null 2>&1 || true
  exit $rc
}
trap on_signal INT TERM
trap 'on_exit "$@"' EXIT
"$PY" "$HERE/compress.py" "$@" &
child=$!
set +e
wait "$child"
exit $?
