"""``loraplane simulate``: replay a scenario against every cache policy and compare."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("simulate")
    def simulate_cmd(
        scenario: Path = typer.Option(..., "--scenario", exists=True, dir_okay=False,
                                      help="scenario YAML (bench/scenarios/*.yaml)"),
        trace: Path | None = typer.Option(None, "--trace", exists=True, dir_okay=False,
                                          help="Azure LLM trace CSV; replaces the workload's"
                                               " arrivals"),
        policies: str | None = typer.Option(None, "--policies",
                                            help="comma-separated names, or 'all'"),
        json_out: Path | None = typer.Option(None, "--json", help="write the result here"),
        plot_dir: Path | None = typer.Option(None, "--plot",
                                             help="write hit-rate/cost vs GPU slots PNGs here"),
        seed: int | None = typer.Option(None, "--seed", help="override the scenario seed"),
    ) -> None:
        """Print a table of every policy on the scenario; optionally JSON and plots."""
        from pydantic import ValidationError

        from loraplane.simulator import benchmark, report
        from loraplane.simulator import policies as registry
        from loraplane.simulator.scenario import load_scenario
        from loraplane.simulator.trace import TraceError

        try:
            sc = load_scenario(scenario)
            if trace is not None:
                sc = sc.model_copy(update={"workload": sc.workload.model_copy(
                    update={"source": "trace", "trace": str(trace.resolve())})})
            if seed is not None:
                sc = sc.model_copy(update={"seed": seed})
            names = registry.resolve(policies.split(",") if policies else sc.policies)
            bench = benchmark.prepare(sc)
        except (ValidationError, ValueError, TraceError, OSError) as exc:
            typer.echo(f"simulate: {exc}", err=True)
            raise typer.Exit(2) from exc
        result = benchmark.run(bench, names)
        typer.echo(f"{sc.name}: {result['requests']} requests, seed {sc.seed}")
        typer.echo(report.table(result))
        seed_rows = report.seed_table(result)
        if seed_rows:
            typer.echo("\nThe seed's comparison (simulated / measured in the seed):")
            typer.echo(seed_rows)
        if json_out is not None:
            report.write_json(result, json_out)
            typer.echo(f"wrote {json_out}")
        if plot_dir is not None:
            for path in report.plot(benchmark.sweep(bench, names), sc.name, plot_dir):
                typer.echo(f"wrote {path}")
