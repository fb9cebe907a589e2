"""The isolated namespace of one demo or load-test run on the shared stack.

A run gets its own state folder, Kafka topic prefix and ClickHouse database, passed to every
child as ``LORAPLANE_*`` environment variables. So a second demo, a load test and the test
suite can share one Kafka and one ClickHouse without seeing each other's registry, traffic
or metrics, and a report from a run counts exactly that run. The S3 bucket is shared:
artifact prefixes are content-addressed, so sharing it is harmless.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from loraplane.kernel.config import Settings

__all__ = ["RunSpace"]


@dataclass(frozen=True)
class RunSpace:
    run_id: str  # e.g. demo-20261129-081500-1a2b: sorts by time, unique per run
    home: Path
    topic_prefix: str
    database: str
    s3_endpoint_url: str | None = None  # None: the stack's S3
    secrets_dir: Path | None = None  # the stack's credentials (None: each child's default)

    @classmethod
    def fresh(
        cls, root: Path, kind: str, now: datetime | None = None, secrets_dir: Path | None = None
    ) -> RunSpace:
        """A new namespace under ``root`` (the state dir) for a run of ``kind``; its children
        log in to the stack with the credentials in ``secrets_dir``."""
        stamp = (now or datetime.now(UTC)).strftime("%Y%m%d-%H%M%S")
        run_id = f"{kind}-{stamp}-{secrets.token_hex(2)}"
        return cls(
            run_id=run_id,
            home=root / kind / "runs" / run_id,
            topic_prefix=run_id,
            database="lp_" + run_id.replace("-", "_"),
            secrets_dir=secrets_dir,
        )

    def with_s3(self, endpoint_url: str) -> RunSpace:
        return replace(self, s3_endpoint_url=endpoint_url)

    def env(self) -> dict[str, str]:
        """What a child needs on top of the parent's environment to live in this run."""
        env = {
            "LORAPLANE_HOME": str(self.home),
            "LORAPLANE_TOPIC_PREFIX": self.topic_prefix,
            "LORAPLANE_CLICKHOUSE__DATABASE": self.database,
            "PYTHONUNBUFFERED": "1",
        }
        if self.s3_endpoint_url:
            env["LORAPLANE_S3__ENDPOINT_URL"] = self.s3_endpoint_url
        if self.secrets_dir is not None:
            env["LORAPLANE_SECRETS_DIR"] = str(self.secrets_dir)
        return env

    def child_env(self) -> dict[str, str]:
        """The full environment of a child: ours, minus any config of another run."""
        base = {
            k: v
            for k, v in os.environ.items()
            if k
            not in {"LORAPLANE_KEYRING_PATH", "LORAPLANE_SCHEDULES_PATH", "LORAPLANE_API_KEYS_FILE"}
        }
        return {**base, **self.env()}

    def settings(self, base: Settings) -> Settings:
        """``base`` as the children of this run see it (for in-process reads)."""
        s3 = (
            base.s3
            if not self.s3_endpoint_url
            else base.s3.model_copy(update={"endpoint_url": self.s3_endpoint_url})
        )
        return base.model_copy(
            update={
                "home": self.home,
                "topic_prefix": self.topic_prefix,
                "clickhouse": base.clickhouse.model_copy(update={"database": self.database}),
                "s3": s3,
                "keyring_path": self.home / "keyring.yaml",
                "schedules_path": self.home / "schedules.yaml",
                "api_keys_file": None,
            }
        )

    @property
    def keyring_path(self) -> Path:
        return self.home / "keyring.yaml"

    @property
    def schedules_path(self) -> Path:
        return self.home / "schedules.yaml"

    @property
    def log_dir(self) -> Path:
        return self.home.parent.parent / "logs" / self.run_id
