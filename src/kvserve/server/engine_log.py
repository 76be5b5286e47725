"""What the AsyncEngine's loop reports: a log line per finished request, the periodic load
line, and the latency histograms observed as tokens come out."""

from __future__ import annotations

import logging

from kvserve.engine.engine import EngineStats
from kvserve.engine.request import RequestOutput
from kvserve.server.metrics import ServerMetrics

logger = logging.getLogger("kvserve.server.async_engine")


def log_finished(out: RequestOutput) -> None:
    def ms(s: float | None) -> str:
        return "-" if s is None else f"{s * 1e3:.0f} ms"

    logger.info(
        "request %s finished (%s): prompt %d tokens (%d cached), generated %d; "
        "queue %s, TTFT %s, decode %s",
        out.request_id,
        out.finish_reason,
        len(out.prompt_token_ids),
        out.num_cached_tokens,
        len(out.token_ids),
        ms(out.queue_time_s),
        ms(out.ttft_s),
        ms(out.decode_time_s),
    )


def log_stats(s: EngineStats) -> None:
    hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
    logger.info(
        "running %d, waiting %d, KV cache usage %.1f%% (%d/%d blocks), prefix cache hit "
        "rate %.1f%%, %d preemptions",
        s.num_running,
        s.num_waiting,
        100 * s.kv_cache_usage,
        s.num_used_blocks,
        s.num_blocks,
        100 * hit_rate,
        s.num_preemptions,
    )


def observe(
    metrics: ServerMetrics, last_token_at: dict[str, float], out: RequestOutput, now: float
) -> None:
    """TTFT on a sample's first token, inter-token latency after; ``last_token_at`` is the
    group's per-sample time of its latest token (updated here)."""
    if not out.new_token_ids:
        return
    prev = last_token_at.get(out.request_id)
    if prev is None:
        if out.ttft_s is not None:
            metrics.ttft.observe(out.ttft_s)
    else:
        metrics.inter_token_latency.observe(now - prev)
    last_token_at[out.request_id] = now
    if out.finished:
        metrics.request_finished(out.finish_reason)
