"""The adapters a run publishes, and their folders: a tiny local base model plus PEFT LoRA
adapters built on this machine (no hub), reused across runs.

Folders are content-stable: adapter ``(seed, rank)`` always has the same bytes, so the same
artifact, digest and LoRA name across runs, and an existing folder is reused as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraplane.artifact.model_shape import MAX_MODEL_CONFIG_BYTES
from loraplane.kernel.local_files import read_json
from loraplane.tiny_model import TINY_BASE_MODEL, build_adapter, build_model

__all__ = ["BASE_MODEL", "DEMO_CATALOG", "Adapter", "Artifacts", "Catalog"]

BASE_MODEL = TINY_BASE_MODEL


@dataclass(frozen=True)
class Adapter:
    """One adapter of a run: who owns it, its priority and the versions it publishes."""

    adapter_id: str
    tenant_id: str
    priority: str  # bronze | silver | gold | platinum
    seed: int
    canary_seed: int | None = None  # a second version, published as a canary
    canary_percent: float = 10.0


@dataclass(frozen=True)
class Catalog:
    adapters: tuple[Adapter, ...]

    @property
    def ids(self) -> list[str]:
        return [a.adapter_id for a in self.adapters]

    @property
    def tenants(self) -> list[str]:
        return sorted({a.tenant_id for a in self.adapters})

    def with_priority(self, priority: str) -> list[Adapter]:
        return [a for a in self.adapters if a.priority == priority]

    @property
    def canaries(self) -> list[Adapter]:
        return [a for a in self.adapters if a.canary_seed is not None]


DEMO_CATALOG = Catalog(
    (
        # most popular first: the trace mapping gives adapter i a power-law share
        Adapter("support-en", "acme", "gold", seed=11),
        Adapter("support-de", "acme", "gold", seed=12, canary_seed=112),
        Adapter("contracts", "globex", "platinum", seed=13),
        Adapter("code-review", "initech", "gold", seed=14),
        Adapter("summarize", "globex", "silver", seed=15),
        Adapter("translate-fr", "initech", "silver", seed=16),
        Adapter("sql-helper", "acme", "bronze", seed=17),
        Adapter("poetry", "umbrella", "bronze", seed=18),
    )
)
"""What ``loraplane demo`` publishes: gold ones, one platinum, one canary at 10%."""


@dataclass(frozen=True)
class Artifacts:
    """Where the base model and the adapter folders are."""

    root: Path

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    def adapter_dir(self, seed: int) -> Path:
        return self.root / "adapters" / f"seed-{seed}"

    def ensure_model(self) -> bool:
        """Build the tiny base model unless it is there; True when it was built now."""
        if (self.model_dir / "config.json").is_file() and (
            self.model_dir / "model.safetensors"
        ).is_file():
            return False
        build_model(self.model_dir)
        return True

    def ensure_adapter(self, seed: int) -> bool:
        """Build adapter ``seed`` unless it is there; True when it was built now."""
        folder = self.adapter_dir(seed)
        if (folder / "adapter_model.safetensors").is_file():
            return False
        config = read_json(self.model_dir / "config.json", MAX_MODEL_CONFIG_BYTES)
        build_adapter(folder, seed=seed, base_model_name=BASE_MODEL, model_config=config)
        return True

    def ensure(self, catalog: Catalog) -> int:
        """Model and every adapter folder of ``catalog``; returns how many were built."""
        built = int(self.ensure_model())
        for adapter in catalog.adapters:
            for seed in (adapter.seed, adapter.canary_seed):
                if seed is not None:
                    built += self.ensure_adapter(seed)
        return built
