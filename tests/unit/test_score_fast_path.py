"""The scoring fast path: the msgspec decoder never accepts what the pydantic validator
refuses and never decodes a field differently, and the inlined ``observe_many`` folds
exactly (to the bit) as the helper-call form it replaced."""

from __future__ import annotations

import math
from datetime import UTC, timedelta, timezone
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.schemas.codec import SchemaError
from loraplane.schemas.request_log import (
    RequestClass,
    RequestDemand,
    RequestStatus,
    Tier,
)
from loraplane.streams.score_fold import _Demand, demand_of, fast_demand, row_of
from loraplane.streams.scores import (
    BURST_FACTOR,
    BURST_MIN_REQUESTS_1M,
    BURST_REARM_REQUESTS_1M,
    DAY_S,
    TAU_1M_S,
    TAU_10M_S,
    TAU_DAYS_S,
    TTFT_SMOOTHING,
    Daily,
    Decayed,
    Flat,
    Sample,
    ScoreState,
    observe_many,
)
from tests.kafka_message import FakeMessage
from tests.wire_strategies import enums, floats, hostile, ids, mutated, raw_of, versions, whole

T0 = 1_800_000_000.0


def _bits(row: Any) -> Any:
    """A row with every float as its repr: -0.0 and 0.0 differ, as they would on the wire."""
    if isinstance(row, tuple):
        return tuple(_bits(x) for x in row)
    return repr(row) if isinstance(row, float) else row


def check(raw: bytes | None, key: bytes | None) -> None:
    """The property: what the fast path accepts, pydantic accepts with the same fields."""
    fast = fast_demand(raw, key)
    try:
        slow = row_of(demand_of(FakeMessage(raw, key)))
    except SchemaError:
        assert fast is None, (raw, key, fast)
        return
    if fast is not None:
        assert _bits(fast) == _bits(slow), (raw, fast, slow)


def test_the_fast_path_takes_a_gateway_log_as_pydantic_does() -> None:
    raw = raw_of(whole(7))
    fast = fast_demand(raw, b"a1")
    assert fast is not None
    assert _bits(fast) == _bits(row_of(demand_of(FakeMessage(raw, b"a1"))))
    assert fast_demand(raw, b"other") is None  # key mismatch: the slow path names it


def test_the_decoder_has_the_demand_fields_and_defaults() -> None:
    fields = RequestDemand.model_fields
    assert set(_Demand.__struct_fields__) == set(fields)
    for name, default in zip(
        _Demand.__struct_fields__[-len(_Demand.__struct_defaults__) :],
        _Demand.__struct_defaults__,
        strict=True,
    ):
        assert fields[name].default == default, name
    required = set(_Demand.__struct_fields__[: -len(_Demand.__struct_defaults__)])
    assert required == {n for n, f in fields.items() if f.is_required()}


# Values each field may take: valid, at the edges, of the wrong type, hostile.
stamps = (
    st.sampled_from(
        [
            "2026-12-01T22:00:00Z",
            "2026-12-01T22:00:00.123456Z",
            "2026-12-01T22:00:00.1234567Z",
            "2026-12-01T22:00:00.9999999Z",
            "2026-12-01T22:00:00+05:30",
            "2026-12-01T22:00:00-00:00",
            "2026-12-01T22:00:00+23:59",
            "2026-12-01T22:00:00+24:00",
            "2026-12-01T22:00:00+00:60",
            "2026-12-01T22:00:00-00:99",
            "2026-12-01T22:00:00+19:59",
            "2026-12-01T22:60:00Z",
            "2026-12-01T24:00:00Z",
            "2026-12-01T23:59:60Z",
            "2026-02-30T00:00:00Z",
            "0000-01-01T00:00:00Z",
            "9999-12-31T23:59:59.999999Z",
            "2026-12-01 22:00:00Z",
            "2026-12-01t22:00:00z",
            "2026-12-01T22:00:00",
            "2026-12-01T22:00Z",
            "2026-12-01",
            "2026-12-01T22:00:00,5Z",
            "20261201T220000Z",
            "2026-W48-1T22:00:00Z",
            "2026-12-01T22:00:00.Z",
            "2026-12-01T22:00:00+05",
            "2026-12-01T22:00:00+0530",
            "\uff12026-12-01T22:00:00Z",
            1_800_000_000,
            1.8e9,
            "1800000000",
            None,
            "",
        ]
    )
    | st.datetimes(
        timezones=st.just(UTC)
        | st.builds(timezone, st.timedeltas(timedelta(hours=-23), timedelta(hours=23)))
    ).map(lambda d: d.isoformat())
    | st.builds(
        "{:04d}-{:02d}-{:02d}T{:02d}:{:02d}:{:02d}{}{}".format,
        st.integers(0, 9999),
        st.integers(0, 13),
        st.integers(0, 32),
        st.integers(0, 25),
        st.integers(0, 61),
        st.integers(0, 61),
        st.sampled_from(["", ".5", ".123456", ".1234567", ".99999999"]),
        st.sampled_from(["Z", "z", "+00:00", "-05:30", "+24:00", "+12:60", "-23:59", ""]),
    )
)
fields_st = st.fixed_dictionaries(
    {},
    optional={
        "schema_version": st.sampled_from([1, 1.0, 2, "1", True, None, 0]),
        "ts": stamps,
        "event_id": ids,
        "adapter_id": ids,
        "adapter_version": versions,
        "request_class": enums,
        "tier_at_arrival": enums,
        "ttft_ms": floats,
        "status": enums,
        "extra": st.none()
        | st.text(max_size=5)
        | st.lists(st.integers(), max_size=2)
        | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    },
)


