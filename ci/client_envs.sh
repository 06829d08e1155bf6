#!/usr/bin/env bash
# Build the environments tests/clients/ runs the real client packages in (issue 28), each with
# ckptlib installed from this checkout (editable) and pinned by its constraints file:
#
#   .ci/clients/venv-hf        torch 2.13.0 (constraints.txt) + transformers, Lightning, torchtitan
#                              (ci/constraints-clients-hf.txt); ~3.5 min, 2.7 GB
#   .ci/clients/venv-composer  MosaicML Composer 0.32.1 + torch 2.7.0 (ci/constraints-clients-composer.txt;
#                              Composer pins torch<2.7.1); ~3 min, 5.4 GB
#
#   ci/client_envs.sh [hf|composer|all]     (default all; CKPTLIB_CLIENT_ENVS=DIR builds elsewhere)
#
# An env whose stamp matches its constraints is kept; a partial or stale one is rebuilt.
# .ci/run calls this before the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${CKPTLIB_CLIENT_ENVS:-.ci/clients}"
which="${1:-all}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3
mkdir -p "$dest"

stamp_of() {  # the constraints an env was built from: rebuilt when they change
  cat "$@" pyproject.toml | sha256sum | cut -c1-16
}

build() {  # build NAME STAMP PIP-ARGS...
  local name="$1" stamp="$2"
  shift 2
  local env="$dest/venv-$name"
  if [ -f "$env/.ckptlib-client-env" ] && [ "$(cat "$env/.ckptlib-client-env")" = "$stamp" ]; then
    echo "client_envs: $env is up to date"
    return
  fi
  echo "client_envs: building $env"
  rm -rf "$env"
  "$python" -m venv "$env"
  "$env/bin/pip" install -q "$@"
  echo "$stamp" > "$env/.ckptlib-client-env"
}

if [ "$which" = hf ] || [ "$which" = all ]; then
  build hf "$(stamp_of constraints.txt ci/constraints-clients-hf.txt)" \
    -c constraints.txt -c ci/constraints-clients-hf.txt -e . \
    transformers safetensors accelerate lightning torchtitan torchdata triton
fi
if [ "$which" = composer ] || [ "$which" = all ]; then
  build composer "$(stamp_of ci/constraints-clients-composer.txt)" \
    -c ci/constraints-clients-composer.txt -e . mosaicml torch
fi
