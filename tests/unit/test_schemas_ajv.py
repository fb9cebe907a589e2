"""The exported JSON Schemas validate real topic messages in a non-Python validator: ajv.

Producers in other languages validate against ``schemas/json/`` (``loraplane schemas
export``); this proves those files mean what pydantic means. Messages are the models the
product sends, encoded by ``schemas.codec.encode`` (signed where the product signs), checked
by ajv's draft 2020-12 validator with ajv-formats; invalid ones must be rejected by ajv as
they are by pydantic. ajv lives in ``.venv-node`` (scripts/setup.d/50-ajv.sh).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from loraplane.schemas import export
from loraplane.schemas.adapter import AdapterStatus
from loraplane.schemas.audit import AuditRecord
from loraplane.schemas.cache_event import CacheEvent, CacheEventKind
from loraplane.schemas.codec import encode
from loraplane.schemas.commands import CacheCommand, CommandAction, CommandReason
from loraplane.schemas.dead_letter import dead_letter_at
from loraplane.schemas.reasons import ArtifactReason, CommandRule, DecodeReason
from loraplane.schemas.request_log import RequestLog
from loraplane.schemas.worker_state import LoadedAdapter, WorkerState
from tests.lifecycle_kit import BASE, TENANT, make_kit, record, signed_view

ROOT = Path(__file__).resolve().parents[2]
NODE_MODULES = ROOT / ".venv-node" / "node_modules"

# Reads {"schemas": {name: schema}, "cases": [[name, message], ...]} on stdin; prints one
# [valid, errors] per case. Strict mode stays on: a keyword ajv does not know is an error.
VALIDATE_JS = """
const Ajv2020 = require("ajv/dist/2020").default;
const addFormats = require("ajv-formats").default;
const input = JSON.parse(require("fs").readFileSync(0, "utf8"));
const ajv = new Ajv2020({allErrors: true});
addFormats(ajv);
const validators = {};
for (const [name, schema] of Object.entries(input.schemas)) {
  validators[name] = ajv.compile(schema);
}
const out = input.cases.map(([name, message]) => {
  const validate = validators[name];
  return [validate(message), validate.errors || []];
});
process.stdout.write(JSON.stringify({version: require("ajv/package.json").version, out}));
"""


def node() -> str:
    found = shutil.which("node")
    if found is None:
        pytest.skip(
            "node is not installed: the ajv check needs Node.js "
            "(scripts/setup.d/50-ajv.sh installs it and ajv)"
        )
    assert (NODE_MODULES / "ajv").is_dir() and (NODE_MODULES / "ajv-formats").is_dir(), (
        "ajv is missing: run scripts/setup.d/50-ajv.sh"
    )
    return found


def ajv(schema_dir: Path, cases: list[tuple[str, Any]]) -> list[tuple[bool, list[Any]]]:
    schemas = {
        p.name.removesuffix(".schema.json"): json.loads(p.read_text())
        for p in sorted(schema_dir.glob("*.schema.json"))
    }
    proc = subprocess.run(
        [node(), "-e", VALIDATE_JS],
        cwd=NODE_MODULES.parent,
        input=json.dumps({"schemas": schemas, "cases": cases}),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    print(f"ajv {result['version']} (draft 2020-12), {len(cases)} messages")
    return [(valid, errors) for valid, errors in result["out"]]


def wire(message: BaseModel) -> Any:
    """The message as it goes on the topic: the product's encoder, parsed back to JSON."""
    return json.loads(encode(message))


