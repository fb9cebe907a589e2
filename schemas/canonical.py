"""Canonical bytes: the exact bytes that are hashed and signed.

JSON with sorted keys, no insignificant whitespace, UTF-8, numbers as Python's json module
writes them (floats that are whole numbers are written as such by pydantic's JSON mode).
A domain tag is prefixed so that bytes signed for one purpose never verify for another.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["canonical_json", "tagged"]


def canonical_json(obj: Any) -> bytes:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def tagged(domain: str, obj: Any) -> bytes:
    """``domain + "\\n" + canonical_json(obj)``: what Ed25519 signs."""
    return domain.encode("ascii") + b"\n" + canonical_json(obj)
