"""The router's flow control: the pure queues (loraplane/router/flow_control.py) by property and by
example, and the ATTACK test through the real router: one tenant floods batch requests at
a slow worker while another sends interactive ones."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from itertools import pairwise
from typing import Any

import pytest
from aiohttp import ClientSession, ClientTimeout
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from loraplane.kernel import metric_names as m
from loraplane.kernel.policy import QueueBudget, RequestBudgets, TenantLimits
from loraplane.router.flow_control import (
    BANDS,
    FlowControl,
    Ticket,
    TicketState,
    band_of,
)
from loraplane.router.routing import FleetIndex
from loraplane.router.server import Fleet, Router, serving_versions
from loraplane.schemas.adapter import Priority
from loraplane.schemas.reasons import QueueRefusal
from loraplane.schemas.request_log import RequestClass
from loraplane.workers.gateway import Gateway
from tests.unit.test_gateway import (
    AUTH_A,
    AUTH_B,
    BASE,
    KEYS,
    RECORDS,
    Answer,
    FakeServing,
    ListSink,
)
from tests.unit.test_planner import POLICY, worker
from tests.unit.test_router import SECRET, at, router_metrics

TTL = {
    RequestClass.interactive: 1.0,
    RequestClass.canary: 10.0,
    RequestClass.batch: 10.0,
    RequestClass.shadow: 10.0,
}
INTER = band_of(RequestClass.interactive, Priority.silver)
B = band_of(RequestClass.batch, Priority.silver)


def flow(per_band: int = 100, per_tenant: int = 100) -> FlowControl:
    return FlowControl(max_queued_per_band=per_band, max_queued_per_tenant=per_tenant, ttl_s=TTL)


def queued(f: FlowControl, band: Any, tenant: str, now: float = 0.0, base: str = "llama") -> Ticket:
    got = f.offer(base, band, tenant, 0, now)
    assert isinstance(got, Ticket) and got.state is TicketState.queued
    return got


# ---- by example -----------------------------------------------------------------------------
def test_bands_are_class_first_then_priority() -> None:
    order = sorted(BANDS.values(), key=lambda b: b.rank)
    assert [b.label for b in order[:5]] == [
        "interactive-platinum",
        "interactive-gold",
        "interactive-silver",
        "interactive-bronze",
        "canary-platinum",
    ]
    assert order[-1].label == "shadow-bronze"


def test_the_fast_path_admits_at_once_while_nothing_queues() -> None:
    f = flow()
    first = f.offer("llama", B, "t1", 2, 0.0)
    assert isinstance(first, Ticket) and first.state is TicketState.admitted
    assert f.in_flight == {"llama": 1} and not f.queued and not f.depth
    f.offer("llama", B, "t1", 2, 0.0)
    third = f.offer("llama", INTER, "t2", 2, 0.0)
    assert isinstance(third, Ticket) and third.state is TicketState.queued
    step = f.release(first, 2, 0.5)
    assert step.admitted == [third] and third.state is TicketState.admitted
    assert f.waits[("llama", INTER)].total == 1 and f.waits[("llama", INTER)].sum_s == 0.5


def test_bounds_refuse_with_their_reason() -> None:
    f = flow(per_band=3, per_tenant=2)
    queued(f, B, "t1"), queued(f, B, "t1")
    assert f.offer("llama", B, "t1", 0, 0.0) is QueueRefusal.tenant_queue_full
    queued(f, B, "t2")
    assert f.offer("llama", B, "t3", 0, 0.0) is QueueRefusal.queue_full
    queued(f, INTER, "t3")  # another band has its own room
    assert f.refused[("llama", B, QueueRefusal.tenant_queue_full)] == 1
    assert f.refused[("llama", B, QueueRefusal.queue_full)] == 1


def test_ttl_and_withdrawal() -> None:
    f = flow()
    late = queued(f, INTER, "t1", now=0.0)
    gone = queued(f, B, "t2", now=0.0)
    step = f.pump("llama", 5, 1.0)  # interactive TTL is 1 s: at 1.0 it is over
    assert step.expired == [late] and late.state is TicketState.expired
    assert step.admitted == [gone]
    again = queued(f, B, "t2", now=2.0)
    assert f.withdraw(again, 2.1) and again.state is TicketState.withdrawn
    assert not f.withdraw(again, 2.2)  # once
    assert f.withdrawn[("llama", B)] == 1 and not f.queued
    assert f.refused[("llama", INTER, QueueRefusal.queue_timeout)] == 1
    with pytest.raises(ValueError):
        f.release(again, 1, 3.0)


# ---- by property ----------------------------------------------------------------------------
bands = st.sampled_from(sorted(BANDS.values(), key=lambda b: b.rank))
tenants = st.sampled_from(["t1", "t2", "t3", "t4"])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(bands, tenants), min_size=1, max_size=60), st.integers(1, 4))
def test_strict_priority_and_tenant_turns(arrivals: list[tuple[Any, str]], limit: int) -> None:
    """Everything queued behind a full base model, then drained one release at a time:
    bands come out best first, and inside a band no tenant is served twice while another
    tenant of the band waits."""
    f = flow()
    busy = [f.offer("llama", B, "x", limit, 0.0) for _ in range(limit)]
    tickets = [queued(f, band, tenant) for band, tenant in arrivals]
    order: list[Ticket] = []
    running = [t for t in busy if isinstance(t, Ticket)]
    while running:
        step = f.release(running.pop(0), limit, 0.1)
        order += step.admitted
        running += step.admitted
    assert sorted(order, key=id) == sorted(tickets, key=id)  # each once, none lost
    ranks = [t.band.rank for t in order]
    assert ranks == sorted(ranks)
    for band in {t.band for t in order}:
        seq = [t.tenant for t in order if t.band == band]
        for tenant in set(seq):
            at_ = [i for i, x in enumerate(seq) if x == tenant]
            for i, j in pairwise(at_):
                between = Counter(seq[i + 1 : j])
                assert all(n <= 1 for n in between.values()), (tenant, seq)


ops = st.one_of(
    st.tuples(st.just("offer"), st.sampled_from(["a", "b"]), bands, tenants),
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("withdraw"), st.integers(0, 50)),
    st.tuples(st.just("tick"), st.floats(0.0, 3.0)),
    st.tuples(st.just("pump"), st.sampled_from(["a", "b"])),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(ops, max_size=120), st.integers(1, 3), st.integers(1, 6), st.integers(1, 4))
def test_invariants_under_any_sequence(
    script: list[tuple[Any, ...]], limit: int, per_band: int, per_tenant: int
) -> None:
    """Bounds never exceeded, in flight never over the limit, nobody admitted after its
    deadline, admitted or dropped once, nothing lost, and a free slot never left idle while
    something of that base model waits."""
    f = flow(per_band, per_tenant)
    now = 0.0
    offered: list[Ticket] = []
    admitted_at: dict[int, float] = {}

    def note(step_admitted: list[Ticket]) -> None:
        for t in step_admitted:
            assert id(t) not in admitted_at, "admitted twice"
            assert now < t.deadline, "admitted past its TTL"
            admitted_at[id(t)] = now

    for op in script:
        if op[0] == "offer":
            got = f.offer(op[1], op[2], op[3], limit, now)
            if isinstance(got, Ticket):
                offered.append(got)
                if got.state is TicketState.admitted:
                    note([got])
                else:
                    note(f.pump(op[1], limit, now).admitted)
        elif op[0] in ("release", "withdraw") and offered:
            t = offered[op[1] % len(offered)]
            if op[0] == "release" and t.state is TicketState.admitted:
                note(f.release(t, limit, now).admitted)
            elif op[0] == "withdraw":
                was = t.state
                assert f.withdraw(t, now) == (was is TicketState.queued)
        elif op[0] == "tick":
            now += op[1]
        elif op[0] == "pump":
            note(f.pump(op[1], limit, now).admitted)
        states = Counter((t.base, t.state) for t in offered)
        for base in ("a", "b"):
            assert f.in_flight.get(base, 0) == states[(base, TicketState.admitted)] <= limit
            assert f.queued.get(base, 0) == states[(base, TicketState.queued)]
        for (base, band), n in f.depth.items():
            waiting = [
                t
                for t in offered
                if t.state is TicketState.queued and (t.base, t.band) == (base, band)
            ]
            assert n == len(waiting) <= per_band
            assert all(n <= per_tenant for n in Counter(t.tenant for t in waiting).values())
    # drain: everything ends in one final state
    now += 100.0
    for base in ("a", "b"):
        f.pump(base, limit, now)
    assert not f.queued and all(t.state is not TicketState.queued for t in offered)


# ---- ATTACK: a batch flood at a slow worker beside interactive traffic ----------------------
class SlowServing(FakeServing):
    """A worker whose vLLM takes ``delay_s`` per request; it remembers each prompt."""

    delay_s = 0.15
    prompts: list[str]

    @asynccontextmanager
    async def completion(self, path: str, body: dict[str, Any]) -> AsyncIterator[Answer]:
        self.prompts.append(body.get("prompt", ""))
        await asyncio.sleep(self.delay_s)
        yield Answer(
            json.dumps({"model": body["model"], "usage": {"completion_tokens": 1}}).encode()
        )


@asynccontextmanager
async def slow_fleet(
    queues: QueueBudget, **budgets: Any
) -> AsyncIterator[tuple[Router, str, SlowServing, ClientSession]]:
    limits = TenantLimits(max_concurrent=10_000, tokens_per_minute=10**9, burst_tokens=10**9)
    rb = RequestBudgets(tenants=limits, queues=queues, **budgets)
    serving = SlowServing(hot={RECORDS[2].lora_name, RECORDS[3].lora_name}, worker_id="w1")
    serving.prompts = []
    gateway = Gateway(serving, api_keys=KEYS, budgets=rb, sink=ListSink(), router_secret=SECRET)
    gw = TestServer(gateway.app(), host="127.0.0.1")
    await gw.start_server()
    fleet = Fleet(FleetIndex(POLICY, 5.0), ListSink(), "router-t")
    fleet.index.update(
        at(
            worker("w1", gpu=[RECORDS[2], RECORDS[3]], slots=4, base=RECORDS[2].base_model),
            datetime.now(UTC).timestamp(),
            str(gw.make_url("")).rstrip("/"),
            max_lora_rank=64,
        )
    )
    fleet.versions = serving_versions(list(RECORDS))
    router = Router(fleet, api_keys=KEYS, budgets=rb, secret=SECRET)
    rt = TestServer(router.app(), host="127.0.0.1")
    await rt.start_server()
    try:
        async with ClientSession() as http:
            yield router, str(rt.make_url("")).rstrip("/"), serving, http
    finally:
        await rt.close()
        await gw.close()


async def _post(
    http: ClientSession,
    url: str,
    model: str,
    auth: dict[str, str],
    request_class: str,
    prompt: str = "q",
) -> tuple[int, dict[str, Any], float]:
    t = time.monotonic()
    async with http.post(
        url + "/v1/completions",
        json={"model": model, "prompt": prompt},
        headers={**auth, "X-Request-Class": request_class},
    ) as resp:
        body = await resp.json()
        return resp.status, {"retry": resp.headers.get("Retry-After"), **body}, time.monotonic() - t


@pytest.mark.asyncio(loop_scope="session")
async def test_a_batch_flood_does_not_starve_interactive_traffic() -> None:
    """Tenant B floods 60 batch requests at a worker that serves 2 at a time, 0.15 s each;
    tenant A's interactive requests, sent meanwhile, go before every queued batch request
    (while one waits, at most two rounds of the 2 in flight finish: those in flight when it
    was sent and those a slot freed before it reached the queue went to; never the 8 queued)
    and all succeed; the flood is mostly 429 ``queue_full`` with Retry-After, never
    forwarded past the queue bound. Counted in finished requests, not seconds, so a loaded
    machine does not change the verdict."""
    queues = QueueBudget(max_in_flight_per_worker=2, max_queued_per_band=8, max_queued_per_tenant=8)

    async def finished(
        call: Awaitable[tuple[int, dict[str, Any], float]],
    ) -> tuple[int, dict[str, Any], float, float]:
        status, body, took = await call
        return status, body, took, time.monotonic()

    async with slow_fleet(queues) as (router, url, serving, http):
        flood = [
            asyncio.create_task(finished(_post(http, url, "other", AUTH_B, "batch")))
            for _ in range(60)
        ]
        await asyncio.sleep(0.05)  # the flood is in: 2 in flight, 8 queued, the rest refused
        interactive = []
        for _ in range(4):
            sent = time.monotonic()
            interactive.append(
                (sent, await finished(_post(http, url, "sql", AUTH_A, "interactive")))
            )
        flooded_at = await asyncio.gather(*flood)
        text = await router_metrics(router, http)
    flooded = [(s, b, w) for s, b, w, _ in flooded_at]
    assert [r[0] for _, r in interactive] == [200] * 4
    served_at = [at for s, _, _, at in flooded_at if s == 200]
    for sent, (_, _, _, done) in interactive:  # FIFO would let all 8 queued finish first
        assert sum(sent < at < done for at in served_at) <= 2 * 2, (sent, done, served_at)
    statuses = Counter(s for s, _, _ in flooded)
    assert statuses[200] == 10 and statuses[429] == 50, statuses  # 2 + 8 served
    refused = [b for s, b, _ in flooded if s == 429]
    assert {b["error"]["type"] for b in refused} == {"queue_full"}
    assert {b["retry"] for b in refused} == {"5"}  # batch.retry_after_s
    assert len(serving.prompts) == 14  # 10 batch + 4 interactive reached vLLM, no more
    assert router.flow.in_flight == {} and not router.flow.queued
    samples = {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for f in text_string_to_metric_families(text)
        for x in f.samples
    }
    batch = (("band", "batch-silver"), ("base_model", "tiny-llama"))
    assert samples[(m.ROUTER_QUEUE_REJECTIONS, (*batch, ("reason", "queue_full")))] == 50
    assert samples[(m.ROUTER_QUEUE_DEPTH, batch)] == 0
    assert (
        m.ROUTER_QUEUE_WAIT_SECONDS + "_count",
        (("band", "interactive-silver"), ("base_model", "tiny-llama")),
    ) in samples


@pytest.mark.asyncio(loop_scope="session")
async def test_a_queued_request_times_out_or_leaves_without_being_forwarded() -> None:
    queues = QueueBudget(max_in_flight_per_worker=1, interactive_ttl_ms=200)
    async with slow_fleet(queues) as (router, url, serving, http):
        serving.delay_s = 0.6
        busy = asyncio.create_task(_post(http, url, "sql", AUTH_A, "interactive", "busy"))
        await asyncio.sleep(0.05)
        status, body, waited = await _post(http, url, "sql", AUTH_A, "interactive", "late")
        assert status == 503 and body["error"]["type"] == "queue_timeout"
        assert body["retry"] == "2" and 0.15 < waited < 0.5
        with pytest.raises(TimeoutError):  # a client that gives up while queued
            async with http.post(
                url + "/v1/completions",
                json={"model": "sql", "prompt": "gone"},
                headers={**AUTH_A, "X-Request-Class": "batch"},
                timeout=ClientTimeout(total=0.1),
            ) as resp:
                await resp.read()
        await busy
        await asyncio.sleep(0.3)
        assert serving.prompts == ["busy"]  # neither the late nor the gone one was forwarded
        assert router.flow.withdrawn[(BASE, band_of(RequestClass.batch, Priority.silver))] == 1
        assert not router.flow.queued and router.flow.in_flight == {}
