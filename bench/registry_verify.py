"""Registry view verification: the CPU a consumer spends on one registry record whose view
carries a long genuine history, what whoever may write the registry topic can make every
worker agent, router, scoring keeper and planner spend by sending copies of it.

Two genuine histories of ``--events`` events (one publish and canary steps; publishes only,
each adding a version), folded by the registry's own ``registry.fold.evaluate``. For each,
in this process: the record's decode (``AdapterView`` from its bytes: the least any consumer
does with it, the baseline) and ``registry.evidence.verify_view`` of it, first with no
signature remembered (``cold``: a consumer that never saw these events) and then again
(``warm``: copies of a history the consumer verified before). Best of ``--reps``, CPU time.

    .venv/bin/python -m bench.registry_verify
    .venv/bin/python -m bench.registry_verify --events 100 --reps 3
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from bench.report import Row, emit, parse_args, times
from loraplane.registry.evidence import ViewVerified, verify_view
from loraplane.registry.fold import Accepted, AdapterState, evaluate
from loraplane.schemas import signing
from loraplane.schemas.codec import decode, encode
from loraplane.schemas.registry import AdapterView
from tests.lifecycle_kit import Kit, make_kit

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def history(kit: Kit, kind: str, events: int) -> bytes:
    """The registry record (a view's canonical bytes) after ``events`` genuine events."""
    state: AdapterState | None = None
    for n in range(events):
        at = NOW - timedelta(hours=1) + timedelta(seconds=n)
        if n == 0 or kind == "publish":
            event = kit.event("ci", "publish", "long-bot", str(n + 1), 1 + n, at)
        else:
            event = kit.event("ci", "canary", "long-bot", "1", 1 + n, at, canary_percent=n % 100)
        decision = evaluate(event, kit.keyring, lambda _a, s=state: s, at)
        if not isinstance(decision, Accepted):
            break
        state = decision.state
    assert state is not None
    return encode(state.view)


def best(run: Callable[[], Any], reps: int, before: Callable[[], None] | None = None) -> float:
    """The least CPU seconds of ``reps`` runs (``before`` each, outside the clock)."""
    spent = []
    for _ in range(reps):
        if before is not None:
            before()
        start = time.process_time()
        run()
        spent.append(time.process_time() - start)
    return min(spent)


def forget() -> None:
    remembered = getattr(signing, "_verified", None)
    if remembered is not None:
        remembered.clear()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=240)
    parser.add_argument("--reps", type=int, default=5)
    args = parse_args(parser, "bench.registry_verify", argv)
    kit = make_kit(NOW)
    keyring = kit.keyring
    shapes: dict[str, Any] = {}
    for kind in ("canary", "publish"):
        raw = history(kit, kind, args.events)
        view = decode(AdapterView, raw)
        assert isinstance(verify_view(view, keyring, NOW), ViewVerified)
        decode_s = best(lambda raw=raw: decode(AdapterView, raw), args.reps)
        cold_s = best(lambda v=view: verify_view(v, keyring, NOW), args.reps, forget)
        verify_view(view, keyring, NOW)
        warm_s = best(lambda v=view: verify_view(v, keyring, NOW), args.reps)
        shapes[kind] = {
            "events": len(view.evidence),
            "versions": len(view.versions),
            "record_bytes": len(raw),
            "decode_ms": round(decode_s * 1e3, 2),
            "verify_cold_ms": round(cold_s * 1e3, 2),
            "verify_warm_ms": round(warm_s * 1e3, 2),
            "cold_per_decode": round(cold_s / decode_s, 1),
            "warm_per_decode": round(warm_s / decode_s, 1),
            "verify_warm_us_per_byte": round(warm_s * 1e6 / len(raw), 3),
        }
    worst = max(shapes.values(), key=lambda s: s["warm_per_decode"])
    row = Row(
        benchmark=f"registry view verification, {args.events}-event genuine histories",
        loraplane=", ".join(
            f"{k}: {s['verify_warm_ms']} ms a copy ({s['verify_cold_ms']} ms first)"
            for k, s in shapes.items()
        ),
        baseline=", ".join(f"{k}: decode {s['decode_ms']} ms" for k, s in shapes.items()),
        ratio=times(worst["warm_per_decode"]) + " a decode (worst)",
        goal="work in proportion to the record",
    )
    emit({"unit": "CPU ms per record", "reps": args.reps, "shapes": shapes}, row, args)


if __name__ == "__main__":
    main()
