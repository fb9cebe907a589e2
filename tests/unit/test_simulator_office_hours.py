"""The office-hours workload (scenario ``workload.office_hours``): each tenant's requests
follow its own working day, one tenant further east than the next, and the arrivals are
the same as without it."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from loraplane.simulator.benchmark import prepare
from loraplane.simulator.scenario import OfficeHours, Scenario, Workload

DAY = 86_400.0


def _scenario(hours: OfficeHours | None) -> Scenario:
    workload = Workload(
        requests=40_000, rate_qps=0.5, adapters=40, tenants=8, alpha=0.5, office_hours=hours
    )
    return Scenario(name="office", seed=3, workload=workload)


def test_each_tenant_is_busy_in_its_own_hours_and_arrivals_are_unchanged() -> None:
    hours = OfficeHours(start_h=9, end_h=17, off_share=0.05, spread_s=DAY)
    plain, office = prepare(_scenario(None)), prepare(_scenario(hours))
    assert office.requests.time_s == plain.requests.time_s  # only the adapters move
    tenants = sorted({a.tenant for a in office.catalog.adapters})
    inside: Counter[str] = Counter()
    total: Counter[str] = Counter()
    for t, a in zip(office.requests.time_s, office.requests.adapter, strict=True):
        tenant = office.catalog.adapters[a].tenant
        local_h = ((t + DAY * tenants.index(tenant) / len(tenants)) % DAY) / 3600
        total[tenant] += 1
        inside[tenant] += 9 <= local_h < 17
    for tenant in tenants:
        # 8 of 24 hours at full share against 16 at 5%: ~91% inside
        assert inside[tenant] / total[tenant] > 0.85, tenant
    # the busy hours differ: the tenants' mean hour of day spreads over the day
    means = [
        np.angle(
            np.mean(
                [
                    np.exp(2j * np.pi * t / DAY)
                    for t, a in zip(office.requests.time_s, office.requests.adapter, strict=True)
                    if office.catalog.adapters[a].tenant == tenant
                ]
            )
        )
        for tenant in tenants
    ]
    assert len({round(m, 1) for m in means}) == len(tenants)


def test_hours_that_end_before_they_start_are_refused() -> None:
    with pytest.raises(ValueError, match="end_h"):
        OfficeHours(start_h=17, end_h=9)


def test_no_share_outside_hours_is_refused() -> None:
    """With nobody in their hours and no share outside them, no request finds an adapter."""
    with pytest.raises(ValueError, match="off_share"):
        OfficeHours(off_share=0.0)
