"""``loraplane publish | canary | promote | rollback | retire | revoke`` and
``loraplane lifecycle verify``: signed lifecycle events from CI and ops.

Each command signs one event with ``--key`` and produces it with acks=all; it exits 0 only
once the broker acknowledged it and prints one JSON line for CI logs. The registry agent
decides later; an acknowledged event may still be rejected (see the audit topic or
``loraplane registry show``); ``publish --wait-s`` waits for that decision. ``publish``'s
output and exit codes are a stable interface (``schemas.publish_result``, written by
``loraplane.publish_output``). seq is time-based, see loraplane.lifecycle_events.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from loraplane.publish_output import PublishFailed, PublishReport
from loraplane.schemas.reasons import PublishFailure

if TYPE_CHECKING:
    from loraplane.kernel.config import Settings
    from loraplane.registry.decisions import DecisionWatch
    from loraplane.schemas.lifecycle import LifecycleAction, LifecycleEvent

__all__ = [
    "ADAPTER_OPTION",
    "BASE_OPTION",
    "KEY_OPTION",
    "MAX_EVENTS_FILE_BYTES",
    "REASON_OPTION",
    "TENANT_OPTION",
    "TTL_OPTION",
    "VERSION_OPTION",
    "register",
]

KEY_OPTION = typer.Option(..., "--key", help="Private key file (loraplane keys generate).")
ADAPTER_OPTION = typer.Option(..., "--adapter-id")
VERSION_OPTION = typer.Option(..., "--version", help="The version the action applies to.")
TENANT_OPTION = typer.Option(None, "--tenant", help="Default: the registry's owner.")
BASE_OPTION = typer.Option(None, "--base-model", help="Default: the registry's base model.")
REASON_OPTION = typer.Option("", "--reason", help="Why, for the audit log.")
TTL_OPTION = typer.Option(
    60, "--ttl-minutes", min=1, max=7 * 24 * 60, help="The event expires after this long unapplied."
)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(1)


def _missing_extra(message: str) -> typer.Exit:
    """An optional part of loraplane this command needs is not installed: exit 2."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def _produce(settings: Settings, event: LifecycleEvent) -> tuple[int, int]:
    from loraplane.kernel.bus import DeliveryError, produce_sync
    from loraplane.kernel.topics import topic_name

    try:
        return produce_sync(settings, topic_name(settings, "lifecycle"), event.adapter_id, event)
    except DeliveryError as exc:
        raise _fail(str(exc)) from None


def _load_key(path: Path) -> Any:
    from loraplane.schemas.signing import KeyFileError, SigningKey

    try:
        return SigningKey.load(path)
    except KeyFileError as exc:
        raise _fail(str(exc)) from None


def _owner(
    settings: Settings, adapter_id: str, tenant: str | None, base_model: str | None
) -> tuple[str, str]:
    """Tenant and base model from the options, else from the registry topic."""
    if tenant and base_model:
        return tenant, base_model
    from loraplane.registry.topic import RegistryUnreadable, load_registry

    try:
        view = load_registry(settings).get(adapter_id)
    except RegistryUnreadable as exc:
        raise _fail(f"{exc}; or pass --tenant and --base-model") from None
    if view is None:
        raise _fail(f"{adapter_id} is not in the registry; pass --tenant and --base-model")
    return tenant or view.tenant_id, base_model or view.base_model


def _transition(
    action: LifecycleAction,
    key_file: Path,
    adapter_id: str,
    version: str,
    tenant: str | None,
    base_model: str | None,
    reason: str,
    ttl_minutes: int,
    **fields: Any,
) -> None:
    from datetime import timedelta

    from pydantic import ValidationError

    from loraplane.kernel.config import get_settings
    from loraplane.lifecycle_events import signed_event
    from loraplane.schemas.validation_text import error_line

    settings = get_settings()
    key = _load_key(key_file)
    tenant_id, base = _owner(settings, adapter_id, tenant, base_model)
    try:
        event = signed_event(
            key,
            action,
            adapter_id=adapter_id,
            tenant_id=tenant_id,
            base_model=base,
            version=version,
            reason=reason,
            ttl=timedelta(minutes=ttl_minutes),
            **fields,
        )
    except ValidationError as exc:
        raise _fail(error_line(exc)) from None
    partition, offset = _produce(settings, event)
    typer.echo(
        json.dumps(
            {
                "event_id": event.event_id,
                "action": str(action),
                "adapter_id": adapter_id,
                "version": version,
                "seq": event.seq,
                "partition": partition,
                "offset": offset,
            }
        )
    )


