"""``loraplane capacity``: the smallest fleet that reaches a target SLO attainment per request
class, from a scenario or the fleet's own traffic in ClickHouse (docs/capacity.md)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer

if TYPE_CHECKING:
    from loraplane.simulator.capacity import Grid, PoolAnswer

__all__ = ["MAX_AXIS", "register"]


def register(app: typer.Typer) -> None:
    @app.command("capacity")
    def capacity_cmd(
        target: str = typer.Option(
            ...,
            "--target",
            help="the SLO attainment each request class must reach, e.g. "
            "interactive=0.99,batch=0.95 (classes: interactive, batch, "
            "canary)",
        ),
        scenario: Path | None = typer.Option(
            None,
            "--scenario",
            exists=True,
            dir_okay=False,
            help="scenario YAML; with --from-clickhouse it supplies costs and policy only",
        ),
        from_clickhouse: bool = typer.Option(
            False,
            "--from-clickhouse",
            help="sweep the request_log rows of --since (and the fleet's worker states)",
        ),
        since: str = typer.Option(
            "24h", "--since", help="--from-clickhouse window: 15m, 1h, 24h, 7d ..."
        ),
        policy: str = typer.Option(
            "loraplane", "--policy", help="the policy the fleet runs (default: loraplane's)"
        ),
        workers: str | None = typer.Option(
            None,
            "--workers",
            help="worker counts per base model to try, e.g. 1,2,4,8 "
            "(default: 1 up to 4x the fleet's, powers of two)",
        ),
        slots: str | None = typer.Option(
            None,
            "--slots",
            help="GPU LoRA slots per worker to try, e.g. 8,16,32 (default: 4 up to 4x the fleet's)",
        ),
        loads: str | None = typer.Option(
            None,
            "--loads",
            help="cold loads per worker per minute to try, e.g. 6,12 "
            "(default: half, once and twice the policy's)",
        ),
        json_out: Path | None = typer.Option(
            None, "--json", help="write every point and the answer here"
        ),
        plot: Path | None = typer.Option(
            None, "--plot", help="write the attainment and cost curves (PNG)"
        ),
        seed: int | None = typer.Option(None, "--seed", help="override the scenario seed"),
    ) -> None:
        """Sweep workers, GPU slots and the cold-load budget; print the smallest fleet per base
        model whose SLO attainment reaches every target. Exit 1 when a base model reaches it
        nowhere on the grid."""
        from pydantic import ValidationError

        from loraplane.extras import require
        from loraplane.schemas.validation_text import error_line

        require("sim", "capacity")

        from loraplane.commands.simulate import base_scenario, replay_clickhouse, written
        from loraplane.simulator import benchmark, capacity, report
        from loraplane.simulator import policies as registry
        from loraplane.simulator.replay import WhatIf
        from loraplane.simulator.trace import TraceError

        if not from_clickhouse and scenario is None:
            _usage("give --scenario FILE or --from-clickhouse")
        try:
            targets = capacity.parse_targets(target)
            registry.resolve([policy])
            axes = [
                _counts(text, flag)
                for text, flag in ((workers, "--workers"), (slots, "--slots"), (loads, "--loads"))
            ]
            report.check_outputs([(json_out, "--json", False), (plot, "--plot", False)])
            sc = base_scenario(scenario, since, seed)
            if from_clickhouse:
                replayed = replay_clickhouse(sc, since, WhatIf(), "capacity")
                for note in replayed.notes:
                    typer.echo(f"note: {note}", err=True)
                bench = benchmark.Workbench(replayed.scenario, replayed.catalog, replayed.requests)
            else:
                bench = benchmark.prepare(sc)
        except (ValidationError, ValueError, TraceError, OSError) as exc:
            typer.echo(f"capacity: {error_line(exc)}", err=True)
            raise typer.Exit(2) from exc
        sc = bench.scenario
        grids = {
            i: _grid(capacity.default_grid(sc, i), axes) for i in range(len(sc.fleet.base_models))
        }
        typer.echo(
            f"{sc.name}: {len(bench.requests)} requests, policy {policy}, target "
            f"{', '.join(f'{k} {v:g}' for k, v in targets.items())}",
            err=True,
        )
        answers = capacity.sweep(
            bench, policy, targets, grids, progress=lambda line: typer.echo(line, err=True)
        )
        for found in answers:
            typer.echo(_answer_line(found, targets))
        with written("capacity"):
            if json_out is not None:
                result = {
                    "scenario": sc.name,
                    "requests": len(bench.requests),
                    "policy": policy,
                    "targets": targets,
                    "pools": [a.as_dict() for a in answers],
                }
                report.write_json(result, json_out)
                typer.echo(f"wrote {json_out}")
            if plot is not None:
                typer.echo(f"wrote {capacity.plot(answers, targets, plot)}")
        if any(a.answer is None for a in answers):
            raise typer.Exit(1)


MAX_AXIS = 64  # values per axis: the grid is their product, each point a whole replay


def _counts(text: str | None, flag: str) -> tuple[int, ...] | None:
    """``"1,2,4"`` -> (1, 2, 4), sorted, each from 1 to the scenario's ``MAX_COUNT`` in ASCII
    digits, at most ``MAX_AXIS`` of them; None: the default."""
    from loraplane.simulator.scenario import MAX_COUNT

    if text is None:
        return None
    parts = [v.strip() for v in text.split(",") if v.strip()]
    if not all(re.fullmatch(r"[0-9]{1,9}", v) for v in parts):
        raise ValueError(f"{flag} {text[:80]!r}: expected whole numbers, e.g. 1,2,4")
    values = sorted({int(v) for v in parts})
    if not values or values[0] < 1:
        raise ValueError(f"{flag} {text[:80]!r}: expected whole numbers of at least 1")
    if values[-1] > MAX_COUNT:
        raise ValueError(f"{flag} {text[:80]!r}: each at most {MAX_COUNT}")
    if len(values) > MAX_AXIS:
        raise ValueError(f"{flag}: at most {MAX_AXIS} values, not {len(values)}")
    return tuple(values)


def _grid(default: Grid, axes: list[tuple[int, ...] | None]) -> Grid:
    from loraplane.simulator.capacity import Grid

    workers, slots, loads = axes
    return Grid(
        workers or default.workers, slots or default.slots, loads or default.loads_per_minute
    )


def _answer_line(found: PoolAnswer, targets: dict[str, float]) -> str:
    a = found.answer
    if a is None:
        best = max(found.points, key=lambda p: min(p.attainment.get(k, 1.0) for k in targets))
        shares = ", ".join(f"{k} {best.attainment.get(k, 1.0):.3f}" for k in targets)
        return (
            f"{found.base_model}: no point of the grid reaches the target (the largest, "
            f"{best.workers} workers x {best.slots} slots at {best.loads_per_minute} "
            f"loads/min, reaches {shares}): try more workers or slots"
        )
    shares = ", ".join(f"{k} {a.attainment.get(k, 1.0):.3f}" for k in sorted(a.attainment))
    return (
        f"{found.base_model}: {a.workers} workers x {a.slots} GPU slots, "
        f"cold_loads_per_minute_per_worker {a.loads_per_minute}: {shares}; weighted miss "
        f"cost {a.weighted_miss_cost:.4g} ({found.requests} requests)"
    )


def _usage(message: str) -> NoReturn:
    typer.echo(f"capacity: {message}", err=True)
    raise typer.Exit(2)
