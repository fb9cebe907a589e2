"""The registry agent: signed lifecycle events in, the adapter registry out.

It reads the lifecycle topic as raw bytes (so hostile bytes reach our decoder, not Faust's),
asks the pure ``registry.fold.evaluate`` for a decision, and then:
- accepted: the adapter's new state goes to the ``registry`` table (changelog-backed, rebuilt
  on restart) and its public view to the compacted registry topic, with its base model in
  a header (``registry.topic.view_headers``: consumers of other base models skip it);
- rejected: a DeadLetter with the reason, the detail and the original bytes;
- always: an AuditRecord of the decision.

Processing is at-least-once; a message redelivered after a crash is rejected by the replay
and seq checks instead of being applied twice. If the crash fell between the table write and
the registry-topic mirror, that replay re-sends the mirror, so the topic heals itself.
The keyring file (``settings.keyring_path``) is re-read whenever it changes.
"""

from __future__ import annotations

import logging

import faust

from loraplane.kernel.config import get_settings
from loraplane.kernel.topics import spec
from loraplane.registry.fold import Accepted, AdapterState, Decision, evaluate
from loraplane.registry.topic import view_headers
from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import encode
from loraplane.schemas.keyring import Keyring, KeyringError, KeyringFile
from loraplane.schemas.reasons import ConsumerFault
from loraplane.schemas.reasons import RegistryRejection as Reason
from loraplane.streams.app import app, dead_letter_of, raw_topic

__all__ = [
    "COMPONENT",
    "PARTITIONS",
    "adapter_state",
    "audit_topic",
    "dead_letter_topic",
    "keyring_file",
    "lifecycle_topic",
    "registry_agent",
    "registry_table",
    "registry_topic",
    "settings",
]

log = logging.getLogger(__name__)
settings = get_settings()
COMPONENT = "registry"


lifecycle_topic = raw_topic("lifecycle")
registry_topic = raw_topic("registry")
audit_topic = raw_topic("audit")
dead_letter_topic = raw_topic("dead-letters")

PARTITIONS = spec("lifecycle").partitions
"""The table's partitions, as declared for the lifecycle topic (Faust requires the topic's and
the table changelog's counts to be equal). An event is taken only on the partition its key
hashes to under the topic's count (the consumer's metadata, else this), where its adapter's
state lives."""

registry_table = app.Table(
    "registry",
    partitions=PARTITIONS,
    help="adapter_id -> AdapterState as JSON: versions, active version, seq, replay set",
)

keyring_file = KeyringFile(settings.keyring_path)


def adapter_state(adapter_id: str) -> AdapterState | None:
    """The table's state of one adapter (for this agent and the planner in the same app)."""
    raw = registry_table.get(adapter_id)
    return AdapterState.model_validate(raw) if raw is not None else None


def _keyring() -> Keyring | None:
    try:
        return keyring_file.current()
    except KeyringError as exc:
        log.error("keyring unavailable, rejecting lifecycle events: %s", exc)
        return None


async def _publish(decision: Decision, message: faust.types.Message, key: bytes | None) -> None:
    if isinstance(decision, Accepted):
        registry_table[decision.adapter_id] = decision.state.model_dump(mode="json")
        view = decision.state.view
        await registry_topic.send(
            key=decision.adapter_id.encode(), value=encode(view), headers=view_headers(view)
        )
    else:
        await dead_letter_topic.send(
            key=key,
            value=encode(dead_letter_of(message, COMPONENT, decision.reason, decision.detail)),
        )
        event = decision.event
        state = adapter_state(event.adapter_id) if event else None
        if (
            decision.reason is Reason.replayed_event_id
            and event is not None
            and state is not None
            and state.view.last_event_id == event.event_id
        ):
            await registry_topic.send(
                key=event.adapter_id.encode(),
                value=encode(state.view),
                headers=view_headers(state.view),
            )
    await audit_topic.send(
        key=decision.audit.adapter_id.encode() if decision.audit.adapter_id else key,
        value=encode(decision.audit),
    )


@app.agent(lifecycle_topic)
async def registry_agent(stream: faust.StreamT) -> None:
    async for event in stream.events():
        message = event.message
        raw = event.value if isinstance(event.value, bytes) else b""
        key = event.key if isinstance(event.key, bytes) else None
        try:
            decision = evaluate(
                raw,
                _keyring(),
                adapter_state,
                now_utc(),
                key=key or b"",
                placed=(
                    message.partition,
                    app.consumer.topic_partitions(message.topic) or PARTITIONS,
                ),
            )
            log.info(
                "lifecycle p%s@%s %s: %s %s",
                message.partition,
                message.offset,
                decision.audit.action,
                decision.audit.decision,
                decision.audit.reason,
            )
            await _publish(decision, message, key)
        except Exception as exc:  # a bug or a broken table must not drop the event silently
            log.exception("lifecycle p%s@%s: internal error", message.partition, message.offset)
            await dead_letter_topic.send(
                key=key,
                value=encode(
                    dead_letter_of(
                        message,
                        COMPONENT,
                        ConsumerFault.internal_error,
                        f"{type(exc).__name__}: {exc}",
                    )
                ),
            )
