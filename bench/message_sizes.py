"""Message sizes on the wire: key + value bytes of one record of each hot topic, encoded with
the project's own schemas and codec, for the broker throughput of ``docs/scale.md``.

Each message is built by the code that writes it in production where that code is pure: the
planner's ``plan`` for commands and memory (on ``bench.planner_scale``'s fleet, signed with a
planner key as the planner agent signs at send time), the registry's ``evaluate`` of signed
publish + promote events for a view, ``streams.scores.snapshot`` for a score record, a
worker state holding what ``bench.planner_scale.converged`` places (16 GPU copies and its
host tier). A request log is ``bench.workload``'s.

    .venv/bin/python -m bench.message_sizes
"""

from __future__ import annotations

import json
import math
import statistics

from bench.planner_scale import NOW, SLOTS, converged, fleet, registry
from bench.workload import request_logs
from loraplane.kernel.policy import Policy
from loraplane.registry.fold import Accepted, AdapterState, evaluate
from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import encode
from loraplane.schemas.request_log import RequestStatus, Tier
from loraplane.streams.planner import plan
from loraplane.streams.scores import ScoreState, observe, score_key, snapshot
from tests.lifecycle_kit import make_kit, record


def _sizes(pairs: list[tuple[str, bytes]]) -> dict[str, float]:
    sizes = [len(k.encode()) + len(v) for k, v in pairs]
    return {"median": statistics.median(sizes), "max": max(sizes), "n": len(sizes)}


def view_bytes(versions: int) -> tuple[str, bytes]:
    """The registry record of one adapter after ``versions`` signed publish + promote pairs."""
    kit = make_kit(now_utc())
    state: AdapterState | None = None
    seq = 0
    for v in range(1, versions + 1):
        for action, extra in (("publish", {"record": record("a000001", str(v))}), ("promote", {})):
            seq += 1
            decided = evaluate(
                kit.event("ci", action, "a000001", str(v), seq, now_utc(), **extra),
                kit.keyring,
                lambda _, s=state: s,
                now_utc(),
            )
            assert isinstance(decided, Accepted), decided
            state = decided.state
    assert state is not None
    return "a000001", encode(state.view)


def measure(adapters: int = 1000, workers: int = 10) -> dict[str, object]:
    views, scores, records = registry(adapters)
    policy = Policy(gpu_slots_per_base_model=SLOTS * math.ceil(workers / 10))
    result = plan(views, scores, fleet(workers), policy, NOW)
    key = make_kit(now_utc()).keys["planner"]
    commands = [(c.worker_id, encode(key.sign_command(c))) for c in result.commands]
    memory = [(wid, encode(m.record())) for wid, m in result.memory.items()]
    states = [
        (w.worker_id, encode(w)) for w in converged(views, scores, records, fleet(workers), policy)
    ]
    logs = [(m.adapter_id, encode(m)) for m in request_logs(1000)]
    state = ScoreState()
    for i, cls in enumerate(("interactive", "batch") * 10):
        state = observe(
            state,
            ts=NOW + i,
            request_class=cls,
            tier=Tier.gpu,
            status=RequestStatus.ok,
            ttft_ms=40.0,
        )
    score = (score_key("a000001", "1"), encode(snapshot(state)))
    return {
        "unit": "bytes per record, key + value",
        "request_log": _sizes(logs),
        "score_snapshot": _sizes([score]),
        "cache_command_signed": _sizes(commands),
        "planner_memory_per_worker_cold_tick": _sizes(memory),
        "worker_state_16_gpu_plus_host": _sizes(states),
        "registry_view_1_version": _sizes([view_bytes(1)]),
        "registry_view_5_versions": _sizes([view_bytes(5)]),
    }


if __name__ == "__main__":
    print(json.dumps(measure()))
