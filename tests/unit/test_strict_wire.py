"""Strict JSON where a signature is checked (schemas.strict_json, codec.decode_signed), the
canonical URI rule, and the CLI tools on hostile bytes: a reason, never a traceback."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from loraplane.cli import app
from loraplane.registry.fold import Rejected, evaluate
from loraplane.schemas.adapter import s3_uri_problem
from loraplane.schemas.codec import SchemaError, decode_signed, encode
from loraplane.schemas.keyring import KeyringError, parse_keyring, save_keyring
from loraplane.schemas.lifecycle import LifecycleEvent
from loraplane.schemas.reasons import DecodeReason
from loraplane.schemas.reasons import RegistryRejection as Reason
from loraplane.schemas.strict_json import (
    MAX_DEPTH,
    MAX_SIGNED_BYTES,
    StrictJsonError,
    nesting_depth,
    strict_loads,
    unicode_text,
)
from tests.lifecycle_kit import make_kit

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
KIT = make_kit(NOW)
EVENT = KIT.event("ci", "publish", "support-bot", "1", 1, NOW)
RAW = encode(EVENT)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)

hostile_bytes = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda n: b"[" * n + b"]" * n, st.integers(0, 5000)),
    st.builds(lambda n: b'{"a":' * n + b"1" + b"}" * n, st.integers(0, 3000)),
    st.builds(
        lambda v: json.dumps(v, allow_nan=True).encode("utf-8", "surrogatepass"), json_values
    ),
    # splices of a real signed event: cut, duplicated, prefixed, suffixed
    st.builds(lambda i, j: RAW[:i] + RAW[j:], st.integers(0, len(RAW)), st.integers(0, len(RAW))),
    st.builds(
        lambda pre, post: pre + RAW + post,
        st.sampled_from([b"", b"\xef\xbb\xbf", b" ", b"[", b"\x00"]),
        st.sampled_from([b"", b"x", b"{}", b"\n", b"]", b"\xff"]),
    ),
    st.builds(
        lambda k, v: RAW.replace(
            b'{"schema_version"', b'{"' + k.encode() + b'":' + v + b',"schema_version"', 1
        ),
        st.sampled_from(["version", "seq", "action", "tenant_id", "record", "signature"]),
        st.sampled_from([b'"9"', b"1", b"true", b"null", b"NaN", b"1e999", b"{}"]),
    ),
)


@given(hostile_bytes)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_strict_loads_raises_only_its_own_error(raw: bytes) -> None:
    try:
        strict_loads(raw)
    except StrictJsonError as exc:
        assert exc.reason in (DecodeReason.malformed, DecodeReason.too_large)


@given(hostile_bytes)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_evaluate_turns_any_bytes_into_a_decision(raw: bytes) -> None:
    decision = evaluate(raw, KIT.keyring, lambda _: None, NOW)
    if raw != RAW:
        assert isinstance(decision, Rejected) or json.loads(raw) == json.loads(RAW)
    if isinstance(decision, Rejected):
        assert decision.reason in Reason


@given(json_values)
@settings(max_examples=200, deadline=None)
def test_strict_loads_agrees_with_json_on_strict_documents(value: object) -> None:
    """On documents that are strict (finite numbers, well-formed strings, no duplicate keys
    by construction) strict_loads reads what json.loads reads."""
    text = json.dumps(value, allow_nan=True)
    try:
        expected = json.loads(text)
        text.encode("utf-8")
    except (ValueError, UnicodeEncodeError):
        return
    try:
        got = strict_loads(text.encode())
    except StrictJsonError:
        return  # NaN, Infinity, huge ints, lone surrogates, depth: refused, never misread
    assert got == expected or json.dumps(got) == json.dumps(expected)


@given(
    json_values | st.lists(st.text(alphabet="a\ud800\udfff\ud83d", max_size=3), max_size=4),
    st.integers(0, 3000),
)
def test_unicode_text_is_the_encoders_answer_at_any_depth(value: object, depth: int) -> None:
    """``unicode_text`` says what encoding every string says (a lone surrogate is no text,
    a pair is one character), however deep the value: past the recursion limit, where the
    encoder raises, it still answers."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        encodes = True
    except UnicodeEncodeError:
        encodes = False
    assert unicode_text(value) is encodes
    nested: object = value
    for _ in range(depth):
        nested = [nested]
    assert unicode_text({"x": nested}) is encodes


@given(st.integers(0, 200), st.text(alphabet='[]{}"\\ab', max_size=50))
def test_nesting_depth_counts_only_outside_strings(n: int, noise: str) -> None:
    s = json.dumps(noise)
    assert nesting_depth(("[" * n + s + "]" * n).encode()) == n


