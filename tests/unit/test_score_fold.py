"""The scoring agent's batch fold: same states as folding one request at a time, bad
messages refused with their reason, never an exception."""

from __future__ import annotations

from datetime import UTC, datetime

from hypothesis import example, given
from hypothesis import strategies as st

from loraplane.schemas.codec import encode
from loraplane.schemas.request_log import (
    RequestClass,
    RequestDemand,
    RequestLog,
    RequestStatus,
    Tier,
)
from loraplane.streams.score_admission import Known
from loraplane.streams.score_fold import RecentIds, fold_batch
from loraplane.streams.scores import (
    Flat,
    Sample,
    ScoreState,
    is_burst,
    observe,
    observe_many,
    score_key,
)
from tests.kafka_message import FakeMessage

T0 = 1_800_000_000.0
KNOWN = Known({"a1": frozenset({"1", "2"})})


def Msg(raw: bytes | None, k: bytes | None, part: int = 0, off: int = 0) -> FakeMessage:
    return FakeMessage(raw, k, part=part, off=off, ts_ms=int(T0 * 1000))


def log(i: int, adapter: str = "a1", version: str | None = "1", **kw: object) -> RequestLog:
    fields = dict(
        event_id=f"e{i}",
        ts=datetime.fromtimestamp(T0 + i, UTC),
        request_id=f"r{i}",
        tenant_id="t1",
        base_model="b",
        adapter_id=adapter,
        adapter_version=version,
        worker_id="w1",
        tier_at_arrival=Tier.gpu,
        ttft_ms=40.0,
    )
    fields.update(kw)
    return RequestLog.model_validate(fields)


def fold_one(state: ScoreState, x: RequestLog) -> ScoreState:
    return observe_many(state, [Sample.from_demand(x)])[0]


samples = st.lists(
    st.builds(
        Sample,
        ts=st.floats(T0 - 1000, T0 + 5000),
        request_class=st.sampled_from([c.value for c in RequestClass]),
        tier=st.sampled_from(list(Tier)),
        status=st.sampled_from(list(RequestStatus)),
        ttft_ms=st.none() | st.floats(0, 10_000),
    ),
    max_size=60,
)


def _demand(s: Sample) -> bool:
    """Whether a request is demand, the only kind that can start a burst: a refused one
    and the control plane's own shadow requests are not (``Flat.observe_many``)."""
    return s.status is not RequestStatus.refused and s.request_class != "shadow"


_T = 1_799_999_000.0
_OK = Sample(_T, "interactive", Tier.gpu, RequestStatus.ok, None)


@given(samples, st.integers(0, 40))
@example(  # five at once, then a refused one when the 1-minute count has decayed
    [_OK] * 5 + [Sample(_T + 73, "interactive", Tier.gpu, RequestStatus.refused, None)], 3
)
def test_batch_fold_equals_one_request_at_a_time(batch: list[Sample], split: int) -> None:
    start, _ = observe_many(ScoreState(), batch[:split])
    state, fired = start, False
    for s in batch[split:]:
        after = observe(
            state,
            ts=s.ts,
            request_class=s.request_class,
            tier=s.tier,
            status=s.status,
            ttft_ms=s.ttft_ms,
        )
        fired = fired or (_demand(s) and is_burst(state, after, s.ts))
        state = after
    assert observe_many(start, batch[split:]) == (state, fired)


def test_fold_batch_scores_each_version_and_leaves_the_input_alone() -> None:
    logs = [log(i, version="1" if i % 3 else "2") for i in range(30)] + [log(40, version=None)]
    before = {score_key("a1", "1"): fold_one(ScoreState(), log(-5))}
    snapshot = dict(before)
    out = fold_batch(before, [Msg(encode(x), b"a1") for x in logs], KNOWN)
    assert before == snapshot and out.refused == []
    expected: dict[str, ScoreState] = dict(before)
    for x in logs:
        key = score_key(x.adapter_id, x.adapter_version)
        expected[key] = fold_one(expected.get(key) or ScoreState(), x)
    assert out.touched == expected
    assert set(out.touched) == {"a1@1", "a1@2", "a1@*"}


