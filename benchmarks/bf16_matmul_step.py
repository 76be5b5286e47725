"""bf16-matmul-step: the default model's 120 layer matmuls back to back, bfloat16 activations,
at each row count (a decode batch, a prefill chunk), five ways:

  kernel  kvserve::quant_matmul_bf16 on the 4-bit weights: its dot tiles below
          quant_bf16_gemm_min_rows() rows, its panel GEMM from there
  fixed   the same op with fixed_order=True (batch-invariant mode): the dot tiles (or the
          register GEMV) at every row count, one summation order
  inter   kvserve::interleaved_matmul_bf16 on the same weights interleaved into 16-row groups
          (batch-invariant mode's kernel for Q4_0 / Q4_1 / Q8_0): one order at every row count
  deq     kvserve::dequantize_bf16 + F.linear (oneDNN): the path the policy takes above the
          kernel's measured range
  dense   F.linear on weights already bfloat16: vLLM's matmul (3x the resident bytes)

The shapes are SmolLM2-135M's fused ones (q/k/v 960 x 576, o 576 x 576, gate/up 3072 x 576,
down 576 x 1536) x 30 layers on distinct weights (~66 MB of Q4_1), so they stream from DRAM as
in a real step. Best of --reps per row count and way, after a warm-up step; "x" = that way's time / the kernel's.

    python -m benchmarks.bf16_matmul_step [--rows 1,4,32,64,128,256,384,2048] [--threads 2]

The kernel needs AVX-512-BF16 (Zen 4/5, Cooper Lake and later Xeons); elsewhere the script says
so and stops.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from kvserve.kernels.build import build_kernels
from kvserve.kernels.interleaved_weights import interleave
from kvserve.kernels.quant_ref import dequantize_ref, quantize
from kvserve.models.quantized_linear import best_time

FUSED = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out N, in K) per layer
NUM_LAYERS = 30
QUANT_TYPES = {"Q4_0": QT.Q4_0, "Q4_1": QT.Q4_1, "Q8_0": QT.Q8_0}  # gguf-py quantizes these


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,32,64,128,256,384,2048")
    ap.add_argument("--qtype", default="Q4_1", choices=sorted(QUANT_TYPES))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if min(rows) < 1:
        raise ValueError(f"--rows must be positive row counts, got {args.rows}")
    torch.set_num_threads(args.threads)
    build_kernels()  # raises with the compiler output: a benchmark must not fall back silently
    if not torch.ops.kvserve.cpu_has_avx512_bf16():
        sys.exit("bf16-matmul-step: this CPU lacks AVX-512-BF16, so the bf16 kernel never runs")
    qtype = QUANT_TYPES[args.qtype]
    g = torch.Generator().manual_seed(0)
    weights = []  # (qweight, dense bf16 or the interleaved rows, n, k) per matmul
    inter = []
    for _ in range(NUM_LAYERS):
        for n, k in FUSED:
            q = quantize(torch.randn(n, k, generator=g) * 0.05, qtype)
            weights.append((q, dequantize_ref(q, qtype, n, k).bfloat16(), n, k))
            inter.append((None, interleave(q, qtype, n, k), n, k))
    t = int(qtype)
    ways = {
        "kernel": lambda x, q, wb, n, k: torch.ops.kvserve.quant_matmul_bf16(x[k], q, t, n, 0),
        "fixed": lambda x, q, wb, n, k: torch.ops.kvserve.quant_matmul_bf16(x[k], q, t, n, 0, True),
        "inter": lambda x, q, w, n, k: torch.ops.kvserve.interleaved_matmul_bf16(x[k], w, t, n),
        "deq": lambda x, q, wb, n, k: F.linear(x[k], torch.ops.kvserve.dequantize_bf16(q, t, n, k)),
        "dense": lambda x, q, wb, n, k: F.linear(x[k], wb),
    }
    print(
        f"bf16-matmul-step: {len(weights)} matmuls ({args.qtype}), threads={args.threads}, "
        f"panel GEMM from {int(torch.ops.kvserve.quant_bf16_gemm_min_rows())} rows, "
        f"torch={torch.__version__}"
    )
    print(
        "| rows | kernel ms | GFLOP/s | fixed order ms | x | interleaved ms | x | deq ms | x "
        "| dense bf16 ms | x |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    flop_per_row = 2 * NUM_LAYERS * sum(n * k for n, k in FUSED)
    for m in rows:
        x = {k: torch.randn(m, k, generator=g).bfloat16() for k in (576, 1536)}
        secs = {
            name: best_time(
                lambda f=f, x=x, ws=inter if name == "inter" else weights: [f(x, *w) for w in ws],
                args.reps,
            )
            for name, f in ways.items()
        }
        kern = secs["kernel"]
        print(
            f"| {m} | {kern * 1e3:.2f} | {flop_per_row * m / kern / 1e9:.0f} "
            f"| {secs['fixed'] * 1e3:.2f} | {secs['fixed'] / kern:.2f} "
            f"| {secs['inter'] * 1e3:.2f} | {secs['inter'] / kern:.2f} "
            f"| {secs['deq'] * 1e3:.2f} | {secs['deq'] / kern:.2f} "
            f"| {secs['dense'] * 1e3:.2f} | {secs['dense'] / kern:.2f} |"
        )


if __name__ == "__main__":
    main()
