"""The pure side of the load tests: summary numbers and each scenario's pass/fail checks."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from loraplane.demo.expectations import EXPECTATIONS, Facts, evaluate
from loraplane.demo.measure import AuditRow, CacheRow, DeadLetterRow, Recorded, RequestRow
from loraplane.demo.results import max_loads_per_minute, quantile_exact, summarize

T0 = datetime(2026, 11, 29, 8, 0, tzinfo=UTC)


def req(
    adapter: str = "a",
    *,
    cls: str = "interactive",
    tier: str = "gpu",
    status: str = "ok",
    error: str = "",
    ttft: float | None = 50.0,
) -> RequestRow:
    return RequestRow(adapter, "1", "w1", cls, tier, status, error, ttft, 0.0)


def ev(
    kind: str,
    adapter: str = "a",
    *,
    at_s: float = 0.0,
    worker: str = "w1",
    reason: str = "",
    swap: float = 5.0,
) -> CacheRow:
    return CacheRow(
        T0 + timedelta(seconds=at_s),
        worker,
        adapter,
        "1",
        f"{adapter}@1-00000000",
        kind,
        swap,
        reason,
        "",
    )


def rec(
    requests: list[RequestRow] = (),
    cache: list[CacheRow] = (),
    dead: list[DeadLetterRow] = (),
    audit: list[AuditRow] = (),
) -> Recorded:
    return Recorded(list(requests), list(cache), list(dead), list(audit))


def revoke(adapter: str, at_s: float, decision: str = "accepted") -> AuditRow:
    return AuditRow(T0 + timedelta(seconds=at_s), "revoke", adapter, decision)


def checks(
    scenario: str, r: Recorded, facts: Facts, status: dict[int, int] | None = None
) -> dict[str, bool]:
    return {c.name: c.passed for c in evaluate(scenario, r, summarize(r, status), facts)}


# -- numbers ------------------------------------------------------------------------------


@given(
    st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=200),
    st.floats(0, 1, exclude_max=True),
)
def test_quantile_is_an_element_with_the_right_rank(values: list[float], q: float) -> None:
    v = quantile_exact(values, q)
    assert v in values
    assert sum(x < v for x in values) <= int(q * len(values)) < sum(x <= v for x in values)


def test_quantile_of_nothing_is_none() -> None:
    assert quantile_exact([], 0.99) is None


@given(st.lists(st.tuples(st.sampled_from(["w1", "w2"]), st.integers(0, 600)), max_size=60))
def test_max_loads_per_minute_matches_a_brute_force_count(loads: list[tuple[str, int]]) -> None:
    rows = [ev("load", worker=w, at_s=t) for w, t in loads]
    brute = max(
        (sum(1 for w2, t2 in loads if w2 == w and t <= t2 < t + 60) for w, t in loads), default=0
    )
    assert max_loads_per_minute(rows) == brute


def test_summary_counts_tiers_classes_and_refusals() -> None:
    r = rec(
        [
            req(tier="gpu", ttft=10),
            req(tier="base_fallback", ttft=20),
            req(cls="batch", tier="cold", ttft=900),
            req(status="refused", error="unknown_adapter", tier="cold", ttft=None),
        ],
        [ev("load", swap=7), ev("fail", reason="artifact_unavailable"), ev("unload")],
        [DeadLetterRow("registry", "unknown_key", "")],
    )
    s = summarize(r, {200: 3, 404: 1})
    assert (s.requests, s.gpu_hits, s.fallbacks, s.cold_loads, s.evictions) == (4, 1, 1, 1, 1)
    assert s.hit_rate == 0.25 and s.swap_p95_ms == 7
    assert {c.request_class: c.requests for c in s.by_class} == {"batch": 1, "interactive": 3}
    assert s.refusals == {
        "request:refused:unknown_adapter": 1,
        "load:fail:artifact_unavailable": 1,
        "registry:unknown_key": 1,
    }
    assert s.to_json()["client_status"] == {"200": 3, "404": 1}


# -- checks --------------------------------------------------------------------------------


def test_every_scenario_has_checks() -> None:
    assert set(EXPECTATIONS) >= {
        "hot-adapter",
        "cold-adapter",
        "burst-loading",
        "bulk-eviction",
        "artifact-store-unavailable",
        "signature-failure",
        "demo",
    }


def test_hot_adapter_needs_hits_and_no_errors() -> None:
    facts = Facts(targets=("a",), min_hit_rate=0.95, interactive_p99_budget_ms=100)
    good = rec([req(ttft=40) for _ in range(20)])
    assert all(checks("hot-adapter", good, facts, {200: 20}).values())
    cold = rec([req(tier="base_fallback")] * 2 + [req()] * 18)
    assert not checks("hot-adapter", cold, facts)["target_hit_rate"]
    slow = rec([req(ttft=40)] * 19 + [req(ttft=500)])
    assert not checks("hot-adapter", slow, facts)["interactive_p99_within_budget"]
    assert not checks("hot-adapter", good, facts, {200: 19, 502: 1})["no_errors"]
    assert not checks("hot-adapter", rec(), facts)["target_hit_rate"]  # never vacuous


def test_cold_adapter_must_not_hold_interactive_requests() -> None:
    facts = Facts(targets=("a",))
    fine = rec(
        [req(tier="base_fallback"), req(cls="batch", tier="cold"), req()], [ev("fetch"), ev("load")]
    )
    assert all(checks("cold-adapter", fine, facts).values())
    held = rec([req(tier="cold"), req()], [ev("load")])
    assert not checks("cold-adapter", held, facts)["interactive_never_waited_for_a_load"]
    never_hot = rec([req(tier="base_fallback")])
    assert not checks("cold-adapter", never_hot, facts)["targets_became_hot"]


def test_burst_loads_stay_within_the_budget() -> None:
    facts = Facts(targets=("a", "b"), cold_loads_per_minute=2)
    r = rec([req("a"), req("b")], [ev("load", "a", at_s=0), ev("load", "b", at_s=59)])
    assert checks("burst-loading", r, facts)["cold_loads_within_budget"]
    r3 = rec(
        [req("a"), req("b")],
        [ev("load", "a", at_s=0), ev("load", "b", at_s=10), ev("load", "a", at_s=20)],
    )
    assert not checks("burst-loading", r3, facts)["cold_loads_within_budget"]
    unserved = rec([req("a"), req("b", status="retry_later", tier="cold", ttft=None)])
    assert not checks("burst-loading", unserved, facts)["every_target_served"]


def test_bulk_eviction_checks_residents_at_each_revoke() -> None:
    facts = Facts(priorities={"p": "platinum", "a": "silver", "b": "silver"}, targets=("a", "b"))
    revokes = [revoke("a", 30), revoke("b", 35)]
    good = rec(
        [req("p")],
        [
            ev("load", "p"),
            ev("load", "a", at_s=1),
            ev("load", "b", at_s=2),
            ev("unload", "b", at_s=3),
            ev("load", "a", at_s=30),  # same second as its revoke: racing
            ev("unload", "a", at_s=31),
        ],
        audit=revokes,
    )
    assert all(checks("bulk-eviction", good, facts).values())  # b was gone already
    kept = rec([req("p")], [ev("load", "p"), ev("load", "a", at_s=1)], audit=revokes)
    assert not checks("bulk-eviction", kept, facts)["revoked_versions_evicted"]
    reloaded = rec(
        [req("p")],
        [ev("load", "a", at_s=1), ev("unload", "a", at_s=31), ev("load", "a", at_s=40)],
        audit=revokes,
    )
    assert not checks("bulk-eviction", reloaded, facts)["no_load_after_revoke"]
    lost = rec(
        [req("p")],
        [ev("load", "a", at_s=1), ev("unload", "a", at_s=31), ev("unload", "p", at_s=32)],
        audit=revokes,
    )
    assert not checks("bulk-eviction", lost, facts)["platinum_never_evicted"]
    same_second = rec(
        [req("p")],
        [ev("load", "p"), ev("load", "b", at_s=35), ev("unload", "b", at_s=35)],
        audit=revokes,
    )
    # b's only load and its unload share the second of its revoke: it was on a GPU then
    assert all(checks("bulk-eviction", same_second, facts).values())
    kept_past = rec([req("p")], [ev("load", "p"), ev("load", "b", at_s=35)], audit=revokes)
    assert not checks("bulk-eviction", kept_past, facts)["revoked_versions_evicted"]
    rejected = rec(
        [req("p")],
        [ev("load", "a", at_s=1), ev("unload", "a", at_s=31)],
        audit=[revoke("a", 30, "rejected"), revoke("b", 35)],
    )
    assert not checks("bulk-eviction", rejected, facts)["revoked_versions_evicted"]


def test_store_down_needs_reasoned_failures_and_no_load() -> None:
    facts = Facts(targets=("c",))
    good = rec(
        [req("c", tier="base_fallback"), req("s")], [ev("fail", "c", reason="artifact_unavailable")]
    )
    assert all(checks("artifact-store-unavailable", good, facts).values())
    silent = rec([req("c", tier="base_fallback")], [ev("fail", "c", reason="")])
    assert not checks("artifact-store-unavailable", silent, facts)[
        "load_failures_recorded_with_reason"
    ]
    loaded = rec([req("c")], [ev("fail", "c", reason="x"), ev("load", "c")])
    assert not checks("artifact-store-unavailable", loaded, facts)[
        "nothing_loaded_without_its_artifact"
    ]


def test_signature_failure_needs_dead_letters_and_no_load() -> None:
    facts = Facts(targets=("u", "w"))
    refused = [
        req("u", status="refused", error="unknown_adapter", tier="cold", ttft=None),
        req("w", status="refused", error="unknown_adapter", tier="cold", ttft=None),
    ]
    dead = [
        DeadLetterRow("registry", "unknown_key", ""),
        DeadLetterRow("registry", "tenant_out_of_scope", ""),
    ]
    at_router = {404: 6}  # the router refused them all before any worker: no RequestLog
    assert all(checks("signature-failure", rec([], [], dead), facts, at_router).values())
    assert all(checks("signature-failure", rec(refused, [], dead), facts, {404: 2}).values())
    assert not checks("signature-failure", rec([], [ev("fetch", "u")], dead), facts, at_router)[
        "no_unsigned_load"
    ]
    assert not checks("signature-failure", rec([], [], dead[:1]), facts, at_router)[
        "dead_lettered_with_reason"
    ]
    assert not checks("signature-failure", rec([req("u")], [], dead), facts, {200: 1})[
        "requests_for_untrusted_refused"
    ]
    assert not checks("signature-failure", rec([], [], dead), facts, {404: 5, 503: 1})[
        "requests_for_untrusted_refused"
    ]
    assert not checks("signature-failure", rec([], [], dead), facts, {})[
        "requests_for_untrusted_refused"
    ]  # nothing sent proves nothing


def test_demo_flags_a_platinum_cold_start() -> None:
    facts = Facts(priorities={"p": "platinum", "g": "gold"})
    assert checks("demo", rec([req("p"), req("g", tier="base_fallback")]), facts)[
        "no_platinum_cold_start"
    ]
    assert not checks("demo", rec([req("p", tier="base_fallback")]), facts)[
        "no_platinum_cold_start"
    ]
