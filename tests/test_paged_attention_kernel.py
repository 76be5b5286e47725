"""The C++ paged decode kernel (``kvserve::paged_decode_attention``) against plain SDPA over each
request's own dense K/V and against ``reference_paged_attention``: random caches in shuffled
blocks, padded tables, mixed lengths, GQA / MHA / MQA, every ISA path this CPU has; plus the
fallback switch, the ISA argument and the input checks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvserve.attention.paged import AttentionMetadata, PagedAttention, reference_paged_attention
from kvserve.kernels.build import build_kernels
from kvserve.kernels.paged_attention_ops import default_isa, paged_decode_attention
from kvserve.kv.spec import KVCacheSpec
from kvserve.kv.storage import KVCacheStorage
from kvserve.platform import detect_cpu_features

LENS = [1, 16, 17, 5, 100, 33, 250, 48]  # 1, multiples of 16 and not
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # vs float32 SDPA
REF_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    build_kernels()  # a broken build fails here with its compiler output, not a silent skip


def supported_isas() -> list[int]:
    """The paths this CPU can run, judged by torch's cpuinfo (not by the kernel's own check)."""
    f = detect_cpu_features("amx")  # the highest cap: everything the CPU has
    return [0] + ([1] if f.avx2 and f.fma else []) + ([2] if f.avx512 else [])


def build_cache(lens, heads, kv_heads, head_dim, dtype, block_size=16, pad=-1, seed=0):
    """Random dense K/V per request written into shuffled blocks of a one-layer storage.

    Returns storage, q (B, heads, D), block tables (B, width) padded with `pad` (never read:
    -1 would crash an out-of-range read), seq_lens, and each request's dense (k, v) (n, kvh, D).
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    spec = KVCacheSpec.full_attention(1, kv_heads, head_dim, dtype, block_size)
    storage = KVCacheStorage(spec, sum(need) + 5)
    storage.kv.copy_(torch.randn(storage.kv.shape, generator=gen))  # garbage in unused slots
    perm = torch.randperm(storage.num_blocks, generator=gen).tolist()
    tables = torch.full((len(lens), max(need) + 2), pad, dtype=torch.long)
    dense = []
    for i, (n, nb) in enumerate(zip(lens, need, strict=True)):
        tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
        k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(n)
        slots = tables[i, pos // block_size] * block_size + pos % block_size
        storage.write(0, slots, k, v)
        dense.append((k, v))
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    return storage, q, tables, torch.tensor(lens), dense


def dense_sdpa(q: torch.Tensor, dense) -> torch.Tensor:
    """Plain float32 SDPA of each request's query over its own K/V (enable_gqa = repeat_kv)."""
    out = []
    for i, (k, v) in enumerate(dense):
        qi = q[i].float()[None, :, None]  # (1, heads, 1, D)
        ki, vi = k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None]
        out.append(F.scaled_dot_product_attention(qi, ki, vi, enable_gqa=True)[0, :, 0])
    return torch.stack(out)  # (B, heads, D)


