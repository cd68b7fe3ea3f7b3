#!/usr/bin/env bash
# xfstests (the Linux filesystem test suite) on birchfs through FUSE.
#
#   tests/xfstests/run.sh                   # generic/quick on birch (FSTYP=fuse), fsck after each test
#   tests/xfstests/run.sh --ci              # the same, for CI: the known failures
#                                           # (known-failures.txt, each with its reason) are
#                                           # printed and do not fail the run
#   tests/xfstests/run.sh generic/001 ...   # only these tests (or any check(1) arguments: -g GROUP)
#   tests/xfstests/run.sh --ext4 [TESTS]    # the same tests on kernel ext4 (loop devices);
#                                           # default TESTS: the excluded ones (exclude.txt)
#
# What it proves: the suite's generic tests pass on birch as they would on a kernel filesystem,
# and every test leaves both images consistent (`birch fsck`, through the suite's per-test
# check, which rc-fuse-birch.patch wires to FUSE_FSCK_PROG; BIRCH_XFSTESTS_FSCK_EACH=0 turns it
# off), and both images are fsck-clean once more after the run.
#
# setup.sh installs the Debian packages, the users and the build (idempotent). Two sparse
# 10 GiB images (test and scratch) are made under a fresh directory in /var/tmp; the suite
# mounts them with `mount -t fuse.birch` (mount.fuse.birch, installed here from $BIRCH, the
# same binary scripts/test.sh installs). Tests in exclude.txt are not run: each fails on kernel
# ext4 on this machine too, for the reason written beside it (`--ext4` shows it).
#
# Prints pass / fail / not-run counts and the first line of each failure's report. Exit 0 when
# no test failed and both images are clean, 1 otherwise, 77 when it cannot run here (not root,
# no /dev/fuse). Results: $RESULTS_DIR (default /tmp/birch-xfstests-results): the suite's
# results tree, its log, and a summary.
#
# Knobs: BIRCH (binary), XFSTESTS_DIR (build, default /var/tmp/birch-xfstests),
# XFSTESTS_IMG_SIZE (default 10G), XFSTESTS_TIMEOUT (whole run, default 5400 s),
# BIRCH_XFSTESTS_FSCK_EACH (default 1), KEEP_WORK=1 (keep the images), BIRCH_MOUNT_OPTS
# (extra birch mount options for every mount, e.g. `uring`).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
RESULTS_DIR=${RESULTS_DIR:-/tmp/birch-xfstests-results}
# shellcheck source=../posix/lib.sh
source "$HERE/../posix/lib.sh" # cleanup of mounts on any exit, run_guarded; cd /
XFSTESTS_DIR=${XFSTESTS_DIR:-/var/tmp/birch-xfstests}
IMG_SIZE=${XFSTESTS_IMG_SIZE:-10G}
TIMEOUT=${XFSTESTS_TIMEOUT:-5400}
FSCK_EACH=${BIRCH_XFSTESTS_FSCK_EACH:-1}
EXCLUDE=$HERE/exclude.txt

target=birch
ci=0
if [[ ${1:-} == --ext4 ]]; then
  target=ext4
  shift
elif [[ ${1:-} == --ci ]]; then
  ci=1
  shift
fi
args=("$@")
if ((ci)); then
  # The whole group; the failures known-failures.txt lists (each with its reason) are printed
  # and do not fail the run.
  export XFSTESTS_KNOWN=$HERE/known-failures.txt
