"""Every value of an adapter's float tensors is finite, or the artifact is refused
(``tensor_value_nonfinite``): a NaN or an infinity in a LoRA weight passes every format
check, vLLM loads it, and every request using the adapter gets NaN logits. A finite value
that is an infinity once vLLM serves it (cast to float16, lora_B multiplied by alpha / r
in it) is refused too (``tensor_value_overflows``): to vLLM it is the same infinity.

The oracle here is numpy's own ``isfinite`` and ``abs`` on float views (bfloat16 widened to
float32 by its bits), not the verifier's exponent masks."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import shutil
import struct
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from loraplane.artifact import verification
from loraplane.artifact.verification import (
    CONFIG_NAME,
    DTYPE_BYTES,
    MANIFEST_NAME,
    NONFINITE_BITS,
    VALUE_CHUNK_BYTES,
    WEIGHTS_NAME,
    Verdict,
    verify_artifact,
)
from loraplane.schemas.adapter import AdapterStatus
from loraplane.schemas.cache_event import CacheEvent, CacheEventKind
from loraplane.schemas.manifest import Manifest, ManifestFile
from loraplane.schemas.reasons import ArtifactReason as Reason
from loraplane.tiny_model import TINY_BASE_MODEL, build_adapter
from loraplane.workers.host_tier import HostTier
from loraplane.workers.host_tier_entry import ADAPTER_DIR, RECORD_FILE
from tests.hostile_corpus import CASES, LIMITS, PREFIX, hostile
from tests.unit.test_agent_fetches import real_tier, running_agent
from tests.unit.test_gateway import converge
from tests.unit.test_verification import MemoryArtifact
from tests.unit.test_vllm_resolver import LocalFetcher

# (unsigned view, mantissa bits) of each float dtype, as IEEE 754 / bfloat16 define it
FORMATS = {"F16": (np.uint16, 10), "BF16": (np.uint16, 7), "F32": (np.uint32, 23)}
FORMATS["F64"] = (np.uint64, 52)


FLOAT16_MAX = 65504.0  # float16's largest finite value
SCALING = 16 / 8  # the tiny adapter's lora_alpha / r: vLLM multiplies lora_B by it


def floats(dtype: str, bits: np.ndarray) -> np.ndarray:
    """The values of ``bits`` as float64 (bfloat16 is float32's upper half)."""
    if dtype == "BF16":
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    kind = {"F16": np.float16, "F32": np.float32, "F64": np.float64}[dtype]
    return bits.view(kind).astype(np.float64)


def finite(dtype: str, bits: np.ndarray) -> np.ndarray:
    """numpy's verdict on each value."""
    return np.isfinite(floats(dtype, bits))


def limit_of(name: str, scaling: float = SCALING) -> float:
    """The largest magnitude vLLM serves of tensor ``name`` without an infinity: float16's
    largest value, for lora_B divided by the scaling it is multiplied by in float16."""
    return FLOAT16_MAX / max(scaling, 1.0) if ".lora_B." in name else FLOAT16_MAX


def served(dtype: str, bits: np.ndarray, limit: float) -> np.ndarray:
    values = floats(dtype, bits)
    return np.isfinite(values) & (np.abs(values) <= limit)


def top_bits(dtype: str, limit: float) -> int:
    """The largest non-negative bit pattern of ``dtype`` whose value is at most ``limit``
    (a binary search over the patterns, which order as their values do)."""
    view, _ = FORMATS[dtype]
    lo, hi = 0, (1 << (8 * DTYPE_BYTES[dtype] - 1)) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if served(dtype, np.array([mid], view), limit)[0]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def safetensors_bytes(tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> bytes:
    """A safetensors file of ``name -> (dtype, shape, raw bytes)`` in the given order."""
    header, at = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + len(data)]}
        at += len(data)
    body = json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + b"".join(d for _, _, d in tensors.values())


def verify(config: bytes, weights: bytes) -> Verdict:
    """The verifier on an artifact of ``config`` and ``weights`` with its manifest."""
    files = {CONFIG_NAME: config, WEIGHTS_NAME: weights}
    manifest = Manifest(
        files=[
            ManifestFile(path=p, sha256=hashlib.sha256(b).hexdigest(), size=len(b))
            for p, b in files.items()
        ]
    )
    return verify_artifact(
        MemoryArtifact({**files, MANIFEST_NAME: manifest.canonical_bytes()}), LIMITS
    )


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_adapter(tmp_path_factory.mktemp("good") / "adapter", seed=7)


