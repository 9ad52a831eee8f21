"""`/metrics`: the engine's gauges (read from `EngineHandle.stats()` at each scrape) and the HTTP
layer's counters and histograms, in Prometheus text (prometheus_client, one registry per server).

Several front processes (`--api-server-count`): prometheus_client's multiprocess mode (the first front
sets `PROMETHEUS_MULTIPROC_DIR` for all before any import): every front's counters and histograms are
summed at each scrape, whichever front answers it; the engine's gauges are the cores' own (every front
gets their status)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from dsv4serve.protocol import DoneEvent, StatsEvent

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], StatsEvent]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        yield GaugeMetricFamily("dsv4serve_requests_running", "Requests in the running batch", s.running)
        yield GaugeMetricFamily("dsv4serve_requests_waiting", "Accepted requests not running", s.waiting)
        yield GaugeMetricFamily("dsv4serve_tokens_per_second", "Generated tokens per second", s.tokens_per_s)
        used = GaugeMetricFamily("dsv4serve_pool_used_slots", "Slots in use per pool", labels=["pool"])
        cap = GaugeMetricFamily("dsv4serve_pool_capacity_slots", "Slots per pool", labels=["pool"])
        for name, pool in sorted(s.pools.items()):
            used.add_metric([name], pool.used)
            cap.add_metric([name], pool.capacity)
        yield used
        yield cap
        weights = GaugeMetricFamily(
            "dsv4serve_weight_bytes", "Resident weight bytes by format", labels=["format"]
        )
        for fmt, n in sorted(s.weight_bytes.items()):
            weights.add_metric([fmt], n)
        yield weights
        yield CounterMetricFamily("dsv4serve_preemptions", "Preemptions", s.num_preemptions)
        yield CounterMetricFamily("dsv4serve_engine_steps", "Engine steps", s.num_steps)
        yield CounterMetricFamily(
            "dsv4serve_engine_generated_tokens",
            "Tokens sampled by the engine (cancelled requests' too)",
            s.num_generated,
        )


class Metrics:
    def __init__(
        self, stats: Callable[[], StatsEvent], on_end: Callable[[Callable[[str], None]], None]
    ) -> None:
        self.registry = CollectorRegistry()  # what a scrape renders
        self.registry.register(_EngineCollector(stats))
        r = self.registry
        folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if folder:  # this front's values go to its files there; a scrape sums every front's
            MultiProcessCollector(self.registry, path=folder)
            r = CollectorRegistry()
        self.requests_finished = Counter("dsv4serve_requests_finished", "Requests finished", registry=r)
        self.requests_ended = Counter(
            "dsv4serve_requests_ended",
            "Requests ended, by finish reason (cancelled, error too)",
            ["reason"],
            registry=r,
        )
        on_end(self._ended)
        self.http_requests = Counter(
            "dsv4serve_http_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.ttft = Histogram(
            "dsv4serve_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "dsv4serve_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "dsv4serve_request_latency_seconds", "Arrival to done", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("dsv4serve_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("dsv4serve_generation_tokens", "Generated tokens", registry=r)

    def _ended(self, reason: str) -> None:
        self.requests_finished.inc()
        self.requests_ended.labels(reason).inc()

    def finished(self, done: DoneEvent) -> None:
        t = done.timing
        self.ttft.observe(t.ttft_ms / 1e3)
        self.e2e.observe(t.total_ms / 1e3)
        n = done.usage.completion_tokens
        if n > 1:
            self.tpot.observe((t.total_ms - t.ttft_ms) / 1e3 / (n - 1))
        self.prompt_tokens.inc(done.usage.prompt_tokens)
        self.generation_tokens.inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
