#!/usr/bin/env bash
# SGLang's router (sglang-router 0.3.2: a Rust binary in the wheel, seconds to install) in its
# own venv, .peers/sglang-router: a peer that runs beside kvserve, never inside it. The tests
# put it in front of kvserve replicas (tests/test_server_worker_routes.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
V=.peers/sglang-router
if [ ! -x "$V/bin/python" ]; then
  "$PYTHON" -m venv "$V"
fi
"$V/bin/python" -m pip install -q "sglang-router==0.3.2"
echo "sglang-router is set up in $(pwd)/$V" >&2
