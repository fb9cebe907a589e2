"""The signed form as docs/lifecycle.md specifies it ("The signed form"): checked-in test
vectors (tests/data/lifecycle_vectors/vectors.json) that our signer and verifier reproduce
byte for byte, and an independent signer in JavaScript (examples/sign_event.mjs) whose
events our registry accepts. Regenerate the vectors with
``python tests/unit/test_signed_form.py`` (only when the signed form changes on purpose:
then the domain tag's version changes too)."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from loraplane.registry.fold import Accepted, evaluate
from loraplane.schemas.adapter import AdapterRecord, Compatibility, expected_artifact_prefix
from loraplane.schemas.codec import decode_signed, encode
from loraplane.schemas.keyring import KeyEntry, Keyring, Scopes
from loraplane.schemas.lifecycle import LifecycleAction, LifecycleEvent
from loraplane.schemas.signing import SigningKey, b64, public_key, verify

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "tests/data/lifecycle_vectors/vectors.json"
SIGNER = ROOT / "examples/sign_event.mjs"
SEED = bytes(range(32))
NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
KEY = SigningKey("ci-acme", "ci-acme-vectors", Ed25519PrivateKey.from_private_bytes(SEED))
SHA = "c21ebf18" + "0" * 56
DEFAULTS: dict[str, Any] = {
    "schema_version": 1,
    "record": None,
    "canary_percent": None,
    "rollback_to": None,
    "reason": "",
}


def _events() -> list[tuple[str, LifecycleEvent]]:
    rec = AdapterRecord(
        adapter_id="support-bot",
        base_model="tiny-llama",
        version="1.2",
        rank=8,
        artifact_uri=expected_artifact_prefix(
            "loraplane-artifacts", "acme", "support-bot", "1.2", SHA
        ),
        sha256=SHA,
        size_bytes=34359,
        tenant_id="acme",
        compatibility=Compatibility(target_modules=["q_proj", "v_proj"], max_lora_rank=8),
    )
    common = dict(
        publisher=KEY.publisher,
        key_id=KEY.key_id,
        tenant_id="acme",
        adapter_id="support-bot",
        base_model="tiny-llama",
        version="1.2",
    )
    t0, t1 = NOW, NOW + timedelta(minutes=1, microseconds=250000)
    specs: list[tuple[str, dict[str, Any]]] = [
        (
            "publish",
            dict(
                action="publish",
                record=rec,
                seq=1780315200000000,
                reason='first release: ünïcode "quotes" \\ and a\ttab',
            ),
        ),
        ("canary-whole-percent", dict(action="canary", canary_percent=10.0, seq=1780315200000001)),
        ("canary-fraction", dict(action="canary", canary_percent=12.5, seq=1780315200000002)),
        ("canary-tiny", dict(action="canary", canary_percent=0.00005, seq=1780315200000003)),
        (
            "rollback-microseconds",
            dict(action="rollback", rollback_to="1", seq=1780315260250000, issued=t1),
        ),
    ]
    out = []
    for name, spec in specs:
        issued = spec.pop("issued", t0)
        event = LifecycleEvent(
            event_id=f"{name}-0001",
            issued_at=issued,
            expires_at=issued + timedelta(hours=1),
            **common,
            **spec,
        )
        out.append((name, KEY.sign(event)))
    return out


def build_vectors() -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "private_key_seed_b64": b64(SEED),
            "public_key_b64": KEY.public_key_b64,
            "event": json.loads(encode(event)),
            "signed_bytes": event.signed_bytes().decode("utf-8"),
            "signature": event.signature,
        }
        for name, event in _events()
    ]


def load_vectors() -> list[dict[str, Any]]:
    return json.loads(VECTORS.read_text())


def test_vectors_are_what_the_code_signs() -> None:
    assert load_vectors() == build_vectors(), "run python tests/unit/test_signed_form.py"


@pytest.mark.parametrize("vector", load_vectors(), ids=lambda v: v["name"])
def test_vector_verifies_and_reproduces(vector: dict[str, Any]) -> None:
    raw = json.dumps(vector["event"]).encode()
    event = decode_signed(LifecycleEvent, raw)
    assert event.signed_bytes() == vector["signed_bytes"].encode("utf-8")
    assert verify(event, public_key(vector["public_key_b64"]))
    seed = base64.b64decode(vector["private_key_seed_b64"])
    key = SigningKey(event.publisher, event.key_id, Ed25519PrivateKey.from_private_bytes(seed))
    assert key.sign(event).signature == vector["signature"]  # Ed25519 is deterministic


def _sparse(event: dict[str, Any]) -> dict[str, Any]:
    """The event as a hand-written signer would send it: defaults left out."""
    e = {k: v for k, v in event.items() if k != "signature" and DEFAULTS.get(k, ...) != v}
    if e.get("record"):
        r = dict(e["record"])
        for k, v in {
            "schema_version": 1,
            "format": "peft",
            "status": "published",
            "priority": "silver",
            "release": {"canary_percent": 0.0, "rollback_to": None},
        }.items():
            if r.get(k) == v:
                del r[k]
        e["record"] = r
    return e


def _node(script: str, stdin: str) -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the JavaScript signer is not checked")
    return subprocess.run(
        [node, "--input-type=module", "-e", script],
        input=stdin,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout


@pytest.mark.parametrize("vector", load_vectors(), ids=lambda v: v["name"])
def test_javascript_signer_matches_and_is_accepted(vector: dict[str, Any]) -> None:
    script = (
        f"import {{ signEvent }} from {json.dumps(SIGNER.as_uri())};\n"
        "import { readFileSync } from 'node:fs';\n"
        "const e = JSON.parse(readFileSync(0, 'utf8'));\n"
        f"process.stdout.write(JSON.stringify(signEvent(e, "
        f"{json.dumps(vector['private_key_seed_b64'])}, 'ci-acme', 'ci-acme-vectors')));"
    )
    out = _node(script, json.dumps(_sparse(vector["event"])))
    assert json.loads(out)["signature"] == vector["signature"]
    event = decode_signed(LifecycleEvent, out.encode())
    entry = KeyEntry(
        key_id=KEY.key_id,
        publisher=KEY.publisher,
        public_key=vector["public_key_b64"],
        not_before=NOW - timedelta(days=1),
        not_after=NOW + timedelta(days=30),
        scopes=Scopes(tenants=["acme"], actions="*"),
    )
    if event.action is LifecycleAction.publish:
        decision = evaluate(
            out.encode(), Keyring(keys=[entry]), lambda _: None, NOW + timedelta(seconds=1)
        )
        assert isinstance(decision, Accepted), decision


def test_javascript_float_writer_matches_python() -> None:
    values = [
        0.0,
        -0.0,
        10.0,
        100.0,
        12.5,
        0.1,
        0.30000000000000004,
        33.333333333333336,
        1e-4,
        9.99e-5,
        5e-05,
        1.5e-07,
        99.99999999999999,
        1e16,
        1.2345e20,
        123456.789,
    ]
    script = (
        f"import {{ pyFloat }} from {json.dumps(SIGNER.as_uri())};\n"
        f"process.stdout.write(JSON.stringify({json.dumps(values)}.map(pyFloat)));"
    )
    assert json.loads(_node(script, "")) == [json.dumps(v) for v in values]


if __name__ == "__main__":
    VECTORS.parent.mkdir(parents=True, exist_ok=True)
    VECTORS.write_text(json.dumps(build_vectors(), indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {VECTORS}", file=sys.stderr)
