#!/usr/bin/env bash
# The Debian package, as a person uses it: build it (scripts/package.sh), install it with dpkg
# (apt-get for a missing fuse3), make a filesystem with `mkfs -t birch` on an image file, mount
# it from an fstab line of type fuse.birch with `mount -a`, write and read a file, unmount,
# check it with `fsck -t birch` (exit 0), and remove the package with `dpkg --purge`: every
# path it installed must be gone.
#
# This machine keeps other installs at some of the package's paths (scripts/test.sh installs
# /usr/sbin/mount.fuse.birch for the mount tiers; scripts/setup.sh installs into
# /usr/local/sbin): each file found at a path the package installs is moved aside first and put
# back on exit, and /etc/fstab is restored byte for byte (both in an EXIT trap, which also
# unmounts and purges after a failure). A birchfs package already installed is left alone: the
# test skips.
#
# Needs root and /dev/fuse; without them it exits 77 (skipped) with the reason.
# Prints the time of each step and the total.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ $(id -u) != 0 ]]; then
  echo "package test: skipped: needs root (dpkg -i, mount, /etc/fstab)"
  exit 77
fi
if [[ ! -e /dev/fuse ]]; then
  echo "package test: skipped: no /dev/fuse"
  exit 77
fi
if dpkg-query -W -f='${Status}' birchfs 2>/dev/null | grep -q 'installed'; then
  echo "package test: skipped: a birchfs package is already installed (remove it to run this test)"
  exit 77
fi

start_all=$SECONDS
step_start=$SECONDS
step() { # name: prints the time the previous step took, then the next step's name
  echo "package test: [$((SECONDS - step_start)) s] done"
  step_start=$SECONDS
  echo "package test: $*"
}

WORK=$(mktemp -d /var/tmp/birch-package-test.XXXXXX)
BACKUP=$WORK/backup
IMG=$WORK/disk.img
MNT=$WORK/mnt
mkdir -p "$BACKUP/files" "$MNT"
cp -a /etc/fstab "$BACKUP/fstab"
installed_by_us=0
moved=()   # paths moved into $BACKUP/files, restored on exit

cleanup() {
  local rc=$?
  set +e
  if mountpoint -q "$MNT"; then
    /usr/bin/birch umount "$MNT" 2>/dev/null || umount -l "$MNT"
  fi
  # /etc/fstab exactly as it was: content written over the same inode (mode, owner kept).
  if ! cmp -s "$BACKUP/fstab" /etc/fstab; then
    cat "$BACKUP/fstab" >/etc/fstab
  fi
  cmp -s "$BACKUP/fstab" /etc/fstab || { echo "package test: /etc/fstab NOT restored (copy in $BACKUP/fstab)"; rc=1; }
  if [[ $installed_by_us == 1 ]] && dpkg-query -W -f='${Status}' birchfs 2>/dev/null | grep -q 'installed'; then
    dpkg --purge birchfs >/dev/null 2>&1 || echo "package test: dpkg --purge birchfs failed in cleanup"
  fi
  local path
  for path in "${moved[@]}"; do
    mkdir -p "$(dirname "$path")"
    mv -f "$BACKUP/files$path" "$path" || { echo "package test: could not restore $path (copy in $BACKUP/files$path)"; rc=1; continue; }
  done
  if [[ $rc == 0 ]]; then
    rm -rf "$WORK"
  else
    echo "package test: left $WORK for inspection"
  fi
  echo "package test: total $((SECONDS - start_all)) s"
  exit $rc
}
trap cleanup EXIT

fail() { echo "package test: FAIL: $*"; exit 1; }

echo "package test: build the package (scripts/package.sh)"
deb=$(bash scripts/package.sh | tail -1)
[[ -f $deb ]] || fail "scripts/package.sh printed no .deb path"
echo "package test: $deb ($(du -k "$deb" | cut -f1) KiB)"
dpkg-deb -f "$deb" Depends | grep -qw fuse3 || fail "the package does not depend on fuse3"

step "move aside what this machine has at the package's paths"
# Files and links the package installs (directories are shared with other packages).
mapfile -t paths < <(dpkg-deb --fsys-tarfile "$deb" | tar -t | sed -n 's|^\./|/|p' | grep -v '/$')
for want in /usr/bin/birch /usr/sbin/mkfs.birch /usr/sbin/fsck.birch /usr/sbin/fsck.fuse.birch \
  /usr/sbin/mount.fuse.birch \
  /usr/share/man/man1/birch.1.gz /usr/share/man/man5/birchfs.5.gz \
  /usr/share/man/man8/mkfs.birch.8.gz /usr/share/man/man8/fsck.birch.8.gz \
  /usr/share/man/man8/mount.fuse.birch.8.gz /usr/share/bash-completion/completions/birch \
  /usr/share/zsh/vendor-completions/_birch /usr/share/fish/vendor_completions.d/birch.fish; do
  printf '%s\n' "${paths[@]}" | grep -qx "$want" || fail "the package lacks $want"
