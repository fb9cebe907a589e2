"""Apache Kafka in KRaft mode, one combined broker/controller, run straight from Maven jars.

No tarball and no Docker: ``mvn dependency:build-classpath`` on a generated POM resolves
``kafka_<scala>:<version>`` plus a log4j2 binding into ``~/.m2`` once, and we keep the
resulting classpath in ``<home>/cache``. Kafka 4.x logs through slf4j 1.7 → log4j2.
"""

from __future__ import annotations

import base64
import re
import shutil
import socket
import struct
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from loraplane.infra.processes import StackError
from loraplane.infra.service import Port, Service

from loraplane.kernel import kafka

LOG4J_VERSION = "2.24.3"
_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>loraplane</groupId><artifactId>kafka-runtime</artifactId><version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_{scala}</artifactId>
      <version>{version}</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId><version>{log4j}</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-core</artifactId><version>{log4j}</version></dependency>
  </dependencies>
</project>
"""
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

    def fetch(self) -> Path:
        """Resolve the jars once (network only the first time); returns the classpath file."""
        classpath = self.cache / "classpath.txt"
        if classpath.is_file() and all(Path(j).is_file() for j in self._jars(classpath)):
            return classpath
        if shutil.which("mvn") is None or shutil.which("java") is None:
            raise StackError("kafka needs `java` (17+) and `mvn` on PATH to fetch its jars; "
                             "on Debian: apt-get install -y openjdk-17-jre-headless maven")
        k = self.settings.kafka
        self.cache.mkdir(parents=True, exist_ok=True)
        (self.cache / "pom.xml").write_text(
            _POM.format(scala=k.scala_version, version=k.version, log4j=LOG4J_VERSION))
        done = subprocess.run(
            ["mvn", "-q", "-B", "dependency:build-classpath",
             f"-Dmdep.outputFile={classpath}"],
            cwd=self.cache, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not classpath.is_file():
            raise StackError(f"could not fetch Kafka {k.version} jars with mvn "
                             f"(in {self.cache}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        return classpath

    @staticmethod
    def _jars(classpath: Path) -> list[str]:
        return [j for j in classpath.read_text().strip().split(":") if j]

    def _java(self, *args: str) -> list[str]:
        heap = self.settings.kafka.heap
        return ["java", f"-Xmx{heap}", "-Xms128m", "-XX:+UseG1GC", "-XX:+ExitOnOutOfMemoryError",
                "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={self.dir / 'log4j2.xml'}",
                "-cp", ":".join(self._jars(self.fetch())), *args]

    def prepare(self) -> list[str]:
        k = self.settings.kafka
        (self.dir / "data").mkdir(parents=True, exist_ok=True)
        (self.dir / "log4j2.xml").write_text(_LOG4J2)
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@{k.host}:{k.controller_port}",
            "listeners": f"PLAINTEXT://{k.host}:{k.port},CONTROLLER://{k.host}:{k.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{k.host}:{k.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
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
        self.properties_file.write_text("".join(f"{key}={v}\n" for key, v in props.items()))
        if not (self.dir / "data" / "meta.properties").is_file():
            self._format()
        return self._java("kafka.Kafka", str(self.properties_file))

    def _format(self) -> None:
        cluster_id = new_cluster_id()
        done = subprocess.run(
            self._java("kafka.tools.StorageTool", "format", "-t", cluster_id,
                       "-c", str(self.properties_file)),
            capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise StackError(f"kafka storage format failed:\n{done.stdout}{done.stderr}")

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
        """Nothing: the topics are applied by ``stack up`` once every service is ready."""

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
