"""A tiny random Llama model and PEFT LoRA adapters for it, built without torch.

No weights can be downloaded here, yet the demo and the tests need a real vLLM to load a
real model and real adapters. This writes exactly the files Hugging Face and vLLM read:
``config.json`` (LlamaForCausalLM), ``model.safetensors`` with HF Llama tensor names, a
byte-level BPE ``tokenizer.json`` trained on generated text with a chat template, and per
adapter ``adapter_config.json`` + ``adapter_model.safetensors`` in PEFT's layout
(``base_model.model.<site>.<module>.lora_{A,B}.weight``). Adapter weights are random and
non-zero on both halves (PEFT's ``init_lora_weights=False``), so every adapter changes the
model's output. Everything is deterministic per seed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loraplane.artifact.model_shape import ModelShape
from loraplane.kernel.atomic_file import write_atomic

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TINY_BASE_MODEL",
    "TinyLlama",
    "build_adapter",
    "build_model",
    "peft_lora_config",
]

TINY_BASE_MODEL = "tiny-llama"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3, in this order
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}### {{ message['role'] }}:\n"
    "{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}### assistant:\n"
    "{% endif %}"
)


@dataclass(frozen=True)
class TinyLlama:
    """The architecture; small enough to build in a second and to serve on a laptop CPU."""

    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 256
    max_position_embeddings: int = 512
    vocab_size: int = 1000

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "head_dim": self.hidden_size // self.num_attention_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": vocab_size,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
            "bos_token_id": SPECIAL_TOKENS.index("<s>"),
            "eos_token_id": SPECIAL_TOKENS.index("</s>"),
            "pad_token_id": SPECIAL_TOKENS.index("<pad>"),
            "torch_dtype": "float32",
        }


def build_model(directory: Path, *, seed: int = 0, arch: TinyLlama = TinyLlama()) -> Path:
    """Write a loadable model folder (about 2.5 MB, float32) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = _write_tokenizer(directory, seed=seed, arch=arch)
    config = arch.hf_config(vocab_size)
    _write_json(directory / "config.json", config)
    _write_json(
        directory / "generation_config.json",
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"],
            "pad_token_id": config["pad_token_id"],
        },
    )
    _save_safetensors(directory / "model.safetensors", _model_weights(config, seed))
    return directory


def build_adapter(
    directory: Path,
    *,
    seed: int,
    rank: int = 8,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    base_model_name: str = TINY_BASE_MODEL,
    lora_alpha: int = 16,
    model_config: dict[str, Any] | None = None,
) -> Path:
    """Write a PEFT LoRA adapter for the model described by ``model_config`` (default: the
    tiny Llama) and return its folder. Raises ValueError for a module the model lacks."""
    shape = ModelShape.from_hf_config(model_config or TinyLlama().hf_config(1000))
    unknown = sorted(set(target_modules) - set(shape.modules))
    if unknown:
        raise ValueError(f"the model has no module(s) {unknown}")
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(shape.num_layers):
        for module in sorted(set(target_modules)):
            linear = shape.modules[module]
            prefix = f"base_model.model.{shape.site(layer, module)}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = _normal(rng, (rank, linear.in_features), 0.1)
            tensors[f"{prefix}.lora_B.weight"] = _normal(rng, (linear.out_features, rank), 0.1)
    directory.mkdir(parents=True, exist_ok=True)
    _write_json(
        directory / "adapter_config.json",
        peft_lora_config(
            rank=rank,
            lora_alpha=lora_alpha,
            target_modules=sorted(set(target_modules)),
            base_model_name=base_model_name,
        ),
    )
    _save_safetensors(directory / "adapter_model.safetensors", tensors)
    return directory


def peft_lora_config(
    *, rank: int, lora_alpha: int, target_modules: Sequence[str], base_model_name: str
) -> dict[str, Any]:
    """adapter_config.json as peft's ``LoraConfig.save_pretrained`` writes it."""
    return {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": base_model_name,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": False,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": lora_alpha,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": list(target_modules),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    return (rng.standard_normal(shape) * std).astype(np.float32)


def _model_weights(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = ModelShape.from_hf_config(config)
    hidden, vocab, std = config["hidden_size"], config["vocab_size"], config["initializer_range"]
    ones = np.ones(hidden, dtype=np.float32)
    weights = {"model.embed_tokens.weight": _normal(rng, (vocab, hidden), std)}
    for layer in range(shape.num_layers):
        weights[f"model.layers.{layer}.input_layernorm.weight"] = ones
        weights[f"model.layers.{layer}.post_attention_layernorm.weight"] = ones
        for module, linear in shape.modules.items():
            weights[f"{shape.site(layer, module)}.{module}.weight"] = _normal(
                rng, (linear.out_features, linear.in_features), std
            )
    weights["model.norm.weight"] = ones
    weights["lm_head.weight"] = _normal(rng, (vocab, hidden), std)
    return weights


def _training_text(seed: int, sentences: int = 4000) -> Iterator[str]:
    """Pseudo-words with a skewed frequency, so BPE has plenty of merges to learn."""
    rng = np.random.default_rng(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words = ["".join(rng.choice(syllables, size=int(rng.integers(1, 4)))) for _ in range(600)]
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    for _ in range(sentences):
        picked = rng.choice(len(words), size=int(rng.integers(4, 14)), p=weights)
        yield " ".join(words[i] for i in picked).capitalize() + "."


def _write_tokenizer(directory: Path, *, seed: int, arch: TinyLlama) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=arch.vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(seed), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    special = dict(
        zip(("unk_token", "bos_token", "eos_token", "pad_token"), SPECIAL_TOKENS, strict=True)
    )
    _write_json(directory / "special_tokens_map.json", special)
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "model_max_length": arch.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
            "added_tokens_decoder": {
                str(i): {
                    "content": tok,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for i, tok in enumerate(SPECIAL_TOKENS)
            },
        },
    )
    return tokenizer.get_vocab_size()


def _save_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save

    write_atomic(path, save(tensors, metadata={"format": "pt"}))


def _write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")
