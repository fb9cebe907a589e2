"""``loraplane streams run``: the Faust worker with every agent of streams.app;
``loraplane streams planner``: one planner runtime as its own process;
``loraplane streams scoring``: one more scoring keeper as a plain process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    import faust
    from confluent_kafka.admin import AdminClient

    from loraplane.kernel.config import Settings

__all__ = [
    "CHANGELOG_VISIBLE_S",
    "ensure_changelog_topics",
    "plain_process",
    "register",
    "run_until_signal",
]


CHANGELOG_VISIBLE_S = 30.0
"""How long a changelog topic may take to show in the broker's metadata with all its
partitions led (moments on a healthy cluster)."""


def ensure_changelog_topics(settings: Settings, faust_app: faust.App) -> list[str]:
    """Create the tables' changelog topics before the worker starts.

    Faust would create them itself, but on a fresh prefix its consumer can see a just-created
    changelog with 0 partitions, fail the table's partition check on every write and keep
    failing until its metadata is refreshed, minutes later (Kafka 4.1.1 does this; the
    writes of those minutes are lost). Created here, and waited for
    until the broker's metadata lists every partition with a leader, they exist with their
    partitions before Faust's first metadata fetch. Returns the names created.
    """
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import NewTopic

    from loraplane.kernel import kafka, topics

    admin = kafka.admin(settings)
    copies = topics.replicas(settings)
    existing = _listed_once_kafka_answers(admin, settings.kafka.bootstrap)
    missing = [
        NewTopic(
            t.changelog_topic_name,
            num_partitions=t.partitions or faust_app.conf.topic_partitions,
            replication_factor=copies,
            config={"cleanup.policy": "compact"}
            | ({"min.insync.replicas": str(topics.min_insync(copies))} if copies > 1 else {}),
        )
        for t in faust_app.tables.values()
        if t.changelog_topic_name not in existing
    ]
    if missing:
        for future in admin.create_topics(missing, request_timeout=30).values():
            try:
                future.result(timeout=30)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise
    for t in faust_app.tables.values():
        _wait_listed(admin, t.changelog_topic_name, t.partitions or faust_app.conf.topic_partitions)
    return [t.topic for t in missing]


def _listed_once_kafka_answers(
    admin: AdminClient, bootstrap: str, attempt_s: float = 15.0
) -> dict[str, object]:
    """The broker's topics, once it answers: a worker started before Kafka (or while it is
    away) waits for it, a line each attempt, as every other runtime does, instead of
    ending on the first refused connection."""
    from confluent_kafka import KafkaError, KafkaException

    refused = {
        getattr(KafkaError, name)
        for name in (
            "_AUTHENTICATION",
            "SASL_AUTHENTICATION_FAILED",
            "CLUSTER_AUTHORIZATION_FAILED",
            "TOPIC_AUTHORIZATION_FAILED",
        )
        if hasattr(KafkaError, name)
    }
    while True:
        try:
            return dict(admin.list_topics(timeout=attempt_s).topics)
        except KafkaException as exc:
            error = exc.args[0]
            why = error.str() if hasattr(error, "str") else str(error)
            code = error.code() if hasattr(error, "code") else None
            if code in refused or (hasattr(error, "fatal") and error.fatal()):
                # a wrong password or a missing grant does not heal by waiting
                raise SystemExit(f"Kafka at {bootstrap} refused this client: {why}") from None
            typer.echo(f"Kafka at {bootstrap} does not answer ({why}); waiting", err=True)


def _wait_listed(
    admin: AdminClient, name: str, partitions: int, timeout_s: float = CHANGELOG_VISIBLE_S
) -> None:
    """Until the broker's metadata lists ``name`` with ``partitions`` partitions, each with a
    leader: a creation the controller acknowledged can take a moment to reach the metadata
    Faust's consumer reads. Raises ``RuntimeError`` naming the topic when it does not."""
    deadline = time.monotonic() + timeout_s
    seen = "not listed"
    while True:
        meta = admin.list_topics(topic=name, timeout=5).topics.get(name)
        if meta is not None and meta.error is None:
            led = sum(1 for p in meta.partitions.values() if p.leader >= 0)
            if len(meta.partitions) == partitions and led == partitions:
                return
            seen = f"{len(meta.partitions)} partitions, {led} with a leader"
        elif meta is not None:
            seen = str(meta.error)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"changelog topic {name} is not ready after {timeout_s:.0f} s "
                f"({seen}; want {partitions} partitions with leaders): is "
                "every broker up?"
            )
        time.sleep(0.2)


def plain_process() -> Settings:
    """What a streams runtime outside the Faust worker needs first: the streams principal
    (before any client is built), INFO logs on stderr, its home; returns the settings."""

    from loraplane.kernel import kafka

    kafka.act_as(kafka.Principal.streams)
    from loraplane.kernel.config import get_settings
    from loraplane.kernel.log_lines import configure_logging

    configure_logging()
    settings = get_settings()
    settings.home.mkdir(parents=True, exist_ok=True)
    return settings


