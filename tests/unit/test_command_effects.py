"""The one table of command effects (loraplane.kernel.command_effects)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from loraplane.schemas.commands import CommandAction

from loraplane.kernel.command_effects import LEVEL, TABLE, Copy, Refusal, effect, shows

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
