"""Dispatch of quantized-weight matmuls: the C++ kernel or its PyTorch reference.

The caller decides once (at model load) whether to use the kernel, normally
`use_kernel=kernels_available()`, and passes that flag on every call: a decode step makes
~200 of these calls, so the hot path is a reshape, a dtype check and the op itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kernels.build import ISA_NAMES, cache_dir, kernels_enabled, load_kernels
from kvserve.kernels.quant_ref import dequantize_ref, reference_quant_matmul


def kernels_available() -> bool:
    """True when the C++ ops are loaded and not turned off by KVSERVE_KERNELS=0."""
    return load_kernels()


def quant_matmul(
    x: torch.Tensor, qweight: torch.Tensor, qtype: int, n: int, *, use_kernel: bool
) -> torch.Tensor:
    """x (..., K) @ dequantize(qweight (n, row_bytes)).T -> (..., n) in x's dtype.

    Computed in float32 whatever x's dtype (bf16/f16 activations are converted in and out).
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    if use_kernel:
        y = torch.ops.kvserve.quant_matmul(x2.contiguous(), qweight, int(qtype), n)
    else:
        y = reference_quant_matmul(x2, qweight, qtype, n)
    return y.reshape(*lead, n).to(x.dtype)


def dequantize(
    qweight: torch.Tensor, qtype: int, n: int, k: int, *, use_kernel: bool
) -> torch.Tensor:
    """uint8 (n, row_bytes) -> float32 (n, k): the C++ op (parallel) or the reference."""
    if use_kernel:
        return torch.ops.kvserve.dequantize(qweight, int(qtype), n, k)
    return dequantize_ref(qweight, qtype, n, k)


@dataclass(frozen=True, slots=True)
class KernelInfo:
    """What `kvserve info` reports about the C++ kernels."""

    enabled: bool  # False when KVSERVE_KERNELS=0
    available: bool  # built and loaded (and enabled)
    isa: int | None  # best ISA path the CPU supports (kvserve::cpu_isa), None if not loaded
    isa_name: str
    cache_dir: str

    def summary(self) -> str:
        if not self.enabled:
            return "C++ kernels: disabled (KVSERVE_KERNELS=0), PyTorch reference"
        if not self.available:
            return "C++ kernels: not available (build failed), PyTorch reference"
        return f"C++ kernels: loaded, ISA {self.isa_name} (cache {self.cache_dir})"


def kernel_info() -> KernelInfo:
    available = kernels_available()
    isa = int(torch.ops.kvserve.cpu_isa()) if available else None
    return KernelInfo(
        enabled=kernels_enabled(),
        available=available,
        isa=isa,
        isa_name=ISA_NAMES[isa] if isa is not None else "none",
        cache_dir=str(cache_dir()),
    )
