"""``loraplane demo``, step by step: the whole control plane live on one machine.

1. the local stack (started only if it is not running; then stopped again at the end);
2. the tiny base model and the demo's LoRA adapters, built here or reused;
3. this run's namespace, keys, the Faust app, the ClickHouse sink, vLLM (real, or the FAKE
   one when asked), one worker agent + gateway per vLLM (two when memory allows) and the
   fleet router in front of them;
4. the adapters published through the signed CI path: gold ones, one platinum, one canary
   at 10%; then a schedules file announcing a peak;
5. a trace replayed through the fleet router (``loraplane router run``) with a burst and
   the scheduled peak, a canary promote and a rollback while traffic flows;
6. the per-adapter report from ClickHouse, checked against ClickHouse queried directly and
   against what the client sent, and the dashboard's URL;
7. everything left running until Ctrl-C (or ``--duration`` seconds), then stopped: exactly
   what the demo started, verified.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from rich.console import Console

from loraplane.demo import measure
from loraplane.demo.catalog import DEMO_CATALOG, Adapter, Artifacts
from loraplane.demo.expectations import Facts, evaluate
from loraplane.demo.namespace import RunSpace
from loraplane.demo.peak import ScheduledPeak, write_schedule
from loraplane.demo.replay import (
    Action,
    Outcome,
    Replayer,
    TrafficShape,
    plan,
    status_counts,
)
from loraplane.demo.results import summarize
from loraplane.demo.steps import Steps
from loraplane.demo.supervisor import Supervisor
from loraplane.demo.system import (
    ROOT,
    LiveSystem,
    SystemOptions,
    in_parallel,
    memory_available_bytes,
    stack_command,
    stack_healthy,
    workers_memory_allows,
)
from loraplane.kernel.config import Settings
from loraplane.simulator.scenario import Burst, Peak

__all__ = [
    "BURST_RANK",
    "PEAK_RANK",
    "DemoOptions",
    "hold",
    "lifecycle_actions",
    "platinum_names",
    "publish_catalog",
    "registry_complete",
    "replay",
    "report",
    "run_demo",
    "show_keys",
    "traffic",
]

BURST_RANK = 6  # sql-helper (bronze, rarely used): cold until the burst
PEAK_RANK = 5  # translate-fr: announced in the schedules file


@dataclass(frozen=True)
class DemoOptions:
    fake_vllm: bool = False
    replay_s: float = 180.0
    hold_s: float | None = None  # None: until Ctrl-C
    workers: int | None = None  # None: as memory allows
    max_qps: float = 3.0
    trace: Path | None = None


def traffic(options: DemoOptions) -> TrafficShape:
    d = options.replay_s
    return TrafficShape(
        duration_s=d,
        max_qps=options.max_qps,
        alpha=1.0,
        batch_fraction=0.2,
        bursts=(Burst(at_s=0.25 * d, duration_s=0.1 * d, share=0.6, rank=BURST_RANK),),
        peaks=(Peak(at_s=0.45 * d, duration_s=0.15 * d, qps=options.max_qps / 2, rank=PEAK_RANK),),
    )


def publish_catalog(system: LiveSystem) -> str:
    """Every adapter at version 1, promoted; canaries get version 2 at their percent."""

    def release(a: Adapter) -> None:
        system.publish(
            a.adapter_id, a.tenant_id, "1", system.artifacts.adapter_dir(a.seed), a.priority
        )
        system.lifecycle("promote", a.adapter_id, "1", reason="demo release")
        if a.canary_seed is not None:
            system.publish(
                a.adapter_id,
                a.tenant_id,
                "2",
                system.artifacts.adapter_dir(a.canary_seed),
                a.priority,
                canary_percent=a.canary_percent,
            )

    in_parallel(release, DEMO_CATALOG.adapters)
    tiers = {
        p: len(DEMO_CATALOG.with_priority(p)) for p in ("platinum", "gold", "silver", "bronze")
    }
    return (
        ", ".join(f"{n} {p}" for p, n in tiers.items() if n)
        + ", canary "
        + ", ".join(f"{a.adapter_id}@2 at {a.canary_percent:g}%" for a in DEMO_CATALOG.canaries)
    )


def registry_complete(system: LiveSystem) -> bool:
    views = system.registry()
    return all(
        aid in views and views[aid].active_version == "1" for aid in DEMO_CATALOG.ids
    ) and all(
        any(r.version == "2" and r.status == "canary" for r in views[a.adapter_id].versions)
        for a in DEMO_CATALOG.canaries
    )


def platinum_names(system: LiveSystem) -> set[str]:
    views = system.registry()
    return {
        r.lora_name
        for a in DEMO_CATALOG.with_priority("platinum")
        for r in views[a.adapter_id].versions
        if r.status == "active"
    }


def lifecycle_actions(system: LiveSystem, steps: Steps, replay_s: float) -> list[Action]:
    """The canary's promote at 60% of the replay and its rollback at 80%."""
    canary = DEMO_CATALOG.canaries[0]

    async def promote() -> None:
        await asyncio.to_thread(
            system.lifecycle, "promote", canary.adapter_id, "2", reason="canary looks good"
        )
        steps.note(
            f"[{_clock()}] promoted {canary.adapter_id}@2 (was canary at "
            f"{canary.canary_percent:g}%)"
        )

    async def rollback() -> None:
        await asyncio.to_thread(
            system.lifecycle, "rollback", canary.adapter_id, "2", reason="demo rollback"
        )
        steps.note(f"[{_clock()}] rolled {canary.adapter_id} back to version 1")

    return [(0.6 * replay_s, promote), (0.8 * replay_s, rollback)]


