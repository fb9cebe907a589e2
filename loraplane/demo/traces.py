"""Where the Azure LLM traces are: shipped with the package (``loraplane/demo/azure_traces/``,
CC BY 4.0, attribution in its README.md), so a bare clone or an installed wheel has them."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

__all__ = ["DEFAULT_TRACE", "TRACES", "TraceMissing", "find_trace"]

TRACES = Path(str(files("loraplane.demo") / "azure_traces"))
DEFAULT_TRACE = TRACES / "azure_llm_2023_conv.csv"


class TraceMissing(FileNotFoundError):
    """No trace file; the message says where it was looked for."""


def find_trace(explicit: Path | None = None) -> Path:
    """The trace to replay: ``explicit`` if given, else the shipped conversation trace.
    Raises TraceMissing with the path it expected."""
    path = explicit or DEFAULT_TRACE
    if not path.is_file():
        raise TraceMissing(
            f"no trace at {path} (expected the Azure LLM traces in {DEFAULT_TRACE.parent})"
        )
    return path
