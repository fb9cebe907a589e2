"""One host-tier entry on disk: its layout and the record it was verified against. Pure.

The tier (workers/host_tier.py) writes and adopts entries; the LoRA resolver inside vLLM
(workers/vllm_resolver.py) reads them in another process and puts its verified copies in
the tier's ``.resolver-copies/``; the agent's reconcile vouches for those copies as it does
for the entries. All of them take the layout from here, so "an entry" means the same to
each. Only schema imports: vLLM's Python imports this module too.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Literal

from pydantic import ValidationError

from loraplane.schemas.adapter import AdapterRecord

__all__ = [
    "ADAPTER_DIR",
    "MAX_RECORD_BYTES",
    "RECORD_FILE",
    "RESOLVER_COPIES",
    "VIEWS_FILE",
    "EntryProblem",
    "entry_record",
    "is_resolver_copy",
    "resolver_copy_name",
]

ADAPTER_DIR = "adapter"  # {lora_name}/adapter/: the folder handed to vLLM
RECORD_FILE = "record.json"  # {lora_name}/record.json: the registry record it was verified against
RESOLVER_COPIES = ".resolver-copies"  # {root}/.resolver-copies/{lora_name}.{hex}/: vLLM's
VIEWS_FILE = ".registry-views.json"  # {root}/: the agent's last verified registry views
"""Written by the agent (``loraplane.registry.live``: a start without Kafka serves them);
the resolver vouches for an entry only through them. Not a lora name: scans skip it."""
MAX_RECORD_BYTES = 256 * 1024

EntryProblem = Literal["record_unreadable", "record_mismatch"]


def entry_record(raw: bytes, folder_name: str) -> AdapterRecord | EntryProblem:
    """The record of the entry folder ``folder_name`` from its record.json bytes, or why it
    is none: unparsable, or a record of another lora name (an entry moved or copied)."""
    if len(raw) > MAX_RECORD_BYTES:
        return "record_unreadable"
    try:
        record = AdapterRecord.model_validate_json(raw)
    except ValidationError:
        return "record_unreadable"
    return record if record.lora_name == folder_name else "record_mismatch"


def resolver_copy_name(lora_name: str, token: str) -> str:
    return f"{lora_name}.{token}"


def is_resolver_copy(root: str, entry_path: str, lora_name: str) -> bool:
    """True when vLLM's folder ``root`` for ``lora_name`` is a resolver copy of the entry
    whose adapter folder is ``entry_path`` (the resolver verified it against that entry)."""
    copy, entry = PurePath(root), PurePath(entry_path)
    return (
        copy.parent == entry.parent.parent / RESOLVER_COPIES
        and copy.name.startswith(resolver_copy_name(lora_name, ""))
        and copy.name[len(lora_name) + 1 :].isalnum()
    )
