"""Azure LLM inference traces (Splitwise, ISCA 2024): ``TIMESTAMP,ContextTokens,GeneratedTokens``.

Only arrival times and generated-token counts are used; adapters are assigned by
``requests.assign_adapters`` because the traces carry none.
"""

from __future__ import annotations

import csv
import re
from datetime import datetime
from pathlib import Path

import numpy as np

from loraplane.simulator.scenario import MAX_COUNT, MAX_REQUESTS

__all__ = ["TraceError", "load_trace"]


class TraceError(ValueError):
    """A trace file that is not in the Azure LLM trace format; the message names the line."""


def load_trace(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Seconds since the first request (sorted) and generated tokens per request. A row
    whose GeneratedTokens is not 0 to ``MAX_COUNT`` in ASCII digits, a line csv cannot read
    (a field past its limit), or more than ``MAX_REQUESTS`` rows is a
    TraceError naming the line."""
    stamps: list[float] = []
    generated: list[int] = []
    with path.open(newline="") as fh:
        reader = csv.reader(fh)
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


def _tokens(text: str) -> int:
    value = text.strip()
    if not re.fullmatch(r"[0-9]{1,9}", value) or int(value) > MAX_COUNT:
        raise ValueError(f"GeneratedTokens {value[:40]!r}: expected 0 to {MAX_COUNT}")
    return int(value)
