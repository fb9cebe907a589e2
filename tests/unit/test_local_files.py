"""Attack tests: whatever is put at the path of a file a component re-reads while it runs
(a FIFO with no writer, a link to an endless device, a folder, an oversized file, JSON
nested past the recursion limit) makes that read fail the way a bad file does, never hang,
exhaust memory or raise what the reader does not expect."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from loraplane.kernel.local_files import read_regular

Plant = Callable[[Path], None]
HOSTILE: dict[str, Plant] = {
    "fifo": lambda p: os.mkfifo(p),
    "endless-device": lambda p: p.symlink_to("/dev/zero"),
    "folder": lambda p: p.mkdir(),
    "over-the-cap": lambda p: p.write_bytes(b" " * 2048),
}
DEEP_JSON = b"[" * 100_000


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_read_regular_refuses_anything_but_a_bounded_regular_file(
    kind: str, tmp_path: Path
) -> None:
    path = tmp_path / "file"
    HOSTILE[kind](path)
    with pytest.raises(OSError):
        read_regular(path, max_bytes=1024)


def test_read_regular_reads_a_file_up_to_the_cap_and_follows_a_link(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_bytes(b"x" * 1024)
    (tmp_path / "link").symlink_to(path)
    assert read_regular(tmp_path / "link", max_bytes=1024) == b"x" * 1024
    assert read_regular(path, max_bytes=5000) == b"x" * 1024


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_schedule_file_replaced_by_a_hostile_one_keeps_the_previous_schedule(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loraplane.streams import schedules

    monkeypatch.setattr(schedules, "MAX_SCHEDULE_BYTES", 1024)
    path = tmp_path / "schedules.yaml"
    path.write_text("schedules: [{cron: '0 9 * * *', adapter_id: x}]")
    watched = schedules.ScheduleFile(path)
    assert [e.adapter_id for e in watched.current().schedules] == ["x"]
    path.unlink()
    HOSTILE[kind](path)
    os.utime(path, (1, 1), follow_symlinks=False)
    assert [e.adapter_id for e in watched.current().schedules] == ["x"]


@pytest.mark.parametrize("kind", [*sorted(HOSTILE), "deep-json"])
def test_an_api_key_file_replaced_by_a_hostile_one_accepts_no_key(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loraplane.frontdoor import api_keys

    monkeypatch.setattr(api_keys, "MAX_API_KEYS_BYTES", 1024)
    path = tmp_path / "api-keys.json"
    key = api_keys.add_key(path, "acme")
    watched = api_keys.ApiKeysFile.open(path)
    assert watched.current().grant(f"Bearer {key}") == ("acme", None)
    path.unlink()
    if kind == "deep-json":
        path.write_bytes(DEEP_JSON[:1000])
    else:
        HOSTILE[kind](path)
    assert watched.current().grant(f"Bearer {key}") is None


@pytest.mark.parametrize("kind", [*sorted(HOSTILE), "deep-json"])
def test_a_hostile_applied_commands_file_starts_empty(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loraplane.workers import applied_commands

    monkeypatch.setattr(applied_commands, "MAX_FILE_BYTES", 1024)
    now = datetime(2026, 1, 1, tzinfo=UTC)
    path = tmp_path / applied_commands.FILE_NAME
    if kind == "deep-json":
        path.write_bytes(b'{"applied": ' + DEEP_JSON[:1000])
    else:
        HOSTILE[kind](path)
    assert applied_commands.load_remembered(path, now) == applied_commands.Remembered()
    path.unlink() if not path.is_dir() else path.rmdir()
    applied_commands.save_applied(path, {"c1": now + timedelta(seconds=5)}, ["x"])
    assert applied_commands.load_remembered(path, now).protected == frozenset({"x"})


def _save_keyring(path: Path) -> None:
    from loraplane.schemas.keyring import Keyring, save_keyring

    save_keyring(Keyring(), path)


def _add_key(path: Path) -> None:
    from loraplane.frontdoor.api_keys import add_key

    add_key(path, "acme")


def _write_schedule(path: Path) -> None:
    from loraplane.demo.peak import write_schedule

    write_schedule(path, [])


WRITERS: dict[str, tuple[str, Callable[[Path], None]]] = {
    "keyring": ("keyring.yaml", _save_keyring),
    "api-keys": ("api-keys.json", _add_key),
    "schedules": ("schedules.yaml", _write_schedule),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_link_planted_at_a_writers_temporary_name_is_never_written_through(
    writer: str, tmp_path: Path
) -> None:
    name, write = WRITERS[writer]
    folder = tmp_path / "state"
    folder.mkdir()
    outside = tmp_path / "outside"
    outside.write_text("untouched")
    path = folder / name
    for guess in (path.with_suffix(".tmp"), folder / f".{name}.{os.getpid()}.tmp"):
        guess.symlink_to(outside)
    write(path)
    assert outside.read_text() == "untouched"
    assert path.is_file() and not path.is_symlink() and path.stat().st_size > 0
