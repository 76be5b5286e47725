"""The AMX path of the bf16 quantized kernel (quant_amx.cpp) against its definition.

The same definition as the bf16 kernel's (tests/test_quant_bf16.py): bf16 activations times
bf16(dequantize(W)), products exact, sums in float32 (computed here in float64). Shapes hit
every tile edge: activation rows around 16 and 32 (B-tile pairs; 1, 16, 33 and 70 end on an
odd tile, which runs alone), weight rows around 16 and 32 (A-tile pairs), K one tile and
several.

AMX tiles exist only on Sapphire Rapids and later Xeons. On a CPU with AVX-512-BF16 but no
AMX (Zen 4 / 5) the same calls run the op's fallback, the VDPBF16PS tiles, against the same
definition; without AVX-512-BF16 (Zen 3) the op cannot run and these skip, saying so, while
the policy tests (here and in test_quant_bf16.py) run everywhere. decode_layers through AMX
is test_quant_bf16.py::test_fused_decode_through_the_bf16_kernel[amx].
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from test_quant_bf16 import bf16_kernel, definition, wb_abs  # noqa: F401 - the fixture
from test_quant_kernels import kernels, random_blocks  # noqa: F401 - the fixture it needs

from kvserve.kernels.quant_ops import QuantPolicy
from kvserve.kernels.quant_ref import SUPPORTED_QTYPES


@pytest.mark.usefixtures("bf16_kernel")
@pytest.mark.parametrize("qtype", SUPPORTED_QTYPES, ids=lambda t: t.name)
def test_amx_matches_its_definition(qtype: QT) -> None:
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


@pytest.mark.usefixtures("bf16_kernel")
def test_amx_from_its_rows_only() -> None:
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
