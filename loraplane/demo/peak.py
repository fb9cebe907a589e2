"""The scheduled peak of a replay and the schedules-file entry that announces it.

Schedules are cron expressions (minute resolution, UTC), so the entry names the minute the
peak starts in and its window (``lead_minutes`` before to ``duration_minutes`` after that
minute) is made wide enough to hold the replayed peak whatever second it starts at. The
planner reads the file (``settings.schedules_path``) and prewarms the adapter ahead of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import yaml

from loraplane.kernel.atomic_file import write_atomic
from loraplane.streams.schedules import Schedule

__all__ = ["ScheduledPeak", "write_schedule"]


@dataclass(frozen=True)
class ScheduledPeak:
    adapter_id: str
    at_s: float  # seconds into the replay
    duration_s: float
    qps: float
    minute: datetime  # UTC, the cron minute the peak starts in
    lead_minutes: float = 2.0

    @classmethod
    def at(
        cls,
        adapter_id: str,
        replay_start: datetime,
        at_s: float,
        duration_s: float,
        qps: float,
        lead_minutes: float = 2.0,
    ) -> ScheduledPeak:
        start = replay_start + timedelta(seconds=at_s)
        return cls(
            adapter_id, at_s, duration_s, qps, start.replace(second=0, microsecond=0), lead_minutes
        )

    def entry(self) -> dict[str, object]:
        """The schedules-file entry (streams.schedules.ScheduleEntry)."""
        return {
            "name": f"demo-peak-{self.adapter_id}",
            "cron": f"{self.minute.minute} {self.minute.hour} * * *",
            "adapter_id": self.adapter_id,
            "lead_minutes": self.lead_minutes,
            "duration_minutes": math.ceil(self.duration_s / 60) + 1,
            "warmup_score": 1.0,
        }


def write_schedule(path: Path, peaks: list[ScheduledPeak]) -> None:
    """Write the schedules file atomically, validated as the planner will parse it."""
    data = {"schedules": [p.entry() for p in peaks]}
    Schedule.model_validate(data)
    write_atomic(path, yaml.safe_dump(data, sort_keys=False))
