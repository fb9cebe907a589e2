"""The fleet router: the pure routing decision (loraplane/router/routing.py), the forwarded-tenant
HMAC (frontdoor/forwarded.py) and the router in front of real gateways (router/server.py),
in one process with FakeServing workers."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import hmac
import itertools
import json
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from secrets import token_hex
from typing import Any

import pytest
from aiohttp import ClientPayloadError, ClientSession
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from loraplane.frontdoor.forwarded import (
    HOLD_HEADER,
    MAX_REFUSAL_HOLD_S,
    MAX_SKEW_S,
    NOT_RUN_HEADER,
    PERMANENT_STATUS,
    REFUSAL_ANSWER_BYTES,
    REROUTE_HEADER,
    SIGNATURE_HEADER,
    TENANT_HEADER,
    VERSION_HEADER,
    VERSION_REASON_HEADER,
    Forward,
    Replays,
    Target,
    outdated,
    refusal_hold,
    refused_by_worker,
    sign,
    verify,
)
from loraplane.frontdoor.gateway_proof import proof, proven
from loraplane.kernel.bus import Record
from loraplane.kernel.policy import RequestBudgets
from loraplane.router.routing import FleetIndex, RouteKind
from loraplane.router.server import (
    MAX_REFUSALS,
    MAX_UNPROVEN,
    PROBE_TIMEOUT_S,
    PROOF_RETRY_S,
    PROOFS_IN_FLIGHT,
    REFUSAL_MEMORY_S,
    Fleet,
    Refusals,
    Router,
    RouterMetrics,
    _watch_fleet,
    attempt_id,
    serving_versions,
)
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus
from loraplane.schemas.commands import CommandAction
from loraplane.schemas.dead_letter import DeadLetter
from loraplane.schemas.reasons import ArtifactReason, ServingRefusal, VllmErrorCode, VllmFailure
from loraplane.schemas.request_log import RequestLog
from loraplane.schemas.worker_state import WorkerState
from loraplane.streams.scores import score_key
from loraplane.workers.agent import WorkerConfig
from loraplane.workers.gateway import Gateway, refused_here
from loraplane.workers.vllm_client import VllmError
from tests.unit.test_gateway import (
    AUTH_A,
    BASE,
    KEYS,
    RECORDS,
    FailingUpstream,
    FakeServing,
    ListSink,
    session_for,
)
from tests.unit.test_gateway import record as tenant_a_record
from tests.unit.test_planner import (
    NOW,
    POLICY,
    busy,
    cmds,
    plan,
    record,
    scores,
    views,
    worker,
)

SECRET = b"s" * 32
NONCE = "0" * 16  # a forward's own, where one forward is signed


def at(state: WorkerState, ts: float, url: str = "", **update: Any) -> WorkerState:
    return state.model_copy(
        update={
            "ts": datetime.fromtimestamp(ts, UTC),
            "gateway_url": url or f"http://{state.worker_id}",
            **update,
        }
    )


def index(*states: WorkerState, heartbeat_s: float = 5.0) -> FleetIndex:
    fleet = FleetIndex(POLICY, heartbeat_s)
    for s in states:
        fleet.update(s)
    return fleet


# ---- the decision ---------------------------------------------------------------------------
def test_gpu_copy_then_host_copy_then_free_slot_then_cold_budget() -> None:
    a = record("a")
    hot = at(worker("w3", gpu=[a], slots=1), NOW)
    warm = at(worker("w2", host=[a], slots=1), NOW)
    empty = at(worker("w1", slots=4), NOW)
    assert index(hot, warm, empty).route(a, NOW, {}).worker_id == "w3"
    assert index(warm, empty).route(a, NOW, {}).kind is RouteKind.host
    route = index(empty, at(worker("w0", slots=2), NOW)).route(a, NOW, {})
    assert (route.worker_id, route.kind) == ("w1", RouteKind.free_slot)  # most free slots
    full = at(worker("w4", gpu=[record("x")], slots=1), NOW)
    route = index(full).route(a, NOW, {})
    assert (route.worker_id, route.kind) == ("w4", RouteKind.cold_budget)


def test_a_free_slot_counts_only_within_the_budget_the_worker_reports_capped() -> None:
    """Rule 3 skips a worker out of cold-load budget: the budget it reports in its heartbeat
    (lowered by its measured load cost), never more than the policy's (attack: a heartbeat
    claiming a huge budget gets no more cold requests than the policy allows)."""
    a = record("a")
    spent = POLICY.cold_loads_per_minute_per_worker
    for reported, loads, kind in (
        (2, 2, RouteKind.cold_budget),
        (2, 1, RouteKind.free_slot),
        (10_000, spent, RouteKind.cold_budget),
    ):
        w = at(worker("w1", slots=4), NOW, cold_load_budget=reported, cold_loads_last_minute=loads)
        assert index(w).route(a, NOW, {}).kind is kind, (reported, loads)


def test_least_in_flight_among_copies_and_drained_and_rank_fit() -> None:
    a = record("a")
    w1, w2 = at(worker("w1", gpu=[a]), NOW), at(worker("w2", gpu=[a]), NOW)
    assert index(w1, w2).route(a, NOW, {"w1": 3, "w2": 1}).worker_id == "w2"
    assert index(w1, w2).route(a, NOW, {}).worker_id == "w1"  # ties: lowest id
    taking_turns = index(w1, w2)  # idle copies take turns: an extra copy shares the traffic
    assert [taking_turns.route(a, NOW, {}).worker_id for _ in range(4)] == ["w1", "w2"] * 2
    assert taking_turns.route(a, NOW, {"w1": 1}).worker_id == "w2"  # busy first, turns second
    stale = at(worker("w1", gpu=[a]), NOW - 16)  # > 3 heartbeats of 5 s
    assert index(stale, w2).route(a, NOW, {}).worker_id == "w2"
    assert index(stale).route(a, NOW, {}) is None
    fleet = index(stale, w2)
    assert fleet.drain(NOW).gone == ["w1"] and set(fleet.workers) == {"w2"}
    big = a.model_copy(update={"rank": 32})
    small = at(worker("w1", gpu=[a], slots=4), NOW, max_lora_rank=16)
    assert index(small).route(big, NOW, {}) is None  # never below the adapter's rank
    assert index(small).route(a, NOW, {}).worker_id == "w1"
    other_base = at(worker("w9", gpu=[a], base="mistral"), NOW)
    assert index(other_base).route(a, NOW, {}) is None


def test_an_older_state_never_replaces_a_newer_one() -> None:
    a = record("a")
    fleet = index(at(worker("w1", gpu=[a]), NOW))
    fleet.update(at(worker("w1"), NOW - 1))
    assert fleet.route(a, NOW, {}).kind is RouteKind.gpu
    fleet.update(at(worker("w1"), NOW + 1))
    assert fleet.route(a, NOW, {}).kind is RouteKind.free_slot


def test_new_versions_in_the_heartbeats_lag_spread_and_follow_their_placement() -> None:
    """Between two heartbeats the router's own placements count as taken slots: three new
    versions go to three slots, not all to the worker that looked emptiest; each one's next
    requests follow it until its copy shows; then it is a plain GPU holder."""
    a, b, c = record("a"), record("b"), record("c")
    fleet = index(at(worker("w1", slots=2), NOW), at(worker("w2", slots=1), NOW), heartbeat_s=1.0)
    first = [fleet.route(r, NOW, {}) for r in (a, b, c)]
    assert [(r.worker_id, r.kind) for r in first] == [
        ("w1", RouteKind.free_slot),
        ("w1", RouteKind.free_slot),
        ("w2", RouteKind.free_slot),
    ]
    again = fleet.route(b, NOW + 0.5, {"w1": 9})
    assert (again.worker_id, again.kind) == ("w1", RouteKind.placed)  # in flight or not
    fleet.update(at(worker("w1", gpu=[b], slots=2), NOW + 1))  # b shows, a is still loading
    assert fleet.route(b, NOW + 1, {}).kind is RouteKind.gpu
    assert fleet.route(a, NOW + 1, {}).kind is RouteKind.placed
    d = record("d")  # every slot is taken or placed: the cold budget, and it is placed too
    assert fleet.route(d, NOW + 1, {}).kind is RouteKind.cold_budget
    fleet.update(at(worker("w1", gpu=[b], slots=2), NOW + 4))
    fleet.update(at(worker("w2", slots=1), NOW + 4))
    late = fleet.route(a, NOW + 4.5, {})  # 3 heartbeats and still not shown: placed anew
    assert (late.worker_id, late.kind) == ("w1", RouteKind.free_slot)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.integers(0, 4),
            st.integers(1, 4),
            st.sampled_from([None, 0.5, 0.95]),
            st.sampled_from([8, 16, 64]),
        ),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from([8, 16, 32]),
)
def test_a_new_copy_goes_where_the_planner_would_load_it(
    shape: list[tuple[int, int, float | None, int]], rank: int
) -> None:
    """The router's free-slot choice is the planner's rule-5 target for the same fleet,
    ``max_lora_rank`` fit included (the residents are in demand too, so no other rule frees
    a slot in the same tick)."""
    a = record("a").model_copy(update={"rank": rank})
    states = []
    for i, (used, extra, hbm, max_rank) in enumerate(shape):
        residents = [record(f"x{i}-{j}") for j in range(used)]
        states.append(
            worker(f"w{i}", gpu=residents, slots=used + extra, hbm=hbm).model_copy(
                update={"max_lora_rank": max_rank}
            )
        )
    residents = [record(x.adapter_id) for s in states for x in s.adapters]
    demand = {**scores(a=5.0), **{score_key(r.adapter_id, "1"): busy(1.0) for r in residents}}
    p = plan(views(a, *residents), demand, states, POLICY, NOW)  # residents stay: hot too
    loads = [c for c in cmds(p, CommandAction.load_gpu) if c.adapter_id == "a"]
    route = index(*(at(s, NOW) for s in states)).route(a, NOW, {})
    if loads:
        assert route is not None and route.kind is RouteKind.free_slot
        assert route.worker_id == loads[0].worker_id
    else:
        assert route is None or route.kind is RouteKind.cold_budget


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["gpu", "host", "none"]),
            st.integers(1, 64),
            st.integers(0, 40),
            st.integers(0, 5),
        ),
        min_size=1,
        max_size=8,
    ),
    st.integers(1, 64),
)
def test_routing_properties(fleet: list[tuple[str, int, int, int]], rank: int) -> None:
    """Whatever the fleet: never a drained worker or one whose rank is too small; a GPU copy
    wins over a host copy, which wins over a new load."""
    a = record("a").model_copy(update={"rank": rank})
    states, in_flight = [], {}
    for i, (tier, max_rank, age, load) in enumerate(fleet):
        s = worker(
            f"w{i}", gpu=[a] if tier == "gpu" else [], host=[a] if tier == "host" else [], slots=2
        )
        states.append(at(s, NOW - age, max_lora_rank=max_rank))
        in_flight[f"w{i}"] = load
    route = index(*states).route(a, NOW, in_flight)
    eligible = {f"w{i}": t for i, (t, r, age, _) in enumerate(fleet) if r >= rank and age <= 15}
    if not eligible:
        assert route is None
        return
    assert route is not None and route.worker_id in eligible
    best = "gpu" if "gpu" in eligible.values() else "host" if "host" in eligible.values() else None
    if best is not None:
        assert route.kind.value == best and eligible[route.worker_id] == best
        peers = [w for w, t in eligible.items() if t == best]
        assert in_flight[route.worker_id] == min(in_flight[w] for w in peers)


# ---- the forwarded tenant -------------------------------------------------------------------
def test_the_signature_binds_tenant_request_body_class_version_and_time() -> None:
    fwd = Forward("tenant-a", "interactive", "2", "canary", "1")
    to = Target("POST", "/v1/completions")
    sig = sign(SECRET, fwd, to, "r1", b"{}", 1000.0, worker_id="w1", nonce=NONCE)
    assert verify(SECRET, fwd, to, "r1", b"{}", sig, 1010.0, worker_id="w1")
    for other in (
        Forward("tenant-b", "interactive", "2", "canary", "1"),
        Forward("tenant-a", "batch", "2", "canary", "1"),
        Forward("tenant-a", "interactive", "1", "canary", "1"),
        Forward("tenant-a", "interactive", "2", "active", "1"),
        Forward("tenant-a", "interactive", "2", "canary", ""),
        Forward("tenant-a", "interactive", "2", "canary", "1", reroute=True),
    ):
        assert not verify(SECRET, other, to, "r1", b"{}", sig, 1010.0, worker_id="w1")
    assert not verify(SECRET, fwd, to, "r2", b"{}", sig, 1010.0, worker_id="w1")
    assert not verify(SECRET, fwd, to, "r1", b'{"x":1}', sig, 1010.0, worker_id="w1")
    assert not verify(SECRET, fwd, to, "r1", b"{}", sig, 1031.0, worker_id="w1")  # expired
    assert not verify(b"t" * 32, fwd, to, "r1", b"{}", sig, 1010.0, worker_id="w1")
    assert not verify(None, fwd, to, "r1", b"{}", sig, 1010.0, worker_id="w1")
    for junk in ("", "x", "1000.", "abc." + "0" * 64, sig + "0", sig[3:], "v1" + sig[2:]):
        assert not verify(SECRET, fwd, to, "r1", b"{}", junk, 1010.0, worker_id="w1")


_TARGETS = st.builds(
    Target,
    st.sampled_from(["POST", "GET", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "post"]),
    st.one_of(
        st.sampled_from(
            [
                "/v1/completions",
                "/v1/chat/completions",
                "/v1/completions?",
                "/v1/completions?stream=true",
                "/v1/completions/",
                "//v1/completions",
                "/v1/%63ompletions",
                "/v1/load_lora_adapter",
                "/healthz",
                "/v1/completions#x",
                "/v1/completions\nPOST",
            ]
        ),
        st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(
            lambda t: "/" + t
        ),
    ),
)


@settings(max_examples=300, deadline=None)
@given(signed=_TARGETS, sent=_TARGETS)
def test_attack_a_forward_is_believed_only_for_the_method_and_target_it_was_signed_for(
    signed: Target, sent: Target
) -> None:
    """A forward captured on its way to one endpoint, replayed within its window against
    another route, by another method or with another query, never verifies: the HMAC covers
    the method and the request target byte for byte."""
    assume(sent != signed)
    fwd = Forward("tenant-a", "interactive", "1", "active")
    sig = sign(SECRET, fwd, signed, "r1", b"{}", 1000.0, worker_id="w1", nonce=NONCE)
    assert not verify(SECRET, fwd, sent, "r1", b"{}", sig, 1001.0, worker_id="w1")
    honest = sign(SECRET, fwd, sent, "r1", b"{}", 1000.0, worker_id="w1", nonce=NONCE)
    assert verify(SECRET, fwd, sent, "r1", b"{}", honest, 1001.0, worker_id="w1") == (
        sent.method.isupper() and " " not in sent.path and "\n" not in sent.path
    )


def _older_form(
    fwd: Forward,
    request_id: str,
    body: bytes,
    now: float,
    form: str = "v2",
    target: Target = Target("POST", "/v1/completions"),
) -> str:
    """A signature as a router of an older form wrote it: ``v2`` (over the method and the
    target, neither the worker nor the session key) or ``bare`` (over neither of them)."""
    digest = hashlib.sha256(body).hexdigest()
    ts = int(now)
    if form == "bare":
        message = (
            f"{fwd.tenant}\n{request_id}\n{ts}\n{digest}\n{fwd.request_class}\n"
            f"{fwd.version}\n{fwd.reason}\n{fwd.stable}"
        ).encode()
        return f"{ts}.{hmac.digest(SECRET, message, 'sha256').hex()}"
    message = (
        f"v2\n{target.method}\n{fwd.tenant}\n{request_id}\n{ts}\n{digest}\n"
        f"{fwd.request_class}\n{fwd.version}\n{fwd.reason}\n{fwd.stable}\n{target.path}"
    ).encode()
    return f"v2.{ts}.{hmac.digest(SECRET, message, 'sha256').hex()}"


@pytest.mark.parametrize("form", ["v2", "bare"])
def test_a_signature_of_an_older_form_is_told_apart_and_never_verifies(form: str) -> None:
    fwd = Forward("tenant-a", "interactive", "1", "active")
    old = _older_form(fwd, "r1", b"{}", 1000.0, form)
    to = Target("POST", "/v1/completions")
    assert outdated(old) and not verify(SECRET, fwd, to, "r1", b"{}", old, 1001.0, worker_id="w1")
    new = sign(SECRET, fwd, to, "r1", b"{}", 1000.0, worker_id="w1", nonce=NONCE)
    assert new.startswith("v3.") and not outdated(new)
    for other in (None, "1000.zz", "v4" + new[2:], "v1" + new[2:], "v2." + new):
        assert not outdated(other), other


_SESSIONS = st.one_of(
    st.none(),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=12),
    st.sampled_from(["s1", "-", "+", "+s1", "-s1", "s1 ", " s1", "", "s1\n", "é"]),
)
_WORKERS = st.one_of(
    st.sampled_from(["w1", "w2", "w10", "w1.", "W1", "w1\n", "", " w1"]),
    st.from_regex(r"[a-z0-9][a-z0-9._-]{0,8}", fullmatch=True),
)


@settings(max_examples=500, deadline=None)
@given(worker=_WORKERS, other_worker=_WORKERS, session=_SESSIONS, other_session=_SESSIONS)
def test_attack_a_forward_verifies_only_on_its_worker_with_its_session_key(
    worker: str, other_worker: str, session: str | None, other_session: str | None
) -> None:
    """A forward captured on its way to one worker's gateway never verifies on another's
    (every gateway of a fleet holds the same router secret), nor with its ``X-Session-Key``
    changed, added or removed: the HMAC covers the destination worker and the session key's
    value or its absence, one reading each."""
    assume((worker, session) != (other_worker, other_session))
    to = Target("POST", "/v1/completions")
    signed = Forward("tenant-a", "interactive", "1", "active", session=session)
    sent = Forward("tenant-a", "interactive", "1", "active", session=other_session)
    sig = sign(SECRET, signed, to, "r1", b"{}", 1000.0, worker_id=worker, nonce=NONCE)
    assert not verify(SECRET, sent, to, "r1", b"{}", sig, 1001.0, worker_id=other_worker)
    honest = verify(SECRET, signed, to, "r1", b"{}", sig, 1001.0, worker_id=worker)
    sound = re.fullmatch(r"[a-z0-9][a-z0-9._-]{0,127}", worker) is not None and (
        session is None or re.fullmatch(r"[\x21-\x7e]{1,128}", session) is not None
    )
    assert honest == sound


def _signed(nonce: str, ts: float, request_id: str = "r1") -> str:
    fwd = Forward("tenant-a", "interactive", "1", "active")
    to = Target("POST", "/v1/completions")
    return sign(SECRET, fwd, to, request_id, b"{}", ts, worker_id="w1", nonce=nonce)


def test_a_forward_is_taken_once_within_its_window() -> None:
    """The same signature again within its window is a replay; another forward (another
    nonce), the same request's included, is not; an entry goes once its ``ts`` is out of
    the window, and a ``ts`` that old is refused still, a clock set back included."""
    replays = Replays()
    first = _signed("a" * 16, 1000.0)
    assert replays.first(first, 1000.2)
    assert not replays.first(first, 1000.4) and not replays.first(first, 1029.9)
    assert replays.first(_signed("b" * 16, 1000.0), 1000.5)  # the same request, signed again
    assert replays.first(_signed("a" * 16, 1001.0), 1001.0)  # the same nonce, another ts
    assert len(replays) == 3
    assert replays.first(_signed("c" * 16, 1031.0), 1031.0)  # ts 1000 is out: forgotten
    assert len(replays) == 2
    assert not replays.first(first, 1025.0)  # the clock set back: still refused
    assert not replays.first(_signed("d" * 16, 1000.0), 1025.0)
    assert not replays.first("v3.1031.zz", 1031.0)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0, 3, allow_nan=False),  # seconds on
            st.integers(-MAX_SKEW_S, MAX_SKEW_S),  # the router's clock against the gateway's
            st.integers(0, 6),  # the forward: a few, so some come again
        ),
        max_size=80,
    )
)
def test_replays_refuse_exactly_the_signatures_taken_and_hold_only_the_window(
    steps: list[tuple[float, int, int]],
) -> None:
    """Against a model: a verified signature is taken exactly when it was not taken before,
    and the memory holds only those whose ``ts`` is still within the window."""
    replays, taken, now = Replays(), set(), 5000.0
    signed: dict[tuple[int, int], str] = {}
    for step, skew, n in steps:
        now += step
        ts = int(now) + skew
        if abs(now - ts) > MAX_SKEW_S:
            continue  # verify refuses it: never offered
        sig = signed.setdefault((ts, n), _signed(f"{n:016x}", ts))
        assert replays.first(sig, now) == (sig not in taken)
        taken.add(sig)
        live = {t for t in taken if int(t.split(".")[1]) >= now - MAX_SKEW_S}
        assert len(replays) <= len(taken) and len(live) <= len(replays)
        assert len(replays) <= len(
            {t for t in taken if int(t.split(".")[1]) > now - 1 - MAX_SKEW_S}
        )


# ---- a worker's own 424 ------------------------------------------------------------------
def _refusal(
    status: int, kind: str, message: str = "version 1 of 'chat' cannot be loaded"
) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}
    ).encode()


JSON = "application/json; charset=utf-8"


def test_a_424_is_read_as_the_workers_own_only_when_it_says_so() -> None:
    """The router re-routes on a 424 whose ``error.type`` is ``adapter_refused_by_worker``
    alone: the artifact's own refusal, any other status, a stream, or bytes that are not
    OpenAI's error shape in JSON within the bound are passed on as they are."""
    own = ServingRefusal.adapter_refused_by_worker
    assert refused_by_worker(PERMANENT_STATUS, JSON, _refusal(424, own))
    assert refused_by_worker(PERMANENT_STATUS, "application/json", _refusal(424, own))
    for status, kind, content_type, body in [
        (424, ServingRefusal.adapter_unavailable_permanent, JSON, None),
        (429, own, JSON, None),
        (503, own, JSON, None),
        (400, own, JSON, None),
        (200, own, JSON, None),
        (424, own, "text/event-stream", None),
        (424, own, "text/plain", None),
        (424, own, JSON, b"not json"),
        (424, own, JSON, b'{"error": "adapter_refused_by_worker"}'),
        (424, own, JSON, b'["adapter_refused_by_worker"]'),
        (424, own, JSON, b'{"error": {"type": "adapter_refused_by_worker"'),  # cut
        (424, own, JSON, b'{"error": {"type": "x", "type": "adapter_refused_by_worker"}}'),
        (424, own, JSON, b"[" * 5000 + b"]" * 5000),
        (424, own, JSON, _refusal(424, own, "x" * REFUSAL_ANSWER_BYTES)),
    ]:
        raw = _refusal(status, kind) if body is None else body
        assert not refused_by_worker(status, content_type, raw), (status, content_type, raw[:80])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_reading_a_424_never_fails_on_any_bytes(body: bytes) -> None:
    assert refused_by_worker(PERMANENT_STATUS, JSON, body) in (True, False)


