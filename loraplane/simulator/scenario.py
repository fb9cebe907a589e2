"""The scenario file (YAML): workload, fleet, costs, the loraplane policy and the sweep.

One file holds everything a run depends on, so a table in docs/benchmarks.md is reproduced by
naming the file and the seed. Unknown keys are errors: a typo must not silently fall back to a
default and change the benchmark.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from loraplane.kernel.local_files import read_regular
from loraplane.kernel.policy import Policy
from loraplane.schemas.adapter import MAX_ADAPTER_BYTES, MAX_RANK
from loraplane.schemas.bounded_yaml import YamlTooLarge, load_yaml

__all__ = [
    "MAX_BYTES",
    "MAX_COUNT",
    "MAX_MS",
    "MAX_RATE",
    "MAX_REQUESTS",
    "MAX_SCENARIO_BYTES",
    "MAX_SECONDS",
    "MAX_WEIGHT",
    "MIN_RATE",
    "NAME_PATTERN",
    "PRIORITIES",
    "BaseModelFleet",
    "Burst",
    "Canaries",
    "Costs",
    "Count",
    "Diurnal",
    "Fleet",
    "Interference",
    "LoraRank",
    "OfficeHours",
    "OptimumSettings",
    "Override",
    "Peak",
    "PriorityName",
    "Scenario",
    "SeedRow",
    "SloClass",
    "Sweep",
    "Weight",
    "Workload",
    "load_scenario",
]

PriorityName = Literal["bronze", "silver", "gold", "platinum"]
SloClass = Literal["interactive", "batch"]
_SLO_TTFT_MS: dict[SloClass, float] = {"interactive": 1000.0, "batch": 30_000.0}
PRIORITIES: tuple[PriorityName, ...] = get_args(PriorityName)
_PRIORITY_MIX: dict[PriorityName, float] = {
    "bronze": 0.5,
    "silver": 0.3,
    "gold": 0.15,
    "platinum": 0.05,
}
_PRIORITY_WEIGHTS: dict[PriorityName, float] = {
    "bronze": 1.0,
    "silver": 2.0,
    "gold": 4.0,
    "platinum": 8.0,
}


# The file names a run writes (``simulate --plot``: ``{name}-hit-rate.png``) are made of the
# scenario's name, so the name is one plain file name: no separator, no leading dot.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
# Workers, slots, loads a minute, tenants, adapters: the simulator builds one object (or a
# list entry) per unit of each, so a file of 10**9 holds ``simulate`` until memory runs out.
MAX_COUNT = 100_000
MAX_SCENARIO_BYTES = 1024 * 1024  # a scenario is a page of YAML; a trace is its own file
MAX_REQUESTS = 10_000_000  # synthetic and peak arrivals: ten times the largest bench scenario
Count = Annotated[int, Field(ge=1, le=MAX_COUNT)]
MAX_SECONDS = 10 * 365 * 86_400.0
"""The longest time span or offset in a scenario (ten years). Every quantity of a scenario is
bounded so that no sum or product the simulator forms over ``MAX_REQUESTS`` requests leaves
the finite floats: a finite 1e308 a request was an inf total, a NaN ratio, and the LP bound's
ValueError traceback."""
MAX_MS = 1e9
"""The longest cost or budget in milliseconds (about 11.6 days)."""
MAX_BYTES = float(2**60)
"""The largest byte count (1 EiB)."""
MIN_RATE = 1e-6
"""The slowest bandwidth (GB/s), decode or arrival rate (per second) a scenario takes."""
MAX_RATE = 1e9
"""The fastest."""
MAX_WEIGHT = 1e6
"""The largest weight of a mix or of a priority."""
Weight = Annotated[float, Field(ge=0, le=MAX_WEIGHT)]
LoraRank = Annotated[int, Field(ge=1, le=MAX_RANK)]
"""A LoRA rank, as the registry's records hold it: an adapter's size is rank x bytes per
rank, so 0 or a negative rank sized it at nothing or less, and 10**400 overflowed a float."""


class _Strict(BaseModel):
    """Unknown keys are errors; every float is finite (``.inf`` or ``.nan`` in a cost or a
    rate turns every total it reaches into one)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Diurnal(_Strict):
    """Arrival rate multiplied by ``1 + amplitude * sin(2π (t + phase_s) / period_s)``."""

    amplitude: float = Field(0.0, ge=0, lt=1)
    period_s: float = Field(86_400.0, gt=0, le=MAX_SECONDS)
    phase_s: float = Field(0.0, ge=-MAX_SECONDS, le=MAX_SECONDS)


