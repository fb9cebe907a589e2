"""What each load-test scenario (and the demo) must show, as pure pass/fail checks over the
rows ClickHouse recorded and the summary computed from them. No I/O, no clock.

A check never passes vacuously where that would hide a broken run: "the target became
hot" needs a load, "interactive p99 within budget" needs interactive requests, and "no
unsigned load" also needs the registry's dead letter that proves the event was rejected.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from loraplane.demo.measure import Recorded
from loraplane.demo.results import Summary
from loraplane.schemas.reasons import RegistryRejection

__all__ = [
    "EXPECTATIONS",
    "REJECTION_REASONS",
    "Check",
    "Facts",
    "Rule",
    "evaluate",
    "interactive_never_waited",
    "interactive_p99_within_budget",
    "load_failures_recorded",
    "loads_within_budget",
    "no_errors",
    "no_load_after_revoke",
    "no_load_of_targets",
    "no_platinum_cold_start",
    "no_unsigned_load",
    "platinum_kept",
    "rejected_with_reason",
    "revoked_evicted",
    "targets_became_hot",
    "targets_hit_rate",
    "targets_refused",
    "targets_served",
]

REJECTION_REASONS = frozenset(
    {
        RegistryRejection.unknown_key,
        RegistryRejection.bad_signature,
        RegistryRejection.key_publisher_mismatch,
        RegistryRejection.key_revoked,
        RegistryRejection.key_expired,
        RegistryRejection.key_not_yet_valid,
        RegistryRejection.action_out_of_scope,
        RegistryRejection.tenant_out_of_scope,
    }
)
"""Registry dead-letter reasons that mean: not signed by a key trusted for this."""


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class Facts:
    """What the scenario did, so the checks know what to look for."""

    priorities: Mapping[str, str] = field(default_factory=dict)  # adapter_id -> priority
    targets: tuple[str, ...] = ()  # the adapters the scenario is about
    interactive_p99_budget_ms: float = 1000.0
    cold_loads_per_minute: int = 6
    min_hit_rate: float = 0.9
    gone_after: tuple[str, ...] = ()
    """LoRA names the workers' heartbeats listed on a GPU just before the scenario's revoke:
    the rows the measure waits for (their load, then their unload or evict)."""


Rule = Callable[[Recorded, Summary, Facts], Check]


def no_errors(rec: Recorded, s: Summary, f: Facts) -> Check:
    failed = {k: v for k, v in s.client_status.items() if k == 0 or k >= 500}
    return Check(
        "no_errors",
        s.errors == 0 and not failed,
        f"{s.errors} request errors logged; client saw {failed or 'no'} 5xx/no reply",
    )


def interactive_p99_within_budget(rec: Recorded, s: Summary, f: Facts) -> Check:
    stats = next((c for c in s.by_class if c.request_class == "interactive"), None)
    p99 = stats.ttft_p99_ms if stats else None
    return Check(
        "interactive_p99_within_budget",
        p99 is not None and p99 <= f.interactive_p99_budget_ms,
        f"interactive TTFT p99 {_ms(p99)} (budget {f.interactive_p99_budget_ms:g} ms)",
    )


def interactive_never_waited(rec: Recorded, s: Summary, f: Facts) -> Check:
    """A cold adapter never sits on an interactive request's path: it is served by the base
    model (fallback) or told to retry, never held while the adapter loads."""
    waited = [
        r
        for r in rec.requests
        if r.request_class == "interactive" and r.tier in ("cold", "host") and r.status == "ok"
    ]
    return Check(
        "interactive_never_waited_for_a_load",
        not waited,
        f"{len(waited)} interactive requests waited on a cold adapter",
    )


def no_platinum_cold_start(rec: Recorded, s: Summary, f: Facts) -> Check:
    platinum = [
        r
        for r in rec.requests
        if f.priorities.get(r.adapter_id) == "platinum" and r.status != "refused"
    ]
    cold = [r for r in platinum if r.tier != "gpu"]
    return Check(
        "no_platinum_cold_start",
        bool(platinum) and not cold,
        f"{len(cold)} of {len(platinum)} platinum requests arrived with the adapter off the GPU",
    )


def targets_hit_rate(rec: Recorded, s: Summary, f: Facts) -> Check:
    rows = [r for r in rec.requests if r.adapter_id in f.targets]
    hits = sum(r.tier == "gpu" for r in rows)
    rate = hits / len(rows) if rows else 0.0
    return Check(
        "target_hit_rate",
        bool(rows) and rate >= f.min_hit_rate,
        f"{hits}/{len(rows)} target requests hit a GPU copy ({rate:.1%}, "
        f"minimum {f.min_hit_rate:.0%})",
    )


def targets_became_hot(rec: Recorded, s: Summary, f: Facts) -> Check:
    loaded = {c.adapter_id for c in rec.cache if c.kind == "load" and c.adapter_id in f.targets}
    served_hot = {
        r.adapter_id for r in rec.requests if r.tier == "gpu" and r.adapter_id in f.targets
    }
    missing = sorted(set(f.targets) - (loaded & served_hot))
    return Check(
        "targets_became_hot",
        bool(f.targets) and not missing,
        f"{len(f.targets) - len(missing)}/{len(f.targets)} loaded and then served "
        f"from GPU" + (f"; not: {', '.join(missing)}" if missing else ""),
    )


def targets_served(rec: Recorded, s: Summary, f: Facts) -> Check:
    """Every target answered (from a GPU copy or by the base model) although the loads
    they need queue behind the per-worker budget."""
    served = {r.adapter_id for r in rec.requests if r.status == "ok"}
    missing = sorted(set(f.targets) - served)
    hot = {r.adapter_id for r in rec.requests if r.tier == "gpu"} & set(f.targets)
    return Check(
        "every_target_served",
        bool(f.targets) and not missing,
        f"{len(f.targets) - len(missing)}/{len(f.targets)} answered, {len(hot)} of "
        "them from a GPU copy" + (f"; never: {', '.join(missing)}" if missing else ""),
    )


def loads_within_budget(rec: Recorded, s: Summary, f: Facts) -> Check:
    return Check(
        "cold_loads_within_budget",
        s.max_loads_per_minute <= f.cold_loads_per_minute,
        f"at most {s.max_loads_per_minute} loads per worker in any minute "
        f"(budget {f.cold_loads_per_minute})",
    )


def no_unsigned_load(rec: Recorded, s: Summary, f: Facts) -> Check:
    touched = sorted(
        {
            c.adapter_id
            for c in rec.cache
            if c.adapter_id in f.targets and c.kind in ("fetch", "load")
        }
    )
    return Check(
        "no_unsigned_load",
        bool(f.targets) and not touched,
        f"fetched or loaded unsigned adapters: {', '.join(touched) or 'none'}",
    )


def rejected_with_reason(rec: Recorded, s: Summary, f: Facts) -> Check:
    reasons = sorted({d.reason for d in rec.dead_letters if d.reason in REJECTION_REASONS})
    rejected = sum(d.reason in REJECTION_REASONS for d in rec.dead_letters)
    return Check(
        "dead_lettered_with_reason",
        rejected >= len(f.targets) > 0,
        f"{rejected} lifecycle events dead-lettered ({', '.join(reasons) or 'none'}) "
        f"for {len(f.targets)} untrusted publishes",
    )


def targets_refused(rec: Recorded, s: Summary, f: Facts) -> Check:
    """Every request the client sent got a 4xx (the router refuses an adapter its verified
    registry lacks before any worker, so there may be no RequestLog), and no worker served
    a target."""
    sent = sum(s.client_status.values())
    refused = sum(n for status, n in s.client_status.items() if 400 <= status < 500)
    served = [r for r in rec.requests if r.adapter_id in f.targets and r.status == "ok"]
    return Check(
        "requests_for_untrusted_refused",
        sent > 0 and refused == sent and not served,
        f"{refused}/{sent} requests refused (HTTP 4xx), {len(served)} served",
    )


def _revokes(rec: Recorded, f: Facts) -> dict[str, datetime]:
    """When the registry accepted each target's revoke (its audit record)."""
    out: dict[str, datetime] = {}
    for a in rec.audit:
        if a.action == "revoke" and a.decision == "accepted" and a.adapter_id in f.targets:
            out.setdefault(a.adapter_id, a.ts)
    return out


