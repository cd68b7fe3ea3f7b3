#!/usr/bin/env bash
# Installs what the NFS tier needs (NFS-Ganesha with FSAL_VFS, rpcbind, libnfs and its tools, getfattr,
# a C compiler) from Debian's packages, and compiles the test client nfs-client.c into OUTDIR
# (default /tmp/nfs-test/bin). Idempotent: installs only what is missing. Exits 77 when the
# packages cannot be installed, 1 when the client does not compile.
set -euo pipefail
cd "$(dirname "$0")"
out=${1:-/tmp/nfs-test/bin}
need=()
for p in nfs-ganesha nfs-ganesha-vfs rpcbind libnfs-utils libnfs-dev gcc pkg-config e2fsprogs attr; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if ((${#need[@]})); then
  echo "nfs setup: installing ${need[*]}"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; }; then
    echo "nfs setup: cannot install ${need[*]}"
    exit 77
  fi
fi
mkdir -p "$out"
# shellcheck disable=SC2046
gcc -O2 -Wall -Wextra -Werror -o "$out/nfs-client" nfs-client.c $(pkg-config --cflags --libs libnfs)
