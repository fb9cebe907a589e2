"""One dead-letter builder (schemas.dead_letter.dead_letter_at): its id depends only on where
the message was and who refused it, every consumer's letter goes through it (confluent and
Faust messages alike), and no module builds a DeadLetter of its own."""

from __future__ import annotations

import ast
import asyncio
import base64
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from loraplane.kernel.config import Settings
from loraplane.schemas.codec import decode, encode
from loraplane.schemas.dead_letter import (
    MAX_DEAD_LETTER_BYTES,
    MAX_DEAD_LETTER_RAW,
    DeadLetter,
    dead_letter_at,
    dead_letter_for,
    dead_letter_id,
)
from tests.kafka_message import AssignedConsumer, FakeMessage

ROOT = Path(__file__).resolve().parents[2]
BUILDER = ROOT / "schemas" / "dead_letter.py"
SOURCE_FOLDERS = ("loraplane", "schemas", "streams", "workers", "infra", "dashboards")

topics = st.text(
    st.characters(whitelist_categories=("Ll", "Nd"), whitelist_characters=".-"),
    min_size=1,
    max_size=40,
)
positions = st.tuples(
    topics,
    st.integers(0, 1000),
    st.integers(0, 2**40),
    st.sampled_from(["registry", "scoring", "planner", "metrics-sink", "worker-agent"]),
)


def Msg(
    t: str,
    part: int,
    off: int,
    raw: bytes | None,
    k: bytes | None = b"k",
    ts_ms: int = 1_800_000_000_000,
) -> FakeMessage:
    return FakeMessage(raw, k, t, part, off, ts_ms)


@given(
    positions,
    st.binary(max_size=64),
    st.binary(max_size=64),
    st.text(max_size=20),
    st.floats(0, 4e9),
)
def test_the_id_is_where_the_message_was_and_who_refused_it(
    where: tuple[str, int, int, str], raw: bytes, other_raw: bytes, detail: str, ts: float
) -> None:
    """A replay (same position, same consumer) gives the same id whatever else differs."""
    topic, partition, offset, component = where
    first = dead_letter_at(topic, partition, offset, b"k", raw, ts, component, "malformed", detail)
    again = dead_letter_at(topic, partition, offset, None, other_raw, 0.0, component, "invalid", "")
    assert first.event_id == again.event_id == dead_letter_id(*where)


@given(positions, positions)
def test_different_positions_or_consumers_never_share_an_id(
    a: tuple[str, int, int, str], b: tuple[str, int, int, str]
) -> None:
    assert (dead_letter_id(*a) == dead_letter_id(*b)) == (a == b)


def test_two_consumers_of_one_topic_each_keep_their_letter() -> None:
    msg = Msg("p.requests", 1, 9, b"\xff")
    scoring = dead_letter_for(msg, "scoring", "malformed", "x")
    sink = dead_letter_for(msg, "metrics-sink", "malformed", "x")
    assert scoring.event_id != sink.event_id
    assert (scoring.source_topic, scoring.partition, scoring.offset) == ("p.requests", 1, 9)


def test_a_huge_message_is_kept_truncated_and_says_so() -> None:
    raw = b"x" * (MAX_DEAD_LETTER_RAW + 10)
    letter = dead_letter_at("t", 0, 0, b"k" * 5000, raw, 1.0, "registry", "too_large", "big")
    assert base64.b64decode(letter.raw_b64) == raw[:MAX_DEAD_LETTER_RAW]
    assert (letter.raw_size, letter.raw_sha256) == (len(raw), hashlib.sha256(raw).hexdigest())
    assert letter.detail.startswith("big") and "raw truncated" in letter.detail
    assert letter.raw_sha256 in letter.detail  # ClickHouse keeps the detail
    assert letter.key_b64 is not None and len(letter.key_b64) <= 4096


# Poison shapes (issue #19): empty, ~1.5 MB, invalid UTF-8, a JSON bomb, lone surrogates in
# the detail (an exception quoting the bytes), huge keys, out-of-range positions.
raws = st.one_of(
    st.binary(max_size=256),
    st.sampled_from(
        [
            b"",
            b"\xff\xfe" * 40_000,
            b"[" * 200_000,
            b"x" * 1_500_000,
            b'{"a":' * 100_000,
            bytes(range(256)) * 5000,
        ]
    ),
)
details = st.one_of(
    st.text(max_size=300), st.just("\ud800" * 10_000), st.text(min_size=5000, max_size=6000)
)


