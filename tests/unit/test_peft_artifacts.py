"""Adapters as PEFT's ``save_pretrained`` writes them verify, publish and serve.

The folder holds the exact files PEFT 0.21.2 wrote for the tiny Llama (tests/data/peft-0.21.2:
its model card and its full adapter_config.json) with weights in PEFT's layout. The real
PEFT, torch and vLLM run in tests/integration/test_peft_adapters.py.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from typer.testing import CliRunner

from loraplane.artifact.directory import DirectoryArtifact
from loraplane.artifact.inert_files import MAX_INERT_BYTES
from loraplane.artifact.lora_config import (
    HARMLESS,
    MUST_BE_OFF,
    VALIDATED,
    Unservable,
    parse_lora_config,
)
from loraplane.artifact.model_shape import ModelShape
from loraplane.artifact.verification import (
    CONFIG_NAME,
    MANIFEST_NAME,
    WEIGHTS_NAME,
    WorkerLimits,
    verify_artifact,
)
from loraplane.artifact_publish import ArtifactError, PublishRequest, build_record
from loraplane.cli import app
from loraplane.kernel.config import Settings
from loraplane.schemas.adapter import Priority
from loraplane.schemas.manifest import InertKind, Manifest, ManifestFile
from loraplane.schemas.reasons import ArtifactReason as Reason
from loraplane.tiny_model import TinyLlama, build_adapter

ROOT = Path(__file__).resolve().parents[2]
PEFT_FILES = ROOT / "tests/data/peft-0.21.2"
PEFT_CONFIG: dict[str, Any] = json.loads((PEFT_FILES / CONFIG_NAME).read_text())
TRAINED_FROM = "/models/tiny-llama"  # what PEFT records: the folder the trainer loaded
ALIASES = {
    TRAINED_FROM: "tiny-llama",
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3-1-8b",
    "acme/tiny-llama-hub": "tiny-llama",
}
MODEL = ModelShape.from_hf_config(TinyLlama().hf_config(1000))
RELEASE = PublishRequest("chat", "acme", "tiny-llama", "1", Priority.silver)
VLLM_PEFT_HELPER = ROOT / ".venv-vllm/lib/python3.11/site-packages/vllm/lora/peft_helper.py"


def peft_folder(
    folder: Path,
    *,
    seed: int = 1,
    base: str = TRAINED_FROM,
    model_config: dict[str, Any] | None = None,
    **config: Any,
) -> Path:
    """README.md, adapter_config.json and adapter_model.safetensors, as PEFT writes them."""
    build_adapter(
        folder,
        seed=seed,
        rank=PEFT_CONFIG["r"],
        target_modules=PEFT_CONFIG["target_modules"],
        model_config=model_config,
    )
    (folder / CONFIG_NAME).write_text(
        json.dumps(
            {**PEFT_CONFIG, "base_model_name_or_path": base, **config}, indent=2, sort_keys=True
        )
    )
    shutil.copy(PEFT_FILES / "README.md", folder / "README.md")
    return folder


def publish(
    folder: Path, aliases: dict[str, str] | None = None, model: ModelShape | None = MODEL
) -> tuple[Any, Manifest]:
    return build_record(
        folder,
        RELEASE,
        "bucket",
        base_model_aliases=ALIASES if aliases is None else aliases,
        model=model,
    )


def uploaded(folder: Path, manifest: Manifest, dest: Path) -> Path:
    """What lands on S3: the manifest's files and the manifest, nothing else."""
    dest.mkdir()
    for f in manifest.files:
        shutil.copy(folder / f.path, dest / f.path)
    (dest / MANIFEST_NAME).write_bytes(manifest.canonical_bytes())
    return dest


def worker_limits(aliases: dict[str, str] = ALIASES) -> WorkerLimits:
    return WorkerLimits(
        base_model="tiny-llama", max_lora_rank=8, model=MODEL, base_model_aliases=aliases
    )


# ---- what PEFT writes publishes, and a worker accepts what was uploaded --------------------
def test_a_peft_folder_publishes_without_its_model_card(tmp_path: Path) -> None:
    folder = peft_folder(tmp_path / "peft")
    record, manifest = publish(folder)
    assert [f.path for f in manifest.files] == [CONFIG_NAME, WEIGHTS_NAME]
    assert [(d.path, d.kind, d.size) for d in manifest.dropped] == [
        ("README.md", InertKind.model_card, (folder / "README.md").stat().st_size)
    ]
    assert record.rank == PEFT_CONFIG["r"] and record.size_bytes == manifest.total_size
    s3 = uploaded(folder, manifest, tmp_path / "s3")
    verdict = verify_artifact(DirectoryArtifact(s3), worker_limits(), record)
    assert verdict.ok, verdict.refusals


