"""Desired versus actual LoRA state of one worker, as a pure function (no I/O).

The agent is a Kubernetes-style controller: commands from the planner, loads the gateway
asks for on a cold request, and what its actions found out fold into a *desired* state
through one reducer (``fold``; ``kernel.command_effects`` says what each command does to a
copy); vLLM's ``GET /v1/models`` and the host tier's entries are the *actual* state;
``reconcile`` returns the actions that move the second towards the first. Because both
inputs are plain values, the same inputs always give the same actions, a redelivered
command changes nothing (``command_id`` dedup, across restarts through
workers/applied_commands.py), and the rules are testable without a server: a name vLLM
serves that this agent cannot vouch for is unloaded at once, a revoked version too, any other
only once drained; cold loads stay within the budget; and the worker's own ``Guard``
(never-evict, derived from its registry copy and the policy, never from a command) and its
``gpu_slots`` (``make_room``) hold whoever asks. The rules: docs/worker.md, "The reconcile loop".
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from functools import partial

from loraplane.kernel.command_effects import (
    LEVEL,
    Copy,
    Tier,
    effect,
    never_evict_rule,
    protected_cap,
    protected_copies,
)
from loraplane.kernel.policy import Policy
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus
from loraplane.schemas.base import LORA_NAME_RE, lora_name
from loraplane.schemas.commands import CacheCommand, CommandAction
from loraplane.schemas.reasons import IntentRefusal, UnloadReason
from loraplane.schemas.worker_state import CopyOrigin
from loraplane.workers.demand_admission import give_up_order
from loraplane.workers.host_tier_entry import is_resolver_copy

__all__ = [
    "DEFAULT_WARMUP_REQUESTS",
    "IDLE",
    "MAX_CONFLICTS_PER_TICK",
    "MAX_REMEMBERED_COMMANDS",
    "NO_PROTECTION",
    "WINDOW_S",
    "Action",
    "ActualState",
    "Ask",
    "BusyRetry",
    "Change",
    "CommandSkip",
    "Conflict",
    "DesiredState",
    "Fetch",
    "Guard",
    "GuardChanged",
    "HostEntry",
    "Intent",
    "Load",
    "LoadBudget",
    "Outcome",
    "Refuse",
    "RemoveHost",
    "Settled",
    "Unload",
    "Usage",
    "Vanished",
    "adopt",
    "apply_command",
    "ask",
    "fold",
    "make_room",
    "may_move_down",
    "overridden",
    "protect",
    "reconcile",
    "registry_by_name",
    "remember",
    "settle",
    "settled_by",
    "vouched",
]

MAX_REMEMBERED_COMMANDS = 10_000
MAX_CONFLICTS_PER_TICK = 64
"""Names vLLM serves that the agent cannot vouch for, unloaded per tick at most: a vLLM that
lists a flood of them gets them unloaded over several ticks, each of bounded length, rather
than one tick of unbounded length holding the agent's lock."""
WINDOW_S = 60.0


@dataclass(frozen=True)
class Intent:
    """Where one lora name should be, and who asked."""

    lora_name: str
    adapter_id: str
    version: str
    tenant_id: str
    tier: Tier
    pinned: bool = False
    command_id: str | None = None  # the command that last changed it (None: gateway/adopted)
    warmup_requests: int = 0  # golden-set requests to send after each load (canary versions)
    origin: CopyOrigin = CopyOrigin.adopted
    unload_reason: UnloadReason | None = None  # the worker's own (slot_needed), else derived

    @property
    def copy(self) -> Copy:
        return Copy(self.tier, self.pinned)


@dataclass(frozen=True)
class DesiredState:
    intents: Mapping[str, Intent] = field(default_factory=dict)
    seen_commands: Mapping[str, datetime] = field(default_factory=dict)  # applied id -> deadline
    protected: frozenset[str] = frozenset()  # the never-evict GPU copies (``protect``)

    def with_intent(self, intent: Intent) -> DesiredState:
        return replace(self, intents={**self.intents, intent.lora_name: intent})

    def without(self, name: str) -> DesiredState:
        return replace(self, intents={k: v for k, v in self.intents.items() if k != name})


