"""Attack tests: a component's own log holding a line of 64 MiB without a newline
(what a component writes when it quotes what it was sent). ``stack logs`` (its tail and its
``--follow``), a failed start's last lines and the demo's failure report and readiness
check read it in bounded pieces: the line is cut at ``MAX_LINE`` characters and marked, the
lines after it come whole, and memory stays far below the line's size."""

from __future__ import annotations

import io
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from loraplane.demo import supervisor
from loraplane.infra.processes import Managed
from loraplane.kernel.log_tail import CUT_MARK, MAX_HELD, MAX_LINE, next_line, tail

LONG = 64 * 1024 * 1024


def _log_with_a_long_line(path: Path) -> Path:
    with path.open("wb") as fh:
        fh.write(b"before\n")
        fh.truncate(LONG)  # sparse: one line of NULs, no disk used
        fh.seek(LONG)
        fh.write(b"\nafter\n")
    return path


def _peak(read: Callable[[], Any]) -> tuple[Any, int]:
    tracemalloc.start()
    try:
        return read(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


READERS: dict[str, Callable[[Path], list[str]]] = {
    "log_tail.tail": lambda path: tail(path, 5),
    "stack-status-tail": lambda path: Managed(path.with_suffix(".pid"), path, "m").tail(5),
    "demo-failure-report": lambda path: supervisor.tail(path, 5).splitlines(),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_log_line_of_64_mib_is_cut_and_read_in_bounded_pieces(
    reader: str, tmp_path: Path
) -> None:
    path = _log_with_a_long_line(tmp_path / "component.log")
    lines, peak = _peak(lambda: READERS[reader](path))
    assert lines == ["before", "\0" * MAX_LINE + CUT_MARK, "after"]
    assert peak < 8 * 1024 * 1024  # the line itself is 64 MiB


@pytest.mark.timeout(60)
def test_the_demos_readiness_check_reads_a_long_line_in_bounded_pieces(tmp_path: Path) -> None:
    path = _log_with_a_long_line(tmp_path / "component.log")
    child: Any = SimpleNamespace(log_path=path)
    check = supervisor.Supervisor(tmp_path, {}, tmp_path).log_contains(child, "after")
    found, peak = _peak(check)
    assert found is True and peak < 8 * 1024 * 1024


def test_follow_cuts_a_long_line_and_goes_on_with_the_next() -> None:
    """``stack logs --follow`` reads with ``next_line``: a long line is cut and keeps its
    newline, the next comes whole, and a last line still being written comes as it is."""
    stream = io.StringIO("x" * (MAX_LINE * 5) + "\nnext\npart")
    assert next_line(stream) == "x" * MAX_LINE + CUT_MARK + "\n"
    assert next_line(stream) == "next\n"
    assert next_line(stream) == "part"
    assert next_line(stream) == ""
    exact = io.StringIO("y" * MAX_LINE + "\n")
    assert next_line(exact) == "y" * MAX_LINE + "\n"


@pytest.mark.timeout(120)
def test_a_tail_of_a_million_long_lines_holds_at_most_max_held(tmp_path: Path) -> None:
    """``stack logs -n 1000000`` of a log of long lines: each line is cut at ``MAX_LINE``,
    but a million of them would still be gigabytes; the tail keeps the newest lines that fit
    in ``MAX_HELD`` characters, and the newest line is always among them."""
    path = tmp_path / "component.log"
    line = "z" * (MAX_LINE * 2)
    count = 3 * MAX_HELD // MAX_LINE
    with path.open("w") as fh:
        for i in range(count):
            fh.write(f"{i:08d}{line}\n")
    lines, peak = _peak(lambda: tail(path, 1_000_000))
    assert sum(len(x) for x in lines) <= MAX_HELD
    assert len(lines) >= MAX_HELD // (MAX_LINE + len(CUT_MARK) + 1) - 1
    assert lines[-1].startswith(f"{count - 1:08d}")
    assert peak < 3 * MAX_HELD * 4  # characters held, at most 4 bytes each, and slack
    assert tail(path, 2)[0].startswith(f"{count - 2:08d}")
