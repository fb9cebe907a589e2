"""CLI command groups. Each module here exposes ``register(app: typer.Typer) -> None``;
``loraplane.cli`` finds them all, so adding a command never edits a shared file."""
