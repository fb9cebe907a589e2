"""JSON files the CLI reads (events, registry state, records, a model's config.json): hostile
bytes become one ``ValueError`` with a message, never a traceback (RecursionError on deep
nesting, UnicodeDecodeError, a list where an object belongs, ...)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraplane.artifact.model_shape import ModelShape

__all__ = ["MAX_FILE_BYTES", "read_json", "read_model_config"]

MAX_FILE_BYTES = 64 * 1024 * 1024


def read_json(path: Path, max_bytes: int = MAX_FILE_BYTES, max_depth: int = 64) -> Any:
    """The one strict JSON value in ``path`` (schemas.strict_json); ValueError otherwise."""
    from loraplane.kernel.local_files import read_regular
    from loraplane.schemas.strict_json import strict_loads

    try:
        raw = read_regular(path, max_bytes)
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    try:
        return strict_loads(raw, max_bytes=max_bytes, max_depth=max_depth)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def read_model_config(path: Path) -> ModelShape:
    """A base model's config.json as shapes; ValueError for anything else."""
    from loraplane.artifact.model_shape import MAX_MODEL_CONFIG_BYTES, ModelShape

    config = read_json(path, MAX_MODEL_CONFIG_BYTES)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: config.json must be a JSON object")
    try:
        return ModelShape.from_hf_config(config)
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
        raise ValueError(f"{path}: {exc}") from None
