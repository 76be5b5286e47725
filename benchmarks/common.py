"""Shared pieces of the benchmark scripts: workloads with fixed seeds, the HF peer on the same
weights, the peers that run in their own virtualenvs (benchmarks/peers/), the machine's memory
bandwidth and the bytes a decode step reads."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch
from safetensors.torch import save_file
from torch import nn

from kvserve.engine.llm import LLM
from kvserve.models.model_session import ModelSession
from kvserve.models.packed_linear import dense_state_dict
from kvserve.models.weight_formats import resident_bytes

ROOT = Path(__file__).resolve().parents[1]
PEERS_SCRIPTS = ROOT / "benchmarks" / "peers"
T = TypeVar("T")


def peers_dir() -> Path:
    """Where benchmarks/peers/setup.sh installs the peers (``PEERS_DIR`` overrides)."""
    return Path(os.environ.get("PEERS_DIR", ROOT / ".peers"))


def default_peer_python(name: str) -> str | None:
    """``.peers/NAME/bin/python`` when setup.sh installed that peer, else None."""
    py = peers_dir() / name / "bin" / "python"
    return str(py) if py.exists() else None


def with_dtype_fallback(load: Callable[[str], T], dtype: str) -> tuple[T, str]:
    """``load(dtype)``; where ``auto`` is not accepted (yet), ``load("float32")``. Returns the
    result and the dtype actually asked for."""
    try:
        return load(dtype), dtype
    except ValueError as e:
        if dtype != "auto" or "dtype" not in str(e):
            raise
        return load("float32"), "float32"


def resident_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the model's resident weights that a decode step reads, bytes left out).

    The library's count (every distinct storage once, quantized, packed or dense; fused
    q/k/v rows and their member views once). Left out: an untied embedding table, of which a
    step only gathers one row; a tied one is the lm_head, which reads all of it."""
    total = resident_bytes(model)
    embed = model.model.embed_tokens
    if getattr(model.config, "tie_word_embeddings", False):
        return total, 0
    tensor = getattr(embed, "qweight", None)
    if tensor is None:
        tensor = embed.weight
    left_out = tensor.untyped_storage().nbytes()
    return total - left_out, left_out


class PeerCrashed(RuntimeError):
    """The peer process died by a signal (a segfault, say); ``summary`` is one line."""

    def __init__(self, summary: str, message: str) -> None:
        super().__init__(message)
        self.summary = summary


class PeerProcess:
    """A peer's benchmark script (benchmarks/peers/*.py) run by the peer's own Python, kept
    running so that its runs alternate with kvserve's without paying its start-up each time.

    The script prints ``PEER_READY {json}`` once loaded and warmed up, then one
    ``PEER_RESULT {json}`` per line it reads on stdin. Everything else it writes goes to
    ``log_path``."""

    def __init__(
        self,
        python: str,
        script: str,
        args: Sequence[str],
        env: dict[str, str] | None = None,
    ) -> None:
        self.script = script
        fd, self.log_path = tempfile.mkstemp(
            prefix=f"kvserve-peer-{Path(script).stem}-", suffix=".log"
        )
        self._log = os.fdopen(fd, "a")
        self.proc = subprocess.Popen(
            [python, str(PEERS_SCRIPTS / script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.info = self._read("PEER_READY")

    def _read(self, marker: str) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(marker + " "):
                return json.loads(line[len(marker) + 1 :])
            self._log.write(line)
            self._log.flush()
        rc = self.proc.wait()
        self._log.flush()
        tail = Path(self.log_path).read_text(errors="replace")[-3000:]
        summary = f"{self.script} exited ({rc}) before {marker}"
        if rc < 0:  # killed by a signal: a crash inside the peer, not an error it reported
            raise PeerCrashed(summary, f"{summary}; log tail:\n{tail}")
        raise RuntimeError(f"{summary}; log tail:\n{tail}")

    def run(self) -> dict:
        """One timed run of the peer's workload."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._read("PEER_RESULT")

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def measure_bandwidth() -> float:
    """GB/s of summing a 1 GiB float32 tensor (read-only streaming), best of 5."""
    x = torch.ones(256 * 1024 * 1024, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.nbytes / best / 1e9


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def workload_offline(
    num_requests: int, vocab: int, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """offline-N: prompt lengths uniform in [32, 512], output lengths uniform in [32, 256]."""
    rng = random.Random(seed)
    prompts = [random_prompt(rng, rng.randint(32, 512), vocab) for _ in range(num_requests)]
    outputs = [rng.randint(32, 256) for _ in range(num_requests)]
    return prompts, outputs


def kvserve_llm(model: str | None, dtype: str, **engine_kwargs) -> LLM:
    return LLM(model=model, dtype=dtype, **engine_kwargs)


def export_hf_dir(session: ModelSession, out: Path) -> None:
    """config.json + model.safetensors with the loaded (dequantized) weights; names are HF's."""
    cfg = session.config
    state = {k: v.contiguous() for k, v in dense_state_dict(session.model).items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, out / "model.safetensors")
    hf_cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama" if cfg.model_type == "smollm" else cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
    }
    (out / "config.json").write_text(json.dumps(hf_cfg))


def export_hf_dir_model(session: ModelSession, dtype: torch.dtype):
    """HF transformers on the same weights. A GGUF model is first written out as an HF
    directory of its dequantized weights: transformers 5 keeps GGUF weights packed and
    dequantizes in every matmul, which is not the dense-weight peer a user runs."""
    from transformers import AutoModelForCausalLM

    tmp = Path(tempfile.mkdtemp(prefix="kvserve-bench-hf-"))
    export_hf_dir(session, tmp)
    return AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).eval()


def bench_cluster_config(replicas: int, policy: str, router_python: str, dtype: str, tag: str):
    """A fresh `kvserve cluster` of the default model on free loopback ports, its cores split
    as `kvserve cluster` splits them (benchmarks/cluster.py, cluster_failover.py)."""
    from kvserve import cluster

    return cluster.ClusterConfig(
        replicas=replicas,
        host="127.0.0.1",
        port=cluster.free_port(),
        policy=policy,
        router_python=Path(router_python),
        router_args=(),
        serve_args=("--served-model-name", "kvserve", "--dtype", dtype),
        log_dir=Path(tempfile.mkdtemp(prefix=f"kvserve-cluster-{replicas}-{tag}-")),
        threads_per_replica=cluster.default_threads(replicas),
    )


def start_llama_peer(python: str, script: str, args: Sequence[str]) -> PeerProcess:
    """A llama.cpp peer script (peers/llama_*.py), ready. If it dies by a signal while warming
    up (llama.cpp's AMX matmul segfaults on some Xeons, see peers/llama_decode.py), once more
    with ``--no-extra-bufts``, saying so: a slower llama.cpp is still a measurement, a crash is
    none."""
    try:
        return PeerProcess(python, script, args)
    except PeerCrashed as e:
        print(f"llama.cpp: {e.summary}; again with --no-extra-bufts", file=sys.stderr)
        return PeerProcess(python, script, [*args, "--no-extra-bufts"])
