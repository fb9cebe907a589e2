"""OpenSSF model signing, with the real ``model-signing`` library: an adapter folder signed
the way a trainer signs it is published with its bundle and signer in the record, and a
worker verifies the same bundle before installing; every attack is refused with its reason,
at publish and at the worker (loraplane/artifact/model_signature.py).

The attacks: a byte changed after signing, a file added, the bundle of other files, a key
the keyring does not trust, a trusted key of another tenant, a revoked signer, a tenant that
requires signatures publishing without one, a record that names another signer or bundle.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from loraplane.artifact import model_signing_bundle
from loraplane.artifact.directory import DirectoryArtifact
from loraplane.artifact.model_signature import (
    Signed,
    SignedFiles,
    Unsigned,
    check_model_signature,
    coverage_refusals,
)
from loraplane.artifact.model_signing_bundle import SignatureCheck, check_folder
from loraplane.artifact.refusal import ArtifactError as Refused
from loraplane.artifact.verification import (
    BUNDLE_NAME,
    CONFIG_NAME,
    MANIFEST_NAME,
    WEIGHTS_NAME,
    WorkerLimits,
    record_size_bytes,
    verify_artifact,
)
from loraplane.artifact_publish import (
    ArtifactError,
    PublishRequest,
    SigningUnavailable,
    build_record,
)
from loraplane.schemas.adapter import AdapterRecord, Priority
from loraplane.schemas.keyring import Keyring, ModelSignerEntry, TenantPolicy, parse_keyring
from loraplane.schemas.manifest import DroppedFile, InertKind, Manifest, ManifestFile
from loraplane.schemas.pem import key_fingerprint
from loraplane.schemas.reasons import ArtifactReason as Reason
from loraplane.tiny_model import TINY_BASE_MODEL, build_adapter
from tests.model_signing_kit import (
    MODEL_SIGNING_REASONS,
    EcKey,
    certificate_entry,
    certificate_signer,
    ec_key,
    key_signer,
    sign_with_certificate,
    sign_with_key,
)

BUCKET = "loraplane-artifacts"
LIMITS = WorkerLimits(base_model=TINY_BASE_MODEL, max_lora_rank=8)
README = "# Model card\n\nWritten by PEFT's save_pretrained.\n"


def trainer_folder(tmp: Path, name: str, seed: int = 1) -> Path:
    """What PEFT's save_pretrained leaves: the adapter, its config and a model card."""
    folder = build_adapter(tmp / name, seed=seed)
    (folder / "README.md").write_text(README)
    return folder


def request(tenant: str = "acme") -> PublishRequest:
    return PublishRequest("chat", tenant, TINY_BASE_MODEL, "1", Priority.silver)


def publish(
    folder: Path, keyring: Keyring | None, tenant: str = "acme"
) -> tuple[AdapterRecord, Manifest]:
    return build_record(folder, request(tenant), BUCKET, keyring=keyring)


def refused_reasons(folder: Path, keyring: Keyring | None, tenant: str = "acme") -> str:
    with pytest.raises(ArtifactError) as refused:
        publish(folder, keyring, tenant)
    return str(refused.value)


def uploaded(folder: Path, manifest: Manifest, dest: Path) -> Path:
    """The artifact as a worker fetches it: the manifest's files and manifest.json."""
    dest.mkdir(parents=True)
    for f in manifest.files:
        shutil.copyfile(folder / f.path, dest / f.path)
    (dest / MANIFEST_NAME).write_bytes(manifest.canonical_bytes())
    return dest


def at_worker(copy: Path, record: AdapterRecord, keyring: Keyring | None) -> None:
    """What the host tier does before installing: the content, then the bundle."""
    verdict = verify_artifact(DirectoryArtifact(copy), LIMITS, record)
    if not verdict.ok:
        raise Refused(verdict.refusals)
    manifest = Manifest.model_validate_json((copy / MANIFEST_NAME).read_bytes())
    SignatureCheck(lambda: keyring)(copy, manifest, record)


def worker_reasons(
    copy: Path, record: AdapterRecord, keyring: Keyring | None
) -> tuple[Reason, ...]:
    with pytest.raises(Refused) as refused:
        at_worker(copy, record, keyring)
    return refused.value.reasons


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, EcKey]:
    folder = tmp_path_factory.mktemp("keys")
    return {name: ec_key(folder, name) for name in ("acme", "globex", "stranger", "old")}


