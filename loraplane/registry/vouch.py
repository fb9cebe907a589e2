"""Whether the signed registry vouches for a lora name that a process outside the agent is
about to load (vLLM's host-tier resolver, workers/vllm_resolver.py). Pure.

An entry's ``record.json`` says what its files were verified against, but anyone who can
write the host tier can write a record to match any files. The resolver decides from the
agent's saved views instead (``host_tier_entry.VIEWS_FILE``): the adapter's view must verify
with the keyring (``registry.evidence.verify_view``: its signed events fold into
exactly it), name a version whose lora name (id, version and digest) is the one asked for,
and not have that version retired or revoked. The record of that signed view is then the
one the files are checked against, so the bytes vLLM loads are the ones a signed release
names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from loraplane.registry.evidence import ViewRefused, verify_view
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus
from loraplane.schemas.keyring import Keyring
from loraplane.schemas.reasons import ResolverRefusal
from loraplane.schemas.registry import AdapterView

__all__ = ["WITHDRAWN", "Unvouched", "vouched_record"]

WITHDRAWN = (AdapterStatus.retired, AdapterStatus.revoked)


@dataclass(frozen=True)
class Unvouched:
    reason: ResolverRefusal  # unvouched or withdrawn
    detail: str


def vouched_record(
    lora_name: str, views: Mapping[str, AdapterView], keyring: Keyring | None, now: datetime
) -> AdapterRecord | Unvouched:
    """The signed record of ``lora_name`` (``{adapter_id}@{version}-{sha8}``), or why none."""
    adapter_id = lora_name.partition("@")[0]
    view = views.get(adapter_id)
    if view is None:
        return Unvouched(ResolverRefusal.unvouched, f"no saved registry view of {adapter_id}")
    verdict = verify_view(view, keyring, now)
    if isinstance(verdict, ViewRefused):
        return Unvouched(
            ResolverRefusal.unvouched, f"the view of {adapter_id}: {verdict.reason.value}"
        )
    record = next((r for r in view.versions if r.lora_name == lora_name), None)
    if record is None:
        return Unvouched(
            ResolverRefusal.unvouched, f"the verified view of {adapter_id} names no {lora_name}"
        )
    if record.status in WITHDRAWN:
        return Unvouched(ResolverRefusal.withdrawn, f"{lora_name} is {record.status.value}")
    return record
