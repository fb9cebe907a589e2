"""`loraplane metrics migrate` on the real server: idempotent, no TTL on 18.16; retention."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from loraplane.kernel.config import Settings
from loraplane.metrics import migrations
from loraplane.metrics.clickhouse import connect
from loraplane.metrics.tables import TABLES
from tests.integration.metrics_env import (
    REPO,
    cache_event,
    drop_database,
    env_for,
    isolated,
    require_stack,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def settings() -> Settings:
    base = Settings()
    require_stack(base)
    settings = isolated(base)
    yield settings
    drop_database(settings)


def cli(settings: Settings, *args: str) -> str:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "loraplane"), "metrics", *args],
        cwd=REPO,
        env=env_for(settings),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_migrate_twice_is_a_no_op(settings: Settings) -> None:
    first = cli(settings, "migrate")
    assert "applied 001_raw_tables" in first and "applied 002_minute_views" in first
    client = connect(settings)
    tables_before = client.execute("SHOW TABLES")
    second = cli(settings, "migrate")
    assert "0 applied, 2 already applied" in second
    assert client.execute("SHOW TABLES") == tables_before
    assert client.execute("SELECT count() FROM schema_migrations") == [(2,)]
    version = migrations.ServerFeatures.parse(client.execute("SELECT version()")[0][0])
    ddl = client.execute("SHOW CREATE TABLE request_log")[0][0]
    assert ("TTL" in ddl) == version.ttl
    assert ("LowCardinality" in ddl) == version.low_cardinality
    client.disconnect()


def test_retention_drops_only_partitions_older_than_the_window(settings: Settings) -> None:
    migrations.migrate(settings)
    table = next(t for t in TABLES if t.name == "cache_events")
    now = datetime.now(UTC)
    old = cache_event(1, "load").model_copy(update={"ts": now - timedelta(days=40)})
    new = cache_event(2, "load").model_copy(update={"ts": now})
    client = connect(settings)
    client.execute(table.insert_sql, [table.row(old), table.row(new)], types_check=True)
    planned = migrations.retention(settings, 30, dry_run=True)
    assert {p.table for p in planned} == {"cache_events", "adapter_cache_1m", "worker_cache_1m"}
    assert client.execute("SELECT count() FROM cache_events") == [(2,)]
    out = cli(settings, "retention", "--days", "30")
    assert "3 partition(s)" in out
    assert client.execute("SELECT event_id FROM cache_events") == [("c-2",)]
    client.disconnect()


def test_an_edited_applied_migration_is_reported(settings: Settings, tmp_path: Path) -> None:
    for path in migrations.MIGRATIONS_DIR.glob("*.sql"):
        (tmp_path / path.name).write_text(path.read_text())
    migrations.migrate(settings, tmp_path)
    edited = tmp_path / "001_raw_tables.sql"
    edited.write_text(edited.read_text() + "\n-- edited\n")
    with pytest.raises(migrations.MigrationError, match="changed after it was applied"):
        migrations.migrate(settings, tmp_path)
