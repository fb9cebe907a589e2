"""The golden prompt set a canary version is warmed up with before real traffic reaches it.

After a ``load_gpu`` command with ``warmup_requests=N`` loads a version, the agent sends N of
these prompts (cycling) straight to vLLM under the version's lora name, not through the
gateway: they touch the adapter's weights and the prefix cache under its name, and prove the
version answers, before any tenant session is routed to it. Each is logged as a RequestLog
with ``request_class=shadow``, so it is visible but never mistaken for tenant traffic.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager

from loraplane.schemas.adapter import AdapterRecord
from loraplane.schemas.base import now_utc
from loraplane.schemas.request_log import RequestClass, RequestLog, RequestStatus, Tier
from loraplane.workers.vllm_client import VllmClient, VllmError

__all__ = ["GOLDEN_MAX_TOKENS", "GOLDEN_PROMPTS", "send_golden_set"]

GOLDEN_PROMPTS: tuple[str, ...] = (
    "Summarise in one sentence: the cache keeps hot adapters on the GPU.",
    "Translate to French: good morning, how are you?",
    "Question: what is 12 times 12? Answer:",
    "Write a short SQL query that counts the rows of a table named events.",
    "List three prime numbers:",
)
GOLDEN_MAX_TOKENS = 8


async def send_golden_set(
    vllm: VllmClient,
    record: AdapterRecord,
    count: int,
    *,
    worker_id: str,
    base_model: str,
    emit: Callable[[RequestLog], None],
    serving: Callable[[str], AbstractContextManager[None]],
) -> int:
    """Send ``count`` golden requests for ``record`` one after another; returns how many
    succeeded. ``serving(name)`` holds the name in flight (the drain rule waits for it)."""
    ok = 0
    for i in range(count):
        request_id = f"warmup-{uuid.uuid4().hex}"
        prompt = GOLDEN_PROMPTS[i % len(GOLDEN_PROMPTS)]
        body = {
            "model": record.lora_name,
            "prompt": prompt,
            "max_tokens": GOLDEN_MAX_TOKENS,
            "temperature": 0,
        }
        started = time.perf_counter()
        status, error = RequestStatus.ok, None
        usage: object = {}  # the JSON answer's, whatever its shape (_count checks)
        with serving(record.lora_name):
            try:
                async with vllm.completion("/v1/completions", body) as resp:
                    usage = json.loads(await resp.read()).get("usage") or {}
                ok += 1
            except VllmError as exc:
                status, error = RequestStatus.error, exc.reason.failure
            except (ValueError, AttributeError, RecursionError):  # answered, not our JSON
                ok += 1
        emit(
            RequestLog(
                event_id=uuid.uuid4().hex,
                ts=now_utc(),
                request_id=request_id,
                tenant_id=record.tenant_id,
                base_model=base_model,
                adapter_id=record.adapter_id,
                adapter_version=record.version,
                lora_name=record.lora_name,
                worker_id=worker_id,
                request_class=RequestClass.shadow,
                tier_at_arrival=Tier.gpu,
                ttft_ms=(time.perf_counter() - started) * 1000
                if status == RequestStatus.ok
                else None,
                prompt_tokens=_count(usage, "prompt_tokens"),
                output_tokens=_count(usage, "completion_tokens"),
                status=status,
                error=error,
            )
        )
    return ok


def _count(usage: object, key: str) -> int:
    value = usage.get(key, 0) if isinstance(usage, dict) else 0
    return value if isinstance(value, int) and value >= 0 else 0
