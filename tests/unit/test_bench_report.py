"""bench.report: a benchmark prints its JSON and writes no file unless asked; asked, its row
replaces the latest result of its configuration inside its own block and nowhere else."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.report import (
    DEFAULT_DOC,
    Row,
    Summary,
    emit,
    markers,
    parse_args,
    percentile,
    record_latest,
)

ROW = Row("thing (size 1)", "10.0 x/s [9.0..11.0]", "20.0 x/s", "0.50x", ">= 0.5x")
BLOCK_BEGIN, BLOCK_END = markers("bench.thing")


def parsed(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=1)
    return parse_args(parser, "bench.thing", argv)


def test_without_write_doc_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    before = DEFAULT_DOC.read_text()
    args = parsed(["--size", "2"])
    assert args.write_doc is None
    emit({"ratio": 0.5}, ROW, args)
    out = json.loads(capsys.readouterr().out)
    assert out == {
        "benchmark": ROW.benchmark,
        "command": ".venv/bin/python -m bench.thing --size 2",
        "ratio": 0.5,
    }
    assert DEFAULT_DOC.read_text() == before and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--write-doc"],
        ["--write-doc", "--size", "2"],
        ["--size", "2", "--write-doc", "x.md"],
        ["--write-doc=x.md", "--size", "2"],
    ],
)
def test_write_doc_is_asked_for_and_left_out_of_the_command(argv: list[str]) -> None:
    args = parsed(argv)
    assert args.write_doc in (DEFAULT_DOC, Path("x.md"))
    assert "--write-doc" not in args.command and "x.md" not in args.command


def test_the_row_replaces_its_configuration_inside_the_block(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    before, after = "# Benchmarks\n\n## Thing\n\nWhat it means.\n\n", "\nMore prose.\n\n## Next\n"
    doc.write_text(f"{before}{BLOCK_BEGIN}\n{BLOCK_END}\n{after}")
    record_latest(doc, "bench.thing", ROW, "python -m bench.thing", "2 cores, load 1.0")
    other = Row("thing (size 2)", "1 x/s", "2 x/s", "0.50x", ">= 0.5x")
    record_latest(doc, "bench.thing", other, "python -m bench.thing --size 2", "2 cores")
    newer = Row(ROW.benchmark, "12.0 x/s", "20.0 x/s", "0.60x", ">= 0.5x")
    record_latest(doc, "bench.thing", newer, "python -m bench.thing", "2 cores, load 3.0")
    text = doc.read_text()
    assert text.startswith(before + BLOCK_BEGIN) and text.endswith(BLOCK_END + "\n" + after)
    block = text[text.index(BLOCK_BEGIN) : text.index(BLOCK_END)]
    rows = [r for r in block.splitlines() if r.startswith("| thing")]
    assert rows == [
        "| thing (size 1) | 12.0 x/s | 20.0 x/s | 0.60x | >= 0.5x | `python -m bench.thing` "
        "| 2 cores, load 3.0 |",
        "| thing (size 2) | 1 x/s | 2 x/s | 0.50x | >= 0.5x | `python -m bench.thing --size 2` "
        "| 2 cores |",
    ]
    assert block.count("| configuration |") == 1


def test_a_doc_without_the_block_gets_a_section_at_its_end(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    theirs = "# Benchmarks\n\n## Simulator\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    doc.write_text(theirs)
    record_latest(doc, "bench.thing", ROW, "python -m bench.thing", "2 cores")
    record_latest(doc, "bench.thing", ROW, "python -m bench.thing", "2 cores")
    text = doc.read_text()
    assert text.startswith(theirs + "\n## bench.thing\n\n" + BLOCK_BEGIN)
    assert text.count("| thing (size 1) |") == 1 and text.endswith(BLOCK_END + "\n")


def test_summary_and_percentile() -> None:
    s = Summary.from_samples([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.min, s.max, s.n) == (2.5, 1.0, 10.0, 4)
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        Summary.from_samples([])