def test_a_hub_id_and_a_path_with_a_slash_resolve_through_the_aliases(tmp_path: Path) -> None:
    hub = peft_folder(tmp_path / "hub", base="acme/tiny-llama-hub")
    slash = peft_folder(tmp_path / "slash", base=TRAINED_FROM + "/")
    assert publish(hub)[0].base_model == publish(slash)[0].base_model == "tiny-llama"


def test_the_worker_needs_the_same_aliases(tmp_path: Path) -> None:
    folder = peft_folder(tmp_path / "peft")
    record, manifest = publish(folder)
    s3 = uploaded(folder, manifest, tmp_path / "s3")
    verdict = verify_artifact(DirectoryArtifact(s3), worker_limits({}), record)
    assert verdict.reasons == (Reason.base_model_mismatch,)
    assert f"{TRAINED_FROM!r} != 'tiny-llama'" in verdict.refusals[0].detail


def test_a_model_card_on_the_store_is_still_refused_by_the_worker(tmp_path: Path) -> None:
    folder = peft_folder(tmp_path / "peft")
    record, manifest = publish(folder)
    s3 = uploaded(folder, manifest, tmp_path / "s3")
    shutil.copy(folder / "README.md", s3 / "README.md")  # smuggled in beside the upload
    reasons = verify_artifact(DirectoryArtifact(s3), worker_limits(), record).reasons
    assert {Reason.disallowed_file, Reason.file_not_in_manifest} <= set(reasons)


def test_verify_checks_a_folder_without_a_manifest_as_publish_would(tmp_path: Path) -> None:
    folder = peft_folder(tmp_path / "peft", base="tiny-llama")
    runner = CliRunner()
    ok = runner.invoke(
        app, ["artifact", "verify", str(folder), "--base-model", "tiny-llama", "--max-rank", "8"]
    )
    assert ok.exit_code == 0, ok.output
    assert ok.stdout.startswith("ok: every file check passed; no digest is pinned yet")
    assert "publish drops README.md (model_card)" in ok.stderr
    (folder / "checkpoint-1").mkdir()  # a stray folder, even empty, is refused by name
    empty = runner.invoke(app, ["artifact", "verify", str(folder)])
    assert empty.exit_code == 1
    assert empty.stdout.split()[:2] == ["disallowed_file", "checkpoint-1:"]
    (folder / "checkpoint-1").rmdir()
    (folder / "train.py").write_text("import os\n")
    refused = runner.invoke(app, ["artifact", "verify", str(folder)])
    assert refused.exit_code == 1
    assert refused.stdout.split()[:2] == ["disallowed_file", "train.py:"]


# ---- base model: names through the aliases, claims through the shapes ------------------------
def test_without_an_alias_the_trainers_path_is_refused_with_both_names(tmp_path: Path) -> None:
    with pytest.raises(
        ArtifactError,
        match=r"base_model_mismatch adapter_config\.json "
        rf"\('{TRAINED_FROM}' != 'tiny-llama'\)",
    ):
        publish(peft_folder(tmp_path / "peft"), aliases={})


def test_an_alias_to_another_base_model_is_refused(tmp_path: Path) -> None:
    folder = peft_folder(tmp_path / "peft", base="meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises(
        ArtifactError,
        match=r"'meta-llama/Llama-3.1-8B-Instruct' \(alias of "
        r"'llama-3-1-8b'\) != 'tiny-llama'",
    ):
        publish(folder)


def test_a_wrong_alias_is_caught_by_the_shapes(tmp_path: Path) -> None:
    """An alias claims the adapter is for tiny-llama; its weights were made for a wider model."""
    wider = TinyLlama(hidden_size=256).hf_config(1000)
    folder = peft_folder(tmp_path / "peft", model_config=wider)
    with pytest.raises(ArtifactError, match=r"tensor_shape_mismatch .*\[8, 256\] \(r=8\)"):
        publish(folder)
    publish(folder, model=None)  # without the base model's shapes, only the name is checked


# ---- inert extras are dropped; code, pickles, links and folders are refused -----------------
@pytest.mark.parametrize(
    "name, content, words",
    [
        ("modeling_lora.py", b"import os\n", r"disallowed_file modeling_lora\.py"),
        ("training_args.bin", b"\x80\x04", r"pickle_weights training_args\.bin"),
        ("optimizer.pt", b"\x80\x04", r"pickle_weights optimizer\.pt"),
        ("state.pkl", b"\x80\x04", r"pickle_weights state\.pkl"),
        ("sub/README.md", b"# card\n", r"folders are never part of an artifact\): sub$"),
        ("README.md.py", b"print()\n", r"disallowed_file README\.md\.py"),
        ("readme.md", b"# card\n", r"disallowed_file readme\.md"),
    ],
)
def test_an_extra_that_is_not_inert_is_refused(
    tmp_path: Path, name: str, content: bytes, words: str
) -> None:
    folder = peft_folder(tmp_path / "peft")
    (folder / name).parent.mkdir(exist_ok=True)
    (folder / name).write_bytes(content)
    with pytest.raises(ArtifactError, match=words):
        publish(folder)


