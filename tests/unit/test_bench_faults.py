"""bench/faults.py: the fault table from the rows the fault tests report."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import faults
from tests.integration.fault_report import REPORT_ENV, report_fault


def test_a_reported_row_becomes_a_table_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = tmp_path / "rows.jsonl"
    monkeypatch.setenv(REPORT_ENV, str(report))
    report_fault(
        "Kafka SIGKILL",
        answered=10,
        stored=10,
        lost=0,
        duplicated=0,
        recovered=True,
        down_s=38.04,
        recovery_s=5.0,
        note="spooled 7",
    )
    (row,) = [__import__("json").loads(line) for line in report.read_text().splitlines()]
    row |= {"passed": True}
    failed = {"fault": "s3", "passed": False, "note": "AssertionError"}
    text = faults.table([row, failed])
    assert "| Kafka SIGKILL | 10 | 10 | **0** | 0 | yes | 38 | 5 | spooled 7 |" in text
    assert "| s3 | **test failed** |" in text


def test_without_the_variable_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(REPORT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    report_fault("x", answered=1, stored=1, lost=0, duplicated=0, recovered=True)
    assert list(tmp_path.iterdir()) == []


def test_the_doc_block_is_replaced_not_appended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = tmp_path / "reliability.md"
    doc.write_text("# Reliability\n")
    monkeypatch.setattr(faults, "DOC", doc)
    row = {
        "fault": "f",
        "passed": True,
        "answered": 1,
        "stored": 1,
        "lost": 0,
        "duplicated": 0,
        "recovered_by_itself": True,
        "down_s": None,
        "recovery_s": None,
        "note": "",
    }
    faults.write_doc([row], "machine one")
    faults.write_doc([row], "machine two")
    text = doc.read_text()
    assert text.count(faults.BEGIN) == 1 and "machine two" in text and "machine one" not in text
