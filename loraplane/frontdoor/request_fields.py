"""What of a client's request body may reach vLLM: the front door's allowlist, caps and salts.

Pure code (no I/O): ``admit`` takes the parsed body of ``/v1/completions`` or
``/v1/chat/completions`` and the request class's ``RequestCaps`` and returns either the body
to forward (without ``model``, which the gateway sets) or the refusal (a ``RequestRefusal``
and the field it names). Only documented OpenAI fields whose cost is bounded here pass,
type-checked and capped; a few are dropped silently (``DROPPED``); anything else is refused
by name (``field_not_allowed``), since vLLM's extensions would let a tenant change the
shared engine's scheduling, KV transfer, templates or costs. ``header_token`` is the rule for
client header values copied into a request head, a hash or a log; ``cache_salt`` keeps
tenants' prefix-cache blocks apart; ``TokenBucket`` and ``TenantGate`` are the per-tenant
limits. docs/worker.md, "Request fields", has the table.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from loraplane.kernel.policy import RequestBudgets, RequestCaps, TenantLimits
from loraplane.schemas.reasons import RequestRefusal, TenantLimit
from loraplane.schemas.request_log import RequestClass

__all__ = [
    "ALLOWED",
    "BOUND_FIELDS",
    "DROPPED",
    "GREEDY_BELOW",
    "MAX_LOGIT_BIAS",
    "MAX_NAME_CHARS",
    "MESSAGE_KEYS",
    "MESSAGE_ROLES",
    "Admitted",
    "Endpoint",
    "Refused",
    "TenantGate",
    "TokenBucket",
    "admit",
    "cache_salt",
    "fit_context",
    "header_token",
    "request_caps",
]


class Endpoint(StrEnum):
    completions = "/v1/completions"
    chat_completions = "/v1/chat/completions"


DROPPED = frozenset({"user", "cache_salt", "request_id", "stream_options"})
"""Removed without an error: the gateway sets the last three itself."""

_COMMON = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "stop",
        "stream",
        "stream_options",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "logit_bias",
        "logprobs",
    }
)
ALLOWED: Mapping[Endpoint, frozenset[str]] = {
    Endpoint.completions: _COMMON | {"prompt", "best_of", "echo"},
    Endpoint.chat_completions: _COMMON | {"messages", "max_completion_tokens", "top_logprobs"},
}
BOUND_FIELDS = ("max_completion_tokens", "max_tokens")
"""The fields that bound a choice's output tokens, in the order vLLM reads them: the first
one given (not null) is the bound, the other is ignored (chat only has both)."""
MESSAGE_ROLES = frozenset({"system", "developer", "user", "assistant"})
MESSAGE_KEYS = frozenset({"role", "content", "name"})
MAX_LOGIT_BIAS = 300
MAX_NAME_CHARS = 64
GREEDY_BELOW = 1e-5
"""A temperature under this is greedy sampling for vLLM (its ``_SAMPLING_EPS``): one choice."""
_TOKEN = re.compile(r"[\x21-\x7e]{1,128}")


def header_token(value: str | None) -> str | None:
    """``value`` when it is 1 to 128 visible ASCII characters, else None: what of a client's
    header may be copied into a request head, hashed or logged. aiohttp hands other bytes
    over as surrogates, which no encoder takes; an empty or odd value counts as absent."""
    return value if value is not None and _TOKEN.fullmatch(value) else None


class Refused(Exception):
    """A body the gateway does not forward; ``field`` is the JSON name it is about."""

    def __init__(self, reason: RequestRefusal, field_name: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.field = field_name
        self.message = message

    @property
    def status(self) -> int:
        return 413 if self.reason == RequestRefusal.body_too_large else 400


@dataclass(frozen=True)
class Admitted:
    """A body to forward (``model`` removed) and what it may cost."""

    body: dict[str, Any]
    prompts: int  # prompts in the request: a list prompt counts each, a chat request is 1
    choices: int  # per prompt: max(n, best_of)
    max_tokens: int  # per choice
    stream: bool
    client_wants_usage: bool  # stream_options.include_usage as the client asked
    max_tokens_field: str | None = None  # the field the client bounded it with; None: default

    @property
    def max_output_tokens(self) -> int:
        return self.prompts * self.choices * self.max_tokens


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def _bad(name: str, what: str) -> Refused:
    return Refused(RequestRefusal.bad_field, name, f"{name} must be {what}")


def _int_in(
    body: Mapping[str, Any], name: str, low: int, cap: int, over: RequestRefusal
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < low:
        raise _bad(name, f"an integer >= {low}")
    if value > cap:
        raise Refused(over, name, f"{name} {value} is over this request class's cap {cap}")
    return int(value)


def _number(body: Mapping[str, Any], name: str, low: float, high: float) -> None:
    value = body.get(name)
    if value is not None and (not _is_number(value) or not low <= value <= high):
        raise _bad(name, f"a number in [{low}, {high}]")


def _bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(name, "true or false")
    return value


def _prompts(prompt: object) -> int:
    """How many prompts: a string or a list of token ids is one; a list of either, each.
    A lone empty string is no prompt (vLLM refuses it; inside a list it takes it)."""
    if isinstance(prompt, str) and prompt:
        return 1
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) and t >= 0 for t in prompt):
            return 1
        if all(isinstance(p, str) for p in prompt):
            return len(prompt)
        if all(isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p) for p in prompt):
            return len(prompt)
    raise _bad("prompt", "a string, a list of strings, token ids or lists of token ids")


def _messages(messages: object, caps: RequestCaps) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty list")
    if len(messages) > caps.max_messages:
        raise Refused(
            RequestRefusal.too_many_prompts,
            "messages",
            f"{len(messages)} messages are over the cap {caps.max_messages}",
        )
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(where, "an object")
        extra = sorted(set(message) - MESSAGE_KEYS)
        if extra:
            raise Refused(
                RequestRefusal.field_not_allowed,
                f"{where}.{extra[0]}",
                f"{where}.{extra[0]} is not allowed (only role, content, name)",
            )
        if message.get("role") not in MESSAGE_ROLES:
            raise _bad(f"{where}.role", f"one of {sorted(MESSAGE_ROLES)}")
        name = message.get("name")
        if name is not None and (not isinstance(name, str) or len(name) > MAX_NAME_CHARS):
            raise _bad(f"{where}.name", f"a string of at most {MAX_NAME_CHARS} characters")
        content = message.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise _bad(f"{where}.content", "a string or a list of text parts")
        for j, part in enumerate(content):  # text only: no URL for vLLM to fetch
            if (
                not isinstance(part, dict)
                or set(part) != {"type", "text"}
                or part["type"] != "text"
                or not isinstance(part["text"], str)
            ):
                raise Refused(
                    RequestRefusal.field_not_allowed,
                    f"{where}.content[{j}]",
                    f'{where}.content[{j}] must be {{"type": "text", "text": '
                    "...}: only text parts are allowed",
                )


def _stop(stop: object, caps: RequestCaps) -> None:
    if stop is None:
        return
    seqs = [stop] if isinstance(stop, str) else stop
    if not isinstance(seqs, list) or not all(isinstance(s, str) for s in seqs):
        raise _bad("stop", "a string or a list of strings")
    if len(seqs) > caps.max_stop:
        raise Refused(
            RequestRefusal.too_many_stop,
            "stop",
            f"{len(seqs)} stop sequences are over the cap {caps.max_stop}",
        )
    if not all(seqs):  # vLLM: "stop cannot contain an empty string"
        raise _bad("stop", "non-empty strings")
    if any(len(s) > caps.max_stop_chars for s in seqs):
        raise Refused(
            RequestRefusal.too_many_stop,
            "stop",
            f"a stop sequence is longer than {caps.max_stop_chars} characters",
        )


def _logit_bias(bias: object) -> None:
    if bias is None:
        return
    if (
        not isinstance(bias, dict)
        or len(bias) > MAX_LOGIT_BIAS
        or not all(isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 9 for k in bias)
        or not all(_is_number(v) and -100 <= v <= 100 for v in bias.values())
    ):
        raise _bad(
            "logit_bias",
            f"an object of at most {MAX_LOGIT_BIAS} token ids -> numbers in [-100, 100]",
        )


def _client_usage(options: object) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise _bad("stream_options", 'an object with only "include_usage"')
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise _bad("stream_options.include_usage", "true or false")
    return value


def admit(
    endpoint: Endpoint, body: Mapping[str, Any], caps: RequestCaps, body_bytes: int = 0
) -> Admitted:
    """The body to forward, or ``Refused`` naming the first field that is not safe."""
    if body_bytes > caps.max_body_bytes:
        raise Refused(
            RequestRefusal.body_too_large,
            "",
            f"the body is {body_bytes} bytes, over this request class's cap {caps.max_body_bytes}",
        )
    allowed = ALLOWED[endpoint]
    for name in body:
        if name not in allowed and name not in DROPPED:
            shown = str(name)[:64]
            raise Refused(
                RequestRefusal.field_not_allowed,
                shown,
                f"{shown} is not allowed on {endpoint.value}",
            )
    n = _int_in(body, "n", 1, caps.max_n, RequestRefusal.too_many_choices) or 1
    best_of = n
    if endpoint == Endpoint.completions:
        best_of = _int_in(body, "best_of", 1, caps.max_n, RequestRefusal.too_many_choices) or n
        if best_of < n:
            raise _bad("best_of", "at least n")
        if "prompt" not in body:
            raise _bad("prompt", "present")
        prompts = _prompts(body["prompt"])
        if prompts > caps.max_prompts:
            raise Refused(
                RequestRefusal.too_many_prompts,
                "prompt",
                f"{prompts} prompts are over this request class's cap {caps.max_prompts}",
            )
        _int_in(body, "logprobs", 0, caps.max_logprobs, RequestRefusal.logprobs_too_large)
        _bool(body, "echo")
    else:
        prompts = 1
        _messages(body.get("messages"), caps)
        _bool(body, "logprobs")
        _int_in(body, "top_logprobs", 0, caps.max_logprobs, RequestRefusal.logprobs_too_large)
    limits = {
        name: _int_in(body, name, 1, caps.max_tokens, RequestRefusal.max_tokens_too_large)
        for name in BOUND_FIELDS
    }
    # the bound vLLM applies: the first given of BOUND_FIELDS (chat's max_completion_tokens
    # over max_tokens), never a smaller one beside it that vLLM ignores
    given = [(name, value) for name, value in limits.items() if value is not None]
    bound_by: str | None = given[0][0] if given else None
    max_tokens = given[0][1] if given else caps.default_max_tokens
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0)
    # What vLLM refuses whatever the model (a 400 from vLLM is a 502 here, and the
    # adapter's error): top_p 0 and several choices of greedy sampling.
    if body.get("top_p") == 0:
        raise _bad("top_p", "a number in (0, 1]")
    temperature = body.get("temperature")
    if temperature is not None and temperature < GREEDY_BELOW and n > 1:
        raise _bad("n", f"1 when temperature is under {GREEDY_BELOW} (greedy sampling)")
    _number(body, "presence_penalty", -2.0, 2.0)
    _number(body, "frequency_penalty", -2.0, 2.0)
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**63):
        raise _bad("seed", "a 64-bit integer")
    _stop(body.get("stop"), caps)
    _logit_bias(body.get("logit_bias"))
    stream = _bool(body, "stream")
    wants_usage = _client_usage(body.get("stream_options"))
    out = {k: v for k, v in body.items() if k not in DROPPED and k != "model"}
    if not given:
        out["max_tokens"] = max_tokens
    return Admitted(out, prompts, best_of, max_tokens, stream, wants_usage and stream, bound_by)


def fit_context(request: Admitted, context_tokens: int | None) -> Admitted:
    """``request`` within the model's context (vLLM's ``max_model_len``; None: not known):
    vLLM refuses a request whose ``max_tokens`` is over it, and leaves the prompt room
    within it otherwise. A class default over it is lowered to it; a client's own bound
    over it is ``Refused`` (``max_tokens_too_large``, naming the context)."""
    if context_tokens is None or request.max_tokens <= context_tokens:
        return request
    name = request.max_tokens_field
    if name is not None:
        raise Refused(
            RequestRefusal.max_tokens_too_large,
            name,
            f"{name} {request.max_tokens} is over the model's context of {context_tokens} "
            "tokens (prompt and output together)",
        )
    body = {**request.body, "max_tokens": context_tokens}
    return replace(request, body=body, max_tokens=context_tokens)


def cache_salt(secret: bytes, tenant_id: str) -> str:
    """The tenant's prefix-cache salt: HMAC-SHA256(secret, tenant_id), hex. Without the
    secret no one can compute another tenant's salt."""
    return hmac.new(secret, tenant_id.encode(), hashlib.sha256).hexdigest()


