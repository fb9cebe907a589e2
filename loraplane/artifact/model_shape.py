"""The LoRA-targetable linear layers of a Llama-style base model, and their shapes.

A LoRA adapter for module ``m`` holds ``lora_A`` of shape ``[r, in_features]`` and ``lora_B``
of shape ``[out_features, r]``. Knowing the base model's shapes lets verification refuse an
adapter whose weights would not fit (vLLM answers that with a 500 at load time), and lets
the tiny-model builder write adapters that do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_MODEL_CONFIG_BYTES", "LinearShape", "ModelShape"]

MAX_MODEL_CONFIG_BYTES = 1024 * 1024
"""The most a base model's ``config.json`` is read: a few KiB in every model we serve."""


@dataclass(frozen=True)
class LinearShape:
    block: str  # "self_attn" or "mlp": the module's parent inside a decoder layer
    in_features: int
    out_features: int


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    modules: Mapping[str, LinearShape]

    def site(self, layer: int, module: str) -> str:
        """Where PEFT puts the module: ``model.layers.{layer}.{block}``."""
        return f"model.layers.{layer}.{self.modules[module].block}"

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """From a Hugging Face ``config.json`` of a Llama-architecture model.

        Raises ValueError when a needed field is missing or not a positive integer.
        """

        def positive(key: str, default: int | None = None) -> int:
            value = config.get(key, default)
            if value is None:
                # Newer configs omit head_dim / num_key_value_heads when they are implied.
                raise ValueError(f"config.json: {key} is missing")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config.json: {key} must be a positive integer, not {value!r}")
            return value

        hidden = positive("hidden_size")
        heads = positive("num_attention_heads")
        kv_heads = positive("num_key_value_heads", heads)
        head_dim = positive("head_dim", hidden // heads if hidden % heads == 0 else None)
        inter = positive("intermediate_size")
        return cls(
            num_layers=positive("num_hidden_layers"),
            modules={
                "q_proj": LinearShape("self_attn", hidden, heads * head_dim),
                "k_proj": LinearShape("self_attn", hidden, kv_heads * head_dim),
                "v_proj": LinearShape("self_attn", hidden, kv_heads * head_dim),
                "o_proj": LinearShape("self_attn", heads * head_dim, hidden),
                "gate_proj": LinearShape("mlp", hidden, inter),
                "up_proj": LinearShape("mlp", hidden, inter),
                "down_proj": LinearShape("mlp", inter, hidden),
            },
        )
