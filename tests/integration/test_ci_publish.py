"""The CI publishing example end to end on the local stack: examples/ci/publish-adapter.sh
for a release tag, with the real ``loraplane publish --json --wait-s``, real s3proxy, real
Kafka and the registry agent run by ``loraplane streams run`` on its own topic prefix.

A tag publishes (with a canary) and the registry shows the version; a key whose signature
does not verify, a tampered artifact and an unreachable broker each give their documented
exit code and JSON result (docs/lifecycle.md, "Publishing from CI")."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from loraplane.infra.s3 import S3
from loraplane.kernel.config import Settings
from loraplane.schemas.publish_result import PublishResult
from loraplane.schemas.registry import views_from_json
from loraplane.schemas.signing import SigningKey
from loraplane.tiny_model import build_adapter
from tests.integration.registry_env import LORAPLANE, Env, running

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "ci" / "publish-adapter.sh"


@pytest.fixture(scope="module")
def env(stack: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with running(stack, tmp_path_factory.mktemp("ci-publish")) as env:
        yield env


def key_file(env: Env, key: SigningKey, name: str) -> Path:
    path = env.home / f"{name}-{uuid.uuid4().hex[:6]}.key"
    key.save(path)
    return path


def publish_tag(
    env: Env, tag: str, adapters: Path, key: Path, **extra: str
) -> tuple[subprocess.CompletedProcess[str], PublishResult | None]:
    """The script as the workflow runs it; (the process, its result when it printed one)."""
    done = subprocess.run(
        ["bash", str(SCRIPT), tag],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **env.env,
            "PUBLISH_CLI": LORAPLANE,
            "PUBLISH_TENANT": "acme",
            "PUBLISH_BASE_MODEL": "tiny-llama",
            "PUBLISH_KEY_FILE": str(key),
            "PUBLISH_ADAPTERS_DIR": str(adapters),
            "PUBLISH_WAIT_S": "120",
            **extra,
        },
    )
    lines = done.stdout.splitlines()
    assert len(lines) <= 1, done.stdout  # one JSON object, nothing else
    return done, PublishResult.model_validate_json(lines[0]) if lines else None


def registry_show(env: Env, adapter_id: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LORAPLANE, "registry", "show", adapter_id, "--json"],
        env=env.env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_release_tag_publishes_and_the_registry_shows_it(env: Env, tmp_path: Path) -> None:
    aid = f"ci-{uuid.uuid4().hex[:8]}"
    adapters = tmp_path / "adapters"
    build_adapter(adapters / aid, seed=4)
    outputs = tmp_path / "github-output"
    done, result = publish_tag(
        env,
        f"refs/tags/adapter/{aid}/v1.2.0",
        adapters,
        key_file(env, env.kit.keys["ci"], "ci"),
        PUBLISH_CANARY_PERCENT="10",
        GITHUB_OUTPUT=str(outputs),
        GITHUB_SHA="0123456789abcdef",
    )
    assert done.returncode == 0, done.stderr
    assert result is not None and result.ok and result.outcome == "published"
    assert [(e.action, e.event_id) for e in result.events] == [
        ("publish", result.event_id),
        ("canary", result.canary_event_id),
    ]
    assert [(d.event_id, d.decision) for d in result.registry or []] == [
        (result.event_id, "accepted"),
        (result.canary_event_id, "accepted"),
    ]
    assert f"publish-adapter: {aid} 1.2.0 published as {result.lora_name}" in done.stderr
    assert f"lora_name={result.lora_name}\n" in outputs.read_text()

    shown = registry_show(env, aid)  # what a later CI step or an operator reads
    assert shown.returncode == 0, shown.stderr
    view = views_from_json(shown.stdout.encode())[aid]
    version = view.version("1.2.0")
    assert (version.status, version.release.canary_percent) == ("canary", 10.0)
    assert (version.sha256, version.artifact_uri) == (result.sha256, result.artifact_uri)
    assert view.last_event_id == result.canary_event_id
    bucket, _, prefix = (result.artifact_uri or "").removeprefix("s3://").partition("/")
    listed = S3(env.settings).client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    assert {o["Key"][len(prefix) :] for o in listed["Contents"]} == {
        "adapter_config.json",
        "adapter_model.safetensors",
        "manifest.json",
    }


def test_a_key_whose_signature_does_not_verify_is_rejected_by_the_registry(
    env: Env, tmp_path: Path
) -> None:
    """The CI secret names the trusted key id but holds other key bytes: the broker takes
    the event, the registry refuses it (bad_signature), and the job says so: exit 4."""
    aid = f"ci-bad-{uuid.uuid4().hex[:8]}"
    adapters = tmp_path / "adapters"
    build_adapter(adapters / aid, seed=5)
    trusted = env.kit.keys["ci"]
    forged = SigningKey(trusted.publisher, trusted.key_id, Ed25519PrivateKey.generate())
    done, result = publish_tag(env, f"adapter/{aid}/v1", adapters, key_file(env, forged, "forged"))
    assert done.returncode == 4, done.stderr
    assert result is not None and result.outcome == "registry_rejected"
    assert result.error is not None and result.error.code == "registry_rejected"
    assert [(d.event_id, d.decision, d.reason) for d in result.registry or []] == [
        (result.event_id, "rejected", "bad_signature")
    ]
    assert (
        f"not published (registry_rejected, exit 4): the registry rejected publish "
        f"event {result.event_id}: bad_signature (signature does not verify" in done.stderr
    )
    assert registry_show(env, aid).returncode == 1  # never entered the registry


def test_a_tampered_artifact_is_refused_before_anything_is_sent(env: Env, tmp_path: Path) -> None:
    aid = f"ci-pickle-{uuid.uuid4().hex[:8]}"
    adapters = tmp_path / "adapters"
    folder = build_adapter(adapters / aid, seed=6)
    (folder / "optimizer.pt").write_bytes(b"\x80\x04\x95pickled optimizer state")
    done, result = publish_tag(
        env, f"adapter/{aid}/v1", adapters, key_file(env, env.kit.keys["ci"], "ci")
    )
    assert done.returncode == 3, done.stderr
    assert result is not None and result.outcome == "artifact_refused"
    assert result.error is not None
    assert [(r.reason, r.path) for r in result.error.refusals] == [
        ("pickle_weights", "optimizer.pt")
    ]
    assert (result.events, result.event_id, result.registry) == ([], None, None)
    shutil.rmtree(folder)


def test_an_unreachable_broker_is_unavailable_and_sends_nothing(env: Env, tmp_path: Path) -> None:
    """Kafka away before the first event: exit 5, re-running the same tag is safe."""
    aid = f"ci-down-{uuid.uuid4().hex[:8]}"
    adapters = tmp_path / "adapters"
    build_adapter(adapters / aid, seed=7)
    done, result = publish_tag(
        env,
        f"adapter/{aid}/v1",
        adapters,
        key_file(env, env.kit.keys["ci"], "ci"),
        LORAPLANE_KAFKA__PORT=str(closed_port()),
    )
    assert done.returncode == 5, done.stderr
    assert result is not None and result.outcome == "unavailable"
    assert result.error is not None and result.error.code == "bus_unavailable"
    assert result.events == []


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
