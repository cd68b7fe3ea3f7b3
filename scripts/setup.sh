#!/usr/bin/env bash
# Sets up birchfs on a fresh Debian machine and mounts a demo image:
# installs the packages it needs (fuse3, build tools), builds the release binaries, installs
# `birch`, `mkfs.birch`, `fsck.birch` and `mount.fuse.birch` into /usr/local/sbin, makes a 1 GiB
# image at ${BIRCH_IMAGE:-/var/tmp/birch.img} and mounts it at ${BIRCH_MNT:-/mnt/birch}.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [[ $(id -u) == 0 ]] || SUDO=sudo
if ! command -v fusermount3 >/dev/null || ! command -v cc >/dev/null; then
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 build-essential pkg-config >/dev/null
fi
if ! command -v cargo >/dev/null; then
  echo "setup: cargo not found; install a Rust toolchain (rustup) first" >&2
  exit 1
fi
cargo build --release --locked 2>&1 | tail -1
for name in birch mkfs.birch fsck.birch; do
  $SUDO install -m 0755 target/release/birch "/usr/local/sbin/$name"
done
# mount(8) looks for helpers in /sbin only (/usr/sbin on merged-/usr Debian).
$SUDO install -m 0755 target/release/birch /usr/sbin/mount.fuse.birch
# FUSE over io_uring (DESIGN §12.5): birch mounts use it wherever the fuse module's
# enable_uring allows it, a machine-wide setting this script turns on, now and at every boot
# (a modprobe.d option; a kernel before 6.14 has no such parameter and is left alone).
$SUDO sh -c 'exec 3<>/dev/fuse' 2>/dev/null || true  # loads the fuse module if it is not
URING_PARAM=/sys/module/fuse/parameters/enable_uring
if [[ -e $URING_PARAM ]]; then
  if [[ $(cat "$URING_PARAM") != Y ]]; then
    echo Y | $SUDO tee "$URING_PARAM" >/dev/null && echo "setup: turned on FUSE over io_uring ($URING_PARAM)"
  fi
  # At boot too, where modprobe reads /etc/modprobe.d (a fuse built into the kernel takes
  # fuse.enable_uring=1 on the kernel command line instead).
  if [[ -d /etc/modprobe.d ]]; then
    echo "options fuse enable_uring=1" | $SUDO tee /etc/modprobe.d/birch-fuse-uring.conf >/dev/null
  else
    echo "setup: no /etc/modprobe.d: enable_uring is on until the next boot"
  fi
fi
IMG=${BIRCH_IMAGE:-/var/tmp/birch.img}
MNT=${BIRCH_MNT:-/mnt/birch}
$SUDO mkdir -p "$MNT"
if mountpoint -q "$MNT"; then
  echo "setup: $MNT is already mounted"
  exit 0
fi
[[ -e $IMG ]] || $SUDO birch mkfs --size 1G "$IMG"
$SUDO birch mount "$IMG" "$MNT"
echo "setup: $IMG is mounted at $MNT (unmount with: birch umount $MNT)"
