#!/usr/bin/env bash
# Coverage-guided fuzzing on the stable toolchain (docs/TESTING.md, "Fuzzing"): builds
# birch-fuzz with SanitizerCoverage's inline 8-bit counters (stable codegen flags; no nightly,
# no external engine) in its own target directory, and runs every target, or those named, for
# SECONDS each from the corpus. The runner then keeps each input that reaches an edge no
# earlier input reached; a panic or hang is saved under
# crates/birch-fuzz/crashes/ and fails the run. --save adds the kept inputs to the corpus.
#   scripts/fuzz-guided.sh [SECONDS] [--save] [TARGET...]
# The first build takes about 5 minutes on 2 cores (the workspace, instrumented).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
seconds=${1:-600}
shift || true
host=$(rustc -vV | sed -n 's/^host: //p')
# --target keeps the flags off build scripts and proc macros (they have no counter hook).
export CARGO_TARGET_DIR=${BIRCH_FUZZ_TARGET_DIR:-target/fuzz-guided}
RUSTFLAGS="-C passes=sancov-module -C llvm-args=-sanitizer-coverage-level=3 \
-C llvm-args=-sanitizer-coverage-inline-8bit-counters" \
  cargo build --profile checked --locked -p birch-fuzz --target "$host"
exec "$CARGO_TARGET_DIR/$host/checked/birch-fuzz" run --seconds "$seconds" "$@"
