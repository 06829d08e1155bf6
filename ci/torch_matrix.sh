#!/usr/bin/env bash
# Run the CPU suite under every torch minor of the window, one tox env at a time, remove each
# env right after its run (5-7 GB each: the 2.x builds on the package index are CUDA builds),
# then render the compatibility table into docs/compat.md.
#
#   ci/torch_matrix.sh                                  # torch214, torch213, ..., torch26
#   ci/torch_matrix.sh torch29 torch26                  # some envs, in this order
#   ci/torch_matrix.sh -- tests/format/test_cross_version.py   # pytest arguments for every env
#
# Newest first: each env writes its ckptlib checkpoint into ci/compat/cross-version/ and loads
# those of the envs that ran before it, so this order loads every minor's checkpoint under
# every older minor; the committed ckptlib_torch<minor> fixtures cover newer-loads-older.
# Before each env it checks that the disk holding .tox has CKPTLIB_MATRIX_MIN_FREE_GB (default
# 15) free and skips the env otherwise. pip's cache is off (PIP_NO_CACHE_DIR) so the wheels do
# not pile up in ~/.cache. Exit status: 0 when every env ran and passed.
set -u
cd "$(dirname "$0")/.."

TOX=${TOX:-}
if [ -z "$TOX" ]; then
    if [ -x .venv/bin/tox ]; then TOX=.venv/bin/tox; else TOX=tox; fi
fi
ALL_ENVS=(torch214 torch213 torch212 torch211 torch210 torch29 torch28 torch27 torch26)
MIN_FREE_GB=${CKPTLIB_MATRIX_MIN_FREE_GB:-15}
export PIP_NO_CACHE_DIR=1

envs=()
pytest_args=()
while [ $# -gt 0 ]; do
    if [ "$1" = "--" ]; then shift; pytest_args=("$@"); break; fi
    envs+=("$1"); shift
done
[ ${#envs[@]} -gt 0 ] || envs=("${ALL_ENVS[@]}")

mkdir -p .tox ci/compat
log=ci/compat/matrix.log
status=0
for env in "${envs[@]}"; do
    free_gb=$(df -P -B1G .tox | awk 'NR == 2 {print $4}')
    if [ "$free_gb" -lt "$MIN_FREE_GB" ]; then
        echo "torch_matrix: skipping $env: $free_gb GB free under .tox, need $MIN_FREE_GB" | tee -a "$log" >&2
        status=1
        continue
    fi
    start=$(date +%s)
    if [ ${#pytest_args[@]} -gt 0 ]; then
        "$TOX" -e "$env" -- "${pytest_args[@]}"
    else
        "$TOX" -e "$env"
    fi
    rc=$?
    rm -rf ".tox/$env"
    echo "torch_matrix: $env exit $rc after $(( $(date +%s) - start )) s on $(git rev-parse --short HEAD) ($(date -u +%FT%TZ))" | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
done

"$TOX" -e compat-table || status=1
exit "$status"
