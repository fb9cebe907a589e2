"""One Kafka client factory (loraplane/kernel/kafka.py): the source tree builds no client and
spells no broker setting anywhere else (AST scan, nothing imported), and the factory's
configurations are the ones the call sites had before it (pinned here, key by key)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loraplane.kernel import acls, kafka, topics
from loraplane.kernel.config import KafkaSettings, Settings
from loraplane.kernel.topics import TOPICS, topic_name

ROOT = Path(__file__).resolve().parents[2]
FACTORY = ROOT / "loraplane" / "kernel" / "kafka.py"
SCANNED = ("loraplane", "schemas", "streams", "workers", "infra", "dashboards", "bench", "tests")
CLIENT_CLASSES = frozenset(
    {
        "Producer",
        "Consumer",
        "AdminClient",
        "SerializingProducer",
        "DeserializingConsumer",
        "AIOKafkaProducer",
        "AIOKafkaConsumer",
    }
)
CLIENT_MODULES = ("confluent_kafka", "aiokafka")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str


def _client_module(module: str | None) -> bool:
    return module is not None and any(
        module == m or module.startswith(m + ".") for m in CLIENT_MODULES
    )


def findings_in(source: str, path: str) -> list[Finding]:
    """Every place ``source`` constructs a Kafka client or writes broker settings itself."""
    tree = ast.parse(source, path)
    classes: set[str] = set()  # local names bound to client classes
    modules: set[str] = set()  # local names bound to client modules
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _client_module(node.module):
            classes |= {a.asname or a.name for a in node.names if a.name in CLIENT_CLASSES}
        elif isinstance(node, ast.Import):
            modules |= {
                a.asname or a.name.split(".")[0] for a in node.names if _client_module(a.name)
            }
    out: list[Finding] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
            if any(n == "aiokafka" or n.startswith("aiokafka.") for n in names):
                out.append(Finding(path, node.lineno, "imports aiokafka"))
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in classes:
                out.append(Finding(path, node.lineno, f"constructs {func.id}"))
            elif (
                isinstance(func, ast.Attribute)
                and func.attr in CLIENT_CLASSES
                and ast.unparse(func.value).split(".")[0] in modules
            ):
                out.append(Finding(path, node.lineno, f"constructs {ast.unparse(func)}"))
            out += [
                Finding(path, node.lineno, "passes broker=")
                for k in node.keywords
                if k.arg == "broker"
            ]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if "bootstrap.servers" in node.value:
                out.append(Finding(path, node.lineno, "writes bootstrap.servers"))
            elif node.value.startswith("kafka://"):  # also an f-string's first part
                out.append(Finding(path, node.lineno, "writes a kafka:// broker URL"))
    return out


def test_no_module_but_the_factory_builds_a_kafka_client() -> None:
    me = Path(__file__).resolve()
    found = [
        f"{f.path}:{f.line}: {f.what}"
        for folder in SCANNED
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.resolve() not in (me, FACTORY)
        for f in findings_in(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert found == []


def test_the_scan_sees_every_way_around_the_factory() -> None:
    bad = "\n".join(
        [
            "import confluent_kafka as ck",
            "from confluent_kafka import Consumer as C, Producer",
            "from confluent_kafka.admin import AdminClient",
            "import aiokafka",
            "C({'group.id': 'g'})",
            "Producer({})",
            "AdminClient({})",
            "ck.Consumer({})",
            "x = {'bootstrap.servers': 'h:1'}",
            "faust.App('a', broker=f'kafka://{host}')",
        ]
    )
    whats = [f.what for f in findings_in(bad, "bad.py")]
    assert sorted(whats) == sorted(
        [
            "imports aiokafka",
            "constructs C",
            "constructs Producer",
            "constructs AdminClient",
            "constructs ck.Consumer",
            "writes bootstrap.servers",
            "passes broker=",
            "writes a kafka:// broker URL",
        ]
    )
    fine = "from loraplane.kernel import kafka\nkafka.consumer(s, 'g')\nConsumer = 1\n"
    assert findings_in(fine, "fine.py") == []


# No credentials folder: these pin the PLAINTEXT configurations, whatever stack runs here.
SETTINGS = Settings(kafka=KafkaSettings(credentials_dir=ROOT / "tests" / "no-such-folder"))
BOOTSTRAP = SETTINGS.kafka.bootstrap


def test_the_default_producer_is_the_old_bus_producer() -> None:
    assert kafka.producer_config(SETTINGS) == {
        "bootstrap.servers": BOOTSTRAP,
        "acks": "all",
        "enable.idempotence": True,
        "linger.ms": 5,
        "message.timeout.ms": 15_000,
        "client.id": "loraplane",
        "partitioner": "murmur2_random",
        "topic.metadata.refresh.interval.ms": kafka.METADATA_REFRESH_MS,
    }  # a key's partition as Faust and Java clients pick it


def test_the_scoring_transactional_producer_keeps_its_settings() -> None:
    assert kafka.producer_config(
        SETTINGS, client_id="loraplane-scoring", transactional_id="p-scoring"
    ) == {
        "bootstrap.servers": BOOTSTRAP,
        "acks": "all",
        "enable.idempotence": True,
        "linger.ms": 5,
        "message.timeout.ms": 15_000,
        "client.id": "loraplane-scoring",
        "transactional.id": "p-scoring",
        "retry.backoff.ms": kafka.TRANSACTION_RETRY_BACKOFF_MS,
        "partitioner": "murmur2_random",
        "topic.metadata.refresh.interval.ms": kafka.METADATA_REFRESH_MS,
    }


def test_every_producer_learns_a_grown_topics_count_within_seconds() -> None:
    """librdkafka refreshes a producer's topic metadata every 5 minutes by default, and
    hashes keys over the partition count it last learned: after a grow a worker's states
    went to their partition under the old count for up to 5 minutes, where readers knowing
    only the new count refuse them (``wrong_partition``). Every producer of the factory,
    transactional ones too, asks again within a heartbeat."""
    for conf in (
        kafka.producer_config(SETTINGS),
        kafka.producer_config(SETTINGS, client_id="worker-w1", linger_ms=20),
        kafka.producer_config(SETTINGS, transactional_id="p-planner"),
    ):
        assert conf["topic.metadata.refresh.interval.ms"] == kafka.METADATA_REFRESH_MS <= 5_000


def test_a_transaction_begun_right_after_the_last_asks_again_within_milliseconds() -> None:
    """The broker refuses a transaction's partitions and offsets until the markers of the
    one before are written, and librdkafka asks again only after ``retry.backoff.ms``: at
    its 100 ms default every back-to-back transaction waited ~100 ms. Only transactional
    producers ask sooner; the others keep librdkafka's backoff."""
    txn = kafka.producer_config(SETTINGS, transactional_id="p-planner")
    assert txn["retry.backoff.ms"] == kafka.TRANSACTION_RETRY_BACKOFF_MS <= 20
    assert "retry.backoff.ms" not in kafka.producer_config(SETTINGS)


