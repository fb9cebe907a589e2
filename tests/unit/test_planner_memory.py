"""The planner-memory table's records (schemas.planner_memory): what the planner writes
without validating is valid and reads back as the same memory, records written before the
schema still decode, and a record we did not write (or sign) is refused with a reason."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loraplane.schemas.codec import SchemaError, decode, encode
from loraplane.schemas.planner_memory import PlannerMemory
from loraplane.streams.planner import WorkerMemory, plan
from tests.lifecycle_kit import make_kit
from tests.unit.test_planner import NOW, POLICY, record, scores, views, worker

ADAPTERS = [record(f"a{i}") for i in range(6)]
PLAN = plan(
    views(*ADAPTERS),
    scores(**{f"a{i}": 1.0 for i in range(6)}),
    [worker("w1"), worker("w2")],
    POLICY,
    NOW,
)
COMMANDS = PLAN.commands
KIT = make_kit(datetime.fromtimestamp(NOW, UTC))


def signed(wid: str, memory: WorkerMemory, key: str = "planner") -> bytes:
    """The record the planner writes for ``wid``: signed by its key."""
    return encode(KIT.keys[key].sign_memory(wid, memory.record()))


memories = st.builds(
    WorkerMemory,
    seq=st.integers(0, 2**40),
    pending=st.lists(st.sampled_from(COMMANDS), max_size=6).map(tuple),
    loads=st.lists(st.floats(min_value=0, max_value=4e9), max_size=10).map(tuple),
)


def test_a_plan_leaves_memory_with_pending_commands_and_loads() -> None:
    assert COMMANDS and all(m.pending and m.loads for m in PLAN.memory.values())


@given(memories)
def test_what_the_planner_writes_is_valid_and_reads_back_as_the_same_memory(
    memory: WorkerMemory,
) -> None:
    written = memory.record()  # model_construct: the write path does not validate
    assert PlannerMemory.model_validate(written.model_dump()) == written
    assert WorkerMemory.of(decode(PlannerMemory, encode(written))) == memory


@given(memories)
def test_records_written_before_the_schema_still_read(memory: WorkerMemory) -> None:
    """Faust's JSON of the dict the planner stored before (no schema_version)."""
    legacy = json.dumps(
        {
            "seq": memory.seq,
            "loads": list(memory.loads),
            "pending": [c.model_dump(mode="json") for c in memory.pending],
        }
    )
    assert WorkerMemory.of(decode(PlannerMemory, legacy.encode())) == memory


GOOD = json.loads(encode(next(iter(PLAN.memory.values())).record()))


