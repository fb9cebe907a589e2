"""write_atomic on a full disk: the old file stays whole and no half-written temporary
file is left to hold on to the space that ran out."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from loraplane.kernel.atomic_file import write_atomic


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / ".state.json"
    write_atomic(target, '{"v": 1}')

    def full(_fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as failed:
        write_atomic(target, '{"v": 2}' + " " * 100_000)
    assert failed.value.errno == errno.ENOSPC
    assert target.read_text() == '{"v": 1}'
    assert [p.name for p in tmp_path.iterdir()] == [".state.json"]


def test_a_link_at_the_temporary_name_is_not_followed(tmp_path: Path) -> None:
    """Before, a link planted at the predictable ``.<name>.<pid>.tmp`` made the component
    truncate and write whatever file it named (the worker's own user's files)."""
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    target = tmp_path / "state" / ".applied-commands.json"
    target.parent.mkdir()
    (target.parent / f".{target.name}.{os.getpid()}.tmp").symlink_to(victim)
    write_atomic(target, '{"v": 1}')
    assert victim.read_text() == "keep me"
    assert target.read_text() == '{"v": 1}' and not target.is_symlink()
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_a_mode_is_set_from_the_first_byte(tmp_path: Path) -> None:
    target = tmp_path / "secret"
    write_atomic(target, b"s3cr3t", mode=0o600)
    assert target.stat().st_mode & 0o777 == 0o600 and target.read_bytes() == b"s3cr3t"
