# shellcheck shell=bash disable=SC2034  # CLIENT, rpcbind_pid, ganesha_pid: for the caller
# Shared by the NFS scripts (tests/nfs/nfs-test.sh, handle-spike.sh, failover.sh): sourced, not
# run. The caller is in the repository's root, defines skip() (prints a reason, exits 77) and sets
# DIR (its working directory) and LOGS (its log directory).

# nfs_setup NAME: installs ganesha, rpcbind and libnfs if missing and builds the test client
# (tests/nfs/setup.sh) into $DIR/bin; sets CLIENT. Skips (77) when the packages cannot be
# installed, exits 1 when the client does not build.
nfs_setup() {
  local rc=0
  bash tests/nfs/setup.sh "$DIR/bin" || rc=$?
  case $rc in
    0) ;;
    77) skip "cannot install ganesha, rpcbind or libnfs" ;;
    *) echo "$1: the test client does not build"; exit 1 ;;
  esac
  CLIENT=$DIR/bin/nfs-client
}

# nfs_ganesha_conf OUT [KEY=VALUE...]: tests/nfs/ganesha.conf with @DIR@ replaced by $DIR,
# written to OUT. Keys:
#   birch_only=1        the birch export alone (the paragraph of Export_Id 2, ext4, dropped)
#   fsid=MAJOR.MINOR    Filesystem_Id of the birch export (Export_Id 1)
#   fsid_type=TYPE      `fsid_type = TYPE;` in the birch export's FSAL block (FSAL_VFS re-indexes
#                       the filesystem's fsid with it: src/FSAL/localfs.c change_fsid_type)
#   export=PATH         the birch export's Path (default @DIR@/birch)
#   bind=ADDR           Bind_addr (default 127.0.0.1; "any": the line dropped, every address)
#   protocols=LIST      NFS_CORE_PARAM and EXPORT_DEFAULTS Protocols (default 3, 4)
#   recovery=DIR        NFSv4 RecoveryRoot (default @DIR@/recovery)
# Returns 1 (with a message) when an edit did not apply.
nfs_ganesha_conf() {
  local out=$1 kv birch_only=0 fsid='' fsid_type='' export='' bind='' protocols='' recovery=''
  shift
  for kv in "$@"; do
    case $kv in
      birch_only=*) birch_only=${kv#*=} ;;
      fsid=*) fsid=${kv#*=} ;;
      fsid_type=*) fsid_type=${kv#*=} ;;
      export=*) export=${kv#*=} ;;
      bind=*) bind=${kv#*=} ;;
      protocols=*) protocols=${kv#*=} ;;
      recovery=*) recovery=${kv#*=} ;;
      *) echo "nfs_ganesha_conf: unknown key $kv"; return 1 ;;
    esac
  done
  local edits=()
  [[ -n $fsid ]] && edits+=(-e "s#^\( *\)Export_Id = 1;#&\n\1Filesystem_Id = $fsid;#")
  [[ -n $fsid_type ]] && edits+=(-e "s#FSAL { Name = VFS; }#FSAL { Name = VFS; fsid_type = $fsid_type; }#")
  [[ -n $export ]] && edits+=(-e "s#Path = @DIR@/birch;#Path = $export;#")
  [[ $bind == any ]] && edits+=(-e "/^ *Bind_addr = /d")
  [[ -n $bind && $bind != any ]] && edits+=(-e "s#Bind_addr = .*;#Bind_addr = $bind;#")
  [[ -n $protocols ]] && edits+=(-e "s#Protocols = .*;#Protocols = $protocols;#")
  [[ -n $recovery ]] && edits+=(-e "s#RecoveryRoot = .*;#RecoveryRoot = $recovery;#")
  edits+=(-e "s#@DIR@#$DIR#g")
  if ((birch_only)); then
    awk 'BEGIN { RS = ""; ORS = "\n\n" } !/Export_Id = 2;/' tests/nfs/ganesha.conf
  else
    cat tests/nfs/ganesha.conf
  fi | sed "${edits[@]}" >"$out"
  local bad=
  [[ -z $fsid ]] || grep -q "Filesystem_Id = $fsid;" "$out" || bad="no Export_Id = 1 to add Filesystem_Id to"
  ((birch_only == 0)) || ! grep -q "Export_Id = 2" "$out" || bad="the ext4 export is still in"
  [[ -z $fsid_type ]] || grep -q "fsid_type = $fsid_type;" "$out" || bad="fsid_type not added"
  [[ -z $export ]] || grep -q "Path = $export;" "$out" || bad="export path not set"
  if [[ -n $bad ]]; then
    echo "nfs_ganesha_conf: $bad"
    return 1
  fi
}

# nfs_start_rpcbind LOG [PREFIX...]: rpcbind in the foreground of a background job (PREFIX, e.g.
# an nsenter, runs it elsewhere); sets rpcbind_pid; waits until it answers on 127.0.0.1 (asked
# through PREFIX too); returns 1 if it does not.
nfs_start_rpcbind() {
  local log=$1 i
  shift
  "$@" rpcbind -f </dev/null >>"$log" 2>&1 &
  rpcbind_pid=$!
  for ((i = 0; i < 50; i++)); do
    "$@" rpcinfo -p 127.0.0.1 >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  return 1
}

# nfs_start_ganesha CONF PIDFILE LOGLEVEL READY [PREFIX...]: ganesha.nfsd in the foreground of a
# background job in its own session (PREFIX, e.g. an nsenter that execs it, runs it elsewhere),
# logging to $LOGS/ganesha.log; sets ganesha_pid; returns 0 once the command READY succeeds, 1
# if ganesha exits or READY has not succeeded in 20 s.
nfs_start_ganesha() {
  local conf=$1 pidfile=$2 level=$3 ready=$4 i
  shift 4
  setsid "$@" ganesha.nfsd -F -f "$conf" -L "$LOGS/ganesha.log" -p "$pidfile" -N "$level" \
    </dev/null >>"$LOGS/ganesha.out" 2>&1 &
  ganesha_pid=$!
  for ((i = 0; i < 100; i++)); do
    if $ready; then return 0; fi
    kill -0 "$ganesha_pid" 2>/dev/null || break
    sleep 0.2
  done
  return 1
}

# nfs_stop_ganesha: SIGTERM to $ganesha_pid, SIGKILL after 10 s; waits for it.
nfs_stop_ganesha() {
  [[ -n $ganesha_pid ]] || return 0
  kill -TERM "$ganesha_pid" 2>/dev/null || true
  local i
  for ((i = 0; i < 100; i++)); do
    kill -0 "$ganesha_pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$ganesha_pid" 2>/dev/null || true
  wait "$ganesha_pid" 2>/dev/null || true
  ganesha_pid=
}
