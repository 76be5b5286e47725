#!/usr/bin/env bash
# Set up (scripts/setup.sh, and SGLang's router as a peer: scripts/setup_router.sh) and run
# the whole test suite, lint included.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/setup_router.sh
. .venv/bin/activate
ruff check src tests benchmarks
ruff format --check src tests benchmarks
python -m pytest -q "$@"
