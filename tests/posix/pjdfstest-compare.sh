#!/usr/bin/env bash
# Runs pjdfstest on kernel ext4 (baseline) and on birchfs with the same config,
# then compares them.
#
#   tests/posix/pjdfstest-compare.sh [TEST_PATTERN...]
#
# Prints both `pjdfstest TARGET: N passed, N failed, N skipped` lines, then the
# tests skipped on birch but not on ext4. Exit status: 0 when birch has no
# failure, no such extra skip and a clean fsck; 1 otherwise; 77 when birch
# cannot run here (binary absent, no /dev/fuse, not root); ext4 problems are
# reported and also make it exit 1.
# Knobs: ALLOW_EXTRA_SKIP (names of extra skips to report without failing;
# default none), and those of pjdfstest.sh and lib.sh (BIRCH, RESULTS_DIR, ...).
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RESULTS_DIR=$(realpath -m "${RESULTS_DIR:-/tmp/birch-posix-results}")
export RESULTS_DIR
mkdir -p "$RESULTS_DIR"

child=""
trap '[[ -n $child ]] && kill -TERM "$child" 2>/dev/null && wait "$child"; exit 130' INT
trap '[[ -n $child ]] && kill -TERM "$child" 2>/dev/null && wait "$child"; exit 143' TERM HUP

run() { # TARGET -> exit code; pjdfstest.sh leaves its count line in pjdfstest-TARGET.summary
  local t=$1 rc
  shift
  rm -f "$RESULTS_DIR/pjdfstest-$t.summary" "$RESULTS_DIR/pjdfstest-$t.skipped"
  # In the background and waited for, so a signal here stops it (and its cleanup runs).
  bash "$HERE/pjdfstest.sh" "$t" "$@" &
  child=$!
  wait "$child"
  rc=$?
  child=""
  return "$rc"
}

run ext4 "$@"
ext4_rc=$?
run birch "$@"
birch_rc=$?

echo
echo "== pjdfstest 0.2.2, same config ($HERE/pjdfstest.toml)"
line() { cat "$RESULTS_DIR/pjdfstest-$1.summary" 2>/dev/null || echo "pjdfstest $1: did not run (exit $2)"; }
line ext4 "$ext4_rc"
line birch "$birch_rc"

if ((birch_rc == 77)); then
  echo "birch skipped (see message above); nothing to compare"
  exit 77
fi

extra=()
if [[ -f $RESULTS_DIR/pjdfstest-birch.skipped && -f $RESULTS_DIR/pjdfstest-ext4.skipped ]] && ((ext4_rc != 77)); then
  mapfile -t extra < <(comm -23 "$RESULTS_DIR/pjdfstest-birch.skipped" "$RESULTS_DIR/pjdfstest-ext4.skipped")
fi
# ALLOW_EXTRA_SKIP: test names (space-separated) whose extra skip on birch is
# reported but not fatal. Empty by default: every extra skip fails the run.
read -ra allowed <<<"${ALLOW_EXTRA_SKIP:-}"
fatal=()
if ((${#extra[@]})); then
  echo "skipped on birch but not on ext4 (${#extra[@]}):"
  for t in "${extra[@]}"; do
    if [[ " ${allowed[*]} " == *" $t "* ]]; then
      echo "  $t (allowed by ALLOW_EXTRA_SKIP)"
    else
      echo "  $t"
      fatal+=("$t")
    fi
  done
  # The skip reasons are printed under each skipped test in the log.
  echo "  (reasons: grep -A3 NAME $RESULTS_DIR/pjdfstest-birch.log)"
else
  echo "skipped on birch but not on ext4: none"
fi

status=0
((ext4_rc != 0)) && { echo "ext4 baseline did not pass cleanly (exit $ext4_rc)"; status=1; }
((birch_rc != 0)) && { echo "birch did not pass (exit $birch_rc)"; status=1; }
((${#fatal[@]})) && status=1
exit "$status"
