"""vLLM's end of loraplane: the host-tier LoRA resolver and the route guard.

Only vLLM's Python imports this module (nothing in loraplane does: the worker's venv has no
vLLM). ``register``, the ``vllm.general_plugins`` entry point, runs in every vLLM process; it
registers a ``LoRAResolver`` whose decision is ``workers/vllm_resolver.py`` when the
environment names a host tier, and nothing otherwise. ``RouteGuard`` is vLLM's
``--middleware``: the key check of ``workers/vllm_guard.py`` on every route. Installed with
loraplane (pyproject's entry point) or, for the ``.venv-vllm`` of a checkout, made
importable by ``workers/vllm_process.py`` (a generated ``PYTHONPATH`` folder); in that case
the pyproject package-dir mapping is applied here.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

__all__ = ["RouteGuard", "register"]

log = logging.getLogger("loraplane.vllm_plugin")


class RouteGuard:
    """``--middleware loraplane.vllm_plugin.RouteGuard``: vLLM builds it around its app (a
    class, as vLLM requires); the guard gets the key vLLM itself reads, ``VLLM_API_KEY``."""

    def __new__(cls, app: Any) -> Any:
        _map_package_dirs()
        from loraplane.workers.vllm_guard import RouteGuard as Guard

        key = os.environ.get("VLLM_API_KEY") or None
        if key is None:
            log.warning("loraplane route guard: no VLLM_API_KEY, only the open probes are served")
        return Guard(app, key)


def register() -> None:
    _map_package_dirs()
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry

    from loraplane.workers.vllm_resolver import PLUGIN_NAME, HostTierResolver, ResolverConfig

    config = ResolverConfig.from_env(os.environ)
    if config is None:
        log.warning("loraplane resolver plugin loaded without a host tier: it resolves nothing")
        return
    decide = HostTierResolver(config)
    _log_to_stderr()

    class HostTierLoRAResolver(LoRAResolver):
        async def resolve_lora(self, base_model_name: str, lora_name: str) -> Any:
            found = await asyncio.to_thread(decide.resolve, base_model_name, lora_name)
            if found is None:
                return None
            # vLLM replaces lora_int_id with its own counter
            return LoRARequest(lora_name=found.lora_name, lora_int_id=1, lora_path=str(found.path))

    LoRAResolverRegistry.register_resolver(PLUGIN_NAME, HostTierLoRAResolver())


def _log_to_stderr() -> None:
    """vLLM configures only its own loggers: without a handler, every resolve and refusal
    would be lost from vLLM's log (the operator's record of what was refused)."""
    from loraplane.kernel.log_lines import OneLineFormatter

    ours = logging.getLogger("loraplane")
    if not ours.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(OneLineFormatter("%(levelname)s %(asctime)s %(name)s %(message)s"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)


def _map_package_dirs() -> None:
    """A checkout's ``loraplane.workers`` lives in ``workers/``: map pyproject's package-dir
    table the way an install does, once, when the subpackages are not importable yet."""
    if importlib.util.find_spec("loraplane.workers") is not None:
        return
    root = Path(__file__).resolve().parents[1]
    table = tomllib.loads((root / "pyproject.toml").read_text())
    for package, folder in table["tool"]["setuptools"]["package-dir"].items():
        if package == "loraplane" or package in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(
            package, root / folder / "__init__.py", submodule_search_locations=[str(root / folder)]
        )
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        sys.modules[package] = module
        spec.loader.exec_module(module)
