"""The registry agent's decisions on lifecycle events this process sends, read from the
audit topic (``loraplane publish --wait-s``).

The registry decides asynchronously: a broker's acknowledgement says the event is on the
lifecycle topic, not that it was applied. The agent writes one audit record per decision
(``component: registry``, ``subject_event_id`` = the event's id), accepted or rejected, so
a publisher that wants the answer reads the audit topic from where it ended *before* the
events were sent and stops once every event has its record.
"""

from __future__ import annotations

from collections.abc import Collection
from contextlib import closing

from loraplane.kernel.bus import end_offsets, read_since
from loraplane.kernel.config import Settings
from loraplane.kernel.topics import topic_name
from loraplane.schemas.audit import AuditRecord
from loraplane.schemas.codec import SchemaError, decode

__all__ = ["COMPONENT", "DecisionWatch"]

COMPONENT = "registry"


class DecisionWatch:
    """Opened before the events are sent (so no decision can come before its start);
    ``KafkaUnavailable`` when the broker does not answer."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topic = topic_name(settings, "audit")
        self.offsets = end_offsets(settings, self.topic)

    def wait(self, event_ids: Collection[str], timeout_s: float) -> dict[str, AuditRecord]:
        """The registry's audit record of each of ``event_ids``: all of them as soon as they
        are there, else those seen within ``timeout_s``. A record that does not decode is
        skipped (the audit topic is not this reader's to judge)."""
        wanted = set(event_ids)
        found: dict[str, AuditRecord] = {}
        if not wanted:
            return found
        with closing(
            read_since(self.settings, self.topic, self.offsets, timeout_s=timeout_s)
        ) as records:
            for record in records:
                try:
                    audit = decode(AuditRecord, record.value)
                except SchemaError:
                    continue
                subject = audit.subject_event_id
                if audit.component == COMPONENT and subject in wanted and subject not in found:
                    found[subject] = audit
                    if len(found) == len(wanted):
                        break
        return found
