# shellcheck shell=bash
# Common helpers for the external POSIX suites (sourced, not run).
#
# Provides: target mounting (kernel ext4 on a loop device, or birchfs through
# the `birch` binary), cleanup of every mount / loop device on exit (also on
# failure or signal), and a results directory for logs.
#
# Unmounting with escalation, aborting a hung FUSE connection and detaching loop
# devices are not written here: they call the command line of the repository's one
# mount/loop helper, bench/birchbench/mounts.py (standard library Python, shared with
# the benchmark harness and tests/mount/fuse-ops.py). Change them there.
#
# Environment knobs (all optional):
#   BIRCH             path of the birch binary   (default: target/release/birch)
#   BIRCH_MOUNT_OPTS  -o options for birch mount (default: allow_other)
#   IMG_SIZE          size of every test image   (default: 1G)
#   BIRCH_DEVICE_PREFIX  birch target only: the device is PREFIX+NAME instead of an image file
#                     (e.g. rbd:rbd/ gives rbd:rbd/pjd-main on a Ceph cluster; tests/rbd/)
#   RESULTS_DIR       where logs go              (default: /tmp/birch-posix-results)
#   WORK_DIR          where images and mount points go (default: a fresh mktemp -d)
#   KEEP_WORK=1       keep images after the run (for post-mortem)

set -o pipefail

POSIX_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$POSIX_DIR/../.." && pwd)
# Exit code the CI convention (automake, meson...) uses for "skipped".
EXIT_SKIP=77

BIRCH=${BIRCH:-target/release/birch}
# A relative BIRCH is taken from the current directory if it exists there,
# else from the repository root (the default works from anywhere); a bare
# name is looked up in PATH.
case $BIRCH in
  /*) ;;
  */*) if [[ -e $BIRCH ]]; then BIRCH=$(realpath "$BIRCH"); else BIRCH=$REPO_ROOT/$BIRCH; fi ;;
  *) BIRCH=$(command -v "$BIRCH" || echo "$REPO_ROOT/$BIRCH") ;;
esac
BIRCH_MOUNT_OPTS=${BIRCH_MOUNT_OPTS-allow_other}
IMG_SIZE=${IMG_SIZE:-1G}
RESULTS_DIR=${RESULTS_DIR:-/tmp/birch-posix-results}
RESULTS_DIR=$(realpath -m "$RESULTS_DIR")
[[ -n ${WORK_DIR:-} ]] && WORK_DIR=$(realpath -m "$WORK_DIR")
# Work from / so that no shell of ours keeps a test mount busy.
cd /
export PATH="$HOME/.cargo/bin:/usr/local/sbin:/usr/sbin:/sbin:$PATH"
export NO_COLOR=1

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
# Each line a command prints, logged.
_log_lines() { local l; while IFS= read -r l; do [[ -n $l ]] && log "$l"; done; return 0; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }
skip() { printf 'skipped: %s\n' "$*" >&2; exit "$EXIT_SKIP"; }

# ---------------------------------------------------------------------------
# Cleanup registry: everything we mount or attach is recorded here and undone
# in reverse order by the EXIT trap, whatever way the script ends.
# ---------------------------------------------------------------------------
_CLEANUP_MOUNTS=()    # "kind:mountpoint" (kind = ext4 | birch)
_CLEANUP_LOOPS=()     # "device:image" (detached only while still backed by that image)
_CLEANUP_WORK=""      # work directory to delete
_CLEANUP_DONE=0

# The shared helper (see the head of this file). Runs from / like everything here;
# it reads nothing below a mount point, so a hung mount cannot hang it.
MOUNTS_PY=$REPO_ROOT/bench/birchbench/mounts.py
_mounts() { python3 "$MOUNTS_PY" "$@"; }

# Abort the FUSE connection behind MNT (unblocks a hung daemon). The helper reads
# the device number from mountinfo: no file system access to a possibly hung mount.
_fuse_abort() {
  _mounts abort "$1" 2>&1 | _log_lines
}

