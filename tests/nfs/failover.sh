#!/usr/bin/env bash
# An NFS service that survives its node, on RBD (issue 42 item 5; docs/DESIGN.md §17).
#
# Two "nodes" on this machine, a and b: each a network namespace (bfo-a, bfo-b) with its own
# mount and UTS namespaces (its own /run on tmpfs, so its own rpcbind socket and birch host
# lock; hostname birchfo-a / birchfo-b) and its own cgroup v2. Each runs its own rpcbind; the
# active node also mounts the RBD image (birch, rbd backend) at the same path EXPORT and serves
# it with NFS-Ganesha 4.3 (FSAL_VFS, `fsid_type = Major64`, Filesystem_Id 4242.42, Export_Id 1:
# one configuration file for both nodes). The nodes' veths are on a bridge in the root
# namespace (10.99.0.1/24; node a 10.99.0.11, node b 10.99.0.12); the service address
# 10.99.0.10/24 is on the active node and is moved with `ip addr` (and a gratuitous ARP from
# the new node, as keepalived or pacemaker's IPaddr2 send) at failover. The client,
# tests/nfs/nfs-client.c on libnfs (NFSv3), runs in the root namespace against 10.99.0.10.
# The birch daemons reach the cluster through the root namespace's loopback (the test cluster,
# tests/rbd/single-node.sh, listens on 127.0.0.1 only): their network namespace is the root's,
# their mount and UTS namespaces and cgroup the node's.
#
# Scenario 1, freeze (node a active, b standby):
#   - the client takes the NFSv3 handles of a directory, a file in it and a second file (MOUNT +
#     LOOKUP from the export's root, this once), writes 16 blocks of 4 KiB stamped with their
#     offset and a version (UNSTABLE), COMMITs the first 8 (the write verifier recorded) and
#     leaves the last 8 uncommitted;
#   - node a is frozen as a whole (cgroup.freeze: ganesha, rpcbind and the birch daemon; a
#     stopped ganesha alone would keep answering TCP handshakes with its socket); from then on
#     the client asks GETATTR of the file's saved handle every 0.2 s (2 s per try);
#   - the service address moves to b; b mounts the image with `-o takeover` (it waits until
#     a's watch expired, blocklists a, takes the lock) at the same path and starts ganesha;
#     the two mounts' st_dev are printed and must differ (a's frozen mount keeps its anonymous
#     device number, so b's cannot get it);
#   - with the saved handles only: GETATTR of the file, the directory and the second file,
#     READ of the second file, READDIR of the directory (a STALE answer counts as a stale
#     handle); the 8 COMMITted blocks read back with their stamps (each one that does not is a lost
#     COMMITted write); a COMMIT shows the write verifier changed, so the client resends the 8
#     uncommitted blocks and COMMITs them; all 16 read back;
#   - node a thawed: a write through its mount path fails (EIO: its daemon was fenced by the
#     blocklist), a WRITE + COMMIT through its own ganesha (at a's own address) does not
#     succeed, its daemon's log says it was fenced, and nothing reached the image (the blocks and
#     the directory read back through b as before); a process of a that kept a file open since
#     before the freeze, and a READ through a's ganesha (which keeps files open), do not get
#     the bytes the kernel cached before the takeover (a fenced birch has the kernel drop them).
# Scenario 2, kill (b active, a standby; a's fenced mount unmounted and its processes gone):
#   - 8 more blocks COMMITted (version 2), 8 more left uncommitted, through b;
#   - node b killed as a whole (cgroup.kill: SIGKILL to every process of it);
#   - the address moves to a, a mounts with `-o takeover` and starts ganesha; the same checks
#     with the same handles, over all 32 blocks.
# At the end, node a's mount is unmounted and `birch fsck` of the image must be clean.
#
# Prints a RESULT line: the failover time of each scenario (from the freeze or kill to the
# client's first successful reply), stale handles, lost COMMITted writes, st_dev of the two
# mounts of each scenario. Aim: under 60 s. With the cluster's osd_client_watch_timeout at 15 s
# (tests/rbd/rbd-test.sh sets it; so does this script when it starts its own cluster) most of
# that time is the wait for the old node's watch to expire; with Ceph's default of 30 s, add 15.
#
# NFSv3 only: NFSv4 failover needs state reclaim (a shared recovery backend, lease and grace
# periods), out of scope here (issue 42).
#
# The cluster: with FAILOVER_CEPH_BASE=DIR, the running cluster of tests/rbd/single-node.sh
# under DIR (tests/rbd/rbd-test.sh passes its own, and BIRCH_RBD: its birch wrapper with
# client.birch's key); otherwise this script brings one up under $DIR/ceph (cephx on, birch as
# client.birch with profile rbd) and stops it at the end. BIRCH_RBD=path: a birch built with
# --features rbd; otherwise this script builds one (cargo build --release --features rbd, into
# CARGO_TARGET_DIR if set).
#
# Exit 0 when every check passes, 1 on a failure, 77 when it cannot run here (not root, no
# /dev/fuse, no cgroup v2, no ip netns, no ganesha or libnfs, no Ceph packages, the addresses
# 10.99.0.0/24 in use, another ganesha running). Cleans up everything it started (trap).
# Works under NFS_FAILOVER_DIR (default /var/tmp/birch-nfs-failover). About 45 s with a
# running cluster, 60 s with its own.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$(pwd)
DIR=${NFS_FAILOVER_DIR:-/var/tmp/birch-nfs-failover}
LOGS=$DIR/logs
EXPORT=$DIR/export # the same path on both nodes, each in its own mount namespace
SPEC=rbd:rbd/nfs-failover
NET=10.99.0
VIP=$NET.10
declare -A ADDR=([a]=$NET.11 [b]=$NET.12)
BR=bfo-br0
FSID=4242.42
T0=$SECONDS

