"""A small tmpfs of a test's own, for a real full disk (ENOSPC from the kernel, not a mock):
mounted on a fresh folder, resizable while mounted (``mount -o remount,size=``, contents
kept), always unmounted on the way out. Needs root; the test is skipped, with the reason,
where mounting is not allowed."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Tmpfs:
    path: Path

    def resize(self, size_bytes: int) -> None:
        """New size (rounded up to pages by the kernel); a size under what is used fails."""
        _mount("-o", f"remount,size={size_bytes}", str(self.path))

    @property
    def used(self) -> int:
        usage = shutil.disk_usage(self.path)
        return usage.total - usage.free

    @property
    def free(self) -> int:
        return shutil.disk_usage(self.path).free


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise OSError(f"mount {' '.join(args)}: {done.stderr.strip()}")


@contextmanager
def small_tmpfs(path: Path, size_bytes: int) -> Iterator[Tmpfs]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (a real full disk, not a mock)")
    path.mkdir(parents=True, exist_ok=True)
    try:
        _mount("-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", str(path))
    except OSError as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    try:
        yield Tmpfs(path)
    finally:
        subprocess.run(["umount", "--lazy", str(path)], capture_output=True, check=False)
