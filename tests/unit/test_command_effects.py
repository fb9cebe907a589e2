"""The one table of command effects (loraplane.kernel.command_effects)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from loraplane.kernel.command_effects import (
    LEVEL,
    TABLE,
    Copy,
    Refusal,
    effect,
    may_protect,
    protected_copies,
    shows,
)
from loraplane.schemas.commands import CommandAction

COPIES = [Copy(), Copy("host"), Copy("host", True), Copy("gpu"), Copy("gpu", True)]
copies_st = st.sampled_from(COPIES)
actions_st = st.sampled_from(list(CommandAction))


def test_every_action_has_a_row() -> None:
    assert set(TABLE) == set(CommandAction)


def test_commands_say_where_the_copy_should_be() -> None:
    assert effect(CommandAction.pin, Copy()).after == Copy("host", True)
    assert effect(CommandAction.demote_to_host, Copy()).after == Copy("host")
    assert effect(CommandAction.prewarm_host, Copy("gpu", True)).after == Copy("gpu", True)
    assert effect(CommandAction.load_gpu, Copy("host", True)).after == Copy("gpu", True)
    assert effect(CommandAction.evict, Copy("gpu")).after == Copy()


@given(actions_st, copies_st)
def test_a_pinned_copy_never_moves_down_a_tier(action: CommandAction, before: Copy) -> None:
    outcome = effect(action, before)
    if before.pinned:
        assert LEVEL[outcome.after.tier] >= LEVEL[before.tier]
    if outcome.refused is not None:
        assert outcome.refused is Refusal.pinned and outcome.after == before
        assert action in (CommandAction.demote_to_host, CommandAction.evict)


@given(actions_st, copies_st)
def test_a_command_is_idempotent_and_then_shown(action: CommandAction, before: Copy) -> None:
    outcome = effect(action, before)
    if outcome.refused is None:
        assert effect(action, outcome.after).after == outcome.after
        assert shows(action, outcome.after)
    else:
        assert not shows(action, before)


NAMES = [f"n{i}" for i in range(6)]


@given(
    st.sets(st.sampled_from(NAMES)),
    st.permutations(NAMES),
    st.sets(st.sampled_from(NAMES)),
    st.integers(1, 4),
    st.permutations(NAMES),
)
def test_what_the_planner_expects_a_worker_may_protect_covers_what_it_does(
    held: set[str], asked: list[str], never_evict: set[str], cap: int, arrival: list[str]
) -> None:
    """The worker protects (``protected_copies``) from what it held and its copies in the
    order it was asked for them; the planner, which reported ``held`` and saw the copies but
    not that order, expects a superset whatever the order (``may_protect``), and exactly the
    worker's set once the reported ones fill the cap."""
    reported = protected_copies(held, asked, never_evict, cap)  # what the heartbeat says
    may = may_protect(reported, asked, never_evict, cap)
    later = protected_copies(reported, arrival, never_evict, cap)  # the copies, asked anew
    assert later <= may.copies
    assert len(reported) <= cap and reported <= never_evict
    if not may.room:
        assert later == reported == may.copies


def test_protection_is_sticky_and_capped() -> None:
    assert protected_copies((), ["a", "b", "c"], {"a", "b", "c"}, 2) == {"a", "b"}
    assert protected_copies({"c"}, ["a", "b", "c"], {"a", "b", "c"}, 2) == {"c", "a"}
    assert protected_copies({"c"}, ["a", "b"], {"a", "b", "c"}, 2) == {"a", "b"}  # c left
    assert protected_copies({"a"}, ["a", "b"], {"b"}, 2) == {"b"}  # a no longer never-evict