say() { printf '[failover +%3ss] %s\n' "$((SECONDS - T0))" "$*"; }
skip() { echo "failover: SKIP: $*"; exit 77; }
FAILED=0
fail() { say "FAIL: $*"; FAILED=1; }
die() { say "FAIL: $*"; FAILED=1; exit 1; }

[[ $(id -u) == 0 ]] || skip "needs root"
[[ -e /dev/fuse ]] || skip "/dev/fuse is absent"
command -v ip >/dev/null && command -v nsenter >/dev/null && command -v unshare >/dev/null \
  || skip "needs ip (iproute2), nsenter and unshare (util-linux)"
CG2=$(findmnt -n -t cgroup2 -o TARGET 2>/dev/null | head -n 1)
[[ -n $CG2 ]] || skip "no cgroup v2 hierarchy mounted (the nodes are frozen and killed through it)"
if pgrep -x ganesha.nfsd >/dev/null; then skip "another ganesha.nfsd is running"; fi
if ip -o addr show | grep -q " $NET\."; then skip "addresses in $NET.0/24 are in use here"; fi
if ip netns list 2>/dev/null | grep -qE '^bfo-(a|b)( |$)'; then skip "network namespaces bfo-a/bfo-b exist (another run?)"; fi
mkdir -p "$DIR"
rm -rf "$LOGS"
mkdir -p "$LOGS/a" "$LOGS/b" "$DIR/recovery"
source tests/nfs/lib.sh
nfs_setup failover

# --- the cluster and birch ---------------------------------------------------------------------
OWN_CLUSTER=
if [[ -n ${FAILOVER_CEPH_BASE:-} ]]; then
  export BASE=$FAILOVER_CEPH_BASE CEPH_CONF=$FAILOVER_CEPH_BASE/ceph.conf
  timeout 20 ceph -s >/dev/null 2>&1 || { echo "failover: no cluster answers at $CEPH_CONF"; exit 1; }
  say "using the running cluster at $BASE"
else
  command -v ceph-mon >/dev/null && [[ -e /usr/include/rbd/librbd.h ]] \
    || skip "the Ceph packages are not installed (tests/rbd/rbd-test.sh installs them)"
  if ss -ltn 2>/dev/null | grep -qE ':(6789|3300) '; then skip "another Ceph monitor listens on 6789/3300"; fi
  avail_kb=$(df -Pk "$DIR" | awk 'NR == 2 { print $4 }')
  ((avail_kb > 3 * 1024 * 1024)) || skip "less than 3 GiB free under $DIR"
  export BASE=$DIR/ceph CEPH_CONF=$DIR/ceph/ceph.conf IMAGE_SIZE=64M
  export MON_DATA_AVAIL_WARN=${MON_DATA_AVAIL_WARN:-1} MON_DATA_AVAIL_CRIT=${MON_DATA_AVAIL_CRIT:-0}
  OWN_CLUSTER=1
fi
if [[ -n ${BIRCH_RBD:-} ]]; then
  BIRCH=$BIRCH_RBD
else
  say "building birch with --features rbd"
  cargo build --release --locked --features rbd -p birch-tools 2>&1 | tail -n 2
  BIRCH=${CARGO_TARGET_DIR:-$ROOT/target}/release/birch
fi
[[ -x $BIRCH ]] || { echo "failover: $BIRCH not built"; exit 1; }

