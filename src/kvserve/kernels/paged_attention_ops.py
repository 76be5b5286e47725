"""The paged decode attention kernel (`csrc/paged_attention.cpp`) from Python, and the choice
of when ``PagedAttention`` uses it.

``torch.ops.kvserve.paged_decode_attention`` attends one query token per request directly
over the paged K/V cache (no gather); its slow twin is the grouped-SDPA decode of
``kvserve.attention.paged`` (gather the blocks, mask, SDPA), which stays the fallback (no
compiler, ``KVSERVE_KERNELS=0``) and the CUDA path.

The kernel is used for every CPU decode batch: benchmarks/paged_attention.py measured it
faster at every shape of the default model it covers (B 1, 8, 64; context 128..2048; float32
3.0-4.2x, bfloat16 4.2-5.3x on AVX-512, 2.5-3.5x on the AVX2 path; one thread, Zen 5), so
there is no shape where the gather path is kept by choice.

``torch.ops.kvserve.paged_decode_attention_quant`` is the same attention over a cache whose K
and V are each stored in a ``kvserve.kv.cache_dtype.CacheDtype`` (int8, int4_sym, int4,
fp8_e4m3 codes with float16 scales, or a float dtype): ``benchmarks/kv_dtype_attention.py``
measured every quantized format faster than the float kernel over bfloat16 at B 8 and 64
(1.1-1.3x at 2048 tokens from L3, 1.6-1.8x at B 64 from DRAM).

``torch.ops.kvserve.paged_prefill_attention`` attends the prefill chunks of a step, all in one
call, over a bfloat16 cache through AMX tiles (CPUs with AMX-BF16) or VDPBF16PS (AVX-512-BF16
without AMX), instead of one gather and one SDPA call per request. ``python -m
benchmarks.prefill_attention``, eight requests of 32..512 tokens, 2 threads: on a 2-core
Sapphire Rapids guest (AMX) 5.84 ms against 13.92 ms (2.38x; 2.23x for four chunks after a
256-token cached prefix, 2.27x on 1 thread), offline-64's prefill alone 12.8-13.9 s ->
10.6-12.1 s (a throwaway A/B script in one process, the kernel's first version); on a Zen 4
(VDPBF16PS) 5.2 ms against 20.4 ms (3.9x; 3.1x after the 256-token prefix).
"""

from __future__ import annotations

import functools
import os

import torch

from kvserve.kernels.build import load_kernels
from kvserve.platform import CPU_FEATURES_ENV, detect_cpu_features, kernel_isa

# the prefill kernel's tiles: head_dim a multiple of 64 (4 C tiles of output dims) up to 256
PREFILL_HEAD_DIMS = range(64, 257, 64)

ISA_BEST = -1  # the kernels pick the best path the CPU has


@functools.cache
def _isa_for_cap(cap: str) -> int:
    return kernel_isa(detect_cpu_features(cap))


def default_isa() -> int:
    """The kernel path to run: the CPU's best, or less under KVSERVE_CPU_FEATURES (avx2/none),
    so a capped run exercises the path a smaller machine would take."""
    cap = os.environ.get(CPU_FEATURES_ENV, "")
    return _isa_for_cap(cap) if cap else ISA_BEST


# paged_prefill_attention's `tiles` argument
PREFILL_TILES_BEST, PREFILL_TILES_BF16, PREFILL_TILES_AMX = -1, 0, 1


@functools.cache
def _prefill_tiles_for_cap(cap: str) -> int | None:
    """The prefill kernel's tiles on this CPU under the cap: AMX, VDPBF16PS, or None."""
    features = detect_cpu_features(cap)
    if not (features.avx512_bf16 and features.avx512 and torch.ops.kvserve.cpu_has_avx512_bf16()):
        return None
    if features.amx_bf16 and torch.ops.kvserve.cpu_has_amx_bf16():
        return PREFILL_TILES_AMX
    return PREFILL_TILES_BF16


def prefill_tiles() -> int | None:
    """The tiles ``paged_prefill_attention`` runs on here (KVSERVE_CPU_FEATURES applied):
    PREFILL_TILES_AMX, PREFILL_TILES_BF16, or None where the kernel cannot run."""
    if not load_kernels():
        return None
    return _prefill_tiles_for_cap(os.environ.get(CPU_FEATURES_ENV, ""))


def prefill_kernel_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """True when ``paged_prefill_attention`` can serve prefill chunks: CPU with AVX-512-BF16
    (AMX tiles where it has them; neither capped away by KVSERVE_CPU_FEATURES), extension
    loaded, a bfloat16 cache and queries, and a head_dim in PREFILL_HEAD_DIMS. Elsewhere
    prefill stays on SDPA."""
    if not (device.type == "cpu" and dtype == torch.bfloat16 and head_dim in PREFILL_HEAD_DIMS):
        return False
    return prefill_tiles() is not None


