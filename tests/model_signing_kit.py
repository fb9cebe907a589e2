"""Sign adapter folders with the REAL OpenSSF ``model-signing`` library, as a trainer's
pipeline does, and the keyring entries that trust (or do not trust) its keys.

Key-based signing (EC P-256, offline) writes the bundle to ``FOLDER/model.sig`` and leaves it
out of what it signs, like ``model_signing sign key FOLDER --signature FOLDER/model.sig``;
certificate signing uses a throwaway CA and a signing certificate made here.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from loraplane.artifact.verification import BUNDLE_NAME
from loraplane.schemas.keyring import ModelSignerEntry
from loraplane.schemas.reasons import ArtifactReason as Reason

MODEL_SIGNING_REASONS = frozenset(
    {
        Reason.model_signature_required,
        Reason.model_signature_invalid,
        Reason.model_signer_out_of_scope,
        Reason.model_signer_revoked,
        Reason.model_signature_mismatch,
        Reason.model_signing_unavailable,
    }
)
"""Decided by loraplane.artifact.model_signature, each with a case in
tests/unit/test_model_signing.py (the content verifier's corpus does not reach them)."""


@dataclass(frozen=True)
class EcKey:
    private_path: Path  # PEM, mode 0600, as the model_signing CLI reads it
    public_pem: str


def ec_key(folder: Path, name: str, curve: ec.EllipticCurve | None = None) -> EcKey:
    key = ec.generate_private_key(curve or ec.SECP256R1())
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.pem"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return EcKey(path, public.decode("ascii"))


def sign_with_key(folder: Path, key: EcKey, *, ignore: tuple[str, ...] = ()) -> Path:
    """The bundle of ``folder`` signed with ``key`` (sha256 per file, the default)."""
    from model_signing import hashing, signing

    bundle = folder / BUNDLE_NAME
    signing.Config().use_elliptic_key_signer(private_key=key.private_path).set_hashing_config(
        hashing.Config().set_ignored_paths(paths=[BUNDLE_NAME, *ignore])
    ).sign(folder, bundle)
    return bundle


def key_signer(
    signer_id: str, tenants: list[str] | str, key: EcKey, revoked: bool = False
) -> ModelSignerEntry:
    return ModelSignerEntry.model_validate(
        {
            "signer_id": signer_id,
            "tenants": tenants,
            "public_key": key.public_pem,
            "revoked": revoked,
        }
    )


@dataclass(frozen=True)
class CertificateSigner:
    """A CA and one signing certificate it issued, with the signing key, as files."""

    ca_pem: str
    subject: str  # RFC 4514, as the keyring names it
    private_path: Path
    certificate_path: Path
    ca_path: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Acme"),
        ]
    )


def certificate_signer(folder: Path, common_name: str) -> CertificateSigner:
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"{common_name} CA")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    leaf = ec_key(folder, f"{common_name}-leaf")
    leaf_public = serialization.load_pem_public_key(leaf.public_pem.encode())
    assert isinstance(leaf_public, ec.EllipticCurvePublicKey)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_name)
        .public_key(leaf_public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=7))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=False,
                crl_sign=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_pem = ca.public_bytes(serialization.Encoding.PEM).decode("ascii")
    ca_path = folder / f"{common_name}-ca.crt"
    ca_path.write_text(ca_pem)
    certificate_path = folder / f"{common_name}.crt"
    certificate_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return CertificateSigner(
        ca_pem, _name(common_name).rfc4514_string(), leaf.private_path, certificate_path, ca_path
    )


def sign_with_certificate(folder: Path, signer: CertificateSigner) -> Path:
    from model_signing import hashing, signing

    bundle = folder / BUNDLE_NAME
    signing.Config().use_certificate_signer(
        private_key=signer.private_path,
        signing_certificate=signer.certificate_path,
        certificate_chain=[signer.ca_path],
    ).set_hashing_config(hashing.Config().set_ignored_paths(paths=[BUNDLE_NAME])).sign(
        folder, bundle
    )
    return bundle


def certificate_entry(
    signer_id: str, tenants: list[str] | str, signer: CertificateSigner, subject: str | None = None
) -> ModelSignerEntry:
    return ModelSignerEntry.model_validate(
        {
            "signer_id": signer_id,
            "tenants": tenants,
            "ca_certificates": signer.ca_pem,
            "certificate_subject": subject or signer.subject,
        }
    )
