"""ATTACK tests: every integer a component reads off Kafka has an upper bound in its schema.

JSON integers decode as Python ints of any size (pydantic takes up to 4,300 digits), and
the readers do arithmetic with them, floats included: an unbounded count in a record anyone
who can write the topic controls was an OverflowError (or a ValueError from ``str``) on
every tick of the reader while the compacted record stayed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel

from loraplane.schemas.codec import SchemaError, decode, encode
from loraplane.schemas.commands import CacheCommand
from loraplane.schemas.lifecycle import LifecycleEvent
from loraplane.schemas.planner_memory import PlannerMemory
from loraplane.schemas.registry import AdapterView
from loraplane.schemas.request_log import RequestLog
from loraplane.schemas.router_state import RouterState
from loraplane.schemas.score_snapshot import ScoreSnapshot, UnknownTally
from loraplane.schemas.worker_state import WorkerState
from loraplane.streams.planner import plan
from tests.unit.test_planner import NOW, POLICY, record, scores, views, worker

READ_OFF_KAFKA: tuple[type[BaseModel], ...] = (
    AdapterView,
    CacheCommand,
    LifecycleEvent,
    PlannerMemory,
    RequestLog,
    RouterState,
    ScoreSnapshot,
    UnknownTally,
    WorkerState,
)
"""Not ``CacheEvent``: its one reader, the metrics sink, bounds each value by its ClickHouse
column (``ConsumerFault.out_of_range``) and does no arithmetic with it."""


def _unbounded(
    schema: dict[str, Any], defs: dict[str, Any], path: str, seen: set[str]
) -> list[str]:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        if name in seen:
            return []
        return _unbounded(defs[name], defs, path, seen | {name})
    found = []
    if (
        schema.get("type") == "integer"
        and not {
            "const",
            "enum",
            "maximum",
            "exclusiveMaximum",
        }
        & schema.keys()
    ):
        found.append(path)
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for sub in schema.get(key, []):
            found += _unbounded(sub, defs, path, seen)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            found += _unbounded(schema[key], defs, f"{path}[]", seen)
    for name, sub in schema.get("properties", {}).items():
        found += _unbounded(sub, defs, f"{path}.{name}", seen)
    return found


@pytest.mark.parametrize("model", READ_OFF_KAFKA, ids=lambda m: m.__name__)
def test_every_integer_read_off_kafka_is_bounded(model: type[BaseModel]) -> None:
    schema = model.model_json_schema(mode="validation")
    assert _unbounded(schema, schema.get("$defs", {}), model.__name__, set()) == []


def _hostile_state(**fields: int) -> bytes:
    wire = json.loads(encode(worker("w2")))
    wire.update(fields)
    return json.dumps(wire).encode()


@pytest.mark.parametrize(
    "field", ["gpu_slots_total", "gpu_slots_used", "host_bytes_budget", "host_bytes_used"]
)
def test_attack_a_heartbeat_with_a_huge_count_is_refused_where_it_is_read(field: str) -> None:
    """2**1024 slots decoded, and the planner's protected-copy cap (a float share of the
    slots) raised OverflowError on every tick: no base model's plan while it stayed."""
    with pytest.raises(SchemaError) as err:
        decode(WorkerState, _hostile_state(**{field: 2**1024}))
    assert err.value.reason == "invalid"


def test_a_heartbeat_at_the_bounds_is_planned() -> None:
    from loraplane.schemas.worker_state import MAX_BYTES, MAX_GPU_SLOTS

    state = decode(
        WorkerState,
        _hostile_state(
            gpu_slots_total=MAX_GPU_SLOTS, host_bytes_budget=MAX_BYTES, host_bytes_used=MAX_BYTES
        ),
    )
    a = record("a")
    assert plan(views(a), scores(a=0.5), [worker("w1"), state], POLICY, NOW).commands


def test_attack_a_planner_memory_seq_at_the_digit_limit_is_refused() -> None:
    """4,300 nines decode; the next command id formats seq + 1, which has 4,301 digits:
    Python refuses to make that string, and the tick raised."""
    raw = b'{"seq": ' + b"9" * 4300 + b', "pending": [], "loads": []}'
    with pytest.raises(SchemaError) as err:
        decode(PlannerMemory, raw)
    assert err.value.reason == "invalid"
