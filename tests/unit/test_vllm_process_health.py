"""``VllmProcess.healthy`` against whatever answers on vLLM's port: anything but a 200 is
"not healthy", never an exception (``wait_healthy`` and ``loraplane vllm serve``'s
supervision loop call it every few seconds)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplane.workers.vllm_process import VllmProcess


@pytest.fixture
def answering() -> Iterator[tuple[list[bytes], int]]:
    """A loopback port that answers every connection with the next of its payloads."""
    payloads: list[bytes] = []
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(payloads.pop(0) if payloads else b"")

    threading.Thread(target=serve, daemon=True).start()
    yield payloads, server.getsockname()[1]
    server.close()


@pytest.mark.parametrize(
    ("payload", "healthy"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", True),
        (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n", False),
        (b"garbage\r\n\r\n", False),  # not HTTP: BadStatusLine
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", False),  # LineTooLong
        (b"HTTP/1.1 200 OK\r\n" + b"".join(b"X%d: a\r\n" % i for i in range(200)) + b"\r\n", False),
        (b"", False),  # closed at once
    ],
)
def test_any_answer_is_healthy_or_not_never_an_exception(
    answering: tuple[list[bytes], int], payload: bytes, healthy: bool, tmp_path: Path
) -> None:
    """ATTACK: an answer that is not HTTP, a header line over 64 KiB or over 100 headers
    raised http.client's HTTPException (no OSError) out of ``healthy``: vLLM's start
    failed with it, and ``loraplane vllm serve`` stopped a running vLLM."""
    payloads, port = answering
    payloads.append(payload)
    proc = VllmProcess(tmp_path, port, tmp_path / "log")
    assert proc.healthy() is healthy
