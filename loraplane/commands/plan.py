"""``loraplane plan show [--base-model B] [--json]``: what the planner would issue now and
why, from one read of the topics the planner tails, planned by the planner's own tick
(``streams.planner_runtime.preview``) and written nowhere: it runs as the read-only
``reader`` principal, which may not write to any topic."""

from __future__ import annotations

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="The planner's decisions, previewed.", no_args_is_help=True)

    @group.command("show")
    def show_cmd(
        base_model: str | None = typer.Option(
            None,
            "--base-model",
            help="Plan only this base model (as `streams planner "
            "--base-model` does); default: every base model.",
        ),
        as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
        timeout_s: float = typer.Option(
            15.0,
            "--timeout-s",
            min=0.1,
            max=3600,
            help="how long reading each topic to its end may take",
        ),
    ) -> None:
        """Each command the planner would issue now (worker, action, version, rule, score,
        detail) and each hot version that waits for a slot, with its reason. Exit 2 when
        the topics cannot be read to their end (the broker is away): an unread fleet is
        never shown as an empty plan."""
        import json

        from confluent_kafka import KafkaException
        from rich.console import Console
        from rich.table import Table

        from loraplane.kernel import kafka
        from loraplane.kernel.bus import TopicReadIncomplete
        from loraplane.kernel.config import get_settings
        from loraplane.streams.planner_runtime import preview, preview_json

        kafka.act_as(kafka.Principal.reader)
        settings = get_settings()
        try:
            shown = preview(settings, base_model, timeout_s=timeout_s)
        except (TopicReadIncomplete, KafkaException) as exc:
            typer.echo(
                f"error: cannot read the planner's topics from {settings.kafka.bootstrap}: {exc}",
                err=True,
            )
            raise typer.Exit(2) from exc
        out = preview_json(shown)
        if as_json:
            typer.echo(json.dumps({"base_model": base_model, **out}, indent=2))
            return
        console = Console()
        i = out["inputs"]
        console.print(
            f"{i['adapters']} adapters, {i['score_keys']} score keys, "
            f"{i['live_workers']}/{i['workers']} workers live, "
            f"{i['serving_workers']} serving, "
            f"{i['pending_commands']} commands pending in planner memory"
        )
        if i["refused_views"]:
            console.print(
                f"[yellow]{len(i['refused_views'])} registry views refused by the "
                f"keyring: {', '.join(sorted(set(i['refused_views'])))}[/yellow]"
            )
        if not out["commands"]:
            console.print("no command: the fleet already holds what the planner wants")
        else:
            table = Table(
                "worker",
                "action",
                "version",
                "rule",
                "score",
                "detail",
                title="commands the planner would issue now",
            )
            for c in out["commands"]:
                table.add_row(
                    c["worker_id"],
                    c["action"],
                    c["lora_name"],
                    c["rule"],
                    "-" if c["score"] is None else f"{c['score']:.4f}",
                    c["detail"],
                )
            console.print(table)
        if out["waiting"]:
            table = Table("version", "score", "reason", title="hot versions waiting for a slot")
            for w in out["waiting"]:
                table.add_row(w["lora_name"], f"{w['score']:.4f}", w["reason"])
            console.print(table)

    app.add_typer(group, name="plan")
