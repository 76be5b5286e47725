"""The AMX path of the bf16 quantized kernel (quant_amx.cpp) against its definition.

The same definition as the bf16 kernel's (tests/test_quant_bf16.py): bf16 activations times
bf16(dequantize(W)), products exact, sums in float32 (computed here in float64). Shapes hit
every tile edge: activation rows around 16 and 32 (B-tile pairs), weight rows around 16 and 32
(A-tile pairs), K one tile and several. AMX tiles exist only on Sapphire Rapids and later
Xeons: elsewhere these skip, saying so, and the op's amx_min_rows argument is a no-op (the
VDPBF16PS tiles run, tested in test_quant_bf16.py); the policy tests there run everywhere.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from test_quant_bf16 import definition, wb_abs
from test_quant_kernels import (
    kernels,  # noqa: F401 - the fixture: the extension, built
    random_blocks,
)

from kvserve.kernels.quant_ops import QuantPolicy
from kvserve.kernels.quant_ref import SUPPORTED_QTYPES


@pytest.fixture(scope="module")
def amx(kernels: None) -> None:  # noqa: F811 - uses the imported fixture
    if not torch.ops.kvserve.cpu_has_amx_bf16():
        pytest.skip("this CPU lacks AMX-BF16: the AMX path is never taken here")


@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES, ids=lambda t: t.name)
def test_amx_matches_its_definition(amx: None, qtype: QT) -> None:
    g = torch.Generator().manual_seed(5)
    for k in (256, 768):  # one K-quant block, and three (several A tiles per row)
        for n in (1, 16, 17, 33, 64):
            w = random_blocks(qtype, n, k, seed=n + k)
            for m in (1, 15, 16, 17, 32, 33, 70):
                x = torch.randn(m, k, generator=g).bfloat16()
                got = torch.ops.kvserve.quant_matmul_bf16(x, w, int(qtype), n, 1)
                want = definition(x, w, qtype, n, k)
                assert got.dtype == torch.float32 and got.shape == (m, n)
                bound = 1e-6 * k * (x.double().abs() @ wb_abs(w, qtype, n, k).T) + 1e-30
                assert ((got.double() - want).abs() <= bound).all(), (qtype.name, m, n, k)


def test_amx_from_its_rows_only(amx: None) -> None:
    """amx_min_rows = 40: 39 rows take the VDPBF16PS tiles, 40 the AMX ones; both agree."""
    w = random_blocks(QT.Q4_1, 48, 256, seed=1)
    x = torch.randn(40, 256).bfloat16()
    a = torch.ops.kvserve.quant_matmul_bf16(x, w, int(QT.Q4_1), 48, 40)
    b = torch.ops.kvserve.quant_matmul_bf16(x[:39], w, int(QT.Q4_1), 48, 40)
    torch.testing.assert_close(a[:39], b, rtol=1e-5, atol=1e-5)


def test_policy_path_amx() -> None:
    p = QuantPolicy(
        use_kernels=True,
        kernel_max_rows=4,
        native_bf16=True,
        bf16_kernel_max_rows=64,
        amx_min_rows=16,
    )
    assert [p.path(m, bf16=True) for m in (4, 5, 15, 16, 64, 65)] == [
        "kernel",
        "bf16 kernel",
        "bf16 kernel",
        "amx kernel",
        "amx kernel",
        "dequant+matmul",
    ]
    assert p.path(16, bf16=False) == "dequant+matmul"
    with pytest.raises(ValueError, match="amx_min_rows must be >= 0, and 0 unless"):
        QuantPolicy(use_kernels=True, native_bf16=True, amx_min_rows=8)


def test_fused_decode_through_amx(amx: None, tmp_path) -> None:
    """decode_layers with every weight on the AMX tiles (flag 2) agrees with the eager layers
    on the same path."""
    from test_fused_decode import both_ways, load, prefilled

    from kvserve.models.quantized_linear import QuantizedLinear

    model = load(tmp_path, dtype="bfloat16")
    forced = QuantPolicy(
        use_kernels=True,
        kernel_max_rows=0,
        native_bf16=True,
        bf16_kernel_max_rows=64,
        amx_min_rows=1,
    )
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            m.policy = forced
    storage, md, ids, pos = prefilled(model, [6, 11])
    (eager, eager_kv), (got, got_kv) = both_ways(model, storage, md, ids, pos)
    torch.testing.assert_close(got.float(), eager.float(), rtol=0.05, atol=0.05)
    torch.testing.assert_close(got_kv.float(), eager_kv.float(), rtol=0.05, atol=0.05)
