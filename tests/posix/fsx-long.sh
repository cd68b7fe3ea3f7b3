#!/usr/bin/env bash
# The long fsx run: 3 seeds x 100,000 operations (CI runs fsx.sh's 3 x 20,000).
#
#   tests/posix/fsx-long.sh TARGET [SEED...]     (TARGET: ext4 or birch; default seeds 1 2 3)
#
# Same output, files and exit codes as fsx.sh.
set -uo pipefail
[[ $# -ge 1 ]] || { echo "usage: $0 ext4|birch [SEED...]" >&2; exit 2; }
target=$1
shift
exec "$(dirname "${BASH_SOURCE[0]}")/fsx.sh" "$target" "${FSX_LONG_OPS:-100000}" "$@"
