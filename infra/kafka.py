"""Apache Kafka in KRaft mode, run straight from Maven jars: one combined broker/controller,
or ``kafka.brokers`` of them on loopback (a controller quorum of all nodes; node n listens on
``port + 2(n-1)``, its controller on ``controller_port + 2(n-1)``, its files under
``kafka`` for node 1 and ``kafka-<n>`` for the others).

No tarball and no Docker: ``infra.maven`` resolves ``kafka_<scala>:<version>`` plus a
log4j2 binding into ``~/.m2`` once, and we keep the resulting classpath in
``<home>/cache``. Kafka 4.x logs through slf4j 1.7 → log4j2.

Clients authenticate with SASL/SCRAM (one user per ``kafka.Principal``, random passwords
in mode-0600 files under ``secrets/kafka``) and the ``StandardAuthorizer`` denies what
no ACL allows (``kernel.acls``). The controller listener uses SASL/PLAIN (KRaft cannot
check SCRAM there: the credentials live in the metadata it serves) with a per-start
password only the node itself knows; the nodes of a cluster share one, kept in a 0600 file
(``controller_password``), since each must log in to the others' controller listener. No
password reaches a command line or a log: the format step reads its SCRAM user from a java
@argfile, the JAAS lines sit in the 0600 properties file, and Kafka logs password-typed
configs as [hidden].
"""

from __future__ import annotations

import base64
import re
import secrets
import shutil
import socket
import struct
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loraplane.infra import maven
from loraplane.infra.java_text import argfile_text, jaas_quoted, properties_text
from loraplane.infra.processes import StackError
from loraplane.infra.service import Port, Service
from loraplane.kernel import kafka
from loraplane.kernel.atomic_file import write_atomic
from loraplane.kernel.kafka import Principal
from loraplane.kernel.local_files import read_regular
from loraplane.kernel.secrets import make_secret, write_private

if TYPE_CHECKING:
    from loraplane.kernel.config import Settings

__all__ = [
    "CLUSTER_SIZE",
    "CONTROLLER_SECRET",
    "FETCH_API",
    "LOG4J_VERSION",
    "NODE_USER",
    "SCRAM_ITERATIONS",
    "SCRAM_MARKER",
    "Kafka",
    "api_versions",
    "kafka_nodes",
    "new_cluster_id",
    "only_formatted",
    "speaks_kafka_4",
]

LOG4J_VERSION = "2.24.3"
_LOG4J2 = """<?xml version="1.0" encoding="UTF-8"?>
<Configuration status="WARN">
  <Appenders>
    <Console name="out" target="SYSTEM_OUT">
      <PatternLayout pattern="[%d] %p %m (%c)%n"/>
    </Console>
  </Appenders>
  <Loggers>
    <Logger name="org.apache.kafka.controller" level="WARN"/>
    <Logger name="state.change.logger" level="WARN"/>
    <Root level="INFO"><AppenderRef ref="out"/></Root>
  </Loggers>
</Configuration>
"""


def kafka_nodes(settings: Settings) -> list[Kafka]:
    """The cluster's nodes: ``kafka.brokers`` of them, or as many as were formatted (so
    ``stack down`` and ``status`` still see every node when the setting was not exported)."""
    count = max(settings.kafka.brokers, Kafka(settings).formatted_brokers() or 1)
    return [Kafka(settings, node) for node in range(1, count + 1)]


