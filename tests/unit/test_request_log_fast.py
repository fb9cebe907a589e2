"""The metrics sink's fast path: the compiled request-log decoder never accepts what the
pydantic model refuses and never builds a row differently; timestamps reach clickhouse-driver
as the very integers it would compute from the datetimes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from clickhouse_driver.columns.service import get_column_by_spec
from clickhouse_driver.context import Context
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.metrics.tables import TABLES, RowError, columns_of, encoders_for, timestamp_encoder
from loraplane.schemas.codec import SchemaError, decode, encode
from loraplane.schemas.fast_decode import _RequestLog, fast_request_log
from loraplane.schemas.request_log import RequestLog, Tier
from tests.wire_strategies import T0, enums, floats, hostile, ids, mutated, raw_of, versions
from tests.wire_strategies import whole as log_fields

REQUESTS = next(t for t in TABLES if t.name == "request_log")


def _bits(row: Any) -> Any:
    """A row with every float as its repr (-0.0 apart from 0.0) and every datetime with its
    zone: equal bits mean equal values in ClickHouse."""
    if isinstance(row, tuple):
        return tuple(_bits(x) for x in row)
    if isinstance(row, float):
        return repr(row)
    if isinstance(row, datetime):
        return (row.isoformat(), row.tzinfo)
    return (type(row), row)


def check(raw: bytes | None) -> None:
    """The property: what the fast path builds, the slow path builds the same."""
    assert REQUESTS.fast_row is not None
    fast = REQUESTS.fast_row(raw)
    try:
        slow = REQUESTS.row(decode(RequestLog, raw))
    except (SchemaError, RowError):
        assert fast is None, (raw, fast)
        return
    if fast is not None:
        assert _bits(fast) == _bits(slow), (raw, fast, slow)


def whole(i: int = 0, **kw: Any) -> dict[str, Any]:
    return log_fields(
        i,
        {
            "prompt_tokens": 9,
            "output_tokens": 3,
            "lora_name": "a1@1-0123abcd",
            "error": "upstream: 502",
        },
        **kw,
    )


def test_a_gateway_log_takes_the_fast_path_to_the_same_row() -> None:
    assert REQUESTS.fast_row is not None
    for log in (
        RequestLog.model_validate(whole(3)),
        RequestLog(
            event_id="e",
            ts=datetime.now(UTC),
            request_id="r",
            tenant_id="t",
            base_model="b",
            adapter_id="a",
            worker_id="w",
            tier_at_arrival=Tier.cold,
        ),
    ):
        raw = encode(log)
        fast = REQUESTS.fast_row(raw)
        assert fast is not None
        assert _bits(fast) == _bits(REQUESTS.row(log))


def test_the_decoder_has_the_log_fields_and_defaults() -> None:
    fields = RequestLog.model_fields
    names, defaults = _RequestLog.__struct_fields__, _RequestLog.__struct_defaults__
    assert set(names) == set(fields)
    for name, default in zip(names[-len(defaults) :], defaults, strict=True):
        assert fields[name].default == default, name
    assert set(names[: -len(defaults)]) == {n for n, f in fields.items() if f.is_required()}


# Values each field may take: valid, at the edges, of the wrong type, hostile.
stamps = st.sampled_from(
    [
        "2026-12-01T22:00:00Z",
        "2026-12-01T22:00:00.123456Z",
        "2026-12-01T22:00:00.1234567Z",
        "2026-12-01T22:00:00.5Z",
        "2026-12-01T22:00:00+05:30",
        "2026-12-01T22:00:00-00:00",
        "2026-12-01T22:00:00+23:59",
        "2026-12-01T22:00:00+24:00",
        "2026-12-01T22:00:00+00:60",
        "2026-12-01T23:59:60Z",
        "2026-02-30T00:00:00Z",
        "0000-01-01T00:00:00Z",
        "0001-01-01T00:00:00+01:00",
        "9999-12-31T23:59:59.999999-01:00",
        "1969-12-31T23:59:59.5Z",
        "2026-12-01 22:00:00Z",
        "2026-12-01t22:00:00z",
        "2026-12-01T22:00:00",
        "2026-12-01",
        "2026-12-01T22:00:00+0530",
        1_800_000_000,
        1.8e9,
        "1800000000",
        None,
        "",
    ]
) | st.datetimes(
    timezones=st.just(UTC)
    | st.builds(timezone, st.timedeltas(timedelta(hours=-23), timedelta(hours=23)))
).map(lambda d: d.isoformat())
counts = st.integers(-2, 10**8) | st.sampled_from(
    [0, 1, 100_000, 100_001, 10_000_000, 10_000_001, 2**64, 1.0, 2.5, "3", True, None, -0.0]
)
texts = st.text(max_size=6) | st.sampled_from(
    [
        "",
        "x" * 128,
        "x" * 129,
        "x" * 200,
        "x" * 201,
        "x" * 1024,
        "x" * 1025,
        "x" * 4097,
        1,
        None,
        "a\u0000b",
        "\ud800",
        "é",
        'a"b\\c\n',
    ]
)
fields_st = st.fixed_dictionaries(
    {},
    optional={
        "schema_version": st.sampled_from([1, 1.0, 2, "1", True, None, 0]),
        "ts": stamps,
        "event_id": ids,
        "adapter_id": ids,
        "adapter_version": versions,
        "tenant_id": ids,
        "base_model": ids,
        "worker_id": ids,
        "request_class": enums,
        "tier_at_arrival": enums,
        "status": enums,
        "ttft_ms": floats,
        "swap_ms": floats,
        "queue_ms": floats,
        "prompts": counts,
        "prompt_tokens": counts,
        "output_tokens": counts,
        "request_id": texts,
        "lora_name": texts,
        "error": texts,
        "extra": st.none()
        | st.text(max_size=5)
        | st.lists(st.integers(), max_size=2)
        | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    },
)


@settings(max_examples=400)
@given(fields_st, st.booleans(), st.sets(st.sampled_from(sorted(RequestLog.model_fields))))
def test_generated_logs_build_alike_or_go_the_slow_way(
    fields: dict[str, Any], base: bool, dropped: set[str]
) -> None:
    doc = {**whole(), **fields} if base else fields
    check(raw_of({k: v for k, v in doc.items() if k not in dropped}))


@settings(max_examples=500)
@given(stamps)
def test_timestamps_build_alike_or_go_the_slow_way(stamp: Any) -> None:
    check(raw_of(whole(ts=stamp)))


@settings(max_examples=300)
@given(st.data())
def test_mutated_bytes_build_alike_or_go_the_slow_way(data: Any) -> None:
    check(mutated(data, raw_of(whole())))


HOSTILE = [
    raw_of(whole()).replace(b'"r"', b'"' + b"[" * 300 + b'"'),
    raw_of(whole()).replace(b'"r"', b'"\xff"'),  # invalid UTF-8
    raw_of(whole()).replace(b'"r"', b'"caf\\u00e9"'),  # an escape pydantic takes
    raw_of(whole()).replace(b'"adapter_id": "a1"', b'"adapter_id": "a1", "adapter_id": "A"'),
    raw_of(whole()).replace(b'"prompt_tokens": 9', b'"prompt_tokens": 9.0'),
    raw_of(whole()).replace(b'"prompt_tokens": 9', b'"prompt_tokens": 9e0'),
    raw_of(whole()).replace(b'"prompt_tokens": 9', b'"prompt_tokens": -0'),
    *hostile(raw_of(whole())),
]


def test_hostile_messages_build_alike_or_go_the_slow_way() -> None:
    for raw in HOSTILE:
        check(raw)


def test_a_message_the_fast_path_leaves_is_still_taken_or_named() -> None:
    """An escaped non-ASCII error text goes the slow way and is taken there; a log with an
    unknown field is refused there, with pydantic's reason."""
    assert REQUESTS.fast_row is not None
    escaped = raw_of(whole(error="café"))
    assert REQUESTS.fast_row(escaped) is None and fast_request_log(escaped) is None
    assert REQUESTS.row(decode(RequestLog, escaped))[-1] == "café"
    try:
        decode(RequestLog, raw_of(whole(extra=1)))
    except SchemaError as exc:
        assert exc.reason == "invalid"
    else:
        raise AssertionError("an unknown field was taken")