class OfficeHours(_Strict):
    """Each tenant's share of the requests follows its own working day: inside
    ``[start_h, end_h)`` of its local time its adapters draw requests as their popularity
    says, outside it only ``off_share`` of that. Tenant ``k`` of ``n`` is ``k / n`` of
    ``spread_s`` ahead of UTC, so with the whole day as spread the mornings come one after
    another. The arrivals themselves are unchanged: the busy tenants take the others' share."""

    start_h: float = Field(9.0, ge=0, lt=24)
    end_h: float = Field(17.0, gt=0, le=24)
    off_share: float = Field(
        0.05,
        gt=0,
        le=1,
        description="above 0: at an hour when no "
        "tenant is in its hours a request still finds an adapter",
    )
    spread_s: float = Field(86_400.0, ge=0, le=MAX_SECONDS)

    @model_validator(mode="after")
    def _a_day(self) -> OfficeHours:
        if self.end_h <= self.start_h:
            raise ValueError("office_hours: end_h must be after start_h")
        return self


class Burst(_Strict):
    """From ``at_s`` for ``duration_s``, ``share`` of all requests go to one adapter that was
    cold: the adapter at popularity rank ``rank`` (0 = most popular)."""

    at_s: float = Field(ge=0, le=MAX_SECONDS)
    duration_s: float = Field(gt=0, le=MAX_SECONDS)
    share: float = Field(gt=0, le=1)
    rank: int = Field(ge=0, le=MAX_COUNT)


class Peak(_Strict):
    """A scheduled peak: extra ``qps`` for adapter ``rank`` from ``at_s`` for ``duration_s``.
    Known ahead (a schedule entry with ``lead_s``), so a planner may prewarm for it."""

    at_s: float = Field(ge=0, le=MAX_SECONDS)
    duration_s: float = Field(gt=0, le=MAX_SECONDS)
    qps: float = Field(ge=MIN_RATE, le=MAX_RATE)
    rank: int = Field(ge=0, le=MAX_COUNT)
    lead_s: float = Field(120.0, ge=0, le=MAX_SECONDS)


class Canaries(_Strict):
    """``count`` of the most popular adapters get a canary version taking ``percent`` of their
    traffic."""

    count: int = Field(0, ge=0, le=MAX_COUNT)
    percent: float = Field(10.0, ge=0, le=100)


class Workload(_Strict):
    source: Literal["synthetic", "trace"] = "synthetic"
    trace: str | None = Field(None, description="Azure LLM trace CSV (source: trace)")
    requests: int = Field(
        10_000, ge=1, le=MAX_REQUESTS, description="synthetic: number of base arrivals"
    )
    rate_qps: float = Field(
        10.0, ge=MIN_RATE, le=MAX_RATE, description="synthetic: mean arrival rate"
    )
    cv: float = Field(1.0, gt=0, le=100, description="coefficient of variation of inter-arrivals")
    diurnal: Diurnal = Field(default_factory=Diurnal)
    office_hours: OfficeHours | None = Field(
        None, description="tenants' shares follow their own working day (none: constant)"
    )
    output_tokens: int = Field(180, ge=1, le=MAX_COUNT, description="synthetic: mean output tokens")
    adapters: int = Field(100, ge=1, le=MAX_COUNT)
    alpha: float = Field(1.0, ge=0, le=100, description="power-law popularity exponent")
    tenants: int = Field(10, ge=1, le=MAX_COUNT)
    priority_mix: dict[PriorityName, Weight] = Field(default_factory=_PRIORITY_MIX.copy)
    batch_fraction: float = Field(0.0, ge=0, le=1)
    canaries: Canaries = Field(default_factory=Canaries)
    bursts: list[Burst] = Field(default_factory=list)
    peaks: list[Peak] = Field(default_factory=list)
    ranks: dict[LoraRank, Weight] = Field(
        default_factory=lambda: {16: 1.0},
        min_length=1,
        description=f"LoRA rank mix over adapters (ranks 1 to {MAX_RANK})",
    )

    @model_validator(mode="after")
    def _trace_named(self) -> Workload:
        if self.source == "trace" and not self.trace:
            raise ValueError("workload.source is 'trace' but workload.trace is not set")
        return self

    @model_validator(mode="after")
    def _peaks_bounded(self) -> Workload:
        """Each peak adds about ``qps x duration_s`` arrivals, drawn at once."""
        extra = sum(p.qps * p.duration_s for p in self.peaks)
        if not extra <= MAX_REQUESTS:
            raise ValueError(
                f"workload.peaks add {extra:.3g} arrivals: at most {MAX_REQUESTS} in all"
            )
        return self


