"""Per adapter-version score state from request logs, and the hot score. Pure: time is an
argument (epoch seconds), so the simulator replays it with simulated time.

Why exponentially decayed counters rather than windowed counts: a counter is two floats
(value, time of last update) per rate, so a version's state is O(1) whatever its traffic,
serialises to a small record (schemas.score_snapshot) and needs no window buckets; for a
steady rate ``r`` it converges to ``r * tau``, so ``value / tau`` is the recent rate, and an
event older than the last update is added already decayed (out of order is exact). The daily
profile (``Daily``: two harmonics of a version's requests over the time of day, decayed over
days) places a version busy every morning before the morning comes. Demand the gateway could
not attribute to a version is kept under ``score_key(adapter_id, None)`` and counted for the
active version. docs/planner.md, "Hot score".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from itertools import repeat
from operator import add, attrgetter, is_not
from typing import NamedTuple

import msgspec
import numpy as np

from loraplane.kernel.decayed import Decayed
from loraplane.kernel.policy import Policy
from loraplane.schemas.request_log import RequestDemand, RequestStatus, Tier
from loraplane.schemas.score_snapshot import ScoreSnapshot

__all__ = [
    "BURST_FACTOR",
    "BURST_MIN_REQUESTS_1M",
    "BURST_REARM_REQUESTS_1M",
    "DAY_S",
    "MIN_ERROR_SAMPLES",
    "TAU_1M_S",
    "TAU_10M_S",
    "TAU_DAYS_S",
    "TTFT_SMOOTHING",
    "Daily",
    "Flat",
    "Sample",
    "SampleRow",
    "ScoreInputs",
    "ScoreState",
    "daily_merged",
    "daily_rates_at",
    "decayed_at",
    "from_snapshot",
    "hot_score",
    "hot_scores_of",
    "is_burst",
    "merged",
    "observe",
    "observe_many",
    "priority_values",
    "score_key",
    "score_keys",
    "snapshot",
    "snapshot_bytes",
    "unattributed_keys",
]

TAU_10M_S = 600.0
TAU_1M_S = 60.0
DAY_S = 86_400.0
TAU_DAYS_S = 3 * DAY_S
"""Memory of the daily profile: the last ~3 days count, older ones fade."""
_OMEGA = 2 * math.pi / DAY_S
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


def _tau10() -> Decayed:
    return Decayed(TAU_10M_S)


@dataclass(frozen=True)
class Daily:
    """Requests over the time of day: decayed (``TAU_DAYS_S``) sums of 1, cos and sin of the
    request's phase (one and two cycles a day), as of ``at``, and the first request's time.

    Why harmonics rather than 24 hourly counters: five floats per version whatever its
    traffic, and a smooth profile that one day of data already pins down. The rate is read
    back by a weighted least-squares fit (``daily_rates_at``), not by reading the sums as
    Fourier coefficients: the decay weighs the latest hours most, which would itself look
    like a daily cycle (~10% at a 3-day decay)."""

    n: float = 0.0
    c1: float = 0.0
    s1: float = 0.0
    c2: float = 0.0
    s2: float = 0.0
    at: float = 0.0
    since: float | None = None

    def rate_at(self, when: float, now: float) -> float:
        """Requests per second the profile says for the time of day of ``when``, from what
        was seen by ``now`` (a batch of one of ``daily_rates_at``)."""
        return float(daily_rates_at(np.array([_daily_row(self)]), when, now)[0])


def _phase(ts: float) -> float:
    return math.fmod(ts, DAY_S) * _OMEGA


@dataclass(frozen=True)
class ScoreState:
    """What the request logs say about one adapter version (or its unattributed demand).

    The methods define each fact for one version; the planner computes the same facts for
    all versions at once as numpy columns, property-tested against these definitions
    (tests/unit/test_scores_vectorised.py, test_planner_selection.py)."""

    requests_10m: Decayed = field(default_factory=_tau10)
    requests_1m: Decayed = field(default_factory=lambda: Decayed(TAU_1M_S))
    last_request: float | None = None
    ttft_cold_ms: float | None = None
    ttft_hot_ms: float | None = None
    served_after_load: Decayed = field(default_factory=_tau10)
    errors_after_load: Decayed = field(default_factory=_tau10)
    classes: dict[str, Decayed] = field(default_factory=dict)
    burst_armed: bool = True
    daily: Daily = field(default_factory=Daily)

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


def score_keys(adapter_ids: list[str], versions: list[str]) -> list[str]:
    """``score_key`` of many versions, in C-level passes (a planner reads 100k at once)."""
    return list(map("@".join, zip(adapter_ids, versions, strict=True)))


def unattributed_keys(adapter_ids: list[str]) -> list[str | None]:
    """``score_key(a, None)`` of many adapters: where their unattributed demand is kept."""
    return list(map(add, adapter_ids, repeat("@*")))


SampleRow = tuple[float, str, Tier, RequestStatus, float | None]
"""A ``Sample`` as a plain tuple: the batch fold builds one per request log."""


class Sample(NamedTuple):
    """One request as the scores see it (time in epoch seconds)."""

    ts: float
    request_class: str
    tier: Tier
    status: RequestStatus
    ttft_ms: float | None

    @classmethod
    def from_demand(cls, log: RequestDemand) -> Sample:
        return cls(
            log.ts.timestamp(),
            log.request_class.value,
            log.tier_at_arrival,
            log.status,
            log.ttft_ms,
        )


def observe(
    state: ScoreState,
    *,
    ts: float,
    request_class: str,
    tier: Tier,
    status: RequestStatus,
    ttft_ms: float | None,
) -> ScoreState:
    """Fold one request into the state (see ``observe_many``)."""
    return observe_many(state, (Sample(ts, request_class, tier, status, ttft_ms),))[0]


def observe_many(state: ScoreState, samples: Iterable[SampleRow]) -> tuple[ScoreState, bool]:
    """Fold requests into the state, in order; also says whether any of them started a
    burst (``is_burst`` of that step): ``Flat.observe_many`` on the state's fields."""
    flat, fired = Flat.of(state).observe_many(samples)
    return flat.state(), fired