@pytest.fixture(scope="module")
def keyring(keys: dict[str, EcKey]) -> Keyring:
    return Keyring(
        model_signers=[
            key_signer("acme-models", ["acme"], keys["acme"]),
            key_signer("globex-models", ["globex"], keys["globex"]),
            key_signer("acme-old", ["acme"], keys["old"], revoked=True),
        ]
    )


@pytest.fixture()
def signed(tmp_path: Path, keys: dict[str, EcKey]) -> Path:
    folder = trainer_folder(tmp_path, "adapter")
    sign_with_key(folder, keys["acme"])
    return folder


def test_a_signed_peft_folder_publishes_with_its_signer_and_loads(
    signed: Path, keyring: Keyring, keys: dict[str, EcKey], tmp_path: Path
) -> None:
    record, manifest = publish(signed, keyring)
    bundle = manifest.file(BUNDLE_NAME)
    assert bundle is not None and record.model_signature is not None
    assert record.model_signature.bundle_sha256 == bundle.sha256
    assert record.model_signature.signer_id == "acme-models"
    assert record.model_signature.identity == key_fingerprint(keys["acme"].public_pem)
    # The bundle's key hint is that identity: the record names the key the bundle names.
    hint = json.loads((signed / BUNDLE_NAME).read_text())["verificationMaterial"]["publicKey"]
    assert record.model_signature.identity == f"sha256:{hint['hint']}"
    assert [f.path for f in manifest.files] == ["adapter_config.json", WEIGHTS_NAME, BUNDLE_NAME]
    assert [f.path for f in manifest.dropped] == ["README.md"]  # signed, dropped, compared
    at_worker(uploaded(signed, manifest, tmp_path / "worker"), record, keyring)


def test_a_bundle_that_left_the_model_card_out_also_verifies(
    tmp_path: Path, keys: dict[str, EcKey], keyring: Keyring
) -> None:
    folder = trainer_folder(tmp_path, "adapter")
    sign_with_key(folder, keys["acme"], ignore=("README.md",))
    record, manifest = publish(folder, keyring)
    at_worker(uploaded(folder, manifest, tmp_path / "worker"), record, keyring)


def test_certificate_signing_verifies_with_the_ca_and_the_one_subject(tmp_path: Path) -> None:
    ca = certificate_signer(tmp_path / "pki", "acme-release")
    folder = trainer_folder(tmp_path, "adapter")
    sign_with_certificate(folder, ca)
    ring = Keyring(model_signers=[certificate_entry("acme-ca", ["acme"], ca)])
    record, manifest = publish(folder, ring)
    assert record.model_signature is not None
    assert record.model_signature.identity == ca.subject == "O=Acme,CN=acme-release"
    at_worker(uploaded(folder, manifest, tmp_path / "worker"), record, ring)
    # The same CA vouches only for that subject: a sibling certificate signs nothing.
    other = Keyring(
        model_signers=[certificate_entry("acme-ca", ["acme"], ca, subject="O=Acme,CN=someone-else")]
    )
    assert "model_signature_invalid model.sig" in refused_reasons(folder, other)
    # ... and only with its own anchors: another CA's certificates do not chain.
    stranger = certificate_signer(tmp_path / "pki2", "acme-release")
    assert "model_signature_invalid" in refused_reasons(
        folder, Keyring(model_signers=[certificate_entry("acme-ca", ["acme"], stranger)])
    )


# ---- refused at publish ------------------------------------------------------------------
def test_a_byte_changed_after_signing_is_refused(signed: Path, keyring: Keyring) -> None:
    weights = signed / WEIGHTS_NAME
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # a weight's last byte: still a valid safetensors file
    weights.write_bytes(bytes(data))
    message = refused_reasons(signed, keyring)
    assert f"model_signature_mismatch {WEIGHTS_NAME} (signed sha256" in message


def test_a_file_added_after_signing_is_refused(signed: Path, keyring: Keyring) -> None:
    shutil.copyfile(signed / WEIGHTS_NAME, signed / "adapter_model_extra.safetensors")
    assert "disallowed_file adapter_model_extra.safetensors" in refused_reasons(signed, keyring)


