"""Every log line a loraplane process writes is one line (``kernel.log_lines``): a message
carrying outside text (vLLM's refusal quoting a client's field, an upstream's error) can
not forge a record of its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from loraplane.kernel.log_lines import one_line

ROOT = Path(__file__).resolve().parents[2]
_BREAKS = re.compile(
    r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]"
)


@given(st.text())
def test_one_line_has_no_line_break_or_control(text: str) -> None:
    escaped = one_line(text)
    assert not _BREAKS.search(escaped)
    assert escaped.splitlines() in ([escaped], [])
    if not _BREAKS.search(text):
        assert escaped == text  # plain text, tabs and non-ASCII letters are left as they are


def test_attack_a_bidi_override_in_a_message_is_escaped() -> None:
    """ATTACK: a client's value quoted in a log line (or a band shown by ``fleet status``)
    holding U+202E: before, it made a terminal show the rest of the line reversed ("key
    revoked" read as written by someone else); now every bidirectional formatting
    character is an escape, like a control."""
    quoted = "value=x\u202edeyoker yek\u2066\u2069\u200f"
    assert one_line(quoted) == "value=x\\u202edeyoker yek\\u2066\\u2069\\u200f"


def test_attack_a_forged_line_in_a_message_stays_in_its_record(tmp_path: Path) -> None:
    """ATTACK: the gateway logs vLLM's refusal of a request, whose words quote the client's
    field value (vLLM's ``VLLMValidationError`` adds ``value=...``); a value holding a
    newline and a fake record was a line of its own in the worker's log. A serving
    process's logging (here the streams runtimes' ``plain_process``; the worker, router and
    metrics commands call the same ``configure_logging``) writes it as one line."""
    forged = "bad (value=x\n2026-01-01 00:00:00,000 loraplane.keys key revoked\r\u2028)"
    code = (
        "import logging\n"
        "from loraplane.commands.streams import plain_process\n"
        "plain_process()\n"
        f"logging.getLogger('loraplane.gateway').warning('gateway: %s', {forged!r})\n"
    )
    env = {**os.environ, "LORAPLANE_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "loraplane" in line]
    assert len(lines) == 1 and "key revoked" in lines[0], done.stderr
    assert "\\n2026-01-01" in lines[0] and "\\u2028" in lines[0]


def test_every_process_logs_through_the_one_formatter() -> None:
    """No command configures logging but through ``kernel.log_lines``."""
    own = ROOT / "loraplane" / "kernel" / "log_lines.py"
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for top in ("loraplane", "workers", "streams", "dashboards", "schemas", "infra")
        for path in (ROOT / top).rglob("*.py")
        if path != own
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "logging.basicConfig(" in line or "logging.Formatter(" in line
    ]
    assert not found, found
