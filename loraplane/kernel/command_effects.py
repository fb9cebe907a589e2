"""What a cache command does to one copy of a LoRA version on one worker: the one table.

The planner plans on top of what it expects a worker to hold once its pending commands
apply (``streams.planner``), and the worker folds the same commands into its desired state
(``workers.reconcile``). Both read this table, so they cannot disagree about a command.

A command is *declarative*: it says where the copy should be, whatever is there now
(``effect``). A pinned copy never moves down a tier (``Refusal.pinned``), so the planner
unpins before it unloads. A *protected* copy (``never_evict_rule``) refuses ``unpin``,
``demote_to_host`` and ``evict`` too (``Refusal.protected``): its pin is derived from the
registry and the policy, not commanded, so a signed command cannot take it off the GPU.
``pin`` and ``demote_to_host`` of a copy that is not there bring it to the host tier: the
worker folds into its desired state without looking at vLLM, so "no intent" there does not
mean "no copy". The table and the rules: docs/planner.md, "Cache commands", and
docs/worker.md, "The worker's own rules: never-evict and the warm-up cap".
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from typing import Literal

from loraplane.kernel.policy import Condition, Policy
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus
from loraplane.schemas.commands import CommandAction

__all__ = [
    "LEVEL",
    "SERVING",
    "TABLE",
    "UNPROTECTING",
    "Copy",
    "Effect",
    "MayProtect",
    "Refusal",
    "Rule",
    "Tier",
    "copy_at",
    "effect",
    "may_protect",
    "never_evict_rule",
    "protected_cap",
    "protected_copies",
    "record_facts",
    "shows",
]

Tier = Literal["gpu", "host", "gone"]
LEVEL: Mapping[Tier, int] = {"gone": 0, "host": 1, "gpu": 2}
"""Tiers from lowest to highest: a pinned copy never moves to a lower one."""


@dataclass(frozen=True)
class Copy:
    """Where a copy of one lora name is (or is expected to be) on one worker."""

    tier: Tier = "gone"
    pinned: bool = False

    @property
    def present(self) -> bool:
        """True when the copy takes host-tier bytes (a GPU copy is loaded from the host tier)."""
        return self.tier != "gone"


class Refusal(StrEnum):
    """Why a command changes nothing."""

    pinned = "pinned"  # it would move a pinned copy down a tier
    protected = "protected"  # it would unpin, demote or evict a never-evict copy


@dataclass(frozen=True)
class Rule:
    """One row of the table: ``tier`` sets the tier, ``at_least`` raises it to that tier,
    ``pinned`` sets the pin; ``None`` leaves that part as it is. ``met_in`` are the tiers in
    which a copy (with that pin) meets what the command asked for: what ``shows`` checks."""

    met_in: frozenset[Tier]
    tier: Tier | None = None
    at_least: Tier | None = None
    pinned: bool | None = None

    def target(self, before: Copy) -> Copy:
        tier = self.tier or before.tier
        if self.at_least is not None and LEVEL[tier] < LEVEL[self.at_least]:
            tier = self.at_least
        return Copy(tier, before.pinned if self.pinned is None else self.pinned)


_PRESENT: frozenset[Tier] = frozenset({"host", "gpu"})
TABLE: Mapping[CommandAction, Rule] = {
    CommandAction.prewarm_host: Rule(_PRESENT, at_least="host"),
    CommandAction.load_gpu: Rule(frozenset({"gpu"}), tier="gpu"),
    CommandAction.pin: Rule(_PRESENT, at_least="host", pinned=True),
    CommandAction.unpin: Rule(frozenset({"gone", "host", "gpu"}), pinned=False),
    # off the GPU is what a demote asks for: a copy the worker has since evicted meets it
    CommandAction.demote_to_host: Rule(frozenset({"gone", "host"}), tier="host"),
    CommandAction.evict: Rule(frozenset({"gone"}), tier="gone"),
}


@dataclass(frozen=True)
class Effect:
    """The copy after a command, or the copy unchanged and why the command was refused."""

    after: Copy
    refused: Refusal | None = None


UNPROTECTING = frozenset({CommandAction.unpin, CommandAction.demote_to_host, CommandAction.evict})
"""The actions a protected copy refuses."""


@cache
def effect(action: CommandAction, before: Copy, protected: bool = False) -> Effect:
    """What ``action`` does to ``before``; ``protected``: the copy is never-evict. Cached:
    there are only 6 x 6 x 2 cases, and the planner asks once per command it issues (~30k
    on a cold tick)."""
    after = TABLE[action].target(before)
    if protected and before.present and action in UNPROTECTING:
        return Effect(before, Refusal.protected)
    if before.pinned and LEVEL[after.tier] < LEVEL[before.tier]:
        return Effect(before, Refusal.pinned)
    return Effect(after)


SERVING = frozenset({AdapterStatus.active, AdapterStatus.canary})


def record_facts(record: AdapterRecord) -> dict[str, float | str | None]:
    """The condition facts a registry record alone decides (``kernel.policy.FACTS``), in the
    form the planner's columns give them (``streams.planner_columns``); the others
    (request-derived) are unknown, so a clause on them does not hold."""
    return {
        "status": str(record.status),
        "canary_percent": record.release.canary_percent,
        "tenant_priority": str(record.priority),
    }


def never_evict_rule(
    record: AdapterRecord | None, conditions: tuple[Condition, ...]
) -> Condition | None:
    """The first ``never_evict_when`` condition that holds for a serving ``record``
    (``Condition.holds``, the planner's own evaluation), or None."""
    if record is None or record.status not in SERVING:
        return None
    facts = record_facts(record)
    return next((c for c in conditions if c.holds(facts)), None)


def _kept(
    held: Iterable[str], on_worker: Container[str], never_evict: Container[str], cap: int
) -> list[str]:
    """The protected copies that stay protected: still never-evict and still held, by name,
    at most ``cap``."""
    return [n for n in sorted(held) if n in never_evict and n in on_worker][:cap]


def protected_copies(
    held: Iterable[str], asked: Iterable[str], never_evict: Container[str], cap: int
) -> frozenset[str]:
    """The worker's rule for which of its GPU copies are protected (``workers.reconcile``):
    those protected so far (``held``) that are still never-evict and meant for the GPU,
    then the other never-evict ones of ``asked`` (its GPU copies, in the order they were
    asked for), at most ``cap`` (``protected_cap``). Sticky, so a version published later
    does not take the guarantee from one already held."""
    asked = list(asked)
    kept = _kept(held, set(asked), never_evict, cap)
    for name in asked:
        if len(kept) >= cap:
            break
        if name in never_evict and name not in kept:
            kept.append(name)
    return frozenset(kept)


@dataclass(frozen=True)
class MayProtect:
    """What a worker may hold protected, seen from outside (``may_protect``)."""

    copies: frozenset[str]
    room: bool  # under its cap: a never-evict copy it is about to hold may be protected too


def may_protect(
    held: Iterable[str], copies: Iterable[str], never_evict: Container[str], cap: int
) -> MayProtect:
    """The copies a worker may hold protected (``protected_copies``) by the time a command
    reaches it, seen from outside (the planner): those it reported protected (``held``: its
    registry copy may still protect them when ours no longer does); and, unless those that
    stay protected fill ``cap``, every other never-evict copy it holds or is about to hold
    (``copies``), since which of them it protects depends on the order it was asked for them
    in, which only it knows. A command never moves one of these down (``UNPROTECTING``):
    the worker would refuse it."""
    copies = set(copies)
    held = frozenset(held)
    if len(_kept(held, copies, never_evict, cap)) >= cap:
        return MayProtect(held, False)
    return MayProtect(held.union(n for n in copies if n in never_evict), True)


def protected_cap(policy: Policy, slots: int) -> int:
    """How many never-evict versions may be protected (pinned, ranked first, refusing to move
    down) on ``slots`` GPU slots: the planner's cap per base model and each worker's own.
    Rounded up so that a share of a slot is a slot; the tolerance keeps ``0.3 * 10`` at 3."""
    return max(1, math.ceil(round(policy.max_protected_gpu_share * slots, 9)))


@cache
def copy_at(tier: Tier, pinned: bool) -> Copy:
    """The one ``Copy`` of each (tier, pin): hot paths build none."""
    return Copy(tier, pinned)


def shows(action: CommandAction, observed: Copy) -> bool:
    """Does ``observed`` (a worker's reported copy) meet what ``action`` asked for? Then the
    planner stops expecting the command. Every copy ``effect`` leaves meets it; a copy a
    command would refuse never does (it may be unpinned by a command before it, and then it
    applies). A demote is met by a copy that is gone too: the worker evicted it since."""
    rule = TABLE[action]
    return observed.tier in rule.met_in and (rule.pinned is None or observed.pinned == rule.pinned)
