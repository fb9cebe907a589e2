"""OpenSSF model signing of an adapter artifact: which signer vouches for it, and whether what
it signed is exactly what is served. Pure: the cryptography is the model-signing library's,
handed in as ``verify_with`` (loraplane.artifact.model_signing_bundle runs it on a bundle file).

A folder signed with the ``model-signing`` package carries its bundle as ``model.sig``, which
publish uploads like any file (so the manifest pins its bytes) and the record names. The same
check runs at publish and on a worker before the bytes are used: a bundle where the tenant
requires one, verified by a ``model_signers`` entry that may sign this tenant's adapters and
is not revoked, signing exactly the served files (and those dropped at publish) with their
manifest sha256, and, on a worker, the bundle and signer the record names. Each failure has
its reason (``model_signature_required``, ``model_signer_out_of_scope``,
``model_signer_revoked``, ``model_signature_invalid``, ``model_signature_mismatch``,
``record_mismatch``): docs/worker.md, "OpenSSF model signing on the worker", and
docs/lifecycle.md, "Publishing a signed folder".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from loraplane.artifact.refusal import Refusal
from loraplane.artifact.verification import BUNDLE_NAME
from loraplane.schemas.adapter import AdapterRecord, ModelSignature
from loraplane.schemas.keyring import Keyring, ModelSignerEntry
from loraplane.schemas.manifest import Manifest
from loraplane.schemas.reasons import ArtifactReason as Reason

__all__ = [
    "MAX_SIGNED_FILES",
    "BundleRejected",
    "Outcome",
    "Signed",
    "SignedFiles",
    "Unsigned",
    "VerifyWith",
    "bundle_entry_sha256",
    "check_model_signature",
    "coverage_refusals",
]

MAX_SIGNED_FILES = 4096


@dataclass(frozen=True)
class SignedFiles:
    """What a bundle signs, as the library returns it once the signature verified: how the
    files were hashed and each file's digest (``name -> (algorithm, hex)``)."""

    method: str
    hash_type: str
    digests: Mapping[str, tuple[str, str]]


class BundleRejected(Exception):
    """The bundle does not verify with the signer it was tried with; the message says why."""


VerifyWith = Callable[[ModelSignerEntry], SignedFiles]
"""Verify the bundle with one signer; raises BundleRejected when it does not verify."""


@dataclass(frozen=True)
class Signed:
    signature: ModelSignature


@dataclass(frozen=True)
class Unsigned:
    """No bundle, and none required."""


Outcome = Signed | Unsigned | tuple[Refusal, ...]


def bundle_entry_sha256(manifest: Manifest) -> str | None:
    entry = manifest.file(BUNDLE_NAME)
    return entry.sha256 if entry is not None else None


def check_model_signature(
    manifest: Manifest,
    tenant_id: str,
    keyring: Keyring | None,
    verify_with: VerifyWith | None,
    record: AdapterRecord | None = None,
) -> Outcome:
    """Steps 1-4 above for an artifact whose files already match ``manifest``.
    ``verify_with`` is None when the bundle cannot be verified here (no library); ``record``
    is the signed record a worker loads (None at publish, which makes it)."""
    bundle_sha256 = bundle_entry_sha256(manifest)
    if bundle_sha256 is None:
        if keyring is not None and keyring.requires_model_signature(tenant_id):
            return (
                Refusal(
                    Reason.model_signature_required,
                    BUNDLE_NAME,
                    f"tenant {tenant_id} requires an OpenSSF model-signing bundle",
                ),
            )
        return Unsigned()
    if keyring is None:
        return (
            Refusal(
                Reason.model_signature_invalid,
                BUNDLE_NAME,
                "no readable keyring to verify the bundle with",
            ),
        )
    if verify_with is None:
        return (
            Refusal(
                Reason.model_signing_unavailable,
                BUNDLE_NAME,
                "the model-signing package is not installed: pip install 'loraplane[signing]'",
            ),
        )
    found = _signer(keyring, tenant_id, verify_with)
    if isinstance(found, Refusal):
        return (found,)
    entry, signed = found
    refusals = coverage_refusals(signed, manifest)
    signature = ModelSignature(
        bundle_sha256=bundle_sha256, signer_id=entry.signer_id, identity=entry.identity
    )
    if record is not None and not refusals and record.model_signature != signature:
        refusals.append(
            Refusal(
                Reason.record_mismatch,
                BUNDLE_NAME,
                f"the record names {_describe(record.model_signature)}, the "
                f"bundle verifies as {_describe(signature)}",
            )
        )
    return tuple(refusals) if refusals else Signed(signature)


