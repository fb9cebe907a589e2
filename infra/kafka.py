"""Apache Kafka in KRaft mode, one combined broker/controller, run straight from Maven jars.

No tarball and no Docker: ``infra.maven`` resolves ``kafka_<scala>:<version>`` plus a
log4j2 binding into ``~/.m2`` once, and we keep the resulting classpath in
``<home>/cache``. Kafka 4.x logs through slf4j 1.7 → log4j2.

Clients authenticate with SASL/SCRAM (one user per ``kafka.Principal``, random passwords
in mode-0600 files under ``secrets/kafka``) and the ``StandardAuthorizer`` denies what
no ACL allows (``kernel.acls``). The controller listener uses SASL/PLAIN (KRaft cannot
check SCRAM there: the credentials live in the metadata it serves) with a per-start
password only the node itself knows. No password reaches a command line or a log: the
format step reads its SCRAM user from a java @argfile, the JAAS lines sit in the 0600
properties file, and Kafka logs password-typed configs as [hidden].
"""

from __future__ import annotations

import base64
import re
import secrets
import socket
import struct
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from loraplane.infra import maven
from loraplane.infra.processes import StackError
from loraplane.infra.service import Port, Service

from loraplane.kernel import kafka
from loraplane.kernel.kafka import Principal
from loraplane.kernel.secrets import write_private

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