def test_a_gateways_hold_is_read_bounded() -> None:
    """A gateway's ``X-Loraplane-Refusal-Hold`` is believed in whole seconds up to
    ``MAX_REFUSAL_HOLD_S``, a longer one clamped to it; anything that is not a whole number
    of seconds in ASCII digits is no hold at all (the router's own memory stands)."""
    assert MAX_REFUSAL_HOLD_S == 300
    for value, hold in [("45", 45.0), ("0", 0.0), (" 7\t", 7.0), ("007", 7.0), ("300", 300.0)]:
        assert refusal_hold(value) == hold, value
    for huge in ("301", "86400", "999999999"):
        assert refusal_hold(huge) == MAX_REFUSAL_HOLD_S, huge
    for bad in (
        None,
        "",
        " ",
        "-5",
        "+5",
        "4.5",
        "1e9",
        "inf",
        "nan",
        "0x10",
        "5 5",
        "٣",
        "1" * 10,
        "9" * 5000,
        "45, 45",
        "45s",
    ):
        assert refusal_hold(bad) is None, bad


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40) | st.from_regex(r"[0-9]{1,12}", fullmatch=True))
def test_any_hold_a_gateway_says_is_within_the_bound(value: str) -> None:
    hold = refusal_hold(value)
    assert hold is None or 0 <= hold <= MAX_REFUSAL_HOLD_S
    if value.strip(" \t").isascii() and value.strip(" \t").isdigit():
        digits = value.strip(" \t")
        assert hold == (min(int(digits), MAX_REFUSAL_HOLD_S) if len(digits) <= 9 else None)


def test_a_refusal_of_the_workers_own_is_told_from_the_artifacts() -> None:
    """Its vLLM's refusal, or the artifact past its own limits, is the worker's: another
    worker may load the version. Any other refusal is of the bytes, refused everywhere."""
    for reason in VllmFailure:
        assert refused_here(reason), reason
    local = {
        ArtifactReason.rank_too_high,  # its max_lora_rank
        ArtifactReason.host_budget_exceeded,  # its host tier
        ArtifactReason.model_shape_unknown,  # its base model's shapes
    }
    for reason in ArtifactReason:
        assert refused_here(reason) == (reason in local), reason
    for global_ in ("manifest_missing", "sha256_mismatch", "pickle_weights", "unsafe_path"):
        assert not refused_here(global_)
    assert not refused_here("") and not refused_here("vllm_nonsense")


# ---- remembered refusals ----------------------------------------------------------------
def test_a_remembered_refusal_is_chosen_only_when_no_other_worker_fits() -> None:
    """A worker that refused the version as its own moments ago is passed over for every
    step of the rule (its GPU copy, the version placed there), and chosen when it is the
    only worker that fits: the tenant then gets its real answer, not a 503."""
    a = record("a")
    hot = at(worker("w1", gpu=[a], slots=2), NOW)
    empty = at(worker("w3", slots=2), NOW)
    low = at(worker("w2", slots=8), NOW, max_lora_rank=4)  # cannot hold its rank
    fleet = index(hot, empty, low)
    assert fleet.route(a, NOW, {}).worker_id == "w1"
    route = fleet.route(a, NOW, {}, avoid={"w1"})
    assert (route.worker_id, route.kind) == ("w3", RouteKind.free_slot)
    assert fleet.route(a, NOW, {}, avoid={"w1", "w3"}).worker_id == "w1"  # the only fits
    assert fleet.route(a, NOW, {}, skip={"w1"}, avoid={"w3"}).worker_id == "w3"
    assert fleet.route(a, NOW, {}, skip={"w1", "w3"}, avoid={"w3"}) is None
    # placed on w3 above: a refusal there sends the version's next request elsewhere
    cold = index(at(worker("w1", slots=2), NOW), at(worker("w3", slots=2), NOW))
    assert cold.route(a, NOW, {}).worker_id == "w1"  # placed on w1
    assert cold.route(a, NOW, {}).kind is RouteKind.placed
    route = cold.route(a, NOW, {}, avoid={"w1"})
    assert (route.worker_id, route.kind) == ("w3", RouteKind.free_slot)
    assert cold.route(a, NOW, {}, avoid={"w1"}).kind is RouteKind.placed  # follows w3 now
    assert index(hot).route(a, NOW, {}, avoid={"w1", "gone"}).worker_id == "w1"


_COPY = st.sampled_from(["gpu", "host", "none"])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(_COPY, st.integers(0, 3), st.booleans()), min_size=1, max_size=5),
    st.data(),
)
def test_routing_never_chooses_a_remembered_refusal_while_another_worker_fits(
    workers: list[tuple[str, int, bool]], data: st.DataObject
) -> None:
    """Any fleet (copies on GPU or host, free slots, workers whose rank does not fit), any
    remembered refusals and refusals of this request: a remembered worker is chosen only
    when no other fits, and then as if nothing were remembered; a worker that refused this
    request is never chosen."""
    a, x = record("a"), record("x")
    states = []
    for i, (copy, free, fits) in enumerate(workers):
        # no free slot and no copy on GPU: another version's copy fills its one slot
        gpu = [a] if copy == "gpu" else [] if free else [x]
        host = [a] if copy == "host" else []
        state = worker(f"w{i}", gpu=gpu, host=host, slots=len(gpu) + free)
        states.append(at(state, NOW, max_lora_rank=8 if fits else 4))
    ids = [s.worker_id for s in states]
    avoid = data.draw(st.sets(st.sampled_from(ids)), "avoid")
    skip = data.draw(st.sets(st.sampled_from(ids)), "skip")
    in_flight = data.draw(st.dictionaries(st.sampled_from(ids), st.integers(0, 3)), "busy")

    def fresh() -> FleetIndex:
        return index(*states)

    got = fresh().route(a, NOW, in_flight, skip=skip, avoid=avoid)
    elsewhere = fresh().route(a, NOW, in_flight, skip={*skip, *avoid})
    if elsewhere is not None:
        assert got == elsewhere and got.worker_id not in avoid
    else:
        assert got == fresh().route(a, NOW, in_flight, skip=skip)
    assert got is None or got.worker_id not in skip


def test_the_routers_memory_of_a_refusal_lasts_the_workers_hold() -> None:
    """As long as the worker answers the version's requests with its 424 at once."""
    hold = WorkerConfig.__dataclass_fields__["refusal_hold_s"].default
    assert hold == REFUSAL_MEMORY_S
    assert Router.__init__.__kwdefaults__["refusal_memory_s"] == REFUSAL_MEMORY_S


