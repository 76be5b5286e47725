"""cluster: kvserve replicas behind SGLang's router, cache_aware vs round_robin.

The shared-prefix workload over HTTP: 8 groups x 8 questions, each group's questions after
the same ~1024-token system prompt (text, so the router's radix tree sees it), 16 output
tokens each (EOS ignored), --concurrency requests in flight, groups interleaved. For one
replica (through the router, as a baseline) and for 2 and 3 replicas under each policy:
the aggregate prefix-cache hit rate (prompt tokens served from the replicas' caches over all
prompt tokens, from their /metrics), prompt tokens computed, median and p99 TTFT, and output
tokens/s. Each configuration starts a fresh cluster (`kvserve cluster`), so caches start
empty.

On a 2-core machine the replicas share the CPU: throughput does not scale with replicas, and
is not the point. The hit rate and the prompt tokens computed are: cache_aware should keep
one replica's hit rate, round_robin recomputes each system prompt on every replica.

    python -m benchmarks.cluster [--replicas 2,3] [--router-python .peers/sglang-router/bin/python]

With --kill-one, instead: each replica count under cache_aware with its busiest replica
SIGKILLed at half the run, requests sent and failed (benchmarks/cluster_failover.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass

import httpx

from benchmarks import cluster_failover, plot
from benchmarks.common import bench_cluster_config
from benchmarks.serve import WORDS
from kvserve import cluster
from kvserve.default_model import default_model_path
from kvserve.tokenizer import Tokenizer


@dataclass
class Result:
    name: str
    hit_rate: float
    computed: float  # prompt tokens computed (not served by a cache)
    ttft_p50_ms: float
    ttft_p99_ms: float
    output_tok_s: float
    failures: int


def workload(groups: int, questions: int, prefix_tokens: int) -> list[str]:
    gguf = default_model_path()
    tok = Tokenizer.load(gguf.parent, gguf)
    rng = random.Random(0)
    per_group = []
    for g in range(groups):
        words = " ".join(rng.choice(WORDS) for _ in range(prefix_tokens * 2))
        ids = tok.encode(f"System {g}: {words}", add_special_tokens=False)[:prefix_tokens]
        system = tok.decode(ids)
        per_group.append(
            [
                f"{system}\nQuestion {q}: " + " ".join(rng.choice(WORDS) for _ in range(40))
                for q in range(questions)
            ]
        )
    # interleave the groups: question q of every group, then q + 1
    return [per_group[g][q] for q in range(questions) for g in range(groups)]


async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[float, int]:
    body = {"model": "kvserve", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    body |= {"temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0].get("text"):
                tokens += 1
                if first is None:
                    first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("no text streamed")
    return first, tokens


async def drive(url: str, prompts: list[str], max_tokens: int, concurrency: int):
    gate = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    failures = 0
    tokens = 0

    async def task(prompt: str) -> None:
        nonlocal failures, tokens
        async with gate:
            try:
                ttft, n = await one(client, prompt, max_tokens)
                ttfts.append(ttft)
                tokens += n
            except (RuntimeError, httpx.HTTPError):
                failures += 1

    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        start = time.perf_counter()
        await asyncio.gather(*(task(p) for p in prompts))
        wall = time.perf_counter() - start
    return ttfts, failures, tokens / wall


def counters(url: str) -> tuple[float, float]:
    """(prefix-cache queries, hits) of one replica, in tokens."""
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            if line.startswith(name):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values["vllm:prefix_cache_queries_total"], values["vllm:prefix_cache_hits_total"]


def run_one(name: str, replicas: int, policy: str, prompts: list[str], args) -> Result:
    config = bench_cluster_config(replicas, policy, args.router_python, args.dtype, policy)
    workers, router = cluster.start(config)
    try:
        ttfts, failures, tok_s = asyncio.run(
            drive(router.url, prompts, args.max_tokens, args.concurrency)
        )
        queries, hits = map(sum, zip(*(counters(w.url) for w in workers), strict=True))
    finally:
        cluster.stop([router, *workers])
    ttfts.sort()
    return Result(
        name,
        hit_rate=hits / queries if queries else float("nan"),
        computed=queries - hits,
        ttft_p50_ms=1e3 * statistics.median(ttfts),
        ttft_p99_ms=1e3 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        output_tok_s=tok_s,
        failures=failures,
    )


def draw(path, title: str, results: list[Result]) -> None:
    """Per replica setup: hit rate (points vs one replica), prompt tokens computed, TTFT p50 /
    p99, output tokens/s."""
    names = [r.name for r in results]
    base = results[0].hit_rate
    plot.figure(
        path,
        title,
        [
            plot.Bars(
                names,
                [100 * r.hit_rate for r in results],
                "aggregate prefix-cache hit rate (%)",
                [f"{100 * results[0].hit_rate:.1f}%"]
                + [
                    f"{100 * r.hit_rate:.1f}%\n{100 * (r.hit_rate - base):+.1f} pts"
                    for r in results[1:]
                ],
                title="hit rate (pts: vs one replica)",
                xlabel="replicas x router policy",
            ),
            plot.Bars(
                names,
                [r.computed for r in results],
                "prompt tokens computed (not from a cache)",
                [f"{r.computed:,.0f}" for r in results],
                title="prompt tokens computed",
                xlabel="replicas x router policy",
            ),
            plot.GroupedBars(
                names,
                {
                    "TTFT p50": [r.ttft_p50_ms for r in results],
                    "TTFT p99": [r.ttft_p99_ms for r in results],
                },
                "time to first token (ms)",
                title="TTFT",
                xlabel="replicas x router policy",
            ),
            plot.Bars(
                names,
                [r.output_tok_s for r in results],
                "output tokens/s",
                [
                    f"{r.output_tok_s:.1f}" + (f"\n{r.failures} failed" if r.failures else "")
                    for r in results
                ],
                title="throughput (replicas share the machine's cores)",
                xlabel="replicas x router policy",
            ),
        ],
        ncols=2,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", default="2,3")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--router-python", default=str(cluster.DEFAULT_ROUTER_PYTHON))
    p.add_argument(
        "--kill-one",
        action="store_true",
        help="failover instead: cache_aware, the busiest replica SIGKILLed at half the run",
    )
    p.add_argument("--stream", action="store_true", help="--kill-one with streaming requests")
    plot.add_plot_arg(p)
    args = p.parse_args(argv)
    if args.stream and not args.kill_one:
        p.error("--stream is for --kill-one (the comparison always streams)")
    prompts = workload(args.groups, args.questions, args.prefix_tokens)
    if args.kill_one:
        counts = [int(x) for x in args.replicas.split(",")]
        if min(counts) < 2:
            p.error("--kill-one needs at least 2 replicas: one is killed")
        failovers = [cluster_failover.run_failover(n, prompts, args) for n in counts]
        cluster_failover.report(failovers, args)
        if args.plot:
            cluster_failover.draw(args.plot, cluster_failover.title(args), failovers)
        return
    configs = [("1 replica", 1, "round_robin")]
    for n in (int(x) for x in args.replicas.split(",")):
        configs += [
            (f"{n} x cache_aware", n, "cache_aware"),
            (f"{n} x round_robin", n, "round_robin"),
        ]
    results = []
    for name, n, policy in configs:
        results.append(run_one(name, n, policy, prompts, args))
        r = results[-1]
        print(f"done: {name}: hit rate {100 * r.hit_rate:.1f}%", flush=True)
    title = (
        f"cluster: {args.groups} groups x {args.questions} questions over "
        f"{args.prefix_tokens}-token system prompts, {args.max_tokens} output tokens, "
        f"{args.concurrency} in flight, through sglang-router"
    )
    print(title)
    print(
        f"{'configuration':<18} {'hit rate':>9} {'computed':>9} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'out tok/s':>10} {'fail':>5}"
    )
    for r in results:
        print(
            f"{r.name:<18} {100 * r.hit_rate:>8.1f}% {r.computed:>9.0f} {r.ttft_p50_ms:>7.0f}ms "
            f"{r.ttft_p99_ms:>7.0f}ms {r.output_tok_s:>10.1f} {r.failures:>5d}"
        )
    base = results[0].hit_rate
    for r in results[1:]:
        print(f"{r.name}: hit rate {100 * (r.hit_rate - base):+.1f} points vs one replica")
    print(
        "note: the replicas share this machine's cores, so output tok/s does not scale with "
        "replicas; the hit rate and the prompt tokens computed are the point"
    )
    if args.plot:
        draw(args.plot, f"{title}; kvserve replicas --dtype {args.dtype}, one machine", results)


if __name__ == "__main__":
    main()
