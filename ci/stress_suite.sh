#!/usr/bin/env bash
# The suite under load (issue 36): the README's test command on a fresh clone of HEAD, LOADED
# times with BURNERS CPU-bound processes (`while True: pass`) running the whole time, then once
# quiet; or (`files`) the multi-node, crash-boundary and elastic files alone, REPEAT times in a
# row, loaded. Every run's result and time goes to $OUT/summary.txt; each run's log beside it.
#
#   ci/stress_suite.sh [suite|files]      LOADED=3 BURNERS=2 REPEAT=5 OUT=/tmp/ckptlib-stress
#
# The client environments are reused from this checkout's .ci/clients when they are built
# (CKPTLIB_CLIENT_ENVS; the tests put the fresh clone first on each client's path).
# Exits non-zero when any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
mode="${1:-suite}"
loaded="${LOADED:-3}"
burners="${BURNERS:-2}"
repeat="${REPEAT:-5}"
out="${OUT:-/tmp/ckptlib-stress}"
mkdir -p "$out"
summary="$out/summary.txt"
: > "$summary"
export CKPTLIB_CLIENT_ENVS="${CKPTLIB_CLIENT_ENVS:-$repo/.ci/clients}"
export CI=true

burner_pids=()
start_load() {
  for _ in $(seq "$burners"); do
    python3 -c "while True: pass" &
    burner_pids+=("$!")
  done
}
stop_load() {
  for pid in "${burner_pids[@]:-}"; do
    [ -n "$pid" ] && kill "$pid" 2>/dev/null
  done
  burner_pids=()
}
trap stop_load EXIT

clone=""
fresh_clone() {  # a clone of HEAD with the README's install (the first half of its command)
  clone="$(mktemp -d "$out/clone.XXXX")"
  git clone -q "$repo" "$clone" &&
    (cd "$clone" && python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e '.[test]')
}

run() {  # run NAME LOAD(0|1) PYTEST-ARGS...: one pytest run in the fresh clone, timed
  local name="$1" load="$2"
  shift 2
  [ "$load" = 1 ] && start_load
  local t0 rc
  t0=$(date +%s)
  (cd "$clone" && .venv/bin/python -m pytest "$@") > "$out/$name.log" 2>&1
  rc=$?
  stop_load
  local tail_line
  tail_line="$(grep -E '^(=+ )?[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' "$out/$name.log" | tail -1)"
  echo "$name load=$load exit=$rc seconds=$(( $(date +%s) - t0 )) ${tail_line}" | tee -a "$summary"
  [ "$rc" -eq 0 ]
}

failed=0
fresh_clone || { echo "stress_suite: the fresh clone's install failed" >&2; exit 1; }
case "$mode" in
  suite)
    for i in $(seq "$loaded"); do
      run "loaded$i" 1 -n 2 -p no:cacheprovider || failed=1
    done
    run quiet 0 -n 2 -p no:cacheprovider || failed=1
    ;;
  files)
    files=(tests/elastic/test_multinode.py tests/elastic/test_cluster_tier.py tests/elastic/test_read_once_nodes.py
      tests/manager/test_crash_boundaries.py tests/manager/test_crash.py tests/manager/test_tier_replicas.py
      tests/elastic/test_elastic.py tests/elastic/test_agent.py)
    present=()
    for f in "${files[@]}"; do [ -f "$clone/$f" ] && present+=("$f"); done
    for i in $(seq "$repeat"); do
      run "files$i" 1 -n 2 -p no:cacheprovider --suite all "${present[@]}" || failed=1
    done
    ;;
  *)
    echo "usage: ci/stress_suite.sh [suite|files]" >&2
    exit 2
    ;;
esac
rm -rf "$clone"
exit "$failed"
