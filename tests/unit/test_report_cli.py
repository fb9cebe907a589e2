"""``loraplane report`` with ClickHouse away or its reader secret missing: one line saying
which ClickHouse and why, exit 1, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
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


@pytest.mark.parametrize("args", NO_SECRET_COMMANDS[:2], ids=lambda a: " ".join(a[:2]))
def test_the_real_process_prints_no_driver_traceback_when_clickhouse_is_away(
    args: list[str], tmp_path: Path
) -> None:
    """As an operator runs it (its own process, Python's default logging): the driver's
    "Failed to connect" warning came with a traceback ahead of the command's one line."""
    env = {
        **os.environ,
        "LORAPLANE_HOME": str(tmp_path),
        "LORAPLANE_CONFIG": str(tmp_path / "none.yaml"),
        "LORAPLANE_CLICKHOUSE__TCP_PORT": "1",
        "LORAPLANE_CLICKHOUSE__PASSWORD": "x",
        "LORAPLANE_CLICKHOUSE__READER_PASSWORD": "x",
    }
    done = subprocess.run(
        [str(Path(sys.executable).parent / "loraplane"), *args],
        env=env,
        capture_output=True,
        timeout=60,
    )
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert "Traceback" not in err and "Failed to connect" not in err, err
    assert err.strip().splitlines() == [
        "error: cannot read ClickHouse at 127.0.0.1:1, database loraplane: "
        "Code: 210. Connection refused (127.0.0.1:1)"
    ]


def test_a_hung_clickhouse_is_said_in_words() -> None:
    """A server that accepts and never answers (stopped, swapping) times out as code 209,
    whose text is the code and the address only."""
    from clickhouse_driver import errors as ch_errors

    from loraplane.kernel.config import Settings
    from loraplane.metrics.clickhouse import unavailable

    line = unavailable(Settings(), ch_errors.SocketTimeoutError("Code: 209. (127.0.0.1:9000)"))
    assert "no answer in time" in line and line.startswith("cannot read ClickHouse at")
