"""``loraplane loadtest SCENARIO``: one of the seed's load-test scenarios against a live
system of its own (see loraplane.demo.loadtest), with its numbers and verdict."""

from __future__ import annotations

from pathlib import Path

import typer

SCENARIO_NAMES = ("hot-adapter", "cold-adapter", "burst-loading", "bulk-eviction",
                  "artifact-store-unavailable", "signature-failure")


def register(app: typer.Typer) -> None:
    @app.command("loadtest")
    def loadtest_cmd(
        scenario: str = typer.Argument(..., help=" | ".join(SCENARIO_NAMES)),
        duration: float = typer.Option(60.0, "--duration", min=3.0, max=240.0,
                                       help="Seconds of traffic (setup comes on top)."),
        fake_vllm: bool = typer.Option(False, "--fake-vllm",
                                       help="Use the FAKE vLLM (workers/fake_vllm.py)."),
        trace: Path | None = typer.Option(None, "--trace",
                                          help="Azure LLM trace CSV (default: "
                                               "the shipped conversation trace)."),
        as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout; "
                                     "progress goes to stderr."),
    ) -> None:
        """Run one load-test scenario; exit 1 when its expectation is not met."""
        import json

        from rich.console import Console

        from loraplane.demo.loadtest import SCENARIOS, render, run_scenario
        from loraplane.demo.supervisor import ChildFailed
        from loraplane.demo.system import ROOT, BringUpError
        from loraplane.demo.traces import TraceMissing, find_trace
        from loraplane.kernel.config import get_settings
        from loraplane.workers.vllm_process import vllm_installed

        if scenario not in SCENARIOS:
            raise typer.BadParameter(f"choose one of {', '.join(SCENARIOS)}",
                                     param_hint="SCENARIO")
        console = Console(stderr=as_json)
        if not fake_vllm and not vllm_installed(ROOT):
            console.print("[red]error:[/] the real vLLM is not installed (.venv-vllm). "
                          "Install it with `loraplane vllm setup` (several GB), or run with "
                          "--fake-vllm.")
            raise typer.Exit(2)
        try:
            path = find_trace(trace)
        except TraceMissing as exc:
            console.print(f"[yellow]warning:[/] {exc}; replaying synthetic arrivals")
            path = None
        try:
            result = run_scenario(scenario, get_settings(), duration_s=duration,
                                  fake_vllm=fake_vllm, trace=path, console=console)
        except (ChildFailed, BringUpError) as exc:
            console.print(f"[red]error:[/] {exc}", highlight=False)
            raise typer.Exit(1) from None
        if as_json:
            typer.echo(json.dumps(result.to_json(), indent=2))
        else:
            render(result, console)
        raise typer.Exit(0 if result.passed else 1)
