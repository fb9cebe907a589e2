"""The registry per base model (loraplane/registry/topic.py ``RegistryScope`` over the live
tail's ``TailView``, loraplane/registry/live.py): a scoped consumer keeps its base models'
records and reads past the others without decoding them, and no record, whatever base
model its unsigned header claims, keeps a view from a consumer that holds the adapter.

ATTACK tests: records as a topic writer would write them (genuine views relabelled, junk,
tombstones), fed in order through the real ``TailView`` into a ``VerifiedRegistry``.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from loraplane.kernel.bus import Record
from loraplane.kernel.topic_tail import TailView
from loraplane.registry import topic as registry_topic
from loraplane.registry.live import VerifiedRegistry
from loraplane.registry.topic import BASE_MODEL_HEADER, RegistryScope, base_model_of
from loraplane.schemas.codec import decode, encode
from loraplane.schemas.keyring import KeyringFile, save_keyring
from loraplane.schemas.lifecycle import LifecycleEvent
from loraplane.schemas.registry import AdapterView, signed_views_json, views_from_json
from tests.unit.test_registry_evidence import KIT, NOW, fold
from tests.unit.test_registry_trust import Sink

OURS, THEIRS = "base-one", "base-two"


def history(adapter_id: str, base: str, start: int) -> list[LifecycleEvent]:
    """publish 1, promote 1, publish 2, promote 2, revoke 2: five views, the last a revoke."""
    steps = [
        ("publish", "1"),
        ("promote", "1"),
        ("publish", "2"),
        ("promote", "2"),
        ("revoke", "2"),
    ]
    return [
        KIT.event(
            "ops" if action == "revoke" else "ci",
            action,
            adapter_id,
            version,
            start + n,
            NOW + timedelta(seconds=n),
            base_model=base,
            **({"reason": "test"} if action == "revoke" else {}),
        )
        for n, (action, version) in enumerate(steps)
    ]


def steps(adapter_id: str, base: str, start: int) -> list[AdapterView]:
    events = history(adapter_id, base, start)
    views = [fold(events[:n]) for n in range(1, len(events) + 1)]
    assert all(v is not None for v in views)
    return [v for v in views if v is not None]


ADAPTERS = {"ours-a": OURS, "ours-b": OURS, "theirs-a": THEIRS, "theirs-b": THEIRS}
STEPS = {aid: steps(aid, base, 100 * n + 1) for n, (aid, base) in enumerate(ADAPTERS.items())}


class Stream:
    """A registry topic read in order by one tail: every record goes through ``TailView``
    (with the scope's ``keeps`` when scoped), as ``TopicTail`` applies them."""

    def __init__(self, scope: RegistryScope | None) -> None:
        self.view = TailView(None if scope is None or scope.base_models is None else scope.keeps)
        self.view.assign({("reg", 0): 0})
        self.offset = 0

    def write(
        self, key: str, value: AdapterView | bytes | None, header: str | None = "honest"
    ) -> None:
        raw = encode(value) if isinstance(value, AdapterView) else value
        headers: dict[str, bytes] = {}
        if header == "honest" and isinstance(value, AdapterView):
            headers[BASE_MODEL_HEADER] = value.base_model.encode()
        elif header not in (None, "honest"):
            headers[BASE_MODEL_HEADER] = header.encode()
        self.view.apply(Record("reg", 0, self.offset, key.encode(), raw, headers, 0))
        self.offset += 1


def consumer(
    home: Path, base_models: list[str] | None, sink: Sink | None = None
) -> tuple[VerifiedRegistry, Stream, Sink]:
    """A worker-like consumer: saved views and checkpoints in ``home``, its scope, its tail."""
    path = home / "keyring.yaml"
    if not path.exists():
        save_keyring(KIT.keyring, path)
    scope = RegistryScope(base_models)
    stream = Stream(scope)
    sink = sink or Sink()
    registry = VerifiedRegistry(
        KeyringFile(path),
        stream.view.snapshot,
        sink=sink,
        component="worker-w1",
        checkpoints_path=home / ".registry-checkpoints.json",
        views_path=home / ".registry-views.json",
        clock=lambda: NOW + timedelta(minutes=10),
        scope=scope,
    )
    return registry, stream, sink


def held(registry: VerifiedRegistry) -> dict[str, tuple[int, str | None]]:
    registry.records()
    return {aid: (v.last_seq, v.active_version) for aid, v in registry.accepted.items()}


def test_a_scoped_tail_keeps_its_base_model_and_reads_past_the_rest(tmp_path: Path) -> None:
    registry, stream, sink = consumer(tmp_path, [OURS])
    for aid, views in STEPS.items():
        stream.write(aid, views[1])
    before = stream.view.version
    stream.write("theirs-a", STEPS["theirs-a"][2])  # another base model's change: no change
    assert stream.view.version == before
    assert sorted(r.key or b"" for r in stream.view.snapshot()) == [b"ours-a", b"ours-b"]
    assert stream.view.skipped == 3 and stream.view.lag() == 0
    assert sorted(held(registry)) == ["ours-a", "ours-b"] and sink.letters() == []


def test_a_record_with_the_header_is_never_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Selection reads the header alone; the value is not parsed (a peek raises here)."""

    class NoPeek:
        def decode(self, _raw: bytes) -> Any:
            raise AssertionError("a record with the header was decoded")

    monkeypatch.setattr(registry_topic, "_PEEK", NoPeek())
    scope = RegistryScope([OURS])
    theirs = Record(
        "reg", 0, 0, b"theirs-a", b"{not even json", {BASE_MODEL_HEADER: THEIRS.encode()}, 0
    )
    assert not scope.keeps(theirs)
    assert scope.keeps(Record("reg", 0, 1, b"x", b"junk", {BASE_MODEL_HEADER: OURS.encode()}, 0))


def test_a_record_from_before_the_header_is_peeked_and_junk_is_kept() -> None:
    """An upgraded consumer on a topic written before the header: the value's base_model
    field alone selects; a value that does not give one is kept (refused and
    dead-lettered by the verified registry, as before)."""
    scope = RegistryScope([OURS])

    def record(value: bytes | None, key: bytes = b"k") -> Record:
        return Record("reg", 0, 0, key, value, {}, 0)

    assert scope.keeps(record(encode(STEPS["ours-a"][0])))
    assert not scope.keeps(record(encode(STEPS["theirs-a"][0])))
    assert base_model_of(record(encode(STEPS["theirs-a"][0]))) == THEIRS.encode()
    for junk in (
        b"{not json",
        b"[1, 2]",
        b'{"base_model": 3}',
        b"",
        "\ud800".encode("utf-8", "surrogatepass"),
        b'{"base_model": "\\ud800"}',
    ):
        assert scope.keeps(record(junk)), junk
    assert not scope.keeps(record(None))  # a tombstone of nothing held: nothing to drop
    assert RegistryScope().keeps(record(encode(STEPS["theirs-a"][0])))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.one_of(st.none(), st.binary(max_size=40)))
def test_selection_never_raises(value: bytes, header: bytes | None) -> None:
    record = Record(
        "reg", 0, 0, b"k", value, {} if header is None else {BASE_MODEL_HEADER: header}, 0
    )
    assert isinstance(RegistryScope([OURS]).keeps(record), bool)


def test_a_revoke_relabelled_as_another_base_model_still_reaches_a_worker_holding_it(
    tmp_path: Path,
) -> None:
    """ATTACK: after the genuine revoke, the attacker writes a copy of it under the other
    base model's header (so compaction leaves only the copy). A restarted worker that holds
    the adapter (its saved views) keeps the copy, verifies it and withdraws the version."""
    views = STEPS["ours-a"]
    registry, stream, _ = consumer(tmp_path, [OURS])
    stream.write("ours-a", views[3])
    assert held(registry) == {"ours-a": (views[3].last_seq, "2")}
    restarted, fresh, sink = consumer(tmp_path, [OURS])  # the compacted topic: the copy only
    fresh.write("ours-a", views[4], header=THEIRS)
    assert "ours-a@2:revoked" in {
        f"{r.adapter_id}@{r.version}:{r.status}" for r in restarted.records()
    }
    assert sink.letters() == []


def test_junk_over_a_held_adapter_claiming_another_base_model_is_dead_lettered(
    tmp_path: Path,
) -> None:
    """ATTACK: junk over a held adapter's key, labelled with another base model, is not
    read past silently: it is kept, refused, dead-lettered, and the held view stays."""
    views = STEPS["ours-a"]
    registry, stream, _ = consumer(tmp_path, [OURS])
    stream.write("ours-a", views[1])
    assert held(registry) == {"ours-a": (views[1].last_seq, "1")}
    restarted, fresh, sink = consumer(tmp_path, [OURS])
    fresh.write("ours-a", b"{junk", header=THEIRS)
    assert held(restarted) == {"ours-a": (views[1].last_seq, "1")}
    assert [d.reason for d in sink.letters()] == ["view_malformed"]
    stream.write("ours-a", b"{junk", header=THEIRS)  # live: the key is in the tail already
    assert held(registry) == {"ours-a": (views[1].last_seq, "1")}


def test_a_genuine_view_of_another_base_model_under_our_header_is_not_held(tmp_path: Path) -> None:
    """ATTACK: a genuine view of another base model's adapter, copied under this consumer's
    base model header, is kept by the tail and verified, and then not held: what a scoped
    consumer holds is decided by the signed view, never by the header."""
    registry, stream, sink = consumer(tmp_path, [OURS])
    stream.write("theirs-a", STEPS["theirs-a"][1], header=OURS)
    stream.write("theirs-b", STEPS["theirs-b"][1], header=None)  # no header: peeked, skipped
    stream.write("ours-a", STEPS["ours-a"][1])
    assert sorted(r.key or b"" for r in stream.view.snapshot()) == [b"ours-a", b"theirs-a"]
    assert sorted(held(registry)) == ["ours-a"] and sink.letters() == []
    assert not registry.holds("theirs-a")
    stream.write("theirs-a", STEPS["theirs-a"][3], header=OURS)  # its later views: the same
    assert sorted(held(registry)) == ["ours-a"]


def test_saved_views_of_another_base_model_are_not_loaded(tmp_path: Path) -> None:
    """A host tier saved by a consumer of every base model (or of another one): a consumer
    scoped to one base model loads only that base model's saved views."""
    whole, whole_topic, _ = consumer(tmp_path, None)
    for aid in ("ours-a", "theirs-a"):
        whole_topic.write(aid, STEPS[aid][1])
    assert sorted(held(whole)) == ["ours-a", "theirs-a"]
    scoped, _, _ = consumer(tmp_path, [OURS])
    assert sorted(scoped.accepted) == ["ours-a"]
    assert scoped.holds("ours-a") and not scoped.holds("theirs-a")


def test_a_tombstone_reaches_a_holder_and_withdraws_nothing(tmp_path: Path) -> None:
    """A holder reads a tombstone of its adapter (it is never left out by the scope) and
    refuses it: the registry never deletes, so the verified view stays; a view under the
    same key claiming another base model is still read past."""
    registry, stream, _ = consumer(tmp_path, [OURS])
    stream.write("ours-a", STEPS["ours-a"][1])
    before = held(registry)
    assert "ours-a" in before
    stream.write("ours-a", None)
    assert held(registry) == before
    reborn = STEPS["theirs-a"][1].model_copy(update={"adapter_id": "ours-a"})
    stream.write("ours-a", reborn)  # claims the other base model: refused, not held
    assert held(registry) == before


Op = tuple[Any, ...]
AIDS = sorted(ADAPTERS)
HEADERS = st.sampled_from(["honest", None, OURS, THEIRS])
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("agent"), st.sampled_from(AIDS)),
        st.tuples(st.just("copy"), st.sampled_from(AIDS), st.integers(0, 4), HEADERS),
        st.tuples(st.just("junk"), st.sampled_from(AIDS), HEADERS),
        st.tuples(
            st.just("refresh"),
        ),
    ),
    max_size=40,
)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(OPS)
@example([("agent", "ours-a"), ("junk", "ours-a", THEIRS), ("refresh",)])
@example(
    [
        ("agent", "ours-a"),
        ("refresh",),
        ("agent", "ours-a"),
        ("copy", "ours-a", 1, THEIRS),
        ("agent", "theirs-a"),
        ("copy", "theirs-a", 0, OURS),
        ("agent", "theirs-a"),
        ("refresh",),
    ]
)
def test_a_scoped_consumer_holds_exactly_what_an_unscoped_one_holds_of_its_base_model(
    tmp_path_factory: pytest.TempPathFactory, ops: list[Op]
) -> None:
    """ATTACK (model): the registry agent writes each adapter's genuine views in order with
    an honest header; a topic writer adds copies of views already written under any header
    (or none) and junk. At every refresh the consumer scoped to one base model holds, for
    each adapter of that base model, exactly the view a consumer of every base model holds,
    and nothing of another base model: the header hides nothing and adds nothing."""
    scoped, scoped_topic, _ = consumer(tmp_path_factory.mktemp("scoped"), [OURS])
    whole, whole_topic, _ = consumer(tmp_path_factory.mktemp("whole"), None)
    written = dict.fromkeys(AIDS, 0)

    def write(key: str, value: AdapterView | bytes, header: str | None) -> None:
        scoped_topic.write(key, value, header)
        whole_topic.write(key, value, header)

    def same() -> None:
        ours = {aid: v for aid, v in held(whole).items() if ADAPTERS[aid] == OURS}
        assert held(scoped) == ours

    for op in ops:
        if op[0] == "agent" and written[op[1]] < len(STEPS[op[1]]):
            write(op[1], STEPS[op[1]][written[op[1]]], "honest")
            written[op[1]] += 1
        elif op[0] == "copy" and op[2] < written[op[1]]:
            write(op[1], STEPS[op[1]][op[2]], op[3])
        elif op[0] == "junk":
            write(op[1], b'{"base_model": "' + ADAPTERS[op[1]].encode() + b'"}', op[2])
        elif op[0] == "refresh":
            same()
    same()