# --- state for the cleanup ---------------------------------------------------------------------
declare -A GPID BPID
NODES_MADE=()
POLLER=
cg() { echo "$CG2/birch-failover-$1"; }
node_procs() { cat "$(cg "$1")/cgroup.procs" 2>/dev/null; }
# node_in NODE CMD...: CMD in the node's mount and UTS namespaces (not in its cgroup: an
# operator's command on that node). node_in_t SECS NODE CMD...: the same under timeout.
node_in() {
  local n=$1
  shift
  nsenter --mount="$DIR/ns/$n.mnt" --uts="$DIR/ns/$n.uts" -- "$@"
}
node_in_t() {
  local t=$1 n=$2
  shift 2
  timeout "$t" nsenter --mount="$DIR/ns/$n.mnt" --uts="$DIR/ns/$n.uts" -- "$@"
}
# node_cmd NODE NET: sets NODE_CMD, a command prefix that runs what follows as a process of the
# node: in its cgroup, its mount and UTS namespaces and (NET=1) its network namespace; exec all
# the way, so that the caller's $! is the command's pid.
node_cmd() {
  NODE_CMD=(sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$(cg "$1")" nsenter
    --mount="$DIR/ns/$1.mnt" --uts="$DIR/ns/$1.uts")
  (($2)) && NODE_CMD+=(--net="/run/netns/bfo-$1")
  NODE_CMD+=(--)
}
node_exec() { # NODE NET CMD...
  node_cmd "$1" "$2"
  shift 2
  "${NODE_CMD[@]}" "$@"
}
# Ends every process of the node (thawed first) and waits until its cgroup is empty.
kill_node() {
  local c i
  c=$(cg "$1")
  [[ -d $c ]] || return 0
  echo 0 >"$c/cgroup.freeze" 2>/dev/null
  echo 1 >"$c/cgroup.kill" 2>/dev/null
  for ((i = 0; i < 100; i++)); do
    [[ -z $(node_procs "$1") ]] && return 0
    sleep 0.1
  done
  say "note: node $1's cgroup still has processes: $(node_procs "$1" | tr '\n' ' ')"
}