def remember(
    seen: Mapping[str, datetime], command_id: str, deadline: datetime, now: datetime
) -> dict[str, datetime]:
    """``seen`` plus ``command_id``, less the ids whose deadline has passed: a redelivered
    expired command is skipped as ``expired`` anyway, so forgetting it keeps the promise
    while the set stays bounded. Past MAX_REMEMBERED_COMMANDS the earliest deadlines go."""
    kept = {cid: d for cid, d in seen.items() if d >= now}
    if deadline >= now:
        kept[command_id] = deadline
    if len(kept) > MAX_REMEMBERED_COMMANDS:
        kept = dict(sorted(kept.items(), key=lambda kv: kv[1])[-MAX_REMEMBERED_COMMANDS:])
    return kept


class CommandSkip(StrEnum):
    """Why a change left the desired state as it was."""

    duplicate = "duplicate"  # a command id already applied
    other_worker = "other_worker"
    base_model_mismatch = "base_model_mismatch"
    expired = "expired"  # past its deadline
    lora_name_mismatch = "lora_name_mismatch"  # the name is not adapter@version-sha8
    tenant_mismatch = "tenant_mismatch"  # the name's intent belongs to another tenant
    pinned = "pinned"  # it would move a pinned copy down a tier (command_effects.Refusal)
    protected = "protected"  # it would unpin/demote/evict a never-evict copy (the Guard)
    already_desired = "already_desired"  # a gateway ask the desired state already meets
    no_free_slot = "no_free_slot"  # a load, but every GPU copy is pinned, protected or busy
    # a request's load, but every copy that could give its slot had more recent demand here
    busier_copies = "busier_copies"
    # a load, but every copy that could give its slot is kept by the policy's
    # min_residency_s (``_resident``)
    min_residency = "min_residency"
    # it would fetch or load a version whose fetch or load was refused within the worker's
    # refusal hold (``Usage.held``): the same bytes would be refused the same way again
    refusal_held = "refusal_held"


DEFAULT_WARMUP_REQUESTS = Policy().request_budgets.canary.warmup_requests


@dataclass(frozen=True)
class Guard:
    """What no command decides on this worker, derived from its registry copy, the policy
    and its config (``Guard.of``): which versions are never-evict (lora name -> the
    ``never_evict_when`` condition that holds), how many GPU copies may be protected at
    once, the most golden-set requests one load may send, and how many GPU slots it has
    (None: no limit, for callers that only fold)."""

    never_evict: Mapping[str, str] = field(default_factory=dict)
    max_protected: int = 0
    max_warmup_requests: int = DEFAULT_WARMUP_REQUESTS
    gpu_slots: int | None = None
    min_residency_s: float = 0.0  # a load takes no slot of a copy loaded sooner (``_resident``)

    @classmethod
    def of(cls, registry: Mapping[str, AdapterRecord], policy: Policy, gpu_slots: int) -> Guard:
        conditions = policy.never_evict
        never_evict = {}
        for name, record in registry.items():
            rule = never_evict_rule(record, conditions)
            if rule is not None:
                never_evict[name] = rule.text
        return cls(
            never_evict,
            protected_cap(policy, gpu_slots),
            policy.request_budgets.canary.warmup_requests,
            gpu_slots,
            policy.min_residency_s,
        )


def protect(state: DesiredState, guard: Guard) -> DesiredState:
    """Which GPU copies are protected now (``command_effects.protected_copies``, the rule
    the planner expects: ``command_effects.may_protect``): those already protected whose
    version is still never-evict, then the others meant for the GPU in the order they were
    asked for, up to ``guard.max_protected``."""
    protected = protected_copies(
        state.protected,
        (n for n, i in state.intents.items() if i.tier == "gpu"),
        guard.never_evict,
        guard.max_protected,
    )
    return state if protected == state.protected else replace(state, protected=protected)


NO_PROTECTION = Guard()


