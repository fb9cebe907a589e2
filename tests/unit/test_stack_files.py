"""Attack tests: the files the stack writes for its services (ClickHouse's users.xml and
config.xml, Kafka's log4j2.xml, s3proxy's logback.xml). A link planted at one is replaced by
the file, never written through to whatever it names (the user's own files); each is
written whole (``kernel.atomic_file``), and users.xml, which holds the passwords' hashes, is
the owner's only. No service is started: each ``prepare`` stops short of its binary."""

from __future__ import annotations

import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from loraplane.infra.clickhouse import ClickHouse
from loraplane.infra.kafka import SCRAM_MARKER, Kafka
from loraplane.infra.s3 import S3
from loraplane.infra.service import Service
from loraplane.kernel.config import Settings

Prepare = Callable[[Settings, pytest.MonkeyPatch], Service]


def _clickhouse(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Service:
    monkeypatch.setattr(ClickHouse, "binary", staticmethod(lambda: "clickhouse-server"))
    return ClickHouse(settings)


def _kafka(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Service:
    node = Kafka(settings)
    (node.dir / "data").mkdir(parents=True)
    (node.dir / "data" / "meta.properties").write_text("formatted\n")  # no format (java)
    (node.dir / SCRAM_MARKER).write_text("")
    monkeypatch.setattr(Kafka, "_java", lambda _self, *_args: [])
    return node


def _s3(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Service:
    monkeypatch.setattr(S3, "fetch", lambda _self: Path("classpath.txt"))
    monkeypatch.setattr("loraplane.infra.maven.jars", lambda _file: [])
    return S3(settings)


FILES: dict[str, tuple[Prepare, str]] = {
    "clickhouse-users": (_clickhouse, "clickhouse/users.xml"),
    "clickhouse-config": (_clickhouse, "clickhouse/config.xml"),
    "kafka-log4j2": (_kafka, "kafka/log4j2.xml"),
    "s3-logback": (_s3, "s3/logback.xml"),
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_link_planted_at_a_service_file_is_replaced_not_written_through(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make, relative = FILES[name]
    settings = Settings(home=tmp_path / "home")
    service = make(settings, monkeypatch)
    outside = tmp_path / "outside"
    outside.write_text("untouched")
    planted = service.home / relative
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.symlink_to(outside)
    service.prepare()
    assert outside.read_text() == "untouched"
    assert not planted.is_symlink() and planted.stat().st_size > 0
    assert not [p.name for p in planted.parent.iterdir() if p.name.endswith(".tmp")]


def test_clickhouse_users_xml_is_the_owners_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = _clickhouse(Settings(home=tmp_path), monkeypatch)
    service.prepare()
    users = tmp_path / "clickhouse" / "users.xml"
    assert stat.S_IMODE(users.stat().st_mode) == 0o600
