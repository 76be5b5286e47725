"""noisy-neighbour: do the chats of one kvserve server keep their latency while another
tenant sends large batches?

One `kvserve serve` (the default model) with two tenants (--api-keys): "chats" and "batch".
In one run:

1. alone: --clients chat clients of tenant "chats" each stream requests back to back (a
   short question, --max-tokens tokens, EOS ignored) for --duration seconds; per chat its
   TTFT (request sent -> first content chunk) and end-to-end time (-> the stream's end).
2. with neighbour: the same, beside tenant "batch" sending /v1/completions batches of
   --batch-prompts prompts of --batch-prompt-tokens tokens back to back (non-streaming; a 503
   is retried after its Retry-After). The aim: chat TTFT p99 within 1.5x of alone.
3. behind a full batch: tenant "batch" sends one such batch whose prompts generate
   --hold-tokens tokens each (they hold their seats); once every --max-num-seqs seat runs, one
   chat (--probe-tokens tokens) is sent; its TTFT (the aim: < 2 s). --probes times.
4. behind an n = max_num_seqs request: the same, the seats held by tenant "batch"'s one
   completion with n = max_num_seqs (the samples of a single prompt).

--rounds > 1 repeats 1 and 2 in alternating order and reports medians over rounds. Timings
on a shared machine are noisy: compare runs on one quiet machine.

    python -m benchmarks.noisy_neighbour [--duration 30] [--clients 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks import plot
from benchmarks.serve import WORDS, free_port
from kvserve.default_model import default_model_path
from kvserve.tokenizer import Tokenizer

KEYS = {"chats": "chat-key", "batch": "batch-key", "operator": "operator-key"}


@dataclass
class Tally:
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    batches: int = 0  # the neighbour's batches that completed
    refused: int = 0  # the neighbour's 503s


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


async def chat_once(client: httpx.AsyncClient, body: dict, tally: Tally) -> None:
    start = time.perf_counter()
    first: float | None = None
    try:
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers=auth("chats")
        ) as r:
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
        tally.e2e_s.append(time.perf_counter() - start)


def chat_body(rng: random.Random, max_tokens: int) -> dict:
    question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
    return {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }


async def chatter(
    client: httpx.AsyncClient, seed: int, max_tokens: int, until: float, tally: Tally
) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        await chat_once(client, chat_body(rng, max_tokens), tally)


async def neighbour(client: httpx.AsyncClient, body: dict, until: float, tally: Tally) -> None:
    while time.monotonic() < until:
        try:
            r = await client.post("/v1/completions", json=body, headers=auth("batch"))
        except httpx.HTTPError as e:
            tally.failures.append(repr(e))
            await asyncio.sleep(1.0)
            continue
        if r.status_code == 503:
            tally.refused += 1
            await asyncio.sleep(float(r.headers.get("retry-after", "1")))
        elif r.status_code == 200:
            tally.batches += 1
        else:
            tally.failures.append(f"neighbour HTTP {r.status_code}: {r.text[:200]}")
            await asyncio.sleep(1.0)


async def gauges(client: httpx.AsyncClient) -> tuple[float, float]:
    """(running, waiting) sequences, from /metrics."""
    text = (await client.get("/metrics", headers=auth("operator"))).text

    def gauge(name: str) -> float:
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    return gauge("vllm:num_requests_running"), gauge("vllm:num_requests_waiting")


async def until_idle(client: httpx.AsyncClient) -> None:
    while sum(await gauges(client)) > 0:
        await asyncio.sleep(0.5)


def client_for(url: str, connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections)
    return httpx.AsyncClient(base_url=url, limits=limits, timeout=None)


async def run_chats(
    url: str, args: argparse.Namespace, batch: dict | None, seed: int, duration: float
) -> tuple[Tally, Tally]:
    chats, noisy = Tally(), Tally()
    async with client_for(url, args.clients + 8) as client:
        until = time.monotonic() + duration
        tasks = [
            chatter(client, seed * 100 + i, args.max_tokens, until, chats)
            for i in range(args.clients)
        ]
        if batch is not None:
            tasks.append(neighbour(client, batch, until, noisy))
        await asyncio.gather(*tasks)
        await until_idle(client)  # the neighbour's last batch may still run
    return chats, noisy


async def probe_behind(url: str, args: argparse.Namespace, body: dict, seats: int) -> Tally:
    """One chat sent once the ``body`` request of tenant "batch" runs on every seat; the
    request is then abandoned (the server aborts it)."""
    probe = Tally()
    async with client_for(url, 8) as client:
        for i in range(args.probes):
            holder = asyncio.create_task(
                client.post("/v1/completions", json=body, headers=auth("batch"))
            )
            deadline = time.monotonic() + 120
            while (await gauges(client))[0] < seats and time.monotonic() < deadline:
                if holder.done():
                    probe.failures.append(f"the holder ended early: {holder.result()}")
                    break
                await asyncio.sleep(0.05)
            await chat_once(client, chat_body(random.Random(i), args.probe_tokens), probe)
            holder.cancel()
            await asyncio.gather(holder, return_exceptions=True)
            await until_idle(client)
    return probe


def start_server(args: argparse.Namespace, log_dir: Path) -> tuple[subprocess.Popen, str]:
    keys = log_dir / "api-keys"
    keys.write_text(f"{KEYS['chats']} chats\n{KEYS['batch']} batch\n")
    port = free_port()
    argv = [sys.executable, "-m", "kvserve.cli", "serve", "--dtype", args.dtype]
    # compiled before /health: a background compile would share the CPU with the first run
    argv += ["--compile-mode", "sync"]
    argv += ["--port", str(port), "--log-interval", "60", "--api-key", KEYS["operator"]]
    argv += ["--api-keys", str(keys), *args.kvserve_args.split()]
    log = open(log_dir / "kvserve.log", "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600  # a first start builds the C++ kernels (minutes)
    while time.monotonic() < deadline:  # /health is open without a key: 200 once loaded
        if proc.poll() is not None:
            raise RuntimeError(f"kvserve exited: {(log_dir / 'kvserve.log').read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("kvserve did not start")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--duration", type=float, default=30.0, help="seconds per chat run")
    p.add_argument("--clients", type=int, default=32, help="streaming chat clients")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per chat")
    p.add_argument("--batch-prompts", type=int, default=256)
    p.add_argument("--batch-prompt-tokens", type=int, default=256)
    p.add_argument("--hold-tokens", type=int, default=64, help="tokens per held-seat sample")
    p.add_argument("--probe-tokens", type=int, default=4, help="tokens of a probe chat")
    p.add_argument("--probes", type=int, default=3, help="probe chats per held-seat case")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kvserve-args", default="", help="extra `kvserve serve` flags")
    plot.add_plot_arg(p)
    args = p.parse_args(argv)

    gguf = default_model_path()
    tok = Tokenizer.load(gguf.parent, gguf)
    rng = random.Random(7)
    text = " ".join(rng.choice(WORDS) for _ in range(args.batch_prompt_tokens * 2))
    base = tok.encode(text, add_special_tokens=False)[: args.batch_prompt_tokens - 4]
    n = args.batch_prompts

    def batch(tag: int, max_tokens: int) -> dict:
        # distinct prompts each time (4 fresh tokens up front): no cache hits
        prompts = [[100 + tag, 200 + i % 50, 300 + i // 50, 7, *base] for i in range(n)]
        body = {"prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0}
        return {**body, "ignore_eos": True}

    proc, url = start_server(args, Path(tempfile.mkdtemp(prefix="kvserve-noisy-")))
    runs: dict[str, list[tuple[Tally, Tally]]] = {"alone": [], "with neighbour": []}
    try:
        seats = httpx.get(f"{url}/server_info", headers=auth("operator")).json()
        seats = int(seats["max_running_requests"])
        asyncio.run(run_chats(url, args, None, seed=99, duration=3.0))  # warm-up
        for rnd in range(args.rounds):
            order = ["alone", "with neighbour"] if rnd % 2 == 0 else ["with neighbour", "alone"]
            for name in order:
                body = batch(rnd, 4) if name == "with neighbour" else None
                chats, noisy = asyncio.run(run_chats(url, args, body, rnd, args.duration))
                runs[name].append((chats, noisy))
                print(
                    f"round {rnd} {name}: {len(chats.ttft_s)} chats, TTFT p50 "
                    f"{1e3 * pct(chats.ttft_s, 0.5):.0f} ms p99 "
                    f"{1e3 * pct(chats.ttft_s, 0.99):.0f} ms; neighbour {noisy.batches} "
                    f"batches, {noisy.refused} refused; failures "
                    f"{(chats.failures + noisy.failures)[:2]}",
                    file=sys.stderr,
                )
        full = asyncio.run(probe_behind(url, args, batch(50, args.hold_tokens), seats))
        sample = {"prompt": base, "max_tokens": args.hold_tokens, "temperature": 1.0}
        wide = {**sample, "n": seats, "ignore_eos": True, "seed": 1}
        many = asyncio.run(probe_behind(url, args, wide, seats))
    finally:
        proc.terminate()
    report(runs, {f"all {seats} seats held by a batch": full, f"n={seats}": many}, args)


def report(runs: dict[str, list[tuple[Tally, Tally]]], probes: dict[str, Tally], args) -> None:
    def med(name: str, what: str, q: float) -> float:
        return statistics.median(1e3 * pct(getattr(c, what), q) for c, _ in runs[name])

    title = (
        f"noisy-neighbour: {args.clients} streaming chats ({args.max_tokens} tokens), "
        f"neighbour: batches of {args.batch_prompts} x {args.batch_prompt_tokens}-token "
        f"prompts; {args.duration:g} s per run, medians of {args.rounds} round(s)"
    )
    print(title)
    head = f"{'run':<15} {'chats':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'e2e p50':>9}"
    print(f"{head} {'e2e p99':>9} {'batches':>8} {'503s':>5} {'fail':>5}")
    for name, pairs in runs.items():
        chats = statistics.median(len(c.ttft_s) for c, _ in pairs)
        batches = statistics.median(n.batches for _, n in pairs)
        refused = statistics.median(n.refused for _, n in pairs)
        fails = sum(len(c.failures) + len(n.failures) for c, n in pairs)
        cells = [med(name, w, q) for w in ("ttft_s", "e2e_s") for q in (0.5, 0.99)]
        print(
            f"{name:<15} {chats:>6.0f} "
            + " ".join(f"{v:>7.0f}ms" for v in cells)
            + f" {batches:>8.0f} {refused:>5.0f} {fails:>5d}"
        )
    for what, label in (("ttft_s", "TTFT"), ("e2e_s", "e2e")):
        r50, r99 = (med("with neighbour", what, q) / med("alone", what, q) for q in (0.5, 0.99))
        aim = " (aim: p99 <= 1.5x)" if what == "ttft_s" else ""
        print(f"{label} with / without the neighbour: p50 {r50:.2f}x, p99 {r99:.2f}x{aim}")
    for case, t in probes.items():
        ms = ", ".join(f"{1e3 * v:.0f}" for v in t.ttft_s)
        fails = f"; failures {t.failures[:2]}" if t.failures else ""
        print(
            f"one {args.probe_tokens}-token chat behind {case} (another tenant's): TTFT {ms} ms, "
            f"max {1e3 * max(t.ttft_s, default=float('nan')):.0f} ms (aim < 2000 ms){fails}"
        )
    if args.plot:
        ttft = {name: [med(name, "ttft_s", 0.5), med(name, "ttft_s", 0.99)] for name in runs}
        batches = statistics.median(n.batches for _, n in runs["with neighbour"])
        title += f"; one kvserve serve (default model, --dtype {args.dtype} {args.kvserve_args}"
        draw(args.plot, title.rstrip() + ")", ttft, batches)


def draw(path, title: str, ttft: dict[str, list[float]], batches: float) -> None:
    """The chats' TTFT p50 / p99 (ms), alone vs with the neighbour (whose median completed
    batches per run is ``batches``); the with-neighbour bars carry the ratio, and a line marks
    the aim (p99 <= 1.5x alone)."""
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
        subtitle=f"streaming chats (neighbour: {batches:.0f} batches per run)",
        xlabel="percentile",
        refs=[(1.5 * alone[1], "aim: p99 <= 1.5x alone")],
    )


if __name__ == "__main__":
    main()
