"""Producers in other languages follow the exported JSON Schemas (``loraplane schemas
export``): a value the schema accepts for a field must be accepted by the consumer that
reads it, and the schema must not promise what the consumer refuses.

A property over real messages (the ones ``test_schemas_ajv`` sends): one field is given a
value drawn from what its exported schema says (its type, bounds, pattern, enum, format),
and wherever ajv (draft 2020-12 with ajv-formats, as a producer would run it) accepts the
message, the consumer's decoder (``codec.decode``, or ``decode_signed`` for signed lifecycle
events) must not refuse that field. JSON Schema's integer is any number without a fraction
(``5.0`` too): read strictly, a lifecycle event refuses those, and its schema says so.
Rules that tie fields together (a record's rank within its compatibility, a view's
evidence) are refused at the model, not at the field, and stay outside a per-field
schema's reach.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplane.schemas import export
from loraplane.schemas.codec import SchemaError, decode, decode_signed
from loraplane.schemas.fast_decode import unanchored
from tests.unit.test_schemas_ajv import NODE_MODULES, messages, node, wire

# Reads [name, message] lines on stdin and answers one [valid, errors] line each.
AJV_SERVER_JS = """
const Ajv2020 = require("ajv/dist/2020").default;
const addFormats = require("ajv-formats").default;
const fs = require("fs");
const dir = process.argv[1];
const ajv = new Ajv2020({allErrors: true});
addFormats(ajv);
const validators = {};
for (const f of fs.readdirSync(dir)) {
  if (f.endsWith(".schema.json")) {
    const schema = JSON.parse(fs.readFileSync(dir + "/" + f, "utf8"));
    validators[f.replace(".schema.json", "")] = ajv.compile(schema);
  }
}
require("readline").createInterface({input: process.stdin}).on("line", (line) => {
  const [name, message] = JSON.parse(line);
  const validate = validators[name];
  const ok = validate(message);
  process.stdout.write(JSON.stringify([ok, validate.errors || []]) + "\\n");
});
"""

DECODERS: dict[str, Callable[..., Any]] = {"lifecycle_event": decode_signed}
"""How each topic's consumer decodes (``codec.decode`` where not named)."""


class Ajv:
    def __init__(self, schema_dir: Path) -> None:
        self.proc = subprocess.Popen(
            [node(), "-e", AJV_SERVER_JS, str(schema_dir)],
            cwd=NODE_MODULES.parent,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def valid(self, name: str, message: Any) -> bool:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([name, message]) + "\n")
        self.proc.stdin.flush()
        ok, _ = json.loads(self.proc.stdout.readline())
        return bool(ok)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def ajv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ajv]:
    directory = tmp_path_factory.mktemp("schemas")
    export.export(directory)
    server = Ajv(directory)
    try:
        yield server
    finally:
        server.close()


SENT = {name: wire(m) for name, m in messages().items()}
SCHEMAS = {name: json.loads(export.render(export.MODELS[name])) for name in SENT}