def _clock() -> str:
    return datetime.now(UTC).strftime("%H:%M:%S")


def replay(
    system: LiveSystem, steps: Steps, keys: dict[str, str], options: DemoOptions, console: Console
) -> list[Outcome]:
    shape = traffic(options)
    start = datetime.now(UTC) + timedelta(seconds=1)
    peak_def = shape.peaks[0]
    peak = ScheduledPeak.at(
        DEMO_CATALOG.adapters[peak_def.rank].adapter_id,
        start,
        peak_def.at_s,
        peak_def.duration_s,
        peak_def.qps,
    )
    write_schedule(system.space.schedules_path, [peak])
    steps.note(
        f"scheduled peak: {peak.adapter_id} at {peak.minute:%H:%M} UTC "
        f"(+{peak.at_s:.0f}s, {peak.qps:g} qps extra; cron '{peak.entry()['cron']}', "
        f"lead {peak.lead_minutes:g} min) in {system.space.schedules_path}"
    )
    burst = shape.bursts[0]
    steps.note(
        f"burst: {DEMO_CATALOG.adapters[burst.rank].adapter_id} takes "
        f"{burst.share:.0%} of requests from +{burst.at_s:.0f}s for "
        f"{burst.duration_s:.0f}s"
    )
    planned = plan(DEMO_CATALOG.adapters, shape, options.trace)
    replayer = Replayer(system.router_url, keys, concurrency=8)
    actions = lifecycle_actions(system, steps, shape.duration_s)
    source = options.trace or "synthetic arrivals (no trace found)"

    def run() -> list[Outcome]:
        with console.status("") as status:

            def tick(elapsed: float, p: Any) -> None:
                status.update(
                    f"replaying {source}: {elapsed:.0f}/{shape.duration_s:.0f}s, "
                    f"{p.sent}/{len(planned)} sent, {p.done} done, "
                    f"HTTP {dict(sorted(p.by_status.items()))}, "
                    f"{p.fallbacks} base-model fallbacks"
                )

            return asyncio.run(replayer.run(planned, actions, on_tick=tick))

    return steps.run(
        f"replay {len(planned)} requests over {shape.duration_s:.0f}s through the fleet router",
        run,
        _outcome_note,
    )


def _outcome_note(outcomes: list[Outcome]) -> str:
    hot = sum(o.tier == "gpu" for o in outcomes)
    workers = sorted({o.worker for o in outcomes if o.worker})
    return (
        f"HTTP {status_counts(outcomes)}, {hot} served hot, answered by "
        f"{', '.join(workers) or 'no worker'}, "
        f"{sum(o.fallback for o in outcomes)} by the base model, max lag "
        f"{max((o.lag_s for o in outcomes), default=0):.1f}s"
    )


