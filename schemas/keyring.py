"""Who may sign what: the keyring file the registry, the workers and the router trust (YAML,
or JSON which is YAML).

Each key has one ``role``: a ``publisher`` key signs lifecycle events within its scopes
(tenants, actions) and validity window, a ``planner`` key signs cache commands only (its
``tenants`` bound whose copies it may move), so a CI key can never move a GPU copy. Per
tenant, a priority ceiling (``platinum`` means never evicted, so it is granted explicitly)
and whether artifacts need an OpenSSF model signature, verified against ``model_signers``
(keys or certificate authorities, each for the tenants it names). Rotation adds a key of the
same publisher and retires the old one (its window ends, what it signed stays valid); a
revoked key withdraws everything it signed and stays in the file so its events are
reported as revoked, not unknown. ``KeyringFile`` re-reads the file when it changes.

The format, an example and every rule: docs/lifecycle.md, "Keyring file".
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from loraplane.schemas.adapter import Priority
from loraplane.schemas.base import Identifier, StrictModel, Timestamp
from loraplane.schemas.commands import CacheCommand
from loraplane.schemas.lifecycle import LifecycleAction, LifecycleEvent
from loraplane.schemas.pem import check_ca_certificates, check_ec_public_key, key_fingerprint
from loraplane.schemas.reasons import SignerProblem
from loraplane.schemas.signing import public_key, small_order, unb64, verify
from loraplane.schemas.validation_text import error_line

__all__ = [
    "ANY",
    "DEFAULT_MAX_PRIORITY",
    "MAX_KEYRING_CHARS",
    "MAX_PEM_BYTES",
    "KeyEntry",
    "KeyRole",
    "Keyring",
    "KeyringError",
    "KeyringFile",
    "ModelSignerEntry",
    "Scopes",
    "SignerRefusal",
    "TenantPolicy",
    "load_keyring",
    "parse_keyring",
    "save_keyring",
    "signer",
    "window_refusal",
]

ANY: Literal["*"] = "*"


class KeyRole(StrEnum):
    """What a key may sign."""

    publisher = "publisher"  # lifecycle events (CI)
    planner = "planner"  # cache commands (the planner agent)


class KeyringError(ValueError):
    """The keyring file is missing or invalid; the registry then trusts nobody."""


class Scopes(StrictModel):
    tenants: list[Identifier] | Literal["*"] = Field(min_length=1)
    actions: list[LifecycleAction] | Literal["*"] = Field(min_length=1)

    def allows_tenant(self, tenant_id: str) -> bool:
        return self.tenants == ANY or tenant_id in self.tenants

    def allows_action(self, action: LifecycleAction) -> bool:
        return self.actions == ANY or action in self.actions


class KeyEntry(StrictModel):
    key_id: Identifier
    publisher: Identifier
    public_key: str = Field(max_length=64)
    not_before: Timestamp
    not_after: Timestamp
    revoked: bool = False
    scopes: Scopes
    role: KeyRole = KeyRole.publisher

    @field_validator("public_key")
    @classmethod
    def _ed25519(cls, v: str) -> str:
        if small_order(unb64(v, 32)):
            raise ValueError(
                "not an Ed25519 public key anyone holds (a small-order point or a non-canonical "
                "encoding: "
                "anyone could sign as it)"
            )
        return v

    @model_validator(mode="after")
    def _window(self) -> KeyEntry:
        if self.not_after <= self.not_before:
            raise ValueError("not_after must be after not_before")
        return self

    def window_problem(self, now: datetime) -> Literal["expired", "not_yet_valid"] | None:
        """Why the key cannot sign at ``now``, if it cannot."""
        if now < self.not_before:
            return "not_yet_valid"
        if now >= self.not_after:
            return "expired"
        return None


DEFAULT_MAX_PRIORITY = Priority.gold
"""The ceiling of a tenant the keyring does not list: never-evicted (platinum) is opt-in."""


class TenantPolicy(StrictModel):
    max_priority: Priority | None = Field(
        None,
        description="the highest priority its records may carry (None: the default)",
        exclude_if=lambda v: v is None,
    )
    require_model_signature: bool = Field(
        False,
        description="publish and load only artifacts with a verified model-signing bundle",
        exclude_if=lambda v: not v,
    )


MAX_PEM_BYTES = 256 * 1024
"""The most a PEM file handed to ``keys model-signer`` is read: a CA bundle's bound."""


