"""KV cache specs: what each layer caches per token, and so how big the cache is.

The model declares its cache (``LlamaForCausalLM.kv_cache_spec``): one spec per layer,
``FullAttentionSpec`` or ``SlidingWindowSpec``: per token, K and V for each KV head, each
side stored as its ``CacheDtype`` (a float dtype, or codes + scales):

    bytes per token of a layer = kv_heads x (K bytes per head + V bytes per head)

Layers with equal specs form a ``KVCacheGroup``, which the storage allocates together (one
tensor per side and kind of data); ``KVCacheSpec`` is the whole model's list. The capacity
planner, the storage allocator and the engine's memory budget all ask these records, so the
bytes a plan promises are the bytes the engine allocates. ``SlidingWindowSpec`` is a layer that
sees only its last ``sliding_window`` tokens (and optionally the first ``num_sinks``): its
group gives blocks back as the window passes them.

No model code is imported here: the model builds its specs from its config.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvserve.intmath import cdiv
from kvserve.kv.cache_dtype import CacheDtype
from kvserve.kv.latent_spec import MLASpec


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _as_cache_dtype(d: CacheDtype | torch.dtype | str) -> CacheDtype:
    if isinstance(d, CacheDtype):
        return d
    return CacheDtype.of(d) if isinstance(d, torch.dtype) else CacheDtype(d)


@dataclass(frozen=True, slots=True)
class _AttentionSpec:
    """What a softmax-attention layer caches per token: K and V of each KV head."""

    num_kv_heads: int
    head_dim: int
    k_dtype: CacheDtype
    v_dtype: CacheDtype
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "head_dim", "block_size"):
            _positive(name, getattr(self, name))
        for side in (self.k_dtype, self.v_dtype):
            if not isinstance(side, CacheDtype):
                raise TypeError(f"k_dtype / v_dtype must be CacheDtype, got {side!r}")
            side.code_bytes(self.head_dim)  # raises for a head_dim the format cannot hold

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in this layer: codes, scales and mins, exactly."""
        d = self.head_dim
        return self.num_kv_heads * (self.k_dtype.bytes_per_head(d) + self.v_dtype.bytes_per_head(d))

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def tensor_shape(self) -> tuple:
        """What the storage allocates per layer (layers whose shapes agree can share tensors)."""
        return (self.num_kv_heads, self.head_dim, self.k_dtype, self.v_dtype, self.block_size)

    def _dtypes(self) -> str:
        if self.k_dtype == self.v_dtype:
            return self.k_dtype.name
        return f"K {self.k_dtype.name}, V {self.v_dtype.name}"


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(_AttentionSpec):
    """A layer that attends over every earlier token: K and V of each token, kept."""

    kind: ClassVar[str] = "full_attention"
    sliding_window: ClassVar[None] = None
    num_sinks: ClassVar[int] = 0

    def first_needed_block(self, num_computed: int) -> int:
        """Blocks before this one are never read again by queries at >= ``num_computed``."""
        return 0

    def max_blocks(self, num_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds in this layer's group."""
        return cdiv(num_tokens, self.block_size)

    def describe(self) -> str:
        return f"{self.kind} ({self.num_kv_heads} kv heads x {self.head_dim}, {self._dtypes()})"


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(_AttentionSpec):
    """A layer whose query at position q sees keys q - window < k <= q (HF's rule), plus
    the first ``num_sinks`` tokens (StreamingLLM's attention sinks; 0 for a checkpoint's own
    window). Blocks wholly before the window (and past the sinks) are given back while the
    request runs, so a request holds at most sink blocks + ceil(window / block_size) + 1."""

    kind: ClassVar[str] = "sliding_window"
    sliding_window: int = field(default=0, kw_only=True)
    num_sinks: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        _AttentionSpec.__post_init__(self)
        _positive("sliding_window", self.sliding_window)
        if isinstance(self.num_sinks, bool) or not isinstance(self.num_sinks, int):
            raise ValueError(f"num_sinks must be an integer >= 0, got {self.num_sinks!r}")
        if self.num_sinks < 0:
            raise ValueError(f"num_sinks must be >= 0, got {self.num_sinks}")

    @property
    def sink_blocks(self) -> int:
        """Leading blocks kept for the sinks (never given back)."""
        return cdiv(self.num_sinks, self.block_size)

    def first_needed_block(self, num_computed: int) -> int:
        """Queries at positions >= ``num_computed`` see keys > num_computed - window, so blocks
        before the one holding key num_computed - window + 1 are never read again (sink blocks
        aside: the caller keeps the first ``sink_blocks``)."""
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def max_blocks(self, num_tokens: int) -> int:
        """Blocks held while decoding the token after ``num_tokens - 1`` tokens (at most the
        sinks' blocks + ceil(window / block_size) + 1, however long the request)."""
        held = cdiv(num_tokens, self.block_size)
        skipped = max(0, self.first_needed_block(num_tokens - 1) - self.sink_blocks)
        return held - skipped

    def describe(self) -> str:
        sinks = f" + {self.num_sinks} sinks" if self.num_sinks else ""
        return (
            f"{self.kind} {self.sliding_window}{sinks} ({self.num_kv_heads} kv heads x "
            f"{self.head_dim}, {self._dtypes()})"
        )


LayerSpec = FullAttentionSpec | SlidingWindowSpec | MLASpec  # the union of layer kinds


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers with one spec: allocated together, read and written through one block table."""

    layers: tuple[int, ...]
    spec: LayerSpec


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The whole model's cache: ``layers[i]`` is layer i's spec."""

    layers: tuple[LayerSpec, ...]

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a KV cache spec needs at least one layer")
        sizes = {layer.block_size for layer in self.layers}
        if len(sizes) != 1:
            raise ValueError(f"every layer must use one block size, got {sorted(sizes)}")

    @classmethod
    def uniform(cls, num_layers: int, layer: LayerSpec) -> KVCacheSpec:
        _positive("num_layers", num_layers)
        return cls((layer,) * num_layers)

    @classmethod
    def full_attention(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: CacheDtype | torch.dtype | str,
        block_size: int = 16,
        v_dtype: CacheDtype | torch.dtype | str | None = None,
    ) -> KVCacheSpec:
        """Every layer full attention with one shape (``dtype`` for K, and V unless given)."""
        k = _as_cache_dtype(dtype)
        v = k if v_dtype is None else _as_cache_dtype(v_dtype)
        return cls.uniform(num_layers, FullAttentionSpec(num_kv_heads, head_dim, k, v, block_size))

    @classmethod
    def for_layers(
        cls,
        num_kv_heads: int,
        head_dim: int,
        k_dtype: CacheDtype,
        v_dtype: CacheDtype,
        block_size: int,
        windows: Sequence[int | None],
        streaming: tuple[int, int] | None = None,
    ) -> KVCacheSpec:
        """One layer per entry of ``windows``: its sliding window, or None for full attention.
        ``streaming`` = (sinks, window): the StreamingLLM policy, every full-attention layer a
        window of that many tokens plus the sinks (lossy; the checkpoint's own windows stay)."""
        shape = (num_kv_heads, head_dim, k_dtype, v_dtype, block_size)
        layers: list[LayerSpec] = []
        for window in windows:
            if window is not None:
                layers.append(SlidingWindowSpec(*shape, sliding_window=window))
            elif streaming is not None:
                sinks, width = streaming
                layers.append(SlidingWindowSpec(*shape, sliding_window=width, num_sinks=sinks))
            else:
                layers.append(FullAttentionSpec(*shape))
        return cls(tuple(layers))

    def tokens_held(self, num_tokens: int) -> int:
        """Token rows one request of ``num_tokens`` tokens keeps, summed over layers (a
        windowed layer: its window and sinks at most): the exact bytes, before blocks, are
        ``sum(layer.bytes_per_token x its rows)``."""
        return sum(self._rows(layer, num_tokens) for layer in self.layers)

    def bytes_held(self, num_tokens: int) -> int:
        """The exact K/V bytes one request of ``num_tokens`` tokens keeps (before blocks)."""
        return sum(layer.bytes_per_token * self._rows(layer, num_tokens) for layer in self.layers)

    @staticmethod
    def _rows(layer: LayerSpec, n: int) -> int:
        if layer.sliding_window is None:
            return n
        return min(n, layer.sliding_window + layer.num_sinks)

    @property
    def groups(self) -> tuple[KVCacheGroup, ...]:
        """Layers grouped by equal spec, in order of each group's first layer; each group has
        its own block table per request.

        When kinds differ (a hybrid of windowed and full layers) but every layer allocates the
        same tensors, the kinds are cut into groups of one size (the gcd of their layer
        counts), so that groups can share the storage's tensors: a block id from the one pool
        then belongs to one group at a time and costs one group's layers, not all of them
        (vLLM's hybrid allocator). E.g. 21 full + 7 windowed layers: 4 groups of 7.
        """
        by_spec: dict[LayerSpec, list[int]] = {}
        for i, layer in enumerate(self.layers):
            by_spec.setdefault(layer, []).append(i)
        if len(by_spec) > 1 and self.shares_tensors:
            size = math.gcd(*(len(ids) for ids in by_spec.values()))
            chunks = [
                (spec, ids[lo : lo + size])
                for spec, ids in by_spec.items()
                for lo in range(0, len(ids), size)
            ]
            return tuple(KVCacheGroup(tuple(ids), spec) for spec, ids in chunks)
        return tuple(KVCacheGroup(tuple(ids), spec) for spec, ids in by_spec.items())

    @property
    def shares_tensors(self) -> bool:
        """Whether all groups share one set of tensors (every layer allocates the same shape)."""
        return len({layer.tensor_shape for layer in self.layers}) == 1

    @property
    def has_windows(self) -> bool:
        return any(layer.sliding_window is not None for layer in self.layers)

    @property
    def has_sinks(self) -> bool:
        return any(layer.num_sinks for layer in self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def block_size(self) -> int:
        return self.layers[0].block_size

    @property
    def bytes_per_token(self) -> int:
        """One token's cache over all layers."""
        return sum(layer.bytes_per_token for layer in self.layers)

    @property
    def bytes_per_block(self) -> int:
        """What one block id of the pool costs in the storage: every layer's block when there
        is one group (or groups that cannot share tensors: each holds every id), one group's
        layers when the groups share their tensors."""
        groups = self.groups
        if len(groups) > 1 and self.shares_tensors:
            return len(groups[0].layers) * groups[0].spec.bytes_per_block
        return self.bytes_per_token * self.block_size

    def max_blocks(self, num_tokens: int) -> int:
        """Blocks of the pool one request of ``num_tokens`` tokens holds, over its groups (a
        windowed group's count stops growing at its window)."""
        return sum(g.spec.max_blocks(num_tokens) for g in self.groups)

    def max_tokens_for(self, num_blocks: int) -> int | None:
        """The longest request a pool of ``num_blocks`` can hold; None when every group is
        windowed (blocks held stay flat however long it runs, if the window fits)."""
        if all(g.spec.sliding_window is not None for g in self.groups):
            return None
        lo, hi = 0, num_blocks * self.block_size
        while lo < hi:  # max_blocks is monotone in the token count
            mid = (lo + hi + 1) // 2
            if self.max_blocks(mid) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @property
    def mha_equivalent_bytes_per_token(self) -> int:
        """Latent (MLA) layers counted as the multi-head cache they replace; the rest as they
        are (equal to ``bytes_per_token`` for a model without MLA)."""
        return sum(
            getattr(layer, "mha_equivalent_bytes_per_token", layer.bytes_per_token)
            for layer in self.layers
        )

    def num_blocks_for(self, kv_cache_memory: int) -> int:
        """How many blocks a budget of ``kv_cache_memory`` bytes holds."""
        if kv_cache_memory < self.bytes_per_block:
            raise ValueError(
                f"kv_cache_memory of {kv_cache_memory} bytes holds no block "
                f"(one block is {self.bytes_per_block} bytes)"
            )
        return kv_cache_memory // self.bytes_per_block

    @property
    def cache_dtype_name(self) -> str:
        """ "bfloat16", "int8", or K/V apart as "int4_sym/int8" (per group, comma-separated)."""
        names = []
        for g in self.groups:
            k, v = g.spec.k_dtype.name, g.spec.v_dtype.name
            names.append(k if k == v else f"{k}/{v}")
        return ",".join(dict.fromkeys(names))

    def describe(self) -> str:
        """e.g. "30 x full_attention (3 kv heads x 64, int8)"."""
        return ", ".join(f"{len(g.layers)} x {g.spec.describe()}" for g in self.groups)