@pytest.mark.parametrize(
    "raw",
    [
        b'"' + b'\\"' * 600_000,  # one string that never ends, each escape a new start
        b'{"a":["' + b'\\"[' * 400_000,
    ],
)
def test_an_unterminated_string_is_read_once(raw: bytes) -> None:
    """The depth pre-pass is linear in the bytes: a string that never closes is scanned
    once, not again from every quote inside it (quadratic: hours for 1 MiB)."""
    raw = raw[: MAX_SIGNED_BYTES - 1]
    assert nesting_depth(raw) <= 2
    with pytest.raises(StrictJsonError) as info:
        strict_loads(raw)
    assert info.value.reason is DecodeReason.malformed


@pytest.mark.parametrize(
    "raw, why",
    [
        (b'{"a":1,"a":1}', "duplicate key"),
        (b'{"a":{"b":1,"b":2}}', "duplicate key"),
        (b"[NaN]", "NaN"),
        (b"[-Infinity]", "Infinity"),
        (b"[1e400]", "overflows"),
        (b"[" + b"1" * 21 + b"]", "digits"),
        (b'{"seq": -0}', "negative zero"),  # an int to Python, -0.0 to serde_json and JS
        (b'["\\udc00"]', "surrogate"),
        (b"\xef\xbb\xbf{}", "byte-order mark"),
        (b"{} {}", "not JSON"),
        (b'{"a":"\xff"}', "not UTF-8"),
        (b"", "empty"),
        (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), "nested"),
    ],
)
def test_strict_loads_refuses(raw: bytes, why: str) -> None:
    with pytest.raises(StrictJsonError, match=why):
        strict_loads(raw)


def test_size_is_bounded_before_parsing() -> None:
    with pytest.raises(StrictJsonError) as info:
        strict_loads(b"[" + b"0," * 600_000 + b"0]")
    assert info.value.reason is DecodeReason.too_large


def test_decode_signed_round_trips_our_own_events() -> None:
    assert decode_signed(LifecycleEvent, RAW) == EVENT
    canary = KIT.event("ci", "canary", "support-bot", "1", 2, NOW, canary_percent=10.0)
    as_int = encode(canary).replace(b'"canary_percent":10.0', b'"canary_percent":10')
    assert decode_signed(LifecycleEvent, as_int) == canary  # an integer is a number


@pytest.mark.parametrize(
    "raw",
    [
        RAW.replace(b'"schema_version":1', b'"schema_version":true'),
        RAW.replace(b'"schema_version":1', b'"schema_version":1.0'),
        RAW.replace(b'"rank":8', b'"rank":8.0'),
        RAW.replace(b'"seq":1,', b'"seq":"1",'),
    ],
)
def test_decode_signed_refuses_coercion(raw: bytes) -> None:
    assert raw != RAW
    with pytest.raises(SchemaError) as info:
        decode_signed(LifecycleEvent, raw)
    assert info.value.reason is DecodeReason.invalid


@pytest.mark.parametrize(
    "uri, ok",
    [
        ("s3://b/acme/a/1-12345678/", True),
        ("s3://b/acme/a/../x/", False),
        ("s3://b/acme/./a/", False),
        ("s3://b/acme//a/", False),
        ("s3://b/acme/%2e%2e/a/", False),
        ("s3://b/acme\\a/", False),
        ("s3://b/acme/a", False),
        ("s3:///acme/", False),
        ("http://b/a/", False),
    ],
)
def test_s3_uri_must_be_canonical(uri: str, ok: bool) -> None:
    assert (s3_uri_problem(uri) is None) is ok


@given(
    st.lists(st.sampled_from(["a", ".", "..", "", "%2e", "b.c", "x\\y"]), min_size=1, max_size=5)
)
def test_s3_uri_problem_refuses_every_non_canonical_segment(segments: list[str]) -> None:
    uri = "s3://bucket/" + "/".join(segments) + "/"
    canonical = all(s not in ("", ".", "..") and "%" not in s and "\\" not in s for s in segments)
    assert (s3_uri_problem(uri) is None) is canonical


# --- the tools ------------------------------------------------------------------------------


def test_keyring_parser_turns_deep_yaml_into_a_keyring_error() -> None:
    with pytest.raises(KeyringError):
        parse_keyring("[" * 100_000 + "]" * 100_000)
    with pytest.raises(KeyringError):
        parse_keyring("keys: " + "[" * 100_000)


@pytest.mark.parametrize(
    "payload",
    [
        b"[" * 200_000 + b"]" * 200_000,  # crashed with RecursionError
        b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
        b"\xef\xbb\xbf" + RAW,
        RAW.replace(b'{"schema_version"', b'{"version":"9","schema_version"'),
        b"\xff\xfe garbage\n[1,2\n",
    ],
)
def test_lifecycle_verify_reports_a_reason_for_hostile_files(
    tmp_path: Path, payload: bytes
) -> None:
    ring = tmp_path / "keyring.yaml"
    save_keyring(KIT.keyring, ring)
    events = tmp_path / "events.json"
    events.write_bytes(payload)
    result = CliRunner().invoke(app, ["lifecycle", "verify", str(events), "--keyring", str(ring)])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "reject malformed" in result.output or "reject invalid" in result.output


