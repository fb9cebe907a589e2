"""Attack tests: ``loraplane publish`` on a hostile adapter folder refuses with a clear,
one-line reason before it reads or uploads anything it should not, and never hangs: a
sparse file of hundreds of GiB, a config of 50 GiB or more files than a manifest holds are
refused from the listing alone (nothing hashed); a name with a newline, an escape sequence
or a bidi control is refused as ``unsafe_path`` and shown escaped; a file swapped for a
link, a FIFO or other bytes after it was verified is never uploaded as verified."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from loraplane.artifact.directory import DirectoryArtifact
from loraplane.artifact.verification import CONFIG_NAME, MANIFEST_NAME, WEIGHTS_NAME
from loraplane.artifact_publish import ArtifactError, upload
from loraplane.kernel.config import Settings
from loraplane.schemas.reasons import ArtifactReason as Reason
from tests.unit.test_peft_artifacts import peft_folder, publish


def _sparse(path: Path, size: int) -> None:
    with path.open("wb") as fh:
        fh.truncate(size)


@pytest.fixture
def unhashed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fails the test on the first file publish hashes: a folder refused from its listing
    has none of its bytes read."""
    hashed: list[str] = []

    def refuse(_self: DirectoryArtifact, path: str) -> str:
        hashed.append(path)
        raise AssertionError(f"{path!r} hashed before the listing's refusal")

    monkeypatch.setattr(DirectoryArtifact, "sha256", refuse)
    return hashed


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("name", "size"),
    [(WEIGHTS_NAME, 200 * 1024**3), (CONFIG_NAME, 50 * 1024**3)],
)
def test_a_sparse_huge_file_is_refused_before_a_byte_is_hashed(
    tmp_path: Path, unhashed: list[str], name: str, size: int
) -> None:
    folder = peft_folder(tmp_path / "peft")
    _sparse(folder / name, size)
    with pytest.raises(ArtifactError) as refused:
        publish(folder)
    assert [r.reason for r in refused.value.refusals] == [Reason.too_large]
    assert unhashed == []


@pytest.mark.timeout(60)
def test_more_files_than_a_manifest_holds_are_refused_before_hashing(
    tmp_path: Path, unhashed: list[str]
) -> None:
    folder = peft_folder(tmp_path / "peft")
    for i in range(100):
        (folder / f"w{i:03d}.safetensors").write_bytes(b"")
    with pytest.raises(ArtifactError, match="files > 64") as refused:
        publish(folder)
    assert {r.reason for r in refused.value.refusals} == {Reason.too_large, Reason.disallowed_file}
    assert unhashed == []


