"""The command ids a worker has applied, on disk, so a redelivered command is still a no-op
after a restart (``schemas/commands.py`` promises that a repeated id does nothing).

One small JSON file in the host-tier folder, ``{"applied": {command_id: deadline}}``. It is
written atomically (temp file, fsync, rename), so a crash leaves the old file or the new one,
never half of one. Ids whose deadline has passed are dropped when loading (and on every
apply, see ``reconcile.remember``): such a command is skipped as ``expired`` anyway.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

from pydantic import AwareDatetime, TypeAdapter, ValidationError

from loraplane.kernel.atomic_file import write_atomic

FILE_NAME = ".applied-commands.json"  # not a lora name, so the host-tier scan ignores it
_APPLIED = TypeAdapter(dict[str, AwareDatetime])
log = logging.getLogger("loraplane.worker")


def load_applied(path: Path, now: datetime) -> dict[str, datetime]:
    """The ids applied before a restart whose deadline has not passed; {} when there is no
    file. A corrupt file is logged and ignored (dedup then starts empty, as before)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log.warning("applied command ids unreadable (%s): %s", path, exc)
        return {}
    try:
        data = json.loads(raw)
        applied = _APPLIED.validate_python(data.get("applied") if isinstance(data, dict)
                                           else None)
    except (ValueError, ValidationError) as exc:
        log.warning("applied command ids in %s are corrupt, starting empty: %s", path,
                    str(exc)[:200])
        return {}
    return {cid: deadline for cid, deadline in applied.items() if deadline >= now}


def save_applied(path: Path, applied: Mapping[str, datetime]) -> None:
    """Replace the file with ``applied``, atomically."""
    write_atomic(path, json.dumps({"applied": {cid: d.isoformat()
                                               for cid, d in applied.items()}}))
