"""``loraplane fleet status``: what the view shows of the workers' latest states."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from loraplane.router.fleet_view import fleet_view
from loraplane.schemas.reasons import VllmFailure
from loraplane.schemas.router_state import QueueDepth, RouterState
from loraplane.schemas.worker_state import LoadedAdapter, WorkerState

NOW = 1_800_000_000.0


def state(
    wid: str,
    base: str,
    gpu: list[str],
    host: list[str] = (),
    age_s: float = 1.0,
    slots: int = 4,
    protected: tuple[str, ...] = (),
    in_flight: int = 0,
) -> WorkerState:
    adapters = [
        LoadedAdapter(
            lora_name=n,
            adapter_id=n.split("@")[0],
            version="1",
            tenant_id="t",
            tier=tier,
            protected=n in protected,
            in_flight=in_flight,
        )
        for tier, names in (("gpu", gpu), ("host", host))
        for n in names
    ]
    return WorkerState(
        worker_id=wid,
        base_model=base,
        ts=datetime.fromtimestamp(NOW - age_s, UTC),
        gpu_slots_used=len(gpu),
        gpu_slots_total=slots,
        host_bytes_used=0,
        host_bytes_budget=1,
        max_lora_rank=64,
        adapters=adapters,
    )


def router(
    rid: str, in_flight: dict[str, int], queues: list[tuple[str, str, int]], age_s: float = 1.0
) -> RouterState:
    return RouterState(
        router_id=rid,
        ts=datetime.fromtimestamp(NOW - age_s, UTC),
        in_flight=in_flight,
        queues=[QueueDepth(base_model=b, band=band, queued=n) for b, band, n in queues],
    )


def test_rows_per_base_model_and_worker_with_replicas_on_live_workers_only() -> None:
    view = fleet_view(
        [
            state(
                "w2", "llama", ["a@1-aa", "b@1-bb"], ["c@1-cc"], protected=("a@1-aa",), in_flight=2
            ),
            state("w1", "llama", ["a@1-aa"]),
            state("w3", "llama", ["a@1-aa", "z@1-zz"], age_s=16.0),  # 3 x 5 s: drained
            state("q1", "qwen", [], ["d@1-dd"]),
        ],
        NOW,
        heartbeat_s=5.0,
    )
    llama, qwen = view.base_models
    assert [w.worker_id for w in llama.workers] == ["w1", "w2", "w3"]
    assert [w.live for w in llama.workers] == [True, True, False]
    assert llama.live_workers == 2 and llama.gpu_slots_free == 3 + 2
    assert llama.replicas == {"a@1-aa": 2, "b@1-bb": 1}  # w3's copies take no traffic
    w2 = llama.workers[1]
    assert (w2.gpu_versions, w2.host_versions, w2.protected, w2.in_flight) == (2, 1, 1, 6)
    assert qwen.replicas == {} and qwen.workers[0].host_versions == 1
    assert view.as_json()["base_models"][0]["workers"][2]["heartbeat_age_s"] == 16.0


def test_no_state_no_rows() -> None:
    assert fleet_view([], NOW, 5.0).base_models == ()


def test_versions_per_tier_in_flight_and_the_routers_queues() -> None:
    states = [
        state("w1", "llama", ["b@1-bb", "a@1-aa"], ["c@1-cc"], in_flight=1),
        state("w2", "llama", ["a@1-aa"], in_flight=4, age_s=30.0),
    ]  # drained
    (llama,) = fleet_view(states, NOW, 5.0).base_models
    w1 = llama.workers[0]
    assert w1.gpu_loras == ("a@1-aa", "b@1-bb") and w1.host_loras == ("c@1-cc",)
    assert llama.in_flight == 3  # live workers only
    assert llama.queue_depth is None and llama.routers == 0  # no router reports
    routers = [
        router(
            "r1", {"llama": 3}, [("llama", "interactive-gold", 2), ("llama", "batch-silver", 5)]
        ),
        router("r2", {"llama": 1}, [("llama", "batch-silver", 1), ("qwen", "batch-silver", 9)]),
        router("r3", {"llama": 50}, [("llama", "batch-silver", 40)], age_s=16.0),
    ]
    (queued,) = fleet_view(states, NOW, 5.0, routers).base_models
    assert queued.routers == 2  # r3 is silent: its queues are not counted
    assert queued.queue_depth == 8 and queued.router_in_flight == 4
    assert queued.queued_by_band == {"batch-silver": 6, "interactive-gold": 2}
    idle = fleet_view(states, NOW, 5.0, [router("r1", {}, [])]).base_models[0]
    assert (idle.queue_depth, idle.queued_by_band) == (0, {})


def test_attack_names_and_bands_from_the_topics_reach_the_terminal_as_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ATTACK: forged states (the ``worker`` principal may write ``P.worker-state``, the
    ``router`` principal ``P.router-state``) name a lora name ``[/]`` on two workers and a
    queue band holding an ESC sequence and Rich markup. Before, ``fleet status`` ended in
    Rich's MarkupError traceback, and without the "[/]" a band's ESC reached the terminal
    as it was (an OSC 8 link, a cleared screen) and its markup was rendered; now both are
    printed as text, the controls escaped."""
    from typer.testing import CliRunner

    from loraplane.cli import app
    from loraplane.kernel import kafka, worker_states

    band = "\x1b]8;;https://evil.example/\x1b\\[bold]docs[/bold]"

    def forged(wid: str) -> WorkerState:
        genuine = state(wid, "llama", ["x@1", "a@1"])
        named = genuine.adapters[0].model_copy(update={"lora_name": "[/]"})
        return genuine.model_copy(update={"adapters": [named, *genuine.adapters[1:]]})

    latest = worker_states.FleetStates(
        workers={w: forged(w) for w in ("w0", "w1")},
        routers={"r0": router("r0", {"llama": 1}, [("llama", band, 2)])},
    )
    monkeypatch.setattr(worker_states, "latest_fleet_states", lambda *a, **k: latest)
    monkeypatch.setattr(kafka, "_acting_as", kafka.acting_as())  # it acts as reader: restored
    monkeypatch.setattr("time.time", lambda: NOW)
    result = CliRunner().invoke(app, ["fleet", "status"])
    assert result.exit_code == 0, result.output
    assert "replicated: {'[/]': 2, 'a@1': 2}" in result.output
    assert "\x1b" not in result.output
    assert "\\x1b]8;;https://evil.example/\\x1b\\[bold]docs[/bold] 2" in result.output