done
for path in "${paths[@]}"; do
  if [[ -e $path || -L $path ]]; then
    mkdir -p "$BACKUP/files$(dirname "$path")"
    mv "$path" "$BACKUP/files$path"
    moved+=("$path")
    echo "package test: moved aside $path (restored on exit)"
  fi
done

step "install it"
if dpkg-query -W -f='${Status}' fuse3 2>/dev/null | grep -q 'install ok installed'; then
  dpkg -i "$deb" >/dev/null
else
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$deb" >/dev/null
fi
installed_by_us=1
dpkg-query -W -f='${Status}\n' birchfs | grep -q 'install ok installed' || fail "birchfs is not installed"
[[ $(readlink -f /usr/sbin/mkfs.birch) == /usr/bin/birch ]] || fail "mkfs.birch does not lead to /usr/bin/birch"
/usr/bin/birch --version
if command -v man >/dev/null; then
  for page in birch mkfs.birch fsck.birch mount.fuse.birch birchfs; do
    man -w "$page" >/dev/null || fail "man $page: no page found"
  done
  MANWIDTH=80 man birchfs 2>/dev/null | grep -q 'fsync=log' || fail "man birchfs does not list the mount options"
fi
grep -q 'birch' /usr/share/bash-completion/completions/birch || fail "bash completion is empty"

step "mkfs -t birch on an image file"
truncate -s 256M "$IMG"
mkfs -t birch "$IMG"

step "mount -a from an fstab line of type fuse.birch"
printf '%s %s fuse.birch defaults,noatime 0 0  # birch package test\n' "$IMG" "$MNT" >>/etc/fstab
# -t fuse.birch: mount only lines of this type (the machine's other lines are not ours).
mount -a -t fuse.birch
mountpoint -q "$MNT" || fail "mount -a did not mount $MNT"
fstype=$(findmnt -n -o FSTYPE --target "$MNT")
[[ $fstype == fuse.birch ]] || fail "$MNT is $fstype, expected fuse.birch"
findmnt -n -o SOURCE,TARGET,FSTYPE,OPTIONS --target "$MNT"

step "write and read a file"
head -c 3000000 /dev/urandom >"$WORK/data"
cp "$WORK/data" "$MNT/file"
mkdir "$MNT/dir"
echo hello >"$MNT/dir/hello"
/usr/bin/birch sync "$MNT"
cmp "$WORK/data" "$MNT/file" || fail "the file read back differs"
[[ $(cat "$MNT/dir/hello") == hello ]] || fail "dir/hello read back wrong"

step "unmount (umount(8), then wait for the daemon to release the image)"
umount "$MNT"
for _ in $(seq 300); do
  # The daemon holds an exclusive lock on the image until its final commit is done.
  flock -n -x "$IMG" true 2>/dev/null && break
  sleep 0.1
done
mountpoint -q "$MNT" && fail "$MNT still mounted"

# fsck(8) exits 0 without running anything when it skips a filesystem (a type that does not
# match -t, or no checker for the type fstab names), so each run must show birch's summary.
fsck_ran() { # label, fsck arguments...: runs fsck, wants exit 0 and the checker's summary line
  local label=$1; shift
  local out rc=0
  out=$(fsck "$@" 2>&1) || rc=$?
  echo "$out" | sed "s|^|  $label: |"
  [[ $rc == 0 ]] || fail "$label exited $rc"
  echo "$out" | grep -q ' 0 findings' || fail "$label did not run fsck.birch (fsck(8) skipped it?)"
}
step "fsck (must exit 0): the fstab line says fuse.birch, so fsck(8) runs fsck.fuse.birch"
fsck_ran "fsck IMG" "$IMG"
fsck_ran "fsck -a IMG" -a "$IMG"

step "mount again (mount MNT, from the fstab line) and read the file back"
mount "$MNT"
cmp "$WORK/data" "$MNT/file" || fail "the file read back after a remount differs"
/usr/bin/birch umount "$MNT"

step "restore /etc/fstab; fsck -t birch on the image fstab no longer lists (must exit 0)"
cat "$BACKUP/fstab" >/etc/fstab
fsck_ran "fsck -t birch IMG" -t birch "$IMG"
fsck_ran "fsck -t birch -n IMG" -t birch -n "$IMG"

step "remove the package (dpkg --purge)"
dpkg --purge birchfs >/dev/null
installed_by_us=0
dpkg-query -W -f='${Status}' birchfs 2>/dev/null | grep -q 'installed' && fail "birchfs still installed"
left=()
for path in "${paths[@]}"; do
  [[ -e $path || -L $path ]] && left+=("$path")
done
((${#left[@]} == 0)) || fail "left behind by dpkg --purge: ${left[*]}"
echo "package test: ${#paths[@]} installed paths, none left after purge"
step "ok"
