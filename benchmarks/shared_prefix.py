"""shared-prefix (../shared/docs/BENCHMARKS.md): 8 groups x 8 questions; each group shares a
1,024-token system prompt, each question adds 64 tokens, 64 new tokens each, all submitted at
once. Median time to first token and output throughput with the prefix cache on vs off.

    python -m benchmarks.shared_prefix [--dtype bfloat16] [--groups 8] [--questions 8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from benchmarks import plot
from benchmarks.common import random_prompt
from kvserve.engine.llm import LLM
from kvserve.models.model_session import ModelSession
from kvserve.sampling import SamplingParams


def workload(
    groups: int, questions: int, prefix_len: int, question_len: int, vocab: int
) -> list[list[int]]:
    rng = random.Random(0)
    prompts = []
    for _ in range(groups):
        system = random_prompt(rng, prefix_len, vocab)
        prompts += [system + random_prompt(rng, question_len, vocab) for _ in range(questions)]
    rng.shuffle(prompts)  # arrivals interleave the groups
    return prompts


def run(
    session: ModelSession,
    prompts,
    new_tokens: int,
    caching: bool,
    args: argparse.Namespace,
    policy: str,
) -> dict:
    llm = LLM(
        session=session,
        enable_prefix_caching=caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=policy,
    )
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    stats = llm.engine.stats()
    return {
        "ttft": statistics.median(o.ttft_s for o in outs),
        "tput": sum(len(o.token_ids) for o in outs) / wall,
        "cached": sum(o.num_cached_tokens for o in outs),
        "hit_rate": stats.prefix_cache_hits / max(1, stats.prefix_cache_queries),
        "tokens": [o.token_ids for o in outs],
    }


def draw(path, title: str, results: list[tuple[str, dict]]) -> None:
    """Median TTFT, throughput and hit rate per setup; the cache-on bars carry their ratio to
    the cache-off run."""
    names = [n for n, _ in results]
    off = dict(results)["prefix cache off"]

    def vs_off(r: dict, text: str) -> str:
        return "" if r is off else "\n" + text

    plot.figure(
        path,
        title,
        [
            plot.Bars(
                names,
                [r["ttft"] for _, r in results],
                "median time to first token (s)",
                [
                    f"{r['ttft']:.2f} s" + vs_off(r, f"{off['ttft'] / r['ttft']:.2f}x lower")
                    for _, r in results
                ],
                title="TTFT (ratio: cache off / on)",
                xlabel="setup",
            ),
            plot.Bars(
                names,
                [r["tput"] for _, r in results],
                "output tokens/s",
                [
                    f"{r['tput']:.1f}" + vs_off(r, f"{r['tput'] / off['tput']:.2f}x off")
                    for _, r in results
                ],
                title="throughput (ratio: on / off)",
                xlabel="setup",
            ),
            plot.Bars(
                names,
                [100 * r["hit_rate"] for _, r in results],
                "prefix cache hit rate (%)",
                [f"{r['hit_rate']:.1%}\n{r['cached']:,} cached tokens" for _, r in results],
                title="prompt tokens served from the cache",
                xlabel="setup",
            ),
        ],
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    plot.add_plot_arg(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    session = ModelSession.open(args.model, args.dtype)
    prompts = workload(
        args.groups, args.questions, args.prefix_len, args.question_len, session.config.vocab_size
    )
    on = run(session, prompts, args.new_tokens, True, args, "fcfs")
    lpm = run(session, prompts, args.new_tokens, True, args, "lpm")
    off = run(session, prompts, args.new_tokens, False, args, "fcfs")
    title = (
        f"shared-prefix: model={session.path.name} dtype={args.dtype} threads={args.threads} "
        f"{args.groups} groups x {args.questions} questions, prefix {args.prefix_len} + "
        f"{args.question_len} tokens, {args.new_tokens} new, torch={torch.__version__}"
    )
    print(title)
    results = [("cache on, fcfs", on), ("cache on, lpm", lpm), ("prefix cache off", off)]
    for name, r in results:
        print(
            f"{name:<17} median TTFT {r['ttft']:7.2f} s   {r['tput']:7.1f} output tok/s   "
            f"cached prompt tokens {r['cached']:>6}   hit rate {r['hit_rate']:.1%}"
        )
    same = sum(a == b for a, b in zip(on["tokens"], off["tokens"], strict=True))
    for name, r in (("fcfs", on), ("lpm", lpm)):
        print(
            f"cache on ({name}) vs off: median TTFT {off['ttft'] / r['ttft']:.2f}x lower, "
            f"throughput {r['tput'] / off['tput']:.2f}x"
        )
    print(
        f"identical greedy outputs, cache on (fcfs) vs off: {same}/{len(prompts)} "
        "(bfloat16: a cached prefix and a recomputed one round differently; float32 is exact)"
    )
    if args.plot:
        draw(args.plot, title, results)


if __name__ == "__main__":
    main()
