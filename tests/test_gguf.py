"""GGUF loading: llama.cpp's layout (permuted q/k rows), quant types, and the default model.

Tiny GGUF files are written with ``gguf.GGUFWriter`` the way llama.cpp's convert_hf_to_gguf.py
writes them (see conftest.write_gguf) and compared with their safetensors twin. Quantized
weights are checked against ``gguf.quants.dequantize`` and, for the common formats, against an
independent numpy dequantizer written here from ggml's C reference.
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
    llama_cpp_permute,
    make_gguf_checkpoint,
    make_hf_checkpoint,
    make_hf_model,
    random_token_ids,
    write_gguf,
)
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, RopeScalingType
from gguf.quants import dequantize, quantize

from kvserve.models.gguf_checkpoint import SUPPORTED_GGML_TYPES
from kvserve.models.loader import load_model
from kvserve.models.packed_linear import dense_state_dict
from kvserve.reference import full_logits

Q = GGMLQuantizationType
SEQ_LEN = 48
ATOL_F32 = 1e-4

_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_TO_HF:
        return _GGUF_TO_HF[gguf_name]
    _, layer, suffix = gguf_name.split(".", 2)
    return f"model.layers.{layer}.{_GGUF_TO_HF[suffix]}"


def as_stored(model, gguf_name: str, arch: str = "llama") -> np.ndarray:
    """A loaded kvserve parameter in the layout the GGUF file stores it (q/k re-permuted)."""
    w = dense_state_dict(model)[hf_name(gguf_name)].detach().float().numpy()
    cfg = model.config
    if arch == "llama" and gguf_name.endswith("attn_q.weight"):
        return llama_cpp_permute(w, cfg.num_attention_heads)
    if arch == "llama" and gguf_name.endswith("attn_k.weight"):
        return llama_cpp_permute(w, cfg.num_key_value_heads)
    return w


def unpermute_by_index(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama_cpp_permute by tracking row indices (independent of kvserve's formula)."""
    order = llama_cpp_permute(np.arange(w.shape[0]), n_head)  # permuted[i] = w[order[i]]
    out = np.empty_like(w)
    out[order] = w
    return out


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
# Quantized weights written with gguf.quants.quantize

# quant type -> bound on ||logits - float twin's logits|| / ||float twin's logits||. Measured
# on these random 2-layer models: F16 5e-4, BF16 4e-3, Q8_0 1.3e-2, Q5_x 0.1, Q4_x 0.2 (random
# weights have no structure for 4 bits to keep); the bounds leave about 2x headroom.
QUANTIZE_TOLERANCE = {
    Q.F16: 1.5e-3,
    Q.BF16: 1e-2,
    Q.Q8_0: 3e-2,
    Q.Q5_0: 0.2,
    Q.Q5_1: 0.2,
    Q.Q4_0: 0.35,
    Q.Q4_1: 0.35,
}


