#!/usr/bin/env bash
# Copied from /work/shared/ceph/single-node.sh (the shared notes of issue 21, measured on this
# machine 2026-11-25) so that tests/rbd/rbd-test.sh works from a clean checkout; CI has no
# /work/shared. Changes from the original: this header, and the monitor's free-space thresholds
# taken from MON_DATA_AVAIL_WARN / MON_DATA_AVAIL_CRIT (defaults as before, 2 and 1 %): on a
# shared, nearly full disk the warning alone kept the cluster from HEALTH_OK (used by
# rbd-test.sh); and CEPHX=1, which turns cephx on (every daemon gets its own key in its data
# directory, client.admin's key is in $BASE/keyring) for the tier's run with a `profile rbd` key.
# Single-node Ceph (Debian 12 packages, ceph 16.2.x "pacific") on loopback,
# no systemd, everything under $BASE (default /var/tmp/ceph1).
#
#   ceph-single-node.sh            # = "all": stop old daemons, wipe, bring up, bench
#   ceph-single-node.sh up         # stop old daemons, wipe, bring up cluster + pool + image
#   ceph-single-node.sh bench      # run the rbd/rados benchmarks against a running cluster
#   ceph-single-node.sh stop       # stop the daemons started by this script (by PID)
#   ceph-single-node.sh status     # ceph -s, PIDs, RSS, disk use
#
# Clients (rbd, rados, ceph, librados/librbd programs) find the cluster via
#   export CEPH_CONF=/var/tmp/ceph1/ceph.conf
#
# Prerequisites (once):
#   apt-get install -y --no-install-recommends ceph-mon ceph-mgr ceph-osd ceph-common \
#       librbd-dev librados-dev
# (apt's postinst only drops systemd unit symlinks; nothing is started without systemd.)
set -euo pipefail

BASE=${BASE:-/var/tmp/ceph1}
POOL=${POOL:-rbd}
IMAGE=${IMAGE:-img0}
IMAGE_SIZE=${IMAGE_SIZE:-2G}
# sparse file; it only grows as data is written, but it never shrinks (see below)
OSD_BLOCK_SIZE=${OSD_BLOCK_SIZE:-$((16 * 1024 * 1024 * 1024))}
OSD_MEMORY_TARGET=${OSD_MEMORY_TARGET:-$((1024 * 1024 * 1024))}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-180}
# rados bench writes ~800 MB/s here: an uncapped 10 s run filled a 10 GiB OSD before the
# (lagging) full-ratio check kicked in, BlueStore hit ENOSPC and the OSD aborted
# ("ENOSPC from bluestore, misconfigured cluster"). Cap it at 512 x 4 MiB = 2 GiB.
# BlueStore on a plain file also never punches freed space, so whatever the bench wrote
# stays allocated in block.file after the bench objects are deleted.
RADOS_BENCH_ARGS=${RADOS_BENCH_ARGS:---max-objects 512}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-300}   # per benchmark command; a dead OSD makes clients hang

CONF=$BASE/ceph.conf
export CEPH_CONF=$CONF

log() { printf '[%(%H:%M:%S)T +%ss] %s\n' -1 "$SECONDS" "$*" >&2; }
die() { log "FATAL: $*"; exit 1; }

