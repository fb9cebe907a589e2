"""Known traffic peaks: a schedule file raises ``scheduled_warmup_score`` ahead of each peak so
the adapter is hot before its first request.

The file (YAML)::

    schedules:
      - name: emea-morning            # for audit reasons
        cron: "0 8 * * 1-5"           # peak start, UTC (croniter syntax)
        adapter_id: "support-*"       # or tenant_id; shell-style glob
        lead_minutes: 10              # warm up this long before the peak
        duration_minutes: 90          # and stay warm this long after it starts
        warmup_score: 1.0             # in [0, 1]

An entry is active from ``peak - lead`` to ``peak + duration`` for its most recent peak.
Evaluation is pure (``now`` is an argument, epoch seconds) and evaluates each cron
expression once per call, not once per adapter, so a tick over 100k adapters stays cheap.
``ScheduleFile`` is the I/O edge: it re-reads the file when its mtime changes, so schedules
change without a restart; a file that stops parsing keeps the last good schedule.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from fnmatch import fnmatchcase
from pathlib import Path

import yaml
from croniter import croniter
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from loraplane.kernel.local_files import read_regular
from loraplane.schemas.bounded_yaml import load_yaml

__all__ = [
    "MAX_CRON_CHARS",
    "MAX_SCHEDULE_BYTES",
    "ActiveEntry",
    "Schedule",
    "ScheduleEntry",
    "ScheduleFile",
    "active_entries",
    "parse_schedule",
    "scheduled_warmup_score",
    "warmup_scores",
]

log = logging.getLogger(__name__)

MAX_CRON_CHARS = 256
_RANDOM_FIELD = re.compile(r"[rR](\(\d+-\d+\))?(/\d+)?")  # croniter's random field
_REFERENCE = datetime(2026, 1, 1, tzinfo=UTC)  # where the parse check looks for peaks


class ScheduleEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("", max_length=128)
    cron: str
    adapter_id: str | None = Field(None, min_length=1, max_length=128)
    tenant_id: str | None = Field(None, min_length=1, max_length=128)
    lead_minutes: float = Field(10.0, ge=0, le=24 * 60)
    duration_minutes: float = Field(60.0, gt=0, le=7 * 24 * 60)
    warmup_score: float = Field(1.0, ge=0, le=1)

    @field_validator("cron")
    @classmethod
    def _cron_parses(cls, v: str) -> str:
        """A cron expression croniter reads, of at most MAX_CRON_CHARS (each tick evaluates
        it: a list of 20,000 days costs a quarter second), without a random field (``R``:
        drawn again at every evaluation, so two evaluations of one schedule would differ),
        whose peaks can be found both ways (``0 0 30 2 *`` passes croniter's check and
        then never fires)."""
        if len(v) > MAX_CRON_CHARS:
            raise ValueError(f"a cron expression is at most {MAX_CRON_CHARS} characters")
        if not croniter.is_valid(v):
            raise ValueError(f"not a cron expression: {v!r}")
        if any(_RANDOM_FIELD.fullmatch(f) for f in v.split()):
            raise ValueError(f"a random field (R) makes no fixed schedule: {v!r}")
        try:
            croniter(v, _REFERENCE).get_next(datetime)
            croniter(v, _REFERENCE).get_prev(datetime)
        except (ValueError, OverflowError):
            raise ValueError(f"a cron expression that never fires: {v!r}") from None
        return v

    @model_validator(mode="after")
    def _one_selector(self) -> ScheduleEntry:
        if (self.adapter_id is None) == (self.tenant_id is None):
            raise ValueError("an entry selects by exactly one of adapter_id or tenant_id")
        return self

    def warmup_at(self, now: float) -> float:
        """``warmup_score`` while inside the window of the most recent peak, else 0."""
        lead = timedelta(minutes=self.lead_minutes)
        # The latest peak starting at or before now + lead (croniter's get_prev is strict,
        # so start one microsecond later to include a peak exactly at now + lead).
        start = datetime.fromtimestamp(now, UTC) + lead + timedelta(microseconds=1)
        try:
            peak = croniter(self.cron, start).get_prev(datetime)
        except (ValueError, OverflowError):  # CroniterBadDateError: no peak, so not active
            return 0.0
        end = peak + timedelta(minutes=self.duration_minutes)
        return self.warmup_score if now <= end.timestamp() else 0.0

    def selects(self, adapter_id: str, tenant_id: str) -> bool:
        if self.adapter_id is not None:
            return fnmatchcase(adapter_id, self.adapter_id)
        return fnmatchcase(tenant_id, self.tenant_id or "")


class Schedule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schedules: list[ScheduleEntry] = Field(default_factory=list, max_length=10_000)


@dataclass(frozen=True)
class ActiveEntry:
    entry: ScheduleEntry
    score: float


def active_entries(schedule: Schedule, now: float) -> list[ActiveEntry]:
    return [ActiveEntry(e, s) for e in schedule.schedules if (s := e.warmup_at(now)) > 0]


def warmup_scores(
    schedule: Schedule, adapters: Iterable[tuple[str, str]], now: float
) -> dict[str, float]:
    """``{adapter_id: score}`` for the ``(adapter_id, tenant_id)`` pairs inside a window;
    adapters matched by several entries get the highest score."""
    active = active_entries(schedule, now)
    if not active:
        return {}
    index = _SelectorIndex(active)
    scores: dict[str, float] = {}
    for adapter_id, tenant_id in adapters:
        best = index.best(adapter_id, tenant_id)
        if best > 0:
            scores[adapter_id] = best
    return scores


_GLOB_CHARS = frozenset("*?[")


class _SelectorIndex:
    """The active entries' selectors, so that one adapter costs a few dict lookups, not a
    glob match per entry: a literal selector (no ``*?[``) by its text, a ``prefix*`` one
    by its prefix (one lookup per distinct prefix length); only other globs are matched
    one by one. 100 active ``team-*`` entries over 100k adapters took seconds per tick."""

    def __init__(self, active: Iterable[ActiveEntry]) -> None:
        self.exact: dict[tuple[bool, str], float] = {}  # (by tenant, text) -> best score
        self.prefix: dict[tuple[bool, str], float] = {}
        self.lengths: dict[bool, set[int]] = {False: set(), True: set()}
        self.globs: list[ActiveEntry] = []
        for a in active:
            by_tenant = a.entry.adapter_id is None
            pattern = (a.entry.tenant_id if by_tenant else a.entry.adapter_id) or ""
            head = pattern[:-1] if pattern.endswith("*") else None
            if not _GLOB_CHARS.intersection(pattern):
                _keep_best(self.exact, (by_tenant, pattern), a.score)
            elif head is not None and not _GLOB_CHARS.intersection(head):
                _keep_best(self.prefix, (by_tenant, head), a.score)
                self.lengths[by_tenant].add(len(head))
            else:
                self.globs.append(a)

    def best(self, adapter_id: str, tenant_id: str) -> float:
        best = 0.0
        for by_tenant, value in ((False, adapter_id), (True, tenant_id)):
            best = max(best, self.exact.get((by_tenant, value), 0.0))
            for n in self.lengths[by_tenant]:
                if n <= len(value):
                    best = max(best, self.prefix.get((by_tenant, value[:n]), 0.0))
        for a in self.globs:
            if a.score > best and a.entry.selects(adapter_id, tenant_id):
                best = a.score
        return best


def _keep_best(scores: dict[tuple[bool, str], float], key: tuple[bool, str], score: float) -> None:
    scores[key] = max(score, scores.get(key, 0.0))


def scheduled_warmup_score(
    schedule: Schedule, adapter_id: str, tenant_id: str, now: float
) -> float:
    return warmup_scores(schedule, [(adapter_id, tenant_id)], now).get(adapter_id, 0.0)


MAX_SCHEDULE_BYTES = 4 * 1024 * 1024
"""A longer schedule file is not read (the previous schedule stays)."""


def parse_schedule(text: str) -> Schedule:
    data = load_yaml(text) or {}
    if not isinstance(data, dict):
        raise ValueError("a schedule file is a mapping with a 'schedules' list")
    return Schedule.model_validate(data)


class ScheduleFile:
    """The schedule at ``path``, re-read whenever its mtime changes (no restart needed)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mtime: float | None = None
        self._schedule = Schedule()

    def current(self) -> Schedule:
        try:
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            self._mtime, self._schedule = None, Schedule()
            return self._schedule
        if mtime != self._mtime:
            self._mtime = mtime
            try:
                raw = read_regular(self.path, MAX_SCHEDULE_BYTES)
                self._schedule = parse_schedule(raw.decode())
            except (OSError, ValueError, yaml.YAMLError) as exc:  # pydantic errors are ValueErrors
                log.error(
                    "schedule file %s not reloaded, keeping the previous one: %s", self.path, exc
                )
        return self._schedule
