"""Every case of the hostile artifact corpus (tests/hostile_corpus.py) is run end to end
against a real worker (tests/integration/test_worker_e2e.py,
``test_hostile_artifacts_never_reach_vllm``) unless the corpus names it ``NOT_END_TO_END``,
and only a case the stack's worker cannot carry may be named there: one decided by the
worker's own limits, or one whose attack is an object S3 never serves. A new case is run
end to end by default; leaving one out takes a reason here."""

from __future__ import annotations

from tests.hostile_corpus import CASES, NOT_END_TO_END, OVER_S3, end_to_end

NEVER_SERVED = {"file not in manifest", "symlink", "nested", "bundle added after publish"}
"""Attacks made of an object added after publication that the manifest does not list: the
S3 fetcher downloads only what the manifest lists, so the worker never sees it."""


def test_every_hostile_case_runs_end_to_end_or_says_why() -> None:
    ids = [c.id for c in CASES]
    assert len(set(ids)) == len(ids)  # an id names one case
    assert set(NOT_END_TO_END) <= set(ids) and set(OVER_S3) <= set(ids)
    assert {c.id for c in end_to_end()} == set(ids) - set(NOT_END_TO_END)
    limits = {c.id for c in CASES if c.limits}
    assert set(NOT_END_TO_END) == limits | NEVER_SERVED
    assert not set(OVER_S3) & set(NOT_END_TO_END)


def test_the_newest_cases_run_end_to_end() -> None:
    run = {c.id for c in end_to_end()}
    overflow = [c.id for c in CASES if c.reason == "tensor_value_overflows"]
    assert overflow and set(overflow) <= run
    assert {"NaN weight", "infinite weight", "half a pair"} <= run
