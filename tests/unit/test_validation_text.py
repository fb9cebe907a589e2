"""A pydantic ``ValidationError`` reaches people as one line with each field's place and why:
never the input (a secret beside a setting, a hostile value) nor pydantic's URLs, and the CLI
commands that print one do so through ``error_line``."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, Field, ValidationError
from typer.testing import CliRunner

from loraplane.cli import app
from loraplane.schemas.validation_text import MAX_LINE_CHARS, error_line, field_errors


class _Form(BaseModel):
    name: str = Field(pattern=r"[a-z]+")
    count: int = Field(ge=0, le=10)
    tags: list[str] = Field(min_length=1)


def _refusal(data: object) -> ValidationError:
    with pytest.raises(ValidationError) as caught:
        _Form.model_validate(data)
    return caught.value


@given(
    name=st.text(max_size=200),
    count=st.one_of(st.integers(), st.text(max_size=50)),
    tags=st.lists(st.text(max_size=50), max_size=3),
)
def test_one_bounded_line_without_the_input_or_urls(
    name: str, count: object, tags: list[str]
) -> None:
    secret = "s3cr3t-VALUE-" + name
    try:
        _Form.model_validate({"name": secret, "count": count, "tags": tags})
    except ValidationError as exc:
        line = error_line(exc)
        assert "\n" not in line and "\r" not in line
        assert len(line) <= MAX_LINE_CHARS
        assert "errors.pydantic.dev" not in line
        assert secret not in line
        assert all(loc in line for loc, _ in field_errors(exc))


def test_places_and_reasons_are_kept() -> None:
    exc = _refusal({"name": "ok", "count": 99, "tags": []})
    assert field_errors(exc) == [
        ("count", "Input should be less than or equal to 10"),
        ("tags", "List should have at least 1 item after validation, not 0"),
    ]
    assert error_line(exc) == (
        "count: Input should be less than or equal to 10; "
        "tags: List should have at least 1 item after validation, not 0"
    )


def test_other_errors_fold_their_lines() -> None:
    assert error_line(ValueError("first\nsecond\r\nthird")) == "first second third"
    assert error_line(ValueError("")) == "ValueError"


def test_keys_generate_names_the_missing_scope_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAPLANE_HOME", str(tmp_path / "home"))
    out = CliRunner().invoke(
        app,
        [
            "keys",
            "generate",
            "--publisher",
            "ci",
            "--scope",
            "tenant:acme",
            "--out",
            str(tmp_path / "ci.key"),
        ],
    )
    assert out.exit_code == 1
    lines = out.output.strip().splitlines()
    assert len(lines) == 1, out.output
    assert lines[0].startswith("error: actions: ")
    assert "pydantic" not in out.output
    assert not (tmp_path / "ci.key").exists()
