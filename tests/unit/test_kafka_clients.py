"""One Kafka client factory (loraplane/kernel/kafka.py): the source tree builds no client and
spells no broker setting anywhere else (AST scan, nothing imported), and the factory's
configurations are the ones the call sites had before it (pinned here, key by key)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from loraplane.kernel import kafka
from loraplane.kernel.config import Settings

ROOT = Path(__file__).resolve().parents[2]
FACTORY = ROOT / "loraplane" / "kernel" / "kafka.py"
SCANNED = ("loraplane", "schemas", "streams", "workers", "infra", "dashboards", "bench",
           "tests")
CLIENT_CLASSES = frozenset({"Producer", "Consumer", "AdminClient", "SerializingProducer",
                            "DeserializingConsumer", "AIOKafkaProducer", "AIOKafkaConsumer"})
CLIENT_MODULES = ("confluent_kafka", "aiokafka")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str


def _client_module(module: str | None) -> bool:
    return module is not None and any(module == m or module.startswith(m + ".")
                                      for m in CLIENT_MODULES)


def findings_in(source: str, path: str) -> list[Finding]:
    """Every place ``source`` constructs a Kafka client or writes broker settings itself."""
    tree = ast.parse(source, path)
    classes: set[str] = set()  # local names bound to client classes
    modules: set[str] = set()  # local names bound to client modules
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _client_module(node.module):
            classes |= {a.asname or a.name for a in node.names if a.name in CLIENT_CLASSES}
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name.split(".")[0] for a in node.names
                        if _client_module(a.name)}
    out: list[Finding] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) \
                else [node.module or ""]
            if any(n == "aiokafka" or n.startswith("aiokafka.") for n in names):
                out.append(Finding(path, node.lineno, "imports aiokafka"))
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in classes:
                out.append(Finding(path, node.lineno, f"constructs {func.id}"))
            elif (isinstance(func, ast.Attribute) and func.attr in CLIENT_CLASSES
                  and ast.unparse(func.value).split(".")[0] in modules):
                out.append(Finding(path, node.lineno, f"constructs {ast.unparse(func)}"))
            out += [Finding(path, node.lineno, "passes broker=") for k in node.keywords
                    if k.arg == "broker"]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if "bootstrap.servers" in node.value:
                out.append(Finding(path, node.lineno, "writes bootstrap.servers"))
            elif node.value.startswith("kafka://"):  # also an f-string's first part
                out.append(Finding(path, node.lineno, "writes a kafka:// broker URL"))
    return out


def test_no_module_but_the_factory_builds_a_kafka_client() -> None:
    me = Path(__file__).resolve()
    found = [f"{f.path}:{f.line}: {f.what}"
             for folder in SCANNED for path in sorted((ROOT / folder).rglob("*.py"))
             if path.resolve() not in (me, FACTORY)
             for f in findings_in(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == []


def test_the_scan_sees_every_way_around_the_factory() -> None:
    bad = '\n'.join([
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
    ])
    whats = [f.what for f in findings_in(bad, "bad.py")]
    assert sorted(whats) == sorted([
        "imports aiokafka", "constructs C", "constructs Producer", "constructs AdminClient",
        "constructs ck.Consumer", "writes bootstrap.servers", "passes broker=",
        "writes a kafka:// broker URL"])
    fine = "from loraplane.kernel import kafka\nkafka.consumer(s, 'g')\nConsumer = 1\n"
    assert findings_in(fine, "fine.py") == []


SETTINGS = Settings()
BOOTSTRAP = SETTINGS.kafka.bootstrap


def test_the_default_producer_is_the_old_bus_producer() -> None:
    assert kafka.producer_config(SETTINGS) == {
        "bootstrap.servers": BOOTSTRAP, "acks": "all", "enable.idempotence": True,
        "linger.ms": 5, "message.timeout.ms": 15_000, "client.id": "loraplane"}


def test_the_scoring_transactional_producer_keeps_its_settings() -> None:
    assert kafka.producer_config(SETTINGS, client_id="loraplane-scoring",
                                 transactional_id="p-scoring") == {
        "bootstrap.servers": BOOTSTRAP, "acks": "all", "enable.idempotence": True,
        "linger.ms": 5, "message.timeout.ms": 15_000, "client.id": "loraplane-scoring",
        "transactional.id": "p-scoring"}


def test_the_command_feed_consumer_keeps_its_settings() -> None:
    """The worker's consumer before the factory, plus read_committed (librdkafka's
    default, now said)."""
    assert kafka.consumer_config(SETTINGS, "p-worker-w1", static_member="worker-w1",
                                 session_timeout_ms=15_000) == {
        "bootstrap.servers": BOOTSTRAP, "group.id": "p-worker-w1",
        "group.instance.id": "worker-w1", "session.timeout.ms": 15_000,
        "auto.offset.reset": "earliest", "enable.auto.commit": False,
        "enable.partition.eof": False, "isolation.level": "read_committed"}


def test_the_metrics_sink_consumer_keeps_its_settings() -> None:
    assert kafka.consumer_config(SETTINGS, "p.metrics-sink", client_id="metrics-sink",
                                 session_timeout_ms=10_000, quiet=True) == {
        "bootstrap.servers": BOOTSTRAP, "log_level": 0, "group.id": "p.metrics-sink",
        "enable.auto.commit": False, "auto.offset.reset": "earliest",
        "enable.partition.eof": False, "session.timeout.ms": 10_000,
        "client.id": "metrics-sink", "isolation.level": "read_committed"}


def test_admin_clients_are_quiet() -> None:
    assert kafka.admin_config(SETTINGS) == {"bootstrap.servers": BOOTSTRAP, "log_level": 0}


def test_faust_gets_the_same_guarantees() -> None:
    assert kafka.faust_broker(SETTINGS) == {
        "broker": f"kafka://{BOOTSTRAP}", "producer_acks": -1,
        "consumer_auto_offset_reset": "earliest", "broker_session_timeout": 10.0,
        "broker_heartbeat_interval": 2.0}


@given(group=st.text(min_size=1, max_size=20), reset=st.sampled_from(kafka.OffsetReset),
       to_end=st.booleans(), session=st.none() | st.integers(6_000, 60_000),
       quiet=st.booleans())
def test_no_consumer_auto_commits_or_reads_aborted_writes(
        group: str, reset: kafka.OffsetReset, to_end: bool, session: int | None,
        quiet: bool) -> None:
    """Whatever a call site asks for, offsets are committed only by the code that did the
    work, and aborted transactions stay unread."""
    conf = kafka.consumer_config(SETTINGS, group, offset_reset=reset, read_to_end=to_end,
                                 session_timeout_ms=session, quiet=quiet)
    assert conf["enable.auto.commit"] is False
    assert conf["isolation.level"] == "read_committed"
    assert conf["group.id"] == group and conf["auto.offset.reset"] == reset.value
    assert conf["bootstrap.servers"] == BOOTSTRAP


@given(linger=st.integers(0, 1000), client=st.text(min_size=1, max_size=20),
       quiet=st.booleans(), batch=st.none() | st.integers(1, 100_000))
def test_every_producer_waits_for_all_replicas_and_is_idempotent(
        linger: int, client: str, quiet: bool, batch: int | None) -> None:
    conf = kafka.producer_config(SETTINGS, client_id=client, linger_ms=linger, quiet=quiet,
                                 batch_messages=batch)
    assert conf["acks"] == "all" and conf["enable.idempotence"] is True
    assert conf["message.timeout.ms"] == 15_000 and conf["linger.ms"] == linger


def test_librdkafka_accepts_every_configuration() -> None:
    """Construction validates the keys (no broker needed): a typo fails here, not in a
    deployment."""
    kafka.producer(SETTINGS, client_id="t", linger_ms=0, batch_messages=10, quiet=True)
    kafka.transactional_producer(SETTINGS, "t-scoring", client_id="t")
    kafka.admin(SETTINGS)
    consumer = kafka.consumer(SETTINGS, "t", client_id="t", session_timeout_ms=10_000,
                              static_member="t-1", read_to_end=True, quiet=True,
                              offset_reset=kafka.OffsetReset.latest)
    consumer.close()