def report(
    system: LiveSystem, steps: Steps, console: Console, since: datetime, outcomes: list[Outcome]
) -> bool:
    """Print ``loraplane report`` and check it against ClickHouse and the client."""
    settings = system.settings
    logged = sum(o.reached_worker for o in outcomes)  # the router's refusals log nothing
    at_router = sum(o.status != 0 and not o.reached_worker for o in outcomes)
    until = datetime.now(UTC)
    steps.run(
        "sink landed the request logs in ClickHouse",
        lambda: measure.wait_for_rows(
            lambda: measure.request_count(settings, since, until), logged
        ),
        lambda n: f"{n}/{logged}",
    )
    minutes = f"{math.ceil((datetime.now(UTC) - since).total_seconds() / 60) + 1}m"
    console.print(
        system.cli("report", "report", "--since", minutes),
        end="",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    rows = json.loads(system.cli("report-json", "report", "--since", minutes, "--json"))
    reported = sum(int(r.get("requests", 0)) for r in rows)
    window = (settings, since - timedelta(minutes=1), datetime.now(UTC))
    direct = measure.request_count(*window)
    shadow = measure.request_count(*window, shadow_only=True)  # golden sets: no client's
    agree = reported == direct == logged + shadow
    mark = "[green]✓[/]" if agree else "[red]✗[/]"
    console.print(
        f"{mark} report: {reported} requests; ClickHouse `SELECT count() FROM "
        f"{system.space.database}.request_log FINAL`: {direct}; answered to the "
        f"client: {logged} (by a worker; {at_router} refused by the router before "
        f"any worker); the workers' own golden-set checks: {shadow}",
        highlight=False,
    )
    recorded = measure.fetch(settings, since, datetime.now(UTC))
    checks = evaluate(
        "demo",
        recorded,
        summarize(recorded, status_counts(outcomes)),
        Facts(priorities={a.adapter_id: a.priority for a in DEMO_CATALOG.adapters}),
    )
    for c in checks:
        console.print(
            f"{'[green]PASS[/]' if c.passed else '[red]FAIL[/]'} {c.name}: {c.detail}",
            highlight=False,
        )
    return agree


def show_keys(console: Console, router_url: str, keys: dict[str, str]) -> None:
    """The router's URL and the tenants' API keys, shown once and only on a terminal: the
    demo writes a key to no file and no log, so output sent to a file gets the way to make
    one instead."""
    console.print(f"[bold]router:[/] {router_url}/v1/completions", highlight=False)
    try:
        terminal = console.file.isatty()
    except (AttributeError, ValueError):
        terminal = False
    if terminal:
        console.print(
            "[bold]API keys[/] (shown once, stored nowhere): "
            + ", ".join(f"{tenant} {key}" for tenant, key in keys.items()),
            highlight=False,
        )
    else:
        console.print(
            "API keys are shown on a terminal only; make one for tenant T with "
            "the variables above and `loraplane worker add-key --tenant T`",
            highlight=False,
        )


def hold(supervisor: Supervisor, console: Console, hold_s: float | None) -> None:
    """Until Ctrl-C or ``hold_s``; warns once about any child that dies meanwhile."""
    console.print(
        "everything keeps running; "
        + (f"stopping in {hold_s:.0f}s" if hold_s is not None else "Ctrl-C stops it")
    )
    deadline = None if hold_s is None else time.monotonic() + hold_s
    warned: set[str] = set()
    while deadline is None or time.monotonic() < deadline:
        for child in supervisor.children:
            if not child.alive() and child.name not in warned:
                warned.add(child.name)
                console.print(
                    f"[yellow]warning:[/] {child.name} exited "
                    f"({child.popen.returncode}); log {child.log_path}"
                )
        time.sleep(1.0)


def run_demo(base: Settings, options: DemoOptions, console: Console) -> bool:
    """The whole demo; True when the report agreed with ClickHouse. Stops what it started,
    also on Ctrl-C, SIGTERM and errors."""
    steps = Steps(console)
    started_stack = False
    if stack_healthy():
        steps.note("the local stack is already running (it stays running afterwards)")
    else:
        steps.run(
            "local stack: Kafka, ClickHouse, S3 (loraplane stack up)", lambda: stack_command("up")
        )
        started_stack = True
    space = RunSpace.fresh(base.home, "demo", secrets_dir=base.secrets_dir)
    artifacts = Artifacts(base.home / "demo")
    system_options = SystemOptions(fake_vllm=options.fake_vllm)
    workers = workers_memory_allows(options.workers, memory_available_bytes())
    agreed = False
    supervisor = Supervisor(space.log_dir, space.child_env(), ROOT)
    try:
        steps.run(
            "tiny base model + LoRA adapters (built here, no hub)",
            lambda: artifacts.ensure(DEMO_CATALOG),
            lambda n: f"{n} built, the rest reused from {artifacts.root}",
        )
        with supervisor:
            system = LiveSystem(supervisor, space, artifacts, system_options, space.settings(base))
            console.print(f"run {space.run_id}: logs in {space.log_dir}", highlight=False)
            keys = system.bring_up(steps, DEMO_CATALOG.tenants, workers)
            steps.run(
                "publish through the signed CI path (loraplane publish/promote)",
                lambda: publish_catalog(system),
            )
            steps.run(
                "registry accepted every release",
                lambda: system.wait(lambda: registry_complete(system), 90, "the registry"),
            )
            steps.run(
                "platinum adapter prewarmed on a GPU before any request",
                lambda: system.wait(
                    lambda: platinum_names(system) <= system.hot_names(),
                    120,
                    "the platinum adapter on a GPU",
                ),
            )
            since = datetime.now(UTC).replace(microsecond=0)
            outcomes = replay(system, steps, keys, options, console)
            agreed = report(system, steps, console, since, outcomes)
            dashboard = steps.run(
                "dashboard (loraplane dashboard, loopback only)", system.start_dashboard
            )
            console.print(
                f"[bold]dashboard:[/] {dashboard}\n[bold]query this run:[/] "
                + " ".join(f"{k}={v}" for k, v in space.env().items() if k != "PYTHONUNBUFFERED")
                + " loraplane report",
                highlight=False,
            )
            show_keys(console, system.router_url, keys)
            try:
                hold(supervisor, console, options.hold_s)
            except KeyboardInterrupt:
                console.print("stopping …")
    finally:
        console.print(f"stopped {supervisor.stopped} processes (children and theirs)")
        left = supervisor.leftovers()
        console.print(
            "[green]✓[/] no process left behind" if not left else f"[red]✗ still alive:[/] {left}"
        )
        if started_stack:
            steps.run("stop the local stack the demo started", lambda: stack_command("down"))
    return agreed
