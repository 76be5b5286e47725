"""Linear layers with oneDNN (mkldnn) pre-packed weights, for CPU inference.

``nn.Linear`` on CPU re-lays its weight for oneDNN on every call; batch-1 decode is a chain of
matrix-vector products whose time is mostly that. Packing each weight once at load time
measured 1.3-2x faster matmuls on these CPUs (bfloat16 and float32, batch 1 to 64), with the
same arithmetic (bit-identical in bfloat16, reordered float32 accumulation).

oneDNN's bfloat16 packing runs only on CPUs with AVX-512BW/VL/DQ or AVX-NE-CONVERT (it raises
elsewhere): weight_formats.py decides from ``CpuFeatures`` where PackedLinear is used.

The packed tensor is opaque (``torch._mkldnn`` layout): the module keeps it instead of the
dense weight, so ``dense_state_dict`` rebuilds Hugging Face-named dense tensors when needed.
"""

from __future__ import annotations

import torch
from torch import nn

# modules that only concatenate other weights (models/weight_formats.py FUSIONS)
FUSED_SUFFIXES = (".qkv_proj", ".gate_up_proj")


class PackedLinear(nn.Module):
    """y = x W^T + b with W pre-packed by oneDNN. Built from a loaded ``nn.Linear``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # batch-size hint 1: decode is the hot path; measured no slower at batch 64
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.to_dense()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under their Hugging Face names, as dense tensors: packed ones
    unpacked, quantized ones dequantized (float32)."""
    state = {k: v for k, v in model.state_dict().items() if not k.endswith(".qweight")}
    for prefix, module in model.named_modules():
        if prefix.endswith(FUSED_SUFFIXES):
            continue  # a fused q/k/v or gate/up: its members are exported under their names
        if isinstance(module, PackedLinear) or hasattr(module, "qweight"):
            state[f"{prefix}.weight"] = module.weight
    return state
