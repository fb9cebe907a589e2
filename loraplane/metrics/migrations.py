"""Versioned ClickHouse schema: ``infra/clickhouse/migrations/NNN_name.sql``, applied in order.

Each file is a template rendered for the server it runs on: ``SELECT version()`` decides
whether TTL, LowCardinality and DateTime64 exist (Debian's 18.16 has none of them; current
ClickHouse has all three). Applied versions are recorded in ``schema_migrations`` with the
checksum of the template, so a second ``migrate`` is a no-op and an edited, already-applied
migration is reported instead of silently diverging. Every statement is also idempotent
(``IF NOT EXISTS``), so a migration interrupted half-way can simply be run again.

Retention: where TTL exists the tables carry it; on 18.16 ``retention`` drops whole daily
partitions (every table is partitioned by ``toYYYYMMDD`` of its time column).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from loraplane.metrics.clickhouse import checked_database, connect

if TYPE_CHECKING:
    from clickhouse_driver import Client

    from loraplane.kernel.config import Settings

__all__ = [
    "AGGREGATE_TTL_DAYS",
    "FILE_RE",
    "MIGRATIONS_DIR",
    "PLACEHOLDER_RE",
    "RAW_TTL_DAYS",
    "DroppedPartition",
    "Executor",
    "MigrateResult",
    "Migration",
    "MigrationError",
    "ServerFeatures",
    "apply",
    "discover",
    "migrate",
    "retention",
]

# The migrations ship with infra/ (the services it starts), found as package data.
MIGRATIONS_DIR = Path(str(files("loraplane.infra") / "clickhouse" / "migrations"))
FILE_RE = re.compile(r"^(?P<version>[0-9]{3})_(?P<name>[a-z0-9_]+)\.sql$")
PLACEHOLDER_RE = re.compile(r"\{(?P<key>[a-z_]+)(?::(?P<arg>[a-z_]+))?\}")
RAW_TTL_DAYS = 30
AGGREGATE_TTL_DAYS = 400


class Executor(Protocol):
    """The part of clickhouse-driver's Client that applying migrations needs."""

    def execute(self, query: str, params: Any = None) -> Any: ...


class MigrationError(RuntimeError):
    """The schema cannot be brought up to date; the message says which file and why."""


@dataclass(frozen=True)
class ServerFeatures:
    """What the connected server supports, from its version string."""

    version: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> ServerFeatures:
        parts = tuple(int(p) for p in re.findall(r"\d+", text)[:3])
        if not parts:
            raise MigrationError(f"cannot parse ClickHouse version {text!r}")
        return cls(parts)

    @property
    def ttl(self) -> bool:  # table TTL since 19.6
        return self.version >= (19, 6)

    @property
    def low_cardinality(self) -> bool:  # experimental in 18.12, stable since 19.0
        return self.version >= (19, 0)

    @property
    def datetime64(self) -> bool:  # since 20.1
        return self.version >= (20, 1)


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    template: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.template.encode()).hexdigest()[:16]

    def render(self, database: str, features: ServerFeatures) -> list[str]:
        """The statements for this server, in order."""

        def ttl(column: str | None, days: int) -> str:
            if column is None:
                raise MigrationError(f"{self.version:03d}: TTL placeholder needs a column")
            return f"TTL {column} + INTERVAL {days} DAY" if features.ttl else ""

        def fill(match: re.Match[str]) -> str:
            key, arg = match["key"], match["arg"]
            if key == "db":
                return f"`{checked_database(database)}`"
            if key == "lowcard_string":
                return "LowCardinality(String)" if features.low_cardinality else "String"
            if key == "timestamp":
                return "DateTime64(3, 'UTC')" if features.datetime64 else "DateTime('UTC')"
            if key == "ttl_raw":
                return ttl(arg, RAW_TTL_DAYS)
            if key == "ttl_agg":
                return ttl(arg, AGGREGATE_TTL_DAYS)
            raise MigrationError(f"{self.version:03d}_{self.name}: unknown placeholder {match[0]}")

        body = "\n".join(
            line for line in self.template.splitlines() if not line.lstrip().startswith("--")
        )
        statements = [s.strip() for s in re.split(r";\s*(?:\n|$)", body)]
        return [PLACEHOLDER_RE.sub(fill, s) for s in statements if s]


