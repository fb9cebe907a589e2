"""The worker's copy of the registry: only views whose signed evidence it verified itself.

The registry topic is a transport, not an authority. Every refresh reads the last record of
each adapter and accepts it only through ``streams.registry_evidence.verify_view`` with the
worker's own keyring (``settings.keyring_path``, re-read when the file changes, as the
registry agent does). A refused record is dead-lettered once (reason
``RegistryViewRejection``), counted on ``/metrics`` (``registry_view_refused_total``) and
never turned into records: nothing it names is fetched, loaded or served.

- A refused newer record leaves the adapter at the last view this worker accepted, if that
  view still verifies under the current keyring (an attacker overwriting the topic freezes
  an adapter at best; a revoked key withdraws what it signed at the next refresh).
- A view older than, or forking from, the last one accepted for the adapter is refused
  (``view_rollback``); the checkpoints of accepted views are kept in a small JSON file in
  the host tier, so a restart does not forget them.
- Verdicts are cached per topic position and keyring, so a refresh re-verifies only what
  changed.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from loraplane.schemas.adapter import AdapterRecord
from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import SchemaError, decode
from loraplane.schemas.dead_letter import dead_letter_at
from loraplane.schemas.keyring import Keyring, KeyringError, KeyringFile
from loraplane.schemas.reasons import RegistryViewRejection as ViewReason
from loraplane.schemas.registry import AdapterView
from loraplane.streams.registry_evidence import Checkpoint, ViewRefused, verify_view
from loraplane.workers.event_sink import EventSink

from loraplane.kernel.bus import Record

log = logging.getLogger(__name__)
CHECKPOINTS_FILE = ".registry-checkpoints.json"  # not a lora name: the host-tier scan ignores it


@dataclass(frozen=True)
class _Verdict:
    view: AdapterView | None
    refused: ViewRefused | None


class VerifiedRegistry:
    """``records()`` is the worker agent's ``registry_loader``."""

    def __init__(self, keyring: KeyringFile, read: Callable[[], Iterable[Record]], *,
                 sink: EventSink, component: str, checkpoints_path: Path | None = None,
                 on_refused: Callable[[ViewReason], None] | None = None,
                 clock: Callable[[], datetime] = now_utc) -> None:
        self._keyring_file = keyring
        self._read = read
        self._sink = sink
        self._component = component
        self._path = checkpoints_path
        self._on_refused = on_refused or (lambda _r: None)
        self._clock = clock
        self.accepted: dict[str, AdapterView] = {}
        self.checkpoints: dict[str, Checkpoint] = self._load_checkpoints()
        self._cache: dict[tuple[int, int], _Verdict] = {}
        self._cache_keyring: Keyring | None = None
        self._reported: set[tuple[int, int, str]] = set()
        self.refused = 0

    # ---- the loader ---------------------------------------------------------------------
    def records(self) -> list[AdapterRecord]:
        self.refresh()
        return [r for view in self.accepted.values() for r in view.versions]

    def refresh(self) -> None:
        keyring = self._keyring()
        if keyring is not self._cache_keyring:  # a new keyring: every verdict is redone
            self._cache, self._cache_keyring = {}, keyring
            self.accepted = {aid: v for aid, v in self.accepted.items()
                             if not isinstance(self._verify(v, keyring, None), ViewRefused)}
        seen: set[str] = set()
        for record in self._read():
            verdict = self._cache.get((record.partition, record.offset))
            if verdict is None:
                verdict = self._judge(record, keyring)
                self._cache[(record.partition, record.offset)] = verdict
            if verdict.view is not None:
                seen.add(verdict.view.adapter_id)
                self._accept(verdict.view)
            elif verdict.refused is not None:
                self._report(record, verdict.refused)
                if (record.key or b"") and (aid := (record.key or b"").decode(
                        "utf-8", "replace")) in self.accepted:
                    seen.add(aid)  # keep the last view we verified of this adapter
        for aid in set(self.accepted) - seen:  # tombstoned: never serve it again from here
            del self.accepted[aid]

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
            return _Verdict(None, ViewRefused(
                ViewReason.malformed,
                f"message key {(record.key or b'')[:64]!r} is not adapter_id {view.adapter_id}"))
        verdict = self._verify(view, keyring, self.checkpoints.get(view.adapter_id))
        if isinstance(verdict, ViewRefused):
            return _Verdict(None, verdict)
        return _Verdict(view, None)

    def _verify(self, view: AdapterView, keyring: Keyring | None,
                previous: Checkpoint | None) -> ViewRefused | None:
        verdict = verify_view(view, keyring, self._clock(), previous)
        return verdict if isinstance(verdict, ViewRefused) else None

    def _accept(self, view: AdapterView) -> None:
        self.accepted[view.adapter_id] = view
        checkpoint = Checkpoint.of(view)
        if self.checkpoints.get(view.adapter_id) != checkpoint:
            self.checkpoints[view.adapter_id] = checkpoint
            self._save_checkpoints()

    def _report(self, record: Record, refused: ViewRefused) -> None:
        where = (record.partition, record.offset, str(refused.reason))
        if where in self._reported:
            return
        self._reported.add(where)
        self.refused += 1
        self._on_refused(refused.reason)
        log.warning("registry record %s@%s refused: %s: %s", record.partition, record.offset,
                    refused.reason, refused.detail)
        letter = dead_letter_at(record.topic, record.partition, record.offset, record.key,
                                record.value or b"", record.timestamp_ms / 1000,
                                self._component, refused.reason, refused.detail)
        self._sink.emit("dead-letters", (record.key or b"").decode("utf-8", "replace"), letter)

    # ---- checkpoints ----------------------------------------------------------------------
    def _load_checkpoints(self) -> dict[str, Checkpoint]:
        if self._path is None or not self._path.exists():
            return {}
        try:
            raw = json.loads(self._path.read_text())
            return {aid: Checkpoint(aid, int(c["last_seq"]), tuple(map(str, c["event_ids"])))
                    for aid, c in raw.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # Unreadable: start from nothing rather than refuse everything forever.
            log.error("registry checkpoints %s unreadable (%s); starting without", self._path,
                      exc)
            return {}

    def _save_checkpoints(self) -> None:
        if self._path is None:
            return
        body = json.dumps({aid: {"last_seq": c.last_seq, "event_ids": list(c.event_ids)}
                           for aid, c in sorted(self.checkpoints.items())})
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_name(f".{self._path.name}.tmp")
        tmp.write_text(body)
        os.replace(tmp, self._path)
