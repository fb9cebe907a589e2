"""The cache policy: the seed's ``adapter_cache_policy`` YAML, parsed and validated.

The seed writes the hot score as a formula and the eviction/demotion guards as small
boolean expressions. We accept exactly that text, but parse it with a tiny closed grammar
(no ``eval``) so that a typo fails at load time with a clear message instead of silently
changing placement:

    formula    := term ("+" term)*          term := NUMBER "*" NAME | NAME "*" NUMBER
    condition  := clause ("and" clause)*    clause := NAME OP LITERAL
    OP         := == | != | > | >= | < | <=  LITERAL := NUMBER | "text" | 'text' | bare-word
Pure code: no I/O.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "COST_FORMULA",
    "DEFAULT_FORMULA",
    "FACTS",
    "MAX_PRIORITY_VALUE",
    "MAX_REFERENCE",
    "SCORE_TERMS",
    "SEED_FORMULA",
    "BatchBudget",
    "CanaryBudget",
    "Clause",
    "Condition",
    "InteractiveBudget",
    "Normalisation",
    "Policy",
    "PolicyError",
    "PriorityValue",
    "QueueBudget",
    "RequestBudgets",
    "RequestCaps",
    "TenantLimits",
    "parse_condition",
    "parse_formula",
]

SCORE_TERMS = (
    "qps_10m",
    "qps_1m",
    "ttft_penalty_if_cold",
    "tenant_priority",
    "scheduled_warmup_score",
    "weighted_demand",
)
FACTS = (
    "status",
    "canary_percent",
    "tenant_priority",
    "no_request_for_minutes",
    "error_rate_after_load",
    "request_class",
)
SEED_FORMULA = (
    "0.45 * qps_10m + 0.25 * ttft_penalty_if_cold + 0.20 * tenant_priority"
    " + 0.10 * scheduled_warmup_score"
)
"""The seed's hot score: rate, cold penalty and priority added up."""
COST_FORMULA = "0.9 * weighted_demand + 0.1 * scheduled_warmup_score"
"""What a miss costs a second (forecast rate times the tenant's priority value), schedules
kept: it does better than the seed's on the decision-quality scenarios
(docs/benchmarks.md), so it is the default."""
DEFAULT_FORMULA = COST_FORMULA


class PolicyError(ValueError):
    """A policy text that does not parse; the message names the offending part."""


_NUMBER = r"[0-9]+(?:\.[0-9]+)?"
_TERM_RE = re.compile(
    rf"^\s*(?:({_NUMBER})\s*\*\s*([a-z_0-9]+)|([a-z_0-9]+)\s*\*\s*({_NUMBER}))\s*$"
)
_CLAUSE_RE = re.compile(r"^\s*([a-z_0-9]+)\s*(==|!=|>=|<=|>|<)\s*(.+?)\s*$")


def parse_formula(text: str) -> dict[str, float]:
    """``"0.45 * qps_10m + ..."`` -> ``{"qps_10m": 0.45, ...}``."""
    weights: dict[str, float] = {}
    if not text.strip():
        raise PolicyError("hot_score_formula is empty")
    for raw in text.replace("\n", " ").split("+"):
        m = _TERM_RE.fullmatch(raw)
        if not m:
            raise PolicyError(
                f"hot_score_formula: cannot parse term {raw.strip()!r} (expected WEIGHT * NAME)"
            )
        weight = float(m.group(1) or m.group(4))
        name = m.group(2) or m.group(3)
        if name not in SCORE_TERMS:
            raise PolicyError(f"hot_score_formula: unknown term {name!r}; known: {SCORE_TERMS}")
        if name in weights:
            raise PolicyError(f"hot_score_formula: term {name!r} appears twice")
        weights[name] = weight
    return weights