NAMES = [
    "a\n::error::published.safetensors",  # a CI log line of its own (GitHub workflow command)
    "\x1b]0;owned\x07\x1b[2J.safetensors",  # terminal title and clear screen
    "adapter_model\u202egpj.safetensors",  # right-to-left override
    "adapter model.safetensors",
    "a\u2028b.safetensors",
    "\uff41dapter.safetensors",  # fullwidth a: looks like ASCII
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", NAMES)
def test_an_odd_file_name_is_an_unsafe_path_shown_escaped(
    tmp_path: Path, unhashed: list[str], name: str
) -> None:
    folder = peft_folder(tmp_path / "peft")
    (folder / name).write_bytes(b"x")
    with pytest.raises(ArtifactError) as refused:
        publish(folder)
    assert [(r.reason, r.path) for r in refused.value.refusals] == [(Reason.unsafe_path, name)]
    message = str(refused.value)
    assert message.isprintable() and message.startswith("refused: unsafe_path ")
    assert unhashed == []


@pytest.mark.timeout(60)
def test_a_name_that_is_not_utf8_is_refused_escaped(tmp_path: Path) -> None:
    folder = peft_folder(tmp_path / "peft")
    fd = os.open(os.fsencode(folder) + b"/\xff\n.safetensors", os.O_CREAT | os.O_WRONLY)
    os.close(fd)
    with pytest.raises(ArtifactError) as refused:
        publish(folder)
    assert str(refused.value).isprintable()
    assert [r.reason for r in refused.value.refusals] == [Reason.unsafe_path]


@pytest.mark.timeout(60)
def test_a_special_file_with_an_odd_name_is_listed_escaped(tmp_path: Path) -> None:
    folder = peft_folder(tmp_path / "peft")
    os.mkfifo(folder / "x\n::error::ok")
    with pytest.raises(ArtifactError, match="not regular files") as refused:
        publish(folder)
    assert str(refused.value).isprintable()


class Store:
    """An S3 client that reads what it is handed as boto3 does (a path: opened by name)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def upload_file(self, filename: str, _bucket: str, key: str) -> None:
        with open(filename, "rb") as fh:
            self.objects[key] = fh.read()

    def upload_fileobj(self, body: Any, _bucket: str, key: str) -> None:
        data = b""
        while chunk := body.read(8192):
            data += chunk
        self.objects[key] = data

    def put_object(self, *, Bucket: str, Key: str, Body: bytes, **_: Any) -> None:
        self.objects[Key] = Body

    def delete_object(self, *, Bucket: str, Key: str) -> None:
        self.objects.pop(Key, None)


def _swap_link(path: Path, outside: Path) -> None:
    path.unlink()
    path.symlink_to(outside)


def _swap_bytes(path: Path, _outside: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def _swap_growing(path: Path, _outside: Path) -> None:
    with path.open("ab") as fh:
        fh.write(b"more")


def _swap_fifo(path: Path, _outside: Path) -> None:
    path.unlink()
    os.mkfifo(path)


SWAPS = {"link": _swap_link, "bytes": _swap_bytes, "grown": _swap_growing, "fifo": _swap_fifo}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("swap", sorted(SWAPS))
def test_a_file_swapped_after_verification_is_not_uploaded_as_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: str
) -> None:
    import loraplane.artifact_publish as artifact_publish

    store = Store()
    monkeypatch.setattr(artifact_publish, "s3_client", lambda _settings: store)
    folder = peft_folder(tmp_path / "peft")
    record, manifest = publish(folder)
    outside = tmp_path / "secret"
    outside.write_bytes(b"private key material")
    SWAPS[swap](folder / WEIGHTS_NAME, outside)
    with pytest.raises(ArtifactError, match="changed since it was verified"):
        upload(Settings(), folder, record, manifest)
    assert not any(key.endswith(MANIFEST_NAME) for key in store.objects)
    assert not any(key.endswith(WEIGHTS_NAME) for key in store.objects)
    assert b"private key material" not in store.objects.values()


def test_an_unchanged_folder_uploads_every_file_then_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import loraplane.artifact_publish as artifact_publish

    store = Store()
    monkeypatch.setattr(artifact_publish, "s3_client", lambda _settings: store)
    folder = peft_folder(tmp_path / "peft")
    record, manifest = publish(folder)
    upload(Settings(), folder, record, manifest)
    names = [key.rsplit("/", 1)[1] for key in store.objects]
    assert names == [CONFIG_NAME, WEIGHTS_NAME, MANIFEST_NAME]
    assert store.objects[next(iter(store.objects))] == (folder / CONFIG_NAME).read_bytes()


class Prefix:
    """An S3 prefix as list_objects_v2 lists it; counts what is downloaded."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = sizes
        self.downloaded: list[str] = []

    def list_objects_v2(self, *, Bucket: str, Prefix: str, Delimiter: str) -> dict[str, Any]:
        return {"Contents": [{"Key": Prefix + n, "Size": s} for n, s in self.sizes.items()]}

    def download_file(self, _bucket: str, key: str, _filename: str) -> None:
        self.downloaded.append(key)


@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param({CONFIG_NAME: 500, WEIGHTS_NAME: 200 * 1024**3}, id="huge-object"),
        pytest.param({f"w{i:04d}.safetensors": 8 for i in range(1000)}, id="a-thousand-objects"),
        pytest.param({CONFIG_NAME: 500, "run.py": 10}, id="code"),
    ],
)
def test_an_s3_prefix_publish_would_refuse_is_not_downloaded(
    monkeypatch: pytest.MonkeyPatch, sizes: dict[str, int]
) -> None:
    import loraplane.artifact_publish as artifact_publish

    store = Prefix(sizes)
    monkeypatch.setattr(artifact_publish, "s3_client", lambda _settings: store)
    with (
        pytest.raises(ArtifactError, match="refused: "),
        artifact_publish.local_folder(Settings(), "s3://loraplane-artifacts/ci/run-1/"),
    ):
        pass
    assert store.downloaded == []


