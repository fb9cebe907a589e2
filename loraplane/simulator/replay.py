"""Replay your own traffic: request-log rows and worker states -> the simulator's workload
and fleet, so "what if we had 2 more workers / 16 slots / this policy" is asked about the
requests the fleet really served (``loraplane simulate --from-clickhouse``).

Pure conversion, no I/O: the command reads the rows (``metrics.queries.request_arrivals``),
the worker states and the registry, and hands them here. The result is a function of its
inputs only, whatever their order (rows are sorted on every field, groups by name), so a
replay is deterministic per seed like every other run (the seed only reaches the scenario;
nothing here draws at random). Each row becomes one request of a catalog entry per (base
model, adapter, version), sized and owned as the registry says, else as a worker reported
holding it, else at the pool's largest rank; each base model becomes a pool of the workers
seen in its rows and states. The rules: docs/simulator.md, "Replay your own traffic".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple

from loraplane.schemas.base import version_key
from loraplane.schemas.registry import AdapterView
from loraplane.schemas.worker_state import WorkerState
from loraplane.simulator.catalog import Adapter, Catalog
from loraplane.simulator.requests import Requests
from loraplane.simulator.scenario import (
    MAX_COUNT,
    MAX_REQUESTS,
    PRIORITIES,
    BaseModelFleet,
    Fleet,
    PriorityName,
    Scenario,
    Workload,
)

__all__ = [
    "NO_VERSION",
    "AdapterFacts",
    "FactsKey",
    "Replay",
    "RequestRow",
    "WhatIf",
    "WorkerFacts",
    "adapter_facts",
    "build",
    "check_rows",
    "row_of",
    "worker_facts",
]

NO_VERSION = "0"


class RequestRow(NamedTuple):
    """One request_log row, the fields a replay uses (``ts``: unix seconds). A tuple: a day
    of rows sorts on all fields at C speed."""

    ts: float
    base_model: str
    adapter_id: str
    adapter_version: str
    tenant_id: str
    worker_id: str
    request_class: str
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class AdapterFacts:
    """What the registry (or a worker holding it) says about one adapter version."""

    rank: int
    size_bytes: float = 0.0  # 0: unknown, rank x the scenario's bytes per rank
    priority: PriorityName | None = None
    tenant_id: str | None = None
    active: bool = False  # the registry's active version of its adapter
    canary_percent: float | None = None


@dataclass(frozen=True)
class WorkerFacts:
    """The fields of a worker's last state that size its pool."""

    worker_id: str
    base_model: str
    gpu_slots_total: int
    host_bytes_budget: int
    max_lora_rank: int


@dataclass(frozen=True)
class WhatIf:
    """The operator's question, applied to every pool."""

    workers: int | None = None  # exactly this many workers per pool
    add_workers: int = 0  # this many more than seen
    gpu_slots: int | None = None  # GPU LoRA slots per worker


@dataclass(frozen=True)
class Replay:
    scenario: Scenario
    catalog: Catalog
    requests: Requests
    summary: dict[str, object] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


FactsKey = tuple[str, str, str]  # (base_model, adapter_id, version)


def worker_facts(states: Iterable[WorkerState]) -> list[WorkerFacts]:
    return [
        WorkerFacts(
            s.worker_id, s.base_model, s.gpu_slots_total, s.host_bytes_budget, s.max_lora_rank
        )
        for s in states
    ]


def adapter_facts(
    views: Iterable[AdapterView],
    states: Iterable[WorkerState],
) -> dict[FactsKey, AdapterFacts]:
    """Every version the registry knows (its record: rank, size, priority, owner, status),
    and the rank and size of versions it does not know but a worker reported holding."""
    out: dict[FactsKey, AdapterFacts] = {}
    for s in states:
        for a in s.adapters:
            if a.rank:
                out[(s.base_model, a.adapter_id, a.version)] = AdapterFacts(
                    a.rank, float(a.size_bytes), tenant_id=a.tenant_id
                )
    for view in views:
        for r in view.versions:
            out[(view.base_model, view.adapter_id, r.version)] = AdapterFacts(
                r.rank,
                float(r.size_bytes),
                _PRIORITY[r.priority.value],
                view.tenant_id,
                active=r.version == view.active_version,
                canary_percent=r.release.canary_percent if r.status == "canary" else None,
            )
    return out


def _version(text: str) -> str:
    return text or NO_VERSION


def check_rows(count: int) -> None:
    """ValueError when ``count`` request rows are more than a replay holds (the simulator's
    ``MAX_REQUESTS`` arrivals): the reader asks before it reads, so such a window is never
    held in memory only to be refused."""
    if count > MAX_REQUESTS:
        raise ValueError(
            f"the window holds {count} request rows, more than a replay holds "
            f"({MAX_REQUESTS}): give a shorter --since"
        )


