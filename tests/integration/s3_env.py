"""A throwaway S3 endpoint of a test's own: s3proxy started through ``loraplane.infra.s3``
like the stack's (same authentication, objects on disk under the test's home), on a free
port; never the shared one (``S3.private``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from loraplane.infra.processes import wait_until
from loraplane.infra.s3 import S3
from loraplane.kernel.config import S3Settings, Settings


class PrivateS3:
    """Started and stopped by its test only; ``home`` holds its data, secret and log."""

    def __init__(self, home: Path) -> None:
        self.service = S3.private(Settings(), home, home / "secrets" / "s3-secret")
        self.port = self.service.settings.s3.port

    @property
    def settings(self) -> S3Settings:
        return self.service.settings.s3

    @property
    def data(self) -> Path:
        return self.service.data

    def start(self) -> None:
        """Start and wait until a signed request is answered; the bucket exists after."""
        self.service.process.start(self.service.prepare())
        assert wait_until(self.service.ready, 120, alive=self.service.process.running), (
            f"throwaway s3proxy did not start: {self.service.process.tail(30)}"
        )
        self.service.after_start()

    def stop(self) -> None:
        self.service.process.stop(10)

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs (what a crash or an OOM kill does)."""
        pid = self.service.process.pid()
        if pid is not None:
            os.killpg(pid, signal.SIGKILL)
            assert wait_until(lambda: not self.service.process.running(), 20)
