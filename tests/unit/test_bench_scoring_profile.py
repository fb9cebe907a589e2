"""bench/scoring_profile.py at a tiny size: one JSON object with both figures, the ratio and
the profile's shares of the keeper's time (no timing asserted); ``--write-doc`` lands its row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import scoring_profile


def test_scoring_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "benchmarks.md"
    scoring_profile.main(
        [
            "--events",
            "300",
            "--adapters",
            "20",
            "--batch",
            "100",
            "--reps",
            "1",
            "--write-doc",
            str(doc),
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert out["keeper_us_per_log"] > 0 and out["raw_us_per_log"] > 0 and out["ratio"] > 0
    assert out["records_per_batch"] > 0
    assert abs(sum(out["profile_shares"].values()) - 1) < 0.01
    assert out["profile_shares"]["fold arithmetic and new states (observe_many)"] > 0
    assert doc.read_text().count(out["benchmark"]) == 1
