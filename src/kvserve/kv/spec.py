"""KVCacheSpec: the one place that knows how big the KV cache is.

Per token, a full-precision cache holds K and V for every layer and KV head:
``2 x layers x kv_heads x head_dim x bytes per element``. The capacity planner, the storage
allocator and the engine's memory budget all ask this record, so the bytes a plan promises are
the bytes the engine allocates.

The layout kinds reserved for later (same interface, different ``bytes_per_token`` and
storage): quantized K/V with per-group scales (K and V may use different dtypes), sliding-window
layers that release blocks outside the window, attention sinks, and a latent (MLA) cache that
stores one compressed vector per token instead of K and V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.models.config import ModelConfig

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape and dtype of one model's paged KV cache (all layers are full attention today)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"KV cache dtype must be float32, bfloat16 or float16, got {self.dtype}"
            )

    @classmethod
    def for_model(
        cls, config: ModelConfig, dtype: torch.dtype, block_size: int = 16
    ) -> KVCacheSpec:
        return cls(
            config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype, block_size
        )

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, kv_cache_memory: int) -> int:
        """How many blocks a budget of ``kv_cache_memory`` bytes holds."""
        if kv_cache_memory < self.bytes_per_block:
            raise ValueError(
                f"kv_cache_memory of {kv_cache_memory} bytes holds no block "
                f"(one block is {self.bytes_per_block} bytes)"
            )
        return kv_cache_memory // self.bytes_per_block

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def parse_memory(value: int | float | str) -> int:
    """Bytes from an int (bytes), a float (GiB) or a string: "2GiB", "512MiB", "1.5", "1e9"."""
    if isinstance(value, bool):
        raise TypeError(f"kv_cache_memory must be bytes or GiB, got {value!r}")
    if isinstance(value, int):
        result = value
    elif isinstance(value, float):
        result = int(value * GIB)
    elif isinstance(value, str):
        text = value.strip().lower()
        units = {"gib": GIB, "gb": 10**9, "mib": 1 << 20, "mb": 10**6, "kib": 1 << 10, "b": 1}
        for unit, scale in units.items():
            if text.endswith(unit):
                try:
                    return _positive(int(float(text[: -len(unit)]) * scale), value)
                except ValueError as e:
                    raise ValueError(f"cannot read kv_cache_memory {value!r}") from e
        try:
            number = float(text)
        except ValueError as e:
            raise ValueError(
                f"cannot read kv_cache_memory {value!r}; use e.g. 2GiB or 512MiB"
            ) from e
        result = int(number) if number >= 1 << 20 else int(number * GIB)  # small numbers mean GiB
    else:
        raise TypeError(f"kv_cache_memory must be bytes or GiB, got {value!r}")
    return _positive(result, value)


def _positive(result: int, value: object) -> int:
    if result <= 0:
        raise ValueError(f"kv_cache_memory must be > 0, got {value!r}")
    return result
