"""SASL/SCRAM and ACLs on the real broker: each principal may do what kernel.acls grants and
nothing else, an unauthenticated or wrong-password client gets nothing, and no password
reaches a log or a command line."""

from __future__ import annotations

import stat
import uuid
from pathlib import Path

import pytest

from loraplane.infra.kafka import Kafka
from loraplane.kernel import acls, kafka, topics
from loraplane.kernel.config import KafkaSettings, Settings
from loraplane.kernel.kafka import Principal

pytestmark = pytest.mark.integration


def _as(stack: Settings, principal: Principal, password_file: Path | None = None) -> Settings:
    """``stack`` as a deployment configured with one principal's username and file."""
    return stack.model_copy(
        update={
            "kafka": stack.kafka.model_copy(
                update={
                    "username": str(principal),
                    "password_file": password_file or kafka.password_path(stack, principal),
                }
            )
        }
    )


def _produce(settings: Settings, suffix: str) -> str | None:
    """The delivery error's name (None: delivered) of one keyed message to ``suffix``."""
    errors: list[str | None] = []
    producer = kafka.producer(settings, quiet=True)
    producer.produce(
        topics.topic_name(settings, suffix),
        b"{}",
        key=uuid.uuid4().bytes,
        on_delivery=lambda err, _msg: errors.append(err and err.name()),
    )
    producer.flush(20)
    assert len(errors) == 1
    return errors[0]


def test_a_worker_cannot_write_registry_or_commands_but_writes_its_own(stack: Settings) -> None:
    worker = _as(stack, Principal.worker)
    assert _produce(worker, "registry") == "TOPIC_AUTHORIZATION_FAILED"
    assert _produce(worker, "commands") == "TOPIC_AUTHORIZATION_FAILED"
    # the refusal is a delivery error, not a broken client: its own topics still work
    assert _produce(worker, "worker-state") is None
    assert _produce(worker, "requests") is None


def test_only_a_router_writes_router_state_and_a_router_forges_no_worker_state(
    stack: Settings,
) -> None:
    """ATTACK: the fleet view sums what ``router-state`` says of queues and in-flight work;
    a worker (or any principal but router) cannot write it, and a router cannot pose as a
    worker on ``worker-state``, which routing believes."""
    router, worker = _as(stack, Principal.router), _as(stack, Principal.worker)
    assert _produce(worker, "router-state") == "TOPIC_AUTHORIZATION_FAILED"
    assert _produce(router, "worker-state") == "TOPIC_AUTHORIZATION_FAILED"
    assert _produce(router, "router-state") is None


def test_the_streams_app_writes_registry_and_commands_but_not_request_logs(stack: Settings) -> None:
    streams = _as(stack, Principal.streams)
    assert _produce(streams, "registry") is None
    assert _produce(streams, "commands") is None
    assert _produce(streams, "requests") == "TOPIC_AUTHORIZATION_FAILED"


def test_a_worker_can_neither_create_topics_nor_grant_itself_acls(stack: Settings) -> None:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import NewTopic

    admin = kafka.admin(_as(stack, Principal.worker))
    name = f"{stack.topic_prefix}.not-declared-{uuid.uuid4().hex[:6]}"
    with pytest.raises(KafkaException, match="AUTHORIZATION_FAILED"):
        for future in admin.create_topics([NewTopic(name, 1, 1)], request_timeout=10).values():
            future.result(timeout=15)
    with pytest.raises(KafkaException, match="AUTHORIZATION_FAILED"):
        acls.apply(
            _as(stack, Principal.worker),
            admin,
            topics.access(stack),
            topics.every_topic(stack),
            timeout=10,
        )


def test_unauthenticated_and_wrong_password_clients_get_nothing(
    stack: Settings, tmp_path: Path
) -> None:
    from confluent_kafka import KafkaException

    plaintext = stack.model_copy(
        update={
            "kafka": KafkaSettings(
                host=stack.kafka.host, port=stack.kafka.port, credentials_dir=tmp_path / "none"
            )
        }
    )
    assert kafka.credentials(plaintext) is None
    with pytest.raises(KafkaException):
        kafka.admin(plaintext).list_topics(timeout=5)
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password")
    wrong.chmod(0o600)
    with pytest.raises(KafkaException):
        kafka.admin(_as(stack, Principal.ops, wrong)).list_topics(timeout=5)


def test_no_password_in_a_log_a_command_line_or_a_loose_file(stack: Settings) -> None:
    folder = kafka.password_path(stack, Principal.ops).parent
    files = sorted(folder.glob("*.password"))
    assert {f.stem for f in files} == {str(p) for p in Principal}
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    passwords = [f.read_text().strip() for f in files]
    broker = Kafka(stack)
    assert stat.S_IMODE(broker.properties_file.stat().st_mode) == 0o600
    pid = broker.process.pid()
    assert pid is not None
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    logs = [p for p in stack.home.rglob("*.log") if p.is_file()]
    assert broker.process.log_file in logs
    leaks = [(str(log), i) for log in logs for i, pw in enumerate(passwords) if pw in _text_of(log)]
    assert leaks == [] and not any(pw in cmdline for pw in passwords)


def _text_of(path: Path) -> str:
    """A file's text, or "" for one gone since it was listed: a broker deletes the segment
    files (``*.log`` too) of a topic another test deleted, at any moment."""
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