class Flat(msgspec.Struct, frozen=True, gc=False):
    """A ``ScoreState`` as bare fields: what the scoring keeper holds per score key, folds
    into (``observe_many``) and writes (``snapshot_bytes``). ``of`` and ``state`` convert
    both ways, exactly; a fold returns a new ``Flat`` and leaves its input as it was.

    Why not ``ScoreState`` itself: rebuilding its nested frozen dataclasses cost ~8 us per
    touched key and batch, and reading them back for the record ~2.5 us more, which made
    a small batch cost several times a large one per log; this struct is built in one C
    call and read back as one tuple (docs/benchmarks.md, "Stream throughput")."""

    r10: float = 0.0
    r10_at: float = 0.0
    r1: float = 0.0
    r1_at: float = 0.0
    last: float | None = None
    cold: float | None = None
    hot: float | None = None
    served: float = 0.0
    served_at: float = 0.0
    errors: float = 0.0
    errors_at: float = 0.0
    classes: dict[str, tuple[float, float]] = {}
    """Per request class, its 10-minute counter (value, at)."""
    armed: bool = True
    dn: float = 0.0
    dc1: float = 0.0
    ds1: float = 0.0
    dc2: float = 0.0
    ds2: float = 0.0
    dat: float = 0.0
    dsince: float | None = None

    @classmethod
    def of(cls, state: ScoreState) -> Flat:
        r10, r1, served, errors, d = (
            state.requests_10m,
            state.requests_1m,
            state.served_after_load,
            state.errors_after_load,
            state.daily,
        )
        return cls(
            r10.value,
            r10.at,
            r1.value,
            r1.at,
            state.last_request,
            state.ttft_cold_ms,
            state.ttft_hot_ms,
            served.value,
            served.at,
            errors.value,
            errors.at,
            {k: (v.value, v.at) for k, v in state.classes.items()},
            state.burst_armed,
            d.n,
            d.c1,
            d.s1,
            d.c2,
            d.s2,
            d.at,
            d.since,
        )

    def state(self) -> ScoreState:
        """The ``ScoreState`` these fields are."""
        return ScoreState(
            requests_10m=Decayed(TAU_10M_S, self.r10, self.r10_at),
            requests_1m=Decayed(TAU_1M_S, self.r1, self.r1_at),
            last_request=self.last,
            ttft_cold_ms=self.cold,
            ttft_hot_ms=self.hot,
            served_after_load=Decayed(TAU_10M_S, self.served, self.served_at),
            errors_after_load=Decayed(TAU_10M_S, self.errors, self.errors_at),
            classes={k: Decayed(TAU_10M_S, v, at) for k, (v, at) in self.classes.items()},
            burst_armed=self.armed,
            daily=Daily(self.dn, self.dc1, self.ds1, self.dc2, self.ds2, self.dat, self.dsince),
        )

    def observe_many(self, samples: Iterable[SampleRow]) -> tuple[Flat, bool]:
        """Fold requests into a new state, in order; also says whether any of them started
        a burst (``is_burst`` of that step). Refused requests (unknown adapter, not allowed)
        are not demand the cache could serve, so they are ignored. Shadow requests are the
        control plane's own canary warm-up: they count towards the error rate after load,
        not demand.

        Each counter is ``Decayed.add`` on bare floats: an event at or after the counter's
        time decays it to the event (``value * exp((at - ts) / tau)``) and adds 1, an
        earlier one adds ``exp((ts - at) / tau)``. The burst test reads the 1- and
        10-minute counters just before and just after each request: before is the decayed
        value the add computes anyway, after is the new value (at its own time), so one exp
        per counter and request.

        Why inlined floats and one ``Flat`` at the end: this is the scoring agent's hot
        path, run per request log over a batch; the per-request object version cost ~8 us a
        request, the version with helper calls per counter ~3x this one (the old form is
        kept as the reference of tests/unit/test_score_fast_path.py, which checks both
        agree)."""
        (
            r10,
            r10_at,
            r1,
            r1_at,
            last,
            cold,
            hot,
            served,
            served_at,
            errors,
            errors_at,
            classes,
            armed,
            dn,
            dc1,
            ds1,
            dc2,
            ds2,
            dat,
            dsince,
        ) = _astuple(self)
        classes = dict(classes)
        cos, sin, fmod = math.cos, math.sin, math.fmod
        fired = False
        exp = math.exp
        refused, ok, error = RequestStatus.refused, RequestStatus.ok, RequestStatus.error
        gpu, host, cold_tier = Tier.gpu, Tier.host, Tier.cold
        for ts, request_class, tier, status, ttft_ms in samples:
            if status is refused:
                continue
            # the 10-minute decay from r10's time to ts: the served and class counters mostly
            # share that time (the same request updated them), and then their exp is this one
            d10 = exp((r10_at - ts) / TAU_10M_S) if ts >= r10_at else 0.0
            if (tier is gpu or tier is host) and (status is ok or status is error):
                if ts >= served_at:
                    if not served:
                        served = 1.0
                    elif served_at == r10_at:
                        served = served * d10 + 1.0
                    else:
                        served = served * exp((served_at - ts) / TAU_10M_S) + 1.0
                    served_at = ts
                else:
                    served += exp((ts - served_at) / TAU_10M_S)
                if status is error:
                    if ts >= errors_at:
                        errors, errors_at = (
                            (errors * exp((errors_at - ts) / TAU_10M_S) if errors else 0.0) + 1.0,
                            ts,
                        )
                    else:
                        errors += exp((ts - errors_at) / TAU_10M_S)
            if request_class == "shadow":
                continue
            c_value, c_at = classes.get(request_class, _ZERO)
            if ts >= c_at:
                if not c_value:
                    classes[request_class] = 1.0, ts
                elif c_at == r10_at:
                    classes[request_class] = c_value * d10 + 1.0, ts
                else:
                    classes[request_class] = c_value * exp((c_at - ts) / TAU_10M_S) + 1.0, ts
            else:
                classes[request_class] = c_value + exp((ts - c_at) / TAU_10M_S), c_at
            if ttft_ms is not None and status is ok:
                if tier is gpu:
                    hot = ttft_ms if hot is None else hot + TTFT_SMOOTHING * (ttft_ms - hot)
                elif tier is host or tier is cold_tier:
                    cold = ttft_ms if cold is None else cold + TTFT_SMOOTHING * (ttft_ms - cold)
            # p1, p10: the counters decayed to ts, before this request; r1, r10: after it.
            if ts >= r1_at:
                p1 = r1 * exp((r1_at - ts) / TAU_1M_S) if r1 else 0.0
                r1, r1_at = p1 + 1.0, ts
            else:
                p1 = r1 if r1 else 0.0
                r1 += exp((ts - r1_at) / TAU_1M_S)
            if ts >= r10_at:
                p10 = r10 * d10 if r10 else 0.0
                r10, r10_at = p10 + 1.0, ts
            else:
                p10 = r10 if r10 else 0.0
                r10 += exp((ts - r10_at) / TAU_10M_S)
            armed = armed or p1 < BURST_REARM_REQUESTS_1M
            if (
                armed
                and r1 >= BURST_MIN_REQUESTS_1M
                and r1 / TAU_1M_S >= BURST_FACTOR * (r10 / TAU_10M_S)
                and not (
                    p1 >= BURST_MIN_REQUESTS_1M
                    and p1 / TAU_1M_S >= BURST_FACTOR * (p10 / TAU_10M_S)
                )
            ):
                armed, fired = False, True  # fired: is_burst sees armed -> disarmed
            if last is None or ts > last:
                last = ts
            # the daily sums (the reference form, one call per request, is the test's)
            ph = fmod(ts, DAY_S) * _OMEGA
            c, s = cos(ph), sin(ph)
            c2, s2 = c * c - s * s, 2 * s * c
            if dsince is None or ts < dsince:
                dsince = ts
            if ts >= dat:
                k = exp((dat - ts) / TAU_DAYS_S) if dn else 0.0
                dn, dc1, ds1, dc2, ds2, dat = (
                    dn * k + 1.0,
                    dc1 * k + c,
                    ds1 * k + s,
                    dc2 * k + c2,
                    ds2 * k + s2,
                    ts,
                )
            else:
                k = exp((ts - dat) / TAU_DAYS_S)
                dn, dc1, ds1, dc2, ds2 = (
                    dn + k,
                    dc1 + k * c,
                    ds1 + k * s,
                    dc2 + k * c2,
                    ds2 + k * s2,
                )
        return Flat(
            r10,
            r10_at,
            r1,
            r1_at,
            last,
            cold,
            hot,
            served,
            served_at,
            errors,
            errors_at,
            classes,
            armed,
            dn,
            dc1,
            ds1,
            dc2,
            ds2,
            dat,
            dsince,
        ), fired

    def snapshot_bytes(self) -> bytes:
        """The scores record of this state (module ``snapshot_bytes``)."""
        return _encode_wire(
            _Wire(
                1,
                (self.r10, self.r10_at),
                (self.r1, self.r1_at),
                self.last,
                self.cold,
                self.hot,
                (self.served, self.served_at),
                (self.errors, self.errors_at),
                self.classes,
                self.armed,
                None
                if not self.dn
                else (self.dn, self.dc1, self.ds1, self.dc2, self.ds2, self.dat),
                self.dsince,
            )
        )