def run_until_signal(loop: Callable[[threading.Event], None], name: str) -> None:
    """``loop(stop)`` in a thread until it returns or SIGTERM/SIGINT sets ``stop`` (the main
    thread stays free for the signal, which a loop blocked inside librdkafka would delay);
    waits up to 30 s for it to end. An exception of the loop is raised here."""
    import signal

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    failure: list[BaseException] = []

    def run() -> None:
        try:
            loop(stop)
        except BaseException as exc:  # handed to the main thread
            failure.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    while thread.is_alive() and not stop.is_set():
        stop.wait(0.5)
    stop.set()
    thread.join(30)
    if failure:
        raise failure[0]


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        help="The Faust stream processors (registry, scores, planner).", no_args_is_help=True
    )

    @group.command("run")
    def run_cmd(
        agent: list[str] = typer.Option(
            [],
            "--agent",
            help="Run only this agent module (repeatable); default: all of "
            "loraplane.streams.app.AGENT_MODULES.",
        ),
        loglevel: str = typer.Option("info", "--loglevel", "-l"),
        metrics_port: int = typer.Option(
            0,
            "--metrics-port",
            min=0,
            max=65535,
            help="Serve loraplane_consumer_stuck_seconds per component on "
            "listen_host:PORT/metrics (0: none).",
        ),
    ) -> None:
        """Run the stream processors until SIGTERM/SIGINT; logs go to stdout."""
        import sys

        import faust

        from loraplane.kernel import kafka

        kafka.act_as(kafka.Principal.streams)  # before the app (built on import) reads it
        from loraplane.kernel.config import get_settings
        from loraplane.streams.app import AGENT_MODULES, load_agents
        from loraplane.streams.app import app as faust_app

        unknown = sorted(set(agent) - set(AGENT_MODULES))
        if unknown:
            raise typer.BadParameter(f"not in AGENT_MODULES: {', '.join(unknown)}")
        get_settings().home.mkdir(parents=True, exist_ok=True)  # Faust's datadir lives there
        load_agents(agent or AGENT_MODULES)
        for name in ensure_changelog_topics(get_settings(), faust_app):
            typer.echo(f"created changelog topic {name}")
        from loraplane.kernel.progress_metrics import serve_progress

        extra = []
        if "loraplane.streams.planner_agent" in (agent or AGENT_MODULES):
            from loraplane.streams.planner_agent import runtime

            extra.append(runtime.metrics())  # loraplane_planner_active
        # the Faust web server stays off
        serve_progress(metrics_port, extra, host=get_settings().listen_host)
        # faust.Worker (unlike `faust worker`) honours web_enabled=False: Faust binds no port.
        faust.Worker(
            faust_app, loglevel=loglevel, logfile=sys.stdout, stdout=sys.stdout, stderr=sys.stdout
        ).execute_from_commandline()

    @group.command("planner")
    def planner_cmd(
        base_model: str | None = typer.Option(
            None,
            "--base-model",
            help="Plan only this base model (its own lease); default: every base model.",
        ),
        metrics_port: int = typer.Option(
            0,
            "--metrics-port",
            min=0,
            max=65535,
            help="Serve loraplane_planner_active and loraplane_consumer_stuck_seconds on "
            "listen_host:PORT/metrics (0: none).",
        ),
    ) -> None:
        """Run one planner (active while it holds the lease, else standby) until
        SIGTERM/SIGINT, without a Faust worker (docs/reliability.md)."""
        from loraplane.kernel.progress_metrics import serve_progress
        from loraplane.streams.planner_runtime import PlannerRuntime

        settings = plain_process()
        runtime = PlannerRuntime(settings, base_model)
        serve_progress(metrics_port, [runtime.metrics()], host=settings.listen_host)
        run_until_signal(runtime.run, "planner")
        typer.echo("planner stopped")

    @group.command("scoring")
    def scoring_cmd(
        instance: str = typer.Option(
            "",
            "--instance",
            help="This keeper's name, unique among the running ones: its "
            "transactional id is {prefix}-scoring-INSTANCE (a restart "
            "under the same name fences its predecessor at once); "
            "default host-pid.",
        ),
        metrics_port: int = typer.Option(
            0,
            "--metrics-port",
            min=0,
            max=65535,
            help="Serve loraplane_consumer_stuck_seconds per component on "
            "listen_host:PORT/metrics (0: none).",
        ),
    ) -> None:
        """Run one scoring keeper (no Faust worker) until SIGTERM/SIGINT: it shares the
        requests partitions with every other keeper of the prefix (docs/scale.md)."""
        from loraplane.kernel.progress_metrics import serve_progress
        from loraplane.streams.score_keeper import PartitionMismatch, ScoreKeeper

        settings = plain_process()
        keeper = ScoreKeeper(settings, instance or None)
        serve_progress(metrics_port, host=settings.listen_host)
        typer.echo(f"scoring keeper {keeper.instance} starting")
        try:
            run_until_signal(keeper.run, "scoring")
        except PartitionMismatch as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
        typer.echo(f"scoring keeper {keeper.instance} stopped")

    app.add_typer(group, name="streams")
