"""The registry agent on the real broker, run by the real ``loraplane streams run``.

One Faust subprocess serves the whole module on its own topic prefix, so concurrent runs
never share topics, consumer groups or changelogs.
"""

from __future__ import annotations

import base64
import json
import subprocess
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest

from loraplane.kernel.command_partition import partition_of
from loraplane.kernel.config import Settings
from loraplane.registry.topic import load_registry
from loraplane.schemas.adapter import Priority
from loraplane.schemas.audit import AuditRecord
from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import decode, encode
from loraplane.schemas.dead_letter import DeadLetter
from loraplane.schemas.reasons import RegistryRejection as Reason
from tests.integration.registry_env import LORAPLANE, Env, running, wait_for
from tests.lifecycle_kit import record

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def env(stack: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with running(stack, tmp_path_factory.mktemp("registry")) as env:
        yield env


def test_release_flow_ends_with_the_right_active_version_and_a_full_audit(env: Env) -> None:
    aid = f"flow-{uuid.uuid4().hex[:8]}"
    now, kit = now_utc(), env.kit
    steps = [
        kit.event("ci", "publish", aid, "1.0", 1, now),
        kit.event("ci", "canary", aid, "1.0", 2, now, canary_percent=10.0),
        kit.event("ci", "promote", aid, "1.0", 3, now),
        kit.event("ci", "publish", aid, "2.0", 4, now),
        kit.event("ci", "promote", aid, "2.0", 5, now),
        kit.event("ci", "rollback", aid, "2.0", 6, now),
    ]
    env.send([(aid.encode(), e) for e in steps])
    final = env.view(aid, lambda v: v.last_event_id == steps[-1].event_id)
    assert final.active_version == "1.0"
    assert {r.version: str(r.status) for r in final.versions} == {"1.0": "active", "2.0": "retired"}
    audits = [decode(AuditRecord, raw) for raw in env.records("audit")]
    mine = [a for a in audits if a.adapter_id == aid]
    assert [(a.subject_event_id, a.decision) for a in mine] == [
        (e.event_id, "accepted") for e in steps
    ]


def test_each_hostile_event_is_dead_lettered_with_its_reason(env: Env) -> None:
    aid = f"hostile-{uuid.uuid4().hex[:8]}"
    now, kit, key = now_utc(), env.kit, aid.encode()
    publish = kit.event("ci", "publish", aid, "1", 1, now)
    env.send([(key, publish), (key, kit.event("ci", "promote", aid, "1", 2, now))])
    before = env.view(aid, lambda v: v.active_version == "1")

    def ev(key_name: str, action: str, version: str, **fields: object) -> bytes:
        return encode(kit.event(key_name, action, aid, version, 10, now, **fields))

    canary = json.loads(ev("ci", "canary", "1", canary_percent=5.0))
    extra = dict(canary, unexpected="field")
    forged = json.loads(ev("ci", "publish", "2"))
    forged["record"]["rank"] = 4
    hostile: dict[Reason, bytes] = {
        Reason.malformed: b"\x00{not json",
        Reason.invalid: json.dumps(extra).encode(),
        Reason.canary_percent_out_of_range: json.dumps(dict(canary, canary_percent=101)).encode(),
        Reason.bad_signature: json.dumps(forged).encode(),
        Reason.unknown_key: json.dumps(dict(canary, key_id="nobody")).encode(),
        Reason.key_revoked: ev("revoked", "retire", "1"),
        Reason.key_expired: ev("expired", "retire", "1"),
        Reason.action_out_of_scope: ev("ci", "revoke", "1"),
        Reason.tenant_out_of_scope: ev("ci", "retire", "1", tenant_id="beta"),
        Reason.event_expired: encode(
            kit.event("ci", "retire", aid, "1", 10, now - timedelta(hours=2))
        ),
        Reason.replayed_event_id: encode(publish),
        Reason.stale_seq: encode(kit.event("ci", "retire", aid, "1", 2, now)),
        Reason.version_not_newer: ev("ci", "publish", "0.9"),
        Reason.rollback_to_unknown: ev("ci", "rollback", "1", rollback_to="9"),
        Reason.unknown_version: ev("ci", "promote", "7"),
        Reason.tenant_mismatch: ev("beta", "retire", "1", tenant_id="beta"),
        # strict parsing and anti-lockout (each signed by a trusted key)
        Reason.seq_from_future: encode(kit.event("ci", "retire", aid, "1", 2**62, now)),
        Reason.artifact_outside_prefix: ev(
            "ci",
            "publish",
            "2",
            record=record(aid, "2").model_copy(
                update={
                    "artifact_uri": f"s3://loraplane-artifacts/beta/{aid}/"
                    f"2-{record(aid, '2').sha256[:8]}/"
                }
            ),
        ),
        Reason.priority_above_ceiling: ev(
            "beta",
            "publish",
            "2",
            tenant_id="beta",
            record=record(aid, "2", tenant="beta").model_copy(
                update={"priority": Priority.platinum}
            ),
        ),
    }
    duplicate = ev("ci", "retire", "1").replace(
        b'{"schema_version"', b'{"version":"9","schema_version"', 1
    )
    coerced = encode(kit.event("ci", "retire", aid, "1", 11, now)).replace(
        b'"seq":11,', b'"seq":"11",'
    )
    wrong_key = ev("ci", "retire", "1")
    env.send(
        [(key, raw) for raw in [*hostile.values(), duplicate, coerced]]
        + [(b"someone-else", wrong_key)]
    )
    # under its own key, on a partition its key does not hash to
    misplaced = encode(kit.event("ci", "retire", aid, "1", 12, now))
    producer = env.producer()
    producer.produce(
        env.topic("lifecycle"), key=key, value=misplaced, partition=(partition_of(aid, 3) + 1) % 3
    )
    assert producer.flush(20) == 0
    expected = {raw: str(reason) for reason, raw in hostile.items()}
    expected[wrong_key] = str(Reason.key_mismatch)
    expected[misplaced] = str(Reason.wrong_partition)
    expected[duplicate] = str(Reason.malformed)
    expected[coerced] = str(Reason.invalid)

    def dead_letters() -> dict[bytes, str] | None:
        found = {
            base64.b64decode(d.raw_b64): d.reason
            for d in (decode(DeadLetter, raw) for raw in env.records("dead-letters"))
        }
        return found if expected.keys() <= found.keys() else None

    found = wait_for(dead_letters, "every hostile event in the dead-letter topic")
    assert {raw: found[raw] for raw in expected} == expected
    assert load_registry(env.settings)[aid] == before


def test_cli_publish_uploads_signs_and_reaches_the_registry(env: Env) -> None:
    from loraplane.infra.s3 import S3
    from loraplane.schemas.signing import SigningKey
    from loraplane.tiny_model import build_adapter

    aid = f"cli-{uuid.uuid4().hex[:8]}"
    folder = build_adapter(env.home / aid, seed=3)
    key_file = env.home / f"{aid}.key"
    SigningKey.save(env.kit.keys["ci"], key_file)
    common = ["--adapter-id", aid, "--key", str(key_file)]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [LORAPLANE, *args], env=env.env, capture_output=True, text=True, timeout=60
        )

    done = cli(
        "publish",
        *common,
        "--tenant",
        "acme",
        "--base-model",
        "tiny-llama",
        "--version",
        "1.0",
        "--priority",
        "gold",
        "--artifact",
        str(folder),
        "--canary",
        "10",
    )
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout)
    bucket, _, prefix = line["artifact_uri"].removeprefix("s3://").partition("/")
    assert prefix == f"acme/{aid}/1.0-{line['sha256'][:8]}/"  # under the tenant's own prefix
    listed = S3(env.settings).client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    assert {o["Key"][len(prefix) :] for o in listed["Contents"]} == {
        "adapter_config.json",
        "adapter_model.safetensors",
        "manifest.json",
    }
    published = env.view(aid, lambda v: v.versions[0].status == "canary")
    assert published.versions[0].sha256 == line["sha256"]
    assert published.versions[0].lora_name == line["lora_name"]

    assert cli("promote", *common, "--version", "1.0").returncode == 0
    assert env.view(aid, lambda v: v.active_version == "1.0").last_seq > line["seq"]

    (folder / "extra.bin").write_bytes(b"\x80\x04pickle")
    refused = cli(
        "publish",
        *common,
        "--tenant",
        "acme",
        "--base-model",
        "tiny-llama",
        "--version",
        "2.0",
        "--artifact",
        str(folder),
    )
    assert refused.returncode == 3 and "pickle" in refused.stderr  # artifact_refused
