"""The registry table survives a restart of the Faust worker (changelog recovery)."""

from __future__ import annotations

import base64
import uuid
from pathlib import Path

import pytest

from loraplane.kernel.config import Settings
from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import decode, encode
from loraplane.schemas.dead_letter import DeadLetter
from tests.integration.registry_env import Env, wait_for

pytestmark = pytest.mark.integration


def test_state_and_replay_set_survive_a_restart(stack: Settings, tmp_path: Path) -> None:
    env = Env.create(stack, tmp_path)
    aid, now = f"restart-{uuid.uuid4().hex[:8]}", now_utc()
    publish = env.kit.event("ci", "publish", aid, "1", 1, now)
    try:
        env.start()
        env.send([(aid.encode(), publish)])
        env.view(aid, lambda v: v.last_event_id == publish.event_id)
        env.stop()
        env.start()
        # both depend on the recovered table: the seen publish and the known version 1
        env.send(
            [
                (aid.encode(), publish),
                (aid.encode(), env.kit.event("ci", "promote", aid, "1", 2, now)),
            ]
        )
        assert env.view(aid, lambda v: v.active_version == "1").last_seq == 2
        replay = wait_for(
            lambda: next(
                (
                    d
                    for d in (decode(DeadLetter, r) for r in env.records("dead-letters"))
                    if base64.b64decode(d.raw_b64) == encode(publish)
                ),
                None,
            ),
            "the replay's DLQ",
        )
        assert replay.reason == "replayed_event_id"
    finally:
        env.stop()
        env.delete_topics()