def _version_command(action: LifecycleAction) -> Callable[..., None]:
    """The command of an action that needs nothing but the version (promote/retire/revoke)."""

    def command(
        adapter_id: str = ADAPTER_OPTION,
        version: str = VERSION_OPTION,
        key_file: Path = KEY_OPTION,
        tenant: str | None = TENANT_OPTION,
        base_model: str | None = BASE_OPTION,
        reason: str = REASON_OPTION,
        ttl_minutes: int = TTL_OPTION,
    ) -> None:
        _transition(action, key_file, adapter_id, version, tenant, base_model, reason, ttl_minutes)

    return command


MAX_EVENTS_FILE_BYTES = 256 * 1024 * 1024


def _is_one_object(data: bytes) -> bool:
    """A single (possibly pretty-printed) event rather than JSON lines: one strict JSON
    object (bounded depth and size; never RecursionError on hostile nesting)."""
    from loraplane.schemas.strict_json import StrictJsonError, strict_loads

    if b"\n" not in data.strip():
        return True  # one line: one message, whatever it holds
    try:
        return isinstance(strict_loads(data), dict)
    except StrictJsonError:
        return False


def _reupload(
    settings: Settings, adapter_id: str, version: str, artifact: str, model_config: Path | None
) -> None:
    """``publish --reupload``: a registered version's bytes back into the store."""
    from botocore.exceptions import BotoCoreError, ClientError

    from loraplane.artifact.model_config import read_model_config
    from loraplane.artifact_publish import (
        ArtifactError,
        SigningUnavailable,
        local_folder,
        registered_version,
        reupload,
    )

    try:
        record = registered_version(settings, adapter_id, version)
        model = read_model_config(model_config) if model_config else None
        with local_folder(settings, artifact) as folder:
            manifest = reupload(settings, folder, record, model=model)
    except SigningUnavailable as exc:
        raise _missing_extra(str(exc)) from None
    except (BotoCoreError, ClientError) as exc:  # first: its time-outs are OSErrors too
        raise _fail(f"artifact store: {exc}") from None
    except (ArtifactError, ValueError, OSError) as exc:
        raise _fail(str(exc)) from None
    typer.echo(
        json.dumps(
            {
                "reuploaded": True,
                "adapter_id": adapter_id,
                "version": version,
                "sha256": record.sha256,
                "artifact_uri": record.artifact_uri,
                "files": len(manifest.files) + 1,
            }
        )
    )


def _publish_settings(get_settings: Callable[[], Settings]) -> Settings:
    from pydantic import ValidationError

    from loraplane.schemas.validation_text import error_line

    try:
        return get_settings()
    except (ValidationError, ValueError) as exc:
        raise PublishFailed(
            PublishFailure.settings_invalid, f"settings: {error_line(exc)}"
        ) from None


def _check_release(adapter_id: str, tenant: str, base_model: str, version: str) -> None:
    """Ids and version as the signed event needs them, before any byte is read or sent."""
    from pydantic import TypeAdapter, ValidationError

    from loraplane.schemas.base import Identifier, Version

    ids = "an id (lower-case letters, digits, '.', '_', '-'; at most 128)"
    for option, value, kind, what in (
        ("--adapter-id", adapter_id, Identifier, ids),
        ("--tenant", tenant, Identifier, ids),
        ("--base-model", base_model, Identifier, ids),
        ("--version", version, Version, "a version (1, v2, 1.4.0: up to 4 numbers)"),
    ):
        try:
            TypeAdapter(kind).validate_python(value)
        except ValidationError:
            raise PublishFailed(
                PublishFailure.release_invalid, f"{option} {value[:100]!r} is not {what}"
            ) from None


def _publish_key(path: Path) -> Any:
    from loraplane.schemas.signing import KeyFileError, SigningKey

    try:
        return SigningKey.load(path)
    except KeyFileError as exc:
        raise PublishFailed(PublishFailure.key_unusable, str(exc)) from None


def _decision_watch(settings: Settings) -> DecisionWatch:
    """Where the audit topic ends before the events go out (``publish --wait-s``)."""
    from loraplane.kernel.kafka import KafkaAuthError, KafkaUnavailable
    from loraplane.registry.decisions import DecisionWatch

    try:
        return DecisionWatch(settings)
    except KafkaUnavailable as exc:
        raise PublishFailed(PublishFailure.bus_unavailable, f"audit topic: {exc}") from None
    except KafkaAuthError as exc:
        raise PublishFailed(PublishFailure.settings_invalid, str(exc)) from None


