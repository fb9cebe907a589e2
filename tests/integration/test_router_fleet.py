"""The fleet router with three workers on the real stack (router_env: Kafka, an s3proxy S3, three
`loraplane worker run` beside FAKE vLLMs with 2 GPU slots each, heartbeat 1 s), no planner:
what the router alone does to residency.

- a hot adapter's requests all go to the worker that holds it; no cold load elsewhere;
- the same trace (150 requests over 25 s, 6 adapters: three times one worker's 2 slots, as
  many as the fleet's 6) through the router, then round-robin straight to the worker
  gateways (a plain L4 balancer): cold loads (the workers' ``loraplane_cold_loads_total``) + base
  fallbacks (``X-Loraplane-Fallback``) of the router's at most a fifth of round-robin's.
  Round-robin thrashes: every worker sees every adapter and its own slot rule keeps 2;
  measured 5 + 5..9 = 10..14 against 12 + 110 = 122 (the router places each new version in its
  own free slot, router.routing "placed");
- a worker SIGKILLed (agent and vLLM) under load: every request sent gets an answer and
  none a 5xx (a request the killed worker did not answer is routed again under a request
  id of its own, docs/router.md), and its adapter is served from a GPU copy on another
  worker within the stated bound: 3 heartbeats (drain) + one drain pass + one heartbeat to
  see the new copy + the load (FAKE vLLM: well under a second) = 5 s + load, asserted
  <= 20 s for a loaded 2-core machine. A
  refused connection is re-routed at once, so traffic moves before the drain. The killed
  worker is then started again (as a supervisor would; it spools what its journal held) and
  every 200 answer has exactly one request_log row in ClickHouse (the metrics sink in this
  process, a database of the test's own).
The numbers are printed (pytest -s) for the report.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from loraplane.frontdoor.forwarded import NOT_RUN_HEADER
from loraplane.kernel.config import Settings
from loraplane.metrics import migrations
from loraplane.metrics.clickhouse import connect
from loraplane.metrics.sink import Sink, SinkConfig
from tests.integration.fault_report import report_fault
from tests.integration.metrics_env import drop_database, isolated
from tests.integration.router_env import KEY_A, WORKERS, Answer, Fleet, ask, running_fleet
from tests.integration.test_worker_e2e import _healthz, _up, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ADAPTERS = {f"a{i}": (40 + i, "tenant-a") for i in range(1, 7)}
TRACE_REQUESTS, TRACE_QPS, CONCURRENCY = 150, 6.0, 4


def replay(trace: list[str], urls: Iterator[str]) -> list[Answer]:
    """``trace`` at TRACE_QPS, CONCURRENCY at a time, each request to the next of ``urls``."""
    local = threading.local()

    def one(item: tuple[str, str]) -> Answer:
        if not hasattr(local, "s"):
            local.s = requests.Session()
        return ask(item[1], item[0], local.s)

    start = time.monotonic()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = []
        for i, adapter in enumerate(trace):
            time.sleep(max(0.0, start + i / TRACE_QPS - time.monotonic()))
            futures.append(pool.submit(one, (adapter, next(urls))))
        return [f.result() for f in futures]


@pytest.fixture(scope="module")
def fleet(stack: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with running_fleet(stack, tmp_path_factory.mktemp("fleet"), ADAPTERS, gpu_slots=2) as f:
        yield f


def test_requests_for_an_adapter_hot_on_one_worker_all_go_there(fleet: Fleet) -> None:
    fleet.load("w2", fleet.records["a1"])
    wait_for(lambda: fleet.health().get("gpu_copies", 0) >= 1, 60, "a1 hot on w2, seen")
    answers = replay(["a1"] * 24, itertools.repeat(fleet.router_url))
    assert {(a.status, a.worker, a.tier) for a in answers} == {(200, "w2", "gpu")}
    a1 = fleet.records["a1"].lora_name
    assert a1 in fleet.adapters_on("w2")
    assert a1 not in fleet.adapters_on("w1") | fleet.adapters_on("w3")  # no cold load


def test_the_router_costs_at_most_a_fifth_of_round_robins_cold_loads_and_fallbacks(
    fleet: Fleet,
) -> None:
    rng = random.Random(7)
    trace = [rng.choice(sorted(ADAPTERS)) for _ in range(TRACE_REQUESTS)]
    gateways = [f"http://127.0.0.1:{fleet.gateways[w]}" for w in WORKERS]
    cost = {}
    for name, urls in (
        ("router", itertools.repeat(fleet.router_url)),
        ("round-robin", itertools.cycle(gateways)),
    ):
        loads_before = fleet.cold_loads()
        answers = replay(trace, urls)
        loads = fleet.cold_loads() - loads_before
        fallbacks = sum(a.fallback for a in answers)
        statuses = Counter(a.status for a in answers)
        print(
            f"{name}: {loads} cold loads + {fallbacks} base fallbacks = "
            f"{loads + fallbacks}; {sum(a.tier in ('cold', 'host') for a in answers)} "
            f"cold/host arrivals, {sum(a.miss for a in answers)} misses of {len(answers)}; "
            f"HTTP {dict(statuses)}"
        )
        assert statuses == {200: len(trace)}, f"{name}: not every request answered"
        cost[name] = loads + fallbacks
    assert cost["round-robin"] > 0 and cost["router"] * 5 <= cost["round-robin"], cost


@contextlib.contextmanager
def request_log_rows(fleet: Fleet) -> Iterator[Callable[[list[str]], Counter[str]]]:
    """The metrics sink over the fleet's topics into a ClickHouse database of its own; yields
    a function: request ids -> their request_log rows under FINAL."""
    settings = fleet.settings.model_copy(update={"clickhouse": isolated(fleet.settings).clickhouse})
    migrations.migrate(settings)
    stop = threading.Event()
    runner = threading.Thread(
        target=Sink(settings, SinkConfig(max_wait_s=0.2)).run,
        args=(stop,),
        name="sink",
        daemon=True,
    )
    runner.start()

    def rows(ids: list[str]) -> Counter[str]:
        client = connect(settings)
        try:
            return Counter(
                {
                    rid: int(n)
                    for rid, n in client.execute(
                        "SELECT request_id, count() FROM request_log FINAL WHERE request_id IN "
                        "%(ids)s GROUP BY request_id",
                        {"ids": tuple(ids)},
                    )
                }
            )
        finally:
            client.disconnect()

    try:
        yield rows
    finally:
        stop.set()
        runner.join(30)
        drop_database(settings)


def test_a_killed_worker_loses_no_request_and_its_adapter_is_served_elsewhere(fleet: Fleet) -> None:
    def holders() -> list[str]:
        return [
            w
            for w in WORKERS
            if any(fleet.records[a].lora_name in fleet.adapters_on(w) for a in ADAPTERS)
        ]

    if not holders():  # run on its own (bench/faults.py): place the adapters first
        session = requests.Session()
        for adapter in ADAPTERS:
            ask(fleet.router_url, adapter, session)
        wait_for(holders, 30, "an adapter on some worker")
    victim = holders()[0]
    held = sorted(a for a in ADAPTERS if fleet.records[a].lora_name in fleet.adapters_on(victim))
    answers: list[Answer] = []
    stop = threading.Event()

    def load() -> None:
        session = requests.Session()
        for adapter in itertools.cycle(held):
            if stop.is_set():
                return
            answers.append(ask(fleet.router_url, adapter, session))

    with request_log_rows(fleet) as rows:
        threads = [threading.Thread(target=load) for _ in range(CONCURRENCY)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: len(answers) >= 20, 30, "traffic before the kill")
            killed_at = time.monotonic()
            fleet.kill(victim)  # SIGKILL its agent (and gateway) ...
            fleet.kill(f"vllm-{victim}")  # ... and its vLLM
            wait_for(lambda: fleet.health().get("workers") == 2, 30, f"{victim} drained")
            drained_s = time.monotonic() - killed_at

            def served_elsewhere() -> bool:
                late = [a for a in answers if a.at > killed_at]
                return all(
                    any(a.adapter == h and a.tier == "gpu" and a.worker != victim for a in late)
                    for h in held
                )

            wait_for(served_elsewhere, 60, f"{held} served from a GPU copy off {victim}")
            moved_s = (
                max(
                    min(
                        a.at
                        for a in answers
                        if a.at > killed_at
                        and a.adapter == h
                        and a.tier == "gpu"
                        and a.worker != victim
                    )
                    for h in held
                )
                - killed_at
            )
            sent_after = len(answers)
            wait_for(lambda: len(answers) >= sent_after + 20, 30, "traffic after the move")
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        # a supervisor starts the killed worker again: it spools what its journal held
        fleet.respawn(f"vllm-{victim}")
        wait_for(lambda: _up(fleet.vllms[victim] + "/health"), 30, "its FAKE vLLM again")
        fleet.respawn(victim)
        wait_for(lambda: _healthz(fleet.gateways[victim]), 90, f"{victim} /healthz again")
        ok = [a.request_id for a in answers if a.status == 200]
        wait_for(
            lambda: len(rows([r for r in ok if r])) == len(ok),
            90,
            f"a request_log row for each of the {len(ok)} answers",
        )
        per_id = rows([r for r in ok if r])
    kinds = Counter(a.kind for a in answers)
    five_xx = Counter(a.status for a in answers if a.status >= 500)
    print(
        f"killed {victim} (held {held}): drained after {drained_s:.1f}s, served from GPU "
        f"elsewhere after {moved_s:.1f}s; {len(answers)} requests: {dict(kinds)}; "
        f"{len(ok)} answered 200, rows per id {dict(Counter(per_id.values()))}"
    )
    assert drained_s <= 10
    assert moved_s <= 20
    assert kinds["no reply"] == 0  # none vanished
    # routed again elsewhere, never a server error
    assert not five_xx, (
        five_xx,
        [(a.adapter, a.status, a.worker, a.detail) for a in answers if a.status >= 500],
        fleet.tracebacks(),
    )
    failed = sum(n for k, n in kinds.items() if k.startswith("failed"))
    assert failed <= CONCURRENCY  # only those already inside the killed worker
    assert all(a.worker != victim for a in answers if a.at > killed_at + 1 and a.status == 200)
    assert all(ok) and all(per_id[r] == 1 for r in ok), [
        (r, per_id[r]) for r in ok if per_id[r] != 1
    ][:5]
    report_fault(
        "worker SIGKILL under load behind the router",
        answered=len(ok),
        stored=sum(1 for r in ok if per_id[r] == 1),
        lost=sum(1 for r in ok if not per_id[r]),
        duplicated=sum(per_id[r] - 1 for r in ok if per_id[r] > 1),
        recovered=True,
        down_s=drained_s,
        recovery_s=moved_s,
        note=f"answers {dict(kinds)}, no 5xx; drained by the router, served from GPU "
        "elsewhere; every 200 answer one request_log row (the killed worker "
        "started again, as a supervisor would, to spool its journal)",
    )


def holding(fleet: Fleet) -> list[str]:
    """The workers whose vLLM holds one of the module's adapters, placed first if none does
    (a test run on its own)."""

    def holders() -> list[str]:
        return [
            w
            for w in WORKERS
            if any(fleet.records[a].lora_name in fleet.adapters_on(w) for a in ADAPTERS)
        ]

    if not holders():
        session = requests.Session()
        for adapter in ADAPTERS:
            ask(fleet.router_url, adapter, session)
    return wait_for(holders, 30, "an adapter on some worker")


def test_a_worker_whose_vllm_is_killed_is_routed_around_until_it_is_back(fleet: Fleet) -> None:
    """Only the vLLM of a worker holding an adapter is SIGKILLed (the pod's vLLM container
    dies; its agent and gateway stay up, heartbeat and answer /healthz): every request sent
    meanwhile is answered 200 by another worker, none 5xx (the gateway says the request
    never reached vLLM, the router parks the worker and routes it again); vLLM started again,
    the same agent serves the adapter from its GPU again."""
    victim = holding(fleet)[0]
    agent = fleet.procs[victim]
    on_victim = fleet.adapters_on(victim)
    name = sorted(a for a in ADAPTERS if fleet.records[a].lora_name in on_victim)[0]
    session = requests.Session()
    fleet.kill(f"vllm-{victim}")
    answers = [ask(fleet.router_url, name, session) for _ in range(30)]
    fleet.respawn(f"vllm-{victim}")
    wait_for(lambda: _up(fleet.vllms[victim] + "/health"), 30, "its FAKE vLLM again")
    gateway = f"http://127.0.0.1:{fleet.gateways[victim]}"

    def served_by_victim() -> bool:
        a = ask(gateway, name, session)
        return a.status == 200 and not a.fallback

    wait_for(served_by_victim, 60, f"{name} served from {victim}'s GPU again")
    assert agent.poll() is None  # the same agent process all along
    failed = [(a.status, a.worker, a.detail) for a in answers if a.status != 200]
    print(
        f"vLLM of {victim} killed: {len(answers)} requests for {name}, answered by "
        f"{dict(Counter(a.worker for a in answers))}, {len(failed)} not 200"
    )
    assert not failed, (failed, fleet.tracebacks())
    assert all(a.worker != victim for a in answers)


def test_a_worker_whose_vllm_hangs_is_routed_around_until_it_answers(fleet: Fleet) -> None:
    """The vLLM of a worker holding an adapter is SIGSTOPped (hung: the kernel still takes
    its connections, nothing answers). Once its agent's listing of vLLM times out, the
    gateway refuses requests as not run, and every request through the router is answered
    200 by another worker within seconds, where each used to wait out the gateway's 60 s
    read timeout for a 502. SIGCONT, and the same agent serves the adapter again."""
    victim = holding(fleet)[0]
    on_victim = fleet.adapters_on(victim)
    name = sorted(a for a in ADAPTERS if fleet.records[a].lora_name in on_victim)[0]
    gateway = f"http://127.0.0.1:{fleet.gateways[victim]}"
    session = requests.Session()
    vllm = fleet.procs[f"vllm-{victim}"]

    def refused_as_not_run() -> bool:
        try:  # a request sent before the agent saw the hang waits for vLLM: not for us
            resp = requests.post(
                gateway + "/v1/completions",
                timeout=3,
                headers={"Authorization": f"Bearer {KEY_A}"},
                json={"model": name, "prompt": "hello", "max_tokens": 2},
            )
        except requests.RequestException:
            return False
        return resp.status_code == 503 and resp.headers.get(NOT_RUN_HEADER) == "vllm_timeout"

    os.killpg(vllm.pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        wait_for(refused_as_not_run, 90, f"{victim}'s gateway refusing as not run")
        seen_after_s = time.monotonic() - stopped
        answers, waits = [], []
        for _ in range(20):
            sent = time.monotonic()
            answers.append(ask(fleet.router_url, name, session))
            waits.append(answers[-1].at - sent)
    finally:
        os.killpg(vllm.pid, signal.SIGCONT)

    def served_by_victim() -> bool:
        a = ask(gateway, name, session)
        return a.status == 200 and not a.fallback

    wait_for(served_by_victim, 90, f"{name} served from {victim}'s GPU again")
    failed = [(a.status, a.worker, a.detail) for a in answers if a.status != 200]
    print(
        f"vLLM of {victim} stopped: refused as not run after {seen_after_s:.1f} s; "
        f"{len(answers)} requests for {name}, answered by "
        f"{dict(Counter(a.worker for a in answers))}, {len(failed)} not 200, "
        f"slowest {max(waits):.2f} s"
    )
    assert not failed, (failed, fleet.tracebacks())
    assert all(a.worker != victim for a in answers)
    assert max(waits) < 20  # each was a 60 s wait and a 502
