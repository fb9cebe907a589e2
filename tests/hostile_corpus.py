"""A corpus of hostile artifacts, shared by the verifier's unit tests and the worker's
end-to-end test: each must be refused with its own reason, none may reach vLLM.

Each case starts from a good tiny-llama adapter, changes it either before it is published
(the manifest and the record then describe the hostile bytes faithfully: the signature is
fine, the content is not) or after (tampering on the way), and names the reason expected.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.numpy import load_file, save_file

from loraplane.artifact.directory import DirectoryArtifact
from loraplane.artifact.model_shape import ModelShape
from loraplane.artifact.verification import (
    CONFIG_NAME,
    MANIFEST_NAME,
    WEIGHTS_NAME,
    WorkerLimits,
    record_size_bytes,
)
from loraplane.schemas.adapter import AdapterRecord
from loraplane.schemas.manifest import Manifest, ManifestFile
from loraplane.schemas.reasons import ArtifactReason as Reason
from loraplane.tiny_model import TinyLlama

MODEL = ModelShape.from_hf_config(TinyLlama().hf_config(1000))
LIMITS = WorkerLimits(base_model="tiny-llama", max_lora_rank=8, model=MODEL)
PREFIX = "base_model.model.model.layers"


def write_manifest(folder: Path) -> Manifest:
    """Publish the folder as it is, hostile or not (the real publisher would refuse it)."""
    reader = DirectoryArtifact(folder)
    manifest = Manifest(
        files=[
            ManifestFile(path=f.path, sha256=reader.sha256(f.path), size=f.size)
            for f in reader.files()
            if f.path != MANIFEST_NAME
        ]
    )
    (folder / MANIFEST_NAME).write_bytes(manifest.canonical_bytes())
    return manifest


def record_for(manifest: Manifest, **overrides: Any) -> AdapterRecord:
    fields: dict[str, Any] = {
        "adapter_id": "hostile",
        "base_model": "tiny-llama",
        "version": "1",
        "rank": 8,
        "artifact_uri": "s3://loraplane-artifacts/hostile/1/",
        "sha256": manifest.digest,
        "size_bytes": record_size_bytes(manifest),
        "tenant_id": "t1",
        "compatibility": {"target_modules": ["q_proj", "v_proj"], "max_lora_rank": 8},
    }
    fields.update(overrides)
    return AdapterRecord.model_validate(fields)


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


def raw_weights(
    header: Any, data: bytes = b"", length: int | None = None
) -> Callable[[Path], None]:
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


def one_tensor(
    name: str,
    dtype: str = "F32",
    shape: Sequence[int] = (8, 128),
    offsets: Sequence[int] | None = None,
) -> Callable[[Path], None]:
    size = 4 * 8 * 128
    return raw_weights(
        {name: {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets or (0, size))}},
        b"\0" * size,
    )


def poison(name: str, value: float) -> Callable[[dict[str, Any]], None]:
    """One value of tensor ``name`` set to ``value`` (a NaN, an infinity, a huge value)."""

    def run(tensors: dict[str, Any]) -> None:
        tensors[name] = tensors[name].copy()
        tensors[name].flat[tensors[name].size // 2] = value

    return run


def drop(name: str) -> Callable[[dict[str, Any]], None]:
    return lambda tensors: tensors.pop(name)


def add_lora(
    module: str, rank: int = 8, in_features: int = 128, out_features: int = 128
) -> Callable[[dict[str, Any]], None]:
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
    Case(
        "manifest schema",
        Reason.manifest_invalid,
        after=[add_file(MANIFEST_NAME, b'{"format": "other", "files": []}')],
    ),
    Case("digest mismatch", Reason.manifest_digest_mismatch, record={"sha256": "ab" * 32}),
    Case(
        "file missing",
        Reason.file_missing,
        before=[add_file("extra.safetensors")],
        after=[remove_file("extra.safetensors")],
    ),
    Case(
        "file not in manifest",
        Reason.file_not_in_manifest,
        after=[add_file("smuggled.safetensors")],
    ),
    Case(
        "wrong size",
        Reason.size_mismatch,
        after=[lambda f: (f / WEIGHTS_NAME).write_bytes((f / WEIGHTS_NAME).read_bytes() + b"\0")],
    ),
    # a signed record that lies about the size the planner places the adapter by
    Case("record size too small", Reason.size_mismatch, record={"size_bytes": 1}),
    Case("record size too large", Reason.size_mismatch, record={"size_bytes": 64 * 1024**3}),
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
    Case(
        "config regex modules",
        Reason.config_invalid,
        before=[edit_config(target_modules="all-linear")],
    ),
    Case(
        "config modules_to_save",
        Reason.config_invalid,
        before=[edit_config(modules_to_save=["lm_head"])],
    ),
    Case("rank too high", Reason.rank_too_high, limits={"max_lora_rank": 4}),
    Case(
        "record rank differs",
        Reason.record_mismatch,
        record={
            "rank": 4,
            "compatibility": {"target_modules": ["q_proj", "v_proj"], "max_lora_rank": 8},
        },
    ),
    Case(
        "record modules differ",
        Reason.record_mismatch,
        record={"compatibility": {"target_modules": ["q_proj"], "max_lora_rank": 8}},
    ),
    Case(
        "bundle the record does not name",
        Reason.record_mismatch,
        before=[add_file("model.sig", b"{}")],
    ),
    Case(
        "bundle added after publish",
        Reason.file_not_in_manifest,
        after=[add_file("model.sig", b"{}")],
    ),
    Case(
        "bundle over 1 MiB",
        Reason.too_large,
        before=[add_file("model.sig", b" " * (1024 * 1024 + 1))],
    ),
    Case("worker base model", Reason.base_model_mismatch, limits={"base_model": "llama-3-8b"}),
    Case(
        "config base model",
        Reason.base_model_mismatch,
        before=[edit_config(base_model_name_or_path="meta-llama/Other")],
    ),
    Case("record base model", Reason.base_model_mismatch, record={"base_model": "other"}),
    Case(
        "weights missing",
        Reason.weights_missing,
        before=[rename_file(WEIGHTS_NAME, "other.safetensors")],
    ),
    Case(
        "header claims gigabytes",
        Reason.header_too_large,
        before=[raw_weights(b"{}", length=8 * 1024**3)],
    ),
    Case("header too short", Reason.header_invalid, before=[add_file(WEIGHTS_NAME, b"\x01\x02")]),
    Case("header not json", Reason.header_invalid, before=[raw_weights(b"\xff\xfe not json")]),
    Case("header a list", Reason.header_invalid, before=[raw_weights([1, 2, 3])]),
    Case(  # each escaped quote once started another scan to the end: hours for 1 MiB
        "header an unclosed string of escaped quotes",
        Reason.header_invalid,
        before=[raw_weights(b'{"a":"' + b'\\"' * 500_000)],
    ),
    Case(
        "dtype int",
        Reason.tensor_dtype_invalid,
        before=[one_tensor(f"{PREFIX}.0.self_attn.q_proj.lora_A.weight", dtype="I32")],
    ),
    Case(
        "offsets outside",
        Reason.tensor_offsets_invalid,
        before=[one_tensor(f"{PREFIX}.0.self_attn.q_proj.lora_A.weight", offsets=(0, 10**9))],
    ),
    Case(
        "offsets overlap",
        Reason.tensor_offsets_invalid,
        before=[
            raw_weights(
                {
                    f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": {
                        "dtype": "F32",
                        "shape": [2],
                        "data_offsets": [0, 8],
                    },
                    f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": {
                        "dtype": "F32",
                        "shape": [2],
                        "data_offsets": [4, 12],
                    },
                },
                b"\0" * 12,
            )
        ],
    ),
    Case(
        "offsets disagree with shape",
        Reason.tensor_offsets_invalid,
        before=[one_tensor(f"{PREFIX}.0.self_attn.q_proj.lora_A.weight", shape=(8, 64))],
    ),
    Case(
        "base weight smuggled",
        Reason.tensor_name_invalid,
        before=[
            edit_tensors(lambda t: t.__setitem__("model.embed_tokens.weight", t[next(iter(t))]))
        ],
    ),
    Case(
        "shape not rank",
        Reason.tensor_shape_mismatch,
        before=[
            edit_tensors(
                lambda t: t.__setitem__(
                    f"{PREFIX}.0.self_attn.q_proj.lora_A.weight",
                    t[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"][:4],
                )
            )
        ],
    ),
    Case(
        "shape not model",
        Reason.tensor_shape_mismatch,
        before=[
            edit_tensors(drop(f"{PREFIX}.0.self_attn.v_proj.lora_B.weight")),
            edit_tensors(add_lora("v_proj", out_features=64)),
        ],
    ),
    Case(  # [r, 5000] for a 128-wide model: vLLM fails it at activation, not at load
        "lora_A wider than the model",
        Reason.tensor_shape_mismatch,
        before=[
            edit_tensors(drop(f"{PREFIX}.0.self_attn.q_proj.lora_A.weight")),
            edit_tensors(drop(f"{PREFIX}.0.self_attn.q_proj.lora_B.weight")),
            edit_tensors(add_lora("q_proj", in_features=5000)),
        ],
    ),
    Case(
        "module outside targets",
        Reason.module_not_targeted,
        before=[edit_tensors(add_lora("k_proj"))],
    ),
    Case(
        "module the model lacks",
        Reason.module_not_in_model,
        before=[
            edit_config(target_modules=["q_proj", "v_proj", "foo_proj"]),
            edit_tensors(add_lora("foo_proj")),
        ],
        record={
            "compatibility": {
                "target_modules": ["q_proj", "v_proj", "foo_proj"],
                "max_lora_rank": 8,
            }
        },
    ),
    Case(
        "target without weights",
        Reason.target_module_missing,
        before=[edit_config(target_modules=["q_proj", "v_proj", "k_proj"])],
        record={
            "compatibility": {"target_modules": ["q_proj", "v_proj", "k_proj"], "max_lora_rank": 8}
        },
    ),
    Case("weights of no tensor", Reason.target_module_missing, before=[raw_weights({})]),
    Case(  # vLLM reads adapter_model.safetensors alone: these weights would never be served
        "a second weights file",
        Reason.disallowed_file,
        before=[lambda f: (f / "more.safetensors").write_bytes((f / WEIGHTS_NAME).read_bytes())],
    ),
    Case(  # a worker that knows no base-model shapes checks no tensor against them
        "no model shapes",
        Reason.model_shape_unknown,
        limits={"model": None, "require_model": True},
    ),
    Case(  # vLLM loads it; every request using the adapter gets NaN logits
        "NaN weight",
        Reason.tensor_value_nonfinite,
        before=[edit_tensors(poison(f"{PREFIX}.1.self_attn.v_proj.lora_B.weight", math.nan))],
    ),
    Case(
        "infinite weight",
        Reason.tensor_value_nonfinite,
        before=[edit_tensors(poison(f"{PREFIX}.0.self_attn.q_proj.lora_A.weight", -math.inf))],
    ),
    Case(  # finite in the F32 file, +inf once vLLM casts it to float16: NaN logits again
        "weight past float16",
        Reason.tensor_value_overflows,
        before=[edit_tensors(poison(f"{PREFIX}.0.self_attn.q_proj.lora_A.weight", 1e6))],
    ),
    Case(  # within float16, but vLLM multiplies lora_B by alpha / r (16 / 8) in it: 80000
        "lora_B past float16 once scaled",
        Reason.tensor_value_overflows,
        before=[edit_tensors(poison(f"{PREFIX}.1.self_attn.v_proj.lora_B.weight", 40000.0))],
    ),
    Case(
        "half a pair",
        Reason.lora_pair_incomplete,
        before=[edit_tensors(drop(f"{PREFIX}.1.self_attn.q_proj.lora_B.weight"))],
    ),
]


NOT_END_TO_END = {
    "too large total": "its limit is the worker's own (max_total_bytes), not the stack's",
    "rank too high": "its limit is the worker's own (max_lora_rank), not the stack's",
    "worker base model": "its limit is the worker's own (its base model), not the stack's",
    "no model shapes": "its limit is the worker's own (require_model), not the stack's",
    # Over S3 only the files the manifest lists are ever downloaded (workers/artifact_fetch):
    # an object added to the prefix after publication never reaches the worker, whose copy
    # is the published artifact (the local-folder verifier refuses these).
    "file not in manifest": "an unlisted object is never downloaded from S3",
    "symlink": "S3 has no links; an unlisted object is never downloaded",
    "nested": "an unlisted object is never downloaded from S3",
    "bundle added after publish": "an unlisted object is never downloaded from S3",
}
"""The cases tests/integration/test_worker_e2e.py does not run against a real worker, and
why: every other case is run there (``end_to_end``), so a new case is covered unless it is
named here, and tests/unit/test_hostile_coverage.py checks that exactly the cases with
worker ``limits`` and those whose attack S3 cannot carry are."""

OVER_S3: dict[str, str] = {
    # the fetcher parses manifest.json with the schema first, which refuses such a path
    # (the verifier's own unsafe_path check is the second line)
    "dot-dot path": Reason.manifest_invalid,
    "absolute path": Reason.manifest_invalid,
    # a worker's registry holds only its base model's views: the name is not in it
    "record base model": "not_in_registry",
    # the fetcher refuses the manifest's names before it downloads a file, and a weights
    # file other than adapter_model.safetensors is one vLLM would never read
    "file missing": Reason.disallowed_file,
    "weights missing": Reason.disallowed_file,
    # the size the record claims (64 GiB) is over the worker's host-tier budget
    "record size too large": Reason.host_budget_exceeded,
}
"""The reason a case is refused with on the worker's S3 path where it is not its own."""


def end_to_end() -> list[Case]:
    """The cases run end to end against a real worker: all but ``NOT_END_TO_END``."""
    return [c for c in CASES if c.id not in NOT_END_TO_END]


def hostile(case: Case, good: Path, tmp_path: Path) -> tuple[DirectoryArtifact, AdapterRecord]:
    folder = tmp_path / "artifact"
    shutil.copytree(good, folder)
    for change in case.before:
        change(folder)
    record = record_for(write_manifest(folder), **case.record)
    for change in case.after:
        change(folder)
    return DirectoryArtifact(folder), record
