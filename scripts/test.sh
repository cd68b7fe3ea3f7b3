#!/usr/bin/env bash
# Runs every birchfs test tier and prints the time of each:
#   1. fmt and clippy          2. unit, property and library tests (cargo test), bench/tests,
#      a short structure-aware fuzz run of the format decoders, log replay and image open
#   2b. the Debian package: build, install, mkfs/mount -a/fsck through it, purge
#   3. mount tests on a real FUSE mount, the NFS export through ganesha   4. pjdfstest (birch and the kernel ext4 baseline)
#   5. fsx (3 seeds x 20,000 ops), xfstests generic/quick, the soak (short) and under device
#      faults, the differential test
#      against ext4
#   6. benchmark harness in quick mode   7. birch on a Ceph RBD image (single-node cluster), with
#      NFS failover between two nodes on it
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
# The planted defects (scripts/sabotage.py, docs/TESTING.md "8. Planted defects") still apply to
# the code: each case's text to replace is found exactly once (seconds; running them is not CI's).
tier "planted defects apply" python3 scripts/sabotage.py --check
tier "clippy" cargo clippy --all-targets --release --locked -- -D warnings
# The Ceph RBD backend (birch-core's `rbd` feature) is linted too: checking needs no Ceph
# libraries (its FFI is declared by hand), only linking does. The same run lints the seeds'
# "before" switches (the `seed-before` feature, benchmark builds only: docs/BENCHMARKS.md,
# "The seeds, reproduced") and the fault device under a mount (`fault-injection`, test builds
# only); the features touch different code, so one run covers them all.
tier "clippy rbd + seed-before" cargo clippy --all-targets --release --locked \
  --features birch-tools/rbd,birch-tools/seed-before,birch-tools/fault-injection,birch-bench/seed-before -- -D warnings
# Every crate's tests in release, but the core's: those run in the `checked` profile (release
# speed with debug assertions, Error::bug's assertion and overflow checks; Cargo.toml), so a
# debug_assert! in the engine fires in CI. Model and crash tests run fixed seeds plus one
# fresh seed a run, printed (birch-testkit's `seeds`; BIRCH_SEED / BIRCH_FRESH_SEED replay).
tier "cargo test" cargo test --release --locked --workspace --exclude birch-core
# Then the tests of the seeds' "before" switches, which exist only with the `seed-before`
# feature: tests/bench_switches.rs and the object-id switch's unit test.
core_tests() {
  cargo test --profile checked --locked -p birch-core &&
    cargo test --profile checked --locked -p birch-core --features seed-before \
      --lib --test bench_switches -- objectid_lock_switch apply_per_item_costs
}
tier "core tests, checked" core_tests
# Structure-aware fuzzing, short (crates/birch-fuzz; docs/TESTING.md, "Fuzzing"): each of the
# six targets (node, item, superblock and log-batch decoding, log replay, open + walk + fsck of
# a whole image) runs 10 s from its corpus with a fresh seed (printed; a panic or a hang saves
# the input under crates/birch-fuzz/crashes/ and fails the tier). The corpus itself is replayed
# by the "cargo test" tier. Built in the `checked` profile (overflow checks and debug
# assertions are findings too), reusing the core tier's artifacts: about 2 minutes in all.
fuzz_short() {
  cargo build --profile checked --locked -p birch-fuzz &&
    ./target/checked/birch-fuzz run --seconds "${BIRCH_FUZZ_SECONDS:-10}"
}
tier "fuzz (short)" fuzz_short
tier "bench unit tests" python3 -m unittest discover bench/tests
# The mount tiers need the birch binary itself (cargo test does not build it).
tier "build birch" cargo build --release --locked -p birch-tools
# The Debian package (scripts/package.sh, reusing the release build just made): install it,
# mkfs -t birch, mount -a from an fstab line, fsck -t birch, dpkg --purge; puts back what the
# machine had at the package's paths and /etc/fstab. Skipped (77) without root or /dev/fuse.
# About 20 s, plus a one-time `cargo install cargo-deb` (about 7 minutes on 2 cores) on a
# machine without it. BIRCH_PACKAGE_TEST=0 leaves it out.
if [[ ${BIRCH_PACKAGE_TEST:-1} == 1 ]]; then
  tier "package" bash tests/package/package-test.sh