_astuple = msgspec.structs.astuple


_ZERO = (0.0, 0.0)


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
    return replace(
        a,
        requests_10m=add(a.requests_10m, b.requests_10m),
        requests_1m=add(a.requests_1m, b.requests_1m),
        last_request=max(last) if last else None,
        classes=classes,
        daily=daily_merged(a.daily, b.daily),
    )


def daily_merged(a: Daily, b: Daily) -> Daily:
    """The profile of both request streams together."""
    if not b.n:
        return a
    if not a.n:
        return b
    at = max(a.at, b.at)
    ka, kb = math.exp((a.at - at) / TAU_DAYS_S), math.exp((b.at - at) / TAU_DAYS_S)
    since = (
        min(x for x in (a.since, b.since) if x is not None)
        if a.since is not None or b.since is not None
        else None
    )
    return Daily(
        a.n * ka + b.n * kb,
        a.c1 * ka + b.c1 * kb,
        a.s1 * ka + b.s1 * kb,
        a.c2 * ka + b.c2 * kb,
        a.s2 * ka + b.s2 * kb,
        at,
        since,
    )


def _clip(x: np.ndarray) -> np.ndarray:
    """Each input clipped to [0, 1]; NaN counts as 0 (as a missing input would)."""
    return np.where(np.isnan(x), 0.0, np.minimum(1.0, np.maximum(0.0, x)))