def decode_kernel_available(device: torch.device) -> bool:
    """True when the C++ decode kernel can serve a cache on ``device`` (CPU, extension loaded,
    KVSERVE_KERNELS not 0)."""
    return device.type == "cpu" and load_kernels()


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    isa: int | None = None,
) -> torch.Tensor:
    """Decode attention over the paged cache, read in place.

    q: (B, num_heads, head_dim), one query token per request; key_cache / value_cache:
    (num_blocks, block_size, num_kv_heads, head_dim), contiguous, float32 / bfloat16 / float16;
    block_tables: (B, max_blocks) int64, padded; seq_lens: (B,) int64, tokens visible (this
    step's included). Query head h uses kv head h // (num_heads // num_kv_heads). Returns
    (B, num_heads, head_dim) in q's dtype. ``isa``: None = ``default_isa()``, -1 best,
    0 scalar, 1 AVX2, 2 AVX-512 (one the CPU lacks raises).
    """
    isa = default_isa() if isa is None else isa
    return torch.ops.kvserve.paged_decode_attention(
        q, key_cache, value_cache, block_tables, seq_lens, scale, isa
    )


def paged_prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    tiles: int | None = None,
) -> torch.Tensor:
    """Causal attention of prefill chunks over the paged cache, read in place through the block
    tables, on AMX tiles or with VDPBF16PS (``csrc/prefill_attention.cpp``;
    ``prefill_kernel_available`` says where it runs). ``tiles``: None = ``prefill_tiles()``,
    or PREFILL_TILES_BEST / _BF16 / _AMX (one the CPU lacks raises; so does None where
    ``prefill_tiles()`` is None, a KVSERVE_CPU_FEATURES cap included).

    q: (T, num_heads, head_dim) bfloat16, request b owning rows [query_start_loc[b],
    query_start_loc[b + 1]); key_cache / value_cache (num_blocks, block_size, num_kv_heads,
    head_dim) bfloat16 with this step's K/V already written; block_tables (B, max_blocks)
    int64; seq_lens (B,) int64, tokens cached after this step. Request b's queries are its last
    tokens: query t sees keys 0 .. seq_lens[b] - n_b + t, as ``causal_attention``. Returns
    (T, num_heads, head_dim) bfloat16; bf16 products summed in float32, the probabilities
    rounded to bfloat16 as SDPA's flash kernel does.
    """
    if tiles is None:
        tiles = prefill_tiles()
        if tiles is None:  # the kernel itself would not see a cap, and run regardless
            raise RuntimeError(
                "kvserve: paged_prefill_attention cannot run here: it needs the C++ extension "
                "and a CPU with AVX-512-BF16, not capped away by KVSERVE_CPU_FEATURES "
                "(prefill_kernel_available says where it runs)"
            )
    return torch.ops.kvserve.paged_prefill_attention(
        q, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, tiles
    )


def paged_decode_attention_quant(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scales: torch.Tensor | None,
    k_mins: torch.Tensor | None,
    k_format: int,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor | None,
    v_mins: torch.Tensor | None,
    v_format: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    isa: int | None = None,
) -> torch.Tensor:
    """Decode attention over a paged cache whose K and V are each stored in a
    ``kvserve.kv.cache_dtype.CacheDtype`` format, read in place (``csrc/paged_attention_quant.cpp``).

    q: (B, num_heads, head_dim) float32 / bfloat16 / float16. Each side (K, V) is
    ``codes`` (num_blocks, block_size, num_kv_heads, code_bytes), contiguous, with
    ``scales`` / ``mins`` (num_blocks, block_size, num_kv_heads, num_groups) float16 or None,
    and ``format`` = ``CacheDtype.format_code``: 0 float (codes are the float32 / bfloat16 /
    float16 values, no scales), 1 int8, 2 int4_sym, 3 int4 (the only one with mins),
    4 fp8_e4m3; exactly what ``CacheDtype.quantize`` returns, per block. K and V formats are
    independent. block_tables (B, max_blocks) int64, seq_lens (B,) int64, as
    ``paged_decode_attention``. Returns (B, num_heads, head_dim) in q's dtype; float32
    accumulation over the values ``CacheDtype.dequantize`` gives. ``isa`` as
    ``paged_decode_attention``.
    """
    isa = default_isa() if isa is None else isa
    return torch.ops.kvserve.paged_decode_attention_quant(
        q,
        k_codes,
        k_scales,
        k_mins,
        k_format,
        v_codes,
        v_scales,
        v_mins,
        v_format,
        block_tables,
        seq_lens,
        scale,
        isa,
    )