def discover(directory: Path = MIGRATIONS_DIR) -> list[Migration]:
    """The migration files in version order; duplicate or malformed names are errors."""
    found: dict[int, Migration] = {}
    for path in sorted(directory.glob("*.sql")):
        m = FILE_RE.fullmatch(path.name)
        if m is None:
            raise MigrationError(f"{path}: migration files are named NNN_lower_snake.sql")
        version = int(m["version"])
        if version in found:
            raise MigrationError(f"{path}: version {version:03d} is used twice")
        found[version] = Migration(version, m["name"], path.read_text())
    return [found[v] for v in sorted(found)]


@dataclass(frozen=True)
class MigrateResult:
    server_version: str
    applied: list[str]
    already: list[str]


_LEDGER = """CREATE TABLE IF NOT EXISTS `{db}`.schema_migrations (
    version UInt32, name String, checksum String, server_version String,
    applied_at DateTime('UTC')
) ENGINE = MergeTree() ORDER BY version"""


def migrate(settings: Settings, directory: Path = MIGRATIONS_DIR) -> MigrateResult:
    """Create the database and apply every migration not yet recorded in it."""
    database = checked_database(settings.clickhouse.database)
    client = connect(settings, database="")
    try:
        return apply(client, database, directory)
    finally:
        client.disconnect()


def apply(client: Executor, database: str, directory: Path = MIGRATIONS_DIR) -> MigrateResult:
    """``migrate`` on an open client: anything with clickhouse-driver's ``execute`` (the
    unit suite passes an embedded current ClickHouse, chdb, through the same code)."""
    database = checked_database(database)
    server_version = str(client.execute("SELECT version()")[0][0])
    features = ServerFeatures.parse(server_version)
    client.execute(f"CREATE DATABASE IF NOT EXISTS `{database}`")
    client.execute(_LEDGER.format(db=database))
    recorded = dict(
        client.execute(
            f"SELECT version, any(checksum) FROM `{database}`.schema_migrations GROUP BY version"
        )
    )
    applied, already = [], []
    for migration in discover(directory):
        label = f"{migration.version:03d}_{migration.name}"
        if migration.version in recorded:
            if recorded[migration.version] != migration.checksum:
                raise MigrationError(
                    f"{label} was changed after it was applied (checksum "
                    f"{recorded[migration.version]} -> {migration.checksum}); add a new "
                    "migration instead of editing an applied one"
                )
            already.append(label)
            continue
        for statement in migration.render(database, features):
            try:
                client.execute(statement)
            except Exception as exc:
                raise MigrationError(
                    f"{label} failed on ClickHouse {server_version}: "
                    f"{str(exc).splitlines()[0]}\n{statement}"
                ) from exc
        client.execute(
            f"INSERT INTO `{database}`.schema_migrations "
            "(version, name, checksum, server_version, applied_at) VALUES",
            [
                (
                    migration.version,
                    migration.name,
                    migration.checksum,
                    server_version,
                    datetime.now(UTC),
                )
            ],
        )
        applied.append(label)
    return MigrateResult(server_version, applied, already)


@dataclass(frozen=True)
class DroppedPartition:
    table: str
    partition: int


def retention(
    settings: Settings, days: int, *, dry_run: bool = False, today: date | None = None
) -> list[DroppedPartition]:
    """Drop every daily partition older than ``days`` days (all tables of the database).

    Partition values come from system.parts and are checked to be YYYYMMDD integers
    before they are spelled into the ALTER statement.
    """
    if days < 1:
        raise ValueError("retention needs at least 1 day")
    database = checked_database(settings.clickhouse.database)
    cutoff = int(((today or datetime.now(UTC).date()) - timedelta(days=days)).strftime("%Y%m%d"))
    client = connect(settings, database="")
    try:
        rows = client.execute(
            "SELECT DISTINCT table, partition FROM system.parts "
            "WHERE database = %(db)s AND active ORDER BY table, partition",
            {"db": database},
        )
        doomed = [
            DroppedPartition(table, int(partition))
            for table, partition in rows
            if _is_day(partition) and int(partition) < cutoff
        ]
        if not dry_run:
            for part in doomed:
                _drop(client, database, part)
        return doomed
    finally:
        client.disconnect()


def _is_day(partition: str) -> bool:
    return bool(re.fullmatch(r"\d{8}", partition))


def _drop(client: Client, database: str, part: DroppedPartition) -> None:
    if not re.fullmatch(r"[a-z0-9_]+", part.table):
        raise MigrationError(f"refusing to drop a partition of unexpected table {part.table!r}")
    client.execute(f"ALTER TABLE `{database}`.`{part.table}` DROP PARTITION {part.partition}")