@dataclass(frozen=True)
class Usage:
    """What the fold needs of the actual state to pick a slot's victim (``make_room``):
    in-flight requests per name, and when each was last used or loaded (any clock, larger
    is later; a name without one is the least recently used)."""

    in_flight: Mapping[str, int] = field(default_factory=dict)
    last_used: Mapping[str, float] = field(default_factory=dict)
    admits: Callable[[str, str], bool] | None = None
    """May a request's demand load of the first name take the slot of the second
    (``demand_admission``)? None: any copy that may move down."""
    demand: Callable[[str], float] | None = None
    """A name's priority-weighted recent demand here: a request's load then takes the slot
    of ``demand_admission.give_up_order``'s first copy; None: the least recently used."""
    loaded_at: Mapping[str, float] = field(default_factory=dict)
    """When each GPU copy was loaded here, on the clock of ``now`` (none: found at start)."""
    now: float = 0.0
    held: Mapping[str, Tier] = field(default_factory=dict)
    """The names under a refusal hold, each with the lowest tier the hold refuses: ``host``
    when its artifact was refused (no fetch, no load), ``gpu`` when vLLM's loader refused
    it (no load). An ask that would raise the copy to that tier or above is skipped as
    ``refusal_held``."""

    def settled(self, name: str, guard: Guard) -> bool:
        """Is the copy past ``guard.min_residency_s`` since its load (or of unknown load)?"""
        at = self.loaded_at.get(name)
        return at is None or self.now - at >= guard.min_residency_s


IDLE = Usage()


def may_move_down(state: DesiredState, name: str, usage: Usage) -> bool:
    """A GPU copy the worker may demote on its own: not pinned, not protected, idle."""
    intent = state.intents.get(name)
    return (
        intent is not None
        and intent.tier == "gpu"
        and not intent.pinned
        and name not in state.protected
        and usage.in_flight.get(name, 0) == 0
    )


def make_room(
    state: DesiredState,
    guard: Guard,
    usage: Usage,
    keep: str | None = None,
    may_take: Callable[[str], bool] | None = None,
) -> tuple[DesiredState, bool]:
    """``state`` with its least recently used GPU copies that may move down
    (``may_move_down``, and ``may_take``, if given; never ``keep``, the one being loaded)
    demoted to the host tier with reason ``slot_needed``, until at most ``guard.gpu_slots``
    GPU intents are left; and whether that many are left (False: too few could move, and as
    many as could did)."""
    if guard.gpu_slots is None:
        return state, True
    on_gpu = [n for n, i in state.intents.items() if i.tier == "gpu"]
    excess = len(on_gpu) - guard.gpu_slots
    if excess <= 0:
        return state, True
    movable = sorted(
        (
            n
            for n in on_gpu
            if n != keep and may_move_down(state, n, usage) and (may_take is None or may_take(n))
        ),
        key=_order(state, usage),
    )
    for name in movable[:excess]:
        state = state.with_intent(
            replace(
                state.intents[name],
                tier="host",
                command_id=None,
                unload_reason=UnloadReason.slot_needed,
            )
        )
    return state, len(movable) >= excess


def _order(state: DesiredState, usage: Usage) -> Callable[[str], tuple[object, ...]]:
    """Which copy gives up its slot first: by ``demand_admission.give_up_order`` when the
    demand is known, else the least recently used."""
    demand, used = usage.demand, usage.last_used
    if demand is None:
        return lambda n: (used.get(n, float("-inf")), n)
    return lambda n: give_up_order(
        n,
        planned=state.intents[n].origin is CopyOrigin.planner,
        demand=demand(n),
        last_used=used.get(n, float("-inf")),
    )


