#!/usr/bin/env bash
# Installs and builds what the xfstests tier needs. Idempotent: does nothing that is already
# done, so the CI run after the first costs a few seconds. Needs root.
#
#   tests/xfstests/setup.sh
#
# - the Debian build and run dependencies that /work/shared/xfstests/README.md lists (quietly,
#   only those missing);
# - the users fsgqa, fsgqa2 and 123456-fsgqa that some tests switch to;
# - xfstests built out of tree from the unmodified tarball in shared/xfstests/ into
#   $XFSTESTS_DIR (default /var/tmp/birch-xfstests), with our patch (rc-fuse-birch.patch,
#   see its header) applied. Rebuilt only when the build is missing or the tarball or the
#   patch changed (a stamp file records both checksums).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
export PATH="/usr/local/sbin:/usr/sbin:/sbin:$PATH"
XFSTESTS_DIR=${XFSTESTS_DIR:-/var/tmp/birch-xfstests}
log() { printf '[xfstests setup] %s\n' "$*" >&2; }

[[ $(id -u) == 0 ]] || { echo "xfstests setup: must run as root (apt-get, useradd)" >&2; exit 1; }

# The tarball: shared/ beside the repository (the CI clone and the sessions' work trees both
# have it there), or XFSTESTS_TARBALL.
find_tarball() {
  local d
  if [[ -n ${XFSTESTS_TARBALL:-} ]]; then echo "$XFSTESTS_TARBALL"; return; fi
  for d in "$REPO/../shared/xfstests" "$REPO/../../shared/xfstests" /work/shared/xfstests; do
    compgen -G "$d/xfstests-*.tar.gz" >/dev/null && { ls "$d"/xfstests-*.tar.gz | head -n1; return; }
  done
  return 1
}
TARBALL=$(find_tarball) || { echo "xfstests setup: no xfstests-*.tar.gz in shared/xfstests (set XFSTESTS_TARBALL)" >&2; exit 1; }

# --- Debian packages ----------------------------------------------------------------------------
APT_PACKAGES=(acl attr autoconf automake bc dbench dump e2fsprogs fio gawk gcc git indent
  libacl1-dev libattr1-dev libaio-dev libcap-dev libgdbm-dev libgdbm-compat-dev libtool
  libtool-bin liburing-dev libuuid1 lvm2 make psmisc python3 quota sed uuid-dev uuid-runtime
  xfsprogs xfslibs-dev xfsdump sqlite3 libssl-dev keyutils xz-utils pkg-config perl fuse3)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt_log=$(mktemp)
  if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}"; } \
    >"$apt_log" 2>&1; then
    cat "$apt_log" >&2
    rm -f "$apt_log"
    exit 1
  fi
  rm -f "$apt_log"
else
  log "apt packages present"
fi

# --- users --------------------------------------------------------------------------------------
for u in fsgqa fsgqa2 123456-fsgqa; do
  if ! id "$u" >/dev/null 2>&1; then
    log "useradd $u"
    # A name that starts with digits needs --badname on newer shadow versions.
    useradd -m "$u" 2>/dev/null || useradd --badname -m "$u"
  fi
done

# --- build ----------------------------------------------------------------------------------------
stamp_want="$(sha256sum "$TARBALL" | cut -d' ' -f1) $(sha256sum "$HERE/rc-fuse-birch.patch" | cut -d' ' -f1)"
if [[ -x $XFSTESTS_DIR/check && -x $XFSTESTS_DIR/ltp/fsx && -f $XFSTESTS_DIR/.birch-stamp &&
      $(cat "$XFSTESTS_DIR/.birch-stamp") == "$stamp_want" ]]; then
  log "xfstests already built in $XFSTESTS_DIR"
  exit 0
fi
log "building xfstests from $(basename "$TARBALL") in $XFSTESTS_DIR (a few minutes)"
rm -rf "$XFSTESTS_DIR.new"
mkdir -p "$XFSTESTS_DIR.new"
tar -xzf "$TARBALL" -C "$XFSTESTS_DIR.new" --strip-components=1
patch -d "$XFSTESTS_DIR.new" -p1 --quiet <"$HERE/rc-fuse-birch.patch"
(
  cd "$XFSTESTS_DIR.new"
  make -j"$(nproc)" >build.log 2>&1 || { tail -n 40 build.log >&2; exit 1; }
)
echo "$stamp_want" >"$XFSTESTS_DIR.new/.birch-stamp"
rm -rf "$XFSTESTS_DIR"
mv "$XFSTESTS_DIR.new" "$XFSTESTS_DIR"
log "xfstests built in $XFSTESTS_DIR"
