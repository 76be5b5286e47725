"""Quantized-weight kernels (kvserve::quant_matmul, kvserve::dequantize) against outside truths.

- `dequantize_ref` (PyTorch) equals gguf-py's `gguf.quants.dequantize` bit for bit;
- the C++ `dequantize` equals `dequantize_ref` bit for bit, on every ISA path;
- the C++ `quant_matmul` equals `reference_quant_matmul` up to float32 summation order, on
  every ISA path the CPU has (scalar always), for tile-edge shapes (M, N not multiples of the
  register tile; K spanning several blocks and several decode chunks);
- `quantize` is gguf-py's quantizer; KVSERVE_KERNELS=0 routes the dispatch to the reference.

Random blocks are random bytes with their fp16 scale fields replaced by sane finite values.
A C++ build failure on a machine with a compiler is a test error, never a skip.
"""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from kvserve.kernels import quant_ops
from kvserve.kernels.build import build_kernels, kernels_enabled, load_kernels
from kvserve.kernels.quant_ref import (
    QUANTIZABLE_QTYPES,
    SUPPORTED_QTYPES,
    block_size,
    dequantize_ref,
    dequantize_rows,
    quantize,
    reference_quant_matmul,
    row_bytes,
)

# Byte offsets of the fp16 fields (scales, mins) inside each block (llama.cpp's structs).
FP16_FIELDS = {
    QT.Q4_0: (0,),
    QT.Q4_1: (0, 2),
    QT.Q5_0: (0,),
    QT.Q5_1: (0, 2),
    QT.Q8_0: (0,),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
}
ISAS = (0, 1, 2)  # scalar, avx2+fma, avx512
M_VALUES = (1, 2, 3, 4, 5, 8, 17, 64)


def random_blocks(qtype: QT, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 (n, row_bytes): random codes, fp16 scales of magnitude 1e-3 .. 5e-2 (either sign)."""
    g = torch.Generator().manual_seed(seed)
    elems, nbytes = block_size(qtype)
    nblocks = n * (k // elems)
    blocks = torch.randint(0, 256, (nblocks, nbytes), dtype=torch.uint8, generator=g)
    for off in FP16_FIELDS[qtype]:
        mag = torch.rand(nblocks, generator=g) * 0.049 + 0.001
        sign = torch.where(torch.rand(nblocks, generator=g) < 0.5, -1.0, 1.0)
        blocks[:, off : off + 2] = (mag * sign).half().view(torch.uint8).reshape(nblocks, 2)
    return blocks.reshape(n, -1)


def k_values(qtype: QT) -> tuple[int, ...]:
    # several blocks; the largest spans more than one 1024-value decode chunk
    return (256, 512, 768, 1280) if block_size(qtype)[0] == 256 else (32, 96, 576, 2080)


@pytest.fixture(scope="module")
def kernels() -> None:
    """The compiled extension; a build failure is an error with the compiler's message."""
    if not kernels_enabled():
        pytest.skip("KVSERVE_KERNELS=0 turns the C++ kernels off")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine; the PyTorch reference is used")
    if not load_kernels():
        build_kernels(verbose=True)  # raises with the reason


def supported_isas() -> list[int]:
    return list(range(int(torch.ops.kvserve.cpu_isa()) + 1))


@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES, ids=lambda t: t.name)
def test_dequantize_ref_matches_gguf_exactly(qtype: QT) -> None:
    for n, k in [(1, k_values(qtype)[0]), (7, k_values(qtype)[1]), (33, k_values(qtype)[3])]:
        w = random_blocks(qtype, n, k, seed=n)
        expected = gguf.quants.dequantize(w.numpy(), qtype)  # (n, k) float32
        got = dequantize_ref(w, qtype, n, k)
        assert got.dtype == torch.float32 and got.shape == (n, k)
        assert np.array_equal(got.numpy(), expected), (qtype.name, n, k)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES, ids=lambda t: t.name)
