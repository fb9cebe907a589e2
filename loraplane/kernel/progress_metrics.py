"""Consumer hold-ups on a Prometheus endpoint, for every runtime that has a loop to watch.

The worker and the router put ``ProgressMetrics`` on their own /metrics; the streams app and
the metrics sink have no HTTP server of their own, so ``serve_progress`` gives them one
(``--metrics-port``, on ``settings.listen_host``: loopback unless in a pod): a component
that cannot make progress says so in its log (``kernel.progress``: STALLED / RECOVERED) and
in ``loraplane_consumer_stuck_seconds``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplane.kernel import metric_names as m
from loraplane.kernel.progress import Progress, every_progress
from loraplane.kernel.topic_tail import TopicTail

__all__ = ["ProgressMetrics", "TailMetrics", "progress_registry", "serve_progress"]


class ProgressMetrics(Collector):
    """``loraplane_consumer_stuck_seconds`` is 0 while a consumer progresses and grows
    while it cannot; ``loraplane_consumer_stalls_total`` counts hold-ups that lasted past
    the stall threshold.
    ``progress`` is read at each scrape (a live collection such as ``every_progress()``
    shows the components built after the endpoint started)."""

    def __init__(self, progress: Iterable[Progress]) -> None:
        self.progress = progress

    def collect(self) -> Iterator[Metric]:
        stuck = GaugeMetricFamily(
            m.CONSUMER_STUCK_SECONDS,
            "Seconds this consumer has not been able to make progress (0: fine)",
            labels=["component"],
        )
        stalls = CounterMetricFamily(
            m.CONSUMER_STALLS,
            "Hold-ups that lasted past the stall threshold (each logged as STALLED)",
            labels=["component"],
        )
        for p in sorted(self.progress, key=lambda p: p.component):
            stuck.add_metric([p.component], p.stuck_s())
            stalls.add_metric([p.component], p.stalls)
        yield stuck
        yield stalls


def progress_registry(extra: Iterable[Collector] = ()) -> CollectorRegistry:
    """Every ``Progress`` of this process and the ``extra`` collectors (the planner's lease):
    what ``serve_progress`` serves, and what promtool checks (tests/unit)."""
    registry = CollectorRegistry()
    registry.register(ProgressMetrics(every_progress()))
    for collector in extra:
        registry.register(collector)
    return registry


def serve_progress(port: int, extra: Iterable[Collector] = (), *, host: str) -> None:
    """Serve ``progress_registry(extra)`` on ``http://HOST:PORT/metrics`` (``host``: the
    settings' ``listen_host``) from a daemon thread (it ends with the process). ``port`` 0:
    nothing is served."""
    if not port:
        return
    start_http_server(port, addr=host, registry=progress_registry(extra))


class TailMetrics(Collector):
    """Whether a live topic tail (``kernel.topic_tail``: the registry) is the topic's
    present: ``loraplane_topic_tail_caught_up`` 0 until the first complete read,
    ``loraplane_topic_tail_lag`` the records known to be unread, ``.._current`` 1 when
    caught up, not behind and the broker answering (a view that is not current keeps
    serving, just older), ``.._forgotten_total`` the refused records it forgot past its
    bounds (``TopicTail.refuse``)."""

    def __init__(self, tails: Iterable[TopicTail]) -> None:
        self.tails = list(tails)

    def collect(self) -> Iterator[Metric]:
        caught_up = GaugeMetricFamily(
            m.TOPIC_TAIL_CAUGHT_UP, "1 once the topic was read to its end", labels=["component"]
        )
        lag = GaugeMetricFamily(
            m.TOPIC_TAIL_LAG,
            "Records between the tail's position and the topic's end as last learned",
            labels=["component"],
        )
        current = GaugeMetricFamily(
            m.TOPIC_TAIL_CURRENT,
            "1 when the view is the topic's present (caught up, no lag, broker answering)",
            labels=["component"],
        )
        forgotten = CounterMetricFamily(
            m.TOPIC_TAIL_FORGOTTEN,
            "Records its user refused that the tail forgot past its bounds (a writer of the "
            "topic inventing keys; re-read from the start on a new keyring)",
            labels=["component"],
        )
        for t in self.tails:
            caught_up.add_metric([t.component], float(t.caught_up))
            lag.add_metric([t.component], t.lag())
            current.add_metric([t.component], float(t.current()))
            forgotten.add_metric([t.component], t.forgotten)
        yield caught_up
        yield lag
        yield current
        yield forgotten
