"""A slowloris of many shapes, as its own process: ``python -m tests.integration.slow_clients
--port P --connections N`` keeps N connections to 127.0.0.1:P open (the address the
legitimate clients use, so no per-address limit can tell them apart) and opens a new one
whenever the server closes one. Each connection is one of ``SHAPES`` (by its index):

* ``silent``: connects and never sends a byte;
* ``head``: a request line, then one more header byte every ``--trickle-s``;
* ``body``: a whole POST head with ``Content-Length: 100000``, then one body byte every
  ``--trickle-s``;
* ``keepalive``: one whole ``GET /healthz``, its answer read, then idle on the keep-alive
  connection;
* ``stalled``: half a head at once, then nothing.

Every second it prints a JSON line of counts (``held`` open now, ``opened`` and ``closed``
by the server so far, ``errors`` of connects); SIGTERM ends it after a last line.
``SlowClients`` runs it from a test or a benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SHAPES = ("silent", "head", "body", "keepalive", "stalled")
ROOT = Path(__file__).resolve().parents[2]


class _Counts:
    def __init__(self) -> None:
        self.held = 0
        self.opened = 0
        self.closed = 0
        self.errors = 0

    def line(self) -> str:
        return json.dumps(
            {"held": self.held, "opened": self.opened, "closed": self.closed, "errors": self.errors}
        )


async def _speak(
    shape: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, trickle_s: float
) -> None:
    """Plays one shape until the server closes the connection."""
    if shape == "head":
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        while True:
            await asyncio.sleep(trickle_s)
            writer.write(b"X")  # an endless header name, one byte at a time
            await writer.drain()
    elif shape == "body":
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/json\r\nContent-Length: 100000\r\n\r\n"
        )
        while True:
            await asyncio.sleep(trickle_s)
            writer.write(b" ")
            await writer.drain()
    elif shape == "keepalive":
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await reader.readuntil(b"\r\n\r\n")
    elif shape == "stalled":
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    while await reader.read(65536):  # until the server closes it
        pass


async def _hold(
    index: int, port: int, trickle_s: float, counts: _Counts, connecting: asyncio.Semaphore
) -> None:
    shape = SHAPES[index % len(SHAPES)]
    while True:
        async with connecting:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", port), 10
                )
            except (OSError, TimeoutError):
                counts.errors += 1
                await asyncio.sleep(0.1)
                continue
        counts.held += 1
        counts.opened += 1
        try:
            await _speak(shape, reader, writer, trickle_s)
        except (OSError, RuntimeError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            counts.held -= 1
            counts.closed += 1
            writer.transport.abort()


async def _main(port: int, connections: int, trickle_s: float, parallel_connects: int) -> None:
    counts = _Counts()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    connecting = asyncio.Semaphore(parallel_connects)
    tasks = [
        asyncio.create_task(_hold(i, port, trickle_s, counts, connecting))
        for i in range(connections)
    ]
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
        print(counts.line(), flush=True)
    del tasks
    os._exit(0)  # the kernel closes every socket at once; cancelling 10,000 connects is slow


class SlowClients:
    """The attack as a child process; ``counts`` is its latest line."""

    def __init__(
        self, port: int, connections: int, *, trickle_s: float = 3.0, parallel_connects: int = 256
    ) -> None:
        self.connections = connections
        self.counts: dict[str, Any] = {"held": 0, "opened": 0, "closed": 0, "errors": 0}
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.integration.slow_clients",
                "--port",
                str(port),
                "--connections",
                str(connections),
                "--trickle-s",
                str(trickle_s),
                "--parallel-connects",
                str(parallel_connects),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            with contextlib.suppress(ValueError):
                self.counts = json.loads(line)

    def wait_held(self, timeout_s: float = 120.0) -> None:
        """Until every connection has been opened once."""
        deadline = time.monotonic() + timeout_s
        while self.counts["opened"] < self.connections:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the attack did not get its connections: {self.counts}")
            time.sleep(0.2)

    def stop(self) -> dict[str, Any]:
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(10)
        self._reader.join(5)
        return self.counts


@contextlib.contextmanager
def slow_clients(port: int, connections: int, **kwargs: Any) -> Iterator[SlowClients]:
    """The attack on ``port``, held (``wait_held``) before the body runs, stopped after."""
    attack = SlowClients(port, connections, **kwargs)
    try:
        attack.wait_held()
        yield attack
    finally:
        attack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--trickle-s", type=float, default=3.0)
    parser.add_argument("--parallel-connects", type=int, default=256)
    args = parser.parse_args()
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        asyncio.run(_main(args.port, args.connections, args.trickle_s, args.parallel_connects))
    else:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_main(args.port, args.connections, args.trickle_s, args.parallel_connects))


if __name__ == "__main__":
    main()
