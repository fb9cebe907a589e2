"""Verification of a PEFT LoRA artifact before anything reaches vLLM. Pure: no I/O.

The artifact is seen through an ``ArtifactReader`` (a local folder, a fetch in progress, an
in-memory dict in tests), so every check here runs the same for the host tier, the offline
``loraplane artifact verify`` and the hostile-artifact tests. Checked, each failure with its
own ``Reason``: the manifest against the signed record (its digest, its files' total size)
and every file against the manifest; only the allowed files, the ones vLLM reads and our own
(no pickle, no links, no path games, no weights vLLM would never load); the weights'
safetensors header read with a bounded length and validated; tensors against ``r`` and
``target_modules`` of adapter_config.json and the base model's shape (vLLM itself accepts a
config naming modules the model lacks; this does not; a worker requires the shape, offline
use checks it when known); every value of a float tensor finite (a NaN or an infinity,
which vLLM loads, turns every logit of a request using the adapter into NaN), and finite
still once vLLM serves it (cast to its serving dtype, lora_B multiplied by alpha / r in it:
``served_limit``), read in bounded chunks; the config is a LoRA vLLM serves
(``lora_config``), within the worker's rank, for its base model (``base_model``), and agrees
with the record. Any input yields a ``Verdict``; hostile bytes never raise. docs/worker.md,
"Host warm tier and artifact verification", lists every rule.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
from pydantic import ValidationError

from loraplane.artifact.base_model import base_model_matches, mismatch_detail
from loraplane.artifact.lora_config import FLOAT16_MAX, LoraConfig, parse_lora_config
from loraplane.artifact.model_shape import LinearShape, ModelShape
from loraplane.artifact.refusal import Refusal
from loraplane.schemas.adapter import AdapterRecord
from loraplane.schemas.manifest import SAFE_PATH, Manifest
from loraplane.schemas.reasons import ArtifactReason as Reason
from loraplane.schemas.strict_json import StrictJsonError, strict_loads

__all__ = [
    "ALLOWED_NAMES",
    "BUNDLE_NAME",
    "CONFIG_NAME",
    "DTYPE_BYTES",
    "MANIFEST_NAME",
    "MAX_BUNDLE_BYTES",
    "MAX_JSON_FILE_BYTES",
    "MAX_REFUSALS",
    "MAX_TOTAL_BYTES",
    "NONFINITE_BITS",
    "PICKLE_SUFFIXES",
    "VALUE_CHUNK_BYTES",
    "WEIGHTS_NAME",
    "ArtifactReader",
    "FileFacts",
    "TensorInfo",
    "Verdict",
    "WorkerLimits",
    "is_safe_relative_path",
    "name_refusal",
    "parse_safetensors_header",
    "record_size_bytes",
    "record_size_refusal",
    "served_limit",
    "verify_artifact",
]

MANIFEST_NAME = "manifest.json"
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
BUNDLE_NAME = "model.sig"  # OpenSSF model signing's bundle (the model_signing CLI's default name)
MAX_BUNDLE_BYTES = 1024 * 1024  # a key-signed bundle of a few files is ~2 KiB
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
NONFINITE_BITS = {"F64": 0x7FF0_0000_0000_0000, "F32": 0x7F80_0000, "F16": 0x7C00, "BF16": 0x7F80}
"""Per float dtype of ``DTYPE_BYTES``, its exponent bits: a value with all of them set is NaN
or an infinity (IEEE 754 binary64, binary32, binary16; bfloat16 is binary32's upper half).
Read as unsigned integers with the sign bit cleared, a value is non-finite exactly when it is
at least these bits, so the check is exact for every dtype, bfloat16 included (which numpy
has no float type for). A dtype without an entry holds no float and is not scanned."""
_FLOAT_TYPES: dict[str, type[np.floating[Any]]] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.float32,  # bfloat16 is float32's upper half
}
VALUE_CHUNK_BYTES = 1024 * 1024  # a multiple of every dtype's size: no value straddles a read
MAX_JSON_FILE_BYTES = 256 * 1024
MAX_TOTAL_BYTES = 1024**3  # a worker's default bound on an artifact's bytes
MAX_REFUSALS = 64
_SAFE_PATH = re.compile(SAFE_PATH.removeprefix("^").removesuffix("$"), re.ASCII)
_LAYER_SITE = re.compile(r"^model\.layers\.(0|[1-9][0-9]{0,5})\.([a-z_]+)$")


@dataclass(frozen=True)
class FileFacts:
    """One entry of the artifact as its source lists it, links included (never followed)."""

    path: str  # relative, '/'-separated
    kind: Literal["file", "symlink", "other"]
    size: int


class ArtifactReader(Protocol):
    """Read access to one artifact. ``read`` returns at most ``length`` bytes."""

    def files(self) -> Sequence[FileFacts]: ...

    def read(self, path: str, offset: int, length: int) -> bytes: ...

    def sha256(self, path: str) -> str: ...


@dataclass(frozen=True)
class WorkerLimits:
    """What this worker accepts. ``base_model=None`` skips the base-model check (offline use);
    ``base_model_aliases`` maps the names PEFT writes (hub ids, local paths) to base-model ids.
    ``model``: the base model's shapes, checked when known; ``require_model`` (a worker, which
    hands what passes to vLLM) refuses everything as ``model_shape_unknown`` without them:
    vLLM meets a wrong shape only at activation, which can take its engine down."""

    base_model: str | None
    max_lora_rank: int
    max_total_bytes: int = MAX_TOTAL_BYTES
    max_header_bytes: int = 1024**2
    model: ModelShape | None = None
    base_model_aliases: Mapping[str, str] = field(default_factory=dict)
    require_model: bool = False


@dataclass(frozen=True)
class Verdict:
    refusals: tuple[Refusal, ...]

    @property
    def ok(self) -> bool:
        return not self.refusals

    @property
    def reasons(self) -> tuple[Reason, ...]:
        return tuple(dict.fromkeys(r.reason for r in self.refusals))


@dataclass(frozen=True)
class TensorInfo:
    """``span``: the bytes ``[begin, end)`` of the file that hold the tensor's values."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    span: tuple[int, int]