_CONTEXT = Context()
_CONTEXT.client_settings = {"use_numpy": False, "input_format_null_as_default": False}
_CONTEXT.settings = {"use_client_time_zone": True}  # for the specs without a zone
SPECS = [
    "DateTime('UTC')",
    "DateTime",
    "DateTime64(3, 'UTC')",
    "DateTime64(6, 'UTC')",
    "DateTime64(0)",
]


def _driver(spec: str, values: list[Any]) -> list[Any]:
    column = get_column_by_spec(spec, {"context": _CONTEXT})
    items = list(values)
    column.before_write_items(items)
    return items


@settings(max_examples=300)
@given(
    st.lists(
        st.datetimes(
            min_value=datetime(1970, 1, 2),
            timezones=st.just(UTC)
            | st.builds(
                timezone,
                st.timedeltas(timedelta(hours=-23), timedelta(hours=23)).map(
                    lambda d: timedelta(minutes=d // timedelta(minutes=1))
                ),
            ),
        ),
        max_size=5,
    ),
    st.sampled_from(SPECS),
)
def test_timestamps_encode_as_the_driver_writes_them(values: list[datetime], spec: str) -> None:
    encode = timestamp_encoder(spec)
    assert encode is not None
    assert [encode(v) for v in values] == _driver(spec, values)


def test_only_timestamp_columns_are_encoded() -> None:
    assert [
        timestamp_encoder(t)
        for t in ("String", "UInt64", "Nullable(DateTime)", "DateTime64(9, 'UTC')", "Date")
    ] == [None] * 5
    types = {"ts": "DateTime64(3, 'UTC')", "event_id": "String"}
    encoders = encoders_for(REQUESTS, types)
    assert list(encoders) == [REQUESTS.columns.index("ts")]
    log = RequestLog.model_validate(whole())
    columns = columns_of([REQUESTS.row(log)] * 2, encoders)
    assert columns[1] == [int(T0) * 1000] * 2
    assert columns[0] == ["e0", "e0"] and len(columns) == len(REQUESTS.columns)


def test_an_instant_before_the_first_utc_day_is_refused_not_raised() -> None:
    """0001-01-01T00:00+01:00 has no UTC datetime in Python: a dead letter's reason, never an
    OverflowError out of the decoder (which would stop the sink on every replay)."""
    raw = raw_of(whole(ts="0001-01-01T00:00:00+01:00"))
    assert fast_request_log(raw) is None
    try:
        decode(RequestLog, raw)
    except SchemaError as exc:
        assert exc.reason == "invalid" and "out of range" in str(exc)
    else:
        raise AssertionError("taken")