def _resident_at(rec: Recorded, revokes: dict[str, datetime]) -> set[str]:
    """LoRA names whose last GPU event before their adapter's revoke was a load. Rows keep
    whole seconds: a load in the second of the revoke came before it (none may come after:
    ``no_load_after_revoke``), an unload in that second after it (the revoke's own)."""
    last: dict[str, str] = {}
    for c in sorted(rec.cache, key=lambda c: (c.ts, c.kind != "load")):
        at = revokes.get(c.adapter_id)
        if at is None or c.kind not in ("load", "unload"):
            continue
        if c.ts < at or (c.kind == "load" and c.ts == at):
            last[c.lora_name] = c.kind
    return {name for name, kind in last.items() if kind == "load"}


def revoked_evicted(rec: Recorded, s: Summary, f: Facts) -> Check:
    revokes = _revokes(rec, f)
    resident = _resident_at(rec, revokes)
    evicted = {
        c.lora_name
        for c in rec.cache
        if c.kind in ("unload", "evict")
        and c.adapter_id in revokes
        and c.ts >= revokes[c.adapter_id]
    }
    missing = sorted(resident - evicted)
    return Check(
        "revoked_versions_evicted",
        len(revokes) == len(f.targets) > 0 and bool(resident) and not missing,
        f"{len(revokes)}/{len(f.targets)} revokes accepted; "
        f"{len(resident & evicted)}/{len(resident)} revoked versions that were on a "
        "GPU got evicted" + (f"; still: {', '.join(missing)}" if missing else ""),
    )


