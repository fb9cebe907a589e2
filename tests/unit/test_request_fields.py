"""The gateway's request allowlist, caps, salts and tenant limits (frontdoor/request_fields.py).

Properties over arbitrary JSON bodies: ``admit`` either refuses with a ``RequestRefusal`` or
forwards only allowlisted fields, never ``model``/``cache_salt``/``request_id``/``user``, and
never more output than the class's caps allow.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from loraplane.frontdoor.request_fields import (
    ALLOWED,
    DROPPED,
    Endpoint,
    Refused,
    TenantGate,
    TokenBucket,
    admit,
    cache_salt,
    fit_context,
    header_token,
)
from loraplane.kernel.policy import RequestCaps, TenantLimits
from loraplane.schemas.reasons import RequestRefusal, TenantLimit

CAPS = RequestCaps()
MESSAGES = [{"role": "user", "content": "q"}]
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)
FIELDS = sorted(
    set().union(*ALLOWED.values())
    | DROPPED
    | {
        "priority",
        "kv_transfer_params",
        "vllm_xargs",
        "ignore_eos",
        "min_tokens",
        "suffix",
        "prompt_logprobs",
        "guided_json",
        "tools",
        "response_format",
    }
)
bodies = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=10), json_values, max_size=10)


@settings(max_examples=400, deadline=None)
@given(endpoint=st.sampled_from(list(Endpoint)), body=bodies)
def test_admit_forwards_only_allowlisted_bounded_bodies(
    endpoint: Endpoint, body: dict[str, Any]
) -> None:
    try:
        ok = admit(endpoint, body, CAPS)
    except Refused as exc:
        assert isinstance(exc.reason, RequestRefusal) and exc.status in (400, 413)
        return
    assert set(ok.body) <= ALLOWED[endpoint] - DROPPED - {"model"}
    assert 1 <= ok.prompts <= CAPS.max_prompts and 1 <= ok.choices <= CAPS.max_n
    assert 1 <= ok.max_tokens <= CAPS.max_tokens
    assert ok.max_output_tokens <= CAPS.max_prompts * CAPS.max_n * CAPS.max_tokens
    assert "max_tokens" in ok.body or "max_completion_tokens" in ok.body


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"temperature": 10**400}, "temperature"),
        ({"top_p": -(10**400)}, "top_p"),
        ({"presence_penalty": 10**309}, "presence_penalty"),
        ({"logit_bias": {"1": 10**400}}, "logit_bias"),
        ({"logit_bias": {"\u0661\u0662": 1}}, "logit_bias"),  # Arabic-Indic digits: no token id
        ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),
    ],
)  # a superscript two is a digit to isdigit
def test_attack_huge_integers_and_non_ascii_digits_are_bad_fields(
    extra: dict[str, Any], param: str
) -> None:
    """A JSON integer too large for a float is refused, never an OverflowError (a 500)."""
    with pytest.raises(Refused) as refused:
        admit(Endpoint.completions, {"model": "m", "prompt": "q", **extra}, CAPS)
    assert (refused.value.reason, refused.value.field) == (RequestRefusal.bad_field, param)


@given(
    st.text(max_size=200)
    | st.binary(max_size=20).map(lambda b: b.decode("utf-8", "surrogateescape"))
)
def test_a_header_token_is_visible_ascii_and_can_always_be_encoded(value: str) -> None:
    token = header_token(value)
    if token is None:
        assert not value or len(value) > 128 or any(not "!" <= c <= "~" for c in value)
    else:
        assert token == value and token.encode("ascii") and 1 <= len(token) <= 128


@settings(max_examples=200, deadline=None)
@given(prompts=st.lists(st.text(max_size=5), min_size=1, max_size=40))
def test_a_list_prompt_counts_each(prompts: list[str]) -> None:
    body = {"model": "m", "prompt": prompts}
    if len(prompts) > CAPS.max_prompts:
        with pytest.raises(Refused) as err:
            admit(Endpoint.completions, body, CAPS)
        assert err.value.reason == RequestRefusal.too_many_prompts
    else:
        assert admit(Endpoint.completions, body, CAPS).prompts == len(prompts)


def test_token_id_prompts_and_field_names() -> None:
    assert admit(Endpoint.completions, {"prompt": [1, 2, 3]}, CAPS).prompts == 1
    assert admit(Endpoint.completions, {"prompt": [[1], [2]]}, CAPS).prompts == 2
    for body, field in (
        ({"prompt": "x", "priority": 1}, "priority"),
        ({"messages": [{"role": "user", "content": "x"}], "best_of": 2}, "best_of"),
    ):
        endpoint = Endpoint.completions if "prompt" in body else Endpoint.chat_completions
        with pytest.raises(Refused) as err:
            admit(endpoint, body, CAPS)
        assert (err.value.reason, err.value.field) == (RequestRefusal.field_not_allowed, field)
    with pytest.raises(Refused) as err:
        admit(Endpoint.completions, {"prompt": "x"}, CAPS, body_bytes=CAPS.max_body_bytes + 1)
    assert err.value.status == 413


def test_stream_usage_is_the_clients_choice_only_when_streaming() -> None:
    ask = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    assert admit(Endpoint.completions, ask, CAPS).client_wants_usage
    assert not admit(Endpoint.completions, {**ask, "stream": False}, CAPS).client_wants_usage
    with pytest.raises(Refused):
        admit(
            Endpoint.completions, {**ask, "stream_options": {"continuous_usage_stats": True}}, CAPS
        )


@given(a=st.text(min_size=1, max_size=20), b=st.text(min_size=1, max_size=20))
def test_cache_salts_are_per_tenant_and_per_secret(a: str, b: str) -> None:
    assert (cache_salt(b"k" * 32, a) == cache_salt(b"k" * 32, b)) == (a == b)
    assert cache_salt(b"k" * 32, a) != cache_salt(b"j" * 32, a)


def test_token_bucket_admits_while_positive_and_refills() -> None:
    bucket = TokenBucket(rate_per_s=1.0, size=5, level=5, at=0.0)
    assert bucket.retry_after_s(0.0) == 0
    bucket.charge(20, 0.0)  # charged after the fact: may go below zero
    assert bucket.retry_after_s(0.0) == pytest.approx(16)
    assert bucket.retry_after_s(16.5) == 0
    bucket.charge(0, 1000.0)
    assert bucket.level == 5  # never above its size


def test_tenant_gate_counts_in_flight_per_tenant() -> None:
    now = [0.0]
    gate = TenantGate(
        TenantLimits(max_concurrent=2, tokens_per_minute=60, burst_tokens=10), lambda: now[0]
    )
    assert gate.enter("a") is None and gate.enter("a") is None
    assert gate.enter("a") == (TenantLimit.tenant_concurrency, 1)
    assert gate.enter("b") is None  # another tenant is not affected
    gate.leave("a", 30)
    assert gate.enter("a") == (TenantLimit.tenant_token_rate, 21)
    now[0] = 21
    assert gate.enter("a") is None


def test_the_gateway_secret_is_made_private_and_a_readable_one_stops_the_start(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    from loraplane.frontdoor.hmac_keys import hmac_key

    path = tmp_path / "home" / "gateway-secret"
    with caplog.at_level("DEBUG"):
        secret = hmac_key(path)
    assert len(secret) >= 32 and path.stat().st_mode & 0o777 == 0o600
    assert hmac_key(path) == secret  # stable across restarts: the cache stays warm
    assert secret.decode() not in caplog.text and cache_salt(secret, "t") not in caplog.text
    path.chmod(0o644)  # ATTACK: a secret others can read lets them compute any salt
    with pytest.raises(SystemExit, match="readable by others"):
        hmac_key(path)
    path.chmod(0o600)
    path.write_bytes(b"short")
    with pytest.raises(SystemExit, match="at least 16 bytes"):
        hmac_key(path)


@pytest.mark.parametrize(
    "endpoint, body, field",
    [
        (Endpoint.completions, {"prompt": ""}, "prompt"),
        (Endpoint.completions, {"prompt": "q", "stop": [""]}, "stop"),
        (Endpoint.completions, {"prompt": "q", "stop": ""}, "stop"),
        (Endpoint.completions, {"prompt": "q", "top_p": 0}, "top_p"),
        (Endpoint.completions, {"prompt": "q", "top_p": 0.0}, "top_p"),
        (Endpoint.completions, {"prompt": "q", "temperature": 0, "n": 2}, "n"),
        (Endpoint.chat_completions, {"messages": MESSAGES, "temperature": 0.0, "n": 4}, "n"),
        (Endpoint.chat_completions, {"messages": MESSAGES, "stop": ["x", ""]}, "stop"),
    ],
)
def test_attack_what_vllm_refuses_for_any_model_is_the_doors_400(
    endpoint: Endpoint, body: dict[str, object], field: str
) -> None:
    """Each of these went through and came back from the real vLLM (0.32, tiny model) as a
    400 for any model: the door refuses them itself, naming the field, before they take a
    place in flight to vLLM."""
    with pytest.raises(Refused) as refused:
        admit(endpoint, {"model": "m", **body}, CAPS)
    assert (refused.value.reason, refused.value.field) == (RequestRefusal.bad_field, field)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": ["", "q"]},  # vLLM takes an empty string inside a list
        {"prompt": "q", "temperature": 0},
        {"prompt": "q", "temperature": 0, "best_of": 2},
        {"prompt": "q", "top_p": 1e-9},
        {"prompt": "q", "temperature": 0.5, "n": 2},
    ],
)
def test_what_vllm_takes_still_passes(body: dict[str, object]) -> None:
    admit(Endpoint.completions, {"model": "m", **body}, CAPS)


def vllm_bound(endpoint: Endpoint, body: dict[str, Any]) -> int | None:
    """A choice's output bound as vLLM 0.32 reads a body (``serving.py``'s
    ``get_max_tokens``): on chat ``max_completion_tokens`` when it is not null, else
    ``max_tokens``; a completion has only ``max_tokens``."""
    if endpoint == Endpoint.chat_completions and body.get("max_completion_tokens") is not None:
        return int(body["max_completion_tokens"])
    return body.get("max_tokens")


@given(
    endpoint=st.sampled_from(list(Endpoint)),
    bounds=st.dictionaries(
        st.sampled_from(["max_tokens", "max_completion_tokens"]),
        st.integers(1, CAPS.max_tokens),
        max_size=2,
    ),
    context=st.one_of(st.none(), st.integers(1, 2 * CAPS.max_tokens)),
)
@example(
    endpoint=Endpoint.chat_completions,
    bounds={"max_tokens": 1, "max_completion_tokens": 300},
    context=256,
)  # vLLM ignores the smaller max_tokens beside max_completion_tokens
def test_fit_context_never_sends_more_than_the_context(
    endpoint: Endpoint, bounds: dict[str, int], context: int | None
) -> None:
    """What is forwarded never asks vLLM for more than the model's context (which vLLM
    refuses), read as vLLM reads it; a client's own bound past it is refused by the field
    that set it, a class default past it is lowered to it, and nothing else changes."""
    if endpoint == Endpoint.completions:
        bounds.pop("max_completion_tokens", None)
        body: dict[str, Any] = {"model": "m", "prompt": "q", **bounds}
    else:
        body = {"model": "m", "messages": MESSAGES, **bounds}
    admitted = admit(endpoint, body, CAPS)
    assert admitted.max_tokens == (vllm_bound(endpoint, body) or CAPS.default_max_tokens)
    try:
        fitted = fit_context(admitted, context)
    except Refused as exc:
        assert exc.reason == RequestRefusal.max_tokens_too_large
        assert context is not None and bounds[exc.field] == admitted.max_tokens > context
        assert bounds[exc.field] == vllm_bound(endpoint, body)
        return
    sent = vllm_bound(endpoint, fitted.body)
    assert sent is not None and (context is None or sent <= context)
    if context is None or admitted.max_tokens <= context:
        assert fitted == admitted
        return
    assert not bounds and fitted.max_tokens == fitted.body["max_tokens"] == context
    assert {k: v for k, v in fitted.body.items() if k != "max_tokens"} == {
        k: v for k, v in admitted.body.items() if k != "max_tokens"
    }
