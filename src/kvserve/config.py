"""Engine configuration: frozen, validated dataclasses with no I/O.

The CLI and ``LLM`` take their defaults from here, so every default has one source.
Names follow vLLM (``block_size``, ``max_num_seqs``, ``max_num_batched_tokens``,
``enable_prefix_caching``, ``max_model_len``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvserve.kv.cache_dtype import CACHE_DTYPE_NAMES

GIB = 1 << 30
DEFAULT_KV_CACHE_MEMORY = GIB  # 1 GiB when neither a budget nor a block count is given
# the length limit of a request under the StreamingLLM policy (its cache stays flat). Window
# keys are rotated at their text positions (attention/window.py), whose float32 rotary angles
# err by ~position x 6e-8 rad: 0.06 rad at 2**20 tokens, as in any 1M-context checkpoint
STREAMING_MAX_LEN = 1 << 20


def _positive_int(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: num_blocks, or DEFAULT_KV_CACHE_MEMORY
    num_blocks: int | None = None  # overrides kv_cache_memory
    enable_prefix_caching: bool = True
    # record every change to the prefix-cache index (kv/events.py) for a KV-events publisher
    enable_kv_cache_events: bool = False
    # what K and V are stored as (kv/cache_dtype.py): "auto" = the model's dtype, exact; int8,
    # int4, int4_sym, fp8_e4m3 are lossy (``kvserve eval-cache`` says how much). The k_ / v_
    # fields, when set, override kv_cache_dtype for that side (llama.cpp's -ctk / -ctv).
    kv_cache_dtype: str = "auto"
    k_cache_dtype: str | None = None
    v_cache_dtype: str | None = None
    # StreamingLLM (lossy): every full-attention layer keeps only the first ``streaming_sinks``
    # tokens and the last ``streaming_window``, gives the rest of its blocks back, and a
    # request may run past the model's context in flat memory. None: off (exact).
    streaming_window: int | None = None
    streaming_sinks: int = 4

    def __post_init__(self) -> None:
        _positive_int("streaming_window", self.streaming_window, allow_none=True)
        if (
            isinstance(self.streaming_sinks, bool)
            or not isinstance(self.streaming_sinks, int)
            or self.streaming_sinks < 0
        ):
            raise ValueError(
                f"streaming_sinks must be an integer >= 0, got {self.streaming_sinks!r}"
            )
        for name in ("kv_cache_dtype", "k_cache_dtype", "v_cache_dtype"):
            value = getattr(self, name)
            if value is not None and value not in CACHE_DTYPE_NAMES:
                raise ValueError(
                    f"{name} must be one of {', '.join(CACHE_DTYPE_NAMES)}, got {value!r}"
                )
        _positive_int("block_size", self.block_size)
        _positive_int("kv_cache_memory", self.kv_cache_memory, allow_none=True)
        _positive_int("num_blocks", self.num_blocks, allow_none=True)

    @property
    def streaming(self) -> tuple[int, int] | None:
        """(sinks, window) when the StreamingLLM policy is on, else None."""
        if self.streaming_window is None:
            return None
        return self.streaming_sinks, self.streaming_window

    @property
    def cache_dtypes(self) -> tuple[str, str]:
        """The names K and V are stored as (either may still be "auto")."""
        return (
            self.k_cache_dtype or self.kv_cache_dtype,
            self.v_cache_dtype or self.kv_cache_dtype,
        )


SCHEDULING_POLICIES = ("fcfs", "lpm", "priority")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # tokens per step (decodes + prefill chunks)
    max_model_len: int | None = None  # None: the model's context length
    # "fcfs": admit in arrival order (vLLM). "lpm": longest cached prefix first (SGLang), ties
    # in arrival order; preempted requests always go first. lpm serves prefix hits early at
    # the price of fairness (a request with no hit can wait behind many hits).
    # "priority": lowest ``Request.priority`` first, then arrival (vLLM); a waiting request
    # may be admitted before a lower-ranked running prefill continues. The server gives a
    # batch's k-th prompt priority k, so a batch yields to single requests; interactive
    # requests go before batch members and tenants round-robin, with preemption for a seat
    # (engine/fairness.py).
    scheduling_policy: str = "fcfs"
    # a step that carries decodes takes at most this many prefill tokens (None: up to the
    # step's budget). Bounds every stream's inter-token latency while prompts are prefilled
    # (Sarathi-Serve's token budget); steps with no decode still use the whole budget.
    max_prefill_tokens_with_decodes: int | None = None

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        _positive_int(
            "max_prefill_tokens_with_decodes", self.max_prefill_tokens_with_decodes, allow_none=True
        )
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_model_len", self.max_model_len, allow_none=True)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # HF directory or .gguf; None: the embedded default model
    dtype: str = "auto"  # "auto": bfloat16 on CUDA and native-bf16 CPUs, else float32
    device: str | None = None  # None: cuda if available, else cpu
    quantization: str | None = None  # "q8_0" | "q4_0": quantize float weights at load
    enforce_eager: bool = False  # True: no torch.compile of the model step
    # "sync" | "background" | "off" (engine/compiled_steps.py); the server compiles in the
    # background so that /health and the first reply do not wait for it
    compile_mode: str = "background"
    # every matmul in one fixed summation order and every step through the fused kernel: a
    # request's logits bit-identical whatever its batch, chunking or cache hits (ARCHITECTURE.md
    # "Bitwise invariance"); off by default: it costs prefill speed (README "Batch-invariant")
    batch_invariant: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    show_progress: bool = False  # progress bar while loading weights


# units, longest suffix first; decimal (GB) and binary (GiB) as written
_MEMORY_UNITS = {
    "tib": 1 << 40,
    "gib": GIB,
    "mib": 1 << 20,
    "kib": 1 << 10,
    "tb": 10**12,
    "gb": 10**9,
    "mb": 10**6,
    "kb": 10**3,
    "b": 1,
}
MIN_UNITLESS_BYTES = 1024  # a smaller number without a unit is taken for a forgotten unit


def parse_memory(value: int | float | str, name: str = "kv_cache_memory") -> int:
    """Bytes from a number or a string with a unit: 2GiB, 512MiB, 80GB, 1.5GiB, 4096B.

    One rule for every spelling: a number without a unit is bytes (an int, a whole float
    such as 1e9, or a string such as "2000000"), as vLLM's ``kv_cache_memory_bytes`` and
    ``CacheConfig.kv_cache_memory``; below ``MIN_UNITLESS_BYTES`` it is refused as a
    forgotten unit ("2" is not 2 GiB: write 2GiB). Units are case-insensitive: KB/MB/GB/TB
    are powers of 1000, KiB/MiB/GiB/TiB of 1024. ``name`` names the setting in errors.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(f"{name} must be bytes or a string such as 2GiB, got {value!r}")
    amount: int | float = value if isinstance(value, int) else 0
    if not isinstance(value, int):
        text = str(value).strip().lower().replace(" ", "")
        number, unit = text, ""
        for suffix in _MEMORY_UNITS:
            if text.endswith(suffix):
                number, unit = text[: -len(suffix)], suffix
                break
        try:
            amount = float(number)
        except ValueError as e:
            raise ValueError(
                f"cannot read {name} {value!r}; use bytes or a number with a unit: "
                "2GiB, 512MiB, 80GB, 4096B"
            ) from e
        if not math.isfinite(amount):
            raise ValueError(f"{name} must be a finite size, got {value!r}")
        if unit:
            return _positive(int(amount * _MEMORY_UNITS[unit]), value, name)
        if amount != int(amount):
            raise ValueError(
                f"{name} {value!r} is not a whole number of bytes; add a unit: {value}GiB"
            )
    if 0 < amount < MIN_UNITLESS_BYTES:
        raise ValueError(
            f"{name} {value!r} has no unit, so it means {int(amount)} bytes; "
            f"write {value}GiB or {value}MiB (or {value}B for bytes)"
        )
    return _positive(int(amount), value, name)


def _positive(result: int, value: object, name: str) -> int:
    if result <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return result