def verify_artifact(
    reader: ArtifactReader, limits: WorkerLimits, record: AdapterRecord | None = None
) -> Verdict:
    """Every check above; ``record=None`` (offline, no registry) skips the record checks."""
    out: list[Refusal] = []
    if limits.require_model and limits.model is None:
        out.append(
            Refusal(
                Reason.model_shape_unknown,
                detail="this worker knows no base-model shapes to check tensors against",
            )
        )
    facts = {f.path: f for f in reader.files()}
    manifest = _check_manifest(reader, facts, limits, record, out)
    usable = _check_names(facts, manifest, out)
    if manifest is not None:
        # over the bound (already too_large): nothing is hashed, sizes and names still checked
        hashable = usable if manifest.total_size <= limits.max_total_bytes else set()
        _check_files_against_manifest(reader, facts, manifest, hashable, out)
    elif sum(f.size for f in facts.values()) > limits.max_total_bytes:
        out.append(Refusal(Reason.too_large, detail=f"over {limits.max_total_bytes} bytes"))
    config = _check_config(reader, facts, usable, limits, record, out)
    tensors = _read_all_headers(reader, facts, usable, limits, out)
    if config is not None and tensors is not None:
        _check_tensors(tensors, config, limits.model, out)
    if tensors is not None and facts[WEIGHTS_NAME].size <= limits.max_total_bytes:
        scaling = config.scaling if config is not None else 1.0
        _check_values(reader, WEIGHTS_NAME, [t for _, t in tensors], scaling, out)
    return Verdict(tuple(_dedupe(out)[:MAX_REFUSALS]))


def _dedupe(refusals: list[Refusal]) -> list[Refusal]:
    return list(dict.fromkeys(refusals))


def is_safe_relative_path(path: str) -> bool:
    """A path a manifest can hold (``schemas.manifest.SAFE_PATH``): relative,
    '/'-separated, at most four segments of ASCII letters, digits, '.', '_' and '-' (no
    '.' or '..' segment, no control character, space or look-alike letter to echo into a
    log or a terminal)."""
    return _SAFE_PATH.fullmatch(path) is not None


ALLOWED_NAMES = (CONFIG_NAME, WEIGHTS_NAME, MANIFEST_NAME, BUNDLE_NAME)
"""The files an artifact may hold: the two vLLM 0.32 reads from an adapter folder
(``PEFTHelper.from_local_dir``, ``LoRAModel.from_local_checkpoint``) and our own two. Any
other file would be checked as if served and never be: weights in a second
``*.safetensors`` would count toward the target modules vLLM never gets."""


