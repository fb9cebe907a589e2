"""Every pattern that checks an input is matched in full (source audit, AST: no import runs).

In Python's ``re``, ``$`` also matches before a final newline, and ``match`` anchors only the
start: ``re.compile(r"^[a-z]+$").match("support-en\\n")`` matches. pydantic-core runs its
``pattern=`` constraints with Rust's regex, where ``$`` is the end of the text (checked below
on the shared id types), so the same ``^...$`` pattern is exact in a pydantic model and loose
in Python code. The product therefore applies a compiled pattern with ``fullmatch`` (or scans
with ``finditer``/``sub``/``findall``), never with ``match``, and ``re.search`` only with
patterns that have no ``$``; no model switches pydantic to Python's engine.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from loraplane.schemas.base import (
    ID_PATTERN,
    SHA256_PATTERN,
    VERSION_PATTERN,
    Identifier,
    Sha256,
    StrictModel,
    Version,
    is_id,
)
from tests.unit.test_layers import FOLDERS, ROOT

CONTROL = [chr(c) for c in (*range(0x20), 0x7F, 0x85, 0x2028, 0x2029)]


def _sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def _regex_names(trees: dict[Path, ast.Module]) -> dict[str, str | None]:
    """Every name (module constant or attribute) bound to ``re.compile(...)`` anywhere, with
    its pattern when that is a literal (None: built from other names)."""
    names: dict[str, str | None] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and _is_re_call(node.value, "compile")
                and node.value.args
            ):
                pattern = _constant(node.value.args[0])
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        names[target.id] = pattern
                    elif isinstance(target, ast.Attribute):
                        names[target.attr] = pattern
    return names


def _is_re_call(call: ast.Call, name: str) -> bool:
    func = call.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr == name
        and isinstance(func.value, ast.Name)
        and func.value.id == "re"
    )


def _constant(node: ast.expr) -> str | None:
    """A literal pattern (of text or bytes), or the literal parts of an f-string one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Constant) and isinstance(node.value, bytes):
        return node.value.decode("latin-1")
    if isinstance(node, ast.JoinedStr):
        return "".join(
            v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)
        )
    return None


def _dollar(pattern: str | None) -> bool:
    """Whether a pattern may hold an unescaped ``$`` (an unknown pattern may)."""
    return pattern is None or re.search(r"(?<!\\)\$", pattern) is not None


def _loose_uses(path: Path, tree: ast.Module, regexes: dict[str, str | None]) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        func, where = node.func, f"{path.relative_to(ROOT)}:{node.lineno}"
        receiver = func.value
        receiver_name = (
            receiver.id
            if isinstance(receiver, ast.Name)
            else receiver.attr
            if isinstance(receiver, ast.Attribute)
            else None
        )
        if func.attr == "match" and (receiver_name == "re" or receiver_name in regexes):
            found.append(f"{where}: .match (use fullmatch)")
        elif func.attr == "search" and receiver_name in regexes and _dollar(regexes[receiver_name]):
            found.append(f"{where}: .search of a pattern with $ (use fullmatch)")
        elif _is_re_call(node, "search") and node.args and _dollar(_constant(node.args[0])):
            found.append(f"{where}: re.search with $ (use fullmatch)")
    return found


def test_no_input_pattern_is_applied_with_match_or_a_loose_dollar() -> None:
    trees = {p: ast.parse(p.read_text(), str(p)) for p in _sources()}
    regexes = _regex_names(trees)
    loose = [hit for path, tree in trees.items() for hit in _loose_uses(path, tree, regexes)]
    assert not loose, "\n".join(loose)


def test_no_model_runs_its_patterns_on_pythons_engine() -> None:
    """``regex_engine="python-re"`` would make every ``pattern=`` a ``re.search``."""
    users = [str(p.relative_to(ROOT)) for p in _sources() if "regex_engine" in p.read_text()]
    assert not users, users


class _Ids(StrictModel):
    id: Identifier | None = None
    version: Version | None = None
    sha: Sha256 | None = None


@pytest.mark.parametrize(
    "field, good, pattern",
    [
        ("id", "support-en", ID_PATTERN),
        ("version", "1.2", VERSION_PATTERN),
        ("sha", "a" * 64, SHA256_PATTERN),
    ],
)
@given(control=st.sampled_from(CONTROL), at=st.sampled_from(["end", "start", "middle"]))
def test_pydantic_patterns_refuse_control_characters_anywhere(
    field: str, good: str, pattern: str, control: str, at: str
) -> None:
    bad = {"end": good + control, "start": control + good, "middle": good[:1] + control + good[1:]}[
        at
    ]
    _Ids.model_validate({field: good})
    with pytest.raises(ValidationError):
        _Ids.model_validate({field: bad})
    assert re.compile(pattern).fullmatch(bad) is None
    if field == "id":
        assert not is_id(bad) and is_id(good)
