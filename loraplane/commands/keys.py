"""``loraplane keys generate | rotate | retire | revoke | tenant | model-signer``: Ed25519
signing keys and the keyring that trusts them, and the OpenSSF model-signing keys it trusts
for bytes. Routine rotation retires the old key (it signs nothing new, what it signed stays
valid); revoking is for a key that may have leaked and withdraws every registry view it
signed. Every keyring change is an atomic file replace that the registry agent and the workers pick
up without a restart; key changes are audited (``audit`` topic, component ``cli``) when the
stack is reachable."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from loraplane.schemas.keyring import KeyEntry, Keyring, KeyRole, Scopes
    from loraplane.schemas.signing import SigningKey

__all__ = ["audit_keyring_change", "parse_scopes", "register"]


def parse_scopes(items: list[str]) -> dict[str, list[str] | str]:
    """``tenant:acme action:publish action:canary`` -> {"tenants": [...], "actions": [...]};
    ``tenant:*`` / ``action:*`` mean any."""
    out: dict[str, list[str] | str] = {"tenants": [], "actions": []}
    for item in items:
        kind, _, value = item.partition(":")
        field = {"tenant": "tenants", "action": "actions"}.get(kind)
        if field is None or not value:
            raise typer.BadParameter(f"{item!r}: expected tenant:NAME or action:NAME ('*': any)")
        current = out[field]
        out[field] = "*" if value == "*" or current == "*" else [*current, value]
    return out


def audit_keyring_change(action: str, key_id: str, publisher: str, detail: str) -> None:
    """Best effort: one AuditRecord for a keyring change. The change itself is the file; a
    broker that is down costs the record (said on stderr), never the change."""
    import getpass
    import uuid

    from confluent_kafka import KafkaException

    from loraplane.kernel.bus import DeliveryError, produce_sync
    from loraplane.kernel.config import get_settings
    from loraplane.kernel.kafka import KafkaAuthError
    from loraplane.kernel.topics import topic_name
    from loraplane.schemas.audit import AuditRecord
    from loraplane.schemas.base import now_utc

    settings = get_settings()
    record = AuditRecord(
        event_id=f"keys-{uuid.uuid4().hex}",
        ts=now_utc(),
        component="cli",
        action=action,
        decision="applied",
        actor=getpass.getuser()[:128],
        subject_event_id=key_id[:128],
        detail=f"{publisher}: {detail}"[:2048],
    )
    try:
        produce_sync(settings, topic_name(settings, "audit"), key_id, record, timeout_s=5.0)
    except (DeliveryError, KafkaAuthError, KafkaException) as exc:  # the file change stands
        typer.echo(
            f"warning: the keyring changed but its audit record was not written: {exc}", err=True
        )


_MAX_OVERLAP_S = 366 * 24 * 3600
"""The longest an operator may let a retired key go on signing (a year)."""
_SHOWN = 10
_REVOKE_WARNING = (
    "revoking {key_id} withdraws every registry view holding an event it ever signed: those "
    "adapters stop serving on every worker and router, for good under their ids (a view "
    "keeps every event of its adapter); give --state to count them; for a routine rotation "
    "retire the key instead (`keys retire`)"
)


def _retired_text(key_id: str, entry: KeyEntry | None) -> str:
    assert entry is not None  # retired, never removed
    return (
        f"{key_id} retired from {entry.not_after.isoformat()} "
        "(signs nothing from then; what it signed stays valid)"
    )


def _withdrawn_by(state: Path, key_id: str) -> list[str]:
    """The adapters of ``state`` (``registry list --json``) whose evidence holds an event
    ``key_id`` signed: a consumer's fold refuses them once the key is revoked. Exit 1 when
    the file is not such a registry."""
    from loraplane.kernel.local_files import read_regular
    from loraplane.schemas.registry import MAX_VIEWS_BYTES, views_from_json

    try:
        views = views_from_json(read_regular(state, MAX_VIEWS_BYTES))
    except (OSError, ValueError) as exc:
        typer.echo(f"error: {state}: not a registry (`registry list --json`): {exc}", err=True)
        raise typer.Exit(1) from None
    return sorted(
        aid for aid, view in views.items() if any(e.key_id == key_id for e in view.evidence)
    )


def _new_key(
    publisher: str, kid: str, scopes: Scopes, role: KeyRole, valid_days: int, out: Path | None
) -> tuple[SigningKey, KeyEntry, Path]:
    """A new key pair, its keyring entry, and where its private key goes (``out``, else the
    planner key path for a planner key, else HOME/keys/KEY_ID.key)."""
    from datetime import timedelta

    from loraplane.kernel.config import get_settings
    from loraplane.registry.fold import CLOCK_SKEW
    from loraplane.schemas.base import now_utc
    from loraplane.schemas.keyring import KeyEntry, KeyRole
    from loraplane.schemas.signing import SigningKey

    now = now_utc()
    key = SigningKey.generate(publisher, kid)
    entry = KeyEntry(
        key_id=kid,
        publisher=publisher,
        public_key=key.public_key_b64,
        # The registry checks the window at an event's issued_at too: a signer's clock
        # behind ours by up to the allowed skew may use the key at once.
        not_before=now - CLOCK_SKEW,
        not_after=now + timedelta(days=valid_days),
        scopes=scopes,
        role=role,
    )
    settings = get_settings()
    path = out or (
        settings.planner_key_path
        if role is KeyRole.planner
        else settings.home / "keys" / f"{kid}.key"
    )
    return key, entry, path


def _keyring_and_entry(keyring: Path, key_id: str) -> tuple[Keyring, KeyEntry]:
    """The keyring file and its ``key_id`` entry; a clear error (exit 1) when either is
    missing or invalid, before anything is written."""
    from loraplane.schemas.keyring import KeyringError, load_keyring

    try:
        ring = load_keyring(keyring)
    except KeyringError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    entry = ring.get(key_id)
    if entry is None:
        typer.echo(f"error: key_id {key_id} is not in {keyring}", err=True)
        raise typer.Exit(1)
    return ring, entry


def _save_new(key: SigningKey, path: Path) -> None:
    try:
        key.save(path)
    except FileExistsError:
        typer.echo(f"error: {path} exists; keys are never overwritten", err=True)
        raise typer.Exit(1) from None


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Publisher signing keys.", no_args_is_help=True)

    @group.command("generate")
    def generate_cmd(
        publisher: str = typer.Option(..., "--publisher"),
        scope: list[str] = typer.Option(
            ..., "--scope", help="tenant:NAME or action:NAME, repeatable; '*': any"
        ),
        key_id: str | None = typer.Option(None, "--key-id", help="Default: PUBLISHER-DATE."),
        out: Path | None = typer.Option(
            None, "--out", help="Private key file (mode 0600); default: HOME/keys/KEY_ID.key"
        ),
        valid_days: int = typer.Option(365, "--valid-days", min=1, max=36_500),
        keyring: Path | None = typer.Option(
            None, "--keyring", help="Also append the entry to this keyring file."
        ),
        role: str = typer.Option(
            "publisher",
            "--role",
            help="publisher (signs lifecycle events, CI) or planner "
            "(signs cache commands; default --out: the planner key path)",
        ),
    ) -> None:
        """Write a new private key and print its keyring entry (YAML)."""
        from pydantic import ValidationError

        from loraplane.schemas.base import now_utc
        from loraplane.schemas.keyring import (
            Keyring,
            KeyringError,
            KeyRole,
            Scopes,
            load_keyring,
            save_keyring,
        )
        from loraplane.schemas.validation_text import error_line

        kid = key_id or f"{publisher}-{now_utc():%Y%m%d%H%M%S}"
        try:
            key, entry, path = _new_key(
                publisher,
                kid,
                Scopes.model_validate(parse_scopes(scope)),
                KeyRole(role),
                valid_days,
                out,
            )
            ring = load_keyring(keyring) if keyring and keyring.exists() else Keyring()
            ring = ring.with_key(entry) if keyring else ring
        except (ValidationError, KeyringError, ValueError) as exc:
            typer.echo(f"error: {error_line(exc)}", err=True)
            raise typer.Exit(1) from None
        _save_new(key, path)
        if keyring:
            save_keyring(ring, keyring)
        typer.echo(f"# private key: {path} (mode 0600)", err=True)
        typer.echo(Keyring(keys=[entry]).to_yaml(), nl=False)

    @group.command("rotate")
    def rotate_cmd(
        keyring: Path = typer.Option(..., "--keyring", help="The keyring file (atomic replace)."),
        key_id: str = typer.Option(..., "--key-id", help="The key being replaced."),
        new_key_id: str | None = typer.Option(
            None, "--new-key-id", help="Default: PUBLISHER-DATE."
        ),
        out: Path | None = typer.Option(None, "--out", help="The new private key (mode 0600)."),
        valid_days: int = typer.Option(365, "--valid-days", min=1, max=36_500),
        overlap_s: int | None = typer.Option(
            None,
            "--overlap-s",
            min=0,
            max=_MAX_OVERLAP_S,
            help="Seconds the old key may still sign, for CI to switch (default 0: it "
            "retires now). What it signed before stays valid.",
        ),
        revoke_old: bool = typer.Option(
            False,
            "--revoke-old",
            help="COMPROMISE ONLY: revoke the old key instead of retiring it. This withdraws "
            "every registry view holding an event it ever signed: those adapters stop "
            "serving, for good under their ids.",
        ),
        audit: bool = typer.Option(
            True, "--audit/--no-audit", help="Write an audit record (needs the stack)."
        ),
    ) -> None:
        """Add a new key for the same publisher, scopes and role as KEY_ID and retire KEY_ID
        (it signs nothing from now, or after --overlap-s; the views it signed stay valid)."""
        from datetime import timedelta

        from loraplane.schemas.base import now_utc
        from loraplane.schemas.keyring import KeyringError, save_keyring

        if revoke_old and overlap_s is not None:
            typer.echo("error: --overlap-s retires the old key; --revoke-old revokes it", err=True)
            raise typer.Exit(1)
        ring, old = _keyring_and_entry(keyring, key_id)
        now = now_utc()
        retire_at = now + timedelta(seconds=overlap_s or 0)
        try:
            kid = new_key_id or f"{old.publisher}-{now:%Y%m%d%H%M%S}"
            key, entry, path = _new_key(old.publisher, kid, old.scopes, old.role, valid_days, out)
            ring = ring.with_key(entry)
            if revoke_old:
                ring = ring.with_revoked(key_id)
            elif not old.revoked:
                ring = ring.with_retired(key_id, retire_at)
        except KeyringError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        _save_new(key, path)
        save_keyring(ring, keyring)
        typer.echo(f"# private key: {path} (mode 0600)", err=True)
        if revoke_old:
            done = f"{key_id} revoked"
            typer.echo(f"warning: {_REVOKE_WARNING.format(key_id=key_id)}", err=True)
        elif old.revoked:
            done = f"{key_id} already revoked"
        else:
            done = _retired_text(key_id, ring.get(key_id))
        typer.echo(f"{kid}: added for {old.publisher} ({old.role}); {done}")
        if audit:
            audit_keyring_change("key_rotate", kid, old.publisher, f"replaces {key_id}: {done}")

    @group.command("retire")
    def retire_cmd(
        keyring: Path = typer.Option(..., "--keyring", help="The keyring file (atomic replace)."),
        key_id: str = typer.Option(..., "--key-id"),
        overlap_s: int = typer.Option(
            0,
            "--overlap-s",
            min=0,
            max=_MAX_OVERLAP_S,
            help="Seconds it may still sign (default 0: it retires now).",
        ),
        audit: bool = typer.Option(
            True, "--audit/--no-audit", help="Write an audit record (needs the stack)."
        ),
    ) -> None:
        """Retire KEY_ID: its window ends now (or after --overlap-s), so events it signs
        from then on are refused (key_expired), while the registry views it signed before
        stay valid. The routine end of a key; a key that may have leaked is revoked."""
        from datetime import timedelta

        from loraplane.schemas.base import now_utc
        from loraplane.schemas.keyring import KeyringError, save_keyring

        ring, entry = _keyring_and_entry(keyring, key_id)
        if entry.revoked:
            typer.echo(f"{key_id}: already revoked")
            return
        at = now_utc() + timedelta(seconds=overlap_s)
        if entry.not_after <= at:
            typer.echo(f"{key_id}: already ends at {entry.not_after.isoformat()}")
            return
        try:
            ring = ring.with_retired(key_id, at)
        except KeyringError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        save_keyring(ring, keyring)
        done = _retired_text(key_id, ring.get(key_id))
        typer.echo(f"{done} ({entry.publisher}, {entry.role})")
        if audit:
            audit_keyring_change("key_retire", key_id, entry.publisher, done)

    @group.command("revoke")
    def revoke_cmd(
        keyring: Path = typer.Option(..., "--keyring", help="The keyring file (atomic replace)."),
        key_id: str = typer.Option(..., "--key-id"),
        state: Path | None = typer.Option(
            None,
            "--state",
            help="The registry as `loraplane registry list --json` wrote it: count the "
            "adapters whose views the revocation withdraws.",
        ),
        dry_run: bool = typer.Option(
            False, "--dry-run", help="Say what it would withdraw; change nothing."
        ),
        as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
        audit: bool = typer.Option(
            True, "--audit/--no-audit", help="Write an audit record (needs the stack)."
        ),
    ) -> None:
        """COMPROMISE: revoke KEY_ID. Its events and commands are refused from now on
        (key_revoked) AND every registry view holding an event it ever signed is withdrawn
        on every worker and router, for good (a view keeps every event of its adapter). For
        a routine rotation, retire the key instead (`keys retire`)."""
        import json

        from loraplane.schemas.keyring import save_keyring

        ring, entry = _keyring_and_entry(keyring, key_id)
        withdrawn = _withdrawn_by(state, key_id) if state is not None else None
        already = entry.revoked
        if not already and not dry_run:
            save_keyring(ring.with_revoked(key_id), keyring)
        if as_json:
            typer.echo(
                json.dumps(
                    {
                        "key_id": key_id,
                        "publisher": entry.publisher,
                        "role": str(entry.role),
                        "revoked": already or not dry_run,
                        "already_revoked": already,
                        "dry_run": dry_run,
                        "withdrawn_adapters": withdrawn,
                        "withdrawn_count": None if withdrawn is None else len(withdrawn),
                    }
                )
            )
        elif already:
            typer.echo(f"{key_id}: already revoked")
        else:
            verb = "would be revoked (dry run)" if dry_run else "revoked"
            typer.echo(f"{key_id}: {verb} ({entry.publisher}, {entry.role})")
            if withdrawn is None:
                typer.echo(f"warning: {_REVOKE_WARNING.format(key_id=key_id)}", err=True)
            else:
                shown = ", ".join(withdrawn[:_SHOWN]) + (" ..." if len(withdrawn) > _SHOWN else "")
                typer.echo(
                    f"warning: {'would withdraw' if dry_run else 'withdraws'} the views of "
                    f"{len(withdrawn)} adapter(s) in {state}"
                    + (f": {shown}" if withdrawn else "")
                    + ("; they stop serving, for good under these ids" if withdrawn else ""),
                    err=True,
                )
        if audit and not already and not dry_run:
            audit_keyring_change(
                "key_revoke",
                key_id,
                entry.publisher,
                "revoked"
                + ("" if withdrawn is None else f"; withdraws {len(withdrawn)} adapter views"),
            )

    @group.command("tenant")
    def tenant_cmd(
        keyring: Path = typer.Option(
            ..., "--keyring", help="The keyring file (created if missing; atomic replace)."
        ),
        tenant: str = typer.Option(..., "--tenant"),
        max_priority: str | None = typer.Option(
            None, "--max-priority", help="bronze | silver | gold | platinum"
        ),
        require_model_signature: bool | None = typer.Option(
            None,
            "--require-model-signature/--no-require-model-signature",
            help="Publish and load only this tenant's artifacts with a verified OpenSSF "
            "model-signing bundle.",
        ),
    ) -> None:
        """Set a tenant's priority ceiling (its publishes above it are rejected) and whether
        its artifacts must be model-signed; what is not given is kept."""
        from pydantic import ValidationError

        from loraplane.schemas.keyring import Keyring, KeyringError, load_keyring, save_keyring
        from loraplane.schemas.validation_text import error_line

        if max_priority is None and require_model_signature is None:
            typer.echo("error: give --max-priority or --[no-]require-model-signature", err=True)
            raise typer.Exit(1)
        try:
            ring = load_keyring(keyring) if keyring.exists() else Keyring()
            data = ring.model_dump(mode="json")
            policy = dict(data["tenants"].get(tenant, {}))
            if max_priority is not None:
                policy["max_priority"] = max_priority
            if require_model_signature is not None:
                policy["require_model_signature"] = require_model_signature
            ring = Keyring.model_validate({**data, "tenants": {**data["tenants"], tenant: policy}})
        except (ValidationError, KeyringError) as exc:
            typer.echo(f"error: {error_line(exc)}", err=True)
            raise typer.Exit(1) from None
        save_keyring(ring, keyring)
        required = "required" if ring.requires_model_signature(tenant) else "not required"
        typer.echo(
            f"{tenant}: max_priority {ring.max_priority(tenant)}, model signature {required}"
        )

    @group.command("model-signer")
    def model_signer_cmd(
        keyring: Path = typer.Option(
            ..., "--keyring", help="The keyring file (created if missing; atomic replace)."
        ),
        signer_id: str = typer.Option(..., "--signer-id"),
        tenants: list[str] = typer.Option(
            ..., "--tenant", help="Whose adapters it may sign (repeatable; '*': any)."
        ),
        public_key: Path | None = typer.Option(
            None, "--public-key", help="EC public key (PEM) of key-based model signing."
        ),
        ca_certificates: Path | None = typer.Option(
            None, "--ca-certificates", help="Trust anchors (PEM) of certificate signing."
        ),
        certificate_subject: str | None = typer.Option(
            None,
            "--certificate-subject",
            help="With --ca-certificates: the one signing-certificate subject (RFC 4514) "
            "they vouch for.",
        ),
        revoke: bool = typer.Option(
            False, "--revoke", help="Mark the signer revoked: its bundles stop verifying."
        ),
    ) -> None:
        """Trust an OpenSSF model-signing key or CA for some tenants' adapters (replaces an
        entry of the same id), or revoke one."""
        from pydantic import ValidationError

        from loraplane.kernel.local_files import read_regular
        from loraplane.schemas.keyring import (
            MAX_PEM_BYTES,
            Keyring,
            KeyringError,
            ModelSignerEntry,
            load_keyring,
            save_keyring,
        )
        from loraplane.schemas.validation_text import error_line

        def pem(path: Path | None) -> str | None:
            try:
                return read_regular(path, MAX_PEM_BYTES).decode() if path else None
            except (OSError, UnicodeDecodeError) as exc:
                reason = getattr(exc, "strerror", None) or "not PEM text"
                raise KeyringError(f"{path}: {reason}") from None

        try:
            ring = load_keyring(keyring) if keyring.exists() else Keyring()
            others = [s for s in ring.model_signers if s.signer_id != signer_id]
            old = next((s for s in ring.model_signers if s.signer_id == signer_id), None)
            if revoke:
                if old is None:
                    raise KeyringError(f"no model signer {signer_id} in {keyring}")
                entry = old.model_copy(update={"revoked": True})
            else:
                entry = ModelSignerEntry.model_validate(
                    {
                        "signer_id": signer_id,
                        "tenants": "*" if "*" in tenants else tenants,
                        "public_key": pem(public_key),
                        "ca_certificates": pem(ca_certificates),
                        "certificate_subject": certificate_subject,
                    }
                )
            ring = ring.model_copy(update={"model_signers": [*others, entry]})
        except (ValidationError, KeyringError, OSError, UnicodeDecodeError) as exc:
            typer.echo(f"error: {error_line(exc)}", err=True)
            raise typer.Exit(1) from None
        save_keyring(ring, keyring)
        state = "revoked" if entry.revoked else "trusted"
        typer.echo(f"{signer_id}: {state} for {entry.tenants} ({entry.identity})")

    app.add_typer(group, name="keys")
