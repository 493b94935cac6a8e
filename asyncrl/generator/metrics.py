"""Gateway metrics: counters kept as data, rendered as Prometheus text on /metrics.

Owns: request/token counters, in-flight gauge, latency histogram, a sliding tokens/s rate, and
rendering them (plus per-replica weight versions passed in) with a private prometheus registry.
Names are `generator/<metric>` as data (`snapshot()`); Prometheus forbids '/', so the exposition
uses `asyncrl_generator_<metric>`.

Must never: call an engine or block.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))


class GatewayMetrics:
    def __init__(self, rate_window_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("asyncrl_generator_requests", "HTTP generation requests", ["route", "status"], registry=self.registry)
        self.tokens = Counter("asyncrl_generator_tokens_generated", "Completion tokens returned", registry=self.registry)
        self.in_flight = Gauge("asyncrl_generator_queue_depth", "Generation requests in flight at this gateway", registry=self.registry)
        self.latency = Histogram("asyncrl_generator_request_latency_seconds",
                                 "End-to-end request latency", ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.rate = Gauge("asyncrl_generator_tokens_per_second", f"Completion tokens/s over the last {rate_window_s:.0f}s", registry=self.registry)
        self.replica_version = Gauge("asyncrl_generator_weight_version", "Weight version per engine replica", ["replica"], registry=self.registry)
        self.replica_ongoing = Gauge("asyncrl_generator_replica_ongoing_requests",
                                     "Requests running in each engine replica", ["replica"], registry=self.registry)
        self.replica_engine_requests = Gauge("asyncrl_generator_replica_engine_requests",
                                             "Requests the engine holds (queued or running), per engine replica", ["replica"], registry=self.registry)
        self.replica_in_flight = Gauge("asyncrl_generator_replica_tokens_in_flight",
                                       "Tokens produced for sequences still running, per engine replica", ["replica"], registry=self.registry)
        self._window, self._clock = rate_window_s, clock
        self._events: collections.deque[tuple[float, int]] = collections.deque()
        self._totals: dict[str, float] = collections.defaultdict(float)

    def observe(self, route: str, status: int, latency_s: float, tokens: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()
        self.latency.labels(route=route).observe(latency_s)
        self._totals["requests"] += 1
        if status >= 400:
            self._totals["requests_failed"] += 1
        self.add_tokens(tokens)

    def add_tokens(self, tokens: int) -> None:
        if tokens:
            self.tokens.inc(tokens)
            self._totals["tokens_generated"] += tokens
            now = self._clock()
            self._events.append((now, tokens))
            self._forget(now)  # (also here: a gateway nobody scrapes must not keep every request's tokens)

    def _forget(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self._window:
            self._events.popleft()

    def tokens_per_second(self) -> float:
        self._forget(self._clock())
        return sum(n for _, n in self._events) / self._window

    def snapshot(self) -> dict[str, Any]:
        return {
            "generator/requests": self._totals["requests"],
            "generator/requests_failed": self._totals["requests_failed"],
            "generator/tokens_generated": self._totals["tokens_generated"],
            "generator/tokens_per_s": self.tokens_per_second(),
            "generator/queue_depth": self.in_flight._value.get(),
        }

    def render(self, replica_stats: dict[str, dict[str, Any]] | None = None) -> bytes:
        self.rate.set(self.tokens_per_second())
        self.replica_version.clear()
        self.replica_ongoing.clear()
        self.replica_in_flight.clear()
        self.replica_engine_requests.clear()
        for rid, stats in (replica_stats or {}).items():
            self.replica_version.labels(replica=rid).set(stats.get("version", -1))
            self.replica_ongoing.labels(replica=rid).set(stats.get("generator/ongoing", 0))
            self.replica_in_flight.labels(replica=rid).set(stats.get("generator/tokens_in_flight", 0))
            self.replica_engine_requests.labels(replica=rid).set(stats.get("engine_unfinished_requests", 0))
        return generate_latest(self.registry)


_TRAINING_PREFIXES = ("train/", "eval/", "buffer/", "weightsync/", "rollout/", "time/", "actor/", "critic/")


def render_training(metrics: dict[str, Any] | None) -> bytes:
    """The training loop's latest step metrics as Prometheus gauges (`asyncrl_weightsync_push_seconds`,
    `asyncrl_buffer_trained`, ...): numbers only, names sanitised, one line each."""
    lines = []
    for key in sorted(metrics or {}):
        value = metrics[key]
        if not key.startswith(_TRAINING_PREFIXES) or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        name = "asyncrl_" + "".join(c if c.isalnum() else "_" for c in key)
        lines.append(f"# TYPE {name} gauge\n{name} {float(value)!r}")
    return ("\n".join(lines) + "\n").encode() if lines else b""
