"""kernel.progress: a hold-up is logged as STALLED once it lasts, rate-limited, and as
RECOVERED when work goes through again."""

from __future__ import annotations

import logging

import pytest

from loraplane.kernel.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_stall_is_logged_once_per_interval_and_recovery_with_its_length(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    p = Progress("sink", stall_after_s=30, report_every_s=60, clock=clock)
    caplog.set_level(logging.INFO, "loraplane.progress")
    p.blocked("clickhouse down")
    clock.t += 29
    assert p.check() == 29 and not caplog.records  # a hiccup, not a stall
    clock.t += 2
    p.blocked("still down")  # a newer reason keeps the start of the hold-up
    assert p.check() == 31
    clock.t += 10
    p.check()  # within report_every_s: no second line
    stalled = [r.getMessage() for r in caplog.records if "STALLED" in r.getMessage()]
    assert stalled == ["STALLED sink: no progress for 31 s (still down)"]
    assert p.stalls == 1 and p.stalled()
    clock.t += 60
    p.check()
    assert sum("STALLED" in r.getMessage() for r in caplog.records) == 2
    assert p.stalls == 1  # one hold-up, reported twice
    p.advanced()
    assert p.stuck_s() == 0 and not p.stalled()
    assert caplog.records[-1].getMessage() == "RECOVERED sink: progressing again after 101 s"


def test_a_short_hold_up_ends_silently(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    p = Progress("feed", stall_after_s=30, clock=clock)
    caplog.set_level(logging.INFO, "loraplane.progress")
    p.blocked("commit")
    clock.t += 5
    p.advanced()
    clock.t += 100
    assert p.check() == 0 and not caplog.records and p.stalls == 0


def test_every_progress_of_the_process_is_served_on_loopback_metrics() -> None:
    """The streams app and the sink have no HTTP server of their own: ``serve_progress``
    shows each hold-up as ``loraplane_consumer_stuck_seconds`` (0 once it progresses
    again), including components built after the endpoint started."""
    import urllib.request

    from loraplane.infra.processes import free_port
    from loraplane.kernel.progress_metrics import serve_progress

    port = free_port()
    serve_progress(port, host="127.0.0.1")
    late = Progress("late-component")  # built after the endpoint started
    late.blocked("broker away")

    def scrape() -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        return {
            line.split("{")[0] + "|" + line.split('"')[1]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("loraplane_consumer_") and 'component="late-component"' in line
        }

    assert scrape()["loraplane_consumer_stuck_seconds|late-component"] > 0
    late.advanced()
    assert scrape()["loraplane_consumer_stuck_seconds|late-component"] == 0
    assert scrape()["loraplane_consumer_stalls_total|late-component"] == 0


def test_no_port_serves_nothing() -> None:
    from loraplane.kernel.progress_metrics import serve_progress

    serve_progress(0, host="127.0.0.1")  # returns without binding anything
