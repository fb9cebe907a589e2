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
