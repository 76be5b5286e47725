"""DeepSeek-V2 / V3 from GGUF (``deepseek2``): tiny random HF models written the way
llama.cpp's convert_hf_to_gguf.py (``DeepseekV2Model``) writes them -- MQA-view key / value
lengths plus the per-head ``*_mla`` ones, experts stacked into 3-D ``ffn_*_exps``, kv_b_proj
split into ``attn_k_b`` (K half transposed) and ``attn_v_b`` (or one ``attn_kv_b`` as older
files have it), the V3 bias as ``exp_probs_b.bias`` -- loaded by kvserve and compared with
transformers' logits of the same model. The writer follows the converter's source; no
llama.cpp binary checks these files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import hf_logits, random_token_ids
from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from test_deepseek_parity import MLA, MOE, make_deepseek_checkpoint

from kvserve.models.deepseek import DeepseekForCausalLM
from kvserve.models.loader import load_model
from kvserve.models.quantized_linear import QuantizedLinear
from kvserve.reference.decoders import full_logits

LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def converted_tensors(ckpt: Path, cfg, split_kv_b: bool) -> dict[str, np.ndarray]:
    """The checkpoint's tensors (per-expert, as saved) under llama.cpp's names and layouts."""
    from safetensors.numpy import load_file

    state = load_file(str(ckpt / "model.safetensors"))
    out: dict[str, np.ndarray] = {}
    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, gg in LAYER.items():
            if p + hf in state:
                out[f"blk.{i}.{gg}"] = state.pop(p + hf)
        kv_b = state.pop(p + "self_attn.kv_b_proj.weight")
        if split_kv_b:
            kv_b = kv_b.reshape(heads, nope + v, -1)
            out[f"blk.{i}.attn_k_b.weight"] = np.ascontiguousarray(
                kv_b[:, :nope].transpose(0, 2, 1)
            )
            out[f"blk.{i}.attn_v_b.weight"] = np.ascontiguousarray(kv_b[:, nope:])
        else:
            out[f"blk.{i}.attn_kv_b.weight"] = kv_b
        if cfg.n_routed_experts and i >= cfg.first_k_dense_replace:
            for w in ("gate", "up", "down"):
                names = [f"{p}mlp.experts.{e}.{w}_proj.weight" for e in range(cfg.n_routed_experts)]
                out[f"blk.{i}.ffn_{w}_exps.weight"] = np.stack([state.pop(n) for n in names])
    for hf, gg in GLOBAL.items():
        out[gg] = state.pop(hf)
    assert not state, sorted(state)
    return out


def write_deepseek2_gguf(path: Path, cfg, tensors, split_kv_b: bool, q8: bool = False) -> Path:
    w = GGUFWriter(path, "deepseek2")
    rank, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1)  # the converter's MQA view of MLA
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(rank)
    if split_kv_b:
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + rope)
        w.add_value_length_mla(cfg.v_head_dim)
    else:  # older files: the per-head dims
        w.add_key_length(cfg.qk_nope_head_dim + rope)
        w.add_value_length(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.n_routed_experts)
    if cfg.num_experts_per_tok is not None:
        w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    sigmoid = cfg.model_type == "deepseek_v3"
    if sigmoid and cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(
        ExpertGatingFuncType.SIGMOID if sigmoid else ExpertGatingFuncType.SOFTMAX
    )
    if sigmoid:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    w.add_rope_dimension_count(rope)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    for name, t in tensors.items():
        t = t.astype(np.float32)
        if q8 and t.ndim in (2, 3) and t.shape[-1] % 32 == 0 and "norm" not in name:
            data = quantize(t, GGMLQuantizationType.Q8_0)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


CASES = [
    pytest.param("deepseek_v2", {**MLA, **MOE, "q_lora_rank": 48}, True, id="v2-moe-split-kv-b"),
    pytest.param("deepseek_v2", {**MLA, "first_k_dense_replace": 3}, False, id="v2-dense-kv-b"),
    pytest.param(
        "deepseek_v3", {**MLA, **MOE, "n_group": 2, "topk_group": 1}, True, id="v3-sigmoid"
    ),
]


@pytest.mark.parametrize(("model_type", "overrides", "split"), CASES)
def test_gguf_matches_transformers(tmp_path: Path, model_type, overrides, split) -> None:
    ckpt, hf = make_deepseek_checkpoint(tmp_path, model_type, **overrides)
    path = write_deepseek2_gguf(
        tmp_path / "m.gguf", hf.config, converted_tensors(ckpt, hf.config, split), split
    )
    loaded = load_model(path, dtype="float32")
    assert isinstance(loaded.model, DeepseekForCausalLM) and loaded.gguf_file == path
    assert loaded.config.model_type == model_type
    ids = random_token_ids(48)
    torch.testing.assert_close(
        full_logits(loaded.model, ids), hf_logits(hf, ids), atol=2e-4, rtol=0
    )


def test_q8_0_gguf_keeps_linears_quantized(tmp_path: Path) -> None:
    ckpt, hf = make_deepseek_checkpoint(tmp_path, "deepseek_v2", **MLA, **MOE)
    tensors = converted_tensors(ckpt, hf.config, True)
    path = write_deepseek2_gguf(tmp_path / "q8.gguf", hf.config, tensors, True, q8=True)
    model = load_model(path, dtype="float32").model
    attn, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert isinstance(attn.kv_a_proj_with_mqa, QuantizedLinear)
    assert isinstance(moe.shared_experts.down_proj, QuantizedLinear)
    assert moe.gate.weight.dtype == torch.float32  # the router and kv_b stay float
    assert not isinstance(attn.kv_b_proj, QuantizedLinear)
    # the truth: the same Q8_0 values dequantized into an F32 file (weights equal, so only
    # the kernel's arithmetic differs)
    rounded = {
        n: dequantize(quantize(t, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
        if t.ndim in (2, 3) and t.shape[-1] % 32 == 0 and "norm" not in n
        else t
        for n, t in tensors.items()
    }
    ref_path = write_deepseek2_gguf(tmp_path / "ref.gguf", hf.config, rounded, True)
    ref = load_model(ref_path, dtype="float32").model
    ids = random_token_ids(32)
    torch.testing.assert_close(full_logits(model, ids), full_logits(ref, ids), atol=1e-3, rtol=0)
