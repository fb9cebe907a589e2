"""The PEM material a keyring's model signers carry: checked when the keyring is read, so a
key the model-signing library cannot use stops the load instead of every later verification.

Key-based OpenSSF model signing uses EC keys on P-256, P-384 or P-521 only. A bundle names
its key by a hint, the sha256 of the public key's PEM (SubjectPublicKeyInfo); ``key_fingerprint``
is that value, so the identity a record carries is the one the bundle shows.
"""

from __future__ import annotations

import hashlib

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

__all__ = [
    "MAX_CA_CERTIFICATES",
    "SUPPORTED_CURVES",
    "check_ca_certificates",
    "check_ec_public_key",
    "key_fingerprint",
]

SUPPORTED_CURVES = ("secp256r1", "secp384r1", "secp521r1")
MAX_CA_CERTIFICATES = 32


def _ec_public_key(pem: str) -> ec.EllipticCurvePublicKey:
    try:
        key = serialization.load_pem_public_key(pem.encode("ascii"))
    except (ValueError, UnicodeEncodeError, TypeError) as exc:
        raise ValueError(f"public_key is not a PEM public key: {str(exc)[:120]}") from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ValueError("public_key must be an EC key (model signing signs with ECDSA)")
    if key.curve.name not in SUPPORTED_CURVES:
        raise ValueError(f"curve {key.curve.name} is not one of {', '.join(SUPPORTED_CURVES)}")
    return key


def check_ec_public_key(pem: str) -> None:
    """ValueError unless ``pem`` is one EC public key on a curve model signing supports."""
    _ec_public_key(pem)


def check_ca_certificates(pem: str) -> None:
    """ValueError unless ``pem`` holds 1 to MAX_CA_CERTIFICATES X.509 certificates."""
    try:
        certificates = x509.load_pem_x509_certificates(pem.encode("ascii"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise ValueError(f"ca_certificates is not PEM certificates: {str(exc)[:120]}") from None
    if not 1 <= len(certificates) <= MAX_CA_CERTIFICATES:
        raise ValueError(
            f"ca_certificates holds {len(certificates)} certificates; "
            f"1 to {MAX_CA_CERTIFICATES} allowed"
        )


def key_fingerprint(pem: str) -> str:
    """``sha256:<hex>`` of the key's canonical PEM, as a model-signing bundle's key hint."""
    canonical = _ec_public_key(pem).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "sha256:" + hashlib.sha256(canonical).hexdigest()
