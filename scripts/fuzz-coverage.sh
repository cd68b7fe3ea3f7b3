#!/usr/bin/env bash
# Line coverage of the format decoders and the log replay reached by the fuzz corpus
# (crates/birch-fuzz/corpus/, replayed by `cargo test -p birch-fuzz --test corpus`), measured
# with cargo-llvm-cov. Prints the per-file table for the decoders and replay, and the totals.
#   scripts/fuzz-coverage.sh            corpus replay only (what the kept corpus reaches)
#   scripts/fuzz-coverage.sh --mutate   corpus replay plus the test's seeded mutations
# Installs cargo-llvm-cov (cargo install, about 3 minutes on 2 cores) and rustup's
# llvm-tools-preview when missing. The instrumented build has its own target directory
# (target/llvm-cov-target): the first run rebuilds the workspace, about 5 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
command -v cargo-llvm-cov >/dev/null || cargo install cargo-llvm-cov --locked
rustup component list --installed 2>/dev/null | grep -q '^llvm-tools' ||
  rustup component add llvm-tools-preview
filter=(corpus_and_fixed_crashes_replay_without_a_panic)
[[ ${1:-} == --mutate ]] && filter=()
out=${BIRCH_COVERAGE_OUT:-target/fuzz-coverage.txt}
mkdir -p "$(dirname "$out")"
cargo llvm-cov --release --locked -p birch-fuzz -p birch-format -p birch-core --test corpus --summary-only \
  -- --exact "${filter[@]}" >"$out.full" 2>"$out.log" || {
  cat "$out.log"; exit 1; }
# The decoders (birch-format) and replay (birch-core's log reading and the replay at open).
files='birch-format/src/(node|items|superblock|log|key|bytes)\.rs|birch-core/src/log/(mod|group|group_commit)\.rs|birch-core/src/vfs/durability\.rs'
{
  grep -m1 '^Filename' "$out.full"
  grep -E "$files" "$out.full"
  grep '^TOTAL' "$out.full"
} | tee "$out"
# Lines of the decoders, of replay, and of both together.
sum() {
  grep -E "$1" "$out.full" | awk -v what="$2" '{ lines += $8; missed += $9 }
    END { if (lines) printf "%s: %d of %d lines covered (%.1f%%)\n", what,
          lines - missed, lines, 100 * (lines - missed) / lines }'
}
{
  sum 'birch-format/src/(node|items|superblock|log|key|bytes)\.rs' 'decoders (birch-format)'
  sum 'birch-core/src/(log/(mod|group|group_commit)|vfs/durability)\.rs' 'replay (birch-core log/, vfs/durability.rs)'
  sum "$files" 'decoders and replay'
} | tee -a "$out"
