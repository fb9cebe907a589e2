"""Hypothesis strategies for the compiled decoders' property tests (the scoring fast path and
the metrics sink's request-log decoder): field values at their edges and hostile, and raw
bytes mutated in place."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from hypothesis import strategies as st

from loraplane.schemas.codec import encode
from loraplane.schemas.request_log import RequestClass, RequestLog, RequestStatus, Tier

T0 = 1_800_000_000.0


def whole(i: int = 0, more: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    """A valid request log's JSON fields (``more``: further model fields), then ``kw`` over
    them as they are (valid or not)."""
    log = RequestLog(
        event_id=f"e{i}",
        ts=datetime.fromtimestamp(T0 + i, UTC),
        request_id="r",
        tenant_id="t1",
        base_model="b",
        adapter_id="a1",
        adapter_version="1",
        worker_id="w1",
        tier_at_arrival=Tier.gpu,
        ttft_ms=40.5,
        **(more or {}),
    )
    fields: dict[str, Any] = json.loads(encode(log))
    fields.update(kw)
    return fields


def raw_of(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, allow_nan=True).encode()


ids = (
    st.sampled_from(
        [
            "a1",
            "a",
            "0",
            "a" * 128,
            "a" * 129,
            "A1",
            "a1\n",
            "\na1",
            "a/b",
            "",
            "-a",
            "a.b_c-d",
            "é",
            "a\u0000",
            "\uff11",
            1,
            None,
            True,
        ]
    )
    | st.text("a0._-", min_size=1, max_size=6)
    | st.text(max_size=8)
)
versions = st.sampled_from(
    [
        "1",
        "v2",
        "1.4.0",
        "1.2.3.4",
        "1.2.3.4.5",
        "v",
        "1.",
        "01",
        "1234567890",
        "1\n",
        "\u0661",
        None,
        1,
        1.0,
    ]
) | st.text("v0123456789.", min_size=1, max_size=8)
floats = (
    st.floats(allow_nan=True, allow_infinity=True)
    | st.integers(-10, 10**17)
    | st.sampled_from([0, -0.0, 86_400_000, 86_400_000.000001, 86_400_001, "1.5", True, None])
)
enums = st.sampled_from([*RequestClass, *Tier, *RequestStatus, "GPU", "", "ok ", 1, None])


def mutated(data: Any, raw: bytes) -> bytes:
    """``raw`` with one to four pieces inserted, deleted or replaced (drawn from ``data``)."""
    out = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(out)))
        op = data.draw(st.sampled_from(["insert", "delete", "replace"]))
        piece = data.draw(
            st.binary(min_size=1, max_size=3)
            | st.sampled_from(
                [
                    b"\\",
                    b"\\u0000",
                    b"\\ud800",
                    b"\\n",
                    b"\n",
                    b" ",
                    b"\xff",
                    b"\xc3\xa9",
                    b'"',
                    b",",
                    b"{",
                    b"[",
                    b"]",
                    b"}",
                    b"-",
                    b"e",
                    b"NaN",
                    b"Infinity",
                    b"0",
                    b"9",
                ]
            )
        )
        if op == "insert":
            out[at:at] = piece
        elif op == "delete":
            del out[at : at + len(piece)]
        else:
            out[at : at + len(piece)] = piece
    return bytes(out)


def hostile(raw: bytes) -> list[bytes | None]:
    """Variants of a valid log's ``raw`` (with ``"adapter_id": "a1"``, ``"ttft_ms": 40.5``
    and ``"status": "ok"``) that probe a JSON decoder's edges, and messages that are no log."""
    return [
        raw.replace(b'"r"', b'"\\ud800"'),  # a lone surrogate
        raw.replace(b'"adapter_id": "a1"', b'"adapter_id": "a1\\n"'),
        raw.replace(b'"status": "ok"', b'"st\\u0061tus": "refused"'),
        raw.replace(b'"adapter_id": "a1"', b'"adapter_id": "zz", "adapter_id": "a1"'),
        raw.replace(b'"adapter_id": "a1"', b'"adapter_id": "a1", "adapter_id": "zz"'),
        *(
            raw.replace(b'"ttft_ms": 40.5', b'"ttft_ms": ' + v)
            for v in (b"1e999", b"NaN", b"-0.0", b"4.05e1")
        ),
        raw + b" ",
        raw + b"x",
        b"\xef\xbb\xbf" + raw,
        b"",
        b"null",
        b"[]",
        b"{}",
        b'"x"',
        None,
        b"{" * 2_000_000,
    ]