def name_refusal(path: str) -> Refusal | None:
    """Why a file name may not be part of an adapter artifact, or None when it may."""
    if not is_safe_relative_path(path):
        return Refusal(Reason.unsafe_path, path)
    if path.lower().endswith(PICKLE_SUFFIXES):
        return Refusal(Reason.pickle_weights, path, "pickle can run code when loaded")
    if path in ALLOWED_NAMES:
        return None
    return Refusal(
        Reason.disallowed_file,
        path,
        f"only {WEIGHTS_NAME}, {CONFIG_NAME} and {BUNDLE_NAME}: vLLM reads no other file",
    )


def _check_names(
    facts: dict[str, FileFacts], manifest: Manifest | None, out: list[Refusal]
) -> set[str]:
    """Refuse bad names and kinds; returns the paths that are safe to open."""
    usable: set[str] = set()
    listed = [f.path for f in manifest.files] if manifest is not None else []
    for path in dict.fromkeys([*facts, *listed]):
        refusal = name_refusal(path)
        fact = facts.get(path)
        if refusal is not None:
            out.append(refusal)
        if fact is not None and fact.kind == "symlink":
            out.append(Refusal(Reason.symlink, path, "links are never followed"))
        elif fact is not None and fact.kind != "file" and refusal is None:
            out.append(Refusal(Reason.disallowed_file, path, "not a regular file"))
        elif fact is not None and refusal is None:
            usable.add(path)
    return usable


def _read_json(reader: ArtifactReader, fact: FileFacts) -> Any:
    """Parse a small JSON file; raises ValueError (never anything else) when it is not one."""
    if fact.size > MAX_JSON_FILE_BYTES:
        raise ValueError(f"{fact.size} bytes is over the {MAX_JSON_FILE_BYTES} allowed")
    data = reader.read(fact.path, 0, fact.size)
    # Strict (schemas.strict_json): the manifest's bytes are pinned by the signed digest, so
    # they must have one reading (no duplicate key, bounded depth, no NaN, ...).
    return strict_loads(data, max_bytes=MAX_JSON_FILE_BYTES)  # StrictJsonError: a ValueError


def _check_manifest(
    reader: ArtifactReader,
    facts: dict[str, FileFacts],
    limits: WorkerLimits,
    record: AdapterRecord | None,
    out: list[Refusal],
) -> Manifest | None:
    fact = facts.get(MANIFEST_NAME)
    if fact is None or fact.kind != "file":
        out.append(Refusal(Reason.manifest_missing, MANIFEST_NAME))
        return None
    try:
        raw = _read_json(reader, fact)
    except ValueError as exc:
        out.append(Refusal(Reason.manifest_invalid, MANIFEST_NAME, str(exc)[:200]))
        return None
    files = raw.get("files") if isinstance(raw, dict) else None
    for entry in files if isinstance(files, list) else []:
        path = entry.get("path") if isinstance(entry, dict) else None
        if isinstance(path, str) and not is_safe_relative_path(path):
            out.append(Refusal(Reason.unsafe_path, path, "named in manifest"))
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as exc:
        out.append(
            Refusal(Reason.manifest_invalid, MANIFEST_NAME, f"{exc.error_count()} schema errors")
        )
        return None
    if record is not None and manifest.digest != record.sha256:
        out.append(
            Refusal(
                Reason.manifest_digest_mismatch,
                MANIFEST_NAME,
                f"digest {manifest.digest[:12]} != record {record.sha256[:12]}",
            )
        )
    if manifest.total_size > limits.max_total_bytes:
        out.append(
            Refusal(
                Reason.too_large, detail=f"{manifest.total_size} bytes > {limits.max_total_bytes}"
            )
        )
    bundle = manifest.file(BUNDLE_NAME)
    if bundle is not None and bundle.size > MAX_BUNDLE_BYTES:
        out.append(
            Refusal(
                Reason.too_large,
                BUNDLE_NAME,
                f"{bundle.size} bytes > {MAX_BUNDLE_BYTES} for a bundle",
            )
        )
    if record is not None:
        out.extend(_bundle_record_mismatch(record, bundle.sha256 if bundle else None))
        if (size := record_size_refusal(manifest, record)) is not None:
            out.append(size)
    return manifest


def record_size_bytes(manifest: Manifest) -> int:
    """The ``size_bytes`` of the registry record of ``manifest``'s artifact, as ``publish``
    writes it: the bytes of the files the manifest pins (``manifest.json`` itself and the
    files dropped at publish not counted), at least 1 (the record's lower bound)."""
    return max(manifest.total_size, 1)