def test_a_served_file_the_bundle_does_not_sign_is_refused(
    tmp_path: Path, keys: dict[str, EcKey], keyring: Keyring
) -> None:
    folder = trainer_folder(tmp_path, "adapter")
    sign_with_key(folder, keys["acme"], ignore=(CONFIG_NAME,))
    assert f"model_signature_mismatch {CONFIG_NAME} (not signed by the bundle)" in (
        refused_reasons(folder, keyring)
    )


def test_a_model_card_changed_after_signing_is_refused(signed: Path, keyring: Keyring) -> None:
    """Dropped at publish, but signed: its digest in the manifest must be the signed one."""
    (signed / "README.md").write_text(README + "edited\n")
    assert "model_signature_mismatch README.md" in refused_reasons(signed, keyring)


def test_the_bundle_of_other_files_is_refused(
    signed: Path, tmp_path: Path, keys: dict[str, EcKey], keyring: Keyring
) -> None:
    other = trainer_folder(tmp_path, "other", seed=2)
    (other / "notes.txt").write_text("signed, never published\n")
    sign_with_key(other, keys["acme"])
    shutil.copyfile(other / BUNDLE_NAME, signed / BUNDLE_NAME)
    message = refused_reasons(signed, keyring)
    assert f"model_signature_mismatch {WEIGHTS_NAME}" in message
    assert "model_signature_mismatch notes.txt (signed, but not a file of this artifact)" in message


def test_a_key_the_keyring_does_not_trust_is_refused(
    tmp_path: Path, keys: dict[str, EcKey], keyring: Keyring
) -> None:
    folder = trainer_folder(tmp_path, "adapter")
    sign_with_key(folder, keys["stranger"])
    message = refused_reasons(folder, keyring)
    assert "model_signature_invalid model.sig (no trusted key verifies it: acme-models:" in message


def test_a_valid_key_of_another_tenant_is_refused(
    tmp_path: Path, keys: dict[str, EcKey], keyring: Keyring
) -> None:
    folder = trainer_folder(tmp_path, "adapter")
    sign_with_key(folder, keys["globex"])
    assert (
        "model_signer_out_of_scope model.sig (signed by globex-models, which may not "
        "sign acme's adapters)"
    ) in refused_reasons(folder, keyring)
    record, _ = publish(folder, keyring, tenant="globex")  # its own tenant's, it may sign
    assert record.model_signature is not None
    assert record.model_signature.signer_id == "globex-models"


def test_a_revoked_signer_is_refused(
    tmp_path: Path, keys: dict[str, EcKey], keyring: Keyring
) -> None:
    folder = trainer_folder(tmp_path, "adapter")
    sign_with_key(folder, keys["old"])
    assert (
        "model_signer_revoked model.sig (signed by acme-old, which is revoked)"
        in refused_reasons(folder, keyring)
    )


def test_a_tenant_that_requires_signing_publishes_nothing_unsigned(
    tmp_path: Path, keyring: Keyring
) -> None:
    strict = keyring.model_copy(
        update={"tenants": {"acme": TenantPolicy(require_model_signature=True)}}
    )
    folder = trainer_folder(tmp_path, "adapter")
    assert "model_signature_required model.sig" in refused_reasons(folder, strict)
    record, _ = publish(folder, strict, tenant="initech")  # other tenants: as before
    assert record.model_signature is None


def test_a_bundle_needs_a_keyring(signed: Path) -> None:
    assert "model_signature_invalid model.sig (no readable keyring" in refused_reasons(signed, None)


def test_an_unsigned_folder_publishes_as_before(tmp_path: Path, keyring: Keyring) -> None:
    record, manifest = publish(trainer_folder(tmp_path, "adapter"), keyring)
    assert record.model_signature is None and manifest.file(BUNDLE_NAME) is None
    assert "model_signature" not in record.model_dump(mode="json")


