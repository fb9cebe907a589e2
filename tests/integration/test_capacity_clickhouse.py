"""``loraplane capacity --from-clickhouse`` against the real ClickHouse of the local stack:
request_log rows we wrote are read back (read-only login), swept, and answered."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from loraplane.kernel.config import Settings
from loraplane.metrics.clickhouse import connect
from loraplane.metrics.tables import TABLES
from tests.integration.metrics_env import REPO, env_for, metrics_env, request_events

pytestmark = pytest.mark.integration

LORAPLANE = str(Path(sys.executable).parent / "loraplane")


def test_the_fleets_own_rows_are_swept_and_answered(tmp_path: Path) -> None:
    with metrics_env(Settings()) as settings:
        start = datetime.now(UTC) - timedelta(minutes=10)
        events = request_events(
            400, seed=9, adapters=("alpha", "beta", "gamma", "delta"), start=start
        )
        table = next(t for t in TABLES if t.name == "request_log")
        client = connect(settings)
        try:
            client.execute(table.insert_sql, [table.row(e) for e in events], types_check=True)
        finally:
            client.disconnect()
        out, png = tmp_path / "cap.json", tmp_path / "cap.png"
        done = subprocess.run(
            [
                LORAPLANE,
                "capacity",
                "--from-clickhouse",
                "--since",
                "1h",
                "--target",
                "interactive=0.5",
                "--workers",
                "1,2",
                "--slots",
                "1,2",
                "--loads",
                "6",
                "--json",
                str(out),
                "--plot",
                str(png),
            ],
            cwd=REPO,
            env=env_for(settings),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode in (0, 1), done.stderr
        assert "reading 400 request rows of the last 1h" in done.stderr
        data = json.loads(out.read_text())
        assert data["requests"] == 400
        (pool,) = data["pools"]
        assert pool["base_model"] == "llama-3.1-8b" and pool["requests"] == 400
        assert pool["points"] and all(
            set(p["attainment"]) >= {"interactive"} for p in pool["points"]
        )
        if done.returncode == 0:
            assert pool["answer"]["meets"] and "llama-3.1-8b:" in done.stdout
        else:
            assert "no point of the grid reaches the target" in done.stdout
        assert png.read_bytes()[:4] == b"\x89PNG"
        empty = subprocess.run(
            [
                LORAPLANE,
                "capacity",
                "--from-clickhouse",
                "--since",
                "1s",
                "--target",
                "interactive=0.5",
            ],
            cwd=REPO,
            env=env_for(settings),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert empty.returncode == 1 and "no request rows in the last 1s" in empty.stderr