def test_views_are_held_without_their_decoded_evidence_and_saved_from_their_bytes(
    tmp_path: Path,
) -> None:
    """Memory: the accepted view keeps no decoded evidence; its signed bytes are the tail's
    own; the saved views file is written from them and reads back as the full views."""
    registry, stream, _ = consumer(tmp_path, [OURS])
    stream.write("ours-a", STEPS["ours-a"][3])
    stream.write("ours-b", STEPS["ours-b"][1])
    registry.records()
    assert all(v.evidence == [] for v in registry.accepted.values())
    record = next(r for r in stream.view.snapshot() if r.key == b"ours-a")
    assert registry.signed["ours-a"] is record.value
    saved = views_from_json((tmp_path / ".registry-views.json").read_bytes())
    assert saved == {"ours-a": STEPS["ours-a"][3], "ours-b": STEPS["ours-b"][1]}
    assert json.loads(signed_views_json(registry.signed)) == json.loads(
        (tmp_path / ".registry-views.json").read_text()
    )
    assert decode(AdapterView, registry.signed["ours-a"]) == STEPS["ours-a"][3]


def test_the_verdict_cache_holds_only_the_present_records(tmp_path: Path) -> None:
    registry, stream, _ = consumer(tmp_path, [OURS])
    for view in STEPS["ours-a"]:
        stream.write("ours-a", view)
        registry.records()
    assert len(registry._cache) == 1


