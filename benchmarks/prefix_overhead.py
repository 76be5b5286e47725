"""overhead: what the prefix cache costs when nothing hits. The offline workload (random
prompts: 0% hits) with prefix caching on vs off, alternating runs; output tokens/s and the
time spent in KV bookkeeping (hashing, lookups, scheduling) as a share of the step.

    python -m benchmarks.prefix_overhead [--dtype bfloat16] [--num-requests 16] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks import plot
from benchmarks.common import workload_offline
from kvserve.engine.llm import LLM
from kvserve.models.model_session import ModelSession
from kvserve.sampling import SamplingParams


def draw(path, title: str, med: dict[bool, tuple[float, float, float]]) -> None:
    """Throughput and bookkeeping time, caching on vs off (medians: tok/s, scheduler s,
    model s); the on bars carry the on / off ratio."""
    names = ["prefix caching on", "prefix caching off"]
    (t_on, s_on, _), (t_off, s_off, _) = med[True], med[False]
    plot.figure(
        path,
        title,
        [
            plot.Bars(
                names,
                [t_on, t_off],
                "output tokens/s (median)",
                [f"{t_on:.1f}\non / off {t_on / t_off:.3f}x", f"{t_off:.1f}"],
                title="throughput at 0% hits",
            ),
            plot.Bars(
                names,
                [1e3 * s_on, 1e3 * s_off],
                "KV bookkeeping over the run (ms, median)",
                [
                    f"{1e3 * s:.1f} ms\n{s / (s + m):.2%} of engine time"
                    for s, m in (med[True][1:], med[False][1:])
                ],
                title=f"bookkeeping (hashing, lookups, scheduling): +{1e3 * (s_on - s_off):.1f} ms on",
            ),
        ],
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    plot.add_plot_arg(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    session = ModelSession.open(args.model, args.dtype)
    prompts, outputs = workload_offline(args.num_requests, session.config.vocab_size, seed=1)
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outputs]
    rows: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    for _ in range(args.runs):
        for caching in (True, False):
            llm = LLM(session=session, enable_prefix_caching=caching)
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t
            st = llm.engine.stats()
            assert caching is False or st.prefix_cache_hits == 0
            rows[caching].append((sum(outputs) / wall, st.scheduler_time_s, st.model_time_s))
    title = (
        f"prefix-cache overhead at 0% hits: model={session.path.name} dtype={args.dtype} "
        f"threads={args.threads} {args.num_requests} requests, {sum(outputs)} output tokens, "
        f"runs={args.runs}"
    )
    print(title)
    med = {}
    for caching, vals in rows.items():
        tput = statistics.median(v[0] for v in vals)
        sched = statistics.median(v[1] for v in vals)
        model = statistics.median(v[2] for v in vals)
        med[caching] = (tput, sched, model)
        print(
            f"prefix caching {'on ' if caching else 'off'}: {tput:7.1f} output tok/s, "
            f"bookkeeping {sched * 1e3:7.1f} ms = {sched / (sched + model):.2%} of engine time"
        )
    print(
        f"throughput on/off: {med[True][0] / med[False][0]:.3f}x; extra bookkeeping with "
        f"caching on: {(med[True][1] - med[False][1]) * 1e3:.1f} ms over the whole run"
    )
    if args.plot:
        draw(args.plot, title, med)


if __name__ == "__main__":
    main()
