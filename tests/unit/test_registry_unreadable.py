"""A broker that is away never reads as an empty registry: ``load_registry`` raises
``RegistryUnreadable`` and every command that reads the registry says so and exits 1,
instead of printing "no adapters" or "not in the registry"."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

import loraplane.registry.topic
from loraplane.cli import app
from loraplane.kernel.bus import Record, TopicReadIncomplete
from loraplane.kernel.config import Settings
from loraplane.registry.topic import RegistryUnreadable, load_registry


def _broker_away(*_a: Any, to_end: bool = False, **_k: Any) -> Iterator[Record]:
    """``read_topic`` with the broker away: nothing read; an error only when the caller
    asked to reach the end (as the real one does after its timeout)."""
    if to_end:
        raise TopicReadIncomplete("registry: the end was not reached within 10s")
    yield from ()


@pytest.fixture
def away(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loraplane.registry.topic, "read_topic", _broker_away)


def test_load_registry_refuses_to_read_a_broker_away_as_empty(away: None) -> None:
    with pytest.raises(RegistryUnreadable, match="cannot read the registry from"):
        load_registry(Settings())


@pytest.mark.parametrize(
    "args",
    [
        ["registry", "list"],
        ["registry", "show", "chat"],
        ["artifact", "verify", "/nonexistent", "--adapter-id", "chat", "--version", "1"],
    ],
)
def test_a_command_reading_the_registry_says_the_broker_is_away(
    args: list[str], away: None
) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    assert "cannot read the registry from" in result.output


def test_a_reupload_with_the_broker_away_is_an_artifact_error(away: None) -> None:
    from loraplane.artifact_publish import ArtifactError, registered_version

    with pytest.raises(ArtifactError, match="cannot read the registry"):
        registered_version(Settings(), "chat", "1")
