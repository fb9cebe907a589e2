"""The S3 endpoint: s3proxy (Java, from Maven Central) on loopback, objects kept on disk.

s3proxy runs the jclouds ``filesystem-nio2`` blob store (the ``filesystem`` provider's
non-deprecated successor, same ``jclouds.filesystem.basedir``) under ``<home>/s3/data``: a
bucket is a folder, an object a file, so a restart of the endpoint keeps every artifact and
``stack down --purge`` is what deletes them. Authentication ``aws-v2-or-v4`` with one
access key, ``settings.s3.access_key_id``, whose secret ``stack up`` writes to
``settings.s3.credentials_file`` (mode 0600, ``kernel.secrets``); an unsigned request or one
signed with anything else gets 403. The secret reaches s3proxy through its properties file
(mode 0600 too), never a command line. ``s3proxy.ignore-unknown-headers``: boto3 (>= 1.36)
sends ``x-amz-checksum-crc32`` on every put, which s3proxy 3.0 would answer with 501; the
bytes are verified end to end anyway (the manifest's sha256 of every file).

Production points ``settings.s3.endpoint_url`` at real S3 or MinIO instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplane.infra import maven
from loraplane.infra.java_text import properties_text
from loraplane.infra.processes import free_port
from loraplane.infra.service import Port, Service
from loraplane.kernel.atomic_file import write_atomic
from loraplane.kernel.config import LOOPBACK, Settings
from loraplane.kernel.secrets import ensure_secret, write_private

__all__ = ["MAIN_CLASS", "S3"]

MAIN_CLASS = "org.gaul.s3proxy.Main"
_LOGBACK = """<configuration>
  <appender name="out" class="ch.qos.logback.core.ConsoleAppender">
    <encoder><pattern>[%d] %p %m \\(%logger{20}\\)%n</pattern></encoder>
  </appender>
  <root level="INFO"><appender-ref ref="out"/></root>
</configuration>
"""


@dataclass(frozen=True)
class S3(Service):
    name = "s3"
    start_timeout = 90.0

    @classmethod
    def private(cls, base: Settings, home: Path, credentials_file: Path | None = None) -> S3:
        """A throwaway endpoint on a free loopback port with its data under ``home`` (tests,
        demo scenarios that stop their store): base's key, the secret in
        ``credentials_file`` (default: base's), base's jar cache."""
        home.mkdir(parents=True, exist_ok=True)
        shared = base.state_dir / "cache"
        if shared.is_dir() and not (home / "cache").exists():
            (home / "cache").symlink_to(shared.resolve())
        port = free_port()
        s3 = base.s3.model_copy(
            update={
                "endpoint_url": f"http://{LOOPBACK}:{port}",
                "port": port,
                "credentials_file": credentials_file or base.s3.credentials_file,
            }
        )
        return cls(base.model_copy(update={"home": home, "s3": s3}))

    @property
    def dir(self) -> Path:
        return self.home / "s3"

    @property
    def data(self) -> Path:
        return self.dir / "data"

    @property
    def cache(self) -> Path:
        return self.home / "cache" / f"s3proxy-{self.settings.s3.server_version}"

    @property
    def properties_file(self) -> Path:
        return self.dir / "s3proxy.properties"

    def marker(self) -> str:
        return str(self.properties_file)

    def ports(self) -> list[Port]:
        return [Port("s3 endpoint", LOOPBACK, self.settings.s3.port, "LORAPLANE_S3__PORT")]

    def endpoint(self) -> str:
        return self.settings.s3.endpoint_url

    def data_dirs(self) -> list[Path]:
        return [self.dir]

    def fetch(self) -> Path:
        """Resolve the jars once (network only the first time); returns the classpath file."""
        version = self.settings.s3.server_version
        return maven.classpath(
            self.cache, f"s3proxy {version}", [maven.Artifact("org.gaul", "s3proxy", version)]
        )

    def prepare(self) -> list[str]:
        s = self.settings.s3
        secret = (
            s.secret()
            if s.secret_access_key is not None
            else ensure_secret(s.credentials_file or self.home / "secrets" / "s3-secret", nbytes=30)
        )
        self.data.mkdir(parents=True, exist_ok=True)
        write_atomic(self.dir / "logback.xml", _LOGBACK)
        props = {
            "s3proxy.endpoint": f"http://{LOOPBACK}:{s.port}",
            "s3proxy.authorization": "aws-v2-or-v4",
            "s3proxy.identity": s.access_key_id,
            "s3proxy.credential": secret,
            "s3proxy.ignore-unknown-headers": "true",
            "jclouds.provider": "filesystem-nio2",
            "jclouds.filesystem.basedir": str(self.data),
        }
        write_private(self.properties_file, properties_text(props))
        return [
            "java",
            f"-Xmx{s.heap}",
            "-XX:+ExitOnOutOfMemoryError",
            "-Djava.awt.headless=true",
            f"-Dlogback.configurationFile={self.dir / 'logback.xml'}",
            "-cp",
            ":".join(maven.jars(self.fetch())),
            MAIN_CLASS,
            "--properties",
            str(self.properties_file),
        ]

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        from loraplane.kernel.s3_redirects import refusing_redirects

        s = self.settings.s3
        return refusing_redirects(
            boto3.client(
                "s3",
                endpoint_url=s.endpoint_url,
                region_name=s.region,
                aws_access_key_id=s.access_key_id,
                aws_secret_access_key=s.secret(),
                config=Config(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1}),
            )
        )

    def healthy(self) -> bool:
        self.client().list_buckets()
        return True

    def after_start(self) -> None:
        client = self.client()
        bucket = self.settings.s3.bucket
        if bucket not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
            client.create_bucket(Bucket=bucket)

    def version(self) -> str:
        """The s3proxy jar our process runs; for a foreign endpoint, its Server header."""
        pid = self.process.pid()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode() if pid else ""
        found = re.search(r"/s3proxy-([\w.-]+)\.jar", cmdline)
        if found:
            return f"s3proxy {found.group(1)}"
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(self.settings.s3.endpoint_url, timeout=3) as resp:
                return str(resp.headers.get("Server", "unknown"))
        except urllib.error.HTTPError as exc:  # 403 for the anonymous probe: still an answer
            return str(exc.headers.get("Server", "unknown"))