class BaseModelFleet(_Strict):
    name: str = "llama-3.1-8b-instruct"
    share: float = Field(
        1.0, gt=0, le=MAX_WEIGHT, description="share of adapters on this base model"
    )
    workers: Count = 2
    gpu_slots_per_worker: Count = 8
    host_slots_per_worker: Count = 64
    host_bytes_per_worker: float = Field(32e9, gt=0, le=MAX_BYTES)
    hbm_bytes_per_worker: float = Field(24e9, gt=0, le=MAX_BYTES)
    base_weights_bytes: float = Field(
        14e9,
        ge=0,
        le=MAX_BYTES,
        description="with kv_reserved_bytes, below the policy's "
        "hbm_low_watermark of hbm_bytes_per_worker (0.77 of it by default), or the planner "
        "loads nothing on these workers",
    )
    kv_reserved_bytes: float = Field(4.5e9, ge=0, le=MAX_BYTES)
    max_concurrent_per_worker: int = Field(
        256,
        ge=1,
        le=MAX_COUNT,
        description="requests a worker serves at once (vLLM max_num_seqs); "
        "more queue, and the wait adds to their TTFT",
    )


class Costs(_Strict):
    """Latency model. Loads are ``fixed + bytes / bandwidth``; a miss never costs less than a
    host→GPU swap, which is what makes the offline optimum a lower bound."""

    gpu_hit_ms: float = Field(0.0, ge=0, le=MAX_MS, description="adapter selection cost on a hit")
    swap_fixed_ms: float = Field(5.0, ge=0, le=MAX_MS)
    host_to_gpu_gbps: float = Field(12.0, ge=MIN_RATE, le=MAX_RATE)
    fetch_fixed_ms: float = Field(80.0, ge=0, le=MAX_MS)
    s3_gbps: float = Field(0.5, ge=MIN_RATE, le=MAX_RATE)
    fallback_cost_ms: float = Field(
        1000.0, ge=0, le=MAX_MS, description="cost charged for serving on the base model"
    )
    decode_tokens_per_s: float = Field(45.0, ge=MIN_RATE, le=MAX_RATE)
    lora_decode_overhead: float = Field(0.1, ge=0, lt=1)
    adapter_bytes_per_rank: float = Field(
        1.7e6,
        gt=0,
        le=MAX_ADAPTER_BYTES / MAX_RANK,
        description="an adapter's size is its rank times this, at most the registry's "
        "largest artifact at the largest rank",
    )
    priority_weights: dict[PriorityName, Weight] = Field(default_factory=_PRIORITY_WEIGHTS.copy)
    slo_ttft_ms: dict[SloClass, Annotated[float, Field(ge=0, le=MAX_MS)]] = Field(
        default_factory=lambda: _SLO_TTFT_MS.copy(),
        description="each request class's TTFT budget: a request attains its SLO when it is "
        "served by its adapter (no base-model fallback, no retry) within it "
        "(gpu_hit_ms + its TTFT penalty, queueing included)",
    )


class Interference(_Strict):
    """What a GPU load does to the batch running on its worker, and what adapter HBM does to
    the batch size. Every default is "off", so a scenario without this section models no
    interference. The seed scenario says which values were fitted (bench/scenarios/seed-004-*)."""

    stall_fraction: float = Field(
        0.0,
        ge=0,
        le=1,
        description="decode on the worker runs at (1 - this) of its rate "
        "while a load runs on it (vLLM loads inside its step "
        "loop: queue blocking, memory traffic)",
    )
    page_alloc_ms: float = Field(
        0.0,
        ge=0,
        le=MAX_MS,
        description="added to every GPU load: allocating the adapter's pages",
    )
    load_slowdown_per_request: float = Field(
        0.0,
        ge=0,
        le=MAX_WEIGHT,
        description="the GPU part of a load takes (1 + this x requests in flight "
        "on the worker) times longer: the batch's memory traffic",
    )
    slot_reserved_bytes: float = Field(
        0.0,
        ge=0,
        le=MAX_BYTES,
        description="HBM each GPU slot reserves (vLLM preallocates max_loras x "
        "max_lora_rank); 0 = adapters take their own bytes",
    )
    staging_bytes_per_load: float = Field(
        0.0,
        ge=0,
        le=MAX_BYTES,
        description="HBM a load holds while queued or copying (staging buffer)",
    )
    kv_bytes_per_sequence: float = Field(
        0.0,
        ge=0,
        le=MAX_BYTES,
        description="KV cache one running sequence needs; > 0: a worker serves at "
        "most (HBM - base - slot reservations) / this at once",
    )


