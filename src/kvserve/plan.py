"""`kvserve plan`: the lessons' KV-cache bill for a model, a cache dtype, a context and a device.

Per token the cache holds ``2 x layers x kv_heads x head_dim x bytes per element`` (K and V of
every layer); a request holds whole blocks of ``block_size`` tokens. Every figure comes from
``KVCacheSpec``, the record the engine allocates with: ``pool_blocks`` is exactly the number
of blocks ``LLMEngine`` creates when given ``kv_cache_memory = kv_budget`` (tested), so what
the plan says fits is what fits.

    kv_budget   = device_memory x (1 - reserve) - weights      (the rest of the device)
    pool_blocks = kv_budget // bytes_per_block                  (KVCacheSpec.num_blocks_for)
    requests    = pool_blocks // blocks per request at that context

Windowed layers (a checkpoint's own sliding windows, or the StreamingLLM policy's sinks +
window) hold at most their window per request, in bytes and in blocks (``bytes_held`` /
``max_blocks``), so their requests stop growing. No I/O: the CLI reads configs and sizes.
A latent-attention model (DeepSeek-V2/V3, ``PlanInput.mla``) plans with ``MLASpec`` (one
latent row per token and layer), and each row also says what the same model would need with a
multi-head cache (``mha_bytes_per_token``, ``mha_requests``). No I/O: the CLI reads configs and sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvserve.config import GIB
from kvserve.kv.cache_dtype import CACHE_DTYPE_NAMES, CacheDtype
from kvserve.kv.spec import KVCacheSpec, MLASpec

# public memory sizes of common devices (what the spec sheet's "GB" means: GiB of HBM/GDDR)
DEVICE_PRESETS: dict[str, int] = {
    "H100-80GB": 80 * GIB,
    "A100-80GB": 80 * GIB,
    "A100-40GB": 40 * GIB,
    "L4-24GB": 24 * GIB,
    "RTX-4090-24GB": 24 * GIB,
}
# what a plan row may name: one cache dtype for K and V, or "K/V" apart ("int4/int8")
CACHE_DTYPES = tuple(n for n in CACHE_DTYPE_NAMES if n != "auto")
DEFAULT_RESERVE = 0.1  # vLLM's gpu_memory_utilization 0.9: activations, allocator slack


@dataclass(frozen=True, slots=True)
class MLAShape:
    """A latent-attention model's cache shape (DeepSeek-V2/V3): what ``MLASpec`` needs."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    num_heads: int
    qk_nope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True, slots=True)
class PlanInput:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    device_memory: int  # bytes
    weights_bytes: int  # bytes the model's weights take on the device
    block_size: int = 16
    reserve: float = DEFAULT_RESERVE  # share of device memory kept for everything else
    # per layer its sliding window, None for full attention (empty: every layer full)
    windows: tuple[int | None, ...] = ()
    streaming: tuple[int, int] | None = None  # (sinks, window): the StreamingLLM policy
    mla: MLAShape | None = None  # set: every layer caches a latent row (MLASpec)

    def __post_init__(self) -> None:
        if self.windows and len(self.windows) != self.num_layers:
            raise ValueError(f"{len(self.windows)} layer windows for {self.num_layers} layers")
        if not 0 <= self.reserve < 1:
            raise ValueError(f"reserve must be in [0, 1), got {self.reserve}")
        if self.device_memory <= 0 or self.weights_bytes < 0:
            raise ValueError(
                f"device memory must be > 0 and weights >= 0 bytes, got {self.device_memory} "
                f"and {self.weights_bytes}"
            )

    def spec(self, k_dtype: CacheDtype, v_dtype: CacheDtype) -> KVCacheSpec:
        """The spec the engine would allocate (``models.llama.kv_cache_spec`` for these dims,
        ``models.deepseek.deepseek_kv_cache_spec`` for a latent shape)."""
        if self.mla is not None:
            if k_dtype != v_dtype:
                raise ValueError("an MLA cache has one dtype (no K/V apart)")
            m = self.mla
            mla = MLASpec(
                m.kv_lora_rank,
                m.qk_rope_head_dim,
                k_dtype,
                self.block_size,
                m.num_heads,
                m.qk_nope_head_dim,
                m.v_head_dim,
                # an fp8 latent keeps its rope key in bfloat16 (the engine: the model's dtype)
                rope_dtype=CacheDtype("bfloat16") if k_dtype.is_quantized else None,
            )
            return KVCacheSpec.uniform(self.num_layers, mla)
        return KVCacheSpec.for_layers(
            self.num_kv_heads,
            self.head_dim,
            k_dtype,
            v_dtype,
            self.block_size,
            self.windows or (None,) * self.num_layers,
            self.streaming,
        )

    @property
    def layout(self) -> str:
        """ "full", "sliding 4096", "hybrid: 16 sliding 4096 + 16 full", "4 sinks + window 1020",
        "mla"."""
        if self.mla is not None:
            return "mla"
        windows = self.windows or (None,) * self.num_layers
        sliding = [w for w in windows if w is not None]
        full = len(windows) - len(sliding)
        if self.streaming is not None and full:
            sinks, w = self.streaming
            return f"{sinks} sinks + window {w}" + (
                f" ({len(sliding)} own windows)" if sliding else ""
            )
        if not sliding:
            return "full"
        own = "/".join(str(w) for w in sorted(set(sliding)))
        return (
            f"sliding {own}" if not full else f"hybrid: {len(sliding)} sliding {own} + {full} full"
        )

    @property
    def kv_budget(self) -> int:
        return int(self.device_memory * (1 - self.reserve)) - self.weights_bytes