def record_size_refusal(manifest: Manifest, record: AdapterRecord) -> Refusal | None:
    """``size_mismatch`` unless the record's ``size_bytes`` is exactly ``record_size_bytes``:
    the planner places an adapter by the record's size, so a record that says 1 KiB of an
    artifact of 900 MiB would overfill every host tier it is planned into."""
    if record.size_bytes == record_size_bytes(manifest):
        return None
    return Refusal(
        Reason.size_mismatch,
        MANIFEST_NAME,
        f"files total {manifest.total_size} bytes != record size_bytes {record.size_bytes}",
    )


def _bundle_record_mismatch(record: AdapterRecord, bundle_sha256: str | None) -> list[Refusal]:
    """The artifact carries a model-signing bundle exactly when the signed record names it,
    and the very one it names: a bundle cannot be added, dropped or swapped after publish."""
    claimed = record.model_signature
    if claimed is None and bundle_sha256 is not None:
        return [
            Refusal(
                Reason.record_mismatch,
                BUNDLE_NAME,
                "the artifact has a model-signing bundle; the record names none",
            )
        ]
    if claimed is not None and bundle_sha256 is None:
        return [
            Refusal(
                Reason.record_mismatch,
                BUNDLE_NAME,
                "the record names a model-signing bundle; the artifact has none",
            )
        ]
    if claimed is not None and claimed.bundle_sha256 != bundle_sha256:
        return [
            Refusal(
                Reason.record_mismatch,
                BUNDLE_NAME,
                f"bundle {str(bundle_sha256)[:12]} != record {claimed.bundle_sha256[:12]}",
            )
        ]
    return []


def _check_files_against_manifest(
    reader: ArtifactReader,
    facts: dict[str, FileFacts],
    manifest: Manifest,
    hashable: set[str],
    out: list[Refusal],
) -> None:
    """Every listed file present at its size, and hashed to its sha256 when in ``hashable``
    (the files safe to open, none when the artifact is over the size bound)."""
    for mf in manifest.files:
        fact = facts.get(mf.path)
        if fact is None:
            out.append(Refusal(Reason.file_missing, mf.path))
        elif fact.size != mf.size:
            out.append(Refusal(Reason.size_mismatch, mf.path, f"{fact.size} != {mf.size}"))
        elif mf.path in hashable and reader.sha256(mf.path) != mf.sha256:
            out.append(Refusal(Reason.sha256_mismatch, mf.path))
    for path in facts:
        if path != MANIFEST_NAME and manifest.file(path) is None:
            out.append(Refusal(Reason.file_not_in_manifest, path))


def _check_config(
    reader: ArtifactReader,
    facts: dict[str, FileFacts],
    usable: set[str],
    limits: WorkerLimits,
    record: AdapterRecord | None,
    out: list[Refusal],
) -> LoraConfig | None:
    if record is not None and record.rank > limits.max_lora_rank:
        out.append(
            Refusal(
                Reason.rank_too_high, detail=f"record rank {record.rank} > {limits.max_lora_rank}"
            )
        )
    expected_base = limits.base_model or (record.base_model if record is not None else None)
    if expected_base is not None and record is not None and record.base_model != expected_base:
        out.append(
            Refusal(
                Reason.base_model_mismatch,
                detail=f"record base {record.base_model!r} != {expected_base!r}",
            )
        )
    if CONFIG_NAME not in usable:
        out.append(Refusal(Reason.config_missing, CONFIG_NAME))
        return None
    try:
        config = parse_lora_config(_read_json(reader, facts[CONFIG_NAME]))
    except ValueError as exc:
        out.append(Refusal(Reason.config_invalid, CONFIG_NAME, str(exc)[:200]))
        return None
    if config.rank > limits.max_lora_rank:
        out.append(
            Refusal(Reason.rank_too_high, CONFIG_NAME, f"r {config.rank} > {limits.max_lora_rank}")
        )
    aliases = limits.base_model_aliases
    if expected_base is not None and not base_model_matches(
        config.base_model, expected_base, aliases
    ):
        out.append(
            Refusal(
                Reason.base_model_mismatch,
                CONFIG_NAME,
                mismatch_detail(config.base_model, expected_base, aliases),
            )
        )
    if record is not None:
        if record.rank != config.rank:
            out.append(
                Refusal(
                    Reason.record_mismatch,
                    CONFIG_NAME,
                    f"r {config.rank} != record rank {record.rank}",
                )
            )
        if set(record.compatibility.target_modules) != config.target_modules:
            out.append(
                Refusal(
                    Reason.record_mismatch, CONFIG_NAME, "target_modules differ from the record's"
                )
            )
    return config


