"""Local service credentials: made private, read back, refused when others could read them,
and resolved by the settings without ever appearing in their repr."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr

from loraplane.kernel.config import Settings
from loraplane.kernel.secrets import SecretError, ensure_secret, read_secret


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
        tmp_path / "secrets" / "clickhouse-loraplane_reader")
    with pytest.raises(SecretError):
        settings.clickhouse.login()  # the writer's file was never made
    assert settings.s3.credentials_file == tmp_path / "secrets" / "s3-secret"
    assert settings.vllm_api_key_path(18000) == tmp_path / "secrets" / "vllm-18000.key"
    given = Settings(home=tmp_path, s3={"secret_access_key": "given-secret"},
                     clickhouse={"password": "given-password"})
    assert given.s3.secret() == "given-secret"
    assert given.clickhouse.login() == ("loraplane", "given-password")
    assert "given-secret" not in repr(given) and "given-password" not in repr(given)
    assert isinstance(given.s3.secret_access_key, SecretStr)
