"""Which base model an adapter_config.json names. Pure.

PEFT writes ``base_model_name_or_path`` as whatever the trainer loaded: a hub id such as
``meta-llama/Llama-3.1-8B-Instruct`` or a local path, never loraplane's base-model id. The
settings' ``base_model_aliases`` map those names to ids; a name is its own id otherwise.
A name is only a claim: where the base model's shapes are known, the tensor checks confirm
it (an alias to the wrong model is caught as ``tensor_shape_mismatch`` or
``module_not_in_model``).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["alias_key", "base_model_matches", "mismatch_detail", "resolve_base_model"]


def alias_key(name_or_path: str) -> str:
    """A local path names the same folder with or without a trailing slash."""
    return name_or_path.rstrip("/") or name_or_path


def resolve_base_model(name_or_path: str, aliases: Mapping[str, str]) -> str:
    """The base-model id ``name_or_path`` stands for: its alias, else itself."""
    normalised = {alias_key(k): v for k, v in aliases.items()}
    return normalised.get(alias_key(name_or_path), name_or_path)


def base_model_matches(
    config_value: str, base_model: str, aliases: Mapping[str, str] | None = None
) -> bool:
    """True when the config's base model, resolved through ``aliases``, is ``base_model``."""
    return resolve_base_model(config_value, aliases or {}) == base_model


def mismatch_detail(config_value: str, base_model: str, aliases: Mapping[str, str]) -> str:
    """Both names, and the alias in between when there is one, for the refusal message."""
    resolved = resolve_base_model(config_value, aliases)
    via = f" (alias of {resolved!r})" if resolved != config_value else ""
    return f"{config_value[:100]!r}{via} != {base_model!r}"