def test_kernel_dequantize_matches_ref_exactly(kernels: None, qtype: QT, isa: int) -> None:
    if isa not in supported_isas():
        pytest.skip(f"CPU lacks isa {isa} (test_unsupported_isa_raises covers it)")
    for n, k in [(1, k_values(qtype)[0]), (33, k_values(qtype)[3])]:
        w = random_blocks(qtype, n, k, seed=k)
        got = torch.ops.kvserve.dequantize(w, int(qtype), n, k, isa)
        assert torch.equal(got, dequantize_ref(w, qtype, n, k)), (qtype.name, isa, n, k)


@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES, ids=lambda t: t.name)
def test_quantized_embedding_lookup_equals_the_reference(
    kernels: None, qtype: QT, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedding lookup dequantizes its rows in C++ where the kernels are loaded: the
    same floats as the PyTorch reference it falls back to (KVSERVE_KERNELS=0)."""
    from kvserve.models.quantized_linear import QuantizedEmbedding

    vocab, k = 50, k_values(qtype)[1]
    emb = QuantizedEmbedding(
        random_blocks(qtype, vocab, k, seed=3), int(qtype), vocab, k, torch.float32
    )
    ids = torch.tensor([[3, 0, 49], [7, 7, 12]])
    got = emb(ids)
    monkeypatch.setenv("KVSERVE_KERNELS", "0")
    want = emb(ids)
    assert got.shape == (2, 3, k)
    assert torch.equal(got, want)
    assert torch.equal(want[1, 0], dequantize_ref(emb.qweight[7:8], qtype, 1, k)[0])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES, ids=lambda t: t.name)
def test_quant_matmul_matches_reference(kernels: None, qtype: QT, isa: int) -> None:
    if isa not in supported_isas():
        pytest.skip(f"CPU lacks isa {isa} (test_unsupported_isa_raises covers it)")
    g = torch.Generator().manual_seed(1)
    ks = k_values(qtype)
    # every M against a few (N, K); N covers 1, below / above / at multiples of the 4-row tile
    cases = [
        (m, n, ks[i % len(ks)])
        for i, (m, n) in enumerate((m, n) for m in M_VALUES for n in (1, 7, 33))
    ]
    for m, n, k in cases:
        w = random_blocks(qtype, n, k, seed=m * 100 + n)
        x = torch.randn(m, k, generator=g)
        got = torch.ops.kvserve.quant_matmul(x, w, int(qtype), n, isa)
        wf = dequantize_ref(w, qtype, n, k)
        expected = reference_quant_matmul(x, w, qtype, n)
        # float32 reassociation bound, elementwise: a few ulps of sum |x| |w|
        bound = 1e-5 * (x.abs() @ wf.abs().T) + 1e-30
        assert got.shape == (m, n) and got.dtype == torch.float32
        err = (got - expected).abs()
        assert bool((err <= bound).all()), (qtype.name, isa, m, n, k, float((err / bound).max()))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES, ids=lambda t: t.name)
def test_batch_one_kernel_reads_every_value_exactly(kernels: None, qtype: QT, isa: int) -> None:
    # x = one-hot rows: each output is one product 1.0 * w[n, k] plus exact zeros, so the
    # batch-1 GEMV (values decoded in registers: for Q4_0 / Q4_1 on AVX-512 by a 16-entry
    # table per block) must give the dequantizer's value bit for bit.
    if isa not in supported_isas():
        pytest.skip(f"CPU lacks isa {isa} (test_unsupported_isa_raises covers it)")
    n, k = 9, k_values(qtype)[0]
    w = random_blocks(qtype, n, k, seed=11)
    eye = torch.eye(k)
    got = torch.cat(
        [torch.ops.kvserve.quant_matmul(eye[i : i + 1], w, int(qtype), n, isa) for i in range(k)]
    )
    assert torch.equal(got.T, dequantize_ref(w, qtype, n, k)), (qtype.name, isa)


# (isa, qtype) with a register GEMV for 2-4 rows: AVX2 for the 4-bit formats, AVX-512 for
# those and Q8_0
FEW_ROWS_GEMV = [(1, QT.Q4_0), (1, QT.Q4_1), (2, QT.Q4_0), (2, QT.Q4_1), (2, QT.Q8_0)]


@pytest.mark.parametrize(("isa", "qtype"), FEW_ROWS_GEMV, ids=lambda v: getattr(v, "name", v))
def test_few_rows_in_registers_equal_batch_one_bit_for_bit(
    kernels: None, isa: int, qtype: QT
) -> None:
    """2..4 activation rows (the register GEMV of a few decodes): each row of the result is
    exactly the batch-1 GEMV's for that row alone (the same operations per row). The dot
    tiles that took these rows before differ from batch 1 in the last bits."""
    if isa not in supported_isas():
        pytest.skip(f"CPU lacks isa {isa} (test_unsupported_isa_raises covers it)")
    g = torch.Generator().manual_seed(3)
    for n in (1, 3, 4, 7, 33):  # odd tails: a weight-row pair and a single row (AVX-512)
        k = 576
        w = random_blocks(qtype, n, k, seed=n)
        for m in (2, 3, 4):
            x = torch.randn(m, k, generator=g)
            got = torch.ops.kvserve.quant_matmul(x, w, int(qtype), n, isa)
            alone = torch.cat(
                [
                    torch.ops.kvserve.quant_matmul(x[i : i + 1], w, int(qtype), n, isa)
                    for i in range(m)
                ]
            )
            assert torch.equal(got, alone), (qtype.name, isa, m, n)


# rows past the ones from which quant_matmul (float32: 384 on AVX-512, 64 on AVX2) and
# quant_matmul_bf16 (128) switch to the panel GEMM (kGemmMinRows* in csrc/quant_kernels.h);
# 401 = 66 tiles of 6 and a 5-row tail
GEMM_ROWS = 401


@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES, ids=lambda t: t.name)
def test_panel_gemm_matches_reference_at_every_tile_edge(kernels: None, qtype: QT) -> None:
    """The panel GEMM forced at any row count (quant_matmul_gemm), on each SIMD path the CPU
    has: row tails of the 6-row tile, a partial 16-column group and partial 64-row panels,
    K across 256-value panel chunks."""
    g = torch.Generator().manual_seed(3)
    isas = [i for i in supported_isas() if i > 0]
    if not isas:
        pytest.skip("the panel GEMM needs the AVX2 or AVX-512 path; this CPU has neither")
    for n, k in [(5, k_values(qtype)[1]), (70, k_values(qtype)[2]), (130, k_values(qtype)[3])]:
        w = random_blocks(qtype, n, k, seed=n + 1)
        wf = dequantize_ref(w, qtype, n, k)
        for m in (1, 5, 6, 7, 13):
            x = torch.randn(m, k, generator=g)
            expected = reference_quant_matmul(x, w, qtype, n)
            bound = 1e-5 * (x.abs() @ wf.abs().T) + 1e-30
            for isa in isas:
                got = torch.ops.kvserve.quant_matmul_gemm(x, w, int(qtype), n, isa)
                err = (got - expected).abs()
                assert bool((err <= bound).all()), (qtype.name, isa, m, n, k)


def test_quant_matmul_takes_the_panel_gemm_from_its_row_threshold(kernels: None) -> None:
    """At the ISA's threshold quant_matmul is the panel GEMM bit for bit; one row below it, the
    dot tiles (which sum in another order: not bit-equal on these values)."""
    qtype, n, k = QT.Q4_1, 70, 576
    w = random_blocks(qtype, n, k, seed=4)
    g = torch.Generator().manual_seed(4)
    for isa in [i for i in supported_isas() if i > 0]:
        rows = int(torch.ops.kvserve.quant_gemm_min_rows(isa))
        assert rows == {1: 64, 2: 384}[isa]
        x = torch.randn(rows, k, generator=g)
        gemm = torch.ops.kvserve.quant_matmul_gemm(x, w, int(qtype), n, isa)
        assert torch.equal(torch.ops.kvserve.quant_matmul(x, w, int(qtype), n, isa), gemm)
        below = torch.ops.kvserve.quant_matmul(x[:-1], w, int(qtype), n, isa)
        assert not torch.equal(below, gemm[:-1])
    assert int(torch.ops.kvserve.quant_gemm_min_rows(0)) == -1  # scalar: never
    with pytest.raises(RuntimeError, match="panel GEMM needs the avx2"):
        torch.ops.kvserve.quant_matmul_gemm(torch.randn(2, k), w, int(qtype), n, 0)


@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES, ids=lambda t: t.name)
def test_many_rows_gemm_path_matches_reference(kernels: None, qtype: QT) -> None:
    g = torch.Generator().manual_seed(2)
    best = int(torch.ops.kvserve.cpu_isa())
    # N: one partial 64-row panel, two panels and a tail; K: across 256-value panel chunks
    for n, k in [(5, k_values(qtype)[1]), (130, k_values(qtype)[3])]:
        w = random_blocks(qtype, n, k, seed=n)
        x = torch.randn(GEMM_ROWS, k, generator=g)
        wf = dequantize_ref(w, qtype, n, k)
        expected = reference_quant_matmul(x, w, qtype, n)
        bound = 1e-5 * (x.abs() @ wf.abs().T) + 1e-30
        for isa in range(best + 1):  # AVX-512 / AVX2: the panel GEMM; scalar: the dot tiles
            got = torch.ops.kvserve.quant_matmul(x, w, int(qtype), n, isa)
            assert bool(((got - expected).abs() <= bound).all()), (qtype.name, isa, n, k)
        if torch.ops.kvserve.cpu_has_avx512_bf16():
            xb = x.bfloat16()
            want = xb.double() @ wf.bfloat16().double().T
            got = torch.ops.kvserve.quant_matmul_bf16(xb, w, int(qtype), n).double()
            bound = 1e-5 * (xb.double().abs() @ wf.bfloat16().double().abs().T) + 1e-30
            assert bool(((got - want).abs() <= bound).all()), ("bf16", qtype.name, n, k)


def test_unsupported_isa_raises(kernels: None) -> None:
    w = random_blocks(QT.Q8_0, 4, 64)
    x = torch.randn(2, 64)
    best = int(torch.ops.kvserve.cpu_isa())
    assert best in ISAS
    for isa in range(best + 1, 3):  # empty on an AVX-512 machine
        with pytest.raises(RuntimeError, match="not supported by this CPU"):
            torch.ops.kvserve.quant_matmul(x, w, int(QT.Q8_0), 4, isa)
    with pytest.raises(RuntimeError, match="isa must be"):
        torch.ops.kvserve.quant_matmul(x, w, int(QT.Q8_0), 4, 7)


def test_bad_inputs_raise(kernels: None) -> None:
    w = random_blocks(QT.Q4_0, 4, 64)
    with pytest.raises(RuntimeError, match="unsupported GGML quantization type 10"):
        torch.ops.kvserve.quant_matmul(torch.randn(1, 64), w, 10, 4)
    with pytest.raises(RuntimeError, match=r"must be \(4, 54\), got \[4, 36\]"):
        torch.ops.kvserve.quant_matmul(torch.randn(1, 96), w, int(QT.Q4_0), 4)
    with pytest.raises(ValueError, match="unsupported quantization type Q2_K"):
        dequantize_ref(w, QT.Q2_K, 4, 256)


def test_meta_kernels_give_shapes(kernels: None) -> None:
    w = random_blocks(QT.Q4_K, 5, 512).to("meta")
    y = torch.ops.kvserve.quant_matmul(torch.empty(3, 512, device="meta"), w, int(QT.Q4_K), 5)
    assert y.device.type == "meta" and y.shape == (3, 5) and y.dtype == torch.float32
    d = torch.ops.kvserve.dequantize(w, int(QT.Q4_K), 5, 512)
    assert d.device.type == "meta" and d.shape == (5, 512)


@pytest.mark.parametrize("rows", [1, 4, 5])
def test_policy_paths_agree(kernels: None, rows: int) -> None:
    # kernel up to 4 rows, C++ dequantize + F.linear above, and the pure-PyTorch reference
    w = random_blocks(QT.Q4_1, 33, 96)
    x = torch.randn(rows, 96)
    fast = quant_ops.QuantPolicy(use_kernels=True, kernel_max_rows=4)
    assert fast.path(rows) == ("kernel" if rows <= 4 else "dequant+matmul")
    want = quant_ops.quant_linear(x, w, QT.Q4_1, 33, quant_ops.REFERENCE_POLICY)
    torch.testing.assert_close(want, reference_quant_matmul(x, w, QT.Q4_1, 33), atol=0, rtol=0)
    got = quant_ops.quant_linear(x, w, QT.Q4_1, 33, fast)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_dispatch_dtypes_and_leading_dims(kernels: None) -> None:
    w = random_blocks(QT.Q4_1, 33, 96)
    x = torch.randn(2, 3, 96).to(torch.bfloat16)
    policy = quant_ops.QuantPolicy(use_kernels=True)
    y = quant_ops.quant_linear(x, w, QT.Q4_1, 33, policy)
    expected = reference_quant_matmul(x.float().reshape(6, 96), w, QT.Q4_1, 33).reshape(2, 3, 33)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 33)
    # float32 inside, one bf16 rounding out: within half a bf16 ulp of the float32 result
    torch.testing.assert_close(y.float(), expected, rtol=2**-8, atol=1e-6)


def test_kernels_off_uses_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_KERNELS", "0")
    assert not load_kernels()
    calls = []

    def spy(*args):
        calls.append(args)
        return dequantize_ref(*args)

    monkeypatch.setattr(quant_ops, "dequantize_ref", spy)
    w = random_blocks(QT.Q8_0, 7, 64)
    x = torch.randn(3, 64, dtype=torch.float16)
    y = quant_ops.quant_linear(x, w, QT.Q8_0, 7, quant_ops.REFERENCE_POLICY)
    assert len(calls) == 1 and y.dtype == torch.float16 and y.shape == (3, 7)
    want = reference_quant_matmul(x.float(), w, QT.Q8_0, 7).to(torch.float16)
    torch.testing.assert_close(y, want, atol=0, rtol=0)


@pytest.mark.parametrize("qtype", QUANTIZABLE_QTYPES, ids=lambda t: t.name)
def test_quantize_is_gguf_and_round_trips(qtype: QT) -> None:
    w = torch.randn(9, 128, generator=torch.Generator().manual_seed(3))
    q = quantize(w, qtype)
    assert q.dtype == torch.uint8 and q.shape == (9, row_bytes(qtype, 128))
    assert np.array_equal(q.numpy(), gguf.quants.quantize(w.numpy(), qtype))
    back = dequantize_ref(q, qtype, 9, 128)
    assert np.array_equal(back.numpy(), gguf.quants.dequantize(q.numpy(), qtype))
    # each value within one quantization step of its block's range
    blocks = w.reshape(-1, 32)
    levels = {QT.Q8_0: 127, QT.Q4_0: 7, QT.Q4_1: 15, QT.Q5_0: 15, QT.Q5_1: 31}[qtype]
    step = (blocks.abs().amax(-1, keepdim=True) * 2 / levels).expand_as(blocks)
    assert bool(((back.reshape(-1, 32) - blocks).abs() <= step).all())


def test_dequantize_rows_is_an_embedding_lookup() -> None:
    table = random_blocks(QT.Q8_0, 50, 64)
    ids = torch.tensor([[3, 49, 3], [0, 7, 12]])
    rows = dequantize_rows(table, QT.Q8_0, ids, 64)
    assert rows.shape == (2, 3, 64)
    assert torch.equal(rows, dequantize_ref(table, QT.Q8_0, 50, 64)[ids])


def test_bf16_dequant_matmul_path_is_bf16_gemm_of_the_reference(kernels: None) -> None:
    # a bfloat16 model on a native-bf16 CPU multiplies above the kernel's rows in bfloat16;
    # correct (only slow) on any CPU, so it is checked everywhere
    w = random_blocks(QT.Q4_1, 33, 96)
    x = torch.randn(9, 96).to(torch.bfloat16)
    policy = quant_ops.QuantPolicy(use_kernels=True, kernel_max_rows=4, native_bf16=True)
    assert policy.path(9) == "dequant+matmul"
    got = quant_ops.quant_linear(x, w, QT.Q4_1, 33, policy)
    want = torch.nn.functional.linear(x, dequantize_ref(w, QT.Q4_1, 33, 96).to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0, rtol=0)