def test_a_refusal_is_remembered_for_its_time_and_forgotten_with_its_worker() -> None:
    memory = Refusals(ttl_s=30.0, cap=8)
    memory.note("w1", "a", 100.0)
    memory.note("w2", "a", 110.0)
    memory.note("w1", "b", 120.0)
    assert memory.of("a", 100.0) == {"w1", "w2"} and memory.of("b", 100.0) == {"w1"}
    assert memory.of("a", 130.0) == {"w2"}  # w1's of "a" lasted 30 s
    memory.note("w2", "a", 135.0)  # refused again: remembered from then
    assert memory.of("a", 160.0) == {"w2"} and memory.of("a", 165.0) == frozenset()
    assert memory.of("c", 0.0) == frozenset() and len(memory) == 0
    memory.note("w1", "a", 200.0)
    memory.note("w1", "b", 200.0)
    memory.note("w2", "b", 200.0)
    memory.forget("w1")  # it left the view
    assert memory.of("a", 200.0) == frozenset() and memory.of("b", 200.0) == {"w2"}
    memory.note("w3", "a", 200.0)
    memory.keep_only({"w3", "w9"})
    assert memory.of("b", 200.0) == frozenset() and memory.of("a", 200.0) == {"w3"}
    memory.forget("never")
    assert len(memory) == 1


def test_a_refused_forward_is_remembered_for_every_version_of_its_worker() -> None:
    """A gateway's 401 (the router's forward refused) marks its worker for every version,
    for the memory's time, beside the versions refused as a worker's own; it goes with its
    worker, and counts within the cap."""
    memory = Refusals(ttl_s=30.0, cap=3)
    memory.note_forwards("w1", 100.0)
    memory.note("w2", "a@1-x", 110.0)
    assert memory.of("a@1-x", 110.0) == {"w1", "w2"} and memory.of("b@1-x", 110.0) == {"w1"}
    assert memory.of("a@1-x", 130.0) == {"w2"} and memory.of("b@1-x", 130.0) == frozenset()
    memory.note_forwards("w1", 135.0)
    memory.note_forwards("w1", 136.0)  # once per worker, however often
    assert memory.of("c@1-x", 165.0) == {"w1"} and len(memory) == 1  # w2's lapsed
    memory.forget("w1")
    assert memory.of("c@1-x", 165.0) == frozenset() and len(memory) == 0
    for wid in ("w3", "w4", "w5"):
        memory.note_forwards(wid, 150.0)
    assert len(memory) == 3 and memory.of("a@1-x", 150.0) == {"w3", "w4", "w5"}


def test_a_refusal_is_remembered_as_long_as_its_worker_holds_it() -> None:
    """A refusal noted with the hold its worker said lasts that long, longer or shorter
    than the memory's own time; one noted again lasts from then, for its new hold."""
    memory = Refusals(ttl_s=30.0, cap=8)
    memory.note("w1", "a@1-x", 100.0, 45.0)
    memory.note("w2", "a@1-x", 100.0, 5.0)
    memory.note("w3", "a@1-x", 100.0)  # no hold said: the memory's own
    assert memory.of("a@1-x", 104.0) == {"w1", "w2", "w3"}
    assert memory.of("a@1-x", 105.0) == {"w1", "w3"}
    assert memory.of("a@1-x", 130.0) == {"w1"} and memory.of("a@1-x", 145.0) == frozenset()
    memory.note("w1", "b@1-x", 150.0, 100.0)
    memory.note("w1", "b@1-x", 151.0, 2.0)  # noted again: its new hold
    assert memory.of("b@1-x", 152.0) == {"w1"} and memory.of("b@1-x", 153.0) == frozenset()
    memory.note("w2", "b@1-x", 160.0, 0.0)  # no hold: not avoided
    assert memory.of("b@1-x", 160.0) == frozenset() and len(memory) == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["w1", "w2", "w3"]),
            st.sampled_from(["a@1-x", "b@1-x", ""]),
            st.integers(0, 5),  # seconds since the last step
            st.none() | st.integers(0, 40).map(float),
        ),
        max_size=150,
    )
)
def test_refusals_of_any_holds_match_a_model_and_stay_bounded(
    notes: list[tuple[str, str, int, float | None]],
) -> None:
    """Notes of any workers, versions (or every version), holds and times: at each step the
    memory gives exactly the refusals still held, within its cap (the oldest noted
    forgotten first), and its expiry heap holds at most about twice its entries."""
    memory = Refusals(ttl_s=10.0, cap=4)
    model: dict[tuple[str, str], float] = {}  # in the order noted
    now = 0.0
    for wid, name, step, hold in notes:
        now += step
        model = {k: u for k, u in model.items() if u > now}
        for query in ("a@1-x", "b@1-x"):
            held = {w for (w, n), _ in model.items() if n in (query, "")}
            assert memory.of(query, now) == held
        hold = hold if name else None  # a refused forward: the memory's own time
        model.pop((wid, name), None)
        model[(wid, name)] = now + (10.0 if hold is None else hold)
        model = dict(list(model.items())[-4:])
        if name:
            memory.note(wid, name, now, hold)
        else:
            memory.note_forwards(wid, now)
        assert len(memory) <= 4 and len(memory._expiry) <= 2 * len(memory) + 16


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["w1", "w2", "w3", "w4"]), st.integers(0, 20), st.booleans()),
        max_size=120,
    )
)
def test_a_flood_of_refusals_keeps_the_memory_within_its_cap(
    notes: list[tuple[str, int, bool]],
) -> None:
    """A gateway refusing everything it is sent (any worker, any version, notes and leaves
    in any order): the memory never holds more than its cap, forgets the oldest first, and
    always holds the latest refusal."""
    memory = Refusals(ttl_s=1000.0, cap=5)
    order: list[tuple[str, str]] = []  # the model: (worker, lora name), oldest first
    for now, (wid, n, leaves) in enumerate(notes):
        if leaves:
            memory.forget(wid)
            order = [k for k in order if k[0] != wid]
            continue
        name = f"v{n}"
        memory.note(wid, name, float(now))
        order = [*[k for k in order if k != (wid, name)][-4:], (wid, name)]
        assert len(memory) == len(order) <= 5
        assert wid in memory.of(name, float(now))
    for n in range(21):
        assert memory.of(f"v{n}", 0.0) == {w for w, v in order if v == f"v{n}"}
    assert MAX_REFUSALS >= 1024  # every (worker, version) of a large fleet's refusals


def forwarded(
    tenant: str,
    request_id: str,
    raw: bytes,
    now: float,
    version: str = "1",
    request_class: str = "interactive",
    target: Target = Target("POST", "/v1/completions"),
    worker_id: str = "w2",
) -> dict[str, str]:
    """The headers a router puts on a request it forwards to ``target`` on the gateway of
    ``worker_id``, signed with the test secret."""
    fwd = Forward(tenant, request_class, version, "active")
    return {
        TENANT_HEADER: tenant,
        "X-Request-Id": request_id,
        "X-Request-Class": request_class,
        VERSION_HEADER: version,
        VERSION_REASON_HEADER: "active",
        SIGNATURE_HEADER: sign(
            SECRET, fwd, target, request_id, raw, now, worker_id=worker_id, nonce=token_hex(16)
        ),
        "Content-Type": "application/json",
    }


# ---- the router in front of gateways --------------------------------------------------------
async def router_metrics(router: Router, http: ClientSession) -> str:
    """The router's ``/metrics``, from its own listener (``Router.metrics_app``)."""
    server = TestServer(router.metrics_app(), host="127.0.0.1")
    await server.start_server()
    try:
        async with http.get(server.make_url("/metrics")) as resp:
            assert resp.status == 200
            return await resp.text()
    finally:
        await server.close()


@dataclass
class Stack:
    router: Router
    url: str
    workers: dict[str, FakeServing]
    sinks: dict[str, ListSink]
    router_sink: ListSink
    http: ClientSession

    async def post(
        self,
        body: dict[str, Any],
        path: str = "/v1/completions",
        headers: dict[str, str] | None = None,
    ) -> tuple[int, CIMultiDict[str], Any]:
        async with self.http.post(
            self.url + path, json=body, headers=headers if headers is not None else AUTH_A
        ) as resp:
            raw = await resp.read()
            return resp.status, CIMultiDict(resp.headers), json.loads(raw) if raw else None


def _gateway_refusals(router: Router) -> dict[str, float]:
    """``loraplane_router_gateway_refusals_total`` by reason, as the router's /metrics
    gives it."""
    (family,) = [
        f for f in RouterMetrics(router).collect() if f.name == "loraplane_router_gateway_refusals"
    ]
    return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    sql = RECORDS[2]
    servers, workers, sinks, states = [], {}, {}, []
    for wid, hot in (("w1", set()), ("w2", {sql.lora_name}), ("w3", set())):
        serving = FakeServing(hot=set(hot), worker_id=wid)
        sink = ListSink()
        gateway = Gateway(
            serving, api_keys=KEYS, budgets=RequestBudgets(), sink=sink, router_secret=SECRET
        )
        server = TestServer(gateway.app(), host="127.0.0.1")
        await server.start_server()
        serving.gateway_url = str(server.make_url("")).rstrip("/")  # what its proof binds
        servers.append(server)
        workers[wid], sinks[wid] = serving, sink
        base = worker(wid, gpu=[sql] if hot else [], slots=2, base=sql.base_model)
        states.append(
            at(
                base,
                datetime.now(UTC).timestamp(),
                str(server.make_url("")).rstrip("/"),
                max_lora_rank=64,
            )
        )
    router_sink = ListSink()
    fleet = Fleet(FleetIndex(POLICY, 5.0), router_sink, "router-t")
    for s in states:
        fleet.index.update(s)
    fleet.versions = serving_versions(list(RECORDS))
    router = Router(fleet, api_keys=KEYS, budgets=RequestBudgets(), secret=SECRET)
    server = TestServer(router.app(), host="127.0.0.1")
    await server.start_server()
    async with ClientSession() as http:
        yield Stack(router, str(server.make_url("")).rstrip("/"), workers, sinks, router_sink, http)
    for s in [server, *servers]:
        await s.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_requests_for_a_hot_adapter_go_to_its_worker(stack: Stack) -> None:
    sql = RECORDS[2]
    for _ in range(5):
        status, headers, _body = await stack.post({"model": "sql", "prompt": "q"})
        assert status == 200
        assert (headers["X-Loraplane-Worker"], headers["X-Loraplane-Route"]) == ("w2", "gpu")
        assert headers["X-Loraplane-Adapter-Version"] == sql.version
        assert headers["X-Loraplane-Tier"] == "gpu"
    assert stack.workers["w1"].asked == stack.workers["w3"].asked == []  # no cold load
    assert len(stack.sinks["w2"].messages(RequestLog)) == 5  # one log per request, by the gateway
    assert not stack.router_sink.messages(RequestLog)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_cold_adapter_is_loaded_where_the_planner_would_put_it(stack: Stack) -> None:
    status, headers, _ = await stack.post({"model": "chat", "prompt": "q"})
    assert status == 200 and headers["X-Loraplane-Route"] == RouteKind.free_slot
    assert headers["X-Loraplane-Worker"] == "w1"  # 2 free slots, lowest id (w3 has 2 too)


@pytest.mark.asyncio(loop_scope="session")
async def test_refusals_before_any_worker(stack: Stack) -> None:
    assert (await stack.post({"model": "nope", "prompt": "q"}))[0] == 404
    assert (await stack.post({"model": "other", "prompt": "q"}))[0] == 404
    assert (await stack.post({"model": "sql", "prompt": "q"}, headers={}))[0] == 401
    status, _, body = await stack.post({"model": "sql", "prompt": "q", "vllm_xargs": {}})
    assert status == 400 and body["error"]["param"] == "vllm_xargs"
    assert (await stack.post({"model": "/etc/passwd", "prompt": "q"}))[0] == 400
    for sink in stack.sinks.values():
        assert not sink.messages(RequestLog)  # nothing reached a gateway, nothing was logged
    for w in stack.workers.values():
        assert w.asked == [] and w.counted == []  # no state for an unknown adapter anywhere


@pytest.mark.asyncio(loop_scope="session")
async def test_no_live_worker_is_503_with_retry_after(stack: Stack) -> None:
    stack.router._clock = lambda: datetime.now(UTC).timestamp() + 60  # every heartbeat stale
    status, headers, body = await stack.post({"model": "sql", "prompt": "q"})
    assert status == 503 and headers["Retry-After"] == "5"
    assert body["error"]["type"] == "no_live_worker"


@pytest.mark.asyncio(loop_scope="session")
async def test_a_gateway_that_is_gone_is_dropped_and_the_request_rerouted(stack: Stack) -> None:
    sql = RECORDS[2]
    dead = at(
        worker("w0", gpu=[sql], base=sql.base_model),
        datetime.now(UTC).timestamp(),
        "http://127.0.0.1:9",
        max_lora_rank=64,
    )  # discard port: refused
    stack.router.fleet.index.update(dead)
    status, headers, _ = await stack.post({"model": "sql", "prompt": "q"})
    assert status == 200 and headers["X-Loraplane-Worker"] == "w2"
    assert "w0" not in stack.router.fleet.index.workers


async def _gateway_of_w0(sink: ListSink, secret: bytes = SECRET) -> tuple[Gateway, TestServer]:
    """A real gateway of worker w0 (sql hot) with router ``secret``, serving on loopback."""
    gateway = Gateway(
        FakeServing(hot={RECORDS[2].lora_name}, worker_id="w0"),
        api_keys=KEYS,
        budgets=RequestBudgets(),
        sink=sink,
        router_secret=secret,
    )
    server = TestServer(gateway.app(), host="127.0.0.1")
    await server.start_server()
    return gateway, server


def _sql_hot_on_w0(stack: Stack, url: str) -> None:
    """A worker w0 holding sql hot, its gateway at ``url``: the lowest id among the idle
    copies, so the router picks it first."""
    sql = RECORDS[2]
    stack.router.fleet.index.update(
        at(
            worker("w0", gpu=[sql], base=sql.base_model),
            datetime.now(UTC).timestamp(),
            url,
            max_lora_rank=64,
        )
    )