stop_daemons() {
    local f pid name
    [ -d "$BASE/pids" ] || return 0
    # osd first, then mgr, mon last (an osd that cannot reach the mon is slow to exit)
    for f in "$BASE"/pids/osd.*.pid "$BASE"/pids/mgr.*.pid "$BASE"/pids/mon.*.pid; do
        [ -e "$f" ] || continue
        pid=$(cat "$f"); name=$(basename "$f" .pid)
        # only kill it if that PID still is a ceph daemon started with our config
        if [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "^ceph-[a-z]* .*-c $CONF"; then
            log "stopping $name (pid $pid)"
            kill -TERM "$pid" 2>/dev/null || true
            for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
            if kill -0 "$pid" 2>/dev/null; then log "$name did not exit in 30 s, SIGKILL"; kill -KILL "$pid" || true; fi
        fi
        rm -f "$f"
    done
}

# start a daemon in the foreground (-f), backgrounded by us, detached from our session
start_daemon() {
    local name=$1; shift
    setsid nohup "$@" -f -c "$CONF" >"$BASE/log/$name.stdout" 2>&1 </dev/null &
    echo $! >"$BASE/pids/$name.pid"
    log "started $name: pid $! ($*)"
}

write_conf() {
    local fsid=$1 auth=none
    [ "${CEPHX:-0}" = 1 ] && auth=cephx
    cat >"$CONF" <<EOF
[global]
fsid = $fsid
mon_host = [v2:127.0.0.1:3300,v1:127.0.0.1:6789]
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1
ms_bind_ipv6 = false
ms_bind_ipv4 = true

# no cephx unless CEPHX=1: simplest for a throw-away loopback cluster
auth_cluster_required = $auth
auth_service_required = $auth
auth_client_required = $auth
# pacific raises AUTH_INSECURE_GLOBAL_ID_RECLAIM_ALLOWED (HEALTH_WARN) even with auth=none
auth_allow_insecure_global_id_reclaim = false
mon_warn_on_insecure_global_id_reclaim_allowed = false

run_dir = $BASE/run
admin_socket = $BASE/run/\$name.asok
log_file = $BASE/log/\$name.log
keyring = $BASE/keyring
crash_dir = $BASE/crash
log_to_stderr = false
err_to_stderr = true

# single OSD, size-1 pools
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_crush_chooseleaf_type = 0
mon_allow_pool_size_one = true
mon_allow_pool_delete = true
mon_warn_on_pool_no_redundancy = false
# / is 21% used but the fs only has ~28% "available": default warn is 30%
mon_data_avail_warn = ${MON_DATA_AVAIL_WARN:-2}
mon_data_avail_crit = ${MON_DATA_AVAIL_CRIT:-1}

[client]
# clients must not share one admin socket path (two concurrent rbd/rados processes
# would collide with "bind_and_listen: (17) File exists")
admin_socket = $BASE/run/\$name.\$pid.asok

[mon]
mon_data = $BASE/mon/\$cluster-\$id
mon_initial_members = a
mon_cluster_log_file = $BASE/log/cluster.log

[mgr]
mgr_data = $BASE/mgr/\$cluster-\$id
keyring = $BASE/mgr/\$cluster-\$id/keyring

[osd]
osd_data = $BASE/osd/\$cluster-\$id
keyring = $BASE/osd/\$cluster-\$id/keyring
osd_objectstore = bluestore
bluestore_block_path = $BASE/osd/\$cluster-\$id/block.file
bluestore_block_create = true
bluestore_block_size = $OSD_BLOCK_SIZE
bluestore_block_db_path = ""
bluestore_block_db_create = false
bluestore_block_wal_path = ""
bluestore_block_wal_create = false
bluestore_fsck_on_mkfs = false
bluestore_fsck_on_mount = false
osd_memory_target = $OSD_MEMORY_TARGET
osd_crush_update_on_start = true
EOF
}

wait_for() {   # wait_for TIMEOUT DESCRIPTION COMMAND...
    local t=$1 what=$2; shift 2
    local end=$((SECONDS + t))
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $end ] || { ceph health detail >&2 || true; die "timed out waiting for $what"; }
        sleep 1
    done
    log "$what: ok"
}

health_ok() {   # HEALTH_OK and every PG active+clean, as seen by `ceph -s`
    ceph -s -f json 2>/dev/null | python3 -c '
import json, sys
s = json.load(sys.stdin)
pg = s["pgmap"]; n = pg.get("num_pgs", 0)
clean = sum(x["count"] for x in pg.get("pgs_by_state", []) if x["state_name"] == "active+clean")
sys.exit(0 if s["health"]["status"] == "HEALTH_OK" and n > 0 and clean == n else 1)'
}

