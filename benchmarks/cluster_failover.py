"""cluster --kill-one: the cluster benchmark's workload with one replica SIGKILLed halfway.

N replicas under cache_aware (the cluster's FAILOVER_DEFAULTS: one failed call opens a
replica's circuit, so the router's retry goes to another), the same shared-prefix prompts,
--concurrency requests in flight. Once half of the requests have finished, the replica
running the most requests is SIGKILLed. Reported: requests sent and failed (by HTTP status or
transport error), how many were in flight at the kill, the aggregate prefix-cache hit rate
(the victim's counters read just before the kill, the survivors' at the end; the victim's
retried requests count again where they land), and latency p50 / p99 / max (a retried
request pays for its lost work: the max shows it).

Non-streaming requests by default: they are what the router can retry, since a replica
dying mid-request breaks the connection before any response header went out. With --stream
a stream that has started when its replica dies cannot be retried by anyone, and fails.

    python -m benchmarks.cluster --replicas 3 --kill-one [--stream]
    python -m benchmarks.cluster_failover --replicas 3 [--stream]   # the same
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from benchmarks import plot
from benchmarks.common import bench_cluster_config
from kvserve import cluster


@dataclass
class Failover:
    name: str
    sent: int
    failed: Counter  # reason (HTTP status or transport error) -> count
    in_flight_at_kill: int
    victim: str
    hit_rate: float
    computed: float
    latency_ms: list[float] = field(default_factory=list)  # successful requests, sorted


async def request(client: httpx.AsyncClient, prompt: str, max_tokens: int, stream: bool) -> None:
    """One completion; raises RuntimeError (with the reason) unless it finished whole."""
    body = {"model": "kvserve", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    body |= {"temperature": 0.0, "ignore_eos": True}
    if not stream:
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}")
        if r.json()["usage"]["completion_tokens"] != max_tokens:
            raise RuntimeError("short completion")
        return
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}")
        lines = [line async for line in r.aiter_lines()]
    if "data: [DONE]" not in lines:
        raise RuntimeError("stream cut short")


async def metrics(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in (await client.get(f"{url}/metrics", timeout=10)).text.splitlines():
        if line.startswith("vllm:") and " " in line:
            name = line.split("{")[0].split(" ")[0]
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


async def drive(
    name: str, router_url: str, workers: list[cluster.Member], prompts: list[str], args
) -> Failover:
    gate = asyncio.Semaphore(args.concurrency)
    spans: list[tuple[float, float]] = []  # (start, end) of every request
    latencies: list[float] = []
    failed: Counter = Counter()
    killed: dict = {}

    async def task(prompt: str) -> None:
        async with gate:
            start = time.monotonic()
            try:
                await request(client, prompt, args.max_tokens, args.stream)
                latencies.append(1e3 * (time.monotonic() - start))
            except RuntimeError as e:
                failed[str(e)] += 1
            except httpx.HTTPError as e:
                failed[type(e).__name__] += 1
            spans.append((start, time.monotonic()))

    async def kill_halfway() -> None:
        while len(spans) < len(prompts) // 2:
            await asyncio.sleep(0.01)
        loads = [await metrics(probe, w.url) for w in workers]
        running = [m.get("vllm:num_requests_running", 0.0) for m in loads]
        victim = running.index(max(running))
        workers[victim].proc.kill()  # SIGKILL: no shutdown, its connections just break
        killed.update(at=time.monotonic(), index=victim, counters=loads[victim])

    async with (
        httpx.AsyncClient(base_url=router_url, timeout=None) as client,
        httpx.AsyncClient() as probe,
    ):
        await asyncio.gather(kill_halfway(), *(task(p) for p in prompts))
        survivors = [w for i, w in enumerate(workers) if i != killed["index"]]
        counters = [killed["counters"], *[await metrics(probe, w.url) for w in survivors]]
    queries = sum(c.get("vllm:prefix_cache_queries_total", 0.0) for c in counters)
    hits = sum(c.get("vllm:prefix_cache_hits_total", 0.0) for c in counters)
    return Failover(
        name=name,
        sent=len(prompts),
        failed=failed,
        in_flight_at_kill=sum(start < killed["at"] < end for start, end in spans),
        victim=workers[killed["index"]].name,
        hit_rate=hits / queries if queries else float("nan"),
        computed=queries - hits,
        latency_ms=sorted(latencies),
    )


def run_failover(replicas: int, prompts: list[str], args) -> Failover:
    config = bench_cluster_config(
        replicas, "cache_aware", args.router_python, args.dtype, "kill-one"
    )
    workers, router = cluster.start(config)
    try:
        name = f"{replicas} x cache_aware, kill one"
        return asyncio.run(drive(name, router.url, workers, prompts, args))
    finally:
        cluster.stop([router, *workers])


def title(args) -> str:
    kind = "streaming" if args.stream else "non-streaming"
    return (
        f"cluster --kill-one: {args.groups} groups x {args.questions} questions over "
        f"{args.prefix_tokens}-token system prompts, {args.max_tokens} output tokens, "
        f"{kind}, {args.concurrency} in flight; the busiest replica SIGKILLed at half the run"
    )


def p99(lat: list[float]) -> float:
    return lat[min(len(lat) - 1, int(0.99 * len(lat)))]


def report(results: list[Failover], args) -> None:
    print(title(args))
    print(
        f"{'configuration':<26} {'sent':>5} {'failed':>7} {'in flight':>10} {'hit rate':>9} "
        f"{'computed':>9} {'p50':>8} {'p99':>8} {'max':>8}"
    )
    for r in results:
        lat = r.latency_ms or [float("nan")]
        print(
            f"{r.name:<26} {r.sent:>5d} {sum(r.failed.values()):>7d} {r.in_flight_at_kill:>10d} "
            f"{100 * r.hit_rate:>8.1f}% {r.computed:>9.0f} {statistics.median(lat):>6.0f}ms "
            f"{p99(lat):>6.0f}ms {lat[-1]:>6.0f}ms"
        )
        print(f"  killed {r.victim}; failures by reason: {json.dumps(dict(r.failed))}")


def draw(path, title: str, results: list[Failover]) -> None:
    """Per replica count: requests sent / failed / in flight at the kill, latency p50 / p99 /
    max of the successful ones (a retried request's lost work shows in the max), hit rate."""
    names = [r.name.replace(", kill one", "") for r in results]
    lats = [r.latency_ms or [float("nan")] for r in results]
    failed = [sum(r.failed.values()) for r in results]
    plot.figure(
        path,
        title,
        [
            plot.GroupedBars(
                names,
                {
                    "sent": [r.sent for r in results],
                    "failed": failed,
                    "in flight at the kill": [r.in_flight_at_kill for r in results],
                },
                "requests",
                annotate={
                    "failed": [str(f) for f in failed],
                    "in flight at the kill": [str(r.in_flight_at_kill) for r in results],
                },
                title="requests (one replica SIGKILLed halfway)",
                xlabel="replicas, cache_aware",
            ),
            plot.GroupedBars(
                names,
                {
                    "p50": [statistics.median(lat) for lat in lats],
                    "p99": [p99(lat) for lat in lats],
                    "max": [lat[-1] for lat in lats],
                },
                "request latency (ms, successful requests)",
                annotate={"max": [f"{lat[-1]:.0f}" for lat in lats]},
                title="latency",
                xlabel="replicas, cache_aware",
            ),
            plot.Bars(
                names,
                [100 * r.hit_rate for r in results],
                "aggregate prefix-cache hit rate (%)",
                [f"{100 * r.hit_rate:.1f}%\n{r.computed:,.0f} computed" for r in results],
                title="hit rate (victim counted until the kill)",
                xlabel="replicas, cache_aware",
            ),
        ],
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.cluster_failover ARGS`` = ``python -m benchmarks.cluster
    --kill-one ARGS`` (the flags are cluster's)."""
    from benchmarks import cluster  # it imports this module

    cluster.main([*(sys.argv[1:] if argv is None else argv), "--kill-one"])


if __name__ == "__main__":
    main()