@settings(max_examples=300)
@given(fields_st, st.booleans())
def test_generated_logs_decode_alike_or_go_the_slow_way(fields: dict[str, Any], base: bool) -> None:
    doc = {**whole(), **fields} if base else fields
    key = doc.get("adapter_id")
    check(raw_of(doc), key.encode() if isinstance(key, str) else None)


@settings(max_examples=1000)
@given(stamps)
def test_timestamps_decode_alike_or_go_the_slow_way(stamp: Any) -> None:
    check(raw_of(whole(ts=stamp)), b"a1")


@settings(max_examples=300)
@given(st.data())
def test_mutated_bytes_decode_alike_or_go_the_slow_way(data: Any) -> None:
    check(mutated(data, raw_of(whole())), b"a1")


HOSTILE = [
    b'{"ts":"2026-12-01T22:00:00Z","event_id":"e","adapter_id":"a1","tier_at_arrival":"gpu",'
    b'"x":' + b"[" * 300 + b"]" * 300 + b"}",  # deeper than pydantic's recursion limit
    raw_of(whole()).replace(b'"r"', b'"\xff"'),  # invalid UTF-8 in an ignored field
    *hostile(raw_of(whole())),
]


def test_hostile_messages_decode_alike_or_go_the_slow_way() -> None:
    for raw in HOSTILE:
        check(raw, b"a1")


# --- observe_many against the form it replaced -----------------------------------------------


def _add(value: float, at: float, tau: float, ts: float) -> tuple[float, float]:
    if ts >= at:
        return (value * math.exp((at - ts) / tau) if value else 0.0) + 1.0, ts
    return value + math.exp((ts - at) / tau), at


def _now(value: float, at: float, tau: float, ts: float) -> float:
    return value * math.exp(-max(0.0, ts - at) / tau) if value else 0.0


def _bursting(r1: float, r1_at: float, r10: float, r10_at: float, now: float) -> bool:
    recent = _now(r1, r1_at, TAU_1M_S, now)
    return recent >= BURST_MIN_REQUESTS_1M and recent / TAU_1M_S >= BURST_FACTOR * (
        _now(r10, r10_at, TAU_10M_S, now) / TAU_10M_S
    )


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else old + TTFT_SMOOTHING * (sample - old)


def _daily_add(d: Daily, ts: float) -> Daily:
    """``Daily`` with one request at ``ts``, as ``observe_many`` folds it inline."""
    ph = math.fmod(ts, DAY_S) * (2 * math.pi / DAY_S)  # the phase, as scores computes it
    c, s = math.cos(ph), math.sin(ph)
    c2, s2 = c * c - s * s, 2 * s * c
    since = ts if d.since is None or ts < d.since else d.since
    if ts >= d.at:
        k = math.exp((d.at - ts) / TAU_DAYS_S) if d.n else 0.0
        return Daily(
            d.n * k + 1.0, d.c1 * k + c, d.s1 * k + s, d.c2 * k + c2, d.s2 * k + s2, ts, since
        )
    k = math.exp((ts - d.at) / TAU_DAYS_S)
    return Daily(d.n + k, d.c1 + k * c, d.s1 + k * s, d.c2 + k * c2, d.s2 + k * s2, d.at, since)


