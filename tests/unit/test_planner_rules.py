"""The planner runs the rules of docs/planner.md in the order the doc numbers them: each rule
is one function of ``_RULES`` (its docstring opens with its number), and on any fleet a base
model's commands carry rule numbers that never decrease."""

from __future__ import annotations

import re
from itertools import groupby
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplane.schemas.registry import AdapterView
from loraplane.schemas.worker_state import WorkerState
from loraplane.streams.planner import _RULES, plan
from loraplane.streams.scores import ScoreState
from tests.unit.test_planner import NOW
from tests.unit.test_planner_incremental import (
    ADAPTERS,
    POLICIES,
    adapter_views,
    fleet_states,
    score_keys,
    score_states,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "planner.md"


def rules_section() -> str:
    text = DOC.read_text()
    start = text.index("## Planner rules")
    return text[start : text.index("\n## ", start + 1)]


def rule_numbers() -> dict[str, int]:
    """``reason.rule`` -> its number, from the doc's table."""
    return {
        rule: int(n)
        for n, rule in re.findall(r"^\| (\d+) \| `(\w+)` \|", rules_section(), re.MULTILINE)
    }


def test_each_numbered_rule_of_the_doc_is_one_function_in_its_order() -> None:
    listed = [int(n) for n in re.findall(r"^(\d+)\. \*\*", rules_section(), re.MULTILINE)]
    assert listed == list(range(1, len(_RULES) + 1))
    for n, rule in enumerate(_RULES, start=1):
        assert (rule.__doc__ or "").startswith(f"{n}. "), rule.__name__
    assert set(rule_numbers().values()) <= set(listed)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_base_models_commands_follow_the_rule_order(data: st.DataObject) -> None:
    draw = data.draw
    registry: dict[str, AdapterView] = {
        a: draw(adapter_views(a)) for a in draw(st.sets(st.sampled_from(ADAPTERS)))
    }
    scores: dict[str, ScoreState] = {
        key: draw(score_states(NOW)) for key in draw(st.sets(st.sampled_from(score_keys(registry))))
    }
    workers: dict[str, WorkerState] = draw(fleet_states(registry, {}, NOW))
    scheduled = {a: 1.0 for a in draw(st.sets(st.sampled_from(ADAPTERS), max_size=2))}
    result = plan(
        list(registry.values()),
        scores,
        list(workers.values()),
        draw(st.sampled_from(POLICIES)),
        NOW,
        scheduled=scheduled,
    )
    number = rule_numbers()
    bases = [
        (base, [number[c.reason.rule] for c in cmds])
        for base, cmds in groupby(result.commands, key=lambda c: c.base_model)
    ]
    assert len({base for base, _ in bases}) == len(bases)  # one base model at a time
    for _, numbers in bases:
        assert numbers == sorted(numbers)