def test_a_burst_is_reported_once_per_key() -> None:
    quiet = [log(i * 60) for i in range(10)]
    burst = [log(700 + i) for i in range(20)]
    out = fold_batch({}, [Msg(encode(x), b"a1") for x in quiet + burst], KNOWN)
    assert out.bursts == ["a1@1"]


def test_bad_messages_are_refused_with_their_reason_and_the_rest_scored() -> None:
    good = log(1)
    bad_field = encode(good).replace(b'"tier_at_arrival":"gpu"', b'"tier_at_arrival":"moon"')
    msgs = [
        Msg(b"{not json", b"a1", off=0),
        Msg(encode(good), b"other", off=1),
        Msg(None, b"a1", off=2),
        Msg(bad_field, b"a1", off=3),
        Msg(encode(good), b"a1", off=4),
    ]
    out = fold_batch({}, msgs, KNOWN)
    assert [(m.offset(), e.reason) for m, e in out.refused] == [
        (0, "malformed"),
        (1, "key_mismatch"),
        (2, "malformed"),
        (3, "invalid"),
    ]
    assert out.touched == {"a1@1": fold_one(ScoreState(), good)}


@given(st.binary(max_size=600), st.binary(max_size=20) | st.none())
def test_any_bytes_are_scored_or_refused_never_raised(raw: bytes, key: bytes | None) -> None:
    out = fold_batch({}, [Msg(raw, key)], KNOWN)
    assert len(out.refused) + len(out.touched) + out.unknown == 1


def test_attack_a_log_stamped_in_the_future_counts_as_of_the_fold() -> None:
    """One log stamped years ahead (forged, or a gateway's clock gone wrong) would set the
    counters' time past every later log: each genuine request then adds ``exp(-years)``, so
    the score stays frozen where it was. It counts as of the fold's clock instead."""
    now = T0 + 100
    forged = log(1, ts=datetime(9999, 12, 31, tzinfo=UTC))
    later = [log(200 + i) for i in range(5)]
    first = fold_batch({}, [Msg(encode(forged), b"a1")], KNOWN, now=now).flat
    (state,) = first.values()
    assert state.r10_at == now and state.last == now
    out = fold_batch(first, [Msg(encode(x), b"a1") for x in later], KNOWN, now=T0 + 300)
    expected = fold_one(fold_one(ScoreState(), log(100)), later[0])
    for x in later[1:]:
        expected = fold_one(expected, x)
    assert out.touched == {"a1@1": expected}


def test_demand_reads_a_whole_log_and_ignores_what_scores_do_not_need() -> None:
    whole = log(3, prompt_tokens=5)
    demand = RequestDemand.model_validate_json(encode(whole))
    assert demand.model_dump() == whole.model_dump(include=set(RequestDemand.model_fields))
    # A field scores do not read may be bad for the metrics sink and still be demand.
    odd = encode(whole).replace(b'"prompt_tokens":5', b'"prompt_tokens":-5')
    assert RequestDemand.model_validate_json(odd).adapter_id == "a1"


def test_a_dead_letter_is_named_by_where_its_message_was() -> None:
    from loraplane.schemas.dead_letter import dead_letter_at, dead_letter_for

    msg = Msg(b"x" * 10, b"k", part=2, off=7)
    letter = dead_letter_for(msg, "scoring", "malformed", "not JSON")
    assert letter == dead_letter_at(
        "t.requests", 2, 7, b"k", b"x" * 10, T0, "scoring", "malformed", "not JSON"
    )
    assert (letter.source_topic, letter.partition, letter.offset) == ("t.requests", 2, 7)
    assert (
        letter.event_id
        != dead_letter_for(
            Msg(b"x", b"k", part=2, off=8), "scoring", "malformed", "not JSON"
        ).event_id
    )