@dataclass(frozen=True)
class Kafka(Service):
    name = "kafka"
    start_timeout = 120.0
    node: int = 1
    """This node's id (from 1); node 1 keeps the one-broker stack's names."""

    @property
    def label(self) -> str:
        return "kafka" if self.node == 1 else f"kafka-{self.node}"

    @property
    def dir(self) -> Path:
        return self.home / self.label

    @property
    def last(self) -> bool:
        """The cluster-wide steps (the produce probe, the SCRAM users) run once, on the last
        node, when every node is up."""
        return self.node >= self.settings.kafka.brokers

    def formatted_brokers(self) -> int | None:
        """The cluster size node 1's data was formatted for (None: not formatted); data
        formatted before ``kafka.brokers`` existed was a single node."""
        first = self.home / "kafka"
        if not (first / "data" / "meta.properties").is_file():
            return None
        record = first / CLUSTER_SIZE
        try:
            text = read_regular(record, 64).strip()
        except FileNotFoundError:
            return 1
        except OSError as exc:
            text, why = b"", exc.strerror or str(exc)
        else:
            why = f"{text[:20]!r} is no broker count"
        if text.isdigit() and 0 < int(text) <= 99:
            return int(text)
        raise StackError(
            f"{record}: {why} (a `stack up` stopped while writing it): write the number of "
            "brokers its data was formatted for, or `loraplane stack down --purge`"
        )

    @property
    def cache(self) -> Path:
        k = self.settings.kafka
        return self.home / "cache" / f"kafka_{k.scala_version}-{k.version}"

    @property
    def properties_file(self) -> Path:
        return self.dir / "server.properties"

    def marker(self) -> str:
        return str(self.properties_file)

    @property
    def port(self) -> int:
        return self.settings.kafka.node_port(self.node)

    def ports(self) -> list[Port]:
        k, n = self.settings.kafka, self.node
        step = "" if n == 1 else f" (+{2 * (n - 1)} for node {n})"
        return [
            Port("kafka listener", k.host, self.port, f"LORAPLANE_KAFKA__PORT{step}"),
            Port(
                "kafka controller",
                k.host,
                k.node_controller_port(n),
                f"LORAPLANE_KAFKA__CONTROLLER_PORT{step}",
            ),
        ]

    def endpoint(self) -> str:
        return f"{self.settings.kafka.host}:{self.port}"

    def data_dirs(self) -> list[Path]:
        return [self.dir]

    def password(self, principal: Principal) -> str:
        """``principal``'s password, generated into a new 0600 file the first time."""
        path = kafka.password_path(self.settings, principal)
        make_secret(path)
        return kafka.read_password(path)

    def fetch(self) -> Path:
        """Resolve the jars once (network only the first time); returns the classpath file."""
        k = self.settings.kafka
        return maven.classpath(
            self.cache,
            f"Kafka {k.version}",
            [
                maven.Artifact("org.apache.kafka", f"kafka_{k.scala_version}", k.version),
                maven.Artifact("org.apache.logging.log4j", "log4j-slf4j-impl", LOG4J_VERSION),
                maven.Artifact("org.apache.logging.log4j", "log4j-core", LOG4J_VERSION),
            ],
        )

    def _java(self, *args: str) -> list[str]:
        heap = self.settings.kafka.heap_per_broker
        return [
            "java",
            f"-Xmx{heap}",
            "-Xms128m",
            "-XX:+UseG1GC",
            "-XX:+ExitOnOutOfMemoryError",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.dir / 'log4j2.xml'}",
            "-cp",
            ":".join(maven.jars(self.fetch())),
            *args,
        ]

    def controller_password(self) -> str:
        """The controller listener's password: per start for a single node, shared by the
        nodes of a cluster (a 0600 file, made the first time)."""
        if self.settings.kafka.brokers == 1:
            return secrets.token_urlsafe(24)
        path = self.settings.secrets_dir / CONTROLLER_SECRET
        make_secret(path)
        return kafka.read_password(path)

    def prepare(self) -> list[str]:
        from loraplane.kernel import topics

        k, n = self.settings.kafka, self.node
        formatted_for = self.formatted_brokers()
        if formatted_for is not None and formatted_for != k.brokers:
            raise StackError(
                f"kafka data under {self.home} was formatted for {formatted_for} broker(s), "
                f"kafka.brokers is {k.brokers}: set LORAPLANE_KAFKA__BROKERS={formatted_for}, "
                "or `loraplane stack down --purge` and `stack up` again"
            )
        (self.dir / "data").mkdir(parents=True, exist_ok=True)
        write_atomic(self.dir / "log4j2.xml", _LOG4J2)
        ops, node = self.password(Principal.ops), self.controller_password()
        mechanism = k.sasl_mechanism
        copies = topics.replicas(self.settings)
        in_sync = str(topics.min_insync(copies))
        voters = ",".join(
            f"{v}@{k.host}:{k.node_controller_port(v)}" for v in range(1, k.brokers + 1)
        )
        controller = k.node_controller_port(n)
        scram_module = "org.apache.kafka.common.security.scram.ScramLoginModule"
        plain_module = "org.apache.kafka.common.security.plain.PlainLoginModule"
        props = {
            "process.roles": "broker,controller",
            "node.id": str(n),
            "controller.quorum.voters": voters,
            "listeners": f"CLIENT://{k.host}:{self.port},CONTROLLER://{k.host}:{controller}",
            "advertised.listeners": f"CLIENT://{k.host}:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "CLIENT",
            "listener.security.protocol.map": "CLIENT:SASL_PLAINTEXT,CONTROLLER:SASL_PLAINTEXT",
            "sasl.enabled.mechanisms": mechanism,
            "sasl.mechanism.inter.broker.protocol": mechanism,
            f"listener.name.client.{mechanism.lower()}.sasl.jaas.config": (
                f"{scram_module} required username={jaas_quoted(Principal.ops)} "
                f"password={jaas_quoted(ops)};"
            ),
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "sasl.mechanism.controller.protocol": "PLAIN",
            "listener.name.controller.plain.sasl.jaas.config": (
                f"{plain_module} required username={jaas_quoted(NODE_USER)} "
                f"password={jaas_quoted(node)} user_{NODE_USER}={jaas_quoted(node)};"
            ),
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": f"User:{Principal.ops};User:{NODE_USER}",
            "allow.everyone.if.no.acl.found": "false",
            "log.dirs": str(self.dir / "data"),
            "num.partitions": "1",
            "default.replication.factor": str(copies),
            "min.insync.replicas": in_sync,
            "offsets.topic.replication.factor": str(copies),
            "offsets.topic.num.partitions": "10",
            "transaction.state.log.replication.factor": str(copies),
            "transaction.state.log.min.isr": in_sync,
            "share.coordinator.state.topic.replication.factor": str(copies),
            "share.coordinator.state.topic.min.isr": in_sync,
            "group.initial.rebalance.delay.ms": "0",
        }
        if k.brokers > 1:
            # A killed node's partitions move once the controller fences it: after 6 s
            # without a heartbeat instead of Kafka's 9 s (produce waits that long).
            props |= {"broker.session.timeout.ms": "6000", "broker.heartbeat.interval.ms": "1500"}
        write_private(self.properties_file, properties_text(props))
        data = self.dir / "data"
        formatted = (data / "meta.properties").is_file()
        if formatted and not (self.dir / SCRAM_MARKER).is_file():
            if not only_formatted(data):
                raise StackError(
                    f"kafka data in {data} was formatted before the broker had SASL "
                    "users; `loraplane stack down --purge` deletes it, then `stack up` again"
                )
            # a format cut short (a stack up killed between the format and its marker): the
            # broker never ran on it, so nothing is lost by formatting it again
            shutil.rmtree(data)
            formatted = False
        if not formatted:
            self._format(ops)
        return self._java("kafka.Kafka", str(self.properties_file))

    def _format(self, ops_password: str) -> None:
        """Format the log dirs with the ops SCRAM user in the first metadata (the other
        users are added once the broker runs: ``after_start``). The password goes through
        a java @argfile, never the command line, which ``ps`` shows to every user."""
        argfile = self.dir / "format.args"
        mechanism = self.settings.kafka.sasl_mechanism
        scram = f"{mechanism}=[name={Principal.ops},password={ops_password}]"
        write_private(
            argfile,
            argfile_text(
                [
                    "kafka.tools.StorageTool",
                    "format",
                    "-t",
                    self._cluster_id(),
                    "-c",
                    str(self.properties_file),
                    "--add-scram",
                    scram,
                ]
            ),
        )
        try:
            done = subprocess.run(
                [*self._java(), f"@{argfile}"], capture_output=True, text=True, check=False
            )
        finally:
            argfile.unlink(missing_ok=True)
        if done.returncode != 0:
            raise StackError(
                f"kafka storage format failed:\n{_redact(done.stdout + done.stderr, ops_password)}"
            )
        write_atomic(self.dir / SCRAM_MARKER, "SCRAM users created at format\n")
        if self.node == 1:
            write_atomic(self.dir / CLUSTER_SIZE, f"{self.settings.kafka.brokers}\n")

    def _cluster_id(self) -> str:
        """Node 1 draws the cluster id; the other nodes take it from node 1's data (which
        ``stack up`` formats first)."""
        if self.node == 1:
            return new_cluster_id()
        meta = self.home / "kafka" / "data" / "meta.properties"
        try:
            text = read_regular(meta, 64 * 1024).decode(errors="replace")
        except OSError as exc:
            raise StackError(f"kafka node {self.node}: {meta}: {exc.strerror or exc}") from None
        for line in text.splitlines():
            if line.startswith("cluster.id="):
                return line.split("=", 1)[1].strip()
        raise StackError(f"kafka node {self.node}: no cluster.id in {meta}")

    def healthy(self) -> bool:
        """A single node: any broker answers; in a cluster, this node is registered (the
        metadata lists live, unfenced brokers only)."""
        brokers = kafka.admin(self.settings).list_topics(timeout=3).brokers
        cluster = self.settings.kafka.brokers > 1 or self.node > 1
        return self.node in brokers if cluster else bool(brokers)

    def ready(self) -> bool:
        """A topic can be created and a message produced and read back (a cluster: by the
        last node, once each node is registered)."""
        from confluent_kafka import KafkaError, Message, TopicPartition

        from loraplane.kernel import topics

        if not self.last:
            return self.healthy()

        probe = topics.spec("stack-health")
        topics.apply(self.settings, only=(probe,), timeout=10)
        name = topics.topic_name(self.settings, probe.suffix)
        token = uuid.uuid4().bytes
        offsets: list[int] = []  # the probe's, or -1 when it was not delivered

        def delivered(err: KafkaError | None, msg: Message) -> None:
            offset = None if err else msg.offset()
            offsets.append(-1 if offset is None else offset)

        producer = kafka.producer(self.settings, quiet=True)
        producer.produce(name, token, partition=0, on_delivery=delivered)
        producer.flush(10)
        if not offsets or offsets[0] < 0:
            return False
        consumer = kafka.consumer(self.settings, "stack-health", quiet=True)
        try:
            consumer.assign([TopicPartition(name, 0, offsets[0])])
            msg = consumer.poll(10)
            return msg is not None and msg.error() is None and msg.value() == token
        finally:
            consumer.close()

    def after_start(self) -> None:
        """Every principal but ops (made at format) gets its SCRAM user, from its password
        file (a new random one when missing); re-run by every ``stack up``, so a replaced
        or deleted file is a rotation. Topics and their ACLs come after, from ``stack up``.
        SCRAM users are cluster metadata: a cluster's last node sets them, once."""
        if not self.last:
            return
        from confluent_kafka.admin import (
            ScramCredentialInfo,
            ScramMechanism,
            UserScramCredentialAlteration,
            UserScramCredentialUpsertion,
        )

        mechanism = ScramMechanism[self.settings.kafka.sasl_mechanism.replace("-", "_")]
        upserts: list[UserScramCredentialAlteration] = [
            UserScramCredentialUpsertion(
                str(p), ScramCredentialInfo(mechanism, SCRAM_ITERATIONS), self.password(p).encode()
            )
            for p in Principal
            if p is not Principal.ops
        ]
        admin = kafka.admin(self.settings)
        for user, future in admin.alter_user_scram_credentials(upserts, request_timeout=30).items():
            try:
                future.result(timeout=30)
            except Exception as exc:
                raise StackError(f"kafka: could not set the SCRAM user {user}: {exc}") from None

    def version(self) -> str:
        """The jar version our broker runs; for a foreign broker, what ApiVersions implies."""
        pid = self.process.pid()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode() if pid else ""
        found = re.search(
            rf"kafka_{re.escape(self.settings.kafka.scala_version)}-([\w.-]+)\.jar", cmdline
        )
        if found:
            return found.group(1)
        k = self.settings.kafka
        versions = api_versions(k.host, self.port)
        return "4.x (ApiVersions)" if speaks_kafka_4(versions) else "< 4.0"


