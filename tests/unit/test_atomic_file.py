"""write_atomic on a full disk (the old file stays whole and no half-written temporary file
is left to hold on to the space that ran out), against a planted link, and from several
threads at once."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from loraplane.kernel import atomic_file
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


def test_a_link_at_the_temporary_name_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link planted at the temporary name the writer draws is neither truncated nor
    written through (it made the component write whatever file it named, the worker's own
    user's files): another name is drawn, and the planted link is left as it was."""
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    target = tmp_path / "state" / ".applied-commands.json"
    target.parent.mkdir()
    planted = target.parent / f".{target.name}.guessed.tmp"
    planted.symlink_to(victim)
    names = iter(["guessed", "fresh"])
    monkeypatch.setattr(atomic_file, "_token", lambda: next(names))
    write_atomic(target, '{"v": 1}')
    assert victim.read_text() == "keep me"
    assert target.read_text() == '{"v": 1}' and not target.is_symlink()
    assert sorted(p.name for p in target.parent.iterdir()) == sorted([target.name, planted.name])


def test_threads_writing_one_file_at_once_each_write_whole(tmp_path: Path) -> None:
    """Two threads of one process writing the same file at once (the registry's checkpoint
    and views, a worker's applied ids) each write a temporary file of their own: every
    call succeeds, the file is one caller's whole text, and no temporary file is left.
    With one temporary name per process, one thread removed or renamed the other's file
    (FileNotFoundError, FileExistsError) or renamed a half-written one into place."""
    target = tmp_path / "state.json"
    threads, rounds = 8, 50
    texts = [f"{i}:" + str(i) * 200_000 for i in range(threads)]
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def write(i: int) -> None:
        start.wait()
        for _ in range(rounds):
            try:
                write_atomic(target, texts[i])
                if target.read_text() not in texts:
                    errors.append(AssertionError("a torn file was renamed into place"))
            except OSError as exc:
                errors.append(exc)

    workers = [threading.Thread(target=write, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert errors == []
    assert target.read_text() in texts
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def test_a_mode_is_set_from_the_first_byte(tmp_path: Path) -> None:
    target = tmp_path / "secret"
    write_atomic(target, b"s3cr3t", mode=0o600)
    assert target.stat().st_mode & 0o777 == 0o600 and target.read_bytes() == b"s3cr3t"


def test_write_new_leaves_what_is_there_alone(tmp_path: Path) -> None:
    """A file that must not exist yet (a signing key, a secret) is made whole or not at all;
    a file or a link already at the path is kept as it is, and no temporary is left."""
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    link, existing, fresh = tmp_path / "link", tmp_path / "existing", tmp_path / "fresh"
    link.symlink_to(victim)
    existing.write_text("old")
    for path in (link, existing):
        with pytest.raises(FileExistsError):
            atomic_file.write_new(path, "new")
    atomic_file.write_new(fresh, b"new", mode=0o600)
    assert victim.read_text() == "keep me" and existing.read_text() == "old"
    assert fresh.read_bytes() == b"new" and fresh.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing", "fresh", "link", "victim"]


def test_a_failed_rename_leaves_no_temporary(tmp_path: Path) -> None:
    """A rename over a folder fails; its temporary file, under a random name no later
    write draws again, stayed beside it for good."""
    (tmp_path / "state.json").mkdir()
    with pytest.raises(OSError):
        write_atomic(tmp_path / "state.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
