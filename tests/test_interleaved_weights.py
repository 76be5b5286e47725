"""Interleaved weights (kernels/interleaved_weights.py) and their kernel,
``kvserve::interleaved_matmul_bf16`` (kernels/csrc/quant_interleaved.cpp): the layout is a
lossless permutation of the GGUF bytes (Q4_K: a bijective re-encoding), the kernel equals its
float64 twin within float32 rounding, and a row's result has the same bits at any row count
(batch-invariant mode's rule).
"""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels.build import load_kernels
from kvserve.kernels.interleaved_weights import (
    deinterleave,
    deinterleave_rows,
    interleavable,
    interleave,
    interleaved_matmul_ref,
)
from kvserve.kernels.quant_ref import QT, block_size, dequantize_ref, quantize

TYPES = [2, 3, 8, 12, 13, 14]  # Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K
KQUANTS = (12, 13, 14)
# byte offsets of a K-quant block's fp16 fields (d, dmin)
KQUANT_FP16 = {12: (0, 2), 13: (0, 2), 14: (208,)}

needs_kernel = pytest.mark.skipif(
    not (load_kernels() and torch.ops.kvserve.cpu_has_avx512_bf16()),
    reason="the interleaved kernel needs AVX-512-BF16 and the C++ kernels",
)


def _weight(qtype: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """GGUF rows with extreme scales in one row and tiny ones in another. gguf-py does not
    quantize the K-quants: theirs are random codes and 6/8-bit scales with random fp16 d."""
    torch.manual_seed(seed)
    if qtype not in KQUANTS:
        w = torch.randn(n, k)
        w[0] *= 1e4
        w[-1] *= 1e-4
        return quantize(w, qtype)
    _, nbytes = block_size(QT(qtype))
    blocks = torch.randint(0, 256, (n, k // 256, nbytes), dtype=torch.uint8)
    for off in KQUANT_FP16[qtype]:
        d = torch.rand(n, k // 256) * 0.049 + 0.001
        d[0] *= 1e3
        d[-1] *= 1e-3
        blocks[..., off : off + 2] = d.half().view(torch.uint8).reshape(n, k // 256, 2)
    return blocks.reshape(n, -1)


def _k(qtype: int, k: int) -> int:
    """k for a 32-value format, or the next multiple of 256 for a K-quant."""
    return -(-k // 256) * 256 if qtype in KQUANTS else k


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [1, 16, 37, 192])
def test_interleaving_is_a_lossless_permutation(qtype: int, n: int) -> None:
    k = _k(qtype, 96) * (2 if qtype in KQUANTS else 1)
    q = _weight(qtype, n, k)
    rows = interleave(q, qtype, n, k)
    per = 256 if qtype in KQUANTS else 32
    assert rows.shape == (
        -(-n // 16),
        k // per,
        {2: 288, 3: 320, 8: 544, 12: 2368, 13: 2880, 14: 3360}[qtype],
    )
    assert torch.equal(deinterleave(rows, qtype, n, k), q)
    ids = torch.tensor([n - 1, 0, n // 2, 0])
    assert torch.equal(deinterleave_rows(rows, qtype, ids, k), q[ids])


def test_which_formats_interleave() -> None:
    assert [t for t in (2, 3, 6, 7, 8, 10, 11, 12, 13, 14) if interleavable(t)] == TYPES
    with pytest.raises(ValueError, match="no interleaved layout for GGML type 6"):
        interleave(torch.zeros(16, 22, dtype=torch.uint8), 6, 16, 32)
    with pytest.raises(ValueError, match=r"qweight must be uint8 \(16, 18\)"):
        interleave(torch.zeros(16, 17, dtype=torch.uint8), 2, 16, 32)


@pytest.mark.parametrize("qtype", TYPES)
def test_the_twin_is_the_dequantized_product(qtype: int) -> None:
    """The float64 twin sums per block with scales outside; exactly, that is x @ W.T."""
    n, k = 40, _k(qtype, 128)
    q = _weight(qtype, n, k)
    x = torch.randn(5, k).to(torch.bfloat16).float()
    want = x.double() @ dequantize_ref(q, qtype, n, k).double().T
    got = interleaved_matmul_ref(x, interleave(q, qtype, n, k), qtype, n)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9 * want.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n, k", [(37, 64), (192, 576), (50, 1536)])
def test_kernel_matches_its_twin(qtype: int, n: int, k: int) -> None:
    k = _k(qtype, k)
    q = _weight(qtype, n, k, seed=n + k)
    rows = interleave(q, qtype, n, k)
    x = torch.randn(13, k)
    want = interleaved_matmul_ref(x, rows, qtype, n)
    # float32 sums of k products: within a few ulps of the largest partial sum
    tol = 1e-5 * (
        x.to(torch.bfloat16).double().abs() @ dequantize_ref(q, qtype, n, k).double().abs().T
    )
    # every register-tile height alone (1..8 rows; 1 and 2 run 4 blocks side by side, so the
    # 18 blocks of a 32-value format at K=576 leave the remainder loop 2), then 13 = 8 + 5
    for m in (*range(1, 9), 13):
        got = torch.ops.kvserve.interleaved_matmul_bf16(x[:m].to(torch.bfloat16), rows, qtype, n)
        assert ((got.double() - want[:m]).abs() <= tol[:m] + 1e-30).all(), m


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
def test_kernel_gives_a_row_the_same_bits_at_any_row_count(qtype: int) -> None:
    """The issue's row counts, a tail group (70 rows: 4 groups + 6) and K of 48 blocks (the
    chains' remainder block when blocks run 2 and 4 side by side). Every register-tile height
    runs: 8 in the bulk, 7 (7 rows), 2, 4, 5, 6 (10, 12, 13, 14 rows: one tile of 8 first),
    3 and 1, each of the first 16 rows checked."""
    n, k = 70, 1536
    rows = interleave(_weight(qtype, n, k, seed=qtype), qtype, n, k)
    x = torch.randn(2049, k).to(torch.bfloat16)

    def mm(a: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvserve.interleaved_matmul_bf16(a.contiguous(), rows, qtype, n)

    picks = sorted(set(range(16)) | set(range(0, 2049, 97)))
    alone = torch.cat([mm(x[i : i + 1]) for i in picks])
    for m in (1, 3, 7, 10, 12, 13, 14, 17, 64, 129, 512, 2049):
        got = mm(x[:m])
        for j, i in enumerate(picks):
            if i < m:
                assert torch.equal(got[i], alone[j]), (m, i)


@needs_kernel
def test_kernel_refuses_bad_input_by_name() -> None:
    rows = interleave(_weight(2, 32, 64), 2, 32, 64)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="interleaved weight must be contiguous uint8"):
        torch.ops.kvserve.interleaved_matmul_bf16(x, rows, 2, 48)
    with pytest.raises(RuntimeError, match="supports Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K"):
        torch.ops.kvserve.interleaved_matmul_bf16(x, rows, 6, 32)
    with pytest.raises(RuntimeError, match="multiple of 256 for type 12"):
        torch.ops.kvserve.interleaved_matmul_bf16(x, rows, 12, 32)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.kvserve.interleaved_matmul_bf16(x.float(), rows, 2, 32)


@needs_kernel
def test_weights_sharing_one_storage_unaligned_keep_gguf_rows_in_one_order() -> None:
    """Batch-invariant mode's weights: two unrelated weights in one buffer (as a memory-mapped
    file would hold them) are not owner and members: they stay GGUF rows, on the dot kernel's
    fixed order; a fused weight with its members interleaves, the members viewing its
    groups."""
    from torch import nn

    from kvserve.kernels.quant_ops import QuantPolicy
    from kvserve.models.fixed_order import fix_summation_order
    from kvserve.models.quantized_linear import QuantizedLinear

    policy = QuantPolicy(use_kernels=True, native_bf16=True, kernel_max_rows=0)
    k = 64
    a, b = _weight(2, 20, k, seed=1), _weight(2, 16, k, seed=2)
    buf = torch.cat([a, b])  # (36, 36): b starts at row 20, not a group boundary of a
    model = nn.ModuleDict(
        {
            "a": QuantizedLinear(buf[:20], 2, k, 20, policy),
            "b": QuantizedLinear(buf[20:], 2, k, 16, policy),
        }
    )
    assert fix_summation_order(model) == ""
    for name, q in (("a", a), ("b", b)):
        m = model[name]
        assert m.policy.fixed_order and not m.policy.interleaved
        assert torch.equal(m.qweight, q)

    fused = _weight(3, 48, k, seed=3)
    model = nn.ModuleDict(
        {
            "fused": QuantizedLinear(fused, 3, k, 48, policy),
            "q": QuantizedLinear(fused[:32], 3, k, 32, policy),
            "v": QuantizedLinear(fused[32:], 3, k, 16, policy),
        }
    )
    assert fix_summation_order(model) == ""
    x = torch.randn(3, k)
    whole = model["fused"](x)
    assert all(m.policy.interleaved for m in model.values())
    assert model["v"].qweight.untyped_storage().data_ptr() == (
        model["fused"].qweight.untyped_storage().data_ptr()
    )
    assert torch.equal(model["q"](x), whole[:, :32]) and torch.equal(model["v"](x), whole[:, 32:])
    assert torch.equal(model["v"].gguf_rows(), fused[32:])


@needs_kernel
def test_bf16_output_is_the_float32_output_rounded() -> None:
    rows = interleave(_weight(3, 40, 128), 3, 40, 128)
    x = torch.randn(7, 128).to(torch.bfloat16)
    f32 = torch.ops.kvserve.interleaved_matmul_bf16(x, rows, 3, 40)
    b16 = torch.ops.kvserve.interleaved_matmul_bf16(x, rows, 3, 40, True)
    assert b16.dtype == torch.bfloat16 and torch.equal(b16, f32.to(torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
def test_dequantizing_the_layout_equals_dequantizing_the_gguf_rows(qtype: int) -> None:
    """The default path's prefill multiplies an interleaved weight through oneDNN after
    kvserve::interleaved_dequantize_bf16: bit for bit what dequantize_bf16 gives the GGUF rows
    (a tail group: 37 rows)."""
    n, k = 37, _k(qtype, 512)
    q = _weight(qtype, n, k, seed=5)
    rows = interleave(q, qtype, n, k)
    got = torch.ops.kvserve.interleaved_dequantize_bf16(rows, qtype, n, k)
    want = torch.ops.kvserve.dequantize_bf16(q, qtype, n, k)
    assert got.dtype == torch.bfloat16 and torch.equal(
        got.view(torch.int16), want.view(torch.int16)
    )
