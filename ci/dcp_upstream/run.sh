#!/usr/bin/env bash
# PyTorch's own DCP tests with ckptlib's writer/reader in place of DCP's FileSystemWriter/Reader.
#
#   ci/dcp_upstream/run.sh UPSTREAM_DIR [OUT_DIR]
#
# UPSTREAM_DIR holds test/distributed/checkpoint/{test_file_system_checkpoint_cpu,
# test_dtensor_resharding,test_format_utils}.py from the pytorch/pytorch source of the torch you
# test (they are not in any wheel or sdist on PyPI; nothing of them is kept in this repository).
# Each file runs twice, as is (DCP's own storage) and swapped (CKPTLIB_DCP_SWAP=1), with the
# GPU-gated DTensor tests forced onto CPU (4 gloo ranks); OUT_DIR (default ./dcp-upstream-out)
# gets one junit XML per run and table.md, the pass table of docs/dcp.md.
# Needs: PYTHON (default .venv/bin/python) with ckptlib, expecttest, zstandard and pytest.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
upstream="$(cd "$1" && pwd)"
out="$(mkdir -p "${2:-dcp-upstream-out}" && cd "${2:-dcp-upstream-out}" && pwd)"
python="$(command -v "${PYTHON:-.venv/bin/python}")"
python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")"  # absolute, the venv's own link kept
files=(test_file_system_checkpoint_cpu.py test_dtensor_resharding.py test_format_utils.py)
"$python" "$here/cpu_variants.py" "$upstream" "$out/tests" "${files[@]}"
for file in "${files[@]}"; do
  for mode in plain ckptlib; do
    swap=0; [ "$mode" = ckptlib ] && swap=1
    (cd "$out/tests" && CKPTLIB_DCP_SWAP=$swap CKPTLIB_DCP_SWAP_LOG="$out/${file%.py}-$mode.swaps" PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" \
      timeout 1800 "$python" -m pytest -p no:cacheprovider -q -rA "$file" \
      --junitxml="$out/${file%.py}-$mode.xml" >"$out/${file%.py}-$mode.log" 2>&1) || true
    echo "$file ($mode): $(tail -1 "$out/${file%.py}-$mode.log")"
  done
done
"$python" "$here/table.py" "$out" "${files[@]}" | tee "$out/table.md"
