"""The worker's Prometheus series, with the seed's names and labels.

Labels are ``adapter_id, adapter_version, tenant_id, base_model`` everywhere. The two
ratios of the seed are exported as gauges next to the counters they are computed from, so
dashboards can use either the ready ratio or ``rate()`` of the counters. prometheus-client
adds ``_total`` to counter names (``kv_namespace_conflict_total``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplane.kernel.topic_tail import TopicTail

if TYPE_CHECKING:
    from loraplane.workers.command_feed import ReadBytes

LABELS = ("adapter_id", "adapter_version", "tenant_id", "base_model")
MS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 30_000)


@dataclass(frozen=True)
class AdapterLabels:
    adapter_id: str
    adapter_version: str
    tenant_id: str
    base_model: str

    def values(self) -> tuple[str, str, str, str]:
        return self.adapter_id, self.adapter_version, self.tenant_id, self.base_model


@dataclass
class _RequestSeries:
    """The children every request of one adapter updates (a gateway's hot path)."""

    requests: Any
    hit_rate: Any
    parts: list[float]  # [hits, requests] behind the hit-rate gauge
    hot_hits: Any = None  # these two are made at their first use: no zero series before
    ttft: Any = None


class WorkerMetrics:
    """One per agent, on its own registry (several agents may share a test process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("hot_adapter_requests", "Requests routed to an adapter",
                                LABELS, registry=r)
        self.hot_hits = Counter("hot_adapter_hits", "Requests that found their adapter on GPU",
                                LABELS, registry=r)
        self.hot_adapter_hit_rate = Gauge(
            "hot_adapter_hit_rate", "Share of requests whose adapter was already on GPU",
            LABELS, registry=r)
        self.adapter_swap_ms = Histogram("adapter_swap_ms", "Host -> vLLM load time (ms)",
                                         LABELS, buckets=MS_BUCKETS, registry=r)
        self.cold_loads = Counter("cold_loads", "Cold loads attempted", LABELS, registry=r)
        self.cold_load_failures = Counter("cold_load_failures", "Cold loads that failed",
                                          LABELS, registry=r)
        self.cold_load_fail_ratio = Gauge("cold_load_fail_ratio",
                                          "Failed / attempted cold loads", LABELS, registry=r)
        self.kv_namespace_conflict = Counter(
            "kv_namespace_conflict", "Names vLLM served that this agent did not load with "
            "those bytes", LABELS, registry=r)
        self.commands_refused = Counter(
            "commands_refused", "Cache commands refused before or by the fold, by reason "
            "(schemas.reasons.CommandRejection)", ("reason",), registry=r)
        self.ttft_ms = Histogram("request_ttft_ms", "Time to first token through the gateway",
                                 LABELS, buckets=MS_BUCKETS, registry=r)
        self.host_install_failures = Counter(
            "host_install_failures", "Host-tier installs that failed or were refused, by "
            "reason (schemas.reasons.ArtifactReason)", ("reason",), registry=r)
        self.registry_view_refused = Counter(
            "registry_view_refused", "Registry records refused: their signed lifecycle "
            "evidence does not verify with this worker's keyring", ("reason",), registry=r)
        self.command_loop_errors = Counter(
            "command_loop_errors", "Command-feed steps that failed (logged); the loop goes "
            "on", registry=r)
        self.registry_read_failures = Counter(
            "registry_read_failures", "Registry reads that failed or did not reach the end "
            "of the topic; the last good view kept serving", registry=r)
        self._ratio_parts: dict[tuple[str, ...], list[float]] = {}
        self._series: dict[AdapterLabels, _RequestSeries] = {}

    def _ratio(self, gauge: Gauge, key: str, labels: AdapterLabels, hit: bool) -> None:
        parts = self._ratio_parts.setdefault((key, *labels.values()), [0.0, 0.0])
        parts[0] += hit
        parts[1] += 1
        gauge.labels(*labels.values()).set(parts[0] / parts[1])

    def request(self, labels: AdapterLabels, *, hot: bool) -> None:
        series = self._series.get(labels)
        if series is None:  # labels() takes a lock and builds a key: once per adapter
            values = labels.values()
            series = self._series[labels] = _RequestSeries(
                self.requests.labels(*values), self.hot_adapter_hit_rate.labels(*values),
                self._ratio_parts.setdefault(("hit", *values), [0.0, 0.0]))
        series.requests.inc()
        if hot:
            if series.hot_hits is None:
                series.hot_hits = self.hot_hits.labels(*labels.values())
            series.hot_hits.inc()
        series.parts[0] += hot
        series.parts[1] += 1
        series.hit_rate.set(series.parts[0] / series.parts[1])

    def cold_load(self, labels: AdapterLabels, *, ok: bool, swap_ms: float = 0.0) -> None:
        self.cold_loads.labels(*labels.values()).inc()
        if ok:
            self.adapter_swap_ms.labels(*labels.values()).observe(swap_ms)
        else:
            self.cold_load_failures.labels(*labels.values()).inc()
        self._ratio(self.cold_load_fail_ratio, "fail", labels, not ok)

    def host_install_failed(self, reason: str) -> None:
        self.host_install_failures.labels(str(reason)).inc()

    def view_refused(self, reason: str) -> None:
        self.registry_view_refused.labels(str(reason)).inc()

    def command_loop_error(self) -> None:
        self.command_loop_errors.inc()

    def registry_read_failed(self) -> None:
        self.registry_read_failures.inc()

    def conflict(self, labels: AdapterLabels) -> None:
        self.kv_namespace_conflict.labels(*labels.values()).inc()

    def command_refused(self, reason: str) -> None:
        self.commands_refused.labels(reason).inc()

    def ttft(self, labels: AdapterLabels, ms: float) -> None:
        series = self._series.get(labels)
        if series is None:
            self.ttft_ms.labels(*labels.values()).observe(ms)
            return
        if series.ttft is None:
            series.ttft = self.ttft_ms.labels(*labels.values())
        series.ttft.observe(ms)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class TailMetrics(Collector):
    """Whether a live topic tail (``kernel.topic_tail``: the registry) is the topic's
    present: ``topic_tail_caught_up`` 0 until the first complete read, ``topic_tail_lag``
    the records known to be unread, ``topic_tail_current`` 1 when caught up, not behind and
    the broker answering (a view that is not current keeps serving, just older)."""

    def __init__(self, tails: Iterable[TopicTail]) -> None:
        self.tails = list(tails)

    def collect(self) -> Iterator[Metric]:
        caught_up = GaugeMetricFamily("topic_tail_caught_up", "1 once the topic was read to "
                                      "its end", labels=["component"])
        lag = GaugeMetricFamily("topic_tail_lag", "Records between the tail's position and "
                                "the topic's end as last learned", labels=["component"])
        current = GaugeMetricFamily("topic_tail_current", "1 when the view is the topic's "
                                    "present (caught up, no lag, broker answering)",
                                    labels=["component"])
        for t in self.tails:
            caught_up.add_metric([t.component], float(t.caught_up))
            lag.add_metric([t.component], t.lag())
            current.add_metric([t.component], float(t.current()))
        yield caught_up
        yield lag
        yield current


class CommandBytesMetrics(Collector):
    """``commands_read_bytes_total{own}``: key + value bytes of the commands records the
    worker's feed read, its own (``own="true"``) and other workers' that share its
    partition (``"false"``): what per-worker delivery costs it (issue #15: others' stay
    well under its own)."""

    def __init__(self, read: ReadBytes) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("commands_read_bytes", "Key + value bytes of the "
                                     "commands records read, this worker's own or not",
                                     labels=["own"])
        family.add_metric(["true"], float(self.read.own))
        family.add_metric(["false"], float(self.read.other))
        yield family
