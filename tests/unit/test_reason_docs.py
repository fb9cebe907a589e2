"""Reason codes are one closed set shared by code, wire and docs.

Each doc table that lists reasons names exactly the values of its enum (so neither can gain a
code the other lacks); every wire model carries a reason as its exact value and refuses a
code outside the set.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import get_args

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from pydantic import BaseModel

from loraplane.schemas.audit import AuditRecord
from loraplane.schemas.cache_event import CacheEvent, CacheEventKind
from loraplane.schemas.codec import SchemaError, decode, encode
from loraplane.schemas.dead_letter import DeadLetter
from loraplane.schemas.export import render
from loraplane.schemas.reasons import (
    AdmissionRefusal,
    ArtifactReason,
    AuditReason,
    CacheEventReason,
    CommandRejection,
    CommandRule,
    ConsumerFault,
    DeadLetterReason,
    DecodeReason,
    ForeignChange,
    IntentRefusal,
    LoadDeferral,
    PublishFailure,
    QueueRefusal,
    RegistryRejection,
    RegistryViewRejection,
    RequestRefusal,
    ResolverRefusal,
    RouterRefusal,
    ServerRefusal,
    ServingRefusal,
    TenantLimit,
    UnloadReason,
    VllmErrorCode,
    VllmFailure,
    WaitReason,
)
from loraplane.workers.reconcile import CommandSkip

ROOT = Path(__file__).resolve().parents[2]
CODE = re.compile(r"^`([a-z0-9_]+)`")
Table = list[list[str]]


def tables(doc: str) -> dict[tuple[str, ...], Table]:
    """Every markdown table of ``doc`` by its header cells (a header seen twice is an error:
    the test would not know which table it checks)."""
    found: dict[tuple[str, ...], Table] = {}
    lines = (ROOT / doc).read_text().splitlines()
    for n, line in enumerate(lines[:-1]):
        if line.startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[n + 1].strip()):
            if n > 0 and lines[n - 1].startswith("|"):
                continue
            header = tuple(_cells(line))
            assert header not in found, f"{doc}: two tables headed {header}"
            rows = []
            for row in lines[n + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(_cells(row))
            found[header] = rows
    return found


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def codes(rows: Table, column: int = 0) -> list[str]:
    out = []
    for row in rows:
        match = CODE.match(row[column])
        assert match, f"not a `code` cell: {row[column]!r}"
        out.append(match[1])
    return out


def by_enum(rows: Table) -> dict[str, list[str]]:
    """Codes of a table whose second column names their enum, grouped by it."""
    out: dict[str, list[str]] = defaultdict(list)
    for row, code in zip(rows, codes(rows), strict=True):
        out[row[1].strip("`")].append(code)
    return dict(out)


def values(*enums: type[StrEnum]) -> list[str]:
    return sorted(m.value for e in enums for m in e)


def test_lifecycle_doc_lists_every_registry_rejection() -> None:
    rows = tables("docs/lifecycle.md")[("reason", "fires when")]
    assert sorted(codes(rows)) == sorted(
        [*values(RegistryRejection), ConsumerFault.internal_error.value]
    )


def test_lifecycle_doc_lists_every_publish_failure_with_its_outcome() -> None:
    from loraplane.schemas.publish_result import FAILURE_OUTCOME

    rows = tables("docs/lifecycle.md")[("failure", "outcome", "when")]
    assert sorted(codes(rows)) == values(PublishFailure)
    assert {code: row[1].strip("`") for code, row in zip(codes(rows), rows, strict=True)} == {
        f.value: FAILURE_OUTCOME[f].value for f in PublishFailure
    }


def test_worker_doc_lists_every_artifact_reason() -> None:
    rows = tables("docs/worker.md")[("reason", "when")]
    assert sorted(codes(rows)) == values(ArtifactReason)
    transient = {c for c, row in zip(codes(rows), rows, strict=True) if "†" in row[0]}
    assert transient == {r.value for r in ArtifactReason if r.is_failure}


def test_worker_doc_lists_every_resolver_refusal() -> None:
    rows = tables("docs/worker.md")[("resolver refusal", "when")]
    assert sorted(codes(rows)) == values(ResolverRefusal)


def test_worker_doc_lists_every_registry_view_rejection() -> None:
    rows = tables("docs/worker.md")[("view reason", "when")]
    assert sorted(codes(rows)) == values(RegistryViewRejection)


def test_worker_doc_lists_the_agents_own_reasons() -> None:
    docs = tables("docs/worker.md")
    grouped = by_enum(docs[("reason", "enum", "where it shows", "when")])
    assert {name: sorted(c) for name, c in grouped.items()} == {
        e.__name__: values(e) for e in (IntentRefusal, UnloadReason, LoadDeferral, CommandSkip)
    }
    assert sorted(codes(docs[("code", "when")])) == values(VllmErrorCode)


def test_worker_doc_lists_every_command_rejection() -> None:
    rows = tables("docs/worker.md")[("command rejection", "when")]
    assert sorted(codes(rows)) == values(CommandRejection)


def test_worker_doc_lists_every_foreign_change() -> None:
    rows = tables("docs/worker.md")[("foreign change", "when")]
    assert sorted(codes(rows)) == values(ForeignChange)


def test_worker_doc_lists_every_gateway_refusal() -> None:
    rows = tables("docs/worker.md")[("refusal", "enum", "status", "when")]
    assert {name: sorted(c) for name, c in by_enum(rows).items()} == {
        e.__name__: values(e)
        for e in (RequestRefusal, TenantLimit, AdmissionRefusal, ServerRefusal)
    }


def test_router_doc_lists_every_queue_refusal() -> None:
    rows = tables("docs/router.md")[("queue refusal", "status", "when")]
    assert sorted(codes(rows)) == values(QueueRefusal)


def test_worker_doc_lists_every_answer_of_the_gateway() -> None:
    """The gateway's answers table: the front door's enums, vLLM's failures (``vllm_*``)
    and the gateway's own serving refusals, which are exactly ``ServingRefusal``."""
    rows = tables("docs/worker.md")[("status", "`error.type`", "when")]
    named = {c for row in rows for c in re.findall(r"`([a-z0-9_]+)`", row[1])}
    door = set(values(RequestRefusal, TenantLimit, AdmissionRefusal, ServerRefusal))
    assert sorted(named - door - set(values(VllmFailure))) == values(ServingRefusal)
    assert any("`vllm_<reason>`" in row[1] for row in rows)  # every vLLM failure


