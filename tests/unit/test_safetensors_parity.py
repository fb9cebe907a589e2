"""What the verifier reads of a safetensors header is what vLLM's parser reads.

vLLM opens adapter weights with the safetensors library, whose header parser is Rust
(serde_json). A header the verifier accepts but that parser reads otherwise would be
checked as one set of tensors and served as another, or refused by vLLM only at load
after every check passed. So every header the verifier accepts must deserialize in the
real library (``safetensors.deserialize``, the parser ``safe_open`` runs) to the same
tensors: names, dtypes, shapes and bytes. The headers are drawn with the spellings JSON
allows for the same values: whitespace between tokens, escaped names, ``-0`` for ``0``,
any key order and any order of the data.
"""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError, deserialize

from loraplane.artifact.verification import DTYPE_BYTES, parse_safetensors_header
from loraplane.schemas.reasons import ArtifactReason as Reason

WHITESPACE = st.text(alphabet=" \t\n\r", max_size=2)


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self, path: str, offset: int, length: int) -> bytes:
        return self.data[offset : offset + length]


@st.composite
def headers(draw: st.DrawFn) -> bytes:
    """A safetensors file of 1-4 tensors whose header spells its values in any way JSON
    allows, with the data in any order."""
    names = draw(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=4, unique=True))
    tensors = []
    for name in names:
        dtype = draw(st.sampled_from(sorted(DTYPE_BYTES)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        tensors.append((name, dtype, shape))
    order = draw(st.permutations(range(len(tensors))))
    offsets: dict[int, tuple[int, int]] = {}
    at = 0
    for i in order:
        _, dtype, shape = tensors[i]
        size = DTYPE_BYTES[dtype]
        for d in shape:
            size *= d
        offsets[i] = (at, at + size)
        at += size

    def ws() -> str:
        return draw(WHITESPACE)

    def number(n: int) -> str:
        return draw(st.sampled_from(["0", "-0"])) if n == 0 else str(n)

    def array(values: list[int]) -> str:
        return "[" + ws() + ("," + ws()).join(number(v) + ws() for v in values) + "]"

    entries = []
    for i, (name, dtype, shape) in enumerate(tensors):
        key = json.dumps(name, ensure_ascii=draw(st.booleans()))
        fields = [
            f'"dtype"{ws()}:{ws()}"{dtype}"',
            f'"shape"{ws()}:{ws()}{array(shape)}',
            f'"data_offsets"{ws()}:{ws()}{array(list(offsets[i]))}',
        ]
        fields = draw(st.permutations(fields))
        entries.append(f"{key}{ws()}:{ws()}{{{ws()}{(',' + ws()).join(fields)}{ws()}}}")
    if draw(st.booleans()):
        entries.append('"__metadata__":' + ws() + '{"format":' + ws() + '"pt"}')
    text = ws() + "{" + ws() + ("," + ws()).join(draw(st.permutations(entries))) + "}" + ws()
    body = text.encode()
    data = bytes(draw(st.binary(min_size=at, max_size=at)))
    return struct.pack("<Q", len(body)) + body + data


@settings(max_examples=400, deadline=None)
@given(headers())
def test_a_header_the_verifier_accepts_reads_the_same_in_the_safetensors_library(
    raw: bytes,
) -> None:
    ours, refusals = parse_safetensors_header(_Bytes(raw), "w", len(raw), 1 << 20)
    if refusals:
        return  # refused: never served, whatever the library would read
    try:
        theirs = {name: t for name, t in deserialize(raw)}
    except SafetensorError as exc:  # pragma: no cover - the failure this test exists for
        pytest.fail(f"the verifier accepts a header the library refuses: {exc}")
    assert sorted(theirs) == sorted(t.name for t in ours)
    for t in ours:
        assert (theirs[t.name]["dtype"], theirs[t.name]["shape"]) == (t.dtype, list(t.shape))
        assert bytes(theirs[t.name]["data"]) == raw[t.span[0] : t.span[1]]


@pytest.mark.parametrize(
    "spelling",
    [
        '{"a": {"dtype": "F32", "shape": [1], "data_offsets": [-0, 4]}}',
        '{"a": {"dtype": "F32", "shape": [-0], "data_offsets": [0, 0]}, '
        '"b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
    ],
)
def test_attack_negative_zero_in_a_header_is_refused(spelling: str) -> None:
    """ATTACK: ``-0`` is an integer to Python's json and a float to the library's
    serde_json: the verifier passed these headers, and the library vLLM loads them with
    refuses them ("invalid type: floating point `-0.0`, expected usize"), at load, after
    every check passed. Refused as ``header_invalid``
    (strict JSON refuses ``-0`` everywhere) before anything is served."""
    body = spelling.encode()
    raw = struct.pack("<Q", len(body)) + body + bytes(4)
    with pytest.raises(SafetensorError, match=r"-0\.0"):
        deserialize(raw)
    _, refusals = parse_safetensors_header(_Bytes(raw), "w", len(raw), 1 << 20)
    assert [r.reason for r in refusals] == [Reason.header_invalid]
    assert "negative zero" in refusals[0].detail
