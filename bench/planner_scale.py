"""Planner scale: wall time of one planning tick of ``streams.planner`` for N adapters over W
workers, against sorting the same N hot scores (the least any planner that ranks adapters
must do).

The fleet: 10 base models, adapters and workers spread evenly over them, 16 GPU slots per
worker and a per-base-model GPU budget that fills every slot (the worst case: the hot set is
as large as the fleet). Demand is Zipf-like (qps 50/rank, every adapter requested in the
last minute, so every one is a candidate), 1% platinum (never evicted, pinned). Two ticks
are timed for each size:

* ``cold``: the first tick of a fresh planner on an empty fleet, as the planner runtime runs
  it after it starts or takes over: its registry and score columns were built while it read
  the topics (``Planner.prime``, timed apart as ``prime_ms``: the work moved out of the
  tick), and 1% of the score states changed since. It ranks everything, fills the load
  budget of every worker and prewarms the host tier up to
  ``host_prewarms_in_flight_per_worker`` per worker. Beside it: ``unprimed_ms``, the same
  tick with nothing kept (``plan``: every column derived in the tick, columns and planning
  together); ``cold_commands`` against ``cold_commands_unbounded`` (no in-flight bound on
  prewarms); ``ticks_to_host_tier``: how many ticks (one second apart, each worker
  showing every command of the last tick as done) issue prewarms, the first one included,
  before one issues none: the host tier is then planned;
* ``steady``: the tick the planner agent runs every second. One ``Planner`` that already
  planned this fleet once (as the agent's has), the fleet holding what the planner converges
  to (the placement one tick would reach with no cold-load budget: hot set on GPU, pinned
  where protected, host tier full), and before each timed tick: ``now`` one second later,
  1% of the score states (random versions) replaced by new ones that count one more
  request (``streams.scores.observe``) in a fresh copy of the score dict, handed over with
  those keys as the planner runtime's score view does (``ScoreView.take()``: ``changed``);
  registry and worker states
  unchanged; the planner memory of the previous tick carried over (as the runtime's memory
  is). The new requests now and then lift a version past a resident, so a tick may issue a few
  commands (``steady_commands``: those of the last tick).

Inputs are built once, outside the timed part; each tick is timed ``--reps`` times. The
garbage collector is frozen after the inputs are built (``gc.freeze``), and again once a
planner is primed (cold) or warmed (steady), as the planner runtime primes its planner
before it freezes what its first read loaded: a collection over 100k live score states
otherwise adds up to a second to an unlucky tick, and one over a planner's 100k-row
columns ~40-70 ms. Within a tick or a priming the planner holds the collector off itself
(``kernel.collector.held_off``); what the tick leaves is walked by the first collection
after it, which may fall at the tick's end.

    .venv/bin/python -m bench.planner_scale                    # 1k/10k/100k x 10/100/1000
    .venv/bin/python -m bench.planner_scale --adapters 1000 --workers 10 --reps 3
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import math
import os
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from bench.report import Row, Summary, emit, parse_args
from loraplane.kernel.command_effects import Copy, copy_at, effect
from loraplane.kernel.decayed import Decayed
from loraplane.kernel.policy import Policy
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus, Compatibility, Priority
from loraplane.schemas.commands import CacheCommand, CommandAction
from loraplane.schemas.registry import AdapterView
from loraplane.schemas.request_log import RequestStatus, Tier
from loraplane.schemas.worker_state import LoadedAdapter, WorkerState
from loraplane.streams.planner import Plan, Planner, plan
from loraplane.streams.scores import TAU_1M_S, TAU_10M_S, ScoreState, observe, score_key

NOW = 1_800_000_000.0
CHANGED_SHARE = 0.01  # of the score states replaced between two steady ticks
BASES = 10
SLOTS = 16
HOST_PER_WORKER = 64
MB = 1024**2
GOAL_OVER_SORT = 5.0  # the steady tick, against sorting the same scores
GOAL_COLD_MS = 500.0


def registry(n: int) -> tuple[list[AdapterView], dict[str, ScoreState], list[AdapterRecord]]:
    """``n`` adapters, one active version each, in rank order of demand."""
    at = datetime.fromtimestamp(NOW, UTC)
    views, scores, records = [], {}, []
    for i in range(n):
        adapter = f"a{i:06d}"
        sha = hashlib.sha256(adapter.encode()).hexdigest()
        priority = Priority.platinum if i % 100 == 7 else list(Priority)[i % 3]
        r = AdapterRecord(
            adapter_id=adapter,
            base_model=f"base{i % BASES}",
            version="1",
            rank=16,
            artifact_uri=f"s3://loraplane-artifacts/{adapter}/1-{sha[:8]}/",
            sha256=sha,
            size_bytes=32 * MB,
            status=AdapterStatus.active,
            tenant_id=f"t{i % 97}",
            priority=priority,
            compatibility=Compatibility(target_modules=["q_proj", "v_proj"], max_lora_rank=64),
        )
        views.append(
            AdapterView(
                adapter_id=adapter,
                tenant_id=r.tenant_id,
                base_model=r.base_model,
                active_version="1",
                versions=[r],
                last_seq=1,
                last_event_id=f"e{i}",
                updated_at=at,
            )
        )
        qps = 50.0 / (i + 1)
        scores[score_key(adapter, "1")] = ScoreState(
            requests_10m=Decayed(TAU_10M_S, qps * TAU_10M_S, NOW - 5),
            requests_1m=Decayed(TAU_1M_S, qps * TAU_1M_S, NOW - 5),
            last_request=NOW - 5,
        )
        records.append(r)
    return views, scores, records


def fleet(workers: int) -> list[WorkerState]:
    """``workers`` empty workers."""
    at = datetime.fromtimestamp(NOW, UTC)
    return [
        WorkerState(
            worker_id=f"w{j:05d}",
            base_model=f"base{j % BASES}",
            ts=at,
            gpu_slots_used=0,
            gpu_slots_total=SLOTS,
            host_bytes_used=0,
            host_bytes_budget=HOST_PER_WORKER * 32 * MB,
            hbm_usage=0.5,
            max_lora_rank=64,
            adapters=[],
        )
        for j in range(workers)
    ]


def converged(
    views: list[AdapterView],
    scores: dict[str, ScoreState],
    records: list[AdapterRecord],
    empty: list[WorkerState],
    policy: Policy,
) -> list[WorkerState]:
    """The workers holding what the planner converges to: the placement of one tick on the
    ``empty`` fleet with no cold-load budget (every hot version loaded at once)."""
    unlimited = policy.model_copy(
        update={
            "cold_loads_per_minute_per_worker": 10_000,
            "host_prewarms_in_flight_per_worker": 10_000,
        }
    )
    result = plan(views, scores, empty, unlimited, NOW)
    by_name = {r.lora_name: r for r in records}
    pinned = {(c.worker_id, c.lora_name) for c in result.commands if c.action is CommandAction.pin}
    held: dict[str, list[LoadedAdapter]] = {w.worker_id: [] for w in empty}
    for tier, placement in (("gpu", result.gpu), ("host", result.host)):
        for lora, holders in placement.items():
            r = by_name[lora]
            for wid in holders:
                held[wid].append(
                    LoadedAdapter(
                        lora_name=lora,
                        adapter_id=r.adapter_id,
                        version=r.version,
                        tenant_id=r.tenant_id,
                        tier=tier,
                        size_bytes=r.size_bytes,
                        pinned=(wid, lora) in pinned,
                    )
                )
    return [
        w.model_copy(
            update={
                "adapters": held[w.worker_id],
                "gpu_slots_used": sum(a.tier == "gpu" for a in held[w.worker_id]),
                "host_bytes_used": sum(a.size_bytes for a in held[w.worker_id]),
            }
        )
        for w in empty
    ]


def reported(
    workers: list[WorkerState], commands: list[CacheCommand], by_name: dict[str, AdapterRecord]
) -> list[WorkerState]:
    """The workers' next states: each showing every command it was sent as done."""
    copies = {
        w.worker_id: {a.lora_name: copy_at(a.tier, a.pinned) for a in w.adapters} for w in workers
    }
    for c in commands:
        held = copies[c.worker_id]
        held[c.lora_name] = effect(c.action, held.get(c.lora_name, Copy())).after
    out = []
    for w in workers:
        adapters = [
            LoadedAdapter(
                lora_name=lora,
                adapter_id=(r := by_name[lora]).adapter_id,
                version=r.version,
                tenant_id=r.tenant_id,
                tier=copy.tier,
                size_bytes=r.size_bytes,
                pinned=copy.pinned,
            )
            for lora, copy in copies[w.worker_id].items()
            if copy.present
        ]
        out.append(
            w.model_copy(
                update={
                    "adapters": adapters,
                    "gpu_slots_used": sum(a.tier == "gpu" for a in adapters),
                    "host_bytes_used": sum(a.size_bytes for a in adapters),
                }
            )
        )
    return out


