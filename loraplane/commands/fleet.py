"""``loraplane fleet status [--json]``: per base model and worker, what the fleet holds now
(slots, versions per tier, replicas, in-flight work, heartbeat age), from the compacted
worker-state topic; ``loraplane/router/fleet_view.py`` decides what is shown."""

from __future__ import annotations

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="The fleet as its workers report it.", no_args_is_help=True)

    @group.command("status")
    def status_cmd(
        as_json: bool = typer.Option(False, "--json"),
        heartbeat_s: float | None = typer.Option(
            None,
            "--heartbeat-s",
            min=0.01,
            max=3600,
            help="the workers' heartbeat interval (default: "
            "policy.worker_heartbeat_s): a worker silent for three "
            "intervals shows as drained, as the router drains it",
        ),
        timeout_s: float = typer.Option(
            10.0, "--timeout-s", min=0.1, max=3600, help="how long to read the topic"
        ),
    ) -> None:
        """One row per worker; a worker state that does not decode is counted, not shown."""
        import json
        import time

        from rich.console import Console
        from rich.table import Table

        from loraplane.kernel import kafka
        from loraplane.kernel.config import get_settings
        from loraplane.kernel.log_lines import one_line
        from loraplane.kernel.worker_states import latest_fleet_states
        from loraplane.router.fleet_view import fleet_view

        kafka.act_as(kafka.Principal.reader)
        settings = get_settings()
        latest = latest_fleet_states(settings, timeout_s=timeout_s)
        malformed = latest.malformed
        view = fleet_view(
            latest.workers.values(),
            time.time(),
            heartbeat_s or settings.policy.worker_heartbeat_s,
            latest.routers.values(),
        )
        if as_json:
            typer.echo(
                json.dumps(
                    {**view.as_json(), "malformed_states": malformed, "complete": latest.complete},
                    indent=2,
                )
            )
            return
        console = Console()
        if not view.base_models:
            console.print("no worker has reported a state yet")
        for base in view.base_models:
            table = Table(
                "worker",
                "live",
                "heartbeat age s",
                "GPU used/free",
                "GPU versions",
                "host versions",
                "protected",
                "in flight",
                "cold loads/min",
                "load stall",
                "HBM",
                title=f"{base.base_model}: {base.live_workers} live, "
                f"{base.serving_workers} serving, {base.gpu_slots_free} free GPU slots",
            )
            for w in base.workers:
                table.add_row(
                    w.worker_id,
                    ("yes" if w.not_run is None else f"not run: {w.not_run}")
                    if w.live
                    else "drained",
                    f"{w.heartbeat_age_s:.1f}",
                    f"{w.gpu_slots_used}/{w.gpu_slots_free}",
                    str(w.gpu_versions),
                    str(w.host_versions),
                    str(w.protected),
                    str(w.in_flight),
                    str(w.cold_loads_last_minute)
                    + ("" if w.cold_load_budget is None else f" of {w.cold_load_budget}"),
                    "-" if w.load_stall is None else f"{w.load_stall:.0%}",
                    "-" if w.hbm_usage is None else f"{w.hbm_usage:.0%}",
                )
            console.print(table)
            # Lora names and queue bands are text of the states' writers: never markup (a
            # "[/]" was Rich's MarkupError), control characters escaped (an ESC reached the
            # terminal as it was).
            multi = {n: c for n, c in base.replicas.items() if c > 1}
            console.print(
                f"GPU copies serving: {sum(base.replicas.values())} of "
                f"{len(base.replicas)} versions" + (f"; replicated: {multi}" if multi else ""),
                markup=False,
            )
            if base.routers:
                bands = ", ".join(
                    f"{one_line(b)} {n}" for b, n in (base.queued_by_band or {}).items()
                )
                console.print(
                    f"routers: {base.routers} live, {base.router_in_flight} in "
                    f"flight, {base.queue_depth} queued" + (f" ({bands})" if bands else ""),
                    markup=False,
                )
            else:
                console.print("routers: none reporting (queue depth unknown)")
        if malformed:
            console.print(
                f"[yellow]{malformed} worker or router state(s) unreadable or under "
                "another key[/yellow]"
            )
        if not latest.complete:
            console.print(
                f"[yellow]the topics were not read to their end in {timeout_s:g} s: "
                "the view may be older than it says[/yellow]"
            )

    app.add_typer(group, name="fleet")
