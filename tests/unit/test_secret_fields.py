"""No secret is held where a repr, a log line or an error message could show it (source
audit, AST): a dataclass field named for a secret (API keys, passwords, gateway / router
secrets, private keys) is ``field(repr=False)``, a pydantic one is ``SecretStr``. Checked
on every dataclass and model of the product, so a new one cannot forget it."""

from __future__ import annotations

import ast
import re

from tests.unit.test_layers import FOLDERS, ROOT

SECRET_NAME = re.compile(r"(.*_)?(secret|password|api_key|private_key)(_.*)?")
NOT_SECRET = re.compile(r".*(_file|_path|_dir|_id|_digest)")


def _decorated_dataclass(node: ast.ClassDef) -> bool:
    return any(
        (isinstance(d, ast.Name) and d.id == "dataclass")
        or (isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "dataclass")
        for d in node.decorator_list
    )


def _hidden(value: ast.expr | None, annotation: ast.expr) -> bool:
    if "SecretStr" in ast.unparse(annotation):
        return True
    return (
        isinstance(value, ast.Call)
        and ast.unparse(value.func) in ("field", "Field")
        and any(
            k.arg == "repr" and isinstance(k.value, ast.Constant) and k.value.value is False
            for k in value.keywords
        )
    )


def test_secret_fields_never_reach_a_repr() -> None:
    shown = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ClassDef):
                    continue
                model = any(
                    ast.unparse(b).endswith(("BaseModel", "StrictModel", "_Strict", "BaseSettings"))
                    for b in node.bases
                )
                if not (model or _decorated_dataclass(node)):
                    continue
                for item in node.body:
                    if (
                        isinstance(item, ast.AnnAssign)
                        and isinstance(item.target, ast.Name)
                        and SECRET_NAME.fullmatch(item.target.id)
                        and not NOT_SECRET.fullmatch(item.target.id)
                        and not _hidden(item.value, item.annotation)
                    ):
                        shown.append(
                            f"{path.relative_to(ROOT)}:{item.lineno} {node.name}.{item.target.id}"
                        )
    assert not shown, "\n".join(shown)
