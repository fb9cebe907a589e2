"""Verifying a registry view where it is used: fold its signed evidence again. Pure.

The registry topic is only a transport: anyone who can write to it can write any
``AdapterView``. A view therefore carries the signed lifecycle events that produced it
(``AdapterView.evidence``), and a consumer accepts it only when folding those events through
the registry's own ``registry.fold.evaluate``, with the consumer's own keyring, yields
exactly that view: an edited field folds into a different view, a forged or out-of-scope
event is refused. Each event is evaluated at its own signed ``issued_at``, so a view stays
verifiable after its events expire; a revoked key is refused at any time. ``verify_view``
also refuses a view whose history does not extend the one the consumer accepted before
(``previous``: rollback and freeze, as in TUF); a consumer that never saw the newer view
cannot tell. docs/lifecycle.md, "Signed all the way to the worker".
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from loraplane.registry.fold import CLOCK_SKEW, AdapterState, Rejected, evaluate
from loraplane.schemas.keyring import Keyring
from loraplane.schemas.reasons import RegistryViewRejection as ViewReason
from loraplane.schemas.registry import AdapterView

__all__ = ["Checkpoint", "ViewRefused", "ViewVerdict", "ViewVerified", "verify_view"]


@dataclass(frozen=True)
class Checkpoint:
    """What a consumer remembers of the last view it accepted for one adapter: enough to
    refuse an older or a forked history (a few bytes per event, persisted by workers)."""

    adapter_id: str
    last_seq: int
    event_ids: tuple[str, ...]

    @classmethod
    def from_view(cls, view: AdapterView) -> Checkpoint:
        return cls(view.adapter_id, view.last_seq, tuple(e.event_id for e in view.evidence))


@dataclass(frozen=True)
class ViewVerified:
    view: AdapterView
    checkpoint: Checkpoint


@dataclass(frozen=True)
class ViewRefused:
    reason: ViewReason
    detail: str


ViewVerdict = ViewVerified | ViewRefused


def verify_view(
    view: AdapterView, keyring: Keyring | None, now: datetime, previous: Checkpoint | None = None
) -> ViewVerdict:
    """Accept ``view`` only if its evidence, folded with ``keyring``, is exactly it and it
    does not go back from ``previous``. Never raises for a well-typed view."""
    if keyring is None:
        return ViewRefused(ViewReason.keyring_unavailable, "the keyring could not be read")
    if not view.evidence:
        return ViewRefused(
            ViewReason.no_evidence,
            f"{view.adapter_id}: the view carries no signed lifecycle events",
        )
    for n, event in enumerate(view.evidence):
        if event.adapter_id != view.adapter_id:
            return ViewRefused(
                ViewReason.foreign_evidence,
                f"event {n} ({event.event_id}) is of adapter {event.adapter_id}, "
                f"not {view.adapter_id}",
            )
        if event.issued_at > now + CLOCK_SKEW:
            return ViewRefused(
                ViewReason.evidence_rejected,
                f"event {n} ({event.event_id}): issued_at {event.issued_at} is ahead of now",
            )
    refused = _goes_back(view, previous)
    if refused is not None:
        return refused
    state: AdapterState | None = None

    def current(_adapter_id: str) -> AdapterState | None:
        return state

    for n, event in enumerate(view.evidence):
        try:
            decision = evaluate(event, keyring, current, event.issued_at, admitting=False)
        except ValueError as exc:  # a state the schema refuses: never raise to the caller
            return ViewRefused(
                ViewReason.evidence_rejected, f"event {n} ({event.event_id}): {exc}"[:2048]
            )
        if isinstance(decision, Rejected):
            return ViewRefused(
                ViewReason.evidence_rejected,
                f"event {n} ({event.event_id}, {event.action}): "
                f"{decision.reason}: {decision.detail}"[:2048],
            )
        state = decision.state
    assert state is not None  # evidence is not empty
    derived = state.view.model_copy(update={"updated_at": view.updated_at})
    if derived != view:
        return ViewRefused(
            ViewReason.mismatch, f"{view.adapter_id}: " + _differences(derived, view)
        )
    return ViewVerified(view, Checkpoint.from_view(view))


def _goes_back(view: AdapterView, previous: Checkpoint | None) -> ViewRefused | None:
    if previous is None:
        return None
    if view.last_seq < previous.last_seq:
        return ViewRefused(
            ViewReason.rollback,
            f"{view.adapter_id}: last_seq {view.last_seq} is older than the "
            f"accepted {previous.last_seq}",
        )
    ids = tuple(e.event_id for e in view.evidence)
    if ids[: len(previous.event_ids)] != previous.event_ids:
        return ViewRefused(
            ViewReason.rollback,
            f"{view.adapter_id}: the history does not extend the "
            f"{len(previous.event_ids)} events accepted before",
        )
    return None


def _differences(derived: AdapterView, carried: AdapterView) -> str:
    """Which fields differ (for the dead letter's detail; never the values' full text)."""
    fields = [
        name
        for name in AdapterView.model_fields
        if getattr(derived, name) != getattr(carried, name)
    ]
    if "versions" in fields:
        ours = {r.version: r for r in derived.versions}
        for r in carried.versions:
            mine = ours.get(r.version)
            changed = (
                [k for k in type(r).model_fields if getattr(mine, k) != getattr(r, k)]
                if mine is not None
                else ["(not published by the evidence)"]
            )
            if changed:
                fields.append(f"version {r.version}: {', '.join(changed)}")
    return "the signed events fold into another view (differs in " + "; ".join(fields) + ")"