def no_load_after_revoke(rec: Recorded, s: Summary, f: Facts) -> Check:
    """Strictly after the second the revoke was accepted (rows keep whole seconds)."""
    revokes = _revokes(rec, f)
    late = sorted(
        {
            c.lora_name
            for c in rec.cache
            if c.kind == "load" and c.adapter_id in revokes and c.ts > revokes[c.adapter_id]
        }
    )
    return Check(
        "no_load_after_revoke",
        bool(revokes) and not late,
        f"loads of revoked versions after their revoke: {', '.join(late) or 'none'}",
    )


def platinum_kept(rec: Recorded, s: Summary, f: Facts) -> Check:
    platinum = {a for a, p in f.priorities.items() if p == "platinum"}
    dropped = sorted(
        {
            c.lora_name
            for c in rec.cache
            if c.adapter_id in platinum and c.kind in ("unload", "evict")
        }
    )
    return Check(
        "platinum_never_evicted",
        bool(platinum) and not dropped,
        f"platinum copies evicted: {', '.join(dropped) or 'none'}",
    )


def load_failures_recorded(rec: Recorded, s: Summary, f: Facts) -> Check:
    fails = [c for c in rec.cache if c.adapter_id in f.targets and c.kind in ("fail", "refuse")]
    reasons = sorted({c.reason for c in fails})
    return Check(
        "load_failures_recorded_with_reason",
        bool(fails) and all(reasons),
        f"{len(fails)} failed fetches/loads ({', '.join(reasons) or 'no reason'})",
    )


def no_load_of_targets(rec: Recorded, s: Summary, f: Facts) -> Check:
    loaded = sorted(
        {c.adapter_id for c in rec.cache if c.kind == "load" and c.adapter_id in f.targets}
    )
    return Check(
        "nothing_loaded_without_its_artifact",
        not loaded,
        f"loaded while the store was down: {', '.join(loaded) or 'none'}",
    )


def _ms(value: float | None) -> str:
    return "n/a (no samples)" if value is None else f"{value:.1f} ms"


EXPECTATIONS: dict[str, tuple[Rule, ...]] = {
    "hot-adapter": (targets_hit_rate, no_errors, interactive_p99_within_budget),
    "cold-adapter": (targets_became_hot, interactive_never_waited, no_errors),
    "burst-loading": (targets_served, loads_within_budget, interactive_never_waited, no_errors),
    "bulk-eviction": (revoked_evicted, no_load_after_revoke, platinum_kept, no_errors),
    "artifact-store-unavailable": (
        load_failures_recorded,
        no_load_of_targets,
        interactive_never_waited,
        no_errors,
    ),
    "signature-failure": (no_unsigned_load, rejected_with_reason, targets_refused),
    "demo": (no_platinum_cold_start, interactive_never_waited, no_errors),
}


def evaluate(scenario: str, recorded: Recorded, summary: Summary, facts: Facts) -> list[Check]:
    return [rule(recorded, summary, facts) for rule in EXPECTATIONS[scenario]]
