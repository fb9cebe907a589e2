"""Where the agent and gateway put their Kafka events without waiting for the broker.

``emit`` only enqueues into librdkafka's in-memory queue (acks=all, idempotent producer); a
background ``poll`` serves delivery reports. A request therefore never waits on Kafka, and
a broker outage costs counted drops (``failed``/``dropped``), never a stuck response.
``emit`` never raises: a message librdkafka refuses outright (too large, unknown topic) is
counted in ``refused`` and logged, so no caller's loop (the command feed dead-lettering a
poison message, a request being answered) can be crashed by the event it reports.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from loraplane.schemas.codec import encode
from pydantic import BaseModel

from loraplane.kernel import kafka
from loraplane.kernel.config import Settings

log = logging.getLogger(__name__)


class EventSink(Protocol):
    def emit(self, topic_suffix: str, key: str, message: BaseModel) -> None: ...


class KafkaEventSink:
    def __init__(self, settings: Settings, client_id: str) -> None:
        from loraplane.kernel.topics import topic_name

        self._topic = lambda suffix: topic_name(settings, suffix)
        self._producer = kafka.producer(settings, client_id=client_id, linger_ms=20)
        self.delivered = 0
        self.failed = 0
        self.dropped = 0
        self.refused = 0

    def _on_delivery(self, err: Any, _msg: Any) -> None:
        if err is None:
            self.delivered += 1
        else:
            self.failed += 1

    def emit(self, topic_suffix: str, key: str, message: BaseModel) -> None:
        try:
            self._producer.produce(self._topic(topic_suffix), key=key, value=encode(message),
                                   on_delivery=self._on_delivery)
        except BufferError:
            self.dropped += 1
        except Exception as exc:  # KafkaException (MSG_SIZE_TOO_LARGE, ...), encode errors
            self.refused += 1
            log.error("%s event for key %.64r not sent (%d refused so far): %s",
                      topic_suffix, key, self.refused, exc)
        self._producer.poll(0)

    def poll(self) -> None:
        self._producer.poll(0)

    def flush(self, timeout_s: float = 5.0) -> int:
        """Wait for outstanding deliveries; returns how many are still queued."""
        return self._producer.flush(timeout_s)
