"""Prometheus metrics under vLLM's names, in a registry of the server's own (no globals).

Gauges and counters come from ``AsyncEngine.stats()`` at scrape time: the engine loop's
latest ``EngineStats`` snapshot, so they can never drift from the engine's own counts, except
waiting, which is the AsyncEngine's live count of sequences (n x prompts) not yet started,
kept where requests enter (a snapshot taken between steps would miss what arrived during a
long step), plus the preempted ones. The latency histograms are
observed by the engine loop thread as tokens come out (prometheus_client is thread-safe).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.engine.engine import EngineStats

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards built for vLLM read ours.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineStatsCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        if s is None:  # still loading
            return
        label = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=label)
            g.add_metric([self.model_name], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=label)
            c.add_metric([self.model_name], value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge(
            "vllm:num_requests_waiting",
            "Sequences waiting to run (queued or preempted).",
            s.num_waiting,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV cache usage: 1 means every block is in use.",
            s.kv_cache_usage,
        )  # fmt: skip
        yield counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        )  # fmt: skip
        yield counter(
            "vllm:prefix_cache_hits", "Prompt tokens served by the prefix cache.",
            s.prefix_cache_hits,
        )  # fmt: skip
        yield counter("vllm:num_preemptions", "Preemptions.", s.num_preemptions)
        yield counter("vllm:prompt_tokens", "Prompt tokens admitted.", s.prompt_tokens)
        yield counter("vllm:generation_tokens", "Tokens generated.", s.generation_tokens)


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(model_name, stats))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)
            return h.labels(model_name)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token (s).", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Time between output tokens (s).", ITL_BUCKETS
        )
        self.e2e_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to last token (s).", E2E_BUCKETS
        )
        self.model_name = model_name
        self._success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )

    def request_finished(self, finish_reason: str | None) -> None:
        self._success.labels(self.model_name, finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