@dataclass(frozen=True)
class Kafka(Service):
    name = "kafka"
    start_timeout = 120.0

    @property
    def dir(self) -> Path:
        return self.home / "kafka"

    @property
    def cache(self) -> Path:
        k = self.settings.kafka
        return self.home / "cache" / f"kafka_{k.scala_version}-{k.version}"

    @property
    def properties_file(self) -> Path:
        return self.dir / "server.properties"

    def marker(self) -> str:
        return str(self.properties_file)

    def ports(self) -> list[Port]:
        k = self.settings.kafka
        return [Port("kafka listener", k.host, k.port, "LORAPLANE_KAFKA__PORT"),
                Port("kafka controller", k.host, k.controller_port,
                     "LORAPLANE_KAFKA__CONTROLLER_PORT")]

    def endpoint(self) -> str:
        return self.settings.kafka.bootstrap

    def data_dirs(self) -> list[Path]:
        return [self.dir]

    def password(self, principal: Principal) -> str:
        """``principal``'s password, generated into a new 0600 file the first time."""
        path = kafka.password_path(self.settings, principal)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_private(path, secrets.token_urlsafe(24))
        return kafka.read_password(path)

    def fetch(self) -> Path:
        """Resolve the jars once (network only the first time); returns the classpath file."""
        k = self.settings.kafka
        return maven.classpath(self.cache, f"Kafka {k.version}", [
            maven.Artifact("org.apache.kafka", f"kafka_{k.scala_version}", k.version),
            maven.Artifact("org.apache.logging.log4j", "log4j-slf4j-impl", LOG4J_VERSION),
            maven.Artifact("org.apache.logging.log4j", "log4j-core", LOG4J_VERSION)])

    def _java(self, *args: str) -> list[str]:
        heap = self.settings.kafka.heap
        return ["java", f"-Xmx{heap}", "-Xms128m", "-XX:+UseG1GC", "-XX:+ExitOnOutOfMemoryError",
                "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={self.dir / 'log4j2.xml'}",
                "-cp", ":".join(maven.jars(self.fetch())), *args]

    def prepare(self) -> list[str]:
        k = self.settings.kafka
        (self.dir / "data").mkdir(parents=True, exist_ok=True)
        (self.dir / "log4j2.xml").write_text(_LOG4J2)
        ops, node = self.password(Principal.ops), secrets.token_urlsafe(24)
        mechanism = k.sasl_mechanism
        scram_module = "org.apache.kafka.common.security.scram.ScramLoginModule"
        plain_module = "org.apache.kafka.common.security.plain.PlainLoginModule"
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@{k.host}:{k.controller_port}",
            "listeners": f"CLIENT://{k.host}:{k.port},CONTROLLER://{k.host}:{k.controller_port}",
            "advertised.listeners": f"CLIENT://{k.host}:{k.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "CLIENT",
            "listener.security.protocol.map": "CLIENT:SASL_PLAINTEXT,CONTROLLER:SASL_PLAINTEXT",
            "sasl.enabled.mechanisms": mechanism,
            "sasl.mechanism.inter.broker.protocol": mechanism,
            f"listener.name.client.{mechanism.lower()}.sasl.jaas.config":
                f'{scram_module} required username="{Principal.ops}" password="{ops}";',
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "sasl.mechanism.controller.protocol": "PLAIN",
            "listener.name.controller.plain.sasl.jaas.config":
                f'{plain_module} required username="{NODE_USER}" password="{node}" '
                f'user_{NODE_USER}="{node}";',
            "authorizer.class.name":
                "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": f"User:{Principal.ops};User:{NODE_USER}",
            "allow.everyone.if.no.acl.found": "false",
            "log.dirs": str(self.dir / "data"),
            "num.partitions": "1",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "10",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
        }
        write_private(self.properties_file, "".join(f"{key}={v}\n" for key, v in props.items()))
        formatted = (self.dir / "data" / "meta.properties").is_file()
        if formatted and not (self.dir / SCRAM_MARKER).is_file():
            raise StackError(
                f"kafka data in {self.dir / 'data'} was formatted before the broker had SASL "
                "users; `loraplane stack down --purge` deletes it, then `stack up` again")
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
        write_private(argfile, "\n".join([
            "kafka.tools.StorageTool", "format", "-t", new_cluster_id(),
            "-c", str(self.properties_file), "--add-scram", f'"{scram}"']) + "\n")
        try:
            done = subprocess.run([*self._java(), f"@{argfile}"],
                                  capture_output=True, text=True, check=False)
        finally:
            argfile.unlink(missing_ok=True)
        if done.returncode != 0:
            raise StackError(f"kafka storage format failed:\n"
                             f"{_redact(done.stdout + done.stderr, ops_password)}")
        (self.dir / SCRAM_MARKER).write_text("SCRAM users created at format\n")

    def healthy(self) -> bool:
        return bool(kafka.admin(self.settings).list_topics(timeout=3).brokers)

    def ready(self) -> bool:
        """A topic can be created and a message produced and read back."""
        from confluent_kafka import KafkaError, Message, TopicPartition

        from loraplane.kernel import topics

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
        or deleted file is a rotation. Topics and their ACLs come after, from ``stack up``."""
        from confluent_kafka.admin import (
            ScramCredentialInfo,
            ScramMechanism,
            UserScramCredentialAlteration,
            UserScramCredentialUpsertion,
        )

        mechanism = ScramMechanism[self.settings.kafka.sasl_mechanism.replace("-", "_")]
        upserts: list[UserScramCredentialAlteration] = [UserScramCredentialUpsertion(
                       str(p), ScramCredentialInfo(mechanism, SCRAM_ITERATIONS),
                       self.password(p).encode())
                   for p in Principal if p is not Principal.ops]
        admin = kafka.admin(self.settings)
        for user, future in admin.alter_user_scram_credentials(
                upserts, request_timeout=30).items():
            try:
                future.result(timeout=30)
            except Exception as exc:
                raise StackError(f"kafka: could not set the SCRAM user {user}: {exc}") from None

    def version(self) -> str:
        """The jar version our broker runs; for a foreign broker, what ApiVersions implies."""
        pid = self.process.pid()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode() if pid else ""
        found = re.search(rf"kafka_{re.escape(self.settings.kafka.scala_version)}-([\w.-]+)\.jar",
                          cmdline)
        if found:
            return found.group(1)
        k = self.settings.kafka
        return "4.x (ApiVersions)" if speaks_kafka_4(api_versions(k.host, k.port)) else "< 4.0"


FETCH_API = 1
NODE_USER = "node"
"""The controller listener's only user (SASL/PLAIN), a super user like ops."""
SCRAM_MARKER = "loraplane-scram"
"""Written beside the data dir once it was formatted with the ops SCRAM user."""
SCRAM_ITERATIONS = 8192


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
    return {key: (lo, hi) for key, lo, hi in struct.iter_unpack(">hhh", payload[10:10 + 6 * count])}


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
