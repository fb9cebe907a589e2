"""The output layer of ``loraplane publish``: what it did so far, and how that is said.

stdout carries the ``PublishResult`` object and nothing else (on success always; with
``--json`` whatever happened); stderr carries progress lines and, on failure, the error in
words (and a traceback for an internal error); the exit code is the outcome's
(``schemas.publish_result``). A step raises ``PublishFailed`` with its ``PublishFailure``
code; everything already done (the artifact, the events the broker acknowledged) stays in
the result, so a failure after an event went out says which one did.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import typer

from loraplane.schemas.publish_result import (
    ArtifactRefusal,
    PublishError,
    PublishResult,
    RegistryDecision,
    SentEvent,
)
from loraplane.schemas.reasons import PublishFailure

if TYPE_CHECKING:
    from loraplane.artifact.refusal import Refusal
    from loraplane.schemas.adapter import AdapterRecord
    from loraplane.schemas.audit import AuditRecord
    from loraplane.schemas.lifecycle import LifecycleEvent

__all__ = ["PublishFailed", "PublishReport"]


class PublishFailed(Exception):
    """A step of publish failed; ``code`` decides the outcome and so the exit code."""

    def __init__(
        self, code: PublishFailure, message: str, refusals: Iterable[Refusal] = ()
    ) -> None:
        super().__init__(message)
        self.code, self.message = code, message
        self.refusals = [
            ArtifactRefusal(reason=r.reason, path=r.path, detail=r.detail) for r in refusals
        ]


class PublishReport:
    """What one publish has done so far; ``running()`` turns it into the command's output."""

    def __init__(
        self,
        adapter_id: str,
        version: str,
        *,
        tenant_id: str | None,
        base_model: str | None,
        json_output: bool,
    ) -> None:
        self.adapter_id, self.version, self.json_output = adapter_id, version, json_output
        self.fields: dict[str, Any] = {"tenant_id": tenant_id, "base_model": base_model}
        self.record: AdapterRecord | None = None
        self.events: list[SentEvent] = []
        self.registry: list[RegistryDecision] | None = None

    @staticmethod
    def progress(message: str) -> None:
        typer.echo(f"publish: {message}", err=True)

    def artifact(self, record: AdapterRecord) -> None:
        self.record = record

    def sent(self, event: LifecycleEvent, partition: int, offset: int) -> None:
        self.events.append(
            SentEvent(
                action=event.action,
                event_id=event.event_id,
                seq=event.seq,
                partition=partition,
                offset=offset,
            )
        )
        if event.action == "publish":
            self.fields |= {"event_id": event.event_id, "seq": event.seq}
        else:
            self.fields[f"{event.action}_event_id"] = event.event_id
        self.progress(
            f"the broker acknowledged {event.action} event {event.event_id} "
            f"(partition {partition}, offset {offset})"
        )

    def decided(self, audits: dict[str, AuditRecord]) -> list[RegistryDecision]:
        """Record the registry's decisions on the sent events (in their order); returns the
        rejected ones."""
        self.registry = [
            RegistryDecision(
                event_id=a.subject_event_id or e.event_id,
                action=a.action,
                decision="accepted" if a.decision == "accepted" else "rejected",
                reason=a.reason,
                detail=a.detail,
            )
            for e in self.events
            if (a := audits.get(e.event_id)) is not None
        ]
        for d in self.registry:
            self.progress(
                f"the registry {d.decision} {d.action} event {d.event_id}"
                + (f": {d.why}" if d.reason else "")
            )
        return [d for d in self.registry if d.decision == "rejected"]

    def result(self, error: PublishError | None = None) -> PublishResult:
        return PublishResult.build(
            self.adapter_id,
            self.version,
            error=error,
            record=self.record,
            events=self.events,
            registry=self.registry,
            **self.fields,
        )

    @contextmanager
    def running(self) -> Iterator[PublishReport]:
        """The command's body runs inside: its ``PublishFailed`` (or any other exception,
        as ``internal_error``) becomes the output and exit code; a normal end is success."""
        try:
            yield self
        except PublishFailed as exc:
            self._finish(PublishError(code=exc.code, message=exc.message, refusals=exc.refusals))
        except typer.Exit:
            raise  # a step that ends the command itself has said why already
        except Exception as exc:
            traceback.print_exc()
            self._finish(
                PublishError(
                    code=PublishFailure.internal_error, message=f"{type(exc).__name__}: {exc}"
                )
            )
        else:
            self._finish(None)

    def _finish(self, error: PublishError | None) -> None:
        result = self.result(error)
        if error is not None:
            typer.echo(f"error: {error.message}", err=True)
        if error is None or self.json_output:
            typer.echo(json.dumps(result.model_dump(mode="json")))
        if result.exit_code:
            raise typer.Exit(result.exit_code)