def test_a_log_delivered_again_is_counted_once() -> None:
    logs = [log(i) for i in range(6)]
    first = fold_batch({}, [Msg(encode(x), b"a1", off=i) for i, x in enumerate(logs[:4])], KNOWN)
    recent = RecentIds(100)
    recent.add(first.counted)
    # the event sink's replay: logs 2 and 3 again (same partition), then new ones, one twice
    again = [logs[2], logs[3], logs[4], logs[5], logs[5]]
    out = fold_batch(
        first.touched,
        [Msg(encode(x), b"a1", off=10 + i) for i, x in enumerate(again)],
        KNOWN,
        recent,
    )
    assert out.duplicates == 3 and out.counted == [(0, "e4"), (0, "e5")]
    expected = ScoreState()
    for x in logs:
        expected = fold_one(expected, x)
    assert out.touched == {"a1@1": expected}
    # the same id on another partition is another log (ids are only compared per partition)
    assert fold_batch({}, [Msg(encode(logs[2]), b"a1", part=1)], KNOWN, recent).duplicates == 0


def test_recent_ids_keep_only_the_last_size_per_partition() -> None:
    recent = RecentIds(3)
    recent.add([(0, f"e{i}") for i in range(5)] + [(1, "e0"), (0, "e4")])
    assert [(0, f"e{i}") in recent for i in range(5)] == [False, False, True, True, True]
    assert (1, "e0") in recent and len(recent) == 4


def reference_fold(
    states: dict[str, ScoreState], msgs: list[FakeMessage], known: Known, seen: set[tuple[int, str]]
) -> tuple[dict[str, ScoreState], list[str], int, float | None, int, list[str]]:
    """One log at a time, with the pydantic validator: (states, bursts, unknown, its latest
    time, duplicates, refusal reasons); ``seen`` (partition, event_id) grows."""
    from loraplane.schemas.codec import SchemaError
    from loraplane.streams.score_fold import demand_of

    states, bursts, unknown, last, duplicates, refused = dict(states), [], 0, None, 0, []
    for m in msgs:
        try:
            d = demand_of(m)
        except SchemaError as exc:
            refused.append(exc.reason)
            continue
        if (m.partition(), d.event_id) in seen:
            duplicates += 1
            continue
        seen.add((m.partition(), d.event_id))
        key = known.key_of(d.adapter_id, d.adapter_version, d.status)
        if key is None:
            unknown += 1
            ts = d.ts.timestamp()
            last = ts if last is None or ts > last else last
            continue
        before = states.get(key) or ScoreState()
        states[key] = observe_many(before, [Sample.from_demand(d)])[0]
        if is_burst(before, states[key], d.ts.timestamp()) and key not in bursts:
            bursts.append(key)
    return states, bursts, unknown, last, duplicates, refused


random_logs = st.lists(
    st.tuples(
        st.integers(0, 30),  # event id (repeats: a log delivered again)
        st.sampled_from(["a1", "a2", "zz"]),
        st.sampled_from(["1", "2", None]),
        st.sampled_from(list(RequestStatus)),
        st.sampled_from(list(Tier)),
        st.integers(0, 900),  # seconds after T0
        st.integers(0, 2),  # partition
        st.sampled_from(["ok", "ok", "ok", "bad json", "wrong key"]),
    ),
    max_size=80,
)


def messages_of(logs: list[tuple[object, ...]]) -> list[FakeMessage]:
    msgs = []
    for off, (i, adapter, version, status, tier, at, part, form) in enumerate(logs):
        x = log(
            i,  # type: ignore[arg-type]
            adapter=str(adapter),
            version=version,
            status=status,
            tier_at_arrival=tier,
            ts=datetime.fromtimestamp(T0 + at, UTC),  # type: ignore[arg-type]
        )
        raw = b"{" + encode(x)[1:] if form != "bad json" else encode(x)[:-1]
        key = b"other" if form == "wrong key" else str(adapter).encode()
        msgs.append(Msg(raw, key, part=part, off=off))  # type: ignore[arg-type]
    return msgs