@pytest.fixture(scope="module")
def shapes(good: Path) -> dict[str, tuple[int, ...]]:
    """The tiny adapter's tensors, by name: what the shape checks accept."""
    return {n: a.shape for n, a in sorted(load_file(str(good / WEIGHTS_NAME)).items())}


def edge_values(dtype: str, limit: float) -> list[int]:
    """The served values at the edges, as bits: +-the largest at most ``limit``, +-the
    smallest normal, the largest and smallest subnormal, -0.0 and +0.0."""
    _, mantissa = FORMATS[dtype]
    nbits = 8 * DTYPE_BYTES[dtype]
    sign = 1 << (nbits - 1)
    top = top_bits(dtype, limit)
    normal, sub_max = 1 << mantissa, (1 << mantissa) - 1
    return [top, top | sign, normal, normal | sign, sub_max, 1, 1 | sign, sign, 0]


def random_finite(dtype: str, n: int, rng: np.random.Generator, limit: float) -> np.ndarray:
    """``n`` random bit patterns of ``dtype``, every one finite and at most ``limit`` in
    magnitude (subnormals and signed zeros included), with each edge value among them."""
    view, _ = FORMATS[dtype]
    sign = view(1 << (8 * DTYPE_BYTES[dtype] - 1))
    bits = rng.integers(0, np.iinfo(view).max, n, dtype=view, endpoint=True)
    while not (ok := served(dtype, bits, limit)).all():  # halve the bits of what is past it
        bits[~ok] = (bits[~ok] & sign) | ((bits[~ok] & ~sign) >> view(1))
    edges = edge_values(dtype, limit)
    bits[rng.choice(n, len(edges), replace=False)] = np.array(edges, dtype=view)
    assert served(dtype, bits, limit).all()
    return bits


def nonfinite(dtype: str, kind: str, negative: bool, payload: int) -> int:
    """NaN (with a non-zero mantissa from ``payload``) or an infinity, as bits."""
    _, mantissa = FORMATS[dtype]
    nbits = 8 * DTYPE_BYTES[dtype]
    exponent = ((1 << (nbits - 1 - mantissa)) - 1) << mantissa
    low = 0 if kind == "inf" else 1 + payload % ((1 << mantissa) - 1)
    return (1 << (nbits - 1) if negative else 0) | exponent | low


def weights(
    dtype: str, shapes: dict[str, tuple[int, ...]], seed: int
) -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {
        n: (dtype, s, random_finite(dtype, int(np.prod(s)), rng, limit_of(n)))
        for n, s in shapes.items()
    }


def as_file(tensors: dict[str, tuple[str, tuple[int, ...], np.ndarray]]) -> bytes:
    return safetensors_bytes({n: (d, s, b.tobytes()) for n, (d, s, b) in tensors.items()})


@pytest.fixture(scope="module")
def config(good: Path) -> bytes:
    return (good / CONFIG_NAME).read_bytes()


CHUNKS = st.sampled_from([8, 24, 4096, VALUE_CHUNK_BYTES])  # multiples of every dtype size
prop = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@prop
@given(
    dtype=st.sampled_from(sorted(FORMATS)),
    seed=st.integers(0, 2**32 - 1),
    chunk=CHUNKS,
    data=st.data(),
)
def test_a_nan_or_infinity_anywhere_in_any_float_dtype_is_refused(
    config: bytes,
    shapes: dict[str, tuple[int, ...]],
    dtype: str,
    seed: int,
    chunk: int,
    data: st.DataObject,
) -> None:
    tensors = weights(dtype, shapes, seed)
    name = data.draw(st.sampled_from(sorted(tensors)), "tensor")
    bits = tensors[name][2]
    at = data.draw(st.integers(0, len(bits) - 1), "position")
    kind = data.draw(st.sampled_from(["nan", "inf"]), "kind")
    value = nonfinite(dtype, kind, data.draw(st.booleans()), data.draw(st.integers(0, 2**52)))
    bits[at] = value
    assert not finite(dtype, bits[at : at + 1]).any()
    with patch.object(verification, "VALUE_CHUNK_BYTES", chunk):
        verdict = verify(config, as_file(tensors))
    assert verdict.reasons == (Reason.tensor_value_nonfinite,), verdict.refusals
    [refusal] = verdict.refusals
    what = "NaN" if kind == "nan" else "-inf" if value >> (8 * DTYPE_BYTES[dtype] - 1) else "+inf"
    assert (refusal.path, refusal.detail) == (WEIGHTS_NAME, f"{name}: {what} at [{at}]")


