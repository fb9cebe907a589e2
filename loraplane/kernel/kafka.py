"""The one Kafka client factory: every producer, consumer and admin client the project makes,
and the Faust app's broker settings, are configured here, so a delivery or offset guarantee
is decided once instead of once per call site (tests/unit/test_kafka_clients.py checks that
nothing else builds a client).

``*_config`` functions are pure (the librdkafka dict, testable without a broker); the others
construct the confluent-kafka client from it. confluent-kafka is imported lazily: the kernel
is imported by processes that never talk to Kafka.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict, Unpack

if TYPE_CHECKING:
    from confluent_kafka import Consumer, Message, Producer
    from confluent_kafka.admin import AdminClient

    from loraplane.kernel.config import Settings

__all__ = [
    "CLIENT_ID",
    "METADATA_REFRESH_MS",
    "TRANSACTION_RETRY_BACKOFF_MS",
    "Config",
    "ConfigValue",
    "ConsumerOptions",
    "Credentials",
    "FaustBroker",
    "KafkaAuthError",
    "KafkaUnavailable",
    "OffsetReset",
    "Principal",
    "act_as",
    "acting_as",
    "admin",
    "admin_config",
    "consume_ready",
    "consumer",
    "consumer_config",
    "credentials",
    "credentials_env",
    "faust_broker",
    "password_path",
    "producer",
    "producer_config",
    "read_password",
    "transactional_producer",
]

ConfigValue = str | int | float | bool  # confluent-kafka's own value type
Config = dict[str, ConfigValue]

CLIENT_ID = "loraplane"
"""What the broker's logs and quotas see from a client that names nothing more specific."""

TRANSACTION_RETRY_BACKOFF_MS = 10
"""How soon a transactional producer asks again after a refused request (librdkafka's
``retry.backoff.ms``, 100 by default). The broker refuses a transaction's partitions and
offsets (CONCURRENT_TRANSACTIONS) until it has written the markers of the one before, a few
ms after that one's commit returned, so a transaction begun right after the last (a scoring
keeper behind a backlog, ticks back to back) waited a whole backoff: ~100 ms each. It is
the first backoff of every other retry of such a producer too (a produce, a coordinator or
leader lookup); later retries still back off exponentially, up to ``retry.backoff.max.ms``
(1 s)."""

METADATA_REFRESH_MS = 5_000
"""How often a producer asks the broker for the metadata of the topics it writes
(librdkafka's ``topic.metadata.refresh.interval.ms``, 5 min by default): a topic grown is
hashed over by its new partition count within this long. Until then a key goes to its
partition under the old count, which readers that know only the new one refuse
(``worker_states.at_home``: a worker's states missing from ``fleet status``, ``plan show``
and a router started after the grow). With the workers' 5 s heartbeat a grown worker-state
topic holds every worker's state at home within 10 s, before the 15 s after which a
silent worker is drained. One small metadata request per producer per interval, for the
topics it wrote only (``topic.metadata.refresh.sparse``, librdkafka's default)."""


class KafkaUnavailable(RuntimeError):
    """The broker could not be reached (the text says where and why)."""


class OffsetReset(StrEnum):
    """Where a consumer group with no committed offset starts."""

    earliest = "earliest"
    """Everything already on the topic: a new group (a first start, a renamed prefix) must
    not miss what was written before it joined. Every project consumer uses it."""
    latest = "latest"
    """Only what arrives after joining: latency probes that time their own messages."""


class KafkaAuthError(RuntimeError):
    """This process's Kafka credentials are missing or unsafe (the text says which file)."""


class Principal(StrEnum):
    """The Kafka users of a loraplane stack; what each may do is the ACL table of
    ``loraplane.kernel.acls`` (docs/security.md). A runtime names its own with ``act_as``."""

    ops = "ops"
    """Super user: the stack, ``topics apply`` (topics and ACLs), operator tools, tests."""
    streams = "streams"
    """The Faust app: the only writer of registry, commands, scores, audit, decisions."""
    worker = "worker"
    """A worker agent and its gateway: request logs, worker state, cache events."""
    metrics = "metrics"
    """The metrics sink: reads the event topics into ClickHouse."""
    reader = "reader"
    """Read-only tools (``registry list``)."""
    router = "router"
    """A fleet router (``loraplane router run``): reads worker states and the registry."""


