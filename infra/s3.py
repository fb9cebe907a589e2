"""The S3 endpoint: moto in server mode on loopback, with the artifact bucket created.

It runs with authentication (``infra.s3_server``): one access key, ``settings.s3.
access_key_id``, whose secret ``stack up`` writes to ``settings.s3.credentials_file``
(mode 0600); a request signed with anything else is refused.

moto keeps everything in memory: a restart of the endpoint loses every object (the bucket
is recreated by ``stack up``). Good enough for a dev stack; production points
``settings.s3.endpoint_url`` at real S3 or MinIO.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from loraplane.infra.service import Port, Service

from loraplane.kernel.config import LOOPBACK
from loraplane.kernel.secrets import ensure_secret


@dataclass(frozen=True)
class S3(Service):
    name = "s3"
    start_timeout = 60.0

    def marker(self) -> str:
        return f"loraplane.infra.s3_server --port {self.settings.s3.port}"

    def ports(self) -> list[Port]:
        return [Port("s3 endpoint", LOOPBACK, self.settings.s3.port, "LORAPLANE_S3__PORT")]

    def endpoint(self) -> str:
        return self.settings.s3.endpoint_url

    def data_dirs(self) -> list[Path]:
        return []

    def prepare(self) -> list[str]:
        s = self.settings.s3
        secret_file = s.credentials_file or self.home / "secrets" / "s3-secret"
        if s.secret_access_key is None:
            ensure_secret(secret_file, nbytes=30)
        return [sys.executable, "-m", *self.marker().split(), "--access-key-id",
                s.access_key_id, "--secret-file", str(secret_file)]

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        s = self.settings.s3
        return boto3.client(
            "s3", endpoint_url=s.endpoint_url, region_name=s.region,
            aws_access_key_id=s.access_key_id, aws_secret_access_key=s.secret(),
            config=Config(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1}))

    def healthy(self) -> bool:
        self.client().list_buckets()
        return True

    def after_start(self) -> None:
        client = self.client()
        bucket = self.settings.s3.bucket
        if bucket not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
            client.create_bucket(Bucket=bucket)

    def version(self) -> str:
        return f"moto {version('moto')}"
