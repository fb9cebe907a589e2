"""The mypy configuration (pyproject.toml) agrees with the layer contract of test_layers.py.

The boundary schemas and every pure decision module are checked strictly, so a new decision
module is strict the day it is placed in the contract; only named third-party packages may be
imported unchecked, never our own code.
"""

from __future__ import annotations

import tomllib
from typing import Any

from tests.unit.test_layers import DECISIONS, ROOT, layer_of, source_files

STRICT_FLAGS = (
    "disallow_untyped_defs",
    "disallow_any_generics",
    "warn_return_any",
    "disallow_untyped_calls",
    "check_untyped_defs",
    "strict_equality",
)


def _mypy() -> dict[str, Any]:
    config: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["mypy"]


def _matches(module: str, pattern: str) -> bool:
    """mypy's override patterns: ``a.b.*`` is a.b and everything under it."""
    if pattern.endswith(".*"):
        package = pattern.removesuffix(".*")
        return module == package or module.startswith(package + ".")
    return module == pattern


def _overrides_with(flag: str) -> list[str]:
    patterns: list[str] = []
    for override in _mypy().get("overrides", []):
        if override.get(flag):
            module = override["module"]
            patterns += [module] if isinstance(module, str) else module
    return patterns


def _strict_overrides() -> list[dict[str, Any]]:
    return [o for o in _mypy().get("overrides", []) if o.get("disallow_untyped_defs")]


def test_strict_modules_are_the_schemas_and_the_pure_decisions() -> None:
    patterns = _overrides_with("disallow_untyped_defs")
    for module in source_files():
        wanted = module.startswith("loraplane.schemas") or layer_of(module) == DECISIONS
        strict = any(_matches(module, p) for p in patterns)
        assert strict == wanted, f"{module}: strict={strict}, layer contract says {wanted}"


def test_strict_override_sets_the_strict_flags() -> None:
    """`strict = true` in an override leaks to every module, so the flags are spelled out."""
    [override] = _strict_overrides()
    assert "strict" not in override
    assert all(override.get(flag) is True for flag in STRICT_FLAGS)
    assert override.get("implicit_reexport") is False


def test_only_third_party_imports_go_unchecked() -> None:
    assert not _mypy().get("ignore_missing_imports")
    unchecked = _overrides_with("ignore_missing_imports")
    assert unchecked
    assert not [p for p in unchecked if p == "loraplane" or p.startswith("loraplane.")]