def cold_ticks(
    views: list[AdapterView],
    scores: dict[str, ScoreState],
    empty: list[WorkerState],
    policy: Policy,
    reps: int,
) -> dict[str, Any]:
    """``reps`` first ticks of a primed planner (and the priming, and an unprimed ``plan``)
    on the empty fleet; then the ticks that follow while they issue prewarms."""
    keys = [score_key(v.adapter_id, "1") for v in views]
    rng = random.Random(11)
    prime_ms, cold_ms, unprimed_ms = [], [], []
    result: Plan | None = None
    planner = Planner()
    for _ in range(reps):
        started = time.perf_counter()
        plan(views, scores, empty, policy, NOW)
        unprimed_ms.append((time.perf_counter() - started) * 1000)
        planner = Planner()
        started = time.perf_counter()
        planner.prime(views, scores)
        prime_ms.append((time.perf_counter() - started) * 1000)
        gc.collect()
        gc.freeze()
        later, changed = with_new_requests(scores, keys, NOW + 1, rng)
        started = time.perf_counter()
        result = planner.tick(views, later, empty, policy, NOW + 1, changed=changed)
        cold_ms.append((time.perf_counter() - started) * 1000)
    assert result is not None
    first = len(result.commands)
    unbounded = policy.model_copy(update={"host_prewarms_in_flight_per_worker": 10_000})
    by_name = {r.lora_name: r for v in views for r in v.versions}
    workers, ticks = empty, 0
    while any(c.action is CommandAction.prewarm_host for c in result.commands):
        ticks += 1
        workers = reported(workers, result.commands, by_name)
        result = planner.tick(
            views, later, workers, policy, NOW + 1 + ticks, result.memory, changed=()
        )
    return {
        "cold_ms": Summary.from_samples(cold_ms).as_dict(),
        "prime_ms": Summary.from_samples(prime_ms).as_dict(),
        "unprimed_ms": Summary.from_samples(unprimed_ms).as_dict(),
        "cold_commands": first,
        "cold_commands_unbounded": len(plan(views, scores, empty, unbounded, NOW).commands),
        "ticks_to_host_tier": ticks,
    }


