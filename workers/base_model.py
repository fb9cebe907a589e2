"""The base model the worker checks adapters against, and whether vLLM still serves it.

Every adapter's tensors are checked against the base model's shapes before vLLM gets it
(``--model-dir``'s config.json, else that of the folder vLLM lists as its base model's
root). vLLM can be restarted under a running agent with another base model; the shapes the
agent checked against would then be another model's, and an adapter that passed them can
fail at activation (which can take vLLM's engine down). ``BaseModelWatch`` compares the root
vLLM lists on every listing with the verified one: while they differ the agent loads
nothing and its gateway refuses requests as not run (docs/worker.md, "--model-dir").
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from loraplane.artifact.model_config import read_model_config
from loraplane.artifact.model_shape import ModelShape

__all__ = ["BaseModelWatch", "base_model_shape", "root_shape"]

log = logging.getLogger("loraplane.worker")
_Signature = tuple[int, int, int, int] | None


def root_shape(served_root: str | None) -> ModelShape:
    """The shapes of ``served_root``, the base model's root vLLM lists, when it is an
    absolute path to a folder whose config.json the bounded reader takes; ValueError
    naming why otherwise (a hub id, a relative path, a folder gone or without a model)."""
    if not served_root or not Path(served_root).is_absolute():
        raise ValueError(
            f"vLLM lists its base model's root as {served_root!r:.200}, no local folder"
        )
    try:
        return read_model_config(Path(served_root) / "config.json")
    except ValueError as exc:
        raise ValueError(str(exc)[:300]) from None


def base_model_shape(model_dir: Path | None, served_root: str | None) -> ModelShape:
    """The shapes every adapter is checked against before vLLM gets it: ``--model-dir``'s
    config.json, else that of ``served_root`` (``root_shape``). ValueError otherwise, and
    the start stops: a worker that could check no adapter would refuse every load, and its
    startup scan would drop every host-tier entry (docs/worker.md, "--model-dir")."""
    if model_dir is not None:
        return read_model_config(model_dir / "config.json")
    try:
        shape = root_shape(served_root)
    except ValueError as exc:
        raise ValueError(
            f"no --model-dir and {exc}: no adapter could be checked against the base model's "
            "shapes (pass --model-dir with the base model's folder)"
        ) from None
    log.info("adapters are checked against the shapes of vLLM's base model %r", served_root)
    return shape


def _signature(root: str | None) -> _Signature:
    """What changes when the config.json at ``root`` is replaced or rewritten (None: none
    to read)."""
    if not root or not Path(root).is_absolute():
        return None
    try:
        st = os.stat(Path(root) / "config.json")
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class BaseModelWatch:
    """Whether the base model vLLM lists is the one whose ``shape`` adapters are checked
    against. ``root``: the root vLLM listed when those shapes were read (None with
    ``--model-dir`` until the first listing). A listed root is the verified model when its
    config.json (read as at the start, ``root_shape``) gives ``shape``; a root with no
    shapes to read (a hub id) only when ``--model-dir`` vouched for it at the first
    listing, and only that very root. Anything else is another model: never adopted, as
    the adapters on the host tier were checked against ``shape``."""

    shape: ModelShape
    root: str | None = None
    model_dir: Path | None = None
    _vouched: str | None = None  # a root with no shapes to read that --model-dir vouched for
    _seen: tuple[str | None, _Signature] | None = field(default=None, repr=False)
    _verdict: str | None = field(default=None, repr=False)

    def check(self, listed: str | None) -> str | None:
        """None when ``listed`` (vLLM's base model's root; None: it lists none) is the
        verified model, else why not. It reads the root's config.json when the root or
        that file changed since the last check: call it off the event loop."""
        key = (listed, _signature(listed))
        if key != self._seen:
            self._seen, self._verdict = key, self._judge(listed)
        return self._verdict

    def _judge(self, listed: str | None) -> str | None:
        verified = self.root or (str(self.model_dir) if self.model_dir else "?")
        if listed is None:
            return "vLLM lists no base model"
        try:
            shape = root_shape(listed)
        except ValueError as exc:
            if listed == self._vouched:
                return None
            if self.root is None and self.model_dir is not None:
                self.root = self._vouched = listed  # --model-dir says what it is
                return None
            return (
                f"vLLM's base model is {listed!r:.200}, not {verified!r:.200} whose shapes "
                f"adapters are checked against, and its shapes cannot be read: {exc}"
            )
        if shape != self.shape:
            return (
                f"vLLM's base model {listed!r:.200} has other shapes than {verified!r:.200}, "
                "which adapters are checked against"
            )
        if listed != self.root:
            log.info(
                "vLLM's base model root is %r, with the shapes adapters are checked against", listed
            )
            self.root = listed
        return None
