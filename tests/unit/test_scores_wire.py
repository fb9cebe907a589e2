"""The scores topic's records (schemas.score_snapshot): what the scoring agent writes
without validating is valid, reads back as the same state, old records still read, and a
record we did not write is refused with a reason."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loraplane.schemas.codec import SchemaError, decode, encode
from loraplane.schemas.request_log import RequestClass, RequestStatus, Tier
from loraplane.schemas.score_snapshot import ScoreSnapshot
from loraplane.streams.scores import (
    Daily,
    Sample,
    ScoreState,
    from_snapshot,
    observe,
    observe_many,
    snapshot,
    snapshot_bytes,
)

T0 = 1_800_000_000.0

samples = st.builds(
    Sample,
    ts=st.floats(min_value=T0 - 3600, max_value=T0 + 3600),
    request_class=st.sampled_from([c.value for c in RequestClass]),
    tier=st.sampled_from(list(Tier)),
    status=st.sampled_from(list(RequestStatus)),
    ttft_ms=st.one_of(st.none(), st.floats(min_value=0, max_value=86_400_000)),
)


def state_of(batch: list[Sample]) -> ScoreState:
    return observe_many(ScoreState(), batch)[0]


@given(st.lists(samples, max_size=60))
def test_what_the_agent_writes_is_valid_and_reads_back_as_the_same_state(
    batch: list[Sample],
) -> None:
    state = state_of(batch)
    written = snapshot(state)  # model_construct: the write path does not validate
    assert ScoreSnapshot.model_validate(written.model_dump()) == written
    assert from_snapshot(decode(ScoreSnapshot, encode(written))) == state


@given(st.lists(samples, max_size=60))
def test_the_keepers_encoding_is_the_models_record(batch: list[Sample]) -> None:
    state = state_of(batch)
    fast, model = snapshot_bytes(state), encode(snapshot(state))
    assert list(json.loads(fast)) == list(ScoreSnapshot.model_fields)  # every field, in order
    assert json.loads(fast) == json.loads(model)
    assert decode(ScoreSnapshot, fast) == decode(ScoreSnapshot, model)
    assert from_snapshot(decode(ScoreSnapshot, fast)) == state


def legacy_bytes(state: ScoreState, with_armed: bool) -> bytes:
    """A record as the scoring agent wrote it before the schema (``json.dumps`` of a dict,
    no schema_version; the oldest ones had no ``armed``)."""

    def pair(d: object) -> list[float]:
        return [d.value, d.at]  # type: ignore[attr-defined]

    record = {
        "r10": pair(state.requests_10m),
        "r1": pair(state.requests_1m),
        "last": state.last_request,
        "cold": state.ttft_cold_ms,
        "hot": state.ttft_hot_ms,
        "served": pair(state.served_after_load),
        "errors": pair(state.errors_after_load),
        "classes": {k: pair(v) for k, v in state.classes.items()},
    }
    if with_armed:
        record["armed"] = state.burst_armed
    return json.dumps(record).encode()


@given(st.lists(samples, max_size=30), st.booleans())
def test_records_written_before_the_schema_still_read(
    batch: list[Sample], with_armed: bool
) -> None:
    state = state_of(batch)
    read = from_snapshot(decode(ScoreSnapshot, legacy_bytes(state, with_armed)))
    state = replace(state, daily=Daily())  # the daily profile is newer: none yet
    assert read == (state if with_armed else replace(state, burst_armed=True))


def test_a_record_carries_its_schema_version() -> None:
    state = observe(
        ScoreState(),
        ts=T0,
        request_class="batch",
        tier=Tier.gpu,
        status=RequestStatus.ok,
        ttft_ms=12.5,
    )
    assert json.loads(encode(snapshot(state)))["schema_version"] == 1


GOOD = json.loads(encode(snapshot(ScoreState())))


@pytest.mark.parametrize(
    "change, field",
    [
        ({"r10": [math.nan, T0]}, "r10.0"),
        ({"r1": [-1.0, T0]}, "r1.0"),
        ({"served": [1.0, math.inf]}, "served.1"),
        ({"errors": [1.0, T0, 3.0]}, "errors"),
        ({"cold": -5.0}, "cold"),
        ({"classes": {"x" * 65: [1.0, T0]}}, "classes.x" + "x" * 64 + ".[key]"),
        ({"surprise": 1}, "surprise"),
        ({"schema_version": 2}, "schema_version"),
    ],
)
def test_a_record_we_did_not_write_is_refused_with_a_reason(change: dict, field: str) -> None:
    raw = json.dumps({**GOOD, **change}).encode()  # json.dumps writes NaN and Infinity
    with pytest.raises(SchemaError) as err:
        decode(ScoreSnapshot, raw)
    assert err.value.reason == "invalid"
    assert any(loc == field for loc, _ in err.value.errors), err.value.errors


def test_a_record_that_is_not_json_is_malformed() -> None:
    with pytest.raises(SchemaError) as err:
        decode(ScoreSnapshot, b'{"r10": [1, ')
    assert err.value.reason == "malformed"