def _check_names(
    rows: Sequence[RequestRow], workers: Sequence[WorkerFacts], what_if: WhatIf
) -> None:
    """ValueError naming the first of base models (pools), adapter versions (catalog entries),
    tenants or one pool's workers that the rows name more of than the simulator holds
    (``MAX_COUNT`` each: it builds an object a unit); a writer of the requests topic chooses
    every id, and a tenant every refused request's adapter id, so this is asked before any
    catalog or fleet is built from them. A pool's workers are counted as ``_fleet`` counts
    them: those the rows name and those with a worker state (a writer of the worker-state
    topic chooses those ids)."""
    pools: dict[str, set[str]] = {}
    for r in rows:
        pools.setdefault(r.base_model, set()).add(r.worker_id)
    for w in workers:
        if w.base_model in pools:
            pools[w.base_model].add(w.worker_id)
    counts = {
        "base models": len(pools),
        "adapter versions": len({(r.base_model, r.adapter_id, r.adapter_version) for r in rows}),
        "tenants": len({r.tenant_id for r in rows}),
    }
    if what_if.workers is None:
        counts["workers of one base model"] = max(map(len, pools.values())) + what_if.add_workers
    for what, count in counts.items():
        if count > MAX_COUNT:
            raise ValueError(
                f"the window's request rows (and worker states) name {count} {what}, more "
                f"than a replay holds ({MAX_COUNT}): give a shorter --since"
            )


def build(
    rows: Iterable[RequestRow],
    workers: Sequence[WorkerFacts],
    facts: dict[FactsKey, AdapterFacts],
    base: Scenario,
    what_if: WhatIf = WhatIf(),
) -> Replay:
    """The scenario (``base`` with this fleet), catalog and request stream of the rows."""
    ordered = sorted(rows)
    if not ordered:
        raise ValueError("no request rows to replay")
    check_rows(len(ordered))
    _check_names(ordered, workers, what_if)
    notes: list[str] = []
    pools = sorted({r.base_model for r in ordered})
    pool_index = {name: i for i, name in enumerate(pools)}
    fleet = _fleet(ordered, workers, pools, base, what_if, notes)
    max_rank = {
        b.name: r for b, r in zip(fleet.base_models, _max_ranks(pools, workers, base), strict=True)
    }
    # Versions equal by version_key are one entry, named by their smallest spelling.
    named = {(r.base_model, r.adapter_id, r.adapter_version) for r in ordered}
    spelled: dict[tuple[str, str, tuple[int, ...]], str] = {}
    for bm, aid, v in named:
        k = (bm, aid, version_key(_version(v)))
        spelled[k] = min(spelled.get(k, _version(v)), _version(v))
    entry = {
        (bm, aid, v): (bm, aid, spelled[(bm, aid, version_key(_version(v)))])
        for bm, aid, v in named
    }
    keys = [entry[(r.base_model, r.adapter_id, r.adapter_version)] for r in ordered]
    demand: Counter[FactsKey] = Counter(keys)
    tenants: dict[tuple[str, str], Counter[str]] = {}
    for (bm, aid, tenant), n in Counter(
        (r.base_model, r.adapter_id, r.tenant_id) for r in ordered
    ).items():
        tenants.setdefault((bm, aid), Counter())[tenant] = n
    catalog, index = _catalog(demand, tenants, facts, pool_index, max_rank, base)
    start = ordered[0].ts
    requests = Requests(
        [r.ts - start for r in ordered],
        [index[k] for k in keys],
        [max(1, r.output_tokens) for r in ordered],
        [r.request_class == "batch" for r in ordered],
    )
    n_tenants = len({r.tenant_id for r in ordered})
    # The report's workload says what was replayed (no bursts, peaks or canaries to draw);
    # the base's per-policy deployments and seed rows describe another fleet than this one.
    scenario = base.model_copy(
        update={
            "fleet": fleet,
            "workload": Workload(
                requests=len(ordered), adapters=max(1, catalog.regular), tenants=n_tenants
            ),
            "overrides": {},
            "seed_reference": {},
        }
    )
    unknown = sum(1 for k in demand if k not in facts)
    if unknown:
        notes.append(
            f"{unknown} of {len(demand)} adapter versions not in the registry or a "
            "worker state: sized at their pool's max LoRA rank, default priority"
        )
    summary: dict[str, object] = {
        "rows": len(ordered),
        "span_s": round(ordered[-1].ts - start, 3),
        "adapter_versions": len(catalog),
        "tenants": n_tenants,
        "batch": sum(requests.batch),
        "prompt_tokens": sum(r.prompt_tokens for r in ordered),
        "output_tokens": sum(r.output_tokens for r in ordered),
        "pools": {
            b.name: {
                "workers": b.workers,
                "gpu_slots_per_worker": b.gpu_slots_per_worker,
                "host_bytes_per_worker": b.host_bytes_per_worker,
            }
            for b in fleet.base_models
        },
    }
    return Replay(scenario, catalog, requests, summary, tuple(notes))


def _max_ranks(pools: list[str], workers: Sequence[WorkerFacts], base: Scenario) -> list[int]:
    default = max(base.workload.ranks)
    ranks: dict[str, int] = {}
    for w in workers:
        ranks[w.base_model] = max(ranks.get(w.base_model, w.max_lora_rank), w.max_lora_rank)
    return [ranks.get(p, default) for p in pools]