@dataclass(frozen=True)
class Ask:
    """A request to move one lora name, in the words of a cache command: from the planner
    (a ``CacheCommand``, checked by ``apply_command``) or from this worker's gateway."""

    action: CommandAction
    lora_name: str
    adapter_id: str
    version: str
    tenant_id: str
    origin: CopyOrigin
    command_id: str | None = None
    warmup_requests: int | None = None  # None: keep the intent's

    @classmethod
    def of_command(
        cls, cmd: CacheCommand, max_warmup_requests: int = DEFAULT_WARMUP_REQUESTS
    ) -> Ask:
        """The command's ask; its ``warmup_requests`` clamped to the policy's."""
        return cls(
            cmd.action,
            cmd.lora_name,
            cmd.adapter_id,
            cmd.version,
            cmd.tenant_id,
            CopyOrigin.planner,
            cmd.command_id,
            min(cmd.warmup_requests, max_warmup_requests)
            if cmd.action is CommandAction.load_gpu
            else None,
        )

    @classmethod
    def gateway_load(cls, record: AdapterRecord) -> Ask:
        """A request found ``record`` cold: load it."""
        return cls(
            CommandAction.load_gpu,
            record.lora_name,
            record.adapter_id,
            record.version,
            record.tenant_id,
            CopyOrigin.gateway_request,
        )

    @classmethod
    def gateway_prefetch(cls, record: AdapterRecord) -> Ask:
        """A request found ``record`` cold on a worker whose GPU slots are all taken, and its
        bytes are not in the host tier yet: fetch and verify them first. A GPU copy gives up
        its slot only for a version that is ready to load, so a version whose artifact cannot
        be fetched never pushes a hot copy out."""
        return cls(
            CommandAction.prewarm_host,
            record.lora_name,
            record.adapter_id,
            record.version,
            record.tenant_id,
            CopyOrigin.gateway_request,
        )


class Settled(StrEnum):
    """What executing an action found out about an intent, reported back to the one writer."""

    removed = "removed"  # its host copy was deleted: an evict is done
    revoked = "revoked"  # the version was revoked and removed everywhere
    refused = "refused"  # the registry or the artifact cannot back it


@dataclass(frozen=True)
class Outcome:
    lora_name: str
    settled: Settled


@dataclass(frozen=True)
class GuardChanged:
    """The registry copy (or the policy) changed: protection is decided again."""


Change = CacheCommand | Ask | Outcome | GuardChanged
"""Everything that changes a worker's desired state."""


def ask(
    state: DesiredState, request: Ask, guard: Guard = NO_PROTECTION, usage: Usage = IDLE
) -> tuple[DesiredState, CommandSkip | None]:
    """Fold one ask into the desired state (``kernel.command_effects``; a copy the guard
    protects refuses to move down; one that would raise a copy to a tier its refusal hold
    refuses is skipped: ``Usage.held``). A gateway ask that would not move the copy changes
    nothing: the planner's word (its command id, a canary's warm-up) stays with the intent.
    A copy raised to the GPU takes a slot (``make_room``), or the ask is refused."""
    current = state.intents.get(request.lora_name) or Intent(
        request.lora_name, request.adapter_id, request.version, request.tenant_id, "gone"
    )
    if current.tenant_id != request.tenant_id:  # a key scoped to one tenant names another's
        return state, CommandSkip.tenant_mismatch
    outcome = effect(request.action, current.copy, protected=request.lora_name in state.protected)
    if outcome.refused is not None:
        return state, CommandSkip(outcome.refused.value)
    held = usage.held.get(request.lora_name)
    if held is not None and LEVEL[outcome.after.tier] >= LEVEL[held]:
        return state, CommandSkip.refusal_held
    if request.origin is CopyOrigin.gateway_request and outcome.after == current.copy:
        return state, CommandSkip.already_desired
    warmup = current.warmup_requests if request.warmup_requests is None else request.warmup_requests
    after = state.with_intent(
        replace(
            current,
            tier=outcome.after.tier,
            pinned=outcome.after.pinned,
            warmup_requests=warmup,
            command_id=request.command_id,
            origin=request.origin,
            unload_reason=None,
        )
    )
    if outcome.after.tier == "gpu" and current.tier != "gpu":
        name = request.lora_name
        urgent = _protected_here(state, guard, name)
        may_take = partial(_may_take, request, state, guard, usage, urgent)
        room, fits = make_room(after, guard, usage, keep=name, may_take=may_take)
        if not fits:
            return state, _no_slot(after, guard, usage, request, urgent)
        after = room
    return after, None


def _protected_here(state: DesiredState, guard: Guard, name: str) -> bool:
    """Would a GPU copy of ``name`` be protected here (never-evict, and room under the cap)?
    Only such a load may take the slot of a copy within the minimum residency: one the
    worker would not protect is an ordinary copy, and two of them would take each other's
    slot in turn."""
    return name in guard.never_evict and (
        name in state.protected or len(state.protected) < guard.max_protected
    )


