"""A compiled (msgspec) decoder of whole request logs, for the consumers whose per-message
pydantic validation is most of their cost (the metrics sink: docs/benchmarks.md, "Metrics
sink").

``fast_request_log`` may refuse more than ``codec.decode(RequestLog, ...)`` does, never less,
and never decodes a value differently (tests/unit/test_request_log_fast.py); whatever it
refuses (None) the caller decodes with ``codec.decode``, which accepts it after all or names
the reason. It takes only what a gateway writes: plain ASCII flat JSON without ``\\u``
escapes, the timestamp in the RFC 3339 form pydantic writes. Patterns are checked after
decoding (msgspec's own check costs about a microsecond a field), and the identifiers that
repeat on every log (tenant, base model, adapter, worker, version) only once while they stay
in a bounded memo.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import msgspec

from loraplane.schemas.base import ID_PATTERN, VERSION_PATTERN
from loraplane.schemas.codec import MAX_MESSAGE_BYTES
from loraplane.schemas.request_log import RequestClass, RequestLog, RequestStatus, Tier

__all__ = ["ValidMemo", "fast_request_log", "fast_request_logs", "field_meta", "unanchored"]


def unanchored(pattern: str) -> str:
    """A pydantic (Rust regex) ``^...$`` pattern for Python's ``re.fullmatch``: in
    ``re.search``, ``$`` also matches before a final newline."""
    return pattern.removeprefix("^").removesuffix("$")


def field_meta(model: Any, name: str) -> msgspec.Meta:
    """The numeric and length bounds pydantic keeps for ``model.name``, as a msgspec Meta
    (so the two cannot drift apart); pydantic's models keep string bounds of the config aside."""
    bounds: dict[str, Any] = {}
    for m in model.model_fields[name].metadata:
        for key in ("ge", "le", "min_length", "max_length"):
            if getattr(m, key, None) is not None:
                bounds[key] = getattr(m, key)
    return msgspec.Meta(**bounds)


_MS = field_meta(RequestLog, "swap_ms")  # NonNegativeMs, as ttft_ms and queue_ms
_STR = msgspec.Meta(max_length=RequestLog.model_config["str_max_length"])


class _RequestLog(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """RequestLog's fields, types, bounds and defaults for msgspec (checked against RequestLog
    in the tests). Identifier and version patterns and ``ts`` are checked after decoding."""

    ts: Annotated[str, _STR]
    event_id: Annotated[str, _STR]
    adapter_id: Annotated[str, _STR]
    tier_at_arrival: Tier
    request_id: Annotated[str, field_meta(RequestLog, "request_id")]
    tenant_id: Annotated[str, _STR]
    base_model: Annotated[str, _STR]
    worker_id: Annotated[str, _STR]
    schema_version: Literal[1] = 1
    adapter_version: Annotated[str, _STR] | None = None
    request_class: RequestClass = RequestClass.interactive
    ttft_ms: Annotated[float, _MS] | None = None
    status: RequestStatus = RequestStatus.ok
    lora_name: Annotated[str, field_meta(RequestLog, "lora_name")] | None = None
    swap_ms: Annotated[float, _MS] = 0.0
    queue_ms: Annotated[float, _MS] = 0.0
    prompts: Annotated[int, field_meta(RequestLog, "prompts")] = 1
    prompt_tokens: Annotated[int, field_meta(RequestLog, "prompt_tokens")] = 0
    output_tokens: Annotated[int, field_meta(RequestLog, "output_tokens")] = 0
    error: Annotated[str, field_meta(RequestLog, "error")] | None = None


_decode = msgspec.json.Decoder(_RequestLog).decode
_fromisoformat = datetime.fromisoformat
_ID = re.compile(unanchored(ID_PATTERN)).fullmatch
_VERSION = re.compile(unanchored(VERSION_PATTERN)).fullmatch
_STAMP = re.compile(
    r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    r"T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,6})?"
    r"(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
).fullmatch
"""The RFC 3339 form pydantic writes, every part in its range (the offset too:
``fromisoformat`` takes "+00:60", pydantic does not); the other forms pydantic takes (a
space, seven fraction digits, a number) go the slow way, where they decode as pydantic
decodes them."""


class ValidMemo:
    """Strings that matched a pattern, remembered up to ``cap`` (then forgotten at once), so
    hostile values cost a pattern check each, never memory. ``seen`` is for a caller's own
    inlined ``in`` test (a method call costs more than the lookup)."""

    def __init__(self, check: Callable[[str], object], cap: int = 100_000) -> None:
        self._check = check
        self._cap = cap
        self.seen: set[str] = set()

    def __call__(self, *values: str) -> bool:
        """Whether every value matches the pattern."""
        seen = self.seen
        for value in values:
            if value in seen:
                continue
            if self._check(value) is None:
                return False
            if len(seen) >= self._cap:
                seen.clear()
            seen.add(value)
        return True


_known_id = ValidMemo(_ID)
_known_version = ValidMemo(_VERSION)


def fast_request_logs(
    raws: Sequence[bytes | None],
) -> tuple[list[_RequestLog], list[datetime], list[int]]:
    """Whole request logs and their ``ts`` in UTC (as ``RequestLog.ts``), and the indices of
    the messages the fast path cannot prove valid (the caller asks ``codec.decode``). A batch
    a call, and no object a log but the decoded one: a call and a tuple a log cost a tenth
    of it."""
    logs: list[_RequestLog] = []
    stamps: list[datetime] = []
    left: list[int] = []
    take, stamp_of, leave = logs.append, stamps.append, left.append
    ids, versions = _known_id.seen, _known_version.seen
    for i, raw in enumerate(raws):
        # ASCII without escapes: a non-ASCII byte or an escape (a lone surrogate, an escaped
        # key) goes the slow way, where pydantic decides. A nested value needs no test: every
        # field is a scalar and unknown fields are refused, so msgspec refuses it. The
        # one-byte test first: a search for two bytes costs half a microsecond a log, one
        # byte (memchr) almost nothing, and a gateway's log has no backslash.
        if (
            raw is None
            or not raw.isascii()
            or (b"\\" in raw and b"\\u" in raw)
            or len(raw) > MAX_MESSAGE_BYTES
        ):
            leave(i)
            continue
        try:
            d = _decode(raw)
        except msgspec.MsgspecError:
            leave(i)
            continue
        adapter_id, tenant_id, base_model, worker_id = (
            d.adapter_id,
            d.tenant_id,
            d.base_model,
            d.worker_id,
        )
        if not (
            adapter_id in ids and tenant_id in ids and base_model in ids and worker_id in ids
        ) and not _known_id(adapter_id, tenant_id, base_model, worker_id):
            leave(i)
            continue
        version = d.adapter_version
        if version is not None and version not in versions and not _known_version(version):
            leave(i)
            continue
        stamp = d.ts
        if not _ID(d.event_id) or not _STAMP(stamp):
            leave(i)
            continue
        try:
            ts = _fromisoformat(stamp).astimezone(UTC)
        except (ValueError, OverflowError):  # a day out of range, or before year 1 in UTC
            leave(i)
            continue
        take(d)
        stamp_of(ts)
    return logs, stamps, left


def fast_request_log(raw: bytes | None) -> tuple[_RequestLog, datetime] | None:
    """One message through ``fast_request_logs``: the log and its ``ts`` in UTC, or None
    where the fast path cannot prove it valid."""
    logs, stamps, _ = fast_request_logs([raw])
    return (logs[0], stamps[0]) if logs else None