_acting_as = Principal.ops


def act_as(principal: Principal) -> None:
    """Pick the principal this process uses when ``kafka.username`` is unset. Called once by
    each runtime's entry point, before it builds a client; everything else (the CLI, tests)
    stays ``ops``."""
    global _acting_as
    _acting_as = principal


def acting_as() -> Principal:
    return _acting_as


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)  # never in a repr, a log line or an error


def password_path(settings: Settings, principal: Principal | str) -> Path:
    """Where the local stack keeps ``principal``'s password."""
    folder = settings.kafka.credentials_dir or settings.secrets_dir / "kafka"
    return folder / f"{principal}.password"


def read_password(path: Path) -> str:
    """A password file's content; refused unless only its owner can read it (0600), so a
    copied or hand-made file with loose permissions fails loudly instead of leaking. Read as
    every secret is (``secrets.read_secret``); a refusal never quotes its bytes."""
    from loraplane.kernel.secrets import SecretError, read_secret

    try:
        return read_secret(path, hint="the kafka password of this principal")
    except SecretError as exc:
        if not path.is_symlink() and not path.exists():
            raise KafkaAuthError(f"kafka password file {path} does not exist") from None
        raise KafkaAuthError(f"kafka password: {exc}") from None


def credentials(settings: Settings) -> Credentials | None:
    """This process's SASL identity: ``kafka.username`` with its ``password_file``, else the
    acting principal's file in the credentials folder, else None (PLAINTEXT: a broker
    without SASL, as unit tests and bare setups have)."""
    k = settings.kafka
    if k.username is not None:
        if k.password_file is None:
            raise KafkaAuthError("kafka.username is set but kafka.password_file is not")
        return Credentials(k.username, read_password(k.password_file))
    path = password_path(settings, _acting_as)
    if not path.parent.is_dir():
        return None
    return Credentials(str(_acting_as), read_password(path))


def credentials_env(settings: Settings) -> dict[str, str]:
    """What a child process with another home (a test's, a benchmark's) needs in its
    environment to find the stack's password files; it still acts as its own principal."""
    folder = password_path(settings, Principal.ops).parent
    return {"LORAPLANE_KAFKA__CREDENTIALS_DIR": str(folder)}


def _common(settings: Settings, client_id: str | None, quiet: bool) -> Config:
    conf: Config = {"bootstrap.servers": settings.kafka.bootstrap}
    creds = credentials(settings)
    if creds is not None:
        conf |= {
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": settings.kafka.sasl_mechanism,
            "sasl.username": creds.username,
            "sasl.password": creds.password,
        }
    if client_id is not None:
        conf["client.id"] = client_id
    if quiet:
        # Probes and start-up checks expect refused connections and report failures
        # themselves; librdkafka's own log lines would only be noise on stderr.
        conf["log_level"] = 0
    return conf


def _logged(conf: Config) -> dict[str, Any]:
    """``conf`` with librdkafka's log lines sent through the process's logging, rate-limited
    (``kernel.librdkafka_log``), unless the client is quiet."""
    if conf.get("log_level") == 0:
        return dict(conf)
    from loraplane.kernel.librdkafka_log import LIBRDKAFKA_LOG

    return {**conf, "logger": LIBRDKAFKA_LOG}


