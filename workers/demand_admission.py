"""Which request may take a GPU slot by loading on demand: a worker-local admission by
priority-weighted demand, in the spirit of TinyLFU's.

Why: the cold-load budget is what binds a busy pool (every policy of the simulator spends all
of it), and a demand load spends it on whatever request came first, giving up the slot of a
copy that may be in far more demand. A load the planner orders is not subject to this (it
ranks by the fleet's scores); a request's load is admitted only when its version has had at
least as many priority-weighted requests at this worker, recently, as the copy it would
replace. Otherwise the request gets its class's cold answer (the base model or a 429) and
the slot keeps the busier copy. Pure: the caller passes the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplane.kernel.decayed import Decayed

MAX_NAMES = 4096
"""Lora names remembered; over it the least-demanded half is forgotten (a forgotten name
counts 0 again: it was among the least demanded anyway)."""


@dataclass
class DemandCounts:
    """Per lora name, the priority-weighted count of requests seen, each decaying with time
    constant ``tau_s`` (``tau_s`` x the weighted request rate, in steady traffic): the
    scores' ``Decayed`` counter, one per name."""

    tau_s: float
    max_names: int = MAX_NAMES
    _counts: dict[str, Decayed] = field(default_factory=dict)

    def count(self, name: str, now: float) -> float:
        """The decayed weighted count of ``name`` at ``now`` (0 for a name never seen)."""
        seen = self._counts.get(name)
        return 0.0 if seen is None else seen.at_time(now)

    def observe(self, name: str, weight: float, now: float) -> None:
        """One request for ``name`` worth ``weight`` (the tenant's priority value)."""
        seen = self._counts.get(name) or Decayed(self.tau_s)
        self._counts[name] = seen.add(now, max(0.0, weight))
        if len(self._counts) > self.max_names:
            ranked = sorted(self._counts, key=lambda k: self.count(k, now))
            for k in ranked[:len(ranked) // 2]:
                del self._counts[k]

    def admits(self, challenger: str, name: str, now: float) -> bool:
        """May a demand load of ``challenger`` take the slot of ``name``? When ``name``'s count
        is not above the challenger's (ties admit: an idle copy's slot goes to a newcomer)."""
        return self.count(name, now) <= self.count(challenger, now)