def decayed_at(value: np.ndarray, at: np.ndarray, tau: float, now: float) -> np.ndarray:
    """``Decayed.at_time(now)`` of many counters (``value[i]``, ``at[i]``) at once.

    The exp is numpy's, which differs from ``math.exp`` by an ulp on ~3% of inputs; what
    matters is that every score goes through this one function, alone or in a batch, so a
    version scores (and ties) the same either way: numpy computes each element the same
    whatever the array around it (``tests/unit/test_scores_vectorised.py``)."""
    decay = np.exp(-np.maximum(0.0, now - at) / tau)
    return np.where(value != 0.0, value * decay, 0.0)


@dataclass(frozen=True)
class ScoreInputs:
    """What the hot score reads from the score states of many versions, as columns: the
    planner keeps these between ticks and rebuilds only the rows whose state changed;
    only the decays depend on the time."""

    r10_value: np.ndarray
    r10_at: np.ndarray
    r1_value: np.ndarray
    r1_at: np.ndarray
    ttft_known: np.ndarray  # bool: both cold and hot TTFT observed
    ttft_gap_ms: np.ndarray  # cold minus hot TTFT where known, else 0
    daily: np.ndarray  # (n, 7): Daily's n, c1, s1, c2, s2, at, since (NaN: never)

    @classmethod
    def from_states(cls, states: Sequence[ScoreState]) -> ScoreInputs:
        # Column by column, each a C-level pass over the states: no object per state (a
        # tuple or a call each cost ~2 us at 100k states, and fed the garbage collector).
        n = len(states)
        dailies = list(map(_DAILY, states))
        daily = np.empty((n, 7))
        for j, field_of in enumerate(_DAILY_FIELDS):
            daily[:, j] = np.fromiter(map(field_of, dailies), float, n)
        # None -> NaN: a profile that never saw a request (as ``_daily_row``)
        daily[:, 6] = np.array(list(map(_SINCE, dailies)), dtype=float)
        r10 = list(map(_R10, states))
        r1 = list(map(_R1, states))
        colds, hots = list(map(_TTFT_COLD, states)), list(map(_TTFT_HOT, states))
        known = np.fromiter(map(is_not, colds, repeat(None)), bool, n) & np.fromiter(
            map(is_not, hots, repeat(None)), bool, n
        )
        gap = np.zeros(n)
        with np.errstate(invalid="ignore"):  # inf - inf is NaN, as in Python, unremarked
            gap[known] = _differences(colds, hots, known)
        return cls(
            np.fromiter(map(_VALUE, r10), float, n),
            np.fromiter(map(_AT, r10), float, n),
            np.fromiter(map(_VALUE, r1), float, n),
            np.fromiter(map(_AT, r1), float, n),
            known,
            gap,
            daily,
        )

    @classmethod
    def zeros(cls, n: int) -> ScoreInputs:
        """Columns of ``n`` versions with no requests."""
        daily = np.zeros((n, 7))
        daily[:, 6] = np.nan
        z = np.zeros
        return cls(z(n), z(n), z(n), z(n), z(n, bool), z(n), daily)

    def rows(self, take: np.ndarray) -> ScoreInputs:
        """The rows ``take``, in that order."""
        return ScoreInputs(
            self.r10_value[take],
            self.r10_at[take],
            self.r1_value[take],
            self.r1_at[take],
            self.ttft_known[take],
            self.ttft_gap_ms[take],
            self.daily[take],
        )


