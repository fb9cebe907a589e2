"""One host-tier entry on disk: its layout and the record it was verified against.

The tier (workers/host_tier.py) writes and adopts entries; the LoRA resolver inside vLLM
(workers/vllm_resolver.py) reads them in another process. Both parse the record here, so
"an entry" means the same to the writer and to the reader. Only schema imports: vLLM's
Python imports this module too.
"""

from __future__ import annotations

from typing import Literal

from loraplane.schemas.adapter import AdapterRecord
from pydantic import ValidationError

ADAPTER_DIR = "adapter"  # {lora_name}/adapter/: the folder handed to vLLM
RECORD_FILE = "record.json"  # {lora_name}/record.json: the registry record it was verified against
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
