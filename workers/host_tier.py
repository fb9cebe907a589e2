"""The host warm tier: verified adapter folders on local disk, within a byte budget.

One folder per entry, named by lora name, so a name always means the same bytes: its
``adapter/`` (the folder handed to vLLM) and ``record.json`` (the record it was verified
against). An install downloads into a ``.partial-*`` folder, verifies it and renames it into
place, so an entry either exists complete and verified or not at all; the startup scan
deletes partial folders and re-verifies every entry, dropping any that fails (an entry is
never trusted just because it is on disk), and one whose files changed on disk since they
were verified (``fingerprint``) is installed again, never handed out. ENOSPC refuses the
install as ``host_disk_full``, retried after the agent's backoff. Installs are not fsynced:
what a power loss tears is dropped by that scan and fetched again, and an fsync of every
file would cost ~20% of an install. docs/worker.md, "Host warm tier and artifact verification".

Thread-safe; concurrent ``ensure()`` of one adapter does the work once (single flight); a
concurrent ``ensure()`` of another digest of the name waits for it, then installs its own.
From asyncio, call it through ``asyncio.to_thread``.
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from loraplane.artifact.directory import MAX_ENTRIES, DirectoryArtifact
from loraplane.artifact.model_signing_bundle import SignatureCheck
from loraplane.artifact.refusal import ArtifactError, Refusal
from loraplane.artifact.verification import (
    MANIFEST_NAME,
    MAX_JSON_FILE_BYTES,
    WorkerLimits,
    verify_artifact,
)
from loraplane.kernel.atomic_file import write_atomic
from loraplane.kernel.local_files import read_regular
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus
from loraplane.schemas.base import LORA_NAME_RE
from loraplane.schemas.manifest import Manifest
from loraplane.schemas.reasons import ArtifactReason as Reason
from loraplane.workers.artifact_fetch import FetchedArtifact
from loraplane.workers.host_tier_entry import (
    ADAPTER_DIR,
    MAX_RECORD_BYTES,
    RECORD_FILE,
    entry_record,
)

__all__ = [
    "CheckSignature",
    "Fetcher",
    "Fingerprint",
    "HostTier",
    "ScanReport",
    "TierEntry",
    "fingerprint",
]

log = logging.getLogger("loraplane.host_tier")

_PARTIAL = ".partial-"
_REMOVING = ".removing-"


class CheckSignature(Protocol):
    """Raises ArtifactError unless the verified folder's model-signing bundle (or its
    absence) is acceptable for ``record`` (loraplane.artifact.model_signing_bundle)."""

    def __call__(self, folder: Path, manifest: Manifest, record: AdapterRecord) -> None: ...


class Fetcher(Protocol):
    def fetch(
        self,
        artifact_uri: str,
        dest: Path,
        *,
        expected_sha256: str | None,
        max_total_bytes: int,
        owner: AdapterRecord | None,
    ) -> FetchedArtifact: ...

    def stop(self) -> None:
        """End the downloads in flight at their next chunk, and refuse later ones."""


Fingerprint = tuple[tuple[str, int, int, int, int], ...]
"""An adapter folder's entries as (name, inode, size, mtime_ns, ctime_ns), links not
followed: a write, a rename over a file, an added or removed name changes it, and no
process short of root can set a ctime back."""


def fingerprint(adapter: Path) -> Fingerprint | None:
    """The fingerprint of ``adapter`` (never through a link to it), or None when it cannot
    be taken: a link, no folder, unreadable, or more names than an artifact may have."""
    try:
        fd = os.open(adapter, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        with os.scandir(fd) as listing:
            names = list(itertools.islice(listing, MAX_ENTRIES + 1))
        if len(names) > MAX_ENTRIES:
            return None
        facts = []
        for name in names:
            st = os.stat(name.name, dir_fd=fd, follow_symlinks=False)
            facts.append((name.name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    except OSError:
        return None
    finally:
        os.close(fd)
    return tuple(sorted(facts))


def _intact(entry: TierEntry) -> bool:
    """Is an entry's ``adapter/`` still the folder the tier verified: a real directory,
    neither it nor its entry folder a link (one could point at bytes nobody verified), and
    every file in it as it was when verified (one changed since holds unverified bytes)?"""
    try:
        if entry.path.parent.is_symlink():
            return False
    except OSError:  # unreadable now: install it again, which reports the disk's error
        return False
    return entry.fingerprint is not None and fingerprint(entry.path) == entry.fingerprint


@dataclass(frozen=True)
class TierEntry:
    lora_name: str
    path: Path  # the adapter folder vLLM loads
    record: AdapterRecord
    size_bytes: int
    last_used: float  # epoch seconds (``HostTier._now``); persisted as the folder's mtime
    fingerprint: Fingerprint | None = None  # taken as it was verified; None: never intact

    @property
    def sha256(self) -> str:
        return self.record.sha256

    def intact(self) -> bool:
        """Is its folder still what was verified (``_intact``)? Reads the disk."""
        return _intact(self)


@dataclass(frozen=True)
class ScanReport:
    kept: tuple[str, ...]
    dropped: tuple[tuple[str, str], ...]  # (folder name, why)


class HostTier:
    """``score(entry)`` ranks eviction candidates (lowest goes first, ties by least recent
    use; default: plain LRU). ``is_protected(lora_name)`` marks entries that must stay, e.g.
    those vLLM has registered and may re-read from disk. ``on_evict`` hears every entry
    removed to make room. ``check_signature`` runs on every verified folder, installs and
    the startup scan alike (default: no keyring, so a record naming a model-signing bundle
    is refused; the worker passes its keyring's)."""

    def __init__(
        self,
        root: Path,
        *,
        budget_bytes: int,
        limits: WorkerLimits,
        fetcher: Fetcher,
        score: Callable[[TierEntry], float] | None = None,
        is_protected: Callable[[str], bool] = lambda _name: False,
        on_evict: Callable[[TierEntry], None] | None = None,
        check_signature: CheckSignature | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self.limits = limits
        self._fetcher = fetcher
        self._score = score or (lambda _entry: 0.0)
        self._is_protected = is_protected
        self._on_evict = on_evict
        self._check_signature = check_signature or SignatureCheck(lambda: None)
        self._clock = clock
        self._latest = 0.0  # the latest use recorded (``_now``)
        self._lock = threading.Lock()
        self._entries: dict[str, TierEntry] = {}
        self._inflight: dict[str, tuple[str, Future[Path]]] = {}  # name -> (digest, install)
        root.mkdir(parents=True, exist_ok=True)
        disk = shutil.disk_usage(root).total
        if budget_bytes > disk:  # allowed (a disk may grow), but it will fill up first
            log.warning(
                "host tier budget %d bytes is larger than its disk (%d bytes): "
                "installs will fail as host_disk_full before the budget evicts",
                budget_bytes,
                disk,
            )
        self.startup_report = self._scan()

    # ---- reading ---------------------------------------------------------------------
    def entries(self) -> list[TierEntry]:
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e.last_used, reverse=True)

    def get(self, lora_name: str) -> TierEntry | None:
        with self._lock:
            return self._entries.get(lora_name)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(e.size_bytes for e in self._entries.values())

    def touch(self, lora_name: str) -> None:
        """Mark an entry used now (it moves to the back of the eviction queue)."""
        with self._lock:
            entry = self._entries.get(lora_name)
            if entry is not None:
                self._entries[lora_name] = self._mark_used(entry)

    # ---- changing --------------------------------------------------------------------
    def stop_fetches(self) -> None:
        """The worker is stopping: the downloads in flight end at their next chunk (an
        install in flight then removes its ``.partial-`` folder, as any failed one does),
        and every later install that needs a download fails at once. Entries already in
        the tier are left as they are."""
        self._fetcher.stop()

    def ensure(self, record: AdapterRecord) -> Path:
        """The verified folder of ``record``, fetching and installing it when absent.
        Raises ArtifactError with every reason when it is refused or cannot be fetched."""
        if record.status == AdapterStatus.revoked:
            raise ArtifactError.single(Reason.adapter_revoked, record.lora_name)
        name = record.lora_name
        while True:
            with self._lock:
                entry = self._entries.get(name)
                if entry is not None and entry.sha256 == record.sha256 and _intact(entry):
                    return self._mark_used(entry).path
                if self._entries.pop(name, None) is not None:  # its place is cleared on install
                    log.warning(
                        "host tier entry %s is gone, linked away, changed or of another digest "
                        "than its record now pins: installing it again",
                        name,
                    )
                ongoing = self._inflight.get(name)
                if ongoing is None:
                    flight: Future[Path] = Future()
                    self._inflight[name] = (record.sha256, flight)
                    break
            digest, other = ongoing
            if digest == record.sha256:  # the same install: its outcome is ours
                return other.result()
            # An install of another digest of the name (the registry's record changed
            # meanwhile): never its folder; look again once it is done.
            other.exception()
        try:
            path = self._install(record)
        except BaseException as exc:
            self._landed(name)
            flight.set_exception(exc)
            raise
        self._landed(name)
        flight.set_result(path)
        return path

    def _landed(self, name: str) -> None:
        """An install is done: a waiter that looks again finds no flight of it."""
        with self._lock:
            del self._inflight[name]

    def remove(self, lora_name: str) -> bool:
        """Delete an entry (planner demote/evict, revoke). False when there was none."""
        with self._lock:
            entry = self._entries.pop(lora_name, None)
            if entry is not None:
                self._delete(entry.path.parent)
        return entry is not None

    # ---- internals -------------------------------------------------------------------
    def _now(self) -> float:
        """The time of a use (lock held): the wall clock, persisted as an entry folder's
        mtime so the order survives a restart, but always after every use already recorded,
        so a clock stepped back (NTP, an operator) cannot rank the newest use oldest and
        evict it first."""
        self._latest = max(self._clock(), math.nextafter(self._latest, math.inf))
        return self._latest

    def _mark_used(self, entry: TierEntry) -> TierEntry:
        now = self._now()
        # Best effort: the mtime only orders evictions after a restart. Removed under us (the
        # next look finds it gone), a disk remounted read-only, another owner: still usable.
        with suppress(OSError):
            os.utime(entry.path.parent, (now, now))
        self._entries[entry.lora_name] = entry = replace(entry, last_used=now)
        return entry

    def _install(self, record: AdapterRecord) -> Path:
        if record.size_bytes > self.budget_bytes:
            raise ArtifactError.single(
                Reason.host_budget_exceeded,
                record.lora_name,
                f"{record.size_bytes} bytes > budget {self.budget_bytes}",
            )
        partial = self.root / f"{_PARTIAL}{uuid.uuid4().hex}"
        try:
            partial.mkdir()  # inside: a full disk can refuse even the folder
            fetched = self._fetcher.fetch(
                record.artifact_uri,
                partial / ADAPTER_DIR,
                expected_sha256=record.sha256,
                max_total_bytes=self.limits.max_total_bytes,
                owner=record,
            )
            # Before verification reads them: a file changed during it shows at the next
            # ``ensure``; the rename below leaves the files alone (a move of a grandparent).
            written = fingerprint(fetched.root)
            verdict = verify_artifact(
                DirectoryArtifact(fetched.root, fetched.digests), self.limits, record
            )
            if not verdict.ok:
                raise ArtifactError(verdict.refusals)
            self._check_signature(fetched.root, fetched.manifest, record)
            write_atomic(partial / RECORD_FILE, record.model_dump_json())
            with self._lock:
                evicted = self._make_room(fetched.bytes, incoming=record.lora_name)
                final = self.root / record.lora_name
                if os.path.lexists(final):  # no entry holds it: torn, or a file or link put there
                    self._delete(final)
                os.rename(partial, final)
                entry = TierEntry(
                    record.lora_name,
                    final / ADAPTER_DIR,
                    record,
                    fetched.bytes,
                    self._now(),
                    written,
                )
                self._entries[entry.lora_name] = entry
        except OSError as exc:
            shutil.rmtree(partial, ignore_errors=True)
            raise self._disk_error(exc, record) from exc
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        for gone in evicted:
            log.info("host tier evicted %s (%d bytes)", gone.lora_name, gone.size_bytes)
            if self._on_evict is not None:
                self._on_evict(gone)
        return entry.path

    def _disk_error(self, exc: OSError, record: AdapterRecord) -> ArtifactError:
        """The refusal for a local disk error (the partial install already removed): a
        full disk says how much room there is, so ops can tell it from a budget problem."""
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            return ArtifactError.single(
                Reason.host_io_error, record.lora_name, f"{type(exc).__name__}: {exc.strerror}"
            )
        try:
            free = f"{shutil.disk_usage(self.root).free} bytes free"
        except OSError:
            free = "free space unknown"
        detail = (
            f"{exc.strerror}: needs {record.size_bytes} bytes, {free} on the disk "
            f"({self.used_bytes} of the {self.budget_bytes}-byte budget in use)"
        )
        log.warning("host tier cannot install %s: %s", record.lora_name, detail)
        return ArtifactError.single(Reason.host_disk_full, record.lora_name, detail)

    def _make_room(self, incoming_bytes: int, incoming: str) -> list[TierEntry]:
        """Evict (lock held) until ``incoming_bytes`` fit; all or nothing."""
        used = sum(e.size_bytes for e in self._entries.values())
        candidates = sorted(
            (e for e in self._entries.values() if e.lora_name != incoming),
            key=lambda e: (self._score(e), e.last_used),
        )
        plan: list[TierEntry] = []
        for entry in candidates:
            if used + incoming_bytes <= self.budget_bytes:
                break
            if self._is_protected(entry.lora_name):
                continue
            plan.append(entry)
            used -= entry.size_bytes
        if used + incoming_bytes > self.budget_bytes:
            raise ArtifactError(
                [
                    Refusal(
                        Reason.host_budget_exceeded,
                        incoming,
                        f"needs {incoming_bytes} bytes; {self.budget_bytes - used} free after "
                        "evicting every unprotected entry",
                    )
                ]
            )
        for entry in plan:
            del self._entries[entry.lora_name]
            self._delete(entry.path.parent)
        return plan

    def _delete(self, folder: Path) -> None:
        """Rename first (atomic: the entry is gone at once), then delete at leisure."""
        if folder.is_symlink() or not folder.is_dir():
            folder.unlink(missing_ok=True)
            return
        doomed = self.root / f"{_REMOVING}{uuid.uuid4().hex}"
        try:
            os.rename(folder, doomed)
        except FileNotFoundError:
            return
        shutil.rmtree(doomed, ignore_errors=True)

    def _scan(self) -> ScanReport:
        kept: list[str] = []
        dropped: list[tuple[str, str]] = []
        for child in sorted(self.root.iterdir()):
            name = child.name
            if name.startswith((_PARTIAL, _REMOVING)):
                shutil.rmtree(child, ignore_errors=True)
                dropped.append((name, "partial"))
            elif LORA_NAME_RE.fullmatch(name):
                why = (
                    self._adopt(child)
                    if child.is_dir() and not child.is_symlink()
                    else "not_a_folder"
                )
                if why:
                    self._delete(child)
                    dropped.append((name, why))
                else:
                    kept.append(name)
        with self._lock:
            for entry in self._make_room(0, incoming=""):
                dropped.append((entry.lora_name, "over_budget"))
        for name, why in dropped:
            log.info("host tier dropped %s at startup: %s", name, why)
        return ScanReport(tuple(n for n in kept if n in self._entries), tuple(dropped))

    def _adopt(self, folder: Path) -> str:
        """Re-verify one entry left by an earlier run; '' when adopted, else why not."""
        try:
            raw = read_regular(folder / RECORD_FILE, MAX_RECORD_BYTES, follow_links=False)
            record = entry_record(raw, folder.name)
        except OSError:
            return "record_unreadable"
        if isinstance(record, str):
            return record
        artifact = DirectoryArtifact(folder / ADAPTER_DIR)
        seen = fingerprint(folder / ADAPTER_DIR)  # before the hash: a change during it shows
        try:
            verdict = verify_artifact(artifact, self.limits, record)
        except OSError as exc:
            return f"unreadable: {exc.strerror}"
        if not verdict.ok:
            return ",".join(r.value for r in verdict.reasons)
        try:  # the verifier parsed this manifest already: it is valid
            manifest = Manifest.model_validate_json(
                artifact.read(MANIFEST_NAME, 0, MAX_JSON_FILE_BYTES + 1)
            )
            self._check_signature(folder / ADAPTER_DIR, manifest, record)
        except ArtifactError as exc:
            return ",".join(r.value for r in exc.reasons)
        except OSError as exc:
            return f"unreadable: {exc.strerror}"
        size = sum(f.size for f in artifact.files())
        used = folder.stat().st_mtime
        self._latest = max(self._latest, used)
        self._entries[record.lora_name] = TierEntry(
            record.lora_name, folder / ADAPTER_DIR, record, size, used, seen
        )
        return ""
