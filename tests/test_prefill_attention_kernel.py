"""The prefill attention kernel (kvserve::paged_prefill_attention) against causal attention
over each request's own K/V in float32, and PagedAttention's choice of it. The kernel runs on
CPUs with AVX-512-BF16: with VDPBF16PS, and on AMX tiles where the CPU has AMX-BF16 (both
tested there); elsewhere the kernel's tests skip, saying so, and prefill takes the per-request
SDPA path that tests/test_paged_attention.py covers on every machine (head_dim 16: never the
kernel's). The choice of path, and the wrapper's refusal where the kernel cannot run, are
tested on every machine."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.backend import causal_attention
from kvserve.attention.paged import AttentionMetadata, PagedAttention, reference_paged_attention
from kvserve.kernels.build import load_kernels
from kvserve.kernels.paged_attention_ops import (
    PREFILL_TILES_AMX,
    PREFILL_TILES_BF16,
    paged_prefill_attention,
    prefill_kernel_available,
    prefill_tiles,
)
from kvserve.kv.spec import KVCacheSpec
from kvserve.kv.storage import KVCacheStorage
from kvserve.platform import CPU_FEATURES_ENV

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(
    not (load_kernels() and prefill_kernel_available(CPU, torch.bfloat16, 64)),
    reason="the prefill attention kernel needs AVX-512-BF16 and the C++ extension",
)
# every path this CPU runs: VDPBF16PS always (where the kernel runs at all), AMX where it has it
TILES = [PREFILL_TILES_BF16] + ([PREFILL_TILES_AMX] if prefill_tiles() == PREFILL_TILES_AMX else [])
# outputs are ~N(0, 1/sqrt(n)); the kernel rounds P and the output to bfloat16, as SDPA's flash
# kernel does, so it is compared with float32 attention over the same bf16 values at bf16's step
TOL = dict(atol=1.6e-2, rtol=1.6e-2)


def paged_case(lens, qlens, heads, kv_heads, head_dim, block_size, seed=0):
    """Random bf16 caches with each request's blocks shuffled; returns the kernel's inputs."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    kc = torch.randn(shape, generator=gen).bfloat16()
    vc = torch.randn(shape, generator=gen).bfloat16()
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max(need), dtype=torch.long)
    used = 0
    for b, nb in enumerate(need):
        tables[b, :nb] = perm[used : used + nb]
        used += nb
    qsl = torch.tensor([0] + qlens).cumsum(0)
    q = torch.randn(int(qsl[-1]), heads, head_dim, generator=gen).bfloat16()
    return q, kc, vc, tables, qsl, torch.tensor(lens)


