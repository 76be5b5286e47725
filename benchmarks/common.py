"""Shared pieces of the benchmark scripts: workloads with fixed seeds, the HF peer on the same
weights, the machine's memory bandwidth."""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvserve.engine.llm import LLM
from kvserve.models.packed_linear import dense_state_dict
from kvserve.session import ModelSession


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
