"""``loraplane registry list | show ID``: the registry as the compacted topic holds it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from loraplane.schemas.registry import AdapterView

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        help="The adapter registry (read from the registry topic).", no_args_is_help=True
    )

    @group.command("list")
    def list_cmd(as_json: bool = typer.Option(False, "--json")) -> None:
        """Every adapter with its active version and serving canaries."""
        from rich.console import Console
        from rich.table import Table

        from loraplane.kernel import kafka
        from loraplane.schemas.registry import views_to_json

        kafka.act_as(kafka.Principal.reader)
        views = _registry()
        if as_json:
            typer.echo(views_to_json(views))
            return
        table = Table(
            "adapter", "tenant", "base model", "active", "canary", "versions", "revoked", "updated"
        )
        for aid, v in sorted(views.items()):
            table.add_row(
                aid,
                v.tenant_id,
                v.base_model,
                v.active_version or "-",
                ", ".join(
                    f"{r.version} ({r.release.canary_percent:g}%)"
                    for r in v.serving
                    if r.status == "canary"
                )
                or "-",
                str(len(v.versions)),
                ", ".join(r.version for r in v.versions if r.status == "revoked") or "-",
                v.updated_at.isoformat(timespec="seconds"),
            )
        Console().print(table)

    @group.command("show")
    def show_cmd(adapter_id: str, as_json: bool = typer.Option(False, "--json")) -> None:
        """Every version of one adapter with its status, digest and artifact."""
        from rich.console import Console
        from rich.table import Table

        from loraplane.kernel import kafka
        from loraplane.schemas.registry import views_to_json

        kafka.act_as(kafka.Principal.reader)
        view = _registry().get(adapter_id)
        if view is None:
            typer.echo(f"error: {adapter_id} is not in the registry", err=True)
            raise typer.Exit(1)
        if as_json:
            typer.echo(views_to_json({adapter_id: view}))
            return
        table = Table(
            "version",
            "status",
            "canary %",
            "rollback to",
            "rank",
            "sha256",
            "artifact",
            title=f"{adapter_id} (tenant {view.tenant_id}, "
            f"{view.base_model}, last seq {view.last_seq})",
        )
        for r in view.versions:
            table.add_row(
                r.version,
                str(r.status),
                f"{r.release.canary_percent:g}",
                r.release.rollback_to or "-",
                str(r.rank),
                r.sha256[:12],
                r.artifact_uri,
            )
        Console().print(table)

    app.add_typer(group, name="registry")


def _registry() -> dict[str, AdapterView]:
    """The registry's views; exit 1 saying why when the broker cannot be read."""
    from loraplane.kernel.config import get_settings
    from loraplane.registry.topic import RegistryUnreadable, load_registry

    try:
        return load_registry(get_settings())
    except RegistryUnreadable as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
