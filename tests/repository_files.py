"""The repository's files as git sees them: tracked ones and untracked ones it does not
ignore (what a commit of the working tree would hold), for the tests that read the whole tree
(docs, sources, listeners)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def repository_files(*patterns: str) -> list[str]:
    """Paths relative to the root, of every such file matching one of ``patterns`` (git's
    pathspecs; none: every file)."""
    return subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", *patterns],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
