"""Every public module of the package says what it exports: ``__all__`` lists every name it
defines for others (classes, functions, constants; none starting with ``_``), and what it
re-exports on purpose, so
``from loraplane.x import *``, the docs' API references and mypy's explicit re-export rule
agree on one list, and a new public name cannot be added without being listed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("loraplane", "schemas", "streams", "workers", "infra", "dashboards")
NOT_EXPORTED = {"log", "logger"}  # a module's logger is its own


def modules() -> list[Path]:
    return sorted(
        p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py") if not p.name.startswith("_")
    )


def defined(tree: ast.Module) -> list[str]:
    """The public names a module defines at its top level."""
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return [n for n in names if not n.startswith("_") and n not in NOT_EXPORTED]


def imported(tree: ast.Module) -> set[str]:
    """Names a module imports: it may list one of them to re-export it on purpose."""
    return {
        (a.asname or a.name).split(".")[0]
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        for a in node.names
    }


def exported(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            value = node.value
            assert isinstance(value, ast.List | ast.Tuple), "__all__ must be a literal list"
            return [e.value for e in value.elts if isinstance(e, ast.Constant)]
    return None


def test_the_scan_covers_the_package() -> None:
    assert len(modules()) > 150


@pytest.mark.parametrize("path", modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_public_module_lists_what_it_defines(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    listed = exported(tree)
    assert listed is not None, "no __all__: list the module's public names"
    mine = set(defined(tree))
    assert len(listed) == len(set(listed)), "a name listed twice"
    assert mine <= set(listed), f"defined but not listed: {sorted(mine - set(listed))}"
    unknown = set(listed) - mine - imported(tree)
    assert not unknown, f"listed but neither defined nor imported here: {sorted(unknown)}"