def _describe(signature: ModelSignature | None) -> str:
    if signature is None:
        return "no model signature"
    return f"signer {signature.signer_id} ({signature.identity[:80]})"


def _signer(
    keyring: Keyring, tenant_id: str, verify_with: VerifyWith
) -> tuple[ModelSignerEntry, SignedFiles] | Refusal:
    """The first signer allowed for ``tenant_id`` whose key verifies the bundle; else the
    refusal that says who, if anyone, does verify it."""
    allowed = [s for s in keyring.model_signers if s.allows_tenant(tenant_id) and not s.revoked]
    problems: list[str] = []
    for entry in allowed:
        try:
            return entry, verify_with(entry)
        except BundleRejected as exc:
            problems.append(f"{entry.signer_id}: {str(exc)[:160]}")
    for entry in keyring.model_signers:
        if entry in allowed:
            continue
        try:
            verify_with(entry)
        except BundleRejected:
            continue
        if entry.revoked:
            return Refusal(
                Reason.model_signer_revoked,
                BUNDLE_NAME,
                f"signed by {entry.signer_id}, which is revoked",
            )
        return Refusal(
            Reason.model_signer_out_of_scope,
            BUNDLE_NAME,
            f"signed by {entry.signer_id}, which may not sign {tenant_id}'s adapters",
        )
    if not allowed:
        return Refusal(
            Reason.model_signature_invalid,
            BUNDLE_NAME,
            f"the keyring trusts no model signer for tenant {tenant_id}",
        )
    return Refusal(
        Reason.model_signature_invalid,
        BUNDLE_NAME,
        "no trusted key verifies it: " + "; ".join(problems)[:400],
    )


def coverage_refusals(signed: SignedFiles, manifest: Manifest) -> list[Refusal]:
    """Step 3: the signed files against the manifest's served and dropped files."""
    if signed.method != "files" or signed.hash_type != "sha256":
        return [
            Refusal(
                Reason.model_signature_invalid,
                BUNDLE_NAME,
                f"hashed as {signed.method[:20]}/{signed.hash_type[:20]}; only "
                "per-file sha256 (the library's default) compares with the manifest",
            )
        ]
    if len(signed.digests) > MAX_SIGNED_FILES:
        return [
            Refusal(
                Reason.model_signature_mismatch,
                BUNDLE_NAME,
                f"signs {len(signed.digests)} files, more than an adapter has",
            )
        ]
    served = {f.path: f.sha256 for f in manifest.files if f.path != BUNDLE_NAME}
    dropped = {f.path: f.sha256 for f in manifest.dropped}
    out: list[Refusal] = []
    for path in sorted(served):
        if path not in signed.digests:
            out.append(Refusal(Reason.model_signature_mismatch, path, "not signed by the bundle"))
    for path, (algorithm, digest) in sorted(signed.digests.items()):
        expected = served.get(path, dropped.get(path))
        if expected is None:
            out.append(
                Refusal(
                    Reason.model_signature_mismatch,
                    path[:200],
                    "signed, but not a file of this artifact",
                )
            )
        elif algorithm != "sha256" or digest != expected:
            out.append(
                Refusal(
                    Reason.model_signature_mismatch,
                    path,
                    f"signed {algorithm[:20]} {digest[:12]} != {expected[:12]}",
                )
            )
    return out
