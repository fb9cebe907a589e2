"""A corpus of hostile artifacts: each must be refused with its own reason, none passes.

Each case starts from a good tiny-llama adapter, changes it either before it is published
(the manifest and the record then describe the hostile bytes faithfully: the signature is
fine, the content is not) or after (tampering on the way), and names the reason expected.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from safetensors.numpy import load_file, save_file

from loraplane.tiny_model import TinyLlama, build_adapter
from schemas.adapter import AdapterRecord
from schemas.manifest import Manifest, ManifestFile
from workers.artifact_dir import DirectoryArtifact
from workers.model_shape import ModelShape
from workers.refusal import Reason
from workers.verification import (
    CONFIG_NAME,
    MANIFEST_NAME,
    WEIGHTS_NAME,
    FileFacts,
    WorkerLimits,
    verify_artifact,
)

MODEL = ModelShape.from_hf_config(TinyLlama().hf_config(1000))
LIMITS = WorkerLimits(base_model="tiny-llama", max_lora_rank=8, model=MODEL)
PREFIX = "base_model.model.model.layers"


def write_manifest(folder: Path) -> Manifest:
    """Publish the folder as it is, hostile or not (the real publisher would refuse it)."""
    reader = DirectoryArtifact(folder)
    manifest = Manifest(files=[ManifestFile(path=f.path, sha256=reader.sha256(f.path),
                                            size=f.size)
                               for f in reader.files() if f.path != MANIFEST_NAME])
    (folder / MANIFEST_NAME).write_bytes(manifest.canonical_bytes())
    return manifest


def record_for(manifest: Manifest, **overrides: Any) -> AdapterRecord:
    fields: dict[str, Any] = {
        "adapter_id": "hostile", "base_model": "tiny-llama", "version": "1", "rank": 8,
        "artifact_uri": "s3://loraplane-artifacts/hostile/1/", "sha256": manifest.digest,
        "size_bytes": max(manifest.total_size, 1), "tenant_id": "t1",
        "compatibility": {"target_modules": ["q_proj", "v_proj"], "max_lora_rank": 8},
    }
    fields.update(overrides)
    return AdapterRecord.model_validate(fields)


@pytest.fixture(scope="module")
def good_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_adapter(tmp_path_factory.mktemp("good") / "adapter", seed=7)


# ---- helpers that forge hostile content -----------------------------------------------------
def edit_config(**changes: Any) -> Callable[[Path], None]:
    def run(folder: Path) -> None:
        config = json.loads((folder / CONFIG_NAME).read_text())
        config.update(changes)
        (folder / CONFIG_NAME).write_text(json.dumps(config))
    return run


def edit_tensors(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def run(folder: Path) -> None:
        tensors = load_file(str(folder / WEIGHTS_NAME))
        change(tensors)
        save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    return run


def raw_weights(header: Any, data: bytes = b"",
                length: int | None = None) -> Callable[[Path], None]:
    """Write a safetensors file with any header, even one that lies about its length."""
    def run(folder: Path) -> None:
        body = header if isinstance(header, bytes) else json.dumps(header).encode()
        n = len(body) if length is None else length
        (folder / WEIGHTS_NAME).write_bytes(struct.pack("<Q", n) + body + data)
    return run


def add_file(name: str, content: bytes = b"x") -> Callable[[Path], None]:
    def run(folder: Path) -> None:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)
    return run


def remove_file(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).unlink()


def rename_file(old: str, new: str) -> Callable[[Path], None]:
    return lambda folder: (folder / old).rename(folder / new)


def symlink(name: str, target: str) -> Callable[[Path], None]:
    return lambda folder: os.symlink(target, folder / name)


def manifest_path(path: str) -> Callable[[Path], None]:
    """A manifest that names ``path`` (written raw: the schema would refuse it)."""
    def run(folder: Path) -> None:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        manifest["files"].append({"path": path, "sha256": "0" * 64, "size": 1})
        (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    return run


def flip_last_byte(folder: Path) -> None:
    data = bytearray((folder / WEIGHTS_NAME).read_bytes())
    data[-1] ^= 0xFF
    (folder / WEIGHTS_NAME).write_bytes(bytes(data))


def one_tensor(name: str, dtype: str = "F32", shape: Sequence[int] = (8, 128),
               offsets: Sequence[int] | None = None) -> Callable[[Path], None]:
    size = 4 * 8 * 128
    return raw_weights({name: {"dtype": dtype, "shape": list(shape),
                               "data_offsets": list(offsets or (0, size))}}, b"\0" * size)


def drop(name: str) -> Callable[[dict[str, Any]], None]:
    return lambda tensors: tensors.pop(name)


def add_lora(module: str, rank: int = 8, in_features: int = 128,
             out_features: int = 128) -> Callable[[dict[str, Any]], None]:
    import numpy as np

    def run(tensors: dict[str, Any]) -> None:
        for layer in range(2):
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            site = f"{PREFIX}.{layer}.{block}.{module}"
            tensors[f"{site}.lora_A.weight"] = np.ones((rank, in_features), np.float32)
            tensors[f"{site}.lora_B.weight"] = np.ones((out_features, rank), np.float32)
    return run


@dataclass
class Case:
    id: str
    reason: Reason
    before: Sequence[Callable[[Path], None]] = ()  # published as is: manifest + record match
    after: Sequence[Callable[[Path], None]] = ()  # tampering after publication
    record: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)


CASES = [
    Case("manifest missing", Reason.manifest_missing, after=[remove_file(MANIFEST_NAME)]),
    Case("manifest garbage", Reason.manifest_invalid, after=[add_file(MANIFEST_NAME, b"{nope")]),
    Case("manifest schema", Reason.manifest_invalid,
         after=[add_file(MANIFEST_NAME, b'{"format": "other", "files": []}')]),
    Case("digest mismatch", Reason.manifest_digest_mismatch, record={"sha256": "ab" * 32}),
    Case("file missing", Reason.file_missing, before=[add_file("extra.safetensors")],
         after=[remove_file("extra.safetensors")]),
    Case("file not in manifest", Reason.file_not_in_manifest,
         after=[add_file("smuggled.safetensors")]),
    Case("wrong size", Reason.size_mismatch, after=[
        lambda f: (f / WEIGHTS_NAME).write_bytes((f / WEIGHTS_NAME).read_bytes() + b"\0")]),
    Case("tampered byte", Reason.sha256_mismatch, after=[flip_last_byte]),
    Case("too large total", Reason.too_large, limits={"max_total_bytes": 10_000}),
    Case("dot-dot path", Reason.unsafe_path, after=[manifest_path("../escape.safetensors")]),
    Case("absolute path", Reason.unsafe_path, after=[manifest_path("/etc/passwd")]),
    Case("symlink", Reason.symlink, after=[symlink("link.safetensors", "/etc/passwd")]),
    Case("pickle bin", Reason.pickle_weights, before=[add_file("adapter_model.bin", b"\x80\x04")]),
    Case("pickle pt", Reason.pickle_weights, before=[add_file("weights.pt", b"\x80\x04")]),
    Case("readme", Reason.disallowed_file, before=[add_file("README.md")]),
    Case("nested", Reason.disallowed_file, after=[add_file("sub/more.safetensors")]),
    Case("config missing", Reason.config_missing, before=[remove_file(CONFIG_NAME)]),
    Case("config not lora", Reason.config_invalid, before=[edit_config(peft_type="PREFIX")]),
    Case("config dora", Reason.config_invalid, before=[edit_config(use_dora=True)]),
    Case("config regex modules", Reason.config_invalid,
         before=[edit_config(target_modules="all-linear")]),
    Case("config modules_to_save", Reason.config_invalid,
         before=[edit_config(modules_to_save=["lm_head"])]),
    Case("rank too high", Reason.rank_too_high, limits={"max_lora_rank": 4}),
    Case("record rank differs", Reason.record_mismatch,
         record={"rank": 4, "compatibility": {"target_modules": ["q_proj", "v_proj"],
                                              "max_lora_rank": 8}}),
    Case("record modules differ", Reason.record_mismatch,
         record={"compatibility": {"target_modules": ["q_proj"], "max_lora_rank": 8}}),
    Case("worker base model", Reason.base_model_mismatch, limits={"base_model": "llama-3-8b"}),
    Case("config base model", Reason.base_model_mismatch,
         before=[edit_config(base_model_name_or_path="meta-llama/Other")]),
    Case("record base model", Reason.base_model_mismatch, record={"base_model": "other"}),
    Case("weights missing", Reason.weights_missing,
         before=[rename_file(WEIGHTS_NAME, "other.safetensors")]),
    Case("header claims gigabytes", Reason.header_too_large,
         before=[raw_weights(b"{}", length=8 * 1024**3)]),
    Case("header too short", Reason.header_invalid, before=[add_file(WEIGHTS_NAME, b"\x01\x02")]),
    Case("header not json", Reason.header_invalid, before=[raw_weights(b"\xff\xfe not json")]),
    Case("header a list", Reason.header_invalid, before=[raw_weights([1, 2, 3])]),
    Case("dtype int", Reason.tensor_dtype_invalid,
         before=[one_tensor(f"{PREFIX}.0.self_attn.q_proj.lora_A.weight", dtype="I32")]),
    Case("offsets outside", Reason.tensor_offsets_invalid,
         before=[one_tensor(f"{PREFIX}.0.self_attn.q_proj.lora_A.weight",
                            offsets=(0, 10**9))]),
    Case("offsets overlap", Reason.tensor_offsets_invalid, before=[raw_weights({
        f"{PREFIX}.0.self_attn.q_proj.lora_A.weight":
            {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        f"{PREFIX}.0.self_attn.q_proj.lora_B.weight":
            {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12)]),
    Case("offsets disagree with shape", Reason.tensor_offsets_invalid,
         before=[one_tensor(f"{PREFIX}.0.self_attn.q_proj.lora_A.weight", shape=(8, 64))]),
    Case("base weight smuggled", Reason.tensor_name_invalid, before=[edit_tensors(
        lambda t: t.__setitem__("model.embed_tokens.weight", t[next(iter(t))]))]),
    Case("shape not rank", Reason.tensor_shape_mismatch, before=[edit_tensors(
        lambda t: t.__setitem__(f"{PREFIX}.0.self_attn.q_proj.lora_A.weight",
                                t[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"][:4]))]),
    Case("shape not model", Reason.tensor_shape_mismatch,
         before=[edit_tensors(drop(f"{PREFIX}.0.self_attn.v_proj.lora_B.weight")),
                 edit_tensors(add_lora("v_proj", out_features=64))]),
    Case("module outside targets", Reason.module_not_targeted,
         before=[edit_tensors(add_lora("k_proj"))]),
    Case("module the model lacks", Reason.module_not_in_model,
         before=[edit_config(target_modules=["q_proj", "v_proj", "foo_proj"]),
                 edit_tensors(add_lora("foo_proj"))],
         record={"compatibility": {"target_modules": ["q_proj", "v_proj", "foo_proj"],
                                   "max_lora_rank": 8}}),
    Case("target without weights", Reason.target_module_missing,
         before=[edit_config(target_modules=["q_proj", "v_proj", "k_proj"])],
         record={"compatibility": {"target_modules": ["q_proj", "v_proj", "k_proj"],
                                   "max_lora_rank": 8}}),
    Case("half a pair", Reason.lora_pair_incomplete,
         before=[edit_tensors(drop(f"{PREFIX}.1.self_attn.q_proj.lora_B.weight"))]),
]


def hostile(case: Case, good: Path, tmp_path: Path) -> tuple[DirectoryArtifact, AdapterRecord]:
    folder = tmp_path / "artifact"
    shutil.copytree(good, folder)
    for change in case.before:
        change(folder)
    record = record_for(write_manifest(folder), **case.record)
    for change in case.after:
        change(folder)
    return DirectoryArtifact(folder), record


def test_the_good_adapter_passes(good_adapter: Path, tmp_path: Path) -> None:
    artifact, record = hostile(Case("none", Reason.fetch_failed), good_adapter, tmp_path)
    verdict = verify_artifact(artifact, LIMITS, record)
    assert verdict.ok, verdict.refusals


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_artifact_is_refused_with_its_reason(case: Case, good_adapter: Path,
                                                     tmp_path: Path) -> None:
    artifact, record = hostile(case, good_adapter, tmp_path)
    limits = WorkerLimits(**{**LIMITS.__dict__, **case.limits})
    verdict = verify_artifact(artifact, limits, record)
    assert not verdict.ok
    assert case.reason in verdict.reasons, verdict.refusals


def test_every_content_reason_has_a_hostile_case() -> None:
    covered = {c.reason for c in CASES}
    io_or_policy = {Reason.source_not_allowed, Reason.artifact_store_unavailable,
                    Reason.fetch_failed, Reason.adapter_revoked, Reason.host_budget_exceeded,
                    Reason.host_io_error}  # covered by the fetch and host-tier tests
    assert set(Reason) - io_or_policy - covered == set()


def test_a_header_claiming_gigabytes_is_refused_after_reading_8_bytes(
        good_adapter: Path, tmp_path: Path) -> None:
    artifact, record = hostile(CASES[[c.id for c in CASES].index("header claims gigabytes")],
                               good_adapter, tmp_path)
    reads: list[tuple[str, int]] = []
    original = artifact.read

    def spy(path: str, offset: int, length: int) -> bytes:
        reads.append((path, length))
        return original(path, offset, length)

    artifact.read = spy  # type: ignore[method-assign]
    assert Reason.header_too_large in verify_artifact(artifact, LIMITS, record).reasons
    assert [length for path, length in reads if path == WEIGHTS_NAME] == [8]


def test_several_reasons_are_reported_at_once(good_adapter: Path, tmp_path: Path) -> None:
    case = Case("many", Reason.pickle_weights, before=[add_file("x.pkl")],
                after=[flip_last_byte, symlink("l.safetensors", "x.pkl")],
                limits={"max_lora_rank": 1})
    artifact, record = hostile(case, good_adapter, tmp_path)
    verdict = verify_artifact(artifact, WorkerLimits(**{**LIMITS.__dict__, **case.limits}),
                              record)
    assert {Reason.pickle_weights, Reason.sha256_mismatch, Reason.symlink,
            Reason.rank_too_high} <= set(verdict.reasons)


def test_without_a_record_the_folder_is_checked_on_its_own(good_adapter: Path,
                                                           tmp_path: Path) -> None:
    folder = shutil.copytree(good_adapter, tmp_path / "a")
    write_manifest(folder)
    offline = WorkerLimits(base_model=None, max_lora_rank=512)
    assert verify_artifact(DirectoryArtifact(folder), offline).ok


# ---- property tests: arbitrary bytes only ever produce refusals ------------------------------
class MemoryArtifact:
    def __init__(self, files: dict[str, bytes]) -> None:
        self.data = files

    def files(self) -> list[FileFacts]:
        return [FileFacts(p, "file", len(b)) for p, b in self.data.items()]

    def read(self, path: str, offset: int, length: int) -> bytes:
        return self.data[path][offset:offset + length]

    def sha256(self, path: str) -> str:
        import hashlib

        return hashlib.sha256(self.data[path]).hexdigest()


@pytest.fixture(scope="module")
def good_files(good_adapter: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in good_adapter.iterdir() if p.name != MANIFEST_NAME}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=30)
    | st.sampled_from(["F32", "BF16", "I8", "LORA", "q_proj", "v_proj", "tiny-llama"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=40), inner,
                                                                 max_size=5),
    max_leaves=20)
tensor_names = st.sampled_from([f"{PREFIX}.0.self_attn.q_proj.lora_A.weight",
                                f"{PREFIX}.1.self_attn.v_proj.lora_B.weight",
                                f"{PREFIX}.9.mlp.down_proj.lora_A.weight", "__metadata__",
                                "base_model.model.x.lora_A.weight", "lm_head.weight"])
tensor_entries = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "bogus"]),
    "shape": st.lists(st.integers(-1, 300), max_size=3),
    "data_offsets": st.lists(st.integers(-5, 5000), min_size=0, max_size=3)})
headers = st.dictionaries(tensor_names, tensor_entries | json_values, max_size=6)
fuzz = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def check(files: dict[str, bytes], limits: WorkerLimits = LIMITS) -> None:
    verdict = verify_artifact(MemoryArtifact(files), limits)  # never raises
    assert all(isinstance(r.reason, Reason) for r in verdict.refusals)


@fuzz
@given(data=st.binary(max_size=300))
def test_random_weight_bytes_never_raise(good_files: dict[str, bytes], data: bytes) -> None:
    check({**good_files, WEIGHTS_NAME: data})


@fuzz
@given(header=headers, data=st.binary(max_size=64), length_delta=st.integers(-3, 3))
def test_random_headers_never_raise(good_files: dict[str, bytes], header: dict[str, Any],
                                    data: bytes, length_delta: int) -> None:
    body = json.dumps(header).encode()
    check({**good_files,
           WEIGHTS_NAME: struct.pack("<Q", max(0, len(body) + length_delta)) + body + data})


@fuzz
@given(config=st.dictionaries(st.sampled_from(["r", "lora_alpha", "target_modules", "peft_type",
                                               "base_model_name_or_path", "use_dora", "bias",
                                               "rank_pattern"]), json_values, max_size=8))
def test_random_configs_never_raise(good_files: dict[str, bytes], config: dict[str, Any]) -> None:
    check({**good_files, CONFIG_NAME: json.dumps(config).encode()})


@fuzz
@given(manifest=json_values, mutation=st.binary(min_size=1, max_size=4),
       position=st.integers(0, 10**6))
def test_mutated_artifacts_with_a_manifest_never_raise_and_never_pass(
        good_files: dict[str, bytes], manifest: Any, mutation: bytes, position: int) -> None:
    weights = bytearray(good_files[WEIGHTS_NAME])
    at = position % len(weights)
    original = bytes(weights[at:at + len(mutation)])
    weights[at:at + len(mutation)] = mutation
    files = {**good_files, MANIFEST_NAME: json.dumps(manifest).encode(),
             WEIGHTS_NAME: bytes(weights)}
    check(files)
    if bytes(weights[at:at + len(mutation)]) != original:
        # a valid manifest of the good files: the flipped bytes must be caught
        from schemas.manifest import Manifest, ManifestFile

        good = Manifest(files=[ManifestFile(path=p, sha256=MemoryArtifact(good_files).sha256(p),
                                            size=len(b)) for p, b in good_files.items()])
        files[MANIFEST_NAME] = good.canonical_bytes()
        assert not verify_artifact(MemoryArtifact(files), LIMITS).ok
