#!/usr/bin/env bash
# What a GPU CI runner executes, in one command: the `gpu` tests on NCCL, at world sizes up to
# the number of visible GPUs (tests/elastic/test_gpu.py parametrizes 1, 2, 4, 8 and
# tests/elastic/test_gpu_async.py 1, 2, skipping sizes above the count with the reason), then the
# GPU async-save benchmark on one GPU (python -m ckptlib.bench.gpu_async: blocking seconds per GB
# and step slowdown of ckptlib's async modes against DCP's process checkpointer with pinned
# memory), whose table it prints and whose JSON it keeps. See docs/gpu.md.
#
#   bash ci/gpu.sh                 # all visible GPUs
#   CUDA_VISIBLE_DEVICES=0,1 bash ci/gpu.sh -x   # two GPUs; extra args go to pytest
#   CKPTLIB_GPU_BENCH_ARGS="--mib 256 --reps 1" bash ci/gpu.sh -k async   # a smaller benchmark
#
# Environment: PYTHON (default .venv/bin/python, else python3), CKPTLIB_GPU_JUNIT (junit
# XML path, default ci/compat/junit-gpu.xml), CKPTLIB_GPU_TIMEOUT (seconds per test, 900),
# CKPTLIB_GPU_BENCH_JSON (the benchmark's JSON, default ci/compat/gpu-async.json),
# CKPTLIB_GPU_BENCH_ARGS (more benchmark arguments), CKPTLIB_GPU_BENCH=0 (skip the benchmark).
# Exit codes: pytest's when it failed (it wins; the benchmark still runs and prints its table);
# else the benchmark's (1: a checkpoint not bit-exact or a method failed, 2: no CUDA); "no GPU"
# is a failure here (exit 3), since a GPU runner that sees no GPU would otherwise report every
# test as skipped and pass, and "no tests collected" too (exit 1, at once).
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
JUNIT="${CKPTLIB_GPU_JUNIT:-ci/compat/junit-gpu.xml}"

# Which torch, how many GPUs, NCCL? Refuse to "pass" on a runner without them.
"$PY" - <<'PY' || exit 3
import sys
import torch
import torch.distributed as dist
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"ci/gpu.sh: torch {torch.__version__}, CUDA {torch.version.cuda}, {n} visible GPU(s), "
      f"NCCL {'available' if dist.is_nccl_available() else 'MISSING'}"
      + (f" {torch.cuda.nccl.version()}" if n and dist.is_nccl_available() else ""))
for i in range(n):
    print(f"  cuda:{i}: {torch.cuda.get_device_name(i)}")
if n == 0 or not dist.is_nccl_available():
    print("ci/gpu.sh: no usable CUDA device or no NCCL: this runner cannot run the GPU tests", file=sys.stderr)
    sys.exit(1)
PY

"$PY" -m pytest -m gpu --backend nccl \
  --timeout "${CKPTLIB_GPU_TIMEOUT:-900}" --junitxml "$JUNIT" -o junit_family=xunit2 -ra "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "ci/gpu.sh: pytest collected no gpu tests (exit code 5): failing" >&2
  exit 1
fi
[ -f "$JUNIT" ] && "$PY" ci/compat_table.py stamp "$JUNIT" >/dev/null 2>&1

bench_rc=0
if [ "${CKPTLIB_GPU_BENCH:-1}" != "0" ]; then
  BENCH_JSON="${CKPTLIB_GPU_BENCH_JSON:-ci/compat/gpu-async.json}"
  echo "ci/gpu.sh: python -m ckptlib.bench.gpu_async --json $BENCH_JSON ${CKPTLIB_GPU_BENCH_ARGS:-}"
  # shellcheck disable=SC2086  # the extra arguments are words
  "$PY" -m ckptlib.bench.gpu_async --json "$BENCH_JSON" ${CKPTLIB_GPU_BENCH_ARGS:-}
  bench_rc=$?
  [ "$bench_rc" -ne 0 ] && echo "ci/gpu.sh: the GPU async benchmark failed (exit code $bench_rc)" >&2
fi
if [ "$rc" -ne 0 ]; then exit "$rc"; fi
exit "$bench_rc"
