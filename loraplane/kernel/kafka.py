"""The one place Kafka client configuration is built (librdkafka keys), for every client
the project makes: producers, consumers and admin clients alike."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraplane.kernel.config import Settings


class KafkaUnavailable(RuntimeError):
    """The broker could not be reached (the text says where and why)."""


def client_config(settings: Settings, **extra: str | int | bool) -> dict[str, str | int | bool]:
    """librdkafka config for our own short-lived clients; silent, since refused connections
    during start-up are expected and the caller reports failures itself."""
    return {"bootstrap.servers": settings.kafka.bootstrap, "log_level": 0, **extra}
