"""Scoring profile: where a request log's CPU goes in one scoring keeper, without a broker.

``ScoreKeeper._commit`` (the fold, the score records, the keeper's loop over a batch) over
``--events`` request logs of ``--adapters`` adapters (``bench.workload``) in batches of
``--batch``, as real confluent-kafka ``Message`` objects on six partitions, into a
transaction that only counts what it is given. Baseline, in the same run: reading the same
messages' value, key and partition, the least any consumer of them does. Reports the CPU
per log of both (best of ``--reps``) and a cProfile of one more pass, as shares of the
keeper's time by part. What the broker adds (the consume, the transaction's round trips)
is ``bench.stream_throughput``'s.

    .venv/bin/python -m bench.scoring_profile                  # 200k logs, batches of 10,000
    .venv/bin/python -m bench.scoring_profile --batch 2000
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from bench.report import Row, emit, parse_args, times
from bench.workload import request_logs
from loraplane.kernel.command_partition import partition_of
from loraplane.kernel.config import Settings
from loraplane.schemas.codec import encode
from loraplane.schemas.score_snapshot import UnknownTally
from loraplane.streams.score_admission import Known
from loraplane.streams.score_fold import RecentIds
from loraplane.streams.score_keeper import RECENT, ScoreKeeper, _Owned

PARTITIONS = 6
PARTS = {  # share of the keeper's time: (function, file it is in, own time only)
    "decode and checks (fast_demand)": ("fast_demand", "score_fold", False),
    "pydantic slow path (demand_of)": ("demand_of", "score_fold", False),
    "fold arithmetic and new states (observe_many)": ("observe_many", "scores", False),
    "fold loop (fold_batch's own)": ("fold_batch", "score_fold", True),
    "RecentIds.add": ("add_run", "score_fold", False),
    "score records (snapshot_bytes)": ("snapshot_bytes", "scores", False),
}


class _Txn:
    """A transactional producer that only counts what it is given."""

    records = 0

    def begin_transaction(self) -> None:
        pass

    def produce(self, topic: str, key: Any = None, value: Any = None, partition: int = -1) -> None:
        self.records += 1

    def send_offsets_to_transaction(self, offsets: Any, meta: Any, timeout: float) -> None:
        pass

    def commit_transaction(self, timeout: float) -> None:
        pass


class _Consumer:
    def consumer_group_metadata(self) -> object:
        return object()


def messages(total: int, adapters: int) -> list[Any]:
    from confluent_kafka import Message

    offsets = [0] * PARTITIONS
    out = []
    for x in request_logs(total, adapters=adapters, seed=0):
        key = x.adapter_id.encode()
        p = partition_of(x.adapter_id, PARTITIONS)  # as the gateway's producer places it
        out.append(
            Message(
                topic="bench.requests", partition=p, offset=offsets[p], key=key, value=encode(x)
            )
        )
        offsets[p] += 1
    return out


def keeper_pass(msgs: list[Any], batch: int, known: Known, home: Path) -> int:
    """One keeper from empty states over every message; returns the records written."""
    k = ScoreKeeper(Settings(home=home), instance="bench")
    k._registry_after = lambda: known  # type: ignore[method-assign]  # caught up
    k.counts = (PARTITIONS,)  # as the broker said at the session's start
    for p in range(PARTITIONS):
        k.owned[p] = _Owned({}, UnknownTally(logs=0), RecentIds(RECENT), 0)
    txn = _Txn()
    for i in range(0, len(msgs), batch):
        k._commit(txn, _Consumer(), msgs[i : i + batch], known)
    return txn.records


def raw_pass(msgs: list[Any]) -> int:
    n = 0
    for m in msgs:
        if m.value() is not None and m.key() is not None and m.partition() >= 0:
            n += 1
    return n


def best_cpu(fn: Any, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def shares(stats: pstats.Stats) -> dict[str, float]:
    table: dict[tuple[str, int, str], tuple[Any, ...]] = stats.stats  # type: ignore[attr-defined]
    total = sum(v[3] for k, v in table.items() if k[2] == "_commit")
    out = {}
    for label, (name, where, own) in PARTS.items():
        spent = sum(
            v[2] if own else v[3] for k, v in table.items() if k[2] == name and where in k[0]
        )
        out[label] = round(spent / total, 3)
    out["the rest (keeper loop, transaction, dicts)"] = round(1 - sum(out.values()), 3)
    return out


def run(total: int, adapters: int, batch: int, reps: int) -> dict[str, Any]:
    msgs = messages(total, adapters)
    known = Known({f"a{i:05d}": frozenset({"1"}) for i in range(adapters)})
    with TemporaryDirectory(prefix="bench-scoring-") as tmp:
        home = Path(tmp)
        records = keeper_pass(msgs, batch, known, home)  # warm: caches, imports
        keeper = best_cpu(lambda: keeper_pass(msgs, batch, known, home), reps)
        raw = best_cpu(lambda: raw_pass(msgs), reps)
        profile = cProfile.Profile()
        profile.runcall(keeper_pass, msgs, batch, known, home)
    return {
        "unit": "µs CPU per log",
        "events": total,
        "adapters": adapters,
        "batch": batch,
        "reps": reps,
        "records_per_batch": round(records / -(-total // batch), 1),
        "keeper_us_per_log": round(keeper / total * 1e6, 3),
        "raw_us_per_log": round(raw / total * 1e6, 3),
        "ratio": round(raw / keeper, 4),
        "profile_shares": shares(pstats.Stats(profile)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--adapters", type=int, default=500)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=3)
    args = parse_args(parser, "bench.scoring_profile", argv)
    result = run(args.events, args.adapters, args.batch, args.reps)
    emit(
        result,
        Row(
            f"scoring keeper without a broker (batches of {args.batch})",
            f"{result['keeper_us_per_log']} µs CPU a log",
            f"{result['raw_us_per_log']} µs reading the same messages",
            times(result["ratio"]),
            "(profile)",
        ),
        args,
    )


if __name__ == "__main__":
    main()
