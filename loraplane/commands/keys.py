"""``loraplane keys generate``: a publisher's Ed25519 key pair and its keyring entry."""

from __future__ import annotations

from pathlib import Path

import typer


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


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Publisher signing keys.", no_args_is_help=True)

    @group.command("generate")
    def generate_cmd(
        publisher: str = typer.Option(..., "--publisher"),
        scope: list[str] = typer.Option(..., "--scope",
                                        help="tenant:NAME or action:NAME, repeatable; '*': any"),
        key_id: str | None = typer.Option(None, "--key-id", help="Default: PUBLISHER-DATE."),
        out: Path | None = typer.Option(None, "--out", help="Private key file (mode 0600); "
                                        "default: HOME/keys/KEY_ID.key"),
        valid_days: int = typer.Option(365, "--valid-days", min=1),
        keyring: Path | None = typer.Option(None, "--keyring",
                                            help="Also append the entry to this keyring file."),
        role: str = typer.Option("publisher", "--role",
                                 help="publisher (signs lifecycle events, CI) or planner "
                                 "(signs cache commands; default --out: the planner key path)"),
    ) -> None:
        """Write a new private key and print its keyring entry (YAML)."""
        from datetime import timedelta

        from pydantic import ValidationError

        from loraplane.kernel.config import get_settings
        from loraplane.schemas.base import now_utc
        from loraplane.schemas.keyring import (
            KeyEntry,
            Keyring,
            KeyringError,
            KeyRole,
            Scopes,
            load_keyring,
            save_keyring,
        )
        from loraplane.schemas.signing import SigningKey

        now = now_utc()
        kid = key_id or f"{publisher}-{now:%Y%m%d%H%M%S}"
        key = SigningKey.generate(publisher, kid)
        try:
            entry = KeyEntry(key_id=kid, publisher=publisher, public_key=key.public_key_b64,
                             not_before=now, not_after=now + timedelta(days=valid_days),
                             scopes=Scopes.model_validate(parse_scopes(scope)),
                             role=KeyRole(role))
            ring = load_keyring(keyring) if keyring and keyring.exists() else Keyring()
            ring = ring.with_key(entry) if keyring else ring
        except (ValidationError, KeyringError, ValueError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        settings = get_settings()
        path = out or (settings.planner_key_path if entry.role is KeyRole.planner
                       else settings.home / "keys" / f"{kid}.key")
        try:
            key.save(path)
        except FileExistsError:
            typer.echo(f"error: {path} exists; keys are never overwritten", err=True)
            raise typer.Exit(1) from None
        if keyring:
            save_keyring(ring, keyring)
        typer.echo(f"# private key: {path} (mode 0600)", err=True)
        typer.echo(Keyring(keys=[entry]).to_yaml(), nl=False)

    @group.command("tenant")
    def tenant_cmd(
        keyring: Path = typer.Option(..., "--keyring", help="The keyring file (created if "
                                                            "missing; atomic replace)."),
        tenant: str = typer.Option(..., "--tenant"),
        max_priority: str = typer.Option(..., "--max-priority",
                                         help="bronze | silver | gold | platinum"),
    ) -> None:
        """Set a tenant's priority ceiling: its publishes above it are rejected."""
        from pydantic import ValidationError

        from loraplane.schemas.keyring import Keyring, KeyringError, load_keyring, save_keyring

        try:
            ring = load_keyring(keyring) if keyring.exists() else Keyring()
            ring = Keyring.model_validate({**ring.model_dump(mode="json"), "tenants": {
                **ring.model_dump(mode="json")["tenants"],
                tenant: {"max_priority": max_priority}}})
        except (ValidationError, KeyringError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        save_keyring(ring, keyring)
        typer.echo(f"{tenant}: max_priority {ring.max_priority(tenant)}")

    app.add_typer(group, name="keys")
