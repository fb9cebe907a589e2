"""``loraplane metrics migrate|retention|sink``, ``loraplane report`` and ``loraplane dashboard``:
the ClickHouse side of loraplane, for ops."""

from __future__ import annotations

import json
import logging
import signal
import threading

import typer

from loraplane.kernel.config import get_settings

__all__ = [
    "REPORT_COLUMNS",
    "app",
    "dashboard",
    "migrate",
    "register",
    "report",
    "retention",
    "sink",
]

app = typer.Typer(
    help="ClickHouse metrics: schema, retention and the Kafka sink.", no_args_is_help=True
)

REPORT_COLUMNS = (
    ("adapter_id", "adapter"),
    ("adapter_version", "version"),
    ("tenant_id", "tenant"),
    ("base_model", "base model"),
    ("requests", "requests"),
    ("gpu_hits", "gpu"),
    ("host_hits", "host"),
    ("cold", "cold"),
    ("base_fallbacks", "fallback"),
    ("hot_adapter_hit_rate", "hit rate"),
    ("ttft_p50_ms", "ttft p50"),
    ("ttft_p95_ms", "ttft p95"),
    ("ttft_p99_ms", "ttft p99"),
    ("swap_p95_ms", "swap p95"),
    ("load_failures", "load fail"),
    ("kv_namespace_conflicts", "kv conflicts"),
)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="metrics")
    root.command("report")(report)
    root.command("dashboard")(dashboard)


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(1)


@app.command()
def migrate() -> None:
    """Create the database and apply pending migrations (a second run is a no-op)."""
    from loraplane.metrics.clickhouse import unavailable, unavailable_errors
    from loraplane.metrics.migrations import MigrationError
    from loraplane.metrics.migrations import migrate as run_migrations

    settings = get_settings()
    try:
        result = run_migrations(settings)
    except MigrationError as exc:
        raise _fail(str(exc)) from None
    except unavailable_errors() as exc:  # away, refused, or no writer password
        raise _fail(unavailable(settings, exc)) from None
    for label in result.applied:
        typer.echo(f"applied {label}")
    typer.echo(
        f"ClickHouse {result.server_version}, database {settings.clickhouse.database}: "
        f"{len(result.applied)} applied, {len(result.already)} already applied"
    )


@app.command()
def retention(
    days: int = typer.Option(..., "--days", min=1, max=36_500, help="Keep this many days."),
    dry_run: bool = typer.Option(False, "--dry-run"),
) -> None:
    """Drop daily partitions older than --days (what TTL does on newer ClickHouse)."""
    from loraplane.metrics.clickhouse import unavailable, unavailable_errors
    from loraplane.metrics.migrations import retention as drop_old

    settings = get_settings()
    try:
        dropped = drop_old(settings, days, dry_run=dry_run)
    except unavailable_errors() as exc:
        raise _fail(unavailable(settings, exc)) from None
    for part in dropped:
        typer.echo(f"{'would drop' if dry_run else 'dropped'} {part.table} {part.partition}")
    typer.echo(f"{len(dropped)} partition(s) older than {days} day(s)")


@app.command()
def sink(
    batch_size: int = typer.Option(20_000, min=1, max=10_000_000),
    max_wait_s: float = typer.Option(1.0, min=0.01, max=3600),
    group_id: str | None = typer.Option(None, help="Default: <topic_prefix>.metrics-sink"),
    session_timeout_ms: int = typer.Option(10_000, min=6000, max=300_000),
    max_row_age_days: float = typer.Option(
        400.0,
        min=0,
        max=50_000,
        help="Rows stamped longer ago go to the dead letters (outside_window); 0: no bound.",
    ),
    max_row_ahead_hours: float = typer.Option(
        24.0,
        min=0,
        max=1_000_000,
        help="Rows stamped this far ahead of the clock go to the dead letters; 0: no bound.",
    ),
    metrics_port: int = typer.Option(
        0,
        "--metrics-port",
        min=0,
        max=65535,
        help="Serve loraplane_consumer_stuck_seconds on listen_host:PORT/metrics (0: none).",
    ),
) -> None:
    """Consume request logs, cache events, decisions, audit and dead letters into ClickHouse
    until SIGINT/SIGTERM."""
    from loraplane.kernel import kafka
    from loraplane.kernel.progress_metrics import serve_progress
    from loraplane.metrics.sink import Sink, SinkConfig

    kafka.act_as(kafka.Principal.metrics)
    from loraplane.kernel.log_lines import configure_logging

    configure_logging()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    settings = get_settings()
    runner = Sink(
        settings,
        SinkConfig(
            batch_size=batch_size,
            max_wait_s=max_wait_s,
            group_id=group_id,
            session_timeout_ms=session_timeout_ms,
            max_row_age_s=max_row_age_days * 86_400.0 or None,
            max_row_ahead_s=max_row_ahead_hours * 3_600.0 or None,
        ),
    )
    serve_progress(metrics_port, host=settings.listen_host)
    logging.getLogger("loraplane.metrics.sink").info("sink started, group %s", runner.group_id)
    stats = runner.run(stop)
    typer.echo(
        f"sink stopped: {stats.batches} batches, {stats.rows} rows, "
        f"{stats.dead_letters} dead letters ({stats.dead_letters_lost} lost), "
        f"{stats.retries} retries"
    )


def report(
    since: str = typer.Option("1h", help="Window up to now: 15m, 1h, 7d ..."),
    adapter: str = typer.Option("", "--adapter", help="Only this adapter_id."),
    tenant: str = typer.Option("", "--tenant", help="Only this tenant_id."),
    base_model: str = typer.Option("", "--base-model"),
    as_json: bool = typer.Option(False, "--json", help="Rows as JSON."),
) -> None:
    """The per-adapter view from ClickHouse: tiers, hit rate, TTFT and swap percentiles."""
    from loraplane.metrics.clickhouse import connect, unavailable, unavailable_errors
    from loraplane.metrics.queries import adapter_view, window

    try:
        params = window(since, adapter_id=adapter, tenant_id=tenant, base_model=base_model)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    settings = get_settings()
    try:
        client = connect(settings, reader=True)
        try:
            rows = adapter_view(client, params)
        finally:
            client.disconnect()
    except unavailable_errors() as exc:
        raise _fail(unavailable(settings, exc)) from None
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"adapters, last {since}")
    for _, title in REPORT_COLUMNS:
        table.add_column(
            title,
            justify="left" if title in {"adapter", "version", "tenant", "base model"} else "right",
        )
    for row in rows:
        table.add_row(*(_cell(row.get(key)) for key, _ in REPORT_COLUMNS))
    console = Console()
    # Piped output has no width; 16 columns squeezed into 80 would be unreadable.
    (console if console.is_terminal else Console(width=200)).print(table)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if value < 1 else f"{value:.1f}"
    return str(value)


def dashboard(
    port: int = typer.Option(8787, min=1, max=65535),
    refresh_s: float = typer.Option(5.0, min=1.0, max=3600, help="Browser refresh period."),
) -> None:
    """Serve the live dashboard on http://127.0.0.1:PORT (charts per adapter over time, the
    fleet view of the workers' heartbeats)."""
    from loraplane.dashboards.web import serve
    from loraplane.kernel import kafka

    kafka.act_as(kafka.Principal.reader)  # the fleet panel reads the worker-state topic

    serve(get_settings(), port=port, refresh_s=refresh_s)
