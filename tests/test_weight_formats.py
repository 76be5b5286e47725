"""Dense linear layers: which one each CPU gets (from what it does, not from an op existing),
and that each computes what nn.Linear computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.models.packed_linear import PackedLinear, dense_state_dict
from kvserve.models.weight_formats import UpcastLinear, WeightsReport, _finalize_dense
from kvserve.platform import detect_cpu_features

NATIVE = detect_cpu_features()
# every machine runs each branch: the real CPU, and the same CPU capped as Zen 3 (AVX2 only,
# no native bfloat16, no oneDNN bf16 packing) and as a portable x86-64 without AVX2
CAPS = [None, "avx2", "none"]


def _model(dtype: torch.dtype, bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 160, bias=bias), nn.ReLU(), nn.Linear(160, 8, bias=False))
    return model.to(dtype).requires_grad_(False)


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_layer_choice_follows_cpu_features(cap, dtype):
    features = detect_cpu_features(cap) if cap else NATIVE
    model = _model(dtype)
    report = WeightsReport()
    _finalize_dense(model, dtype, torch.device("cpu"), features, True, report)
    kind = type(model[0])
    if dtype == torch.float32:
        assert kind is PackedLinear
    elif features.native_bf16 and features.onednn_bf16_packing:
        assert kind is PackedLinear
    else:
        # no native bfloat16: the oneDNN bf16 reorder would raise here (the Zen 3 crash)
        assert kind is UpcastLinear
    assert report.tensors_by_format[str(dtype).removeprefix("torch.")] == 2


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_float32_equals_linear(rows, bias):
    lin = _model(torch.float32, bias)[0]
    x = torch.randn(rows, 96)
    torch.testing.assert_close(PackedLinear(lin)(x), lin(x), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not NATIVE.onednn_bf16_packing, reason="oneDNN bf16 packing needs AVX-512")
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_bfloat16_equals_linear(rows):
    lin = _model(torch.bfloat16)[0]
    x = torch.randn(rows, 96).to(torch.bfloat16)
    torch.testing.assert_close(PackedLinear(lin)(x), lin(x), atol=0, rtol=0)  # same rounding


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_upcast_linear_is_float32_matmul_of_bf16_weights(rows):
    lin = _model(torch.bfloat16)[0]
    x = torch.randn(rows, 96).to(torch.bfloat16)
    want = nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float()).to(torch.bfloat16)
    got = UpcastLinear(lin)(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_dense_state_dict_unpacks():
    model = _model(torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 96)
    want = model(x)
    _finalize_dense(model, torch.float32, torch.device("cpu"), NATIVE, True, WeightsReport())
    torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)
    after = dense_state_dict(model)
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(after[k], before[k]), k
