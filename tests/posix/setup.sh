#!/usr/bin/env bash
# Installs what the external POSIX suites need. Idempotent: safe to run again,
# does nothing that is already done. Needs root (apt, users, cargo install).
#
#   tests/posix/setup.sh
#
# - Debian packages: fuse3 (fusermount3, /etc/fuse.conf), e2fsprogs
#   (mkfs.ext4/e2fsck for the ext4 baseline), util-linux (losetup, mount),
#   libacl1-dev (pjdfstest links libacl), acl/attr (handy when debugging).
# - pjdfstest 0.2.2 and fsx 0.3.2 through `cargo install` (skipped when that
#   exact version is already installed).
# - the dummy user/group pair `tests`:`tests` that pjdfstest switches to
#   (the other pair, nobody:nogroup, exists on Debian already).
set -euo pipefail

PJDFSTEST_VERSION=0.2.2
FSX_VERSION=0.3.2
export PATH="$HOME/.cargo/bin:/usr/local/sbin:/usr/sbin:/sbin:$PATH"

log() { printf '[setup] %s\n' "$*" >&2; }

if [[ $(id -u) != 0 ]]; then
  echo "setup.sh: must run as root (apt-get, useradd, mounts)" >&2
  exit 1
fi

# --- Debian packages --------------------------------------------------------
APT_PACKAGES=(fuse3 e2fsprogs util-linux mount libacl1-dev acl attr pkg-config)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  log "apt packages present: ${APT_PACKAGES[*]}"
fi

# --- cargo tools ------------------------------------------------------------
command -v cargo >/dev/null || { echo "setup.sh: cargo not found" >&2; exit 1; }
# Build gently: the machine is usually compiling something else too.
CARGO_JOBS=${CARGO_JOBS:-1}
cargo_install() {
  local crate=$1 version=$2
  if cargo install --list | grep -qx "$crate v$version:"; then
    log "$crate $version already installed"
    return 0
  fi
  log "cargo install $crate --version $version (-j$CARGO_JOBS)"
  nice -n 10 cargo install --locked "$crate" --version "$version" -j "$CARGO_JOBS" ||
    nice -n 10 cargo install "$crate" --version "$version" -j "$CARGO_JOBS"
}
cargo_install pjdfstest "$PJDFSTEST_VERSION"
cargo_install fsx "$FSX_VERSION"

# --- users and groups for pjdfstest -------------------------------------------
# pjdfstest.toml names two [user, group] pairs; each user's primary group must
# be the named group.
getent group nogroup >/dev/null || groupadd -r nogroup
getent passwd nobody >/dev/null || useradd -r -g nogroup -M -d /nonexistent -s /usr/sbin/nologin nobody
getent group tests >/dev/null || { log "groupadd tests"; groupadd tests; }
if ! getent passwd tests >/dev/null; then
  log "useradd tests"
  useradd -g tests -M -N -d / -s /usr/sbin/nologin -c "Dummy user for pjdfstest" tests
fi
[[ $(id -gn tests) == tests ]] || usermod -g tests tests
[[ $(id -gn nobody) == nogroup ]] || log "warning: nobody's primary group is $(id -gn nobody), not nogroup; edit pjdfstest.toml"

# --- kernel bits ------------------------------------------------------------
[[ -c /dev/fuse ]] || log "warning: /dev/fuse is missing; birch targets will be skipped"
[[ -e /dev/loop-control ]] || modprobe loop 2>/dev/null || log "warning: no loop devices; ext4 targets will be skipped"
grep -qw ext4 /proc/filesystems || modprobe ext4 2>/dev/null || true

log "ok: pjdfstest $(pjdfstest --version 2>/dev/null | awk '{print $2}'), fsx $(fsx --version 2>/dev/null | awk '{print $2}')"
