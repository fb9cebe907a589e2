"""Bounded score state: only live registry versions hold a score key; every other log (an id
not in the registry, a retired or revoked version, a refused request) is one count in the
unknown bucket, and a version leaving the registry's live set makes its key stale."""

from __future__ import annotations

from datetime import UTC, datetime

from hypothesis import given
from hypothesis import strategies as st

from loraplane.schemas.adapter import AdapterStatus
from loraplane.schemas.base import ID_PATTERN
from loraplane.schemas.codec import encode
from loraplane.schemas.request_log import RequestLog, RequestStatus, Tier
from loraplane.schemas.score_snapshot import UNKNOWN_KEY, UnknownTally
from loraplane.streams.score_admission import LIVE, NOBODY, Known, stale_keys
from loraplane.streams.score_fold import fold_batch
from loraplane.streams.scores import score_key
from tests.kafka_message import FakeMessage
from tests.lifecycle_kit import record

T0 = 1_800_000_000.0
ADAPTERS = st.sampled_from(["a1", "a2", "b.x", "c-9"])
VERSIONS = st.sampled_from(["1", "2", "v3"])
registries = st.lists(
    st.tuples(ADAPTERS, VERSIONS, st.sampled_from(list(AdapterStatus))),
    max_size=12,
    unique_by=lambda t: (t[0], t[1]),
)
wanted = st.tuples(
    ADAPTERS | st.from_regex(ID_PATTERN, fullmatch=True),
    st.none() | VERSIONS,
    st.sampled_from(list(RequestStatus)),
)


def known_of(rows: list[tuple[str, str, AdapterStatus]]) -> Known:
    return Known.from_records(record(a, v).model_copy(update={"status": s}) for a, v, s in rows)


def log(
    i: int, adapter: str, version: str | None, status: RequestStatus = RequestStatus.ok
) -> FakeMessage:
    x = RequestLog.model_validate(
        dict(
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
            status=status,
        )
    )
    return FakeMessage(encode(x), adapter.encode(), part=0, off=i, ts_ms=int(T0 * 1000))


@given(registries, st.lists(wanted, max_size=30))
def test_a_log_holds_a_key_only_for_a_live_version_and_never_when_refused(
    rows: list[tuple[str, str, AdapterStatus]], logs: list[tuple[str, str | None, RequestStatus]]
) -> None:
    known = known_of(rows)
    live = {(a, v) for a, v, s in rows if s in LIVE}
    for adapter, version, status in logs:
        expected = status is not RequestStatus.refused and (
            (adapter, version) in live or (version is None and any(a == adapter for a, _ in live))
        )
        key = known.key_of(adapter, version, status)
        assert (key is not None) == expected
        assert key is None or key == score_key(adapter, version)


@given(registries, st.lists(wanted, max_size=40))
def test_the_fold_touches_only_admitted_keys_and_counts_the_rest(
    rows: list[tuple[str, str, AdapterStatus]], logs: list[tuple[str, str | None, RequestStatus]]
) -> None:
    known = known_of(rows)
    out = fold_batch({}, [log(i, a, v, s) for i, (a, v, s) in enumerate(logs)], known)
    admitted = [known.key_of(a, v, s) for a, v, s in logs]
    assert set(out.touched) == {k for k in admitted if k is not None}
    assert out.unknown == admitted.count(None) and out.refused == []
    tally = out.tally(UnknownTally(logs=7))
    assert tally.logs == 7 + out.unknown
    assert (tally.last is None) == (out.unknown == 0)


@given(st.lists(st.from_regex(ID_PATTERN, fullmatch=True), min_size=1, max_size=200))
def test_random_pattern_valid_ids_leave_the_state_unchanged(ids: list[str]) -> None:
    known = known_of([("a1", "1", AdapterStatus.active)])
    ids = [i for i in ids if i != "a1"]
    before = fold_batch({}, [log(0, "a1", "1")], known).touched
    out = fold_batch(before, [log(n, i, "1") for n, i in enumerate(ids, 1)], known)
    assert out.touched == {} and out.unknown == len(ids)
    assert NOBODY.key_of("a1", "1", RequestStatus.ok) is None


@given(registries, registries)
def test_keys_the_registry_no_longer_backs_are_stale_and_only_those(
    before: list[tuple[str, str, AdapterStatus]], after: list[tuple[str, str, AdapterStatus]]
) -> None:
    old, new = known_of(before), known_of(after)
    keys = [score_key(a, v) for a, vs in old.versions.items() for v in (*vs, None)]
    stale = stale_keys(new, [*keys, UNKNOWN_KEY])
    assert UNKNOWN_KEY not in stale
    for key in keys:
        adapter, _, version = key.rpartition("@")
        backed = new.admits(adapter, None if version == "*" else version)
        assert (key in stale) == (not backed)


def test_retire_and_revoke_make_a_version_stale_and_the_last_one_its_adapter() -> None:
    rows = [("a1", "1", AdapterStatus.active), ("a1", "2", AdapterStatus.canary)]
    keys = ["a1@1", "a1@2", "a1@*"]
    assert stale_keys(known_of(rows), keys) == []
    retired = [("a1", "1", AdapterStatus.active), ("a1", "2", AdapterStatus.retired)]
    assert stale_keys(known_of(retired), keys) == ["a1@2"]
    revoked = [("a1", "1", AdapterStatus.revoked), ("a1", "2", AdapterStatus.retired)]
    assert stale_keys(known_of(revoked), keys) == keys
    assert stale_keys(NOBODY, ["x", "x@", "@1"]) == ["x", "x@", "@1"]
