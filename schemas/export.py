"""JSON Schema export for producers in other languages, and the drift check CI runs."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel

from loraplane.schemas.adapter import AdapterRecord
from loraplane.schemas.audit import AuditRecord
from loraplane.schemas.cache_event import CacheEvent
from loraplane.schemas.commands import CacheCommand
from loraplane.schemas.dead_letter import DeadLetter
from loraplane.schemas.lifecycle import LifecycleEvent
from loraplane.schemas.manifest import Manifest
from loraplane.schemas.planner_memory import PlannerMemory
from loraplane.schemas.publish_result import PublishResult
from loraplane.schemas.registry import AdapterView
from loraplane.schemas.request_log import RequestLog
from loraplane.schemas.router_state import RouterState
from loraplane.schemas.score_snapshot import ScoreSnapshot, UnknownTally
from loraplane.schemas.worker_state import WorkerState

__all__ = ["JSON_DIR", "MODELS", "drift", "export", "render"]

MODELS: dict[str, type[BaseModel]] = {
    "adapter_record": AdapterRecord,
    "adapter_view": AdapterView,
    "audit_record": AuditRecord,
    "cache_command": CacheCommand,
    "cache_event": CacheEvent,
    "dead_letter": DeadLetter,
    "lifecycle_event": LifecycleEvent,
    "manifest": Manifest,
    "planner_memory": PlannerMemory,
    "publish_result": PublishResult,
    "request_log": RequestLog,
    "router_state": RouterState,
    "score_snapshot": ScoreSnapshot,
    "unknown_tally": UnknownTally,
    "worker_state": WorkerState,
}

JSON_DIR = Path(__file__).parent / "json"


def render(model: type[BaseModel]) -> str:
    schema = model.model_json_schema(mode="validation")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def export(directory: Path = JSON_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, model in MODELS.items():
        path = directory / f"{name}.schema.json"
        path.write_text(render(model))
        written.append(path)
    return written


def drift(directory: Path = JSON_DIR) -> list[str]:
    """Names whose checked-in schema differs from the model (missing counts as drift)."""
    out = []
    for name, model in MODELS.items():
        path = directory / f"{name}.schema.json"
        if not path.is_file() or path.read_text() != render(model):
            out.append(name)
    return out
