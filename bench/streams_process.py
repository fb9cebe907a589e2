"""A Faust worker (``loraplane streams run`` or an experiment) as a child process on a
benchmark's private topic prefix."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from loraplane.kernel import kafka
from loraplane.kernel.config import Settings

LOG_READY = "Worker ready"
LORAPLANE = str(Path(sys.executable).parent / "loraplane")


def streams_run(agents: Sequence[str]) -> list[str]:
    """Python arguments of ``loraplane streams run`` with only ``agents``."""
    return [LORAPLANE, "streams", "run", *(a for agent in agents for a in ("--agent", agent))]


@contextlib.contextmanager
def streams_worker(
    settings: Settings,
    python_args: Sequence[str],
    log_path: Path,
    start_timeout_s: float = 120.0,
    profile: Path | None = None,
    ready: str = LOG_READY,
    env: Mapping[str, str] | None = None,
) -> Iterator[subprocess.Popen]:
    """Start a Faust worker (``python_args``: a script and its arguments, or ``-m module
    ...``; or another runtime, whose log says ``ready`` once started) and wait for
    ``ready`` in its log ("Worker ready"); SIGTERM on exit. ``profile`` runs it under
    pyinstrument, which writes its text report there when the worker exits. ``env``: more
    environment (a test env's keyring and policy)."""
    environ = {
        **os.environ,
        **(env or {}),
        **kafka.credentials_env(settings),
        "LORAPLANE_TOPIC_PREFIX": settings.topic_prefix,
        "LORAPLANE_HOME": str(settings.home),
        "LORAPLANE_SECRETS_DIR": str(settings.secrets_dir),
    }
    with log_path.open("a") as log:
        runner = (
            [sys.executable]
            if profile is None
            else [
                str(Path(sys.executable).parent / "pyinstrument"),
                "-r",
                "text",
                "--show-all",
                "-o",
                str(profile),
            ]
        )
        proc = subprocess.Popen(
            [*runner, *python_args], env=environ, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + start_timeout_s
        while ready not in log_path.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"streams worker did not start; see {log_path}:\n"
                    + log_path.read_text()[-2000:]
                )
            time.sleep(0.2)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
