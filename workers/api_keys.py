"""API key -> tenant map of the gateway, kept as sha256 digests so the file holds no secret.

File format (JSON): ``{"keys": {"<sha256 hex of the key>": "<tenant_id>"}}``; written by
``loraplane worker add-key``. The file is read once at start; a bad file is an error at
start, never a silently open gateway.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from schemas.base import ID_PATTERN

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_TENANT = re.compile(ID_PATTERN)


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKeys:
    tenants_by_digest: dict[str, str]

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of an ``Authorization: Bearer KEY`` header, None when unknown."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        key = authorization[len("Bearer "):].strip()
        return self.tenants_by_digest.get(key_digest(key)) if key else None


def load_api_keys(path: Path) -> ApiKeys:
    if not path.is_file():
        return ApiKeys({})
    data = json.loads(path.read_text())
    keys = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(keys, dict):
        raise ValueError(f"{path}: expected {{\"keys\": {{sha256: tenant_id}}}}")
    for digest, tenant in keys.items():
        if not _SHA256.match(str(digest)) or not _TENANT.match(str(tenant)):
            raise ValueError(f"{path}: bad entry {digest!r}: {tenant!r}")
    return ApiKeys(dict(keys))


def add_key(path: Path, tenant_id: str) -> str:
    """Create a new key for ``tenant_id``, store its digest, return the key (shown once)."""
    if not _TENANT.match(tenant_id):
        raise ValueError(f"not a tenant id: {tenant_id!r}")
    current = load_api_keys(path).tenants_by_digest
    key = "lp-" + secrets.token_urlsafe(24)
    current[key_digest(key)] = tenant_id
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"keys": current}, indent=2, sort_keys=True))
    tmp.chmod(0o600)
    tmp.replace(path)
    return key