def timed(fn: Callable[[], Any], reps: int) -> tuple[list[float], Any]:
    samples, result = [], None
    for _ in range(reps):
        started = time.perf_counter()
        result = fn()
        samples.append((time.perf_counter() - started) * 1000)
    return samples, result


def with_new_requests(
    scores: dict[str, ScoreState], keys: list[str], now: float, rng: random.Random
) -> tuple[dict[str, ScoreState], list[str]]:
    """A copy of ``scores`` in which ``CHANGED_SHARE`` of ``keys`` saw one more request,
    and those keys."""
    out = dict(scores)
    changed = rng.sample(keys, max(1, round(CHANGED_SHARE * len(keys))))
    for key in changed:
        out[key] = observe(
            out[key],
            ts=now,
            request_class="interactive",
            tier=Tier.gpu,
            status=RequestStatus.ok,
            ttft_ms=40.0,
        )
    return out, changed


def steady_ticks(
    views: list[AdapterView],
    scores: dict[str, ScoreState],
    workers: list[WorkerState],
    policy: Policy,
    reps: int,
) -> tuple[list[float], Any]:
    """``reps`` ticks of a warmed ``Planner``, one second apart, 1% of the scores new."""
    planner = Planner()
    result = planner.tick(views, scores, workers, policy, NOW)
    gc.collect()
    gc.freeze()
    keys = [score_key(v.adapter_id, "1") for v in views]
    rng = random.Random(7)
    samples = []
    for rep in range(1, reps + 1):
        now = NOW + rep
        scores, changed = with_new_requests(scores, keys, now, rng)
        started = time.perf_counter()
        result = planner.tick(views, scores, workers, policy, now, result.memory, changed=changed)
        samples.append((time.perf_counter() - started) * 1000)
    return samples, result