def producer_config(
    settings: Settings,
    *,
    client_id: str = CLIENT_ID,
    linger_ms: int = 5,
    batch_messages: int | None = None,
    transactional_id: str | None = None,
    quiet: bool = False,
) -> Config:
    """acks=all with idempotence: a message counts as delivered only once every in-sync
    replica has it, and librdkafka's retries can neither duplicate nor reorder it (the
    scoring and registry replays rely on per-partition order). ``message.timeout.ms`` is
    15 s, not librdkafka's 5 min, so a broker outage surfaces as a delivery error quickly
    (``bus.produce_sync``, the event sink's ``failed`` count) instead of a hang.
    ``linger_ms`` 5 batches a burst without adding noticeable latency; the event sink,
    which never waits for delivery, lingers longer. ``partitioner`` ``murmur2_random`` puts a
    key in the partition Faust (aiokafka) and Java clients put it in (librdkafka's default,
    CRC32, does not): the registry topic is written by Faust, lifecycle events may come from
    producers in other languages, and a key in two partitions of a compacted topic has no
    single latest record and no order across them. A topic grown is hashed over by its new
    count within ``METADATA_REFRESH_MS``. With ``transactional_id``, refused requests are
    retried after ``TRANSACTION_RETRY_BACKOFF_MS``."""
    conf = _common(settings, client_id, quiet)
    conf |= {
        "acks": "all",
        "enable.idempotence": True,
        "linger.ms": linger_ms,
        "message.timeout.ms": 15_000,
        "partitioner": "murmur2_random",
        "topic.metadata.refresh.interval.ms": METADATA_REFRESH_MS,
    }
    if batch_messages is not None:
        conf["batch.num.messages"] = batch_messages
    if transactional_id is not None:
        conf["transactional.id"] = transactional_id
        conf["retry.backoff.ms"] = TRANSACTION_RETRY_BACKOFF_MS
    return conf


def producer(
    settings: Settings,
    *,
    client_id: str = CLIENT_ID,
    linger_ms: int = 5,
    batch_messages: int | None = None,
    quiet: bool = False,
) -> Producer:
    """A producer as ``producer_config`` describes."""
    from confluent_kafka import Producer

    return Producer(
        _logged(
            producer_config(
                settings,
                client_id=client_id,
                linger_ms=linger_ms,
                batch_messages=batch_messages,
                quiet=quiet,
            )
        )
    )


def transactional_producer(
    settings: Settings,
    transactional_id: str,
    *,
    client_id: str,
    transaction_timeout_ms: int | None = None,
) -> Producer:
    """An idempotent producer (``producer_config``) whose writes and consumer offsets commit
    atomically. ``init_transactions`` with the same id fences a previous instance and aborts
    its open transaction. ``transaction_timeout_ms`` bounds how long the transaction of a
    process killed mid-batch holds back readers when no successor reuses its id (the
    broker aborts it then; librdkafka's default is 60 s)."""
    from confluent_kafka import Producer

    conf = producer_config(settings, client_id=client_id, transactional_id=transactional_id)
    if transaction_timeout_ms is not None:
        conf["transaction.timeout.ms"] = transaction_timeout_ms
    return Producer(_logged(conf))


def consumer_config(
    settings: Settings,
    group: str,
    *,
    client_id: str | None = None,
    offset_reset: OffsetReset = OffsetReset.earliest,
    session_timeout_ms: int | None = None,
    static_member: str | None = None,
    read_to_end: bool = False,
    quiet: bool = False,
    heartbeat_ms: int | None = None,
    cooperative: bool = False,
    prefetch_kbytes: int | None = None,
    fetch_wait_ms: int | None = None,
) -> Config:
    """Offsets are never auto-committed: every consumer here commits only after its work is
    durable (or does not commit at all), so a crash replays instead of losing messages.
    ``isolation.level`` read_committed (librdkafka's default, said out loud): aborted
    scoring transactions are never read. ``session_timeout_ms`` shortens how long a killed
    member holds its partitions (librdkafka's default is 45 s); ``static_member`` (a
    ``group.instance.id``) lets a restarted process take them back at once. ``read_to_end``
    turns on partition-EOF events, for readers that stop at the end of a topic.
    ``heartbeat_ms`` with a short session notices a dead member sooner. ``cooperative``:
    incremental rebalancing (``cooperative-sticky``), so a member joining or leaving moves
    only the partitions that change hands and the others stay where they are (the scoring
    group: each move costs a read-back of that partition's scores; the planner lease: a
    standby joining must not take the lease away). ``prefetch_kbytes`` bounds what
    librdkafka fetches ahead of the reader (``queued.max.messages.kbytes``, 64 MB by
    default): a reader that keeps a tenth of a large topic need not hold 64 MB of it.
    ``fetch_wait_ms``: how long the broker holds a fetch that found nothing (librdkafka's
    default is 500 ms): a latency-bound reader of a read-committed topic lowers it, since
    a fetch parked before a transaction committed may only answer when it expires."""
    conf = _common(settings, client_id, quiet)
    conf |= {
        "group.id": group,
        "enable.auto.commit": False,
        "auto.offset.reset": offset_reset.value,
        "isolation.level": "read_committed",
        "enable.partition.eof": read_to_end,
    }
    if session_timeout_ms is not None:
        conf["session.timeout.ms"] = session_timeout_ms
    if static_member is not None:
        conf["group.instance.id"] = static_member
    if heartbeat_ms is not None:
        conf["heartbeat.interval.ms"] = heartbeat_ms
    if cooperative:
        conf["partition.assignment.strategy"] = "cooperative-sticky"
    if prefetch_kbytes is not None:
        conf["queued.max.messages.kbytes"] = prefetch_kbytes
    if fetch_wait_ms is not None:
        conf["fetch.wait.max.ms"] = fetch_wait_ms
    return conf


