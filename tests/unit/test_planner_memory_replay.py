"""Planner-memory records against replays and floods (streams/planner_runtime.py): a record
carries the planner session's epoch, signed; a record older than the memory read before for
its worker is refused; every command id carries the session's epoch, so a counter set back
still gives ids the worker never saw; a record is checked on its raw bytes before it is
decoded, and refused ones are logged as one line, not one each."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from loraplane.kernel.bus import Record
from loraplane.kernel.topic_tail import TailView
from loraplane.schemas.codec import encode
from loraplane.schemas.planner_memory import PLANNER_MEMORY_SIGNING_DOMAIN
from loraplane.schemas.signing import SigningKey, b64
from loraplane.streams import planner_runtime
from loraplane.streams.planner import Planner, WorkerMemory
from loraplane.streams.planner_runtime import MemoryGate, memory_of, memory_refusal
from tests.unit.test_planner import NOW, POLICY, scores, views, worker
from tests.unit.test_planner_memory import ADAPTERS, COMMANDS, KIT, PLAN, signed
from tests.unit.test_tail_bounds import ViewSource


def memory_record(offset: int, wid: str, memory: WorkerMemory, key: str = "planner") -> Record:
    return Record("m", 0, offset, wid.encode(), signed(wid, memory, key), {}, 0)


@given(
    st.builds(
        WorkerMemory,
        seq=st.integers(0, 2**40),
        pending=st.lists(
            st.sampled_from([c for c in COMMANDS if c.worker_id == "w1"]), max_size=4
        ).map(tuple),
        loads=st.lists(st.floats(min_value=0, max_value=4e9), max_size=5).map(tuple),
        epoch=st.integers(0, 2**62),
    )
)
def test_a_signed_record_of_any_epoch_reads_back_as_written(memory: WorkerMemory) -> None:
    """The raw check (``memory_refusal``) passes exactly what the planner signs, whatever
    its epoch (0 included)."""
    record = memory_record(0, "w1", memory)
    assert memory_refusal(record, KIT.keyring) is None
    assert memory_of([record], KIT.keyring) == {"w1": memory}


_EPOCHS = st.one_of(st.just(0), st.integers(0, 2**62))


@given(_EPOCHS, _EPOCHS, st.sampled_from(["changed", "added after", "added before"]))
@example(5, 0, "added after")
@example(0, 7, "added before")
def test_attack_a_signed_records_epoch_cannot_be_changed(epoch: int, other: int, how: str) -> None:
    """ATTACK: whoever may write planner-memory takes a record a planner signed at one epoch
    and makes it read as another: the value changed, or a second ``epoch`` key put after the
    signed one (the JSON decoder keeps the last) or before it. Every such record is refused
    before it is decoded. (A check that leaves epoch 0 out of what is signed, cutting
    ``,"epoch":0,`` from the bytes, takes ``"epoch":5,"epoch":0`` for epoch 5's signature,
    and the decoder reads it as epoch 0.)"""
    memory = replace(PLAN.memory["w1"], epoch=epoch)
    raw = signed("w1", memory)
    at = b',"epoch":%d,' % epoch
    assert raw.count(at) == 1
    forged = raw.replace(
        at,
        {
            "changed": b',"epoch":%d,' % other,
            "added after": at + b'"epoch":%d,' % other,
            "added before": b',"epoch":%d' % other + at,
        }[how],
    )
    if forged == raw:  # the same value changed to itself
        return
    record = Record("m", 0, 0, b"w1", forged, {}, 0)
    why = memory_refusal(record, KIT.keyring)
    assert why is not None and why.startswith("signature does not verify"), (forged[-160:], why)
    assert memory_of([record], KIT.keyring) == {}


def test_a_record_signed_without_its_epoch_is_refused() -> None:
    """Every record the planner writes signs its epoch, 0 included: one signed over its
    fields without ``epoch`` names an epoch no signature covers."""
    unsigned = (
        PLAN.memory["w1"]
        .record()
        .model_copy(
            update={"worker_id": "w1", "key_id": KIT.keys["planner"].key_id, "signature": ""}
        )
    )
    assert unsigned.epoch == 0
    body = unsigned.model_dump_json(exclude={"signature", "epoch"}).encode()
    key = KIT.keys["planner"].private_key
    old_form = unsigned.model_copy(
        update={"signature": b64(key.sign(PLANNER_MEMORY_SIGNING_DOMAIN.encode() + b"\n" + body))}
    )
    record = Record("m", 0, 0, b"w1", encode(old_form), {}, 0)
    why = memory_refusal(record, KIT.keyring)
    assert why is not None and why.startswith("signature does not verify"), why
    assert memory_refusal(memory_record(0, "w1", PLAN.memory["w1"]), KIT.keyring) is None


def test_attack_a_replayed_older_record_is_refused_at_the_next_takeover(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A genuine record of an earlier session (or of an earlier seq) written again over the
    newest one: the takeover that read or wrote the newer memory refuses it; an equal or
    newer one is read."""
    newest = {"w1": replace(PLAN.memory["w1"], epoch=20, seq=7)}
    older_epoch = replace(PLAN.memory["w1"], epoch=10, seq=50)
    older_seq = replace(PLAN.memory["w1"], epoch=20, seq=3)
    for old in (older_epoch, older_seq):
        with caplog.at_level(logging.ERROR):
            assert memory_of([memory_record(9, "w1", old)], KIT.keyring, newest=newest) == {}
        assert "older than the memory read before (a replay): 1" in caplog.records[-1].message
    for fine in (newest["w1"], replace(newest["w1"], epoch=21, seq=0)):
        read = memory_of([memory_record(9, "w1", fine)], KIT.keyring, newest=newest)
        assert read == {"w1": fine}


