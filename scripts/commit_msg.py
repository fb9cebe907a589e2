#!/usr/bin/env python3
"""commit-msg hook: a subject of at most 72 characters in the imperative, a blank line, and a
body that says why. Run by pre-commit (.pre-commit-config.yaml) with the message file."""

from __future__ import annotations

import sys
from pathlib import Path

MAX_SUBJECT = 72


def problems(message: str) -> list[str]:
    lines = [line for line in message.splitlines() if not line.startswith("#")]
    if not lines or not lines[0].strip():
        return ["the subject line is empty"]
    subject = lines[0]
    found = []
    if len(subject) > MAX_SUBJECT:
        found.append(f"the subject is {len(subject)} characters, at most {MAX_SUBJECT}")
    if subject.rstrip().endswith("."):
        found.append("the subject ends with a full stop")
    if len(lines) > 1 and lines[1].strip():
        found.append("a blank line must follow the subject")
    body = [line for line in lines[2:] if line.strip()]
    if not body and not subject.startswith(("Merge ", "Revert ", "fixup!", "squash!")):
        found.append("the body is empty: say why the change is made")
    return found


def main() -> int:
    found = problems(Path(sys.argv[1]).read_text())
    for problem in found:
        print(f"commit message: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
