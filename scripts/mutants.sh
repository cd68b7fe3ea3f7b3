#!/usr/bin/env bash
# Mutation testing (cargo-mutants) of birch-core's durability and free paths: each mutant is one
# small change to the code (a return value, an operator, a match arm); the chosen tests must
# fail on it. A mutant they pass ("missed") is a test gap or a change that means nothing.
#   scripts/mutants.sh                 the scoped run (docs/TESTING.md, "7. Mutation testing")
#   scripts/mutants.sh --list          the mutants in scope, without building
#   scripts/mutants.sh --file crates/birch-core/src/data/free.rs    one file of the scope
#   scripts/mutants.sh --re 'drop_hold'    only mutants whose name matches (replaces the scope's
#                                          --re; the groups' files still apply)
#   BIRCH_MUTANTS_GROUPS="free group_commit"    only these groups (below), in this order
# Other arguments go to `cargo mutants` as they are (`--shard 1/4`, `--timeout 300`, ...).
# Not run by CI. About an hour on 2 cores shared with a CI run (2026-12-03: free 36 min,
# group_commit 11, fsync_rules 3, plus the baseline builds; 105 mutants, 101 with the
# exclusions below, 5-60 s each); a whole-crate run would take days. Installs cargo-mutants (cargo install, about 6 minutes) when missing.
#
# Scope, in three groups, each with the test targets that reach it (only those are built and
# run for each mutant, so that a mutant costs seconds, not the whole suite):
#   free: src/data/free.rs (the free path of data blocks) and, in src/alloc.rs, the
#     snapshot-aware free (`free_recorded`, `held`, `SnapshotHold::holds`, `add_hold`,
#     `drop_hold`, `forget_holds`); the rest of alloc.rs (bitmap, search, trim, deferral) is
#     left out (its own unit tests; it would double the run).
#     Tests: --lib (alloc.rs's holds, data/free.rs's pinning and placed blocks), placed_race
#     (the free of placed blocks a leader's batch names), snapshot_space (what a snapshot keeps
#     and gives back), snapshots (model, deletion, reopen: holds at open), enospc (space back
#     after unlink and truncate, failed writes: give_back), clones (shared extents freed at
#     their last reference).
#   group_commit: src/log/group_commit.rs (the fsync log's group-commit protocol).
#     Tests: shuttle_group_commit (the file itself under shuttle's scheduler, with a fake
#     writer), group_flush (through the engine: waiters share flushes, crash states).
#   fsync_rules: src/vfs/fsync_rules.rs (the rules' names and counters).
#     Tests: --lib (counters against their names, ALL), fsync_rules (one test per rule).
# Left out: fsync_log (the crash matrix, minutes a run) and the model tests (fs_model,
# btree_model), which reach the scope only through the above.
#
# cargo-mutants finds source files through `mod` items only. alloc.rs is declared through the
# `internal_mods!` macro (src/lib.rs) and group_commit.rs is `include!`d (src/log/group.rs), so
# it would see neither. The run therefore works on a scratch copy of the tree (BIRCH_MUTANTS_SRC)
# in which those two declarations are written as plain `mod` items, as the test builds expand
# them (`pub mod alloc;` with the `internals` feature the tests turn on; `#[path]` for
# group_commit.rs, re-exported as the `include!` made it visible). Nothing else differs; the
# copy is refreshed from the working tree at each run, and cargo-mutants mutates it in place.
#
# Profile `mutants` (Cargo.toml): the test profile (opt-level 2, debug assertions and overflow
# checks on, as CI's checked profile) without debug info, incremental. One mutant of
# data/free.rs, measured (lib, snapshot_space, fsync_rules): rebuild 18-27 s, tests 4.0 s; a
# release-based profile (debug 0, incremental): 27-33 s, 4.6 s.
#
# Output: BIRCH_MUTANTS_OUT (default target/mutants)/GROUP/mutants.out: outcomes.json,
# caught.txt, missed.txt, timeout.txt, unviable.txt, a log per mutant. Builds go to
# CARGO_TARGET_DIR (default: the scratch copy's target/). Exit status: the highest of the
# groups' (cargo-mutants: 2 missed, 3 timeouts).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export PATH="$HOME/.cargo/bin:$PATH"
command -v cargo-mutants >/dev/null || cargo install cargo-mutants --locked

out=${BIRCH_MUTANTS_OUT:-$root/target/mutants}
src=${BIRCH_MUTANTS_SRC:-${TMPDIR:-/tmp}/birch-mutants-src}

# The scratch copy: the working tree without build outputs and VCS data.
mkdir -p "$src" "$out"
find "$src" -mindepth 1 -maxdepth 1 ! -name target -exec rm -rf {} +
tar -C "$root" --exclude=./target --exclude=./.git --exclude='*.img' --exclude=./bench/results \
  -cf - . | tar -C "$src" -xf -