class GrowingPrefix(Prefix):
    """A prefix whose objects grow between the listing and the download (whoever can write
    the bucket appends to them): each is ``grown_to`` bytes when it is read, and its
    answer announces that size (``announce``) or none, streaming it in 1 MiB reads."""

    def __init__(self, sizes: dict[str, int], grown_to: int, announce: bool) -> None:
        super().__init__(sizes)
        self.grown_to, self.announce = grown_to, announce
        self.sent = 0

    def _chunks(self) -> Any:
        left = self.grown_to
        while left > 0:
            n = min(left, 1024 * 1024)
            left -= n
            self.sent += n
            yield b"\0" * n

    def download_file(self, _bucket: str, key: str, filename: str) -> None:
        self.downloaded.append(key)
        with open(filename, "wb") as fh:
            for chunk in self._chunks():
                fh.write(chunk)

    def get_object(self, *, Bucket: str, Key: str) -> dict[str, Any]:
        self.downloaded.append(Key)
        chunks = self._chunks()

        class Body:
            def read(self, _n: int = -1) -> bytes:
                return next(chunks, b"")

            def close(self) -> None:
                pass

        head: dict[str, Any] = {"Body": Body()}
        if self.announce:
            head["ContentLength"] = self.grown_to
        return head


@pytest.mark.timeout(60)
@pytest.mark.parametrize("announce", [True, False], ids=["announced", "unannounced"])
def test_attack_an_object_grown_since_the_listing_is_not_downloaded_past_its_size(
    monkeypatch: pytest.MonkeyPatch, announce: bool
) -> None:
    """ATTACK: ``publish s3://.../`` lists a 500-byte config, then the object is grown to
    256 MiB (or anything, up to filling the disk) before it is downloaded. boto3's
    ``download_file`` wrote whatever the object held by then; each object is read up to
    its listed size and one byte, and one that differs is refused (``size_mismatch``)."""
    import loraplane.artifact_publish as artifact_publish

    store = GrowingPrefix({CONFIG_NAME: 500}, grown_to=256 * 1024**2, announce=announce)
    monkeypatch.setattr(artifact_publish, "s3_client", lambda _settings: store)
    with (
        pytest.raises(ArtifactError, match="size_mismatch") as refused,
        artifact_publish.local_folder(Settings(), "s3://loraplane-artifacts/ci/run-1/"),
    ):
        pass
    assert [r.reason for r in refused.value.refusals] == [Reason.size_mismatch]
    assert store.sent <= 1024 * 1024


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", ["sparse 200 GiB", "a hundred files"])
def test_attack_artifact_verify_refuses_from_the_listing_before_hashing(
    tmp_path: Path, unhashed: list[str], shape: str
) -> None:
    """ATTACK: ``loraplane artifact verify FOLDER`` on a folder without a manifest, holding a
    sparse 200 GiB weights file or a hundred files. Publish refuses such a folder from its
    listing; verify built the manifest first, hashing every byte of every file (minutes
    per sparse file, hours for many). Both share the listing check, before any hash."""
    from typer.testing import CliRunner

    from loraplane.cli import app

    folder = peft_folder(tmp_path / "peft")
    if shape == "sparse 200 GiB":
        _sparse(folder / WEIGHTS_NAME, 200 * 1024**3)
    else:
        for i in range(100):
            (folder / f"w{i:03d}.safetensors").write_bytes(b"")
    done = CliRunner().invoke(app, ["artifact", "verify", str(folder)])
    assert done.exit_code == 1, done.output
    assert done.stdout.startswith("too_large"), done.stdout
    assert unhashed == []
