"""Linear and embedding layers whose weights stay in a GGUF block format (Q8_0, Q4_0, ...).

The weight is the file's own bytes, a uint8 tensor ``qweight`` of shape
``(out_features, in_features // block_elems * block_bytes)``: one row of blocks per output
feature, exactly as llama.cpp stores it. Resident weight bytes are therefore about the file's
size (the default model: ~98 MB instead of 538 MB of float32).

A matmul takes one of three paths, all computing ``x @ dequantize(qweight).T`` in float32:

- ``kernel``: the C++ kernel that dequantizes inside the dot product (``torch.ops.kvserve.
  quant_matmul``), for up to ``policy.kernel_max_rows`` rows (decode, small batches);
- ``dequant+matmul``: the C++ dequantizer into a float32 weight, then ``F.linear`` (oneDNN), for
  more rows (prefill, where the matmul is compute-bound and the unpacking is amortized);
- ``reference``: the pure-PyTorch dequantizer, then ``F.linear`` -- the fallback wherever the
  extension did not build, and the truth every kernel is tested against.

Which of the first two is faster at which row count is measured on the machine
(``measure_kernel_max_rows``), never assumed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels.build import load_kernels
from kvserve.kernels.interleaved_weights import deinterleave, deinterleave_rows, interleave
from kvserve.kernels.quant_ops import QuantPolicy, quant_linear
from kvserve.kernels.quant_ref import block_size as quant_block_size
from kvserve.kernels.quant_ref import dequantize_ref


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W kept in a GGUF block format; bias (if any) in the model dtype."""

    def __init__(
        self,
        qweight: torch.Tensor,
        qtype: int,
        in_features: int,
        out_features: int,
        policy: QuantPolicy,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        elems, nbytes = quant_block_size(qtype)
        if in_features % elems:
            raise ValueError(
                f"in_features {in_features} is not a multiple of the block size {elems}"
            )
        want = (out_features, in_features // elems * nbytes)
        if qweight.dtype != torch.uint8 or tuple(qweight.shape) != want:
            raise ValueError(
                f"qweight must be uint8 {want} for qtype {qtype}, got {qweight.dtype} "
                f"{tuple(qweight.shape)}"
            )
        self.register_buffer("qweight", qweight)
        self.qtype = qtype
        self.in_features = in_features
        self.out_features = out_features
        self.policy = policy
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = quant_linear(x, self.qweight, self.qtype, self.out_features, self.policy)
        return y if self.bias is None else y + self.bias

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized float32 weight (N, K): for export and tests, never the hot path."""
        return dequantize_ref(self.gguf_rows(), self.qtype, self.out_features, self.in_features)

    def gguf_rows(self) -> torch.Tensor:
        """The weight as GGUF rows (N, row_bytes), whatever layout ``qweight`` holds."""
        if self.policy.interleaved:
            return deinterleave(self.qweight, self.qtype, self.out_features, self.in_features)
        return self.qweight

    def interleave(self, policy: QuantPolicy) -> None:
        """Hold the weight in the interleaved layout (kernels/interleaved_weights.py) and
        multiply by ``policy`` (``interleaved`` set), in place; the GGUF rows are dropped
        (a tied embedding keeps its own reference to them)."""
        assert policy.interleaved and not self.policy.interleaved
        self.qweight = interleave(self.qweight, self.qtype, self.out_features, self.in_features)
        self.policy = policy

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"qtype={self.qtype}, bytes={self.qweight.nbytes}"
        )


class QuantizedEmbedding(nn.Module):
    """Token embedding kept quantized: a lookup dequantizes only the rows it reads."""

    def __init__(
        self, qweight: torch.Tensor, qtype: int, num_embeddings: int, dim: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.qtype = qtype
        self.num_embeddings = num_embeddings
        self.embedding_dim = dim
        self.out_dtype = dtype
        self.interleaved = False  # qweight holds the interleaved layout (a tied lm_head's)

    def use_interleaved(self, qweight: torch.Tensor) -> None:
        """Look rows up in ``qweight``, this table's interleaved layout (kernels/
        interleaved_weights.py): a tied lm_head's weight in batch-invariant mode."""
        self.qweight = qweight
        self.interleaved = True

    def _rows(self, flat: torch.Tensor) -> torch.Tensor:
        """GGUF rows (len(flat), row_bytes) of the ids ``flat``."""
        if self.interleaved:
            return deinterleave_rows(self.qweight, self.qtype, flat, self.embedding_dim)
        return self.qweight[flat]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self._rows(flat)
        if self.qweight.device.type == "cpu" and load_kernels():
            # the C++ dequantizer on the gathered rows: bit for bit the reference (tests/
            # test_quant_kernels.py), ~20 us a decode step against ~90 us in PyTorch ops
            out = torch.ops.kvserve.dequantize(rows, self.qtype, flat.shape[0], self.embedding_dim)
        else:
            out = dequantize_ref(rows, self.qtype, flat.shape[0], self.embedding_dim)
        return out.to(self.out_dtype).view(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        n, dim = self.num_embeddings, self.embedding_dim
        rows = deinterleave(self.qweight, self.qtype, n, dim) if self.interleaved else self.qweight
        return dequantize_ref(rows, self.qtype, n, dim)


def best_time(fn: Callable[[], object], repeat: int) -> float:
    """Seconds of the fastest of ``repeat`` calls, after one warm-up call (first-touch,
    oneDNN primitive creation)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


BF16_MARGIN = 1.15  # the bf16 kernel replaces the float32 one only when this much faster


def measure_kernel_max_rows(
    qweight: torch.Tensor,
    qtype: int,
    out_features: int,
    in_features: int,
    isa: int,
    bf16: bool = False,
    bf16_kernel: bool = False,
    candidates: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
    repeat: int = 3,
    amx: bool = False,
) -> tuple[int, int, int]:
    """Row thresholds measured on this machine for this weight: ``(kernel_max_rows,
    bf16_kernel_max_rows, amx_min_rows)`` of ``QuantPolicy``.

    The float32 kernel is kept up to the largest row count at which it is the fastest path;
    from there the bf16 kernel (``bf16_kernel``: a bfloat16 model on a CPU with AVX-512-BF16)
    up to the largest at which it still beats dequantize + F.linear. With ``amx`` (the CPU has
    AMX-BF16) that range runs on AMX tiles only (``amx_min_rows`` is its first row): one
    weight timed over and over in cache had its VDPBF16PS tiles win at 8-16 rows, but a decode
    step streams every weight once, and there the AMX tiles won at every row count (the
    default model's 120 layer matmuls from DRAM, AMX Xeon, 2 threads: 8 rows 14-15 ms
    against 30-33, 12 rows 14.5 against 30-39, 16 rows 16-19 against 48-60; 1-4 rows the
    float32 kernel, 7-13 ms, against AMX 11-15). Rows are tried in increasing order and each
    search stops at its first loss (a kernel's cost grows with rows, the dequantized matmul's
    mostly does not). ``bf16``: the dequantized matmul runs in bfloat16 (a bf16 model on a CPU
    with native bf16), as ``quant_linear`` then does."""
    kernel_rows = bf16_rows = 0
    in_kernel = True
    for m in candidates:
        x = torch.randn(m, in_features)
        xb = x.to(torch.bfloat16)

        def dequantized(x=x, xb=xb) -> torch.Tensor:
            w = torch.ops.kvserve.dequantize(qweight, qtype, out_features, in_features)
            return F.linear(xb, w.to(torch.bfloat16)) if bf16 else F.linear(x, w)

        def bf16_op(repeat: int = repeat, xb=xb) -> float:
            # the AMX tiles where the CPU has them (amx_min_rows 1), else the VDPBF16PS ones
            return best_time(
                lambda: torch.ops.kvserve.quant_matmul_bf16(
                    xb, qweight, qtype, out_features, 1 if amx else 0
                ),
                repeat,
            )

        dense = best_time(dequantized, repeat)
        bf16_time = float("inf")
        if bf16_kernel:
            bf16_time = bf16_op()
        if in_kernel:

            def kernel(x=x) -> torch.Tensor:
                return torch.ops.kvserve.quant_matmul(x, qweight, qtype, out_features, isa)

            fused = best_time(kernel, repeat)
            if fused > dense or fused > BF16_MARGIN * bf16_time:
                # A loss ends the kernel's range for every larger batch, so confirm it with
                # longer timings: one noisy sample on a busy machine (seen: a load during a
                # pip install) once gave a weight "kernel up to 0 rows", and batch-1 decode
                # then dequantized every weight on every step. The same against the bf16
                # kernel: a stalled first timing once gave the Q8_0 lm_head "kernel up to 0
                # rows" on the AMX Xeon, and batch-1 decode took the bf16 kernel, 3.3 ms a
                # step against the float32 kernel's 2.6 ms. (The bf16 kernel is not timed
                # again: noise only ever adds to a best-of time, so a stall there could only
                # have favoured the float32 kernel.)
                dense = min(dense, best_time(dequantized, 3 * repeat))
                fused = min(fused, best_time(kernel, 3 * repeat))
            # the bf16 kernel must win clearly: at a few rows the two are close, and a noisy
            # timing that hands batch-1 decode to the bf16 one costs ~25% of every step
            if fused <= dense and fused <= BF16_MARGIN * bf16_time:
                kernel_rows = m
                continue
            in_kernel = False
        if bf16_kernel and bf16_time > dense:
            # Confirmed as the float32 kernel's loss is: the thresholds are cached, and one
            # stalled sample at a busy first start (the test suite beside a compile) gave the
            # default model's qkv_proj "bf16 kernel up to 16 rows" on a Zen 4, where quiet
            # timings give 512; offline-64 then dequantized that weight every decode step
            # above 16 requests and ran 52.5 s against 46.5 s (one run each).
            dense = min(dense, best_time(dequantized, 3 * repeat))
            bf16_time = min(bf16_time, bf16_op(3 * repeat))
        if bf16_time > dense:
            break
        bf16_rows = m
    # with AMX every row of the bf16 range is on AMX tiles
    amx_rows = kernel_rows + 1 if amx and bf16_rows > kernel_rows else 0
    return kernel_rows, bf16_rows, amx_rows


def measure_interleaved_max_rows(
    qweight: torch.Tensor,
    qtype: int,
    out_features: int,
    in_features: int,
    candidates: tuple[int, ...] = (256, 512),
    repeat: int = 3,
) -> int:
    """Rows up to which the interleaved kernel beats oneDNN on the dequantized weight, for the
    interleaved ``qweight`` (``QuantPolicy.interleaved_max_rows``). Never below 128:
    - at 1-16 rows the kernel measured 2-12x faster for every format and shape tried (Zen 5:
      the default model's Q4_1, TinyLlama-shaped Q4_0 / Q4_K / Q6_K), so no noisy timing at a
      busy start can hand decode to the dequantized matmul;
    - timed here, one weight over and over, the dequantization runs from cache: a 1.1B Q6_K
      weight took ~1 ms, but 3.7 ms a weight inside a real 128-token prefill (322 ms of its
      740), where a measured threshold of 64 rows had sent it. At 64-128 rows the kernel was
      within 10% of the in-cache oneDNN time for every shape tried, so it keeps them.
    Rows above are tried in increasing order and the search stops at its first loss,
    confirmed with longer timings (as measure_kernel_max_rows)."""
    best = 128
    for m in candidates:
        xb = torch.randn(m, in_features).to(torch.bfloat16)

        def kernel(xb=xb) -> torch.Tensor:
            return torch.ops.kvserve.interleaved_matmul_bf16(xb, qweight, qtype, out_features, True)

        def dense(xb=xb) -> torch.Tensor:
            w = torch.ops.kvserve.interleaved_dequantize_bf16(
                qweight, qtype, out_features, in_features
            )
            return F.linear(xb, w)

        k, d = best_time(kernel, repeat), best_time(dense, repeat)
        if k > d:
            k, d = min(k, best_time(kernel, 3 * repeat)), min(d, best_time(dense, 3 * repeat))
        if k > d:
            break
        best = m
    return best