lib=$src/crates/birch-core/src/lib.rs
group=$src/crates/birch-core/src/log/group.rs
grep -qx '    mod alloc;' "$lib" || { echo "mutants.sh: src/lib.rs no longer declares alloc in internal_mods!" >&2; exit 1; }
grep -qx 'include!("group_commit.rs");' "$group" || { echo "mutants.sh: src/log/group.rs no longer includes group_commit.rs" >&2; exit 1; }
sed -i -e '/^    mod alloc;$/d' -e '$a\
\
// scripts/mutants.sh: declared plainly so that cargo-mutants finds it.\
pub mod alloc;' "$lib"
sed -i 's|^include!("group_commit.rs");$|// scripts/mutants.sh: a module so that cargo-mutants finds it.\
#[path = "group_commit.rs"]\
mod group_commit;\
pub use group_commit::*;|' "$group"

# Each group: its name, the --re of its mutants, the test targets that run for them.
group_names=(fsync_rules group_commit free)
declare -A group_re group_files group_targets
group_files[fsync_rules]=crates/birch-core/src/vfs/fsync_rules.rs
group_re[fsync_rules]='src/vfs/fsync_rules\.rs:'
group_targets[fsync_rules]='--lib --test fsync_rules'
group_files[group_commit]=crates/birch-core/src/log/group_commit.rs
group_re[group_commit]='src/log/group_commit\.rs:'
group_targets[group_commit]='--test shuttle_group_commit --test group_flush'
group_files[free]='crates/birch-core/src/data/free.rs crates/birch-core/src/alloc.rs'
group_re[free]='src/data/free\.rs:|src/alloc\.rs:.*(Allocator::(free_recorded|held|add_hold|drop_hold|forget_holds)|SnapshotHold::holds)\b'
group_targets[free]='--lib --test placed_race --test snapshot_space --test snapshots --test enospc --test clones'
# Equivalent mutants, left out (docs/TESTING.md, "Mutation testing", gives each its reason).
exclude=(
  # `newest == 0 && birth > newest`: only the early return changes; the scan of the holds
  # answers the same (no hold, or none of generation >= birth), slower.
  --exclude-re 'replace \|\| with && in Allocator::held'
  # `if mark_shared(..)`: only whether a warning is logged changes.
  --exclude-re "delete ! in DataLayer<'_>::mark_replayed_extent"
  # `(batch_ticket - 1) & 1`: the same parity as `+ 1` (tickets start at 1), the same condvar.
  --exclude-re 'replace \+ with - in GroupCommit<Q, D>::run'
  # `!st.leader || !st.lead_scheduled`: a `lead` asked for while one runs or is scheduled
  # returns at once or does the scheduled one's work; no answer or order changes.
  --exclude-re 'replace && with \|\| in GroupCommit<Q, D>::defer'
)

# A --file of the caller's replaces the groups' files (a group none of whose files is named
# does not run); a --re of the caller's replaces the groups' --re (cargo-mutants would take
# either match).
user_files=()
user_re=
prev=
for arg in "$@"; do
  case $arg in
    --file=*) user_files+=("${arg#--file=}") ;;
    --re=* | -F?*) user_re=1 ;;
    *)
      [[ $prev == --file || $prev == -f ]] && user_files+=("$arg")
      [[ $prev == --re || $prev == -F ]] && user_re=1
      ;;
  esac
  prev=$arg
done

cd "$src"
status=0
for g in ${BIRCH_MUTANTS_GROUPS:-${group_names[*]}}; do
  [[ -n ${group_re[$g]:-} ]] || { echo "mutants.sh: no group $g (${group_names[*]})" >&2; exit 2; }
  files=()
  if ((${#user_files[@]})); then
    hit=
    for f in ${group_files[$g]}; do
      for u in "${user_files[@]}"; do [[ $u == "$f" ]] && hit=1; done
    done
    [[ -n $hit ]] || continue
  else
    for f in ${group_files[$g]}; do files+=(--file "$f"); done
  fi
  re=(--re "${group_re[$g]}")
  [[ -z $user_re ]] || re=()
  cargo_args=()
  for t in ${group_targets[$g]}; do cargo_args+=(--cargo-arg="$t"); done
  echo "== mutants.sh: group $g (tests: ${group_targets[$g]})" >&2
  rc=0
  nice -n 10 cargo mutants --in-place --no-shuffle --profile mutants \
    --package birch-core --test-package birch-core --output "$out/$g" \
    "${files[@]}" "${re[@]}" "${exclude[@]}" "${cargo_args[@]}" "$@" || rc=$?
  ((rc > status)) && status=$rc
done
exit "$status"
