"""Why an adapter artifact was refused, or could not be fetched.

Every reason is a stable code: the agent puts it on the cache-events topic
(``CacheEvent.reason``), ops grep for it, and tests assert on it. A refusal means the bytes
are not acceptable and retrying will not help; a failure (``Reason.is_failure``) means the
artifact store misbehaved and a later retry may succeed. The codes are
``schemas.reasons.ArtifactReason`` (wire-visible); ``Reason`` is this package's name for it.

A refusal's text quotes the artifact (a tensor name, a file name, a library's error about
a bundle) and is printed to terminals and CI logs: it is always printable
(``log_lines.shown``), so hostile bytes cannot start a log line of their own, move the
cursor or reorder the text.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from loraplane.kernel.log_lines import shown
from loraplane.schemas.reasons import ArtifactReason as Reason

__all__ = ["ArtifactError", "Refusal"]


@dataclass(frozen=True)
class Refusal:
    """``path`` is the name as found (callers compare it), shown escaped; ``detail`` is
    text for people, kept escaped (``shown``)."""

    reason: Reason
    path: str = ""
    detail: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "detail", shown(self.detail))

    def __str__(self) -> str:
        where = f" {shown(self.path)}" if self.path else ""
        what = f": {self.detail}" if self.detail else ""
        return f"{self.reason.value}{where}{what}"


class ArtifactError(Exception):
    """An artifact was refused or could not be fetched; ``refusals`` says every reason."""

    def __init__(self, refusals: Iterable[Refusal]) -> None:
        self.refusals = tuple(refusals)
        if not self.refusals:
            raise ValueError("ArtifactError needs at least one refusal")
        super().__init__("; ".join(str(r) for r in self.refusals))

    @classmethod
    def single(cls, reason: Reason, path: str = "", detail: str = "") -> ArtifactError:
        return cls([Refusal(reason, path, detail)])

    @property
    def reasons(self) -> tuple[Reason, ...]:
        """Distinct reasons in first-seen order."""
        return tuple(dict.fromkeys(r.reason for r in self.refusals))

    @property
    def is_failure(self) -> bool:
        """Only transient failures: retrying later may succeed."""
        return all(r.is_failure for r in self.reasons)