def _differences(a: list[float | None], b: list[float | None], known: np.ndarray) -> np.ndarray:
    """``a[i] - b[i]`` for the rows ``known`` (where neither is None), as floats."""
    if known.all():
        everywhere: np.ndarray = np.array(a, dtype=float) - np.array(b, dtype=float)
        return everywhere
    rows = np.flatnonzero(known).tolist()
    m = len(rows)
    somewhere: np.ndarray = np.fromiter(map(a.__getitem__, rows), float, m) - np.fromiter(
        map(b.__getitem__, rows), float, m
    )
    return somewhere


def _daily_row(d: Daily) -> tuple[float, ...]:
    return (d.n, d.c1, d.s1, d.c2, d.s2, d.at, math.nan if d.since is None else d.since)


_HARMONIC = np.array([0, 1, 1, 2, 2])
_FIT_STEP_S = 3600.0
_IS_SIN = np.array([False, False, True, False, True])


def _gram(now: float, seen: np.ndarray) -> np.ndarray:
    """(n, 5, 5): the integrals over the last ``seen`` seconds, weighted as the sums decay,
    of the products of 1, cos, sin, cos 2, sin 2 of the phase: what the sums of a request
    stream of rate ``theta . f(phase)`` converge to is ``gram @ theta``."""
    k = np.arange(5)
    rate = 1.0 / TAU_DAYS_S + 1j * k * _OMEGA
    # K_k = int_0^seen exp(-u / tau) exp(i k w (now - u)) du
    big_k = (
        np.exp(1j * k * _phase(now))[None, :]
        * -np.expm1(-seen[:, None] * rate[None, :])
        / rate[None, :]
    )
    cos_k, sin_k = big_k.real, big_k.imag

    def c(j: np.ndarray) -> np.ndarray:
        out: np.ndarray = cos_k[:, np.abs(j)]
        return out

    def s(j: np.ndarray) -> np.ndarray:
        out: np.ndarray = np.sign(j) * sin_k[:, np.abs(j)]
        return out

    a, b = np.meshgrid(_HARMONIC, _HARMONIC, indexing="ij")
    sa, sb = np.meshgrid(_IS_SIN, _IS_SIN, indexing="ij")
    cc = (c(a - b) + c(a + b)) / 2
    ss = (c(a - b) - c(a + b)) / 2
    cs = (s(a + b) - s(a - b)) / 2  # cos(a) sin(b)
    sc = (s(a + b) + s(a - b)) / 2  # sin(a) cos(b)
    gram: np.ndarray = np.where(sa & sb, ss, np.where(sa, sc, np.where(sb, cs, cc)))
    return gram


