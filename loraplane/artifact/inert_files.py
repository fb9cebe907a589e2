"""Files that training tools write beside an adapter and that publish leaves out. Pure.

PEFT's ``save_pretrained`` writes a model card, ``README.md``, next to ``adapter_config.json``
and ``adapter_model.safetensors``. It serves nothing, so the publisher drops it instead of
uploading it, and records it in the manifest's ``dropped`` list; workers keep their strict
allowlist and never see it. The list is short on purpose: code (``*.py``) and pickles stay
refused, as does anything not named here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loraplane.artifact.refusal import Refusal
from loraplane.artifact.verification import MANIFEST_NAME, FileFacts
from loraplane.schemas.manifest import InertKind
from loraplane.schemas.reasons import ArtifactReason as Reason

__all__ = ["INERT_FILES", "MAX_INERT_BYTES", "Selection", "select_for_publish"]

INERT_FILES: dict[str, InertKind] = {"README.md": InertKind.model_card}
MAX_INERT_BYTES = 1024 * 1024  # a model card is a few KiB; more is not a model card


@dataclass(frozen=True)
class Selection:
    """What publish uploads, what it drops (and why), and what it refuses outright."""

    kept: tuple[FileFacts, ...]
    dropped: tuple[tuple[FileFacts, InertKind], ...]
    refusals: tuple[Refusal, ...]


def select_for_publish(files: Sequence[FileFacts]) -> Selection:
    """Split a folder's listing: top-level regular inert files under the size cap are
    dropped; an oversized one is refused (``too_large``), a linked one is left to the
    verifier's ``symlink``. Everything else is kept, for the verifier to judge."""
    kept: list[FileFacts] = []
    dropped: list[tuple[FileFacts, InertKind]] = []
    refusals: list[Refusal] = []
    for fact in files:
        kind = INERT_FILES.get(fact.path)
        if fact.path == MANIFEST_NAME:
            continue  # rebuilt by the publisher
        if kind is None or fact.kind != "file":
            kept.append(fact)
        elif fact.size > MAX_INERT_BYTES:
            refusals.append(
                Refusal(
                    Reason.too_large,
                    fact.path,
                    f"{fact.size} bytes > {MAX_INERT_BYTES} for a {kind.value.replace('_', ' ')}",
                )
            )
        else:
            dropped.append((fact, kind))
    return Selection(tuple(kept), tuple(dropped), tuple(refusals))
