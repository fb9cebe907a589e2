"""``loraplane publish``'s output as a stable interface: each outcome's exit code and its one
JSON object (``schemas.publish_result``), with S3, Kafka and the registry's audit replaced
at the module boundaries the command imports them from. The same runs on the real stack are
tests/integration/test_ci_publish.py; the exported schema is checked against these outputs
by ajv below."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from loraplane.cli import app
from loraplane.kernel import bus, kafka
from loraplane.kernel.config import get_settings
from loraplane.schemas import export
from loraplane.schemas.audit import AuditRecord
from loraplane.schemas.publish_result import (
    EXIT_CODE,
    FAILURE_OUTCOME,
    PublishError,
    PublishOutcome,
    PublishResult,
)
from loraplane.schemas.reasons import PublishFailure, RegistryRejection
from loraplane.tiny_model import build_adapter
from tests.lifecycle_kit import make_kit
from tests.unit.test_schemas_ajv import ajv

ROOT = Path(__file__).resolve().parents[2]
RUN = CliRunner()


@dataclass
class Fakes:
    """What the command talked to: uploads, produced events, and the registry's verdict."""

    uploads: list[str] = field(default_factory=list)
    produced: list[str] = field(default_factory=list)
    producers: list[object] = field(default_factory=list)  # made by ``kafka.producer``
    sent_through: list[object] = field(default_factory=list)  # each produce's producer
    fail_produce_at: int | None = None  # the n-th produce (from 0) is not acknowledged
    verdict: str | None = None  # "accepted", a RegistryRejection value, or None: no decision


@pytest.fixture
def fakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fakes]:
    import loraplane.artifact_publish as artifact_publish
    import loraplane.registry.decisions as registry_decisions

    monkeypatch.setenv("LORAPLANE_HOME", str(tmp_path / "home"))
    get_settings.cache_clear()
    seen = Fakes()

    def upload(_settings: Any, _folder: Path, record: Any, _manifest: Any) -> None:
        seen.uploads.append(record.artifact_uri)

    def produce(_settings: Any, _topic: str, _key: Any, value: Any, **kw: Any) -> tuple[int, int]:
        if seen.fail_produce_at == len(seen.produced):
            raise bus.DeliveryError("no acknowledgement within 20s (is the broker up?)")
        seen.produced.append(value.event_id)
        seen.sent_through.append(kw.get("producer"))
        return 1, len(seen.produced) - 1

    def producer(_settings: Any, **_kw: Any) -> object:
        made = object()
        seen.producers.append(made)
        return made

    class Watch:
        def __init__(self, _settings: Any) -> None:
            pass

        def wait(self, event_ids: Collection[str], _timeout_s: float) -> dict[str, AuditRecord]:
            if seen.verdict is None:
                return {}
            rejected = seen.verdict != "accepted"
            return {
                i: AuditRecord(
                    event_id=f"audit-{n}",
                    ts=datetime.now(UTC),
                    component="registry",
                    action="canary" if i.startswith("canary") else "publish",
                    decision="rejected" if rejected else "accepted",
                    reason=seen.verdict if rejected else "",
                    subject_event_id=i,
                    detail="key ci-old is not in the keyring" if rejected else "active=None",
                )
                for n, i in enumerate(event_ids)
            }

    monkeypatch.setattr(artifact_publish, "upload", upload)
    monkeypatch.setattr(bus, "produce_sync", produce)
    monkeypatch.setattr(kafka, "producer", producer)
    monkeypatch.setattr(registry_decisions, "DecisionWatch", Watch)
    yield seen
    get_settings.cache_clear()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_adapter(tmp_path_factory.mktemp("adapter") / "bot", seed=3)


@pytest.fixture
def key(tmp_path: Path) -> Path:
    path = tmp_path / "ci.key"
    make_kit(datetime.now(UTC)).keys["ci"].save(path)
    return path