def test_without_the_library_a_signed_folder_says_which_extra(
    signed: Path, keyring: Keyring, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record, manifest = publish(signed, keyring)
    copy = uploaded(signed, manifest, tmp_path / "worker")

    def missing() -> Any:
        raise ImportError("No module named 'model_signing'")

    monkeypatch.setattr(model_signing_bundle, "_library", missing)
    assert not model_signing_bundle.signing_installed()
    with pytest.raises(SigningUnavailable, match=r"pip install 'loraplane\[signing\]'"):
        publish(signed, keyring)
    with pytest.raises(Refused) as failed:
        at_worker(copy, record, keyring)
    assert failed.value.reasons == (Reason.model_signing_unavailable,)
    assert failed.value.is_failure  # retried once the library is there
    publish(trainer_folder(tmp_path, "plain"), keyring)  # unsigned folders need no library


# ---- refused at the worker: bytes or trust changed after publish -------------------------
def republished(folder: Path, record: AdapterRecord, dest: Path) -> tuple[Path, AdapterRecord]:
    """A forged publish: the folder's bytes as they are now, under a manifest and record
    that describe them faithfully (as a stolen CI key could sign), keeping the record's
    model_signature claim unless the bundle changed."""
    listing = DirectoryArtifact(folder)
    manifest = Manifest(
        files=[
            ManifestFile(path=f.path, sha256=listing.sha256(f.path), size=f.size)
            for f in listing.files()
            if f.path not in ("README.md", MANIFEST_NAME)
        ],
        dropped=[
            DroppedFile(
                path="README.md",
                sha256=listing.sha256("README.md"),
                size=(folder / "README.md").stat().st_size,
                kind=InertKind.model_card,
            )
        ],
    )
    signature = record.model_signature
    if signature is not None:
        signature = signature.model_copy(update={"bundle_sha256": listing.sha256(BUNDLE_NAME)})
    forged = record.model_copy(
        update={
            "sha256": manifest.digest,
            "size_bytes": record_size_bytes(manifest),
            "model_signature": signature,
        }
    )
    return uploaded(folder, manifest, dest), forged


def test_the_worker_refuses_bytes_changed_under_a_forged_record(
    signed: Path, keyring: Keyring, tmp_path: Path
) -> None:
    record, _ = publish(signed, keyring)
    data = bytearray((signed / WEIGHTS_NAME).read_bytes())
    data[-1] ^= 0x01
    (signed / WEIGHTS_NAME).write_bytes(bytes(data))
    copy, forged = republished(signed, record, tmp_path / "worker")
    assert worker_reasons(copy, forged, keyring) == (Reason.model_signature_mismatch,)


def test_the_worker_refuses_a_file_added_under_a_forged_record(
    signed: Path, keyring: Keyring, tmp_path: Path
) -> None:
    record, _ = publish(signed, keyring)
    # A safetensors file without tensors: no file vLLM never reads passes the content checks.
    header = b'{"__metadata__":{}}'
    (signed / "extra.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    copy, forged = republished(signed, record, tmp_path / "worker")
    assert worker_reasons(copy, forged, keyring) == (Reason.disallowed_file,)


def test_the_worker_refuses_a_served_file_left_unsigned_under_a_forged_record(
    signed: Path, keyring: Keyring, tmp_path: Path, keys: dict[str, EcKey]
) -> None:
    record, _ = publish(signed, keyring)
    # The bundle signed again without the config: the content checks pass it, the bundle
    # does not sign all that is served.
    sign_with_key(signed, keys["acme"], ignore=(CONFIG_NAME,))
    copy, forged = republished(signed, record, tmp_path / "worker")
    assert verify_artifact(DirectoryArtifact(copy), LIMITS, forged).ok
    assert worker_reasons(copy, forged, keyring) == (Reason.model_signature_mismatch,)


def test_the_worker_refuses_another_tenants_key_and_an_untrusted_one(
    tmp_path: Path, keys: dict[str, EcKey], keyring: Keyring
) -> None:
    for signer, reason in (
        ("globex", Reason.model_signer_out_of_scope),
        ("stranger", Reason.model_signature_invalid),
    ):
        folder = trainer_folder(tmp_path, f"by-{signer}")
        sign_with_key(folder, keys[signer])
        # Published where the publisher trusts the key for acme (its own keyring lied)...
        lax = Keyring(model_signers=[key_signer("acme-models", ["acme"], keys[signer])])
        record, manifest = publish(folder, lax)
        # ... and refused by the worker, whose keyring binds the key to another tenant or
        # does not know it.
        copy = uploaded(folder, manifest, tmp_path / f"worker-{signer}")
        assert worker_reasons(copy, record, keyring) == (reason,)


def test_the_worker_refuses_a_signer_revoked_after_publish(
    signed: Path, keys: dict[str, EcKey], keyring: Keyring, tmp_path: Path
) -> None:
    record, manifest = publish(signed, keyring)
    copy = uploaded(signed, manifest, tmp_path / "worker")
    revoked = keyring.model_copy(
        update={"model_signers": [key_signer("acme-models", ["acme"], keys["acme"], revoked=True)]}
    )
    assert worker_reasons(copy, record, revoked) == (Reason.model_signer_revoked,)


def test_the_worker_refuses_an_unsigned_record_of_a_tenant_that_requires_one(
    tmp_path: Path, keyring: Keyring
) -> None:
    folder = trainer_folder(tmp_path, "adapter")
    record, manifest = publish(folder, keyring)
    strict = keyring.model_copy(
        update={"tenants": {"acme": TenantPolicy(require_model_signature=True)}}
    )
    copy = uploaded(folder, manifest, tmp_path / "worker")
    assert worker_reasons(copy, record, strict) == (Reason.model_signature_required,)


def test_the_worker_refuses_a_record_that_names_another_signer_or_no_bundle(
    signed: Path, keyring: Keyring, tmp_path: Path
) -> None:
    record, manifest = publish(signed, keyring)
    assert record.model_signature is not None
    copy = uploaded(signed, manifest, tmp_path / "worker")
    other = record.model_copy(
        update={
            "model_signature": record.model_signature.model_copy(
                update={"signer_id": "globex-models"}
            )
        }
    )
    assert worker_reasons(copy, other, keyring) == (Reason.record_mismatch,)
    unnamed = record.model_copy(update={"model_signature": None})
    assert worker_reasons(copy, unnamed, keyring) == (Reason.record_mismatch,)


def test_the_worker_refuses_without_a_keyring(
    signed: Path, keyring: Keyring, tmp_path: Path
) -> None:
    record, manifest = publish(signed, keyring)
    copy = uploaded(signed, manifest, tmp_path / "worker")
    assert worker_reasons(copy, record, None) == (Reason.model_signature_invalid,)


def test_every_model_signing_reason_has_a_case_here() -> None:
    cases = {
        Reason.model_signature_required,
        Reason.model_signature_invalid,
        Reason.model_signer_out_of_scope,
        Reason.model_signer_revoked,
        Reason.model_signature_mismatch,
        Reason.model_signing_unavailable,
    }
    assert cases == MODEL_SIGNING_REASONS
    assert {r for r in Reason if r.value.startswith("model_sign")} == MODEL_SIGNING_REASONS


# ---- hostile bundles and the pure comparison ---------------------------------------------
HOSTILE_BUNDLES = st.one_of(
    st.binary(max_size=2048),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=20),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(
                st.sampled_from(
                    [
                        "mediaType",
                        "verificationMaterial",
                        "dsseEnvelope",
                        "publicKey",
                        "payload",
                        "signatures",
                        "hint",
                        "x",
                    ]
                ),
                inner,
                max_size=4,
            )
        ),
        max_leaves=12,
    ).map(lambda v: json.dumps(v).encode()),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=HOSTILE_BUNDLES)
