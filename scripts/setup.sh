#!/usr/bin/env bash
# Set up attnscope in ./.venv on a fresh machine: PyTorch first where the environment has none (so pip
# does not pull a multi-GB CUDA build to satisfy the `torch` requirement), then attnscope with its test
# extras. Safe to run again: an existing .venv and torch are kept.
#
#   TORCH_INDEX_URL   where to take torch from when it is missing, e.g. PyTorch's CPU wheel index
#                     (https://download.pytorch.org/whl/cpu) on a CPU-only machine; default: the usual index
#   TORCH_VERSION     the torch version to install when it is missing (default 2.13.0)
#   PYTHON            the interpreter for the virtual environment (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing torch ${TORCH_VERSION:-2.13.0} ${TORCH_INDEX_URL:+from $TORCH_INDEX_URL}" >&2
  .venv/bin/python -m pip install --quiet ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
    "torch==${TORCH_VERSION:-2.13.0}"
fi
.venv/bin/python -m pip install --quiet -e ".[test]"