@given(random_logs, st.lists(st.integers(1, 40), min_size=1, max_size=5))
def test_batches_fold_as_the_logs_one_at_a_time(
    logs: list[tuple[object, ...]], sizes: list[int]
) -> None:
    known = Known({"a1": frozenset({"1", "2"}), "a2": frozenset({"1"})})
    msgs = messages_of(logs)
    expected = reference_fold({}, msgs, known, set())
    states: dict[str, ScoreState] = {}
    recent, bursts, unknown, last, duplicates, refused = RecentIds(1000), [], 0, None, 0, []
    start, turn = 0, 0
    while start < len(msgs):
        size = sizes[turn % len(sizes)]
        out = fold_batch(states, msgs[start : start + size], known, recent)
        states.update(out.touched)
        recent.add(out.counted)
        bursts += [k for k in out.bursts if k not in bursts]
        unknown, duplicates = unknown + out.unknown, duplicates + out.duplicates
        if out.unknown_last is not None and (last is None or out.unknown_last > last):
            last = out.unknown_last
        refused += [exc.reason for _, exc in out.refused]
        start, turn = start + size, turn + 1
    assert (states, set(bursts), unknown, last, duplicates, refused) == (
        expected[0],
        set(expected[1]),
        *expected[2:],
    )


@given(random_logs, st.lists(st.integers(1, 40), min_size=1, max_size=5))
def test_the_keepers_flat_states_fold_to_the_bit_as_score_states(
    logs: list[tuple[object, ...]], sizes: list[int]
) -> None:
    """The keeper holds ``Flat`` states batch after batch: each batch's states are the
    ``ScoreState`` fold's, to the bit, and a fold leaves the states it read as they were
    (a batch judged again folds from the same states)."""
    known = Known({"a1": frozenset({"1", "2"}), "a2": frozenset({"1"})})
    msgs = messages_of(logs)
    flat: dict[str, Flat] = {}
    states: dict[str, ScoreState] = {}
    start, turn = 0, 0
    while start < len(msgs):
        batch = msgs[start : start + sizes[turn % len(sizes)]]
        before = repr(flat)
        out = fold_batch(flat, batch, known)
        assert repr(flat) == before
        assert repr(fold_batch(flat, batch, known).flat) == repr(out.flat)
        reference = fold_batch(states, batch, known)
        assert repr(out.touched) == repr(reference.touched)
        assert out.bursts == reference.bursts
        flat.update(out.flat)
        states.update(reference.touched)
        start, turn = start + len(batch), turn + 1
    assert repr({k: f.state() for k, f in flat.items()}) == repr(states)


def test_attack_an_unknown_bucket_at_its_bound_saturates() -> None:
    """The unknown bucket read back from the scores topic may hold any count its schema
    takes, 2**62 included (a record the keeper did not write). Adding a batch's unknown
    logs to it made a tally over that bound, a ValidationError in the keeper's commit of
    every later batch of the partition: its scores stopped. The count saturates instead."""
    from loraplane.schemas.score_snapshot import MAX_UNKNOWN_LOGS, UnknownTally

    at_bound = UnknownTally(logs=MAX_UNKNOWN_LOGS, last=T0)
    unknown = [Msg(encode(log(i, adapter="nobody")), b"nobody", off=i) for i in range(3)]
    folded = fold_batch({}, unknown, KNOWN, now=T0 + 10)
    assert folded.unknown == 3
    after = folded.tally(at_bound)
    assert after.logs == MAX_UNKNOWN_LOGS and after.last == T0 + 2
    assert UnknownTally.total([at_bound, after]).logs == MAX_UNKNOWN_LOGS
