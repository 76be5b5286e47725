"""oneDNN-packed linear layers compute what nn.Linear computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.models.packed_linear import (
    PackedLinear,
    dense_state_dict,
    pack_linears,
    packing_available,
)

pytestmark = pytest.mark.skipif(not packing_available(torch.device("cpu")), reason="no oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_linear(dtype: torch.dtype, rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(96, 160, bias=bias).to(dtype).requires_grad_(False)
    x = torch.randn(rows, 96).to(dtype)
    want = lin(x)
    got = PackedLinear(lin)(x)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, atol=0, rtol=0)  # same kernel, same rounding
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_pack_linears_keeps_dense_state() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4, bias=False)).requires_grad_(
        False
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 8)
    want = model(x)
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2], PackedLinear)
    torch.testing.assert_close(model(x), want, atol=1e-6, rtol=1e-6)
    after = dense_state_dict(model)
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(after[k], before[k]), k
