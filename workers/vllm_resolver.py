"""Which folder vLLM may load for a LoRA name it was asked for on demand: only an entry of
this worker's host tier that a signed release names, for this vLLM's base model. Everything
else is refused.

With runtime LoRA updating on (the agent needs it), vLLM resolves a request's unknown
``model`` through its resolver plugins, and one that trusts a folder loads bytes the control
plane never verified. This one re-decides at resolve time, from the bytes vLLM will read:
the entry's files are copied (no link followed) into a folder of this process and that copy
is verified against the record of the agent's saved registry view that the keyring verifies
(never the entry's own ``record.json``); vLLM gets the copy, so a folder swapped on disk
after the check is never what it loads. The vLLM-facing class is
``loraplane/vllm_plugin.py``; this module never imports vLLM. docs/worker.md, "vLLM's
on-demand loads: the host-tier resolver".
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import stat
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from loraplane.artifact.directory import MAX_ENTRIES, DirectoryArtifact
from loraplane.artifact.model_config import read_model_config
from loraplane.artifact.verification import WorkerLimits, verify_artifact
from loraplane.kernel.local_files import read_regular
from loraplane.registry.vouch import Unvouched, vouched_record
from loraplane.schemas.adapter import AdapterRecord
from loraplane.schemas.base import LORA_NAME_RE, now_utc
from loraplane.schemas.keyring import Keyring, KeyringError, KeyringFile
from loraplane.schemas.reasons import ArtifactReason
from loraplane.schemas.reasons import ResolverRefusal as Refused
from loraplane.schemas.registry import MAX_VIEWS_BYTES, AdapterView, views_from_json
from loraplane.workers.host_tier_entry import (
    ADAPTER_DIR,
    MAX_RECORD_BYTES,
    RECORD_FILE,
    RESOLVER_COPIES,
    VIEWS_FILE,
    entry_record,
    resolver_copy_name,
)

__all__ = [
    "ENTRY_POINT",
    "ENV_ALIASES",
    "ENV_BASE_MODEL",
    "ENV_HOST_TIER",
    "ENV_KEYRING",
    "ENV_MAX_LORA_RANK",
    "ENV_SERVED_MODEL",
    "PLUGIN_NAME",
    "HostTierResolver",
    "Resolved",
    "ResolverConfig",
    "ResolverConfigError",
    "safe_name",
]

log = logging.getLogger("loraplane.vllm_resolver")

PLUGIN_NAME = "loraplane_host_tier"  # the entry point's name, what VLLM_PLUGINS allows
ENTRY_POINT = "loraplane.vllm_plugin:register"
ENV_HOST_TIER = "LORAPLANE_RESOLVER_HOST_TIER"
ENV_BASE_MODEL = "LORAPLANE_RESOLVER_BASE_MODEL"  # the registry's base_model id
ENV_SERVED_MODEL = "LORAPLANE_RESOLVER_SERVED_MODEL"  # vLLM's --model: its base_model_name
ENV_MAX_LORA_RANK = "LORAPLANE_RESOLVER_MAX_LORA_RANK"
ENV_ALIASES = "LORAPLANE_RESOLVER_BASE_MODEL_ALIASES"  # JSON object, settings' aliases
ENV_KEYRING = "LORAPLANE_RESOLVER_KEYRING"  # the worker's keyring file (settings.keyring_path)
_CHUNK = 1024 * 1024


class ResolverConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ResolverConfig:
    """One vLLM's resolver: the host tier it may load from and the base model it serves.
    ``served_model`` is vLLM's ``--model``; ``VllmProcess`` sets it to its ``model_dir``.
    ``keyring``: the file the worker verifies the registry with; without one every name is
    refused (``unvouched``: fail closed)."""

    host_tier: Path
    base_model: str
    served_model: str
    max_lora_rank: int
    base_model_aliases: Mapping[str, str] = field(default_factory=dict)
    keyring: Path | None = None

    def env(self) -> dict[str, str]:
        return {
            ENV_HOST_TIER: str(self.host_tier),
            ENV_BASE_MODEL: self.base_model,
            ENV_SERVED_MODEL: self.served_model,
            ENV_MAX_LORA_RANK: str(self.max_lora_rank),
            ENV_ALIASES: json.dumps(dict(self.base_model_aliases)),
            ENV_KEYRING: str(self.keyring or ""),
        }

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ResolverConfig | None:
        """None when the environment names no host tier (the plugin then registers
        nothing); ResolverConfigError when it names one but the rest is unusable."""
        root = env.get(ENV_HOST_TIER)
        if not root:
            return None
        try:
            aliases = json.loads(env.get(ENV_ALIASES) or "{}")
            keyring = env.get(ENV_KEYRING)
            config = cls(
                Path(root),
                env[ENV_BASE_MODEL],
                env[ENV_SERVED_MODEL],
                int(env[ENV_MAX_LORA_RANK]),
                aliases,
                Path(keyring) if keyring else None,
            )
        except (KeyError, ValueError) as exc:
            raise ResolverConfigError(f"resolver environment incomplete: {exc!r}") from None
        if not (
            isinstance(aliases, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items())
        ):
            raise ResolverConfigError(f"{ENV_ALIASES} is not a JSON object of strings")
        if not config.host_tier.is_absolute() or not config.base_model:
            raise ResolverConfigError(
                f"{ENV_HOST_TIER} must be absolute, {ENV_BASE_MODEL} not empty"
            )
        if config.keyring is not None and not config.keyring.is_absolute():
            raise ResolverConfigError(f"{ENV_KEYRING} must be absolute")
        return config


@dataclass(frozen=True)
class Resolved:
    lora_name: str
    path: Path  # this process's verified copy: what vLLM loads
    record: AdapterRecord


class _Refusal(Exception):
    def __init__(self, reason: Refused, detail: str = "") -> None:
        super().__init__(reason, detail)
        self.reason, self.detail = reason, detail


def safe_name(lora_name: object) -> bool:
    """A lora name as the host tier names its entries: one path component, never a path."""
    return (
        isinstance(lora_name, str)
        and LORA_NAME_RE.fullmatch(lora_name) is not None
        and ".." not in lora_name
    )


class HostTierResolver:
    """``resolve`` is thread-safe and blocking (file I/O): call it through a thread from
    asyncio. ``snapshot_root``: where the verified copies go (default: the tier's
    ``.resolver-copies/``, emptied of an earlier run's at the first resolve, deleted at
    exit)."""

    def __init__(self, config: ResolverConfig, snapshot_root: Path | None = None) -> None:
        self.config = config
        shape = None
        model_config = Path(config.served_model) / "config.json"
        if model_config.is_file():  # a local model folder: adapters are checked against it
            shape = read_model_config(model_config)
        else:  # a hub id: no shapes, and no copy is ever handed to vLLM unchecked
            log.error(
                "lora resolver: %s is no local model folder with a config.json: every name "
                "is refused as model_shape_unknown",
                repr(config.served_model)[:200],
            )
        self.limits = WorkerLimits(
            base_model=config.base_model,
            max_lora_rank=config.max_lora_rank,
            model=shape,
            base_model_aliases=dict(config.base_model_aliases),
            require_model=True,
        )
        self._snapshot_root = snapshot_root
        self._copies: dict[str, Path] = {}  # lora name -> its latest verified copy
        self._lock = threading.Lock()
        self._keyring = KeyringFile(config.keyring) if config.keyring is not None else None
        self._views: tuple[tuple[int, int, int], dict[str, AdapterView]] | None = None

    def resolve(self, base_model_name: str, lora_name: str) -> Resolved | None:
        """The verified copy of ``lora_name``'s host-tier entry, or None (logged with its
        ``ResolverRefusal``) for anything else."""
        shown = repr(lora_name)[:160]
        try:
            found = self._resolve(base_model_name, lora_name)
        except _Refusal as refusal:
            log.warning(
                "lora resolver refused %s: %s%s",
                shown,
                refusal.reason.value,
                f" ({refusal.detail})" if refusal.detail else "",
            )
            return None
        log.info("lora resolver resolved %s to its verified copy %s", shown, found.path)
        return found

    def _resolve(self, base_model_name: str, lora_name: str) -> Resolved:
        if not safe_name(lora_name):
            raise _Refusal(Refused.unsafe_name)
        if base_model_name != self.config.served_model:
            raise _Refusal(
                Refused.served_model_mismatch,
                f"{base_model_name[:120]!r} != {self.config.served_model[:120]!r}",
            )
        try:
            entry = os.open(
                self.config.host_tier / lora_name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
            )
        except FileNotFoundError:
            raise _Refusal(Refused.not_in_host_tier) from None
        except OSError as exc:  # a link (ELOOP), a file (ENOTDIR): not an entry the tier made
            raise _Refusal(Refused.unverified, f"entry: {exc.strerror}") from None
        try:
            self._record(entry, lora_name)  # an entry the tier completed
            record = self._vouched(lora_name)
            if record.base_model != self.config.base_model:
                raise _Refusal(Refused.other_base_model, f"record base {record.base_model[:120]!r}")
            copy = self._verified_copy(entry, lora_name, record)
        finally:
            os.close(entry)
        return Resolved(lora_name, copy, record)

    def _record(self, entry: int, lora_name: str) -> AdapterRecord:
        try:  # never a link, never blocking (a FIFO), never more than a record holds
            raw = read_regular(RECORD_FILE, MAX_RECORD_BYTES, follow_links=False, dir_fd=entry)
        except OSError as exc:
            raise _Refusal(Refused.unverified, f"{RECORD_FILE}: {exc.strerror}") from None
        record = entry_record(raw, lora_name)
        if isinstance(record, str):
            raise _Refusal(Refused.unverified, record)
        return record

    def _vouched(self, lora_name: str) -> AdapterRecord:
        """The record a signed release gives ``lora_name`` (loraplane/registry/vouch.py)."""
        found = vouched_record(lora_name, self._saved_views(), self._current_keyring(), now_utc())
        if isinstance(found, Unvouched):
            raise _Refusal(found.reason, found.detail)
        return found

    def _current_keyring(self) -> Keyring | None:
        if self._keyring is None:
            return None
        try:
            return self._keyring.current()
        except KeyringError as exc:
            log.error("lora resolver: keyring unreadable, refusing every name: %s", exc)
            return None

    def _saved_views(self) -> dict[str, AdapterView]:
        """The agent's saved views, parsed again only when the file changed; none when it is
        missing or unreadable (then every name is refused)."""
        try:
            fd = os.open(self.config.host_tier / VIEWS_FILE, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return {}
        try:
            st = os.fstat(fd)
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            with self._lock:
                if self._views is not None and self._views[0] == stamp:
                    return self._views[1]
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_VIEWS_BYTES:
                return {}
            with os.fdopen(os.dup(fd), "rb") as f:
                raw = f.read(MAX_VIEWS_BYTES + 1)
        finally:
            os.close(fd)
        try:
            views = views_from_json(raw)
        except ValueError as exc:
            log.error(
                "lora resolver: %s unreadable, refusing every name: %s", VIEWS_FILE, str(exc)[:200]
            )
            views = {}
        with self._lock:
            self._views = (stamp, views)
        return views

    def _verified_copy(self, entry: int, lora_name: str, record: AdapterRecord) -> Path:
        dest = self._snapshots() / resolver_copy_name(lora_name, uuid.uuid4().hex)
        dest.mkdir(mode=0o700)
        try:
            self._copy(entry, dest)
            verdict = verify_artifact(DirectoryArtifact(dest), self.limits, record)
        except _Refusal:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        except OSError as exc:
            shutil.rmtree(dest, ignore_errors=True)
            raise _Refusal(Refused.io_error, f"{type(exc).__name__}: {exc.strerror}") from None
        if not verdict.ok:
            shutil.rmtree(dest, ignore_errors=True)
            reasons = ",".join(r.value for r in verdict.reasons)
            if ArtifactReason.base_model_mismatch in verdict.reasons:
                raise _Refusal(Refused.other_base_model, reasons)
            if ArtifactReason.model_shape_unknown in verdict.reasons:
                raise _Refusal(Refused.model_shape_unknown, reasons)
            raise _Refusal(Refused.tampered, reasons)
        with self._lock:  # vLLM asks again only after an unload: the older copy is unused
            older, self._copies[lora_name] = self._copies.get(lora_name), dest
        if older is not None:
            shutil.rmtree(older, ignore_errors=True)
        return dest

    def _copy(self, entry: int, dest: Path) -> None:
        """The adapter folder's regular top-level files, each opened without following a
        link and copied up to its size when opened (one that grows meanwhile is
        ``tampered``); anything else stays behind, so the copy's verification misses it (a
        link in place of a pinned file is a ``file_missing``)."""
        try:
            folder = os.open(
                ADAPTER_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=entry
            )
        except OSError as exc:
            raise _Refusal(Refused.unverified, f"{ADAPTER_DIR}/: {exc.strerror}") from None
        try:
            total = 0
            names = sorted(os.listdir(folder))[:MAX_ENTRIES]
            for name in names:
                try:
                    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
                except OSError:
                    continue  # a link or a vanished file: not copied
                try:
                    st = os.fstat(src)
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    total += st.st_size
                    if total > self.limits.max_total_bytes:
                        raise _Refusal(
                            Refused.tampered, f"over {self.limits.max_total_bytes} bytes"
                        )
                    if not _copy_fd(src, dest / name, st.st_size):
                        raise _Refusal(Refused.tampered, f"{name[:120]} grew while copied")
                finally:
                    os.close(src)
        finally:
            os.close(folder)

    def _snapshots(self) -> Path:
        with self._lock:
            if self._snapshot_root is None:
                root = self.config.host_tier / RESOLVER_COPIES
                shutil.rmtree(root, ignore_errors=True)  # an earlier vLLM's: unused now
                root.mkdir(mode=0o700)
                atexit.register(shutil.rmtree, root, True)
                self._snapshot_root = root
            return self._snapshot_root


def _copy_fd(src: int, path: Path, size: int) -> bool:
    """Copy at most ``size`` bytes (the file's size when opened); False when the file holds
    more by then: it grew while copied (a file read to its end could fill the disk)."""
    out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(out, "wb") as sink:
        left = size
        while left > 0 and (chunk := os.read(src, min(_CHUNK, left))):
            sink.write(chunk)
            left -= len(chunk)
    return not os.read(src, 1)
