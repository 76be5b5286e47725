"""Latency of one request by prompt length: TTFT (the prefill step) and TPOT (the decode steps
after it), kvserve alone, medians over ``--runs`` requests with distinct prompts (prefix
caching off). The decode steps at long prompts show what reading the context costs.

    python -m benchmarks.latency [--dtype auto] [--prompt-lens 8,128,512,1024] \\
        [--new-tokens 64] [--runs 5] [--threads 2]

It uses only ``LLM`` and ``SamplingParams`` (engine ``add_request`` / ``step``), so the same
script measures another checkout of kvserve: ``PYTHONPATH=OTHER/src python -m
benchmarks.latency`` (how this project compares a change against the code before it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvserve
from benchmarks import plot
from kvserve.engine.llm import LLM
from kvserve.sampling import SamplingParams


def one_request(llm: LLM, prompt: list[int], new_tokens: int) -> tuple[float, list[float]]:
    """(TTFT, decode step times) of one request run alone."""
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    return steps[0], steps[1:]


def draw(path, title: str, rows: list[tuple[int, float, float]]) -> None:
    """TTFT and TPOT (ms) by prompt length, one panel each."""
    lens = [n for n, _, _ in rows]
    ttft = [1e3 * t for _, t, _ in rows]
    tpot = [1e3 * t for _, _, t in rows]
    plot.figure(
        path,
        title,
        [
            plot.Lines(
                lens,
                {"TTFT (prefill step)": ttft},
                "prompt length (tokens)",
                "time to first token (ms, median)",
                {"TTFT (prefill step)": [f"{v:.1f}" for v in ttft]},
                title="TTFT by prompt length",
                logx=True,
            ),
            plot.Lines(
                lens,
                {"TPOT (decode steps)": tpot},
                "prompt length (tokens)",
                "time per output token (ms, median)",
                {"TPOT (decode steps)": [f"{v:.2f}" for v in tpot]},
                title="TPOT by prompt length (reading the context)",
                logx=True,
            ),
        ],
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: embedded)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--prompt-lens", default="8,128,512,1024")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="kvserve in batch-invariant mode (the same bits whatever the batch or chunking)",
    )
    plot.add_plot_arg(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    extra = {"batch_invariant": True} if args.batch_invariant else {}
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False, **extra)
    vocab = llm.engine.model_config.vocab_size
    lens = [int(n) for n in args.prompt_lens.split(",")]
    one_request(llm, [1000 + i for i in range(16)], 4)  # warm-up
    title = (
        f"latency: kvserve from {kvserve.__file__.rsplit('/kvserve/', 1)[0]} dtype={args.dtype} "
        f"threads={args.threads} new={args.new_tokens} runs={args.runs} torch={torch.__version__}"
    )
    print(title)
    rows = []
    print(f"{'prompt':>7} {'TTFT ms':>9} {'TPOT ms':>9}")
    for n in lens:
        ttfts, tpots = [], []
        for run in range(args.runs):
            prompt = [(1000 + 7919 * run + i) % vocab for i in range(n)]  # distinct per run
            ttft, steps = one_request(llm, prompt, args.new_tokens)
            ttfts.append(ttft)
            tpots.append(statistics.median(steps) if steps else float("nan"))
        rows.append((n, statistics.median(ttfts), statistics.median(tpots)))
        print(f"{n:>7} {rows[-1][1] * 1e3:9.1f} {rows[-1][2] * 1e3:9.2f}")
    if args.plot:
        session = getattr(llm, "session", None)  # an older checkout's LLM may have none
        name = session.path.name if session is not None else args.model or "default"
        draw(args.plot, f"{title} model={name}", rows)


if __name__ == "__main__":
    main()