fi
if ((${#args[@]} == 0)); then
  if [[ $target == birch ]]; then
    args=(-g quick)
  else
    mapfile -t args < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$EXCLUDE" | grep -v '^$')
  fi
fi

require_root
[[ -e /dev/fuse || $target == ext4 ]] || skip "no /dev/fuse: FUSE unavailable on this machine"
if [[ $target == birch && ! -x $BIRCH ]]; then
  die "birch binary not found at $BIRCH (cargo build --release -p birch-tools, or set BIRCH=...)"
fi
bash "$HERE/setup.sh" || die "tests/xfstests/setup.sh failed"

install_cleanup_trap
WORK_DIR=$(mktemp -d /var/tmp/birch-xfstests-run.XXXXXX)
_CLEANUP_WORK=$WORK_DIR
chmod 0755 "$WORK_DIR"
rm -rf "$RESULTS_DIR"
mkdir -p "$RESULTS_DIR"
mkdir -p "$WORK_DIR/test" "$WORK_DIR/scratch"
CONFIG=$WORK_DIR/local.config

if [[ $target == birch ]]; then
  # The run uses a copy of the binary: a rebuild during the run changes nothing. mount(8) runs
  # mount.fuse.birch for `mount -t fuse.birch` (and remounts); it is one file for the whole
  # machine, so another run that installs a different binary meanwhile would mix binaries:
  # checked at the end.
  install -m 0755 "$BIRCH" "$WORK_DIR/birch"
  BIRCH=$WORK_DIR/birch
  cmp -s "$BIRCH" /usr/sbin/mount.fuse.birch || install -m 0755 "$BIRCH" /usr/sbin/mount.fuse.birch
  for name in test scratch; do
    timeout -k 5 120 "$BIRCH" mkfs --force --size "$IMG_SIZE" "$WORK_DIR/$name.img" >/dev/null ||
      die "birch mkfs $WORK_DIR/$name.img failed"
    # Any mount the suite leaves behind is undone on exit (birch umount, then harder).
    _CLEANUP_MOUNTS+=("birch:$WORK_DIR/$name")
  done
  # The per-test check: the suite unmounts first, but umount(8) of a FUSE mount returns
  # before the daemon has released the image; wait for it (at most 60 s) before fsck.
  cat >"$WORK_DIR/fsck-hook" <<EOF
#!/bin/bash
for i in \$(seq 600); do
  out=\$("$BIRCH" fsck "\$1" 2>&1); rc=\$?
  [[ \$rc == 8 && \$out == *"in use"* ]] || break
  sleep 0.1
done
echo "\$out"
exit \$rc
EOF
  chmod 0755 "$WORK_DIR/fsck-hook"
  # The suite's mkfs (rc-fuse-birch.patch): a new filesystem on the image, at the run's size or
  # at the size a test asks for (\$2 bytes); the image file is cut to that size first, since a
  # birchfs fills its image. An image still held by the daemon of an unmount (its flock) is
  # waited for.
  cat >"$WORK_DIR/mkfs-hook" <<EOF
#!/bin/bash
size=\${2:-$IMG_SIZE}
flock -x -w 60 "\$1" true || { echo "mkfs-hook: \$1 still in use after 60 s" >&2; exit 1; }
truncate -s 0 "\$1" && exec "$BIRCH" mkfs --force --size "\$size" "\$1"
EOF
  chmod 0755 "$WORK_DIR/mkfs-hook"
  fsck_line=""
  [[ $FSCK_EACH == 1 ]] && fsck_line="export FUSE_FSCK_PROG=$WORK_DIR/fsck-hook"
  cat >"$CONFIG" <<EOF
export FSTYP=fuse
export FUSE_SUBTYP=.birch
export TEST_DEV=$WORK_DIR/test.img
export TEST_DIR=$WORK_DIR/test
export SCRATCH_DEV=$WORK_DIR/scratch.img
export SCRATCH_MNT=$WORK_DIR/scratch
export FUSE_MOUNT_OPTIONS="-o allow_other${BIRCH_MOUNT_OPTS:+,$BIRCH_MOUNT_OPTS}"
export RESULT_BASE=$RESULTS_DIR/results
export FUSE_MKFS_PROG=$WORK_DIR/mkfs-hook
$fsck_line
EOF
else
  devs=()
  for name in test scratch; do
    truncate -s "$IMG_SIZE" "$WORK_DIR/$name.img"
    loop=$(losetup --find --show "$WORK_DIR/$name.img") || die "losetup failed"
    _CLEANUP_LOOPS+=("$loop")
    _CLEANUP_MOUNTS+=("ext4:$WORK_DIR/$name")
    devs+=("$loop")
  done
  mkfs.ext4 -q -F "${devs[0]}" || die "mkfs.ext4 failed"
  cat >"$CONFIG" <<EOF
export FSTYP=ext4
export TEST_DEV=${devs[0]}
export TEST_DIR=$WORK_DIR/test
export SCRATCH_DEV=${devs[1]}
export SCRATCH_MNT=$WORK_DIR/scratch
export RESULT_BASE=$RESULTS_DIR/results
EOF
fi

log "xfstests on $target: ${args[*]} (log $RESULTS_DIR/check.log)"
start=$SECONDS
exclude_args=()
[[ $target == birch ]] && exclude_args=(-E "$EXCLUDE")
cd "$XFSTESTS_DIR" || die "no $XFSTESTS_DIR"
HOST_OPTIONS=$CONFIG run_guarded "$TIMEOUT" "$RESULTS_DIR/check.log" \
  ./check -R xunit "${exclude_args[@]}" "${args[@]}"
check_rc=$?
took=$((SECONDS - start))
cd /
((check_rc == 124 || check_rc == 137)) && log "xfstests: the run hit its time limit (${TIMEOUT}s)"

# Whatever the suite left mounted is unmounted (synchronously), then both images are checked.
rc=0
for name in test scratch; do
  if _is_mounted "$WORK_DIR/$name"; then
    _cleanup_mount "$target:$WORK_DIR/$name"
  fi
  _forget_mount "$WORK_DIR/$name"
  if [[ $target == birch ]]; then
    if "$WORK_DIR/fsck-hook" "$WORK_DIR/$name.img" >"$RESULTS_DIR/fsck-$name.log" 2>&1; then
      log "birch fsck $name image after the run: clean"
    else
      log "birch fsck $name image after the run: NOT CLEAN (see $RESULTS_DIR/fsck-$name.log)"
      rc=1
    fi
  fi
done

if [[ $target == birch ]] && ! cmp -s "$BIRCH" /usr/sbin/mount.fuse.birch; then
  log "xfstests: /usr/sbin/mount.fuse.birch was replaced during the run: the tests may have run another binary"
  rc=1
fi
python3 "$HERE/summary.py" "$RESULTS_DIR/results" "$XFSTESTS_DIR" "$EXCLUDE" "$target" \
  "$took" | tee "$RESULTS_DIR/summary.txt"
summary_rc=${PIPESTATUS[0]}
((summary_rc != 0)) && rc=1
((check_rc == 124 || check_rc == 137)) && rc=1
# check(1) exits non-zero when a test failed; summary.py judged that already. Anything else
# (the suite could not start) is a failure of its own.
if ((check_rc != 0 && summary_rc == 0)) && ! grep -q '^Failures:' "$RESULTS_DIR/check.log"; then
  log "xfstests: check exited $check_rc without a failure list:"
  tail -n 20 "$RESULTS_DIR/check.log" >&2
  rc=1
fi
[[ $target == ext4 ]] && exit 0 # the baseline shows failures; it does not judge them
exit "$rc"
