#!/usr/bin/env bash
# NFS export of birch, proven through NFS-Ganesha (this kernel has neither nfsd nor an NFS
# client), with the same export of a kernel ext4 loop mount beside it in the same run.
#
# Ganesha's FSAL_VFS resolves NFS file handles with name_to_handle_at / open_by_handle_at, the
# path through FUSE's export operations that the kernel's nfsd takes too. The client is
# tests/nfs/nfs-client.c on libnfs; it prints raw file handles, which this script keeps across
# events and sends back on fresh connections. For each export it checks:
#   - make, write, symlink, hard link, chmod, utimes, rename, truncate, list and remove through
#     NFSv3 and NFSv4: the mount shows the same names, types, sizes, link counts, modes, mtimes,
#     symlink targets and bytes; 3 MiB of random bytes written through NFS read back the same
#     on the mount and through NFS; a 1,500-name directory lists whole; a user other than root owns what it creates and is
#     refused (EACCES) in a directory it may not write;
#   - NFSv3 handles of a file, of a directory three levels deep, and of that directory after its
#     parent was renamed still work after ganesha is restarted and the kernel's caches dropped;
#     birch's counters show the LOOKUPs of "." and ".." the kernel sent to resolve them;
#   - NFSv4 handles saved from one client work with PUTFH from a new client after the same;
#   - the handle of a file removed through NFS answers NFS3ERR_STALE and NFS4ERR_STALE, and so
#     does that of a file replaced by a rename over its name; a file moved to another directory
#     and a file that lost one of its two names keep working;
#   - across a remount of the filesystem (ganesha stopped, unmount, mount, ganesha started)
#     with st_dev back the same: handles work; with st_dev taken by another mount: STALE or the
#     same file, never another file's data (FUSE reports f_fsid 0, so ganesha names the
#     filesystem by st_dev);
#   - an NFSv3 UNSTABLE WRITE then COMMIT, then a crash (kill -9 of the birch daemon; for ext4
#     a copy of its image taken right after the COMMIT): the data is there after the remount;
#   - another filesystem mounted at the export path that gets the old st_dev: the old handles
#     are STALE there, never its files (which have the same inode numbers);
#   - birch alone: a snapshot made through the mount is read through NFS at /.snapshot/NAME
#     (v3 and v4, by path and by handle, also after a ganesha restart and a cache drop) with
#     the bytes the file had then; writes there are refused (EROFS, NFS3ERR_ROFS); a
#     directory's handle there is STALE after a cache drop until its path is looked up (the
#     root's listing hides .snapshot, so the kernel cannot reconnect it: SEMANTICS §9); after
#     the snapshot is deleted (EBUSY while ganesha holds a file of it open) and another made
#     under its name with other bytes, its handles are STALE.
# Prints a table of checks x (birch, ext4); exits 1 if birch fails a check that ext4 passes
# (or that is birch's alone), 77 with a reason if ganesha cannot run here.
#
# Needs root and /dev/fuse. Works in NFS_TEST_DIR (default /tmp/nfs-test), ganesha on
# 127.0.0.1:2049. Drops the kernel's caches (echo 3 > /proc/sys/vm/drop_caches) several times.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIRCH=${BIRCH:-$(pwd)/target/release/birch}
DIR=${NFS_TEST_DIR:-/tmp/nfs-test}
SERVER=127.0.0.1
FSES=(birch ext4)
BIRCH_IMG=$DIR/birch.img
EXT4_IMG=$DIR/ext4.img

skip() { echo "nfs-test: SKIP: $*"; exit 77; }
[[ $(id -u) == 0 ]] || skip "needs root"
[[ -e /dev/fuse ]] || skip "/dev/fuse is absent"
[[ -x $BIRCH ]] || { echo "nfs-test: $BIRCH not built"; exit 1; }
if pgrep -x ganesha.nfsd >/dev/null; then skip "another ganesha.nfsd is running"; fi
mkdir -p "$DIR"
source tests/nfs/lib.sh
nfs_setup nfs-test
if ss -ltn 2>/dev/null | grep -q ':2049 '; then skip "port 2049 is in use"; fi

LOGS=$DIR/logs
rm -rf "$LOGS"
mkdir -p "$LOGS" "$DIR/recovery" "$DIR/birch" "$DIR/ext4"
nfs_ganesha_conf "$DIR/ganesha.conf" || exit 1

ganesha_pid=
birch_pid=
rpcbind_pid=
holds=()
spare=