def test_the_command_feed_consumer_keeps_its_settings() -> None:
    """The worker's consumer before the factory, plus read_committed (librdkafka's
    default, now said)."""
    assert kafka.consumer_config(
        SETTINGS, "p-worker-w1", static_member="worker-w1", session_timeout_ms=15_000
    ) == {
        "bootstrap.servers": BOOTSTRAP,
        "group.id": "p-worker-w1",
        "group.instance.id": "worker-w1",
        "session.timeout.ms": 15_000,
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "enable.partition.eof": False,
        "isolation.level": "read_committed",
    }


def test_the_metrics_sink_consumer_keeps_its_settings() -> None:
    assert kafka.consumer_config(
        SETTINGS, "p.metrics-sink", client_id="metrics-sink", session_timeout_ms=10_000, quiet=True
    ) == {
        "bootstrap.servers": BOOTSTRAP,
        "log_level": 0,
        "group.id": "p.metrics-sink",
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "enable.partition.eof": False,
        "session.timeout.ms": 10_000,
        "client.id": "metrics-sink",
        "isolation.level": "read_committed",
    }


def test_a_registry_tail_consumer_fetches_a_bounded_amount_ahead() -> None:
    """A registry tail's first read of a large topic holds at most PREFETCH_KBYTES of
    records fetched ahead, not librdkafka's 64 MB; other consumers keep the default."""
    from loraplane.registry.topic import PREFETCH_KBYTES, registry_tail

    conf = kafka.consumer_config(SETTINGS, "g", prefetch_kbytes=PREFETCH_KBYTES)
    assert conf["queued.max.messages.kbytes"] == PREFETCH_KBYTES == 4096
    assert "queued.max.messages.kbytes" not in kafka.consumer_config(SETTINGS, "g")
    tail = registry_tail(SETTINGS, "w1", start=False)
    assert tail._prefetch_kbytes == PREFETCH_KBYTES


def test_admin_clients_are_quiet() -> None:
    assert kafka.admin_config(SETTINGS) == {"bootstrap.servers": BOOTSTRAP, "log_level": 0}


def test_faust_gets_the_same_guarantees() -> None:
    assert kafka.faust_broker(SETTINGS) == {
        "broker": f"kafka://{BOOTSTRAP}",
        "producer_acks": -1,
        "consumer_auto_offset_reset": "earliest",
        "broker_session_timeout": 10.0,
        "broker_heartbeat_interval": 2.0,
    }


