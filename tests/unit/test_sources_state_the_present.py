"""The package's sources say what and why, never when or how something was measured: no
calendar dates, no "issue #N" history, no CI-run anecdotes, no "used to". History lives in
git; measurements live in docs/benchmarks.md and the docs of the components. A module's
docstring says what the module is and why, briefly; the rules in detail belong in docs/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.repository_files import repository_files

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("loraplane", "schemas", "streams", "workers", "infra", "dashboards")

# A calendar date says when something happened. A full RFC 3339 timestamp (a ``T`` after the
# day) is a value, e.g. the ``not_before`` of a key in an example, and is allowed.
DATE = re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b(?!T)")
HISTORY = re.compile(
    r"\bissue\s*#?\s*\d+"  # "issue #15", "issue 19"
    r"|(?<![\w&/])#\d+\b"  # "#15 item 3", "(#19)"; not "librdkafka#5456", another project's
    r"|\bbefore issue\b"
    r"|\bCI run\b"  # "in a CI run of ...", "a clean CI run lost ..."
    r"|(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bwas )(?<!\bwere )(?<!\bbeen )(?<!\bbeing )"
    r"\bused to\b",  # past habit; "is used to sign" (a purpose) is fine
    re.IGNORECASE,
)

MAX_MODULE_DOCSTRING_LINES = 20


def sources() -> list[Path]:
    return sorted(p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py"))


def checked(path: Path) -> bool:
    """Every source is checked; kept as the one place an exception would be named."""
    return path.suffix == ".py"


def findings(text: str) -> list[str]:
    """``line: match`` for every date or history phrase in ``text``."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern in (DATE, HISTORY):
            out += [f"{number}: {m.group(0)!r} in {line.strip()!r}" for m in pattern.finditer(line)]
    return out


def test_the_scan_covers_the_package() -> None:
    files = [p for p in sources() if checked(p)]
    assert len(files) > 100
    assert ROOT / "loraplane" / "router" / "routing.py" in files


@pytest.mark.parametrize(
    "text",
    [
        "measured in a CI run of 2026-12-02",
        "(Until 2026-12-03 the budget was kept)",
        "the planner used to treat them as no-ops",
        "a spool (issue #19, item 1)",
        "the command partition (#15 item 3)",
        "see issue 19: the sink stalled",
        "a clean CI run lost the publishes",
        "as it was before issue 7",
    ],
)
def test_history_is_found(text: str) -> None:
    assert findings(text)


@pytest.mark.parametrize(
    "text",
    [
        "not_before: 2026-01-01T00:00:00Z",
        "SIM_EPOCH = 1_704_067_200.0  # 2024-01-01T00:00:00Z",
        "the key that is used to sign the view",
        "a request refused too",
        "the drift check CI runs",
        "colour #1f77b4",
        "version 2026.1",
        "x = 12-31",
        "confluentinc/librdkafka#5456",
    ],
)
def test_what_and_why_pass(text: str) -> None:
    assert findings(text) == []


def test_no_source_module_carries_a_date_or_its_history() -> None:
    found = {
        p.relative_to(ROOT).as_posix(): f
        for p in sources()
        if checked(p)
        if (f := findings(p.read_text(encoding="utf-8")))
    }
    assert found == {}, "say what and why; history lives in git:\n" + "\n".join(
        f"{path}:{line}" for path, lines in found.items() for line in lines
    )


VALUE_DATES = {"2012-10-17", "1970-01-01"}
"""Dates that are values, not history: the version of AWS's IAM policy grammar, the Unix epoch."""


def docs() -> list[Path]:
    """Every doc but CHANGELOG.md (history by design) and the test data's upstream READMEs."""
    listed = repository_files("*.md")
    return sorted(
        ROOT / p for p in listed if p != "CHANGELOG.md" and not p.startswith("tests/data/")
    )


def test_no_doc_carries_a_date_or_its_history() -> None:
    """The docs state the present too; a measurement says what was measured on what, not
    when (docs/benchmarks.md included)."""
    assert ROOT / "docs" / "worker.md" in docs()
    found = {
        p.relative_to(ROOT).as_posix(): f
        for p in docs()
        if (
            f := [
                line
                for line in findings(p.read_text(encoding="utf-8"))
                if not any(repr(d) in line.split(" in ", 1)[0] for d in VALUE_DATES)
            ]
        )
    }
    assert found == {}, "say what and why; history lives in git:\n" + "\n".join(
        f"{path}:{line}" for path, lines in found.items() for line in lines
    )


def test_module_docstrings_stay_short() -> None:
    long = {}
    for path in sources():
        if not checked(path):
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
        if doc and doc.count("\n") + 1 > MAX_MODULE_DOCSTRING_LINES:
            long[path.relative_to(ROOT).as_posix()] = doc.count("\n") + 1
    assert long == {}, (
        f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines: say what "
        f"and why, and move the detail to the component's doc: {long}"
    )