def reference_observe_many(state: ScoreState, samples: list[Sample]) -> tuple[ScoreState, bool]:
    """``scores.observe_many`` as it was before the fast path (helper call per counter)."""
    r10, r10_at = state.requests_10m.value, state.requests_10m.at
    r1, r1_at = state.requests_1m.value, state.requests_1m.at
    served, served_at = state.served_after_load.value, state.served_after_load.at
    errors, errors_at = state.errors_after_load.value, state.errors_after_load.at
    classes = {k: (d.value, d.at) for k, d in state.classes.items()}
    cold, hot, last, armed = (
        state.ttft_cold_ms,
        state.ttft_hot_ms,
        state.last_request,
        state.burst_armed,
    )
    daily = state.daily
    fired = False
    for ts, request_class, tier, status, ttft_ms in samples:
        if status is RequestStatus.refused:
            continue
        if tier in (Tier.gpu, Tier.host) and status in (RequestStatus.ok, RequestStatus.error):
            served, served_at = _add(served, served_at, TAU_10M_S, ts)
            if status is RequestStatus.error:
                errors, errors_at = _add(errors, errors_at, TAU_10M_S, ts)
        if request_class == "shadow":
            continue
        c_value, c_at = classes.get(request_class, (0.0, 0.0))
        classes[request_class] = _add(c_value, c_at, TAU_10M_S, ts)
        if ttft_ms is not None and status is RequestStatus.ok:
            if tier is Tier.gpu:
                hot = _ewma(hot, ttft_ms)
            elif tier in (Tier.host, Tier.cold):
                cold = _ewma(cold, ttft_ms)
        armed = armed or _now(r1, r1_at, TAU_1M_S, ts) < BURST_REARM_REQUESTS_1M
        before = (r1, r1_at, r10, r10_at, ts)
        r1, r1_at = _add(r1, r1_at, TAU_1M_S, ts)
        r10, r10_at = _add(r10, r10_at, TAU_10M_S, ts)
        if armed and _bursting(r1, r1_at, r10, r10_at, ts) and not _bursting(*before):
            armed, fired = False, True
        last = ts if last is None else max(last, ts)
        daily = _daily_add(daily, ts)
    return ScoreState(
        requests_10m=Decayed(TAU_10M_S, r10, r10_at),
        requests_1m=Decayed(TAU_1M_S, r1, r1_at),
        last_request=last,
        ttft_cold_ms=cold,
        ttft_hot_ms=hot,
        served_after_load=Decayed(TAU_10M_S, served, served_at),
        errors_after_load=Decayed(TAU_10M_S, errors, errors_at),
        classes={k: Decayed(TAU_10M_S, v, at) for k, (v, at) in classes.items()},
        burst_armed=armed,
        daily=daily,
    ), fired


times = st.floats(T0 - 2000, T0 + 2000) | st.sampled_from([T0, T0 + 1e-9, 0.0, -0.0])
counts = st.floats(0, 1e6) | st.sampled_from([0.0, -0.0, 1.0, 2.9999999, 3.0, 1.5, 1e308])


def decayed(tau: float) -> st.SearchStrategy[Decayed]:
    return st.builds(Decayed, st.just(tau), counts, times)


states = st.builds(
    ScoreState,
    requests_10m=decayed(TAU_10M_S),
    requests_1m=decayed(TAU_1M_S),
    last_request=st.none() | times,
    ttft_cold_ms=st.none() | st.floats(0, 1e4),
    ttft_hot_ms=st.none() | st.floats(0, 1e4),
    served_after_load=decayed(TAU_10M_S),
    errors_after_load=decayed(TAU_10M_S),
    classes=st.dictionaries(
        st.sampled_from([c.value for c in RequestClass]), decayed(TAU_10M_S), max_size=3
    ),
    burst_armed=st.booleans(),
    daily=st.builds(Daily, counts, *[st.floats(-1e6, 1e6)] * 4, times, st.none() | times),
)
sample_lists = st.lists(
    st.builds(
        Sample,
        ts=times,
        request_class=st.sampled_from([c.value for c in RequestClass]),
        tier=st.sampled_from(list(Tier)),
        status=st.sampled_from(list(RequestStatus)),
        ttft_ms=st.none() | st.floats(0, 10_000),
    ),
    max_size=80,
)
bursty = st.lists(st.floats(0, 3), min_size=1, max_size=120).map(
    lambda gaps: [
        Sample(T0 + sum(gaps[: i + 1]), "interactive", Tier.gpu, RequestStatus.ok, 40.0)
        for i in range(len(gaps))
    ]
)


def _state_bits(result: tuple[ScoreState, bool]) -> str:
    return repr(result)  # floats by repr: bit-exact, -0.0 apart from 0.0


@settings(max_examples=300)
@given(states, sample_lists | bursty)
def test_observe_many_folds_to_the_bit_as_the_form_it_replaced(
    state: ScoreState, samples: list[Sample]
) -> None:
    assert _state_bits(observe_many(state, samples)) == _state_bits(
        reference_observe_many(state, samples)
    )


@settings(max_examples=300)
@given(states)
def test_a_flat_state_is_its_score_state_to_the_bit(state: ScoreState) -> None:
    flat = Flat.of(state)
    assert repr(flat.state()) == repr(state)
    assert repr(Flat.of(flat.state())) == repr(flat)


@settings(max_examples=300)
@given(states, sample_lists | bursty)
def test_a_flat_fold_leaves_its_input_as_it_was(state: ScoreState, samples: list[Sample]) -> None:
    flat = Flat.of(state)
    before = repr(flat)
    after, _ = flat.observe_many(samples)
    assert repr(flat) == before and after.classes is not flat.classes
