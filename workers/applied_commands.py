"""What a worker must remember across a restart that vLLM cannot tell it, on disk: the command
ids it has applied, so a redelivered command is still a no-op (``schemas/commands.py``
promises that a repeated id does nothing), and the copies it holds protected, so a restart
keeps the same ones (protection is sticky, ``command_effects.protected_copies``, and the
planner plans with the set the worker reported: re-deriving it in another order would let a
restart refuse a command planned on the set it had).

One small JSON file in the host-tier folder, ``{"applied": {command_id: deadline},
"protected": [lora_name, ...]}``. It is written atomically (temp file, fsync, rename), so a
crash leaves the old file or the new one, never half of one. Ids whose deadline has passed
are dropped when loading (and on every apply, see ``reconcile.remember``): such a command is
skipped as ``expired`` anyway.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from pydantic import AwareDatetime, TypeAdapter, ValidationError

from loraplane.kernel.atomic_file import write_atomic
from loraplane.kernel.local_files import read_regular
from loraplane.schemas.strict_json import strict_loads

__all__ = [
    "FILE_NAME",
    "MAX_FILE_BYTES",
    "Remembered",
    "load_applied",
    "load_remembered",
    "save_applied",
]

MAX_FILE_BYTES = 16 * 1024 * 1024  # 10,000 ids and every lora name fit in well under 2 MiB
FILE_NAME = ".applied-commands.json"  # not a lora name, so the host-tier scan ignores it
_APPLIED = TypeAdapter(dict[str, AwareDatetime])
_PROTECTED = TypeAdapter(list[str])
log = logging.getLogger("loraplane.worker")


@dataclass(frozen=True)
class Remembered:
    applied: dict[str, datetime] = field(default_factory=dict)
    protected: frozenset[str] = frozenset()


def load_remembered(path: Path, now: datetime) -> Remembered:
    """The ids applied before a restart whose deadline has not passed, and the copies then
    protected; empty when there is no file. A corrupt file is logged and ignored (dedup then
    starts empty, and protection is derived afresh)."""
    try:
        raw = read_regular(path, MAX_FILE_BYTES)
    except FileNotFoundError:
        return Remembered()
    except OSError as exc:
        log.warning("applied command ids unreadable (%s): %s", path, exc)
        return Remembered()
    try:
        data = strict_loads(raw, max_bytes=MAX_FILE_BYTES)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        applied = _APPLIED.validate_python(data.get("applied"))
        protected = _PROTECTED.validate_python(data.get("protected", []))
    except (ValueError, ValidationError) as exc:
        log.warning(
            "applied command ids in %s are corrupt, starting empty: %s", path, str(exc)[:200]
        )
        return Remembered()
    return Remembered(
        {cid: deadline for cid, deadline in applied.items() if deadline >= now},
        frozenset(protected),
    )


def load_applied(path: Path, now: datetime) -> dict[str, datetime]:
    """The ids applied before a restart whose deadline has not passed (``load_remembered``)."""
    return load_remembered(path, now).applied


def save_applied(
    path: Path, applied: Mapping[str, datetime], protected: Iterable[str] = ()
) -> None:
    """Replace the file with ``applied`` and ``protected``, atomically."""
    write_atomic(
        path,
        json.dumps(
            {
                "applied": {cid: d.isoformat() for cid, d in applied.items()},
                "protected": sorted(protected),
            }
        ),
    )