def messages() -> dict[str, BaseModel]:
    """One real message per exported schema, as its producer builds it, signed now (the
    registry refuses a sequence number from the future)."""
    now = datetime.now(UTC).replace(microsecond=0)
    kit = make_kit(now)
    rec = record("support-bot", "1")
    command = CacheCommand(
        command_id="cmd-1",
        worker_id="w0",
        action=CommandAction.load_gpu,
        base_model=BASE,
        tenant_id=TENANT,
        adapter_id=rec.adapter_id,
        version=rec.version,
        sha256=rec.sha256,
        lora_name=rec.lora_name,
        reason=CommandReason(rule=CommandRule.hot_score, score=0.7),
        issued_at=now,
        deadline=now + timedelta(minutes=1),
        warmup_requests=2,
    )
    return {
        "request_log": RequestLog(
            event_id="r-1",
            ts=now,
            request_id="q1",
            tenant_id=TENANT,
            base_model=BASE,
            adapter_id=rec.adapter_id,
            adapter_version="1",
            lora_name=rec.lora_name,
            worker_id="w0",
            tier_at_arrival="gpu",
            ttft_ms=41.5,
            prompt_tokens=12,
            output_tokens=30,
        ),
        "worker_state": WorkerState(
            worker_id="w0",
            base_model=BASE,
            ts=now,
            gpu_slots_used=1,
            gpu_slots_total=4,
            host_bytes_used=1000,
            host_bytes_budget=10**9,
            hbm_usage=0.4,
            max_lora_rank=16,
            command_partition=3,
            adapters=[
                LoadedAdapter(
                    lora_name=rec.lora_name,
                    adapter_id=rec.adapter_id,
                    version="1",
                    tenant_id=TENANT,
                    tier="gpu",
                    pinned=True,
                    size_bytes=1000,
                    rank=8,
                    last_used=now,
                )
            ],
        ),
        "cache_command": kit.keys["planner"].sign_command(command),
        "cache_event": CacheEvent(
            event_id="c-1",
            ts=now,
            worker_id="w0",
            base_model=BASE,
            tenant_id=TENANT,
            adapter_id=rec.adapter_id,
            adapter_version="1",
            lora_name=rec.lora_name,
            kind=CacheEventKind.fail,
            reason=ArtifactReason.fetch_failed,
            command_id="cmd-1",
        ),
        "lifecycle_event": kit.event("ci", "publish", rec.adapter_id, "1", 1, now),
        "adapter_view": signed_view(
            kit.keys["ci"],
            [rec.model_copy(update={"status": AdapterStatus.active})],
            now,
            kit.keyring,
        ),
        "audit_record": AuditRecord(
            event_id="a-1",
            ts=now,
            component="planner",
            action="load_gpu",
            decision="issued",
            reason=CommandRule.hot_score,
            adapter_id=rec.adapter_id,
            actor="cmd-1",
        ),
        "dead_letter": dead_letter_at(
            "loraplane.requests",
            0,
            7,
            b"k",
            b"{not json",
            now.timestamp(),
            "scoring",
            DecodeReason.malformed,
            "not JSON",
        ),
    }


# (schema, what is wrong, how to break a valid message): each must fail both validators.
BROKEN: list[tuple[str, str, Any]] = [
    ("request_log", "unknown tier", lambda m: {**m, "tier_at_arrival": "lukewarm"}),
    ("request_log", "missing field", lambda m: {k: v for k, v in m.items() if k != "ts"}),
    ("worker_state", "negative slots", lambda m: {**m, "gpu_slots_used": -1}),
    ("worker_state", "unknown field", lambda m: {**m, "surprise": 1}),
    ("cache_command", "unknown action", lambda m: {**m, "action": "format_disk"}),
    ("cache_event", "unknown reason code", lambda m: {**m, "reason": "because"}),
    ("lifecycle_event", "timestamp without zone", lambda m: {**m, "issued_at": "yesterday"}),
    ("dead_letter", "wrong type", lambda m: {**m, "offset": "seven"}),
]


def test_every_real_message_is_valid_for_ajv(tmp_path: Path) -> None:
    export.export(tmp_path)  # what `loraplane schemas export` writes
    sent = messages()
    assert set(sent) <= set(export.MODELS)
    cases = [(name, wire(m)) for name, m in sent.items()]
    for (name, _), (valid, errors) in zip(cases, ajv(tmp_path, cases), strict=True):
        assert valid, f"{name}: {errors}"


def test_ajv_rejects_what_pydantic_rejects(tmp_path: Path) -> None:
    export.export(tmp_path)
    sent = messages()
    cases = [(name, breaks(wire(sent[name]))) for name, _, breaks in BROKEN]
    for name, message in cases:
        with pytest.raises(ValidationError):
            export.MODELS[name].model_validate_json(json.dumps(message))
    for (name, what, _), (valid, errors) in zip(BROKEN, ajv(tmp_path, cases), strict=True):
        assert not valid, f"ajv accepted {name} with {what}"
        assert errors


def test_checked_in_schemas_are_the_exported_ones() -> None:
    """The files other languages read are the ones this test validated against."""
    assert export.drift() == []
