"""The bfloat16 quantized kernel (kvserve::quant_matmul_bf16) and where it is chosen.

- against its definition: bf16 activations times bf16(dequantize(W)), summed in float32
  (computed here in float64), for every format and tile-edge shape;
- the policy picks it only for bfloat16 activations, only where it was measured faster, and
  never on a CPU without AVX-512-BF16 (KVSERVE_CPU_FEATURES=avx512 caps it off);
- the fused decode step through it agrees with the eager layers through it.

The kernel itself needs AVX-512-BF16: on a CPU without it (Zen 3) those tests skip, saying so,
and the policy tests still run (they check it is never chosen there).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from test_fused_decode import both_ways, load, prefilled
from test_quant_kernels import (
    M_VALUES,
    k_values,
    kernels,  # noqa: F401 - the fixture: the extension, built
    random_blocks,
)

from kvserve.kernels.quant_ops import QuantPolicy, quant_linear
from kvserve.kernels.quant_ref import SUPPORTED_QTYPES, dequantize_ref
from kvserve.models.gguf_checkpoint import QuantizedTensor
from kvserve.models.quantized_linear import QuantizedLinear
from kvserve.models.weight_formats import _policies
from kvserve.platform import detect_cpu_features


@pytest.fixture(scope="module")
def bf16_kernel(kernels: None) -> None:  # noqa: F811 - uses the imported fixture
    if not torch.ops.kvserve.cpu_has_avx512_bf16():
        pytest.skip("this CPU lacks AVX-512-BF16: the bf16 kernel is never chosen here")


def definition(x: torch.Tensor, w: torch.Tensor, qtype: QT, n: int, k: int) -> torch.Tensor:
    wb = dequantize_ref(w, qtype, n, k).bfloat16().double()
    return x.double() @ wb.T


@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES, ids=lambda t: t.name)
def test_matches_its_definition(bf16_kernel: None, qtype: QT) -> None:
    g = torch.Generator().manual_seed(3)
    for k in k_values(qtype):  # odd multiples of 32 hit the one-row tile's tail
        for n in (1, 5, 64):  # tails of the 4-row weight tile
            w = random_blocks(qtype, n, k, seed=n + k)
            for m in M_VALUES:
                x = torch.randn(m, k, generator=g).bfloat16()
                got = torch.ops.kvserve.quant_matmul_bf16(x, w, int(qtype), n)
                want = definition(x, w, qtype, n, k)
                assert got.dtype == torch.float32 and got.shape == (m, n)
                # exact products, float32 sums: error ~ K * eps * |x||w|
                bound = 1e-6 * k * (x.double().abs() @ wb_abs(w, qtype, n, k).T) + 1e-30
                assert ((got.double() - want).abs() <= bound).all(), (qtype.name, m, n, k)


def wb_abs(w: torch.Tensor, qtype: QT, n: int, k: int) -> torch.Tensor:
    return dequantize_ref(w, qtype, n, k).bfloat16().double().abs()


@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES, ids=lambda t: t.name)
def test_panel_gemm_matches_its_definition(bf16_kernel: None, qtype: QT) -> None:
    """Around the panel GEMM's first row (one below it the dot tiles) and past it: row tails
    of its 6-row tile; weight rows filling none, part or all of a 16-row transpose group and
    of a 64-row panel (its bf16 panel is built 16 rows at a time); K across 256-value
    chunks, with a short last one."""
    rows = int(torch.ops.kvserve.quant_bf16_gemm_min_rows())  # kGemmMinRowsBf16
    assert rows == 128
    g = torch.Generator().manual_seed(5)
    for n, k in [(5, k_values(qtype)[1]), (30, k_values(qtype)[2]), (130, k_values(qtype)[3])]:
        w = random_blocks(qtype, n, k, seed=n + 7)
        x = torch.randn(rows + 5, k, generator=g).bfloat16()
        want_all = definition(x, w, qtype, n, k)
        bound_all = 1e-6 * k * (x.double().abs() @ wb_abs(w, qtype, n, k).T) + 1e-30
        for m in (rows - 1, rows, rows + 5):
            got = torch.ops.kvserve.quant_matmul_bf16(x[:m], w, int(qtype), n)
            err = (got.double() - want_all[:m]).abs()
            assert (err <= bound_all[:m]).all(), (qtype.name, m, n, k)


@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES, ids=lambda t: t.name)
def test_dequantize_bf16_is_dequantize_then_round(kernels: None, qtype: QT) -> None:  # noqa: F811
    """The prefill's one-pass dequantize to bfloat16 equals dequantize + .to(bfloat16) bit for
    bit (any CPU: its rounding falls back to c10::BFloat16's without AVX-512-BF16)."""
    for k in k_values(qtype):
        for n in (1, 5, 64):
            w = random_blocks(qtype, n, k, seed=7 * n + k)
            got = torch.ops.kvserve.dequantize_bf16(w, int(qtype), n, k)
            want = torch.ops.kvserve.dequantize(w, int(qtype), n, k).to(torch.bfloat16)
            assert got.dtype == torch.bfloat16 and torch.equal(
                got.view(torch.int16), want.view(torch.int16)
            ), (qtype.name, n, k)
            assert torch.equal(got, dequantize_ref(w, qtype, n, k).bfloat16())


def test_refuses_float32_activations(bf16_kernel: None) -> None:
    w = random_blocks(QT.Q8_0, 4, 64)
    with pytest.raises(RuntimeError, match="x must be a contiguous 2-D bfloat16 tensor"):
        torch.ops.kvserve.quant_matmul_bf16(torch.randn(2, 64), w, int(QT.Q8_0), 4)


def test_policy_routes_rows() -> None:
    policy = QuantPolicy(
        use_kernels=True, kernel_max_rows=4, native_bf16=True, bf16_kernel_max_rows=64
    )
    assert [policy.path(m, bf16=True) for m in (1, 4, 5, 64, 65)] == [
        "kernel",
        "kernel",
        "bf16 kernel",
        "bf16 kernel",
        "dequant+matmul",
    ]
    assert policy.path(5, bf16=False) == "dequant+matmul"  # float32 activations: never
    with pytest.raises(ValueError, match="bf16_kernel_max_rows must be >= 0, and 0 unless"):
        QuantPolicy(use_kernels=True, bf16_kernel_max_rows=8)


def test_eager_linear_through_the_bf16_kernel(bf16_kernel: None) -> None:
    n, k = 8, 96
    w = random_blocks(QT.Q4_1, n, k)
    policy = QuantPolicy(
        use_kernels=True, kernel_max_rows=0, native_bf16=True, bf16_kernel_max_rows=64
    )
    x = torch.randn(3, 5, k).bfloat16()
    got = quant_linear(x, w, int(QT.Q4_1), n, policy)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 5, n)
    want = definition(x.reshape(-1, k), w, QT.Q4_1, n, k).reshape(3, 5, n)
    torch.testing.assert_close(got.double(), want.bfloat16().double(), rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize("cap", ["avx2", "avx512"])
def test_never_chosen_without_avx512_bf16(kernels: None, cap: str) -> None:  # noqa: F811
    features = detect_cpu_features(cap)
    assert not features.avx512_bf16
    w = random_blocks(QT.Q8_0, 64, 64)
    policies = _policies(
        {"w": QuantizedTensor(w, int(QT.Q8_0), (64, 64))},
        torch.device("cpu"),
        features,
        torch.bfloat16,
    )
    assert all(p.bf16_kernel_max_rows == 0 for p in policies.values())


@pytest.mark.parametrize("cap", ["avx2", "avx512", "avx512_bf16"])
def test_amx_never_chosen_below_the_amx_level(kernels: None, cap: str) -> None:  # noqa: F811
    """Capped below ``amx`` (or on a CPU without it: Zen 3 / Zen 5) no weight takes the AMX
    tiles; the bf16 kernel or the float32 one runs instead."""
    features = detect_cpu_features(cap)
    assert not features.amx_bf16
    w = random_blocks(QT.Q4_1, 64, 256)
    policies = _policies(
        {"w": QuantizedTensor(w, int(QT.Q4_1), (64, 256))},
        torch.device("cpu"),
        features,
        torch.bfloat16,
    )
    assert all(p.amx_min_rows == 0 for p in policies.values())


@pytest.mark.parametrize("amx_min_rows", [0, 1], ids=["vdpbf16ps", "amx"])
def test_fused_decode_through_the_bf16_kernel(
    bf16_kernel: None, tmp_path: Path, amx_min_rows: int
) -> None:
    """decode_layers against the eager layers, every weight on the bf16 kernel: its
    VDPBF16PS tiles, or its AMX ones (flag 2; the VDPBF16PS tiles where the CPU lacks AMX)."""
    model = load(tmp_path, dtype="bfloat16")
    forced = QuantPolicy(
        use_kernels=True,
        kernel_max_rows=0,
        native_bf16=True,
        bf16_kernel_max_rows=64,
        amx_min_rows=amx_min_rows,
    )
    for m in model.modules():  # every quantized layer, eager and fused, on the bf16 kernel
        if isinstance(m, QuantizedLinear):
            m.qweight = m.gguf_rows()  # GGUF rows, where the load interleaved them
            m.policy = forced
    storage, md, ids, pos = prefilled(model, [6, 11])
    (eager, eager_kv), (got, got_kv) = both_ways(model, storage, md, ids, pos)
    torch.testing.assert_close(got.float(), eager.float(), rtol=0.05, atol=0.05)
    torch.testing.assert_close(got_kv.float(), eager_kv.float(), rtol=0.05, atol=0.05)
