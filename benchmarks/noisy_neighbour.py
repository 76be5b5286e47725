"""noisy-neighbour: do the well-behaved clients of one kvserve server keep their TTFT while
one client sends large batches?

One `kvserve serve` (the default model). --clients well-behaved clients each stream chat
requests back to back (a short question, --max-tokens tokens, EOS ignored) for --duration
seconds; their TTFT (request sent -> first content chunk) is collected. The run is done twice
per round, in turns: alone, and beside a neighbour that sends /v1/completions batches of
--batch-prompts prompts of --batch-prompt-tokens tokens back to back (non-streaming; a 503 is
retried after its Retry-After). Reported: the well-behaved clients' TTFT p50 / p99 with and
without the neighbour (medians over rounds) and their ratio; the aim is p99 with <= 2x
without. Also what the neighbour got through and how often it was told to wait.

    python -m benchmarks.noisy_neighbour [--rounds 2] [--duration 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks import plot
from benchmarks.serve import WORDS, free_port, start
from kvserve.default_model import default_model_path
from kvserve.tokenizer import Tokenizer


@dataclass
class Tally:
    ttft_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    batches: int = 0  # the neighbour's batches that completed
    batch_prompts: int = 0
    refused: int = 0  # the neighbour's 503s


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def chat_once(client: httpx.AsyncClient, body: dict, tally: Tally) -> None:
    start = time.perf_counter()
    first: float | None = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                tally.failures.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    tally.failures.append(str(chunk["error"])[:200])
                    return
                text = "".join(
                    (c.get("delta") or {}).get("content") or "" for c in chunk["choices"]
                )
                if text and first is None:
                    first = time.perf_counter() - start
    except httpx.HTTPError as e:
        tally.failures.append(repr(e))
        return
    if first is None:
        tally.failures.append("no content streamed")
    else:
        tally.ttft_s.append(first)


async def well_behaved(
    client: httpx.AsyncClient, seed: int, max_tokens: int, until: float, tally: Tally
) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
        body = {
            "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        await chat_once(client, body, tally)


async def neighbour(
    client: httpx.AsyncClient, prompts: list[list[int]], until: float, tally: Tally
) -> None:
    body = {"prompt": prompts, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    while time.monotonic() < until:
        try:
            r = await client.post("/v1/completions", json=body)
        except httpx.HTTPError as e:
            tally.failures.append(repr(e))
            await asyncio.sleep(1.0)
            continue
        if r.status_code == 503:
            tally.refused += 1
            await asyncio.sleep(float(r.headers.get("retry-after", "1")))
        elif r.status_code == 200:
            tally.batches += 1
            tally.batch_prompts += len(prompts)
        else:
            tally.failures.append(f"neighbour HTTP {r.status_code}: {r.text[:200]}")
            await asyncio.sleep(1.0)


async def run_once(
    url: str, args: argparse.Namespace, batch: list[list[int]] | None, seed: int
) -> tuple[Tally, Tally]:
    good, noisy = Tally(), Tally()
    limits = httpx.Limits(max_connections=args.clients + 8)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as client:
        until = time.monotonic() + args.duration
        tasks = [
            well_behaved(client, seed * 100 + i, args.max_tokens, until, good)
            for i in range(args.clients)
        ]
        if batch is not None:
            tasks.append(neighbour(client, batch, until, noisy))
        await asyncio.gather(*tasks)
        # the neighbour's last batch may still run: wait until the server is idle again
        while True:
            m = (await client.get("/metrics")).text
            if _gauge(m, "vllm:num_requests_running") + _gauge(m, "vllm:num_requests_waiting") == 0:
                break
            await asyncio.sleep(0.5)
    return good, noisy


def _gauge(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--duration", type=float, default=30.0, help="seconds per run")
    p.add_argument("--clients", type=int, default=16, help="well-behaved streaming clients")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batch-prompts", type=int, default=256)
    p.add_argument("--batch-prompt-tokens", type=int, default=256)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kvserve-args", default="", help="extra `kvserve serve` flags")
    plot.add_plot_arg(p)
    args = p.parse_args(argv)

    gguf = default_model_path()
    tok = Tokenizer.load(gguf.parent, gguf)
    rng = random.Random(7)
    text = " ".join(rng.choice(WORDS) for _ in range(args.batch_prompt_tokens * 2))
    base = tok.encode(text, add_special_tokens=False)[: args.batch_prompt_tokens - 4]
    log_dir = Path(tempfile.mkdtemp(prefix="kvserve-noisy-"))
    port = free_port()
    argv = [sys.executable, "-m", "kvserve.cli", "serve", "--dtype", args.dtype]
    argv += ["--port", str(port), "--log-interval", "60", *args.kvserve_args.split()]
    url = f"http://127.0.0.1:{port}"
    proc = start("kvserve", argv, url, log_dir)
    runs: dict[str, list[tuple[Tally, Tally]]] = {"alone": [], "with neighbour": []}
    try:
        for rnd in range(args.rounds):
            order = ["alone", "with neighbour"] if rnd % 2 == 0 else ["with neighbour", "alone"]
            for name in order:
                batch = None
                if name == "with neighbour":
                    # distinct prompts every round (4 fresh tokens up front): no cache hits
                    batch = [
                        [100 + rnd, 200 + i % 50, 300 + i // 50, 7, *base]
                        for i in range(args.batch_prompts)
                    ]
                good, noisy = asyncio.run(run_once(url, args, batch, seed=rnd))
                runs[name].append((good, noisy))
                print(
                    f"round {rnd} {name}: {len(good.ttft_s)} chats, TTFT p50 "
                    f"{1e3 * pct(good.ttft_s, 0.5):.0f} ms p99 {1e3 * pct(good.ttft_s, 0.99):.0f} "
                    f"ms; neighbour {noisy.batches} batches, {noisy.refused} refused; failures "
                    f"{(good.failures + noisy.failures)[:2]}",
                    file=sys.stderr,
                )
    finally:
        proc.terminate()
    report(runs, args)


def report(runs: dict[str, list[tuple[Tally, Tally]]], args: argparse.Namespace) -> None:
    def med(name: str, q: float) -> float:
        return statistics.median(1e3 * pct(g.ttft_s, q) for g, _ in runs[name])

    title = (
        f"noisy-neighbour: {args.clients} clients streaming chat ({args.max_tokens} tokens), "
        f"neighbour: batches of {args.batch_prompts} x {args.batch_prompt_tokens}-token prompts; "
        f"{args.duration:g} s per run, medians of {args.rounds} rounds"
    )
    print(title)
    print(
        f"{'run':<15} {'chats':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'batches':>8} {'503s':>5} {'fail':>5}"
    )
    for name, pairs in runs.items():
        chats = statistics.median(len(g.ttft_s) for g, _ in pairs)
        batches = statistics.median(n.batches for _, n in pairs)
        refused = statistics.median(n.refused for _, n in pairs)
        fails = sum(len(g.failures) + len(n.failures) for g, n in pairs)
        print(
            f"{name:<15} {chats:>6.0f} {med(name, 0.5):>8.0f}ms {med(name, 0.99):>8.0f}ms "
            f"{batches:>8.0f} {refused:>5.0f} {fails:>5d}"
        )
    ratio = med("with neighbour", 0.99) / med("alone", 0.99)
    print(f"TTFT p99 with / without the neighbour: {ratio:.2f}x (aim <= 2x)")
    ratio50 = med("with neighbour", 0.5) / med("alone", 0.5)
    print(f"TTFT p50 with / without the neighbour: {ratio50:.2f}x")
    if args.plot:
        title += f"; one kvserve serve (default model, --dtype {args.dtype} {args.kvserve_args}"
        title = title.rstrip() + ")"
        ttft = {name: [med(name, 0.5), med(name, 0.99)] for name in runs}
        batches = statistics.median(n.batches for _, n in runs["with neighbour"])
        draw(args.plot, title, ttft, batches)


def draw(path, title: str, ttft: dict[str, list[float]], batches: float) -> None:
    """The well-behaved clients' TTFT p50 / p99 (ms), alone vs with the neighbour (whose
    median completed batches per run is ``batches``); the with-neighbour bars carry the
    ratio, and a line marks the aim (p99 <= 2x alone)."""
    alone, noisy = ttft["alone"], ttft["with neighbour"]
    plot.grouped_bars(
        path,
        title,
        ["TTFT p50", "TTFT p99"],
        ttft,
        "time to first token (ms, median over rounds)",
        annotate={
            "alone": [f"{v:.0f} ms" for v in alone],
            "with neighbour": [
                f"{v:.0f} ms\n{v / a:.2f}x" for v, a in zip(noisy, alone, strict=True)
            ],
        },
        subtitle=f"well-behaved clients (neighbour: {batches:.0f} batches per run)",
        xlabel="percentile",
        refs=[(2 * alone[1], "aim: p99 <= 2x alone")],
    )


if __name__ == "__main__":
    main()
