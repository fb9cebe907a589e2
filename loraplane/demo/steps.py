"""Progress of a run, one line per step: a spinner while it runs, then ✓ (or ✗) with its
time and a short result, so a user always sees which step is slow or failed."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from rich.console import Console

__all__ = ["Steps", "T"]

T = TypeVar("T")


class Steps:
    def __init__(self, console: Console) -> None:
        self.console = console
        self.timings: list[tuple[str, float]] = []

    def run(self, title: str, fn: Callable[[], T], done: Callable[[T], str] | None = None) -> T:
        t0 = time.monotonic()
        try:
            with self.console.status(f"{title} …"):
                result = fn()
        except BaseException:
            self.console.print(f"[red]✗[/] {title} [dim]({time.monotonic() - t0:.1f}s)[/]")
            raise
        elapsed = time.monotonic() - t0
        self.timings.append((title, elapsed))
        note = done(result) if done else ""
        self.console.print(
            f"[green]✓[/] {title}{': ' + note if note else ''} [dim]({elapsed:.1f}s)[/]",
            highlight=False,
        )
        return result

    def note(self, text: str) -> None:
        self.console.print(f"  {text}", highlight=False)