cleanup() {
  local st=$? n
  set +e
  [[ -n $POLLER ]] && kill "$POLLER" 2>/dev/null
  for n in "${NODES_MADE[@]}"; do
    echo 0 >"$(cg "$n")/cgroup.freeze" 2>/dev/null
  done
  # A clean unmount where a daemon still serves (its final commit), then every process ended.
  for n in "${NODES_MADE[@]}"; do
    if node_in "$n" mountpoint -q "$EXPORT" 2>/dev/null; then
      node_in_t 30 "$n" "$BIRCH" umount "$EXPORT" >>"$LOGS/cleanup.log" 2>&1 ||
        node_in "$n" umount -l "$EXPORT" 2>/dev/null
    fi
  done
  for n in "${NODES_MADE[@]}"; do
    kill_node "$n"
    rmdir "$(cg "$n")" 2>/dev/null
    umount "$DIR/ns/$n.mnt" "$DIR/ns/$n.uts" 2>/dev/null
    ip netns del "bfo-$n" 2>/dev/null
  done
  mountpoint -q "$DIR/ns" && umount "$DIR/ns"
  ip link del "$BR" 2>/dev/null
  if [[ -n $OWN_CLUSTER ]]; then
    say "stopping the cluster"
    bash tests/rbd/single-node.sh stop >"$LOGS/cluster-stop.log" 2>&1
  else
    timeout 30 rbd rm rbd/nfs-failover >/dev/null 2>&1
  fi
  exit "$st"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [[ -n $OWN_CLUSTER ]]; then
  say "bringing up a single-node cluster (tests/rbd/single-node.sh, BASE=$BASE)"
  CEPHX=1 bash tests/rbd/single-node.sh up >"$LOGS/cluster-up.log" 2>&1 \
    || { tail -n 30 "$LOGS/cluster-up.log"; die "the cluster did not come up"; }
  ceph config set osd osd_client_watch_timeout 15 || die "setting osd_client_watch_timeout"
  ceph auth get-or-create client.birch mon 'profile rbd' osd 'profile rbd pool=rbd' \
    -o "$BASE/birch.keyring" >/dev/null || die "cannot make client.birch"
  mkdir -p "$DIR/bin"
  printf '#!/bin/bash\nCEPH_ARGS="--id birch --keyring %s/birch.keyring${CEPH_ARGS:+ $CEPH_ARGS}" exec -a "$0" "%s" "$@"\n' \
    "$BASE" "$BIRCH" >"$DIR/bin/birch"
  chmod +x "$DIR/bin/birch"
  BIRCH=$DIR/bin/birch
  say "cluster up"
fi
watch_timeout=$(ceph config get osd osd_client_watch_timeout 2>/dev/null)
say "osd_client_watch_timeout: ${watch_timeout:-?} s"
"$BIRCH" mkfs "$SPEC" --size 256M --force >"$LOGS/mkfs.log" 2>&1 || { cat "$LOGS/mkfs.log"; die "birch mkfs $SPEC"; }

# --- the two nodes ----------------------------------------------------------------------------
mkdir -p "$DIR/ns" "$EXPORT"
# A persistent namespace is a bind mount of its /proc file on a file: the directory holding
# them must be a private mount.
mount --bind "$DIR/ns" "$DIR/ns" && mount --make-private "$DIR/ns" || die "cannot make $DIR/ns a private mount"
ip link add "$BR" type bridge && ip addr add "$NET.1/24" dev "$BR" && ip link set "$BR" up \
  || die "cannot make the bridge $BR"
for n in a b; do
  NODES_MADE+=("$n")
  mkdir "$(cg "$n")" || die "cannot make the cgroup $(cg "$n")"
  [[ -e $(cg "$n")/cgroup.freeze && -e $(cg "$n")/cgroup.kill ]] || skip "cgroup v2 without cgroup.freeze or cgroup.kill (Linux 5.14+)"
  ip netns add "bfo-$n" || die "ip netns add bfo-$n"
  ip link add "bfo-$n-h" type veth peer name "bfo-$n-n" netns "bfo-$n" || die "veth for node $n"
  ip link set "bfo-$n-h" master "$BR" && ip link set "bfo-$n-h" up || die "veth bfo-$n-h"
  ip -n "bfo-$n" link set lo up && ip -n "bfo-$n" link set "bfo-$n-n" up &&
    ip -n "bfo-$n" addr add "${ADDR[$n]}/24" dev "bfo-$n-n" || die "addresses of node $n"
  touch "$DIR/ns/$n.mnt" "$DIR/ns/$n.uts"
  unshare --mount="$DIR/ns/$n.mnt" --uts="$DIR/ns/$n.uts" --propagation private \
    sh -c "hostname birchfo-$n && mount -t tmpfs -o mode=755 tmpfs /run && mkdir -p /run/rpcbind /run/birch" \
    || die "mount and UTS namespaces of node $n"
  node_exec "$n" 1 rpcbind -f </dev/null >>"$LOGS/$n/rpcbind.log" 2>&1 &
done
for n in a b; do
  for ((i = 0; i < 50; i++)); do
    nsenter --net="/run/netns/bfo-$n" rpcinfo -p 127.0.0.1 >/dev/null 2>&1 && break
    sleep 0.1
  done
  nsenter --net="/run/netns/bfo-$n" rpcinfo -p 127.0.0.1 >/dev/null 2>&1 || die "rpcbind of node $n does not answer"
done
say "nodes a (${ADDR[a]}) and b (${ADDR[b]}) up: network, mount and UTS namespaces, cgroups, rpcbind each"

# One ganesha configuration for both nodes: the birch export alone, at EXPORT, every address of
# the node's namespace, NFSv3, the handles' fsid from the device major (DESIGN §17).
nfs_ganesha_conf "$DIR/ganesha.conf" birch_only=1 fsid="$FSID" fsid_type=Major64 export="$EXPORT" \
  bind=any protocols=3 || die "ganesha.conf: an edit did not apply"

client() { timeout "${CLIENT_TIMEOUT:-30}" "$CLIENT" "$VIP" "$@" 2>>"$LOGS/client.err"; }
client_at() { local s=$1; shift; timeout "${CLIENT_TIMEOUT:-30}" "$CLIENT" "$s" "$@" 2>>"$LOGS/client.err"; }

garp() { # NODE: a gratuitous ARP for VIP from the node's interface, three times
  nsenter --net="/run/netns/bfo-$1" python3 - "bfo-$1-n" "$VIP" <<'EOF'
import socket, struct, sys, time
ifname, ip = sys.argv[1], socket.inet_aton(sys.argv[2])
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind((ifname, 0))
mac = s.getsockname()[4]
arp = struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, 1, mac, ip, b"\0" * 6, ip)
for _ in range(3):
    s.send(b"\xff" * 6 + mac + b"\x08\x06" + arp)
    time.sleep(0.05)
EOF
}

move_vip() { # FROM TO
  ip -n "bfo-$1" addr del "$VIP/24" dev "bfo-$1-n" 2>/dev/null
  ip -n "bfo-$2" addr add "$VIP/24" dev "bfo-$2-n" || fail "ip addr add $VIP on node $2"
  garp "$2" || fail "gratuitous ARP from node $2"
}

