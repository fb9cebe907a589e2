"""Where the Azure LLM traces are: ``../shared/traces/`` beside the checkout."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"


class TraceMissing(FileNotFoundError):
    """No trace file; the message says where it was looked for."""


def find_trace(explicit: Path | None = None) -> Path:
    """The trace to replay: ``explicit`` if given, else the conversation trace beside the
    checkout. Raises TraceMissing with the path it expected."""
    path = explicit or DEFAULT_TRACE
    if not path.is_file():
        raise TraceMissing(f"no trace at {path} (expected the Azure LLM traces in "
                           f"{DEFAULT_TRACE.parent})")
    return path
