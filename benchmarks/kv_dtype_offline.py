"""offline-64 by KV cache dtype: kvserve alone, one engine per cache dtype over the same
workload (shared/docs/BENCHMARKS.md's offline-64: 64 requests, prompts uniform in [32, 512],
outputs in [32, 256], greedy, ignore EOS), the engines alternating run by run; medians of
output tokens/s, the ratio to the first dtype, which decode path each takes, and how many
requests produced exactly the first dtype's tokens. The peer comparison is
``benchmarks.offline --kv-cache-dtype D``.

    python -m benchmarks.kv_dtype_offline [--kv-cache-dtype auto int8 int4] [--runs 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks import plot
from benchmarks.common import workload_offline
from kvserve import LLM, SamplingParams


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: embedded)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto", "int8", "int4"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    plot.add_plot_arg(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    llms = {
        d: LLM(
            model=args.model,
            dtype=args.dtype,
            kv_cache_dtype=d,
            max_num_seqs=64,
            enable_prefix_caching=False,  # every run repeats the prompts: a hit is not the work
        )
        for d in args.kv_cache_dtype
    }
    first = next(iter(llms))
    prompts, outputs = workload_offline(args.num_requests, llms[first].session.config.vocab_size)
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outputs]
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for llm in llms.values():
        llm.generate(prompts[:8], warm, use_tqdm=False)
    times: dict[str, list[float]] = {d: [] for d in llms}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.runs):
        for d, llm in llms.items():
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times[d].append(time.perf_counter() - t)
            tokens[d] = [o.token_ids for o in outs]
    useful = sum(outputs)
    model = llms[first].session
    title = (
        f"offline-{args.num_requests} by KV cache dtype: {model.path.name}, "
        f"{str(model.model.dtype).removeprefix('torch.')} activations, threads {args.threads}, "
        f"runs {args.runs}, {useful} output tokens"
    )
    print(title)
    print("| cache | time | output tok/s | vs first | fused decode | same tokens as first |")
    print("|---|---|---|---|---|---|")
    rates = {}
    for d, llm in llms.items():
        med = statistics.median(times[d])
        rates[d] = useful / med
        same = sum(a == b for a, b in zip(tokens[d], tokens[first], strict=True))
        print(
            f"| {llm.engine.spec.cache_dtype_name} | {med:.1f} s | {rates[d]:.1f} "
            f"| {rates[d] / rates[first]:.2f}x | {llm.engine.fused_decode is not None} "
            f"| {same} / {len(prompts)} |"
        )
    if args.plot:
        labels = [llms[d].engine.spec.cache_dtype_name for d in llms]
        notes = [f"{rates[d] / rates[first]:.2f}x" for d in llms]
        plot.bar_chart(args.plot, title, labels, list(rates.values()), "output tokens/s", notes)


if __name__ == "__main__":
    main()
