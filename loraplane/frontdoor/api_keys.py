"""API key -> tenant map of the gateway, kept as sha256 digests so the file holds no secret.

File format (JSON): ``{"keys": {"<sha256 hex of the key>": ENTRY}}``, an ENTRY being the
key's ``"<tenant_id>"`` (every base model), or ``{"tenant": "<tenant_id>", "base_models":
["<base_model>", ...]}``: a key the door takes only for adapters of those base models;
written by ``loraplane worker add-key [--base-model B]...``. ``ApiKeysFile`` re-reads the
file whenever its inode, size or mtime changes, so an added (or removed) key takes effect
without a restart. A bad file is an error at start; a bad edit later fails closed (no key
is accepted until it is fixed). A missing or empty file is allowed but logged as a
warning: every request is then a 401.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from loraplane.frontdoor.admission import Grant
from loraplane.kernel.local_files import read_regular
from loraplane.kernel.secrets import write_private
from loraplane.schemas.base import is_id
from loraplane.schemas.strict_json import strict_loads

__all__ = [
    "MAX_API_KEYS_BYTES",
    "ApiKeys",
    "ApiKeysFile",
    "add_key",
    "key_digest",
    "load_api_keys",
]

_SHA256 = re.compile(r"[0-9a-f]{64}")
_UNREAD = (-1, -1, -1)
MAX_API_KEYS_BYTES = 16 * 1024 * 1024
"""About 150,000 keys; a longer file (or a FIFO, a device) is invalid, as a malformed one."""
log = logging.getLogger("loraplane.worker")


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKeys:
    tenants_by_digest: dict[str, str]
    # the base models a scoped key may use; a key not here may use every one
    base_models_by_digest: dict[str, frozenset[str]] = field(default_factory=dict)
    # exact headers of known keys -> their grant: at most one entry per key, so unknown or
    # padded headers can never grow it; gone with this object when the file changes
    _known: dict[str, Grant] = field(default_factory=dict, compare=False, repr=False)

    def grant(self, authorization: str | None) -> Grant | None:
        """The tenant and scope of an ``Authorization: Bearer KEY`` header, None when
        unknown, both from this one file: a caller that asked for them apart could take the
        tenant from one version of the file and the scope from the next. Keys are ASCII
        (``add_key``); other bytes a client sends (aiohttp hands them over as surrogates)
        are no key, never an encoding error."""
        if not authorization:
            return None
        known = self._known.get(authorization)
        if known is not None or not authorization.startswith("Bearer "):
            return known
        key = authorization[len("Bearer ") :].strip()
        if not key or not key.isascii():
            return None
        digest = key_digest(key)
        tenant = self.tenants_by_digest.get(digest)
        if tenant is None:
            return None
        found = (tenant, self.base_models_by_digest.get(digest))
        if len(key) + len("Bearer ") == len(authorization):
            self._known[authorization] = found
        return found


def load_api_keys(path: Path) -> ApiKeys:
    if not path.is_file():
        return ApiKeys({})
    data = strict_loads(read_regular(path, MAX_API_KEYS_BYTES), max_bytes=MAX_API_KEYS_BYTES)
    keys = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(keys, dict):
        raise ValueError(f'{path}: expected {{"keys": {{sha256: tenant_id}}}}')
    tenants: dict[str, str] = {}
    scopes: dict[str, frozenset[str]] = {}
    for digest, entry in keys.items():
        tenant, scope = _entry(entry)
        if not _SHA256.fullmatch(str(digest)) or tenant is None:
            raise ValueError(f"{path}: bad entry {digest!r}: {str(entry)[:200]}")
        tenants[digest] = tenant
        if scope is not None:
            scopes[digest] = scope
    return ApiKeys(tenants, scopes)


def _entry(entry: object) -> tuple[str | None, frozenset[str] | None]:
    """A key's tenant and scope (None: every base model); a tenant of None: not an entry."""
    if isinstance(entry, str):
        return (entry if is_id(entry) else None), None
    if not isinstance(entry, dict) or set(entry) != {"tenant", "base_models"}:
        return None, None
    tenant, bases = entry["tenant"], entry["base_models"]
    if (
        not is_id(tenant)
        or not isinstance(bases, list)
        or not bases
        or not all(is_id(b) for b in bases)
    ):
        return None, None
    return tenant, frozenset(bases)


class ApiKeysFile:
    """The keys in ``path`` as the file says now (one ``stat`` per lookup).

    ``open`` is for the start: a malformed file raises there, as before."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = _UNREAD
        self._keys = ApiKeys({})

    @classmethod
    def open(cls, path: Path) -> ApiKeysFile:
        keys = cls(path)
        keys._stamp = _stamp(path)  # stamp first: a change while loading is re-read later
        keys._keys = load_api_keys(path)
        if keys._stamp is None:
            log.warning(
                "API key file %s is missing: every request gets 401 until a key is "
                "added (loraplane worker add-key --tenant T)",
                path,
            )
        elif not keys._keys.tenants_by_digest:
            log.warning("API key file %s holds no keys: every request gets 401", path)
        return keys

    def current(self) -> ApiKeys:
        stamp = _stamp(self.path)
        if stamp == self._stamp:
            return self._keys
        self._stamp = stamp
        try:
            self._keys = load_api_keys(self.path)
        except (ValueError, OSError) as exc:
            self._keys = ApiKeys({})
            log.error(
                "API key file %s is invalid, accepting no key until fixed: %s",
                self.path,
                str(exc)[:200],
            )
            return self._keys
        if stamp is None:
            log.warning("API key file %s is gone: every request gets 401", self.path)
        else:
            log.info(
                "API key file %s re-read: %d keys", self.path, len(self._keys.tenants_by_digest)
            )
        return self._keys

    def grant(self, authorization: str | None) -> Grant | None:
        return self.current().grant(authorization)


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def add_key(path: Path, tenant_id: str, base_models: list[str] | None = None) -> str:
    """Create a new key for ``tenant_id`` (scoped to ``base_models`` when given), store its
    digest, return the key (shown once)."""
    if not is_id(tenant_id):
        raise ValueError(f"not a tenant id: {tenant_id!r}")
    bad = [b for b in base_models or () if not is_id(b)]
    if bad or base_models == []:
        raise ValueError(f"not base model ids: {bad!r}")
    current = load_api_keys(path)
    entries: dict[str, object] = dict(current.tenants_by_digest)
    for digest, scope in current.base_models_by_digest.items():
        entries[digest] = {"tenant": entries[digest], "base_models": sorted(scope)}
    key = "lp-" + secrets.token_urlsafe(24)
    entries[key_digest(key)] = (
        tenant_id
        if base_models is None
        else {"tenant": tenant_id, "base_models": sorted(set(base_models))}
    )
    write_private(path, json.dumps({"keys": entries}, indent=2, sort_keys=True))
    return key
