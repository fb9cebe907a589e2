"""A gateway's proof, to the routers of its fleet, that it holds the router secret.

A router learns each worker's gateway address from the worker-state topic, which any holder
of the ``worker`` Kafka principal may write. An address believed from the topic alone would
let a forged state take a tenant's requests (their prompts, the tenant signed) to any host.
So a router routes to a worker only once the gateway at the announced address has answered
a random challenge of the router's own (``/healthz?challenge=HEX``) with an HMAC that only a
holder of the router secret can compute, bound to the worker id and that very address (a
relay to a genuine gateway at another address proves nothing). The key is derived from the
router secret for this use alone, so no answer can stand in for a forwarded request's
signature (``frontdoor.forwarded``). Pure: the secret and the challenge are passed in.
"""

from __future__ import annotations

import hmac
import re

__all__ = ["CHALLENGE_PARAM", "PROOF_FIELD", "is_challenge", "proof", "proven"]

CHALLENGE_PARAM = "challenge"
"""The ``/healthz`` query parameter a router puts its challenge in."""
PROOF_FIELD = "proof"
"""The ``/healthz`` answer's field with the gateway's proof."""
_CHALLENGE = re.compile(r"[0-9a-f]{32}")
_PROOF = re.compile(r"[0-9a-f]{64}")
_KEY_LABEL = b"loraplane gateway proof v1"


def is_challenge(value: str | None) -> bool:
    """A router's challenge: 16 random bytes, lowercase hex; anything else gets no proof."""
    return value is not None and _CHALLENGE.fullmatch(value) is not None


def proof(secret: bytes, challenge: str, worker_id: str, gateway_url: str) -> str:
    """The answer to ``challenge`` of the gateway of ``worker_id`` at ``gateway_url``."""
    key = hmac.digest(secret, _KEY_LABEL, "sha256")
    message = f"{challenge}\n{worker_id}\n{gateway_url}".encode()
    return hmac.digest(key, message, "sha256").hex()


def proven(secret: bytes, challenge: str, worker_id: str, gateway_url: str, answer: object) -> bool:
    """``answer`` (the probed ``/healthz`` body's proof) is the one for this challenge."""
    return (
        is_challenge(challenge)
        and isinstance(answer, str)
        and _PROOF.fullmatch(answer) is not None  # compare_digest raises on non-ASCII text
        and hmac.compare_digest(answer, proof(secret, challenge, worker_id, gateway_url))
    )
