"""The end of a component's own log (``stack logs``, a failed start's last lines, the demo's
failure report and readiness checks), each line cut to ``MAX_LINE`` characters.

A log holds what its component wrote, and a component writes what it was sent (vLLM quotes
a request's field, a Java stack trace repeats a message), so one line can run to gigabytes
without a newline. Python's line iteration holds a line whole; here every read is bounded:
a longer line is cut and marked (``CUT_MARK``), and the rest of it is read and dropped in
bounded pieces. The file is opened with ``open_regular`` (a FIFO or a device put at the
path is an ``OSError``, never a wait or an endless read).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from loraplane.kernel.local_files import open_regular

__all__ = ["CUT_MARK", "MAX_HELD", "MAX_LINE", "lines_of", "next_line", "tail"]

MAX_LINE = 16 * 1024
"""The most characters of one log line shown or held; a log line of the project's own
components is under 1 KiB, and a Java stack trace's under 4 KiB."""
MAX_HELD = 8 * 1024 * 1024
"""The most characters ``tail`` holds in all: ``stack logs -n`` takes up to a million lines,
and a million cut lines would be gigabytes; the tail keeps the newest lines within this."""
CUT_MARK = " …[line cut]"
_SKIP = 64 * 1024


def next_line(fh: TextIO, max_line: int = MAX_LINE) -> str:
    """The next line of ``fh`` with its newline ("" at the end of the file), at most
    ``max_line`` characters; a longer one is cut there and marked, the rest of it skipped.
    A last line without its newline (a writer mid-line) comes as it is."""
    line = fh.readline(max_line + 1)
    if len(line) <= max_line or line.endswith("\n"):
        return line
    rest = ""
    while (rest := fh.readline(_SKIP)) and not rest.endswith("\n"):
        pass
    return line[:max_line] + CUT_MARK + ("\n" if rest else "")


def lines_of(fh: TextIO, max_line: int = MAX_LINE) -> Iterator[str]:
    """Every line of ``fh`` from where it stands (``next_line``)."""
    while line := next_line(fh, max_line):
        yield line


def tail(path: Path, lines: int, max_line: int = MAX_LINE, max_held: int = MAX_HELD) -> list[str]:
    """The last ``lines`` lines of the log at ``path``, without their newlines, each at most
    ``max_line`` characters and the mark, and no more of them than fit in ``max_held``
    characters (the newest kept); nothing when it does not exist yet."""
    kept: deque[str] = deque()
    held, lines = 0, max(lines, 0)
    try:
        with os.fdopen(open_regular(path), errors="replace") as fh:
            for line in lines_of(fh, max_line):
                kept.append(line)
                held += len(line)
                while len(kept) > lines or (held > max_held and len(kept) > 1):
                    held -= len(kept.popleft())
    except FileNotFoundError:
        return []
    return [line.rstrip("\n") for line in kept]
