"""``loraplane simulate``: replay a scenario (or the fleet's own traffic from ClickHouse)
against every cache policy and compare."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer

if TYPE_CHECKING:
    from loraplane.kernel.config import Settings
    from loraplane.metrics.queries import Params
    from loraplane.schemas.registry import AdapterView
    from loraplane.schemas.worker_state import WorkerState
    from loraplane.simulator.replay import Replay, RequestRow, WhatIf
    from loraplane.simulator.scenario import Scenario

__all__ = ["PROGRESS_ROWS", "base_scenario", "register", "replay_clickhouse", "written"]

PROGRESS_ROWS = 100_000  # a progress line on stderr every this many rows read


def register(app: typer.Typer) -> None:
    @app.command("simulate")
    def simulate_cmd(
        scenario: Path | None = typer.Option(
            None,
            "--scenario",
            exists=True,
            dir_okay=False,
            help="scenario YAML (bench/scenarios/*.yaml); with --from-clickhouse it supplies "
            "costs, policy and sweep only",
        ),
        trace: Path | None = typer.Option(
            None,
            "--trace",
            exists=True,
            dir_okay=False,
            help="Azure LLM trace CSV; replaces the workload's arrivals",
        ),
        from_clickhouse: bool = typer.Option(
            False,
            "--from-clickhouse",
            help="replay the request_log rows of --since (and the fleet's worker states)",
        ),
        since: str = typer.Option(
            "24h", "--since", help="--from-clickhouse window: 15m, 1h, 24h, 7d ..."
        ),
        workers: int | None = typer.Option(
            None, "--workers", min=1, max=100_000, help="--from-clickhouse: workers per base model"
        ),
        add_workers: int = typer.Option(
            0,
            "--add-workers",
            min=0,
            max=100_000,
            help="--from-clickhouse: this many more per base model",
        ),
        slots: int | None = typer.Option(
            None, "--slots", min=1, max=100_000, help="--from-clickhouse: GPU LoRA slots per worker"
        ),
        policies: str | None = typer.Option(
            None, "--policies", help="comma-separated names, or 'all'"
        ),
        policy: list[str] = typer.Option([], "--policy", help="one policy name; repeat for more"),
        json_out: Path | None = typer.Option(None, "--json", help="write the result here"),
        plot_dir: Path | None = typer.Option(
            None, "--plot", help="write hit-rate/cost vs GPU slots PNGs here"
        ),
        seed: int | None = typer.Option(None, "--seed", help="override the scenario seed"),
    ) -> None:
        """Print a table of every policy on the scenario; optionally JSON and plots."""
        from pydantic import ValidationError

        from loraplane.extras import require
        from loraplane.schemas.validation_text import error_line

        require("sim", "simulate")

        from loraplane.simulator import benchmark, report
        from loraplane.simulator import policies as registry
        from loraplane.simulator.replay import WhatIf
        from loraplane.simulator.trace import TraceError

        what_if = WhatIf(workers, add_workers, slots)
        if from_clickhouse and trace is not None:
            _usage("--trace and --from-clickhouse are two workloads: give one")
        if not from_clickhouse and (what_if != WhatIf()):
            _usage("--workers, --add-workers and --slots go with --from-clickhouse")
        if workers is not None and add_workers:
            _usage("--workers sets the count, --add-workers adds to the one seen: give one")
        if not from_clickhouse and scenario is None:
            _usage("give --scenario FILE or --from-clickhouse")
        replayed: Replay | None = None
        try:
            report.check_outputs([(json_out, "--json", False), (plot_dir, "--plot", True)])
            sc = base_scenario(scenario, since, seed)
            if trace is not None:
                sc = sc.model_copy(
                    update={
                        "workload": sc.workload.model_copy(
                            update={"source": "trace", "trace": str(trace.resolve())}
                        )
                    }
                )
            chosen = [*(policies.split(",") if policies else []), *policy]
            names = registry.resolve(chosen or sc.policies)
            if from_clickhouse:
                replayed = replay_clickhouse(sc, since, what_if, "simulate")
                bench = benchmark.Workbench(replayed.scenario, replayed.catalog, replayed.requests)
            else:
                bench = benchmark.prepare(sc)
        except (ValidationError, ValueError, TraceError, OSError) as exc:
            typer.echo(f"simulate: {error_line(exc)}", err=True)
            raise typer.Exit(2) from exc
        sc = bench.scenario
        result = benchmark.run(bench, names)
        if replayed is not None:
            result["replay"] = {**replayed.summary, "notes": list(replayed.notes)}
            for note in replayed.notes:
                typer.echo(f"note: {note}", err=True)
        typer.echo(f"{sc.name}: {result['requests']} requests, seed {sc.seed}")
        typer.echo(report.table(result))
        seed_rows = report.seed_table(result)
        if seed_rows:
            typer.echo("\nThe seed's comparison (simulated / measured in the seed):")
            typer.echo(seed_rows)
        with written("simulate"):
            if json_out is not None:
                report.write_json(result, json_out)
                typer.echo(f"wrote {json_out}")
            if plot_dir is not None:
                for path in report.plot(benchmark.sweep(bench, names), sc.name, plot_dir):
                    typer.echo(f"wrote {path}")


def _usage(message: str) -> NoReturn:
    typer.echo(f"simulate: {message}", err=True)
    raise typer.Exit(2)


def base_scenario(path: Path | None, since: str, seed: int | None) -> Scenario:
    """The scenario file's, or without one the defaults named ``replay-SINCE``; ``seed`` in
    place of its own. A bad ``--since`` is a ValueError naming it, not the scenario's name."""
    from loraplane.metrics.queries import parse_duration
    from loraplane.simulator.scenario import Scenario, load_scenario

    if path is not None:
        sc = load_scenario(path)
    else:
        parse_duration(since)
        sc = Scenario(name=f"replay-{since.strip()}")
    return sc if seed is None else sc.model_copy(update={"seed": seed})


