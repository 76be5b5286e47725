"""The DeepSeek-V2 / V3 family (and MiniCPM3): multi-head latent attention (MLA) and
mixture-of-experts.

Per token and layer, attention caches one row: the normalized latent ``c_kv``
(``kv_lora_rank`` values) and the rotated rope key (``qk_rope_head_dim``), not K and V per
head. Keys and values are ``kv_b_proj`` of the latent, per head:

    kv_a_proj_with_mqa(x) = [c_kv | k_pe]       (T, kv_lora_rank + rope)
    kv_b_proj(norm(c_kv)) = [k_nope | v] per head  (T, heads, nope + v_head_dim)
    k = [k_nope | rope(k_pe)] (k_pe shared by all heads),  q = [q_nope | rope(q_pe)]

The layer hands q and the latent row to the backend's ``mla`` entry point with the two halves
of ``kv_b_proj`` (attention/mla.py ``MLAWeights``); the backend caches the row and either
expands it (prefill, the reference decoders) or absorbs ``W_UK`` into the query and attends
over the latent as one shared head (the engine's decodes). Module names equal the Hugging
Face weight names; the layers run eager (no compiled or fused step: engine/compiled_steps.py,
engine/fused_decode.py decline this class).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention.mla import MLAWeights
from kvserve.kv.cache_dtype import CacheDtype
from kvserve.kv.spec import KVCacheSpec, MLASpec
from kvserve.models.deepseek_config import DeepseekConfig
from kvserve.models.deepseek_moe import DeepseekMoE
from kvserve.models.deepseek_rope import DeepseekRotary, apply_deepseek_rotary
from kvserve.models.layers import GatedMLP, RMSNorm


class LatentUpProjection(nn.Module):
    """``kv_b_proj``: (heads x (nope + v), kv_lora_rank). A bare weight, not an ``nn.Linear``,
    so weight_formats.py leaves it dense: attention reads its two halves as matrices."""

    def __init__(self, rank: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class DeepseekAttention(nn.Module):
    def __init__(self, config: DeepseekConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = h = config.num_attention_heads
        self.nope, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim, self.rank = config.v_head_dim, config.kv_lora_rank
        self.interleaved = config.rope_interleave
        hidden, bias, qk = config.hidden_size, config.attention_bias, config.qk_head_dim
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, h * qk, bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6)  # HF: the default eps
            self.q_b_proj = nn.Linear(config.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = LatentUpProjection(self.rank, h * (self.nope + self.v_head_dim))
        self.o_proj = nn.Linear(h * self.v_head_dim, hidden, bias=bias)

    def mla_weights(self) -> MLAWeights:
        """W_UK (heads, nope, rank) and W_UV (heads, v, rank): views of kv_b_proj's rows."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_head_dim, self.rank)
        return MLAWeights(w[:, : self.nope], w[:, self.nope :])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        """x (T, hidden), already normalized -> attention output projected (T, hidden)."""
        t = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.nope + self.rope_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        q_pe = apply_deepseek_rotary(q_pe, cos, sin, self.interleaved)
        k_pe = apply_deepseek_rotary(k_pe[:, None, :], cos, sin, self.interleaved)[:, 0]
        latent = torch.cat((self.kv_a_layernorm(c_kv), k_pe), dim=-1)  # (T, rank + rope)
        out = attn.mla(self.layer_idx, q_nope, q_pe, latent, self.mla_weights())  # (T, H, v)
        return self.o_proj(out.reshape(t, -1))


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: DeepseekConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DeepseekAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_scale = config.residual_scale  # MiniCPM3's scale_depth / sqrt(layers)
        if config.is_moe_layer(layer_idx):
            self.mlp: nn.Module = DeepseekMoE(config)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, cos, sin, attn) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, attn)
        x = x + (h if self.residual_scale == 1.0 else h * self.residual_scale)
        h = self.mlp(self.post_attention_layernorm(x))
        return x + (h if self.residual_scale == 1.0 else h * self.residual_scale)


