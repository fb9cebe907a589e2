"""Reading the registry from its compacted topic: once (the CLI, the gateway, the planner)
or as a live tail (the worker agents and the router).

The topic holds one AdapterView per adapter_id (the latest wins); reading it from the start
gives the whole registry without talking to the Faust app.
"""

from __future__ import annotations

import logging

from loraplane.kernel.bus import Record, read_topic
from loraplane.kernel.config import Settings
from loraplane.kernel.topic_tail import TopicTail
from loraplane.kernel.topics import topic_name
from loraplane.schemas.codec import SchemaError, decode
from loraplane.schemas.registry import AdapterView

log = logging.getLogger(__name__)


def load_registry(settings: Settings, timeout_s: float = 10.0,
                  to_end: bool = False) -> dict[str, AdapterView]:
    """adapter_id -> its current view. Undecodable records are logged and skipped.
    Every read waits for the end of every partition (``read_topic``); ``to_end`` also
    ends it there at once, without the idle wait, and raises ``TopicReadIncomplete`` when
    the end is not reached in ``timeout_s`` instead of returning what was read."""
    views: dict[str, AdapterView] = {}
    for record in read_topic(settings, topic_name(settings, "registry"), timeout_s=timeout_s,
                             to_end=to_end):
        key = (record.key or b"").decode("utf-8", "replace")
        if record.value is None:
            views.pop(key, None)
            continue
        try:
            view = decode(AdapterView, record.value)
        except SchemaError as exc:
            log.warning("registry record at %s@%s skipped: %s", record.partition,
                        record.offset, exc)
            continue
        views[view.adapter_id] = view
    return views


def latest_registry_records(settings: Settings, timeout_s: float = 10.0) -> list[Record]:
    """The raw last record of every key of the whole registry topic (a tombstoned key's is
    the tombstone, value None), read once, for a ``loraplane.registry.live.VerifiedRegistry``
    outside a worker or the router (the scoring agent, the tests; a worker and the router hold
    ``registry_tail``). Raises ``TopicReadIncomplete`` (or a ``KafkaException``) unless the
    read reached the end of every partition: a broker that is away never reads as an empty
    registry."""
    latest: dict[bytes, Record] = {}
    for record in read_topic(settings, topic_name(settings, "registry"), timeout_s=timeout_s,
                             to_end=True):
        latest[record.key or b""] = record
    return list(latest.values())


def registry_tail(settings: Settings, component: str) -> TopicTail:
    """A started live tail of the registry topic (``kernel.topic_tail``): the worker's and
    the router's registry, current within the broker's delivery instead of a re-read."""
    return TopicTail(settings, topic_name(settings, "registry"),
                     component=f"{component}-registry").start()
