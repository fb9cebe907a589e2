"""The tiny model and its adapters: HF/PEFT layout, determinism, adapters that matter."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file
from typer.testing import CliRunner

from loraplane.artifact.directory import DirectoryArtifact
from loraplane.artifact.model_shape import ModelShape
from loraplane.artifact.verification import WorkerLimits, verify_artifact
from loraplane.cli import app
from loraplane.tiny_model import SPECIAL_TOKENS, build_adapter, build_model

MODEL_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_model_folder_has_the_files_hf_and_vllm_read(model: Path) -> None:
    assert {p.name for p in model.iterdir()} == MODEL_FILES
    config = json.loads((model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (
        config["hidden_size"],
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["intermediate_size"],
        config["max_position_embeddings"],
    ) == (128, 2, 4, 256, 512)
    assert config["vocab_size"] == 1000
    with safe_open(str(model / "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert shapes["model.embed_tokens.weight"] == (1000, 128)
    assert shapes["lm_head.weight"] == (1000, 128)
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (128, 128)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (128, 256)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (256, 128)
    assert shapes["model.layers.1.post_attention_layernorm.weight"] == (128,)
    assert shapes["model.norm.weight"] == (128,)
    assert len(shapes) == 3 + 2 * 9


def test_tokenizer_is_byte_level_bpe_with_the_special_tokens(model: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert tok.get_vocab_size() == 1000
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    text = "Bada kimo? Ünïcode and 数字 still round-trip."
    encoded = tok.encode(text)
    assert encoded.ids[0] == 1  # <s>
    assert tok.decode(encoded.ids) == text
    assert len(encoded.ids) < len(text.encode())  # merges were learned
    tok_config = json.loads((model / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "add_generation_prompt" in tok_config["chat_template"]
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<s>", "</s>")


def test_same_seed_same_bytes_other_seed_other_weights(model: Path, tmp_path: Path) -> None:
    again = build_model(tmp_path / "again", seed=0)
    for name in MODEL_FILES:
        assert (again / name).read_bytes() == (model / name).read_bytes(), name
    other = build_model(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (model / "model.safetensors").read_bytes()


def test_adapter_is_peft_layout_with_nonzero_halves_that_change_the_weights(
    model: Path, tmp_path: Path
) -> None:
    config = json.loads((model / "config.json").read_text())
    folder = build_adapter(tmp_path / "a", seed=3, model_config=config)
    adapter_config = json.loads((folder / "adapter_config.json").read_text())
    assert adapter_config["peft_type"] == "LORA" and adapter_config["task_type"] == "CAUSAL_LM"
    assert (adapter_config["r"], adapter_config["target_modules"]) == (8, ["q_proj", "v_proj"])
    assert adapter_config["base_model_name_or_path"] == "tiny-llama"
    lora = load_file(str(folder / "adapter_model.safetensors"))
    base = load_file(str(model / "model.safetensors"))
    assert len(lora) == 2 * 2 * 2  # layers x modules x halves
    scale = adapter_config["lora_alpha"] / adapter_config["r"]
    for layer in range(2):
        for module in ("q_proj", "v_proj"):
            site = f"model.layers.{layer}.self_attn.{module}"
            a = lora[f"base_model.model.{site}.lora_A.weight"]
            b = lora[f"base_model.model.{site}.lora_B.weight"]
            assert a.shape == (8, 128) and b.shape == (128, 8)
            assert np.count_nonzero(a) == a.size and np.count_nonzero(b) == b.size
            delta = scale * b @ a
            # the update is not a rounding error next to the base weight
            assert np.linalg.norm(delta) > 0.5 * np.linalg.norm(base[f"{site}.weight"])


def test_adapters_are_deterministic_per_seed(tmp_path: Path) -> None:
    def weights(name: str, seed: int) -> bytes:
        return (
            build_adapter(tmp_path / name, seed=seed) / "adapter_model.safetensors"
        ).read_bytes()

    assert weights("a", 1) == weights("b", 1)
    assert weights("a", 1) != weights("c", 2)


def test_adapters_verify_against_the_model_they_were_built_for(model: Path, tmp_path: Path) -> None:
    from loraplane.artifact_publish import PublishRequest, build_record
    from loraplane.schemas.adapter import Priority

    config = json.loads((model / "config.json").read_text())
    folder = build_adapter(
        tmp_path / "a",
        seed=1,
        rank=16,
        target_modules=["q_proj", "k_proj", "o_proj", "down_proj"],
        model_config=config,
    )
    record, manifest = build_record(
        folder, PublishRequest("a", "t", "tiny-llama", "1", Priority.gold), "bucket"
    )
    (folder / "manifest.json").write_bytes(manifest.canonical_bytes())
    limits = WorkerLimits(
        base_model="tiny-llama", max_lora_rank=16, model=ModelShape.from_hf_config(config)
    )
    assert verify_artifact(DirectoryArtifact(folder), limits, record).ok


def test_a_module_the_model_lacks_is_refused_at_build_time(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="foo_proj"):
        build_adapter(tmp_path / "a", seed=1, target_modules=["q_proj", "foo_proj"])


def test_cli_builds_and_verifies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    built = runner.invoke(app, ["dev", "build-model", str(tmp_path / "m"), "--adapters", "2"])
    assert built.exit_code == 0, built.output
    lines = [json.loads(line) for line in built.output.splitlines()]
    assert [line.get("adapter") for line in lines[1:]] == [
        str(tmp_path / "m-adapters" / f"adapter-{i}") for i in (1, 2)
    ]
    adapter = tmp_path / "m-adapters" / "adapter-1"
    (tmp_path / "record.json").write_text(json.dumps(lines[1]["record"]))
    ok = runner.invoke(
        app,
        [
            "artifact",
            "verify",
            str(adapter),
            "--max-rank",
            "8",
            "--base-model",
            "tiny-llama",
            "--record",
            str(tmp_path / "record.json"),
            "--model-config",
            str(tmp_path / "m" / "config.json"),
        ],
    )
    assert (ok.exit_code, ok.output.strip()) == (0, "ok")
    refused = runner.invoke(
        app, ["artifact", "verify", str(adapter), "--max-rank", "4", "--base-model", "llama-3-8b"]
    )
    assert refused.exit_code == 1
    assert [line.split()[0] for line in refused.output.splitlines()] == [
        "rank_too_high",
        "base_model_mismatch",
    ]

    # --adapter-id/--version take the record from the registry topic's view
    from datetime import UTC, datetime

    import loraplane.registry.topic
    from loraplane.schemas.adapter import AdapterRecord
    from loraplane.schemas.registry import AdapterView

    record = AdapterRecord.model_validate(lines[1]["record"])
    view = AdapterView(
        adapter_id=record.adapter_id,
        tenant_id=record.tenant_id,
        base_model=record.base_model,
        versions=[record],
        last_seq=1,
        last_event_id="e1",
        updated_at=datetime.now(UTC),
    )
    monkeypatch.setattr(
        loraplane.registry.topic, "load_registry", lambda _settings: {record.adapter_id: view}
    )
    by_id = runner.invoke(
        app,
        ["artifact", "verify", str(adapter), "--adapter-id", record.adapter_id, "--version", "1"],
    )
    assert (by_id.exit_code, by_id.output.strip()) == (0, "ok")
    other = tmp_path / "m-adapters" / "adapter-2"
    mismatch = runner.invoke(
        app, ["artifact", "verify", str(other), "--adapter-id", record.adapter_id, "--version", "1"]
    )
    assert mismatch.exit_code == 1
    assert mismatch.output.split()[0] == "manifest_digest_mismatch"
    unknown = runner.invoke(
        app,
        ["artifact", "verify", str(adapter), "--adapter-id", record.adapter_id, "--version", "2"],
    )
    assert unknown.exit_code == 2
