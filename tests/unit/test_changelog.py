"""CHANGELOG.md keeps the Keep a Changelog shape: an Unreleased section first, then released
versions newest first, each with only the standard kinds of change."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KINDS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
RELEASE = re.compile(r"^## \[(Unreleased|\d+\.\d+\.\d+)\](?: - \d{4}-\d{2}-\d{2})?$")


def test_the_changelog_has_unreleased_first_and_standard_kinds() -> None:
    lines = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "# Changelog"
    releases = [line for line in lines if line.startswith("## ")]
    assert releases and releases[0] == "## [Unreleased]"
    assert all(RELEASE.match(r) for r in releases), releases
    kinds = {line[4:] for line in lines if line.startswith("### ")}
    assert kinds and kinds <= KINDS, kinds - KINDS
    assert any(line.startswith("- ") for line in lines)