def test_a_hostile_bundle_is_refused_never_raised(
    data: bytes, keyring: Keyring, tmp_path: Path
) -> None:
    folder = tmp_path / "hostile"
    folder.mkdir(exist_ok=True)
    (folder / BUNDLE_NAME).write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()  # the bytes pinned: the parser meets them
    manifest = Manifest(files=[ManifestFile(path=BUNDLE_NAME, sha256=digest, size=len(data))])
    outcome = check_folder(folder, manifest, "acme", keyring)
    assert isinstance(outcome, tuple)
    assert {r.reason for r in outcome} == {Reason.model_signature_invalid}


def test_a_bundle_over_the_limit_is_not_parsed(tmp_path: Path, keyring: Keyring) -> None:
    (tmp_path / BUNDLE_NAME).write_bytes(b" " * (1024 * 1024 + 1))
    manifest = Manifest(files=[ManifestFile(path=BUNDLE_NAME, sha256="0" * 64, size=1)])
    outcome = check_folder(tmp_path, manifest, "acme", keyring)
    assert isinstance(outcome, tuple) and "over 1048576 bytes" in outcome[0].detail


FILE_NAMES = st.sampled_from(
    [
        "adapter_config.json",
        "adapter_model.safetensors",
        "extra.safetensors",
        "README.md",
        "notes.txt",
    ]
)
DIGESTS = st.sampled_from(["a" * 64, "b" * 64])