def _resolve(root: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = root["$defs"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def _branches(root: dict[str, Any], schema: dict[str, Any]) -> list[dict[str, Any]]:
    schema = _resolve(root, schema)
    if "anyOf" in schema:
        return [b for s in schema["anyOf"] for b in _branches(root, s)]
    return [schema]


def _fits(value: Any, schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    return not isinstance(value, dict | list)


def leaves(
    root: dict[str, Any], schema: dict[str, Any], value: Any, path: tuple[Any, ...] = ()
) -> Iterator[tuple[tuple[Any, ...], list[dict[str, Any]]]]:
    """Every scalar field of ``value`` (and every one it leaves out) with the schema
    branches it may take."""
    branches = _branches(root, schema)
    container = [b for b in branches if _fits(value, b) and b.get("type") in ("object", "array")]
    if container:
        inner = container[0]
        if isinstance(value, dict):
            for key, sub in inner.get("properties", {}).items():
                if key in value:
                    yield from leaves(root, sub, value[key], (*path, key))
                else:  # a field the message leaves out: drawn like any other
                    yield from leaves(root, sub, None, (*path, key))
        else:
            items = inner.get("items")
            if isinstance(items, dict):
                for n, item in enumerate(value):
                    yield from leaves(root, items, item, (*path, n))
        return
    scalars = [b for b in branches if b.get("type") not in ("object", "array")]
    if scalars:
        yield path, scalars


FIELDS = [
    (name, path, branches)
    for name, message in SENT.items()
    for path, branches in leaves(SCHEMAS[name], SCHEMAS[name], message)
    if path and path[-1] not in ("signature", "schema_version")
]


@st.composite
def rfc3339(draw: st.DrawFn) -> str:
    """RFC 3339 date-times, every form the grammar allows (leap seconds, lower-case
    separators, any fraction, any offset, years 0000-9999); ajv decides which are valid."""
    year = draw(st.sampled_from([0, 1, 2, 1969, 1970, 2026, 2038, 2106, 9998, 9999]))
    month = draw(st.integers(1, 12))
    day = draw(st.integers(1, 31))
    hour = draw(st.sampled_from([0, 1, 12, 23]))
    minute = draw(st.sampled_from([0, 30, 59]))
    second = draw(st.sampled_from([0, 30, 59, 60]))
    fraction = draw(st.sampled_from(["", ".0", ".5", ".123456", ".1234567", "." + "9" * 12]))
    t = draw(st.sampled_from(["T", "t"]))
    zone = draw(
        st.sampled_from(["Z", "z", "+00:00", "-00:00", "+01:00", "-01:00", "+23:59", "-23:59"])
    )
    return (
        f"{year:04d}-{month:02d}-{day:02d}{t}{hour:02d}:{minute:02d}:{second:02d}{fraction}{zone}"
    )


def values(schema: dict[str, Any], signed: bool = False) -> st.SearchStrategy[Any]:
    """Values the schema branch describes, edges weighted in. ``signed``: for a message read
    strictly, whose integers are written as integers (its schema's description says so)."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        low, high = schema.get("minimum", -(2**63)), schema.get("maximum", 2**63 - 1)
        ints = st.one_of(st.sampled_from([low, high]), st.integers(low, high))
        if not signed:  # JSON Schema's integer is a number without a fraction: 5.0 too
            return st.one_of(ints, ints.filter(lambda n: abs(n) < 2**53).map(float))
        return ints
    if kind == "number":
        low, high = schema.get("minimum"), schema.get("maximum")
        edges = [x for x in (low, high) if x is not None]
        floats = st.floats(low, high, allow_nan=False, allow_infinity=False)
        return st.one_of(st.sampled_from(edges), floats) if edges else floats
    assert kind == "string", schema
    longest = schema.get("maxLength", 4096)
    if schema.get("format") == "date-time":
        return rfc3339()
    if "pattern" in schema:
        pattern = unanchored(schema["pattern"])
        return st.from_regex(pattern, fullmatch=True).filter(lambda s: len(s) <= longest)
    return st.text(min_size=schema.get("minLength", 0), max_size=min(longest, 300))


def field_errors(name: str, message: Any, path: tuple[Any, ...]) -> list[tuple[str, str]]:
    """The consumer's refusals of the field at ``path`` (none where it accepts)."""
    raw = json.dumps(message, ensure_ascii=False).encode("utf-8")
    try:
        DECODERS.get(name, decode)(export.MODELS[name], raw)
    except SchemaError as exc:
        where = ".".join(map(str, path))
        return [(loc, msg) for loc, msg in exc.errors if loc == where]
    return []


def replaced(message: Any, path: tuple[Any, ...], value: Any) -> Any:
    copy = json.loads(json.dumps(message))
    at = copy
    for step in path[:-1]:
        at = at[step]
        if at is None:  # inside an object the message leaves out: not drawn
            return None
    at[path[-1]] = value
    return copy


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_field_the_exported_schema_accepts_is_accepted_by_its_consumer(
    ajv: Ajv, data: st.DataObject
) -> None:
    name, path, branches = data.draw(st.sampled_from(FIELDS), label="field")
    signed = name in DECODERS
    branch = data.draw(st.sampled_from(branches), label="branch")
    value = data.draw(values(branch, signed), label="value")
    message = replaced(SENT[name], path, value)
    if message is not None and ajv.valid(name, message):
        assert field_errors(name, message, path) == [], (name, path, value)


def test_the_lifecycle_schema_says_what_the_strict_read_adds() -> None:
    description = SCHEMAS["lifecycle_event"]["description"]
    assert "``5``, never ``5.0`` or ``5e0``" in " ".join(description.split())
