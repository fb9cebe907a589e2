"""The fleet and its costs: what a hit, a swap, a fetch and a fallback cost, per request class.

Each worker of a base model has its own GPU slots, host tier, cold-load budget
(``cold_loads_per_minute_per_worker``, a rolling minute as in the seed's
``cold_loads_last_minute()``), load lane (one copy at a time) and serving capacity
(``max_concurrent_per_worker`` requests at once; above it requests queue, and the wait adds
to their TTFT). Requests reach a worker the way the fleet router routes them (engine.py).
Request-class budgets come from the policy file:
- interactive: a miss whose penalty exceeds ``max_wait_ms`` (or that meets a spent load
  budget) is served by the base model (``fallback``, charged ``fallback_cost_ms``) or told to
  retry (``retry_later``, charged ``retry_after_s``); the adapter still loads in the background
  unless the load budget is spent;
- batch: waits for the load budget and the load up to its ``max_wait_ms`` and is charged what
  it waited; beyond that it is told to retry (429 + Retry-After, as the worker gateway answers
  it: ``workers/gateway.py``), charged its ``retry_after_s``, or the time until the worker's
  budget frees when that is longer (the Retry-After the gateway sends then: a client cannot
  be served before it).
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplane.kernel.policy import Policy
from loraplane.simulator.scenario import BaseModelFleet, Costs, PriorityName

__all__ = ["GB", "CostModel", "Outcome", "Pool"]

GB = 1e9


@dataclass(frozen=True)
class Pool:
    """The workers of one base model; every size is per worker."""

    index: int
    name: str
    workers: int
    gpu_slots: int
    host_slots: int
    host_bytes: float
    hbm_bytes: float
    base_bytes: float
    kv_bytes: float
    loads_per_minute: int
    max_concurrent: int

    @classmethod
    def of(cls, index: int, spec: BaseModelFleet, policy: Policy) -> Pool:
        return cls(
            index,
            spec.name,
            spec.workers,
            spec.gpu_slots_per_worker,
            spec.host_slots_per_worker,
            spec.host_bytes_per_worker,
            spec.hbm_bytes_per_worker,
            spec.base_weights_bytes,
            spec.kv_reserved_bytes,
            policy.cold_loads_per_minute_per_worker,
            spec.max_concurrent_per_worker,
        )


@dataclass(frozen=True)
class Outcome:
    """What one request that missed the GPU tier experienced and is charged (ms)."""

    ttft_penalty_ms: float
    charged_ms: float
    fallback: bool
    retry: bool = False
    """Told to retry later (429): it takes no place on the worker."""


class CostModel:
    def __init__(self, costs: Costs, policy: Policy) -> None:
        self.costs = costs
        budgets = policy.request_budgets
        self.interactive = budgets.interactive
        fallback = costs.fallback_cost_ms
        interactive_over = (
            fallback
            if self.interactive.on_cold == "fallback"
            else self.interactive.retry_after_s * 1000.0
        )
        # per class (interactive, batch): max wait, charge when over it, is that a fallback
        # (else a 429 + Retry-After: batch always, as the gateway answers it)
        self._classes = (
            (
                float(self.interactive.max_wait_ms),
                interactive_over,
                self.interactive.on_cold == "fallback",
            ),
            (float(budgets.batch.max_wait_ms), budgets.batch.retry_after_s * 1000.0, False),
        )

    def swap_ms(self, size_bytes: float) -> float:
        """Host memory → GPU slot."""
        return self.costs.swap_fixed_ms + size_bytes / (self.costs.host_to_gpu_gbps * GB) * 1e3

    def fetch_ms(self, size_bytes: float) -> float:
        """Artifact store (S3) → host memory, verified."""
        return self.costs.fetch_fixed_ms + size_bytes / (self.costs.s3_gbps * GB) * 1e3

    def weight(self, priority: PriorityName) -> float:
        return self.costs.priority_weights[priority]

    def may_wait(self, batch: bool, wait_ms: float) -> bool:
        """May a request of this class wait ``wait_ms`` for the load budget?"""
        return batch and wait_ms <= self._classes[1][0]

    def miss(
        self, penalty_ms: float, batch: bool, blocked: bool, retry_after_ms: float = 0.0
    ) -> Outcome:
        """Apply the request-class budget to a miss that would wait ``penalty_ms``
        (``blocked``: nothing loads for it). A 429 is charged its ``Retry-After``: the
        class's ``retry_after_s``, or ``retry_after_ms`` when longer (the time until the
        worker's cold-load budget frees, which the gateway sends: a client told to come back
        then waits that long whatever the policy)."""
        max_wait, over, fallback = self._classes[batch]
        if blocked or penalty_ms > max_wait:
            charged = over if fallback else max(over, retry_after_ms)
            return Outcome(0.0 if fallback else charged, charged, fallback, not fallback)
        return Outcome(penalty_ms, penalty_ms, False)

    def bypass(self, batch: bool) -> Outcome:
        """The policy declined to load (as the gateway refuses a load that admission does not
        let in, before it looks at the budget): the class's answer (an interactive request
        gets the base model or a 429 as ``on_cold`` says, a batch one a 429: the gateway never
        serves batch with the base model), a 429 with the class's own ``Retry-After``."""
        return self.miss(0.0, batch, True)

    def max_wait_ms(self, batch: bool) -> float:
        """The longest a request of this class is served after (a wait for its copy beyond
        it gets the class's cold answer): how far ahead a load may start and still serve it."""
        return self._classes[batch][0]

    def unloaded_miss_ms(self, batch: bool) -> float:
        """What a request of this class is charged when it finds no GPU copy and loads
        nothing (spent budget, bypass): the miss weight of the budgeted bound."""
        return self._classes[batch][1]

    def early_miss_ms(self, wait_ms: float, batch: bool) -> float:
        """The least a request of this class is charged when no copy of its adapter can be
        ready for ``wait_ms``: that wait (a delayed hit) within its class's ``max_wait_ms``
        when cheaper than its cold answer, else the answer."""
        max_wait, over, _ = self._classes[batch]
        return over if wait_ms > max_wait else min(wait_ms, over)

    def min_miss_ms(self, size_bytes: float, batch: bool) -> float:
        """The least any miss of this request can be charged, whatever the policy did: the
        weight of a miss in the offline optimum (so that it is a true lower bound)."""
        max_wait, over, _ = self._classes[batch]
        swap = self.swap_ms(size_bytes)
        return over if swap > max_wait else min(swap, over)
