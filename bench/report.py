"""What every pipeline benchmark shares: summary statistics, the one JSON object it prints,
and the row it appends to ``docs/benchmarks.md`` under ``## Pipeline benchmarks``.

Every figure is a ratio against a raw baseline measured in the same run, because the
machines are shared and noisy: absolute numbers move with the neighbours' load, the ratio
much less. Repetitions are summarised by median and spread (min..max), never a mean.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HEADING = "## Pipeline benchmarks"
DEFAULT_DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
_TABLE_HEAD = ("| date (UTC) | benchmark | command | loraplane | raw baseline | ratio | goal |\n"
               "|---|---|---|---|---|---|---|\n")
_INTRO = ("Each row: one run of a `bench/*.py` script against the real local stack; loraplane's "
          "path and its raw baseline are measured in the same run (median of the repetitions, "
          "spread in brackets). Full figures: the script's JSON output.\n\n")


@dataclass(frozen=True)
class Summary:
    """Median and spread of one measured quantity over the repetitions."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        if not values:
            raise ValueError("no samples")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def text(self, unit: str, digits: int = 1) -> str:
        return f"{self.median:.{digits}f} {unit} [{self.min:.{digits}f}..{self.max:.{digits}f}]"

    def as_dict(self) -> dict[str, float | int]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): an observed value, no interpolation."""
    if not values:
        raise ValueError("no samples")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def parse_args(parser: argparse.ArgumentParser, module: str,
               argv: list[str] | None) -> argparse.Namespace:
    """Adds the shared options, parses, and records the command as a reader would re-run
    it from the repository root (``args.command``)."""
    parser.add_argument("--doc", type=Path, default=DEFAULT_DOC,
                        help="markdown file to append the result row to")
    parser.add_argument("--no-doc", action="store_true", help="print the JSON only")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.command = " ".join(shlex.quote(a) for a in [".venv/bin/python", "-m", module, *argv])
    return args


@dataclass(frozen=True)
class Row:
    benchmark: str
    loraplane: str  # key figure of loraplane's path, with unit and spread
    baseline: str  # the same for the raw baseline
    ratio: str  # e.g. "0.62x" (loraplane / baseline, higher is better) or a cost multiple
    goal: str


def times(ratio: float) -> str:
    """A ratio for the table: two decimals, or two significant digits when that rounds to 0."""
    return f"{ratio:.2f}x" if ratio >= 0.01 else f"{ratio:.2g}x"


def emit(result: dict[str, Any], row: Row, args: argparse.Namespace) -> None:
    """Print the one JSON object (with the command) and append the doc row."""
    print(json.dumps({"benchmark": row.benchmark, "command": args.command, **result}))
    if not args.no_doc:
        append_row(args.doc, row, args.command)


def append_row(doc: Path, row: Row, command: str, now: datetime | None = None) -> None:
    """Insert the row at the end of the ``## Pipeline benchmarks`` table, creating the
    section at the end of the file when it is missing; other sections are left as they are."""
    now = now or datetime.now(UTC)
    line = (f"| {now:%Y-%m-%d %H:%M} | {row.benchmark} | `{command}` | {row.loraplane} | "
            f"{row.baseline} | {row.ratio} | {row.goal} |\n")
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    start = text.find(f"\n{HEADING}\n")
    if start < 0:
        sep = "" if text.endswith("\n\n") else "\n" if text.endswith("\n") else "\n\n"
        text = f"{text}{sep}{HEADING}\n\n{_INTRO}{_TABLE_HEAD}{line}"
    else:
        body = start + len(HEADING) + 2
        nxt = text.find("\n## ", body)
        end = len(text) if nxt < 0 else nxt + 1
        section = text[body:end].rstrip("\n") + "\n"
        if _TABLE_HEAD not in section:
            section += "\n" + _TABLE_HEAD
        text = text[:body] + section + line + ("\n" if nxt >= 0 else "") + text[end:]
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
