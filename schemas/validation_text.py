"""A pydantic ``ValidationError`` in words for people: each field's place and why, on one
line. Never the input (pydantic echoes it: it may be a secret, or a hostile value that
floods a terminal or a log) nor pydantic's documentation links, which made a CLI error
several lines of another project's URLs."""

from __future__ import annotations

from pydantic import ValidationError

__all__ = ["MAX_LINE_CHARS", "error_line", "field_errors"]

MAX_LINE_CHARS = 2000


def field_errors(exc: ValidationError, root: str = "(root)") -> list[tuple[str, str]]:
    """``(field path, message)`` per error; an error that only follows from another one (a
    default that could not be built) is left out."""
    return [
        (".".join(str(p) for p in e["loc"]) or root, e["msg"])
        for e in exc.errors(include_url=False, include_input=False)
        if e["type"] != "default_factory_not_called"
    ]


def error_line(exc: BaseException, root: str = "(root)") -> str:
    """``exc`` as one bounded line: a ``ValidationError`` as ``place: why; ...``, anything
    else as its text with line breaks folded."""
    if isinstance(exc, ValidationError):
        text = "; ".join(f"{loc}: {msg}" for loc, msg in field_errors(exc, root))
    else:
        text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:MAX_LINE_CHARS]
