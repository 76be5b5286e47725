"""The C++ quantized-cache decode kernel (``kvserve::paged_decode_attention_quant``) against a
float64 reference over the cache as ``CacheDtype.dequantize`` reads it: every K / V format
pair, head_dim 64 / 128 / 96 / 80 (80: one group per head), GQA groups 1 / 3 / 8, block sizes
16 / 32 / 7 / 5, random lengths in shuffled blocks, K with outlier channels, q float32 and
bfloat16, every ISA path this CPU has. Plus the dequantize routines bit for bit
(``kvserve::kv_dequantize``; fp8 over all 256 bytes), threads, the float format against the
float kernel, the ISA argument, the input checks and the Meta kernel."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvserve.kernels.build import build_kernels
from kvserve.kernels.paged_attention_ops import (
    paged_decode_attention,
    paged_decode_attention_quant,
)
from kvserve.kv.cache_dtype import FORMAT_CODES, CacheDtype
from kvserve.platform import detect_cpu_features

FORMATS = ("int8", "int4_sym", "int4", "fp8_e4m3", "bfloat16")
# every same-format pair, and mixed ones a deployment would pick (K is the sensitive side)
PAIRS = [(f, f) for f in FORMATS] + [
    ("int4_sym", "int8"),
    ("int8", "int4_sym"),
    ("int8", "bfloat16"),
]
# (head_dim, heads, kv_heads, block_size, q dtype): GQA groups 3, 8, 1, 8, 1, 3
SHAPES = [
    (64, 9, 3, 16, torch.float32),
    (128, 16, 2, 16, torch.bfloat16),
    (80, 4, 4, 7, torch.float32),  # 80 % 32 != 0: one scale group per head
    (96, 24, 3, 32, torch.bfloat16),
    (64, 8, 8, 5, torch.bfloat16),
    (128, 6, 2, 16, torch.float32),
]
OUTLIERS = (3, 17, -5)  # K channels scaled x20, as real keys have


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    build_kernels()  # a broken build fails here with its compiler output, not a silent skip


def supported_isas() -> list[int]:
    """The paths this CPU can run, judged by torch's cpuinfo (not by the kernel's own check)."""
    f = detect_cpu_features("amx")  # the highest cap: everything the CPU has
    return [0] + ([1] if f.avx2 and f.fma else []) + ([2] if f.avx512 else [])


def make_case(kname, vname, head_dim, heads, kv_heads, block_size, lens, seed=0):
    """Random K / V over a pool of shuffled blocks (spare blocks hold garbage too), stored as
    kname / vname. Returns (kernel args without scale / isa, dequantized K, V, q float32)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    nblocks = sum(need) + 4
    perm = torch.randperm(nblocks, generator=gen).tolist()
    tables = torch.full((len(lens), max(need) + 2), -1, dtype=torch.long)  # -1: never read
    for i, nb in enumerate(need):
        tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
    shape = (nblocks, block_size, kv_heads, head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    k[..., list(OUTLIERS)] *= 20
    sides, dequantized = [], []
    for name, x in ((kname, k), (vname, v)):
        cd = CacheDtype(name)
        codes, scales, mins = cd.quantize(x)
        sides += [codes, scales, mins, cd.format_code]
        dequantized.append(cd.dequantize(codes, scales, mins, head_dim))
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    args = (q, *sides, tables, torch.tensor(lens))
    return args, dequantized[0], dequantized[1]


def reference(q, k, v, tables, lens, scale) -> torch.Tensor:
    """Float64 masked-softmax attention of q (B, H, D) over each request's gathered blocks of
    k / v (num_blocks, bs, KVH, D); query head h uses kv head h // (H / KVH)."""
    B, H, D = q.shape
    kvh = k.shape[2]
    kb = k[tables.clamp(min=0)].reshape(B, -1, kvh, D).double()  # (B, width * bs, KVH, D)
    vb = v[tables.clamp(min=0)].reshape(B, -1, kvh, D).double()
    qg = q.double().view(B, kvh, H // kvh, D) * scale
    s = torch.einsum("bkgd,bnkd->bkgn", qg, kb)
    pad = torch.arange(kb.shape[1]) >= lens[:, None]  # (B, n): past each request's end
    p = s.masked_fill(pad[:, None, None], float("-inf")).softmax(-1)
    return torch.einsum("bkgn,bnkd->bkgd", p, vb).reshape(B, H, D)


def random_lens(block_size: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [1, block_size, block_size + 1] + torch.randint(1, 301, (3,), generator=gen).tolist()


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """float32 accumulation: 1e-4 of the output's scale; a bfloat16 result also rounds."""
    assert out.dtype == dtype and out.shape == ref.shape
    atol = 1e-4 * ref.abs().max().item()
    rtol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"d{s[0]}-h{s[1]}-kv{s[2]}-bs{s[3]}")
@pytest.mark.parametrize("kname,vname", PAIRS, ids=[f"{k}-{v}" for k, v in PAIRS])
def test_matches_reference(kname, vname, shape, isa) -> None:
    head_dim, heads, kv_heads, bs, qdtype = shape
    lens = random_lens(bs, seed=head_dim + bs)
    args, k, v = make_case(kname, vname, head_dim, heads, kv_heads, bs, lens, seed=heads)
    q, tables, lens_t = args[0], args[-2], args[-1]
    scale = head_dim**-0.5
    out = paged_decode_attention_quant(q.to(qdtype), *args[1:], scale, isa)
    ref = reference(q.to(qdtype).float(), k, v, tables, lens_t, scale)
    check(out, ref, qdtype)


@pytest.mark.parametrize("kname,vname", list(itertools.product(FORMATS, FORMATS)), ids=lambda n: n)
def test_every_format_pair_on_the_default_isa(kname, vname) -> None:
    # isa None = default_isa(): AVX2 under KVSERVE_CPU_FEATURES=avx2, the best otherwise
    lens = random_lens(16, seed=1)
    args, k, v = make_case(kname, vname, 64, 9, 3, 16, lens, seed=2)
    out = paged_decode_attention_quant(*args, 0.125)
    check(out, reference(args[0], k, v, args[-2], args[-1], 0.125), torch.float32)


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("kname,vname", [("float16", "int8"), ("float32", "fp8_e4m3")])
def test_float16_and_float32_sides(kname, vname, isa) -> None:
    args, k, v = make_case(kname, vname, 128, 8, 2, 16, random_lens(16, seed=3), seed=4)
    out = paged_decode_attention_quant(*args, 0.1, isa)
    check(out, reference(args[0], k, v, args[-2], args[-1], 0.1), torch.float32)


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_float_format_is_the_float_kernel(dtype, isa) -> None:
    # format 0 runs paged_attention.cpp's typed primitives in the same order: bit for bit,
    # except where the float kernel takes its whole-task bf16 path (a bf16 cache on AVX-512
    # at head_dim 64): the same products summed in another order, so the bf16 outputs agree
    # within one bf16 rounding (that path is held to the scalar one in float32 by
    # test_paged_attention_kernel.py::test_bf16_cache_paths_agree_with_scalar)
    name = str(dtype).removeprefix("torch.")
    args, _, _ = make_case(name, name, 64, 9, 3, 16, random_lens(16, seed=5), seed=6)
    # bfloat16 queries: the AVX-512-BF16 path of the float kernel rounds the scaled query to
    # bfloat16, which then (a power-of-two scale) changes nothing
    args = (args[0].to(torch.bfloat16).to(args[0].dtype), *args[1:])
    q, kc, vc, tables, lens = args[0], args[1], args[5], args[-2], args[-1]
    out = paged_decode_attention_quant(*args, 0.125, isa)
    want = paged_decode_attention(q, kc, vc, tables, lens, 0.125, isa)
    if dtype == torch.bfloat16 and isa == 2:
        torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=1e-6)
    else:
        assert torch.equal(out, want)


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("head_dim", [64, 128, 96, 80, 20, 2])
@pytest.mark.parametrize("name", ["int8", "int4_sym", "int4", "fp8_e4m3"])
def test_dequantize_is_the_reference_bit_for_bit(name, head_dim, isa) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    x = torch.randn(61, head_dim, generator=gen) * torch.rand(61, 1, generator=gen) * 4
    x[:, head_dim // 3] *= 20
    x[7] = 0  # an all-zero group: scale 1, codes 0
    cd = CacheDtype(name)
    codes, scales, mins = cd.quantize(x)
    got = torch.ops.kvserve.kv_dequantize(codes, scales, mins, cd.format_code, isa)
    want = cd.dequantize(codes, scales, mins, head_dim)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # -0.0 included


@pytest.mark.parametrize("isa", supported_isas())
def test_fp8_every_byte(isa) -> None:
    # all 256 e4m3fn bytes: zeros of both signs, subnormals, normals, the two NaNs
    codes = torch.arange(256, dtype=torch.uint8).view(8, 32)
    scales = torch.ones(8, 1, dtype=torch.float16)
    got = torch.ops.kvserve.kv_dequantize(codes, scales, None, FORMAT_CODES["fp8_e4m3"], isa)
    want = codes.view(torch.float8_e4m3fn).float()
    nan = want.isnan()
    assert nan.sum() == 2 and torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
    scales.fill_(0.75)  # and times a scale: one rounding, as the reference
    got = torch.ops.kvserve.kv_dequantize(codes, scales, None, FORMAT_CODES["fp8_e4m3"], isa)
    assert torch.equal(got[~nan], (want * 0.75)[~nan])
    # a group holding a NaN byte takes the scalar table: the 254 others again, NaN-free rows
    # (+ two zeros), so every byte also goes through the vector decode
    finite = torch.cat([codes.flatten()[~nan.flatten()], torch.zeros(2, dtype=torch.uint8)])
    got = torch.ops.kvserve.kv_dequantize(finite.view(8, 32), scales, None, 4, isa)
    assert torch.equal(got, finite.view(8, 32).view(torch.float8_e4m3fn).float() * 0.75)


@pytest.mark.parametrize("isa", supported_isas())
def test_many_long_requests_on_threads(isa: int) -> None:
    # enough K/V rows (> 8192) that the (request, kv head) tasks spread over threads
    lens = [(37 * i) % 700 + 1 for i in range(24)]
    args, k, v = make_case("int4_sym", "int8", 64, 9, 3, 16, lens, seed=7)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = paged_decode_attention_quant(*args, 0.125, isa)
    finally:
        torch.set_num_threads(threads)
    check(out, reference(args[0], k, v, args[-2], args[-1], 0.125), torch.float32)


def test_isa_paths_agree_closely() -> None:
    # same inputs: the vector paths differ from scalar only by summation order (and exp's
    # polynomial): a few float32 ulps of the output's scale (K's outliers make scores ~20)
    args, _, _ = make_case("int4", "fp8_e4m3", 64, 9, 3, 16, random_lens(16, 8), seed=8)
    scalar = paged_decode_attention_quant(*args, 0.125, 0)
    for isa in supported_isas()[1:]:
        out = paged_decode_attention_quant(*args, 0.125, isa)
        torch.testing.assert_close(out, scalar, atol=1e-5 * scalar.abs().max().item(), rtol=0)


@pytest.mark.parametrize("isa", [-2, 3] + [i for i in (1, 2) if i not in supported_isas()])
def test_unsupported_isa_raises(isa: int) -> None:
    args, _, _ = make_case("int8", "int8", 64, 4, 2, 16, [5])
    with pytest.raises(RuntimeError, match="isa"):
        paged_decode_attention_quant(*args, 0.125, isa)
    with pytest.raises(RuntimeError, match="isa"):
        torch.ops.kvserve.kv_dequantize(args[1][0, 0], args[2][0, 0], None, 1, isa)


def test_bad_inputs_raise_naming_the_value() -> None:
    (q, kc, ks, km, kf, vc, vs, vm, vf, tables, lens), _, _ = make_case(
        "int4", "int8", 64, 4, 2, 16, [5, 20]
    )
    good = dict(q=q, kc=kc, ks=ks, km=km, kf=kf, vc=vc, vs=vs, vm=vm, vf=vf, t=tables, n=lens)
    cases = {
        "k_format must be 0 \\(float\\)": dict(kf=5),
        "v_format must be": dict(vf=-1),
        "v_scales must be given for v_format 1": dict(vs=None),
        "k_mins must be given for k_format 3": dict(km=None),
        "v_mins must be None for v_format 1": dict(vm=vs),
        "k_scales and k_mins must be None for k_format 0": dict(kf=0, kc=kc.float()),
        "v_codes dtype must be int8 for v_format 1 \\(int8\\), got uint8": dict(
            vc=vc.view(torch.uint8)
        ),
        "k_codes dtype must be int8 for k_format 1 \\(int8\\), got uint8": dict(kf=1, km=None),
        "k_codes dtype must be float32, bfloat16 or float16": dict(kf=0, ks=None, km=None),
        "v_scales must be \\[.*, 2\\]": dict(vs=vs[..., :1].contiguous()),
        "v_scales must be .* float16": dict(vs=vs.float()),
        "k_mins must be": dict(km=km[:-1]),
        "v_codes last dim must be 64": dict(vc=vc[..., :32].contiguous(), vs=vs[..., :1]),
        "v_codes must be \\(num_blocks": dict(vc=vc[:-1], vs=vs[:-1]),
        "k_codes must be \\(num_blocks": dict(kc=kc[0]),
        "contiguous": dict(vc=vc.transpose(0, 1).contiguous().transpose(0, 1)),
        "4-bit formats need an even head_dim": dict(q=q[..., :63]),
        "num_heads 3 must be a multiple of num_kv_heads 2": dict(q=q[:, :3]),
        "block_tables\\[0, 0\\] = 99": dict(t=torch.full_like(tables, 99)),
        "seq_lens\\[1\\] = 0": dict(n=torch.tensor([5, 0])),
        "seq_lens must be": dict(n=lens.int()),
        "block_tables must be": dict(t=tables[:1]),
        "q dtype": dict(q=q.double()),
    }
    for message, change in cases.items():
        a = {**good, **change}
        with pytest.raises(RuntimeError, match=message):
            paged_decode_attention_quant(
                a["q"], a["kc"], a["ks"], a["km"], a["kf"], a["vc"], a["vs"], a["vm"], a["vf"],
                a["t"], a["n"], 0.125, 0,
            )  # fmt: skip


def test_meta_kernel_traces_and_compiles_once() -> None:
    args, _, _ = make_case("int4_sym", "bfloat16", 64, 9, 3, 16, random_lens(16, 9))
    torch.library.opcheck(
        torch.ops.kvserve.paged_decode_attention_quant.default,
        (*args, 0.125, -1),
        test_utils=("test_schema", "test_faketensor"),
    )
    graphs = []

    def count(gm: torch.fx.GraphModule, _inputs) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    def step(q, *rest):
        return paged_decode_attention_quant(q, *rest, 0.125, -1) * 2

    compiled = torch.compile(step, backend=count, dynamic=True, fullgraph=True)
    q, sides, tables, lens = args[0], args[1:9], args[9], args[10]
    dims = {d for t in args if isinstance(t, torch.Tensor) for d in t.shape[1:]}
    batches = (4, 5, 6)
    assert not dims & set(batches)  # equal to another size, duck sizing would tie them
    for b in batches:
        got = compiled(q[:b], *sides, tables[:b], lens[:b])
        torch.testing.assert_close(got, step(q[:b], *sides, tables[:b], lens[:b]))
    assert len(graphs) == 1