HOSTILE_VALUES = [
    b"",
    b"x" * 10_000,
    b"\xff\xfe\x80" * 300,
    b"[" * 200_000,
    b'{"a":' * 50_000,
    b'"a string"',
    b'{"command_id": 5}',
    b'{"base_model": 5}',
    b'{"base_model": "\\ud800"}',
    b'{"base_model": "' + b"b" * 100_000 + b'"}',
]


@pytest.mark.parametrize("value", HOSTILE_VALUES, ids=range(len(HOSTILE_VALUES)))
def test_attack_a_value_the_peek_cannot_read_is_kept_for_the_full_decoder(value: bytes) -> None:
    """A registry record without the header whose value the peek cannot read (deep nesting
    that makes msgspec raise RecursionError, invalid UTF-8, the wrong types) names no base
    model: the scoped tail keeps it, so the registry's own decoder refuses and
    dead-letters it; nothing raises into the tail."""
    record = Record("reg", 0, 0, b"poison", value, {}, 0)
    named = base_model_of(record)
    assert named is None or isinstance(named, bytes)
    view = TailView(RegistryScope(["llama"]).keeps)
    assert view.apply(record) == (named is None or named == b"llama")


@given(
    st.binary(max_size=2048)
    | st.recursive(
        st.none() | st.integers() | st.text(),
        lambda inner: (
            st.lists(inner) | st.dictionaries(st.sampled_from(["base_model", "a"]), inner)
        ),
        max_leaves=50,
    ).map(lambda v: json.dumps(v).encode())
)
def test_the_peek_never_raises(value: bytes) -> None:
    named = base_model_of(Record("reg", 0, 0, b"k", value, {}, 0))
    assert named is None or isinstance(named, bytes)


def test_a_select_that_raises_keeps_the_record_and_the_tail_goes_on() -> None:
    def broken(record: Record) -> bool:
        raise ValueError("a select bug")

    view = TailView(broken)
    assert view.apply(Record("reg", 0, 0, b"a", b"{}", {}, 0))
    assert view.apply(Record("reg", 0, 1, b"b", b"{}", {}, 0))
