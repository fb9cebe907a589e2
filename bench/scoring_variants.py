"""Experimental shapes of the scoring agent, to measure what batching would buy before anyone
changes ``streams/scoring_agent.py``. Run as the Faust worker in place of
``loraplane streams run --agent streams.scoring_agent`` (bench.stream_throughput does that
with ``--variant``):

* ``per_event``: the real agent, unchanged (the default run);
* ``take``: the same decode/key check/dead-letter/observe per event, but events arrive in
  batches (``stream.take_events(max, within)``) and each batch writes every touched score
  key to the table once, so the changelog gets one message per key per batch instead of one
  per event (each write names the event that carried its key as Faust's current event, which
  decides the changelog partition: ``take_events`` sets none);
* ``--linger-ms``: the app's producer waits that long to batch changelog sends.

The batched agent reuses the real module's topic, table and dead-letter builder; only its
loop differs.
"""

from __future__ import annotations

import argparse
import logging
import sys

import faust

from loraplane.config import get_settings
from schemas.codec import SchemaError, decode, encode
from schemas.request_log import RequestLog
from streams.app import app
from streams.scores import ScoreState, from_dict, is_burst, observe_log, score_key, to_dict

log = logging.getLogger(__name__)


def install_take_agent(batch: int, within_s: float) -> None:
    """Replace the real per-event agent with the batched one (same topic, same table)."""
    from streams import scoring_agent as real

    app.agents.pop(real.scoring_agent.name)

    @app.agent(real.requests_topic, name="bench.scoring_take")
    async def scoring_take(stream: faust.StreamT) -> None:
        async for events in stream.take_events(batch, within=within_s):
            touched: dict[str, ScoreState] = {}
            last_event: dict[str, faust.types.EventT] = {}
            for event in events:
                try:
                    request = decode(RequestLog, event.value)
                    if (event.key or b"") != request.adapter_id.encode():
                        raise SchemaError("key_mismatch", [("(key)", "not adapter_id")])
                except SchemaError as exc:
                    await real.dead_letter_topic.send(
                        key=event.key if isinstance(event.key, bytes) else None,
                        value=encode(real.dead_letter(real.requests_topic, event.message,
                                                      exc.reason, str(exc), "scoring")))
                    continue
                key = score_key(request.adapter_id, request.adapter_version)
                before = touched.get(key)
                if before is None:
                    stored = real.scores_table.get(key)
                    before = from_dict(stored) if stored is not None else ScoreState()
                after = touched[key] = observe_log(before, request)
                last_event[key] = event
                if is_burst(before, after, request.ts.timestamp()):
                    real.burst_seen.set()
            for key, state in touched.items():
                # A table write goes to the changelog partition of "the current event";
                # take_events leaves none set, so name the one that carried this key.
                stream._set_current_event(last_event[key])
                real.scores_table[key] = to_dict(state)
            stream._set_current_event(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=("per_event", "take"), default="per_event")
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--within-s", type=float, default=0.05)
    parser.add_argument("--linger-ms", type=int, default=0)
    args = parser.parse_args()
    from loraplane.commands.streams import ensure_changelog_topics
    from streams.app import load_agents

    get_settings().home.mkdir(parents=True, exist_ok=True)
    load_agents(["streams.scoring_agent"])
    if args.variant == "take":
        install_take_agent(args.batch, args.within_s)
    if args.linger_ms:
        app.conf.producer_linger = args.linger_ms / 1000
    ensure_changelog_topics(get_settings(), app)
    faust.Worker(app, loglevel="info", logfile=sys.stdout, stdout=sys.stdout,
                 stderr=sys.stdout).execute_from_commandline()


if __name__ == "__main__":
    main()
