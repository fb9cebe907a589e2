"""Per adapter-version score state from request logs, and the hot score. Pure: time is an
argument (epoch seconds), so the simulator replays it with simulated time.

Why exponentially decayed counters rather than windowed counts: a decayed counter is two
floats (value, time of last update) per rate, so the state of one adapter version is O(1)
whatever its traffic, serialises to a small JSON object for a changelog-backed table, and
is updated and read without keeping or expiring window buckets. For a steady arrival rate
``r`` a counter with time constant ``tau`` converges to ``r * tau``, so ``value / tau`` is the
rate "over the last tau seconds" with recent requests weighing most. Out-of-order events are
exact: an event older than the last update is added already decayed.

Inputs that need a version (TTFT, errors after load) are kept per version; demand that the
gateway could not attribute to a version (``adapter_version`` is None) is kept under
``score_key(adapter_id, None)`` and the planner counts it for the active version.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from loraplane.policy import Policy
from schemas.request_log import RequestLog, RequestStatus, Tier

TAU_10M_S = 600.0
TAU_1M_S = 60.0
TTFT_SMOOTHING = 0.2
"""Weight of a new TTFT sample in the moving average: ~5 samples to follow a change."""
MIN_ERROR_SAMPLES = 20.0
"""Decayed served requests needed before an error rate is reported: one failed request out
of two must not demote an adapter."""
BURST_MIN_REQUESTS_1M = 3.0
BURST_FACTOR = 2.0
BURST_REARM_REQUESTS_1M = 1.5
"""A Schmitt trigger: after a burst fires, the next one needs the 1-minute count to have
fallen below this first. Without it, a tail adapter whose decayed count hovers around the
floor "bursts" on almost every request and the planner re-plans for noise."""


@dataclass(frozen=True)
class Decayed:
    """An exponentially decayed event count with time constant ``tau`` seconds."""

    tau: float
    value: float = 0.0
    at: float = 0.0

    def at_time(self, now: float) -> float:
        if not self.value:
            return 0.0  # an empty counter (most of a large registry): no exp
        return self.value * math.exp(-max(0.0, now - self.at) / self.tau)

    def add(self, ts: float, amount: float = 1.0) -> Decayed:
        # The constructor, not ``dataclasses.replace``: this runs once per request log.
        if ts >= self.at:
            return Decayed(self.tau, self.at_time(ts) + amount, ts)
        return Decayed(self.tau, self.value + amount * math.exp(-(self.at - ts) / self.tau),
                       self.at)

    def rate(self, now: float) -> float:
        """Events per second over the last ~tau seconds."""
        return self.at_time(now) / self.tau


def _tau10() -> Decayed:
    return Decayed(TAU_10M_S)


@dataclass(frozen=True)
class ScoreState:
    """What the request logs say about one adapter version (or its unattributed demand)."""

    requests_10m: Decayed = field(default_factory=_tau10)
    requests_1m: Decayed = field(default_factory=lambda: Decayed(TAU_1M_S))
    last_request: float | None = None
    ttft_cold_ms: float | None = None
    ttft_hot_ms: float | None = None
    served_after_load: Decayed = field(default_factory=_tau10)
    errors_after_load: Decayed = field(default_factory=_tau10)
    classes: dict[str, Decayed] = field(default_factory=dict)
    burst_armed: bool = True

    def qps_10m(self, now: float) -> float:
        return self.requests_10m.rate(now)

    def qps_1m(self, now: float) -> float:
        return self.requests_1m.rate(now)

    def ttft_penalty_ms(self, prior_ms: float) -> float:
        """Cold minus hot TTFT once both were observed, else the policy's prior."""
        if self.ttft_cold_ms is None or self.ttft_hot_ms is None:
            return prior_ms
        return max(0.0, self.ttft_cold_ms - self.ttft_hot_ms)

    def error_rate_after_load(self, now: float) -> float | None:
        served = self.served_after_load.at_time(now)
        if served < MIN_ERROR_SAMPLES:
            return None
        return self.errors_after_load.at_time(now) / served

    def idle_minutes(self, now: float) -> float:
        """Minutes since the last request; infinite when never requested."""
        if self.last_request is None:
            return math.inf
        return max(0.0, now - self.last_request) / 60.0

    def class_mix(self, now: float) -> dict[str, float]:
        """Share of each request class over the last ~10 minutes."""
        counts = {k: d.at_time(now) for k, d in self.classes.items()}
        total = sum(counts.values())
        return {k: v / total for k, v in counts.items()} if total > 0 else {}

    def dominant_class(self, now: float) -> str | None:
        mix = self.class_mix(now)
        return max(sorted(mix), key=mix.__getitem__) if mix else None


