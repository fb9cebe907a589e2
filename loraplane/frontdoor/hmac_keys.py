"""The HMAC keys of the front door, read at start: the gateway's cache-salt secret and the
router secret that signs forwarded requests. One that is not a secret stops the start."""

from __future__ import annotations

from pathlib import Path

from loraplane.kernel.config import Settings
from loraplane.kernel.secrets import SecretError, secret_key

__all__ = ["hmac_key", "router_secret"]


def hmac_key(path: Path, what: str = "gateway secret") -> bytes:
    """An HMAC key file (``kernel.secrets.secret_key``: made once, mode 0600, never logged):
    the gateway's cache-salt secret, the router secret. One that is not a secret (short,
    readable by others) stops the start with the reason."""
    try:
        return secret_key(path)
    except SecretError as exc:
        raise SystemExit(f"the {what}: {exc}") from None


def router_secret(settings: Settings) -> bytes | None:
    """The fleet routers' secret when this host has one (then a forwarded tenant signed
    with it is believed, loraplane/frontdoor/forwarded.py); without the file, API keys only."""
    path = settings.router_secret_path
    return hmac_key(path, "router secret") if path.exists() else None
