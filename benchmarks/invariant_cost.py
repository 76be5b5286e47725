"""invariant-cost: what batch-invariant mode costs against the default path, measured in one
process so both sides see the same machine: two engines on the same model (the default path
and ``batch_invariant=True``), the same distinct prompts, the two alternating request by request
(which goes first alternates too). TTFT is the prefill step, TPOT the median decode step after
it; per prompt length the best and the median of ``--runs`` requests and the mode / default
ratios (issue 34's budget: TTFT within 10%, decode within 5%).

    python -m benchmarks.invariant_cost [--model M] [--prompt-lens 128,512,1024,2000] \\
        [--new-tokens 16] [--runs 7] [--threads 2] [--plot FILE.png]

A shared host moves both sides alike within a pair of requests but not across minutes, so only
the ratios of one run mean much; run it twice before believing a few percent.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks import plot
from benchmarks.latency import one_request
from kvserve.engine.llm import LLM


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: embedded)")
    ap.add_argument("--prompt-lens", default="128,512,1024,2000")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    plot.add_plot_arg(ap)
    args = ap.parse_args(argv)
    lens = [int(n) for n in args.prompt_lens.split(",")]
    if min(lens) < 1 or args.new_tokens < 2 or args.runs < 1:
        raise ValueError(
            f"--prompt-lens must be positive, --new-tokens >= 2 and --runs >= 1, got "
            f"{args.prompt_lens!r}, {args.new_tokens}, {args.runs}"
        )
    torch.set_num_threads(args.threads)
    sides = {
        "default": LLM(model=args.model, enable_prefix_caching=False),
        "invariant": LLM(model=args.model, enable_prefix_caching=False, batch_invariant=True),
    }
    vocab = sides["default"].engine.model_config.vocab_size
    for llm in sides.values():  # warm-up: a decode, a many-row prefill
        one_request(llm, [1000 + i for i in range(16)], 4)
        one_request(llm, [2000 + i for i in range(min(600, max(lens)))], 2)
    print(
        f"invariant-cost: dtype {sides['default'].session.model.dtype}, threads {args.threads}, "
        f"{args.new_tokens} new tokens, {args.runs} runs, torch {torch.__version__}"
    )
    print(
        f"{'prompt':>6} | {'TTFT default':>17} | {'TTFT invariant':>17} | {'ratio':>11} | "
        f"{'TPOT default':>12} {'invariant':>9} {'ratio':>6}"
    )
    print(f"{'':>6} | {'best / median ms':>17} | {'best / median ms':>17} | {'best / med':>11} |")
    ratios: dict[str, list[float]] = {"TTFT": [], "decode step": []}
    for n in lens:
        ttft = {name: [] for name in sides}
        tpot = {name: [] for name in sides}
        for run in range(args.runs):
            prompt = [(1000 + 7919 * run + 13 * n + i) % vocab for i in range(n)]
            order = list(sides) if run % 2 == 0 else list(reversed(sides))
            for name in order:
                first, steps = one_request(sides[name], prompt, args.new_tokens)
                ttft[name].append(first)
                tpot[name].append(statistics.median(steps))
        best = {k: min(v) * 1e3 for k, v in ttft.items()}
        med = {k: statistics.median(v) * 1e3 for k, v in ttft.items()}
        step = {k: statistics.median(v) * 1e3 for k, v in tpot.items()}
        print(
            f"{n:>6} | {best['default']:7.1f} / {med['default']:7.1f} | "
            f"{best['invariant']:7.1f} / {med['invariant']:7.1f} | "
            f"{best['invariant'] / best['default']:.3f} / {med['invariant'] / med['default']:.3f} | "
            f"{step['default']:12.2f} {step['invariant']:9.2f} "
            f"{step['invariant'] / step['default']:6.3f}",
            flush=True,
        )
        ratios["TTFT"].append(med["invariant"] / med["default"])
        ratios["decode step"].append(step["invariant"] / step["default"])
    if args.plot:
        plot.grouped_bars(
            args.plot,
            f"batch-invariant mode / default path, threads {args.threads}, {args.runs} runs",
            [f"{n} tokens" for n in lens],
            ratios,
            "median time, mode / default (lower is faster)",
            {k: [f"{v:.2f}" for v in vals] for k, vals in ratios.items()},
            xlabel="prompt length",
            refs=[(1.10, "TTFT budget 1.10"), (1.05, "decode budget 1.05")],
        )


if __name__ == "__main__":
    main()
