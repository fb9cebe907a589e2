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


NO_SECRET_COMMANDS = [
    ["metrics", "migrate"],
    ["metrics", "retention", "--days", "1"],
    ["simulate", "--from-clickhouse", "--since", "1h"],
    ["capacity", "--from-clickhouse", "--since", "1h", "--target", "interactive=0.9"],
]


@pytest.mark.parametrize("args", NO_SECRET_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_every_clickhouse_command_without_its_secret_says_so_in_one_line(
    args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_settings: None
) -> None:
    monkeypatch.setenv("LORAPLANE_HOME", str(tmp_path))
    monkeypatch.delenv("LORAPLANE_CLICKHOUSE__PASSWORD", raising=False)
    monkeypatch.delenv("LORAPLANE_CLICKHOUSE__READER_PASSWORD", raising=False)
    monkeypatch.setenv("LORAPLANE_CONFIG", str(tmp_path / "none.yaml"))
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "secret file missing" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("args", NO_SECRET_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_every_clickhouse_command_with_clickhouse_away_says_which(
    args: list[str], monkeypatch: pytest.MonkeyPatch, fresh_settings: None
) -> None:
    monkeypatch.setenv("LORAPLANE_CLICKHOUSE__TCP_PORT", "1")
    monkeypatch.setenv("LORAPLANE_CLICKHOUSE__PASSWORD", "x")
    monkeypatch.setenv("LORAPLANE_CLICKHOUSE__READER_PASSWORD", "x")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "ClickHouse at 127.0.0.1:1" in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["--adapter", "a\udcff"],  # a byte argv cannot decode: the driver raised encoding it
        ["--tenant", "t' OR 1=1 --"],
        ["--base-model", "x" * 100_000],
        ["--adapter", "Upper"],
    ],
)
def test_attack_a_filter_no_row_can_hold_is_a_usage_line_before_any_query(
    args: list[str], monkeypatch: pytest.MonkeyPatch, fresh_settings: None
) -> None:
    """Rows hold ids of ``schemas.base.ID_PATTERN`` only: a filter outside it matches nothing,
    and one argv could not decode ended in UnicodeEncodeError inside the driver."""
    monkeypatch.setenv("LORAPLANE_CLICKHOUSE__TCP_PORT", "1")  # never reached
    monkeypatch.setenv("LORAPLANE_CLICKHOUSE__READER_PASSWORD", "x")
    result = CliRunner().invoke(app, ["report", *args])
    assert result.exit_code == 1, result.output  # as a bad --since
    assert isinstance(result.exception, SystemExit)
    assert "must be an id" in result.output and "cannot read ClickHouse" not in result.output


@pytest.mark.parametrize(
    "filters",
    [
        {"adapter_id": "a\udcff"},
        {"tenant_id": "t'"},
        {"base_model": "b\x00"},
        {"adapter_version": "1.0; DROP"},
    ],
)
def test_attack_the_query_pack_refuses_a_filter_no_row_can_hold(filters: dict[str, str]) -> None:
    from loraplane.metrics.queries import window

    with pytest.raises(ValueError, match="must be"):
        window("1h", **filters)
    assert window("1h", adapter_id="support-bot", adapter_version="v3").adapter_id == "support-bot"