def daily_rates_at(daily: np.ndarray, when: float, now: float) -> np.ndarray:
    """Requests per second each profile (rows of ``ScoreInputs.daily``) says for the time of
    day of ``when``, from what was seen by ``now``: the rate ``theta . (1, cos, sin, cos 2,
    sin 2)(phase)`` whose decayed integrals equal the sums (least squares of a Poisson
    intensity under the same weights, over the time since the hour of the first request),
    clipped at 0. 0 before a whole day was seen: a partial day would read one morning as
    every morning."""
    out = np.zeros(len(daily))
    seen = now - daily[:, 6]  # NaN where never: compares False
    ok = np.flatnonzero((seen >= DAY_S) & (daily[:, 0] != 0.0))
    if not ok.size:
        return out
    rows = daily[ok]
    sums = rows[:, :5] * np.exp(-np.maximum(0.0, now - rows[:, 5]) / TAU_DAYS_S)[:, None]
    # The fit's window starts at the hour of the first request (one Gram matrix per distinct
    # hour, not per version: 100k versions cost one small inverse each otherwise, ~0.5 s)
    start_hour = np.floor(rows[:, 6] / _FIT_STEP_S) * _FIT_STEP_S
    hours, which = np.unique(start_hour, return_inverse=True)
    inverse = np.linalg.inv(_gram(now, now - hours))
    theta = np.einsum("nij,nj->ni", inverse[which], sums)
    ph = _phase(when)
    f = np.array([1.0, math.cos(ph), math.sin(ph), math.cos(2 * ph), math.sin(2 * ph)])
    out[ok] = np.maximum(0.0, theta @ f)
    return out


