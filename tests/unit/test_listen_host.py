"""What loraplane's own listeners bind: loopback unless ``listen_host`` says otherwise, and
only the Helm chart (a pod's own network namespace) says otherwise."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from loraplane.kernel.config import LOOPBACK, Settings
from tests.repository_files import repository_files

ROOT = Path(__file__).resolve().parents[2]
SETS_IT = re.compile(r"LORAPLANE_LISTEN_HOST|\blisten_host\s*(?::\s|=(?!=))")
# where it may be set: its definition, and the chart (which sets it in a ConfigMap)
ALLOWED = {"loraplane/kernel/config.py", "tests/unit/test_listen_host.py"}


def test_the_default_is_loopback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LORAPLANE_LISTEN_HOST", raising=False)
    monkeypatch.setenv("LORAPLANE_CONFIG", str(tmp_path / "none.yaml"))
    assert Settings().listen_host == LOOPBACK == "127.0.0.1"


def test_only_an_address_is_accepted() -> None:
    assert Settings(listen_host="0.0.0.0").listen_host == "0.0.0.0"
    assert Settings(listen_host="::1").listen_host == "::1"
    for bad in ("localhost", "", "0.0.0.0:80", "10.0.0.300"):
        with pytest.raises(ValidationError):
            Settings(listen_host=bad)


def test_nothing_in_the_repository_but_the_chart_moves_it_off_loopback() -> None:
    """Scripts, tests, benchmarks, the systemd units and the demo all keep the default, so
    every listener they start binds 127.0.0.1."""
    files = repository_files()
    offenders = []
    for name in files:
        if name in ALLOWED or name.startswith(("infra/helm/", "docs/")):
            continue
        path = ROOT / name
        if not path.is_file() or path.is_symlink() or path.suffix in {".png", ".csv", ".gz"}:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        offenders += [f"{name}: {m.group(0)}" for m in SETS_IT.finditer(text)]
    assert offenders == []


def test_a_bootstrap_list_is_used_as_given() -> None:
    s = Settings(kafka={"host": "k", "port": 9092, "brokers": 3})
    assert s.kafka.bootstrap == "k:9092,k:9094,k:9096"
    s = Settings(kafka={"brokers": 3, "bootstrap_servers": "lora-kafka-bootstrap.kafka.svc:9092"})
    assert s.kafka.bootstrap == "lora-kafka-bootstrap.kafka.svc:9092"


async def test_the_worker_s_listeners_bind_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway and the worker's /metrics listener take their address from the settings
    (recorded here, nothing is bound)."""
    from aiohttp import web

    from loraplane.workers import runner

    bound: list[str] = []

    async def record(listeners: object, host: str, *_: object, **__: object) -> list[object]:
        bound.append(host)
        return []

    monkeypatch.setattr(runner, "start_sites", record)
    gateway = runner.Listener(web.Application(), 0, "gateway", "--gateway-port")
    await runner._sites(Settings(), "w1", [gateway])
    await runner._sites(Settings(listen_host="0.0.0.0"), "w1", [gateway])
    assert bound == [LOOPBACK, "0.0.0.0"]


def test_the_progress_endpoint_binds_what_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplane.kernel import progress_metrics

    bound: list[str] = []
    monkeypatch.setattr(
        progress_metrics, "start_http_server", lambda port, addr, registry: bound.append(addr)
    )
    progress_metrics.serve_progress(18201, host=Settings().listen_host)
    assert bound == [LOOPBACK]