# mount_on NODE [OPTS]: `birch mount -f` of the image at EXPORT as a process of the node (its
# log in $LOGS/NODE/birch.log); returns once the node sees the mount.
mount_on() {
  local n=$1 o=allow_other${2:+,$2} i
  node_exec "$n" 0 "$BIRCH" mount -f "$SPEC" "$EXPORT" -o "$o" </dev/null >>"$LOGS/$n/birch.log" 2>&1 &
  BPID[$n]=$!
  for ((i = 0; i < 1800; i++)); do
    node_in "$n" mountpoint -q "$EXPORT" && return 0
    kill -0 "${BPID[$n]}" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

stop_ganesha_on() { ganesha_pid=${GPID[$1]:-}; nfs_stop_ganesha; GPID[$1]=; }

ganesha_ready_on=
ganesha_ready() { nsenter --net="/run/netns/bfo-$ganesha_ready_on" rpcinfo -T tcp 127.0.0.1 100003 3 >/dev/null 2>&1; }
start_ganesha_on() { # NODE
  ganesha_ready_on=$1
  node_cmd "$1" 1
  if LOGS=$LOGS/$1 nfs_start_ganesha "$DIR/ganesha.conf" "$DIR/ganesha-$1.pid" "${NFS_FAILOVER_GANESHA_LOG:-NIV_EVENT}" \
    ganesha_ready "${NODE_CMD[@]}"; then
    GPID[$1]=$ganesha_pid
    return 0
  fi
  GPID[$1]=$ganesha_pid
  say "ganesha on node $1 did not start; its log ends:"
  tail -20 "$LOGS/$1/ganesha.log"
  return 1
}

dev_on() { node_in "$1" stat -c '%d (%Hd:%Ld)' "$EXPORT"; }

# --- the poller: the client's GETATTR of a saved handle until it answers -------------------------
# poll_handle OUT: every 0.2 s, GETATTR of FH_FILE (2 s per try, a fresh connection each, as a
# client retransmitting); the first OK with the file's inode number ends it: "ok EPOCH" in OUT.
# STALE answers are counted (stale=N). Gives up after 120 s ("timeout").
poll_handle() {
  local out=$1 end=$((SECONDS + 120)) ans stale=0 tries=0
  while ((SECONDS < end)); do
    tries=$((tries + 1))
    ans=$(CLIENT_TIMEOUT=2 client v3fileid "$FH_FILE")
    case $ans in
      "OK $INO_FILE") echo "ok $(date +%s.%N) stale=$stale tries=$tries" >"$out"; return 0 ;;
      "ERR STALE"*) stale=$((stale + 1)) ;;
    esac
    sleep 0.2
  done
  echo "timeout stale=$stale tries=$tries" >"$out"
}

STALE=0 LOST=0
declare -A FAILOVER_S DEVS
# carry_on SCENARIO FIRST_COMMITTED_END UNCOMMITTED_FIRST N VERSION_OF_BLOCK...: the checks after
# a failover with the saved handles. Blocks [0, CEND) were COMMITted (versions in VERS), blocks
# [UFIRST, UFIRST+N) were written with version UVER and not COMMITted.
check_handles() { # SCENARIO
  local s=$1 got bad=0 what=()
  got=$(client v3fileid "$FH_FILE"); what+=("file GETATTR: $got")
  [[ $got == "OK $INO_FILE" ]] || { bad=$((bad + 1)); [[ $got == "ERR STALE"* ]] && STALE=$((STALE + 1)); }
  got=$(client v3fileid "$FH_DIR"); what+=("dir GETATTR: $got")
  [[ $got == "OK $INO_DIR" ]] || { bad=$((bad + 1)); [[ $got == "ERR STALE"* ]] && STALE=$((STALE + 1)); }
  got=$(client v3read "$FH_NOTE"); what+=("note GETATTR+READ: $got")
  [[ $got == "OK $NOTE" ]] || { bad=$((bad + 1)); [[ $got == "ERR STALE"* ]] && STALE=$((STALE + 1)); }
  got=$(client v3ls "$FH_DIR"); what+=("dir READDIR: $got")
  [[ $got == "OK file note" ]] || { bad=$((bad + 1)); [[ $got == "ERR STALE"* ]] && STALE=$((STALE + 1)); }
  if ((bad)); then
    fail "$s: the saved handles after failover: ${what[*]}"
  else
    say "ok: $s: the saved handles work (no LOOKUP from the root): GETATTR of the file, the directory and the note, READ of the note, READDIR ($got)"
  fi
}

# check_blocks SCENARIO VERSION FIRST N WHAT: the blocks read back with their stamps; returns the
# count of bad blocks in BAD.
check_blocks() {
  local got
  got=$(client v3check "$FH_FILE" "$2" "$3" "$4")
  BAD=$4
  [[ $got =~ ^OK\ good=([0-9]+)\ bad=([0-9]+) ]] && BAD=${BASH_REMATCH[2]}
  if [[ $BAD == 0 ]]; then
    say "ok: $1: $5: blocks $3..$(($3 + $4 - 1)) (version $2) read back with their stamps"
  else
    fail "$1: $5: blocks $3..$(($3 + $4 - 1)) (version $2): $got"
  fi
}