class ConsumerOptions(TypedDict, total=False):
    """The keyword options of ``consumer_config``, which ``consumer`` passes on unchanged."""

    client_id: str | None
    offset_reset: OffsetReset
    session_timeout_ms: int | None
    static_member: str | None
    read_to_end: bool
    quiet: bool
    heartbeat_ms: int | None
    cooperative: bool
    prefetch_kbytes: int | None
    fetch_wait_ms: int | None


def consumer(settings: Settings, group: str, **options: Unpack[ConsumerOptions]) -> Consumer:
    """A consumer as ``consumer_config`` describes."""
    from confluent_kafka import Consumer

    return Consumer(_logged(consumer_config(settings, group, **options)))


def consume_ready(
    consumer: Consumer, most: int, timeout_s: float, linger_s: float = 0.0
) -> list[Message]:
    """Up to ``most`` messages: waits up to ``timeout_s`` for the first, then ``linger_s``
    more for others (0: takes only what has already arrived). ``Consumer.consume`` itself
    waits its whole timeout unless ``most`` arrive, so a reader woken by one record would
    hand it over only when the timeout ends; this one hands it over at once (or after the
    linger it chose) and still batches a backlog."""
    first = consumer.poll(timeout_s)
    if first is None:
        return []
    return [first, *consumer.consume(most - 1, linger_s)] if most > 1 else [first]


def admin_config(settings: Settings) -> Config:
    """Admin clients are short-lived (topic apply, health checks, clean-up) and their
    callers turn failures into KafkaUnavailable or a status line: quiet."""
    return _common(settings, None, quiet=True)


def admin(settings: Settings) -> AdminClient:
    """An admin client as ``admin_config`` describes."""
    from confluent_kafka.admin import AdminClient

    return AdminClient(admin_config(settings))


class FaustBroker(TypedDict):
    """The broker keyword arguments of ``faust.App`` (aiokafka underneath)."""

    broker: str
    producer_acks: int
    consumer_auto_offset_reset: str
    broker_session_timeout: float
    broker_heartbeat_interval: float
    broker_credentials: NotRequired[Any]  # faust.SASLCredentials, when the broker has SASL


def faust_broker(settings: Settings) -> FaustBroker:
    """The Faust app's clients, on the same guarantees as ours: acks=all (-1) and a new
    group reads from the earliest offset. A killed worker's partitions move to its
    successor after 10 s, not Faust's 60 s default: the planner must not stay silent for a
    minute after a crash (the heartbeat must stay well under the session timeout). With
    credentials, aiokafka authenticates with the same SCRAM mechanism as our own clients."""
    urls = ";".join(f"kafka://{node}" for node in settings.kafka.bootstrap.split(","))
    broker = FaustBroker(
        broker=urls,
        producer_acks=-1,
        consumer_auto_offset_reset=OffsetReset.earliest.value,
        broker_session_timeout=10.0,
        broker_heartbeat_interval=2.0,
    )
    creds = credentials(settings)
    if creds is not None:
        import faust
        from faust.types.auth import SASLMechanism

        broker["broker_credentials"] = faust.SASLCredentials(
            username=creds.username,
            password=creds.password,
            mechanism=SASLMechanism(settings.kafka.sasl_mechanism),
        )
    return broker
