"""MLASpec: what a multi-head latent attention layer (DeepSeek-V2/V3) caches per token.

Beside kv/spec.py's attention specs, with the same interface (bytes per token and block,
``first_needed_block`` / ``max_blocks``, ``tensor_shape``, ``describe``); kv/spec.py
re-exports it as part of ``LayerSpec``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvserve.kv.cache_dtype import CacheDtype


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class MLASpec:
    """A multi-head latent attention layer (DeepSeek-V2/V3): one row per token, the
    normalized latent (``kv_lora_rank``) and the rotated rope key (``qk_rope_head_dim``),
    shared by every head (storage: kv/latent_storage.py).

        bytes per token of a layer = (kv_lora_rank + qk_rope_head_dim) x bytes per element

    ``num_heads``, ``qk_nope_head_dim``, ``v_head_dim`` only size the multi-head cache the same
    model would need (``mha_equivalent_bytes_per_token``: heads x (nope + rope + v)), for
    reports. ``dtype`` is a float dtype, or ``fp8_e4m3`` for the latent part only (one float16
    scale per token) with the rope key kept in ``rope_dtype`` (a float dtype), as FlashMLA keeps
    its rope part in full precision: rank + 2 + rope x 2 bytes with a bfloat16 rope
    (DeepSeek-V3: 642). ``k_dtype`` and ``v_dtype`` both name ``dtype``, so code that asks a
    spec for its cache dtype works.
    """

    kind: ClassVar[str] = "mla"
    sliding_window: ClassVar[None] = None  # every earlier token is attended (no window)
    num_sinks: ClassVar[int] = 0
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: CacheDtype
    block_size: int = 16
    num_heads: int = 1
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_dtype: CacheDtype | None = None  # the rope key's float dtype when dtype is fp8

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "block_size", "num_heads"):
            _positive(name, getattr(self, name))
        if not isinstance(self.dtype, CacheDtype):
            raise TypeError(f"dtype must be CacheDtype, got {self.dtype!r}")
        if self.dtype.is_quantized:
            if self.dtype.name != "fp8_e4m3":
                raise ValueError(
                    f"the latent cache cannot be {self.dtype.name}; the MLA cache is a "
                    "float dtype (float32, bfloat16, float16) or fp8_e4m3"
                )
            if self.rope_dtype is None or self.rope_dtype.is_quantized:
                raise ValueError("an fp8_e4m3 latent needs a float rope_dtype for the rope key")
        elif self.rope_dtype is not None and self.rope_dtype != self.dtype:
            raise ValueError("rope_dtype differs from dtype only for an fp8_e4m3 latent")

    def first_needed_block(self, num_computed: int) -> int:
        """Blocks before this one are never read again: none (every token stays visible)."""
        return 0

    def max_blocks(self, num_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds in this layer's group."""
        return -(-num_tokens // self.block_size)

    @property
    def tensor_shape(self) -> tuple:
        """What the storage allocates per layer (layers whose shapes agree can share)."""
        return (self.kind, self.kv_lora_rank, self.qk_rope_head_dim, self.dtype, self.rope_dtype)

    @property
    def k_dtype(self) -> CacheDtype:
        return self.dtype

    @property
    def v_dtype(self) -> CacheDtype:
        return self.dtype

    @property
    def width(self) -> int:
        """Values per cached row: kv_lora_rank + qk_rope_head_dim (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def bytes_per_token(self) -> int:
        if self.dtype.is_quantized:  # fp8 codes + scale, the rope key in its float dtype
            assert self.rope_dtype is not None
            rope = self.rope_dtype.bytes_per_head(self.qk_rope_head_dim)
            return self.dtype.bytes_per_head(self.kv_lora_rank) + rope
        return self.dtype.bytes_per_head(self.width)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def mha_equivalent_bytes_per_token(self) -> int:
        """What a multi-head cache of K (nope + rope) and V per head would take, same dtype."""
        per_head = self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim
        return self.num_heads * self.dtype.bytes_per_head(per_head)

    def describe(self) -> str:
        rope = "" if self.rope_dtype in (None, self.dtype) else f", rope {self.rope_dtype.name}"
        return (
            f"{self.kind} (latent {self.kv_lora_rank} + rope {self.qk_rope_head_dim}, "
            f"{self.dtype.name}{rope}; {self.bytes_per_token:,} B/token/layer vs "
            f"{self.mha_equivalent_bytes_per_token:,} as MHA)"
        )
