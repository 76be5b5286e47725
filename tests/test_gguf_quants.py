"""GGUF quant types: quantized and random raw blocks decode exactly, unsupported types fail.

Quantized weights are checked against ``gguf.quants.dequantize`` and, for the common formats,
against an independent numpy dequantizer written here from ggml's C reference. Float GGUF
layout and the default model are tested in test_gguf.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    gguf_float_tensors,
    hf_logits,
    llama_cpp_permute,
    make_hf_model,
    random_token_ids,
    write_gguf,
)
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kvserve.models.gguf_checkpoint import SUPPORTED_GGML_TYPES
from kvserve.models.loader import load_model
from kvserve.models.packed_linear import dense_state_dict
from kvserve.reference.decoders import full_logits

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
