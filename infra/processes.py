"""Detached child processes we can find again: PID files, port checks, health waits, log tails.

The CLI exits while the services keep running, so everything a later ``stack down`` needs
lives on disk. A PID file alone is not trusted: PIDs are reused, so before signalling we
check that the process's command line still contains our marker (a path unique to our home).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from loraplane.kernel.atomic_file import write_atomic
from loraplane.kernel.local_files import open_regular, read_regular
from loraplane.kernel.log_tail import tail

__all__ = ["Managed", "StackError", "free_port", "port_in_use", "wait_until"]

_LOG_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND
"""A log is opened with ``open_regular``: a FIFO or device at its path is refused, not
waited on."""

_PID_FILE_BYTES = 64


class StackError(RuntimeError):
    """A failure the user can act on; the message says what and where."""


@dataclass(frozen=True)
class Managed:
    """One long-running process of the stack and the files that track it."""

    pid_file: Path
    log_file: Path
    marker: str  # a string that only our own instance has in its command line

    def pid(self) -> int | None:
        """The recorded PID when that process is alive and still ours, else None."""
        try:
            raw = read_regular(self.pid_file, _PID_FILE_BYTES)
        except FileNotFoundError:
            return None
        except OSError as exc:  # a folder, a FIFO, a huge or unreadable file: say so, no hang
            raise StackError(
                f"{self.pid_file} is unusable ({exc.strerror or exc}): remove it once you "
                "know the service is stopped"
            ) from None
        text = raw.strip()
        if not (text.isdigit() and text.isascii()) or int(text) <= 0:
            return None  # no pid: a write cut short, or not ours
        pid = int(text)
        return pid if _cmdline_contains(pid, self.marker) else None

    def running(self) -> bool:
        return self.pid() is not None

    def start(
        self, argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None
    ) -> int:
        """Start detached (own session, output to the log file) so it outlives the CLI."""
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        try:
            log_fd = open_regular(self.log_file, _LOG_FLAGS)
        except OSError as exc:
            raise StackError(f"{self.log_file}: {exc.strerror or exc}") from None
        with os.fdopen(log_fd, "ab") as log:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=cwd,
                env={**os.environ, **(env or {})},
            )
        write_atomic(self.pid_file, f"{proc.pid}\n")
        # /proc/PID/cmdline shows the new command line only a moment after exec; until then
        # pid() would call our fresh process foreign.
        deadline = time.monotonic() + 5.0
        while self.pid() is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return proc.pid

    def stop(self, timeout: float = 20.0) -> bool:
        """SIGTERM, then SIGKILL after ``timeout``; returns whether something was running."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        _signal_group(pid, signal.SIGTERM)
        if not _wait_gone(pid, timeout):
            _signal_group(pid, signal.SIGKILL)
            _wait_gone(pid, 5.0)
        self.pid_file.unlink(missing_ok=True)
        return True

    def tail(self, lines: int = 20) -> list[str]:
        return tail(self.log_file, lines)


def _cmdline_contains(pid: int, marker: str) -> bool:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        status = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    zombie = status.rsplit(")", 1)[-1].split()[0] == "Z"
    return not zombie and marker in raw.replace(b"\0", b" ").decode(errors="replace")


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """Signal the whole session we created, so helper children go too."""
    with contextlib.suppress(ProcessLookupError):
        try:
            os.killpg(pid, sig)
        except PermissionError:
            os.kill(pid, sig)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    if state == "Z":
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)  # a zombie of our own (tests start the stack in-process): reap
        return False
    return True


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return not _alive(pid)


def free_port() -> int:
    """A loopback port nobody listens on right now (for throwaway servers in tests/demo)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """True when something else already holds ``host:port`` (we try to bind it ourselves)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


def wait_until(
    check: Callable[[], bool],
    timeout: float,
    interval: float = 0.5,
    alive: Callable[[], bool] = lambda: True,
) -> bool:
    """Poll ``check`` until it is true; give up early once ``alive`` says the process died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return True
        if not alive():
            return False
        time.sleep(interval)
    return False
