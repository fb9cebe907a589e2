"""The backbone on real processes: Kafka 4.x, ClickHouse and the S3 endpoint."""

from __future__ import annotations

import io
import socket
import uuid
from pathlib import Path

import pytest
from rich.console import Console

from loraplane.infra import stack as local_stack
from loraplane.infra.kafka import Kafka, api_versions, speaks_kafka_4
from loraplane.infra.processes import StackError, free_port
from loraplane.kernel import kafka, topics
from loraplane.kernel.config import ClickHouseSettings, KafkaSettings, S3Settings, Settings

pytestmark = pytest.mark.integration


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def _settings_on_free_ports(home: Path, kafka_port: int | None = None) -> Settings:
    s3_port = free_port()
    return Settings(
        home=home,
        kafka=KafkaSettings(port=kafka_port or free_port(), controller_port=free_port()),
        clickhouse=ClickHouseSettings(
            tcp_port=free_port(), http_port=free_port(), interserver_port=free_port()
        ),
        s3=S3Settings(port=s3_port, endpoint_url=f"http://127.0.0.1:{s3_port}"),
    )


def _pids(settings: Settings) -> list[int | None]:
    """What ``local_stack.status`` reports as each service's PID (its PID file, the process
    alive and ours), without the health probes beside it: on a port nothing serves, Kafka's
    waits seconds, and on one a squatter holds and never answers, the S3 probe waits out its
    client's read timeout twice (10 s)."""
    return [svc.process.pid() for svc in local_stack.services(settings)]


def test_kafka_round_trip_keeps_key_and_headers(stack: Settings) -> None:
    from confluent_kafka import TopicPartition

    name = topics.topic_name(stack, "requests")
    key, value = f"adapter-{uuid.uuid4()}".encode(), b'{"ttft_ms": 42}'
    delivered = []
    producer = kafka.producer(stack, quiet=True)
    producer.produce(
        name,
        value,
        key=key,
        headers=[("schema", b"request-log/v1")],
        on_delivery=lambda err, msg: delivered.append((err, msg)),
    )
    producer.flush(10)
    err, msg = delivered[0]
    assert err is None
    consumer = kafka.consumer(stack, f"test-{uuid.uuid4()}", quiet=True)
    try:
        consumer.assign([TopicPartition(name, msg.partition(), msg.offset())])
        got = consumer.poll(10)
    finally:
        consumer.close()
    assert got is not None and got.error() is None
    assert (got.key(), got.value()) == (key, value)
    assert got.headers() == [("schema", b"request-log/v1")]


def test_topic_configs_are_visible_to_the_admin_api(stack: Settings) -> None:
    from confluent_kafka.admin import ConfigResource, ResourceType

    admin = kafka.admin(stack)
    registry = ConfigResource(ResourceType.TOPIC, topics.topic_name(stack, "registry"))
    lifecycle = ConfigResource(ResourceType.TOPIC, topics.topic_name(stack, "lifecycle"))
    described = {
        r.name: f.result(10) for r, f in admin.describe_configs([registry, lifecycle]).items()
    }
    assert described[registry.name]["cleanup.policy"].value == "compact"
    assert described[lifecycle.name]["retention.ms"].value == "-1"
    assert all(c.action == "unchanged" for c in topics.apply(stack, dry_run=True))


def test_broker_answers_api_versions_as_kafka_4(stack: Settings) -> None:
    assert speaks_kafka_4(api_versions(stack.kafka.host, stack.kafka.port))
    assert Kafka(stack).version().startswith("4.")


def test_clickhouse_create_insert_select(stack: Settings) -> None:
    from clickhouse_driver import Client

    c = stack.clickhouse
    user, password = c.login()
    client = Client(host=c.host, port=c.tcp_port, user=user, password=password)
    table = f"{c.database}.test_stack_{uuid.uuid4().hex[:8]}"
    client.execute(
        f"CREATE TABLE {table} (adapter_id String, hits UInt32) "
        "ENGINE = MergeTree ORDER BY adapter_id"
    )
    try:
        client.execute(f"INSERT INTO {table} VALUES", [("a1", 3), ("a2", 5)])
        assert client.execute(f"SELECT adapter_id, hits FROM {table} ORDER BY adapter_id") == [
            ("a1", 3),
            ("a2", 5),
        ]
    finally:
        client.execute(f"DROP TABLE {table}")
        client.disconnect()


def test_clickhouse_reader_reads_only_and_nobody_logs_in_without_a_password(
    stack: Settings,
) -> None:
    """The reader (report, dashboard) can query, with settings, and cannot write or change
    the schema; `default`, no password and a wrong password are refused; users.xml holds
    only digests."""
    from clickhouse_driver import Client, errors

    from loraplane.metrics.clickhouse import connect

    c = stack.clickhouse
    reader = connect(stack, reader=True)
    try:
        assert reader.execute("SELECT 1", settings={"max_execution_time": 5}) == [(1,)]
        for sql in (
            f"INSERT INTO {c.database}.requests SELECT * FROM {c.database}.requests LIMIT 0",
            f"CREATE TABLE {c.database}.nope (a UInt8) ENGINE = Memory",
            f"DROP DATABASE {c.database}",
            "SET readonly = 0",
        ):
            with pytest.raises(errors.ServerException) as refused:
                reader.execute(sql)
            assert refused.value.code == 164, sql  # READONLY: "Cannot execute query in
            # readonly mode"
    finally:
        reader.disconnect()
    reader_user, reader_password = c.login(reader=True)
    for user, password in (("default", ""), (c.user, ""), (reader_user, "wrong")):
        with pytest.raises(errors.ServerException) as denied:
            Client(
                host=c.host, port=c.tcp_port, user=user, password=password, connect_timeout=2
            ).execute("SELECT 1")
        assert denied.value.code in (192, 193, 194, 516), (user, denied.value)  # unknown
        # user, wrong or required password (516: AUTHENTICATION_FAILED in current releases)
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError):  # anonymous over HTTP too
        urllib.request.urlopen(f"http://{c.host}:{c.http_port}/?query=SELECT%201", timeout=5)
    users_xml = (stack.home / "clickhouse" / "users.xml").read_text()
    assert "<password_sha256_hex>" in users_xml and reader_password not in users_xml
    for user in (c.user, reader_user):
        assert c.password_file(user).stat().st_mode & 0o077 == 0


