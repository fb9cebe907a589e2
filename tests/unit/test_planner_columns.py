"""The planner's registry columns (``streams.planner_columns.Registry``), built a field at a
time for 100k versions, hold what each record says: its name, score keys, size, rank,
priority and base model, row by row; the many-at-once namers equal the one-at-a-time ones;
and the commands a tick builds without validating each equal their validated selves."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplane.schemas.adapter import AdapterStatus
from loraplane.schemas.base import lora_name, lora_names
from loraplane.schemas.commands import CacheCommand, CommandReason
from loraplane.schemas.registry import AdapterView
from loraplane.streams.planner import plan
from loraplane.streams.planner_columns import Registry
from loraplane.streams.scores import score_key, score_keys, unattributed_keys
from tests.unit.test_planner import NOW
from tests.unit.test_planner_incremental import (
    ADAPTERS,
    POLICIES,
    adapter_views,
    fleet_states,
    score_states,
)
from tests.unit.test_planner_incremental import score_keys as keys_of

ids = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True)
versions = st.from_regex(r"v?[0-9.]{1,8}", fullmatch=True)
shas = st.from_regex(r"[0-9a-f]{64}", fullmatch=True)


@given(st.lists(st.tuples(ids, versions, shas), max_size=20))
def test_names_and_keys_built_at_once_are_those_built_one_at_a_time(rows: list) -> None:
    adapters = [a for a, _, _ in rows]
    vs = [v for _, v, _ in rows]
    keys = score_keys(adapters, vs)
    assert keys == [score_key(a, v) for a, v, _ in rows]
    assert unattributed_keys(adapters) == [score_key(a, None) for a in adapters]
    assert lora_names(keys, [s for _, _, s in rows]) == [lora_name(a, v, s) for a, v, s in rows]


@st.composite
def registries(draw: st.DrawFn) -> list[AdapterView]:
    """Views of some adapters, in any order, now and then one listed twice."""
    chosen = draw(st.lists(st.sampled_from(ADAPTERS), unique=True))
    views = [draw(adapter_views(a)) for a in chosen]
    if views and draw(st.booleans()):
        views.append(draw(adapter_views(chosen[0])))
    return views


@settings(max_examples=150, deadline=None)
@given(registries())
def test_the_registry_columns_hold_each_serving_version_s_own_facts(
    views: list[AdapterView],
) -> None:
    registry = Registry(views)
    every = [r for v in views for r in v.versions]
    assert registry.records == {r.lora_name: r for r in every}
    assert registry.revoked == {
        name for name, r in registry.records.items() if r.status is AdapterStatus.revoked
    }
    serving = [r for r in every if r.status in (AdapterStatus.active, AdapterStatus.canary)]
    assert registry.record == serving
    assert registry.lora == [r.lora_name for r in serving]
    assert registry.adapters == [r.adapter_id for r in serving]
    assert registry.keys == [score_key(r.adapter_id, r.version) for r in serving]
    assert registry.unattributed == [
        score_key(r.adapter_id, None) if r.status is AdapterStatus.active else None for r in serving
    ]
    assert registry.size_bytes.tolist() == [r.size_bytes for r in serving]
    assert registry.ranks.tolist() == [r.rank for r in serving]
    priorities = registry.priorities
    assert [priorities.values[c] for c in priorities.codes.tolist()] == [
        str(r.priority) for r in serving
    ]
    assert registry.canary.tolist() == [r.status is AdapterStatus.canary for r in serving]
    for base, rows in registry.bases.items():
        names = {
            r.lora_name: i for i, r in enumerate(serving) if r.base_model == base
        }  # the last row of a name seen twice
        assert rows.index == names
        assert rows.rows.tolist() == list(names.values())
    assert set(registry.bases) == {r.base_model for r in serving}
    names, rows = registry.ranked
    assert names == [n for base in sorted(registry.bases) for n in registry.bases[base].index]
    assert np.array_equal(
        rows,
        np.array([i for b in sorted(registry.bases) for i in registry.bases[b].rows], np.intp),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_tick_s_commands_equal_their_validated_selves(data: st.DataObject) -> None:
    """Only a tick's first command is validated; every other one is a copy of it with each
    field replaced, and must be exactly the command validation would have built."""
    draw = data.draw
    views = {a: draw(adapter_views(a)) for a in draw(st.sets(st.sampled_from(ADAPTERS)))}
    scores = {k: draw(score_states(NOW)) for k in draw(st.sets(st.sampled_from(keys_of(views))))}
    workers = draw(fleet_states(views, {}, NOW))
    result = plan(
        list(views.values()), scores, list(workers.values()), draw(st.sampled_from(POLICIES)), NOW
    )
    for command in result.commands:
        validated = CacheCommand.model_validate(command.model_dump())
        assert command == validated
        assert isinstance(command.reason, CommandReason)
        assert command.model_fields_set == result.commands[0].model_fields_set
        assert command.model_dump_json() == validated.model_dump_json()
