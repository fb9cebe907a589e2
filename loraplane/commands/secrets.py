"""``loraplane secrets install``: a pod's secret files, as the runtimes read them."""

from __future__ import annotations

from pathlib import Path

import typer

__all__ = ["app", "install", "register"]

app = typer.Typer(help="Secret files of a deployment.", no_args_is_help=True)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="secrets")


@app.command("install")
def install(
    source: Path = typer.Option(
        ..., "--from", help="a folder of secret files (a mounted Kubernetes Secret volume)"
    ),
    target: Path = typer.Option(
        ..., "--to", help="where the runtimes read them (settings.secrets_dir)"
    ),
) -> None:
    """Copy every file under --from to --to, mode 0600 (folders 0700): a Secret volume's
    files are readable by the pod's group, which the runtimes refuse (docs/deploy.md, "On
    Kubernetes"). Names are printed, never contents."""
    from loraplane.kernel.secrets import SecretError, install_private

    try:
        written = install_private(source, target)
    except (SecretError, OSError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    for path in written:
        typer.echo(f"installed {path}")
    typer.echo(f"{len(written)} secret file(s) in {target}")