class Fleet(_Strict):
    base_models: list[BaseModelFleet] = Field(default_factory=lambda: [BaseModelFleet()])
    costs: Costs = Field(default_factory=Costs)
    interference: Interference = Field(default_factory=Interference)


class Sweep(_Strict):
    gpu_slots_per_worker: list[Count] = Field(
        default_factory=lambda: [2, 4, 8, 16, 32], min_length=1, max_length=64
    )


class OptimumSettings(_Strict):
    exact_max_requests: int = Field(3000, ge=0, description="exact min-cost flow up to this")
    segment_requests: int = Field(2000, ge=10, description="segment size of the lower bound")
    bound_max_requests: int = Field(200_000, ge=0, description="no bound above this (time)")
    bound_max_cells: int = Field(
        120_000,
        ge=1,
        description="budgeted LP bound: adapters x time buckets at most (the bucket grows to fit)",
    )


class SeedRow(_Strict):
    hbm_peak: float
    swap_ms: float
    p95_tokens_per_s: float


class Override(_Strict):
    """A policy that stands for a deployment strategy gets its own slots or load budget."""

    gpu_slots_per_worker: Count | None = None
    host_slots_per_worker: Count | None = Field(
        None, description="vLLM's max_cpu_loras (its default is max_loras)"
    )
    cold_loads_per_minute_per_worker: Count | None = None
    demand_admission_tau_s: float | None = Field(
        None,
        ge=0,
        description="the policy's demand admission (0: off, as the seed's pooled hot set had none)",
    )


class Scenario(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str = ""
    seed: int = 0
    workload: Workload = Field(default_factory=Workload)
    fleet: Fleet = Field(default_factory=Fleet)
    policy: Policy = Field(default_factory=Policy)
    policies: list[str] = Field(default_factory=lambda: ["all"])
    overrides: dict[str, Override] = Field(
        default_factory=dict, description="policy -> its own deployment (seed comparison)"
    )
    sweep: Sweep = Field(default_factory=Sweep)
    optimum: OptimumSettings = Field(default_factory=OptimumSettings)
    seed_reference: dict[str, SeedRow] = Field(
        default_factory=dict, description="policy name -> the seed's measured row"
    )

    def for_policy(self, name: str) -> Scenario:
        """This scenario with the policy's override applied (itself if none)."""
        o = self.overrides.get(name)
        if o is None:
            return self
        out = self.with_gpu_slots(o.gpu_slots_per_worker) if o.gpu_slots_per_worker else self
        if o.host_slots_per_worker:
            out = out._with_base_models(host_slots_per_worker=o.host_slots_per_worker)
        policy = {
            k: v
            for k, v in (
                ("cold_loads_per_minute_per_worker", o.cold_loads_per_minute_per_worker),
                ("demand_admission_tau_s", o.demand_admission_tau_s),
            )
            if v is not None
        }
        if policy:
            out = out.model_copy(update={"policy": out.policy.model_copy(update=policy)})
        return out

    def with_gpu_slots(self, slots: int) -> Scenario:
        return self._with_base_models(gpu_slots_per_worker=slots)

    def _with_base_models(self, **update: int) -> Scenario:
        fleet = self.fleet.model_copy(
            update={"base_models": [b.model_copy(update=update) for b in self.fleet.base_models]}
        )
        return self.model_copy(update={"fleet": fleet})


def load_scenario(path: Path) -> Scenario:
    """Parse a scenario file; a relative trace path is taken relative to the file. A file
    that is no YAML, or whose aliases expand past a bound (``schemas.bounded_yaml``), is a
    ``ValueError`` naming it, before any model is built."""
    try:
        data = load_yaml(read_regular(path, MAX_SCENARIO_BYTES).decode())
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML: {exc}") from None
    except YamlTooLarge as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a scenario is a mapping")
    if "adapter_cache_policy" in data:
        data["policy"] = data.pop("adapter_cache_policy")
    scenario = Scenario.model_validate(data)
    trace = scenario.workload.trace
    if trace and not Path(trace).is_absolute():
        workload = scenario.workload.model_copy(
            update={"trace": str((path.parent / trace).resolve())}
        )
        scenario = scenario.model_copy(update={"workload": workload})
    return scenario
