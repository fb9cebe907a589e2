"""``loraplane loadtest SCENARIO [SCENARIO ...]``: the seed's load-test scenarios against a
live system (see loraplane.demo.loadtest), with their numbers and verdicts."""

from __future__ import annotations

from pathlib import Path

import typer

__all__ = ["SCENARIO_NAMES", "register"]

SCENARIO_NAMES = (
    "hot-adapter",
    "cold-adapter",
    "burst-loading",
    "bulk-eviction",
    "artifact-store-unavailable",
    "signature-failure",
)


def register(app: typer.Typer) -> None:
    @app.command("loadtest")
    def loadtest_cmd(
        scenarios: list[str] = typer.Argument(
            ...,
            help=" | ".join(SCENARIO_NAMES) + "; several share one live system, "
            "in the order given (artifact-store-unavailable always gets its own).",
        ),
        duration: float = typer.Option(
            60.0, "--duration", min=3.0, max=240.0, help="Seconds of traffic (setup comes on top)."
        ),
        fake_vllm: bool = typer.Option(
            False, "--fake-vllm", help="Use the FAKE vLLM (loraplane/testing/fake_vllm.py)."
        ),
        trace: Path | None = typer.Option(
            None, "--trace", help="Azure LLM trace CSV (default: the shipped conversation trace)."
        ),
        as_json: bool = typer.Option(
            False,
            "--json",
            help="One JSON object (a list for several "
            "scenarios) on stdout; "
            "progress goes to stderr.",
        ),
    ) -> None:
        """Run load-test scenarios; exit 1 when an expectation is not met."""
        import json

        from rich.console import Console

        from loraplane.demo.loadtest import SCENARIOS, render, run_scenarios
        from loraplane.demo.supervisor import ChildFailed
        from loraplane.demo.system import ROOT, BringUpError
        from loraplane.demo.traces import TraceMissing, find_trace
        from loraplane.kernel.config import get_settings
        from loraplane.workers.vllm_process import vllm_installed

        unknown = [s for s in scenarios if s not in SCENARIOS]
        if unknown or len(set(scenarios)) != len(scenarios):
            raise typer.BadParameter(
                f"{', '.join(unknown) or 'a repeated scenario'}: choose "
                f"each at most once of {', '.join(SCENARIOS)}",
                param_hint="SCENARIO",
            )
        console = Console(stderr=as_json)
        if not fake_vllm and not vllm_installed(ROOT):
            console.print(
                "[red]error:[/] the real vLLM is not installed (.venv-vllm). "
                "Install it with `loraplane vllm setup` (several GB), or run with "
                "--fake-vllm."
            )
            raise typer.Exit(2)
        try:
            path = find_trace(trace)
        except TraceMissing as exc:
            console.print(f"[yellow]warning:[/] {exc}; replaying synthetic arrivals")
            path = None
        try:
            results = run_scenarios(
                scenarios,
                get_settings(),
                duration_s=duration,
                fake_vllm=fake_vllm,
                trace=path,
                console=console,
            )
        except (ChildFailed, BringUpError) as exc:
            console.print(f"[red]error:[/] {exc}", highlight=False)
            raise typer.Exit(1) from None
        if as_json:  # one scenario: its object, as before; several: a list of them
            objects = [r.to_json() for r in results]
            typer.echo(json.dumps(objects[0] if len(objects) == 1 else objects, indent=2))
        else:
            for result in results:
                render(result, console)
        raise typer.Exit(0 if all(r.passed for r in results) else 1)