def decode_metadata(tables: torch.Tensor, lens: torch.Tensor) -> AttentionMetadata:
    """All requests decode (one query token each); tables padded with 0 as the runner does."""
    b = len(lens)
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        query_start_loc=list(range(b + 1)),
        seq_lens=lens.tolist(),
        block_tables=tables.clamp(min=0),
        num_decodes=b,
        seq_lens_tensor=lens,
    )


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    # groups of more than 4 query heads take the register-blocked paths in two passes
    [(9, 3, 64), (8, 8, 64), (8, 2, 128), (4, 1, 128), (4, 2, 20), (16, 2, 64), (12, 2, 128)],
    ids=["gqa3-d64", "mha-d64", "gqa4-d128", "mqa-d128", "gqa2-d20", "gqa8-d64", "gqa6-d128"],
)
def test_kernel_matches_sdpa_and_reference(isa, dtype, heads, kv_heads, head_dim) -> None:
    storage, q, tables, lens, dense = build_cache(LENS, heads, kv_heads, head_dim, dtype)
    kc, vc = storage.plane(0, "k").codes, storage.plane(0, "v").codes
    out = paged_decode_attention(q, kc, vc, tables, lens, head_dim**-0.5, isa)
    assert out.shape == q.shape and out.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), dense_sdpa(q, dense), atol=tol, rtol=tol)
    # the reference runs SDPA in the cache dtype: both sides round, so a looser half tolerance
    ref = reference_paged_attention(storage, decode_metadata(tables, lens), 0, q, head_dim**-0.5)
    ref_tol = REF_TOL[dtype]
    torch.testing.assert_close(out, ref, atol=ref_tol, rtol=ref_tol)


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("block_size", [1, 3, 32])
def test_other_block_sizes(isa: int, block_size: int) -> None:
    storage, q, tables, lens, dense = build_cache(LENS, 6, 2, 64, torch.float32, block_size)
    out = paged_decode_attention(
        q, storage.plane(0, "k").codes, storage.plane(0, "v").codes, tables, lens, 64**-0.5, isa
    )
    torch.testing.assert_close(out, dense_sdpa(q, dense), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("isa", supported_isas())
def test_many_long_requests_on_threads(isa: int) -> None:
    # enough K/V rows (> 512, and more than the old 8192) that the kernel spreads the (request,
    # kv head) tasks over threads
    lens = [(37 * i) % 700 + 1 for i in range(24)]
    storage, q, tables, lens_t, dense = build_cache(lens, 9, 3, 64, torch.bfloat16, seed=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = paged_decode_attention(
            q,
            storage.plane(0, "k").codes,
            storage.plane(0, "v").codes,
            tables,
            lens_t,
            64**-0.5,
            isa,
        )
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out.float(), dense_sdpa(q, dense), atol=1e-2, rtol=1e-2)


def test_isa_paths_agree_closely() -> None:
    # same float32 inputs: the vector paths differ from scalar only by summation order
    storage, q, tables, lens, _ = build_cache(LENS, 9, 3, 64, torch.float32, seed=4)
    args = (q, storage.plane(0, "k").codes, storage.plane(0, "v").codes, tables, lens, 0.125)
    scalar = paged_decode_attention(*args, 0)
    for isa in supported_isas()[1:]:
        torch.testing.assert_close(paged_decode_attention(*args, isa), scalar, atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_kernel_and_fallback_agree(dtype, monkeypatch) -> None:
    storage, q, tables, lens, dense = build_cache(LENS, 9, 3, 64, dtype, seed=5)
    md = decode_metadata(tables, lens)
    monkeypatch.setenv("KVSERVE_KERNELS", "1")
    assert PagedAttention(storage, md, 64**-0.5).use_kernel  # CPU + extension loaded: the default
    empty = q.new_zeros(0, 3, 64)  # this step writes no K/V: the cache already holds it all
    with_kernel = PagedAttention(storage, md, 64**-0.5)(0, q, empty, empty)
    monkeypatch.setenv("KVSERVE_KERNELS", "0")
    fallback = PagedAttention(storage, md, 64**-0.5)
    assert not fallback.use_kernel
    without = fallback(0, q, empty, empty)
    tol = TOL[dtype] if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(with_kernel, without, atol=tol, rtol=tol)
    forced = PagedAttention(storage, md, 64**-0.5, use_kernel=False)(0, q, empty, empty)
    torch.testing.assert_close(forced, without)
    torch.testing.assert_close(without.float(), dense_sdpa(q, dense), atol=tol, rtol=tol)


def test_default_isa_follows_feature_cap(monkeypatch) -> None:
    monkeypatch.delenv("KVSERVE_CPU_FEATURES", raising=False)
    assert default_isa() == -1
    monkeypatch.setenv("KVSERVE_CPU_FEATURES", "none")
    assert default_isa() == 0
    monkeypatch.setenv("KVSERVE_CPU_FEATURES", "avx2")
    assert default_isa() == (1 if 1 in supported_isas() else 0)


@pytest.mark.parametrize("isa", [-2, 3] + [i for i in (1, 2) if i not in supported_isas()])
def test_unsupported_isa_raises(isa: int) -> None:
    storage, q, tables, lens, _ = build_cache([5], 4, 2, 64, torch.float32)
    with pytest.raises(RuntimeError, match="isa"):
        paged_decode_attention(
            q, storage.plane(0, "k").codes, storage.plane(0, "v").codes, tables, lens, 0.125, isa
        )


def test_bad_inputs_raise_naming_the_value() -> None:
    storage, q, tables, lens, _ = build_cache([5, 20], 4, 2, 64, torch.float32)
    kc, vc = storage.plane(0, "k").codes, storage.plane(0, "v").codes
    cases = {
        "seq_lens must be": (q, kc, vc, tables, lens.int()),
        "seq_lens\\[1\\] = 0": (q, kc, vc, tables, torch.tensor([5, 0])),
        "seq_lens\\[0\\] = 1000": (q, kc, vc, tables, torch.tensor([1000, 20])),
        "block_tables\\[0, 0\\]": (q, kc, vc, torch.full_like(tables, 99), lens),
        "q head_dim": (q[..., :32], kc, vc, tables, lens),
        "num_heads": (q[:, :3], kc, vc, tables, lens),
        "value_cache dtype": (q, kc, vc.bfloat16(), tables, lens),
        "contiguous": (q, kc, vc.transpose(0, 1).contiguous().transpose(0, 1), tables, lens),
    }
    for message, args in cases.items():
        with pytest.raises(RuntimeError, match=message):
            paged_decode_attention(*args, 0.125, 0)


def test_compiles_once_for_every_batch_size() -> None:
    # under torch.compile(dynamic=True) the Meta kernel keeps B symbolic: one graph, no recompile
    graphs = []

    def count(gm: torch.fx.GraphModule, _inputs) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    def step(q, kc, vc, tables, lens):
        return paged_decode_attention(q, kc, vc, tables, lens, 0.125, -1) * 2

    compiled = torch.compile(step, backend=count, dynamic=True, fullgraph=True)
    storage, q, tables, lens, _ = build_cache(LENS, 9, 3, 64, torch.float32)
    kc, vc = storage.plane(0, "k").codes, storage.plane(0, "v").codes
    for b in (4, 5, 7):  # the first b requests; b equals no other size (duck sizing would tie it)
        args = (q[:b], kc, vc, tables[:b], lens[:b])
        torch.testing.assert_close(compiled(*args), step(*args))
    assert len(graphs) == 1


def test_meta_kernel_traces() -> None:
    # the Meta kernel gives torch.compile / FakeTensor the output shape and dtype
    storage, q, tables, lens, _ = build_cache([5, 20], 4, 2, 64, torch.bfloat16)
    args = (q, storage.plane(0, "k").codes, storage.plane(0, "v").codes, tables, lens, 0.125, -1)
    torch.library.opcheck(
        torch.ops.kvserve.paged_decode_attention.default,
        args,
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1), (12, 2)])
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
def test_bf16_cache_paths_agree_with_scalar(head_dim, heads, kv_heads, block_size) -> None:
    # float32 queries over a bfloat16 cache: the products are exact in float32 on every path,
    # so the vector paths (on AVX-512 at these head_dims: the whole-task bf16 path, with its
    # even/odd lanes and 16-row reductions) differ from scalar only by summation order. (The
    # batch-invariant kernel, paged_attention_dp.cpp, has its own test in
    # test_bitwise_invariance.py: it rounds P to bfloat16.) Lengths cover a partial 16-row group, exact multiples of 16 and of the
    # block size.
    lens = [1, 15, 16, 17, 33, 100, 257]
    storage, q, tables, lens_t, _ = build_cache(
        lens, heads, kv_heads, head_dim, torch.bfloat16, block_size, seed=5
    )
    q = q.to(torch.bfloat16).float()
    args = (q, storage.plane(0, "k").codes, storage.plane(0, "v").codes, tables, lens_t)
    scale = 2.0 ** -round(math.log2(head_dim) / 2)
    scalar = paged_decode_attention(*args, scale, 0)
    for isa in supported_isas()[1:]:
        out = paged_decode_attention(*args, scale, isa)
        torch.testing.assert_close(out, scalar, atol=3e-6, rtol=1e-5)
