"""The vLLM driver against the FAKE vLLM (which follows the recorded real answers)."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from loraplane.schemas.reasons import VllmErrorCode
from loraplane.testing.fake_vllm import FakeVllm
from loraplane.tiny_model import build_adapter
from loraplane.workers.vllm_client import MAX_ANSWER_BYTES, VllmClient, VllmError, classify

session_loop = pytest.mark.asyncio(loop_scope="session")


def alien_adapter(folder: Path) -> Path:
    """A rank-8 adapter whose weights name a module the tiny Llama does not have."""
    build_adapter(folder, seed=5)
    header = json.dumps(
        {
            "base_model.model.model.layers.0.self_attn.w_proj.lora_A.weight": {
                "dtype": "F32",
                "shape": [8, 1],
                "data_offsets": [0, 32],
            }
        }
    ).encode()
    (folder / "adapter_model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + bytes(32)
    )
    return folder


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    made = {
        "a1": build_adapter(root / "a1", seed=1),
        "a2": build_adapter(root / "a2", seed=2),
        "r16": build_adapter(root / "r16", seed=3, rank=16),
    }
    corrupt = build_adapter(root / "corrupt", seed=4)
    (corrupt / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    alien = alien_adapter(root / "alien")
    no_config = root / "no_config"
    no_config.mkdir()
    made.update(corrupt=corrupt, alien=alien, no_config=no_config)
    return made


@pytest.fixture
async def client() -> AsyncIterator[VllmClient]:
    server = TestServer(FakeVllm("/models/tiny", api_key="k-1").app(), host="127.0.0.1")
    await server.start_server()
    vllm = VllmClient(str(server.make_url("/")), timeout_s=2, api_key="k-1")
    yield vllm
    await vllm.close()
    await server.close()


@session_loop
async def test_load_models_unload(client: VllmClient, adapters: dict[str, Path]) -> None:
    assert await client.load("a1@1-00000000", str(adapters["a1"])) >= 0
    models = await client.models()
    assert [(m.id, m.is_adapter) for m in models] == [
        ("/models/tiny", False),
        ("a1@1-00000000", True),
    ]
    assert models[1].root == str(adapters["a1"])
    await client.unload("a1@1-00000000")
    assert [m.id for m in await client.models()] == ["/models/tiny"]


@session_loop
async def test_errors_have_stable_reasons(client: VllmClient, adapters: dict[str, Path]) -> None:
    await client.load("x", str(adapters["a1"]))
    cases = [
        (client.load("x", str(adapters["a2"])), "already_loaded", 400),
        (client.unload("nope"), "not_found", 404),
        (client.load("y", str(adapters["no_config"])), "not_found", 404),
        (client.load("y", "/does/not/exist"), "not_found", 404),
        (client.load("y", str(adapters["r16"])), "rank_too_large", 500),
        (client.load("y", str(adapters["corrupt"])), "adapter_refused", 500),
        (client.load("y", str(adapters["alien"])), "adapter_refused", 500),
    ]
    for call, reason, status in cases:
        with pytest.raises(VllmError) as err:
            await call
        assert (err.value.reason, err.value.status) == (reason, status), err.value
        # what the loader refuses is refused again; a name taken or a folder gone is not
        assert err.value.reason.refuses_load is (status == 500), err.value
    await client.load("x", str(adapters["a2"]), inplace=True)  # replaced in place


@session_loop
async def test_completion_depends_on_adapter_bytes(
    client: VllmClient, adapters: dict[str, Path]
) -> None:
    await client.load("a1", str(adapters["a1"]))
    await client.load("a2", str(adapters["a2"]))
    texts = {}
    for model in ("/models/tiny", "a1", "a2"):
        async with client.completion(
            "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 5}
        ) as r:
            texts[model] = (await r.json())["choices"][0]["text"]
    assert len(set(texts.values())) == 3
    await client.unload("a1")
    with pytest.raises(VllmError) as err:
        async with client.completion("/v1/completions", {"model": "a1", "prompt": "hi"}):
            pass
    assert err.value.reason == "not_found" and "does not exist" in err.value.message


@session_loop
async def test_unreachable_and_timeout_fail_fast() -> None:
    dead = VllmClient("http://127.0.0.1:9", timeout_s=1)
    with pytest.raises(VllmError) as err:
        await dead.models()
    assert err.value.reason == "unreachable"
    await dead.close()

    async def slow(_: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response(text="late")

    app = web.Application()
    app.router.add_get("/v1/models", slow)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    hung = VllmClient(str(server.make_url("/")), timeout_s=0.3)
    with pytest.raises(VllmError) as err:
        await hung.models()
    assert err.value.reason == "timeout"
    await hung.close()
    await server.close()


def test_classify_plain_text_and_json() -> None:
    assert classify(400, '{"error": {"message": "bad"}}').message == "bad"
    assert classify(500, "LoRA rank 16 is greater than max_lora_rank 8").reason == "rank_too_large"
    assert classify(418, "teapot").reason == "unexpected_status"


def _vllm_error(message: str, err_type: str, status: int) -> str:
    return json.dumps({"error": {"message": message, "type": err_type, "code": status}})


@pytest.mark.parametrize(
    ("status", "message", "reason", "refused"),
    [
        # vLLM 0.32's engine wraps what its LoRA loader raised; the server answers a 500
        (
            500,
            "Call to add_lora method failed: LoRA rank 16 is greater than max_lora_rank 8.",
            "rank_too_large",
            True,
        ),
        (
            500,
            "Call to add_lora method failed: While loading /h/a, expected target modules in "
            "{'q_proj'} but received ['w_proj']. Please verify that the loaded LoRA module is "
            "correct",
            "adapter_refused",
            True,
        ),
        (
            500,
            "Call to add_lora method failed: Error while deserializing header: header too large",
            "adapter_refused",
            True,
        ),
        (
            500,
            "Call to add_lora method failed: vLLM does not yet support DoRA. Adapter bias is "
            "not supported.",
            "adapter_refused",
            True,
        ),
        (
            500,
            "Call to add_lora method failed: Worker failed with error 'Mapped LoRA weight "
            "name cannot be None.', please check the stack trace above for the root cause",
            "adapter_refused",
            True,
        ),
        # vLLM releases that answer any loader failure as a 400 BadRequestError
        (400, "lora_B is unsupported LoRA weight", "bad_request", True),
        (400, "The lora adapter 'tiny' conflicts with a served base model.", "bad_request", True),
        # the host's or the engine's trouble, a name taken, a folder gone: a retry may pass
        (
            500,
            "Call to add_lora method failed: CUDA out of memory. Tried to allocate 20.00 MiB",
            "server_error",
            False,
        ),
        (
            500,
            "Call to add_lora method failed: [enforce fail at alloc_cpu.cpp:118] "
            "DefaultCPUAllocator: can't allocate memory",
            "server_error",
            False,
        ),
        (500, "EngineCore encountered an issue. See stack trace (above)", "server_error", False),
        (500, "Server shutting down", "server_error", False),
        (503, "Service Unavailable", "server_error", False),
        (
            400,
            "The lora adapter 'a@1-00000000' has already been loaded. If you want to load "
            "the adapter in place, set 'load_inplace' to True.",
            "already_loaded",
            False,
        ),
        (
            404,
            "Loading lora a@1-00000000 failed: No adapter found for /h/a",
            "not_found",
            False,
        ),
        (401, "Unauthorized", "unexpected_status", False),
    ],
)
def test_a_load_vllm_refuses_for_the_adapters_own_bytes_is_told_apart(
    status: int, message: str, reason: str, refused: bool
) -> None:
    """Every refusal of a load was one ``fail`` the agent retried every backoff, forever,
    however vLLM answered. Which answers refuse the adapter itself (a retry of the same
    version is refused the same way) is decided here, once: ``refuses_load``."""
    err = classify(status, _vllm_error(message, "InternalServerError", status))
    assert (err.reason, err.reason.refuses_load) == (reason, refused)


def test_every_transport_trouble_is_retried() -> None:
    assert [c for c in VllmErrorCode if c.refuses_load] == [
        VllmErrorCode.bad_request,
        VllmErrorCode.rank_too_large,
        VllmErrorCode.adapter_refused,
    ]


def test_classify_an_answer_nested_past_the_recursion_limit() -> None:
    """json.loads raises RecursionError, not a JSONDecodeError, for deep nesting: it escaped
    ``classify`` (and the agent's load) instead of naming the status."""
    deep = "[" * 100_000 + "]" * 100_000
    err = classify(500, deep)
    assert err.reason == "server_error" and len(err.message) <= 500


@session_loop
async def test_the_api_key_guards_every_route_like_the_guarded_vllm(
    adapters: dict[str, Path],
) -> None:
    """The FAKE refuses every route without the key (401, vLLM's body) but the open probes
    (/health, /metrics), as the route guard of the vLLM a worker starts does; the client
    with the key loads, lists and completes, on both its HTTP paths (aiohttp and the
    upstream pool)."""
    server = TestServer(FakeVllm("/models/tiny", api_key="k-123").app(), host="127.0.0.1")
    await server.start_server()
    base = str(server.make_url("/"))
    keyed, keyless, wrong = (
        VllmClient(base, timeout_s=2, api_key=k) for k in ("k-123", None, "k-12")
    )
    try:
        for refused in (keyless, wrong):
            with pytest.raises(VllmError) as err:
                await refused.load("a1@1-00000000", str(adapters["a1"]))
            assert err.value.status == 401 and err.value.message == "Unauthorized"
            with pytest.raises(VllmError):
                await refused.models()
            assert await refused.health()
        async with keyless._http().get(base + "metrics") as resp:
            assert resp.status == 200
        for method, path in (
            ("POST", "adapters"),
            ("DELETE", "adapters/a1"),
            ("POST", "invocations"),
            ("POST", "tokenize"),
        ):
            async with keyless._http().request(method, base + path, json={}) as resp:
                assert resp.status == 401, (method, path)
            async with keyed._http().request(method, base + path, json={}) as resp:
                assert resp.status == 501, (method, path)  # served by vLLM, not by the fake
        await keyed.load("a1@1-00000000", str(adapters["a1"]))
        assert [m.id for m in await keyed.models()] == ["/models/tiny", "a1@1-00000000"]
        body = {"model": "a1@1-00000000", "prompt": "hi", "max_tokens": 2}
        async with keyed.completion("/v1/completions", body) as resp:
            assert resp.status == 200
        with pytest.raises(VllmError) as err:
            async with wrong.completion("/v1/completions", body):
                pass
        assert err.value.status == 401
    finally:
        for c in (keyed, keyless, wrong):
            await c.close()
        await server.close()


async def _hostile(handler: Any) -> tuple[TestServer, VllmClient]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server, VllmClient(str(server.make_url("/")), timeout_s=5)


@session_loop
@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("application/json", b'\xff\xfe{"data": []}'),  # not UTF-8
        ("text/plain; charset=hex", b"zz"),  # a codec that is no text encoding
        ("text/plain; charset=utf-16", b"\x00"),  # an odd byte count
    ],
)
async def test_an_undecodable_answer_is_a_vllm_error(content_type: str, body: bytes) -> None:
    """ATTACK: a body vLLM's charset cannot decode raised UnicodeDecodeError or LookupError
    out of every call, past the agent's ``except VllmError`` (its tick loop ended)."""

    async def answer(request: web.Request) -> web.Response:
        status = 500 if request.path == "/v1/unload_lora_adapter" else 200
        return web.Response(status=status, body=body, headers={"Content-Type": content_type})

    server, vllm = await _hostile(answer)
    try:
        with pytest.raises(VllmError) as err:
            await vllm.models()
        assert err.value.reason == "bad_response"
        assert await vllm.load("a@1-00000000", "/x") >= 0  # a 200 nobody reads is a 200
        with pytest.raises(VllmError) as err:
            await vllm.unload("a@1-00000000")
        assert err.value.reason == "server_error"
    finally:
        await vllm.close()
        await server.close()


