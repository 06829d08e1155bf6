#!/usr/bin/env bash
# Mutation testing of ckptlib's core (cosmic-ray), one session per module; see docs/mutation.md.
#
#   ci/mutation.sh list                     # the modules and the tests each runs per mutant
#   ci/mutation.sh run [module...]          # all modules by default; resumes an interrupted session
#   ci/mutation.sh report [module...]       # counts + survivors (<out>/<module>.md)
#   ci/mutation.sh retest [module...]       # after adding tests: survivors pending again, then `run`
#   ci/mutation.sh coverage [module...]     # per-test coverage map: `run` then runs only the tests
#                                           # that cover each mutant (see ci/mutation_select.py)
#
# cosmic-ray mutates files in place, so it works on a scratch copy of the committed tree
# (git archive HEAD), never on the checkout: MUTATION_TREE (default /tmp/ckptlib-mutation/tree),
# refreshed from HEAD with MUTATION_REFRESH=1. Sessions and reports go to MUTATION_OUT
# (default /tmp/ckptlib-mutation/out). cosmic-ray lives in its own venv (MUTATION_VENV, default
# .venv-mut, made on first use); the tests run on MUTATION_TEST_PYTHON (default .venv/bin/python,
# the project's venv with the test extra). Spawned ranks import the mutated copy: the rank
# forkserver inherits the pytest process's sys.path, which starts with the scratch tree.
# MUTATION_SAMPLE=N (MUTATION_SEED=S) keeps a seeded random sample of N mutants at a session's
# start: the `format` module (all of ckptlib/format/, ~2,850 mutants) is run that way.
# It is CPU-heavy and not part of .ci/run: run it under `nice -n 10` on a shared machine.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${MUTATION_VENV:-$repo/.venv-mut}
tree=${MUTATION_TREE:-/tmp/ckptlib-mutation/tree}
out=${MUTATION_OUT:-/tmp/ckptlib-mutation/out}
test_python=${MUTATION_TEST_PYTHON:-$repo/.venv/bin/python}

if [ ! -x "$venv/bin/cosmic-ray" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "cosmic-ray==8.7.0"
fi
if [ "${MUTATION_REFRESH:-0}" = 1 ] || [ ! -d "$tree/ckptlib" ]; then
    rm -rf "$tree" && mkdir -p "$tree"
    git -C "$repo" archive HEAD | tar -x -C "$tree"
fi
if [ "${1:-}" = coverage ] && ! "$test_python" -c 'import coverage' 2>/dev/null; then
    # coverage.py is a dependency of the mutation tool, not of the tests: installed into the test python
    "$test_python" -m pip install -q "coverage>=7,<8"
fi
cd "$tree"
export PYTHONPATH="$tree" MUTATION_OUT="$out" MUTATION_TEST_PYTHON="$test_python"
exec "$venv/bin/python" ci/mutation.py "$@"
