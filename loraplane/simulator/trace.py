"""Azure LLM inference traces (Splitwise, ISCA 2024): ``TIMESTAMP,ContextTokens,GeneratedTokens``.

Only arrival times and generated-token counts are used; adapters are assigned by
``requests.assign_adapters`` because the traces carry none.
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import TextIO

import numpy as np

from loraplane.kernel.local_files import open_regular
from loraplane.simulator.scenario import MAX_COUNT, MAX_REQUESTS

__all__ = ["MAX_LINE_CHARS", "TraceError", "load_trace"]

MAX_LINE_CHARS = 1024 * 1024
"""A trace row is a timestamp and two counts (csv refuses a field past 128 KiB): a longer
line, a file of NULs, is no trace and is never read whole."""


class TraceError(ValueError):
    """A trace file that is not in the Azure LLM trace format; the message names the line."""


def load_trace(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Seconds since the first request (sorted) and generated tokens per request. A row
    whose GeneratedTokens is not 0 to ``MAX_COUNT`` in ASCII digits, a line csv cannot read
    (a field past its limit), a line over ``MAX_LINE_CHARS``, or more than ``MAX_REQUESTS``
    rows is a TraceError naming the line; anything but a regular file an OSError."""
    stamps: list[float] = []
    generated: list[int] = []
    with os.fdopen(open_regular(path), newline="") as fh:  # never a FIFO's wait
        reader = csv.reader(_lines(fh, path))
        try:
            header = next(reader, None)
            if header is None or [h.strip() for h in header[:3]] != [
                "TIMESTAMP",
                "ContextTokens",
                "GeneratedTokens",
            ]:
                raise TraceError(f"{path}: expected header TIMESTAMP,ContextTokens,GeneratedTokens")
            for row in reader:
                line = reader.line_num
                if len(stamps) >= MAX_REQUESTS:
                    raise TraceError(f"{path}:{line}: more than {MAX_REQUESTS} requests")
                try:
                    stamps.append(datetime.fromisoformat(row[0].strip()).timestamp())
                    generated.append(_tokens(row[2]))
                except (ValueError, IndexError) as exc:
                    raise TraceError(f"{path}:{line}: {exc}") from exc
        except csv.Error as exc:
            raise TraceError(f"{path}:{reader.line_num}: {exc}") from exc
    if not stamps:
        raise TraceError(f"{path}: no requests")
    times = np.asarray(stamps)
    order = np.argsort(times, kind="stable")
    return times[order] - times[order[0]], np.asarray(generated, dtype=np.int64)[order]


def _lines(fh: TextIO, path: Path) -> Iterator[str]:
    """The lines of ``fh``, each read up to ``MAX_LINE_CHARS``, never a whole file as one."""
    n = 0
    while line := fh.readline(MAX_LINE_CHARS + 1):
        n += 1
        if len(line) > MAX_LINE_CHARS:
            raise TraceError(f"{path}:{n}: a line over {MAX_LINE_CHARS} characters")
        yield line


def _tokens(text: str) -> int:
    value = text.strip()
    if not re.fullmatch(r"[0-9]{1,9}", value) or int(value) > MAX_COUNT:
        raise ValueError(f"GeneratedTokens {value[:40]!r}: expected 0 to {MAX_COUNT}")
    return int(value)
