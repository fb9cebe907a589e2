"""``loraplane dev build-model``: the tiny local model and adapters the demo and tests use."""

from __future__ import annotations

import json
from pathlib import Path

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Developer helpers (local fixtures).", no_args_is_help=True)

    @group.command("build-model")
    def build_model_cmd(
        directory: Path = typer.Argument(..., help="model folder to write"),
        adapters: int = typer.Option(
            0, "--adapters", min=0, max=1000, help="also write N LoRA adapters (seeds 1..N)"
        ),
        adapter_dir: Path | None = typer.Option(
            None, "--adapter-dir", help="where adapter-1..N go (default: DIR-adapters)"
        ),
        rank: int = typer.Option(8, "--rank", min=1, max=512),
        target_modules: str = typer.Option("q_proj,v_proj", "--target-modules"),
        base_model: str = typer.Option(
            "tiny-llama", "--base-model", help="base_model_name_or_path written in adapters"
        ),
        seed: int = typer.Option(0, "--seed"),
    ) -> None:
        """Write a tiny random Llama (HF layout, loadable by vLLM) and PEFT adapters for it,
        each with its manifest.json. Prints one JSON line per folder written; an adapter's
        line holds the registry record it would be published with (adapter_id
        ``adapter-N``, version 1), for ``loraplane artifact verify DIR --record``."""
        from loraplane.artifact.model_shape import MAX_MODEL_CONFIG_BYTES
        from loraplane.artifact.verification import MANIFEST_NAME
        from loraplane.artifact_publish import PublishRequest, build_record
        from loraplane.kernel.atomic_file import write_atomic
        from loraplane.kernel.config import get_settings
        from loraplane.kernel.local_files import read_json
        from loraplane.schemas.adapter import Priority
        from loraplane.tiny_model import build_adapter, build_model

        build_model(directory, seed=seed)
        config = read_json(directory / "config.json", MAX_MODEL_CONFIG_BYTES)
        typer.echo(json.dumps({"model": str(directory), "vocab_size": config["vocab_size"]}))
        root = adapter_dir or directory.with_name(directory.name + "-adapters")
        modules = [m.strip() for m in target_modules.split(",") if m.strip()]
        for i in range(1, adapters + 1):
            folder = build_adapter(
                root / f"adapter-{i}",
                seed=i,
                rank=rank,
                target_modules=modules,
                base_model_name=base_model,
                model_config=config,
            )
            release = PublishRequest(
                adapter_id=f"adapter-{i}",
                tenant_id="dev",
                base_model=base_model,
                version="1",
                priority=Priority.silver,
            )
            record, manifest = build_record(folder, release, get_settings().s3.bucket)
            write_atomic(folder / MANIFEST_NAME, manifest.canonical_bytes())
            typer.echo(
                json.dumps({"adapter": str(folder), "record": record.model_dump(mode="json")})
            )

    app.add_typer(group, name="dev")