@prop
@given(dtype=st.sampled_from(sorted(FORMATS)), seed=st.integers(0, 2**32 - 1), chunk=CHUNKS)
def test_served_values_pass_the_limit_subnormals_and_negative_zero_included(
    config: bytes, shapes: dict[str, tuple[int, ...]], dtype: str, seed: int, chunk: int
) -> None:
    with patch.object(verification, "VALUE_CHUNK_BYTES", chunk):
        verdict = verify(config, as_file(weights(dtype, shapes, seed)))
    assert verdict.ok, verdict.refusals


@prop
@given(
    dtype=st.sampled_from(sorted(FORMATS)),
    seed=st.integers(0, 2**32 - 1),
    chunk=CHUNKS,
    data=st.data(),
)
def test_attack_a_finite_value_vllm_serves_as_an_infinity_is_refused(
    config: bytes,
    shapes: dict[str, tuple[int, ...]],
    dtype: str,
    seed: int,
    chunk: int,
    data: st.DataObject,
) -> None:
    """ATTACK: a value finite in the file but past float16's range once vLLM serves it (cast
    to its serving dtype; lora_B also multiplied by alpha / r there) passed as finite, and
    vLLM served it as an infinity: NaN logits for every request of the adapter, as a NaN
    in the file gives. Anywhere in any tensor of any float dtype it is refused as
    ``tensor_value_overflows``, naming the tensor and the index."""
    tensors = weights(dtype, shapes, seed)
    name = data.draw(st.sampled_from(sorted(tensors)), "tensor")
    bits = tensors[name][2]
    at = data.draw(st.integers(0, len(bits) - 1), "position")
    top = top_bits(dtype, limit_of(name))
    exponent = ((1 << (8 * DTYPE_BYTES[dtype] - 1 - FORMATS[dtype][1])) - 1) << FORMATS[dtype][1]
    assume(top + 1 < exponent)  # float16's own largest value in a lora_A: nothing past it
    past = data.draw(st.integers(top + 1, exponent - 1), "bits past the limit")
    bits[at] = past | (1 << (8 * DTYPE_BYTES[dtype] - 1) if data.draw(st.booleans()) else 0)
    assert finite(dtype, bits).all() and not served(dtype, bits[at : at + 1], limit_of(name))[0]
    with patch.object(verification, "VALUE_CHUNK_BYTES", chunk):
        verdict = verify(config, as_file(tensors))
    assert verdict.reasons == (Reason.tensor_value_overflows,), verdict.refusals
    [refusal] = verdict.refusals
    assert refusal.path == WEIGHTS_NAME
    assert refusal.detail.startswith(f"{name}: ") and f" at [{at}] " in refusal.detail


def rslora(config: bytes) -> bytes:
    return json.dumps({**json.loads(config), "use_rslora": True}).encode()


