"""The pack's answers on Debian's ClickHouse 18.16 for the rows of ``tests/pack_cases.py``:
the same checks the unit suite runs on current ClickHouse (chdb,
tests/unit/test_clickhouse_current.py), so one SQL text is shown to answer alike on both.
Cheap: one migrated database, no topics, no sink (under 2 s of test time)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from clickhouse_driver import Client

from loraplane.kernel.config import Settings
from loraplane.metrics import migrations, queries
from loraplane.metrics.clickhouse import connect
from tests import pack_cases
from tests.integration.metrics_env import drop_database, isolated, require_stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    base = Settings()
    require_stack(base)
    settings = isolated(base)
    result = migrations.migrate(settings)
    print(f"ClickHouse {result.server_version}")
    c = connect(settings)
    try:
        pack_cases.load(c)
        yield c
    finally:
        c.disconnect()
        drop_database(settings)


@pytest.mark.parametrize("name", queries.names())
def test_pack_query_on_the_stacks_clickhouse(client: Client, name: str) -> None:
    pack_cases.CHECKS[name](pack_cases.run(client, name))


def test_attack_a_flood_of_adapter_ids_leaves_the_charts_their_latest_minute(
    client: Client,
) -> None:
    """``pack_cases.flood`` on 18.16: the charts keep the genuine adapter's latest minute."""
    pack_cases.insert(client, pack_cases.flood())
    pack_cases.flood_charted(queries.run(client, "timeseries_requests", pack_cases.flood_window()))
