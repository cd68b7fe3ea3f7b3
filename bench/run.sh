#!/usr/bin/env bash
# birchbench: install what the benchmark needs, then run bench/birchbench.py.
#
#   sudo bench/run.sh --quick                 # ~3 min smoke run, checks every target produced numbers
#   sudo bench/run.sh --detach                # full run (~1 h) in the background; prints the log path
#   sudo bench/run.sh --birch-opts fsync=commit --birch-opts fsync=log --detach
#   sudo bench/run.sh --cleanup               # undo mounts/loop devices left by a killed run
#   bench/run.sh --help                       # every option (sizes, durations, targets, workloads)
#
# The seeds' "before" switches (--birch-opts bench_serialize_sync_writes, bench_global_objectid_lock,
# bench_apply_per_item) exist only in a birch built with the seed-before feature: when a run
# names one, this script builds that birch (cargo build --release -p birch-tools --features
# birch-tools/seed-before --target-dir target/seed-before) and the whole run uses
# target/seed-before/release/birch, the default target as well (unless BIRCH or --birch names
# another); target/release/birch, the shipped build, never has them.
#
# Environment: BIRCH (birch binary, default target/release/birch), BIRCHBENCH_DIR (images,
# default /var/tmp/birchbench), BIRCHBENCH_BUILD=1 (cargo build --release first),
# BIRCHBENCH_NO_INSTALL=1 (skip apt), BIRCHBENCH_LIBFUSE_TAR (libfuse source for the memfs_ll
# target, default ../shared/libfuse/libfuse-e8d407ce.tar.gz beside the repo).  See docs/BENCHMARKS.md.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
cd "$REPO"

for a in "$@"; do
  case "$a" in
    -h|--help) exec python3 "$HERE/birchbench.py" --help ;;
  esac
done

if [ "$(id -u)" != 0 ]; then
  echo "birchbench needs root (loop devices, mounts): run it with sudo" >&2
  exit 2
fi

# Debian's python3 (matplotlib comes from apt as python3-matplotlib)
PY=/usr/bin/python3
[ -x "$PY" ] || PY="$(command -v python3)"

PKGS=(dbench fio sysbench fsmark btrfs-progs xfsprogs e2fsprogs fuse2fs bindfs fuse3 util-linux python3 python3-matplotlib gcc libc6-dev git)
# the memfs_ll target is built from libfuse's source, when it is there (see docs/BENCHMARKS.md)
LIBFUSE_TAR="${BIRCHBENCH_LIBFUSE_TAR:-$REPO/../shared/libfuse/libfuse-e8d407ce.tar.gz}"
if [ -f "$LIBFUSE_TAR" ]; then
  PKGS+=(meson ninja-build liburing-dev g++ pkg-config)
fi
if [ "${BIRCHBENCH_NO_INSTALL:-0}" != 1 ]; then
  missing=()
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "birchbench: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  if ! "$PY" -c 'import matplotlib' 2>/dev/null; then
    "$PY" -m pip install --quiet matplotlib 2>/dev/null \
      || "$PY" -m pip install --quiet --break-system-packages matplotlib 2>/dev/null \
      || echo "birchbench: matplotlib unavailable, charts will be skipped" >&2
  fi
fi
modprobe loop 2>/dev/null || true
modprobe fuse 2>/dev/null || true

if [ "${BIRCHBENCH_BUILD:-0}" = 1 ] && command -v cargo >/dev/null; then
  echo "birchbench: cargo build --release"
  cargo build --release
fi

# A run that names a seed's "before" switch needs the seed-before build (see the top).
seed_switch=0
for a in "$@"; do
  case "$a" in
    *bench_serialize_sync_writes*|*bench_global_objectid_lock*|*bench_apply_per_item*) seed_switch=1 ;;
  esac
  # a birch named on the command line is the caller's choice
  case "$a" in --birch|--birch=*) seed_switch=0; break ;; esac
done
if [ "$seed_switch" = 1 ] && [ -z "${BIRCH:-}" ]; then
  SEED_TARGET="$REPO/target/seed-before"
  export PATH="$PATH:${HOME:-/root}/.cargo/bin"
  if command -v cargo >/dev/null; then
    echo "birchbench: a seed's before switch: cargo build --release -p birch-tools --features birch-tools/seed-before --target-dir target/seed-before"
    cargo build --release --locked -p birch-tools --features birch-tools/seed-before \
      --target-dir "$SEED_TARGET"
  elif [ -x "$SEED_TARGET/release/birch" ]; then
    echo "birchbench: no cargo here; using the seed-before build $SEED_TARGET/release/birch as it is" >&2
  else
    echo "birchbench: the seeds' before switches need a birch built with them; as your user, run" >&2
    echo "  cargo build --release -p birch-tools --features birch-tools/seed-before --target-dir target/seed-before" >&2
    exit 2
  fi
  export BIRCH="$SEED_TARGET/release/birch"
fi

export BIRCHBENCH_VIA_RUNSH=1 PYTHONDONTWRITEBYTECODE=1
# the image directory the run uses (for the cleanup safety net below)
prev=""
for a in "$@"; do
  case "$a" in --image-dir=*) export BIRCHBENCH_DIR="${a#--image-dir=}" ;; esac
  [ "$prev" = "--image-dir" ] && export BIRCHBENCH_DIR="$a"
  prev="$a"
done

# Detached runs and --cleanup hand over to python directly (it keeps its own state and cleanup).
for a in "$@"; do
  case "$a" in
    --detach|--cleanup) exec "$PY" "$HERE/birchbench.py" "$@" ;;
  esac
done

# Foreground: python cleans up on INT/TERM itself; the trap is the safety net for whatever
# a hard kill of python left behind (it undoes only what the state file records).
child=""
on_signal() {
  trap - INT TERM
  if [ -n "$child" ]; then kill -TERM "$child" 2>/dev/null || true; wait "$child" 2>/dev/null || true; fi
  exit 130
}
on_exit() {
  rc=$?
  "$PY" "$HERE/birchbench.py" --cleanup >/dev/null 2>&1 || true
  exit $rc
}
trap on_signal INT TERM
trap on_exit EXIT
"$PY" "$HERE/birchbench.py" "$@" &
child=$!
set +e
wait "$child"
rc=$?
# wait returns early (>128) when a trapped signal arrives; the trap handles that
exit $rc