def test_the_gateway_answers_with_its_enums_only() -> None:
    """Every error the gateway answers names an enum member, never a bare string."""
    source = (ROOT / "workers/gateway.py").read_text()
    assert re.findall(r"error_response\(\s*\w+,\s*\"", source) == []
    assert re.findall(r"trace\.error = [^\n]*\"", source) == []


def test_router_doc_lists_every_refusal_of_its_own() -> None:
    """The router's own refusals (no worker, a worker lost, a client gone while queued) are
    one enum and one table; its first row stands for the front door's, listed elsewhere."""
    rows = tables("docs/router.md")[("router refusal", "status", "when")]
    own = [c for c in codes(rows) if c not in values(AdmissionRefusal)]
    assert sorted(own) == values(RouterRefusal)


def test_router_refuses_with_its_enums_only() -> None:
    """Every code the router answers itself is an enum member, never a bare string."""
    source = (ROOT / "loraplane/router/server.py").read_text()
    assert re.findall(r"_refuse\(\s*\d+,\s*\"", source) == []


def test_planner_doc_lists_every_rule_and_waiting_reason() -> None:
    docs = tables("docs/planner.md")
    rules = next(rows for header, rows in docs.items() if header[1].startswith("rule ("))
    assert sorted(set(codes(rules, 1))) == values(CommandRule)
    assert sorted(codes(docs[("waiting reason", "when")])) == values(WaitReason)


def test_dashboards_doc_lists_every_dead_letter_reason_of_its_own() -> None:
    rows = tables("dashboards/README.md")[("reason", "enum", "component", "when")]
    assert {name: sorted(c) for name, c in by_enum(rows).items()} == {
        e.__name__: values(e) for e in (DecodeReason, ConsumerFault)
    }


def test_a_vllm_failure_is_its_code_prefixed() -> None:
    assert [c.failure.value for c in VllmErrorCode] == [f.value for f in VllmFailure]
    assert all(f"vllm_{c}" == c.failure for c in VllmErrorCode)


def _members(union: object) -> list[StrEnum | str]:
    out: list[StrEnum | str] = []
    for arg in get_args(union):
        out.extend(
            list(arg) if isinstance(arg, type) and issubclass(arg, StrEnum) else get_args(arg)
        )
    return out


TS = datetime(2024, 1, 1, tzinfo=UTC)


def _cache_event(reason: object) -> BaseModel:
    return CacheEvent(
        event_id="e",
        ts=TS,
        worker_id="w",
        base_model="b",
        tenant_id="t",
        adapter_id="a",
        adapter_version="1",
        lora_name="n",
        kind=CacheEventKind.fail,
        reason=reason,
    )


def _dead_letter(reason: object) -> BaseModel:
    return DeadLetter(
        event_id="e", ts=TS, source_topic="t", component="c", reason=reason, raw_b64=""
    )


def _audit(reason: object) -> BaseModel:
    return AuditRecord(
        event_id="e",
        ts=TS,
        component="planner",
        action="load_gpu",
        decision="issued",
        reason=reason,
    )


WIRE = [(_cache_event, CacheEventReason), (_dead_letter, DeadLetterReason), (_audit, AuditReason)]


@pytest.mark.parametrize(("build", "union"), WIRE)
def test_the_json_schema_lists_every_reason(build, union) -> None:
    schema = json.loads(render(type(build(_members(union)[0]))))
    listed = set()
    for option in schema["properties"]["reason"]["anyOf"]:
        if "$ref" in option:
            listed |= set(schema["$defs"][option["$ref"].rsplit("/", 1)[1]]["enum"])
        else:
            listed.add(option["const"])
    assert listed == {str(m) for m in _members(union)}


@given(st.data())
def test_a_reason_crosses_the_wire_as_its_exact_value(data: st.DataObject) -> None:
    build, union = data.draw(st.sampled_from(WIRE))
    reason = data.draw(st.sampled_from(_members(union)))
    raw = encode(build(reason))
    assert json.loads(raw)["reason"] == str(reason)
    assert f'"reason":"{reason}"'.encode() in raw
    assert decode(type(build(reason)), raw).reason == reason


@given(st.data(), st.text(min_size=1, max_size=40))
def test_a_reason_outside_the_set_is_refused(data: st.DataObject, text: str) -> None:
    build, union = data.draw(st.sampled_from(WIRE))
    assume(text not in {str(m) for m in _members(union)})
    model = type(build(_members(union)[0]))
    raw = json.loads(encode(build(_members(union)[0])))
    raw["reason"] = text
    with pytest.raises(SchemaError) as err:
        decode(model, json.dumps(raw))
    assert err.value.reason == DecodeReason.invalid
