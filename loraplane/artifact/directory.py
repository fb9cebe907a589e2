"""An adapter folder on local disk, seen as verification's ``ArtifactReader``.

Links are listed as links and never followed (``lstat``, ``O_NOFOLLOW``), so a symlink to
``/etc/shadow`` is refused by name instead of being read. Digests computed while the files
were downloaded can be handed in, so a fresh fetch is not hashed twice.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Iterator, Mapping
from itertools import islice
from pathlib import Path

from loraplane.artifact.verification import FileFacts

__all__ = ["MAX_DEPTH", "MAX_ENTRIES", "TOO_MANY", "DirectoryArtifact"]

MAX_ENTRIES = 1024
TOO_MANY = f"(more than {MAX_ENTRIES} entries)"
"""The name listed past ``MAX_ENTRIES``: no file can have it (``unsafe_path``)."""
MAX_DEPTH = 4
_CHUNK = 1024 * 1024


class DirectoryArtifact:
    def __init__(self, root: Path, digests: Mapping[str, str] | None = None) -> None:
        self.root = root
        self._digests = dict(digests or {})
        self._files: list[FileFacts] | None = None

    def files(self) -> list[FileFacts]:
        """The folder's entries, at most ``MAX_ENTRIES`` in the whole tree; past them one
        entry of kind ``other`` says so, which verification refuses (an artifact is a
        handful of files). Why not cut silently: an entry left out would be one no check
        saw; nor list everything first: a folder of millions of names would be held."""
        if self._files is None:
            listed: list[FileFacts] = []
            for facts in self._walk(self.root, "", 0):
                if len(listed) == MAX_ENTRIES:
                    listed.append(FileFacts(TOO_MANY, "other", 0))
                    break
                listed.append(facts)
            self._files = listed
        return self._files

    def _walk(self, folder: Path, prefix: str, depth: int) -> Iterator[FileFacts]:
        with os.scandir(folder) as names:  # one past the bound tells there are more
            entries = sorted(islice(names, MAX_ENTRIES + 1), key=lambda e: e.name)
        for entry in entries:
            rel = f"{prefix}{entry.name}"
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                yield FileFacts(rel, "symlink", 0)
            elif stat.S_ISREG(st.st_mode):
                yield FileFacts(rel, "file", st.st_size)
            elif stat.S_ISDIR(st.st_mode):
                # A folder is never part of an artifact (the allowlist is flat): listed
                # itself, so an empty one is refused too, then walked for its names.
                yield FileFacts(rel, "other", 0)
                if depth < MAX_DEPTH:
                    yield from self._walk(Path(entry.path), f"{rel}/", depth + 1)
            else:
                yield FileFacts(rel, "other", 0)

    def _size(self, path: str) -> int:
        return next(f.size for f in self.files() if f.path == path)

    def _open(self, path: str) -> int:
        """A file listed as regular, opened only if it still is one: swapped since the
        listing for a link, a FIFO (whose open would block) or a folder, it is an OSError."""
        if not any(f.path == path and f.kind == "file" for f in self.files()):
            raise FileNotFoundError(path)
        fd = os.open(self.root / path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "no longer a regular file", path)
        return fd

    def read(self, path: str, offset: int, length: int) -> bytes:
        fd = self._open(path)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def sha256(self, path: str) -> str:
        """The digest of at most the listed size and one byte: a file grown since the
        listing hashes to no pinned digest, and is never read to an end it keeps moving."""
        if path not in self._digests:
            digest = hashlib.sha256()
            fd = self._open(path)
            left = self._size(path) + 1
            try:
                while left > 0 and (chunk := os.read(fd, min(_CHUNK, left))):
                    digest.update(chunk)
                    left -= len(chunk)
            finally:
                os.close(fd)
            self._digests[path] = digest.hexdigest()
        return self._digests[path]
