"""Fake (shape-only) implementations of the C++ ops, for torch.compile and meta tensors.

They live in Python, not as C++ Meta kernels, because a C++ kernel that reads ``x.size(0)``
as an integer forces torch.compile to specialize on every token count (one recompile per
batch size, measured); these keep sizes symbolic. Registered once, right after the library
loads (build.py).
"""

from __future__ import annotations

import torch

from kvserve.kernels.quant_ref import row_bytes


def register_fakes() -> None:
    """Register the fake of every op the library defines (call once per process)."""

    @torch.library.register_fake("kvserve::quant_matmul")
    def _quant_matmul(x, qweight, qtype, out_features, isa=-1):
        torch._check(x.dim() == 2, lambda: f"x must be 2-D, got {tuple(x.shape)}")
        torch._check(
            tuple(qweight.shape) == (out_features, row_bytes(qtype, x.shape[1])),
            lambda: f"qweight {tuple(qweight.shape)} does not fit ({out_features}, {x.shape[1]})",
        )
        return x.new_empty((x.shape[0], out_features), dtype=torch.float32)

    @torch.library.register_fake("kvserve::quant_matmul_gemm")
    def _quant_matmul_gemm(x, qweight, qtype, out_features, isa=-1):
        return _quant_matmul(x, qweight, qtype, out_features, isa)

    @torch.library.register_fake("kvserve::quant_matmul_bf16")
    def _quant_matmul_bf16(x, qweight, qtype, out_features, amx_min_rows=0, fixed_order=False):
        torch._check(x.dim() == 2, lambda: f"x must be 2-D, got {tuple(x.shape)}")
        return x.new_empty((x.shape[0], out_features), dtype=torch.float32)

    @torch.library.register_fake("kvserve::interleaved_matmul_bf16")
    def _interleaved_matmul_bf16(x, w, qtype, out_features, out_bf16=False):
        torch._check(x.dim() == 2, lambda: f"x must be 2-D, got {tuple(x.shape)}")
        dtype = torch.bfloat16 if out_bf16 else torch.float32
        return x.new_empty((x.shape[0], out_features), dtype=dtype)

    @torch.library.register_fake("kvserve::dequantize")
    def _dequantize(qweight, qtype, out_features, in_features, isa=-1):
        return qweight.new_empty((out_features, in_features), dtype=torch.float32)

    @torch.library.register_fake("kvserve::dequantize_bf16")
    def _dequantize_bf16(qweight, qtype, out_features, in_features):
        return qweight.new_empty((out_features, in_features), dtype=torch.bfloat16)

    @torch.library.register_fake("kvserve::interleaved_dequantize_bf16")
    def _interleaved_dequantize_bf16(w, qtype, out_features, in_features):
        return w.new_empty((out_features, in_features), dtype=torch.bfloat16)

    # paged_decode_attention and paged_decode_attention_quant (q-shaped, q's dtype) have C++
    # Meta kernels instead, over sym_sizes, so sizes stay symbolic there too; register_fake
    # raises for an op that has one, which would fail this whole registration.

    @torch.library.register_fake("kvserve::kv_dequantize")
    def _kv_dequantize(codes, scales, mins, format, isa=-1):
        head_dim = codes.shape[1] * (2 if format in (2, 3) else 1)  # 4 bits: two values a byte
        return codes.new_empty((codes.shape[0], head_dim), dtype=torch.float32)