# resend_if_verifier_changed SCENARIO OLD_VERF VERSION FIRST N
resend_if_verifier_changed() {
  local got verf
  got=$(client v3commit "$FH_FILE")
  verf=${got#OK cverf=}
  if [[ $got != "OK cverf="* ]]; then
    fail "$1: COMMIT after failover: $got"
  elif [[ $verf == "$2" ]]; then
    fail "$1: the write verifier did not change ($verf): a client would not resend what the old node lost"
  else
    say "ok: $1: COMMIT answers another write verifier ($2 -> $verf): the client resends its uncommitted blocks $4..$(($4 + $5 - 1))"
    got=$(client v3wstamp "$FH_FILE" "$3" "$4" "$5" commit)
    [[ $got == "OK wverf="*" cverf=$verf" ]] || fail "$1: resend: $got (verifier now $verf)"
  fi
}

# --- scenario 1: node a active, frozen ---------------------------------------------------------
echo "== scenario 1: node a serves; frozen as a whole; node b takes over"
t=$SECONDS
mount_on a || { tail -n 20 "$LOGS/a/birch.log"; die "birch mount on node a"; }
say "node a mounted $SPEC at $EXPORT in $((SECONDS - t)) s"
DEVS[a1]=$(dev_on a)
ip -n bfo-a addr add "$VIP/24" dev bfo-a-n || die "ip addr add $VIP on node a"
start_ganesha_on a || die "ganesha on node a"
say "node a serves $VIP:/birch (ganesha pid ${GPID[a]}, birch daemon in cgroup $(cg a))"

NOTE="a file whose handle is kept across the failovers"
client mkdir /birch /data >/dev/null
client put /birch /data/note "$NOTE" >/dev/null
client put /birch /data/file "" >/dev/null
FH_DIR=$(client v3fh /birch data) FH_FILE=$(client v3fh /birch data/file) FH_NOTE=$(client v3fh /birch data/note)
[[ $FH_DIR =~ ^[0-9a-f]+$ && $FH_FILE =~ ^[0-9a-f]+$ && $FH_NOTE =~ ^[0-9a-f]+$ ]] \
  || die "no handles: dir '$FH_DIR', file '$FH_FILE', note '$FH_NOTE'"
INO_DIR=$(client v3fileid "$FH_DIR") INO_FILE=$(client v3fileid "$FH_FILE")
INO_DIR=${INO_DIR#OK } INO_FILE=${INO_FILE#OK }
say "handles: dir $FH_DIR (inode $INO_DIR), file $FH_FILE (inode $INO_FILE)"
w=$(client v3wstamp "$FH_FILE" 1 0 8 commit)
[[ $w =~ cverf=([0-9a-f]{16}) ]] || die "WRITE + COMMIT of blocks 0..7: $w"
VERF1=${BASH_REMATCH[1]}
w2=$(client v3wstamp "$FH_FILE" 1 8 8 nocommit)
[[ $w2 == "OK wverf="* ]] || die "WRITE of blocks 8..15: $w2"
say "blocks 0..7 written UNSTABLE and COMMITted ($w), blocks 8..15 written UNSTABLE, not COMMITted ($w2)"

# A process of node a keeps the note open (read once, so its pages are cached), to read it again
# after the fence (below).
rm -f "$DIR/read-now" "$DIR/read-now.held" "$DIR/held-read.out"
node_exec a 0 python3 -c '
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
os.pread(fd, 4096, 0)
open(sys.argv[2] + ".held", "w").close()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.1)
try:
    print("OK", os.pread(fd, 4096, 0).decode())
except OSError as e:
    print("ERR", e.strerror)
' "$EXPORT/data/note" "$DIR/read-now" >"$DIR/held-read.out" 2>&1 &

for ((i = 0; i < 100; i++)); do [[ -e $DIR/read-now.held ]] && break; sleep 0.1; done
[[ -e $DIR/read-now.held ]] || say "note: the reader on node a did not open the note: $(cat "$DIR/held-read.out")"

# Freeze node a: every process of it at once.
echo 1 >"$(cg a)/cgroup.freeze"
T_FREEZE=$(date +%s.%N)
poll_handle "$DIR/poll1" &
POLLER=$!
sleep 0.5
say "node a frozen (cgroup.events: $(tr '\n' ' ' <"$(cg a)/cgroup.events"); processes: $(node_procs a | wc -l))"
move_vip a b
say "service address $VIP moved to node b (gratuitous ARP sent)"
t=$SECONDS
if mount_on b takeover; then
  say "node b mounted with -o takeover in $((SECONDS - t)) s: $(grep -hoiE '[^ ]*(took over|blocklist)[^.]*' "$LOGS/b/birch.log" | head -n 1)"
else
  tail -n 20 "$LOGS/b/birch.log"
  die "birch mount -o takeover on node b"
fi
DEVS[b1]=$(dev_on b)
start_ganesha_on b || die "ganesha on node b"
wait "$POLLER"
POLLER=
read -r state when rest <"$DIR/poll1"
if [[ $state == ok ]]; then
  FAILOVER_S[freeze]=$(awk -v a="$T_FREEZE" -v b="$when" 'BEGIN { printf "%.1f", b - a }')
  say "the client's first successful reply (GETATTR of its saved file handle) came ${FAILOVER_S[freeze]} s after the freeze ($rest)"
else
  FAILOVER_S[freeze]=none
  fail "the client got no successful reply within 120 s of the freeze ($state $when $rest)"
fi
[[ $rest =~ stale=([0-9]+) ]] && STALE=$((STALE + BASH_REMATCH[1]))
say "st_dev: node a's mount ${DEVS[a1]}, node b's mount ${DEVS[b1]}"
[[ ${DEVS[a1]%% *} != "${DEVS[b1]%% *}" ]] || fail "the two mounts have the same st_dev ${DEVS[a1]}"
check_handles freeze
check_blocks freeze 1 0 8 "COMMITted before the freeze"
LOST=$((LOST + BAD))
resend_if_verifier_changed freeze "$VERF1" 1 8 8
check_blocks freeze 1 0 16 "all, after the resend"

# The old node thawed: fenced.
echo 0 >"$(cg a)/cgroup.freeze"
say "node a thawed; waiting 5 s (its lock monitor asks every 2 s)"
sleep 5
out=$(node_in_t 20 a sh -c "echo 'written by the fenced node' >'$EXPORT/data/fenced'" 2>&1)
rc=$?
if ((rc == 0)); then
  fail "a write through node a's mount path succeeded after the takeover"
else
  say "ok: a write through node a's mount path fails: ${out:-exit $rc}"
fi
out=$(node_in_t 20 a dd if=/dev/zero of="$EXPORT/data/file" bs=4k count=1 conv=notrunc,fsync status=none 2>&1)
rc=$?
((rc != 0)) && say "ok: an overwrite of block 0 through node a's mount path fails: ${out:-exit $rc}" \
  || fail "an overwrite of block 0 through node a's mount path succeeded"
got=$(CLIENT_TIMEOUT=20 client_at "${ADDR[a]}" v3wstamp "$FH_FILE" 99 0 1 commit)
rc=$?
if [[ $got == OK* ]]; then
  fail "WRITE + COMMIT through node a's ganesha (${ADDR[a]}) succeeded: $got"
else
  say "ok: WRITE + COMMIT through node a's own ganesha (${ADDR[a]}) does not succeed: ${got:-no answer (exit $rc)}"
fi
# Reads on the fenced node. A fenced birch answers EIO to every request (an open, above), and
# has the kernel drop the pages and attributes it cached, which need no request: a process of a
# that kept the note open since before the freeze, and a's ganesha (which keeps files open in
# its fd cache), must not read the bytes cached before the takeover.
touch "$DIR/read-now"
for ((i = 0; i < 100; i++)); do [[ -s $DIR/held-read.out ]] && break; sleep 0.1; done
got=$(head -c 200 "$DIR/held-read.out")
if [[ $got == ERR* ]]; then
  say "ok: a process of node a that held the note open since before the freeze cannot read it after the fence: $got"
else
  fail "a process of node a that held the note open since before the freeze reads after the fence: ${got:-nothing}"
fi
got=$(CLIENT_TIMEOUT=20 client_at "${ADDR[a]}" v3read "$FH_NOTE")
rc=$?
if [[ $got == OK* ]]; then
  fail "READ of the note through node a's own ganesha (${ADDR[a]}) answers after the fence: $got"
else
  say "ok: READ of the note through node a's own ganesha does not answer with data: ${got:-no answer (exit $rc)}"
fi
fenced=$(grep -hoE 'the image is lost \([^)]*\)+|this client is blocklisted[^;]*|the image lock is no longer ours[^;]*' "$LOGS/a/birch.log" | head -n 1)
[[ -n $fenced ]] && say "ok: node a's daemon says it was fenced: $fenced" \
  || fail "node a's daemon log does not say it was fenced: $(tail -n 3 "$LOGS/a/birch.log")"
check_blocks fence 1 0 16 "read through node b after node a's attempts"
got=$(client v3lookup "$FH_DIR" fenced)
[[ $got == "ERR NOENT 2" ]] && say "ok: node a's file is not in the directory (through node b: $got)" \
  || fail "node a's file through node b: $got"

# Node a leaves: its fenced mount unmounted, its processes ended; it becomes the standby.
stop_ganesha_on a
node_in_t 30 a "$BIRCH" umount "$EXPORT" >>"$LOGS/a/birch-umount.log" 2>&1 || node_in a umount -l "$EXPORT"
kill_node a
node_exec a 1 rpcbind -f </dev/null >>"$LOGS/a/rpcbind.log" 2>&1 &

# --- scenario 2: node b active, killed ----------------------------------------------------------
echo "== scenario 2: node b serves; killed as a whole (SIGKILL); node a takes over"
w=$(client v3wstamp "$FH_FILE" 2 16 8 commit)
[[ $w =~ cverf=([0-9a-f]{16}) ]] || die "WRITE + COMMIT of blocks 16..23 through node b: $w"
VERF2=${BASH_REMATCH[1]}
w2=$(client v3wstamp "$FH_FILE" 2 24 8 nocommit)
[[ $w2 == "OK wverf="* ]] || die "WRITE of blocks 24..31: $w2"
say "blocks 16..23 written and COMMITted through node b ($w), blocks 24..31 not COMMITted ($w2)"
DEVS[b2]=${DEVS[b1]}
echo 1 >"$(cg b)/cgroup.kill"
T_KILL=$(date +%s.%N)
poll_handle "$DIR/poll2" &
POLLER=$!
for ((i = 0; i < 50; i++)); do [[ -z $(node_procs b) ]] && break; sleep 0.1; done
say "node b killed (processes left: $(node_procs b | wc -l))"
move_vip b a
say "service address $VIP moved to node a"
t=$SECONDS
if mount_on a takeover; then
  say "node a mounted with -o takeover in $((SECONDS - t)) s"
else
  tail -n 20 "$LOGS/a/birch.log"
  die "birch mount -o takeover on node a"
fi
DEVS[a2]=$(dev_on a)
start_ganesha_on a || die "ganesha on node a"
wait "$POLLER"
POLLER=
read -r state when rest <"$DIR/poll2"
if [[ $state == ok ]]; then
  FAILOVER_S[kill]=$(awk -v a="$T_KILL" -v b="$when" 'BEGIN { printf "%.1f", b - a }')
  say "the client's first successful reply came ${FAILOVER_S[kill]} s after the kill ($rest)"
else
  FAILOVER_S[kill]=none
  fail "the client got no successful reply within 120 s of the kill ($state $when $rest)"
fi
[[ $rest =~ stale=([0-9]+) ]] && STALE=$((STALE + BASH_REMATCH[1]))
say "st_dev: node b's (dead) mount ${DEVS[b2]}, node a's new mount ${DEVS[a2]}"
[[ ${DEVS[a2]%% *} != "${DEVS[b2]%% *}" ]] || fail "the two mounts have the same st_dev ${DEVS[a2]}"
check_handles kill
check_blocks kill 1 0 16 "COMMITted in scenario 1"
LOST=$((LOST + BAD))
check_blocks kill 2 16 8 "COMMITted before the kill"
LOST=$((LOST + BAD))
resend_if_verifier_changed kill "$VERF2" 2 24 8
check_blocks kill 2 16 16 "blocks of version 2, after the resend"
out=$(node_in_t 10 b sh -c "echo x >'$EXPORT/data/fenced'" 2>&1) && fail "a write through node b's dead mount succeeded" \
  || say "ok: node b's mount is dead: ${out:-error}"

# --- the end: fsck ------------------------------------------------------------------------------
stop_ganesha_on a
node_in_t 60 a "$BIRCH" umount "$EXPORT" >>"$LOGS/a/birch-umount.log" 2>&1 || fail "birch umount on node a"
node_in b umount -l "$EXPORT" 2>/dev/null
if "$BIRCH" fsck "$SPEC" >"$LOGS/fsck.log" 2>&1; then
  say "ok: birch fsck of the image is clean"
else
  tail -n 10 "$LOGS/fsck.log"
  fail "birch fsck of the image"
fi

echo
echo "RESULT: failover freeze ${FAILOVER_S[freeze]} s, kill ${FAILOVER_S[kill]} s (aim < 60 s);" \
  "stale handles $STALE; lost COMMITted writes $LOST (of 24 blocks);" \
  "st_dev freeze: a ${DEVS[a1]} vs b ${DEVS[b1]}, kill: b ${DEVS[b2]} vs a ${DEVS[a2]};" \
  "osd_client_watch_timeout ${watch_timeout:-?} s; $((SECONDS - T0)) s in all"
if ((FAILED)); then say "FAILED (logs: $LOGS)"; exit 1; fi
for s in freeze kill; do
  [[ ${FAILOVER_S[$s]} != none ]] && awk -v x="${FAILOVER_S[$s]}" 'BEGIN { exit !(x < 60) }' ||
    { say "FAILED: the $s failover took ${FAILOVER_S[$s]} s (aim: under 60)"; exit 1; }
done
say "all checks passed"
exit 0
