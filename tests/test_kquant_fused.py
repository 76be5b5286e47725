"""Q4_K_M- and Q5_K_M-style GGUFs (written here: random Q4_K or Q5_K blocks, Q6_K on attn_v and
ffn_down of one layer as llama.cpp's _M mixes do) on the fused step: q/k/v of mixed types cannot be one
fused weight, so decode_layers takes them as separate slots. The fused step must give the
reference path's greedy tokens (float32), and batch-invariant mode must take the file (its
K-quants interleaved) and give the same bits whole or chunked."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import gguf_float_tensors, make_hf_model, random_token_ids, write_gguf
from gguf import GGMLQuantizationType as GT
from test_bitwise_invariance import needs_invariant_path
from test_fused_decode import pin_kernel_rows
from test_gguf_quants import random_blocks as gguf_random_blocks
from test_quant_kernels import kernels, random_blocks  # noqa: F401 - kernels: the fixture

from kvserve.engine.llm import LLM
from kvserve.kernels.build import load_kernels
from kvserve.kernels.quant_ref import QT
from kvserve.models.model_session import ModelSession
from kvserve.models.quantized_linear import QuantizedLinear
from kvserve.models.weight_formats import _interleaves
from kvserve.platform import detect_cpu_features
from kvserve.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("kernels")

# K-quant rows need K a multiple of 256: hidden 256, FFN 512, 4 heads of 64, 2 KV heads
SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
}
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


# the default bfloat16 path interleaves quantized weights at load on these CPUs only (the
# loader's own rule, so a KVSERVE_CPU_FEATURES cap skips these tests too)
interleaves_by_default = pytest.mark.skipif(
    not (load_kernels() and _interleaves(detect_cpu_features(), torch.bfloat16)),
    reason="the default path interleaves on AVX-512-BF16 CPUs without AMX",
)

BASES = [QT.Q4_K, QT.Q5_K]  # the _M mixes' main type: Q4_K_M, Q5_K_M


def _k_m_gguf(tmp_path: Path, base: QT) -> Path:
    """Layer 0: ``base`` with Q6_K attn_v and ffn_down (q/k/v unfused); layer 1: all ``base``
    (fused q/k/v and gate/up)."""
    model = make_hf_model("llama", **SHAPE)
    tensors: dict = dict(gguf_float_tensors(model))
    for i in range(SHAPE["num_hidden_layers"]):
        for j, part in enumerate(LINEARS):
            name = f"blk.{i}.{part}.weight"
            n, k = tensors[name].shape
            qt = QT.Q6_K if i == 0 and part in ("attn_v", "ffn_down") else base
            blocks = random_blocks(qt, n, k, seed=10 * i + j).numpy()
            tensors[name] = (np.ascontiguousarray(blocks), GT(int(qt)))
    return write_gguf(tmp_path / f"{base.name.lower()}_m.gguf", model.config, tensors)


def _types(model) -> list[tuple[str, int]]:
    return [(n, m.qtype) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]


@pytest.mark.parametrize("base", BASES, ids=lambda t: t.name)
def test_a_k_m_file_decodes_fused_with_the_reference_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, base: QT
) -> None:
    path = _k_m_gguf(tmp_path, base)
    prompts = [random_token_ids(n, seed=n) for n in (5, 11)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    session = ModelSession.open(path, "float32", "cpu")
    pin_kernel_rows(session.model)  # a noisy timing on tiny weights must not turn it off
    llm = LLM(session=session, num_kv_blocks=64, block_size=4, enforce_eager=True)
    fused = llm.engine.fused_decode
    assert fused is not None, "a mixed-type layer must not push the model off the fused step"
    layer0 = fused.qtypes[:7]
    b, q6 = int(base), int(QT.Q6_K)
    assert layer0 == [b, b, q6, b, b, -1, q6]
    assert fused.qtypes[7:] == [b, -1, -1, b, b, -1, b]
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("KVSERVE_KERNELS", "0")  # the reference: PyTorch dequantize + matmul
    ref = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=4, enforce_eager=True)
    assert ref.engine.fused_decode is None
    want = [o.token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    assert got == want


@needs_invariant_path
@pytest.mark.parametrize("base", BASES, ids=lambda t: t.name)
def test_batch_invariant_mode_takes_a_k_m_file(tmp_path: Path, base: QT) -> None:
    path = _k_m_gguf(tmp_path, base)
    prompt = random_token_ids(40, seed=3)
    params = SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1
    )

    def run(chunk: int):
        llm = LLM(str(path), dtype="bfloat16", batch_invariant=True, num_kv_blocks=64,
                  enable_prefix_caching=False, max_num_batched_tokens=chunk, max_num_seqs=1)  # fmt: skip
        model = llm.engine.fused_decode.model
        linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
        assert linears and all(m.policy.interleaved for m in linears), _types(model)
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        return out.token_ids, out.logprobs, out.prompt_logprobs

    whole = run(64)
    assert run(7) == whole


@interleaves_by_default
@pytest.mark.parametrize("base", BASES, ids=lambda t: t.name)
def test_the_default_bfloat16_path_decodes_a_k_m_file_interleaved(tmp_path: Path, base: QT) -> None:
    """bfloat16 at defaults: every K-quant weight interleaved at load, decode through the
    interleaved kernel inside the fused step, the float32 reference path's greedy tokens."""
    path = _k_m_gguf(tmp_path, base)
    prompt = random_token_ids(24, seed=4)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=64)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert linears and all(m.policy.interleaved for m in linears), _types(model)
    fused = llm.engine.fused_decode
    assert fused is not None and fused.max_rows >= 128
    assert set(fused._bf16_flags.get(1, [4])) <= {0, 4}
    (got,) = llm.generate([prompt], params, use_tqdm=False)
    assert fused._bf16_flags[1] == [0 if t < 0 else 4 for t in fused.qtypes]
    ref = LLM(str(path), dtype="float32", num_kv_blocks=64, enforce_eager=True)
    (want,) = ref.generate([prompt], params, use_tqdm=False)
    assert got.token_ids == want.token_ids