def publish(
    adapter: Path, key: Path, *extra: str, json_output: bool = True, **options: str
) -> tuple[int, str, str]:
    """Run the command in process; (exit code, stdout, stderr)."""
    args = {
        "--adapter-id": "bot",
        "--tenant": "acme",
        "--base-model": "tiny-llama",
        "--version": "1",
        "--artifact": str(adapter),
        "--key": str(key),
        **{f"--{k.replace('_', '-')}": v for k, v in options.items()},
    }
    argv = [
        "publish",
        *(["--json"] if json_output else []),
        *(a for k, v in args.items() if v != "" for a in (k, v)),
        *extra,
    ]
    done = RUN.invoke(app, argv)
    return done.exit_code, done.stdout, done.stderr


def result_of(stdout: str) -> PublishResult:
    """stdout is exactly one JSON object, and a valid PublishResult."""
    lines = stdout.splitlines()
    assert len(lines) == 1, stdout
    return PublishResult.model_validate_json(lines[0])


@dataclass
class Case:
    """What a case's set-up may change: the fakes, files, and (undone after) patches."""

    fakes: Fakes
    adapter: Path
    key: Path
    tmp: Path
    patch: pytest.MonkeyPatch


Setup = Callable[[Case], list[str]]
"""Prepares a case and returns its extra options (a repeated option's last value wins)."""


def _nothing(_c: Case) -> list[str]:
    return []


def _canary(_c: Case) -> list[str]:
    return ["--canary", "10"]


def _wait_accepted(c: Case) -> list[str]:
    c.fakes.verdict = "accepted"
    return ["--canary", "5", "--wait-s", "30"]


def _wait_rejected(c: Case) -> list[str]:
    c.fakes.verdict = RegistryRejection.unknown_key.value
    return ["--wait-s", "30"]


def _wait_silent(_c: Case) -> list[str]:
    return ["--wait-s", "0.5"]


def _both_follow_ups(_c: Case) -> list[str]:
    return ["--canary", "10", "--promote"]


def _readable_key(c: Case) -> list[str]:
    c.key.chmod(0o644)
    return []


def _bad_settings(c: Case) -> list[str]:
    c.patch.setenv("LORAPLANE_KAFKA__PORT", "not-a-port")
    get_settings.cache_clear()
    return []


def _bad_version(_c: Case) -> list[str]:
    return ["--version", "1.x"]


def _bad_priority(_c: Case) -> list[str]:
    return ["--priority", "diamond"]


def _missing_model_config(c: Case) -> list[str]:
    return ["--model-config", str(c.tmp / "nope.json")]


def _json_reupload(_c: Case) -> list[str]:
    return ["--reupload"]


def _pickle(c: Case) -> list[str]:
    import shutil

    copy = Path(shutil.copytree(c.adapter, c.tmp / "bot"))
    (copy / "extra.bin").write_bytes(b"\x80\x04pickle")
    return ["--artifact", str(copy)]