@session_loop
async def test_an_answer_that_never_ends_is_refused_past_the_cap() -> None:
    """ATTACK: a chunked answer that never ends (or a 1 GB one) was read whole into memory
    until the total timeout; it ends as ``bad_response`` once it passes MAX_ANSWER_BYTES."""

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        chunk = b"x" * (1024 * 1024)
        while True:
            await resp.write(chunk)

    server, vllm = await _hostile(endless)
    try:
        with pytest.raises(VllmError) as err:
            await vllm.models()
        assert err.value.reason == "bad_response" and str(MAX_ANSWER_BYTES) in err.value.message
    finally:
        await vllm.close()
        await server.close()


@session_loop
@pytest.mark.parametrize(
    "answer",
    [
        {"data": {"id": "a"}},  # data is an object
        {"data": "abc"},
        {"data": [{"id": 5, "root": "/x", "parent": "/m"}]},  # id is a number
        {"data": [{"id": None, "root": "/x", "parent": "/m"}]},
        {"data": [{"id": ["a"], "root": "/x", "parent": "/m"}]},
        {"data": [{"id": "a", "root": {"p": 1}, "parent": "/m"}]},
        {"data": [{"id": "a", "root": "/x", "parent": 7}]},
        {"data": [["a"]]},
        [1, 2],
    ],
)
async def test_a_models_list_of_the_wrong_types_is_a_bad_response(answer: Any) -> None:
    """ATTACK: /v1/models whose entries are not the strings vLLM sends were taken as
    ``str()`` of anything: an id ``None`` became the adapter ``"None"``, a parent ``7`` an
    adapter. Any entry of the wrong type refuses the whole answer as ``bad_response``."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response(answer)

    server, vllm = await _hostile(models)
    try:
        with pytest.raises(VllmError) as err:
            await vllm.models()
        assert err.value.reason == "bad_response"
    finally:
        await vllm.close()
        await server.close()


@session_loop
async def test_a_redirect_is_an_unexpected_status_never_followed() -> None:
    """ATTACK: whatever answers on vLLM's port redirects (307) elsewhere. The client
    followed it: the load's POST (name and folder) went to another server, whose 200 and
    /v1/models were taken for vLLM's. A 3xx is now ``unexpected_status``, nothing follows."""
    seen: list[str] = []

    async def elsewhere(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.json_response({"data": []})

    other, unused = await _hostile(elsewhere)
    await unused.close()

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(str(other.make_url(request.path)))

    server, vllm = await _hostile(redirect)
    try:
        for call in (vllm.models(), vllm.load("a@1-00000000", "/x"), vllm.unload("a")):
            with pytest.raises(VllmError) as err:
                await call
            assert (err.value.reason, err.value.status) == ("unexpected_status", 307)
        assert not await vllm.health()
        assert seen == []
    finally:
        await vllm.close()
        await server.close()
        await other.close()
