#!/usr/bin/env bash
# The soak under device faults, short (docs/TESTING.md, "device faults"): a birch built with the
# fault-injection feature (the test kit's fault device between the image and the filesystem,
# `-o fault=RULE` and `birch fault MNT RULE|clear|release`), its unit test, then
# tests/soak/soak.py --faults: each cycle arms one fault kind (EIO on writes, flushes, reads;
# ENOSPC from the device; a slow device; a hung write released) while fsx, fsstress and the
# oracle writers run; every acknowledged write is checked after each cycle, fsck must be clean,
# and no panic or hang is allowed.
#   tests/soak/fault-soak.sh [soak.py options]   (default: --minutes 1.5 --seed 20261203)
# The fault build goes to target/fault-injection/birch: cargo builds it in the release target
# directory (only birch-fuse and birch-tools recompile, about 2 minutes on 2 cores), the binary
# is copied out, and target/release/birch is put back as the build without the feature (no
# compile: cargo keeps both). The shipped binary never has fault injection; this script checks
# that it refuses `-o fault=`.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release --locked -p birch-tools --features fault-injection
mkdir -p target/fault-injection
cp target/release/birch target/fault-injection/birch
cargo build --release --locked -p birch-tools
if ./target/release/birch mount /nonexistent.img /nonexistent -o fault=flush:eio 2>/tmp/fault-soak-refusal.txt; then
  echo "fault-soak: the release birch accepted -o fault=" >&2; exit 1
fi
grep -q "built without fault injection" /tmp/fault-soak-refusal.txt || {
  echo "fault-soak: the release birch's refusal does not say why: $(cat /tmp/fault-soak-refusal.txt)" >&2; exit 1; }
cargo test --release --locked -p birch-fuse --features fault-injection --lib daemon::faults
if [[ $# -eq 0 ]]; then set -- --minutes 1.5 --seed 20261203; fi
exec python3 tests/soak/soak.py --faults --birch target/fault-injection/birch "$@"
