"""Field types shared by all messages: identifiers, versions, digests, the LoRA name."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from functools import lru_cache
from operator import itemgetter
from typing import Annotated, TypeGuard

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    WithJsonSchema,
)

__all__ = [
    "ID_PATTERN",
    "LORA_NAME_RE",
    "SHA256_PATTERN",
    "TIMESTAMP_PATTERN",
    "VERSION_PATTERN",
    "Identifier",
    "NonNegativeMs",
    "Sha256",
    "StrictModel",
    "Timestamp",
    "Version",
    "is_id",
    "lora_name",
    "lora_names",
    "now_utc",
    "version_key",
]

# pydantic-core runs ``pattern=`` with Rust's regex, where ``$`` is the end of the text. In
# Python's ``re`` it also matches before a final newline (and ``match`` anchors only the
# start), so Python code applies these patterns with ``fullmatch`` (``is_id``), never
# ``match`` or ``search`` (tests/unit/test_input_patterns.py audits the source).
ID_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,127}$"
VERSION_PATTERN = r"^v?[0-9]{1,9}(\.[0-9]{1,9}){0,3}$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"
_ID_RE = re.compile(ID_PATTERN)


def is_id(text: object) -> TypeGuard[str]:
    """Whether ``text`` is an ``Identifier``, the whole of it (no trailing newline)."""
    return isinstance(text, str) and _ID_RE.fullmatch(text) is not None


Identifier = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
"""Adapter, tenant, base model, worker, publisher and event ids: lower-case, no paths."""

Version = Annotated[str, StringConstraints(pattern=VERSION_PATTERN)]
"""Dotted numeric version (``1``, ``v2``, ``1.4.0``), ordered numerically by version_key."""

Sha256 = Annotated[str, StringConstraints(pattern=SHA256_PATTERN)]


def _utc(value: datetime) -> datetime:
    try:
        return value.astimezone(UTC)
    except OverflowError:  # 0001-01-01T00:00+01:00 is before the first UTC instant Python has
        raise ValueError("the instant is out of range in UTC") from None


TIMESTAMP_PATTERN = (
    r"^(?!0000)(?!9999-12-31[Tt][^+]*-)(?!0001-01-01[Tt][^-]*\+)"
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-5][0-9]"
)
"""What the exported schema adds to RFC 3339's ``date-time`` for a ``Timestamp`` (ECMA-262,
as JSON Schema validators run it; pydantic does not apply it): the instants Python holds.
No year 0000, no leap second (:60), and no offset that moves the instant out of years
1-9999 in UTC."""

Timestamp = Annotated[
    AwareDatetime,
    AfterValidator(_utc),
    WithJsonSchema({"type": "string", "format": "date-time", "pattern": TIMESTAMP_PATTERN}),
]
"""Timezone-aware instants, normalised to UTC so canonical bytes do not depend on offsets."""

NonNegativeMs = Annotated[float, Field(ge=0, le=86_400_000)]


class StrictModel(BaseModel):
    """Base of every wire model: unknown fields and type coercion are errors."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, strict=False, str_max_length=4096, validate_default=True
    )


def version_key(version: str) -> tuple[int, ...]:
    """Numeric order of versions: ``v2`` < ``1.10`` is false, ``1.9`` < ``1.10`` is true.

    Remembered for strings as long as a ``Version`` may be: a registry view's versions are
    ordered and checked on every step of every fold of its history."""
    if len(version) <= _VERSION_MAX:
        return _version_key(version)
    return _parse_version(version)


_VERSION_MAX = 40
"""The longest string ``VERSION_PATTERN`` matches (``v`` and four parts of nine digits)."""


def _parse_version(version: str) -> tuple[int, ...]:
    parts = tuple(int(p) for p in version.lstrip("v").split("."))
    # Trailing zeros do not make a version newer: 1 == 1.0 == 1.0.0.
    while len(parts) > 1 and parts[-1] == 0:
        parts = parts[:-1]
    return parts


_version_key = lru_cache(maxsize=4096)(_parse_version)


LORA_NAME_RE = re.compile(
    r"^(?P<adapter_id>[a-z0-9][a-z0-9._-]{0,127})@(?P<version>v?[0-9.]+)"
    r"-(?P<sha8>[0-9a-f]{8})$"
)


def lora_name(adapter_id: str, version: str, sha256: str) -> str:
    """The name vLLM knows an adapter by. It names the *content*: vLLM keys its prefix
    cache by LoRA name, so a name must never be reused for other weights."""
    return f"{adapter_id}@{version}-{sha256[:8]}"


def lora_names(keys: list[str], sha256s: list[str]) -> list[str]:
    """``lora_name`` of many versions from their ``adapter_id@version`` keys (a version's
    score key), in C-level passes: a planner names 100k versions at once."""
    return list(map("-".join, zip(keys, map(_SHA8, sha256s), strict=True)))


_SHA8 = itemgetter(slice(None, 8))


def now_utc() -> datetime:
    return datetime.now(UTC)
