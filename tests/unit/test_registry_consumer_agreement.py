"""ATTACK tests: what the registry accepts, every consumer verifies.

The registry agent decides an event at its own clock (``now``); a consumer folds the same
event again from the view's evidence at the event's signed ``issued_at``
(``registry.evidence.verify_view``). An event the first accepts and the second refuses
wedges the adapter on every consumer for good: the event stays in the evidence of every
later view, so no later view verifies, a revoke included, and consumers keep serving the
view they held. A signer's clock a little behind (or a tenant's CI key on purpose) reaches
that through every check that reads the clock.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.lifecycle_events import signed_event
from loraplane.registry.evidence import ViewVerified, verify_view
from loraplane.registry.fold import Accepted, AdapterState, Rejected, evaluate
from loraplane.schemas.lifecycle import LifecycleAction, LifecycleEvent, seq_at
from loraplane.schemas.reasons import RegistryRejection as Reason
from tests.lifecycle_kit import BASE, TENANT, make_kit

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
KIT = make_kit(NOW)
AID = "wedge-bot"
LATER = NOW + timedelta(days=1, minutes=1)  # the "future" key is valid from NOW + 1 day


def published() -> AdapterState:
    event = KIT.event("ops", "publish", AID, "1", seq_at(NOW), NOW)
    decision = evaluate(event, KIT.keyring, lambda _a: None, NOW)
    assert isinstance(decision, Accepted), decision
    return decision.state


def promote(
    key: str, issued_at: datetime, seq: int, ttl: timedelta = timedelta(hours=1)
) -> LifecycleEvent:
    return signed_event(
        KIT.keys[key],
        LifecycleAction.promote,
        adapter_id=AID,
        tenant_id=TENANT,
        base_model=BASE,
        version="1",
        seq=seq,
        now=issued_at,
        ttl=ttl,
    )


def decide(event: LifecycleEvent, state: AdapterState, now: datetime) -> Accepted | Rejected:
    return evaluate(event, KIT.keyring, lambda _a: state, now)


def test_an_event_issued_before_its_keys_window_is_refused() -> None:
    """Valid at the registry's clock, not yet valid at its own issued_at."""
    issued = NOW + timedelta(days=1) - timedelta(minutes=1)
    decision = decide(promote("future", issued, seq_at(issued)), published(), LATER)
    assert isinstance(decision, Rejected)
    assert decision.reason is Reason.key_not_yet_valid


def test_an_event_issued_after_its_keys_window_is_refused() -> None:
    """Valid at the registry's clock, expired at its own issued_at (dated within the skew
    ahead): the key's window is checked there too, named by that instant."""
    end = NOW + timedelta(days=30)  # the "ops" key's not_after
    now, issued = end - timedelta(minutes=1), end + timedelta(minutes=2)
    decision = decide(promote("ops", issued, seq_at(issued)), published(), now)
    assert isinstance(decision, Rejected)
    assert decision.reason is Reason.key_expired
    assert "at issued_at" in decision.detail


def test_a_seq_ahead_of_its_issued_at_is_refused() -> None:
    """Within the registry's clock, ahead of the event's own issued_at by over the skew."""
    issued = LATER - timedelta(hours=1)
    event = promote("ops", issued, seq_at(LATER), ttl=timedelta(hours=2))
    decision = decide(event, published(), LATER)
    assert isinstance(decision, Rejected)
    assert decision.reason is Reason.seq_from_future


def test_an_event_id_of_the_history_is_never_taken_again() -> None:
    """The first event has expired at the registry's clock and left its replay set (a
    later event pruned it), but not at the issued_at of the events after it."""
    state = published()
    first = state.view.evidence[0]
    later = first.expires_at + timedelta(hours=1)
    between = promote(
        "ops", first.issued_at + timedelta(minutes=1), first.seq + 1, timedelta(days=2)
    )
    accepted = decide(between, state, later)
    assert isinstance(accepted, Accepted), accepted
    assert first.event_id not in accepted.state.seen
    again = signed_event(
        KIT.keys["ops"],
        LifecycleAction.retire,
        adapter_id=AID,
        tenant_id=TENANT,
        base_model=BASE,
        version="1",
        seq=first.seq + 2,
        now=first.issued_at + timedelta(minutes=5),
        ttl=timedelta(days=2),
    )
    again = KIT.keys["ops"].sign(again.model_copy(update={"event_id": first.event_id}))
    decision = decide(again, accepted.state, later)
    assert isinstance(decision, Rejected)
    assert decision.reason is Reason.replayed_event_id


@settings(max_examples=200, deadline=None)
@given(
    key=st.sampled_from(["ops", "ci", "future", "expired"]),
    issued_back_s=st.integers(-300, 8 * 86_400),
    seq_back_s=st.integers(-300, 86_400),
    reuse_id=st.booleans(),
)
def test_what_the_registry_accepts_every_consumer_verifies(
    key: str, issued_back_s: int, seq_back_s: int, reuse_id: bool
) -> None:
    state = published()
    issued = LATER - timedelta(seconds=issued_back_s)
    ttl = min(timedelta(days=7), max(timedelta(hours=1), LATER - issued + timedelta(minutes=1)))
    event = promote(key, issued, seq_at(LATER - timedelta(seconds=seq_back_s)), ttl)
    if reuse_id:
        event = KIT.keys[key].sign(
            event.model_copy(update={"event_id": state.view.evidence[0].event_id})
        )
    decision = decide(event, state, LATER)
    if isinstance(decision, Accepted):
        verdict = verify_view(decision.state.view, KIT.keyring, LATER)
        assert isinstance(verdict, ViewVerified), verdict