@dataclass
class TokenBucket:
    """Tokens per minute with a burst size; a request is admitted while the bucket is not
    empty and charged what it used afterwards (so it may go below zero)."""

    rate_per_s: float
    size: float
    level: float
    at: float

    def _refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.size, self.level + (now - self.at) * self.rate_per_s)
            self.at = now

    def retry_after_s(self, now: float) -> float:
        """0 when a request may start now, else the seconds until the bucket is positive."""
        self._refill(now)
        if self.level > 0:
            return 0.0
        return (1.0 - self.level) / self.rate_per_s

    def charge(self, tokens: int, now: float) -> None:
        self._refill(now)
        self.level -= max(0, tokens)


@dataclass
class TenantGate:
    """Per-tenant requests in flight and token buckets of one gateway."""

    limits: TenantLimits
    clock: Callable[[], float]
    in_flight: dict[str, int] = field(default_factory=dict)
    buckets: dict[str, TokenBucket] = field(default_factory=dict)

    def _bucket(self, tenant: str, now: float) -> TokenBucket:
        bucket = self.buckets.get(tenant)
        if bucket is None:
            bucket = self.buckets[tenant] = TokenBucket(
                self.limits.tokens_per_minute / 60,
                self.limits.burst_tokens,
                self.limits.burst_tokens,
                now,
            )
        return bucket

    def enter(self, tenant: str) -> tuple[TenantLimit, int] | None:
        """None when the request may start (it is then in flight until ``leave``), else the
        limit hit and Retry-After in whole seconds."""
        now = self.clock()
        if self.in_flight.get(tenant, 0) >= self.limits.max_concurrent:
            return TenantLimit.tenant_concurrency, 1
        wait = self._bucket(tenant, now).retry_after_s(now)
        if wait > 0:
            return TenantLimit.tenant_token_rate, max(1, math.ceil(wait))
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1
        return None

    def leave(self, tenant: str, tokens: int) -> None:
        now = self.clock()
        left = self.in_flight.get(tenant, 0) - 1
        if left > 0:
            self.in_flight[tenant] = left
        else:
            self.in_flight.pop(tenant, None)
        self._bucket(tenant, now).charge(tokens, now)


def request_caps(budgets: RequestBudgets, request_class: RequestClass) -> RequestCaps:
    """The caps of a request class; shadow follows batch."""
    if request_class == RequestClass.interactive:
        return budgets.interactive.caps
    if request_class == RequestClass.canary:
        return budgets.canary.caps
    return budgets.batch.caps
