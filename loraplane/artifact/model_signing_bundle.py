"""Runs the OpenSSF ``model-signing`` library on a bundle file, for the pure check in
loraplane.artifact.model_signature, at publish and on a worker before the bytes are used.

The library (``pip install 'loraplane[signing]'``) verifies the bundle's signature with one
keyring signer, a public key or a certificate chain, offline, and returns the manifest it
signed; comparing that manifest with the artifact is ours, so PEFT's model card, dropped at
publish and never on a worker, is compared by the digest the signed manifest recorded. The
library's high-level ``verify(model_path, signature_path)`` re-hashes a folder instead,
which a worker without the dropped files cannot do; its verifier classes are used directly
(pinned to model-signing 1.1.x in pyproject; tests/unit/test_model_signing.py signs and
verifies with the real library).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from loraplane.artifact.model_signature import (
    BundleRejected,
    Outcome,
    SignedFiles,
    VerifyWith,
    check_model_signature,
)
from loraplane.artifact.refusal import ArtifactError
from loraplane.artifact.verification import BUNDLE_NAME, MAX_BUNDLE_BYTES
from loraplane.kernel.local_files import read_regular
from loraplane.schemas.adapter import AdapterRecord
from loraplane.schemas.keyring import Keyring, ModelSignerEntry
from loraplane.schemas.manifest import Manifest

__all__ = [
    "SIGNING_EXTRA",
    "SignatureCheck",
    "bundle_verifier",
    "check_folder",
    "signing_installed",
]

SIGNING_EXTRA = "loraplane[signing]"


def signing_installed() -> bool:
    """Whether the model-signing library (and the pyOpenSSL its certificate code needs)
    imports here."""
    try:
        _library()
    except ImportError:
        return False
    return True


def _library() -> tuple[Any, Any, Any]:
    from model_signing._signing import sign_certificate, sign_ec_key, sign_sigstore_pb

    return sign_sigstore_pb, sign_ec_key, sign_certificate


def bundle_verifier(bundle: Path, sha256: str | None = None) -> VerifyWith | None:
    """A ``verify_with`` for the bundle file ``bundle``; None without the library. A bundle
    that is not one (too large, not JSON, not a Sigstore bundle) is rejected by every
    signer, with the reason. It is read once, as a regular file of at most
    ``MAX_BUNDLE_BYTES``, never through a link nor waiting on a FIFO (``read_regular``);
    given ``sha256`` (the manifest's), those bytes must be the ones it pins. The library
    parses a private copy of them: its own read opens a path as it finds it."""
    try:
        sigstore_pb, ec_key, certificate = _library()
    except ImportError:
        return None
    try:
        data = read_regular(bundle, MAX_BUNDLE_BYTES, follow_links=False)
    except OSError as exc:
        return _always(BundleRejected(f"cannot be read: {exc.strerror or exc}"))
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        return _always(BundleRejected("its bytes are not the bytes the manifest pins"))
    try:
        with _private_file(data, BUNDLE_NAME) as copy:
            signature = sigstore_pb.Signature.read(copy)
    except Exception as exc:  # a hostile bundle: any error of the parser is a refusal
        return _always(
            BundleRejected(f"not a model-signing bundle: {type(exc).__name__}: {str(exc)[:160]}")
        )

    def verify(entry: ModelSignerEntry) -> SignedFiles:
        with (
            _pem_file(entry.public_key or entry.ca_certificates or "") as pem,
            contextlib.redirect_stdout(sys.stderr),
        ):  # the library prints warnings
            try:
                if entry.public_key is not None:
                    verifier = ec_key.Verifier(pem)
                else:
                    verifier = certificate.Verifier([pem])
                    _check_subject(signature, entry.certificate_subject or "")
                manifest = verifier.verify(signature)
                return _signed_files(manifest)
            except BundleRejected:
                raise
            except Exception as exc:  # InvalidSignature, ValueError, OpenSSL errors, ...
                raise BundleRejected(f"{type(exc).__name__}: {str(exc)[:200]}") from None

    return verify


def _always(exc: BundleRejected) -> VerifyWith:
    def verify(_entry: ModelSignerEntry) -> SignedFiles:
        raise exc

    return verify


@contextlib.contextmanager
def _private_file(data: bytes, name: str) -> Iterator[Path]:
    """``data`` in a file of a new private folder: the library reads keys, certificates
    and bundles from paths."""
    with tempfile.TemporaryDirectory(prefix="loraplane-signing-") as tmp:
        path = Path(tmp) / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        yield path


def _pem_file(pem: str) -> contextlib.AbstractContextManager[Path]:
    return _private_file(pem.encode(), "trust.pem")


def _check_subject(signature: Any, subject: str) -> None:
    """The signing certificate (first of the bundle's chain) is the one this signer may
    vouch for; the chain to the trust anchors is the library's check."""
    from cryptography import x509

    chain = signature.bundle.verification_material.x509_certificate_chain
    if chain is None or not chain.certificates:
        raise BundleRejected("the bundle carries no signing certificate")
    leaf = x509.load_der_x509_certificate(chain.certificates[0].raw_bytes)
    found = leaf.subject.rfc4514_string()
    if found != subject:
        raise BundleRejected(f"signing certificate subject {found[:200]!r} is not {subject!r}")


def _signed_files(manifest: Any) -> SignedFiles:
    serialization = manifest.serialization_type
    digests = {
        rd.identifier: (rd.digest.algorithm, rd.digest.digest_hex)
        for rd in manifest.resource_descriptors()
    }
    return SignedFiles(
        method=str(serialization.get("method", "")),
        hash_type=str(serialization.get("hash_type", "")),
        digests=digests,
    )


def check_folder(
    folder: Path,
    manifest: Manifest,
    tenant_id: str,
    keyring: Keyring | None,
    record: AdapterRecord | None = None,
) -> Outcome:
    """``check_model_signature`` of an artifact in ``folder`` (files already verified
    against ``manifest``), with the library on ``folder/model.sig``."""
    entry = manifest.file(BUNDLE_NAME)
    verify_with = bundle_verifier(folder / BUNDLE_NAME, entry.sha256) if entry else None
    return check_model_signature(manifest, tenant_id, keyring, verify_with, record)


class SignatureCheck:
    """The worker's check of a verified folder before it is installed: raises ArtifactError
    with the refusals. ``keyring`` is read at each check (the worker's keyring file, which
    reloads when it changes); None when it cannot be read."""

    def __init__(self, keyring: Callable[[], Keyring | None]) -> None:
        self._keyring = keyring

    def __call__(self, folder: Path, manifest: Manifest, record: AdapterRecord) -> None:
        outcome = check_folder(folder, manifest, record.tenant_id, self._keyring(), record)
        if isinstance(outcome, tuple):
            raise ArtifactError(outcome)
