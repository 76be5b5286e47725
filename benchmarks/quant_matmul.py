"""quant_matmul: the C++ quantized-weight matmul vs dequantize-then-F.linear, on the default
model's shapes (SmolLM2-135M: hidden 576, kv 192, mlp 1536, vocab 49152).

Per type, M and shape: best-of-reps time of
  kernel  torch.ops.kvserve.quant_matmul (best ISA, or --isa)
  ref     dequantize_ref (PyTorch) + F.linear
  deq     kvserve::dequantize (C++) + F.linear
  f32     F.linear on a float32 weight (what kvserve does today)
with GB/s of quantized weight bytes read by the kernel and ratios (x = time / kernel time).
Then the decode step: all 211 M=1 matmuls of the model on distinct weights (~96 MB, so they
stream from DRAM as in a real decode), per ISA.

    python -m benchmarks.quant_matmul [--types Q4_1,Q8_0] [--m 1,4,16,64,256] [--threads 2]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from benchmarks import plot
from kvserve.kernels.build import ISA_NAMES, load_kernels
from kvserve.kernels.quant_ref import block_size, dequantize_ref, quantize, row_bytes
from kvserve.models.quantized_linear import best_time

# (out_features N, in_features K) of the model's matmuls; per layer: q, k, v, o, gate, up, down.
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
NUM_LAYERS = 30


def random_weight(qtype: QT, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """uint8 (n, row_bytes): gguf-quantized for the types gguf-py can quantize, else random
    bytes with sane fp16 scales (the kernel's speed does not depend on the values)."""
    if qtype in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0):
        return quantize(torch.randn(n, k, generator=g) * 0.05, qtype)
    w = torch.randint(0, 256, (n, row_bytes(qtype, k)), dtype=torch.uint8, generator=g)
    blocks = w.view(-1, 144 if qtype == QT.Q4_K else 210)
    half = torch.full((blocks.shape[0], 1), 0.01).half().view(torch.uint8)  # (nb, 2)
    for off in (0, 2) if qtype == QT.Q4_K else (208,):
        blocks[:, off : off + 2] = half
    return w


