"""Local service credentials: made private, read back, refused when others could read them,
resolved by the settings without ever appearing in their repr, and installed private from a
Kubernetes Secret volume's layout."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr

from loraplane.kernel.config import KafkaSettings, Settings
from loraplane.kernel.kafka import read_password
from loraplane.kernel.secrets import SecretError, ensure_secret, install_private, read_secret


def test_a_secret_is_made_once_private_and_then_kept(tmp_path: Path) -> None:
    path = tmp_path / "secrets" / "s3-secret"
    first = ensure_secret(path)
    assert len(first) >= 32 and path.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "secrets").stat().st_mode & 0o077 == 0
    assert ensure_secret(path) == first == read_secret(path)
    assert ensure_secret(tmp_path / "other") != first


def test_a_missing_empty_or_readable_secret_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(SecretError, match=r"missing.*stack up"):
        read_secret(tmp_path / "nope")
    path = tmp_path / "s"
    path.write_text("")
    path.chmod(0o600)
    with pytest.raises(SecretError, match="empty"):
        read_secret(path)
    path.write_text("hunter2-but-longer")
    path.chmod(0o644)
    with pytest.raises(SecretError, match="chmod 600"):
        read_secret(path)


def test_settings_find_each_login_under_secrets_dir(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    assert settings.secrets_dir == tmp_path / "secrets"
    ensure_secret(settings.clickhouse.password_file("loraplane_reader"))
    user, password = settings.clickhouse.login(reader=True)
    assert user == "loraplane_reader" and password == read_secret(
        tmp_path / "secrets" / "clickhouse-loraplane_reader"
    )
    with pytest.raises(SecretError):
        settings.clickhouse.login()  # the writer's file was never made
    assert settings.s3.credentials_file == tmp_path / "secrets" / "s3-secret"
    assert settings.vllm_api_key_path(18000) == tmp_path / "secrets" / "vllm-18000.key"
    given = Settings(
        home=tmp_path,
        s3={"secret_access_key": "given-secret"},
        clickhouse={"password": "given-password"},
    )
    assert given.s3.secret() == "given-secret"
    assert given.clickhouse.login() == ("loraplane", "given-password")
    assert "given-secret" not in repr(given) and "given-password" not in repr(given)
    assert isinstance(given.s3.secret_access_key, SecretStr)


def secret_volume(root: Path, files: dict[str, bytes]) -> Path:
    """A Secret volume as the kubelet lays it out: the files in a timestamped folder,
    ``..data`` a link to it, each top-level name a link through ``..data``, mode 0440
    (``fsGroup`` adds group read)."""
    volume = root / "volume"
    stamp = volume / "..2026_01_01_00_00_00.000000001"
    for rel, data in files.items():
        path = stamp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(0o440)
    (volume / "..data").symlink_to(stamp.name)
    for top in {rel.split("/")[0] for rel in files}:
        (volume / top).symlink_to(f"..data/{top}")
    return volume


def test_a_secret_volume_is_installed_private_where_the_runtimes_read_it(tmp_path: Path) -> None:
    files = {
        "kafka/worker.password": b"pw-of-the-worker",
        "router-secret": b"\x00\xffkey" * 4,
        "s3-secret": b"s3-secret-key\n",
    }
    volume = secret_volume(tmp_path, files)
    with pytest.raises(SecretError, match="chmod 600"):
        read_secret(volume / "s3-secret")  # as mounted: group-readable, refused
    target = tmp_path / "secrets"
    written = install_private(volume, target)
    assert sorted(p.relative_to(target).as_posix() for p in written) == sorted(files)
    for rel, data in files.items():
        assert (target / rel).read_bytes() == data
        assert (target / rel).stat().st_mode & 0o777 == 0o600
    assert (target / "kafka").stat().st_mode & 0o777 == 0o700
    assert not list(target.glob("..*"))  # the volume's bookkeeping stays behind
    # the Kafka section given here, so no setting from the environment (a stack's own
    # credentials folder) can stand in for the one this volume installed
    settings = Settings(home=tmp_path, secrets_dir=target, kafka=KafkaSettings())
    assert settings.s3.secret() == "s3-secret-key"
    assert read_password(settings.kafka.credentials_dir / "worker.password") == "pw-of-the-worker"
    assert install_private(volume, target) == written  # a second run replaces them


def test_a_link_out_of_the_secret_volume_is_not_followed(tmp_path: Path) -> None:
    volume = secret_volume(tmp_path, {"router-secret": b"k" * 32})
    outside = tmp_path / "elsewhere"
    outside.write_text("not a secret of this pod")
    (volume / "stolen").symlink_to(outside)
    written = install_private(volume, tmp_path / "secrets")
    assert [p.name for p in written] == ["router-secret"]
    with pytest.raises(SecretError, match="not a folder"):
        install_private(tmp_path / "missing", tmp_path / "secrets")


def _killed_while_making(path: str) -> None:
    """Run in a child: SIGKILL itself the moment the new secret's bytes are drawn, as a
    kill -9 of ``stack up`` between the file's creation and its write does."""
    import os
    import secrets
    import signal

    def die(_n: int = 0) -> str:
        os.kill(os.getpid(), signal.SIGKILL)
        return ""

    secrets.token_urlsafe = die
    ensure_secret(Path(path))


@pytest.mark.timeout(60)
def test_a_kill_while_a_secret_is_made_leaves_none_or_one_that_is_made_again(
    tmp_path: Path,
) -> None:
    """Before, the kill left an empty file, and every later `stack up` stopped at
    'secret file is empty (run `loraplane stack up`)' for good."""
    import signal
    import subprocess
    import sys

    path = tmp_path / "secrets" / "s3-secret"
    code = (
        "from tests.unit.test_local_secrets import _killed_while_making; "
        f"_killed_while_making({str(path)!r})"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, check=False, timeout=60)
    assert done.returncode == -signal.SIGKILL
    made = ensure_secret(path)
    assert len(made) >= 32 and read_secret(path) == made
    path.write_bytes(b"")  # what the kill left under the code before: made again too
    assert len(ensure_secret(path)) >= 32


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["folder", "fifo", "huge"])
def test_a_secret_or_password_file_that_is_no_small_file_is_refused(
    tmp_path: Path, kind: str
) -> None:
    """Each is refused naming the file; making a secret never replaces what sits there."""
    import os

    from loraplane.kernel.kafka import KafkaAuthError
    from loraplane.kernel.secrets import secret_key

    path = tmp_path / "planted-secret"
    if kind == "folder":
        path.mkdir(mode=0o700)
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    else:
        path.write_bytes(b"x" * (1 << 20))
        path.chmod(0o600)
    with pytest.raises(SecretError, match="planted-secret"):
        read_secret(path)
    with pytest.raises(SecretError, match="planted-secret"):
        secret_key(path)
    with pytest.raises(SecretError, match="planted-secret"):
        ensure_secret(path)
    with pytest.raises(KafkaAuthError, match="planted-secret"):
        read_password(path)