@given(
    served=st.dictionaries(FILE_NAMES, DIGESTS, min_size=1),
    dropped=st.dictionaries(FILE_NAMES, DIGESTS),
    signed=st.dictionaries(FILE_NAMES, DIGESTS),
)
def test_coverage_refuses_exactly_what_differs(
    served: dict[str, str], dropped: dict[str, str], signed: dict[str, str]
) -> None:
    dropped = {p: d for p, d in dropped.items() if p not in served}
    manifest = Manifest(
        files=[ManifestFile(path=p, sha256=d, size=1) for p, d in served.items()],
        dropped=[
            DroppedFile(path=p, sha256=d, size=1, kind=InertKind.model_card)
            for p, d in dropped.items()
        ],
    )
    refusals = coverage_refusals(
        SignedFiles("files", "sha256", {p: ("sha256", d) for p, d in signed.items()}), manifest
    )
    unsigned = set(served) - set(signed)
    wrong = {p for p, d in signed.items() if {**dropped, **served}.get(p) != d}
    assert {r.path for r in refusals} == unsigned | wrong
    assert all(r.reason is Reason.model_signature_mismatch for r in refusals)


def test_only_per_file_sha256_compares_with_the_manifest() -> None:
    manifest = Manifest(files=[ManifestFile(path="a.safetensors", sha256="a" * 64, size=1)])
    for method, hash_type in (("shards", "sha256"), ("files", "blake3")):
        [refusal] = coverage_refusals(SignedFiles(method, hash_type, {}), manifest)
        assert refusal.reason is Reason.model_signature_invalid


def test_the_check_is_pure_given_a_verifier(keys: dict[str, EcKey]) -> None:
    """Which signer vouches is decided without any library: the verifier is handed in."""
    manifest = Manifest(
        files=[
            ManifestFile(path="a.safetensors", sha256="a" * 64, size=1),
            ManifestFile(path=BUNDLE_NAME, sha256="c" * 64, size=1),
        ]
    )
    ring = Keyring(model_signers=[key_signer("one", "*", keys["acme"])])
    outcome = check_model_signature(
        manifest,
        "anyone",
        ring,
        lambda _entry: SignedFiles("files", "sha256", {"a.safetensors": ("sha256", "a" * 64)}),
    )
    assert isinstance(outcome, Signed) and outcome.signature.signer_id == "one"
    assert isinstance(
        check_model_signature(Manifest(files=manifest.files[:1]), "anyone", ring, None), Unsigned
    )


# ---- the keyring's model signers and the record ------------------------------------------
def test_keyring_model_signers_round_trip_and_are_validated(
    keys: dict[str, EcKey], tmp_path: Path
) -> None:
    ca = certificate_signer(tmp_path, "acme-release")
    ring = Keyring(
        model_signers=[
            key_signer("acme-models", ["acme"], keys["acme"]),
            certificate_entry("acme-ca", ["acme"], ca),
        ],
        tenants={"acme": TenantPolicy(require_model_signature=True)},
    )
    again = parse_keyring(ring.to_yaml())
    assert again == ring and again.requires_model_signature("acme")
    assert not again.requires_model_signature("globex")
    assert again.max_priority("acme") is Priority.gold  # no ceiling given: the default
    pem = keys["acme"].public_pem
    bad: list[dict[str, Any]] = [
        {"public_key": pem, "ca_certificates": ca.ca_pem, "certificate_subject": "CN=x"},
        {},
        {"public_key": "not a key"},
        {"ca_certificates": ca.ca_pem},  # no subject: any certificate of the CA would do
        {"public_key": pem, "certificate_subject": "CN=x"},
        {"public_key": ec_key(tmp_path, "k1", _secp256k1()).public_pem},  # unsupported curve
        {"public_key": _ed25519_pem()},  # not ECDSA
    ]
    for fields in bad:
        with pytest.raises(ValidationError):
            ModelSignerEntry.model_validate({"signer_id": "s", "tenants": ["acme"], **fields})
    with pytest.raises(ValidationError, match="duplicate signer_id"):
        Keyring(
            model_signers=[
                key_signer("same", ["acme"], keys["acme"]),
                key_signer("same", ["globex"], keys["globex"]),
            ]
        )


def _secp256k1() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.SECP256K1()


