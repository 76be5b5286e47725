"""GGUF loading: llama.cpp's layout (permuted q/k rows), architectures, and the default model.

Tiny float GGUF files are written with ``gguf.GGUFWriter`` the way llama.cpp's
convert_hf_to_gguf.py writes them (see conftest.write_gguf) and compared with their safetensors
twin. Quantized weights are tested in test_gguf_quants.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    gguf_float_tensors,
    hf_logits,
    make_gguf_checkpoint,
    make_hf_checkpoint,
    make_hf_model,
    random_token_ids,
    write_gguf,
)
from gguf import RopeScalingType

from kvserve.models.loader import load_model
from kvserve.reference.decoders import full_logits

SEQ_LEN = 48
ATOL_F32 = 1e-4


# --------------------------------------------------------------------------------------------
# Float32 GGUF == its safetensors twin


GGUF_CASES = [
    pytest.param("llama", {}, id="llama-mha"),
    pytest.param("llama", {"num_key_value_heads": 2}, id="llama-gqa"),
    pytest.param("llama", {"num_key_value_heads": 1}, id="llama-mqa"),
    pytest.param("llama", {"head_dim": 32, "num_key_value_heads": 2}, id="llama-explicit-head-dim"),
    pytest.param("llama", {"tie_word_embeddings": True, "num_key_value_heads": 2}, id="llama-tied"),
    pytest.param("mistral", {"num_key_value_heads": 2}, id="mistral-as-llama"),
    pytest.param("qwen2", {"num_key_value_heads": 2}, id="qwen2"),
    pytest.param("qwen3", {"num_key_value_heads": 2, "head_dim": 32}, id="qwen3"),
]


@pytest.mark.parametrize(("model_type", "overrides"), GGUF_CASES)
def test_float_gguf_matches_safetensors_twin(tmp_path: Path, model_type: str, overrides: dict):
    ckpt, hf_model = make_hf_checkpoint(tmp_path, model_type, **overrides)
    gguf_path = make_gguf_checkpoint(tmp_path / "model.gguf", hf_model)
    ids = random_token_ids(SEQ_LEN)

    from_gguf = load_model(gguf_path)
    from_hf = load_model(ckpt)

    assert from_gguf.gguf_file == gguf_path
    a, b = from_gguf.config, from_hf.config
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rope_theta",
        "max_position_embeddings",
        "tie_word_embeddings",
        "attention_bias",
        "qk_norm",
        "bos_token_id",
        "eos_token_ids",
    ):
        assert getattr(a, field) == getattr(b, field), field
    assert a.rms_norm_eps == pytest.approx(b.rms_norm_eps, rel=1e-6)  # stored as float32
    # The weights are the same numbers: the q/k permutation was undone exactly.
    hf_params = dict(from_hf.model.named_parameters())
    for name, p in from_gguf.model.named_parameters():
        assert torch.equal(p, hf_params[name]), name
    got = full_logits(from_gguf.model, ids)
    torch.testing.assert_close(got, full_logits(from_hf.model, ids), atol=1e-5, rtol=0)
    torch.testing.assert_close(got, hf_logits(hf_model, ids), atol=ATOL_F32, rtol=0)


def test_gguf_arch_flags(tmp_path: Path):
    """qwen2 bias / qwen3 q-k norm / tied output are detected from the tensors present."""
    qwen2 = make_gguf_checkpoint(
        tmp_path / "q2.gguf", make_hf_model("qwen2", num_key_value_heads=2)
    )
    qwen3 = make_gguf_checkpoint(
        tmp_path / "q3.gguf", make_hf_model("qwen3", num_key_value_heads=2, head_dim=32)
    )
    tied = make_gguf_checkpoint(
        tmp_path / "t.gguf", make_hf_model("llama", tie_word_embeddings=True)
    )

    c2, c3, ct = (load_model(p).config for p in (qwen2, qwen3, tied))

    assert (c2.model_type, c2.attention_bias, c2.qk_norm) == ("qwen2", True, False)
    assert (c3.model_type, c3.attention_bias, c3.qk_norm, c3.head_dim) == ("qwen3", False, True, 32)
    assert ct.tie_word_embeddings and not c2.tie_word_embeddings


def test_unpermuted_llama_gguf_gives_different_logits(tmp_path: Path):
    """Guard for the twin test: without llama.cpp's q/k permutation the logits change a lot."""
    hf_model = make_hf_model("llama", num_key_value_heads=2)
    good = make_gguf_checkpoint(tmp_path / "good.gguf", hf_model)
    # Written as "qwen2" layout (no permutation) but labelled llama: kvserve will un-permute.
    tensors = gguf_float_tensors(hf_model, arch="qwen2")
    bad = write_gguf(tmp_path / "bad.gguf", hf_model.config, tensors, arch="llama")
    ids = random_token_ids(SEQ_LEN)

    good_logits = full_logits(load_model(good).model, ids)
    bad_logits = full_logits(load_model(bad).model, ids)

    assert (good_logits - bad_logits).abs().max() > 0.1


