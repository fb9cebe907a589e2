"""Strict JSON for bytes whose signature is checked: one reading, the one that was signed.

A signature says nothing if two readers of the same bytes see two different events. So the
bytes of a signed message (a lifecycle event, a registry state file) are refused unless
every JSON reader must read them the same way:

- size and nesting depth are bounded *before* anything is parsed (no RecursionError);
- UTF-8 only: no byte-order mark, no invalid byte, no lone surrogate (``"\\ud800"``);
- no duplicate key in any object (a first-key reader would see another event);
- no ``NaN`` / ``Infinity`` / ``-Infinity``, no number that overflows a double, no integer
  with more than ``MAX_INT_DIGITS`` digits, no ``-0`` (Python's json reads the integer 0,
  serde_json and JavaScript the float -0.0: the safetensors library vLLM loads weights
  with refuses it where an integer belongs);
- exactly one JSON value (nothing but whitespace after it).

``strict_loads`` returns the parsed value or raises ``StrictJsonError`` with a
``DecodeReason`` (``too_large`` or ``malformed``) and a message for people. Type coercion is
the models' part: signed models are validated with pydantic's strict mode (see
``schemas.codec.decode_signed``).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from loraplane.schemas.reasons import DecodeReason

__all__ = [
    "MAX_DEPTH",
    "MAX_INT_DIGITS",
    "MAX_SIGNED_BYTES",
    "StrictJsonError",
    "nesting_depth",
    "strict_loads",
    "unicode_text",
]

MAX_SIGNED_BYTES = 1024 * 1024
MAX_DEPTH = 32
"""Objects and arrays nested deeper than this are refused (an event needs 4)."""
MAX_INT_DIGITS = 20
"""Longer integers are refused before Python builds them (a signed seq fits 19 digits)."""

_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.DOTALL)
"""A string (to its closing quote, or to the end when it has none, so that no quote inside
an unclosed string starts another scan: linear in the bytes) or a bracket outside one."""


class StrictJsonError(ValueError):
    def __init__(self, reason: DecodeReason, message: str) -> None:
        self.reason = reason
        super().__init__(message)


def nesting_depth(raw: bytes) -> int:
    """The deepest nesting of ``[`` / ``{`` outside strings, without parsing (linear)."""
    depth = deepest = 0
    for token in _TOKEN.findall(raw):
        if token in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif token in (b"]", b"}"):
            depth -= 1
    return deepest


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise StrictJsonError(DecodeReason.malformed, f"duplicate key {key[:64]!r}")
        obj[key] = value
    return obj


def _no_constant(name: str) -> Any:
    raise StrictJsonError(DecodeReason.malformed, f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise StrictJsonError(DecodeReason.malformed, f"number {text[:32]} overflows a double")
    return value


def _bounded_int(text: str) -> int:
    if text == "-0":
        raise StrictJsonError(
            DecodeReason.malformed,
            "negative zero -0: an integer to some readers, a float to others",
        )
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise StrictJsonError(
            DecodeReason.malformed, f"integer of {len(text)} digits (at most {MAX_INT_DIGITS})"
        )
    return int(text)


def unicode_text(value: Any) -> bool:
    """Whether every string of a parsed JSON value (keys included) is Unicode text: no lone
    surrogate, which ``json.loads`` takes from an escape (``"\\ud800"``) and no encoder
    takes. A walk with its own stack, so a value nested as deep as the parser took (one
    level past what the C encoder walks) is answered, never a RecursionError."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


def _check_strings(value: Any) -> None:
    """Lone surrogates (escaped in the JSON) are not Unicode scalar values: refuse them."""
    if not unicode_text(value):
        raise StrictJsonError(DecodeReason.malformed, "string with a lone surrogate")


def strict_loads(
    raw: bytes | str | None, max_bytes: int = MAX_SIGNED_BYTES, max_depth: int = MAX_DEPTH
) -> Any:
    """The one JSON value in ``raw``, or StrictJsonError (never another exception)."""
    if raw is None or not raw:
        raise StrictJsonError(DecodeReason.malformed, "empty message")
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if len(raw) > max_bytes:
        raise StrictJsonError(DecodeReason.too_large, f"{len(raw)} bytes > {max_bytes}")
    if raw.startswith(b"\xef\xbb\xbf"):
        raise StrictJsonError(DecodeReason.malformed, "starts with a UTF-8 byte-order mark")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StrictJsonError(
            DecodeReason.malformed, f"not UTF-8: {exc.reason} at byte {exc.start}"
        ) from None
    depth = nesting_depth(raw)
    if depth > max_depth:
        raise StrictJsonError(DecodeReason.malformed, f"nested {depth} deep (at most {max_depth})")
    try:
        value = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
            parse_float=_finite_float,
            parse_int=_bounded_int,
        )
    except StrictJsonError:
        raise
    except (ValueError, RecursionError, OverflowError) as exc:
        raise StrictJsonError(DecodeReason.malformed, f"not JSON: {exc}") from None
    _check_strings(value)
    return value
