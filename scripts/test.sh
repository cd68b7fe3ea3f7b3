#!/usr/bin/env bash
# Runs every birchfs test tier and prints the time of each:
#   1. fmt and clippy          2. unit, property and library tests (cargo test)
#   3. mount tests on a real FUSE mount   4. pjdfstest (birch and the kernel ext4 baseline)
#   5. fsx (3 seeds x 20,000 ops)        6. benchmark harness in quick mode
# Installs what the suites need (tests/posix/setup.sh). Needs root for tiers 3-6; without
# /dev/fuse or root those tiers are skipped with a printed reason.
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
export BIRCH=$(pwd)/target/release/birch
status=0
summary=()
tier() {
  local name=$1; shift
  local start=$SECONDS
  echo "=== tier: $name"
  "$@"
  local rc=$?
  local took=$((SECONDS - start))
  case $rc in
    0) summary+=("$name: ok (${took}s)") ;;
    77) summary+=("$name: skipped (${took}s)") ;;
    *) summary+=("$name: FAILED rc=$rc (${took}s)"); status=1 ;;
  esac
}
tier "fmt" cargo fmt --all -- --check
tier "clippy" cargo clippy --all-targets --release --locked -- -D warnings
tier "cargo test" cargo test --release --locked
# pjdfstest on birch beside the kernel ext4 baseline. Known gap, reported on every run: the 13
# EROFS tests need `mount -o remount,ro` to reach the daemon, which the mount helper does not
# do yet (issue 5). Any other failure fails the tier.
pjdfstest_tier() {
  local results=${RESULTS_DIR:-/tmp/birch-test-results}/pjdfstest
  rm -rf "$results"; mkdir -p "$results"
  RESULTS_DIR=$results bash tests/posix/pjdfstest-compare.sh
  local rc=$?
  [[ $rc == 0 ]] && return 0
  local failed=$results/pjdfstest-birch.failed
  [[ -s $failed ]] || return $rc
  local other
  other=$(grep -v 'erofs' "$failed")
  if [[ -n $other ]]; then
    echo "pjdfstest: failures beyond the known EROFS gap:"; echo "$other"
    return 1
  fi
  echo "pjdfstest: KNOWN GAP: $(wc -l <"$failed") EROFS tests fail (remount,ro does not reach the daemon yet); no other failure"
  return 0
}

can_mount=1
if [[ $(id -u) != 0 || ! -e /dev/fuse ]]; then
  can_mount=0
  echo "mount tiers skipped: need root and /dev/fuse"
fi
if [[ $can_mount == 1 ]]; then
  tier "posix setup" bash tests/posix/setup.sh
  tier "mount tests" bash tests/mount/mount-tests.sh
  tier "pjdfstest birch vs ext4" pjdfstest_tier
  tier "fsx birch" bash tests/posix/fsx.sh birch
  if [[ ${BIRCH_BENCH_QUICK:-0} == 1 && -x bench/run.sh ]]; then
    tier "bench quick" bash bench/run.sh --quick
  fi
fi
echo "=== summary"
printf '%s\n' "${summary[@]}"
n_failed=$(printf '%s\n' "${summary[@]}" | grep -c FAILED)
n_passed=$(printf '%s\n' "${summary[@]}" | grep -c ': ok')
n_skipped=$(printf '%s\n' "${summary[@]}" | grep -c ': skipped')
echo "tiers: $n_passed passed, $n_failed failed, $n_skipped skipped"
exit $status