def _resident(request: Ask, state: DesiredState, guard: Guard, usage: Usage, victim: str) -> bool:
    """Does the minimum residency keep ``victim``'s slot from ``request``'s load? A copy
    loaded here within ``min_residency_s``: from a planner's load any such copy, from a
    request's own load one the planner asked for (the copies requests loaded compete for
    their slots by recency and demand admission alone, so a lost worker's hot versions find
    slots on the others at once)."""
    if usage.settled(victim, guard):
        return False
    if request.origin is not CopyOrigin.gateway_request:
        return True
    intent = state.intents.get(victim)
    return intent is not None and intent.origin is CopyOrigin.planner


def _may_take(
    request: Ask, state: DesiredState, guard: Guard, usage: Usage, urgent: bool, victim: str
) -> bool:
    """May ``request``'s load take ``victim``'s slot: one the minimum residency does not
    keep (``_resident``; any for an ``urgent`` load: ``_protected_here``), and for a
    request's own load one that demand admission (if on) lets it replace."""
    if not urgent and _resident(request, state, guard, usage, victim):
        return False
    return (
        request.origin is not CopyOrigin.gateway_request
        or usage.admits is None
        or usage.admits(request.lora_name, victim)
    )


def _no_slot(
    state: DesiredState, guard: Guard, usage: Usage, request: Ask, urgent: bool
) -> CommandSkip:
    """Why ``request``'s load found no slot in ``state``: no copy may move at all
    (``no_free_slot``), those that may were all kept by the minimum residency
    (``min_residency``), or admission lets it replace none of the rest (``busier_copies``)."""
    name = request.lora_name
    if not make_room(state, guard, usage, keep=name)[1]:
        return CommandSkip.no_free_slot
    if (
        not urgent
        and not make_room(
            state,
            guard,
            usage,
            keep=name,
            may_take=lambda v: not _resident(request, state, guard, usage, v),
        )[1]
    ):
        return CommandSkip.min_residency
    return CommandSkip.busier_copies


def apply_command(
    state: DesiredState,
    cmd: CacheCommand,
    *,
    worker_id: str,
    base_model: str,
    now: datetime,
    guard: Guard = NO_PROTECTION,
    usage: Usage = IDLE,
) -> tuple[DesiredState, CommandSkip | None]:
    """Fold one command into the desired state. Returns the new state and, when the command
    changed nothing, why (``duplicate``, ``other_worker``, ``expired``, ...)."""
    if cmd.command_id in state.seen_commands:
        return state, CommandSkip.duplicate
    state = replace(
        state, seen_commands=remember(state.seen_commands, cmd.command_id, cmd.deadline, now)
    )
    if cmd.worker_id != worker_id:
        return state, CommandSkip.other_worker
    if cmd.base_model != base_model:
        return state, CommandSkip.base_model_mismatch
    if cmd.deadline < now:
        return state, CommandSkip.expired
    if cmd.lora_name != lora_name(cmd.adapter_id, cmd.version, cmd.sha256):
        return state, CommandSkip.lora_name_mismatch
    return ask(state, Ask.of_command(cmd, guard.max_warmup_requests), guard, usage)


def overridden(before: DesiredState, after: DesiredState) -> list[str]:
    """The planner commands a fold from ``before`` to ``after`` undid by the worker's own slot
    rule (``make_room``: their copy gave its GPU slot to another load): they will not be
    carried out, so the worker reports them (``WorkerState.skipped_commands``)."""
    return [
        cid
        for name, intent in after.intents.items()
        if intent.unload_reason is UnloadReason.slot_needed
        and (old := before.intents.get(name)) is not None
        and old.tier == "gpu"
        and (cid := old.command_id) is not None
    ]


def settle(state: DesiredState, outcome: Outcome) -> DesiredState:
    """Forget an intent that is done (an evict whose copy is gone) or cannot be met."""
    intent = state.intents.get(outcome.lora_name)
    if intent is None or (outcome.settled is Settled.removed and intent.tier != "gone"):
        return state
    return state.without(outcome.lora_name)


