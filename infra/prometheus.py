"""A Prometheus server of our own on loopback, scraping the stack, and promtool's checks.

Debian's ``prometheus`` package (scripts/setup.d/20-services.sh) gives ``prometheus`` and
``promtool``; its systemd service is not used (it would bind 0.0.0.0:9090). ``Prometheus``
writes a config for the targets it is given, starts the server on ``127.0.0.1:PORT`` with its
own TSDB under ``home`` and the project's rules (``dashboards/prometheus``), and reads it back
through Prometheus' HTTP API. The integration test uses it (tests/integration/
test_prometheus_scrape.py); so can an operator::

    python -m loraplane.infra.prometheus HOME PORT worker=127.0.0.1:8101 router=127.0.0.1:8300

``check_metrics`` is ``promtool check metrics`` on one /metrics body, less the one lint the
project accepts: the colon of ``vllm:lora_adapter_loaded`` (vLLM's name, kept for llm-d).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplane.infra.processes import Managed, StackError, port_in_use, wait_until
from loraplane.kernel.atomic_file import write_atomic
from loraplane.kernel.config import LOOPBACK
from loraplane.kernel.metric_names import LORA_ADAPTER_LOADED

__all__ = [
    "ALLOWED_LINTS",
    "RULES_DIR",
    "RULES_FILE",
    "RULES_TEST_FILE",
    "Prometheus",
    "binary",
    "check_metrics",
    "check_rules",
    "main",
    "run_rule_tests",
]

RULES_DIR = Path(__file__).resolve().parents[1] / "dashboards" / "prometheus"
RULES_FILE = RULES_DIR / "loraplane.rules.yml"
RULES_TEST_FILE = RULES_DIR / "loraplane.rules.test.yml"
# promtool's lint on a vLLM-style name: accepted for that one name, nothing else.
ALLOWED_LINTS = frozenset({f"{LORA_ADAPTER_LOADED} metric names should not contain ':'"})


def binary(name: str) -> str | None:
    """``prometheus`` or ``promtool`` on PATH (Debian puts both in /usr/bin)."""
    return shutil.which(name)


def _promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    tool = binary("promtool")
    if tool is None:
        raise StackError("promtool is missing: run scripts/setup.d/20-services.sh")
    return subprocess.run(
        [tool, *args], input=stdin, capture_output=True, text=True, timeout=60, check=False
    )


def check_metrics(exposition: str) -> list[str]:
    """promtool's lint problems on one /metrics body, less ``ALLOWED_LINTS`` ([]: clean)."""
    done = _promtool("check", "metrics", stdin=exposition)
    problems = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return [p for p in problems if p not in ALLOWED_LINTS]


def check_rules(path: Path = RULES_FILE) -> subprocess.CompletedProcess[str]:
    return _promtool("check", "rules", str(path))


def run_rule_tests(path: Path = RULES_TEST_FILE) -> subprocess.CompletedProcess[str]:
    """``promtool test rules``: the rules' own unit tests (input series, expected alerts)."""
    return _promtool("test", "rules", str(path))


@dataclass
class Prometheus:
    """One server: ``targets`` maps a job name to ``host:port`` addresses of /metrics."""

    home: Path
    port: int
    targets: dict[str, list[str]]
    scrape_interval_s: float = 1.0
    rule_files: list[Path] = field(default_factory=lambda: [RULES_FILE])

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def process(self) -> Managed:
        return Managed(
            self.home / "prometheus.pid",
            self.home / "prometheus.log",
            str(self.home / "prometheus.yml"),
        )

    def config(self) -> dict[str, Any]:
        interval = f"{int(self.scrape_interval_s * 1000)}ms"
        return {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": addrs}]}
                for job, addrs in sorted(self.targets.items())
            ],
        }

    def start(self, timeout_s: float = 30.0) -> None:
        server = binary("prometheus")
        if server is None:
            raise StackError("prometheus is missing: run scripts/setup.d/20-services.sh")
        if port_in_use(LOOPBACK, self.port):
            raise StackError(f"{LOOPBACK}:{self.port} is taken")
        self.home.mkdir(parents=True, exist_ok=True)
        config = self.home / "prometheus.yml"
        write_atomic(config, json.dumps(self.config(), indent=1))  # JSON is YAML
        self.process.start(
            [
                server,
                f"--config.file={config}",
                f"--storage.tsdb.path={self.home / 'tsdb'}",
                f"--web.listen-address={LOOPBACK}:{self.port}",
                "--storage.tsdb.retention.time=1d",
            ]
        )
        if not wait_until(self.ready, timeout_s, 0.2, self.process.running):
            log = "\n".join(self.process.tail(20))
            self.stop()
            raise StackError(f"prometheus did not become ready on {self.url}:\n{log}")

    def ready(self) -> bool:
        with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as reply:
            return int(reply.status) == 200

    def stop(self) -> bool:
        return self.process.stop(10.0)

    def api(self, path: str, **params: str) -> Any:
        """``/api/v1/PATH``'s ``data`` (raises on an API error)."""
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=5) as reply:
            body = json.load(reply)
        if body.get("status") != "success":
            raise StackError(f"prometheus {path}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant vector: ``[{"metric": {labels}, "value": [ts, "value"]}, ...]``."""
        data = self.api("query", query=expr)
        return list(data["result"])


def main(argv: list[str]) -> int:
    """``HOME PORT JOB=HOST:PORT ...``: run a server in the foreground until Ctrl-C."""
    if len(argv) < 3:
        print(main.__doc__, file=sys.stderr)
        return 2
    targets: dict[str, list[str]] = {}
    for spec in argv[2:]:
        job, _, addr = spec.partition("=")
        targets.setdefault(job, []).append(addr)
    server = Prometheus(Path(argv[0]), int(argv[1]), targets)
    server.start()
    print(f"prometheus on {server.url} (log {server.process.log_file}); Ctrl-C stops it")
    try:
        wait_until(lambda: False, float("inf"), 1.0, server.process.running)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