class ModelSignerEntry(StrictModel):
    """A key or certificate authority trusted for OpenSSF model-signing bundles, bound to the
    tenants whose artifacts it may sign (a valid bundle of another tenant's key is refused).
    Exactly one of ``public_key`` (key-based signing) or ``ca_certificates`` with
    ``certificate_subject`` (certificate signing: any chain to these anchors, but only the
    signing certificate with exactly this subject)."""

    signer_id: Identifier
    tenants: list[Identifier] | Literal["*"] = Field(min_length=1)
    public_key: str | None = Field(None, max_length=4096, description="EC public key, PEM")
    ca_certificates: str | None = Field(
        None, max_length=MAX_PEM_BYTES, description="trust anchors, PEM"
    )
    certificate_subject: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="RFC 4514 subject of the signing certificate",
    )
    revoked: bool = False

    @model_validator(mode="after")
    def _one_kind(self) -> ModelSignerEntry:
        if (self.public_key is None) == (self.ca_certificates is None):
            raise ValueError("give exactly one of public_key or ca_certificates")
        if self.public_key is not None:
            if self.certificate_subject is not None:
                raise ValueError("certificate_subject goes with ca_certificates")
            check_ec_public_key(self.public_key)
        else:
            if self.certificate_subject is None:
                raise ValueError("ca_certificates needs the certificate_subject it vouches for")
            check_ca_certificates(self.ca_certificates or "")
        return self

    def allows_tenant(self, tenant_id: str) -> bool:
        return self.tenants == ANY or tenant_id in self.tenants

    @property
    def identity(self) -> str:
        """Who signs with it: ``sha256:<hex>`` of the public key's PEM (the key hint a
        model-signing bundle carries), or the signing certificate's subject."""
        if self.public_key is not None:
            return key_fingerprint(self.public_key)
        return self.certificate_subject or ""


class Keyring(StrictModel):
    keys: list[KeyEntry] = Field(default_factory=list, max_length=10_000)
    default_max_priority: Priority = DEFAULT_MAX_PRIORITY
    tenants: dict[Identifier, TenantPolicy] = Field(default_factory=dict, max_length=100_000)
    model_signers: list[ModelSignerEntry] = Field(default_factory=list, max_length=10_000)

    def max_priority(self, tenant_id: str) -> Priority:
        policy = self.tenants.get(tenant_id)
        if policy is None or policy.max_priority is None:
            return self.default_max_priority
        return policy.max_priority

    def requires_model_signature(self, tenant_id: str) -> bool:
        policy = self.tenants.get(tenant_id)
        return policy is not None and policy.require_model_signature

    @field_validator("model_signers")
    @classmethod
    def _unique_signers(cls, v: list[ModelSignerEntry]) -> list[ModelSignerEntry]:
        ids = [s.signer_id for s in v]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate signer_id")
        return v

    @field_validator("keys")
    @classmethod
    def _unique_ids(cls, v: list[KeyEntry]) -> list[KeyEntry]:
        ids = [k.key_id for k in v]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate key_id")
        return v

    def get(self, key_id: str) -> KeyEntry | None:
        return next((k for k in self.keys if k.key_id == key_id), None)

    def with_key(self, entry: KeyEntry) -> Keyring:
        if self.get(entry.key_id) is not None:
            raise KeyringError(f"key_id {entry.key_id} is already in the keyring")
        return self.model_copy(update={"keys": [*self.keys, entry]})

    def with_retired(self, key_id: str, at: datetime) -> Keyring:
        """The same keyring with ``key_id``'s window ending at ``at`` (never later than it
        ended already): the key signs nothing from then on (``key_expired``), while what it
        signed before keeps verifying, as consumers fold each event at its ``issued_at``.
        Routine rotation; a key that may have leaked is revoked instead."""
        entry = self.get(key_id)
        if entry is None:
            raise KeyringError(f"key_id {key_id} is not in the keyring")
        if at <= entry.not_before:
            raise KeyringError(
                f"key {key_id} is valid only from {entry.not_before}: it cannot end at {at} "
                "(revoke it instead)"
            )
        end = min(entry.not_after, at)
        return self.model_copy(
            update={
                "keys": [
                    k.model_copy(update={"not_after": end}) if k.key_id == key_id else k
                    for k in self.keys
                ]
            }
        )

    def with_revoked(self, key_id: str) -> Keyring:
        """The same keyring with ``key_id`` revoked. The entry stays, so its events are
        reported as ``key_revoked``, not ``unknown_key``."""
        if self.get(key_id) is None:
            raise KeyringError(f"key_id {key_id} is not in the keyring")
        return self.model_copy(
            update={
                "keys": [
                    k.model_copy(update={"revoked": True}) if k.key_id == key_id else k
                    for k in self.keys
                ]
            }
        )

    def to_yaml(self) -> str:
        import yaml

        data = self.model_dump(mode="json", exclude_none=True)
        if not self.tenants:  # defaults left out: a printed entry is just ``keys:``
            del data["tenants"]
        if not self.model_signers:
            del data["model_signers"]
        if self.default_max_priority is DEFAULT_MAX_PRIORITY:
            del data["default_max_priority"]
        return yaml.safe_dump(data, sort_keys=False)


MAX_KEYRING_CHARS = 16 * 1024 * 1024


