"""The seed's policy text parses exactly as written, and bad text fails loudly."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from loraplane.kernel.policy import SCORE_TERMS, Policy, PolicyError, parse_condition, parse_formula

SEED_YAML = """
gpu_slots_per_base_model: 64
host_slots_per_base_model: 2048
eviction_policy: "weighted-lru"
hot_score_formula: |
  0.45 * qps_10m +
  0.25 * ttft_penalty_if_cold +
  0.20 * tenant_priority +
  0.10 * scheduled_warmup_score
never_evict_when:
  - status == "canary" and canary_percent > 0
  - tenant_priority == "platinum"
demote_when:
  - no_request_for_minutes > 60
  - error_rate_after_load > 0.02
"""


def test_seed_policy_parses_verbatim() -> None:
    import yaml

    policy = Policy.model_validate(yaml.safe_load(SEED_YAML))
    assert policy.weights == {
        "qps_10m": 0.45,
        "ttft_penalty_if_cold": 0.25,
        "tenant_priority": 0.20,
        "scheduled_warmup_score": 0.10,
    }
    canary, platinum = policy.never_evict
    assert canary.holds({"status": "canary", "canary_percent": 10})
    assert not canary.holds({"status": "canary", "canary_percent": 0})
    assert not canary.holds({"status": "active", "canary_percent": 10})
    assert platinum.holds({"tenant_priority": "platinum"})
    idle, errors = policy.demote
    assert idle.holds({"no_request_for_minutes": 61}) and not idle.holds(
        {"no_request_for_minutes": 60}
    )
    assert errors.holds({"error_rate_after_load": 0.03})
    assert not errors.holds({}), "a missing fact never triggers a rule"


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "0.5 * qps",
        "qps_10m",
        "0.5 * qps_10m + 0.1 * qps_10m",
        "0.5 * qps_10m; import os",
        "-1 * qps_10m",
    ],
)
def test_bad_formulas_are_rejected_with_a_message(bad: str) -> None:
    with pytest.raises(PolicyError):
        parse_formula(bad)
    with pytest.raises(ValidationError, match="hot_score_formula"):
        Policy(hot_score_formula=bad)


@pytest.mark.parametrize(
    "bad",
    [
        "status = canary",
        "foo > 1",
        "status == ",
        "__import__ > 1",
        "canary_percent > 1 or status == x",
    ],
)
def test_bad_conditions_are_rejected(bad: str) -> None:
    with pytest.raises(PolicyError):
        parse_condition(bad)


@given(
    st.dictionaries(
        st.sampled_from(SCORE_TERMS), st.decimals(min_value=0, max_value=100, places=3), min_size=1
    )
)
def test_formula_round_trips(weights: dict) -> None:
    text = " + ".join(f"{w} * {name}" for name, w in weights.items())
    assert parse_formula(text) == {k: float(v) for k, v in weights.items()}


@given(st.text(max_size=60))
def test_formula_parser_only_raises_policy_error(text: str) -> None:
    with contextlib.suppress(PolicyError):
        parse_formula(text)


@given(st.text(max_size=60))
def test_condition_parser_only_raises_policy_error(text: str) -> None:
    with contextlib.suppress(PolicyError):
        parse_condition(text)


@pytest.mark.parametrize(
    "field",
    [
        {"tenant_priority_values": {"gold": float("nan")}},
        {"tenant_priority_values": {"gold": float("inf")}},
        {"tenant_priority_values": {"gold": -5.0}},
        {"tenant_priority_values": {"gold": 1e308}},
        {"normalisation": {"qps_10m": float("inf")}},
        {"normalisation": {"weighted_demand": 1e308}},
        {"ttft_penalty_prior_ms": float("inf")},
    ],
)
def test_attack_a_policy_number_that_is_not_finite_or_out_of_range_is_refused(
    field: dict[str, object],
) -> None:
    """ATTACK: a settings file's policy with a NaN, an inf, a negative or a 1e308 priority
    value or reference was taken: every priority-weighted score the planner ranks became
    NaN (which sorts anywhere) or inf, and a negative priority ranked a tenant below none."""
    with pytest.raises(ValidationError):
        Policy.model_validate(field)


@given(st.floats(min_value=0, max_value=1e6), st.floats(min_value=1e-9, max_value=1e9))
def test_a_finite_policy_in_range_is_taken(priority: float, reference: float) -> None:
    policy = Policy.model_validate(
        {"tenant_priority_values": {"gold": priority}, "normalisation": {"qps_10m": reference}}
    )
    assert policy.tenant_priority_values["gold"] == priority