# The same test as mounts.is_mounted, kept as a line of awk: it is on every
# mount/unmount path here and decides nothing but "is it there".
_is_mounted() { awk -v m="$1" '$5 == m { found = 1 } END { exit !found }' /proc/self/mountinfo; }

# Unmount "kind:MNT" whatever state it is in: for birch, `birch umount` (60 s),
# fusermount3 -u, umount (30 s each), then the FUSE connection aborted and the lazy
# unmounts, and the daemon of MNT killed if it is still there 10 s later; for ext4,
# umount, then umount -l. Every failed step is logged.
_cleanup_mount() {
  local kind=${1%%:*} mnt=${1#*:}
  _is_mounted "$mnt" || return 0
  log "cleanup: unmounting $mnt ($kind)"
  local -a args=(unmount --timeout 30)
  if [[ $kind == birch ]]; then
    args+=(--fuse --abort --birch-timeout 60)
    [[ -x $BIRCH ]] && args+=(--birch "$BIRCH")
  fi
  _mounts "${args[@]}" "$mnt" 2>&1 | _log_lines
  _is_mounted "$mnt" && log "cleanup: could not unmount $mnt"
  return 0
}

cleanup() {
  local rc=$?
  ((_CLEANUP_DONE)) && return 0
  _CLEANUP_DONE=1
  trap - EXIT INT TERM HUP
  local i
  for ((i = ${#_CLEANUP_MOUNTS[@]} - 1; i >= 0; i--)); do
    _cleanup_mount "${_CLEANUP_MOUNTS[i]}"
  done
  for ((i = ${#_CLEANUP_LOOPS[@]} - 1; i >= 0; i--)); do
    # detached only while its backing file is still our image: unmount_target may have
    # detached it already, and another run may have been given the same device since
    _mounts detach-loop "${_CLEANUP_LOOPS[i]%%:*}" "${_CLEANUP_LOOPS[i]#*:}" 2>&1 | _log_lines
  done
  if [[ -n $_CLEANUP_WORK && -d $_CLEANUP_WORK ]]; then
    if [[ ${KEEP_WORK:-0} == 1 ]]; then
      log "KEEP_WORK=1: leaving $_CLEANUP_WORK"
    elif ! grep -qF " $_CLEANUP_WORK/" /proc/self/mountinfo; then
      rm -rf -- "$_CLEANUP_WORK"
    else
      log "cleanup: $_CLEANUP_WORK still has mounts; not deleting it"
    fi
  fi
  return "$rc"
}

# The long-running child (a suite under `timeout`), if any. Run in the
# background and waited for, so that a signal to this script is handled at
# once (bash runs traps only between foreground commands) and stops it.
_CHILD=""
_WATCHDOG=""

_stop_watchdog() {
  [[ -n $_WATCHDOG ]] || return 0
  kill -TERM "$_WATCHDOG" 2>/dev/null
  wait "$_WATCHDOG" 2>/dev/null
  _WATCHDOG=""
}

_stop_child() {
  [[ -n $_CHILD ]] || return 0
  kill -TERM "$_CHILD" 2>/dev/null || return 0
  local i
  for ((i = 0; i < 15; i++)); do
    kill -0 "$_CHILD" 2>/dev/null || break
    sleep 1
  done
  # timeout(1) leads its own process group: kill what is left of it.
  kill -KILL -- "-$_CHILD" 2>/dev/null
  sleep 2
  if kill -0 "$_CHILD" 2>/dev/null; then
    # Blocked on a FUSE request nobody answers: fail the requests.
    local m
    for m in "${_CLEANUP_MOUNTS[@]}"; do
      [[ ${m%%:*} == birch ]] && _fuse_abort "${m#*:}"
    done
  fi
  wait "$_CHILD" 2>/dev/null
  _CHILD=""
}

# run_guarded SECONDS OUTFILE CMD...: CMD with a time limit (then SIGTERM, and
# SIGKILL 30 s later), stdout+stderr to OUTFILE, stdin from /dev/null.
# Returns CMD's status (124 or 137 when the limit hit).
# A process blocked on a FUSE request the daemon never answers ignores even
# SIGKILL; so if CMD is still there 10 s after the SIGKILL, a watchdog aborts
# the FUSE connections of our birch mounts, which fails those requests.
run_guarded() {
  local t=$1 out=$2 rc child
  shift 2
  timeout -k 30 "$t" "$@" >"$out" 2>&1 </dev/null &
  child=$!
  _CHILD=$child
  (
    # Its sleep is killed with it, and holds none of our output pipes.
    sp=""
    trap 'kill "$sp" 2>/dev/null; exit 0' TERM
    trap - EXIT INT HUP
    sleep $((t + 40)) >/dev/null 2>&1 &
    sp=$!
    wait "$sp"
    kill -0 "$child" 2>/dev/null || exit 0
    log "watchdog: '$1' still running $((t + 40))s after its start despite SIGKILL: file system hung"
    for m in "${_CLEANUP_MOUNTS[@]}"; do
      [[ ${m%%:*} == birch ]] && _fuse_abort "${m#*:}"
    done
  ) &
  _WATCHDOG=$!
  wait "$child"
  rc=$?
  _CHILD=""
  _stop_watchdog
  return "$rc"
}

install_cleanup_trap() {
  trap cleanup EXIT
  trap 'log "interrupted"; _stop_child; _stop_watchdog; exit 130' INT
  trap 'log "terminated"; _stop_child; _stop_watchdog; exit 143' TERM HUP
}

# Mark a mount as done with (already unmounted by the normal path).
_forget_mount() {
  local want=$1 i
  for i in "${!_CLEANUP_MOUNTS[@]}"; do
    [[ ${_CLEANUP_MOUNTS[i]#*:} == "$want" ]] && unset '_CLEANUP_MOUNTS[i]'
  done
  _CLEANUP_MOUNTS=("${_CLEANUP_MOUNTS[@]}")
}

make_work_dir() {
  if [[ -n ${WORK_DIR:-} ]]; then
    mkdir -p "$WORK_DIR"
  else
    WORK_DIR=$(mktemp -d /tmp/birch-posix.XXXXXX)
    _CLEANUP_WORK=$WORK_DIR
  fi
  # pjdfstest switches to unprivileged users: they must be able to reach the
  # mount points (mktemp -d makes 0700 directories).
  chmod 0755 "$WORK_DIR"
  mkdir -p "$RESULTS_DIR"
}

# ---------------------------------------------------------------------------
# Preconditions
# ---------------------------------------------------------------------------
require_root() {
  [[ $(id -u) == 0 ]] || skip "must run as root (mounts, loop devices, user switching)"
}

require_cmd() {
  local c
  for c in "$@"; do
    command -v "$c" >/dev/null 2>&1 || die "'$c' not found; run tests/posix/setup.sh first"
  done
}

# Check what TARGET needs before anything is created.
require_target() {
  case $1 in
    ext4)
      require_cmd mkfs.ext4 e2fsck losetup mount umount python3
      [[ -e /dev/loop-control ]] || skip "no /dev/loop-control: loop devices unavailable"
      ;;
    birch)
      if [[ ! -x $BIRCH ]]; then
        skip "birch binary not found at $BIRCH (build it with 'cargo build --release' or set BIRCH=...)"
      fi
      [[ -c /dev/fuse ]] || skip "no /dev/fuse: FUSE unavailable on this machine"
      require_cmd fusermount3 mount umount python3
      ;;
    *) die "unknown target '$1' (expected ext4 or birch)" ;;
  esac
}

# ---------------------------------------------------------------------------
# Targets. mount_target TARGET NAME: makes an image $WORK_DIR/NAME.img (for birch with
# BIRCH_DEVICE_PREFIX, the device PREFIX+NAME), mounts
# it at $WORK_DIR/NAME and sets MOUNTED_AT to the mount point (not printed:
# a $(...) subshell would lose the cleanup registration). unmount_target TARGET NAME:
# synchronous unmount, then fsck of the image; returns non-zero if unclean.
# ---------------------------------------------------------------------------
mount_target() {
  local target=$1 name=$2
  local img=$WORK_DIR/$name.img mnt=$WORK_DIR/$name
  mkdir -p "$mnt"
  rm -f "$img"
  case $target in
    ext4)
      truncate -s "$IMG_SIZE" "$img"
      mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$img" >&2 || die "mkfs.ext4 $img failed"
      local loop
      loop=$(losetup --find --show "$img") || die "losetup $img failed"
      _CLEANUP_LOOPS+=("$loop:$img")
      mount -t ext4 "$loop" "$mnt" || die "mount $loop $mnt failed"
      _CLEANUP_MOUNTS+=("ext4:$mnt")
      log "mounted ext4 $img ($loop) at $mnt"
      ;;
    birch)
      [[ -n ${BIRCH_DEVICE_PREFIX:-} ]] && img=$BIRCH_DEVICE_PREFIX$name
      timeout -k 5 120 "$BIRCH" mkfs --force --size "$IMG_SIZE" "$img" >&2 || die "$BIRCH mkfs --force --size $IMG_SIZE $img failed"
      local -a opts=()
      [[ -n $BIRCH_MOUNT_OPTS ]] && opts=(-o "$BIRCH_MOUNT_OPTS")
      # Register before mounting: a mount that half-succeeds is still cleaned up.
      _CLEANUP_MOUNTS+=("birch:$mnt")
      # The daemon's output goes to a log file: a daemon left holding our
      # stdout/stderr would keep a caller's pipe open.
      local mlog=$RESULTS_DIR/birch-mount-$name.log
      if ! timeout -k 5 120 "$BIRCH" mount "$img" "$mnt" "${opts[@]}" </dev/null >"$mlog" 2>&1; then
        sed 's/^/  | /' "$mlog" >&2
        die "$BIRCH mount $img $mnt ${opts[*]} failed (log $mlog)"
      fi
      _is_mounted "$mnt" || die "$BIRCH mount returned but nothing is mounted at $mnt"
      log "mounted birch $img at $mnt${opts:+ (${opts[*]})}"
      ;;
  esac
  # shellcheck disable=SC2034  # read by the scripts that source this file
  MOUNTED_AT=$mnt
}

# Returns 0 when the unmount succeeded and the image is clean.
unmount_target() {
  local target=$1 name=$2
  local img=$WORK_DIR/$name.img mnt=$WORK_DIR/$name rc=0
  case $target in
    ext4)
      sync
      timeout -k 5 120 umount "$mnt" || { log "umount $mnt failed"; return 1; }
      _forget_mount "$mnt"
      local loop
      loop=$(losetup -j "$img" | head -n1 | cut -d: -f1)
      [[ -n $loop ]] && losetup -d "$loop"
      if timeout -k 5 300 e2fsck -fn "$img" >"$RESULTS_DIR/fsck-$target-$name.log" 2>&1; then
        log "e2fsck $name: clean"
      else
        log "e2fsck $name: NOT CLEAN (see $RESULTS_DIR/fsck-$target-$name.log)"
        rc=1
      fi
      ;;
    birch)
      [[ -n ${BIRCH_DEVICE_PREFIX:-} ]] && img=$BIRCH_DEVICE_PREFIX$name
      timeout -k 5 300 "$BIRCH" umount "$mnt" || { log "$BIRCH umount $mnt failed"; return 1; }
      _is_mounted "$mnt" && { log "$BIRCH umount returned but $mnt is still mounted"; return 1; }
      _forget_mount "$mnt"
      if timeout -k 5 600 "$BIRCH" fsck "$img" >"$RESULTS_DIR/fsck-$target-$name.log" 2>&1; then
        log "birch fsck $name: clean"
      else
        log "birch fsck $name: NOT CLEAN (exit $?; see $RESULTS_DIR/fsck-$target-$name.log)"
        rc=1
      fi
      ;;
  esac
  return "$rc"
}