def test_every_broker_of_a_cluster_is_bootstrapped() -> None:
    three = Settings(kafka=KafkaSettings(port=30092, controller_port=30093, brokers=3))
    assert three.kafka.bootstrap == "127.0.0.1:30092,127.0.0.1:30094,127.0.0.1:30096"
    assert kafka.admin_config(three)["bootstrap.servers"] == three.kafka.bootstrap
    assert kafka.faust_broker(three)["broker"] == (
        "kafka://127.0.0.1:30092;kafka://127.0.0.1:30094;kafka://127.0.0.1:30096"
    )


@given(
    group=st.text(min_size=1, max_size=20),
    reset=st.sampled_from(kafka.OffsetReset),
    to_end=st.booleans(),
    session=st.none() | st.integers(6_000, 60_000),
    quiet=st.booleans(),
)
def test_no_consumer_auto_commits_or_reads_aborted_writes(
    group: str, reset: kafka.OffsetReset, to_end: bool, session: int | None, quiet: bool
) -> None:
    """Whatever a call site asks for, offsets are committed only by the code that did the
    work, and aborted transactions stay unread."""
    conf = kafka.consumer_config(
        SETTINGS,
        group,
        offset_reset=reset,
        read_to_end=to_end,
        session_timeout_ms=session,
        quiet=quiet,
    )
    assert conf["enable.auto.commit"] is False
    assert conf["isolation.level"] == "read_committed"
    assert conf["group.id"] == group and conf["auto.offset.reset"] == reset.value
    assert conf["bootstrap.servers"] == BOOTSTRAP


@given(
    linger=st.integers(0, 1000),
    client=st.text(min_size=1, max_size=20),
    quiet=st.booleans(),
    batch=st.none() | st.integers(1, 100_000),
)
def test_every_producer_waits_for_all_replicas_and_is_idempotent(
    linger: int, client: str, quiet: bool, batch: int | None
) -> None:
    conf = kafka.producer_config(
        SETTINGS, client_id=client, linger_ms=linger, quiet=quiet, batch_messages=batch
    )
    assert conf["acks"] == "all" and conf["enable.idempotence"] is True
    assert conf["message.timeout.ms"] == 15_000 and conf["linger.ms"] == linger


def test_librdkafka_accepts_every_configuration() -> None:
    """Construction validates the keys (no broker needed): a typo fails here, not in a
    deployment."""
    kafka.producer(SETTINGS, client_id="t", linger_ms=0, batch_messages=10, quiet=True)
    kafka.transactional_producer(SETTINGS, "t-scoring", client_id="t")
    kafka.admin(SETTINGS)
    consumer = kafka.consumer(
        SETTINGS,
        "t",
        client_id="t",
        session_timeout_ms=10_000,
        static_member="t-1",
        read_to_end=True,
        quiet=True,
        offset_reset=kafka.OffsetReset.latest,
    )
    consumer.close()


def _stack_settings(tmp_path: Path) -> Settings:
    """Settings whose credentials folder holds one 0600 password file per principal."""
    settings = Settings(
        home=tmp_path, secrets_dir=tmp_path / "secrets", kafka=KafkaSettings()
    )  # not a session env var's
    for principal in kafka.Principal:
        path = kafka.password_path(settings, principal)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"pw-of-{principal}\n")
        path.chmod(0o600)
    return settings


def test_with_a_credentials_folder_every_client_authenticates_as_its_runtime(
    tmp_path: Path,
) -> None:
    settings = _stack_settings(tmp_path)
    sasl = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-256"}
    assert (
        kafka.admin_config(settings).items()
        >= {**sasl, "sasl.username": "ops", "sasl.password": "pw-of-ops"}.items()
    )
    try:
        kafka.act_as(kafka.Principal.worker)
        for conf in (kafka.producer_config(settings), kafka.consumer_config(settings, "g")):
            assert (
                conf.items()
                >= {**sasl, "sasl.username": "worker", "sasl.password": "pw-of-worker"}.items()
            )
        creds = kafka.faust_broker(settings)["broker_credentials"]
        assert (creds.username, creds.password) == ("worker", "pw-of-worker")
        assert creds.mechanism.value == "SCRAM-SHA-256"
        assert creds.protocol.value == "SASL_PLAINTEXT"
    finally:
        kafka.act_as(kafka.Principal.ops)


