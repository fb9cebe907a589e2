"""The whole streams app (registry, scoring, planner) on its own topic prefix, with helpers to
publish adapters, send request logs and fake worker heartbeats, and read cache commands.
Shared by the planner's integration tests and bench/planner_burst_latency.py."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from pathlib import Path

from loraplane.kernel.config import Settings
from loraplane.registry.topic import load_registry
from loraplane.schemas.adapter import AdapterRecord, Priority
from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import decode, encode
from loraplane.schemas.commands import CacheCommand
from loraplane.schemas.request_log import RequestLog, Tier
from loraplane.schemas.worker_state import LoadedAdapter, WorkerState
from tests.integration.registry_env import Env, wait_for
from tests.lifecycle_kit import TENANT, record

ALL_AGENTS: tuple[str, ...] = ()


class PlannerEnv(Env):
    seq: int = 0

    @classmethod
    def create(cls, stack: Settings, home: Path, **policy: object) -> PlannerEnv:
        env = super().create(stack, home)
        env.env["LORAPLANE_SCHEDULES_PATH"] = str(home / "schedules.yaml")
        # one heartbeat stands for a worker for the whole test: the planner must not leave
        # it out as silent (the planner's liveness rule is test_router_fleet's subject)
        policy.setdefault("worker_heartbeat_s", 3600)
        for name, value in policy.items():
            env.env[f"LORAPLANE_POLICY__{name.upper()}"] = str(value)
        return env  # type: ignore[return-value]

    def start(self, agents: tuple[str, ...] = ALL_AGENTS) -> None:
        super().start(agents)

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def publish(
        self,
        adapter_id: str,
        base: str,
        version: str = "1",
        active: bool = True,
        priority: Priority = Priority.silver,
        canary: float | None = None,
    ) -> AdapterRecord:
        """Signed publish (+ promote or canary) events; returns the record as published."""
        now = now_utc()
        rec = record(adapter_id, version, base=base).model_copy(update={"priority": priority})
        events = [
            self.kit.event(
                "ci",
                "publish",
                adapter_id,
                version,
                self._next_seq(),
                now,
                base_model=base,
                record=rec,
            )
        ]
        if canary is not None:
            events.append(
                self.kit.event(
                    "ci",
                    "canary",
                    adapter_id,
                    version,
                    self._next_seq(),
                    now,
                    base_model=base,
                    canary_percent=canary,
                )
            )
        elif active:
            events.append(
                self.kit.event(
                    "ci", "promote", adapter_id, version, self._next_seq(), now, base_model=base
                )
            )
        self.send([(adapter_id.encode(), e) for e in events])
        return rec

    def wait_registered(self, *expected: tuple[AdapterRecord, str]) -> None:
        """Wait until the registry shows every ``(record, status)``: one read per poll."""

        def probe() -> bool | None:
            views = load_registry(self.settings, timeout_s=5)
            return (
                True
                if all(
                    (v := views.get(r.adapter_id)) is not None
                    and (got := v.version(r.version)) is not None
                    and got.status.value == status
                    for r, status in expected
                )
                else None
            )

        wait_for(probe, f"{len(expected)} registry entries")

    def requests(
        self, rec: AdapterRecord, n: int, ts: datetime | None = None, tier: Tier = Tier.cold
    ) -> None:
        ts = ts or now_utc()
        p = self.producer()
        for i in range(n):
            log = RequestLog(
                event_id=f"r-{uuid.uuid4().hex}",
                ts=ts + timedelta(milliseconds=i),
                request_id=uuid.uuid4().hex,
                tenant_id=TENANT,
                base_model=rec.base_model,
                adapter_id=rec.adapter_id,
                adapter_version=rec.version,
                worker_id="gw",
                tier_at_arrival=tier,
                ttft_ms=900.0,
            )
            p.produce(self.topic("requests"), key=rec.adapter_id.encode(), value=encode(log))
        assert p.flush(20) == 0

    def heartbeat(
        self,
        worker_id: str,
        base: str,
        gpu: list[AdapterRecord] = (),
        slots: int = 8,
        pinned: frozenset[str] = frozenset(),
        hbm: float = 0.5,
    ) -> None:
        state = WorkerState(
            worker_id=worker_id,
            base_model=base,
            ts=now_utc(),
            gpu_slots_used=len(gpu),
            gpu_slots_total=slots,
            host_bytes_used=0,
            host_bytes_budget=10**12,
            hbm_usage=hbm,
            max_lora_rank=64,
            adapters=[
                LoadedAdapter(
                    lora_name=r.lora_name,
                    adapter_id=r.adapter_id,
                    version=r.version,
                    tenant_id=r.tenant_id,
                    tier="gpu",
                    pinned=r.lora_name in pinned,
                    size_bytes=r.size_bytes,
                )
                for r in gpu
            ],
        )
        p = self.producer()
        p.produce(self.topic("worker-state"), key=worker_id.encode(), value=encode(state))
        assert p.flush(20) == 0

    def commands(self, base: str | None = None) -> list[CacheCommand]:
        cmds = [decode(CacheCommand, raw) for raw in self.records("commands")]
        return [c for c in cmds if base is None or c.base_model == base]

    def wait_commands(
        self, base: str, done, what: str, timeout_s: float = 60
    ) -> list[CacheCommand]:
        def probe() -> list[CacheCommand] | None:
            cmds = self.commands(base)
            return cmds if done(cmds) else None

        return wait_for(probe, what, timeout_s)