def parse_keyring(text: str, source: str = "keyring") -> Keyring:
    import yaml

    from loraplane.schemas.bounded_yaml import YamlTooLarge, load_yaml

    if len(text) > MAX_KEYRING_CHARS:
        raise KeyringError(f"{source}: {len(text)} characters > {MAX_KEYRING_CHARS}")
    try:
        data = load_yaml(text)
        return Keyring.model_validate(data if data is not None else {})
    except yaml.YAMLError as exc:
        raise KeyringError(f"{source}: not YAML/JSON: {exc}") from None
    except YamlTooLarge as exc:
        raise KeyringError(f"{source}: {exc}") from None
    except ValidationError as exc:
        raise KeyringError(f"{source}: {error_line(exc)}") from None
    except (RecursionError, MemoryError, ValueError, TypeError) as exc:  # hostile nesting
        raise KeyringError(f"{source}: unreadable: {type(exc).__name__}") from None


def load_keyring(path: Path) -> Keyring:
    """The keyring in the regular file at ``path`` (``kernel.local_files.read_regular``: a
    FIFO, a device or a file over ``MAX_KEYRING_CHARS`` bytes is a KeyringError, never a
    hang or a read without end)."""
    from loraplane.kernel.local_files import read_regular

    try:
        text = read_regular(path, MAX_KEYRING_CHARS).decode()
    except UnicodeDecodeError as exc:
        raise KeyringError(f"{path}: not UTF-8: {exc.reason}") from None
    except OSError as exc:
        raise KeyringError(f"{path}: {exc.strerror or exc}") from None
    return parse_keyring(text, str(path))


def save_keyring(keyring: Keyring, path: Path) -> None:
    """Atomic replace (``kernel.atomic_file``), so a reader never sees half a file and a
    link or FIFO planted at the temporary name is never written through or waited on."""
    from loraplane.kernel.atomic_file import write_atomic

    write_atomic(path, keyring.to_yaml())


class KeyringFile:
    """The keyring at ``path``, re-read whenever the file's identity, size or mtime changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._keyring: Keyring | None = None

    def current(self) -> Keyring:
        """The keyring as the file says now; KeyringError if it is missing or invalid (the
        previous contents are never used once the file changed: a bad edit fails closed)."""
        try:
            st = self.path.stat()
        except OSError as exc:
            self._stamp = self._keyring = None
            raise KeyringError(f"{self.path}: {exc.strerror or exc}") from None
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp != self._stamp or self._keyring is None:
            self._stamp, self._keyring = stamp, None
            self._keyring = load_keyring(self.path)
        return self._keyring


@dataclass(frozen=True)
class SignerRefusal:
    problem: SignerProblem
    detail: str


def window_refusal(entry: KeyEntry, at: datetime) -> SignerRefusal | None:
    """Why ``entry`` cannot sign at ``at`` (expired, not valid yet), None when it can: the
    one wording of a key's window, for ``signer`` at the time of the check and for the
    registry at an event's own ``issued_at``."""
    problem = entry.window_problem(at)
    if problem == "expired":
        return SignerRefusal(
            SignerProblem.key_expired, f"key {entry.key_id} expired {entry.not_after}"
        )
    if problem == "not_yet_valid":
        return SignerRefusal(
            SignerProblem.key_not_yet_valid, f"key {entry.key_id} is valid from {entry.not_before}"
        )
    return None


def signer(
    keyring: Keyring | None,
    signed: LifecycleEvent | CacheCommand,
    role: KeyRole,
    now: datetime,
    publisher: str | None = None,
) -> KeyEntry | SignerRefusal:
    """The key that vouches for ``signed`` at ``now``, or why none does, checked in the order
    of ``SignerProblem``: the keyring is readable, the key is in it with ``role`` (and
    ``publisher``, when given), not revoked, inside its window, and its Ed25519 signature
    is of exactly these bytes. The one check of the registry and the worker (scopes are
    theirs: an action for an event, a tenant for a command). Planner-memory records are
    checked on their raw bytes (``streams.planner_runtime.memory_refusal``)."""
    if keyring is None:
        return SignerRefusal(SignerProblem.keyring_unavailable, "the keyring could not be read")
    entry = keyring.get(signed.key_id)
    if entry is None:
        return SignerRefusal(
            SignerProblem.unknown_key, f"key_id {signed.key_id!r} is not in the keyring"
        )
    if entry.role is not role:
        return SignerRefusal(
            SignerProblem.key_role_mismatch,
            f"key {entry.key_id} is a {entry.role} key, not a {role} key",
        )
    if publisher is not None and entry.publisher != publisher:
        return SignerRefusal(
            SignerProblem.key_publisher_mismatch,
            f"key {entry.key_id} belongs to {entry.publisher}, not {publisher}",
        )
    if entry.revoked:
        return SignerRefusal(SignerProblem.key_revoked, f"key {entry.key_id} is revoked")
    refused = window_refusal(entry, now)
    if refused is not None:
        return refused
    if not verify(signed, public_key(entry.public_key)):
        return SignerRefusal(
            SignerProblem.bad_signature, f"signature does not verify with key {entry.key_id}"
        )
    return entry