def test_an_explicit_username_wins_and_its_password_never_shows(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret-value")
    secret.chmod(0o600)
    settings = Settings(
        home=tmp_path,
        kafka=KafkaSettings(
            username="ci-publisher", password_file=secret, sasl_mechanism="SCRAM-SHA-512"
        ),
    )
    conf = kafka.producer_config(settings)
    assert (conf["sasl.username"], conf["sasl.password"]) == ("ci-publisher", "s3cret-value")
    assert conf["sasl.mechanism"] == "SCRAM-SHA-512"
    assert "s3cret-value" not in repr(kafka.credentials(settings))
    assert "s3cret-value" not in repr(settings)


def test_unsafe_or_missing_password_files_are_refused(tmp_path: Path) -> None:
    settings = _stack_settings(tmp_path)
    loose = kafka.password_path(settings, kafka.Principal.ops)
    loose.chmod(0o644)
    with pytest.raises(kafka.KafkaAuthError, match="readable by others"):
        kafka.producer_config(settings)
    loose.unlink()
    with pytest.raises(kafka.KafkaAuthError, match="does not exist"):
        kafka.producer_config(settings)
    with pytest.raises(kafka.KafkaAuthError, match="password_file is not"):
        kafka.admin_config(Settings(home=tmp_path, kafka=KafkaSettings(username="u")))


def test_a_copy_moved_to_another_home_keeps_the_stacks_passwords(tmp_path: Path) -> None:
    settings = _stack_settings(tmp_path / "stack")
    moved = settings.model_copy(update={"home": tmp_path / "run"})
    assert kafka.admin_config(moved)["sasl.password"] == "pw-of-ops"
    assert kafka.credentials_env(moved) == {
        "LORAPLANE_KAFKA__CREDENTIALS_DIR": str(tmp_path / "stack" / "secrets" / "kafka")
    }


def _writers(grants: list[acls.Grant], topic: str) -> set[kafka.Principal]:
    return {
        g.principal
        for g in grants
        if g.resource is acls.Resource.topic
        and g.operation in (acls.Operation.write, acls.Operation.all)
        and (g.name == topic or (g.pattern is acls.Pattern.prefixed and topic.startswith(g.name)))
    }


def test_only_the_streams_app_writes_registry_and_commands() -> None:
    grants = acls.grants(SETTINGS, topics.access(SETTINGS), topics.every_topic(SETTINGS))
    for suffix in ("registry", "commands", "scores", "audit", "decisions"):
        assert _writers(grants, topic_name(SETTINGS, suffix)) == {kafka.Principal.streams}
    for suffix in ("requests", "worker-state", "cache-events"):
        assert _writers(grants, topic_name(SETTINGS, suffix)) == {kafka.Principal.worker}
    assert _writers(grants, topic_name(SETTINGS, "lifecycle")) == set()  # ops only
    assert not [
        g
        for g in grants
        if g.principal is kafka.Principal.reader and g.operation is not acls.Operation.read
    ]
    assert not [g for g in grants if g.principal is kafka.Principal.ops]  # a super user
    assert {t.suffix for t in TOPICS} >= {"registry", "commands"}


def test_the_acl_table_is_per_prefix() -> None:
    other = SETTINGS.model_copy(update={"topic_prefix": "t-1"})
    names = {
        g.name for g in acls.grants(other, topics.access(other), topics.every_topic(other))
    } - {acls.READER_GROUP_PREFIX}
    assert names and all(n.startswith("t-1") for n in names)


class _Queue:
    """A consumer's fetched messages, as ``poll`` and ``consume`` take them."""

    def __init__(self, messages: list[str]) -> None:
        self.messages = messages
        self.calls: list[tuple[str, float]] = []

    def poll(self, timeout: float) -> str | None:
        self.calls.append(("poll", timeout))
        return self.messages.pop(0) if self.messages else None

    def consume(self, num_messages: int, timeout: float) -> list[str]:
        self.calls.append(("consume", timeout))
        taken, self.messages = self.messages[:num_messages], self.messages[num_messages:]
        return taken


def test_consume_ready_hands_the_first_message_over_without_waiting_for_a_full_batch() -> None:
    """``Consumer.consume`` waits its whole timeout unless the batch fills: a tail must wait
    for the first message only, then take what has arrived (or linger as asked)."""
    q = _Queue(["a", "b", "c", "d"])
    assert kafka.consume_ready(q, 3, 0.2) == ["a", "b", "c"]  # type: ignore[arg-type]
    assert q.calls == [("poll", 0.2), ("consume", 0.0)]
    assert kafka.consume_ready(q, 5, 0.2, linger_s=0.01) == ["d"]  # type: ignore[arg-type]
    assert q.calls[-1] == ("consume", 0.01)
    assert kafka.consume_ready(q, 5, 0.2) == []  # type: ignore[arg-type]
    assert q.calls[-1] == ("poll", 0.2)  # nothing arrived: no batch read
    assert kafka.consume_ready(_Queue(["x", "y"]), 1, 0.2) == ["x"]  # type: ignore[arg-type]
