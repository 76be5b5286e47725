"""Quantized-weight matmuls: which path a call takes, and the call.

``x @ dequantize(qweight).T`` in float32 by one of three paths:

- ``kernel``: the C++ kernel that dequantizes inside the dot product
  (``torch.ops.kvserve.quant_matmul``), for up to ``policy.kernel_max_rows`` rows;
- ``bf16 kernel``: a bfloat16 model on a CPU with AVX-512-BF16: the same with the weights
  rounded to bfloat16 in the kernel and bf16 x bf16 dot products (``quant_matmul_bf16``),
  for rows above ``kernel_max_rows`` up to ``bf16_kernel_max_rows``;
- ``amx kernel``: the same arithmetic through AMX tiles (CPUs with AMX-BF16), for the rows
  of the bf16 kernel's range from ``amx_min_rows`` on;
- ``bf16 kernel, fixed order`` (``fixed_order``: batch-invariant mode, a bfloat16 model on a
  CPU with AVX-512-BF16): the bf16 kernel at every row count, each output summed in one order whatever
  the row count, so a request's numbers do not depend on its batch (ARCHITECTURE.md);
- ``bf16 kernel, interleaved`` (``interleaved``: a Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K weight
  of a bfloat16 model on a CPU with AVX-512-BF16 and no AMX, held in the layout of
  ``kernels/interleaved_weights.py``): the weight's 16-row groups times bfloat16 activations,
  scales applied per block, one order at every row count; up to ``interleaved_max_rows`` rows
  (a decode, a small batch), or every row count with ``fixed_order`` (batch-invariant mode);
- ``dequant+matmul``: the C++ dequantizer into a float32 weight (a bfloat16 model on a CPU
  with native bfloat16: straight into a bf16 weight, ``dequantize_bf16``, or
  ``interleaved_dequantize_bf16`` for an interleaved one, the same bits), then ``F.linear``
  (oneDNN);
- ``reference``: the pure-PyTorch dequantizer, then ``F.linear`` -- the fallback wherever the
  extension did not build or is turned off, and the truth the kernels are tested against.

The policy is decided once per weight at load (models/weight_formats.py); a decode step makes
~200 of these calls, so the hot path is a reshape, a dtype check and the op itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.kernels.quant_ref import dequantize_ref


@dataclass(frozen=True, slots=True)
class QuantPolicy:
    """How the quantized layers of one model multiply. Built once at load."""

    use_kernels: bool  # the C++ extension is loaded (else: the PyTorch reference)
    isa: int = -1  # kernel ISA: -1 best the CPU has, 0 scalar, 1 AVX2+FMA, 2 AVX-512
    kernel_max_rows: int = 16  # rows up to which the fused kernel runs; above: dequant+matmul
    # dequant+matmul of bfloat16 activations in bfloat16 (oneDNN, AVX-512-BF16): only where
    # the CPU has native bfloat16 (elsewhere that matmul is emulated, ~30x slower)
    native_bf16: bool = False
    # rows in (kernel_max_rows, bf16_kernel_max_rows] of bfloat16 activations take the bf16
    # kernel (set only where native_bf16 and the CPU has AVX-512-BF16); 0: never
    bf16_kernel_max_rows: int = 0
    # rows in [amx_min_rows, bf16_kernel_max_rows] of the bf16 kernel run through AMX tiles
    # (set only where the CPU has AMX-BF16, measured); 0: never
    amx_min_rows: int = 0
    # every row count takes the bf16 kernel in its fixed order (kernels/csrc/quant_bf16.cpp):
    # a row's result does not depend on how many rows share the call (ARCHITECTURE.md
    # "Bitwise invariance"); the thresholds above are then unused. Set for a bfloat16 model on
    # a CPU with AVX-512-BF16.
    fixed_order: bool = False
    # the module's qweight holds the interleaved layout (kernels/interleaved_weights.py) and
    # multiplies through kvserve::interleaved_matmul_bf16 up to interleaved_max_rows rows
    # (every row count with fixed_order), above that through its dequantized bf16 weight
    interleaved: bool = False
    interleaved_max_rows: int = 0

    def __post_init__(self) -> None:
        if self.isa not in (-1, 0, 1, 2):
            raise ValueError(f"isa must be -1, 0, 1 or 2, got {self.isa}")
        if self.kernel_max_rows < 0:
            raise ValueError(f"kernel_max_rows must be >= 0, got {self.kernel_max_rows}")
        if self.bf16_kernel_max_rows < 0 or (self.bf16_kernel_max_rows and not self.native_bf16):
            raise ValueError(
                f"bf16_kernel_max_rows must be >= 0, and 0 unless native_bf16, got "
                f"{self.bf16_kernel_max_rows} (native_bf16={self.native_bf16})"
            )
        if self.amx_min_rows < 0 or (self.amx_min_rows and not self.bf16_kernel_max_rows):
            raise ValueError(
                f"amx_min_rows must be >= 0, and 0 unless bf16_kernel_max_rows, got "
                f"{self.amx_min_rows} (bf16_kernel_max_rows={self.bf16_kernel_max_rows})"
            )

        if self.fixed_order and not (self.use_kernels and self.native_bf16):
            raise ValueError("fixed_order needs the kernels (use_kernels) and native_bf16")
        if self.interleaved and not (self.use_kernels and self.native_bf16):
            raise ValueError("interleaved needs the kernels (use_kernels) and native_bf16")
        if self.interleaved_max_rows < 0:
            raise ValueError(f"interleaved_max_rows must be >= 0, got {self.interleaved_max_rows}")

    def path(self, rows: int, bf16: bool = False) -> str:
        """The path ``rows`` activation rows take (``bf16``: the activations are bfloat16)."""
        if not self.use_kernels:
            return "reference"
        if self.interleaved:
            if self.fixed_order or rows <= self.interleaved_max_rows:
                return "bf16 kernel, interleaved"
            return "dequant+matmul"
        if self.fixed_order:
            return "bf16 kernel, fixed order"
        if rows <= self.kernel_max_rows:
            return "kernel"
        if bf16 and rows <= self.bf16_kernel_max_rows:
            return "amx kernel" if 0 < self.amx_min_rows <= rows else "bf16 kernel"
        return "dequant+matmul"


REFERENCE_POLICY = QuantPolicy(use_kernels=False)


def quant_linear(
    x: torch.Tensor, qweight: torch.Tensor, qtype: int, out_features: int, policy: QuantPolicy
) -> torch.Tensor:
    """(..., K) activations times a quantized (N, K) weight -> (..., N) in x's dtype."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)  # (M, K)
    rows = x2.shape[0]
    if policy.interleaved and not (policy.fixed_order or rows <= policy.interleaved_max_rows):
        # a prefill chunk: oneDNN's GEMM on the dequantized weight (dequantize_bf16's bits)
        w = torch.ops.kvserve.interleaved_dequantize_bf16(qweight, qtype, out_features, k)
        y = F.linear(x2.to(torch.bfloat16), w)
        return y.to(x.dtype).view(*x.shape[:-1], out_features)
    if policy.fixed_order or policy.interleaved:  # one summation order (a float32 x is rounded)
        xb = x2.to(torch.bfloat16).contiguous()
        if policy.interleaved:
            # a bfloat16 model's output rounded in the kernel's store (no float32 copy)
            bf16_out = x.dtype == torch.bfloat16
            y = torch.ops.kvserve.interleaved_matmul_bf16(
                xb, qweight, qtype, out_features, bf16_out
            )
        else:
            y = torch.ops.kvserve.quant_matmul_bf16(xb, qweight, qtype, out_features, 0, True)
        return y.to(x.dtype).view(*x.shape[:-1], out_features)
    if policy.use_kernels and rows <= policy.kernel_max_rows:  # the decode hot path
        y = torch.ops.kvserve.quant_matmul(
            x2.float().contiguous(), qweight, qtype, out_features, policy.isa
        )
        return y.to(x.dtype).view(*x.shape[:-1], out_features)
    bf16 = x.dtype == torch.bfloat16
    path = policy.path(rows, bf16)
    if path in ("bf16 kernel", "amx kernel"):  # bf16 activations as they are: no float32 copy
        y = torch.ops.kvserve.quant_matmul_bf16(
            x2.contiguous(), qweight, qtype, out_features, policy.amx_min_rows
        )
        return y.to(x.dtype).view(*x.shape[:-1], out_features)
    if path == "dequant+matmul" and policy.native_bf16 and bf16:
        # a bfloat16 model's prefill: bf16 weights x bf16 activations, float32 accumulation
        # (what a bf16 checkpoint computes; 1.4-2x the float32 GEMM measured at 64+ rows)
        # (dequantize_bf16: dequantize + .to(bfloat16) bit for bit, without the float32 weight)
        w = torch.ops.kvserve.dequantize_bf16(qweight, qtype, out_features, k)
        return F.linear(x2, w).view(*x.shape[:-1], out_features)
    x2 = x2.float()
    if path == "kernel":
        y = torch.ops.kvserve.quant_matmul(
            x2.contiguous(), qweight, qtype, out_features, policy.isa
        )
    elif path == "dequant+matmul":
        y = F.linear(x2, torch.ops.kvserve.dequantize(qweight, qtype, out_features, k))
    else:
        y = F.linear(x2, dequantize_ref(qweight, qtype, out_features, k))
    return y.to(x.dtype).view(*x.shape[:-1], out_features)
