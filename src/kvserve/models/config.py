"""ModelConfig: one normalised, validated record for every supported architecture.

Built from a Hugging Face ``config.json`` dict (``from_hf``) or from GGUF metadata
(``from_gguf``). Field names follow Hugging Face. No I/O happens here: callers read the
files and pass plain dicts in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# model_type (HF) -> architecture family handled by models/llama.py. They differ only by flags.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary-embedding scaling, Hugging Face ``rope_parameters`` / ``rope_scaling`` semantics."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {self.rope_type!r}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and self.original_max_position_embeddings is None:
            raise ValueError("llama3 rope scaling needs original_max_position_embeddings")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the model code needs to know about a checkpoint.

    Invariants: ``num_attention_heads % num_key_value_heads == 0``; ``head_dim`` is explicit
    (it may differ from ``hidden_size // num_attention_heads``, as in Qwen3).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2 always, Llama optional)
    o_proj_bias: bool = False  # bias on o_proj too (HF Llama / Qwen3 attention_bias=True)
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3)
    # the window of the "sliding_attention" layers (HF's rule: the query at q sees keys
    # q - sliding_window < k <= q); ``layer_types`` says which layers slide ("full_attention"
    # / "sliding_attention", transformers' spelling); empty: every layer full attention
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture {self.model_type!r}; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for "
                    f"{self.num_hidden_layers} layers"
                )
            bad = set(self.layer_types) - set(LAYER_TYPES)
            if bad:
                raise ValueError(
                    f"unsupported layer_types {sorted(bad)}; supported: {', '.join(LAYER_TYPES)}"
                )
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("sliding_attention layers need sliding_window")
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window <= 0
        ):
            raise ValueError(
                f"sliding_window must be a positive integer, got {self.sliding_window!r}"
            )

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, or None for full attention."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def attention_scale(self) -> float:
        """The softmax scale every attention backend uses: head_dim ** -0.5 (HF's default)."""
        return self.head_dim**-0.5

    @property
    def max_model_len(self) -> int:
        """The context the checkpoint was trained for (windowed layers included: they attend
        their window at every position, as the checkpoint was trained)."""
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json dict (transformers 4.x and 5.x spellings)."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = cfg.get("architectures")
            raise ValueError(
                f"unsupported architecture model_type={model_type!r} (architectures={archs}); "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        # transformers 5 folds rope_theta into rope_parameters; 4.x has rope_theta + rope_scaling.
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(rope_params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        if not rope_params:
            rope_params = dict(cfg.get("rope_scaling") or {})
        rope_scaling = _rope_from_dict(rope_params)
        sliding, layer_types = _sliding_layers(model_type, cfg)
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported (no supported checkpoint uses it)")
        # HF: Qwen2 always has q/k/v bias and no o_proj bias; Llama and Qwen3 put a bias on
        # q/k/v/o when attention_bias is set; Mistral never has one.
        flag = model_type in ("llama", "qwen3", "smollm") and bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or flag,
            o_proj_bias=flag,
            qk_norm=model_type == "qwen3",
            sliding_window=sliding,
            layer_types=layer_types,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        """From GGUF metadata (``general.architecture`` and ``{arch}.*`` keys) and tensor names."""
        arch = meta.get("general.architecture")
        if arch not in ("llama", "qwen2", "qwen3"):
            raise ValueError(
                f"unsupported GGUF architecture {arch!r}; supported: llama, qwen2, qwen3 "
                "(Mistral and SmolLM files use 'llama')"
            )

        def key(suffix: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{suffix}", default)

        heads = int(key("attention.head_count"))
        kv_heads = int(key("attention.head_count_kv", heads))
        hidden = int(key("embedding_length"))
        head_dim = int(key("attention.key_length", hidden // heads))
        vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        if not vocab:
            raise ValueError("GGUF file has neither {arch}.vocab_size nor a tokenizer vocabulary")
        scaling_type = key("rope.scaling.type", "none")
        if "rope_freqs.weight" in tensor_names:
            # llama.cpp stores Llama 3.1 scaling as precomputed per-frequency factors; the
            # loader reads them from that tensor, so the config keeps the default formula.
            rope_scaling = RopeScaling()
        elif scaling_type in ("none", None):
            rope_scaling = RopeScaling()
        elif scaling_type == "linear":
            rope_scaling = RopeScaling("linear", float(key("rope.scaling.factor")))
        else:
            raise ValueError(
                f"unsupported GGUF rope scaling {scaling_type!r}; supported: none, linear, "
                "llama3 (as a rope_freqs tensor)"
            )
        eos = meta.get("tokenizer.ggml.eos_token_id")
        window = key("attention.sliding_window")
        layers = int(key("block_count"))
        return cls(
            model_type="llama" if arch == "llama" else arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            o_proj_bias="blk.0.attn_output.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            # llama.cpp writes one window for the model: every layer slides (Mistral v0.1)
            sliding_window=int(window) if window else None,
            layer_types=("sliding_attention",) * layers if window else (),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )


def _sliding_layers(model_type: str, cfg: dict[str, Any]) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) as transformers reads them: Mistral's ``sliding_window``
    slides every layer; Qwen2/3's only with ``use_sliding_window``, the layers from
    ``max_window_layers`` on; an explicit ``layer_types`` list wins. A "sliding_attention"
    layer with no window is full attention (HF's attention reads ``sliding_window`` None)."""
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window"):
        window = None
    if model_type not in ("mistral", "qwen2", "qwen3") and "layer_types" not in cfg:
        window = None  # Llama and SmolLM configs may carry a sliding_window they never use
    if window is None:
        return None, ()
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        if model_type == "mistral":
            types = ["sliding_attention"] * n
        else:
            first = cfg.get("max_window_layers", 0) or 0
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    types = tuple(types)
    if "sliding_attention" not in types:
        return None, ()
    return int(window), types


def _rope_from_dict(params: dict[str, Any]) -> RopeScaling:
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return RopeScaling()
    return RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
    )