def _await_registry(report: PublishReport, watch: DecisionWatch, wait_s: float) -> None:
    """The registry's decision on every sent event, or the failure that says what is known."""
    from confluent_kafka import KafkaException

    ids = [e.event_id for e in report.events]
    report.progress(f"waiting up to {wait_s:g} s for the registry's decision")
    try:
        audits = watch.wait(ids, wait_s)
    except KafkaException as exc:
        raise PublishFailed(
            PublishFailure.registry_undecided, f"reading the audit topic: {exc}"
        ) from None
    rejected = report.decided(audits)
    if rejected:
        raise PublishFailed(
            PublishFailure.registry_rejected,
            "; ".join(
                f"the registry rejected {d.action} event {d.event_id}: {d.why}" for d in rejected
            ),
        )
    missing = [i for i in ids if i not in audits]
    if missing:
        raise PublishFailed(
            PublishFailure.registry_undecided,
            f"no decision on {', '.join(missing)} within {wait_s:g} s (is the "
            "registry agent, `loraplane streams run`, running?)",
        )


def register(app: typer.Typer) -> None:
    from loraplane.schemas.lifecycle import LifecycleAction

    @app.command("publish")
    def publish_cmd(
        adapter_id: str = ADAPTER_OPTION,
        tenant: str | None = typer.Option(None, "--tenant", help="Required unless --reupload."),
        base_model: str | None = typer.Option(
            None, "--base-model", help="Required unless --reupload."
        ),
        version: str = typer.Option(..., "--version"),
        priority: str = typer.Option(
            "silver", "--priority", help="bronze | silver | gold | platinum"
        ),
        artifact: str = typer.Option(..., "--artifact", help="Adapter folder or s3:// prefix."),
        canary: float | None = typer.Option(
            None, "--canary", min=0, max=100, help="Also start a canary at this percent."
        ),
        promote: bool = typer.Option(
            False, "--promote", help="Also make this version the active one."
        ),
        tokenizer_revision: str = typer.Option("", "--tokenizer-revision"),
        model_config: Path | None = typer.Option(
            None,
            "--model-config",
            help="the base model's config.json: also check that "
            "every module exists there with matching shapes",
        ),
        key_file: Path | None = typer.Option(
            None,
            "--key",
            help="Private key file (loraplane keys generate); required unless --reupload.",
        ),
        reason: str = REASON_OPTION,
        ttl_minutes: int = TTL_OPTION,
        wait_s: float = typer.Option(
            0.0,
            "--wait-s",
            min=0,
            max=3600,
            help="Also wait this long for the registry's decision on each event (read "
            "from the audit topic); 0: exit once the broker acknowledged them.",
        ),
        json_output: bool = typer.Option(
            False,
            "--json",
            help="Print the result object (stdout) whatever happens, "
            "failures included: the stable interface for scripts.",
        ),
        reupload: bool = typer.Option(
            False,
            "--reupload",
            help="The version is registered already and the store lost "
            "its bytes: upload them again once their digest is the "
            "registry's signed one; no lifecycle event.",
        ),
    ) -> None:
        """Verify, upload and publish an adapter version (status: published).

        Exit codes: 0 published, 1 internal error, 2 invalid input, 3 artifact refused,
        4 registry rejected (--wait-s), 5 unavailable (S3 or Kafka; nothing sent: re-run),
        6 undecided (events sent, outcome unknown). docs/lifecycle.md, "Publishing from CI".
        """
        from datetime import timedelta

        from botocore.exceptions import BotoCoreError, ClientError
        from pydantic import ValidationError

        from loraplane.artifact.model_config import read_model_config
        from loraplane.artifact_publish import (
            ArtifactError,
            PublishRequest,
            SigningUnavailable,
            build_record,
            local_folder,
            publish_keyring,
            upload,
        )
        from loraplane.kernel import kafka
        from loraplane.kernel.bus import DeliveryError, produce_sync
        from loraplane.kernel.config import get_settings
        from loraplane.kernel.kafka import KafkaAuthError
        from loraplane.kernel.secrets import SecretError
        from loraplane.kernel.topics import topic_name
        from loraplane.lifecycle_events import signed_event
        from loraplane.schemas.adapter import Priority
        from loraplane.schemas.validation_text import error_line

        if reupload and not json_output:
            _reupload(get_settings(), adapter_id, version, artifact, model_config)
            return
        report = PublishReport(
            adapter_id, version, tenant_id=tenant, base_model=base_model, json_output=json_output
        )
        with report.running():
            if reupload:
                raise PublishFailed(
                    PublishFailure.options_invalid,
                    "--json is for publishing; --reupload prints its own line",
                )
            if key_file is None or tenant is None or base_model is None:
                raise PublishFailed(
                    PublishFailure.options_invalid,
                    "publish needs --key, --tenant and --base-model (or --reupload)",
                )
            if promote and canary is not None:
                raise PublishFailed(
                    PublishFailure.options_invalid, "--canary or --promote, not both"
                )
            settings = _publish_settings(get_settings)
            _check_release(adapter_id, tenant, base_model, version)
            key = _publish_key(key_file)
            ttl = timedelta(minutes=ttl_minutes)
            try:
                request = PublishRequest(
                    adapter_id, tenant, base_model, version, Priority(priority), tokenizer_revision
                )
            except ValueError as exc:
                raise PublishFailed(PublishFailure.options_invalid, str(exc)) from None
            try:
                model = read_model_config(model_config) if model_config else None
            except (OSError, ValueError) as exc:
                raise PublishFailed(PublishFailure.model_config_invalid, str(exc)) from None
            try:
                with local_folder(settings, artifact) as folder:
                    report.progress(f"verifying {artifact} as a worker would")
                    record, manifest = build_record(
                        folder,
                        request,
                        settings.s3.bucket,
                        base_model_aliases=settings.base_model_aliases,
                        model=model,
                        keyring=publish_keyring(settings),
                    )
                    report.artifact(record)
                    report.progress(
                        f"uploading {len(manifest.files)} files and the manifest "
                        f"to {record.artifact_uri}"
                    )
                    upload(settings, folder, record, manifest)
            except SigningUnavailable as exc:
                raise PublishFailed(PublishFailure.extra_missing, str(exc)) from None
            except ArtifactError as exc:
                raise PublishFailed(
                    PublishFailure.artifact_refused, str(exc), exc.refusals
                ) from None
            # before OSError: botocore's connect and read time-outs are OSErrors too
            except (BotoCoreError, ClientError) as exc:
                raise PublishFailed(
                    PublishFailure.artifact_store_unavailable, f"artifact store: {exc}"
                ) from None
            except OSError as exc:  # the folder could not be read
                raise PublishFailed(PublishFailure.artifact_refused, str(exc)) from None
            except SecretError as exc:  # the S3 secret file
                raise PublishFailed(PublishFailure.settings_invalid, str(exc)) from None
            try:
                event = signed_event(
                    key,
                    LifecycleAction.publish,
                    adapter_id=adapter_id,
                    tenant_id=tenant,
                    base_model=base_model,
                    version=version,
                    record=record,
                    reason=reason,
                    ttl=ttl,
                )
                # The follow-up needs no registry look-up (promote alone does: the owner), so
                # it cannot race the registry taking in the publish.
                follow = None
                if canary is not None:
                    follow = signed_event(
                        key,
                        LifecycleAction.canary,
                        adapter_id=adapter_id,
                        tenant_id=tenant,
                        base_model=base_model,
                        version=version,
                        canary_percent=canary,
                        reason=reason,
                        seq=event.seq + 1,
                        ttl=ttl,
                    )
                elif promote:
                    follow = signed_event(
                        key,
                        LifecycleAction.promote,
                        adapter_id=adapter_id,
                        tenant_id=tenant,
                        base_model=base_model,
                        version=version,
                        reason=reason,
                        seq=event.seq + 1,
                        ttl=ttl,
                    )
            except (ValueError, ValidationError) as exc:
                raise PublishFailed(PublishFailure.release_invalid, error_line(exc)) from None
            watch = _decision_watch(settings) if wait_s else None
            lifecycle = topic_name(settings, "lifecycle")
            shared: Any = None  # one producer for the event and its follow-up
            for sent in (event, follow):
                if sent is None:
                    continue
                try:
                    if shared is None:  # a Producer's truth is its queue's length
                        shared = kafka.producer(settings)
                    report.sent(
                        sent,
                        *produce_sync(settings, lifecycle, adapter_id, sent, producer=shared),
                    )
                except DeliveryError as exc:
                    raise PublishFailed(
                        PublishFailure.bus_unavailable
                        if sent is event
                        else PublishFailure.follow_up_not_acknowledged,
                        str(exc),
                    ) from None
                except KafkaAuthError as exc:  # before the first event: nothing was sent
                    raise PublishFailed(PublishFailure.settings_invalid, str(exc)) from None
            if watch is not None:
                _await_registry(report, watch, wait_s)

    @app.command("canary")
    def canary_cmd(
        adapter_id: str = ADAPTER_OPTION,
        version: str = VERSION_OPTION,
        percent: float = typer.Option(..., "--percent", min=0, max=100, help="0-100"),
        key_file: Path = KEY_OPTION,
        tenant: str | None = TENANT_OPTION,
        base_model: str | None = BASE_OPTION,
        reason: str = REASON_OPTION,
        ttl_minutes: int = TTL_OPTION,
    ) -> None:
        """Serve a published version to PERCENT of the adapter's traffic."""
        _transition(
            LifecycleAction.canary,
            key_file,
            adapter_id,
            version,
            tenant,
            base_model,
            reason,
            ttl_minutes,
            canary_percent=percent,
        )

    @app.command("rollback")
    def rollback_cmd(
        adapter_id: str = ADAPTER_OPTION,
        version: str = typer.Option(..., "--version", help="The active version."),
        to: str | None = typer.Option(None, "--to", help="Default: the version it replaced."),
        key_file: Path = KEY_OPTION,
        tenant: str | None = TENANT_OPTION,
        base_model: str | None = BASE_OPTION,
        reason: str = REASON_OPTION,
        ttl_minutes: int = TTL_OPTION,
    ) -> None:
        """Retire the active version and re-activate an earlier one."""
        _transition(
            LifecycleAction.rollback,
            key_file,
            adapter_id,
            version,
            tenant,
            base_model,
            reason,
            ttl_minutes,
            rollback_to=to,
        )

    for action, doc in (
        (LifecycleAction.promote, "Make a version the active one."),
        (LifecycleAction.retire, "Take a version out of service."),
        (LifecycleAction.revoke, "Never load a version again; workers evict."),
    ):
        app.command(str(action), help=doc)(_version_command(action))

    group = typer.Typer(help="Offline checks of lifecycle events.", no_args_is_help=True)

    @group.command("verify")
    def verify_cmd(
        file: Path = typer.Argument(..., help="One event (JSON) or JSON lines, in order."),
        keyring: Path = typer.Option(..., "--keyring"),
        state: Path | None = typer.Option(
            None,
            "--state",
            help="Registry to start from: the output of `loraplane registry list --json`.",
        ),
    ) -> None:
        """Apply the events in order as the registry would; exit 1 if any is rejected."""
        from loraplane.kernel.local_files import read_regular
        from loraplane.registry.fold import Accepted, AdapterState, evaluate
        from loraplane.schemas.base import now_utc
        from loraplane.schemas.keyring import KeyringError, load_keyring
        from loraplane.schemas.registry import MAX_VIEWS_BYTES, views_from_json

        try:
            ring = load_keyring(keyring)
            views = views_from_json(read_regular(state, MAX_VIEWS_BYTES)) if state else {}
            data = read_regular(file, MAX_EVENTS_FILE_BYTES)
        except OSError as exc:
            raise _fail(f"{exc.filename}: {exc.strerror or exc}") from None
        except (KeyringError, ValueError) as exc:
            raise _fail(str(exc)) from None
        states = {aid: AdapterState(view=v) for aid, v in views.items()}
        messages = (
            [data] if _is_one_object(data) else [line for line in data.splitlines() if line.strip()]
        )
        rejected = 0
        for n, raw in enumerate(messages, 1):
            decision = evaluate(raw, ring, states.get, now_utc())
            if isinstance(decision, Accepted):
                states[decision.adapter_id] = decision.state
                typer.echo(
                    f"{n}: accept {decision.event.action} {decision.adapter_id}@"
                    f"{decision.event.version} (active: "
                    f"{decision.state.view.active_version})"
                )
            else:
                rejected += 1
                typer.echo(f"{n}: reject {decision.reason}: {decision.detail}")
        if rejected:
            raise typer.Exit(1)

    app.add_typer(group, name="lifecycle")