def fold(
    state: DesiredState,
    change: Change,
    *,
    worker_id: str,
    base_model: str,
    now: datetime,
    guard: Guard = NO_PROTECTION,
    usage: Usage = IDLE,
) -> tuple[DesiredState, CommandSkip | None]:
    """The one reducer of a worker's desired state: the state after ``change`` and, when it
    changed nothing, why. ``guard``: the worker's own rules (never-evict, warm-up cap, GPU
    slots); ``usage``: in-flight and recency, for choosing which copy gives up a slot."""
    skipped: CommandSkip | None = None
    match change:
        case CacheCommand():
            state, skipped = apply_command(
                state,
                change,
                worker_id=worker_id,
                base_model=base_model,
                now=now,
                guard=guard,
                usage=usage,
            )
        case Ask():
            state, skipped = ask(state, change, guard, usage)
        case Outcome():
            state = settle(state, change)
        case GuardChanged():  # fewer slots, or an adopted state over them: fit if we can
            state, _ = make_room(protect(state, guard), guard, usage)
    return protect(state, guard), skipped


@dataclass(frozen=True)
class HostEntry:
    """A complete, verified adapter folder in the host tier."""

    lora_name: str
    path: str
    sha256: str
    size_bytes: int = 0
    intact: bool = True  # its files as verified; False: changed on disk since, never vouched


@dataclass(frozen=True)
class ActualState:
    gpu: Mapping[str, str]  # lora name -> folder vLLM reports as its root
    host: Mapping[str, HostEntry]
    loaded_by_agent: Mapping[str, str] = field(default_factory=dict)  # name -> path we loaded
    in_flight: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadBudget:
    """Cold loads into vLLM in the last rolling minute (monotonic seconds)."""

    per_minute: int
    recent: tuple[float, ...] = ()

    def used(self, now: float) -> tuple[float, ...]:
        return tuple(t for t in self.recent if now - t < WINDOW_S)

    def remaining(self, now: float) -> int:
        return max(0, self.per_minute - len(self.used(now)))

    def retry_after_s(self, now: float) -> float:
        used = sorted(self.used(now))
        return max(0.0, WINDOW_S - (now - used[0])) if used else 0.0


@dataclass(frozen=True)
class Load:
    """Make sure the verified folder is in the host tier, then load it into vLLM; then send
    ``warmup_requests`` golden-set requests before real canary traffic reaches it."""

    lora_name: str
    record: AdapterRecord
    command_id: str | None
    warmup_requests: int = 0


@dataclass(frozen=True)
class Fetch:
    """Bring the verified folder into the host tier only."""

    lora_name: str
    record: AdapterRecord
    command_id: str | None


@dataclass(frozen=True)
class Unload:
    lora_name: str
    reason: UnloadReason
    command_id: str | None


@dataclass(frozen=True)
class RemoveHost:
    lora_name: str
    reason: UnloadReason
    command_id: str | None


@dataclass(frozen=True)
class BusyRetry:
    """Over the cold-load budget: try again after ``retry_after_s``."""

    lora_name: str
    retry_after_s: float
    command_id: str | None


@dataclass(frozen=True)
class Conflict:
    """vLLM serves a name this agent cannot vouch for: count it, then unload it."""

    lora_name: str
    root: str


@dataclass(frozen=True)
class Vanished:
    """A copy this agent loaded is gone from vLLM, unloaded by someone else (or vLLM
    restarted): report it; its intent loads it again like any missing copy."""

    lora_name: str
    path: str


@dataclass(frozen=True)
class Refuse:
    """The intent cannot be satisfied from the registry; the agent drops it."""

    lora_name: str
    reason: IntentRefusal
    command_id: str | None


Action = Load | Fetch | Unload | RemoveHost | BusyRetry | Conflict | Vanished | Refuse


def settled_by(action: Action) -> Outcome | None:
    """What carrying out ``action`` tells the desired state: a removed host copy ends an
    evict (or a revoked version), a refusal ends the intent."""
    match action:
        case RemoveHost(name, reason, _):
            revoked = reason == UnloadReason.revoked
            return Outcome(name, Settled.revoked if revoked else Settled.removed)
        case Refuse(name, _, _):
            return Outcome(name, Settled.refused)
    return None