def test_a_worker_whose_state_says_not_run_shows_why_in_its_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A live worker whose gateway refuses every request as not run takes no traffic: its
    row (``/api/fleet``, ``fleet status``) says so, others say nothing."""
    down = state("w0", "llama", ["a@1"]).model_copy(
        update={"not_run": VllmFailure.vllm_wrong_base_model}
    )
    view = fleet_view([down, state("w1", "llama", ["a@1"])], NOW, 5.0)
    assert [w.not_run for w in view.base_models[0].workers] == ["vllm_wrong_base_model", None]
    assert view.as_json()["base_models"][0]["workers"][0]["not_run"] == "vllm_wrong_base_model"
    assert "not run: vllm_wrong_base_model" in fleet_status(monkeypatch, down)


def fleet_status(monkeypatch: pytest.MonkeyPatch, *states: WorkerState) -> str:
    """What ``loraplane fleet status`` prints of ``states`` (no router) at ``NOW``."""
    from typer.testing import CliRunner

    from loraplane.cli import app
    from loraplane.kernel import kafka, worker_states

    latest = worker_states.FleetStates(workers={s.worker_id: s for s in states}, routers={})
    monkeypatch.setattr(worker_states, "latest_fleet_states", lambda *a, **k: latest)
    monkeypatch.setattr(kafka, "_acting_as", kafka.acting_as())
    monkeypatch.setattr("time.time", lambda: NOW)
    result = CliRunner(env={"COLUMNS": "300"}).invoke(app, ["fleet", "status"])
    assert result.exit_code == 0, result.output
    return result.output


def test_a_not_run_worker_counts_in_no_serving_total(monkeypatch: pytest.MonkeyPatch) -> None:
    """A live worker whose gateway refuses every request serves no copy and takes no load:
    its GPU copies are no replicas, its free slots are not free to the fleet, and it is not
    a serving worker (it counted in all three, as if it served)."""
    down = state("w0", "llama", ["a@1", "b@1"], slots=8).model_copy(
        update={"not_run": VllmFailure.vllm_timeout}
    )
    up = state("w1", "llama", ["a@1"], slots=4)
    (llama,) = fleet_view([down, up], NOW, 5.0).base_models
    assert llama.live_workers == 2 and llama.serving_workers == 1
    assert llama.replicas == {"a@1": 1}
    assert llama.gpu_slots_free == 3
    assert [w.gpu_slots_free for w in llama.workers] == [6, 3]  # each row says its own
    assert fleet_view([down], NOW, 5.0).as_json()["base_models"][0]["serving_workers"] == 0
    output = fleet_status(monkeypatch, down, up)
    assert "llama: 2 live, 1 serving, 3 free GPU slots" in output
    assert "GPU copies serving: 1 of 1 versions" in output
