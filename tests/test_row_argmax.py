"""kvserve::argmax_rows (greedy sampling's argmax) gives torch.argmax's indices on every ISA
path the CPU has: ties (bfloat16 logits have many) go to the first index, a NaN counts as the
maximum (the first NaN wins), all -inf gives 0, row lengths off the vector width."""

from __future__ import annotations

import pytest
import torch
from test_quant_kernels import kernels  # noqa: F401 - the fixture: the extension, built

from kvserve.kernels.row_argmax import row_argmax

pytestmark = pytest.mark.usefixtures("kernels")


def cases(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    rows = torch.randn(12, n, generator=g).bfloat16().float()  # bf16-rounded: ties
    rows[1] = rows[1].round()  # many ties at the maximum
    rows[2, n // 2] = float("nan")
    rows[3, n - 1] = float("nan")
    rows[3, 0] = float("inf")
    rows[4] = float("-inf")
    rows[5] = 0.0
    rows[5, n // 3] = -0.0
    rows[6, n - 1] = 100.0  # the maximum in the tail past the last full vector
    rows[7, 0] = 100.0
    rows[8] = torch.arange(n, 0, -1).float()  # strictly decreasing
    rows[9] = torch.arange(n).float()  # strictly increasing
    rows[10, [n // 4, n - 1]] = float("nan")
    rows[11, -min(n, 3) :] = float("inf")
    return rows


@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 33, 1000, 49152])
def test_argmax_rows_equals_torch_argmax_on_every_isa(n: int) -> None:
    x = cases(n)
    want = x.argmax(dim=-1)
    for isa in range(int(torch.ops.kvserve.cpu_isa()) + 1):  # scalar, AVX2, AVX-512
        assert torch.equal(torch.ops.kvserve.argmax_rows(x, isa), want), f"isa {isa}"
    assert torch.equal(row_argmax(x), want)
    wide = torch.cat([x, torch.full_like(x, float("inf"))], dim=1)
    assert torch.equal(row_argmax(wide[:, :n]), want)  # a non-contiguous view of the rows


@pytest.mark.parametrize("cap", ["none", "avx2"])
def test_row_argmax_follows_the_cpu_features_cap(cap: str, monkeypatch) -> None:
    """Under KVSERVE_CPU_FEATURES the op runs the capped path (as every other kernel), and
    gives the same indices."""
    calls = []
    op = torch.ops.kvserve.argmax_rows
    monkeypatch.setattr(
        torch.ops.kvserve, "argmax_rows", lambda x, isa=-1: calls.append(isa) or op(x, isa)
    )
    monkeypatch.setenv("KVSERVE_CPU_FEATURES", cap)
    x = cases(37)
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert calls == [{"none": 0, "avx2": 1}[cap]]


def test_row_argmax_falls_back_to_torch_where_the_op_does_not_apply(monkeypatch) -> None:
    """float64 logits, and float32 ones with the kernels off, take torch.argmax."""
    x = cases(37)
    monkeypatch.setattr(torch.ops.kvserve, "argmax_rows", lambda *a: pytest.fail("the op ran"))
    assert torch.equal(row_argmax(x.double()), x.argmax(dim=-1))
    monkeypatch.setenv("KVSERVE_KERNELS", "0")
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))


def test_argmax_rows_rejects_bad_input() -> None:
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.kvserve.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="rows, n >= 1"):
        torch.ops.kvserve.argmax_rows(torch.zeros(3))
    with pytest.raises(RuntimeError, match="isa 9"):
        torch.ops.kvserve.argmax_rows(torch.zeros(2, 3), 9)
