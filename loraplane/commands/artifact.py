"""``loraplane artifact verify``: the worker's artifact checks, offline, for ops and CI."""

from __future__ import annotations

import tempfile
from pathlib import Path

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Adapter artifacts (PEFT LoRA folders).", no_args_is_help=True)

    @group.command("verify")
    def verify_cmd(
        target: str = typer.Argument(..., help="artifact folder, or s3://bucket/prefix/"),
        record_file: Path | None = typer.Option(
            None,
            "--record",
            help="AdapterRecord JSON: checks the manifest digest, rank, "
            "target modules and base model against it",
        ),
        adapter_id: str | None = typer.Option(
            None, "--adapter-id", help="take the record from the registry topic instead"
        ),
        version: str | None = typer.Option(None, "--version"),
        max_rank: int | None = typer.Option(
            None, "--max-rank", min=1, max=65_536, help="the worker's max_lora_rank (default 512)"
        ),
        base_model: str | None = typer.Option(
            None, "--base-model", help="the worker's base model id"
        ),
        max_bytes: int = typer.Option(1024**3, "--max-bytes", min=1, max=2**62),
        model_config: Path | None = typer.Option(
            None,
            "--model-config",
            help="the base model's config.json: also check that "
            "every module exists there with matching shapes",
        ),
        tenant: str | None = typer.Option(
            None,
            "--tenant",
            help="check the OpenSSF model-signing bundle (model.sig) for "
            "this tenant with the keyring (default: the record's)",
        ),
    ) -> None:
        """Print ``ok``, or one line per refusal reason; exit 1 when refused. A folder
        without manifest.json is checked as ``loraplane publish`` would upload it: inert
        files it would drop are named on stderr. With a tenant (``--tenant`` or the
        record's), the model-signing bundle is checked as a worker checks it, with
        ``settings.keyring_path``."""
        from pydantic import ValidationError

        from loraplane.artifact.directory import DirectoryArtifact
        from loraplane.artifact.model_config import read_model_config
        from loraplane.artifact.model_signing_bundle import SIGNING_EXTRA, check_folder
        from loraplane.artifact.refusal import ArtifactError, Refusal
        from loraplane.artifact.verification import (
            MANIFEST_NAME,
            MAX_JSON_FILE_BYTES,
            WorkerLimits,
            verify_artifact,
        )
        from loraplane.artifact_publish import ArtifactError as PublishRefused
        from loraplane.artifact_publish import prepare, publish_keyring
        from loraplane.kernel.config import get_settings
        from loraplane.kernel.local_files import read_regular
        from loraplane.schemas.adapter import MAX_RANK, AdapterRecord
        from loraplane.schemas.codec import MAX_MESSAGE_BYTES, SchemaError, decode_signed
        from loraplane.schemas.manifest import Manifest
        from loraplane.schemas.reasons import ArtifactReason as Reason
        from loraplane.schemas.validation_text import error_line
        from loraplane.workers.artifact_fetch import ArtifactFetcher

        record = None
        if (adapter_id is None) != (version is None) or (adapter_id and record_file):
            typer.echo("give --record FILE, or --adapter-id with --version", err=True)
            raise typer.Exit(2)
        if adapter_id is not None and version is not None:
            from loraplane.registry.topic import RegistryUnreadable, load_registry

            try:
                view = load_registry(get_settings()).get(adapter_id)
            except RegistryUnreadable as exc:
                typer.echo(f"error: {exc}", err=True)
                raise typer.Exit(1) from None
            record = view.version(version) if view is not None else None
            if record is None:
                typer.echo(f"{adapter_id} version {version} is not in the registry", err=True)
                raise typer.Exit(2)
        if record_file is not None:
            try:
                record = decode_signed(AdapterRecord, read_regular(record_file, MAX_MESSAGE_BYTES))
            except (OSError, SchemaError, ValidationError) as exc:
                typer.echo(f"--record {record_file}: {error_line(exc)}", err=True)
                raise typer.Exit(2) from None
        try:
            model = read_model_config(model_config) if model_config else None
        except ValueError as exc:
            typer.echo(f"--model-config: {exc}", err=True)
            raise typer.Exit(2) from None
        limits = WorkerLimits(
            base_model=base_model,
            max_lora_rank=max_rank or MAX_RANK,
            max_total_bytes=max_bytes,
            model=model,
            base_model_aliases=get_settings().base_model_aliases,
        )

        owner = tenant or (record.tenant_id if record is not None else None)

        def signature(folder: Path, manifest: Manifest | None) -> tuple[Refusal, ...]:
            """The bundle's refusals, once the files passed (their digests are then the
            manifest's); nothing without a tenant to check it for."""
            if owner is None or manifest is None:
                return ()
            outcome = check_folder(folder, manifest, owner, publish_keyring(get_settings()), record)
            if not isinstance(outcome, tuple):
                return ()
            if any(r.reason is Reason.model_signing_unavailable for r in outcome):
                typer.echo(
                    f"{target} carries a model-signing bundle and the model-signing "
                    f"library is not installed: pip install '{SIGNING_EXTRA}'",
                    err=True,
                )
                raise typer.Exit(2)
            return outcome

        def report(refusals: tuple[Refusal, ...], pinned: bool = True) -> None:
            if not refusals:
                typer.echo(
                    "ok"
                    if pinned
                    else "ok: every file check passed; no digest is "
                    "pinned yet (no manifest.json: publish writes one and pins it)"
                )
                return
            for refusal in refusals:
                typer.echo(str(refusal))
            raise typer.Exit(1)

        if not target.startswith("s3://"):
            folder = Path(target)
            if not folder.is_dir():
                typer.echo(f"{target}: not a folder", err=True)
                raise typer.Exit(2)
            if (folder / MANIFEST_NAME).exists():
                listing = DirectoryArtifact(folder)
                refusals = verify_artifact(listing, limits, record).refusals
                if not refusals:  # the verifier read it: a file of at most the bound
                    raw = listing.read(MANIFEST_NAME, 0, MAX_JSON_FILE_BYTES + 1)
                    refusals = signature(folder, Manifest.model_validate_json(raw))
                report(refusals)
                return
            try:
                prepared = prepare(folder)
            except PublishRefused as exc:  # the listing's refusals: nothing was read
                report(exc.refusals)
                return
            except ValueError as exc:  # pydantic's ValidationError too: nothing to upload
                report((Refusal(Reason.manifest_invalid, MANIFEST_NAME, str(exc)[:200]),))
                return
            for dropped in prepared.manifest.dropped:
                typer.echo(f"publish drops {dropped.path} ({dropped.kind})", err=True)
            # prepare() refused on the listing already: only the artifact's own checks are left
            refusals = verify_artifact(prepared.reader, limits, record).refusals
            report(refusals or signature(folder, prepared.manifest), pinned=record is not None)
            return
        with tempfile.TemporaryDirectory(prefix="loraplane-verify-") as tmp:
            fetcher = ArtifactFetcher(get_settings().s3)
            try:
                fetched = fetcher.fetch(
                    target if target.endswith("/") else target + "/",
                    Path(tmp) / "artifact",
                    expected_sha256=record.sha256 if record else None,
                    max_total_bytes=max_bytes,
                    owner=record
                    if record
                    and record.artifact_uri == (target if target.endswith("/") else target + "/")
                    else None,
                )
            except ArtifactError as exc:
                report(exc.refusals)
                return
            artifact = DirectoryArtifact(fetched.root, fetched.digests)
            report(
                verify_artifact(artifact, limits, record).refusals
                or signature(fetched.root, fetched.manifest)
            )

    app.add_typer(group, name="artifact")