class DeepseekModel(nn.Module):
    def __init__(self, config: DeepseekConfig) -> None:
        super().__init__()
        # no random init: the checkpoint fills it (built on meta, nn.Embedding's normal_ goes
        # through torch._refs and imports torch._dynamo: ~2 s of every start)
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = DeepseekRotary(config)


class DeepseekForCausalLM(nn.Module):
    """forward(token ids, positions, attention backend) -> hidden; compute_logits(hidden).

    The backend must have the ``mla`` entry point (NoCacheAttention, DenseAttention,
    PagedAttention do)."""

    # checkpoint tensors the router keeps in float32 whatever the model dtype (as HF)
    float32_params = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")

    def __init__(self, config: DeepseekConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """DeepSeek-V3's multi-token-prediction layers (``model.layers.{num_hidden_layers}``
        on) are not part of the causal LM; transformers skips them too."""
        prefix = "model.layers."
        if not name.startswith(prefix):
            return False
        index = name[len(prefix) :].split(".", 1)[0]
        return index.isdigit() and int(index) >= self.config.num_hidden_layers

    def init_buffers(self, device: torch.device) -> None:
        self.model.rotary_emb.reset(device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn, steps=None
    ) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, hidden). ``steps`` is
        accepted for the runner's call and ignored: these layers always run eager."""
        x = self.model.embed_tokens(input_ids)
        if self.config.scale_emb != 1.0:  # MiniCPM3 (HF: the scale cast to the weights' dtype)
            x = x * torch.tensor(self.config.scale_emb, dtype=x.dtype)
        cos, sin = self.model.rotary_emb(positions)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn)
        return self.model.norm(x)

    def kv_cache_spec(
        self,
        k_dtype: CacheDtype | None = None,
        v_dtype: CacheDtype | None = None,
        block_size: int = 16,
        streaming: tuple[int, int] | None = None,
    ) -> KVCacheSpec:
        """Every layer caches one latent row per token (``MLASpec``), in the model's dtype
        unless given (fp8_e4m3: the latent part only, the rope key in the model's dtype). K and
        V are not stored apart, so a K/V pair of dtypes must be equal. The StreamingLLM policy
        (``streaming``) is not implemented for latent layers: refused."""
        if streaming is not None:
            raise ValueError(
                "--streaming-window is not supported for latent-attention (MLA) models"
            )
        exact = CacheDtype.of(self.dtype)
        return deepseek_kv_cache_spec(
            self.config, k_dtype or exact, v_dtype or exact, block_size, rope_dtype=exact
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.config.logits_scaling != 1.0:  # MiniCPM3: hidden / (hidden / dim_model_base)
            hidden = hidden / self.config.logits_scaling
        return self.lm_head(hidden).float()


def deepseek_kv_cache_spec(
    config: DeepseekConfig,
    k_dtype: CacheDtype,
    v_dtype: CacheDtype,
    block_size: int = 16,
    rope_dtype: CacheDtype | None = None,
) -> KVCacheSpec:
    """``rope_dtype``: where the latent is fp8_e4m3, the float dtype of the rope key (the
    model's; default bfloat16)."""
    if k_dtype != v_dtype:
        raise ValueError(
            f"an MLA cache holds one latent row per token, not K and V apart: give one cache "
            f"dtype, got K {k_dtype.name} and V {v_dtype.name}"
        )
    layer = MLASpec(
        config.kv_lora_rank,
        config.qk_rope_head_dim,
        k_dtype,
        block_size,
        num_heads=config.num_attention_heads,
        qk_nope_head_dim=config.qk_nope_head_dim,
        v_head_dim=config.v_head_dim,
        rope_dtype=(rope_dtype or CacheDtype("bfloat16")) if k_dtype.is_quantized else None,
    )
    return KVCacheSpec.uniform(config.num_hidden_layers, layer)


DEEPSEEK_REGISTRY: dict[str, type[nn.Module]] = {
    "deepseek_v2": DeepseekForCausalLM,
    "deepseek_v3": DeepseekForCausalLM,
    "minicpm3": DeepseekForCausalLM,  # DeepSeek-V2 attention, dense MLPs, config scalings
}
