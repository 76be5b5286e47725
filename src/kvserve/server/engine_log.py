"""The AsyncEngine's log lines: one per finished request, and the periodic load line."""

from __future__ import annotations

import logging

from kvserve.engine.engine import EngineStats
from kvserve.engine.request import RequestOutput

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