@pytest.mark.parametrize("qtype", list(QUANTIZE_TOLERANCE), ids=lambda q: q.name)
def test_quantized_gguf(tmp_path: Path, qtype: GGMLQuantizationType):
    hf_model = make_hf_model("llama", num_key_value_heads=2)
    cfg = hf_model.config
    floats = gguf_float_tensors(hf_model)
    tensors: dict = {}
    expected: dict[str, np.ndarray] = {}  # what each stored tensor decodes to, stored layout
    for name, w in floats.items():
        if w.ndim == 2:  # llama.cpp keeps 1-D norm weights in F32
            qdata = quantize(w, qtype)
            tensors[name] = (qdata, qtype)
            expected[name] = np.asarray(dequantize(qdata, qtype), dtype=np.float32).reshape(w.shape)
        else:
            tensors[name] = w
            expected[name] = w
    path = write_gguf(tmp_path / f"m-{qtype.name}.gguf", cfg, tensors)
    ids = random_token_ids(SEQ_LEN)

    loaded = load_model(path)

    for name, want in expected.items():
        np.testing.assert_array_equal(as_stored(loaded.model, name), want, err_msg=name)
    # Exact parity with transformers running the same dequantized weights...
    deq_state = {}
    for name, w in expected.items():
        if name.endswith("attn_q.weight"):
            w = unpermute_by_index(w, cfg.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            w = unpermute_by_index(w, cfg.num_key_value_heads)
        deq_state[hf_name(name)] = torch.from_numpy(w.copy())
    deq_twin = make_hf_model("llama", num_key_value_heads=2)
    deq_twin.load_state_dict(deq_state, strict=True)
    got = full_logits(loaded.model, ids)
    torch.testing.assert_close(got, hf_logits(deq_twin, ids), atol=ATOL_F32, rtol=0)
    # ...and close to the float model, within what the quant type's precision allows.
    want = hf_logits(hf_model, ids)
    rel_err = ((got - want).norm() / want.norm()).item()
    assert rel_err < QUANTIZE_TOLERANCE[qtype]


# --------------------------------------------------------------------------------------------
# Random raw blocks (k-quants have no quantizer in gguf-py): a 256-wide model

# quant type -> byte offsets of the fp16 fields in one block (ggml's block_* structs)
FP16_FIELDS = {
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}
WIDE = {
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
}


def random_blocks(rows: int, cols: int, qtype: GGMLQuantizationType, rng) -> np.ndarray:
    """Valid random bytes for a (rows, cols) tensor: fp16 fields set to small finite values."""
    block, size = GGML_QUANT_SIZES[qtype]
    assert cols % block == 0
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        scale = rng.uniform(1e-3, 2e-2, size=(rows, cols // block)).astype(np.float16)
        raw[:, :, off : off + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, cols // block * size)


def write_random_quant_model(path: Path, qtype: GGMLQuantizationType, seed: int = 0):
    """A 256-wide llama whose 2-D weights are random raw ``qtype`` blocks; returns (raw, path)."""
    hf_model = make_hf_model("llama", **WIDE)
    rng = np.random.default_rng(seed)
    tensors: dict = {}
    raw: dict[str, np.ndarray] = {}
    for name, w in gguf_float_tensors(hf_model).items():
        if w.ndim == 2:
            raw[name] = random_blocks(*w.shape, qtype, rng)
            tensors[name] = (raw[name], qtype)
        else:
            tensors[name] = w
    return raw, write_gguf(path, hf_model.config, tensors)


@pytest.mark.parametrize("qtype", list(FP16_FIELDS), ids=lambda q: q.name)
def test_random_blocks_dequantize_like_gguf_py(tmp_path: Path, qtype: GGMLQuantizationType):
    raw, path = write_random_quant_model(tmp_path / "m.gguf", qtype)

    loaded = load_model(path)

    for name, data in raw.items():
        w = as_stored(loaded.model, name)
        block, size = GGML_QUANT_SIZES[qtype]
        assert w.shape == (data.shape[0], data.shape[1] // size * block), name
        assert np.isfinite(w).all(), name
        want = np.asarray(dequantize(data, qtype), dtype=np.float32)
        np.testing.assert_array_equal(w, want, err_msg=name)
    logits = full_logits(loaded.model, random_token_ids(8))
    assert torch.isfinite(logits).all()


# Independent reference dequantizers, transcribed from ggml-quants.c (dequantize_row_*).
# Each takes (n_blocks, type_size) uint8 and returns (n_blocks, block_size) float32.


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)  # (n, 2) -> (n, 1)


def ref_q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    q = b[:, 2:34].view(np.int8).astype(np.float32)
    return d * q


def ref_q4_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    qs = b[:, 2:18]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)  # elements 0..15, 16..31
    return d * (q - 8)


def ref_q4_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    qs = b[:, 4:20]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return d * q + m


def _k4_scale_min(scales: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml get_scale_min_k4: 6-bit scale and min of sub-block j (0..7)."""
    s = scales.astype(np.int32)
    if j < 4:
        return s[:, j] & 63, s[:, j + 4] & 63
    sc = (s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4)
    mn = (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)
    return sc, mn


def ref_q4_k(b: np.ndarray) -> np.ndarray:
    d, dmin = _f16(b[:, 0:2])[:, 0], _f16(b[:, 2:4])[:, 0]
    scales, qs = b[:, 4:16], b[:, 16:144]
    out = np.empty((b.shape[0], 256), dtype=np.float32)
    for chunk in range(4):  # 64 elements each: 32 low nibbles, then 32 high nibbles
        q = qs[:, chunk * 32 : chunk * 32 + 32]
        for half, nib in enumerate((q & 0xF, q >> 4)):
            sc, mn = _k4_scale_min(scales, 2 * chunk + half)
            d1 = (d * sc.astype(np.float32))[:, None]
            m1 = (dmin * mn.astype(np.float32))[:, None]
            start = chunk * 64 + half * 32
            out[:, start : start + 32] = d1 * nib.astype(np.float32) - m1
    return out


def ref_q6_k(b: np.ndarray) -> np.ndarray:
    ql_all, qh_all = b[:, 0:128], b[:, 128:192]
    sc_all = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])[:, 0]
    out = np.empty((b.shape[0], 256), dtype=np.float32)
    for n in range(2):  # two halves of 128
        ql, qh = ql_all[:, 64 * n :].astype(np.int32), qh_all[:, 32 * n :].astype(np.int32)
        sc = sc_all[:, 8 * n :]
        for l in range(32):  # noqa: E741 - ggml's loop variable
            is_ = l // 16
            q1 = ((ql[:, l] & 0xF) | (((qh[:, l] >> 0) & 3) << 4)) - 32
            q2 = ((ql[:, l + 32] & 0xF) | (((qh[:, l] >> 2) & 3) << 4)) - 32
            q3 = ((ql[:, l] >> 4) | (((qh[:, l] >> 4) & 3) << 4)) - 32
            q4 = ((ql[:, l + 32] >> 4) | (((qh[:, l] >> 6) & 3) << 4)) - 32
            base = 128 * n + l
            out[:, base] = d * sc[:, is_] * q1
            out[:, base + 32] = d * sc[:, is_ + 2] * q2
            out[:, base + 64] = d * sc[:, is_ + 4] * q3
            out[:, base + 96] = d * sc[:, is_ + 6] * q4
    return out


REFERENCE_DEQUANT = {
    Q.Q8_0: ref_q8_0,
    Q.Q4_0: ref_q4_0,
    Q.Q4_1: ref_q4_1,
    Q.Q4_K: ref_q4_k,
    Q.Q6_K: ref_q6_k,
}


@pytest.mark.parametrize("qtype", list(REFERENCE_DEQUANT), ids=lambda q: q.name)
def test_random_blocks_match_reference_dequantizer(tmp_path: Path, qtype: GGMLQuantizationType):
    raw, path = write_random_quant_model(tmp_path / "m.gguf", qtype, seed=1)
    block, size = GGML_QUANT_SIZES[qtype]

    loaded = load_model(path)

    for name, data in raw.items():
        rows = data.shape[0]
        blocks = data.reshape(-1, size)
        want = REFERENCE_DEQUANT[qtype](blocks).reshape(rows, -1)
        np.testing.assert_allclose(as_stored(loaded.model, name), want, rtol=1e-6, atol=1e-9)


def test_reference_q4_0_nibble_order():
    """Pin the reference itself on a hand-made block: low nibbles first, then high nibbles."""
    block = np.zeros((1, 18), dtype=np.uint8)
    block[0, 0:2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    block[0, 2:18] = np.arange(16, dtype=np.uint8) | (15 - np.arange(16, dtype=np.uint8)) << 4
    want = 0.5 * (np.concatenate([np.arange(16), 15 - np.arange(16)]) - 8)
    np.testing.assert_array_equal(ref_q4_0(block)[0], want)
    np.testing.assert_array_equal(dequantize(block, Q.Q4_0)[0], want)


# --------------------------------------------------------------------------------------------
# Unsupported quant types


@pytest.mark.parametrize("qtype", [Q.TQ1_0, Q.IQ2_XXS], ids=lambda q: q.name)
def test_unsupported_quant_type_is_rejected(tmp_path: Path, qtype: GGMLQuantizationType):
    hf_model = make_hf_model("llama", **WIDE)
    tensors: dict = dict(gguf_float_tensors(hf_model))
    w = tensors["blk.0.ffn_up.weight"]
    if qtype == Q.TQ1_0:
        tensors["blk.0.ffn_up.weight"] = (quantize(w, qtype), qtype)
    else:
        rng = np.random.default_rng(0)
        block, size = GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, size=(w.shape[0], w.shape[1] // block * size), dtype=np.uint8)
        tensors["blk.0.ffn_up.weight"] = (data, qtype)
    path = write_gguf(tmp_path / "m.gguf", hf_model.config, tensors)

    with pytest.raises(ValueError, match=qtype.name) as info:
        load_model(path)
    message = str(info.value)
    assert "blk.0.ffn_up.weight" in message
    for supported in SUPPORTED_GGML_TYPES:
        assert supported.name in message


# --------------------------------------------------------------------------------------------
# The embedded default model (SmolLM2-135M-Instruct, Q4_1) against transformers' GGUF loader

# "The capital of France is Paris. The capital of Germany is Berlin, and the capital of Italy is"
DEFAULT_MODEL_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 4521, 314, 11452, 28, 284, 260, 3575, 282, 7158, 314]  # fmt: skip
BERLIN = 11452


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    from kvserve.default_model import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))


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