up() {
    local t0=$SECONDS
    command -v ceph-mon >/dev/null || die "ceph-mon not installed"
    stop_daemons
    log "wiping $BASE"
    rm -rf "$BASE"
    mkdir -p "$BASE"/{run,log,pids,crash,mon,mgr,osd}

    local fsid; fsid=$(uuidgen 2>/dev/null || cat /proc/sys/kernel/random/uuid)
    write_conf "$fsid"

    # keyrings are not used with auth=none but mkfs likes to have one
    ceph-authtool --create-keyring "$BASE/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
    ceph-authtool "$BASE/keyring" --gen-key -n client.admin \
        --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' --cap mds 'allow *' >/dev/null

    # --- mon ---
    monmaptool --create --fsid "$fsid" --addv a '[v2:127.0.0.1:3300,v1:127.0.0.1:6789]' \
        "$BASE/monmap" >/dev/null
    mkdir -p "$BASE/mon/ceph-a"
    ceph-mon -c "$CONF" --mkfs -i a --monmap "$BASE/monmap" --keyring "$BASE/keyring"
    start_daemon mon.a ceph-mon -i a
    wait_for 60 "mon quorum" ceph -s --connect-timeout 5
    # pacific: let size-1 pools exist without nagging
    ceph config set global mon_warn_on_pool_no_redundancy false >/dev/null
    ceph config set global mon_allow_pool_size_one true >/dev/null

    # --- mgr ---
    mkdir -p "$BASE/mgr/ceph-x"
    # the mgr's key (only checked with cephx; harmless without)
    ceph auth get-or-create mgr.x mon 'allow profile mgr' osd 'allow *' mds 'allow *' \
        -o "$BASE/mgr/ceph-x/keyring" >/dev/null
    start_daemon mgr.x ceph-mgr -i x

    # --- osd (BlueStore on a plain sparse file) ---
    local uuid id secret; uuid=$(uuidgen 2>/dev/null || cat /proc/sys/kernel/random/uuid)
    secret=$(ceph-authtool --gen-print-key)
    id=$(echo "{\"cephx_secret\": \"$secret\"}" | ceph osd new "$uuid" -i -)
    mkdir -p "$BASE/osd/ceph-$id"
    ceph-authtool --create-keyring "$BASE/osd/ceph-$id/keyring" --name "osd.$id" \
        --add-key "$secret" >/dev/null
    log "osd.$id mkfs (bluestore on $BASE/osd/ceph-$id/block.file)"
    ceph-osd -c "$CONF" -i "$id" --mkfs --osd-uuid "$uuid" \
        >"$BASE/log/osd.$id.mkfs.out" 2>&1 || { tail -20 "$BASE/log/osd.$id.mkfs.out"; die "osd mkfs failed"; }
    start_daemon "osd.$id" ceph-osd -i "$id"
    wait_for 120 "osd.$id up" bash -c "ceph osd dump 2>/dev/null | grep -q '^osd.$id up'"
    wait_for 60 "mgr available" bash -c "ceph mgr stat 2>/dev/null | grep -q '\"available\": true'"

    # --- rbd pool + image ---
    ceph osd pool create "$POOL" 32 32
    ceph osd pool set "$POOL" size 1 --yes-i-really-mean-it >/dev/null 2>&1 || true
    rbd pool init "$POOL"
    rbd create --size "$IMAGE_SIZE" "$POOL/$IMAGE"
    wait_for "$HEALTH_TIMEOUT" "HEALTH_OK" health_ok
    log "cluster healthy after $((SECONDS - t0)) s"
    echo "$((SECONDS - t0))" >"$BASE/time-to-healthy.txt"
    ceph -s
    rbd info "$POOL/$IMAGE"
}

bench() {
    # librbd's client cache (rbd_cache=true, writeback after the first flush) merges the
    # sequential 4K writes into whole-object writes, so each write test runs twice:
    # default settings and --rbd-cache=false (every write acknowledged by the OSD).
    local out=$BASE/bench.txt b
    : >"$out"
    run() { log "bench: $*"; { echo "### $*"; timeout "$BENCH_TIMEOUT" "$@" 2>&1 | tail -n 1; echo; } | tee -a "$out"; }
    b=(rbd bench --io-threads 16 --io-total 256M)
    for cache in true false; do
        run "${b[@]}" --rbd-cache=$cache --io-type write --io-size 4K  --io-pattern seq  "$POOL/$IMAGE"
        run "${b[@]}" --rbd-cache=$cache --io-type write --io-size 4K  --io-pattern rand "$POOL/$IMAGE"
        run "${b[@]}" --rbd-cache=$cache --io-type write --io-size 64K --io-pattern seq  "$POOL/$IMAGE"
    done
    run "${b[@]}" --io-type read --io-size 4K  --io-pattern seq  "$POOL/$IMAGE"
    run "${b[@]}" --io-type read --io-size 4K  --io-pattern rand "$POOL/$IMAGE"
    run "${b[@]}" --io-type read --io-size 64K --io-pattern seq  "$POOL/$IMAGE"
    log "bench: rados bench -p $POOL 10 write $RADOS_BENCH_ARGS"
    { echo "### rados bench -p $POOL 10 write $RADOS_BENCH_ARGS (4 MiB objects, 16 in flight)"
      timeout "$BENCH_TIMEOUT" rados bench -p "$POOL" 10 write $RADOS_BENCH_ARGS 2>&1 | grep -E '^(Total writes|Bandwidth|Average IOPS|Average Latency|Max latency)'
      echo; } | tee -a "$out"
    log "results in $out"
}

status() {
    ceph -s || true
    local f pid
    for f in "$BASE"/pids/*.pid; do
        [ -e "$f" ] || continue
        pid=$(cat "$f")
        printf '%-8s pid %-7s %s\n' "$(basename "$f" .pid)" "$pid" \
            "$(awk '/^(VmRSS|VmHWM|Threads)/{printf "%s %s %s  ", $1, $2, $3}' /proc/"$pid"/status 2>/dev/null || echo dead)"
    done
    du -sh --apparent-size "$BASE" | sed 's/^/apparent: /'
    du -sh "$BASE" | sed 's/^/allocated: /'
}

case "${1:-all}" in
    all)    up; bench; status ;;
    up)     up ;;
    bench)  bench ;;
    stop)   stop_daemons ;;
    status) status ;;
    *) echo "usage: $0 [all|up|bench|stop|status]" >&2; exit 2 ;;
esac
