"""Logits parity with transformers on tiny random-weight Hugging Face checkpoints.

Each case saves a tiny model with ``save_pretrained``, loads the directory with kvserve and
compares ``full_logits`` with transformers' logits of the very model that was saved. The
sequence is 100 tokens, longer than ``original_max_position_embeddings`` (64) of the llama3
rope case, so every rotary regime is exercised.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import hf_logits, make_hf_checkpoint, random_token_ids
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kvserve.models.config import SUPPORTED_MODEL_TYPES
from kvserve.models.loader import load_model
from kvserve.platform import detect_cpu_features
from kvserve.reference.decoders import full_logits

SEQ_LEN = 100
ATOL_F32 = 1e-4

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}
LINEAR_ROPE = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}

PARITY_CASES = [
    pytest.param("llama", {}, id="llama-mha"),
    pytest.param("llama", {"num_key_value_heads": 2}, id="llama-gqa"),
    pytest.param("llama", {"num_key_value_heads": 1}, id="llama-mqa"),
    # head_dim 32 with 4 heads: q_proj has 128 rows although hidden_size is 64
    pytest.param("llama", {"head_dim": 32, "num_key_value_heads": 2}, id="llama-explicit-head-dim"),
    pytest.param("llama", {"tie_word_embeddings": True}, id="llama-tied"),
    pytest.param("llama", {"tie_word_embeddings": False}, id="llama-untied"),
    pytest.param("llama", {"rope_parameters": LLAMA3_ROPE}, id="llama3-rope"),
    pytest.param("llama", {"rope_parameters": LINEAR_ROPE}, id="linear-rope"),
    pytest.param(
        "llama",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
        id="llama-rope-theta",
    ),
    pytest.param(
        "llama",
        {"attention_bias": True, "num_key_value_heads": 2},
        id="llama-attention-bias",
    ),
    pytest.param("mistral", {"num_key_value_heads": 2, "sliding_window": 4096}, id="mistral"),
    pytest.param("qwen2", {"num_key_value_heads": 2}, id="qwen2"),
    pytest.param("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": True}, id="qwen2-tied"),
    pytest.param("qwen3", {"num_key_value_heads": 2, "head_dim": 32}, id="qwen3"),
    pytest.param(
        "qwen3",
        {"num_key_value_heads": 2, "head_dim": 32, "attention_bias": True},
        id="qwen3-attention-bias",
    ),
]


@pytest.mark.parametrize(("model_type", "overrides"), PARITY_CASES)
def test_float32_logits_match_transformers(tmp_path: Path, model_type: str, overrides: dict):
    ckpt, hf_model = make_hf_checkpoint(tmp_path, model_type, **overrides)
    ids = random_token_ids(SEQ_LEN)

    loaded = load_model(ckpt, dtype="float32")

    assert loaded.gguf_file is None and loaded.path == ckpt
    assert loaded.config.model_type == model_type
    assert loaded.model.dtype == torch.float32
    got = full_logits(loaded.model, ids)
    want = hf_logits(hf_model, ids)
    assert got.shape == want.shape == (SEQ_LEN, hf_model.config.vocab_size)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=ATOL_F32, rtol=0)


def test_tied_model_shares_embedding_and_head(tmp_path: Path):
    ckpt, _ = make_hf_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    model = load_model(ckpt, pack_weights=False).model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # packed for oneDNN, the head is a re-laid copy of the same values
    packed = load_model(ckpt, pack_weights=True).model
    assert torch.equal(packed.lm_head.weight, packed.model.embed_tokens.weight)


def test_llama3_rope_config_is_read(tmp_path: Path):
    ckpt, _ = make_hf_checkpoint(tmp_path, "llama", rope_parameters=LLAMA3_ROPE)
    scaling = load_model(ckpt).config.rope_scaling
    assert scaling.rope_type == "llama3"
    assert scaling.factor == 8.0
    assert scaling.original_max_position_embeddings == 64


def test_sharded_checkpoint(tmp_path: Path):
    ckpt, hf_model = make_hf_checkpoint(
        tmp_path, "llama", num_key_value_heads=2, max_shard_size="20KB"
    )
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (ckpt / "model.safetensors").exists()
    ids = random_token_ids(SEQ_LEN)

    got = full_logits(load_model(ckpt).model, ids)

    torch.testing.assert_close(got, hf_logits(hf_model, ids), atol=ATOL_F32, rtol=0)


# None: this CPU as it is; "avx2": the same CPU capped as a Zen 3 (no native bfloat16, no oneDNN
# bf16 packing), where an explicit bfloat16 used to crash at load
@pytest.mark.parametrize("cap", [None, "avx2"])
def test_bfloat16_close_to_transformers_bfloat16(tmp_path: Path, cap: str | None):
    ckpt, hf32 = make_hf_checkpoint(tmp_path, "llama", num_key_value_heads=2)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    ids = random_token_ids(64)

    loaded = load_model(ckpt, dtype="bfloat16", features=detect_cpu_features(cap))

    assert loaded.model.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    got = full_logits(loaded.model, ids)
    assert got.dtype == torch.float32  # logits are returned as float32 whatever the model dtype
    want_bf16 = hf_logits(hf_bf16, ids)
    want_f32 = hf_logits(hf32, ids)
    # Same arithmetic as transformers in bfloat16, up to op-order rounding (bf16 eps = 2^-8).
    torch.testing.assert_close(got, want_bf16, atol=0.1, rtol=0)
    torch.testing.assert_close(got, want_f32, atol=0.15, rtol=0)
    # The greedy token agrees with float32 wherever float32 has a clear winner.
    top2 = want_f32.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    assert clear.sum() >= len(ids) // 2
    assert torch.equal(got.argmax(-1)[clear], want_f32.argmax(-1)[clear])


# --------------------------------------------------------------------------------------------
# Strictness: a checkpoint that does not fit the model is refused with the tensor's name.


def _rewrite_weights(ckpt: Path, edit) -> None:
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_extra_tensor_is_rejected(tmp_path: Path):
    ckpt, _ = make_hf_checkpoint(tmp_path, "llama")
    extra = "model.layers.0.self_attn.surprise.weight"
    _rewrite_weights(ckpt, lambda t: t.__setitem__(extra, torch.zeros(4, 4)))

    with pytest.raises(ValueError, match="unexpected tensor") as info:
        load_model(ckpt)
    assert extra in str(info.value)


def test_missing_tensor_is_rejected(tmp_path: Path):
    ckpt, _ = make_hf_checkpoint(tmp_path, "llama")
    gone = "model.layers.1.mlp.up_proj.weight"
    _rewrite_weights(ckpt, lambda t: t.pop(gone))

    with pytest.raises(ValueError, match="missing") as info:
        load_model(ckpt)
    assert gone in str(info.value)


def test_wrong_shape_is_rejected(tmp_path: Path):
    ckpt, _ = make_hf_checkpoint(tmp_path, "llama")
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite_weights(ckpt, lambda t: t.__setitem__(name, torch.zeros(8, 64)))

    with pytest.raises(ValueError, match="shape") as info:
        load_model(ckpt)
    assert name in str(info.value)
    assert "(8, 64)" in str(info.value) and "(64, 64)" in str(info.value)


def test_missing_lm_head_of_untied_model_is_rejected(tmp_path: Path):
    ckpt, _ = make_hf_checkpoint(tmp_path, "llama", tie_word_embeddings=False)
    _rewrite_weights(ckpt, lambda t: t.pop("lm_head.weight"))

    with pytest.raises(ValueError, match="lm_head.weight"):
        load_model(ckpt)


def test_tied_model_with_equal_lm_head_copy_loads(tmp_path: Path):
    ckpt, hf_model = make_hf_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    _rewrite_weights(
        ckpt, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone())
    )
    ids = random_token_ids(16)

    got = full_logits(load_model(ckpt).model, ids)

    torch.testing.assert_close(got, hf_logits(hf_model, ids), atol=ATOL_F32, rtol=0)


def test_tied_model_with_different_lm_head_is_rejected(tmp_path: Path):
    ckpt, _ = make_hf_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    _rewrite_weights(ckpt, lambda t: t.__setitem__("lm_head.weight", torch.ones(128, 64)))

    with pytest.raises(ValueError, match="lm_head.weight"):
        load_model(ckpt)


def test_unsupported_model_type_is_rejected(tmp_path: Path):
    ckpt, _ = make_hf_checkpoint(tmp_path, "llama")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(cfg))

    with pytest.raises(ValueError, match="gpt2") as info:
        load_model(ckpt)
    for supported in SUPPORTED_MODEL_TYPES:
        assert supported in str(info.value)