def test_a_huge_model_card_is_refused_with_both_sizes(tmp_path: Path) -> None:
    folder = peft_folder(tmp_path / "peft")
    (folder / "README.md").write_bytes(b"x" * (MAX_INERT_BYTES + 1))
    with pytest.raises(
        ArtifactError,
        match=rf"too_large README\.md \({MAX_INERT_BYTES + 1} "
        rf"bytes > {MAX_INERT_BYTES} for a model card\)",
    ):
        publish(folder)


def test_a_linked_or_folder_model_card_is_never_followed(tmp_path: Path) -> None:
    linked = peft_folder(tmp_path / "linked")
    (linked / "README.md").unlink()
    os.symlink("/etc/passwd", linked / "README.md")
    with pytest.raises(ArtifactError, match="links are never followed"):
        publish(linked)
    folder = peft_folder(tmp_path / "folder")
    (folder / "README.md").unlink()
    (folder / "README.md").mkdir()
    (folder / "README.md" / "x.safetensors").write_bytes(b"")
    with pytest.raises(
        ArtifactError, match=r"folders are never part of an artifact\): README\.md$"
    ):
        publish(folder)


extra_names = st.sampled_from(
    [
        "README.md",
        "notes.txt",
        "train.py",
        "adapter_model.bin",
        "rng_state.pth",
        "tokenizer.json",
        "sub/README.md",
        ".hidden",
        "extra.safetensors",
    ]
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    extras=st.lists(extra_names, unique=True, max_size=3),
    card_size=st.sampled_from([0, 10, MAX_INERT_BYTES, MAX_INERT_BYTES + 1]),
)
def test_only_safetensors_and_the_config_are_ever_uploaded(
    tmp_path_factory: pytest.TempPathFactory, extras: list[str], card_size: int
) -> None:
    folder = peft_folder(tmp_path_factory.mktemp("fuzz") / "peft")
    (folder / "README.md").write_bytes(b"#" * card_size)
    for name in extras:
        if name == "extra.safetensors":
            shutil.copy(folder / WEIGHTS_NAME, folder / name)  # a valid second weights file
        elif name != "README.md":
            (folder / name).parent.mkdir(exist_ok=True)
            (folder / name).write_bytes(b"\x80\x04 x")
    publishable = card_size <= MAX_INERT_BYTES and set(extras) <= {"README.md"}
    try:
        _, manifest = publish(folder)
    except ArtifactError:
        assert not publishable
        return
    assert publishable
    assert {f.path for f in manifest.files} == {CONFIG_NAME, WEIGHTS_NAME}
    assert [d.path for d in manifest.dropped] == ["README.md"]


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(b"[" * 100_000, id="nested-past-the-recursion-limit"),
        pytest.param(b'{"r": 8, "r": 2}', id="duplicate-key"),
        pytest.param(b'{"r": NaN}', id="nan"),
        pytest.param(b'{"r": 8' + b" " * 300_000 + b"}", id="over-the-size-cap"),
    ],
)
def test_a_hostile_adapter_config_is_a_publish_refusal_not_a_crash(
    config: bytes, tmp_path: Path
) -> None:
    """Publish reads the config as a worker will (strict JSON): what a worker would refuse
    is refused at publish with a message, never an exception of another kind."""
    folder = peft_folder(tmp_path / "peft")
    (folder / CONFIG_NAME).write_bytes(config)
    with pytest.raises(ArtifactError):
        publish(folder)


# ---- adapter_config.json: every field PEFT writes has a rule -------------------------------
def test_every_field_peft_writes_is_ruled_and_its_defaults_parse() -> None:
    assert set(PEFT_CONFIG) <= VALIDATED | HARMLESS | set(MUST_BE_OFF)
    config = parse_lora_config(PEFT_CONFIG)
    assert (config.rank, config.target_modules) == (8, frozenset({"q_proj", "v_proj"}))