def test_s3_refuses_wrong_or_missing_credentials(stack: Settings) -> None:
    """Only the stack's key is accepted; unsigned and wrongly signed requests are refused
    (tests/integration/test_s3_durable.py attacks a private s3proxy in more ways)."""
    import urllib.error
    import urllib.request

    from botocore.exceptions import ClientError
    from pydantic import SecretStr

    from loraplane.infra.s3 import S3

    for s3 in (
        stack.s3.model_copy(update={"secret_access_key": SecretStr("wrong-secret")}),
        stack.s3.model_copy(update={"access_key_id": "someone-else"}),
    ):
        with pytest.raises(ClientError) as refused:
            S3(stack.model_copy(update={"s3": s3})).client().list_objects_v2(Bucket=stack.s3.bucket)
        assert refused.value.response["Error"]["Code"] in (
            "SignatureDoesNotMatch",
            "InvalidAccessKeyId",
        ), refused.value
    for path, headers in (
        (f"/{stack.s3.bucket}?list-type=2", {}),
        ("/", {}),
        (f"/{stack.s3.bucket}/x", {"Authorization": "AWS loraplane:bogus"}),
    ):
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(
                urllib.request.Request(stack.s3.endpoint_url + path, headers=headers), timeout=5
            )
        assert denied.value.code == 403
    assert stack.s3.credentials_file is not None
    assert stack.s3.credentials_file.stat().st_mode & 0o077 == 0


def test_s3_put_and_get(stack: Settings) -> None:
    from loraplane.infra.s3 import S3

    client = S3(stack).client()
    key = f"tests/{uuid.uuid4()}.safetensors"
    client.put_object(Bucket=stack.s3.bucket, Key=key, Body=b"weights")
    assert client.get_object(Bucket=stack.s3.bucket, Key=key)["Body"].read() == b"weights"
    client.delete_object(Bucket=stack.s3.bucket, Key=key)


def test_up_twice_is_a_no_op(stack: Settings) -> None:
    before = [h.pid for h in local_stack.status(stack)]
    console = _quiet()
    local_stack.up(stack, console)
    output = console.file.getvalue()  # type: ignore[attr-defined]
    assert output.count("already running") == 3
    assert "0 changed" in output
    assert [h.pid for h in local_stack.status(stack)] == before


def test_port_taken_fails_naming_the_port(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        settings = _settings_on_free_ports(tmp_path, kafka_port=port)
        with pytest.raises(StackError, match=rf"kafka: port {port} \(kafka listener\)"):
            local_stack.up(settings, _quiet())
    assert not any(_pids(settings))


def test_down_leaves_no_process_behind(tmp_path: Path) -> None:
    """A throwaway stack on other ports and another home, so the shared one stays up."""
    settings = _settings_on_free_ports(tmp_path)
    try:
        local_stack.up(settings, _quiet())
        pids = [h.pid for h in local_stack.status(settings)]
        assert all(pids) and local_stack.healthy(settings)
    finally:
        local_stack.down(settings, _quiet())
    assert [p for p in pids if p and Path(f"/proc/{p}").exists()] == []
    assert not list((tmp_path / "run").glob("*.pid"))
    assert (tmp_path / "kafka" / "data" / "meta.properties").is_file()  # data kept
    assert (tmp_path / "s3" / "data" / settings.s3.bucket).is_dir()  # objects on disk, kept
    local_stack.down(settings, _quiet(), purge=True)
    assert not (tmp_path / "s3").exists() and not (tmp_path / "kafka").exists()


def test_a_later_service_whose_port_is_taken_leaves_nothing_started(tmp_path: Path) -> None:
    """Before: Kafka and ClickHouse started, then s3proxy's port was found taken, and `up`
    failed leaving the two running (and `./run test` exited without stopping them)."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        settings = _settings_on_free_ports(tmp_path)
        settings = settings.model_copy(
            update={
                "s3": S3Settings(port=port, endpoint_url=f"http://127.0.0.1:{port}"),
            }
        )
        try:
            with pytest.raises(StackError, match=rf"s3: port {port}"):
                local_stack.up(settings, _quiet())
            assert not any(_pids(settings))
        finally:
            local_stack.down(settings, _quiet())


def test_a_service_failing_after_others_started_stops_what_this_up_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _settings_on_free_ports(tmp_path)

    def broken(self: object) -> list[str]:
        raise StackError("s3: cannot prepare")

    monkeypatch.setattr(local_stack.S3, "prepare", broken)
    try:
        with pytest.raises(StackError, match="cannot prepare"):
            local_stack.up(settings, _quiet())
        assert not any(_pids(settings))
    finally:
        local_stack.down(settings, _quiet())