@contextmanager
def written(command: str) -> Iterator[None]:
    """A write that fails after the run (the disk filled, the folder went) is one line and
    exit 1, not a traceback."""
    try:
        yield
    except OSError as exc:
        typer.echo(f"{command}: could not write the result: {exc}", err=True)
        raise typer.Exit(1) from exc


def replay_clickhouse(base: Scenario, since: str, what_if: WhatIf, command: str) -> Replay:
    """The window's rows from ClickHouse (read-only login), the fleet's worker states and the
    registry from Kafka; exits 1 when ClickHouse cannot be read or the window is empty
    (``command`` names the command in what it says)."""
    from loraplane.kernel.config import get_settings
    from loraplane.metrics import queries
    from loraplane.simulator import replay

    params = queries.window(since)  # ValueError on a bad --since: a usage error
    settings = get_settings()
    rows = _read_rows(settings, params, since, command)
    states, views = _fleet_facts(settings, command)
    return replay.build(
        rows, replay.worker_facts(states), replay.adapter_facts(views, states), base, what_if
    )


def _read_rows(settings: Settings, params: Params, since: str, command: str) -> list[RequestRow]:
    from loraplane.metrics import queries
    from loraplane.metrics.clickhouse import connect, unavailable, unavailable_errors
    from loraplane.simulator.replay import check_rows, row_of

    c = settings.clickhouse
    where = f"ClickHouse at {c.host}:{c.tcp_port}, database {c.database}"
    rows: list[RequestRow] = []
    try:
        client = connect(settings, reader=True, timeout_s=60.0)
        try:
            total = queries.count_arrivals(client, params)
            if total == 0:
                typer.echo(
                    f"{command}: no request rows in the last {since} ({where}): nothing to replay",
                    err=True,
                )
                raise typer.Exit(1)
            check_rows(total)  # before the read: a window past it is never held in memory
            typer.echo(f"reading {total} request rows of the last {since} from {where}", err=True)
            for values in queries.request_arrivals(client, params):
                if len(rows) >= total:  # rows written since the count: each one asked
                    check_rows(len(rows) + 1)
                rows.append(row_of(values))
                if len(rows) % PROGRESS_ROWS == 0:
                    typer.echo(f"  {len(rows)}/{total} rows", err=True)
        finally:
            client.disconnect()
    except unavailable_errors() as exc:  # away, refused, or no reader password
        typer.echo(f"{command}: {unavailable(settings, exc)}", err=True)
        raise typer.Exit(1) from exc
    return rows


def _fleet_facts(settings: Settings, command: str) -> tuple[list[WorkerState], list[AdapterView]]:
    """Worker states (the compacted worker-state topic: ClickHouse has no table of them) and
    registry views; a broker that is away leaves both empty, which the replay notes."""
    from concurrent.futures import ThreadPoolExecutor

    from confluent_kafka import KafkaException

    from loraplane.kernel import kafka
    from loraplane.kernel.bus import TopicReadIncomplete
    from loraplane.kernel.worker_states import latest_fleet_states
    from loraplane.registry.topic import load_registry

    kafka.act_as(kafka.Principal.reader)  # reads two topics, writes nothing
    try:  # side by side: each read is mostly waiting for its consumer's assignment
        with ThreadPoolExecutor(2) as pool:
            states = pool.submit(latest_fleet_states, settings, 5.0)
            registry = pool.submit(load_registry, settings, 5.0, True)
            fleet, views = states.result(), registry.result()
    except (KafkaException, TopicReadIncomplete) as exc:
        typer.echo(
            f"{command}: Kafka unreadable ({exc}); fleet from the request rows only, "
            "adapters unknown",
            err=True,
        )
        return [], []
    if not fleet.complete:
        typer.echo(
            f"{command}: the worker-state read was cut short; fleet partly from the request rows",
            err=True,
        )
    return list(fleet.workers.values()), list(views.values())
