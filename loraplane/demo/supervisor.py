"""The child processes of one demo or load-test run, and the guarantee that none outlives it.

Every child starts in its own session (so its process group can be signalled as a whole)
with its output in ``LOG_DIR/NAME.log``; the folder is the user's alone (0700, each log
0600), and the output of a command that prints a secret (an API key) is never written
there. Some children put grandchildren into sessions of their own (``loraplane vllm
serve`` does, for vLLM's engine processes), where a group signal cannot reach them; so
before stopping a child we snapshot its whole process tree from /proc and, once the child
is gone, kill whatever of that snapshot is still alive (checked by start time, never by
name, so a reused PID is left alone). ``stop_all`` runs on a normal exit, an exception,
Ctrl-C and SIGTERM (turned into KeyboardInterrupt while the supervisor is entered).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import BinaryIO

from loraplane.kernel import log_tail
from loraplane.kernel.local_files import open_regular

__all__ = [
    "LOG_TAIL_LINES",
    "ORPHAN_GRACE_S",
    "Child",
    "ChildFailed",
    "Supervisor",
    "process_tree",
    "tail",
]

LOG_TAIL_LINES = 25
ORPHAN_GRACE_S = 5.0


class ChildFailed(RuntimeError):
    """A child exited, failed or never became ready; the message ends with its log tail."""


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live, non-zombie process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[19])


def process_tree(root: int) -> list[tuple[int, int]]:
    """(pid, start time) of every live descendant of ``root`` (not root itself)."""
    parents: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            parents.setdefault(st[0], []).append((int(entry), st[1]))
    out: list[tuple[int, int]] = []
    todo = [root]
    while todo:
        for pid, start in parents.get(todo.pop(), []):
            out.append((pid, start))
            todo.append(pid)
    return out


def _same_process_alive(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] == start


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a child's log, each cut to ``log_tail.MAX_LINE``."""
    return "".join(f"{line}\n" for line in log_tail.tail(path, lines))


class Supervisor:
    """Starts, watches and stops the children of one run; a context manager."""

    def __init__(self, log_dir: Path, env: Mapping[str, str], cwd: Path) -> None:
        self.log_dir = log_dir
        self.env = dict(env)
        self.cwd = cwd
        self.children: list[Child] = []
        self._stopped: list[tuple[int, int]] = []  # (pid, start time) of all we stopped
        self._previous: dict[int, object] = {}

    # -- lifetime -----------------------------------------------------------------------
    def __enter__(self) -> Supervisor:
        self.log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.log_dir.chmod(0o700)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._previous[sig] = signal.signal(sig, _interrupt)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # A second Ctrl-C during clean-up must not leave children behind: ignore it.
        previous_int = None
        if threading.current_thread() is threading.main_thread():
            previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.stop_all()
        finally:
            if previous_int is not None:
                signal.signal(signal.SIGINT, previous_int)
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]

    # -- children -----------------------------------------------------------------------
    def start(
        self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> Child:
        """Start ``argv`` in its own session, output appended to ``LOG_DIR/NAME.log``."""
        log_path = self.log_dir / f"{name}.log"
        with _open_log(log_path) as log:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.cwd,
                env={**self.env, **(env or {})},
                start_new_session=True,
            )
        child = Child(name, list(argv), log_path, popen)
        self.children.append(child)
        return child

    def wait_ready(
        self,
        child: Child,
        check: Callable[[], bool],
        timeout_s: float,
        what: str,
        interval_s: float = 0.5,
    ) -> float:
        """Poll ``check`` until true; fail at once if the child exits. Returns seconds."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if not child.alive():
                raise self._failure(child, f"exited with {child.popen.returncode} before {what}")
            with contextlib.suppress(Exception):
                if check():
                    return time.monotonic() - t0
            time.sleep(interval_s)
        raise self._failure(child, f"not {what} after {timeout_s:.0f}s")

    def log_contains(self, child: Child, text: str) -> Callable[[], bool]:
        """A check: does a line of ``child``'s log hold ``text`` (lines read as
        ``log_tail`` reads them: bounded, whatever the child wrote)?"""

        def check() -> bool:
            with os.fdopen(open_regular(child.log_path), errors="replace") as fh:
                return any(text in line for line in log_tail.lines_of(fh))

        return check

    def run(
        self,
        name: str,
        argv: Sequence[str],
        *,
        timeout_s: float = 180.0,
        env: Mapping[str, str] | None = None,
        secret_output: bool = False,
    ) -> str:
        """Run a one-shot command to completion; its stdout is returned and logged (unless
        ``secret_output``: then only its length is), its stderr logged.

        It too gets its own session, so a timeout (or Ctrl-C) kills all of it.
        """
        log_path = self.log_dir / f"{name}.log"
        with _open_log(log_path) as log:
            log.write(f"$ {' '.join(argv)}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=self.cwd,
                env={**self.env, **(env or {})},
                start_new_session=True,
            )
            child = Child(name, list(argv), log_path, popen)
            try:
                out, _ = popen.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.stop(child, grace_s=5)
                raise self._failure(child, f"timed out after {timeout_s:.0f}s") from None
            except BaseException:
                self.stop(child, grace_s=5)
                raise
            text = out.decode(errors="replace")
            log.write(
                f"(stdout withheld: {len(out)} bytes holding a secret)\n".encode()
                if secret_output
                else out
            )
        if popen.returncode != 0:
            raise self._failure(child, f"exited with {popen.returncode}")
        return text

    def stop(self, child: Child, grace_s: float = 20.0) -> None:
        """SIGTERM the child's group, SIGKILL after ``grace_s``; then SIGTERM, and SIGKILL
        after ORPHAN_GRACE_S, whatever of the process tree it had is still alive."""
        tree = process_tree(child.pid)
        own = _stat(child.pid) if child.alive() else None
        self._stopped += tree + ([(child.pid, own[1])] if own else [])
        if child.alive():
            _signal_group(child.pid, signal.SIGTERM)
            try:
                child.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(child.pid, signal.SIGKILL)
                child.popen.wait(10)
        for sig in (signal.SIGTERM, signal.SIGKILL):  # orphans the child left behind
            survivors = [(p, st) for p, st in tree if _same_process_alive(p, st)]
            for pid, _ in survivors:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + ORPHAN_GRACE_S
            while (
                any(_same_process_alive(p, st) for p, st in survivors)
                and time.monotonic() < deadline
            ):
                time.sleep(0.1)
        if child in self.children:
            self.children.remove(child)

    def stop_all(self) -> None:
        """Stop every child, the last started first (workers before their vLLM)."""
        for child in reversed(list(self.children)):
            self.stop(child)

    @property
    def stopped(self) -> int:
        """How many processes (children and their descendants) were stopped."""
        return len(self._stopped)

    def leftovers(self) -> list[int]:
        """PIDs of anything this supervisor stopped that is still alive (should be none)."""
        return [pid for pid, start in self._stopped if _same_process_alive(pid, start)]

    def _failure(self, child: Child, why: str) -> ChildFailed:
        return ChildFailed(
            f"{child.name}: {why}; last lines of {child.log_path}:\n{tail(child.log_path)}"
        )


def _open_log(path: Path) -> BinaryIO:
    """``path`` for appending, readable by its owner only from its first byte on; a FIFO or
    a device put there is refused (``open_regular``), never waited on or written to."""
    fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, mode=0o600)
    return os.fdopen(fd, "ab")


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")
