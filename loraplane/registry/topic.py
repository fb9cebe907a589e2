"""Reading the registry from its compacted topic: once (the CLI, the gateway, the planner)
or as a live tail (the worker agents and the router).

The topic holds one AdapterView per adapter_id (the latest wins); reading it from the start
gives the whole registry without talking to the Faust app. A consumer may hold only its base
models' views (``RegistryScope``): the registry agent writes each view with a ``base_model``
header (``view_headers``), which a scoped tail selects by without decoding other base
models' records. The header is never believed: a record of an adapter the consumer already
holds is kept and verified whatever it claims, so a header cannot hide a revoke, and a view
is held only when its signed ``base_model`` is in scope, so a header cannot add one. The
rules are in docs/lifecycle.md, "Per base model: who holds which views".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import msgspec

from loraplane.kernel.bus import Record, TopicReadIncomplete, latest_per_key, read_topic
from loraplane.kernel.config import Settings
from loraplane.kernel.topic_tail import TopicTail
from loraplane.kernel.topics import topic_name
from loraplane.schemas.codec import SchemaError, decode
from loraplane.schemas.registry import AdapterView

__all__ = [
    "BASE_MODEL_HEADER",
    "PREFETCH_KBYTES",
    "RegistryScope",
    "RegistryUnreadable",
    "base_model_of",
    "latest_registry_records",
    "load_registry",
    "registry_tail",
    "view_headers",
]

log = logging.getLogger(__name__)
BASE_MODEL_HEADER = "base_model"
# What a registry tail's consumer fetches ahead of its reader. librdkafka's 64 MB default
# is filled by a first read of a large registry: several times what a scoped tail keeps
# (docs/benchmarks.md, "Fleet scale"); 4 MB reads as fast.
PREFETCH_KBYTES = 4096


def view_headers(view: AdapterView) -> dict[str, bytes]:
    """The headers the registry agent writes a view with (``RegistryScope`` reads them)."""
    return {BASE_MODEL_HEADER: view.base_model.encode()}


class _BaseModelOnly(msgspec.Struct):
    base_model: str


_PEEK = msgspec.json.Decoder(_BaseModelOnly)


def base_model_of(record: Record) -> bytes | None:
    """The base model a registry record claims: its header, else (a record written before
    the header) the value's own ``base_model`` field; None when neither says."""
    named = record.headers.get(BASE_MODEL_HEADER)
    if named is not None or record.value is None:
        return named
    try:
        return _PEEK.decode(record.value).base_model.encode()
    except (msgspec.DecodeError, UnicodeEncodeError, RecursionError):
        # RecursionError: msgspec's answer to deep nesting (``{"a":`` x 50,000); whatever
        # the peek cannot read is kept, so the full decoder refuses and dead-letters it
        return None


def _holds_nothing(_adapter_id: str) -> bool:
    return False


class RegistryScope:
    """Which records of the registry topic a consumer's tail keeps: those of the base
    models it serves (``base_models``; None: every one, a tail without a filter) and every
    record of an adapter it holds a view of (``held_by``: its ``VerifiedRegistry``)."""

    def __init__(self, base_models: Iterable[str] | None = None) -> None:
        self.base_models = (
            None if base_models is None else frozenset(b.encode() for b in base_models)
        )
        self._holds: Callable[[str], bool] = _holds_nothing

    def held_by(self, holds: Callable[[str], bool]) -> None:
        self._holds = holds

    def serves(self, base_model: str) -> bool:
        """Whether a verified view of ``base_model`` is held (``VerifiedRegistry``)."""
        return self.base_models is None or base_model.encode() in self.base_models

    def keeps(self, record: Record) -> bool:
        """Whether a record of a key the tail keeps nothing for yet is kept (``TailView``'s
        ``select``): a tombstone only for an adapter held; a view when it is held or claims
        one of ``base_models`` or claims nothing readable."""
        if self.base_models is None:
            return True
        if self._holds((record.key or b"").decode("utf-8", "replace")):
            return True
        if record.value is None:
            return False
        named = base_model_of(record)
        return named is None or named in self.base_models


class RegistryUnreadable(TopicReadIncomplete):
    """The registry topic could not be read to its end: the broker is away or refused."""


def load_registry(
    settings: Settings, timeout_s: float = 10.0, to_end: bool = True
) -> dict[str, AdapterView]:
    """adapter_id -> its current view. Undecodable records, and views under another key than
    their adapter_id, are logged and skipped. The read ends once every partition reached
    its end; ``RegistryUnreadable`` when that did not happen in ``timeout_s``: a broker that
    is away never reads as an empty registry (which a command would print as "no adapters"
    or "not in the registry"). ``to_end=False``: what was read by then, for a caller to
    whom an empty registry is as good as none."""
    from confluent_kafka import KafkaException

    try:
        return _views(latest_registry_records(settings, timeout_s, to_end=to_end, quiet=True))
    except (TopicReadIncomplete, KafkaException) as exc:
        raise RegistryUnreadable(
            f"cannot read the registry from {settings.kafka.bootstrap}: {exc}"
        ) from None


def _views(records: Iterable[Record]) -> dict[str, AdapterView]:
    views: dict[str, AdapterView] = {}
    for record in records:
        key = (record.key or b"").decode("utf-8", "replace")
        if record.value is None:
            views.pop(key, None)
            continue
        try:
            view = decode(AdapterView, record.value)
        except SchemaError as exc:
            log.warning(
                "registry record at %s@%s skipped: %s", record.partition, record.offset, exc
            )
            continue
        if (record.key or b"") != view.adapter_id.encode():
            # never replaced or tombstoned by the adapter's own records: not its view
            log.warning(
                "registry record at %s@%s skipped: message key %r is not adapter_id %s",
                record.partition,
                record.offset,
                (record.key or b"")[:64],
                view.adapter_id,
            )
            continue
        views[view.adapter_id] = view
    return views


def latest_registry_records(
    settings: Settings, timeout_s: float = 10.0, *, to_end: bool = True, quiet: bool = False
) -> list[Record]:
    """The raw record that stands for every key of the whole registry topic
    (``bus.latest_per_key``; a tombstoned key's is the tombstone, value None), read once, for
    ``load_registry`` and a ``loraplane.registry.live.VerifiedRegistry`` outside a worker or
    the router (the scoring agent, the tests; a worker and the router hold
    ``registry_tail``). Raises ``TopicReadIncomplete`` (or a ``KafkaException``) unless the
    read reached the end of every partition: a broker that is away never reads as an empty
    registry. ``to_end=False``: what was read by then; ``quiet``: as ``read_topic``'s."""
    counts: dict[str, int] = {}
    read = read_topic(
        settings,
        topic_name(settings, "registry"),
        timeout_s=timeout_s,
        to_end=to_end,
        quiet=quiet,
        partition_counts=counts,
    )
    return list(latest_per_key(read, counts).values())


def registry_tail(
    settings: Settings, component: str, scope: RegistryScope | None = None, *, start: bool = True
) -> TopicTail:
    """A live tail of the registry topic (``kernel.topic_tail``): the worker's and the
    router's registry, current within the broker's delivery instead of a re-read. With a
    ``scope`` of some base models it keeps only theirs; ``start=False`` leaves starting it
    to the caller, once the ``VerifiedRegistry`` given the same scope exists (it then knows
    the adapters held from before a restart)."""
    select = None if scope is None or scope.base_models is None else scope.keeps
    tail = TopicTail(
        settings,
        topic_name(settings, "registry"),
        component=f"{component}-registry",
        select=select,
        prefetch_kbytes=PREFETCH_KBYTES,
    )
    return tail.start() if start else tail