FETCH_API = 1
NODE_USER = "node"
"""The controller listener's only user (SASL/PLAIN), a super user like ops."""
SCRAM_MARKER = "loraplane-scram"
"""Written beside the data dir once it was formatted with the ops SCRAM user."""
SCRAM_ITERATIONS = 8192
CLUSTER_SIZE = "cluster-size"
"""Written beside node 1's data dir at format: how many nodes the quorum was made of."""
CONTROLLER_SECRET = "kafka-controller.password"
"""Under secrets_dir: the controller listener's password shared by a cluster's nodes."""
_FORMAT_FILES = frozenset({"meta.properties", "bootstrap.checkpoint"})
"""What Kafka's storage format writes in a node's (combined) log dir; a broker that ran
adds its metadata log and partitions beside them."""


def only_formatted(data: Path) -> bool:
    """Does ``data`` hold only what a storage format writes (the broker never started on
    it)? A link or anything else there means it may hold a cluster's data: never deleted."""
    try:
        entries = list(data.iterdir())
    except OSError:
        return False
    return not data.is_symlink() and all(
        e.name in _FORMAT_FILES and e.is_file() and not e.is_symlink() for e in entries
    )


def _redact(text: str, secret: str) -> str:
    return text.replace(secret, "[hidden]")


def speaks_kafka_4(versions: dict[int, tuple[int, int]]) -> bool:
    """Kafka 4.0 removed Fetch v0-v3 (KIP-896); 3.x brokers still accept v0."""
    return versions.get(FETCH_API, (0, 0))[0] >= 4