async def _dies_mid_answer(head: bytes) -> tuple[asyncio.AbstractServer, str]:
    """A gateway that reads a request, sends ``head`` and part of a body, and closes."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(head)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


_GZIPPED = gzip.compress(b'{"choices": []}', mtime=0)


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize(
    "head",
    [
        b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"id',
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
        b'\r\n5\r\n{"id"',
    ],
)
async def test_a_worker_killed_mid_answer_is_a_retryable_503_and_dropped(
    stack: Stack, head: bytes
) -> None:
    server, url = await _dies_mid_answer(head)
    try:
        _sql_hot_on_w0(stack, url)
        status, headers, body = await stack.post({"model": "sql", "prompt": "q"})
        assert status == 503 and headers["Retry-After"] == "5", body
        assert body["error"]["type"] == "worker_lost"
        assert "w0" not in stack.router.fleet.index.workers
        status, headers, _ = await stack.post({"model": "sql", "prompt": "q"})
        assert status == 200 and headers["X-Loraplane-Worker"] == "w2"
    finally:
        server.close()


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: Upgrade\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
        b"HTTP/1.1 999 Odd\r\nContent-Length: 2\r\n\r\n{}",
        b"HTTP/1.1 600 Odd\r\nContent-Length: 2\r\n\r\n{}",
        b"HTTP/1.1 204 No Content\r\nContent-Type: application/json\r\n\r\n",
        b"HTTP/1.1 304 Not Modified\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 302 Found\r\nLocation: http://elsewhere/\r\nContent-Length: 2\r\n\r\n{}",
        # an encoded answer: the header was dropped and the gzip bytes relayed as JSON
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(_GZIPPED), _GZIPPED),
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: br\r\n"
        b"Content-Length: 4\r\n\r\n\x0b\x01\x80\x03",
    ],
)
async def test_attack_a_gateway_answering_no_final_status_is_dropped_and_rerouted(
    stack: Stack, head: bytes
) -> None:
    """ATTACK: a gateway (a URL a forged worker state announces) answering an interim,
    upgrade or unknown status, or one no gateway answers (204, 304, a redirect, a body with
    a ``Content-Encoding`` the router never asked for and would relay undecodable). The router
    passed it to the client as its answer (a 101 without a protocol, a 999, a 304 to a
    POST, a 302 without its Location); it is a bad answer: that gateway is dropped and the
    request served elsewhere."""
    server, url = await _dies_mid_answer(head)
    try:
        _sql_hot_on_w0(stack, url)
        status, headers, _ = await stack.post({"model": "sql", "prompt": "q"})
        assert status == 200 and headers["X-Loraplane-Worker"] == "w2"
        assert "w0" not in stack.router.fleet.index.workers
    finally:
        server.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_attack_the_routers_own_headers_are_the_only_ones_of_their_name(
    stack: Stack,
) -> None:
    """ATTACK: a gateway sending the headers the router sets itself (the worker, the route,
    the version it decided). The client got both, the gateway's first; it gets the
    router's alone."""
    server, url = await _dies_mid_answer(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
        b"X-Loraplane-Worker: evil\r\nx-loraplane-route: evil\r\n"
        b"X-LORAPLANE-VERSION: 666\r\n\r\n{}"
    )
    try:
        _sql_hot_on_w0(stack, url)
        status, headers, _ = await stack.post({"model": "sql", "prompt": "q"})
        assert status == 200
        assert headers.getall("X-Loraplane-Worker") == ["w0"]
        assert headers.getall("X-Loraplane-Route") == ["gpu"]
        assert headers.getall("X-Loraplane-Version") == ["1"]
    finally:
        server.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_a_request_sent_again_elsewhere_has_its_own_id_and_one_log(stack: Stack) -> None:
    """A worker that took the request and died before answering may have run and logged it:
    the re-routed attempt is another request id, so the answer names exactly one row."""
    seen: list[bytes] = []

    async def takes_it_then_dies(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        writer.close()

    server = await asyncio.start_server(takes_it_then_dies, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        _sql_hot_on_w0(stack, url)
        status, headers, _ = await stack.post(
            {"model": "sql", "prompt": "q"}, headers={**AUTH_A, "X-Request-Id": "client-7"}
        )
        assert status == 200 and headers["X-Loraplane-Worker"] == "w2"
        assert b"\r\nX-Request-Id: client-7\r\n" in seen[0]  # the first attempt: its own id
        assert headers["X-Request-Id"] == "client-7-r1"
        (log,) = stack.sinks["w2"].messages(RequestLog)
        assert log.request_id == "client-7-r1"
    finally:
        server.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_a_worker_whose_vllm_is_gone_is_parked_and_the_request_served_elsewhere(
    stack: Stack,
) -> None:
    """A live gateway (fresh heartbeat, /healthz 200) whose vLLM was killed answers that the
    request never reached vLLM: the router parks that worker and serves the request on
    another, under the attempt's own id, so the client gets the 200, not the dead vLLM's
    error; the first gateway's row names the failure."""
    dead_vllm = FailingUpstream(
        hot={RECORDS[2].lora_name},
        worker_id="w0",
        error=VllmError(
            VllmErrorCode.unreachable,
            "POST /v1/completions: 127.0.0.1:18000: connection refused",
            unsent=True,
        ),
    )
    sink = ListSink()
    gateway = Gateway(
        dead_vllm, api_keys=KEYS, budgets=RequestBudgets(), sink=sink, router_secret=SECRET
    )
    server = TestServer(gateway.app(), host="127.0.0.1")
    await server.start_server()
    try:
        _sql_hot_on_w0(stack, str(server.make_url("")).rstrip("/"))
        status, headers, _ = await stack.post(
            {"model": "sql", "prompt": "q"}, headers={**AUTH_A, "X-Request-Id": "client-9"}
        )
        assert status == 200 and headers["X-Loraplane-Worker"] == "w2"
        assert headers["X-Request-Id"] == "client-9-r1"
        assert "w0" in stack.router.fleet.index.parked
        (failed,) = sink.messages(RequestLog)
        assert (failed.request_id, failed.error) == ("client-9", "vllm_unreachable")
        status, headers, _ = await stack.post({"model": "sql", "prompt": "q"})
        assert status == 200 and headers["X-Loraplane-Worker"] == "w2"  # parked: not asked
        assert len(sink.messages(RequestLog)) == 1
    finally:
        await server.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_a_vllm_error_after_the_request_left_is_not_sent_again(stack: Stack) -> None:
    """vLLM lost after it took the request (it may have run it): the gateway's 502 reaches
    the client as it is; only a request that never reached vLLM goes elsewhere."""
    lost = FailingUpstream(
        hot={RECORDS[2].lora_name},
        worker_id="w0",
        error=VllmError(VllmErrorCode.unreachable, "POST /v1/completions: closed mid-answer"),
    )
    gateway = Gateway(
        lost, api_keys=KEYS, budgets=RequestBudgets(), sink=ListSink(), router_secret=SECRET
    )
    server = TestServer(gateway.app(), host="127.0.0.1")
    await server.start_server()
    try:
        _sql_hot_on_w0(stack, str(server.make_url("")).rstrip("/"))
        status, headers, body = await stack.post({"model": "sql", "prompt": "q"})
        assert status == 502 and headers["X-Loraplane-Worker"] == "w0"
        assert body["error"]["type"] == "vllm_unreachable"
        assert "w0" not in stack.router.fleet.index.parked
    finally:
        await server.close()


_NOT_RUN_BODY = b'{"error": {"type": "vllm_unreachable", "message": "vLLM is not there"}}'


def _answer_503(not_run: bytes | None) -> bytes:
    """A gateway's 503 as it travels: with ``X-Loraplane-Not-Run: <not_run>`` or without."""
    extra = b"" if not_run is None else NOT_RUN_HEADER.encode() + b": " + not_run + b"\r\n"
    return (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        b"Retry-After: 1\r\n" + extra + b"Content-Length: %d\r\n\r\n" % len(_NOT_RUN_BODY)
    ) + _NOT_RUN_BODY


async def _message(reader: asyncio.StreamReader) -> bytes:
    """One HTTP/1.1 message: its head and its ``Content-Length`` body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    return head + await reader.readexactly(int(length[1]) if length else 0)


async def _answering(
    answer_of: Callable[[int, bytes], Awaitable[bytes | None]],
) -> tuple[asyncio.AbstractServer, str]:
    """A server on loopback that reads each request of a connection (head and body, kept
    alive) and writes ``answer_of(n, request)`` back, n counting the connection's requests;
    None closes the connection with no byte of an answer."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for n in itertools.count():
                answer = await answer_of(n, await _message(reader))
                if answer is None:
                    return
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _always_answers(answer: bytes, asked: list[bytes]) -> tuple[asyncio.AbstractServer, str]:
    """A gateway that answers every request (head and body read, kept alive) with ``answer``,
    noting each request's head in ``asked``."""

    async def answer_of(_: int, request: bytes) -> bytes:
        asked.append(request.partition(b"\r\n\r\n")[0] + b"\r\n\r\n")
        return answer

    return await _answering(answer_of)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_gateway_503_saying_not_run_is_parked_and_served_by_another(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """A gateway's 503 with ``X-Loraplane-Not-Run`` (its vLLM was not reached: nothing ran)
    parks that worker and the request is answered by another under the attempt's id; the
    gateway's 503 and its header never reach the client, and the reason it gave is logged
    cut short (a gateway's header is anyone's bytes)."""
    asked: list[bytes] = []
    server, url = await _always_answers(_answer_503(b"vllm_unreachable" + b"x" * 5000), asked)
    try:
        _sql_hot_on_w0(stack, url)
        with caplog.at_level("WARNING", logger="loraplane.router"):
            status, headers, body = await stack.post(
                {"model": "sql", "prompt": "q"}, headers={**AUTH_A, "X-Request-Id": "client-5"}
            )
        assert status == 200, body
        assert headers["X-Loraplane-Worker"] == "w2" and NOT_RUN_HEADER not in headers
        assert headers["X-Request-Id"] == "client-5-r1"
        assert len(asked) == 1 and b"\r\nX-Request-Id: client-5\r\n" in asked[0]
        assert "w0" in stack.router.fleet.index.parked
        (line,) = [r.getMessage() for r in caplog.records if "w0" in r.getMessage()]
        assert "vllm_unreachable" in line and len(line) < 1000, line[:300]
        status, headers, _ = await stack.post({"model": "sql", "prompt": "q"})
        assert status == 200 and headers["X-Loraplane-Worker"] == "w2"  # parked: not asked
        assert len(asked) == 1
    finally:
        server.close()


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("not_run", [None, b""])
async def test_a_gateway_503_without_not_run_is_relayed_as_it_is(
    stack: Stack, not_run: bytes | None
) -> None:
    """A 503 without the header (or with an empty one) is the gateway's own answer (vLLM may
    have taken the request): it reaches the client as it is, once, and the worker stays in
    the view."""
    asked: list[bytes] = []
    server, url = await _always_answers(_answer_503(not_run), asked)
    try:
        _sql_hot_on_w0(stack, url)
        status, headers, body = await stack.post({"model": "sql", "prompt": "q"})
        assert status == 503 and headers["X-Loraplane-Worker"] == "w0"
        assert headers["Retry-After"] == "1" and body["error"]["type"] == "vllm_unreachable"
        assert len(asked) == 1
        assert "w0" in stack.router.fleet.index.workers
        assert "w0" not in stack.router.fleet.index.parked
    finally:
        server.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_attack_gateways_all_saying_not_run_cannot_loop_a_request() -> None:
    """ATTACK: every worker of a base model is a forged or compromised gateway answering 503
    ``X-Loraplane-Not-Run`` to everything. A request is sent to at most two of them (one
    re-route), then answered 503 ``no_live_worker``; it never goes round the fleet, nor round
    the same gateway, however many such workers the view holds."""
    sql = RECORDS[2]
    asked: list[bytes] = []
    servers = []
    fleet = Fleet(FleetIndex(POLICY, 5.0), ListSink(), "router-t")
    fleet.versions = serving_versions(list(RECORDS))
    for i in range(6):
        server, url = await _always_answers(_answer_503(b"vllm_unreachable"), asked)
        servers.append(server)
        fleet.index.update(
            at(
                worker(f"evil{i}", gpu=[sql], base=sql.base_model),
                datetime.now(UTC).timestamp(),
                url,
                max_lora_rank=64,
            )
        )
    router = Router(fleet, api_keys=KEYS, budgets=RequestBudgets(), secret=SECRET)
    front = TestServer(router.app(), host="127.0.0.1")
    await front.start_server()
    try:
        async with ClientSession() as http:
            for n in (1, 2, 3):
                async with http.post(
                    str(front.make_url("/v1/completions")),
                    json={"model": "sql", "prompt": "q"},
                    headers=AUTH_A,
                ) as resp:
                    body = await resp.json()
                assert resp.status == 503 and resp.headers["Retry-After"] == "5", body
                assert body["error"]["type"] == "no_live_worker"
                assert len(asked) == 2 * n  # two tries a request, each to another gateway
        assert len({next(iter(re.findall(rb"X-Request-Id: (\S+)", h))) for h in asked}) == 6
        assert set(fleet.index.parked) == {f"evil{i}" for i in range(6)}
    finally:
        await front.close()
        for server in servers:
            server.close()


def test_an_attempt_id_stays_a_request_id() -> None:
    assert attempt_id("abc", 0) == "abc"
    assert attempt_id("abc", 1) == "abc-r1"
    longest = attempt_id("x" * 128, 1)
    assert len(longest) == 128 and longest.endswith("-r1")


@pytest.mark.asyncio(loop_scope="session")
async def test_a_stream_cut_by_a_killed_worker_is_cut_for_the_client(stack: Stack) -> None:
    server, url = await _dies_mid_answer(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked"
        b'\r\n\r\n10\r\ndata: {"a": 1}\n\n\r\n'
    )
    try:
        _sql_hot_on_w0(stack, url)
        async with stack.http.post(
            stack.url + "/v1/completions",
            headers=AUTH_A,
            json={"model": "sql", "prompt": "q", "stream": True},
        ) as resp:
            assert resp.status == 200
            with pytest.raises(ClientPayloadError):
                await resp.read()  # cut, never a stream that looks whole
        assert "w0" not in stack.router.fleet.index.workers
        status, _, _ = await stack.post({"model": "sql", "prompt": "q"})
        assert status == 200  # the router goes on
    finally:
        server.close()


BATCH = {**AUTH_A, "X-Request-Class": "batch"}  # a cold load refused for good is a 424
CHAT = [r.lora_name for r in RECORDS if r.adapter_id == "chat"]  # its active and its canary


def _refuse_chat(serving: FakeServing, reason: str) -> None:
    serving.refuses.update(dict.fromkeys(CHAT, reason))


@pytest.mark.asyncio(loop_scope="session")
async def test_a_workers_own_424_sends_the_request_to_another_worker(stack: Stack) -> None:
    """The worker the router picks for a cold version (w1: the most free slots) has a vLLM
    that refuses to load it (its --max-lora-rank): the request goes on to another worker of
    the base model, which serves it; w1 stays in the view, and the client gets one answer
    naming the worker that served it."""
    _refuse_chat(stack.workers["w1"], VllmFailure.vllm_rank_too_large)
    status, headers, body = await stack.post({"model": "chat", "prompt": "q"}, headers=BATCH)
    assert status == 200, body
    assert headers["X-Loraplane-Worker"] == "w3"
    chat = headers["X-Loraplane-Lora-Name"]
    assert stack.workers["w1"].asked == [chat] and stack.workers["w3"].asked == [chat]
    (refused,) = stack.sinks["w1"].messages(RequestLog)  # w1 logged its 424, not served
    assert refused.error == "vllm_rank_too_large"
    (served,) = stack.sinks["w3"].messages(RequestLog)
    assert served.status == "ok" and served.request_id == refused.request_id + "-r1"
    assert "w1" in stack.router.fleet.index.workers  # not parked: it serves other versions
    assert _gateway_refusals(stack.router) == {"adapter_refused_by_worker": 1}


@pytest.mark.asyncio(loop_scope="session")
async def test_a_remembered_refusal_sends_the_next_request_elsewhere(stack: Stack) -> None:
    """w1 refuses the version as its own (its --max-lora-rank): the first request pays the
    hop through it, and the version's next request, after the router's placement on w3 has
    lapsed and while w1's refusal hold lasts, goes straight to w3 (w1 forwarded to once,
    w3 twice). With no other worker left, w1 is tried again and its 424 is the answer."""
    _refuse_chat(stack.workers["w1"], VllmFailure.vllm_rank_too_large)
    active = {**BATCH, "X-Session-Key": session_for("chat", False)}  # one version throughout
    status, headers, body = await stack.post({"model": "chat", "prompt": "q"}, headers=active)
    assert (status, headers["X-Loraplane-Worker"]) == (200, "w3"), body
    chat = headers["X-Loraplane-Lora-Name"]
    assert stack.router.refusals.of(chat, datetime.now(UTC).timestamp()) == {"w1"}
    # 16 s on: the placement (3 heartbeats of 5 s) lapsed, the hold (30 s) did not; every
    # worker's heartbeat is fresh and shows no copy of the version, so the free slots decide
    later = 16.0
    index = stack.router.fleet.index
    for w in list(index.workers.values()):
        index.update(at(w.state, w.state.ts.timestamp() + later, w.state.gateway_url))
    stack.router._clock = lambda: datetime.now(UTC).timestamp() + later
    status, headers, body = await stack.post({"model": "chat", "prompt": "q"}, headers=active)
    assert (status, headers["X-Loraplane-Worker"]) == (200, "w3"), body
    assert (headers["X-Loraplane-Route"], headers["X-Loraplane-Lora-Name"]) == ("free_slot", chat)
    # a gateway logs every request it is forwarded (workers.gateway)
    forwards = {wid: len(sink.messages(RequestLog)) for wid, sink in stack.sinks.items()}
    assert forwards == {"w1": 1, "w2": 0, "w3": 2}
    (request_log,) = stack.sinks["w1"].messages(RequestLog)  # its one 424
    assert request_log.error == "vllm_rank_too_large"
    # the only worker of the base model left: remembered, it is still asked, and answers
    for wid in ("w2", "w3"):
        index.remove(wid)
    status, headers, body = await stack.post({"model": "chat", "prompt": "q"}, headers=active)
    assert (status, headers["X-Loraplane-Worker"]) == (PERMANENT_STATUS, "w1")
    assert body["error"]["type"] == ServingRefusal.adapter_refused_by_worker
    assert len(stack.sinks["w1"].messages(RequestLog)) == 2


def _answer_424(hold: bytes) -> bytes:
    """A gateway's 424 of its worker's own refusal, saying ``X-Loraplane-Refusal-Hold: hold``."""
    body = _refusal(424, ServingRefusal.adapter_refused_by_worker)
    return (
        b"HTTP/1.1 424 Failed Dependency\r\nContent-Type: application/json; charset=utf-8\r\n"
        + HOLD_HEADER.encode()
        + b": "
        + hold
        + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
    ) + body


@pytest.mark.asyncio(loop_scope="session")
async def test_a_refusal_is_remembered_as_long_as_the_gateway_says_it_holds(
    stack: Stack,
) -> None:
    """w1's worker holds its refusal of chat 45 s (its ``refusal_hold_s``), longer than the
    router's own 30 s: its gateway's 424 says so and the router passes w1 over for chat
    that long, not 30 s. A gateway saying a hold of days is remembered
    ``MAX_REFUSAL_HOLD_S``, and one saying no number the router's own time."""
    w1 = stack.workers["w1"]
    _refuse_chat(w1, VllmFailure.vllm_rank_too_large)
    w1.refusal_hold_s = 45.0
    now = datetime.now(UTC).timestamp()
    status, headers, body = await stack.post({"model": "chat", "prompt": "q"}, headers=BATCH)
    assert (status, headers["X-Loraplane-Worker"]) == (200, "w3"), body
    refusals, chat = stack.router.refusals, headers["X-Loraplane-Lora-Name"]
    assert refusals.of(chat, now + 40) == {"w1"}  # within its hold, past the router's 30 s
    assert refusals.of(chat, now + 46) == frozenset()
    for said, held in [
        (b"86400000", MAX_REFUSAL_HOLD_S),
        (b"999999999999", REFUSAL_MEMORY_S),
        (b"-1", REFUSAL_MEMORY_S),
        (b"1e9", REFUSAL_MEMORY_S),
        (b"2", 2.0),
    ]:
        stack.router.refusals = refusals = Refusals()
        asked: list[bytes] = []
        server, url = await _always_answers(_answer_424(said), asked)
        try:
            _sql_hot_on_w0(stack, url)
            now = datetime.now(UTC).timestamp()
            status, headers, body = await stack.post({"model": "sql", "prompt": "q"})
            assert (status, headers["X-Loraplane-Worker"]) == (200, "w2"), body
            assert len(asked) == 1, said
            sql = RECORDS[2].lora_name
            assert refusals.of(sql, now + held - 1) == {"w0"}, said
            assert refusals.of(sql, now + held + 1) == frozenset(), said
        finally:
            server.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_a_worker_out_of_the_view_is_forgotten_with_its_refusals(stack: Stack) -> None:
    """A worker parked (its gateway failed) or forgotten (drained, tombstoned) leaves the
    router's memory of refusals at the fleet watch's next pass; the others' stay."""
    refusals, index = stack.router.refusals, stack.router.fleet.index
    now = datetime.now(UTC).timestamp()
    for wid in ("w1", "w2", "w3"):
        refusals.note(wid, "chat-1", now)
    watch = asyncio.create_task(_watch_fleet(stack.router, lambda: None, 0.05, poll_s=0.01))
    try:
        await asyncio.sleep(0.05)
        assert refusals.of("chat-1", now) == {"w1", "w2", "w3"}  # all in the view: kept
        index.failed("w1", now)
        index.forget("w3")
        await asyncio.sleep(0.1)
        assert refusals.of("chat-1", now) == {"w2"}
    finally:
        watch.cancel()


ACTIVE = {**AUTH_A, "X-Session-Key": session_for("chat", False)}  # interactive, one version


@pytest.mark.asyncio(loop_scope="session")
async def test_an_interactive_request_gets_its_adapter_from_another_worker(
    stack: Stack,
) -> None:
    """The worker chosen for an interactive request (w1) refuses the version as its own (its
    --max-lora-rank): while the router has another worker for it (``X-Loraplane-Reroute``),
    w1 answers its 424 instead of the base model's fallback, and the request is served
    with its own adapter by w3; the client gets that one answer."""
    _refuse_chat(stack.workers["w1"], VllmFailure.vllm_rank_too_large)
    status, headers, body = await stack.post({"model": "chat", "prompt": "q"}, headers=ACTIVE)
    assert (status, headers["X-Loraplane-Worker"]) == (200, "w3"), body
    assert "X-Loraplane-Fallback" not in headers
    assert headers["X-Loraplane-Lora-Name"] == CHAT[0]
    (refused,) = stack.sinks["w1"].messages(RequestLog)
    assert (refused.error, refused.tier_at_arrival) == ("vllm_rank_too_large", "cold")
    (served,) = stack.sinks["w3"].messages(RequestLog)
    assert served.status == "ok" and served.lora_name == CHAT[0]


@pytest.mark.asyncio(loop_scope="session")
async def test_an_interactive_request_falls_back_on_the_last_worker_only(stack: Stack) -> None:
    """Every worker the router tries refuses the version as its own: the last one (told no
    other is left) serves the base model's fallback, permanent, as without a router; a
    worker alone in the view falls back at once, asked once."""
    for wid in ("w1", "w3"):
        _refuse_chat(stack.workers[wid], VllmFailure.vllm_adapter_refused)
    status, headers, body = await stack.post({"model": "chat", "prompt": "q"}, headers=ACTIVE)
    assert (status, headers["X-Loraplane-Worker"]) == (200, "w3"), body
    assert headers["X-Loraplane-Fallback"] == "base"
    assert headers["X-Loraplane-Fallback-Permanent"] == "true"
    assert headers["X-Loraplane-Fallback-Reason"] == "vllm_adapter_refused"
    assert len(stack.sinks["w1"].messages(RequestLog)) == 1  # its 424, then w3's fallback
    for wid in ("w2", "w3"):
        stack.router.fleet.index.remove(wid)
    stack.router.refusals = Refusals()
    status, headers, body = await stack.post({"model": "chat", "prompt": "q"}, headers=ACTIVE)
    assert (status, headers["X-Loraplane-Worker"]) == (200, "w1"), body
    assert headers["X-Loraplane-Fallback"] == "base"
    assert len(stack.sinks["w1"].messages(RequestLog)) == 2


@contextlib.asynccontextmanager
async def _w3_not_serving(stack: Stack, other: str) -> AsyncIterator[list[bytes]]:
    """w3 stays in the view but does not serve: its gateway is gone (the discard port:
    refused) or, ``other == "unsigned"``, refuses the router's forward (401); yields the
    requests that gateway was asked."""
    asked: list[bytes] = []
    server: asyncio.AbstractServer | None = None
    url = "http://127.0.0.1:9"
    if other == "unsigned":
        server, url = await _always_answers(_answer_401("forward_outdated"), asked)
    try:
        index = stack.router.fleet.index
        w3 = index.workers["w3"].state
        index.update(at(w3, w3.ts.timestamp(), url))
        yield asked
    finally:
        if server is not None:
            server.close()


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("other", ["gone", "unsigned"])
async def test_an_interactive_request_the_other_worker_fails_gets_its_fallback(
    stack: Stack, other: str
) -> None:
    """w1 refuses the version as its own and answers its 424 (the router had w3 left), but
    w3 does not serve it: its gateway is gone, or refuses the router's forward (another
    router secret). The router asks w1 again, as the last worker, and the tenant gets its
    base model's fallback, as without a router, never the 424 of one worker's own."""
    _refuse_chat(stack.workers["w1"], VllmFailure.vllm_rank_too_large)
    async with _w3_not_serving(stack, other) as asked:
        status, headers, body = await stack.post({"model": "chat", "prompt": "q"}, headers=ACTIVE)
        assert (status, headers["X-Loraplane-Worker"]) == (200, "w1"), body
        assert headers["X-Loraplane-Fallback"] == "base"
        assert headers["X-Loraplane-Fallback-Reason"] == "vllm_rank_too_large"
        assert headers["X-Loraplane-Fallback-Permanent"] == "true"
        assert len(asked) == (other == "unsigned")
        logs = stack.sinks["w1"].messages(RequestLog)  # its 424, then its fallback
        assert [r.status for r in logs] == ["error", "ok"]
        assert logs[1].request_id == logs[0].request_id + "-r2"


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("other", ["gone", "unsigned"])
async def test_a_batch_request_the_other_worker_fails_gets_the_held_424_at_once(
    stack: Stack, other: str
) -> None:
    """A batch request has no fallback: w1's own 424 is held while w3 is tried, and when w3
    does not serve it (gone, or refusing the router's forward) that 424 is the answer. The
    forward to w1 is not signed ``X-Loraplane-Reroute`` (only a request that falls back
    is), so w1 is not asked again for a fallback it has none of: one forward to it."""
    _refuse_chat(stack.workers["w1"], VllmFailure.vllm_rank_too_large)
    async with _w3_not_serving(stack, other) as asked:
        status, headers, body = await stack.post({"model": "chat", "prompt": "q"}, headers=BATCH)
        assert (status, headers["X-Loraplane-Worker"]) == (PERMANENT_STATUS, "w1"), body
        assert body["error"]["type"] == ServingRefusal.adapter_refused_by_worker
        assert len(asked) == (other == "unsigned")
        assert [r.status for r in stack.sinks["w1"].messages(RequestLog)] == ["error"]
        assert len(stack.workers["w1"].asked) == 1


@pytest.mark.asyncio(loop_scope="session")
async def test_an_interactive_request_for_a_refused_artifact_falls_back_at_once(
    stack: Stack,
) -> None:
    """The artifact's own refusal (gone from the store: every worker refuses it alike) is
    no reason to try another worker: the chosen one serves the base model's fallback,
    permanent, and no other worker is asked."""
    _refuse_chat(stack.workers["w1"], ArtifactReason.manifest_missing)
    status, headers, body = await stack.post({"model": "chat", "prompt": "q"}, headers=ACTIVE)
    assert (status, headers["X-Loraplane-Worker"]) == (200, "w1"), body
    assert headers["X-Loraplane-Fallback"] == "base"
    assert headers["X-Loraplane-Fallback-Reason"] == "manifest_missing"
    assert headers["X-Loraplane-Fallback-Permanent"] == "true"
    assert stack.workers["w3"].asked == stack.workers["w2"].asked == []


@pytest.mark.asyncio(loop_scope="session")
async def test_an_artifacts_own_424_is_passed_on_without_another_worker(stack: Stack) -> None:
    """A 424 for the artifact itself (gone from the store): every worker would refuse it,
    so the client gets it at once, and no other worker is asked."""
    _refuse_chat(stack.workers["w1"], ArtifactReason.manifest_missing)
    status, headers, body = await stack.post({"model": "chat", "prompt": "q"}, headers=BATCH)
    assert status == PERMANENT_STATUS and headers["X-Loraplane-Worker"] == "w1"
    assert body["error"]["type"] == ServingRefusal.adapter_unavailable_permanent
    assert "manifest_missing" in body["error"]["message"]
    assert len(stack.workers["w1"].asked) == 1
    assert stack.workers["w3"].asked == stack.workers["w2"].asked == []


@pytest.mark.asyncio(loop_scope="session")
async def test_a_workers_own_424_is_passed_on_when_no_other_worker_serves(stack: Stack) -> None:
    """Every worker tried refuses the version as its own: the last 424 is the answer, within
    the router's one re-route (w2, which would load it, is not a third try)."""
    for wid in ("w1", "w3"):
        _refuse_chat(stack.workers[wid], VllmFailure.vllm_adapter_refused)
        stack.workers[wid].refusal_hold_s = 30.0  # said to the router, not to the client
    status, headers, body = await stack.post({"model": "chat", "prompt": "q"}, headers=BATCH)
    assert status == PERMANENT_STATUS and headers["X-Loraplane-Worker"] == "w3"
    assert body["error"]["type"] == ServingRefusal.adapter_refused_by_worker
    assert "Retry-After" not in headers
    assert HOLD_HEADER not in headers  # the gateway's word to the router alone
    assert len(stack.workers["w1"].asked) == len(stack.workers["w3"].asked) == 1
    assert stack.workers["w2"].asked == []
    # the only worker of the base model: its own 424 is the answer, with no second try
    for wid in ("w2", "w3"):
        stack.router.fleet.index.remove(wid)
    stack.workers["w1"].asked.clear()
    status, headers, body = await stack.post({"model": "chat", "prompt": "q"}, headers=BATCH)
    assert (status, headers["X-Loraplane-Worker"]) == (PERMANENT_STATUS, "w1")
    assert body["error"]["type"] == ServingRefusal.adapter_refused_by_worker
    assert len(stack.workers["w1"].asked) == 1


@pytest.mark.asyncio(loop_scope="session")
async def test_attack_a_captured_forward_is_served_once(stack: Stack) -> None:
    """ATTACK: a forward the router sent to worker w0's gateway, captured, sent to that
    gateway again within its window: served once, then refused 401 ``forward_replayed``
    (and not logged) however often it comes. A forgery of it (its MAC changed) taken first
    is refused as unsigned and takes nothing from the forward: only signatures that verify
    are remembered."""
    async with captured_forward(stack, AUTH_A) as capture:
        captured, door = capture.headers, capture.gateway.door
        raw = json.dumps({"model": "sql", "prompt": "q"}).encode()
        target = capture.url + "/v1/completions"
        signature = captured[SIGNATURE_HEADER]
        flipped = signature[:-1] + ("0" if signature[-1] != "0" else "1")
        for _ in range(3):
            forged = {**captured, SIGNATURE_HEADER: flipped}
            async with stack.http.post(target, data=raw, headers=forged) as resp:
                assert (resp.status, (await resp.json())["error"]["type"]) == (401, "unauthorized")
        assert len(door.replays) == 0
        async with stack.http.post(target, data=raw, headers=captured) as resp:
            assert resp.status == 200, await resp.text()
        for _ in range(3):
            async with stack.http.post(target, data=raw, headers=captured) as resp:
                body = await resp.json()
                assert (resp.status, body["error"]["type"]) == (401, "forward_replayed"), body
        assert len(capture.sink.messages(RequestLog)) == 1 and len(door.replays) == 1


@pytest.mark.asyncio(loop_scope="session")
async def test_the_same_request_sent_again_is_forwarded_anew(stack: Stack) -> None:
    """A client sending the same request again at once (the same request id, body and
    session key, within one second) is no replay: each forward the router signs is its
    own (its nonce), and the gateway serves both."""
    headers = {**AUTH_A, "X-Request-Id": "again-1", "X-Session-Key": "s1"}
    now = datetime.now(UTC).timestamp()
    stack.router._clock = lambda: now  # one second for all three: only the nonce differs
    for _ in range(3):
        status, answer, body = await stack.post({"model": "sql", "prompt": "q"}, headers=headers)
        assert (status, answer["X-Loraplane-Worker"]) == (200, "w2"), body
    assert [r.request_id for r in stack.sinks["w2"].messages(RequestLog)] == ["again-1"] * 3


def _answer_401(kind: str) -> bytes:
    """A gateway's 401 as it travels, with ``kind`` as its ``error.type``."""
    body = json.dumps(
        {"error": {"message": "gateway words", "type": kind, "param": None, "code": 401}}
    ).encode()
    return (
        b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json; charset=utf-8\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize(
    "kind", ["unauthorized", "forward_outdated", "forward_replayed", "x" * 5000, "rotated"]
)
async def test_a_gateway_refusing_the_routers_forward_is_passed_by(
    stack: Stack, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A gateway's 401 refuses the router's own forward (a form of another version during
    an upgrade, a secret rotated on one side, a replay), never the tenant, whose key was
    good: the request goes to another worker, which serves it, and the client never sees
    that 401; the line logged names the worker and a reason of the front door's (or
    ``other``: a gateway's bytes are not kept)."""
    asked: list[bytes] = []
    if kind == "rotated":  # a real gateway whose router secret is another
        _, server = await _gateway_of_w0(ListSink(), b"t" * 32)
        url = str(server.make_url("")).rstrip("/")
    else:
        server, url = await _always_answers(_answer_401(kind), asked)
    try:
        _sql_hot_on_w0(stack, url)
        with caplog.at_level("WARNING", logger="loraplane.router"):
            status, headers, body = await stack.post({"model": "sql", "prompt": "q"})
        assert (status, headers["X-Loraplane-Worker"]) == (200, "w2"), body
        assert len(asked) == (0 if kind == "rotated" else 1)
        (line,) = [r.getMessage() for r in caplog.records if "w0" in r.getMessage()]
        told = "unauthorized" if kind == "rotated" else kind if len(kind) < 100 else "other"
        assert f": {told} (worker w0 gateway {url})" in line, line[:300]
        assert "w0" in stack.router.fleet.index.workers  # not parked: no failure of its own
    finally:
        close = server.close()
        if close is not None:
            await close


@pytest.mark.asyncio(loop_scope="session")
async def test_no_gateway_taking_the_routers_forward_is_the_routers_own_502(
    stack: Stack,
) -> None:
    """The only workers of the base model refuse the router's forward: the client gets the
    router's own 502 ``forward_refused`` (counted), never a gateway's 401 (which would say
    the tenant's key was bad) nor its words; within the router's two attempts."""
    asked: list[bytes] = []
    server, url = await _always_answers(_answer_401("forward_outdated"), asked)
    try:
        for wid in ("w1", "w2", "w3"):
            stack.router.fleet.index.remove(wid)
        _sql_hot_on_w0(stack, url)
        status, headers, body = await stack.post({"model": "sql", "prompt": "q"})
        assert (status, body["error"]["type"]) == (502, "forward_refused"), body
        assert headers["Retry-After"] == "5" and "gateway words" not in json.dumps(body)
        assert len(asked) == 1
        assert stack.router.outcomes["forward_refused"] == 1
        stale = at(worker("w4", base=RECORDS[2].base_model), datetime.now(UTC).timestamp(), url)
        stack.router.fleet.index.update(stale.model_copy(update={"max_lora_rank": 64}))
        status, _, body = await stack.post({"model": "sql", "prompt": "q"})
        assert (status, body["error"]["type"]) == (502, "forward_refused"), body
        assert len(asked) == 3  # w0 and w4, once each: two attempts, no more
    finally:
        server.close()


def _later(stack: Stack, later: float) -> None:
    """The router's clock ``later`` seconds on, every worker's heartbeat as fresh then."""
    index = stack.router.fleet.index
    for w in list(index.workers.values()):
        index.update(at(w.state, w.state.ts.timestamp() + later, w.state.gateway_url))
    stack.router._clock = lambda: datetime.now(UTC).timestamp() + later


@pytest.mark.asyncio(loop_scope="session")
async def test_a_gateway_refusing_every_forward_is_passed_over_while_remembered(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """w0's gateway refuses every forward (its router secret rotated on one side), and w0
    is the first choice for sql (a hot copy, the lowest id) and for chat (the most free
    slots): only the first request pays the hop through it. While the router remembers the
    refusal, requests of any version go to other workers first (w0 asked once, not once per
    request); w0 is still asked when no other worker fits, and is the first choice again
    once the memory of it has lapsed. One log line for its reason in the interval."""
    asked: list[bytes] = []
    server, url = await _always_answers(_answer_401("unauthorized"), asked)
    stack.router.refusals = Refusals(ttl_s=10.0)  # its lapse within a forward's window
    try:
        _sql_hot_on_w0(stack, url)
        with caplog.at_level("WARNING", logger="loraplane.router"):
            for _ in range(3):
                status, headers, body = await stack.post({"model": "sql", "prompt": "q"})
                assert (status, headers["X-Loraplane-Worker"]) == (200, "w2"), body
            status, headers, body = await stack.post({"model": "chat", "prompt": "q"})
            assert status == 200 and headers["X-Loraplane-Worker"] in ("w1", "w3"), body
            assert len(asked) == 1  # one hop through w0 in all
            now = datetime.now(UTC).timestamp()
            assert stack.router.refusals.of(RECORDS[2].lora_name, now) == {"w0"}
            assert stack.router.refusals.of(CHAT[0], now) == {"w0"}
            assert "w0" in stack.router.fleet.index.workers  # not parked
            for wid in ("w1", "w2", "w3"):  # no other worker fits: w0 is asked again
                stack.router.fleet.index.remove(wid)
            status, _, body = await stack.post({"model": "sql", "prompt": "q"})
            assert (status, body["error"]["type"]) == (502, "forward_refused"), body
            assert len(asked) == 2
        lines = [r.getMessage() for r in caplog.records if "w0" in r.getMessage()]
        assert len(lines) == 1 and ": unauthorized (worker w0" in lines[0], lines
        assert _gateway_refusals(stack.router) == {"unauthorized": 2}  # each one counted
        # the memory lapses: w0 is the first choice again
        for wid in ("w1", "w2", "w3"):
            serving = stack.workers[wid]
            state = worker(wid, slots=2, base=RECORDS[2].base_model)
            stack.router.fleet.index.update(
                at(state, datetime.now(UTC).timestamp(), serving.gateway_url, max_lora_rank=64)
            )
        _later(stack, 11.0)
        status, headers, body = await stack.post({"model": "sql", "prompt": "q"})
        assert status == 200 and headers["X-Loraplane-Worker"] != "w0", body
        assert len(asked) == 3
    finally:
        server.close()


async def _takes_then_drops(gateway_url: str) -> tuple[asyncio.AbstractServer, str, list[str]]:
    """A hop in front of a gateway that passes each request on and its answer back, kept
    alive, except the second request of a connection: that one reaches the gateway (which
    takes it and answers), and the connection is closed with no byte of the answer, as a
    gateway's keep-alive closing under a request looks. Each request's signature noted."""
    port = int(gateway_url.rsplit(":", 1)[1])
    signatures: list[str] = []

    async def pass_on(n: int, request: bytes) -> bytes | None:
        signature = re.search(rb"(?i)\r\nx-loraplane-forwarded: *([^\r]+)", request)
        signatures.append(signature[1].decode() if signature else "")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request)
            answer = await _message(reader)
        finally:
            writer.close()
        return None if n == 1 else answer  # the second: taken, and no answer

    server, url = await _answering(pass_on)
    return server, url, signatures


@pytest.mark.asyncio(loop_scope="session")
async def test_a_forward_sent_again_on_a_fresh_connection_is_signed_anew(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """The router's keep-alive connection to w0's gateway closes under its second request,
    which the gateway took, with no answer: the router's pool sends it once more on a fresh
    connection, signed anew (a new nonce), so w0's gateway serves it instead of refusing it
    401 ``forward_replayed`` (no legitimate path repeats a signature): w0, the only worker
    of the base model, answers both requests."""
    sink = ListSink()
    gateway, real = await _gateway_of_w0(sink)
    hop, url, signatures = await _takes_then_drops(str(real.make_url("")).rstrip("/"))
    try:
        for wid in ("w1", "w2", "w3"):
            stack.router.fleet.index.remove(wid)
        _sql_hot_on_w0(stack, url)
        with caplog.at_level("WARNING", logger="loraplane.router"):
            for _ in range(2):
                status, headers, body = await stack.post({"model": "sql", "prompt": "q"})
                assert (status, headers.get("X-Loraplane-Worker")) == (200, "w0"), body
        assert len(signatures) == 3 and len(set(signatures)) == 3  # the resend: its own
        logged = sink.messages(RequestLog)
        assert [r.status for r in logged] == ["ok"] * 3  # the one taken and dropped too
        assert logged[1].request_id == logged[2].request_id  # one request, sent again
        assert len(gateway.door.replays) == 3
        assert not [r for r in caplog.records if "refused the router's forward" in r.getMessage()]
    finally:
        hop.close()
        await real.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_models_lists_only_the_tenants_adapters(stack: Stack) -> None:
    async with stack.http.get(stack.url + "/v1/models", headers=AUTH_A) as resp:
        data = (await resp.json())["data"]
    assert sorted(m["id"] for m in data) == ["chat", "sql"]
    async with stack.http.get(stack.url + "/v1/models") as resp:
        assert resp.status == 401


@pytest.mark.asyncio(loop_scope="session")
async def test_gateway_believes_a_forwarded_tenant_only_when_signed(stack: Stack) -> None:
    url = stack.router.fleet.index.workers["w2"].state.gateway_url + "/v1/completions"
    raw = json.dumps({"model": "sql", "prompt": "q"}).encode()
    now = datetime.now(UTC).timestamp()
    good = forwarded("tenant-a", "r1", raw, now)
    cases = [
        (good, 200),
        ({**good, SIGNATURE_HEADER: "0." + "0" * 64}, 401),
        ({k: v for k, v in good.items() if k != SIGNATURE_HEADER}, 401),
        ({**good, TENANT_HEADER: "tenant-b"}, 401),
        ({**good, **AUTH_A, TENANT_HEADER: "tenant-b"}, 401),  # a key does not help
        ({**good, "X-Request-Id": "r2"}, 401),
        ({**good, "X-Request-Class": "batch"}, 401),  # the class is signed too
        ({**good, VERSION_HEADER: "2"}, 401),
        ({**good, REROUTE_HEADER: "1"}, 401),  # and whether the router has another worker
    ]  # and the version
    for headers, want in cases:
        async with stack.http.post(url, data=raw, headers=headers) as resp:
            assert resp.status == want, headers
    stale = forwarded("tenant-a", "r1", raw, now - 120)
    async with stack.http.post(url, data=raw, headers=stale) as resp:
        assert resp.status == 401


@pytest.mark.asyncio(loop_scope="session")
async def test_attack_a_forward_replayed_on_another_path_or_query_is_refused(
    stack: Stack,
) -> None:
    """A forward signed for one endpoint (its headers captured on loopback), replayed within
    its window on another endpoint or query of the same gateway with a body that meets that
    endpoint's allowlist: refused 401, never served."""
    gateway = stack.router.fleet.index.workers["w2"].state.gateway_url
    chat = json.dumps({"model": "sql", "messages": [{"role": "user", "content": "q"}]}).encode()
    text = json.dumps({"model": "sql", "prompt": "q"}).encode()
    now = datetime.now(UTC).timestamp()
    for n, (signed_for, sent_to, raw) in enumerate(
        [
            ("/v1/chat/completions", "/v1/chat/completions", chat),  # the honest forward
            ("/v1/completions", "/v1/chat/completions", chat),
            ("/v1/chat/completions", "/v1/completions", text),
            ("/v1/completions", "/v1/completions?stream=true", text),
            ("/v1/completions?a=1", "/v1/completions?a=2", text),
            ("/v1/completions?a=1", "/v1/completions", text),
        ]
    ):
        headers = forwarded("tenant-a", f"p{n}", raw, now, target=Target("POST", signed_for))
        async with stack.http.post(gateway + sent_to, data=raw, headers=headers) as resp:
            body = await resp.json()
            if signed_for == sent_to:
                assert resp.status == 200, body
            else:
                assert (resp.status, body["error"]["type"]) == (401, "unauthorized"), sent_to


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("form", ["v2", "bare"])
async def test_a_forward_of_an_older_router_is_refused_as_outdated(stack: Stack, form: str) -> None:
    """A rolling upgrade: a router signing in an older form (``v2``: no worker, no session
    key; bare: no method or target either) is refused with a reason of its own, never
    served."""
    url = stack.router.fleet.index.workers["w2"].state.gateway_url + "/v1/completions"
    raw = json.dumps({"model": "sql", "prompt": "q"}).encode()
    now = datetime.now(UTC).timestamp()
    fwd = Forward("tenant-a", "interactive", "1", "active")
    headers = {
        **forwarded("tenant-a", "o1", raw, now),
        SIGNATURE_HEADER: _older_form(fwd, "o1", raw, now, form),
    }
    async with stack.http.post(url, data=raw, headers=headers) as resp:
        body = await resp.json()
    assert (resp.status, body["error"]["type"]) == (401, "forward_outdated")
    assert not stack.sinks["w2"].messages(RequestLog)


_OK_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def _captured(head: bytes) -> dict[str, str]:
    """The headers of a forward as the router sent it (one a party on loopback captured),
    without those its HTTP client sets for one connection."""
    lines = head.decode("latin-1").split("\r\n")[1:]
    pairs = [line.split(": ", 1) for line in lines if ": " in line]
    hop = {"host", "content-length", "connection", "accept-encoding", "user-agent", "accept"}
    return {k: v for k, v in pairs if k.lower() not in hop}


@dataclass
class Capture:
    """A forward the router sent to worker w0 (its headers, captured on the way), and the
    real gateway of w0 (``url``), which was not sent it."""

    headers: dict[str, str]
    gateway: Gateway
    sink: ListSink
    url: str


@asynccontextmanager
async def captured_forward(stack: Stack, client: dict[str, str]) -> AsyncIterator[Capture]:
    """Capture the forward of a request for sql sent to the router with ``client``'s
    headers: the router sends it to w0, whose address answers 200 and keeps what it got."""
    asked: list[bytes] = []
    capture, url = await _always_answers(_OK_ANSWER, asked)
    sink = ListSink()
    gateway, server = await _gateway_of_w0(sink)
    try:
        _sql_hot_on_w0(stack, url)
        status, headers, _ = await stack.post({"model": "sql", "prompt": "q"}, headers=client)
        assert (status, headers["X-Loraplane-Worker"]) == (200, "w0")
        (head,) = asked
        yield Capture(_captured(head), gateway, sink, str(server.make_url("")).rstrip("/"))
    finally:
        capture.close()
        await server.close()


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("session", [None, "s-17"])
async def test_attack_a_captured_forward_serves_on_no_other_gateway_or_session(
    stack: Stack, session: str | None
) -> None:
    """ATTACK: a forward the router sent to worker w0's gateway, captured on its way, sent
    within its window to w2's gateway (the same router secret), or to w0's own with its
    ``X-Session-Key`` changed, added or removed: refused 401, never served nor logged. Sent
    unchanged to the gateway of the worker it was signed for, it serves."""
    client = {**AUTH_A, **({} if session is None else {"X-Session-Key": session})}
    async with captured_forward(stack, client) as capture:
        captured = capture.headers
        assert captured.get("X-Session-Key") == session
        raw = json.dumps({"model": "sql", "prompt": "q"}).encode()
        w2 = stack.router.fleet.index.workers["w2"].state.gateway_url
        w0 = capture.url
        without = {k: v for k, v in captured.items() if k != "X-Session-Key"}
        forged = [
            (w2, captured),  # another worker's gateway
            (w0, {**without, "X-Session-Key": "s-18"}),  # changed or added
            (w0, {**without, "X-Session-Key": session or "s-17"}) if session is None else None,
            (w0, without) if session is not None else None,  # removed
            (w0, {**without, "X-Session-Key": ""}),  # present and empty
        ]
        for gateway_url, sent in [f for f in forged if f is not None]:
            async with stack.http.post(
                gateway_url + "/v1/completions", data=raw, headers=sent
            ) as resp:
                body = await resp.json()
                assert (resp.status, body["error"]["type"]) == (401, "unauthorized"), sent
        assert not stack.sinks["w2"].messages(RequestLog)
        assert not capture.sink.messages(RequestLog)
        async with stack.http.post(w0 + "/v1/completions", data=raw, headers=captured) as resp:
            assert resp.status == 200, await resp.text()  # the worker it was signed for


def test_a_malformed_worker_state_is_dead_lettered_never_a_crash() -> None:
    sink = ListSink()
    fleet = Fleet(FleetIndex(POLICY, 5.0), sink, "router-t")
    good = at(worker("w1"), NOW)
    for key, value in (
        (b"w1", b"not json"),
        (b"w1", b'{"worker_id": "w1"}'),
        (b"w2", good.model_dump_json().encode()),
    ):
        fleet.take(Record("lp.worker-state", 0, 7, key, value, {}, 0))
    fleet.take(Record("lp.worker-state", 0, 8, b"w1", good.model_dump_json().encode(), {}, 0))
    reasons = [d.reason for d in sink.messages(DeadLetter)]
    assert reasons == ["malformed", "invalid", "key_mismatch"]
    assert fleet.to_prove(NOW, 10) == [("w1", good.gateway_url)] and fleet.dead_lettered == 3
    fleet.proved("w1", good.gateway_url, True, NOW)
    assert set(fleet.index.workers) == {"w1"}
    fleet.take(Record("lp.worker-state", 0, 9, b"w1", None, {}, 0))  # tombstone
    assert not fleet.index.workers


def test_versions_are_newest_first() -> None:
    chat = serving_versions(list(RECORDS))["chat"]
    assert [r.version for r in chat] == ["2", "1"]


def test_the_router_state_reports_in_flight_and_non_empty_queues() -> None:
    from loraplane.router.flow_control import BANDS
    from loraplane.schemas.adapter import Priority
    from loraplane.schemas.codec import decode, encode
    from loraplane.schemas.request_log import RequestClass
    from loraplane.schemas.router_state import RouterState

    router = Router(
        Fleet(FleetIndex(POLICY, 5.0), ListSink(), "router-t"),
        api_keys=KEYS,
        budgets=RequestBudgets(),
        secret=SECRET,
    )
    band = BANDS[(RequestClass.batch, Priority.silver)]
    now = 1_800_000_000.0
    admitted = router.flow.offer("llama", band, "t1", 1, now)
    queued = [router.flow.offer("llama", band, t, 1, now) for t in ("t1", "t2")]
    state = decode(RouterState, encode(router.state("r1", now)))
    assert state.in_flight == {"llama": 1}
    assert [(q.base_model, q.band, q.queued) for q in state.queues] == [("llama", band.label, 2)]
    for ticket in (admitted, *queued):
        assert not isinstance(ticket, str)
    router.flow.pump("llama", 10, now + 1)
    assert router.state("r1", now + 1).queues == []


class LaggingServing(FakeServing):
    """A gateway's worker whose registry view is its own, behind or ahead of the router's."""

    def __init__(self, records: list[AdapterRecord], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.records = records

    def versions(self, adapter_id: str) -> list[AdapterRecord]:
        return [r for r in self.records if r.adapter_id == adapter_id]


def _statused(v1: AdapterStatus, v2: AdapterStatus, canary: float = 0.0) -> list[AdapterRecord]:
    return [tenant_a_record("race", "1", v1), tenant_a_record("race", "2", v2, canary=canary)]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_promote_and_a_rollback_racing_requests_never_split_the_version() -> None:
    """The version is decided once, at the router: whatever either registry view says while
    a promote (canary 2 -> active) and a rollback (back to 1) reach the router and the
    gateway at different moments, every answer is served by exactly the version the router
    chose, or refused with the reason (a version revoked meanwhile)."""
    stages = [
        _statused(AdapterStatus.active, AdapterStatus.canary, 50.0),
        _statused(AdapterStatus.retired, AdapterStatus.active),  # promote
        _statused(AdapterStatus.active, AdapterStatus.retired),  # rollback
        _statused(AdapterStatus.active, AdapterStatus.revoked),
    ]  # 2 revoked
    names = {r.lora_name for stage in stages for r in stage}
    serving = LaggingServing(list(stages[0]), hot=set(names), worker_id="w1")
    gateway = Gateway(
        serving, api_keys=KEYS, budgets=RequestBudgets(), sink=ListSink(), router_secret=SECRET
    )
    gw_server = TestServer(gateway.app(), host="127.0.0.1")
    await gw_server.start_server()
    fleet = Fleet(FleetIndex(POLICY, 5.0), ListSink(), "router-t")
    fleet.index.update(
        at(
            worker("w1", gpu=list(stages[0]), slots=4, base=BASE),
            datetime.now(UTC).timestamp(),
            str(gw_server.make_url("")).rstrip("/"),
            max_lora_rank=64,
        )
    )
    fleet.versions = serving_versions(list(stages[0]))
    router = Router(fleet, api_keys=KEYS, budgets=RequestBudgets(), secret=SECRET)
    rt_server = TestServer(router.app(), host="127.0.0.1")
    await rt_server.start_server()
    url = str(rt_server.make_url("/v1/completions"))
    seen: list[tuple[int, str | None, str | None, str | None]] = []
    done = asyncio.Event()
    rng = random.Random(7)

    async def clients(http: ClientSession, n: int) -> None:
        while not done.is_set():
            headers = {**AUTH_A, "X-Session-Key": f"s{n}-{rng.randrange(10**6)}"}
            async with http.post(
                url, json={"model": "race", "prompt": "q"}, headers=headers
            ) as resp:
                body = await resp.json()
                seen.append(
                    (
                        resp.status,
                        resp.headers.get("X-Loraplane-Version"),
                        resp.headers.get("X-Loraplane-Adapter-Version"),
                        body.get("error", {}).get("type") if resp.status >= 400 else None,
                    )
                )

    async def registry() -> None:
        for _ in range(6):
            for stage in stages[1:]:

                def to_router(stage: list[AdapterRecord] = stage) -> None:
                    fleet.versions = serving_versions(list(stage))

                def to_gateway(stage: list[AdapterRecord] = stage) -> None:
                    serving.records = list(stage)

                first, second = to_router, to_gateway
                if rng.random() < 0.5:
                    first, second = second, first
                first()
                await asyncio.sleep(rng.uniform(0.0, 0.03))  # one view lags the other
                second()
                await asyncio.sleep(rng.uniform(0.01, 0.03))
            fleet.versions = serving_versions(list(stages[0]))
            serving.records = list(stages[0])
        done.set()

    try:
        async with ClientSession() as http:
            await asyncio.gather(registry(), *(clients(http, n) for n in range(4)))
    finally:
        await rt_server.close()
        await gw_server.close()
    served = [s for s in seen if s[0] == 200]
    assert len(served) > 50 and {s[1] for s in served} == {"1", "2"}
    assert all(decided == used for _, decided, used, _ in served), served
    refused = [s for s in seen if s[0] != 200]
    assert all(
        s[3] in ("version_revoked", "version_unknown", "no_serving_version") for s in refused
    ), refused


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize(
    "body",
    [
        b'{"ok": true, "worker_id": "w0", "pad": "' + b"x" * (8 * 1024 * 1024) + b'"}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"ok": true, "worker_id": "w9", "worker_id": "w0"}',
    ],
    ids=["8 MiB", "nested", "duplicate key"],
)
async def test_attack_a_probed_gateways_answer_is_bounded(stack: Stack, body: bytes) -> None:
    """ATTACK: an address a forged worker state announces answers the router's /healthz
    probe with 8 MiB naming the worker (read whole, up to 64 MiB, for every gateway probed
    at once, and believed), with JSON nested past the recursion limit (an exception the
    probe did not expect), or naming another worker first and ours last (a plain JSON read
    believes the last). Each fails the probe: it is read by the strict, bounded reader."""
    server, url = await _dies_mid_answer(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % len(body)
        + body
    )
    try:
        assert await stack.router.probe("w0", url) is False
    finally:
        server.close()


def _proof_answer(worker_id: str, url: str, head: bytes) -> bytes:
    """A genuine gateway's ``/healthz`` body for the challenge in a probe's ``head``."""
    challenge = re.search(rb"challenge=([0-9a-f]{32})", head)
    assert challenge is not None, head
    return json.dumps(
        {
            "ok": True,
            "worker_id": worker_id,
            "proof": proof(SECRET, challenge[1].decode(), worker_id, url),
        }
    ).encode()


@pytest.mark.asyncio(loop_scope="session")
async def test_a_gateway_refusing_requests_as_not_run_proves_the_secret_but_is_not_live(
    stack: Stack,
) -> None:
    """A genuine gateway whose vLLM is hung (or serves another base model) says ``not_run``
    in its /healthz: its proof of the router secret holds (no failed proof is counted and
    alerted on for an honest worker), while a liveness probe of it fails (it serves
    nothing, and the router keeps it parked)."""

    async def gateway(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        body = json.loads(_proof_answer("w0", url, head)) | {"not_run": "vllm_timeout"}
        data = json.dumps(body).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
            % (len(data), data)
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(gateway, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        assert await stack.router.probe("w0", url, serving=False) is True
        assert await stack.router.probe("w0", url) is False
    finally:
        server.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_attack_a_gateway_gone_from_the_view_keeps_no_connection(stack: Stack) -> None:
    """ATTACK: forged worker states announcing a new gateway address each time. Each address
    the router probed or forwarded to kept its pool and its kept-alive connections after
    no worker named it any more: open descriptors without a bound. A gateway no worker in
    the view names has its connections closed at the next drain pass."""
    closed = asyncio.Event()

    async def gateway(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        body = _proof_answer("w0", url, head)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        if not await reader.read(1):  # kept alive until the router lets it go
            closed.set()
        writer.close()

    server = await asyncio.start_server(gateway, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    watch = asyncio.create_task(_watch_fleet(stack.router, lambda: None, 0.05, poll_s=0.01))
    try:
        _sql_hot_on_w0(stack, url)
        assert await stack.router.probe("w0", url) is True
        await asyncio.sleep(0.2)
        assert not closed.is_set()  # still in the view: kept
        stack.router.fleet.index.forget("w0")
        await asyncio.wait_for(closed.wait(), 3)
    finally:
        watch.cancel()
        server.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_answers_read_whole_are_bounded_across_requests(stack: Stack) -> None:
    """ATTACK: many requests at once whose gateways answer big bodies (up to 64 MiB each,
    read whole before they are relayed). Each answer was bounded, their sum was not: a
    thousand in flight could hold 64 GiB. All of them at once are bounded by the router's
    ``answer_budget``: an answer past it is a 503 ``answers_full`` + Retry-After, and the
    gateway stays in the view (its answer was no fault of its own). What a relayed answer
    held is freed once it is written."""
    budget = stack.router.answer_budget
    assert budget.held == 0
    status, _, body = await stack.post({"model": "sql", "prompt": "q"})
    assert status == 200 and budget.held == 0  # written, then freed
    before = set(stack.router.fleet.index.workers)
    budget.held = budget.max_bytes - 10  # the answers of others fill it
    try:
        status, headers, body = await stack.post({"model": "sql", "prompt": "q"})
    finally:
        budget.held -= budget.max_bytes - 10
    assert (status, body["error"]["type"]) == (503, "answers_full"), body
    assert headers["Retry-After"] == str(stack.router.retry_after_s)
    assert set(stack.router.fleet.index.workers) == before  # nobody parked
    assert budget.held == 0
    assert stack.router.outcomes["answers_full"] == 1
    text = await router_metrics(stack.router, stack.http)
    assert "\nloraplane_router_answer_bytes_held 0.0\n" in text


def test_attack_a_worker_state_is_routed_only_once_its_gateway_proved_the_router_secret() -> None:
    """ATTACK: a worker state is anyone's who may write the worker-state topic, and the
    router routed on it as it arrived: a forged state announcing an address of the forger's
    took tenants' requests (their prompts) there. A state is held until the gateway at its
    address proves the router secret for that worker and address; a failed proof drops it
    and is asked again no sooner than PROOF_RETRY_S; a proven worker's next states go in at
    once, and a new address waits for its own proof while the proven one is routed."""
    fleet = Fleet(FleetIndex(POLICY, 5.0), ListSink(), "router-t")
    good = at(worker("w1"), NOW)
    fleet.offer(good, NOW)
    assert not fleet.index.workers
    assert fleet.to_prove(NOW, 10) == [("w1", "http://w1")]
    assert fleet.to_prove(NOW, 10) == []  # being asked
    fleet.proved("w1", "http://w1", False, NOW)
    assert not fleet.index.workers
    fleet.offer(at(worker("w1"), NOW + 1), NOW + 1)
    assert fleet.to_prove(NOW + 1, 10) == []  # failed lately
    assert fleet.to_prove(NOW + PROOF_RETRY_S, 10) == [("w1", "http://w1")]
    fleet.proved("w1", "http://w1", True, NOW + PROOF_RETRY_S)
    assert set(fleet.index.workers) == {"w1"}
    fleet.offer(at(worker("w1"), NOW + 6, "http://elsewhere"), NOW + 6)
    assert fleet.index.workers["w1"].state.gateway_url == "http://w1"
    assert fleet.to_prove(NOW + 6, 10) == [("w1", "http://elsewhere")]
    fleet.offer(at(worker("w1"), NOW + 7), NOW + 7)  # back at the proven address: at once
    assert fleet.index.workers["w1"].beat == NOW + 7
    fleet.proved("w1", "http://elsewhere", True, NOW + 7)  # no state names it any more
    assert fleet.index.workers["w1"].state.gateway_url == "http://w1"


def test_attack_forged_states_under_many_ids_hold_bounded_memory_and_proofs() -> None:
    """ATTACK: forged states under 20,000 worker ids. None is routed; the held ones are at
    most MAX_UNPROVEN (the oldest dropped) and the proofs asked at once at most the room
    the runtime gives (PROOFS_IN_FLIGHT)."""
    fleet = Fleet(FleetIndex(POLICY, 5.0), ListSink(), "router-t")
    for i in range(20_000):
        fleet.offer(at(worker(f"f{i}"), NOW, f"http://10.0.{i // 250}.{i % 250}:80"), NOW)
    assert not fleet.index.workers
    asked = fleet.to_prove(NOW, PROOFS_IN_FLIGHT)
    assert len(asked) == PROOFS_IN_FLIGHT
    assert asked[0][0] == f"f{20_000 - MAX_UNPROVEN}"  # the oldest kept
    for wid, url in asked:
        fleet.proved(wid, url, False, NOW)
    assert len(fleet.to_prove(NOW, 10**6)) == MAX_UNPROVEN - PROOFS_IN_FLIGHT
    assert fleet.unproven == MAX_UNPROVEN - PROOFS_IN_FLIGHT
    assert fleet.proofs_failed == PROOFS_IN_FLIGHT


async def _answer_json(writer: asyncio.StreamWriter, body: bytes) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (len(body), body)
    )
    await writer.drain()
    writer.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_attack_an_address_that_cannot_prove_the_secret_gets_no_request(
    stack: Stack,
) -> None:
    """ATTACK: forged states announce addresses of the forger's: one answering the probe
    as a gateway would without a router secret (``ok`` and the worker's id: believed
    before), and one relaying the probe to the genuine gateway of w2 (whose proof binds
    its own address). Neither is routed, and no request reaches either; the genuine w2
    still serves."""
    asked: list[bytes] = []
    genuine = next(
        w.state.gateway_url
        for w in stack.router.fleet.index.workers.values()
        if w.state.worker_id == "w2"
    )

    async def forger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        asked.append(head.split(b"\r\n", 1)[0])
        if head.startswith(b"GET /healthz"):
            target = head.split(b" ")[1].decode()
            host, port = genuine.removeprefix("http://").split(":")
            r, w = await asyncio.open_connection(host, int(port))
            w.write(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            relayed = await r.read()
            w.close()
            body = relayed.split(b"\r\n\r\n", 1)[1]
        else:
            body = b"{}"
        await _answer_json(writer, body)

    async def plain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        asked.append(head.split(b"\r\n", 1)[0])
        await _answer_json(writer, b'{"ok": true, "worker_id": "w7"}')

    relay = await asyncio.start_server(forger, "127.0.0.1", 0)
    lone = await asyncio.start_server(plain, "127.0.0.1", 0)
    relay_url = f"http://127.0.0.1:{relay.sockets[0].getsockname()[1]}"
    lone_url = f"http://127.0.0.1:{lone.sockets[0].getsockname()[1]}"
    sql = RECORDS[2]
    now = datetime.now(UTC).timestamp()
    forged = [
        at(worker(wid, gpu=[sql], slots=9, base=sql.base_model), now + 1, url, max_lora_rank=64)
        for wid, url in (("w2", relay_url), ("w7", lone_url))
    ]
    watch = asyncio.create_task(_watch_fleet(stack.router, lambda: None, 0.05, poll_s=0.01))
    try:
        for state in forged:
            stack.router.fleet.offer(state, now + 1)
        for _ in range(200):
            if sum(line.startswith(b"GET /healthz") for line in asked) >= 2:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        index = stack.router.fleet.index
        assert "w7" not in index.workers and "w7" not in index.parked
        assert index.workers["w2"].state.gateway_url == genuine
        for _ in range(5):
            async with stack.http.post(
                stack.url + "/v1/completions", headers=AUTH_A, json={"model": "sql", "prompt": "q"}
            ) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["X-Loraplane-Worker"] == "w2"
        assert all(line.startswith(b"GET /healthz?challenge=") for line in asked), asked
    finally:
        watch.cancel()
        relay.close()
        lone.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_a_stopped_fleet_watch_leaves_no_proof_or_probe_in_flight(stack: Stack) -> None:
    """Worker states naming gateways that take the connection and never answer: their
    proofs are in flight when the router stops its fleet watch (its probes are asked and
    ended the same way). Stopping it ends them too, at once: no task of the watch is left
    pending, every gateway connection is closed, and no proof or probe is asked after."""
    asked: list[bytes] = []
    closed: list[bool] = []
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        head = await reader.readuntil(b"\r\n\r\n")
        asked.append(head.split(b"\r\n", 1)[0])
        closed.append(await reader.read() == b"")  # EOF: the router closed it

    gateways = [await asyncio.start_server(silent, "127.0.0.1", 0) for _ in range(3)]
    sql = RECORDS[2]
    now = datetime.now(UTC).timestamp()
    for n, gateway in enumerate(gateways):
        url = f"http://127.0.0.1:{gateway.sockets[0].getsockname()[1]}"
        state = at(worker(f"s{n}", gpu=[sql], slots=2, base=sql.base_model), now, url)
        stack.router.fleet.offer(state, now)
    watch = asyncio.create_task(_watch_fleet(stack.router, lambda: None, 0.05, poll_s=0.01))

    def watch_tasks() -> list[asyncio.Task[Any]]:
        return [
            t
            for t in asyncio.all_tasks()
            if not t.done() and "_watch_fleet." in t.get_coro().__qualname__  # type: ignore[union-attr]
        ]

    try:
        for _ in range(300):
            if len(asked) >= 3:
                break
            await asyncio.sleep(0.01)
        assert len(asked) == 3, asked
        assert watch_tasks()  # the proofs wait on gateways that never answer
        watch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(watch, PROBE_TIMEOUT_S / 2)  # not held by a proof
        assert watch_tasks() == []
        for _ in range(100):
            if len(closed) == 3:
                break
            await asyncio.sleep(0.01)
        assert closed == [True] * 3
        await asyncio.sleep(PROBE_TIMEOUT_S)  # past any proof's deadline: nothing more asked
        assert len(asked) == 3, asked
        assert watch_tasks() == []
    finally:
        watch.cancel()
        for writer in held:
            writer.close()
        for gateway in gateways:
            gateway.close()
        for n in range(3):
            stack.router.fleet.forget(f"s{n}")


@pytest.mark.asyncio(loop_scope="session")
async def test_a_gateway_proves_the_router_secret_only_for_a_challenge_and_with_the_secret(
    stack: Stack,
) -> None:
    """A gateway's /healthz carries the proof for a well-formed challenge when it holds the
    router secret, bound to its worker id and its announced address; none for a malformed
    challenge; a gateway without the secret proves nothing (the router does not route to
    it: it could not believe the router's forwarded tenants either)."""
    url = next(
        w.state.gateway_url
        for w in stack.router.fleet.index.workers.values()
        if w.state.worker_id == "w1"
    )
    challenge = "0123456789abcdef" * 2
    async with stack.http.get(f"{url}/healthz?challenge={challenge}") as resp:
        body = await resp.json()
    assert body["proof"] == proof(SECRET, challenge, "w1", url)
    for bad in ("0123", challenge.upper(), challenge + "0", "x" * 32):
        async with stack.http.get(f"{url}/healthz", params={"challenge": bad}) as resp:
            assert "proof" not in await resp.json()
    serving = FakeServing(worker_id="w5", gateway_url="http://127.0.0.1:1")
    lone = TestServer(
        Gateway(serving, api_keys=KEYS, budgets=RequestBudgets(), sink=ListSink()).app(),
        host="127.0.0.1",
    )
    await lone.start_server()
    try:
        async with stack.http.get(lone.make_url(f"/healthz?challenge={challenge}")) as resp:
            assert "proof" not in await resp.json()
    finally:
        await lone.close()


def test_attack_a_flood_of_forged_states_never_pushes_a_known_worker_out() -> None:
    """ATTACK: forged states under fresh ids, 50 for each heartbeat of a genuine worker that
    the router had proven, then lost (a forged tombstone). Each re-offer of a held state
    sent it to the back of the queue and the oldest were evicted first, so the genuine
    state was never asked. A state keeps its place when its worker and address come again,
    a pair that proved itself before is asked first and evicted last."""
    fleet = Fleet(FleetIndex(POLICY, 5.0), ListSink(), "router-t")
    genuine = at(worker("w1"), NOW, "http://10.0.0.1:8000")
    fleet.offer(genuine, NOW)
    assert fleet.to_prove(NOW, 1) == [("w1", "http://10.0.0.1:8000")]
    fleet.proved("w1", "http://10.0.0.1:8000", True, NOW)
    fleet.take(Record("lp.worker-state", 0, 1, b"w1", None, {}, 0))  # a forged tombstone
    assert "w1" not in fleet.index.workers and "w1" not in fleet.proven
    forged = 0
    for beat in range(1, 60):
        fleet.offer(at(worker("w1"), NOW + beat, "http://10.0.0.1:8000"), NOW + beat)
        for _ in range(50):
            forged += 1
            fleet.offer(
                at(worker(f"f{forged}"), NOW + beat, f"http://10.1.{forged // 250}.{forged % 250}"),
                NOW + beat,
            )
    assert fleet.unproven == MAX_UNPROVEN
    assert fleet.to_prove(NOW + 60, 1) == [("w1", "http://10.0.0.1:8000")]
    fleet.proved("w1", "http://10.0.0.1:8000", True, NOW + 60)
    assert fleet.index.workers["w1"].beat == NOW + 59  # its newest state, routed


def test_attack_a_proof_is_forgotten_with_its_worker_and_a_late_one_proves_nothing() -> None:
    """ATTACK: a worker is tombstoned or drained and its address later handed to a host of
    the forger's. Its proof stayed, so a state naming that worker and address was routed at
    once with no challenge. It is forgotten with the worker; a proof that comes back after
    its state was forgotten proves nothing."""
    fleet = Fleet(FleetIndex(POLICY, 5.0), ListSink(), "router-t")
    url = "http://10.0.3.7:8000"
    fleet.offer(at(worker("w1"), NOW, url), NOW)
    fleet.to_prove(NOW, 1)
    fleet.proved("w1", url, True, NOW)
    fleet.forget("w1")  # drained
    fleet.index.forget("w1")
    fleet.offer(at(worker("w1"), NOW + 1, url), NOW + 1)
    assert "w1" not in fleet.index.workers and fleet.unproven == 1  # asked anew
    assert fleet.to_prove(NOW + 1, 1) == [("w1", url)]
    fleet.take(Record("lp.worker-state", 0, 2, b"w1", None, {}, 0))  # gone while being asked
    fleet.proved("w1", url, True, NOW + 2)
    assert "w1" not in fleet.proven and "w1" not in fleet.index.workers


@pytest.mark.parametrize("answer", ["é" * 64, "0" * 63, "0" * 64 + "\n", 12, None, "A" * 64])
def test_attack_a_malformed_proof_is_refused_never_raised(answer: object) -> None:
    """ATTACK: a proof of non-ASCII text made hmac.compare_digest raise TypeError: each
    probe logged a traceback (not rate-limited) instead of refusing the gateway."""
    challenge = "0123456789abcdef" * 2
    assert proven(SECRET, challenge, "w1", "http://w1", answer) is False
    good = proof(SECRET, challenge, "w1", "http://w1")
    assert proven(SECRET, challenge, "w1", "http://w1", good) is True
