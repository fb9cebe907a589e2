"""Wire models: exported JSON Schemas match, and hostile input yields only SchemaError."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.schemas.codec import SchemaError, decode, encode
from loraplane.schemas.export import MODELS, drift
from loraplane.schemas.lifecycle import LifecycleEvent
from loraplane.schemas.registry import AdapterView
from tests.lifecycle_kit import make_kit, record

NOW = datetime(2026, 6, 1, tzinfo=UTC)
EVENT = json.loads(encode(make_kit(NOW).event("ci", "publish", "a", "1", 1, NOW)))


def test_checked_in_json_schemas_match_the_models() -> None:
    assert drift() == [], "run `loraplane schemas export`"


@pytest.mark.parametrize(
    "change, field, words",
    [
        ({"surprise": 1}, "surprise", "Extra inputs"),
        ({"seq": "many"}, "seq", "integer"),
        ({"seq": 0}, "seq", "greater than or equal"),
        ({"adapter_id": "../etc/passwd"}, "adapter_id", "pattern"),
        ({"adapter_id": "Upper"}, "adapter_id", "pattern"),
        ({"version": "latest"}, "version", "pattern"),
        ({"issued_at": "2026-06-01T00:00:00"}, "issued_at", "timezone"),
        ({"action": "deploy"}, "action", "Input should be"),
    ],
)
def test_field_level_rejections(change: dict, field: str, words: str) -> None:
    with pytest.raises(SchemaError) as err:
        decode(LifecycleEvent, json.dumps({**EVENT, **change}))
    assert err.value.reason == "invalid"
    assert any(loc == field and words in msg for loc, msg in err.value.errors), err.value.errors


def test_nested_record_errors_name_the_path() -> None:
    bad = {**EVENT, "record": {**EVENT["record"], "rank": 10_000}}
    with pytest.raises(SchemaError) as err:
        decode(LifecycleEvent, json.dumps(bad))
    assert any(loc == "record.rank" for loc, _ in err.value.errors)


def test_adapter_view_invariants() -> None:
    r1, r2 = record("a", "1"), record("a", "2")
    base = {
        "adapter_id": "a",
        "tenant_id": "acme",
        "base_model": "tiny-llama",
        "last_seq": 1,
        "last_event_id": "e1",
        "updated_at": NOW,
    }
    view = AdapterView(versions=[r1, r2], **base)
    assert view.version("2.0") == r2 and view.active is None and view.must_evict == []
    with pytest.raises(ValueError, match="ordered"):
        AdapterView(versions=[r2, r1], **base)
    with pytest.raises(ValueError, match="active"):
        AdapterView(versions=[r1], active_version="1", **base)
    with pytest.raises(ValueError, match="another"):
        AdapterView(versions=[record("b", "1")], **base)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=12), c, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(
    model=st.sampled_from(list(MODELS.values())),
    data=st.one_of(
        st.binary(max_size=300),
        JSON.map(lambda v: json.dumps(v).encode()),
        st.dictionaries(st.sampled_from(list(EVENT)), JSON, max_size=6).map(
            lambda d: json.dumps({**EVENT, **d}).encode()
        ),
    ),
)
def test_hostile_bytes_raise_only_schema_error(model, data: bytes) -> None:
    try:
        decode(model, data)
    except SchemaError as exc:
        assert exc.reason in {"malformed", "invalid", "too_large"} and exc.errors