def dense_reference(q, kc, vc, tables, qsl, lens, scale) -> torch.Tensor:
    """Per request: gather its keys in order, causal attention in float32."""
    bs, outs = kc.shape[1], []
    for b, n in enumerate(lens.tolist()):
        blocks = tables[b, : -(-n // bs)]
        k = kc[blocks].flatten(0, 1)[:n].transpose(0, 1).float()
        v = vc[blocks].flatten(0, 1)[:n].transpose(0, 1).float()
        outs.append(causal_attention(q[qsl[b] : qsl[b + 1]].float(), k, v, scale))
    return torch.cat(outs)


@needs_kernel
@pytest.mark.parametrize(
    "lens,qlens,heads,kv_heads,head_dim,block_size",
    [
        ([1], [1], 9, 3, 64, 16),  # one token, one key
        ([5, 64, 65], [5, 64, 65], 9, 3, 64, 16),  # around the 64-key block
        ([300, 17, 100], [300, 17, 40], 9, 3, 64, 16),  # the last one after a cached prefix
        ([129, 64, 1000], [1, 64, 200], 4, 4, 128, 16),  # MHA, head_dim 128, long prefix
        ([70, 33], [70, 20], 8, 1, 64, 5),  # MQA, a block size that divides nothing
        ([513], [513], 6, 2, 192, 32),
        ([40, 41, 42, 43, 44, 45], [40, 1, 42, 3, 44, 5], 16, 4, 256, 16),
    ],
)
@pytest.mark.parametrize("tiles", TILES)
def test_kernel_matches_causal_attention(lens, qlens, heads, kv_heads, head_dim, block_size, tiles):
    args = paged_case(lens, qlens, heads, kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    out = paged_prefill_attention(*args, scale, tiles=tiles)
    assert out.dtype == torch.bfloat16 and out.shape == args[0].shape
    torch.testing.assert_close(out.float(), dense_reference(*args, scale), **TOL)


@needs_kernel
@pytest.mark.parametrize("tiles", TILES)
def test_kernel_reads_only_the_requests_blocks(tiles):
    q, kc, vc, tables, qsl, lens = paged_case([50, 20], [50, 20], 9, 3, 64, 16, seed=1)
    before = paged_prefill_attention(q, kc, vc, tables, qsl, lens, 0.125, tiles=tiles)
    used = set(tables[0, :4].tolist()) | set(tables[1, :2].tolist())
    for b in range(kc.shape[0]):  # scribble NaN over every block nobody reads
        if b not in used:
            kc[b], vc[b] = float("nan"), float("nan")
    kc[tables[1, 1], 4:], vc[tables[1, 1], 4:] = float("nan"), float("nan")  # past seq_len 20
    after = paged_prefill_attention(q, kc, vc, tables, qsl, lens, 0.125, tiles=tiles)
    assert torch.equal(before, after)


@needs_kernel
@pytest.mark.parametrize(
    "qsl,lens,tables,match",
    [
        ([0, 5], [4], [[0]], "has 5 queries and seq_len 4"),
        ([0, 5], [5], [[9]], r"block_tables\[0, 0\] = 9"),
        ([0, 4], [5], [[0]], "from 0 to T = 5"),
        ([0, 5], [40], [[0]], "seq_len 40"),
    ],
)
def test_kernel_refuses_bad_tables(qsl, lens, tables, match):
    q, kc, vc, *_ = paged_case([16], [16], 9, 3, 64, 16)
    with pytest.raises(RuntimeError, match=match):
        paged_prefill_attention(
            q[:5], kc, vc, torch.tensor(tables), torch.tensor(qsl), torch.tensor(lens), 0.125
        )


@needs_kernel
def test_paged_attention_takes_the_kernel_for_prefill(monkeypatch):
    """Decodes plus prefill chunks (one after a cached prefix) at head_dim 64: the step's
    prefill goes through the kernel and matches the reference; capped below AVX-512-BF16 it
    does not."""
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    seq_lens, query_lens = [7, 30, 90, 40], [1, 1, 90, 25]
    gen = torch.Generator().manual_seed(3)
    spec = KVCacheSpec.full_attention(1, kv_heads, head_dim, torch.bfloat16, bs)
    need = [-(-n // bs) for n in seq_lens]
    storage = KVCacheStorage(spec, sum(need) + 2)
    perm = torch.randperm(storage.num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(need), dtype=torch.long)
    slots, starts, qs, ks, vs = [], [0], [], [], []
    for i, (n, t, nb) in enumerate(zip(seq_lens, query_lens, need, strict=True)):
        tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
        pos = [int(tables[i, p // bs]) * bs + p % bs for p in range(n)]
        k = torch.randn(n, kv_heads, head_dim, generator=gen).bfloat16()
        v = torch.randn(n, kv_heads, head_dim, generator=gen).bfloat16()
        if n > t:
            storage.write(0, torch.tensor(pos[: n - t]), k[: n - t], v[: n - t])
        slots += pos[n - t :]
        starts.append(starts[-1] + t)
        qs.append(torch.randn(t, heads, head_dim, generator=gen).bfloat16())
        ks.append(k[n - t :])
        vs.append(v[n - t :])
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=starts,
        seq_lens=seq_lens,
        block_tables=tables,
        num_decodes=2,
        seq_lens_tensor=torch.tensor(seq_lens),
    )
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    calls = []
    real = torch.ops.kvserve.paged_prefill_attention

    def counting(*a):
        calls.append(a[0].shape[0])
        return real(*a)

    monkeypatch.setattr("kvserve.attention.paged.paged_prefill_attention", counting)
    out = PagedAttention(storage, md, head_dim**-0.5)(0, q, k, v)
    assert calls == [115]  # both prefill chunks, one call
    ref = reference_paged_attention(storage, md, 0, q, head_dim**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), **TOL)

    monkeypatch.setenv(CPU_FEATURES_ENV, "avx512")  # bf16 capped away: per-request SDPA
    calls.clear()
    capped = PagedAttention(storage, md, head_dim**-0.5)(0, q, k, v)
    assert calls == []
    torch.testing.assert_close(capped.float(), ref.float(), **TOL)


@needs_kernel
def test_kernel_refuses_a_path_the_cpu_lacks():
    q, kc, vc, tables, qsl, lens = paged_case([16], [16], 9, 3, 64, 16)
    with pytest.raises(RuntimeError, match="tiles must be -1"):
        paged_prefill_attention(q, kc, vc, tables, qsl, lens, 0.125, tiles=2)
    if prefill_tiles() != PREFILL_TILES_AMX:
        with pytest.raises(RuntimeError, match="on AMX tiles needs AMX-BF16"):
            paged_prefill_attention(q, kc, vc, tables, qsl, lens, 0.125, tiles=PREFILL_TILES_AMX)


# ---- on every machine: where the kernel is chosen, and where it is refused ----


@pytest.mark.parametrize("cap", ["avx512", "avx2", "none"])
def test_no_prefill_kernel_below_avx512_bf16(monkeypatch, cap):
    """Capped below AVX-512-BF16 (an AVX2-only machine's view), the kernel is never chosen,
    whatever this CPU has, and the wrapper refuses rather than run it regardless of the cap."""
    monkeypatch.setenv(CPU_FEATURES_ENV, cap)
    assert prefill_tiles() is None
    assert not prefill_kernel_available(CPU, torch.bfloat16, 64)
    with pytest.raises(RuntimeError, match="paged_prefill_attention cannot run here"):
        paged_prefill_attention(*paged_case([16], [16], 9, 3, 64, 16), 0.125)


def test_no_prefill_kernel_off_its_dtype_head_dims_device_or_with_kernels_off(monkeypatch):
    assert not prefill_kernel_available(CPU, torch.float32, 64)
    assert not prefill_kernel_available(CPU, torch.bfloat16, 32)
    assert not prefill_kernel_available(torch.device("meta"), torch.bfloat16, 64)
    monkeypatch.setenv("KVSERVE_KERNELS", "0")
    assert prefill_tiles() is None
    assert not prefill_kernel_available(CPU, torch.bfloat16, 64)