_OPS: dict[str, Callable[[float, float], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
}


@dataclass(frozen=True)
class Clause:
    fact: str
    op: str
    value: float | str

    def holds(self, facts: dict[str, float | str | None]) -> bool:
        actual = facts.get(self.fact)
        if actual is None:
            return False
        if isinstance(self.value, str) or isinstance(actual, str):
            if self.op not in ("==", "!="):
                return False
            return (str(actual) == str(self.value)) == (self.op == "==")
        # A table lookup, not a dict of all six comparisons: the planner evaluates every
        # condition for every version on every tick.
        return _OPS[self.op](float(actual), self.value)


@dataclass(frozen=True)
class Condition:
    """A conjunction of clauses; ``text`` is kept for audit reasons."""

    text: str
    clauses: tuple[Clause, ...]

    def holds(self, facts: dict[str, float | str | None]) -> bool:
        return all(c.holds(facts) for c in self.clauses)


def parse_condition(text: str) -> Condition:
    clauses = []
    for raw in re.split(r"\s+and\s+", text.strip()):
        m = _CLAUSE_RE.fullmatch(raw)
        if not m:
            raise PolicyError(f"condition {text!r}: cannot parse {raw!r} (expected NAME OP VALUE)")
        fact, op, lit = m.groups()
        if fact not in FACTS:
            raise PolicyError(f"condition {text!r}: unknown fact {fact!r}; known: {FACTS}")
        value: float | str
        if re.fullmatch(_NUMBER, lit):
            value = float(lit)
        elif len(lit) >= 2 and lit[0] == lit[-1] and lit[0] in "\"'":
            value = lit[1:-1]
        elif re.fullmatch(r"[a-z][a-z0-9_-]*", lit):
            value = lit
        else:
            raise PolicyError(f"condition {text!r}: bad value {lit!r}")
        clauses.append(Clause(fact, op, value))
    return Condition(text.strip(), tuple(clauses))


class _Strict(BaseModel):
    """Unknown keys are errors, and every number is finite: a NaN or an inf in a weight or a
    reference value reaches every score the planner ranks (NaN sorts anywhere)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


MAX_REFERENCE = 1e9
"""The largest reference value or penalty (requests/s, milliseconds) a policy takes."""
MAX_PRIORITY_VALUE = 1e6
"""The largest tenant priority value (the defaults run 0.25 to 1)."""
PriorityValue = Annotated[float, Field(ge=0, le=MAX_PRIORITY_VALUE)]


class Normalisation(_Strict):
    """Reference values that map each raw score input to 1.0 (inputs are clipped to [0, 1])."""

    qps_10m: float = Field(
        1.0, gt=0, le=MAX_REFERENCE, description="requests/s over 10 min that scores 1.0"
    )
    qps_1m: float = Field(
        2.0, gt=0, le=MAX_REFERENCE, description="requests/s over 1 min that scores 1.0"
    )
    ttft_penalty_ms: float = Field(
        2000.0, gt=0, le=MAX_REFERENCE, description="cold TTFT penalty scoring 1.0"
    )
    weighted_demand: float = Field(
        1.0,
        gt=0,
        le=MAX_REFERENCE,
        description="forecast requests/s x tenant priority value scoring 1.0",
    )


class RequestCaps(_Strict):
    """What one request of a class may ask of vLLM (``frontdoor.request_fields.admit``)."""

    max_n: int = Field(4, ge=1, le=128, description="n and best_of, each")
    max_tokens: int = Field(
        1024, ge=1, le=1_000_000, description="max_tokens / max_completion_tokens, each"
    )
    default_max_tokens: int = Field(
        256, ge=1, le=1_000_000, description="set when the request names no max_tokens"
    )
    max_prompts: int = Field(4, ge=1, le=10_000, description="a list prompt counts each")
    max_logprobs: int = Field(5, ge=0, le=100, description="logprobs / top_logprobs")
    max_stop: int = Field(4, ge=0, le=64, description="stop sequences")
    max_stop_chars: int = Field(64, ge=1, le=4096, description="length of one stop sequence")
    max_messages: int = Field(256, ge=1, le=100_000, description="chat messages")
    max_body_bytes: int = Field(1024 * 1024, ge=1024, le=64 * 1024 * 1024)

    @model_validator(mode="after")
    def _default_within_cap(self) -> RequestCaps:
        if self.default_max_tokens > self.max_tokens:
            raise ValueError("default_max_tokens must not exceed max_tokens")
        return self


def _batch_caps() -> RequestCaps:
    return RequestCaps(max_tokens=4096, default_max_tokens=512, max_prompts=64)


class TenantLimits(_Strict):
    """Per tenant, per gateway: requests in flight and tokens (prompt + output) per minute.
    Tokens are charged when vLLM reports the usage; an empty bucket answers 429."""

    max_concurrent: int = Field(32, ge=1, le=100_000)
    tokens_per_minute: int = Field(200_000, ge=1, le=10**10)
    burst_tokens: int = Field(
        50_000,
        ge=1,
        le=10**10,
        description="the bucket's size: what a quiet tenant may spend at once",
    )


class InteractiveBudget(_Strict):
    caps: RequestCaps = Field(default_factory=RequestCaps)
    on_cold: Literal["fallback", "retry_later"] = "fallback"
    retry_after_s: int = Field(2, ge=1, le=300)
    max_wait_ms: int = Field(0, ge=0, le=60_000)


class BatchBudget(_Strict):
    caps: RequestCaps = Field(default_factory=_batch_caps)  # also the shadow class's
    max_wait_ms: int = Field(30_000, ge=0, le=600_000)
    max_concurrent_cold_loads: int = Field(2, ge=1, le=64)
    retry_after_s: int = Field(5, ge=1, le=300)  # also the shadow class's


class CanaryBudget(_Strict):
    caps: RequestCaps = Field(default_factory=RequestCaps)
    warmup_requests: int = Field(3, ge=0, le=1000)
    retry_after_s: int = Field(5, ge=1, le=300)


class QueueBudget(_Strict):
    """The fleet router's flow control (``router.flow_control``, docs/router.md)."""

    max_in_flight_per_worker: int = Field(
        64,
        ge=1,
        le=100_000,
        description="requests one router forwards at once per worker: "
        "a base model's limit is this times its workers in the router's view; more wait",
    )
    max_queued_per_band: int = Field(
        512, ge=1, le=1_000_000, description="per (base model, band); over it: 429"
    )
    max_queued_per_tenant: int = Field(
        128, ge=1, le=1_000_000, description="one tenant's share of one band"
    )
    interactive_ttl_ms: int = Field(
        2000,
        ge=1,
        le=60_000,
        description="the longest an interactive request waits in a "
        "queue; batch, canary and shadow wait batch.max_wait_ms",
    )


class RequestBudgets(_Strict):
    interactive: InteractiveBudget = Field(default_factory=InteractiveBudget)
    batch: BatchBudget = Field(default_factory=BatchBudget)
    canary: CanaryBudget = Field(default_factory=CanaryBudget)
    tenants: TenantLimits = Field(default_factory=TenantLimits)
    queues: QueueBudget = Field(default_factory=QueueBudget)


class Policy(_Strict):
    """The ``adapter_cache_policy`` section. Field names follow the seed where it has one."""

    gpu_slots_per_base_model: int = Field(64, ge=1, le=100_000)
    host_slots_per_base_model: int = Field(2048, ge=1, le=10_000_000)
    host_prewarms_in_flight_per_worker: int = Field(
        4,
        ge=1,
        le=10_000,
        description="prewarm_host commands a worker may have pending (issued, not yet "
        "shown in its state): it fetches its host copies one at a time, so more would only "
        "queue there; the rest of the host tier follows as the worker reports these",
    )
    eviction_policy: Literal["weighted-lru"] = "weighted-lru"
    hot_score_formula: str = DEFAULT_FORMULA
    never_evict_when: list[str] = Field(
        default_factory=lambda: [
            'status == "canary" and canary_percent > 0',
            'tenant_priority == "platinum"',
        ]
    )
    demote_when: list[str] = Field(
        default_factory=lambda: ["no_request_for_minutes > 60", "error_rate_after_load > 0.02"]
    )
    tenant_priority_values: dict[str, PriorityValue] = Field(
        default_factory=lambda: {"bronze": 0.25, "silver": 0.5, "gold": 0.75, "platinum": 1.0}
    )
    normalisation: Normalisation = Field(default_factory=Normalisation)
    demand_trend_weight: float = Field(
        0.5,
        ge=0,
        le=1,
        description="weighted_demand's forecast: the 10-minute rate plus this "
        "share of a rise of the 1-minute rate above it",
    )
    demand_diurnal_weight: float = Field(
        1.0,
        ge=0,
        le=10,
        description="weighted_demand's forecast is at least this share of the "
        "rate the version's daily profile gives for demand_diurnal_lead_s ahead, once a whole "
        "day of its requests was seen (streams.scores.Daily); 0: off",
    )
    demand_diurnal_lead_s: float = Field(
        600.0,
        ge=0,
        le=86_400,
        description="how far ahead the daily profile is read: a copy wanted then is placed now",
    )
    ttft_penalty_prior_ms: float = Field(
        800.0, ge=0, le=MAX_REFERENCE, description="cold TTFT penalty until one is observed"
    )
    cold_loads_per_minute_per_worker: int = Field(
        6,
        ge=1,
        le=10_000,
        description="GPU loads per worker per rolling minute (the seed's "
        "budget); with load_stall_share on, the ceiling of the budget each worker adapts",
    )
    load_stall_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="0: the cold-load budget is the constant above. Above 0, "
        "each worker measures how much a load slows the batch beside it and loads at most "
        "floor(this x 60 s / (stall x seconds per load)) times a minute, so loads take at most "
        "this share of its decode time (workers.load_interference); the planner and the router "
        "plan with the budget it reports",
    )
    max_protected_gpu_share: float = Field(
        0.25,
        gt=0,
        le=1,
        description="the most never-evict versions protected per base "
        "model, as a share of its GPU slots (rounded up, at least 1); the rest compete by "
        "score (the seed's 0.5 held half the slots for idle platinum versions where they do "
        "not all fit: docs/benchmarks.md)",
    )
    hbm_low_watermark: float = Field(
        0.82,
        gt=0,
        le=1,
        description="a worker whose reported hbm_usage is above it gets no load from the planner",
    )
    hbm_high_watermark: float = Field(
        0.9,
        gt=0,
        le=1,
        description="a worker whose reported hbm_usage is above it demotes one copy a tick "
        "(planner rule 8); at least hbm_low_watermark: between the two nothing is added and "
        "nothing shed, so a copy shed is not loaded back at once",
    )
    hysteresis_margin: float = Field(
        0.05, ge=0, le=1, description="a challenger must beat a resident's score by this much"
    )
    min_residency_s: float = Field(
        180.0,
        ge=0,
        le=86_400,
        description="a GPU copy stays at least this long after its load "
        "(the worker's loaded_at): the planner neither demotes it nor gives its slot away "
        "sooner, and on the worker a planner's load takes no such copy's slot, a request's "
        "own load none the planner loaded. Only a revoke, a version no longer serving, a "
        "demote_when condition (an error rate) or the load of a never-evict version it then "
        "protects may undo a load sooner; 0: off",
    )
    worker_capacity_rps: float = Field(
        10.0,
        gt=0,
        le=1_000_000,
        description="requests/s one worker serves for one adapter: a "
        "hot version gets ceil(demand / this) GPU copies (rule 6), at most one per worker",
    )
    replica_hysteresis: float = Field(
        0.2,
        ge=0,
        lt=1,
        description="with n copies, one is added only above n x capacity x "
        "(1 + this) and dropped only below (n - 1) x capacity x (1 - this)",
    )
    demand_admission_tau_s: float = Field(
        600.0,
        ge=0,
        le=86_400,
        description="a request's own load is admitted by its class and "
        "the cold-load budget: one that may wait (batch) whenever the budget has a load for it "
        "within its wait, an interactive one while the budget keeps a reserve for those; else "
        "it may take only the slot of a copy with no more priority-weighted requests at that "
        "worker, each request's weight decaying with this time constant (s), and the least "
        "demanded copy gives its slot; 0: off, the least recently used idle unpinned copy "
        "gives its slot to any request (workers.demand_admission)",
    )
    planner_interval_s: float = Field(1.0, gt=0, le=3600)
    worker_heartbeat_s: float = Field(
        5.0,
        gt=0,
        le=3600,
        description="the workers' heartbeat interval (worker run's default): "
        "a worker silent for 3 of them is drained by the router, shown drained by the fleet "
        "view and left out by the planner, whose copies there are placed again",
    )
    command_deadline_s: float = Field(60.0, gt=0, le=86_400)
    request_budgets: RequestBudgets = Field(default_factory=RequestBudgets)

    def priority_value(self, priority: str) -> float:
        """``tenant_priority_values`` of one priority (0 for an unknown one): the weight of a
        tenant's demand in scores and in the workers' demand admission."""
        return self.tenant_priority_values.get(priority, 0.0)

    @model_validator(mode="after")
    def _watermarks_ordered(self) -> Policy:
        if self.hbm_high_watermark < self.hbm_low_watermark:
            raise ValueError("hbm_high_watermark must not be below hbm_low_watermark")
        return self

    @field_validator("hot_score_formula")
    @classmethod
    def _formula_parses(cls, v: str) -> str:
        parse_formula(v)
        return v

    @field_validator("never_evict_when", "demote_when")
    @classmethod
    def _conditions_parse(cls, v: list[str]) -> list[str]:
        for text in v:
            parse_condition(text)
        return v

    @property
    def weights(self) -> dict[str, float]:
        return parse_formula(self.hot_score_formula)

    @property
    def never_evict(self) -> tuple[Condition, ...]:
        return tuple(parse_condition(t) for t in self.never_evict_when)

    @property
    def demote(self) -> tuple[Condition, ...]:
        return tuple(parse_condition(t) for t in self.demote_when)
