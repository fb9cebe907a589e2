"""A base model's ``config.json`` on local disk, read as the shapes verification checks an
adapter against (the worker, vLLM's resolver and the CLI's ``--model-config``).

The file is read with ``kernel.local_files.read_json``: a regular file only, at most
``MAX_MODEL_CONFIG_BYTES``, strict JSON. Anything else (a FIFO, a link to an endless device,
a list where the object belongs, a config that is no Llama) is one ``ValueError`` naming the
file.
"""

from __future__ import annotations

from pathlib import Path

from loraplane.artifact.model_shape import MAX_MODEL_CONFIG_BYTES, ModelShape
from loraplane.kernel.local_files import read_json

__all__ = ["read_model_config"]


def read_model_config(path: Path) -> ModelShape:
    """The shapes of the base model whose ``config.json`` is ``path``; ValueError otherwise."""
    config = read_json(path, MAX_MODEL_CONFIG_BYTES)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: config.json must be a JSON object")
    try:
        return ModelShape.from_hf_config(config)
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
        raise ValueError(f"{path}: {exc}") from None
