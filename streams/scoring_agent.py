"""The scoring agent: request logs in, per adapter-version score state out.

Each request log (key = adapter_id) is folded into a ``streams.scores.ScoreState`` kept in the
``scores`` table (changelog-backed: a restarted worker rebuilds it). Time is the log's own
``ts`` (event time), so replayed or late logs count as of when they happened and tests
control time by the timestamps they write. A log that does not decode, or whose Kafka key
is not its adapter_id (the table would then live on the wrong partition), becomes a dead
letter with its reason; the stream never stops on bad input.

When a log starts a burst (``scores.is_burst``) the agent sets ``burst_seen`` so the planner
re-plans now instead of at its next tick; the planner does not run per request.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import uuid

import faust

from infra.topics import spec, topic_name
from loraplane.config import get_settings
from schemas.base import now_utc
from schemas.codec import SchemaError, decode, encode
from schemas.dead_letter import DeadLetter
from schemas.request_log import RequestLog
from streams.app import app
from streams.scores import ScoreState, from_dict, is_burst, observe_log, score_key, to_dict

log = logging.getLogger(__name__)
settings = get_settings()

requests_topic = app.topic(topic_name(settings, "requests"), key_serializer="raw",
                           value_serializer="raw")
dead_letter_topic = app.topic(topic_name(settings, "dead-letters"), key_serializer="raw",
                              value_serializer="raw")
scores_table = app.Table(
    "scores", partitions=spec("requests").partitions,
    help="score_key (adapter_id@version) -> streams.scores.to_dict(ScoreState)")

burst_seen = asyncio.Event()
"""Set when a request log starts a burst; the planner agent waits on it."""

MAX_DEAD_LETTER_RAW = 512 * 1024


def score_states() -> dict[str, ScoreState]:
    """Every score state this worker holds (all partitions when it runs alone)."""
    return {k: from_dict(v) for k, v in scores_table.items()}


def dead_letter(source: faust.TopicT, message: faust.types.Message, reason: str,
                detail: str, component: str) -> DeadLetter:
    raw = message.value if isinstance(message.value, bytes) else b""
    key = message.key if isinstance(message.key, bytes) else None
    return DeadLetter(
        event_id=f"dlq-{uuid.uuid4().hex}", ts=now_utc(), source_topic=source.get_topic_name(),
        partition=message.partition, offset=message.offset, component=component,
        reason=reason, detail=detail[:4000],
        key_b64=base64.b64encode(key[:3000]).decode() if key is not None else None,
        raw_b64=base64.b64encode(raw[:MAX_DEAD_LETTER_RAW]).decode())


@app.agent(requests_topic)
async def scoring_agent(stream: faust.StreamT) -> None:
    async for event in stream.events():
        message = event.message
        try:
            request = decode(RequestLog, event.value)
            if (event.key or b"") != request.adapter_id.encode():
                raise SchemaError("key_mismatch", [("(key)", f"Kafka key {event.key!r} is not "
                                                              f"adapter_id {request.adapter_id}")])
        except SchemaError as exc:
            log.warning("request log p%s@%s refused: %s", message.partition, message.offset, exc)
            await dead_letter_topic.send(
                key=event.key if isinstance(event.key, bytes) else None,
                value=encode(dead_letter(requests_topic, message, exc.reason, str(exc),
                                         "scoring")))
            continue
        key = score_key(request.adapter_id, request.adapter_version)
        stored = scores_table.get(key)
        before = from_dict(stored) if stored is not None else ScoreState()
        after = observe_log(before, request)
        scores_table[key] = to_dict(after)
        if is_burst(before, after, request.ts.timestamp()):
            log.info("burst for %s", key)
            burst_seen.set()
