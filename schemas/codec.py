"""Bytes <-> models at the Kafka boundary, with the project's own error for anything bad.

Consumers call ``decode`` and turn a ``SchemaError`` into a dead letter; nothing else may
escape from hostile bytes.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError

from loraplane.schemas.reasons import DecodeReason
from loraplane.schemas.validation_text import field_errors

__all__ = ["MAX_MESSAGE_BYTES", "M", "SchemaError", "decode", "decode_signed", "encode"]

MAX_MESSAGE_BYTES = 1024 * 1024

M = TypeVar("M", bound=BaseModel)


class SchemaError(ValueError):
    """Bytes that are not a valid message. ``reason`` is a stable code, ``errors`` are
    ``(field path, message)`` pairs for people."""

    def __init__(self, reason: DecodeReason, errors: list[tuple[str, str]]) -> None:
        self.reason = reason
        self.errors = errors
        super().__init__(f"{reason}: " + "; ".join(f"{loc}: {msg}" for loc, msg in errors))


def decode(model: type[M], raw: bytes | str | None) -> M:
    if raw is None:
        raise SchemaError(DecodeReason.malformed, [("(root)", "empty message")])
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if len(raw) > MAX_MESSAGE_BYTES:
        raise SchemaError(
            DecodeReason.too_large, [("(root)", f"{len(raw)} bytes > {MAX_MESSAGE_BYTES}")]
        )
    try:
        # One pass in pydantic-core (JSON parse + validation): ~25% cheaper per message than
        # json.loads + model_validate, on every consumer's hot path.
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors()
        if any(e["type"] == "json_invalid" for e in errors):
            raise SchemaError(
                DecodeReason.malformed, [("(root)", f"not JSON: {errors[0]['msg']}")]
            ) from None
        if len(errors) == 1 and errors[0]["type"] == "model_type" and not errors[0]["loc"]:
            raise SchemaError(
                DecodeReason.malformed, [("(root)", "expected a JSON object")]
            ) from None
        raise SchemaError(DecodeReason.invalid, field_errors(exc)) from None
    except (ValueError, TypeError, RecursionError) as exc:
        raise SchemaError(DecodeReason.invalid, [("(root)", str(exc))]) from None


def decode_signed(model: type[M], raw: bytes | str | None) -> M:
    """``decode`` for bytes whose signature is checked: the strict JSON pre-pass
    (``schemas.strict_json``: bounded size and depth, no duplicate key, no NaN, no lone
    surrogate, no BOM, one value) and then pydantic's strict mode (no coercion: ``"123"``,
    ``true`` or ``5.0`` is not an integer, a string is not a number or a timestamp number).
    """
    from loraplane.schemas.strict_json import StrictJsonError, strict_loads

    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    try:
        value = strict_loads(raw, max_bytes=MAX_MESSAGE_BYTES)
    except StrictJsonError as exc:
        raise SchemaError(exc.reason, [("(root)", str(exc))]) from None
    if not isinstance(value, dict):
        raise SchemaError(DecodeReason.malformed, [("(root)", "expected a JSON object")])
    assert raw is not None  # strict_loads refuses None
    try:
        message = model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        raise SchemaError(DecodeReason.invalid, field_errors(exc)) from None
    except (ValueError, TypeError, RecursionError) as exc:
        raise SchemaError(DecodeReason.invalid, [("(root)", str(exc))]) from None
    problem = _type_drift(value, message.model_dump(mode="json"), "")
    if problem:
        raise SchemaError(DecodeReason.invalid, [problem])
    return message


def _json_kind(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "integer" if isinstance(value, int) else "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null"


def _type_drift(wire: object, model: object, path: str) -> tuple[str, str] | None:
    """Where a wire value's JSON type differs from the validated model's own (pydantic's
    strict mode still takes ``true`` or ``1.0`` for ``Literal[1]``). An integer is fine
    where the model writes a number (``10`` for ``10.0``); nothing else is."""
    wk, mk = _json_kind(wire), _json_kind(model)
    if wk != mk and not (wk == "integer" and mk == "number"):
        return (path or "(root)", f"JSON {wk} where the schema has a {mk}")
    if isinstance(wire, dict) and isinstance(model, dict):
        for key, item in wire.items():
            if key in model:
                found = _type_drift(item, model[key], f"{path}.{key}" if path else key)
                if found:
                    return found
    elif isinstance(wire, list) and isinstance(model, list):
        for n, (item, dumped) in enumerate(zip(wire, model, strict=False)):
            found = _type_drift(item, dumped, f"{path}.{n}")
            if found:
                return found
    return None


def encode(message: BaseModel) -> bytes:
    return message.model_dump_json().encode("utf-8")