def score_key(adapter_id: str, version: str | None) -> str:
    return f"{adapter_id}@{version}" if version is not None else f"{adapter_id}@*"


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else old + TTFT_SMOOTHING * (sample - old)


def observe(state: ScoreState, *, ts: float, request_class: str, tier: Tier,
            status: RequestStatus, ttft_ms: float | None) -> ScoreState:
    """Fold one request into the state. Refused requests (unknown adapter, not allowed) are
    not demand the cache could serve, so they are ignored. Shadow requests are the control
    plane's own canary warm-up: they count towards the error rate after load, not demand."""
    if status is RequestStatus.refused:
        return state
    if request_class == "shadow":
        return _observe_shadow(state, ts=ts, tier=tier, status=status)
    classes = dict(state.classes)
    classes[request_class] = classes.get(request_class, _tau10()).add(ts)
    cold, hot = state.ttft_cold_ms, state.ttft_hot_ms
    if ttft_ms is not None and status is RequestStatus.ok:
        if tier is Tier.gpu:
            hot = _ewma(hot, ttft_ms)
        elif tier in (Tier.host, Tier.cold):
            cold = _ewma(cold, ttft_ms)
    served, errors = state.served_after_load, state.errors_after_load
    if tier in (Tier.gpu, Tier.host) and status in (RequestStatus.ok, RequestStatus.error):
        served = served.add(ts)
        if status is RequestStatus.error:
            errors = errors.add(ts)
    armed = _armed(state, ts)
    requests_1m = state.requests_1m.add(ts)
    requests_10m = state.requests_10m.add(ts)
    if armed and _bursting(requests_1m, requests_10m, ts) and not _bursting(
            state.requests_1m, state.requests_10m, ts):
        armed = False  # fired: is_burst sees armed -> disarmed
    # One constructor call per request (the hot path of the scoring agent and simulator).
    return ScoreState(
        requests_10m=requests_10m,
        requests_1m=requests_1m,
        last_request=ts if state.last_request is None else max(state.last_request, ts),
        ttft_cold_ms=cold, ttft_hot_ms=hot, served_after_load=served,
        errors_after_load=errors, classes=classes, burst_armed=armed)


def _observe_shadow(state: ScoreState, *, ts: float, tier: Tier,
                    status: RequestStatus) -> ScoreState:
    if tier not in (Tier.gpu, Tier.host) or status not in (RequestStatus.ok, RequestStatus.error):
        return state
    errors = state.errors_after_load
    return replace(state, served_after_load=state.served_after_load.add(ts),
                   errors_after_load=errors.add(ts) if status is RequestStatus.error else errors)


def observe_log(state: ScoreState, log: RequestLog) -> ScoreState:
    return observe(state, ts=log.ts.timestamp(), request_class=log.request_class.value,
                   tier=log.tier_at_arrival, status=log.status, ttft_ms=log.ttft_ms)


def _bursting(r1: Decayed, r10: Decayed, now: float) -> bool:
    recent = r1.at_time(now)
    return recent >= BURST_MIN_REQUESTS_1M and recent / r1.tau >= BURST_FACTOR * r10.rate(now)


def _armed(state: ScoreState, now: float) -> bool:
    return state.burst_armed or state.requests_1m.at_time(now) < BURST_REARM_REQUESTS_1M


def is_burst(before: ScoreState, after: ScoreState, now: float) -> bool:
    """The 1-minute rate just crossed both a floor and BURST_FACTOR x the 10-minute rate:
    worth re-planning now instead of at the next tick. Fires once per crossing, and again
    only after the 1-minute count fell below BURST_REARM_REQUESTS_1M (hysteresis)."""
    return _armed(before, now) and not after.burst_armed


