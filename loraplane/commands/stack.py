"""``loraplane stack``: run the local backbone (Kafka, ClickHouse, S3) on loopback."""

from __future__ import annotations

import os
import time

import typer

from loraplane.kernel.config import Settings, get_settings

__all__ = ["app", "down", "fetch", "logs", "register", "status", "up"]

app = typer.Typer(
    help="Start, stop and inspect the local Kafka + ClickHouse + S3 stack.", no_args_is_help=True
)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="stack")


def _run(action: str, settings: Settings | None = None, **kwargs: bool) -> None:
    """Call ``infra.stack.<action>``; a StackError becomes a red message and exit code 1."""
    from rich.console import Console

    from loraplane.infra import stack
    from loraplane.infra.processes import StackError
    from loraplane.kernel.kafka import KafkaUnavailable

    console = Console()
    try:
        getattr(stack, action)(settings or get_settings(), console, **kwargs)
    except (StackError, KafkaUnavailable) as exc:
        console.print(f"[red]error:[/] {exc}", highlight=False)
        raise typer.Exit(1) from None


@app.command()
def up(
    brokers: int | None = typer.Option(
        None,
        "--brokers",
        min=1,
        max=9,
        help="Kafka nodes (default: kafka.brokers, 1). Clients and `topics apply` read "
        "LORAPLANE_KAFKA__BROKERS: export it too.",
    ),
) -> None:
    """Start every service that is not running, wait until healthy, apply the topics."""
    settings = get_settings()
    if brokers is not None and brokers != settings.kafka.brokers:
        settings = settings.model_copy(
            update={"kafka": settings.kafka.model_copy(update={"brokers": brokers})}
        )
        typer.echo(
            f"note: export LORAPLANE_KAFKA__BROKERS={brokers} so that clients name "
            "every broker and `topics apply` keeps the replication",
            err=True,
        )
    _run("up", settings)


@app.command()
def down(purge: bool = typer.Option(False, "--purge", help="Also delete data dirs.")) -> None:
    """Stop the services this home started; data is kept unless --purge."""
    _run("down", purge=purge)


@app.command()
def status(
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="No output; exit 0 only if all are healthy."
    ),
) -> None:
    """Endpoint, version, PID and health of each service."""
    from rich.console import Console

    from loraplane.infra import stack

    settings = get_settings()
    ok = stack.healthy(settings) if quiet else stack.print_status(settings, Console())
    raise typer.Exit(0 if ok else 1)


@app.command()
def logs(
    service: str = typer.Argument(..., help="kafka (kafka-2 … of a cluster), clickhouse, s3"),
    lines: int = typer.Option(50, "-n", "--lines", min=0, max=1_000_000),
    follow: bool = typer.Option(False, "--follow", "-f"),
) -> None:
    """Print the end of a service's log, optionally following it."""
    from loraplane.infra import stack
    from loraplane.infra.processes import StackError
    from loraplane.kernel.local_files import open_regular
    from loraplane.kernel.log_tail import next_line

    try:
        managed = stack.service(get_settings(), service).process
    except StackError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        for line in managed.tail(lines):
            typer.echo(line)
        if not follow:
            return
        fh = os.fdopen(open_regular(managed.log_file), errors="replace")
    except OSError as exc:
        typer.echo(f"error: {managed.log_file}: {exc.strerror or exc}", err=True)
        raise typer.Exit(1) from None
    with fh:
        fh.seek(0, 2)
        try:
            while True:
                line = next_line(fh)
                if line:
                    typer.echo(line, nl=False)
                else:
                    time.sleep(0.3)
        except KeyboardInterrupt:
            pass


@app.command()
def fetch() -> None:
    """Download the Kafka and s3proxy jars into the cache now (setup does this once)."""
    from loraplane.infra.kafka import Kafka
    from loraplane.infra.s3 import S3

    settings = get_settings()
    typer.echo(f"kafka classpath: {Kafka(settings).fetch()}")
    typer.echo(f"s3proxy classpath: {S3(settings).fetch()}")
