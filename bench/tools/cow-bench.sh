#!/bin/bash
# The COW write path's cost of snapshots (issue 15's aim: at most 5% more than before the
# issue), DESIGN §15.8. Builds birch-engine-bench at 3af630b (the last commit before issue 15's
# code) in a scratch worktree, with a 3-line patch so it reads the overwrite count from
# BENCH_OVERWRITES (it has no --overwrites flag), and this tree's; then alternates the old one,
# the new one, and the new one with a snapshot taken before the clock
# (--overwrite-snapshot): FIRST_ROUNDS rounds of 4,000 random 4 KiB overwrites of a 64 MiB
# file (most the first of their block: the first pass after a snapshot) and STEADY_ROUNDS
# of 400,000 (the steady state), on a MemDevice. Prints the medians and the ratios to old.
# Usage: bench/tools/cow-bench.sh   (FIRST_ROUNDS=25 STEADY_ROUNDS=6 by default)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$(dirname "$HERE")")"
FIRST_ROUNDS=${FIRST_ROUNDS:-25}
STEADY_ROUNDS=${STEADY_ROUNDS:-6}
WORK=${WORK:-/var/tmp/cow-bench}
mkdir -p "$WORK"
OLD_TREE="$WORK/old-3af630b"
if [ ! -x "$WORK/bench-old" ]; then
  rm -rf "$OLD_TREE"
  git -C "$REPO" worktree add -q --detach "$OLD_TREE" 3af630b
  sed -i 's/^    let sizes = Sizes::new(args.quick);$/    let mut sizes = Sizes::new(args.quick);\n    if let Some(n) = std::env::var("BENCH_OVERWRITES").ok().and_then(|v| v.parse().ok()) {\n        sizes.overwrites = n;\n    }/' \
    "$OLD_TREE/crates/birch-bench/src/main.rs"
  grep -q BENCH_OVERWRITES "$OLD_TREE/crates/birch-bench/src/main.rs"
  (cd "$OLD_TREE" && cargo build --release --locked -p birch-bench -q)
  cp "$OLD_TREE/target/release/birch-engine-bench" "$WORK/bench-old"
  git -C "$REPO" worktree remove --force "$OLD_TREE"
fi
(cd "$REPO" && cargo build --release --locked -p birch-bench -q)
cp "$REPO/target/release/birch-engine-bench" "$WORK/bench-new"
out="$WORK/results.tsv"
: > "$out"
one() { # KIND N VARIANT
  local cmd
  case $3 in
    old) cmd=(env BENCH_OVERWRITES="$2" "$WORK/bench-old" --only overwrite --json) ;;
    new) cmd=("$WORK/bench-new" --overwrites "$2" --only overwrite --json) ;;
    snap) cmd=("$WORK/bench-new" --overwrites "$2" --only overwrite --overwrite-snapshot --json) ;;
  esac
  local secs
  secs=$("${cmd[@]}" 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["results"][0]["seconds"])')
  printf '%s\t%s\t%s\n' "$1" "$3" "$secs" >> "$out"
}
for _ in $(seq "$STEADY_ROUNDS"); do for v in old new snap; do one steady 400000 $v; done; done
for _ in $(seq "$FIRST_ROUNDS"); do for v in old new snap; do one first 4000 $v; done; done
python3 - "$out" <<'PYEND'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    kind, variant, secs = line.split("\t")
    runs.setdefault((kind, variant), []).append(float(secs))
for kind in ("first", "steady"):
    old = statistics.median(runs[(kind, "old")])
    new = statistics.median(runs[(kind, "new")])
    snap = statistics.median(runs[(kind, "snap")])
    n = len(runs[(kind, "old")])
    print(f"{kind}: {n} rounds, medians old {old:.4f} s, new {new:.4f} s ({new / old:.3f}x), "
          f"new after a snapshot {snap:.4f} s ({snap / old:.3f}x)")
PYEND
