"""What every stack service has in common; ``infra.stack`` only talks to this interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from loraplane.infra.processes import Managed

if TYPE_CHECKING:
    from loraplane.kernel.config import Settings

__all__ = ["Port", "Service"]


@dataclass(frozen=True)
class Port:
    """A socket a service binds, and the environment variable that moves it."""

    what: str
    host: str
    number: int
    env: str


@dataclass(frozen=True)
class Service(ABC):
    """One local service: how to prepare, start, probe and describe it."""

    settings: Settings
    name: ClassVar[str]
    start_timeout: ClassVar[float] = 60.0

    @property
    def home(self) -> Path:
        return self.settings.state_dir

    @property
    def label(self) -> str:
        """This instance's name (PID file, log, ``stack status``); several instances of one
        service (the Kafka nodes) differ here."""
        return self.name

    @property
    def process(self) -> Managed:
        return Managed(
            self.home / "run" / f"{self.label}.pid",
            self.home / "logs" / f"{self.label}.log",
            self.marker(),
        )

    @abstractmethod
    def marker(self) -> str:
        """A string only our instance has in its command line (guards against PID reuse)."""

    @abstractmethod
    def ports(self) -> list[Port]:
        """Every socket the service binds."""

    @abstractmethod
    def endpoint(self) -> str: ...

    @abstractmethod
    def prepare(self) -> list[str]:
        """Write configs, create data dirs; returns the command line to start it."""

    @abstractmethod
    def healthy(self) -> bool:
        """A cheap probe, used by ``status``."""

    def ready(self) -> bool:
        """The probe ``up`` waits for; defaults to ``healthy``."""
        return self.healthy()

    @abstractmethod
    def after_start(self) -> None:
        """One-off, idempotent initialisation once ready (buckets, databases)."""

    @abstractmethod
    def version(self) -> str: ...

    @abstractmethod
    def data_dirs(self) -> list[Path]:
        """What ``down --purge`` deletes."""