cleanup() {
  stop_ganesha
  for h in "${holds[@]}"; do umount "$h" 2>/dev/null; done
  rmdir "$DIR"/hold* 2>/dev/null
  # The repository's mount helper reads the mount table (a mount whose daemon died cannot be
  # stat'ed): `birch umount`, then harder, up to aborting the FUSE connection.
  python3 bench/birchbench/mounts.py unmount --fuse --abort --birch "$BIRCH" --timeout 30 "$DIR/birch" >/dev/null
  findmnt -n "$DIR/ext4" >/dev/null && umount "$DIR/ext4"
  findmnt -n "$DIR/ext4-crash" >/dev/null && umount "$DIR/ext4-crash"
  [[ -n $spare ]] && losetup -d "$spare" 2>/dev/null
  [[ -n $rpcbind_pid ]] && { kill "$rpcbind_pid" 2>/dev/null; wait "$rpcbind_pid" 2>/dev/null; }
  rm -f "$DIR"/*.img "$DIR/random.bin"
}
trap cleanup EXIT

# --- the servers and the mounts -------------------------------------------------------------
client() { timeout 30 "$CLIENT" "$SERVER" "$@" 2>>"$LOGS/client.err"; }

both_exports_served() { [[ $(client v4fh /birch "") =~ ^[0-9a-f]+$ && $(client v4fh /ext4 "") =~ ^[0-9a-f]+$ ]]; }

start_ganesha() {
  nfs_start_ganesha "$DIR/ganesha.conf" "$DIR/ganesha.pid" "${NFS_TEST_GANESHA_LOG:-NIV_EVENT}" both_exports_served \
    && return 0
  echo "nfs-test: ganesha did not serve both exports; its log ends:"
  tail -20 "$LOGS/ganesha.log"
  return 1
}

stop_ganesha() { nfs_stop_ganesha; }

restart_ganesha() { stop_ganesha; start_ganesha; }

drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }

# allow_other, as every NFS export of birch needs (docs/SEMANTICS.md §7): ganesha serves a
# request as the caller's uid and gid (its thread's effective ids), and a FUSE mount without
# allow_other refuses every process whose ids are not the mounter's, so every user but root
# would get EACCES.
mount_birch() {
  setsid "$BIRCH" mount -f -o allow_other "$BIRCH_IMG" "$DIR/birch" </dev/null >>"$LOGS/birch.log" 2>&1 &
  birch_pid=$!
  local i
  for ((i = 0; i < 100; i++)); do
    mountpoint -q "$DIR/birch" && return 0
    kill -0 "$birch_pid" 2>/dev/null || break
    sleep 0.1
  done
  echo "nfs-test: birch did not mount"; tail -5 "$LOGS/birch.log"
  return 1
}

# Mounts birch so that it gets st_dev $1 back if that number is free: the kernel hands out
# the lowest free anonymous device number, so tmpfs mounts take the free ones below it first
# (another mount on the machine may have taken one since birch's unmount).
mount_birch_at_dev() {
  local want=$1 i d
  for ((i = 0; i < 32; i++)); do
    mkdir -p "$DIR/hold$i" && mount -t tmpfs -o size=1M none "$DIR/hold$i" || break
    d=$(stat -c %d "$DIR/hold$i")
    if [[ $d == "$want" ]]; then umount "$DIR/hold$i"; break; fi
    holds+=("$DIR/hold$i")
    ((d > want)) && break
  done
  mount_birch
  local rc=$?
  for h in "${holds[@]}"; do umount "$h"; done
  holds=()
  return $rc
}

umount_birch() {
  "$BIRCH" umount "$DIR/birch" || return 1
  wait "$birch_pid" 2>/dev/null
  birch_pid=
}

mount_ext4() { mount -o loop "$EXT4_IMG" "$DIR/ext4"; }
umount_ext4() { umount "$DIR/ext4"; }

stats() { getfattr -n trusted.birch.stats --only-values "$DIR/birch" 2>/dev/null; }
counter() { stats | grep -o "\"$1\": [0-9]*" | grep -o '[0-9]*$'; }

# --- results --------------------------------------------------------------------------------
CHECKS=()
declare -A RESULT DETAIL SEEN
record() { # check fs PASS|FAIL|n/a detail
  [[ -n ${SEEN[$1]:-} ]] || { SEEN[$1]=1; CHECKS+=("$1"); }
  RESULT[$1,$2]=$3
  DETAIL[$1,$2]=$4
  echo "  [$2] $1: $3${4:+ ($4)}"
}
# expect check fs got want [detail]: PASS if got == want.
expect() {
  if [[ $3 == "$4" ]]; then record "$1" "$2" PASS "${5:-}"; else record "$1" "$2" FAIL "got '$3', want '$4'${5:+; $5}"; fi
}

local_walk() { # what nfs-client's walk prints, from the mount, sorted
  (cd "$1" && find . -mindepth 1 | sed 's#^\./##' | while IFS= read -r p; do
    if [[ -L $p ]]; then echo "$p l $(readlink "$p")"
    elif [[ -d $p ]]; then echo "$p d"
    else echo "$p f $(stat -c '%s %h %a %Y' "$p") $(od -An -v -tx1 "$p" | tr -d ' \n')"; fi
  done) | LC_ALL=C sort
}

# --- the table -------------------------------------------------------------------------------
report() {
  echo
  printf '%-56s %-6s %-6s\n' "check" "birch" "ext4"
  printf '%-56s %-6s %-6s\n' "-----" "-----" "----"
  local regress=0 bp=0 bf=0 ep=0 ef=0 c b e
  for c in "${CHECKS[@]}"; do
    b=${RESULT[$c,birch]:-FAIL} e=${RESULT[$c,ext4]:-FAIL}
    printf '%-56s %-6s %-6s\n' "$c" "$b" "$e"
    [[ $b == PASS ]] && bp=$((bp + 1))
    [[ $b == FAIL ]] && bf=$((bf + 1))
    [[ $e == PASS ]] && ep=$((ep + 1))
    [[ $e == FAIL ]] && ef=$((ef + 1))
    [[ $b == FAIL && $e != FAIL ]] && regress=1
  done
  echo
  echo "nfs-test: birch $bp of $((bp + bf)) checks pass, ext4 $ep of $((ep + ef)); $((SECONDS - T0))s"
  if ((regress)); then
    echo "nfs-test: birch fails a check that ext4 passes (logs: $LOGS)"
    return 1
  fi
  return 0
}

# A step the checks depend on failed (a mount, an unmount, ganesha): the table so far, then 1.
abort() {
  echo "nfs-test: $* (logs: $LOGS)"
  report
  exit 1
}

# --- setup ----------------------------------------------------------------------------------
T0=$SECONDS
if ! pgrep -x rpcbind >/dev/null; then
  nfs_start_rpcbind "$LOGS/rpcbind.log" || skip "rpcbind does not start"
fi
truncate -s 128M "$DIR/ext4.img" && mkfs.ext4 -q -F "$DIR/ext4.img" && mount_ext4 || { echo "nfs-test: ext4 loop mount failed"; exit 1; }
"$BIRCH" mkfs --size 256M "$DIR/birch.img" >/dev/null && mount_birch || { echo "nfs-test: birch mount failed"; exit 1; }
start_ganesha || skip "ganesha cannot start here (log: $LOGS/ganesha.log)"
echo "nfs-test: ganesha serves /birch and /ext4 ($((SECONDS - T0))s)"

# --- 1. namespace operations through NFS, checked on the mount ------------------------------
echo "== operations through NFSv3 and NFSv4"
for fs in "${FSES[@]}"; do
  for v in 3 4; do
    c="v$v make/write/link/chmod/utimes/rename/truncate/rm"
    listing=$(client ops /$fs $v /ops$v)
    if [[ $listing != "OK a b-moved link two" ]]; then
      record "$c" $fs FAIL "listing through NFS: '$listing'"
      continue
    fi
    client walk /$fs $v /ops$v | LC_ALL=C sort >"$LOGS/walk-nfs-$fs-$v"
    local_walk "$DIR/$fs/ops$v" >"$LOGS/walk-mnt-$fs-$v"
    n=$(wc -l <"$LOGS/walk-mnt-$fs-$v")
    if [[ $n == 7 ]] && cmp -s "$LOGS/walk-nfs-$fs-$v" "$LOGS/walk-mnt-$fs-$v"; then
      record "$c" $fs PASS "$n entries: names, types, sizes, link counts, modes, mtimes, targets and bytes equal"
    else
      record "$c" $fs FAIL "NFS and mount differ: diff $LOGS/walk-nfs-$fs-$v $LOGS/walk-mnt-$fs-$v"
    fi
  done
done

echo "== 3 MiB of random bytes written and read back through NFS"
head -c 3M /dev/urandom >"$DIR/random.bin"
c="3 MiB file: v3 and v4 write and read back = mount"
for fs in "${FSES[@]}"; do
  bad=
  for v in 3 4; do
    client putfile /$fs $v /big$v.bin <"$DIR/random.bin" || bad+=" v$v write failed;"
    cmp -s "$DIR/random.bin" "$DIR/$fs/big$v.bin" || bad+=" v$v: the mount differs;"
    client cat /$fs $v /big$v.bin | cmp -s "$DIR/random.bin" - || bad+=" v$v: read back differs;"
  done
  if [[ -z $bad ]]; then record "$c" $fs PASS ""; else record "$c" $fs FAIL "${bad# }"; fi
done
rm -f "$DIR/random.bin"

echo "== a directory of 1500 names listed through NFS (many READDIRs, each from a cookie)"
c="1500-name directory: v3 and v4 READDIR = mount"
for fs in "${FSES[@]}"; do
  mkdir "$DIR/$fs/big"
  for ((i = 0; i < 1500; i++)); do : >"$DIR/$fs/big/a-name-long-enough-to-fill-replies-$i"; done
  rm "$DIR/$fs/big/a-name-long-enough-to-fill-replies-7"
  want="OK $(ls "$DIR/$fs/big" | LC_ALL=C sort | tr '\n' ' ')"
  h=$(client v3fh /$fs big) h4=$(client v4fh /$fs big)
  got3="$(client v3ls "$h") " got4="$(client v4ls "$h4") "
  if [[ $got3 == "$want" && $got4 == "$want" ]]; then
    record "$c" $fs PASS "1499 names each way"
  else
    record "$c" $fs FAIL "v3: $(wc -w <<<"$got3") words, v4: $(wc -w <<<"$got4"), want $(wc -w <<<"$want")"
  fi
done

echo "== a user other than root (ganesha serves its requests with the caller's uid and gid)"
c="uid 1000: owns what it creates, EACCES elsewhere"
for fs in "${FSES[@]}"; do
  client mkdir /$fs /pub && client chmod /$fs /pub 1777
  got="$(client putas /$fs 1000 /pub/mine "by uid 1000") $(client putas /$fs 1000 /ops3/theirs "denied")"
  owner=$(stat -c %u:%g "$DIR/$fs/pub/mine" 2>/dev/null)
  expect "$c" $fs "$got $owner $(cat "$DIR/$fs/pub/mine" 2>/dev/null)" "OK ERR EACCES 1000:1000 by uid 1000"
done

# --- 2. handles held across a ganesha restart and a cache drop ------------------------------
echo "== handles held across a ganesha restart and drop_caches"
declare -A F3 D3 R3 X3 F4 D4 X4 W3 M3 P3 L3 INO WRITE_RESULT
DATA="held file, three levels down"
for fs in "${FSES[@]}"; do
  for p in /h /h/d1 /h/d1/d2 /h/d1/d2/d3; do client mkdir /$fs $p; done
  client put /$fs /h/d1/d2/d3/f "$DATA"
  client put /$fs /h/doomed "removed through NFS"
  F3[$fs]=$(client v3fh /$fs h/d1/d2/d3/f)
  D3[$fs]=$(client v3fh /$fs h/d1/d2/d3)
  X3[$fs]=$(client v3fh /$fs h/doomed)
  F4[$fs]=$(client v4fh /$fs h/d1/d2/d3/f)
  D4[$fs]=$(client v4fh /$fs h/d1/d2/d3)
  X4[$fs]=$(client v4fh /$fs h/doomed)
  # The parent of d3 renamed through NFS; the handle of d3 taken before is held on, and the
  # handle of d3 under its new path taken too.
  client rename /$fs /h/d1/d2 /h/d1/d2r
  R3[$fs]=$(client v3fh /$fs h/d1/d2r/d3)
  client unlink /$fs /h/doomed
  # A file moved to another directory, a file replaced by a rename over its name, and a file
  # that lost one of its two names: each handle taken before.
  client put /$fs /h/moving "moved to another directory"
  client put /$fs /h/replaced "replaced by a rename"
  client put /$fs /h/newer "the file renamed over it"
  client put /$fs /h/linked "one of two names removed"
  client link /$fs /h/linked /h/d1/linked2
  M3[$fs]=$(client v3fh /$fs h/moving)
  P3[$fs]=$(client v3fh /$fs h/replaced)
  L3[$fs]=$(client v3fh /$fs h/linked)
  client rename /$fs /h/moving /h/d1/d2r/moved
  client rename /$fs /h/newer /h/replaced
  client unlink /$fs /h/linked
  INO[$fs,d2r]=$(stat -c %i "$DIR/$fs/h/d1/d2r")
  for h in "${F3[$fs]}" "${D3[$fs]}" "${R3[$fs]}" "${X3[$fs]}" "${F4[$fs]}" "${D4[$fs]}" "${X4[$fs]}" \
    "${M3[$fs]}" "${P3[$fs]}" "${L3[$fs]}"; do
    [[ $h =~ ^[0-9a-f]+$ ]] || abort "could not get a handle on $fs: '$h'"
  done
done
dot0=$(counter lookup_dot) dotdot0=$(counter lookup_dotdot) stale0=$(counter lookup_dot_stale)
restart_ganesha || abort "ganesha did not restart"
drop_caches
for fs in "${FSES[@]}"; do
  expect "v3 file handle after restart+drop_caches" $fs "$(client v3read "${F3[$fs]}")" "OK $DATA"
  expect "v3 handle of dir 3 levels deep" $fs "$(client v3ls "${D3[$fs]}")" "OK f"
  got="$(client v3ls "${R3[$fs]}") $(client v3lookup "${R3[$fs]}" ..)"
  expect "v3 handle of that dir, parent renamed" $fs "$got" "OK f OK ${INO[$fs,d2r]}" "lists d3 and LOOKUP .. is the renamed parent"
  expect "v3 handle of removed file: NFS3ERR_STALE" $fs "$(client v3read "${X3[$fs]}")" "ERR STALE 70"
  got="$(client v3read "${M3[$fs]}") | $(client v3read "${L3[$fs]}") | $(client v3read "${P3[$fs]}")"
  expect "v3 handles: moved, one link left, replaced (STALE)" $fs "$got" \
    "OK moved to another directory | OK one of two names removed | ERR STALE 70"
done
dot1=$(counter lookup_dot) dotdot1=$(counter lookup_dotdot) stale1=$(counter lookup_dot_stale)
c='kernel LOOKUP "." / ".." served (counters)'
if [[ -z $dot1 ]]; then
  record "$c" birch FAIL "no lookup_dot counter in the stats"
elif ((dot1 > dot0 && dotdot1 > dotdot0 && stale1 > stale0)); then
  record "$c" birch PASS "lookup_dot +$((dot1 - dot0)), lookup_dotdot +$((dotdot1 - dotdot0)), lookup_dot_stale +$((stale1 - stale0))"
else
  record "$c" birch FAIL "lookup_dot +$((dot1 - dot0)), lookup_dotdot +$((dotdot1 - dotdot0)), lookup_dot_stale +$((stale1 - stale0))"
fi
record "$c" ext4 n/a "kernel filesystem"

echo "== NFSv4 PUTFH of saved handles from a new client, after a ganesha restart and drop_caches"
restart_ganesha || abort "ganesha did not restart"
drop_caches
for fs in "${FSES[@]}"; do
  expect "v4 PUTFH file handle, new client" $fs "$(client v4read "${F4[$fs]}")" "OK $DATA"
  expect "v4 PUTFH dir handle, new client" $fs "$(client v4ls "${D4[$fs]}")" "OK f"
  expect "v4 PUTFH removed file: NFS4ERR_STALE" $fs "$(client v4read "${X4[$fs]}")" "ERR STALE 70"
done

# --- 2b. snapshots through the export (birch only) ------------------------------------------
# A snapshot made through the mount (`birch snapshot create MNT NAME`) is read through NFS at
# /.snapshot/NAME/...: by path and by handle (also after a ganesha restart and a cache drop,
# which resolves the handle through FUSE's export operations), with the bytes the live file had
# when it was made; writes there are refused (EROFS / NFS3ERR_ROFS); after the snapshot is
# deleted and another made under the same name with other bytes, the first one's handles
# answer STALE (or NOENT), never the new snapshot's bytes. ext4 has no snapshots: n/a.
echo "== a snapshot of birch through NFS (/.snapshot/NAME)"
SNAP_OLD="the file when the snapshot was made"
SNAP_LIVE="the live file, overwritten after the snapshot"
SNAP_NEW="the second snapshot of that name: other bytes"
snapdel() { "$BIRCH" snapshot delete "$DIR/birch" nfs1 >>"$LOGS/snapshot.log" 2>&1; }
client mkdir /birch /snapdir
client put /birch /snapdir/f "$SNAP_OLD"
if "$BIRCH" snapshot create "$DIR/birch" nfs1 >>"$LOGS/snapshot.log" 2>&1; then
  client put /birch /snapdir/f "$SNAP_LIVE"
  S3=$(client v3fh /birch .snapshot/nfs1/snapdir/f)
  S4=$(client v4fh /birch .snapshot/nfs1/snapdir/f)
  SD3=$(client v3fh /birch .snapshot/nfs1/snapdir)
  c="snapshot: read through NFS = bytes at the snapshot"
  got="$(client trycat /birch 3 /.snapshot/nfs1/snapdir/f) | $(client trycat /birch 4 /.snapshot/nfs1/snapdir/f) | $(client v3read "$S3") | $(client v4read "$S4") | $(client v3ls "$SD3") | $(client trycat /birch 3 /snapdir/f)"
  expect "$c" birch "$got" "OK $SNAP_OLD | OK $SNAP_OLD | OK $SNAP_OLD | OK $SNAP_OLD | OK f | OK $SNAP_LIVE" \
    "v3 and v4 by path and by handle, the snapshot's dir listed; the live file overwritten"
  c="snapshot: writes through NFS refused (EROFS)"
  got="$(client tryput /birch 3 /.snapshot/nfs1/snapdir/f x) | $(client tryput /birch 4 /.snapshot/nfs1/snapdir/new x) | $(client v3write "$S3" x) | $(client trycat /birch 3 /.snapshot/nfs1/snapdir/f)"
  expect "$c" birch "$got" "ERR EROFS | ERR EROFS | ERR ROFS 30 | OK $SNAP_OLD" \
    "v3 overwrite, v4 create, v3 WRITE on the handle: NFS3ERR_ROFS / NFS4ERR_ROFS; the bytes unchanged"
  restart_ganesha || abort "ganesha did not restart"
  drop_caches
  c="snapshot: file handles after restart+drop_caches"
  got="$(client v3read "$S3") | $(client v4read "$S4")"
  expect "$c" birch "$got" "OK $SNAP_OLD | OK $SNAP_OLD"
  # A directory's handle is resolved only when the kernel can connect it to the root: it
  # looks the parents up with LOOKUP "..", then each one's name in its parent's listing, and
  # the root's listing does not show .snapshot (hidden). So after the caches were dropped a
  # snapshot directory's handle is STALE until its path is looked up again (SEMANTICS §9).
  c="snapshot: dir handle, cold: STALE until looked up"
  cold=$(client v3ls "$SD3")
  ls "$DIR/birch/.snapshot/nfs1/snapdir" >/dev/null
  warm=$(client v3ls "$SD3")
  if [[ ($cold == "ERR STALE 70" || $cold == "OK f") && $warm == "OK f" ]]; then
    record "$c" birch PASS "cold: $cold; after ls of the path on the mount: $warm"
  else
    record "$c" birch FAIL "cold: $cold; after ls of the path on the mount: $warm"
  fi
  # Ganesha keeps files it read open (its fd cache), and a deletion is refused while a file
  # is open in the snapshot (EBUSY, SEMANTICS §9): if so, ganesha is stopped for it.
  client v3read "$S3" >/dev/null
  how="deleted with ganesha running"
  if ! snapdel; then
    how="EBUSY while ganesha ran (a file of it open), deleted with ganesha stopped"
    stop_ganesha
  fi
  if [[ -z $ganesha_pid ]] && ! snapdel; then how="failed"; fi
  if [[ $how != failed ]]; then
    printf %s "$SNAP_NEW" >"$DIR/birch/snapdir/f"
    "$BIRCH" snapshot create "$DIR/birch" nfs1 >>"$LOGS/snapshot.log" 2>&1 || abort "second snapshot nfs1 not made"
    restart_ganesha || abort "ganesha did not start again"
    drop_caches
    c="snapshot remade under its name: old handles STALE"
    got="$(client v3read "$S3") | $(client v4read "$S4") | $(client v3ls "$SD3")"
    new="$(client trycat /birch 3 /.snapshot/nfs1/snapdir/f)"
    if [[ $new != "OK $SNAP_NEW" ]]; then
      record "$c" birch FAIL "the new snapshot reads '$new' through NFS; old handles: $got"
    elif [[ $got =~ ^(ERR\ (STALE\ 70|NOENT\ 2)\ \|\ ){2}ERR\ (STALE\ 70|NOENT\ 2)$ ]]; then
      record "$c" birch PASS "$how; v3 file, v4 file, v3 dir: $got; the new snapshot reads its own bytes"
    else
      record "$c" birch FAIL "old handles: $got (the new snapshot holds '$SNAP_NEW')"
    fi
    "$BIRCH" snapshot delete "$DIR/birch" nfs1 >>"$LOGS/snapshot.log" 2>&1
  else
    record "snapshot remade under its name: old handles STALE" birch FAIL "the deletion failed: $(tail -1 "$LOGS/snapshot.log")"
    [[ -n $ganesha_pid ]] || start_ganesha || abort "ganesha did not start again"
  fi
else
  record "snapshot: read through NFS = bytes at the snapshot" birch FAIL "birch snapshot create failed: $(tail -1 "$LOGS/snapshot.log")"
fi
for c in "snapshot: read through NFS = bytes at the snapshot" "snapshot: writes through NFS refused (EROFS)" \
  "snapshot: file handles after restart+drop_caches" \
  "snapshot: dir handle, cold: STALE until looked up" \
  "snapshot remade under its name: old handles STALE"; do
  record "$c" ext4 n/a "no snapshots"
done

# --- 3. remounts ----------------------------------------------------------------------------
# After a remount the handles must name the same file or be STALE: never another's data.
judge_after_remount() { # check fs same_dev
  local check=$1 fs=$2 same=$3 f d f4 bad=0 stale=0
  f=$(client v3read "${F3[$fs]}") d=$(client v3ls "${R3[$fs]}") f4=$(client v4read "${F4[$fs]}")
  for got in "$f" "$d" "$f4"; do
    case $got in
      "OK $DATA" | "OK f") ;;
      "ERR STALE 70") stale=$((stale + 1)) ;;
      *) bad=1 ;;
    esac
  done
  local what="v3 file: $f; v3 dir: $d; v4 file: $f4"
  if ((bad)); then
    record "$check" $fs FAIL "neither the same file nor STALE: $what"
  elif [[ $same == 1 ]] && ((stale)); then
    record "$check" $fs FAIL "st_dev came back the same but handles are stale: $what"
  elif [[ $same == 1 ]]; then
    record "$check" $fs PASS "st_dev $4 again; 3 handles work"
  elif ((stale == 3)); then
    record "$check" $fs PASS "st_dev $4 -> $5; 3 handles STALE"
  else
    record "$check" $fs PASS "st_dev $4 -> $5; $((3 - stale)) handles still name the same file (fsid not from st_dev), $stale STALE"
  fi
}

echo "== remount (ganesha stopped, unmount, mount, ganesha started)"
stop_ganesha
declare -A DEV0 DEV1
for fs in "${FSES[@]}"; do DEV0[$fs]=$(stat -c %d "$DIR/$fs"); done
umount_birch && mount_birch_at_dev "${DEV0[birch]}" || abort "a mount or unmount failed"
umount_ext4 && mount_ext4 || abort "a mount or unmount failed"
start_ganesha || abort "ganesha did not start again"
drop_caches
for fs in "${FSES[@]}"; do
  DEV1[$fs]=$(stat -c %d "$DIR/$fs")
  same=0; [[ ${DEV0[$fs]} == "${DEV1[$fs]}" ]] && same=1
  judge_after_remount "remount: handles work (same st_dev) or STALE" $fs $same "${DEV0[$fs]}" "${DEV1[$fs]}"
done

echo "== remount with the old st_dev taken by another mount"
stop_ganesha
for fs in "${FSES[@]}"; do DEV0[$fs]=$(stat -c %d "$DIR/$fs"); done
umount_birch || abort "a mount or unmount failed"
# Anonymous device numbers go to the lowest free one: tmpfs mounts until one takes birch's.
for ((i = 0; i < 16; i++)); do
  mkdir -p "$DIR/hold$i" && mount -t tmpfs -o size=1M none "$DIR/hold$i" && holds+=("$DIR/hold$i")
  [[ $(stat -c %d "$DIR/hold$i") == "${DEV0[birch]}" ]] && break
done
mount_birch || abort "a mount or unmount failed"
# ext4's st_dev is its loop device: attach a spare image to the freed one first.
loopdev=$(findmnt -n -o SOURCE "$DIR/ext4")
umount_ext4 || abort "a mount or unmount failed"
truncate -s 1M "$DIR/spare.img"
spare=$(losetup --show -f "$DIR/spare.img")
if [[ $spare != "$loopdev" ]]; then
  losetup -d "$spare"
  spare=
  losetup "$loopdev" "$DIR/spare.img" 2>/dev/null && spare=$loopdev
fi
mount_ext4 || abort "a mount or unmount failed"
start_ganesha || abort "ganesha did not start again"
drop_caches
for fs in "${FSES[@]}"; do
  DEV1[$fs]=$(stat -c %d "$DIR/$fs")
  same=0; [[ ${DEV0[$fs]} == "${DEV1[$fs]}" ]] && same=1
  judge_after_remount "remount, old st_dev taken: STALE or same file" $fs $same "${DEV0[$fs]}" "${DEV1[$fs]}"
done
[[ -n $spare ]] && losetup -d "$spare" 2>/dev/null
spare=
for h in "${holds[@]}"; do umount "$h"; done
holds=()

# --- 4. UNSTABLE WRITE + COMMIT, then a crash --------------------------------------------
echo "== NFSv3 UNSTABLE WRITE + COMMIT, then a crash"
CDATA="unstable write, then COMMIT, then kill -9"
c="v3 UNSTABLE write + COMMIT survives a crash"
for fs in "${FSES[@]}"; do
  client put /$fs /crashfile ""
  W3[$fs]=$(client v3fh /$fs crashfile)
  fsyncs0=$(counter fsyncs)
  w=$(client v3write "${W3[$fs]}" "$CDATA")
  [[ $w == OK* ]] || record "$c" $fs FAIL "WRITE/COMMIT: $w"
  [[ $fs == birch ]] && w="$w, fsyncs +$(($(counter fsyncs) - fsyncs0))"
  WRITE_RESULT[$fs]=$w
done
# ext4: its image as a power cut right after the COMMIT would leave it (the loop device's
# writes so far), journal replayed by e2fsck.
cp --sparse=always "$DIR/ext4.img" "$DIR/ext4-crash.img"
# birch: the daemon killed; ganesha stopped (its requests to the dead mount fail); the
# mount point unmounted and the image mounted again (log replay).
DEV0[birch]=$(stat -c %d "$DIR/birch")
kill -KILL "$birch_pid"
wait "$birch_pid" 2>/dev/null
stop_ganesha
umount "$DIR/birch" 2>/dev/null || umount -l "$DIR/birch"
mount_birch_at_dev "${DEV0[birch]}" || abort "a mount or unmount failed"
if [[ ${RESULT[$c,birch]:-} != FAIL ]]; then
  got=$(cat "$DIR/birch/crashfile")
  replay=$(grep -o 'replaying [0-9]* log records' "$LOGS/birch.log" | tail -1)
  expect "$c" birch "$got" "$CDATA" "kill -9 of the daemon, remount (${replay:-no log replay}); ${WRITE_RESULT[birch]#OK }"
fi
if [[ ${RESULT[$c,ext4]:-} != FAIL ]]; then
  e2fsck -fy "$DIR/ext4-crash.img" >>"$LOGS/e2fsck.log" 2>&1
  mkdir -p "$DIR/ext4-crash"
  if mount -o ro,loop "$DIR/ext4-crash.img" "$DIR/ext4-crash"; then
    got=$(cat "$DIR/ext4-crash/crashfile")
    umount "$DIR/ext4-crash"
  else
    got="(crash image does not mount)"
  fi
  expect "$c" ext4 "$got" "$CDATA" "image copied right after COMMIT, journal replayed; ${WRITE_RESULT[ext4]#OK }"
fi

# The same file through its handle, from ganesha started again: birch's st_dev came back the
# same (the data) or not (STALE); ext4 was not crashed (its live mount answers).
start_ganesha || abort "ganesha did not start again"
drop_caches
DEV1[birch]=$(stat -c %d "$DIR/birch")
c2="handle after the crash: the data (same st_dev) or STALE"
for fs in "${FSES[@]}"; do
  got=$(client v3read "${W3[$fs]}")
  if [[ $got == "OK $CDATA" ]]; then
    record "$c2" $fs PASS "st_dev $(stat -c %d "$DIR/$fs")"
  elif [[ $got == "ERR STALE 70" && $fs == birch && ${DEV1[birch]} != "${DEV0[birch]}" ]]; then
    record "$c2" $fs PASS "STALE: st_dev ${DEV0[birch]} -> ${DEV1[birch]}"
  else
    record "$c2" $fs FAIL "got '$got'"
  fi
done
# Handles of four files on this mount, for the last check (another filesystem on this st_dev).
declare -A O3
for fs in "${FSES[@]}"; do
  for p in h/d1/d2r/d3/f h/d1/d2r/moved h/d1/linked2 crashfile; do
    O3[$fs]+="$(client v3fh /$fs $p) "
  done
done
stop_ganesha

# --- 5. the images are consistent -------------------------------------------------------------
declare -A DEV_END
for fs in "${FSES[@]}"; do
  DEV_END[$fs]=$(stat -c %d "$DIR/$fs")
  INO[$fs,held]="$(stat -c %i "$DIR/$fs/h/d1/d2r/d3/f" "$DIR/$fs/h/d1/d2r/moved" "$DIR/$fs/h/d1/linked2" "$DIR/$fs/crashfile" | tr '\n' ' ')"
done
umount_birch || abort "a mount or unmount failed"
umount_ext4 || abort "a mount or unmount failed"
c="fsck clean at the end"
if "$BIRCH" fsck "$DIR/birch.img" >"$LOGS/fsck-birch.log" 2>&1; then record "$c" birch PASS ""; else record "$c" birch FAIL "$LOGS/fsck-birch.log"; fi
if e2fsck -fn "$DIR/ext4.img" >"$LOGS/fsck-ext4.log" 2>&1; then record "$c" ext4 PASS ""; else record "$c" ext4 FAIL "$LOGS/fsck-ext4.log"; fi

# --- 6. another filesystem at the export path, on the old st_dev -----------------------------
# Ganesha names a FUSE filesystem by st_dev alone, so a different birch image that gets the same
# number at the same path is the same filesystem to it, and the old handles reach it. There
# they must be STALE, never its files, which have the same inode numbers. ext4 beside it: a new
# ext4 image on a loop device at the same path.
echo "== another filesystem at the export path on the old st_dev"
"$BIRCH" mkfs --size 256M "$DIR/birch2.img" >/dev/null || abort "mkfs of a second birch image failed"
truncate -s 128M "$DIR/ext4-2.img" && mkfs.ext4 -q -F "$DIR/ext4-2.img" || abort "mkfs of a second ext4 image failed"
BIRCH_IMG=$DIR/birch2.img EXT4_IMG=$DIR/ext4-2.img
mount_birch_at_dev "${DEV_END[birch]}" || abort "a mount or unmount failed"
mount_ext4 || abort "a mount or unmount failed"
for fs in "${FSES[@]}"; do
  mkdir "$DIR/$fs/other"
  for ((i = 0; i < 2500; i++)); do echo "another filesystem's file $i" >"$DIR/$fs/other/$i"; done
done
start_ganesha || abort "ganesha did not start again"
drop_caches
c="other fs on the old st_dev: old handles STALE"
for fs in "${FSES[@]}"; do
  dev=$(stat -c %d "$DIR/$fs") answers= bad=0 present=0
  for ino in ${INO[$fs,held]}; do
    [[ -n $(find "$DIR/$fs/other" -inum "$ino" -print -quit) ]] && present=$((present + 1))
  done
  for h in ${O3[$fs]}; do
    got=$(client v3read "$h")
    answers+="${answers:+; }$got"
    [[ $got == "ERR STALE 70" ]] || bad=1
  done
  same="st_dev ${DEV_END[$fs]} -> $dev; $present of 4 inode numbers are files there"
  if ((bad)); then
    record "$c" $fs FAIL "$same; got: $answers"
  else
    record "$c" $fs PASS "$same; 4 handles STALE"
  fi
done
stop_ganesha
umount_birch || abort "a mount or unmount failed"
umount_ext4 || abort "a mount or unmount failed"

report
