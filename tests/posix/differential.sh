#!/usr/bin/env bash
# Differential test: the same seeded random sequence of system calls on birchfs and on a
# directory of kernel ext4 (loop device), compared after every call (result or errno, and the
# touched objects' stat) and as whole trees (differential.py says what and which differences
# are allowed: `differential.py --list-allowed`).
#
#   tests/posix/differential.sh [OPS] [SEED...]
#   tests/posix/differential.sh [--ops OPS] [--seed SEED]...
#
# OPS   operations per seed (default 1000; CI: 3 seeds x 1000 = 3,000 ops, well under 2 min)
# SEED  seeds, one run each on a fresh directory of both mounts (default 1 2 3); `random`
#       draws one (printed, so a failure can be replayed with the same OPS and SEED)
#
# One ext4 image and one birch image (IMG_SIZE, default 512M) are made and mounted; each seed
# works in seed-SEED/ on both. After the runs birch is unmounted (synchronous) and checked with
# `birch fsck`, mounted again, every tree that passed is compared with ext4 once more (what
# was acknowledged must come back after a remount), and birch is unmounted and checked again;
# ext4 is unmounted and checked with e2fsck -fn.
#
# Prints one line per seed and `differential: N passed, N failed` (in seeds).
# Exit status: 0 all seeds identical and fsck clean; 1 otherwise; 77 when it cannot run here
# (not root, no /dev/fuse, no loop devices, birch binary missing).
# Output: $RESULTS_DIR/differential-SEED.log (the full report of each seed).
# Knobs: DIFF_TIMEOUT (seconds per seed; default 300 + OPS/10), DIFF_CHECK_EVERY (whole-tree
# compare every N ops, default 100), plus those of lib.sh (BIRCH, BIRCH_MOUNT_OPTS, IMG_SIZE,
# RESULTS_DIR, KEEP_WORK).
set -uo pipefail
IMG_SIZE=${IMG_SIZE:-512M}
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() { echo "usage: $0 [OPS] [SEED...]   or   $0 [--ops OPS] [--seed SEED]..." >&2; exit 2; }
OPS=1000
SEEDS=()
if [[ ${1:-} == --* ]]; then
  while (($#)); do
    case $1 in
      --ops) OPS=${2:-}; shift 2 || usage ;;
      --seed) SEEDS+=("${2:-}"); shift 2 || usage ;;
      *) usage ;;
    esac
  done
else
  OPS=${1:-1000}
  (($# > 0)) && shift
  SEEDS=("$@")
fi
[[ $OPS =~ ^[1-9][0-9]*$ ]] || usage
((${#SEEDS[@]})) || SEEDS=(1 2 3)
for i in "${!SEEDS[@]}"; do
  [[ ${SEEDS[i]} == random ]] && SEEDS[i]=$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')
  [[ ${SEEDS[i]} =~ ^[0-9]+$ ]] || usage
done
DIFF_TIMEOUT=${DIFF_TIMEOUT:-$((300 + OPS / 10))}
DIFF_CHECK_EVERY=${DIFF_CHECK_EVERY:-100}
PY=$POSIX_DIR/differential.py

require_root
require_target ext4
require_target birch
command -v python3 >/dev/null || skip "python3 not found"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 9))' || skip "python3 >= 3.9 needed"

install_cleanup_trap
make_work_dir
mount_target ext4 ref
REF=$MOUNTED_AT
mount_target birch bfs
BFS=$MOUNTED_AT
BIMG=$WORK_DIR/bfs.img

log "differential on birch vs ext4: ${#SEEDS[@]} seeds (${SEEDS[*]}) x $OPS ops"
passed=0 failed=0
ok_seeds=()
start_all=$(date +%s)
for seed in "${SEEDS[@]}"; do
  logf=$RESULTS_DIR/differential-$seed.log
  rm -rf "$REF/seed-$seed" "$BFS/seed-$seed"
  mkdir "$REF/seed-$seed" "$BFS/seed-$seed"
  start=$(date +%s)
  run_guarded "$DIFF_TIMEOUT" "$logf" python3 "$PY" --ref "$REF/seed-$seed" --birch "$BFS/seed-$seed" \
    --seed "$seed" --ops "$OPS" --check-every "$DIFF_CHECK_EVERY"
  rc=$?
  secs=$(($(date +%s) - start))
  if ((rc == 0)); then
    passed=$((passed + 1))
    ok_seeds+=("$seed")
    grep -E "^(differential: seed $seed: |  allowed)" "$logf"
  else
    failed=$((failed + 1))
    ((rc == 124 || rc == 137)) && echo "differential: seed $seed: timed out after ${DIFF_TIMEOUT}s"
    echo "differential: seed $seed: FAILED (exit $rc, ${secs}s); log $logf"
    sed -n '2,$p' "$logf" | sed 's/^/  /'
  fi
done
elapsed=$(($(date +%s) - start_all))

fsck_ok=1
unmount_target birch bfs || fsck_ok=0
# Remount: every tree that passed must come back identical.
if ((fsck_ok)) && ((${#ok_seeds[@]})); then
  _CLEANUP_MOUNTS+=("birch:$BFS")
  opts=()
  [[ -n $BIRCH_MOUNT_OPTS ]] && opts=(-o "$BIRCH_MOUNT_OPTS")
  if timeout -k 5 120 "$BIRCH" mount "$BIMG" "$BFS" "${opts[@]}" </dev/null >"$RESULTS_DIR/birch-mount-bfs-2.log" 2>&1; then
    for seed in "${ok_seeds[@]}"; do
      if ! python3 "$PY" --verify-only --ref "$REF/seed-$seed" --birch "$BFS/seed-$seed"; then
        echo "differential: seed $seed: FAILED after remount (the tree differs from ext4)"
        passed=$((passed - 1))
        failed=$((failed + 1))
      fi
    done
    unmount_target birch bfs || fsck_ok=0
  else
    sed 's/^/  | /' "$RESULTS_DIR/birch-mount-bfs-2.log"
    echo "differential: remount of $BIMG failed"
    fsck_ok=0
  fi
fi
unmount_target ext4 ref || log "e2fsck of the ext4 reference is not clean (not a birch failure)"

echo "differential: $((${#SEEDS[@]} * OPS)) ops in ${elapsed}s, seeds ${SEEDS[*]}, birch fsck $([[ $fsck_ok == 1 ]] && echo clean || echo NOT CLEAN)"
echo "differential: $passed passed, $failed failed"
((failed == 0 && fsck_ok == 1))
