"""``./run test --unit`` selects what pyproject's ``addopts`` deselects and more: its own
``-m`` keeps the ``fault_long`` runs out beside the ``stack`` tests (pytest's last ``-m``
replaces an earlier one, so a bare ``-m "not stack"`` brought them back)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_TESTS = """
import pytest

def test_plain():
    pass

@pytest.mark.stack
def test_on_the_stack():
    pass

@pytest.mark.fault_long
def test_a_long_fault_run():
    pass
"""


def _script(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_the_unit_loop_deselects_the_stack_and_the_long_fault_runs(tmp_path: Path) -> None:
    """The real ``run`` and pyproject, with set-up, lint and types stubbed out, collecting
    three tests: only the one with neither marker is selected."""
    shutil.copy(ROOT / "run", tmp_path / "run")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    _script(tmp_path / "scripts" / "setup.d" / "10-python.sh", "exit 0\n")
    _script(tmp_path / "scripts" / "typecheck.sh", "#!/bin/sh\nexit 0\n")
    stubs = tmp_path / "stubs"
    _script(stubs / "ruff", "#!/bin/sh\nexit 0\n")
    _script(stubs / "python", f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    _script(tmp_path / ".venv" / "bin" / "activate", f'PATH="{stubs}:$PATH"\n')
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_marked.py").write_text(_TESTS)
    env = {**os.environ, "LORAPLANE_TEST_CPUS": "0", "LORAPLANE_HOME": str(tmp_path / "home")}
    done = subprocess.run(
        [str(tmp_path / "run"), "test", "--unit", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    selected = sorted(line for line in done.stdout.splitlines() if "::" in line)
    assert selected == ["tests/unit/test_marked.py::test_plain"], done.stdout
