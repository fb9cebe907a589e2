"""A stack home whose path holds what Java's properties format reads otherwise (a space, a
non-ASCII letter, a backslash, ``#``, ``=``, ``:``): the real broker keeps its data there and
nowhere else, and starts again on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplane.infra.processes import wait_until
from tests.integration.private_kafka import private_cluster
from tests.integration.s3_env import PrivateS3

pytestmark = pytest.mark.integration


def test_a_home_path_java_would_misread_holds_the_brokers_data(tmp_path: Path) -> None:
    """Before: server.properties held ``log.dirs=<path>`` as UTF-8 text, which Kafka reads as
    ISO-8859-1 with ``\\`` as an escape: the data went to ``.../opér\u00c3\u00a9...`` beside
    the home (left by ``stack down --purge``), and the next start formatted it again."""
    odd = tmp_path / "ops data é\\x #1 a=b:c"
    odd.mkdir()
    with private_cluster(odd, ("requests",), 1) as (_settings, [broker]):
        data = broker.dir / "data"
        assert (data / "meta.properties").is_file()
        assert any(p.name.startswith("__cluster_metadata") for p in data.iterdir())
        broker.process.stop(10)
        broker.process.start(broker.prepare())  # formatted: not formatted again
        assert wait_until(broker.ready, 150, alive=broker.process.running), broker.process.tail(30)
    strays = [p for p in tmp_path.iterdir() if p != odd]
    assert strays == [], strays


def test_a_home_path_java_would_misread_holds_s3proxys_objects(tmp_path: Path) -> None:
    """s3proxy reads its properties file the same way: its objects go under the home."""
    odd = tmp_path / "ops data é\\x #1"
    server = PrivateS3(odd / "home")
    server.start()
    try:
        assert server.data.is_dir()
        assert any(server.data.iterdir())  # the bucket after_start made
    finally:
        server.stop()
    strays = [p for p in tmp_path.iterdir() if p != odd]
    assert strays == [], strays