def _fleet(
    rows: list[RequestRow],
    workers: Sequence[WorkerFacts],
    pools: list[str],
    base: Scenario,
    what_if: WhatIf,
    notes: list[str],
) -> Fleet:
    template = base.fleet.base_models[0] if base.fleet.base_models else BaseModelFleet()
    specs = []
    by_pool: dict[str, list[WorkerFacts]] = {}
    for w in workers:
        by_pool.setdefault(w.base_model, []).append(w)
    in_rows: dict[str, set[str]] = {}
    for r in rows:
        in_rows.setdefault(r.base_model, set()).add(r.worker_id)
    for name in pools:
        states = by_pool.get(name, [])
        seen = in_rows.get(name, set()) | {w.worker_id for w in states}
        count = what_if.workers if what_if.workers is not None else max(1, len(seen))
        update: dict[str, object] = {
            "name": name,
            "share": 1.0,
            "workers": count + what_if.add_workers,
        }
        slots = max((w.gpu_slots_total for w in states), default=0)
        host = max((w.host_bytes_budget for w in states), default=0)
        if slots:
            update["gpu_slots_per_worker"] = slots
        if host:
            update["host_bytes_per_worker"] = float(host)
        if not states:
            notes.append(
                f"{name}: no worker state; slots and host budget are the scenario's "
                f"({template.gpu_slots_per_worker} slots per worker)"
            )
        if what_if.gpu_slots is not None:
            update["gpu_slots_per_worker"] = what_if.gpu_slots
        specs.append(BaseModelFleet.model_validate({**template.model_dump(), **update}))
    return base.fleet.model_copy(update={"base_models": specs})


def _catalog(
    demand: Counter[FactsKey],
    tenants: dict[tuple[str, str], Counter[str]],
    facts: dict[FactsKey, AdapterFacts],
    pool_index: dict[str, int],
    max_rank: dict[str, int],
    base: Scenario,
) -> tuple[Catalog, dict[FactsKey, int]]:
    """Adapters most requested first, each adapter's versions together in version order."""
    per_adapter: dict[tuple[str, str], list[str]] = {}
    for bm, aid, v in demand:
        per_adapter.setdefault((bm, aid), []).append(v)
    total = {k: sum(demand[(*k, v)] for v in vs) for k, vs in per_adapter.items()}
    bytes_per_rank = base.fleet.costs.adapter_bytes_per_rank
    adapters: list[Adapter] = []
    index: dict[FactsKey, int] = {}
    for bm, aid in sorted(per_adapter, key=lambda k: (-total[k], k)):
        versions = sorted(per_adapter[(bm, aid)], key=version_key)
        known = [v for v in versions if facts.get((bm, aid, v), _NONE).active]
        stable = (
            known[0]
            if known
            else max(versions, key=lambda v: (demand[(bm, aid, v)], version_key(v)))
        )
        stable_at = len(adapters) + versions.index(stable)
        owner = next(
            (f.tenant_id for v in versions if (f := facts.get((bm, aid, v))) and f.tenant_id), None
        )
        tenant = owner or min(tenants[(bm, aid)].items(), key=lambda kv: (-kv[1], kv[0]))[0]
        for v in versions:
            f = facts.get((bm, aid, v))
            rank = f.rank if f else max_rank[bm]
            canary = v != stable
            percent = (
                (
                    f.canary_percent
                    if f and f.canary_percent is not None
                    else 100.0 * demand[(bm, aid, v)] / total[(bm, aid)]
                )
                if canary
                else 0.0
            )
            priority = f.priority if f and f.priority else _DEFAULT_PRIORITY
            index[(bm, aid, v)] = len(adapters)
            adapters.append(
                Adapter(
                    index=len(adapters),
                    adapter_id=aid,
                    version=v,
                    base_model=pool_index[bm],
                    tenant=tenant,
                    priority=priority,
                    rank=rank,
                    size_bytes=f.size_bytes if f and f.size_bytes else rank * bytes_per_rank,
                    canary_percent=percent,
                    stable_of=stable_at if canary else None,
                )
            )
    regular = sum(1 for a in adapters if not a.is_canary)
    return Catalog(tuple(adapters), regular, {}), index


_DEFAULT_PRIORITY: PriorityName = "silver"  # the registry's default (schemas.adapter)
_NONE = AdapterFacts(rank=1)
_PRIORITY: dict[str, PriorityName] = {p: p for p in PRIORITIES}


def row_of(values: Sequence[Any]) -> RequestRow:
    """One ``metrics.queries.request_arrivals`` row (its ``ARRIVAL_COLUMNS``); a naive
    ``ts`` is UTC (the table's time zone; the driver drops it on some versions)."""
    ts, bm, aid, version, tenant, worker, cls, prompt, output = values
    if not isinstance(ts, datetime):
        raise ValueError(f"request row without a timestamp: {values!r}")
    stamp = (ts if ts.tzinfo else ts.replace(tzinfo=UTC)).timestamp()
    return RequestRow(
        stamp,
        str(bm),
        str(aid),
        str(version),
        str(tenant),
        str(worker),
        str(cls),
        int(prompt),
        int(output),
    )
