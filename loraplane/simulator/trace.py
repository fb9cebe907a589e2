"""Azure LLM inference traces (Splitwise, ISCA 2024): ``TIMESTAMP,ContextTokens,GeneratedTokens``.

Only arrival times and generated-token counts are used; adapters are assigned by
``requests.assign_adapters`` because the traces carry none.
"""

from __future__ import annotations

import csv
from datetime import datetime
from pathlib import Path

import numpy as np

__all__ = ["TraceError", "load_trace"]


class TraceError(ValueError):
    """A trace file that is not in the Azure LLM trace format; the message names the line."""


def load_trace(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Seconds since the first request (sorted) and generated tokens per request."""
    stamps: list[float] = []
    generated: list[int] = []
    with path.open(newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None or [h.strip() for h in header[:3]] != [
            "TIMESTAMP",
            "ContextTokens",
            "GeneratedTokens",
        ]:
            raise TraceError(f"{path}: expected header TIMESTAMP,ContextTokens,GeneratedTokens")
        for line, row in enumerate(reader, start=2):
            try:
                stamps.append(datetime.fromisoformat(row[0].strip()).timestamp())
                generated.append(int(row[2]))
            except (ValueError, IndexError) as exc:
                raise TraceError(f"{path}:{line}: {exc}") from exc
    if not stamps:
        raise TraceError(f"{path}: no requests")
    times = np.asarray(stamps)
    order = np.argsort(times, kind="stable")
    return times[order] - times[order[0]], np.asarray(generated, dtype=np.int64)[order]