@pytest.mark.parametrize("payload", [b"[" * 200_000, b'{"a":1,"a":2}', b"[]", b"\xff"])
def test_lifecycle_verify_refuses_a_hostile_state_file(tmp_path: Path, payload: bytes) -> None:
    ring = tmp_path / "keyring.yaml"
    save_keyring(KIT.keyring, ring)
    events, state = tmp_path / "e.json", tmp_path / "state.json"
    events.write_bytes(RAW)
    state.write_bytes(payload)
    result = CliRunner().invoke(
        app, ["lifecycle", "verify", str(events), "--keyring", str(ring), "--state", str(state)]
    )
    assert result.exit_code == 1 and "error:" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize("payload", [b"[" * 200_000, b"[1]", b'{"a":1,"a":2}', b"\xff"])
def test_artifact_verify_refuses_hostile_record_and_config(tmp_path: Path, payload: bytes) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(payload)
    folder = tmp_path / "adapter"
    folder.mkdir()
    for option in ("--record", "--model-config"):
        result = CliRunner().invoke(app, ["artifact", "verify", str(folder), option, str(bad)])
        assert result.exit_code == 2, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)


def test_keys_tenant_sets_the_priority_ceiling(tmp_path: Path) -> None:
    from loraplane.schemas.adapter import Priority
    from loraplane.schemas.keyring import load_keyring

    ring = tmp_path / "keyring.yaml"
    save_keyring(KIT.keyring, ring)
    done = CliRunner().invoke(
        app,
        [
            "keys",
            "tenant",
            "--keyring",
            str(ring),
            "--tenant",
            "beta",
            "--max-priority",
            "platinum",
        ],
    )
    assert done.exit_code == 0, done.output
    loaded = load_keyring(ring)
    assert loaded.max_priority("beta") is Priority.platinum
    assert loaded.max_priority("nobody") is Priority.gold
    assert [k.key_id for k in loaded.keys] == [k.key_id for k in KIT.keyring.keys]
    bad = CliRunner().invoke(
        app,
        ["keys", "tenant", "--keyring", str(ring), "--tenant", "beta", "--max-priority", "diamond"],
    )
    assert bad.exit_code == 1 and "error:" in bad.output


# --- artifacts: the bytes the signed digest pins have one reading ---------------------------


@pytest.fixture(scope="module")
def good_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loraplane.tiny_model import build_adapter

    return build_adapter(tmp_path_factory.mktemp("good") / "adapter", seed=7)


def test_manifest_with_a_duplicate_key_is_refused(good_adapter: Path, tmp_path: Path) -> None:
    """The manifest's own bytes match the signed digest; a first-key reader would see an
    empty file list, the old parser took the last. Now refused as manifest_invalid."""
    import hashlib
    import shutil

    from loraplane.artifact.directory import DirectoryArtifact
    from loraplane.artifact.verification import MANIFEST_NAME, verify_artifact
    from loraplane.schemas.reasons import ArtifactReason
    from tests.hostile_corpus import LIMITS, record_for, write_manifest

    folder = tmp_path / "a"
    shutil.copytree(good_adapter, folder)
    manifest = write_manifest(folder)
    body = (folder / MANIFEST_NAME).read_bytes()
    hostile = b'{"files":[],' + body[1:]
    (folder / MANIFEST_NAME).write_bytes(hostile)
    record = record_for(manifest, sha256=hashlib.sha256(hostile).hexdigest())
    verdict = verify_artifact(DirectoryArtifact(folder), LIMITS, record)
    assert ArtifactReason.manifest_invalid in verdict.reasons, verdict.refusals


def test_safetensors_header_with_a_duplicate_tensor_is_refused(
    good_adapter: Path, tmp_path: Path
) -> None:
    import shutil
    import struct

    from loraplane.artifact.directory import DirectoryArtifact
    from loraplane.artifact.verification import WEIGHTS_NAME, verify_artifact
    from loraplane.schemas.reasons import ArtifactReason
    from tests.hostile_corpus import LIMITS, record_for, write_manifest

    folder = tmp_path / "a"
    shutil.copytree(good_adapter, folder)
    data = (folder / WEIGHTS_NAME).read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    first = next(k for k in header if k != "__metadata__")
    decoy = json.dumps({first: {**header[first], "data_offsets": [0, 0]}})[:-1] + ","
    text = (decoy + data[8 : 8 + length].decode()[1:]).encode()
    (folder / WEIGHTS_NAME).write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])
    record = record_for(write_manifest(folder))
    verdict = verify_artifact(DirectoryArtifact(folder), LIMITS, record)
    assert ArtifactReason.header_invalid in verdict.reasons, verdict.refusals