@pytest.mark.parametrize(
    "change, field",
    [
        ({"seq": -1}, "seq"),
        ({"seq": "many"}, "seq"),
        ({"loads": [float("nan")]}, "loads.0"),
        ({"pending": [{**GOOD["pending"][0], "action": "deploy"}]}, "pending.0.action"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_a_record_we_did_not_write_is_refused_with_a_reason(change: dict, field: str) -> None:
    with pytest.raises(SchemaError) as err:
        decode(PlannerMemory, json.dumps({**GOOD, **change}))
    assert err.value.reason == "invalid"
    assert any(loc == field for loc, _ in err.value.errors), err.value.errors


def test_the_runtime_skips_an_unreadable_record_with_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The planner runtime plans a worker whose planner-memory record does not decode as if
    it had no memory (the tick's memory then replaces the record), and says why; a
    tombstone is no memory."""
    from loraplane.kernel.bus import Record
    from loraplane.streams.planner_runtime import memory_of

    good, bad = signed("w1", PLAN.memory["w1"]), b'{"seq": -1'
    records = [
        Record("m", 0, i, wid.encode(), value, {}, 0)
        for i, (wid, value) in enumerate([("w1", good), ("w2", bad), ("w3", None)])
    ]
    with caplog.at_level("ERROR"):
        memory = memory_of(records, KIT.keyring)
    assert list(memory) == ["w1"]
    assert memory["w1"] == PLAN.memory["w1"]
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == "planner-memory: 1 records skipped (unreadable: 1); e.g. 'w2': unreadable"


def test_attack_a_record_holding_another_workers_commands_is_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Whoever may write planner-memory puts a worker's pending commands under another
    worker's key: neither worker's commands are held back by it."""
    from loraplane.kernel.bus import Record
    from loraplane.streams.planner_runtime import memory_of

    memory = next(m for m in PLAN.memory.values() if m.pending)
    forged = Record("m", 0, 0, b"someone-else", signed("someone-else", memory), {}, 0)
    with caplog.at_level("ERROR"):
        assert memory_of([forged], KIT.keyring) == {}
    (line,) = [r.getMessage() for r in caplog.records]
    assert "it holds a pending command for another worker" in line


@pytest.mark.parametrize(
    "how, words",
    [
        ("unsigned", "no planner key of the keyring signed it"),
        ("ci key", "no planner key of the keyring signed it"),
        ("other worker's", "the memory of another worker"),
        ("altered", "signature does not verify"),
    ],
)
def test_attack_a_memory_record_no_planner_key_signed_for_the_worker_is_skipped(
    how: str, words: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Whoever may write planner-memory writes a worker's record with pending commands of
    their choosing: the next active planner re-signed and sent every one (``_resend``), a
    signing oracle for commands to any worker. Only a record a planner key signed for that
    worker is read."""
    from loraplane.kernel.bus import Record
    from loraplane.streams.planner_runtime import memory_of

    owner, memory = next((w, m) for w, m in PLAN.memory.items() if m.pending)
    if how == "unsigned":
        raw = encode(memory.record().model_copy(update={"worker_id": owner}))
    elif how == "ci key":
        raw = signed(owner, memory, key="ci")
    elif how == "other worker's":
        other = next(w for w in PLAN.memory if w != owner)
        raw = signed(other, WorkerMemory(memory.seq, (), memory.loads))
    else:
        wire = json.loads(signed(owner, memory))
        wire["seq"] += 1
        raw = json.dumps(wire, separators=(",", ":")).encode()
    with caplog.at_level("ERROR"):
        assert memory_of([Record("m", 0, 0, owner.encode(), raw, {}, 0)], KIT.keyring) == {}
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("planner-memory: 1 records skipped (") and words in line, line


def test_no_keyring_reads_no_memory() -> None:
    from loraplane.kernel.bus import Record
    from loraplane.streams.planner_runtime import memory_of

    raw = signed("w1", PLAN.memory["w1"])
    assert memory_of([Record("m", 0, 0, b"w1", raw, {}, 0)], None) == {}


@pytest.mark.parametrize("score", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_attack_a_pending_command_with_a_non_finite_score_is_skipped(score: str) -> None:
    """A pending command is re-signed by the next active planner (``_resend``), and its
    signed bytes are canonical JSON, which has no NaN or infinity: a record holding one
    made every session end at its resend, for ever. It is refused where it is read."""
    from loraplane.kernel.bus import Record
    from loraplane.schemas.signing import SigningKey
    from loraplane.streams.planner_runtime import memory_of

    owner, memory = next((w, m) for w, m in PLAN.memory.items() if m.pending)
    marker = '"score":1.23456789'
    wire = json.loads(encode(memory.record()))
    wire["pending"][0]["reason"]["score"] = 1.23456789
    raw = json.dumps(wire, separators=(",", ":"))
    assert marker in raw
    hostile = raw.replace(marker, f'"score":{score}', 1).encode()
    with pytest.raises(SchemaError) as err:
        decode(PlannerMemory, hostile)
    assert err.value.reason == "invalid"
    read = memory_of([Record("m", 0, 0, owner.encode(), hostile, {}, 0)], KIT.keyring)
    key = SigningKey.generate("planner", "planner-1")
    for mem in read.values():  # what is read can be re-signed
        for cmd in mem.pending:
            key.sign_command(cmd)
    assert read == {}


class _Txn:
    """A transactional producer that keeps what it was given."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes | None]] = []

    def begin_transaction(self) -> None:
        pass

    def produce(
        self, topic: str, key: bytes | None = None, value: bytes | None = None, **_: object
    ) -> None:
        self.sent.append((topic, value))

    def commit_transaction(self, timeout: float = 0) -> None:
        pass


def test_attack_a_pending_command_past_its_deadline_is_not_sent_again(tmp_path: object) -> None:
    """A takeover re-signs the memory's pending commands: one whose deadline has passed
    (an old record, or one replayed) is not signed and sent again with it."""
    from loraplane.kernel.config import Settings
    from loraplane.schemas.codec import decode as decode_message
    from loraplane.schemas.commands import CacheCommand
    from loraplane.streams.planner_runtime import PlannerRuntime

    runtime = PlannerRuntime(Settings(home=tmp_path))
    owner, memory = next((w, m) for w, m in PLAN.memory.items() if len(m.pending) >= 2)
    live, old = memory.pending[0], memory.pending[1]
    past = datetime.now(UTC).replace(microsecond=0)
    old = old.model_copy(
        update={"issued_at": past.replace(year=2020), "deadline": past.replace(year=2020)}
    )
    live = live.model_copy(update={"issued_at": past, "deadline": past.replace(year=past.year + 1)})
    runtime.memory = {owner: WorkerMemory(memory.seq, (live, old), memory.loads)}
    runtime._partitions = type("P", (), {"current": lambda self: 1})()  # type: ignore[assignment]
    runtime._guard = lambda epoch: None  # type: ignore[method-assign]  # the lease is held
    txn = _Txn()
    runtime._resend(txn, KIT.keys["planner"], 1)
    sent = [decode_message(CacheCommand, v).command_id for _, v in txn.sent]
    assert sent == [live.command_id]
