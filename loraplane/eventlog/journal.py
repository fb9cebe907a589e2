"""The event sink's write-ahead journal: an event of a log topic is in the kernel, in a local
file, before ``emit`` returns, and stays there until Kafka acknowledges it or the spool takes
it, so a process killed -9 loses no event it emitted.

Why: librdkafka holds a produced event in the process's memory until the broker's ack, and
waiting for the ack would add a broker round trip to every request; one ``write`` to a local
file does not. It is on the disk once ``sync`` has run (once per poll, one fsync for the
interval), so a host crash can lose that last interval, as a broker's own page cache can.

Layout: ``<spool dir>/<client id>/journal`` (``flock``-ed by its process), segments
``<n>.journal`` of records ``kind (1 byte) | body length (4) | body | crc32 (4)``, each one
``write`` on an ``O_APPEND`` descriptor: ``E`` an event (seq, topic, key, value), ``A`` the
seqs now done. Recovery returns the events without an ack, oldest first, and stops reading
a segment at a torn record; a segment that is no regular file of at most ``READ_LIMIT``
bytes is set aside and logged (``spool.read_segment``), a name it never writes is ignored.
docs/worker.md, "The event journal".
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loraplane.eventlog.spool import read_segment, segment_numbers
from loraplane.kernel.local_files import locked_folder, open_regular

__all__ = ["CLOSE_WAIT_S", "SEGMENT_BYTES", "EventJournal", "JournalEvent", "JournalUnavailable"]

log = logging.getLogger(__name__)

SEGMENT_BYTES = 4 * 1024 * 1024
CLOSE_WAIT_S = 5.0
"""How long ``close`` waits for a ``sync`` still running in another thread."""
_SUFFIX = ".journal"
_EVENT, _ACKS = b"E", b"A"
_HEAD = struct.Struct("<cI")  # kind, body length
_CRC = struct.Struct("<I")
_EVENT_HEAD = struct.Struct("<QHi")  # seq, topic length, key length (-1: no key)
_SEQ = struct.Struct("<Q")


class JournalUnavailable(Exception):
    """The journal directory is locked by another process or cannot be written."""


@dataclass(frozen=True)
class JournalEvent:
    seq: int
    topic: str
    key: bytes | None
    value: bytes


@dataclass
class _Segment:
    fd: int
    size: int = 0
    live: int = 0  # events in it not yet done


def _record(kind: bytes, body: bytes) -> bytes:
    head = _HEAD.pack(kind, len(body))
    return head + body + _CRC.pack(zlib.crc32(body, zlib.crc32(head)))


def _records(data: bytes) -> Iterator[tuple[bytes, bytes]]:
    """(kind, body) of each whole, intact record; stops at the first that is not."""
    off, end = 0, len(data)
    while off + _HEAD.size <= end:
        kind, length = _HEAD.unpack_from(data, off)
        stop = off + _HEAD.size + length + _CRC.size
        if kind not in (_EVENT, _ACKS) or stop > end:
            return
        body_end = stop - _CRC.size
        (crc,) = _CRC.unpack_from(data, body_end)
        if crc != zlib.crc32(data[off:body_end]):
            return
        yield kind, data[off + _HEAD.size : body_end]
        off = stop


def _event(body: bytes) -> JournalEvent | None:
    try:
        seq, topic_len, key_len = _EVENT_HEAD.unpack_from(body)
        at = _EVENT_HEAD.size
        topic = body[at : at + topic_len].decode()
        at += topic_len
        key = None if key_len < 0 else body[at : at + key_len]
        return JournalEvent(seq, topic, key, body[at + max(key_len, 0) :])
    except (struct.error, UnicodeDecodeError):
        return None


class EventJournal:
    """Appends (``append``), marks done (``done``, written by ``write_acks``), fsyncs
    (``sync``, safe from another thread). The sink calls the rest under its own lock."""

    def __init__(self, directory: Path, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        self._lock_file = locked_folder(directory, JournalUnavailable)
        try:
            self._dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            self._lock_file.close()
            raise JournalUnavailable(f"{directory}: {exc}") from None
        self._lock = threading.Lock()  # ``sync`` runs in a thread of its own
        # held by a sync from its start to its last fsync: ``close`` waits for it (a cancelled
        # ``asyncio.to_thread`` leaves its thread running, fsyncing what it took)
        self._syncing = threading.Lock()
        self._closed = False
        self._segments: dict[int, _Segment] = {}
        self._tail: int | None = None
        self._where: dict[int, int] = {}  # seq of an event not yet done -> its segment
        self._acks: list[int] = []  # done, not yet written
        self._unsynced: set[int] = set()  # segments written since the last sync
        self._dir_unsynced = False
        try:
            numbers = segment_numbers(directory, _SUFFIX)
            # a previous process's segments, until ``forget``
            self._old, self.recovered, self._seq = self._read(numbers)
        except (OSError, JournalUnavailable) as exc:
            os.close(self._dir_fd)
            self._lock_file.close()
            raise JournalUnavailable(f"{directory}: {exc}") from None
        self._next_segment = (numbers[-1] + 1) if numbers else 0

    @property
    def pending(self) -> int:
        """Events appended and not yet done."""
        return len(self._where)

    # ---- a previous process's events ----------------------------------------------------
    def _path(self, n: int) -> Path:
        return self.directory / f"{n:012d}{_SUFFIX}"

    def _read(self, numbers: list[int]) -> tuple[list[int], list[JournalEvent], int]:
        """The segments read, their events without an ack, oldest first, and the next free
        seq."""
        events: dict[int, JournalEvent] = {}
        acked: set[int] = set()
        read_ones = []
        for n in numbers:
            data = read_segment(self._path(n), JournalUnavailable)
            if data is None:
                continue
            read_ones.append(n)
            read = 0
            for kind, body in _records(data):
                read += _HEAD.size + len(body) + _CRC.size
                if kind == _ACKS:
                    acked.update(s for (s,) in _SEQ.iter_unpack(body[: len(body) // 8 * 8]))
                elif (event := _event(body)) is not None:
                    events[event.seq] = event
            if read < len(data):
                log.warning(
                    "event journal %s: segment %d ends in %d bytes of a torn or "
                    "corrupt record (a write cut short); skipped",
                    self.directory,
                    n,
                    len(data) - read,
                )
        left = [events[s] for s in sorted(events) if s not in acked]
        return read_ones, left, max([*events, *acked], default=-1) + 1

    def forget(self) -> None:
        """Remove the previous process's segments (their events are safe elsewhere now)."""
        for n in self._old:
            self._path(n).unlink(missing_ok=True)
        self._old, self.recovered = [], []
        self._dir_unsynced = True

    def keep(self) -> None:
        """Leave the previous process's segments for the next start (their events are not
        all safe elsewhere); this process no longer needs them in memory."""
        self._old, self.recovered = [], []

    # ---- this process's events ----------------------------------------------------------
    def append(self, topic: str, key: bytes | None, value: bytes) -> int:
        """Write one event; its seq for ``done``. Raises ``OSError`` (nothing written)."""
        name = topic.encode()
        with self._lock:
            seq = self._seq
            record = _record(
                _EVENT,
                _EVENT_HEAD.pack(seq, len(name), -1 if key is None else len(key))
                + name
                + (key or b"")
                + value,
            )
            n = self._write(record)
            self._seq += 1
            self._segments[n].live += 1
            self._where[seq] = n
            return seq

    def done(self, seq: int) -> None:
        """The event is acknowledged, spooled, or lost and counted: no longer needed here."""
        with self._lock:
            n = self._where.pop(seq, None)
            if n is not None:
                self._acks.append(seq)
                self._segments[n].live -= 1

    def write_acks(self) -> None:
        """Write what ``done`` gathered as one record; remove segments nothing needs. An
        ack that cannot be written only makes its event come back after a kill (a
        duplicate, kept once downstream)."""
        with self._lock:
            if self._acks:
                acks, self._acks = self._acks, []
                try:
                    self._write(_record(_ACKS, struct.pack(f"<{len(acks)}Q", *acks)))
                except OSError as exc:
                    log.warning(
                        "event journal %s: %d acks not written: %s", self.directory, len(acks), exc
                    )
            for n in [n for n, s in self._segments.items() if not s.live and n != self._tail]:
                self._remove(n)

    def _write(self, record: bytes) -> int:
        """Append ``record`` to the tail segment (rotated past ``segment_bytes``); its
        number. A short or failed write is cut off again, so no torn record sits before a
        later good one."""
        n = self._tail_for(len(record))
        segment = self._segments[n]
        try:
            written = os.write(segment.fd, record)
        except OSError:
            self._cut(n)
            raise
        if written != len(record):
            self._cut(n)
            raise OSError(f"short write to the event journal ({written} of {len(record)})")
        segment.size += written
        self._unsynced.add(n)
        return n

    def _cut(self, n: int) -> None:
        try:
            os.ftruncate(self._segments[n].fd, self._segments[n].size)
        except OSError:
            self._tail = None  # cannot cut it: appends go on in a fresh segment

    def _tail_for(self, size: int) -> int:
        n = self._tail
        tail = self._segments.get(n) if n is not None else None
        if (
            n is not None
            and tail is not None
            and (not tail.size or tail.size + size <= self.segment_bytes)
        ):
            return n
        if n is not None and tail is not None and not tail.live:
            self._remove(n)
        n = self._next_segment
        # a FIFO planted at the name would block the open for good: refused (OSError) instead
        fd = open_regular(
            self._path(n), os.O_WRONLY | os.O_CREAT | os.O_APPEND, follow_links=False, mode=0o600
        )
        self._next_segment += 1
        self._segments[n], self._tail = _Segment(fd), n
        self._dir_unsynced = True
        return n

    def _remove(self, n: int) -> None:
        segment = self._segments.pop(n)
        os.close(segment.fd)
        self._path(n).unlink(missing_ok=True)
        self._unsynced.discard(n)
        self._dir_unsynced = True
        if self._tail == n:
            self._tail = None

    # ---- durability ---------------------------------------------------------------------
    @property
    def unsynced(self) -> bool:
        return bool(self._unsynced) or self._dir_unsynced

    def sync(self) -> None:
        """fsync what was written since the last call (the group commit). The descriptors are
        duplicated under the lock, so appends and segment removals go on meanwhile. After
        ``close``, nothing."""
        with self._syncing:
            self._sync()

    def _sync(self) -> None:
        with self._lock:
            if self._closed:
                return
            fds = [os.dup(self._segments[n].fd) for n in self._unsynced]
            if self._dir_unsynced:
                fds.append(os.dup(self._dir_fd))
            self._unsynced.clear()
            self._dir_unsynced = False
        for fd in fds:
            try:
                os.fsync(fd)
            except OSError as exc:
                log.warning("event journal %s: fsync failed: %s", self.directory, exc)
            finally:
                os.close(fd)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Release the journal once what was written is on the disk: what is done is
        removed, what is not stays for the next start. A sync running in another thread is
        waited for, up to ``wait_s`` (a sync took the writes it fsyncs, so returning before
        it ends would release writes not yet on the disk); past that, logged, and the journal
        is closed beside it (its fsyncs go on on descriptors of their own)."""
        waited = self._syncing.acquire(timeout=wait_s)
        try:
            self.write_acks()
            if waited:
                self._sync()  # the last group commit, the acks just written included
            else:
                log.error(
                    "event journal %s: a sync still runs after %.1f s; closed without waiting "
                    "for it (what it fsyncs is written, on the disk once the system flushes it)",
                    self.directory,
                    wait_s,
                )
            with self._lock:
                for n in list(self._segments):
                    if not self._segments[n].live:
                        self._remove(n)
                for segment in self._segments.values():
                    os.close(segment.fd)
                self._segments.clear()
                os.close(self._dir_fd)
                self._closed = True
            self._lock_file.close()
        finally:
            if waited:
                self._syncing.release()