def _nan_weights(c: Case) -> list[str]:
    """A NaN in the middle of one lora_B, and a -inf at the start of one lora_A."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    copy = Path(shutil.copytree(c.adapter, c.tmp / "bot"))
    weights = copy / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    tensors[NAN_TENSOR].flat[100] = np.nan
    tensors[INF_TENSOR].flat[0] = -np.inf
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return ["--artifact", str(copy)]


NAN_TENSOR = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
INF_TENSOR = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _no_folder(c: Case) -> list[str]:
    return ["--artifact", str(c.tmp / "missing")]


def _store_down(c: Case) -> list[str]:
    import loraplane.artifact_publish as artifact_publish

    def down(*_a: Any) -> None:
        raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1/")

    c.patch.setattr(artifact_publish, "upload", down)
    return []


def _store_hung(c: Case) -> list[str]:
    """A store that accepts and never answers (s3proxy stopped): botocore's read time-out is
    an OSError too (it subclasses requests' ReadTimeout), yet no folder failed to read."""
    import loraplane.artifact_publish as artifact_publish

    def hung(*_a: Any) -> None:
        raise ReadTimeoutError(endpoint_url="http://127.0.0.1:1/b/k")

    c.patch.setattr(artifact_publish, "upload", hung)
    return []


def _store_unconnectable(c: Case) -> list[str]:
    import loraplane.artifact_publish as artifact_publish

    def unconnectable(*_a: Any) -> None:
        raise ConnectTimeoutError(endpoint_url="http://127.0.0.1:1/")

    c.patch.setattr(artifact_publish, "upload", unconnectable)
    return []


def _kafka_down(c: Case) -> list[str]:
    c.fakes.fail_produce_at = 0
    return ["--canary", "10"]


def _canary_lost(c: Case) -> list[str]:
    c.fakes.fail_produce_at = 1
    return ["--canary", "10"]


def _bug(c: Case) -> list[str]:
    import loraplane.artifact_publish as artifact_publish

    def broken(*_a: Any, **_k: Any) -> None:
        raise RuntimeError("a bug")

    c.patch.setattr(artifact_publish, "build_record", broken)
    return []


CASES: list[tuple[str, Setup, PublishFailure | None]] = [
    ("published", _nothing, None),
    ("published with a canary", _canary, None),
    ("accepted by the registry", _wait_accepted, None),
    ("rejected by the registry", _wait_rejected, PublishFailure.registry_rejected),
    ("no registry decision in time", _wait_silent, PublishFailure.registry_undecided),
    ("canary and promote", _both_follow_ups, PublishFailure.options_invalid),
    ("key readable by others", _readable_key, PublishFailure.key_unusable),
    ("settings unusable", _bad_settings, PublishFailure.settings_invalid),
    ("version not a version", _bad_version, PublishFailure.release_invalid),
    ("unknown priority", _bad_priority, PublishFailure.options_invalid),
    ("model config missing", _missing_model_config, PublishFailure.model_config_invalid),
    ("--json with --reupload", _json_reupload, PublishFailure.options_invalid),
    ("pickle beside the weights", _pickle, PublishFailure.artifact_refused),
    ("no such folder", _no_folder, PublishFailure.artifact_refused),
    ("S3 away", _store_down, PublishFailure.artifact_store_unavailable),
    ("S3 hung", _store_hung, PublishFailure.artifact_store_unavailable),
    ("S3 connect timed out", _store_unconnectable, PublishFailure.artifact_store_unavailable),
    ("Kafka away", _kafka_down, PublishFailure.bus_unavailable),
    ("canary not acknowledged", _canary_lost, PublishFailure.follow_up_not_acknowledged),
    ("a bug", _bug, PublishFailure.internal_error),
]


def run_case(
    setup: Setup, fakes: Fakes, adapter: Path, key: Path, tmp: Path, json_output: bool = True
) -> tuple[int, str, str]:
    tmp.mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        extra = setup(Case(fakes, adapter, key, tmp, patch))
        try:
            return publish(adapter, key, *extra, json_output=json_output)
        finally:
            get_settings.cache_clear()


@pytest.mark.parametrize(("name", "setup", "failure"), CASES, ids=[c[0] for c in CASES])
def test_each_outcome_has_its_exit_code_and_one_json_object(
    name: str,
    setup: Setup,
    failure: PublishFailure | None,
    fakes: Fakes,
    adapter: Path,
    key: Path,
    tmp_path: Path,
) -> None:
    code, stdout, stderr = run_case(setup, fakes, adapter, key, tmp_path)
    result = result_of(stdout)
    outcome = PublishOutcome.published if failure is None else FAILURE_OUTCOME[failure]
    assert (code, result.outcome, result.exit_code) == (outcome.exit_code, outcome, code), stderr
    assert result.ok is (failure is None)
    assert (result.adapter_id, result.tenant_id, result.base_model) == ("bot", "acme", "tiny-llama")
    # what the broker acknowledged is what the result lists, whatever failed after it
    assert [e.event_id for e in result.events] == fakes.produced
    if failure is None:
        assert result.error is None and result.event_id == fakes.produced[0]
        assert result.lora_name == f"bot@1-{result.sha256[:8]}"  # type: ignore[index]
        assert fakes.uploads == [result.artifact_uri]
        assert "publish: the broker acknowledged publish event" in stderr
    else:
        assert result.error is not None and result.error.code is failure
        assert f"error: {result.error.message}" in stderr
    if failure is not None and outcome in (
        PublishOutcome.invalid_input,
        PublishOutcome.artifact_refused,
    ):
        assert fakes.uploads == [] and fakes.produced == []  # refused before any side effect


def test_a_refused_artifact_lists_each_reason(
    fakes: Fakes, adapter: Path, key: Path, tmp_path: Path
) -> None:
    code, stdout, _ = run_case(_pickle, fakes, adapter, key, tmp_path)
    error = result_of(stdout).error
    assert code == 3 and error is not None
    assert [(r.reason, r.path) for r in error.refusals] == [("pickle_weights", "extra.bin")]


def test_attack_weights_holding_a_nan_or_an_infinity_are_refused_before_upload(
    fakes: Fakes, adapter: Path, key: Path, tmp_path: Path
) -> None:
    """ATTACK: an adapter folder whose weights hold a NaN and a -inf (as a diverged training
    run saves them, or a publisher means them) was uploaded and published, and every worker
    then loaded it into vLLM. CI's publish refuses it with exit 3, each tensor and its first
    bad index in ``error.refusals`` and on stderr, and uploads and produces nothing."""
    code, stdout, _ = run_case(_nan_weights, fakes, adapter, key, tmp_path)
    error = result_of(stdout).error
    assert code == 3 and error is not None and error.code is PublishFailure.artifact_refused
    assert sorted((r.reason, r.path, r.detail) for r in error.refusals) == [
        ("tensor_value_nonfinite", "adapter_model.safetensors", f"{INF_TENSOR}: -inf at [0]"),
        ("tensor_value_nonfinite", "adapter_model.safetensors", f"{NAN_TENSOR}: NaN at [100]"),
    ]
    assert fakes.uploads == [] and fakes.produced == []
    code, stdout, stderr = run_case(
        _nan_weights, fakes, adapter, key, tmp_path / "again", json_output=False
    )
    assert (code, stdout) == (3, "")
    assert (
        f"error: refused: tensor_value_nonfinite adapter_model.safetensors ({INF_TENSOR}" in stderr
    )


def test_the_registry_decisions_are_in_the_result(
    fakes: Fakes, adapter: Path, key: Path, tmp_path: Path
) -> None:
    _, stdout, _ = run_case(_wait_accepted, fakes, adapter, key, tmp_path)
    result = result_of(stdout)
    assert [(d.event_id, d.action, d.decision) for d in result.registry or []] == [
        (result.event_id, "publish", "accepted"),
        (result.canary_event_id, "canary", "accepted"),
    ]
    _, stdout, _ = run_case(_wait_rejected, fakes, adapter, key, tmp_path)
    rejected = result_of(stdout)
    assert [(d.decision, d.reason) for d in rejected.registry or []] == [
        ("rejected", "unknown_key")
    ]
    assert rejected.error is not None and "unknown_key" in rejected.error.message
    _, stdout, _ = run_case(_nothing, fakes, adapter, key, tmp_path)
    assert result_of(stdout).registry is None  # not waited for: null, not []


def test_without_json_a_failure_leaves_stdout_empty_and_success_prints_the_object(
    fakes: Fakes, adapter: Path, key: Path, tmp_path: Path
) -> None:
    code, stdout, stderr = run_case(_pickle, fakes, adapter, key, tmp_path, json_output=False)
    assert (code, stdout) == (3, "") and "error: refused: pickle_weights extra.bin" in stderr
    code, stdout, _ = run_case(_nothing, fakes, adapter, key, tmp_path, json_output=False)
    assert code == 0 and result_of(stdout).ok
    # the keys of the line publish printed before the interface was written down remain
    assert {"event_id", "version", "sha256", "artifact_uri", "lora_name", "seq"} <= set(
        json.loads(stdout)
    )


def test_every_output_is_valid_for_ajv_against_the_exported_schema(
    fakes: Fakes, adapter: Path, key: Path, tmp_path: Path
) -> None:
    export.export(tmp_path / "schemas")
    outputs = []
    for n, (_, setup, _) in enumerate(CASES):
        fakes.produced.clear()
        fakes.fail_produce_at, fakes.verdict = None, None
        _, stdout, _ = run_case(setup, fakes, adapter, key, tmp_path / str(n))
        outputs.append(("publish_result", json.loads(stdout)))
    checked = ajv(tmp_path / "schemas", outputs)
    assert [(valid, errors) for valid, errors in checked if not valid] == []
    # and a consumer's schema check sees what the model forbids
    broken = [
        ("publish_result", {**outputs[0][1], "outcome": "maybe"}),
        ("publish_result", {**outputs[0][1], "exit_code": -1}),
        ("publish_result", {k: v for k, v in outputs[0][1].items() if k != "ok"}),
    ]
    assert [valid for valid, _ in ajv(tmp_path / "schemas", broken)] == [False] * 3


def test_exit_codes_are_distinct_and_every_failure_has_an_outcome() -> None:
    assert sorted(EXIT_CODE.values()) == list(range(len(PublishOutcome)))
    assert set(FAILURE_OUTCOME) == set(PublishFailure)
    assert set(FAILURE_OUTCOME.values()) == set(PublishOutcome) - {PublishOutcome.published}


def test_the_documented_exit_codes_are_the_codes() -> None:
    from tests.unit.test_reason_docs import tables

    rows = tables("docs/lifecycle.md")[("exit", "outcome", "meaning", "what the CI job does")]
    assert {int(r[0].strip("`")): r[1].strip("`") for r in rows} == {
        code: outcome.value for outcome, code in EXIT_CODE.items()
    }
    script = (ROOT / "examples/ci/publish-adapter.sh").read_text().replace("#", " ")
    help_text = RUN.invoke(app, ["publish", "--help"], terminal_width=200).stdout
    said = [" ".join(text.replace("│", " ").split()) for text in (script, help_text)]
    for outcome, code in EXIT_CODE.items():  # the script's header and --help say them too
        words = outcome.value.replace("_", " ")
        assert all(f"{code} {words}" in text for text in said), words


@given(
    st.sampled_from([None, *PublishFailure]),
    st.text(max_size=40),
    st.lists(st.sampled_from(["canary", "promote"]), max_size=1),
)
def test_a_result_round_trips_and_its_code_follows_its_error(
    failure: PublishFailure | None, message: str, follow: list[str]
) -> None:
    error = None if failure is None else PublishError(code=failure, message=message)
    result = PublishResult.build(
        "bot", "1", error=error, **{f"{a}_event_id": f"{a}-1" for a in follow}
    )
    again = PublishResult.model_validate_json(result.model_dump_json())
    assert again == result
    assert again.exit_code == (0 if failure is None else FAILURE_OUTCOME[failure].exit_code)


def test_a_consumer_reads_a_result_with_fields_it_does_not_know() -> None:
    """Fields are added within schema_version 1: an older reader ignores them."""
    line = PublishResult.build("bot", "1").model_dump(mode="json")
    later = PublishResult.model_validate({**line, "bundle": {"signer": "x"}})
    assert later == PublishResult.build("bot", "1")
    with pytest.raises(ValueError, match="exit_code"):
        PublishResult.model_validate({**line, "exit_code": 3})


@pytest.mark.parametrize("follow_up", [["--promote"], ["--canary", "10"]])
def test_an_event_and_its_follow_up_go_through_one_producer(
    fakes: Fakes, adapter: Path, key: Path, follow_up: list[str]
) -> None:
    """A fresh idempotent producer waits ~0.5 s for its id before its first message is
    acknowledged: a publish with a follow-up pays that once."""
    code, _, _ = publish(adapter, key, *follow_up)
    assert code == 0
    assert len(fakes.produced) == 2
    assert len(fakes.producers) == 1
    assert fakes.sent_through == fakes.producers * 2