_VALUE = attrgetter("value")
_AT = attrgetter("at")
_R10 = attrgetter("requests_10m")
_R1 = attrgetter("requests_1m")
_DAILY = attrgetter("daily")
_DAILY_FIELDS = tuple(map(attrgetter, ("n", "c1", "s1", "c2", "s2", "at")))
_SINCE = attrgetter("since")
_TTFT_COLD = attrgetter("ttft_cold_ms")
_TTFT_HOT = attrgetter("ttft_hot_ms")


# Each term maps the inputs of many versions to one normalised column.
def _rate_10m(x: ScoreInputs, now: float) -> np.ndarray:
    return decayed_at(x.r10_value, x.r10_at, TAU_10M_S, now) / TAU_10M_S


def _rate_1m(x: ScoreInputs, now: float) -> np.ndarray:
    return decayed_at(x.r1_value, x.r1_at, TAU_1M_S, now) / TAU_1M_S


def _qps_10m(
    x: ScoreInputs, priority: np.ndarray, scheduled: np.ndarray, policy: Policy, now: float
) -> np.ndarray:
    return _clip(_rate_10m(x, now) / policy.normalisation.qps_10m)


def _qps_1m(
    x: ScoreInputs, priority: np.ndarray, scheduled: np.ndarray, policy: Policy, now: float
) -> np.ndarray:
    return _clip(_rate_1m(x, now) / policy.normalisation.qps_1m)


def _ttft_penalty(
    x: ScoreInputs, priority: np.ndarray, scheduled: np.ndarray, policy: Policy, now: float
) -> np.ndarray:
    penalty = np.where(x.ttft_known, np.maximum(0.0, x.ttft_gap_ms), policy.ttft_penalty_prior_ms)
    return _clip(penalty / policy.normalisation.ttft_penalty_ms)


def _priority(
    x: ScoreInputs, priority: np.ndarray, scheduled: np.ndarray, policy: Policy, now: float
) -> np.ndarray:
    return _clip(priority)


def _scheduled(
    x: ScoreInputs, priority: np.ndarray, scheduled: np.ndarray, policy: Policy, now: float
) -> np.ndarray:
    return _clip(scheduled)


def _weighted_demand(
    x: ScoreInputs, priority: np.ndarray, scheduled: np.ndarray, policy: Policy, now: float
) -> np.ndarray:
    """Forecast requests/s times the tenant's priority value: what a miss of this version
    costs per second, the quantity a budgeted cache should rank by (a product, so an idle
    platinum version does not outrank a busy bronze one as an added priority term would).
    The forecast is the 10-minute rate plus ``demand_trend_weight`` of a rise of the 1-minute
    rate above it, and at least ``demand_diurnal_weight`` of what the daily profile says for
    ``demand_diurnal_lead_s`` ahead; a fall is left to the 10-minute decay, so a lull does not
    drop a copy."""
    r10, r1 = _rate_10m(x, now), _rate_1m(x, now)
    forecast = r10 + policy.demand_trend_weight * np.maximum(0.0, r1 - r10)
    if policy.demand_diurnal_weight:
        ahead = daily_rates_at(x.daily, now + policy.demand_diurnal_lead_s, now)
        forecast = np.maximum(forecast, policy.demand_diurnal_weight * ahead)
    return _clip(forecast * priority / policy.normalisation.weighted_demand)


_TERMS = {
    "qps_10m": _qps_10m,
    "qps_1m": _qps_1m,
    "ttft_penalty_if_cold": _ttft_penalty,
    "tenant_priority": _priority,
    "scheduled_warmup_score": _scheduled,
    "weighted_demand": _weighted_demand,
}


def priority_values(priorities: Iterable[str], policy: Policy) -> np.ndarray:
    """``policy.priority_value`` of each priority (0 for an unknown one)."""
    return np.fromiter(map(policy.priority_value, priorities), float)


def hot_scores_of(
    inputs: ScoreInputs,
    priority: np.ndarray,
    scheduled: np.ndarray,
    policy: Policy,
    now: float,
    weights: dict[str, float] | None = None,
) -> np.ndarray:
    """``hot_score`` of many versions from their columns: ``priority`` holds
    ``priority_values``, ``scheduled`` the scheduled warm-up scores. Only the weighted terms
    are computed; pass ``weights`` (``policy.weights``) to skip re-parsing the formula."""
    total = np.zeros(len(inputs.r10_value))
    for name, w in (weights or policy.weights).items():
        total = total + w * _TERMS[name](inputs, priority, scheduled, policy, now)
    return total


