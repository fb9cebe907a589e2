"""What every pipeline benchmark shares: summary statistics, the one JSON object it prints,
and, only when asked (``--write-doc``), its row among the latest results of a doc.

Every figure is a ratio against a raw baseline measured in the same run, because the
machines are shared and noisy: absolute numbers move with the neighbours' load, the ratio
much less. Repetitions are summarised by median and spread (min..max), never a mean.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
TABLE_HEAD = (
    "| configuration | loraplane | raw baseline | ratio | goal | command | machine |\n"
    "|---|---|---|---|---|---|---|\n"
)


@dataclass(frozen=True)
class Summary:
    """Median and spread of one measured quantity over the repetitions."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def from_samples(cls, values: Sequence[float]) -> Summary:
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


def parse_args(
    parser: argparse.ArgumentParser, module: str, argv: list[str] | None
) -> argparse.Namespace:
    """Adds ``--write-doc``, parses, and records the command as a reader would re-run it from
    the repository root (``args.command``, without ``--write-doc``) and the module
    (``args.module``, which names the doc's block)."""
    parser.add_argument(
        "--write-doc",
        nargs="?",
        type=Path,
        const=DEFAULT_DOC,
        default=None,
        metavar="DOC",
        help="also record the result as this benchmark's row of the latest "
        "results in DOC (default docs/benchmarks.md); without it the "
        "benchmark only prints its JSON",
    )
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.module = module
    args.command = " ".join(
        shlex.quote(a) for a in [".venv/bin/python", "-m", module, *_without_write_doc(argv)]
    )
    return args


def _without_write_doc(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            if not a.startswith("-"):
                continue
        if a == "--write-doc":
            skip = True
            continue
        if a.startswith("--write-doc="):
            continue
        out.append(a)
    return out


@dataclass(frozen=True)
class Row:
    benchmark: str  # the configuration measured, e.g. "gateway overhead (fake vLLM, ...)"
    loraplane: str  # key figure of loraplane's path, with unit and spread
    baseline: str  # the same for the raw baseline
    ratio: str  # e.g. "0.62x" (loraplane / baseline, higher is better) or a cost multiple
    goal: str


def times(ratio: float) -> str:
    """A ratio for the table: two decimals, or two significant digits when that rounds to 0."""
    return f"{ratio:.2f}x" if ratio >= 0.01 else f"{ratio:.2g}x"


def machine() -> str:
    """The machine a result was measured on, as the doc's ``machine`` column says it: cores,
    CPU model and the load average while it ran (the neighbours' share of those cores)."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = " " + line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores{model}, load {os.getloadavg()[0]:.1f}"


def emit(result: dict[str, Any], row: Row, args: argparse.Namespace) -> None:
    """Print the one JSON object (with the command); with ``--write-doc``, also record the row."""
    print(json.dumps({"benchmark": row.benchmark, "command": args.command, **result}))
    if args.write_doc is not None:
        record_latest(args.write_doc, args.module, row, args.command, machine())


def markers(module: str) -> tuple[str, str]:
    """The comments around a benchmark's block of latest results in a doc."""
    return f"<!-- latest:{module} -->", f"<!-- /latest:{module} -->"


def record_latest(doc: Path, module: str, row: Row, command: str, where: str) -> None:
    """Make ``row`` the latest result of its configuration in ``module``'s block of ``doc``:
    the row of the same configuration is replaced, a new configuration is added after the
    others, and nothing outside the block changes. A doc without the block gets one, in a
    section of its own at its end. Results of earlier runs are not kept: they live in git."""
    line = (
        f"| {row.benchmark} | {row.loraplane} | {row.baseline} | {row.ratio} | "
        f"{row.goal} | `{command}` | {where} |\n"
    )
    begin, end = markers(module)
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    start = text.find(begin)
    stop = text.find(end, start) if start >= 0 else -1
    if start < 0 or stop < 0:
        sep = "" if text.endswith("\n\n") else "\n" if text.endswith("\n") else "\n\n"
        text = f"{text}{sep}## {module}\n\n{begin}\n{TABLE_HEAD}{line}{end}\n"
    else:
        body = text[start + len(begin) : stop].strip("\n")
        rows = [
            r
            for r in body.splitlines()
            if r.startswith("| ") and not r.startswith("| configuration |")
        ]
        key = f"| {row.benchmark} |"
        kept = [line if r.startswith(key) else r + "\n" for r in rows]
        if line not in kept:
            kept.append(line)
        text = f"{text[:start]}{begin}\n{TABLE_HEAD}{''.join(kept)}{text[stop:]}"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