def parse_safetensors_header(
    reader: ArtifactReader, path: str, file_size: int, max_header_bytes: int
) -> tuple[list[TensorInfo], list[Refusal]]:
    """Read and validate one safetensors header without ever reading more than
    ``8 + max_header_bytes`` bytes: the announced length is checked before it is read."""
    if file_size < 8:
        return [], [Refusal(Reason.header_invalid, path, "shorter than 8 bytes")]
    (length,) = struct.unpack("<Q", reader.read(path, 0, 8).ljust(8, b"\0"))
    if length > max_header_bytes:
        return [], [
            Refusal(
                Reason.header_too_large,
                path,
                f"header claims {length} bytes, limit {max_header_bytes}",
            )
        ]
    if length < 2 or 8 + length > file_size:
        return [], [
            Refusal(
                Reason.header_invalid,
                path,
                f"header length {length} does not fit a {file_size}-byte file",
            )
        ]
    try:  # strict: a duplicate tensor name would give two readers two offsets
        header = strict_loads(reader.read(path, 8, length), max_bytes=length)
    except StrictJsonError as exc:
        return [], [
            Refusal(
                Reason.header_invalid, path, f"header is not strict UTF-8 JSON: {str(exc)[:120]}"
            )
        ]
    if not isinstance(header, dict):
        return [], [Refusal(Reason.header_invalid, path, "header is not a JSON object")]
    return _validate_header(header, path, 8 + length, file_size - 8 - length)


def _validate_header(
    header: dict[str, Any], path: str, data_start: int, data_size: int
) -> tuple[list[TensorInfo], list[Refusal]]:
    out: list[Refusal] = []
    tensors: list[TensorInfo] = []
    spans: list[tuple[int, int, str]] = []
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        out.append(Refusal(Reason.header_invalid, path, "__metadata__ must map str to str"))
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            out.append(Refusal(Reason.header_invalid, path, f"tensor {name[:80]!r} malformed"))
            continue
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:  # an array is unhashable
            out.append(
                Refusal(Reason.tensor_dtype_invalid, path, f"{name[:80]}: {str(dtype)[:20]}")
            )
            continue
        if not (
            isinstance(shape, list)
            and len(shape) <= 8
            and all(_is_uint(d) and d < 2**40 for d in shape)
        ):
            out.append(Refusal(Reason.header_invalid, path, f"{name[:80]}: bad shape"))
            continue
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(map(_is_uint, offsets))
            and offsets[0] <= offsets[1] <= data_size
            and offsets[1] - offsets[0] == math.prod(shape) * DTYPE_BYTES[dtype]
        ):
            out.append(
                Refusal(
                    Reason.tensor_offsets_invalid,
                    path,
                    f"{name[:80]}: offsets do not match shape/dtype or file",
                )
            )
            continue
        spans.append((offsets[0], offsets[1], name))
        span = (data_start + offsets[0], data_start + offsets[1])
        tensors.append(TensorInfo(name, dtype, tuple(shape), span))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            what = "overlaps the previous tensor" if begin < end else "leaves a gap"
            out.append(Refusal(Reason.tensor_offsets_invalid, path, f"{name[:80]} {what}"))
        end = max(end, stop)
    if not out and end != data_size:
        out.append(
            Refusal(
                Reason.tensor_offsets_invalid,
                path,
                f"tensors cover {end} of {data_size} data bytes",
            )
        )
    return tensors, out


def _is_uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_all_headers(
    reader: ArtifactReader,
    facts: dict[str, FileFacts],
    usable: set[str],
    limits: WorkerLimits,
    out: list[Refusal],
) -> list[tuple[str, TensorInfo]] | None:
    """Every tensor of the weights file, or None when it is missing or its header is
    unusable. A weights file of no tensor is an empty list, which the tensor checks judge
    like any other (every target module without weights is refused)."""
    if WEIGHTS_NAME not in usable:
        out.append(Refusal(Reason.weights_missing, WEIGHTS_NAME))
        return None
    tensors, refusals = parse_safetensors_header(
        reader, WEIGHTS_NAME, facts[WEIGHTS_NAME].size, limits.max_header_bytes
    )
    out.extend(refusals)
    return None if refusals else [(WEIGHTS_NAME, t) for t in tensors]


