"""The serve-poisson client: Poisson arrivals against an OpenAI /v1/completions endpoint,
measured the way `vllm bench serve` defines its numbers.

- TTFT: request sent -> first streamed chunk that carries text.
- ITL: the gaps between successive chunks that carry text.
- TPOT: (latency - TTFT) / (output tokens - 1), per request.
- output tokens: EOS is suppressed, so a request that ends with finish_reason "length" made
  exactly max_tokens tokens (re-tokenizing the text, as vllm bench does without usage, merges
  tokens: 58 counted for 70 generated); any other ending counts as a failed request.
- goodput: requests per second that met every SLO (TTFT and TPOT).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        return (
            (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0
        )


@dataclass
class RunResult:
    duration: float
    results: list[RequestResult]

    def summary(self, slo_ttft_s: float, slo_tpot_s: float) -> dict[str, float]:
        ok = [r for r in self.results if r.ok]

        def pct(values: list[float], q: float) -> float:
            if not values:
                return float("nan")
            values = sorted(values)
            return values[min(len(values) - 1, int(q * len(values)))]

        ttft = [r.ttft for r in ok]
        tpot = [r.tpot for r in ok if r.output_tokens > 1]
        itl = [x for r in ok for x in r.itl]
        good = [r for r in ok if r.ttft <= slo_ttft_s and r.tpot <= slo_tpot_s]
        return {
            "completed": len(ok),
            "failed": len(self.results) - len(ok),
            "duration_s": self.duration,
            "output_tok_s": sum(r.output_tokens for r in ok) / self.duration,
            "req_s": len(ok) / self.duration,
            "goodput_req_s": len(good) / self.duration,
            "ttft_med_ms": 1e3 * statistics.median(ttft) if ttft else float("nan"),
            "ttft_p99_ms": 1e3 * pct(ttft, 0.99),
            "tpot_med_ms": 1e3 * statistics.median(tpot) if tpot else float("nan"),
            "tpot_p99_ms": 1e3 * pct(tpot, 0.99),
            "itl_med_ms": 1e3 * statistics.median(itl) if itl else float("nan"),
            "itl_p99_ms": 1e3 * pct(itl, 0.99),
        }


async def _one(client: httpx.AsyncClient, url: str, payload: dict) -> RequestResult:
    start = time.perf_counter()
    ttft: float | None = None
    last = start
    itl: list[float] = []
    finish: str | None = None
    try:
        async with client.stream("POST", url, json=payload) as r:
            if r.status_code != 200:
                return RequestResult(False, error=f"HTTP {r.status_code}: {await r.aread()!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data.strip() == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestResult(False, error=str(chunk["error"]))
                choices = chunk.get("choices") or []
                finish = next(
                    (c["finish_reason"] for c in choices if c.get("finish_reason")), finish
                )
                delta = "".join(c.get("text") or "" for c in choices)
                if not delta:
                    continue
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - start
                else:
                    itl.append(now - last)
                last = now
    except httpx.HTTPError as e:
        return RequestResult(False, error=repr(e))
    latency = time.perf_counter() - start
    if ttft is None:
        return RequestResult(False, error="no text streamed")
    if finish != "length":  # EOS is suppressed: anything else was cut short
        return RequestResult(False, error=f"finish_reason {finish!r}, not 'length'")
    return RequestResult(True, ttft, latency, payload["max_tokens"], itl)


async def run_poisson(
    base_url: str,
    payloads: list[dict],
    rate: float,
    max_concurrency: int,
    seed: int = 0,
) -> RunResult:
    """Send ``payloads`` with exponential gaps of mean 1/rate (rate inf: all at once), at most
    ``max_concurrency`` in flight, as vllm bench serve's --request-rate / --max-concurrency."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(max_concurrency)
    limits = httpx.Limits(max_connections=max_concurrency + 4)
    timeout = httpx.Timeout(None)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:

        async def gated(payload: dict) -> RequestResult:
            async with gate:
                return await _one(client, "/v1/completions", payload)

        tasks = []
        start = time.perf_counter()
        for payload in payloads:
            tasks.append(asyncio.create_task(gated(payload)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return RunResult(time.perf_counter() - start, list(results))