def hot_score(
    state: ScoreState,
    priority: str,
    scheduled_warmup: float,
    policy: Policy,
    now: float,
    weights: dict[str, float] | None = None,
) -> float:
    """Weighted sum of the normalised terms named in ``policy.hot_score_formula``; always in
    ``[0, sum(weights)]``. The same computation as a batch of one (``hot_scores_of``).

    ``ttft_penalty_if_cold`` is what a request pays when this adapter is cold. It is counted
    whether or not the adapter is hot right now: dropping it once loaded would lower the
    score of every adapter the moment it is placed and make residents swap back and forth.
    """
    return float(
        hot_scores_of(
            ScoreInputs.from_states([state]),
            priority_values([priority], policy),
            np.array([scheduled_warmup], dtype=float),
            policy,
            now,
            weights,
        )[0]
    )


# --- the wire form (schemas.score_snapshot) -------------------------------------------------


def _pair(d: Decayed) -> tuple[float, float]:
    return (d.value, d.at)


def snapshot(state: ScoreState) -> ScoreSnapshot:
    """The state as written to the scores topic. Not validated: every field is a float or
    bool this module computed (``model_construct`` is half the cost of ``json.dumps`` of a
    dict on the scoring agent's write path); ``from_snapshot`` of a decoded record checks."""
    return ScoreSnapshot.model_construct(
        r10=_pair(state.requests_10m),
        r1=_pair(state.requests_1m),
        last=state.last_request,
        cold=state.ttft_cold_ms,
        hot=state.ttft_hot_ms,
        served=_pair(state.served_after_load),
        errors=_pair(state.errors_after_load),
        classes={k: _pair(v) for k, v in state.classes.items()},
        armed=state.burst_armed,
        day=_daily_sums(state.daily),
        since=state.daily.since,
    )


def _daily_sums(d: Daily) -> tuple[float, float, float, float, float, float] | None:
    return None if not d.n else (d.n, d.c1, d.s1, d.c2, d.s2, d.at)


class _Wire(msgspec.Struct, array_like=False, gc=False):
    """``ScoreSnapshot``'s fields, in its order, for ``snapshot_bytes`` (the tests check the
    two agree field by field and decode to the same record)."""

    schema_version: int
    r10: tuple[float, float]
    r1: tuple[float, float]
    last: float | None
    cold: float | None
    hot: float | None
    served: tuple[float, float]
    errors: tuple[float, float]
    classes: dict[str, tuple[float, float]]
    armed: bool
    day: tuple[float, float, float, float, float, float] | None
    since: float | None


_encode_wire = msgspec.json.Encoder().encode


def snapshot_bytes(state: ScoreState) -> bytes:
    """``encode(snapshot(state))`` as the scoring keeper writes it: the same record, each
    float the same (only an exponent may be spelt ``1e21`` for ``1e+21``), encoded by
    msgspec. Why: the pydantic model cost ~8 us a touched key and batch, a third of the
    keeper's CPU at a few thousand logs a batch."""
    return Flat.of(state).snapshot_bytes()


def from_snapshot(record: ScoreSnapshot) -> ScoreState:
    """The state a (decoded, so validated) scores record holds."""
    return ScoreState(
        requests_10m=Decayed(TAU_10M_S, *record.r10),
        requests_1m=Decayed(TAU_1M_S, *record.r1),
        last_request=record.last,
        ttft_cold_ms=record.cold,
        ttft_hot_ms=record.hot,
        served_after_load=Decayed(TAU_10M_S, *record.served),
        errors_after_load=Decayed(TAU_10M_S, *record.errors),
        classes={k: Decayed(TAU_10M_S, *v) for k, v in record.classes.items()},
        burst_armed=record.armed,
        daily=Daily() if record.day is None else Daily(*record.day, since=record.since),
    )
