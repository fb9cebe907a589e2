"""Scheduled warm-up scores (streams/schedules.py) for many adapters under many active
entries: ``warmup_scores`` (literal and ``prefix*`` selectors looked up) against the
baseline of matching every active entry's glob per adapter, measured in the same run.
Prints JSON: seconds of each, their ratio, and whether both gave the same scores.

    .venv/bin/python -m bench.schedule_selectors [--entries 100 --adapters 100000]
"""

from __future__ import annotations

import argparse
import json
import time

from loraplane.streams.schedules import (
    Schedule,
    ScheduleEntry,
    active_entries,
    warmup_scores,
)


def naive(schedule: Schedule, adapters: list[tuple[str, str]], now: float) -> dict[str, float]:
    active = active_entries(schedule, now)
    scores: dict[str, float] = {}
    for adapter_id, tenant_id in adapters:
        best = max((a.score for a in active if a.entry.selects(adapter_id, tenant_id)), default=0)
        if best > 0:
            scores[adapter_id] = best
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--entries", type=int, default=100)
    parser.add_argument("--adapters", type=int, default=100_000)
    args = parser.parse_args()
    schedule = Schedule(
        schedules=[
            ScheduleEntry(cron="* * * * *", adapter_id=f"team{i}-*", warmup_score=0.5)
            for i in range(args.entries)
        ]
    )
    adapters = [(f"team{i % (2 * args.entries)}-a{i}", "t") for i in range(args.adapters)]
    now = time.time()
    started = time.perf_counter()
    base = naive(schedule, adapters, now)
    base_s = time.perf_counter() - started
    started = time.perf_counter()
    got = warmup_scores(schedule, adapters, now)
    indexed_s = time.perf_counter() - started
    print(
        json.dumps(
            {
                "entries": args.entries,
                "adapters": args.adapters,
                "baseline_glob_per_entry_s": round(base_s, 4),
                "warmup_scores_s": round(indexed_s, 4),
                "ratio": round(indexed_s / base_s, 4) if base_s else None,
                "same_scores": got == base,
            }
        )
    )


if __name__ == "__main__":
    main()
