"""Which version of an adapter serves a request: active, or the canary for its sticky share
of sessions. Decided once, at the first front door a request meets (the router, or a
gateway reached directly); a router's choice travels signed to the gateway, which serves
exactly it (``loraplane.frontdoor.admission``). Pure."""

from __future__ import annotations

import hashlib

from loraplane.schemas.adapter import AdapterRecord, AdapterStatus
from loraplane.schemas.request_log import RequestClass

__all__ = ["canary_bucket", "choose_version", "serves"]


def canary_bucket(adapter_id: str, session_key: str) -> float:
    """A stable number in [0, 100) per (adapter, session): the canary split is sticky."""
    digest = hashlib.sha256(f"{adapter_id}\x00{session_key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 10_000 / 100


def choose_version(
    versions: list[AdapterRecord], *, session_key: str, request_class: RequestClass
) -> AdapterRecord | None:
    """Active, or the canary for its share of sessions (always for class ``canary``)."""
    active = next((r for r in versions if r.status == AdapterStatus.active), None)
    canary = next(
        (r for r in versions if r.status == AdapterStatus.canary and r.release.canary_percent > 0),
        None,
    )
    if canary is not None and (
        request_class == RequestClass.canary
        or active is None
        or canary_bucket(canary.adapter_id, session_key) < canary.release.canary_percent
    ):
        return canary
    return active


def serves(versions: list[AdapterRecord]) -> bool:
    """Whether some version serves requests: an active one, or a canary above 0 %."""
    return choose_version(versions, session_key="", request_class=RequestClass.canary) is not None
