#!/usr/bin/env bash
# Run the CPU suite under every torch minor of the window, one tox env at a time, remove each
# env right after its run (5-7 GB each: the 2.x builds on the package index are CUDA builds),
# then load every minor's ckptlib checkpoint under every other minor, then render the
# compatibility table into docs/compat.md.
#
#   ci/torch_matrix.sh                                  # both passes below, then the table
#   ci/torch_matrix.sh --full-only torch29 torch26      # the suite pass only, some envs, in this order
#   ci/torch_matrix.sh --cross-only                     # the cross-version pass only
#   ci/torch_matrix.sh --full-only torch27 -- tests/format/test_cross_version.py   # pytest arguments
#
# 1. Suite pass, newest first (torch214 .. torch26): the full suite in each env
#    (ci/compat/junit-<env>.xml). Each env writes its ckptlib checkpoint into
#    ci/compat/cross-version/torch<minor>/ and loads those found there, i.e. every newer
#    minor's: every older minor loads every newer one.
# 2. Cross-version pass, oldest first (torch27 .. torch214; torch26 has nothing older to load):
#    only tests/format/test_cross_version.py (ci/compat/junit-cross-<env>.xml), now that every
#    minor's checkpoint is in ci/compat/cross-version/: every newer minor loads every older one.
#    Together: every pair, both directions. This pass reinstalls each env (2-3 min each) but runs
#    only ~20 short tests. With --cross-only the oldest env of the list runs too (it writes its
#    checkpoint, which an empty ci/compat/cross-version/ lacks, and loads what is there).
#    CKPTLIB_MATRIX_CROSS_PREFIX (default junit-cross; must start with junit-cross-... or be
#    junit-cross) names this pass's XML <prefix>-<env>.xml, e.g. junit-cross-rev to keep an
#    earlier pass's junit-cross-<env>.xml files; ci/compat_table.py counts every
#    junit-cross-*.xml in the cross-minor table only, the newest result of each test winning.
# Before each env it checks that the disk holding .tox has CKPTLIB_MATRIX_MIN_FREE_GB (default
# 15) free and skips the env otherwise. pip's cache is off (PIP_NO_CACHE_DIR) so the wheels do
# not pile up in ~/.cache. Each env's exit status, wall time (install + tests) and commit go to
# ci/compat/matrix.log. Exit status: 0 when every env ran and passed.
set -u
cd "$(dirname "$0")/.."

TOX=${TOX:-}
if [ -z "$TOX" ]; then
    if [ -x .venv/bin/tox ]; then TOX=.venv/bin/tox; else TOX=tox; fi
fi
ALL_ENVS=(torch214 torch213 torch212 torch211 torch210 torch29 torch28 torch27 torch26)
CROSS_TESTS=tests/format/test_cross_version.py
MIN_FREE_GB=${CKPTLIB_MATRIX_MIN_FREE_GB:-15}
CROSS_PREFIX=${CKPTLIB_MATRIX_CROSS_PREFIX:-junit-cross}
case "$CROSS_PREFIX" in
    junit-cross|junit-cross-*) ;;
    *) echo "torch_matrix: CKPTLIB_MATRIX_CROSS_PREFIX must be junit-cross or start with junit-cross-" >&2; exit 2 ;;
esac
export PIP_NO_CACHE_DIR=1

full=1
cross=1
envs=()
pytest_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --) shift; pytest_args=("$@"); break ;;
        --full-only) cross=0 ;;
        --cross-only) full=0 ;;
        -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) echo "torch_matrix: unknown option $1" >&2; exit 2 ;;
        *) envs+=("$1") ;;
    esac
    shift
done
[ ${#envs[@]} -gt 0 ] || envs=("${ALL_ENVS[@]}")

mkdir -p .tox ci/compat
log=ci/compat/matrix.log
status=0

# run_env PASS ENV [pytest args...]: one tox env, removed afterwards; logs its exit and time.
run_env() {
    local pass=$1 env=$2
    shift 2
    local free_gb start rc
    free_gb=$(df -P -B1G .tox | awk 'NR == 2 {print $4}')
    if [ "$free_gb" -lt "$MIN_FREE_GB" ]; then
        echo "torch_matrix: skipping $env ($pass pass): $free_gb GB free under .tox, need $MIN_FREE_GB" | tee -a "$log" >&2
        status=1
        return
    fi
    start=$(date +%s)
    if [ "$pass" = cross ]; then
        CKPTLIB_JUNIT_PREFIX=$CROSS_PREFIX "$TOX" -e "$env" -- "$@"
    elif [ $# -gt 0 ]; then
        "$TOX" -e "$env" -- "$@"
    else
        "$TOX" -e "$env"
    fi
    rc=$?
    rm -rf ".tox/$env"
    echo "torch_matrix: $env ($pass pass) exit $rc after $(( $(date +%s) - start )) s on $(git rev-parse --short HEAD) ($(date -u +%FT%TZ))" | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
}

if [ "$full" = 1 ]; then
    for env in "${envs[@]}"; do
        run_env full "$env" ${pytest_args[@]+"${pytest_args[@]}"}
    done
fi
if [ "$cross" = 1 ]; then
    # Oldest first; the oldest env of the list has nothing older to load.
    reversed=()
    for env in "${envs[@]}"; do reversed=("$env" ${reversed[@]+"${reversed[@]}"}); done
    [ "$full" = 0 ] || reversed=("${reversed[@]:1}")
    for env in ${reversed[@]+"${reversed[@]}"}; do
        run_env cross "$env" "$CROSS_TESTS"
    done
fi

"$TOX" -e compat-table || status=1
exit "$status"
