"""Every hostile artifact of tests/hostile_corpus.py is refused with its own reason."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from loraplane.artifact.directory import DirectoryArtifact
from loraplane.artifact.verification import (
    CONFIG_NAME,
    MANIFEST_NAME,
    WEIGHTS_NAME,
    FileFacts,
    WorkerLimits,
    record_size_bytes,
    verify_artifact,
)
from loraplane.schemas.reasons import ArtifactReason as Reason
from loraplane.tiny_model import build_adapter
from tests.hostile_corpus import (
    CASES,
    LIMITS,
    PREFIX,
    Case,
    add_file,
    flip_last_byte,
    hostile,
    record_for,
    symlink,
    write_manifest,
)
from tests.model_signing_kit import MODEL_SIGNING_REASONS


@pytest.fixture(scope="module")
def good_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_adapter(tmp_path_factory.mktemp("good") / "adapter", seed=7)


def test_the_good_adapter_passes(good_adapter: Path, tmp_path: Path) -> None:
    artifact, record = hostile(Case("none", Reason.fetch_failed), good_adapter, tmp_path)
    verdict = verify_artifact(artifact, LIMITS, record)
    assert verdict.ok, verdict.refusals


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_artifact_is_refused_with_its_reason(
    case: Case, good_adapter: Path, tmp_path: Path
) -> None:
    artifact, record = hostile(case, good_adapter, tmp_path)
    limits = WorkerLimits(**{**LIMITS.__dict__, **case.limits})
    verdict = verify_artifact(artifact, limits, record)
    assert not verdict.ok
    assert case.reason in verdict.reasons, verdict.refusals


def test_every_content_reason_has_a_hostile_case() -> None:
    covered = {c.reason for c in CASES}
    io_or_policy = {
        Reason.source_not_allowed,
        Reason.outside_owner_prefix,
        Reason.artifact_store_unavailable,
        Reason.fetch_failed,
        Reason.adapter_revoked,
        Reason.host_budget_exceeded,
        Reason.host_io_error,
        Reason.host_disk_full,
        Reason.install_error,
    }  # the fetch and host-tier tests (install_error: tests/unit/test_worker_faults.py)
    assert set(Reason) - io_or_policy - MODEL_SIGNING_REASONS - covered == set()


def test_a_header_claiming_gigabytes_is_refused_after_reading_8_bytes(
    good_adapter: Path, tmp_path: Path
) -> None:
    artifact, record = hostile(
        CASES[[c.id for c in CASES].index("header claims gigabytes")], good_adapter, tmp_path
    )
    reads: list[tuple[str, int]] = []
    original = artifact.read

    def spy(path: str, offset: int, length: int) -> bytes:
        reads.append((path, length))
        return original(path, offset, length)

    artifact.read = spy  # type: ignore[method-assign]
    assert Reason.header_too_large in verify_artifact(artifact, LIMITS, record).reasons
    assert [length for path, length in reads if path == WEIGHTS_NAME] == [8]


def test_several_reasons_are_reported_at_once(good_adapter: Path, tmp_path: Path) -> None:
    case = Case(
        "many",
        Reason.pickle_weights,
        before=[add_file("x.pkl")],
        after=[flip_last_byte, symlink("l.safetensors", "x.pkl")],
        limits={"max_lora_rank": 1},
    )
    artifact, record = hostile(case, good_adapter, tmp_path)
    verdict = verify_artifact(artifact, WorkerLimits(**{**LIMITS.__dict__, **case.limits}), record)
    assert {
        Reason.pickle_weights,
        Reason.sha256_mismatch,
        Reason.symlink,
        Reason.rank_too_high,
    } <= set(verdict.reasons)


def test_without_a_record_the_folder_is_checked_on_its_own(
    good_adapter: Path, tmp_path: Path
) -> None:
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
        return self.data[path][offset : offset + length]

    def sha256(self, path: str) -> str:
        import hashlib

        return hashlib.sha256(self.data[path]).hexdigest()


@pytest.fixture(scope="module")
def good_files(good_adapter: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in good_adapter.iterdir() if p.name != MANIFEST_NAME}


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.text(max_size=30)
    | st.sampled_from(["F32", "BF16", "I8", "LORA", "q_proj", "v_proj", "tiny-llama"]),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=40), inner, max_size=5)
    ),
    max_leaves=20,
)
tensor_names = st.sampled_from(
    [
        f"{PREFIX}.0.self_attn.q_proj.lora_A.weight",
        f"{PREFIX}.1.self_attn.v_proj.lora_B.weight",
        f"{PREFIX}.9.mlp.down_proj.lora_A.weight",
        "__metadata__",
        "base_model.model.x.lora_A.weight",
        "lm_head.weight",
    ]
)
tensor_entries = st.fixed_dictionaries(
    {  # each field also any JSON value: an array or object where a string belongs
        "dtype": st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "bogus"]) | json_values,
        "shape": st.lists(st.integers(-1, 300), max_size=3) | json_values,
        "data_offsets": st.lists(st.integers(-5, 5000), min_size=0, max_size=3) | json_values,
    }
)
headers = st.dictionaries(tensor_names, tensor_entries | json_values, max_size=6)
fuzz = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def check(files: dict[str, bytes], limits: WorkerLimits = LIMITS) -> None:
    verdict = verify_artifact(MemoryArtifact(files), limits)  # never raises
    assert all(isinstance(r.reason, Reason) for r in verdict.refusals)


@fuzz
@given(data=st.binary(max_size=300))
def test_random_weight_bytes_never_raise(good_files: dict[str, bytes], data: bytes) -> None:
    check({**good_files, WEIGHTS_NAME: data})


@pytest.mark.parametrize("dtype", [[], ["F32"], {"F32": 4}, None, 4, True])
def test_attack_a_dtype_that_is_no_string_is_refused(
    good_files: dict[str, bytes], dtype: Any
) -> None:
    """An array or object as a tensor's dtype was looked up in the dtype table as it was:
    TypeError (unhashable) out of the verifier, so the worker neither refused nor held the
    adapter. Every field of a tensor entry is checked for its JSON type before it is used."""
    header = {
        f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": {
            "dtype": dtype,
            "shape": [1],
            "data_offsets": [0, 4],
        }
    }
    body = json.dumps(header).encode()
    files = {**good_files, WEIGHTS_NAME: struct.pack("<Q", len(body)) + body + b"\0" * 4}
    verdict = verify_artifact(MemoryArtifact(files), LIMITS)
    assert Reason.tensor_dtype_invalid in verdict.reasons


@fuzz
@given(header=headers, data=st.binary(max_size=64), length_delta=st.integers(-3, 3))
def test_random_headers_never_raise(
    good_files: dict[str, bytes], header: dict[str, Any], data: bytes, length_delta: int
) -> None:
    body = json.dumps(header).encode()
    check(
        {
            **good_files,
            WEIGHTS_NAME: struct.pack("<Q", max(0, len(body) + length_delta)) + body + data,
        }
    )


@fuzz
@given(
    config=st.dictionaries(
        st.sampled_from(
            [
                "r",
                "lora_alpha",
                "target_modules",
                "peft_type",
                "base_model_name_or_path",
                "use_dora",
                "bias",
                "rank_pattern",
            ]
        ),
        json_values,
        max_size=8,
    )
)
def test_random_configs_never_raise(good_files: dict[str, bytes], config: dict[str, Any]) -> None:
    check({**good_files, CONFIG_NAME: json.dumps(config).encode()})


@fuzz
@given(
    manifest=json_values, mutation=st.binary(min_size=1, max_size=4), position=st.integers(0, 10**6)
)
def test_mutated_artifacts_with_a_manifest_never_raise_and_never_pass(
    good_files: dict[str, bytes], manifest: Any, mutation: bytes, position: int
) -> None:
    weights = bytearray(good_files[WEIGHTS_NAME])
    at = position % len(weights)
    original = bytes(weights[at : at + len(mutation)])
    weights[at : at + len(mutation)] = mutation
    files = {
        **good_files,
        MANIFEST_NAME: json.dumps(manifest).encode(),
        WEIGHTS_NAME: bytes(weights),
    }
    check(files)
    if bytes(weights[at : at + len(mutation)]) != original:
        # a valid manifest of the good files: the flipped bytes must be caught
        from loraplane.schemas.manifest import Manifest, ManifestFile

        good = Manifest(
            files=[
                ManifestFile(path=p, sha256=MemoryArtifact(good_files).sha256(p), size=len(b))
                for p, b in good_files.items()
            ]
        )
        files[MANIFEST_NAME] = good.canonical_bytes()
        assert not verify_artifact(MemoryArtifact(files), LIMITS).ok


@pytest.mark.parametrize("swap", ["fifo", "link", "folder"])
def test_a_file_swapped_after_the_listing_is_never_read_through(
    swap: str, good_adapter: Path, tmp_path: Path
) -> None:
    """Between the folder's listing and a read, a file replaced by a FIFO (whose open would
    block), a link or a folder is an OSError for the caller, which refuses the entry."""
    import os

    folder = tmp_path / "a"
    shutil.copytree(good_adapter, folder)
    listing = DirectoryArtifact(folder)
    name = next(f.path for f in listing.files() if f.kind == "file")
    (folder / name).unlink()
    if swap == "fifo":
        os.mkfifo(folder / name)
    elif swap == "link":
        (folder / name).symlink_to("/dev/zero")
    else:
        (folder / name).mkdir()
    with pytest.raises(OSError):
        listing.read(name, 0, 16)
    with pytest.raises(OSError):
        listing.sha256(name)


def test_a_file_grown_since_its_listing_is_hashed_to_no_pinned_digest(tmp_path: Path) -> None:
    """ATTACK: a file of a folder being verified grows between its listing and its hash
    (extended sparse by whoever can write the disk). The hash read it to its end, however
    far; it reads the listed size and one byte, so the digest pins nothing and the read
    ends."""
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "x.safetensors").write_bytes(b"abc")
    artifact = DirectoryArtifact(folder)
    assert [f.size for f in artifact.files()] == [3]
    os.truncate(folder / "x.safetensors", 256 * 1024**2)
    assert artifact.sha256("x.safetensors") == hashlib.sha256(b"abc\0").hexdigest()


@pytest.mark.parametrize("shape", ["one folder", "a tree"])
def test_attack_a_folder_of_more_entries_than_the_bound_is_refused_not_cut(
    shape: str, good_adapter: Path, tmp_path: Path
) -> None:
    """More entries than ``MAX_ENTRIES`` (in one folder, or over a tree of folders that each
    hold fewer): the listing stops one past the bound with an entry verification refuses.
    Before, each folder's first 1,024 names by sort were listed and the rest left unseen,
    after every name of the folder was read and sorted (millions held)."""
    from loraplane.artifact.directory import MAX_ENTRIES, TOO_MANY

    folder = tmp_path / "adapter"
    shutil.copytree(good_adapter, folder)
    if shape == "one folder":
        for n in range(MAX_ENTRIES + 5):
            (folder / f"z{n:05d}.txt").write_bytes(b"")
    else:
        for d in range(3):
            (folder / f"d{d}").mkdir()
            for n in range(MAX_ENTRIES // 2):
                (folder / f"d{d}" / f"f{n:04d}").write_bytes(b"")
    listing = DirectoryArtifact(folder).files()
    assert len(listing) == MAX_ENTRIES + 1
    assert listing[-1].path == TOO_MANY and listing[-1].kind == "other"
    assert not verify_artifact(DirectoryArtifact(folder), LIMITS).ok


@pytest.mark.parametrize(
    "header",
    [{}, {"__metadata__": {"format": "pt"}}],
    ids=["empty header", "metadata only"],
)
def test_attack_weights_without_a_tensor_are_refused(
    good_adapter: Path, tmp_path: Path, header: dict[str, Any]
) -> None:
    """ATTACK: an ``adapter_model.safetensors`` that holds no tensor at all, published with
    a config whose ``target_modules`` promise q_proj and v_proj. The tensor checks ran only
    when some tensor was found, so it passed (vLLM serves it as the bare base model under
    the adapter's name); every target module without weights is ``target_module_missing``."""
    body = json.dumps(header).encode()
    case = Case(
        "no tensors",
        Reason.target_module_missing,
        before=[add_file(WEIGHTS_NAME, struct.pack("<Q", len(body)) + body)],
    )
    artifact, record = hostile(case, good_adapter, tmp_path)
    verdict = verify_artifact(artifact, LIMITS, record)
    assert not verdict.ok
    assert {r.detail.split()[0] for r in verdict.refusals} == {"q_proj", "v_proj"}
    assert set(verdict.reasons) == {Reason.target_module_missing}


@pytest.mark.parametrize("name", ["extra.safetensors", "new_embeddings.safetensors"])
def test_attack_weights_in_a_file_vllm_never_reads_are_refused(
    good_adapter: Path, tmp_path: Path, name: str
) -> None:
    """ATTACK: the v_proj half of the adapter moved from ``adapter_model.safetensors`` into
    another top-level ``*.safetensors``. The verifier counted every file's tensors toward
    its target modules and pairs, so it passed; vLLM 0.32 reads the weights file alone
    (``LoRAModel.from_local_checkpoint``) and served an adapter without the v_proj the
    checks vouched for. A file vLLM never reads is ``disallowed_file``."""
    from safetensors.numpy import load_file, save_file

    def split(folder: Path) -> None:
        tensors = load_file(str(folder / WEIGHTS_NAME))
        moved = {k: v for k, v in tensors.items() if ".v_proj." in k}
        kept = {k: v for k, v in tensors.items() if k not in moved}
        save_file(kept, str(folder / WEIGHTS_NAME))
        save_file(moved, str(folder / name))

    artifact, record = hostile(
        Case("split", Reason.disallowed_file, before=[split]), good_adapter, tmp_path
    )
    verdict = verify_artifact(artifact, LIMITS, record)
    assert Reason.disallowed_file in verdict.reasons, verdict.refusals
    assert Reason.target_module_missing in verdict.reasons, verdict.refusals


HOSTILE_TEXT = [
    "x\n::error::published",  # a CI log line of its own (GitHub workflow command)
    "\x1b]0;owned\x07\x1b[2J",  # terminal title and clear screen
    "a\u202egpj",  # right-to-left override
    "a\u2028b\rc\x00",
]


@pytest.mark.parametrize("text", HOSTILE_TEXT)
def test_attack_a_tensor_name_is_shown_escaped_in_every_refusal(
    good_files: dict[str, bytes], text: str
) -> None:
    """ATTACK: a tensor named with a line break or a terminal escape. Its refusal quoted it
    as it was, so ``loraplane publish`` printed a CI log line of the attacker's and
    ``artifact verify`` sent escapes to the terminal; every refusal's text is printable."""
    header = {
        f"{PREFIX}.0.self_attn.q_proj.{text}.lora_A.weight": {
            "dtype": "F32",
            "shape": [1],
            "data_offsets": [0, 4],
        },
        text: {"dtype": "I8", "shape": [1], "data_offsets": [4, 5]},
    }
    body = json.dumps(header).encode()
    files = {**good_files, WEIGHTS_NAME: struct.pack("<Q", len(body)) + body + b"\0" * 5}
    verdict = verify_artifact(MemoryArtifact(files), LIMITS)
    assert not verdict.ok
    for refusal in verdict.refusals:
        assert str(refusal).isprintable() and refusal.detail.isprintable(), refusal


@given(path=st.text(max_size=40), detail=st.text(max_size=40))
def test_a_refusal_is_always_printable(path: str, detail: str) -> None:
    from loraplane.artifact.refusal import Refusal

    refusal = Refusal(Reason.header_invalid, path, detail)
    assert str(refusal).isprintable() and refusal.detail.isprintable()
    assert refusal.path == path  # the name itself, for callers that compare it


def test_attack_a_manifest_over_the_size_bound_is_refused_unhashed(
    good_files: dict[str, bytes],
) -> None:
    """ATTACK: ``artifact verify`` (or a startup scan) on a folder whose manifest lists, and
    whose files are, 64 GiB each (sparse: they cost no disk). ``too_large`` was reported,
    then every file whose size matched was hashed all the same: hours of reading zeros.
    Nothing is hashed of an artifact over the bound."""
    from loraplane.schemas.manifest import Manifest, ManifestFile

    huge = 64 * 1024**3
    manifest = Manifest(
        files=[
            ManifestFile(path=CONFIG_NAME, sha256="0" * 64, size=len(good_files[CONFIG_NAME])),
            ManifestFile(path=WEIGHTS_NAME, sha256="0" * 64, size=huge),
        ]
    )
    hashed: list[str] = []

    class Sparse(MemoryArtifact):
        def files(self) -> list[FileFacts]:
            return [
                FileFacts(p, "file", huge if p == WEIGHTS_NAME else len(b))
                for p, b in self.data.items()
            ]

        def sha256(self, path: str) -> str:
            hashed.append(path)
            return super().sha256(path)

    reader = Sparse(
        {**good_files, WEIGHTS_NAME: b"\0" * 8, MANIFEST_NAME: manifest.canonical_bytes()}
    )
    verdict = verify_artifact(reader, LIMITS)
    assert Reason.too_large in verdict.reasons
    assert hashed == []


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(min_value=1, max_value=64 * 1024**3))
def test_attack_a_record_whose_size_is_not_the_artifacts_is_refused(
    good_adapter: Path, tmp_path_factory: pytest.TempPathFactory, size_bytes: int
) -> None:
    """ATTACK: a signed record whose ``size_bytes`` is not the total of the files its
    manifest pins (the host-tier budget is planned by it: 1 byte said of a 900 MiB artifact
    overfills every tier it is placed in). It passed whatever it said; it is refused as
    ``size_mismatch`` unless it says exactly what ``publish`` writes."""
    folder = tmp_path_factory.mktemp("sized") / "artifact"
    shutil.copytree(good_adapter, folder)
    manifest = write_manifest(folder)
    record = record_for(manifest, size_bytes=size_bytes)
    verdict = verify_artifact(DirectoryArtifact(folder), LIMITS, record)
    if size_bytes == record_size_bytes(manifest):
        assert verdict.ok, verdict.refusals
    else:
        assert verdict.reasons == (Reason.size_mismatch,), verdict.refusals
        assert f"record size_bytes {size_bytes}" in verdict.refusals[0].detail


def test_publish_writes_the_size_a_worker_expects(good_adapter: Path, tmp_path: Path) -> None:
    """The rule matches what ``publish`` writes: the files the manifest pins, not
    ``manifest.json`` itself, so every genuine record passes."""
    from loraplane.artifact_publish import PublishRequest, build_record
    from loraplane.schemas.adapter import Priority

    folder = tmp_path / "artifact"
    shutil.copytree(good_adapter, folder)
    release = PublishRequest("sized", "t1", "tiny-llama", "1", Priority.silver)
    record, manifest = build_record(folder, release, "loraplane-artifacts")
    pinned = sum((folder / f.path).stat().st_size for f in manifest.files)
    assert record.size_bytes == pinned == record_size_bytes(manifest)
    (folder / MANIFEST_NAME).write_bytes(manifest.canonical_bytes())  # as uploaded
    assert verify_artifact(DirectoryArtifact(folder), LIMITS, record).ok