@pytest.mark.parametrize(
    ("dtype", "half", "value", "rs", "refused"),
    [
        ("F32", "lora_A", 1e6, False, True),  # +inf as float16
        ("F32", "lora_A", FLOAT16_MAX, False, False),
        ("F64", "lora_A", 1e300, False, True),  # +inf as float16, bfloat16 and float32 alike
        ("BF16", "lora_A", -1e30, False, True),
        ("F16", "lora_B", 40000.0, False, True),  # finite in the file; * 16/8 = 80000
        ("F16", "lora_B", FLOAT16_MAX / SCALING, False, False),
        ("F32", "lora_B", 12000.0, False, False),  # * 16/8 = 24000
        ("F32", "lora_B", 12000.0, True, True),  # rsLoRA: * 16/sqrt(8) = 33941
    ],
)
def test_attack_values_past_float16_once_scaled_are_refused(
    config: bytes,
    shapes: dict[str, tuple[int, ...]],
    dtype: str,
    half: str,
    value: float,
    rs: bool,
    refused: bool,
) -> None:
    """ATTACK, the cases measured on vLLM 0.32's own loader (``LoRAModel`` at float16,
    ``optimize()`` merging the scaling): each refused one holds an infinity there."""
    scaling = 16 / math.sqrt(8) if rs else SCALING
    tensors = weights(dtype, shapes, 5)
    for name, (_, _, bits) in tensors.items():  # within every limit, rsLoRA's included
        bits[~served(dtype, bits, limit_of(name, scaling))] = 0
    name = f"{PREFIX}.1.self_attn.v_proj.{half}.weight"
    bits = tensors[name][2]
    widened = np.array([value], np.float32 if dtype == "BF16" else floats_type(dtype))
    bits[7] = widened.view(np.uint32)[0] >> 16 if dtype == "BF16" else widened.view(bits.dtype)[0]
    verdict = verify(rslora(config) if rs else config, as_file(tensors))
    if not refused:
        assert verdict.ok, verdict.refusals
        return
    assert verdict.reasons == (Reason.tensor_value_overflows,), verdict.refusals
    shown = floats(dtype, bits[7:8])[0]  # bfloat16 keeps float32's upper half of it
    assert verdict.refusals[0].detail.startswith(f"{name}: {shown:.6g} at [7] is past ")


def floats_type(dtype: str) -> type[np.floating]:  # type: ignore[type-arg]
    return {"F16": np.float16, "F32": np.float32, "F64": np.float64}[dtype]


@pytest.mark.parametrize("dtype", sorted(FORMATS))
def test_a_nan_in_every_tensor_is_one_refusal_each(
    config: bytes, shapes: dict[str, tuple[int, ...]], dtype: str
) -> None:
    tensors = weights(dtype, shapes, 1)
    for _, _, bits in tensors.values():
        bits[-1] = nonfinite(dtype, "nan", False, 0)
    verdict = verify(config, as_file(tensors))
    assert [r.detail for r in verdict.refusals] == [
        f"{n}: NaN at [{len(b) - 1}]" for n, (_, _, b) in tensors.items()
    ]


def test_every_float_dtype_the_parser_accepts_is_scanned() -> None:
    """A float dtype added to the parser's table without its exponent bits would be loaded
    unscanned: safetensors names floats F<bits>[_...] and BF16; everything else (I8..I64,
    U8..U64, BOOL) holds no NaN."""
    floats = {d for d in DTYPE_BYTES if d.startswith(("F", "BF"))}
    assert floats == set(NONFINITE_BITS)


@pytest.mark.parametrize(
    "dtype", ["I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64", "BOOL", "F8_E4M3", "F8_E5M2"]
)
def test_integer_bool_and_f8_tensors_are_refused_by_dtype_not_read_as_floats(
    config: bytes, dtype: str
) -> None:
    """Bytes that would be NaN in any float reading, under a dtype the parser does not take:
    ``tensor_dtype_invalid``, and never a value refusal: integer and bool bytes are no
    floats, and an F8 tensor is refused whole before its values could be read."""
    name = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"
    verdict = verify(config, safetensors_bytes({name: (dtype, (8, 8), b"\xff" * 64)}))
    assert Reason.tensor_dtype_invalid in verdict.reasons
    assert Reason.tensor_value_nonfinite not in verdict.reasons


@pytest.mark.parametrize("dtype", sorted(FORMATS))
def test_zero_size_tensors_read_nothing_and_hide_no_neighbour(config: bytes, dtype: str) -> None:
    """Zero-size tensors beside a NaN, at the same offset: the NaN is found, the empty
    tensors are judged by shape only (never a value refusal, never an error)."""
    nan = np.array([nonfinite(dtype, "nan", True, 5)], FORMATS[dtype][0]).tobytes()
    tensors = {
        f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": (dtype, (0, 128), b""),
        f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": (dtype, (1,), nan),
        f"{PREFIX}.0.self_attn.v_proj.lora_A.weight": (dtype, (8, 0), b""),
    }
    verdict = verify(config, safetensors_bytes(tensors))
    values = [r for r in verdict.refusals if r.reason == Reason.tensor_value_nonfinite]
    assert [r.detail for r in values] == [f"{PREFIX}.0.self_attn.q_proj.lora_B.weight: NaN at [0]"]