def tick(memory: dict[str, WorkerMemory], epoch: int) -> list[str]:
    plan = Planner().tick(
        views(*ADAPTERS),
        scores(**{a.adapter_id: 1.0 for a in ADAPTERS}),
        [worker("w1"), worker("w2")],
        POLICY,
        NOW,
        memory,
        epoch=epoch,
    )
    assert plan.commands and all(m.epoch == epoch for m in plan.memory.values())
    return [c.command_id for c in plan.commands]


def test_attack_a_counter_set_back_still_gives_new_command_ids() -> None:
    """A replay that sets a worker's counter back, or removes its record: the next session
    issues the same commands at the same counters, under ids the worker never saw (it
    refuses an id it applied until that command's deadline passes). Epoch 0 (no lease)
    keeps the ids of before."""
    first = tick({}, epoch=1_800_000_000_000)
    again = tick({}, epoch=1_800_000_000_001)
    assert len(first) == len(again) and not set(first) & set(again)
    assert tick({}, epoch=0) == [c.command_id for c in PLAN.commands]


def test_attack_forged_records_are_refused_before_they_are_decoded(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """10,000 records under new worker ids: unsigned, signed by a key of another role,
    and naming the planner's key with a signature of nothing: none is decoded, and the
    takeover logs one line for all."""
    decoded = []
    real = planner_runtime.decode
    monkeypatch.setattr(
        planner_runtime, "decode", lambda model, raw: decoded.append(raw) or real(model, raw)
    )
    ci = KIT.keys["ci"]
    planner_key = KIT.keys["planner"].key_id
    records = []
    for i in range(10_000):
        wid = f"ghost-{i}"
        body = replace(PLAN.memory["w1"], pending=()).record()
        if i % 3 == 0:
            raw = encode(body.model_copy(update={"worker_id": wid}))
        elif i % 3 == 1:
            raw = encode(ci.sign_memory(wid, body))
        else:
            sig = "A" * 86 + "=="
            raw = encode(
                body.model_copy(update={"worker_id": wid, "key_id": planner_key, "signature": sig})
            )
        records.append(Record("m", 0, i, wid.encode(), raw, {}, 0))
    records.append(memory_record(10_000, "w1", PLAN.memory["w1"]))
    with caplog.at_level(logging.ERROR):
        assert memory_of(records, KIT.keyring) == {"w1": PLAN.memory["w1"]}
    assert len(decoded) == 1
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("planner-memory: 10000 records skipped (")


def test_attack_the_memory_tail_holds_forged_records_only_within_its_bounds(
    tmp_path: os.PathLike[str], caplog: pytest.LogCaptureFixture
) -> None:
    """As they arrive (``MemoryGate``, the tail's ``on_record``): 5,000 forged records
    leave the tail's bound of them beside the genuine one, logged once; a new keyring
    re-reads what was forgotten."""
    from pathlib import Path

    from loraplane.schemas.keyring import KeyringFile, save_keyring

    path = Path(tmp_path) / "keyring.yaml"
    save_keyring(KIT.keyring, path)
    view = TailView(max_refused=100)
    view.assign({("m", 0): 0})
    tail = ViewSource(view)
    gate = MemoryGate(KeyringFile(path), lambda: tail)  # type: ignore[arg-type,return-value]
    genuine = memory_record(0, "w1", PLAN.memory["w1"])
    stranger = SigningKey.generate("stranger", "planner-9")
    with caplog.at_level(logging.WARNING):
        for r in [genuine] + [
            Record(
                "m",
                0,
                i,
                f"ghost-{i}".encode(),
                encode(stranger.sign_memory(f"ghost-{i}", PLAN.memory["w1"].record())),
                {},
                0,
            )
            for i in range(1, 5001)
        ]:
            view.apply(r)
            gate(r)
    assert len(view.snapshot()) == 101 and view.forgotten == 4900 and gate.refused == 5000
    assert view.snapshot()[0] is genuine
    assert len(caplog.records) == 1
    save_keyring(KIT.keyring, path)
    path.touch()
    gate.keyring()
    assert tail.rewinds == 1
