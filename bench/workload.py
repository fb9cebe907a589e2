"""Synthetic request logs for the pipeline benchmarks: a power law over adapters (a few hot,
a long cold tail), tenants by adapter, TTFT by tier. Deterministic per seed."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from loraplane.schemas.request_log import RequestLog, Tier

BASE_MODEL = "bench-llama"
_TIERS = (Tier.gpu, Tier.gpu, Tier.gpu, Tier.gpu, Tier.host, Tier.cold)
_TTFT = {Tier.gpu: 40.0, Tier.host: 120.0, Tier.cold: 900.0, Tier.base_fallback: 60.0}


def request_logs(
    n: int,
    *,
    adapters: int = 200,
    seed: int = 0,
    prefix: str = "e",
    start: datetime | None = None,
    span_s: float = 300.0,
) -> list[RequestLog]:
    """``n`` logs over ``adapters`` adapters (Zipf-like weights 1/rank), spread evenly over
    ``span_s`` seconds ending now (or from ``start``)."""
    rng = random.Random(seed)
    start = start or datetime.now(UTC) - timedelta(seconds=span_s)
    names = [f"a{i:05d}" for i in range(adapters)]
    weights = [1.0 / (i + 1) for i in range(adapters)]
    picks = rng.choices(names, weights=weights, k=n)
    step = span_s / max(n, 1)
    logs = []
    for i, adapter in enumerate(picks):
        tier = rng.choice(_TIERS)
        logs.append(
            RequestLog(
                event_id=f"{prefix}{seed}-{i}",
                ts=start + timedelta(seconds=i * step),
                request_id=f"r{seed}-{i}",
                tenant_id=f"t{int(adapter[1:]) % 7}",
                base_model=BASE_MODEL,
                adapter_id=adapter,
                adapter_version="1",
                worker_id=f"w{i % 4}",
                tier_at_arrival=tier,
                ttft_ms=round(_TTFT[tier] * (0.5 + rng.random()), 3),
                prompt_tokens=rng.randrange(16, 2048),
                output_tokens=rng.randrange(1, 512),
            )
        )
    return logs