def merged(a: ScoreState, b: ScoreState) -> ScoreState:
    """Demand of two states together (a version plus its adapter's unattributed demand).
    Version-specific facts (TTFT, errors) come from ``a``."""

    def add(x: Decayed, y: Decayed) -> Decayed:
        at = max(x.at, y.at)
        return Decayed(x.tau, x.at_time(at) + y.at_time(at), at)

    classes = dict(a.classes)
    for k, d in b.classes.items():
        classes[k] = add(classes[k], d) if k in classes else d
    last = [t for t in (a.last_request, b.last_request) if t is not None]
    return replace(a, requests_10m=add(a.requests_10m, b.requests_10m),
                   requests_1m=add(a.requests_1m, b.requests_1m),
                   last_request=max(last) if last else None, classes=classes)


def _clip(x: float) -> float:
    return min(1.0, max(0.0, x)) if math.isfinite(x) else (1.0 if x > 0 else 0.0)


# The terms read the counters directly (``ScoreState.qps_10m`` is ``requests_10m.rate``):
# the planner scores every version on every tick.
def _qps_10m(state: ScoreState, priority: str, scheduled: float, policy: Policy,
             now: float) -> float:
    return _clip(state.requests_10m.rate(now) / policy.normalisation.qps_10m)


def _qps_1m(state: ScoreState, priority: str, scheduled: float, policy: Policy,
            now: float) -> float:
    return _clip(state.requests_1m.rate(now) / policy.normalisation.qps_1m)


def _ttft_penalty(state: ScoreState, priority: str, scheduled: float, policy: Policy,
                  now: float) -> float:
    return _clip(state.ttft_penalty_ms(policy.ttft_penalty_prior_ms)
                 / policy.normalisation.ttft_penalty_ms)


def _priority(state: ScoreState, priority: str, scheduled: float, policy: Policy,
              now: float) -> float:
    return _clip(policy.tenant_priority_values.get(priority, 0.0))


def _scheduled(state: ScoreState, priority: str, scheduled: float, policy: Policy,
               now: float) -> float:
    return _clip(scheduled)


_TERMS = {"qps_10m": _qps_10m, "qps_1m": _qps_1m, "ttft_penalty_if_cold": _ttft_penalty,
          "tenant_priority": _priority, "scheduled_warmup_score": _scheduled}


def hot_score(state: ScoreState, priority: str, scheduled_warmup: float, policy: Policy,
              now: float, weights: dict[str, float] | None = None) -> float:
    """Weighted sum of the normalised terms named in ``policy.hot_score_formula``; always in
    ``[0, sum(weights)]``. Pass ``weights`` (``policy.weights``) to skip re-parsing the
    formula in a hot loop. Only the weighted terms are computed (the planner scores every
    version on every tick).

    ``ttft_penalty_if_cold`` is what a request pays when this adapter is cold. It is counted
    whether or not the adapter is hot right now: dropping it once loaded would lower the
    score of every adapter the moment it is placed and make residents swap back and forth.
    """
    return sum(w * _TERMS[name](state, priority, scheduled_warmup, policy, now)
               for name, w in (weights or policy.weights).items())


# --- serialisation for the changelog-backed table -------------------------------------------

def _decayed_dict(d: Decayed) -> list[float]:
    return [d.value, d.at]


def to_dict(state: ScoreState) -> dict[str, Any]:
    return {
        "r10": _decayed_dict(state.requests_10m),
        "r1": _decayed_dict(state.requests_1m),
        "last": state.last_request,
        "cold": state.ttft_cold_ms,
        "hot": state.ttft_hot_ms,
        "served": _decayed_dict(state.served_after_load),
        "errors": _decayed_dict(state.errors_after_load),
        "classes": {k: _decayed_dict(v) for k, v in state.classes.items()},
        "armed": state.burst_armed,
    }


def from_dict(data: dict[str, Any]) -> ScoreState:
    def dec(tau: float, pair: list[float]) -> Decayed:
        return Decayed(tau, float(pair[0]), float(pair[1]))

    return ScoreState(
        requests_10m=dec(TAU_10M_S, data["r10"]),
        requests_1m=dec(TAU_1M_S, data["r1"]),
        last_request=data["last"],
        ttft_cold_ms=data["cold"],
        ttft_hot_ms=data["hot"],
        served_after_load=dec(TAU_10M_S, data["served"]),
        errors_after_load=dec(TAU_10M_S, data["errors"]),
        classes={k: dec(TAU_10M_S, v) for k, v in data["classes"].items()},
        burst_armed=bool(data.get("armed", True)),
    )