def mixed_gguf(path: Path, pick: Callable[[int, str], GT], seed: int = 0) -> Path:
    """A GGUF of SHAPE with each linear of layer i in ``pick(i, part)``'s format (random
    blocks, gguf-py's valid float16 scales)."""
    model = make_hf_model("llama", **SHAPE)
    tensors: dict = dict(gguf_float_tensors(model))
    rng = np.random.default_rng(seed)
    for i in range(SHAPE["num_hidden_layers"]):
        for part in LINEARS:
            name = f"blk.{i}.{part}.weight"
            n, k = tensors[name].shape
            qt = pick(i, part)
            tensors[name] = (gguf_random_blocks(n, k, qt, rng), qt)
    return write_gguf(path, model.config, tensors)


def test_a_file_that_falls_off_the_fused_step_says_why_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Q2_K is dequantized at load: a layer holding it cannot run in decode_layers, and the
    log says so once, naming the layer and the weight, where the CLI shows it."""
    path = mixed_gguf(
        tmp_path / "q2_k_mix.gguf",
        lambda i, part: GT.Q2_K if i == 1 and part == "ffn_down" else GT.Q4_K,
    )
    with caplog.at_level(logging.WARNING, logger="kvserve.engine.fused_decode"):
        llm = LLM(str(path), dtype="float32", num_kv_blocks=64, enforce_eager=True)
    assert llm.engine.fused_decode is None
    said = [r.getMessage() for r in caplog.records if "fused decode step off" in r.getMessage()]
    assert len(said) == 1 and "layer 1 down_proj is held dense" in said[0], said
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([random_token_ids(6, seed=1)], params, use_tqdm=False)
    assert len(out.token_ids) == 3