def vouched(
    name: str, root: str, actual: ActualState, registry: Mapping[str, AdapterRecord]
) -> bool:
    """True when vLLM's ``name`` is bytes this agent loaded or verified under that name: its
    host-tier entry, or the copy of it that vLLM's host-tier resolver verified and loaded,
    and that entry was verified against the very digest the registry's record of ``name``
    pins (the name carries only its first 8 hex: an entry of a digest the registry no longer
    pins holds bytes it no longer vouches for). A copy vLLM loads from the entry's own folder
    also needs that folder unchanged since its verification (``HostEntry.intact``)."""
    entry = actual.host.get(name)
    record = registry.get(name)
    if entry is not None and record is not None and entry.sha256 != record.sha256:
        return False
    if entry is not None and root == entry.path and not entry.intact:
        return False  # vLLM reads the folder again (its CPU cache): changed bytes would go
    if actual.loaded_by_agent.get(name) == root:
        return True
    parsed = LORA_NAME_RE.fullmatch(name)
    return (
        entry is not None
        and parsed is not None
        and (entry.path == root or is_resolver_copy(root, entry.path, name))
        and entry.sha256.startswith(parsed["sha8"])
    )


def _refusal(record: AdapterRecord | None, base_model: str) -> IntentRefusal | None:
    if record is None:
        return IntentRefusal.not_in_registry
    if record.status == AdapterStatus.revoked:
        return IntentRefusal.revoked
    if record.base_model != base_model:
        return IntentRefusal.base_model_mismatch
    return None  # another tenant's record: ``_foreign_intents``, for intents of every tier


def _foreign_intents(
    desired: DesiredState, registry: Mapping[str, AdapterRecord]
) -> dict[str, str | None]:
    """The intents whose tenant is not their record's (name -> command id): a planner key
    scoped to one tenant signs a command naming another tenant's copy. Such an intent moves
    nothing, whatever its tier; it is refused, and so dropped."""
    return {
        name: intent.command_id
        for name, intent in desired.intents.items()
        if (record := registry.get(name)) is not None and record.tenant_id != intent.tenant_id
    }