def served_limit(tensor: TensorInfo, scaling: float) -> float:
    """The largest magnitude a value of ``tensor`` may have: vLLM casts every weight to its
    serving dtype, then multiplies lora_B by ``scaling`` (alpha / r) in it, and float16, the
    narrowest it serves in, turns anything past ``FLOAT16_MAX`` into an infinity. A value of
    1e6 is finite in an F32 file and +inf once served: NaN logits, as a NaN in the file."""
    if tensor.name.split(".")[-2:-1] == ["lora_B"]:
        return FLOAT16_MAX / max(abs(scaling), 1.0)
    return FLOAT16_MAX


def _limit_bits(dtype: str, limit: float) -> int:
    """The bits of the largest value of ``dtype`` at most ``limit`` (finite, > 0): read as
    unsigned integers with the sign cleared, a float dtype's values order as their bits do,
    so a value is past ``limit`` exactly when its magnitude's bits are past these."""
    kind = _FLOAT_TYPES[dtype]
    value = np.array(limit, kind)
    if float(value) > limit:
        value = np.nextafter(value, kind(0))
    bits = int(value.view(f"<u{value.itemsize}"))
    return bits >> 16 if dtype == "BF16" else bits  # truncation rounds toward zero


def _as_float(dtype: str, bits: int) -> float:
    if dtype == "BF16":
        return float(np.array(bits << 16, np.uint32).view(np.float32))
    kind = _FLOAT_TYPES[dtype]
    return float(np.array(bits, f"<u{DTYPE_BYTES[dtype]}").view(kind))