def _ed25519_pem() -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return (
        Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


def test_records_without_a_model_signature_keep_their_bytes(signed: Path, keyring: Keyring) -> None:
    """Old records decode, and their canonical bytes (what lifecycle events sign) are
    unchanged: the field is left out when absent."""
    record, _ = publish(signed, keyring)
    old = record.model_dump(mode="json")
    del old["model_signature"]
    decoded = AdapterRecord.model_validate_json(json.dumps(old))
    assert decoded.model_signature is None
    assert json.loads(decoded.model_dump_json()) == old
    assert AdapterRecord.model_validate_json(record.model_dump_json()) == record


def test_keys_cli_trusts_revokes_and_requires_model_signers(
    tmp_path: Path, keys: dict[str, EcKey]
) -> None:
    from typer.testing import CliRunner

    from loraplane.cli import app
    from loraplane.schemas.keyring import load_keyring

    path = tmp_path / "keyring.yaml"
    pem = tmp_path / "acme.pub"
    pem.write_text(keys["acme"].public_pem)
    runner = CliRunner()
    done = runner.invoke(
        app,
        [
            "keys",
            "model-signer",
            "--keyring",
            str(path),
            "--signer-id",
            "acme-models",
            "--tenant",
            "acme",
            "--public-key",
            str(pem),
        ],
    )
    assert done.exit_code == 0, done.output
    assert key_fingerprint(keys["acme"].public_pem) in done.output
    done = runner.invoke(
        app,
        [
            "keys",
            "tenant",
            "--keyring",
            str(path),
            "--tenant",
            "acme",
            "--max-priority",
            "platinum",
        ],
    )
    done = runner.invoke(
        app,
        ["keys", "tenant", "--keyring", str(path), "--tenant", "acme", "--require-model-signature"],
    )
    assert (
        done.exit_code == 0 and "max_priority platinum, model signature required" in done.output
    )  # the ceiling set before is kept
    ring = load_keyring(path)
    assert ring.requires_model_signature("acme")
    assert ring.max_priority("acme") is Priority.platinum
    assert [s.signer_id for s in ring.model_signers] == ["acme-models"]
    done = runner.invoke(
        app,
        [
            "keys",
            "model-signer",
            "--keyring",
            str(path),
            "--signer-id",
            "acme-models",
            "--tenant",
            "acme",
            "--revoke",
        ],
    )
    assert done.exit_code == 0 and "acme-models: revoked" in done.output
    assert load_keyring(path).model_signers[0].revoked
    not_ec = tmp_path / "ed25519.pub"
    not_ec.write_text(_ed25519_pem())
    done = runner.invoke(
        app,
        [
            "keys",
            "model-signer",
            "--keyring",
            str(path),
            "--signer-id",
            "bad",
            "--tenant",
            "acme",
            "--public-key",
            str(not_ec),
        ],
    )
    assert done.exit_code == 1 and "must be an EC key" in done.output


def test_artifact_verify_checks_the_bundle_for_a_tenant(
    signed: Path,
    keyring: Keyring,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    from typer.testing import CliRunner

    from loraplane.cli import app
    from loraplane.kernel.config import get_settings
    from loraplane.schemas.keyring import save_keyring

    path = tmp_path / "keyring.yaml"
    save_keyring(keyring, path)
    monkeypatch.setenv("LORAPLANE_KEYRING_PATH", str(path))
    get_settings.cache_clear()  # the CLI's settings: read again with this keyring
    request.addfinalizer(get_settings.cache_clear)
    runner = CliRunner()
    done = runner.invoke(app, ["artifact", "verify", str(signed), "--tenant", "acme"])
    assert done.exit_code == 0, done.output
    done = runner.invoke(app, ["artifact", "verify", str(signed), "--tenant", "globex"])
    assert done.exit_code == 1 and "model_signer_out_of_scope model.sig" in done.output
    _, manifest = publish(signed, keyring)
    copy = uploaded(signed, manifest, tmp_path / "worker")
    flip = bytearray((copy / BUNDLE_NAME).read_bytes())
    done = runner.invoke(app, ["artifact", "verify", str(copy), "--tenant", "acme"])
    assert done.exit_code == 0, done.output
    flip[len(flip) // 2] ^= 0x01  # the bundle the manifest pins is no longer the one here
    (copy / BUNDLE_NAME).write_bytes(bytes(flip))
    done = runner.invoke(app, ["artifact", "verify", str(copy), "--tenant", "acme"])
    assert done.exit_code == 1 and done.output == "sha256_mismatch model.sig\n"


class FolderFetcher:
    """The S3 fetch's stand-in: a published folder's manifest files, by artifact URI."""

    def __init__(self, sources: dict[str, tuple[Path, Manifest]]) -> None:
        self.sources = sources

    def fetch(
        self,
        artifact_uri: str,
        dest: Path,
        *,
        expected_sha256: str | None,
        max_total_bytes: int,
        owner: AdapterRecord | None,
    ) -> Any:
        from loraplane.workers.artifact_fetch import FetchedArtifact

        folder, manifest = self.sources[artifact_uri]
        uploaded(folder, manifest, dest)
        return FetchedArtifact(dest, manifest, {}, manifest.total_size, 0.0)

    def stop(self) -> None:
        """A copy has no chunk to stop at: it ends by itself."""


def test_the_host_tier_checks_bundles_at_install_and_in_its_startup_scan(
    signed: Path, keys: dict[str, EcKey], keyring: Keyring, tmp_path: Path
) -> None:
    from loraplane.workers.host_tier import HostTier

    record, manifest = publish(signed, keyring)
    fetcher = FolderFetcher({record.artifact_uri: (signed, manifest)})
    current: list[Keyring | None] = [keyring]

    def tier() -> HostTier:
        return HostTier(
            tmp_path / "tier",
            budget_bytes=10**8,
            limits=LIMITS,
            fetcher=fetcher,
            check_signature=SignatureCheck(lambda: current[0]),
        )

    path = tier().ensure(record)
    assert (path / BUNDLE_NAME).is_file()
    assert tier().startup_report.kept == (record.lora_name,)  # re-verified, kept
    current[0] = keyring.model_copy(
        update={"model_signers": [key_signer("acme-models", ["acme"], keys["acme"], revoked=True)]}
    )
    report = tier().startup_report  # revoked since: the next start drops it
    assert report.dropped == ((record.lora_name, "model_signer_revoked"),)
    with pytest.raises(Refused) as refused:
        tier().ensure(record)
    assert refused.value.reasons == (Reason.model_signer_revoked,)
    assert not list((tmp_path / "tier").glob(".partial-*"))
    # A tier built without a keyring (the default) refuses signed records, loads others.
    bare = HostTier(tmp_path / "bare", budget_bytes=10**8, limits=LIMITS, fetcher=fetcher)
    with pytest.raises(Refused) as refused:
        bare.ensure(record)
    assert refused.value.reasons == (Reason.model_signature_invalid,)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("swap", ["fifo", "link to /dev/zero", "link to a bundle"])
def test_attack_a_bundle_swapped_for_a_special_file_is_refused_unread(
    signed: Path, keyring: Keyring, tmp_path: Path, swap: str
) -> None:
    """ATTACK: whoever writes the folder being published swaps ``model.sig``, after the
    listing, for a FIFO (the library's ``read_text`` waited on it for good: publish hung),
    a link to ``/dev/zero`` (its size 0 passed the size check, then it was read until
    memory ran out) or a link to a genuine bundle. The bundle is read once, as a regular
    file of at most 1 MiB, without following a link or waiting."""
    from loraplane.artifact.model_signature import BundleRejected
    from loraplane.artifact.model_signing_bundle import bundle_verifier

    real = tmp_path / "real.sig"
    shutil.copyfile(signed / BUNDLE_NAME, real)
    bundle = signed / BUNDLE_NAME
    bundle.unlink()
    if swap == "fifo":
        os.mkfifo(bundle)
    elif swap == "link to /dev/zero":
        bundle.symlink_to("/dev/zero")
    else:
        bundle.symlink_to(real)
    verify = bundle_verifier(bundle)
    assert verify is not None
    with pytest.raises(BundleRejected, match="cannot be read"):
        verify(keyring.model_signers[0])


def test_attack_a_bundle_changed_since_it_was_hashed_is_refused(
    signed: Path, keyring: Keyring, tmp_path: Path, keys: dict[str, EcKey]
) -> None:
    """The bundle verified is the one the manifest pins: a genuine bundle swapped in after
    the manifest hashed another is refused, not verified in its stead."""
    from loraplane.artifact.model_signature import BundleRejected
    from loraplane.artifact.model_signing_bundle import bundle_verifier

    verify = bundle_verifier(signed / BUNDLE_NAME, sha256="0" * 64)
    assert verify is not None
    with pytest.raises(BundleRejected, match="not the bytes the manifest pins"):
        verify(keyring.model_signers[0])
