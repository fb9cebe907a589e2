"""Which request logs may hold a score key. Pure: the scoring keeper asks it per log, with
the registry it verified itself (``loraplane.registry.live``), and asks it which keys to
tombstone when the registry changes.

Why: a request log is written for any pattern-valid id a tenant sends, and a score key is
state on a compacted topic and in every scoring and planning process; keyed by whatever
arrived, one tenant with a valid API key would grow it without bound. So only a version the
registry lists as live (published, canary, active) gets a key, plus its adapter's
unattributed demand (``adapter@*``) while the adapter has a live version; everything else is
counted in the unknown bucket of its partition, and a version leaving the live set has its
key tombstoned. A worker serves a version only once its own registry copy lists it, so a
served log never precedes its view on the topic. docs/planner.md, "Bounded state".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from loraplane.schemas.adapter import AdapterRecord, AdapterStatus
from loraplane.schemas.request_log import RequestStatus
from loraplane.schemas.score_snapshot import is_unknown_key
from loraplane.streams.scores import score_key

__all__ = ["LIVE", "NOBODY", "Known", "score_key_of", "stale_keys"]

LIVE = frozenset({AdapterStatus.published, AdapterStatus.canary, AdapterStatus.active})
"""Statuses whose demand is scored: a retired version may come back only through a signed
rollback, and then scores from that moment on."""


@dataclass(frozen=True)
class Known:
    """The live versions of the registry, adapter id -> versions. Immutable: the agent swaps
    a new one in when the registry changes."""

    versions: Mapping[str, frozenset[str]]

    @classmethod
    def from_records(cls, records: Iterable[AdapterRecord]) -> Known:
        live: dict[str, set[str]] = {}
        for r in records:
            if r.status in LIVE:
                live.setdefault(r.adapter_id, set()).add(r.version)
        return cls({aid: frozenset(vs) for aid, vs in live.items()})

    def admits(self, adapter_id: str, version: str | None) -> bool:
        """Whether demand for ``(adapter_id, version)`` may hold a score key; ``None`` is the
        adapter's unattributed demand, kept while the adapter has a live version."""
        live = self.versions.get(adapter_id)
        return live is not None and (version is None or version in live)

    def key_of(self, adapter_id: str, version: str | None, status: RequestStatus) -> str | None:
        """The score key a request log folds into, or None: it counts as unknown."""
        if status is RequestStatus.refused or not self.admits(adapter_id, version):
            return None
        return score_key(adapter_id, version)

    def holds(self, key: str) -> bool:
        """Whether an existing score key is still backed by the registry."""
        adapter_id, at, version = key.rpartition("@")
        return bool(at) and self.admits(adapter_id, None if version == "*" else version)


NOBODY = Known({})


def score_key_of(raw: bytes | None) -> str | None:
    """A scores record's Kafka key as its score key, or None when it is not UTF-8 text: no
    keeper writes such a key (score keys are made of adapter ids), and decoded with
    replacement it would name another key (two keys would share a state, and the keeper's
    tombstone of the text would go to other bytes than the record's: it stayed forever).
    Its readers refuse such a record; the keeper tombstones it under its own bytes."""
    try:
        return (raw or b"").decode("utf-8")
    except UnicodeDecodeError:
        return None


def stale_keys(known: Known, keys: Iterable[str]) -> list[str]:
    """The score keys to tombstone: every one the registry no longer backs (a retired or
    revoked version, an adapter gone or withdrawn), in order; never the unknown bucket."""
    return [k for k in keys if not is_unknown_key(k) and not known.holds(k)]
