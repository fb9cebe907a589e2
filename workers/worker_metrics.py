"""The worker's Prometheus series: the seed's series, named by ``kernel.metric_names``.

Labels are ``adapter_id, adapter_version, tenant_id, base_model`` everywhere. The two
ratios of the seed are exported as gauges next to the counters they are computed from, so
dashboards can use either the ready ratio or ``rate()`` of the counters. Times are in
seconds here (Prometheus' base unit); the seed's milliseconds stay in the events and in
ClickHouse (``adapter_swap_ms``). ``ResidencyMetrics`` says which adapters are loaded in
vLLM's proposed ``vllm:lora_adapter_loaded`` shape, for llm-d's lora-load-state scorer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplane.kernel import metric_names as m

if TYPE_CHECKING:
    from loraplane.workers.command_feed import ReadBytes

__all__ = [
    "LABELS",
    "SECONDS_BUCKETS",
    "AdapterLabels",
    "CommandBytesMetrics",
    "ResidencyMetrics",
    "Resident",
    "WorkerMetrics",
]

LABELS = ("adapter_id", "adapter_version", "tenant_id", "base_model")
SECONDS_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)


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
        self.requests = Counter(
            m.ADAPTER_REQUESTS, "Requests routed to an adapter", LABELS, registry=r
        )
        self.hot_hits = Counter(
            m.ADAPTER_HITS, "Requests that found their adapter on GPU", LABELS, registry=r
        )
        self.hot_adapter_hit_rate = Gauge(
            m.ADAPTER_HIT_RATE,
            "Share of requests whose adapter was already on GPU",
            LABELS,
            registry=r,
        )
        self.adapter_swap_seconds = Histogram(
            m.ADAPTER_SWAP_SECONDS,
            "Host -> vLLM load time (s)",
            LABELS,
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.cold_loads = Counter(m.COLD_LOADS, "Cold loads attempted", LABELS, registry=r)
        self.cold_load_failures = Counter(
            m.COLD_LOAD_FAILURES, "Cold loads that failed", LABELS, registry=r
        )
        self.cold_load_fail_ratio = Gauge(
            m.COLD_LOAD_FAIL_RATIO, "Failed / attempted cold loads", LABELS, registry=r
        )
        self.kv_namespace_conflict = Counter(
            m.KV_NAMESPACE_CONFLICTS,
            "Names vLLM served that this agent did not load with those bytes",
            LABELS,
            registry=r,
        )
        self.foreign_changes = Counter(
            m.VLLM_FOREIGN_CHANGES,
            "Changes to vLLM's adapters this agent did not make, by "
            "reason (schemas.reasons.ForeignChange)",
            ("reason",),
            registry=r,
        )
        self.commands_refused = Counter(
            m.COMMANDS_REFUSED,
            "Cache commands refused before or by the fold, by reason "
            "(schemas.reasons.CommandRejection)",
            ("reason",),
            registry=r,
        )
        self.ttft_seconds = Histogram(
            m.REQUEST_TTFT_SECONDS,
            "Time to first token through the gateway (s)",
            LABELS,
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.host_install_failures = Counter(
            m.HOST_INSTALL_FAILURES,
            "Host-tier installs that failed or were refused, by "
            "reason (schemas.reasons.ArtifactReason)",
            ("reason",),
            registry=r,
        )
        self.registry_view_refused = Counter(
            m.REGISTRY_VIEW_REFUSED,
            "Registry records refused: their signed lifecycle "
            "evidence does not verify with this worker's keyring",
            ("reason",),
            registry=r,
        )
        self.command_loop_errors = Counter(
            m.COMMAND_LOOP_ERRORS,
            "Command-feed steps that failed (logged); the loop goes on",
            registry=r,
        )
        self.registry_read_failures = Counter(
            m.REGISTRY_READ_FAILURES,
            "Registry reads that failed or did not reach the end "
            "of the topic; the last good view kept serving",
            registry=r,
        )
        self.worker_heartbeat = Gauge(
            m.WORKER_HEARTBEAT, "Unix time of the last worker-state heartbeat published", registry=r
        )
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
                self.requests.labels(*values),
                self.hot_adapter_hit_rate.labels(*values),
                self._ratio_parts.setdefault(("hit", *values), [0.0, 0.0]),
            )
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
            self.adapter_swap_seconds.labels(*labels.values()).observe(swap_ms / 1000)
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

    def foreign_change(self, reason: str) -> None:
        self.foreign_changes.labels(str(reason)).inc()

    def command_refused(self, reason: str) -> None:
        self.commands_refused.labels(reason).inc()

    def ttft(self, labels: AdapterLabels, ms: float) -> None:
        """``ms`` as the gateway measures it (and the request log keeps); seconds out."""
        series = self._series.get(labels)
        if series is None:
            self.ttft_seconds.labels(*labels.values()).observe(ms / 1000)
            return
        if series.ttft is None:
            series.ttft = self.ttft_seconds.labels(*labels.values())
        series.ttft.observe(ms / 1000)

    def heartbeat(self, now: float) -> None:
        """The wall-clock time of the last state the agent published (stale-heartbeat
        alert: the loop may hang while /metrics still answers)."""
        self.worker_heartbeat.set(now)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class CommandBytesMetrics(Collector):
    """``loraplane_commands_read_bytes_total{own}``: key + value bytes of the commands records the
    worker's feed read, its own (``own="true"``) and other workers' that share its
    partition (``"false"``): what per-worker delivery costs it (others' should stay well
    under its own)."""

    def __init__(self, read: ReadBytes) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            m.COMMANDS_READ_BYTES,
            "Key + value bytes of the commands records read, this worker's own or not",
            labels=["own"],
        )
        family.add_metric(["true"], float(self.read.own))
        family.add_metric(["false"], float(self.read.other))
        yield family


@dataclass(frozen=True)
class Resident:
    """One adapter vLLM serves or the host tier holds, as ``vllm:lora_adapter_loaded``
    labels it: ``level`` ``gpu`` (loaded in vLLM) or ``cpu`` (host tier only)."""

    adapter_name: str  # the lora name vLLM serves it under
    level: str
    pinned: bool
    rank: int


class ResidencyMetrics(Collector):
    """``vllm:lora_adapter_loaded{adapter_name,level,pinned,rank} 1`` per resident adapter,
    the shape of vLLM's proposed gauge, so llm-d's lora-load-state scorer can read this
    worker as it would a vLLM that has it. Read at each scrape from the agent."""

    def __init__(self, resident: Callable[[], Iterable[Resident]]) -> None:
        self.resident = resident

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            m.LORA_ADAPTER_LOADED,
            "1 per LoRA adapter resident on this worker (level gpu: in vLLM; cpu: host tier only)",
            labels=["adapter_name", "level", "pinned", "rank"],
        )
        for r in self.resident():
            family.add_metric([r.adapter_name, r.level, str(r.pinned).lower(), str(r.rank)], 1.0)
        yield family