def reconcile(
    desired: DesiredState,
    actual: ActualState,
    registry: Mapping[str, AdapterRecord],
    *,
    base_model: str,
    budget: LoadBudget,
    now: float,
    backoff: Mapping[str, float] | None = None,
    awaiting_registry: Mapping[str, float] | None = None,
    gpu_slots: int | None = None,
    fetching: Collection[str] = (),
) -> list[Action]:
    """The actions that converge ``actual`` to ``desired``; [] when converged.

    ``registry`` maps lora names to their records; ``backoff`` holds names whose last load
    failed, with the monotonic time before which they are not retried; ``awaiting_registry``
    names a command asked for before our registry copy knew them, with the monotonic time
    until which they are not refused; ``fetching`` names whose artifact fetch is in flight:
    no load or fetch of them is started again (the fetch ending wakes the next tick), and
    they hold no slot or budget meanwhile, but a refusal still drops their intent. A
    protected copy (``desired.protected``) is unloaded or removed only when revoked,
    whatever the intent says. ``gpu_slots``: a load waits until vLLM has a free slot (a
    copy leaving it may still be draining); an idle copy no intent holds gives its slot up
    to one.
    """
    backoff = backoff or {}
    protected = desired.protected
    awaiting_registry = awaiting_registry or {}
    foreign = _foreign_intents(desired, registry)
    if foreign:
        desired = replace(
            desired, intents={n: i for n, i in desired.intents.items() if n not in foreign}
        )
    actions: list[Action] = [
        Vanished(name, path)
        for name, path in sorted(actual.loaded_by_agent.items())
        if name not in actual.gpu
    ]
    actions += [
        Refuse(name, IntentRefusal.tenant_mismatch, command_id)
        for name, command_id in sorted(foreign.items(), key=lambda item: item[0])
    ]
    unloading: set[str] = set()
    conflicts = 0
    waiting_conflicts: set[str] = set()  # foreign names a later tick unloads as conflicts

    for name, root in sorted(actual.gpu.items()):
        if not vouched(name, root, actual, registry):
            if conflicts < MAX_CONFLICTS_PER_TICK:  # the rest go on the next ticks
                conflicts += 1
                actions.append(Conflict(name, root))
                unloading.add(name)
            else:
                waiting_conflicts.add(name)
            continue
        record = registry.get(name)
        intent = desired.intents.get(name)
        cmd = intent.command_id if intent else None
        if record is not None and record.status == AdapterStatus.revoked:
            actions.append(Unload(name, UnloadReason.revoked, cmd))
            unloading.add(name)
        elif (
            intent is not None
            and intent.tier != "gpu"
            and not intent.pinned
            and name not in protected
            and actual.in_flight.get(name, 0) == 0
        ):
            actions.append(
                Unload(
                    name,
                    intent.unload_reason
                    or (UnloadReason.demote if intent.tier == "host" else UnloadReason.evict),
                    cmd,
                )
            )
            unloading.add(name)

    for name in sorted(actual.host):
        record = registry.get(name)
        intent = desired.intents.get(name)
        cmd = intent.command_id if intent else None
        off_gpu = name not in actual.gpu or name in unloading
        if record is not None and record.status == AdapterStatus.revoked:
            actions.append(RemoveHost(name, UnloadReason.revoked, cmd))
        elif intent is not None and intent.tier == "gone" and off_gpu and name not in protected:
            actions.append(RemoveHost(name, UnloadReason.evict, cmd))

    remaining = budget.remaining(now)
    free = None if gpu_slots is None else gpu_slots - len(actual.gpu.keys() - unloading)
    orphans = sorted(
        n
        for n in actual.gpu.keys() - unloading - waiting_conflicts
        if n not in desired.intents and actual.in_flight.get(n, 0) == 0
    )
    wanted = sorted(
        (i for i in desired.intents.values() if i.tier in ("gpu", "host")),
        key=lambda i: not i.pinned,
    )  # stable: pinned first, else command order
    for intent in wanted:
        name = intent.lora_name
        on_gpu = name in actual.gpu and name not in unloading
        if (intent.tier == "gpu" and on_gpu) or (intent.tier == "host" and name in actual.host):
            continue
        record = registry.get(name)
        if record is None and awaiting_registry.get(name, 0.0) > now:
            continue  # a command newer than our registry copy: wait for the next refresh
        reason = _refusal(record, base_model)
        if reason is not None or record is None:
            actions.append(Refuse(name, reason or IntentRefusal.not_in_registry, intent.command_id))
            continue
        if backoff.get(name, 0.0) > now or name in fetching:
            continue
        if intent.tier == "host":
            actions.append(Fetch(name, record, intent.command_id))
        elif free is not None and free <= 0:  # wait for the slot (next tick, or a drain)
            if orphans:
                actions.append(Unload(orphans.pop(0), UnloadReason.slot_needed, None))
        elif remaining > 0:
            actions.append(Load(name, record, intent.command_id, intent.warmup_requests))
            remaining -= 1
            free = None if free is None else free - 1
        else:
            actions.append(BusyRetry(name, budget.retry_after_s(now), intent.command_id))
    return actions


def registry_by_name(records: Iterable[AdapterRecord]) -> dict[str, AdapterRecord]:
    """Index registry records by the lora name vLLM knows them under."""
    return {r.lora_name: r for r in records}


def adopt(actual: ActualState, registry: Mapping[str, AdapterRecord]) -> DesiredState:
    """The desired state of an agent that just started: keep what is already there and
    vouched for (a restart must not unload a warm GPU or wipe the host tier)."""
    intents: dict[str, Intent] = {}
    for name in actual.host:
        parsed = LORA_NAME_RE.fullmatch(name)
        record = registry.get(name)
        if parsed is None or record is None:
            continue
        on_gpu = name in actual.gpu and vouched(name, actual.gpu[name], actual, registry)
        intents[name] = Intent(
            name,
            parsed["adapter_id"],
            parsed["version"],
            record.tenant_id,
            "gpu" if on_gpu else "host",
        )
    return DesiredState(intents)