fi
# The crash matrix at CLI level, 250 crash states per run: 49 library runs (12 workloads:
# shutdown 3 runs, snapshots+fsync and snapshots+rollback 4 each, 30 ACE runs) + 15 FUSE-level
# runs (real system calls on a mount of the recording device; skipped with a reason without
# root or /dev/fuse): 16,000 crash states.
# A fixed seed, so two CI runs of one commit check the same states, then a smaller run from a
# fresh seed (printed: replay with --seed) so CI keeps exploring: 16,000 + 2,600 crash states.
tier "crashtest" ./target/release/birch crashtest --seed 20261202 --states 250 --ace-runs 30 --fuse-runs 15
tier "crashtest, fresh seed" ./target/release/birch crashtest --states 50 --ace-runs 30 --fuse-runs 3
# pjdfstest on birch beside the kernel ext4 baseline: no failure, and no skip that ext4 does
# not also skip, except link::link_count_max: glibc's pathconf(_PC_LINK_MAX) answers 127
# ("unknown") for every FUSE filesystem, whatever the server does, and pjdfstest then skips.
pjdfstest_tier() {
  local results=${RESULTS_DIR:-/tmp/birch-test-results}/pjdfstest
  rm -rf "$results"; mkdir -p "$results"
  RESULTS_DIR=$results bash tests/posix/pjdfstest-compare.sh
  local rc=$?
  [[ $rc == 0 ]] && return 0
  if [[ -s $results/pjdfstest-birch.failed ]]; then
    echo "pjdfstest: birch failures:"; cat "$results/pjdfstest-birch.failed"
    return 1
  fi
  [[ -f $results/pjdfstest-birch.skipped && -f $results/pjdfstest-ext4.skipped ]] || return $rc
  local extra
  extra=$(comm -13 <(sort "$results/pjdfstest-ext4.skipped") <(sort "$results/pjdfstest-birch.skipped") | grep -v '^link::link_count_max$')
  if [[ -n $extra ]]; then
    echo "pjdfstest: skipped on birch but not on ext4:"; echo "$extra"
    return 1
  fi
  echo "pjdfstest: 0 failures; only extra skip is link::link_count_max (FUSE pathconf limit)"
  return 0
}

can_mount=1
if [[ $(id -u) != 0 || ! -e /dev/fuse ]]; then
  can_mount=0
  echo "mount tiers skipped: need root and /dev/fuse"
