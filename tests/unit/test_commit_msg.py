"""The commit-msg hook (scripts/commit_msg.py): what a message must look like."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("commit_msg", ROOT / "scripts" / "commit_msg.py")
assert _spec is not None and _spec.loader is not None
commit_msg = importlib.util.module_from_spec(_spec)
sys.modules["commit_msg"] = commit_msg
_spec.loader.exec_module(commit_msg)


def test_a_short_subject_and_a_body_pass() -> None:
    assert (
        commit_msg.problems(
            "Guard every vLLM route with its key\n\nBecause vLLM does not guard SageMaker routes.\n"
        )
        == []
    )


def test_long_subjects_missing_bodies_and_run_ons_fail() -> None:
    assert commit_msg.problems("x" * 73 + "\n\nwhy\n")[0].startswith("the subject is 73")
    assert commit_msg.problems("Add a thing\n") == ["the body is empty: say why the change is made"]
    assert "a blank line must follow the subject" in commit_msg.problems("Add\nwhy\n")
    assert "the subject ends with a full stop" in commit_msg.problems("Add it.\n\nwhy\n")
    assert commit_msg.problems("# only a comment\n") == ["the subject line is empty"]


def test_pre_commit_runs_the_hook_and_the_projects_checkers() -> None:
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = {h["id"]: h for repo in config["repos"] for h in repo["hooks"]}
    assert hooks["commit-msg"]["entry"] == "scripts/commit_msg.py"
    assert hooks["commit-msg"]["stages"] == ["commit-msg"]
    assert hooks["mypy"]["entry"] == "scripts/typecheck.sh"
    assert hooks["ruff"]["entry"].startswith(".venv/bin/ruff check")
    assert hooks["ruff-format"]["entry"].startswith(".venv/bin/ruff format")
