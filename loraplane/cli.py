"""The one CLI, ``loraplane``: every command group registers itself from loraplane.commands."""

from __future__ import annotations

import importlib
import pkgutil

import typer

import loraplane.commands

__all__ = ["app", "main"]

app = typer.Typer(
    name="loraplane",
    help="Keeps the right LoRA adapters hot on a fleet of vLLM workers.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _register_all() -> None:
    for info in sorted(pkgutil.iter_modules(loraplane.commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"loraplane.commands.{info.name}")
        module.register(app)


_register_all()


def main() -> None:
    import logging

    from loraplane.kernel.config import SettingsError

    # The ClickHouse driver logs every refused or dropped connection as a warning with its
    # traceback, ahead of the one line each command (and the sink's retry log) gives instead.
    logging.getLogger("clickhouse_driver").setLevel(logging.ERROR)
    try:
        app()
    except SettingsError as exc:  # a hostile or mistaken environment: a line, not a traceback
        typer.echo(f"loraplane: {exc}", err=True)
        raise SystemExit(2) from None
