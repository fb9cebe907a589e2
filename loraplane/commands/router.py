"""``loraplane router``: the fleet router, one OpenAI-compatible endpoint for every worker."""

from __future__ import annotations

import typer

from loraplane.kernel.config import get_settings

__all__ = ["register", "router_app", "run"]

router_app = typer.Typer(
    help="The fleet router in front of the worker gateways.", no_args_is_help=True
)


def register(root: typer.Typer) -> None:
    root.add_typer(router_app, name="router")


@router_app.command("run")
def run(
    port: int = typer.Option(
        18100,
        "--port",
        min=0,
        max=65535,
        help="listen on listen_host:PORT (127.0.0.1; 0: any free)",
    ),
    metrics_port: int = typer.Option(
        0,
        "--metrics-port",
        min=0,
        max=65535,
        help="serve /metrics on listen_host:PORT (0: none); the API port never serves it",
    ),
    router_id: str = typer.Option(
        "r1", "--router-id", help="names its dead letters and registry checkpoints"
    ),
    heartbeat_s: float | None = typer.Option(
        None,
        "--heartbeat-s",
        min=0.01,
        max=3600,
        help="the workers' heartbeat interval (default: "
        "policy.worker_heartbeat_s): a worker silent for three "
        "intervals is drained",
    ),
    base_models: list[str] | None = typer.Option(
        None,
        "--base-model",
        help="hold only these base models' registry views and route "
        "only their adapters (repeat; default: every base model)",
    ),
) -> None:
    """Route requests by residency until SIGTERM/SIGINT (docs/router.md)."""

    from loraplane.kernel import kafka
    from loraplane.kernel.http_server import run_serving
    from loraplane.router.server import RouterOptions, serve_router
    from loraplane.schemas.base import is_id

    if not is_id(router_id):  # it keys the router's state, dead letters and checkpoints
        raise typer.BadParameter(f"{router_id!r} is not an id", param_hint="--router-id")
    for base in base_models or []:
        if not is_id(base):
            raise typer.BadParameter(f"{base!r} is not an id", param_hint="--base-model")
    kafka.act_as(kafka.Principal.router)

    from loraplane.kernel.log_lines import configure_logging

    configure_logging()
    settings = get_settings()
    run_serving(
        serve_router(
            settings,
            RouterOptions(
                port=port,
                metrics_port=metrics_port,
                router_id=router_id,
                heartbeat_s=heartbeat_s or settings.policy.worker_heartbeat_s,
                base_models=tuple(base_models or ()),
            ),
        )
    )
