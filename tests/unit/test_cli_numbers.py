"""ATTACK audit of the CLI's numeric options: each has a range, so a hostile or mistaken
argument is a usage error (exit 2) before anything starts, never ``nan``, a negative or a
huge number reaching a loop, a socket or a date (``worker run --tick-s -1`` spun a busy
loop, ``--tick-s nan`` or ``router run --heartbeat-s nan`` crashed later, ``--port -1``
reached ``bind()``, ``metrics retention --days 1000000`` was an OverflowError traceback).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import typer
from typer._click.core import Context
from typer.testing import CliRunner

from loraplane import cli

ANY_INTEGER = {"seed"}  # a random seed: every integer is one
IN_THE_COMMAND = {
    "worker run --gpu_slots",
    "worker run --host_budget_bytes",
    "worker run --max_lora_rank",
}
"""Checked by the command itself against the worker state's bounds, before anything starts
(tests/unit/test_front_door_attacks.py)."""


def _options() -> Iterator[tuple[str, Any, Any]]:
    def walk(command: Any, path: list[str]) -> Iterator[tuple[str, Any, Any]]:
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                yield from walk(sub, [*path, name])
            return
        for param in command.params:
            annotation = getattr(param.type_descriptor, "annotation", None)
            if annotation in (int, float):
                yield " ".join(path), command, param

    yield from walk(typer.main.get_command(cli.app), [])


NUMBERS = [(f"{path} --{p.name}", command, p) for path, command, p in _options()]


def test_the_audit_sees_the_options() -> None:
    names = {name for name, _, _ in NUMBERS}
    assert {"worker run --tick_s", "router run --port", "vllm serve --port"} <= names


@pytest.mark.parametrize("name, command, param", NUMBERS, ids=[n for n, _, _ in NUMBERS])
def test_attack_every_numeric_option_has_a_range(name: str, command: Any, param: Any) -> None:
    if param.name in ANY_INTEGER or name in IN_THE_COMMAND:
        return
    assert param.min is not None and param.max is not None, f"{name} has no range"
    if param.name.endswith("port"):
        assert param.min >= 0 and param.max == 65535, name
    ctx = Context(command)
    hostile = ["-" + "9" * 30, "9" * 30]  # 10**30 days: a date past datetime's range
    if param.type_descriptor.annotation is float:
        hostile += ["nan", "inf", "-inf", "-1e30", "1e30"]  # 1e30 s: a sleep that overflows
    for value in hostile:
        with pytest.raises(Exception, match="Input should be"):
            param.process_value(ctx, value)


@pytest.mark.parametrize(
    "argv",
    [
        ["metrics", "retention", "--days", "1000000"],
        [
            "worker",
            "run",
            "--worker-id",
            "w",
            "--base-model",
            "b",
            "--vllm-url",
            "x",
            "--tick-s",
            "nan",
        ],
        [
            "worker",
            "run",
            "--worker-id",
            "w",
            "--base-model",
            "b",
            "--vllm-url",
            "x",
            "--gateway-port",
            "-1",
        ],
        ["router", "run", "--heartbeat-s", "nan"],
        ["router", "run", "--port", "70000"],
        ["vllm", "serve", "--port", "0"],
    ],
)
def test_attack_a_hostile_number_is_a_usage_error(argv: list[str]) -> None:
    result = CliRunner().invoke(cli.app, argv)
    assert result.exit_code == 2, result.output