def api_versions(host: str, port: int, timeout: float = 5.0) -> dict[int, tuple[int, int]]:
    """The broker's own ApiVersions answer (v0): api_key -> (min, max) version.

    It tells a 4.x broker from a 3.x one without trusting any local file (see
    ``speaks_kafka_4``).
    """
    client_id = b"loraplane"
    body = struct.pack(">hhih", 18, 0, 1, len(client_id)) + client_id
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(struct.pack(">i", len(body)) + body)
        size = struct.unpack(">i", _recv(sock, 4))[0]
        payload = _recv(sock, size)
    _, error, count = struct.unpack(">ihi", payload[:10])
    if error:
        raise StackError(f"ApiVersions error code {error} from {host}:{port}")
    return {
        key: (lo, hi) for key, lo, hi in struct.iter_unpack(">hhh", payload[10 : 10 + 6 * count])
    }


def _recv(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise StackError("connection closed while reading the ApiVersions answer")
        data += chunk
    return data


def new_cluster_id() -> str:
    """A random KRaft cluster id (URL-safe base64 of a UUID) that does not start with "-":
    the storage tool would read such an id (1 in 64) as an option and refuse to format,
    which is why Kafka's own ``Uuid.randomUuid`` skips them too."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cluster_id.startswith("-"):
            return cluster_id
