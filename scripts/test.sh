#!/usr/bin/env bash
# Set up (Debian's chromium for the browser tests, scripts/setup.sh, and SGLang's router as a
# peer: scripts/setup_router.sh) and run
# the whole test suite, lint included.
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
scripts/setup.sh
scripts/setup_router.sh
. .venv/bin/activate
python -m pip install -q -e ".[test]"
ruff check src tests benchmarks
ruff format --check src tests benchmarks
python -m pytest -q "$@"
