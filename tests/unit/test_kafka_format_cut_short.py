"""``stack up`` after a format cut short: a node whose data holds only what Kafka's storage
format writes, without the marker written after it (a ``stack up`` killed in between), is
formatted again; data a broker ran on never is, and the operator is told how to start over."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loraplane.infra import kafka as infra_kafka
from loraplane.infra.kafka import SCRAM_MARKER, Kafka, kafka_nodes, only_formatted
from loraplane.infra.processes import StackError
from loraplane.kernel.config import Settings


def _node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Kafka, list[str]]:
    monkeypatch.setenv("LORAPLANE_HOME", str(tmp_path / "home"))
    node = kafka_nodes(Settings(home=tmp_path / "home"))[0]
    formats: list[str] = []

    def fake_format(self: Kafka, password: str) -> None:  # what StorageTool leaves
        (self.dir / "data").mkdir(parents=True, exist_ok=True)
        (self.dir / "data" / "meta.properties").write_text("node.id=1\n")
        (self.dir / "data" / "bootstrap.checkpoint").write_bytes(b"\0")
        (self.dir / SCRAM_MARKER).write_text("made\n")
        formats.append(password)

    monkeypatch.setattr(Kafka, "_format", fake_format)
    monkeypatch.setattr(Kafka, "_java", lambda self, *a: ["java", *a])
    monkeypatch.setattr(infra_kafka, "properties_text", lambda props: "")
    return node, formats


def _cut_short(node: Kafka) -> Path:
    data = node.dir / "data"
    data.mkdir(parents=True)
    (data / "meta.properties").write_text("node.id=1\n")
    (data / "bootstrap.checkpoint").write_bytes(b"\0")
    return data


def test_a_format_cut_short_is_formatted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node, formats = _node(tmp_path, monkeypatch)
    _cut_short(node)
    node.prepare()
    assert len(formats) == 1
    assert (node.dir / SCRAM_MARKER).is_file()


def test_data_a_broker_ran_on_is_never_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node, formats = _node(tmp_path, monkeypatch)
    data = _cut_short(node)
    (data / "__cluster_metadata-0").mkdir()
    (data / "requests-0").mkdir()
    with pytest.raises(StackError, match="stack down --purge"):
        node.prepare()
    assert formats == []
    assert (data / "requests-0").is_dir()


def test_only_what_a_format_writes_counts(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.properties").write_text("x")
    assert only_formatted(data)
    (data / "bootstrap.checkpoint").write_text("x")
    assert only_formatted(data)
    os.symlink(tmp_path / "elsewhere", data / "requests-0")
    assert not only_formatted(data)
    (data / "requests-0").unlink()
    (data / "bootstrap.checkpoint").unlink()
    (data / "bootstrap.checkpoint").mkdir()  # not the file a format writes
    assert not only_formatted(data)
    linked = tmp_path / "linked"
    linked.symlink_to(data, target_is_directory=True)
    assert not only_formatted(linked)
    assert not only_formatted(tmp_path / "missing")