@pytest.mark.parametrize(
    "key, value",
    [
        ("use_dora", True),
        ("lora_bias", True),
        ("modules_to_save", ["lm_head"]),
        ("rank_pattern", {"q_proj": 2}),
        ("alpha_pattern", {"q_proj": 4.0}),
        ("layers_to_transform", [0]),
        ("layer_replication", [[0, 1]]),
        ("alora_invocation_tokens", [5, 6]),
        ("use_bdlora", {"nblocks": 2}),
        ("use_qalora", True),
        ("trainable_token_indices", [3]),
        ("target_parameters", ["experts.gate_up_proj"]),
        ("fan_in_fan_out", True),
        ("arrow_config", {"top_k": 2}),
        ("kasa_config", {"beta": 1}),
        ("monteclora_config", {"n": 1}),
        ("use_fancy_new_thing", True),
    ],
)
def test_a_feature_vllm_cannot_serve_is_refused_naming_field_and_value(
    key: str, value: Any
) -> None:
    why = MUST_BE_OFF.get(key, Unservable.unknown_feature)
    with pytest.raises(ValueError) as err:
        parse_lora_config({**PEFT_CONFIG, key: value})
    assert str(err.value).startswith(f"{key}={value!r}: {why.value}")


@pytest.mark.parametrize(
    "init, servable",
    [
        (True, True),
        (False, True),
        ("gaussian", True),
        ("eva", True),
        ("orthogonal", True),
        ("pissa", False),
        ("pissa_niter_16", False),
        ("olora", False),
        ("loftq", False),
        ("corda", False),
    ],
)
def test_only_inits_that_leave_the_base_weights_alone_are_served(
    init: bool | str, servable: bool
) -> None:
    raw = {**PEFT_CONFIG, "init_lora_weights": init}
    if servable:
        parse_lora_config(raw)
    else:
        with pytest.raises(ValueError, match=f"init_lora_weights {init!r} changes the base"):
            parse_lora_config(raw)


@pytest.mark.parametrize("alpha", [1e308, -1e308, 65504.5, 2**70])
def test_an_alpha_that_overflows_the_serving_dtype_is_refused(alpha: float) -> None:
    """ATTACK: a finite alpha past fp16's range: vLLM scales the weights by alpha / r in the
    serving dtype, so the adapter's weights become inf and its answers NaN."""
    with pytest.raises(ValueError, match="lora_alpha must be within"):
        parse_lora_config({**PEFT_CONFIG, "lora_alpha": alpha})
    parse_lora_config({**PEFT_CONFIG, "lora_alpha": 65504})


off_values = st.sampled_from([None, False, 0, "", [], {}])


@settings(max_examples=100, deadline=None)
@given(
    extra=st.dictionaries(
        st.from_regex(r"[a-z][a-z_]{0,20}", fullmatch=True), off_values, max_size=5
    ),
    harmless=st.dictionaries(
        st.sampled_from(sorted(HARMLESS)),
        st.none() | st.booleans() | st.integers(0, 9) | st.text(max_size=8),
        max_size=4,
    ),
)
def test_fields_that_are_off_or_harmless_never_refuse(
    extra: dict[str, Any], harmless: dict[str, Any]
) -> None:
    keep = {k: v for k, v in extra.items() if k not in VALIDATED}
    parse_lora_config({**PEFT_CONFIG, **keep, **harmless})


@pytest.mark.skipif(
    not VLLM_PEFT_HELPER.is_file(),
    reason="vLLM is not installed (.venv-vllm, skipped with LORAPLANE_SKIP_VLLM=1)",
)
def test_every_feature_vllm_refuses_is_refused_here() -> None:
    """The fields vLLM 0.32's PEFTHelper._validate_features reads are all ruled by us."""
    tree = ast.parse(VLLM_PEFT_HELPER.read_text())
    validate = next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == "_validate_features"
    )
    read = {
        node.attr
        for node in ast.walk(validate)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and not node.attr.startswith("_")
    }
    assert read and read <= set(MUST_BE_OFF) | {"init_lora_weights"}


# ---- where the aliases and the dropped list live -----------------------------------------
def test_aliases_come_from_the_settings_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "loraplane.yaml").write_text(f"base_model_aliases:\n  {TRAINED_FROM}: tiny-llama\n")
    monkeypatch.setenv("LORAPLANE_CONFIG", str(tmp_path / "loraplane.yaml"))
    assert Settings().base_model_aliases == {TRAINED_FROM: "tiny-llama"}
    (tmp_path / "loraplane.yaml").write_text("base_model_aliases:\n  a/b: Not/An-Id\n")
    with pytest.raises(ValueError, match="base_model_aliases"):
        Settings()


def test_a_manifest_with_nothing_dropped_keeps_its_bytes() -> None:
    files = [ManifestFile(path=CONFIG_NAME, sha256="0" * 64, size=1)]
    manifest = Manifest(files=files)
    assert json.loads(manifest.canonical_bytes()) == {
        "files": [{"path": CONFIG_NAME, "sha256": "0" * 64, "size": 1}],
        "format": "loraplane.manifest.v1",
    }
    with pytest.raises(ValueError, match="kept and dropped at once"):
        Manifest(
            files=files,
            dropped=[{"path": CONFIG_NAME, "sha256": "0" * 64, "size": 1, "kind": "model_card"}],
        )
