"""One row of the fault table per fault test (``bench/faults.py``): a test that injects a
fault appends what it measured to the file ``LORAPLANE_FAULT_REPORT`` names, after its own
assertions passed. Without the variable (a plain ``./run test``) nothing is written."""

from __future__ import annotations

import json
import os
from pathlib import Path

REPORT_ENV = "LORAPLANE_FAULT_REPORT"


def report_fault(
    fault: str,
    *,
    answered: int,
    stored: int,
    lost: int,
    duplicated: int,
    recovered: bool,
    down_s: float | None = None,
    recovery_s: float | None = None,
    note: str = "",
) -> None:
    """``answered``: what the system accepted (events emitted, requests answered);
    ``stored``: what of it is where it belongs afterwards; ``recovered``: no component was
    restarted by hand."""
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    row = {
        "fault": fault,
        "answered": answered,
        "stored": stored,
        "lost": lost,
        "duplicated": duplicated,
        "recovered_by_itself": recovered,
        "down_s": None if down_s is None else round(down_s, 1),
        "recovery_s": None if recovery_s is None else round(recovery_s, 1),
        "note": note,
    }
    with Path(path).open("a") as fh:
        fh.write(json.dumps(row) + "\n")
