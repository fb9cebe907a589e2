"""``loraplane schemas export|check``: the JSON Schemas for producers in other languages."""

from __future__ import annotations

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="JSON Schema of every event and command.", no_args_is_help=True)

    @group.command("export")
    def export_cmd() -> None:
        """Write schemas/json/*.schema.json from the models."""
        from loraplane.schemas.export import export

        for path in export():
            typer.echo(path)

    @group.command("check")
    def check_cmd() -> None:
        """Exit 1 if a checked-in schema differs from its model."""
        from loraplane.schemas.export import drift

        stale = drift()
        if stale:
            typer.echo(
                f"schemas out of date: {', '.join(stale)}; run `loraplane schemas export`", err=True
            )
            raise typer.Exit(1)
        typer.echo("schemas up to date")

    app.add_typer(group, name="schemas")
