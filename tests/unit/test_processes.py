"""PID files are only trusted while the command line still matches; stop really stops."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from loraplane.infra.processes import Managed, StackError, port_in_use
from loraplane.kernel.log_tail import tail


def _managed(tmp_path: Path, marker: str) -> Managed:
    return Managed(tmp_path / "sleeper.pid", tmp_path / "sleeper.log", marker)


def test_start_then_stop_kills_the_process(tmp_path: Path) -> None:
    marker = f"# sleeper {tmp_path}"
    managed = _managed(tmp_path, marker)
    pid = managed.start(
        [sys.executable, "-c", f"import time; print('up', flush=True); time.sleep(60)  {marker}"]
    )
    assert managed.pid() == pid
    assert managed.stop(timeout=5)
    assert not Path(f"/proc/{pid}").exists() or managed.pid() is None
    assert not managed.pid_file.exists()
    assert managed.stop() is False


def test_a_reused_pid_is_not_ours(tmp_path: Path) -> None:
    managed = _managed(tmp_path, "a marker no process has")
    managed.pid_file.write_text(f"{os.getpid()}\n")
    assert managed.pid() is None
    assert managed.stop() is False  # and nothing was signalled: we are still here


def test_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert port_in_use("127.0.0.1", sock.getsockname()[1])


def test_tail_of_a_missing_file_is_empty(tmp_path: Path) -> None:
    assert tail(tmp_path / "nope.log", 5) == []
    (tmp_path / "x.log").write_text("".join(f"{i}\n" for i in range(10)))
    assert tail(tmp_path / "x.log", 2) == ["8", "9"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["folder", "fifo", "huge"])
def test_a_pid_file_that_is_no_small_file_is_a_clear_error(tmp_path: Path, kind: str) -> None:
    """Before, a folder raised IsADirectoryError through ``stack status``/``up``/``down``,
    and a FIFO hung them for good."""
    managed = _managed(tmp_path, "a marker no process has")
    if kind == "folder":
        managed.pid_file.mkdir()
    elif kind == "fifo":
        os.mkfifo(managed.pid_file)
    else:
        managed.pid_file.write_bytes(b"1" * (1 << 20))
    with pytest.raises(StackError, match=r"sleeper\.pid"):
        managed.pid()
    with pytest.raises(StackError, match=r"sleeper\.pid"):
        managed.stop()


@pytest.mark.parametrize("text", [b"\xff\xfe\n", b"-1\n", b"0\n", b"12abc\n", b""])
def test_a_pid_file_without_a_pid_names_no_process(tmp_path: Path, text: bytes) -> None:
    managed = _managed(tmp_path, "a marker no process has")
    managed.pid_file.write_bytes(text)
    assert managed.pid() is None
    assert managed.stop() is False and not managed.pid_file.exists()


def _hold_host_tier(folder: str) -> None:
    """Run in a child: hold the host tier as a worker agent does, until killed."""
    import time

    from loraplane.workers.runner import claim_host_tier

    held = claim_host_tier(Path(folder))  # kept open: the lock lives as long as the file
    print("held", flush=True)
    time.sleep(120)
    held.close()


@pytest.mark.timeout(60)
def test_one_worker_agent_per_host_tier_and_a_kill_frees_it(tmp_path: Path) -> None:
    """Before, a second agent on the same host tier (the same worker id started twice, or
    two ids given one --host-tier-dir) started: its startup scan deleted the first's
    installs in flight, and each overwrote the other's applied command ids."""
    import signal
    import subprocess

    from loraplane.workers.runner import claim_host_tier

    folder = tmp_path / "host-tier"
    root = Path(__file__).resolve().parents[2]
    code = (
        f"from tests.unit.test_processes import _hold_host_tier; _hold_host_tier({str(folder)!r})"
    )
    child = subprocess.Popen([sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"held\n"
        with pytest.raises(SystemExit, match="one worker agent per host-tier folder"):
            claim_host_tier(folder)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    claim_host_tier(folder).close()  # no stale lock after a kill -9
