#!/usr/bin/env bash
# Builds the Debian package of birchfs: target/debian/birchfs_VERSION-1_ARCH.deb.
#   birch (/usr/bin), mkfs.birch, fsck.birch, fsck.fuse.birch and mount.fuse.birch (/usr/sbin,
#   links to birch, which acts on the name it is run as), man pages (birch(1) and one per subcommand,
#   mkfs.birch(8), fsck.birch(8), mount.fuse.birch(8), birchfs(5) for the mount options) and
#   bash, zsh and fish completions, all generated from the clap definitions by
#   `birch gen-docs DIR` (not offered in help or completions). Depends on fuse3.
# Uses the rustup toolchain (Debian 12's rustc is older than the workspace needs) and
# cargo-deb, which it installs with `cargo install cargo-deb --locked` when missing (several
# minutes on 2 cores). Reuses the release build when it is current (`cargo build --release
# --locked -p birch-tools` is then a no-op) and packages it with `cargo deb --no-build`.
# Prints the path of the .deb on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
if ! command -v cargo >/dev/null; then
  echo "package: cargo not found; install a Rust toolchain (rustup) first" >&2
  exit 1
fi
if ! cargo deb --version >/dev/null 2>&1; then
  echo "package: installing cargo-deb (cargo install cargo-deb --locked)"
  start=$SECONDS
  cargo install cargo-deb --locked --quiet
  echo "package: cargo-deb installed in $((SECONDS - start)) s"
fi
if ! command -v dpkg-deb >/dev/null || ! command -v strip >/dev/null; then
  echo "package: needs dpkg-deb and strip (Debian: dpkg, binutils)" >&2
  exit 1
fi
cargo build --release --locked -p birch-tools 2>&1 | tail -1
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
docs=$target_dir/release/birch-docs
rm -rf "$docs"
"$target_dir/release/birch" gen-docs "$docs"
# Debian installs man pages compressed; -n leaves out the name and time, so the package is the
# same for the same sources.
find "$docs/man" -type f -exec gzip -9nf {} +
# --strip: the release profile keeps line tables for backtraces (debug = 1), which would
# otherwise make cargo-deb keep the debug info in the package (35 MB instead of 6).
cargo deb -p birch-tools --no-build --strip --quiet >/dev/null
deb=$(ls -t "$target_dir"/debian/birchfs_*.deb | head -1)
dpkg-deb -f "$deb" Package Version Depends | sed 's/^/package: /'
echo "$deb"
