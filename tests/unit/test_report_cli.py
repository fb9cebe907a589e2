"""``loraplane report`` with ClickHouse away or its reader secret missing: one line saying
which ClickHouse and why, exit 1, never a traceback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loraplane.cli import app
from loraplane.kernel.config import get_settings


@pytest.fixture
def fresh_settings() -> Iterator[None]:
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_report_says_which_clickhouse_it_could_not_reach(
    monkeypatch: pytest.MonkeyPatch, fresh_settings: None
) -> None:
    monkeypatch.setenv("LORAPLANE_CLICKHOUSE__TCP_PORT", "1")
    monkeypatch.setenv("LORAPLANE_CLICKHOUSE__READER_PASSWORD", "x")
    result = CliRunner().invoke(app, ["report", "--since", "1h"])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    assert "cannot read ClickHouse at 127.0.0.1:1, database" in result.output


def test_report_without_the_reader_secret_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_settings: None
) -> None:
    monkeypatch.setenv("LORAPLANE_HOME", str(tmp_path))
    monkeypatch.delenv("LORAPLANE_CLICKHOUSE__READER_PASSWORD", raising=False)
    monkeypatch.setenv("LORAPLANE_CONFIG", str(tmp_path / "none.yaml"))
    result = CliRunner().invoke(app, ["report", "--since", "1h"])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    assert "secret file missing" in result.output