def test_vocab_size_from_tokenizer_tokens(tmp_path: Path):
    """Without {arch}.vocab_size, the vocabulary length comes from tokenizer.ggml.tokens."""
    hf_model = make_hf_model("llama")
    tokens = [f"tok{i}" for i in range(hf_model.config.vocab_size)]
    path = make_gguf_checkpoint(
        tmp_path / "m.gguf",
        hf_model,
        write_vocab_size=False,
        extra_metadata=lambda w: (w.add_tokenizer_model("llama"), w.add_token_list(tokens)),
    )
    ids = random_token_ids(16)

    loaded = load_model(path)

    assert loaded.config.vocab_size == hf_model.config.vocab_size
    torch.testing.assert_close(
        full_logits(loaded.model, ids), hf_logits(hf_model, ids), atol=ATOL_F32, rtol=0
    )


def llama_cpp_rope_freqs(config) -> np.ndarray:
    """convert_hf_to_gguf.LlamaModel.generate_extra_tensors: Llama 3.1 scaling as per-frequency
    divisors (the rope_freqs.weight tensor)."""
    rope = config.rope_parameters
    dim = config.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_rope_as_rope_freqs_tensor(tmp_path: Path):
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
    }
    hf_model = make_hf_model("llama", num_key_value_heads=2, rope_parameters=rope)
    tensors = {"rope_freqs.weight": llama_cpp_rope_freqs(hf_model.config)}
    tensors.update(gguf_float_tensors(hf_model))
    path = write_gguf(tmp_path / "m.gguf", hf_model.config, tensors)
    ids = random_token_ids(100)  # past original_max_position_embeddings

    loaded = load_model(path)

    assert loaded.config.rope_scaling.rope_type == "default"  # the factors carry the scaling
    torch.testing.assert_close(
        full_logits(loaded.model, ids), hf_logits(hf_model, ids), atol=ATOL_F32, rtol=0
    )


def test_linear_rope_scaling_metadata(tmp_path: Path):
    rope = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    hf_model = make_hf_model("llama", num_key_value_heads=2, rope_parameters=rope)

    def scaling(writer):
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)

    path = make_gguf_checkpoint(tmp_path / "m.gguf", hf_model, extra_metadata=scaling)
    ids = random_token_ids(100)

    loaded = load_model(path)

    assert (loaded.config.rope_scaling.rope_type, loaded.config.rope_scaling.factor) == (
        "linear",
        4.0,
    )
    torch.testing.assert_close(
        full_logits(loaded.model, ids), hf_logits(hf_model, ids), atol=ATOL_F32, rtol=0
    )


def test_loaded_gguf_weights_do_not_alias_the_file(tmp_path: Path):
    """F32 tensors are read-only views of GGUFReader's memory map; the model must own copies."""
    path = make_gguf_checkpoint(tmp_path / "m.gguf", make_hf_model("llama"))
    model = load_model(path, dtype="float32").model
    before = {n: p.clone() for n, p in model.named_parameters()}

    # Overwrite the file in place (same size: the mapping stays valid, nothing is truncated).
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.write(b"\0" * size)

    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert not changed, f"parameters changed with the file: {changed}"


# --------------------------------------------------------------------------------------------
# The embedded default model (SmolLM2-135M-Instruct, Q4_1) against transformers' GGUF loader

# "The capital of France is Paris. The capital of Germany is Berlin, and the capital of Italy is"
DEFAULT_MODEL_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 4521, 314, 11452, 28, 284, 260, 3575, 282, 7158, 314]  # fmt: skip
BERLIN = 11452


@pytest.fixture(scope="module")
def default_kvserve_logits(default_gguf: Path) -> torch.Tensor:
    loaded = load_model(default_gguf)
    assert loaded.config.model_type == "llama" and loaded.config.tie_word_embeddings
    return full_logits(loaded.model, DEFAULT_MODEL_IDS)


@pytest.fixture(scope="module")
def default_hf_logits(default_gguf: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
    ).eval()
    return hf_logits(model, DEFAULT_MODEL_IDS)


@pytest.mark.slow
def test_default_model_matches_transformers(default_kvserve_logits, default_hf_logits):
    got, want = default_kvserve_logits, default_hf_logits
    assert got.shape == want.shape == (len(DEFAULT_MODEL_IDS), 49152)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.slow
def test_default_model_is_sensible(default_kvserve_logits):
    # after "... The capital of Germany is" the model says " Berlin"
    assert default_kvserve_logits[11].argmax().item() == BERLIN
