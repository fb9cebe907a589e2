"""Capacity advice: the smallest fleet that reaches a target SLO attainment per request class.

Per base model, the simulator replays that pool's requests (a scenario's, or the fleet's own
from ClickHouse) with one policy at every point of a grid of workers, GPU slots per worker and
cold-load budgets (loads per worker per rolling minute), and keeps each point's attainment
per class (``Counters.slo``: served by the request's own adapter within its class's TTFT
budget) and weighted miss cost. The answer is the smallest point whose attainment reaches
every target: the fewest workers (GPUs), then the fewest slots per worker (HBM the adapters
take from the KV cache), then the lowest budget (loads slow the batch beside them). Workers
are tried in increasing order and the sweep stops after the first count that reaches the
targets, so a large grid costs only the rows below its answer.

Pools are independent in the simulator (each has its own workers; a request reaches only its
base model's), so each is swept on its own requests. What the answer is worth is what the
simulator models: docs/capacity.md says what that leaves out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loraplane.simulator.benchmark import Workbench, run_policy
from loraplane.simulator.requests import Requests
from loraplane.simulator.scenario import Scenario

__all__ = [
    "CLASSES",
    "Grid",
    "Point",
    "PoolAnswer",
    "TargetError",
    "at",
    "default_grid",
    "meets",
    "parse_targets",
    "plot",
    "pool_requests",
    "sweep",
]

CLASSES = ("interactive", "batch", "canary")
"""The request classes a target may name (``canary``: requests of canary versions)."""


class TargetError(ValueError):
    """A ``--target`` text that does not parse."""


def parse_targets(text: str) -> dict[str, float]:
    """``"interactive=0.99,batch=0.95"`` -> ``{"interactive": 0.99, "batch": 0.95}``: each
    class at most once, each share in (0, 1]."""
    targets: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in CLASSES:
            raise TargetError(
                f"target {part!r}: expected CLASS=SHARE, CLASS one of {', '.join(CLASSES)}"
            )
        if name in targets:
            raise TargetError(f"target {name!r} given twice")
        try:
            share = float(value)
        except ValueError:
            raise TargetError(f"target {part!r}: {value.strip()!r} is not a number") from None
        if not 0 < share <= 1:
            raise TargetError(f"target {part!r}: the share must be in (0, 1]")
        targets[name] = share
    return targets


@dataclass(frozen=True)
class Grid:
    workers: tuple[int, ...]
    slots: tuple[int, ...]
    loads_per_minute: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.workers) * len(self.slots) * len(self.loads_per_minute)


def default_grid(scenario: Scenario, pool: int) -> Grid:
    """Around the pool's own deployment: 1 worker up to 4x its workers (powers of two and its
    own count), slots from 4 to 4x its own, the budget at half, once and twice the policy's."""
    spec = scenario.fleet.base_models[pool]
    budget = scenario.policy.cold_loads_per_minute_per_worker
    workers = {spec.workers} | {2**k for k in range(8) if 2**k <= 4 * spec.workers}
    slots = {spec.gpu_slots_per_worker} | {
        s for s in (4, 8, 16, 32, 64) if s <= 4 * spec.gpu_slots_per_worker
    }
    loads = {max(1, budget // 2), budget, 2 * budget}
    return Grid(tuple(sorted(workers)), tuple(sorted(slots)), tuple(sorted(loads)))


@dataclass(frozen=True)
class Point:
    workers: int
    slots: int
    loads_per_minute: int
    attainment: dict[str, float]
    weighted_miss_cost: float
    meets: bool
    seconds: float


@dataclass
class PoolAnswer:
    base_model: str
    requests: int
    grid: Grid
    points: list[Point] = field(default_factory=list)
    answer: Point | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "base_model": self.base_model,
            "requests": self.requests,
            "grid": asdict(self.grid),
            "points": [asdict(p) for p in self.points],
            "answer": asdict(self.answer) if self.answer else None,
        }


def meets(attainment: dict[str, float], targets: dict[str, float]) -> bool:
    """Every targeted class reaches its share (a class without requests meets any target)."""
    return all(attainment.get(k, 1.0) >= v for k, v in targets.items())


def pool_requests(bench: Workbench, pool: int) -> Requests:
    """The requests of one base model, in order."""
    of = [a.base_model for a in bench.catalog.adapters]
    r = bench.requests
    keep = [i for i, a in enumerate(r.adapter) if of[a] == pool]
    return Requests(
        [r.time_s[i] for i in keep],
        [r.adapter[i] for i in keep],
        [r.output_tokens[i] for i in keep],
        [r.batch[i] for i in keep],
    )


def at(scenario: Scenario, pool: int, workers: int, slots: int, loads: int) -> Scenario:
    """The scenario with one pool sized as a grid point (the budget is the policy's)."""
    bases = list(scenario.fleet.base_models)
    bases[pool] = bases[pool].model_copy(update={"workers": workers, "gpu_slots_per_worker": slots})
    fleet = scenario.fleet.model_copy(update={"base_models": bases})
    policy = scenario.policy.model_copy(update={"cold_loads_per_minute_per_worker": loads})
    return scenario.model_copy(update={"fleet": fleet, "policy": policy, "overrides": {}})


def sweep(
    bench: Workbench,
    policy: str,
    targets: dict[str, float],
    grids: dict[int, Grid] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[PoolAnswer]:
    """Every pool with requests, swept in increasing worker count until a count reaches the
    targets (all of its slot and budget points are run, so the smallest is known)."""
    tell = progress or (lambda _: None)
    out = []
    for pool, spec in enumerate(bench.scenario.fleet.base_models):
        requests = pool_requests(bench, pool)
        if not len(requests):
            continue
        grid = (grids or {}).get(pool) or default_grid(bench.scenario, pool)
        found = PoolAnswer(spec.name, len(requests), grid)
        n = 0
        for workers in grid.workers:
            for slots in grid.slots:
                for loads in grid.loads_per_minute:
                    n += 1
                    sized = Workbench(
                        at(bench.scenario, pool, workers, slots, loads), bench.catalog, requests
                    )
                    started = time.perf_counter()
                    counters = run_policy(sized, policy)
                    summary = counters.summary()
                    point = Point(
                        workers,
                        slots,
                        loads,
                        summary["slo_attainment"],
                        summary["weighted_miss_cost"],
                        meets(summary["slo_attainment"], targets),
                        round(time.perf_counter() - started, 2),
                    )
                    found.points.append(point)
                    tell(_said(spec.name, n, grid.size, point))
            reached = [p for p in found.points if p.meets and p.workers == workers]
            if reached:
                found.answer = min(reached, key=lambda p: (p.slots, p.loads_per_minute))
                break
        out.append(found)
    return out


def _said(pool: str, n: int, of: int, p: Point) -> str:
    shares = " ".join(f"{k} {v:.3f}" for k, v in sorted(p.attainment.items()))
    return (
        f"{pool} [{n}/{of}] {p.workers} workers x {p.slots} slots, "
        f"{p.loads_per_minute} loads/min: {shares}; cost {p.weighted_miss_cost:.4g}"
        f"{' (meets the target)' if p.meets else ''} in {p.seconds:.1f} s"
    )


def plot(answers: Sequence[PoolAnswer], targets: dict[str, float], path: Path) -> Path:
    """One row per pool, against the fleet's GPU LoRA slots (workers x slots per worker), one
    line per (workers, budget): the worst margin of a targeted class to its target (at 0 or
    above: the point reaches every target) and the weighted miss cost (the cost curve), the
    answer starred."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        max(1, len(answers)), 2, figsize=(11, 4.2 * max(1, len(answers))), squeeze=False
    )
    for row, found in zip(axes, answers, strict=False):
        lines: dict[tuple[int, int], list[Point]] = {}
        for p in found.points:
            lines.setdefault((p.workers, p.loads_per_minute), []).append(p)
        for (workers, loads), pts in sorted(lines.items()):
            pts = sorted(pts, key=lambda p: p.slots)
            xs = [p.workers * p.slots for p in pts]
            label = f"{workers} workers, {loads} loads/min"
            row[0].plot(xs, [_margin(p, targets) for p in pts], marker="o", label=label)
            row[1].plot(xs, [p.weighted_miss_cost for p in pts], marker="o", label=label)
        if found.answer is not None:
            a = found.answer
            for ax, y in ((row[0], _margin(a, targets)), (row[1], a.weighted_miss_cost)):
                ax.plot(
                    [a.workers * a.slots],
                    [y],
                    marker="*",
                    markersize=16,
                    color="black",
                    linestyle="none",
                    label="answer",
                )
        row[0].axhline(0.0, color="grey", linestyle="--", linewidth=0.8)
        row[0].set_title(f"{found.base_model}: worst margin to the target", fontsize=10)
        row[0].set_ylabel(
            "attainment - target, worst of " + ", ".join(f"{k} {v:g}" for k, v in targets.items()),
            fontsize=8,
        )
        row[1].set_title(f"{found.base_model}: priority-weighted miss cost", fontsize=10)
        row[1].set_ylabel("weighted miss cost (ms)")
        for ax in row:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("GPU LoRA slots in the fleet (workers x slots per worker)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _margin(p: Point, targets: dict[str, float]) -> float:
    return min((p.attainment.get(k, 1.0) - v for k, v in targets.items()), default=0.0)
