"""The latest finished sequences' TTFT and TPOT, for the web view's live figures.

The Prometheus histograms (server/metrics.py) hold every observation since start in fixed
buckets, from which no exact recent median can be read; this keeps the exact values of the
last ``size`` finished sequences instead. Written and read on the engine loop thread only
(``AsyncEngine._deliver`` records, ``/v1/kv_state`` reads through ``AsyncEngine.call``).

    TTFT = arrival -> first token                       (RequestOutput.ttft_s)
    TPOT = (first token -> finished) / (output tokens - 1)   (sequences of 2+ tokens only)
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from kvserve.engine.request import RequestOutput

DEFAULT_WINDOW = 64


@dataclass(frozen=True, slots=True)
class LatencySummary:
    window: int  # how many finished sequences the medians may cover at most
    num_ttft: int  # how many they cover now (TTFT)
    num_tpot: int  # (TPOT: sequences of 2 or more output tokens)
    ttft_median_s: float | None  # None: none finished yet
    tpot_median_s: float | None
    ttft_last_s: float | None  # the latest entry of each
    tpot_last_s: float | None


class LatencyWindow:
    """The last ``size`` finished sequences' TTFT, and TPOT of those with 2+ output tokens."""

    def __init__(self, size: int = DEFAULT_WINDOW) -> None:
        if size < 1:
            raise ValueError(f"the latency window must hold >= 1 sequence, got {size}")
        self.size = size
        self._ttft: deque[float] = deque(maxlen=size)
        self._tpot: deque[float] = deque(maxlen=size)

    def record(self, out: RequestOutput) -> None:
        """A sequence's final output (finish reason stop / length; errors and aborts are not
        latencies a client saw)."""
        if not out.finished or out.finish_reason not in ("stop", "length"):
            return
        if out.ttft_s is not None:
            self._ttft.append(out.ttft_s)
        n = len(out.token_ids or ())
        if out.decode_time_s is not None and n > 1:
            self._tpot.append(out.decode_time_s / (n - 1))

    def summary(self) -> LatencySummary:
        def median(values: deque[float]) -> float | None:
            return statistics.median(values) if values else None

        return LatencySummary(
            window=self.size,
            num_ttft=len(self._ttft),
            num_tpot=len(self._tpot),
            ttft_median_s=median(self._ttft),
            tpot_median_s=median(self._tpot),
            ttft_last_s=self._ttft[-1] if self._ttft else None,
            tpot_last_s=self._tpot[-1] if self._tpot else None,
        )
