"""DeepSeek-V2 / V3 from GGUF (llama.cpp's ``deepseek2`` architecture).

llama.cpp's converter (convert_hf_to_gguf.py ``DeepseekV2Model``) writes, per layer:

    attn_q | attn_q_a, attn_q_a_norm, attn_q_b      q_proj | q_a_proj, q_a_layernorm, q_b_proj
    attn_kv_a_mqa, attn_kv_a_norm                    kv_a_proj_with_mqa, kv_a_layernorm
    attn_k_b (heads, rank, nope) + attn_v_b (heads, v, rank)   kv_b_proj, split per head, the
        K half transposed (older files: attn_kv_b, kv_b_proj as is)
    ffn_gate_inp, exp_probs_b.bias                   mlp.gate.weight, e_score_correction_bias
    ffn_{gate,up,down}_exps (experts, out, in)       mlp.experts.{e}.*_proj (stacked)
    ffn_{gate,up,down}_shexp                         mlp.shared_experts.*_proj

and no rotary permutation (DeepSeek's rope pairs are interleaved on both sides). Metadata:
``attention.key_length`` / ``value_length`` are the MQA view (rank + rope, rank) in new files,
``key_length_mla`` / ``value_length_mla`` the per-head dims; the router from
``expert_gating_func`` (1 softmax: V2, 2 sigmoid: V3); YaRN's ``mscale_all_dim`` from
``rope.scaling.yarn_log_multiplier / 0.1`` and, as GGUF keeps no separate ``mscale``, mscale
taken equal to it (true of DeepSeek-V2, V2-Lite and V3: the cos/sin factor is then 1).

The stacked experts, the kv_b halves and the router are dequantized (they are not plain
linears here); every other 2-D weight in a HELD_QUANTIZED format stays quantized.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from kvserve.models.deepseek_config import DeepseekConfig, DeepseekRope
from kvserve.models.gguf_header import GgufHeader

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
_EXPERTS = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}
_KV_B_HALVES = ("attn_k_b.weight", "attn_v_b.weight")
_ALWAYS_FLOAT = ("attn_kv_b.weight", "ffn_gate_inp.weight", *_KV_B_HALVES, *_EXPERTS)
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def deepseek_config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> DeepseekConfig:
    def key(suffix: str, default: Any = None) -> Any:
        return meta.get(f"deepseek2.{suffix}", default)

    layers = int(key("block_count"))
    rank = int(key("attention.kv_lora_rank"))
    rope_dim = int(key("rope.dimension_count"))
    if key("attention.key_length_mla") is not None:
        qk, v = int(key("attention.key_length_mla")), int(key("attention.value_length_mla"))
    else:  # older files: key_length / value_length are the per-head dims
        qk, v = int(key("attention.key_length")), int(key("attention.value_length"))
    experts = int(key("expert_count", 0) or 0)
    sigmoid = int(key("expert_gating_func", 1) or 1) == 2
    groups, used_groups = (
        int(key("expert_group_count", 1) or 1),
        int(key("expert_group_used_count", 1) or 1),
    )
    scaling = key("rope.scaling.type", "none")
    rope = DeepseekRope()
    if scaling == "yarn":
        log_mul = key("rope.scaling.yarn_log_multiplier")
        mscale_all = None if log_mul is None else float(log_mul) / 0.1
        rope = DeepseekRope(
            "yarn",
            float(key("rope.scaling.factor")),
            int(key("rope.scaling.original_context_length")),
            float(key("rope.scaling.yarn_beta_fast", 32.0)),
            float(key("rope.scaling.yarn_beta_slow", 1.0)),
            mscale=mscale_all,
            mscale_all_dim=mscale_all,
        )
    elif scaling not in ("none", None):
        raise ValueError(f"unsupported GGUF rope scaling {scaling!r} for deepseek2")
    vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    q_lora = key("attention.q_lora_rank")
    return DeepseekConfig(
        model_type="deepseek_v3" if sigmoid else "deepseek_v2",
        vocab_size=int(vocab),
        hidden_size=int(key("embedding_length")),
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=int(key("attention.head_count")),
        kv_lora_rank=rank,
        qk_nope_head_dim=qk - rope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=v,
        q_lora_rank=None if q_lora is None else int(q_lora),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope=rope,
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        n_routed_experts=experts,
        num_experts_per_tok=int(key("expert_used_count", 1) or 1),
        n_shared_experts=int(key("expert_shared_count", 0) or 0),
        moe_intermediate_size=int(key("expert_feed_forward_length", 0) or 0),
        first_k_dense_replace=int(key("leading_dense_block_count", 0) or 0),
        scoring_func="sigmoid" if sigmoid else "softmax",
        topk_method="noaux_tc" if sigmoid else ("group_limited_greedy" if groups > 1 else "greedy"),
        n_group=groups,
        topk_group=used_groups,
        routed_scaling_factor=float(key("expert_weights_scale", 1.0) or 1.0),
        norm_topk_prob=bool(key("expert_weights_norm", False)) if sigmoid else False,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def iter_deepseek_gguf_tensors(
    reader: GgufHeader, config: DeepseekConfig, keep_quantized: bool, quantized_type, dequantize
) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) pairs; ``quantized_type(data, qtype, shape)`` wraps a block-format
    weight (gguf_checkpoint.QuantizedTensor), ``dequantize(name, data, qtype)`` the rest."""
    from kvserve.models.gguf_checkpoint import HELD_QUANTIZED
    from kvserve.models.gguf_transcode import TRANSCODED, transcode

    halves: dict[tuple[int, str], np.ndarray] = {}
    for t in reader.tensors:
        qtype = GGMLQuantizationType(t.tensor_type)
        shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dims innermost first
        m = _LAYER_RE.match(t.name)
        local = m.group(2) if m else t.name
        if (
            keep_quantized
            and qtype in HELD_QUANTIZED
            and len(shape) == 2
            and local not in _ALWAYS_FLOAT
        ):
            rows, held = np.asarray(t.data), int(qtype)
            if qtype in TRANSCODED:
                rows, held = transcode(rows, qtype)
            data = torch.from_numpy(np.array(rows, dtype=np.uint8, order="C", copy=True))
            yield _hf_name(t.name), quantized_type(data, held, (shape[0], shape[1]))
            continue
        w = dequantize(t.name, t.data, qtype).reshape(shape)
        if m and local in _EXPERTS:  # (experts, out, in) -> one weight per expert
            for e in range(w.shape[0]):
                name = f"model.layers.{m.group(1)}.mlp.experts.{e}.{_EXPERTS[local]}.weight"
                yield name, _tensor(w[e])
            continue
        if m and local in _KV_B_HALVES:
            layer = int(m.group(1))
            halves[(layer, local)] = w
            if (layer, _KV_B_HALVES[0]) not in halves or (layer, _KV_B_HALVES[1]) not in halves:
                continue  # the other half comes later
            k_b, v_b = halves.pop((layer, _KV_B_HALVES[0])), halves.pop((layer, _KV_B_HALVES[1]))
            # k_b (heads, rank, nope) -> (heads, nope, rank); v_b (heads, v, rank): per head
            # [W_UK; W_UV] rows, as HF's kv_b_proj (heads x (nope + v), rank)
            kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
            yield (
                f"model.layers.{layer}.self_attn.kv_b_proj.weight",
                _tensor(kv_b.reshape(-1, kv_b.shape[-1])),
            )
            continue
        yield _hf_name(t.name), _tensor(w)
    if halves:
        raise ValueError(f"GGUF has attn_k_b / attn_v_b without its other half: {sorted(halves)}")


def _hf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    raise ValueError(f"unexpected deepseek2 GGUF tensor {name!r}: no Hugging Face name known")


def _tensor(w: np.ndarray) -> torch.Tensor:
    # the data are read-only views of the memory-mapped file: copy before torch owns them
    return torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))
