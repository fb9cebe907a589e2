"""bench.report: the doc row lands in the Pipeline benchmarks section and nowhere else."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from bench.report import HEADING, Row, Summary, append_row, percentile

WHEN = datetime(2026, 1, 2, 3, 4, tzinfo=UTC)
ROW = Row("thing", "10.0 x/s [9.0..11.0]", "20.0 x/s", "0.50x", ">= 0.5x")


def test_section_is_created_after_other_sections_and_rows_accumulate(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    theirs = "# Benchmarks\n\n## Simulator\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    doc.write_text(theirs)
    append_row(doc, ROW, "python -m bench.thing", WHEN)
    append_row(doc, ROW, "python -m bench.thing --size 2", WHEN)
    text = doc.read_text()
    assert text.startswith(theirs)
    section = text[text.index(HEADING):]
    assert section.count("| 2026-01-02 03:04 | thing |") == 2
    assert section.index("--size 2") > section.index("`python -m bench.thing`")
    assert section.count("|---|---|---|---|---|---|---|") == 1


def test_rows_go_into_the_section_even_when_another_follows_it(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    append_row(doc, ROW, "first", WHEN)
    doc.write_text(doc.read_text() + "\n## Later section\n\nkept\n")
    append_row(doc, ROW, "second", WHEN)
    text = doc.read_text()
    later = text.index("## Later section")
    assert text.index("`first`") < text.index("`second`") < later
    assert text.endswith("## Later section\n\nkept\n")


def test_summary_and_percentile() -> None:
    s = Summary.of([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.min, s.max, s.n) == (2.5, 1.0, 10.0, 4)
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        Summary.of([])