@dataclass(frozen=True, slots=True)
class PlanRow:
    dtype: str
    context: int  # tokens per request
    layout: str  # PlanInput.layout: full attention, windows, sinks
    bytes_per_token: int
    bytes_per_request: int  # the exact figure: context x bytes per token
    allocated_per_request: int  # whole blocks, as the pool hands them out
    kv_budget: int
    pool_blocks: int  # what LLMEngine allocates for kv_budget
    pool_tokens: int
    requests: int  # requests of this context that fit at once
    mha_bytes_per_token: int = 0  # the same model with a multi-head cache (MLA: far more)
    mha_requests: int = 0  # requests that would fit with that cache, same budget

    def as_dict(self) -> dict[str, int | str]:
        return asdict(self)


def plan_row(inp: PlanInput, dtype: str, context: int) -> PlanRow:
    if context <= 0:
        raise ValueError(f"context must be a positive number of tokens, got {context}")
    spec = inp.spec(*parse_kv_dtypes(dtype))
    budget = inp.kv_budget
    blocks = spec.num_blocks_for(budget) if budget >= spec.bytes_per_block else 0
    # a windowed layer stops growing at its window: the pool's own count (KVCacheSpec)
    per_request_blocks = spec.max_blocks(context)
    return PlanRow(
        dtype=dtype,
        context=context,
        layout=inp.layout,
        bytes_per_token=spec.bytes_per_token,
        bytes_per_request=spec.bytes_held(context),
        allocated_per_request=per_request_blocks * spec.bytes_per_block,
        kv_budget=budget,
        pool_blocks=blocks,
        pool_tokens=blocks * spec.block_size,
        requests=blocks // per_request_blocks,
        mha_bytes_per_token=spec.mha_equivalent_bytes_per_token,
        mha_requests=max(budget, 0)
        // (spec.mha_equivalent_bytes_per_token * spec.block_size)
        // per_request_blocks,
    )


@dataclass(frozen=True, slots=True)
class TextCost:
    """What one text holds in the cache: the lessons' tokens chapter ends in this bill."""

    dtype: str
    tokens: int
    words: int
    kv_bytes: int  # tokens x bytes per token, exactly
    allocated_bytes: int  # in whole blocks, as the pool hands them out
    context_share: dict[int, float]  # context length -> share of it the text takes

    @property
    def tokens_per_word(self) -> float:
        return self.tokens / self.words if self.words else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_word"] = self.tokens_per_word
        return d


def text_cost(
    inp: PlanInput, dtype: str, tokens: int, words: int, contexts: Sequence[int]
) -> TextCost:
    spec = inp.spec(*parse_kv_dtypes(dtype))
    return TextCost(
        dtype=dtype,
        tokens=tokens,
        words=words,
        kv_bytes=spec.bytes_held(tokens),
        allocated_bytes=spec.max_blocks(tokens) * spec.bytes_per_block,
        context_share={c: tokens / c for c in contexts},
    )


def parse_kv_dtypes(dtype: str) -> tuple[CacheDtype, CacheDtype]:
    """ "int8" -> (int8, int8); "int4/int8" -> K int4, V int8."""
    names = dtype.split("/")
    if len(names) > 2 or any(n not in CACHE_DTYPES for n in names):
        raise ValueError(
            f"cache dtype must be one of {', '.join(CACHE_DTYPES)}, or K/V as int4/int8, "
            f"got {dtype!r}"
        )
    return CacheDtype(names[0]), CacheDtype(names[-1])


def plan(inp: PlanInput, dtypes: Sequence[str], contexts: Sequence[int]) -> list[PlanRow]:
    return [plan_row(inp, d, c) for d in dtypes for c in contexts]


def human(n: float) -> str:
    """Bytes as both a decimal and a binary figure: '1.07 GB (1.00 GiB)'."""
    if abs(n) < 10**6:
        return f"{n:,.0f} B"
    if abs(n) < 10**9:
        return f"{n / 1e6:.1f} MB ({n / 2**20:.1f} MiB)"
    return f"{n / 1e9:.2f} GB ({n / GIB:.2f} GiB)"


def table(rows: Sequence[PlanRow]) -> list[str]:
    lines = [
        f"{'cache dtype':<19} {'layout':<24} {'context':>8} {'bytes/token':>12} "
        f"{'per request':>24} {'pool tokens':>12} {'requests':>9}"
    ]
    for r in rows:
        lines.append(
            f"{r.dtype:<19} {r.layout:<24} {r.context:>8} {r.bytes_per_token:>12,} "
            f"{human(r.bytes_per_request):>24} {r.pool_tokens:>12,} {r.requests:>9,}"
        )
    if rows and any(r.mha_bytes_per_token != r.bytes_per_token for r in rows):  # MLA
        lines[0] += f" {'as MHA b/token':>15} {'MHA requests':>13}"
        for i, r in enumerate(rows, start=1):
            lines[i] += f" {r.mha_bytes_per_token:>15,} {r.mha_requests:>13,}"
    return lines
