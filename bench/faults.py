"""The fault suite as a tool: runs each fault test, which injects its fault into services of
its own (a throwaway broker, cluster, ClickHouse or S3 with a tmp home and free ports, or its
own worker and router processes; the shared stack only for what it does not break), and
prints the table: fault -> answered -> stored -> lost -> duplicated -> recovered by itself,
with timings, as JSON. ``--write-doc`` also writes it into docs/reliability.md; nothing is
written without it. Each row comes from the test's own measurement
(``tests/integration/fault_report.py``), written only after the test's assertions passed; a
failed test is a row with ``passed: false``. The rows that do not kill a broker also run in
``./run test``; the others are marked ``fault_long`` (deselected there, for the suite's
25-minute budget).

    .venv/bin/python -m bench.faults [--write-doc] [--only kafka-1,s3]  # needs `loraplane stack up`
    .venv/bin/python -m bench.faults --only kafka-1 --outage-s 600   # the 10-minute outage

``lost_ratio`` is lost / answered per row (the goal: 0 everywhere, every row recovered by
itself).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import machine

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- faults:begin -->", "<!-- faults:end -->"

FAULTS: dict[str, str] = {
    "kafka-1": "tests/integration/test_sink_broker_restart.py",
    "kafka-3": "tests/integration/test_cluster_broker_kill.py",
    "clickhouse": "tests/integration/test_metrics_outage.py",
    "s3": "tests/integration/test_s3_durable.py::test_an_artifact_survives_a_restart_and_a_kill",
    "worker": "tests/integration/test_router_fleet.py::"
    "test_a_killed_worker_loses_no_request_and_its_adapter_is_served_elsewhere",
    "worker-logs": "tests/integration/test_worker_kill_request_log.py",
    "poison": "tests/integration/test_worker_e2e.py::"
    "test_poison_messages_do_not_crash_loop_the_worker",
    "host-disk-full": "tests/integration/test_host_disk_full.py",
    "kafka-3-agents": "tests/integration/test_cluster_agents.py",
    "registry-tail-kafka": "tests/integration/test_registry_tail_live.py::"
    "test_a_broker_restart_keeps_the_view_and_the_tail_resumes",
    "streams-kafka": "tests/integration/test_streams_broker_kill.py::"
    "test_the_app_heals_from_a_broker_kill_by_itself",
    "streams-kill": "tests/integration/test_streams_broker_kill.py::"
    "test_a_killed_app_restarts_exact_and_reissues_nothing",
    "router-kafka": "tests/integration/test_router_kafka_outage.py",
}


def run_one(name: str, target: str, outage_s: float | None = None) -> list[dict[str, Any]]:
    """Run one fault test; its rows, or one failed row. ``outage_s``: how long a killed
    broker stays down (the tests that read ``LORAPLANE_FAULT_DOWN_S``)."""
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as report:
        env = {**os.environ, "LORAPLANE_FAULT_REPORT": report.name}
        timeout = ["-o", "timeout=300"]
        if outage_s is not None:
            env["LORAPLANE_FAULT_DOWN_S"] = str(outage_s)
            timeout = ["-o", f"timeout={int(outage_s) + 600}"]
        t0 = time.monotonic()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-o",
                "addopts=",
                *timeout,
                target,
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        wall = round(time.monotonic() - t0, 1)
        rows = [
            json.loads(line) for line in Path(report.name).read_text().splitlines() if line.strip()
        ]
    if done.returncode != 0 or not rows:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        return [{"fault": name, "passed": False, "wall_s": wall, "note": " | ".join(tail)}]
    for row in rows:
        row |= {
            "id": name,
            "passed": True,
            "wall_s": wall,
            "lost_ratio": round(row["lost"] / row["answered"], 6) if row["answered"] else 0,
        }
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| fault | answered | stored | lost | duplicated | recovered by itself | down s "
        "| recovery s | note |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    body = []
    for r in rows:
        if not r.get("passed"):
            body.append(f"| {r['fault']} | **test failed** | | | | | | | {r.get('note', '')} |")
            continue
        body.append(
            " | ".join(
                [
                    f"| {r['fault']}",
                    str(r["answered"]),
                    str(r["stored"]),
                    f"**{r['lost']}**",
                    str(r["duplicated"]),
                    "yes" if r["recovered_by_itself"] else "**no**",
                    "-" if r["down_s"] is None else f"{r['down_s']:g}",
                    "-" if r["recovery_s"] is None else f"{r['recovery_s']:g}",
                    f"{r['note']} |",
                ]
            )
        )
    return head + "\n".join(body) + "\n"


def write_doc(rows: list[dict[str, Any]], where: str) -> None:
    """Replace the table between the markers of ``DOC`` (or add it at the end)."""
    text = DOC.read_text()
    block = f"{BEGIN}\n_Measured by `python -m bench.faults` on {where}._\n\n{table(rows)}{END}"
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n## The fault table (`bench/faults.py`)\n\n" + block + "\n"
    DOC.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", default="", help="comma-separated fault ids: " + ", ".join(FAULTS)
    )
    parser.add_argument(
        "--write-doc",
        action="store_true",
        help="also write the table into " + str(DOC.relative_to(ROOT)),
    )
    parser.add_argument(
        "--outage-s",
        type=float,
        default=None,
        help="keep a killed broker down this long (default: the test's 20 s)",
    )
    args = parser.parse_args()
    chosen = [f for f in args.only.split(",") if f] or list(FAULTS)
    unknown = set(chosen) - FAULTS.keys()
    if unknown:
        parser.error(f"unknown fault ids: {sorted(unknown)}")
    rows: list[dict[str, Any]] = []
    for name in chosen:
        print(f"fault {name}: {FAULTS[name]} ...", file=sys.stderr, flush=True)
        rows += run_one(name, FAULTS[name], args.outage_s)
    ok = [r for r in rows if r.get("passed")]
    result = {
        "faults": rows,
        "every_row_passed": len(ok) == len(rows),
        "lost_total": sum(r["lost"] for r in ok),
        "every_row_recovered_by_itself": all(r["recovered_by_itself"] for r in ok),
    }
    print(json.dumps(result, indent=2))
    if args.write_doc:
        write_doc(rows, machine())


if __name__ == "__main__":
    main()
