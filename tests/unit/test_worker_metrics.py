"""The worker's request series: counts, hit rate and TTFT per adapter, and no series before
its first use (the per-adapter children are cached for the gateway's hot path)."""

from __future__ import annotations

from loraplane.kernel import metric_names as m
from loraplane.workers.worker_metrics import AdapterLabels, WorkerMetrics

TTFT_COUNT, TTFT_SUM = m.REQUEST_TTFT_SECONDS + "_count", m.REQUEST_TTFT_SECONDS + "_sum"


def sample(metrics: WorkerMetrics, name: str, labels: AdapterLabels) -> float | None:
    return metrics.registry.get_sample_value(
        name,
        dict(
            zip(
                ("adapter_id", "adapter_version", "tenant_id", "base_model"),
                labels.values(),
                strict=True,
            )
        ),
    )


def test_request_series_count_hits_and_ttft_per_adapter() -> None:
    metrics = WorkerMetrics()
    a, b = AdapterLabels("a", "1", "t", "base"), AdapterLabels("b", "1", "t", "base")
    metrics.request(a, hot=False)
    assert sample(metrics, m.ADAPTER_HITS, a) is None  # no hit yet: no series
    assert sample(metrics, TTFT_COUNT, a) is None
    for hot in (True, True, False):
        metrics.request(a, hot=hot)
    metrics.request(b, hot=True)
    metrics.ttft(a, 12.0)
    metrics.ttft(AdapterLabels("c", "1", "t", "base"), 3.0)  # never routed: still observed
    assert sample(metrics, m.ADAPTER_REQUESTS, a) == 4
    assert sample(metrics, m.ADAPTER_HITS, a) == 2
    assert sample(metrics, m.ADAPTER_HIT_RATE, a) == 0.5
    assert sample(metrics, m.ADAPTER_HIT_RATE, b) == 1.0
    assert sample(metrics, TTFT_COUNT, a) == 1
    assert sample(metrics, TTFT_SUM, a) == 0.012
    assert sample(metrics, TTFT_COUNT, AdapterLabels("c", "1", "t", "base")) == 1