@settings(max_examples=60, deadline=None)
@given(
    raw=raws,
    key=st.one_of(st.none(), st.binary(max_size=64), st.just(b"k" * 100_000)),
    detail=details,
    topic=st.text(min_size=1, max_size=300),
    partition=st.integers(-5, 2**31),
    offset=st.integers(-5, 2**62),
    ts=st.floats(-1e12, 1e12, allow_nan=False),
    component=st.text(min_size=1, max_size=90),
)
def test_no_dead_letter_exceeds_the_bound_whatever_it_was_built_from(
    raw: bytes,
    key: bytes | None,
    detail: str,
    topic: str,
    partition: int,
    offset: int,
    ts: float,
    component: str,
) -> None:
    """The one owner of the bound: encoded, every letter is under MAX_DEAD_LETTER_BYTES (far
    under the broker's 1 MiB), decodes again, and names the whole message by size+sha256."""
    letter = dead_letter_at(topic, partition, offset, key, raw, ts, component, "malformed", detail)
    wire = encode(letter)
    assert len(wire) <= MAX_DEAD_LETTER_BYTES
    again = decode(DeadLetter, wire)
    assert base64.b64decode(again.raw_b64) == raw[:MAX_DEAD_LETTER_RAW]
    assert (again.raw_size, again.raw_sha256) == (len(raw), hashlib.sha256(raw).hexdigest())
    assert again.event_id == dead_letter_id(topic, partition, offset, component)


def test_a_faust_message_gives_the_same_letter_as_any_other_client() -> None:
    from loraplane.streams.app import dead_letter_of

    message = SimpleNamespace(
        topic="p.lifecycle",
        partition=2,
        offset=7,
        key=b"a1",
        value=b"{not json",
        timestamp=1_800_000_000.5,
    )
    letter = dead_letter_of(message, "registry", "malformed", "not JSON")
    assert letter == dead_letter_at(
        "p.lifecycle",
        2,
        7,
        b"a1",
        b"{not json",
        1_800_000_000.5,
        "registry",
        "malformed",
        "not JSON",
    )
    assert letter == dead_letter_for(
        Msg("p.lifecycle", 2, 7, b"{not json", b"a1", 1_800_000_000_500),
        "registry",
        "malformed",
        "not JSON",
    )


@dataclass
class Sink:
    emitted: list[tuple[str, str, BaseModel]] = field(default_factory=list)

    def emit(self, topic_suffix: str, key: str, message: BaseModel) -> None:
        self.emitted.append((topic_suffix, key, message))


@dataclass
class Consumer(AssignedConsumer):
    pending: list[Msg]
    commits: list[Msg] = field(default_factory=list)

    def poll(self, timeout: float) -> Msg | None:
        return self.pending.pop(0) if self.pending else None

    def commit(self, message: Msg, asynchronous: bool) -> None:
        self.commits.append(message)


def test_an_undecodable_command_is_the_same_dead_letter_when_redelivered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker used to name these by uuid4: a redelivery after a crash was a second
    letter. Now it is the same record."""
    from loraplane.kernel import kafka
    from loraplane.schemas.keyring import KeyringFile
    from loraplane.workers.command_feed import COMPONENT, KafkaCommandFeed

    bad = Msg("loraplane.commands", 0, 41, b"\x00 not a command", b"w1")
    consumer = Consumer([bad, bad])
    monkeypatch.setattr(kafka, "consumer", lambda *a, **k: consumer)
    sink = Sink()
    feed = KafkaCommandFeed(Settings(), "w1", sink, keyring=KeyringFile(Path("/nonexistent")))
    assert asyncio.run(feed.next()) is None and asyncio.run(feed.next()) is None
    (s1, k1, first), (s2, k2, again) = sink.emitted
    assert (s1, k1) == (s2, k2) == ("dead-letters", "w1")
    assert first == again
    assert first == dead_letter_for(bad, COMPONENT, first.reason, first.detail)
    assert consumer.commits == [bad, bad]


def _builds_a_dead_letter(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id == "DeadLetter")
        or (isinstance(node.func, ast.Attribute) and node.func.attr == "DeadLetter")
    )


def test_no_module_but_the_builder_makes_a_dead_letter() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for folder in SOURCE_FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != BUILDER
        for node in ast.walk(ast.parse(path.read_text()))
        if _builds_a_dead_letter(node)
    ]
    assert found == []


def test_the_scan_sees_a_hand_made_dead_letter() -> None:
    tree = ast.parse("from x import DeadLetter\nDeadLetter(event_id='e')\nm.DeadLetter()\n")
    assert sum(_builds_a_dead_letter(n) for n in ast.walk(tree)) == 2
