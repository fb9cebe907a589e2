"""ATTACK tests of hostile settings at the local stack and the CLI: every socket `stack up`
binds is a loopback address and a port in range, checked before anything starts, and an
invalid setting is one line naming it, not a traceback.

Before: ``kafka.host: 0.0.0.0`` (or a deployment's broker name, or an address with a line
break that became its own line of Kafka's server.properties) was bound as given, and a port
of -1 reached ``bind()`` as an OverflowError traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from rich.console import Console

from loraplane import cli
from loraplane.infra import stack
from loraplane.infra.processes import Managed, StackError
from loraplane.kernel.config import Settings, get_settings

HOSTILE_HOSTS = [
    "0.0.0.0",
    "::",
    "10.0.0.7",
    "kafka.internal",  # a name: DNS decides what it binds
    "localhost",
    "127.0.0.1\nallow.everyone.if.no.acl.found=true",
    "127.0.0.1</listen_host><listen_host>0.0.0.0",
    "",
]


@pytest.mark.parametrize("section", ["kafka", "clickhouse"])
@pytest.mark.parametrize("host", HOSTILE_HOSTS)
def test_attack_the_local_stack_binds_loopback_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, section: str, host: str
) -> None:
    started: list[Any] = []
    monkeypatch.setattr(Managed, "start", lambda self, argv: started.append(argv))
    settings = Settings(home=tmp_path, **{section: {"host": host}})
    with pytest.raises(StackError, match="loopback only"):
        stack.up(settings, Console(file=None, quiet=True), apply_topics=False)
    assert started == []  # refused before any service started


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1"])
def test_loopback_addresses_pass(tmp_path: Path, host: str) -> None:
    stack.check_binds(Settings(home=tmp_path, kafka={"host": host}, clickhouse={"host": host}))


def test_a_later_kafka_node_past_the_last_port_is_refused(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, kafka={"port": 65534, "brokers": 3})
    with pytest.raises(StackError, match="not from 1 to 65535"):
        stack.check_binds(settings)


@pytest.mark.parametrize(
    "section, key", [("kafka", "port"), ("clickhouse", "http_port"), ("s3", "port")]
)
@pytest.mark.parametrize("port", [-1, 0, 65536, 10**12])
def test_attack_a_port_out_of_range_is_a_settings_error(section: str, key: str, port: int) -> None:
    with pytest.raises(ValidationError):
        Settings(**{section: {key: port}})


@pytest.mark.parametrize(
    "name, value, says",
    [
        ("LORAPLANE_KAFKA__PORT", "-1", "kafka.port"),
        ("LORAPLANE_CLICKHOUSE__TCP_PORT", "nan", "clickhouse.tcp_port"),
        ("LORAPLANE_KAFKA__BROKERS", "0", "kafka.brokers"),
        ("LORAPLANE_HTTP__SEND_TIMEOUT_S", "nan", "http.send_timeout_s"),
        ("LORAPLANE_HTTP__MAX_BODY_BYTES", "-5", "http.max_body_bytes"),
        ("LORAPLANE_SPOOL_MAX_BYTES", "-1", "spool_max_bytes"),
        ("LORAPLANE_CLICKHOUSE__DATABASE", "a`b", "clickhouse.database"),
        ("LORAPLANE_CLICKHOUSE__USER", "../../../etc/hostname", "clickhouse.user"),
        ("LORAPLANE_CLICKHOUSE__READER_USER", "r x", "clickhouse.reader_user"),
        ("LORAPLANE_TOPIC_PREFIX", "a b", "topic_prefix"),
    ],
)
def test_attack_an_invalid_setting_is_one_line_not_a_traceback(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    value: str,
    says: str,
) -> None:
    monkeypatch.setenv("LORAPLANE_HOME", str(tmp_path))
    monkeypatch.setenv(name, value)
    monkeypatch.setattr("sys.argv", ["loraplane", "stack", "status"])
    get_settings.cache_clear()
    try:
        with pytest.raises(SystemExit) as exited:
            cli.main()
    finally:
        get_settings.cache_clear()
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.startswith("loraplane: invalid settings: ") and says in err, err
    assert "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("key", ["database", "user", "reader_user"])
@pytest.mark.parametrize(
    "name", ["a`b", "x; DROP DATABASE y", "../../x", "a/b", "", "1abc", "a" * 65, "é", "a\n"]
)
def test_attack_a_clickhouse_name_that_is_no_plain_identifier_is_a_settings_error(
    key: str, name: str
) -> None:
    """Database and user names reach DDL as `quoted` identifiers, users.xml as element names
    and the secrets folder as ``clickhouse-USER``: before, ``a`b`` was accepted here and ended
    in a ValueError traceback (report, migrate, retention) or a server error (stack up), and
    ``../../x`` named a password file outside the secrets folder."""
    with pytest.raises(ValidationError, match=key):
        Settings(clickhouse={key: name})
    assert Settings(clickhouse={key: "Loraplane_2"}).clickhouse.model_dump()[key] == "Loraplane_2"


@pytest.mark.parametrize(
    "prefix", ["a b", "x/y", "", "a\nb", ".hidden", "__consumer", "-x", "é", "p" * 101]
)
def test_attack_a_topic_prefix_kafka_cannot_name_a_topic_with_is_a_settings_error(
    prefix: str,
) -> None:
    """The prefix names every topic, ACL pattern and consumer group: before, ``a b`` was
    accepted here and `topics apply` (so `stack up`) ended in a KafkaException traceback,
    and every reader in a misleading "Topic authorization failed"."""
    with pytest.raises(ValidationError, match="topic_prefix"):
        Settings(topic_prefix=prefix)
    for good in ("loraplane", "demo-20261129-081500-1a2b", "prod.eu_1"):
        assert Settings(topic_prefix=good).topic_prefix == good
