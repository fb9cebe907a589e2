"""Which optional extra a command needs, and the clear exit when it is not installed.

The base install carries what the control-plane runtimes need (router, worker agent, streams
app, metrics sink, CLI). The simulator's libraries come with ``loraplane[sim]``, NVML with
``loraplane[gpu]``; a command that needs one says which to install and exits 2, never with a
traceback from a failed import.
"""

from __future__ import annotations

import importlib.util

import typer

__all__ = ["EXTRAS", "missing", "require"]

EXTRAS: dict[str, tuple[str, ...]] = {
    "sim": ("scipy", "matplotlib", "networkx"),
    "gpu": ("pynvml",),
}
"""Each extra and the import names it provides (pyproject's optional-dependencies)."""


def missing(extra: str) -> list[str]:
    return [name for name in EXTRAS[extra] if not _importable(name)]


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def require(extra: str, command: str) -> None:
    """Exit 2 with the install line unless every module of ``extra`` is importable."""
    absent = missing(extra)
    if absent:
        typer.echo(
            f"`loraplane {command}` needs the [{extra}] extra ({', '.join(absent)} "
            f"not installed): pip install 'loraplane[{extra}]'",
            err=True,
        )
        raise typer.Exit(2)
