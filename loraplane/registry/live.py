"""A consumer's copy of the registry: only views whose signed evidence it verified itself.

Shared by the runtimes that read the registry topic (the worker agent, the fleet router,
the scoring keepers, the planner): it sits beside them, so none imports another. The topic
is a transport, not an authority: the last record of each adapter (from the process's live
tail, ``kernel.topic_tail``) is accepted only through ``registry.evidence.verify_view`` with
the process's own keyring. A refused record is dead-lettered once
(``RegistryViewRejection``), counted (``loraplane_registry_view_refused_total``) and never
turned into records. A refused newer record leaves the adapter at the last view accepted
(if it still verifies), a view older than or forking from that one is refused
(``view_rollback``), and a read is merged into what was accepted, never swapped in whole,
so serving does not depend on Kafka. Checkpoints and the accepted views are kept in the host
tier and re-verified on a restart. An accepted view is held beside the signed bytes it was
accepted from, without its decoded evidence, and a consumer given a
``registry.topic.RegistryScope`` holds only its base models' adapters. A record that is no
accepted view goes back to its tail (``Source``: held within bounds, re-read on a new
keyring). docs/worker.md, "Host warm tier and artifact verification", and
docs/lifecycle.md give the rules.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pydantic import BaseModel

from loraplane.kernel.atomic_file import write_atomic
from loraplane.kernel.bus import Record
from loraplane.kernel.local_files import read_regular
from loraplane.registry.evidence import Checkpoint, ViewRefused, verify_view
from loraplane.schemas.adapter import AdapterRecord
from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import SchemaError, decode, encode
from loraplane.schemas.dead_letter import dead_letter_at
from loraplane.schemas.keyring import Keyring, KeyringError, KeyringFile
from loraplane.schemas.reasons import RegistryViewRejection as ViewReason
from loraplane.schemas.registry import (
    MAX_VIEWS_BYTES,
    AdapterView,
    signed_views_json,
    views_from_json,
)
from loraplane.schemas.strict_json import strict_loads

if TYPE_CHECKING:
    from loraplane.registry.topic import RegistryScope

__all__ = ["CHECKPOINTS_FILE", "EventSink", "Source", "VerifiedRegistry", "newer"]

log = logging.getLogger(__name__)
CHECKPOINTS_FILE = ".registry-checkpoints.json"  # not a lora name: the host-tier scan ignores it


class EventSink(Protocol):
    """Where refused records go (``eventlog.sink.EventSink`` is one)."""

    def emit(self, topic_suffix: str, key: str, message: BaseModel) -> None: ...


class Source(Protocol):
    """The tail the records come from (``kernel.topic_tail.TopicTail``), told which of its
    records are no accepted view and when the keyring changed."""

    def refuse(self, record: Record) -> None: ...

    def rewind(self) -> bool: ...


def newer(incoming: AdapterView | Checkpoint, current: AdapterView | Checkpoint | None) -> bool:
    """Whether ``incoming`` replaces ``current`` for its adapter (a view, or its
    checkpoint): the view's own order, its highest accepted seq and then how many signed
    events it carries (a revoke may land below ``last_seq`` but always adds an event).
    Equal is not newer."""
    if current is None:
        return True
    return _order(incoming) > _order(current)


def _order(view: AdapterView | Checkpoint) -> tuple[int, int]:
    if isinstance(view, Checkpoint):
        return view.last_seq, len(view.event_ids)
    return view.last_seq, len(view.evidence)


@dataclass(frozen=True)
class _Verdict:
    view: AdapterView | None  # verified, without its evidence
    refused: ViewRefused | None
    signed: bytes = b""  # the view's canonical bytes, evidence included
    checkpoint: Checkpoint | None = None


def _held(view: AdapterView, raw: bytes) -> _Verdict:
    """The verdict of a verified ``view``: kept without its decoded evidence (most of a
    decoded view's memory), beside its canonical bytes: ``raw`` itself when it is them."""
    canonical = encode(view)
    return _Verdict(
        view.model_copy(update={"evidence": []}),
        None,
        raw if raw == canonical else canonical,
        Checkpoint.from_view(view),
    )


class VerifiedRegistry:
    """``records()`` is the worker agent's ``registry_loader``."""

    def __init__(
        self,
        keyring: KeyringFile,
        read: Callable[[], Iterable[Record]],
        *,
        sink: EventSink,
        component: str,
        checkpoints_path: Path | None = None,
        views_path: Path | None = None,
        on_refused: Callable[[ViewReason], None] | None = None,
        on_read_failed: Callable[[], None] | None = None,
        clock: Callable[[], datetime] = now_utc,
        version: Callable[[], int] | None = None,
        scope: RegistryScope | None = None,
        source: Source | None = None,
    ) -> None:
        """``version``: the source's change counter (``TopicTail.version``); with it a
        refresh reads only after a change (or a new keyring), without it every time.
        ``scope``: the source tail's (``registry.topic.RegistryScope``), told which
        adapters this registry holds once the saved views are loaded: start the tail
        after this. A verified view of a base model outside the scope is not held, whatever
        header brought it in. ``source``: the tail behind ``read``, told the records that
        are no accepted view (held within its bounds) and re-read on a new keyring."""
        self._keyring_file = keyring
        self._source = source
        self._read = read
        self._version = version
        self._read_version: int | None = None
        self._sink = sink
        self._component = component
        self._path = checkpoints_path
        self._views_path = views_path
        self._on_refused = on_refused or (lambda _r: None)
        self._on_read_failed = on_read_failed or (lambda: None)
        self._clock = clock
        self._serves: Callable[[str], bool] = (lambda _b: True) if scope is None else (scope.serves)
        self.checkpoints: dict[str, Checkpoint] = self._load_checkpoints()
        self._checkpoints_dirty = False
        self._cache: dict[tuple[int, int], _Verdict] = {}
        self._cache_keyring: Keyring | None = None
        self._reported: set[tuple[int, int, str]] = set()
        self.refused = 0
        self.read_failures = 0
        self.signed: dict[str, bytes] = {}  # adapter_id -> its accepted view's bytes
        self.accepted: dict[str, AdapterView] = self._load_views()  # without evidence
        self.changes = 0
        """Bumped whenever ``accepted`` changes (a view taken in or withdrawn): what is
        derived from the accepted views is rebuilt when it moves, not on every record
        the tail reads (a refused one, another base model's)."""
        if scope is not None:
            scope.held_by(self.holds)

    def holds(self, adapter_id: str) -> bool:
        """Whether a view of ``adapter_id`` is accepted (safe from the tail's thread)."""
        return adapter_id in self.accepted

    # ---- the loader ---------------------------------------------------------------------
    def records(self) -> list[AdapterRecord]:
        """Every version of every accepted view, after a refresh; a refresh that could not
        read the topic serves the last good views (never raises for a broker away)."""
        try:
            self.refresh()
        except Exception as exc:  # KafkaException, TopicReadIncomplete, OSError, ...
            self.read_failures += 1
            self._on_read_failed()
            log.warning(
                "registry read failed (%d so far); serving the %d views accepted before: %s",
                self.read_failures,
                len(self.accepted),
                exc,
            )
        return [r for view in self.accepted.values() for r in view.versions]

    def refresh(self) -> None:
        """Merge one read of the topic into the accepted views. The keyring is applied
        first, so a revoked key takes effect even when the read then fails."""
        keyring = self._keyring()
        new_keyring = keyring is not self._cache_keyring
        changed = self._apply_keyring(keyring)
        version = None if self._version is None else self._version()
        if version is not None and version == self._read_version and not new_keyring:
            if self._checkpoints_dirty:  # a write that failed before
                self._save_checkpoints()
            if changed:
                self._save_views()
            return
        self._read_version = version  # a failed read is not retried until the source moves
        read: set[tuple[int, int]] = set()
        try:
            for record in self._read():
                read.add((record.partition, record.offset))
                changed |= self._merge(record, keyring)
            # The verdicts of records no longer in the source go, and so does the memory of
            # having reported them: both stay the size of the topic's present, not of every
            # record ever read (a writer overwriting one key with junk would grow them).
            for gone in self._cache.keys() - read:
                del self._cache[gone]
            self._reported = {w for w in self._reported if (w[0], w[1]) in read}
        finally:
            # Once per read, not once per accepted view: a first read of N views wrote the
            # whole checkpoints file (and fsynced it) N times, quadratic in the registry.
            if self._checkpoints_dirty:
                self._save_checkpoints()
            if changed:
                self._save_views()

    def _apply_keyring(self, keyring: Keyring | None) -> bool:
        """On a new keyring every verdict is redone and accepted views that no longer
        verify are withdrawn; True when that withdrew any."""
        if keyring is self._cache_keyring:
            return False
        if self._source is not None and self._cache_keyring is not None:
            self._source.rewind()  # what it forgot may verify now
        self._cache, self._cache_keyring = {}, keyring
        withdrawn = [
            aid
            for aid in self.accepted
            if self._verify(decode(AdapterView, self.signed[aid]), keyring, None) is not None
        ]
        for aid in withdrawn:
            del self.accepted[aid], self.signed[aid]
        self.changes += len(withdrawn)
        return bool(withdrawn)

    def _merge(self, record: Record, keyring: Keyring | None) -> bool:
        """One record into the accepted views; True when they changed. A refused record
        leaves its adapter at the view accepted before."""
        if record.value is None:
            # A tombstone is no signed event: the registry never deletes an adapter, and a
            # held view leaves only by signed events (retire, revoke) or the keyring. Anyone
            # who can write the topic can write one, so it withdraws nothing.
            aid = (record.key or b"").decode("utf-8", "replace")
            if aid in self.accepted:
                self._report(
                    record,
                    ViewRefused(
                        ViewReason.tombstone,
                        f"a tombstone over {aid[:128]!r}: the registry never deletes an "
                        f"adapter; its verified view stays (revoke its versions to end it)",
                    ),
                )
            else:
                self._forget(record)  # nothing to withdraw: no view to hold it for
            return False
        verdict = self._cache.get((record.partition, record.offset))
        if verdict is None:
            verdict = self._judge(record, keyring)
            self._cache[(record.partition, record.offset)] = verdict
        if verdict.refused is not None:
            self._report(record, verdict.refused)
            self._forget(record)
            return False
        if (
            verdict.view is None
            or verdict.checkpoint is None
            or not self._serves(verdict.view.base_model)
        ):
            self._forget(record)  # a genuine view of another base model: not this consumer's
            return False
        aid = verdict.view.adapter_id
        held = self.checkpoints.get(aid) if aid in self.accepted else None
        if not newer(verdict.checkpoint, held):
            if verdict.signed == self.signed.get(aid):
                self.signed[aid] = verdict.signed  # one copy of the bytes, the tail's
            return False
        self._accept(verdict)
        return True

    def _forget(self, record: Record) -> None:
        """``record`` is no accepted view: its tail holds it only within its bounds."""
        if self._source is not None:
            self._source.refuse(record)

    # ---- deciding -------------------------------------------------------------------------
    def _keyring(self) -> Keyring | None:
        try:
            return self._keyring_file.current()
        except KeyringError as exc:
            log.error("keyring unavailable, refusing every registry view: %s", exc)
            return None

    def _judge(self, record: Record, keyring: Keyring | None) -> _Verdict:
        try:
            view = decode(AdapterView, record.value or b"")
        except SchemaError as exc:
            return _Verdict(None, ViewRefused(ViewReason.malformed, str(exc)[:2048]))
        if (record.key or b"") != view.adapter_id.encode():
            return _Verdict(
                None,
                ViewRefused(
                    ViewReason.malformed,
                    f"message key {(record.key or b'')[:64]!r} is not adapter_id {view.adapter_id}",
                ),
            )
        verdict = self._verify(view, keyring, self.checkpoints.get(view.adapter_id))
        if isinstance(verdict, ViewRefused):
            return _Verdict(None, verdict)
        return _held(view, record.value or b"")

    def _verify(
        self, view: AdapterView, keyring: Keyring | None, previous: Checkpoint | None
    ) -> ViewRefused | None:
        verdict = verify_view(view, keyring, self._clock(), previous)
        return verdict if isinstance(verdict, ViewRefused) else None

    def _accept(self, verdict: _Verdict) -> None:
        assert verdict.view is not None and verdict.checkpoint is not None
        aid = verdict.view.adapter_id
        if self.signed.get(aid) != verdict.signed:
            self.changes += 1
        self.accepted[aid] = verdict.view
        self.signed[aid] = verdict.signed
        if self.checkpoints.get(aid) != verdict.checkpoint:
            self.checkpoints[aid] = verdict.checkpoint
            self._checkpoints_dirty = True  # saved by ``refresh``, before the views

    def _report(self, record: Record, refused: ViewRefused) -> None:
        where = (record.partition, record.offset, str(refused.reason))
        if where in self._reported:
            return
        self._reported.add(where)
        self.refused += 1
        self._on_refused(refused.reason)
        log.warning(
            "registry record %s@%s refused: %s: %s",
            record.partition,
            record.offset,
            refused.reason,
            refused.detail,
        )
        letter = dead_letter_at(
            record.topic,
            record.partition,
            record.offset,
            record.key,
            record.value or b"",
            record.timestamp_ms / 1000,
            self._component,
            refused.reason,
            refused.detail,
        )
        self._sink.emit("dead-letters", (record.key or b"").decode("utf-8", "replace"), letter)

    # ---- checkpoints ----------------------------------------------------------------------
    def _load_checkpoints(self) -> dict[str, Checkpoint]:
        if self._path is None or not self._path.exists():
            return {}
        try:
            # Bounded and strict: nesting past the recursion limit is unreadable too.
            raw = strict_loads(read_regular(self._path, MAX_VIEWS_BYTES), max_bytes=MAX_VIEWS_BYTES)
            return {
                aid: Checkpoint(aid, int(c["last_seq"]), tuple(map(str, c["event_ids"])))
                for aid, c in raw.items()
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # Unreadable: start from nothing rather than refuse everything forever.
            log.error("registry checkpoints %s unreadable (%s); starting without", self._path, exc)
            return {}

    def _save_checkpoints(self) -> None:
        """Logged, never raised, when the write fails (a full disk, a folder at the path):
        the checkpoints stay due, so the next ``refresh`` writes them even with no news."""
        if self._path is None:
            self._checkpoints_dirty = False
            return
        try:
            write_atomic(
                self._path,
                json.dumps(
                    {
                        aid: {"last_seq": c.last_seq, "event_ids": list(c.event_ids)}
                        for aid, c in sorted(self.checkpoints.items())
                    }
                ),
            )
        except OSError as exc:
            log.error("registry checkpoints not saved to %s: %s", self._path, exc)
            return
        self._checkpoints_dirty = False

    # ---- the last verified views ------------------------------------------------------------
    def _save_views(self) -> None:
        """After the checkpoints (``refresh``): a crash in between leaves a file older than
        its checkpoints, whose views are then refused on load, never a newer one."""
        if self._views_path is None:
            return
        try:
            write_atomic(self._views_path, signed_views_json(self.signed))
        except OSError as exc:  # a full disk must not stop serving what we have
            log.error("registry views not saved to %s: %s", self._views_path, exc)

    def _load_views(self) -> dict[str, AdapterView]:
        """The views saved before a restart that still verify with the keyring now and do
        not go back from the checkpoints; none without a keyring (fail closed)."""
        if self._views_path is None or not self._views_path.exists():
            return {}
        try:
            saved = views_from_json(read_regular(self._views_path, MAX_VIEWS_BYTES))
        except (OSError, ValueError) as exc:
            log.error(
                "registry views %s unreadable (%s); starting without",
                self._views_path,
                str(exc)[:200],
            )
            return {}
        keyring = self._keyring()
        views: dict[str, AdapterView] = {}
        for aid, view in saved.items():
            if not self._serves(view.base_model):  # saved under another scope
                continue
            refused = self._verify(view, keyring, self.checkpoints.get(aid))
            if refused is not None:
                log.warning(
                    "saved registry view of %s not used: %s: %s",
                    aid,
                    refused.reason,
                    refused.detail[:200],
                )
                continue
            held = _held(view, b"")
            assert held.view is not None and held.checkpoint is not None
            views[aid], self.signed[aid] = held.view, held.signed
            # it extends the checkpoint it verified against: it is the one held now
            if self.checkpoints.get(aid) != held.checkpoint:
                self.checkpoints[aid] = held.checkpoint
                self._checkpoints_dirty = True
        log.info(
            "registry: %d of %d saved views verified, serving them until Kafka answers",
            len(views),
            len(saved),
        )
        return views