fi
if [[ $can_mount == 1 ]]; then
  # mount(8) calls mount.fuse.birch for `-o remount` and fstab lines of type fuse.birch.
  install -m 0755 target/release/birch /usr/sbin/mount.fuse.birch
  tier "posix setup" bash tests/posix/setup.sh
  # The machine as scripts/setup.sh leaves it: FUSE over io_uring allowed (the fuse module's
  # enable_uring Y), so the mount tiers below run over the ring, birch's default there; the
  # /dev/fuse transport (older kernels, uring=off) gets its own tier right after.
  sh -c 'exec 3<>/dev/fuse' 2>/dev/null
  URING_PARAM=/sys/module/fuse/parameters/enable_uring
  [[ -e $URING_PARAM ]] && echo Y > "$URING_PARAM" 2>/dev/null
  tier "mount tests" bash tests/mount/mount-tests.sh
  tier "FUSE op tests" python3 tests/mount/fuse-ops.py
  tier "mount and FUSE op tests over /dev/fuse" \
    env BIRCH_MOUNT_OPTS=uring=off bash -c 'bash tests/mount/mount-tests.sh && python3 tests/mount/fuse-ops.py'
  # birch stats: --json fields, counters and latencies moving after writes, fsyncs and a
  # commit, the table and --watch (about 2 s).
  tier "stats" bash tests/mount/stats-test.sh
  # Images of older formats (FORMAT.md §9) still check clean, mount and take writes.
  tier "format fixtures" bash tests/images/check-fixtures.sh
  # birch scrub offline and online: clean and damaged (a data byte, a leaf byte) images,
  # exit codes 0/1/2, JSON fields, inodes and paths of damaged blocks (about 5 s).
  tier "scrub" bash tests/mount/scrub-test.sh
  # A device that stops answering: the image on ext4 frozen with fsfreeze under a mount with
  # -o io_timeout=1 (fsyncs fail in bounded time, read-only with the cause, stat/readdir/cached
  # reads served, fsync'd files intact, fsck clean; about 10 s).
  tier "hung device (io_timeout)" bash tests/mount/io-timeout-test.sh
  # FUSE over io_uring: the default with enable_uring N (over /dev/fuse, the setting left
  # alone) and Y (over the ring), -o uring, -o uring=off, and the fallback when registration
  # fails; skips (77) on a kernel without it. Leaves enable_uring as it found it.
  tier "FUSE over io_uring" bash tests/mount/uring-test.sh
  # NFS export through NFS-Ganesha (NFSv3 and v4, FSAL_VFS) beside kernel ext4: operations,
  # file handles across ganesha restarts, cache drops and remounts, UNSTABLE WRITE + COMMIT
  # across kill -9 (tests/nfs/; under a minute; skips with 77 if ganesha cannot run here).
  tier "NFS export (ganesha)" bash tests/nfs/nfs-test.sh
  tier "pjdfstest birch vs ext4" pjdfstest_tier
  tier "fsx birch" bash tests/posix/fsx.sh birch
  # xfstests generic/quick (633 tests; about 18 minutes here, 30 on a busy machine), birch
  # fsck after every test. The failures tests/xfstests/known-failures.txt lists, each with
  # its reason, are printed and do not fail the tier; any other does. Builds the suite once
  # into /var/tmp/birch-xfstests. BIRCH_XFSTESTS=0 leaves it out.
  if [[ ${BIRCH_XFSTESTS:-1} == 1 ]]; then
    tier "xfstests generic/quick" bash tests/xfstests/run.sh --ci
  fi
  # The soak, short (tests/soak/soak.py; docs/TESTING.md, "Soak"): fsx, fsstress and oracle
  # writers on a mount for 2.5 minutes of cycles ended by kill -9, birch shutdown (commit,
  # --log, --now) or umount; after each, fsck --data and every acknowledged write checked.
  # A fixed seed; about 3 minutes. After xfstests, which builds the fsstress and the C fsx
  # (O_DIRECT) it uses (without them it says so and runs the rest). The long run:
  # sudo python3 tests/soak/soak.py --minutes 30. BIRCH_SOAK=0 leaves it out.
  if [[ ${BIRCH_SOAK:-1} == 1 ]]; then
    tier "soak (short)" python3 tests/soak/soak.py --minutes 2.5 --seed 20261202
    # The same under device faults (one fault kind a cycle, through a build with the
    # fault-injection feature in target/fault-injection): about 3.5 minutes with its build.
    tier "fault soak (short)" bash tests/soak/fault-soak.sh
  fi
  tier "differential birch vs ext4" bash tests/posix/differential.sh
  # The benchmark harness in quick mode keeps it from rotting: it checks that every target
  # produced numbers, never how big they are. BIRCH_BENCH_QUICK=0 leaves it out.
  if [[ ${BIRCH_BENCH_QUICK:-1} == 1 ]]; then
    tier "bench quick" bash bench/run.sh --quick
  fi
  # birch on a Ceph RBD image (issue 21): a single-node cluster on loopback (tests/rbd/; about
  # 1.7 GB of memory, 3 GiB of disk, 3-5 minutes with the --features rbd build), mkfs, mount,
  # fsync'd data across a remount and a kill -9, the second user refused, takeover and fencing,
  # fsck; on the same cluster, NFS failover (tests/nfs/failover.sh, about 45 s: NFS-Ganesha on
  # one of two namespace "nodes" moves to the other when the first is frozen or killed, the
  # client carries on with its handles; BIRCH_NFS_FAILOVER=0 leaves it out). Last: it
  # rebuilds target/release/birch with the rbd feature. BIRCH_RBD=0 leaves it out.
  if [[ ${BIRCH_RBD:-1} == 1 ]]; then
    tier "RBD on a single-node Ceph, NFS failover" bash tests/rbd/rbd-test.sh
  fi
fi
echo "=== summary"
printf '%s\n' "${summary[@]}"
n_failed=$(printf '%s\n' "${summary[@]}" | grep -c FAILED)
n_passed=$(printf '%s\n' "${summary[@]}" | grep -c ': ok')
n_skipped=$(printf '%s\n' "${summary[@]}" | grep -c ': skipped')
echo "tiers: $n_passed passed, $n_failed failed, $n_skipped skipped"
exit $status