def run(adapter_counts: list[int], worker_counts: list[int], reps: int) -> dict[str, Any]:
    views_all, scores, records_all = registry(max(adapter_counts))
    cases = []
    for n in adapter_counts:
        views, records = views_all[:n], records_all[:n]
        for w in worker_counts:
            policy = Policy(gpu_slots_per_base_model=SLOTS * math.ceil(w / BASES))
            case: dict[str, Any] = {"adapters": n, "workers": w}
            empty = fleet(w)
            full = converged(views, scores, records, empty, policy)
            gc.collect()
            gc.freeze()
            case.update(cold_ticks(views, scores, empty, policy, reps))
            ms, result = steady_ticks(views, scores, full, policy, reps)
            case["steady_ms"] = Summary.from_samples(ms).as_dict()
            case["steady_commands"] = len(result.commands)
            gc.unfreeze()
            ranked = dict(result.scores)
            sort_ms, _ = timed(lambda r=ranked: sorted(r, key=r.__getitem__, reverse=True), reps)
            case["sort_ms"] = Summary.from_samples(sort_ms).as_dict()
            case["steady_over_sort"] = round(
                case["steady_ms"]["median"] / case["sort_ms"]["median"], 1
            )
            cases.append(case)
    biggest = cases[-1]
    return {
        "unit": "ms per tick",
        "reps": reps,
        "steady": f"warmed Planner, now +1 s, {CHANGED_SHARE:.0%} of score states new and named",
        "cases": cases,
        "growth": growth(cases),
        "goal": f"at {max(adapter_counts)} x {max(worker_counts)}: steady tick <= "
        f"{GOAL_OVER_SORT:g}x a sort, cold tick <= {GOAL_COLD_MS:.0f} ms",
        "goal_met": {
            "steady": biggest["steady_over_sort"] <= GOAL_OVER_SORT,
            "cold": biggest["cold_ms"]["median"] <= GOAL_COLD_MS,
            "cold_unprimed": biggest["unprimed_ms"]["median"] <= GOAL_COLD_MS,
        },
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def growth(cases: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Log-log slope of each tick's time against adapters (at the most workers) and against
    workers (at the most adapters): 1.0 = linear."""

    def slope(points: list[tuple[int, float]]) -> float:
        (x0, y0), (x1, y1) = points[0], points[-1]
        return round(math.log(y1 / y0) / math.log(x1 / x0), 2) if x1 != x0 else 0.0

    top_w = max(c["workers"] for c in cases)
    top_n = max(c["adapters"] for c in cases)
    return {
        tick: {
            "vs_adapters": slope(
                [(c["adapters"], c[f"{tick}_ms"]["median"]) for c in cases if c["workers"] == top_w]
            ),
            "vs_workers": slope(
                [(c["workers"], c[f"{tick}_ms"]["median"]) for c in cases if c["adapters"] == top_n]
            ),
        }
        for tick in ("cold", "steady")
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, nargs="+", default=[1000, 10_000, 100_000])
    parser.add_argument("--workers", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--reps", type=int, default=5)
    args = parse_args(parser, "bench.planner_scale", argv)
    result = run(sorted(args.adapters), sorted(args.workers), args.reps)
    big = result["cases"][-1]
    steady = result["growth"]["steady"]
    emit(
        result,
        Row(
            f"planner tick ({big['adapters']} adapters x {big['workers']} workers)",
            f"steady {Summary(**big['steady_ms']).text('ms')} ({result['steady']}); cold "
            f"{Summary(**big['cold_ms']).text('ms')} (first tick, primed: columns built "
            f"while reading, {Summary(**big['prime_ms']).text('ms')}; unprimed "
            f"{Summary(**big['unprimed_ms']).text('ms')}), {big['cold_commands']} commands "
            f"(unbounded {big['cold_commands_unbounded']}), host tier planned in "
            f"{big['ticks_to_host_tier']} ticks; steady grows ~N^{steady['vs_adapters']}"
            f" in adapters, ~W^{steady['vs_workers']} in workers",
            f"{Summary(**big['sort_ms']).text('ms')} sorted() of the same scores",
            f"steady tick = {big['steady_over_sort']}x a sort",
            result["goal"],
        ),
        args,
    )


if __name__ == "__main__":
    main()