def _check_values(
    reader: ArtifactReader,
    path: str,
    tensors: Sequence[TensorInfo],
    scaling: float,
    out: list[Refusal],
) -> None:
    """Every value of every float tensor finite (``NONFINITE_BITS``) and within its
    ``served_limit``: per tensor, a refusal for its first NaN or infinity
    (``tensor_value_nonfinite``) and one for its first finite value past the limit
    (``tensor_value_overflows``), at most ``MAX_REFUSALS`` in all. The bytes are read at
    most ``VALUE_CHUNK_BYTES`` at a time and judged in place as unsigned integers
    (``np.frombuffer``, no float copy), so memory is bounded by the chunk, not the file."""
    refused: set[tuple[str, Reason]] = set()
    bits_of: dict[tuple[str, float], int] = {}  # a few pairs, however many tensors
    limits: dict[str, int] = {}
    for t in tensors:
        key = (t.dtype, served_limit(t, scaling))
        if key not in bits_of:
            bits_of[key] = _limit_bits(*key)
        limits[t.name] = bits_of[key]
    scratch = np.empty(VALUE_CHUNK_BYTES, np.uint8)  # each piece's magnitudes, in place
    for pieces in _value_reads(tensors):
        begin, end = pieces[0][1], pieces[-1][2]
        data = reader.read(path, begin, end - begin)
        if len(data) != end - begin:  # the file shrank since it was listed
            out.append(Refusal(Reason.size_mismatch, path, "shorter than when it was listed"))
            return
        for t, at, stop in pieces:
            size = DTYPE_BYTES[t.dtype]
            bits = np.frombuffer(data, f"<u{size}", (stop - at) // size, at - begin)
            sign_cleared = np.array((1 << (8 * size - 1)) - 1, bits.dtype)
            magnitude = np.bitwise_and(
                bits, sign_cleared, out=scratch.view(bits.dtype)[: len(bits)]
            )
            exponent, limit, top = NONFINITE_BITS[t.dtype], limits[t.name], magnitude.max()
            if top <= limit:
                continue
            first = (at - t.span[0]) // size
            if top >= exponent and (t.name, Reason.tensor_value_nonfinite) not in refused:
                i = int(np.argmax(magnitude >= exponent))
                what = (
                    "NaN" if magnitude[i] != exponent else "-inf" if bits[i] != exponent else "+inf"
                )
                out.append(
                    Refusal(
                        Reason.tensor_value_nonfinite,
                        path,
                        f"{t.name[:80]}: {what} at [{first + i}]",
                    )
                )
                refused.add((t.name, Reason.tensor_value_nonfinite))
            past = (magnitude > limit) & (magnitude < exponent)
            if (t.name, Reason.tensor_value_overflows) not in refused and past.any():
                i = int(np.argmax(past))
                out.append(
                    Refusal(
                        Reason.tensor_value_overflows,
                        path,
                        f"{t.name[:80]}: {_as_float(t.dtype, int(bits[i])):.6g} at "
                        f"[{first + i}] is past {_as_float(t.dtype, limit):.6g}, an infinity "
                        "once served (float16, lora_B times alpha / r)",
                    )
                )
                refused.add((t.name, Reason.tensor_value_overflows))
            if len(refused) >= MAX_REFUSALS:
                return


def _value_reads(
    tensors: Sequence[TensorInfo],
) -> Iterator[list[tuple[TensorInfo, int, int]]]:
    """The float tensors' bytes as reads of at most ``VALUE_CHUNK_BYTES``, in file order:
    each a list of pieces (a tensor, the piece's ``[begin, end)`` in the file) that follow
    one another. A tensor longer than a read is cut every ``VALUE_CHUNK_BYTES`` from its
    start, so a piece holds whole values; small neighbouring tensors share one read."""
    batch: list[tuple[TensorInfo, int, int]] = []
    for t in sorted((t for t in tensors if t.dtype in NONFINITE_BITS), key=lambda t: t.span):
        for at in range(t.span[0], t.span[1], VALUE_CHUNK_BYTES):
            stop = min(at + VALUE_CHUNK_BYTES, t.span[1])
            if batch and (at != batch[-1][2] or stop - batch[0][1] > VALUE_CHUNK_BYTES):
                yield batch
                batch = []
            batch.append((t, at, stop))
    if batch:
        yield batch


def _check_tensors(
    tensors: list[tuple[str, TensorInfo]],
    config: LoraConfig,
    model: ModelShape | None,
    out: list[Refusal],
) -> None:
    """Names and shapes agree with ``r`` / ``target_modules`` (and the model, when known)."""
    halves: dict[tuple[str, str], set[str]] = {}
    seen: set[str] = set()
    for path, t in tensors:
        parts = t.name.split(".")
        if t.name in seen:
            out.append(Refusal(Reason.tensor_name_invalid, path, f"{t.name[:120]} twice"))
            continue
        seen.add(t.name)
        if (
            len(parts) < 6
            or parts[:2] != ["base_model", "model"]
            or parts[-2] not in ("lora_A", "lora_B")
            or parts[-1] != "weight"
        ):
            out.append(
                Refusal(
                    Reason.tensor_name_invalid,
                    path,
                    f"{t.name[:120]} is not base_model.model.<site>.<module>.lora_{{A,B}}.weight",
                )
            )
            continue
        site, module, half = ".".join(parts[2:-3]), parts[-3], parts[-2]
        if module not in config.target_modules:
            out.append(Refusal(Reason.module_not_targeted, path, t.name[:120]))
            continue
        if model is not None and not _site_in_model(model, site, module):
            out.append(Refusal(Reason.module_not_in_model, path, t.name[:120]))
            continue
        if not _shape_fits(t.shape, half, config.rank, model.modules[module] if model else None):
            out.append(
                Refusal(
                    Reason.tensor_shape_mismatch,
                    path,
                    f"{t.name[:120]}: {list(t.shape)} (r={config.rank})",
                )
            )
        halves.setdefault((site, module), set()).add(half)
    for (site, module), got in sorted(halves.items()):
        if got != {"lora_A", "lora_B"}:
            out.append(
                Refusal(
                    Reason.lora_pair_incomplete, detail=f"{site}.{module} has only {sorted(got)[0]}"
                )
            )
    covered = {module for _, module in halves}
    for module in sorted(config.target_modules - covered):
        out.append(
            Refusal(
                Reason.target_module_missing, CONFIG_NAME, f"{module} has no lora_A/lora_B weights"
            )
        )


def _site_in_model(model: ModelShape, site: str, module: str) -> bool:
    m = _LAYER_SITE.fullmatch(site)
    return (
        m is not None
        and module in model.modules
        and int(m.group(1)) < model.num_layers
        and m.group(2) == model.modules[module].block
    )


def _shape_fits(shape: tuple[int, ...], half: str, rank: int, linear: LinearShape | None) -> bool:
    if len(shape) != 2:
        return False
    if half == "lora_A":
        return shape[0] == rank and (linear is None or shape[1] == linear.in_features)
    return shape[1] == rank and (linear is None or shape[0] == linear.out_features)
