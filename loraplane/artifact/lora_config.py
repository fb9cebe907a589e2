"""adapter_config.json as PEFT writes it, read for what vLLM will serve. Pure.

Every field PEFT 0.21's ``LoraConfig`` saves has a rule here, and the rules mirror vLLM
0.32's own refusals (``vllm/lora/peft_helper.py``) so that an adapter is refused before
upload instead of with a 400 at load time:

- a few fields decide the weights and are validated (``peft_type``, ``r``,
  ``lora_alpha``, ``target_modules``, ``bias``, ``init_lora_weights``,
  ``base_model_name_or_path``);
- ``HARMLESS`` fields only matter while training or loading in PEFT, any value passes;
- ``MUST_BE_OFF`` fields turn on something vLLM does not serve (DoRA, LoRA bias, aLoRA,
  ...) or that our record and tensor checks cannot describe (per-module ranks): they must
  be null, false or empty;
- a field neither list knows (a newer PEFT) passes while it is off and is refused once set:
  PEFT adds features off by default, and a feature we have not reviewed may change what the
  weights mean.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = [
    "FLOAT16_MAX",
    "HARMLESS",
    "MAX_ALPHA",
    "MUST_BE_OFF",
    "SERVABLE_INITS",
    "VALIDATED",
    "LoraConfig",
    "Unservable",
    "is_off",
    "parse_lora_config",
    "unservable_fields",
]


class Unservable(StrEnum):
    """A PEFT feature an adapter may not use, named in ``config_invalid`` details."""

    dora = "DoRA (vLLM does not serve it)"
    lora_bias = "LoRA bias (vLLM does not serve it)"
    modules_to_save = "fully trained modules (vLLM serves none for a causal LM)"
    per_module_rank = "per-module rank or alpha (one rank per adapter here)"
    layer_subset = "a subset of layers (one rank per adapter here)"
    layer_replication = "layer replication (vLLM does not serve it)"
    activated_lora = "Activated LoRA (vLLM does not serve it)"
    block_diagonal = "block-diagonal LoRA (vLLM does not serve it)"
    qalora = "QALoRA (vLLM does not serve it)"
    trainable_tokens = "trainable token embeddings (vLLM does not serve them)"
    target_parameters = "LoRA on parameters, not modules (not checked here)"
    transposed_weights = "fan_in_fan_out weights (vLLM reads [out, in] layers only)"
    arrow_routing = "Arrow routing between adapters (vLLM does not serve it)"
    kasa = "KaSA, which changes the base weights (vLLM does not serve it)"
    monteclora = "MonteCLoRA sampling (vLLM does not serve it)"
    unknown_feature = "a PEFT option this version of loraplane does not know"


MUST_BE_OFF: dict[str, Unservable] = {
    "use_dora": Unservable.dora,
    "lora_bias": Unservable.lora_bias,
    "modules_to_save": Unservable.modules_to_save,
    "rank_pattern": Unservable.per_module_rank,
    "alpha_pattern": Unservable.per_module_rank,
    "layers_to_transform": Unservable.layer_subset,
    "layer_replication": Unservable.layer_replication,
    "alora_invocation_tokens": Unservable.activated_lora,
    "use_bdlora": Unservable.block_diagonal,
    "use_qalora": Unservable.qalora,
    "trainable_token_indices": Unservable.trainable_tokens,
    "target_parameters": Unservable.target_parameters,
    "fan_in_fan_out": Unservable.transposed_weights,
    "arrow_config": Unservable.arrow_routing,
    "kasa_config": Unservable.kasa,
    "monteclora_config": Unservable.monteclora,
}
HARMLESS = frozenset(
    {
        "task_type",
        "auto_mapping",
        "peft_version",
        "revision",
        "inference_mode",
        "lora_dropout",
        "use_rslora",  # a different scaling, which vLLM applies
        "exclude_modules",
        "layers_pattern",  # which modules PEFT wrapped: the weights say it
        "megatron_config",
        "megatron_core",
        "qalora_group_size",
        "runtime_config",
        "ensure_weight_tying",  # only with modules_to_save or tied layers
        "velora_config",  # a training-time backward pass
        # parameters of an initialisation; init_lora_weights says whether it is servable
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
    }
)
VALIDATED = frozenset(
    {
        "peft_type",
        "r",
        "lora_alpha",
        "target_modules",
        "bias",
        "init_lora_weights",
        "base_model_name_or_path",
    }
)
# Initialisations that only set the first adapter weights (vLLM's list); the others (PiSSA,
# OLoRA, CorDA, LoftQ, ...) change the base model's weights when PEFT loads the adapter.
SERVABLE_INITS = frozenset({"gaussian", "eva", "orthogonal", "mica", "lora_ga"})
_MODULE_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")


@dataclass(frozen=True)
class LoraConfig:
    """The fields of adapter_config.json that decide what the weights must look like."""

    rank: int
    target_modules: frozenset[str]
    base_model: str
    scaling: float = 1.0
    """What vLLM multiplies lora_B by, in its serving dtype: ``lora_alpha / r``, or
    ``lora_alpha / sqrt(r)`` with ``use_rslora`` (``PEFTHelper._scaling``)."""


def is_off(value: Any) -> bool:
    """null, false, 0, "" or an empty list/object: how PEFT writes a feature it does not use."""
    return value is None or value is False or value in ("", 0) or value == [] or value == {}


def unservable_fields(raw: dict[str, Any]) -> list[tuple[str, Unservable]]:
    """Every field that is set and turns on something we do not serve, in file order."""
    found = []
    for key, value in raw.items():
        if key in VALIDATED or key in HARMLESS or is_off(value):
            continue
        found.append((key, MUST_BE_OFF.get(key, Unservable.unknown_feature)))
    return found


FLOAT16_MAX = 65504.0
"""float16's largest finite value, the narrowest dtype vLLM serves LoRA weights in: vLLM casts
every weight to its serving dtype (``--dtype``) and multiplies lora_B by the scaling in it,
so a value past it is an infinity there and every answer of the adapter is NaN. The bound
holds for every worker, whatever dtype it serves in, so an adapter is served everywhere or
nowhere."""
MAX_ALPHA = FLOAT16_MAX
"""The largest ``lora_alpha`` served: vLLM scales the adapter's weights by alpha / r in the
serving dtype, so past it the scaled weights overflow to inf."""


def parse_lora_config(raw: Any) -> LoraConfig:
    """The subset of a PEFT LoraConfig that vLLM honours; ValueError (its message names the
    field and its value) for anything vLLM would misread or refuse."""
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    if raw.get("peft_type") != "LORA":
        raise ValueError(f"peft_type must be 'LORA', not {_short(raw.get('peft_type'))}")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"r must be a positive integer, not {_short(rank)}")
    alpha = raw.get("lora_alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"lora_alpha must be a number, not {_short(alpha)}")
    if abs(alpha) > MAX_ALPHA:
        raise ValueError(f"lora_alpha must be within +-{MAX_ALPHA:g}, not {_short(alpha)}")
    modules = raw.get("target_modules")
    if (
        not isinstance(modules, list)
        or not modules
        or not all(isinstance(m, str) and _MODULE_NAME.fullmatch(m) for m in modules)
    ):
        raise ValueError(
            f"target_modules must be a non-empty list of module names, not {_short(modules)}"
        )
    if raw.get("bias", "none") != "none":
        raise ValueError(f"bias must be 'none', not {_short(raw.get('bias'))}")
    init = raw.get("init_lora_weights", True)
    if not isinstance(init, bool) and not (
        isinstance(init, str) and init.lower() in SERVABLE_INITS
    ):
        raise ValueError(
            f"init_lora_weights {_short(init)} changes the base weights "
            f"(servable: true, false, {', '.join(sorted(SERVABLE_INITS))})"
        )
    unservable = unservable_fields(raw)
    if unservable:
        raise ValueError(
            "; ".join(f"{key[:64]}={_short(raw[key])}: {why.value}" for key, why in unservable[:4])
        )
    base = raw.get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise ValueError("base_model_name_or_path is missing")
    # vLLM's test is truthiness (``if self.use_rslora``), whatever the value's type
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    return LoraConfig(rank, frozenset(modules), base, scaling)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
