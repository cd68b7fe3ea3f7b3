#!/usr/bin/env bash
# Runs fsx 0.3.2 (File System eXerciser) with every operation it offers on a
# file on a fresh file system.
#
#   tests/posix/fsx.sh TARGET [OPS] [SEED...]
#
# TARGET  ext4 (kernel ext4 on a loop device) or birch (birchfs through $BIRCH)
# OPS     operations per seed (default 20000)
# SEED    fsx seeds, one run each, one after another (default: 1 2 3). The word
#         `random` picks a fresh random seed (printed, so a failure can be replayed).
#
# One file system is made and mounted; each seed works on its own file there.
# After the runs the file system is unmounted synchronously and checked
# (e2fsck -fn / birch fsck). The configuration is fsx.toml beside this script
# (all 14 operations of fsx 0.3.2 enabled; checked before running).
#
# Prints one line per seed and `fsx TARGET: N passed, N failed` (in seeds).
# Exit status: 0 all seeds passed and fsck clean; 1 otherwise; 77 when TARGET
# cannot run here (birch binary absent, no /dev/fuse, not root).
# Output: $RESULTS_DIR/fsx-TARGET-SEED.log, and on a failure fsx's artifacts
# (the expected file image and the operation log) in $RESULTS_DIR/fsx-TARGET-SEED/.
# Knobs: FSX_TIMEOUT (seconds per seed; default 600 + OPS/50), FSX_CONFIG,
# plus those of lib.sh (BIRCH, BIRCH_MOUNT_OPTS, IMG_SIZE, RESULTS_DIR, KEEP_WORK).
set -uo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() { echo "usage: $0 ext4|birch [OPS] [SEED...]" >&2; exit 2; }
[[ $# -ge 1 ]] || usage
TARGET=$1
shift
case $TARGET in ext4 | birch) ;; *) usage ;; esac
OPS=${1:-20000}
(($# > 0)) && shift
[[ $OPS =~ ^[1-9][0-9]*$ ]] || usage
SEEDS=("$@")
((${#SEEDS[@]})) || SEEDS=(1 2 3)
for i in "${!SEEDS[@]}"; do
  [[ ${SEEDS[i]} == random ]] && SEEDS[i]=$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')
  [[ ${SEEDS[i]} =~ ^[0-9]+$ ]] || usage
done

FSX_VERSION=0.3.2
FSX_CONFIG=${FSX_CONFIG:-$POSIX_DIR/fsx.toml}
FSX_TIMEOUT=${FSX_TIMEOUT:-$((600 + OPS / 50))}
# Every operation of fsx 0.3.2 (its Weights struct); each must have a non-zero weight.
FSX_OPS=(close_open read write mapread mapwrite invalidate truncate fsync fdatasync
  posix_fallocate punch_hole sendfile posix_fadvise copy_file_range)

require_root
require_target "$TARGET"
command -v fsx >/dev/null || die "fsx not found; run tests/posix/setup.sh first"
have=$(fsx --version | awk '{print $2}')
[[ $have == "$FSX_VERSION" ]] || die "fsx $have installed, $FSX_VERSION wanted; run tests/posix/setup.sh"
[[ -f $FSX_CONFIG ]] || die "config $FSX_CONFIG not found"
for op in "${FSX_OPS[@]}"; do
  w=$(awk -v k="$op" '/^\[/ { sect = $0 } sect == "[weights]" && $1 == k && $2 == "=" { print $3 }' "$FSX_CONFIG")
  [[ -n $w && $w != 0 && $w != 0.0 ]] || die "$FSX_CONFIG: operation '$op' is not enabled (weights.$op must be > 0)"
done

install_cleanup_trap
make_work_dir
mount_target "$TARGET" fsx
MNT=$MOUNTED_AT

log "fsx $FSX_VERSION on $TARGET: ${#SEEDS[@]} seeds (${SEEDS[*]}) x $OPS ops, config $FSX_CONFIG, timeout ${FSX_TIMEOUT}s each"
passed=0 failed=0 total_ops=0
start_all=$(date +%s)
for seed in "${SEEDS[@]}"; do
  logf=$RESULTS_DIR/fsx-$TARGET-$seed.log
  art=$RESULTS_DIR/fsx-$TARGET-$seed
  rm -rf "$art"
  mkdir -p "$art"
  start=$(date +%s)
  run_guarded "$FSX_TIMEOUT" "$logf" fsx -f "$FSX_CONFIG" -N "$OPS" -S "$seed" -P "$art" "$MNT/fsx-$seed.dat"
  rc=$?
  secs=$(($(date +%s) - start))
  if ((rc == 0)) && grep -q "All operations completed A-OK!" "$logf"; then
    passed=$((passed + 1))
    total_ops=$((total_ops + OPS))
    rm -rf "$art"
    echo "fsx $TARGET seed $seed: $OPS ops ok (${secs}s)"
  else
    failed=$((failed + 1))
    if ((rc == 124 || rc == 137)); then
      why="timed out after ${FSX_TIMEOUT}s"
    else
      why="exit $rc"
    fi
    echo "fsx $TARGET seed $seed: FAILED ($why, ${secs}s); log $logf, artifacts $art"
    echo "  replay: fsx -f $FSX_CONFIG -N $OPS -S $seed FILE"
    grep -m5 -iE "error|miscompare|panick|fail" "$logf" | sed 's/^/  | /'
  fi
done
elapsed=$(($(date +%s) - start_all))

fsck_ok=1
unmount_target "$TARGET" fsx || fsck_ok=0

echo "fsx $TARGET: $total_ops ops in ${elapsed}s, seeds ${SEEDS[*]}, fsck $([[ $fsck_ok == 1 ]] && echo clean || echo NOT CLEAN)"
echo "fsx $TARGET: $passed passed, $failed failed"
((failed == 0 && fsck_ok == 1))