def test_the_values_are_read_in_bounded_chunks(
    config: bytes, shapes: dict[str, tuple[int, ...]]
) -> None:
    """Memory stays bounded by the chunk whatever the file's size: no read of the values is
    longer than ``VALUE_CHUNK_BYTES``, and every value byte is read exactly once."""
    data = as_file(weights("F64", shapes, 3))
    reads: list[tuple[int, int]] = []
    artifact = MemoryArtifact({CONFIG_NAME: config, WEIGHTS_NAME: data})
    original = artifact.read

    def spy(path: str, offset: int, length: int) -> bytes:
        if path == WEIGHTS_NAME and offset > 8:
            reads.append((offset, length))
        return original(path, offset, length)

    artifact.read = spy  # type: ignore[method-assign]
    with patch.object(verification, "VALUE_CHUNK_BYTES", 4096):
        verify_artifact(artifact, LIMITS)
    values = [(o, n) for o, n in reads if n != struct.unpack("<Q", data[:8])[0]]
    assert max(n for _, n in values) <= 4096
    assert sum(n for _, n in values) == len(data) - 8 - struct.unpack("<Q", data[:8])[0]


# ---- the worker: the path a fetched artifact takes -----------------------------------------
NAN = next(c for c in CASES if c.id == "NaN weight")


@pytest.mark.asyncio(loop_scope="session")
async def test_attack_a_nan_adapter_is_refused_by_the_worker_and_never_loaded(
    tmp_path: Path,
) -> None:
    """ATTACK, through the worker's own install path (agent -> ``HostTier.ensure`` -> fetch
    -> ``verify_artifact``): a signed adapter whose weights hold a NaN (published as it is:
    the manifest and the record describe its bytes faithfully) passed every check and was
    loaded into vLLM. It is refused as ``tensor_value_nonfinite`` naming the tensor, on the
    cache-events topic and to the waiting request (as a permanent refusal, not retried);
    vLLM never sees it and the host tier keeps nothing of it."""
    good = build_adapter(tmp_path / "src", seed=1)
    artifact, rec = hostile(NAN, good, tmp_path / "case")
    rec = rec.model_copy(update={"status": AdapterStatus.active, "base_model": TINY_BASE_MODEL})
    fetcher = LocalFetcher()
    manifest = Manifest.model_validate_json((artifact.root / MANIFEST_NAME).read_bytes())
    fetcher.sources[rec.artifact_uri] = (artifact.root, manifest)
    tier = real_tier(HostTier, tmp_path / "tier", fetcher)
    async with running_agent(tmp_path, tier, [rec], TINY_BASE_MODEL) as (fake, agent, sink):
        waiter = agent.request_load(rec)
        await converge(agent)
        outcome = await asyncio.wait_for(waiter, 15)
        assert (outcome.ok, outcome.reason, outcome.permanent) == (
            False,
            Reason.tensor_value_nonfinite,
            True,
        )
        events = [e for e in sink.messages(CacheEvent) if e.lora_name == rec.lora_name]
        assert [(e.kind, e.reason) for e in events] == [
            (CacheEventKind.refuse, Reason.tensor_value_nonfinite)
        ]
        assert f"{PREFIX}.1.self_attn.v_proj.lora_B.weight: NaN at [" in events[0].detail
        assert (fake.adapters, fake.load_calls) == ({}, 0)
        assert list(tier.root.iterdir()) == []


def test_a_nan_entry_left_by_an_earlier_worker_is_dropped_at_startup(tmp_path: Path) -> None:
    """A host-tier entry installed before this check (a worker upgraded in place) holds a NaN
    adapter: the startup scan verifies every entry again and drops it, naming the reason,
    instead of handing it to vLLM."""
    good = build_adapter(tmp_path / "src", seed=1)
    artifact, rec = hostile(NAN, good, tmp_path / "case")
    rec = rec.model_copy(update={"status": AdapterStatus.active, "base_model": TINY_BASE_MODEL})
    entry = tmp_path / "tier" / rec.lora_name
    shutil.copytree(artifact.root, entry / ADAPTER_DIR)
    (entry / RECORD_FILE).write_text(rec.model_dump_json())
    tier = real_tier(HostTier, tmp_path / "tier", LocalFetcher())
    assert tier.startup_report.dropped == ((rec.lora_name, "tensor_value_nonfinite"),)
    assert tier.get(rec.lora_name) is None and not entry.exists()