def time_row(
    qtype: QT, w: torch.Tensor, wf: torch.Tensor, x: torch.Tensor, reps: int, isa: int
) -> tuple[float, float, float, float]:
    """(kernel, ref, deq, f32) seconds for x (M, K) times weight (N, K)."""
    n, k = wf.shape
    op = torch.ops.kvserve.quant_matmul
    return (
        best_time(lambda: op(x, w, int(qtype), n, isa), reps),
        best_time(lambda: F.linear(x, dequantize_ref(w, qtype, n, k)), max(2, reps // 4)),
        best_time(lambda: F.linear(x, torch.ops.kvserve.dequantize(w, int(qtype), n, k)), reps),
        best_time(lambda: F.linear(x, wf), reps),
    )


@dataclass(frozen=True, slots=True)
class ShapeRow:
    qtype: str
    n: int
    k: int
    m: int
    kernel_s: float
    ref_s: float  # dequantize_ref + F.linear
    deq_s: float  # kvserve::dequantize + F.linear
    f32_s: float  # F.linear on a float32 weight
    weight_bytes: int


@dataclass(frozen=True, slots=True)
class StepRow:
    isa: str
    seconds: float
    matmuls: int
    weight_bytes: int


def draw(path, title: str, rows: list[ShapeRow], steps: list[StepRow]) -> None:
    """A grid, a row per type and a column per N x K: time per call by M for the kernel and
    the three other paths (their points carry the script's ratio, time / kernel time); then
    the decode step per ISA."""
    shapes = list(dict.fromkeys((r.n, r.k) for r in rows))
    paths = {
        "kernel": "kernel_s",
        "deq + F.linear": "deq_s",
        "ref + F.linear": "ref_s",
        "f32 F.linear": "f32_s",
    }
    panels: list[plot.Panel | None] = []
    for qtype in dict.fromkeys(r.qtype for r in rows):
        for n, k in shapes:
            mine = [r for r in rows if r.qtype == qtype and (r.n, r.k) == (n, k)]
            if not mine:  # K-quants skip K % 256 != 0
                panels.append(None)
                continue
            series = {name: [1e6 * getattr(r, a) for r in mine] for name, a in paths.items()}
            notes = {
                name: [f"{getattr(r, a) / r.kernel_s:.1f}x" for r in mine]
                for name, a in paths.items()
                if name != "kernel"
            }
            panels.append(
                plot.Lines(
                    [r.m for r in mine],
                    series,
                    "M (rows of x)",
                    "time per call (us, best of reps)",
                    notes,
                    title=f"{qtype} {n} x {k} (x = time / kernel)",
                    logx=True,
                    logy=True,
                )
            )
    ncols = max(1, len(shapes))
    if steps:
        panels += [None] * (-len(panels) % ncols)
        s = steps[0]
        panels.append(
            plot.Bars(
                [r.isa for r in steps],
                [1e3 * r.seconds for r in steps],
                "decode step matmuls (ms, best of reps)",
                [
                    f"{1e3 * r.seconds:.2f} ms\n{r.weight_bytes / r.seconds / 1e9:.1f} GB/s"
                    for r in steps
                ],
                title=f"decode step: {s.matmuls} M=1 matmuls, {s.weight_bytes / 1e6:.0f} MB",
                xlabel="kernel ISA path",
            )
        )
    plot.figure(path, title, panels, ncols=ncols)


def bench_shapes(qtypes: list[QT], ms: list[int], reps: int, isa: int) -> list[ShapeRow]:
    g = torch.Generator().manual_seed(0)
    rows = []
    print(
        f"{'type':5} {'N x K':>11} {'M':>4} {'kernel us':>10} {'GB/s':>6} "
        f"{'ref x':>7} {'deq x':>7} {'f32 x':>7}"
    )
    for qtype in qtypes:
        for n, k in SHAPES:
            if k % block_size(qtype)[0]:
                continue  # K-quants need K % 256 == 0 (llama.cpp falls back to Q5_0/Q8_0 there)
            w = random_weight(qtype, n, k, g)
            wf = dequantize_ref(w, qtype, n, k)
            r = max(2, reps // 8) if n * k > 10**7 else reps
            for m in ms:
                t_k, t_ref, t_deq, t_f32 = time_row(
                    qtype, w, wf, torch.randn(m, k, generator=g), r, isa
                )
                rows.append(ShapeRow(qtype.name, n, k, m, t_k, t_ref, t_deq, t_f32, w.numel()))
                print(
                    f"{qtype.name:5} {n:>5}x{k:<5} {m:>4} {t_k * 1e6:>10.1f} "
                    f"{w.numel() / t_k / 1e9:>6.1f} {t_ref / t_k:>7.2f} {t_deq / t_k:>7.2f} "
                    f"{t_f32 / t_k:>7.2f}"
                )
    return rows


def bench_decode_step(reps: int) -> list[StepRow]:
    """All M=1 matmuls of one decode step: Q4_1 layers + the Q8_0 lm_head, distinct weights."""
    g = torch.Generator().manual_seed(1)
    mats = [
        (QT.Q4_1, n, k, random_weight(QT.Q4_1, n, k, g))
        for _ in range(NUM_LAYERS)
        for n, k in LAYER
    ]
    mats.append((QT.Q8_0, 49152, 576, random_weight(QT.Q8_0, 49152, 576, g)))
    xs = {576: torch.randn(1, 576, generator=g), 1536: torch.randn(1, 1536, generator=g)}
    nbytes = sum(w.numel() for *_, w in mats)
    op = torch.ops.kvserve.quant_matmul
    rows = []
    for isa in range(int(torch.ops.kvserve.cpu_isa()), -1, -1):

        def step(isa: int = isa) -> None:
            for qtype, n, k, w in mats:
                op(xs[k], w, int(qtype), n, isa)

        t = best_time(step, reps)
        rows.append(StepRow(ISA_NAMES[isa], t, len(mats), nbytes))
        print(
            f"decode step, {len(mats)} matmuls, {nbytes / 1e6:.0f} MB, {ISA_NAMES[isa]:>20}: "
            f"{t * 1e3:6.2f} ms  ({nbytes / t / 1e9:.1f} GB/s)"
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_1,Q8_0,Q4_0,Q4_K,Q6_K")
    ap.add_argument("--m", default="1,4,16,64,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", type=int, default=-1, help="-1 best, 0 scalar, 1 avx2, 2 avx512")
    ap.add_argument("--skip-step", action="store_true", help="skip the decode-step timing")
    plot.add_plot_arg(ap)
    args = ap.parse_args(argv)
    if not load_kernels():
        raise SystemExit("the C++ kernels did not load (see the warning above)")
    torch.set_num_threads(args.threads)
    header = (
        f"threads {torch.get_num_threads()}, best ISA {ISA_NAMES[int(torch.ops.kvserve.cpu_isa())]}"
    )
    print(header)
    qtypes = [QT[name] for name in args.types.split(",")]
    rows = bench_shapes(qtypes, [int(m) for m in args.m.split(",")], args.reps, args.isa)
    steps = [] if args.skip_step else bench_decode_step(max(3, args.reps // 4))
    if args.plot:
        isa = "best" if args.isa < 0 else ISA_NAMES[args.isa]
        title = (
            "quant_matmul: the quantized-weight kernel vs dequantize + F.linear vs float32 "
            f"F.linear on SmolLM2-135M's shapes; {header}, kernel ISA {isa}, "
            f"torch {torch.__version__}"
        )
        draw(args.plot, title, rows, steps)


if __name__ == "__main__":
    main()
