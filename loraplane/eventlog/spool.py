"""A bounded, durable, in-order spool of the events Kafka did not take.

The event sink (``eventlog.sink``) never waits for the broker, so during an outage its
events end in librdkafka's delivery reports as errors. Each such event is appended here, on
local disk, and the sink replays the spool from its head once the broker answers again. A
restarted process finds its spool and replays what the last one left.

Layout: one directory per producing client (``home/spool/<client id>``) holding segment files
``<n>.spool`` of JSON lines ``{"t": topic, "k": key b64, "v": value b64}`` and ``cursor.json``
(segment and byte offset of the first event not yet delivered, replaced atomically). A torn
last line (a crash mid-write) is cut when the spool is opened. The directory is locked
(``flock``) by the process using it: a second process with the same client id gets no spool
and says so, rather than interleaving writes. Whatever else sits at a segment's or the
cursor's path when it is read back (a folder, a FIFO, a link, a file past ``READ_LIMIT``) is
renamed aside to ``<name>.damaged-<ns>``, logged and kept for an operator (while it runs, a
segment is opened without waiting on a FIFO); other names (``7.spool``) are ignored.

Bound: ``max_bytes`` of undelivered events. An event past it is not written; the caller
counts it as dropped and logs the count, so nothing is lost without a counter.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from loraplane.kernel.atomic_file import write_atomic
from loraplane.kernel.local_files import locked_folder, open_regular, read_regular

__all__ = [
    "CURSOR_FILE",
    "READ_LIMIT",
    "SEGMENT_BYTES",
    "EventSpool",
    "SpoolUnavailable",
    "SpooledEvent",
    "read_segment",
    "segment_numbers",
]

log = logging.getLogger(__name__)

CURSOR_FILE = "cursor.json"
SEGMENT_BYTES = 8 * 1024 * 1024
READ_LIMIT = 64 * 1024 * 1024
"""The most a segment of the spool or the journal is read back: a segment holds
``SEGMENT_BYTES`` and one event past it, and Kafka takes no event near this size."""
_SUFFIX = ".spool"
_CURSOR_BYTES = 4096


class SpoolUnavailable(Exception):
    """The spool directory is locked by another process or cannot be written."""


def segment_numbers(directory: Path, suffix: str) -> list[int]:
    """The numbers of the segments in ``directory``, in order: only names as ``n:012d`` +
    ``suffix`` writes them (``7.spool`` or ``².spool`` would name no file it reads)."""
    pattern = re.compile(rf"([0-9]{{12,}}){re.escape(suffix)}", re.ASCII)
    numbers = []
    for name in os.listdir(directory):
        match = pattern.fullmatch(name)
        if match and name == f"{int(match[1]):012d}{suffix}":
            numbers.append(int(match[1]))
    return sorted(numbers)


def read_segment(path: Path, unavailable: type[Exception], limit: int = READ_LIMIT) -> bytes | None:
    """The bytes of a segment or state file read back at start; None when there is none.
    Anything but a regular file of at most ``limit`` bytes (a folder, a FIFO, a link, an
    unreadable file) is renamed aside, kept for an operator and logged, and None is
    returned; ``unavailable`` when it cannot even be moved out of the way."""
    try:
        return read_regular(path, limit, follow_links=False)
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = exc
    aside = path.with_name(f"{path.name}.damaged-{time.time_ns()}")
    try:
        os.rename(path, aside)
    except OSError as exc:
        raise unavailable(f"{path} is not read ({why}) and cannot be set aside: {exc}") from None
    log.error("%s is not read (%s): set aside as %s", path, why, aside.name)
    return None


@dataclass(frozen=True)
class SpooledEvent:
    topic: str
    key: bytes | None
    value: bytes
    size: int  # bytes of its line in the segment

    def line(self) -> bytes:
        return _line(self.topic, self.key, self.value)


def _line(topic: str, key: bytes | None, value: bytes) -> bytes:
    return (
        json.dumps(
            {
                "t": topic,
                "k": None if key is None else base64.b64encode(key).decode(),
                "v": base64.b64encode(value).decode(),
            },
            separators=(",", ":"),
        ).encode()
        + b"\n"
    )


def _parse(line: bytes) -> SpooledEvent | None:
    try:
        d = json.loads(line)
        key = None if d["k"] is None else base64.b64decode(d["k"], validate=True)
        return SpooledEvent(str(d["t"]), key, base64.b64decode(d["v"], validate=True), len(line))
    except (ValueError, KeyError, TypeError, RecursionError):
        return None


class EventSpool:
    """A FIFO of undelivered events on disk: ``append`` at the tail, ``peek`` + ``commit``
    at the head. Not thread-safe: the sink calls it from librdkafka's delivery reports,
    which run inside the sink's own ``poll``."""

    def __init__(self, directory: Path, max_bytes: int, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self._lock = locked_folder(directory, SpoolUnavailable)
        self.records = 0  # undelivered events
        self.bytes = 0  # their bytes on disk
        self._dirty = False
        self._tail: IO[bytes] | None = None
        try:
            self._head_segment, self._head_offset = self._read_cursor()
            self._scan()
        except (OSError, SpoolUnavailable) as exc:
            self._lock.close()
            raise SpoolUnavailable(f"{directory}: {exc}") from None

    # ---- state on disk ------------------------------------------------------------------
    def _segments(self) -> list[int]:
        return segment_numbers(self.directory, _SUFFIX)

    def _path(self, n: int) -> Path:
        return self.directory / f"{n:012d}{_SUFFIX}"

    def _read_cursor(self) -> tuple[int, int]:
        raw = read_segment(self.directory / CURSOR_FILE, SpoolUnavailable, _CURSOR_BYTES)
        try:
            if raw is None:
                raise ValueError("no cursor")
            d = json.loads(raw)
            segment, offset = d["segment"], d["offset"]
            if not all(type(v) is int and v >= 0 for v in (segment, offset)):
                raise ValueError("not two counts")
            return segment, offset
        except (ValueError, KeyError, TypeError, RecursionError):
            segments = self._segments()
            return (segments[0] if segments else 0), 0

    def _scan(self) -> None:
        """Count what is undelivered; cut a torn last line; drop segments before the head;
        set aside what is no segment (``read_segment``)."""
        kept: list[int] = []
        first = True
        for n in self._segments():
            path = self._path(n)
            if n < self._head_segment and path.is_file() and not path.is_symlink():
                path.unlink(missing_ok=True)  # delivered: dropped unread
                continue
            data = read_segment(path, SpoolUnavailable)
            if data is None or n < self._head_segment:  # set aside, or delivered and gone
                if data is not None:
                    path.unlink(missing_ok=True)
                continue
            if first and n != self._head_segment:  # the head segment went away
                self._head_segment, self._head_offset = n, 0
            first = False
            kept.append(n)
            if data and not data.endswith(b"\n"):
                cut = data.rfind(b"\n") + 1
                log.warning(
                    "event spool %s: cut a torn last line (%d bytes) of segment %d",
                    self.directory,
                    len(data) - cut,
                    n,
                )
                fd = open_regular(self._path(n), os.O_WRONLY, follow_links=False)
                try:
                    os.ftruncate(fd, cut)
                finally:
                    os.close(fd)
                data = data[:cut]
            start = self._head_offset if n == self._head_segment else 0
            body = data[start:]
            self.records += body.count(b"\n")
            self.bytes += len(body)
        self._tail_segment = kept[-1] if kept else self._head_segment

    def _write_cursor(self) -> None:
        """A cursor that cannot be written (a full disk) is logged: the one on disk lags,
        so a restart sends its events again (at least once), and the next commit tries."""
        try:
            write_atomic(
                self.directory / CURSOR_FILE,
                json.dumps({"segment": self._head_segment, "offset": self._head_offset}),
            )
        except OSError as exc:
            log.error("event spool %s: cursor not written: %s", self.directory, exc)

    # ---- tail ---------------------------------------------------------------------------
    def append(self, topic: str, key: bytes | None, value: bytes) -> bool:
        """Write one event at the tail, one ``write`` (in the kernel once it returns, so it
        survives the process; on the disk at the next ``sync``); False (nothing written)
        when over ``max_bytes`` or the disk refuses it."""
        line = _line(topic, key, value)
        if self.bytes + len(line) > self.max_bytes:
            return False
        try:
            fh = self._tail_file(len(line))
            size = fh.tell()
            if fh.write(line) != len(line):  # a full disk: cut the partial line off again
                fh.truncate(size)
                raise OSError(f"short write ({len(line)} bytes asked)")
        except OSError as exc:
            log.error("event spool %s: could not write an event: %s", self.directory, exc)
            return False
        self.records += 1
        self.bytes += len(line)
        self._dirty = True
        return True

    def _tail_file(self, size: int) -> IO[bytes]:
        if self._tail is not None and self._tail.tell() + size > self.segment_bytes:
            self._close_tail()
            self._tail_segment += 1
        if self._tail is None:  # unbuffered: an appended event outlives a kill of the process
            fd = open_regular(
                self._path(self._tail_segment),
                os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                follow_links=False,
            )
            self._tail = os.fdopen(fd, "ab", buffering=0)
        return self._tail

    def _close_tail(self) -> None:
        if self._tail is not None:
            self.sync()
            self._tail.close()
            self._tail = None

    def sync(self) -> None:
        """Make what was appended durable (the sink calls it once per poll, not per event)."""
        if self._dirty and self._tail is not None:
            try:
                self._tail.flush()
                os.fsync(self._tail.fileno())
            except OSError as exc:  # the events are in the kernel still: a kill keeps them
                log.error("event spool %s: fsync failed: %s", self.directory, exc)
        self._dirty = False

    # ---- head ---------------------------------------------------------------------------
    def peek(self, limit: int) -> list[SpooledEvent]:
        """Up to ``limit`` events from the head, oldest first (not removed)."""
        if self._tail is not None:
            self._tail.flush()
        out: list[SpooledEvent] = []
        segment, offset = self._head_segment, self._head_offset
        while len(out) < limit and segment <= self._tail_segment:
            try:
                self._peek_segment(self._path(segment), offset, limit, out)
            except OSError as exc:  # replayed from here once it can be read again
                log.error("event spool %s: segment %d not read: %s", self.directory, segment, exc)
                break
            segment, offset = segment + 1, 0
        return out

    @staticmethod
    def _peek_segment(path: Path, offset: int, limit: int, out: list[SpooledEvent]) -> None:
        """Events of the segment at ``path`` from ``offset``: whatever was put at its path
        since it was written (a FIFO, a link, an endless file) is an OSError, never a wait
        or a line read past ``READ_LIMIT``."""
        try:
            fd = open_regular(path, follow_links=False)
        except FileNotFoundError:
            return
        with os.fdopen(fd, "rb") as fh:
            fh.seek(offset)
            while raw := fh.readline(READ_LIMIT):
                if not raw.endswith(b"\n"):
                    break  # being written, or no event
                event = _parse(raw)
                out.append(event if event is not None else SpooledEvent("", None, b"", len(raw)))
                if len(out) >= limit:
                    break

    def commit(self, events: list[SpooledEvent]) -> None:
        """Remove ``events`` (the head, as ``peek`` returned it) for good."""
        if not events:
            return
        segment, offset = self._head_segment, self._head_offset
        size = self._size(segment)
        for event in events:
            while segment < self._tail_segment and offset >= size:
                self._path(segment).unlink(missing_ok=True)
                segment, offset = segment + 1, 0
                size = self._size(segment)
            offset += event.size
            self.records -= 1
            self.bytes -= event.size
        if segment < self._tail_segment and offset >= size:
            self._path(segment).unlink(missing_ok=True)
            segment, offset = segment + 1, 0
        self._head_segment, self._head_offset = segment, offset
        if self.records == 0:  # empty: start afresh, no file left behind
            self._close_tail()
            for n in self._segments():
                self._path(n).unlink(missing_ok=True)
            self._head_segment = self._tail_segment = self._tail_segment + 1
            self._head_offset = 0
        self._write_cursor()

    def _size(self, segment: int) -> int:
        try:
            return self._path(segment).stat().st_size
        except FileNotFoundError:
            return 0

    def close(self) -> None:
        self._close_tail()
        self._lock.close()
