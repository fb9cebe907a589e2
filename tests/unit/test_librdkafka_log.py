"""librdkafka's own log lines (loraplane/kernel/librdkafka_log.py): while the broker is away,
the factory's clients write nothing to stderr in librdkafka's format, and what they report
reaches the process's logging as one line per client and facility per interval, with the
rest counted. Real clients against a port nobody listens on; no broker needed."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import pytest

from loraplane.kernel import kafka
from loraplane.kernel.config import KafkaSettings, Settings
from loraplane.kernel.librdkafka_log import LIBRDKAFKA_LOG, LibrdkafkaLog

ROOT = Path(__file__).resolve().parents[2]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_client_of_an_absent_broker_logs_through_python_a_line_per_kind(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(
        kafka=KafkaSettings(port=closed_port(), credentials_dir=ROOT / "tests" / "no-such-folder")
    )
    before = LIBRDKAFKA_LOG.total
    producer = kafka.producer(settings, client_id="lp-test-producer")
    consumer = kafka.consumer(settings, "lp-test-group", client_id="lp-test-consumer")
    consumer.subscribe(["lp-test-topic"])
    with caplog.at_level(logging.DEBUG, logger="loraplane.kernel.librdkafka_log"):
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            producer.poll(0.05)
            consumer.poll(0.05)
        consumer.close()
    given = LIBRDKAFKA_LOG.total - before
    lines = [r for r in caplog.records if r.name == "loraplane.kernel.librdkafka_log"]
    assert given > 10, "librdkafka reported each failed connection"  # ~60 in 3 s
    assert 1 <= len(lines) <= 6, [r.getMessage() for r in lines]
    assert any("Connection refused" in r.getMessage() for r in lines)
    assert all(r.levelno >= logging.WARNING for r in lines)
    assert "%3|" not in capfd.readouterr().err


def test_a_quiet_client_logs_nothing_through_python_either() -> None:
    settings = Settings(kafka=KafkaSettings(port=closed_port()))
    assert "logger" not in kafka._logged(kafka.admin_config(settings))
    assert kafka._logged(kafka.consumer_config(settings, "g"))["logger"] is LIBRDKAFKA_LOG


def test_each_client_and_facility_is_its_own_kind_and_the_rest_is_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    sink = LibrdkafkaLog(30, logging.getLogger("test.librdkafka"), lambda: now[0])
    with caplog.at_level(logging.INFO, logger="test.librdkafka"):
        for _ in range(100):
            for client in ("rdkafka#producer-1", "rdkafka#consumer-2"):
                sink.log(logging.ERROR, "%s [%s] %s", "FAIL", client, "refused")
        sink.log(logging.WARNING, "%s [%s] %s", "REQTMOUT", "rdkafka#producer-1", "timed out")
        sink.log(logging.INFO, "a shape of its own")
        now[0] = 31.0
        sink.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", "refused again")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 5, messages
    assert sink.total == 203
    assert messages[0] == "librdkafka: rdkafka#producer-1 FAIL (refused)"
    assert messages[1] == "librdkafka: rdkafka#consumer-2 FAIL (refused)"
    assert messages[4] == (
        "librdkafka: rdkafka#producer-1 FAIL (refused again); 99 more in the last 31s"
    )
    assert [r.levelno for r in caplog.records] == [40, 40, 30, 20, 40]
