"""The stack's S3 endpoint (s3proxy, infra/s3.py) keeps artifacts on disk (issue #19, item 5):
an object published survives a stop, and a SIGKILL, of the endpoint and a worker's fetcher
still fetches and verifies it. Only the stack's key is accepted. ``publish --reupload`` puts
a registered version's lost bytes back, and only bytes whose digest is the signed one.

Each test runs a throwaway s3proxy of its own (tests/integration/s3_env.py: tmp home, free
port), never the shared one; the re-upload tests also use the shared stack's Kafka, under a
topic prefix of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from botocore.exceptions import ClientError
from pydantic import SecretStr

from loraplane.artifact.model_shape import ModelShape
from loraplane.artifact.refusal import ArtifactError
from loraplane.artifact.verification import MANIFEST_NAME, WorkerLimits
from loraplane.artifact_publish import PublishRequest, build_record, upload
from loraplane.kernel import kafka, topics
from loraplane.kernel.bus import produce_sync
from loraplane.kernel.config import Settings
from loraplane.kernel.topics import topic_name
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus, Priority
from loraplane.schemas.base import now_utc
from loraplane.schemas.keyring import save_keyring
from loraplane.schemas.reasons import ArtifactReason as Reason
from loraplane.tiny_model import TINY_BASE_MODEL, TinyLlama, build_adapter
from loraplane.workers.artifact_fetch import ArtifactFetcher, FetchPolicy, parse_s3_uri, s3_client
from loraplane.workers.host_tier import HostTier
from tests.integration.fault_report import report_fault
from tests.integration.s3_env import PrivateS3
from tests.lifecycle_kit import make_kit, signed_view

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
LIMITS = WorkerLimits(
    base_model=TINY_BASE_MODEL,
    max_lora_rank=8,
    model=ModelShape.from_hf_config(TinyLlama().hf_config(1000)),
)
FAST = FetchPolicy(
    connect_timeout_s=0.5, read_timeout_s=1.0, attempts=2, backoff_s=0.05, deadline_s=10.0
)
LORAPLANE = str(Path(sys.executable).with_name("loraplane"))


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[PrivateS3]:
    server = PrivateS3(tmp_path / "home")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _settings(s3: PrivateS3) -> Settings:
    return Settings().model_copy(update={"s3": s3.settings})


def _publish(settings: Settings, folder: Path, adapter: str, tenant: str = "acme") -> AdapterRecord:
    record, manifest = build_record(
        folder,
        PublishRequest(adapter, tenant, TINY_BASE_MODEL, "1", Priority.silver),
        settings.s3.bucket,
    )
    upload(settings, folder, record, manifest)
    return record


def _worker_fetch(s3: PrivateS3, record: AdapterRecord, root: Path) -> Path:
    """What a worker does on a cold load: the host tier fetches through S3 and verifies."""
    tier = HostTier(
        root, budget_bytes=10**9, limits=LIMITS, fetcher=ArtifactFetcher(s3.settings, FAST)
    )
    return tier.ensure(record)


def test_an_artifact_survives_a_restart_and_a_kill(s3: PrivateS3, tmp_path: Path) -> None:
    settings = _settings(s3)
    record = _publish(settings, build_adapter(tmp_path / "src", seed=3), "durable")
    bucket, prefix = parse_s3_uri(record.artifact_uri)
    assert (s3.data / bucket / prefix / MANIFEST_NAME).is_file()  # on disk, not in memory
    s3.stop()
    with pytest.raises(ArtifactError) as down:
        _worker_fetch(s3, record, tmp_path / "host-down")
    assert down.value.reasons == (Reason.artifact_store_unavailable,)
    s3.start()
    folder = _worker_fetch(s3, record, tmp_path / "host-1")
    assert (folder / "adapter_model.safetensors").is_file()
    s3.kill()  # no shutdown hook: what was acknowledged is already on disk
    s3.start()
    folder = _worker_fetch(s3, record, tmp_path / "host-2")
    assert json.loads((folder / MANIFEST_NAME).read_text())["files"]
    assert s3.service.data_dirs() == [s3.data.parent]  # what `stack down --purge` deletes
    report_fault(
        "S3 (s3proxy) stopped, then SIGKILLed",
        answered=1,
        stored=1,
        lost=0,
        duplicated=0,
        recovered=True,
        note="while down: artifact_store_unavailable (retriable); the artifact "
        "fetched and verified after each restart",
    )


def test_only_the_stacks_key_is_accepted(s3: PrivateS3) -> None:
    """ATTACK: unsigned, wrongly signed, other-key and tampered pre-signed requests are all
    refused (403), reads and writes alike; the secret is on no command line."""
    settings = _settings(s3)
    bucket, endpoint = settings.s3.bucket, settings.s3.endpoint_url
    good = s3_client(settings.s3)
    good.put_object(Bucket=bucket, Key="secret/object", Body=b"weights")
    for bad in (
        settings.s3.model_copy(update={"secret_access_key": SecretStr("wrong")}),
        settings.s3.model_copy(update={"access_key_id": "someone-else"}),
    ):
        # a client per request: s3proxy may close a connection after refusing a PUT whose body
        # it did not read, and a client without retries (ours) that reuses it then sees the
        # close (ConnectionClosedError, seen in a CI run), not the answer this test is about
        for call in (
            lambda c: c.get_object(Bucket=bucket, Key="secret/object"),
            lambda c: c.put_object(Bucket=bucket, Key="secret/x", Body=b"x"),
            lambda c: c.list_objects_v2(Bucket=bucket),
        ):
            with pytest.raises(ClientError) as refused:
                call(s3_client(bad))
            assert refused.value.response["Error"]["Code"] in (
                "SignatureDoesNotMatch",
                "InvalidAccessKeyId",
                "AccessDenied",
            ), refused.value
    signed = good.generate_presigned_url(
        "get_object", Params={"Bucket": bucket, "Key": "secret/object"}
    )
    with urllib.request.urlopen(signed, timeout=5) as resp:  # a valid signature works
        assert resp.read() == b"weights"
    tampered = signed.replace("secret/object", "secret/x")
    anonymous = [
        urllib.request.Request(f"{endpoint}/{bucket}/secret/object"),
        urllib.request.Request(f"{endpoint}/{bucket}?list-type=2"),
        urllib.request.Request(f"{endpoint}/{bucket}/secret/y", data=b"y", method="PUT"),
        urllib.request.Request(
            f"{endpoint}/{bucket}/secret/object", headers={"Authorization": "AWS loraplane:bogus"}
        ),
        urllib.request.Request(tampered),
    ]
    for req in anonymous:
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(req, timeout=5)
        assert denied.value.code == 403, req.full_url
    assert [o["Key"] for o in good.list_objects_v2(Bucket=bucket)["Contents"]] == ["secret/object"]
    pid = s3.service.process.pid()
    assert pid is not None
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert settings.s3.secret().encode() not in cmdline
    assert s3.service.properties_file.stat().st_mode & 0o077 == 0


@pytest.fixture
def registered(
    stack: Settings, s3: PrivateS3, tmp_path: Path
) -> Iterator[tuple[Settings, AdapterRecord, Path, dict[str, str]]]:
    """One version published to our S3 and in a signed registry view on a topic prefix of
    our own; the env a `loraplane` child needs to see both."""
    kit = make_kit(now_utc())
    prefix = f"lp-reup-{uuid.uuid4().hex[:8]}"
    settings = stack.model_copy(update={"topic_prefix": prefix, "s3": s3.settings})
    topics.apply(settings, only=(topics.spec("registry"),))
    folder = build_adapter(tmp_path / "src", seed=5)
    record = _publish(settings, folder, "reup").model_copy(update={"status": AdapterStatus.active})
    produce_sync(
        settings,
        topic_name(settings, "registry"),
        "reup",
        signed_view(kit.keys["ops"], [record], now_utc(), kit.keyring),
    )
    keyring = tmp_path / "keyring.yaml"
    save_keyring(kit.keyring, keyring)
    env = {
        **os.environ,
        "LORAPLANE_TOPIC_PREFIX": prefix,
        "LORAPLANE_KEYRING_PATH": str(keyring),
        "LORAPLANE_S3__ENDPOINT_URL": s3.settings.endpoint_url,
        "LORAPLANE_S3__PORT": str(s3.port),
        "LORAPLANE_S3__CREDENTIALS_FILE": str(s3.settings.credentials_file),
    }
    try:
        yield settings, record, folder, env
    finally:
        kafka.admin(settings).delete_topics([topic_name(settings, "registry")])


def _reupload(
    env: dict[str, str], folder: Path, version: str = "1"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            LORAPLANE,
            "publish",
            "--reupload",
            "--adapter-id",
            "reup",
            "--version",
            version,
            "--artifact",
            str(folder),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_reupload_puts_a_lost_version_back(
    registered: tuple[Settings, AdapterRecord, Path, dict[str, str]], s3: PrivateS3, tmp_path: Path
) -> None:
    settings, record, folder, env = registered
    bucket, prefix = parse_s3_uri(record.artifact_uri)
    client = s3_client(settings.s3)
    for obj in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]:
        client.delete_object(Bucket=bucket, Key=obj["Key"])  # the store lost the version
    with pytest.raises(ArtifactError) as gone:
        _worker_fetch(s3, record, tmp_path / "host-gone")
    assert gone.value.reasons == (Reason.manifest_missing,)  # a refusal, not a retry
    done = _reupload(env, folder)
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert (line["reuploaded"], line["sha256"]) == (True, record.sha256)
    assert _worker_fetch(s3, record, tmp_path / "host-back").is_dir()
    # no lifecycle event: the registry already holds the version (nothing on `lifecycle`)
    lifecycle = topic_name(settings, "lifecycle")
    assert lifecycle not in kafka.admin(settings).list_topics(timeout=10).topics


def test_reupload_refuses_other_bytes_and_unknown_versions(
    registered: tuple[Settings, AdapterRecord, Path, dict[str, str]], tmp_path: Path
) -> None:
    settings, record, _, env = registered
    bucket, prefix = parse_s3_uri(record.artifact_uri)
    client = s3_client(settings.s3)
    before = {
        o["Key"]: o["ETag"]
        for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
    }
    other = build_adapter(tmp_path / "other", seed=6)  # same shape, other weights
    refused = _reupload(env, other)
    assert refused.returncode == 1
    assert "not the registered (signed) digest" in refused.stderr, refused.stderr
    assert record.sha256 in refused.stderr
    after = {
        o["Key"]: o["ETag"]
        for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
    }
    assert after == before  # nothing written
    unknown = _reupload(env, other, version="9")
    assert unknown.returncode == 1 and "no version 9" in unknown.stderr, unknown.stderr
