"""The Llama family: Llama 1/2/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM.

They differ only by ModelConfig flags (qkv bias, q/k norm, tied embeddings, rope scaling,
GQA/MQA, explicit head_dim). Module names equal the Hugging Face weight names, so loading is
a lookup. Tokens are flattened: a forward pass takes (T,) token ids and (T,) positions and the
attention backend decides which earlier K/V each token sees.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kvserve.attention.backend import AttentionBackend
from kvserve.kv.cache_dtype import CacheDtype
from kvserve.kv.spec import KVCacheSpec
from kvserve.models.config import ModelConfig
from kvserve.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # q, k and v in one matmul (vLLM's QKVParallelLinear), set by weight_formats.py where
        # the three weights share a quantized format; q_proj / k_proj / v_proj then view its rows
        self.qkv_proj: nn.Module | None = None

    def project(
        self,
        x: torch.Tensor,  # (T, hidden), already normalized
        cos: torch.Tensor,  # (T, 1, head_dim)
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (T, heads, head_dim) and k, v (T, kv_heads, head_dim), q and k rotated."""
        t = x.shape[0]
        if self.qkv_proj is not None:
            kv_width = self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split(
                [self.num_heads * self.head_dim, kv_width, kv_width], -1
            )
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    # The layer in two halves around attention, so that each half can be compiled (fused
    # norms, rotary, activations around the opaque matmul ops) while attention -- which reads
    # and writes the cache through a backend object -- stays outside the compiled graphs.
    def before_attention(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Residual stream x (T, hidden) -> q, k, v of this layer."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def after_attention(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual stream x (T, hidden), attention output (T, heads, head_dim) -> new x."""
        x = x + self.self_attn.o_proj(attn_out.reshape(x.shape[0], -1))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x, cos, sin, attn: AttentionBackend) -> torch.Tensor:
        q, k, v = self.before_attention(x, cos, sin)
        return self.after_attention(x, attn(self.self_attn.layer_idx, q, k, v))


@dataclass(slots=True)
class LayerSteps:
    """The two halves every decoder layer runs: eager methods, or their compiled versions."""

    before_attention: Callable
    after_attention: Callable


EAGER_STEPS = LayerSteps(LlamaDecoderLayer.before_attention, LlamaDecoderLayer.after_attention)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # no random init: the checkpoint fills it (built on meta, nn.Embedding's normal_ goes
        # through torch._refs and imports torch._dynamo: ~2 s of every start)
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class LlamaForCausalLM(nn.Module):
    """forward(token ids, positions, attention backend) -> hidden; compute_logits(hidden)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # engine/compiled_steps.py's CompileResult once an engine compiled (and checked) this
        # model's layer steps: later engines in the process reuse it instead of tracing again
        self.compiled_steps = None

    @property
    def dtype(self) -> torch.dtype:
        """The activation (and KV cache) dtype; weights may be quantized whatever it is."""
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        steps: LayerSteps = EAGER_STEPS,
    ) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, hidden).

        ``steps``: the layer halves to run (eager, or compiled by engine/compiled_steps.py).
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        before, after = steps.before_attention, steps.after_attention
        for layer in self.model.layers:
            q, k, v = before(layer, x, cos, sin)
            x = after(layer, x, attn(layer.self_attn.layer_idx, q, k, v))
        return self.model.norm(x)

    def kv_cache_spec(
        self,
        k_dtype: CacheDtype | None = None,
        v_dtype: CacheDtype | None = None,
        block_size: int = 16,
        streaming: tuple[int, int] | None = None,
    ) -> KVCacheSpec:
        """The cache this model needs, one spec per layer (see ``kv_cache_spec``); K and V in
        the model's own dtype (the exact cache) unless given."""
        exact = CacheDtype.of(self.dtype)
        return kv_cache_spec(self.config, k_dtype or exact, v_dtype or exact, block_size, streaming)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32 logits (matmul in the model dtype, as HF)."""
        return self.lm_head(hidden).float()


def kv_cache_spec(
    config: ModelConfig,
    k_dtype: CacheDtype,
    v_dtype: CacheDtype,
    block_size: int = 16,
    streaming: tuple[int, int] | None = None,
) -> KVCacheSpec:
    """One spec per layer: full attention over its KV heads, or the checkpoint's sliding
    window (``ModelConfig.layer_window``). ``streaming`` = (sinks, window): the StreamingLLM
    policy, every full-attention layer becomes a window of that many tokens plus the sinks
    (lossy; the checkpoint's own windows stay as they are)."""
    windows = [config.layer_window(i) for i in range(config.num_hidden_layers)]
    return KVCacheSpec.for_layers(
        config.num_key_value_heads,
        config.head_dim,
        k_dtype,
        v_dtype,
        block_size,
        windows,
        streaming,
    )


MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "smollm": LlamaForCausalLM,
}
