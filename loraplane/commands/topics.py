"""``loraplane topics``: converge the broker to the topics declared in
loraplane/kernel/topics.py."""

from __future__ import annotations

import typer

from loraplane.kernel.config import get_settings

__all__ = ["app", "apply_", "list_", "register"]

app = typer.Typer(help="Kafka topics declared in loraplane/kernel/topics.py.", no_args_is_help=True)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="topics")


@app.command("apply")
def apply_(dry_run: bool = typer.Option(False, "--dry-run", help="Only print the diff.")) -> None:
    """Create missing topics, alter differing configs, grow partitions; never shrink."""
    from loraplane.kernel import topics
    from loraplane.kernel.bus import keys_spread
    from loraplane.kernel.kafka import KafkaUnavailable
    from loraplane.kernel.worker_states import clear_left_behind

    try:
        changes = topics.apply(
            get_settings(), dry_run=dry_run, clear_grown=clear_left_behind, spread=keys_spread
        )
    except KafkaUnavailable as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    for change in changes:
        typer.echo(("would " if dry_run and change.action != "unchanged" else "") + str(change))
    if any(c.action == "refused" for c in changes):
        raise typer.Exit(1)


@app.command("list")
def list_() -> None:
    """The declared topics with their keys, partitions and purpose."""
    from loraplane.kernel import topics

    settings = get_settings()
    for spec in topics.TOPICS:
        configs = ", ".join(f"{k}={v}" for k, v in spec.configs().items())
        typer.echo(
            f"{topics.topic_name(settings, spec.suffix)}  key={spec.key}  "
            f"partitions={spec.partitions}  {configs}  # {spec.purpose}"
        )
