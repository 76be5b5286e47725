"""DeepseekConfig: the DeepSeek-V2 / V3 family's record (multi-head latent attention + MoE),
and MiniCPM3 (the same attention, dense MLPs, rotate-half rope, three scalings).

Built from a Hugging Face ``config.json`` dict (``from_hf``, transformers 4 and 5 spellings)
or GGUF metadata (``from_gguf``, llama.cpp's ``deepseek2`` keys). Field names follow
Hugging Face. No I/O. The engine, the loader and the planner read the same attributes as on
``ModelConfig`` (vocab_size, num_hidden_layers, max_model_len, attention_scale, eos / bos ids,
tie_word_embeddings); the rest is the model's own (models/deepseek.py).

Semantics are transformers' (``DeepseekV2Config`` / ``DeepseekV3Config`` and their models):

- a layer is mixture-of-experts when ``layer >= first_k_dense_replace`` (transformers ignores
  ``moe_layer_freq``; every released checkpoint has 1, and another value is refused here);
- V2's gate is a softmax over routed experts, top-k ``greedy`` or ``group_limited_greedy``
  (top ``topk_group`` groups by their best expert), weights x ``routed_scaling_factor``, no
  renormalisation; V3's is a sigmoid plus ``e_score_correction_bias`` for the choice only,
  groups ranked by their two best, weights renormalised when ``norm_topk_prob``;
- rotary covers only the ``qk_rope_head_dim`` part of q and k: interleaved pairs (V2 always,
  V3 when ``rope_interleave``), YaRN's ``attention_factor`` on cos / sin and
  ``mscale(factor, mscale_all_dim) ** 2`` on the softmax scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "minicpm3")
DEEPSEEK_ROPE_TYPES = ("default", "linear", "yarn", "longrope")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True, slots=True)
class DeepseekRope:
    """Rotary scaling of the rope part (HF ``rope_parameters``): default, linear or YaRN."""

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # None: from factor / mscale / mscale_all_dim
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None  # longrope (MiniCPM3): per-frequency divisors

    def __post_init__(self) -> None:
        if self.rope_type not in DEEPSEEK_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {self.rope_type!r} for DeepSeek; "
                f"supported: {', '.join(DEEPSEEK_ROPE_TYPES)}"
            )
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.rope_type in ("yarn", "longrope") and self.original_max_position_embeddings is None:
            raise ValueError(
                f"{self.rope_type} rope scaling needs original_max_position_embeddings"
            )
        if self.rope_type == "longrope" and not self.short_factor:
            raise ValueError("longrope rope scaling needs short_factor")

    @property
    def cos_sin_factor(self) -> float:
        """What cos and sin are multiplied by (HF's ``attention_scaling`` of the rotary)."""
        if self.rope_type == "longrope":
            if self.attention_factor is not None:
                return self.attention_factor
            if self.factor <= 1.0:
                return 1.0
            original = self.original_max_position_embeddings
            assert original is not None
            return math.sqrt(1 + math.log(self.factor) / math.log(original))
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_get_mscale(self.factor)

    @property
    def softmax_factor(self) -> float:
        """HF ``yarn_apply_mscale``: any non-default rope with ``mscale_all_dim`` scales the
        softmax by mscale(factor, mscale_all_dim) squared."""
        if self.rope_type != "default" and self.mscale_all_dim:
            m = yarn_get_mscale(self.factor, self.mscale_all_dim)
            return m * m
        return 1.0


@dataclass(frozen=True, slots=True)
class DeepseekConfig:
    """Invariants: ``n_routed_experts % n_group == 0`` when grouped; the rope dim is even."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: a plain q_proj
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope: DeepseekRope = field(default_factory=DeepseekRope)
    rope_interleave: bool = True
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # mixture of experts (n_routed_experts 0: every layer dense)
    n_routed_experts: int = 0
    num_experts_per_tok: int = 1
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    scoring_func: str = "softmax"  # V2 softmax, V3 sigmoid
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # MiniCPM3: embeddings x scale_emb, each residual branch x scale_depth / sqrt(layers), the
    # final hidden / (hidden_size / dim_model_base) before lm_head; 1.0 for DeepSeek
    scale_emb: float = 1.0
    residual_scale: float = 1.0
    logits_scaling: float = 1.0

    def __post_init__(self) -> None:
        if self.model_type not in DEEPSEEK_MODEL_TYPES:
            raise ValueError(
                f"unsupported DeepSeek model_type {self.model_type!r}; "
                f"supported: {', '.join(DEEPSEEK_MODEL_TYPES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        rope = self.rope
        if rope.rope_type == "longrope":
            # HF switches to long_factor once a sequence passes the original length: per
            # sequence, so cached keys would have been rotated with the other factors
            if self.max_position_embeddings > (rope.original_max_position_embeddings or 0):
                raise ValueError(
                    "longrope past original_max_position_embeddings (long_factor, chosen per "
                    "sequence length) is not supported; max_position_embeddings must be <= "
                    f"{rope.original_max_position_embeddings}"
                )
            if len(rope.short_factor or ()) != self.qk_rope_head_dim // 2:
                raise ValueError(f"short_factor needs {self.qk_rope_head_dim // 2} values")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank must be None or > 0, got {self.q_lora_rank}")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func must be softmax or sigmoid, got {self.scoring_func!r}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        if self.n_routed_experts:
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ValueError(
                    f"num_experts_per_tok must be in [1, {self.n_routed_experts}], got "
                    f"{self.num_experts_per_tok}"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError("moe_intermediate_size must be > 0 with routed experts")
            if self.n_group <= 0 or self.n_routed_experts % self.n_group:
                raise ValueError(
                    f"n_routed_experts ({self.n_routed_experts}) must be a multiple of "
                    f"n_group ({self.n_group})"
                )
            if self.scoring_func == "sigmoid" and self.n_routed_experts // self.n_group < 2:
                raise ValueError(
                    f"the V3 router ranks each group by its two best experts: n_routed_experts "
                    f"({self.n_routed_experts}) / n_group ({self.n_group}) must be >= 2"
                )
            if not 0 < self.topk_group <= self.n_group:
                raise ValueError(
                    f"topk_group must be in [1, {self.n_group}], got {self.topk_group}"
                )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        """The rotary dim (transformers sets ``head_dim = qk_rope_head_dim`` for MLA)."""
        return self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """One cached row per token and layer: the normalized latent plus the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def attention_scale(self) -> float:
        """qk_head_dim ** -0.5, times YaRN's mscale squared (HF ``yarn_apply_mscale``)."""
        return self.qk_head_dim**-0.5 * self.rope.softmax_factor

    @property
    def max_model_len(self) -> int:
        return self.max_position_embeddings

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> DeepseekConfig:
        """From a Hugging Face config.json dict (transformers 4.x and 5.x spellings)."""
        model_type = cfg.get("model_type")
        if model_type not in DEEPSEEK_MODEL_TYPES:
            raise ValueError(f"not a DeepSeek config: model_type={model_type!r}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be silu, got {cfg.get('hidden_act')!r}")
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported (no DeepSeek checkpoint uses it)")
        if model_type == "minicpm3":
            return _minicpm3_from_hf(cls, cfg)
        if cfg.get("moe_layer_freq", 1) != 1:
            raise ValueError(
                f"moe_layer_freq={cfg['moe_layer_freq']} is not supported: transformers ignores "
                "it (every layer from first_k_dense_replace is MoE), and kvserve follows it"
            )
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(rope_params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        if not rope_params:
            rope_params = dict(cfg.get("rope_scaling") or {})
        v3 = model_type == "deepseek_v3"
        experts = int(cfg.get("n_routed_experts") or 0)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            q_lora_rank=cfg.get("q_lora_rank"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope=_rope_from_dict(rope_params, cfg.get("max_position_embeddings", 2048)),
            # V2 rotates interleaved pairs always (its complex form); V3 when rope_interleave
            rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            n_routed_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 1),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
            first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
            scoring_func="sigmoid" if v3 else "softmax",
            topk_method="noaux_tc" if v3 else (cfg.get("topk_method") or "greedy"),
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            # transformers' V2 gate never renormalises (its checkpoints all say false)
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) if v3 else False,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _minicpm3_from_hf(cls, cfg: dict[str, Any]) -> DeepseekConfig:
    """MiniCPM3: DeepSeek-V2's attention (rotate-half rope), dense MLPs, three scalings."""
    hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    rope_params = dict(cfg.get("rope_parameters") or {})
    rope_theta = float(rope_params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if not rope_params:
        rope_params = dict(cfg.get("rope_scaling") or {})
    scale_depth = cfg.get("scale_depth", 1.4)
    scale_depth = math.sqrt(layers) if scale_depth is None else float(scale_depth)
    base = cfg.get("dim_model_base", 256) or hidden
    eos = cfg.get("eos_token_id")
    return cls(
        model_type="minicpm3",
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        kv_lora_rank=cfg.get("kv_lora_rank", 256),
        qk_nope_head_dim=cfg.get("qk_nope_head_dim", 64),
        qk_rope_head_dim=cfg.get("qk_rope_head_dim", 32),
        v_head_dim=cfg.get("v_head_dim") or hidden // heads,
        q_lora_rank=cfg.get("q_lora_rank", 768),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=rope_theta,
        rope=_rope_from_dict(rope_params, cfg.get("max_position_embeddings", 32768)),
        rope_interleave=False,  # HF MiniCPM3: apply_rotary_pos_emb (rotate-half)
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        scale_emb=float(cfg.get("scale_emb", 12)),
        residual_scale=scale_depth / math.sqrt(layers),
        logits_scaling=hidden / base,
    )


def _rope_from_dict(params: dict[str, Any], max_positions: int) -> DeepseekRope:
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return DeepseekRope()
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None and original:  # HF: DeepSeek-V3 may give the ratio instead
        factor = max_positions / original
    return DeepseekRope(
        rope_type=rope_type,
        factor=float(factor if factor is not None else 1.0),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
        short_factor=tuple(params["short_factor"]) if params.get("short_factor") else None,
    )
